//! The long-lived gateway <-> broker links: one task per broker keeps a `Link` stream
//! open and handles what the broker sends on it.
//!
//! The gateway's side of each link is a queue owned by [`AggregatedStreams`]: it
//! starts with the hello and the registration and credit of every aggregated stream,
//! and carries registration and credit changes, yields, and this task's acks to the
//! broker's pushes.

use crate::long_poll::LongPollQueue;
use crate::metrics;
use crate::streams::{AggregatedStreams, AttachedLink};
use crate::topology::Topology;
use courier_proto::backoff::Backoff;
use courier_proto::cluster::{
    broker_message, gateway_message, BrokerMessage, GatewayHello, GatewayLeaving, GatewayMessage,
    PushJob,
};
use courier_proto::domain::{JobKey, Lease, NodeId, PartitionId};
use futures::StreamExt;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

const RECONNECT_BASE: Duration = Duration::from_millis(50);
const RECONNECT_CAP: Duration = Duration::from_secs(2);
/// A link that stayed up this long was healthy: the next reconnect starts from the
/// shortest back-off again. A link that flaps faster keeps backing off.
const STABLE_LINK: Duration = Duration::from_secs(5);
/// Bound on opening a link (connection plus the broker's response headers).
const OPEN_TIMEOUT: Duration = Duration::from_secs(5);
/// On a graceful stop, how long a link keeps answering pushes that crossed the
/// unregistration of this gateway's streams before it closes its side.
const CLOSE_QUIET: Duration = Duration::from_millis(100);
/// On a graceful stop, how long a link waits for the broker to close its side
/// after this gateway closed its own (the broker has then read all of it).
const CLOSE_WAIT: Duration = Duration::from_secs(1);

/// What every link task shares.
#[derive(Clone)]
pub struct BrokerLink {
    topology: Arc<Topology>,
    queue: Arc<LongPollQueue>,
    streams: Arc<AggregatedStreams>,
    /// Unique per gateway process, so a broker can tell a restarted gateway apart.
    gateway_id: String,
    /// A graceful stop: the links close their side once what is queued on them is
    /// sent (see [`BrokerLink::close`]), and do not reconnect.
    closing: CancellationToken,
    /// The gateway was asked to stop: a link that ends now (its broker stopping
    /// too, as in `courier dev`) is no news worth a warning.
    stopping: CancellationToken,
    shutdown: CancellationToken,
}

/// An open link: the broker's messages, and the gateway's side of the stream
/// (dropping it detaches the link and ends the stream).
struct Connected {
    inbound: courier_proto::api::Inbound<BrokerMessage>,
    outbound: AttachedLink,
}

impl BrokerLink {
    /// Link tasks over `topology`, feeding notices into `queue`, pushes into `streams`.
    pub fn new(
        topology: Arc<Topology>,
        queue: Arc<LongPollQueue>,
        streams: Arc<AggregatedStreams>,
        gateway_id: String,
        closing: CancellationToken,
        stopping: CancellationToken,
        shutdown: CancellationToken,
    ) -> Self {
        BrokerLink {
            topology,
            queue,
            streams,
            gateway_id,
            closing,
            stopping,
            shutdown,
        }
    }

    /// Starts one link task on `tracker` for every broker of the membership, as it is
    /// learned, until shutdown.
    pub async fn supervise(self, tracker: TaskTracker) {
        let mut members = self.topology.members();
        let mut started: HashSet<NodeId> = HashSet::new();
        loop {
            let nodes: Vec<NodeId> = members.borrow_and_update().keys().copied().collect();
            for node in nodes {
                if started.insert(node) {
                    tracker.spawn(self.clone().run(node));
                }
            }
            tokio::select! {
                changed = members.changed() => if changed.is_err() { return },
                _ = self.closing.cancelled() => return,
                _ = self.shutdown.cancelled() => return,
            }
        }
    }

    /// Keeps the link to broker `node` open, reconnecting with back-off, until shutdown.
    async fn run(self, node: NodeId) {
        let mut backoff = Backoff::new(RECONNECT_BASE, RECONNECT_CAP).attempts();
        let mut failures = 0u32;
        while !self.shutdown.is_cancelled() && !self.closing.is_cancelled() {
            let started = Instant::now();
            let opened = tokio::select! {
                opened = self.open(node) => opened,
                _ = self.closing.cancelled() => return,
                _ = self.shutdown.cancelled() => return,
            };
            match opened {
                Ok(link) => {
                    failures = 0;
                    tracing::info!(node, "broker link connected");
                    metrics::broker_links(1);
                    // Notices sent while the link was down are lost: every parked
                    // poll looks again.
                    self.queue.notify_all();
                    self.serve(node, link).await;
                    metrics::broker_links(-1);
                }
                Err(e) => {
                    failures += 1;
                    if failures == 1 {
                        tracing::warn!(node, error = e, "cannot open broker link; retrying");
                    } else {
                        tracing::debug!(node, error = e, failures, "cannot open broker link");
                    }
                }
            }
            if started.elapsed() >= STABLE_LINK {
                backoff.reset();
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff.next_delay()) => {}
                _ = self.closing.cancelled() => return,
                _ = self.shutdown.cancelled() => return,
            }
        }
    }

    async fn open(&self, node: NodeId) -> Result<Connected, String> {
        let broker = self
            .topology
            .node_broker(node)
            .ok_or_else(|| "no usable address".to_string())?;
        let hello = GatewayMessage {
            kind: Some(gateway_message::Kind::Hello(GatewayHello {
                gateway_id: self.gateway_id.clone(),
            })),
        };
        // Attached before the call: registration changes while it opens queue up
        // behind the hello and the initial registrations instead of being missed.
        let (outbound, rx) = self.streams.attach_link(node, hello);
        let call = broker.link(Box::pin(ReceiverStream::new(rx)));
        match tokio::time::timeout(OPEN_TIMEOUT, call).await {
            Ok(Ok(inbound)) => Ok(Connected { inbound, outbound }),
            Ok(Err(status)) => Err(status.to_string()),
            Err(_) => Err("timed out".to_string()),
        }
    }

    /// Handles the broker's messages until the link ends, must be reset, or shutdown.
    async fn serve(&self, node: NodeId, mut link: Connected) {
        loop {
            let next = tokio::select! {
                next = link.inbound.next() => next,
                _ = link.outbound.broken().cancelled() => {
                    tracing::warn!(node, "broker link reset: it stopped taking messages");
                    return;
                }
                _ = self.closing.cancelled() => return self.close(node, link).await,
                _ = self.shutdown.cancelled() => return,
            };
            match next {
                Some(Ok(msg)) => self.answer(node, msg, &link.outbound),
                None => {
                    if self.stopping.is_cancelled() {
                        tracing::info!(node, "broker closed the link as this gateway stops");
                    } else {
                        tracing::warn!(node, "broker closed the link");
                    }
                    return;
                }
                Some(Err(status)) => {
                    if self.stopping.is_cancelled() {
                        tracing::info!(node, %status, "broker link ended as this gateway stops");
                    } else {
                        tracing::warn!(node, %status, "broker link failed");
                    }
                    return;
                }
            }
        }
    }

    /// Handles one message from the broker and queues its answer, if it has one.
    fn answer(&self, node: NodeId, msg: BrokerMessage, outbound: &AttachedLink) {
        if let Some(reply) = self.handle(node, msg, outbound) {
            outbound.send(reply, "ack");
        }
    }

    /// Closes the link of a gateway that stops gracefully, once its clients are
    /// gone: their streams are unregistered and the jobs they had not received
    /// yielded, on this link's queue. For [`CLOSE_QUIET`] pushes that crossed the
    /// unregistrations are still answered (refused: the broker tries elsewhere);
    /// then the gateway says it is leaving (the jobs still handed out through it are
    /// with its clients' workers, which may finish them through another gateway:
    /// the broker leaves them to their activation timeouts instead of running them
    /// again after its lost-gateway grace), this side of the stream ends after
    /// everything queued on it, and the broker, having read it all, ends its side
    /// (waited for up to [`CLOSE_WAIT`]). Without this, the yields would die with
    /// the process and the jobs wait for the brokers' lost-gateway grace.
    async fn close(&self, node: NodeId, link: Connected) {
        let Connected {
            mut inbound,
            outbound,
        } = link;
        let quiet = tokio::time::sleep(CLOSE_QUIET);
        tokio::pin!(quiet);
        loop {
            tokio::select! {
                next = inbound.next() => match next {
                    Some(Ok(msg)) => self.answer(node, msg, &outbound),
                    _ => return,
                },
                () = &mut quiet => break,
                _ = self.shutdown.cancelled() => return,
            }
        }
        outbound.send(
            GatewayMessage {
                kind: Some(gateway_message::Kind::Leaving(GatewayLeaving {})),
            },
            "leaving",
        );
        drop(outbound);
        let drained = tokio::time::timeout(CLOSE_WAIT, async {
            while let Some(Ok(msg)) = inbound.next().await {
                tracing::debug!(node, ?msg.kind, "broker message after this gateway closed its side");
            }
        });
        tokio::select! {
            r = drained => match r {
                Ok(()) => tracing::info!(node, "broker link closed"),
                Err(_) => tracing::warn!(node, "the broker did not close the link in time"),
            },
            _ = self.shutdown.cancelled() => {}
        }
    }

    /// One message from a broker, and the answer to send back if it needs one. Never
    /// fails: a message that makes no sense is logged and dropped, the link stays up.
    fn handle(
        &self,
        node: NodeId,
        msg: BrokerMessage,
        link: &AttachedLink,
    ) -> Option<GatewayMessage> {
        match msg.kind {
            Some(broker_message::Kind::JobsAvailable(j)) => {
                if j.r#type.is_empty() {
                    tracing::warn!(node, "dropping JobsAvailable without a type");
                    return None;
                }
                tracing::trace!(
                    node,
                    job_type = j.r#type,
                    partition = j.partition_id,
                    "jobs available"
                );
                let partition = (j.partition_id > 0).then_some(PartitionId(j.partition_id));
                self.queue.notify(&j.r#type, &j.tenant_id, partition);
                self.streams.jobs_available(node, &j.r#type, &j.tenant_id);
                None
            }
            Some(broker_message::Kind::Push(p)) => Self::push(node, p, link),
            Some(broker_message::Kind::Finished(f)) => {
                tracing::trace!(node, job_key = f.key, lease = f.lease, "job finished");
                self.streams.finished(JobKey(f.key), Lease(f.lease));
                None
            }
            Some(broker_message::Kind::HeldQuery(q)) => {
                let (partition, asked) = (q.partition_id, q.jobs.len());
                let answer = self.streams.held(q);
                tracing::info!(
                    node,
                    partition,
                    asked,
                    held = answer.held.len(),
                    "a leader asked which of its partition's handed-out jobs this gateway holds \
                     (a new leader checking its predecessors' pushes, or a leader reclaiming \
                     the jobs of a gateway that is gone)"
                );
                Some(GatewayMessage {
                    kind: Some(gateway_message::Kind::HeldAnswer(answer)),
                })
            }
            Some(broker_message::Kind::Leading(l)) => {
                if l.partition_id == 0 {
                    tracing::warn!(node, "dropping Leading without a partition");
                    return None;
                }
                self.topology
                    .claim(PartitionId(l.partition_id), node, l.term);
                None
            }
            // A kind this gateway does not know (a newer broker) decodes as None.
            None => {
                tracing::warn!(node, "dropping a link message of unknown kind");
                None
            }
        }
    }

    fn push(node: NodeId, p: PushJob, link: &AttachedLink) -> Option<GatewayMessage> {
        let span = tracing::debug_span!(
            "push",
            node,
            stream_id = p.stream_id,
            push_id = p.push_id,
            partition = p.partition_id,
            job_key = p.job.as_ref().map(|j| j.key),
        );
        let _entered = span.enter();
        let ack = link.push(p)?;
        if ack.accepted {
            tracing::trace!("pushed job handed to a client");
        } else {
            tracing::debug!(reason = ack.reason, "pushed job refused");
        }
        Some(GatewayMessage {
            kind: Some(gateway_message::Kind::PushAck(ack)),
        })
    }
}
