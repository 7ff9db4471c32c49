//! The commit path on openraft 0.9: a 3-node group in one process, an in-memory log
//! (optionally written and fdatasync'ed per append), a state machine that counts,
//! and a network that calls the target node directly. See ../README.md.

#[path = "../../common.rs"]
mod common;

use common::LogFile;
use openraft::storage::{LogFlushed, LogState, RaftLogStorage, RaftStateMachine, Snapshot};
use openraft::{
    BasicNode, Config, Entry, EntryPayload, LogId, OptionalSend, RaftLogReader,
    RaftSnapshotBuilder, SnapshotMeta, SnapshotPolicy, StorageError, StoredMembership, Vote,
};
use std::collections::{BTreeMap, HashMap};
use std::io::Cursor;
use std::ops::RangeBounds;
use std::sync::{Arc, Mutex};

openraft::declare_raft_types!(pub Tc: D = Vec<u8>, R = u64);
type Raft = openraft::Raft<Tc>;
type NodeId = u64;

#[derive(Default)]
struct LogInner {
    vote: Option<Vote<NodeId>>,
    log: BTreeMap<u64, Entry<Tc>>,
    purged: Option<LogId<NodeId>>,
}

#[derive(Clone)]
struct LogStore {
    inner: Arc<Mutex<LogInner>>,
    file: Option<Arc<LogFile>>,
    node: NodeId,
    /// `--early`: the leader reports its own entries flushed once written, as
    /// Courier's log store does, and a write is answered once the leader's sync
    /// covers it ([`LogStore::synced`]).
    early: bool,
    /// The highest index this node's log has synced.
    synced: Arc<tokio::sync::watch::Sender<u64>>,
}

impl RaftLogReader<Tc> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + std::fmt::Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<Tc>>, StorageError<NodeId>> {
        let g = self.inner.lock().unwrap();
        Ok(g.log.range(range).map(|(_, e)| e.clone()).collect())
    }
}

impl RaftLogStorage<Tc> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<Tc>, StorageError<NodeId>> {
        let g = self.inner.lock().unwrap();
        let last = g.log.values().next_back().map(|e| e.log_id).or(g.purged);
        Ok(LogState {
            last_purged_log_id: g.purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError<NodeId>> {
        self.inner.lock().unwrap().vote = Some(*vote);
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError<NodeId>> {
        Ok(self.inner.lock().unwrap().vote)
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<Tc>,
    ) -> Result<(), StorageError<NodeId>>
    where
        I: IntoIterator<Item = Entry<Tc>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut bytes = Vec::new();
        let (mut last, mut own) = (0, true);
        {
            let mut g = self.inner.lock().unwrap();
            for e in entries {
                last = e.log_id.index;
                own &= e.log_id.leader_id.node_id == self.node;
                if let EntryPayload::Normal(d) = &e.payload {
                    bytes.extend_from_slice(&e.log_id.index.to_le_bytes());
                    bytes.extend_from_slice(d);
                }
                g.log.insert(e.log_id.index, e);
            }
        }
        match &self.file {
            None => callback.log_io_completed(Ok(())),
            Some(f) => {
                let (f, synced) = (Arc::clone(f), Arc::clone(&self.synced));
                let callback = if self.early && own {
                    callback.log_io_completed(Ok(()));
                    None
                } else {
                    Some(callback)
                };
                // Flushed in the background: the next append may be handed in meanwhile.
                tokio::spawn(async move {
                    let r = f.write_synced(bytes).await;
                    if r.is_ok() {
                        synced.send_modify(|s| *s = (*s).max(last));
                    }
                    if let Some(callback) = callback {
                        callback.log_io_completed(r);
                    }
                });
            }
        }
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        self.inner.lock().unwrap().log.split_off(&log_id.index);
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        let mut g = self.inner.lock().unwrap();
        g.log = g.log.split_off(&(log_id.index + 1));
        g.purged = Some(log_id);
        Ok(())
    }
}

#[derive(Default, Clone)]
struct Sm {
    applied: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, BasicNode>,
    count: u64,
}

impl RaftSnapshotBuilder<Tc> for Sm {
    async fn build_snapshot(&mut self) -> Result<Snapshot<Tc>, StorageError<NodeId>> {
        Ok(Snapshot {
            meta: SnapshotMeta {
                last_log_id: self.applied,
                last_membership: self.membership.clone(),
                snapshot_id: format!("{:?}", self.applied),
            },
            snapshot: Box::new(Cursor::new(self.count.to_le_bytes().to_vec())),
        })
    }
}

impl RaftStateMachine<Tc> for Sm {
    type SnapshotBuilder = Sm;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, BasicNode>), StorageError<NodeId>>
    {
        Ok((self.applied, self.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<u64>, StorageError<NodeId>>
    where
        I: IntoIterator<Item = Entry<Tc>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut out = Vec::new();
        for e in entries {
            self.applied = Some(e.log_id);
            if let EntryPayload::Membership(m) = &e.payload {
                self.membership = StoredMembership::new(Some(e.log_id), m.clone());
            }
            self.count += 1;
            out.push(self.count);
        }
        Ok(out)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(
        &mut self,
    ) -> Result<Box<Cursor<Vec<u8>>>, StorageError<NodeId>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        _snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError<NodeId>> {
        self.applied = meta.last_log_id;
        self.membership = meta.last_membership.clone();
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<Tc>>, StorageError<NodeId>> {
        Ok(None)
    }
}

/// Every node of the group, for the network to call.
#[derive(Clone, Default)]
struct Router(Arc<Mutex<HashMap<NodeId, Raft>>>);

struct Conn {
    router: Router,
    target: NodeId,
}

mod net {
    use super::*;
    use openraft::error::{InstallSnapshotError, RPCError, RaftError, RemoteError, Unreachable};
    use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
    use openraft::raft::{
        AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest,
        InstallSnapshotResponse, VoteRequest, VoteResponse,
    };

    type Err<E = openraft::error::Infallible> = RPCError<NodeId, BasicNode, RaftError<NodeId, E>>;

    impl Conn {
        fn node<E: std::error::Error>(&self) -> Result<Raft, RPCError<NodeId, BasicNode, E>> {
            self.router
                .0
                .lock()
                .unwrap()
                .get(&self.target)
                .cloned()
                .ok_or_else(|| {
                    RPCError::Unreachable(Unreachable::new(&std::io::Error::other("no such node")))
                })
        }
    }

    impl RaftNetworkFactory<Tc> for Router {
        type Network = Conn;
        async fn new_client(&mut self, target: NodeId, _node: &BasicNode) -> Conn {
            Conn {
                router: self.clone(),
                target,
            }
        }
    }

    impl RaftNetwork<Tc> for Conn {
        async fn append_entries(
            &mut self,
            rpc: AppendEntriesRequest<Tc>,
            _option: RPCOption,
        ) -> Result<AppendEntriesResponse<NodeId>, Err> {
            let n = self.node::<RaftError<NodeId>>()?;
            n.append_entries(rpc)
                .await
                .map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
        }

        async fn install_snapshot(
            &mut self,
            rpc: InstallSnapshotRequest<Tc>,
            _option: RPCOption,
        ) -> Result<InstallSnapshotResponse<NodeId>, Err<InstallSnapshotError>> {
            let n = self.node::<RaftError<NodeId, InstallSnapshotError>>()?;
            n.install_snapshot(rpc)
                .await
                .map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
        }

        async fn vote(
            &mut self,
            rpc: VoteRequest<NodeId>,
            _option: RPCOption,
        ) -> Result<VoteResponse<NodeId>, Err> {
            let n = self.node::<RaftError<NodeId>>()?;
            n.vote(rpc)
                .await
                .map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
        }
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(run());
}

async fn run() {
    let fsync = common::fsync_wanted();
    let early = std::env::args().any(|a| a == "--early");
    let mut leader_synced = None;
    let dir = std::env::temp_dir().join(format!("openraft-eval-09-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let config = Arc::new(
        Config {
            heartbeat_interval: 50,
            election_timeout_min: 300,
            election_timeout_max: 600,
            snapshot_policy: SnapshotPolicy::Never,
            ..Config::default()
        }
        .validate()
        .expect("config"),
    );
    let router = Router::default();
    for id in 1..=3u64 {
        let synced = Arc::new(tokio::sync::watch::channel(0).0);
        if id == 1 {
            leader_synced = Some(Arc::clone(&synced));
        }
        let log = LogStore {
            inner: Arc::default(),
            file: fsync.then(|| Arc::new(LogFile::create(&dir, id))),
            node: id,
            early,
            synced,
        };
        let raft = Raft::new(id, Arc::clone(&config), router.clone(), log, Sm::default())
            .await
            .expect("raft");
        router.0.lock().unwrap().insert(id, raft);
    }
    let leader = router.0.lock().unwrap()[&1].clone();
    let members: BTreeMap<NodeId, BasicNode> = (1..=3).map(|i| (i, BasicNode::default())).collect();
    leader.initialize(members).await.expect("initialize");
    leader
        .wait(Some(std::time::Duration::from_secs(10)))
        .current_leader(1, "leader")
        .await
        .expect("leader elected");
    let payload = vec![7u8; common::PAYLOAD];
    let leader_synced = leader_synced.expect("node 1's log");
    let write = move || {
        let (leader, payload) = (leader.clone(), payload.clone());
        let mut synced = leader_synced.subscribe();
        async move {
            let Ok(r) = leader.client_write(payload).await else {
                return false;
            };
            // With --early the leader may have counted its copy before syncing it:
            // the answer waits for its sync, as Courier's answers do.
            !early || synced.wait_for(|&s| s >= r.log_id.index).await.is_ok()
        }
    };
    let mode = match (fsync, early) {
        (true, true) => "fsync, leader's copy counted once written",
        (true, false) => "fsync",
        (false, _) => "in memory",
    };
    common::measure("openraft 0.9.25", mode, write, 3000, 5, 64).await;
    let _ = std::fs::remove_dir_all(&dir);
}
