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

use courier_proto::domain::NodeId;

/// The flush state of one partition's log, shared by its log store, its state
/// machine and its Raft network.
#[derive(Debug, Default)]
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
    /// The highest commit index found on disk here when it was told to followers:
    /// committed by a majority of flushed copies, so never truncated.
    safe_commit: Option<LogId<NodeId>>,
}

#[derive(Debug, Clone, Default)]
struct Flushed {
    /// Every write numbered up to this one is flushed.
    seq: u64,
    /// A flush failed: nothing written from then on can be counted on.
    failed: Option<Arc<str>>,
}

impl Durable {
    /// The state of a log whose entries are all on disk.
    pub fn new() -> Arc<Durable> {
        Arc::default()
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

    /// Notes that write `seq` and every write before it were flushed, or that the
    /// flush failed (said before anything counts as flushed).
    pub fn flushed(&self, seq: u64, result: &std::io::Result<()>) {
        if let Err(e) = result {
            self.flushed.send_modify(|f| {
                f.failed.get_or_insert_with(|| e.to_string().into());
            });
            return;
        }
        {
            let mut w = self.writes();
            while w.unflushed.front().is_some_and(|&(_, s)| s <= seq) {
                w.unflushed.pop_front();
            }
        }
        self.flushed.send_modify(|f| f.seq = f.seq.max(seq));
    }

    /// The number of the write that must be flushed before the entry at `index` is
    /// on disk, if any: the latest unflushed write that starts at or below it (an
    /// entry rewritten after a truncation is held by the later write).
    fn pending_for(w: &Writes, index: u64) -> Option<u64> {
        w.unflushed
            .iter()
            .rev()
            .find(|&&(first, _)| first <= index)
            .map(|&(_, seq)| seq)
    }

    /// Waits until the log entries up to `index` are on disk.
    pub async fn wait_for(&self, index: u64) -> Result<(), StorageError<NodeId>> {
        let pending = Self::pending_for(&self.writes(), index);
        let Some(seq) = pending else {
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

    /// The commit index a leader may tell its followers, given openraft's
    /// `commit`: `commit` itself once every entry up to it is on disk here, else
    /// the last commit index that was (or `commit`, if lower).
    pub fn clamp_commit(&self, commit: Option<LogId<NodeId>>) -> Option<LogId<NodeId>> {
        if self.flushed.borrow().failed.is_some() {
            return None;
        }
        let c = commit?;
        let mut w = self.writes();
        if Self::pending_for(&w, c.index).is_none() {
            if w.safe_commit.is_none_or(|s| s.index < c.index) {
                w.safe_commit = Some(c);
            }
            return Some(c);
        }
        match w.safe_commit {
            Some(s) if s.index < c.index => Some(s),
            Some(_) => Some(c),
            None => None,
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
        let d = Durable::new();
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
        d.flushed(a, &Ok(()));
        assert!(waiting.await.unwrap().is_ok());
        assert!(ready(d.wait_for(6)).is_some());
        assert!(ready(d.wait_for(7)).is_none(), "held by the second write");
        d.flushed(b, &Ok(()));
        assert!(ready(d.wait_for(9)).is_some());
    }

    #[tokio::test]
    async fn an_entry_rewritten_after_a_truncation_waits_for_its_new_write() {
        let d = Durable::new();
        let a = d.wrote(1); // 1..=5
        d.flushed(a, &Ok(()));
        let rewrite = d.wrote(4); // 4..=6, under a new leader
        assert!(ready(d.wait_for(3)).is_some());
        assert!(ready(d.wait_for(4)).is_none());
        assert!(ready(d.wait_for(6)).is_none());
        d.flushed(rewrite, &Ok(()));
        assert!(ready(d.wait_for(6)).is_some());
    }

    #[tokio::test]
    async fn a_failed_flush_fails_every_wait_and_stops_the_commit_index() {
        let d = Durable::new();
        let a = d.wrote(3);
        let waiting = tokio::spawn({
            let d = d.clone();
            async move { d.wait_for(3).await }
        });
        d.flushed(a, &Err(std::io::Error::other("disk gone")));
        let e = waiting.await.unwrap().unwrap_err();
        assert!(e.to_string().contains("disk gone"), "{e}");
        assert!(
            ready(d.wait_for(3)).unwrap().is_err(),
            "not taken as flushed"
        );
        assert!(ready(d.wait_for(1)).unwrap().is_err());
        assert_eq!(d.clamp_commit(Some(id(1, 2))), None);
    }

    #[test]
    fn the_commit_index_told_to_followers_stops_at_what_is_on_disk_here() {
        let d = Durable::new();
        assert_eq!(d.clamp_commit(None), None);
        assert_eq!(d.clamp_commit(Some(id(1, 3))), Some(id(1, 3)), "on disk");
        let a = d.wrote(4); // 4..=6
        assert_eq!(d.clamp_commit(Some(id(1, 2))), Some(id(1, 2)), "lower");
        assert_eq!(
            d.clamp_commit(Some(id(2, 6))),
            Some(id(1, 3)),
            "the last commit index that was on disk"
        );
        d.flushed(a, &Ok(()));
        assert_eq!(d.clamp_commit(Some(id(2, 6))), Some(id(2, 6)));

        // Nothing known on disk yet (a log opened empty, or fully purged): none.
        let fresh = Durable::new();
        fresh.wrote(1);
        assert_eq!(fresh.clamp_commit(Some(id(1, 1))), None);
    }

    /// After a truncation the commit index told is never one from the cut-off
    /// entries: only commit indexes once found on disk are told while a write of
    /// the new leader's entries is pending.
    #[test]
    fn a_truncated_log_tells_no_commit_index_of_the_entries_cut_off() {
        let d = Durable::new();
        let a = d.wrote(1); // 1..=6 as a follower
        d.flushed(a, &Ok(()));
        assert_eq!(d.clamp_commit(Some(id(2, 4))), Some(id(2, 4)));
        // 5..=6 cut off by a later leader; this broker leads next, writing 5..=6 anew.
        let b = d.wrote(5);
        assert_eq!(d.clamp_commit(Some(id(4, 6))), Some(id(2, 4)));
        d.flushed(b, &Ok(()));
        assert_eq!(d.clamp_commit(Some(id(4, 6))), Some(id(4, 6)));
    }
}
