//! The commit path on openraft 0.10: the same group, store and state machine as the
//! 0.9 arm, on 0.10's storage and network traits. `--pipelined` streams appends to a
//! follower (0.10's `stream_append`) instead of one append request at a time.

#[path = "../../common.rs"]
mod common;

use common::LogFile;
use futures_util::StreamExt;
use openraft::alias::{EntryOf, LogIdOf, SnapshotMetaOf, SnapshotOf, StoredMembershipOf, VoteOf};
use openraft::storage::{EntryResponder, IOFlushed, LogState, RaftLogStorage, RaftStateMachine};
use openraft::{
    BasicNode, Config, EntryPayload, OptionalSend, RaftLogReader, RaftSnapshotBuilder,
    SnapshotPolicy,
};
use std::collections::{BTreeMap, HashMap};
use std::io;
use std::ops::RangeBounds;
use std::sync::{Arc, Mutex};

/// An entry's bytes (0.10 wants application data that can be displayed).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Data(Vec<u8>);

impl std::fmt::Display for Data {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} bytes", self.0.len())
    }
}

openraft::declare_raft_types!(pub Tc: D = Data, R = u64);
type Raft = openraft::Raft<Tc, Sm>;
type NodeId = u64;

#[derive(Default)]
struct LogInner {
    vote: Option<VoteOf<Tc>>,
    log: BTreeMap<u64, EntryOf<Tc>>,
    purged: Option<LogIdOf<Tc>>,
}

#[derive(Clone)]
struct LogStore {
    inner: Arc<Mutex<LogInner>>,
    file: Option<Arc<LogFile>>,
}

impl RaftLogReader<Tc> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + std::fmt::Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<EntryOf<Tc>>, io::Error> {
        let g = self.inner.lock().unwrap();
        Ok(g.log.range(range).map(|(_, e)| e.clone()).collect())
    }

    async fn read_vote(&mut self) -> Result<Option<VoteOf<Tc>>, io::Error> {
        Ok(self.inner.lock().unwrap().vote)
    }
}

impl RaftLogStorage<Tc> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<Tc>, io::Error> {
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

    async fn save_vote(&mut self, vote: &VoteOf<Tc>) -> Result<(), io::Error> {
        self.inner.lock().unwrap().vote = Some(*vote);
        Ok(())
    }

    async fn append<I>(&mut self, entries: I, callback: IOFlushed<Tc>) -> Result<(), io::Error>
    where
        I: IntoIterator<Item = EntryOf<Tc>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut bytes = Vec::new();
        {
            let mut g = self.inner.lock().unwrap();
            for e in entries {
                if let EntryPayload::Normal(d) = &e.payload {
                    bytes.extend_from_slice(&e.log_id.index.to_le_bytes());
                    bytes.extend_from_slice(&d.0);
                }
                g.log.insert(e.log_id.index, e);
            }
        }
        match &self.file {
            None => callback.io_completed(Ok(())),
            Some(f) => {
                let f = Arc::clone(f);
                // Flushed in the background: the next append may be handed in meanwhile.
                tokio::spawn(async move { callback.io_completed(f.write_synced(bytes).await) });
            }
        }
        Ok(())
    }

    async fn truncate_after(&mut self, last: Option<LogIdOf<Tc>>) -> Result<(), io::Error> {
        let from = last.map_or(0, |l| l.index + 1);
        self.inner.lock().unwrap().log.split_off(&from);
        Ok(())
    }

    async fn purge(&mut self, log_id: LogIdOf<Tc>) -> Result<(), io::Error> {
        let mut g = self.inner.lock().unwrap();
        g.log = g.log.split_off(&(log_id.index + 1));
        g.purged = Some(log_id);
        Ok(())
    }
}

#[derive(Default, Clone)]
struct Sm {
    applied: Option<LogIdOf<Tc>>,
    membership: StoredMembershipOf<Tc>,
    count: u64,
}

impl RaftSnapshotBuilder<Tc> for Sm {
    type SnapshotData = u64;

    async fn build_snapshot(&mut self) -> Result<SnapshotOf<Tc, u64>, io::Error> {
        Ok(SnapshotOf::<Tc, u64> {
            meta: SnapshotMetaOf::<Tc> {
                last_log_id: self.applied,
                last_membership: self.membership.clone(),
            },
            snapshot: self.count,
        })
    }
}

impl RaftStateMachine<Tc> for Sm {
    type SnapshotData = u64;
    type SnapshotBuilder = Sm;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogIdOf<Tc>>, StoredMembershipOf<Tc>), io::Error> {
        Ok((self.applied, self.membership.clone()))
    }

    async fn apply<Strm>(&mut self, mut entries: Strm) -> Result<(), io::Error>
    where
        Strm: futures_util::Stream<Item = Result<EntryResponder<Tc>, io::Error>>
            + Unpin
            + OptionalSend,
    {
        while let Some(item) = entries.next().await {
            let (e, responder) = item?;
            self.applied = Some(e.log_id);
            if let EntryPayload::Membership(m) = &e.payload {
                self.membership = StoredMembershipOf::<Tc>::new(Some(e.log_id), m.clone());
            }
            self.count += 1;
            if let Some(r) = responder {
                r.send(self.count);
            }
        }
        Ok(())
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMetaOf<Tc>,
        snapshot: u64,
    ) -> Result<(), io::Error> {
        self.applied = meta.last_log_id;
        self.membership = meta.last_membership.clone();
        self.count = snapshot;
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<SnapshotOf<Tc, u64>>, io::Error> {
        Ok(None)
    }
}

/// Every node of the group, for the network to call.
#[derive(Clone, Default)]
struct Router {
    nodes: Arc<Mutex<HashMap<NodeId, Raft>>>,
    pipelined: bool,
}

struct Conn {
    router: Router,
    target: NodeId,
}

mod net {
    use super::*;
    use openraft::base::{BoxFuture, BoxStream};
    use openraft::error::{RPCError, ReplicationClosed, StreamingError, Unreachable};
    use openraft::network::{RPCOption, RaftNetworkFactory, RaftNetworkV2};
    use openraft::raft::{
        AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, StreamAppendResult,
        VoteRequest, VoteResponse,
    };
    use std::future::Future;

    fn unreachable<E: std::error::Error + 'static>(e: &E) -> RPCError<Tc> {
        RPCError::Unreachable(Unreachable::new(e))
    }

    impl Conn {
        fn node(&self) -> Result<Raft, RPCError<Tc>> {
            self.router
                .nodes
                .lock()
                .unwrap()
                .get(&self.target)
                .cloned()
                .ok_or_else(|| unreachable(&io::Error::other("no such node")))
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

    impl RaftNetworkV2<Tc> for Conn {
        type SnapshotData = u64;

        async fn append_entries(
            &mut self,
            rpc: AppendEntriesRequest<Tc>,
            _option: RPCOption,
        ) -> Result<AppendEntriesResponse<Tc>, RPCError<Tc>> {
            self.node()?
                .append_entries(rpc)
                .await
                .map_err(|e| unreachable(&e))
        }

        fn stream_append<'s, S>(
            &'s mut self,
            input: S,
            option: RPCOption,
        ) -> BoxFuture<
            's,
            Result<BoxStream<'s, Result<StreamAppendResult<Tc>, RPCError<Tc>>>, RPCError<Tc>>,
        >
        where
            S: futures_util::Stream<Item = AppendEntriesRequest<Tc>>
                + OptionalSend
                + Unpin
                + 'static,
        {
            if !self.router.pipelined {
                return openraft::network::stream_append_sequential(self, input, option);
            }
            Box::pin(async move {
                let node = self.node()?;
                let out = node
                    .stream_append(input)
                    .map(|r| r.map_err(|e| unreachable(&e)));
                Ok(Box::pin(out) as BoxStream<'s, _>)
            })
        }

        async fn vote(
            &mut self,
            rpc: VoteRequest<Tc>,
            _option: RPCOption,
        ) -> Result<VoteResponse<Tc>, RPCError<Tc>> {
            self.node()?.vote(rpc).await.map_err(|e| unreachable(&e))
        }

        async fn full_snapshot(
            &mut self,
            vote: VoteOf<Tc>,
            snapshot: SnapshotOf<Tc, u64>,
            _cancel: impl Future<Output = ReplicationClosed> + OptionalSend + 'static,
            _option: RPCOption,
        ) -> Result<SnapshotResponse<Tc>, StreamingError<Tc>> {
            let node = self.node().map_err(|_| {
                StreamingError::Unreachable(Unreachable::new(&io::Error::other("no such node")))
            })?;
            node.install_full_snapshot(vote, snapshot)
                .await
                .map_err(|e| StreamingError::Unreachable(Unreachable::new(&e)))
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
    let pipelined = std::env::args().any(|a| a == "--pipelined");
    let dir = std::env::temp_dir().join(format!("openraft-eval-010-{}", std::process::id()));
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
    let router = Router {
        nodes: Arc::default(),
        pipelined,
    };
    for id in 1..=3u64 {
        let log = LogStore {
            inner: Arc::default(),
            file: fsync.then(|| Arc::new(LogFile::create(&dir, id))),
        };
        let raft = Raft::new(id, Arc::clone(&config), router.clone(), log, Sm::default())
            .await
            .expect("raft");
        router.nodes.lock().unwrap().insert(id, raft);
    }
    let leader = router.nodes.lock().unwrap()[&1].clone();
    let members: BTreeMap<NodeId, BasicNode> = (1..=3).map(|i| (i, BasicNode::default())).collect();
    leader.initialize(members).await.expect("initialize");
    leader
        .wait(Some(std::time::Duration::from_secs(10)))
        .current_leader(1, "leader")
        .await
        .expect("leader elected");
    let payload = Data(vec![7u8; common::PAYLOAD]);
    let write = move || {
        let (leader, payload) = (leader.clone(), payload.clone());
        async move { leader.client_write(payload).await.is_ok() }
    };
    let mode = match (fsync, pipelined) {
        (true, true) => "fsync, pipelined",
        (true, false) => "fsync",
        (false, true) => "in memory, pipelined",
        (false, false) => "in memory",
    };
    common::measure("openraft 0.10.0-alpha.37", mode, write, 3000, 5, 64).await;
    let _ = std::fs::remove_dir_all(&dir);
}
