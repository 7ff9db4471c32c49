//! Several gateways: a client given all of them spreads its calls over them, per
//! call, and goes on over the others when one dies.

use crate::common;

use common::{serial, Cluster, ClusterOpts};
use courier_client::{Client, NewJob};
use std::time::{Duration, Instant};

/// Requests each gateway has answered so far.
async fn answered(cluster: &Cluster) -> Vec<f64> {
    cluster
        .gateway_metric_each("courier_gateway_requests_total")
        .await
}

/// Creates `n` jobs from `tasks` concurrent tasks; every one must be acknowledged.
async fn create_many(c: &Client, tasks: usize, n: usize) {
    let mut running = Vec::new();
    for _ in 0..tasks {
        let c = c.clone();
        running.push(tokio::spawn(async move {
            for _ in 0..n / tasks {
                c.create_job(NewJob::new("spread")).await.expect("create");
            }
        }));
    }
    for t in running {
        t.await.expect("creating task");
    }
}

/// Three gateways behind one client: each takes a share of the calls (none is
/// pinned), and with one killed every call still succeeds on the other two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_spreads_calls_over_its_gateways_and_outlives_one() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts::one_broker(2)).await;
    cluster.add_gateway();
    cluster.add_gateway();
    let c = Client::connect(&cluster.gateway_addrs.join(","))
        .expect("client")
        .with_retry_budget(Duration::from_secs(20));
    assert_eq!(c.gateway_addresses(), cluster.gateway_addrs);
    // Every gateway must be serving before shares mean anything.
    cluster.wait_gateways_serving().await;
    let before = answered(&cluster).await;
    create_many(&c, 12, 600).await;
    let after = answered(&cluster).await;
    let shares: Vec<f64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    let total: f64 = shares.iter().sum();
    assert!(total >= 600.0, "{shares:?}");
    for s in &shares {
        assert!(
            *s >= total * 0.15,
            "every gateway takes a share: {shares:?}"
        );
    }

    cluster.kill_gateway(1);
    // Calls made once its death shows go to the others. One on its connection
    // the moment it died fails UNKNOWN: whether the gateway acted on it cannot be
    // told, so it is not sent again.
    let dead = cluster.gateway_addrs[1].clone();
    common::wait_until(
        Duration::from_secs(10),
        "the killed gateway is gone",
        || {
            let dead = dead.clone();
            async move { tokio::net::TcpStream::connect(dead).await.is_err() }
        },
    )
    .await;
    // The client sees the death on its next call over the old connection, which
    // fails UNKNOWN; reads (safe to lose) find it before the creates do.
    for _ in 0..50 {
        if c.topology().await.is_err() {
            break;
        }
    }
    let started = Instant::now();
    create_many(&c, 12, 300).await;
    eprintln!(
        "300 creates with a gateway dead took {:?}",
        started.elapsed()
    );
    let last = answered(&cluster).await;
    let on_the_others = last[0] - after[0] + last[2] - after[2];
    assert!(on_the_others >= 300.0, "{last:?} after {after:?}");
}

/// A host name stands for every address it resolves to: `localhost` reaches a
/// gateway on 127.0.0.1 whatever else it resolves to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_name_reaches_the_gateways_it_resolves_to() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::one_broker(1)).await;
    let port = cluster.gateway_addr.rsplit(':').next().expect("a port");
    let c = Client::connect(&format!("localhost:{port}"))
        .expect("client")
        .with_retry_budget(Duration::from_secs(20));
    for _ in 0..20 {
        c.create_job(NewJob::new("named")).await.expect("create");
    }
    let addrs = c.gateway_addresses();
    assert!(
        addrs.contains(&format!("127.0.0.1:{port}")),
        "resolved: {addrs:?}"
    );
}

/// `courier dev --gateways 3` serves three gateways on consecutive ports in one
/// process: each answers, a job created through one is activated through another,
/// and Ctrl-C (SIGTERM) stops it cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn courier_dev_runs_several_gateways_on_consecutive_ports() {
    let _g = serial().await;
    // Taken first: ports are handed out in order, and the gateways take three.
    let metrics = format!("127.0.0.1:{}", common::free_port());
    let first = loop {
        let p = common::free_port();
        let free = |q: u16| std::net::TcpListener::bind(("127.0.0.1", q)).is_ok();
        if p < u16::MAX - 2 && free(p + 1) && free(p + 2) {
            break p;
        }
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let args: Vec<String> = [
        "dev",
        "--gateways",
        "3",
        "--gateway-addr",
        &format!("127.0.0.1:{first}"),
        "--metrics-addr",
        &metrics,
        "--data-dir",
        &dir.path().join("data").display().to_string(),
    ]
    .map(String::from)
    .to_vec();
    let mut dev = common::Proc::spawn(&args, dir.path().join("dev.log"));
    let addrs: Vec<String> = (0..3).map(|i| format!("127.0.0.1:{}", first + i)).collect();
    let clients: Vec<Client> = addrs
        .iter()
        .map(|a| {
            Client::connect(a)
                .expect("client")
                .with_retry_budget(Duration::from_secs(20))
        })
        .collect();
    for (c, a) in clients.iter().zip(&addrs) {
        common::wait_until(Duration::from_secs(30), &format!("{a} serves"), || async {
            c.topology().await.is_ok_and(|t| !t.brokers.is_empty())
        })
        .await;
    }
    let key = clients[2]
        .create_job(NewJob::new("dev-gateways"))
        .await
        .expect("create")
        .key;
    let got = clients[1]
        .activate_jobs(courier_client::ActivateJobs::new("dev-gateways").max_jobs(1))
        .await
        .expect("activate");
    assert_eq!(got.iter().map(|j| j.key).collect::<Vec<_>>(), [key]);
    assert!(dev.terminate(Duration::from_secs(10)), "dev exit status");
}
