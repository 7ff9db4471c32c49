//! One partition on this broker: its Raft node, its proposer and its leader-side timers.
//!
//! # Layout
//! - this file: the partition, submitting commands, claims of activations in
//!   flight, reads of the leader's state;
//! - `proposer`: group commit at the application level; Raft entries are expensive
//!   and commands are cheap, so everything that arrives while Raft flushes the
//!   previous entry is drained into one [`Batch`];
//! - `push`: push targets chosen before proposing, pushes sent after apply, yields
//!   and back-fills;
//! - `recovery`: a new leader's reconciliation of its predecessors' pushes, and the
//!   jobs of a gateway that is gone;
//! - `leader`: the state and tasks of one term of leadership ([`LeaderState`]);
//! - `handoff`: leadership handed to an up-to-date follower;
//! - `timers`: activation deadlines and retry back-offs.

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
    ActivatedJob, ActivationProps, BrokerError, Command, JobKey, Lease, LinkId, NodeId,
    PartitionId, Reply, RequestId,
};
use courier_proto::push_refusal::DISOWNED;
use courier_proto::sync::{lock, read_lock, write_lock};
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use openraft::error::{ClientWriteError, RaftError};
use openraft::ServerState;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::{broadcast, mpsc, oneshot, Notify};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

mod handoff;
mod inspect;
mod leader;
mod payloads;
mod proposer;
mod push;
mod recovery;
#[cfg(test)]
mod tests;
mod timers;

pub use handoff::ElectError;
use handoff::Gate;
pub use inspect::{ActivationRate, MAX_LIST};
use leader::*;
use payloads::*;
use proposer::*;
use push::*;
use recovery::*;
use timers::*;

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

/// The jobs an Activate in flight may take, claimed from when it is proposed until
/// its caller has the answer (or goes away). On release, the jobs of its tenants
/// still activatable are announced: it may have taken fewer than it claimed, and
/// polls answered "claimed" meanwhile may be parked on them.
struct ActivationClaim<'a> {
    partition: &'a Partition,
    leader: Arc<LeaderState>,
    job_type: String,
    tenants: Vec<String>,
    max_jobs: u32,
    /// The request id of a once-only activation.
    request: Option<RequestId>,
}

impl Drop for ActivationClaim<'_> {
    fn drop(&mut self) {
        let p = self.partition;
        let mut claims = lock(&self.leader.claims);
        claims.release(&self.job_type, &self.tenants, self.max_jobs, self.request);
        drop(claims);
        if !self.leader.current() {
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
    /// Jobs this replica activated lately, while leading.
    activations: ActivationRate,
    /// Takes in the snapshots a leader sends, checked before Raft installs them.
    pub intake: Arc<crate::store::sm::SnapshotIntake>,
    shared: Arc<SharedState>,
    proposals: mpsc::Sender<Proposal>,
    registry: Arc<JobStreamRegistry>,
    notices: Notices,
    /// The leadership in force, while this replica leads (see [`Partition::leader`]).
    leader: RwLock<Option<Arc<LeaderState>>>,
    /// See [`crate::config::BrokerConfig::lost_gateway_grace`].
    lost_gateway_grace: Option<Duration>,
    /// See [`crate::config::BrokerConfig::max_partition_bytes`].
    max_bytes: u64,
    /// Counts the entries the proposer has in flight; closed during a hand-off.
    gate: Gate,
    /// Set once this broker was asked to stop: it takes no partition over then.
    stopping: AtomicBool,
    /// Set once the broker's storage failed: the replica is stopped for good, and
    /// leads no more whatever Raft's last word (see `failstop`).
    failed: AtomicBool,
    /// When this replica last heard from a leader or granted a vote (see
    /// `drive_elections` in the crate root).
    /// In µs since `started`; an atomic, since every append-entries sets it.
    leader_heard_us: AtomicU64,
    started: std::time::Instant,
    /// Whether a voter refused this replica's last candidacy for a longer log.
    pub longer_log: Arc<crate::raft::LongerLog>,
    /// The broker's tasks: the partition's own and its leaderships'.
    tasks: TaskTracker,
    shutdown: CancellationToken,
}

impl Partition {
    /// Starts the proposer of a partition; it, and every leadership's tasks, stop on
    /// `shutdown`.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        id: PartitionId,
        node_id: NodeId,
        raft: Raft,
        intake: Arc<crate::store::sm::SnapshotIntake>,
        shared: Arc<SharedState>,
        notices: Notices,
        registry: Arc<JobStreamRegistry>,
        lost_gateway_grace: Option<Duration>,
        max_bytes: u64,
        longer_log: Arc<crate::raft::LongerLog>,
        tasks: &TaskTracker,
        shutdown: CancellationToken,
    ) -> Arc<Partition> {
        let (tx, rx) = mpsc::channel(QUEUE_CAPACITY);
        let p = Arc::new(Partition {
            id,
            node_id,
            raft,
            activations: ActivationRate::default(),
            intake,
            shared,
            proposals: tx,
            registry,
            notices,
            leader: RwLock::new(None),
            lost_gateway_grace,
            max_bytes,
            gate: Gate::default(),
            stopping: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            leader_heard_us: AtomicU64::new(0),
            started: std::time::Instant::now(),
            longer_log,
            tasks: tasks.clone(),
            shutdown: shutdown.clone(),
        });
        let span = tracing::info_span!("partition", partition = id.0, node = node_id);
        tasks.spawn(run_proposer(p.clone(), rx, shutdown).instrument(span));
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
        read_lock(&self.leader)
            .as_ref()
            .is_some_and(|l| l.majority_lost())
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

    /// Tells every linked gateway that this replica leads now, and in which term,
    /// so that they route here without waiting for a topology round.
    fn announce_leadership(&self, term: u64) {
        tracing::info!(partition = self.id.0, term, "leading: telling the gateways");
        // No link: no gateway to tell (they learn it from their next round).
        let _ = self.notices.send(BrokerMessage {
            kind: Some(broker_message::Kind::Leading(Leading {
                partition_id: self.id.0,
                term,
            })),
        });
    }

    /// Prepares a client's command with the leader's push decisions and replicates it.
    /// `gateway`, the id of the gateway that sent it, if it said.
    pub async fn submit(
        self: &Arc<Self>,
        cmd: Command,
        gateway: Option<Arc<str>>,
    ) -> Result<Reply, BrokerError> {
        self.submit_in(cmd, gateway, None).await
    }

    /// [`Partition::submit`], limited to the caller's `tenants` when given: a
    /// command about a job of another tenant finds no job.
    pub async fn submit_in(
        self: &Arc<Self>,
        cmd: Command,
        gateway: Option<Arc<str>>,
        tenants: Option<Vec<String>>,
    ) -> Result<Reply, BrokerError> {
        // A poll's jobs are recorded with the gateway they go out through.
        let via = cmd
            .inner()
            .activation()
            .and_then(|_| gateway.as_deref().map(str::to_string));
        let ends_from = match (cmd.inner(), gateway) {
            (
                Command::Complete { key, .. }
                | Command::Fail { key, .. }
                | Command::ThrowError { key, .. },
                Some(g),
            ) => Some((*key, g)),
            _ => None,
        };
        let _claim = match cmd.inner().activation() {
            Some((props, max_jobs, _)) => {
                match self.claim_activation(props, max_jobs, cmd.once_request()) {
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
        let reply = self.propose_from(logged, ends_from).await;
        if let Ok(Reply::Activated(jobs)) = &reply {
            for j in jobs {
                self.activations.add(&j.job_type, &j.tenant_id, 1);
            }
        }
        reply
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
        self: &Arc<Self>,
        props: &ActivationProps,
        max_jobs: u32,
        request: Option<RequestId>,
    ) -> Result<Option<ActivationClaim<'_>>, &'static str> {
        // Not leading: the proposal is refused as it is.
        let Some(leader) = self.leader() else {
            return Ok(None);
        };
        let mut claims = lock(&leader.claims);
        if request.is_some_and(|r| claims.carries(r)) {
            return Ok(None);
        }
        {
            let applied = self.shared.read();
            if request.is_some_and(|r| applied.state.once_record(r).is_some()) {
                return Ok(None);
            }
            let caught_up = applied
                .last_applied
                .is_some_and(|id| id.leader_id.term == leader.term);
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
        drop(claims);
        Ok(Some(ActivationClaim {
            partition: self,
            leader,
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

    /// Replicates `cmd` and answers once it is committed and applied. Credit held
    /// for its push targets goes back if it is never proposed.
    pub async fn propose(self: &Arc<Self>, cmd: LogCommand) -> Result<Reply, BrokerError> {
        self.propose_from(cmd, None).await
    }

    async fn propose_from(
        self: &Arc<Self>,
        cmd: LogCommand,
        ends_from: Option<(JobKey, Arc<str>)>,
    ) -> Result<Reply, BrokerError> {
        if let Err(e) = self.check_leader().and_then(|()| self.check_room(&cmd)) {
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

    /// Refuses a create whose jobs would take the partition's jobs past
    /// [`Partition::max_bytes`]. A create sent again after it was applied is let
    /// through, to be answered as the first time. Creates queued but not yet applied
    /// are not counted: the bound can be passed by what is in flight, no more.
    fn check_room(&self, cmd: &LogCommand) -> Result<(), BrokerError> {
        let (LogCommand::Client { cmd, .. } | LogCommand::ClientIn { cmd, .. }) = cmd else {
            return Ok(());
        };
        let Command::Create(jobs) = cmd.inner() else {
            return Ok(());
        };
        let adding: u64 = jobs.iter().map(new_job_bytes).sum();
        let applied = self.shared.read();
        if let Command::Once { request, .. } = cmd {
            if applied.state.once_record(*request).is_some() {
                return Ok(());
            }
        }
        let held = applied.state.held_bytes();
        if held.saturating_add(adding) <= self.max_bytes {
            return Ok(());
        }
        drop(applied);
        metrics::REJECTED
            .with_label_values(&[label::rejected::PARTITION_FULL])
            .inc();
        Err(BrokerError::ResourceExhausted(format!(
            "partition {} holds {held} bytes of jobs, and {adding} more would pass its \
             bound of {} (--max-partition-bytes); retry once jobs have ended",
            self.id, self.max_bytes
        )))
    }

    fn refund_targets(&self, cmd: &LogCommand) {
        for t in targets_of(cmd) {
            self.registry.refund(&t.recipient, u64::from(t.max));
        }
    }

    /// Reads a job from the leader's state; with `tenants`, a job of another
    /// tenant is not found.
    pub fn get_job(
        self: &Arc<Self>,
        key: JobKey,
        tenants: Option<&[String]>,
    ) -> Result<Reply, BrokerError> {
        self.check_leader()?;
        let (view, stored) = {
            let applied = self.shared.read();
            let view = applied
                .state
                .view(key)
                .filter(|v| tenants.is_none_or(|t| t.contains(&v.tenant_id)));
            (view, applied.state.stored_payload(key).is_some())
        };
        let mut view = view
            .ok_or_else(|| BrokerError::NotFound(format!("job with key '{key}' was not found")))?;
        if stored {
            // Read after the state: a job that ended since has no payload left.
            let payload = self.shared.payloads.get(key).map_err(|e| {
                BrokerError::Unavailable(format!("cannot read the payload of job {key}: {e}"))
            })?;
            let payload = payload.ok_or_else(|| {
                BrokerError::NotFound(format!("job with key '{key}' was not found"))
            })?;
            view.variables = payload.variables;
            view.custom_headers = payload.custom_headers;
        }
        Ok(Reply::Job(view))
    }

    /// The term this replica leads in, if it leads now.
    fn leading_term(&self) -> Option<u64> {
        if self.has_failed() {
            return None;
        }
        let m = self.raft.server_metrics();
        let m = m.borrow();
        (m.state == ServerState::Leader).then(|| m.vote.leader_id().term)
    }

    /// Jobs, what they weigh in memory, those whose payload is stored apart, and
    /// remembered requests.
    pub fn held(&self) -> (usize, u64, usize, usize) {
        let applied = self.shared.read();
        (
            applied.state.job_count(),
            applied.state.held_bytes(),
            applied.state.stored_count(),
            applied.state.once_count(),
        )
    }

    /// See [`crate::config::BrokerConfig::max_partition_bytes`].
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Whether this replica leads its partition now.
    pub fn is_leader(&self) -> bool {
        // The server metrics change with role and leader only; the full metrics
        // change with every entry, and their lock with them.
        let m = self.raft.server_metrics();
        let m = m.borrow();
        m.state == ServerState::Leader && !self.has_failed()
    }

    /// Stops this replica for good after a storage fault: it stands for nothing
    /// more, and a leadership it held ends now, so commands are refused as by a
    /// follower instead of reaching its stopped Raft.
    pub async fn stop_for_good(self: &Arc<Self>) {
        self.failed.store(true, Ordering::Relaxed);
        self.begin_stopping();
        self.sync_leadership();
        match tokio::time::timeout(Duration::from_secs(5), self.raft.shutdown()).await {
            Ok(Ok(())) => tracing::info!(partition = self.id.0, "replica stopped"),
            Ok(Err(e)) => tracing::warn!(partition = self.id.0, error = %e, "stopping the replica"),
            Err(_) => tracing::warn!(partition = self.id.0, "the replica did not stop in 5 s"),
        }
    }

    /// Whether this replica was stopped for good ([`Partition::stop_for_good`]).
    pub fn has_failed(&self) -> bool {
        self.failed.load(Ordering::Relaxed)
    }

    fn check_leader(self: &Arc<Self>) -> Result<(), BrokerError> {
        if let Some(leader) = self.leader() {
            if leader.majority_lost() {
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
            let leader = self.raft.server_metrics().borrow().current_leader;
            Err(BrokerError::NotLeader {
                partition: self.id,
                leader: leader.filter(|l| *l != self.node_id),
            })
        }
    }

    fn stopping(&self) -> BrokerError {
        BrokerError::Unavailable(format!("partition {} is shutting down", self.id))
    }
}

/// What a job created from `new` will weigh (see [`crate::engine::held_bytes`]).
fn new_job_bytes(new: &courier_proto::domain::NewJob) -> u64 {
    let text = courier_proto::domain::job_text_bytes(
        &new.job_type,
        &new.tenant_id,
        &new.variables,
        &new.custom_headers,
        &new.process,
    );
    u64::try_from(text).unwrap_or(u64::MAX) + crate::engine::JOB_OVERHEAD_BYTES
}
