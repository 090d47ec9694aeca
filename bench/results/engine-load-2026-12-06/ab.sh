cd /work/main
source /tmp/nixl.exports
for r in 1 2; do
for v in oldload new; do
  /tmp/kvferry-$v bench --profiles 1gbit-50ms --sizes-mib 256,2048 --no-baselines --no-decisions --out /tmp/ab/$v-$r > /tmp/ab/$v-$r.log 2>&1
  echo "$v-$r $(date +%T)" >> /tmp/ab/progress
done
done
echo ALLDONE >> /tmp/ab/progress
