//! [`JobWorker`]: runs a handler for every job of a type, with jobs pushed on a
//! stream first and polled as a fallback, never holding more than its max jobs
//! active, and shutting down without losing a job.
//!
//! # How jobs arrive
//! - **Push.** The worker keeps one `StreamActivatedJobs` stream open, stating its
//!   capacity in the `courier-max-jobs-active` header, and the jobs it holds
//!   already (opened again while handlers run) in `courier-jobs-held`, which the
//!   gateway counts against that capacity. When the stream fails (a
//!   gateway restart, the network, `UNIMPLEMENTED` from a gateway without push) it
//!   is reopened after a jittered back-off (50 ms doubling to 5 s), forever.
//! - **Poll.** Beside it, whenever the worker has free room, it polls `ActivateJobs`
//!   for at most that many jobs, so nothing waits on a backlog push does not cover
//!   (jobs yielded while the worker was full, for instance). While the stream is
//!   healthy the poll waits first, a jittered delay that climbs from 50 ms to 5 s
//!   while polls come back empty; that wait is also push's head start on freed
//!   room. Such a poll answers at once rather than parking on the gateway, so that
//!   its ask is never stale: a parked poll woken long after it was sent could bring
//!   back room's worth of jobs the stream has meanwhile filled. While the stream is
//!   down the poll long-polls back to back. Polling never stops for good: errors
//!   only pace it.
//!
//! # Never more than max jobs active
//! A semaphore of max-jobs-active permits counts the jobs running, from receipt
//! until the outcome is sent (the gateway frees the stream's credit when it
//! arrives), whichever path they came by. A job that arrives when no permit is free
//! (push and poll raced for the same room, or the gateway does not count the jobs
//! a reopened stream declares) waits for the next
//! free permit, up to [`WAIT_FOR_ROOM`] and never past its activation deadline
//! (less a margin); at most max-jobs-active jobs wait. One that still finds no room
//! is given back with `UpdateJobTimeout(key, 1 ms)`. It times out on the broker and
//! is runnable again right away, with no retry used and no error recorded, unlike a
//! `FailJob`, and it is counted in
//! [`WorkerMetricsSnapshot::given_back_no_capacity`].
//!
//! Giving such a job back at once would make a loop: the gateway, which counts
//! only the jobs it pushed on this stream, still sees room, so the broker pushes
//! the job straight back, as fast as its log commits, for as long as the handlers
//! that fill the worker run. Waiting breaks it: the waiting job holds the credit
//! the gateway counts, so nothing more is pushed until a handler finishes.
//!
//! # Shutdown
//! [`JobWorker::shutdown`] stops taking jobs (drops the stream, abandons a poll in
//! flight), lets running handlers finish within the grace period (10 s by
//! default), then drops the handlers still running and gives their jobs back the
//! same way, so another worker can take them at once. Failing them instead would
//! cost each a retry (and make an incident of a job on its last one) and record an
//! error the job did nothing to earn; merely leaving them would delay each by up to
//! its whole activation timeout. Either way nothing is lost: a job that the
//! shutdown catches in transit (pushed or polled but not yet received) times out on
//! the broker and runs again.

mod capacity;
mod job;
mod lanes;
pub mod metrics;
mod pacing;
mod sources;

use crate::error::ClientError;
use crate::request::IntoJsonText;
use crate::Client;
use courier_proto::gateway_protocol::ActivatedJob;
use metrics::{GiveBack, JobPath};
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use metrics::{WorkerMetrics, WorkerMetricsSnapshot};

/// What became of a job, as the handler decides it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobOutcome {
    /// Complete the job, setting these variables (JSON object text; empty: none).
    Complete {
        /// The variables, as JSON text.
        variables: String,
    },
    /// Fail the job.
    Fail {
        /// Why, recorded on the job.
        message: String,
        /// Retries left after this failure; `None`: one less than the job had.
        retries: Option<i32>,
        /// How long before the job may run again.
        backoff: Duration,
    },
    /// End the job with a business error.
    ThrowError {
        /// The error code.
        code: String,
        /// The error message.
        message: String,
    },
}

impl JobOutcome {
    /// Complete the job without variables.
    pub fn complete() -> Self {
        JobOutcome::Complete {
            variables: String::new(),
        }
    }

    /// Complete the job, setting these variables (a JSON object).
    pub fn complete_with(variables: impl IntoJsonText) -> Self {
        JobOutcome::Complete {
            variables: variables.into_json_text(),
        }
    }

    /// Fail the job with one retry less than it had, to run again at once if any
    /// are left. This is what a handler's error or panic does.
    pub fn fail(message: impl Into<String>) -> Self {
        JobOutcome::Fail {
            message: message.into(),
            retries: None,
            backoff: Duration::ZERO,
        }
    }

    /// Fail the job, leaving it `retries` retries, to run again after `backoff`.
    pub fn fail_with(message: impl Into<String>, retries: i32, backoff: Duration) -> Self {
        JobOutcome::Fail {
            message: message.into(),
            retries: Some(retries),
            backoff,
        }
    }

    /// End the job with a business error.
    pub fn throw_error(code: impl Into<String>, message: impl Into<String>) -> Self {
        JobOutcome::ThrowError {
            code: code.into(),
            message: message.into(),
        }
    }
}

/// Called once the gateway has answered a job's outcome: the job's key, the
/// outcome, and whether it was recorded.
type Reported = Arc<dyn Fn(i64, &JobOutcome, Result<(), &ClientError>) + Send + Sync>;

/// The handler with its error type erased to its message.
type HandlerFuture = Pin<Box<dyn Future<Output = Result<JobOutcome, String>> + Send>>;
type Handler = Arc<dyn Fn(ActivatedJob) -> HandlerFuture + Send + Sync>;

/// The default age at which the worker reopens a stream itself: past a gateway's
/// default (10 minutes), so it acts only where the gateway never ends streams.
pub const STREAM_MAX_AGE: Duration = Duration::from_secs(15 * 60);

/// The default heartbeat interval asked for on the stream: a stall is seen within
/// three of them.
pub const STREAM_HEARTBEAT: Duration = Duration::from_secs(2);

/// What the worker asks for and how it stops.
#[derive(Clone, Debug)]
struct Config {
    job_type: String,
    name: String,
    max_jobs_active: u32,
    timeout: Duration,
    fetch_variables: Vec<String>,
    tenant_ids: Vec<String>,
    streaming: bool,
    grace: Duration,
    /// Heartbeat interval asked of the gateway on the stream; `None`: none.
    heartbeat: Option<Duration>,
    /// Job streams kept at most, each on its own gateway.
    max_streams: usize,
    /// How long a stream beside others may carry nothing before it is closed.
    prune_after: Duration,
    /// Age at which the worker reopens a stream itself (less up to a fifth at
    /// random), in case its gateway never ends it.
    stream_max_age: Option<Duration>,
}

/// Builds a [`JobWorker`]: [`JobWorker::builder`], options, then
/// [`spawn`](JobWorkerBuilder::spawn).
pub struct JobWorkerBuilder {
    client: Client,
    config: Config,
    handler: Handler,
    reported: Option<Reported>,
}

impl JobWorkerBuilder {
    /// How many jobs the worker holds at most, from both paths together (default
    /// 32). It is also the stream's push credit.
    pub fn max_jobs_active(mut self, max: u32) -> Self {
        self.config.max_jobs_active = max;
        self
    }

    /// How long each activation lasts before an unfinished job runs again
    /// elsewhere (default 5 minutes): longer than the handler ever takes.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.config.timeout = timeout;
        self
    }

    /// Hand the handler only these variables (all when none is named).
    pub fn fetch_variables(mut self, names: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.config.fetch_variables = names.into_iter().map(Into::into).collect();
        self
    }

    /// Take jobs of these tenants (`<default>` when none is named).
    pub fn tenant_ids(mut self, tenants: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.config.tenant_ids = tenants.into_iter().map(Into::into).collect();
        self
    }

    /// The worker name recorded on the jobs it takes (default `default`).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.config.name = name.into();
        self
    }

    /// Whether to open a job stream (default true); without one the worker only
    /// long-polls.
    pub fn streaming(mut self, streaming: bool) -> Self {
        self.config.streaming = streaming;
        self
    }

    /// How often the gateway is asked to show an idle stream is alive (default
    /// 2 s; `None`: never). A stream that carried nothing, heartbeats included, for
    /// three intervals is taken for stalled (a proxy between that stopped
    /// forwarding) and reopened on another gateway.
    pub fn stream_heartbeat(mut self, every: Option<Duration>) -> Self {
        self.config.heartbeat = every;
        self
    }

    /// How many job streams the worker keeps at most, each on another gateway
    /// (default 4, and never more than the client's gateways or max jobs active).
    /// It opens one more while its credit stays fully used or its polls find jobs
    /// the streams were not pushed, and splits max jobs active between them.
    pub fn max_streams(mut self, max: usize) -> Self {
        self.config.max_streams = max.max(1);
        self
    }

    /// Age at which the worker reopens a stream itself, less up to a fifth at
    /// random (default 15 minutes; `None`: never), without losing a job on the
    /// way: streams move to gateways added since even where the gateway never
    /// ends them, and never outlive the proxies between.
    pub fn stream_max_age(mut self, age: Option<Duration>) -> Self {
        self.config.stream_max_age = age;
        self
    }

    /// How long a stream beside others may carry no job before it is closed
    /// (default 30 s); the last stream is always kept.
    pub fn stream_prune_after(mut self, idle: Duration) -> Self {
        self.config.prune_after = idle;
        self
    }

    /// How long a shutdown waits for running handlers before giving their jobs
    /// back (default 10 s).
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.config.grace = grace;
        self
    }

    /// Calls `reported` with each job's key and outcome once the gateway has
    /// answered the outcome: `Ok` when it was recorded, the error when it was
    /// refused (the job was gone or no longer activated) or could not be sent
    /// within the retry budget. Jobs given back are not reported.
    pub fn on_reported(
        mut self,
        reported: impl Fn(i64, &JobOutcome, Result<(), &ClientError>) + Send + Sync + 'static,
    ) -> Self {
        self.reported = Some(Arc::new(reported));
        self
    }

    /// Starts the worker on the current Tokio runtime. Refuses (`INVALID_ARGUMENT`)
    /// a blank job type or worker name, a max jobs active of 0, a timeout under
    /// 1 ms and an invalid tenant id, which the gateway would refuse on every poll;
    /// refuses (`FAILED_PRECONDITION`) to start outside a Tokio runtime.
    pub fn spawn(self) -> Result<JobWorker, ClientError> {
        let c = &self.config;
        let invalid = |m: &str| Err(ClientError::Status(tonic::Status::invalid_argument(m)));
        if c.job_type.trim().is_empty() {
            return invalid("the job type must not be blank");
        }
        if c.name.trim().is_empty() {
            return invalid("the worker name must not be blank");
        }
        if c.max_jobs_active == 0 {
            return invalid("max jobs active must be at least 1");
        }
        if c.timeout < Duration::from_millis(1) {
            return invalid("the job timeout must be at least 1 ms");
        }
        if let Err(m) = courier_proto::validate::tenant_ids(&c.tenant_ids) {
            return invalid(&m);
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Err(ClientError::Status(tonic::Status::failed_precondition(
                "a worker must be started inside a Tokio runtime",
            )));
        };
        let stop = CancellationToken::new();
        let abandon = CancellationToken::new();
        let metrics = WorkerMetrics::default();
        let ctx = Arc::new(Ctx {
            once: self.client.clone().with_retry_budget(Duration::ZERO),
            give_back: self.client.clone().with_retry_budget(GIVE_BACK_BUDGET),
            client: self.client,
            capacity: capacity::Capacity::new(self.config.max_jobs_active as usize),
            waiting: std::sync::Mutex::new(VecDeque::new()),
            running: std::sync::Mutex::new(HashMap::new()),
            last_wait: AtomicU64::new(0),
            config: self.config,
            handler: self.handler,
            reported: self.reported,
            metrics: metrics.clone(),
            tracker: TaskTracker::new(),
            stop: stop.clone(),
            abandon: abandon.clone(),
        });
        let supervisor = runtime.spawn(supervise(ctx));
        Ok(JobWorker {
            metrics,
            stop,
            abandon,
            supervisor: Some(supervisor),
        })
    }
}

/// A running worker. Dropping it starts its shutdown without waiting for it; call
/// [`shutdown`](JobWorker::shutdown) to wait.
///
/// ```no_run
/// use courier_client::{Client, JobOutcome, JobWorker};
/// use serde_json::json;
/// use std::time::Duration;
///
/// # async fn example() -> Result<(), courier_client::ClientError> {
/// let client = Client::connect("127.0.0.1:26500")?;
/// let worker = JobWorker::builder(client, "email", |job| async move {
///     let vars: serde_json::Value = serde_json::from_str(&job.variables)?;
///     println!("sending mail to {}", vars["to"]);
///     // An `Err` fails the job with its message, leaving it one retry less.
///     Ok::<_, serde_json::Error>(JobOutcome::complete_with(json!({ "sent": true })))
/// })
/// .max_jobs_active(16)
/// .timeout(Duration::from_secs(60))
/// .name("mailer")
/// .spawn()?;
///
/// tokio::signal::ctrl_c().await.ok();
/// worker.shutdown().await; // lets running handlers finish, for up to 10 s
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct JobWorker {
    metrics: WorkerMetrics,
    stop: CancellationToken,
    /// Ends the grace period.
    abandon: CancellationToken,
    /// Ends when the shutdown is complete; `None` once joined.
    supervisor: Option<JoinHandle<()>>,
}

/// Stops a worker from anywhere (a signal handler, another task). Cloning is cheap.
#[derive(Clone, Debug)]
pub struct ShutdownHandle {
    stop: CancellationToken,
    abandon: CancellationToken,
}

impl ShutdownHandle {
    /// Starts the worker's shutdown; [`JobWorker::join`] waits for its end.
    pub fn shutdown(&self) {
        self.stop.cancel();
    }

    /// Starts the shutdown, or ends its grace period now: the handlers still
    /// running are dropped and their jobs given back at once (a second Ctrl-C).
    pub fn give_back_now(&self) {
        self.stop.cancel();
        self.abandon.cancel();
    }

    /// Whether the shutdown has started.
    pub fn is_shutdown(&self) -> bool {
        self.stop.is_cancelled()
    }
}

impl JobWorker {
    /// A worker for jobs of `job_type` whose outcomes `handler` decides. The handler
    /// gets each job (its variables are JSON text); its `Ok` says what to do with
    /// the job, and its `Err` or panic fails the job with the message and one retry
    /// less. Handlers run concurrently, up to max jobs active.
    pub fn builder<H, Fut, E>(
        client: Client,
        job_type: impl Into<String>,
        handler: H,
    ) -> JobWorkerBuilder
    where
        H: Fn(ActivatedJob) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<JobOutcome, E>> + Send + 'static,
        E: std::fmt::Display + 'static,
    {
        let handler: Handler = Arc::new(move |job| {
            let fut = handler(job);
            Box::pin(async move { fut.await.map_err(|e| format!("{e:#}")) })
        });
        JobWorkerBuilder {
            client,
            config: Config {
                job_type: job_type.into(),
                name: "default".into(),
                max_jobs_active: 32,
                timeout: Duration::from_secs(300),
                fetch_variables: Vec::new(),
                tenant_ids: Vec::new(),
                streaming: true,
                grace: Duration::from_secs(10),
                heartbeat: Some(STREAM_HEARTBEAT),
                max_streams: lanes::MAX_STREAMS,
                prune_after: lanes::PRUNE_AFTER,
                stream_max_age: Some(STREAM_MAX_AGE),
            },
            handler,
            reported: None,
        }
    }

    /// The worker's counters.
    pub fn metrics(&self) -> &WorkerMetrics {
        &self.metrics
    }

    /// A handle that starts this worker's shutdown.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle {
            stop: self.stop.clone(),
            abandon: self.abandon.clone(),
        }
    }

    /// Shuts down and waits until it is done: no job is taken any more, running
    /// handlers have finished or their jobs were given back after the grace period,
    /// and every outcome has been reported.
    pub async fn shutdown(self) {
        self.stop.cancel();
        self.join().await;
    }

    /// Waits until the worker has been shut down (through a [`ShutdownHandle`]) and
    /// the shutdown is done.
    pub async fn join(mut self) {
        if let Some(supervisor) = self.supervisor.take() {
            // It only ends early if a task panicked, which is a bug to report, not
            // a reason to panic the caller.
            if let Err(e) = supervisor.await {
                tracing::error!(error = %e, "worker supervisor failed");
            }
        }
    }
}

impl Drop for JobWorker {
    fn drop(&mut self) {
        // The worker's tasks stop with their owner rather than run unowned.
        self.stop.cancel();
    }
}

/// How long a give-back keeps retrying: it only spares the job its timeout, so it
/// is not worth holding a shutdown for.
const GIVE_BACK_BUDGET: Duration = Duration::from_secs(2);

/// How long a job that arrived while the worker was full waits for a free permit
/// before it is given back.
pub const WAIT_FOR_ROOM: Duration = Duration::from_secs(1);

/// A waiting job is given back this long before its activation deadline at the
/// latest, so the give-back cannot cut short a later activation of the same job.
const DEADLINE_MARGIN: Duration = Duration::from_millis(200);

/// A job that arrived while every permit was taken.
struct Waiting {
    /// Tells this wait from a later one of the same job.
    id: u64,
    job: ActivatedJob,
}

/// What the worker's tasks share.
struct Ctx {
    /// Reports outcomes, with the caller's retry budget.
    client: Client,
    /// Polls and opens the stream without retries: the loops pace themselves.
    once: Client,
    /// Gives jobs back, with a short retry budget.
    give_back: Client,
    config: Config,
    handler: Handler,
    /// Told of each outcome once it is answered.
    reported: Option<Reported>,
    capacity: capacity::Capacity,
    /// Jobs waiting for a permit, oldest first; at most max jobs active.
    waiting: std::sync::Mutex<VecDeque<Waiting>>,
    /// Key -> activation deadline (epoch ms) of each job being run, declared when
    /// the stream is reopened.
    running: std::sync::Mutex<HashMap<i64, i64>>,
    last_wait: AtomicU64,
    metrics: WorkerMetrics,
    /// Every job task (handler, report, give-back), so shutdown can wait for them.
    tracker: TaskTracker,
    /// Shutdown started: take no more jobs.
    stop: CancellationToken,
    /// The grace period is over: drop the handlers still running.
    abandon: CancellationToken,
}

impl Ctx {
    /// A job arrived: run it if there is room; if not, let it wait for room, or
    /// give it back.
    fn receive(self: &Arc<Self>, job: ActivatedJob, path: JobPath) {
        self.metrics.received(path);
        match self.capacity.try_take() {
            Some(held) => self.start(job, held),
            None => self.wait_for_room(job, path),
        }
    }

    fn start(self: &Arc<Self>, job: ActivatedJob, held: capacity::Held) {
        lock(&self.running).insert(job.key, job.deadline);
        let active = self.metrics.holding();
        self.tracker
            .spawn(job::run(Arc::clone(self), job, (held, active)));
    }

    /// Queues a job that found no free permit; it is given back if none frees in
    /// time (see [`WAIT_FOR_ROOM`]), or at once when it cannot wait.
    fn wait_for_room(self: &Arc<Self>, job: ActivatedJob, path: JobPath) {
        let key = job.key;
        let id = self.last_wait.fetch_add(1, Ordering::Relaxed) + 1;
        let wait = room_wait(time_left(job.deadline)).filter(|_| self.queue(id, job));
        let Some(wait) = wait else {
            tracing::debug!(job_key = key, ?path, "no room for the job; giving it back");
            self.tracker
                .spawn(job::give_back(Arc::clone(self), key, GiveBack::NoCapacity));
            return;
        };
        tracing::debug!(
            job_key = key,
            ?path,
            ?wait,
            "no room for the job yet; it waits"
        );
        let ctx = Arc::clone(self);
        self.tracker.spawn(async move {
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = ctx.stop.cancelled() => {}
            }
            let gone = {
                let mut q = lock(&ctx.waiting);
                q.iter().position(|w| w.id == id).and_then(|i| q.remove(i))
            };
            if gone.is_some() {
                tracing::debug!(job_key = key, "no room came for the job; giving it back");
                job::give_back(Arc::clone(&ctx), key, GiveBack::NoCapacity).await;
            }
        });
        // A permit may have come back since it was looked for.
        self.pump();
    }

    /// Puts `job` in line for a permit, unless the line is full or the worker stops.
    fn queue(&self, id: u64, job: ActivatedJob) -> bool {
        let mut q = lock(&self.waiting);
        let room = q.len() < self.capacity.max() && !self.stop.is_cancelled();
        if room {
            q.push_back(Waiting { id, job });
        }
        room
    }

    /// Starts waiting jobs while there are free permits. Called whenever a permit
    /// comes back.
    fn pump(self: &Arc<Self>) {
        loop {
            if self.stop.is_cancelled() {
                return;
            }
            let next = {
                let mut q = lock(&self.waiting);
                if q.is_empty() {
                    return;
                }
                let Some(held) = self.capacity.try_take() else {
                    return;
                };
                q.pop_front().map(|w| (w, held))
            };
            if let Some((w, held)) = next {
                self.metrics.waited_for_room();
                self.start(w.job, held);
            }
        }
    }

    /// Job `key`'s handler is done (or dropped): it is no longer run here.
    fn ran(&self, key: i64) {
        lock(&self.running).remove(&key);
    }

    /// Jobs waiting for a permit now.
    fn waiting(&self) -> usize {
        lock(&self.waiting).len()
    }

    /// (key, deadline) of every job held now, running or waiting for room: what a
    /// reopened stream declares, so its gateway does not push into room it lacks.
    fn jobs_held(&self) -> Vec<(i64, i64)> {
        let mut held: Vec<(i64, i64)> = lock(&self.running).iter().map(|(&k, &d)| (k, d)).collect();
        held.extend(
            lock(&self.waiting)
                .iter()
                .map(|w| (w.job.key, w.job.deadline)),
        );
        held
    }
}

/// Nothing panics while these locks are held; a poisoned one still holds good data.
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Time until an activation deadline given in epoch milliseconds (zero once it
/// passed; a deadline of 0 or less is taken as unknown: no limit).
fn time_left(deadline_ms: i64) -> Option<Duration> {
    if deadline_ms <= 0 {
        return None;
    }
    Some(Duration::from_millis(
        u64::try_from(deadline_ms.saturating_sub(courier_proto::domain::epoch_ms())).unwrap_or(0),
    ))
}

/// How long a job with `left` until its deadline may wait for room: `None` when it
/// must go back at once.
fn room_wait(left: Option<Duration>) -> Option<Duration> {
    match left {
        None => Some(WAIT_FOR_ROOM),
        Some(left) => left
            .checked_sub(DEADLINE_MARGIN)
            .filter(|w| !w.is_zero())
            .map(|w| w.min(WAIT_FOR_ROOM)),
    }
}

/// Runs the job sources until shutdown, then winds down: sources first, then the
/// handlers within the grace period, then whatever is left.
async fn supervise(ctx: Arc<Ctx>) {
    let initial = if ctx.config.streaming {
        sources::StreamState::Opening
    } else {
        sources::StreamState::Down
    };
    // Held here for the worker's whole life, so the poller's view never closes.
    let (state, state_rx) = tokio::sync::watch::channel(initial);
    let lanes = Arc::new(lanes::Lanes::new(state));
    let stream = ctx
        .config
        .streaming
        .then(|| tokio::spawn(lanes::run(Arc::clone(&ctx), Arc::clone(&lanes))));
    let poll = tokio::spawn(sources::poll_loop(
        Arc::clone(&ctx),
        Arc::clone(&lanes),
        state_rx,
    ));

    ctx.stop.cancelled().await;
    // Both loops watch `stop` at every await and return at once; after they have,
    // no job is taken any more.
    if let Some(stream) = stream {
        let _ = stream.await;
    }
    let _ = poll.await;
    ctx.tracker.close();
    let running = ctx.capacity.held();
    tracing::info!(
        job_type = %ctx.config.job_type,
        running,
        grace = ?ctx.config.grace,
        "worker stopping: waiting for running handlers"
    );
    let finished = tokio::select! {
        () = ctx.tracker.wait() => true,
        () = tokio::time::sleep(ctx.config.grace) => false,
        () = ctx.abandon.cancelled() => false,
    };
    if !finished {
        tracing::warn!(
            unfinished = ctx.capacity.held(),
            "grace period over: giving the unfinished jobs back"
        );
        ctx.abandon.cancel();
        ctx.tracker.wait().await;
    }
    drop(lanes);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::convert::Infallible;

    fn builder(client: &Client) -> JobWorkerBuilder {
        JobWorker::builder(client.clone(), "t", |_job| async {
            Ok::<_, Infallible>(JobOutcome::complete())
        })
    }

    /// Settings every poll would be refused for stop the worker before it starts,
    /// rather than having it retry for ever.
    #[test]
    fn a_job_waits_for_room_a_second_at_most_and_never_into_its_deadline_margin() {
        assert_eq!(room_wait(None), Some(WAIT_FOR_ROOM));
        assert_eq!(
            room_wait(Some(Duration::from_secs(60))),
            Some(WAIT_FOR_ROOM)
        );
        assert_eq!(
            room_wait(Some(Duration::from_millis(700))),
            Some(Duration::from_millis(500))
        );
        assert_eq!(room_wait(Some(DEADLINE_MARGIN)), None);
        assert_eq!(room_wait(Some(Duration::ZERO)), None);

        assert_eq!(time_left(0), None, "no deadline known");
        assert_eq!(time_left(1), Some(Duration::ZERO), "long past");
        let left = time_left(courier_proto::domain::epoch_ms() + 60_000).unwrap_or_default();
        assert!(
            left > Duration::from_secs(59) && left <= Duration::from_secs(60),
            "{left:?}"
        );
    }

    #[tokio::test]
    async fn settings_the_gateway_would_refuse_are_refused_at_spawn() {
        let client = Client::connect("127.0.0.1:1").unwrap();
        let refused = |r: Result<JobWorker, ClientError>| match r {
            Err(e) => {
                assert_eq!(e.code(), Some(tonic::Code::InvalidArgument));
                e.to_string()
            }
            Ok(_) => panic!("spawned"),
        };
        let e = refused(builder(&client).tenant_ids(["bad tenant"]).spawn());
        assert!(e.contains("tenant id 'bad tenant'"), "{e}");
        let e = refused(builder(&client).timeout(Duration::ZERO).spawn());
        assert!(e.contains("timeout"), "{e}");
        let e = refused(builder(&client).max_jobs_active(0).spawn());
        assert!(e.contains("max jobs active"), "{e}");
        let ok = builder(&client).tenant_ids(["a", "<default>"]).spawn();
        ok.unwrap().shutdown().await;
    }
}
