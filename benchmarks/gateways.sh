#!/usr/bin/env bash
# The several-gateways scenarios (tests/spread.rs) on a release build, the kill
# scenario at 2,000 jobs/s: each prints its figures (streams and pushes per gateway,
# latency after the kill, time to reopen behind a silent proxy).
#   bash benchmarks/gateways.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
export COURIER_KILL_RATE="${COURIER_KILL_RATE:-2000}"
cargo test --release -p courier-cli --test integration -- spread:: \
  --test-threads=1 --nocapture 2>&1 |
  grep -E '^(test |streams |at |reopened |credit stated|test result|thread .* panicked|timed out|assertion)' | cut -c1-300
