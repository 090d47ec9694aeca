#!/bin/bash
# per-thread CPU and context switches of both daemons over a window of a transfer
PROFILE=${1:-100mbit-20ms}; MIB=${2:-256}; SECS=${3:-10}; OUT=${4:-/tmp/prof/t}
rm -rf $OUT; mkdir -p $OUT
${KVFERRY:-target/release/kvferry} bench --profiles $PROFILE --sizes-mib $MIB --no-decisions --no-baselines --out $OUT/run > $OUT/bench.log 2>&1 &
B=$!
for i in $(seq 1 120); do n=$(pgrep -f "daemon --config /tmp/kvferry-bench" | wc -l); [ "$n" -ge 2 ] && break; sleep 1; done
sleep 1
PIDS=($(pgrep -f "region-a/kvferry.toml") $(pgrep -f "region-b/kvferry.toml"))
snap() { for p in "${PIDS[@]}"; do for t in /proc/$p/task/*; do
  echo "$p $(basename $t) $(cat $t/comm) $(awk '{print $14+$15}' $t/stat) $(awk '/voluntary_ctxt_switches/{s+=$2} END{print s}' $t/status)"; done; done; }
# wait for the transfer: the target's receive thread appears busy; use source CPU rising
prev=0
for i in $(seq 1 300); do t=$(awk '{print $14+$15}' /proc/${PIDS[0]}/stat); d=$((t-prev)); prev=$t; [ $i -gt 2 ] && [ $d -gt 5 ] && break; sleep 1; done
sleep 2
snap > $OUT/s0; sleep $SECS; snap > $OUT/s1
wait $B
grep -E "fetch " $OUT/bench.log
python3 - $OUT $SECS <<'PY'
import sys,collections
out,secs=sys.argv[1],float(sys.argv[2])
def load(f):
    d={}
    for l in open(f):
        p,t,c,cpu,cs=l.split(); d[(p,t)]=(c,int(cpu),int(cs))
    return d
a,b=load(out+'/s0'),load(out+'/s1')
agg=collections.defaultdict(lambda:[0,0,0])
for k,(c,cpu,cs) in b.items():
    c0,cpu0,cs0=a.get(k,(c,0,0))
    g=agg[(k[0],c)]; g[0]+=cpu-cpu0; g[1]+=cs-cs0; g[2]+=1
for (p,c),(cpu,cs,n) in sorted(agg.items()):
    if cpu or cs: print(f"{p} {c:20s} threads {n:3d} cpu {cpu/100/secs*100:5.1f}% ctxsw/s {cs/secs:8.0f}")
PY
