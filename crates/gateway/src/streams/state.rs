//! The state under the registry's lock: demand, held jobs, spare rooms, the
//! hand-off of pushed jobs to clients, credit reports and yields.

use super::*;

impl State {
    /// Ages the brokers' demand for each stream's credit: while a stream has no
    /// free credit no broker can push, so its demand is kept as it is, and so is
    /// that of a broker told of none (its jobs wait for credit the split gives
    /// others); otherwise a broker that has neither announced nor pushed jobs of
    /// the stream for [`DEMAND_WINDOW`] has none left, and the stream is re-split
    /// without it.
    pub(super) fn age_demand(&mut self, now: Instant) {
        let State {
            streams,
            dirty,
            links,
            demanded,
            ..
        } = self;
        demanded.retain(|id| streams.get(id).is_some_and(|s| !s.wanted.is_empty()));
        for &id in demanded.iter() {
            let Some(s) = streams.get_mut(&id) else {
                continue;
            };
            if free_of(s) == 0 {
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
    pub(super) fn yield_waited_spare(&mut self, now: Instant) {
        let State {
            streams,
            with_spare,
            ..
        } = self;
        with_spare.retain(|id| streams.get(id).is_some_and(|s| !s.spare.is_empty()));
        let waited: Vec<StreamId> = self
            .with_spare
            .iter()
            .filter_map(|id| self.streams.get_key_value(id))
            .filter(|(_, s)| {
                s.spare.iter().find_map(|b| {
                    self.held
                        .get(&b.key())
                        .filter(|h| h.holder == Holder::Spare && h.lease == Some(b.lease))
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
                if self.holds(b.key(), Holder::Spare, b.lease) {
                    self.release(b.key());
                    self.yield_job(b, SPARE_WAITED);
                }
            }
            self.dirty.insert(id);
        }
    }

    /// Takes a pushed job: counts it as received on its link, checks the gateway's
    /// bounds, hands it to a client and holds its credit.
    pub(super) fn accept(
        &mut self,
        node: NodeId,
        conn: u64,
        stream_id: StreamId,
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
        let key = b.key();
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
        let holder = match self.offer(stream_id, b) {
            Ok(client_id) => Holder::Client(client_id),
            Err((b, reason)) => {
                // No client has credit: the spare room takes it, if there is room.
                if reason == CLIENTS_FULL && self.put_spare(stream_id, b).is_ok() {
                    Holder::Spare
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
                holder,
                lease: Some(lease),
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
    pub(super) fn adopt(
        &mut self,
        stream_id: StreamId,
        client_id: ClientId,
        jobs: &[(JobKey, i64)],
    ) -> u32 {
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
                Some(h) if matches!(h.holder, Holder::Client(c) if !self.clients.contains_key(&c)) =>
                {
                    // Its old stream's gauges let it go with the client that left.
                    h.stream_id = stream_id;
                    h.holder = Holder::Client(client_id);
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
                            holder: Holder::Client(client_id),
                            // No activation lease known: a broker's notice that
                            // an activation ended does not name this one, a
                            // finish through here or the deadline ends it.
                            lease: None,
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
        self.recount(client_id);
        adopted
    }

    /// Whether job `key`'s activation `lease` is held by `holder`. False once that
    /// activation ended here.
    pub(super) fn holds(&self, key: JobKey, holder: Holder, lease: Lease) -> bool {
        self.held
            .get(&key)
            .is_some_and(|h| h.holder == holder && h.lease == Some(lease))
    }

    /// Moves a held job that no client can take now into its stream's spare room; when
    /// there is no room (or no client), releases it and yields it to its broker.
    /// True when kept.
    pub(super) fn keep_spare(
        &mut self,
        stream_id: StreamId,
        key: JobKey,
        b: Buffered,
        reason: &'static str,
    ) -> bool {
        match self.put_spare(stream_id, b) {
            Ok(()) => {
                if let Some(h) = self.held.get_mut(&key) {
                    h.holder = Holder::Spare;
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
    pub(super) fn put_spare(&mut self, stream_id: StreamId, b: Buffered) -> Result<(), Buffered> {
        match self
            .streams
            .get_mut(&stream_id)
            .filter(|s| s.members > 0 && !s.spare_paused && s.spare_fits())
        {
            Some(s) => {
                if s.spare.is_empty() {
                    // A stream with spare jobs is in the set until a sweep finds none.
                    self.with_spare.insert(stream_id);
                }
                s.spare.push_back(b);
                s.spared += 1;
                metrics::spare_jobs(1);
                Ok(())
            }
            None => Err(b),
        }
    }

    /// Hands the stream's spare jobs, oldest first, to clients with free credit.
    pub(super) fn drain_spare(&mut self, stream_id: StreamId) {
        loop {
            let Some(b) = self
                .streams
                .get_mut(&stream_id)
                .and_then(|s| s.spare.pop_front())
            else {
                return;
            };
            let (key, lease) = (b.key(), b.lease);
            if !self.holds(key, Holder::Spare, lease) {
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
                        h.holder = Holder::Client(to);
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
    pub(super) fn offer(
        &mut self,
        stream_id: StreamId,
        job: Buffered,
    ) -> Result<ClientId, (Buffered, &'static str)> {
        let Some(stream) = self.streams.get_mut(&stream_id) else {
            return Err((job, UNKNOWN_STREAM));
        };
        if stream.members == 0 {
            return Err((job, NO_CLIENT));
        }
        // Round-robin over the clients that have credit: each client in turn, one
        // that cannot take a job is skipped (issue: round-robin, never random).
        let Some(client_id) = stream
            .ready
            .range((Bound::Excluded(stream.last), Bound::Unbounded))
            .next()
            .or_else(|| stream.ready.first())
            .copied()
        else {
            return Err((job, CLIENTS_FULL));
        };
        let Some(client) = self.clients.get_mut(&client_id) else {
            return Err((job, CLIENTS_FULL));
        };
        // Cannot fail: a ready client had room in its buffer when counted (only we
        // send, under this lock), and its receiver lives while it is listed.
        if let Err(e) = client.tx.try_send(job) {
            tracing::warn!(%client_id, "a client with credit could not take a job");
            metrics::push_try_next();
            return Err((e.into_inner(), CLIENTS_FULL));
        }
        client.held += 1;
        stream.last = client_id;
        stream.gauges.add(1, -1);
        self.recount(client_id);
        Ok(client_id)
    }

    /// Counts client `client_id`'s free credit anew into its stream's sum and ready
    /// set, after its holds or its buffer changed. True when it grew.
    pub(super) fn recount(&mut self, client_id: ClientId) -> bool {
        let Some(c) = self.clients.get_mut(&client_id) else {
            return false;
        };
        let free = c.free();
        let old = std::mem::replace(&mut c.counted, free);
        let Some(s) = self.streams.get_mut(&c.stream_id) else {
            return false;
        };
        s.free = (s.free + u64::from(free)).saturating_sub(u64::from(old));
        if free > 0 {
            s.ready.insert(client_id);
        } else {
            s.ready.remove(&client_id);
        }
        free > old
    }

    /// Ends the hold on job `key`, if any: its client (if still there) and the gateway
    /// get the credit back.
    pub(super) fn release(&mut self, key: JobKey) {
        let Some(h) = self.held.remove(&key) else {
            return;
        };
        self.deadlines.remove(&(h.deadline, key));
        self.inflight_bytes -= h.bytes;
        metrics::inflight(-1, -i64::try_from(h.bytes).unwrap_or(i64::MAX));
        self.full = false;
        if h.holder == Holder::Spare {
            if let Some(s) = self.streams.get_mut(&h.stream_id) {
                s.spared = s.spared.saturating_sub(1);
            }
            metrics::spare_jobs(-1);
            self.dirty.insert(h.stream_id);
        } else if let Some((id, c)) = match h.holder {
            Holder::Client(id) => self.clients.get_mut(&id).map(|c| (id, c)),
            Holder::Spare => None,
        } {
            c.held = c.held.saturating_sub(1);
            if let Some(s) = self.streams.get(&h.stream_id) {
                s.gauges.add(-1, 1);
            }
            self.recount(id);
            self.dirty.insert(h.stream_id);
            self.drain_spare(h.stream_id);
        }
        // Their reports were bounded by the gateway's headroom, which just grew.
        self.dirty.extend(self.capped.iter().copied());
    }

    pub(super) fn mark_all_dirty(&mut self) {
        self.dirty.extend(self.streams.keys().copied());
    }

    /// Recomputes the credit reports of `ids` and sends each link those that changed.
    pub(super) fn report(&mut self, ids: &[StreamId]) {
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
            let mut sum = stream.free;
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
                        stream_id: id.0,
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
    pub(super) fn yield_job(&mut self, b: Buffered, reason: &'static str) {
        let msg = GatewayMessage {
            kind: Some(gateway_message::Kind::YieldJob(YieldJob {
                partition_id: b.partition,
                key: b.job.key,
                lease: b.lease.0,
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
    pub(super) fn broadcast(&mut self, msg: &GatewayMessage, kind: &'static str) {
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
    pub(super) fn break_link(&mut self, node: NodeId, kind: &'static str) {
        metrics::link_message_dropped(kind);
        if let Some(link) = self.links.remove(&node) {
            tracing::warn!(node, kind, "broker link queue full or closed; resetting it");
            link.broken.cancel();
            // The remaining links' shares grow.
            self.mark_all_dirty();
        }
    }
}

/// The gateway-clock instant of an activation deadline (epoch ms); a push without
/// one holds its credit for the stream's activation timeout.
pub(super) fn deadline_instant(deadline_ms: i64, timeout_ms: i64) -> Instant {
    if deadline_ms <= 0 {
        return instant_in(timeout_ms);
    }
    instant_in(deadline_ms.saturating_sub(courier_proto::domain::epoch_ms()))
}

/// `ms` from now; now if negative.
pub(super) fn instant_in(ms: i64) -> Instant {
    let d = Duration::from_millis(u64::try_from(ms).unwrap_or(0)).min(MAX_HOLD);
    Instant::now() + d
}
