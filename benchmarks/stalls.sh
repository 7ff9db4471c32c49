#!/usr/bin/env bash
# Push rows one after another on one fresh 3-broker cluster, each followed by what
# the brokers' storage did meanwhile: a row's latency beside the jobs its brokers
# handed out by back-fill (jobs that found every worker's credit in use), the fjall
# journal each broker writes now, and the tables on disk. A row with a long tail
# beside a journal change or new tables shows a storage stall and its backlog.
#   bash benchmarks/stalls.sh      ROWS=8 RATE=5000 CREDIT=32 DURABILITY=fsync
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
cargo build -q --release -p courier-cli -p courier-bench
source benchmarks/cluster.sh
scratch
ROWS=${ROWS:-8}
RATE=${RATE:-5000}
CREDIT=${CREDIT:-32}

backfilled() { # the three brokers' back-filled jobs so far
  local s=0 v
  for m in ${BMETRICS//,/ }; do
    v=$(curl -s "http://$m/metrics" | awk '$1 == "courier_broker_backfilled_jobs_total" {print $2}')
    s=$((s + ${v:-0}))
  done
  echo "$s"
}
journals() { # each broker's newest journal number
  for b in "$WORK"/data/b*/; do
    find "$b" -name '*.jnl' -printf '%f\n' | sed 's/\.jnl$//' | sort -n | tail -1
  done | paste -sd/ -
}
tables() { # files under each broker's tables folders
  for b in "$WORK"/data/b*/; do find "$b" -path '*tables*' -type f | wc -l; done | paste -sd/ -
}

DURABILITY=${DURABILITY:-fsync} start_cluster target/release/courier "$WORK/data"
echo "| row | p50 ms | p90 ms | p99 ms | max ms | jobs back-filled | journal (per broker) | tables (per broker) |"
echo "|---|---:|---:|---:|---:|---:|---|---|"
before=$(backfilled)
for row in $(seq 1 "$ROWS"); do
  r=$(target/release/courier-bench e2e --address "$ADDR" --mode push --workers 8 \
    --rate "$RATE" --credit "$CREDIT" --duration 10 --warmup 1 | tail -1)
  now=$(backfilled)
  echo "$r" | awk -F'|' -v row="$row" -v bf=$((now - before)) -v j="$(journals)" -v t="$(tables)" \
    '{gsub(/ /, ""); printf "| %s | %s | %s | %s | %s | %d | %s | %s |\n", row, $4, $5, $6, $8, bf, j, t}'
  before=$now
done
