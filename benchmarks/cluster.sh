# Sourced by the benchmark scripts: starts a 3-broker cluster (3 partitions, RF 3,
# fsync) and one gateway from the binary BIN, its data and logs under DIR; sets ADDR
# to the gateway's address and adds the processes to PIDS.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
start_cluster() { # BIN DIR
  local bin=$1 dir=$2 ports peers i brokers
  ports=("$(free_port)" "$(free_port)" "$(free_port)")
  peers="1=127.0.0.1:${ports[0]},2=127.0.0.1:${ports[1]},3=127.0.0.1:${ports[2]}"
  brokers="127.0.0.1:${ports[0]},127.0.0.1:${ports[1]},127.0.0.1:${ports[2]}"
  for i in 1 2 3; do
    "$bin" broker --node-id $i --addr "127.0.0.1:${ports[$((i-1))]}" --peers "$peers" \
      --partitions 3 --replication-factor 3 --data-dir "$dir/b$i" >"$dir/b$i.log" 2>&1 &
    PIDS+=($!)
  done
  ADDR="127.0.0.1:$(free_port)"
  "$bin" gateway --addr "$ADDR" --brokers "$brokers" >"$dir/gw.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 200); do
    if "$bin" status --address "$ADDR" --retry-budget 0s 2>/dev/null | grep -q PARTITION \
      && ! "$bin" status --address "$ADDR" --retry-budget 0s | grep -q "no leader"; then return 0; fi
    sleep 0.1
  done
  echo "the cluster of $bin did not become ready" >&2; exit 1
}
