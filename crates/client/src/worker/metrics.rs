//! What a worker counts: plain atomics, read through [`WorkerMetrics::snapshot`], and
//! with the `prometheus` feature exported to a `prometheus::Registry`.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

/// Upper bounds of the handler-duration buckets, in seconds: from a millisecond (a
/// handler that only computes) to a minute (one that calls slow services).
pub const HANDLER_DURATION_BUCKETS: [f64; 15] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// How a job reached the worker.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum JobPath {
    /// Pushed on the worker's `StreamActivatedJobs` stream.
    Push,
    /// Returned by an `ActivateJobs` poll.
    Poll,
}

/// Why a job was handed back untouched (its timeout shortened to 1 ms, so it runs
/// again at once, with no retry used and no error recorded).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum GiveBack {
    /// It arrived while the worker already held max-jobs-active jobs.
    NoCapacity,
    /// Its handler was still running when the shutdown grace period ended.
    Shutdown,
}

/// A worker's live counters. Cloning is cheap: clones read the same counters.
#[derive(Clone, Debug, Default)]
pub struct WorkerMetrics(Arc<Counters>);

/// One held job in the `active` gauge.
#[derive(Debug)]
pub(crate) struct ActiveGuard(WorkerMetrics);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0 .0.active.fetch_sub(1, Relaxed);
    }
}

#[derive(Debug, Default)]
struct Counters {
    pushed: AtomicU64,
    polled: AtomicU64,
    completed: AtomicU64,
    failed: AtomicU64,
    errors_thrown: AtomicU64,
    given_back_no_capacity: AtomicU64,
    given_back_shutdown: AtomicU64,
    waited_for_room: AtomicU64,
    commands_failed: AtomicU64,
    active: AtomicU64,
    streams_open: AtomicU64,
    stream_credit: AtomicI64,
    stream_opens: AtomicU64,
    stream_failures: AtomicU64,
    polls: AtomicU64,
    polls_empty: AtomicU64,
    poll_errors: AtomicU64,
    handler: Histogram,
}

/// Durations counted per bucket (not cumulative; the snapshot adds them up).
#[derive(Debug, Default)]
struct Histogram {
    /// One counter per bound of [`HANDLER_DURATION_BUCKETS`], plus one past the last.
    buckets: [AtomicU64; HANDLER_DURATION_BUCKETS.len() + 1],
    sum_nanos: AtomicU64,
}

/// The counters at one moment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkerMetricsSnapshot {
    /// Jobs received on the stream (including any given back).
    pub pushed: u64,
    /// Jobs received from polls (including any given back).
    pub polled: u64,
    /// Jobs the handler completed and the gateway accepted the completion of.
    pub completed: u64,
    /// Jobs failed (by the handler's choice, its error or its panic) and accepted.
    pub failed: u64,
    /// Jobs ended with a business error, accepted.
    pub errors_thrown: u64,
    /// Jobs given back because they arrived while the worker was full and no room
    /// came in time.
    pub given_back_no_capacity: u64,
    /// Jobs that arrived while the worker was full and ran once room came.
    pub waited_for_room: u64,
    /// Jobs given back because their handler outlived the shutdown grace period.
    pub given_back_shutdown: u64,
    /// Completions, failures and error throws the gateway refused or never
    /// answered (a job that timed out meanwhile answers `NOT_FOUND` or
    /// `FAILED_PRECONDITION`); such jobs run again after their timeout.
    pub commands_failed: u64,
    /// Jobs held right now.
    pub active: u64,
    /// Whether a job stream is open right now.
    pub stream_open: bool,
    /// Job streams open right now (one per gateway the worker streams from).
    pub streams_open: u64,
    /// Credit the open streams stated, in all: never more than max jobs active.
    pub stream_credit: u64,
    /// Times the stream was opened.
    pub stream_opens: u64,
    /// Times opening or keeping the stream failed (including `UNIMPLEMENTED`).
    pub stream_failures: u64,
    /// Polls answered (with jobs or empty).
    pub polls: u64,
    /// Polls answered with no job.
    pub polls_empty: u64,
    /// Polls that failed.
    pub poll_errors: u64,
    /// How long handlers took, from the job's receipt to the handler's result.
    pub handler_duration: DurationHistogram,
}

impl WorkerMetricsSnapshot {
    /// Jobs received on both paths.
    pub fn received(&self) -> u64 {
        self.pushed + self.polled
    }

    /// Jobs whose outcome (complete, fail, throw) the gateway accepted.
    pub fn handled(&self) -> u64 {
        self.completed + self.failed + self.errors_thrown
    }
}

/// A duration histogram with the buckets of [`HANDLER_DURATION_BUCKETS`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DurationHistogram {
    /// Durations observed.
    pub count: u64,
    /// Their sum.
    pub sum: Duration,
    /// `(upper bound in seconds, durations at or below it)`, cumulative, in the
    /// order of [`HANDLER_DURATION_BUCKETS`]; `count` is the `+Inf` bucket.
    pub buckets: Vec<(f64, u64)>,
}

impl WorkerMetrics {
    /// The counters now. Each is read on its own, so a snapshot taken while jobs
    /// run may be off by the jobs in between.
    pub fn snapshot(&self) -> WorkerMetricsSnapshot {
        let c = &self.0;
        let mut cumulative = 0;
        let mut buckets = Vec::with_capacity(HANDLER_DURATION_BUCKETS.len());
        for (bound, n) in HANDLER_DURATION_BUCKETS.iter().zip(&c.handler.buckets) {
            cumulative += n.load(Relaxed);
            buckets.push((*bound, cumulative));
        }
        let count = cumulative + c.handler.buckets[HANDLER_DURATION_BUCKETS.len()].load(Relaxed);
        WorkerMetricsSnapshot {
            pushed: c.pushed.load(Relaxed),
            polled: c.polled.load(Relaxed),
            completed: c.completed.load(Relaxed),
            failed: c.failed.load(Relaxed),
            errors_thrown: c.errors_thrown.load(Relaxed),
            given_back_no_capacity: c.given_back_no_capacity.load(Relaxed),
            waited_for_room: c.waited_for_room.load(Relaxed),
            given_back_shutdown: c.given_back_shutdown.load(Relaxed),
            commands_failed: c.commands_failed.load(Relaxed),
            active: c.active.load(Relaxed),
            stream_open: c.streams_open.load(Relaxed) > 0,
            streams_open: c.streams_open.load(Relaxed),
            stream_credit: c.stream_credit.load(Relaxed).max(0) as u64,
            stream_opens: c.stream_opens.load(Relaxed),
            stream_failures: c.stream_failures.load(Relaxed),
            polls: c.polls.load(Relaxed),
            polls_empty: c.polls_empty.load(Relaxed),
            poll_errors: c.poll_errors.load(Relaxed),
            handler_duration: DurationHistogram {
                count,
                sum: Duration::from_nanos(c.handler.sum_nanos.load(Relaxed)),
                buckets,
            },
        }
    }

    pub(crate) fn received(&self, path: JobPath) {
        match path {
            JobPath::Push => &self.0.pushed,
            JobPath::Poll => &self.0.polled,
        }
        .fetch_add(1, Relaxed);
    }

    pub(crate) fn given_back(&self, why: GiveBack) {
        match why {
            GiveBack::NoCapacity => &self.0.given_back_no_capacity,
            GiveBack::Shutdown => &self.0.given_back_shutdown,
        }
        .fetch_add(1, Relaxed);
    }

    pub(crate) fn waited_for_room(&self) {
        self.0.waited_for_room.fetch_add(1, Relaxed);
    }

    pub(crate) fn completed(&self) {
        self.0.completed.fetch_add(1, Relaxed);
    }

    pub(crate) fn failed(&self) {
        self.0.failed.fetch_add(1, Relaxed);
    }

    pub(crate) fn error_thrown(&self) {
        self.0.errors_thrown.fetch_add(1, Relaxed);
    }

    pub(crate) fn command_failed(&self) {
        self.0.commands_failed.fetch_add(1, Relaxed);
    }

    /// Counts one more job held until the guard is dropped.
    pub(crate) fn holding(&self) -> ActiveGuard {
        self.0.active.fetch_add(1, Relaxed);
        ActiveGuard(self.clone())
    }

    pub(crate) fn stream_opened(&self) {
        self.0.stream_opens.fetch_add(1, Relaxed);
        self.0.streams_open.fetch_add(1, Relaxed);
    }

    /// An open stream broke.
    pub(crate) fn stream_failed(&self) {
        self.0.stream_failures.fetch_add(1, Relaxed);
        self.stream_closed();
    }

    /// The credit stated by open streams changed by `delta`.
    pub(crate) fn stream_credit(&self, delta: i64) {
        self.0.stream_credit.fetch_add(delta, Relaxed);
    }

    /// A stream could not be opened.
    pub(crate) fn stream_not_opened(&self) {
        self.0.stream_failures.fetch_add(1, Relaxed);
    }

    pub(crate) fn stream_closed(&self) {
        let _ = self
            .0
            .streams_open
            .fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1));
    }

    pub(crate) fn polled(&self, jobs: usize) {
        self.0.polls.fetch_add(1, Relaxed);
        if jobs == 0 {
            self.0.polls_empty.fetch_add(1, Relaxed);
        }
    }

    pub(crate) fn poll_failed(&self) {
        self.0.poll_errors.fetch_add(1, Relaxed);
    }

    pub(crate) fn handler_took(&self, d: Duration) {
        let h = &self.0.handler;
        let secs = d.as_secs_f64();
        let i = HANDLER_DURATION_BUCKETS
            .iter()
            .position(|bound| secs <= *bound)
            .unwrap_or(HANDLER_DURATION_BUCKETS.len());
        h.buckets[i].fetch_add(1, Relaxed);
        h.sum_nanos
            .fetch_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Relaxed);
    }
}

// Also built for unit tests (prometheus is a dev-dependency), so that a plain
// `cargo test` checks the export.
#[cfg(any(feature = "prometheus", test))]
mod export {
    use super::{WorkerMetrics, WorkerMetricsSnapshot};
    use prometheus::core::{Collector, Desc};
    use prometheus::proto::{
        Bucket, Counter, Gauge, Histogram, LabelPair, Metric, MetricFamily, MetricType,
    };
    use std::collections::HashMap;

    /// One family: its description and how to read its samples from a snapshot.
    struct Family {
        desc: Desc,
        kind: MetricType,
        /// The name of the one variable label, if any.
        label: Option<&'static str>,
        read: fn(&WorkerMetricsSnapshot) -> Vec<(&'static str, f64)>,
    }

    /// The worker's metrics as a Prometheus collector, labelled with the worker's
    /// job type and name so that several workers can share a registry.
    pub(super) struct WorkerCollector {
        metrics: WorkerMetrics,
        const_labels: Vec<LabelPair>,
        families: Vec<Family>,
        handler: Desc,
    }

    fn desc(
        name: &str,
        help: &str,
        label: Option<&'static str>,
        consts: &HashMap<String, String>,
    ) -> prometheus::Result<Desc> {
        let labels = label.map(|l| vec![l.to_string()]).unwrap_or_default();
        Desc::new(name.into(), help.into(), labels, consts.clone())
    }

    impl WorkerCollector {
        pub(super) fn new(
            metrics: WorkerMetrics,
            job_type: &str,
            worker: &str,
        ) -> prometheus::Result<Self> {
            let consts: HashMap<String, String> = [
                ("job_type".to_string(), job_type.to_string()),
                ("worker".to_string(), worker.to_string()),
            ]
            .into();
            let family = |name: &str,
                          help: &str,
                          kind: MetricType,
                          label: Option<&'static str>,
                          read: fn(&WorkerMetricsSnapshot) -> Vec<(&'static str, f64)>|
             -> prometheus::Result<Family> {
                Ok(Family {
                    desc: desc(name, help, label, &consts)?,
                    kind,
                    label,
                    read,
                })
            };
            use MetricType::{COUNTER, GAUGE};
            let families = vec![
                family(
                    "courier_worker_jobs_received_total",
                    "Jobs received, by path (push, poll)",
                    COUNTER,
                    Some("path"),
                    |s| vec![("push", s.pushed as f64), ("poll", s.polled as f64)],
                )?,
                family(
                    "courier_worker_jobs_handled_total",
                    "Jobs whose outcome the gateway accepted, by outcome",
                    COUNTER,
                    Some("outcome"),
                    |s| {
                        vec![
                            ("completed", s.completed as f64),
                            ("failed", s.failed as f64),
                            ("error_thrown", s.errors_thrown as f64),
                        ]
                    },
                )?,
                family(
                    "courier_worker_jobs_given_back_total",
                    "Jobs handed back untouched to run again at once, by reason",
                    COUNTER,
                    Some("reason"),
                    |s| {
                        vec![
                            ("no_capacity", s.given_back_no_capacity as f64),
                            ("shutdown", s.given_back_shutdown as f64),
                        ]
                    },
                )?,
                family(
                    "courier_worker_jobs_waited_for_room_total",
                    "Jobs that arrived while the worker was full and ran once a handler finished",
                    COUNTER,
                    None,
                    |s| vec![("", s.waited_for_room as f64)],
                )?,
                family(
                    "courier_worker_commands_failed_total",
                    "Completions, failures and error throws that did not go through",
                    COUNTER,
                    None,
                    |s| vec![("", s.commands_failed as f64)],
                )?,
                family(
                    "courier_worker_jobs_active",
                    "Jobs held right now",
                    GAUGE,
                    None,
                    |s| vec![("", s.active as f64)],
                )?,
                family(
                    "courier_worker_stream_open",
                    "1 while the job stream is open",
                    GAUGE,
                    None,
                    |s| vec![("", f64::from(u8::from(s.stream_open)))],
                )?,
                family(
                    "courier_worker_streams_open",
                    "Job streams open right now, one per gateway streamed from",
                    GAUGE,
                    None,
                    |s| vec![("", s.streams_open as f64)],
                )?,
                family(
                    "courier_worker_stream_credit",
                    "Credit the open job streams stated, in all (at most max jobs active)",
                    GAUGE,
                    None,
                    |s| vec![("", s.stream_credit as f64)],
                )?,
                family(
                    "courier_worker_stream_failures_total",
                    "Job streams that could not be opened or broke",
                    COUNTER,
                    None,
                    |s| vec![("", s.stream_failures as f64)],
                )?,
                family(
                    "courier_worker_polls_total",
                    "ActivateJobs polls, by result (jobs, empty, error)",
                    COUNTER,
                    Some("result"),
                    |s| {
                        vec![
                            ("jobs", (s.polls - s.polls_empty) as f64),
                            ("empty", s.polls_empty as f64),
                            ("error", s.poll_errors as f64),
                        ]
                    },
                )?,
            ];
            let handler = desc(
                "courier_worker_handler_duration_seconds",
                "Time from a job's receipt to its handler's result",
                None,
                &consts,
            )?;
            let mut const_labels: Vec<LabelPair> = consts
                .into_iter()
                .map(|(k, v)| label_pair(&k, &v))
                .collect();
            const_labels.sort_by(|a, b| a.name().cmp(b.name()));
            Ok(WorkerCollector {
                metrics,
                const_labels,
                families,
                handler,
            })
        }

        fn labels(&self, var: Option<(&str, &str)>) -> Vec<LabelPair> {
            let mut labels = self.const_labels.clone();
            if let Some((k, v)) = var {
                labels.push(label_pair(k, v));
                labels.sort_by(|a, b| a.name().cmp(b.name()));
            }
            labels
        }
    }

    fn label_pair(name: &str, value: &str) -> LabelPair {
        let mut l = LabelPair::default();
        l.set_name(name.to_string());
        l.set_value(value.to_string());
        l
    }

    impl Collector for WorkerCollector {
        fn desc(&self) -> Vec<&Desc> {
            self.families
                .iter()
                .map(|f| &f.desc)
                .chain(std::iter::once(&self.handler))
                .collect()
        }

        fn collect(&self) -> Vec<MetricFamily> {
            let s = self.metrics.snapshot();
            let mut out = Vec::with_capacity(self.families.len() + 1);
            for f in &self.families {
                let mut family = MetricFamily::default();
                family.set_name(f.desc.fq_name.clone());
                family.set_help(f.desc.help.clone());
                family.set_field_type(f.kind);
                let metrics = (f.read)(&s)
                    .into_iter()
                    .map(|(value_label, v)| {
                        let mut m =
                            Metric::from_label(self.labels(f.label.map(|l| (l, value_label))));
                        if f.kind == MetricType::GAUGE {
                            let mut g = Gauge::default();
                            g.set_value(v);
                            m.set_gauge(g);
                        } else {
                            let mut c = Counter::default();
                            c.set_value(v);
                            m.set_counter(c);
                        }
                        m
                    })
                    .collect();
                family.set_metric(metrics);
                out.push(family);
            }
            let mut h = Histogram::default();
            h.set_sample_count(s.handler_duration.count);
            h.set_sample_sum(s.handler_duration.sum.as_secs_f64());
            h.set_bucket(
                s.handler_duration
                    .buckets
                    .iter()
                    .map(|(bound, n)| {
                        let mut b = Bucket::default();
                        b.set_upper_bound(*bound);
                        b.set_cumulative_count(*n);
                        b
                    })
                    .collect(),
            );
            let mut m = Metric::from_label(self.labels(None));
            m.set_histogram(h);
            let mut family = MetricFamily::default();
            family.set_name(self.handler.fq_name.clone());
            family.set_help(self.handler.help.clone());
            family.set_field_type(MetricType::HISTOGRAM);
            family.set_metric(vec![m]);
            out.push(family);
            out
        }
    }
}

#[cfg(any(feature = "prometheus", test))]
impl WorkerMetrics {
    /// Registers these metrics (`courier_worker_*`, labelled with `job_type` and
    /// `worker`) in `registry`. Two workers with the same job type and name cannot
    /// share a registry.
    pub fn register(
        &self,
        registry: &prometheus::Registry,
        job_type: &str,
        worker: &str,
    ) -> prometheus::Result<()> {
        let collector = export::WorkerCollector::new(self.clone(), job_type, worker)?;
        registry.register(Box::new(collector))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_and_histogram_add_up() {
        let m = WorkerMetrics::default();
        m.received(JobPath::Push);
        m.received(JobPath::Push);
        m.received(JobPath::Poll);
        m.completed();
        m.failed();
        m.given_back(GiveBack::NoCapacity);
        m.waited_for_room();
        m.polled(0);
        m.polled(3);
        m.handler_took(Duration::from_micros(500));
        m.handler_took(Duration::from_millis(30));
        m.handler_took(Duration::from_secs(90));
        let s = m.snapshot();
        assert_eq!((s.pushed, s.polled, s.received()), (2, 1, 3));
        assert_eq!(s.handled(), 2);
        assert_eq!((s.given_back_no_capacity, s.waited_for_room), (1, 1));
        assert_eq!((s.polls, s.polls_empty), (2, 1));
        let h = &s.handler_duration;
        assert_eq!(h.count, 3);
        assert_eq!(
            h.sum,
            Duration::from_micros(500) + Duration::from_millis(30) + Duration::from_secs(90)
        );
        let at = |bound: f64| h.buckets.iter().find(|(b, _)| *b == bound).map(|(_, n)| *n);
        assert_eq!(at(0.001), Some(1));
        assert_eq!(at(0.025), Some(1));
        assert_eq!(at(0.05), Some(2));
        assert_eq!(at(60.0), Some(2), "90 s only in +Inf");
    }

    #[test]
    fn exported_to_a_prometheus_registry() {
        use prometheus::Encoder;
        let registry = prometheus::Registry::new();
        let (a, b) = (WorkerMetrics::default(), WorkerMetrics::default());
        assert!(a.register(&registry, "email", "w1").is_ok());
        assert!(b.register(&registry, "email", "w2").is_ok());
        assert!(a.register(&registry, "email", "w1").is_err());
        a.received(JobPath::Push);
        a.handler_took(Duration::from_millis(3));
        b.received(JobPath::Poll);
        let mut text = Vec::new();
        let encoded = prometheus::TextEncoder::new().encode(&registry.gather(), &mut text);
        assert!(encoded.is_ok());
        let text = String::from_utf8_lossy(&text);
        for line in [
            r#"courier_worker_jobs_received_total{job_type="email",path="push",worker="w1"} 1"#,
            r#"courier_worker_jobs_received_total{job_type="email",path="poll",worker="w2"} 1"#,
            r#"courier_worker_handler_duration_seconds_bucket{job_type="email",worker="w1",le="0.005"} 1"#,
            r#"courier_worker_handler_duration_seconds_count{job_type="email",worker="w1"} 1"#,
            r#"courier_worker_stream_open{job_type="email",worker="w2"} 0"#,
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
    }
}
