//! Parked ActivateJobs requests, woken when a broker says jobs of their type became
//! available.
//!
//! Each job type with waiters has a generation counter in a `watch` channel. A waiter
//! subscribes before it visits the partitions, which marks the current generation as
//! seen; any notice after that (even one that arrives during the visit) bumps the
//! generation, so the next wait returns at once instead of sleeping through it.

use crate::metrics;
use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Generation counters of the job types that have waiters.
#[derive(Default)]
pub struct LongPollQueue {
    /// Only types with at least one live [`Waiter`]; the last waiter to leave
    /// removes its entry, so the map never outgrows the waiting requests.
    types: Mutex<HashMap<String, watch::Sender<u64>>>,
    /// Requests parked right now.
    parked: AtomicI64,
}

impl LongPollQueue {
    /// An empty queue.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Starts watching for jobs of `job_type`; notices from now on are not missed.
    pub fn subscribe(self: &Arc<Self>, job_type: &str) -> Waiter {
        let mut types = self.lock();
        let rx = types
            .entry(job_type.to_string())
            .or_insert_with(|| watch::Sender::new(0))
            .subscribe();
        Waiter {
            queue: Arc::clone(self),
            job_type: job_type.to_string(),
            rx: Some(rx),
        }
    }

    /// Wakes every waiter for `job_type`.
    pub fn notify(&self, job_type: &str) {
        if let Some(tx) = self.lock().get(job_type) {
            tx.send_modify(|g| *g = g.wrapping_add(1));
        }
    }

    /// Wakes every waiter of every type: after a broker link (re)connects, notices
    /// sent while it was down are lost, so everyone looks again.
    pub fn notify_all(&self) {
        for tx in self.lock().values() {
            tx.send_modify(|g| *g = g.wrapping_add(1));
        }
    }

    /// How many requests are parked right now.
    pub fn parked(&self) -> i64 {
        self.parked.load(Ordering::Relaxed)
    }

    /// How many job types have waiters (for tests of the clean-up).
    pub fn types_watched(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, watch::Sender<u64>>> {
        // Every critical section leaves the map consistent, so a poisoned one is usable.
        self.types.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One request's subscription to a job type.
pub struct Waiter {
    queue: Arc<LongPollQueue>,
    job_type: String,
    /// Always `Some` until dropped; taken in `drop` so the receiver count is exact
    /// when deciding whether to remove the type.
    rx: Option<watch::Receiver<u64>>,
}

impl Waiter {
    /// Parks until a notice for the type newer than the last one seen, `until`, or
    /// `shutdown`. Returns true when woken by a notice.
    pub async fn wait(&mut self, until: Instant, shutdown: &CancellationToken) -> bool {
        let Some(rx) = self.rx.as_mut() else {
            return false;
        };
        let _parked = Parked::new(&self.queue);
        tokio::select! {
            changed = rx.changed() => changed.is_ok(),
            _ = tokio::time::sleep_until(until) => false,
            _ = shutdown.cancelled() => false,
        }
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let mut types = self.queue.lock();
        drop(self.rx.take());
        if types
            .get(&self.job_type)
            .is_some_and(|tx| tx.receiver_count() == 0)
        {
            types.remove(&self.job_type);
        }
    }
}

/// Counts a request as parked for as long as it lives, also when its future is
/// dropped mid-wait (the client went away).
struct Parked<'a>(&'a LongPollQueue);

impl<'a> Parked<'a> {
    fn new(queue: &'a LongPollQueue) -> Self {
        queue.parked.fetch_add(1, Ordering::Relaxed);
        metrics::long_poll_parked(1);
        Parked(queue)
    }
}

impl Drop for Parked<'_> {
    fn drop(&mut self) {
        self.0.parked.fetch_sub(1, Ordering::Relaxed);
        metrics::long_poll_parked(-1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn secs(s: u64) -> Instant {
        Instant::now() + Duration::from_secs(s)
    }

    #[tokio::test(start_paused = true)]
    async fn a_notice_wakes_the_waiters_of_its_type_only() {
        let q = LongPollQueue::new();
        let token = CancellationToken::new();
        let mut a = q.subscribe("a");
        let mut b = q.subscribe("b");
        let qq = q.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            qq.notify("a");
        });
        let start = Instant::now();
        assert!(a.wait(secs(10), &token).await);
        assert_eq!(start.elapsed(), Duration::from_secs(1));
        assert!(!b.wait(secs(10), &token).await, "b must time out");
        assert_eq!(start.elapsed(), Duration::from_secs(11));
    }

    #[tokio::test(start_paused = true)]
    async fn a_notice_between_subscribe_and_wait_is_not_lost() {
        let q = LongPollQueue::new();
        let token = CancellationToken::new();
        let mut w = q.subscribe("t");
        // Arrives while the request is still visiting partitions.
        q.notify("t");
        let start = Instant::now();
        assert!(w.wait(secs(10), &token).await);
        assert_eq!(start.elapsed(), Duration::ZERO);
        // Seen now: the next wait parks again.
        assert!(!w.wait(secs(10), &token).await);
    }

    #[tokio::test(start_paused = true)]
    async fn notify_all_wakes_every_type() {
        let q = LongPollQueue::new();
        let token = CancellationToken::new();
        let mut a = q.subscribe("a");
        let mut b = q.subscribe("b");
        q.notify_all();
        assert!(a.wait(secs(10), &token).await);
        assert!(b.wait(secs(10), &token).await);
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_ends_the_wait() {
        let q = LongPollQueue::new();
        let token = CancellationToken::new();
        let mut w = q.subscribe("t");
        let t = token.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            t.cancel();
        });
        let start = Instant::now();
        assert!(!w.wait(secs(60), &token).await);
        assert_eq!(start.elapsed(), Duration::from_secs(2));
    }

    #[tokio::test(start_paused = true)]
    async fn types_without_waiters_are_forgotten() {
        let q = LongPollQueue::new();
        let w1 = q.subscribe("t");
        let w2 = q.subscribe("t");
        let w3 = q.subscribe("u");
        assert_eq!(q.types_watched(), 2);
        drop(w1);
        assert_eq!(q.types_watched(), 2);
        drop(w2);
        assert_eq!(q.types_watched(), 1);
        drop(w3);
        assert_eq!(q.types_watched(), 0);
        // A notice for a type nobody waits for creates nothing.
        q.notify("t");
        assert_eq!(q.types_watched(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_gauge_counts_parked_requests_also_when_abandoned() {
        let q = LongPollQueue::new();
        let token = CancellationToken::new();
        let mut w = q.subscribe("t");
        assert_eq!(q.parked(), 0, "subscribed but visiting is not parked");
        let qq = q.clone();
        let task = tokio::spawn(async move {
            let mut w2 = qq.subscribe("t");
            w2.wait(secs(60), &CancellationToken::new()).await
        });
        let waiting = w.wait(secs(1), &token);
        tokio::pin!(waiting);
        tokio::select! {
            _ = &mut waiting => panic!("must not finish yet"),
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
        assert_eq!(q.parked(), 2);
        task.abort();
        let _ = task.await;
        assert_eq!(q.parked(), 1);
        assert!(!waiting.await);
        assert_eq!(q.parked(), 0);
    }
}
