//! The nemesis: the faults a run injects, how each is made and how it is healed.

use super::net::Net;
use super::procs::{metric, Cluster};
use anyhow::bail;
use rand::rngs::StdRng;
use rand::Rng;
use std::fmt;

/// The kinds of fault, as `--faults` names them.
pub const KINDS: [&str; 8] = [
    "partition",
    "one-way",
    "isolate",
    "gateway-cut",
    "freeze",
    "kill",
    "kill-majority",
    "disk-full",
];

#[derive(Clone, Debug)]
pub enum Fault {
    /// Two brokers cannot reach each other.
    Partition { a: String, b: String },
    /// One broker's packets to another are dropped; the other way still works.
    OneWay { from: String, to: String },
    /// A broker can reach no other process, nor they it.
    Isolate { broker: String },
    /// A gateway and a broker cannot reach each other.
    GatewayCut { gateway: String, broker: String },
    /// A process is stopped (SIGSTOP) and continued at the heal.
    Freeze { node: String },
    /// A process is killed (SIGKILL) and started again at the heal.
    Kill { node: String },
    /// A majority of the brokers is killed: no partition can commit until the heal
    /// starts them again.
    KillMajority { brokers: Vec<String> },
    /// A broker's data disk is filled; at the heal the space is freed and the broker
    /// restarted if its storage failed (it stops its replicas for good until then).
    DiskFull { broker: String },
}

impl Fault {
    pub fn kind(&self) -> &'static str {
        match self {
            Fault::Partition { .. } => "partition",
            Fault::OneWay { .. } => "one-way",
            Fault::Isolate { .. } => "isolate",
            Fault::GatewayCut { .. } => "gateway-cut",
            Fault::Freeze { .. } => "freeze",
            Fault::Kill { .. } => "kill",
            Fault::KillMajority { .. } => "kill-majority",
            Fault::DiskFull { .. } => "disk-full",
        }
    }

    /// A fault of `kind` on processes drawn from `brokers` and `gateways`.
    pub fn draw(kind: &str, rng: &mut StdRng, brokers: &[String], gateways: &[String]) -> Fault {
        let pick = |rng: &mut StdRng, of: &[String]| of[rng.random_range(0..of.len())].clone();
        let two = |rng: &mut StdRng| {
            let a = rng.random_range(0..brokers.len());
            let b = (a + rng.random_range(1..brokers.len())) % brokers.len();
            (brokers[a].clone(), brokers[b].clone())
        };
        match kind {
            "partition" => {
                let (a, b) = two(rng);
                Fault::Partition { a, b }
            }
            "one-way" => {
                let (from, to) = two(rng);
                Fault::OneWay { from, to }
            }
            "isolate" => Fault::Isolate {
                broker: pick(rng, brokers),
            },
            "gateway-cut" => Fault::GatewayCut {
                gateway: pick(rng, gateways),
                broker: pick(rng, brokers),
            },
            "kill" | "freeze" => {
                // Brokers twice as often as gateways: they hold the state.
                let all: Vec<String> = brokers
                    .iter()
                    .chain(brokers)
                    .chain(gateways)
                    .cloned()
                    .collect();
                let node = pick(rng, &all);
                if kind == "kill" {
                    Fault::Kill { node }
                } else {
                    Fault::Freeze { node }
                }
            }
            "kill-majority" => {
                let mut left = brokers.to_vec();
                let mut gone = Vec::new();
                while gone.len() <= brokers.len() / 2 {
                    gone.push(left.swap_remove(rng.random_range(0..left.len())));
                }
                gone.sort();
                Fault::KillMajority { brokers: gone }
            }
            _ => Fault::DiskFull {
                broker: pick(rng, brokers),
            },
        }
    }

    pub fn inject(&self, net: &Net, cluster: &mut Cluster) -> anyhow::Result<()> {
        match self {
            Fault::Partition { a, b } => {
                net.cut(a, b)?;
                net.cut(b, a)
            }
            Fault::OneWay { from, to } => net.cut(from, to),
            Fault::Isolate { broker } => {
                for other in net.nodes.iter().filter(|n| &n.name != broker) {
                    net.cut(broker, &other.name)?;
                    net.cut(&other.name, broker)?;
                }
                Ok(())
            }
            Fault::GatewayCut { gateway, broker } => {
                net.cut(gateway, broker)?;
                net.cut(broker, gateway)
            }
            Fault::Freeze { node } => {
                proc_of(cluster, node)?.freeze();
                Ok(())
            }
            Fault::Kill { node } => {
                proc_of(cluster, node)?.kill();
                Ok(())
            }
            Fault::KillMajority { brokers } => {
                for b in brokers {
                    proc_of(cluster, b)?.kill();
                }
                Ok(())
            }
            Fault::DiskFull { broker } => {
                let disk = cluster.disks.get(&broker_id(broker)?);
                if let Some(d) = disk {
                    d.fill();
                }
                Ok(())
            }
        }
    }

    /// Undoes the fault. Returns whether a broker had to be restarted because its
    /// storage failed.
    pub async fn heal(&self, net: &Net, cluster: &mut Cluster) -> anyhow::Result<bool> {
        net.heal()?;
        let courier = cluster.courier().to_path_buf();
        match self {
            Fault::Freeze { node } => proc_of(cluster, node)?.thaw(),
            Fault::Kill { node } => proc_of(cluster, node)?.start(&courier)?,
            Fault::KillMajority { brokers } => {
                for b in brokers {
                    proc_of(cluster, b)?.start(&courier)?;
                }
            }
            Fault::DiskFull { broker } => {
                let id = broker_id(broker)?;
                if let Some(d) = cluster.disks.get(&id) {
                    d.free();
                }
                let failed = match cluster.broker_metrics.get(&id) {
                    Some(addr) => metric(addr, "courier_broker_storage_failed").await,
                    None => None,
                };
                // Failed, or not answering at all: an operator restarts it.
                if failed.is_none_or(|v| v > 0.0) {
                    let p = proc_of(cluster, broker)?;
                    p.kill();
                    p.start(&courier)?;
                    return Ok(true);
                }
            }
            _ => {}
        }
        Ok(false)
    }
}

fn broker_id(name: &str) -> anyhow::Result<u64> {
    match name.strip_prefix('b').and_then(|n| n.parse().ok()) {
        Some(id) => Ok(id),
        None => bail!("{name} is not a broker"),
    }
}

fn proc_of<'a>(cluster: &'a mut Cluster, name: &str) -> anyhow::Result<&'a mut super::procs::Proc> {
    match cluster.proc_mut(name) {
        Some(p) => Ok(p),
        None => bail!("no process {name}"),
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::Partition { a, b } => write!(f, "partition {a} <-> {b}"),
            Fault::OneWay { from, to } => write!(f, "one-way cut {from} -> {to}"),
            Fault::Isolate { broker } => write!(f, "isolate {broker}"),
            Fault::GatewayCut { gateway, broker } => write!(f, "cut {gateway} <-> {broker}"),
            Fault::Freeze { node } => write!(f, "freeze {node}"),
            Fault::Kill { node } => write!(f, "kill {node}"),
            Fault::KillMajority { brokers } => write!(f, "kill {}", brokers.join(" and ")),
            Fault::DiskFull { broker } => write!(f, "fill the disk of {broker}"),
        }
    }
}
