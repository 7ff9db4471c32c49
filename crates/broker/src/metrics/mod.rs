//! The broker's Prometheus metrics, in the default registry. Statics, so several
//! brokers in one process (`courier dev`) share them.

use prometheus::core::Collector;
use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
};
use std::sync::LazyLock;

mod positions;
pub use positions::POSITIONS;

/// Registers `m`; a second registration (impossible with these statics) only logs.
fn register<T: Collector + Clone + 'static>(m: T) -> T {
    if let Err(e) = prometheus::default_registry().register(Box::new(m.clone())) {
        tracing::warn!(error = %e, "metric not registered");
    }
    m
}

/// Construction fails only for an invalid constant name, which the tests rule out.
fn built<T>(r: prometheus::Result<T>) -> T {
    match r {
        Ok(m) => m,
        Err(e) => unreachable!("invalid metric definition: {e}"),
    }
}

fn latency_buckets() -> Vec<f64> {
    built(prometheus::exponential_buckets(0.0001, 2.0, 16))
}

/// Commands per proposed log entry.
pub static BATCH_SIZE: LazyLock<Histogram> = LazyLock::new(|| {
    register(built(Histogram::with_opts(
        HistogramOpts::new(
            "courier_broker_batch_commands",
            "Commands per proposed log entry",
        )
        .buckets(built(prometheus::exponential_buckets(1.0, 2.0, 12))),
    )))
});

/// Time from proposing an entry to having it committed and applied.
pub static COMMIT_SECONDS: LazyLock<Histogram> = LazyLock::new(|| {
    register(built(Histogram::with_opts(
        HistogramOpts::new(
            "courier_broker_commit_seconds",
            "Time from proposing a log entry until it is committed and applied",
        )
        .buckets(latency_buckets()),
    )))
});

/// Time of one flush of the log to disk (fdatasync) by a broker's syncer.
pub static FSYNC_SECONDS: LazyLock<Histogram> = LazyLock::new(|| {
    register(built(Histogram::with_opts(
        HistogramOpts::new(
            "courier_broker_log_fsync_seconds",
            "Time of one flush of the log to disk (fdatasync)",
        )
        .buckets(built(prometheus::exponential_buckets(0.00005, 2.0, 16))),
    )))
});

/// Time a state machine waited for its own log's flush before applying entries a
/// commit counted before they were on this replica's disk (a leader replicates its
/// entries while it flushes them).
pub static APPLY_FLUSH_WAIT_SECONDS: LazyLock<Histogram> = LazyLock::new(|| {
    register(built(Histogram::with_opts(
        HistogramOpts::new(
            "courier_broker_apply_flush_wait_seconds",
            "Time applying committed entries waited for this replica's own log flush",
        )
        .buckets(built(prometheus::exponential_buckets(0.00005, 2.0, 16))),
    )))
});

/// Time to delete the log entries a snapshot covers (in the background), per purge.
pub static PURGE_SECONDS: LazyLock<Histogram> = LazyLock::new(|| {
    register(built(Histogram::with_opts(
        HistogramOpts::new(
            "courier_broker_log_purge_seconds",
            "Time to delete the log entries a snapshot covers, in the background",
        )
        .buckets(latency_buckets()),
    )))
});

/// Time to build and write one snapshot of a partition (on a blocking thread).
pub static SNAPSHOT_SECONDS: LazyLock<Histogram> = LazyLock::new(|| {
    register(built(Histogram::with_opts(
        HistogramOpts::new(
            "courier_broker_snapshot_build_seconds",
            "Time to build and write one snapshot of a partition, in the background",
        )
        .buckets(latency_buckets()),
    )))
});

/// Log appends (of any partition) made durable by one flush: the group commit.
pub static FSYNC_APPENDS: LazyLock<Histogram> = LazyLock::new(|| {
    register(built(Histogram::with_opts(
        HistogramOpts::new(
            "courier_broker_log_fsync_appends",
            "Log appends made durable by one flush (group commit)",
        )
        .buckets(built(prometheus::exponential_buckets(1.0, 2.0, 10))),
    )))
});

/// Raft streams opened to peer brokers: one per peer, again after each break.
pub static RAFT_STREAMS_OPENED: LazyLock<IntCounter> = LazyLock::new(|| {
    register(built(IntCounter::new(
        "courier_broker_raft_streams_opened_total",
        "Raft streams opened to peer brokers (one per peer, again after each break)",
    )))
});

/// Connections to this broker's port dropped in the TLS handshake: a peer without
/// a certificate of the cluster's CA, or a plaintext client.
pub static PEERS_REFUSED: LazyLock<IntCounter> = LazyLock::new(|| {
    register(built(IntCounter::new(
        "courier_broker_tls_refused_total",
        "Connections dropped in the TLS handshake (no certificate of the cluster's CA, or plaintext)",
    )))
});

/// Counts a connection refused in the TLS handshake.
pub fn peer_refused() {
    PEERS_REFUSED.inc();
}

/// A counter of append-entries by whether they carried entries (`some`) or only a
/// heartbeat or commit index (`none`), its two series looked up once: every append
/// counts.
fn by_entries(name: &str, help: &str) -> [IntCounter; 2] {
    let vec = register(built(IntCounterVec::new(
        Opts::new(name, help),
        &["entries"],
    )));
    ["none", "some"].map(|entries| vec.with_label_values(&[entries]))
}

/// Append-entries this broker received as a follower.
static APPENDS_RECEIVED: LazyLock<[IntCounter; 2]> = LazyLock::new(|| {
    by_entries(
        "courier_broker_raft_appends_received_total",
        "Append-entries received from leaders, by whether they carried entries (some) or only a heartbeat or commit index (none)",
    )
});

/// Append-entries this broker sent as a leader.
static APPENDS_SENT: LazyLock<[IntCounter; 2]> = LazyLock::new(|| {
    by_entries(
        "courier_broker_raft_appends_sent_total",
        "Append-entries sent to followers, by whether they carried entries (some) or only a heartbeat or commit index (none)",
    )
});

/// Counts an append-entries received, with or without entries.
pub fn append_received(with_entries: bool) {
    APPENDS_RECEIVED[usize::from(with_entries)].inc();
}

/// Counts an append-entries sent, with or without entries.
pub fn append_sent(with_entries: bool) {
    APPENDS_SENT[usize::from(with_entries)].inc();
}

/// News of a commit alone that a leader left for its next message to a follower.
pub static COMMIT_NEWS_LEFT: LazyLock<IntCounter> = LazyLock::new(|| {
    register(built(IntCounter::new(
        "courier_broker_raft_commit_news_deferred_total",
        "Append-entries carrying only a new commit index that a leader did not send, leaving the news to its next message to that follower",
    )))
});

/// Times this broker noticed it had stood still (see `drive_elections`).
pub static PAUSES: LazyLock<IntCounter> = LazyLock::new(|| {
    register(built(IntCounter::new(
        "courier_broker_pauses_total",
        "Times this broker noticed it had stood still (frozen, starved of CPU) and gave its leaders a new election timeout",
    )))
});

/// Peer brokers this broker's Raft calls cannot reach now, or that do not answer.
pub static PEERS_UNREACHABLE: LazyLock<IntGauge> = LazyLock::new(|| {
    register(built(IntGauge::new(
        "courier_broker_peers_unreachable",
        "Peer brokers this broker's Raft calls cannot reach now, or that do not answer them",
    )))
});

/// Raft calls to peer brokers that could not reach them or got no answer.
pub static PEER_CALLS_UNREACHABLE: LazyLock<IntCounter> = LazyLock::new(|| {
    register(built(IntCounter::new(
        "courier_broker_peer_calls_unreachable_total",
        "Raft calls to peer brokers that could not reach them or got no answer",
    )))
});

/// Partitions a leader tried to hand to a follower (it was asked to stop, or
/// handed the partition back to its preferred leader), by outcome: handed_over,
/// no_follower_caught_up, refused (the follower would not stand), not_taken_over
/// (no new leader in time).
pub static HANDOFFS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register(built(IntCounterVec::new(
        Opts::new(
            "courier_broker_leadership_handoffs_total",
            "Partitions a leader tried to hand to a follower (stopping, or rebalancing), by outcome",
        ),
        &["outcome"],
    )))
});

/// Partitions this broker led in place of their preferred leader and tried to hand
/// back to it once it was back, by outcome: handed_over, kept (it leads on).
pub static REBALANCES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register(built(IntCounterVec::new(
        Opts::new(
            "courier_broker_leadership_rebalances_total",
            "Partitions handed back to their preferred leader, by outcome",
        ),
        &["outcome"],
    )))
});

/// Requests of a leader handing a partition over to stand for election, by
/// outcome: started, refused.
pub static ELECTIONS_ASKED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register(built(IntCounterVec::new(
        Opts::new(
            "courier_broker_elections_asked_total",
            "Requests of a leader handing a partition over to stand for election, by outcome",
        ),
        &["outcome"],
    )))
});

/// Commands refused before or during replication, by reason.
pub static REJECTED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register(built(IntCounterVec::new(
        Opts::new(
            "courier_broker_commands_rejected_total",
            "Commands refused before or during replication, by reason",
        ),
        &["reason"],
    )))
});

/// Requests served by the broker API, by kind and outcome.
pub static REQUESTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register(built(IntCounterVec::new(
        Opts::new(
            "courier_broker_requests_total",
            "Requests served by the broker API, by kind and outcome",
        ),
        &["kind", "outcome"],
    )))
});

/// Time to serve a broker API request, by kind.
pub static REQUEST_SECONDS: LazyLock<HistogramVec> = LazyLock::new(|| {
    register(built(HistogramVec::new(
        HistogramOpts::new(
            "courier_broker_request_seconds",
            "Time to serve a broker API request, by kind",
        )
        .buckets(latency_buckets()),
        &["kind"],
    )))
});

/// 1 where this broker leads the partition, 0 where it does not.
pub static LEADER: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    register(built(IntGaugeVec::new(
        Opts::new(
            "courier_broker_partition_leader",
            "1 where this broker leads the partition",
        ),
        &["node", "partition"],
    )))
});

/// 1 where this broker leads the partition without a majority: it has heard from
/// too few of its replicas for a while and refuses commands.
pub static MAJORITY_LOST: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    register(built(IntGaugeVec::new(
        Opts::new(
            "courier_broker_partition_majority_lost",
            "1 where this broker leads the partition but has lost its majority",
        ),
        &["node", "partition"],
    )))
});

/// Snapshots asked for by the bytes written to a log (see `compaction`).
pub static SIZE_SNAPSHOTS: LazyLock<IntCounter> = LazyLock::new(|| {
    register(built(IntCounter::new(
        "courier_broker_size_snapshots_total",
        "Snapshots asked for because a log had --snapshot-every-bytes written since the last",
    )))
});

/// Snapshots from a leader refused because they could not be decoded.
pub static SNAPSHOTS_REFUSED: LazyLock<IntCounter> = LazyLock::new(|| {
    register(built(IntCounter::new(
        "courier_broker_snapshots_refused_total",
        "Snapshots sent by a leader and refused because they could not be decoded",
    )))
});

/// 1 once this broker's storage failed (a write or fdatasync): its replicas are
/// stopped until it is restarted (see `failstop`).
pub static STORAGE_FAILED: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    register(built(IntGaugeVec::new(
        Opts::new(
            "courier_broker_storage_failed",
            "1 once this broker's storage failed and its replicas stopped for good",
        ),
        &["node"],
    )))
});

/// Gateway links open on this broker.
pub static LINKS: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    register(built(IntGaugeVec::new(
        Opts::new(
            "courier_broker_gateway_links",
            "Gateway links open on this broker",
        ),
        &["node"],
    )))
});

/// Aggregated streams registered on this broker (one per gateway and stream).
pub static STREAMS: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    register(built(IntGaugeVec::new(
        Opts::new(
            "courier_broker_registered_streams",
            "Aggregated streams registered by gateways on this broker",
        ),
        &["node"],
    )))
});

/// Jobs a partition leader pushed whose activation has not ended yet: the ones whose
/// end it will tell the gateway holding them about.
pub static PUSHED_HELD: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    register(built(IntGaugeVec::new(
        Opts::new(
            "courier_broker_pushed_jobs_active",
            "Pushed jobs whose activation has not ended, per partition led here",
        ),
        &["node", "partition"],
    )))
});

/// Ends of pushed jobs' activations: told to the gateway holding the job ("sent"), or
/// not, because that gateway sent the command that ended it ("sender").
pub static FINISHED_NOTICES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register(built(IntCounterVec::new(
        Opts::new(
            "courier_broker_finished_notices_total",
            "Ends of pushed jobs' activations, by whether the holding gateway was told",
        ),
        &["outcome"],
    )))
});

/// Push attempts by outcome: accepted, refused (with the gateway's reason), unknown.
pub static PUSHES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register(built(IntCounterVec::new(
        Opts::new(
            "courier_broker_push_attempts_total",
            "Push attempts by outcome (accepted, refused_<reason>, unknown)",
        ),
        &["outcome"],
    )))
});

/// A refused push tried on the next recipient of the same logical stream.
pub static TRY_NEXT: LazyLock<IntCounter> = LazyLock::new(|| {
    register(built(IntCounter::new(
        "courier_broker_push_try_next_total",
        "Refused pushes tried on another recipient of the same logical stream",
    )))
});

/// Jobs given back to the log after every recipient refused them, or by a gateway.
pub static YIELDS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register(built(IntCounterVec::new(
        Opts::new(
            "courier_broker_yields_total",
            "Pushed jobs given back to their partition, by source: all_refused (every recipient refused them), gateway (accepted, then no client took them), left_to_timeout (too close to their deadline to yield)",
        ),
        &["source"],
    )))
});

/// Push activations of earlier leaders a new leader checked with the gateways, and
/// activations handed out through a gateway that did not come back, by outcome:
/// `held` (a gateway has it), `yielded` (it never arrived: activatable again),
/// `gateway_gone` (its gateway is gone: activatable again), `unanswered` (left to
/// its activation deadline).
pub static RECONCILED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register(built(IntCounterVec::new(
        Opts::new(
            "courier_broker_reconciled_pushes_total",
            "Pushes of earlier leaders a new leader checked with their gateway, by outcome (held, yielded, gateway_gone, unanswered)",
        ),
        &["outcome"],
    )))
});

/// Jobs pushed from the activatable backlog to a stream.
pub static BACKFILLED: LazyLock<IntCounter> = LazyLock::new(|| {
    register(built(IntCounter::new(
        "courier_broker_backfilled_jobs_total",
        "Jobs activated from the backlog for a newly available stream",
    )))
});

/// Jobs handed out whose payload the leader read from the store (it was kept
/// apart, past the partition's payload budget).
pub static STORED_PAYLOADS_READ: LazyLock<IntCounter> = LazyLock::new(|| {
    register(built(IntCounter::new(
        "courier_broker_stored_payloads_read_total",
        "Jobs handed out whose payload the leader read from disk, as it was kept apart past --payload-memory-budget",
    )))
});

/// Creates, activations, fails and thrown errors sent again (a gateway's resend
/// after a failover lost the first answer) that a partition answered as it did the
/// first attempt, instead of carrying them out again.
pub static REPEATS: LazyLock<IntCounter> = LazyLock::new(|| {
    register(built(IntCounter::new(
        "courier_broker_repeated_commands_total",
        "Creates, activations, fails and thrown errors sent again after a failover, answered as their first attempt was instead of carried out again",
    )))
});

/// Times a gateway link fell behind the "jobs available" notices, so the skipped
/// ones were replaced by one notice per type with activatable jobs.
pub static NOTICE_CATCH_UPS: LazyLock<IntCounter> = LazyLock::new(|| {
    register(built(IntCounter::new(
        "courier_broker_notice_catch_ups_total",
        "Gateway links that fell behind the jobs-available notices and were sent one per activatable type instead",
    )))
});

/// Activate commands answered with no job from the leader's applied state, without
/// a log entry, by reason: `nothing` activatable of the type, or every such job
/// `claimed` by activations in flight.
pub static EMPTY_ACTIVATIONS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register(built(IntCounterVec::new(
        Opts::new(
            "courier_broker_empty_activations_total",
            "Activate requests answered empty by the leader without a log entry, by reason (nothing activatable; all claimed by activations in flight)",
        ),
        &["reason"],
    )))
});

/// From proposing a create to sending the activated job to a gateway.
pub static CREATE_TO_PUSH: LazyLock<Histogram> = LazyLock::new(|| {
    register(built(Histogram::with_opts(
        HistogramOpts::new(
            "courier_broker_create_to_push_seconds",
            "From proposing a job's creation to sending it to a gateway, on the leader",
        )
        .buckets(latency_buckets()),
    )))
});

/// The label values of the broker's labelled counters, each named once: the places
/// that count use these, and [`init`] puts every one on `/metrics` at 0.
pub mod label {
    /// The `outcome` of `courier_broker_leadership_handoffs_total`.
    pub mod handoff {
        pub const HANDED_OVER: &str = "handed_over";
        pub const NO_FOLLOWER_CAUGHT_UP: &str = "no_follower_caught_up";
        pub const REFUSED: &str = "refused";
        pub const NOT_TAKEN_OVER: &str = "not_taken_over";
        pub const ALL: [&str; 4] = [HANDED_OVER, NO_FOLLOWER_CAUGHT_UP, REFUSED, NOT_TAKEN_OVER];
    }
    /// The `outcome` of `courier_broker_leadership_rebalances_total`.
    pub mod rebalance {
        pub const HANDED_OVER: &str = "handed_over";
        pub const KEPT: &str = "kept";
        pub const ALL: [&str; 2] = [HANDED_OVER, KEPT];
    }
    /// The `outcome` of `courier_broker_elections_asked_total`.
    pub mod election_asked {
        pub const STARTED: &str = "started";
        pub const REFUSED: &str = "refused";
        pub const ALL: [&str; 2] = [STARTED, REFUSED];
    }
    /// The `reason` of `courier_broker_commands_rejected_total`.
    pub mod rejected {
        pub const QUEUE_FULL: &str = "queue_full";
        pub const NOT_COMMITTED: &str = "not_committed";
        /// A create past the partition's `--max-partition-bytes`.
        pub const PARTITION_FULL: &str = "partition_full";
        pub const ALL: [&str; 3] = [QUEUE_FULL, NOT_COMMITTED, PARTITION_FULL];
    }
    /// The `outcome` of `courier_broker_finished_notices_total`.
    pub mod finished_notice {
        pub const SENT: &str = "sent";
        pub const SENDER: &str = "sender";
        pub const ALL: [&str; 2] = [SENT, SENDER];
    }
    /// The `outcome` of `courier_broker_push_attempts_total`, besides `refused_<reason>`.
    pub mod push {
        pub const ACCEPTED: &str = "accepted";
        pub const UNKNOWN: &str = "unknown";
        pub const ALL: [&str; 2] = [ACCEPTED, UNKNOWN];
    }
    /// The `source` of `courier_broker_yields_total`.
    pub mod yield_source {
        pub const ALL_REFUSED: &str = "all_refused";
        pub const GATEWAY: &str = "gateway";
        pub const LEFT_TO_TIMEOUT: &str = "left_to_timeout";
        pub const ALL: [&str; 3] = [ALL_REFUSED, GATEWAY, LEFT_TO_TIMEOUT];
    }
    /// The `outcome` of `courier_broker_reconciled_pushes_total`.
    pub mod reconciled {
        pub const HELD: &str = "held";
        pub const YIELDED: &str = "yielded";
        pub const GATEWAY_GONE: &str = "gateway_gone";
        pub const LEFT_TO_TIMEOUT: &str = "left_to_timeout";
        pub const UNANSWERED: &str = "unanswered";
        pub const ALL: [&str; 5] = [HELD, YIELDED, GATEWAY_GONE, LEFT_TO_TIMEOUT, UNANSWERED];
    }
    /// The `reason` of `courier_broker_empty_activations_total`.
    pub mod empty_activation {
        pub const NOTHING: &str = "nothing";
        pub const CLAIMED: &str = "claimed";
        pub const ALL: [&str; 2] = [NOTHING, CLAIMED];
    }
}

/// Puts every broker metric on `/metrics` from the start: each counter with every
/// label value it can have at 0, so a graph or an alert on rates sees 0 before the
/// first event, not an absent series (the partition and link gauges appear with
/// the partitions and links they describe).
pub fn init() {
    for h in [
        &BATCH_SIZE,
        &COMMIT_SECONDS,
        &FSYNC_SECONDS,
        &APPLY_FLUSH_WAIT_SECONDS,
        &PURGE_SECONDS,
        &SNAPSHOT_SECONDS,
        &FSYNC_APPENDS,
        &CREATE_TO_PUSH,
    ] {
        LazyLock::force(h);
    }
    for c in [
        &RAFT_STREAMS_OPENED,
        &PEERS_REFUSED,
        &COMMIT_NEWS_LEFT,
        &PAUSES,
        &PEER_CALLS_UNREACHABLE,
        &TRY_NEXT,
        &BACKFILLED,
        &REPEATS,
        &STORED_PAYLOADS_READ,
        &NOTICE_CATCH_UPS,
        &SIZE_SNAPSHOTS,
        &SNAPSHOTS_REFUSED,
    ] {
        LazyLock::force(c);
    }
    LazyLock::force(&PEERS_UNREACHABLE);
    LazyLock::force(&APPENDS_RECEIVED);
    LazyLock::force(&APPENDS_SENT);
    LazyLock::force(&REQUEST_SECONDS);
    LazyLock::force(&POSITIONS);
    let refused = courier_proto::push_refusal::ALL.map(|r| format!("refused_{r}"));
    let labelled: [(&IntCounterVec, &[&str]); 10] = [
        (&HANDOFFS, &label::handoff::ALL),
        (&REBALANCES, &label::rebalance::ALL),
        (&ELECTIONS_ASKED, &label::election_asked::ALL),
        (&REJECTED, &label::rejected::ALL),
        (&FINISHED_NOTICES, &label::finished_notice::ALL),
        (&PUSHES, &label::push::ALL),
        (&PUSHES, &refused.each_ref().map(String::as_str)),
        (&YIELDS, &label::yield_source::ALL),
        (&RECONCILED, &label::reconciled::ALL),
        (&EMPTY_ACTIVATIONS, &label::empty_activation::ALL),
    ];
    for (counter, values) in labelled {
        for v in values {
            counter.with_label_values(&[v]).inc_by(0);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_metric_is_well_defined_and_registered() {
        super::BATCH_SIZE.observe(1.0);
        super::COMMIT_SECONDS.observe(0.001);
        super::REJECTED.with_label_values(&["x"]).inc();
        super::REQUESTS.with_label_values(&["x", "ok"]).inc();
        super::REQUEST_SECONDS
            .with_label_values(&["x"])
            .observe(0.1);
        super::LEADER.with_label_values(&["1", "1"]).set(1);
        super::LINKS.with_label_values(&["1"]).set(0);
        super::STREAMS.with_label_values(&["1"]).set(0);
        super::FINISHED_NOTICES.with_label_values(&["sent"]).inc();
        super::PUSHED_HELD.with_label_values(&["1", "1"]).set(0);
        super::PUSHES.with_label_values(&["accepted"]).inc();
        super::TRY_NEXT.inc();
        super::YIELDS.with_label_values(&["gateway"]).inc();
        super::BACKFILLED.inc();
        super::NOTICE_CATCH_UPS.inc();
        super::REPEATS.inc_by(0);
        super::RECONCILED.with_label_values(&["held"]).inc();
        super::EMPTY_ACTIVATIONS
            .with_label_values(&["claimed"])
            .inc();
        super::CREATE_TO_PUSH.observe(0.001);
        super::PEERS_UNREACHABLE.add(0);
        super::PEER_CALLS_UNREACHABLE.inc_by(0);
        super::append_received(false);
        super::append_sent(false);
        super::COMMIT_NEWS_LEFT.inc_by(0);
        super::POSITIONS.log.with_label_values(&["7", "1"]).set(12);
        super::POSITIONS
            .applied
            .with_label_values(&["7", "1"])
            .set(10);
        super::POSITIONS.jobs.with_label_values(&["7", "1"]).set(3);
        super::POSITIONS
            .remembered
            .with_label_values(&["7", "1"])
            .set(2);
        let names: Vec<String> = prometheus::gather()
            .iter()
            .map(|f| f.name().to_string())
            .collect();
        for n in [
            "courier_broker_batch_commands",
            "courier_broker_commit_seconds",
            "courier_broker_raft_appends_received_total",
            "courier_broker_raft_appends_sent_total",
            "courier_broker_raft_commit_news_deferred_total",
            "courier_broker_partition_log_index",
            "courier_broker_partition_applied_index",
            "courier_broker_partition_jobs",
            "courier_broker_partition_remembered_requests",
            "courier_broker_partition_leader",
            "courier_broker_pushed_jobs_active",
            "courier_broker_peers_unreachable",
            "courier_broker_peer_calls_unreachable_total",
            "courier_broker_repeated_commands_total",
        ] {
            assert!(names.iter().any(|x| x == n), "{n} missing from {names:?}");
        }
    }

    /// Every counter a person would graph is on `/metrics` once the broker starts,
    /// each label value at 0, before anything happened.
    #[test]
    fn init_puts_every_counter_on_metrics_with_each_label_value() {
        super::init();
        let families = prometheus::gather();
        let series = |name: &str| -> Vec<String> {
            families
                .iter()
                .filter(|f| f.name() == name)
                .flat_map(|f| f.get_metric())
                .map(|m| {
                    m.get_label()
                        .iter()
                        .map(|l| l.value())
                        .collect::<Vec<_>>()
                        .join(",")
                })
                .collect()
        };
        for name in [
            "courier_broker_push_try_next_total",
            "courier_broker_backfilled_jobs_total",
            "courier_broker_create_to_push_seconds",
            "courier_broker_snapshot_build_seconds",
            "courier_broker_raft_streams_opened_total",
            "courier_broker_pauses_total",
            "courier_broker_notice_catch_ups_total",
        ] {
            assert_eq!(series(name).len(), 1, "{name}");
        }
        let pushes = series("courier_broker_push_attempts_total");
        for outcome in [
            "accepted",
            "unknown",
            "refused_no_client",
            "refused_clients_full",
            "refused_gateway_full",
            "refused_unknown_stream",
            "refused_disowned",
        ] {
            assert!(pushes.iter().any(|p| p == outcome), "{outcome}: {pushes:?}");
        }
        for (name, n) in [
            ("courier_broker_yields_total", 3),
            ("courier_broker_reconciled_pushes_total", 5),
            ("courier_broker_leadership_handoffs_total", 4),
            ("courier_broker_leadership_rebalances_total", 2),
            ("courier_broker_empty_activations_total", 2),
            ("courier_broker_finished_notices_total", 2),
            ("courier_broker_raft_appends_received_total", 2),
            ("courier_broker_raft_appends_sent_total", 2),
        ] {
            assert_eq!(series(name).len(), n, "{name}: {:?}", series(name));
        }
    }
}
