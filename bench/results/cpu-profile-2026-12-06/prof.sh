#!/bin/bash
# perf both daemons in the steady state of a 2 GiB fetch at 1gbit-50ms, after a 256 MiB fetch
# warmed their buffer free lists (as in a full bench, where 64 MiB-1 GiB fetches come first).
# Run from the repository root after a release build with --features nixl.
set -u
OUT=${OUT:-/tmp/prof}
source /tmp/nixl.exports
rm -rf "$OUT"; mkdir -p "$OUT"
./target/release/kvferry bench --profiles 1gbit-50ms --sizes-mib 256,2048 --no-decisions --no-baselines \
  --out "$OUT/run" > "$OUT/bench.log" 2>&1 &
B=$!
until grep -q "fetch   256 MiB" "$OUT/bench.log"; do sleep 1; kill -0 $B || exit 1; done
SRC=$(pgrep -f "region-a/kvferry.toml"); TGT=$(pgrep -f "region-b/kvferry.toml")
echo "source $SRC target $TGT"
# the 2 GiB fetch starts once the source engine has filled its pool: the source daemon's CPU rises
prev=$(awk '{print $14+$15}' /proc/$SRC/stat)
for i in $(seq 1 300); do
  sleep 1; t=$(awk '{print $14+$15}' /proc/$SRC/stat); d=$((t-prev)); prev=$t
  [ $d -gt 20 ] && break
done
sleep 2
echo "profiling from $(date +%T)"
perf record -F 499 --call-graph dwarf,8192 -p $SRC -o "$OUT/source.data" -- sleep 10 > /dev/null 2>&1 &
perf record -F 499 --call-graph dwarf,8192 -p $TGT -o "$OUT/target.data" -- sleep 10 > /dev/null 2>&1 &
wait %2 %3 2>/dev/null
wait $B
grep -E "fetch |ceilings" "$OUT/bench.log"
