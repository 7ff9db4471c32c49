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
//! - [`metrics`]: Prometheus metrics.
//!
//! [`run`] starts a broker on a listener and stops it when told to.

pub mod claims;
pub mod config;
pub mod engine;
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

/// Why a broker could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("storage: {0}")]
    Storage(String),
    #[error("raft: {0}")]
    Raft(String),
    #[error("gRPC server: {0}")]
    Server(#[from] tonic::transport::Error),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// Largest message between brokers and gateways: a command may carry documents of
/// up to 4 MiB and a Raft append carries many commands.
pub const MAX_MESSAGE_BYTES: usize = 256 * 1024 * 1024;

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
    // The caller's token asks this broker to stop (`signal`); this one stops its
    // tasks and server, once its partitions are handed over (see `hand_off_all`).
    let signal = shutdown;
    let shutdown = CancellationToken::new();
    let _stop_on_return = shutdown.clone().drop_guard();
    config.validate().map_err(Error::Config)?;
    let config = Arc::new(config);
    std::fs::create_dir_all(&config.data_dir)?;
    store::check_format(&config.data_dir).map_err(Error::Storage)?;
    store::check_shape(&config.data_dir, &config.shape()).map_err(Error::Storage)?;
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

    let mut partitions = BTreeMap::new();
    for p in 1..=config.partitions {
        if !config.replicas(p).contains(&config.node_id) {
            continue;
        }
        let id = PartitionId(p);
        let raft_config = Arc::new(
            config
                .raft_config(p)
                .validate()
                .map_err(|e| Error::Config(e.to_string()))?,
        );
        let log =
            LogStore::open(&db, p, config.node_id).map_err(|e| Error::Storage(e.to_string()))?;
        let sm = StateMachine::open(&db, id, config.data_dir.join("snapshots"))
            .map_err(|e| Error::Storage(e.to_string()))?
            .with_durable(log.durable());
        let shared = sm.shared();
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
            shared,
            notices.clone(),
            registry.clone(),
            config.lost_gateway_grace,
            longer_log,
            &tasks,
            shutdown.clone(),
        );
        partitions.insert(p, part);
    }
    let partitions: service::Partitions = Arc::new(partitions);

    let server_tls = match &config.cluster_tls {
        Some(tls) => Some(
            tls.server_config()
                .map_err(|e| Error::Config(e.to_string()))?,
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
        shutdown.clone(),
    );
    let server = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(5)))
        .http2_keepalive_timeout(Some(Duration::from_secs(5)))
        .add_service(
            RaftServer::new(RaftService {
                partitions: partitions.clone(),
                peers: peers.clone(),
                shutdown: shutdown.clone(),
            })
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES),
        )
        .add_service(
            BrokerServer::new(BrokerService {
                config: config.clone(),
                partitions: partitions.clone(),
                notices,
                registry,
                shutdown: shutdown.clone(),
            })
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES),
        )
        .serve_with_incoming_shutdown(incoming, shutdown.clone().cancelled_owned());
    let server = tokio::spawn(server);

    for part in partitions.values() {
        tasks.spawn(initialize(config.clone(), part.clone(), shutdown.clone()));
        tasks.spawn(track_leadership(part.clone(), shutdown.clone()));
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
    if let Err(e) = db.sync() {
        tracing::warn!(error = %e, "final flush failed");
    }
    tracing::info!(node = config.node_id, "broker stopped");
    Ok(())
}

/// How often the election driver looks at its partitions, and how late it must
/// wake to tell that this process stood still.
const ELECTION_TICK: Duration = Duration::from_millis(10);
const PAUSE_THRESHOLD: Duration = Duration::from_millis(250);

/// Starts elections for this broker's replicas, in place of openraft's timer
/// (`enable_elect` is off, see [`BrokerConfig::raft_config`]): a follower stands
/// when it has heard nothing of a leader (no append-entries, no vote granted) for
/// the leader's lease and its election timeout, drawn anew for each election, and
/// later still after a voter refused it for a longer log ([`election_wait`]), as
/// openraft 0.9 would. Unlike openraft's timer, it tells a silent leader from a
/// pause of this process (frozen by SIGSTOP, a stalled virtual machine, starved of
/// CPU): after one it counts every replica's silence from the moment it runs again.
/// openraft's first tick after a pause starts an election at a higher term, and a
/// healthy leader that sees it steps down: a stall of about half a second on
/// partitions that never had a problem (openraft 0.9 has no pre-vote).
async fn drive_elections(
    parts: Vec<Arc<Partition>>,
    timeouts: (u64, u64),
    shutdown: CancellationToken,
) {
    use rand::Rng;
    metrics::PAUSES.inc_by(0);
    let (min, max) = (timeouts.0, timeouts.1.max(timeouts.0));
    let draw = || Duration::from_millis(rand::rng().random_range(min..=max));
    let lease = Duration::from_millis(max);
    let mut timeout: Vec<Duration> = parts.iter().map(|_| draw()).collect();
    let mut tick = tokio::time::interval(ELECTION_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = std::time::Instant::now();
    // Silence is counted from now, not from when each replica was opened: loading
    // a partition with millions of open jobs takes seconds, and the replicas opened
    // first would otherwise stand at once, against leaders that are alive.
    for p in &parts {
        p.heard_from_leader_at(last);
    }
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let now = std::time::Instant::now();
        let late = now.duration_since(last).saturating_sub(ELECTION_TICK);
        last = now;
        if late >= PAUSE_THRESHOLD {
            for p in &parts {
                p.heard_from_leader_at(now);
            }
            metrics::PAUSES.inc();
            tracing::warn!(
                stood_still = ?late,
                "this broker stood still (frozen, or starved of CPU); its replicas give their leaders a full election timeout from now"
            );
            continue;
        }
        for (i, p) in parts.iter().enumerate() {
            let (voters, candidate, committed) = {
                let m = p.raft.metrics();
                let m = m.borrow();
                if m.state == openraft::ServerState::Leader {
                    continue;
                }
                let membership = m.membership_config.membership();
                if !membership.voter_ids().any(|v| v == p.node_id) {
                    continue;
                }
                (
                    membership.voter_ids().count(),
                    m.state == openraft::ServerState::Candidate,
                    m.vote.is_committed(),
                )
            };
            let wait = election_wait(
                Silence {
                    voters,
                    candidate,
                    committed,
                    longer_log_seen: p.longer_log.seen(),
                },
                lease,
                timeout[i],
            );
            if now.duration_since(p.last_heard_from_leader()) <= wait {
                continue;
            }
            p.heard_from_leader_at(now);
            p.longer_log.clear();
            timeout[i] = draw();
            if let Err(e) = p.raft.trigger().elect().await {
                tracing::warn!(partition = p.id.0, error = %e, "could not start an election");
            }
        }
    }
}

/// What a replica that does not lead knows when its election driver looks at it.
#[derive(Clone, Copy, Debug)]
struct Silence {
    /// Voters of the partition, this replica among them.
    voters: usize,
    /// Whether it stands for election now.
    candidate: bool,
    /// Whether the vote it holds is a leader's, granted by a quorum.
    committed: bool,
    /// Whether a voter refused its last candidacy for a longer log
    /// ([`raft::LongerLog`]).
    longer_log_seen: bool,
}

/// How long a replica must have heard nothing of a leader before it stands for
/// election, as openraft 0.9's own timer has it: `lease` is the leader's lease (the
/// longest election timeout), `timeout` this election's timeout, drawn at random.
fn election_wait(s: Silence, lease: Duration, timeout: Duration) -> Duration {
    let wait = match s {
        // The only voter: at once, and again only if that did not end.
        Silence {
            voters: 1,
            candidate: false,
            ..
        } => return Duration::ZERO,
        Silence {
            committed: true, ..
        } => lease + timeout,
        _ => timeout,
    };
    if s.longer_log_seen {
        wait + lease * raft::LongerLog::BACK_OFF
    } else {
        wait
    }
}

/// Hands every partition this broker leads to a follower that has its whole log,
/// all at once, before the broker stops: see [`Partition::hand_off`].
async fn hand_off_all(
    partitions: &service::Partitions,
    peers: &PeerChannels,
    config: &BrokerConfig,
) {
    let handoffs = partitions.values().map(|part| async move {
        let ask = |to, term| ask_to_elect(peers, config, part.id, to, term);
        let span = tracing::info_span!("hand-off", partition = part.id.0);
        tracing::Instrument::instrument(part.hand_off(ask, None), span).await
    });
    futures::future::join_all(handoffs).await;
}

/// Asks broker `to` to stand for election for `partition` now, as its leader in
/// `term` hands the partition over (see [`Partition::hand_off`]).
async fn ask_to_elect(
    peers: &PeerChannels,
    config: &BrokerConfig,
    partition: PartitionId,
    to: NodeId,
    term: u64,
) -> Result<(), String> {
    let addr = config
        .brokers
        .get(&to)
        .ok_or_else(|| format!("broker {to} is not in the configuration"))?;
    let req = raft::ElectRequest {
        leader: config.node_id,
        term,
    };
    peers
        .ask_to_elect(addr, partition, &req, Duration::from_millis(500))
        .await
}

/// How often a broker looks for partitions it leads in place of their preferred
/// leader.
const REBALANCE_TICK: Duration = Duration::from_secs(1);

/// How far behind the leader's log the preferred leader may be and still count as
/// caught up while it waits for its turn: the hand-off itself waits until it has
/// every entry, with the partition's writes held, so only a few may be missing.
const REBALANCE_MAX_LAG: u64 = 64;

/// Hands each partition this broker leads in place of its preferred leader (see
/// [`BrokerConfig::preferred_leader`]) back to it, once the preferred leader has
/// been reachable and caught up for `settle`: after a failure or a rolling
/// restart, elections leave leaders wherever they happened to win, often most of
/// them on one broker, which then does most of the work. One partition at a time;
/// each hand-off holds the partition's writes for about one Raft round trip (see
/// [`Partition::hand_off`]). A partition's preferred leader never hands it on, so
/// leadership settles instead of moving around.
async fn rebalance_leaders(
    parts: Vec<Arc<Partition>>,
    peers: PeerChannels,
    config: Arc<BrokerConfig>,
    settle: Duration,
    handing_off: Arc<tokio::sync::Mutex<()>>,
    shutdown: CancellationToken,
) {
    use tokio::time::Instant;
    // Per partition: since when its preferred leader has looked ready to take over.
    let mut ready_since: Vec<Option<Instant>> = vec![None; parts.len()];
    let mut tick = tokio::time::interval(REBALANCE_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        for (i, part) in parts.iter().enumerate() {
            let Some(preferred) = config.preferred_leader(part.id.0) else {
                continue;
            };
            let ready = preferred != config.node_id
                && !peers.is_down(preferred)
                && {
                    let m = part.raft.metrics();
                    let m = m.borrow();
                    let matched = m
                        .replication
                        .as_ref()
                        .and_then(|r| r.get(&preferred))
                        .and_then(|l| l.map(|l| l.index));
                    m.state == openraft::ServerState::Leader
                        && matches!((matched, m.last_log_index), (Some(at), Some(last)) if at + REBALANCE_MAX_LAG >= last)
                };
            if !ready {
                ready_since[i] = None;
                continue;
            }
            let since = *ready_since[i].get_or_insert_with(Instant::now);
            if since.elapsed() < settle {
                continue;
            }
            ready_since[i] = None;
            // Taken before looking at whether the broker stops, which is said
            // before the stop's hand-off takes it: that one then waits for this one.
            let _one_at_a_time = handing_off.lock().await;
            if part.is_stopping() {
                return;
            }
            tracing::info!(
                partition = part.id.0,
                to = preferred,
                "handing the partition back to its preferred leader"
            );
            let ask = |to, term| ask_to_elect(&peers, &config, part.id, to, term);
            let span = tracing::info_span!("rebalance", partition = part.id.0);
            // Not cut short by a stop: a hand-off dropped halfway would leave the
            // partition's proposer closed. It ends within a few seconds.
            let handed =
                tracing::Instrument::instrument(part.hand_off(ask, Some(preferred)), span).await;
            let outcome = if handed == Some(preferred) {
                metrics::label::rebalance::HANDED_OVER
            } else {
                metrics::label::rebalance::KEPT
            };
            metrics::REBALANCES.with_label_values(&[outcome]).inc();
        }
    }
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

/// Keeps the leadership gauge of a partition current, and the partition's own
/// record of since when it leads.
async fn track_leadership(part: Arc<Partition>, shutdown: CancellationToken) {
    // Changes of role or leader only, not every entry.
    let mut m = part.raft.server_metrics();
    let gauge =
        metrics::LEADER.with_label_values(&[&part.node_id.to_string(), &part.id.to_string()]);
    loop {
        part.note_role();
        gauge.set(i64::from(part.is_leader()));
        tokio::select! {
            _ = shutdown.cancelled() => return,
            r = m.changed() => if r.is_err() { return },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_millis(600);
    const TIMEOUT: Duration = Duration::from_millis(400);

    fn silence(voters: usize, candidate: bool, committed: bool, longer: bool) -> Silence {
        Silence {
            voters,
            candidate,
            committed,
            longer_log_seen: longer,
        }
    }

    fn wait(s: Silence) -> Duration {
        election_wait(s, LEASE, TIMEOUT)
    }

    #[test]
    fn a_follower_of_a_leader_waits_out_its_lease_and_a_candidate_its_timeout() {
        // It followed a leader (the vote it holds is committed): lease, then timeout.
        assert_eq!(wait(silence(3, false, true, false)), LEASE + TIMEOUT);
        // It granted a vote, or stands itself: the timeout alone.
        assert_eq!(wait(silence(3, false, false, false)), TIMEOUT);
        assert_eq!(wait(silence(3, true, false, false)), TIMEOUT);
        // The only voter stands at once, and waits for an election of its own
        // that did not end.
        assert_eq!(wait(silence(1, false, false, false)), Duration::ZERO);
        assert_eq!(wait(silence(1, false, false, true)), Duration::ZERO);
        assert_eq!(wait(silence(1, true, false, false)), TIMEOUT);
    }

    /// The survivor a voter with a longer log refused stands again only after that
    /// voter's longest wait has surely run out, so the voter stands first: with both
    /// on the same timeout, they took turns raising the term for as long as their
    /// timers kept in step, and no leader was elected (a cluster test's failure).
    #[test]
    fn a_candidate_refused_for_a_longer_log_lets_that_voter_stand_first() {
        let refused = wait(silence(3, true, false, true));
        assert_eq!(refused, TIMEOUT + 2 * LEASE);
        // Longer than the voter's longest wait after it last stood or granted a
        // vote: the longest timeout.
        assert!(refused > LEASE);
        assert_eq!(wait(silence(3, false, false, true)), TIMEOUT + 2 * LEASE);
        assert_eq!(
            wait(silence(3, false, true, true)),
            LEASE + TIMEOUT + 2 * LEASE
        );
    }
}
