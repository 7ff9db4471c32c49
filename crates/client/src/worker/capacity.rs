//! How many jobs a worker holds: one permit per job, from the moment it is received
//! until its outcome is sent (or it is given back), whichever path it came by.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// `max` permits shared by the stream and the poller. A job is only ever held with a
/// permit, so the worker never holds more than `max` jobs, however the two paths race.
#[derive(Clone, Debug)]
pub(crate) struct Capacity {
    permits: Arc<Semaphore>,
    /// Woken whenever a permit comes back, for the poller waiting for room. Not
    /// `Semaphore::acquire`: taking a permit just to learn there is one would, for
    /// that instant, make a pushed job find none and be given back for nothing.
    freed: Arc<Notify>,
    /// Set when a take leaves no room; cleared by [`Capacity::filled_since_asked`].
    filled: Arc<AtomicBool>,
    max: usize,
}

/// One held job's permit; dropping it frees the room.
#[derive(Debug)]
pub(crate) struct Held {
    permit: Option<OwnedSemaphorePermit>,
    freed: Arc<Notify>,
}

impl Drop for Held {
    fn drop(&mut self) {
        // Release first, then wake: a woken poller must see the permit.
        drop(self.permit.take());
        self.freed.notify_waiters();
    }
}

impl Capacity {
    /// Room for `max` jobs (at least one).
    pub(crate) fn new(max: usize) -> Self {
        let max = max.max(1);
        Capacity {
            permits: Arc::new(Semaphore::new(max)),
            freed: Arc::new(Notify::new()),
            filled: Arc::new(AtomicBool::new(false)),
            max,
        }
    }

    /// A permit for one more job, or `None` when the worker is full.
    pub(crate) fn try_take(&self) -> Option<Held> {
        let permit = Arc::clone(&self.permits).try_acquire_owned().ok()?;
        if self.permits.available_permits() == 0 {
            self.filled.store(true, Relaxed);
        }
        Some(Held {
            permit: Some(permit),
            freed: Arc::clone(&self.freed),
        })
    }

    /// Jobs that could be taken right now.
    pub(crate) fn free(&self) -> usize {
        self.permits.available_permits()
    }

    /// Whether every permit was in use at some moment since the last call (or is
    /// now): the credit was all used, even where the instant of a look would find
    /// a permit on its way back.
    pub(crate) fn filled_since_asked(&self) -> bool {
        self.filled.swap(false, Relaxed) || self.free() == 0
    }

    /// Jobs it holds at most.
    pub(crate) fn max(&self) -> usize {
        self.max
    }

    /// Jobs held right now.
    pub(crate) fn held(&self) -> usize {
        self.max - self.free()
    }

    /// Returns once at least one job could be taken.
    pub(crate) async fn until_free(&self) {
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            // Registered before the check, so a permit returned in between still
            // wakes this waiter.
            freed.as_mut().enable();
            if self.free() > 0 {
                return;
            }
            freed.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn never_more_than_max_held() {
        let c = Capacity::new(3);
        let held: Vec<Held> = (0..5).filter_map(|_| c.try_take()).collect();
        assert_eq!(held.len(), 3);
        assert_eq!((c.free(), c.held()), (0, 3));
        drop(held);
        assert_eq!((c.free(), c.held()), (3, 0));
        assert!(c.filled_since_asked());
        assert!(
            !c.filled_since_asked(),
            "asked again with room: not full since"
        );
        let one = c.try_take();
        assert!(!c.filled_since_asked(), "one of three taken");
        drop(one);
        // Zero would be a worker that can never take a job.
        assert_eq!(Capacity::new(0).free(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn until_free_waits_for_a_permit_to_come_back() {
        let c = Capacity::new(2);
        let (a, b) = (c.try_take(), c.try_take());
        assert!(a.is_some() && b.is_some());
        // Full: the wait does not return, however long.
        let waiting = tokio::time::timeout(Duration::from_secs(3600), c.until_free()).await;
        assert!(waiting.is_err());

        let waiter = tokio::spawn({
            let c = c.clone();
            async move { c.until_free().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        drop(a);
        let woke = tokio::time::timeout(Duration::from_millis(1), waiter).await;
        assert!(matches!(woke, Ok(Ok(()))));
        assert_eq!(c.free(), 1);
        // With room already there, it returns at once.
        c.until_free().await;
    }
}
