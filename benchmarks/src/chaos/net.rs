//! The run's network: a bridge in the host's namespace and one network namespace per
//! process, each with a veth pair on the bridge and an nftables table whose output
//! chain drops what a fault says. Only the addresses made here are used.

use anyhow::{bail, Context};
use std::net::Ipv4Addr;
use std::process::Command;

/// Runs `ip` or `nft` (optionally inside namespace `ns`); an error carries stderr.
fn run(ns: Option<&str>, program: &str, args: &[&str]) -> anyhow::Result<()> {
    let mut cmd = match ns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, program]);
            c
        }
        None => Command::new(program),
    };
    let out = cmd
        .args(args)
        .output()
        .with_context(|| format!("running {program} (is it installed?)"))?;
    if !out.status.success() {
        bail!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// One process's place on the network.
pub struct Node {
    pub name: String,
    pub ns: String,
    pub ip: Ipv4Addr,
}

pub struct Net {
    bridge: String,
    pub host_ip: Ipv4Addr,
    pub nodes: Vec<Node>,
}

impl Net {
    /// Builds the bridge and a namespace for each of `names`. `id` (the process id)
    /// keeps names and the subnet apart from any other run's.
    pub fn create(id: u32, names: &[String]) -> anyhow::Result<Net> {
        remove_stale();
        let subnet = u8::try_from(20 + id % 200).unwrap_or(20);
        let bridge = format!("cc{id}br");
        let mut net = Net {
            bridge: bridge.clone(),
            host_ip: Ipv4Addr::new(10, 213, subnet, 1),
            nodes: Vec::new(),
        };
        run(None, "ip", &["link", "add", &bridge, "type", "bridge"])?;
        run(
            None,
            "ip",
            &[
                "addr",
                "add",
                &format!("{}/24", net.host_ip),
                "dev",
                &bridge,
            ],
        )?;
        run(None, "ip", &["link", "set", &bridge, "up"])?;
        for (i, name) in names.iter().enumerate() {
            let ip = Ipv4Addr::new(10, 213, subnet, u8::try_from(10 + i).unwrap_or(250));
            let node = Node {
                name: name.clone(),
                ns: format!("courier-chaos-{id}-{name}"),
                ip,
            };
            // Pushed first so that Drop removes a namespace half set up.
            net.nodes.push(node);
            if let Some(node) = net.nodes.last() {
                add_node(&bridge, &format!("cc{id}{name}"), node)?;
            }
        }
        Ok(net)
    }

    pub fn node(&self, name: &str) -> &Node {
        match self.nodes.iter().find(|n| n.name == name) {
            Some(n) => n,
            None => unreachable!("no node {name} in this run"),
        }
    }

    /// Drops every packet `from` sends to `to` (one way; `to` still reaches `from`).
    pub fn cut(&self, from: &str, to: &str) -> anyhow::Result<()> {
        let to = self.node(to).ip.to_string();
        run(
            Some(&self.node(from).ns),
            "nft",
            &[
                "add", "rule", "inet", "chaos", "out", "ip", "daddr", &to, "drop",
            ],
        )
    }

    /// Removes every cut.
    pub fn heal(&self) -> anyhow::Result<()> {
        for n in &self.nodes {
            run(
                Some(&n.ns),
                "nft",
                &["flush", "chain", "inet", "chaos", "out"],
            )?;
        }
        Ok(())
    }
}

fn add_node(bridge: &str, veth: &str, node: &Node) -> anyhow::Result<()> {
    run(None, "ip", &["netns", "add", &node.ns])?;
    run(
        None,
        "ip",
        &[
            "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", &node.ns,
        ],
    )?;
    run(None, "ip", &["link", "set", veth, "master", bridge, "up"])?;
    let ns = Some(node.ns.as_str());
    run(
        ns,
        "ip",
        &["addr", "add", &format!("{}/24", node.ip), "dev", "eth0"],
    )?;
    run(ns, "ip", &["link", "set", "eth0", "up"])?;
    run(ns, "ip", &["link", "set", "lo", "up"])?;
    run(ns, "nft", &["add", "table", "inet", "chaos"])?;
    run(
        ns,
        "nft",
        &["add chain inet chaos out { type filter hook output priority 0; policy accept; }"],
    )
}

impl Drop for Net {
    fn drop(&mut self) {
        for n in &self.nodes {
            let _ = run(None, "ip", &["netns", "del", &n.ns]);
        }
        let _ = run(None, "ip", &["link", "del", &self.bridge]);
    }
}

/// Deletes the namespaces and bridges of earlier runs whose process is gone (a run
/// killed before it could clean up).
fn remove_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(ns) = line.split_whitespace().next() else {
            continue;
        };
        let Some(rest) = ns.strip_prefix("courier-chaos-") else {
            continue;
        };
        let Some(pid) = rest.split('-').next() else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = run(None, "ip", &["netns", "del", ns]);
            let _ = run(None, "ip", &["link", "del", &format!("cc{pid}br")]);
        }
    }
}
