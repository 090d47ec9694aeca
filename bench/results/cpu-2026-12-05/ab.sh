#!/bin/bash
# A/B: the build before (36ed5fe) and after, alternated, same host, same commands.
OUT=/tmp/prof/ab; mkdir -p $OUT
for round in 1 2; do
  for who in before after; do
    if [ $who = before ]; then B=${KVFERRY_BEFORE:?build of 36ed5fe}; else B=${KVFERRY:-target/release/kvferry}; fi
    echo "== round $round: $who"
    $B bench --profiles "100mbit-20ms;1gbit-50ms;1gbit-150ms" --sizes-mib 256 --no-decisions --no-baselines --out $OUT/$who-$round 2>&1 | grep "fetch "
  done
done
