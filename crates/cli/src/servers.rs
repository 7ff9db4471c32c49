//! `courier dev`, `courier broker`, `courier gateway`: compose the library crates
//! into processes, serve `/metrics`, and stop cleanly on Ctrl-C or SIGTERM.

use anyhow::{bail, Context};
use courier_broker::{BrokerConfig, Durability, RaftTuning};
use courier_gateway::admission::Bounds;
use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// What becomes of the jobs handed out through a gateway that is gone.
#[derive(clap::Args)]
pub(crate) struct LostGateway {
    /// How long a gateway may be gone before the jobs handed out through it
    /// (pushed, or answered to its polls) run again elsewhere: their results could
    /// not come back through it, but a worker still running one may then run it a
    /// second time. "off": they wait for their activation timeouts, as in Zeebe.
    #[arg(long, default_value = "10s", value_parser = parse_grace)]
    pub(crate) lost_gateway_grace: Grace,
}

/// What a partition may hold in memory.
#[derive(clap::Args)]
pub(crate) struct Memory {
    /// Most bytes the jobs of one partition replica may weigh in memory: their
    /// variables, headers and other text, and 256 bytes each. Past it, creates on
    /// that partition are refused with RESOURCE_EXHAUSTED until jobs end.
    #[arg(long, default_value_t = courier_broker::config::DEFAULT_MAX_PARTITION_BYTES)]
    max_partition_bytes: u64,
    /// Past this weight of a partition replica's jobs, a new job's variables and
    /// custom headers are kept on disk only, and read when the job is handed out or
    /// shown: memory then grows by the rest of a job only (its type, state and 256
    /// bytes).
    #[arg(long, default_value_t = courier_broker::config::DEFAULT_PAYLOAD_BUDGET)]
    payload_memory_budget: u64,
}

impl Memory {
    pub(crate) fn config(&self) -> courier_broker::config::Memory {
        courier_broker::config::Memory {
            payload_budget: self.payload_memory_budget,
            max_partition_bytes: self.max_partition_bytes,
        }
    }
}

/// A duration, or none ("off").
#[derive(Clone, Debug)]
pub(crate) struct Grace(pub(crate) Option<Duration>);

pub(crate) fn parse_grace(s: &str) -> Result<Grace, String> {
    if s.trim() == "off" {
        return Ok(Grace(None));
    }
    crate::client_cmds::parse_duration(s).map(|d| Grace(Some(d)))
}

/// How a server process sizes its runtime.
#[derive(clap::Args)]
pub struct ServerRuntime {
    /// Threads that run the process's tasks (default: one per CPU).
    #[arg(long, env = "COURIER_WORKER_THREADS",
          value_parser = clap::value_parser!(u16).range(1..))]
    worker_threads: Option<u16>,
}

impl ServerRuntime {
    pub fn worker_threads(&self) -> Option<usize> {
        self.worker_threads.map(usize::from)
    }
}

#[derive(clap::Args)]
pub struct BrokerArgs {
    /// This broker's id; must be one of --peers.
    #[arg(long)]
    node_id: u64,
    /// Address to listen on, as other brokers and gateways reach it.
    #[arg(long)]
    addr: String,
    /// Every broker of the cluster: "1=HOST:PORT,2=HOST:PORT,3=HOST:PORT".
    #[arg(long)]
    peers: String,
    #[arg(long, default_value_t = 2)]
    partitions: u32,
    #[arg(long, default_value_t = 1)]
    replication_factor: u32,
    #[arg(long, default_value = "./courier-data")]
    data_dir: PathBuf,
    /// fsync (every append flushed before it counts) or replicated.
    #[arg(long, default_value = "fsync")]
    durability: Durability,
    /// Where Prometheus metrics are served (`/metrics`).
    #[arg(long)]
    metrics_addr: Option<String>,
    /// Log entries between snapshots of a partition: this many, plus a share of up
    /// to half again that differs per partition and broker, so snapshots spread out.
    #[arg(long, default_value_t = RaftTuning::default().snapshot_every)]
    snapshot_every: u64,
    /// Log entries kept behind a snapshot for lagging followers.
    #[arg(long, default_value_t = RaftTuning::default().keep_after_snapshot)]
    keep_after_snapshot: u64,
    /// Bytes of log entries written after which a partition takes a snapshot
    /// whatever their number, so a log of large jobs is compacted in time.
    #[arg(long, default_value_t = RaftTuning::default().snapshot_every_bytes)]
    snapshot_every_bytes: u64,
    /// The shortest election timeout [default: 300ms]. A follower that hears
    /// nothing of its leader for the leader's lease (the longest timeout) and a
    /// timeout drawn between the shortest and the longest stands for election.
    /// Above the heartbeat (150ms), and the same on every broker.
    #[arg(long, value_parser = crate::client_cmds::parse_duration)]
    election_timeout_min: Option<Duration>,
    /// The longest election timeout, also the leader's lease [default: 600ms].
    #[arg(long, value_parser = crate::client_cmds::parse_duration)]
    election_timeout_max: Option<Duration>,
    #[command(flatten)]
    lost_gateway: LostGateway,
    #[command(flatten)]
    memory: Memory,
    #[command(flatten)]
    rebalance: Rebalance,
    #[command(flatten)]
    cluster_tls: crate::security::ClusterTlsArgs,
    #[command(flatten)]
    pub runtime: ServerRuntime,
    #[command(flatten)]
    pub otlp: crate::telemetry::OtlpArgs,
}

/// Where partition leaders go once the brokers that should lead them are back.
#[derive(clap::Args)]
struct Rebalance {
    /// How long a partition's preferred leader (brokers take turns: partition 1
    /// prefers broker 1, partition 2 broker 2, ...) must have been back and caught
    /// up before the broker leading in its place hands the partition back, so
    /// leaders spread out again after a failure or a rolling restart. "off": they
    /// stay where elections put them.
    #[arg(long, default_value = "10s", value_parser = parse_grace)]
    rebalance_after: Grace,
}

#[derive(clap::Args)]
pub struct GatewayArgs {
    /// Address to listen on for clients.
    #[arg(long, default_value = "127.0.0.1:26500")]
    addr: String,
    /// Brokers to learn the cluster from: "HOST:PORT,HOST:PORT".
    #[arg(long)]
    brokers: String,
    /// Where Prometheus metrics are served (`/metrics`).
    #[arg(long)]
    metrics_addr: Option<String>,
    /// Serve no StreamActivatedJobs (UNIMPLEMENTED): workers long-poll instead.
    #[arg(long)]
    no_push: bool,
    /// Pushed jobs a stream client may hold unfinished unless it states its own
    /// (Courier's worker does; Zeebe clients' default maxJobsActive is 32).
    #[arg(long, default_value_t = 32)]
    client_credit: u32,
    /// Spare room of each job stream, in percent of its clients' credit: jobs kept
    /// at the gateway for the first worker that finishes one (0: none).
    #[arg(long, default_value_t = 50)]
    stream_spare_percent: u32,
    #[command(flatten)]
    bounds: GatewayBounds,
    #[command(flatten)]
    stream_life: StreamLife,
    #[command(flatten)]
    client_tls: crate::security::ClientPortTlsArgs,
    #[command(flatten)]
    cluster_tls: crate::security::ClusterTlsArgs,
    #[command(flatten)]
    auth: crate::security::AuthArgs,
    #[command(flatten)]
    pub runtime: ServerRuntime,
    #[command(flatten)]
    pub otlp: crate::telemetry::OtlpArgs,
}

/// How long a gateway keeps a job stream.
#[derive(clap::Args)]
pub(crate) struct StreamLife {
    /// Age at which a job stream is ended (less up to a fifth at random) with a
    /// status its worker reopens on at once, perhaps on another gateway: workers
    /// spread over the gateways there are now, and a stream never outlives the
    /// proxies and load balancers between them. "off": streams live until their
    /// worker or the gateway leaves.
    #[arg(long, default_value = "10m", value_parser = parse_grace)]
    pub(crate) stream_max_age: Grace,
}

/// The gateway's bounds. Past one, a connection is closed at once and a call is
/// refused RESOURCE_EXHAUSTED at once: clients back off or go to another gateway.
#[derive(clap::Args)]
struct GatewayBounds {
    /// Client connections held at once (TLS handshakes included).
    #[arg(long, default_value_t = Bounds::DEFAULT.max_connections)]
    max_connections: usize,
    /// Concurrent calls (HTTP/2 streams) per client connection, advertised to the
    /// client, which waits for a free one or opens another connection.
    #[arg(long, default_value_t = Bounds::DEFAULT.max_calls_per_connection)]
    max_calls_per_connection: u32,
    /// StreamActivatedJobs streams held at once.
    #[arg(long, default_value_t = Bounds::DEFAULT.max_job_streams)]
    max_job_streams: usize,
    /// ActivateJobs long polls parked waiting for jobs at once.
    #[arg(long, default_value_t = Bounds::DEFAULT.max_parked_polls)]
    max_parked_polls: usize,
    /// Pushed jobs held unfinished across all stream clients; past it, brokers are
    /// told there is no room and jobs wait at the brokers.
    #[arg(long, default_value_t = courier_gateway::DEFAULT_MAX_INFLIGHT_JOBS)]
    max_inflight_jobs: usize,
    /// Bytes (variables and custom headers) of those jobs.
    #[arg(long, default_value_t = courier_gateway::DEFAULT_MAX_INFLIGHT_BYTES)]
    max_inflight_bytes: usize,
}

impl GatewayBounds {
    fn bounds(&self) -> Bounds {
        Bounds {
            max_connections: self.max_connections,
            max_calls_per_connection: self.max_calls_per_connection.max(1),
            max_job_streams: self.max_job_streams,
            max_parked_polls: self.max_parked_polls,
        }
    }
}

/// What the servers log unless `RUST_LOG` says otherwise. openraft warns of every
/// failed attempt to reach a peer that is down; its errors are kept, but for the
/// one of each call that could not reach a peer ([`QuietUnreachablePeers`]).
/// rustls warns of every client that names an IP address in its TLS SNI (the
/// Node.js and Java clients do), which it ignores as it should.
pub(crate) const SERVER_LOG: &str = "info,openraft=error,rustls=error";

/// Logs to stderr: `default_filter`, or what `RUST_LOG` asks for; with `otlp`
/// (an endpoint and this process's service name), also exports the `info` spans
/// of Courier's crates there. Runs within the tokio runtime.
pub fn init_tracing(
    default_filter: &str,
    otlp: Option<(&str, &'static str)>,
) -> anyhow::Result<crate::telemetry::Telemetry> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer as _;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    // Colours only for a person at a terminal, not in a log file or a pipe.
    let ansi = std::io::stderr().is_terminal();
    let Some((endpoint, service)) = otlp else {
        // One global filter: a call site it leaves out costs nothing on the job path.
        let _ = tracing_subscriber::registry()
            .with(filter)
            .with(QuietUnreachablePeers)
            .with(
                tracing_subscriber::fmt::layer()
                    .with_writer(std::io::stderr)
                    .with_ansi(ansi),
            )
            .try_init();
        return Ok(crate::telemetry::Telemetry::default());
    };
    let (telemetry, otel) = crate::telemetry::Telemetry::otlp(endpoint, service)?;
    let courier =
        tracing_subscriber::filter::Targets::new().with_target("courier", tracing::Level::INFO);
    let _ = tracing_subscriber::registry()
        .with(QuietUnreachablePeers)
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(ansi)
                .with_filter(filter),
        )
        .with(otel.with_filter(courier))
        .try_init();
    Ok(telemetry)
}

/// Drops openraft's errors and warnings for each Raft call that could not reach a
/// peer broker, or that it did not answer: a few a second per partition for as
/// long as the peer is down or hung. The broker says
/// once that it cannot reach the peer, and again when the peer answers. Also drops,
/// once the process is stopping, openraft's errors for a call that met its Raft
/// core stopped (a peer's append-entries arriving as the partition shuts down): a
/// planned stop is not a failure.
struct QuietUnreachablePeers;

/// Set when a stop was asked for (Ctrl-C, SIGTERM).
static STOPPING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for QuietUnreachablePeers {
    fn event_enabled(
        &self,
        event: &tracing::Event<'_>,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        let meta = event.metadata();
        if *meta.level() > tracing::Level::WARN || !meta.target().starts_with("openraft") {
            return true;
        }
        let mut found = Mentions {
            stopping: STOPPING.load(std::sync::atomic::Ordering::Relaxed),
            found: false,
        };
        event.record(&mut found);
        !found.found
    }
}

/// Whether any field of an event names openraft's `Unreachable` error or a call the
/// peer did not answer, or (`stopping`) a Raft core that stopped.
struct Mentions {
    stopping: bool,
    found: bool,
}

impl tracing::field::Visit for Mentions {
    fn record_debug(&mut self, _: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if !self.found {
            let text = format!("{value:?}");
            self.found = text.contains("Unreachable")
                || text.contains(courier_broker::raft::PEER_SILENT)
                || (self.stopping && text.contains("Stopped"));
        }
    }
}

/// A token cancelled on Ctrl-C or SIGTERM.
pub(crate) fn shutdown_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            match signal(SignalKind::terminate()) {
                Ok(mut term) => {
                    tokio::select! {
                        _ = ctrl_c => {}
                        _ = term.recv() => {}
                    }
                }
                Err(_) => {
                    let _ = ctrl_c.await;
                }
            }
        }
        #[cfg(not(unix))]
        let _ = ctrl_c.await;
        STOPPING.store(true, std::sync::atomic::Ordering::Relaxed);
        tracing::info!("shutting down");
        t.cancel();
    });
    token
}

pub(crate) async fn bind(addr: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))
}

/// The worker threads of the runtime this process runs on.
pub(crate) fn runtime_workers() -> usize {
    tokio::runtime::Handle::current().metrics().num_workers()
}

/// Serves the default Prometheus registry at `/metrics` until `shutdown`, with
/// the runtime's worker threads as `courier_runtime_worker_threads`.
/// Serves `/metrics` on `addr`, and with `status` the status page of the gateway
/// that fills it (see `status_page`).
pub(crate) async fn serve_metrics(
    addr: &str,
    status: Option<courier_gateway::service::InspectorSlot>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let listener = bind(addr).await?;
    let workers = prometheus::IntGauge::new(
        "courier_runtime_worker_threads",
        "Worker threads of the process's tokio runtime (--worker-threads).",
    )?;
    workers.set(i64::try_from(runtime_workers()).unwrap_or(i64::MAX));
    if let Err(e) = prometheus::default_registry().register(Box::new(workers)) {
        tracing::warn!(error = %e, "cannot register courier_runtime_worker_threads");
    }
    let mut app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(|| async {
            let mut out = String::new();
            let families = prometheus::gather();
            match prometheus::TextEncoder::new().encode_utf8(&families, &mut out) {
                Ok(()) => (axum::http::StatusCode::OK, out),
                Err(e) => (axum::http::StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
            }
        }),
    );
    if let Some(slot) = status {
        app = app.merge(crate::status_page::router(slot));
    }
    tokio::spawn(async move {
        let r = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await;
        if let Err(e) = r {
            tracing::warn!(error = %e, "metrics server stopped");
        }
    });
    Ok(())
}

/// Waits for every task; the first failure stops the others.
pub(crate) async fn wait_all(
    mut tasks: tokio::task::JoinSet<anyhow::Result<()>>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let mut first_err = None;
    while let Some(r) = tasks.join_next().await {
        let r = r.map_err(anyhow::Error::from).and_then(|r| r);
        if let Err(e) = r {
            shutdown.cancel();
            first_err.get_or_insert(e);
        }
    }
    first_err.map_or(Ok(()), Err)
}

fn parse_peers(s: &str) -> anyhow::Result<BTreeMap<u64, String>> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            let (id, addr) = p
                .split_once('=')
                .with_context(|| format!("peer '{p}' is not ID=HOST:PORT"))?;
            let id: u64 = id
                .trim()
                .parse()
                .with_context(|| format!("peer id '{id}' is not a number"))?;
            Ok((id, addr.trim().to_string()))
        })
        .collect()
}

/// A broker must be one of the peers every broker is given (an empty list means a
/// cluster of this broker alone): another id would make a cluster of a shape the
/// others do not know, in which this broker holds no partition.
fn check_member(node_id: u64, peers: &BTreeMap<u64, String>) -> anyhow::Result<()> {
    if peers.is_empty() || peers.contains_key(&node_id) {
        return Ok(());
    }
    let ids: Vec<String> = peers.keys().map(u64::to_string).collect();
    bail!(
        "--node-id {node_id} is not one of --peers (ids {}); give every broker the same --peers, its own id among them",
        ids.join(", ")
    )
}

/// The Raft timing and compaction `a` asks for, checked.
fn raft_tuning(a: &BrokerArgs) -> anyhow::Result<RaftTuning> {
    let d = RaftTuning::default();
    let ms = |t: Option<Duration>, default| {
        t.map_or(default, |t| {
            u64::try_from(t.as_millis()).unwrap_or(u64::MAX)
        })
    };
    let tuning = RaftTuning {
        snapshot_every: a.snapshot_every,
        keep_after_snapshot: a.keep_after_snapshot,
        snapshot_every_bytes: a.snapshot_every_bytes.max(1),
        election_timeout_min_ms: ms(a.election_timeout_min, d.election_timeout_min_ms),
        election_timeout_max_ms: ms(a.election_timeout_max, d.election_timeout_max_ms),
        ..d
    };
    if tuning.election_timeout_min_ms <= tuning.heartbeat_ms {
        anyhow::bail!(
            "--election-timeout-min ({} ms) must be longer than the heartbeat ({} ms)",
            tuning.election_timeout_min_ms,
            tuning.heartbeat_ms
        );
    }
    if tuning.election_timeout_max_ms <= tuning.election_timeout_min_ms {
        anyhow::bail!(
            "--election-timeout-max ({} ms) must be longer than --election-timeout-min ({} ms)",
            tuning.election_timeout_max_ms,
            tuning.election_timeout_min_ms
        );
    }
    Ok(tuning)
}

pub async fn broker(a: BrokerArgs) -> anyhow::Result<()> {
    // Bad arguments fail before the broker says it starts.
    let mut brokers = parse_peers(&a.peers)?;
    check_member(a.node_id, &brokers)?;
    let raft = raft_tuning(&a)?;
    let cluster_tls = a.cluster_tls.load().context("cluster TLS")?;
    tracing::info!(
        worker_threads = runtime_workers(),
        cluster_tls = cluster_tls.is_some(),
        "starting the broker"
    );
    let shutdown = shutdown_on_signal();
    brokers.entry(a.node_id).or_insert_with(|| a.addr.clone());
    let listener = bind(&a.addr).await?;
    if let Some(m) = &a.metrics_addr {
        serve_metrics(m, None, shutdown.clone()).await?;
    }
    let config = BrokerConfig {
        node_id: a.node_id,
        brokers,
        partitions: a.partitions,
        replication_factor: a.replication_factor,
        data_dir: a.data_dir,
        durability: a.durability,
        raft,
        lost_gateway_grace: a.lost_gateway.lost_gateway_grace.0,
        hand_off_leadership: true,
        rebalance_after: a.rebalance.rebalance_after.0,
        cluster_tls,
        memory: a.memory.config(),
    };
    courier_broker::run(config, listener, shutdown)
        .await
        .context("broker")
}

pub async fn gateway(a: GatewayArgs) -> anyhow::Result<()> {
    let cluster_tls = a.cluster_tls.load().context("cluster TLS")?;
    tracing::info!(
        worker_threads = runtime_workers(),
        client_tls = a.client_tls.config().is_some(),
        cluster_tls = cluster_tls.is_some(),
        auth = a.auth.describe(),
        "starting the gateway"
    );
    let shutdown = shutdown_on_signal();
    let brokers: Vec<String> = a
        .brokers
        .split(',')
        .map(|b| b.trim().to_string())
        .filter(|b| !b.is_empty())
        .collect();
    if brokers.is_empty() {
        bail!("--brokers must name at least one broker");
    }
    let listener = bind(&a.addr).await?;
    let inspector = courier_gateway::service::InspectorSlot::default();
    if let Some(m) = &a.metrics_addr {
        serve_metrics(m, Some(inspector.clone()), shutdown.clone()).await?;
    }
    let config = courier_gateway::GatewayConfig {
        inspector: Some(inspector),
        brokers,
        default_long_poll: Duration::from_secs(10),
        push_enabled: !a.no_push,
        client_credit: a.client_credit.max(1),
        stream_spare_percent: a.stream_spare_percent,
        max_inflight_jobs: a.bounds.max_inflight_jobs,
        max_inflight_bytes: a.bounds.max_inflight_bytes,
        bounds: a.bounds.bounds(),
        stream_max_age: a.stream_life.stream_max_age.0,
        tls: a.client_tls.config(),
        cluster_tls,
        auth: a.auth.config(),
        ..Default::default()
    };
    courier_gateway::serve(config, listener, shutdown)
        .await
        .context("gateway")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openraft_noise_about_down_peers_and_a_stopping_core_is_dropped() {
        use std::sync::{Arc, Mutex};
        use tracing_subscriber::layer::SubscriberExt;
        #[derive(Clone, Default)]
        struct Buf(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buf::default();
        let out = buf.clone();
        let subscriber = tracing_subscriber::registry()
            .with(QuietUnreachablePeers)
            .with(
                tracing_subscriber::fmt::layer()
                    .with_ansi(false)
                    .with_writer(move || out.clone()),
            );
        tracing::subscriber::with_default(subscriber, || {
            tracing::error!(target: "openraft::network", error = ?"Unreachable(x)", "down");
            tracing::error!(target: "openraft::raft", error = ?"Fatal(Stopped)", "before the stop");
            tracing::error!(target: "courier_broker", error = ?"Unreachable", "ours");
            STOPPING.store(true, std::sync::atomic::Ordering::Relaxed);
            tracing::error!(target: "openraft::raft", error = ?"Fatal(Stopped)", "during the stop");
            tracing::error!(target: "openraft::raft", error = ?"Fatal(Panicked)", "a real one");
        });
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        assert!(!text.contains("down"), "{text}");
        assert!(text.contains("before the stop"), "{text}");
        assert!(text.contains("ours"), "{text}");
        assert!(!text.contains("during the stop"), "{text}");
        assert!(text.contains("a real one"), "{text}");
    }

    #[test]
    fn a_broker_must_be_one_of_its_peers() {
        let p = parse_peers("1=127.0.0.1:1,2=127.0.0.1:2,3=127.0.0.1:3").unwrap();
        assert!(check_member(2, &p).is_ok());
        let e = check_member(4, &p).unwrap_err().to_string();
        assert!(
            e.contains("--node-id 4 is not one of --peers (ids 1, 2, 3)"),
            "{e}"
        );
        assert!(check_member(4, &BTreeMap::new()).is_ok());
    }

    #[test]
    fn peers_parse_and_bad_ones_say_why() {
        let p = parse_peers("1=127.0.0.1:1, 2=127.0.0.1:2").unwrap();
        assert_eq!(p.get(&2).map(String::as_str), Some("127.0.0.1:2"));
        assert!(parse_peers("x=1").unwrap_err().to_string().contains("'x'"));
        assert!(parse_peers("127.0.0.1:1")
            .unwrap_err()
            .to_string()
            .contains("ID=HOST:PORT"));
    }

    #[test]
    fn election_timeouts_default_and_bad_ones_say_why() {
        #[derive(clap::Parser)]
        struct Args {
            #[command(flatten)]
            broker: BrokerArgs,
        }
        let tuning = |extra: &[&str]| {
            let base = [
                "courier",
                "--node-id",
                "1",
                "--addr",
                "a:1",
                "--peers",
                "1=a:1",
            ];
            let a = <Args as clap::Parser>::try_parse_from(base.iter().chain(extra))
                .expect("arguments parse");
            raft_tuning(&a.broker).map_err(|e| e.to_string())
        };
        let d = tuning(&[]).unwrap();
        assert_eq!(
            (d.election_timeout_min_ms, d.election_timeout_max_ms),
            (300, 600)
        );
        let t = tuning(&[
            "--election-timeout-min",
            "1s",
            "--election-timeout-max",
            "2s",
        ])
        .unwrap();
        assert_eq!(
            (t.election_timeout_min_ms, t.election_timeout_max_ms),
            (1000, 2000)
        );
        let e = tuning(&["--election-timeout-min", "700ms"]).unwrap_err();
        assert!(e.contains("--election-timeout-max (600 ms) must be longer than --election-timeout-min (700 ms)"), "{e}");
        let e = tuning(&["--election-timeout-min", "100ms"]).unwrap_err();
        assert!(
            e.contains("must be longer than the heartbeat (150 ms)"),
            "{e}"
        );
    }

    #[test]
    fn the_lost_gateway_grace_is_a_duration_or_off() {
        assert_eq!(parse_grace("10s").unwrap().0, Some(Duration::from_secs(10)));
        assert_eq!(parse_grace("off").unwrap().0, None);
        assert!(parse_grace("soon").unwrap_err().contains("10s"));
    }
}
