//! One partition on this broker: its Raft node, its proposer and its leader-side timers.
//!
//! The proposer is group commit at the application level: Raft entries are
//! expensive and commands are cheap, so everything waiting is drained into one
//! [`Batch`] while earlier entries are in flight.

use crate::engine::{Batch, Effect, LogCommand};
use crate::metrics;
use crate::raft::Raft;
use crate::store::sm::SharedState;
use courier_proto::cluster::{broker_message, BrokerMessage, JobsAvailable};
use courier_proto::domain::{BrokerError, JobKey, NodeId, PartitionId, Reply};
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use openraft::error::{ClientWriteError, RaftError};
use openraft::ServerState;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Most commands in one log entry.
const MAX_BATCH: usize = 2048;
/// Commands that may wait for the proposer before callers get RESOURCE_EXHAUSTED.
const QUEUE_CAPACITY: usize = 20_000;
/// Entries a partition may have in flight at once.
const MAX_INFLIGHT: usize = 2;
/// Most timed-out or recurring jobs handled in one command.
const MAX_TIMER_KEYS: usize = 1000;

/// The leader's wall clock in epoch ms; decided before proposing, never in apply.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

struct Proposal {
    cmd: LogCommand,
    reply: oneshot::Sender<Result<Reply, BrokerError>>,
}

/// Notices to gateways, fanned out to every link of this broker.
pub type Notices = broadcast::Sender<BrokerMessage>;

/// A partition replica hosted on this broker.
pub struct Partition {
    pub id: PartitionId,
    pub node_id: NodeId,
    pub raft: Raft,
    shared: Arc<SharedState>,
    proposals: mpsc::Sender<Proposal>,
}

impl Partition {
    /// Starts the proposer and the timers of a partition; both stop on `shutdown`.
    pub fn start(
        id: PartitionId,
        node_id: NodeId,
        raft: Raft,
        shared: Arc<SharedState>,
        notices: Notices,
        tasks: &tokio_util::task::TaskTracker,
        shutdown: CancellationToken,
    ) -> Arc<Partition> {
        let (tx, rx) = mpsc::channel(QUEUE_CAPACITY);
        let p = Arc::new(Partition {
            id,
            node_id,
            raft,
            shared,
            proposals: tx,
        });
        let span = tracing::info_span!("partition", partition = id.0, node = node_id);
        tasks.spawn(
            run_proposer(p.clone(), rx, notices.clone(), shutdown.clone()).instrument(span.clone()),
        );
        tasks.spawn(run_timers(p.clone(), notices, shutdown).instrument(span));
        p
    }

    /// Replicates `cmd` and answers once it is committed and applied.
    pub async fn propose(&self, cmd: LogCommand) -> Result<Reply, BrokerError> {
        self.check_leader()?;
        let (tx, rx) = oneshot::channel();
        self.proposals
            .try_send(Proposal { cmd, reply: tx })
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => {
                    metrics::REJECTED.with_label_values(&["queue_full"]).inc();
                    BrokerError::ResourceExhausted(format!(
                        "partition {} has {QUEUE_CAPACITY} commands waiting; retry later",
                        self.id
                    ))
                }
                mpsc::error::TrySendError::Closed(_) => self.stopping(),
            })?;
        rx.await.map_err(|_| self.stopping())?
    }

    /// Reads a job from the leader's applied state.
    pub fn get_job(&self, key: JobKey) -> Result<Reply, BrokerError> {
        self.check_leader()?;
        let applied = self.shared.read();
        applied
            .state
            .view(key)
            .map(Reply::Job)
            .ok_or_else(|| BrokerError::NotFound(format!("job with key '{key}' was not found")))
    }

    /// Whether this replica leads its partition now.
    pub fn is_leader(&self) -> bool {
        let m = self.raft.metrics();
        let m = m.borrow();
        m.state == ServerState::Leader
    }

    fn check_leader(&self) -> Result<(), BrokerError> {
        let m = self.raft.metrics();
        let m = m.borrow();
        if m.state == ServerState::Leader {
            Ok(())
        } else {
            Err(BrokerError::NotLeader {
                partition: self.id,
                leader: m.current_leader.filter(|l| *l != self.node_id),
            })
        }
    }

    fn stopping(&self) -> BrokerError {
        BrokerError::Unavailable(format!("partition {} is shutting down", self.id))
    }
}

async fn run_proposer(
    p: Arc<Partition>,
    mut rx: mpsc::Receiver<Proposal>,
    notices: Notices,
    shutdown: CancellationToken,
) {
    let mut inflight = FuturesUnordered::new();
    let mut pending: Vec<Proposal> = Vec::new();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            Some(()) = inflight.next(), if !inflight.is_empty() => {}
            msg = rx.recv(), if pending.len() < MAX_BATCH => match msg {
                Some(m) => pending.push(m),
                None => break,
            },
        }
        while pending.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(m) => pending.push(m),
                Err(_) => break,
            }
        }
        if !pending.is_empty() && inflight.len() < MAX_INFLIGHT {
            let batch = std::mem::take(&mut pending);
            inflight.push(write(p.clone(), batch, notices.clone()));
        }
    }
    // Whatever is still waiting is answered by dropping its sender: UNAVAILABLE.
}

/// Proposes one entry and answers each of its commands.
async fn write(p: Arc<Partition>, batch: Vec<Proposal>, notices: Notices) {
    let (commands, replies): (Vec<_>, Vec<_>) = batch.into_iter().map(|b| (b.cmd, b.reply)).unzip();
    metrics::BATCH_SIZE.observe(commands.len() as f64);
    let started = std::time::Instant::now();
    let result = p
        .raft
        .client_write(Batch {
            ts: now_ms(),
            commands,
        })
        .await;
    metrics::COMMIT_SECONDS.observe(started.elapsed().as_secs_f64());
    match result {
        Ok(resp) => {
            for (reply, tx) in resp.data.replies.into_iter().zip(replies) {
                let _ = tx.send(reply);
            }
            announce(p.id, &resp.data.effects, &notices);
        }
        Err(e) => {
            let err = match e {
                RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => {
                    BrokerError::NotLeader {
                        partition: p.id,
                        leader: f.leader_id.filter(|l| *l != p.node_id),
                    }
                }
                other => BrokerError::Unavailable(format!(
                    "partition {} could not replicate the command: {other}",
                    p.id
                )),
            };
            metrics::REJECTED
                .with_label_values(&["not_committed"])
                .inc();
            for tx in replies {
                let _ = tx.send(Err(err.clone()));
            }
        }
    }
}

/// Carries out the effects of an applied entry on the leader.
fn announce(partition: PartitionId, effects: &[Effect], notices: &Notices) {
    for e in effects {
        match e {
            Effect::JobsAvailable { job_type, .. } => {
                // No receiver (no gateway linked) is fine.
                let _ = notices.send(BrokerMessage {
                    kind: Some(broker_message::Kind::JobsAvailable(JobsAvailable {
                        r#type: job_type.clone(),
                        partition_id: partition.0,
                    })),
                });
            }
        }
    }
}

/// While leader: proposes TimeOut for activations past their deadline and Recur
/// for jobs past their retry back-off. Apply re-checks both against the entry's time.
async fn run_timers(p: Arc<Partition>, notices: Notices, shutdown: CancellationToken) {
    let mut metrics_rx = p.raft.metrics();
    let mut was_leader = false;
    loop {
        if !p.is_leader() {
            was_leader = false;
            tokio::select! {
                _ = shutdown.cancelled() => return,
                r = metrics_rx.changed() => if r.is_err() { return },
            }
            continue;
        }
        if !was_leader {
            was_leader = true;
            // Parked polls may have missed notices while leadership moved.
            let types = p.shared.read().state.activatable_types();
            let effects: Vec<Effect> = types
                .into_iter()
                .map(|(job_type, tenant_id)| Effect::JobsAvailable {
                    job_type,
                    tenant_id,
                })
                .collect();
            announce(p.id, &effects, &notices);
        }
        let applied = p.shared.applied.notified();
        tokio::pin!(applied);
        applied.as_mut().enable();
        let now = now_ms();
        let (timeouts, retries, next) = {
            let a = p.shared.read();
            let next = [a.state.next_deadline(), a.state.next_retry()]
                .into_iter()
                .flatten()
                .min();
            (
                a.state.due_deadlines(now, MAX_TIMER_KEYS),
                a.state.due_retries(now, MAX_TIMER_KEYS),
                next,
            )
        };
        let mut proposed = false;
        for cmd in [
            (!timeouts.is_empty()).then_some(LogCommand::TimeOut(timeouts)),
            (!retries.is_empty()).then_some(LogCommand::Recur(retries)),
        ]
        .into_iter()
        .flatten()
        {
            proposed = true;
            if let Err(e) = p.propose(cmd).await {
                tracing::debug!(error = %e, "timer command not applied");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
            }
        }
        if proposed {
            continue;
        }
        let wait = next
            .map(|t| (t - now).clamp(1, 1000) as u64)
            .unwrap_or(1000);
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(wait)) => {}
            _ = &mut applied => {}
            r = metrics_rx.changed() => if r.is_err() { return },
        }
    }
}
