//! The Rust `JobWorker` and the `courier worker` command on clusters of real
//! processes: jobs pushed and counted by path, a gateway restarted under a running
//! worker, a gateway without push, max jobs active across both paths, a full
//! worker whose stream reopens, a shutdown with jobs in flight, and the CLI worker
//! end to end.

use crate::common;

use common::{courier_bin, serial, wait_until, Cluster, ClusterOpts};
use courier_client::{ActivatedJob, Client, JobOutcome, JobState, JobWorker, NewJob};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tonic::Code;

/// Creates `n` jobs of `job_type` one by one (so they spread over the partitions);
/// returns their keys.
async fn create(c: &Client, job_type: &str, n: usize) -> Vec<i64> {
    let mut keys = Vec::with_capacity(n);
    for i in 0..n {
        let job = NewJob::new(job_type).variables(format!("{{\"i\":{i}}}").as_str());
        keys.push(c.create_job(job).await.expect("create").key);
    }
    keys
}

/// Waits until every job in `keys` is gone (completed).
async fn all_completed(c: &Client, keys: &[i64], within: Duration) {
    let remaining = Mutex::new(keys.iter().copied().collect::<BTreeSet<i64>>());
    wait_until(within, "every job is completed", || async {
        let left: Vec<i64> = remaining.lock().unwrap().iter().copied().collect();
        for k in left {
            if let Err(e) = c.get_job(k).await {
                if e.code() == Some(Code::NotFound) {
                    remaining.lock().unwrap().remove(&k);
                }
            }
        }
        remaining.lock().unwrap().is_empty()
    })
    .await;
}

/// A handler that completes every job, echoing its variables back.
async fn complete(job: ActivatedJob) -> Result<JobOutcome, String> {
    Ok(JobOutcome::complete_with(format!(
        "{{\"echo\":{}}}",
        job.variables
    )))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streaming_worker_gets_jobs_pushed() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client();
    let worker = JobWorker::builder(c.clone(), "w-push", complete)
        .name("pushed-worker")
        .spawn()
        .unwrap();
    wait_until(
        Duration::from_secs(10),
        "the stream is registered",
        || async {
            worker.metrics().snapshot().stream_open
                && cluster
                    .broker_metric("courier_broker_registered_streams")
                    .await
                    == 3.0
        },
    )
    .await;
    let keys = create(&c, "w-push", 60).await;
    all_completed(&c, &keys, Duration::from_secs(20)).await;

    let s = worker.metrics().snapshot();
    eprintln!("{s:?}");
    assert!(s.pushed > 0, "no job was pushed: {s:?}");
    assert_eq!(s.completed, 60);
    assert_eq!((s.failed, s.commands_failed), (0, 0));
    assert_eq!(s.handler_duration.count, 60);
    assert!(
        cluster
            .gateway_metric(0, "courier_gateway_jobs_pushed_total")
            .await
            >= s.pushed as f64
    );
    worker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_carries_on_by_itself_across_a_gateway_restart() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client();
    // A short activation timeout: jobs that die with the gateway, pushed but never
    // delivered, come back soon.
    let worker = JobWorker::builder(c.clone(), "w-restart", complete)
        .timeout(Duration::from_secs(3))
        .spawn()
        .unwrap();
    let mut keys = create(&c, "w-restart", 30).await;
    all_completed(&c, &keys, Duration::from_secs(20)).await;
    let before = worker.metrics().snapshot();
    assert!(before.stream_open);

    cluster.kill_gateway(0);
    wait_until(
        Duration::from_secs(10),
        "the worker sees the stream fail",
        || async { !worker.metrics().snapshot().stream_open },
    )
    .await;
    cluster.start_gateway(0);
    // The client retries while the gateway comes up.
    keys.extend(create(&c, "w-restart", 30).await);
    all_completed(&c, &keys, Duration::from_secs(30)).await;
    wait_until(
        Duration::from_secs(15),
        "the stream is open again",
        || async { worker.metrics().snapshot().stream_open },
    )
    .await;
    let after = worker.metrics().snapshot();
    eprintln!("before {before:?}\nafter {after:?}");
    assert!(after.stream_opens >= 2, "{after:?}");
    assert!(after.stream_failures >= 1);
    assert!(after.completed >= 60, "{after:?}");
    // Push resumed on the new stream (everything left after a restart is backfilled
    // or pushed); polling covered the gap.
    let more = create(&c, "w-restart", 10).await;
    all_completed(&c, &more, Duration::from_secs(20)).await;
    assert!(worker.metrics().snapshot().pushed > after.pushed);
    worker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_push_the_worker_falls_back_to_polling() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts {
        gateway_no_push: true,
        ..ClusterOpts::default()
    })
    .await;
    let c = cluster.client();
    let worker = JobWorker::builder(c.clone(), "w-poll", complete)
        .spawn()
        .unwrap();
    let keys = create(&c, "w-poll", 40).await;
    all_completed(&c, &keys, Duration::from_secs(20)).await;
    // It keeps trying push, never giving up on it, while polling does the work.
    wait_until(Duration::from_secs(10), "push is tried again", || async {
        worker.metrics().snapshot().stream_failures >= 2
    })
    .await;
    let s = worker.metrics().snapshot();
    eprintln!("{s:?}");
    assert_eq!((s.pushed, s.stream_opens), (0, 0));
    assert!(s.polled >= 40);
    assert_eq!(s.completed, 40);
    assert!(
        cluster
            .gateway_metric(0, "courier_gateway_jobs_activated_total")
            .await
            >= 40.0
    );
    worker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_jobs_active_is_never_exceeded_across_push_and_poll() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client();
    const MAX: usize = 4;
    let held = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (held, peak) = (held.clone(), peak.clone());
        move |job: ActivatedJob| {
            let (held, peak) = (held.clone(), peak.clone());
            async move {
                let now = held.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(20 + (job.key % 4) as u64 * 10)).await;
                held.fetch_sub(1, Ordering::SeqCst);
                Ok::<_, String>(JobOutcome::complete())
            }
        }
    };
    // A backlog before the worker starts (for its first poll and the new stream's
    // back-fill to race for), and more while it runs.
    let mut keys = create(&c, "w-max", 40).await;
    let worker = JobWorker::builder(c.clone(), "w-max", handler)
        .max_jobs_active(MAX as u32)
        .timeout(Duration::from_secs(10))
        .spawn()
        .unwrap();
    keys.extend(create(&c, "w-max", 60).await);
    all_completed(&c, &keys, Duration::from_secs(60)).await;
    let s = worker.metrics().snapshot();
    eprintln!("peak {} of {MAX}: {s:?}", peak.load(Ordering::SeqCst));
    assert!(peak.load(Ordering::SeqCst) <= MAX, "{s:?}");
    assert_eq!(
        peak.load(Ordering::SeqCst),
        MAX,
        "the worker was never full"
    );
    assert!(s.pushed > 0, "{s:?}");
    assert!(s.completed >= 100);
    assert_eq!(s.active, 0);
    worker.shutdown().await;
}

/// A worker whose stream is reopened (its gateway restarted) while every handler
/// is still busy. The new stream used to state the worker's whole max jobs active
/// as free, so the gateway pushed jobs the worker had no room for; given back at
/// once, each came straight back, as fast as the broker's log committed (thousands
/// of pushes a second, for as long as the handlers ran). Now the stream declares
/// the jobs the worker runs, and the gateway pushes nothing until one finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_worker_whose_stream_reopens_is_not_pushed_jobs_in_a_loop() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts::one_broker(1)).await;
    let c = cluster.client();
    const MAX: usize = 4;
    let (release, released) = tokio::sync::watch::channel(false);
    let running = Arc::new(AtomicUsize::new(0));
    let handler = {
        let running = running.clone();
        move |_job: ActivatedJob| {
            let (running, mut released) = (running.clone(), released.clone());
            async move {
                running.fetch_add(1, Ordering::SeqCst);
                let _ = released.wait_for(|r| *r).await;
                running.fetch_sub(1, Ordering::SeqCst);
                Ok::<_, String>(JobOutcome::complete())
            }
        }
    };
    let keys = create(&c, "w-full", 12).await;
    let worker = JobWorker::builder(c.clone(), "w-full", handler)
        .max_jobs_active(MAX as u32)
        .timeout(Duration::from_secs(60))
        .spawn()
        .unwrap();
    wait_until(Duration::from_secs(10), "the worker is full", || async {
        running.load(Ordering::SeqCst) == MAX
    })
    .await;

    // A graceful stop: the jobs the worker holds stay with it.
    assert!(cluster.terminate_gateway(Duration::from_secs(10)));
    cluster.start_gateway(0);
    wait_until(
        Duration::from_secs(15),
        "the worker's stream is open again",
        || async {
            let s = worker.metrics().snapshot();
            s.stream_open && s.stream_opens >= 2
        },
    )
    .await;
    let pushes = || cluster.broker_metric("courier_broker_push_attempts_total");
    let before = pushes().await;
    let window = Instant::now();
    // Watched for a while: what is measured is the absence of a loop.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let pushed = pushes().await - before;
    let s = worker.metrics().snapshot();
    eprintln!(
        "{pushed} pushes in {:?} while the worker was full: {s:?}",
        window.elapsed()
    );
    assert_eq!(running.load(Ordering::SeqCst), MAX, "{s:?}");
    assert!(
        pushed <= 4.0 * MAX as f64,
        "{pushed} pushes to a full worker in 3 s: {s:?}"
    );
    assert_eq!(
        (s.received(), s.given_back_no_capacity, s.waited_for_room),
        (MAX as u64, 0, 0),
        "the full worker was pushed jobs: {s:?}"
    );

    release.send_replace(true);
    all_completed(&c, &keys, Duration::from_secs(30)).await;
    let s = worker.metrics().snapshot();
    eprintln!("after: {s:?}");
    assert_eq!(s.completed, 12, "{s:?}");
    worker.shutdown().await;
}

/// A gateway killed (not stopped) while the worker's handlers run: after the lost
/// gateway grace a broker checks the jobs handed out through it, and asks the
/// gateways that are linked whether any holds them. The worker's stream, reopened
/// on the restarted gateway, declared them, so they are left with it and none runs
/// twice. A Zeebe client, which declares nothing, has them run again elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_a_worker_runs_across_a_gateway_crash_are_not_run_again() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts {
        // Long enough for the worker's stream to be back before the check.
        lost_gateway_grace: Some("3s"),
        ..ClusterOpts::one_broker(1)
    })
    .await;
    let c = cluster.client();
    let (release, released) = tokio::sync::watch::channel(false);
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        move |_job: ActivatedJob| {
            let (runs, mut released) = (runs.clone(), released.clone());
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let _ = released.wait_for(|r| *r).await;
                Ok::<_, String>(JobOutcome::complete())
            }
        }
    };
    let keys = create(&c, "w-crash", 2).await;
    let worker = JobWorker::builder(c.clone(), "w-crash", handler)
        .timeout(Duration::from_secs(60))
        .spawn()
        .unwrap();
    wait_until(Duration::from_secs(10), "both jobs run", || async {
        runs.load(Ordering::SeqCst) == 2
    })
    .await;
    cluster.kill_gateway(0);
    cluster.start_gateway(0);
    wait_until(
        Duration::from_secs(15),
        "the broker checked the jobs handed out through the lost gateway",
        || async {
            cluster
                .broker_metric("courier_broker_reconciled_pushes_total")
                .await
                >= 2.0
        },
    )
    .await;
    let s = worker.metrics().snapshot();
    assert_eq!(s.stream_opens, 2, "{s:?}");
    release.send_replace(true);
    all_completed(&c, &keys, Duration::from_secs(20)).await;
    let s = worker.metrics().snapshot();
    eprintln!("{s:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2, "a job ran twice: {s:?}");
    assert_eq!((s.completed, s.commands_failed), (2, 0), "{s:?}");
    worker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_with_jobs_in_flight_loses_none() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client();
    // Even keys finish within the grace period, odd ones never do.
    let first = JobWorker::builder(c.clone(), "w-stop", |job: ActivatedJob| async move {
        if job.key % 2 == 0 {
            tokio::time::sleep(Duration::from_millis(300)).await;
        } else {
            std::future::pending::<()>().await;
        }
        Ok::<_, String>(JobOutcome::complete())
    })
    .max_jobs_active(8)
    .timeout(Duration::from_secs(8))
    .shutdown_grace(Duration::from_secs(1))
    .spawn()
    .unwrap();
    let keys = create(&c, "w-stop", 24).await;
    wait_until(
        Duration::from_secs(10),
        "the first worker is full",
        || async { first.metrics().snapshot().active == 8 },
    )
    .await;
    let metrics = first.metrics().clone();
    let started = Instant::now();
    first.shutdown().await;
    let took = started.elapsed();
    let s = metrics.snapshot();
    eprintln!("shutdown took {took:?}: {s:?}");
    assert!(took < Duration::from_secs(4), "{took:?}");
    assert_eq!(s.active, 0);
    assert_eq!(s.failed, 0, "no job is failed by a shutdown");
    assert!(s.given_back_shutdown >= 1, "{s:?}");

    // What the first worker held, finished or given back, and anything caught in
    // transit (after its timeout), is done by a second worker.
    let second = JobWorker::builder(c.clone(), "w-stop", complete)
        .spawn()
        .unwrap();
    all_completed(&c, &keys, Duration::from_secs(30)).await;
    assert_eq!(
        s.completed + second.metrics().snapshot().completed,
        24,
        "each job completed once"
    );
    second.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_worker_runs_a_command_per_job() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client();
    let dir = tempfile::tempdir().unwrap();
    let seen = dir.path().join("seen.jsonl");
    let out = dir.path().join("out.jsonl");
    // Records its input, completes with it wrapped, or fails in two ways.
    let handler = r#"v=$(cat)
case "$v" in
  *'"fail"'*) echo "cannot do $COURIER_JOB_KEY" >&2; exit 3 ;;
  *'"garbage"'*) echo "not json" ;;
  *'"slow"'*) sleep 2; echo '{}' ;;
  *) echo "$v" >> "$SEEN"; printf '{"input":%s}' "$v" ;;
esac"#;
    let mut worker = std::process::Command::new(courier_bin())
        .args([
            "worker",
            "w-cli",
            "--handler",
            handler,
            "--address",
            &cluster.gateway_addr,
            "--max-jobs-active",
            "4",
            "--json",
        ])
        .env("SEEN", &seen)
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .unwrap();

    let ok = create(&c, "w-cli", 10).await;
    let fail = c
        .create_job(
            NewJob::new("w-cli")
                .variables(r#"{"fail":true}"#)
                .retries(1),
        )
        .await
        .unwrap()
        .key;
    let garbage = c
        .create_job(
            NewJob::new("w-cli")
                .variables(r#"{"garbage":true}"#)
                .retries(1),
        )
        .await
        .unwrap()
        .key;
    all_completed(&c, &ok, Duration::from_secs(20)).await;
    for (key, message) in [
        (fail, format!("cannot do {fail}")),
        (
            garbage,
            "the handler's output is not a JSON object: not json".into(),
        ),
    ] {
        wait_until(Duration::from_secs(10), "the job is failed", || async {
            c.get_job(key)
                .await
                .is_ok_and(|j| j.state == JobState::Incident as i32)
        })
        .await;
        let j = c.get_job(key).await.unwrap();
        assert_eq!((j.retries, j.error_message.as_str()), (0, message.as_str()));
    }
    // Completed by someone else while its handler runs: the worker's own completion
    // is refused, and the worker says so instead of reporting it completed.
    let slow = c
        .create_job(NewJob::new("w-cli").variables(r#"{"slow":true}"#))
        .await
        .unwrap()
        .key;
    wait_until(
        Duration::from_secs(10),
        "the slow job is activated",
        || async {
            c.get_job(slow)
                .await
                .is_ok_and(|j| j.state == JobState::Activated as i32)
        },
    )
    .await;
    c.complete_job(slow, "{}").await.unwrap();
    let seen_text = std::fs::read_to_string(&seen).unwrap();
    for i in 0..10 {
        assert!(seen_text.contains(&format!("{{\"i\":{i}}}")), "{seen_text}");
    }

    // `job create --count` without a terminal: no progress bar, a summary.
    let created = std::process::Command::new(courier_bin())
        .args([
            "job",
            "create",
            "w-cli",
            "--count",
            "25",
            "--json",
            "--address",
            &cluster.gateway_addr,
        ])
        .output()
        .unwrap();
    assert!(created.status.success());
    assert!(
        created.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&created.stdout).unwrap();
    assert_eq!(summary["created"], 25);
    wait_until(
        Duration::from_secs(20),
        "the CLI-created jobs are done",
        || async {
            std::fs::read_to_string(&out)
                .unwrap_or_default()
                .lines()
                .count()
                >= 38
        },
    )
    .await;

    // SIGTERM: a clean stop.
    std::process::Command::new("kill")
        .args(["-TERM", &worker.id().to_string()])
        .status()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(status) = worker.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the worker did not stop");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status:?}");

    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let completed: Vec<_> = lines
        .iter()
        .filter(|l| l["outcome"] == "completed" && l["recorded"] == true)
        .collect();
    assert_eq!(completed.len(), 35);
    assert!(!completed.iter().any(|l| l["key"] == slow), "{lines:?}");
    let refused: Vec<_> = lines.iter().filter(|l| l["key"] == slow).collect();
    assert_eq!(refused.len(), 1, "{lines:?}");
    assert_eq!(
        (&refused[0]["outcome"], &refused[0]["recorded"]),
        (&serde_json::json!("completed"), &serde_json::json!(false)),
        "{lines:?}"
    );
    assert!(
        refused[0]["error"].as_str().unwrap().contains("NOT_FOUND"),
        "{lines:?}"
    );
    let first = completed
        .iter()
        .find(|l| ok.contains(&l["key"].as_i64().unwrap()))
        .unwrap();
    assert!(first["variables"]["input"]["i"].is_number(), "{first}");
    let failed: BTreeSet<i64> = lines
        .iter()
        .filter(|l| l["outcome"] == "failed")
        .map(|l| l["key"].as_i64().unwrap())
        .collect();
    assert_eq!(failed, [fail, garbage].into_iter().collect());
    let last = lines.last().unwrap();
    assert_eq!(
        (last["completed"].as_u64(), last["failed"].as_u64()),
        (Some(35), Some(2))
    );
}

/// A handler still running when the shutdown grace ends (here cut short by a second
/// signal, as a second Ctrl-C does) is killed with everything it started, not only
/// its shell: its job has been given back and may already run elsewhere, so what
/// the handler started must not go on and do the work too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_worker_kills_an_abandoned_handlers_processes() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::one_broker(1)).await;
    let c = cluster.client();
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let side = dir.path().join("side-effect");
    let log = dir.path().join("stderr");
    // The work runs in a subshell, a process of its own, as a script's commands do.
    let handler = r#"touch "$STARTED"; (sleep 2; echo "$COURIER_JOB_KEY" >> "$SIDE"); echo '{}'"#;
    let mut worker = std::process::Command::new(courier_bin())
        .args([
            "worker",
            "w-abandon",
            "--handler",
            handler,
            "--address",
            &cluster.gateway_addr,
            "--grace",
            "60s",
        ])
        .env("STARTED", &started)
        .env("SIDE", &side)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let key = create(&c, "w-abandon", 1).await[0];
    wait_until(Duration::from_secs(10), "the handler started", || async {
        started.exists()
    })
    .await;
    let term = |pid: u32| {
        std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap()
    };
    assert!(term(worker.id()).success());
    wait_until(
        Duration::from_secs(10),
        "the worker is stopping",
        || async { std::fs::read_to_string(&log).is_ok_and(|t| t.contains("stopping:")) },
    )
    .await;
    // The second signal ends the 60 s grace at once (sent until the worker is gone:
    // one that arrives before it listens again would be missed).
    let stopped = Instant::now();
    let status = loop {
        if let Some(status) = worker.try_wait().unwrap() {
            break status;
        }
        assert!(
            stopped.elapsed() < Duration::from_secs(10),
            "a second signal cuts the grace short"
        );
        let _ = term(worker.id());
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(status.success());
    // Given back at once: another worker can take it.
    let job = c.get_job(key).await.unwrap();
    assert_eq!(job.state, JobState::Activatable as i32);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !side.exists(),
        "the abandoned handler's subshell went on and did the work"
    );
}
