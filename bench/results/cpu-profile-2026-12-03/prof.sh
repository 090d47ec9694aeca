#!/bin/bash
# perf both daemons during a 2 GiB fetch at 1gbit-50ms (CUBIC)
export $(cat /tmp/nixl.vars | xargs)
rm -rf /tmp/prof; mkdir -p /tmp/prof
/work/target-rel/release/kvferry bench --profiles 1gbit-50ms --sizes-mib 2048 --no-decisions --no-baselines --out /tmp/prof/run > /tmp/prof/bench.log 2>&1 &
B=$!
# wait for the fill to finish: the engines' CPU drops; watch for the daemons' first sizable CPU
for i in $(seq 1 120); do
  n=$(pgrep -f "daemon --config /tmp/kvferry-bench" | wc -l)
  [ "$n" -ge 2 ] && break; sleep 1
done
sleep 1
PIDS=($(pgrep -f "region-a/kvferry.toml") $(pgrep -f "region-b/kvferry.toml"))
echo "daemons ${PIDS[*]}"
# the source daemon is region-a (first started)
for p in "${PIDS[@]}"; do tr '\0' ' ' < /proc/$p/cmdline; echo; done
# wait until the target engine's fill is done: poll the source daemon CPU rising
prev=0
for i in $(seq 1 200); do
  t=$(awk '{print $14+$15}' /proc/${PIDS[0]}/stat)
  d=$((t-prev)); prev=$t
  [ $i -gt 2 ] && [ $d -gt 20 ] && break
  sleep 1
done
echo "transfer running at $(date +%T)"
perf record -F 1999 -g -p ${PIDS[0]} -o /tmp/prof/p0.data -- sleep 12 > /dev/null 2>&1 &
perf record -F 1999 -g -p ${PIDS[1]} -o /tmp/prof/p1.data -- sleep 12 > /dev/null 2>&1 &
wait %2 %3 2>/dev/null
wait $B
grep -E "fetch |ceilings" /tmp/prof/bench.log
