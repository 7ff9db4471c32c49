#!/usr/bin/env bash
# Runs every test: unit tests, openraft's storage suite, cluster tests on real
# processes, the compatibility tests with real Zeebe clients (installed here from
# the npm registry and PyPI; nothing needs installing by hand), and a short run of
# the chaos suite (as root; it installs nftables from Debian when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"

command -v npm >/dev/null || { echo "npm is required for the Zeebe client tests" >&2; exit 1; }
npm ci --prefix tests/compat --no-audit --no-fund --loglevel=error

command -v python3 >/dev/null || { echo "python3 is required for the pyzeebe tests" >&2; exit 1; }
[ -x tests/compat/.venv/bin/python ] || python3 -m venv tests/compat/.venv
tests/compat/.venv/bin/python -m pip install --quiet --disable-pip-version-check \
  -r tests/compat/requirements.txt

# Headless Chromium loads the status page in its test (Debian's package).
if ! command -v chromium-headless-shell >/dev/null; then
  command -v apt-get >/dev/null || { echo "chromium-headless-shell is required for the status page test" >&2; exit 1; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium-headless-shell >/dev/null \
    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium-headless-shell >/dev/null; }
fi

cargo test --workspace

# The chaos suite's short run: faults in network namespaces under a workload, then
# a history check. The seed it prints reproduces its fault schedule.
PROFILE=dev bash benchmarks/chaos.sh --duration 60
