//! The gateway against real brokers in this process: real openraft, fjall files in
//! temporary folders and Raft over loopback between the brokers, but the gateway
//! reaches them through `courier_proto::api::InProcess` instead of gRPC. Clients
//! still talk to the gateway over gRPC. Kills, freezes, cuts and the Zeebe clients
//! are tested with real processes in the workspace's `tests/`.

// Test code: a failed expectation is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use courier_broker::{BrokerConfig, Durability, RaftTuning};
use courier_proto::api::{Connect, InProcess};
use courier_proto::courier_v1 as v1;
use courier_proto::courier_v1::jobs_client::JobsClient;
use courier_proto::gateway_protocol as gw;
use courier_proto::gateway_protocol::gateway_client::GatewayClient;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};
use tonic::Code;

/// Three brokers (two partitions, each on all three) and a gateway in this process.
struct Cluster {
    _dirs: Vec<tempfile::TempDir>,
    addrs: BTreeMap<u64, String>,
    stops: BTreeMap<u64, CancellationToken>,
    brokers: InProcess,
    gateway: Channel,
    gateway_stop: CancellationToken,
}

impl Cluster {
    async fn start() -> Cluster {
        let mut listeners = BTreeMap::new();
        for id in 1..=3u64 {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            listeners.insert(id, l);
        }
        let addrs: BTreeMap<u64, String> = listeners
            .iter()
            .map(|(id, l)| (*id, l.local_addr().unwrap().to_string()))
            .collect();
        let brokers = InProcess::default();
        let (mut dirs, mut stops) = (Vec::new(), BTreeMap::new());
        for (id, listener) in listeners {
            let dir = tempfile::tempdir().unwrap();
            let config = BrokerConfig {
                node_id: id,
                brokers: addrs.clone(),
                partitions: 2,
                replication_factor: 3,
                data_dir: dir.path().to_path_buf(),
                durability: Durability::Replicated,
                raft: RaftTuning::default(),
                lost_gateway_grace: None,
                hand_off_leadership: true,
                rebalance_after: None,
                cluster_tls: None,
                memory: courier_broker::config::Memory::default(),
            };
            let stop = CancellationToken::new();
            tokio::spawn(courier_broker::run_with(
                config,
                listener,
                stop.clone(),
                Some(brokers.clone()),
            ));
            dirs.push(dir);
            stops.insert(id, stop);
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let gateway_addr = listener.local_addr().unwrap();
        let config = courier_gateway::GatewayConfig {
            brokers: addrs.values().cloned().collect(),
            topology_refresh: Duration::from_millis(100),
            ..Default::default()
        };
        let gateway_stop = CancellationToken::new();
        let connect: Arc<dyn Connect> = Arc::new(brokers.clone());
        tokio::spawn(courier_gateway::serve_with(
            config,
            listener,
            gateway_stop.clone(),
            connect,
        ));
        let gateway = Endpoint::from_shared(format!("http://{gateway_addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        Cluster {
            _dirs: dirs,
            addrs,
            stops,
            brokers,
            gateway,
            gateway_stop,
        }
    }

    /// The broker leading `partition`, asked of the brokers themselves, once one
    /// leads (within 20 s).
    async fn leader_of(&self, partition: u32) -> u64 {
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            for (id, addr) in &self.addrs {
                if self.stops[id].is_cancelled() {
                    continue;
                }
                let broker = self.brokers.connect(addr).unwrap();
                let Ok(t) = broker.topology().await else {
                    continue;
                };
                if t.partitions
                    .iter()
                    .any(|p| p.partition_id == partition && p.role == "leader")
                {
                    return *id;
                }
            }
            assert!(Instant::now() < until, "no leader of partition {partition}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the gateway knows a leader of each of `partitions` (it routes
    /// creates only to partitions whose leader it knows).
    async fn gateway_knows_leaders(&self, partitions: &[i32]) {
        let mut gateway = GatewayClient::new(self.gateway.clone());
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(t) = gateway.topology(gw::TopologyRequest {}).await {
                let led: BTreeSet<i32> = t
                    .into_inner()
                    .brokers
                    .iter()
                    .flat_map(|b| &b.partitions)
                    .filter(|p| p.role == gw::partition::PartitionBrokerRole::Leader as i32)
                    .map(|p| p.partition_id)
                    .collect();
                if partitions.iter().all(|p| led.contains(p)) {
                    return;
                }
            }
            assert!(Instant::now() < until, "the gateway never saw every leader");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Creates `n` jobs of `job_type`, retrying while the cluster is still forming
    /// or electing; their keys.
    async fn create(&self, job_type: &str, n: usize) -> Vec<i64> {
        let mut jobs = JobsClient::new(self.gateway.clone());
        let mut keys = Vec::new();
        let until = Instant::now() + Duration::from_secs(20);
        while keys.len() < n {
            let r = jobs
                .create_job(v1::CreateJobRequest {
                    r#type: job_type.into(),
                    variables: format!(r#"{{"n":{}}}"#, keys.len()),
                    ..Default::default()
                })
                .await;
            match r {
                Ok(r) => keys.push(r.into_inner().key),
                Err(e) if e.code() == Code::Unavailable && Instant::now() < until => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("create failed: {e:?}"),
            }
        }
        keys
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.gateway_stop.cancel();
        for stop in self.stops.values() {
            stop.cancel();
        }
    }
}

/// Receives pushed jobs from `stream` until `keys` are all there (within 20 s),
/// completing each; fails on a job pushed twice or not created.
async fn take_and_complete(
    gateway: &mut GatewayClient<Channel>,
    stream: &mut tonic::Streaming<gw::ActivatedJob>,
    keys: &[i64],
) {
    let wanted: BTreeSet<i64> = keys.iter().copied().collect();
    let mut seen = BTreeSet::new();
    while seen != wanted {
        let job = tokio::time::timeout(Duration::from_secs(20), stream.message())
            .await
            .expect("the jobs are pushed within 20 s")
            .unwrap()
            .expect("the stream stays open");
        assert!(
            wanted.contains(&job.key),
            "pushed a job not created: {job:?}"
        );
        assert!(seen.insert(job.key), "job {} pushed twice", job.key);
        gateway
            .complete_job(gw::CompleteJobRequest {
                job_key: job.key,
                variables: String::new(),
            })
            .await
            .unwrap();
    }
}

/// Waits (up to 10 s) until a long poll is parked at the gateway.
async fn wait_for_parked_poll() {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let parked = prometheus::default_registry()
            .gather()
            .iter()
            .filter(|f| f.name() == "courier_gateway_long_poll_parked")
            .flat_map(|f| f.get_metric())
            .map(|m| m.get_gauge().get_value())
            .sum::<f64>();
        if parked >= 1.0 {
            return;
        }
        assert!(Instant::now() < until, "the poll was never parked");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn stream_request(job_type: &str) -> gw::StreamActivatedJobsRequest {
    gw::StreamActivatedJobsRequest {
        r#type: job_type.into(),
        worker: "in-process".into(),
        timeout: 30_000,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_are_pushed_polled_and_completed_through_in_process_brokers() {
    let cluster = Cluster::start().await;
    let mut gateway = GatewayClient::new(cluster.gateway.clone());
    for p in [1, 2] {
        cluster.leader_of(p).await;
    }
    cluster.gateway_knows_leaders(&[1, 2]).await;

    // Pushed: every job created once the stream is open reaches it once, from
    // both partitions, and completes.
    let mut stream = gateway
        .stream_activated_jobs(stream_request("pushed"))
        .await
        .unwrap()
        .into_inner();
    let keys = cluster.create("pushed", 20).await;
    let partitions: BTreeSet<i64> = keys.iter().map(|k| k >> 51).collect();
    assert_eq!(partitions.len(), 2, "creates go round the partitions");
    take_and_complete(&mut gateway, &mut stream, &keys).await;

    // Polled: a long poll parked before the job exists is answered with it.
    let poll = {
        let mut gateway = gateway.clone();
        tokio::spawn(async move {
            gateway
                .activate_jobs(gw::ActivateJobsRequest {
                    r#type: "polled".into(),
                    worker: "in-process".into(),
                    timeout: 30_000,
                    max_jobs_to_activate: 1,
                    request_timeout: 15_000,
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner()
                .message()
                .await
                .unwrap()
                .expect("an answer")
        })
    };
    wait_for_parked_poll().await;
    let polled = cluster.create("polled", 1).await;
    let answer = tokio::time::timeout(Duration::from_secs(10), poll)
        .await
        .expect("the parked poll is answered")
        .unwrap();
    let got: Vec<i64> = answer.jobs.iter().map(|j| j.key).collect();
    assert_eq!(got, polled);

    // A completed job is gone.
    let e = gateway
        .complete_job(gw::CompleteJobRequest {
            job_key: keys[0],
            variables: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_and_pushes_follow_a_partition_to_its_next_leader() {
    let cluster = Cluster::start().await;
    let mut gateway = GatewayClient::new(cluster.gateway.clone());
    let leader = cluster.leader_of(1).await;
    cluster.leader_of(2).await;
    let mut stream = gateway
        .stream_activated_jobs(stream_request("moved"))
        .await
        .unwrap()
        .into_inner();
    let before = cluster.create("moved", 4).await;
    take_and_complete(&mut gateway, &mut stream, &before).await;

    // The leader of partition 1 stops (handing its partitions over) and can no
    // longer be reached; the gateway finds the new leaders on its own.
    cluster.stops[&leader].cancel();
    let next = cluster.leader_of(1).await;
    assert_ne!(next, leader);
    let after = cluster.create("moved", 10).await;
    take_and_complete(&mut gateway, &mut stream, &after).await;
}
