//! The client-facing gRPC services: Zeebe's `gateway_protocol.Gateway` for workers and
//! Courier's `courier.v1.Jobs` for producers. Both are thin: convert and validate the
//! request, route it, convert the reply.

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
use tonic::{Response, Status};
use tracing::Instrument;

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
/// Most bytes of jobs one ActivateJobs answer carries: the 4 MiB that Zeebe's gateway
/// allows and that gRPC clients accept by default (Java, Go, Node.js, tonic). Jobs
/// past it are given back, and the next poll gets them.
pub const MAX_ACTIVATE_RESPONSE_BYTES: usize = 4 * 1024 * 1024;
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
    shutdown: CancellationToken,
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
        shutdown: CancellationToken,
    ) -> Arc<Self> {
        Arc::new(Shared {
            router: Router::new(topology.clone(), gateway_id, shutdown.clone()),
            topology,
            queue,
            streams,
            default_long_poll,
            default_request_timeout,
            push_enabled,
            activate_start: RoundRobin::default(),
            create_start: RoundRobin::default(),
            request_ids: RequestIds::new(),
            shutdown,
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
            // A notice that chose this waiter as the client left is passed on by
            // the waiter's drop.
            let woken = tokio::select! {
                w = w.wait(end, &self.shutdown) => w,
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
        declared: Vec<(i64, i64)>,
    ) -> Vec<(i64, i64)> {
        if declared.is_empty() {
            return declared;
        }
        let deadline = instant_after(HELD_CHECK_BUDGET);
        let checks = declared.into_iter().map(|(key, deadline_ms)| async move {
            let key = JobKey(key);
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
            confirmed.then_some((key.0, deadline_ms))
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
            _ = self.shutdown.cancelled() => {}
        }
    }

    /// One pass over the partitions, from `first` or else a rotating start, until
    /// `max` jobs, until `first` gave some, or until the answer is full
    /// ([`MAX_ACTIVATE_RESPONSE_BYTES`]; the jobs past it are given back).
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
            if remaining == 0 || !over.is_empty() || Instant::now() >= deadline {
                break;
            }
            // Once only: sent again after a failover lost the answer of an attempt
            // that was applied, it gets that attempt's jobs, which would otherwise
            // sit out their activation timeout.
            let request = Request::Command(self.once(Command::Activate {
                props: props.clone(),
                max_jobs: remaining,
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
            tokio::spawn(async move { me.give_back(over, ANSWER_FULL_MESSAGE).await });
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
                Err(f) => return Err(maybe_created(f.error).into()),
            }
        }
        Err(last
            .unwrap_or_else(|| BrokerError::Unavailable("request deadline passed".into()))
            .into())
    }
}

/// A create that failed after it may have reached a leader: unavailable then means
/// the outcome is unknown (the leader may have appended it, and a later leader
/// commits it), so the client is told not to send it again blindly (UNAVAILABLE is
/// what clients retry on their own, which would create the job twice).
fn maybe_created(e: BrokerError) -> BrokerError {
    match e {
        BrokerError::Unavailable(m) => BrokerError::OutcomeUnknown(format!(
            "{m}; the job may have been created: look for it before creating it again"
        )),
        other => other,
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
fn declared_held(metadata: &tonic::metadata::MetadataMap) -> Vec<(i64, i64)> {
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
            Some((k.trim().parse::<i64>().ok()?, d.trim().parse::<i64>().ok()?))
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

/// The Zeebe gateway service.
#[derive(Clone)]
pub struct GatewayService(pub Arc<Shared>);

/// The stream type of ActivateJobs: at most one response, then the end.
pub type ActivateJobsStream =
    Pin<Box<dyn Stream<Item = Result<gw::ActivateJobsResponse, Status>> + Send + 'static>>;

/// The stream type of StreamActivatedJobs: pushed jobs until the client leaves or the
/// gateway shuts down.
pub type JobStream = Pin<Box<dyn Stream<Item = Result<gw::ActivatedJob, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl Gateway for GatewayService {
    type ActivateJobsStream = ActivateJobsStream;
    type StreamActivatedJobsStream = JobStream;

    async fn activate_jobs(
        &self,
        request: tonic::Request<gw::ActivateJobsRequest>,
    ) -> Result<Response<Self::ActivateJobsStream>, Status> {
        let observer = RequestObserver::start("ActivateJobs");
        let stated = stated_timeout(request.metadata());
        let caller = auth::caller(&request);
        let req = request.into_inner();
        let deadline = instant_after(activate_timeout(
            stated,
            req.request_timeout,
            self.0.default_request_timeout,
            self.0.default_long_poll,
        ));
        let span = tracing::info_span!(
            "ActivateJobs",
            job_type = %loggable(&req.r#type),
            worker = %loggable(&req.worker),
            max_jobs = req.max_jobs_to_activate,
            request_timeout = req.request_timeout,
        );
        let (mut props, max) = match convert::activate_request(&req) {
            Ok(v) => v,
            Err(m) => {
                observer.finish(tonic::Code::InvalidArgument);
                return Err(Status::invalid_argument(m));
            }
        };
        if let Err(e) = auth::worker_tenants(caller.as_deref(), &mut props, &req.tenant_ids) {
            observer.finish(tonic::Code::PermissionDenied);
            return Err(e.into());
        }
        let shared = self.0.clone();
        // The poll runs on a task of its own, so that a client going away while an
        // Activate is on its way to a broker cannot lose the jobs it activates: the
        // stream is dropped then, which cancels `gone` (ending a parked poll), and
        // an answer that finds nobody to take it is given back.
        let gone = CancellationToken::new();
        let client = gone.clone().drop_guard();
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(
            async move {
                let result = shared
                    .activate(props, max, req.request_timeout, deadline, &gone)
                    .await
                    .map_err(Status::from);
                let code = result
                    .as_ref()
                    .map_or_else(|s| s.code(), |_| tonic::Code::Ok);
                match tx.send(result) {
                    Ok(()) => observer.finish(code),
                    Err(unsent) => {
                        observer.finish(tonic::Code::Cancelled);
                        if let Ok(Some(answer)) = unsent {
                            tracing::debug!(
                                jobs = answer.jobs.len(),
                                "client gone; giving the jobs back"
                            );
                            shared.give_back(answer.jobs, GIVE_BACK_MESSAGE).await;
                        }
                    }
                }
            }
            .instrument(span),
        );
        let answer = async move {
            let _client = client;
            rx.await
                .unwrap_or_else(|_| Err(Status::internal("the long poll ended without an answer")))
        };
        let stream =
            futures::stream::once(answer).filter_map(|r| std::future::ready(r.transpose()));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn stream_activated_jobs(
        &self,
        request: tonic::Request<gw::StreamActivatedJobsRequest>,
    ) -> Result<Response<Self::StreamActivatedJobsStream>, Status> {
        let observer = RequestObserver::start("StreamActivatedJobs");
        if !self.0.push_enabled {
            observer.finish(tonic::Code::Unimplemented);
            return Err(Status::unimplemented(
                "job push is switched off on this gateway",
            ));
        }
        let mut props = match convert::stream_request(request.get_ref()) {
            Ok(p) => p,
            Err(m) => {
                observer.finish(tonic::Code::InvalidArgument);
                return Err(Status::invalid_argument(m));
            }
        };
        let caller = auth::caller(&request);
        if let Err(e) =
            auth::worker_tenants(caller.as_deref(), &mut props, &request.get_ref().tenant_ids)
        {
            observer.finish(tonic::Code::PermissionDenied);
            return Err(e.into());
        }
        let (job_type, worker) = (props.job_type.clone(), props.worker.clone());
        let credit = stated_credit(request.metadata());
        let held = self
            .0
            .confirmed_held(caller.as_deref(), &props, declared_held(request.metadata()))
            .await;
        let client = self.0.streams.join_holding(props, credit, &held);
        tracing::debug!(
            stream_id = client.stream_id(),
            credit = client.credit(),
            job_type = loggable(&job_type),
            worker = loggable(&worker),
            "stream client joined"
        );
        // Tonic drops the stream when the client goes away, and with it the client
        // (see `ClientStream`); shutdown ends it cleanly, then counts it as OK.
        let end = futures::stream::once(async move {
            observer.finish(tonic::Code::Ok);
            None
        });
        let jobs = client
            .map(|job| Some(Ok(job)))
            .take_until(self.0.shutdown.clone().cancelled_owned())
            .chain(end)
            .filter_map(std::future::ready);
        Ok(Response::new(Box::pin(jobs)))
    }

    async fn complete_job(
        &self,
        request: tonic::Request<gw::CompleteJobRequest>,
    ) -> Result<Response<gw::CompleteJobResponse>, Status> {
        // Credit is released only for a hand-off before this request began.
        let since = Instant::now();
        let deadline = self.0.deadline(&request);
        let caller = auth::caller(&request);
        let r = request.into_inner();
        let span = tracing::info_span!("CompleteJob", job_key = r.job_key);
        unary("CompleteJob", span, async {
            // A request that is not valid finishes nothing: the worker still holds
            // the job. A valid one means the worker is done with it: its credit
            // comes back now, so the next job is on its way while this one commits.
            let command = convert::complete_request(&r).map_err(invalid)?;
            let _finishing = self.0.streams.finished_here(r.job_key, since);
            self.0
                .job_command(caller.as_deref(), r.job_key, Ok(command), deadline)
                .await?;
            Ok(gw::CompleteJobResponse {})
        })
        .await
    }

    async fn fail_job(
        &self,
        request: tonic::Request<gw::FailJobRequest>,
    ) -> Result<Response<gw::FailJobResponse>, Status> {
        // Credit is released only for a hand-off before this request began.
        let since = Instant::now();
        let deadline = self.0.deadline(&request);
        let caller = auth::caller(&request);
        let r = request.into_inner();
        let span = tracing::info_span!("FailJob", job_key = r.job_key, retries = r.retries);
        unary("FailJob", span, async {
            // A request that is not valid finishes nothing: the worker still holds
            // the job. A valid one means the worker is done with it: its credit
            // comes back now, so the next job is on its way while this one commits.
            let command = convert::fail_request(&r).map_err(invalid)?;
            let _finishing = self.0.streams.finished_here(r.job_key, since);
            self.0
                .job_command(caller.as_deref(), r.job_key, Ok(command), deadline)
                .await?;
            Ok(gw::FailJobResponse {})
        })
        .await
    }

    async fn throw_error(
        &self,
        request: tonic::Request<gw::ThrowErrorRequest>,
    ) -> Result<Response<gw::ThrowErrorResponse>, Status> {
        // Credit is released only for a hand-off before this request began.
        let since = Instant::now();
        let deadline = self.0.deadline(&request);
        let caller = auth::caller(&request);
        let r = request.into_inner();
        let span = tracing::info_span!("ThrowError", job_key = r.job_key, error_code = %loggable(&r.error_code));
        unary("ThrowError", span, async {
            // A request that is not valid finishes nothing: the worker still holds
            // the job. A valid one means the worker is done with it: its credit
            // comes back now, so the next job is on its way while this one commits.
            let command = convert::throw_error_request(&r).map_err(invalid)?;
            let _finishing = self.0.streams.finished_here(r.job_key, since);
            self.0
                .job_command(caller.as_deref(), r.job_key, Ok(command), deadline)
                .await?;
            Ok(gw::ThrowErrorResponse {})
        })
        .await
    }

    async fn update_job_retries(
        &self,
        request: tonic::Request<gw::UpdateJobRetriesRequest>,
    ) -> Result<Response<gw::UpdateJobRetriesResponse>, Status> {
        let deadline = self.0.deadline(&request);
        let caller = auth::caller(&request);
        let r = request.into_inner();
        let span =
            tracing::info_span!("UpdateJobRetries", job_key = r.job_key, retries = r.retries);
        unary("UpdateJobRetries", span, async {
            let command = convert::update_retries_request(&r);
            self.0
                .job_command(caller.as_deref(), r.job_key, command, deadline)
                .await?;
            Ok(gw::UpdateJobRetriesResponse {})
        })
        .await
    }

    async fn update_job_timeout(
        &self,
        request: tonic::Request<gw::UpdateJobTimeoutRequest>,
    ) -> Result<Response<gw::UpdateJobTimeoutResponse>, Status> {
        // Only a hand-off before this request began gets the new deadline.
        let since = Instant::now();
        let deadline = self.0.deadline(&request);
        let caller = auth::caller(&request);
        let r = request.into_inner();
        let span =
            tracing::info_span!("UpdateJobTimeout", job_key = r.job_key, timeout = r.timeout);
        unary("UpdateJobTimeout", span, async {
            let command = convert::update_timeout_request(&r);
            self.0
                .job_command(caller.as_deref(), r.job_key, command, deadline)
                .await?;
            self.0.streams.timeout_updated(r.job_key, r.timeout, since);
            Ok(gw::UpdateJobTimeoutResponse {})
        })
        .await
    }

    async fn topology(
        &self,
        _request: tonic::Request<gw::TopologyRequest>,
    ) -> Result<Response<gw::TopologyResponse>, Status> {
        let span = tracing::info_span!("Topology");
        unary("Topology", span, async {
            Ok(zeebe_topology(&self.0.topology.snapshot()))
        })
        .await
    }
}

/// The cluster as Zeebe clients expect to see it. A broker that did not answer the
/// last round is listed without partitions; one that never answered, without a
/// version. Roles are those of the last round, except that the leader the gateway
/// knows now (a broker's own word since, a hand-off, a failover) is the partition's
/// only leader: between rounds a broker that handed its partitions over, or stopped,
/// would still be listed as leading them.
pub fn zeebe_topology(view: &ClusterView) -> gw::TopologyResponse {
    use gw::partition::{PartitionBrokerHealth as Health, PartitionBrokerRole as Role};
    let brokers = view
        .members
        .iter()
        .map(|(&node, addr)| {
            let (host, port) = split_host_port(addr);
            let partitions = view
                .reports
                .get(&node)
                .into_iter()
                .flatten()
                .map(|p| {
                    let known = view.leaders.get(&p.partition).map(|l| l.node);
                    // As Zeebe's brokers do, a replica that is not leading and
                    // still takes part (standing for election, or catching up as
                    // a learner) is a follower; one shutting down is inactive.
                    let role = match (p.role.as_str(), known) {
                        (_, Some(leader)) if leader == node => Role::Leader,
                        ("leader", Some(_)) | ("follower" | "candidate" | "learner", _) => {
                            Role::Follower
                        }
                        ("leader", None) => Role::Leader,
                        _ => Role::Inactive,
                    };
                    let health = if view.healthy(p.partition) {
                        Health::Healthy
                    } else {
                        Health::Unhealthy
                    };
                    gw::Partition {
                        partition_id: to_i32(p.partition.0.into()),
                        role: role as i32,
                        health: health as i32,
                    }
                })
                .collect();
            gw::BrokerInfo {
                node_id: to_i32(node),
                host,
                port,
                partitions,
                version: view.versions.get(&node).cloned().unwrap_or_default(),
            }
        })
        .collect();
    gw::TopologyResponse {
        brokers,
        cluster_size: to_i32(view.members.len() as u64),
        partitions_count: to_i32(view.partitions_count.into()),
        replication_factor: to_i32(view.replication_factor.into()),
        gateway_version: VERSION.to_string(),
    }
}

fn to_i32(n: u64) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

/// Splits "host:port" (also "http://host:port" and "[::1]:port"); port 0 if absent.
fn split_host_port(addr: &str) -> (String, i32) {
    let rest = addr.split_once("://").map_or(addr, |(_, r)| r);
    let rest = rest.trim_end_matches('/');
    match rest.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && !port.contains(']') => (
            host.trim_start_matches('[')
                .trim_end_matches(']')
                .to_string(),
            port.parse().unwrap_or(0),
        ),
        _ => (rest.to_string(), 0),
    }
}

/// The methods of Zeebe's gateway service that Courier implements: its job API.
pub const JOB_API: [&str; 8] = [
    "ActivateJobs",
    "StreamActivatedJobs",
    "CompleteJob",
    "FailJob",
    "ThrowError",
    "UpdateJobRetries",
    "UpdateJobTimeout",
    "Topology",
];

/// Zeebe's gateway service as Courier serves it: the job API goes to the service
/// inside; every other method of Zeebe's (processes, messages, deployments, ...)
/// answers UNIMPLEMENTED with a message that says what is served instead, where
/// tonic would answer with none.
#[derive(Clone)]
pub struct JobApiOnly<S>(pub S);

impl<S: tonic::server::NamedService> tonic::server::NamedService for JobApiOnly<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> tonic::codegen::Service<tonic::codegen::http::Request<tonic::body::Body>> for JobApiOnly<S>
where
    S: tonic::codegen::Service<
        tonic::codegen::http::Request<tonic::body::Body>,
        Response = tonic::codegen::http::Response<tonic::body::Body>,
        Error = std::convert::Infallible,
    >,
{
    type Response = S::Response;
    type Error = std::convert::Infallible;
    type Future = futures::future::Either<
        S::Future,
        std::future::Ready<Result<Self::Response, std::convert::Infallible>>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: tonic::codegen::http::Request<tonic::body::Body>) -> Self::Future {
        let method = request.uri().path().rsplit('/').next().unwrap_or_default();
        if JOB_API.contains(&method) {
            return futures::future::Either::Left(self.0.call(request));
        }
        let status = Status::unimplemented(format!(
            "{method} is not served: Courier's gateway speaks the job API of Zeebe's \
             gateway protocol ({}); jobs are created through courier.v1.Jobs (CreateJob)",
            JOB_API.join(", ")
        ));
        futures::future::Either::Right(std::future::ready(Ok(status.into_http())))
    }
}

/// Courier's producer service.
#[derive(Clone)]
pub struct JobsService(pub Arc<Shared>);

#[tonic::async_trait]
impl Jobs for JobsService {
    async fn create_job(
        &self,
        request: tonic::Request<v1::CreateJobRequest>,
    ) -> Result<Response<v1::CreateJobResponse>, Status> {
        let deadline = self.0.deadline(&request);
        let caller = auth::caller(&request);
        let r = request.into_inner();
        let span = tracing::info_span!("CreateJob", job_type = %loggable(&r.r#type));
        unary("CreateJob", span, async {
            let mut job = convert::create_request(&r).map_err(invalid)?;
            auth::own_tenant(caller.as_deref(), &mut job, r.tenant_id.is_empty())?;
            let (keys, partition) = self.0.create(vec![job], deadline).await?;
            let key = keys.first().ok_or_else(|| {
                GatewayError::from(BrokerError::Internal("broker created no job".into()))
            })?;
            tracing::debug!(job_key = key.0, "created");
            Ok(v1::CreateJobResponse {
                key: key.0,
                partition_id: to_i32(partition.0.into()),
            })
        })
        .await
    }

    async fn create_jobs(
        &self,
        request: tonic::Request<v1::CreateJobsRequest>,
    ) -> Result<Response<v1::CreateJobsResponse>, Status> {
        let deadline = self.0.deadline(&request);
        let caller = auth::caller(&request);
        let r = request.into_inner();
        let span = tracing::info_span!("CreateJobs", jobs = r.jobs.len());
        unary("CreateJobs", span, async {
            let mut jobs = create_batch(&r.jobs)?;
            for (job, asked) in jobs.iter_mut().zip(&r.jobs) {
                auth::own_tenant(caller.as_deref(), job, asked.tenant_id.is_empty())?;
            }
            let (keys, partition) = self.0.create(jobs, deadline).await?;
            Ok(v1::CreateJobsResponse {
                keys: keys.into_iter().map(|k| k.0).collect(),
                partition_id: to_i32(partition.0.into()),
            })
        })
        .await
    }

    async fn get_job(
        &self,
        request: tonic::Request<v1::GetJobRequest>,
    ) -> Result<Response<v1::GetJobResponse>, Status> {
        let deadline = self.0.deadline(&request);
        let caller = auth::caller(&request);
        let r = request.into_inner();
        let span = tracing::info_span!("GetJob", job_key = r.key);
        unary("GetJob", span, async {
            let key = JobKey(r.key);
            match self
                .0
                .on_job(caller.as_deref(), key, Request::GetJob { key }, deadline)
                .await?
            {
                Reply::Job(view) => Ok(v1::GetJobResponse {
                    job: Some(view.into()),
                }),
                other => Err(unexpected(&other)),
            }
        })
        .await
    }

    async fn cancel_job(
        &self,
        request: tonic::Request<v1::CancelJobRequest>,
    ) -> Result<Response<v1::CancelJobResponse>, Status> {
        let deadline = self.0.deadline(&request);
        let caller = auth::caller(&request);
        let r = request.into_inner();
        let span = tracing::info_span!("CancelJob", job_key = r.key);
        unary("CancelJob", span, async {
            let command = Command::Cancel { key: JobKey(r.key) };
            self.0
                .job_command(caller.as_deref(), r.key, Ok(command), deadline)
                .await?;
            Ok(v1::CancelJobResponse {})
        })
        .await
    }
}

/// Validates a CreateJobs batch; errors name the offending entry.
fn create_batch(jobs: &[v1::CreateJobRequest]) -> Result<Vec<NewJob>, GatewayError> {
    if jobs.is_empty() {
        return Err(invalid("jobs must not be empty"));
    }
    if jobs.len() > MAX_BATCH {
        return Err(invalid(format!(
            "jobs has {} entries, more than the limit of {MAX_BATCH}",
            jobs.len()
        )));
    }
    jobs.iter()
        .enumerate()
        .map(|(i, j)| convert::create_request(j).map_err(|e| invalid(format!("jobs[{i}]: {e}"))))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::topology::{Leader, PartitionReport};

    /// A create whose attempt may have reached a leader and then went unanswered is
    /// reported as of unknown outcome (DEADLINE_EXCEEDED, which clients do not
    /// resend on their own), never as UNAVAILABLE; other answers stay as they are.
    #[test]
    fn a_create_that_may_have_reached_a_leader_fails_with_an_unknown_outcome() {
        let status: tonic::Status =
            maybe_created(BrokerError::Unavailable("broker 3 timed out".into())).into();
        assert_eq!(status.code(), tonic::Code::DeadlineExceeded);
        assert!(
            status.message().contains("broker 3 timed out")
                && status.message().contains("may have been created"),
            "{}",
            status.message()
        );
        let refused: tonic::Status =
            maybe_created(BrokerError::InvalidArgument("bad variables".into())).into();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    }

    /// Create ids differ between calls and between gateways (and a gateway's
    /// restart), so no two creates are taken for one.
    #[test]
    fn create_ids_are_never_drawn_twice() {
        let (a, b) = (RequestIds::new(), RequestIds::new());
        let ids: std::collections::BTreeSet<RequestId> =
            (0..1000).flat_map(|_| [a.next(), b.next()]).collect();
        assert_eq!(ids.len(), 2000);
        assert_ne!(a.prefix, b.prefix);
    }

    #[test]
    fn the_size_bound_of_a_job_is_never_below_its_encoded_size() {
        use prost::Message;
        let long = |n: usize| "v".repeat(n);
        let jobs = [
            gw::ActivatedJob::default(),
            gw::ActivatedJob {
                key: i64::MIN,
                r#type: long(300),
                process_instance_key: -1,
                bpmn_process_id: long(200),
                process_definition_version: i32::MIN,
                process_definition_key: -1,
                element_id: long(130),
                element_instance_key: i64::MIN,
                custom_headers: long(70_000),
                worker: long(20),
                retries: -1,
                deadline: i64::MAX,
                variables: long(4 * 1024 * 1024),
                tenant_id: long(31),
            },
        ];
        for job in jobs {
            let answer = gw::ActivateJobsResponse {
                jobs: vec![job.clone()],
            };
            assert!(encoded_size_bound(&job) >= answer.encoded_len());
        }
    }

    fn visit(rr: &RoundRobin, count: u32) -> Vec<u32> {
        rr.order(count).map(|p| p.0).collect()
    }

    #[test]
    fn each_visit_starts_one_partition_further() {
        let rr = RoundRobin::default();
        assert_eq!(visit(&rr, 3), vec![1, 2, 3]);
        assert_eq!(visit(&rr, 3), vec![2, 3, 1]);
        assert_eq!(visit(&rr, 3), vec![3, 1, 2]);
        assert_eq!(visit(&rr, 3), vec![1, 2, 3]);
        assert_eq!(visit(&rr, 0), Vec::<u32>::new());
        assert_eq!(visit(&rr, 1), vec![1]);
    }

    #[test]
    fn a_wrapping_counter_still_visits_every_partition_once() {
        let rr = RoundRobin(AtomicU32::new(u32::MAX - 1));
        for _ in 0..4 {
            let mut v = visit(&rr, 3);
            v.sort();
            assert_eq!(v, vec![1, 2, 3]);
        }
    }

    #[test]
    fn the_partition_a_notice_came_from_is_visited_first() {
        let rr = RoundRobin::default();
        let from = |p: Option<u32>, count| -> Vec<u32> {
            rr.order_from(p.map(PartitionId), count)
                .map(|p| p.0)
                .collect()
        };
        assert_eq!(from(Some(2), 3), vec![2, 1, 3]);
        assert_eq!(from(Some(2), 3), vec![2, 3, 1]);
        assert_eq!(from(Some(3), 3), vec![3, 1, 2]);
        // One the cluster does not have (a stale notice) is no hint.
        assert_eq!(from(Some(4), 3), vec![1, 2, 3]);
        assert_eq!(from(Some(0), 3), vec![2, 3, 1]);
        assert_eq!(from(None, 3), vec![3, 1, 2]);
        assert_eq!(from(Some(1), 0), Vec::<u32>::new());
    }

    #[test]
    fn batches_are_bounded_and_errors_name_the_entry() {
        let ok = v1::CreateJobRequest {
            r#type: "t".into(),
            ..Default::default()
        };
        let e = create_batch(&[]).unwrap_err().to_string();
        assert!(e.contains("jobs must not be empty"), "{e}");
        let e = create_batch(&vec![ok.clone(); MAX_BATCH + 1])
            .unwrap_err()
            .to_string();
        assert!(e.contains("10000"), "{e}");
        assert_eq!(
            create_batch(&vec![ok.clone(); MAX_BATCH]).unwrap().len(),
            MAX_BATCH
        );
        let bad = v1::CreateJobRequest {
            r#type: "t".into(),
            variables: "[]".into(),
            ..Default::default()
        };
        let e = create_batch(&[ok, bad]).unwrap_err();
        assert!(matches!(e, GatewayError::InvalidArgument(_)));
        assert!(e.to_string().starts_with("jobs[1]: variables"), "{e}");
    }

    #[test]
    fn a_long_poll_without_a_grpc_timeout_runs_its_request_timeout() {
        let (s, ms) = (Duration::from_secs(1), Duration::from_millis(1));
        let (request, poll) = (15 * s, 10 * s);
        // A stated deadline bounds it whatever the request timeout.
        assert_eq!(activate_timeout(Some(3 * s), 60_000, request, poll), 3 * s);
        // Without one: the long poll's own length, with room to answer.
        assert_eq!(
            activate_timeout(None, 60_000, request, poll),
            60 * s + 200 * ms
        );
        assert_eq!(
            activate_timeout(None, 0, request, 20 * s),
            20 * s + 200 * ms
        );
        // Never less than any request gets.
        assert_eq!(activate_timeout(None, 0, request, poll), request);
        assert_eq!(activate_timeout(None, -1, request, poll), request);
        assert_eq!(activate_timeout(None, 500, request, poll), request);
    }

    #[test]
    fn declared_held_jobs_are_read_and_bad_entries_skipped() {
        let mut md = tonic::metadata::MetadataMap::new();
        assert!(declared_held(&md).is_empty());
        md.insert(
            JOBS_HELD_HEADER,
            " 11:1700000000000, x:1,12:1700000000001,13,14:-5,,"
                .parse()
                .unwrap(),
        );
        assert_eq!(
            declared_held(&md),
            [(11, 1_700_000_000_000), (12, 1_700_000_000_001), (14, -5)]
        );
        let many: Vec<String> = (0..MAX_CLIENT_CREDIT as i64 + 5)
            .map(|k| format!("{k}:1"))
            .collect();
        md.insert(JOBS_HELD_HEADER, many.join(",").parse().unwrap());
        assert_eq!(declared_held(&md).len(), MAX_CLIENT_CREDIT as usize);
    }

    #[test]
    fn a_valid_max_jobs_active_header_states_the_credit() {
        let stated = |v: &str| {
            let mut md = tonic::metadata::MetadataMap::new();
            md.insert(MAX_JOBS_ACTIVE_HEADER, v.parse().unwrap());
            stated_credit(&md)
        };
        assert_eq!(stated("5"), Some(5));
        assert_eq!(stated(" 10000 "), Some(10_000));
        assert_eq!(stated("1"), Some(1));
        for bad in ["0", "10001", "-3", "many", ""] {
            assert_eq!(stated(bad), None, "{bad:?}");
        }
        assert_eq!(stated_credit(&tonic::metadata::MetadataMap::new()), None);
    }

    #[test]
    fn host_and_port_are_split_from_addresses() {
        assert_eq!(
            split_host_port("broker-1:26501"),
            ("broker-1".into(), 26501)
        );
        assert_eq!(split_host_port("http://10.0.0.2:9"), ("10.0.0.2".into(), 9));
        assert_eq!(split_host_port("[::1]:26501"), ("::1".into(), 26501));
        assert_eq!(split_host_port("broker-1"), ("broker-1".into(), 0));
    }

    #[test]
    fn zeebe_topology_lists_every_member_with_roles_and_health() {
        let mut view = ClusterView {
            partitions_count: 2,
            replication_factor: 2,
            ..Default::default()
        };
        for n in 1..=3u64 {
            view.members.insert(n, format!("b{n}:2650{n}"));
        }
        let report = |p: u32, role: &str| PartitionReport {
            partition: PartitionId(p),
            role: role.into(),
            majority_lost: false,
        };
        view.reports
            .insert(1, vec![report(1, "leader"), report(2, "candidate")]);
        view.reports
            .insert(2, vec![report(1, "follower"), report(2, "shutdown")]);
        view.leaders
            .insert(PartitionId(1), Leader { node: 1, term: 3 });
        view.versions.insert(1, "0.9.0".into());
        view.versions.insert(2, VERSION.into());
        // Broker 3 did not answer.
        let t = zeebe_topology(&view);
        assert_eq!(t.cluster_size, 3);
        assert_eq!(t.partitions_count, 2);
        assert_eq!(t.replication_factor, 2);
        assert_eq!(t.gateway_version, VERSION);
        assert_eq!(t.brokers.len(), 3);
        let b1 = &t.brokers[0];
        assert_eq!((b1.node_id, b1.host.as_str(), b1.port), (1, "b1", 26501));
        use gw::partition::{PartitionBrokerHealth as H, PartitionBrokerRole as R};
        let parts: Vec<(i32, i32, i32)> = b1
            .partitions
            .iter()
            .map(|p| (p.partition_id, p.role, p.health))
            .collect();
        assert_eq!(
            parts,
            vec![
                (1, R::Leader as i32, H::Healthy as i32),
                (2, R::Follower as i32, H::Unhealthy as i32)
            ]
        );
        assert_eq!(t.brokers[1].partitions[0].role, R::Follower as i32);
        assert_eq!(t.brokers[1].partitions[1].role, R::Inactive as i32);
        assert!(t.brokers[2].partitions.is_empty());
        // Each broker's own version, as it reported it.
        let versions: Vec<&str> = t.brokers.iter().map(|b| b.version.as_str()).collect();
        assert_eq!(versions, ["0.9.0", VERSION, ""]);
        // A leader that lost its majority still leads, but its partition is unhealthy
        // on every broker that reports it.
        view.reports.get_mut(&1).unwrap()[0].majority_lost = true;
        let t = zeebe_topology(&view);
        assert_eq!(
            (
                t.brokers[0].partitions[0].role,
                t.brokers[0].partitions[0].health
            ),
            (R::Leader as i32, H::Unhealthy as i32)
        );
        assert_eq!(t.brokers[1].partitions[0].health, H::Unhealthy as i32);
        // Broker 1 handed partition 1 to broker 2, which said so before the next
        // round: broker 2 is its leader, broker 1 a follower.
        view.reports.get_mut(&1).unwrap()[0].majority_lost = false;
        view.leaders
            .insert(PartitionId(1), Leader { node: 2, term: 4 });
        let t = zeebe_topology(&view);
        let roles: Vec<i32> = t.brokers[..2]
            .iter()
            .map(|b| b.partitions[0].role)
            .collect();
        assert_eq!(roles, [R::Follower as i32, R::Leader as i32]);
    }
}
