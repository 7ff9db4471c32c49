//! Parked ActivateJobs requests, woken when a broker says jobs of their type became
//! available.
//!
//! Per job type, the parked requests wait in line, oldest first. A notice for a
//! (type, tenant) wakes one of them, the oldest that wants the tenant: one request
//! visits the partitions for it, not every parked one at once. A request that takes
//! jobs is answered and leaves the line; one that finds none (another took them)
//! parks again in its old place. A woken request that fills its batch passes the turn on (there may be
//! more), and so does one that goes away before it has looked. A notice that finds
//! no parked request for its tenant is kept, and the next request of the type that
//! parks and wants the tenant looks again at once instead: a request subscribes
//! before it visits the partitions, so a notice during the visit is not lost.
//! `notify_all` (a broker link came back, its notices may be lost) wakes every
//! request of every type, parked or visiting. A woken request learns which
//! partition the notice came from, and visits that one first.

use crate::metrics;
use courier_proto::domain::PartitionId;
use courier_proto::sync::lock;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The waiting requests of every job type that has some.
#[derive(Default)]
pub struct LongPollQueue {
    /// Only types with at least one live [`Waiter`]; the last waiter to leave
    /// removes its entry, so the map never outgrows the waiting requests.
    types: Mutex<HashMap<String, TypeWaiters>>,
    /// Requests parked right now.
    parked: AtomicI64,
    next_id: AtomicU64,
}

/// The waiters of one job type.
#[derive(Default)]
struct TypeWaiters {
    /// Parked, oldest first.
    parked: VecDeque<ParkedWaiter>,
    /// Tenants announced while no parked waiter wanted them, with the partition of
    /// those notices (None: several, or unknown).
    pending: HashMap<String, Option<PartitionId>>,
    /// Bumped by `notify_all`: a waiter that has not seen the current value looks
    /// again at once.
    epoch: u64,
    /// Live waiters, parked or visiting.
    waiters: usize,
}

struct ParkedWaiter {
    id: u64,
    tenants: Arc<[String]>,
    /// Told the notice that gives the waiter its turn.
    wake: oneshot::Sender<Notice>,
}

/// What a turn comes with: the tenant whose jobs became available (empty: any) and
/// the partition they are on, where known.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Notice {
    tenant: String,
    partition: Option<PartitionId>,
}

impl TypeWaiters {
    /// Gives the turn to the oldest parked waiter that wants the notice's tenant
    /// (any, when empty), else keeps the notice for the next one to park.
    fn notify(&mut self, mut notice: Notice) {
        while let Some(pos) = self
            .parked
            .iter()
            .position(|w| notice.tenant.is_empty() || w.tenants.contains(&notice.tenant))
        {
            if let Some(w) = self.parked.remove(pos) {
                // A waiter whose request went away takes nothing: try the next.
                match w.wake.send(notice) {
                    Ok(()) => return,
                    Err(back) => notice = back,
                }
            }
        }
        if notice.tenant.is_empty() {
            self.epoch = self.epoch.wrapping_add(1);
        } else {
            // Kept notices of one tenant from different partitions say no one
            // partition: the waiter that takes them visits them all.
            self.pending
                .entry(notice.tenant)
                .and_modify(|p| {
                    if *p != notice.partition {
                        *p = None;
                    }
                })
                .or_insert(notice.partition);
        }
    }

    fn remove_parked(&mut self, id: u64) -> bool {
        match self.parked.iter().position(|w| w.id == id) {
            Some(pos) => {
                self.parked.remove(pos);
                true
            }
            None => false,
        }
    }
}

impl LongPollQueue {
    /// An empty queue.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Starts waiting for jobs of `job_type` and `tenants`; notices from now on are
    /// not missed.
    pub fn subscribe(self: &Arc<Self>, job_type: &str, tenants: &[String]) -> Waiter {
        let mut types = self.lock();
        let t = types.entry(job_type.to_string()).or_default();
        t.waiters += 1;
        Waiter {
            queue: Arc::clone(self),
            job_type: job_type.to_string(),
            tenants: tenants.into(),
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            epoch_seen: t.epoch,
            wake: None,
            unserved: None,
        }
    }

    /// Jobs of `job_type` and `tenant` (any tenant, when empty) became available on
    /// `partition`: wakes the oldest parked waiter that wants them.
    pub fn notify(&self, job_type: &str, tenant: &str, partition: Option<PartitionId>) {
        if let Some(t) = self.lock().get_mut(job_type) {
            t.notify(Notice {
                tenant: tenant.to_string(),
                partition,
            });
        }
    }

    /// Wakes every waiter of every type: after a broker link (re)connects, notices
    /// sent while it was down are lost, so everyone looks again.
    pub fn notify_all(&self) {
        for t in self.lock().values_mut() {
            t.epoch = t.epoch.wrapping_add(1);
            for w in t.parked.drain(..) {
                let _ = w.wake.send(Notice::default());
            }
        }
    }

    /// How many requests are parked right now.
    pub fn parked(&self) -> i64 {
        self.parked.load(Ordering::Relaxed)
    }

    /// Requests parked now for jobs of `job_type` and `tenant`.
    pub fn parked_for(&self, job_type: &str, tenant: &str) -> usize {
        self.lock().get(job_type).map_or(0, |w| {
            w.parked
                .iter()
                .filter(|p| p.tenants.iter().any(|t| t == tenant))
                .count()
        })
    }

    /// How many job types have waiters (for tests of the clean-up).
    pub fn types_watched(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, TypeWaiters>> {
        // Every critical section leaves the map consistent, so a poisoned one is usable.
        lock(&self.types)
    }
}

/// One request's place among the waiters of its job type.
pub struct Waiter {
    queue: Arc<LongPollQueue>,
    job_type: String,
    tenants: Arc<[String]>,
    id: u64,
    epoch_seen: u64,
    /// While parked: where the turn arrives.
    wake: Option<oneshot::Receiver<Notice>>,
    /// The notice this waiter was woken for and has not looked at yet (an empty
    /// tenant: any): passed on if the request goes away first.
    unserved: Option<Notice>,
}

impl Waiter {
    /// Parks until this waiter's turn (a notice for one of its tenants), `until`, or
    /// `shutdown`. Returns true when it should look at the partitions again: it was
    /// woken, or a notice came while it was not parked.
    pub async fn wait(&mut self, until: Instant, shutdown: &CancellationToken) -> bool {
        let (tx, rx) = oneshot::channel();
        {
            let mut types = self.queue.lock();
            let Some(t) = types.get_mut(&self.job_type) else {
                return false;
            };
            if t.epoch != self.epoch_seen {
                self.epoch_seen = t.epoch;
                return true;
            }
            if let Some(tenant) = self.tenants.iter().find(|x| t.pending.contains_key(*x)) {
                let tenant = tenant.clone();
                let partition = t.pending.remove(&tenant).flatten();
                self.unserved = Some(Notice { tenant, partition });
                return true;
            }
            // In line by arrival: a request that was woken and found nothing (the
            // job went to another) parks again in its old place, not at the back.
            let place = t
                .parked
                .iter()
                .position(|w| w.id > self.id)
                .unwrap_or(t.parked.len());
            t.parked.insert(
                place,
                ParkedWaiter {
                    id: self.id,
                    tenants: Arc::clone(&self.tenants),
                    wake: tx,
                },
            );
        }
        let rx = self.wake.insert(rx);
        let parked = Parked::new(&self.queue);
        let woken = tokio::select! {
            r = rx => Some(r.unwrap_or_default()),
            _ = tokio::time::sleep_until(until) => None,
            _ = shutdown.cancelled() => None,
        };
        drop(parked);
        let woken = match woken {
            Some(tenant) => Some(tenant),
            None => {
                let mut types = self.queue.lock();
                let left = types
                    .get_mut(&self.job_type)
                    .is_some_and(|t| t.remove_parked(self.id));
                drop(types);
                if left {
                    None
                } else {
                    // Not in line any more: a notice chose this waiter just now.
                    self.wake.as_mut().and_then(|rx| rx.try_recv().ok())
                }
            }
        };
        self.wake = None;
        match woken {
            Some(notice) => {
                let mut types = self.queue.lock();
                if let Some(t) = types.get_mut(&self.job_type) {
                    self.epoch_seen = t.epoch;
                }
                self.unserved = Some(notice);
                true
            }
            None => false,
        }
    }

    /// The partition the notice that woke this waiter came from, if known and not
    /// visited since: the one to look at first.
    pub fn partition_hint(&self) -> Option<PartitionId> {
        self.unserved.as_ref().and_then(|n| n.partition)
    }

    /// The request has looked at the partitions since it was woken: the notice is
    /// served.
    pub fn visited(&mut self) {
        self.unserved = None;
    }

    /// The request took a full batch: there may be more, so the next waiter of each
    /// of its tenants gets a turn.
    pub fn pass_on(&self) {
        let mut types = self.queue.lock();
        if let Some(t) = types.get_mut(&self.job_type) {
            for tenant in self.tenants.iter() {
                t.notify(Notice {
                    tenant: tenant.clone(),
                    partition: None,
                });
            }
        }
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let mut types = self.queue.lock();
        let Some(t) = types.get_mut(&self.job_type) else {
            return;
        };
        t.remove_parked(self.id);
        // Woken (or chosen while going away) and never looked: the next one looks.
        let chosen = self.wake.take().and_then(|mut rx| rx.try_recv().ok());
        if let Some(notice) = chosen.or(self.unserved.take()) {
            t.notify(notice);
        }
        t.waiters = t.waiters.saturating_sub(1);
        if t.waiters == 0 {
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

    const T: &str = "<default>";

    fn secs(s: u64) -> Instant {
        Instant::now() + Duration::from_secs(s)
    }

    fn tenants(t: &[&str]) -> Vec<String> {
        t.iter().map(|s| s.to_string()).collect()
    }

    /// Parks `w` in a task of its own; the handle says whether it was woken.
    fn park(mut w: Waiter, until: Instant) -> tokio::task::JoinHandle<(bool, Waiter)> {
        tokio::spawn(async move {
            let woken = w.wait(until, &CancellationToken::new()).await;
            (woken, w)
        })
    }

    /// Lets spawned tasks run up to their next wait, without moving the clock.
    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_notice_wakes_one_parked_waiter_of_its_type_and_tenant() {
        let q = LongPollQueue::new();
        let a1 = park(q.subscribe("a", &tenants(&[T])), secs(10));
        settle().await;
        let a2 = park(q.subscribe("a", &tenants(&[T])), secs(10));
        let other_tenant = park(q.subscribe("a", &tenants(&["x"])), secs(10));
        let b = park(q.subscribe("b", &tenants(&[T])), secs(10));
        settle().await;
        assert_eq!(q.parked(), 4);
        q.notify("a", T, None);
        let (woken, _a1) = a1.await.unwrap();
        assert!(woken, "the oldest waiter for the type and tenant is woken");
        settle().await;
        assert_eq!(q.parked(), 3, "one notice, one waiter");
        let start = Instant::now();
        assert!(!a2.await.unwrap().0);
        assert!(!other_tenant.await.unwrap().0);
        assert!(!b.await.unwrap().0);
        assert_eq!(
            start.elapsed(),
            Duration::from_secs(10),
            "the others time out"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn parked_waiters_are_served_oldest_first_and_keep_their_place_when_they_find_nothing() {
        let q = LongPollQueue::new();
        let turns = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for name in ["a", "b", "c"] {
            let (q, turns) = (q.clone(), turns.clone());
            tasks.push(tokio::spawn(async move {
                let mut w = q.subscribe("t", &tenants(&[T]));
                let token = CancellationToken::new();
                // Woken, it looks: the first time it finds nothing (another request
                // took the job) and parks again; the second time it takes a job, is
                // answered and leaves.
                let mut looks = 0;
                while w.wait(secs(100), &token).await {
                    w.visited();
                    turns.lock().unwrap().push(name);
                    looks += 1;
                    if looks == 2 {
                        break;
                    }
                }
            }));
            settle().await;
        }
        for _ in 0..6 {
            q.notify("t", T, None);
            settle().await;
        }
        assert_eq!(*turns.lock().unwrap(), vec!["a", "a", "b", "b", "c", "c"]);
        for t in tasks {
            t.abort();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_notice_while_nobody_is_parked_is_kept_for_the_next_to_park() {
        let q = LongPollQueue::new();
        let token = CancellationToken::new();
        let mut w = q.subscribe("t", &tenants(&[T]));
        // Arrives while the request is still visiting partitions.
        q.notify("t", T, None);
        let start = Instant::now();
        assert!(w.wait(secs(10), &token).await);
        assert_eq!(start.elapsed(), Duration::ZERO);
        w.visited();
        // Served now: the next wait parks again.
        assert!(!w.wait(secs(10), &token).await);
        // A notice for a tenant it does not want is not its.
        q.notify("t", "x", None);
        assert!(!w.wait(secs(20), &token).await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_woken_waiter_that_goes_away_before_looking_passes_the_turn_on() {
        let q = LongPollQueue::new();
        let first = park(q.subscribe("t", &tenants(&[T])), secs(10));
        settle().await;
        let second = park(q.subscribe("t", &tenants(&[T])), secs(10));
        settle().await;
        q.notify("t", T, None);
        let (woken, w) = first.await.unwrap();
        assert!(woken);
        // Its request ends (the client went away) before it visited the partitions.
        drop(w);
        let start = Instant::now();
        assert!(second.await.unwrap().0, "the turn went to the next waiter");
        assert_eq!(start.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_that_goes_away_while_parked_leaves_the_line() {
        let q = LongPollQueue::new();
        let gone = park(q.subscribe("t", &tenants(&[T])), secs(10));
        settle().await;
        let next = park(q.subscribe("t", &tenants(&[T])), secs(10));
        settle().await;
        gone.abort();
        let _ = gone.await;
        q.notify("t", T, None);
        let start = Instant::now();
        assert!(next.await.unwrap().0);
        assert_eq!(start.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_batch_passes_the_turn_on() {
        let q = LongPollQueue::new();
        let mut taker = q.subscribe("t", &tenants(&[T]));
        let next = park(q.subscribe("t", &tenants(&[T])), secs(10));
        settle().await;
        // The taker's first visit filled its batch.
        taker.visited();
        taker.pass_on();
        let start = Instant::now();
        assert!(next.await.unwrap().0);
        assert_eq!(start.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn a_woken_waiter_knows_the_partition_of_its_notice_until_it_looks() {
        let q = LongPollQueue::new();
        let token = CancellationToken::new();
        let p2 = Some(PartitionId(2));
        let first = park(q.subscribe("t", &tenants(&[T])), secs(10));
        settle().await;
        let second = park(q.subscribe("t", &tenants(&[T])), secs(10));
        settle().await;
        q.notify("t", T, p2);
        let (woken, w) = first.await.unwrap();
        assert!(woken);
        assert_eq!(w.partition_hint(), p2);
        // Gone before looking: the next waiter gets the turn, and the partition.
        drop(w);
        let (woken, mut w) = second.await.unwrap();
        assert!(woken);
        assert_eq!(w.partition_hint(), p2);
        w.visited();
        assert_eq!(w.partition_hint(), None, "served");
        // A notice kept while nobody was parked keeps its partition too.
        q.notify("t", T, Some(PartitionId(3)));
        q.notify("t", T, Some(PartitionId(3)));
        assert!(w.wait(secs(10), &token).await);
        assert_eq!(w.partition_hint(), Some(PartitionId(3)));
        w.visited();
        // Kept notices from two partitions: no one partition, so every one is visited
        // (answering with the first's jobs alone would leave the other's unannounced).
        q.notify("t", T, Some(PartitionId(3)));
        q.notify("t", T, Some(PartitionId(1)));
        assert!(w.wait(secs(10), &token).await);
        assert_eq!(w.partition_hint(), None);
        w.visited();
        // notify_all and a full batch's pass-on say no partition.
        q.notify_all();
        assert!(w.wait(secs(10), &token).await);
        assert_eq!(w.partition_hint(), None);
        w.visited();
        let other = q.subscribe("t", &tenants(&[T]));
        other.pass_on();
        assert!(w.wait(secs(10), &token).await);
        assert_eq!(w.partition_hint(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn an_empty_tenant_means_any() {
        let q = LongPollQueue::new();
        let x = park(q.subscribe("t", &tenants(&["x"])), secs(10));
        settle().await;
        q.notify("t", "", None);
        assert!(x.await.unwrap().0);
        // Nobody parked: every waiter of the type looks again.
        let token = CancellationToken::new();
        let mut a = q.subscribe("t", &tenants(&["a"]));
        let mut b = q.subscribe("t", &tenants(&["b"]));
        q.notify("t", "", None);
        assert!(a.wait(secs(10), &token).await);
        assert!(b.wait(secs(10), &token).await);
    }

    #[tokio::test(start_paused = true)]
    async fn notify_all_wakes_every_waiter_of_every_type() {
        let q = LongPollQueue::new();
        let token = CancellationToken::new();
        let p1 = park(q.subscribe("a", &tenants(&[T])), secs(10));
        let p2 = park(q.subscribe("a", &tenants(&[T])), secs(10));
        settle().await;
        let mut visiting_a = q.subscribe("a", &tenants(&[T]));
        let mut visiting_b = q.subscribe("b", &tenants(&[T]));
        q.notify_all();
        assert!(p1.await.unwrap().0);
        assert!(p2.await.unwrap().0);
        assert!(visiting_a.wait(secs(10), &token).await);
        assert!(visiting_b.wait(secs(10), &token).await);
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_ends_the_wait() {
        let q = LongPollQueue::new();
        let token = CancellationToken::new();
        let mut w = q.subscribe("t", &tenants(&[T]));
        let t = token.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            t.cancel();
        });
        let start = Instant::now();
        assert!(!w.wait(secs(60), &token).await);
        assert_eq!(start.elapsed(), Duration::from_secs(2));
        assert_eq!(q.parked(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn types_without_waiters_are_forgotten() {
        let q = LongPollQueue::new();
        let w1 = q.subscribe("t", &tenants(&[T]));
        let w2 = q.subscribe("t", &tenants(&[T]));
        let w3 = q.subscribe("u", &tenants(&[T]));
        assert_eq!(q.types_watched(), 2);
        drop(w1);
        assert_eq!(q.types_watched(), 2);
        drop(w2);
        assert_eq!(q.types_watched(), 1);
        drop(w3);
        assert_eq!(q.types_watched(), 0);
        // A notice for a type nobody waits for creates nothing.
        q.notify("t", T, None);
        assert_eq!(q.types_watched(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_gauge_counts_parked_requests_also_when_abandoned() {
        let q = LongPollQueue::new();
        let token = CancellationToken::new();
        let mut w = q.subscribe("t", &tenants(&[T]));
        assert_eq!(q.parked(), 0, "subscribed but visiting is not parked");
        let task = park(q.subscribe("t", &tenants(&[T])), secs(60));
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
