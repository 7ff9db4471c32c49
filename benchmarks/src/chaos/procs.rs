//! The cluster's processes, each `courier` in its own network namespace, and the
//! brokers' data directories, each a small tmpfs of its own that a fault can fill.

use anyhow::{bail, Context};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::net::Net;

pub const GATEWAY_PORT: u16 = 26500;
const BROKER_PORT: u16 = 26501;
const METRICS_PORT: u16 = 9600;

/// One `courier` process in a namespace; killed when dropped.
pub struct Proc {
    ns: String,
    args: Vec<String>,
    log: PathBuf,
    child: Option<Child>,
    frozen: bool,
}

impl Proc {
    fn new(ns: &str, args: Vec<String>, log: PathBuf) -> Proc {
        Proc {
            ns: ns.to_string(),
            args,
            log,
            child: None,
            frozen: false,
        }
    }

    pub fn start(&mut self, courier: &Path) -> anyhow::Result<()> {
        self.kill();
        let log = File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("opening {}", self.log.display()))?;
        // `ip netns exec` enters the namespace and execs: the child is courier itself.
        let child = Command::new("ip")
            .args(["netns", "exec", &self.ns])
            .arg(courier)
            .args(&self.args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting courier")?;
        self.child = Some(child);
        Ok(())
    }

    fn signal(&self, name: &str) {
        if let Some(c) = &self.child {
            let _ = Command::new("kill")
                .args(["-s", name, &c.id().to_string()])
                .status();
        }
    }

    pub fn freeze(&mut self) {
        self.signal("STOP");
        self.frozen = true;
    }

    pub fn thaw(&mut self) {
        if self.frozen {
            self.signal("CONT");
            self.frozen = false;
        }
    }

    /// SIGKILL: no chance to flush or say goodbye.
    pub fn kill(&mut self) {
        self.thaw();
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then SIGKILL if it has not exited within `grace`.
    pub fn stop(&mut self, grace: Duration) {
        self.thaw();
        self.signal("TERM");
        if let Some(mut c) = self.child.take() {
            let until = std::time::Instant::now() + grace;
            while std::time::Instant::now() < until {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A tmpfs mounted on a broker's data directory; unmounted when dropped.
pub struct Disk {
    dir: PathBuf,
}

impl Disk {
    fn mount(dir: &Path, mib: u64) -> anyhow::Result<Disk> {
        std::fs::create_dir_all(dir)?;
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(dir)
            .status()
            .context("mount")?;
        if !status.success() {
            bail!("mounting a tmpfs on {} (are you root?)", dir.display());
        }
        Ok(Disk {
            dir: dir.to_path_buf(),
        })
    }

    fn filler(&self) -> PathBuf {
        self.dir.join("chaos-fill")
    }

    /// Fills the disk to the last byte.
    pub fn fill(&self) {
        let Ok(mut f) = File::create(self.filler()) else {
            return;
        };
        let chunk = vec![0u8; 1 << 20];
        while f.write_all(&chunk).is_ok() {}
        // The last partial megabyte.
        let mut small = vec![0u8; 4096];
        while f.write_all(&small).is_ok() {}
        small.truncate(1);
        while f.write_all(&small).is_ok() {}
    }

    pub fn free(&self) {
        let _ = std::fs::remove_file(self.filler());
    }
}

impl Drop for Disk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.dir).status();
    }
}

/// Three brokers (`b1`..) and the gateways (`g1`..), each in the namespace of the
/// same name.
pub struct Cluster {
    courier: PathBuf,
    // Dropped first: the processes die before their disks are unmounted.
    pub brokers: BTreeMap<u64, Proc>,
    pub gateways: Vec<Proc>,
    pub disks: BTreeMap<u64, Disk>,
    pub broker_metrics: BTreeMap<u64, String>,
    pub gateway_addrs: Vec<String>,
}

pub struct ClusterSpec<'a> {
    pub courier: &'a Path,
    pub dir: &'a Path,
    pub brokers: u64,
    pub gateways: usize,
    pub partitions: u32,
    pub disk_mib: u64,
}

impl Cluster {
    pub fn start(spec: &ClusterSpec<'_>, net: &Net) -> anyhow::Result<Cluster> {
        let broker_addr = |id: u64| format!("{}:{BROKER_PORT}", net.node(&format!("b{id}")).ip);
        let peers: Vec<String> = (1..=spec.brokers)
            .map(|id| format!("{id}={}", broker_addr(id)))
            .collect();
        let mut c = Cluster {
            courier: spec.courier.to_path_buf(),
            brokers: BTreeMap::new(),
            gateways: Vec::new(),
            disks: BTreeMap::new(),
            broker_metrics: BTreeMap::new(),
            gateway_addrs: Vec::new(),
        };
        for id in 1..=spec.brokers {
            let node = net.node(&format!("b{id}"));
            let data = spec.dir.join(format!("broker-{id}"));
            c.disks.insert(id, Disk::mount(&data, spec.disk_mib)?);
            let metrics = format!("{}:{METRICS_PORT}", node.ip);
            let args = vec![
                "broker".to_string(),
                "--node-id".into(),
                id.to_string(),
                "--addr".into(),
                broker_addr(id),
                "--peers".into(),
                peers.join(","),
                "--partitions".into(),
                spec.partitions.to_string(),
                "--replication-factor".into(),
                spec.brokers.min(3).to_string(),
                "--data-dir".into(),
                data.display().to_string(),
                "--metrics-addr".into(),
                metrics.clone(),
            ];
            let log = spec.dir.join(format!("broker-{id}.log"));
            let mut p = Proc::new(&node.ns, args, log);
            p.start(&c.courier)?;
            c.brokers.insert(id, p);
            c.broker_metrics.insert(id, metrics);
        }
        let brokers: Vec<String> = (1..=spec.brokers).map(broker_addr).collect();
        for g in 1..=spec.gateways {
            let node = net.node(&format!("g{g}"));
            let addr = format!("{}:{GATEWAY_PORT}", node.ip);
            let args = vec![
                "gateway".to_string(),
                "--addr".into(),
                addr.clone(),
                "--brokers".into(),
                brokers.join(","),
                "--metrics-addr".into(),
                format!("{}:{METRICS_PORT}", node.ip),
            ];
            let log = spec.dir.join(format!("gateway-{g}.log"));
            let mut p = Proc::new(&node.ns, args, log);
            p.start(&c.courier)?;
            c.gateways.push(p);
            c.gateway_addrs.push(addr);
        }
        Ok(c)
    }

    pub fn courier(&self) -> &Path {
        &self.courier
    }

    /// Every process by name (`b1`, `g1`, ...).
    pub fn proc_mut(&mut self, name: &str) -> Option<&mut Proc> {
        let (kind, n) = name.split_at(1);
        let n: usize = n.parse().ok()?;
        match kind {
            "b" => self.brokers.get_mut(&(n as u64)),
            "g" => self.gateways.get_mut(n.checked_sub(1)?),
            _ => None,
        }
    }

    /// Stops every process, gently.
    pub fn stop(&mut self) {
        for g in &mut self.gateways {
            g.stop(Duration::from_secs(10));
        }
        for b in self.brokers.values_mut() {
            b.stop(Duration::from_secs(10));
        }
    }
}

/// Reads `/metrics` at `addr` and sums every sample of `name`; `None` when the
/// endpoint does not answer.
pub async fn metric(addr: &str, name: &str) -> Option<f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let connect = tokio::net::TcpStream::connect(addr);
    let mut s = tokio::time::timeout(Duration::from_millis(500), connect)
        .await
        .ok()?
        .ok()?;
    let req = format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    s.write_all(req.as_bytes()).await.ok()?;
    let mut body = String::new();
    tokio::time::timeout(Duration::from_secs(2), s.read_to_string(&mut body))
        .await
        .ok()?
        .ok()?;
    Some(
        body.lines()
            .filter(|l| {
                l.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum(),
    )
}
