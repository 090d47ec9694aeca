#!/bin/bash
# perf + per-thread wake-ups of both daemons in the steady state of a 1 GiB fetch at 100mbit-20ms,
# after a 64 MiB fetch. Run from the repository root after a release build with --features nixl;
# then `python3 threads.py $OUT` and, per side, `perf script --no-inline -i $OUT/source.data -F
# tid,ip,sym | python3 ../cpu-profile-2026-12-06/cat.py 15 GIB` (GIB: what crossed in the 15 s).
set -u
OUT=${OUT:-/tmp/prof100}
source /tmp/nixl.exports
rm -rf "$OUT"; mkdir -p "$OUT"
./target/release/kvferry bench --profiles 100mbit-20ms --sizes-mib 64,1024 --no-decisions --no-baselines \
  --out "$OUT/run" > "$OUT/bench.log" 2>&1 &
B=$!
until grep -q "fetch    64 MiB" "$OUT/bench.log"; do sleep 1; kill -0 $B || exit 1; done
SRC=$(pgrep -f "region-a/kvferry.toml"); TGT=$(pgrep -f "region-b/kvferry.toml")
echo "source $SRC target $TGT"
echo $SRC > "$OUT/source.pid"
sleep 30
snap() { for p in $SRC $TGT; do for t in /proc/$p/task/*; do
  echo "$p $(basename $t) $(cat $t/comm | tr ' ' _) $(awk '{print $14+$15}' $t/stat) $(grep -E '^(voluntary|nonvoluntary)_ctxt' $t/status | awk '{print $2}' | tr '\n' ' ')"; done; done; }
snap > "$OUT/snap0"; date +%s.%N > "$OUT/t0"
perf record -F 499 --call-graph dwarf,8192 -p $SRC -o "$OUT/source.data" -- sleep 15 > /dev/null 2>&1 &
perf record -F 499 --call-graph dwarf,8192 -p $TGT -o "$OUT/target.data" -- sleep 15 > /dev/null 2>&1 &
wait %2 %3 2>/dev/null
snap > "$OUT/snap1"; date +%s.%N > "$OUT/t1"
wait $B
grep -E "fetch |ceilings" "$OUT/bench.log"
