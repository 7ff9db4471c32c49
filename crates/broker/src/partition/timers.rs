//! The leader's timers: activation deadlines and retry back-offs that are due
//! become TimeOut and Recur commands, paced.

use super::*;

/// For one leadership: proposes TimeOut for activations past their deadline and
/// Recur for jobs past their retry back-off. Apply re-checks both against the
/// entry's time.
pub(super) async fn run_timers(p: Arc<Partition>) {
    loop {
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
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        if proposed {
            // More may be due at once only if the round was cut short.
            if !full {
                tokio::time::sleep(TIMER_PACE).await;
            }
            continue;
        }
        let wait = next.map(|t| (t - now).clamp(1, 1000)).unwrap_or(1000);
        // Applies that make nothing due before then do not wake this task.
        p.shared.timers_wait_until(now + wait);
        let wait = wait as u64;
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(wait)) => {}
            _ = &mut applied => {}
        }
    }
}
