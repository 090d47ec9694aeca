#!/bin/bash
# A/B of the emulator's offloads: interleaved, same binary, host otherwise idle.
bin=/work/target-rel/release/kvferry
for rep in 1 2 3; do
  for v in off gro0 gro50 gro100; do
    case $v in off) f="--wan-no-offloads";; gro0) f="--wan-gro-hold-us 0";; gro50) f="--wan-gro-hold-us 50";; gro100) f="--wan-gro-hold-us 100";; esac
    $bin bench --profiles "1gbit-50ms;1gbit-150ms" --sizes-mib 256 --no-decisions --no-baselines $f --out ab/$v-$rep > ab/$v-$rep.log 2>&1
    echo "$v rep$rep: $(grep '^| 256.0' ab/$v-$rep/report.md | awk -F'|' '{printf "%s%% cpu %s ; ", $5, $10}')"
  done
done
