source /tmp/nixl.exports
cd /work/main
for i in 1 2; do
for cc in cubic tolerant; do
  echo "=== $cc run $i"
  ./target/release/kvferry bench --profiles "1gbit-50ms;1gbit-150ms" --sizes-mib 16,64,256,1024,2048 --no-decisions --no-baselines --congestion $cc --out /tmp/cc-$cc-$i 2>&1 | grep "fetch \|== profile" | sed -E 's/, first layer.*tgt ([0-9.]+).*queue drops ([0-9]+).*/ tgt \1 drops \2/'
  ./target/release/kvferry bench --profiles "100mbit-20ms" --sizes-mib 16,64,256 --no-decisions --no-baselines --congestion $cc --out /tmp/cc100-$cc-$i 2>&1 | grep "fetch \|== profile" | sed -E 's/, first layer.*CPU s.GiB src ([0-9.]+) tgt ([0-9.]+).*queue drops ([0-9]+).*/ src \1 tgt \2 drops \3/'
done; done
echo DONE
