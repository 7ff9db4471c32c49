//! One partition on this broker: its Raft node, its proposer and its leader-side timers.
//!
//! The proposer is group commit at the application level: Raft entries are
//! expensive and commands are cheap, so everything that arrives while Raft flushes
//! the previous entry is drained into one [`Batch`] (see [`ready_to_propose`]).

use crate::claims::{Claims, Outlook};
use crate::engine::{
    Batch, Effect, FlushSignal, Handed, LogCommand, Push, PushOrigin, PushTarget, Recipient,
};
use crate::metrics::{self, label};
use crate::raft::Raft;
use crate::registry::{JobStreamRegistry, PushOutcome, SentPush};
use crate::store::sm::SharedState;
use courier_proto::cluster::{
    broker_message, BrokerMessage, HeldJob, JobFinished, JobsAvailable, Leading,
};
use courier_proto::domain::{
    ActivatedJob, ActivationProps, BrokerError, Command, JobKey, NodeId, PartitionId, Reply,
    RequestId,
};
use courier_proto::push_refusal::DISOWNED;
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use openraft::error::{ClientWriteError, RaftError};
use openraft::ServerState;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{broadcast, mpsc, oneshot, Notify};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Most commands in one log entry.
const MAX_BATCH: usize = 2048;
/// About the most bytes of commands in one log entry: an entry must replicate
/// well inside the AppendEntries timeout.
const MAX_BATCH_BYTES: usize = 1024 * 1024;
/// Commands that may wait for the proposer before callers get RESOURCE_EXHAUSTED.
const QUEUE_CAPACITY: usize = 20_000;
/// Entries a partition may have in flight at once.
const MAX_INFLIGHT: usize = 2;
/// How long completions alone wait for a command that makes work runnable (a
/// create, a poll, a failure with retries): they ride in its entry instead of
/// costing an entry, and an fdatasync on every replica, of their own. Under load
/// that halves the log writes, and a create no longer queues behind a completion's
/// flush; nothing but the completion's own answer waits on it.
const COMPLETION_HOLD: Duration = Duration::from_millis(3);
/// Completions are held only while such commands flow: the last two arrived at
/// most this far apart, and the last at most this long before the completions, so
/// the next is likely within the hold. On a quiet partition (a lone job created,
/// then completed) there is nothing to ride with and no create to get in the way
/// of, so a completion is proposed at once, not 3 ms later.
const BUSY_LOOKBACK: Duration = Duration::from_millis(6);
/// Most timed-out or recurring jobs handled in one command.
const MAX_TIMER_KEYS: usize = 1000;
/// Least time between two rounds of timeouts and back-offs ended (unless the last
/// round was full): deadlines and back-offs end up to this late, and a job whose
/// activation lasts less than a round trip (a 1 ms timeout) cycles at most this
/// often between timing out and being pushed again, instead of as fast as the log
/// commits. Zeebe checks its deadlines once a second.
const TIMER_PACE: Duration = Duration::from_millis(100);
/// Most jobs pushed per back-fill round (one log entry); a round is also bounded by
/// the stream's free credit.
const BACKFILL_BATCH: u32 = 512;
/// Yields wait this long (plus up to as much again, at random) to be proposed
/// together: refused pushes never turn into a burst of log writes.
const YIELD_PACE: Duration = Duration::from_millis(10);
/// How long a new leader waits for the link of a gateway it must ask about its
/// predecessors' pushes.
const GATEWAY_GRACE: Duration = Duration::from_secs(10);
/// How long a gateway has to answer a `HeldQuery`; past it, the activations asked
/// about are left to their deadlines.
const HELD_ANSWER_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a log entry may take to commit before the proposer warns about it (and
/// again after each as long).
const SLOW_ENTRY: Duration = Duration::from_secs(2);
/// A leader that has heard from no majority of its partition's replicas for this
/// long has lost it (they are down or cut off): it cannot commit, and another may
/// lead elsewhere. It refuses commands at once (UNAVAILABLE) instead of holding them
/// until their deadline, and reports the partition unhealthy. Heartbeats go every
/// 150 ms; 3 s leaves room for followers slowed by a loaded machine.
const MAJORITY_LOST_AFTER: Duration = Duration::from_secs(3);
/// How often a leader checks whether it still hears from a majority.
const MAJORITY_CHECK_EVERY: Duration = Duration::from_millis(250);
/// Most activations asked about in one `HeldQuery`.
const HELD_QUERY_BATCH: usize = 4096;

/// The leader's wall clock in epoch ms; decided before proposing, never in apply.
pub fn now_ms() -> i64 {
    courier_proto::domain::epoch_ms()
}

struct Proposal {
    cmd: LogCommand,
    /// The gateway that sent a command ending an activation (complete, fail, throw
    /// error): it needs no word from this leader about that end.
    ends_from: Option<(JobKey, Arc<str>)>,
    reply: oneshot::Sender<Result<Reply, BrokerError>>,
}

/// A command's approximate size in a log entry: its documents dominate.
fn approx_bytes(cmd: &LogCommand) -> usize {
    use courier_proto::domain::Command;
    match cmd {
        LogCommand::Client { cmd, .. } | LogCommand::ClientIn { cmd, .. } => match cmd.inner() {
            Command::Create(jobs) => jobs
                .iter()
                .map(|j| j.variables.len() + j.custom_headers.len() + 128)
                .sum(),
            Command::Complete {
                variables: Some(v), ..
            }
            | Command::Fail {
                variables: Some(v), ..
            }
            | Command::ThrowError {
                variables: Some(v), ..
            } => v.len() + 128,
            _ => 128,
        },
        LogCommand::TimeOut { keys, .. } | LogCommand::Recur { keys, .. } => keys.len() * 24 + 128,
        _ => 128,
    }
}

/// The jobs an Activate in flight may take, claimed from when it is proposed until
/// its caller has the answer (or goes away). On release, the jobs of its tenants
/// still activatable are announced: it may have taken fewer than it claimed, and
/// polls answered "claimed" meanwhile may be parked on them.
struct ActivationClaim<'a> {
    partition: &'a Partition,
    job_type: String,
    tenants: Vec<String>,
    max_jobs: u32,
    /// The request id of a once-only activation.
    request: Option<RequestId>,
}

impl Drop for ActivationClaim<'_> {
    fn drop(&mut self) {
        let p = self.partition;
        let mut claims = p.claims.lock().unwrap_or_else(|e| e.into_inner());
        claims.release(&self.job_type, &self.tenants, self.max_jobs, self.request);
        drop(claims);
        if !p.is_leader() {
            return;
        }
        let left: Vec<&String> = {
            let applied = p.shared.read();
            self.tenants
                .iter()
                .filter(|t| applied.state.queued(&self.job_type, t) > 0)
                .collect()
        };
        for t in left {
            p.announce(self.job_type.clone(), t.clone());
        }
    }
}

/// Notices to gateways, fanned out to every link of this broker.
pub type Notices = broadcast::Sender<BrokerMessage>;

/// A partition replica hosted on this broker.
pub struct Partition {
    pub id: PartitionId,
    pub node_id: NodeId,
    pub raft: Raft,
    shared: Arc<SharedState>,
    proposals: mpsc::Sender<Proposal>,
    registry: Arc<JobStreamRegistry>,
    notices: Notices,
    /// Jobs this leader pushed, from the moment the push leaves until the end of
    /// their activation: key -> (link, lease), so that end can free the credit on
    /// the gateway holding the job. Leader-local.
    pushed: dashmap::DashMap<JobKey, (u64, u64)>,
    /// Entries in `pushed`: raised and lowered with each insert and removal, so
    /// changes at once never leave it at a stale count.
    pushed_gauge: prometheus::IntGauge,
    /// Yields waiting for the next paced batch: (key, lease, deadline).
    yields: Mutex<Vec<(JobKey, u64, i64)>>,
    yield_wake: Notify,
    /// Activations proposed and not yet finished (leader-local).
    claims: Mutex<Claims>,
    /// See [`crate::config::BrokerConfig::lost_gateway_grace`].
    lost_gateway_grace: Option<Duration>,
    /// Whether this replica leads without a majority (see [`MAJORITY_LOST_AFTER`]).
    majority_lost: AtomicBool,
    /// Entries the proposer has in flight. Taken to count one in or out and to
    /// close or open the gate, so that no entry goes in once it is closed.
    gate: Mutex<usize>,
    /// Closed while the leadership is handed over (see [`Partition::hand_off`]):
    /// the proposer hands Raft no new entry. Changed only under `gate`.
    gate_closed: AtomicBool,
    gate_opened: Notify,
    /// Told when the last entry in flight is done while the gate is closed.
    gate_idle: Notify,
    /// Since when this replica leads (see [`Partition::note_role`]).
    leading_since: Mutex<Option<tokio::time::Instant>>,
    /// Set once this broker was asked to stop: it takes no partition over then.
    stopping: AtomicBool,
    /// When this replica last heard from a leader or granted a vote (see
    /// `drive_elections` in the crate root).
    /// In µs since `started`; an atomic, since every append-entries sets it.
    leader_heard_us: AtomicU64,
    started: std::time::Instant,
    /// Whether a voter refused this replica's last candidacy for a longer log.
    pub longer_log: Arc<crate::raft::LongerLog>,
    shutdown: CancellationToken,
}

/// How long a leader that is shutting down waits for a follower to have its whole
/// log, and then for that follower to lead, before it stops all the same.
const HAND_OFF_WAIT: Duration = Duration::from_secs(1);
/// Past its lease by this much, a leader surely grants the vote it asks for.
const LEASE_MARGIN: Duration = Duration::from_millis(20);

/// What becomes of a partition whose hand-off failed: a stopping leader's waits for
/// an election; one being handed back to its preferred leader (`only`) stays led here.
fn then_what(only: Option<NodeId>) -> &'static str {
    if only.is_some() {
        "this broker leads on"
    } else {
        "the partition waits for an election"
    }
}

impl Partition {
    /// Starts the proposer and the timers of a partition; both stop on `shutdown`.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        id: PartitionId,
        node_id: NodeId,
        raft: Raft,
        shared: Arc<SharedState>,
        notices: Notices,
        registry: Arc<JobStreamRegistry>,
        lost_gateway_grace: Option<Duration>,
        longer_log: Arc<crate::raft::LongerLog>,
        tasks: &tokio_util::task::TaskTracker,
        shutdown: CancellationToken,
    ) -> Arc<Partition> {
        let (tx, rx) = mpsc::channel(QUEUE_CAPACITY);
        let p = Arc::new(Partition {
            id,
            node_id,
            raft,
            shared,
            proposals: tx,
            registry,
            notices,
            pushed: dashmap::DashMap::new(),
            pushed_gauge: metrics::PUSHED_HELD
                .with_label_values(&[&node_id.to_string(), &id.to_string()]),
            yields: Mutex::new(Vec::new()),
            yield_wake: Notify::new(),
            claims: Mutex::new(Claims::default()),
            lost_gateway_grace,
            majority_lost: AtomicBool::new(false),
            gate: Mutex::new(0),
            gate_closed: AtomicBool::new(false),
            gate_opened: Notify::new(),
            gate_idle: Notify::new(),
            leading_since: Mutex::new(None),
            stopping: AtomicBool::new(false),
            leader_heard_us: AtomicU64::new(0),
            started: std::time::Instant::now(),
            longer_log,
            shutdown: shutdown.clone(),
        });
        let span = tracing::info_span!("partition", partition = id.0, node = node_id);
        tasks.spawn(run_proposer(p.clone(), rx, shutdown.clone()).instrument(span.clone()));
        tasks.spawn(run_yields(p.clone(), shutdown.clone()).instrument(span.clone()));
        tasks.spawn(watch_majority(p.clone(), shutdown.clone()).instrument(span.clone()));
        tasks.spawn(run_timers(p.clone(), shutdown).instrument(span));
        p
    }

    /// A leader's append-entries reached this replica at `at`, or it granted a vote
    /// then (or stood itself, or its broker started): no election before an
    /// election timeout from then.
    pub fn heard_from_leader_at(&self, at: std::time::Instant) {
        let us = at.saturating_duration_since(self.started).as_micros();
        self.leader_heard_us
            .fetch_max(u64::try_from(us).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    pub fn last_heard_from_leader(&self) -> std::time::Instant {
        self.started + Duration::from_micros(self.leader_heard_us.load(Ordering::Relaxed))
    }

    /// Whether this replica leads but has lost its majority: see
    /// [`MAJORITY_LOST_AFTER`].
    pub fn majority_lost(&self) -> bool {
        self.majority_lost.load(Ordering::Relaxed)
    }

    /// This broker was asked to stop: it no longer stands for election when a
    /// stopping leader asks it to (see [`Partition::hand_off`]).
    pub fn begin_stopping(&self) {
        self.stopping.store(true, Ordering::Relaxed);
    }

    /// Whether this broker is stopping (see [`Partition::begin_stopping`]).
    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::Relaxed)
    }

    /// Keeps track of since when this replica leads, and tells the gateways when it
    /// begins to; called on every change of role or leader.
    pub fn note_role(&self) {
        let leading = self.is_leader();
        let mut since = self.leading_since.lock().unwrap_or_else(|e| e.into_inner());
        match (leading, since.is_some()) {
            (true, false) => {
                *since = Some(tokio::time::Instant::now());
                drop(since);
                self.announce_leadership();
            }
            (false, true) => *since = None,
            _ => {}
        }
    }

    /// Tells every linked gateway that this replica leads now, and in which term,
    /// so that they route here without waiting for a topology round.
    fn announce_leadership(&self) {
        let term = self
            .raft
            .server_metrics()
            .borrow()
            .vote
            .leader_id()
            .get_term();
        tracing::info!(partition = self.id.0, term, "leading: telling the gateways");
        // No link: no gateway to tell (they learn it from their next round).
        let _ = self.notices.send(BrokerMessage {
            kind: Some(broker_message::Kind::Leading(Leading {
                partition_id: self.id.0,
                term,
            })),
        });
    }

    fn gate_lock(&self) -> std::sync::MutexGuard<'_, usize> {
        self.gate.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts an entry the proposer is about to hand Raft, unless the gate is closed.
    fn enter_gate(&self) -> bool {
        let mut entries = self.gate_lock();
        if self.gate_closed.load(Ordering::Relaxed) {
            return false;
        }
        *entries += 1;
        true
    }

    /// An entry counted by [`Partition::enter_gate`] is applied or has failed.
    fn leave_gate(&self) {
        let idle = {
            let mut entries = self.gate_lock();
            *entries = entries.saturating_sub(1);
            *entries == 0 && self.gate_closed.load(Ordering::Relaxed)
        };
        if idle {
            self.gate_idle.notify_one();
        }
    }

    fn set_gate(&self, closed: bool) {
        let _entries = self.gate_lock();
        self.gate_closed.store(closed, Ordering::Relaxed);
        if !closed {
            self.gate_opened.notify_one();
        }
    }

    /// Hands the leadership of this partition to a follower (Raft's leadership
    /// transfer): before this broker stops, so that the partition is back in
    /// milliseconds instead of after an election timeout, which in openraft 0.9 is
    /// the leader lease and an election timeout together; or to the partition's
    /// preferred leader once it is back (see `rebalance_leaders`).
    ///
    /// The proposer stops handing Raft new entries (commands wait in its queue);
    /// once every entry in flight is applied, the followers that have the whole log
    /// are asked in turn to stand for election (`ask`: a node id, this leader's
    /// term) until one will (one that is stopping too will not). This replica
    /// grants the vote, as its lease as leader is not renewed, and the follower
    /// leads with every entry. Then the proposer goes on: Raft refuses what waited,
    /// and the gateways send it to the new leader.
    ///
    /// `only`: ask that follower alone (a rebalance to the preferred leader).
    ///
    /// Returns the new leader; `None` when this replica does not lead, has no
    /// follower, none would take over, or none did within [`HAND_OFF_WAIT`] twice.
    pub async fn hand_off<F, Fut>(&self, ask: F, only: Option<NodeId>) -> Option<NodeId>
    where
        F: Fn(NodeId, u64) -> Fut,
        Fut: std::future::Future<Output = Result<(), String>>,
    {
        {
            let m = self.raft.server_metrics();
            let m = m.borrow();
            if m.state != ServerState::Leader
                || m.membership_config.membership().voter_ids().count() < 2
                || self.majority_lost()
            {
                return None;
            }
        }
        // A replica votes for no one while its leader's lease runs (openraft 0.9:
        // the longest election timeout since it last heard from it, or since it
        // became leader, for the leader itself), so a leader younger than that would
        // refuse the vote it hands over, and the follower standing for election
        // would only unseat it. It leads on until then.
        let lease = Duration::from_millis(self.raft.config().election_timeout_max);
        let since = *self.leading_since.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(since) = since {
            tokio::time::sleep_until(since + lease + LEASE_MARGIN).await;
        }
        self.set_gate(true);
        let new_leader = self.hand_off_closed(ask, only).await;
        self.set_gate(false);
        new_leader
    }

    async fn hand_off_closed<F, Fut>(&self, ask: F, only: Option<NodeId>) -> Option<NodeId>
    where
        F: Fn(NodeId, u64) -> Fut,
        Fut: std::future::Future<Output = Result<(), String>>,
    {
        let mut watch = self.raft.metrics();
        let until = tokio::time::Instant::now() + HAND_OFF_WAIT;
        // The followers with the whole log, once nothing is in flight.
        let (candidates, term) = loop {
            let found = {
                let m = watch.borrow_and_update();
                if m.state != ServerState::Leader {
                    return None;
                }
                let idle = *self.gate_lock() == 0;
                let last = m.last_log_index;
                let up_to_date: Vec<NodeId> = m
                    .replication
                    .iter()
                    .flatten()
                    .filter(|(id, matched)| {
                        **id != self.node_id
                            && only.is_none_or(|o| o == **id)
                            && matched.map(|l| l.index) == last
                    })
                    .map(|(id, _)| *id)
                    .collect();
                (idle && last == m.last_applied.map(|l| l.index) && !up_to_date.is_empty())
                    .then_some((up_to_date, m.current_term))
            };
            if let Some(found) = found {
                break found;
            }
            // Followers catch up and entries are applied: the metrics change; the
            // last entry in flight is done: the gate says so.
            tokio::select! {
                changed = watch.changed() => if changed.is_err() { return None },
                _ = self.gate_idle.notified() => {}
                _ = tokio::time::sleep_until(until) => {
                    tracing::warn!(
                        "{} within {} ms: {}",
                        if only.is_some() {
                            "the preferred leader did not have the whole log"
                        } else {
                            "no follower had the whole log (all down, or behind)"
                        },
                        HAND_OFF_WAIT.as_millis(),
                        then_what(only)
                    );
                    metrics::HANDOFFS
                        .with_label_values(&[label::handoff::NO_FOLLOWER_CAUGHT_UP])
                        .inc();
                    return None;
                }
            }
        };
        // The first that will: one that is stopping too, say, will not.
        let mut to = None;
        for candidate in candidates {
            match ask(candidate, term).await {
                Ok(()) => {
                    to = Some(candidate);
                    break;
                }
                Err(e) => {
                    tracing::info!(to = candidate, error = %e, "a follower would not take the partition over")
                }
            }
        }
        let Some(to) = to else {
            tracing::warn!(
                "{} take the partition over: {}",
                if only.is_some() {
                    "the preferred leader would not"
                } else {
                    "no follower would"
                },
                then_what(only)
            );
            metrics::HANDOFFS
                .with_label_values(&[label::handoff::REFUSED])
                .inc();
            return None;
        };
        let led_by_another = |m: &openraft::RaftMetrics<NodeId, openraft::BasicNode>| {
            m.state != ServerState::Leader && m.current_leader.is_some()
        };
        let led = tokio::time::timeout(HAND_OFF_WAIT, watch.wait_for(led_by_another))
            .await
            .map(|r| r.map(|m| m.current_leader));
        match led {
            Ok(Ok(leader)) => {
                if let Some(to) = leader {
                    tracing::info!(to, "partition handed over");
                }
                metrics::HANDOFFS
                    .with_label_values(&[label::handoff::HANDED_OVER])
                    .inc();
                leader
            }
            Ok(Err(_)) => None,
            Err(_) => {
                tracing::warn!(to, "the follower did not take the partition over in time");
                metrics::HANDOFFS
                    .with_label_values(&[label::handoff::NOT_TAKEN_OVER])
                    .inc();
                None
            }
        }
    }

    /// A leader that is shutting down asks this replica to stand for election now
    /// (see [`Partition::hand_off`]). Only a follower of that very leader and term
    /// does; anything else is refused with why.
    pub async fn elect_on_request(&self, leader: NodeId, term: u64) -> Result<(), String> {
        let refusal = if self.stopping.load(Ordering::Relaxed) {
            Some(format!("broker {} is stopping too", self.node_id))
        } else {
            let m = self.raft.server_metrics();
            let m = m.borrow();
            let current = m.vote.leader_id().get_term();
            (m.state != ServerState::Follower || m.current_leader != Some(leader) || current != term)
                .then(|| {
                    format!(
                        "broker {} follows {:?} in term {current}, not broker {leader} in term {term}",
                        self.node_id, m.current_leader
                    )
                })
        };
        if let Some(why) = refusal {
            metrics::ELECTIONS_ASKED
                .with_label_values(&[label::election_asked::REFUSED])
                .inc();
            return Err(format!("partition {}: {why}", self.id));
        }
        tracing::info!(
            leader,
            term,
            "standing for election: the leader hands the partition over (it is stopping, or this broker is the partition's preferred leader)"
        );
        metrics::ELECTIONS_ASKED
            .with_label_values(&[label::election_asked::STARTED])
            .inc();
        self.longer_log.clear();
        self.raft
            .trigger()
            .elect()
            .await
            .map_err(|e| format!("partition {}: cannot start an election: {e}", self.id))
    }

    /// Prepares a client's command with the leader's push decisions and replicates it.
    /// `gateway`, the id of the gateway that sent it, if it said.
    pub async fn submit(
        &self,
        cmd: Command,
        gateway: Option<Arc<str>>,
    ) -> Result<Reply, BrokerError> {
        self.submit_in(cmd, gateway, None).await
    }

    /// [`Partition::submit`], limited to the caller's `tenants` when given: a
    /// command about a job of another tenant finds no job.
    pub async fn submit_in(
        &self,
        cmd: Command,
        gateway: Option<Arc<str>>,
        tenants: Option<Vec<String>>,
    ) -> Result<Reply, BrokerError> {
        // A poll's jobs are recorded with the gateway they go out through.
        let via = matches!(cmd.inner(), Command::Activate { .. })
            .then(|| gateway.as_deref().map(str::to_string))
            .flatten();
        let ends_from = match (cmd.inner(), gateway) {
            (
                Command::Complete { key, .. }
                | Command::Fail { key, .. }
                | Command::ThrowError { key, .. },
                Some(g),
            ) => Some((*key, g)),
            _ => None,
        };
        let _claim = match cmd.inner() {
            Command::Activate { props, max_jobs } => {
                match self.claim_activation(props, *max_jobs, cmd.once_request()) {
                    Ok(claim) => claim,
                    Err(reason) => {
                        metrics::EMPTY_ACTIVATIONS
                            .with_label_values(&[reason])
                            .inc();
                        return Ok(Reply::Activated(Vec::new()));
                    }
                }
            }
            _ => None,
        };
        let push = self.push_targets(&cmd);
        let logged = match tenants {
            Some(tenants) => LogCommand::ClientIn { cmd, push, tenants },
            None => LogCommand::Client { cmd, push, via },
        };
        self.propose_from(logged, ends_from).await
    }

    /// Claims the jobs an Activate may take before it is proposed, or says why it
    /// would certainly take none, so it needs no log entry (and no commit):
    /// - `nothing`: no job of the type is activatable for these tenants;
    /// - `claimed`: activations in flight want every such job (pollers that ask
    ///   while a job's activation is still committing would each propose one).
    ///
    /// Both only where this replica leads and has applied an entry of its own term
    /// (so every entry of earlier leaders too). A job that becomes activatable later
    /// does so through an entry this leader proposes, whose application sends the
    /// gateways a "jobs available" notice, and jobs an activation in flight leaves
    /// are announced when it finishes ([`ActivationClaim`]); the gateway subscribed
    /// to those notices before it asked, so the poll it parks is woken.
    ///
    /// A repeat of a once-only activation (`request`) whose first attempt is in
    /// flight here or applied is proposed as it is, with no claim: the log answers
    /// it with that attempt's jobs, which the outlook would count as claimed or
    /// gone. The claims are looked at before the applied state, under their lock,
    /// and a claim is released only once its attempt is answered (its entry
    /// applied) or has failed, so an attempt that succeeded is found in one or the
    /// other.
    fn claim_activation(
        &self,
        props: &ActivationProps,
        max_jobs: u32,
        request: Option<RequestId>,
    ) -> Result<Option<ActivationClaim<'_>>, &'static str> {
        let leading_term = self.leading_term();
        let mut claims = self.claims.lock().unwrap_or_else(|e| e.into_inner());
        if request.is_some_and(|r| claims.carries(r)) {
            return Ok(None);
        }
        {
            let applied = self.shared.read();
            if request.is_some_and(|r| applied.state.once_record(r).is_some()) {
                return Ok(None);
            }
            let caught_up = leading_term.is_some_and(|term| {
                applied
                    .last_applied
                    .is_some_and(|id| id.leader_id.term == term)
            });
            if caught_up {
                let outlook = claims.outlook(&props.job_type, &props.tenant_ids, |t| {
                    applied.state.queued(&props.job_type, t)
                });
                match outlook {
                    Outlook::Nothing => return Err(label::empty_activation::NOTHING),
                    Outlook::Claimed => return Err(label::empty_activation::CLAIMED),
                    Outlook::Jobs => {}
                }
            }
        }
        claims.add(&props.job_type, &props.tenant_ids, max_jobs, request);
        Ok(Some(ActivationClaim {
            partition: self,
            job_type: props.job_type.clone(),
            tenants: props.tenant_ids.clone(),
            max_jobs,
            request,
        }))
    }

    /// Tells the gateways that this stream's jobs wait here for credit it does not
    /// have: a gateway then gives its free credit to the brokers with such a backlog
    /// (its split by partitions led could leave it with less than the stream has),
    /// and its parked polls may take them.
    fn announce_backlog(&self, props: &ActivationProps) {
        for tenant in &props.tenant_ids {
            let waiting = self
                .shared
                .read()
                .state
                .activatable_count(&props.job_type, std::slice::from_ref(tenant));
            if waiting > 0 {
                self.announce(props.job_type.clone(), tenant.clone());
            }
        }
    }

    /// Tells the gateways jobs of this type and tenant are activatable here.
    fn announce(&self, job_type: String, tenant_id: String) {
        // No receiver (no gateway linked) is fine.
        let _ = self.notices.send(self.jobs_available(job_type, tenant_id));
    }

    fn jobs_available(&self, job_type: String, tenant_id: String) -> BrokerMessage {
        BrokerMessage {
            kind: Some(broker_message::Kind::JobsAvailable(JobsAvailable {
                r#type: job_type,
                partition_id: self.id.0,
                tenant_id,
            })),
        }
    }

    /// A "jobs available" notice for every type and tenant with activatable jobs
    /// here, where this replica leads: what a gateway that missed notices needs to
    /// wake its parked polls. Empty on a follower, whose jobs no poll can take.
    pub fn activatable_notices(&self) -> Vec<BrokerMessage> {
        if !self.is_leader() {
            return Vec::new();
        }
        let types = self.shared.read().state.activatable_types();
        types
            .into_iter()
            .map(|(job_type, tenant_id)| self.jobs_available(job_type, tenant_id))
            .collect()
    }

    /// The streams that may take the jobs this command makes runnable: decided here,
    /// on the leader, and written into the command so every replica activates alike.
    fn push_targets(&self, cmd: &Command) -> Vec<PushTarget> {
        match cmd.inner() {
            Command::Create(jobs) => {
                let mut wanted: BTreeMap<(&str, &str), u32> = BTreeMap::new();
                for j in jobs {
                    *wanted.entry((&j.job_type, &j.tenant_id)).or_default() += 1;
                }
                self.lookup_all(wanted)
            }
            Command::Fail {
                key,
                retries,
                retry_backoff_ms,
                ..
            } if *retries > 0 && *retry_backoff_ms <= 0 => self.targets_for_keys(&[*key]),
            Command::UpdateRetries { key, .. } => self.targets_for_keys(&[*key]),
            _ => Vec::new(),
        }
    }

    fn lookup_all(&self, wanted: BTreeMap<(&str, &str), u32>) -> Vec<PushTarget> {
        wanted
            .into_iter()
            .filter_map(|((t, tenant), n)| self.registry.lookup(t, tenant, n))
            .collect()
    }

    /// Targets for jobs already in the state (fail, timers, retries updates).
    fn targets_for_keys(&self, keys: &[JobKey]) -> Vec<PushTarget> {
        let applied = self.shared.read();
        let mut wanted: BTreeMap<(String, String), u32> = BTreeMap::new();
        for k in keys {
            if let Some(j) = applied.state.job(*k) {
                *wanted
                    .entry((j.job_type.clone(), j.tenant_id.clone()))
                    .or_default() += 1;
            }
        }
        drop(applied);
        wanted
            .into_iter()
            .filter_map(|((t, tenant), n)| self.registry.lookup(&t, &tenant, n))
            .collect()
    }

    /// Replicates `cmd` and answers once it is committed and applied. Credit held
    /// for its push targets goes back if it is never proposed.
    pub async fn propose(&self, cmd: LogCommand) -> Result<Reply, BrokerError> {
        self.propose_from(cmd, None).await
    }

    async fn propose_from(
        &self,
        cmd: LogCommand,
        ends_from: Option<(JobKey, Arc<str>)>,
    ) -> Result<Reply, BrokerError> {
        if let Err(e) = self.check_leader() {
            self.refund_targets(&cmd);
            return Err(e);
        }
        let (tx, rx) = oneshot::channel();
        self.proposals
            .try_send(Proposal {
                cmd,
                ends_from,
                reply: tx,
            })
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(p) => {
                    self.refund_targets(&p.cmd);
                    metrics::REJECTED
                        .with_label_values(&[label::rejected::QUEUE_FULL])
                        .inc();
                    BrokerError::ResourceExhausted(format!(
                        "partition {} has {QUEUE_CAPACITY} commands waiting; retry later",
                        self.id
                    ))
                }
                mpsc::error::TrySendError::Closed(p) => {
                    self.refund_targets(&p.cmd);
                    self.stopping()
                }
            })?;
        rx.await.map_err(|_| self.stopping())?
    }

    fn refund_targets(&self, cmd: &LogCommand) {
        for t in targets_of(cmd) {
            self.registry.refund(&t.recipient, u64::from(t.max));
        }
    }

    /// Reads a job from the leader's applied state.
    /// Reads a job from the leader's state; with `tenants`, a job of another
    /// tenant is not found.
    pub fn get_job(&self, key: JobKey, tenants: Option<&[String]>) -> Result<Reply, BrokerError> {
        self.check_leader()?;
        let applied = self.shared.read();
        applied
            .state
            .view(key)
            .filter(|v| tenants.is_none_or(|t| t.contains(&v.tenant_id)))
            .map(Reply::Job)
            .ok_or_else(|| BrokerError::NotFound(format!("job with key '{key}' was not found")))
    }

    /// The term this replica leads in, if it leads now.
    fn leading_term(&self) -> Option<u64> {
        let m = self.raft.server_metrics();
        let m = m.borrow();
        (m.state == ServerState::Leader).then(|| m.vote.leader_id().term)
    }

    /// The jobs this replica holds, and the request ids it remembers.
    pub fn held(&self) -> (usize, usize) {
        let applied = self.shared.read();
        (applied.state.job_count(), applied.state.once_count())
    }

    /// Whether this replica leads its partition now.
    pub fn is_leader(&self) -> bool {
        // The server metrics change with role and leader only; the full metrics
        // change with every entry, and their lock with them.
        let m = self.raft.server_metrics();
        let m = m.borrow();
        m.state == ServerState::Leader
    }

    fn check_leader(&self) -> Result<(), BrokerError> {
        let m = self.raft.server_metrics();
        let m = m.borrow();
        if m.state == ServerState::Leader {
            if self.majority_lost() {
                return Err(BrokerError::NoMajority(format!(
                    "partition {} has lost its majority: its leader, broker {}, has not \
                     heard from most of its replicas for {} s and cannot commit until \
                     they are back",
                    self.id,
                    self.node_id,
                    MAJORITY_LOST_AFTER.as_secs()
                )));
            }
            Ok(())
        } else {
            Err(BrokerError::NotLeader {
                partition: self.id,
                leader: m.current_leader.filter(|l| *l != self.node_id),
            })
        }
    }

    fn stopping(&self) -> BrokerError {
        BrokerError::Unavailable(format!("partition {} is shutting down", self.id))
    }
}

async fn run_proposer(
    p: Arc<Partition>,
    mut rx: mpsc::Receiver<Proposal>,
    shutdown: CancellationToken,
) {
    let mut inflight = FuturesUnordered::new();
    let mut pending = Pending::default();
    // The entry Raft has not yet made durable in this replica's log: (its number,
    // the receiver its flush signal fires). Raft appends one entry at a time, so
    // the next waits in `pending`, growing, until this one is flushed.
    let mut appending: Option<(u64, oneshot::Receiver<()>)> = None;
    let mut next_seq = 0u64;
    loop {
        // Armed only while ahead: past it, only the flush or the in-flight limit
        // holds the completions, and those have branches of their own.
        let held = (!pending.proposals.is_empty() && completions_only(&pending.proposals))
            .then_some(pending.since + pending.hold())
            .filter(|&until| until > tokio::time::Instant::now());
        let gated = p.gate_closed.load(Ordering::Relaxed);
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = p.gate_opened.notified(), if gated => {}
            // Completions held long enough: the check below lets them go.
            _ = tokio::time::sleep_until(held.unwrap_or(pending.since)), if held.is_some() => {}
            Some(seq) = inflight.next(), if !inflight.is_empty() => {
                // Applied (or failed): long past its append whatever the signal says.
                if appending.as_ref().is_some_and(|(s, _)| *s == seq) {
                    appending = None;
                }
            }
            _ = async {
                if let Some((_, flushed)) = appending.as_mut() {
                    let _ = flushed.await;
                }
            }, if appending.is_some() => appending = None,
            msg = rx.recv(), if !pending.full() => match msg {
                Some(m) => pending.add(m),
                None => break,
            },
        }
        while !pending.full() {
            match rx.try_recv() {
                Ok(m) => pending.add(m),
                Err(_) => break,
            }
        }
        if ready_to_propose(
            &pending.proposals,
            pending.full(),
            appending.is_some(),
            inflight.len(),
            pending.since.elapsed(),
            pending.hold(),
        ) && p.enter_gate()
        {
            let batch = pending.take();
            let (signal, flushed) = FlushSignal::new();
            next_seq += 1;
            appending = Some((next_seq, flushed));
            let p = p.clone();
            inflight.push(async move {
                let seq = write(p.clone(), batch, signal, next_seq).await;
                p.leave_gate();
                seq
            });
        }
    }
    // Whatever is still waiting is answered by dropping its sender: UNAVAILABLE.
}

/// The commands waiting for the proposer's next entry.
struct Pending {
    proposals: Vec<Proposal>,
    /// Their approximate size in the entry.
    bytes: usize,
    /// When the oldest of them arrived.
    since: tokio::time::Instant,
    /// When the last command that is not a completion arrived (in this batch or
    /// an earlier one), and how long after the one before it.
    busy_at: Option<tokio::time::Instant>,
    busy_gap: Option<Duration>,
}

impl Default for Pending {
    fn default() -> Self {
        Pending {
            proposals: Vec::new(),
            bytes: 0,
            since: tokio::time::Instant::now(),
            busy_at: None,
            busy_gap: None,
        }
    }
}

impl Pending {
    /// Adds a command; the first one starts the hold's clock.
    fn add(&mut self, m: Proposal) {
        let now = tokio::time::Instant::now();
        if self.proposals.is_empty() {
            self.since = now;
        }
        if !is_completion(&m.cmd) {
            self.busy_gap = self.busy_at.map(|at| now.saturating_duration_since(at));
            self.busy_at = Some(now);
        }
        self.bytes += approx_bytes(&m.cmd);
        self.proposals.push(m);
    }

    /// How long completions alone wait: [`COMPLETION_HOLD`] while work is flowing
    /// (see [`BUSY_LOOKBACK`]), else not at all.
    fn hold(&self) -> Duration {
        hold_for(self.since, self.busy_at, self.busy_gap)
    }

    /// Whether the entry takes no more commands.
    fn full(&self) -> bool {
        self.proposals.len() >= MAX_BATCH || self.bytes >= MAX_BATCH_BYTES
    }

    /// The commands, for one entry; the next starts empty.
    fn take(&mut self) -> Vec<Proposal> {
        self.bytes = 0;
        std::mem::take(&mut self.proposals)
    }
}

/// Whether the proposer hands Raft its pending commands now, as one entry:
/// - not while Raft is still flushing this replica's previous entry (`appending`):
///   Raft takes one append at a time, and whatever arrives meanwhile joins this entry;
/// - not beyond [`MAX_INFLIGHT`] entries waiting to be applied;
/// - when every pending command only completes a job, not before the oldest has
///   waited `hold` (`waited`) or the batch is `full`.
fn ready_to_propose(
    pending: &[Proposal],
    full: bool,
    appending: bool,
    inflight: usize,
    waited: Duration,
    hold: Duration,
) -> bool {
    !pending.is_empty()
        && !appending
        && inflight < MAX_INFLIGHT
        && (full || waited >= hold || !completions_only(pending))
}

/// The hold of completions the first of which arrived at `since`, when the last
/// other command arrived at `busy_at`, `busy_gap` after the one before it.
fn hold_for(
    since: tokio::time::Instant,
    busy_at: Option<tokio::time::Instant>,
    busy_gap: Option<Duration>,
) -> Duration {
    match (busy_at, busy_gap) {
        (Some(at), Some(gap))
            if gap <= BUSY_LOOKBACK && since.saturating_duration_since(at) <= BUSY_LOOKBACK =>
        {
            COMPLETION_HOLD
        }
        _ => Duration::ZERO,
    }
}

/// Whether every command only completes a job: nothing becomes runnable.
fn completions_only(pending: &[Proposal]) -> bool {
    pending.iter().all(|p| is_completion(&p.cmd))
}

fn is_completion(cmd: &LogCommand) -> bool {
    matches!(
        cmd,
        LogCommand::Client {
            cmd: Command::Complete { .. },
            ..
        } | LogCommand::ClientIn {
            cmd: Command::Complete { .. },
            ..
        }
    )
}

/// Proposes one entry and answers each of its commands.
/// Resolves to `seq` once the entry is applied or has failed.
async fn write(p: Arc<Partition>, batch: Vec<Proposal>, on_flushed: FlushSignal, seq: u64) -> u64 {
    let mut ends_from = BTreeMap::new();
    let mut commands = Vec::with_capacity(batch.len());
    let mut replies = Vec::with_capacity(batch.len());
    for b in batch {
        commands.push(b.cmd);
        replies.push(b.reply);
        ends_from.extend(b.ends_from);
    }
    // Credit held for this entry's push targets; what apply does not use goes back.
    let mut held: BTreeMap<Recipient, u64> = BTreeMap::new();
    for c in &commands {
        for t in targets_of(c) {
            *held.entry(t.recipient.clone()).or_default() += u64::from(t.max);
        }
    }
    metrics::BATCH_SIZE.observe(commands.len() as f64);
    let started = std::time::Instant::now();
    let count = commands.len();
    let write = p.raft.client_write(Batch {
        ts: now_ms(),
        commands,
        on_flushed,
    });
    tokio::pin!(write);
    // An entry should commit in milliseconds; one that does not holds up every
    // command behind it, so say so while it waits.
    let result = loop {
        match tokio::time::timeout(SLOW_ENTRY, &mut write).await {
            Ok(result) => break result,
            Err(_) => tracing::warn!(
                commands = count,
                waited = ?started.elapsed(),
                "a log entry is taking long to commit"
            ),
        }
    };
    metrics::COMMIT_SECONDS.observe(started.elapsed().as_secs_f64());
    match result {
        Ok(resp) => {
            if resp.data.repeated > 0 {
                metrics::REPEATS.inc_by(u64::from(resp.data.repeated));
                tracing::info!(
                    commands = resp.data.repeated,
                    "commands sent again answered as their first attempt was"
                );
            }
            for e in &resp.data.effects {
                if let Effect::Push(push) = e {
                    if let Some(n) = held.get_mut(&push.target.recipient) {
                        *n = n.saturating_sub(1);
                    }
                }
            }
            for (r, n) in held {
                p.registry.refund(&r, n);
            }
            // Pushes first: they are the job path's latency.
            carry_out(&p, resp.data.effects, started, &ends_from);
            for (reply, tx) in resp.data.replies.into_iter().zip(replies) {
                let _ = tx.send(reply);
            }
        }
        Err(e) => {
            let err = match e {
                RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => {
                    BrokerError::NotLeader {
                        partition: p.id,
                        leader: f.leader_id.filter(|l| *l != p.node_id),
                    }
                }
                other => BrokerError::Unavailable(format!(
                    "partition {} could not replicate the command: {other}",
                    p.id
                )),
            };
            // Nothing was pushed: the credit held for the entry goes back.
            for (r, n) in held {
                p.registry.refund(&r, n);
            }
            metrics::REJECTED
                .with_label_values(&[label::rejected::NOT_COMMITTED])
                .inc();
            for tx in replies {
                let _ = tx.send(Err(err.clone()));
            }
        }
    }
    seq
}

/// The push targets a command carries (credit held for it).
fn targets_of(c: &LogCommand) -> &[PushTarget] {
    match c {
        LogCommand::Client { push, .. }
        | LogCommand::ClientIn { push, .. }
        | LogCommand::TimeOut { push, .. }
        | LogCommand::Recur { push, .. } => push,
        LogCommand::Backfill { target } => std::slice::from_ref(target),
        LogCommand::Yield { .. } => &[],
    }
}

/// Carries out the effects of an applied entry, on the leader only (only the
/// proposer gets them). `proposed` is when the entry was proposed; `ends_from`,
/// which gateway sent the entry's commands that end activations.
fn carry_out(
    p: &Arc<Partition>,
    effects: Vec<Effect>,
    proposed: Instant,
    ends_from: &BTreeMap<JobKey, Arc<str>>,
) {
    for e in effects {
        match e {
            Effect::JobsAvailable {
                job_type,
                tenant_id,
            } => {
                p.backfill_streams_of(&job_type, &tenant_id);
                p.announce(job_type, tenant_id);
            }
            Effect::Push(push) => {
                if push.origin == PushOrigin::Backfill {
                    metrics::BACKFILLED.inc();
                }
                let created = (push.origin == PushOrigin::Created).then_some(proposed);
                start_push(p, *push, created);
            }
            Effect::Finished { key, lease } => {
                // Tell the gateway holding it, whichever gateway finished it. An
                // entry of an older activation goes too: the job has moved on.
                let held = p
                    .unhold(p.pushed.remove(&key))
                    .filter(|(_, (_, l))| *l == lease);
                if let Some((_, (link, _))) = held {
                    let Some(link) = p.registry.link(link) else {
                        continue;
                    };
                    // The gateway that sent the command knows: it released the job's
                    // credit when the command came through it.
                    if ends_from.get(&key).is_some_and(|g| link.is_gateway(g)) {
                        metrics::FINISHED_NOTICES
                            .with_label_values(&[label::finished_notice::SENDER])
                            .inc();
                        continue;
                    }
                    metrics::FINISHED_NOTICES
                        .with_label_values(&[label::finished_notice::SENT])
                        .inc();
                    link.send(BrokerMessage {
                        kind: Some(broker_message::Kind::Finished(JobFinished {
                            key: key.0,
                            lease,
                        })),
                    });
                }
            }
        }
    }
}

/// Sends a pushed job to its recipient now, on the job path, and leaves waiting for
/// the answer to a task of its own.
fn start_push(p: &Arc<Partition>, push: Push, created: Option<Instant>) {
    let Push {
        target, lease, job, ..
    } = push;
    // Recorded before the push leaves: the job may finish before its ack arrives,
    // and the end of its activation must find (and remove) the entry.
    if p.pushed
        .insert(job.key, (target.recipient.link, lease))
        .is_none()
    {
        p.pushed_gauge.inc();
    }
    let sent = send_to(p, &target.recipient, true, lease, job.clone(), created);
    tokio::spawn(finish_push(p.clone(), target, lease, job, sent));
}

/// Queues `job` for `recipient`. The first recipient's credit was held when the
/// command was prepared; the others are tried only where credit is free. None when
/// the recipient cannot be tried at all.
fn send_to(
    p: &Partition,
    recipient: &Recipient,
    first: bool,
    lease: u64,
    job: ActivatedJob,
    created: Option<Instant>,
) -> Option<Result<SentPush, PushOutcome>> {
    if !first && !p.registry.take_one(recipient) {
        return None;
    }
    if !first {
        metrics::TRY_NEXT.inc();
    }
    let sent = p.registry.send_push(recipient, p.id, lease, job)?;
    if let (Ok(_), Some(t0)) = (&sent, created) {
        metrics::CREATE_TO_PUSH.observe(t0.elapsed().as_secs_f64());
    }
    Some(sent)
}

/// Waits for the answer to a push, then tries the other recipients of the same
/// logical stream while they refuse; when all refuse, yields the job back to the
/// log. A push that got no answer is never retried: it may be running, and its
/// activation deadline recovers it if not.
async fn finish_push(
    p: Arc<Partition>,
    target: PushTarget,
    lease: u64,
    job: ActivatedJob,
    first: Option<Result<SentPush, PushOutcome>>,
) {
    let (key, deadline) = (job.key, job.deadline);
    let mut attempt = first;
    let mut others = None;
    loop {
        if let Some(sent) = attempt.take() {
            let outcome = match sent {
                Ok(sent) => sent.outcome().await,
                Err(refused) => refused,
            };
            match outcome {
                PushOutcome::Accepted => {
                    metrics::PUSHES
                        .with_label_values(&[label::push::ACCEPTED])
                        .inc();
                    return;
                }
                PushOutcome::Refused(reason) => {
                    tracing::debug!(job = key.0, reason, "push refused");
                    metrics::PUSHES
                        .with_label_values(&[&format!("refused_{reason}")])
                        .inc();
                    if reason == DISOWNED {
                        // A newer leader asked the gateway about this activation
                        // and has made the job runnable again: nothing to do here.
                        return;
                    }
                }
                PushOutcome::Unknown => {
                    // The entry stays: the gateway may hold the job, and is told
                    // when its activation ends.
                    metrics::PUSHES
                        .with_label_values(&[label::push::UNKNOWN])
                        .inc();
                    return;
                }
            }
        }
        let others = others.get_or_insert_with(|| {
            p.registry
                .others(&target.props, &target.recipient)
                .into_iter()
        });
        let Some(next) = others.next() else {
            break;
        };
        // Unless the activation already ended, its entry follows the job.
        if let Some(mut held) = p.pushed.get_mut(&key).filter(|h| h.1 == lease) {
            held.0 = next.link;
        }
        attempt = send_to(&p, &next, false, lease, job.clone(), None);
    }
    p.unhold(p.pushed.remove_if(&key, |_, (_, l)| *l == lease));
    p.queue_yield(key, lease, deadline);
}

impl Partition {
    /// Counts an entry removed from `pushed` out of its gauge; passes it on.
    fn unhold<T>(&self, removed: Option<T>) -> Option<T> {
        if removed.is_some() {
            self.pushed_gauge.dec();
        }
        removed
    }

    /// Queues a yield for the next paced batch.
    pub fn queue_yield(&self, key: JobKey, lease: u64, deadline: i64) {
        self.yields
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((key, lease, deadline));
        self.yield_wake.notify_one();
    }

    /// Jobs of this type and tenant became runnable without a push (a yield, a
    /// create or failure whose targets were chosen before a stream got room, ...).
    /// A stream that got room while they were activated, or before their entry
    /// applied, was back-filled without them and hears of them no other way: offer
    /// them to every stream that has room now. The stream that refused a yielded job
    /// has none (its gateway reported so, or it is gone), so it is not pushed there
    /// again at once.
    fn backfill_streams_of(self: &Arc<Self>, job_type: &str, tenant: &str) {
        for props in self.registry.streams_with_room(job_type, tenant) {
            self.backfill(props);
        }
    }

    /// A stream with these properties has free credit (it registered, or a gateway
    /// reported more): if this replica leads and has a backlog of its type, propose one
    /// back-fill round for it, sized to the smaller of the backlog and the credit free
    /// now. The round holds that credit from now until its pushes are made (what apply
    /// does not use goes back), so rounds never promise more than a gateway reported,
    /// and a round need not wait for an earlier one: every credit report can start one,
    /// and the proposer puts the rounds waiting together into one log entry. A backlog
    /// larger than the credit goes as more credit is reported.
    pub fn backfill(self: &Arc<Self>, props: ActivationProps) {
        if self.shutdown.is_cancelled() || !self.is_leader() {
            return;
        }
        let backlog = self
            .shared
            .read()
            .state
            .activatable_count(&props.job_type, &props.tenant_ids);
        let want = u32::try_from(backlog)
            .unwrap_or(u32::MAX)
            .min(BACKFILL_BATCH);
        if want == 0 {
            return;
        }
        let target = self.registry.target_for(&props, want);
        if target.as_ref().is_none_or(|t| (t.max as usize) < backlog) {
            self.announce_backlog(&props);
        }
        let Some(target) = target else {
            return;
        };
        let p = self.clone();
        tokio::spawn(async move {
            if let Err(e) = p.propose(LogCommand::Backfill { target }).await {
                tracing::debug!(error = %e, "back-fill round not applied");
            }
        });
    }
}

/// Keeps [`Partition::majority_lost`] current: a leader of a partition with more
/// than one voter whose last acknowledgement by a majority is older than
/// [`MAJORITY_LOST_AFTER`]. (openraft 0.9's leader does not step down by itself.)
async fn watch_majority(p: Arc<Partition>, shutdown: CancellationToken) {
    let gauge =
        metrics::MAJORITY_LOST.with_label_values(&[&p.node_id.to_string(), &p.id.to_string()]);
    let mut every = tokio::time::interval(MAJORITY_CHECK_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = every.tick() => {}
        }
        let lost = {
            let m = p.raft.metrics();
            let m = m.borrow();
            m.state == ServerState::Leader
                && m.membership_config.membership().voter_ids().count() > 1
                && m.millis_since_quorum_ack
                    .is_some_and(|ms| Duration::from_millis(ms) > MAJORITY_LOST_AFTER)
        };
        if lost != p.majority_lost() {
            if lost {
                tracing::warn!("leading without a majority: refusing commands until it is back");
            } else {
                tracing::info!("majority back");
            }
            p.majority_lost.store(lost, Ordering::Relaxed);
            gauge.set(i64::from(lost));
        }
    }
}

/// Proposes queued yields in paced batches: after a wake it waits [`YIELD_PACE`]
/// plus jitter, collecting more, then proposes them together (one log entry). A
/// job whose deadline would pass before its yield could land is left to time out.
async fn run_yields(p: Arc<Partition>, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = p.yield_wake.notified() => {}
        }
        let jitter = Duration::from_micros(rand::random::<u64>() % YIELD_PACE.as_micros() as u64);
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(YIELD_PACE + jitter) => {}
        }
        let batch = std::mem::take(&mut *p.yields.lock().unwrap_or_else(|e| e.into_inner()));
        let soon = now_ms() + 2 * YIELD_PACE.as_millis() as i64;
        let (due, late): (Vec<_>, Vec<_>) = batch.into_iter().partition(|(_, _, d)| *d > soon);
        if !late.is_empty() {
            metrics::YIELDS
                .with_label_values(&[label::yield_source::LEFT_TO_TIMEOUT])
                .inc_by(late.len() as u64);
        }
        metrics::YIELDS
            .with_label_values(&[label::yield_source::ALL_REFUSED])
            .inc_by(due.len() as u64);
        // Submitted together, so the proposer puts them in one entry.
        let proposals = due
            .into_iter()
            .map(|(key, lease, _)| p.propose(LogCommand::Yield { key, lease }));
        for r in futures::future::join_all(proposals).await {
            if let Err(e) = r {
                // The job stays activated; its deadline recovers it.
                tracing::debug!(error = %e, "yield not applied");
            }
        }
    }
}

/// Run by the leader of `term` once it has applied an entry of that term (and so
/// every earlier one): the activations an earlier leader made for a push may never
/// have been pushed (it died between the commit and the send, or its entries were
/// committed by this leader, which does not carry out their effects). Once the
/// gateways they name are linked here (or [`GATEWAY_GRACE`] has passed), every
/// linked gateway is asked which of them it holds; those none holds are yielded and
/// offered to the registered streams. When a gateway does not answer, all are left
/// to their deadlines: running a job twice is worse than running it late.
async fn reconcile_pushes(p: Arc<Partition>, term: u64) {
    let earlier = p.shared.read().state.pushed_before(term);
    if earlier.is_empty() {
        return;
    }
    let named: BTreeSet<String> = earlier.iter().map(|e| e.gateway.clone()).collect();
    tracing::info!(
        term,
        gateways = named.len(),
        jobs = earlier.len(),
        "asking the gateways about the pushes of earlier leaders"
    );
    let grace_ends = Instant::now() + GATEWAY_GRACE;
    while named
        .iter()
        .any(|g| p.registry.link_of_gateway(g).is_none())
        && Instant::now() < grace_ends
    {
        if p.leading_term() != Some(term) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let Some(lost) = held_by_none(&p, earlier).await else {
        return;
    };
    if p.leading_term() == Some(term) {
        yield_lost(&p, lost).await;
    }
}

/// Waits until this replica, leading in `term`, has applied an entry of that term,
/// and with it every entry of earlier leaders (a follower may not have heard of
/// the last commits before it was elected). False once it no longer leads in `term`.
async fn caught_up_in(p: &Partition, term: u64) -> bool {
    // Raft's metrics change with every entry applied and every change of role.
    let mut metrics = p.raft.metrics();
    loop {
        if p.leading_term() != Some(term) {
            return false;
        }
        if p.shared
            .read()
            .last_applied
            .is_some_and(|id| id.leader_id.term == term)
        {
            return true;
        }
        if metrics.changed().await.is_err() {
            return false;
        }
    }
}

/// Run by a replica once it begins to lead in this process. The jobs handed out
/// (pushed, or answered to a poll) through a gateway with no link here may have gone
/// with a gateway that died while this replica did not lead here: its links ended at
/// an earlier leader, or at this broker before it restarted, and no
/// [`Partition::gateway_lost`] timer runs for them ([`reconcile_pushes`] gets to
/// those of earlier terms too, but only after [`GATEWAY_GRACE`]).
/// Those of gateways that have not said hello here within the lost-gateway grace
/// are then treated as that timer treats them; without a grace they wait for their
/// activation timeouts.
async fn reclaim_orphans(p: Arc<Partition>, term: u64) {
    let Some(grace) = p.lost_gateway_grace else {
        return;
    };
    let mark = p.registry.hellos();
    tokio::time::sleep(grace).await;
    if p.leading_term() != Some(term) {
        return;
    }
    let gone = |gateway: &str| {
        p.registry.link_of_gateway(gateway).is_none()
            && !p.registry.said_hello_since(gateway, mark)
            && !p.registry.left(gateway)
    };
    let orphans = p.shared.read().state.handed_through(gone);
    if orphans.is_empty() {
        return;
    }
    tracing::info!(
        jobs = orphans.len(),
        "jobs were handed out through gateways that have not come back since this replica began to lead; checking them"
    );
    if let Some(lost) = held_by_none(&p, orphans).await {
        if p.leading_term() == Some(term) {
            yield_lost(&p, lost).await;
        }
    }
}

/// Which of `jobs` no gateway linked here holds. Every linked gateway is asked, not
/// only the one each activation names: a push that gateway refused may have been
/// taken by another. `None` when a gateway did not answer: the caller then leaves
/// them all to their deadlines. Counts the outcomes.
async fn held_by_none(p: &Partition, jobs: Vec<Handed>) -> Option<Vec<Handed>> {
    let asked: Vec<HeldJob> = jobs
        .iter()
        .map(|e| HeldJob {
            key: e.key.0,
            lease: e.lease,
        })
        .collect();
    let links = p.registry.links();
    let answers = links.iter().map(|link| {
        let asked = &asked;
        async move {
            let mut held = Vec::new();
            for chunk in asked.chunks(HELD_QUERY_BATCH) {
                let answer = tokio::time::timeout(
                    HELD_ANSWER_TIMEOUT,
                    link.query_held(p.id, chunk.to_vec()),
                )
                .await;
                // No answer in time, or the link ended before it: not known.
                held.extend(answer.ok().flatten()?);
            }
            Some(held)
        }
    });
    let mut held = std::collections::HashSet::new();
    for answer in futures::future::join_all(answers).await {
        let Some(answer) = answer else {
            tracing::warn!(
                jobs = jobs.len(),
                "a gateway did not answer about earlier pushes; leaving them to their deadlines"
            );
            metrics::RECONCILED
                .with_label_values(&[label::reconciled::UNANSWERED])
                .inc_by(jobs.len() as u64);
            return None;
        };
        held.extend(answer.into_iter().map(|h| (h.key, h.lease)));
    }
    let (kept, lost): (Vec<_>, Vec<_>) = jobs
        .into_iter()
        .partition(|e| held.contains(&(e.key.0, e.lease)));
    // What went out through a gateway that is gone is yielded only with a
    // lost-gateway grace; without one it waits for its activation timeout, as its
    // worker may still be running it.
    let linked = |e: &Handed| p.registry.link_of_gateway(&e.gateway).is_some();
    let (lost, waiting): (Vec<_>, Vec<_>) = match p.lost_gateway_grace {
        Some(_) => (lost, Vec::new()),
        None => lost.into_iter().partition(linked),
    };
    let gone = lost.iter().filter(|e| !linked(e)).count();
    for (outcome, n) in [
        (label::reconciled::HELD, kept.len()),
        (label::reconciled::YIELDED, lost.len() - gone),
        (label::reconciled::GATEWAY_GONE, gone),
        (label::reconciled::LEFT_TO_TIMEOUT, waiting.len()),
    ] {
        metrics::RECONCILED
            .with_label_values(&[outcome])
            .inc_by(n as u64);
    }
    tracing::info!(
        gateways = links.len(),
        held = kept.len(),
        yielded = lost.len(),
        of_gateways_gone = gone,
        left_to_timeout = waiting.len(),
        "pushes of earlier leaders or lost gateways checked"
    );
    Some(lost)
}

/// Makes the activations of jobs whose push reached nobody runnable again (each
/// only if that activation is still the job's current one), and offers them to the
/// registered streams: unlike a job every stream refused, none was offered to
/// anyone.
async fn yield_lost(p: &Arc<Partition>, lost: Vec<Handed>) {
    if lost.is_empty() {
        return;
    }
    // Proposed together, so they share one entry.
    let yields = lost.iter().map(|e| {
        p.propose(LogCommand::Yield {
            key: e.key,
            lease: e.lease,
        })
    });
    for r in futures::future::join_all(yields).await {
        if let Err(e) = r {
            tracing::debug!(error = %e, "yield of an unpushed job not applied");
        }
    }
    for props in p.registry.all_props() {
        p.backfill(props);
    }
}

impl Partition {
    /// A link of `gateway` to this broker ended when the registry had seen `hellos`
    /// gateway hellos. If that gateway has not said hello again within the lost
    /// gateway grace (when there is one) and this replica leads, the jobs handed out
    /// through it (pushed, or answered to a poll) that no linked gateway holds are
    /// made runnable again: its ids are per process, so a gateway that restarted,
    /// or died, holds none of them, and its workers' results for them cannot reach
    /// a broker through it (a worker still running one may finish it through another
    /// gateway: as after any activation timeout, the job may then run twice).
    pub fn gateway_lost(self: &Arc<Self>, gateway: String, hellos: u64) {
        let Some(grace) = self.lost_gateway_grace else {
            return;
        };
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let p = self.clone();
        let stop = self.shutdown.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(grace) => {}
            }
            if !p.is_leader() || p.registry.said_hello_since(&gateway, hellos) {
                return;
            }
            let candidates = p.shared.read().state.handed_through(|g| g == gateway);
            if candidates.is_empty() {
                return;
            }
            tracing::info!(%gateway, jobs = candidates.len(), "a gateway did not come back; checking the jobs handed out through it");
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = async {
                    if let Some(lost) = held_by_none(&p, candidates).await {
                        yield_lost(&p, lost).await;
                    }
                } => {}
            }
        });
    }
}

/// Run by a replica once it leads and has applied what earlier leaders committed:
/// parked polls may have missed notices while leadership moved, and streams
/// registered earlier may have a backlog here now.
fn offer_backlog(p: &Arc<Partition>) {
    for notice in p.activatable_notices() {
        // No receiver (no gateway linked) is fine.
        let _ = p.notices.send(notice);
    }
    for props in p.registry.all_props() {
        p.backfill(props);
    }
}

/// While leader: proposes TimeOut for activations past their deadline and Recur
/// for jobs past their retry back-off. Apply re-checks both against the entry's time.
async fn run_timers(p: Arc<Partition>, shutdown: CancellationToken) {
    // Woken by changes of role or leader, not by every entry.
    let mut metrics_rx = p.raft.server_metrics();
    // The term this replica leads in, as of the last round.
    let mut led: Option<u64> = None;
    loop {
        let Some(term) = p.leading_term() else {
            if led.take().is_some() {
                // Ends of activations are carried out by the next leader now.
                let keys: Vec<JobKey> = p.pushed.iter().map(|e| *e.key()).collect();
                for key in keys {
                    p.unhold(p.pushed.remove(&key));
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                r = metrics_rx.changed() => if r.is_err() { return },
            }
            continue;
        };
        // A new term, even one this replica won again without this task seeing it
        // follow in between.
        if led != Some(term) {
            led = Some(term);
            let (q, stop) = (p.clone(), shutdown.clone());
            tokio::spawn(async move {
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = async {
                        tokio::join!(
                            async {
                                if caught_up_in(&q, term).await {
                                    offer_backlog(&q);
                                    reconcile_pushes(q.clone(), term).await;
                                }
                            },
                            reclaim_orphans(q.clone(), term),
                        )
                    } => {}
                }
            });
        }
        let applied = p.shared.applied.notified();
        tokio::pin!(applied);
        applied.as_mut().enable();
        p.shared.timers_reading();
        let now = now_ms();
        let (timeouts, retries, next) = {
            let a = p.shared.read();
            let next = a.state.next_timer();
            (
                a.state.due_deadlines(now, MAX_TIMER_KEYS),
                a.state.due_retries(now, MAX_TIMER_KEYS),
                next,
            )
        };
        let mut proposed = false;
        let full = timeouts.len() >= MAX_TIMER_KEYS || retries.len() >= MAX_TIMER_KEYS;
        let timeouts = (!timeouts.is_empty()).then(|| LogCommand::TimeOut {
            push: p.targets_for_keys(&timeouts),
            keys: timeouts,
        });
        let retries = (!retries.is_empty()).then(|| LogCommand::Recur {
            push: p.targets_for_keys(&retries),
            keys: retries,
        });
        for cmd in [timeouts, retries].into_iter().flatten() {
            proposed = true;
            if let Err(e) = p.propose(cmd).await {
                tracing::debug!(error = %e, "timer command not applied");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
            }
        }
        if proposed {
            // More may be due at once only if the round was cut short.
            if !full {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(TIMER_PACE) => {}
                    r = metrics_rx.changed() => if r.is_err() { return },
                }
            }
            continue;
        }
        let wait = next.map(|t| (t - now).clamp(1, 1000)).unwrap_or(1000);
        // Applies that make nothing due before then do not wake this task.
        p.shared.timers_wait_until(now + wait);
        let wait = wait as u64;
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(wait)) => {}
            _ = &mut applied => {}
            r = metrics_rx.changed() => if r.is_err() { return },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proposal(cmd: Command) -> Proposal {
        Proposal {
            cmd: LogCommand::client(cmd),
            ends_from: None,
            reply: oneshot::channel().0,
        }
    }

    fn complete(n: u64) -> Proposal {
        proposal(Command::Complete {
            key: JobKey::new(PartitionId(1), n),
            variables: None,
        })
    }

    fn create() -> Proposal {
        proposal(Command::Create(vec![crate::engine::tests::new_job("t")]))
    }

    #[test]
    fn the_next_entry_waits_for_the_previous_flush_and_the_inflight_limit() {
        let pending = vec![create()];
        let (now, hold) = (Duration::ZERO, COMPLETION_HOLD);
        assert!(ready_to_propose(&pending, false, false, 0, now, hold));
        assert!(ready_to_propose(
            &pending,
            false,
            false,
            MAX_INFLIGHT - 1,
            now,
            hold
        ));
        assert!(!ready_to_propose(&pending, false, true, 0, now, hold));
        assert!(!ready_to_propose(
            &pending,
            false,
            false,
            MAX_INFLIGHT,
            now,
            hold
        ));
        assert!(!ready_to_propose(&[], false, false, 0, hold, hold));
        assert!(!ready_to_propose(&[], false, false, 0, now, Duration::ZERO));
    }

    #[test]
    fn completions_alone_wait_for_work_to_ride_with() {
        let mut pending = vec![complete(1), complete(2)];
        let (short, hold) = (COMPLETION_HOLD / 2, COMPLETION_HOLD);
        // Even with nothing in flight, they wait ...
        assert!(!ready_to_propose(&pending, false, false, 0, short, hold));
        // ... until the hold is over ...
        assert!(ready_to_propose(&pending, false, false, 0, hold, hold));
        // ... and then not past the flush and in-flight limits ...
        assert!(!ready_to_propose(&pending, false, true, 0, hold, hold));
        // ... or until the batch is full ...
        assert!(ready_to_propose(&pending, true, false, 1, short, hold));
        // ... or a command that makes work runnable joins them.
        pending.push(create());
        assert!(ready_to_propose(&pending, false, false, 1, short, hold));
        // Without a hold (a quiet partition), completions go at once.
        pending.pop();
        assert!(ready_to_propose(
            &pending,
            false,
            false,
            0,
            Duration::ZERO,
            Duration::ZERO
        ));
    }

    #[test]
    fn completions_are_held_only_while_work_is_flowing() {
        let t0 = tokio::time::Instant::now();
        let (close, far) = (BUSY_LOOKBACK, BUSY_LOOKBACK + Duration::from_millis(1));
        // Nothing else ever proposed: a quiet partition.
        assert_eq!(hold_for(t0, None, None), Duration::ZERO);
        // Creates coming close together, the last just before: more are likely
        // within the hold.
        assert_eq!(hold_for(t0 + close, Some(t0), Some(close)), COMPLETION_HOLD);
        // One create just before, the one before it long ago (a lone job created,
        // then completed): nothing to wait for.
        assert_eq!(hold_for(t0 + close, Some(t0), Some(far)), Duration::ZERO);
        assert_eq!(hold_for(t0, Some(t0), None), Duration::ZERO);
        // The last create long ago: nothing to wait for.
        assert_eq!(hold_for(t0 + far, Some(t0), Some(close)), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn pending_completions_hold_only_after_recent_work() {
        let mut pending = Pending::default();
        pending.add(complete(1));
        assert_eq!(pending.hold(), Duration::ZERO, "nothing else was proposed");
        pending.take();
        pending.add(create());
        pending.take();
        tokio::time::advance(BUSY_LOOKBACK / 2).await;
        pending.add(complete(2));
        assert_eq!(pending.hold(), Duration::ZERO, "a lone create");
        pending.take();
        pending.add(create());
        pending.take();
        tokio::time::advance(BUSY_LOOKBACK / 2).await;
        pending.add(complete(3));
        assert_eq!(pending.hold(), COMPLETION_HOLD, "creates are flowing");
        pending.take();
        tokio::time::advance(BUSY_LOOKBACK * 2).await;
        pending.add(complete(4));
        assert_eq!(
            pending.hold(),
            Duration::ZERO,
            "the last create is long past"
        );
    }
}
