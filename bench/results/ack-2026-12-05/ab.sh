#!/bin/bash
# A/B of the QUIC ACK frequency (KVFERRY_TRANSFER_ACK_ELICITING_THRESHOLD, inherited by the
# bench's daemons), alternated, same build, same host: 100 Mbit/s x 20 ms at 256 MiB and
# 1 Gbit/s x 50 ms at 1 GiB, transfers only.
B=${KVFERRY:-target/release/kvferry}
OUT=${OUT:-/tmp/ack}; mkdir -p $OUT
for round in 1 2; do
  for t in ${THRESHOLDS:-16 32 64}; do
    echo "== round $round: threshold $t"
    KVFERRY_TRANSFER_ACK_ELICITING_THRESHOLD=$t $B bench --profiles "100mbit-20ms" --sizes-mib 256 --no-decisions --no-baselines --out $OUT/t$t-100m-$round 2>&1 | grep "fetch "
    KVFERRY_TRANSFER_ACK_ELICITING_THRESHOLD=$t $B bench --profiles "1gbit-50ms" --sizes-mib 1024 --no-decisions --no-baselines --out $OUT/t$t-1g-$round 2>&1 | grep "fetch "
  done
done
