//! The gateway's learned view of the cluster: membership, partition count, who leads
//! each partition, and one lazily connected channel per broker address.
//!
//! The view is rebuilt from every broker's own report on each refresh round, so it
//! never drifts from what the brokers say for longer than one round. Between rounds,
//! NotLeader hints from the router patch it, because the broker that refused a request
//! knows better than a view up to `topology_refresh` old.

use crate::error::GatewayError;
use crate::metrics;
use courier_proto::api::{BrokerApi, Connect};
use courier_proto::cluster::BrokerTopology;
use courier_proto::domain::{NodeId, PartitionId};
use courier_proto::sync::{lock, read_lock, write_lock};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tokio::sync::{watch, Notify};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Bound on one broker's Topology answer; a broker slower than this counts as down
/// for the round.
const TOPOLOGY_CALL_TIMEOUT: Duration = Duration::from_secs(1);
/// Least time between two refresh rounds, so a burst of routing failures asking for
/// a refresh does not turn into a burst of Topology calls.
const MIN_REFRESH_GAP: Duration = Duration::from_millis(50);

/// Who leads a partition, and in which Raft term the gateway learned it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Leader {
    /// The leading broker.
    pub node: NodeId,
    /// The term of the report that named it; a hint keeps the term it replaced.
    pub term: u64,
}

/// One partition as a broker reported it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartitionReport {
    /// The partition.
    pub partition: PartitionId,
    /// The broker's role for it: "leader", "follower", "candidate", "learner", "shutdown".
    pub role: String,
    /// A leader that has lost its majority (it cannot commit).
    pub majority_lost: bool,
}

/// A snapshot of what the gateway knows about the cluster.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterView {
    /// Every broker of the static membership, by id, with its address.
    pub members: BTreeMap<NodeId, String>,
    /// Partitions are numbered `1..=partitions_count`; 0 until a broker answered.
    pub partitions_count: u32,
    /// Replicas per partition.
    pub replication_factor: u32,
    /// The partitions each broker reported in the last round; a broker that did not
    /// answer has no entry.
    pub reports: BTreeMap<NodeId, Vec<PartitionReport>>,
    /// The version each broker last reported (kept while it does not answer).
    pub versions: BTreeMap<NodeId, String>,
    /// The brokers whose storage failed, as they said in the last round, with what
    /// failed: their replicas are stopped until they are restarted.
    pub storage_failures: BTreeMap<NodeId, String>,
    /// The known leader of each partition.
    pub leaders: HashMap<PartitionId, Leader>,
    /// Since when each partition without a known leader has had none.
    pub leaderless_since: HashMap<PartitionId, Instant>,
}

impl ClusterView {
    /// Folds in one refresh round: `answers` are the reports of the brokers that
    /// replied. Membership only grows (it is static); everything else is replaced.
    pub fn merge_round(&mut self, answers: &[BrokerTopology]) {
        self.reports.clear();
        self.storage_failures.clear();
        for a in answers {
            if !a.storage_failure.is_empty() {
                self.storage_failures
                    .insert(a.node_id, a.storage_failure.clone());
            }
            for b in &a.brokers {
                self.members.insert(b.node_id, b.addr.clone());
            }
            self.partitions_count = self.partitions_count.max(a.partitions_count);
            self.replication_factor = self.replication_factor.max(a.replication_factor);
            let parts = a
                .partitions
                .iter()
                .map(|p| PartitionReport {
                    partition: PartitionId(p.partition_id),
                    role: p.role.clone(),
                    majority_lost: p.majority_lost,
                })
                .collect();
            self.reports.insert(a.node_id, parts);
            self.versions.insert(a.node_id, a.version.clone());
        }
        // A leader that announced itself in a later term than the round saw (whose
        // answers were gathered before it won) stays.
        self.leaders = elect(answers)
            .into_iter()
            .map(|(p, l)| match self.leaders.get(&p) {
                Some(known) if known.term > l.term => (p, *known),
                _ => (p, l),
            })
            .collect();
        self.note_leaderless();
    }

    /// Applies a broker's own word that it leads `partition` in `term` (a `Leading`
    /// link message): it becomes the leader unless one of a later term is known.
    /// Returns whether the leader changed.
    pub fn claim(&mut self, partition: PartitionId, node: NodeId, term: u64) -> bool {
        if self.leaders.get(&partition).is_some_and(|l| l.term > term) {
            return false;
        }
        let changed = self.leaders.get(&partition).map(|l| l.node) != Some(node);
        self.leaders.insert(partition, Leader { node, term });
        self.note_leaderless();
        changed
    }

    /// Starts the clock of partitions that just lost their leader, stops that of
    /// those that have one again.
    fn note_leaderless(&mut self) {
        let now = Instant::now();
        for p in 1..=self.partitions_count {
            let p = PartitionId(p);
            if self.leaders.contains_key(&p) {
                self.leaderless_since.remove(&p);
            } else {
                self.leaderless_since.entry(p).or_insert(now);
            }
        }
    }

    /// Whether `partition` has a leader that can commit: one is known, and its last
    /// report did not say it lost its majority.
    pub fn healthy(&self, partition: PartitionId) -> bool {
        let Some(leader) = self.leaders.get(&partition) else {
            return false;
        };
        !self
            .reports
            .get(&leader.node)
            .into_iter()
            .flatten()
            .any(|r| r.partition == partition && r.majority_lost)
    }

    /// How many partitions each broker is known to lead; brokers leading none are
    /// absent.
    pub fn led_partitions(&self) -> BTreeMap<NodeId, u32> {
        let mut led = BTreeMap::new();
        for l in self.leaders.values() {
            *led.entry(l.node).or_insert(0) += 1;
        }
        led
    }

    /// Applies a NotLeader answer from broker `from`: its hint becomes the leader at
    /// once; without a hint, `from` at least stops being the leader.
    pub fn hint(&mut self, partition: PartitionId, from: NodeId, leader: Option<NodeId>) {
        match leader {
            Some(node) if node != from => {
                let term = self.leaders.get(&partition).map_or(0, |l| l.term);
                self.leaders.insert(partition, Leader { node, term });
            }
            _ => {
                if self.leaders.get(&partition).is_some_and(|l| l.node == from) {
                    self.leaders.remove(&partition);
                }
            }
        }
        self.note_leaderless();
    }
}

/// Picks each partition's leader from one round of reports: the broker claiming
/// leadership in the highest term wins. A follower's view of the leader counts too
/// (below a claim of the same term): it names a leader the gateway may not have heard
/// from yet, and a higher term means a stale leader's claim is outdated.
fn elect(answers: &[BrokerTopology]) -> HashMap<PartitionId, Leader> {
    // (term, is a claim, node): the tuple order is the preference order.
    let mut best: HashMap<PartitionId, (u64, bool, NodeId)> = HashMap::new();
    for a in answers {
        for p in &a.partitions {
            let candidate = if p.role == "leader" {
                (p.term, true, a.node_id)
            } else if p.leader_id != 0 {
                (p.term, false, p.leader_id)
            } else {
                continue;
            };
            let slot = best.entry(PartitionId(p.partition_id)).or_insert(candidate);
            if candidate > *slot {
                *slot = candidate;
            }
        }
    }
    best.into_iter()
        .map(|(p, (term, _, node))| (p, Leader { node, term }))
        .collect()
}

/// The gateway's live topology: the view, the brokers, and the refresh task.
pub struct Topology {
    /// Addresses from the configuration; polled every round besides the members,
    /// since they may be spelled differently from the members' own addresses.
    seeds: Vec<String>,
    view: RwLock<ClusterView>,
    /// One broker per address, reused for the command stream, Topology and Link.
    brokers: Mutex<HashMap<String, Arc<dyn BrokerApi>>>,
    /// Reaches the brokers (over gRPC, but for tests).
    connect: Arc<dyn Connect>,
    /// The membership, for the link supervisor to start one link per broker.
    members: watch::Sender<BTreeMap<NodeId, String>>,
    /// The partition count, for requests that arrive before the first answer.
    partitions: watch::Sender<u32>,
    /// Partitions led per broker, for splitting stream credit between brokers.
    led: watch::Sender<BTreeMap<NodeId, u32>>,
    /// Asks the refresh task for an early round (after a routing failure).
    refresh_wanted: Notify,
    /// Counts changes of any partition's leader, so that commands waiting to retry
    /// for want of a leader go at once when one is known.
    leader_changes: watch::Sender<u64>,
}

impl Topology {
    /// A topology that learns the cluster from `seeds` ("host:port" broker addresses).
    pub fn new(seeds: &[String]) -> Result<Self, GatewayError> {
        Self::with_tls(seeds, None)
    }

    /// A view learned from `seeds`, reaching brokers over gRPC with the cluster's
    /// mutual TLS when `tls` is given.
    pub fn with_tls(
        seeds: &[String],
        tls: Option<tonic::transport::ClientTlsConfig>,
    ) -> Result<Self, GatewayError> {
        Self::with_connect(seeds, Arc::new(crate::grpc::GrpcConnect { tls }))
    }

    /// A view learned from `seeds`, reaching brokers through `connect`.
    pub fn with_connect(seeds: &[String], connect: Arc<dyn Connect>) -> Result<Self, GatewayError> {
        if seeds.is_empty() {
            return Err(GatewayError::NoBrokers);
        }
        let mut brokers = HashMap::new();
        for addr in seeds {
            let broker =
                connect
                    .connect(addr)
                    .map_err(|reason| GatewayError::BadBrokerAddress {
                        addr: addr.clone(),
                        reason,
                    })?;
            brokers.insert(addr.clone(), broker);
        }
        Ok(Topology {
            seeds: seeds.to_vec(),
            view: RwLock::new(ClusterView::default()),
            brokers: Mutex::new(brokers),
            connect,
            members: watch::Sender::new(BTreeMap::new()),
            partitions: watch::Sender::new(0),
            led: watch::Sender::new(BTreeMap::new()),
            refresh_wanted: Notify::new(),
            leader_changes: watch::Sender::new(0),
        })
    }

    /// A copy of the current view.
    pub fn snapshot(&self) -> ClusterView {
        self.read().clone()
    }

    /// The partition count, 0 while no broker has answered.
    pub fn partitions_count(&self) -> u32 {
        self.read().partitions_count
    }

    /// Waits until the partition count is known or `until` passes; returns it (0 if
    /// still unknown).
    pub async fn wait_for_partitions(&self, until: Instant) -> u32 {
        let mut rx = self.partitions.subscribe();
        // A dropped sender or an elapsed wait both leave the count as last seen.
        let _ = tokio::time::timeout_at(until, rx.wait_for(|c| *c > 0)).await;
        let count = *rx.borrow();
        count
    }

    /// The known leader of `partition`.
    pub fn leader(&self, partition: PartitionId) -> Option<NodeId> {
        self.read().leaders.get(&partition).map(|l| l.node)
    }

    /// How long `partition` has been without a known leader; `None` while it has one.
    pub fn leaderless_for(&self, partition: PartitionId) -> Option<Duration> {
        self.read()
            .leaderless_since
            .get(&partition)
            .map(|since| since.elapsed())
    }

    /// `order` with the partitions whose leader can commit (see
    /// [`ClusterView::healthy`]) first and the others after, each in the order given.
    pub fn healthy_first(&self, order: impl Iterator<Item = PartitionId>) -> Vec<PartitionId> {
        let view = self.read();
        let (mut healthy, others): (Vec<_>, Vec<_>) = order.partition(|&p| view.healthy(p));
        healthy.extend(others);
        healthy
    }

    /// Applies a NotLeader answer (see [`ClusterView::hint`]).
    pub fn hint(&self, partition: PartitionId, from: NodeId, leader: Option<NodeId>) {
        if leader.is_some() {
            metrics::leader_reported("hint");
        }
        self.update_leaders("hint", |view| view.hint(partition, from, leader));
    }

    /// Applies a broker's own word that it leads `partition` in `term` (see
    /// [`ClusterView::claim`]).
    pub fn claim(&self, partition: PartitionId, node: NodeId, term: u64) {
        metrics::leader_reported("claim");
        self.update_leaders("claim", |view| {
            view.claim(partition, node, term);
        });
    }

    /// Runs `update` on the view; each partition it gives a new leader is logged and
    /// counted (learned from `source`), and the credit split and the commands
    /// waiting for a leader hear of it.
    fn update_leaders(&self, source: &'static str, update: impl FnOnce(&mut ClusterView)) {
        let (led, changed) = {
            let mut view = self.write();
            let before = view.leaders.clone();
            update(&mut view);
            let mut changed = 0;
            for (p, l) in &view.leaders {
                if before.get(p).map(|b| b.node) != Some(l.node) {
                    changed += 1;
                    tracing::info!(
                        partition = p.0,
                        leader = l.node,
                        term = l.term,
                        source,
                        "leader changed"
                    );
                }
            }
            (view.led_partitions(), changed)
        };
        self.publish_led(led);
        if changed > 0 {
            metrics::leader_changed(source, changed);
            self.leader_changes.send_modify(|n| *n += 1);
        }
    }

    /// Changes whenever a partition gets a new leader (the value counts them).
    pub fn leader_changes(&self) -> watch::Receiver<u64> {
        self.leader_changes.subscribe()
    }

    /// How many partitions each broker leads (see [`ClusterView::led_partitions`]),
    /// updated when it changes.
    pub fn leadership(&self) -> watch::Receiver<BTreeMap<NodeId, u32>> {
        self.led.subscribe()
    }

    fn publish_led(&self, led: BTreeMap<NodeId, u32>) {
        self.led.send_if_modified(|l| {
            let changed = *l != led;
            *l = led;
            changed
        });
    }

    /// Asks for a refresh round soon, paced by [`MIN_REFRESH_GAP`].
    pub fn request_refresh(&self) {
        self.refresh_wanted.notify_one();
    }

    /// The membership, updated whenever a broker is learned.
    pub fn members(&self) -> watch::Receiver<BTreeMap<NodeId, String>> {
        self.members.subscribe()
    }

    /// Broker `node`, if its address is known.
    pub fn node_broker(&self, node: NodeId) -> Option<Arc<dyn BrokerApi>> {
        self.broker(&self.node_addr(node)?)
    }

    /// The address of broker `node`, if known.
    pub fn node_addr(&self, node: NodeId) -> Option<String> {
        self.read().members.get(&node).cloned()
    }

    /// The broker at `addr`, made (not connected) on first use.
    pub fn broker(&self, addr: &str) -> Option<Arc<dyn BrokerApi>> {
        let mut brokers = lock(&self.brokers);
        if let Some(b) = brokers.get(addr) {
            return Some(b.clone());
        }
        match self.connect.connect(addr) {
            Ok(b) => {
                brokers.insert(addr.to_string(), b.clone());
                Some(b)
            }
            Err(reason) => {
                tracing::warn!(addr, reason, "ignoring unusable broker address");
                None
            }
        }
    }

    /// Refreshes every `every` (or sooner when asked) until `shutdown`.
    pub async fn run(&self, every: Duration, shutdown: CancellationToken) {
        loop {
            let started = Instant::now();
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = self.refresh() => {}
            }
            let early = async {
                self.refresh_wanted.notified().await;
                tokio::time::sleep_until(started + MIN_REFRESH_GAP).await;
            };
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep_until(started + every) => {}
                _ = early => {}
            }
        }
    }

    /// One round: polls the seeds and every member, then any broker first learned from
    /// those answers, and folds the answers into the view.
    pub async fn refresh(&self) {
        let mut polled: HashSet<String> = HashSet::new();
        let mut answers: Vec<BrokerTopology> = Vec::new();
        let mut known: HashSet<String> = self.read().members.values().cloned().collect();
        known.extend(self.seeds.iter().cloned());
        loop {
            let round: Vec<String> = known.difference(&polled).cloned().collect();
            if round.is_empty() {
                break;
            }
            let replies = futures::future::join_all(round.iter().map(|a| self.poll(a))).await;
            polled.extend(round);
            for reply in replies.into_iter().flatten() {
                known.extend(reply.brokers.iter().map(|b| b.addr.clone()));
                answers.push(reply);
            }
        }
        self.apply(&answers);
    }

    async fn poll(&self, addr: &str) -> Option<BrokerTopology> {
        let broker = self.broker(addr)?;
        match tokio::time::timeout(TOPOLOGY_CALL_TIMEOUT, broker.topology()).await {
            Ok(Ok(r)) => Some(r),
            Ok(Err(status)) => {
                tracing::debug!(addr, %status, "broker did not answer Topology");
                None
            }
            Err(_) => {
                tracing::debug!(addr, "broker Topology timed out");
                None
            }
        }
    }

    fn apply(&self, answers: &[BrokerTopology]) {
        let mut seen = (BTreeMap::new(), 0);
        self.update_leaders("round", |view| {
            view.merge_round(answers);
            seen = (view.members.clone(), view.partitions_count);
        });
        let (members, count) = seen;
        self.members.send_if_modified(|m| {
            let changed = *m != members;
            *m = members;
            changed
        });
        self.partitions.send_if_modified(|c| {
            let changed = *c != count;
            *c = count;
            changed
        });
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, ClusterView> {
        // The view is replaced whole under the lock, so a poisoned one is still usable.
        read_lock(&self.view)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, ClusterView> {
        write_lock(&self.view)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use courier_proto::cluster::{BrokerAddress, PartitionStatus};

    fn status(p: u32, role: &str, leader_id: u64, term: u64) -> PartitionStatus {
        PartitionStatus {
            partition_id: p,
            role: role.into(),
            leader_id,
            term,
            last_applied: 0,
            majority_lost: false,
        }
    }

    fn answer(node: NodeId, parts: Vec<PartitionStatus>) -> BrokerTopology {
        BrokerTopology {
            node_id: node,
            brokers: (1..=3)
                .map(|n| BrokerAddress {
                    node_id: n,
                    addr: format!("b{n}:26501"),
                })
                .collect(),
            partitions_count: 2,
            replication_factor: 3,
            partitions: parts,
            version: "0.1.0".into(),
            storage_failure: String::new(),
        }
    }

    fn leader_of(v: &ClusterView, p: u32) -> Option<NodeId> {
        v.leaders.get(&PartitionId(p)).map(|l| l.node)
    }

    #[test]
    fn a_new_leader_is_announced_to_commands_waiting_for_one() {
        let t = Topology::new(&["127.0.0.1:26501".to_string()]).unwrap();
        let mut changes = t.leader_changes();
        // Broker 1 says it does not lead partition 1 and names broker 2.
        t.hint(PartitionId(1), 1, Some(2));
        assert!(changes.has_changed().unwrap());
        changes.mark_unchanged();
        // The same leader again, or a broker that knows none: nothing to go for.
        t.hint(PartitionId(1), 1, Some(2));
        t.hint(PartitionId(1), 2, None);
        assert!(!changes.has_changed().unwrap());
        // A round of answers that names a leader.
        t.apply(&[answer(3, vec![status(1, "leader", 3, 6)])]);
        assert!(changes.has_changed().unwrap());
        assert_eq!(t.leader(PartitionId(1)), Some(3));
    }

    #[test]
    fn a_leader_that_says_so_leads_unless_a_later_term_is_known() {
        let mut v = ClusterView::default();
        v.merge_round(&[answer(1, vec![status(1, "leader", 1, 4)])]);
        // Broker 2 won term 5 (a hand-over): it says so over its link.
        assert!(v.claim(PartitionId(1), 2, 5));
        assert_eq!(leader_of(&v, 1), Some(2));
        // A round whose answers were gathered before still names broker 1 in term 4:
        // the later term stays.
        v.merge_round(&[answer(1, vec![status(1, "leader", 1, 4)])]);
        assert_eq!(v.leaders[&PartitionId(1)], Leader { node: 2, term: 5 });
        // A late word from an earlier term changes nothing; saying it again neither.
        assert!(!v.claim(PartitionId(1), 1, 4));
        assert!(!v.claim(PartitionId(1), 2, 5));
        assert_eq!(leader_of(&v, 1), Some(2));
        // A round that knows a later term wins, and one that names no leader at all
        // leaves the partition without one, as before.
        v.merge_round(&[answer(3, vec![status(1, "leader", 3, 6)])]);
        assert_eq!(leader_of(&v, 1), Some(3));
        v.merge_round(&[answer(3, vec![status(1, "candidate", 0, 7)])]);
        assert_eq!(leader_of(&v, 1), None);
    }

    #[test]
    fn any_answer_teaches_the_whole_membership() {
        let mut v = ClusterView::default();
        v.merge_round(&[answer(2, vec![])]);
        assert_eq!(v.members.len(), 3);
        assert_eq!(v.members.get(&3).map(String::as_str), Some("b3:26501"));
        assert_eq!(v.partitions_count, 2);
        assert_eq!(v.replication_factor, 3);
    }

    #[test]
    fn the_claim_with_the_highest_term_wins() {
        let mut v = ClusterView::default();
        // Broker 1 is a deposed leader that has not noticed yet.
        v.merge_round(&[
            answer(1, vec![status(1, "leader", 1, 4)]),
            answer(2, vec![status(1, "leader", 2, 5)]),
            answer(3, vec![status(1, "follower", 2, 5)]),
        ]);
        assert_eq!(leader_of(&v, 1), Some(2));
        assert_eq!(v.leaders[&PartitionId(1)].term, 5);
    }

    #[test]
    fn led_partitions_are_counted_per_broker() {
        let mut v = ClusterView::default();
        v.merge_round(&[
            answer(
                1,
                vec![status(1, "leader", 1, 4), status(2, "leader", 1, 4)],
            ),
            answer(
                2,
                vec![status(3, "leader", 2, 4), status(1, "follower", 1, 4)],
            ),
        ]);
        assert_eq!(v.led_partitions(), BTreeMap::from([(1, 2), (2, 1)]));
    }

    #[test]
    fn a_follower_names_the_leader_when_the_leader_is_silent() {
        let mut v = ClusterView::default();
        v.merge_round(&[
            answer(1, vec![status(1, "leader", 1, 4)]),
            answer(
                3,
                vec![status(1, "follower", 2, 5), status(2, "candidate", 0, 7)],
            ),
        ]);
        assert_eq!(leader_of(&v, 1), Some(2));
        // A candidate names no leader: partition 2 has none.
        assert_eq!(leader_of(&v, 2), None);
    }

    #[test]
    fn a_claim_beats_a_follower_view_of_the_same_term() {
        let mut v = ClusterView::default();
        v.merge_round(&[
            answer(1, vec![status(1, "follower", 3, 5)]),
            answer(2, vec![status(1, "leader", 2, 5)]),
        ]);
        assert_eq!(leader_of(&v, 1), Some(2));
    }

    #[test]
    fn a_broker_that_stops_answering_loses_its_partitions_and_leadership() {
        let mut v = ClusterView::default();
        v.merge_round(&[
            answer(1, vec![status(1, "leader", 1, 4)]),
            answer(2, vec![status(1, "follower", 1, 4)]),
        ]);
        assert_eq!(leader_of(&v, 1), Some(1));
        v.merge_round(&[answer(2, vec![status(1, "candidate", 0, 5)])]);
        assert_eq!(leader_of(&v, 1), None);
        assert!(!v.reports.contains_key(&1));
        assert_eq!(v.members.len(), 3, "membership is static");
    }

    #[test]
    fn hints_apply_at_once_and_only_unseat_the_broker_that_refused() {
        let mut v = ClusterView::default();
        v.merge_round(&[answer(1, vec![status(1, "leader", 1, 4)])]);
        v.hint(PartitionId(1), 1, Some(3));
        assert_eq!(leader_of(&v, 1), Some(3));
        assert_eq!(v.leaders[&PartitionId(1)].term, 4);
        // A stale refusal from broker 1 must not unseat broker 3.
        v.hint(PartitionId(1), 1, None);
        assert_eq!(leader_of(&v, 1), Some(3));
        v.hint(PartitionId(1), 3, None);
        assert_eq!(leader_of(&v, 1), None);
        // A hint for a partition with no known leader installs it.
        v.hint(PartitionId(2), 1, Some(2));
        assert_eq!(leader_of(&v, 2), Some(2));
    }

    /// A partition's time without a leader runs from the first round (or hint) that
    /// found none until one that finds one; partitions that can commit come first.
    #[tokio::test(start_paused = true)]
    async fn leaderless_time_is_counted_and_healthy_partitions_come_first() {
        let t = Topology::new(&["b1:26501".into()]).unwrap();
        let merge = |answers: &[BrokerTopology]| t.write().merge_round(answers);
        merge(&[answer(
            1,
            vec![status(1, "leader", 1, 2), status(2, "candidate", 0, 2)],
        )]);
        assert_eq!(t.leaderless_for(PartitionId(1)), None);
        assert_eq!(t.leaderless_for(PartitionId(2)), Some(Duration::ZERO));
        let both = || [PartitionId(2), PartitionId(1)].into_iter();
        assert_eq!(t.healthy_first(both()), [PartitionId(1), PartitionId(2)]);
        tokio::time::advance(Duration::from_secs(3)).await;
        merge(&[answer(
            1,
            vec![status(1, "leader", 1, 2), status(2, "candidate", 0, 3)],
        )]);
        assert_eq!(
            t.leaderless_for(PartitionId(2)),
            Some(Duration::from_secs(3)),
            "counted from the first round without one"
        );
        // A leader that lost its majority counts as none for the order.
        let mut lost = status(1, "leader", 1, 2);
        lost.majority_lost = true;
        merge(&[answer(1, vec![lost, status(2, "leader", 1, 3)])]);
        assert_eq!(t.leaderless_for(PartitionId(2)), None);
        assert_eq!(t.healthy_first(both()), [PartitionId(2), PartitionId(1)]);
        // A hint that unseats the leader starts the clock again.
        t.hint(PartitionId(2), 1, None);
        assert_eq!(t.leaderless_for(PartitionId(2)), Some(Duration::ZERO));
    }

    #[test]
    fn addresses_are_checked() {
        assert!(Topology::new(&["127.0.0.1:26501".into()]).is_ok());
        assert!(Topology::new(&["http://broker-1:26501".into()]).is_ok());
        assert!(matches!(Topology::new(&[]), Err(GatewayError::NoBrokers)));
        assert!(matches!(
            Topology::new(&["x y".into()]),
            Err(GatewayError::BadBrokerAddress { .. })
        ));
    }
}
