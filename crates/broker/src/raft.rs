//! openraft wiring: the type config and the network client that carries Raft
//! messages to peers over gRPC (`courier.cluster.Raft`): one connection per peer
//! shared by all partitions, the partition id in every message. Append-entries and
//! votes travel on one long-lived stream per peer ([`PeerLink`]), which spares each
//! of them a gRPC call's set-up; snapshots are unary calls.

use crate::engine::{Applied, Batch};
use crate::metrics;
use crate::partition::ElectError;
use crate::store::durable::Durable;
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
use openraft::{BasicNode, LogId, SnapshotMeta, Vote};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, Ordering};
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
        NodeId = NodeId,
        Node = BasicNode,
        Entry = openraft::Entry<TypeConfig>,
        // A file: snapshots are streamed to and from disk, never held whole in memory.
        SnapshotData = tokio::fs::File,
        AsyncRuntime = openraft::TokioRuntime,
);

/// The Raft handle of one partition.
pub type Raft = openraft::Raft<TypeConfig>;
use courier_proto::domain::NodeId;

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
    /// What this broker presents to its peers, and checks them by.
    tls: Option<tonic::transport::ClientTlsConfig>,
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
    pub fn new(
        shutdown: CancellationToken,
        tls: Option<tonic::transport::ClientTlsConfig>,
    ) -> PeerChannels {
        // On /metrics from the start, at 0.
        crate::metrics::PEERS_UNREACHABLE.add(0);
        crate::metrics::PEER_CALLS_UNREACHABLE.inc_by(0);
        PeerChannels {
            channels: Arc::default(),
            links: Arc::default(),
            down: Arc::default(),
            down_count: Arc::default(),
            shutdown,
            tls,
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
        let mut endpoint =
            Endpoint::from_shared(courier_proto::tls::peer_uri(addr, self.tls.is_some()))?;
        if let Some(tls) = &self.tls {
            endpoint = endpoint.tls_config(tls.clone())?;
        }
        let channel = endpoint
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
    ) -> Result<(), ElectError> {
        let unreachable = |e: &dyn std::fmt::Display| ElectError::Unreachable(e.to_string());
        let link = self.link(addr).map_err(|e| unreachable(&e))?;
        let payload = codec::encode(req).map_err(|e| unreachable(&e))?;
        let reply = link
            .call(partition, RaftCall::Elect, payload, ttl)
            .await
            .map_err(|e| unreachable(&e))?;
        if reply.error.is_empty() {
            Ok(())
        } else {
            Err(ElectError::Refused(reply.error))
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
                .max_decoding_message_size(courier_proto::MAX_CLUSTER_MESSAGE_BYTES)
                .max_encoding_message_size(courier_proto::MAX_CLUSTER_MESSAGE_BYTES)
                .stream(with_data_format(tonic::Request::new(requests)))
                .await?;
            Ok(Box::pin(replies.into_inner()) as courier_proto::mux::Replies<RaftFrame>)
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
    /// The flush state of this replica's log of the partition.
    pub durable: Arc<Durable>,
    /// Told when a voter refuses this replica's candidacy with a longer log.
    pub longer_log: Arc<LongerLog>,
}

/// Whether a voter refused one of this replica's candidacies holding a longer log
/// than the candidate stood with. Such a candidate cannot win while that voter is
/// up, and each time it stands it raises the term and turns away the voter's own
/// candidacy for that term (a vote of the same term for a higher node id wins the
/// tie): two survivors of a dead leader could take turns at this for as long as
/// their timers keep in step. openraft 0.9's own election timer waits
/// [`LongerLog::BACK_OFF`] longer before it stands again after such a refusal; the
/// broker's election driver (`drive_elections`, which replaces that timer) does the
/// same, so the voter with the longer log stands first.
#[derive(Debug, Default)]
pub struct LongerLog(AtomicBool);

impl LongerLog {
    /// How much later than its election timeout a replica that was refused for a
    /// shorter log stands again, in multiples of the longest election timeout:
    /// openraft 0.9's `smaller_log_timeout`.
    pub const BACK_OFF: u32 = 2;

    /// Notes the reply to a candidacy that stood with `last`, this replica's last
    /// log id then; true when it refuses it for a longer log.
    pub fn note_reply(&self, last: Option<&LogId<NodeId>>, reply: &VoteResponse<NodeId>) -> bool {
        let longer = !reply.vote_granted && reply.last_log_id.as_ref() > last;
        if longer {
            self.0.store(true, Ordering::Relaxed);
        }
        longer
    }

    pub fn seen(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// Forgets it: this replica stands again, or a leader's entries reached it
    /// (every append-entries, so a read first: no write while there is nothing).
    pub fn clear(&self) {
        if self.seen() {
            self.0.store(false, Ordering::Relaxed);
        }
    }
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
            told: Told::default(),
            durable: self.durable.clone(),
            longer_log: self.longer_log.clone(),
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
    /// What the peer last accepted from this leader (see [`Told::commit_alone`]).
    told: Told,
    /// The flush state of this replica's log: the commit index a follower is told
    /// never passes it.
    durable: Arc<Durable>,
    longer_log: Arc<LongerLog>,
}

/// How soon after the peer accepted a leader's entries that leader's news of
/// their commit may wait for its next message (see [`Told::commit_alone`]):
/// well inside a heartbeat interval.
const COMMIT_NEWS_WINDOW: Duration = Duration::from_millis(50);

/// What a peer last accepted whole from this leader, and the commit index whose
/// news alone was last left for a later message.
#[derive(Debug, Default)]
struct Told {
    accepted: Option<Accepted>,
    left: Option<LogId<NodeId>>,
}

/// An append-entries a peer accepted: when it was sent, under which vote, the last
/// log id the peer then held and the commit index it was told.
#[derive(Debug)]
struct Accepted {
    at: std::time::Instant,
    vote: Vote<NodeId>,
    matching: Option<LogId<NodeId>>,
    commit: Option<LogId<NodeId>>,
}

impl Told {
    /// Whether `rpc`, sent at `now`, is openraft's news of a commit and nothing
    /// else, which the peer need not hear now. openraft 0.9 sends every new commit
    /// index to each follower in a message of its own, and waits for its answer
    /// before it sends that follower the next entry: under load half the
    /// append-entries a leader sends, and a round trip in front of the next entry.
    /// A follower needs a commit index only to apply entries it already holds
    /// (a leader's pushes, answers and elections never wait for that), and the
    /// leader's next message carries it: the next entry, or at the latest the
    /// heartbeat within an interval, which is sent whatever this says.
    ///
    /// Left for later only when the peer accepted, under the same vote and less
    /// than [`COMMIT_NEWS_WINDOW`] ago, everything up to the request's previous log
    /// id; and only the first time a commit index comes alone. The answer openraft
    /// is then given is the one the peer would give; all the leader learns from it
    /// is that the peer was heard from at `now`, within the window of when it was.
    fn commit_alone(
        &mut self,
        rpc: &AppendEntriesRequest<TypeConfig>,
        now: std::time::Instant,
    ) -> bool {
        let leave = rpc.entries.is_empty()
            && rpc.leader_commit != self.left
            && self.accepted.as_ref().is_some_and(|a| {
                rpc.leader_commit > a.commit
                    && a.vote == rpc.vote
                    && a.matching == rpc.prev_log_id
                    && now.saturating_duration_since(a.at) < COMMIT_NEWS_WINDOW
            });
        if leave {
            self.left = rpc.leader_commit;
        }
        leave
    }

    /// Notes that the peer accepted `rpc` (sent at `now`) whole.
    fn accepted(&mut self, rpc: &AppendEntriesRequest<TypeConfig>, now: std::time::Instant) {
        self.accepted = Some(Accepted {
            at: now,
            vote: rpc.vote,
            matching: rpc.entries.last().map(|e| e.log_id).or(rpc.prev_log_id),
            commit: rpc.leader_commit,
        });
    }

    /// Forgets the peer's state: an answer other than success, or none.
    fn unsure(&mut self) {
        *self = Told::default();
    }
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
        mut rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RpcErr> {
        // Raft may count this leader's own entries toward a commit before they are
        // flushed; a follower applies only what is on a majority of disks.
        rpc.leader_commit = self.durable.clamp_commit(rpc.leader_commit);
        let now = std::time::Instant::now();
        if self.told.commit_alone(&rpc, now) {
            metrics::COMMIT_NEWS_LEFT.inc();
            return Ok(AppendEntriesResponse::Success);
        }
        metrics::append_sent(!rpc.entries.is_empty());
        let reply = self.call(RaftCall::AppendEntries, &rpc, &option).await;
        match &reply {
            Ok(AppendEntriesResponse::Success) => self.told.accepted(&rpc, now),
            _ => self.told.unsure(),
        }
        reply
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
        let reply: VoteResponse<NodeId> = self.call(RaftCall::Vote, &rpc, &option).await?;
        if self.longer_log.note_reply(rpc.last_log_id.as_ref(), &reply) {
            tracing::info!(
                partition = self.partition.0,
                voter = self.target,
                "refused by a voter with a longer log: this replica stands again only after a longer wait"
            );
        }
        Ok(reply)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::{CommittedLeaderId, Entry, EntryPayload};

    fn id(index: u64) -> LogId<NodeId> {
        LogId::new(CommittedLeaderId::new(2, 1), index)
    }

    fn vote() -> Vote<NodeId> {
        Vote::new_committed(2, 1)
    }

    /// A refusal by a voter holding a longer log than the candidate stood with is
    /// noted; a refusal for any other reason (a vote of a higher term, a leader's
    /// lease), and a vote granted, are not.
    #[test]
    fn a_refusal_for_a_longer_log_is_noted() {
        let at = |term, node, index| Some(LogId::new(CommittedLeaderId::new(term, node), index));
        let reply = |granted, last| VoteResponse {
            vote: Vote::new(7, 3),
            vote_granted: granted,
            last_log_id: last,
        };
        let seen = LongerLog::default();
        let mine = at(5, 3, 5);
        // Same log, or shorter: not noted.
        assert!(!seen.note_reply(mine.as_ref(), &reply(false, mine)));
        assert!(!seen.note_reply(mine.as_ref(), &reply(false, at(5, 3, 4))));
        assert!(!seen.note_reply(mine.as_ref(), &reply(true, mine)));
        assert!(!seen.seen());
        // A later term's entry, or more entries of the same term.
        assert!(seen.note_reply(mine.as_ref(), &reply(false, at(21, 1, 6))));
        assert!(seen.seen());
        seen.clear();
        assert!(seen.note_reply(mine.as_ref(), &reply(false, at(5, 3, 6))));
        seen.clear();
        // A candidate with an empty log.
        assert!(seen.note_reply(None, &reply(false, at(1, 1, 1))));
        assert!(seen.seen());
        seen.clear();
        assert!(!seen.seen());
    }

    /// An append-entries of leader 1 in term 2: `entries` entries after index
    /// `prev`, telling the commit index `commit`.
    fn append(prev: u64, entries: u64, commit: u64) -> AppendEntriesRequest<TypeConfig> {
        AppendEntriesRequest {
            vote: vote(),
            prev_log_id: Some(id(prev)),
            leader_commit: Some(id(commit)),
            entries: (prev + 1..=prev + entries)
                .map(|i| Entry {
                    log_id: id(i),
                    payload: EntryPayload::Blank,
                })
                .collect(),
        }
    }

    #[test]
    fn a_commit_alone_right_after_its_entries_were_accepted_waits_for_the_next_message() {
        let t0 = std::time::Instant::now();
        let mut told = Told::default();
        // Nothing accepted yet: everything is sent.
        assert!(!told.commit_alone(&append(4, 0, 5), t0));
        told.accepted(&append(4, 1, 4), t0);
        // The commit of entry 5, alone, just after: left for later.
        let ms = Duration::from_millis(1);
        assert!(told.commit_alone(&append(5, 0, 5), t0 + ms));
        // The same news again (the next heartbeat) is sent: the peer hears of it.
        assert!(!told.commit_alone(&append(5, 0, 5), t0 + 2 * ms));
        // An entry is always sent, and carries the commit.
        assert!(!told.commit_alone(&append(5, 1, 5), t0 + 3 * ms));
        told.accepted(&append(5, 1, 5), t0 + 3 * ms);
        // A heartbeat with no news of a commit is sent.
        assert!(!told.commit_alone(&append(6, 0, 5), t0 + 4 * ms));
        assert!(told.commit_alone(&append(6, 0, 6), t0 + 4 * ms));
    }

    #[test]
    fn a_commit_alone_is_sent_when_the_peer_may_not_hold_its_entries() {
        let t0 = std::time::Instant::now();
        let ms = Duration::from_millis(1);
        let accepted = |at| {
            let mut told = Told::default();
            told.accepted(&append(4, 1, 4), at);
            told
        };
        // Accepted too long ago.
        assert!(!accepted(t0).commit_alone(&append(5, 0, 5), t0 + COMMIT_NEWS_WINDOW));
        // A heartbeat that does not follow the entries the peer accepted.
        assert!(!accepted(t0).commit_alone(&append(3, 0, 5), t0 + ms));
        // Another leader's, or another term's.
        let mut other = append(5, 0, 5);
        other.vote = Vote::new_committed(3, 2);
        assert!(!accepted(t0).commit_alone(&other, t0 + ms));
        // After an answer other than success, nothing is assumed.
        let mut told = accepted(t0);
        told.unsure();
        assert!(!told.commit_alone(&append(5, 0, 5), t0 + ms));
    }
}
