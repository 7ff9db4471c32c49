//! The two ways jobs reach the worker: the stream, kept open, and the poll beside
//! it. Both hand what they get to [`Ctx::receive`], which holds a job only with a
//! free permit.

use super::lanes::{Lane, Lanes};
use super::metrics::JobPath;
use super::pacing::{Ramp, PACE};
use super::Ctx;
use crate::client::OpenStream;
use crate::request::{ActivateJobs, StreamJobs};
use courier_proto::gateway_protocol::ActivatedJob;
use courier_proto::headers::{
    HEARTBEAT_KEY, STREAM_END_HEADER, STREAM_END_MAX_AGE, STREAM_END_SHUTDOWN,
};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;
use tonic::Code;

/// The stream's health, as the poller needs to know it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum StreamState {
    /// The first stream is being opened: treated as healthy, so the poller does not
    /// grab at once the backlog the new stream is about to be pushed.
    Opening,
    /// Open: push delivers.
    Open,
    /// Failed, being reopened, or switched off: the poller long-polls.
    Down,
}

/// An empty long poll that came back sooner than this was not held by the gateway
/// (it answers at once): the poller paces itself instead of spinning.
const LONG_POLL_FLOOR: Duration = Duration::from_secs(1);

/// How a stream ended.
enum Ended {
    /// The worker moved credit to or from it: reopen at once where it was.
    Resized,
    /// The gateway ended it on purpose (its maximum age, or its shutdown): reopen at
    /// once, without back-off.
    Moved {
        leaving: bool,
    },
    /// Nothing, not even a heartbeat, came for three heartbeat intervals: a proxy
    /// between may have stopped forwarding while keeping the connection up.
    Stalled(Duration),
    /// The gateway closed it without saying why.
    Closed,
    Broke(tonic::Status),
}

impl Ended {
    fn of(status: tonic::Status) -> Ended {
        match status
            .metadata()
            .get(STREAM_END_HEADER)
            .and_then(|v| v.to_str().ok())
        {
            Some(STREAM_END_MAX_AGE) => Ended::Moved { leaving: false },
            Some(STREAM_END_SHUTDOWN) => Ended::Moved { leaving: true },
            _ => Ended::Broke(status),
        }
    }
}

/// Heartbeat intervals without a message after which a stream counts as stalled.
const STALL_AFTER_BEATS: u32 = 3;

/// Keeps one of the worker's job streams open until it is closed or the worker
/// stops, reopening it with jittered back-off; at once when the gateway ended it on
/// purpose or its credit changed, or when it stalled (then on another gateway).
pub(super) async fn stream_loop(ctx: Arc<Ctx>, lanes: Arc<Lanes>, lane: Arc<Lane>) {
    let c = &ctx.config;
    let mut request = StreamJobs::new(&c.job_type)
        .worker(&c.name)
        .timeout(c.timeout)
        .fetch_variables(c.fetch_variables.clone())
        .tenant_ids(c.tenant_ids.clone())
        .reopens();
    if let Some(every) = c.heartbeat {
        request = request.heartbeat(every);
    }
    let mut ramp = Ramp::default();
    // Only the first failure of a run of failures is worth a warning.
    let mut quiet = false;
    // The gateway whose stream just ended at its age: the reopen may stay there.
    let mut aged = None;
    let state = |s| lanes.set_state(&lane, s);
    loop {
        // A stream just added has no credit until others gave some up; a stream
        // stating none would be given the gateway's default.
        while lane.credit() == 0 {
            tokio::select! {
                () = lane.resized.notified() => {}
                () = lane.close.cancelled() => return,
            }
        }
        let from = aged.take();
        let credit = lane.credit();
        // Jobs still held from an earlier stream (or polled) are declared, so the
        // gateway counts them against this one's credit.
        let asked = request
            .clone()
            .max_jobs_active(credit)
            .jobs_held(lanes.held_by(&lane, ctx.jobs_held()));
        let avoid = lanes.other_gateways(&lane);
        let opened = tokio::select! {
            r = ctx.once.open_stream(asked, from.as_ref(), &avoid) => r,
            () = lane.close.cancelled() => return,
        };
        let again = match opened {
            Ok(mut open) => {
                ctx.metrics.stream_opened();
                lane.opened(&ctx, open.gateway.addr(), credit);
                state(StreamState::Open);
                tracing::debug!(job_type = %c.job_type, gateway = open.gateway.addr(), credit, "job stream open");
                let opened_at = Instant::now();
                // Aborted when this stream ends, however it ends.
                let _saying_alive = match (open.id, open.heartbeat) {
                    (Some(id), Some(every)) => {
                        Some(AbortOnDrop(tokio::spawn(open.gateway.say_alive(id, every))))
                    }
                    _ => None,
                };
                // A gateway that keeps no heartbeat cannot be told from a stall.
                let stall_after = open.heartbeat.map(|h| h * STALL_AFTER_BEATS);
                let old_at = c
                    .stream_max_age
                    .map(|age| opened_at + age.mul_f64(1.0 - 0.2 * rand::random::<f64>()));
                let ended = loop {
                    let old = async {
                        match old_at {
                            Some(at) => tokio::time::sleep_until(at).await,
                            None => std::future::pending().await,
                        }
                    };
                    let silence = async {
                        match stall_after {
                            Some(d) => tokio::time::sleep(d).await,
                            None => std::future::pending().await,
                        }
                    };
                    tokio::select! {
                        m = open.jobs.message() => match m {
                            Ok(Some(job)) => pushed(&ctx, &lanes, &lane, job),
                            Ok(None) => break Ended::Closed,
                            Err(status) => break Ended::of(status),
                        },
                        () = silence => break Ended::Stalled(stall_after.unwrap_or_default()),
                        () = lane.resized.notified() => {
                            end_and_drain(&ctx, &lanes, &lane, &mut open).await;
                            break Ended::Resized;
                        }
                        () = old => {
                            end_and_drain(&ctx, &lanes, &lane, &mut open).await;
                            break Ended::Moved { leaving: false };
                        }
                        () = lane.close.cancelled() => {
                            // The worker closes this one of its streams: the jobs
                            // on their way still come. On shutdown it is dropped,
                            // which cancels the call: the gateway stops pushing and
                            // yields what it had buffered for us.
                            if !ctx.stop.is_cancelled() {
                                end_and_drain(&ctx, &lanes, &lane, &mut open).await;
                            }
                            ctx.metrics.stream_closed();
                            lane.ended(&ctx);
                            return;
                        }
                    }
                };
                // A stream that lived a while was a healthy one: start the ramp over.
                if opened_at.elapsed() >= PACE.cap {
                    ramp.reset();
                }
                lane.ended(&ctx);
                match ended {
                    Ended::Resized => {
                        ctx.metrics.stream_closed();
                        // A stream told to move reopens where the worker has none.
                        if !lane.take_move() {
                            aged = Some(open.gateway);
                        }
                        true
                    }
                    Ended::Moved { leaving } => {
                        ctx.metrics.stream_closed();
                        tracing::debug!(
                            gateway = open.gateway.addr(),
                            leaving,
                            "the job stream ended on purpose (its age, or its gateway leaving); reopening at once"
                        );
                        if leaving {
                            open.gateway.pass_over();
                        } else {
                            aged = Some(open.gateway);
                        }
                        // The poller stays beside the stream: it is back in a moment.
                        true
                    }
                    Ended::Stalled(after) => {
                        ctx.metrics.stream_failed();
                        state(StreamState::Down);
                        open.gateway.pass_over();
                        tracing::warn!(
                            gateway = open.gateway.addr(),
                            silent_for = ?after,
                            "the job stream went silent; reopening it on another gateway"
                        );
                        quiet = true;
                        true
                    }
                    Ended::Closed | Ended::Broke(_) => {
                        ctx.metrics.stream_failed();
                        state(StreamState::Down);
                        match ended {
                            Ended::Broke(s) => {
                                open.gateway.broke(&s);
                                tracing::warn!(
                                    code = ?s.code(),
                                    message = s.message(),
                                    gateway = open.gateway.addr(),
                                    "the job stream broke; polling and reopening"
                                )
                            }
                            _ => tracing::info!(
                                "the gateway closed the job stream; polling and reopening"
                            ),
                        }
                        quiet = true;
                        false
                    }
                }
            }
            Err(e) => {
                ctx.metrics.stream_not_opened();
                state(StreamState::Down);
                if quiet {
                    tracing::debug!(error = %e, "job stream still unavailable");
                } else if e.code() == Some(Code::Unimplemented) {
                    tracing::info!(
                        "the gateway has no job push; polling, and trying push again now and then"
                    );
                } else {
                    tracing::warn!(error = %e, "cannot open the job stream; polling meanwhile");
                }
                quiet = true;
                false
            }
        };
        if again {
            continue;
        }
        let delay = ramp.full_jitter(&mut rand::rng());
        ramp.grow();
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = lane.close.cancelled() => return,
        }
    }
}

/// A message on `lane`'s stream: a job to run, or a heartbeat, which is none.
fn pushed(ctx: &Arc<Ctx>, lanes: &Lanes, lane: &Lane, job: ActivatedJob) {
    if job.key != HEARTBEAT_KEY {
        lanes.carried(ctx, lane, job.key);
        ctx.receive(job, JobPath::Push);
    }
}

/// A task that stops when its handle is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// How long a stream the worker asked its gateway to end may take to end.
const END_DRAIN: Duration = Duration::from_secs(3);

/// Asks the gateway to end `open` and takes the jobs it sent until the end comes,
/// so none is left on the wire to wait for its timeout. A gateway that cannot end
/// it (an older one) or takes too long has it dropped.
async fn end_and_drain(ctx: &Arc<Ctx>, lanes: &Lanes, lane: &Lane, open: &mut OpenStream) {
    let Some(id) = open.id else { return };
    if !open.gateway.end_stream(id).await {
        return;
    }
    let deadline = tokio::time::sleep(END_DRAIN);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            m = open.jobs.message() => match m {
                Ok(Some(job)) => pushed(ctx, lanes, lane, job),
                Ok(None) | Err(_) => return,
            },
            () = &mut deadline => return,
            () = ctx.stop.cancelled() => return,
        }
    }
}

/// Polls for jobs whenever there is room, until shutdown.
pub(super) async fn poll_loop(
    ctx: Arc<Ctx>,
    lanes: Arc<Lanes>,
    mut stream: watch::Receiver<StreamState>,
) {
    let c = &ctx.config;
    let base = ActivateJobs::new(&c.job_type)
        .worker(&c.name)
        .timeout(c.timeout)
        .fetch_variables(c.fetch_variables.clone())
        .tenant_ids(c.tenant_ids.clone());
    // Climbs while polls come back empty, drops on jobs.
    let mut idle = Ramp::default();
    // Climbs while polls fail, drops on an answer.
    let mut errors = Ramp::default();
    loop {
        tokio::select! {
            () = ctx.capacity.until_free() => {}
            () = ctx.stop.cancelled() => return,
        }
        if *stream.borrow() != StreamState::Down {
            let delay = idle.equal_jitter(&mut rand::rng());
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                // The stream broke: poll now rather than after the delay.
                _ = stream.wait_for(|s| *s == StreamState::Down) => {}
                () = ctx.stop.cancelled() => return,
            }
        }
        // Asked for at most what is free now; push may still fill that room while
        // the poll is out, and what then finds no room is given back.
        // Room taken by jobs waiting for it is not room.
        let free = ctx.capacity.free().saturating_sub(ctx.waiting());
        if free == 0 {
            // A permit that just came back is about to go to a waiting job.
            tokio::task::yield_now().await;
            continue;
        }
        let beside_stream = *stream.borrow() != StreamState::Down;
        let mut request = base
            .clone()
            .max_jobs(i32::try_from(free).unwrap_or(i32::MAX));
        if beside_stream {
            request = request.request_timeout(Duration::ZERO);
        }
        let sent = Instant::now();
        let polled = tokio::select! {
            r = ctx.once.activate_jobs(request) => r,
            // A poll dropped mid-answer leaves its jobs to time out and run again.
            () = ctx.stop.cancelled() => return,
        };
        let pause = match polled {
            Ok(jobs) => {
                errors.reset();
                ctx.metrics.polled(jobs.len());
                let empty = jobs.is_empty();
                if beside_stream {
                    // Jobs the streams were not pushed: more streams may take them.
                    lanes.polled_beside(jobs.len());
                }
                for job in jobs {
                    ctx.receive(job, JobPath::Poll);
                }
                if !empty {
                    idle.reset();
                    None
                } else {
                    idle.grow();
                    (!beside_stream && sent.elapsed() < LONG_POLL_FLOOR)
                        .then(|| idle.full_jitter(&mut rand::rng()))
                }
            }
            Err(e) => {
                ctx.metrics.poll_failed();
                if errors.ceiling() == PACE.base {
                    tracing::warn!(error = %e, "poll failed; retrying with back-off");
                } else {
                    tracing::debug!(error = %e, "poll failed again");
                }
                let delay = errors.full_jitter(&mut rand::rng());
                errors.grow();
                Some(delay)
            }
        };
        if let Some(pause) = pause {
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                () = ctx.stop.cancelled() => return,
            }
        }
    }
}
