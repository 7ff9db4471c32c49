//! The broker's gRPC services: `courier.cluster.Raft` (peer brokers) and
//! `courier.cluster.Broker` (gateways). A malformed message is logged and refused,
//! never fatal.

use crate::config::BrokerConfig;
use crate::metrics;
use crate::partition::{Notices, Partition};
use crate::raft::{ElectRequest, SnapshotChunkHeader, TypeConfig};
use crate::registry::{JobStreamRegistry, Link};
use crate::store::sm::IntakeError;
use courier_proto::api::{BrokerApi, Inbound, Outbound};
use courier_proto::cluster::{
    self, gateway_message, BrokerAddress, BrokerMessage, BrokerTopology, BrokerTopologyRequest,
    ExecuteReply, ExecuteRequest, GatewayMessage, PartitionStatus, RaftCall, RaftFrame, RaftReply,
    SnapshotChunk,
};
use courier_proto::codec;
use courier_proto::convert;
use courier_proto::domain::{BrokerError, JobKey, Lease, PartitionId, Reply, Request, StreamId};
use courier_proto::mux;
use futures::{Stream, StreamExt};
use openraft::error::{InstallSnapshotError, RaftError, SnapshotMismatch};
use openraft::raft::{AppendEntriesRequest, InstallSnapshotResponse, VoteRequest};
use openraft::{ServerState, SnapshotSegmentId};
use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;
use tokio::sync::broadcast::error::RecvError;
use tokio_util::sync::CancellationToken;
use tonic::{Request as GrpcRequest, Response, Status, Streaming};
use tracing::Instrument;

/// The partitions this broker hosts, by id.
pub type Partitions = Arc<BTreeMap<u32, Arc<Partition>>>;

fn malformed(what: &str, e: codec::CodecError) -> Status {
    tracing::warn!(error = %e, "malformed {what} dropped");
    Status::invalid_argument(format!("malformed {what}: {e}"))
}

fn encode<T: serde::Serialize>(v: &T) -> Result<bytes::Bytes, Status> {
    codec::encode(v).map_err(|e| Status::internal(e.to_string()))
}

/// Raft traffic from peer brokers.
pub struct RaftService {
    pub partitions: Partitions,
    /// Told which peers send Raft traffic (see [`PeerChannels::heard_from`]).
    pub peers: crate::raft::PeerChannels,
    /// Ends the Raft streams peers hold open, so the server can stop.
    pub shutdown: CancellationToken,
}

/// The replica of partition `id` a peer's Raft call is for: not found where none is
/// hosted, unavailable once stopped for good by a storage fault (its Raft would
/// only answer that it stopped, and log each call).
fn partition(partitions: &Partitions, id: u32) -> Result<&Arc<Partition>, Status> {
    let p = partitions
        .get(&id)
        .ok_or_else(|| Status::not_found(format!("partition {id} is not hosted on this broker")))?;
    if p.has_failed() {
        return Err(Status::unavailable(format!(
            "the replica of partition {id} on this broker is stopped: its storage failed"
        )));
    }
    Ok(p)
}

/// A leader's append-entries (`vote` names the sender) reached replica `p`: the
/// peer answers, and `p` stands for no election before an election timeout from
/// now, nor later than that for a longer log it heard of as a candidate: it
/// follows a leader now.
fn heard_from(peers: &crate::raft::PeerChannels, p: &Partition, vote: &openraft::Vote<u64>) {
    if let Some(sender) = vote.leader_id().voted_for() {
        peers.heard_from(sender);
    }
    p.heard_from_leader_at(std::time::Instant::now());
    p.longer_log.clear();
}

/// Serves one request of a Raft stream: the encoded openraft reply.
async fn serve_raft_call(
    partitions: &Partitions,
    peers: &crate::raft::PeerChannels,
    frame: &RaftFrame,
) -> Result<bytes::Bytes, Status> {
    let p = partition(partitions, frame.partition_id)?;
    match RaftCall::try_from(frame.call) {
        Ok(RaftCall::AppendEntries) => {
            let rpc: AppendEntriesRequest<TypeConfig> = codec::decode(&frame.payload)
                .map_err(|e| malformed("append-entries request", e))?;
            heard_from(peers, p, &rpc.vote);
            metrics::append_received(!rpc.entries.is_empty());
            encode(&p.raft.append_entries(rpc).await)
        }
        Ok(RaftCall::Vote) => {
            let rpc: VoteRequest<u64> =
                codec::decode(&frame.payload).map_err(|e| malformed("vote request", e))?;
            if let Some(sender) = rpc.vote.leader_id().voted_for() {
                peers.heard_from(sender);
            }
            let reply = p.raft.vote(rpc).await;
            // As Raft has it, only a vote granted holds this replica's own election
            // back. A candidate refused (its log is behind this one's) would
            // otherwise, standing again and again, keep the replica that can win
            // from ever standing: no leader for as long as the old one is down.
            if matches!(&reply, Ok(r) if r.vote_granted) {
                p.heard_from_leader_at(std::time::Instant::now());
            }
            encode(&reply)
        }
        Ok(RaftCall::Elect) => {
            let rpc: ElectRequest =
                codec::decode(&frame.payload).map_err(|e| malformed("election request", e))?;
            p.elect_on_request(rpc.leader, rpc.term)
                .await
                .map_err(|e| Status::failed_precondition(e.to_string()))?;
            Ok(bytes::Bytes::new())
        }
        Err(_) => {
            tracing::warn!(call = frame.call, "unknown raft call dropped");
            Err(Status::invalid_argument(format!(
                "unknown raft call {}",
                frame.call
            )))
        }
    }
}

#[tonic::async_trait]
impl cluster::raft_server::Raft for RaftService {
    type StreamStream = mux::Replies<RaftFrame>;

    /// Serves a peer's append-entries and votes as they come (an append waits for
    /// its flush; others, of other partitions, must not wait behind it).
    async fn stream(
        &self,
        req: GrpcRequest<Streaming<RaftFrame>>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        crate::raft::check_data_format(req.metadata())?;
        let partitions = self.partitions.clone();
        let peers = self.peers.clone();
        let replies = mux::serve(req.into_inner(), self.shutdown.clone(), move |frame| {
            let (partitions, peers) = (partitions.clone(), peers.clone());
            async move {
                let (payload, error) = match serve_raft_call(&partitions, &peers, &frame).await {
                    Ok(payload) => (payload, String::new()),
                    Err(status) => (bytes::Bytes::new(), status.message().to_string()),
                };
                RaftFrame {
                    payload,
                    error,
                    ..frame
                }
            }
        });
        Ok(Response::new(replies))
    }

    async fn install_snapshot(
        &self,
        req: GrpcRequest<SnapshotChunk>,
    ) -> Result<Response<RaftReply>, Status> {
        crate::raft::check_data_format(req.metadata())?;
        let r = req.into_inner();
        let p = partition(&self.partitions, r.partition_id)?;
        let h: SnapshotChunkHeader =
            codec::decode(&r.header).map_err(|e| malformed("snapshot chunk", e))?;
        let res = receive_snapshot_chunk(p, h, r.data).await?;
        Ok(Response::new(RaftReply {
            payload: encode(&res)?,
        }))
    }
}

/// Takes one chunk of a snapshot a leader sends; the last, once the whole snapshot
/// is checked, has Raft install it. A snapshot that cannot be decoded is refused
/// and its sender told why; it never reaches the state machine.
async fn receive_snapshot_chunk(
    p: &Partition,
    h: SnapshotChunkHeader,
    data: bytes::Bytes,
) -> Result<Result<InstallSnapshotResponse<u64>, RaftError<u64, InstallSnapshotError>>, Status> {
    let vote = p.raft.metrics().borrow().vote;
    let answer = InstallSnapshotResponse { vote };
    // A chunk of a stale leader is not written (Raft checks the vote again on install).
    if h.vote < vote {
        return Ok(Ok(answer));
    }
    match p.intake.receive(&h.meta, h.offset, data, h.done).await {
        Ok(None) => Ok(Ok(answer)),
        Ok(Some(snapshot)) => Ok(p
            .raft
            .install_full_snapshot(h.vote, snapshot)
            .await
            .map(|r| InstallSnapshotResponse { vote: r.vote })
            .map_err(RaftError::Fatal)),
        Err(IntakeError::NotStarted { id, offset }) => {
            let segment = |offset| SnapshotSegmentId {
                id: id.clone(),
                offset,
            };
            Ok(Err(RaftError::APIError(
                InstallSnapshotError::SnapshotMismatch(SnapshotMismatch {
                    expect: segment(0),
                    got: segment(offset),
                }),
            )))
        }
        Err(e @ IntakeError::Undecodable { .. }) => {
            metrics::SNAPSHOTS_REFUSED.inc();
            tracing::warn!(partition = p.id.0, error = %e, "snapshot from the leader refused");
            Err(Status::invalid_argument(e.to_string()))
        }
        Err(e @ IntakeError::Io(_)) => {
            tracing::error!(partition = p.id.0, error = %e, "cannot take in a snapshot");
            Err(Status::unavailable(e.to_string()))
        }
    }
}

/// Commands, topology and links from gateways.
#[derive(Clone)]
pub struct BrokerService {
    pub config: Arc<BrokerConfig>,
    pub partitions: Partitions,
    pub notices: Notices,
    pub registry: Arc<JobStreamRegistry>,
    /// This broker's storage failure, if any: its replicas are stopped for good.
    pub fault: Arc<crate::store::Fault>,
    pub shutdown: CancellationToken,
}

impl BrokerService {
    /// Runs one command from a gateway: the encoded reply, or why it could not run.
    async fn execute_one(
        &self,
        r: ExecuteRequest,
        gateway: Option<Arc<str>>,
    ) -> Result<bytes::Bytes, Status> {
        let request: Request =
            codec::decode(&r.request).map_err(|e| malformed("execute request", e))?;
        let kind = request_kind(&request);
        let span = match create_trace(&request) {
            // Its commit (replicated, and flushed in fsync mode) in the job's trace.
            Some(tp) => {
                let span = tracing::info_span!("CreateJobs", partition = r.partition_id);
                courier_proto::trace::set_parent(&span, &tp);
                span
            }
            None => tracing::debug_span!("execute", partition = r.partition_id, kind),
        };
        let started = std::time::Instant::now();
        let tenants = r.scope.map(|s| s.tenants);
        let result = self
            .run(r.partition_id, request, gateway, tenants)
            .instrument(span)
            .await;
        metrics::REQUESTS
            .with_label_values(&[kind, outcome(&result)])
            .inc();
        metrics::REQUEST_SECONDS
            .with_label_values(&[kind])
            .observe(started.elapsed().as_secs_f64());
        encode(&result)
    }

    async fn run(
        &self,
        partition: u32,
        request: Request,
        gateway: Option<Arc<str>>,
        tenants: Option<Vec<String>>,
    ) -> Result<Reply, BrokerError> {
        let Some(p) = self.partitions.get(&partition) else {
            return Err(BrokerError::NotLeader {
                partition: PartitionId(partition),
                leader: None,
            });
        };
        match request {
            Request::Command(c) => p.submit_in(c, gateway, tenants).await,
            Request::GetJob { key } => p.get_job(key, tenants.as_deref()),
            Request::ListJobs {
                filter,
                after,
                limit,
            } => p.list_jobs(&filter, after, limit, tenants.as_deref()).await,
            Request::JobStats { filter } => p.job_stats(&filter, tenants.as_deref()).await,
        }
    }
}

/// The trace context a create joins, where this broker exports spans and one of
/// its jobs carries one.
fn create_trace(r: &Request) -> Option<String> {
    if !courier_proto::trace::enabled() {
        return None;
    }
    match r {
        Request::Command(c) => match c.inner() {
            courier_proto::domain::Command::Create(jobs) => jobs
                .iter()
                .find_map(|j| courier_proto::trace::in_headers(&j.custom_headers)),
            _ => None,
        },
        _ => None,
    }
}

fn request_kind(r: &Request) -> &'static str {
    use courier_proto::domain::Command as C;
    match r {
        Request::GetJob { .. } => "get_job",
        Request::ListJobs { .. } => "list_jobs",
        Request::JobStats { .. } => "job_stats",
        Request::Command(c) => match c.inner() {
            C::Create(_) => "create",
            C::Activate { .. } | C::ActivateWithin { .. } => "activate",
            C::Complete { .. } => "complete",
            C::Fail { .. } => "fail",
            C::ThrowError { .. } => "throw_error",
            C::UpdateRetries { .. } => "update_retries",
            C::UpdateTimeout { .. } => "update_timeout",
            C::Cancel { .. } => "cancel",
            // Nested: refused by the engine.
            C::Once { .. } => "once",
        },
    }
}

fn outcome(r: &Result<Reply, BrokerError>) -> &'static str {
    match r {
        Ok(_) => "ok",
        Err(BrokerError::InvalidArgument(_)) => "invalid_argument",
        Err(BrokerError::NotFound(_)) => "not_found",
        Err(BrokerError::FailedPrecondition(_)) => "failed_precondition",
        Err(BrokerError::ResourceExhausted(_)) => "resource_exhausted",
        Err(BrokerError::Unavailable(_)) => "unavailable",
        Err(BrokerError::NoMajority(_)) => "no_majority",
        Err(BrokerError::NotLeader { .. }) => "not_leader",
        Err(BrokerError::Internal(_)) => "internal",
        Err(BrokerError::OutcomeUnknown(_)) => "outcome_unknown",
    }
}

type LinkStream = Pin<Box<dyn Stream<Item = Result<BrokerMessage, Status>> + Send>>;

/// Ends a link however its stream ends (closed, broken, dropped): its streams leave
/// the registry at once, and the open-links gauge stays right.
struct LinkGuard {
    registry: Arc<JobStreamRegistry>,
    link: Arc<Link>,
    partitions: Partitions,
    gauge: prometheus::IntGauge,
    shutdown: CancellationToken,
}

impl Drop for LinkGuard {
    fn drop(&mut self) {
        self.registry.remove_link(self.link.id);
        self.gauge.dec();
        if self.shutdown.is_cancelled() {
            return;
        }
        // The jobs pushed through that gateway are checked on if it does not return,
        // unless it left gracefully: then they are with its clients' workers.
        let gateway = self.link.gateway_id();
        if self.registry.left(&gateway) {
            tracing::info!(
                %gateway,
                link = %self.link.id,
                "gateway left gracefully; the jobs its clients hold stay theirs until their activation timeouts"
            );
            return;
        }
        if !gateway.is_empty() {
            tracing::warn!(
                %gateway,
                link = %self.link.id,
                "gateway link lost without the gateway saying it leaves (it died, or was cut off)"
            );
            let mark = self.registry.hellos();
            for p in self.partitions.values() {
                p.gateway_lost(gateway.clone(), mark);
            }
        }
    }
}

/// Handles one message a gateway sent over its link. Malformed ones are dropped.
fn on_gateway_message(
    registry: &JobStreamRegistry,
    partitions: &Partitions,
    link: &Link,
    msg: GatewayMessage,
) {
    match msg.kind {
        Some(gateway_message::Kind::Hello(h)) => {
            tracing::info!(gateway = %h.gateway_id, link = %link.id, "gateway linked");
            registry.hello(link, h.gateway_id);
        }
        Some(gateway_message::Kind::Register(r)) => {
            match r.props.as_ref().map(convert::stream_props) {
                Some(Ok(props)) => {
                    tracing::debug!(link = %link.id, stream = r.stream_id, job_type = %props.job_type, "stream registered");
                    registry.register(link.id, StreamId(r.stream_id), props.clone());
                    for p in partitions.values() {
                        p.backfill(props.clone());
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!(link = %link.id, error = %e, "invalid stream registration dropped")
                }
                None => tracing::warn!(
                    link = %link.id,
                    "stream registration without properties dropped"
                ),
            }
        }
        Some(gateway_message::Kind::Unregister(u)) => {
            registry.unregister(link.id, StreamId(u.stream_id))
        }
        Some(gateway_message::Kind::Credit(c)) => {
            let fresh = registry.report_credit(
                link.id,
                StreamId(c.stream_id),
                u64::from(c.free),
                c.received,
            );
            if fresh {
                // More credit: the backlog that waited for it goes now.
                if let Some(props) = registry.props_of(link.id, StreamId(c.stream_id)) {
                    for p in partitions.values() {
                        p.backfill(props.clone());
                    }
                }
            }
        }
        Some(gateway_message::Kind::PushAck(a)) => link.acked(a.push_id, a.accepted, a.reason),
        Some(gateway_message::Kind::Leaving(_)) => {
            tracing::info!(gateway = %link.gateway_id(), link = %link.id, "gateway stops gracefully");
            registry.leaving(link);
        }
        Some(gateway_message::Kind::HeldAnswer(a)) => link.answered(a.query_id, a.held),
        Some(gateway_message::Kind::YieldJob(y)) => {
            // Gateways send yields to every broker: only the partition's leader
            // acts on one.
            let queued = partitions
                .get(&y.partition_id)
                .is_some_and(|p| p.gateway_yield(JobKey(y.key), Lease(y.lease)));
            if !queued {
                tracing::debug!(
                    partition = y.partition_id,
                    "yield for a partition not led here dropped"
                );
                return;
            }
            metrics::YIELDS
                .with_label_values(&[metrics::label::yield_source::GATEWAY])
                .inc();
        }
        None => tracing::warn!(link = %link.id, "empty link message dropped"),
    }
}

#[tonic::async_trait]
impl cluster::broker_server::Broker for BrokerService {
    type ExecuteStream = mux::Replies<ExecuteReply>;

    /// Serves a gateway's commands as they come, each answered on the returned
    /// stream with its request's id.
    async fn execute(
        &self,
        req: GrpcRequest<Streaming<ExecuteRequest>>,
    ) -> Result<Response<Self::ExecuteStream>, Status> {
        let gateway: Option<Arc<str>> = req
            .metadata()
            .get(courier_proto::GATEWAY_ID_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(Arc::from);
        Ok(Response::new(
            self.serve_commands(gateway, req.into_inner()),
        ))
    }

    async fn topology(
        &self,
        _req: GrpcRequest<BrokerTopologyRequest>,
    ) -> Result<Response<BrokerTopology>, Status> {
        Ok(Response::new(self.topology_now()))
    }

    type LinkStream = LinkStream;

    async fn link(
        &self,
        req: GrpcRequest<Streaming<GatewayMessage>>,
    ) -> Result<Response<LinkStream>, Status> {
        Ok(Response::new(self.open_link(req.into_inner())))
    }
}

/// The same calls for a gateway in this process (see [`courier_proto::api`]).
#[tonic::async_trait]
impl BrokerApi for BrokerService {
    async fn execute(
        &self,
        gateway_id: Option<Arc<str>>,
        requests: Outbound<ExecuteRequest>,
    ) -> Result<Inbound<ExecuteReply>, Status> {
        Ok(self.serve_commands(gateway_id, requests.map(Ok)))
    }

    async fn topology(&self) -> Result<BrokerTopology, Status> {
        Ok(self.topology_now())
    }

    async fn link(
        &self,
        outbound: Outbound<GatewayMessage>,
    ) -> Result<Inbound<BrokerMessage>, Status> {
        Ok(self.open_link(outbound.map(Ok)))
    }
}

impl BrokerService {
    /// Serves a gateway's command stream: each command runs as it comes and is
    /// answered under its request's id.
    fn serve_commands<S>(&self, gateway: Option<Arc<str>>, inbound: S) -> mux::Replies<ExecuteReply>
    where
        S: Stream<Item = Result<ExecuteRequest, Status>> + Send + Unpin + 'static,
    {
        let service = self.clone();
        mux::serve(inbound, self.shutdown.clone(), move |r| {
            let (service, gateway) = (service.clone(), gateway.clone());
            async move {
                match service.execute_one(r, gateway).await {
                    Ok(reply) => ExecuteReply {
                        reply,
                        ..ExecuteReply::default()
                    },
                    Err(status) => ExecuteReply {
                        error_code: status.code() as i32,
                        error: status.message().to_string(),
                        ..ExecuteReply::default()
                    },
                }
            }
        })
    }

    /// This broker's view of the cluster and the state of its replicas.
    fn topology_now(&self) -> BrokerTopology {
        let partitions = self
            .partitions
            .values()
            .map(|p| {
                let m = p.raft.metrics();
                let m = m.borrow();
                // A replica stopped for good reads `shutdown` at once, whatever its
                // Raft said last.
                let state = if p.has_failed() {
                    ServerState::Shutdown
                } else {
                    m.state
                };
                PartitionStatus {
                    partition_id: p.id.0,
                    role: match state {
                        ServerState::Leader => "leader",
                        ServerState::Follower => "follower",
                        ServerState::Candidate => "candidate",
                        ServerState::Learner => "learner",
                        ServerState::Shutdown => "shutdown",
                    }
                    .to_string(),
                    leader_id: m.current_leader.filter(|_| !p.has_failed()).unwrap_or(0),
                    term: m.current_term,
                    last_applied: m.last_applied.map(|l| l.index).unwrap_or(0),
                    majority_lost: state == ServerState::Leader && p.majority_lost(),
                }
            })
            .collect();
        BrokerTopology {
            node_id: self.config.node_id,
            brokers: self
                .config
                .brokers
                .iter()
                .map(|(id, addr)| BrokerAddress {
                    node_id: *id,
                    addr: addr.clone(),
                })
                .collect(),
            partitions_count: self.config.partitions,
            replication_factor: self.config.replication_factor,
            partitions,
            version: env!("CARGO_PKG_VERSION").to_string(),
            storage_failure: self.fault.get().map(|f| f.to_string()).unwrap_or_default(),
        }
    }

    /// Serves a gateway's link until either side ends it, or this broker stops.
    fn open_link<S>(&self, mut inbound: S) -> LinkStream
    where
        S: Stream<Item = Result<GatewayMessage, Status>> + Send + Unpin + 'static,
    {
        let mut notices = self.notices.subscribe();
        let (link, mut outbound) = self.registry.add_link();
        let registry = self.registry.clone();
        let partitions = self.partitions.clone();
        let shutdown = self.shutdown.clone();
        let gauge = metrics::LINKS.with_label_values(&[&self.config.node_id.to_string()]);
        gauge.inc();
        let guard = LinkGuard {
            registry: registry.clone(),
            link: link.clone(),
            partitions: partitions.clone(),
            gauge,
            shutdown: shutdown.clone(),
        };
        let out = async_stream::stream! {
            let _guard = guard;
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    m = inbound.next() => match m {
                        Some(Ok(msg)) => on_gateway_message(&registry, &partitions, &link, msg),
                        None => break,
                        Some(Err(e)) => {
                            tracing::info!(link = %link.id, error = %e, "gateway link broke");
                            break;
                        }
                    },
                    o = outbound.recv() => match o {
                        Some(msg) => yield Ok(msg),
                        None => break,
                    },
                    n = notices.recv() => match n {
                        Ok(msg) => yield Ok(msg),
                        Err(RecvError::Lagged(k)) => {
                            // The skipped notices may have been the only ones for some
                            // types: without them parked polls would sleep until their
                            // timeout. What is still activatable is announced again, and
                            // the link (its streams, its pushes) stays up.
                            metrics::NOTICE_CATCH_UPS.inc();
                            let again: Vec<BrokerMessage> = partitions
                                .values()
                                .flat_map(|p| p.activatable_notices())
                                .collect();
                            tracing::warn!(
                                link = %link.id,
                                skipped = k,
                                announced = again.len(),
                                "link fell behind the jobs-available notices; announcing every activatable type instead"
                            );
                            for msg in again {
                                yield Ok(msg);
                            }
                        }
                        Err(RecvError::Closed) => break,
                    },
                }
            }
            tracing::info!(link = %link.id, "gateway link closed");
        };
        Box::pin(out)
    }
}
