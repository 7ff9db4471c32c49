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

// Test code: a failed expectation is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use common::{
    assert_all_completed, create_in_batches, serial, wait_registered, ClientProc, Cluster,
    ClusterOpts,
};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

const JOBS: usize = 100;

fn compat_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/compat")
}

/// The Python that has pyzeebe; a missing one fails the test, it never skips it.
fn python() -> PathBuf {
    let python = compat_dir().join(".venv/bin/python");
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
    let python = python();
    let cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client();
    let job_type = format!("pyzeebe-{mode}");
    let script = compat_dir().join("pyzeebe-worker.py");
    // Declared after the cluster, so dropped (killed) before it.
    let mut worker = ClientProc::spawn(
        &python,
        &[
            script.to_str().expect("utf-8 path"),
            &cluster.gateway_addr,
            &job_type,
            &JOBS.to_string(),
            mode,
            // The script's own deadline in seconds, within the test's 60 s.
            "50",
        ],
        cluster
            .dir
            .path()
            .join(format!("pyzeebe-{mode}-worker.out")),
    );

    if mode == "stream" {
        // pyzeebe's one stream, registered with each of the 3 brokers.
        wait_registered(&cluster, 3.0).await;
    }
    let keys = create_in_batches(&c, &job_type, 10, JOBS / 10).await;
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
