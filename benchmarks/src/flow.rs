//! Flow-control scenarios: slow and fast workers, overload, and a burst created
//! with no worker connected. Workers are streams that state their credit
//! (`courier-max-jobs-active`) and spend a fixed time per job, so the workers'
//! combined capacity is known exactly and throughput can be set against it.

use crate::drive::{created_us, now_us};
use anyhow::Context;
use courier_client::{ActivateJobs, Client, NewJob};
use courier_proto::gateway_protocol::{gateway_client::GatewayClient, StreamActivatedJobsRequest};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Push latency once the backlog is gone: `n` jobs carrying their creation time,
/// one at a time, each created when the previous one reached a handler. Returns
/// (p50, p99) in ms.
async fn probe(
    client: &Client,
    job_type: &str,
    ws: &[Worker],
    n: usize,
) -> anyhow::Result<(f64, f64)> {
    let seen = |ws: &[Worker]| -> usize {
        ws.iter()
            .map(|w| w.latencies.lock().unwrap_or_else(|e| e.into_inner()).len())
            .sum()
    };
    let before = seen(ws);
    for i in 0..n {
        let job = NewJob::new(job_type).variables(format!("{{\"t\":{}}}", now_us()).as_str());
        client.create_job(job).await?;
        let t0 = Instant::now();
        while seen(ws) < before + i + 1 {
            anyhow::ensure!(
                t0.elapsed() < Duration::from_secs(30),
                "a probe job was not pushed"
            );
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    }
    let mut all: Vec<u64> = ws
        .iter()
        .flat_map(|w| {
            w.latencies
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
        })
        .collect();
    all.sort_unstable();
    let at = |q: f64| all[((all.len() - 1) as f64 * q).round() as usize] as f64 / 1000.0;
    Ok((at(0.50), at(0.99)))
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// Half the workers take 10 times longer per job; a backlog is always waiting.
    Slow,
    /// Jobs created at 5 times what the workers finish, then the backlog drains.
    Overload,
    /// Jobs created with no worker connected, then the workers connect: push.
    Burst,
    /// The same burst drained by long-polling workers, for comparison.
    BurstPoll,
}

#[derive(clap::Args)]
pub struct FlowArgs {
    #[arg(long, default_value = "127.0.0.1:26500")]
    pub address: String,
    /// The gateway's metrics address (`/metrics`), for in-flight and refusal figures.
    #[arg(long)]
    pub gateway_metrics: Option<String>,
    /// Metrics addresses of the brokers, comma-separated, for yields and pushes.
    #[arg(long, default_value = "")]
    pub broker_metrics: String,
    #[arg(long, value_enum)]
    pub scenario: Scenario,
    #[arg(long, default_value = "courier")]
    pub label: String,
    /// Seconds of load (slow, overload).
    #[arg(long, default_value_t = 20)]
    pub duration: u64,
    /// Jobs of the burst.
    #[arg(long, default_value_t = 50_000)]
    pub burst: usize,
}

/// A worker: a stream with `credit`, `work` per job; counts what it holds.
struct Worker {
    max_held: Arc<AtomicUsize>,
    done: Arc<AtomicU64>,
    /// Create-to-handler latencies (µs) of jobs that carry their creation time.
    latencies: Arc<std::sync::Mutex<Vec<u64>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn stream_worker(
    address: &str,
    job_type: &str,
    name: &str,
    credit: usize,
    work: Duration,
    client: Client,
) -> anyhow::Result<Worker> {
    let mut g = GatewayClient::connect(format!("http://{address}")).await?;
    let mut req = tonic::Request::new(StreamActivatedJobsRequest {
        r#type: job_type.into(),
        worker: name.into(),
        timeout: 60_000,
        fetch_variable: vec![],
        tenant_ids: vec![],
    });
    req.metadata_mut()
        .insert("courier-max-jobs-active", credit.to_string().parse()?);
    let mut stream = g.stream_activated_jobs(req).await?.into_inner();
    let latencies = Arc::new(std::sync::Mutex::new(Vec::new()));
    let lat = latencies.clone();
    let held = Arc::new(AtomicUsize::new(0));
    let max_held = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let (h, m, d) = (held.clone(), max_held.clone(), done.clone());
    let task = tokio::spawn(async move {
        while let Ok(Some(job)) = stream.message().await {
            if let Some(t) = created_us(job.variables.as_bytes()) {
                lat.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(now_us().saturating_sub(t));
            }
            handle(job.key, work, &client, &h, &m, &d);
        }
    });
    Ok(Worker {
        latencies,
        max_held,
        done,
        task,
    })
}

/// Holds a job for `work`, then completes it, keeping the worker's counts.
fn handle(
    key: i64,
    work: Duration,
    client: &Client,
    held: &Arc<AtomicUsize>,
    max_held: &AtomicUsize,
    done: &Arc<AtomicU64>,
) {
    max_held.fetch_max(held.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
    let (c, h, d) = (client.clone(), held.clone(), done.clone());
    tokio::spawn(async move {
        tokio::time::sleep(work).await;
        // Held until the completion is sent: the gateway frees the credit as soon
        // as the broker confirms it.
        h.fetch_sub(1, Ordering::SeqCst);
        if c.complete_job(key, "").await.is_ok() {
            d.fetch_add(1, Ordering::SeqCst);
        }
    });
}

/// A long-polling worker with the same accounting (for the burst comparison).
fn poll_worker(job_type: &str, credit: usize, work: Duration, client: Client) -> Worker {
    let held = Arc::new(AtomicUsize::new(0));
    let max_held = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let (h, m, d) = (held.clone(), max_held.clone(), done.clone());
    let job_type = job_type.to_string();
    let task = tokio::spawn(async move {
        loop {
            let free = credit.saturating_sub(h.load(Ordering::SeqCst));
            if free == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            }
            let req = ActivateJobs::new(job_type.clone())
                .worker("poller")
                .max_jobs(free as i32)
                .timeout(Duration::from_secs(60))
                .request_timeout(Duration::from_secs(10));
            let Ok(jobs) = client.activate_jobs(req).await else {
                continue;
            };
            for job in jobs {
                handle(job.key, work, &client, &h, &m, &d);
            }
        }
    });
    Worker {
        max_held,
        done,
        latencies: Arc::default(),
        task,
    }
}

/// Creates `n` jobs in batches of 500, at most 4 batches in flight.
async fn create_many(client: &Client, job_type: &str, n: usize) -> anyhow::Result<()> {
    let mut left = n;
    let mut tasks = tokio::task::JoinSet::new();
    while left > 0 {
        let size = left.min(500);
        left -= size;
        let (c, t) = (client.clone(), job_type.to_string());
        tasks.spawn(async move {
            c.create_jobs((0..size).map(|_| NewJob::new(t.as_str())))
                .await
        });
        while tasks.len() >= 4 {
            if let Some(r) = tasks.join_next().await {
                r??;
            }
        }
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    Ok(())
}

/// Sum of a metric over all label sets at a `/metrics` endpoint; 0 when unreachable.
async fn metric(addr: &str, name: &str) -> f64 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        return 0.0;
    };
    if s.write_all(format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .is_err()
    {
        return 0.0;
    }
    let mut body = String::new();
    let _ = s.read_to_string(&mut body).await;
    body.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with(' ') || r.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn broker_sum(a: &FlowArgs, name: &str) -> f64 {
    let mut total = 0.0;
    for addr in a.broker_metrics.split(',').filter(|s| !s.is_empty()) {
        total += metric(addr, name).await;
    }
    total
}

fn total_done(ws: &[Worker]) -> u64 {
    ws.iter().map(|w| w.done.load(Ordering::SeqCst)).sum()
}

fn max_held(ws: &[Worker]) -> usize {
    ws.iter()
        .map(|w| w.max_held.load(Ordering::SeqCst))
        .max()
        .unwrap_or(0)
}

/// Waits until `n` jobs are done, up to `within`; returns the time taken.
async fn drain(ws: &[Worker], n: u64, within: Duration) -> Option<Duration> {
    let t0 = Instant::now();
    while t0.elapsed() < within {
        if total_done(ws) >= n {
            return Some(t0.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    None
}

pub async fn run(a: FlowArgs) -> anyhow::Result<()> {
    let client = Client::connect(&a.address)?.with_retry_budget(Duration::from_secs(30));
    client.topology().await.context("gateway not reachable")?;
    let job_type = format!("flow-{:?}-{}", a.scenario, std::process::id()).to_lowercase();
    let yields0 = broker_sum(&a, "courier_broker_yields_total").await;
    let pushes0 = broker_sum(
        &a,
        "courier_broker_push_attempts_total{outcome=\"accepted\"}",
    )
    .await;
    let line = match a.scenario {
        Scenario::Slow => {
            // 4 fast workers (20 ms a job) and 4 slow ones (200 ms), credit 4 each: 880
            // jobs/s together, well under what the cluster itself can create and push.
            let (credit, fast, slow) = (
                4usize,
                Duration::from_millis(20),
                Duration::from_millis(200),
            );
            let mut ws = Vec::new();
            for i in 0..8 {
                let (name, work) = if i < 4 {
                    ("fast", fast)
                } else {
                    ("slow", slow)
                };
                ws.push(
                    stream_worker(&a.address, &job_type, name, credit, work, client.clone())
                        .await?,
                );
            }
            let capacity =
                4.0 * credit as f64 / fast.as_secs_f64() + 4.0 * credit as f64 / slow.as_secs_f64();
            // Keep a backlog: create well ahead of capacity, topping up as it drains.
            let mut created = 0u64;
            let t0 = Instant::now();
            let mut measured_from = None;
            while t0.elapsed() < Duration::from_secs(a.duration + 2) {
                if created < total_done(&ws) + (capacity as u64) {
                    create_many(&client, &job_type, 500).await?;
                    created += 500;
                }
                if measured_from.is_none() && t0.elapsed() >= Duration::from_secs(2) {
                    measured_from = Some((Instant::now(), total_done(&ws)));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let (m0, d0) = measured_from.unwrap_or((t0, 0));
            let rate = (total_done(&ws) - d0) as f64 / m0.elapsed().as_secs_f64();
            let fast_done: u64 = ws[..4].iter().map(|w| w.done.load(Ordering::SeqCst)).sum();
            format!(
                "| {} | slow workers: 4 at 20 ms + 4 at 200 ms a job, credit 4 | {:.0} jobs/s of {:.0} possible ({:.0}%) | max held {} (credit {credit}) | fast workers did {:.0}% |",
                a.label,
                rate,
                capacity,
                100.0 * rate / capacity,
                max_held(&ws),
                100.0 * fast_done as f64 / total_done(&ws).max(1) as f64
            )
        }
        Scenario::Overload => {
            // 4 workers, credit 4, 40 ms a job: 400 jobs/s; created at 5 times that for
            // half the run's duration, then the backlog drains.
            let (credit, work) = (4usize, Duration::from_millis(40));
            let mut ws = Vec::new();
            for _ in 0..4 {
                ws.push(
                    stream_worker(&a.address, &job_type, "w", credit, work, client.clone()).await?,
                );
            }
            let capacity = 4.0 * credit as f64 / work.as_secs_f64();
            let rate = 5.0 * capacity;
            let t0 = Instant::now();
            let mut created = 0u64;
            let mut max_inflight = 0.0f64;
            while t0.elapsed() < Duration::from_secs(a.duration / 2) {
                let due = (t0.elapsed().as_secs_f64() * rate) as u64;
                if due > created {
                    let n = (due - created).min(2000) as usize;
                    create_many(&client, &job_type, n).await?;
                    created += n as u64;
                }
                if let Some(g) = &a.gateway_metrics {
                    max_inflight =
                        max_inflight.max(metric(g, "courier_gateway_inflight_jobs").await);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let created_for = t0.elapsed();
            let drained = drain(&ws, created, Duration::from_secs(600)).await;
            let lost = created.saturating_sub(total_done(&ws));
            let (p50, p99) = probe(&client, &job_type, &ws, 100).await?;
            format!(
                "| {} | overload: {created} jobs in {:.0} s at {:.0}/s for 4 workers of {:.0}/s | backlog drained {} after creation stopped, {} lost; then push p50 {p50:.2} ms, p99 {p99:.2} ms (100 jobs, 1 at a time) | max held {} (credit {credit}); gateway in-flight max {max_inflight:.0} jobs |",
                a.label,
                created_for.as_secs_f64(),
                created as f64 / created_for.as_secs_f64(),
                capacity,
                drained.map_or("NOT".to_string(), |d| format!("in {:.1} s", d.as_secs_f64())),
                lost,
                max_held(&ws)
            )
        }
        Scenario::Burst | Scenario::BurstPoll => {
            let push = a.scenario == Scenario::Burst;
            create_many(&client, &job_type, a.burst).await?;
            let (credit, work) = (32usize, Duration::from_millis(1));
            let t0 = Instant::now();
            let mut ws = Vec::new();
            for _ in 0..10 {
                ws.push(if push {
                    stream_worker(&a.address, &job_type, "w", credit, work, client.clone()).await?
                } else {
                    poll_worker(&job_type, credit, work, client.clone())
                });
            }
            let drained = drain(&ws, a.burst as u64, Duration::from_secs(600)).await;
            // From the moment the workers started to connect.
            let secs = drained.map_or(f64::NAN, |_| t0.elapsed().as_secs_f64());
            format!(
                "| {} | burst of {} jobs, then 10 {} workers (credit 32, 1 ms a job) | drained in {:.1} s ({:.0} jobs/s) | max held {} |",
                a.label,
                a.burst,
                if push { "streaming" } else { "long-polling" },
                secs,
                a.burst as f64 / secs,
                max_held(&ws)
            )
        }
    };
    let yields = broker_sum(&a, "courier_broker_yields_total").await - yields0;
    let pushes = broker_sum(
        &a,
        "courier_broker_push_attempts_total{outcome=\"accepted\"}",
    )
    .await
        - pushes0;
    println!("{line} {yields:.0} yields / {pushes:.0} pushes |");
    Ok(())
}
