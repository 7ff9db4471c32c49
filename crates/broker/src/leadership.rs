//! Moving leadership on purpose: a stopping broker hands its partitions to
//! up-to-date followers, and a partition goes back to its preferred broker once that
//! one is back and caught up.

use super::*;
use crate::partition::ElectError;

/// Hands every partition this broker leads to a follower that has its whole log,
/// all at once, before the broker stops: see [`Partition::hand_off`].
pub(super) async fn hand_off_all(
    partitions: &service::Partitions,
    peers: &PeerChannels,
    config: &BrokerConfig,
) {
    let handoffs = partitions.values().map(|part| async move {
        let ask = |to, term| ask_to_elect(peers, config, part.id, to, term);
        let span = tracing::info_span!("hand-off", partition = part.id.0);
        tracing::Instrument::instrument(part.hand_off(ask, None), span).await
    });
    futures::future::join_all(handoffs).await;
}

/// Asks broker `to` to stand for election for `partition` now, as its leader in
/// `term` hands the partition over (see [`Partition::hand_off`]).
pub(super) async fn ask_to_elect(
    peers: &PeerChannels,
    config: &BrokerConfig,
    partition: PartitionId,
    to: NodeId,
    term: u64,
) -> Result<(), ElectError> {
    let addr = config
        .brokers
        .get(&to)
        .ok_or(ElectError::UnknownBroker(to))?;
    let req = raft::ElectRequest {
        leader: config.node_id,
        term,
    };
    peers
        .ask_to_elect(addr, partition, &req, Duration::from_millis(500))
        .await
}

/// How often a broker looks for partitions it leads in place of their preferred
/// leader.
pub(super) const REBALANCE_TICK: Duration = Duration::from_secs(1);

/// How far behind the leader's log the preferred leader may be and still count as
/// caught up while it waits for its turn: the hand-off itself waits until it has
/// every entry, with the partition's writes held, so only a few may be missing.
pub(super) const REBALANCE_MAX_LAG: u64 = 64;

/// Hands each partition this broker leads in place of its preferred leader (see
/// [`BrokerConfig::preferred_leader`]) back to it, once the preferred leader has
/// been reachable and caught up for `settle`: after a failure or a rolling
/// restart, elections leave leaders wherever they happened to win, often most of
/// them on one broker, which then does most of the work. One partition at a time;
/// each hand-off holds the partition's writes for about one Raft round trip (see
/// [`Partition::hand_off`]). A partition's preferred leader never hands it on, so
/// leadership settles instead of moving around.
pub(super) async fn rebalance_leaders(
    parts: Vec<Arc<Partition>>,
    peers: PeerChannels,
    config: Arc<BrokerConfig>,
    settle: Duration,
    handing_off: Arc<tokio::sync::Mutex<()>>,
    shutdown: CancellationToken,
) {
    use tokio::time::Instant;
    // Per partition: since when its preferred leader has looked ready to take over.
    let mut ready_since: Vec<Option<Instant>> = vec![None; parts.len()];
    let mut tick = tokio::time::interval(REBALANCE_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        for (i, part) in parts.iter().enumerate() {
            let Some(preferred) = config.preferred_leader(part.id.0) else {
                continue;
            };
            let ready = preferred != config.node_id
                && !peers.is_down(preferred)
                && {
                    let m = part.raft.metrics();
                    let m = m.borrow();
                    let matched = m
                        .replication
                        .as_ref()
                        .and_then(|r| r.get(&preferred))
                        .and_then(|l| l.map(|l| l.index));
                    m.state == openraft::ServerState::Leader
                        && matches!((matched, m.last_log_index), (Some(at), Some(last)) if at + REBALANCE_MAX_LAG >= last)
                };
            if !ready {
                ready_since[i] = None;
                continue;
            }
            let since = *ready_since[i].get_or_insert_with(Instant::now);
            if since.elapsed() < settle {
                continue;
            }
            ready_since[i] = None;
            // Taken before looking at whether the broker stops, which is said
            // before the stop's hand-off takes it: that one then waits for this one.
            let _one_at_a_time = handing_off.lock().await;
            if part.is_stopping() {
                return;
            }
            tracing::info!(
                partition = part.id.0,
                to = preferred,
                "handing the partition back to its preferred leader"
            );
            let ask = |to, term| ask_to_elect(&peers, &config, part.id, to, term);
            let span = tracing::info_span!("rebalance", partition = part.id.0);
            // Not cut short by a stop: a hand-off dropped halfway would leave the
            // partition's proposer closed. It ends within a few seconds.
            let handed =
                tracing::Instrument::instrument(part.hand_off(ask, Some(preferred)), span).await;
            let outcome = if handed == Some(preferred) {
                metrics::label::rebalance::HANDED_OVER
            } else {
                metrics::label::rebalance::KEPT
            };
            metrics::REBALANCES.with_label_values(&[outcome]).inc();
        }
    }
}
