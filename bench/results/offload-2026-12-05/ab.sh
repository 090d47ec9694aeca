#!/bin/bash
# variants: old-w2 (old binary, auto=2 workers), new-w2, new-w1
source /tmp/nixl.exports
for round in 1 2; do
 for v in ${VARIANTS:-old-w2 new-w1 new-w2}; do
  unset KVFERRY_RUNTIME_WORKER_THREADS
  BIN=/work/main/target/release/kvferry; [ ${v%-*} = old ] && BIN=/tmp/kvferry-old
  [ ${v#*-} = w1 ] && export KVFERRY_RUNTIME_WORKER_THREADS=1
  $BIN bench --profiles "${PROFILES:-1gbit-50ms}" --sizes-mib ${SIZES:-256,1024} --no-decisions --no-baselines --out /tmp/ab-$v-$round > /tmp/ab-$v-$round.log 2>&1
  grep "fetch " /tmp/ab-$v-$round.log | sed "s/^/$v $round /" | cut -c1-170
 done
done
