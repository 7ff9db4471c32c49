#!/usr/bin/env bash
# Builds Courier in release mode, starts each topology, runs the scenarios, stops
# everything it started, and writes benchmarks/RESULTS.md.
#   bash benchmarks/run.sh           full run (about 25 minutes)
#   bash benchmarks/run.sh --quick   short run (under 2 minutes): the 3-broker fsync
#                                    cluster's latency rows, JetStream at 1,000/s, and
#                                    the slow-worker and burst scenarios, 2 s a row
#   bash benchmarks/run.sh --peer    the rows against JetStream and the full
#                                    lifecycle, both modes, printed (about 6 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
DURATION=10; WARMUP=2; FLOW=20; BURST=50000; MODES=(fsync replicated); QUICK=
# The push-against-polling rows at 1,000 jobs/s run longer: their p99 is the figure
# compared, and over 10 s it is the worst 100 jobs, which one 0.1 s stall of this
# shared machine decides on its own. 30 s takes a stall three times as long, and
# they run in alternating segments (see rated) so a stall falls on both arms alike.
RATE_DURATION=30; RATE_SEGMENTS=3
# --quick: the 3-broker cluster in fsync mode only, short rows and scenarios.
if [[ "${1:-}" == "--quick" ]]; then DURATION=2; WARMUP=1; FLOW=4; BURST=2000; MODES=(fsync); QUICK=1; RATE_DURATION=2; RATE_SEGMENTS=2; fi
# --peer: only the rows against JetStream and the full lifecycle's throughput, on 3
# brokers in both modes (about 6 minutes), printed rather than written to RESULTS.md.
PEER_ONLY=; [[ "${1:-}" == "--peer" ]] && PEER_ONLY=1

cargo build --release -p courier-cli -p courier-bench
BIN=target/release
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  bash benchmarks/jetstream.sh stop "$WORK/jetstream" 2>/dev/null || true
  wait 2>/dev/null || true; rm -rf "$WORK"
}
trap cleanup EXIT

stop_all() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; PIDS=(); }

# start_cluster, wait_ready, with_cpu, cpu_per_k and col.
source benchmarks/cluster.sh

ROWS=()
bench() { # label address
  ROWS+=("$(with_cpu "${PIDS[*]}" "$BIN/courier-bench" create --address "$2" --label "$1" --concurrency 1 --duration "$DURATION" --warmup "$WARMUP")")
  ROWS+=("$(with_cpu "${PIDS[*]}" "$BIN/courier-bench" create --address "$2" --label "$1" --concurrency 64 --duration "$DURATION" --warmup "$WARMUP")")
}

E2E=()
RATIOS=()
e2e() { # label address
  local e=(with_cpu "${PIDS[*]}" "$BIN/courier-bench" e2e --address "$2" --label "$1" --duration "$DURATION" --warmup "$WARMUP")
  local commit push1 poll1 pushr pollr pusht pollt
  commit=$(with_cpu "${PIDS[*]}" "$BIN/courier-bench" create --address "$2" --label "$1" --concurrency 1 --duration "$DURATION" --warmup "$WARMUP")
  # Arms alternate (push, poll, then poll, push, then push, poll) so a drift in
  # machine speed does not favour one side.
  push1=$("${e[@]}" --mode push)
  poll1=$("${e[@]}" --mode poll)
  rated "$1" "$2"
  # The full lifecycle's throughput: closed loop, 256 jobs between create and handler.
  E2E+=("$(echo "$commit" | sed 's/closed loop x1/create acknowledged (one commit), 1 at a time/')" "$push1" "$poll1" "$pushr" "$pollr")
  if [[ -z $QUICK ]]; then
    pusht=$("${e[@]}" --mode push --workers 8 --in-flight 256)
    pollt=$("${e[@]}" --mode poll --workers 8 --in-flight 256)
    E2E+=("$pusht" "$pollt")
  fi
  RATIOS+=("| $1 | $(awk -v a="$(col "$push1" 4)" -v b="$(col "$commit" 4)" 'BEGIN{printf "%.2f", a/b}') | $(awk -v a="$(col "$poll1" 4)" -v b="$(col "$push1" 4)" 'BEGIN{printf "%.2f", a/b}') | $(awk -v a="$(col "$pollr" 6)" -v b="$(col "$pushr" 6)" 'BEGIN{printf "%.2f", a/b}') |")
}

# Push and poll at 1,000 jobs/s: RATE_SEGMENTS segments of each, alternating
# (push, poll, then poll, push, ...), merged into one row per arm, so a stall of the
# machine falls on both arms alike instead of deciding one arm's p99. CPU: the mean
# of the segments'. Sets pushr and pollr.
rated() { # label address
  local seg=$((RATE_DURATION / RATE_SEGMENTS)) i m row
  local -A cpu=([push]=0 [poll]=0) files=([push]="" [poll]="")
  for i in $(seq 1 "$RATE_SEGMENTS"); do
    for m in $( ((i % 2)) && echo push poll || echo poll push); do
      row=$(with_cpu "${PIDS[*]}" "$BIN/courier-bench" e2e --address "$2" --label "$1" --mode "$m" \
        --workers 8 --rate 1000 --duration "$seg" --warmup "$WARMUP" --histogram-out "$WORK/$m-$i.hist")
      cpu[$m]=$(awk -v a="${cpu[$m]}" -v b="$(col "$row" 11)" 'BEGIN{print a+b}')
      files[$m]="${files[$m]} $WORK/$m-$i.hist"
    done
  done
  local -A rows
  for m in push poll; do
    # shellcheck disable=SC2086
    rows[$m]="$("$BIN/courier-bench" merge --label "$1" ${files[$m]}) $(awk -v c="${cpu[$m]}" -v n="$RATE_SEGMENTS" 'BEGIN{printf "%.2f", c/n}') |"
  done
  pushr=${rows[push]}; pollr=${rows[poll]}
}

start_dev() { # durability [data-dir tag: a fresh process per tag] [more dev options...]
  local gw; gw=$(free_port)
  "$BIN/courier" dev --data-dir "$WORK/dev-$1${2:-}" --gateway-addr "127.0.0.1:$gw" --metrics-addr "127.0.0.1:$(free_port)" --durability "$1" "${@:3}" >"$WORK/dev-$1${2:-}.log" 2>&1 &
  PIDS+=($!)
  wait_ready "$BIN/courier" "127.0.0.1:$gw"; ADDR="127.0.0.1:$gw"
}

start_3() { # durability [data-dir tag: a fresh cluster per tag]
  DURABILITY=$1 start_cluster "$BIN/courier" "$WORK/c-$1${2:-}"
}

# The peer: NATS JetStream R3 (benchmarks/jetstream.sh), started beside the Courier
# cluster at ADDR for these rows only. Each scenario runs on both, the order of arms
# alternating from one scenario to the next (C J, J C, C J, J C), so a drift in machine
# speed does not favour one side. Courier rows carry the ratio Courier / JetStream.
PEER=()
vs() { # courier-row jetstream-row -> "p50 ratio | p99 ratio | CPU per job ratio"
  awk -v a="$(col "$1" 4)" -v b="$(col "$2" 4)" -v c="$(col "$1" 6)" -v d="$(col "$2" 6)" \
    -v e="$(cpu_per_k "$1")" -v f="$(cpu_per_k "$2")" \
    'BEGIN{printf "%.2f | %.2f | %.2f", (b>0?a/b:0), (d>0?c/d:0), (f>0?e/f:0)}'
}
peer() { # label address
  local servers c j i=0 s
  servers=$(bash benchmarks/jetstream.sh start "$WORK/jetstream")
  local cc=("$BIN/courier-bench" e2e --address "$2" --label "$1" --mode push --duration "$DURATION" --warmup "$WARMUP")
  local jj=("$BIN/courier-bench" jetstream --servers "$servers" --duration "$DURATION" --warmup "$WARMUP")
  local scenarios=(commit unloaded 1000 5000)
  [[ -n $QUICK ]] && scenarios=(unloaded 1000)
  for s in "${scenarios[@]}"; do
    local ca=() ja=()
    case $s in
      commit) ca=(--commit); ja=(--publish-only) ;;
      unloaded) ;;
      *) ca=(--workers 8 --rate "$s"); ja=(--workers 8 --rate "$s") ;;
    esac
    local jpids; jpids=$(cat "$WORK"/jetstream/n*/pid)
    if (( i % 2 == 0 )); then c=$(with_cpu "${PIDS[*]}" peer_courier "$1" "$2" "${ca[@]}"); j=$(with_cpu "$jpids" "${jj[@]}" "${ja[@]}")
    else j=$(with_cpu "$jpids" "${jj[@]}" "${ja[@]}"); c=$(with_cpu "${PIDS[*]}" peer_courier "$1" "$2" "${ca[@]}"); fi
    PEER+=("$c $(cpu_per_k "$c") | $(vs "$c" "$j") |" "$j $(cpu_per_k "$j") | - | - | - |")
    i=$((i+1))
  done
  bash benchmarks/jetstream.sh stop "$WORK/jetstream"
}
peer_courier() { # label address [--commit | e2e args...]
  if [[ ${3:-} == --commit ]]; then
    "$BIN/courier-bench" create --address "$2" --label "$1" --concurrency 1 --duration "$DURATION" --warmup "$WARMUP" \
      | sed 's/closed loop x1/create acknowledged (one commit), 1 at a time/'
  else
    "$BIN/courier-bench" e2e --address "$2" --label "$1" --mode push --duration "$DURATION" --warmup "$WARMUP" "${@:3}"
  fi
}

FLOWS=()
flow() { # label address
  local f=("$BIN/courier-bench" flow --address "$2" --label "$1" --gateway-metrics "$GMETRICS" --broker-metrics "$BMETRICS" --duration "$FLOW" --burst "$BURST")
  FLOWS+=("$("${f[@]}" --scenario slow) - |")
  # --quick: slow workers and the push burst only.
  if [[ -n $QUICK ]]; then FLOWS+=("$("${f[@]}" --scenario burst) - |"); return; fi
  # The gateway's resident memory, sampled through the overload.
  : > "$WORK/rss"
  ( while kill -0 "$GWPID" 2>/dev/null; do awk '/VmRSS/{print $2}' "/proc/$GWPID/status" >> "$WORK/rss"; sleep 0.2; done ) &
  local sampler=$!
  FLOWS+=("$("${f[@]}" --scenario overload) $(sort -n "$WORK/rss" | tail -1) KiB |")
  kill "$sampler" 2>/dev/null || true
  FLOWS+=("$("${f[@]}" --scenario burst) - |")
  FLOWS+=("$("${f[@]}" --scenario burst-poll) - |")
}

# Micro-benchmarks of the broker's hot path (criterion), as name and time per iteration.
MICRO=()
if [[ -z $QUICK && -z $PEER_ONLY ]]; then
  while read -r _ name _ _ ns _; do
    MICRO+=("| \`$name\` | $(awk -v n="${ns//,/}" 'BEGIN{printf "%.2f", n/1000}') |")
  done < <(cargo bench -p courier-broker --bench hot_path -- --warm-up-time 1 --measurement-time 3 --output-format bencher 2>/dev/null | grep '^test ')
fi

# What security costs: plain against TLS, mutual TLS and a token (its own clusters,
# alternating rounds; see benchmarks/security.sh).
SECURITY=()
if [[ -z $QUICK && -z $PEER_ONLY ]]; then
  mapfile -t SECURITY < <(ROUNDS="${SECURITY_ROUNDS:-3}" bash benchmarks/security.sh 2>/dev/null | grep '^|')
fi

# start_* set ADDR rather than print it: a $(...) subshell would lose PIDS, and the
# processes would outlive the script.
FSYNC=$("$BIN/courier-bench" fsync-probe --dir "$WORK")
if [[ -n $PEER_ONLY ]]; then
  LIFE=()
  for d in "${MODES[@]}"; do
    start_3 "$d" -peer; peer "3 brokers, RF 3, $d" "$ADDR"
    row=$(with_cpu "${PIDS[*]}" "$BIN/courier-bench" e2e --address "$ADDR" --label "3 brokers, RF 3, $d" --mode push \
      --workers 8 --in-flight 256 --duration "$DURATION" --warmup "$WARMUP")
    LIFE+=("$row $(cpu_per_k "$row") |")
    stop_all
  done
  echo "$(date -u +%Y-%m-%d), $FSYNC, commit $(git rev-parse --short HEAD)"
  echo
  echo "| topology | scenario | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms | jobs/s | errors | server CPU (cores) | CPU ms per 1,000 jobs | p50 / JetStream | p99 / JetStream | CPU per job / JetStream |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${PEER[@]}"
  echo
  echo "| topology | scenario | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms | jobs/s | errors | server CPU (cores) | CPU ms per 1,000 jobs |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${LIFE[@]}"
  exit 0
fi
# The create rows leave ~100k jobs no worker takes, and the storage engine and
# snapshots are busy with them for a while after: the latency rows start on a fresh
# cluster, so neither arm runs in that aftermath.
for d in "${MODES[@]}"; do
  if [[ -z $QUICK ]]; then
    start_dev "$d"; bench "courier dev (1 broker, 2 partitions), $d" "$ADDR"; stop_all
    if [[ $d == fsync ]]; then
      start_dev "$d" -e2e; e2e "courier dev, $d" "$ADDR"; stop_all
      # dev's default is one worker thread; the same rows on two (one per CPU
      # here) show what that is worth.
      start_dev "$d" -e2e2 --worker-threads 2; e2e "courier dev --worker-threads 2, $d" "$ADDR"; stop_all
    fi
    start_3 "$d"; bench "3 brokers, RF 3, 3 partitions, $d" "$ADDR"; stop_all
  fi
  start_3 "$d" -e2e
  if [[ $d == fsync ]]; then e2e "3 brokers, RF 3, $d" "$ADDR"; fi
  peer "3 brokers, RF 3, $d" "$ADDR"
  stop_all
  if [[ $d == fsync ]]; then start_3 "$d" -flow; flow "3 brokers, RF 3, $d" "$ADDR"; stop_all; fi
done

{
  echo "# Benchmark results"
  echo
  echo "Produced by \`bash benchmarks/run.sh${1:+ $1}\` on $(date -u +%Y-%m-%d) ($(nproc) cores, $(free -g | awk '/Mem/{print $2}') GiB;"
  echo "$FSYNC). Release build, everything on loopback on one machine; the load"
  echo "generator shares the 2 cores with the cluster. Each row: ${DURATION} s measured after ${WARMUP} s warm-up"
  echo "(the push and poll rows at 1,000 jobs/s: ${RATE_DURATION} s each, in ${RATE_SEGMENTS} segments that alternate between push"
  echo "and poll, merged with \`courier-bench merge\`, so one stall of the machine cannot decide their p99)."
  echo
  echo "## Create latency (request sent -> acknowledged: committed by a majority, applied)"
  echo
  echo "\`courier-bench create --concurrency C\`: C producers, each with one create in flight."
  echo
  echo "| topology | load | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms | creates/s | errors | server CPU (cores) |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${ROWS[@]}"
  echo
  echo "## Create-to-handler latency: push against long polling"
  echo
  echo "\`courier-bench e2e --mode push|poll\`: each job carries the time it was sent for"
  echo "creation; the worker's handler records when it has the job. Push workers hold a"
  echo "\`StreamActivatedJobs\` stream; poll workers long-poll \`ActivateJobs\` (32 jobs, 10 s)"
  echo "as Zeebe's clients do. Unloaded: one job at a time. Loaded: open loop, 8 workers."
  echo "Full lifecycle: closed loop (\`--in-flight 256\`), each job that reaches a handler lets"
  echo "the next be created; handlers complete every job; the rate is the lifecycle's throughput."
  echo "The first row of each topology is the create acknowledgement (one Raft commit),"
  echo "measured in the same run. Columns as above (rate = jobs handled per second). Server"
  echo "CPU: user + system time of the brokers and the gateway (or the \`courier dev\` process)"
  echo "during the row, over the row's wall time, in cores (the machine has $(nproc))."
  echo
  echo "| topology | scenario | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms | jobs/s | errors | server CPU (cores) |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${E2E[@]}"
  echo
  echo "| topology | unloaded push p50 / commit p50 | unloaded poll p50 / push p50 | 1000/s poll p99 / push p99 |"
  echo "|---|---|---|---|"
  printf '%s\n' "${RATIOS[@]}"
  echo
  echo "## Against NATS JetStream (the peer)"
  echo
  echo "The peer: Debian's \`$(nats-server --version 2>/dev/null || /usr/sbin/nats-server --version)\`, 3 nodes on loopback"
  echo "(\`bash benchmarks/jetstream.sh start DIR\`); a fresh stream per row with 3 replicas and file"
  echo "storage (JetStream's default: replicated to a majority, no fsync per message), work-queue"
  echo "retention (acked messages are deleted, as completed jobs are), a durable push consumer with"
  echo "explicit ack, max_ack_pending 32 (Courier's worker credit) and a deliver group shared by the"
  echo "workers. The consumer's leader is moved onto the stream leader's server and the clients"
  echo "connect there: JetStream's best case, the same from run to run. Driven by"
  echo "\`courier-bench jetstream --servers URLS [--publish-only] [--workers 8 --rate R]\`: same payload"
  echo "(the creation time in µs plus padding, as Courier's variables), same rates, same histogram"
  echo "code as \`e2e --mode push\`; the handler records its latency, then acks. The commit rows:"
  echo "Courier's create acknowledged against JetStream's publish acknowledged (PubAck), one at a"
  echo "time. Both systems run during every row; the order of arms alternates. Ratio = Courier /"
  echo "JetStream, below 1 Courier is faster. Targets: replicated no worse (<= 1.00) on p50 and p99 at"
  echo "1,000 and 5,000 jobs/s; fsync within 1.30; server CPU per job no more than JetStream's."
  echo "CPU per 1,000 jobs: the servers' CPU (cores) over the row's rate, in ms."
  echo
  echo "| topology | scenario | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms | jobs/s | errors | server CPU (cores) | CPU ms per 1,000 jobs | p50 / JetStream | p99 / JetStream | CPU per job / JetStream |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${PEER[@]}"
  echo
  echo "## Flow control"
  echo
  echo "\`courier-bench flow --scenario slow|overload|burst|burst-poll\` on a fresh 3-broker cluster"
  echo "(fsync). Workers are streams stating their credit and spending a fixed time per job,"
  echo "so their combined capacity is known; yields and pushes are read from the brokers'"
  echo "/metrics. Slow: ${FLOW} s with a backlog always waiting. Overload: ${FLOW} s of creation"
  echo "at 5 times capacity, then the drain, then 100 jobs one at a time for the push latency"
  echo "once the backlog is gone. Burst: ${BURST} jobs with no worker, then 10 workers."
  echo
  echo "| topology | scenario | outcome | bounds | notes | yields / pushes | gateway RSS max |"
  echo "|---|---|---|---|---|---|---|"
  printf '%s\n' "${FLOWS[@]}"
  if [[ ${#MICRO[@]} -gt 0 ]]; then
    echo
    echo "## Micro-benchmarks of the broker's hot path"
    echo
    echo "\`cargo bench -p courier-broker --bench hot_path -- --warm-up-time 1 --measurement-time 3\`"
    echo "(criterion; crates/broker/benches/hot_path.rs). One iteration: the engine applying a"
    echo "64-job create entry (activated inline for a stream) and the entry completing them, or a"
    echo "back-fill of 64 from a 10,000-job backlog; a registry lookup (with the refund of the"
    echo "credit it held) and a miss; the log append of one 64-create entry, encoded and written,"
    echo "and with the fdatasync that makes it durable."
    echo
    echo "| benchmark | µs per iteration |"
    echo "|---|---|"
    printf '%s\n' "${MICRO[@]}"
  fi
  if [[ ${#SECURITY[@]} -gt 0 ]]; then
    echo
    echo "## Security: TLS, mutual TLS and a token, against plain"
    echo
    echo "\`benchmarks/security.sh\`: 3 brokers, RF 3, fsync; each round starts a fresh cluster"
    echo "per arm, plain first, then secure (mutual TLS between brokers and from the gateway,"
    echo "TLS on the client port, a static token checked on every request). Columns in ms."
    echo
    printf '%s\n' "${SECURITY[@]}"
  fi
} > benchmarks/RESULTS.md
cat benchmarks/RESULTS.md
