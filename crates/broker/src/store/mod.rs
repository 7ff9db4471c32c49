//! Storage of a broker on fjall: one database per broker, keyspaces per partition
//! (`p{N}.log`, `p{N}.meta`, `p{N}.jobs`).
//!
//! - [`Db`] opens the database and owns the syncer thread, which turns the
//!   durability setting into one `fdatasync` per group of appends (across all
//!   partitions of the broker).
//! - [`log::LogStore`] is the openraft log (`RaftLogStorage`).
//! - [`sm::StateMachine`] is the openraft state machine: the engine's state,
//!   persisted atomically with last-applied, and its snapshots.

pub mod log;
pub mod sm;

use crate::raft::TypeConfig;
use fjall::{Database, Keyspace, KeyspaceCreateOptions, PersistMode};
use openraft::storage::LogFlushed;
use openraft::{StorageError, StorageIOError};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

/// When an appended log entry counts as stored.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum Durability {
    /// Every append batch is flushed with fdatasync before it counts toward a commit:
    /// an acknowledged job survives power loss of every replica.
    #[default]
    Fsync,
    /// An append counts once written to the OS; the log is flushed every
    /// `flush_interval`. An acknowledged job survives process crashes, and machine
    /// failures of a minority of replicas.
    Replicated,
}

impl std::str::FromStr for Durability {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fsync" => Ok(Durability::Fsync),
            "replicated" => Ok(Durability::Replicated),
            other => Err(format!(
                "unknown durability '{other}': expected 'fsync' or 'replicated'"
            )),
        }
    }
}

/// Flush period of the `replicated` durability mode.
pub const REPLICATED_FLUSH_INTERVAL: Duration = Duration::from_millis(50);

/// A broker's fjall database and its syncer.
#[derive(Clone)]
pub struct Db {
    db: Database,
    durability: Durability,
    /// Appends waiting for a flush; the syncer thread ends when every sender is dropped.
    sync_tx: mpsc::Sender<LogFlushed<TypeConfig>>,
}

impl Db {
    /// Opens (or creates) the database in `dir` and starts its syncer thread.
    pub fn open(dir: &Path, durability: Durability) -> Result<Db, fjall::Error> {
        let db = Database::builder(dir).open()?;
        let (sync_tx, sync_rx) = mpsc::channel();
        let syncer_db = db.clone();
        std::thread::Builder::new()
            .name("courier-syncer".into())
            .spawn(move || run_syncer(syncer_db, durability, sync_rx))
            .map_err(fjall::Error::from)?;
        Ok(Db {
            db,
            durability,
            sync_tx,
        })
    }

    pub fn durability(&self) -> Durability {
        self.durability
    }

    pub(crate) fn keyspace(&self, name: &str) -> Result<Keyspace, fjall::Error> {
        self.db.keyspace(name, KeyspaceCreateOptions::default)
    }

    pub(crate) fn database(&self) -> &Database {
        &self.db
    }

    /// Completes `callback` once the appends written before it are durable per the
    /// durability setting.
    pub(crate) fn flushed(&self, callback: LogFlushed<TypeConfig>) {
        match self.durability {
            // Written to the OS already (fjall flushes each batch to the OS).
            Durability::Replicated => callback.log_io_completed(Ok(())),
            Durability::Fsync => {
                if let Err(mpsc::SendError(cb)) = self.sync_tx.send(callback) {
                    cb.log_io_completed(Err(std::io::Error::other("syncer stopped")));
                }
            }
        }
    }

    /// Flushes everything written so far to disk, now.
    pub fn sync(&self) -> Result<(), fjall::Error> {
        self.db.persist(PersistMode::SyncData)
    }
}

/// One fdatasync covers every append queued since the previous one: group commit
/// across the partitions of a broker.
fn run_syncer(db: Database, durability: Durability, rx: mpsc::Receiver<LogFlushed<TypeConfig>>) {
    let mut waiting = Vec::new();
    loop {
        let first = match durability {
            Durability::Fsync => match rx.recv() {
                Ok(cb) => Some(cb),
                Err(_) => return,
            },
            Durability::Replicated => match rx.recv_timeout(REPLICATED_FLUSH_INTERVAL) {
                Ok(cb) => Some(cb),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            },
        };
        waiting.extend(first);
        waiting.extend(rx.try_iter());
        let result = db.persist(PersistMode::SyncData);
        if let Err(e) = &result {
            tracing::error!(error = %e, "flushing the log failed");
        }
        for cb in waiting.drain(..) {
            cb.log_io_completed(
                result
                    .as_ref()
                    .map(|_| ())
                    .map_err(|e| std::io::Error::other(e.to_string())),
            );
        }
    }
}

/// Maps a storage failure to openraft's error for reads.
pub(crate) fn read_err(e: impl std::error::Error + 'static) -> StorageError<u64> {
    StorageIOError::read(&e).into()
}

/// Maps a storage failure to openraft's error for writes.
pub(crate) fn write_err(e: impl std::error::Error + 'static) -> StorageError<u64> {
    StorageIOError::write(&e).into()
}
