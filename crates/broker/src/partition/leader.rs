//! What exists only while this replica leads: a [`LeaderState`] per term of
//! leadership, made when it starts and ended when it ends, with the tasks it owns.

use super::*;

/// A pushed job's holder on this leader: the link it went out on, the activation's lease.
pub(super) type Held = (LinkId, Lease);

/// The leader-only state of one term: nothing in it outlives the leadership, and
/// nothing outside it is leader-only. Its tasks (timers, yields, the majority
/// watch, recovery of earlier leaders' pushes, pushes awaiting their answer) stop
/// when it ends.
pub(super) struct LeaderState {
    pub term: u64,
    /// When this replica began to lead in `term`.
    pub since: tokio::time::Instant,
    /// Jobs this leader pushed, from the moment the push leaves until the end of
    /// their activation, so that end can free the credit on the gateway holding it.
    pub pushed: dashmap::DashMap<JobKey, Held>,
    /// Entries in `pushed`: raised and lowered with each insert and removal, so
    /// changes at once never leave it at a stale count.
    pushed_gauge: prometheus::IntGauge,
    /// Yields waiting for the next paced batch: (key, lease, deadline).
    pub yields: Mutex<Vec<(JobKey, Lease, i64)>>,
    pub yield_wake: Notify,
    /// Activations proposed and not yet finished.
    pub claims: Mutex<Claims>,
    /// Whether this leader has lost its majority (see [`MAJORITY_LOST_AFTER`]).
    majority_lost: AtomicBool,
    majority_gauge: prometheus::IntGauge,
    /// Cancelled when this leadership ends, or the broker stops.
    pub ended: CancellationToken,
}

impl LeaderState {
    fn new(p: &Partition, term: u64) -> LeaderState {
        let labels = [p.node_id.to_string(), p.id.to_string()];
        let labels = [labels[0].as_str(), labels[1].as_str()];
        LeaderState {
            term,
            since: tokio::time::Instant::now(),
            pushed: dashmap::DashMap::new(),
            pushed_gauge: metrics::PUSHED_HELD.with_label_values(&labels),
            yields: Mutex::new(Vec::new()),
            yield_wake: Notify::new(),
            claims: Mutex::new(Claims::default()),
            majority_lost: AtomicBool::new(false),
            majority_gauge: metrics::MAJORITY_LOST.with_label_values(&labels),
            ended: p.shutdown.child_token(),
        }
    }

    /// Records a push leaving for `held`.
    pub fn hold(&self, key: JobKey, held: Held) {
        if self.pushed.insert(key, held).is_none() {
            self.pushed_gauge.inc();
        }
    }

    /// Forgets the push of `key`, whatever its lease; returns its holder.
    pub fn unhold(&self, key: JobKey) -> Option<Held> {
        self.counted(self.pushed.remove(&key)).map(|(_, h)| h)
    }

    /// Forgets the push of `key` if it is of that activation.
    pub fn unhold_lease(&self, key: JobKey, lease: Lease) {
        self.counted(self.pushed.remove_if(&key, |_, (_, l)| *l == lease));
    }

    fn counted<T>(&self, removed: Option<T>) -> Option<T> {
        if removed.is_some() {
            self.pushed_gauge.dec();
        }
        removed
    }

    pub fn majority_lost(&self) -> bool {
        self.majority_lost.load(Ordering::Relaxed)
    }

    /// Whether this is still the leadership in force.
    pub fn current(&self) -> bool {
        !self.ended.is_cancelled()
    }

    /// Ends this leadership: its tasks stop; the ends of its activations are
    /// carried out by the next leader.
    fn end(&self) {
        self.ended.cancel();
        self.majority_gauge.set(0);
    }
}

impl Drop for LeaderState {
    fn drop(&mut self) {
        self.pushed_gauge.sub(self.pushed.len() as i64);
    }
}

impl Partition {
    /// This replica's leadership in force, if Raft says it leads: made here the
    /// first time it is asked for in a new term, so no command or effect of the
    /// term runs before it exists.
    pub(super) fn leader(self: &Arc<Self>) -> Option<Arc<LeaderState>> {
        let term = self.leading_term();
        {
            let current = read_lock(&self.leader);
            if let Some(l) = current.as_ref().filter(|l| Some(l.term) == term) {
                return Some(l.clone());
            }
            if term.is_none() && current.is_none() {
                return None;
            }
        }
        self.resync_leader()
    }

    /// Makes the leader state agree with Raft's role: ends a leadership that is
    /// over, and starts one (with its tasks) for a term this replica leads in.
    /// Called on every change of role or leader.
    pub fn sync_leadership(self: &Arc<Self>) {
        self.resync_leader();
    }

    fn resync_leader(self: &Arc<Self>) -> Option<Arc<LeaderState>> {
        let mut current = write_lock(&self.leader);
        let term = self.leading_term();
        if let Some(l) = current.as_ref().filter(|l| Some(l.term) == term) {
            return Some(l.clone());
        }
        if let Some(old) = current.take() {
            tracing::info!(term = old.term, "leadership ended");
            old.end();
        }
        let term = term.filter(|_| !self.shutdown.is_cancelled())?;
        let leader = Arc::new(LeaderState::new(self, term));
        *current = Some(leader.clone());
        drop(current);
        self.announce_leadership(term);
        self.start_leader_tasks(&leader);
        Some(leader)
    }

    /// Spawns a term's tasks; each stops when the leadership ends.
    fn start_leader_tasks(self: &Arc<Self>, l: &Arc<LeaderState>) {
        let span = tracing::info_span!("leader", partition = self.id.0, term = l.term);
        self.spawn_led(l, run_timers(self.clone()), &span);
        self.spawn_led(l, run_yields(self.clone(), l.clone()), &span);
        self.spawn_led(l, watch_majority(self.clone(), l.clone()), &span);
        let (p, term) = (self.clone(), l.term);
        let recover = async move {
            tokio::join!(
                async {
                    if caught_up_in(&p, term).await {
                        offer_backlog(&p);
                        reconcile_pushes(p.clone(), term).await;
                    }
                },
                reclaim_orphans(p.clone(), term),
            );
        };
        self.spawn_led(l, recover, &span);
    }

    /// Runs `task` on the broker's task tracker until `l` ends.
    pub(super) fn spawn_led<F>(&self, l: &LeaderState, task: F, span: &tracing::Span)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let ended = l.ended.clone();
        self.tasks.spawn(
            async move {
                tokio::select! {
                    _ = ended.cancelled() => {}
                    _ = task => {}
                }
            }
            .instrument(span.clone()),
        );
    }
}

/// Keeps the leader's [`LeaderState::majority_lost`] current: a leader of a
/// partition with more than one voter whose last acknowledgement by a majority is
/// older than [`MAJORITY_LOST_AFTER`]. (openraft 0.9's leader does not step down
/// by itself.)
pub(super) async fn watch_majority(p: Arc<Partition>, l: Arc<LeaderState>) {
    let mut every = tokio::time::interval(MAJORITY_CHECK_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let lost = {
            let m = p.raft.metrics();
            let m = m.borrow();
            m.state == ServerState::Leader
                && m.membership_config.membership().voter_ids().count() > 1
                && m.millis_since_quorum_ack
                    .is_some_and(|ms| Duration::from_millis(ms) > MAJORITY_LOST_AFTER)
        };
        if lost != l.majority_lost() {
            if lost {
                tracing::warn!("leading without a majority: refusing commands until it is back");
            } else {
                tracing::info!("majority back");
            }
            l.majority_lost.store(lost, Ordering::Relaxed);
            l.majority_gauge.set(i64::from(lost));
        }
    }
}
