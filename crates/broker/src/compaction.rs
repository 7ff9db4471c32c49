//! Snapshots by size: openraft 0.9 takes a snapshot after a number of entries
//! only, and entries of large jobs can fill a disk long before that number. Each
//! replica also takes one once `snapshot_every_bytes` of entries were written to its
//! log since the last one this asked for; the log below it is then purged as after
//! any snapshot.

use super::*;
use std::sync::atomic::{AtomicU64, Ordering};

/// How often the bytes written to each log are looked at.
pub(super) const SIZE_CHECK_EVERY: Duration = Duration::from_millis(500);

/// Triggers a snapshot of each partition whose log had `every_bytes` written since
/// the last one triggered here (`written`: each log's running count).
pub(super) async fn snapshot_by_size(
    parts: Vec<(Arc<Partition>, Arc<AtomicU64>)>,
    every_bytes: u64,
    shutdown: CancellationToken,
) {
    let mut marks: Vec<u64> = parts
        .iter()
        .map(|(_, w)| w.load(Ordering::Relaxed))
        .collect();
    let mut tick = tokio::time::interval(SIZE_CHECK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        for ((part, written), mark) in parts.iter().zip(marks.iter_mut()) {
            let now = written.load(Ordering::Relaxed);
            if now.saturating_sub(*mark) < every_bytes {
                continue;
            }
            *mark = now;
            tracing::debug!(partition = part.id.0, bytes = now, "snapshot by size");
            metrics::SIZE_SNAPSHOTS.inc();
            if let Err(e) = part.raft.trigger().snapshot().await {
                tracing::debug!(partition = part.id.0, error = %e, "snapshot by size not taken");
            }
        }
    }
}
