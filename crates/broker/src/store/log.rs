//! A partition's Raft log in fjall: entries keyed by big-endian index, plus the vote
//! and the last purged id in the partition's meta keyspace.

use super::{read_err, write_err, Db};
use crate::raft::TypeConfig;
use courier_proto::codec;
use fjall::Keyspace;
use openraft::storage::{LogFlushed, LogState, RaftLogReader, RaftLogStorage};
use openraft::{Entry, LogId, OptionalSend, RaftLogId, StorageError, Vote};
use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};

const VOTE: &[u8] = b"vote";
const LAST_PURGED: &[u8] = b"last_purged";

type NodeId = u64;

/// The log of one partition.
#[derive(Clone)]
pub struct LogStore {
    db: Db,
    log: Keyspace,
    meta: Keyspace,
}

impl LogStore {
    /// Opens the log of `partition` in `db`.
    pub fn open(db: &Db, partition: u32) -> Result<LogStore, fjall::Error> {
        Ok(LogStore {
            db: db.clone(),
            log: db.keyspace(&format!("p{partition}.log"))?,
            meta: db.keyspace(&format!("p{partition}.meta"))?,
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
    pub fn write(
        &self,
        entries: impl IntoIterator<Item = Entry<TypeConfig>>,
    ) -> Result<(), StorageError<NodeId>> {
        let mut batch = self.db.database().batch();
        for entry in entries {
            let bytes = codec::to_vec(&entry).map_err(write_err)?;
            batch.insert(&self.log, entry.get_log_id().index.to_be_bytes(), bytes);
        }
        batch.commit().map_err(write_err)
    }
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
        let last = match self.log.last_key_value() {
            None => last_purged,
            Some(g) => {
                let (_, v) = g.into_inner().map_err(read_err)?;
                let entry: Entry<TypeConfig> = codec::decode(&v).map_err(read_err)?;
                Some(*entry.get_log_id())
            }
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
        self.put_meta(VOTE, vote)?;
        // A vote must never be forgotten, whatever the durability mode.
        self.db.sync().map_err(write_err)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError<NodeId>> {
        self.get_meta(VOTE)
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
        self.write(entries)?;
        self.db.flushed(callback);
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        let mut batch = self.db.database().batch();
        for k in self.keys_in(log_id.index..)? {
            batch.remove(&self.log, k);
        }
        batch.commit().map_err(write_err)
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        let mut batch = self.db.database().batch();
        batch.insert(
            &self.meta,
            LAST_PURGED,
            codec::to_vec(&log_id).map_err(write_err)?,
        );
        for k in self.keys_in(..=log_id.index)? {
            batch.remove(&self.log, k);
        }
        batch.commit().map_err(write_err)
    }
}
