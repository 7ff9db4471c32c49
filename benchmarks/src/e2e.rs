//! Create-to-handler latency: each job carries the wall-clock time it was sent to be
//! created; a worker's handler records `now - created` when the job reaches it.
//! Workers either stream (`StreamActivatedJobs`, job push) or long-poll
//! (`ActivateJobs`, 32 jobs, 10 s), as Zeebe's clients do.

use crate::drive::{self, created_us, now_us, Seen, Window};
use crate::{histogram, payload, Outcome};
use anyhow::Context;
use courier_client::{ActivateJobs, Client, NewJob, StreamJobs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Semaphore};

/// How workers get their jobs.
#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    Push,
    Poll,
}

#[derive(clap::Args)]
pub struct E2eArgs {
    #[arg(long, default_value = "127.0.0.1:26500")]
    pub address: String,
    #[arg(long, default_value = "courier")]
    pub label: String,
    #[arg(long, value_enum)]
    pub mode: Mode,
    /// Workers (streams or pollers).
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// Jobs per second, open loop; without it, one job at a time (unloaded).
    #[arg(long, conflicts_with = "in_flight")]
    pub rate: Option<u64>,
    /// Closed loop, as fast as the cluster takes: at most this many jobs between
    /// being sent for creation and reaching a handler; each job that reaches one lets
    /// the next be created. The rate reported is the full lifecycle's throughput.
    #[arg(long)]
    pub in_flight: Option<usize>,
    #[arg(long, default_value_t = 10)]
    pub duration: u64,
    #[arg(long, default_value_t = 2)]
    pub warmup: u64,
    #[arg(long, default_value_t = 100)]
    pub payload: usize,
    /// Print every measured job slower than this many milliseconds on stderr, with
    /// its creation time (µs since the epoch), to line stalls up with broker logs.
    #[arg(long)]
    pub print_slower_than_ms: Option<u64>,
    /// Operators' reads beside the load, this many a second: a `ListJobs` page of
    /// 1,000 jobs (walking on with its cursor) and a `JobStats` over every job.
    #[arg(long)]
    pub inspect_per_sec: Option<u32>,
    /// Also save the measured latencies to this file, for `merge`.
    #[arg(long)]
    pub histogram_out: Option<std::path::PathBuf>,
    /// Job types: jobs go round them in turn, and worker `i` takes type `i mod N`.
    #[arg(long, default_value_t = 1)]
    pub types: usize,
    /// Each worker under a name of its own, so the gateway cannot merge their
    /// streams into one per type: every broker then holds one registration each.
    #[arg(long)]
    pub distinct_workers: bool,
    /// Workers per connection to the gateway (its default bound is 1,000 calls on
    /// one connection, completions included).
    #[arg(long, default_value_t = 200)]
    pub workers_per_connection: usize,
    /// Each worker's credit: a stream's max jobs active, a poll's max jobs.
    #[arg(long, default_value_t = 32)]
    pub credit: u32,
    #[command(flatten)]
    pub security: crate::SecurityArgs,
}

async fn push_worker(
    job_type: String,
    worker: String,
    client: Client,
    seen: Seen,
    opened: Arc<Semaphore>,
    credit: u32,
) -> anyhow::Result<()> {
    let request = StreamJobs::new(job_type)
        .worker(worker)
        .max_jobs_active(credit)
        .timeout(Duration::from_secs(30));
    let mut stream = client.stream_activated_jobs(request).await?;
    opened.add_permits(1);
    while let Some(job) = stream.message().await? {
        if let Some(t) = created_us(job.variables.as_bytes()) {
            let _ = seen.send((t, now_us().saturating_sub(t)));
        }
        let c = client.clone();
        tokio::spawn(async move { c.complete_job(job.key, "").await });
    }
    Ok(())
}

async fn poll_worker(
    job_type: String,
    worker: String,
    client: Client,
    seen: Seen,
    credit: u32,
) -> anyhow::Result<()> {
    let req = ActivateJobs::new(job_type)
        .worker(worker)
        .max_jobs(i32::try_from(credit).unwrap_or(i32::MAX))
        .timeout(Duration::from_secs(30))
        .request_timeout(Duration::from_secs(10));
    loop {
        let jobs = client.activate_jobs(req.clone()).await?;
        for job in jobs {
            if let Some(t) = created_us(job.variables.as_bytes()) {
                let _ = seen.send((t, now_us().saturating_sub(t)));
            }
            let c = client.clone();
            tokio::spawn(async move { c.complete_job(job.key, "").await });
        }
    }
}

/// A job created at `created` (µs since the epoch), which it carries.
fn job(job_type: &str, pad: &str, created: u64) -> NewJob {
    NewJob::new(job_type).variables(format!("{{\"t\":{created},\"p\":\"{pad}\"}}").as_str())
}

pub async fn run(a: E2eArgs) -> anyhow::Result<()> {
    let client = a.security.client(&a.address)?;
    client.topology().await.context("gateway not reachable")?;
    // A type of its own, so jobs of other runs never mix in.
    let job_type = format!("bench-{:?}-{}", a.mode, now_us()).to_lowercase();
    let types: Vec<String> = match a.types {
        0 | 1 => vec![job_type.clone()],
        n => (0..n).map(|i| format!("{job_type}-{i}")).collect(),
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut workers = Vec::new();
    let opened = Arc::new(Semaphore::new(0));
    let mut connection = client.clone();
    let n_workers = a.workers.max(1);
    for i in 0..n_workers {
        if i > 0 && i % a.workers_per_connection.max(1) == 0 {
            connection = a.security.client(&a.address)?;
        }
        let worker = if a.distinct_workers {
            format!("bench-{i}")
        } else {
            "bench".to_string()
        };
        let (t, c, s) = (
            types[i % types.len()].clone(),
            connection.clone(),
            tx.clone(),
        );
        let o = Arc::clone(&opened);
        workers.push(tokio::spawn(async move {
            match a.mode {
                Mode::Push => push_worker(t, worker, c, s, o, a.credit).await,
                Mode::Poll => poll_worker(t, worker, c, s, a.credit).await,
            }
        }));
    }
    drop(tx);
    if a.mode == Mode::Push {
        let all = u32::try_from(n_workers).unwrap_or(u32::MAX);
        tokio::time::timeout(Duration::from_secs(60), opened.acquire_many(all))
            .await
            .context("the workers' streams did not all open within 60 s")?
            .context("opening streams")?
            .forget();
    }
    // Streams register with every broker asynchronously; polls park. Let them settle.
    tokio::time::sleep(Duration::from_millis(500 + n_workers as u64 / 10)).await;
    let next_type = AtomicUsize::new(0);
    let pick = || types[next_type.fetch_add(1, Ordering::Relaxed) % types.len()].clone();
    let pad = payload(a.payload);
    let pad = pad
        .trim_start_matches("{\"p\":\"")
        .trim_end_matches("\"}")
        .to_string();
    let mut w = Window::new(a.warmup, a.duration);
    w.print_slower_than_us = a.print_slower_than_ms.map(|ms| ms * 1000);
    let mut h = histogram()?;
    let mut errors = 0u64;
    let inspector = a
        .inspect_per_sec
        .map(|n| tokio::spawn(inspect(client.clone(), n, w.until)));
    let load = match (a.rate, a.in_flight) {
        (None, Some(window)) => {
            let permits = Arc::new(Semaphore::new(window.max(1)));
            let create_errors = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
            let producer = {
                let (c, types, p, permits, errs) = (
                    client.clone(),
                    types.clone(),
                    pad.clone(),
                    permits.clone(),
                    create_errors.clone(),
                );
                tokio::spawn(async move {
                    for n in 0.. {
                        if Instant::now() >= w.until {
                            break;
                        }
                        let Ok(permit) = permits.clone().acquire_owned().await else {
                            return;
                        };
                        // Given back when a handler has the job (below), or now if
                        // its create fails.
                        permit.forget();
                        let (c, t, p, permits, errs) = (
                            c.clone(),
                            types[n % types.len()].clone(),
                            p.clone(),
                            permits.clone(),
                            errs.clone(),
                        );
                        tokio::spawn(async move {
                            if c.create_job(job(&t, &p, now_us())).await.is_err() {
                                errs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                permits.add_permits(1);
                            }
                        });
                    }
                })
            };
            while Instant::now() < w.until {
                let left = w.until.saturating_duration_since(Instant::now());
                match tokio::time::timeout(left, rx.recv()).await {
                    Ok(Some((t, lat))) => {
                        permits.add_permits(1);
                        if t >= w.measure_from_us {
                            h.saturating_record(lat);
                        }
                    }
                    Ok(None) | Err(_) => break,
                }
            }
            producer.abort();
            errors += create_errors.load(std::sync::atomic::Ordering::Relaxed);
            format!(
                "full lifecycle, closed loop ({window} in flight), {} workers",
                a.workers
            )
        }
        (None, None) => {
            errors += drive::unloaded(&w, &mut rx, &mut h, |created| {
                client.create_job(job(&pick(), &pad, created))
            })
            .await;
            "unloaded, 1 job at a time".to_string()
        }
        (Some(rate), _) => {
            errors += drive::open_loop(&w, rate, &mut rx, &mut h, |created| {
                let (c, j) = (client.clone(), job(&pick(), &pad, created));
                async move { c.create_job(j).await }
            })
            .await;
            format!("{rate} jobs/s, {} workers", a.workers)
        }
    };
    for worker in workers {
        worker.abort();
    }
    let mut load = format!("{:?} {load}", a.mode).to_lowercase();
    if types.len() > 1 {
        load = format!("{load} over {} types", types.len());
    }
    if a.distinct_workers {
        load = format!("{load}, each worker named apart");
    }
    if let (Some(n), Some(inspector)) = (a.inspect_per_sec, inspector) {
        let reads = inspector.await.context("the inspecting task")??;
        eprintln!(
            "inspecting beside {load}: {} reads, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            reads.len(),
            crate::ms(reads.value_at_quantile(0.5)),
            crate::ms(reads.value_at_quantile(0.99)),
            crate::ms(reads.max()),
        );
        load = format!("{load}, {n} ListJobs + {n} JobStats/s");
    }
    let outcome = Outcome {
        latency: h,
        errors,
        elapsed: Duration::from_secs(a.duration),
    };
    crate::report(&a.label, &load, &outcome);
    if let Some(path) = &a.histogram_out {
        crate::merge::save(path, &load, &outcome)?;
    }
    Ok(())
}

/// Lists and counts jobs `per_sec` times a second each until `until`; returns the
/// latency of every read.
async fn inspect(
    client: Client,
    per_sec: u32,
    until: Instant,
) -> anyhow::Result<hdrhistogram::Histogram<u64>> {
    let mut reads = histogram()?;
    let mut tick = tokio::time::interval(Duration::from_secs(1) / per_sec.max(1));
    let mut cursor = String::new();
    while Instant::now() < until {
        tick.tick().await;
        let t0 = Instant::now();
        let page = client
            .list_jobs(Default::default(), &cursor, 1000)
            .await
            .context("ListJobs")?;
        reads.saturating_record(t0.elapsed().as_micros() as u64);
        cursor = page.cursor;
        let t0 = Instant::now();
        client
            .job_stats(Default::default())
            .await
            .context("JobStats")?;
        reads.saturating_record(t0.elapsed().as_micros() as u64);
    }
    Ok(reads)
}
