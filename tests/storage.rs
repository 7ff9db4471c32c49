//! Storage faults are fail-stop: a broker whose data directory (a real tmpfs) runs
//! out of space, or whose flushes fail with EIO (libc's fdatasync and fsync made to
//! fail in the broker's process), stops its replicas for good, leaves leadership,
//! says it is unhealthy (health service, topology, metric, `courier status`), and
//! once the fault is gone a restart recovers with no acknowledged job lost.

use crate::common;

use common::{serial, wait_until, Cluster, ClusterOpts};
use courier_client::{Client, JobState, NewJob};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tonic_health::pb::health_check_response::ServingStatus;

/// Producers creating jobs of `job_type` until stopped; the keys acknowledged.
struct Producers {
    acked: Arc<Mutex<Vec<i64>>>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Producers {
    fn start(c: &Client, job_type: &'static str, n: usize) -> Producers {
        let acked = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..n)
            .map(|w| {
                let (c, acked, stop) = (c.clone(), acked.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        i += 1;
                        let vars = format!("{{\"w\":{w},\"i\":{i}}}");
                        // Not acknowledged: allowed to be lost (or created: a
                        // command in flight at the fault may have been carried out).
                        if let Ok(r) = c
                            .create_job(NewJob::new(job_type).variables(vars.as_str()))
                            .await
                        {
                            acked.lock().unwrap().push(r.key);
                        }
                    }
                })
            })
            .collect();
        Producers { acked, stop, tasks }
    }

    fn count(&self) -> usize {
        self.acked.lock().unwrap().len()
    }

    async fn wait_for_more(&self, n: usize, what: &str) {
        let before = self.count();
        wait_until(Duration::from_secs(20), what, || async {
            self.count() >= before + n
        })
        .await;
    }

    async fn stop(self) -> Vec<i64> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.unwrap();
        }
        let keys = self.acked.lock().unwrap().clone();
        let unique: BTreeSet<i64> = keys.iter().copied().collect();
        assert_eq!(unique.len(), keys.len(), "a key was acknowledged twice");
        keys
    }
}

/// The health status broker `id` serves for the whole server.
async fn broker_health(cluster: &Cluster, id: u64) -> Option<i32> {
    let addr = format!("http://{}", cluster.broker_addrs[&id]);
    let channel = tonic::transport::Endpoint::from_shared(addr)
        .ok()?
        .connect()
        .await
        .ok()?;
    let r = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .ok()?;
    Some(r.into_inner().status)
}

/// What broker `id` says failed in its storage, once it says so.
async fn storage_failure(cluster: &Cluster, id: u64) -> Option<String> {
    let t = cluster.broker_topology(id).await?;
    (!t.storage_failure.is_empty()).then_some(t.storage_failure)
}

async fn courier_status(cluster: &Cluster) -> String {
    let out = tokio::process::Command::new(common::courier_bin())
        .args(["status", "--address", &cluster.gateway_addr])
        .output()
        .await
        .expect("courier status");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Every key is there once and activatable: none was lost, none is there twice.
async fn assert_all_activatable(c: &Client, keys: &[i64]) {
    for k in keys {
        let state = c.get_job(*k).await.map(|j| j.state);
        assert_eq!(
            state.ok(),
            Some(JobState::Activatable as i32),
            "acknowledged job {k} lost"
        );
    }
}

/// How broker 1's storage is made to fail, and made whole again.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// Its data directory, a small tmpfs, is filled: writes fail with ENOSPC.
    DiskFull,
    /// Its flushes (fdatasync, fsync) fail with EIO, as a failing device's do.
    FlushFails,
}

impl Fault {
    fn opts(self) -> ClusterOpts {
        match self {
            Fault::DiskFull => ClusterOpts {
                tmpfs: Some((1, "64m")),
                ..ClusterOpts::default()
            },
            Fault::FlushFails => ClusterOpts {
                faulty_disk: Some(1),
                ..ClusterOpts::default()
            },
        }
    }

    fn inject(self, cluster: &Cluster) {
        match self {
            Fault::DiskFull => {
                let filled = cluster.tmpfs[&1].fill();
                eprintln!("broker 1's disk filled with {filled} bytes");
            }
            Fault::FlushFails => cluster.faulty_disk.as_ref().expect("faulty disk").fail(),
        }
    }

    fn heal(self, cluster: &Cluster) {
        match self {
            Fault::DiskFull => cluster.tmpfs[&1].free(),
            Fault::FlushFails => cluster.faulty_disk.as_ref().expect("faulty disk").heal(),
        }
    }

    /// What the broker's error says.
    fn message(self) -> &'static str {
        match self {
            Fault::DiskFull => "No space left on device",
            Fault::FlushFails => "Input/output error",
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_whose_disk_fills_stops_for_good_and_its_peers_serve_on() {
    a_broker_whose_storage_fails_stops_for_good_and_its_peers_serve_on(Fault::DiskFull).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_whose_flushes_fail_with_eio_stops_for_good_and_its_peers_serve_on() {
    a_broker_whose_storage_fails_stops_for_good_and_its_peers_serve_on(Fault::FlushFails).await;
}

async fn a_broker_whose_storage_fails_stops_for_good_and_its_peers_serve_on(fault: Fault) {
    let _g = serial().await;
    let mut cluster = Cluster::start(fault.opts()).await;
    // Broker 1 is partition 1's preferred leader: it leads once settled, so the
    // fault hits a leader.
    wait_until(
        Duration::from_secs(20),
        "broker 1 leads a partition",
        || async { cluster.leaders().await.values().any(|l| *l == 1) },
    )
    .await;
    let c = cluster.client();
    let producers = Producers::start(&c, "stored", 3);
    producers.wait_for_more(200, "jobs are acknowledged").await;

    fault.inject(&cluster);
    let full_at = Instant::now();
    wait_until(
        Duration::from_secs(15),
        "broker 1 reports its storage failed",
        || async { storage_failure(&cluster, 1).await.is_some() },
    )
    .await;
    let failure = storage_failure(&cluster, 1).await.unwrap();
    assert!(failure.contains(fault.message()), "{failure}");
    // It leaves leadership, and the others lead every partition.
    wait_until(
        Duration::from_secs(10),
        "every partition is led by another broker",
        || async {
            let leaders = cluster.leaders().await;
            leaders.len() == 3 && leaders.values().all(|l| *l != 1)
        },
    )
    .await;
    eprintln!(
        "partitions led elsewhere {:?} after the fault ({fault:?})",
        full_at.elapsed()
    );
    let t = cluster.broker_topology(1).await.unwrap();
    assert!(
        t.partitions.iter().all(|p| p.role == "shutdown"),
        "its replicas are stopped: {t:?}"
    );
    assert_eq!(
        broker_health(&cluster, 1).await,
        Some(ServingStatus::NotServing as i32)
    );
    assert_eq!(
        broker_health(&cluster, 2).await,
        Some(ServingStatus::Serving as i32)
    );
    let failed = common::metric(&cluster.broker_metrics[&1], "courier_broker_storage_failed").await;
    assert_eq!(failed, 1.0);
    wait_until(
        Duration::from_secs(10),
        "courier status shows broker 1 dead",
        || async {
            let text = courier_status(&cluster).await;
            text.lines()
                .any(|l| l.starts_with("1 ") && l.contains("inactive dead"))
                && text.contains("the storage of broker 1 failed")
        },
    )
    .await;
    // The others serve on.
    producers
        .wait_for_more(200, "creates succeed on the other brokers")
        .await;
    let keys = producers.stop().await;
    let log = cluster.broker_log(1);
    assert_eq!(
        log.matches("STORAGE FAILED").count(),
        1,
        "said once:\n{log}"
    );
    assert!(!log.contains("panicked"), "{log}");

    // The fault gone (space freed, the device replaced), a restart recovers: it
    // catches up and every job is there once.
    cluster.kill_broker(1);
    fault.heal(&cluster);
    cluster.start_broker(1);
    wait_until(Duration::from_secs(30), "broker 1 is back", || async {
        cluster.broker_topology(1).await.is_some_and(|t| {
            t.storage_failure.is_empty()
                && t.partitions
                    .iter()
                    .all(|p| p.role == "follower" || p.role == "leader")
        })
    })
    .await;
    assert_eq!(
        broker_health(&cluster, 1).await,
        Some(ServingStatus::Serving as i32)
    );
    let failed = common::metric(&cluster.broker_metrics[&1], "courier_broker_storage_failed").await;
    assert_eq!(failed, 0.0);
    let applied = |t: courier_proto::cluster::BrokerTopology| {
        t.partitions
            .iter()
            .map(|p| (p.partition_id, p.last_applied))
            .collect::<Vec<_>>()
    };
    let on_2 = applied(cluster.broker_topology(2).await.unwrap());
    wait_until(Duration::from_secs(30), "broker 1 caught up", || async {
        let on_1 = applied(cluster.broker_topology(1).await.unwrap_or_default());
        on_2.iter()
            .all(|(p, at)| on_1.iter().any(|(q, a)| q == p && a >= at))
    })
    .await;
    assert_all_activatable(&cluster.client(), &keys).await;
}

/// With one replica the failed disk holds the only copy: what it acknowledged must
/// all be there after the restart. Meanwhile requests fail at once, not hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_broker_whose_disk_fills_loses_no_acknowledged_job() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts {
        tmpfs: Some((1, "64m")),
        ..ClusterOpts::one_broker(2)
    })
    .await;
    let c = cluster.client();
    let producers = Producers::start(&c, "alone", 2);
    producers.wait_for_more(200, "jobs are acknowledged").await;
    cluster.tmpfs[&1].fill();
    wait_until(
        Duration::from_secs(15),
        "the broker reports its storage failed",
        || async { storage_failure(&cluster, 1).await.is_some() },
    )
    .await;
    let keys = producers.stop().await;
    // No partition can be served: a create is refused within its retry budget.
    let once = c.clone().with_retry_budget(Duration::from_secs(2));
    let started = Instant::now();
    let e = once
        .create_job(NewJob::new("alone"))
        .await
        .expect_err("no replica serves");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "took {:?}: {e}",
        started.elapsed()
    );
    assert_eq!(e.code(), Some(tonic::Code::Unavailable), "{e}");

    cluster.kill_broker(1);
    cluster.tmpfs[&1].free();
    cluster.start_broker(1);
    cluster.wait_for_leaders(Duration::from_secs(30)).await;
    assert_all_activatable(&cluster.client(), &keys).await;
    eprintln!(
        "{} acknowledged jobs all there after the restart",
        keys.len()
    );
}
