//! The broker links' side of the registry: attaching and detaching links, the
//! flusher that sends credit reports, and the sweep of jobs past their deadline.

use super::*;

impl AggregatedStreams {
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
    pub(super) fn flush(&self) {
        let mut st = self.lock();
        let dirty: Vec<StreamId> = st.dirty.drain().collect();
        st.report(&dirty);
    }

    /// Releases the credit of every job whose deadline is at or before `now`.
    pub(super) fn sweep(&self, now: Instant) {
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
        let all: Vec<StreamId> = st.dirty.drain().collect();
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

    pub(super) fn detach_link(&self, node: NodeId, conn: u64) {
        let mut st = self.lock();
        if st.links.get(&node).is_some_and(|l| l.conn == conn) {
            st.links.remove(&node);
            // The remaining links' shares grow.
            st.mark_all_dirty();
            self.wake_if_dirty(&st);
        }
    }
}

pub(super) fn register(stream_id: StreamId, props: &ActivationProps) -> GatewayMessage {
    GatewayMessage {
        kind: Some(gateway_message::Kind::Register(RegisterStream {
            stream_id: stream_id.0,
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
        // Traced only where this gateway exports spans and the job carries a trace.
        let traced = push
            .job
            .as_ref()
            .filter(|_| courier_proto::trace::enabled())
            .and_then(|j| {
                let tp = courier_proto::trace::in_headers(&j.custom_headers)?;
                let span = tracing::info_span!("PushJob", job_key = j.key, stream = push.stream_id);
                courier_proto::trace::set_parent(&span, &tp);
                Some(span)
            });
        match traced {
            Some(span) => span.in_scope(|| self.streams.push(self.node, self.conn, push)),
            None => self.streams.push(self.node, self.conn, push),
        }
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
