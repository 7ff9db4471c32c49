//! The leader's timers: activation deadlines and retry back-offs that are due
//! become TimeOut and Recur commands, paced.

use super::*;

/// While leader: proposes TimeOut for activations past their deadline and Recur
/// for jobs past their retry back-off. Apply re-checks both against the entry's time.
pub(super) async fn run_timers(p: Arc<Partition>, shutdown: CancellationToken) {
    // Woken by changes of role or leader, not by every entry.
    let mut metrics_rx = p.raft.server_metrics();
    // The term this replica leads in, as of the last round.
    let mut led: Option<u64> = None;
    loop {
        let Some(term) = p.leading_term() else {
            if led.take().is_some() {
                // Ends of activations are carried out by the next leader now.
                let keys: Vec<JobKey> = p.pushed.iter().map(|e| *e.key()).collect();
                for key in keys {
                    p.unhold(p.pushed.remove(&key));
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                r = metrics_rx.changed() => if r.is_err() { return },
            }
            continue;
        };
        // A new term, even one this replica won again without this task seeing it
        // follow in between.
        if led != Some(term) {
            led = Some(term);
            let (q, stop) = (p.clone(), shutdown.clone());
            tokio::spawn(async move {
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = async {
                        tokio::join!(
                            async {
                                if caught_up_in(&q, term).await {
                                    offer_backlog(&q);
                                    reconcile_pushes(q.clone(), term).await;
                                }
                            },
                            reclaim_orphans(q.clone(), term),
                        )
                    } => {}
                }
            });
        }
        let applied = p.shared.applied.notified();
        tokio::pin!(applied);
        applied.as_mut().enable();
        p.shared.timers_reading();
        let now = now_ms();
        let (timeouts, retries, next) = {
            let a = p.shared.read();
            let next = a.state.next_timer();
            (
                a.state.due_deadlines(now, MAX_TIMER_KEYS),
                a.state.due_retries(now, MAX_TIMER_KEYS),
                next,
            )
        };
        let mut proposed = false;
        let full = timeouts.len() >= MAX_TIMER_KEYS || retries.len() >= MAX_TIMER_KEYS;
        let timeouts = (!timeouts.is_empty()).then(|| LogCommand::TimeOut {
            push: p.targets_for_keys(&timeouts),
            keys: timeouts,
        });
        let retries = (!retries.is_empty()).then(|| LogCommand::Recur {
            push: p.targets_for_keys(&retries),
            keys: retries,
        });
        for cmd in [timeouts, retries].into_iter().flatten() {
            proposed = true;
            if let Err(e) = p.propose(cmd).await {
                tracing::debug!(error = %e, "timer command not applied");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
            }
        }
        if proposed {
            // More may be due at once only if the round was cut short.
            if !full {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(TIMER_PACE) => {}
                    r = metrics_rx.changed() => if r.is_err() { return },
                }
            }
            continue;
        }
        let wait = next.map(|t| (t - now).clamp(1, 1000)).unwrap_or(1000);
        // Applies that make nothing due before then do not wake this task.
        p.shared.timers_wait_until(now + wait);
        let wait = wait as u64;
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(wait)) => {}
            _ = &mut applied => {}
            r = metrics_rx.changed() => if r.is_err() { return },
        }
    }
}
