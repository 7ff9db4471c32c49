//! The job engine: a pure, deterministic function of (state, command) -> (reply,
//! effects, changed jobs).
//!
//! No I/O, clock, randomness or broker-local reads happen here: every replica that
//! applies log entry N ends in the same state. What only the leader may decide (the
//! timestamp) arrives inside the [`Batch`]. Effects are carried out by the leader
//! after the entry is applied; followers drop them.
//!
//! This file holds the state, its indexes and what the log and the leader read of
//! it; `apply` the transitions.

use courier_proto::domain::{
    activated_size_bound, job_text_bytes, job_too_large, ActivatedJob, ActivationProps,
    BrokerError, Command, JobKey, JobStateKind, JobView, Lease, LinkId, NewJob, PartitionId,
    ProcessContext, Reply, RequestId, StreamId, MAX_JOB_BYTES, ONCE_WINDOW_MS,
};
use courier_proto::sync::lock;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

mod apply;
mod inspect;
mod payload;
#[cfg(test)]
pub(crate) mod tests;

pub(crate) use apply::filter_variables;
pub use apply::Applied;
use apply::*;
pub use inspect::SliceEnd;
pub use payload::{payload_bytes, Payload};

/// One replicated log entry: every command a partition's proposer gathered while
/// Raft flushed its previous entry, stamped with the leader's clock.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    /// Epoch ms, decided by the leader before proposing.
    pub ts: i64,
    pub commands: Vec<LogCommand>,
    /// The proposer's word that this entry is on the leader's disk. In memory only:
    /// never written, so followers and replays see none.
    #[serde(skip)]
    pub on_flushed: FlushSignal,
}

/// Fires once the entry carrying it is durable in the leader's own log (with
/// durability `replicated`: written). Raft 0.9 takes one append at a time and waits
/// for it to be flushed, so that moment, not the commit, is when the proposer hands
/// it the next entry: whatever queued during the flush goes into that one entry.
/// Dropping the last copy unfired (the entry never reached the log) fires it too.
/// What firing does is the proposer's; the engine only carries it.
#[derive(Clone, Default)]
pub struct FlushSignal(Option<Arc<OnFlushed>>);

/// What firing does, done at most once: when fired, or when the last copy of the
/// signal is dropped unfired.
struct OnFlushed(Mutex<Option<Box<dyn FnOnce() + Send>>>);

impl OnFlushed {
    fn run(&self) {
        let f = lock(&self.0).take();
        if let Some(f) = f {
            f();
        }
    }
}

impl Drop for OnFlushed {
    fn drop(&mut self) {
        self.run();
    }
}

impl FlushSignal {
    /// A signal that calls `on_flushed` when it fires (or is dropped unfired).
    pub fn new(on_flushed: impl FnOnce() + Send + 'static) -> FlushSignal {
        FlushSignal(Some(Arc::new(OnFlushed(Mutex::new(Some(Box::new(
            on_flushed,
        )))))))
    }

    /// Whether anyone waits for this signal.
    pub fn is_set(&self) -> bool {
        self.0.is_some()
    }

    /// Tells the waiting proposer; later calls do nothing.
    pub fn fire(&self) {
        if let Some(on_flushed) = &self.0 {
            on_flushed.run();
        }
    }
}

impl std::fmt::Debug for FlushSignal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_set() {
            "FlushSignal(set)"
        } else {
            "FlushSignal"
        })
    }
}

/// Not part of the entry's value: two batches with the same commands are equal.
impl PartialEq for FlushSignal {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for FlushSignal {}

/// A command as written to the log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LogCommand {
    /// A client's command, with the leader's push decisions for jobs it makes runnable
    /// and, for an Activate, the gateway the poll came through (when it said).
    Client {
        cmd: Command,
        push: Vec<PushTarget>,
        via: Option<String>,
    },
    /// Activations the leader's timer found past their deadline; re-checked on apply.
    TimeOut {
        keys: Vec<JobKey>,
        push: Vec<PushTarget>,
    },
    /// Failed jobs the leader's timer found past their retry back-off; re-checked on apply.
    Recur {
        keys: Vec<JobKey>,
        push: Vec<PushTarget>,
    },
    /// Every recipient refused a pushed job: it becomes activatable again, unless the
    /// activation named by `lease` is no longer the job's current one.
    Yield { key: JobKey, lease: Lease },
    /// Activate and push up to `target.max` of the oldest activatable jobs matching the
    /// target's stream (a stream registered after they were created).
    Backfill { target: PushTarget },
    /// A client's command about one job, limited to the caller's `tenants`: a job
    /// of another tenant answers as a job that does not exist, so its existence is
    /// not told. Checked on apply, where every replica sees the same job. Last of
    /// the variants: entries written before it read the same.
    ClientIn {
        cmd: Command,
        push: Vec<PushTarget>,
        tenants: Vec<String>,
    },
}

impl LogCommand {
    /// A client command with no push decision.
    pub fn client(cmd: Command) -> LogCommand {
        LogCommand::Client {
            cmd,
            push: Vec::new(),
            via: None,
        }
    }
}

/// Which aggregated stream on which gateway link a job is pushed to. Only the leader
/// acts on the recipient; apply uses the properties, so every replica activates alike.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Recipient {
    /// The broker-local id of the gateway link.
    pub link: LinkId,
    /// The gateway's id of the aggregated stream.
    pub stream_id: StreamId,
}

/// The leader's decision, written into a command, to push up to `max` jobs of the
/// stream's type and tenants that the command makes runnable.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushTarget {
    pub props: ActivationProps,
    pub recipient: Recipient,
    pub max: u32,
    /// The id the recipient's gateway gave in its hello: recorded in the activations,
    /// so a later leader knows which gateway to ask about them.
    pub gateway: String,
}

impl PushTarget {
    /// What an activation for this target records, in an entry of `term`.
    fn via(&self, term: u64) -> Via {
        Via {
            gateway: self.gateway.clone(),
            term,
            pushed: true,
        }
    }

    fn takes(&self, job: &Job) -> bool {
        self.props.job_type == job.job_type && self.props.tenant_ids.contains(&job.tenant_id)
    }
}

/// A job activated for a stream, to push after apply.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Push {
    pub target: PushTarget,
    pub lease: Lease,
    pub job: ActivatedJob,
    pub origin: PushOrigin,
}

/// Why a job was pushed: for the create-to-push latency and back-fill metrics.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PushOrigin {
    /// Created by this entry.
    Created,
    /// Runnable again (failed, timed out, back-off over, retries updated).
    Runnable,
    /// Taken from the backlog for a stream that had none or no credit before.
    Backfill,
}

/// What the leader does after applying an entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Effect {
    /// Jobs of this type and tenant became activatable: wake parked long polls.
    JobsAvailable { job_type: String, tenant_id: String },
    /// A job was activated for a stream: push it to the recipient. Boxed: it carries
    /// the job's documents.
    Push(Box<Push>),
    /// An activation ended (completed, failed, error thrown, canceled, timed out,
    /// yielded): a gateway holding it for a client may count that credit free again.
    Finished { key: JobKey, lease: Lease },
}

/// A job's lifecycle state while it exists. Completed and canceled jobs are removed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobStatus {
    /// Waiting to be activated; `seq` orders its type's queue (oldest first).
    Activatable { seq: u64 },
    /// Held by a worker until `deadline`; `lease` is unique per activation.
    Activated {
        worker: String,
        deadline: i64,
        lease: Lease,
        /// The gateway it went out through, when known.
        via: Option<Via>,
    },
    /// Failed with retries left; runnable again at `retry_at`.
    BackOff { retry_at: i64 },
    /// Failed without retries left: waits for UpdateJobRetries.
    Incident,
    /// A worker threw a business error; terminal, kept so its code and message can be read.
    ErrorThrown,
}

/// Which gateway an activation went out through, and in which term: a leader of a
/// later term asks the gateway whether a push reached it (the leader that made it
/// may have died before sending it), and the jobs handed out through a gateway that
/// is gone are runnable again.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Via {
    /// The gateway's id from its hello (or its requests' header).
    pub gateway: String,
    /// The term of the entry that activated it.
    pub term: u64,
    /// Pushed to a stream, rather than polled.
    pub pushed: bool,
}

/// A job handed out through a gateway that may not have it (see
/// [`State::pushed_before`] and [`State::handed_through`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Handed {
    pub key: JobKey,
    pub lease: Lease,
    pub gateway: String,
}

/// One job's record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Job {
    pub key: JobKey,
    pub job_type: String,
    pub tenant_id: String,
    pub variables: String,
    pub custom_headers: String,
    pub retries: i32,
    pub process: ProcessContext,
    pub created_at: i64,
    pub status: JobStatus,
    pub error_message: String,
    pub error_code: String,
}

/// Counters that must advance identically on every replica.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Last job counter used in a key.
    pub last_key: u64,
    /// Last queue position handed out.
    pub last_seq: u64,
    /// Last activation lease handed out.
    pub last_lease: u64,
}

/// What applying touched: the storage layer writes or deletes exactly these jobs
/// and records of [`Command::Once`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    pub jobs: BTreeSet<JobKey>,
    /// Request ids of [`Command::Once`] recorded or forgotten.
    pub requests: BTreeSet<RequestId>,
    /// Payloads to store apart from their job's record, or to drop from there.
    pub payloads: BTreeMap<JobKey, Option<Payload>>,
}

impl Changes {
    pub fn new() -> Changes {
        Changes::default()
    }

    /// How many jobs and records changed.
    pub fn len(&self) -> usize {
        self.jobs.len() + self.requests.len() + self.payloads.len()
    }

    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty() && self.requests.is_empty() && self.payloads.is_empty()
    }
}

/// What a partition remembers of an applied [`Command::Once`]: when, and how it
/// went.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OnceRecord {
    /// The entry's timestamp (epoch ms).
    pub ts: i64,
    pub outcome: Outcome,
}

/// How a [`Command::Once`] went: what a repeat of it is answered.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// Jobs created with consecutive keys (one command's jobs take the next
    /// counters in turn): the counter of the first, and how many.
    Created {
        first: u64,
        count: u32,
    },
    Done,
    /// Jobs activated, with the lease of each activation.
    Activated {
        jobs: Vec<(JobKey, Lease)>,
    },
}

/// A partition's state: the jobs and the indexes derived from them.
#[derive(Clone, Debug)]
pub struct State {
    partition: PartitionId,
    counters: Counters,
    jobs: BTreeMap<JobKey, Job>,
    /// (type, tenant) -> seq -> key: activatable jobs, oldest first.
    queues: BTreeMap<(String, String), BTreeMap<u64, JobKey>>,
    /// (deadline, key) of activated jobs.
    deadlines: BTreeSet<(i64, JobKey)>,
    /// (retry_at, key) of jobs in back-off.
    backoffs: BTreeSet<(i64, JobKey)>,
    /// [`Command::Once`]s applied within [`ONCE_WINDOW_MS`], by request id.
    onces: BTreeMap<RequestId, OnceRecord>,
    /// (ts, id) of `onces`, oldest first: what to forget next.
    once_times: BTreeSet<(i64, RequestId)>,
    /// What the jobs weigh in memory, by [`held_bytes`]: derived from `jobs`.
    held_bytes: u64,
    /// Past this weight a new payload is kept in the store only.
    payload_budget: u64,
    /// Jobs whose payload is in the store only, with its size.
    stored: BTreeMap<JobKey, u64>,
}

/// What a job's record and its index entries cost beyond its text, roughly.
pub const JOB_OVERHEAD_BYTES: u64 = 256;

/// What job `job` weighs in a replica's memory: its text, its error, and a fixed
/// share for the record and its indexes.
pub fn held_bytes(job: &Job) -> u64 {
    let text = text_bytes(job) + job.error_message.len() + job.error_code.len();
    u64::try_from(text).unwrap_or(u64::MAX) + JOB_OVERHEAD_BYTES
}

/// The size of job `job`'s text as a create states it (see [`job_text_bytes`]).
fn text_bytes(job: &Job) -> usize {
    job_text_bytes(
        &job.job_type,
        &job.tenant_id,
        &job.variables,
        &job.custom_headers,
        &job.process,
    )
}

impl State {
    /// An empty partition.
    pub fn new(partition: PartitionId) -> Self {
        Self::from_parts(partition, Counters::default(), Vec::new(), Vec::new())
    }

    /// Rebuilds the state (and its indexes) from jobs held whole, counters and
    /// records of [`Command::Once`].
    pub fn from_parts(
        partition: PartitionId,
        counters: Counters,
        jobs: impl IntoIterator<Item = Job>,
        onces: impl IntoIterator<Item = (RequestId, OnceRecord)>,
    ) -> Self {
        State::from_stored(
            partition,
            counters,
            jobs.into_iter().map(|j| (j, None)),
            onces,
        )
    }

    /// Rebuilds the state from stored jobs, each with the size of its payload when
    /// that is stored apart (its record then holds none), counters and records of
    /// [`Command::Once`].
    pub fn from_stored(
        partition: PartitionId,
        counters: Counters,
        jobs: impl IntoIterator<Item = (Job, Option<u64>)>,
        onces: impl IntoIterator<Item = (RequestId, OnceRecord)>,
    ) -> Self {
        let mut s = State {
            partition,
            counters,
            jobs: BTreeMap::new(),
            queues: BTreeMap::new(),
            deadlines: BTreeSet::new(),
            backoffs: BTreeSet::new(),
            onces: BTreeMap::new(),
            once_times: BTreeSet::new(),
            held_bytes: 0,
            payload_budget: u64::MAX,
            stored: BTreeMap::new(),
        };
        for (job, stored) in jobs {
            s.held_bytes += held_bytes(&job);
            s.index(&job);
            if let Some(size) = stored {
                s.stored.insert(job.key, size);
            }
            s.jobs.insert(job.key, job);
        }
        for (id, record) in onces {
            s.once_times.insert((record.ts, id));
            s.onces.insert(id, record);
        }
        s
    }

    pub fn partition(&self) -> PartitionId {
        self.partition
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    pub fn job(&self, key: JobKey) -> Option<&Job> {
        self.jobs.get(&key)
    }

    pub fn jobs(&self) -> impl Iterator<Item = &Job> {
        self.jobs.values()
    }

    pub fn job_count(&self) -> usize {
        self.jobs.len()
    }

    /// What the jobs weigh in memory, by [`held_bytes`].
    pub fn held_bytes(&self) -> u64 {
        self.held_bytes
    }

    /// What job `key` weighs now (0 when there is none).
    fn weight(&self, key: JobKey) -> u64 {
        self.jobs.get(&key).map_or(0, held_bytes)
    }

    /// Counts job `key` at its new weight, after a change from `before`.
    fn reweigh(&mut self, key: JobKey, before: u64) {
        let after = self.weight(key);
        self.held_bytes = self.held_bytes.saturating_sub(before).saturating_add(after);
    }

    /// The record of the [`Command::Once`] with request id `id`, while it is
    /// remembered.
    pub fn once_record(&self, id: RequestId) -> Option<&OnceRecord> {
        self.onces.get(&id)
    }

    /// How many [`Command::Once`]s are remembered.
    pub fn once_count(&self) -> usize {
        self.onces.len()
    }

    /// The remembered [`Command::Once`]s, by request id.
    pub fn onces(&self) -> impl Iterator<Item = (RequestId, OnceRecord)> + '_ {
        self.onces.iter().map(|(id, r)| (*id, r.clone()))
    }

    /// The earliest activation deadline, if any job is activated.
    pub fn next_deadline(&self) -> Option<i64> {
        self.deadlines.first().map(|(d, _)| *d)
    }

    /// The earliest deadline or end of a retry back-off: when the timers have
    /// something to do next.
    pub fn next_timer(&self) -> Option<i64> {
        self.next_deadline()
            .into_iter()
            .chain(self.next_retry())
            .min()
    }

    /// The earliest end of a retry back-off, if any job is in back-off.
    pub fn next_retry(&self) -> Option<i64> {
        self.backoffs.first().map(|(d, _)| *d)
    }

    /// Activated jobs whose deadline is at or before `now`, at most `max`.
    pub fn due_deadlines(&self, now: i64, max: usize) -> Vec<JobKey> {
        self.deadlines
            .iter()
            .take_while(|(d, _)| *d <= now)
            .take(max)
            .map(|(_, k)| *k)
            .collect()
    }

    /// Jobs in back-off whose retry time is at or before `now`, at most `max`.
    pub fn due_retries(&self, now: i64, max: usize) -> Vec<JobKey> {
        self.backoffs
            .iter()
            .take_while(|(d, _)| *d <= now)
            .take(max)
            .map(|(_, k)| *k)
            .collect()
    }

    /// (type, tenant) pairs that have activatable jobs, e.g. to wake polls after a
    /// leader change.
    pub fn activatable_types(&self) -> Vec<(String, String)> {
        self.queues
            .iter()
            .filter(|(_, q)| !q.is_empty())
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Jobs whose current activation was pushed by the leader of a term before
    /// `term`: that leader may have died before the push left it, so the leader of
    /// `term` asks the gateways which of them arrived.
    pub fn pushed_before(&self, term: u64) -> Vec<Handed> {
        self.handed_where(|v| v.pushed && v.term < term)
    }

    /// Jobs whose current activation went out, pushed or polled, in any term,
    /// through a gateway for which `gone` holds: a gateway that is gone took them
    /// with it.
    pub fn handed_through(&self, gone: impl Fn(&str) -> bool) -> Vec<Handed> {
        self.handed_where(|v| gone(&v.gateway))
    }

    fn handed_where(&self, wanted: impl Fn(&Via) -> bool) -> Vec<Handed> {
        self.deadlines
            .iter()
            .filter_map(|(_, key)| match &self.jobs.get(key)?.status {
                JobStatus::Activated {
                    lease,
                    via: Some(v),
                    ..
                } if wanted(v) => Some(Handed {
                    key: *key,
                    lease: *lease,
                    gateway: v.gateway.clone(),
                }),
                _ => None,
            })
            .collect()
    }

    /// The GetJob view of a job.
    pub fn view(&self, key: JobKey) -> Option<JobView> {
        self.jobs.get(&key).map(|j| view_of(j, true))
    }

    /// How many jobs of this type and these tenants are activatable.
    pub fn activatable_count(&self, job_type: &str, tenants: &[String]) -> usize {
        tenants.iter().map(|t| self.queued(job_type, t)).sum()
    }

    /// How many jobs of `job_type` for `tenant` are activatable.
    pub fn queued(&self, job_type: &str, tenant: &str) -> usize {
        self.queues
            .get(&(job_type.to_string(), tenant.to_string()))
            .map_or(0, BTreeMap::len)
    }

    fn remove(&mut self, key: JobKey, changes: &mut Changes) {
        self.drop_stored(key, changes);
        self.unindex(key);
        let before = self.weight(key);
        self.jobs.remove(&key);
        self.reweigh(key, before);
        changes.jobs.insert(key);
    }

    fn expect_activated(&self, key: JobKey, action: &str) -> Result<(), BrokerError> {
        match self.jobs.get(&key) {
            None => Err(not_found(key, action)),
            Some(j) if matches!(j.status, JobStatus::Activated { .. }) => Ok(()),
            Some(j) => Err(precondition(key, action, &j.status)),
        }
    }

    fn job_mut(&mut self, key: JobKey, action: &str) -> Result<&mut Job, BrokerError> {
        self.jobs
            .get_mut(&key)
            .ok_or_else(|| not_found(key, action))
    }

    fn index(&mut self, job: &Job) {
        match &job.status {
            JobStatus::Activatable { seq } => {
                self.queues
                    .entry((job.job_type.clone(), job.tenant_id.clone()))
                    .or_default()
                    .insert(*seq, job.key);
            }
            JobStatus::Activated { deadline, .. } => {
                self.deadlines.insert((*deadline, job.key));
            }
            JobStatus::BackOff { retry_at } => {
                self.backoffs.insert((*retry_at, job.key));
            }
            JobStatus::Incident | JobStatus::ErrorThrown => {}
        }
    }

    fn reindex(&mut self, key: JobKey) {
        if let Some(job) = self.jobs.get(&key).cloned() {
            self.index(&job);
        }
    }

    fn unindex(&mut self, key: JobKey) {
        let Some(job) = self.jobs.get(&key) else {
            return;
        };
        match &job.status {
            JobStatus::Activatable { seq } => {
                let qk = (job.job_type.clone(), job.tenant_id.clone());
                if let Some(q) = self.queues.get_mut(&qk) {
                    q.remove(seq);
                    if q.is_empty() {
                        self.queues.remove(&qk);
                    }
                }
            }
            JobStatus::Activated { deadline, .. } => {
                self.deadlines.remove(&(*deadline, key));
            }
            JobStatus::BackOff { retry_at } => {
                self.backoffs.remove(&(*retry_at, key));
            }
            JobStatus::Incident | JobStatus::ErrorThrown => {}
        }
    }
}

/// Where a job stands, as GetJob reports it.
pub fn state_of(j: &Job) -> JobStateKind {
    match &j.status {
        JobStatus::Activatable { .. } => JobStateKind::Activatable,
        JobStatus::Activated { .. } => JobStateKind::Activated,
        JobStatus::BackOff { .. } => JobStateKind::FailedBackOff,
        JobStatus::Incident => JobStateKind::Incident,
        JobStatus::ErrorThrown => JobStateKind::ErrorThrown,
    }
}

/// The view of a job; with `payload`, its variables and headers as held in memory.
fn view_of(j: &Job, payload: bool) -> JobView {
    let (worker, deadline, retry_at) = match &j.status {
        JobStatus::Activated {
            worker, deadline, ..
        } => (worker.clone(), *deadline, 0),
        JobStatus::BackOff { retry_at } => (String::new(), 0, *retry_at),
        _ => (String::new(), 0, 0),
    };
    let text = |t: &String| if payload { t.clone() } else { String::new() };
    JobView {
        key: j.key,
        job_type: j.job_type.clone(),
        state: state_of(j),
        retries: j.retries,
        worker,
        deadline,
        retry_at,
        error_message: j.error_message.clone(),
        error_code: j.error_code.clone(),
        variables: text(&j.variables),
        custom_headers: text(&j.custom_headers),
        tenant_id: j.tenant_id.clone(),
        created_at: j.created_at,
    }
}
