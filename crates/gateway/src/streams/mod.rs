//! Job push, the gateway's half: client job streams aggregated by activation
//! properties, their registration with every broker link, the hand-off of pushed
//! jobs to clients, and flow control.
//!
//! Everything lives under one mutex and nothing under it waits: client buffers and
//! link queues are written with `try_send`. Holding the lock while queueing is what
//! keeps every link's view exact: a link attaching, a stream appearing or going away,
//! and a client leaving are totally ordered, so a broker never misses a registration
//! or keeps one the gateway has dropped.
//!
//! # Flow control
//! Each client has a credit: how many pushed jobs it may hold unfinished. A job
//! counts against its client from hand-off until it is completed, failed or thrown
//! through this gateway, a broker says it finished (`JobFinished`), or its
//! activation deadline passes. Jobs go to the clients in turn (round-robin), skipping
//! any without free credit; a client's buffer holds as many jobs as its credit, so a client
//! whose buffer is full (its HTTP/2 window is) has none. The gateway as a whole
//! holds at most `max_inflight_jobs` jobs and `max_inflight_bytes` bytes.
//!
//! A stream also has a small spare room (`Limits::spare_percent` of its clients'
//! credit): jobs pushed when no client has free credit wait there, oldest first, for
//! the first client that frees some, so a worker that finishes a job is handed the
//! next one at once, without a round trip to a broker and a log write. The room is
//! reported as credit; as much again is accepted beyond it, because a broker's view
//! of its share can be overtaken by other brokers' pushes, and a push that arrives on
//! such a stale share is better kept for a moment than refused and written back to
//! the log as a yield. A spare job counts against the gateway's bounds, keeps its
//! activation deadline, and goes back to its broker if the stream loses its last
//! client.
//!
//! Each broker link hears, per stream, its share of the stream's free credit and
//! how many pushes for the stream it has received from that broker on this
//! connection (`StreamCredit`); the broker may push `free - (sent - received)` more.
//! A push changes neither side of that sum, so pushes alone send no report: a
//! stream is marked dirty when credit comes back or its split may have changed, and
//! a flusher sends the reports that changed, at most every [`FLUSH_GAP`]. Less
//! credit than a broker was told is reported at once; more, only once the broker's
//! view has fallen to half of its share (see [`worth_reporting`]), so a finished job
//! does not cost a message of its own.
//!
//! Message flow per link: `Hello`, then `RegisterStream` and `StreamCredit` for
//! every current stream, then `RegisterStream` / `UnregisterStream` as streams come
//! and go, `StreamCredit` as credit changes, a `PushAck` for every `PushJob`,
//! `YieldJob` for jobs whose client left before taking them, and a `HeldAnswer` for
//! every `HeldQuery` (a new leader asking which of its predecessors' pushes arrived).
//!
//! # Layout
//! - this file: the registry's types and its entry points (join, push, finish);
//! - `clients`: a client leaving, taking a job, and the stream it reads;
//! - `links`: broker links attaching and detaching, the report flusher, the sweep;
//! - `state`: what happens under the lock (hand-off, held jobs, spare rooms,
//!   reports, yields);
//! - `credit`: credit arithmetic, pure functions.

use crate::metrics::{self, CreditGauges};
use courier_proto::cluster::{
    gateway_message, GatewayMessage, HeldAnswer, HeldQuery, PushAck, PushJob, RegisterStream,
    StreamCredit, StreamProps, UnregisterStream, YieldJob,
};
use courier_proto::domain::{ActivationProps, JobKey, Lease, NodeId, StreamId};
use courier_proto::gateway_protocol as gw;
use courier_proto::sync::lock;
use futures::Stream;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::hash::{Hash, Hasher};
use std::ops::Bound;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::{mpsc, watch, Notify};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

mod clients;
mod credit;
mod links;
mod state;
#[cfg(test)]
mod tests;

pub use clients::{ClientStream, Finishing};
use credit::*;
use links::register;
pub use links::AttachedLink;
use state::instant_in;

/// Messages a link may have queued towards its broker beyond the registrations and
/// reports it starts with. Nothing waits for room (a wait could deadlock against a
/// broker that waits for us): when full, the broker has stopped reading and the
/// link is reset.
const OUTBOUND_BUFFER: usize = 1024;
/// Least time between two flushes of credit reports: credit released within it goes
/// out in one report per stream and link, not one per job.
const FLUSH_GAP: Duration = Duration::from_millis(2);
/// How often passed activation deadlines release their credit. A backstop: the
/// broker's `JobFinished` for a timed-out job normally comes first.
const SWEEP_EVERY: Duration = Duration::from_millis(100);
/// How long a broker that announced jobs of a stream it had no credit to push keeps
/// the stream's free credit to itself (with the other brokers that did) after its
/// last such notice or push, counted only while the stream has free credit.
const DEMAND_WINDOW: Duration = Duration::from_secs(1);
/// Bound on how long a job is held, so an absurd deadline cannot overflow an Instant.
const MAX_HOLD: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// Most credit a client may state for itself.
pub const MAX_CLIENT_CREDIT: u32 = 10_000;

/// Why a push is refused (its [`PushAck::reason`]); see [`courier_proto::push_refusal`].
pub use courier_proto::push_refusal::{
    CLIENTS_FULL, DISOWNED, GATEWAY_FULL, NO_CLIENT, UNKNOWN_STREAM,
};
/// How long the gateway remembers the activations it told a leader it does not hold.
/// A late push can only come over a link that is still up, and a broker that does
/// not answer the link's pings for 15 s (see `topology::KEEPALIVE_INTERVAL` and
/// `KEEPALIVE_TIMEOUT`) loses its link and the pushes queued on it: four times that
/// is ample.
const DISOWNED_MEMORY: Duration = Duration::from_secs(60);
/// How long spare jobs may wait for a client of their stream to free credit. Past
/// it the stream's clients are stuck or slow: the spare jobs go back to their
/// brokers (for streams elsewhere, or polls) rather than wait for their activation
/// timeouts, and the spare room is not offered again until a client frees credit.
const SPARE_WAIT: Duration = Duration::from_secs(5);
/// Yield reason of spare jobs that waited [`SPARE_WAIT`] for a client with room.
pub const SPARE_WAITED: &str = "spare_waited";
/// Yield reason of a spare job that waited until less than half its activation
/// timeout was left: handed out now, it could time out while its worker runs it.
pub const SPARE_STALE: &str = "spare_stale";

/// The flow-control bounds.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Credit of a client that states none.
    pub client_credit: u32,
    /// Most pushed jobs held unfinished across all clients.
    pub max_inflight_jobs: usize,
    /// Most bytes (variables and custom headers) of those jobs.
    pub max_inflight_bytes: usize,
    /// Spare room of a stream, in percent of each client's credit (rounded up): pushed
    /// jobs the gateway keeps for the stream's clients when none has free credit,
    /// handed to the first that frees some. It is reported as credit, so the next jobs
    /// are already here when a worker finishes one; as much again is accepted beyond
    /// what was reported, so pushes made on a credit report that another broker's
    /// pushes overtook wait here instead of being refused and yielded. 0: none.
    pub spare_percent: u32,
}

/// A client stream at this gateway, numbered in order of arrival.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClientId(u64);

impl std::fmt::Display for ClientId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Who holds a pushed job at this gateway.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Holder {
    /// A client (that may have left: the job still counts against the gateway).
    Client(ClientId),
    /// Its stream's spare room, until a client frees credit.
    Spare,
}

/// A pushed job waiting in a client's buffer, with what a yield needs.
struct Buffered {
    /// Boxed: jobs are moved from buffer to buffer; the box keeps that cheap.
    job: Box<gw::ActivatedJob>,
    /// The broker that pushed it, for the logs (a yield goes to every broker).
    node: NodeId,
    partition: u32,
    lease: Lease,
}

impl Buffered {
    /// The job's key.
    fn key(&self) -> JobKey {
        JobKey(self.job.key)
    }
}

struct Client {
    stream_id: StreamId,
    /// Its capacity is the credit.
    tx: mpsc::Sender<Buffered>,
    credit: u32,
    /// Jobs handed to it and not finished, buffered or not.
    held: u32,
    /// Its [`free`](Self::free) as last counted into its stream's
    /// [`Aggregated::free`] and `ready` (see [`State::recount`]).
    counted: u32,
}

impl Client {
    /// Jobs it may be handed now. Its buffer's room bounds it too: jobs whose credit
    /// came back may still sit in the buffer.
    fn free(&self) -> u32 {
        let room = u32::try_from(self.tx.capacity()).unwrap_or(u32::MAX);
        self.credit.saturating_sub(self.held).min(room)
    }
}

/// Client streams that share activation properties.
///
/// Its clients' free credit is counted as it changes, and those with some are kept
/// in an ordered set, so a push, a credit report and a client leaving cost the same
/// with a hundred thousand clients as with one.
struct Aggregated {
    props: ActivationProps,
    /// How many clients it has.
    members: usize,
    /// Its clients that may be handed a job now (free credit, room in the buffer),
    /// by id: jobs go round them in that order.
    ready: BTreeSet<ClientId>,
    /// The client the last job went to: the next goes to the first ready one after it.
    last: ClientId,
    /// The sum of its clients' free credit, as counted.
    free: u64,
    /// Where the remainder of the credit split starts, so it goes round the brokers.
    rotate: usize,
    gauges: CreditGauges,
    /// Jobs waiting for a client with free credit, oldest first. May hold jobs whose
    /// hold ended since (finished, deadline passed): they are dropped when reached.
    spare: VecDeque<Buffered>,
    /// Jobs of `spare` still held.
    spared: u32,
    /// The spare room reported as credit: the sum of the clients' shares.
    spare_room: u32,
    /// Its spare jobs waited [`SPARE_WAIT`] and went back: the spare room is neither
    /// offered nor filled until a client has free credit again.
    spare_paused: bool,
    /// Brokers with jobs of this stream they had no credit to push (they announced
    /// them as available), and when that was last seen: while there are any, the
    /// free credit is split among them alone, so a backlog on one partition is not
    /// held to its leader's share while the shares of brokers with nothing to push
    /// go unused. See [`DEMAND_WINDOW`].
    wanted: BTreeMap<NodeId, Instant>,
    /// The broker that announced such jobs last, until it pushes for the stream: the
    /// remainder of the split goes to it first. With less credit than brokers (a
    /// worker taking one job at a time), only some of them get any, and without this
    /// a broker announcing a new job would wait, while the credit sat with one whose
    /// jobs were gone, until its demand aged out.
    prefer: Option<NodeId>,
}

impl Aggregated {
    /// Whether one more job fits in the spare room, counting the tolerance beyond
    /// what was reported.
    fn spare_fits(&self) -> bool {
        self.spared < self.spare_room.saturating_mul(2)
    }
}

/// A pushed job counted against a client until it finishes.
struct Held {
    stream_id: StreamId,
    holder: Holder,
    /// The activation held; `None` for a job a joining client declared it holds
    /// (the client does not know which activation it has).
    lease: Option<Lease>,
    /// When the activation times out, in the gateway's clock.
    deadline: Instant,
    /// Variables and custom headers.
    bytes: usize,
    /// When it was handed off: a finish through this gateway whose request started
    /// earlier is about an older activation of the same job.
    since: Instant,
}

/// What a link has heard of one stream on its current connection.
#[derive(Default)]
struct LinkStream {
    /// `PushJob`s for the stream received on this connection.
    received: u64,
    /// The last report sent: (free share, received).
    reported: Option<(u32, u64)>,
    /// A larger credit than reported (as `share + received`), held back while the
    /// broker's view is good enough (see [`worth_reporting`]); pushes wear that
    /// view down, so each one checks it again.
    owed: Option<u64>,
}

/// A broker link's outbound queue, as known to the registry.
struct LinkEntry {
    /// Tells a reconnected link's entry from its predecessor's.
    conn: u64,
    tx: mpsc::Sender<GatewayMessage>,
    /// Cancelled when a message could not be queued: the link must be re-opened so
    /// the broker's view is rebuilt from scratch.
    broken: CancellationToken,
    /// Per stream id; starts empty with each connection, as the broker's view does.
    streams: HashMap<StreamId, LinkStream>,
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

struct State {
    limits: Limits,
    by_props: HashMap<PropsKey, StreamId>,
    /// Streams per job type, for notices of available jobs.
    by_type: HashMap<String, BTreeSet<StreamId>>,
    /// Streams some broker has jobs for that it had no credit to push (a non-empty
    /// [`Aggregated::wanted`]): those whose demand ages.
    demanded: BTreeSet<StreamId>,
    /// Streams that have had spare jobs since the last sweep looked.
    with_spare: BTreeSet<StreamId>,
    streams: HashMap<StreamId, Aggregated>,
    clients: HashMap<ClientId, Client>,
    links: HashMap<NodeId, LinkEntry>,
    /// Job key -> its hand-off, so finishing is O(1).
    held: HashMap<JobKey, Held>,
    /// Job key -> completions, failures and thrown errors for it on their way
    /// through this gateway now (see [`Finishing`]).
    finishing: HashMap<JobKey, u32>,
    /// (job key, lease) a leader was told this gateway does not hold, and when.
    disowned: HashMap<(JobKey, Lease), Instant>,
    /// (deadline, job key) of every held job, earliest first.
    deadlines: BTreeSet<(Instant, JobKey)>,
    inflight_bytes: usize,
    /// A push was refused for the gateway's bounds and nothing was released since:
    /// reports say no room, so brokers do not keep pushing into a full gateway.
    full: bool,
    /// Streams whose reports must be recomputed.
    dirty: HashSet<StreamId>,
    /// Streams whose last report was cut down to the gateway's headroom: credit
    /// released anywhere changes theirs too.
    capped: HashSet<StreamId>,
    /// Partitions led per broker: the weights of the credit split.
    leaders: BTreeMap<NodeId, u32>,
    last_stream: u64,
    last_client: u64,
    last_conn: u64,
}

/// The gateway's aggregated streams, the broker links they are registered with, and
/// the credit of their clients.
pub struct AggregatedStreams {
    state: Mutex<State>,
    /// Wakes the flusher when streams are marked dirty.
    wake: Notify,
}

impl AggregatedStreams {
    /// An empty registry with these bounds.
    pub fn new(limits: Limits) -> Arc<Self> {
        Arc::new(AggregatedStreams {
            state: Mutex::new(State {
                limits,
                by_props: HashMap::new(),
                by_type: HashMap::new(),
                demanded: BTreeSet::new(),
                with_spare: BTreeSet::new(),
                streams: HashMap::new(),
                clients: HashMap::new(),
                links: HashMap::new(),
                held: HashMap::new(),
                finishing: HashMap::new(),
                disowned: HashMap::new(),
                deadlines: BTreeSet::new(),
                inflight_bytes: 0,
                full: false,
                dirty: HashSet::new(),
                capped: HashSet::new(),
                leaders: BTreeMap::new(),
                last_stream: 0,
                last_client: 0,
                last_conn: 0,
            }),
            wake: Notify::new(),
        })
    }

    /// Adds a client with `props` and `credit` (the default credit when `None`),
    /// creating (and registering with every link) the aggregated stream if it is the
    /// first. The client leaves when the returned stream is dropped.
    pub fn join(self: &Arc<Self>, props: ActivationProps, credit: Option<u32>) -> ClientStream {
        self.join_holding(props, credit, &[])
    }

    /// [`join`](Self::join) for a client that already holds jobs `held`, as (job key,
    /// activation deadline in epoch ms): jobs it was handed on an earlier stream
    /// (through this gateway or another), or polled. They count against its credit,
    /// as if pushed on this stream, until they finish through this gateway or their
    /// deadlines pass; otherwise the stream would be pushed jobs the worker has no
    /// room for. Jobs past their deadline, held here for another client that is
    /// still there or in a spare room, or beyond the credit, are not counted.
    pub fn join_holding(
        self: &Arc<Self>,
        props: ActivationProps,
        credit: Option<u32>,
        held: &[(JobKey, i64)],
    ) -> ClientStream {
        let mut st = self.lock();
        // A zero-capacity channel panics; one job is the least a client can take.
        let credit = credit.unwrap_or(st.limits.client_credit).max(1);
        let (tx, rx) = mpsc::channel(usize::try_from(credit).unwrap_or(usize::MAX));
        st.last_client += 1;
        let client_id = ClientId(st.last_client);
        let key = PropsKey(props);
        let stream_id = match st.by_props.get(&key) {
            Some(&id) => id,
            None => {
                st.last_stream += 1;
                let id = StreamId(st.last_stream);
                let register = register(id, &key.0);
                st.streams.insert(
                    id,
                    Aggregated {
                        gauges: CreditGauges::for_type(&key.0.job_type),
                        props: key.0.clone(),
                        members: 0,
                        ready: BTreeSet::new(),
                        last: ClientId(0),
                        free: 0,
                        rotate: 0,
                        spare: VecDeque::new(),
                        spared: 0,
                        spare_room: 0,
                        spare_paused: false,
                        wanted: BTreeMap::new(),
                        prefer: None,
                    },
                );
                st.by_type
                    .entry(key.0.job_type.clone())
                    .or_default()
                    .insert(id);
                st.by_props.insert(key, id);
                metrics::aggregated_streams(1);
                st.broadcast(&register, "register");
                id
            }
        };
        let spare = spare_share(credit, st.limits.spare_percent);
        if let Some(s) = st.streams.get_mut(&stream_id) {
            s.members += 1;
            s.spare_room = s.spare_room.saturating_add(spare);
            s.gauges.add(0, i64::from(credit));
        }
        st.clients.insert(
            client_id,
            Client {
                stream_id,
                tx,
                credit,
                held: 0,
                counted: 0,
            },
        );
        st.recount(client_id);
        let adopted = st.adopt(stream_id, client_id, held);
        if adopted > 0 {
            tracing::debug!(
                %stream_id,
                %client_id,
                adopted,
                declared = held.len(),
                "a joining client already holds jobs: counted against its credit"
            );
        }
        st.dirty.insert(stream_id);
        metrics::stream_clients(1);
        st.drain_spare(stream_id);
        self.wake_if_dirty(&st);
        ClientStream {
            streams: Arc::clone(self),
            stream_id,
            client_id,
            credit,
            rx,
        }
    }

    /// Hands a job pushed by broker `node` on its link connection `conn` to the
    /// next client of its stream with free credit, and says how it went, for the
    /// `PushAck`. `None`: the push carries no job, and is dropped.
    fn push(&self, node: NodeId, conn: u64, push: PushJob) -> Option<PushAck> {
        let Some(job) = push.job else {
            metrics::push_rejected(metrics::MALFORMED_PUSH);
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
            lease: Lease(push.lease),
        };
        let mut st = self.lock();
        let outcome = st.accept(node, conn, StreamId(push.stream_id), buffered);
        self.wake_if_dirty(&st);
        drop(st);
        let refused = match outcome {
            Ok(()) => {
                metrics::job_pushed();
                None
            }
            Err(reason) => {
                metrics::push_rejected(reason);
                Some(reason)
            }
        };
        Some(PushAck {
            push_id: push.push_id,
            accepted: refused.is_none(),
            reason: refused.unwrap_or_default().to_string(),
        })
    }

    /// A broker says activation `lease` of job `key` ended: its credit comes back.
    /// Unknown keys and other activations' leases are ignored, so this is idempotent.
    pub fn finished(&self, key: JobKey, lease: Lease) {
        let mut st = self.lock();
        if st.held.get(&key).is_some_and(|h| h.lease == Some(lease)) {
            st.release(key);
            self.wake_if_dirty(&st);
        }
    }

    /// Job `key` is being completed, failed or thrown through this gateway by a
    /// request that started at `since`: the client is done with it, so its credit
    /// comes back, unless it was handed off after `since` (a new activation). Until
    /// the returned guard is dropped (the request has its answer), a broker asking
    /// whether this gateway holds the job hears that it does.
    pub fn finished_here(self: &Arc<Self>, key: JobKey, since: Instant) -> Finishing {
        let mut st = self.lock();
        if st.held.get(&key).is_some_and(|h| h.since <= since) {
            st.release(key);
            self.wake_if_dirty(&st);
        }
        // Tracked whether the job was pushed or polled, and through whichever
        // gateway: a broker asks every gateway about the jobs a new leader's
        // predecessor pushed and about those handed out through a gateway that is
        // gone, and a worker may finish a job through any gateway.
        *st.finishing.entry(key).or_default() += 1;
        Finishing {
            streams: Arc::clone(self),
            key,
        }
    }

    /// Which of the activations a broker asks about this gateway holds: handed to
    /// a client (which may have left since: its worker may still finish the job) or
    /// waiting in a client's buffer, under the same lease; declared held by a client
    /// that joined (under any lease: see [`join_holding`](Self::join_holding)); or
    /// with a completion,
    /// failure or thrown error on its way through here. A job waiting in a stream's
    /// spare room is given up instead: the broker asking makes it runnable again,
    /// whereas a yield from here would go to the broker that pushed it, which may be
    /// gone. The others are refused if their push arrives after all (from a
    /// predecessor that was slow, not dead).
    pub fn held(&self, q: HeldQuery) -> HeldAnswer {
        let mut st = self.lock();
        let now = Instant::now();
        let mut held = Vec::new();
        for j in q.jobs {
            let key = JobKey(j.key);
            let (holds, spare) = match st.held.get(&key) {
                Some(h) if h.lease == Some(Lease(j.lease)) => (true, h.holder == Holder::Spare),
                // A worker that came back (its gateway restarted, say) runs it: the
                // activation asked about is the one it was handed, or the job would
                // not be activated through a gateway that is gone.
                Some(h) if h.lease.is_none() => (true, false),
                _ => (false, false),
            };
            if spare {
                // Dropped from the spare room when reached: its hold is over.
                st.release(key);
            }
            if (holds && !spare) || st.finishing.contains_key(&key) {
                held.push(j);
            } else {
                st.disowned.insert((key, Lease(j.lease)), now);
            }
        }
        self.wake_if_dirty(&st);
        HeldAnswer {
            query_id: q.query_id,
            held,
        }
    }

    /// Job `key`'s activation timeout was set to `timeout_ms` from now through this
    /// gateway by a request that started at `since`: its credit is held until then.
    pub fn timeout_updated(&self, key: JobKey, timeout_ms: i64, since: Instant) {
        let mut st = self.lock();
        let Some(h) = st.held.get_mut(&key).filter(|h| h.since <= since) else {
            return;
        };
        let old = std::mem::replace(&mut h.deadline, instant_in(timeout_ms));
        let new = h.deadline;
        st.deadlines.remove(&(old, key));
        st.deadlines.insert((new, key));
    }

    /// Broker `node` announced activatable jobs of `job_type` for `tenant`. Where a
    /// stream would take them, that broker had no credit to push them: the stream's
    /// free credit goes to the brokers with such jobs (see [`Aggregated::wanted`]).
    pub fn jobs_available(&self, node: NodeId, job_type: &str, tenant: &str) {
        let mut st = self.lock();
        let now = Instant::now();
        let mut wanting = Vec::new();
        let State {
            streams,
            links,
            by_type,
            demanded,
            ..
        } = &mut *st;
        for &id in by_type.get(job_type).into_iter().flatten() {
            let Some(s) = streams.get_mut(&id) else {
                continue;
            };
            if !s.props.tenant_ids.iter().any(|t| t == tenant) {
                continue;
            }
            demanded.insert(id);
            let new = s.wanted.insert(node, now).is_none();
            s.prefer = Some(node);
            // A broker that announces again re-splits the credit only when it has
            // none: then it goes to it first.
            if new || told_no_credit(links, node, id) {
                wanting.push(id);
            }
        }
        if !wanting.is_empty() {
            st.dirty.extend(wanting);
            self.wake_if_dirty(&st);
        }
    }

    /// Sets how many partitions each broker leads; a change re-splits every
    /// stream's credit.
    pub fn set_leaders(&self, led: BTreeMap<NodeId, u32>) {
        let mut st = self.lock();
        if st.leaders != led {
            st.leaders = led;
            st.mark_all_dirty();
            self.wake_if_dirty(&st);
        }
    }

    /// Aggregated streams right now.
    pub fn stream_count(&self) -> usize {
        self.lock().streams.len()
    }

    /// Per job type: aggregated streams and their clients right now.
    pub fn by_type(&self) -> BTreeMap<String, (usize, usize)> {
        let st = self.lock();
        let mut out: BTreeMap<String, (usize, usize)> = BTreeMap::new();
        for a in st.streams.values() {
            let e = out.entry(a.props.job_type.clone()).or_default();
            e.0 += 1;
            e.1 += a.members;
        }
        out
    }

    /// Clients of all streams right now.
    pub fn client_count(&self) -> usize {
        self.lock().clients.len()
    }

    /// Jobs and bytes held in flight right now.
    pub fn inflight(&self) -> (usize, usize) {
        let st = self.lock();
        (st.held.len(), st.inflight_bytes)
    }

    fn wake_if_dirty(&self, st: &State) {
        if !st.dirty.is_empty() {
            self.wake.notify_one();
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the state consistent, so a poisoned one is usable.
        lock(&self.state)
    }
}
