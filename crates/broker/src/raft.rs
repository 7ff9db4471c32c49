//! openraft wiring: the type config and the network client that carries Raft
//! messages to peers over gRPC (`courier.cluster.Raft`): one connection per peer
//! shared by all partitions, the partition id in every message. Append-entries and
//! votes travel on one long-lived stream per peer ([`PeerLink`]), which spares each
//! of them a gRPC call's set-up; snapshots are unary calls.

use crate::engine::{Applied, Batch};
use courier_proto::cluster::{raft_client::RaftClient, RaftCall, RaftFrame, SnapshotChunk};
use courier_proto::codec;
use courier_proto::domain::PartitionId;
use courier_proto::mux::{CallError, Mux};
use dashmap::DashMap;
use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::{BasicNode, SnapshotMeta, Vote};
use serde::{Deserialize, Serialize};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};

openraft::declare_raft_types!(
    /// Courier's Raft types: a log entry is a [`Batch`] of commands; applying one
    /// yields the engine's [`Applied`] replies and effects.
    pub TypeConfig:
        D = Batch,
        R = Applied,
        NodeId = u64,
        Node = BasicNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = std::io::Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
);

/// The Raft handle of one partition.
pub type Raft = openraft::Raft<TypeConfig>;
type NodeId = u64;

/// The header of a snapshot chunk; its bytes travel beside it as protobuf `bytes`.
#[derive(Serialize, Deserialize)]
pub struct SnapshotChunkHeader {
    pub vote: Vote<NodeId>,
    pub meta: SnapshotMeta<NodeId, BasicNode>,
    pub offset: u64,
    pub done: bool,
}

/// One lazily connected channel and Raft stream per peer address, shared by every
/// partition.
#[derive(Clone)]
pub struct PeerChannels {
    channels: Arc<DashMap<String, Channel>>,
    links: Arc<DashMap<String, Arc<PeerLink>>>,
    /// Peers this broker's Raft calls cannot reach: where, since when, and how
    /// many calls failed since.
    down: Arc<DashMap<NodeId, Down>>,
    /// How many are in `down`: every Raft call and append-entries looks, and
    /// almost always finds none.
    down_count: Arc<std::sync::atomic::AtomicUsize>,
    /// Ends the streams' reader tasks.
    shutdown: CancellationToken,
}

/// Begins the error of a Raft call a peer did not answer (in time, or before its
/// stream broke): the servers' log filter drops openraft's errors that carry it,
/// as it drops its `Unreachable` ones, since [`PeerChannels::unreachable`] says
/// it once.
pub const PEER_SILENT: &str = "peer broker did not answer";

/// A peer that cannot be reached (see [`PeerChannels::unreachable`]).
struct Down {
    addr: String,
    since: std::time::Instant,
    failed_calls: u64,
}

impl PeerChannels {
    pub fn new(shutdown: CancellationToken) -> PeerChannels {
        // On /metrics from the start, at 0.
        crate::metrics::PEERS_UNREACHABLE.add(0);
        crate::metrics::PEER_CALLS_UNREACHABLE.inc_by(0);
        PeerChannels {
            channels: Arc::default(),
            links: Arc::default(),
            down: Arc::default(),
            down_count: Arc::default(),
            shutdown,
        }
    }

    /// A Raft call to the peer at `addr` could not reach it, or got no answer.
    /// openraft logs an error for each such call (the servers' log filter drops
    /// those: a few a second per partition for as long as a peer is down or hung);
    /// this says it once.
    fn unreachable(&self, addr: &str, peer: NodeId, error: &dyn std::fmt::Display) {
        let mut down = self.down.entry(peer).or_insert_with(|| {
            self.down_count.fetch_add(1, Ordering::Relaxed);
            crate::metrics::PEERS_UNREACHABLE.inc();
            tracing::warn!(
                peer,
                addr,
                %error,
                "cannot reach peer broker, or it does not answer; Raft keeps trying (quietly until it answers)"
            );
            Down {
                addr: addr.to_string(),
                since: std::time::Instant::now(),
                failed_calls: 0,
            }
        });
        down.failed_calls += 1;
        crate::metrics::PEER_CALLS_UNREACHABLE.inc();
    }

    /// Whether this broker's Raft calls to `peer` fail since it last heard from it.
    pub(crate) fn is_down(&self, peer: NodeId) -> bool {
        self.down_count.load(Ordering::Relaxed) > 0 && self.down.contains_key(&peer)
    }

    /// `peer` answered a Raft call, or sent one (a broker that leads nothing
    /// calls no one, and learns that a peer is back from its calls).
    pub(crate) fn heard_from(&self, peer: NodeId) {
        if self.down_count.load(Ordering::Relaxed) == 0 {
            return;
        }
        if let Some((_, down)) = self.down.remove(&peer) {
            self.down_count.fetch_sub(1, Ordering::Relaxed);
            crate::metrics::PEERS_UNREACHABLE.dec();
            tracing::info!(
                peer,
                addr = down.addr,
                unreachable_for = ?down.since.elapsed(),
                failed_calls = down.failed_calls,
                "peer broker answers again"
            );
        }
    }

    /// The channel to `addr`, created on first use; connecting happens lazily.
    pub fn get(&self, addr: &str) -> Result<Channel, tonic::transport::Error> {
        if let Some(c) = self.channels.get(addr) {
            return Ok(c.clone());
        }
        let channel = Endpoint::from_shared(format!("http://{addr}"))?
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_millis(500))
            .http2_keep_alive_interval(Duration::from_secs(5))
            .keep_alive_timeout(Duration::from_secs(5))
            .keep_alive_while_idle(true)
            .connect_lazy();
        self.channels.insert(addr.to_string(), channel.clone());
        Ok(channel)
    }

    /// The Raft stream to `addr`, opened on first use.
    pub fn link(&self, addr: &str) -> Result<Arc<PeerLink>, tonic::transport::Error> {
        if let Some(l) = self.links.get(addr) {
            return Ok(l.clone());
        }
        let link = Arc::new(PeerLink {
            channel: self.get(addr)?,
            mux: Mux::new(self.shutdown.clone()),
        });
        Ok(self
            .links
            .entry(addr.to_string())
            .or_insert(link)
            .value()
            .clone())
    }
}

/// What a leader that is shutting down sends the follower it hands a partition to
/// (`RaftCall::Elect`): stand for election now, if you follow me in this term.
#[derive(Serialize, Deserialize)]
pub struct ElectRequest {
    pub leader: NodeId,
    pub term: u64,
}

impl PeerChannels {
    /// Asks the broker at `addr` to stand for election in `partition` at once
    /// (see [`crate::partition::Partition::hand_off`]).
    pub async fn ask_to_elect(
        &self,
        addr: &str,
        partition: PartitionId,
        req: &ElectRequest,
        ttl: Duration,
    ) -> Result<(), String> {
        let link = self.link(addr).map_err(|e| e.to_string())?;
        let payload = codec::encode(req).map_err(|e| e.to_string())?;
        let reply = link
            .call(partition, RaftCall::Elect, payload, ttl)
            .await
            .map_err(|e| e.to_string())?;
        if reply.error.is_empty() {
            Ok(())
        } else {
            Err(reply.error)
        }
    }
}

/// The Raft stream to one peer, shared by every partition: append-entries and
/// votes go out on it as frames. A broken stream fails the calls waiting on it at
/// once and is opened again by the next call.
pub struct PeerLink {
    channel: Channel,
    mux: Mux<RaftFrame, RaftFrame>,
}

impl PeerLink {
    /// Sends one request and waits at most `ttl` for its reply's payload.
    async fn call(
        &self,
        partition: PartitionId,
        call: RaftCall,
        payload: bytes::Bytes,
        ttl: Duration,
    ) -> Result<RaftFrame, CallError> {
        let frame = RaftFrame {
            id: 0,
            partition_id: partition.0,
            call: call as i32,
            payload,
            error: String::new(),
        };
        let open = |requests| async move {
            crate::metrics::RAFT_STREAMS_OPENED.inc();
            let replies = RaftClient::new(self.channel.clone())
                .max_decoding_message_size(crate::MAX_MESSAGE_BYTES)
                .max_encoding_message_size(crate::MAX_MESSAGE_BYTES)
                .stream(with_data_format(tonic::Request::new(requests)))
                .await?;
            Ok(replies.into_inner())
        };
        self.mux
            .call(open, frame, tokio::time::Instant::now() + ttl)
            .await
    }
}

/// `req`, stating the data format this broker writes (see
/// [`courier_proto::DATA_FORMAT_HEADER`]).
fn with_data_format<T>(mut req: tonic::Request<T>) -> tonic::Request<T> {
    req.metadata_mut().insert(
        courier_proto::DATA_FORMAT_HEADER,
        tonic::metadata::MetadataValue::from(crate::store::DATA_FORMAT),
    );
    req
}

/// Refuses Raft traffic from a peer that states another data format than this
/// broker's: its entries and snapshots would be misread. A peer that states none
/// is taken as it comes.
pub fn check_data_format(metadata: &tonic::metadata::MetadataMap) -> Result<(), tonic::Status> {
    let Some(value) = metadata.get(courier_proto::DATA_FORMAT_HEADER) else {
        return Ok(());
    };
    let theirs = value.to_str().unwrap_or("(not text)");
    if theirs.parse::<u32>() == Ok(crate::store::DATA_FORMAT) {
        return Ok(());
    }
    tracing::warn!(
        peer_format = theirs,
        "refused Raft traffic from a peer of another data format"
    );
    Err(tonic::Status::failed_precondition(format!(
        "this broker reads data format {}, the peer writes {theirs}: the brokers of a \
         cluster must run versions with the same data format",
        crate::store::DATA_FORMAT
    )))
}

/// Makes Raft network clients for one partition.
pub struct Network {
    pub partition: PartitionId,
    pub peers: PeerChannels,
    /// Addresses from the static configuration; they win over the address stored in
    /// the Raft membership, so a broker that moved (a restarted `courier dev`) is found.
    pub addrs: Arc<std::collections::BTreeMap<NodeId, String>>,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = PeerClient;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> PeerClient {
        let addr = self.addrs.get(&target).unwrap_or(&node.addr);
        PeerClient {
            partition: self.partition,
            target,
            addr: addr.clone(),
            peers: self.peers.clone(),
            client: self.peers.get(addr).map(RaftClient::new).map_err(Arc::new),
            link: self.peers.link(addr).map_err(Arc::new),
        }
    }
}

/// Sends one partition's Raft messages to one peer.
pub struct PeerClient {
    partition: PartitionId,
    target: NodeId,
    addr: String,
    peers: PeerChannels,
    client: Result<RaftClient<Channel>, Arc<tonic::transport::Error>>,
    link: Result<Arc<PeerLink>, Arc<tonic::transport::Error>>,
}

type RpcErr<E = openraft::error::Infallible> = RPCError<NodeId, BasicNode, RaftError<NodeId, E>>;

/// Failures before any answer: an unreachable peer gets back-off, others are retried.
fn transport_err<E: std::error::Error>(status: tonic::Status) -> RpcErr<E> {
    match status.code() {
        tonic::Code::Unavailable => RPCError::Unreachable(Unreachable::new(&status)),
        _ => RPCError::Network(NetworkError::new(&status)),
    }
}

fn codec_err<E: std::error::Error>(e: codec::CodecError) -> RpcErr<E> {
    RPCError::Network(NetworkError::new(&e))
}

impl PeerClient {
    fn client<E: std::error::Error>(&self) -> Result<RaftClient<Channel>, RpcErr<E>> {
        self.client
            .clone()
            .map_err(|e| RPCError::Unreachable(Unreachable::new(e.as_ref())))
    }

    fn request<T>(&self, msg: T, option: &RPCOption) -> tonic::Request<T> {
        let mut req = with_data_format(tonic::Request::new(msg));
        req.set_timeout(option.hard_ttl());
        req
    }

    /// Sends an append-entries or vote request on the peer's Raft stream and
    /// decodes the reply.
    async fn call<Req: Serialize, R: serde::de::DeserializeOwned>(
        &self,
        call: RaftCall,
        rpc: &Req,
        option: &RPCOption,
    ) -> Result<R, RpcErr> {
        let link = self
            .link
            .clone()
            .map_err(|e| RPCError::Unreachable(Unreachable::new(e.as_ref())))?;
        let payload = codec::encode(rpc).map_err(codec_err)?;
        let result = link
            .call(self.partition, call, payload, option.hard_ttl())
            .await;
        match &result {
            Ok(_) => self.peers.heard_from(self.target),
            // Down, or hung (frozen, cut off): it answers nothing either way.
            Err(e) => self.peers.unreachable(&self.addr, self.target, e),
        }
        match result {
            Ok(reply) if reply.error.is_empty() => self.reply(&reply.payload),
            // The peer could not serve it: retried, like a lost reply.
            Ok(reply) => Err(RPCError::Network(NetworkError::new(
                &std::io::Error::other(reply.error),
            ))),
            // Not `Unreachable`: openraft would wait 500 ms before the next try,
            // where a reply that came late once is no reason to.
            Err(e @ (CallError::TimedOut | CallError::Lost)) => Err(RPCError::Network(
                NetworkError::new(&std::io::Error::other(format!("{PEER_SILENT}: {e}"))),
            )),
            // The peer could not be reached: openraft backs off.
            Err(e) => Err(RPCError::Unreachable(Unreachable::new(
                &std::io::Error::other(e.to_string()),
            ))),
        }
    }

    /// Decodes a peer's `Result<Resp, RaftError<E>>` reply.
    fn reply<R, E>(&self, payload: &[u8]) -> Result<R, RpcErr<E>>
    where
        R: serde::de::DeserializeOwned,
        E: std::error::Error + serde::de::DeserializeOwned,
    {
        let r: Result<R, RaftError<NodeId, E>> = codec::decode(payload).map_err(codec_err)?;
        r.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }
}

impl RaftNetwork<TypeConfig> for PeerClient {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RpcErr> {
        self.call(RaftCall::AppendEntries, &rpc, &option).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<InstallSnapshotResponse<NodeId>, RpcErr<InstallSnapshotError>> {
        let header = SnapshotChunkHeader {
            vote: rpc.vote,
            meta: rpc.meta,
            offset: rpc.offset,
            done: rpc.done,
        };
        let req = self.request(
            SnapshotChunk {
                partition_id: self.partition.0,
                header: codec::encode(&header).map_err(codec_err)?,
                data: rpc.data.into(),
            },
            &option,
        );
        let reply = self
            .client()?
            .install_snapshot(req)
            .await
            .map_err(transport_err)?;
        self.reply(&reply.into_inner().payload)
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RpcErr> {
        self.call(RaftCall::Vote, &rpc, &option).await
    }
}
