//! Compatibility with a real Zeebe client: the Node.js `@camunda8/sdk` streaming job
//! worker (npm package installed into tests/compat by `npm ci --prefix tests/compat`)
//! against a Courier cluster of real processes. tests/compat/stream-worker.mjs opens
//! the SDK's `streamJobs` worker; every job created through Courier must reach it by
//! push over `StreamActivatedJobs` and be completed by it.
//!
//! Habits of the SDK (8.8.13) this depends on: it gzips every request message (its
//! gRPC channels set `grpc.default_compression_algorithm` = gzip, and a channel only
//! stops after a reply without `gzip` in `grpc-accept-encoding`), so the gateway
//! must accept gzip; its stream worker also polls with ActivateJobs once, right after
//! opening the stream; and it never reopens a stream that failed or ended.

// Test code: a failed expectation is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use common::{serial, wait_until, Cluster, ClusterOpts};
use courier_client::{Client, NewJob};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const JOB_TYPE: &str = "node-sdk-stream";
const JOBS: usize = 100;

fn compat_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/compat")
}

/// `node` and the SDK; a missing one fails the test, it never skips it.
fn require_node_and_sdk() {
    let node = Command::new("node").arg("--version").output();
    assert!(
        node.as_ref().is_ok_and(|o| o.status.success()),
        "`node` does not run ({node:?}): install Node.js 20+, then run `npm ci --prefix tests/compat`"
    );
    let sdk = compat_dir().join("node_modules/@camunda8/sdk");
    assert!(
        sdk.exists(),
        "@camunda8/sdk not found at {}: run `npm ci --prefix tests/compat`",
        sdk.display()
    );
}

/// The node worker process: killed when the test ends, however it ends, and its
/// whole output printed when the test fails.
struct NodeWorker {
    child: Child,
    /// Not a `.log` file: the cluster prints only the last lines of those, and the
    /// SDK's stack traces run longer.
    out: PathBuf,
}

impl NodeWorker {
    fn start(cluster: &Cluster) -> NodeWorker {
        let out = cluster.dir.path().join("node-sdk-worker.out");
        let file = std::fs::File::create(&out).expect("worker output file");
        let child = Command::new("node")
            .arg(compat_dir().join("stream-worker.mjs"))
            .args([&cluster.gateway_addr, JOB_TYPE, &JOBS.to_string()])
            // The script's own deadline, within the test's 60 s.
            .arg("50000")
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("worker output file"))
            .stderr(file)
            .spawn()
            .expect("start node");
        NodeWorker { child, out }
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    /// Panics (the output is printed on drop) if the worker has exited unsuccessfully;
    /// true if it has exited successfully.
    fn exited_ok(&mut self) -> bool {
        match self.child.try_wait().expect("poll node") {
            None => false,
            Some(status) if status.success() => true,
            Some(status) => panic!("the node worker exited with {status}"),
        }
    }
}

impl Drop for NodeWorker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("----- {} -----\n{}", self.out.display(), self.output());
        }
    }
}

/// The created keys that do not answer NOT_FOUND (a completed job is gone).
async fn not_completed(c: &Client, keys: &[i64]) -> Vec<String> {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_sdk_stream_worker_completes_100_jobs_pushed_by_courier() {
    let _g = serial().await;
    require_node_and_sdk();
    let cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client();
    // Declared after the cluster, so dropped (killed) before it.
    let mut worker = NodeWorker::start(&cluster);

    // The SDK's one stream is registered with every broker, and the script says
    // "ready" once the SDK's initial backfill poll is answered: from then on no job
    // reaches it except by push.
    wait_until(
        Duration::from_secs(20),
        "the node worker's stream is registered with every broker and it is ready",
        || {
            assert!(
                !worker.exited_ok(),
                "the node worker exited before any job was created"
            );
            let ready = worker.output().lines().any(|l| l == "ready");
            let cluster = &cluster;
            async move {
                let streams = cluster.broker_metric("courier_broker_registered_streams");
                ready && streams.await == 3.0
            }
        },
    )
    .await;

    // Ten requests of ten, so the jobs land on several partitions.
    let mut keys = Vec::new();
    for chunk in 0..JOBS / 10 {
        let jobs = (0..10).map(|i| {
            NewJob::new(JOB_TYPE).variables(format!("{{\"n\":{}}}", chunk * 10 + i).as_str())
        });
        keys.extend(c.create_jobs(jobs).await.expect("create"));
    }
    assert_eq!(keys.len(), JOBS);

    wait_until(
        Duration::from_secs(60),
        "the node worker completed every job and exited",
        || {
            let done = worker.exited_ok();
            async move { done }
        },
    )
    .await;

    // The worker printed exactly the keys created here.
    let printed: BTreeSet<i64> = worker
        .output()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    assert_eq!(
        printed,
        keys.iter().copied().collect::<BTreeSet<i64>>(),
        "the keys the node worker completed are not the keys created"
    );

    // The SDK's `job.complete()` swallows errors, so see for ourselves. It awaited
    // every CompleteJob answer before the worker exited: the deadline only covers
    // a read racing the last completion.
    let mut left = Vec::new();
    let gone = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            left = not_completed(&c, &keys).await;
            if left.is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    })
    .await;
    assert!(
        gone.is_ok(),
        "{} of {JOBS} jobs are not completed, e.g. {:?}",
        left.len(),
        &left[..left.len().min(5)]
    );

    let pushed = cluster
        .gateway_metric(0, "courier_gateway_jobs_pushed_total")
        .await;
    let polled = cluster
        .gateway_metric(0, "courier_gateway_jobs_activated_total")
        .await;
    assert_eq!(
        (pushed, polled),
        (JOBS as f64, 0.0),
        "every job must be pushed and none polled (pushed, polled)"
    );
}
