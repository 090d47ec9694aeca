#!/bin/bash
# A/B on one VM: 2e89b10 (the morning's code) against HEAD, alternated, two rounds
source /tmp/nixl.exports
cd /work/main
for round in 1 2; do
  for who in base head; do
    bin=/tmp/kvferry-$who
    echo "== $who round $round $(date -u +%T)"
    $bin bench --profiles "100mbit-20ms" --sizes-mib 256 --no-baselines --no-decisions --out /tmp/ab/$who-$round-a 2>&1 | grep -E "fetch  "
    $bin bench --profiles "1gbit-50ms" --sizes-mib 256,1024 --no-baselines --no-decisions --out /tmp/ab/$who-$round-b 2>&1 | grep -E "fetch  "
  done
done
