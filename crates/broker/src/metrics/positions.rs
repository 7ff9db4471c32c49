//! Per-replica gauges (log positions, jobs, their weight, stored payloads), read
//! from each partition when `/metrics` is scraped rather than kept up to date.

use super::{built, register};
use crate::partition::Partition;
use courier_proto::sync::lock;
use prometheus::core::Collector;
use prometheus::{IntGaugeVec, Opts};
use std::sync::{Arc, LazyLock, Mutex, Weak};

/// Every replica's last log index and last applied index, read from Raft's
/// metrics when `/metrics` is scraped rather than at every entry.
#[derive(Clone)]
pub struct Positions {
    pub(super) log: IntGaugeVec,
    pub(super) applied: IntGaugeVec,
    pub(super) jobs: IntGaugeVec,
    job_bytes: IntGaugeVec,
    job_bytes_bound: IntGaugeVec,
    stored_payloads: IntGaugeVec,
    pub(super) remembered: IntGaugeVec,
    /// The replicas, with their labels; one that is gone is dropped at the next scrape.
    replicas: Arc<Mutex<Vec<Tracked>>>,
}

/// A replica and its labels: node, partition.
type Tracked = (Weak<Partition>, [String; 2]);

impl Positions {
    /// Reports `p`'s log positions for as long as it lives.
    pub fn track(&self, p: &Arc<Partition>) {
        let labels = [p.node_id.to_string(), p.id.0.to_string()];
        lock(&self.replicas).push((Arc::downgrade(p), labels));
    }
}

impl Collector for Positions {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        let mut d = self.log.desc();
        d.extend(self.applied.desc());
        d.extend(self.jobs.desc());
        d.extend(self.job_bytes.desc());
        d.extend(self.job_bytes_bound.desc());
        d.extend(self.stored_payloads.desc());
        d.extend(self.remembered.desc());
        d
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        let mut replicas = lock(&self.replicas);
        replicas.retain(|(replica, labels)| {
            let labels = [labels[0].as_str(), labels[1].as_str()];
            let Some(p) = replica.upgrade() else {
                for g in self.gauges() {
                    let _ = g.remove_label_values(&labels);
                }
                return false;
            };
            let (jobs, bytes, stored, remembered) = p.held();
            let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
            let size = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
            self.jobs.with_label_values(&labels).set(count(jobs));
            self.job_bytes.with_label_values(&labels).set(size(bytes));
            self.job_bytes_bound
                .with_label_values(&labels)
                .set(size(p.max_bytes()));
            self.stored_payloads
                .with_label_values(&labels)
                .set(count(stored));
            self.remembered
                .with_label_values(&labels)
                .set(count(remembered));
            let m = p.raft.metrics();
            let m = m.borrow();
            let index = |i: u64| i64::try_from(i).unwrap_or(i64::MAX);
            self.log
                .with_label_values(&labels)
                .set(index(m.last_log_index.unwrap_or(0)));
            self.applied
                .with_label_values(&labels)
                .set(index(m.last_applied.map_or(0, |l| l.index)));
            true
        });
        self.gauges().iter().flat_map(|g| g.collect()).collect()
    }
}

impl Positions {
    fn gauges(&self) -> [&IntGaugeVec; 7] {
        [
            &self.log,
            &self.applied,
            &self.jobs,
            &self.job_bytes,
            &self.job_bytes_bound,
            &self.stored_payloads,
            &self.remembered,
        ]
    }
}

pub static POSITIONS: LazyLock<Positions> = LazyLock::new(|| {
    let gauge = |name, help| {
        built(IntGaugeVec::new(
            Opts::new(name, help),
            &["node", "partition"],
        ))
    };
    register(Positions {
        log: gauge(
            "courier_broker_partition_log_index",
            "The last index in this replica's Raft log of the partition",
        ),
        applied: gauge(
            "courier_broker_partition_applied_index",
            "The last log index this replica of the partition has applied: a follower behind its leader's shows how far it lags",
        ),
        jobs: gauge(
            "courier_broker_partition_jobs",
            "Jobs this replica of the partition holds, in any state (completed and canceled ones are gone)",
        ),
        job_bytes: gauge(
            "courier_broker_partition_job_bytes",
            "What the jobs of this replica of the partition weigh in memory: their text and 256 bytes each",
        ),
        job_bytes_bound: gauge(
            "courier_broker_partition_job_bytes_bound",
            "The most the jobs of a partition may weigh (--max-partition-bytes): past it creates are refused with RESOURCE_EXHAUSTED",
        ),
        stored_payloads: gauge(
            "courier_broker_partition_stored_payloads",
            "Jobs of this replica of the partition whose payload is on disk only, kept apart past --payload-memory-budget",
        ),
        remembered: gauge(
            "courier_broker_partition_remembered_requests",
            "Request ids of creates, activations, fails and thrown errors this replica remembers (2 minutes each), so that one sent again is not carried out twice",
        ),
        replicas: Arc::default(),
    })
});
