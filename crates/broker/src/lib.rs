//! # Layout
//! - [`engine`]: the pure job state machine: (state, command) -> (reply, effects, changes).
//! - [`store`]: fjall storage: the Raft log, the engine state with last-applied, snapshots.
//! - [`raft`]: openraft type config and the gRPC network client.
//! - [`partition`]: a hosted partition: its proposer (group commit), leader timers,
//!   and the pusher that carries pushed jobs to gateways.
//! - [`claims`]: activations a leader has in flight, so polls do not propose in vain.
//! - [`registry`]: the job-stream registry: which gateway streams take which jobs.
//! - [`service`]: the gRPC services for peer brokers and gateways.
//! - [`config`]: static cluster configuration and replica placement.
//! - `elections`: this broker's election timer, which tells a silent leader from a
//!   pause of its own process.
//! - `leadership`: leadership handed off at a stop, and back to preferred brokers.
//! - `failstop`: the first storage fault stops the broker's replicas for good.
//! - `compaction`: snapshots by the bytes written to a log, besides by entries.
//! - [`metrics`]: Prometheus metrics.
//!
//! [`run`] starts a broker on a listener and stops it when told to.

pub mod claims;
mod compaction;
pub mod config;
mod elections;
pub mod engine;
mod failstop;
mod leadership;
pub mod metrics;
pub mod partition;
// openraft's error types (StorageError, RPCError) are large; their signatures are openraft's.
#[allow(clippy::result_large_err)]
pub mod raft;
pub mod registry;
pub mod service;
#[allow(clippy::result_large_err)]
pub mod store;

pub use config::{BrokerConfig, RaftTuning};
pub use store::Durability;

use courier_proto::cluster::{broker_server::BrokerServer, raft_server::RaftServer};
use courier_proto::domain::{NodeId, PartitionId};
use openraft::error::{InitializeError, RaftError};
use openraft::BasicNode;
use partition::Partition;
use raft::{Network, PeerChannels, Raft};
use service::{BrokerService, RaftService};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use store::{log::LogStore, sm::StateMachine, Db};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use elections::drive_elections;
use leadership::{hand_off_all, rebalance_leaders};

/// Why a broker could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid configuration: {0}")]
    Config(#[from] config::ConfigError),
    #[error("storage: {0}")]
    Storage(String),
    #[error(transparent)]
    DataDir(#[from] store::DataDirError),
    #[error("raft: {0}")]
    Raft(String),
    #[error("gRPC server: {0}")]
    Server(#[from] tonic::transport::Error),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// Takes a broker out of [`courier_proto::api::InProcess`] when it stops.
struct Unregister(courier_proto::api::InProcess, String);

impl Drop for Unregister {
    fn drop(&mut self) {
        self.0.unregister(&self.1);
    }
}

/// How long a stopping broker waits for its connections to close.
const SERVER_DRAIN: Duration = Duration::from_millis(500);

/// Says loudly that a broker without cluster TLS listens where other machines can
/// reach it: anyone who can connect may then elect leaders, pose as a gateway or
/// create jobs past every check.
fn warn_if_open(listener: &TcpListener) {
    let Ok(addr) = listener.local_addr() else {
        return;
    };
    if !addr.ip().is_loopback() {
        tracing::warn!(
            %addr,
            "THIS BROKER'S PORT IS OPEN: it listens beyond loopback without cluster TLS, so \
             anyone who reaches it can take part in the cluster. Give every broker and \
             gateway --cluster-ca, --cluster-cert and --cluster-key (see docs/security.md)"
        );
    }
}

/// Runs a broker on `listener` until `shutdown` is cancelled, then stops every task
/// it started and returns.
pub async fn run(
    config: BrokerConfig,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    run_with(config, listener, shutdown, None).await
}

/// [`run`], reachable besides by gateways of this process through `in_process`
/// (at its configured address) for as long as it runs.
pub async fn run_with(
    config: BrokerConfig,
    listener: TcpListener,
    shutdown: CancellationToken,
    in_process: Option<courier_proto::api::InProcess>,
) -> Result<(), Error> {
    // The caller's token asks this broker to stop (`signal`); this one stops its
    // tasks and server, once its partitions are handed over (see `hand_off_all`).
    let signal = shutdown;
    let shutdown = CancellationToken::new();
    let _stop_on_return = shutdown.clone().drop_guard();
    config.validate()?;
    let config = Arc::new(config);
    std::fs::create_dir_all(&config.data_dir)?;
    store::check_format(&config.data_dir)?;
    store::check_shape(&config.data_dir, &config.shape())?;
    let db = Db::open(&config.data_dir.join("db"), config.durability).map_err(|e| match e {
        fjall::Error::Locked => Error::Storage(format!(
            "the data directory {} is in use by another running broker (or courier dev): stop that one, or give this one another data directory",
            config.data_dir.display()
        )),
        e => Error::Storage(e.to_string()),
    })?;
    let peers = PeerChannels::new(
        shutdown.clone(),
        config.cluster_tls.as_ref().map(|t| t.client_config()),
    );
    let addrs = Arc::new(config.brokers.clone());
    let (notices, _) = tokio::sync::broadcast::channel(4096);
    let registry = Arc::new(registry::JobStreamRegistry::for_node(config.node_id));
    let tasks = TaskTracker::new();
    let fault = db.fault().clone();

    let mut partitions = BTreeMap::new();
    let mut written = Vec::new();
    for p in 1..=config.partitions {
        if !config.replicas(p).contains(&config.node_id) {
            continue;
        }
        let id = PartitionId(p);
        let raft_config = Arc::new(
            config
                .raft_config(p)
                .validate()
                .map_err(|e| config::ConfigError::Raft(e.to_string()))?,
        );
        let log =
            LogStore::open(&db, p, config.node_id).map_err(|e| Error::Storage(e.to_string()))?;
        let sm = StateMachine::open(&db, id, config.data_dir.join("snapshots"))
            .map_err(|e| Error::Storage(e.to_string()))?
            .with_durable(log.durable())
            .with_payload_budget(config.memory.payload_budget);
        let shared = sm.shared();
        let intake = sm.intake();
        let written_bytes = log.written_bytes();
        let longer_log = Arc::new(raft::LongerLog::default());
        let network = Network {
            partition: id,
            peers: peers.clone(),
            addrs: addrs.clone(),
            durable: log.durable(),
            longer_log: longer_log.clone(),
        };
        let raft = Raft::new(config.node_id, raft_config, network, log, sm)
            .await
            .map_err(|e| Error::Raft(e.to_string()))?;
        let part = Partition::start(
            id,
            config.node_id,
            raft,
            intake,
            shared,
            notices.clone(),
            registry.clone(),
            config.lost_gateway_grace,
            config.memory.max_partition_bytes,
            longer_log,
            &tasks,
            shutdown.clone(),
        );
        written.push((part.clone(), written_bytes));
        partitions.insert(p, part);
    }
    let partitions: service::Partitions = Arc::new(partitions);

    let server_tls = match &config.cluster_tls {
        Some(tls) => Some(
            tls.server_config()
                .map_err(|e| config::ConfigError::Raft(e.to_string()))?,
        ),
        None => {
            warn_if_open(&listener);
            None
        }
    };
    let incoming = courier_proto::tls::incoming(
        listener,
        server_tls,
        metrics::peer_refused,
        None,
        shutdown.clone(),
    );
    let broker_service = BrokerService {
        config: config.clone(),
        partitions: partitions.clone(),
        notices,
        registry,
        fault: fault.clone(),
        shutdown: shutdown.clone(),
    };
    let own_addr = config
        .brokers
        .get(&config.node_id)
        .cloned()
        .unwrap_or_default();
    let _unregister = in_process.map(|brokers| {
        brokers.register(&own_addr, Arc::new(broker_service.clone()));
        Unregister(brokers, own_addr.clone())
    });
    // grpc.health.v1, for probes and load balancers: serving until the broker stops
    // or its storage fails.
    let (health, health_service) = tonic_health::server::health_reporter();
    failstop::set_health(&health, tonic_health::ServingStatus::Serving).await;
    metrics::STORAGE_FAILED
        .with_label_values(&[&config.node_id.to_string()])
        .set(0);
    let server = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(5)))
        .http2_keepalive_timeout(Some(Duration::from_secs(5)))
        .add_service(health_service)
        .add_service(
            RaftServer::new(RaftService {
                partitions: partitions.clone(),
                peers: peers.clone(),
                shutdown: shutdown.clone(),
            })
            .max_decoding_message_size(courier_proto::MAX_CLUSTER_MESSAGE_BYTES)
            .max_encoding_message_size(courier_proto::MAX_CLUSTER_MESSAGE_BYTES),
        )
        .add_service(
            BrokerServer::new(broker_service.clone())
                .max_decoding_message_size(courier_proto::MAX_CLUSTER_MESSAGE_BYTES)
                .max_encoding_message_size(courier_proto::MAX_CLUSTER_MESSAGE_BYTES),
        )
        .serve_with_incoming_shutdown(incoming, shutdown.clone().cancelled_owned());
    let server = tokio::spawn(server);

    for part in partitions.values() {
        tasks.spawn(initialize(config.clone(), part.clone(), shutdown.clone()));
        tasks.spawn(track_leadership(
            part.clone(),
            fault.clone(),
            shutdown.clone(),
        ));
        metrics::POSITIONS.track(part);
    }
    tasks.spawn(drive_elections(
        partitions.values().cloned().collect(),
        (
            config.raft.election_timeout_min_ms,
            config.raft.election_timeout_max_ms,
        ),
        shutdown.clone(),
    ));
    tasks.spawn(compaction::snapshot_by_size(
        written,
        config.raft.snapshot_every_bytes,
        shutdown.clone(),
    ));
    tasks.spawn(failstop::stop_on_fault(
        config.node_id,
        fault.clone(),
        partitions.clone(),
        health.clone(),
        shutdown.clone(),
    ));
    metrics::init();
    // One hand-off at a time: a rebalance's ends before the stop's begin.
    let handing_off = Arc::new(tokio::sync::Mutex::new(()));
    if let Some(settle) = config.rebalance_after {
        if config.replication_factor > 1 {
            tasks.spawn(rebalance_leaders(
                partitions.values().cloned().collect(),
                peers.clone(),
                config.clone(),
                settle,
                handing_off.clone(),
                shutdown.clone(),
            ));
        }
    }
    tracing::info!(
        node = config.node_id,
        partitions = ?partitions.keys().collect::<Vec<_>>(),
        "broker started"
    );

    signal.cancelled().await;
    failstop::set_health(&health, tonic_health::ServingStatus::NotServing).await;
    for part in partitions.values() {
        part.begin_stopping();
    }
    if config.hand_off_leadership {
        let _one_at_a_time = handing_off.lock().await;
        hand_off_all(&partitions, &peers, &config).await;
    }
    shutdown.cancel();
    tasks.close();
    for part in partitions.values() {
        if let Err(e) = part.raft.shutdown().await {
            tracing::warn!(partition = part.id.0, error = %e, "raft shutdown failed");
        }
    }
    tasks.wait().await;
    // A graceful close waits for every connection to end, and the connection of a
    // peer that is frozen or cut off never does (until keepalive gives up, 10 s):
    // those still open after SERVER_DRAIN are dropped.
    let mut server = server;
    match tokio::time::timeout(SERVER_DRAIN, &mut server).await {
        Ok(Ok(r)) => r?,
        Ok(Err(e)) => tracing::warn!(error = %e, "server task ended abnormally"),
        Err(_) => {
            tracing::warn!(
                "connections still open {} ms into the shutdown were dropped",
                SERVER_DRAIN.as_millis()
            );
            server.abort();
        }
    }
    // After a storage fault nothing more is flushed (see `failstop`).
    if fault.get().is_none() {
        if let Err(e) = db.sync() {
            tracing::warn!(error = %e, "final flush failed");
        }
    }
    tracing::info!(node = config.node_id, "broker stopped");
    Ok(())
}

/// Initializes a partition's membership once. The first replica does it at once;
/// the others wait (longer the later they are placed) and only act if still nothing
/// reached them, so a cluster forms even when the first replica's broker is down,
/// without replicas racing each other in the normal case.
async fn initialize(config: Arc<BrokerConfig>, part: Arc<Partition>, shutdown: CancellationToken) {
    let replicas = config.replicas(part.id.0);
    let rank = replicas
        .iter()
        .position(|id| *id == config.node_id)
        .unwrap_or(0) as u64;
    if rank > 0 {
        let wait = Duration::from_millis(rank * 3 * config.raft.election_timeout_max_ms);
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
    match part.raft.is_initialized().await {
        Ok(false) => {}
        Ok(true) => return,
        Err(e) => {
            tracing::warn!(partition = part.id.0, error = %e, "cannot read raft state");
            return;
        }
    }
    // Someone else's vote request or entries may be on the way: a voted replica has
    // been contacted, and initializing now would only be refused.
    if part.raft.metrics().borrow().vote.leader_id().term > 0 {
        return;
    }
    let members: BTreeMap<u64, BasicNode> = replicas
        .into_iter()
        .filter_map(|id| config.brokers.get(&id).map(|a| (id, BasicNode::new(a))))
        .collect();
    match part.raft.initialize(members).await {
        Ok(()) => tracing::info!(partition = part.id.0, "partition membership initialized"),
        Err(RaftError::APIError(InitializeError::NotAllowed(_))) => {}
        Err(e) => tracing::warn!(partition = part.id.0, error = %e, "initialize failed"),
    }
}

/// Keeps the leadership gauge of a partition current, and its leader state in
/// step with Raft's role (see `Partition::sync_leadership`); a replica stopped by
/// a storage error becomes the broker's fault.
async fn track_leadership(
    part: Arc<Partition>,
    fault: Arc<store::Fault>,
    shutdown: CancellationToken,
) {
    // Changes of role or leader only, not every entry.
    let mut m = part.raft.server_metrics();
    let gauge =
        metrics::LEADER.with_label_values(&[&part.node_id.to_string(), &part.id.to_string()]);
    loop {
        part.sync_leadership();
        gauge.set(i64::from(part.is_leader()));
        failstop::note_fatal(&part, &fault);
        tokio::select! {
            _ = shutdown.cancelled() => return,
            r = m.changed() => if r.is_err() { return },
        }
    }
}
