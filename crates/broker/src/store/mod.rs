//! Storage of a broker on fjall: one database per broker, keyspaces per partition
//! (`p{N}.log`, `p{N}.meta`, `p{N}.jobs`).
//!
//! - [`Db`] opens the database and owns the syncer, whose threads turn the
//!   durability setting into one `fdatasync` per group of appends (across all
//!   partitions of the broker), two of them at most at once.
//! - [`log::LogStore`] is the openraft log (`RaftLogStorage`).
//! - [`sm::StateMachine`] is the openraft state machine: the engine's state,
//!   persisted atomically with last-applied, and its snapshots.
//! - [`Fault`] is the broker's first storage failure: storage is fail-stop.

pub mod durable;
mod fault;
pub mod log;
pub mod sm;

pub use fault::Fault;

use fjall::{Database, Keyspace, KeyspaceCreateOptions, PersistMode};
use openraft::{StorageError, StorageIOError};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
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

/// The version of what a broker writes to its data directory (log entries, jobs,
/// snapshots), kept in the directory's `FORMAT` file. 2: activations record the
/// gateway and term of their push. 3: log entries may hold `Command::Once`, and
/// a partition stores the requests it remembers (a keyspace, and a snapshot's
/// tail). 4: log entries may hold `Command::ActivateWithin`. 5: a partition's
/// snapshot is a data file named by an index file (`pN.snap`), where it was one file
/// (`pN.snapshot`), converted when the partition opens; a job's payload may be
/// stored apart (keyspace `pN.payloads`), its record then ending with the payload's
/// size.
pub const DATA_FORMAT: u32 = 5;

/// The earlier formats this broker reads: each later one adds to them, or changes
/// what the broker converts as it opens a partition, so such a directory is marked
/// [`DATA_FORMAT`] and used (after which the version that wrote it refuses it, as it
/// could not read what is added).
const UPGRADES_FROM: [u32; 3] = [2, 3, 4];

/// Why a data directory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum DataDirError {
    #[error(
        "the data directory {} was written by another version of Courier ({found}); this \
         broker reads format {DATA_FORMAT}. Run the version that wrote it, or remove the \
         directory (its jobs are lost) to start afresh",
        dir.display()
    )]
    OtherFormat { dir: PathBuf, found: String },
    #[error(
        "the data directory {} belongs to {recorded}; this broker is configured as \
         {configured}. Brokers, partitions and replication factor cannot change over \
         existing data: start with the options that wrote it (for `courier dev`: \
         --brokers, --partitions, --replication-factor), or use another --data-dir (or \
         remove this one: its jobs are lost)",
        dir.display()
    )]
    OtherCluster {
        dir: PathBuf,
        recorded: String,
        configured: String,
    },
    #[error("cannot {doing} {}: {source}", path.display())]
    Io {
        doing: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Makes sure `dir` holds data this broker can read: a new directory is marked with
/// [`DATA_FORMAT`], one of [`UPGRADES_FROM`] is marked anew; one written in another
/// format (or before formats were marked) is refused with what to do, instead of
/// being misread.
pub fn check_format(dir: &Path) -> Result<(), DataDirError> {
    let marker = dir.join("FORMAT");
    let refuse = |found: &str| {
        Err(DataDirError::OtherFormat {
            dir: dir.to_path_buf(),
            found: found.to_string(),
        })
    };
    let io = |doing, source| DataDirError::Io {
        doing,
        path: marker.clone(),
        source,
    };
    match std::fs::read_to_string(&marker) {
        Ok(text) => match text.trim().parse::<u32>() {
            Ok(v) if v == DATA_FORMAT => Ok(()),
            Ok(v) if UPGRADES_FROM.contains(&v) => {
                write_durably(dir, &marker, format!("{DATA_FORMAT}\n").as_bytes())
                    .map_err(|e| io("mark", e))?;
                tracing::info!(
                    dir = %dir.display(),
                    "data directory of format {v} marked {DATA_FORMAT}"
                );
                Ok(())
            }
            Ok(v) => refuse(&format!("format {v}")),
            Err(_) => refuse(&format!("unreadable FORMAT file {:?}", text.trim())),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if dir.join("db").exists() {
                return refuse("format 1, from before formats were marked");
            }
            write_durably(dir, &marker, format!("{DATA_FORMAT}\n").as_bytes())
                .map_err(|e| io("mark", e))
        }
        Err(e) => Err(io("read", e)),
    }
}

/// Makes sure `dir` was written by a broker of the same cluster shape, `shape` (see
/// [`crate::config::BrokerConfig::shape`]): Raft's membership and the placement of
/// partitions come from it, and a replica restarted into another one would misread
/// its log (openraft panics on it) and hand out keys again. A new directory, or one
/// from before shapes were recorded, is marked with `shape`.
pub fn check_shape(dir: &Path, shape: &str) -> Result<(), DataDirError> {
    if !compare_shape(dir, shape)? {
        let marker = dir.join("CLUSTER");
        write_durably(dir, &marker, format!("{shape}\n").as_bytes()).map_err(|source| {
            DataDirError::Io {
                doing: "mark",
                path: marker.clone(),
                source,
            }
        })?;
    }
    Ok(())
}

/// [`check_shape`] without marking anything: whether `dir` records `shape` (true),
/// records none (false), or another one (the error says what to do).
pub fn compare_shape(dir: &Path, shape: &str) -> Result<bool, DataDirError> {
    let marker = dir.join("CLUSTER");
    match std::fs::read_to_string(&marker) {
        Ok(text) if text.trim() == shape => Ok(true),
        Ok(text) => Err(DataDirError::OtherCluster {
            dir: dir.to_path_buf(),
            recorded: text.trim().to_string(),
            configured: shape.to_string(),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(DataDirError::Io {
            doing: "read",
            path: marker,
            source,
        }),
    }
}

/// Writes `path` (in `dir`) whole or not at all, and makes it durable: through a
/// temporary file, fsynced, renamed over it, and the directory fsynced.
fn write_durably(dir: &Path, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    std::fs::create_dir_all(dir)?;
    let tmp = path.with_extension("tmp");
    let mut f = File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    File::open(dir)?.sync_all()
}

/// Flush period of the `replicated` durability mode.
pub const REPLICATED_FLUSH_INTERVAL: Duration = Duration::from_millis(50);

/// The most fjall keeps in journals before it flushes the memtables that pin the
/// oldest (its default is 512 MiB). A broker that crashed replays its journals before
/// it starts, so a smaller bound halves both the data left after a burst of load and
/// the time a restart after a crash takes, at the same throughput. 64 MiB is the
/// least fjall accepts.
const MAX_JOURNALING_BYTES: u64 = 64 * 1024 * 1024;

/// The most a keyspace's memtable holds before it is flushed to a table (fjall's
/// default is 64 MiB). Log entries and jobs live briefly (compacted away after a
/// snapshot, deleted when completed), so a memtable is mostly data already gone.
const MAX_MEMTABLE_BYTES: u64 = 16 * 1024 * 1024;

/// A broker's fjall database and its syncer.
#[derive(Clone)]
pub struct Db {
    db: Database,
    durability: Durability,
    /// Appends waiting for a flush; the syncer's threads end when the last clone of
    /// this handle is dropped.
    syncer: Arc<SyncerHandle>,
    fault: Arc<Fault>,
}

impl Db {
    /// Opens (or creates) the database in `dir` and starts its syncer threads.
    pub fn open(dir: &Path, durability: Durability) -> Result<Db, fjall::Error> {
        let db = Database::builder(dir)
            .max_journaling_size(MAX_JOURNALING_BYTES)
            .open()?;
        // What a stopped broker left in the OS's cache is on disk from here on, as
        // this broker tells peers of its log as stored (and a leader counts its own
        // entries as stored before they are flushed, see [`durable`]): fjall's
        // recovery syncs the active journal when it opens one (3.1, `recover`), and
        // older journals were synced when it moved past them.
        let fault = Arc::new(Fault::default());
        let queue = Arc::new(SyncQueue {
            fault: fault.clone(),
            ..SyncQueue::default()
        });
        let flushers = match durability {
            Durability::Fsync => FLUSHERS,
            Durability::Replicated => 1,
        };
        for i in 0..flushers {
            let journal = ActiveJournal::find(dir);
            if i == 0 && journal.is_none() {
                tracing::warn!("no fjall journal file found; flushing through fjall's persist");
            }
            let flusher = Flusher {
                db: db.clone(),
                journal,
                queue: queue.clone(),
            };
            let spawned = std::thread::Builder::new()
                .name(format!("courier-syncer-{i}"))
                .spawn(move || match durability {
                    Durability::Fsync => flusher.run(),
                    Durability::Replicated => flusher.run_periodic(),
                });
            if let Err(e) = spawned {
                queue.close();
                return Err(fjall::Error::from(e));
            }
        }
        Ok(Db {
            db,
            durability,
            syncer: Arc::new(SyncerHandle(queue)),
            fault,
        })
    }

    pub fn durability(&self) -> Durability {
        self.durability
    }

    /// This broker's storage failure, recorded by the syncer or by whoever saw a
    /// write fail.
    pub fn fault(&self) -> &Arc<Fault> {
        &self.fault
    }

    pub(crate) fn keyspace(&self, name: &str) -> Result<Keyspace, fjall::Error> {
        self.db.keyspace(name, || {
            KeyspaceCreateOptions::default().max_memtable_size(MAX_MEMTABLE_BYTES)
        })
    }

    pub(crate) fn database(&self) -> &Database {
        &self.db
    }

    /// Runs `then` once the appends written before this call are durable per the
    /// durability setting (with the flush's outcome).
    pub(crate) fn after_flush(&self, then: impl FnOnce(std::io::Result<()>) + Send + 'static) {
        match self.durability {
            // Written to the OS already (fjall flushes each batch to the OS).
            Durability::Replicated => then(Ok(())),
            Durability::Fsync => self.syncer.0.push(Box::new(then)),
        }
    }

    /// Flushes everything written so far to disk, now.
    pub fn sync(&self) -> Result<(), fjall::Error> {
        self.db.persist(PersistMode::SyncData)
    }
}

/// The journal file fjall appends to, which the syncer flushes through its own file
/// handle: fjall's `persist` holds the journal's lock for the whole fdatasync, so
/// every write of the broker (log appends on the Raft tasks, state-machine applies)
/// would wait for the disk behind it, blocking a runtime worker thread each.
///
/// Relies on fjall's journal layout: `N.jnl` files in the database folder, the
/// highest `N` active, a new one (`N + 1`) created only after the previous one was
/// synced. So a write flushed to the OS before [`ActiveJournal::sync`] starts is in
/// the journal found there, or in an older one that rotation already synced.
struct ActiveJournal {
    dir: PathBuf,
    id: u64,
    file: File,
}

impl ActiveJournal {
    /// The highest-numbered journal in `dir`, or `None` when there is none (a layout
    /// this code does not know: the syncer then falls back to fjall's `persist`).
    fn find(dir: &Path) -> Option<ActiveJournal> {
        let id = std::fs::read_dir(dir)
            .ok()?
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().to_str()?.strip_suffix(".jnl")?.parse().ok())
            .max()?;
        let file = File::open(journal_path(dir, id)).ok()?;
        Some(ActiveJournal {
            dir: dir.to_path_buf(),
            id,
            file,
        })
    }

    /// Makes everything written to the journal so far durable.
    fn sync(&mut self) -> std::io::Result<()> {
        // Follow rotations: a journal is never left for the next before it is synced.
        loop {
            match File::open(journal_path(&self.dir, self.id + 1)) {
                Ok(next) => {
                    self.id += 1;
                    self.file = next;
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                Err(e) => return Err(e),
            }
        }
        self.file.sync_data()
    }
}

fn journal_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id}.jnl"))
}

/// What waits for the syncer's next flush: an append's callbacks.
type Flush = Box<dyn FnOnce(std::io::Result<()>) + Send>;

/// fdatasyncs a broker may have running at once. An append that arrives while a
/// flush runs starts the next at once instead of waiting for it to end: the kernel
/// serves overlapping fdatasyncs of one file side by side, and each covers every
/// write made before it started.
const FLUSHERS: usize = 2;

/// The appends waiting for a flush, shared by the flusher threads.
#[derive(Default)]
struct SyncQueue {
    state: Mutex<SyncState>,
    wake: Condvar,
    /// Held by a flusher from taking the groups its flush made durable until it
    /// has answered them, so groups are answered in the order they started and
    /// Raft hears of its appends in the order it made them. Taken before the
    /// state's lock, never while holding it: an answer may queue the next append.
    answering: Mutex<()>,
    /// Once a flush failed, every later one fails with the same error, unsynced.
    fault: Arc<Fault>,
}

#[derive(Default)]
struct SyncState {
    /// Written, not yet covered by a started fdatasync.
    waiting: Vec<Flush>,
    /// Groups covered by a running fdatasync, by the order it started in.
    running: BTreeMap<u64, Vec<Flush>>,
    next_group: u64,
    closed: bool,
}

impl SyncQueue {
    fn lock(&self) -> MutexGuard<'_, SyncState> {
        // The state stays consistent across a panic in a callback: callbacks run
        // outside the lock.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn push(&self, then: Flush) {
        let mut st = self.lock();
        if st.closed {
            drop(st);
            then(Err(std::io::Error::other("syncer stopped")));
            return;
        }
        st.waiting.push(then);
        drop(st);
        self.wake.notify_one();
    }

    fn close(&self) {
        self.lock().closed = true;
        self.wake.notify_all();
    }
}

/// Stops the flusher threads when the last [`Db`] handle goes, once they have
/// flushed what is waiting.
struct SyncerHandle(Arc<SyncQueue>);

impl Drop for SyncerHandle {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// One flusher thread: its own handle on the journal, so flushes can overlap.
struct Flusher {
    db: Database,
    journal: Option<ActiveJournal>,
    queue: Arc<SyncQueue>,
}

impl Flusher {
    /// Flushes the journal to disk. Every append is written to the OS before its
    /// callback reaches the syncer (fjall's write batches flush their buffer), so
    /// only the fdatasync is left. After a failed flush none is tried again: its
    /// error is every later flush's.
    fn sync(&mut self) -> Result<(), String> {
        if let Some(failed) = self.queue.fault.get() {
            return Err(failed.to_string());
        }
        let started = std::time::Instant::now();
        let result = match &mut self.journal {
            Some(journal) => journal.sync().map_err(|e| e.to_string()),
            None => self
                .db
                .persist(PersistMode::SyncData)
                .map_err(|e| e.to_string()),
        };
        crate::metrics::FSYNC_SECONDS.observe(started.elapsed().as_secs_f64());
        result.map_err(|e| {
            let what = format!("flushing the log to disk (fdatasync) failed: {e}");
            self.queue.fault.set(&what);
            what
        })
    }

    /// Group commit across the partitions of a broker: one fdatasync covers every
    /// append waiting when it starts. When it ends, the appends of every group that
    /// started before it are durable too (their writes preceded it), so they are
    /// answered then, in order, even while their own fdatasync still runs.
    fn run(mut self) {
        loop {
            let mut st = self.queue.lock();
            while st.waiting.is_empty() && !st.closed {
                st = self
                    .queue
                    .wake
                    .wait(st)
                    .unwrap_or_else(PoisonError::into_inner);
            }
            if st.waiting.is_empty() {
                return;
            }
            let group = st.next_group;
            st.next_group += 1;
            let appends = std::mem::take(&mut st.waiting);
            crate::metrics::FSYNC_APPENDS.observe(appends.len() as f64);
            st.running.insert(group, appends);
            drop(st);

            let result = self.sync();

            let answering = self
                .queue
                .answering
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let done = {
                let mut st = self.queue.lock();
                let later = st.running.split_off(&(group + 1));
                std::mem::replace(&mut st.running, later)
            };
            for then in done.into_values().flatten() {
                then(result.clone().map_err(std::io::Error::other));
            }
            drop(answering);
        }
    }

    /// The `replicated` setting: appends count once written; the log is flushed
    /// every [`REPLICATED_FLUSH_INTERVAL`] all the same.
    fn run_periodic(mut self) {
        loop {
            let st = self.queue.lock();
            let (st, _) = self
                .queue
                .wake
                .wait_timeout_while(st, REPLICATED_FLUSH_INTERVAL, |st| !st.closed)
                .unwrap_or_else(PoisonError::into_inner);
            if st.closed {
                return;
            }
            drop(st);
            if self.sync().is_err() {
                // Recorded as the broker's fault; nothing more is flushed.
                return;
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// A database in a fresh folder, flushing with fdatasync.
    fn fsync_db() -> (tempfile::TempDir, Db) {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(dir.path(), Durability::Fsync).unwrap();
        (dir, db)
    }

    #[test]
    fn a_data_directory_of_another_format_is_refused_and_a_new_one_is_marked() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("broker");
        check_format(&data).expect("a new directory");
        assert_eq!(
            std::fs::read_to_string(data.join("FORMAT")).unwrap(),
            format!("{DATA_FORMAT}\n")
        );
        check_format(&data).expect("its own format");
        // The formats before, which this one only adds to, are taken and marked.
        for earlier in ["2\n", "3\n", "4\n"] {
            std::fs::write(data.join("FORMAT"), earlier).unwrap();
            check_format(&data).expect("an earlier format is read");
            assert_eq!(
                std::fs::read_to_string(data.join("FORMAT")).unwrap(),
                format!("{DATA_FORMAT}\n")
            );
        }
        std::fs::write(data.join("FORMAT"), "1").unwrap();
        let e = check_format(&data).unwrap_err().to_string();
        assert!(
            e.contains("format 1") && e.contains("remove the directory"),
            "{e}"
        );
        // Data from before the marker existed.
        let old = dir.path().join("old");
        std::fs::create_dir_all(old.join("db")).unwrap();
        let e = check_format(&old).unwrap_err().to_string();
        assert!(e.contains("before formats were marked"), "{e}");
    }

    #[test]
    fn a_data_directory_of_another_cluster_shape_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("broker");
        let one = "node 1 of brokers [1], 2 partitions, replication factor 1";
        check_shape(&data, one).expect("a new directory");
        assert_eq!(
            std::fs::read_to_string(data.join("CLUSTER")).unwrap(),
            format!("{one}\n")
        );
        check_shape(&data, one).expect("its own shape");
        let three = "node 1 of brokers [1, 2, 3], 2 partitions, replication factor 3";
        let e = check_shape(&data, three).unwrap_err().to_string();
        assert!(
            e.contains(one) && e.contains(three) && e.contains("--brokers"),
            "{e}"
        );
        // The refusal leaves the directory as it was.
        check_shape(&data, one).expect("still its own shape");
        assert!(matches!(compare_shape(&data, one), Ok(true)));
        assert!(matches!(
            compare_shape(&data, three),
            Err(DataDirError::OtherCluster { .. })
        ));
        assert!(matches!(
            compare_shape(&dir.path().join("new"), three),
            Ok(false)
        ));
        assert!(!dir.path().join("new").exists(), "comparing marks nothing");
    }

    /// What waits for a flush runs after the syncer's next fdatasync, in order, with
    /// its outcome.
    #[test]
    fn work_waiting_for_a_flush_runs_after_it_in_order() {
        let (_dir, db) = fsync_db();
        let (tx, rx) = mpsc::channel();
        let before = crate::metrics::FSYNC_SECONDS.get_sample_count();
        for i in 0..3 {
            let tx = tx.clone();
            db.after_flush(move |result| tx.send((i, result.is_ok())).unwrap());
        }
        let done: Vec<_> = (0..3)
            .map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap())
            .collect();
        assert_eq!(done, vec![(0, true), (1, true), (2, true)]);
        assert!(crate::metrics::FSYNC_SECONDS.get_sample_count() > before);
    }

    /// Appends made one after another, so that their flushes overlap on both
    /// flushers, are still answered in the order they were made, each after an
    /// fdatasync that began after it was written.
    #[test]
    fn overlapping_flushes_answer_appends_in_order() {
        let (_dir, db) = fsync_db();
        let ks = db.keyspace("data").unwrap();
        let (tx, rx) = mpsc::channel();
        for i in 0u32..300 {
            ks.insert(i.to_be_bytes(), b"v").unwrap();
            let tx = tx.clone();
            db.after_flush(move |result| tx.send((i, result.is_ok())).unwrap());
            if i % 3 == 0 {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        let done: Vec<_> = (0..300)
            .map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap())
            .collect();
        assert_eq!(done, (0..300).map(|i| (i, true)).collect::<Vec<_>>());
    }

    /// Queues the next flush from inside an answer, the way a chain of appends does.
    fn chain(db: Db, id: u32, step: u32, tx: mpsc::Sender<(u32, u32, bool)>) {
        let next = db.clone();
        db.after_flush(move |result| {
            tx.send((id, step, result.is_ok())).unwrap();
            if step < 100 {
                chain(next, id, step + 1, tx);
            }
        });
    }

    /// An answer may queue the next append while the other flusher is done too:
    /// neither waits on the other, and every chain runs to its end in order.
    #[test]
    fn answers_may_queue_appends_while_both_flushers_finish() {
        let (_dir, db) = fsync_db();
        let (tx, rx) = mpsc::channel();
        for c in 0..4 {
            chain(db.clone(), c, 0, tx.clone());
        }
        let mut last = [None; 4];
        for _ in 0..4 * 101 {
            let (c, step, ok) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
            assert!(ok);
            assert_eq!(last[c as usize].map_or(0, |s: u32| s + 1), step);
            last[c as usize] = Some(step);
        }
    }

    /// Appends still waiting when the last handle goes are flushed and answered.
    #[test]
    fn dropping_the_database_answers_what_waits() {
        let (_dir, db) = fsync_db();
        let (tx, rx) = mpsc::channel();
        for i in 0..50 {
            let tx = tx.clone();
            db.after_flush(move |result| tx.send((i, result.is_ok())).unwrap());
        }
        drop(db);
        drop(tx);
        let done: Vec<_> = rx.iter().collect();
        assert_eq!(done, (0..50).map(|i| (i, true)).collect::<Vec<_>>());
    }

    /// A flush that fails records the broker's fault; after it no flush is tried
    /// again, and what waits then is answered with that first error.
    #[test]
    fn after_a_failed_flush_every_flush_fails_with_its_error() {
        let (dir, db) = fsync_db();
        // fdatasync of a socket fails (EINVAL): a real failing call in place of a
        // disk's EIO.
        let (socket, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut flusher = Flusher {
            db: db.database().clone(),
            journal: Some(ActiveJournal {
                dir: dir.path().to_path_buf(),
                id: u64::MAX - 1,
                file: File::from(std::os::fd::OwnedFd::from(socket)),
            }),
            queue: db.syncer.0.clone(),
        };
        let first = flusher.sync().unwrap_err();
        assert!(first.contains("fdatasync"), "{first}");
        assert_eq!(db.fault().get().as_deref(), Some(first.as_str()));
        flusher.journal = None;
        assert_eq!(flusher.sync().unwrap_err(), first, "not tried again");

        // The syncer's own threads answer every append with it.
        let (tx, rx) = mpsc::channel();
        for i in 0..3 {
            let tx = tx.clone();
            db.after_flush(move |result| tx.send((i, result.map_err(|e| e.to_string()))).unwrap());
        }
        for i in 0..3 {
            assert_eq!(
                rx.recv_timeout(Duration::from_secs(10)).unwrap(),
                (i, Err(first.clone()))
            );
        }
        assert!(!db.fault().set("a later failure"), "the first fault stays");
        assert_eq!(db.fault().get().as_deref(), Some(first.as_str()));
    }

    fn max_journal_id(dir: &Path) -> u64 {
        std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| {
                e.unwrap()
                    .file_name()
                    .to_str()?
                    .strip_suffix(".jnl")?
                    .parse()
                    .ok()
            })
            .max()
            .unwrap()
    }

    /// The syncer finds fjall's journal (it would fall back to fjall's locking
    /// `persist` otherwise) and follows it when fjall moves on to a new one.
    #[test]
    fn syncer_follows_the_active_journal_across_rotations() {
        let (dir, db) = fsync_db();
        let mut journal = ActiveJournal::find(dir.path()).expect("fjall's journal file");
        let first = journal.id;
        assert_eq!(first, max_journal_id(dir.path()));

        // fjall starts a new journal on a memtable flush once the active one passes
        // 64 MB (values that do not compress: the journal may compress).
        let ks = db.keyspace("data").unwrap();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for i in 0u32..70 {
            let value: Vec<u8> = (0..1 << 17)
                .flat_map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x.to_le_bytes()
                })
                .collect();
            ks.insert(i.to_be_bytes(), value).unwrap();
        }
        ks.rotate_memtable_and_wait().unwrap();
        let rotated = max_journal_id(dir.path());
        assert!(rotated > first, "fjall did not rotate its journal");

        ks.insert(b"after", b"rotation").unwrap();
        journal.sync().unwrap();
        assert_eq!(journal.id, rotated);
    }
}
