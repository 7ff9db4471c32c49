//! A broker's static configuration and the placement of partition replicas.

use crate::store::Durability;
use courier_proto::domain::{replicas_of, NodeId};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// Everything a broker needs to know at start.
#[derive(Clone, Debug)]
pub struct BrokerConfig {
    pub node_id: NodeId,
    /// Every broker of the cluster (this one included) and the address it is reached at.
    pub brokers: BTreeMap<NodeId, String>,
    pub partitions: u32,
    pub replication_factor: u32,
    pub data_dir: PathBuf,
    pub durability: Durability,
    pub raft: RaftTuning,
    /// How long a gateway may be gone (no link to this broker) before the leaders
    /// here make the jobs handed out through it runnable again: their results cannot
    /// come back through it, but a worker still running one may then run it a
    /// second time. `None`: they wait for their activation timeouts, as in Zeebe.
    pub lost_gateway_grace: Option<Duration>,
    /// Whether a leader hands its partitions to up-to-date followers when it is
    /// asked to stop (SIGTERM, Ctrl-C), so they are back in milliseconds rather than
    /// after an election. Off where every broker stops at once (`courier dev`).
    pub hand_off_leadership: bool,
    /// How long a partition's preferred replica (the first of its placement, see
    /// [`BrokerConfig::replicas`]) must have been reachable and caught up before
    /// the broker leading the partition in its place hands the leadership back to
    /// it, so that leaders spread out again after a failure or a rolling restart.
    /// `None`: leadership stays where elections put it.
    pub rebalance_after: Option<Duration>,
    /// Mutual TLS inside the cluster: with it, this broker's port takes only
    /// connections that present a certificate of the cluster's CA, and it presents
    /// its own to its peers. `None`: plaintext, open to anyone who can reach it.
    pub cluster_tls: Option<courier_proto::tls::ClusterTls>,
    /// What a partition replica holds in memory.
    pub memory: Memory,
}

/// What a partition replica holds in memory: what its jobs weigh (their text and a
/// fixed share each, see [`crate::engine::held_bytes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Memory {
    /// Past this weight a new job's payload (variables and custom headers) is kept
    /// on disk only, and read when the job is handed out or shown.
    pub payload_budget: u64,
    /// Past this weight a leader refuses creates with RESOURCE_EXHAUSTED until jobs
    /// end: back pressure on producers instead of every replica running out of
    /// memory.
    pub max_partition_bytes: u64,
}

impl Default for Memory {
    fn default() -> Memory {
        Memory {
            payload_budget: DEFAULT_PAYLOAD_BUDGET,
            max_partition_bytes: DEFAULT_MAX_PARTITION_BYTES,
        }
    }
}

/// The default of [`Memory::payload_budget`].
pub const DEFAULT_PAYLOAD_BUDGET: u64 = 256 * 1024 * 1024;

/// The default of [`BrokerConfig::lost_gateway_grace`].
pub const DEFAULT_LOST_GATEWAY_GRACE: Duration = Duration::from_secs(10);

/// The default of [`Memory::max_partition_bytes`].
pub const DEFAULT_MAX_PARTITION_BYTES: u64 = 512 * 1024 * 1024;

/// The default of [`BrokerConfig::rebalance_after`].
pub const DEFAULT_REBALANCE_AFTER: Duration = Duration::from_secs(10);

/// Raft timing and log compaction.
#[derive(Clone, Debug)]
pub struct RaftTuning {
    /// Also the AppendEntries timeout in openraft 0.9: size it above the disk's fsync time.
    pub heartbeat_ms: u64,
    pub election_timeout_min_ms: u64,
    pub election_timeout_max_ms: u64,
    /// A snapshot is built after this many entries since the last one, plus a
    /// share of up to half again per partition and broker (`snapshot_threshold`).
    pub snapshot_every: u64,
    /// Entries kept behind a snapshot for followers that lag a little.
    pub keep_after_snapshot: u64,
    /// A snapshot is also built once this many bytes of entries were written since
    /// the last one that size asked for: a log of large entries is compacted before
    /// it fills the disk, whatever their number.
    pub snapshot_every_bytes: u64,
}

impl Default for RaftTuning {
    fn default() -> Self {
        RaftTuning {
            // Also openraft 0.9's AppendEntries timeout: a loaded follower on 2 cores
            // (decode, fsync, answer) must fit, or replication retries forever.
            heartbeat_ms: 150,
            // A follower of openraft 0.9 stands for election once it has not heard
            // from its leader for the leader's lease (the longest timeout) and an
            // election timeout: 0.9-1.2 s here, six heartbeats at least, so a dead
            // leader's partitions are pushing again within 2 s.
            election_timeout_min_ms: 300,
            election_timeout_max_ms: 600,
            snapshot_every: 20_000,
            keep_after_snapshot: 1000,
            snapshot_every_bytes: 256 * 1024 * 1024,
        }
    }
}

/// What is wrong with a broker's configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("node id {node} is not among the brokers {brokers:?}")]
    NotAmongBrokers { node: NodeId, brokers: Vec<NodeId> },
    #[error("the cluster needs at least 1 partition")]
    NoPartitions,
    #[error("{0} partitions is more than job keys can name (at most {max})", max = courier_proto::domain::MAX_PARTITIONS)]
    TooManyPartitions(u32),
    #[error("replication factor {factor} must be between 1 and the number of brokers ({brokers})")]
    ReplicationFactor { factor: u32, brokers: u32 },
    #[error("raft: {0}")]
    Raft(String),
}

impl BrokerConfig {
    /// Checks the configuration.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !self.brokers.contains_key(&self.node_id) {
            return Err(ConfigError::NotAmongBrokers {
                node: self.node_id,
                brokers: self.brokers.keys().copied().collect(),
            });
        }
        if self.partitions < 1 {
            return Err(ConfigError::NoPartitions);
        }
        if self.partitions > courier_proto::domain::MAX_PARTITIONS {
            return Err(ConfigError::TooManyPartitions(self.partitions));
        }
        let n = self.brokers.len() as u32;
        if self.replication_factor < 1 || self.replication_factor > n {
            return Err(ConfigError::ReplicationFactor {
                factor: self.replication_factor,
                brokers: n,
            });
        }
        Ok(())
    }

    /// What a data directory records of the cluster it belongs to (see
    /// [`crate::store::check_shape`]): this broker's id, every broker's id, the
    /// partitions and the replication factor. Addresses may change between runs.
    pub fn shape(&self) -> String {
        let ids: Vec<NodeId> = self.brokers.keys().copied().collect();
        format!(
            "node {} of brokers {ids:?}, {} partitions, replication factor {}",
            self.node_id, self.partitions, self.replication_factor
        )
    }

    /// The replica that should lead `partition` when it can: the first of its
    /// placement. Placement starts each partition on the next broker, so the
    /// preferred leaders spread evenly over the brokers.
    pub fn preferred_leader(&self, partition: u32) -> Option<NodeId> {
        self.replicas(partition).first().copied()
    }

    /// The brokers holding `partition`, round-robin over brokers ordered by id
    /// ([`replicas_of`]).
    pub fn replicas(&self, partition: u32) -> Vec<NodeId> {
        let ids: Vec<NodeId> = self.brokers.keys().copied().collect();
        replicas_of(&ids, partition, self.replication_factor)
    }

    /// Entries between two snapshots of `partition` on this broker: `snapshot_every`
    /// plus up to half of it again, a different share for every (partition, broker).
    /// Under even load every partition reaches the same log length at the same
    /// moment, and with one threshold all of them (on every replica) built a snapshot
    /// and purged their logs at once: on two cores that stalled every commit for a
    /// few hundred milliseconds.
    pub fn snapshot_threshold(&self, partition: u32) -> u64 {
        let every = self.raft.snapshot_every.max(1);
        let brokers = self.brokers.len().max(1) as u64;
        let position = self
            .brokers
            .keys()
            .position(|&id| id == self.node_id)
            .unwrap_or(0) as u64;
        let slots = brokers * u64::from(self.partitions.max(1));
        let slot = u64::from(partition.saturating_sub(1)) * brokers + position;
        every + every * (slot % slots) / (2 * slots)
    }

    /// openraft's configuration for `partition` on this broker.
    pub fn raft_config(&self, partition: u32) -> openraft::Config {
        openraft::Config {
            cluster_name: "courier".into(),
            heartbeat_interval: self.raft.heartbeat_ms,
            election_timeout_min: self.raft.election_timeout_min_ms,
            election_timeout_max: self.raft.election_timeout_max_ms,
            install_snapshot_timeout: 5_000,
            // Entries are batches of up to ~1 MiB: a few per AppendEntries keeps one
            // well inside its timeout (the heartbeat interval).
            max_payload_entries: 4,
            snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(
                self.snapshot_threshold(partition),
            ),
            max_in_snapshot_log_to_keep: self.raft.keep_after_snapshot,
            // Elections are started by the broker (`drive_elections`), which tells
            // a silent leader from a pause of its own process.
            enable_elect: false,
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(n: u64, rf: u32) -> BrokerConfig {
        BrokerConfig {
            node_id: 1,
            brokers: (1..=n)
                .map(|i| (i, format!("127.0.0.1:{}", 26600 + i)))
                .collect(),
            partitions: 3,
            replication_factor: rf,
            data_dir: PathBuf::from("x"),
            durability: Durability::Fsync,
            raft: RaftTuning::default(),
            lost_gateway_grace: Some(DEFAULT_LOST_GATEWAY_GRACE),
            hand_off_leadership: true,
            rebalance_after: Some(DEFAULT_REBALANCE_AFTER),
            cluster_tls: None,
            memory: Memory::default(),
        }
    }

    #[test]
    fn replicas_are_placed_round_robin() {
        let c = config(3, 3);
        assert_eq!(c.replicas(1), vec![1, 2, 3]);
        assert_eq!(c.replicas(2), vec![2, 3, 1]);
        assert_eq!(c.replicas(3), vec![3, 1, 2]);
        let preferred: Vec<_> = (1..=6).map(|p| c.preferred_leader(p)).collect();
        assert_eq!(preferred, [1, 2, 3, 1, 2, 3].map(Some));
        let c = config(3, 1);
        assert_eq!(c.replicas(1), vec![1]);
        assert_eq!(c.replicas(2), vec![2]);
        assert_eq!(c.replicas(4), vec![1]);
    }

    #[test]
    fn bad_configurations_are_refused_with_a_reason() {
        assert!(config(3, 3).validate().is_ok());
        assert_eq!(
            config(3, 4).validate(),
            Err(ConfigError::ReplicationFactor {
                factor: 4,
                brokers: 3
            })
        );
        let mut c = config(3, 1);
        c.node_id = 9;
        let e = c.validate().unwrap_err();
        assert!(e.to_string().contains("node id 9"), "{e}");
        c.node_id = 1;
        c.partitions = 0;
        assert_eq!(c.validate(), Err(ConfigError::NoPartitions));
        c.partitions = courier_proto::domain::MAX_PARTITIONS;
        assert!(c.validate().is_ok());
        let last =
            courier_proto::domain::JobKey::new(courier_proto::domain::PartitionId(c.partitions), 1);
        assert_eq!(
            last.partition(),
            Some(courier_proto::domain::PartitionId(c.partitions))
        );
        c.partitions += 1;
        assert_eq!(
            c.validate(),
            Err(ConfigError::TooManyPartitions(c.partitions))
        );
        assert!(config(3, 3).raft_config(1).validate().is_ok());
    }

    /// No two (partition, broker) pairs snapshot after the same number of entries,
    /// and none waits longer than one and a half times the configured interval.
    #[test]
    fn snapshot_thresholds_are_staggered() {
        let mut c = config(3, 3);
        c.partitions = 3;
        c.raft.snapshot_every = 20_000;
        let mut seen = std::collections::BTreeSet::new();
        for node in 1..=3 {
            c.node_id = node;
            for p in 1..=3 {
                let t = c.snapshot_threshold(p);
                assert!((20_000..30_000).contains(&t), "{t}");
                assert!(seen.insert(t), "threshold {t} repeated");
            }
        }
        assert_eq!(seen.first(), Some(&20_000));
    }
}
