//! Retrying transient failures: full-jitter exponential back-off within a time budget.
//!
//! Full jitter (a delay drawn uniformly from zero to the ceiling) rather than a fixed
//! schedule, so that many clients refused at the same moment (a leader change, a
//! restart) do not come back at the same moment too.

pub use courier_proto::backoff::Backoff;
use std::future::Future;
use std::time::Duration;
use tokio::time::Instant;
use tonic::{Code, Status};

/// How long a call keeps retrying by default before it returns the last error.
pub const DEFAULT_RETRY_BUDGET: Duration = Duration::from_secs(30);

/// The back-off of a client's call retries: from 25 ms, at most 2 s.
pub const DEFAULT_BACKOFF: Backoff =
    Backoff::new(Duration::from_millis(25), Duration::from_secs(2));

/// The codes that mean "not now" (no leader, back pressure) rather than "no".
pub fn is_retryable(code: Code) -> bool {
    matches!(code, Code::Unavailable | Code::ResourceExhausted)
}

/// Whether `status` says the request never left this process: the connection it
/// was queued on closed before it was written (hyper cancels it then, and tonic
/// answers CANCELLED). Sending it again cannot apply it twice, whatever it does;
/// seen when a gateway restarts under a client.
pub fn never_sent(status: &Status) -> bool {
    if status.code() != Code::Cancelled {
        return false;
    }
    let mut source = std::error::Error::source(status);
    while let Some(e) = source {
        if e.downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_canceled)
        {
            return true;
        }
        source = e.source();
    }
    false
}

/// How long a call retries before it says so, once, as a warning: a person who ran
/// a command against a gateway that is not up sees why it waits, where a leader
/// change (well under this) stays quiet.
pub const RETRY_NOTICE_AFTER: Duration = Duration::from_secs(1);

/// Runs `call` until it succeeds, fails with a code that is not retryable, or
/// `budget` has passed since the first attempt; then returns the last outcome. The
/// last sleep is shortened to end at the budget, so one attempt is made right at it.
/// A call still retrying after [`RETRY_NOTICE_AFTER`] logs one warning.
pub(crate) async fn with_retries<T, F, Fut>(
    backoff: Backoff,
    budget: Duration,
    mut call: F,
) -> Result<T, Status>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Status>>,
{
    let start = Instant::now();
    let mut attempt = 0u32;
    let mut noticed = false;
    loop {
        let status = match call().await {
            Ok(v) => return Ok(v),
            Err(s) if is_retryable(s.code()) || never_sent(&s) => s,
            Err(s) => return Err(s),
        };
        let left = budget.saturating_sub(start.elapsed());
        if left.is_zero() {
            return Err(status);
        }
        if !noticed && start.elapsed() >= RETRY_NOTICE_AFTER {
            noticed = true;
            tracing::warn!(
                "no answer yet ({}); retrying for up to {:.0?} more",
                crate::error::status_text(&status),
                left
            );
        }
        let delay = backoff.delay(attempt, &mut rand::rng()).min(left);
        tracing::debug!(code = ?status.code(), message = status.message(), ?delay, attempt, "retrying");
        tokio::time::sleep(delay).await;
        attempt = attempt.saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn client_retries_back_off_from_25ms_to_2s() {
        assert_eq!(DEFAULT_BACKOFF.ceiling(0), Duration::from_millis(25));
        assert_eq!(DEFAULT_BACKOFF.ceiling(30), Duration::from_secs(2));
    }

    #[tokio::test(start_paused = true)]
    async fn retries_transient_codes_until_success() {
        let calls = Cell::new(0);
        let r = with_retries(DEFAULT_BACKOFF, DEFAULT_RETRY_BUDGET, || {
            calls.set(calls.get() + 1);
            let n = calls.get();
            async move {
                match n {
                    1 => Err(Status::unavailable("no leader")),
                    2 => Err(Status::resource_exhausted("busy")),
                    _ => Ok(n),
                }
            }
        })
        .await;
        assert_eq!(r.ok(), Some(3));
    }

    /// What tonic answers for a request whose connection went before it was
    /// written: hyper's own error, from a connection that is no longer driven.
    async fn unsent_request_status() -> Status {
        let (io, _peer) = tokio::io::duplex(1024);
        let (mut send, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(io),
        )
        .await
        .expect("handshake");
        drop(conn);
        let req = tonic::codegen::http::Request::new(tonic::body::Body::empty());
        let err = send.send_request(req).await.expect_err("no connection");
        Status::from_error(Box::new(err))
    }

    #[tokio::test]
    async fn a_request_that_was_never_written_is_sent_again() {
        let unsent = unsent_request_status().await;
        assert_eq!(unsent.code(), Code::Cancelled, "{unsent:?}");
        assert!(never_sent(&unsent), "{unsent:?}");
        // A cancellation that may have reached the gateway is not retried.
        assert!(!never_sent(&Status::cancelled("the call was cancelled")));

        let calls = Cell::new(0);
        let mut first = Some(unsent);
        let r = with_retries(DEFAULT_BACKOFF, DEFAULT_RETRY_BUDGET, || {
            calls.set(calls.get() + 1);
            let outcome = first.take().map_or(Ok(calls.get()), Err);
            async move { outcome }
        })
        .await;
        assert_eq!(r.ok(), Some(2));
    }

    #[tokio::test(start_paused = true)]
    async fn other_codes_return_at_once() {
        let calls = Cell::new(0);
        let r: Result<(), Status> = with_retries(DEFAULT_BACKOFF, DEFAULT_RETRY_BUDGET, || {
            calls.set(calls.get() + 1);
            async { Err(Status::not_found("gone")) }
        })
        .await;
        assert_eq!(r.map_err(|s| s.code()), Err(Code::NotFound));
        assert_eq!(calls.get(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn gives_up_with_the_last_error_when_the_budget_is_spent() {
        let start = Instant::now();
        let calls = Cell::new(0);
        let budget = Duration::from_secs(5);
        let r: Result<(), Status> = with_retries(DEFAULT_BACKOFF, budget, || {
            calls.set(calls.get() + 1);
            let n = calls.get();
            async move { Err(Status::unavailable(format!("attempt {n}"))) }
        })
        .await;
        let err = r.err().map(|s| s.message().to_string());
        assert_eq!(err, Some(format!("attempt {}", calls.get())));
        assert!(calls.get() > 2);
        // The last attempt happens at the budget, not a back-off step past it (the
        // timer wheel rounds each sleep up to a millisecond).
        let elapsed = start.elapsed();
        assert!(elapsed >= budget && elapsed < budget + Duration::from_millis(50));
    }

    #[tokio::test(start_paused = true)]
    async fn a_zero_budget_means_one_attempt() {
        let calls = Cell::new(0);
        let r: Result<(), Status> = with_retries(DEFAULT_BACKOFF, Duration::ZERO, || {
            calls.set(calls.get() + 1);
            async { Err(Status::unavailable("down")) }
        })
        .await;
        assert!(r.is_err());
        assert_eq!(calls.get(), 1);
    }
}
