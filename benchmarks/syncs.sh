#!/usr/bin/env bash
# Where the commit time goes with both durabilities on this machine: a push row at
# RATE jobs/s (default 1,000) on a fresh 3-broker cluster in each mode, then, per
# broker, the fdatasyncs a second, the appends each covered, a sync's mean time and
# the mean commit time, read from the brokers' own metrics before and after the row.
#   bash benchmarks/syncs.sh            RATE=5000 bash benchmarks/syncs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
cargo build -q --release -p courier-cli -p courier-bench
source benchmarks/cluster.sh
scratch
RATE=${RATE:-1000}
ROWS=""
DURATION=10

# The sum of a metric's samples (a histogram's _count or _sum over every label).
metric() { curl -s "http://$1/metrics" | awk -v n="$2" '$1 == n || index($1, n "{") == 1 {s += $2} END {printf "%.6f", s}'; }
snapshot() { # metrics-address -> "syncs sync_secs appends commits commit_secs"
  echo "$(metric "$1" courier_broker_log_fsync_seconds_count) $(metric "$1" courier_broker_log_fsync_seconds_sum)" \
    "$(metric "$1" courier_broker_log_fsync_appends_sum) $(metric "$1" courier_broker_commit_seconds_count)" \
    "$(metric "$1" courier_broker_commit_seconds_sum)"
}

echo "| durability | broker | fdatasyncs/s | appends per sync | sync mean ms | commit mean ms |"
echo "|---|---|---:|---:|---:|---:|"
for mode in fsync replicated; do
  rm -rf "$WORK/data"
  DURABILITY=$mode start_cluster target/release/courier "$WORK/data"
  declare -A before=()
  for m in ${BMETRICS//,/ }; do before[$m]=$(snapshot "$m"); done
  target/release/courier-bench e2e --address "$ADDR" --mode push --workers 8 \
    --rate "$RATE" --duration "$DURATION" --warmup 2 >"$WORK/row.txt"
  i=0
  for m in ${BMETRICS//,/ }; do
    i=$((i + 1))
    awk -v mode="$mode" -v b="$i" -v d=$((DURATION + 2)) -v x="${before[$m]}" -v y="$(snapshot "$m")" 'BEGIN {
      split(x, p); split(y, q); s = q[1] - p[1]; t = q[2] - p[2]; a = q[3] - p[3]; c = q[4] - p[4]; u = q[5] - p[5]
      printf "| %s | %d | %.0f | %.2f | %.3f | %.3f |\n", mode, b, s / d,
        (s > 0 ? a / s : 0), (s > 0 ? t / s * 1000 : 0), (c > 0 ? u / c * 1000 : 0) }'
  done
  ROWS+="$mode: $(cat "$WORK/row.txt")"$'\n'
  stop_all
done
echo
echo "The push rows (p50, p90, p99, p99.9, max ms, jobs/s, errors):"
printf '%s' "$ROWS"
