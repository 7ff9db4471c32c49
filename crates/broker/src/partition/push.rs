//! Push delivery on the leader: choosing push targets before proposing, sending
//! activated jobs to gateways after apply, and yields and back-fills.

use super::*;
use courier_proto::sync::lock;

impl Partition {
    /// The streams that may take the jobs this command makes runnable: decided here,
    /// on the leader, and written into the command so every replica activates alike.
    pub(super) fn push_targets(&self, cmd: &Command) -> Vec<PushTarget> {
        match cmd.inner() {
            Command::Create(jobs) => {
                let mut wanted: BTreeMap<(&str, &str), u32> = BTreeMap::new();
                for j in jobs {
                    *wanted.entry((&j.job_type, &j.tenant_id)).or_default() += 1;
                }
                self.lookup_all(wanted)
            }
            Command::Fail {
                key,
                retries,
                retry_backoff_ms,
                ..
            } if *retries > 0 && *retry_backoff_ms <= 0 => self.targets_for_keys(&[*key]),
            Command::UpdateRetries { key, .. } => self.targets_for_keys(&[*key]),
            _ => Vec::new(),
        }
    }

    pub(super) fn lookup_all(&self, wanted: BTreeMap<(&str, &str), u32>) -> Vec<PushTarget> {
        wanted
            .into_iter()
            .filter_map(|((t, tenant), n)| self.registry.lookup(t, tenant, n))
            .collect()
    }

    /// Targets for jobs already in the state (fail, timers, retries updates).
    pub(super) fn targets_for_keys(&self, keys: &[JobKey]) -> Vec<PushTarget> {
        let applied = self.shared.read();
        let mut wanted: BTreeMap<(String, String), u32> = BTreeMap::new();
        for k in keys {
            if let Some(j) = applied.state.job(*k) {
                *wanted
                    .entry((j.job_type.clone(), j.tenant_id.clone()))
                    .or_default() += 1;
            }
        }
        drop(applied);
        wanted
            .into_iter()
            .filter_map(|((t, tenant), n)| self.registry.lookup(&t, &tenant, n))
            .collect()
    }
}

/// The push targets a command carries (credit held for it).
pub(super) fn targets_of(c: &LogCommand) -> &[PushTarget] {
    match c {
        LogCommand::Client { push, .. }
        | LogCommand::ClientIn { push, .. }
        | LogCommand::TimeOut { push, .. }
        | LogCommand::Recur { push, .. } => push,
        LogCommand::Backfill { target } => std::slice::from_ref(target),
        LogCommand::Yield { .. } => &[],
    }
}

/// Carries out the effects of an applied entry, on the leader only (only the
/// proposer gets them). `proposed` is when the entry was proposed; `ends_from`,
/// which gateway sent the entry's commands that end activations.
pub(super) fn carry_out(
    p: &Arc<Partition>,
    effects: Vec<Effect>,
    proposed: Instant,
    ends_from: &BTreeMap<JobKey, Arc<str>>,
) {
    // None once the leadership that proposed the entry is over: its pushes still
    // go out (the jobs are activated for them), and the next leader sees to the rest.
    let leader = p.leader();
    for e in effects {
        match e {
            Effect::JobsAvailable {
                job_type,
                tenant_id,
            } => {
                p.backfill_streams_of(&job_type, &tenant_id);
                p.announce(job_type, tenant_id);
            }
            Effect::Push(push) => {
                if push.origin == PushOrigin::Backfill {
                    metrics::BACKFILLED.inc();
                }
                let created = (push.origin == PushOrigin::Created).then_some(proposed);
                start_push(p, leader.as_ref(), *push, created);
            }
            Effect::Finished { key, lease } => {
                // Tell the gateway holding it, whichever gateway finished it. An
                // entry of an older activation goes too: the job has moved on.
                let held = leader
                    .as_ref()
                    .and_then(|l| l.unhold(key))
                    .filter(|(_, l)| *l == lease);
                if let Some((link, _)) = held {
                    let Some(link) = p.registry.link(link) else {
                        continue;
                    };
                    // The gateway that sent the command knows: it released the job's
                    // credit when the command came through it.
                    if ends_from.get(&key).is_some_and(|g| link.is_gateway(g)) {
                        metrics::FINISHED_NOTICES
                            .with_label_values(&[label::finished_notice::SENDER])
                            .inc();
                        continue;
                    }
                    metrics::FINISHED_NOTICES
                        .with_label_values(&[label::finished_notice::SENT])
                        .inc();
                    link.send(BrokerMessage {
                        kind: Some(broker_message::Kind::Finished(JobFinished {
                            key: key.0,
                            lease: lease.0,
                        })),
                    });
                }
            }
        }
    }
}

/// Sends a pushed job to its recipient now, on the job path, and leaves waiting for
/// the answer to a task of its own.
pub(super) fn start_push(
    p: &Arc<Partition>,
    leader: Option<&Arc<LeaderState>>,
    push: Push,
    created: Option<Instant>,
) {
    let Push {
        target, lease, job, ..
    } = push;
    // Recorded before the push leaves: the job may finish before its ack arrives,
    // and the end of its activation must find (and remove) the entry.
    if let Some(l) = leader {
        l.hold(job.key, (target.recipient.link, lease));
    }
    p.activations.add(&job.job_type, &job.tenant_id, 1);
    let sent = send_to(p, &target.recipient, true, lease, job.clone(), created);
    match leader {
        Some(l) => p.spawn_led(
            l,
            finish_push(p.clone(), l.clone(), target, lease, job, sent),
            &tracing::Span::current(),
        ),
        // No leadership to hold the job for or to yield it in: the answer is not
        // awaited, and the next leader reconciles the push.
        None => drop(sent),
    }
}

/// Queues `job` for `recipient`. The first recipient's credit was held when the
/// command was prepared; the others are tried only where credit is free. None when
/// the recipient cannot be tried at all.
pub(super) fn send_to(
    p: &Partition,
    recipient: &Recipient,
    first: bool,
    lease: Lease,
    job: ActivatedJob,
    created: Option<Instant>,
) -> Option<Result<SentPush, PushOutcome>> {
    if !first && !p.registry.take_one(recipient) {
        return None;
    }
    if !first {
        metrics::TRY_NEXT.inc();
    }
    let sent = p.registry.send_push(recipient, p.id, lease, job)?;
    if let (Ok(_), Some(t0)) = (&sent, created) {
        metrics::CREATE_TO_PUSH.observe(t0.elapsed().as_secs_f64());
    }
    Some(sent)
}

/// Waits for the answer to a push, then tries the other recipients of the same
/// logical stream while they refuse; when all refuse, yields the job back to the
/// log. A push that got no answer is never retried: it may be running, and its
/// activation deadline recovers it if not.
pub(super) async fn finish_push(
    p: Arc<Partition>,
    l: Arc<LeaderState>,
    target: PushTarget,
    lease: Lease,
    job: ActivatedJob,
    first: Option<Result<SentPush, PushOutcome>>,
) {
    let (key, deadline) = (job.key, job.deadline);
    let mut attempt = first;
    let mut others = None;
    loop {
        if let Some(sent) = attempt.take() {
            let outcome = match sent {
                Ok(sent) => sent.outcome().await,
                Err(refused) => refused,
            };
            match outcome {
                PushOutcome::Accepted => {
                    metrics::PUSHES
                        .with_label_values(&[label::push::ACCEPTED])
                        .inc();
                    return;
                }
                PushOutcome::Refused(reason) => {
                    tracing::debug!(job = key.0, reason, "push refused");
                    metrics::PUSHES
                        .with_label_values(&[&format!("refused_{reason}")])
                        .inc();
                    if reason == DISOWNED {
                        // A newer leader asked the gateway about this activation
                        // and has made the job runnable again: nothing to do here.
                        return;
                    }
                }
                PushOutcome::Unknown => {
                    // The entry stays: the gateway may hold the job, and is told
                    // when its activation ends.
                    metrics::PUSHES
                        .with_label_values(&[label::push::UNKNOWN])
                        .inc();
                    return;
                }
            }
        }
        let others = others.get_or_insert_with(|| {
            p.registry
                .others(&target.props, &target.recipient)
                .into_iter()
        });
        let Some(next) = others.next() else {
            break;
        };
        // Unless the activation already ended, its entry follows the job.
        if let Some(mut held) = l.pushed.get_mut(&key).filter(|h| h.1 == lease) {
            held.0 = next.link;
        }
        attempt = send_to(&p, &next, false, lease, job.clone(), None);
    }
    l.unhold_lease(key, lease);
    l.queue_yield(key, lease, deadline);
}

impl LeaderState {
    /// Queues a yield for the next paced batch.
    pub fn queue_yield(&self, key: JobKey, lease: Lease, deadline: i64) {
        lock(&self.yields).push((key, lease, deadline));
        self.yield_wake.notify_one();
    }
}

impl Partition {
    /// A gateway gave a pushed job back: queued as a yield where this replica leads.
    pub fn gateway_yield(self: &Arc<Self>, key: JobKey, lease: Lease) -> bool {
        let Some(l) = self.leader() else {
            return false;
        };
        // Paced like every yield; its deadline is unknown here, so never skipped.
        l.queue_yield(key, lease, i64::MAX);
        true
    }

    /// Jobs of this type and tenant became runnable without a push (a yield, a
    /// create or failure whose targets were chosen before a stream got room, ...).
    /// A stream that got room while they were activated, or before their entry
    /// applied, was back-filled without them and hears of them no other way: offer
    /// them to every stream that has room now. The stream that refused a yielded job
    /// has none (its gateway reported so, or it is gone), so it is not pushed there
    /// again at once.
    pub(super) fn backfill_streams_of(self: &Arc<Self>, job_type: &str, tenant: &str) {
        for props in self.registry.streams_with_room(job_type, tenant) {
            self.backfill(props);
        }
    }

    /// A stream with these properties has free credit (it registered, or a gateway
    /// reported more): if this replica leads and has a backlog of its type, propose one
    /// back-fill round for it, sized to the smaller of the backlog and the credit free
    /// now. The round holds that credit from now until its pushes are made (what apply
    /// does not use goes back), so rounds never promise more than a gateway reported,
    /// and a round need not wait for an earlier one: every credit report can start one,
    /// and the proposer puts the rounds waiting together into one log entry. A backlog
    /// larger than the credit goes as more credit is reported.
    pub fn backfill(self: &Arc<Self>, props: ActivationProps) {
        let Some(leader) = self.leader() else {
            return;
        };
        let backlog = self
            .shared
            .read()
            .state
            .activatable_count(&props.job_type, &props.tenant_ids);
        let want = u32::try_from(backlog)
            .unwrap_or(u32::MAX)
            .min(BACKFILL_BATCH);
        if want == 0 {
            return;
        }
        let target = self.registry.target_for(&props, want);
        if target.as_ref().is_none_or(|t| (t.max as usize) < backlog) {
            self.announce_backlog(&props);
        }
        let Some(target) = target else {
            return;
        };
        let p = self.clone();
        let round = async move {
            if let Err(e) = p.propose(LogCommand::Backfill { target }).await {
                tracing::debug!(error = %e, "back-fill round not applied");
            }
        };
        self.spawn_led(&leader, round, &tracing::Span::current());
    }
}

/// Proposes queued yields in paced batches: after a wake it waits [`YIELD_PACE`]
/// plus jitter, collecting more, then proposes them together (one log entry). A
/// job whose deadline would pass before its yield could land is left to time out.
pub(super) async fn run_yields(p: Arc<Partition>, l: Arc<LeaderState>) {
    loop {
        l.yield_wake.notified().await;
        let jitter = Duration::from_micros(rand::random::<u64>() % YIELD_PACE.as_micros() as u64);
        tokio::time::sleep(YIELD_PACE + jitter).await;
        let batch = std::mem::take(&mut *lock(&l.yields));
        let soon = now_ms() + 2 * YIELD_PACE.as_millis() as i64;
        let (due, late): (Vec<_>, Vec<_>) = batch.into_iter().partition(|(_, _, d)| *d > soon);
        if !late.is_empty() {
            metrics::YIELDS
                .with_label_values(&[label::yield_source::LEFT_TO_TIMEOUT])
                .inc_by(late.len() as u64);
        }
        metrics::YIELDS
            .with_label_values(&[label::yield_source::ALL_REFUSED])
            .inc_by(due.len() as u64);
        // Submitted together, so the proposer puts them in one entry.
        let proposals = due
            .into_iter()
            .map(|(key, lease, _)| p.propose(LogCommand::Yield { key, lease }));
        for r in futures::future::join_all(proposals).await {
            if let Err(e) = r {
                // The job stays activated; its deadline recovers it.
                tracing::debug!(error = %e, "yield not applied");
            }
        }
    }
}

/// Run by a replica once it leads and has applied what earlier leaders committed:
/// parked polls may have missed notices while leadership moved, and streams
/// registered earlier may have a backlog here now.
pub(super) fn offer_backlog(p: &Arc<Partition>) {
    for notice in p.activatable_notices() {
        // No receiver (no gateway linked) is fine.
        let _ = p.notices.send(notice);
    }
    for props in p.registry.all_props() {
        p.backfill(props);
    }
}
