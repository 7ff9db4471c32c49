//! A partition's Raft log in fjall: entries keyed by big-endian index, plus the vote
//! and the last purged id in the partition's meta keyspace.

use super::durable::Durable;
use super::{read_err, write_err, Db, Durability};
use crate::engine::FlushSignal;
use crate::raft::TypeConfig;
use courier_proto::codec;
use fjall::Keyspace;
use openraft::storage::{LogFlushed, LogState, RaftLogReader, RaftLogStorage};
use openraft::{Entry, EntryPayload, LogId, OptionalSend, RaftLogId, StorageError, Vote};
use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const VOTE: &[u8] = b"vote";
const LAST_PURGED: &[u8] = b"last_purged";

use courier_proto::domain::NodeId;

/// Entries deleted per write batch when purging: each batch holds fjall's journal
/// lock while it goes into the memtable, and every other write of the broker (log
/// appends, applies) waits for that lock. Small batches with a pause between them
/// keep a purge of tens of thousands of entries from holding it for long at a time,
/// even when the purging thread is preempted on a busy machine.
const PURGE_CHUNK: u64 = 64;
const PURGE_PAUSE: std::time::Duration = std::time::Duration::from_micros(500);

/// The log of one partition.
#[derive(Clone)]
pub struct LogStore {
    db: Db,
    log: Keyspace,
    meta: Keyspace,
    /// Entries below this index are deleted, or being deleted in the background.
    deleted_below: Arc<AtomicU64>,
    /// This broker: the entries it appends as the leader of the vote it holds are
    /// its own proposals.
    node: NodeId,
    /// The vote last saved.
    vote: Option<Vote<NodeId>>,
    /// Which writes are flushed, for the state machine and the Raft network.
    durable: Arc<Durable>,
    /// Bytes of entries written since the log was opened, for snapshots by size.
    written_bytes: Arc<AtomicU64>,
}

impl LogStore {
    /// Opens the log of `partition` in `db` on broker `node`, deleting entries a
    /// purge recorded but did not get to delete before the broker stopped.
    pub fn open(db: &Db, partition: u32, node: NodeId) -> Result<LogStore, StorageError<NodeId>> {
        let mut store = LogStore {
            db: db.clone(),
            log: db
                .keyspace(&format!("p{partition}.log"))
                .map_err(read_err)?,
            meta: db
                .keyspace(&format!("p{partition}.meta"))
                .map_err(read_err)?,
            deleted_below: Arc::default(),
            node,
            vote: None,
            durable: Durable::new(),
            written_bytes: Arc::default(),
        };
        store.vote = store.stored_vote()?;
        if let Some(purged) = store.get_meta::<LogId<NodeId>>(LAST_PURGED)? {
            let leftovers = store.keys_in(..=purged.index)?;
            let mut batch = store.db.database().batch();
            for k in leftovers {
                batch.remove(&store.log, k);
            }
            batch.commit().map_err(write_err)?;
            store.deleted_below = Arc::new(AtomicU64::new(purged.index + 1));
        }
        Ok(store)
    }

    /// The vote last saved, where this broker's own granted vote reads as its vote
    /// for itself, not granted. A leader that stopped does not resume leading the
    /// same term (openraft 0.9 would, at once): its own entries count as stored
    /// before they are flushed (see [`Durable`]), so after a power loss its log may
    /// lack entries its followers hold under ids it would hand out again. It stands
    /// for election instead, and its new term's first entry overwrites them.
    fn stored_vote(&self) -> Result<Option<Vote<NodeId>>, StorageError<NodeId>> {
        let vote: Option<Vote<NodeId>> = self.get_meta(VOTE)?;
        Ok(vote.map(|v| {
            let led = v.leader_id();
            if v.is_committed() && led.voted_for() == Some(self.node) {
                Vote::new(led.get_term(), self.node)
            } else {
                v
            }
        }))
    }

    /// The flush state of this log.
    pub fn durable(&self) -> Arc<Durable> {
        self.durable.clone()
    }

    /// Bytes of entries written since the log was opened, counting up.
    pub fn written_bytes(&self) -> Arc<AtomicU64> {
        self.written_bytes.clone()
    }

    /// The id of the last stored entry.
    fn last_stored(&self) -> Result<Option<LogId<NodeId>>, StorageError<NodeId>> {
        match self.log.last_key_value() {
            None => Ok(None),
            Some(g) => {
                let (_, v) = g.into_inner().map_err(read_err)?;
                let entry: Entry<TypeConfig> = codec::decode(&v).map_err(read_err)?;
                Ok(Some(*entry.get_log_id()))
            }
        }
    }

    /// Whether entries of `leader` are this broker's own proposals under the vote
    /// it holds: it leads that vote, and the vote is granted by a quorum.
    fn own(&self, leader: &openraft::CommittedLeaderId<NodeId>) -> bool {
        self.vote.as_ref().is_some_and(|v| {
            v.is_committed()
                && v.leader_id().voted_for() == Some(self.node)
                && v.leader_id() == leader
        })
    }

    fn get_meta<T: serde::de::DeserializeOwned>(
        &self,
        key: &[u8],
    ) -> Result<Option<T>, StorageError<NodeId>> {
        match self.meta.get(key).map_err(read_err)? {
            None => Ok(None),
            Some(v) => codec::decode(&v).map(Some).map_err(read_err),
        }
    }

    fn put_meta<T: serde::Serialize>(&self, key: &[u8], v: &T) -> Result<(), StorageError<NodeId>> {
        let bytes = codec::to_vec(v).map_err(write_err)?;
        self.meta.insert(key, bytes).map_err(write_err)
    }

    /// Keys of entries in `range`, to delete.
    fn keys_in(
        &self,
        range: impl RangeBounds<u64>,
    ) -> Result<Vec<fjall::UserKey>, StorageError<NodeId>> {
        let (start, end) = byte_range(range);
        self.log
            .range((start, end))
            .map(|g| g.key().map_err(read_err))
            .collect()
    }
}

fn byte_range(range: impl RangeBounds<u64>) -> (Bound<[u8; 8]>, Bound<[u8; 8]>) {
    let map = |b: Bound<&u64>| match b {
        Bound::Included(i) => Bound::Included(i.to_be_bytes()),
        Bound::Excluded(i) => Bound::Excluded(i.to_be_bytes()),
        Bound::Unbounded => Bound::Unbounded,
    };
    (map(range.start_bound()), map(range.end_bound()))
}

impl LogStore {
    /// Encodes `entries` and writes them in one batch, without waiting for them to be
    /// durable (see [`Db::sync`]): the part of an append that is this store's own.
    /// Returns the flush signals the entries carry (the leader's own proposals).
    pub fn write(
        &self,
        entries: impl IntoIterator<Item = Entry<TypeConfig>>,
    ) -> Result<Vec<FlushSignal>, StorageError<NodeId>> {
        self.write_entries(entries).map(|w| w.signals)
    }

    fn write_entries(
        &self,
        entries: impl IntoIterator<Item = Entry<TypeConfig>>,
    ) -> Result<Written, StorageError<NodeId>> {
        let mut batch = self.db.database().batch();
        let mut w = Written {
            signals: Vec::new(),
            first: None,
            own: true,
        };
        for entry in entries {
            let id = *entry.get_log_id();
            let bytes = codec::to_vec(&entry).map_err(write_err)?;
            self.written_bytes
                .fetch_add(bytes.len() as u64, Ordering::Relaxed);
            batch.insert(&self.log, id.index.to_be_bytes(), bytes);
            w.own &= self.own(&id.leader_id);
            w.first.get_or_insert(id.index);
            if let EntryPayload::Normal(b) = entry.payload {
                if b.on_flushed.is_set() {
                    w.signals.push(b.on_flushed);
                }
            }
        }
        batch.commit().map_err(write_err)?;
        Ok(w)
    }
}

/// What one append wrote.
struct Written {
    /// The flush signals its entries carry (the leader's own proposals).
    signals: Vec<FlushSignal>,
    /// The index of its first entry.
    first: Option<u64>,
    /// Whether every entry is this broker's own, as leader of the vote it holds.
    own: bool,
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>, StorageError<NodeId>> {
        let (start, end) = byte_range(range);
        self.log
            .range((start, end))
            .map(|g| {
                let (_, v) = g.into_inner().map_err(read_err)?;
                codec::decode(&v).map_err(read_err)
            })
            .collect()
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError<NodeId>> {
        let last_purged: Option<LogId<NodeId>> = self.get_meta(LAST_PURGED)?;
        let last_stored = self.last_stored()?;
        // Entries a purge covers may still be stored (they are deleted in the
        // background), and a purge may reach past the last entry (a snapshot).
        let last = match (last_stored, last_purged) {
            (Some(s), Some(p)) if s.index <= p.index => Some(p),
            (stored, purged) => stored.or(purged),
        };
        Ok(LogState {
            last_purged_log_id: last_purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError<NodeId>> {
        let fault = self.db.fault().clone();
        let r: Result<(), StorageError<NodeId>> = async {
            self.put_meta(VOTE, vote)?;
            // A vote must never be forgotten, whatever the durability mode.
            self.db.sync().map_err(write_err)?;
            self.vote = Some(*vote);
            Ok(())
        }
        .await;
        fault.note(r)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError<NodeId>> {
        self.stored_vote()
    }

    // No `save_committed`/`read_committed`: the state machine persists what it applied
    // together with last-applied, so nothing needs the committed id after a restart,
    // and storing it cost a journal write per commit on every replica.

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError<NodeId>>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let fault = self.db.fault().clone();
        let r: Result<(), StorageError<NodeId>> = async {
            let Written {
                signals,
                first,
                own,
            } = self.write_entries(entries)?;
            let Some(first) = first else {
                callback.log_io_completed(Ok(()));
                return Ok(());
            };
            let seq = self.durable.wrote(first);
            // The leader's own entries count as stored once written, so Raft replicates
            // them while this flush runs; what their commit makes visible waits for it
            // (see [`Durable`]). A follower's entries count once flushed: its answer is
            // what a leader counts on.
            let callback = if own && self.db.durability() == Durability::Fsync {
                callback.log_io_completed(Ok(()));
                None
            } else {
                Some(callback)
            };
            let durable = self.durable.clone();
            self.db.after_flush(move |result| {
                durable.flushed(seq, &result);
                if let Some(callback) = callback {
                    callback.log_io_completed(result);
                }
                // A failed flush fires them too: the proposer must not wait on an
                // append Raft has given up on.
                signals.iter().for_each(FlushSignal::fire);
            });
            Ok(())
        }
        .await;
        fault.note(r)
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        let fault = self.db.fault().clone();
        let r: Result<(), StorageError<NodeId>> = async {
            let mut batch = self.db.database().batch();
            for k in self.keys_in(log_id.index..)? {
                batch.remove(&self.log, k);
            }
            batch.commit().map_err(write_err)
        }
        .await;
        fault.note(r)
    }

    /// Records the purge, then deletes the entries on a blocking thread: a snapshot
    /// covers tens of thousands of entries, and deleting them here held up this
    /// partition's Raft core (and a runtime worker) for about 100 ms each time.
    /// Entries at or below the purged id are never read again; any the deletion
    /// leaves behind (the broker stopped) go when the log is next opened.
    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        let fault = self.db.fault().clone();
        let r: Result<(), StorageError<NodeId>> = async {
            self.put_meta(LAST_PURGED, &log_id)?;
            let from = self
                .deleted_below
                .fetch_max(log_id.index + 1, Ordering::AcqRel);
            if from > log_id.index {
                return Ok(());
            }
            let (db, log) = (self.db.clone(), self.log.clone());
            tokio::task::spawn_blocking(move || {
                let started = std::time::Instant::now();
                let mut start = from;
                while start <= log_id.index {
                    let end = log_id.index.min(start.saturating_add(PURGE_CHUNK - 1));
                    let mut batch = db.database().batch();
                    for index in start..=end {
                        batch.remove(&log, index.to_be_bytes());
                    }
                    if let Err(e) = batch.commit() {
                        // A write that fails is the broker's storage fault (see
                        // `failstop`); what is left goes when the log is next opened.
                        db.fault()
                            .set(&format!("deleting purged log entries failed: {e}"));
                        return;
                    }
                    start = end + 1;
                    if start <= log_id.index {
                        std::thread::sleep(PURGE_PAUSE);
                    }
                }
                crate::metrics::PURGE_SECONDS.observe(started.elapsed().as_secs_f64());
                tracing::debug!(from, to = log_id.index, took = ?started.elapsed(), "log purged");
            });
            Ok(())
        }
        .await;
        fault.note(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Batch;
    use crate::store::Durability;
    use openraft::CommittedLeaderId;
    use std::time::Duration;

    fn id(index: u64) -> LogId<NodeId> {
        LogId::new(CommittedLeaderId::new(1, 1), index)
    }

    fn entries(range: std::ops::RangeInclusive<u64>) -> Vec<Entry<TypeConfig>> {
        range
            .map(|i| Entry {
                log_id: id(i),
                payload: EntryPayload::Blank,
            })
            .collect()
    }

    async fn stored(log: &mut LogStore) -> Vec<u64> {
        log.try_get_log_entries(0..u64::MAX)
            .await
            .unwrap()
            .iter()
            .map(|e| e.log_id.index)
            .collect()
    }

    /// A purge returns at once and the entries go in the background; the log's
    /// state says what was purged meanwhile, also past its last entry.
    #[tokio::test]
    async fn purged_entries_are_deleted_in_the_background() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(dir.path(), Durability::Replicated).unwrap();
        let mut log = LogStore::open(&db, 1, 1).unwrap();
        log.write(entries(1..=2000)).unwrap();
        log.purge(id(1500)).await.unwrap();
        let state = log.get_log_state().await.unwrap();
        assert_eq!(state.last_purged_log_id, Some(id(1500)));
        assert_eq!(state.last_log_id, Some(id(2000)));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while stored(&mut log).await.len() > 500 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "not deleted in 10 s"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(stored(&mut log).await, (1501..=2000).collect::<Vec<_>>());

        // A snapshot beyond the log's end purges past its last entry.
        log.purge(id(2500)).await.unwrap();
        let state = log.get_log_state().await.unwrap();
        assert_eq!(state.last_purged_log_id, Some(id(2500)));
        assert_eq!(state.last_log_id, Some(id(2500)));
    }

    /// Entries a purge recorded but did not delete before the broker stopped are
    /// deleted when the log is opened again.
    #[tokio::test]
    async fn leftovers_of_a_purge_go_when_the_log_is_opened() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(dir.path(), Durability::Replicated).unwrap();
        let log = LogStore::open(&db, 1, 1).unwrap();
        log.write(entries(1..=10)).unwrap();
        log.put_meta(LAST_PURGED, &id(6)).unwrap();
        let mut reopened = LogStore::open(&db, 1, 1).unwrap();
        assert_eq!(stored(&mut reopened).await, vec![7, 8, 9, 10]);
    }

    /// Only the entries this broker appends as leader of a granted vote of its own
    /// count as stored before their flush: not a follower's, not its own entries
    /// of an earlier term sent back to it, not while its vote is not granted.
    #[tokio::test]
    async fn only_a_leaders_own_entries_of_its_granted_vote_count_as_stored_when_written() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(dir.path(), Durability::Fsync).unwrap();
        let mut log = LogStore::open(&db, 1, 1).unwrap();
        let of = |term, node, index| Entry::<TypeConfig> {
            log_id: LogId::new(CommittedLeaderId::new(term, node), index),
            payload: EntryPayload::Blank,
        };
        let own = |log: &LogStore, e: Entry<TypeConfig>| log.write_entries([e]).unwrap().own;

        assert!(!own(&log, of(1, 1, 1)), "no vote");
        log.save_vote(&Vote::new(2, 1)).await.unwrap();
        assert!(!own(&log, of(2, 1, 1)), "a vote not granted yet");
        log.save_vote(&Vote::new_committed(2, 1)).await.unwrap();
        assert!(own(&log, of(2, 1, 1)), "its own entry as leader");
        assert!(!own(&log, of(1, 1, 1)), "its entry of an earlier term");
        log.save_vote(&Vote::new_committed(3, 2)).await.unwrap();
        assert!(!own(&log, of(3, 2, 1)), "another leader's entry");
        assert!(!own(&log, of(2, 1, 1)));

        // Opened again, a broker does not resume leading the term it led: its own
        // granted vote reads as its vote for itself, so it stands for election.
        log.save_vote(&Vote::new_committed(4, 1)).await.unwrap();
        let mut reopened = LogStore::open(&db, 1, 1).unwrap();
        assert_eq!(reopened.read_vote().await.unwrap(), Some(Vote::new(4, 1)));
        assert!(!own(&reopened, of(4, 1, 1)));
        // Another broker's granted vote reads as it was saved.
        let mut other_broker = LogStore::open(&db, 1, 2).unwrap();
        assert_eq!(
            other_broker.read_vote().await.unwrap(),
            Some(Vote::new_committed(4, 1))
        );
        assert!(!own(&other_broker, of(4, 1, 1)));
    }

    /// A write hands back the flush signals its entries carry, unfired, so the append
    /// can fire them after the flush; the stored entries carry none.
    #[tokio::test]
    async fn a_write_hands_back_the_flush_signals_and_stores_none() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(dir.path(), Durability::Replicated).unwrap();
        let mut log = LogStore::open(&db, 1, 1).unwrap();
        let (tx, mut flushed) = tokio::sync::oneshot::channel();
        let signal = FlushSignal::new(move || {
            let _ = tx.send(());
        });
        let mut written = entries(1..=3);
        written[1].payload = EntryPayload::Normal(Batch {
            ts: 7,
            commands: Vec::new(),
            on_flushed: signal,
        });
        let signals = log.write(written).unwrap();
        assert_eq!(signals.len(), 1);
        assert!(flushed.try_recv().is_err(), "fired before the flush");
        signals[0].fire();
        assert_eq!(flushed.try_recv(), Ok(()));

        let read = log.try_get_log_entries(2..3).await.unwrap();
        match &read[0].payload {
            EntryPayload::Normal(b) => {
                assert_eq!(b.ts, 7);
                assert!(!b.on_flushed.is_set());
            }
            other => panic!("entry 2 is {other:?}"),
        }
    }
}
