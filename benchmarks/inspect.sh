#!/usr/bin/env bash
# The job path while operators read: push latency at 1,000 jobs/s on 3 brokers
# (RF 3, fsync) with and without ListJobs + JobStats calls beside it, over a backlog
# of waiting jobs that every JobStats counts and ListJobs pages through. The arms
# alternate on the same cluster, so a slow spell of this machine falls on both.
#   bash benchmarks/inspect.sh
#   BACKLOG=300000 READS=20 ROUNDS=4 bash benchmarks/inspect.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
BACKLOG=${BACKLOG:-100000}; READS=${READS:-10}; ROUNDS=${ROUNDS:-3}
cargo build --release -p courier-cli -p courier-bench
BIN=target/release
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT
source benchmarks/cluster.sh
start_cluster "$BIN/courier" "$WORK"
"$BIN/courier" job create waiting --count "$BACKLOG" --address "$ADDR" >/dev/null

echo "Backlog: $BACKLOG waiting jobs over 3 partitions; reads: $READS ListJobs (1,000 a page) and $READS JobStats a second."
echo
echo "| round | reads | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms | jobs/s | errors |"
echo "|---|---|---:|---:|---:|---:|---:|---:|---:|"
for round in $(seq 1 "$ROUNDS"); do
  arms=(none reads); ((round % 2)) || arms=(reads none)
  for arm in "${arms[@]}"; do
    extra=(); [[ $arm == reads ]] && extra=(--inspect-per-sec "$READS")
    row=$("$BIN/courier-bench" e2e --address "$ADDR" --label "$round" --mode push --workers 8 \
      --rate 1000 --duration 10 --warmup 2 "${extra[@]}" 2>"$WORK/reads.txt")
    echo "$row" | awk -F'|' -v arm="$arm" 'BEGIN{OFS="|"} {print "", $2, " " arm " ", $4, $5, $6, $7, $8, $9, $10, ""}'
    [[ $arm == reads ]] && sed 's/^/    /' "$WORK/reads.txt" >&2
  done
done
