//! The job engine: a pure, deterministic function of (state, command) -> (reply,
//! effects, changed jobs).
//!
//! No I/O, clock, randomness or broker-local reads happen here: every replica that
//! applies log entry N ends in the same state. What only the leader may decide (the
//! timestamp) arrives inside the [`Batch`]. Effects are carried out by the leader
//! after the entry is applied; followers drop them.

use courier_proto::domain::{
    job_text_bytes, job_too_large, ActivatedJob, ActivationProps, BrokerError, Command, JobKey,
    JobStateKind, JobView, NewJob, PartitionId, ProcessContext, Reply, RequestId, MAX_JOB_BYTES,
    ONCE_WINDOW_MS,
};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;

#[cfg(test)]
pub(crate) mod tests;

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
/// Dropping the signal unfired (the entry never reached the log) fires it too.
#[derive(Clone, Default)]
pub struct FlushSignal(Option<Arc<Mutex<Option<oneshot::Sender<()>>>>>);

impl FlushSignal {
    /// A signal and the receiver that learns when it fires (or is dropped).
    pub fn new() -> (FlushSignal, oneshot::Receiver<()>) {
        let (tx, rx) = oneshot::channel();
        (FlushSignal(Some(Arc::new(Mutex::new(Some(tx))))), rx)
    }

    /// Whether anyone waits for this signal.
    pub fn is_set(&self) -> bool {
        self.0.is_some()
    }

    /// Tells the waiting proposer; later calls do nothing.
    pub fn fire(&self) {
        if let Some(slot) = &self.0 {
            let tx = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(tx) = tx {
                let _ = tx.send(());
            }
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
    Yield { key: JobKey, lease: u64 },
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
    pub link: u64,
    /// The gateway's id of the aggregated stream.
    pub stream_id: u64,
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
    pub lease: u64,
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
    Finished { key: JobKey, lease: u64 },
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
        lease: u64,
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
    pub lease: u64,
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
}

impl Changes {
    pub fn new() -> Changes {
        Changes::default()
    }

    /// How many jobs and records changed.
    pub fn len(&self) -> usize {
        self.jobs.len() + self.requests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty() && self.requests.is_empty()
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
        jobs: Vec<(JobKey, u64)>,
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
}

impl State {
    /// An empty partition.
    pub fn new(partition: PartitionId) -> Self {
        Self::from_parts(partition, Counters::default(), Vec::new(), Vec::new())
    }

    /// Rebuilds the state (and its indexes) from stored jobs, counters and records
    /// of [`Command::Once`].
    pub fn from_parts(
        partition: PartitionId,
        counters: Counters,
        jobs: impl IntoIterator<Item = Job>,
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
        };
        for job in jobs {
            s.index(&job);
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
        let j = self.jobs.get(&key)?;
        let (state, worker, deadline, retry_at) = match &j.status {
            JobStatus::Activatable { .. } => (JobStateKind::Activatable, String::new(), 0, 0),
            JobStatus::Activated {
                worker, deadline, ..
            } => (JobStateKind::Activated, worker.clone(), *deadline, 0),
            JobStatus::BackOff { retry_at } => {
                (JobStateKind::FailedBackOff, String::new(), 0, *retry_at)
            }
            JobStatus::Incident => (JobStateKind::Incident, String::new(), 0, 0),
            JobStatus::ErrorThrown => (JobStateKind::ErrorThrown, String::new(), 0, 0),
        };
        Some(JobView {
            key,
            job_type: j.job_type.clone(),
            state,
            retries: j.retries,
            worker,
            deadline,
            retry_at,
            error_message: j.error_message.clone(),
            error_code: j.error_code.clone(),
            variables: j.variables.clone(),
            custom_headers: j.custom_headers.clone(),
            tenant_id: j.tenant_id.clone(),
            created_at: j.created_at,
        })
    }

    /// Applies one log entry of `term`: one reply per command, in order, and the
    /// entry's effects (de-duplicated, in order of first occurrence).
    pub fn apply_batch(&mut self, term: u64, batch: &Batch, changes: &mut Changes) -> Applied {
        self.forget_onces(batch.ts.saturating_sub(ONCE_WINDOW_MS), changes);
        let mut effects = Vec::new();
        let mut repeated = 0;
        let replies = batch
            .commands
            .iter()
            .map(|c| match self.repeat(c) {
                Some(answer) => {
                    repeated += 1;
                    Ok(answer)
                }
                None => self.apply(batch.ts, term, c, &mut effects, changes),
            })
            .collect();
        let mut seen = BTreeSet::new();
        effects.retain(|e| match e {
            Effect::JobsAvailable {
                job_type,
                tenant_id,
            } => seen.insert((job_type.clone(), tenant_id.clone())),
            Effect::Push(_) | Effect::Finished { .. } => true,
        });
        Applied {
            replies,
            effects,
            repeated,
        }
    }

    /// The answer to `cmd` if it repeats a [`Command::Once`] applied before (an
    /// earlier attempt's answer, as far as its jobs are still where it left them):
    /// a repeat changes nothing.
    fn repeat(&self, cmd: &LogCommand) -> Option<Reply> {
        let (LogCommand::Client {
            cmd: Command::Once { request, command },
            ..
        }
        | LogCommand::ClientIn {
            cmd: Command::Once { request, command },
            ..
        }) = cmd
        else {
            return None;
        };
        let done = self.onces.get(request)?;
        Some(self.answer_again(&done.outcome, command))
    }

    /// Applies one command at time `ts`, of an entry of `term`; a repeat of a
    /// [`Command::Once`] is answered by [`State::repeat`] before.
    fn apply(
        &mut self,
        ts: i64,
        term: u64,
        cmd: &LogCommand,
        effects: &mut Vec<Effect>,
        changes: &mut Changes,
    ) -> Result<Reply, BrokerError> {
        match cmd {
            LogCommand::Client { cmd, push, via } => {
                let mut budget = Budget::new(push, term);
                let via = via.as_ref().map(|gateway| Via {
                    gateway: gateway.clone(),
                    term,
                    pushed: false,
                });
                self.apply_client(ts, cmd, &mut budget, via, effects, changes)
            }
            LogCommand::TimeOut { keys, push } => {
                let mut budget = Budget::new(push, term);
                for key in keys {
                    let due = matches!(
                        self.jobs.get(key).map(|j| &j.status),
                        Some(JobStatus::Activated { deadline, .. }) if *deadline <= ts
                    );
                    if due {
                        self.end_activation(*key, effects);
                        self.runnable(ts, *key, &mut budget, false, effects, changes);
                    }
                }
                Ok(Reply::Done)
            }
            LogCommand::Recur { keys, push } => {
                let mut budget = Budget::new(push, term);
                for key in keys {
                    let due = matches!(
                        self.jobs.get(key).map(|j| &j.status),
                        Some(JobStatus::BackOff { retry_at }) if *retry_at <= ts
                    );
                    if due {
                        self.runnable(ts, *key, &mut budget, false, effects, changes);
                    }
                }
                Ok(Reply::Done)
            }
            LogCommand::Yield { key, lease } => {
                let current = matches!(
                    self.jobs.get(key).map(|j| &j.status),
                    Some(JobStatus::Activated { lease: l, .. }) if l == lease
                );
                if current {
                    // Not pushed again at once: it waits for a poll or a stream with room.
                    self.end_activation(*key, effects);
                    self.runnable(ts, *key, &mut Budget::default(), false, effects, changes);
                }
                Ok(Reply::Done)
            }
            LogCommand::ClientIn { cmd, push, tenants } => {
                if let Some((key, action)) = about_job(cmd.inner()) {
                    if self
                        .jobs
                        .get(&key)
                        .is_some_and(|j| !tenants.contains(&j.tenant_id))
                    {
                        return Err(not_found(key, action));
                    }
                }
                let mut budget = Budget::new(push, term);
                self.apply_client(ts, cmd, &mut budget, None, effects, changes)
            }
            LogCommand::Backfill { target } => {
                let via = target.via(term);
                let jobs = self.activate(ts, &target.props, target.max, Some(via), changes);
                for job in jobs {
                    let lease = self.lease_of(job.key);
                    effects.push(Effect::Push(Box::new(Push {
                        target: target.clone(),
                        lease,
                        job,
                        origin: PushOrigin::Backfill,
                    })));
                }
                Ok(Reply::Done)
            }
        }
    }

    fn apply_client(
        &mut self,
        ts: i64,
        cmd: &Command,
        budget: &mut Budget,
        polled_via: Option<Via>,
        effects: &mut Vec<Effect>,
        changes: &mut Changes,
    ) -> Result<Reply, BrokerError> {
        match cmd {
            Command::Create(jobs) => Ok(Reply::Created(
                jobs.iter()
                    .map(|j| self.create(ts, j, budget, effects, changes))
                    .collect(),
            )),
            Command::Once { request, command } => {
                if !matches!(
                    **command,
                    Command::Create(_)
                        | Command::Activate { .. }
                        | Command::Fail { .. }
                        | Command::ThrowError { .. }
                ) {
                    return Err(BrokerError::InvalidArgument(
                        "only a create, an activation, a fail or a thrown error is carried \
                         out once"
                            .into(),
                    ));
                }
                let first = self.counters.last_key + 1;
                let reply = self.apply_client(ts, command, budget, polled_via, effects, changes)?;
                let outcome = match &reply {
                    Reply::Created(keys) => Outcome::Created {
                        first,
                        count: u32::try_from(keys.len()).unwrap_or(u32::MAX),
                    },
                    Reply::Activated(jobs) => Outcome::Activated {
                        jobs: jobs.iter().map(|j| (j.key, self.lease_of(j.key))).collect(),
                    },
                    _ => Outcome::Done,
                };
                self.onces.insert(*request, OnceRecord { ts, outcome });
                self.once_times.insert((ts, *request));
                changes.requests.insert(*request);
                Ok(reply)
            }
            Command::Activate { props, max_jobs } => Ok(Reply::Activated(
                self.activate(ts, props, *max_jobs, polled_via, changes),
            )),
            Command::Complete { key, .. } => {
                self.expect_activated(*key, "complete")?;
                self.end_activation(*key, effects);
                self.remove(*key, changes);
                Ok(Reply::Done)
            }
            Command::Fail {
                key,
                retries,
                error_message,
                retry_backoff_ms,
                variables,
            } => {
                self.expect_activated(*key, "fail")?;
                // The job runs again with the variables merged in: it must still fit
                // in the message that hands it out.
                let merged = self.merged_variables(*key, variables.as_deref(), "fail")?;
                self.end_activation(*key, effects);
                self.unindex(*key);
                let job = self.job_mut(*key, "fail")?;
                job.retries = (*retries).max(0);
                job.error_message = error_message.clone();
                if let Some(merged) = merged {
                    job.variables = merged;
                }
                changes.jobs.insert(*key);
                if *retries <= 0 {
                    job.status = JobStatus::Incident;
                } else if *retry_backoff_ms > 0 {
                    job.status = JobStatus::BackOff {
                        retry_at: ts.saturating_add(*retry_backoff_ms),
                    };
                    self.reindex(*key);
                } else {
                    self.runnable(ts, *key, budget, false, effects, changes);
                }
                Ok(Reply::Done)
            }
            Command::ThrowError {
                key,
                error_code,
                error_message,
                variables,
            } => {
                self.expect_activated(*key, "throw an error for")?;
                // Kept with the variables merged in, as a failed job is: they must
                // fit the same bound, so the job can still be read (GetJob).
                let merged =
                    self.merged_variables(*key, variables.as_deref(), "throw an error for")?;
                self.end_activation(*key, effects);
                self.unindex(*key);
                let job = self.job_mut(*key, "throw an error for")?;
                job.error_code = error_code.clone();
                job.error_message = error_message.clone();
                if let Some(merged) = merged {
                    job.variables = merged;
                }
                job.status = JobStatus::ErrorThrown;
                changes.jobs.insert(*key);
                Ok(Reply::Done)
            }
            Command::UpdateRetries { key, retries } => {
                if *retries < 1 {
                    return Err(BrokerError::InvalidArgument(format!(
                        "retries must be at least 1, got {retries}"
                    )));
                }
                let job = self.job_mut(*key, "update retries of")?;
                if job.status == JobStatus::ErrorThrown {
                    return Err(precondition(*key, "update retries of", &job.status));
                }
                job.retries = *retries;
                let incident = job.status == JobStatus::Incident;
                changes.jobs.insert(*key);
                if incident {
                    self.runnable(ts, *key, budget, false, effects, changes);
                }
                Ok(Reply::Done)
            }
            Command::UpdateTimeout { key, timeout_ms } => {
                self.expect_activated(*key, "update the timeout of")?;
                self.unindex(*key);
                let job = self.job_mut(*key, "update the timeout of")?;
                if let JobStatus::Activated { deadline, .. } = &mut job.status {
                    *deadline = ts.saturating_add(*timeout_ms);
                }
                self.reindex(*key);
                changes.jobs.insert(*key);
                Ok(Reply::Done)
            }
            Command::Cancel { key } => {
                if !self.jobs.contains_key(key) {
                    return Err(not_found(*key, "cancel"));
                }
                self.end_activation(*key, effects);
                self.remove(*key, changes);
                Ok(Reply::Done)
            }
        }
    }

    fn create(
        &mut self,
        ts: i64,
        new: &NewJob,
        budget: &mut Budget,
        effects: &mut Vec<Effect>,
        changes: &mut Changes,
    ) -> JobKey {
        self.counters.last_key += 1;
        let key = JobKey::new(self.partition, self.counters.last_key);
        self.jobs.insert(
            key,
            Job {
                key,
                job_type: new.job_type.clone(),
                tenant_id: new.tenant_id.clone(),
                variables: new.variables.clone(),
                custom_headers: new.custom_headers.clone(),
                retries: new.retries,
                process: new.process.clone(),
                created_at: ts,
                status: JobStatus::Activatable { seq: 0 },
                error_message: String::new(),
                error_code: String::new(),
            },
        );
        self.runnable(ts, key, budget, true, effects, changes);
        key
    }

    /// The answer to a repeat of a [`Command::Once`] (`command`, the one it
    /// wraps) that went as `outcome` said. Activated jobs are given again while
    /// that activation holds them (not completed, failed or timed out since), as
    /// the first answer gave them.
    fn answer_again(&self, outcome: &Outcome, command: &Command) -> Reply {
        match outcome {
            Outcome::Created { first, count } => Reply::Created(
                (0..u64::from(*count))
                    .map(|i| JobKey::new(self.partition, first + i))
                    .collect(),
            ),
            Outcome::Done => Reply::Done,
            Outcome::Activated { jobs } => {
                let Command::Activate { props, .. } = command else {
                    return Reply::Activated(Vec::new());
                };
                Reply::Activated(
                    jobs.iter()
                        .filter_map(|(key, lease)| self.still_activated(*key, *lease, props))
                        .collect(),
                )
            }
        }
    }

    /// Job `key` as activated for `props`, if activation `lease` still holds it.
    fn still_activated(
        &self,
        key: JobKey,
        lease: u64,
        props: &ActivationProps,
    ) -> Option<ActivatedJob> {
        let job = self.jobs.get(&key)?;
        let JobStatus::Activated {
            worker,
            deadline,
            lease: current,
            ..
        } = &job.status
        else {
            return None;
        };
        (*current == lease).then(|| handed_out(job, worker, *deadline, props))
    }

    /// Forgets the [`Command::Once`]s applied before `cutoff` (epoch ms of the
    /// entry being applied, less the window): the same on every replica, as it goes
    /// by entries' timestamps only.
    fn forget_onces(&mut self, cutoff: i64, changes: &mut Changes) {
        while let Some(&(ts, id)) = self.once_times.first() {
            if ts >= cutoff {
                break;
            }
            self.once_times.pop_first();
            self.onces.remove(&id);
            changes.requests.insert(id);
        }
    }

    /// Activates up to `max` of the oldest activatable jobs matching `props`.
    fn activate(
        &mut self,
        ts: i64,
        props: &ActivationProps,
        max: u32,
        via: Option<Via>,
        changes: &mut Changes,
    ) -> Vec<ActivatedJob> {
        let mut picked: Vec<(u64, JobKey)> = Vec::new();
        for tenant in &props.tenant_ids {
            if let Some(q) = self.queues.get(&(props.job_type.clone(), tenant.clone())) {
                picked.extend(q.iter().take(max as usize).map(|(s, k)| (*s, *k)));
            }
        }
        picked.sort_unstable();
        picked.truncate(max as usize);
        picked
            .into_iter()
            .filter_map(|(_, key)| self.activate_one(ts, key, props, via.clone(), changes))
            .collect()
    }

    fn activate_one(
        &mut self,
        ts: i64,
        key: JobKey,
        props: &ActivationProps,
        via: Option<Via>,
        changes: &mut Changes,
    ) -> Option<ActivatedJob> {
        self.unindex(key);
        self.counters.last_lease += 1;
        let lease = self.counters.last_lease;
        let deadline = ts.saturating_add(props.timeout_ms);
        let job = self.jobs.get_mut(&key)?;
        job.status = JobStatus::Activated {
            worker: props.worker.clone(),
            deadline,
            lease,
            via,
        };
        let activated = handed_out(job, &props.worker, deadline, props);
        self.reindex(key);
        changes.jobs.insert(key);
        Some(activated)
    }

    /// A job became runnable: activated for a push target of the command when one
    /// matches and has room, otherwise queued and announced to long polls.
    fn runnable(
        &mut self,
        ts: i64,
        key: JobKey,
        budget: &mut Budget,
        created: bool,
        effects: &mut Vec<Effect>,
        changes: &mut Changes,
    ) {
        self.make_activatable(key, changes);
        let Some(job) = self.jobs.get(&key) else {
            return;
        };
        match budget.take(job) {
            Some(target) => {
                let via = Some(target.via(budget.term));
                if let Some(activated) = self.activate_one(ts, key, &target.props, via, changes) {
                    let lease = self.lease_of(key);
                    effects.push(Effect::Push(Box::new(Push {
                        target,
                        lease,
                        job: activated,
                        origin: if created {
                            PushOrigin::Created
                        } else {
                            PushOrigin::Runnable
                        },
                    })));
                }
            }
            None => effects.push(Effect::JobsAvailable {
                job_type: job.job_type.clone(),
                tenant_id: job.tenant_id.clone(),
            }),
        }
    }

    /// Puts an existing job at the back of its type's queue.
    fn make_activatable(&mut self, key: JobKey, changes: &mut Changes) {
        self.unindex(key);
        self.counters.last_seq += 1;
        let seq = self.counters.last_seq;
        let Some(job) = self.jobs.get_mut(&key) else {
            return;
        };
        job.status = JobStatus::Activatable { seq };
        self.reindex(key);
        changes.jobs.insert(key);
    }

    /// Announces the end of the job's activation, if it is activated.
    fn end_activation(&self, key: JobKey, effects: &mut Vec<Effect>) {
        if let Some(JobStatus::Activated { lease, .. }) = self.jobs.get(&key).map(|j| &j.status) {
            effects.push(Effect::Finished { key, lease: *lease });
        }
    }

    /// Job `key`'s variables with `variables` merged in (`None` when there are none
    /// to merge), refused when the job would then be over [`MAX_JOB_BYTES`].
    fn merged_variables(
        &mut self,
        key: JobKey,
        variables: Option<&str>,
        action: &str,
    ) -> Result<Option<String>, BrokerError> {
        let Some(v) = variables else {
            return Ok(None);
        };
        let job = self.job_mut(key, action)?;
        let merged = merge_objects(&job.variables, v);
        let bytes = job_text_bytes(
            &job.job_type,
            &job.tenant_id,
            &merged,
            &job.custom_headers,
            &job.process,
        );
        if bytes > MAX_JOB_BYTES {
            return Err(BrokerError::InvalidArgument(job_too_large(bytes)));
        }
        Ok(Some(merged))
    }

    fn lease_of(&self, key: JobKey) -> u64 {
        match self.jobs.get(&key).map(|j| &j.status) {
            Some(JobStatus::Activated { lease, .. }) => *lease,
            _ => 0,
        }
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
        self.unindex(key);
        self.jobs.remove(&key);
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

/// The push targets of one command and how many more jobs each may take.
#[derive(Default)]
struct Budget {
    slots: Vec<(PushTarget, u32)>,
    /// The term of the entry being applied.
    term: u64,
}

impl Budget {
    fn new(targets: &[PushTarget], term: u64) -> Self {
        Budget {
            slots: targets.iter().map(|t| (t.clone(), t.max)).collect(),
            term,
        }
    }

    /// The first target that takes this job and has room, using up one place.
    fn take(&mut self, job: &Job) -> Option<PushTarget> {
        let (target, left) = self
            .slots
            .iter_mut()
            .find(|(t, left)| *left > 0 && t.takes(job))?;
        *left -= 1;
        Some(target.clone())
    }
}

/// The replies and effects of one applied entry.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Applied {
    pub replies: Vec<Result<Reply, BrokerError>>,
    pub effects: Vec<Effect>,
    /// [`Command::Once`]s answered as an earlier attempt was.
    pub repeated: u32,
}

/// The job a command is about, and what it does to it in the words of the
/// NOT_FOUND answer.
fn about_job(cmd: &Command) -> Option<(JobKey, &'static str)> {
    match cmd {
        Command::Complete { key, .. } => Some((*key, "complete")),
        Command::Fail { key, .. } => Some((*key, "fail")),
        Command::ThrowError { key, .. } => Some((*key, "throw an error for")),
        Command::UpdateRetries { key, .. } => Some((*key, "update retries of")),
        Command::UpdateTimeout { key, .. } => Some((*key, "update the timeout of")),
        Command::Cancel { key } => Some((*key, "cancel")),
        Command::Create(_) | Command::Activate { .. } | Command::Once { .. } => None,
    }
}

fn not_found(key: JobKey, action: &str) -> BrokerError {
    BrokerError::NotFound(format!(
        "expected to {action} job with key '{key}', but no such job was found"
    ))
}

fn precondition(key: JobKey, action: &str, status: &JobStatus) -> BrokerError {
    let what = match status {
        JobStatus::Activatable { .. } => "it is activatable, not activated",
        JobStatus::Activated { .. } => "it is activated",
        JobStatus::BackOff { .. } => "it failed and is waiting for its retry back-off",
        JobStatus::Incident => "it failed without retries left (an incident)",
        JobStatus::ErrorThrown => "an error was thrown for it",
    };
    BrokerError::FailedPrecondition(format!(
        "expected to {action} job with key '{key}', but {what}"
    ))
}

/// `job` as an activation for `props` hands it out.
fn handed_out(job: &Job, worker: &str, deadline: i64, props: &ActivationProps) -> ActivatedJob {
    ActivatedJob {
        key: job.key,
        job_type: job.job_type.clone(),
        worker: worker.to_string(),
        retries: job.retries,
        deadline,
        variables: filter_variables(&job.variables, &props.fetch_variables),
        custom_headers: job.custom_headers.clone(),
        tenant_id: job.tenant_id.clone(),
        process: job.process.clone(),
    }
}

/// Keeps only the variables a worker asked for; all of them when it named none.
fn filter_variables(doc: &str, fetch: &[String]) -> String {
    if fetch.is_empty() {
        return doc.to_string();
    }
    match serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(doc) {
        Ok(mut map) => {
            map.retain(|k, _| fetch.iter().any(|f| f == k));
            serde_json::Value::Object(map).to_string()
        }
        Err(_) => doc.to_string(),
    }
}

/// Top-level merge of two JSON objects; keys of `update` win.
fn merge_objects(base: &str, update: &str) -> String {
    type Map = serde_json::Map<String, serde_json::Value>;
    match (
        serde_json::from_str::<Map>(base),
        serde_json::from_str::<Map>(update),
    ) {
        (Ok(mut b), Ok(u)) => {
            b.extend(u);
            serde_json::Value::Object(b).to_string()
        }
        (Err(_), Ok(_)) => update.to_string(),
        _ => base.to_string(),
    }
}
