//! The client-facing gRPC services: Zeebe's `gateway_protocol.Gateway` for workers and
//! Courier's `courier.v1.Jobs` for producers. Both are thin: convert and validate the
//! request, route it, convert the reply.
//!
//! This file holds what both share (routing a request about a job, long polls,
//! creates); `zeebe` and `jobs` the two services.

use crate::admission::Admission;
use crate::auth::{self, Caller};
use crate::error::GatewayError;
use crate::long_poll::{LongPollQueue, Waiter};
use crate::metrics::{self, RequestObserver};
use crate::router::{instant_after, request_deadline, stated_timeout, Router};
use crate::streams::{AggregatedStreams, MAX_CLIENT_CREDIT};
use crate::topology::{ClusterView, Topology};
use courier_proto::convert;
use courier_proto::courier_v1::{self as v1, jobs_server::Jobs};
use courier_proto::domain::{
    ActivationProps, BrokerError, Command, JobKey, JobStateKind, NewJob, PartitionId, Reply,
    Request, RequestId,
};
use courier_proto::gateway_protocol::{self as gw, gateway_server::Gateway};
use futures::{Stream, StreamExt};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::{Response, Status};
use tracing::Instrument;

mod inspect;
mod jobs;
mod lifetime;
#[cfg(test)]
mod lifetime_tests;
mod load;
#[cfg(test)]
mod tests;
mod zeebe;

pub use inspect::{Bulk, BulkOutcome, Inspector, InspectorSlot};
#[cfg(test)]
use jobs::create_batch;
pub use jobs::JobsService;
pub use load::ReportLoad;
use zeebe::to_i32;
pub use zeebe::{
    zeebe_topology, ActivateJobsStream, GatewayService, JobApiOnly, JobStream, JOB_API,
};

/// How long a long-poll visit keeps retrying one partition before skipping it: long
/// enough to follow a NotLeader hint, short enough that one sick partition does not
/// hold up the others.
const VISIT_RETRY_BUDGET: Duration = Duration::from_millis(300);

/// How long a poll's visit waits for the answer of an Activate it sent, however
/// soon its client's deadline: jobs activated for a client that has given up are
/// given back then, where an answer not waited for would leave them activated for
/// nobody until their timeout.
const ACTIVATE_SETTLE: Duration = Duration::from_secs(2);
/// How long CreateJob waits for one partition's leader before trying the next one.
const CREATE_HOP_AFTER: Duration = Duration::from_secs(1);
/// A long poll ends this much before the request's deadline, so the client gets a
/// clean end of stream rather than DEADLINE_EXCEEDED.
const LONG_POLL_MARGIN: Duration = Duration::from_millis(100);
/// How long giving back the jobs of an ActivateJobs answer nobody took may retry.
const GIVE_BACK_BUDGET: Duration = Duration::from_secs(10);
/// How long a reopening stream waits for the cluster to confirm the jobs its
/// worker says it holds; what is not confirmed by then is not counted.
const HELD_CHECK_BUDGET: Duration = Duration::from_secs(2);
/// The error message of a job given back that way.
const GIVE_BACK_MESSAGE: &str =
    "activated for an ActivateJobs call whose client went away before the answer; given back";
/// Most bytes of jobs one ActivateJobs answer carries (see
/// [`courier_proto::domain::MAX_ACTIVATE_BYTES`]): each partition is asked to
/// activate only what still fits, so a backlog of large jobs goes out over several
/// polls. Should jobs past it come back all the same, they are given back, and the
/// next poll gets them.
pub const MAX_ACTIVATE_RESPONSE_BYTES: usize = courier_proto::domain::MAX_ACTIVATE_BYTES;
/// An answer with less room left than this asks no further partition: the next poll
/// takes their jobs.
const MIN_ACTIVATE_ROOM: usize = 64 * 1024;
/// The error message of a job given back because its poll's answer was full.
const ANSWER_FULL_MESSAGE: &str =
    "activated beyond the 4 MiB an ActivateJobs answer may carry; given back";
/// Most jobs one CreateJobs request may carry.
pub const MAX_BATCH: usize = 10_000;
/// The version reported by Topology.
const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The StreamActivatedJobs request header in which Courier's worker states its
/// credit (its max jobs active); Zeebe clients never send it.
pub const MAX_JOBS_ACTIVE_HEADER: &str = "courier-max-jobs-active";

/// Metadata header of a `StreamActivatedJobs` request: the jobs its client holds
/// already (`KEY:DEADLINE_MS,...`), counted against its credit; see
/// [`AggregatedStreams::join_holding`](crate::streams::AggregatedStreams::join_holding).
pub const JOBS_HELD_HEADER: &str = "courier-jobs-held";

/// At least the bytes `job` takes in an encoded ActivateJobsResponse: its strings,
/// and for each of its 14 fields a tag, a length and at most a 10-byte varint, plus
/// the job's own tag and length.
fn encoded_size_bound(job: &gw::ActivatedJob) -> usize {
    let strings = [
        &job.r#type,
        &job.bpmn_process_id,
        &job.element_id,
        &job.custom_headers,
        &job.worker,
        &job.variables,
        &job.tenant_id,
    ];
    strings.iter().map(|s| s.len()).sum::<usize>() + 14 * 16 + 16
}

/// Rotates the first partition of successive visits, so that requests spread over
/// partitions instead of all draining partition 1 first.
#[derive(Debug, Default)]
pub struct RoundRobin(AtomicU32);

impl RoundRobin {
    /// Partitions `1..=count`, each once, starting one further than the last call.
    pub fn order(&self, count: u32) -> impl Iterator<Item = PartitionId> {
        self.order_from(None, count)
    }

    /// As [`RoundRobin::order`], but `first` (where it is one of them) comes first.
    pub fn order_from(
        &self,
        first: Option<PartitionId>,
        count: u32,
    ) -> impl Iterator<Item = PartitionId> {
        let start = self.0.fetch_add(1, Ordering::Relaxed);
        // `% count` before adding, so the counter wrapping around never repeats one.
        let rotated = start.checked_rem(count).unwrap_or(0);
        let first = first.filter(|p| (1..=count).contains(&p.0));
        first.into_iter().chain(
            (0..count)
                .map(move |i| PartitionId((rotated + i) % count + 1))
                .filter(move |p| Some(*p) != first),
        )
    }
}

/// Draws the ids that make a create, an activation, a fail or a thrown error
/// happen once however often it is sent ([`Command::Once`]): a random prefix per
/// gateway process, then a counter.
#[derive(Debug)]
pub struct RequestIds {
    prefix: u64,
    next: AtomicU64,
}

impl RequestIds {
    pub fn new() -> RequestIds {
        use std::hash::{BuildHasher, Hasher};
        // The standard library keys each `RandomState` with random bits from the
        // OS; the time and the process id are hashed in for good measure.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        h.write_u128(now);
        h.write_u32(std::process::id());
        RequestIds {
            prefix: h.finish(),
            next: AtomicU64::new(0),
        }
    }

    /// An id no other call of any gateway draws.
    pub fn next(&self) -> RequestId {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        RequestId(u128::from(self.prefix) << 64 | u128::from(n))
    }
}

impl Default for RequestIds {
    fn default() -> Self {
        RequestIds::new()
    }
}

/// The gateway's shutdown phases, as the services see them.
pub struct Phases {
    /// Cancelled first: no more clients are served.
    pub clients: CancellationToken,
    /// The tasks requests leave behind, waited for after `clients`.
    pub requests: TaskTracker,
    /// Cancelled last: the gateway's own tasks and streams stop.
    pub stop: CancellationToken,
}

/// What both services share.
pub struct Shared {
    topology: Arc<Topology>,
    router: Router,
    queue: Arc<LongPollQueue>,
    streams: Arc<AggregatedStreams>,
    default_long_poll: Duration,
    default_request_timeout: Duration,
    /// Without push, StreamActivatedJobs answers UNIMPLEMENTED, as a gateway
    /// without job push would.
    push_enabled: bool,
    activate_start: RoundRobin,
    create_start: RoundRobin,
    request_ids: RequestIds,
    /// Cancelled when the gateway stops serving clients.
    clients: CancellationToken,
    /// What requests leave behind: polls that outlive a departed client, and
    /// give-backs. The gateway waits for them (a while) before it stops.
    requests: TaskTracker,
    /// Places for job streams and parked polls.
    admission: Arc<Admission>,
    /// When a job stream is ended for its client to reopen (jittered); `None`: never.
    stream_max_age: Option<Duration>,
    /// Streams their clients may end (`EndStream`).
    endable: Arc<lifetime::Endable>,
}

impl Shared {
    /// The state both services work on.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        topology: Arc<Topology>,
        queue: Arc<LongPollQueue>,
        streams: Arc<AggregatedStreams>,
        default_long_poll: Duration,
        default_request_timeout: Duration,
        push_enabled: bool,
        gateway_id: &str,
        phases: Phases,
        admission: Arc<Admission>,
        stream_max_age: Option<Duration>,
    ) -> Arc<Self> {
        Arc::new(Shared {
            router: Router::new(
                topology.clone(),
                gateway_id,
                phases.clients.clone(),
                phases.stop,
            ),
            topology,
            queue,
            streams,
            default_long_poll,
            default_request_timeout,
            push_enabled,
            activate_start: RoundRobin::default(),
            create_start: RoundRobin::default(),
            request_ids: RequestIds::new(),
            clients: phases.clients,
            requests: phases.requests,
            admission,
            stream_max_age,
            endable: Arc::default(),
        })
    }

    fn deadline<T>(&self, request: &tonic::Request<T>) -> Instant {
        request_deadline(request.metadata(), self.default_request_timeout)
    }

    /// The partition a job key lives on; a key that names no partition the cluster
    /// has names no job (NOT_FOUND, as Zeebe answers).
    fn partition_of(&self, key: JobKey) -> Result<PartitionId, GatewayError> {
        let partition = key.partition().ok_or_else(|| {
            BrokerError::NotFound(format!(
                "no job with key {key}: a job key carries its partition in its top bits, and this one names none"
            ))
        })?;
        let count = self.topology.partitions_count();
        if count > 0 && partition.0 > count {
            return Err(BrokerError::NotFound(format!(
                "no job with key {key}: partition {partition} does not exist"
            ))
            .into());
        }
        Ok(partition)
    }

    /// Runs a request about one job on the job's partition.
    async fn on_job(
        &self,
        caller: Option<&Caller>,
        key: JobKey,
        request: Request,
        deadline: Instant,
    ) -> Result<Reply, GatewayError> {
        let partition = self.partition_of(key)?;
        let tenants = caller.map(|c| c.tenants.as_slice());
        Ok(self
            .router
            .execute_in(partition, &request, tenants, deadline)
            .await?)
    }

    /// `command` carried out once however often the router sends it (see
    /// [`Command::Once`]).
    fn once(&self, command: Command) -> Command {
        Command::Once {
            request: self.request_ids.next(),
            command: Box::new(command),
        }
    }

    /// Runs a command that answers `Done` on the job's partition.
    ///
    /// A fail or a thrown error goes once only: sent again after a failover that
    /// lost the answer of an attempt that was applied, it is answered as that
    /// attempt was, instead of failing the job's next activation (or being refused
    /// as the job is no longer activated). A completion needs none: sent again, it
    /// finds the job gone, which the router takes as done.
    async fn job_command(
        &self,
        caller: Option<&Caller>,
        key: i64,
        command: Result<Command, String>,
        deadline: Instant,
    ) -> Result<(), GatewayError> {
        let command = match command.map_err(invalid)? {
            c @ (Command::Fail { .. } | Command::ThrowError { .. }) => self.once(c),
            c => c,
        };
        match self
            .on_job(caller, JobKey(key), Request::Command(command), deadline)
            .await?
        {
            Reply::Done => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    /// ActivateJobs: visit the partitions, park until a notice if nothing was found,
    /// and answer with the jobs (`None`: end the stream without a message).
    /// `gone` is cancelled when the client went away: a parked poll ends then, a visit
    /// in flight runs to its end (see [`Shared::give_back`]).
    async fn activate(
        self: &Arc<Self>,
        props: ActivationProps,
        max: u32,
        request_timeout_ms: i64,
        deadline: Instant,
        gone: &CancellationToken,
    ) -> Result<Option<gw::ActivateJobsResponse>, GatewayError> {
        let poll_end = match request_timeout_ms {
            t if t < 0 => None,
            0 => Some(instant_after(self.default_long_poll)),
            t => Some(instant_after(Duration::from_millis(t.unsigned_abs()))),
        }
        .map(|end| end.min(deadline.checked_sub(LONG_POLL_MARGIN).unwrap_or(deadline)));
        // Subscribed before the first visit: a notice during the visit is not lost.
        let mut waiter = poll_end.map(|_| self.queue.subscribe(&props.job_type, &props.tenant_ids));
        loop {
            // Nobody to answer: activate nothing.
            if gone.is_cancelled() {
                return Ok(None);
            }
            // Woken by a notice: its partition first.
            let first = waiter.as_ref().and_then(Waiter::partition_hint);
            let jobs = self.visit(&props, max, deadline, first).await?;
            if let Some(w) = waiter.as_mut() {
                w.visited();
                // A full batch may have left more: the next parked request looks.
                if u32::try_from(jobs.len()).is_ok_and(|n| n >= max) {
                    w.pass_on();
                }
            }
            if !jobs.is_empty() {
                metrics::jobs_activated(jobs.len());
                tracing::debug!(jobs = jobs.len(), "activated");
                return Ok(Some(gw::ActivateJobsResponse { jobs }));
            }
            let (Some(end), Some(w)) = (poll_end, waiter.as_mut()) else {
                return Ok(None);
            };
            // Parked, the request holds a place under the gateway's bound until
            // it is woken; at the bound it is refused at once.
            let _place = self.admission.parked_poll()?;
            // A notice that chose this waiter as the client left is passed on by
            // the waiter's drop.
            let woken = tokio::select! {
                w = w.wait(end, &self.clients) => w,
                _ = gone.cancelled() => false,
            };
            if !woken {
                return Ok(None);
            }
        }
    }

    /// The jobs of a `courier-jobs-held` claim that the cluster knows were handed
    /// to this worker: activated now, under the worker's name, of a tenant the
    /// caller may see. The others are dropped, so a claim cannot pin someone
    /// else's job (a new leader takes a claimed job as delivered).
    async fn confirmed_held(
        &self,
        caller: Option<&Caller>,
        props: &ActivationProps,
        declared: Vec<(JobKey, i64)>,
    ) -> Vec<(JobKey, i64)> {
        if declared.is_empty() {
            return declared;
        }
        let deadline = instant_after(HELD_CHECK_BUDGET);
        let checks = declared.into_iter().map(|(key, deadline_ms)| async move {
            let view = self
                .on_job(caller, key, Request::GetJob { key }, deadline)
                .await;
            let confirmed = matches!(
                view,
                Ok(Reply::Job(v)) if v.state == JobStateKind::Activated
                    && v.worker == props.worker
                    && props.tenant_ids.contains(&v.tenant_id)
            );
            if !confirmed {
                tracing::debug!(
                    job_key = key.0,
                    "a declared held job is not this worker's; not counted"
                );
            }
            confirmed.then_some((key, deadline_ms))
        });
        futures::future::join_all(checks)
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    /// Jobs activated for an ActivateJobs call that its answer does not carry (the
    /// client went away first, or the answer was full; `why` says which): each is
    /// failed back with its retries unchanged and no back-off, so
    /// it is runnable again at once (pushed to a stream, or there for the next poll)
    /// instead of waiting out its activation timeout. As Zeebe's gateway does.
    async fn give_back(&self, jobs: Vec<gw::ActivatedJob>, why: &'static str) {
        let deadline = instant_after(GIVE_BACK_BUDGET);
        let fails = jobs.into_iter().map(|job| async move {
            let command = Command::Fail {
                key: JobKey(job.key),
                retries: job.retries,
                error_message: why.into(),
                retry_backoff_ms: 0,
                variables: None,
            };
            match self.job_command(None, job.key, Ok(command), deadline).await {
                Ok(()) => metrics::activations_given_back(1),
                // Its timeout recovers it.
                Err(e) => tracing::info!(job = job.key, error = %e, "could not give back a job"),
            }
        });
        // Stopping: what is left recovers by its activation timeout.
        tokio::select! {
            _ = futures::future::join_all(fails) => {}
            _ = self.clients.cancelled() => {}
        }
    }

    /// One pass over the partitions, from `first` or else a rotating start, until
    /// `max` jobs, until `first` gave some, or until the answer is full
    /// ([`MAX_ACTIVATE_RESPONSE_BYTES`]): each partition activates only what fits in
    /// the room left.
    async fn visit(
        self: &Arc<Self>,
        props: &ActivationProps,
        max: u32,
        deadline: Instant,
        first: Option<PartitionId>,
    ) -> Result<Vec<gw::ActivatedJob>, GatewayError> {
        let mut jobs: Vec<gw::ActivatedJob> = Vec::new();
        let mut bytes = 0usize;
        let mut over: Vec<gw::ActivatedJob> = Vec::new();
        let count = self.topology.partitions_count();
        for partition in self.activate_start.order_from(first, count) {
            let remaining = max.saturating_sub(u32::try_from(jobs.len()).unwrap_or(u32::MAX));
            let room = MAX_ACTIVATE_RESPONSE_BYTES.saturating_sub(bytes);
            if remaining == 0
                || !over.is_empty()
                || room < MIN_ACTIVATE_ROOM
                || Instant::now() >= deadline
            {
                break;
            }
            // Once only: sent again after a failover lost the answer of an attempt
            // that was applied, it gets that attempt's jobs, which would otherwise
            // sit out their activation timeout.
            let request = Request::Command(self.once(Command::ActivateWithin {
                props: props.clone(),
                max_jobs: remaining,
                max_bytes: room as u64,
            }));
            // An Activate on its way is waited for past the client's deadline: if it
            // activates jobs after the client gave up, they are given back (see
            // `activate_jobs`) rather than left to their timeout.
            let visit_end = deadline.max(instant_after(ACTIVATE_SETTLE));
            let retry_until = instant_after(VISIT_RETRY_BUDGET).min(deadline);
            match self
                .router
                .execute_until(partition, &request, retry_until, visit_end)
                .await
            {
                Ok(Reply::Activated(batch)) => {
                    for job in batch.into_iter().map(gw::ActivatedJob::from) {
                        let size = encoded_size_bound(&job);
                        // The first job goes whatever its size: alone, it fits in as
                        // much as any answer could.
                        if !jobs.is_empty() && bytes + size > MAX_ACTIVATE_RESPONSE_BYTES {
                            over.push(job);
                        } else {
                            bytes += size;
                            jobs.push(job);
                        }
                    }
                    // Woken for jobs there and given some: answer now rather than
                    // after visiting the rest. Their jobs have notices of their own,
                    // which wake the next parked request.
                    if first == Some(partition) && !jobs.is_empty() {
                        break;
                    }
                }
                Ok(other) => {
                    tracing::warn!(%partition, reply = reply_kind(&other), "unexpected reply to Activate")
                }
                Err(f)
                    if matches!(
                        f.error,
                        BrokerError::Unavailable(_)
                            | BrokerError::NoMajority(_)
                            | BrokerError::ResourceExhausted(_)
                    ) =>
                {
                    // Counted in the retry metric; at info level this would log every poll.
                    tracing::debug!(%partition, error = %f.error, "skipping unavailable partition");
                }
                // Jobs already activated elsewhere must reach the worker, or they sit
                // out their timeout: answer with them and let the next poll hit the error.
                Err(f) if !jobs.is_empty() => {
                    tracing::warn!(%partition, error = %f.error, "partition refused Activate");
                    break;
                }
                Err(f) => return Err(f.error.into()),
            }
        }
        if !over.is_empty() {
            tracing::debug!(jobs = over.len(), "answer full; giving the rest back");
            let me = self.clone();
            self.requests
                .spawn(async move { me.give_back(over, ANSWER_FULL_MESSAGE).await });
        }
        Ok(jobs)
    }

    /// Creates `jobs` in one command on one partition, chosen round-robin. A partition
    /// without a reachable leader is passed over only while the command certainly was
    /// not applied there. One sent again to a partition where it may have been
    /// applied (its answer lost in a failover) carries the same request id, and the
    /// partition answers with the jobs of the first time ([`Command::Once`]): a job
    /// is never created twice.
    async fn create(
        &self,
        jobs: Vec<NewJob>,
        deadline: Instant,
    ) -> Result<(Vec<JobKey>, PartitionId), GatewayError> {
        let count = self.topology.wait_for_partitions(deadline).await;
        if count == 0 {
            return Err(BrokerError::Unavailable(
                "the cluster's partitions are not known yet: no broker has answered".into(),
            )
            .into());
        }
        let request = Request::Command(self.once(Command::Create(jobs)));
        // Round-robin over the partitions that can commit now, then the others.
        let order = self.topology.healthy_first(self.create_start.order(count));
        let mut last = None;
        // Partitions in a row whose leader refused for want of a majority: when all
        // did, no partition can take the job now, and going round again would only
        // ask them again at once.
        let mut without_majority = 0;
        for &partition in order.iter().cycle() {
            if Instant::now() >= deadline || without_majority == order.len() {
                break;
            }
            let retry_until = instant_after(CREATE_HOP_AFTER).min(deadline);
            match self
                .router
                .execute_until(partition, &request, retry_until, deadline)
                .await
            {
                Ok(Reply::Created(keys)) => return Ok((keys, partition)),
                Ok(other) => return Err(unexpected(&other)),
                Err(f) if f.not_applied => {
                    tracing::debug!(%partition, error = %f.error, "trying the next partition");
                    if matches!(f.error, BrokerError::NoMajority(_)) {
                        without_majority += 1;
                    } else {
                        without_majority = 0;
                    }
                    last = Some(f.error);
                }
                // Of unknown outcome when it may have reached a leader (the router's
                // `unsettled`): never UNAVAILABLE, which clients resend on their own.
                Err(f) => return Err(f.error.into()),
            }
        }
        Err(last
            .unwrap_or_else(|| BrokerError::Unavailable("request deadline passed".into()))
            .into())
    }
}

/// The credit a StreamActivatedJobs request states in [`MAX_JOBS_ACTIVE_HEADER`], if
/// present and within `1..=MAX_CLIENT_CREDIT`; otherwise the gateway's default applies.
fn stated_credit(metadata: &tonic::metadata::MetadataMap) -> Option<u32> {
    let value = metadata.get(MAX_JOBS_ACTIVE_HEADER)?;
    let credit = value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<u32>().ok())
        .filter(|n| (1..=MAX_CLIENT_CREDIT).contains(n));
    if credit.is_none() {
        tracing::debug!(
            ?value,
            "ignoring an invalid {MAX_JOBS_ACTIVE_HEADER} header"
        );
    }
    credit
}

/// A client's text as a log field: at most its first 128 bytes (a type or worker
/// name of megabytes is refused, but its span is made before that).
fn loggable(text: &str) -> &str {
    let mut end = text.len().min(128);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The jobs a StreamActivatedJobs request says its client holds already, from
/// [`JOBS_HELD_HEADER`]: `KEY:DEADLINE_MS` pairs separated by commas, at most
/// [`MAX_CLIENT_CREDIT`] of them. Entries that do not parse are skipped (logged):
/// the header only spares the worker jobs it has no room for.
fn declared_held(metadata: &tonic::metadata::MetadataMap) -> Vec<(JobKey, i64)> {
    let Some(value) = metadata.get(JOBS_HELD_HEADER) else {
        return Vec::new();
    };
    let Ok(text) = value.to_str() else {
        tracing::debug!(
            ?value,
            "ignoring a {JOBS_HELD_HEADER} header that is not text"
        );
        return Vec::new();
    };
    let mut held = Vec::new();
    let mut skipped = 0usize;
    for entry in text.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let parsed = entry.split_once(':').and_then(|(k, d)| {
            Some((
                JobKey(k.trim().parse::<i64>().ok()?),
                d.trim().parse::<i64>().ok()?,
            ))
        });
        match parsed {
            Some(pair) if held.len() < MAX_CLIENT_CREDIT as usize => held.push(pair),
            Some(_) => {}
            None => skipped += 1,
        }
    }
    if skipped > 0 {
        tracing::debug!(skipped, "ignoring malformed {JOBS_HELD_HEADER} entries");
    }
    held
}

/// How long an ActivateJobs call may take: its `grpc-timeout` when it states one;
/// otherwise long enough for its long poll (its `requestTimeout`, or the gateway's
/// default when 0) to run its course, and never less than the default for requests.
fn activate_timeout(
    stated: Option<Duration>,
    request_timeout_ms: i64,
    default_request: Duration,
    default_long_poll: Duration,
) -> Duration {
    if let Some(t) = stated {
        return t;
    }
    let poll = match request_timeout_ms {
        t if t < 0 => Duration::ZERO,
        0 => default_long_poll,
        t => Duration::from_millis(t.unsigned_abs()),
    };
    default_request.max(poll.saturating_add(2 * LONG_POLL_MARGIN))
}

fn invalid(message: impl Into<String>) -> GatewayError {
    GatewayError::InvalidArgument(message.into())
}

fn unexpected(reply: &Reply) -> GatewayError {
    BrokerError::Internal(format!(
        "unexpected reply from broker: {}",
        reply_kind(reply)
    ))
    .into()
}

fn reply_kind(reply: &Reply) -> &'static str {
    match reply {
        Reply::Created(_) => "Created",
        Reply::Activated(_) => "Activated",
        Reply::Done => "Done",
        Reply::Job(_) => "Job",
        Reply::Jobs { .. } => "Jobs",
        Reply::Stats(_) => "Stats",
    }
}

/// Runs one unary request: counts and times it, traces it in `span`, maps errors.
async fn unary<T>(
    method: &'static str,
    span: tracing::Span,
    work: impl Future<Output = Result<T, GatewayError>>,
) -> Result<Response<T>, Status> {
    let observer = RequestObserver::start(method);
    let result = work.instrument(span.clone()).await.map_err(Status::from);
    let code = match &result {
        Ok(_) => tonic::Code::Ok,
        Err(s) => {
            span.in_scope(
                || tracing::debug!(code = ?s.code(), message = s.message(), "request failed"),
            );
            s.code()
        }
    };
    observer.finish(code);
    result.map(Response::new)
}
