//! A partition's snapshot on disk, streamed in and out rather than held in memory.
//!
//! - `p{n}-{stamp}.data`: the snapshot's data (the encoding of `SnapshotData`),
//!   written, or received from the leader, and fsynced first.
//! - `p{n}.snap`: which data file is current, with the snapshot's meta: a 4-byte
//!   big-endian meta length, the encoded meta, then the data file's name. Written to
//!   a temporary file, fsynced, renamed over the last one, and its directory fsynced,
//!   so it never names data that is not all on disk.
//!
//! A snapshot being built is written as `.part`, one being received as `.recv`; it
//! becomes a `.data` file only when it is switched to, under the lock that also
//! removes the data files that are no longer current (one being read, to send it
//! to a follower, stays readable until closed).

use super::super::{read_err, write_err};
use courier_proto::codec;
use courier_proto::domain::NodeId;
use openraft::{BasicNode, SnapshotMeta, StorageError};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// The current snapshot: its meta and its data file.
#[derive(Clone)]
pub struct Current {
    pub meta: SnapshotMeta<NodeId, BasicNode>,
    pub data: PathBuf,
}

/// A snapshot's meta and its data file, opened for reading.
pub type Opened = (SnapshotMeta<NodeId, BasicNode>, std::fs::File);

/// The snapshot files of one partition.
pub struct SnapshotFiles {
    dir: PathBuf,
    partition: u32,
    current: Mutex<Option<Current>>,
    /// Makes data file names unique within this process.
    next: AtomicU64,
    /// A received and checked `.recv` file, handed to Raft to install (see `intake`).
    received: Mutex<Option<PathBuf>>,
}

impl SnapshotFiles {
    /// Opens the snapshot of `partition` in `dir`: converts a snapshot file of data
    /// format 4 (meta and data in one file), and removes data files that are not
    /// current (a snapshot being built or received when the broker stopped).
    pub fn open(dir: &Path, partition: u32) -> Result<SnapshotFiles, StorageError<NodeId>> {
        std::fs::create_dir_all(dir).map_err(read_err)?;
        let files = SnapshotFiles {
            dir: dir.to_path_buf(),
            partition,
            current: Mutex::new(None),
            next: AtomicU64::new(0),
            received: Mutex::new(None),
        };
        let current = match files.read_index()? {
            Some(c) => Some(c),
            None => files.convert_single_file()?,
        };
        *files.lock() = current;
        files.remove_unfinished();
        files.remove_stale(&files.lock());
        Ok(files)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Current>> {
        self.current.lock().unwrap_or_else(|p| p.into_inner())
    }

    #[cfg(test)]
    pub fn current(&self) -> Option<Current> {
        self.lock().clone()
    }

    /// The current snapshot's meta and its data, opened for reading; `None` when
    /// there is none. Opened under the lock: a switch cannot remove it first.
    pub fn open_current(&self) -> Result<Option<Opened>, StorageError<NodeId>> {
        let current = self.lock();
        let Some(c) = current.as_ref() else {
            return Ok(None);
        };
        let f = std::fs::File::open(&c.data).map_err(read_err)?;
        Ok(Some((c.meta.clone(), f)))
    }

    /// Notes `path` as the received snapshot handed to Raft to install; an earlier
    /// one that was never installed is removed.
    pub fn received(&self, path: PathBuf) {
        let mut slot = self.received.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(old) = slot.replace(path) {
            let _ = std::fs::remove_file(old);
        }
    }

    /// The received snapshot handed to Raft, if one is waiting to be installed.
    pub fn take_received(&self) -> Option<PathBuf> {
        self.received
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    fn index_path(&self) -> PathBuf {
        self.dir.join(format!("p{}.snap", self.partition))
    }

    /// A new data file's path; `kind` is `part` for a snapshot being built, `recv`
    /// for one being received.
    pub fn new_data_path(&self, kind: &str) -> PathBuf {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        self.dir
            .join(format!("p{}-{stamp}-{n}.{kind}", self.partition))
    }

    /// Makes the fsynced file `written` (a `.part` or `.recv` of this directory) the
    /// current snapshot's data with `meta`, unless the current one is newer: then
    /// `written` is removed and the current one stays.
    pub fn switch(
        &self,
        meta: SnapshotMeta<NodeId, BasicNode>,
        written: &Path,
    ) -> Result<Current, StorageError<NodeId>> {
        let mut current = self.lock();
        if let Some(c) = current
            .as_ref()
            .filter(|c| c.meta.last_log_id > meta.last_log_id)
        {
            let _ = std::fs::remove_file(written);
            return Ok(c.clone());
        }
        let data = written.with_extension("data");
        std::fs::rename(written, &data).map_err(write_err)?;
        let name = data.file_name().and_then(|n| n.to_str()).ok_or_else(|| {
            write_err(std::io::Error::other("a snapshot data file without a name"))
        })?;
        let encoded = codec::to_vec(&meta).map_err(write_err)?;
        let mut index = Vec::with_capacity(4 + encoded.len() + name.len());
        index.extend_from_slice(&(encoded.len() as u32).to_be_bytes());
        index.extend_from_slice(&encoded);
        index.extend_from_slice(name.as_bytes());
        // The rename of the data is made durable with the index's (same directory).
        write_durably(&self.index_path(), &index)?;
        let next = Current { meta, data };
        *current = Some(next.clone());
        self.remove_stale(&current);
        Ok(next)
    }

    fn read_index(&self) -> Result<Option<Current>, StorageError<NodeId>> {
        let path = self.index_path();
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(read_err(e)),
        };
        let corrupt = || {
            read_err(std::io::Error::other(format!(
                "snapshot index {} is corrupt",
                path.display()
            )))
        };
        let (meta, name) = split(&bytes).ok_or_else(corrupt)?;
        let name = std::str::from_utf8(name).map_err(|_| corrupt())?;
        if name.is_empty() || name.contains('/') {
            return Err(corrupt());
        }
        Ok(Some(Current {
            meta: codec::decode(meta).map_err(read_err)?,
            data: self.dir.join(name),
        }))
    }

    /// Data format 4 kept a snapshot as `p{n}.snapshot`: the meta's length, the meta,
    /// then the data. Its data becomes a data file and its meta the index.
    fn convert_single_file(&self) -> Result<Option<Current>, StorageError<NodeId>> {
        let old = self.dir.join(format!("p{}.snapshot", self.partition));
        let bytes = match std::fs::read(&old) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(read_err(e)),
        };
        let (meta, data) = split(&bytes).ok_or_else(|| {
            read_err(std::io::Error::other(format!(
                "snapshot file {} is corrupt",
                old.display()
            )))
        })?;
        let meta = codec::decode(meta).map_err(read_err)?;
        let path = self.new_data_path("part");
        write_durably(&path, data)?;
        let current = self.switch(meta, &path)?;
        std::fs::remove_file(&old).map_err(write_err)?;
        Ok(Some(current))
    }

    /// Removes this partition's data files other than `current`'s.
    fn remove_stale(&self, current: &Option<Current>) {
        let keep = current.as_ref().map(|c| &c.data);
        let prefix = format!("p{}-", self.partition);
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for e in entries.flatten() {
            let path = e.path();
            let name = e.file_name();
            let Some(name) = name.to_str() else {
                continue;
            };
            let ours = name.starts_with(&prefix) && name.ends_with(".data");
            if ours && keep != Some(&path) {
                let _ = std::fs::remove_file(&path);
            }
        }
    }

    /// Removes the files of snapshots being built or received when the broker
    /// stopped.
    fn remove_unfinished(&self) {
        let prefix = format!("p{}-", self.partition);
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            if name.to_str().is_some_and(|n| {
                n.starts_with(&prefix) && [".part", ".recv", ".tmp"].iter().any(|x| n.ends_with(x))
            }) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

/// Splits `bytes` into the meta (after its 4-byte length) and what follows it.
fn split(bytes: &[u8]) -> Option<(&[u8], &[u8])> {
    let len = u32::from_be_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
    let meta = bytes.get(4..4usize.checked_add(len)?)?;
    Some((meta, bytes.get(4 + len..)?))
}

/// Writes `path` atomically and durably: a temporary file, fsynced, renamed over it,
/// and the directory fsynced so the rename itself survives a crash.
fn write_durably(path: &Path, bytes: &[u8]) -> Result<(), StorageError<NodeId>> {
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp).map_err(write_err)?;
    f.write_all(bytes)
        .and_then(|()| f.sync_data())
        .map_err(write_err)?;
    std::fs::rename(&tmp, path).map_err(write_err)?;
    sync_dir(path)
}

/// Fsyncs the directory holding `path`: a rename or a new file in it is then on disk.
pub fn sync_dir(path: &Path) -> Result<(), StorageError<NodeId>> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(write_err)
}
