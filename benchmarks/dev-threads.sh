#!/usr/bin/env bash
# `courier dev` on one runtime worker thread (its default) against two (one per CPU
# on this 2-core machine), in alternating rounds with the same binary, so that a slow
# spell of this shared machine falls on both arms alike. Each round starts a fresh
# dev per arm and measures push and poll, one job at a time and at 1,000 jobs/s.
#   ROUNDS=5 bash benchmarks/dev-threads.sh     (about 90 s a round)
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
cargo build --release -p courier-cli -p courier-bench
BIN=$PWD/target/release
WORK=$(mktemp -d)
PID=
cleanup() { if [[ -n $PID ]]; then kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; fi; rm -rf "$WORK"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

echo "| round | worker threads | push unloaded p50 | poll unloaded p50 | push p99 at 1000/s | poll p99 at 1000/s |"
echo "|---|---|---|---|---|---|"
for round in $(seq 1 "${ROUNDS:-4}"); do
  for arm in 1 2; do
    addr="127.0.0.1:$(free_port)"
    threads=(--worker-threads "$arm")
    rm -rf "$WORK/data"
    "$BIN/courier" dev --data-dir "$WORK/data" --gateway-addr "$addr" --metrics-addr off "${threads[@]}" >"$WORK/dev.log" 2>&1 &
    PID=$!
    for _ in $(seq 1 100); do
      if "$BIN/courier" status --address "$addr" --retry-budget 0s 2>/dev/null | grep -q PARTITION \
        && ! "$BIN/courier" status --address "$addr" --retry-budget 0s | grep -q "no leader"; then break; fi
      sleep 0.1
    done
    e2e() { "$BIN/courier-bench" e2e --address "$addr" --label "$arm" --warmup 1 "$@"; }
    # A row's columns: | label | scenario | p50 | p90 | p99 | ...
    p50() { awk -F'|' '{gsub(/ /, "", $4); print $4}'; }
    p99() { awk -F'|' '{gsub(/ /, "", $6); print $6}'; }
    push=$(e2e --mode push --duration 8 | p50)
    poll=$(e2e --mode poll --duration 8 | p50)
    push_r=$(e2e --mode push --workers 8 --rate 1000 --duration 10 | p99)
    poll_r=$(e2e --mode poll --workers 8 --rate 1000 --duration 10 | p99)
    echo "| $round | $arm | $push | $poll | $push_r | $poll_r |"
    kill -INT "$PID"; wait "$PID" || true; PID=
  done
done
