# Sourced by the benchmark scripts: start_cluster, which starts a 3-broker cluster
# (PARTITIONS partitions, default 3; RF 3; $DURABILITY, default fsync; more broker
# flags in $BROKER_ARGS) and one
# gateway from the binary BIN, its data and logs under DIR: sets ADDR to the
# gateway's address, GWPID to its process, BMETRICS and GMETRICS to the brokers' and
# the gateway's metrics addresses, and adds the processes to PIDS. Also the servers'
# CPU over a row (with_cpu, cpu_per_k).
stop_all() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; PIDS=(); }
# A scratch folder WORK, removed on exit once every server in PIDS is stopped.
scratch() { WORK=$(mktemp -d); PIDS=(); trap 'stop_all; rm -rf "$WORK"' EXIT; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_ready() { # BIN ADDR: until every partition has a leader
  for _ in $(seq 1 200); do
    if "$1" status --address "$2" --retry-budget 0s 2>/dev/null | grep -q PARTITION \
      && ! "$1" status --address "$2" --retry-budget 0s | grep -q "no leader"; then return 0; fi
    sleep 0.1
  done
  echo "the cluster at $2 ($1) did not become ready" >&2; exit 1
}
start_cluster() { # BIN DIR [PARTITIONS]
  local bin=$1 dir=$2 partitions=${3:-3} ports peers i brokers m
  mkdir -p "$dir"
  ports=("$(free_port)" "$(free_port)" "$(free_port)")
  peers="1=127.0.0.1:${ports[0]},2=127.0.0.1:${ports[1]},3=127.0.0.1:${ports[2]}"
  brokers="127.0.0.1:${ports[0]},127.0.0.1:${ports[1]},127.0.0.1:${ports[2]}"
  BMETRICS=""
  for i in 1 2 3; do
    m="127.0.0.1:$(free_port)"; BMETRICS="$BMETRICS${BMETRICS:+,}$m"
    "$bin" broker --node-id $i --addr "127.0.0.1:${ports[$((i-1))]}" --peers "$peers" \
      --partitions "$partitions" --replication-factor 3 --durability "${DURABILITY:-fsync}" \
      --data-dir "$dir/b$i" --metrics-addr "$m" ${BROKER_ARGS:-} >"$dir/b$i.log" 2>&1 &
    PIDS+=($!)
  done
  ADDR="127.0.0.1:$(free_port)"; GMETRICS="127.0.0.1:$(free_port)"
  "$bin" gateway --addr "$ADDR" --brokers "$brokers" --metrics-addr "$GMETRICS" >"$dir/gw.log" 2>&1 &
  PIDS+=($!); GWPID=$!
  wait_ready "$bin" "$ADDR"
}

# CPU used by the servers under test, as a last column: user + system time of the
# given processes (all their threads) while the row ran, divided by the row's wall
# time (warm-up, measurement and drain), in cores of this machine.
HZ=$(getconf CLK_TCK)
cpu_ticks() { local t=0 p v; for p in "$@"; do v=$(awk '{print $14+$15}' "/proc/$p/stat" 2>/dev/null || echo 0); t=$((t+v)); done; echo "$t"; }
with_cpu() { # "PIDS" command... -> the command's row, with a CPU column
  local pids=$1 t0 w0 out t1 w1; shift
  # shellcheck disable=SC2086
  t0=$(cpu_ticks $pids); w0=$(date +%s.%N)
  out=$("$@")
  # shellcheck disable=SC2086
  t1=$(cpu_ticks $pids); w1=$(date +%s.%N)
  echo "$out $(awk -v c=$((t1-t0)) -v hz="$HZ" -v a="$w0" -v b="$w1" 'BEGIN{printf "%.2f", c/hz/(b-a)}') |"
}
# A row's column N (1-based after the leading |), spaces removed.
col() { echo "$1" | awk -F'|' -v c="$2" '{gsub(/ /,"",$c); print $c}'; }
# Server CPU per 1,000 jobs (ms) of a row with a CPU column: cores / (jobs/s) x 10^6.
cpu_per_k() { awk -v c="$(col "$1" 11)" -v r="$(col "$1" 9)" 'BEGIN{printf "%.0f", (r>0 ? c/r*1e6 : 0)}'; }
