//! The job-stream registry of a broker, shared by all its partitions: which gateway
//! links hold aggregated streams for which job types and activation properties.
//!
//! Lookups are synchronous (dashmap, no await): the leader calls them while it
//! prepares a command. Registrations live exactly as long as the gateway link that
//! carried them: when a link ends, every stream of that gateway goes at once.

use crate::engine::{PushTarget, Recipient};
use crate::metrics;
use courier_proto::cluster::{broker_message, BrokerMessage, HeldJob, HeldQuery, PushJob};
use courier_proto::domain::{
    ActivatedJob, ActivationProps, Lease, LinkId, NodeId, PartitionId, StreamId,
};
use courier_proto::sync::lock;
use dashmap::DashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// How long a gateway has to answer a push; after that the push counts as delivered
/// to nobody we know of, and the activation deadline recovers the job.
pub const PUSH_ACK_TIMEOUT: Duration = Duration::from_secs(5);
/// Messages queued toward one gateway before pushes to it are refused.
pub const LINK_QUEUE: usize = 8192;
/// Gateways whose last hello is remembered (see [`JobStreamRegistry::hello`]) before
/// those not linked are forgotten.
const MAX_GATEWAYS_REMEMBERED: usize = 1024;

/// Refusal reason of the pushes a gateway that left gracefully never answered.
pub const GATEWAY_LEFT: &str = "gateway_left";

/// How a push ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PushOutcome {
    /// A client of the stream took the job.
    Accepted,
    /// The gateway could not place it (reason from the gateway, or "link_busy",
    /// "link_gone" when it never left this broker): another recipient may take it.
    Refused(String),
    /// Sent, but no answer came (the link broke or the ack timed out): the job may be
    /// with a worker, so it must not be pushed again; its deadline recovers it.
    Unknown,
}

/// One gateway link as the broker sees it.
pub struct Link {
    pub id: LinkId,
    /// The gateway's id from its hello, for logs.
    pub gateway: std::sync::Mutex<String>,
    tx: mpsc::Sender<BrokerMessage>,
    pending: DashMap<u64, oneshot::Sender<PushOutcome>>,
    next_push: AtomicU64,
    /// `HeldQuery`s waiting for the gateway's answer, by query id.
    queries: DashMap<u64, oneshot::Sender<Vec<HeldJob>>>,
    next_query: AtomicU64,
}

impl Link {
    /// Queues a job for `stream_id` on this gateway now, without waiting: the send is
    /// on the job path, the answer is not. Refused when the link is full or gone.
    pub fn send_push(
        self: &Arc<Self>,
        stream_id: StreamId,
        partition: PartitionId,
        lease: Lease,
        job: ActivatedJob,
    ) -> Result<SentPush, PushOutcome> {
        let push_id = self.next_push.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.pending.insert(push_id, tx);
        let msg = BrokerMessage {
            kind: Some(broker_message::Kind::Push(PushJob {
                push_id,
                stream_id: stream_id.0,
                partition_id: partition.0,
                lease: lease.0,
                job: Some(job.into()),
            })),
        };
        match self.tx.try_send(msg) {
            Ok(()) => Ok(SentPush {
                link: self.clone(),
                push_id,
                rx,
            }),
            Err(e) => {
                self.pending.remove(&push_id);
                Err(PushOutcome::Refused(
                    match e {
                        mpsc::error::TrySendError::Full(_) => "link_busy",
                        mpsc::error::TrySendError::Closed(_) => "link_gone",
                    }
                    .to_string(),
                ))
            }
        }
    }

    /// Whether the queue towards the gateway is full: it has stopped reading.
    pub fn is_full(&self) -> bool {
        self.tx.capacity() == 0
    }

    /// The gateway answered push `push_id`.
    pub fn acked(&self, push_id: u64, accepted: bool, reason: String) {
        if let Some((_, tx)) = self.pending.remove(&push_id) {
            let _ = tx.send(if accepted {
                PushOutcome::Accepted
            } else {
                PushOutcome::Refused(reason)
            });
        }
    }

    /// Asks the gateway which of these activations (key, lease) of `partition` it
    /// holds. The answer, or `None` when the link ends or the question cannot be
    /// queued; a gateway that never answers keeps the returned future waiting, so
    /// callers bound it (dropping it forgets the question).
    pub fn query_held(
        self: &Arc<Self>,
        partition: PartitionId,
        jobs: Vec<HeldJob>,
    ) -> impl std::future::Future<Output = Option<Vec<HeldJob>>> {
        let query_id = self.next_query.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.queries.insert(query_id, tx);
        let asked = Asked {
            link: self.clone(),
            query_id,
        };
        let sent = self.send(BrokerMessage {
            kind: Some(broker_message::Kind::HeldQuery(HeldQuery {
                query_id,
                partition_id: partition.0,
                jobs,
            })),
        });
        async move {
            let _asked = asked;
            if !sent {
                return None;
            }
            rx.await.ok()
        }
    }

    /// The gateway answered `HeldQuery` `query_id`; unknown ids are ignored.
    pub fn answered(&self, query_id: u64, held: Vec<HeldJob>) {
        if let Some((_, tx)) = self.queries.remove(&query_id) {
            let _ = tx.send(held);
        }
    }

    /// Whether the gateway at the other end said `id` in its hello.
    pub fn is_gateway(&self, id: &str) -> bool {
        *lock(&self.gateway) == id
    }

    /// The id the gateway at the other end gave in its hello ("" before it).
    pub fn gateway_id(&self) -> String {
        lock(&self.gateway).clone()
    }

    /// Queues a message toward the gateway; false when the link is gone or full.
    pub fn send(&self, msg: BrokerMessage) -> bool {
        self.tx.try_send(msg).is_ok()
    }
}

/// A `HeldQuery` waiting for its answer; dropped, it is forgotten.
struct Asked {
    link: Arc<Link>,
    query_id: u64,
}

impl Drop for Asked {
    fn drop(&mut self) {
        self.link.queries.remove(&self.query_id);
    }
}

/// A push on its way to a gateway, waiting for the gateway's answer.
pub struct SentPush {
    link: Arc<Link>,
    push_id: u64,
    rx: oneshot::Receiver<PushOutcome>,
}

impl SentPush {
    /// The gateway's answer, or [`PushOutcome::Unknown`] when none comes in time.
    pub async fn outcome(self) -> PushOutcome {
        match tokio::time::timeout(PUSH_ACK_TIMEOUT, self.rx).await {
            Ok(Ok(outcome)) => outcome,
            // The link ended (pending dropped) or no answer in time.
            Ok(Err(_)) | Err(_) => {
                self.link.pending.remove(&self.push_id);
                PushOutcome::Unknown
            }
        }
    }
}

/// One logical stream: equal activation properties, held by one or more gateways.
struct Logical {
    props: ActivationProps,
    recipients: Vec<Recipient>,
}

impl Logical {
    /// Whether it takes jobs of `tenant`.
    fn takes(&self, tenant: &str) -> bool {
        self.props.tenant_ids.iter().any(|t| t == tenant)
    }
}

/// The logical streams of one job type, found by their properties in one step, so
/// registering and unregistering cost the same however many there are.
#[derive(Default)]
struct TypeStreams {
    logicals: Vec<Logical>,
    /// Properties -> position in `logicals`.
    index: std::collections::HashMap<ActivationProps, usize>,
}

impl TypeStreams {
    fn get(&self, props: &ActivationProps) -> Option<&Logical> {
        self.index.get(props).map(|&i| &self.logicals[i])
    }

    /// Adds `r` to the logical stream of `props`, making it if it is the first.
    fn add(&mut self, props: ActivationProps, r: Recipient) {
        match self.index.get(&props) {
            Some(&i) => {
                let l = &mut self.logicals[i];
                if !l.recipients.contains(&r) {
                    l.recipients.push(r);
                }
            }
            None => {
                self.index.insert(props.clone(), self.logicals.len());
                self.logicals.push(Logical {
                    props,
                    recipients: vec![r],
                });
            }
        }
    }

    /// Takes `r` from the logical stream of `props`; the stream goes with its last.
    fn remove(&mut self, props: &ActivationProps, r: &Recipient) {
        let Some(&i) = self.index.get(props) else {
            return;
        };
        self.logicals[i].recipients.retain(|x| x != r);
        if !self.logicals[i].recipients.is_empty() {
            return;
        }
        self.index.remove(props);
        self.logicals.swap_remove(i);
        if let Some(moved) = self.logicals.get(i) {
            self.index.insert(moved.props.clone(), i);
        }
    }

    /// Keeps the recipients `keep` says, and the logical streams left with any.
    fn retain(&mut self, keep: impl Fn(&Recipient) -> bool) {
        for l in &mut self.logicals {
            l.recipients.retain(&keep);
        }
        self.logicals.retain(|l| !l.recipients.is_empty());
        self.index = self
            .logicals
            .iter()
            .enumerate()
            .map(|(i, l)| (l.props.clone(), i))
            .collect();
    }
}

/// What this broker knows of a recipient's credit. The gateway reports this
/// broker's `share` of the stream's free credit with the number of pushes it had
/// `received` from us; we count what we `sent` (reserved) since the link opened.
#[derive(Default, Clone, Copy, Debug, PartialEq, Eq)]
struct Credit {
    share: u64,
    received: u64,
    sent: u64,
}

impl Credit {
    /// Pushes this broker may still send: its share less what is on the way.
    fn available(&self) -> u64 {
        self.share
            .saturating_sub(self.sent.saturating_sub(self.received))
    }
}

/// The registry. See the module doc.
#[derive(Default)]
pub struct JobStreamRegistry {
    /// job type -> logical streams of that type.
    streams: DashMap<String, TypeStreams>,
    /// Each registered recipient's properties.
    registered: DashMap<Recipient, ActivationProps>,
    /// Credit per recipient; a recipient without a report has none.
    credits: DashMap<Recipient, Credit>,
    links: DashMap<LinkId, Arc<Link>>,
    next_link: AtomicU64,
    /// Gateway hellos heard so far, and the number of each gateway's last one.
    hellos: AtomicU64,
    last_hello: DashMap<String, u64>,
    /// Gateways that said they stop gracefully (see [`JobStreamRegistry::left`]).
    left: DashMap<String, ()>,
    /// Rotates the choice among logical streams and recipients, per lookup.
    turn: AtomicUsize,
    /// This broker's `courier_broker_registered_streams` (none in unit tests).
    gauge: Option<prometheus::IntGauge>,
    /// Held while the gauge is counted and set (see [`Self::update_gauge`]).
    gauge_lock: std::sync::Mutex<()>,
}

impl JobStreamRegistry {
    /// The registry of broker `node`, which keeps that broker's
    /// `courier_broker_registered_streams` current.
    pub fn for_node(node: NodeId) -> JobStreamRegistry {
        JobStreamRegistry {
            gauge: Some(metrics::STREAMS.with_label_values(&[&node.to_string()])),
            ..JobStreamRegistry::default()
        }
    }

    /// A new link; its messages toward the gateway come out of the returned receiver.
    pub fn add_link(&self) -> (Arc<Link>, mpsc::Receiver<BrokerMessage>) {
        let (tx, rx) = mpsc::channel(LINK_QUEUE);
        let id = LinkId(self.next_link.fetch_add(1, Ordering::Relaxed) + 1);
        let link = Arc::new(Link {
            id,
            gateway: std::sync::Mutex::new(String::new()),
            tx,
            pending: DashMap::new(),
            next_push: AtomicU64::new(1),
            queries: DashMap::new(),
            next_query: AtomicU64::new(1),
        });
        self.links.insert(id, link.clone());
        (link, rx)
    }

    /// The link ended: every stream it registered goes, and pushes waiting for its
    /// answer end as [`PushOutcome::Unknown`].
    /// A gateway that said it leaves ([`Self::leaving`]) had no client left: the
    /// pushes it never answered reached none, and end as refused ("gateway_left"),
    /// to be tried elsewhere or yielded, not left to their deadlines.
    pub fn remove_link(&self, id: LinkId) {
        if let Some((_, link)) = self.links.remove(&id) {
            if self.left(&link.gateway_id()) {
                let unanswered: Vec<u64> = link.pending.iter().map(|e| *e.key()).collect();
                for push_id in unanswered {
                    link.acked(push_id, false, GATEWAY_LEFT.to_string());
                }
            }
            link.pending.clear();
            link.queries.clear();
        }
        self.credits.retain(|r, _| r.link != id);
        self.registered.retain(|r, _| r.link != id);
        self.streams.retain(|_, streams| {
            streams.retain(|r| r.link != id);
            !streams.logicals.is_empty()
        });
        self.update_gauge();
    }

    /// The streams registered for jobs of `job_type` and `tenant`, counted by the
    /// id of the gateway that holds them.
    pub fn streams_by_gateway(
        &self,
        job_type: &str,
        tenant: &str,
    ) -> std::collections::BTreeMap<String, u32> {
        let mut out = std::collections::BTreeMap::new();
        let Some(streams) = self.streams.get(job_type) else {
            return out;
        };
        for l in streams.logicals.iter().filter(|l| l.takes(tenant)) {
            for r in &l.recipients {
                let gateway = self
                    .link(r.link)
                    .map(|l| l.gateway_id())
                    .unwrap_or_default();
                *out.entry(gateway).or_insert(0) += 1;
            }
        }
        out
    }

    pub fn link(&self, id: LinkId) -> Option<Arc<Link>> {
        self.links.get(&id).map(|l| l.clone())
    }

    /// Queues a push to `r` on its link now. A push that could not be queued (the
    /// link is full or gone) gives back the credit it held: the gateway never counts
    /// it as received, so that credit would otherwise be lost until the link ends.
    /// `None` when `r`'s link is gone.
    pub fn send_push(
        &self,
        r: &Recipient,
        partition: PartitionId,
        lease: Lease,
        job: ActivatedJob,
    ) -> Option<Result<SentPush, PushOutcome>> {
        let sent = self
            .link(r.link)?
            .send_push(r.stream_id, partition, lease, job);
        if sent.is_err() {
            self.refund(r, 1);
        }
        Some(sent)
    }

    /// The gateway at the other end of `link` said hello with its id.
    pub fn hello(&self, link: &Link, gateway: String) {
        let n = self.hellos.fetch_add(1, Ordering::Relaxed) + 1;
        if self.last_hello.len() >= MAX_GATEWAYS_REMEMBERED {
            // Gateways are ids per process: forget those that are not linked.
            let linked: std::collections::HashSet<String> =
                self.links.iter().map(|l| l.gateway_id()).collect();
            self.last_hello.retain(|g, _| linked.contains(g));
        }
        self.last_hello.insert(gateway.clone(), n);
        *lock(&link.gateway) = gateway;
    }

    /// The gateway of `link` stops gracefully: its clients are gone, and what they
    /// had not received came back before this. The jobs still handed out through it
    /// are with its clients' workers, which may finish them through another
    /// gateway: they are not reclaimed after the lost-gateway grace, here or by a
    /// later leader on this broker.
    pub fn leaving(&self, link: &Link) {
        let gateway = link.gateway_id();
        if gateway.is_empty() {
            return;
        }
        if self.left.len() >= MAX_GATEWAYS_REMEMBERED {
            self.left.clear();
        }
        self.left.insert(gateway, ());
    }

    /// Whether `gateway` said it stops gracefully (see [`Self::leaving`]).
    pub fn left(&self, gateway: &str) -> bool {
        self.left.contains_key(gateway)
    }

    /// Gateway hellos heard so far: a mark to compare [`Self::said_hello_since`] with.
    pub fn hellos(&self) -> u64 {
        self.hellos.load(Ordering::Relaxed)
    }

    /// Whether `gateway` said hello after the `mark`-th hello.
    pub fn said_hello_since(&self, gateway: &str, mark: u64) -> bool {
        self.last_hello.get(gateway).is_some_and(|n| *n > mark)
    }

    /// The id the gateway of link `id` gave in its hello ("" before it).
    fn gateway_of(&self, id: LinkId) -> String {
        self.links
            .get(&id)
            .map(|l| l.gateway_id())
            .unwrap_or_default()
    }

    /// The open link of the gateway that said `gateway` in its hello, if any.
    pub fn link_of_gateway(&self, gateway: &str) -> Option<Arc<Link>> {
        if gateway.is_empty() {
            return None;
        }
        self.links
            .iter()
            .find(|l| l.is_gateway(gateway))
            .map(|l| l.clone())
    }

    /// Every open link, e.g. to announce jobs to all gateways.
    pub fn links(&self) -> Vec<Arc<Link>> {
        self.links.iter().map(|l| l.clone()).collect()
    }

    /// A gateway's aggregated stream can take jobs.
    pub fn register(&self, link: LinkId, stream_id: StreamId, props: ActivationProps) {
        let recipient = Recipient { link, stream_id };
        // A stream id registered again with other properties leaves its old stream.
        if let Some(old) = self.registered.insert(recipient.clone(), props.clone()) {
            if old != props {
                self.remove_recipient(&old, &recipient);
            }
        }
        self.streams
            .entry(props.job_type.clone())
            .or_default()
            .add(props, recipient);
        self.update_gauge();
    }

    pub fn unregister(&self, link: LinkId, stream_id: StreamId) {
        let gone = Recipient { link, stream_id };
        self.credits.remove(&gone);
        if let Some((_, props)) = self.registered.remove(&gone) {
            self.remove_recipient(&props, &gone);
        }
        self.update_gauge();
    }

    /// Takes `r` from the logical stream of `props`, and the type's entry with its
    /// last stream.
    fn remove_recipient(&self, props: &ActivationProps, r: &Recipient) {
        let empty = self.streams.get_mut(&props.job_type).is_some_and(|mut s| {
            s.remove(props, r);
            s.logicals.is_empty()
        });
        if empty {
            self.streams
                .remove_if(&props.job_type, |_, s| s.logicals.is_empty());
        }
    }

    /// A stream with free credit for jobs of this type and tenant, if any: the
    /// recipients with credit in turn (see [`Self::in_turn`]), holding up to `max` of
    /// its credit for the command. What the command does not use goes back with
    /// [`Self::refund`]. No credit anywhere: `None`, and the jobs wait in the backlog.
    pub fn lookup(&self, job_type: &str, tenant: &str, max: u32) -> Option<PushTarget> {
        let streams = self.streams.get(job_type)?;
        let (l, r) = self.in_turn(&streams.logicals, Some(tenant))?;
        let held = self.hold(r, max)?;
        Some(PushTarget {
            props: l.props.clone(),
            recipient: r.clone(),
            max: held,
            gateway: self.gateway_of(r.link),
        })
    }

    /// Like [`Self::lookup`], for exactly these properties (back-fill).
    pub fn target_for(&self, props: &ActivationProps, max: u32) -> Option<PushTarget> {
        let streams = self.streams.get(&props.job_type)?;
        let l = streams.get(props)?;
        let (_, r) = self.in_turn(std::slice::from_ref(l), None)?;
        let held = self.hold(r, max)?;
        Some(PushTarget {
            props: props.clone(),
            recipient: r.clone(),
            max: held,
            gateway: self.gateway_of(r.link),
        })
    }

    /// The recipients of `logicals` that take `tenant`'s jobs (any, for `None`) and have available
    /// credit take turns, whatever their credit: the one with the most would win
    /// every light-load push, and workers that state a smaller credit (another
    /// `maxJobsActive`) would get nothing. Under load a recipient whose credit is
    /// used up drops out until it frees some. The search starts where the turn
    /// points and takes the first with credit, so it costs one step while streams
    /// have credit, however many there are.
    fn in_turn<'a>(
        &self,
        logicals: &'a [Logical],
        tenant: Option<&str>,
    ) -> Option<(&'a Logical, &'a Recipient)> {
        let n = logicals.len();
        let turn = self.turn.fetch_add(1, Ordering::Relaxed);
        (0..n)
            .map(|i| &logicals[turn.wrapping_add(i) % n])
            .filter(|l| tenant.is_none_or(|t| l.takes(t)))
            .find_map(|l| {
                let k = l.recipients.len();
                (0..k)
                    .map(|j| &l.recipients[(turn / n).wrapping_add(j) % k])
                    .find(|r| self.available(r) > 0)
                    .map(|r| (l, r))
            })
    }

    /// Credit of `r` that pushes may take now: none while its link's queue is full
    /// (the gateway is not reading; a push would be refused as `link_busy` and its
    /// credit given back, so choosing it again would only go round that loop).
    fn available(&self, r: &Recipient) -> u64 {
        if self.links.get(&r.link).is_some_and(|l| l.is_full()) {
            return 0;
        }
        self.credits.get(r).map_or(0, |c| c.available())
    }

    /// Takes up to `max` of the recipient's credit; `None` when it has none.
    fn hold(&self, r: &Recipient, max: u32) -> Option<u32> {
        let mut c = self.credits.get_mut(r)?;
        let n = c.available().min(u64::from(max));
        if n == 0 {
            return None;
        }
        c.sent += n;
        Some(n as u32)
    }

    /// Takes one credit of `r` for a push to it (try-next); false when it has none.
    pub fn take_one(&self, r: &Recipient) -> bool {
        self.hold(r, 1).is_some()
    }

    /// Gives back credit held for pushes that were not made.
    pub fn refund(&self, r: &Recipient, n: u64) {
        if let Some(mut c) = self.credits.get_mut(r) {
            c.sent = c.sent.saturating_sub(n);
        }
    }

    /// A gateway reported a stream's credit. True when this broker may now push more
    /// than before: jobs that waited for credit can be back-filled. (Any increase, not
    /// only from none: jobs can wait while a little credit is left, when a command
    /// needed more than there was.)
    pub fn report_credit(
        &self,
        link: LinkId,
        stream_id: StreamId,
        share: u64,
        received: u64,
    ) -> bool {
        let r = Recipient { link, stream_id };
        let mut c = self.credits.entry(r).or_default();
        let before = c.available();
        c.share = share;
        // Reports can overtake nothing on one link, but be safe with stale ones.
        c.received = c.received.max(received);
        c.available() > before
    }

    /// The properties of every logical stream that takes jobs of this type and tenant
    /// and has a recipient with credit: the streams a back-fill could push to now.
    pub fn streams_with_room(&self, job_type: &str, tenant: &str) -> Vec<ActivationProps> {
        let Some(streams) = self.streams.get(job_type) else {
            return Vec::new();
        };
        // Collected, so the map's guard is gone before a back-fill takes credit.
        streams
            .logicals
            .iter()
            .filter(|l| l.takes(tenant))
            .filter(|l| l.recipients.iter().any(|r| self.available(r) > 0))
            .map(|l| l.props.clone())
            .collect()
    }

    /// Every recipient of the logical stream with these properties, starting after
    /// `first`: the order in which a refused push tries the others.
    pub fn others(&self, props: &ActivationProps, first: &Recipient) -> Vec<Recipient> {
        let Some(streams) = self.streams.get(&props.job_type) else {
            return Vec::new();
        };
        let Some(l) = streams.get(props) else {
            return Vec::new();
        };
        let start = l
            .recipients
            .iter()
            .position(|r| r == first)
            .map_or(0, |i| i + 1);
        (0..l.recipients.len())
            .map(|i| l.recipients[(start + i) % l.recipients.len()].clone())
            .filter(|r| r != first)
            .collect()
    }

    /// The properties of a gateway's stream, if registered.
    pub fn props_of(&self, link: LinkId, stream_id: StreamId) -> Option<ActivationProps> {
        let r = Recipient { link, stream_id };
        self.registered.get(&r).map(|p| p.clone())
    }

    /// Every registered logical stream's properties, e.g. to back-fill after a
    /// partition gains its leader.
    pub fn all_props(&self) -> Vec<ActivationProps> {
        self.streams
            .iter()
            .flat_map(|e| {
                e.value()
                    .logicals
                    .iter()
                    .map(|l| l.props.clone())
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Counts the registered streams into the gauge. Counting and setting happen
    /// under one lock: two gateways registering at once each counted, and the one
    /// that counted first could set its smaller count last (a test saw 5 of 6).
    fn update_gauge(&self) {
        let Some(gauge) = &self.gauge else { return };
        let _counting = self
            .gauge_lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = self.registered.len();
        gauge.set(i64::try_from(n).unwrap_or(i64::MAX));
    }
}

#[cfg(test)]
mod tests;
