#!/usr/bin/env bash
# The chaos suite: 3 brokers and 2 gateways, each a process in a network namespace
# of its own, under a workload while faults are injected; then a history check
# (benchmarks/src/chaos/main.rs says what is checked). Needs root; installs
# nftables when missing. Arguments go to courier-chaos:
#   bash benchmarks/chaos.sh --duration 1800              # the long run
#   PROFILE=dev bash benchmarks/chaos.sh --duration 60    # CI's short run
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
profile="${PROFILE:-release}"

[ "$(id -u)" = 0 ] || { echo "the chaos suite needs root (network namespaces, tmpfs)" >&2; exit 1; }
if ! command -v nft >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q nftables >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null && apt-get install -y -q nftables >/dev/null; }
fi
command -v nft >/dev/null || { echo "nftables could not be installed" >&2; exit 1; }

cargo build -q --profile "$profile" -p courier-cli --bin courier -p courier-bench --bin courier-chaos
out="${CARGO_TARGET_DIR:-target}/$([ "$profile" = dev ] && echo debug || echo "$profile")"
exec "$out/courier-chaos" "$@"
