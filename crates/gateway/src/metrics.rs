//! The gateway's Prometheus metrics, in the default registry.
//!
//! Statics, so several gateways in one process (`courier dev`, tests) share one set
//! instead of failing to register twice. A metric that cannot be created or registered
//! is logged and the gateway runs on without it: metrics never take a request down.

use prometheus::{HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts};
use std::sync::LazyLock;
use std::time::Instant;

struct Metrics {
    requests: IntCounterVec,
    request_duration: HistogramVec,
    long_poll_parked: IntGauge,
    broker_retries: IntCounterVec,
    broker_links: IntGauge,
    jobs_activated: IntCounter,
}

static METRICS: LazyLock<Option<Metrics>> = LazyLock::new(|| match build() {
    Ok(m) => Some(m),
    Err(e) => {
        tracing::error!(error = %e, "gateway metrics are disabled: cannot create them");
        None
    }
});

fn build() -> prometheus::Result<Metrics> {
    let m = Metrics {
        requests: IntCounterVec::new(
            Opts::new(
                "courier_gateway_requests_total",
                "Client requests answered by the gateway, by method and gRPC code",
            ),
            &["method", "code"],
        )?,
        request_duration: HistogramVec::new(
            HistogramOpts::new(
                "courier_gateway_request_duration_seconds",
                "Time from receiving a client request to its answer (long polls included)",
            )
            .buckets(vec![
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0, 30.0, 60.0,
            ]),
            &["method"],
        )?,
        long_poll_parked: IntGauge::new(
            "courier_gateway_long_poll_parked",
            "ActivateJobs requests parked waiting for jobs",
        )?,
        broker_retries: IntCounterVec::new(
            Opts::new(
                "courier_gateway_broker_retries_total",
                "Requests to brokers that were retried, by reason",
            ),
            &["reason"],
        )?,
        broker_links: IntGauge::new(
            "courier_gateway_broker_links",
            "Gateway <-> broker links currently connected",
        )?,
        jobs_activated: IntCounter::new(
            "courier_gateway_jobs_activated_total",
            "Jobs handed to workers through ActivateJobs",
        )?,
    };
    let registry = prometheus::default_registry();
    let collectors: [Box<dyn prometheus::core::Collector>; 6] = [
        Box::new(m.requests.clone()),
        Box::new(m.request_duration.clone()),
        Box::new(m.long_poll_parked.clone()),
        Box::new(m.broker_retries.clone()),
        Box::new(m.broker_links.clone()),
        Box::new(m.jobs_activated.clone()),
    ];
    for c in collectors {
        if let Err(e) = registry.register(c) {
            tracing::error!(error = %e, "cannot register a gateway metric");
        }
    }
    Ok(m)
}

/// Times one client request and counts it by its final gRPC code when finished or
/// dropped; dropped unfinished (the client went away) counts as `Cancelled`.
pub struct RequestObserver {
    method: &'static str,
    start: Instant,
    done: bool,
}

impl RequestObserver {
    /// Starts timing a request to `method`.
    pub fn start(method: &'static str) -> Self {
        RequestObserver {
            method,
            start: Instant::now(),
            done: false,
        }
    }

    /// Records the request's outcome.
    pub fn finish(mut self, code: tonic::Code) {
        self.record(code);
    }

    fn record(&mut self, code: tonic::Code) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        if let Some(m) = METRICS.as_ref() {
            let code = format!("{code:?}");
            m.requests.with_label_values(&[self.method, &code]).inc();
            m.request_duration
                .with_label_values(&[self.method])
                .observe(self.start.elapsed().as_secs_f64());
        }
    }
}

impl Drop for RequestObserver {
    fn drop(&mut self) {
        self.record(tonic::Code::Cancelled);
    }
}

/// Counts a retried broker request; `reason` is a short fixed label.
pub fn broker_retry(reason: &'static str) {
    if let Some(m) = METRICS.as_ref() {
        m.broker_retries.with_label_values(&[reason]).inc();
    }
}

/// Counts jobs handed out by ActivateJobs.
pub fn jobs_activated(n: usize) {
    if let Some(m) = METRICS.as_ref() {
        m.jobs_activated.inc_by(n as u64);
    }
}

/// Adds `delta` to the parked long-poll gauge.
pub fn long_poll_parked(delta: i64) {
    if let Some(m) = METRICS.as_ref() {
        m.long_poll_parked.add(delta);
    }
}

/// Adds `delta` to the connected broker links gauge.
pub fn broker_links(delta: i64) {
    if let Some(m) = METRICS.as_ref() {
        m.broker_links.add(delta);
    }
}
