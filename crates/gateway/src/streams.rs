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

use crate::metrics::{self, CreditGauges};
use courier_proto::cluster::{
    gateway_message, GatewayMessage, HeldAnswer, HeldQuery, PushAck, PushJob, RegisterStream,
    StreamCredit, StreamProps, UnregisterStream, YieldJob,
};
use courier_proto::domain::{ActivationProps, NodeId};
use courier_proto::gateway_protocol as gw;
use futures::Stream;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::hash::{Hash, Hasher};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::{mpsc, watch, Notify};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

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

/// [`Held::client_id`] of a job in its stream's spare room (client ids start at 1).
const SPARE: u64 = 0;

/// [`Held::lease`] of a job a joining client declared it holds (leases start at 1;
/// the client does not know which activation it holds).
const DECLARED: u64 = 0;

/// A pushed job waiting in a client's buffer, with what a yield needs.
struct Buffered {
    /// Boxed: jobs are moved from buffer to buffer; the box keeps that cheap.
    job: Box<gw::ActivatedJob>,
    /// The broker that pushed it, for the logs (a yield goes to every broker).
    node: NodeId,
    partition: u32,
    lease: u64,
}

struct Client {
    /// Its capacity is the credit.
    tx: mpsc::Sender<Buffered>,
    credit: u32,
    /// Jobs handed to it and not finished, buffered or not.
    held: u32,
    /// Set when the last report of the stream was held down by this client's buffer
    /// (jobs released while still buffered): the client taking a job then makes the
    /// stream report again, or that credit would never be offered.
    starved: Arc<AtomicBool>,
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
struct Aggregated {
    props: ActivationProps,
    /// Client ids, in the order the rotation visits them.
    clients: Vec<u64>,
    /// Where the next search for the client with the most credit starts, so ties
    /// go round.
    next: usize,
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
    stream_id: u64,
    /// May name a client that left: the job still counts against the gateway.
    client_id: u64,
    lease: u64,
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
    streams: HashMap<u64, LinkStream>,
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
    by_props: HashMap<PropsKey, u64>,
    streams: HashMap<u64, Aggregated>,
    clients: HashMap<u64, Client>,
    links: HashMap<NodeId, LinkEntry>,
    /// Job key -> its hand-off, so finishing is O(1).
    held: HashMap<i64, Held>,
    /// Job key -> completions, failures and thrown errors for it on their way
    /// through this gateway now (see [`Finishing`]).
    finishing: HashMap<i64, u32>,
    /// (job key, lease) a leader was told this gateway does not hold, and when.
    disowned: HashMap<(i64, u64), Instant>,
    /// (deadline, job key) of every held job, earliest first.
    deadlines: BTreeSet<(Instant, i64)>,
    inflight_bytes: usize,
    /// A push was refused for the gateway's bounds and nothing was released since:
    /// reports say no room, so brokers do not keep pushing into a full gateway.
    full: bool,
    /// Streams whose reports must be recomputed.
    dirty: HashSet<u64>,
    /// Streams whose last report was cut down to the gateway's headroom: credit
    /// released anywhere changes theirs too.
    capped: HashSet<u64>,
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
        held: &[(i64, i64)],
    ) -> ClientStream {
        let mut st = self.lock();
        // A zero-capacity channel panics; one job is the least a client can take.
        let credit = credit.unwrap_or(st.limits.client_credit).max(1);
        let (tx, rx) = mpsc::channel(usize::try_from(credit).unwrap_or(usize::MAX));
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
                        gauges: CreditGauges::for_type(&key.0.job_type),
                        props: key.0.clone(),
                        clients: Vec::new(),
                        next: 0,
                        rotate: 0,
                        spare: VecDeque::new(),
                        spared: 0,
                        spare_room: 0,
                        spare_paused: false,
                        wanted: BTreeMap::new(),
                        prefer: None,
                    },
                );
                st.by_props.insert(key, id);
                metrics::aggregated_streams(1);
                st.broadcast(&register, "register");
                id
            }
        };
        let starved = Arc::new(AtomicBool::new(false));
        let spare = spare_share(credit, st.limits.spare_percent);
        if let Some(s) = st.streams.get_mut(&stream_id) {
            s.clients.push(client_id);
            s.spare_room = s.spare_room.saturating_add(spare);
            s.gauges.add(0, i64::from(credit));
        }
        st.clients.insert(
            client_id,
            Client {
                tx,
                credit,
                held: 0,
                starved: starved.clone(),
            },
        );
        let adopted = st.adopt(stream_id, client_id, held);
        if adopted > 0 {
            tracing::debug!(
                stream_id,
                client_id,
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
            starved,
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
            lease: push.lease,
        };
        let mut st = self.lock();
        let outcome = st.accept(node, conn, push.stream_id, buffered);
        self.wake_if_dirty(&st);
        drop(st);
        let reason = match outcome {
            Ok(()) => {
                metrics::job_pushed();
                ""
            }
            Err(reason) => {
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

    /// A broker says activation `lease` of job `key` ended: its credit comes back.
    /// Unknown keys and other activations' leases are ignored, so this is idempotent.
    pub fn finished(&self, key: i64, lease: u64) {
        let mut st = self.lock();
        if st.held.get(&key).is_some_and(|h| h.lease == lease) {
            st.release(key);
            self.wake_if_dirty(&st);
        }
    }

    /// Job `key` is being completed, failed or thrown through this gateway by a
    /// request that started at `since`: the client is done with it, so its credit
    /// comes back, unless it was handed off after `since` (a new activation). Until
    /// the returned guard is dropped (the request has its answer), a broker asking
    /// whether this gateway holds the job hears that it does.
    pub fn finished_here(self: &Arc<Self>, key: i64, since: Instant) -> Finishing {
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
            let (holds, spare) = match st.held.get(&j.key) {
                Some(h) if h.lease == j.lease => (true, h.client_id == SPARE),
                // A worker that came back (its gateway restarted, say) runs it: the
                // activation asked about is the one it was handed, or the job would
                // not be activated through a gateway that is gone.
                Some(h) if h.lease == DECLARED => (true, false),
                _ => (false, false),
            };
            if spare {
                // Dropped from the spare room when reached: its hold is over.
                st.release(j.key);
            }
            if (holds && !spare) || st.finishing.contains_key(&j.key) {
                held.push(j);
            } else {
                st.disowned.insert((j.key, j.lease), now);
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
    pub fn timeout_updated(&self, key: i64, timeout_ms: i64, since: Instant) {
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
        let State { streams, links, .. } = &mut *st;
        for (&id, s) in streams.iter_mut() {
            if s.props.job_type != job_type || !s.props.tenant_ids.iter().any(|t| t == tenant) {
                continue;
            }
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

    /// Sends the credit reports of dirty streams (paced to one flush per
    /// [`FLUSH_GAP`]), follows `leaders` (partitions led per broker), and releases
    /// the credit of jobs whose deadline passed, until `shutdown`.
    pub async fn run(
        self: Arc<Self>,
        mut leaders: watch::Receiver<BTreeMap<NodeId, u32>>,
        shutdown: CancellationToken,
    ) {
        self.set_leaders(leaders.borrow_and_update().clone());
        let mut leaders_open = true;
        let mut sweep = tokio::time::interval(SWEEP_EVERY);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_flush: Option<Instant> = None;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = self.wake.notified() => {
                    // Whatever is marked until the gap has passed goes in this flush.
                    if let Some(last) = last_flush {
                        tokio::select! {
                            _ = shutdown.cancelled() => return,
                            _ = tokio::time::sleep_until(last + FLUSH_GAP) => {}
                        }
                    }
                    self.flush();
                    last_flush = Some(Instant::now());
                }
                changed = leaders.changed(), if leaders_open => match changed {
                    Ok(()) => self.set_leaders(leaders.borrow_and_update().clone()),
                    // The topology is gone (shutting down): keep the last split.
                    Err(_) => leaders_open = false,
                },
                _ = sweep.tick() => self.sweep(Instant::now()),
            }
        }
    }

    /// Sends every dirty stream's changed reports.
    fn flush(&self) {
        let mut st = self.lock();
        let dirty: Vec<u64> = st.dirty.drain().collect();
        st.report(&dirty);
    }

    /// Releases the credit of every job whose deadline is at or before `now`.
    fn sweep(&self, now: Instant) {
        let mut st = self.lock();
        if !st.disowned.is_empty() {
            st.disowned
                .retain(|_, at| now.saturating_duration_since(*at) < DISOWNED_MEMORY);
        }
        let mut released = 0usize;
        while let Some(&(deadline, key)) = st.deadlines.first() {
            if deadline > now {
                break;
            }
            st.release(key);
            released += 1;
        }
        if released > 0 {
            tracing::debug!(released, "credit of jobs past their deadline released");
        }
        st.age_demand(now);
        st.yield_waited_spare(now);
        self.wake_if_dirty(&st);
    }

    /// Attaches the outbound side of a link to broker `node`: the returned queue
    /// starts with `hello`, a `RegisterStream` and a `StreamCredit` for every current
    /// stream, then gets every registration and credit change, until the returned
    /// guard is dropped.
    pub fn attach_link(
        self: &Arc<Self>,
        node: NodeId,
        hello: GatewayMessage,
    ) -> (AttachedLink, mpsc::Receiver<GatewayMessage>) {
        let mut st = self.lock();
        let (tx, rx) = mpsc::channel(OUTBOUND_BUFFER + 2 * st.streams.len() + 1);
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
            streams: HashMap::new(),
        };
        if let Some(old) = st.links.insert(node, entry) {
            // One link task per broker makes this impossible; if it happened, the
            // old connection's registrations would no longer be kept in step.
            old.broken.cancel();
        }
        // A broker gives a stream no jobs before it hears its credit: report every
        // stream now, behind the registrations. The new link changes the split, so
        // the other links hear their new shares too.
        st.mark_all_dirty();
        let all: Vec<u64> = st.dirty.drain().collect();
        st.report(&all);
        self.wake_if_dirty(&st);
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
        self.lock().clients.len()
    }

    /// Jobs and bytes held in flight right now.
    pub fn inflight(&self) -> (usize, usize) {
        let st = self.lock();
        (st.held.len(), st.inflight_bytes)
    }

    /// Removes a client; its buffered jobs go to the stream's other clients or back to
    /// the brokers that pushed them. Jobs it was already given stay counted against
    /// the gateway until they finish, since its worker may still be running them.
    fn leave(&self, stream_id: u64, client_id: u64, rx: &mut mpsc::Receiver<Buffered>) {
        let mut st = self.lock();
        let Some(client) = st.clients.remove(&client_id) else {
            return;
        };
        let spare_percent = st.limits.spare_percent;
        let Some(stream) = st.streams.get_mut(&stream_id) else {
            return;
        };
        stream.gauges.add(
            -i64::from(client.held),
            -i64::from(client.credit.saturating_sub(client.held)),
        );
        stream.spare_room = stream
            .spare_room
            .saturating_sub(spare_share(client.credit, spare_percent));
        if let Some(pos) = stream.clients.iter().position(|&c| c == client_id) {
            stream.clients.remove(pos);
            // The rotation goes on with the client that followed the one removed.
            if pos < stream.next {
                stream.next -= 1;
            }
        }
        if stream.next >= stream.clients.len() {
            stream.next = 0;
        }
        let left = stream.clients.len();
        metrics::stream_clients(-1);
        // Dropping its sender (the only one) means the buffer below is all there is.
        drop(client);
        rx.close();
        let (mut moved, mut yielded, mut stale) = (0usize, 0usize, 0usize);
        while let Ok(b) = rx.try_recv() {
            let key = b.job.key;
            // A job whose credit came back while buffered has finished or timed out:
            // nobody should run it.
            if !st.holds(key, client_id, b.lease) {
                stale += 1;
                continue;
            }
            match st.offer(stream_id, b) {
                Ok(to) => {
                    if let Some(h) = st.held.get_mut(&key) {
                        h.client_id = to;
                    }
                    moved += 1;
                }
                Err((b, reason)) => {
                    if st.keep_spare(stream_id, key, b, reason) {
                        moved += 1;
                    } else {
                        yielded += 1;
                    }
                }
            }
        }
        if left == 0 {
            // Nobody is left to take the spare jobs: back to their brokers.
            let spare = st
                .streams
                .get_mut(&stream_id)
                .map(|s| std::mem::take(&mut s.spare))
                .unwrap_or_default();
            for b in spare {
                let key = b.job.key;
                if st.holds(key, SPARE, b.lease) {
                    yielded += 1;
                    st.release(key);
                    st.yield_job(b, NO_CLIENT);
                }
            }
        }
        metrics::stale_jobs_dropped(stale);
        tracing::debug!(
            stream_id,
            client_id,
            clients_left = left,
            moved,
            yielded,
            stale,
            "stream client left"
        );
        if left == 0 {
            if let Some(s) = st.streams.remove(&stream_id) {
                if !st
                    .streams
                    .values()
                    .any(|o| o.props.job_type == s.props.job_type)
                {
                    CreditGauges::forget(&s.props.job_type);
                }
                st.by_props.remove(&PropsKey(s.props));
            }
            st.dirty.remove(&stream_id);
            st.capped.remove(&stream_id);
            for link in st.links.values_mut() {
                link.streams.remove(&stream_id);
            }
            metrics::aggregated_streams(-1);
            let unregister = GatewayMessage {
                kind: Some(gateway_message::Kind::Unregister(UnregisterStream {
                    stream_id,
                })),
            };
            st.broadcast(&unregister, "unregister");
        } else {
            st.dirty.insert(stream_id);
        }
        self.wake_if_dirty(&st);
    }

    /// Client `client_id` took job `b` from its buffer. True when the job is still
    /// its to run; false when the activation it came with ended while it waited there
    /// (it timed out, finished elsewhere, or was pushed again): its credit already came
    /// back, and running it would run it twice or after its end. `starved`: the
    /// stream's last report was held down by this client's buffer, so it reports again.
    fn take(&self, stream_id: u64, client_id: u64, b: &Buffered, starved: bool) -> bool {
        let mut st = self.lock();
        let key = b.job.key;
        let current = st.holds(key, client_id, b.lease);
        if !current {
            metrics::stale_jobs_dropped(1);
            tracing::debug!(
                job = key,
                client_id,
                "activation ended while buffered; dropped"
            );
        }
        if starved && st.streams.contains_key(&stream_id) {
            st.dirty.insert(stream_id);
            st.drain_spare(stream_id);
            self.wake_if_dirty(&st);
        }
        current
    }

    fn detach_link(&self, node: NodeId, conn: u64) {
        let mut st = self.lock();
        if st.links.get(&node).is_some_and(|l| l.conn == conn) {
            st.links.remove(&node);
            // The remaining links' shares grow.
            st.mark_all_dirty();
            self.wake_if_dirty(&st);
        }
    }

    fn wake_if_dirty(&self, st: &State) {
        if !st.dirty.is_empty() {
            self.wake.notify_one();
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the state consistent, so a poisoned one is usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The free credit of stream `s`: its clients' and its spare room's.
fn free_of(clients: &HashMap<u64, Client>, s: &Aggregated) -> u64 {
    let of_clients: u64 = s
        .clients
        .iter()
        .filter_map(|c| clients.get(c))
        .map(|c| u64::from(c.free()))
        .sum();
    of_clients + spare_offered(s)
}

/// The spare room a stream offers as credit.
fn spare_offered(s: &Aggregated) -> u64 {
    if s.spare_paused {
        0
    } else {
        u64::from(s.spare_room.saturating_sub(s.spared))
    }
}

impl State {
    /// Ages the brokers' demand for each stream's credit: while a stream has no
    /// free credit no broker can push, so its demand is kept as it is, and so is
    /// that of a broker told of none (its jobs wait for credit the split gives
    /// others); otherwise a broker that has neither announced nor pushed jobs of
    /// the stream for [`DEMAND_WINDOW`] has none left, and the stream is re-split
    /// without it.
    fn age_demand(&mut self, now: Instant) {
        let State {
            streams,
            clients,
            dirty,
            links,
            ..
        } = self;
        for (&id, s) in streams.iter_mut() {
            if s.wanted.is_empty() {
                continue;
            }
            if free_of(clients, s) == 0 {
                s.wanted.values_mut().for_each(|at| *at = now);
                continue;
            }
            for (&node, at) in s.wanted.iter_mut() {
                if told_no_credit(links, node, id) {
                    *at = now;
                }
            }
            let before = s.wanted.len();
            s.wanted
                .retain(|_, at| now.saturating_duration_since(*at) < DEMAND_WINDOW);
            if s.wanted.len() != before {
                dirty.insert(id);
            }
            if s.prefer.is_some_and(|n| !s.wanted.contains_key(&n)) {
                s.prefer = None;
            }
        }
    }

    /// Gives back the spare jobs of every stream whose oldest spare job has waited
    /// [`SPARE_WAIT`] for a client with room, and pauses its spare room.
    fn yield_waited_spare(&mut self, now: Instant) {
        let waited: Vec<u64> = self
            .streams
            .iter()
            .filter(|(_, s)| {
                s.spare.iter().find_map(|b| {
                    self.held
                        .get(&b.job.key)
                        .filter(|h| h.client_id == SPARE && h.lease == b.lease)
                        .map(|h| now.saturating_duration_since(h.since) >= SPARE_WAIT)
                }) == Some(true)
            })
            .map(|(&id, _)| id)
            .collect();
        for id in waited {
            let jobs: Vec<Buffered> = match self.streams.get_mut(&id) {
                Some(s) => {
                    s.spare_paused = true;
                    s.spare.drain(..).collect()
                }
                None => continue,
            };
            for b in jobs {
                if self.holds(b.job.key, SPARE, b.lease) {
                    self.release(b.job.key);
                    self.yield_job(b, SPARE_WAITED);
                }
            }
            self.dirty.insert(id);
        }
    }

    /// Takes a pushed job: counts it as received on its link, checks the gateway's
    /// bounds, hands it to a client and holds its credit.
    fn accept(
        &mut self,
        node: NodeId,
        conn: u64,
        stream_id: u64,
        b: Buffered,
    ) -> Result<(), &'static str> {
        if !self.streams.contains_key(&stream_id) {
            return Err(UNKNOWN_STREAM);
        }
        if let Some(link) = self.links.get_mut(&node).filter(|l| l.conn == conn) {
            let seen = link.streams.entry(stream_id).or_default();
            seen.received += 1;
            if seen
                .owed
                .is_some_and(|credit| worth_reporting(seen, credit, false))
            {
                self.dirty.insert(stream_id);
            }
        }
        // A broker pushing for a stream it wanted credit for still has jobs for it.
        if let Some(s) = self.streams.get_mut(&stream_id) {
            if let Some(at) = s.wanted.get_mut(&node) {
                *at = Instant::now();
            }
            if s.prefer == Some(node) {
                s.prefer = None;
            }
        }
        let key = b.job.key;
        if self.disowned.contains_key(&(key, b.lease)) {
            return Err(DISOWNED);
        }
        // The broker activated the job again: the activation held is over.
        self.release(key);
        let bytes = b.job.variables.len() + b.job.custom_headers.len();
        if self.held.len() >= self.limits.max_inflight_jobs
            || self.inflight_bytes + bytes > self.limits.max_inflight_bytes
        {
            if !std::mem::replace(&mut self.full, true) {
                // Every broker should hear at once that there is no room.
                self.mark_all_dirty();
            }
            self.dirty.insert(stream_id);
            return Err(GATEWAY_FULL);
        }
        let (lease, deadline_ms) = (b.lease, b.job.deadline);
        let client_id = match self.offer(stream_id, b) {
            Ok(client_id) => client_id,
            Err((b, reason)) => {
                // No client has credit: the spare room takes it, if there is room.
                if reason == CLIENTS_FULL && self.put_spare(stream_id, b).is_ok() {
                    SPARE
                } else {
                    // The broker thought there was credit: correct its view.
                    self.dirty.insert(stream_id);
                    return Err(reason);
                }
            }
        };
        let timeout_ms = self
            .streams
            .get(&stream_id)
            .map_or(0, |s| s.props.timeout_ms);
        let deadline = deadline_instant(deadline_ms, timeout_ms);
        self.held.insert(
            key,
            Held {
                stream_id,
                client_id,
                lease,
                deadline,
                bytes,
                since: Instant::now(),
            },
        );
        self.deadlines.insert((deadline, key));
        self.inflight_bytes += bytes;
        metrics::inflight(1, i64::try_from(bytes).unwrap_or(i64::MAX));
        Ok(())
    }

    /// Counts jobs a joining client already holds against its credit (see
    /// [`AggregatedStreams::join_holding`]); returns how many.
    fn adopt(&mut self, stream_id: u64, client_id: u64, jobs: &[(i64, i64)]) -> u32 {
        let now = Instant::now();
        let timeout_ms = self
            .streams
            .get(&stream_id)
            .map_or(0, |s| s.props.timeout_ms);
        let mut adopted = 0;
        for &(key, deadline_ms) in jobs {
            let Some(client) = self.clients.get(&client_id) else {
                break;
            };
            if client.held >= client.credit {
                break;
            }
            let deadline = deadline_instant(deadline_ms, timeout_ms);
            // Read after the deadline: one already past is never in the future.
            if deadline <= Instant::now() {
                continue;
            }
            match self.held.get_mut(&key) {
                // Handed to a client that has left: its worker is back.
                Some(h) if h.client_id != SPARE && !self.clients.contains_key(&h.client_id) => {
                    // Its old stream's gauges let it go with the client that left.
                    h.stream_id = stream_id;
                    h.client_id = client_id;
                }
                // Another client's, or waiting in a spare room: not this worker's.
                Some(_) => continue,
                None => {
                    if self.held.len() >= self.limits.max_inflight_jobs {
                        break;
                    }
                    self.held.insert(
                        key,
                        Held {
                            stream_id,
                            client_id,
                            // No activation lease known: a broker's notice that
                            // an activation ended does not name this one, a
                            // finish through here or the deadline ends it.
                            lease: DECLARED,
                            deadline,
                            bytes: 0,
                            since: now,
                        },
                    );
                    self.deadlines.insert((deadline, key));
                    metrics::inflight(1, 0);
                }
            }
            if let Some(c) = self.clients.get_mut(&client_id) {
                c.held += 1;
            }
            if let Some(s) = self.streams.get(&stream_id) {
                s.gauges.add(1, -1);
            }
            adopted += 1;
        }
        adopted
    }

    /// Whether job `key`'s activation `lease` is held for client `client_id` (or in its
    /// stream's spare room: [`SPARE`]). False once that activation ended here.
    fn holds(&self, key: i64, client_id: u64, lease: u64) -> bool {
        self.held
            .get(&key)
            .is_some_and(|h| h.client_id == client_id && h.lease == lease)
    }

    /// Moves a held job that no client can take now into its stream's spare room; when
    /// there is no room (or no client), releases it and yields it to its broker.
    /// True when kept.
    fn keep_spare(&mut self, stream_id: u64, key: i64, b: Buffered, reason: &'static str) -> bool {
        match self.put_spare(stream_id, b) {
            Ok(()) => {
                if let Some(h) = self.held.get_mut(&key) {
                    h.client_id = SPARE;
                }
                true
            }
            Err(b) => {
                self.release(key);
                self.yield_job(b, reason);
                false
            }
        }
    }

    /// Puts a job in its stream's spare room when the stream has clients and room;
    /// gives it back otherwise.
    fn put_spare(&mut self, stream_id: u64, b: Buffered) -> Result<(), Buffered> {
        match self
            .streams
            .get_mut(&stream_id)
            .filter(|s| !s.clients.is_empty() && !s.spare_paused && s.spare_fits())
        {
            Some(s) => {
                s.spare.push_back(b);
                s.spared += 1;
                metrics::spare_jobs(1);
                Ok(())
            }
            None => Err(b),
        }
    }

    /// Hands the stream's spare jobs, oldest first, to clients with free credit.
    fn drain_spare(&mut self, stream_id: u64) {
        loop {
            let Some(b) = self
                .streams
                .get_mut(&stream_id)
                .and_then(|s| s.spare.pop_front())
            else {
                return;
            };
            let (key, lease) = (b.job.key, b.lease);
            if !self.holds(key, SPARE, lease) {
                // Its hold ended while it waited: nobody should run it.
                metrics::stale_jobs_dropped(1);
                continue;
            }
            let timeout_ms = self
                .streams
                .get(&stream_id)
                .map_or(0, |s| s.props.timeout_ms);
            let left = self.held.get(&key).map_or(Duration::ZERO, |h| {
                h.deadline.saturating_duration_since(Instant::now())
            });
            if left.as_millis() < u128::try_from(timeout_ms / 2).unwrap_or(0) {
                // Back to its broker, which activates it afresh for the next room.
                self.release(key);
                self.yield_job(b, SPARE_STALE);
                continue;
            }
            match self.offer(stream_id, b) {
                Ok(to) => {
                    if let Some(h) = self.held.get_mut(&key) {
                        h.client_id = to;
                    }
                    if let Some(s) = self.streams.get_mut(&stream_id) {
                        s.spared = s.spared.saturating_sub(1);
                    }
                    metrics::spare_jobs(-1);
                    self.dirty.insert(stream_id);
                }
                Err((b, _)) => {
                    if let Some(s) = self.streams.get_mut(&stream_id) {
                        s.spare.push_front(b);
                    }
                    return;
                }
            }
        }
    }

    /// Hands a job to the stream's next client (round-robin) with free credit, and
    /// counts it against that client; says which client took it.
    fn offer(&mut self, stream_id: u64, job: Buffered) -> Result<u64, (Buffered, &'static str)> {
        let Some(stream) = self.streams.get_mut(&stream_id) else {
            return Err((job, UNKNOWN_STREAM));
        };
        let n = stream.clients.len();
        if n == 0 {
            return Err((job, NO_CLIENT));
        }
        // Round-robin over the clients that have credit: each client in turn, one
        // that cannot take a job is skipped (issue: round-robin, never random).
        let Some(at) = (0..n).map(|i| (stream.next + i) % n).find(|&at| {
            self.clients
                .get(&stream.clients[at])
                .is_some_and(|c| c.free() > 0)
        }) else {
            return Err((job, CLIENTS_FULL));
        };
        if at != stream.next {
            metrics::push_try_next();
        }
        let client_id = stream.clients[at];
        let Some(client) = self.clients.get_mut(&client_id) else {
            return Err((job, CLIENTS_FULL));
        };
        // Cannot fail: the client had room in its buffer (checked under this lock,
        // and only we send), and its receiver lives while it is listed.
        if let Err(e) = client.tx.try_send(job) {
            tracing::warn!(client_id, "a client with credit could not take a job");
            metrics::push_try_next();
            return Err((e.into_inner(), CLIENTS_FULL));
        }
        client.held += 1;
        stream.next = (at + 1) % n;
        stream.gauges.add(1, -1);
        Ok(client_id)
    }

    /// Ends the hold on job `key`, if any: its client (if still there) and the gateway
    /// get the credit back.
    fn release(&mut self, key: i64) {
        let Some(h) = self.held.remove(&key) else {
            return;
        };
        self.deadlines.remove(&(h.deadline, key));
        self.inflight_bytes -= h.bytes;
        metrics::inflight(-1, -i64::try_from(h.bytes).unwrap_or(i64::MAX));
        self.full = false;
        if h.client_id == SPARE {
            if let Some(s) = self.streams.get_mut(&h.stream_id) {
                s.spared = s.spared.saturating_sub(1);
            }
            metrics::spare_jobs(-1);
            self.dirty.insert(h.stream_id);
        } else if let Some(c) = self.clients.get_mut(&h.client_id) {
            c.held = c.held.saturating_sub(1);
            if let Some(s) = self.streams.get(&h.stream_id) {
                s.gauges.add(-1, 1);
            }
            self.dirty.insert(h.stream_id);
            self.drain_spare(h.stream_id);
        }
        // Their reports were bounded by the gateway's headroom, which just grew.
        self.dirty.extend(self.capped.iter().copied());
    }

    fn mark_all_dirty(&mut self) {
        self.dirty.extend(self.streams.keys().copied());
    }

    /// Recomputes the credit reports of `ids` and sends each link those that changed.
    fn report(&mut self, ids: &[u64]) {
        let mut nodes: Vec<NodeId> = self.links.keys().copied().collect();
        if nodes.is_empty() {
            return;
        }
        nodes.sort_unstable();
        let weights: Vec<u32> = nodes
            .iter()
            .map(|n| self.leaders.get(n).copied().unwrap_or(0))
            .collect();
        let headroom = if self.full {
            0
        } else {
            self.limits
                .max_inflight_jobs
                .saturating_sub(self.held.len())
        };
        let headroom = u64::try_from(headroom).unwrap_or(u64::MAX);
        let mut failed: Vec<NodeId> = Vec::new();
        for &id in ids {
            let Some(stream) = self.streams.get_mut(&id) else {
                continue;
            };
            let mut sum = 0u64;
            for c in stream.clients.iter().filter_map(|c| self.clients.get(c)) {
                let free = c.free();
                if free < c.credit.saturating_sub(c.held) {
                    c.starved.store(true, Ordering::Relaxed);
                }
                sum += u64::from(free);
            }
            if sum > 0 {
                // A client has room again: so may the spare.
                stream.spare_paused = false;
            }
            sum += spare_offered(stream);
            if sum > headroom {
                self.capped.insert(id);
            } else {
                self.capped.remove(&id);
            }
            let free = u32::try_from(sum.min(headroom)).unwrap_or(u32::MAX);
            // Brokers with jobs they had no credit for take it all, in proportion to
            // the partitions they lead.
            let wanted: Option<Vec<u32>> = (!stream.wanted.is_empty()).then(|| {
                nodes
                    .iter()
                    .map(|n| {
                        if stream.wanted.contains_key(n) {
                            self.leaders.get(n).copied().unwrap_or(0).max(1)
                        } else {
                            0
                        }
                    })
                    .collect()
            });
            let weights = wanted.as_deref().unwrap_or(&weights);
            let rotate = stream
                .prefer
                .and_then(|n| first_place(&nodes, weights, n))
                .unwrap_or(stream.rotate);
            let shares = split(free, weights, rotate);
            stream.rotate = rotate.wrapping_add(1);
            for (node, share) in nodes.iter().zip(shares) {
                let Some(link) = self.links.get_mut(node) else {
                    continue;
                };
                let seen = link.streams.entry(id).or_default();
                let report = (share, seen.received);
                let credit = u64::from(share) + seen.received;
                if !worth_reporting(seen, credit, stream.wanted.contains_key(node)) {
                    seen.owed = seen
                        .reported
                        .filter(|&(s, r)| credit != u64::from(s) + r)
                        .map(|_| credit);
                    continue;
                }
                let msg = GatewayMessage {
                    kind: Some(gateway_message::Kind::Credit(StreamCredit {
                        stream_id: id,
                        free: share,
                        received: seen.received,
                    })),
                };
                if link.tx.try_send(msg).is_ok() {
                    seen.reported = Some(report);
                    seen.owed = None;
                    metrics::credit_report_sent();
                } else if !failed.contains(node) {
                    failed.push(*node);
                }
            }
        }
        for node in failed {
            self.break_link(node, "credit");
        }
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
        // To every broker, not only the one that pushed it: leadership may have
        // moved since (that broker may be gone), and only the partition's leader
        // acts on it. The lease makes a yield for a stale activation a no-op.
        if self.links.is_empty() {
            // Its activation deadline makes it runnable again.
            tracing::warn!(job_key = b.job.key, "cannot yield a job: no broker linked");
            metrics::link_message_dropped("yield");
            return;
        }
        self.broadcast(&msg, "yield");
        metrics::job_yielded(reason);
        tracing::debug!(node = b.node, job_key = b.job.key, reason, "job yielded");
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
            // The remaining links' shares grow.
            self.mark_all_dirty();
        }
    }
}

/// Whether a link should be told the stream's credit now: `credit` is its share of
/// the free credit plus the pushes received from it, the only sum the broker's view
/// depends on (it may push `share + received - sent` more; see the module doc), so
/// pushes alone change nothing. A view that shrank is corrected at once: the broker
/// must not push on credit that is gone. One that grew is corrected, as HTTP/2 sends
/// window updates, once the broker's view has fallen to half of its share or below (or
/// at once when the broker has jobs waiting for credit: `wanted`); until then it has
/// credit enough to push on, and a report per finished job would double the
/// messages of a pushed job on the link.
fn worth_reporting(seen: &LinkStream, credit: u64, wanted: bool) -> bool {
    let Some((old_share, old_received)) = seen.reported else {
        return true;
    };
    let told = u64::from(old_share) + old_received;
    if credit == told {
        return false;
    }
    if credit < told || wanted {
        return true;
    }
    // What it may push, against what the broker believes.
    let share = credit.saturating_sub(seen.received);
    believed(seen).saturating_mul(2) <= share
}

/// What the broker at the other end of a link believes it may still push for the
/// stream, had every push it sent arrived.
fn believed(seen: &LinkStream) -> u64 {
    seen.reported
        .map_or(0, |(share, received)| u64::from(share) + received)
        .saturating_sub(seen.received)
}

/// Whether broker `node`, linked, believes it may push nothing more for stream `id`.
fn told_no_credit(links: &HashMap<NodeId, LinkEntry>, node: NodeId, id: u64) -> bool {
    links
        .get(&node)
        .is_some_and(|l| l.streams.get(&id).is_none_or(|seen| believed(seen) == 0))
}

/// The rotation with which [`split`] gives `node` the first unit of the remainder,
/// if it gets any at all.
fn first_place(nodes: &[NodeId], weights: &[u32], node: NodeId) -> Option<usize> {
    let all = weights.iter().all(|&w| w == 0);
    nodes
        .iter()
        .zip(weights)
        .filter(|(_, &w)| all || w > 0)
        .position(|(&n, _)| n == node)
}

/// Splits `free` between links in proportion to `weights` (the partitions each
/// leads); when all are zero (no leader known, or none among the linked brokers),
/// equally. The remainder of the
/// division goes one by one to links with weight, from `rotate` on, so none of it
/// is lost and it does not always go to the same link: with little credit and many
/// brokers, that link would be the only one ever pushing.
fn split(free: u32, weights: &[u32], rotate: usize) -> Vec<u32> {
    let weights: Vec<u64> = if weights.iter().all(|&w| w == 0) {
        vec![1; weights.len()]
    } else {
        weights.iter().map(|&w| u64::from(w)).collect()
    };
    let total: u64 = weights.iter().sum();
    if total == 0 {
        return Vec::new();
    }
    let mut shares: Vec<u32> = weights
        .iter()
        .map(|&w| u32::try_from(u64::from(free) * w / total).unwrap_or(0))
        .collect();
    let given: u32 = shares.iter().sum();
    let eligible: Vec<usize> = (0..weights.len()).filter(|&i| weights[i] > 0).collect();
    for k in 0..free.saturating_sub(given) {
        let i = eligible[rotate.wrapping_add(k as usize) % eligible.len()];
        shares[i] += 1;
    }
    shares
}

/// A client's share of its stream's spare room: `percent` of its credit, rounded up.
fn spare_share(credit: u32, percent: u32) -> u32 {
    u32::try_from((u64::from(credit) * u64::from(percent)).div_ceil(100)).unwrap_or(u32::MAX)
}

/// The gateway-clock instant of an activation deadline (epoch ms); a push without
/// one holds its credit for the stream's activation timeout.
fn deadline_instant(deadline_ms: i64, timeout_ms: i64) -> Instant {
    if deadline_ms <= 0 {
        return instant_in(timeout_ms);
    }
    instant_in(deadline_ms.saturating_sub(courier_proto::domain::epoch_ms()))
}

/// `ms` from now; now if negative.
fn instant_in(ms: i64) -> Instant {
    let d = Duration::from_millis(u64::try_from(ms).unwrap_or(0)).min(MAX_HOLD);
    Instant::now() + d
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

    /// Hands a job this link's broker pushed to a client (see
    /// [`AggregatedStreams`]) and says how it went, for the `PushAck`. `None`: the
    /// push carries no job, and is dropped.
    pub fn push(&self, push: PushJob) -> Option<PushAck> {
        self.streams.push(self.node, self.conn, push)
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

/// A completion, failure or thrown error on its way through this gateway: while it
/// lives, the job counts as held here for a broker that asks (a new leader must not
/// make it activatable while the command that ends it is being retried towards it).
#[must_use = "the job counts as finishing here only while this lives"]
pub struct Finishing {
    streams: Arc<AggregatedStreams>,
    key: i64,
}

impl Drop for Finishing {
    fn drop(&mut self) {
        let mut st = self.streams.lock();
        if let Some(n) = st.finishing.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                st.finishing.remove(&self.key);
            }
        }
    }
}

/// One client's jobs. Dropping it (tonic drops a response stream whose client went
/// away) removes the client at once.
pub struct ClientStream {
    streams: Arc<AggregatedStreams>,
    stream_id: u64,
    client_id: u64,
    credit: u32,
    rx: mpsc::Receiver<Buffered>,
    starved: Arc<AtomicBool>,
}

impl ClientStream {
    /// The aggregated stream this client belongs to.
    pub fn stream_id(&self) -> u64 {
        self.stream_id
    }

    /// How many pushed jobs this client may hold unfinished.
    pub fn credit(&self) -> u32 {
        self.credit
    }
}

impl Stream for ClientStream {
    type Item = gw::ActivatedJob;

    /// Never ends on its own: the client's sender lives until the client leaves.
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            let b = match self.rx.poll_recv(cx) {
                Poll::Ready(Some(b)) => b,
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => return Poll::Pending,
            };
            let starved = self.starved.swap(false, Ordering::Relaxed);
            if self
                .streams
                .take(self.stream_id, self.client_id, &b, starved)
            {
                return Poll::Ready(Some(*b.job));
            }
        }
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

    fn limits(client_credit: u32) -> Limits {
        Limits {
            client_credit,
            max_inflight_jobs: 100_000,
            max_inflight_bytes: 256 << 20,
            spare_percent: 0,
        }
    }

    fn registry(client_credit: u32) -> Arc<AggregatedStreams> {
        AggregatedStreams::new(limits(client_credit))
    }

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

    /// Like [`t`], with a 10-minute activation timeout: sweeps in the tests' future
    /// release no job's credit.
    fn long_t() -> ActivationProps {
        let r = gw::StreamActivatedJobsRequest {
            r#type: "t".into(),
            worker: "w".into(),
            timeout: 600_000,
            ..Default::default()
        };
        courier_proto::convert::stream_request(&r).unwrap()
    }

    /// A push of job `key`, activation lease `key + 500`, without a deadline (held
    /// for the stream's 1 s timeout).
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

    fn lease(key: i64) -> u64 {
        key as u64 + 500
    }

    use courier_proto::domain::epoch_ms;

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

    /// The credit reports queued on a link so far: (stream, free, received); any
    /// other message fails the test.
    fn reports(rx: &mut mpsc::Receiver<GatewayMessage>) -> Vec<(u64, u32, u64)> {
        drain(rx)
            .into_iter()
            .map(|k| match k {
                Kind::Credit(c) => (c.stream_id, c.free, c.received),
                other => panic!("not a credit report: {other:?}"),
            })
            .collect()
    }

    /// Keys of the jobs yielded on a link so far; other messages are skipped.
    fn yielded_keys(rx: &mut mpsc::Receiver<GatewayMessage>) -> Vec<i64> {
        drain(rx)
            .into_iter()
            .filter_map(|k| match k {
                Kind::YieldJob(y) => Some(y.key),
                _ => None,
            })
            .collect()
    }

    /// Keys of every job buffered for a client so far.
    fn keys(c: &mut ClientStream) -> Vec<i64> {
        std::iter::from_fn(|| c.next().now_or_never().flatten())
            .map(|j| j.key)
            .collect()
    }

    fn ack(l: &AttachedLink, p: PushJob) -> (bool, String) {
        let a = l.push(p).unwrap();
        (a.accepted, a.reason)
    }

    fn ok() -> (bool, String) {
        (true, String::new())
    }

    fn refused(reason: &str) -> (bool, String) {
        (false, reason.to_string())
    }

    #[test]
    fn equal_props_share_a_stream_and_different_ones_do_not() {
        let s = registry(32);
        let a = s.join(props("t", &["x", "y"], &["b", "a"]), None);
        let b = s.join(props("t", &["y", "x", "y"], &["a", "b"]), None);
        assert_eq!(a.stream_id(), b.stream_id());
        let others = [
            props("u", &["x", "y"], &["a", "b"]),
            props("t", &["x"], &["a", "b"]),
            props("t", &["x", "y"], &["a"]),
            props("t", &["x", "y"], &[DEFAULT_TENANT]),
        ];
        let mut ids = vec![a.stream_id()];
        let clients: Vec<ClientStream> = others.into_iter().map(|p| s.join(p, None)).collect();
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
        let c = s.join(t(), None);
        let d = s.join(props("t", &["x", "y"], &["a", "b"]), None);
        assert!(d.stream_id() > c.stream_id());
    }

    #[test]
    fn streams_are_registered_with_every_link_on_first_join_and_unregistered_on_last_leave() {
        let s = registry(32);
        let (_l1, mut rx1) = s.attach_link(1, hello());
        let (_l2, mut rx2) = s.attach_link(2, hello());
        assert!(matches!(drain(&mut rx1)[..], [Kind::Hello(_)]));
        assert!(matches!(drain(&mut rx2)[..], [Kind::Hello(_)]));

        let a = s.join(t(), None);
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
        let b = s.join(t(), None);
        drop(a);
        assert!(drain(&mut rx1).is_empty());
        assert!(drain(&mut rx2).is_empty());

        // A link (re)connecting gets the hello, then every current stream, then every
        // stream's credit.
        let u = s.join(props("u", &[], &[]), None);
        let (l3, mut rx3) = s.attach_link(3, hello());
        let got = drain(&mut rx3);
        assert!(matches!(got[0], Kind::Hello(_)), "{got:?}");
        let mut registered: Vec<String> = got[1..3]
            .iter()
            .map(|k| match k {
                Kind::Register(r) => r.props.as_ref().unwrap().r#type.clone(),
                other => panic!("{other:?}"),
            })
            .collect();
        registered.sort();
        assert_eq!(registered, ["t", "u"]);
        let mut credited: Vec<u64> = got[3..]
            .iter()
            .map(|k| match k {
                Kind::Credit(c) => c.stream_id,
                other => panic!("{other:?}"),
            })
            .collect();
        credited.sort();
        assert_eq!(credited, [id, u.stream_id()]);
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
        let s = registry(32);
        let (l1, _rx1) = s.attach_link(1, hello());
        // Fill the queue as a broker that stopped reading would.
        for _ in 0..OUTBOUND_BUFFER {
            l1.send(hello(), "ack");
        }
        assert!(!l1.broken().is_cancelled());
        let _a = s.join(t(), None);
        assert!(l1.broken().is_cancelled());
        // Forgotten: the reconnect registers everything afresh.
        let (_l1, mut rx1) = s.attach_link(1, hello());
        assert!(matches!(
            drain(&mut rx1)[..],
            [Kind::Hello(_), Kind::Register(_), Kind::Credit(_)]
        ));
    }

    #[test]
    fn a_client_never_holds_more_than_its_credit() {
        let s = registry(3);
        let (l, _rx) = s.attach_link(1, hello());
        let mut a = s.join(t(), None);
        let id = a.stream_id();
        for k in 0..3 {
            assert_eq!(ack(&l, push(id, k)), ok());
        }
        assert_eq!(ack(&l, push(id, 3)), refused(CLIENTS_FULL));
        // Taking jobs from the buffer is not finishing them.
        assert_eq!(keys(&mut a), [0, 1, 2]);
        assert_eq!(ack(&l, push(id, 4)), refused(CLIENTS_FULL));
        drop(s.finished_here(1, Instant::now()));
        assert_eq!(ack(&l, push(id, 5)), ok());
        assert_eq!(ack(&l, push(id, 6)), refused(CLIENTS_FULL));
        assert_eq!(keys(&mut a), [5]);
        assert_eq!(s.inflight().0, 3);
    }

    /// Which of `keys` (each asked with its own lease, `key + 500`, or a stale
    /// one) the gateway says it holds.
    fn held_of(s: &AggregatedStreams, asked: &[(i64, u64)]) -> Vec<i64> {
        let answer = s.held(HeldQuery {
            query_id: 7,
            partition_id: 1,
            jobs: asked
                .iter()
                .map(|&(key, lease)| courier_proto::cluster::HeldJob { key, lease })
                .collect(),
        });
        assert_eq!(answer.query_id, 7);
        answer.held.into_iter().map(|h| h.key).collect()
    }

    #[test]
    fn a_new_leader_hears_which_pushes_are_held_here_or_finishing_through_here() {
        let s = registry(4);
        let (l, _rx) = s.attach_link(1, hello());
        let mut a = s.join(t(), None);
        let id = a.stream_id();
        // Job 1 handed over, 2 still buffered, 3 handed over and being completed,
        // 4 never arrived; job 1 asked about under a stale lease too.
        assert_eq!(ack(&l, push(id, 1)), ok());
        assert_eq!(ack(&l, push(id, 3)), ok());
        assert_eq!(keys(&mut a), [1, 3]);
        assert_eq!(ack(&l, push(id, 2)), ok());
        let completing = s.finished_here(3, Instant::now());
        let asked = [(1, 501), (2, 502), (3, 503), (4, 504)];
        assert_eq!(held_of(&s, &asked), [1, 2, 3]);
        assert_eq!(held_of(&s, &[(1, 9)]), Vec::<i64>::new());
        // Once the completion has its answer, job 3 is nobody's here.
        drop(completing);
        assert_eq!(held_of(&s, &asked), [1, 2]);
        // A client that left may still finish what it was handed: still held. Its
        // buffered job went back to the broker.
        drop(a);
        assert_eq!(held_of(&s, &asked), [1]);
        // A job polled through another gateway (gone, say) and being completed
        // through this one counts as held too, until the completion has its answer.
        let polled = s.finished_here(99, Instant::now());
        let twice = s.finished_here(99, Instant::now());
        assert_eq!(held_of(&s, &[(99, 1)]), [99]);
        drop(polled);
        assert_eq!(held_of(&s, &[(99, 1)]), [99]);
        drop(twice);
        assert_eq!(held_of(&s, &[(99, 1)]), Vec::<i64>::new());
        assert!(s.lock().finishing.is_empty());
        // The push of job 4 arrives late (its leader was slow, not dead): the leader
        // that asked has made it runnable again, so it is refused. Another
        // activation of it is not.
        let b = s.join(t(), None);
        let late = push(b.stream_id(), 4);
        assert_eq!(ack(&l, late.clone()), refused(DISOWNED));
        let again = PushJob { lease: 9, ..late };
        assert_eq!(ack(&l, again), ok());
    }

    #[test]
    fn a_job_in_the_spare_room_is_given_up_to_the_leader_that_asks() {
        // Job 1 handed to the client, 2 and 3 in the spare room.
        let (s, _l, _rx, mut a) = one_full_client_and_two_spare_jobs();
        assert_eq!(held_of(&s, &[(1, lease(1)), (2, lease(2))]), [1]);
        // The other spare job still goes to the first client that frees credit;
        // the one given up never does.
        drop(s.finished_here(1, Instant::now()));
        assert_eq!(keys(&mut a), [3]);
    }

    #[test]
    fn jobs_a_joining_client_holds_already_count_against_its_credit() {
        let s = registry(4);
        let (l, _rx) = s.attach_link(1, hello());
        // Another client holds job 9.
        let mut other = s.join(t(), Some(1));
        let id = other.stream_id();
        assert_eq!(ack(&l, push(id, 9)), ok());
        assert_eq!(keys(&mut other), [9]);
        // Job 1 was handed to a client that left; its worker still runs it.
        let mut first = s.join(t(), None);
        assert_eq!(ack(&l, push(id, 1)), ok());
        assert_eq!(keys(&mut first), [1]);
        drop(first);

        // The worker is back holding job 1, job 2 (polled, or from another gateway),
        // job 3 (past its deadline) and job 9 (not its own).
        let later = epoch_ms() + 60_000;
        let declared = [(1, later), (2, later), (3, epoch_ms() - 1), (9, later)];
        let mut back = s.join_holding(t(), None, &declared);
        assert_eq!(back.stream_id(), id);
        assert_eq!(s.inflight().0, 3, "jobs 1, 2 and 9");
        // Two of its four are taken: two more pushes fit.
        assert_eq!(ack(&l, push(id, 4)), ok());
        assert_eq!(ack(&l, push(id, 5)), ok());
        assert_eq!(ack(&l, push(id, 6)), refused(CLIENTS_FULL));
        // A declared job finished through here frees its room ...
        drop(s.finished_here(2, Instant::now()));
        assert_eq!(ack(&l, push(id, 7)), ok());
        // ... as does the end of job 1's activation, now counted for this client.
        s.finished(1, lease(1));
        assert_eq!(ack(&l, push(id, 8)), ok());
        assert_eq!(ack(&l, push(id, 10)), refused(CLIENTS_FULL));
        assert_eq!(keys(&mut back), [4, 5, 7, 8]);
        assert!(keys(&mut other).is_empty());
        // A broker asking about a job a client declared hears that it is held here,
        // whatever the lease (the client cannot know it).
        let mut again = s.join_holding(props("u", &[], &[]), None, &[(20, later)]);
        assert_eq!(held_of(&s, &[(20, 77), (21, 78)]), [20]);
        assert!(keys(&mut again).is_empty());

        // Never more than its credit, and a declared job's deadline ends its hold.
        let s = registry(2);
        let (l, _rx) = s.attach_link(1, hello());
        let soon = epoch_ms() + 1_000;
        let c = s.join_holding(t(), None, &[(1, soon), (2, later), (3, later)]);
        assert_eq!(s.inflight().0, 2);
        assert_eq!(ack(&l, push(c.stream_id(), 4)), refused(CLIENTS_FULL));
        s.sweep(Instant::now() + Duration::from_secs(2));
        assert_eq!(ack(&l, push(c.stream_id(), 4)), ok());
        assert_eq!(ack(&l, push(c.stream_id(), 5)), refused(CLIENTS_FULL));
    }

    #[test]
    fn a_stated_credit_overrides_the_default() {
        let s = registry(32);
        let (l, _rx) = s.attach_link(1, hello());
        assert_eq!(s.join(t(), None).credit(), 32);
        let a = s.join(t(), Some(2));
        assert_eq!(a.credit(), 2);
        assert_eq!(ack(&l, push(a.stream_id(), 1)), ok());
        assert_eq!(ack(&l, push(a.stream_id(), 2)), ok());
        assert_eq!(ack(&l, push(a.stream_id(), 3)), refused(CLIENTS_FULL));
        // A credit of zero would be a client that can never take a job.
        let z = AggregatedStreams::new(limits(0));
        let (l, _rx) = z.attach_link(1, hello());
        let mut c = z.join(t(), None);
        assert_eq!(c.credit(), 1);
        assert_eq!(ack(&l, push(c.stream_id(), 1)), ok());
        assert_eq!(ack(&l, push(c.stream_id(), 2)), refused(CLIENTS_FULL));
        assert_eq!(keys(&mut c), [1]);
    }

    #[test]
    fn clients_take_turns_and_one_without_credit_is_skipped() {
        let s = registry(32);
        let (l, _rx) = s.attach_link(1, hello());
        let mut a = s.join(t(), Some(2));
        let id = a.stream_id();
        let mut b = s.join(t(), Some(10));
        for k in 0..4 {
            assert_eq!(ack(&l, push(id, k)), ok());
        }
        // In turn until a has no credit left (2), then only b.
        for k in 4..10 {
            assert_eq!(ack(&l, push(id, k)), ok());
        }
        assert_eq!(keys(&mut a), vec![0, 2]);
        assert_eq!(keys(&mut b), vec![1, 3, 4, 5, 6, 7, 8, 9]);
        // b has 2 left; then nobody has credit.
        assert_eq!(ack(&l, push(id, 10)), ok());
        assert_eq!(ack(&l, push(id, 11)), ok());
        assert_eq!(ack(&l, push(id, 12)), refused(CLIENTS_FULL));
    }

    #[test]
    fn clients_with_credit_take_turns() {
        let s = registry(64);
        let (l, _rx) = s.attach_link(1, hello());
        let mut a = s.join(t(), None);
        let mut b = s.join(t(), None);
        for k in 0..100 {
            assert_eq!(ack(&l, push(a.stream_id(), k)), ok());
        }
        let (ka, kb) = (keys(&mut a), keys(&mut b));
        assert_eq!((ka.len(), kb.len()), (50, 50));
        // Strictly alternating, not just balanced.
        assert!(ka.iter().all(|k| k % 2 == 0), "{ka:?}");
        assert!(kb.iter().all(|k| k % 2 == 1), "{kb:?}");
    }

    #[test]
    fn a_job_finished_through_this_gateway_or_any_other_frees_one_credit() {
        let s = registry(2);
        let (l, _rx) = s.attach_link(1, hello());
        let mut a = s.join(t(), None);
        let id = a.stream_id();
        assert_eq!(ack(&l, push(id, 1)), ok());
        assert_eq!(ack(&l, push(id, 2)), ok());
        assert_eq!(ack(&l, push(id, 3)), refused(CLIENTS_FULL));
        // The worker has them.
        assert_eq!(keys(&mut a), [1, 2]);
        // JobFinished: only for the activation held, and only once.
        s.finished(1, lease(1) + 1);
        s.finished(99, 1);
        assert_eq!(ack(&l, push(id, 3)), refused(CLIENTS_FULL));
        s.finished(1, lease(1));
        assert_eq!(ack(&l, push(id, 3)), ok());
        assert_eq!(keys(&mut a), [3]);
        s.finished(1, lease(1));
        assert_eq!(ack(&l, push(id, 4)), refused(CLIENTS_FULL));
        // Completed through this gateway.
        drop(s.finished_here(2, Instant::now()));
        drop(s.finished_here(2, Instant::now()));
        assert_eq!(ack(&l, push(id, 4)), ok());
        assert_eq!(ack(&l, push(id, 5)), refused(CLIENTS_FULL));
        assert_eq!(s.inflight().0, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_finish_whose_request_began_before_the_hand_off_frees_nothing() {
        let s = registry(1);
        let (l, _rx) = s.attach_link(1, hello());
        let mut a = s.join(t(), None);
        let since = Instant::now();
        tokio::time::sleep(Duration::from_millis(1)).await;
        // Failed with retries left, and pushed again before the FailJob reply.
        assert_eq!(ack(&l, push(a.stream_id(), 1)), ok());
        assert_eq!(keys(&mut a), [1]);
        drop(s.finished_here(1, since));
        s.timeout_updated(1, 60_000, since);
        assert_eq!(ack(&l, push(a.stream_id(), 2)), refused(CLIENTS_FULL));
        drop(s.finished_here(1, Instant::now()));
        assert_eq!(ack(&l, push(a.stream_id(), 2)), ok());
    }

    #[tokio::test(start_paused = true)]
    async fn a_passed_deadline_frees_one_credit_and_update_timeout_moves_it() {
        let s = registry(1);
        let stop = CancellationToken::new();
        let (_tx, leaders) = watch::channel(BTreeMap::new());
        let task = tokio::spawn(s.clone().run(leaders, stop.clone()));
        let (l, _rx) = s.attach_link(1, hello());
        let mut a = s.join(t(), None);
        let id = a.stream_id();
        let with_deadline = |key: i64, in_ms: i64| {
            let mut p = push(id, key);
            if let Some(j) = p.job.as_mut() {
                j.deadline = epoch_ms() + in_ms;
            }
            p
        };
        assert_eq!(ack(&l, with_deadline(1, 1000)), ok());
        assert_eq!(keys(&mut a), [1]);
        tokio::time::sleep(Duration::from_millis(900)).await;
        assert_eq!(ack(&l, push(id, 2)), refused(CLIENTS_FULL));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(s.inflight().0, 0);
        assert_eq!(ack(&l, with_deadline(2, 1000)), ok());
        assert_eq!(keys(&mut a), [2]);

        // At 500 ms the timeout is set to 2 s from then.
        tokio::time::sleep(Duration::from_millis(500)).await;
        s.timeout_updated(2, 2000, Instant::now());
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert_eq!(ack(&l, push(id, 3)), refused(CLIENTS_FULL));
        tokio::time::sleep(Duration::from_millis(1200)).await;
        assert_eq!(ack(&l, push(id, 3)), ok());
        assert_eq!(keys(&mut a), [3]);

        // A push without a deadline is held for the stream's activation timeout.
        drop(s.finished_here(3, Instant::now()));
        assert_eq!(ack(&l, push(id, 4)), ok());
        assert_eq!(keys(&mut a), [4]);
        tokio::time::sleep(Duration::from_millis(900)).await;
        assert_eq!(s.inflight().0, 1);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(s.inflight().0, 0);

        stop.cancel();
        tokio::time::timeout(Duration::from_secs(1), task)
            .await
            .expect("the task stops on shutdown")
            .unwrap();
    }

    #[test]
    fn the_gateway_refuses_past_its_jobs_bound() {
        let s = AggregatedStreams::new(Limits {
            max_inflight_jobs: 2,
            ..limits(32)
        });
        let (l, mut rx) = s.attach_link(1, hello());
        let a = s.join(t(), None);
        let b = s.join(props("u", &[], &[]), None);
        assert_eq!(ack(&l, push(a.stream_id(), 1)), ok());
        assert_eq!(ack(&l, push(b.stream_id(), 2)), ok());
        assert_eq!(ack(&l, push(a.stream_id(), 3)), refused(GATEWAY_FULL));
        assert_eq!(s.inflight().0, 2);
        drain(&mut rx);
        s.flush();
        let mut got = reports(&mut rx);
        got.sort();
        assert_eq!(got, [(a.stream_id(), 0, 2), (b.stream_id(), 0, 1)]);
        // One released: one more fits, and both streams may have it.
        drop(s.finished_here(2, Instant::now()));
        s.flush();
        let mut got = reports(&mut rx);
        got.sort();
        assert_eq!(got, [(a.stream_id(), 1, 2), (b.stream_id(), 1, 1)]);
        assert_eq!(ack(&l, push(a.stream_id(), 3)), ok());
    }

    #[test]
    fn the_gateway_refuses_past_its_bytes_bound() {
        let s = AggregatedStreams::new(Limits {
            max_inflight_bytes: 100,
            ..limits(32)
        });
        let (l, mut rx) = s.attach_link(1, hello());
        let a = s.join(t(), None);
        let id = a.stream_id();
        let sized = |key: i64, vars: usize, headers: usize| {
            let mut p = push(id, key);
            if let Some(j) = p.job.as_mut() {
                j.variables = "v".repeat(vars);
                j.custom_headers = "h".repeat(headers);
            }
            p
        };
        assert_eq!(ack(&l, sized(1, 40, 20)), ok());
        assert_eq!(s.inflight(), (1, 60));
        assert_eq!(ack(&l, sized(2, 30, 20)), refused(GATEWAY_FULL));
        drain(&mut rx);
        s.flush();
        // No room reported until something is released, though a smaller job fits.
        assert_eq!(reports(&mut rx), [(id, 0, 2)]);
        assert_eq!(ack(&l, sized(3, 30, 10)), ok());
        assert_eq!(s.inflight(), (2, 100));
        s.finished(1, lease(1));
        assert_eq!(s.inflight(), (1, 40));
        s.flush();
        assert_eq!(reports(&mut rx), [(id, 30, 3)]);
        assert_eq!(ack(&l, sized(2, 30, 20)), ok());
    }

    #[test]
    fn credit_is_split_by_led_partitions_with_the_remainder_in_turn() {
        assert_eq!(split(10, &[2, 1, 0], 0), [7, 3, 0]);
        assert_eq!(split(10, &[2, 1, 0], 1), [6, 4, 0]);
        assert_eq!(split(10, &[2, 1, 0], 2), [7, 3, 0]);
        // No leader known: equal shares.
        assert_eq!(split(10, &[0, 0, 0], 0), [4, 3, 3]);
        assert_eq!(split(10, &[0, 0, 0], 1), [3, 4, 3]);
        // A single credit goes round.
        let firsts: Vec<Vec<u32>> = (0..3).map(|r| split(1, &[1, 1, 1], r)).collect();
        assert_eq!(firsts, [[1, 0, 0], [0, 1, 0], [0, 0, 1]]);
        assert_eq!(split(0, &[3, 1], 5), [0, 0]);
        assert!(split(7, &[], 0).is_empty());
        for free in [0, 1, 2, 9, 10, 11, 1000, u32::MAX] {
            for r in 0..4 {
                for w in [[2, 1, 0], [0, 0, 0], [5, 5, 1], [1, 0, 0]] {
                    let shares = split(free, &w, r);
                    let sum: u64 = shares.iter().map(|&s| u64::from(s)).sum();
                    assert_eq!(sum, u64::from(free), "{free} {w:?} {r}");
                    if w.iter().any(|&x| x > 0) {
                        assert!(w.iter().zip(&shares).all(|(&w, &s)| w > 0 || s == 0));
                    }
                }
            }
        }
    }

    #[test]
    fn each_link_hears_its_share_of_the_streams_free_credit() {
        let s = registry(10);
        let links: Vec<_> = (1..=3).map(|n| s.attach_link(n, hello())).collect();
        let mut rxs: Vec<_> = links.into_iter().collect();
        let a = s.join(t(), None);
        let id = a.stream_id();
        s.set_leaders(BTreeMap::from([(1, 2), (2, 1)]));
        let mut first = Vec::new();
        for round in 0..2 {
            s.flush();
            let shares: Vec<u32> = rxs
                .iter_mut()
                .map(|(_, rx)| {
                    let got: Vec<_> = drain(rx)
                        .into_iter()
                        .filter_map(|k| match k {
                            Kind::Credit(c) => Some((c.stream_id, c.free, c.received)),
                            _ => None,
                        })
                        .collect();
                    match got[..] {
                        [(sid, free, 0)] if sid == id => free,
                        // Nothing sent: unchanged, or not worth reporting yet.
                        [] => 0,
                        _ => panic!("{got:?}"),
                    }
                })
                .collect();
            if round == 0 {
                assert!(shares == [7, 3, 0] || shares == [6, 4, 0], "{shares:?}");
                first = shares;
            } else if first == [7, 3, 0] {
                // The remainder moved on: the share that shrank is told at once; the
                // one that grew by a credit, with the broker's view still above half
                // of it, is not.
                assert_eq!(shares, [6, 0, 0]);
            } else {
                assert_eq!(shares, [0, 3, 0]);
            }
            // Something changed: the next flush re-splits.
            s.set_leaders(BTreeMap::from([(1, 2), (2, 1), (3, 0)]));
        }
    }

    #[test]
    fn a_types_credit_gauges_go_with_its_last_stream() {
        let series = || {
            prometheus::default_registry()
                .gather()
                .iter()
                .filter(|f| f.name().starts_with("courier_gateway_credit_"))
                .flat_map(|f| f.get_metric())
                .filter(|m| m.get_label().iter().any(|l| l.value() == "gone-type"))
                .count()
        };
        let s = registry(8);
        let a = s.join(props("gone-type", &[], &[]), None);
        let b = s.join(props("gone-type", &["x"], &[]), None);
        assert_eq!(series(), 2);
        drop(a);
        assert_eq!(series(), 2, "another stream of the type is left");
        drop(b);
        assert_eq!(series(), 0);
    }

    #[test]
    fn brokers_with_jobs_they_had_no_credit_for_take_the_streams_free_credit() {
        let s = registry(30);
        let (l1, mut rx1) = s.attach_link(1, hello());
        let (_l2, mut rx2) = s.attach_link(2, hello());
        s.set_leaders(BTreeMap::from([(1, 1), (2, 2)]));
        let mut a = s.join(long_t(), None);
        let id = a.stream_id();
        drain(&mut rx1);
        drain(&mut rx2);
        s.flush();
        assert_eq!(reports(&mut rx1), [(id, 10, 0)]);
        assert_eq!(reports(&mut rx2), [(id, 20, 0)]);

        // Broker 1 has jobs it could not push: the credit goes to it alone. A notice
        // for another type or tenant changes nothing.
        s.jobs_available(2, "u", DEFAULT_TENANT);
        s.jobs_available(2, "t", "other");
        s.flush();
        assert!(drain(&mut rx1).is_empty());
        assert!(drain(&mut rx2).is_empty());
        s.jobs_available(1, "t", DEFAULT_TENANT);
        s.flush();
        assert_eq!(reports(&mut rx1), [(id, 30, 0)]);
        assert_eq!(reports(&mut rx2), [(id, 0, 0)]);

        // It pushes all it may: no free credit, so its demand lasts however long
        // the client holds the jobs.
        for k in 0..30 {
            assert_eq!(ack(&l1, push(id, k)), ok());
        }
        assert_eq!(keys(&mut a).len(), 30);
        let later = Instant::now() + DEMAND_WINDOW * 3;
        s.sweep(later);
        s.flush();
        assert!(drain(&mut rx2).is_empty());
        for k in 0..6 {
            drop(s.finished_here(k, Instant::now()));
        }
        s.flush();
        assert_eq!(reports(&mut rx1), [(id, 6, 30)]);
        assert!(drain(&mut rx2).is_empty());

        // With free credit and neither notices nor pushes for the window, the
        // backlog is gone: the split by led partitions is back.
        s.sweep(later + DEMAND_WINDOW + Duration::from_millis(1));
        assert!(s.lock().streams[&id].wanted.is_empty());
        s.flush();
        assert_eq!(reports(&mut rx1), [(id, 2, 30)]);
        assert_eq!(reports(&mut rx2), [(id, 4, 0)]);

        // Now broker 2 has jobs it could not push.
        s.jobs_available(2, "t", DEFAULT_TENANT);
        s.flush();
        assert_eq!(reports(&mut rx1), [(id, 0, 30)]);
        assert_eq!(reports(&mut rx2), [(id, 6, 0)]);
    }

    #[test]
    fn a_broker_whose_jobs_wait_for_credit_gets_the_next_free_credit_and_keeps_its_demand() {
        // One credit, three brokers with a partition each: only one can hold it.
        let s = registry(1);
        let (_links, mut rxs): (Vec<_>, Vec<_>) =
            (1..=3).map(|n| s.attach_link(n, hello())).unzip();
        s.set_leaders(BTreeMap::from([(1, 1), (2, 1), (3, 1)]));
        let a = s.join(t(), None);
        let id = a.stream_id();
        // What each broker was told last.
        let mut told = [0u32; 3];
        let mut hear = |rxs: &mut Vec<mpsc::Receiver<GatewayMessage>>| {
            for (i, rx) in rxs.iter_mut().enumerate() {
                for k in drain(rx) {
                    if let Kind::Credit(c) = k {
                        assert_eq!(c.stream_id, id);
                        told[i] = c.free;
                    }
                }
            }
            told
        };
        s.flush();
        let first = hear(&mut rxs);
        assert_eq!(first.iter().sum::<u32>(), 1, "{first:?}");
        // Brokers 1 and 3 announce jobs they could not push: one of them gets it.
        s.jobs_available(1, "t", DEFAULT_TENANT);
        s.jobs_available(3, "t", DEFAULT_TENANT);
        s.flush();
        let (with, without) = match hear(&mut rxs) {
            [1, 0, 0] => (0, 2),
            [0, 0, 1] => (2, 0),
            other => panic!("{other:?}"),
        };
        // The other one announces again (a new job it could not push): the credit
        // moves to it now, not once the first one's demand has aged out.
        s.jobs_available(without as NodeId + 1, "t", DEFAULT_TENANT);
        s.flush();
        let now = hear(&mut rxs);
        assert_eq!((now[without], now[with], now[1]), (1, 0, 0), "{now:?}");

        // It pushes nothing (its job went elsewhere, say to a poll): once that has
        // lasted the window its demand is gone. The first's stays, however long: it
        // was told of no credit, so it could not show its demand by pushing.
        s.sweep(Instant::now() + DEMAND_WINDOW * 3);
        s.flush();
        let now = hear(&mut rxs);
        assert_eq!((now[with], now[without]), (1, 0), "{now:?}");
        let wanted: Vec<NodeId> = s.lock().streams[&id].wanted.keys().copied().collect();
        assert_eq!(wanted, [with as NodeId + 1]);
        drop(a);
    }

    #[test]
    fn pushes_alone_send_no_report_and_a_release_sends_one_per_link() {
        let s = registry(32);
        let (l1, mut rx1) = s.attach_link(1, hello());
        let (_l2, mut rx2) = s.attach_link(2, hello());
        s.set_leaders(BTreeMap::from([(1, 1), (2, 1)]));
        let mut a = s.join(t(), None);
        let id = a.stream_id();
        s.flush();
        drain(&mut rx1);
        drain(&mut rx2);
        for k in 0..20 {
            assert_eq!(ack(&l1, push(id, k)), ok());
        }
        assert_eq!(keys(&mut a).len(), 20);
        s.flush();
        assert!(drain(&mut rx1).is_empty());
        assert!(drain(&mut rx2).is_empty());
        // Eight released before the flush: one report per link. Broker 1 thinks it
        // has no credit left (16 told, 20 received), so it hears of its new share
        // of 10; broker 2's share shrank from 16.
        for k in 0..8 {
            drop(s.finished_here(k, Instant::now()));
        }
        s.flush();
        assert_eq!(reports(&mut rx1), [(id, 10, 20)]);
        assert_eq!(reports(&mut rx2), [(id, 10, 0)]);
        s.flush();
        assert!(drain(&mut rx1).is_empty());
        // A client joining or leaving changes the stream's credit too. Joining adds
        // 32: both brokers' views are below half of their new shares of 26.
        let b = s.join(t(), None);
        s.flush();
        assert_eq!(reports(&mut rx1), [(id, 26, 20)]);
        assert_eq!(reports(&mut rx2), [(id, 26, 0)]);
        drop(b);
        s.flush();
        assert_eq!(reports(&mut rx1), [(id, 10, 20)]);
        assert_eq!(reports(&mut rx2), [(id, 10, 0)]);
    }

    #[test]
    fn credit_that_grew_is_reported_once_the_brokers_view_falls_to_half_of_it() {
        let s = registry(32);
        let (l1, mut rx1) = s.attach_link(1, hello());
        let mut a = s.join(t(), None);
        let id = a.stream_id();
        s.flush();
        drain(&mut rx1);
        for k in 0..20 {
            assert_eq!(ack(&l1, push(id, k)), ok());
        }
        assert_eq!(keys(&mut a).len(), 20);
        // Three come back: the broker thinks it may push 12 more, of 15.
        for k in 0..3 {
            drop(s.finished_here(k, Instant::now()));
        }
        s.flush();
        assert!(drain(&mut rx1).is_empty());
        // A client of credit 1 joins and leaves: 12 of 16, then of 15 again.
        let b = s.join(t(), Some(1));
        s.flush();
        drop(b);
        s.flush();
        assert!(drain(&mut rx1).is_empty());
        // Its pushes wear its view down: 4 of 7 is more than half...
        for k in 20..28 {
            assert_eq!(ack(&l1, push(id, k)), ok());
        }
        s.flush();
        assert!(drain(&mut rx1).is_empty());
        // ...3 of 6 is not: the push that took it there has the report sent.
        assert_eq!(ack(&l1, push(id, 28)), ok());
        assert!(s.lock().dirty.contains(&id));
        s.flush();
        assert_eq!(reports(&mut rx1), [(id, 6, 29)]);
        assert_eq!(keys(&mut a).len(), 9);
        // A share that shrinks is told at once, however little: a second broker
        // leads a partition too.
        let (_l2, mut rx2) = s.attach_link(2, hello());
        s.set_leaders(BTreeMap::from([(1, 1), (2, 1)]));
        s.flush();
        assert_eq!(reports(&mut rx1), [(id, 3, 29)]);
        assert!(drain(&mut rx2)
            .iter()
            .any(|k| matches!(k, Kind::Credit(c) if c.stream_id == id)));
    }

    #[tokio::test(start_paused = true)]
    async fn the_flusher_coalesces_releases_and_follows_leadership() {
        let s = registry(32);
        let stop = CancellationToken::new();
        let (leaders_tx, leaders) = watch::channel(BTreeMap::from([(1, 1), (2, 1)]));
        let task = tokio::spawn(s.clone().run(leaders, stop.clone()));
        let (l1, mut rx1) = s.attach_link(1, hello());
        let (_l2, mut rx2) = s.attach_link(2, hello());
        let mut a = s.join(t(), None);
        let id = a.stream_id();
        tokio::time::sleep(Duration::from_millis(10)).await;
        drain(&mut rx1);
        drain(&mut rx2);
        for k in 0..20 {
            assert_eq!(ack(&l1, push(id, k)), ok());
        }
        assert_eq!(keys(&mut a).len(), 20);
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(drain(&mut rx1).is_empty());
        assert!(drain(&mut rx2).is_empty());
        for k in 0..4 {
            s.finished(k, lease(k));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(reports(&mut rx1), [(id, 8, 20)]);
        assert_eq!(reports(&mut rx2), [(id, 8, 0)]);
        // Broker 2 now leads both partitions.
        leaders_tx.send_replace(BTreeMap::from([(2, 2)]));
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(reports(&mut rx1), [(id, 0, 20)]);
        assert_eq!(reports(&mut rx2), [(id, 16, 0)]);
        stop.cancel();
        task.await.unwrap();
    }

    #[test]
    fn a_reconnected_link_hears_every_report_again_with_its_pushes_counted_afresh() {
        let s = registry(8);
        let (l1, mut rx1) = s.attach_link(1, hello());
        let mut a = s.join(t(), None);
        let id = a.stream_id();
        s.flush();
        assert_eq!(drain(&mut rx1).len(), 3);
        for k in 0..3 {
            assert_eq!(ack(&l1, push(id, k)), ok());
        }
        assert_eq!(keys(&mut a), [0, 1, 2]);
        // Refused pushes count as received too.
        assert_eq!(ack(&l1, push(77, 9)), refused(UNKNOWN_STREAM));
        drop(s.finished_here(0, Instant::now()));
        // Broker 1 has jobs waiting for credit: it hears of every credit that comes back.
        s.jobs_available(1, "t", DEFAULT_TENANT);
        s.flush();
        assert_eq!(reports(&mut rx1), [(id, 6, 3)]);
        drop(l1);
        let (l1, mut rx1) = s.attach_link(1, hello());
        match &drain(&mut rx1)[..] {
            [Kind::Hello(_), Kind::Register(r), Kind::Credit(c)] => {
                assert_eq!(r.stream_id, id);
                assert_eq!((c.stream_id, c.free, c.received), (id, 6, 0));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(ack(&l1, push(id, 5)), ok());
        assert_eq!(keys(&mut a), [5]);
        drop(s.finished_here(1, Instant::now()));
        s.flush();
        assert_eq!(reports(&mut rx1), [(id, 6, 1)]);
    }

    #[test]
    fn a_client_whose_buffer_holds_released_jobs_reports_again_when_it_takes_one() {
        let s = registry(2);
        let (l, mut rx) = s.attach_link(1, hello());
        let mut a = s.join(t(), None);
        let id = a.stream_id();
        assert_eq!(ack(&l, push(id, 1)), ok());
        assert_eq!(ack(&l, push(id, 2)), ok());
        // Canceled while still buffered (the client's window is full): the credit is
        // back but the buffer has no room.
        s.finished(1, lease(1));
        s.finished(2, lease(2));
        drain(&mut rx);
        s.flush();
        assert_eq!(reports(&mut rx), [(id, 0, 2)]);
        assert_eq!(ack(&l, push(id, 3)), refused(CLIENTS_FULL));
        // Their activations ended: the client takes them out of its buffer but is
        // not handed them.
        assert_eq!(keys(&mut a), Vec::<i64>::new());
        s.flush();
        assert_eq!(reports(&mut rx), [(id, 2, 3)]);
        assert_eq!(ack(&l, push(id, 3)), ok());
        assert_eq!(keys(&mut a), [3]);
    }

    #[test]
    fn a_buffered_job_whose_activation_ended_never_reaches_its_client() {
        let s = registry(4);
        let (l, _rx) = s.attach_link(1, hello());
        let mut a = s.join(t(), None);
        let id = a.stream_id();
        for k in 1..=3 {
            assert_eq!(ack(&l, push(id, k)), ok());
        }
        // While the client has not read them: job 1 timed out and was pushed again
        // under a new lease, job 2 was completed through another gateway.
        let mut again = push(id, 1);
        again.lease = lease(1) + 1;
        again.push_id += 1;
        assert_eq!(ack(&l, again), ok());
        s.finished(2, lease(2));
        // Each job once, under the activation that is current; nothing run twice.
        assert_eq!(keys(&mut a), [3, 1]);
        assert_eq!(s.inflight().0, 2);
    }

    #[test]
    fn unknown_streams_and_malformed_pushes_are_refused() {
        let s = registry(2);
        let (l, _rx) = s.attach_link(1, hello());
        assert_eq!(ack(&l, push(77, 1)), refused(UNKNOWN_STREAM));
        let a = s.join(t(), None);
        let id = a.stream_id();
        drop(a);
        // Gone with its last client.
        assert_eq!(ack(&l, push(id, 1)), refused(UNKNOWN_STREAM));
        let mut p = push(id, 1);
        p.job = None;
        assert!(l.push(p).is_none());
        let ack = l.push(push(id, 9));
        assert_eq!(ack.map(|a| a.push_id), Some(1009));
        assert_eq!(s.inflight(), (0, 0));
    }

    #[test]
    fn a_leaving_clients_buffered_jobs_go_to_the_next_client_with_their_credit() {
        let s = registry(4);
        let (l1, mut rx1) = s.attach_link(1, hello());
        let a = s.join(t(), None);
        let mut b = s.join(t(), None);
        let id = a.stream_id();
        for k in 0..4 {
            assert_eq!(ack(&l1, push(id, k)), ok());
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
        // The moved jobs count against b now.
        assert_eq!(ack(&l1, push(id, 4)), refused(CLIENTS_FULL));
        s.finished(0, lease(0));
        assert_eq!(ack(&l1, push(id, 4)), ok());
    }

    fn with_spare(client_credit: u32, spare_percent: u32) -> Arc<AggregatedStreams> {
        AggregatedStreams::new(Limits {
            spare_percent,
            ..limits(client_credit)
        })
    }

    #[test]
    fn spare_room_is_a_quarter_of_the_credit_rounded_up() {
        assert_eq!(spare_share(32, 25), 8);
        assert_eq!(spare_share(4, 25), 1);
        assert_eq!(spare_share(1, 25), 1);
        assert_eq!(spare_share(10, 0), 0);
        assert_eq!(spare_share(u32::MAX, 100), u32::MAX);
    }

    #[test]
    fn spare_jobs_wait_for_the_first_client_that_frees_credit_never_exceeding_it() {
        // Credit 2 each, spare 50%: one spare place per client, reported as credit.
        let s = with_spare(2, 50);
        let (l, mut rx) = s.attach_link(1, hello());
        let mut a = s.join(t(), None);
        let mut b = s.join(t(), None);
        let id = a.stream_id();
        drain(&mut rx);
        s.flush();
        assert_eq!(reports(&mut rx).last(), Some(&(id, 6, 0)));
        for k in 1..=4 {
            assert_eq!(ack(&l, push(id, k)), ok());
        }
        // Both clients are full; the next two wait in the spare room.
        assert_eq!(ack(&l, push(id, 5)), ok());
        assert_eq!(ack(&l, push(id, 6)), ok());
        assert_eq!(keys(&mut a), [1, 3]);
        assert_eq!(keys(&mut b), [2, 4]);
        assert_eq!(s.inflight().0, 6);
        // b finishes one: the oldest spare job goes to b at once, not to a.
        drop(s.finished_here(4, Instant::now()));
        assert_eq!(keys(&mut b), [5]);
        assert!(keys(&mut a).is_empty());
        drop(s.finished_here(1, Instant::now()));
        assert_eq!(keys(&mut a), [6]);
        // The spare room is empty again and reported as free.
        s.flush();
        assert_eq!(reports(&mut rx).last(), Some(&(id, 2, 6)));
    }

    #[test]
    fn spare_jobs_that_wait_too_long_go_back_and_the_spare_room_pauses() {
        let s = with_spare(1, 100);
        let (l, mut rx) = s.attach_link(1, hello());
        let mut a = s.join(long_t(), None);
        let id = a.stream_id();
        for k in 1..=3 {
            assert_eq!(ack(&l, push(id, k)), ok());
        }
        assert_eq!(keys(&mut a), [1]);
        drain(&mut rx);
        s.sweep(Instant::now() + SPARE_WAIT / 2);
        assert!(yielded_keys(&mut rx).is_empty(), "not yet");
        // The client is stuck: its spare jobs go back for others to run.
        s.sweep(Instant::now() + SPARE_WAIT);
        let mut back = yielded_keys(&mut rx);
        back.sort();
        assert_eq!(back, [2, 3]);
        assert_eq!(s.inflight().0, 1);
        // And the spare room is neither offered nor filled while it stays stuck.
        s.flush();
        assert_eq!(reports(&mut rx).last(), Some(&(id, 0, 3)));
        assert_eq!(ack(&l, push(id, 4)), refused(CLIENTS_FULL));
        // It frees its credit: room for it, and the spare room again.
        drop(s.finished_here(1, Instant::now()));
        s.flush();
        assert_eq!(reports(&mut rx).last(), Some(&(id, 2, 4)));
    }

    /// Credit 1 and spare 100% (one place reported, one more of tolerance): job 1
    /// taken by the client, jobs 2 and 3 in the spare room.
    fn one_full_client_and_two_spare_jobs() -> (
        Arc<AggregatedStreams>,
        AttachedLink,
        mpsc::Receiver<GatewayMessage>,
        ClientStream,
    ) {
        let s = with_spare(1, 100);
        let (l, rx) = s.attach_link(1, hello());
        let mut a = s.join(t(), None);
        let id = a.stream_id();
        assert_eq!(ack(&l, push(id, 1)), ok());
        assert_eq!(ack(&l, push(id, 2)), ok());
        assert_eq!(ack(&l, push(id, 3)), ok());
        assert_eq!(keys(&mut a), [1]);
        (s, l, rx, a)
    }

    #[test]
    fn pushes_beyond_the_reported_spare_room_are_taken_up_to_as_much_again() {
        let (s, l, _rx, mut a) = one_full_client_and_two_spare_jobs();
        let id = a.stream_id();
        assert_eq!(ack(&l, push(id, 4)), refused(CLIENTS_FULL));
        drop(s.finished_here(1, Instant::now()));
        assert_eq!(keys(&mut a), [2]);
        assert_eq!(ack(&l, push(id, 4)), ok());
        assert_eq!(ack(&l, push(id, 5)), refused(CLIENTS_FULL));
    }

    #[test]
    fn a_spare_job_whose_activation_ended_is_never_handed_out() {
        let (s, _l, _rx, mut a) = one_full_client_and_two_spare_jobs();
        // Job 2 timed out at the broker (or was canceled) while it waited.
        s.finished(2, lease(2));
        assert_eq!(s.inflight().0, 2);
        drop(s.finished_here(1, Instant::now()));
        assert_eq!(keys(&mut a), [3]);
        assert_eq!(s.inflight().0, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_spare_job_past_half_its_timeout_goes_back_to_its_broker() {
        // The stream's timeout is 1 s (see `props`).
        let (s, _l, mut rx, mut a) = one_full_client_and_two_spare_jobs();
        drain(&mut rx);
        tokio::time::advance(Duration::from_millis(400)).await;
        drop(s.finished_here(1, Instant::now()));
        assert_eq!(keys(&mut a), [2]);
        tokio::time::advance(Duration::from_millis(200)).await;
        drop(s.finished_here(2, Instant::now()));
        // Job 3 has 400 ms of its 1 s left: yielded, not handed out.
        assert!(keys(&mut a).is_empty());
        let yielded = yielded_keys(&mut rx);
        assert_eq!(yielded, [3]);
        assert_eq!(s.inflight().0, 0);
    }

    #[test]
    fn spare_jobs_are_yielded_when_the_last_client_leaves() {
        let s = with_spare(1, 100);
        let (l, mut rx) = s.attach_link(1, hello());
        let a = s.join(t(), None);
        let id = a.stream_id();
        assert_eq!(ack(&l, push(id, 1)), ok());
        assert_eq!(ack(&l, push(id, 2)), ok());
        drain(&mut rx);
        drop(a);
        let yielded = yielded_keys(&mut rx);
        assert_eq!(yielded, [1, 2]);
        assert_eq!(s.inflight(), (0, 0));
    }

    #[test]
    fn a_leaving_clients_buffered_jobs_wait_in_the_spare_room_for_the_others() {
        let s = with_spare(1, 100);
        let (l, mut rx) = s.attach_link(1, hello());
        let a = s.join(t(), None);
        let mut b = s.join(t(), None);
        let id = a.stream_id();
        assert_eq!(ack(&l, push(id, 1)), ok());
        assert_eq!(ack(&l, push(id, 2)), ok());
        drain(&mut rx);
        // a leaves with job 1 in its buffer; b is full: job 1 waits for b.
        drop(a);
        assert!(drain(&mut rx)
            .iter()
            .all(|k| !matches!(k, Kind::YieldJob(_))));
        assert_eq!(keys(&mut b), [2]);
        drop(s.finished_here(2, Instant::now()));
        assert_eq!(keys(&mut b), [1]);
    }

    #[test]
    fn jobs_no_client_can_take_are_yielded_to_every_broker() {
        let s = registry(4);
        let (l1, mut rx1) = s.attach_link(1, hello());
        let (l2, mut rx2) = s.attach_link(2, hello());
        let a = s.join(t(), None);
        let id = a.stream_id();
        assert_eq!(ack(&l1, push(id, 10)), ok());
        assert_eq!(ack(&l2, push(id, 20)), ok());
        assert_eq!(ack(&l1, push(id, 11)), ok());
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
        // Whichever leads the partition now acts on them; the lease guards the rest.
        let all = [(1, 10, 510), (1, 20, 520), (1, 11, 511)];
        assert_eq!(yields(&mut rx1), all);
        assert_eq!(yields(&mut rx2), all);
        assert_eq!(s.stream_count(), 0);
        assert_eq!(s.inflight(), (0, 0));
    }

    #[test]
    fn jobs_the_remaining_clients_have_no_credit_for_are_yielded() {
        let s = registry(1);
        let (l1, mut rx1) = s.attach_link(1, hello());
        let a = s.join(t(), None);
        let mut b = s.join(t(), None);
        let id = a.stream_id();
        assert_eq!(ack(&l1, push(id, 1)), ok());
        assert_eq!(ack(&l1, push(id, 2)), ok());
        drain(&mut rx1);
        drop(a);
        match &drain(&mut rx1)[..] {
            [Kind::YieldJob(y)] => assert_eq!(y.key, 1),
            other => panic!("{other:?}"),
        }
        assert_eq!(keys(&mut b), [2]);
        // b stays in the rotation alone, with its credit.
        s.finished(2, lease(2));
        assert_eq!(ack(&l1, push(id, 3)), ok());
        assert_eq!(keys(&mut b), [3]);
    }

    #[test]
    fn jobs_of_a_client_that_left_count_against_the_gateway_until_they_finish() {
        let s = registry(4);
        let (l1, _rx1) = s.attach_link(1, hello());
        let mut a = s.join(t(), None);
        let id = a.stream_id();
        let mut p = push(id, 1);
        if let Some(j) = p.job.as_mut() {
            j.variables = "{}".into();
        }
        assert_eq!(ack(&l1, p), ok());
        // Its worker has it.
        assert_eq!(keys(&mut a), [1]);
        drop(a);
        assert_eq!(s.inflight(), (1, 2));
        s.finished(1, lease(1));
        assert_eq!(s.inflight(), (0, 0));
    }

    #[test]
    fn a_job_pushed_again_replaces_its_earlier_activation() {
        let s = registry(2);
        let (l1, _rx1) = s.attach_link(1, hello());
        let a = s.join(t(), None);
        let id = a.stream_id();
        assert_eq!(ack(&l1, push(id, 1)), ok());
        let mut again = push(id, 1);
        again.lease = 9000;
        assert_eq!(ack(&l1, again), ok());
        assert_eq!(s.inflight().0, 1);
        // The earlier activation's end is stale; the current one's is not.
        s.finished(1, lease(1));
        assert_eq!(s.inflight().0, 1);
        s.finished(1, 9000);
        assert_eq!(s.inflight().0, 0);
    }

    #[test]
    fn the_rotation_continues_past_a_removed_client() {
        let s = registry(8);
        let (l, _rx) = s.attach_link(1, hello());
        let mut a = s.join(t(), None);
        let mut b = s.join(t(), None);
        let mut c = s.join(t(), None);
        let id = a.stream_id();
        // a, b: next is c.
        assert_eq!(ack(&l, push(id, 0)), ok());
        assert_eq!(ack(&l, push(id, 1)), ok());
        assert_eq!(keys(&mut b), [1]);
        drop(b);
        assert_eq!(ack(&l, push(id, 2)), ok());
        assert_eq!(ack(&l, push(id, 3)), ok());
        assert_eq!(keys(&mut a), [0, 3]);
        assert_eq!(keys(&mut c), [2]);
    }
}
