//! The gateway's Prometheus metrics, in the default registry.
//!
//! Statics, so several gateways in one process (`courier dev`, tests) share one set
//! instead of failing to register twice. A metric that cannot be created or registered
//! is logged and the gateway runs on without it: metrics never take a request down.

use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
};
use std::sync::LazyLock;
use std::time::Instant;

struct Metrics {
    requests: IntCounterVec,
    request_duration: HistogramVec,
    long_poll_parked: IntGauge,
    broker_retries: IntCounterVec,
    leader_changes: IntCounterVec,
    leader_reports: IntCounterVec,
    broker_links: IntGauge,
    jobs_activated: IntCounter,
    aggregated_streams: IntGauge,
    stream_clients: IntGauge,
    jobs_pushed: IntCounter,
    push_rejected: IntCounterVec,
    push_try_next: IntCounter,
    jobs_yielded: IntCounterVec,
    link_messages_dropped: IntCounterVec,
    credit_in_use: IntGaugeVec,
    credit_free: IntGaugeVec,
    inflight_jobs: IntGauge,
    inflight_bytes: IntGauge,
    spare_jobs: IntGauge,
    credit_reports: IntCounter,
    stale_jobs_dropped: IntCounter,
    activations_given_back: IntCounter,
    auth_refused: IntCounterVec,
    tls_refused: IntCounter,
    connections: IntGauge,
    bounds: IntGaugeVec,
    admission_refused: IntCounterVec,
    streams_ended: IntCounterVec,
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
        leader_changes: IntCounterVec::new(
            Opts::new(
                "courier_gateway_leader_changes_total",
                "Partitions whose leader the gateway learned anew, by source: round (a \
                 topology round), hint (a NotLeader answer), claim (the leader said so)",
            ),
            &["source"],
        )?,
        leader_reports: IntCounterVec::new(
            Opts::new(
                "courier_gateway_leader_reports_total",
                "Word of a partition's leader from a broker, whether or not it was news, by \
                 source: hint (a NotLeader answer naming it), claim (the leader said so)",
            ),
            &["source"],
        )?,
        broker_links: IntGauge::new(
            "courier_gateway_broker_links",
            "Gateway <-> broker links currently connected",
        )?,
        jobs_activated: IntCounter::new(
            "courier_gateway_jobs_activated_total",
            "Jobs handed to workers through ActivateJobs",
        )?,
        aggregated_streams: IntGauge::new(
            "courier_gateway_aggregated_streams",
            "Aggregated job streams (client streams with equal activation properties)",
        )?,
        stream_clients: IntGauge::new(
            "courier_gateway_stream_clients",
            "StreamActivatedJobs clients connected",
        )?,
        jobs_pushed: IntCounter::new(
            "courier_gateway_jobs_pushed_total",
            "Jobs pushed by brokers and handed to a stream client",
        )?,
        push_rejected: IntCounterVec::new(
            Opts::new(
                "courier_gateway_push_rejected_total",
                "Pushed jobs refused, by reason (no_client, unknown_stream, clients_full, gateway_full, malformed)",
            ),
            &["reason"],
        )?,
        push_try_next: IntCounter::new(
            "courier_gateway_push_try_next_total",
            "Stream clients counted as having room that could not take a pushed job",
        )?,
        jobs_yielded: IntCounterVec::new(
            Opts::new(
                "courier_gateway_jobs_yielded_total",
                "YieldJob sent for accepted jobs whose client left, by why no other client took them",
            ),
            &["reason"],
        )?,
        link_messages_dropped: IntCounterVec::new(
            Opts::new(
                "courier_gateway_link_messages_dropped_total",
                "Messages to brokers that could not be queued (no link, or its queue full), by kind",
            ),
            &["kind"],
        )?,
        credit_in_use: IntGaugeVec::new(
            Opts::new(
                "courier_gateway_credit_in_use",
                "Pushed jobs held unfinished by stream clients, by job type",
            ),
            &["type"],
        )?,
        credit_free: IntGaugeVec::new(
            Opts::new(
                "courier_gateway_credit_free",
                "Credit of stream clients not in use (credit minus jobs held), by job type",
            ),
            &["type"],
        )?,
        inflight_jobs: IntGauge::new(
            "courier_gateway_inflight_jobs",
            "Pushed jobs the gateway holds unfinished, across all clients",
        )?,
        inflight_bytes: IntGauge::new(
            "courier_gateway_inflight_bytes",
            "Variables and custom headers bytes of the pushed jobs the gateway holds unfinished",
        )?,
        spare_jobs: IntGauge::new(
            "courier_gateway_spare_jobs",
            "Pushed jobs kept in streams' spare room, waiting for a client with free credit",
        )?,
        credit_reports: IntCounter::new(
            "courier_gateway_credit_reports_total",
            "StreamCredit reports sent to brokers",
        )?,
        stale_jobs_dropped: IntCounter::new(
            "courier_gateway_stale_jobs_dropped_total",
            "Pushed jobs dropped before reaching a client because their activation ended \
             while they waited in the gateway (timed out, finished elsewhere, or pushed again)",
        )?,
        activations_given_back: IntCounter::new(
            "courier_gateway_activations_given_back_total",
            "Jobs activated for an ActivateJobs call but not in its answer (the client went \
             away first, or the answer was full), failed back with their retries unchanged",
        )?,
        auth_refused: IntCounterVec::new(
            Opts::new(
                "courier_gateway_auth_refused_total",
                "Requests refused UNAUTHENTICATED, by reason (missing, malformed, unknown_token, jwt_*)",
            ),
            &["reason"],
        )?,
        tls_refused: IntCounter::new(
            "courier_gateway_tls_refused_total",
            "Client connections dropped in the TLS handshake (plaintext, or a bad handshake)",
        )?,
        connections: IntGauge::new(
            "courier_gateway_connections",
            "Client connections the gateway holds (TLS handshakes included)",
        )?,
        bounds: IntGaugeVec::new(
            Opts::new(
                "courier_gateway_bound",
                "The gateway's admission bounds as configured, by bound (connections, \
                 calls_per_connection, job_streams, parked_polls, inflight_jobs, inflight_bytes): \
                 compare with courier_gateway_connections, _stream_clients, \
                 _long_poll_parked, _inflight_jobs and _inflight_bytes",
            ),
            &["bound"],
        )?,
        admission_refused: IntCounterVec::new(
            Opts::new(
                "courier_gateway_admission_refused_total",
                "Connections closed and requests refused RESOURCE_EXHAUSTED at an admission \
                 bound, by bound",
            ),
            &["bound"],
        )?,
        streams_ended: IntCounterVec::new(
            Opts::new(
                "courier_gateway_streams_ended_total",
                "Job streams the gateway ended, by reason (max_age, shutdown, asked, stalled: \
                 their client silent for three heartbeats)",
            ),
            &["reason"],
        )?,
    };
    for reason in [
        STREAM_END_MAX_AGE,
        STREAM_END_SHUTDOWN,
        STREAM_END_ASKED,
        STREAM_END_STALLED,
    ] {
        m.streams_ended.with_label_values(&[reason]);
    }
    for bound in crate::admission::Bound::ALL {
        m.admission_refused.with_label_values(&[bound.label()]);
    }
    for reason in ["missing", "malformed", "unknown_token"]
        .into_iter()
        .chain(crate::auth::jwt::JwtError::REASONS)
    {
        m.auth_refused.with_label_values(&[reason]);
    }
    // At zero from the start, so a graph of yields has a series before the first.
    for reason in [
        crate::streams::NO_CLIENT,
        crate::streams::SPARE_WAITED,
        crate::streams::SPARE_STALE,
    ] {
        m.jobs_yielded.with_label_values(&[reason]);
    }
    for reason in courier_proto::push_refusal::ALL
        .into_iter()
        .chain([MALFORMED_PUSH])
    {
        m.push_rejected.with_label_values(&[reason]);
    }
    let registry = prometheus::default_registry();
    let collectors: [Box<dyn prometheus::core::Collector>; 29] = [
        Box::new(m.requests.clone()),
        Box::new(m.request_duration.clone()),
        Box::new(m.long_poll_parked.clone()),
        Box::new(m.broker_retries.clone()),
        Box::new(m.leader_changes.clone()),
        Box::new(m.leader_reports.clone()),
        Box::new(m.broker_links.clone()),
        Box::new(m.jobs_activated.clone()),
        Box::new(m.aggregated_streams.clone()),
        Box::new(m.stream_clients.clone()),
        Box::new(m.jobs_pushed.clone()),
        Box::new(m.push_rejected.clone()),
        Box::new(m.push_try_next.clone()),
        Box::new(m.jobs_yielded.clone()),
        Box::new(m.link_messages_dropped.clone()),
        Box::new(m.credit_in_use.clone()),
        Box::new(m.credit_free.clone()),
        Box::new(m.inflight_jobs.clone()),
        Box::new(m.inflight_bytes.clone()),
        Box::new(m.spare_jobs.clone()),
        Box::new(m.credit_reports.clone()),
        Box::new(m.stale_jobs_dropped.clone()),
        Box::new(m.activations_given_back.clone()),
        Box::new(m.auth_refused.clone()),
        Box::new(m.tls_refused.clone()),
        Box::new(m.connections.clone()),
        Box::new(m.bounds.clone()),
        Box::new(m.admission_refused.clone()),
        Box::new(m.streams_ended.clone()),
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

/// Counts `n` partitions whose leader the gateway learned anew; `source` is a
/// fixed label.
pub fn leader_changed(source: &'static str, n: u64) {
    if let Some(m) = METRICS.as_ref() {
        m.leader_changes.with_label_values(&[source]).inc_by(n);
    }
}

/// Counts a broker's word of a partition's leader (`claim` or `hint`), news or not.
pub fn leader_reported(source: &'static str) {
    if let Some(m) = METRICS.as_ref() {
        m.leader_reports.with_label_values(&[source]).inc();
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

/// Adds `delta` to the aggregated streams gauge.
pub fn aggregated_streams(delta: i64) {
    if let Some(m) = METRICS.as_ref() {
        m.aggregated_streams.add(delta);
    }
}

/// Adds `delta` to the stream clients gauge.
pub fn stream_clients(delta: i64) {
    if let Some(m) = METRICS.as_ref() {
        m.stream_clients.add(delta);
    }
}

/// Counts a pushed job handed to a client.
pub fn job_pushed() {
    if let Some(m) = METRICS.as_ref() {
        m.jobs_pushed.inc();
    }
}

/// The reason counted for a push that carries no job: dropped, never acked.
pub const MALFORMED_PUSH: &str = "malformed";

/// Counts a refused push; `reason` is the ack's reason (or [`MALFORMED_PUSH`]).
pub fn push_rejected(reason: &'static str) {
    if let Some(m) = METRICS.as_ref() {
        m.push_rejected.with_label_values(&[reason]).inc();
    }
}

/// Counts a client skipped because it could not take a pushed job.
pub fn push_try_next() {
    if let Some(m) = METRICS.as_ref() {
        m.push_try_next.inc();
    }
}

/// Counts a YieldJob sent; `reason` says why no other client took the job.
pub fn job_yielded(reason: &'static str) {
    if let Some(m) = METRICS.as_ref() {
        m.jobs_yielded.with_label_values(&[reason]).inc();
    }
}

/// The label of a stream ended at its maximum age.
pub const STREAM_END_MAX_AGE: &str = "max_age";
/// The label of a stream ended because the gateway shuts down.
pub const STREAM_END_SHUTDOWN: &str = "shutdown";
/// The label of a stream ended because its client asked (`EndStream`).
pub const STREAM_END_ASKED: &str = "asked";
/// The label of a stream ended because its client went silent.
pub const STREAM_END_STALLED: &str = "stalled";

/// Counts a job stream ended for its client to reopen, by `reason`.
pub fn stream_ended(reason: &'static str) {
    if let Some(m) = METRICS.as_ref() {
        m.streams_ended.with_label_values(&[reason]).inc();
    }
}

/// Counts a message to a broker that could not be queued; `kind` names the message.
pub fn link_message_dropped(kind: &'static str) {
    if let Some(m) = METRICS.as_ref() {
        m.link_messages_dropped.with_label_values(&[kind]).inc();
    }
}

/// Counts a StreamCredit report sent to a broker.
pub fn credit_report_sent() {
    if let Some(m) = METRICS.as_ref() {
        m.credit_reports.inc();
    }
}

/// Counts `n` pushed jobs dropped at the gateway because their activation ended.
pub fn stale_jobs_dropped(n: usize) {
    if let Some(m) = METRICS.as_ref() {
        m.stale_jobs_dropped.inc_by(n as u64);
    }
}

/// Counts `n` jobs of an unanswerable ActivateJobs call given back to their broker.
pub fn activations_given_back(n: u64) {
    if let Some(m) = METRICS.as_ref() {
        m.activations_given_back.inc_by(n);
    }
}

/// Counts a request refused UNAUTHENTICATED for `reason`.
pub fn auth_refused(reason: &'static str) {
    if let Some(m) = METRICS.as_ref() {
        m.auth_refused.with_label_values(&[reason]).inc();
    }
}

/// Counts a client connection dropped in the TLS handshake.
pub fn tls_refused() {
    if let Some(m) = METRICS.as_ref() {
        m.tls_refused.inc();
    }
}

/// Jobs kept in streams' spare room moved by `n`.
pub fn connections(delta: i64) {
    if let Some(m) = METRICS.as_ref() {
        m.connections.add(delta);
    }
}

pub fn connection_refused() {
    admission_refused(crate::admission::Bound::Connections);
}

pub fn admission_refused(bound: crate::admission::Bound) {
    if let Some(m) = METRICS.as_ref() {
        m.admission_refused
            .with_label_values(&[bound.label()])
            .inc();
    }
}

/// Publishes a configured bound.
pub fn bound(bound: crate::admission::Bound, value: usize) {
    if let Some(m) = METRICS.as_ref() {
        m.bounds
            .with_label_values(&[bound.label()])
            .set(i64::try_from(value).unwrap_or(i64::MAX));
    }
}

pub fn spare_jobs(n: i64) {
    if let Some(m) = METRICS.as_ref() {
        m.spare_jobs.add(n);
    }
}

/// Adds to the gateway's in-flight jobs and bytes gauges. Deltas rather than values,
/// so several gateways in one process add up instead of overwriting each other.
pub fn inflight(jobs: i64, bytes: i64) {
    if let Some(m) = METRICS.as_ref() {
        m.inflight_jobs.add(jobs);
        m.inflight_bytes.add(bytes);
    }
}

/// The credit gauges of one job type, looked up once per aggregated stream rather
/// than by label on every push.
pub struct CreditGauges(Option<(IntGauge, IntGauge)>);

impl CreditGauges {
    /// The gauges labelled with `job_type`.
    pub fn for_type(job_type: &str) -> Self {
        CreditGauges(METRICS.as_ref().map(|m| {
            (
                m.credit_in_use.with_label_values(&[job_type]),
                m.credit_free.with_label_values(&[job_type]),
            )
        }))
    }

    /// Drops the gauges of `job_type` once no stream of it is left, so the series
    /// do not pile up with every type ever streamed.
    pub fn forget(job_type: &str) {
        if let Some(m) = METRICS.as_ref() {
            let _ = m.credit_in_use.remove_label_values(&[job_type]);
            let _ = m.credit_free.remove_label_values(&[job_type]);
        }
    }

    /// Adds `in_use` to the credit in use and `free` to the free credit.
    pub fn add(&self, in_use: i64, free: i64) {
        if let Some((u, f)) = &self.0 {
            u.add(in_use);
            f.add(free);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn credit_series(job_type: &str) -> usize {
        prometheus::default_registry()
            .gather()
            .iter()
            .filter(|f| f.name().starts_with("courier_gateway_credit_"))
            .flat_map(|f| f.get_metric())
            .filter(|m| m.get_label().iter().any(|l| l.value() == job_type))
            .count()
    }

    #[test]
    fn the_credit_series_of_a_type_go_with_its_last_stream() {
        let gauges = CreditGauges::for_type("forgotten-type");
        gauges.add(0, 32);
        assert_eq!(credit_series("forgotten-type"), 2);
        CreditGauges::forget("forgotten-type");
        assert_eq!(credit_series("forgotten-type"), 0);
    }

    /// The values of `label` among the series of counter `name`.
    fn label_values(name: &str, label: &str) -> Vec<String> {
        prometheus::default_registry()
            .gather()
            .iter()
            .filter(|f| f.name() == name)
            .flat_map(|f| f.get_metric())
            .flat_map(|m| m.get_label())
            .filter(|l| l.name() == label)
            .map(|l| l.value().to_string())
            .collect()
    }

    #[test]
    fn push_refusals_and_yields_have_a_series_for_every_reason_from_the_start() {
        LazyLock::force(&METRICS);
        let refused = label_values("courier_gateway_push_rejected_total", "reason");
        for reason in courier_proto::push_refusal::ALL
            .into_iter()
            .chain([MALFORMED_PUSH])
        {
            assert!(refused.iter().any(|r| r == reason), "{reason}: {refused:?}");
        }
        let yielded = label_values("courier_gateway_jobs_yielded_total", "reason");
        assert_eq!(yielded.len(), 3, "{yielded:?}");
    }
}
