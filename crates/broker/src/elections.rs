//! The election timer of this broker's replicas, in place of openraft's own: it
//! tells a silent leader from a pause of this process.

use super::*;

/// How often the election driver looks at its partitions, and how late it must
/// wake to tell that this process stood still.
pub(super) const ELECTION_TICK: Duration = Duration::from_millis(10);
pub(super) const PAUSE_THRESHOLD: Duration = Duration::from_millis(250);

/// Starts elections for this broker's replicas, in place of openraft's timer
/// (`enable_elect` is off, see [`BrokerConfig::raft_config`]): a follower stands
/// when it has heard nothing of a leader (no append-entries, no vote granted) for
/// the leader's lease and its election timeout, drawn anew for each election, and
/// later still after a voter refused it for a longer log ([`election_wait`]), as
/// openraft 0.9 would. Unlike openraft's timer, it tells a silent leader from a
/// pause of this process (frozen by SIGSTOP, a stalled virtual machine, starved of
/// CPU): after one it counts every replica's silence from the moment it runs again.
/// openraft's first tick after a pause starts an election at a higher term, and a
/// healthy leader that sees it steps down: a stall of about half a second on
/// partitions that never had a problem (openraft 0.9 has no pre-vote).
pub(super) async fn drive_elections(
    parts: Vec<Arc<Partition>>,
    timeouts: (u64, u64),
    shutdown: CancellationToken,
) {
    use rand::Rng;
    metrics::PAUSES.inc_by(0);
    let (min, max) = (timeouts.0, timeouts.1.max(timeouts.0));
    let draw = || Duration::from_millis(rand::rng().random_range(min..=max));
    let lease = Duration::from_millis(max);
    let mut timeout: Vec<Duration> = parts.iter().map(|_| draw()).collect();
    let mut tick = tokio::time::interval(ELECTION_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = std::time::Instant::now();
    // Silence is counted from now, not from when each replica was opened: loading
    // a partition with millions of open jobs takes seconds, and the replicas opened
    // first would otherwise stand at once, against leaders that are alive.
    for p in &parts {
        p.heard_from_leader_at(last);
    }
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let now = std::time::Instant::now();
        let late = now.duration_since(last).saturating_sub(ELECTION_TICK);
        last = now;
        if late >= PAUSE_THRESHOLD {
            for p in &parts {
                p.heard_from_leader_at(now);
            }
            metrics::PAUSES.inc();
            tracing::warn!(
                stood_still = ?late,
                "this broker stood still (frozen, or starved of CPU); its replicas give their leaders a full election timeout from now"
            );
            continue;
        }
        for (i, p) in parts.iter().enumerate() {
            let (voters, candidate, committed) = {
                let m = p.raft.metrics();
                let m = m.borrow();
                // A replica stopped (its storage failed) stands no more.
                if matches!(
                    m.state,
                    openraft::ServerState::Leader | openraft::ServerState::Shutdown
                ) {
                    continue;
                }
                let membership = m.membership_config.membership();
                if !membership.voter_ids().any(|v| v == p.node_id) {
                    continue;
                }
                (
                    membership.voter_ids().count(),
                    m.state == openraft::ServerState::Candidate,
                    m.vote.is_committed(),
                )
            };
            let wait = election_wait(
                Silence {
                    voters,
                    candidate,
                    committed,
                    longer_log_seen: p.longer_log.seen(),
                },
                lease,
                timeout[i],
            );
            if now.duration_since(p.last_heard_from_leader()) <= wait {
                continue;
            }
            p.heard_from_leader_at(now);
            p.longer_log.clear();
            timeout[i] = draw();
            if let Err(e) = p.raft.trigger().elect().await {
                tracing::warn!(partition = p.id.0, error = %e, "could not start an election");
            }
        }
    }
}

/// What a replica that does not lead knows when its election driver looks at it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Silence {
    /// Voters of the partition, this replica among them.
    voters: usize,
    /// Whether it stands for election now.
    candidate: bool,
    /// Whether the vote it holds is a leader's, granted by a quorum.
    committed: bool,
    /// Whether a voter refused its last candidacy for a longer log
    /// ([`raft::LongerLog`]).
    longer_log_seen: bool,
}

/// How long a replica must have heard nothing of a leader before it stands for
/// election, as openraft 0.9's own timer has it: `lease` is the leader's lease (the
/// longest election timeout), `timeout` this election's timeout, drawn at random.
pub(super) fn election_wait(s: Silence, lease: Duration, timeout: Duration) -> Duration {
    let wait = match s {
        // The only voter: at once, and again only if that did not end.
        Silence {
            voters: 1,
            candidate: false,
            ..
        } => return Duration::ZERO,
        Silence {
            committed: true, ..
        } => lease + timeout,
        _ => timeout,
    };
    if s.longer_log_seen {
        wait + lease * raft::LongerLog::BACK_OFF
    } else {
        wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_millis(600);
    const TIMEOUT: Duration = Duration::from_millis(400);

    fn silence(voters: usize, candidate: bool, committed: bool, longer: bool) -> Silence {
        Silence {
            voters,
            candidate,
            committed,
            longer_log_seen: longer,
        }
    }

    fn wait(s: Silence) -> Duration {
        election_wait(s, LEASE, TIMEOUT)
    }

    #[test]
    fn a_follower_of_a_leader_waits_out_its_lease_and_a_candidate_its_timeout() {
        // It followed a leader (the vote it holds is committed): lease, then timeout.
        assert_eq!(wait(silence(3, false, true, false)), LEASE + TIMEOUT);
        // It granted a vote, or stands itself: the timeout alone.
        assert_eq!(wait(silence(3, false, false, false)), TIMEOUT);
        assert_eq!(wait(silence(3, true, false, false)), TIMEOUT);
        // The only voter stands at once, and waits for an election of its own
        // that did not end.
        assert_eq!(wait(silence(1, false, false, false)), Duration::ZERO);
        assert_eq!(wait(silence(1, false, false, true)), Duration::ZERO);
        assert_eq!(wait(silence(1, true, false, false)), TIMEOUT);
    }

    /// The survivor a voter with a longer log refused stands again only after that
    /// voter's longest wait has surely run out, so the voter stands first: with both
    /// on the same timeout, they took turns raising the term for as long as their
    /// timers kept in step, and no leader was elected (a cluster test's failure).
    #[test]
    fn a_candidate_refused_for_a_longer_log_lets_that_voter_stand_first() {
        let refused = wait(silence(3, true, false, true));
        assert_eq!(refused, TIMEOUT + 2 * LEASE);
        // Longer than the voter's longest wait after it last stood or granted a
        // vote: the longest timeout.
        assert!(refused > LEASE);
        assert_eq!(wait(silence(3, false, false, true)), TIMEOUT + 2 * LEASE);
        assert_eq!(
            wait(silence(3, false, true, true)),
            LEASE + TIMEOUT + 2 * LEASE
        );
    }
}
