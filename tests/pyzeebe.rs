//! Compatibility with a real Zeebe client: pyzeebe, the Python client (pinned in
//! tests/compat/requirements.txt and installed into tests/compat/.venv by
//! scripts/test.sh), against a Courier cluster of real processes.
//! tests/compat/pyzeebe-worker.py runs one pyzeebe `ZeebeWorker` task; every job
//! created through Courier must reach it and be completed by it, once with
//! streaming turned on (`stream_enabled`) and once long-polling only.
//!
//! Habits of pyzeebe (4.7.0) this depends on: with streaming on it keeps polling
//! ActivateJobs beside the stream, so some jobs may reach it by a poll; its poller
//! asks for at most 32 jobs, and while 32 jobs (pushed or polled) are running it
//! waits `poll_retry_delay` before asking again (5 s by default; the script sets 1 s).

use crate::common;

use common::secure::Secure;

use common::{
    assert_all_completed, create_in_batches, serial, wait_registered, ClientProc, Cluster,
    ClusterOpts,
};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

const JOBS: usize = 100;

/// The Python that has pyzeebe; a missing one fails the test, it never skips it.
fn python() -> PathBuf {
    let python = common::compat_dir().join(".venv/bin/python");
    let check = Command::new(&python)
        .args(["-c", "import pyzeebe; print(pyzeebe.__name__)"])
        .output();
    assert!(
        check.as_ref().is_ok_and(|o| o.status.success()),
        "pyzeebe does not import with {} ({check:?}): run `bash scripts/test.sh`, which \
         installs tests/compat/requirements.txt into tests/compat/.venv",
        python.display()
    );
    python
}

/// Runs the pyzeebe worker in `mode` ("stream" or "poll") against a fresh cluster,
/// creates `JOBS` jobs through Courier and checks that the worker handled exactly
/// those and that every one is completed. Returns the gateway's (pushed, polled)
/// job counts.
async fn pyzeebe_worker_completes_every_job(mode: &str) -> (f64, f64) {
    pyzeebe_completes(ClusterOpts::default(), mode, JOBS).await
}

/// Runs the pyzeebe worker in `mode` against a cluster of `opts` (over TLS with
/// OAuth on a secure one) and checks that it completes `jobs` jobs.
async fn pyzeebe_completes(opts: ClusterOpts, mode: &str, jobs: usize) -> (f64, f64) {
    let python = python();
    let secure = opts.secure.clone();
    let cluster = Cluster::start(opts).await;
    let c = cluster.client();
    let job_type = format!("pyzeebe-{mode}");
    let script = common::compat_dir().join("pyzeebe-worker.py");
    let env = secure
        .map(|s| s.zeebe_env("pyzeebe-worker", "pyzeebe-secret", cluster.dir.path()))
        .unwrap_or_default();
    // Declared after the cluster, so dropped (killed) before it.
    let mut worker = ClientProc::spawn_with_env(
        &python,
        &[
            script.to_str().expect("utf-8 path"),
            &cluster.gateway_addr,
            &job_type,
            &jobs.to_string(),
            mode,
            // The script's own deadline in seconds, within the test's 60 s.
            "50",
        ],
        &env,
        cluster
            .dir
            .path()
            .join(format!("pyzeebe-{mode}-worker.out")),
    );

    if mode == "stream" {
        // pyzeebe's one stream, registered with each broker.
        wait_registered(&cluster, cluster.opts.brokers as f64).await;
    }
    let keys = create_in_batches(&c, &job_type, 10, jobs / 10).await;
    worker.wait_for_keys(Duration::from_secs(60), &keys).await;
    // pyzeebe logs a failed CompleteJob and goes on, so see for ourselves.
    assert_all_completed(&c, &keys).await;

    cluster.pushed_and_polled().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzeebe_streaming_worker_completes_100_jobs() {
    let _g = serial().await;
    let (pushed, polled) = pyzeebe_worker_completes_every_job("stream").await;
    // The stream is open before the first job is created, so jobs are pushed; those
    // beyond the stream's credit of 32 may go to pyzeebe's poller instead.
    assert!(
        pushed >= 32.0 && pushed + polled >= JOBS as f64,
        "jobs must reach pyzeebe's stream by push (pushed {pushed}, polled {polled})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzeebe_polling_worker_completes_100_jobs() {
    let _g = serial().await;
    let (pushed, polled) = pyzeebe_worker_completes_every_job("poll").await;
    assert_eq!(pushed, 0.0, "a worker without a stream is pushed nothing");
    assert!(
        polled >= JOBS as f64,
        "every job must be activated by a poll (polled {polled})"
    );
}

/// pyzeebe over TLS (checked against the cluster's CA) with OAuth client
/// credentials from the tests' provider, streaming.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzeebe_over_tls_with_oauth_completes_jobs() {
    let _g = serial().await;
    let s = Secure::new(&[], &[("pyzeebe-worker", "pyzeebe-secret", &["<default>"])]).await;
    let opts = ClusterOpts {
        secure: Some(s.clone()),
        ..ClusterOpts::one_broker(2)
    };
    let (pushed, polled) = pyzeebe_completes(opts, "stream", 50).await;
    assert!(pushed + polled >= 50.0, "pushed {pushed}, polled {polled}");
    assert!(s.oauth.issued.load(std::sync::atomic::Ordering::SeqCst) >= 1);
}
