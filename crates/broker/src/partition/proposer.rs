//! The proposer: group commit at the application level. Everything that arrives
//! while Raft flushes the previous entry is drained into one [`Batch`].

use super::*;

/// A command's approximate size in a log entry: its documents dominate.
pub(super) fn approx_bytes(cmd: &LogCommand) -> usize {
    use courier_proto::domain::Command;
    match cmd {
        LogCommand::Client { cmd, .. } | LogCommand::ClientIn { cmd, .. } => match cmd.inner() {
            Command::Create(jobs) => jobs
                .iter()
                .map(|j| j.variables.len() + j.custom_headers.len() + 128)
                .sum(),
            Command::Complete {
                variables: Some(v), ..
            }
            | Command::Fail {
                variables: Some(v), ..
            }
            | Command::ThrowError {
                variables: Some(v), ..
            } => v.len() + 128,
            _ => 128,
        },
        LogCommand::TimeOut { keys, .. } | LogCommand::Recur { keys, .. } => keys.len() * 24 + 128,
        _ => 128,
    }
}

pub(super) async fn run_proposer(
    p: Arc<Partition>,
    mut rx: mpsc::Receiver<Proposal>,
    shutdown: CancellationToken,
) {
    let mut inflight = FuturesUnordered::new();
    let mut pending = Pending::default();
    // The entry Raft has not yet made durable in this replica's log: (its number,
    // the receiver its flush signal fires). Raft appends one entry at a time, so
    // the next waits in `pending`, growing, until this one is flushed.
    let mut appending: Option<(u64, oneshot::Receiver<()>)> = None;
    let mut next_seq = 0u64;
    loop {
        // Armed only while ahead: past it, only the flush or the in-flight limit
        // holds the completions, and those have branches of their own.
        let held = (!pending.proposals.is_empty() && completions_only(&pending.proposals))
            .then_some(pending.since + pending.hold())
            .filter(|&until| until > tokio::time::Instant::now());
        let gated = p.gate.is_closed();
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = p.gate.opened(), if gated => {}
            // Completions held long enough: the check below lets them go.
            _ = tokio::time::sleep_until(held.unwrap_or(pending.since)), if held.is_some() => {}
            Some(seq) = inflight.next(), if !inflight.is_empty() => {
                // Applied (or failed): long past its append whatever the signal says.
                if appending.as_ref().is_some_and(|(s, _)| *s == seq) {
                    appending = None;
                }
            }
            _ = async {
                if let Some((_, flushed)) = appending.as_mut() {
                    let _ = flushed.await;
                }
            }, if appending.is_some() => appending = None,
            msg = rx.recv(), if !pending.full() => match msg {
                Some(m) => pending.add(m),
                None => break,
            },
        }
        while !pending.full() {
            match rx.try_recv() {
                Ok(m) => pending.add(m),
                Err(_) => break,
            }
        }
        if ready_to_propose(
            &pending.proposals,
            pending.full(),
            appending.is_some(),
            inflight.len(),
            pending.since.elapsed(),
            pending.hold(),
        ) && p.gate.enter()
        {
            let batch = pending.take();
            let (flushed_tx, flushed) = oneshot::channel();
            let signal = FlushSignal::new(move || {
                let _ = flushed_tx.send(());
            });
            next_seq += 1;
            appending = Some((next_seq, flushed));
            let p = p.clone();
            inflight.push(async move {
                let seq = write(p.clone(), batch, signal, next_seq).await;
                p.gate.leave();
                seq
            });
        }
    }
    // Whatever is still waiting is answered by dropping its sender: UNAVAILABLE.
}

/// The commands waiting for the proposer's next entry.
pub(super) struct Pending {
    proposals: Vec<Proposal>,
    /// Their approximate size in the entry.
    bytes: usize,
    /// When the oldest of them arrived.
    since: tokio::time::Instant,
    /// When the last command that is not a completion arrived (in this batch or
    /// an earlier one), and how long after the one before it.
    busy_at: Option<tokio::time::Instant>,
    busy_gap: Option<Duration>,
}

impl Default for Pending {
    fn default() -> Self {
        Pending {
            proposals: Vec::new(),
            bytes: 0,
            since: tokio::time::Instant::now(),
            busy_at: None,
            busy_gap: None,
        }
    }
}

impl Pending {
    /// Adds a command; the first one starts the hold's clock.
    pub(super) fn add(&mut self, m: Proposal) {
        let now = tokio::time::Instant::now();
        if self.proposals.is_empty() {
            self.since = now;
        }
        if !is_completion(&m.cmd) {
            self.busy_gap = self.busy_at.map(|at| now.saturating_duration_since(at));
            self.busy_at = Some(now);
        }
        self.bytes += approx_bytes(&m.cmd);
        self.proposals.push(m);
    }

    /// How long completions alone wait: [`COMPLETION_HOLD`] while work is flowing
    /// (see [`BUSY_LOOKBACK`]), else not at all.
    pub(super) fn hold(&self) -> Duration {
        hold_for(self.since, self.busy_at, self.busy_gap)
    }

    /// Whether the entry takes no more commands.
    pub(super) fn full(&self) -> bool {
        self.proposals.len() >= MAX_BATCH || self.bytes >= MAX_BATCH_BYTES
    }

    /// The commands, for one entry; the next starts empty.
    pub(super) fn take(&mut self) -> Vec<Proposal> {
        self.bytes = 0;
        std::mem::take(&mut self.proposals)
    }
}

/// Whether the proposer hands Raft its pending commands now, as one entry:
/// - not while Raft is still flushing this replica's previous entry (`appending`):
///   Raft takes one append at a time, and whatever arrives meanwhile joins this entry;
/// - not beyond [`MAX_INFLIGHT`] entries waiting to be applied;
/// - when every pending command only completes a job, not before the oldest has
///   waited `hold` (`waited`) or the batch is `full`.
pub(super) fn ready_to_propose(
    pending: &[Proposal],
    full: bool,
    appending: bool,
    inflight: usize,
    waited: Duration,
    hold: Duration,
) -> bool {
    !pending.is_empty()
        && !appending
        && inflight < MAX_INFLIGHT
        && (full || waited >= hold || !completions_only(pending))
}

/// The hold of completions the first of which arrived at `since`, when the last
/// other command arrived at `busy_at`, `busy_gap` after the one before it.
pub(super) fn hold_for(
    since: tokio::time::Instant,
    busy_at: Option<tokio::time::Instant>,
    busy_gap: Option<Duration>,
) -> Duration {
    match (busy_at, busy_gap) {
        (Some(at), Some(gap))
            if gap <= BUSY_LOOKBACK && since.saturating_duration_since(at) <= BUSY_LOOKBACK =>
        {
            COMPLETION_HOLD
        }
        _ => Duration::ZERO,
    }
}

/// Whether every command only completes a job: nothing becomes runnable.
pub(super) fn completions_only(pending: &[Proposal]) -> bool {
    pending.iter().all(|p| is_completion(&p.cmd))
}

pub(super) fn is_completion(cmd: &LogCommand) -> bool {
    matches!(
        cmd,
        LogCommand::Client {
            cmd: Command::Complete { .. },
            ..
        } | LogCommand::ClientIn {
            cmd: Command::Complete { .. },
            ..
        }
    )
}

/// Proposes one entry and answers each of its commands.
/// Resolves to `seq` once the entry is applied or has failed.
pub(super) async fn write(
    p: Arc<Partition>,
    batch: Vec<Proposal>,
    on_flushed: FlushSignal,
    seq: u64,
) -> u64 {
    let mut ends_from = BTreeMap::new();
    let mut commands = Vec::with_capacity(batch.len());
    let mut replies = Vec::with_capacity(batch.len());
    for b in batch {
        commands.push(b.cmd);
        replies.push(b.reply);
        ends_from.extend(b.ends_from);
    }
    // Credit held for this entry's push targets; what apply does not use goes back.
    let mut held: BTreeMap<Recipient, u64> = BTreeMap::new();
    for c in &commands {
        for t in targets_of(c) {
            *held.entry(t.recipient.clone()).or_default() += u64::from(t.max);
        }
    }
    let fetch: Vec<Option<Vec<String>>> = commands.iter().map(fetch_of).collect();
    metrics::BATCH_SIZE.observe(commands.len() as f64);
    let started = std::time::Instant::now();
    let count = commands.len();
    let write = p.raft.client_write(Batch {
        ts: now_ms(),
        commands,
        on_flushed,
    });
    tokio::pin!(write);
    // An entry should commit in milliseconds; one that does not holds up every
    // command behind it, so say so while it waits.
    let result = loop {
        match tokio::time::timeout(SLOW_ENTRY, &mut write).await {
            Ok(result) => break result,
            Err(_) => tracing::warn!(
                commands = count,
                waited = ?started.elapsed(),
                "a log entry is taking long to commit"
            ),
        }
    };
    metrics::COMMIT_SECONDS.observe(started.elapsed().as_secs_f64());
    match result {
        Ok(mut resp) => {
            fill_stored(&p, &mut resp.data, &fetch);
            if resp.data.repeated > 0 {
                metrics::REPEATS.inc_by(u64::from(resp.data.repeated));
                tracing::info!(
                    commands = resp.data.repeated,
                    "commands sent again answered as their first attempt was"
                );
            }
            for e in &resp.data.effects {
                if let Effect::Push(push) = e {
                    if let Some(n) = held.get_mut(&push.target.recipient) {
                        *n = n.saturating_sub(1);
                    }
                }
            }
            for (r, n) in held {
                p.registry.refund(&r, n);
            }
            // Pushes first: they are the job path's latency.
            carry_out(&p, resp.data.effects, started, &ends_from);
            for (reply, tx) in resp.data.replies.into_iter().zip(replies) {
                let _ = tx.send(reply);
            }
        }
        Err(e) => {
            let err = match e {
                RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => {
                    BrokerError::NotLeader {
                        partition: p.id,
                        leader: f.leader_id.filter(|l| *l != p.node_id),
                    }
                }
                // The replica stopped (its storage failed) with the entry perhaps
                // appended and sent: another leader may commit it.
                RaftError::Fatal(f)
                    if p.has_failed() || matches!(f, openraft::error::Fatal::StorageError(_)) =>
                {
                    BrokerError::OutcomeUnknown(format!(
                        "partition {} stopped on this broker while the command was in \
                         flight ({f}): it may have been carried out",
                        p.id
                    ))
                }
                other => BrokerError::Unavailable(format!(
                    "partition {} could not replicate the command: {other}",
                    p.id
                )),
            };
            // Nothing was pushed: the credit held for the entry goes back.
            for (r, n) in held {
                p.registry.refund(&r, n);
            }
            metrics::REJECTED
                .with_label_values(&[label::rejected::NOT_COMMITTED])
                .inc();
            for tx in replies {
                let _ = tx.send(Err(err.clone()));
            }
        }
    }
    seq
}
