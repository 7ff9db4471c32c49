#!/usr/bin/env bash
# The openraft 0.10 evaluation: the commit path on openraft 0.9 (Courier's version)
# and on 0.10.0-alpha, same harness (common.rs), one after the other, each mode
# ROUNDS times (default 2). Prints Markdown rows; docs/openraft.md reads them.
#   bash benchmarks/openraft-eval/run.sh
set -euo pipefail
cd "$(dirname "$0")"
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/../../target/openraft-eval}"
rounds="${ROUNDS:-2}"

(cd v09 && cargo build -q --release)
(cd v010 && cargo build -q --release)
bin="$CARGO_TARGET_DIR/release"

echo "| openraft | log | writers | p50 ms | p99 ms | p99.9 ms | writes/s | CPU µs per write |"
echo "|---|---|---|---|---|---|---|---|"
for _ in $(seq "$rounds"); do
  for mode in "" "--fsync"; do
    "$bin/openraft-eval-09" $mode
    # Courier's way on 0.9: the leader's own entries count as stored once written.
    [[ $mode == --fsync ]] && "$bin/openraft-eval-09" --fsync --early
    "$bin/openraft-eval-010" $mode
    "$bin/openraft-eval-010" $mode --pipelined
  done
done
