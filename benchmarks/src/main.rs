//! `courier-bench`: Courier's load generator.
//!
//! - `create`: create latency (request sent -> acknowledged, i.e. committed by a
//!   majority and applied) and throughput, closed loop (`--concurrency` producers as
//!   fast as the cluster takes) or open loop (`--rate` jobs/s; latency counted from
//!   the moment each create was due, so a stalled cluster cannot hide its queue).
//! - `e2e`: create-to-handler latency with streaming (push) or long-polling workers,
//!   unloaded or at a fixed rate.
//! - `jetstream`: the same create-to-handler scenarios against NATS JetStream (R3,
//!   durable push consumer, explicit ack), the peer Courier is measured against.
//! - `flow`: flow-control scenarios (slow workers, overload, burst by push or poll).
//! - `fsync-probe`: the disk's fdatasync latency, for the machine line of a report.
//!
//! Results print as one markdown table row and, with `--json`, as JSON.

mod drive;
mod e2e;
mod flow;
mod jetstream;
mod merge;

use anyhow::Context;
use clap::{Parser, Subcommand};
use courier_client::{Client, NewJob};
use hdrhistogram::Histogram;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(name = "courier-bench", about = "Courier's load generator")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Create latency and throughput.
    Create(CreateArgs),
    /// Create-to-handler latency, push or poll.
    E2e(e2e::E2eArgs),
    /// Flow-control scenarios: slow workers, overload, burst.
    Flow(flow::FlowArgs),
    /// The peer: NATS JetStream create-to-handler (or publish) latency, as `e2e`.
    Jetstream(jetstream::JetStreamArgs),
    /// One row from segments saved by `e2e --histogram-out`.
    Merge(merge::MergeArgs),
    /// fdatasync latency of the disk holding DIR.
    FsyncProbe {
        #[arg(long, default_value = ".")]
        dir: std::path::PathBuf,
        #[arg(long, default_value_t = 200)]
        samples: u32,
    },
}

#[derive(clap::Args)]
struct CreateArgs {
    /// Gateway address.
    #[arg(long, default_value = "127.0.0.1:26500")]
    address: String,
    /// Label of this run in the output (topology, mode).
    #[arg(long, default_value = "courier")]
    label: String,
    /// Producers, each with one create in flight (closed loop).
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Jobs per second (open loop); overrides --concurrency.
    #[arg(long)]
    rate: Option<u64>,
    /// Seconds of measurement.
    #[arg(long, default_value_t = 10)]
    duration: u64,
    /// Seconds of warm-up before measuring.
    #[arg(long, default_value_t = 2)]
    warmup: u64,
    /// Bytes of variables per job.
    #[arg(long, default_value_t = 100)]
    payload: usize,
    /// Print JSON as well as the table row.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    security: SecurityArgs,
}

/// TLS and a token towards a secure gateway.
#[derive(clap::Args, Clone, Default)]
pub(crate) struct SecurityArgs {
    /// PEM file of the CA of the gateway's certificate: TLS with it.
    #[arg(long)]
    pub tls_ca: Option<std::path::PathBuf>,
    /// A static token of the gateway.
    #[arg(long)]
    pub token: Option<String>,
}

impl SecurityArgs {
    /// A client of `address` with these settings.
    pub fn client(&self, address: &str) -> anyhow::Result<Client> {
        let security = courier_client::Security {
            tls_ca: self.tls_ca.clone(),
            credentials: match &self.token {
                Some(t) => courier_client::Credentials::Token(t.clone()),
                None => courier_client::Credentials::None,
            },
        };
        Ok(Client::connect_with(address, &security)?.with_retry_budget(Duration::from_secs(5)))
    }
}

pub(crate) fn histogram() -> anyhow::Result<Histogram<u64>> {
    // 1 µs .. 60 s at 3 significant digits.
    Histogram::new_with_bounds(1, 60_000_000, 3).context("histogram bounds")
}

pub(crate) fn payload(bytes: usize) -> String {
    format!("{{\"p\":\"{}\"}}", "x".repeat(bytes.saturating_sub(8)))
}

pub(crate) struct Outcome {
    pub latency: Histogram<u64>,
    pub errors: u64,
    pub elapsed: Duration,
}

/// Prints one markdown table row: label, load, p50, p99, p99.9, max (ms), rate, errors.
pub(crate) fn report(label: &str, load: &str, o: &Outcome) {
    let h = &o.latency;
    println!(
        "| {label} | {load} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.0} | {} |",
        ms(h.value_at_quantile(0.5)),
        ms(h.value_at_quantile(0.9)),
        ms(h.value_at_quantile(0.99)),
        ms(h.value_at_quantile(0.999)),
        ms(h.max()),
        h.len() as f64 / o.elapsed.as_secs_f64(),
        o.errors
    );
}

/// Closed loop: each producer sends its next create when the previous is acknowledged.
async fn closed_loop(
    client: Client,
    a: &CreateArgs,
    until: Instant,
    measure_from: Instant,
) -> anyhow::Result<Outcome> {
    let vars = Arc::new(payload(a.payload));
    let mut tasks = Vec::new();
    for _ in 0..a.concurrency {
        let (client, vars) = (client.clone(), vars.clone());
        tasks.push(tokio::spawn(async move {
            let mut h = histogram()?;
            let mut errors = 0u64;
            while Instant::now() < until {
                let t0 = Instant::now();
                let r = client
                    .create_job(NewJob::new("bench").variables(vars.as_str()))
                    .await;
                if t0 < measure_from {
                    continue;
                }
                match r {
                    Ok(_) => h.saturating_record(t0.elapsed().as_micros() as u64),
                    Err(_) => errors += 1,
                }
            }
            anyhow::Ok((h, errors))
        }));
    }
    let mut latency = histogram()?;
    let mut errors = 0;
    for t in tasks {
        let (h, e) = t.await??;
        latency.add(&h)?;
        errors += e;
    }
    Ok(Outcome {
        latency,
        errors,
        elapsed: until - measure_from,
    })
}

/// Open loop: creates are due at a fixed rate whatever the cluster does; each one's
/// latency counts from when it was due.
async fn open_loop(
    client: Client,
    a: &CreateArgs,
    rate: u64,
    until: Instant,
    measure_from: Instant,
) -> anyhow::Result<Outcome> {
    let vars = Arc::new(payload(a.payload));
    let interval = Duration::from_secs_f64(1.0 / rate.max(1) as f64);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Option<u64>>();
    let start = Instant::now();
    let mut n: u64 = 0;
    loop {
        let due = start + interval.mul_f64(n as f64);
        if due >= until {
            break;
        }
        tokio::time::sleep_until(due.into()).await;
        let (client, vars, tx) = (client.clone(), vars.clone(), tx.clone());
        tokio::spawn(async move {
            let r = client
                .create_job(NewJob::new("bench").variables(vars.as_str()))
                .await;
            if due >= measure_from {
                let _ = tx.send(r.ok().map(|_| due.elapsed().as_micros() as u64));
            }
        });
        n += 1;
    }
    drop(tx);
    let mut latency = histogram()?;
    let mut errors = 0;
    while let Some(r) = rx.recv().await {
        match r {
            Some(us) => latency.saturating_record(us),
            None => errors += 1,
        }
    }
    Ok(Outcome {
        latency,
        errors,
        elapsed: until - measure_from,
    })
}

pub(crate) fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

async fn create(a: CreateArgs) -> anyhow::Result<()> {
    let client = a.security.client(&a.address)?;
    client.topology().await.context("gateway not reachable")?;
    let measure_from = Instant::now() + Duration::from_secs(a.warmup);
    let until = measure_from + Duration::from_secs(a.duration);
    let (load, o) = match a.rate {
        Some(rate) => (
            format!("open loop {rate}/s"),
            open_loop(client, &a, rate, until, measure_from).await?,
        ),
        None => (
            format!("closed loop x{}", a.concurrency),
            closed_loop(client, &a, until, measure_from).await?,
        ),
    };
    report(&a.label, &load, &o);
    let h = &o.latency;
    let rate = h.len() as f64 / o.elapsed.as_secs_f64();
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "label": a.label, "load": load, "count": h.len(), "errors": o.errors,
                "p50_ms": ms(h.value_at_quantile(0.5)), "p90_ms": ms(h.value_at_quantile(0.9)),
                "p99_ms": ms(h.value_at_quantile(0.99)), "p999_ms": ms(h.value_at_quantile(0.999)),
                "max_ms": ms(h.max()), "rate_per_s": rate,
            })
        );
    }
    Ok(())
}

fn fsync_probe(dir: &std::path::Path, samples: u32) -> anyhow::Result<()> {
    use std::io::Write;
    let path = dir.join(".courier-fsync-probe");
    let mut f = std::fs::File::create(&path)?;
    let mut h = histogram()?;
    let block = [0u8; 4096];
    for _ in 0..samples {
        f.write_all(&block)?;
        let t0 = Instant::now();
        f.sync_data()?;
        h.saturating_record(t0.elapsed().as_micros() as u64);
    }
    std::fs::remove_file(&path)?;
    println!(
        "fdatasync of 4 KiB appends: p50 {:.3} ms, p99 {:.3} ms ({samples} samples)",
        ms(h.value_at_quantile(0.5)),
        ms(h.value_at_quantile(0.99))
    );
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Create(a) => create(a).await,
        Cmd::E2e(a) => e2e::run(a).await,
        Cmd::Flow(a) => flow::run(a).await,
        Cmd::Jetstream(a) => jetstream::run(a).await,
        Cmd::Merge(a) => merge::run(a),
        Cmd::FsyncProbe { dir, samples } => fsync_probe(&dir, samples),
    }
}
