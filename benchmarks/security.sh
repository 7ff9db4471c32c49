#!/usr/bin/env bash
# What security costs on 3 brokers (RF 3, fsync): a plain cluster against one with
# mutual TLS between brokers and gateway, TLS on the client port and a static token
# checked on every request, in alternating rounds with the same binary, so a slow
# spell of this shared machine falls on both arms alike. Each round starts a fresh
# cluster per arm and measures the create acknowledgement and the create-to-handler
# latency of a pushed job, one job at a time, and the push p99 at 1,000 jobs/s.
#   ROUNDS=4 bash benchmarks/security.sh     (about 70 s a round)
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
cargo build --release -p courier-cli -p courier-bench
BIN=$PWD/target/release
WORK=$(mktemp -d)
PIDS=()
stop_all() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; PIDS=(); }
cleanup() { stop_all; rm -rf "$WORK"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

"$BIN/courier" cert ca --out "$WORK/certs" 2>/dev/null
"$BIN/courier" cert issue node --ca "$WORK/certs" --out "$WORK/certs" 2>/dev/null
TOKEN=bench-token-0123456789
echo "{\"tokens\": [{\"name\": \"bench\", \"token\": \"$TOKEN\"}]}" > "$WORK/tokens.json"
C=$WORK/certs
CLUSTER_TLS=(--cluster-ca "$C/ca.pem" --cluster-cert "$C/node.pem" --cluster-key "$C/node-key.pem")

start() { # arm: plain | secure
  local arm=$1 ports peers i
  rm -rf "$WORK/data"
  ports=("$(free_port)" "$(free_port)" "$(free_port)")
  peers="1=127.0.0.1:${ports[0]},2=127.0.0.1:${ports[1]},3=127.0.0.1:${ports[2]}"
  local tls=() gw=()
  if [[ $arm == secure ]]; then
    tls=("${CLUSTER_TLS[@]}")
    gw=(--tls-cert "$C/node.pem" --tls-key "$C/node-key.pem" --auth-tokens "$WORK/tokens.json")
  fi
  for i in 1 2 3; do
    "$BIN/courier" broker --node-id $i --addr "127.0.0.1:${ports[$((i-1))]}" --peers "$peers" \
      --partitions 3 --replication-factor 3 --data-dir "$WORK/data/b$i" "${tls[@]}" >"$WORK/b$i.log" 2>&1 &
    PIDS+=($!)
  done
  ADDR="127.0.0.1:$(free_port)"
  "$BIN/courier" gateway --addr "$ADDR" --brokers "127.0.0.1:${ports[0]},127.0.0.1:${ports[1]},127.0.0.1:${ports[2]}" \
    "${tls[@]}" "${gw[@]}" >"$WORK/gw.log" 2>&1 &
  PIDS+=($!)
  CLIENT=()
  if [[ $arm == secure ]]; then CLIENT=(--tls-ca "$C/ca.pem" --token "$TOKEN"); fi
  for _ in $(seq 1 200); do
    if "$BIN/courier" status --address "$ADDR" "${CLIENT[@]}" --retry-budget 0s 2>/dev/null | grep -q PARTITION \
      && ! "$BIN/courier" status --address "$ADDR" "${CLIENT[@]}" --retry-budget 0s | grep -q "no leader"; then return 0; fi
    sleep 0.1
  done
  echo "the $arm cluster did not become ready" >&2; exit 1
}

# A row's columns: | label | scenario | p50 | p90 | p99 | ...
p50() { awk -F'|' '{gsub(/ /, "", $4); print $4}'; }
p99() { awk -F'|' '{gsub(/ /, "", $6); print $6}'; }
echo "| round | arm | create acknowledged p50 | push unloaded p50 | push p99 at 1000/s |"
echo "|---|---|---|---|---|"
for round in $(seq 1 "${ROUNDS:-4}"); do
  for arm in plain secure; do
    start "$arm"
    create=$("$BIN/courier-bench" create --address "$ADDR" "${CLIENT[@]}" --label "$arm" --duration 8 --warmup 1 | p50)
    push=$("$BIN/courier-bench" e2e --address "$ADDR" "${CLIENT[@]}" --label "$arm" --mode push --duration 8 --warmup 1 | p50)
    rated=$("$BIN/courier-bench" e2e --address "$ADDR" "${CLIENT[@]}" --label "$arm" --mode push --workers 8 --rate 1000 --duration 10 --warmup 1 | p99)
    echo "| $round | $arm | $create | $push | $rated |"
    stop_all
  done
done
