//! The workload: producers creating jobs at a steady rate, and streaming and polling
//! workers (Courier's own `JobWorker`) completing them, every step recorded in the
//! [`History`]. A probe says when the cluster serves again after a fault.

use super::history::{now_ms, Delivery, History};
use courier_client::{ActivateJobs, Client, JobOutcome, JobWorker, NewJob};
use courier_proto::gateway_protocol::{
    partition::{PartitionBrokerHealth, PartitionBrokerRole},
    ActivatedJob,
};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub const JOB_TYPE: &str = "chaos";
const PROBE_TYPE: &str = "chaos-probe";
/// How long a call keeps retrying: long enough for a leader change, short enough
/// that a producer notices a cut and moves on.
const RETRY_BUDGET: Duration = Duration::from_secs(5);

pub struct WorkloadSpec {
    pub gateways: Vec<String>,
    /// Jobs per second over all producers.
    pub rate: u64,
    pub job_timeout: Duration,
    /// Percent of handler runs that fail the job (keeping its retries) instead of
    /// completing it, so that it runs again after a back-off.
    pub fail_percent: u32,
}

pub struct Workload {
    pub history: Arc<History>,
    stop_producers: watch::Sender<bool>,
    producers: Vec<JoinHandle<()>>,
    workers: Vec<JobWorker>,
}

fn client(addr: &str) -> anyhow::Result<Client> {
    Ok(Client::connect(addr)?.with_retry_budget(RETRY_BUDGET))
}

impl Workload {
    /// Two producers, two streaming workers and one polling worker per gateway.
    pub fn start(spec: &WorkloadSpec) -> anyhow::Result<Workload> {
        let history = Arc::new(History::default());
        let (stop_producers, stopped) = watch::channel(false);
        let producers_n = spec.gateways.len() * 2;
        let period = Duration::from_secs_f64(producers_n as f64 / spec.rate.max(1) as f64);
        let mut producers = Vec::new();
        let mut workers = Vec::new();
        for (g, addr) in spec.gateways.iter().enumerate() {
            for p in 0..2 {
                let c = client(addr)?;
                let name = format!("producer-g{}-{p}", g + 1);
                producers.push(tokio::spawn(produce(
                    c,
                    name,
                    period,
                    Arc::clone(&history),
                    stopped.clone(),
                )));
            }
            for (i, streaming) in [true, true, false].into_iter().enumerate() {
                let kind = if streaming { "stream" } else { "poll" };
                let name = format!("{kind}-g{}-{i}", g + 1);
                workers.push(worker(client(addr)?, name, streaming, spec, &history)?);
            }
        }
        Ok(Workload {
            history,
            stop_producers,
            producers,
            workers,
        })
    }

    pub async fn stop_producers(&mut self) {
        let _ = self.stop_producers.send(true);
        for p in self.producers.drain(..) {
            let _ = p.await;
        }
    }

    pub async fn stop_workers(&mut self) {
        for w in self.workers.drain(..) {
            w.shutdown().await;
        }
    }
}

async fn produce(
    c: Client,
    name: String,
    period: Duration,
    history: Arc<History>,
    mut stopped: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut n = 0u64;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stopped.changed() => return,
        }
        n += 1;
        let job = NewJob::new(JOB_TYPE)
            .variables(format!("{{\"producer\":\"{name}\",\"n\":{n}}}").as_str())
            .retries(3);
        match c.create_job(job).await {
            Ok(r) => history.created(r.key, now_ms()),
            Err(e) => history.create_failed(e.outcome_unknown()),
        }
    }
}

fn worker(
    c: Client,
    name: String,
    streaming: bool,
    spec: &WorkloadSpec,
    history: &Arc<History>,
) -> anyhow::Result<JobWorker> {
    let timeout_ms = i64::try_from(spec.job_timeout.as_millis()).unwrap_or(i64::MAX);
    let fail_percent = spec.fail_percent;
    let (h, worker) = (Arc::clone(history), name.clone());
    let handler = move |job: ActivatedJob| {
        let (h, worker) = (Arc::clone(&h), worker.clone());
        async move {
            h.delivered(
                job.key,
                Delivery {
                    worker,
                    activated_ms: job.deadline.saturating_sub(timeout_ms),
                    received_ms: now_ms(),
                },
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
            let outcome = if rand::random_range(0..100) < fail_percent {
                // Its retries kept: it runs again after the back-off, never an incident.
                JobOutcome::fail_with("failed on purpose", job.retries, Duration::from_millis(200))
            } else {
                JobOutcome::complete()
            };
            Ok::<_, std::convert::Infallible>(outcome)
        }
    };
    let (h, me) = (Arc::clone(history), name.clone());
    let w = JobWorker::builder(c, JOB_TYPE, handler)
        .name(name)
        .streaming(streaming)
        .timeout(spec.job_timeout)
        .max_jobs_active(16)
        .shutdown_grace(Duration::from_secs(2))
        .on_reported(move |key, outcome, result| {
            let complete = matches!(outcome, JobOutcome::Complete { .. });
            match result {
                Ok(()) if complete => h.completed(key, &me, now_ms()),
                Ok(()) => {}
                Err(e) if complete && e.outcome_unknown() => h.completion_unknown(key),
                Err(e) => h.outcome_refused(key, &me, format!("{outcome:?}: {e}")),
            }
        })
        .spawn()?;
    Ok(w)
}

/// Whether the cluster serves through the gateway at `addr`: its topology shows a
/// healthy leader for each of `partitions`, and a job created on each partition is
/// activated and completed through it.
pub async fn serves(addr: &str, partitions: u32) -> bool {
    let Ok(c) = Client::connect(addr) else {
        return false;
    };
    let c = c.with_retry_budget(Duration::ZERO);
    let call = Duration::from_secs(2);
    let Ok(Ok(t)) = tokio::time::timeout(call, c.topology()).await else {
        return false;
    };
    let healthy: BTreeSet<i32> = t
        .brokers
        .iter()
        .flat_map(|b| &b.partitions)
        .filter(|p| {
            p.role == PartitionBrokerRole::Leader as i32
                && p.health == PartitionBrokerHealth::Healthy as i32
        })
        .map(|p| p.partition_id)
        .collect();
    if (1..=partitions).any(|p| !healthy.contains(&(p as i32))) {
        return false;
    }
    // Creates go round the partitions; a few more than their number reach each.
    let mut keys = BTreeSet::new();
    let mut on = BTreeSet::new();
    for _ in 0..partitions * 3 {
        match tokio::time::timeout(call, c.create_job(NewJob::new(PROBE_TYPE))).await {
            Ok(Ok(r)) => {
                keys.insert(r.key);
                on.insert(r.partition_id);
            }
            _ => return false,
        }
        if on.len() >= partitions as usize {
            break;
        }
    }
    if on.len() < partitions as usize {
        return false;
    }
    while !keys.is_empty() {
        let poll = ActivateJobs::new(PROBE_TYPE)
            .max_jobs(64)
            .timeout(Duration::from_secs(1))
            .request_timeout(Duration::from_secs(1));
        let Ok(Ok(jobs)) = tokio::time::timeout(call, c.activate_jobs(poll)).await else {
            return false;
        };
        if jobs.is_empty() {
            return false;
        }
        for j in jobs {
            // Probe jobs of earlier rounds that timed out come back too.
            keys.remove(&j.key);
            if !matches!(
                tokio::time::timeout(call, c.complete_job(j.key, "")).await,
                Ok(Ok(()))
            ) {
                return false;
            }
        }
    }
    true
}
