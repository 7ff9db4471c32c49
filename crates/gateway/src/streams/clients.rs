//! The clients' side: a client leaving, a client taking a job from its buffer, and
//! the stream a client reads its jobs from.

use super::*;

impl AggregatedStreams {
    /// Removes a client; its buffered jobs go to the stream's other clients or back to
    /// the brokers that pushed them. Jobs it was already given stay counted against
    /// the gateway until they finish, since its worker may still be running them.
    pub(super) fn leave(
        &self,
        stream_id: StreamId,
        client_id: ClientId,
        rx: &mut mpsc::Receiver<Buffered>,
    ) {
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
        stream.ready.remove(&client_id);
        stream.free = stream.free.saturating_sub(u64::from(client.counted));
        stream.members = stream.members.saturating_sub(1);
        let left = stream.members;
        metrics::stream_clients(-1);
        // Dropping its sender (the only one) means the buffer below is all there is.
        drop(client);
        rx.close();
        let (mut moved, mut yielded, mut stale) = (0usize, 0usize, 0usize);
        while let Ok(b) = rx.try_recv() {
            let key = b.key();
            // A job whose credit came back while buffered has finished or timed out:
            // nobody should run it.
            if !st.holds(key, Holder::Client(client_id), b.lease) {
                stale += 1;
                continue;
            }
            match st.offer(stream_id, b) {
                Ok(to) => {
                    if let Some(h) = st.held.get_mut(&key) {
                        h.holder = Holder::Client(to);
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
                let key = b.key();
                if st.holds(key, Holder::Spare, b.lease) {
                    yielded += 1;
                    st.release(key);
                    st.yield_job(b, NO_CLIENT);
                }
            }
        }
        metrics::stale_jobs_dropped(stale);
        tracing::debug!(
            %stream_id,
            %client_id,
            clients_left = left,
            moved,
            yielded,
            stale,
            "stream client left"
        );
        if left == 0 {
            if let Some(s) = st.streams.remove(&stream_id) {
                let job_type = &s.props.job_type;
                let last_of_type = st.by_type.get_mut(job_type).is_none_or(|ids| {
                    ids.remove(&stream_id);
                    ids.is_empty()
                });
                if last_of_type {
                    st.by_type.remove(job_type);
                    CreditGauges::forget(job_type);
                }
                st.by_props.remove(&PropsKey(s.props));
            }
            st.dirty.remove(&stream_id);
            st.capped.remove(&stream_id);
            st.demanded.remove(&stream_id);
            st.with_spare.remove(&stream_id);
            for link in st.links.values_mut() {
                link.streams.remove(&stream_id);
            }
            metrics::aggregated_streams(-1);
            let unregister = GatewayMessage {
                kind: Some(gateway_message::Kind::Unregister(UnregisterStream {
                    stream_id: stream_id.0,
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
    /// back, and running it would run it twice or after its end. When its buffer held
    /// its free credit down (jobs whose credit came back while buffered), the room
    /// made is credit to report, and to hand spare jobs to.
    pub(super) fn take(&self, stream_id: StreamId, client_id: ClientId, b: &Buffered) -> bool {
        let mut st = self.lock();
        let key = b.key();
        let current = st.holds(key, Holder::Client(client_id), b.lease);
        if !current {
            metrics::stale_jobs_dropped(1);
            tracing::debug!(
                job = %key,
                %client_id,
                "activation ended while buffered; dropped"
            );
        }
        if st.recount(client_id) && st.streams.contains_key(&stream_id) {
            st.dirty.insert(stream_id);
            st.drain_spare(stream_id);
            self.wake_if_dirty(&st);
        }
        current
    }
}

/// A completion, failure or thrown error on its way through this gateway: while it
/// lives, the job counts as held here for a broker that asks (a new leader must not
/// make it activatable while the command that ends it is being retried towards it).
#[must_use = "the job counts as finishing here only while this lives"]
pub struct Finishing {
    pub(super) streams: Arc<AggregatedStreams>,
    pub(super) key: JobKey,
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
    pub(super) streams: Arc<AggregatedStreams>,
    pub(super) stream_id: StreamId,
    pub(super) client_id: ClientId,
    pub(super) credit: u32,
    pub(super) rx: mpsc::Receiver<Buffered>,
}

impl ClientStream {
    /// The aggregated stream this client belongs to.
    pub fn stream_id(&self) -> StreamId {
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
            if self.streams.take(self.stream_id, self.client_id, &b) {
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
