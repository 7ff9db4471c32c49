//! Job push, the gateway's half: client job streams aggregated by activation
//! properties, their registration with every broker link, and the hand-off of pushed
//! jobs to clients.
//!
//! Everything lives under one mutex and nothing under it waits: client buffers and
//! link queues are written with `try_send`. Holding the lock while queueing is what
//! keeps every link's view exact: a link attaching, a stream appearing or going away,
//! and a client leaving are totally ordered, so a broker never misses a registration
//! or keeps one the gateway has dropped.
//!
//! Message flow per link: `Hello`, then `RegisterStream` for every current stream,
//! then `RegisterStream` / `UnregisterStream` as streams come and go, a `PushAck` for
//! every `PushJob`, and `YieldJob` for jobs whose client left before taking them.

use crate::metrics;
use courier_proto::cluster::{
    gateway_message, GatewayMessage, PushAck, PushJob, RegisterStream, StreamProps, StreamReady,
    UnregisterStream, YieldJob,
};
use courier_proto::domain::{ActivationProps, NodeId};
use courier_proto::gateway_protocol as gw;
use futures::Stream;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use tokio::sync::mpsc::{self, error::TrySendError};
use tokio_util::sync::CancellationToken;

/// Messages a link may have queued towards its broker beyond the registrations it
/// starts with. Nothing waits for room (a wait could deadlock against a broker that
/// waits for us): when full, the broker has stopped reading and the link is reset.
const OUTBOUND_BUFFER: usize = 1024;

/// [`PushAck::reason`] when the stream has no client.
pub const NO_CLIENT: &str = "no_client";
/// [`PushAck::reason`] when the push names a stream this gateway does not have (any
/// more: it may have just lost its last client).
pub const UNKNOWN_STREAM: &str = "unknown_stream";
/// [`PushAck::reason`] when every client of the stream had a full buffer.
pub const CLIENTS_FULL: &str = "clients_full";

/// A pushed job waiting in a client's buffer, with what a yield needs.
struct Buffered {
    /// Boxed: jobs are moved from buffer to buffer; the box keeps that cheap.
    job: Box<gw::ActivatedJob>,
    /// The broker that pushed it: a yield must reach that broker.
    node: NodeId,
    partition: u32,
    lease: u64,
}

struct Client {
    id: u64,
    tx: mpsc::Sender<Buffered>,
}

/// Client streams that share activation properties.
struct Aggregated {
    props: ActivationProps,
    clients: Vec<Client>,
    /// The client the next job is offered to first.
    next: usize,
    /// A push was refused with every client full since the brokers last heard the
    /// stream has room: the next job a client takes sends them `StreamReady`.
    refused: bool,
}

/// A broker link's outbound queue, as known to the registry.
struct LinkEntry {
    /// Tells a reconnected link's entry from its predecessor's.
    conn: u64,
    tx: mpsc::Sender<GatewayMessage>,
    /// Cancelled when a message could not be queued: the link must be re-opened so
    /// the broker's view is rebuilt from scratch.
    broken: CancellationToken,
}

/// `ActivationProps` as a map key. Its fetch variables and tenant ids arrive sorted
/// and de-duplicated from `convert::stream_request`, so equal sets are equal values.
#[derive(PartialEq, Eq)]
struct PropsKey(ActivationProps);

impl Hash for PropsKey {
    fn hash<H: Hasher>(&self, h: &mut H) {
        let p = &self.0;
        p.job_type.hash(h);
        p.worker.hash(h);
        p.timeout_ms.hash(h);
        p.fetch_variables.hash(h);
        p.tenant_ids.hash(h);
    }
}

#[derive(Default)]
struct State {
    by_props: HashMap<PropsKey, u64>,
    streams: HashMap<u64, Aggregated>,
    links: HashMap<NodeId, LinkEntry>,
    last_stream: u64,
    last_client: u64,
    last_conn: u64,
}

/// The gateway's aggregated streams and the broker links they are registered with.
pub struct AggregatedStreams {
    client_buffer: usize,
    state: Mutex<State>,
}

impl AggregatedStreams {
    /// An empty registry whose clients buffer up to `client_buffer` jobs each.
    pub fn new(client_buffer: usize) -> Arc<Self> {
        Arc::new(AggregatedStreams {
            // A zero-capacity channel panics; one job is the least a client can take.
            client_buffer: client_buffer.max(1),
            state: Mutex::new(State::default()),
        })
    }

    /// Adds a client with `props`, creating (and registering with every link) the
    /// aggregated stream if it is the first. The client leaves when the returned
    /// stream is dropped.
    pub fn join(self: &Arc<Self>, props: ActivationProps) -> ClientStream {
        let (tx, rx) = mpsc::channel(self.client_buffer);
        let mut st = self.lock();
        st.last_client += 1;
        let client_id = st.last_client;
        let key = PropsKey(props);
        let stream_id = match st.by_props.get(&key) {
            Some(&id) => id,
            None => {
                st.last_stream += 1;
                let id = st.last_stream;
                let register = register(id, &key.0);
                st.streams.insert(
                    id,
                    Aggregated {
                        props: key.0.clone(),
                        clients: Vec::new(),
                        next: 0,
                        refused: false,
                    },
                );
                st.by_props.insert(key, id);
                metrics::aggregated_streams(1);
                st.broadcast(&register, "register");
                id
            }
        };
        if let Some(s) = st.streams.get_mut(&stream_id) {
            s.clients.push(Client { id: client_id, tx });
        }
        metrics::stream_clients(1);
        ClientStream {
            streams: Arc::clone(self),
            stream_id,
            client_id,
            rx,
        }
    }

    /// Hands a job pushed by broker `node` to one client of its stream and says how
    /// it went, for the `PushAck`. `None`: the push carries no job, and is dropped.
    pub fn push(&self, node: NodeId, push: PushJob) -> Option<PushAck> {
        let Some(job) = push.job else {
            metrics::push_rejected("malformed");
            tracing::warn!(
                node,
                push_id = push.push_id,
                "dropping a PushJob without a job"
            );
            return None;
        };
        let buffered = Buffered {
            job: Box::new(job),
            node,
            partition: push.partition_id,
            lease: push.lease,
        };
        let stream_id = push.stream_id;
        let mut st = self.lock();
        let outcome = st.offer(stream_id, buffered);
        if let (Err((_, CLIENTS_FULL)), Some(s)) = (&outcome, st.streams.get_mut(&stream_id)) {
            s.refused = true;
        }
        drop(st);
        let reason = match outcome {
            Ok(()) => {
                metrics::job_pushed();
                ""
            }
            Err((_, reason)) => {
                metrics::push_rejected(reason);
                reason
            }
        };
        Some(PushAck {
            push_id: push.push_id,
            accepted: reason.is_empty(),
            reason: reason.to_string(),
        })
    }

    /// Attaches the outbound side of a link to broker `node`: the returned queue
    /// starts with `hello` and a `RegisterStream` for every current stream, then gets
    /// every registration change, until the returned guard is dropped.
    pub fn attach_link(
        self: &Arc<Self>,
        node: NodeId,
        hello: GatewayMessage,
    ) -> (AttachedLink, mpsc::Receiver<GatewayMessage>) {
        let mut st = self.lock();
        let (tx, rx) = mpsc::channel(OUTBOUND_BUFFER + st.streams.len() + 1);
        let broken = CancellationToken::new();
        st.last_conn += 1;
        let conn = st.last_conn;
        // Room was made for all of these: they cannot fail.
        let _ = tx.try_send(hello);
        for (&id, s) in &st.streams {
            let _ = tx.try_send(register(id, &s.props));
        }
        let entry = LinkEntry {
            conn,
            tx: tx.clone(),
            broken: broken.clone(),
        };
        if let Some(old) = st.links.insert(node, entry) {
            // One link task per broker makes this impossible; if it happened, the
            // old connection's registrations would no longer be kept in step.
            old.broken.cancel();
        }
        let link = AttachedLink {
            streams: Arc::clone(self),
            node,
            conn,
            tx,
            broken,
        };
        (link, rx)
    }

    /// Aggregated streams right now.
    pub fn stream_count(&self) -> usize {
        self.lock().streams.len()
    }

    /// Clients of all streams right now.
    pub fn client_count(&self) -> usize {
        self.lock().streams.values().map(|s| s.clients.len()).sum()
    }

    /// Removes a client; its buffered jobs go to the stream's other clients or back to
    /// the brokers that pushed them.
    fn leave(&self, stream_id: u64, client_id: u64, rx: &mut mpsc::Receiver<Buffered>) {
        let mut st = self.lock();
        let Some(stream) = st.streams.get_mut(&stream_id) else {
            return;
        };
        let Some(pos) = stream.clients.iter().position(|c| c.id == client_id) else {
            return;
        };
        // Dropping its sender (the only one) means the buffer below is all there is.
        stream.clients.remove(pos);
        // The rotation goes on with the client that followed the one removed.
        if pos < stream.next {
            stream.next -= 1;
        }
        if stream.next >= stream.clients.len() {
            stream.next = 0;
        }
        let left = stream.clients.len();
        metrics::stream_clients(-1);
        rx.close();
        let (mut moved, mut yielded) = (0usize, 0usize);
        while let Ok(b) = rx.try_recv() {
            match st.offer(stream_id, b) {
                Ok(()) => moved += 1,
                Err((b, reason)) => {
                    yielded += 1;
                    st.yield_job(b, reason);
                }
            }
        }
        tracing::debug!(
            stream_id,
            client_id,
            clients_left = left,
            moved,
            yielded,
            "stream client left"
        );
        if left == 0 {
            if let Some(s) = st.streams.remove(&stream_id) {
                st.by_props.remove(&PropsKey(s.props));
            }
            metrics::aggregated_streams(-1);
            let unregister = GatewayMessage {
                kind: Some(gateway_message::Kind::Unregister(UnregisterStream {
                    stream_id,
                })),
            };
            st.broadcast(&unregister, "unregister");
        }
    }

    /// A client took a job from its buffer: if the stream refused pushes for want of
    /// room, tell every broker it has room again, once.
    fn took(&self, stream_id: u64) {
        let mut st = self.lock();
        let Some(s) = st.streams.get_mut(&stream_id) else {
            return;
        };
        if !std::mem::take(&mut s.refused) {
            return;
        }
        let ready = GatewayMessage {
            kind: Some(gateway_message::Kind::Ready(StreamReady { stream_id })),
        };
        st.broadcast(&ready, "ready");
    }

    fn detach_link(&self, node: NodeId, conn: u64) {
        let mut st = self.lock();
        if st.links.get(&node).is_some_and(|l| l.conn == conn) {
            st.links.remove(&node);
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the state consistent, so a poisoned one is usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl State {
    /// Offers a job to the stream's clients in round-robin order, each at most once.
    fn offer(&mut self, stream_id: u64, mut job: Buffered) -> Result<(), (Buffered, &'static str)> {
        let Some(stream) = self.streams.get_mut(&stream_id) else {
            return Err((job, UNKNOWN_STREAM));
        };
        let n = stream.clients.len();
        if n == 0 {
            return Err((job, NO_CLIENT));
        }
        for i in 0..n {
            let at = (stream.next + i) % n;
            match stream.clients[at].tx.try_send(job) {
                Ok(()) => {
                    stream.next = (at + 1) % n;
                    return Ok(());
                }
                // Closed cannot happen while the client is listed (its receiver is
                // dropped only after it is removed), but it means the same: next one.
                Err(TrySendError::Full(j) | TrySendError::Closed(j)) => {
                    metrics::push_try_next();
                    job = j;
                }
            }
        }
        Err((job, CLIENTS_FULL))
    }

    /// Gives a job no client could take back to the broker that pushed it.
    fn yield_job(&mut self, b: Buffered, reason: &'static str) {
        let msg = GatewayMessage {
            kind: Some(gateway_message::Kind::YieldJob(YieldJob {
                partition_id: b.partition,
                key: b.job.key,
                lease: b.lease,
            })),
        };
        // The link may have reconnected since the push: the broker is the same, and
        // the lease makes a yield for a stale activation a no-op.
        if self.send_to(b.node, msg, "yield") {
            metrics::job_yielded(reason);
            tracing::debug!(node = b.node, job_key = b.job.key, reason, "job yielded");
        } else {
            // Its activation deadline makes it runnable again.
            tracing::warn!(
                node = b.node,
                job_key = b.job.key,
                "cannot yield a job: no link to its broker"
            );
        }
    }

    /// Queues `msg` on the link to `node`. A full or closed queue resets the link.
    fn send_to(&mut self, node: NodeId, msg: GatewayMessage, kind: &'static str) -> bool {
        let Some(link) = self.links.get(&node) else {
            metrics::link_message_dropped(kind);
            return false;
        };
        if link.tx.try_send(msg).is_ok() {
            return true;
        }
        self.break_link(node, kind);
        false
    }

    /// Queues `msg` on every link; links whose queue is full or closed are reset.
    fn broadcast(&mut self, msg: &GatewayMessage, kind: &'static str) {
        let failed: Vec<NodeId> = self
            .links
            .iter()
            .filter(|(_, l)| l.tx.try_send(msg.clone()).is_err())
            .map(|(&node, _)| node)
            .collect();
        for node in failed {
            self.break_link(node, kind);
        }
    }

    /// Forgets a link that could not take a message and has it reconnect: the broker
    /// drops the old connection's registrations, the new one gets them all again.
    fn break_link(&mut self, node: NodeId, kind: &'static str) {
        metrics::link_message_dropped(kind);
        if let Some(link) = self.links.remove(&node) {
            tracing::warn!(node, kind, "broker link queue full or closed; resetting it");
            link.broken.cancel();
        }
    }
}

fn register(stream_id: u64, props: &ActivationProps) -> GatewayMessage {
    GatewayMessage {
        kind: Some(gateway_message::Kind::Register(RegisterStream {
            stream_id,
            props: Some(StreamProps::from(props)),
        })),
    }
}

/// A link's place in the registry; dropping it detaches the link.
pub struct AttachedLink {
    streams: Arc<AggregatedStreams>,
    node: NodeId,
    conn: u64,
    tx: mpsc::Sender<GatewayMessage>,
    broken: CancellationToken,
}

impl AttachedLink {
    /// Cancelled when the link must be re-opened (its queue overflowed).
    pub fn broken(&self) -> &CancellationToken {
        &self.broken
    }

    /// Queues a message of this link's own (an ack). Never waits: a full queue drops
    /// the message, counted, since waiting could deadlock against the broker.
    pub fn send(&self, msg: GatewayMessage, kind: &'static str) {
        if self.tx.try_send(msg).is_err() {
            metrics::link_message_dropped(kind);
            tracing::debug!(node = self.node, kind, "link queue full; message dropped");
        }
    }
}

impl Drop for AttachedLink {
    fn drop(&mut self) {
        self.streams.detach_link(self.node, self.conn);
    }
}

/// One client's jobs. Dropping it (tonic drops a response stream whose client went
/// away) removes the client at once.
pub struct ClientStream {
    streams: Arc<AggregatedStreams>,
    stream_id: u64,
    client_id: u64,
    rx: mpsc::Receiver<Buffered>,
}

impl ClientStream {
    /// The aggregated stream this client belongs to.
    pub fn stream_id(&self) -> u64 {
        self.stream_id
    }
}

impl Stream for ClientStream {
    type Item = gw::ActivatedJob;

    /// Never ends on its own: the client's sender lives until the client leaves.
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let polled = self.rx.poll_recv(cx);
        if let Poll::Ready(Some(_)) = &polled {
            self.streams.took(self.stream_id);
        }
        polled.map(|b| b.map(|b| *b.job))
    }
}

impl Drop for ClientStream {
    fn drop(&mut self) {
        self.streams
            .leave(self.stream_id, self.client_id, &mut self.rx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use courier_proto::cluster::gateway_message::Kind;
    use courier_proto::domain::DEFAULT_TENANT;
    use futures::FutureExt;
    use futures::StreamExt;

    fn props(job_type: &str, fetch: &[&str], tenants: &[&str]) -> ActivationProps {
        let r = gw::StreamActivatedJobsRequest {
            r#type: job_type.into(),
            worker: "w".into(),
            timeout: 1000,
            fetch_variable: fetch.iter().map(|s| s.to_string()).collect(),
            tenant_ids: tenants.iter().map(|s| s.to_string()).collect(),
        };
        courier_proto::convert::stream_request(&r).unwrap()
    }

    fn t() -> ActivationProps {
        props("t", &[], &[])
    }

    fn push(stream_id: u64, key: i64) -> PushJob {
        PushJob {
            push_id: key as u64 + 1000,
            stream_id,
            partition_id: 1,
            lease: key as u64 + 500,
            job: Some(gw::ActivatedJob {
                key,
                ..Default::default()
            }),
        }
    }

    fn hello() -> GatewayMessage {
        GatewayMessage {
            kind: Some(Kind::Hello(Default::default())),
        }
    }

    /// Everything queued on a link so far.
    fn drain(rx: &mut mpsc::Receiver<GatewayMessage>) -> Vec<Kind> {
        std::iter::from_fn(|| rx.try_recv().ok())
            .filter_map(|m| m.kind)
            .collect()
    }

    /// Keys of every job buffered for a client so far.
    fn keys(c: &mut ClientStream) -> Vec<i64> {
        std::iter::from_fn(|| c.next().now_or_never().flatten())
            .map(|j| j.key)
            .collect()
    }

    fn ack(s: &AggregatedStreams, node: NodeId, p: PushJob) -> (bool, String) {
        let a = s.push(node, p).unwrap();
        (a.accepted, a.reason)
    }

    #[test]
    fn a_stream_that_refused_for_lack_of_room_says_once_when_it_has_room_again() {
        let s = AggregatedStreams::new(1);
        let (_l, mut rx) = s.attach_link(1, hello());
        let mut c = s.join(t());
        let id = c.stream_id();
        drain(&mut rx);
        assert_eq!(ack(&s, 1, push(id, 1)), (true, String::new()));
        // Taking a job when nothing was refused says nothing.
        assert_eq!(keys(&mut c), vec![1]);
        assert!(drain(&mut rx).is_empty());
        assert_eq!(ack(&s, 1, push(id, 2)), (true, String::new()));
        assert_eq!(ack(&s, 1, push(id, 3)), (false, CLIENTS_FULL.to_string()));
        assert_eq!(ack(&s, 1, push(id, 4)), (false, CLIENTS_FULL.to_string()));
        assert!(
            drain(&mut rx).is_empty(),
            "nothing until a client takes a job"
        );
        assert_eq!(keys(&mut c), vec![2]);
        let msgs = drain(&mut rx);
        assert!(
            matches!(&msgs[..], [Kind::Ready(r)] if r.stream_id == id),
            "one StreamReady: {msgs:?}"
        );
        assert_eq!(ack(&s, 1, push(id, 5)), (true, String::new()));
        assert_eq!(keys(&mut c), vec![5]);
        assert!(drain(&mut rx).is_empty(), "said once");
    }

    #[test]
    fn equal_props_share_a_stream_and_different_ones_do_not() {
        let s = AggregatedStreams::new(32);
        let a = s.join(props("t", &["x", "y"], &["b", "a"]));
        let b = s.join(props("t", &["y", "x", "y"], &["a", "b"]));
        assert_eq!(a.stream_id(), b.stream_id());
        let others = [
            props("u", &["x", "y"], &["a", "b"]),
            props("t", &["x"], &["a", "b"]),
            props("t", &["x", "y"], &["a"]),
            props("t", &["x", "y"], &[DEFAULT_TENANT]),
        ];
        let mut ids = vec![a.stream_id()];
        let clients: Vec<ClientStream> = others.into_iter().map(|p| s.join(p)).collect();
        ids.extend(clients.iter().map(|c| c.stream_id()));
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), 5, "{ids:?}");
        assert_eq!(s.stream_count(), 5);
        assert_eq!(s.client_count(), 6);
        drop(clients);
        drop(a);
        assert_eq!(s.stream_count(), 1);
        drop(b);
        assert_eq!((s.stream_count(), s.client_count()), (0, 0));
        // A stream created again after it went away gets a new id: stale pushes for the
        // old one are refused rather than delivered to the wrong stream generation.
        let c = s.join(t());
        let d = s.join(props("t", &["x", "y"], &["a", "b"]));
        assert!(d.stream_id() > c.stream_id());
    }

    #[test]
    fn streams_are_registered_with_every_link_on_first_join_and_unregistered_on_last_leave() {
        let s = AggregatedStreams::new(32);
        let (_l1, mut rx1) = s.attach_link(1, hello());
        let (_l2, mut rx2) = s.attach_link(2, hello());
        assert!(matches!(drain(&mut rx1)[..], [Kind::Hello(_)]));
        assert!(matches!(drain(&mut rx2)[..], [Kind::Hello(_)]));

        let a = s.join(t());
        let id = a.stream_id();
        for rx in [&mut rx1, &mut rx2] {
            match &drain(rx)[..] {
                [Kind::Register(r)] => {
                    assert_eq!(r.stream_id, id);
                    assert_eq!(r.props, Some(StreamProps::from(&t())));
                }
                other => panic!("{other:?}"),
            }
        }
        let b = s.join(t());
        drop(a);
        assert!(drain(&mut rx1).is_empty());
        assert!(drain(&mut rx2).is_empty());

        // A link (re)connecting gets the hello, then every current stream.
        let _u = s.join(props("u", &[], &[]));
        let (l3, mut rx3) = s.attach_link(3, hello());
        let got = drain(&mut rx3);
        assert!(matches!(got[0], Kind::Hello(_)), "{got:?}");
        let mut registered: Vec<String> = got[1..]
            .iter()
            .map(|k| match k {
                Kind::Register(r) => r.props.as_ref().unwrap().r#type.clone(),
                other => panic!("{other:?}"),
            })
            .collect();
        registered.sort();
        assert_eq!(registered, ["t", "u"]);
        drain(&mut rx1);
        drain(&mut rx2);

        // A detached link hears nothing more.
        drop(l3);
        drop(b);
        for rx in [&mut rx1, &mut rx2] {
            match &drain(rx)[..] {
                [Kind::Unregister(u)] => assert_eq!(u.stream_id, id),
                other => panic!("{other:?}"),
            }
        }
        assert!(drain(&mut rx3).is_empty());
    }

    #[test]
    fn a_link_that_cannot_take_a_message_is_reset() {
        let s = AggregatedStreams::new(32);
        let (l1, _rx1) = s.attach_link(1, hello());
        // Fill the queue as a broker that stopped reading would.
        for _ in 0..OUTBOUND_BUFFER {
            l1.send(hello(), "ack");
        }
        assert!(!l1.broken().is_cancelled());
        let _a = s.join(t());
        assert!(l1.broken().is_cancelled());
        // Forgotten: the reconnect registers everything afresh.
        let (_l1, mut rx1) = s.attach_link(1, hello());
        assert!(matches!(
            drain(&mut rx1)[..],
            [Kind::Hello(_), Kind::Register(_)]
        ));
    }

    #[test]
    fn pushes_go_round_robin() {
        let s = AggregatedStreams::new(64);
        let mut a = s.join(t());
        let mut b = s.join(t());
        for k in 0..100 {
            assert_eq!(ack(&s, 1, push(a.stream_id(), k)), (true, String::new()));
        }
        let (ka, kb) = (keys(&mut a), keys(&mut b));
        assert_eq!((ka.len(), kb.len()), (50, 50));
        // Strictly alternating, not just balanced.
        assert!(ka.iter().all(|k| k % 2 == 0), "{ka:?}");
        assert!(kb.iter().all(|k| k % 2 == 1), "{kb:?}");
    }

    #[test]
    fn a_full_client_is_skipped_and_all_full_is_refused() {
        let s = AggregatedStreams::new(2);
        let mut a = s.join(t());
        let mut b = s.join(t());
        let id = a.stream_id();
        // a: 0, b: 1, a: 2 -> a is full; b's worker takes its job.
        for k in 0..3 {
            assert!(ack(&s, 1, push(id, k)).0);
        }
        assert_eq!(keys(&mut b), [1]);
        // b's turn: 3; then a's turn, but a is full: b takes 4 too.
        assert!(ack(&s, 1, push(id, 3)).0);
        assert!(ack(&s, 1, push(id, 4)).0);
        assert_eq!(ack(&s, 1, push(id, 5)), (false, CLIENTS_FULL.to_string()));
        assert_eq!(keys(&mut a), [0, 2]);
        assert_eq!(keys(&mut b), [3, 4]);
        // Room again: taken.
        assert!(ack(&s, 1, push(id, 6)).0);
    }

    #[test]
    fn unknown_streams_and_malformed_pushes_are_refused() {
        let s = AggregatedStreams::new(2);
        assert_eq!(ack(&s, 1, push(77, 1)), (false, UNKNOWN_STREAM.to_string()));
        let a = s.join(t());
        let id = a.stream_id();
        drop(a);
        // Gone with its last client.
        assert_eq!(ack(&s, 1, push(id, 1)), (false, UNKNOWN_STREAM.to_string()));
        let mut p = push(id, 1);
        p.job = None;
        assert!(s.push(1, p).is_none());
        let ack = s.push(1, push(id, 9));
        assert_eq!(ack.map(|a| a.push_id), Some(1009));
    }

    #[test]
    fn a_leaving_clients_buffered_jobs_go_to_the_next_client() {
        let s = AggregatedStreams::new(4);
        let (_l1, mut rx1) = s.attach_link(1, hello());
        let a = s.join(t());
        let mut b = s.join(t());
        let id = a.stream_id();
        for k in 0..4 {
            assert!(ack(&s, 1, push(id, k)).0);
        }
        drop(a);
        let mut got = keys(&mut b);
        got.sort();
        assert_eq!(got, [0, 1, 2, 3]);
        assert_eq!(s.client_count(), 1);
        // Nothing yielded, the stream is still registered.
        assert!(matches!(
            drain(&mut rx1)[..],
            [Kind::Hello(_), Kind::Register(_)]
        ));
    }

    #[test]
    fn jobs_no_client_can_take_are_yielded_to_the_broker_that_pushed_them() {
        let s = AggregatedStreams::new(4);
        let (_l1, mut rx1) = s.attach_link(1, hello());
        let (_l2, mut rx2) = s.attach_link(2, hello());
        let a = s.join(t());
        let id = a.stream_id();
        assert!(ack(&s, 1, push(id, 10)).0);
        assert!(ack(&s, 2, push(id, 20)).0);
        assert!(ack(&s, 1, push(id, 11)).0);
        drain(&mut rx1);
        drain(&mut rx2);
        drop(a);
        let yields = |rx: &mut mpsc::Receiver<GatewayMessage>| -> Vec<(u32, i64, u64)> {
            drain(rx)
                .into_iter()
                .filter_map(|k| match k {
                    Kind::YieldJob(y) => Some((y.partition_id, y.key, y.lease)),
                    Kind::Unregister(_) => None,
                    other => panic!("{other:?}"),
                })
                .collect()
        };
        assert_eq!(yields(&mut rx1), [(1, 10, 510), (1, 11, 511)]);
        assert_eq!(yields(&mut rx2), [(1, 20, 520)]);
        assert_eq!(s.stream_count(), 0);
    }

    #[test]
    fn jobs_the_remaining_clients_have_no_room_for_are_yielded() {
        let s = AggregatedStreams::new(1);
        let (_l1, mut rx1) = s.attach_link(1, hello());
        let a = s.join(t());
        let mut b = s.join(t());
        let id = a.stream_id();
        assert!(ack(&s, 1, push(id, 1)).0);
        assert!(ack(&s, 1, push(id, 2)).0);
        drain(&mut rx1);
        drop(a);
        match &drain(&mut rx1)[..] {
            [Kind::YieldJob(y)] => assert_eq!(y.key, 1),
            other => panic!("{other:?}"),
        }
        assert_eq!(keys(&mut b), [2]);
        // b stays in the rotation alone.
        assert!(ack(&s, 1, push(id, 3)).0);
        assert_eq!(keys(&mut b), [3]);
    }

    #[test]
    fn the_rotation_continues_past_a_removed_client() {
        let s = AggregatedStreams::new(8);
        let mut a = s.join(t());
        let mut b = s.join(t());
        let mut c = s.join(t());
        let id = a.stream_id();
        // a, b: next is c.
        assert!(ack(&s, 1, push(id, 0)).0);
        assert!(ack(&s, 1, push(id, 1)).0);
        assert_eq!(keys(&mut b), [1]);
        drop(b);
        assert!(ack(&s, 1, push(id, 2)).0);
        assert!(ack(&s, 1, push(id, 3)).0);
        assert_eq!(keys(&mut a), [0, 3]);
        assert_eq!(keys(&mut c), [2]);
    }

    #[test]
    fn a_buffer_of_zero_still_takes_one_job() {
        let s = AggregatedStreams::new(0);
        let mut a = s.join(t());
        assert!(ack(&s, 1, push(a.stream_id(), 1)).0);
        assert!(!ack(&s, 1, push(a.stream_id(), 2)).0);
        assert_eq!(keys(&mut a), [1]);
    }
}
