#!/usr/bin/env bash
# Cost per job against streams and partitions: push at each of RATES jobs/s on 3
# brokers (RF 3, fsync), on a cluster of 3 partitions with 8 streams of one type
# ("base"), and on one of PARTITIONS partitions with STREAMS streams over TYPES
# types ("scale"), each stream under a worker name of its own so the gateway cannot
# merge them: every broker holds STREAMS registrations. Each arm on a fresh cluster,
# the arms' order alternating by round. The servers' CPU covers the whole row,
# the opening of the streams included.
#   bash benchmarks/scale.sh
#   STREAMS=10000 TYPES=50 PARTITIONS=12 RATES="1000 5000" ROUNDS=2 bash benchmarks/scale.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
STREAMS=${STREAMS:-10000}; TYPES=${TYPES:-50}; PARTITIONS=${PARTITIONS:-12}
RATES=${RATES:-"1000 5000"}; ROUNDS=${ROUNDS:-2}
cargo build --release -p courier-cli -p courier-bench
BIN=target/release
WORK=$(mktemp -d)
PIDS=()
stop() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; PIDS=(); }
trap 'stop; rm -rf "$WORK"' EXIT
source benchmarks/cluster.sh

arm() { # base|scale round
  local dir="$WORK/$1-$2" label args row r
  mkdir -p "$dir"
  if [[ $1 == base ]]; then
    start_cluster "$BIN/courier" "$dir" 3
    label="3 partitions, 8 streams of 1 type"; args=(--workers 8)
  else
    start_cluster "$BIN/courier" "$dir" "$PARTITIONS"
    label="$PARTITIONS partitions, $STREAMS streams over $TYPES types"
    args=(--workers "$STREAMS" --types "$TYPES" --distinct-workers)
  fi
  for r in $RATES; do
    row=$(with_cpu "${PIDS[*]}" "$BIN/courier-bench" e2e --address "$ADDR" --label "$label" \
      --mode push --rate "$r" --duration 10 --warmup 2 "${args[@]}")
    echo "$row $(cpu_per_k "$row") |"
  done
  stop
}

echo "| topology | scenario | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms | jobs/s | errors | server CPU (cores) | CPU ms per 1,000 jobs |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
for round in $(seq 1 "$ROUNDS"); do
  arms=(base scale); ((round % 2)) || arms=(scale base)
  for a in "${arms[@]}"; do arm "$a" "$round"; done
done
