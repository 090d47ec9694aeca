#!/bin/bash
# The lossy profile under the loss-tolerant controller and under quinn's BBR, alternated, with
# the connection window of 451673a (4 x BDP); then the lossless profiles once (CUBIC), to see
# that the larger window changes nothing there. Run from the repository root after
#   cargo build --release -p kvferry --features nixl && cargo build --release -p kvferry-baselines --bins
#   source deploy/install-nixl.sh
set -u
OUT=${OUT:-/tmp/lossy-ab}
mkdir -p $OUT
K=${KVFERRY:-target/release/kvferry}
for round in 1 2; do
  for cc in tolerant bbr; do
    base=""; [ $round = 2 ] && base="--no-baselines"
    $K bench --profiles 1gbit-50ms-loss0.1 --sizes-mib 256,1024,2048 --no-decisions $base \
      --congestion $cc --out $OUT/$cc-$round > $OUT/$cc-$round.log 2>&1
    grep -E "fetch |baseline|kvferry" $OUT/$cc-$round.log | sed "s/^/$cc round $round: /"
  done
done
$K bench --profiles "100mbit-20ms;1gbit-50ms;1gbit-150ms" --sizes-mib 256,1024 --no-decisions \
  --no-baselines --out $OUT/lossless > $OUT/lossless.log 2>&1
grep -E "fetch |== profile" $OUT/lossless.log | sed "s/^/lossless: /"
