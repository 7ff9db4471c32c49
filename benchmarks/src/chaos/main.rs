//! `courier-chaos`: runs a workload against a real cluster while a nemesis injects
//! faults, then checks the history.
//!
//! Each broker and gateway is a `courier` process in a network namespace of its own,
//! on a bridge; a broker's data directory is a small tmpfs. Producers create jobs at
//! a steady rate and streaming and polling workers complete them, while the nemesis
//! cuts links (both ways or one way, with nftables inside the namespaces), freezes
//! and kills processes, and fills disks. After each heal the run measures how long
//! until every gateway serves every partition again. At the end everything is
//! healed, the backlog drained, and the checker verifies: every acknowledged create
//! was completed; no job was activated after its completion was acknowledged; no
//! completion was acknowledged twice; every recovery stayed within its bound.
//!
//! Needs root (namespaces, tmpfs mounts) and `nft` (Debian's nftables).

mod history;
mod nemesis;
mod net;
mod procs;
mod workload;

use anyhow::{bail, Context};
use clap::Parser;
use nemesis::Fault;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(
    name = "courier-chaos",
    about = "Faults against a real cluster, then a history check"
)]
struct Args {
    /// Seconds of faults (the workload runs through them; healing and draining
    /// come after).
    #[arg(long, default_value_t = 60)]
    duration: u64,
    /// Seed of the fault schedule (default: the clock).
    #[arg(long)]
    seed: Option<u64>,
    /// The faults to draw from, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = nemesis::KINDS.map(String::from))]
    faults: Vec<String>,
    /// Brokers (at least 3; partitions are replicated on 3).
    #[arg(long, default_value_t = 3)]
    brokers: u64,
    #[arg(long, default_value_t = 2)]
    gateways: usize,
    #[arg(long, default_value_t = 3)]
    partitions: u32,
    /// Jobs created per second, over all producers.
    #[arg(long, default_value_t = 100)]
    rate: u64,
    /// Activation timeout of the workers' jobs, in seconds.
    #[arg(long, default_value_t = 5)]
    job_timeout: u64,
    /// Shortest and longest time a fault lasts, in seconds.
    #[arg(long, default_value_t = 2)]
    hold_min: u64,
    #[arg(long, default_value_t = 8)]
    hold_max: u64,
    /// Most seconds from a heal until every gateway serves every partition again.
    #[arg(long, default_value_t = 30)]
    recovery_bound: u64,
    /// Size of each broker's data disk (tmpfs), in MiB.
    #[arg(long, default_value_t = 256)]
    disk_mib: u64,
    /// The `courier` binary (default: beside this one).
    #[arg(long)]
    courier: Option<PathBuf>,
    /// Where logs and data go (default: a new folder under the temp directory).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Write the report as JSON to this file too.
    #[arg(long)]
    json_out: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(args).await {
        Ok(0) => ExitCode::SUCCESS,
        Ok(_) => ExitCode::from(1),
        Err(e) => {
            eprintln!("courier-chaos: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// What one heal cost: from the heal until the cluster served again.
struct Recovery {
    kind: &'static str,
    fault: String,
    took: Option<Duration>,
}

async fn run(args: Args) -> anyhow::Result<usize> {
    preflight(&args)?;
    let courier = match &args.courier {
        Some(p) => p.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("no folder of this binary")?
            .join("courier"),
    };
    if !courier.exists() {
        bail!(
            "no courier binary at {} (build it: cargo build -p courier-cli, or pass --courier)",
            courier.display()
        );
    }
    let seed = args
        .seed
        .unwrap_or_else(|| u64::try_from(history::now_ms()).unwrap_or(0));
    let dir = match &args.dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("courier-chaos-{}", std::process::id())),
    };
    std::fs::create_dir_all(&dir)?;
    say(&format!("seed {seed}; logs in {}", dir.display()));

    let brokers: Vec<String> = (1..=args.brokers).map(|i| format!("b{i}")).collect();
    let gateways: Vec<String> = (1..=args.gateways).map(|i| format!("g{i}")).collect();
    let names: Vec<String> = brokers.iter().chain(&gateways).cloned().collect();
    // Declared before the cluster: dropped after it, once its processes are gone.
    let net = net::Net::create(std::process::id(), &names)?;
    let spec = procs::ClusterSpec {
        courier: &courier,
        dir: &dir,
        brokers: args.brokers,
        gateways: args.gateways,
        partitions: args.partitions,
        disk_mib: args.disk_mib,
    };
    let mut cluster = procs::Cluster::start(&spec, &net)?;
    let addrs = cluster.gateway_addrs.clone();
    if wait_serving(&addrs, args.partitions, Duration::from_secs(120))
        .await
        .is_none()
    {
        bail!("the cluster did not start serving within 120 s (see the logs)");
    }
    let mut load = workload::Workload::start(&workload::WorkloadSpec {
        gateways: addrs.clone(),
        rate: args.rate,
        job_timeout: Duration::from_secs(args.job_timeout),
        fail_percent: 5,
    })?;

    let outcome = tokio::select! {
        r = nemesis_loop(&args, seed, &net, &mut cluster, &brokers, &gateways, &load.history) => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    // Whatever happened, heal and drain before judging or leaving.
    let healed = heal_all(&net, &mut cluster).await;
    let recoveries = outcome?;
    healed?;
    say("healed everything; draining");
    if wait_serving(&addrs, args.partitions, Duration::from_secs(120))
        .await
        .is_none()
    {
        say("the cluster does not serve after the final heal");
    }
    load.stop_producers().await;
    drain(
        &load.history,
        &addrs,
        Duration::from_secs(args.job_timeout * 4 + 60),
    )
    .await;
    load.stop_workers().await;
    cluster.stop();

    let report = report::Report::new(seed, &args, &recoveries, load.history.check());
    println!("{}", report.markdown());
    if let Some(path) = &args.json_out {
        std::fs::write(path, report.json())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(report.violations())
}

mod report;

fn preflight(args: &Args) -> anyhow::Result<()> {
    if args.brokers < 3 || args.gateways < 1 {
        bail!("a chaos run needs at least 3 brokers and 1 gateway");
    }
    if args.hold_min > args.hold_max {
        bail!("--hold-min is over --hold-max");
    }
    if let Some(bad) = args
        .faults
        .iter()
        .find(|f| !nemesis::KINDS.contains(&f.as_str()))
    {
        bail!(
            "no fault called {bad}; the faults are {}",
            nemesis::KINDS.join(", ")
        );
    }
    let uid = std::process::Command::new("id").arg("-u").output()?;
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        bail!("a chaos run needs root (network namespaces and tmpfs mounts)");
    }
    for tool in ["ip", "nft", "mount"] {
        let found = std::process::Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()?
            .status
            .success();
        if !found {
            bail!("{tool} is missing (nft: apt-get install nftables)");
        }
    }
    Ok(())
}

async fn nemesis_loop(
    args: &Args,
    seed: u64,
    net: &net::Net,
    cluster: &mut procs::Cluster,
    brokers: &[String],
    gateways: &[String],
    history: &history::History,
) -> anyhow::Result<Vec<Recovery>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let addrs = cluster.gateway_addrs.clone();
    let end = Instant::now() + Duration::from_secs(args.duration);
    let bound = Duration::from_secs(args.recovery_bound);
    let mut recoveries = Vec::new();
    while Instant::now() < end {
        let kind = &args.faults[rng.random_range(0..args.faults.len())];
        let fault = Fault::draw(kind, &mut rng, brokers, gateways);
        let hold = Duration::from_secs(rng.random_range(args.hold_min..=args.hold_max));
        say(&format!("{fault} for {hold:?}"));
        fault.inject(net, cluster)?;
        tokio::time::sleep(hold).await;
        let restarted = fault.heal(net, cluster).await?;
        // Four times the bound before giving up on it: a recovery that takes longer
        // is a violation either way, and its length is worth knowing.
        let took = wait_serving(&addrs, args.partitions, bound * 4).await;
        let (created, completed) = history.progress();
        say(&format!(
            "  healed{}; serving again after {}; {created} jobs created, {completed} completed",
            if restarted {
                " (storage failed: broker restarted)"
            } else {
                ""
            },
            took.map_or("(not within the bound)".to_string(), |d| format!("{d:.1?}")),
        ));
        recoveries.push(Recovery {
            kind: fault.kind(),
            fault: fault.to_string(),
            took,
        });
        let quiet = Duration::from_millis(rng.random_range(1000..3000));
        tokio::time::sleep(quiet.min(end.saturating_duration_since(Instant::now()))).await;
    }
    Ok(recoveries)
}

/// Removes every cut, continues every frozen process and starts every stopped one.
async fn heal_all(net: &net::Net, cluster: &mut procs::Cluster) -> anyhow::Result<()> {
    net.heal()?;
    let courier = cluster.courier().to_path_buf();
    let names: Vec<String> = cluster
        .brokers
        .keys()
        .map(|id| format!("b{id}"))
        .chain((1..=cluster.gateways.len()).map(|g| format!("g{g}")))
        .collect();
    for name in names {
        if let Some(p) = cluster.proc_mut(&name) {
            p.thaw();
            if !p.is_running() {
                p.start(&courier)?;
            }
        }
    }
    for d in cluster.disks.values() {
        d.free();
    }
    Ok(())
}

/// Waits until every gateway serves every partition; how long that took, or `None`
/// past `within`.
async fn wait_serving(addrs: &[String], partitions: u32, within: Duration) -> Option<Duration> {
    let start = Instant::now();
    let mut pending: Vec<&String> = addrs.iter().collect();
    while start.elapsed() < within {
        let mut still = Vec::new();
        for a in pending {
            if !workload::serves(a, partitions).await {
                still.push(a);
            }
        }
        if still.is_empty() {
            return Some(start.elapsed());
        }
        pending = still;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    None
}

/// Waits until every acknowledged create is completed, or `within` passes. A job
/// whose completion was sent but not answered counts once the cluster no longer
/// knows it.
async fn drain(history: &history::History, addrs: &[String], within: Duration) {
    let start = Instant::now();
    let clients: Vec<courier_client::Client> = addrs
        .iter()
        .filter_map(|a| courier_client::Client::connect(a).ok())
        .collect();
    let mut last = usize::MAX;
    while start.elapsed() < within {
        let open = history.open_jobs();
        if open.is_empty() {
            say(&format!("drained in {:.1?}", start.elapsed()));
            return;
        }
        if open.len() != last {
            say(&format!("  {} jobs not completed yet", open.len()));
            last = open.len();
        }
        for (key, unknown) in open {
            if !unknown {
                continue;
            }
            for c in &clients {
                match c.get_job(key).await {
                    Err(e) if e.code() == Some(tonic::Code::NotFound) => {
                        history.gone(key);
                        break;
                    }
                    Ok(_) => break,
                    Err(_) => {}
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    say(&format!("not drained within {within:?}"));
    for (key, _) in history.open_jobs() {
        let mut state = "no gateway answered".to_string();
        for c in &clients {
            match c.get_job(key).await {
                Ok(j) => {
                    state = format!(
                        "{:?}, {} retries, worker {:?}, deadline {}, retry at {}",
                        j.state(),
                        j.retries,
                        j.worker,
                        j.deadline,
                        j.retry_at
                    );
                    break;
                }
                Err(e) if e.code() == Some(tonic::Code::NotFound) => {
                    state = "gone (NOT_FOUND)".into();
                    break;
                }
                Err(e) => state = e.to_string(),
            }
        }
        history.end_state(key, state);
    }
}

/// A line of the run's log, stamped with the wall clock.
fn say(line: &str) {
    let ms = history::now_ms();
    println!("[{}.{:03}] {line}", (ms / 1000) % 100_000, ms % 1000);
}
