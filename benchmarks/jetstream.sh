#!/usr/bin/env bash
# The peer of Courier's benchmarks: a 3-node NATS JetStream cluster on loopback,
# from Debian's nats-server package (2.9: streams replicate to a majority and do not
# fsync each message).
#   bash benchmarks/jetstream.sh start DIR   starts it; prints nats://127.0.0.1:P1,P2,P3
#   bash benchmarks/jetstream.sh stop DIR    stops the servers started in DIR
# Each node keeps its config, store, log and pid under DIR/nN. Only stdout's last
# line is the server list; everything else goes to stderr or DIR.
set -euo pipefail

usage() { echo "usage: $0 start|stop DIR" >&2; exit 2; }
[[ $# -eq 2 ]] || usage
CMD=$1; DIR=$2

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

stop() {
  local pid f
  [[ -d $DIR ]] || return 0
  DIR=$(cd "$DIR" && pwd)
  for f in "$DIR"/n*/pid; do
    [[ -f $f ]] || continue
    pid=$(cat "$f")
    # Only a process that is still the nats-server we started (pids get reused).
    if [[ -r /proc/$pid/cmdline ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$DIR/n"; then
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
  done
}

start() {
  local bin
  bin=$(command -v nats-server || true)
  if [[ -z $bin && -x /usr/sbin/nats-server ]]; then bin=/usr/sbin/nats-server; fi
  if [[ -z $bin ]]; then
    (apt-get update && apt-get install -y nats-server) >&2
    bin=$(command -v nats-server || echo /usr/sbin/nats-server)
  fi
  mkdir -p "$DIR"
  DIR=$(cd "$DIR" && pwd)
  local i client=() route=() http=() routes=""
  for i in 1 2 3; do
    client[i]=$(free_port); route[i]=$(free_port); http[i]=$(free_port)
    routes="$routes${routes:+, }\"nats-route://127.0.0.1:${route[i]}\""
  done
  for i in 1 2 3; do
    mkdir -p "$DIR/n$i/store"
    cat >"$DIR/n$i/nats.conf" <<EOF
server_name: n$i
host: 127.0.0.1
port: ${client[i]}
http: 127.0.0.1:${http[i]}
jetstream {
  store_dir: "$DIR/n$i/store"
  max_memory_store: 1GB
  max_file_store: 10GB
}
cluster {
  name: courier-bench-peer
  listen: 127.0.0.1:${route[i]}
  routes: [ $routes ]
}
EOF
    # setsid: the server outlives this script and is not in its process group.
    setsid "$bin" -c "$DIR/n$i/nats.conf" >"$DIR/n$i/log" 2>&1 </dev/null &
    echo $! >"$DIR/n$i/pid"
  done
  # Ready when every node is healthy and sees the same JetStream meta leader.
  local ok leader l
  for _ in $(seq 1 300); do
    ok=1; leader=""
    for i in 1 2 3; do
      if ! curl -fs "http://127.0.0.1:${http[i]}/healthz" >/dev/null 2>&1; then ok=0; break; fi
      l=$(curl -fs "http://127.0.0.1:${http[i]}/jsz" 2>/dev/null \
        | python3 -c 'import json,sys; print((json.load(sys.stdin).get("meta_cluster") or {}).get("leader",""))' 2>/dev/null || true)
      if [[ -z $l || ( -n $leader && $l != "$leader" ) ]]; then ok=0; break; fi
      leader=$l
    done
    if [[ $ok == 1 ]]; then
      echo "jetstream cluster ready in $DIR (meta leader $leader)" >&2
      echo "nats://127.0.0.1:${client[1]},nats://127.0.0.1:${client[2]},nats://127.0.0.1:${client[3]}"
      return 0
    fi
    sleep 0.1
  done
  echo "jetstream cluster in $DIR did not become ready; logs in $DIR/n*/log" >&2
  stop
  exit 1
}

case $CMD in
  start) start ;;
  stop) stop ;;
  *) usage ;;
esac
