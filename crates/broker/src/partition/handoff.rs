//! Leadership hand-off: a leader that stops, or hands a partition back to its
//! preferred broker, gives it to an up-to-date follower, which stands at once.

use super::*;
use courier_proto::sync::lock;

/// How long a leader that is shutting down waits for a follower to have its whole
/// log, and then for that follower to lead, before it stops all the same.
pub(super) const HAND_OFF_WAIT: Duration = Duration::from_secs(1);

/// Past its lease by this much, a leader surely grants the vote it asks for.
pub(super) const LEASE_MARGIN: Duration = Duration::from_millis(20);

/// Why a follower did not stand for election when its leader handed it the partition.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ElectError {
    #[error("partition {partition}: broker {node} is stopping too")]
    Stopping {
        partition: PartitionId,
        node: NodeId,
    },
    #[error(
        "partition {partition}: broker {node} follows {follows:?} in term {term}, not broker \
         {leader} in term {asked}"
    )]
    NotItsFollower {
        partition: PartitionId,
        node: NodeId,
        follows: Option<NodeId>,
        term: u64,
        leader: NodeId,
        asked: u64,
    },
    #[error("partition {partition}: cannot start an election: {reason}")]
    Raft {
        partition: PartitionId,
        reason: String,
    },
    #[error("broker {0} is not in the configuration")]
    UnknownBroker(NodeId),
    #[error("could not ask: {0}")]
    Unreachable(String),
    /// The asked broker's refusal, as it worded it.
    #[error("{0}")]
    Refused(String),
}

/// What becomes of a partition whose hand-off failed: a stopping leader's waits for
/// an election; one being handed back to its preferred leader (`only`) stays led here.
pub(super) fn then_what(only: Option<NodeId>) -> &'static str {
    if only.is_some() {
        "this broker leads on"
    } else {
        "the partition waits for an election"
    }
}

/// Counts the entries the proposer has in flight, and closes to new ones while the
/// leadership is handed over (see [`Partition::hand_off`]). It is the proposer's,
/// not a leadership's: entries stay in flight across changes of term.
#[derive(Default)]
pub(super) struct Gate {
    /// Entries in flight. Taken to count one in or out and to close or open the
    /// gate, so that no entry goes in once it is closed.
    entries: Mutex<usize>,
    /// Changed only under `entries`.
    closed: AtomicBool,
    opened: Notify,
    /// Told when the last entry in flight is done while the gate is closed.
    idle: Notify,
}

impl Gate {
    /// Counts an entry the proposer is about to hand Raft, unless the gate is closed.
    pub fn enter(&self) -> bool {
        let mut entries = lock(&self.entries);
        if self.closed.load(Ordering::Relaxed) {
            return false;
        }
        *entries += 1;
        true
    }

    /// An entry counted by [`Gate::enter`] is applied or has failed.
    pub fn leave(&self) {
        let idle = {
            let mut entries = lock(&self.entries);
            *entries = entries.saturating_sub(1);
            *entries == 0 && self.closed.load(Ordering::Relaxed)
        };
        if idle {
            self.idle.notify_one();
        }
    }

    pub fn set_closed(&self, closed: bool) {
        let _entries = lock(&self.entries);
        self.closed.store(closed, Ordering::Relaxed);
        if !closed {
            self.opened.notify_one();
        }
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }

    /// Resolves when the gate opens after [`Gate::is_closed`] said it was closed.
    pub async fn opened(&self) {
        self.opened.notified().await
    }

    pub fn in_flight(&self) -> usize {
        *lock(&self.entries)
    }
}

impl Partition {
    /// Hands the leadership of this partition to a follower (Raft's leadership
    /// transfer): before this broker stops, so that the partition is back in
    /// milliseconds instead of after an election timeout, which in openraft 0.9 is
    /// the leader lease and an election timeout together; or to the partition's
    /// preferred leader once it is back (see `rebalance_leaders`).
    ///
    /// The proposer stops handing Raft new entries (commands wait in its queue);
    /// once every entry in flight is applied, the followers that have the whole log
    /// are asked in turn to stand for election (`ask`: a node id, this leader's
    /// term) until one will (one that is stopping too will not). This replica
    /// grants the vote, as its lease as leader is not renewed, and the follower
    /// leads with every entry. Then the proposer goes on: Raft refuses what waited,
    /// and the gateways send it to the new leader.
    ///
    /// `only`: ask that follower alone (a rebalance to the preferred leader).
    ///
    /// Returns the new leader; `None` when this replica does not lead, has no
    /// follower, none would take over, or none did within [`HAND_OFF_WAIT`] twice.
    pub async fn hand_off<F, Fut>(self: &Arc<Self>, ask: F, only: Option<NodeId>) -> Option<NodeId>
    where
        F: Fn(NodeId, u64) -> Fut,
        Fut: std::future::Future<Output = Result<(), ElectError>>,
    {
        let leader = self.leader()?;
        {
            let m = self.raft.server_metrics();
            let m = m.borrow();
            if m.membership_config.membership().voter_ids().count() < 2 || leader.majority_lost() {
                return None;
            }
        }
        // A replica votes for no one while its leader's lease runs (openraft 0.9:
        // the longest election timeout since it last heard from it, or since it
        // became leader, for the leader itself), so a leader younger than that would
        // refuse the vote it hands over, and the follower standing for election
        // would only unseat it. It leads on until then.
        let lease = Duration::from_millis(self.raft.config().election_timeout_max);
        tokio::time::sleep_until(leader.since + lease + LEASE_MARGIN).await;
        drop(leader);
        self.gate.set_closed(true);
        let new_leader = self.hand_off_closed(ask, only).await;
        self.gate.set_closed(false);
        new_leader
    }

    pub(super) async fn hand_off_closed<F, Fut>(
        &self,
        ask: F,
        only: Option<NodeId>,
    ) -> Option<NodeId>
    where
        F: Fn(NodeId, u64) -> Fut,
        Fut: std::future::Future<Output = Result<(), ElectError>>,
    {
        let mut watch = self.raft.metrics();
        let until = tokio::time::Instant::now() + HAND_OFF_WAIT;
        // The followers with the whole log, once nothing is in flight.
        let (candidates, term) = loop {
            let found = {
                let m = watch.borrow_and_update();
                if m.state != ServerState::Leader {
                    return None;
                }
                let idle = self.gate.in_flight() == 0;
                let last = m.last_log_index;
                let up_to_date: Vec<NodeId> = m
                    .replication
                    .iter()
                    .flatten()
                    .filter(|(id, matched)| {
                        **id != self.node_id
                            && only.is_none_or(|o| o == **id)
                            && matched.map(|l| l.index) == last
                    })
                    .map(|(id, _)| *id)
                    .collect();
                (idle && last == m.last_applied.map(|l| l.index) && !up_to_date.is_empty())
                    .then_some((up_to_date, m.current_term))
            };
            if let Some(found) = found {
                break found;
            }
            // Followers catch up and entries are applied: the metrics change; the
            // last entry in flight is done: the gate says so.
            tokio::select! {
                changed = watch.changed() => if changed.is_err() { return None },
                _ = self.gate.idle.notified() => {}
                _ = tokio::time::sleep_until(until) => {
                    tracing::warn!(
                        "{} within {} ms: {}",
                        if only.is_some() {
                            "the preferred leader did not have the whole log"
                        } else {
                            "no follower had the whole log (all down, or behind)"
                        },
                        HAND_OFF_WAIT.as_millis(),
                        then_what(only)
                    );
                    metrics::HANDOFFS
                        .with_label_values(&[label::handoff::NO_FOLLOWER_CAUGHT_UP])
                        .inc();
                    return None;
                }
            }
        };
        // The first that will: one that is stopping too, say, will not.
        let mut to = None;
        for candidate in candidates {
            match ask(candidate, term).await {
                Ok(()) => {
                    to = Some(candidate);
                    break;
                }
                Err(e) => {
                    tracing::info!(to = candidate, error = %e, "a follower would not take the partition over")
                }
            }
        }
        let Some(to) = to else {
            tracing::warn!(
                "{} take the partition over: {}",
                if only.is_some() {
                    "the preferred leader would not"
                } else {
                    "no follower would"
                },
                then_what(only)
            );
            metrics::HANDOFFS
                .with_label_values(&[label::handoff::REFUSED])
                .inc();
            return None;
        };
        let led_by_another = |m: &openraft::RaftMetrics<NodeId, openraft::BasicNode>| {
            m.state != ServerState::Leader && m.current_leader.is_some()
        };
        let led = tokio::time::timeout(HAND_OFF_WAIT, watch.wait_for(led_by_another))
            .await
            .map(|r| r.map(|m| m.current_leader));
        match led {
            Ok(Ok(leader)) => {
                if let Some(to) = leader {
                    tracing::info!(to, "partition handed over");
                }
                metrics::HANDOFFS
                    .with_label_values(&[label::handoff::HANDED_OVER])
                    .inc();
                leader
            }
            Ok(Err(_)) => None,
            Err(_) => {
                tracing::warn!(to, "the follower did not take the partition over in time");
                metrics::HANDOFFS
                    .with_label_values(&[label::handoff::NOT_TAKEN_OVER])
                    .inc();
                None
            }
        }
    }

    /// A leader that is shutting down asks this replica to stand for election now
    /// (see [`Partition::hand_off`]). Only a follower of that very leader and term
    /// does; anything else is refused with why.
    pub async fn elect_on_request(&self, leader: NodeId, term: u64) -> Result<(), ElectError> {
        let (partition, node) = (self.id, self.node_id);
        let refusal = if self.stopping.load(Ordering::Relaxed) {
            Some(ElectError::Stopping { partition, node })
        } else {
            let m = self.raft.server_metrics();
            let m = m.borrow();
            let current = m.vote.leader_id().get_term();
            (m.state != ServerState::Follower
                || m.current_leader != Some(leader)
                || current != term)
                .then_some(ElectError::NotItsFollower {
                    partition,
                    node,
                    follows: m.current_leader,
                    term: current,
                    leader,
                    asked: term,
                })
        };
        if let Some(why) = refusal {
            metrics::ELECTIONS_ASKED
                .with_label_values(&[label::election_asked::REFUSED])
                .inc();
            return Err(why);
        }
        tracing::info!(
            leader,
            term,
            "standing for election: the leader hands the partition over (it is stopping, or this broker is the partition's preferred leader)"
        );
        metrics::ELECTIONS_ASKED
            .with_label_values(&[label::election_asked::STARTED])
            .inc();
        self.longer_log.clear();
        self.raft
            .trigger()
            .elect()
            .await
            .map_err(|e| ElectError::Raft {
                partition,
                reason: e.to_string(),
            })
    }
}
