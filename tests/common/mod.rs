//! Harness for cluster tests: real `courier broker` and `courier gateway` processes
//! on loopback ports, each with its own data directory and log file.
//!
//! Tests wait for conditions (a leader, a job state) with a deadline, never a fixed
//! sleep. Clusters of different tests never overlap: each test holds [`serial`].

#![allow(dead_code)]

pub mod disk;
pub mod proxy;
pub mod secure;

use courier_client::Client;
use courier_proto::cluster::{broker_client::BrokerClient, BrokerTopology, BrokerTopologyRequest};
use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The `courier` binary built for these tests.
pub fn courier_bin() -> &'static str {
    env!("CARGO_BIN_EXE_courier")
}

/// One cluster test at a time: a 2-core machine cannot run several clusters at once
/// and still meet their deadlines.
pub async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

/// A free loopback port for a process to listen on, handed out once per test process.
///
/// Taken below Linux's ephemeral range (32768-60999), never from it: a port the kernel
/// picked for us and we released can be given again as the local port of an outgoing
/// connection (a broker dialling its peers) before the process we meant it for binds it,
/// and that process then fails with "address in use" (seen in CI: a cluster started
/// with two brokers out of three).
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    // Where this process starts in the range, so concurrent test binaries rarely meet.
    static NEXT: AtomicU16 = AtomicU16::new(0);
    const LOW: u16 = 20_000;
    const SPAN: u16 = 12_000;
    let _ = NEXT.compare_exchange(
        0,
        (std::process::id() % u32::from(SPAN)) as u16 + 1,
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
    for _ in 0..SPAN {
        let port = LOW + NEXT.fetch_add(1, Ordering::SeqCst) % SPAN;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port between {LOW} and {}", LOW + SPAN)
}

/// How a test cluster is set up.
#[derive(Clone, Debug)]
pub struct ClusterOpts {
    pub brokers: u64,
    pub partitions: u32,
    pub replication_factor: u32,
    pub durability: &'static str,
    pub snapshot_every: u64,
    pub keep_after_snapshot: u64,
    /// Start the gateways with `--no-push`.
    pub gateway_no_push: bool,
    /// `--worker-threads` of every broker and gateway (None: their default).
    pub worker_threads: Option<u16>,
    /// `--lost-gateway-grace` of every broker (None: its default).
    pub lost_gateway_grace: Option<&'static str>,
    /// `--rebalance-after` of every broker (None: its default).
    pub rebalance_after: Option<&'static str>,
    /// `--election-timeout-min` and `--election-timeout-max` of every broker
    /// (None: their defaults).
    pub election_timeout: Option<(&'static str, &'static str)>,
    /// Mutual TLS between the processes, TLS and authentication at the gateway.
    pub secure: Option<std::sync::Arc<secure::Secure>>,
    /// A broker whose data directory is a tmpfs of the given size (`64m`), to fill.
    pub tmpfs: Option<(u64, &'static str)>,
    /// A broker whose flushes can be made to fail with EIO ([`disk::FaultyDisk`]).
    pub faulty_disk: Option<u64>,
    /// `--snapshot-every-bytes` of every broker (None: its default).
    pub snapshot_every_bytes: Option<u64>,
    /// `--max-partition-bytes` of every broker (None: its default).
    pub max_partition_bytes: Option<u64>,
    /// `--payload-memory-budget` of every broker (None: its default).
    pub payload_memory_budget: Option<u64>,
    /// `--stream-max-age` of every gateway (None: its default).
    pub stream_max_age: Option<&'static str>,
    /// `--otlp-endpoint` of every broker and gateway (None: no export).
    pub otlp_endpoint: Option<String>,
}

impl Default for ClusterOpts {
    fn default() -> Self {
        ClusterOpts {
            brokers: 3,
            partitions: 3,
            replication_factor: 3,
            durability: "fsync",
            snapshot_every: 20_000,
            keep_after_snapshot: 1000,
            gateway_no_push: false,
            worker_threads: None,
            lost_gateway_grace: None,
            rebalance_after: None,
            election_timeout: None,
            secure: None,
            tmpfs: None,
            faulty_disk: None,
            snapshot_every_bytes: None,
            max_partition_bytes: None,
            payload_memory_budget: None,
            stream_max_age: None,
            otlp_endpoint: None,
        }
    }
}

impl ClusterOpts {
    /// One broker holding `partitions`, no replication.
    pub fn one_broker(partitions: u32) -> ClusterOpts {
        ClusterOpts {
            brokers: 1,
            partitions,
            replication_factor: 1,
            ..ClusterOpts::default()
        }
    }
}

/// A `courier` process; killed when dropped.
pub struct Proc {
    child: Option<Child>,
    log: PathBuf,
}

impl Proc {
    /// A process not started yet (as if killed).
    pub fn not_started(log: PathBuf) -> Proc {
        Proc { child: None, log }
    }

    /// Starts `courier ARGS`, its stdout and stderr appended to `log`.
    pub fn spawn(args: &[String], log: PathBuf) -> Proc {
        Self::spawn_with_env(args, log, &[])
    }

    /// [`Proc::spawn`] with `env` added to the environment.
    pub fn spawn_with_env(args: &[String], log: PathBuf, env: &[(String, String)]) -> Proc {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("open log file");
        let err = out.try_clone().expect("clone log file");
        let child = Command::new(courier_bin())
            .args(args)
            .env("RUST_LOG", "info,openraft=warn")
            // Each test says how many threads its processes run, not the shell.
            .env_remove("COURIER_WORKER_THREADS")
            .env_remove("TOKIO_WORKER_THREADS")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .expect("start courier");
        Proc {
            child: Some(child),
            log,
        }
    }

    /// SIGSTOP (`stop`) or SIGCONT: the process hangs, as on a stalled machine, with
    /// its sockets open.
    fn signal_stop(&self, stop: bool) {
        if let Some(c) = &self.child {
            let status = Command::new("kill")
                .arg(if stop { "-STOP" } else { "-CONT" })
                .arg(c.id().to_string())
                .status()
                .expect("run kill");
            assert!(status.success(), "kill -STOP/-CONT failed");
        }
    }

    /// SIGTERM without waiting: the process begins its clean shutdown.
    fn ask_to_stop(&self) {
        if let Some(c) = &self.child {
            let status = Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status()
                .expect("run kill");
            assert!(status.success(), "kill -TERM failed");
        }
    }

    /// SIGKILL: a crash, not a shutdown.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait: a clean shutdown; returns whether it exited successfully.
    pub fn terminate(&mut self, within: Duration) -> bool {
        let Some(mut c) = self.child.take() else {
            return false;
        };
        let _ = Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status();
        let deadline = Instant::now() + within;
        loop {
            match c.try_wait() {
                Ok(Some(status)) => return status.success(),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => {
                    let _ = c.kill();
                    let _ = c.wait();
                    return false;
                }
            }
        }
    }
}

/// A running cluster: brokers and one gateway, each a real process.
pub struct Cluster {
    pub opts: ClusterOpts,
    pub dir: tempfile::TempDir,
    pub broker_addrs: BTreeMap<u64, String>,
    brokers: BTreeMap<u64, Proc>,
    /// Metrics address of each broker.
    pub broker_metrics: BTreeMap<u64, String>,
    gateways: Vec<Proc>,
    /// Client address of each gateway; the first is `gateway_addr`.
    pub gateway_addrs: Vec<String>,
    /// Metrics address of each gateway.
    pub gateway_metrics: Vec<String>,
    pub gateway_addr: String,
    /// The tmpfs data directory of a broker ([`ClusterOpts::tmpfs`]), unmounted
    /// after every process is gone.
    pub tmpfs: BTreeMap<u64, disk::Tmpfs>,
    /// The disk of [`ClusterOpts::faulty_disk`].
    pub faulty_disk: Option<disk::FaultyDisk>,
}

impl Cluster {
    /// Starts every broker and the gateway, and waits until every partition has a leader.
    pub async fn start(opts: ClusterOpts) -> Cluster {
        let dir = tempfile::tempdir().expect("temp dir");
        let broker_addrs: BTreeMap<u64, String> = (1..=opts.brokers)
            .map(|id| (id, format!("127.0.0.1:{}", free_port())))
            .collect();
        let broker_metrics = broker_addrs
            .keys()
            .map(|id| (*id, format!("127.0.0.1:{}", free_port())))
            .collect();
        let gateway_addr = format!("127.0.0.1:{}", free_port());
        let mut c = Cluster {
            opts,
            dir,
            broker_addrs,
            brokers: BTreeMap::new(),
            broker_metrics,
            gateways: Vec::new(),
            gateway_addrs: vec![gateway_addr.clone()],
            gateway_metrics: vec![format!("127.0.0.1:{}", free_port())],
            gateway_addr,
            tmpfs: BTreeMap::new(),
            faulty_disk: None,
        };
        if c.opts.faulty_disk.is_some() {
            c.faulty_disk = Some(disk::FaultyDisk::build(c.dir.path()));
        }
        if let Some((id, size)) = c.opts.tmpfs {
            c.tmpfs
                .insert(id, disk::Tmpfs::mount(&c.data_dir(id), size));
        }
        for id in 1..=c.opts.brokers {
            c.start_broker(id);
        }
        c.start_gateway(0);
        c.wait_for_leaders(Duration::from_secs(20)).await;
        // A majority elects leaders: make sure no broker failed to start.
        let ids: Vec<u64> = c.broker_addrs.keys().copied().collect();
        for id in ids {
            wait_until(
                Duration::from_secs(20),
                &format!("broker {id} answers"),
                || {
                    let c = &c;
                    async move { c.broker_topology(id).await.is_some() }
                },
            )
            .await;
        }
        c
    }

    fn peers(&self) -> String {
        self.broker_addrs
            .iter()
            .map(|(id, a)| format!("{id}={a}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn data_dir(&self, id: u64) -> PathBuf {
        self.dir.path().join(format!("broker-{id}"))
    }

    /// Starts (or restarts) broker `id` with its data directory.
    pub fn start_broker(&mut self, id: u64) {
        let mut args = vec![
            "broker".to_string(),
            "--node-id".into(),
            id.to_string(),
            "--addr".into(),
            self.broker_addrs[&id].clone(),
            "--peers".into(),
            self.peers(),
            "--partitions".into(),
            self.opts.partitions.to_string(),
            "--replication-factor".into(),
            self.opts.replication_factor.to_string(),
            "--data-dir".into(),
            self.data_dir(id).display().to_string(),
            "--durability".into(),
            self.opts.durability.into(),
            "--snapshot-every".into(),
            self.opts.snapshot_every.to_string(),
            "--keep-after-snapshot".into(),
            self.opts.keep_after_snapshot.to_string(),
            "--metrics-addr".into(),
            self.broker_metrics[&id].clone(),
        ];
        args.extend(self.worker_threads_args());
        if let Some(grace) = self.opts.lost_gateway_grace {
            args.extend(["--lost-gateway-grace".to_string(), grace.to_string()]);
        }
        if let Some(bytes) = self.opts.snapshot_every_bytes {
            args.extend(["--snapshot-every-bytes".to_string(), bytes.to_string()]);
        }
        if let Some(bytes) = self.opts.max_partition_bytes {
            args.extend(["--max-partition-bytes".to_string(), bytes.to_string()]);
        }
        if let Some(bytes) = self.opts.payload_memory_budget {
            args.extend(["--payload-memory-budget".to_string(), bytes.to_string()]);
        }
        if let Some(after) = self.opts.rebalance_after {
            args.extend(["--rebalance-after".to_string(), after.to_string()]);
        }
        if let Some((min, max)) = self.opts.election_timeout {
            args.extend([
                "--election-timeout-min".to_string(),
                min.to_string(),
                "--election-timeout-max".to_string(),
                max.to_string(),
            ]);
        }
        if let Some(s) = &self.opts.secure {
            args.extend(s.cluster_args("broker"));
        }
        args.extend(self.otlp_args());
        let log = self.dir.path().join(format!("broker-{id}.log"));
        let env = match &self.faulty_disk {
            Some(disk) if self.opts.faulty_disk == Some(id) => disk.env(),
            _ => Vec::new(),
        };
        self.brokers
            .insert(id, Proc::spawn_with_env(&args, log, &env));
    }

    fn otlp_args(&self) -> Vec<String> {
        match &self.opts.otlp_endpoint {
            Some(e) => vec!["--otlp-endpoint".into(), e.clone()],
            None => Vec::new(),
        }
    }

    fn worker_threads_args(&self) -> Vec<String> {
        match self.opts.worker_threads {
            Some(n) => vec!["--worker-threads".into(), n.to_string()],
            None => Vec::new(),
        }
    }

    /// Starts (or restarts) gateway `i` on its addresses.
    pub fn start_gateway(&mut self, i: usize) {
        let mut args = vec![
            "gateway".to_string(),
            "--addr".into(),
            self.gateway_addrs[i].clone(),
            "--brokers".into(),
            self.broker_addrs
                .values()
                .cloned()
                .collect::<Vec<_>>()
                .join(","),
            "--metrics-addr".into(),
            self.gateway_metrics[i].clone(),
        ];
        if self.opts.gateway_no_push {
            args.push("--no-push".into());
        }
        if let Some(age) = self.opts.stream_max_age {
            args.extend(["--stream-max-age".into(), age.into()]);
        }
        if let Some(s) = &self.opts.secure {
            args.extend(s.cluster_args("gateway"));
            args.extend(s.gateway_args());
        }
        args.extend(self.otlp_args());
        args.extend(self.worker_threads_args());
        let log = self.dir.path().join(format!("gateway-{i}.log"));
        let p = Proc::spawn(&args, log);
        if i < self.gateways.len() {
            self.gateways[i] = p;
        } else {
            self.gateways.push(p);
        }
    }

    /// Starts one more gateway; returns its index.
    pub fn add_gateway(&mut self) -> usize {
        let i = self.reserve_gateway();
        self.start_gateway(i);
        i
    }

    /// Addresses for one more gateway, not started (see [`Self::start_gateway`]);
    /// returns its index.
    pub fn reserve_gateway(&mut self) -> usize {
        self.gateway_addrs
            .push(format!("127.0.0.1:{}", free_port()));
        self.gateway_metrics
            .push(format!("127.0.0.1:{}", free_port()));
        let i = self.gateway_addrs.len() - 1;
        let log = self.dir.path().join(format!("gateway-{i}.log"));
        self.gateways.push(Proc::not_started(log));
        i
    }

    /// A client of gateway `i` (over TLS with the admin token on a secure cluster).
    pub fn client_of(&self, i: usize) -> Client {
        let security = match &self.opts.secure {
            Some(s) => s.with_token("admin"),
            None => courier_client::Security::default(),
        };
        Client::connect_with(&self.gateway_addrs[i], &security)
            .expect("client")
            .with_retry_budget(Duration::from_secs(20))
    }

    /// The sum over all label sets of a gateway's metric, 0 if absent.
    pub async fn gateway_metric(&self, i: usize, name: &str) -> f64 {
        metric(&self.gateway_metrics[i], name).await
    }

    /// Waits until every gateway answers a call (each through a client of its own).
    pub async fn wait_gateways_serving(&self) {
        for i in 0..self.gateway_addrs.len() {
            self.client_of(i)
                .topology()
                .await
                .unwrap_or_else(|e| panic!("gateway {i} serves: {e}"));
        }
    }

    /// A metric of every gateway, in order; 0 for a gateway that is down.
    pub async fn gateway_metric_each(&self, name: &str) -> Vec<f64> {
        let mut per = Vec::new();
        for addr in &self.gateway_metrics {
            per.push(metric(addr, name).await);
        }
        per
    }

    /// Jobs the first gateway handed out by push and by polling, in that order.
    pub async fn pushed_and_polled(&self) -> (f64, f64) {
        (
            self.gateway_metric(0, "courier_gateway_jobs_pushed_total")
                .await,
            self.gateway_metric(0, "courier_gateway_jobs_activated_total")
                .await,
        )
    }

    /// The sum over all label sets of a metric, over every live broker.
    pub async fn broker_metric(&self, name: &str) -> f64 {
        let mut total = 0.0;
        for addr in self.broker_metrics.values() {
            total += metric(addr, name).await;
        }
        total
    }

    /// Every broker and gateway moves to new ports (their data stays): like a
    /// restarted `courier dev`, whose brokers take free ports each time.
    pub fn move_to_new_ports(&mut self) {
        for id in self.broker_addrs.clone().keys() {
            self.broker_addrs
                .insert(*id, format!("127.0.0.1:{}", free_port()));
            self.broker_metrics
                .insert(*id, format!("127.0.0.1:{}", free_port()));
        }
    }

    /// What broker `id` has logged so far (every start of it).
    pub fn broker_log(&self, id: u64) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("broker-{id}.log")))
            .unwrap_or_default()
    }

    pub fn kill_broker(&mut self, id: u64) {
        if let Some(p) = self.brokers.get_mut(&id) {
            p.kill();
        }
    }

    /// Sends broker `id` SIGTERM and returns at once (see [`Cluster::terminate_broker`]
    /// to wait for its exit).
    pub fn ask_broker_to_stop(&self, id: u64) {
        if let Some(p) = self.brokers.get(&id) {
            p.ask_to_stop();
        }
    }

    /// Freezes broker `id` (SIGSTOP) or lets it go on (`frozen` false: SIGCONT).
    pub fn freeze_broker(&self, id: u64, frozen: bool) {
        if let Some(p) = self.brokers.get(&id) {
            p.signal_stop(frozen);
        }
    }

    pub fn kill_gateway(&mut self, i: usize) {
        if let Some(p) = self.gateways.get_mut(i) {
            p.kill();
        }
    }

    /// Stops broker `id` with SIGTERM; true when it exited cleanly in time.
    pub fn terminate_broker(&mut self, id: u64, within: Duration) -> bool {
        self.brokers
            .get_mut(&id)
            .map(|p| p.terminate(within))
            .unwrap_or(false)
    }

    pub fn terminate_gateway(&mut self, within: Duration) -> bool {
        self.gateways
            .first_mut()
            .map(|p| p.terminate(within))
            .unwrap_or(false)
    }

    pub fn client(&self) -> Client {
        self.client_of(0)
    }

    /// The topology broker `id` reports, if it answers (asked with the test
    /// client's cluster certificate on a secure cluster).
    pub async fn broker_topology(&self, id: u64) -> Option<BrokerTopology> {
        let addr = self.broker_addrs.get(&id)?;
        let mut endpoint = tonic::transport::Endpoint::from_shared(courier_proto::tls::peer_uri(
            addr,
            self.opts.secure.is_some(),
        ))
        .ok()?;
        if let Some(s) = &self.opts.secure {
            endpoint = endpoint.tls_config(s.peer_tls()).ok()?;
        }
        let channel = tokio::time::timeout(Duration::from_millis(500), endpoint.connect())
            .await
            .ok()?
            .ok()?;
        let mut c = BrokerClient::new(channel);
        let r = tokio::time::timeout(
            Duration::from_millis(500),
            c.topology(BrokerTopologyRequest {}),
        )
        .await
        .ok()?
        .ok()?;
        Some(r.into_inner())
    }

    /// partition -> leader id, as the live brokers report it (a broker claiming the
    /// leadership of a partition).
    pub async fn leaders(&self) -> BTreeMap<u32, u64> {
        let mut out = BTreeMap::new();
        let mut terms: BTreeMap<u32, u64> = BTreeMap::new();
        for id in self.broker_addrs.keys() {
            if let Some(t) = self.broker_topology(*id).await {
                for p in t.partitions {
                    if p.role == "leader" && terms.get(&p.partition_id).is_none_or(|x| *x < p.term)
                    {
                        terms.insert(p.partition_id, p.term);
                        out.insert(p.partition_id, *id);
                    }
                }
            }
        }
        out
    }

    /// The broker leading `partition`, waited for (10 s at most): leadership can be
    /// on its way, e.g. back to the partition's preferred broker.
    pub async fn leader_of(&self, partition: u32) -> u64 {
        let leader = std::sync::Mutex::new(None);
        wait_until(
            Duration::from_secs(10),
            "the partition has a leader",
            || async {
                let l = self.leaders().await.get(&partition).copied();
                *leader.lock().expect("lock") = l;
                l.is_some()
            },
        )
        .await;
        let l = leader.lock().expect("lock").expect("a leader");
        l
    }

    /// Waits (`within` at most) until a broker other than `old` leads `partition`.
    pub async fn wait_led_by_another(&self, partition: u32, old: u64, within: Duration) {
        wait_until(
            within,
            &format!("a broker other than {old} leads partition {partition}"),
            || async {
                self.leaders()
                    .await
                    .get(&partition)
                    .is_some_and(|l| *l != old)
            },
        )
        .await;
    }

    /// Waits until every partition has a leader and the gateway answers.
    pub async fn wait_for_leaders(&self, within: Duration) {
        let partitions = self.opts.partitions as usize;
        wait_until(within, "every partition has a leader", || async {
            self.leaders().await.len() == partitions
        })
        .await;
        let client = self.client();
        wait_until(within, "the gateway knows every leader", || async {
            match client.topology().await {
                Ok(t) => {
                    let mut led = std::collections::BTreeSet::new();
                    for b in &t.brokers {
                        for p in &b.partitions {
                            if p.role == 0 {
                                led.insert(p.partition_id);
                            }
                        }
                    }
                    led.len() == partitions
                }
                Err(_) => false,
            }
        })
        .await;
    }

    fn dump_logs(&self) {
        for entry in std::fs::read_dir(self.dir.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "log") {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(40).collect();
                eprintln!("----- {} (last 40 lines) -----", path.display());
                for l in tail.iter().rev() {
                    eprintln!("{l}");
                }
            }
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.dump_logs();
            // The whole of every log, and the data, for whoever looks into it.
            self.dir.disable_cleanup(true);
            eprintln!(
                "----- the cluster's logs and data are kept in {} -----",
                self.dir.path().display()
            );
        }
        for p in self.brokers.values_mut() {
            p.kill();
        }
        for g in &mut self.gateways {
            g.kill();
        }
    }
}

/// Polls `cond` every 25 ms until it holds; panics naming `what` after `within`.
pub async fn wait_until<F, Fut>(within: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if cond().await {
            return;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {within:?} waiting until {what}");
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Reads `/metrics` at `addr` over plain HTTP and sums every sample of `name`
/// (all label sets); 0 when the endpoint or the metric is missing.
pub async fn metric(addr: &str, name: &str) -> f64 {
    metrics_text(addr)
        .await
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The `/metrics` text at `addr`, read over plain HTTP; empty when it cannot be read.
pub async fn metrics_text(addr: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(Ok(mut s)) = tokio::time::timeout(
        Duration::from_millis(500),
        tokio::net::TcpStream::connect(addr),
    )
    .await
    else {
        return String::new();
    };
    let req = format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    if s.write_all(req.as_bytes()).await.is_err() {
        return String::new();
    }
    let mut body = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_string(&mut body)).await;
    body
}

/// Whether every job of `keys` is gone (completed or canceled): NOT_FOUND for each.
pub async fn all_gone(c: &Client, keys: &[i64]) -> bool {
    for k in keys.iter().rev() {
        match c.get_job(*k).await {
            Err(e) if e.code() == Some(tonic::Code::NotFound) => {}
            _ => return false,
        }
    }
    true
}

/// Whether a path exists (for snapshot files).
pub fn exists(p: &Path) -> bool {
    p.exists()
}

/// The created keys that do not answer NOT_FOUND (a completed job is gone), each
/// with what it answered instead.
pub async fn not_completed(c: &Client, keys: &[i64]) -> Vec<String> {
    let mut left = Vec::new();
    for k in keys {
        match c.get_job(*k).await {
            Err(e) if e.code() == Some(tonic::Code::NotFound) => {}
            Ok(job) => left.push(format!("{k}: state {}", job.state)),
            Err(e) => left.push(format!("{k}: {e}")),
        }
    }
    left
}

/// Waits (10 s at most) until every job of `keys` is completed; panics naming the
/// ones that are not. For clients that do not report failed completions themselves:
/// it covers only a read racing the last completion, not a wait for the worker.
pub async fn assert_all_completed(c: &Client, keys: &[i64]) {
    let mut left = Vec::new();
    let gone = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            left = not_completed(c, keys).await;
            if left.is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    })
    .await;
    assert!(
        gone.is_ok(),
        "{} of {} jobs are not completed, e.g. {:?}",
        left.len(),
        keys.len(),
        &left[..left.len().min(5)]
    );
}

/// A client program under test (a Zeebe client's worker script): its stdout and
/// stderr go to one file, it is killed when dropped however the test ends, and its
/// whole output is printed when the test fails.
pub struct ClientProc {
    child: Child,
    /// Not a `.log` file: the cluster prints only the last lines of those, and
    /// clients' stack traces run longer.
    out: PathBuf,
}

impl ClientProc {
    /// Starts `program args`, its output in `out`.
    pub fn spawn(program: &Path, args: &[&str], out: PathBuf) -> ClientProc {
        Self::spawn_with_env(program, args, &[], out)
    }

    /// [`ClientProc::spawn`] with `env` added to the environment.
    pub fn spawn_with_env(
        program: &Path,
        args: &[&str],
        env: &[(&str, String)],
        out: PathBuf,
    ) -> ClientProc {
        let file = std::fs::File::create(&out).expect("client output file");
        let child = Command::new(program)
            .args(args)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("client output file"))
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", program.display()));
        ClientProc { child, out }
    }

    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    /// The integers the client printed one a line (the job keys it handled).
    pub fn printed_keys(&self) -> std::collections::BTreeSet<i64> {
        self.output()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// Panics (the output is printed on drop) if the client has exited
    /// unsuccessfully; true if it has exited successfully.
    pub fn exited_ok(&mut self) -> bool {
        match self.child.try_wait().expect("poll client process") {
            None => false,
            Some(status) if status.success() => true,
            Some(status) => panic!("{} exited with {status}", self.out.display()),
        }
    }
}

impl ClientProc {
    /// Waits until the client has exited successfully (`within` at most), then
    /// checks that the keys it printed are exactly `keys`.
    pub async fn wait_for_keys(&mut self, within: Duration, keys: &[i64]) {
        let what = format!("{} handled every job and exited", self.out.display());
        wait_until(within, &what, || {
            let done = self.exited_ok();
            async move { done }
        })
        .await;
        assert_eq!(
            self.printed_keys(),
            keys.iter()
                .copied()
                .collect::<std::collections::BTreeSet<i64>>(),
            "the keys the client handled are not the keys created"
        );
    }
}

impl Drop for ClientProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("----- {} -----\n{}", self.out.display(), self.output());
        }
    }
}

/// Waits (10 s at most) until the brokers' metric `name`, summed over them, is `n`.
pub async fn wait_broker_metric(cluster: &Cluster, name: &str, n: f64) {
    wait_until(
        Duration::from_secs(10),
        &format!("the brokers' {name} is {n}"),
        || async { cluster.broker_metric(name).await == n },
    )
    .await;
}

/// Waits until the brokers hold `n` stream registrations in all (one per aggregated
/// gateway stream per broker).
pub async fn wait_registered(cluster: &Cluster, n: f64) {
    wait_broker_metric(cluster, "courier_broker_registered_streams", n).await;
}

/// Creates `batches` requests of `per_batch` jobs of `job_type`, each with a
/// variable `n` counting from 0 (several requests, so the jobs land on several
/// partitions), and returns their keys.
pub async fn create_in_batches(
    c: &Client,
    job_type: &str,
    batches: usize,
    per_batch: usize,
) -> Vec<i64> {
    let mut keys = Vec::new();
    for batch in 0..batches {
        let jobs = (0..per_batch).map(|i| {
            courier_client::NewJob::new(job_type)
                .variables(format!("{{\"n\":{}}}", batch * per_batch + i).as_str())
        });
        keys.extend(c.create_jobs(jobs).await.expect("create"));
    }
    assert_eq!(keys.len(), batches * per_batch);
    keys
}

/// The folder of the real clients' compatibility scripts and their packages
/// (`npm ci --prefix tests/compat`, its `.venv`), which scripts/test.sh installs.
pub fn compat_dir() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/compat")
}
