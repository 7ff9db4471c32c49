//! What a new leader does about its predecessors' pushes: asks the gateways which
//! arrived and makes the others runnable again; and the jobs of a gateway that is gone.

use super::*;

/// Run by the leader of `term` once it has applied an entry of that term (and so
/// every earlier one): the activations an earlier leader made for a push may never
/// have been pushed (it died between the commit and the send, or its entries were
/// committed by this leader, which does not carry out their effects). Once the
/// gateways they name are linked here (or [`GATEWAY_GRACE`] has passed), every
/// linked gateway is asked which of them it holds; those none holds are yielded and
/// offered to the registered streams. When a gateway does not answer, all are left
/// to their deadlines: running a job twice is worse than running it late.
pub(super) async fn reconcile_pushes(p: Arc<Partition>, term: u64) {
    let earlier = p.shared.read().state.pushed_before(term);
    if earlier.is_empty() {
        return;
    }
    let named: BTreeSet<String> = earlier.iter().map(|e| e.gateway.clone()).collect();
    tracing::info!(
        term,
        gateways = named.len(),
        jobs = earlier.len(),
        "asking the gateways about the pushes of earlier leaders"
    );
    let grace_ends = Instant::now() + GATEWAY_GRACE;
    while named
        .iter()
        .any(|g| p.registry.link_of_gateway(g).is_none())
        && Instant::now() < grace_ends
    {
        if p.leading_term() != Some(term) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let Some(lost) = held_by_none(&p, earlier).await else {
        return;
    };
    if p.leading_term() == Some(term) {
        yield_lost(&p, lost).await;
    }
}

/// Waits until this replica, leading in `term`, has applied an entry of that term,
/// and with it every entry of earlier leaders (a follower may not have heard of
/// the last commits before it was elected). False once it no longer leads in `term`.
pub(super) async fn caught_up_in(p: &Partition, term: u64) -> bool {
    // Raft's metrics change with every entry applied and every change of role.
    let mut metrics = p.raft.metrics();
    loop {
        if p.leading_term() != Some(term) {
            return false;
        }
        if p.shared
            .read()
            .last_applied
            .is_some_and(|id| id.leader_id.term == term)
        {
            return true;
        }
        if metrics.changed().await.is_err() {
            return false;
        }
    }
}

/// Run by a replica once it begins to lead in this process. The jobs handed out
/// (pushed, or answered to a poll) through a gateway with no link here may have gone
/// with a gateway that died while this replica did not lead here: its links ended at
/// an earlier leader, or at this broker before it restarted, and no
/// [`Partition::gateway_lost`] timer runs for them ([`reconcile_pushes`] gets to
/// those of earlier terms too, but only after [`GATEWAY_GRACE`]).
/// Those of gateways that have not said hello here within the lost-gateway grace
/// are then treated as that timer treats them; without a grace they wait for their
/// activation timeouts.
pub(super) async fn reclaim_orphans(p: Arc<Partition>, term: u64) {
    let Some(grace) = p.lost_gateway_grace else {
        return;
    };
    let mark = p.registry.hellos();
    tokio::time::sleep(grace).await;
    if p.leading_term() != Some(term) {
        return;
    }
    let gone = |gateway: &str| {
        p.registry.link_of_gateway(gateway).is_none()
            && !p.registry.said_hello_since(gateway, mark)
            && !p.registry.left(gateway)
    };
    let orphans = p.shared.read().state.handed_through(gone);
    if orphans.is_empty() {
        return;
    }
    tracing::info!(
        jobs = orphans.len(),
        "jobs were handed out through gateways that have not come back since this replica began to lead; checking them"
    );
    if let Some(lost) = held_by_none(&p, orphans).await {
        if p.leading_term() == Some(term) {
            yield_lost(&p, lost).await;
        }
    }
}

/// Which of `jobs` no gateway linked here holds. Every linked gateway is asked, not
/// only the one each activation names: a push that gateway refused may have been
/// taken by another. `None` when a gateway did not answer: the caller then leaves
/// them all to their deadlines. Counts the outcomes.
pub(super) async fn held_by_none(p: &Partition, jobs: Vec<Handed>) -> Option<Vec<Handed>> {
    let asked: Vec<HeldJob> = jobs
        .iter()
        .map(|e| HeldJob {
            key: e.key.0,
            lease: e.lease.0,
        })
        .collect();
    let links = p.registry.links();
    let answers = links.iter().map(|link| {
        let asked = &asked;
        async move {
            let mut held = Vec::new();
            for chunk in asked.chunks(HELD_QUERY_BATCH) {
                let answer = tokio::time::timeout(
                    HELD_ANSWER_TIMEOUT,
                    link.query_held(p.id, chunk.to_vec()),
                )
                .await;
                // No answer in time, or the link ended before it: not known.
                held.extend(answer.ok().flatten()?);
            }
            Some(held)
        }
    });
    let mut held = std::collections::HashSet::new();
    for answer in futures::future::join_all(answers).await {
        let Some(answer) = answer else {
            tracing::warn!(
                jobs = jobs.len(),
                "a gateway did not answer about earlier pushes; leaving them to their deadlines"
            );
            metrics::RECONCILED
                .with_label_values(&[label::reconciled::UNANSWERED])
                .inc_by(jobs.len() as u64);
            return None;
        };
        held.extend(answer.into_iter().map(|h| (h.key, h.lease)));
    }
    let (kept, lost): (Vec<_>, Vec<_>) = jobs
        .into_iter()
        .partition(|e| held.contains(&(e.key.0, e.lease.0)));
    // What went out through a gateway that is gone is yielded only with a
    // lost-gateway grace; without one it waits for its activation timeout, as its
    // worker may still be running it.
    let linked = |e: &Handed| p.registry.link_of_gateway(&e.gateway).is_some();
    let (lost, waiting): (Vec<_>, Vec<_>) = match p.lost_gateway_grace {
        Some(_) => (lost, Vec::new()),
        None => lost.into_iter().partition(linked),
    };
    let gone = lost.iter().filter(|e| !linked(e)).count();
    for (outcome, n) in [
        (label::reconciled::HELD, kept.len()),
        (label::reconciled::YIELDED, lost.len() - gone),
        (label::reconciled::GATEWAY_GONE, gone),
        (label::reconciled::LEFT_TO_TIMEOUT, waiting.len()),
    ] {
        metrics::RECONCILED
            .with_label_values(&[outcome])
            .inc_by(n as u64);
    }
    tracing::info!(
        gateways = links.len(),
        held = kept.len(),
        yielded = lost.len(),
        of_gateways_gone = gone,
        left_to_timeout = waiting.len(),
        "pushes of earlier leaders or lost gateways checked"
    );
    Some(lost)
}

/// Makes the activations of jobs whose push reached nobody runnable again (each
/// only if that activation is still the job's current one), and offers them to the
/// registered streams: unlike a job every stream refused, none was offered to
/// anyone.
pub(super) async fn yield_lost(p: &Arc<Partition>, lost: Vec<Handed>) {
    if lost.is_empty() {
        return;
    }
    // Proposed together, so they share one entry.
    let yields = lost.iter().map(|e| {
        p.propose(LogCommand::Yield {
            key: e.key,
            lease: e.lease,
        })
    });
    for r in futures::future::join_all(yields).await {
        if let Err(e) = r {
            tracing::debug!(error = %e, "yield of an unpushed job not applied");
        }
    }
    for props in p.registry.all_props() {
        p.backfill(props);
    }
}

impl Partition {
    /// A link of `gateway` to this broker ended when the registry had seen `hellos`
    /// gateway hellos. If that gateway has not said hello again within the lost
    /// gateway grace (when there is one) and this replica leads, the jobs handed out
    /// through it (pushed, or answered to a poll) that no linked gateway holds are
    /// made runnable again: its ids are per process, so a gateway that restarted,
    /// or died, holds none of them, and its workers' results for them cannot reach
    /// a broker through it (a worker still running one may finish it through another
    /// gateway: as after any activation timeout, the job may then run twice).
    pub fn gateway_lost(self: &Arc<Self>, gateway: String, hellos: u64) {
        let Some(grace) = self.lost_gateway_grace else {
            return;
        };
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let p = self.clone();
        let stop = self.shutdown.clone();
        self.tasks.spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(grace) => {}
            }
            if !p.is_leader() || p.registry.said_hello_since(&gateway, hellos) {
                return;
            }
            let candidates = p.shared.read().state.handed_through(|g| g == gateway);
            if candidates.is_empty() {
                return;
            }
            tracing::info!(%gateway, jobs = candidates.len(), "a gateway did not come back; checking the jobs handed out through it");
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = async {
                    if let Some(lost) = held_by_none(&p, candidates).await {
                        yield_lost(&p, lost).await;
                    }
                } => {}
            }
        });
    }
}
