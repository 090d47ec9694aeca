cd /work/main
source /tmp/nixl.exports
for r in 1 2; do
for v in new nozero; do
  /tmp/kvferry-$v bench --profiles 1gbit-50ms --sizes-mib 1024,2048 --no-baselines --no-decisions --out /tmp/ab2/$v-$r > /tmp/ab2/$v-$r.log 2>&1
  echo "$v-$r $(date +%T)" >> /tmp/ab2/progress
done
done
echo ALLDONE >> /tmp/ab2/progress
