#!/bin/bash
# perf both daemons during a fetch: $1 profile, $2 MiB, $3 perf seconds, $4 out dir
PROFILE=${1:-100mbit-20ms}; MIB=${2:-256}; SECS=${3:-12}; OUT=${4:-/tmp/prof/out}
rm -rf $OUT; mkdir -p $OUT
${KVFERRY:-target/release/kvferry} bench --profiles $PROFILE --sizes-mib $MIB --no-decisions --no-baselines --out $OUT/run > $OUT/bench.log 2>&1 &
B=$!
for i in $(seq 1 120); do
  n=$(pgrep -f "daemon --config /tmp/kvferry-bench" | wc -l)
  [ "$n" -ge 2 ] && break; sleep 1
done
sleep 1
PIDS=($(pgrep -f "region-a/kvferry.toml") $(pgrep -f "region-b/kvferry.toml"))
echo "daemons ${PIDS[*]}"
prev=0
for i in $(seq 1 300); do
  t=$(awk '{print $14+$15}' /proc/${PIDS[0]}/stat)
  d=$((t-prev)); prev=$t
  [ $i -gt 2 ] && [ $d -gt 5 ] && break
  sleep 1
done
sleep 3; echo "transfer running at $(date +%T)"
perf record -F 1999 -g -p ${PIDS[0]} -o $OUT/p0.data -- sleep $SECS > /dev/null 2>&1 &
perf record -F 1999 -g -p ${PIDS[1]} -o $OUT/p1.data -- sleep $SECS > /dev/null 2>&1 &
wait %2 %3 2>/dev/null
wait $B
grep -E "fetch |ceilings|MiB" $OUT/bench.log | head
