#!/bin/bash
# A/B over four profiles, 256 MiB and 1 GiB: the build before this session (36ed5fe) and HEAD, alternated.
OUT=${OUT:-/tmp/prof/ab2}; mkdir -p $OUT
for who in before after; do
  if [ $who = before ]; then B=${KVFERRY_BEFORE:?build of 36ed5fe}; else B=${KVFERRY:-target/release/kvferry}; fi
  echo "== $who"
  $B bench --profiles "100mbit-20ms;1gbit-50ms;1gbit-150ms;1gbit-50ms-loss0.1" --sizes-mib 256,1024 --no-decisions --no-baselines --out $OUT/$who 2>&1 | grep -E "^== profile|fetch "
done
