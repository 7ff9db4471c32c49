//! A snapshot sent by a leader, taken in chunk by chunk and checked before Raft
//! installs it. A snapshot that cannot be decoded is the sender's fault: it is
//! refused, where installing it would fail in the state machine and stop this
//! replica for good as a storage fault.

use super::snapfile::SnapshotFiles;
use super::SnapshotData;
use crate::raft::TypeConfig;
use courier_proto::domain::NodeId;
use openraft::storage::Snapshot;
use openraft::{BasicNode, SnapshotId, SnapshotMeta};
use std::io::BufRead;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Why a chunk was not taken.
#[derive(Debug, thiserror::Error)]
pub enum IntakeError {
    /// A chunk past the start of a snapshot this replica is not receiving.
    #[error("chunk at offset {offset} of snapshot {id}, which is not being received")]
    NotStarted { id: SnapshotId, offset: u64 },
    /// The whole snapshot was received but is not a snapshot Courier can read.
    #[error("snapshot {id} cannot be decoded: {reason}")]
    Undecodable { id: SnapshotId, reason: String },
    /// Writing or reading the received bytes failed on this broker's disk.
    #[error("snapshot file: {0}")]
    Io(#[from] std::io::Error),
}

/// The snapshot being received, if any.
struct Incoming {
    id: SnapshotId,
    path: PathBuf,
    file: Arc<std::fs::File>,
}

/// Takes in the snapshots of one partition.
pub struct SnapshotIntake {
    files: Arc<SnapshotFiles>,
    incoming: tokio::sync::Mutex<Option<Incoming>>,
}

impl SnapshotIntake {
    pub(super) fn new(files: Arc<SnapshotFiles>) -> SnapshotIntake {
        SnapshotIntake {
            files,
            incoming: tokio::sync::Mutex::new(None),
        }
    }

    /// Writes one chunk at `offset`. The last (`done`) gives the whole snapshot,
    /// fsynced and decoded once to check it, for Raft to install; a snapshot that
    /// fails the check is removed and refused.
    pub async fn receive(
        &self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        offset: u64,
        data: bytes::Bytes,
        done: bool,
    ) -> Result<Option<Snapshot<TypeConfig>>, IntakeError> {
        let mut incoming = self.incoming.lock().await;
        if incoming.as_ref().map(|i| &i.id) != Some(&meta.snapshot_id) {
            if offset != 0 {
                return Err(IntakeError::NotStarted {
                    id: meta.snapshot_id.clone(),
                    offset,
                });
            }
            // Another snapshot, or one begun again: the bytes of the last are dropped.
            if let Some(old) = incoming.take() {
                let _ = std::fs::remove_file(old.path);
            }
            let path = self.files.new_data_path("recv");
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&path)?;
            *incoming = Some(Incoming {
                id: meta.snapshot_id.clone(),
                path,
                file: Arc::new(file),
            });
        }
        let Some(i) = incoming.as_ref() else {
            return Err(std::io::Error::other("no snapshot being received").into());
        };
        let file = i.file.clone();
        blocking(move || file.write_all_at(&data, offset)).await?;
        if !done {
            return Ok(None);
        }
        let Some(i) = incoming.take() else {
            return Err(std::io::Error::other("no snapshot being received").into());
        };
        let (path, file) = (i.path.clone(), i.file.clone());
        let checked = blocking(move || {
            file.sync_data()?;
            Ok(check(&path))
        })
        .await?;
        if let Err(reason) = checked {
            let _ = std::fs::remove_file(&i.path);
            return Err(IntakeError::Undecodable { id: i.id, reason });
        }
        let file = Arc::try_unwrap(i.file).map_or_else(|f| f.try_clone(), Ok)?;
        self.files.received(i.path);
        Ok(Some(Snapshot {
            meta: meta.clone(),
            snapshot: Box::new(tokio::fs::File::from_std(file)),
        }))
    }
}

/// Whether the file at `path` reads as a whole snapshot, with nothing after it.
pub(super) fn check(path: &Path) -> Result<(), String> {
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let mut r = std::io::BufReader::new(file);
    SnapshotData::read(&mut r).map_err(|e| e.to_string())?;
    match r.fill_buf() {
        Ok([]) => Ok(()),
        Ok(_) => Err("bytes after the end of the snapshot".into()),
        Err(e) => Err(e.to_string()),
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(std::io::Error::other)?
}
