#!/usr/bin/env bash
# The job path (create, push, poll) of this checkout against an earlier commit, in
# alternating rounds on fresh 3-broker clusters (RF 3, fsync), so a slow spell of this
# shared machine falls on both arms alike. The same load generator (this checkout's)
# drives both arms.
#   bash benchmarks/ab.sh REV            e.g. bash benchmarks/ab.sh c512317
#   ROUNDS=4 bash benchmarks/ab.sh REV   (about 80 s a round)
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
REV=${1:?usage: benchmarks/ab.sh REV}
WORK=$(mktemp -d)
PIDS=()
stop_all() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; PIDS=(); }
cleanup() { stop_all; git worktree remove --force "$WORK/base-src" 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT
source benchmarks/cluster.sh

# The base's server binary, built in a worktree with a target directory of its own
# (cargo names a workspace's build outputs by package, not by path, so the two trees
# would overwrite each other's build-script outputs in one target directory).
git worktree add --detach "$WORK/base-src" "$REV" >/dev/null 2>&1
CARGO_TARGET_DIR="$PWD/target/ab-base" cargo build --release -p courier-cli --manifest-path "$WORK/base-src/Cargo.toml"
mkdir -p "$WORK/base"; cp target/ab-base/release/courier "$WORK/base/courier"
cargo build --release -p courier-cli -p courier-bench
BENCH=$PWD/target/release/courier-bench
declare -A SERVER=([base]="$WORK/base/courier" [head]="$PWD/target/release/courier")

start() { # arm
  rm -rf "$WORK/data"; mkdir -p "$WORK/data"
  start_cluster "${SERVER[$1]}" "$WORK/data"
}

# A row's columns: | label | scenario | p50 | p90 | p99 | ...
p50() { awk -F'|' '{gsub(/ /, "", $4); print $4}'; }
p99() { awk -F'|' '{gsub(/ /, "", $6); print $6}'; }
echo "| round | arm | create acknowledged p50 | push unloaded p50 | poll unloaded p50 | push 1000/s p50 | push 1000/s p99 | push 5000/s p50 | push 5000/s p99 | server CPU ms per 1,000 jobs at 5000/s |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for round in $(seq 1 "${ROUNDS:-3}"); do
  arms=(base head); ((round % 2)) || arms=(head base)
  for arm in "${arms[@]}"; do
    start "$arm"
    create=$("$BENCH" create --address "$ADDR" --label "$arm" --duration 8 --warmup 1 | p50)
    push=$("$BENCH" e2e --address "$ADDR" --label "$arm" --mode push --duration 8 --warmup 1 | p50)
    poll=$("$BENCH" e2e --address "$ADDR" --label "$arm" --mode poll --duration 8 --warmup 1 | p50)
    r1=$("$BENCH" e2e --address "$ADDR" --label "$arm" --mode push --workers 8 --rate 1000 --duration 10 --warmup 1)
    r5=$(with_cpu "${PIDS[*]}" "$BENCH" e2e --address "$ADDR" --label "$arm" --mode push --workers 8 --rate 5000 --duration 10 --warmup 1)
    echo "| $round | $arm ($([[ $arm == base ]] && echo "$REV" || git rev-parse --short HEAD)) | $create | $push | $poll | $(echo "$r1" | p50) | $(echo "$r1" | p99) | $(echo "$r5" | p50) | $(echo "$r5" | p99) | $(cpu_per_k "$r5") |"
    stop_all
  done
done
