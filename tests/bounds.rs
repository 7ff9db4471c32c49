//! Byte bounds on the job path: a backlog of large jobs, more than any one message
//! between processes may carry, goes out over several answers.

use crate::common;

use common::{serial, Cluster, ClusterOpts};
use courier_client::{ActivateJobs, NewJob, StreamJobs};
use courier_proto::domain::MAX_ACTIVATE_BYTES;
use courier_proto::MAX_CLUSTER_MESSAGE_BYTES;
use std::collections::BTreeSet;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_of_large_jobs_is_activated_over_several_answers() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::one_broker(1)).await;
    let c = cluster.client();
    // Jobs of nearly the largest size, more of them than one cluster message holds:
    // activated in one go, their answer could cross no link.
    let variables = format!(r#"{{"x":"{}"}}"#, "v".repeat(3_900_000));
    let n = MAX_CLUSTER_MESSAGE_BYTES / 3_900_000 + 4;
    let mut created = BTreeSet::new();
    for _ in 0..n {
        let r = c
            .create_job(NewJob::new("large").variables(variables.as_str()))
            .await
            .expect("create");
        created.insert(r.key);
    }
    let poll = ActivateJobs::new("large")
        .worker("bounds-test")
        .max_jobs(1000)
        .timeout(Duration::from_secs(300))
        .request_timeout(Duration::ZERO);
    let mut activated = BTreeSet::new();
    let mut answers = 0;
    while activated.len() < n {
        let jobs = c.activate_jobs(poll.clone()).await.expect("activate");
        answers += 1;
        assert!(!jobs.is_empty(), "an answer with room took no job");
        let bytes: usize = jobs.iter().map(|j| j.variables.len()).sum();
        assert!(bytes <= MAX_ACTIVATE_BYTES, "an answer of {bytes} bytes");
        for j in jobs {
            assert!(activated.insert(j.key), "job {} handed out twice", j.key);
        }
        assert!(answers <= n, "more answers than jobs");
    }
    assert_eq!(activated, created);
    for k in &activated {
        c.complete_job(*k, "").await.expect("complete");
    }
    common::assert_all_completed(&c, &activated.iter().copied().collect::<Vec<_>>()).await;
}

/// A log of large entries is compacted by its size, long before the number of
/// entries that would snapshot it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_of_large_jobs_is_snapshotted_by_its_size() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts {
        snapshot_every: 1_000_000,
        snapshot_every_bytes: Some(8 * 1024 * 1024),
        ..ClusterOpts::one_broker(1)
    })
    .await;
    let c = cluster.client();
    let snapshot = cluster.data_dir(1).join("snapshots").join("p1.snap");
    let variables = format!(r#"{{"x":"{}"}}"#, "v".repeat(1_000_000));
    for _ in 0..4 {
        c.create_job(NewJob::new("sized").variables(variables.as_str()))
            .await
            .expect("create");
    }
    assert!(
        !snapshot.exists(),
        "a snapshot before the log reached 8 MiB"
    );
    for _ in 0..8 {
        c.create_job(NewJob::new("sized").variables(variables.as_str()))
            .await
            .expect("create");
    }
    common::wait_until(Duration::from_secs(10), "a snapshot by size", || async {
        snapshot.exists()
    })
    .await;
    let taken = common::metric(
        &cluster.broker_metrics[&1],
        "courier_broker_size_snapshots_total",
    )
    .await;
    assert!(taken >= 1.0, "{taken}");
}

/// A partition's jobs may weigh at most `--max-partition-bytes` in memory: past it
/// creates are refused at once with RESOURCE_EXHAUSTED, saying why, and taken again
/// once jobs have ended. The weight is rebuilt from the stored jobs at a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_past_a_partitions_memory_bound_are_refused_until_jobs_end() {
    let _g = serial().await;
    let bound = 1024 * 1024;
    let mut cluster = Cluster::start(ClusterOpts {
        max_partition_bytes: Some(bound),
        ..ClusterOpts::one_broker(1)
    })
    .await;
    // No retries: the refusal itself is what is looked at.
    let c = cluster.client().with_retry_budget(Duration::ZERO);
    let variables = format!(r#"{{"x":"{}"}}"#, "v".repeat(100_000));
    let create = || NewJob::new("heavy").variables(variables.as_str());
    let refused = |e: courier_client::ClientError| {
        assert_eq!(e.code(), Some(tonic::Code::ResourceExhausted), "{e}");
        assert!(e.to_string().contains("--max-partition-bytes"), "{e}");
    };
    // Ten jobs of 100 KB fit in 1 MiB; the eleventh does not.
    for _ in 0..10 {
        c.create_job(create())
            .await
            .expect("create within the bound");
    }
    refused(c.create_job(create()).await.expect_err("past the bound"));
    let weight = common::metric(
        &cluster.broker_metrics[&1],
        "courier_broker_partition_job_bytes",
    )
    .await;
    assert!(
        weight > 1_000_000.0 && weight <= bound as f64,
        "weight {weight}"
    );
    // Jobs that end make room.
    let poll = ActivateJobs::new("heavy")
        .max_jobs(3)
        .request_timeout(Duration::ZERO);
    let jobs = c.activate_jobs(poll).await.expect("activate");
    assert_eq!(jobs.len(), 3);
    for j in &jobs {
        c.complete_job(j.key, "").await.expect("complete");
    }
    for _ in 0..3 {
        c.create_job(create())
            .await
            .expect("create after jobs ended");
    }
    refused(c.create_job(create()).await.expect_err("full again"));
    // A restart weighs the stored jobs again.
    cluster.kill_broker(1);
    cluster.start_broker(1);
    cluster.wait_for_leaders(Duration::from_secs(30)).await;
    // Until the gateway has found the broker again a create is UNAVAILABLE; none
    // may be taken.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let e = c
            .create_job(create())
            .await
            .expect_err("full after a restart");
        if e.code() != Some(tonic::Code::Unavailable) || std::time::Instant::now() > deadline {
            refused(e);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Past `--payload-memory-budget` a partition keeps new payloads on disk only: the
/// jobs' weight in memory stops growing with them, yet jobs reach workers whole
/// (polled, with only the variables asked for, and pushed on a stream), GetJob
/// shows them, and after a restart they are still on disk and still whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_past_the_budget_live_on_disk_and_reach_workers_whole() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts {
        payload_memory_budget: Some(64 * 1024),
        ..ClusterOpts::one_broker(1)
    })
    .await;
    let c = cluster.client();
    let vars = |i: usize| format!(r#"{{"i":{i},"pad":"{}"}}"#, "x".repeat(10_000));
    let mut keys = Vec::new();
    for i in 0..40 {
        let job = NewJob::new("heavy")
            .variables(vars(i).as_str())
            .custom_headers(r#"{"h":"v"}"#);
        keys.push(c.create_job(job).await.expect("create").key);
    }
    let broker = cluster.broker_metrics[&1].clone();
    let stored = common::metric(&broker, "courier_broker_partition_stored_payloads").await;
    assert!(stored >= 30.0, "stored apart: {stored}");
    let weight = common::metric(&broker, "courier_broker_partition_job_bytes").await;
    assert!(weight < 100_000.0, "weight in memory: {weight}");
    let last = c.get_job(keys[39]).await.expect("get job");
    assert_eq!(last.variables, vars(39));
    assert_eq!(last.custom_headers, r#"{"h":"v"}"#);

    // Polled, asking for one variable.
    let poll = ActivateJobs::new("heavy")
        .max_jobs(20)
        .fetch_variables(["i"])
        .request_timeout(Duration::ZERO);
    let polled = c.activate_jobs(poll).await.expect("activate");
    assert_eq!(polled.len(), 20);
    for j in &polled {
        let i = keys
            .iter()
            .position(|k| *k == j.key)
            .expect("a created job");
        assert_eq!(j.variables, format!(r#"{{"i":{i}}}"#));
        assert_eq!(j.custom_headers, r#"{"h":"v"}"#);
        c.complete_job(j.key, "").await.expect("complete");
    }

    // A restart keeps what is on disk there, and it still reads whole.
    cluster.kill_broker(1);
    cluster.start_broker(1);
    cluster.wait_for_leaders(Duration::from_secs(30)).await;
    let c = cluster.client();
    common::wait_until(
        Duration::from_secs(20),
        "the broker serves again",
        || async { c.get_job(keys[39]).await.is_ok() },
    )
    .await;
    assert_eq!(
        c.get_job(keys[39]).await.expect("get job").variables,
        vars(39)
    );
    let stored = common::metric(&broker, "courier_broker_partition_stored_payloads").await;
    assert!(
        stored >= 10.0,
        "still stored apart after a restart: {stored}"
    );

    // Pushed on a stream, whole.
    let mut stream = c
        .stream_activated_jobs(StreamJobs::new("heavy").max_jobs_active(100))
        .await
        .expect("stream");
    let mut pushed = BTreeSet::new();
    while pushed.len() < 20 {
        let j = tokio::time::timeout(Duration::from_secs(20), stream.message())
            .await
            .expect("pushed in time")
            .expect("stream ok")
            .expect("stream open");
        let i = keys
            .iter()
            .position(|k| *k == j.key)
            .expect("a created job");
        assert_eq!(j.variables, vars(i));
        c.complete_job(j.key, "").await.expect("complete");
        pushed.insert(j.key);
    }
    let read = common::metric(&broker, "courier_broker_stored_payloads_read_total").await;
    assert!(read >= 10.0, "payloads read from disk: {read}");
}
