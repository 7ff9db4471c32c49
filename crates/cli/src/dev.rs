//! `courier dev`: a whole cluster in one process (brokers, one or more gateways,
//! `/metrics`), its data in one folder, stopped cleanly on Ctrl-C.

use crate::servers::{
    bind, runtime_workers, serve_metrics, shutdown_on_signal, wait_all, LostGateway, Memory,
    StreamLife,
};
use anyhow::{bail, Context};
use courier_broker::{BrokerConfig, Durability, RaftTuning};
use std::collections::BTreeMap;
use std::path::PathBuf;
use tokio::net::TcpListener;

#[derive(clap::Args)]
pub struct DevArgs {
    /// Brokers to run in this process.
    #[arg(long, default_value_t = 1)]
    brokers: u64,
    /// Partitions of the cluster.
    #[arg(long, default_value_t = 2)]
    partitions: u32,
    /// Replicas per partition (default: the number of brokers, at most 3).
    #[arg(long)]
    replication_factor: Option<u32>,
    /// Where the brokers keep their data (one folder per broker).
    #[arg(long, default_value = "./courier-data")]
    data_dir: PathBuf,
    /// Where the gateway listens for clients; further gateways take the ports
    /// after it.
    #[arg(long, default_value = "127.0.0.1:26500")]
    gateway_addr: String,
    /// Gateways to run, each on a port of its own, for trying out clients and
    /// workers over several gateways.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    gateways: u16,
    #[command(flatten)]
    stream_life: StreamLife,
    /// Where Prometheus metrics are served (`/metrics`); "off" to disable.
    #[arg(long, default_value = "127.0.0.1:9600")]
    metrics_addr: String,
    /// fsync (every append flushed before it counts) or replicated.
    #[arg(long, default_value = "fsync")]
    durability: Durability,
    #[command(flatten)]
    lost_gateway: LostGateway,
    #[command(flatten)]
    memory: Memory,
    #[command(flatten)]
    client_tls: crate::security::ClientPortTlsArgs,
    #[command(flatten)]
    auth: crate::security::AuthArgs,
    #[command(flatten)]
    pub runtime: DevRuntime,
    #[command(flatten)]
    pub otlp: crate::telemetry::OtlpArgs,
}

/// How `courier dev` sizes its runtime. One thread unless told otherwise: the whole
/// cluster runs in one process, so a job's every hop (producer's call, gateway,
/// broker, push) is a task waking another, and on one thread none of them waits for
/// a parked thread to be woken. `benchmarks/dev-threads.sh` measures it against one
/// thread per CPU (see benchmarks/RESULTS.md).
#[derive(clap::Args)]
pub struct DevRuntime {
    /// Threads that run the cluster's tasks (fsyncs and other blocking work keep
    /// their own threads).
    #[arg(long, env = "COURIER_WORKER_THREADS", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..))]
    worker_threads: u16,
}

impl DevRuntime {
    pub fn worker_threads(&self) -> usize {
        usize::from(self.worker_threads)
    }
}

pub async fn dev(a: DevArgs) -> anyhow::Result<()> {
    if a.brokers < 1 {
        bail!("--brokers must be at least 1");
    }
    // The brokers speak mutual TLS with a CA of this run's own, so they are never
    // open, even on loopback.
    let cluster_tls = crate::security::dev_cluster_tls().context("cluster TLS")?;
    let shutdown = shutdown_on_signal();
    let rf = a.replication_factor.unwrap_or(a.brokers.min(3) as u32);
    // Brokers listen on free loopback ports; peers find each other through the
    // static configuration, so the ports may differ from one run to the next.
    let mut listeners = Vec::new();
    let mut brokers = BTreeMap::new();
    for id in 1..=a.brokers {
        let l = bind("127.0.0.1:0").await?;
        brokers.insert(id, l.local_addr()?.to_string());
        listeners.push((id, l));
    }
    let gateway_listeners = bind_gateways(&a.gateway_addr, a.gateways).await?;
    let gateway_addrs = gateway_listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.to_string()))
        .collect::<Result<Vec<_>, _>>()?
        .join(",");
    // The status page shows the first gateway's view.
    let inspector = courier_gateway::service::InspectorSlot::default();
    if a.metrics_addr != "off" {
        serve_metrics(&a.metrics_addr, Some(inspector.clone()), shutdown.clone()).await?;
    }
    let configs: Vec<(BrokerConfig, _)> = listeners
        .into_iter()
        .map(|(id, listener)| {
            let config = BrokerConfig {
                node_id: id,
                brokers: brokers.clone(),
                partitions: a.partitions,
                replication_factor: rf,
                data_dir: a.data_dir.join(format!("broker-{id}")),
                durability: a.durability,
                raft: RaftTuning::default(),
                lost_gateway_grace: a.lost_gateway.lost_gateway_grace.0,
                // Every broker of dev stops at once: there is no one to hand to.
                hand_off_leadership: false,
                rebalance_after: Some(courier_broker::config::DEFAULT_REBALANCE_AFTER),
                cluster_tls: Some(cluster_tls.clone()),
                memory: a.memory.config(),
            };
            (config, listener)
        })
        .collect();
    // Every broker's directory is checked before any starts: one that refuses
    // must not leave the others' directories marked with the shape it refused.
    for (config, _) in &configs {
        courier_broker::store::compare_shape(&config.data_dir, &config.shape())
            .map_err(|e| anyhow::anyhow!("broker {}: {e}", config.node_id))?;
    }
    let mut tasks = tokio::task::JoinSet::new();
    for (config, listener) in configs {
        let id = config.node_id;
        let s = shutdown.clone();
        tasks.spawn(async move {
            courier_broker::run(config, listener, s)
                .await
                .with_context(|| format!("broker {id}"))
        });
    }
    for (i, listener) in gateway_listeners.into_iter().enumerate() {
        let gw_config = courier_gateway::GatewayConfig {
            inspector: (i == 0).then(|| inspector.clone()),
            brokers: brokers.values().cloned().collect(),
            tls: a.client_tls.config(),
            cluster_tls: Some(cluster_tls.clone()),
            auth: a.auth.config(),
            stream_max_age: a.stream_life.stream_max_age.0,
            ..Default::default()
        };
        let s = shutdown.clone();
        tasks.spawn(async move {
            courier_gateway::serve(gw_config, listener, s)
                .await
                .with_context(|| format!("gateway {}", i + 1))
        });
    }
    eprintln!(
        "courier dev: {} broker(s), {} partition(s), replication factor {rf}, durability {:?}\n  gateway  {} ({})\n  auth     {}\n  brokers  mutual TLS with a CA of this run, held in memory\n  metrics  {}\n  data     {}\n  threads  {} (--worker-threads)\nPress Ctrl-C to stop.",
        a.brokers,
        a.partitions,
        a.durability,
        gateway_addrs,
        if a.client_tls.config().is_some() { "TLS" } else { "plaintext" },
        a.auth.describe(),
        if a.metrics_addr == "off" { "off".to_string() } else { format!("http://{}/metrics", a.metrics_addr) },
        a.data_dir.display(),
        runtime_workers(),
    );
    wait_all(tasks, shutdown).await
}

/// Listeners for `n` gateways: the first on `addr`, the others on the ports after
/// it (on free ports, when `addr` asks for any port).
async fn bind_gateways(addr: &str, n: u16) -> anyhow::Result<Vec<TcpListener>> {
    let first = bind(addr).await?;
    let at = first.local_addr()?;
    let asked_any = addr.ends_with(":0");
    let mut listeners = vec![first];
    for i in 1..n {
        let port = if asked_any {
            0
        } else {
            at.port()
                .checked_add(i)
                .with_context(|| format!("no port after {at} for gateway {}", i + 1))?
        };
        listeners.push(bind(&std::net::SocketAddr::new(at.ip(), port).to_string()).await?);
    }
    Ok(listeners)
}
