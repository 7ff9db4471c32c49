//! One job's life in the worker: the handler, then its outcome reported, or the job
//! given back.

use super::capacity::Held;
use super::metrics::{ActiveGuard, GiveBack, WorkerMetrics};
use super::{Ctx, JobOutcome};
use crate::error::ClientError;
use courier_proto::gateway_protocol::ActivatedJob;
use std::any::Any;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinError;
use tokio::time::Instant;
use tracing::Instrument;

/// The timeout a give-back sets: the job times out on the broker at once and is
/// runnable again, its retries untouched.
const GIVE_BACK_TIMEOUT: Duration = Duration::from_millis(1);

/// Runs the handler for a held job and reports what it decided. The job's room is
/// freed when its outcome is sent, as the gateway frees the stream's credit when
/// the outcome arrives: the next job may be on its way while this one's outcome is
/// committed. It stays counted as active (for shutdown) until the report is answered.
pub(super) async fn run(ctx: Arc<Ctx>, job: ActivatedJob, hold: (Held, ActiveGuard)) {
    let (key, retries) = (job.key, job.retries);
    let started = Instant::now();
    let handler = Arc::clone(&ctx.handler);
    // A task of its own: a panic in the handler ends that task only, and the
    // handler can be dropped when the shutdown grace is over.
    // The handler's span, a child of the job's producer where the job carries its
    // trace context: spans the handler makes join that trace.
    let span = tracing::info_span!("job", job_key = key, job_type = %job.r#type);
    if let Some(tp) = courier_proto::trace::in_headers(&job.custom_headers) {
        courier_proto::trace::set_parent(&span, &tp);
    }
    let mut task = tokio::spawn(async move { handler(job).await }.instrument(span));
    let outcome = tokio::select! {
        biased;
        r = &mut task => decide(r),
        () = ctx.abandon.cancelled() => {
            task.abort();
            None
        }
    };
    let (held, active) = hold;
    ctx.ran(key);
    match outcome {
        Some(outcome) => {
            ctx.metrics.handler_took(started.elapsed());
            drop(held);
            // The permit goes to a job waiting for one, if any.
            ctx.pump();
            report(&ctx, key, retries, outcome).await;
        }
        None => give_back(Arc::clone(&ctx), key, GiveBack::Shutdown).await,
    }
    drop(active);
}

/// The outcome for a finished handler task: its own decision, or a failure for its
/// error or panic. `None` when the task was cancelled (the runtime is going away).
fn decide(r: Result<Result<JobOutcome, String>, JoinError>) -> Option<JobOutcome> {
    match r {
        Ok(Ok(outcome)) => Some(outcome),
        Ok(Err(message)) => Some(JobOutcome::fail(message)),
        Err(e) if e.is_panic() => Some(JobOutcome::fail(format!(
            "handler panicked: {}",
            panic_message(e.into_panic().as_ref())
        ))),
        Err(_) => None,
    }
}

/// The text a panic was raised with, when it was text.
fn panic_message(payload: &(dyn Any + Send)) -> &str {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s
    } else {
        "(no message)"
    }
}

/// The retries a failure leaves: as the handler said, or one less than the job had.
fn retries_after_failure(asked: Option<i32>, job_retries: i32) -> i32 {
    asked.unwrap_or(job_retries.saturating_sub(1)).max(0)
}

/// Tells the gateway the outcome. A refusal is logged and counted, not retried
/// beyond the client's budget: the job runs again after its timeout anyway.
async fn report(ctx: &Ctx, key: i64, job_retries: i32, outcome: JobOutcome) {
    let c = &ctx.client;
    // Kept for the caller's hook only: the command takes the outcome's text.
    let kept = ctx.reported.as_ref().map(|_| outcome.clone());
    let (result, count): (Result<(), ClientError>, fn(&WorkerMetrics)) = match outcome {
        JobOutcome::Complete { variables } => (
            c.complete_job(key, variables).await,
            WorkerMetrics::completed,
        ),
        JobOutcome::Fail {
            message,
            retries,
            backoff,
        } => {
            let retries = retries_after_failure(retries, job_retries);
            (
                c.fail_job(key, retries, message, backoff).await,
                WorkerMetrics::failed,
            )
        }
        JobOutcome::ThrowError { code, message } => (
            c.throw_error(key, code, message).await,
            WorkerMetrics::error_thrown,
        ),
    };
    match &result {
        Ok(()) => count(&ctx.metrics),
        Err(e) => {
            ctx.metrics.command_failed();
            tracing::warn!(job_key = key, error = %e, "{}", refused_outcome(e));
        }
    }
    if let (Some(reported), Some(outcome)) = (&ctx.reported, kept) {
        reported(key, &outcome, result.as_ref().map(|_| ()));
    }
}

/// What a refused outcome means for the job, by the refusal's code.
fn refused_outcome(e: &ClientError) -> &'static str {
    if e.outcome_unknown() {
        return "could not tell whether the outcome was recorded (the connection broke or the call timed out); if it was not, the job runs again after its timeout";
    }
    match e.code() {
        Some(tonic::Code::NotFound) => {
            "the outcome was not recorded: the job is gone (completed, its error thrown or canceled, perhaps by another run of it after its activation timed out)"
        }
        Some(tonic::Code::FailedPrecondition) => {
            "the outcome was not recorded: the job is no longer activated (its activation timed out and it waits to run again, or it failed)"
        }
        _ => "could not report the job's outcome; it runs again after its timeout",
    }
}

/// Hands a job back untouched: its timeout is cut to 1 ms, so it runs again at once
/// without using a retry. If that fails, the job runs again after its own timeout.
pub(super) async fn give_back(ctx: Arc<Ctx>, key: i64, why: GiveBack) {
    ctx.metrics.given_back(why);
    if let Err(e) = ctx
        .give_back
        .update_job_timeout(key, GIVE_BACK_TIMEOUT)
        .await
    {
        tracing::debug!(
            job_key = key,
            error = %e,
            "could not give the job back; it runs again after its timeout"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_leave_one_retry_less_unless_told_otherwise() {
        assert_eq!(retries_after_failure(None, 3), 2);
        assert_eq!(retries_after_failure(None, 1), 0);
        assert_eq!(retries_after_failure(None, 0), 0);
        assert_eq!(retries_after_failure(None, i32::MIN), 0);
        assert_eq!(retries_after_failure(Some(5), 1), 5);
        assert_eq!(retries_after_failure(Some(-2), 3), 0);
    }

    #[tokio::test]
    async fn errors_and_panics_become_failures() {
        let ok = tokio::spawn(async { Ok(JobOutcome::complete()) }).await;
        assert_eq!(decide(ok), Some(JobOutcome::complete()));
        let err = tokio::spawn(async { Err("no funds".to_string()) }).await;
        assert_eq!(decide(err), Some(JobOutcome::fail("no funds")));
        let panicked = tokio::spawn(async {
            if true {
                panic!("index {} out of range", 7);
            }
            Ok(JobOutcome::complete())
        })
        .await;
        assert_eq!(
            decide(panicked),
            Some(JobOutcome::fail("handler panicked: index 7 out of range"))
        );
        let static_panic = tokio::spawn(async {
            if true {
                panic!("boom");
            }
            Ok(JobOutcome::complete())
        })
        .await;
        assert_eq!(
            decide(static_panic),
            Some(JobOutcome::fail("handler panicked: boom"))
        );
        let aborted = tokio::spawn(std::future::pending::<Result<JobOutcome, String>>());
        aborted.abort();
        assert_eq!(decide(aborted.await), None);
    }
}
