//! Which of a partition's log writes are on disk.
//!
//! A leader tells Raft that its own entries are stored as soon as they are written
//! to the OS, so it replicates them while its own fdatasync runs (Raft allows this:
//! the leader's disk write and the followers' run side by side; Ongaro's thesis,
//! 10.2.1). Raft may then count the leader's copy toward a commit before it is
//! durable, so nothing of such a commit may be seen until it is: the state machine
//! applies an entry only once the write that holds it is flushed
//! ([`Durable::wait_for`]), and the commit index the leader sends its followers never
//! passes its own flushed log ([`Durable::clamp_commit`]). What a commit makes
//! visible (an answer, a push, a follower's apply) therefore always rests on a
//! majority of flushed copies, as before.

use openraft::{LogId, StorageError};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use tokio::sync::watch;

type NodeId = u64;

/// The flush state of one partition's log, shared by its log store, its state
/// machine and its Raft network.
#[derive(Debug)]
pub struct Durable {
    writes: Mutex<Writes>,
    flushed: watch::Sender<Flushed>,
}

/// Writes not known to be flushed yet, in the order they were made.
#[derive(Debug, Default)]
struct Writes {
    next_seq: u64,
    /// (first index written, sequence number) of each unflushed write.
    unflushed: VecDeque<(u64, u64)>,
}

#[derive(Debug, Clone, Default)]
struct Flushed {
    /// Every write numbered up to this one is flushed.
    seq: u64,
    /// The last log id of the latest flushed write (or of the log when opened).
    last: Option<LogId<NodeId>>,
    /// A flush failed: nothing written from then on can be counted on.
    failed: Option<Arc<str>>,
}

impl Durable {
    /// The state of a log opened with `last` as its last entry, all of it on disk.
    pub fn new(last: Option<LogId<NodeId>>) -> Arc<Durable> {
        let (flushed, _) = watch::channel(Flushed {
            last,
            ..Flushed::default()
        });
        Arc::new(Durable {
            writes: Mutex::new(Writes::default()),
            flushed,
        })
    }

    fn writes(&self) -> std::sync::MutexGuard<'_, Writes> {
        self.writes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Notes a write of entries from index `first` on; returns its number, for
    /// [`Durable::flushed`].
    pub fn wrote(&self, first: u64) -> u64 {
        let mut w = self.writes();
        w.next_seq += 1;
        let seq = w.next_seq;
        w.unflushed.push_back((first, seq));
        seq
    }

    /// Notes that write `seq`, whose last entry is `last`, and every write before
    /// it, were flushed (or that the flush failed).
    pub fn flushed(&self, seq: u64, last: LogId<NodeId>, result: &std::io::Result<()>) {
        {
            let mut w = self.writes();
            while w.unflushed.front().is_some_and(|&(_, s)| s <= seq) {
                w.unflushed.pop_front();
            }
        }
        self.flushed.send_modify(|f| {
            if let Err(e) = result {
                f.failed.get_or_insert_with(|| e.to_string().into());
            } else if seq > f.seq {
                f.seq = seq;
                f.last = Some(last);
            }
        });
    }

    /// The number of the write that must be flushed before the entry at `index` is
    /// on disk, if any: the latest unflushed write that starts at or below it (an
    /// entry rewritten after a truncation is held by the later write).
    fn pending_for(&self, index: u64) -> Option<u64> {
        self.writes()
            .unflushed
            .iter()
            .rev()
            .find(|&&(first, _)| first <= index)
            .map(|&(_, seq)| seq)
    }

    /// Waits until the log entries up to `index` are on disk.
    pub async fn wait_for(&self, index: u64) -> Result<(), StorageError<NodeId>> {
        let Some(seq) = self.pending_for(index) else {
            return self.check();
        };
        let started = std::time::Instant::now();
        let mut rx = self.flushed.subscribe();
        let f = rx
            .wait_for(|f| f.seq >= seq || f.failed.is_some())
            .await
            .map_err(|e| super::write_err(std::io::Error::other(e.to_string())))?;
        crate::metrics::APPLY_FLUSH_WAIT_SECONDS.observe(started.elapsed().as_secs_f64());
        match &f.failed {
            Some(e) => Err(flush_failed(e)),
            None => Ok(()),
        }
    }

    fn check(&self) -> Result<(), StorageError<NodeId>> {
        match &self.flushed.borrow().failed {
            Some(e) => Err(flush_failed(e)),
            None => Ok(()),
        }
    }

    /// `commit`, or the last flushed entry where `commit` is beyond it: the commit
    /// index a leader may tell its followers.
    pub fn clamp_commit(&self, commit: Option<LogId<NodeId>>) -> Option<LogId<NodeId>> {
        let f = self.flushed.borrow();
        if f.failed.is_some() {
            return None;
        }
        match (commit, f.last) {
            (Some(c), Some(l)) if c.index > l.index => Some(l),
            (Some(_), None) => None,
            (c, _) => c,
        }
    }
}

fn flush_failed(e: &str) -> StorageError<NodeId> {
    super::write_err(std::io::Error::other(format!(
        "flushing the log failed: {e}"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::CommittedLeaderId;
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};

    fn id(term: u64, index: u64) -> LogId<NodeId> {
        LogId::new(CommittedLeaderId::new(term, 1), index)
    }

    /// Polls `f` once: whether it is done.
    fn ready<F: Future>(f: F) -> Option<F::Output> {
        let mut cx = Context::from_waker(Waker::noop());
        match pin!(f).poll(&mut cx) {
            Poll::Ready(v) => Some(v),
            Poll::Pending => None,
        }
    }

    #[tokio::test]
    async fn an_entry_counts_as_on_disk_once_the_write_that_holds_it_is_flushed() {
        let d = Durable::new(Some(id(1, 4)));
        assert!(ready(d.wait_for(4)).is_some(), "opened on disk");
        let a = d.wrote(5); // 5..=6
        let b = d.wrote(7); // 7..=9
        assert!(ready(d.wait_for(3)).is_some());
        assert!(ready(d.wait_for(6)).is_none());
        assert!(ready(d.wait_for(9)).is_none());

        let waiting = tokio::spawn({
            let d = d.clone();
            async move { d.wait_for(6).await }
        });
        d.flushed(a, id(2, 6), &Ok(()));
        assert!(waiting.await.unwrap().is_ok());
        assert!(ready(d.wait_for(6)).is_some());
        assert!(ready(d.wait_for(7)).is_none(), "held by the second write");
        d.flushed(b, id(2, 9), &Ok(()));
        assert!(ready(d.wait_for(9)).is_some());
    }

    #[tokio::test]
    async fn an_entry_rewritten_after_a_truncation_waits_for_its_new_write() {
        let d = Durable::new(None);
        let a = d.wrote(1); // 1..=5
        d.flushed(a, id(1, 5), &Ok(()));
        let _rewrite = d.wrote(4); // 4..=6, under a new leader
        assert!(ready(d.wait_for(3)).is_some());
        assert!(ready(d.wait_for(4)).is_none());
        assert!(ready(d.wait_for(6)).is_none());
    }

    #[tokio::test]
    async fn a_failed_flush_fails_every_wait_and_stops_the_commit_index() {
        let d = Durable::new(Some(id(1, 2)));
        let a = d.wrote(3);
        let waiting = tokio::spawn({
            let d = d.clone();
            async move { d.wait_for(3).await }
        });
        d.flushed(a, id(1, 3), &Err(std::io::Error::other("disk gone")));
        let e = waiting.await.unwrap().unwrap_err();
        assert!(e.to_string().contains("disk gone"), "{e}");
        assert!(ready(d.wait_for(1)).unwrap().is_err());
        assert_eq!(d.clamp_commit(Some(id(1, 2))), None);
    }

    #[test]
    fn the_commit_index_told_to_followers_stops_at_the_flushed_log() {
        let d = Durable::new(Some(id(1, 4)));
        assert_eq!(d.clamp_commit(None), None);
        assert_eq!(d.clamp_commit(Some(id(1, 3))), Some(id(1, 3)));
        let a = d.wrote(5);
        assert_eq!(d.clamp_commit(Some(id(2, 6))), Some(id(1, 4)));
        d.flushed(a, id(2, 6), &Ok(()));
        assert_eq!(d.clamp_commit(Some(id(2, 6))), Some(id(2, 6)));
        assert_eq!(Durable::new(None).clamp_commit(Some(id(1, 1))), None);
    }
}
