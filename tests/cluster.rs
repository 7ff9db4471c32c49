//! Cluster tests: 3 brokers (replication factor 3, 3 partitions) and a gateway, each a
//! real `courier` process on loopback, driven through the Rust client over gRPC.

use crate::common;

use common::{free_port, metric, serial, wait_until, Cluster, ClusterOpts, Proc};
use courier_client::{ActivateJobs, Client, JobState, NewJob};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tonic::Code;

fn poll(job_type: &str, max: i32) -> ActivateJobs {
    ActivateJobs::new(job_type)
        .worker("cluster-test")
        .max_jobs(max)
        .timeout(Duration::from_secs(60))
        .request_timeout(Duration::from_secs(2))
}

/// Activates until `n` jobs were handed out or `within` passes.
async fn activate_n(c: &Client, req: ActivateJobs, n: usize, within: Duration) -> Vec<i64> {
    let mut keys = Vec::new();
    let deadline = Instant::now() + within;
    while keys.len() < n && Instant::now() < deadline {
        let jobs = c.activate_jobs(req.clone()).await.expect("activate");
        keys.extend(jobs.iter().map(|j| j.key));
    }
    keys
}

async fn state_of(c: &Client, key: i64) -> Result<JobState, Code> {
    match c.get_job(key).await {
        Ok(j) => Ok(JobState::try_from(j.state).unwrap_or(JobState::Unspecified)),
        Err(e) => Err(e.code().unwrap_or(Code::Unknown)),
    }
}

async fn lifecycle_of_many_jobs(opts: ClusterOpts, n: usize) {
    let cluster = Cluster::start(opts).await;
    let c = cluster.client();

    // Half one at a time (round-robin over partitions), half in batches.
    let mut created = BTreeSet::new();
    for i in 0..n / 2 {
        let r = c
            .create_job(NewJob::new("bulk").variables(format!("{{\"i\":{i}}}").as_str()))
            .await
            .expect("create");
        created.insert(r.key);
    }
    for chunk in (n / 2..n).collect::<Vec<_>>().chunks(100) {
        let keys = c
            .create_jobs(
                chunk
                    .iter()
                    .map(|i| NewJob::new("bulk").variables(format!("{{\"i\":{i}}}").as_str())),
            )
            .await
            .expect("create batch");
        created.extend(keys);
    }
    assert_eq!(created.len(), n, "every created job has its own key");
    let partitions: BTreeSet<i64> = created.iter().map(|k| k >> 51).collect();
    assert_eq!(partitions.len(), 3, "jobs spread over all partitions");

    let activated = activate_n(&c, poll("bulk", 100), n, Duration::from_secs(60)).await;
    let activated_set: BTreeSet<i64> = activated.iter().copied().collect();
    assert_eq!(activated.len(), n, "each job activated exactly once");
    assert_eq!(activated_set, created);

    for k in &activated {
        c.complete_job(*k, "").await.expect("complete");
    }
    // None left: nothing to activate, every key gone.
    let left = c
        .activate_jobs(poll("bulk", 100).request_timeout(Duration::ZERO))
        .await
        .expect("activate");
    assert!(left.is_empty(), "jobs left after completing all: {left:?}");
    for k in created.iter().step_by(97) {
        assert_eq!(state_of(&c, *k).await, Err(Code::NotFound));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_jobs_are_created_activated_and_completed() {
    let _g = serial().await;
    lifecycle_of_many_jobs(ClusterOpts::default(), 1000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replicated_durability_mode_runs_the_same_lifecycle() {
    let _g = serial().await;
    lifecycle_of_many_jobs(
        ClusterOpts {
            durability: "replicated",
            ..ClusterOpts::default()
        },
        300,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_activation_that_times_out_is_activated_again() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client();
    let key = c.create_job(NewJob::new("slow")).await.expect("create").key;
    // Taken before the call: the leader stamps the deadline after this, whatever the
    // commit and the answer cost on a loaded machine.
    let activated_at = Instant::now();
    let first = c
        .activate_jobs(poll("slow", 1).timeout(Duration::from_millis(700)))
        .await
        .expect("activate");
    assert_eq!(first.iter().map(|j| j.key).collect::<Vec<_>>(), vec![key]);
    assert_eq!(state_of(&c, key).await, Ok(JobState::Activated));

    // A long poll parked now is woken when the deadline passes and the job is runnable.
    let again = activate_n(&c, poll("slow", 1), 1, Duration::from_secs(10)).await;
    assert_eq!(again, vec![key]);
    assert!(
        activated_at.elapsed() >= Duration::from_millis(695),
        "re-activated before its deadline: {:?}",
        activated_at.elapsed()
    );
    // The first worker's late completion is refused: its activation is gone... but the
    // job is activated again, so completing it works for whoever holds it.
    c.complete_job(key, "").await.expect("complete");
    assert_eq!(state_of(&c, key).await, Err(Code::NotFound));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_job_waits_for_its_back_off_then_runs_again() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client();
    let key = c
        .create_job(NewJob::new("flaky"))
        .await
        .expect("create")
        .key;
    activate_n(&c, poll("flaky", 1), 1, Duration::from_secs(5)).await;
    // Taken before the call: the leader stamps the back-off's end after this, so the
    // bound below holds however long the commit and the answer take (the 5 ms allow
    // for deadlines kept in whole milliseconds).
    let failed_at = Instant::now();
    c.fail_job(key, 2, "try later", Duration::from_millis(1500))
        .await
        .expect("fail");
    let job = c.get_job(key).await.expect("get");
    assert_eq!(job.state, JobState::FailedBackOff as i32);
    assert_eq!(job.retries, 2);
    assert_eq!(job.error_message, "try later");
    let now = c
        .activate_jobs(poll("flaky", 1).request_timeout(Duration::ZERO))
        .await
        .expect("activate");
    assert!(now.is_empty(), "activated during its back-off");

    let later = activate_n(&c, poll("flaky", 1), 1, Duration::from_secs(10)).await;
    assert_eq!(later, vec![key]);
    assert!(
        failed_at.elapsed() >= Duration::from_millis(1495),
        "{:?}",
        failed_at.elapsed()
    );
    assert_eq!(c.get_job(key).await.expect("get").retries, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_out_of_retries_is_an_incident_until_its_retries_are_updated() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client();
    let key = c
        .create_job(NewJob::new("doomed"))
        .await
        .expect("create")
        .key;
    activate_n(&c, poll("doomed", 1), 1, Duration::from_secs(5)).await;
    c.fail_job(key, 0, "no more", Duration::ZERO)
        .await
        .expect("fail");
    assert_eq!(state_of(&c, key).await, Ok(JobState::Incident));
    let none = c
        .activate_jobs(poll("doomed", 1).request_timeout(Duration::ZERO))
        .await
        .expect("activate");
    assert!(none.is_empty());
    let err = c.complete_job(key, "").await.expect_err("not activated");
    assert_eq!(err.code(), Some(Code::FailedPrecondition));
    let err = c.update_job_retries(key, 0).await.expect_err("retries < 1");
    assert_eq!(err.code(), Some(Code::InvalidArgument));

    c.update_job_retries(key, 1).await.expect("update retries");
    let again = activate_n(&c, poll("doomed", 1), 1, Duration::from_secs(5)).await;
    assert_eq!(again, vec![key]);
    c.complete_job(key, "").await.expect("complete");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_leader_mid_load_loses_no_acknowledged_job() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client();
    let acked = Arc::new(Mutex::new(Vec::<i64>::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut producers = Vec::new();
    for w in 0..4 {
        let (c, acked, stop) = (c.clone(), acked.clone(), stop.clone());
        producers.push(tokio::spawn(async move {
            let mut i = 0u64;
            let mut errors = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let job =
                    NewJob::new("survivor").variables(format!("{{\"w\":{w},\"i\":{i}}}").as_str());
                match c.create_job(job).await {
                    Ok(r) => acked.lock().expect("lock").push(r.key),
                    // Not acknowledged: allowed to be lost, retried by real producers.
                    Err(_) => errors += 1,
                }
            }
            errors
        }));
    }
    wait_until(
        Duration::from_secs(10),
        "some jobs are acknowledged",
        || async { acked.lock().expect("lock").len() > 200 },
    )
    .await;

    let leaders = cluster.leaders().await;
    let victim = leaders[&1];
    cluster.kill_broker(victim);
    let killed_at = Instant::now();
    cluster
        .wait_led_by_another(1, victim, Duration::from_secs(5))
        .await;
    let failover = killed_at.elapsed();
    let before = acked.lock().expect("lock").len();
    wait_until(Duration::from_secs(10), "creates succeed again", || async {
        acked.lock().expect("lock").len() > before + 100
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    for p in producers {
        p.await.expect("producer");
    }
    eprintln!("new leader of partition 1 after {failover:?}");
    assert!(
        failover < Duration::from_secs(3),
        "failover took {failover:?}"
    );

    // Every acknowledged job exists exactly once, on the surviving majority.
    let keys = acked.lock().expect("lock").clone();
    let unique: BTreeSet<i64> = keys.iter().copied().collect();
    assert_eq!(unique.len(), keys.len(), "a key was acknowledged twice");
    let c = cluster.client();
    for k in &keys {
        assert_eq!(
            state_of(&c, *k).await,
            Ok(JobState::Activatable),
            "acknowledged job {k} lost"
        );
    }
    // And each is activated exactly once: no duplicates in state.
    let activated = activate_n(
        &c,
        poll("survivor", 500),
        keys.len(),
        Duration::from_secs(60),
    )
    .await;
    let activated_set: BTreeSet<i64> = activated.iter().copied().collect();
    assert_eq!(
        activated_set.len(),
        activated.len(),
        "a job was handed out twice"
    );
    assert!(
        unique.is_subset(&activated_set),
        "acknowledged jobs missing from activation"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_broker_catches_up_through_a_snapshot() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts {
        snapshot_every: 20,
        keep_after_snapshot: 0,
        ..ClusterOpts::default()
    })
    .await;
    let c = cluster.client();
    // Keep broker 3 out while the others write, snapshot and purge their logs.
    assert!(
        cluster.terminate_broker(3, Duration::from_secs(10)),
        "broker 3 stops cleanly"
    );
    cluster.wait_for_leaders(Duration::from_secs(10)).await;
    let mut keys = Vec::new();
    for _ in 0..300 {
        keys.push(
            c.create_job(NewJob::new("later"))
                .await
                .expect("create")
                .key,
        );
    }
    let snapshots = cluster.data_dir(3).join("snapshots");
    let before: BTreeSet<_> = std::fs::read_dir(&snapshots)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();

    cluster.start_broker(3);
    // Caught up: broker 3 has applied, for every partition, as far as the leader.
    wait_until(Duration::from_secs(20), "broker 3 caught up", || async {
        let (Some(me), leaders) = (cluster.broker_topology(3).await, cluster.leaders().await)
        else {
            return false;
        };
        let mut ok = me.partitions.len() == 3;
        for p in &me.partitions {
            let Some(l) = leaders.get(&p.partition_id) else {
                return false;
            };
            let Some(lt) = cluster.broker_topology(*l).await else {
                return false;
            };
            let leader_applied = lt
                .partitions
                .iter()
                .find(|x| x.partition_id == p.partition_id)
                .map(|x| x.last_applied)
                .unwrap_or(u64::MAX);
            ok &= p.last_applied >= leader_applied;
        }
        ok
    })
    .await;
    let after: BTreeSet<_> = std::fs::read_dir(&snapshots)
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default();
    // Broker 3 stopped after a handful of entries, too few to build a snapshot; the
    // leaders purged everything behind theirs, so only an installed snapshot explains
    // an index and one data file per partition now (the file received, nothing left
    // of the transfer).
    assert!(
        before.is_empty(),
        "broker 3 had snapshots before it stopped: {before:?}"
    );
    for p in 1..=3 {
        let data: Vec<_> = after
            .iter()
            .filter(|n| n.starts_with(&format!("p{p}-")))
            .collect();
        assert!(
            after.contains(&format!("p{p}.snap")) && data.len() == 1 && data[0].ends_with(".data"),
            "broker 3 installed a snapshot of partition {p}: {after:?}"
        );
    }
    assert_eq!(after.len(), 6, "{after:?}");

    // Broker 3's copy is real: with broker 1 gone it is needed for a majority.
    cluster.kill_broker(1);
    cluster.wait_for_leaders(Duration::from_secs(10)).await;
    for k in keys.iter().step_by(7) {
        assert_eq!(state_of(&c, *k).await, Ok(JobState::Activatable), "job {k}");
    }
    let n = activate_n(&c, poll("later", 100), keys.len(), Duration::from_secs(30)).await;
    assert_eq!(n.len(), keys.len());
}

/// A leader leaves the news that an entry committed for its next message to each
/// follower (openraft 0.9 sends it alone and waits for the answer before the next
/// entry). Followers still apply every entry: the next entry or, once writes stop,
/// the next heartbeat carries it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn followers_apply_every_entry_though_a_commit_alone_waits_for_the_next_message() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client();
    for _ in 0..30 {
        c.create_job(NewJob::new("news")).await.expect("create");
    }
    let left = cluster
        .broker_metric("courier_broker_raft_commit_news_deferred_total")
        .await;
    assert!(left > 0.0, "no commit news was left for a later message");
    wait_until(
        Duration::from_secs(3),
        "every replica applied as far as its leader",
        || async {
            let mut applied: std::collections::BTreeMap<u32, Vec<u64>> = Default::default();
            for id in 1..=3 {
                let Some(t) = cluster.broker_topology(id).await else {
                    return false;
                };
                for p in t.partitions {
                    applied
                        .entry(p.partition_id)
                        .or_default()
                        .push(p.last_applied);
                }
            }
            applied.len() == 3
                && applied
                    .values()
                    .all(|v| v.len() == 3 && v.iter().all(|a| *a == v[0]))
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_the_status_zeebe_clients_expect() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::one_broker(2)).await;
    let c = cluster.client();
    fn code<T>(r: Result<T, courier_client::ClientError>) -> Option<Code> {
        r.err().and_then(|e| e.code())
    }
    assert_eq!(
        code(c.create_job(NewJob::new(" ")).await),
        Some(Code::InvalidArgument)
    );
    assert_eq!(
        code(c.create_job(NewJob::new("t").variables("[1,2]")).await),
        Some(Code::InvalidArgument)
    );
    let big = format!("{{\"x\":\"{}\"}}", "a".repeat(4 * 1024 * 1024));
    assert_eq!(
        code(c.create_job(NewJob::new("t").variables(big.as_str())).await),
        Some(Code::InvalidArgument)
    );
    assert_eq!(
        code(c.create_job(NewJob::new("t").tenant_id("bad tenant")).await),
        Some(Code::InvalidArgument)
    );
    assert_eq!(
        code(c.activate_jobs(ActivateJobs::new("t").max_jobs(0)).await),
        Some(Code::InvalidArgument)
    );
    assert_eq!(
        code(
            c.activate_jobs(ActivateJobs::new("t").timeout(Duration::ZERO))
                .await
        ),
        Some(Code::InvalidArgument)
    );
    let key = c.create_job(NewJob::new("t")).await.expect("create").key;
    assert_eq!(
        code(c.complete_job(key, "").await),
        Some(Code::FailedPrecondition)
    );
    assert_eq!(
        code(c.complete_job(key, "\"x\"").await),
        Some(Code::InvalidArgument)
    );
    assert_eq!(
        code(c.complete_job(key + 1000, "").await),
        Some(Code::NotFound)
    );
    // Keys that name no partition name no job, as in Zeebe.
    for bogus in [0, -1, 12_345, i64::MAX] {
        assert_eq!(
            code(c.complete_job(bogus, "").await),
            Some(Code::NotFound),
            "{bogus}"
        );
        assert_eq!(
            code(c.get_job(bogus).await),
            Some(Code::NotFound),
            "{bogus}"
        );
    }
    assert_eq!(
        code(c.update_job_retries(key, 0).await),
        Some(Code::InvalidArgument)
    );
    // Oversized text: a worker name is refused; a long error message is cut, not
    // refused, so the failure is recorded; a message over what the Zeebe API takes
    // (4 MiB of variables and a little) is refused before it is read whole.
    assert_eq!(
        code(
            c.activate_jobs(ActivateJobs::new("t").worker("w".repeat(9000)))
                .await
        ),
        Some(Code::InvalidArgument)
    );
    let jobs = c
        .activate_jobs(ActivateJobs::new("t").max_jobs(1))
        .await
        .expect("activate");
    let k = jobs.first().expect("a job").key;
    assert_eq!(
        code(
            c.fail_job(k, 1, "m".repeat(5 * 1024 * 1024), Duration::ZERO)
                .await
        ),
        Some(Code::OutOfRange)
    );
    c.fail_job(k, 1, "m".repeat(100_000), Duration::ZERO)
        .await
        .expect("a long message is cut, not refused");
    let kept = c.get_job(k).await.expect("get").error_message;
    assert!(
        kept.len() <= 32 * 1024 && kept.ends_with("the message was 100000 bytes]"),
        "{} bytes: ...{}",
        kept.len(),
        &kept[kept.len().saturating_sub(60)..]
    );
    // Nothing panicked: the gateway still serves.
    c.topology().await.expect("topology");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_sent_to_a_leader_that_froze_goes_to_its_successor() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client();
    for _ in 0..12 {
        c.create_job(NewJob::new("frozen")).await.expect("create");
    }
    let keys = activate_n(&c, poll("frozen", 12), 12, Duration::from_secs(20)).await;
    let leaders = cluster.leaders().await;
    // A job of a partition broker 1 leads, and one of a partition it does not.
    let led_by_1 = |k: &i64| {
        let p = courier_proto::domain::JobKey(*k)
            .partition()
            .expect("partition")
            .0;
        leaders.get(&p) == Some(&1)
    };
    let on_1 = *keys
        .iter()
        .find(|k| led_by_1(k))
        .expect("a job on broker 1");
    let elsewhere = *keys.iter().find(|k| !led_by_1(k)).expect("a job elsewhere");
    c.complete_job(elsewhere, "{}").await.expect("complete");

    // Frozen (SIGSTOP), broker 1 keeps its connections open and answers nothing:
    // the complete sent to it would wait for as long as the freeze lasts. Another
    // broker is elected in about a second and tells the gateway, which sends the
    // command there.
    cluster.freeze_broker(1, true);
    let started = Instant::now();
    let done = c.complete_job(on_1, "{}").await;
    let took = started.elapsed();
    cluster.freeze_broker(1, false);
    done.expect("complete after the freeze");
    assert!(
        took < Duration::from_secs(4),
        "the complete took {took:?} while its partition's leader was frozen"
    );
    assert!(
        cluster
            .gateway_metric(0, "courier_gateway_broker_retries_total")
            .await
            >= 1.0
    );
    wait_until(Duration::from_secs(20), "both jobs are gone", || {
        let c = &c;
        async move { common::all_gone(c, &[on_1, elsewhere]).await }
    })
    .await;
    cluster.kill_broker(1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_is_down_is_logged_once_not_at_every_raft_call() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts::default()).await;
    // A broker that started before its peers may have said so already.
    let before = cluster.broker_log(1).len();
    cluster.kill_broker(3);
    let calls = |c: &Cluster| {
        let addr = c.broker_metrics[&1].clone();
        async move { metric(&addr, "courier_broker_peer_calls_unreachable_total").await }
    };
    // Broker 1 replicates to (or asks votes of) broker 3 for every partition, and
    // openraft logged an error for each of those calls.
    wait_until(
        Duration::from_secs(20),
        "broker 1 has failed to reach broker 3 ten times",
        || {
            let c = &cluster;
            async move { calls(c).await >= 10.0 }
        },
    )
    .await;
    assert_eq!(
        metric(
            &cluster.broker_metrics[&1],
            "courier_broker_peers_unreachable"
        )
        .await,
        1.0
    );
    let log = cluster.broker_log(1).split_off(before);
    let said = |what: &str| log.lines().filter(|l| l.contains(what)).count();
    assert_eq!(said("cannot reach peer broker"), 1, "{log}");
    assert_eq!(
        said("Unreachable"),
        0,
        "openraft's errors were logged:\n{log}"
    );

    cluster.start_broker(3);
    wait_until(
        Duration::from_secs(20),
        "broker 1 reaches broker 3 again",
        || {
            let c = &cluster;
            async move {
                metric(&c.broker_metrics[&1], "courier_broker_peers_unreachable").await == 0.0
            }
        },
    )
    .await;
    let log = cluster.broker_log(1).split_off(before);
    assert_eq!(
        log.lines()
            .filter(|l| l.contains("peer broker answers again"))
            .count(),
        1,
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_peer_counts_as_unreachable_and_is_logged_once() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::default()).await;
    let before = cluster.broker_log(1).len();
    // Frozen (SIGSTOP), broker 3 keeps its connections and answers nothing: each
    // call to it times out, where a dead one's fail at once.
    cluster.freeze_broker(3, true);
    let metric_of_1 = |name: &'static str| {
        let addr = cluster.broker_metrics[&1].clone();
        async move { metric(&addr, name).await }
    };
    // Well before HTTP/2 keepalive (10 s) would break the connection.
    wait_until(
        Duration::from_secs(5),
        "broker 1 has had ten calls to broker 3 unanswered",
        || async { metric_of_1("courier_broker_peer_calls_unreachable_total").await >= 10.0 },
    )
    .await;
    assert_eq!(metric_of_1("courier_broker_peers_unreachable").await, 1.0);
    let log = cluster.broker_log(1).split_off(before);
    let said = |what: &str| log.lines().filter(|l| l.contains(what)).count();
    assert_eq!(said("cannot reach peer broker"), 1, "{log}");
    // The warning may quote the first call's error; openraft's own errors for
    // the calls after it are not logged.
    assert!(
        said("no reply in time") <= 1,
        "openraft's errors were logged:\n{log}"
    );
    cluster.freeze_broker(3, false);
    wait_until(
        Duration::from_secs(20),
        "broker 1 hears from broker 3 again",
        || async { metric_of_1("courier_broker_peers_unreachable").await == 0.0 },
    )
    .await;
}

/// The term of partition 1 as broker `id` reports it, with its role there.
async fn term_at(cluster: &Cluster, id: u64) -> Option<(u64, String)> {
    let t = cluster.broker_topology(id).await?;
    let p = t.partitions.into_iter().find(|p| p.partition_id == 1)?;
    Some((p.term, p.role))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_that_stood_still_does_not_depose_the_leader_when_it_runs_again() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts {
        partitions: 1,
        ..ClusterOpts::default()
    })
    .await;
    let leader = cluster.leaders().await[&1];
    let (term, _) = term_at(&cluster, leader).await.expect("leader's term");
    let follower = (1..=3).find(|id| *id != leader).expect("a follower");

    // Longer than the follower's leader lease and election timeout (0.9-1.2 s): its
    // first tick after the pause would start an election at a higher term.
    cluster.freeze_broker(follower, true);
    tokio::time::sleep(Duration::from_secs(2)).await;
    cluster.freeze_broker(follower, false);

    let follower_metrics = cluster.broker_metrics[&follower].clone();
    wait_until(
        Duration::from_secs(20),
        "the follower noticed its pause and follows the leader again",
        || {
            let (c, m) = (&cluster, follower_metrics.clone());
            async move {
                metric(&m, "courier_broker_pauses_total").await >= 1.0
                    && term_at(c, follower).await.is_some_and(|(t, _)| t >= term)
            }
        },
    )
    .await;
    // An election it started would come within its hold (0.3 s) and an election
    // timeout after it: watch the terms for longer than that.
    let watch_until = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < watch_until {
        for id in 1..=3 {
            if let Some((t, role)) = term_at(&cluster, id).await {
                assert_eq!(
                    t, term,
                    "broker {id} is {role} in term {t}; the leader was elected in {term}"
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(cluster.leaders().await[&1], leader);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brokers_and_the_gateway_stop_cleanly_on_sigterm() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client();
    c.create_job(NewJob::new("t")).await.expect("create");
    // Without --worker-threads a server runs one worker thread per CPU.
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    assert_eq!(
        cluster
            .gateway_metric(0, "courier_runtime_worker_threads")
            .await,
        cpus
    );
    assert!(
        cluster.terminate_gateway(Duration::from_secs(10)),
        "gateway exit status"
    );
    for id in 1..=3 {
        assert!(
            cluster.terminate_broker(id, Duration::from_secs(10)),
            "broker {id} exit status"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_restarted_on_new_addresses_keeps_its_jobs() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client();
    let mut keys = Vec::new();
    for _ in 0..30 {
        keys.push(
            c.create_job(NewJob::new("moved"))
                .await
                .expect("create")
                .key,
        );
    }
    for id in 1..=3 {
        assert!(cluster.terminate_broker(id, Duration::from_secs(10)));
    }
    assert!(cluster.terminate_gateway(Duration::from_secs(10)));
    // The Raft membership on disk names the old addresses; the configuration wins.
    cluster.move_to_new_ports();
    for id in 1..=3 {
        cluster.start_broker(id);
    }
    cluster.start_gateway(0);
    cluster.wait_for_leaders(Duration::from_secs(20)).await;
    let c = cluster.client();
    // Replication works: new jobs commit (a majority is reachable) and old ones are there.
    keys.push(
        c.create_job(NewJob::new("moved"))
            .await
            .expect("create after the move")
            .key,
    );
    let got = activate_n(&c, poll("moved", 100), keys.len(), Duration::from_secs(20)).await;
    let got: BTreeSet<i64> = got.into_iter().collect();
    assert_eq!(got, keys.iter().copied().collect::<BTreeSet<_>>());
}

/// A CLI command run before its gateway is up waits for it within its retry
/// budget, says once why it waits, and goes through once `courier dev` is up. With
/// no budget it fails at once, without the warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cli_command_says_it_waits_for_a_gateway_that_is_not_up_yet() {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt};
    let _g = serial().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let gateway = format!("127.0.0.1:{}", free_port());
    let create = |budget: &str| {
        let mut c = tokio::process::Command::new(common::courier_bin());
        c.args(["job", "create", "early", "--address", &gateway])
            .args(["--retry-budget", budget])
            .env_remove("RUST_LOG");
        c
    };
    let out = create("0s").output().await.expect("run courier");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("UNAVAILABLE") && !err.contains("no answer yet"),
        "{err}"
    );

    // Started once the waiting command has said why it waits.
    let mut waiting = create("60s")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run courier");
    let mut stderr = tokio::io::BufReader::new(waiting.stderr.take().expect("stderr"));
    let mut err = String::new();
    tokio::time::timeout(Duration::from_secs(10), async {
        while !err.contains("no answer yet") {
            let read = stderr.read_line(&mut err).await.expect("read stderr");
            assert!(read > 0, "stderr closed: {err}");
        }
    })
    .await
    .expect("the warning within 10 s");
    let mut dev = Proc::spawn(
        &dev_args(dir.path(), &gateway, "off"),
        dir.path().join("dev.log"),
    );
    stderr.read_to_string(&mut err).await.expect("read stderr");
    let out = tokio::time::timeout(Duration::from_secs(60), waiting.wait_with_output())
        .await
        .expect("the command ends within its budget")
        .expect("run courier");
    assert!(out.status.success(), "{err}");
    assert_eq!(err.matches("no answer yet").count(), 1, "{err}");
    assert!(err.contains("retrying for up to"), "{err}");
    let key: i64 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("the job's key");
    let c = Client::connect(&gateway).expect("client");
    assert_eq!(state_of(&c, key).await, Ok(JobState::Activatable));
    assert!(dev.terminate(Duration::from_secs(10)), "dev exit status");
}

/// `courier dev` with its data in `dir`, on the given gateway and metrics addresses.
fn dev_args(dir: &std::path::Path, gateway: &str, metrics: &str) -> Vec<String> {
    vec![
        "dev".into(),
        "--data-dir".into(),
        dir.join("data").display().to_string(),
        "--gateway-addr".into(),
        gateway.into(),
        "--metrics-addr".into(),
        metrics.into(),
    ]
}

/// Creates a job and activates it: the cluster behind `c` does its work.
async fn create_and_activate_one(c: &Client) {
    let key = c.create_job(NewJob::new("one")).await.expect("create").key;
    let got = activate_n(c, poll("one", 1), 1, Duration::from_secs(10)).await;
    assert_eq!(got, vec![key]);
}

/// `--worker-threads` sizes the runtime of each process: `courier dev` runs one
/// unless told otherwise, brokers and gateways one per CPU; and a cluster on the
/// threads it was given does its work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_threads_size_the_runtime_of_every_process() {
    let _g = serial().await;
    const GAUGE: &str = "courier_runtime_worker_threads";

    // courier dev: one by default, what it is told otherwise.
    for (extra, want) in [(None, 1.0), (Some("2"), 2.0), (Some("3"), 3.0)] {
        let dir = tempfile::tempdir().expect("temp dir");
        let gateway = format!("127.0.0.1:{}", free_port());
        let metrics = format!("127.0.0.1:{}", free_port());
        let mut args = dev_args(dir.path(), &gateway, &metrics);
        if let Some(n) = extra {
            args.extend(["--worker-threads".into(), n.into()]);
        }
        let log = dir.path().join("dev.log");
        let mut dev = Proc::spawn(&args, log.clone());
        let c = Client::connect(&gateway)
            .expect("client")
            .with_retry_budget(Duration::from_secs(20));
        create_and_activate_one(&c).await;
        assert_eq!(
            metric(&metrics, GAUGE).await,
            want,
            "dev {extra:?}; log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        assert!(dev.terminate(Duration::from_secs(10)), "dev exit status");
    }

    // Zero threads is refused, naming the option.
    let out = std::process::Command::new(common::courier_bin())
        .args(["dev", "--worker-threads", "0"])
        .env_remove("COURIER_WORKER_THREADS")
        .output()
        .expect("run courier");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--worker-threads"), "{err}");

    // Brokers and gateway: what they are told.
    let cluster = Cluster::start(ClusterOpts {
        worker_threads: Some(2),
        ..ClusterOpts::default()
    })
    .await;
    assert_eq!(cluster.broker_metric(GAUGE).await, 3.0 * 2.0);
    assert_eq!(cluster.gateway_metric(0, GAUGE).await, 2.0);
    let c = cluster.client();
    create_and_activate_one(&c).await;
}

/// A poll that finds nothing is answered from the leaders' applied state: no log
/// entry, no commit (before, every parked poll a notice woke wrote an empty entry to
/// each partition it visited). A poll that finds a job still activates it through
/// the log, and a long poll parked on empty partitions is still woken by a new job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polls_that_find_nothing_write_nothing_to_the_log() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client();
    let empty = || cluster.broker_metric("courier_broker_empty_activations_total");
    let commands = || cluster.broker_metric("courier_broker_batch_commands_sum");
    let once = poll("nothing-here", 10).request_timeout(Duration::ZERO);

    // Each leader answers from its state once it has applied an entry of its own
    // term, right after its election: from then on a poll visits the 3 partitions
    // without proposing anything.
    wait_leaders_answer_empty_polls(&cluster, &c, "nothing-here", 3.0).await;
    let (empty_before, commands_before) = (empty().await, commands().await);
    for _ in 0..20 {
        assert!(c
            .activate_jobs(once.clone())
            .await
            .expect("poll")
            .is_empty());
    }
    assert_eq!(
        empty().await - empty_before,
        60.0,
        "20 polls of 3 partitions"
    );
    assert_eq!(
        commands().await,
        commands_before,
        "a poll that found nothing proposed a command"
    );

    // A job there is still activated, through the log.
    let key = c
        .create_job(NewJob::new("nothing-here"))
        .await
        .expect("create")
        .key;
    let commands_before = commands().await;
    let jobs = activate_n(&c, once.clone(), 1, Duration::from_secs(10)).await;
    assert_eq!(jobs, vec![key]);
    assert!(
        commands().await > commands_before,
        "the activation was not logged"
    );

    // A long poll that found nothing parks, and the next job wakes it.
    let parked = tokio::spawn({
        let c = c.clone();
        async move {
            c.activate_jobs(poll("later", 1).request_timeout(Duration::from_secs(20)))
                .await
                .expect("long poll")
        }
    });
    wait_until(
        Duration::from_secs(10),
        "the long poll is parked",
        || async {
            cluster
                .gateway_metric(0, "courier_gateway_long_poll_parked")
                .await
                == 1.0
        },
    )
    .await;
    let key = c
        .create_job(NewJob::new("later"))
        .await
        .expect("create")
        .key;
    let jobs = tokio::time::timeout(Duration::from_secs(5), parked)
        .await
        .expect("the parked poll was not woken by the new job")
        .expect("join");
    assert_eq!(jobs.iter().map(|j| j.key).collect::<Vec<_>>(), vec![key]);
}

/// Waits until each leader answers an empty poll of `job_type` from its applied
/// state (it has applied an entry of its own term), `partitions` answers a poll.
async fn wait_leaders_answer_empty_polls(
    cluster: &Cluster,
    c: &Client,
    job_type: &str,
    partitions: f64,
) {
    let once = poll(job_type, 1).request_timeout(Duration::ZERO);
    wait_until(
        Duration::from_secs(10),
        "an empty poll is answered by every leader without a log entry",
        || {
            let (c, once) = (c.clone(), once.clone());
            async move {
                let before = cluster
                    .broker_metric("courier_broker_empty_activations_total")
                    .await;
                assert!(c.activate_jobs(once).await.expect("poll").is_empty());
                cluster
                    .broker_metric("courier_broker_empty_activations_total")
                    .await
                    - before
                    == partitions
            }
        },
    )
    .await;
}

/// 3 brokers with one partition, its leader answering polls of `job_type` from its
/// applied state.
async fn one_partition_cluster(job_type: &str) -> (Cluster, Client) {
    let cluster = Cluster::start(ClusterOpts {
        partitions: 1,
        ..ClusterOpts::default()
    })
    .await;
    let c = cluster.client();
    wait_leaders_answer_empty_polls(&cluster, &c, job_type, 1.0).await;
    (cluster, c)
}

const CLAIMED: &str = "courier_broker_empty_activations_total{reason=\"claimed\"}";

/// Polls that ask for a job while its activation commits leave it to that
/// activation: of 8 polls sent together for one job, one Activate reaches the log
/// and the rest are answered by the leader without an entry (before, each that came
/// while the first was in flight proposed one of its own and committed it in vain).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polls_for_a_job_being_activated_leave_it_to_that_activation() {
    let _g = serial().await;
    let (cluster, c) = one_partition_cluster("wanted").await;
    let commands = || cluster.broker_metric("courier_broker_batch_commands_sum");
    let claimed_before = cluster.broker_metric(CLAIMED).await;
    let once = poll("wanted", 1).request_timeout(Duration::ZERO);
    for round in 0..10 {
        let key = c
            .create_job(NewJob::new("wanted"))
            .await
            .expect("create")
            .key;
        let before = commands().await;
        let polls: Vec<_> = (0..8)
            .map(|_| {
                tokio::spawn({
                    let (c, once) = (c.clone(), once.clone());
                    async move { c.activate_jobs(once).await.expect("poll") }
                })
            })
            .collect();
        let mut got = Vec::new();
        for p in polls {
            got.extend(p.await.expect("join").into_iter().map(|j| j.key));
        }
        assert_eq!(got, vec![key], "round {round}");
        assert_eq!(
            commands().await - before,
            1.0,
            "round {round}: more than one Activate was logged for one job"
        );
    }
    eprintln!(
        "polls answered 'claimed': {}",
        cluster.broker_metric(CLAIMED).await - claimed_before
    );
}

/// Jobs an activation in flight leaves behind are announced when it finishes: a
/// poll answered "claimed" meanwhile parks, and must get them at once, not at the
/// end of its request timeout. Here the activation in flight (tenants x and y, one
/// job) takes y's older job and leaves x's, which a long poll for x was told was
/// claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_an_activation_in_flight_leaves_goes_to_a_poll_it_deferred() {
    let _g = serial().await;
    let (cluster, c) = one_partition_cluster("mixed").await;
    let claimed_before = cluster.broker_metric(CLAIMED).await;
    let both = poll("mixed", 1)
        .tenant_ids(["x", "y"])
        .request_timeout(Duration::ZERO);
    let x_only = poll("mixed", 1)
        .tenant_ids(["x"])
        .request_timeout(Duration::from_secs(30));
    for round in 0..20 {
        let y = c
            .create_job(NewJob::new("mixed").tenant_id("y"))
            .await
            .expect("create")
            .key;
        let x = c
            .create_job(NewJob::new("mixed").tenant_id("x"))
            .await
            .expect("create")
            .key;
        let first = tokio::spawn({
            let (c, both) = (c.clone(), both.clone());
            async move { c.activate_jobs(both).await.expect("poll") }
        });
        let second = tokio::spawn({
            let (c, x_only) = (c.clone(), x_only.clone());
            async move { c.activate_jobs(x_only).await.expect("poll") }
        });
        let first: Vec<i64> = first.await.expect("join").iter().map(|j| j.key).collect();
        let second: Vec<i64> = tokio::time::timeout(Duration::from_secs(5), second)
            .await
            .unwrap_or_else(|_| panic!("round {round}: the poll for x was not woken for its job"))
            .expect("join")
            .iter()
            .map(|j| j.key)
            .collect();
        assert_eq!((first, second), (vec![y], vec![x]), "round {round}");
    }
    eprintln!(
        "polls answered 'claimed': {}",
        cluster.broker_metric(CLAIMED).await - claimed_before
    );
}

/// A parked poll woken by a notice visits the partition the notice came from
/// first, and answers with the job it found there without visiting the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_woken_poll_takes_its_job_from_the_notices_partition_alone() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client();
    wait_leaders_answer_empty_polls(&cluster, &c, "hinted", 3.0).await;
    let empty = || cluster.broker_metric("courier_broker_empty_activations_total");
    let parked = || cluster.gateway_metric(0, "courier_gateway_long_poll_parked");
    // Jobs are created round-robin: the rounds cover every partition.
    for round in 0..6 {
        let before = empty().await;
        let poll = tokio::spawn({
            let c = c.clone();
            async move {
                c.activate_jobs(poll("hinted", 32).request_timeout(Duration::from_secs(20)))
                    .await
                    .expect("long poll")
            }
        });
        wait_until(Duration::from_secs(10), "the poll is parked", || async {
            parked().await == 1.0
        })
        .await;
        let parked_at = empty().await;
        assert_eq!(parked_at - before, 3.0, "round {round}: its first visit");
        let key = c
            .create_job(NewJob::new("hinted"))
            .await
            .expect("create")
            .key;
        let jobs = tokio::time::timeout(Duration::from_secs(5), poll)
            .await
            .expect("the parked poll was not woken")
            .expect("join");
        assert_eq!(jobs.iter().map(|j| j.key).collect::<Vec<_>>(), vec![key]);
        assert_eq!(
            empty().await,
            parked_at,
            "round {round}: the woken poll visited partitions without the job"
        );
    }
}

/// Jobs activated for an ActivateJobs call whose client went away before the answer
/// are given back at once (failed with their retries unchanged, as Zeebe's gateway
/// does), not held until their activation times out. The followers are frozen so that
/// the activation is still committing when the client leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_activated_for_a_poll_whose_client_left_are_given_back() {
    let _g = serial().await;
    let (cluster, c) = one_partition_cluster("given-back").await;
    let key = c
        .create_job(NewJob::new("given-back").retries(4))
        .await
        .expect("create")
        .key;
    let leader = cluster.leaders().await[&1];
    let followers: Vec<u64> = (1..=3).filter(|&b| b != leader).collect();
    for &f in &followers {
        cluster.freeze_broker(f, true);
    }
    // The client leaves while its activation waits for a majority.
    let gone = tokio::spawn({
        let c = c.clone();
        async move {
            c.activate_jobs(poll("given-back", 1).request_timeout(Duration::from_secs(20)))
                .await
        }
    });
    // Seen from the leader: another poll finds the job claimed by that activation.
    // (Only the leader's metrics: the frozen followers would not answer, and a freeze
    // longer than the election timeout would end that leader's term.)
    let claimed = || metric(&cluster.broker_metrics[&leader], CLAIMED);
    let claimed_before = claimed().await;
    // A check that came first takes the job itself and hangs: it is cut short, and
    // its client is gone too (one activation in flight either way). Kept well under
    // the followers' election timeout (450 ms), which would end the leader's term.
    wait_until(
        Duration::from_secs(10),
        "an activation whose client left is in flight",
        || async {
            let once = poll("given-back", 1).request_timeout(Duration::ZERO);
            let answer =
                tokio::time::timeout(Duration::from_millis(100), c.activate_jobs(once)).await;
            matches!(answer, Ok(Ok(jobs)) if jobs.is_empty()) && claimed().await > claimed_before
        },
    )
    .await;
    gone.abort();
    let _ = gone.await;
    for &f in &followers {
        cluster.freeze_broker(f, false);
    }
    // Far sooner than its 60 s activation timeout, the next poll gets it, retries intact.
    let jobs = c
        .activate_jobs(poll("given-back", 1).request_timeout(Duration::from_secs(10)))
        .await
        .expect("poll");
    assert_eq!(
        jobs.iter().map(|j| (j.key, j.retries)).collect::<Vec<_>>(),
        vec![(key, 4)],
        "the job activated for the client that left was not given back"
    );
    assert_eq!(
        cluster
            .gateway_metric(0, "courier_gateway_activations_given_back_total")
            .await,
        1.0
    );
}

/// An ActivateJobs answer carries at most 4 MiB of jobs, what gRPC clients accept
/// by default. The broker activates only the jobs that fit the room the answer has
/// left, so none has to be given back; the rest go to the next poll at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_answer_stays_within_what_clients_accept_and_the_rest_waits_its_turn() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::one_broker(1)).await;
    let c = cluster.client();
    let big = format!("{{\"blob\":\"{}\"}}", "b".repeat(1536 * 1024));
    let mut keys = BTreeSet::new();
    for _ in 0..6 {
        let job = NewJob::new("large").variables(big.as_str()).retries(5);
        keys.insert(c.create_job(job).await.expect("create").key);
    }
    // The client (tonic, like Zeebe's) refuses messages above 4 MiB: all six in one
    // answer would be 9 MiB.
    let mut got = BTreeSet::new();
    let start = Instant::now();
    while got.len() < keys.len() && start.elapsed() < Duration::from_secs(20) {
        let jobs = c
            .activate_jobs(poll("large", 32).request_timeout(Duration::from_secs(2)))
            .await
            .expect("an answer the client accepts");
        assert!(
            jobs.len() <= 2,
            "{} jobs of 1.5 MiB in one answer",
            jobs.len()
        );
        for j in jobs {
            assert_eq!(j.retries, 5, "a job given back keeps its retries");
            assert!(got.insert(j.key), "job {} handed out twice", j.key);
        }
    }
    assert_eq!(
        got, keys,
        "every job, long before its 60 s activation timeout"
    );
    assert_eq!(
        cluster
            .gateway_metric(0, "courier_gateway_activations_given_back_total")
            .await,
        0.0,
        "the broker activated only what fit, so nothing was given back"
    );
}

/// A leader whose followers are all gone cannot commit. It says so: the partition
/// turns unhealthy in the topology and commands are refused at once with
/// UNAVAILABLE, instead of each waiting out its deadline (Zeebe's leader steps
/// down). When a follower is back, the partition is healthy and takes commands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_without_a_majority_reports_it_and_refuses_commands_at_once() {
    use courier_proto::gateway_protocol::partition::{
        PartitionBrokerHealth as Health, PartitionBrokerRole as Role,
    };
    let _g = serial().await;
    let (mut cluster, c) = one_partition_cluster("no-majority").await;
    let leader = cluster.leaders().await[&1];
    let followers: Vec<u64> = (1..=3).filter(|&b| b != leader).collect();
    // One job to complete, one left waiting for a poll.
    c.create_jobs([NewJob::new("no-majority"), NewJob::new("no-majority")])
        .await
        .expect("create");
    let active = activate_n(&c, poll("no-majority", 1), 1, Duration::from_secs(10)).await;
    let leaders_health = |c: Client| async move {
        let t = c.topology().await.expect("topology");
        t.brokers
            .iter()
            .find(|b| b.node_id as u64 == leader)
            .and_then(|b| b.partitions.iter().find(|p| p.partition_id == 1))
            .map(|p| (p.role, p.health))
    };
    assert_eq!(
        leaders_health(c.clone()).await,
        Some((Role::Leader as i32, Health::Healthy as i32))
    );
    for &f in &followers {
        cluster.kill_broker(f);
    }
    wait_until(
        Duration::from_secs(15),
        "the partition is reported unhealthy",
        || async {
            leaders_health(c.clone()).await == Some((Role::Leader as i32, Health::Unhealthy as i32))
        },
    )
    .await;
    // `courier status` says which brokers are silent and which replicas they hold.
    let addr = cluster.gateway_addr.clone();
    let silent_rows = |followers: Vec<u64>| {
        let addr = addr.clone();
        async move {
            let out = tokio::process::Command::new(common::courier_bin())
                .args(["status", "--address", &addr])
                .output()
                .await
                .expect("courier status");
            assert!(out.status.success(), "{out:?}");
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            followers.iter().all(|f| {
                text.lines().any(|l| {
                    l.starts_with(&format!("{f} "))
                        && l.ends_with("no answer: down or unreachable (replicas of 1)")
                })
            })
        }
    };
    wait_until(
        Duration::from_secs(10),
        "courier status names the brokers that are down",
        || silent_rows(followers.clone()),
    )
    .await;
    let once = c.clone().with_retry_budget(Duration::ZERO);
    let e = unavailable_at_once(once.create_job(NewJob::new("no-majority"))).await;
    assert!(e.to_string().contains("lost its majority"), "{e}");
    unavailable_at_once(once.complete_job(active[0], "")).await;
    // A poll that must not wait passes the partition over (its waiting job cannot
    // be activated without a majority) and answers at once.
    let started = Instant::now();
    let jobs = once
        .activate_jobs(poll("no-majority", 1).request_timeout(Duration::ZERO))
        .await
        .expect("an answer, with no jobs");
    assert!(jobs.is_empty());
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "a poll too: {:?}",
        started.elapsed()
    );
    cluster.start_broker(followers[0]);
    wait_until(
        Duration::from_secs(20),
        "a majority is back and commits",
        || async { once.create_job(NewJob::new("no-majority")).await.is_ok() },
    )
    .await;
    c.complete_job(active[0], "")
        .await
        .expect("complete, with a majority");
    wait_until(
        Duration::from_secs(10),
        "the partition is healthy",
        || async {
            let t = c.topology().await.expect("topology");
            t.brokers
                .iter()
                .flat_map(|b| b.partitions.iter())
                .any(|p| p.role == Role::Leader as i32 && p.health == Health::Healthy as i32)
        },
    )
    .await;
}

/// A partition that has had no leader for a while (here only one of its three
/// replicas is up, too few to elect one) is in an outage, not between two leaders:
/// the gateway answers its commands at once with UNAVAILABLE instead of holding each
/// until its deadline, and creates go nowhere rather than waiting. With a majority
/// back, it takes commands again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_for_a_partition_without_a_leader_for_a_while_are_refused_at_once() {
    let _g = serial().await;
    let (mut cluster, c) = one_partition_cluster("leaderless").await;
    c.create_job(NewJob::new("leaderless"))
        .await
        .expect("create");
    let active = activate_n(&c, poll("leaderless", 1), 1, Duration::from_secs(10)).await;
    let leader = cluster.leaders().await[&1];
    let follower = (1..=3).find(|&b| b != leader).unwrap();
    cluster.kill_broker(leader);
    cluster.kill_broker(follower);
    let once = c.clone().with_retry_budget(Duration::ZERO);
    // Within the first seconds the gateway still waits for a new leader; then it
    // stops waiting.
    wait_until(
        Duration::from_secs(20),
        "a completion is refused at once",
        || async {
            let started = Instant::now();
            let r = once.complete_job(active[0], "").await;
            matches!(&r, Err(e) if e.code() == Some(Code::Unavailable))
                && started.elapsed() < Duration::from_secs(1)
        },
    )
    .await;
    let e = unavailable_at_once(once.create_job(NewJob::new("leaderless"))).await;
    assert!(e.to_string().contains("no leader"), "{e}");
    cluster.start_broker(follower);
    c.complete_job(active[0], "")
        .await
        .expect("completed once a majority is back");
}

/// Awaits a call that must be refused with UNAVAILABLE at once (within 2 s), not
/// when its deadline passes; returns the refusal.
async fn unavailable_at_once<T: std::fmt::Debug>(
    call: impl std::future::Future<Output = Result<T, courier_client::ClientError>>,
) -> courier_client::ClientError {
    let started = Instant::now();
    let e = call.await.expect_err("refused");
    assert_eq!(e.code(), Some(Code::Unavailable), "{e}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "refused at once, not at its deadline: {:?}",
        started.elapsed()
    );
    e
}

/// After a broker fails, the partitions it led stay with the brokers that took them
/// over only until it is back: once it has been back and caught up for the
/// `--rebalance-after` time, they are handed back to it, so leaders spread out
/// again instead of piling up on the survivors. Jobs created throughout, the
/// hand-back included, are all completed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_go_back_to_their_preferred_leader_once_it_is_back() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts {
        rebalance_after: Some("1s"),
        ..ClusterOpts::default()
    })
    .await;
    let c = cluster.client();
    // Partition N prefers broker N (placement takes turns).
    let preferred: std::collections::BTreeMap<u32, u64> = [(1, 1), (2, 2), (3, 3)].into();
    wait_until(
        Duration::from_secs(20),
        "every partition is led by its preferred broker",
        || async { cluster.leaders().await == preferred },
    )
    .await;
    let worker = courier_client::JobWorker::builder(c.clone(), "rebalance", |_job| async {
        Ok::<_, std::convert::Infallible>(courier_client::JobOutcome::complete())
    })
    .spawn()
    .expect("worker");
    let stop = Arc::new(AtomicBool::new(false));
    let created = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let producer = {
        let (c, stop, created) = (c.clone(), stop.clone(), created.clone());
        tokio::spawn(async move {
            let mut keys = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                keys.push(
                    c.create_job(NewJob::new("rebalance"))
                        .await
                        .expect("create")
                        .key,
                );
                created.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            keys
        })
    };

    cluster.kill_broker(1);
    wait_until(
        Duration::from_secs(10),
        "partition 1 is led by another broker",
        || async { cluster.leaders().await.get(&1).is_some_and(|&l| l != 1) },
    )
    .await;
    cluster.start_broker(1);
    let back = Instant::now();
    wait_until(
        Duration::from_secs(20),
        "partition 1 is handed back to broker 1",
        || async { cluster.leaders().await == preferred },
    )
    .await;
    // Not before its --rebalance-after (1 s) of being back and caught up.
    assert!(
        back.elapsed() >= Duration::from_secs(1),
        "{:?}",
        back.elapsed()
    );
    assert!(
        cluster
            .broker_metric("courier_broker_leadership_rebalances_total")
            .await
            >= 1.0
    );
    cluster.wait_for_leaders(Duration::from_secs(10)).await;
    // Writes go on after the hand-back, through the gateway.
    let handed_back = created.load(Ordering::Relaxed);
    wait_until(Duration::from_secs(10), "creates go on", || async {
        created.load(Ordering::Relaxed) >= handed_back + 5
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let keys = producer.await.expect("producer");
    assert!(keys.len() > 20, "{} jobs created", keys.len());
    wait_until(
        Duration::from_secs(20),
        "every job is completed",
        || async { common::all_gone(&c, &keys).await },
    )
    .await;
    worker.shutdown().await;
    let log = cluster.broker_log(2) + &cluster.broker_log(3);
    assert!(
        log.contains("handing the partition back to its preferred leader"),
        "{log}"
    );
}

/// The two brokers left when a leader dies elect one of them even when their
/// election timers keep in step (here the same timeout, give or take 1 ms). Each
/// round kills the leader soon after the broker killed the round before is back,
/// so a survivor often lacks the dead leader's last entries. Before, when that
/// survivor had the higher id, it stood again and again: each time it raised the
/// term, which turned away the other survivor's candidacy for that same term, and
/// the partition had no leader for as long as the timers kept in step (a CI run
/// saw 10 s). Now a candidate refused for a longer log waits longer before it
/// stands again, as openraft's own timer would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survivors_whose_election_timers_keep_in_step_elect_a_leader() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts {
        partitions: 1,
        election_timeout: Some(("300ms", "301ms")),
        rebalance_after: Some("off"),
        ..ClusterOpts::default()
    })
    .await;
    let c = cluster.client();
    let mut keys = Vec::new();
    for round in 0..10 {
        let dead = cluster.leaders().await[&1];
        keys.push(
            c.create_job(NewJob::new("in-step"))
                .await
                .unwrap_or_else(|e| panic!("round {round}: create: {e}"))
                .key,
        );
        cluster.kill_broker(dead);
        let killed = Instant::now();
        wait_until(
            Duration::from_secs(6),
            &format!("round {round}: a survivor of broker {dead} leads partition 1"),
            || async { cluster.leaders().await.get(&1).is_some_and(|&l| l != dead) },
        )
        .await;
        let took = killed.elapsed();
        cluster.start_broker(dead);
        // Back as a follower, not necessarily caught up.
        wait_until(
            Duration::from_secs(10),
            &format!("round {round}: broker {dead} follows again (the election took {took:?})"),
            || async {
                cluster.broker_topology(dead).await.is_some_and(|t| {
                    t.partitions
                        .iter()
                        .any(|p| p.partition_id == 1 && p.role == "follower")
                })
            },
        )
        .await;
    }
    // No acknowledged job was lost on the way.
    let mut got = activate_n(
        &c,
        poll("in-step", 100),
        keys.len(),
        Duration::from_secs(20),
    )
    .await;
    got.sort_unstable();
    keys.sort_unstable();
    assert_eq!(got, keys);
}

/// A broker that takes seconds to load its partitions (here 450,000 open jobs)
/// counts its replicas' silence from when it is up, not from when each was opened:
/// back after a restart, it takes no partition from a leader that is alive. Before,
/// the replicas it opened first stood for election as soon as it was up, and a
/// restart moved the leadership of partitions whose leaders were fine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_slow_to_load_its_partitions_takes_no_leadership_when_back() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts {
        rebalance_after: Some("off"),
        ..ClusterOpts::default()
    })
    .await;
    let c = cluster.client();
    // Each create request lands on one partition, in turn.
    let keys = common::create_in_batches(&c, "backlog", 90, 5000).await;
    assert_eq!(keys.len(), 450_000);
    cluster.kill_broker(3);
    wait_until(
        Duration::from_secs(10),
        "partition 3 is led by a broker that is up",
        || async { cluster.leaders().await.get(&3).is_some_and(|&l| l != 3) },
    )
    .await;
    let before = cluster.leaders().await;
    cluster.start_broker(3);
    wait_until(Duration::from_secs(60), "broker 3 is up again", || async {
        cluster.broker_topology(3).await.is_some()
    })
    .await;
    // Past the lease and the longest election timeout of a replica that stood at once.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(cluster.leaders().await, before);
    let log = cluster.broker_log(3);
    let restarted = log.rsplit("starting the broker").next().unwrap_or_default();
    assert!(restarted.contains("jobs=150000"), "{restarted}");
    assert!(
        !restarted.contains("leading: telling the gateways"),
        "{restarted}"
    );
}

/// A one-partition cluster whose elections wait longer (2-2.5 s) than
/// [`sent_as_its_leader_dies`] keeps followers frozen.
async fn slow_electing_cluster(job_type: &str) -> (Cluster, Client) {
    let cluster = Cluster::start(ClusterOpts {
        partitions: 1,
        election_timeout: Some(("2s", "2500ms")),
        ..ClusterOpts::default()
    })
    .await;
    let c = cluster.client();
    wait_leaders_answer_empty_polls(&cluster, &c, job_type, 1.0).await;
    (cluster, c)
}

/// Sends a command (`send`) whose leader dies after its followers received the
/// entry, but before the gateway has the answer: the followers are frozen while the
/// leader appends it, so what the leader sends them waits in their sockets; then
/// the leader is killed and the followers let go. With election timeouts longer
/// than the freeze they read it before they stand, and the next leader commits it.
/// The gateway sends the command again to that leader; returns its answer.
async fn sent_as_its_leader_dies<T: Send + 'static>(
    cluster: &mut Cluster,
    send: impl std::future::Future<Output = T> + Send + 'static,
) -> T {
    let leader = cluster.leaders().await[&1];
    let leader_metrics = cluster.broker_metrics[&leader].clone();
    let log_index = || metric(&leader_metrics, "courier_broker_partition_log_index");
    let sent_entries = || {
        metric(
            &leader_metrics,
            r#"courier_broker_raft_appends_sent_total{entries="some"}"#,
        )
    };
    let before = log_index().await;
    let sent_before = sent_entries().await;
    let followers: Vec<u64> = (1..=3).filter(|b| *b != leader).collect();
    for f in &followers {
        cluster.freeze_broker(*f, true);
    }
    let sent = tokio::spawn(send);
    wait_until(
        Duration::from_secs(5),
        "the leader appends the command",
        || async { log_index().await > before },
    )
    .await;
    // The leader has sent the entry to both followers (their sockets hold it).
    wait_until(
        Duration::from_secs(5),
        "the leader sends the entry to its followers",
        || async { sent_entries().await >= sent_before + 2.0 },
    )
    .await;
    cluster.kill_broker(leader);
    for f in &followers {
        cluster.freeze_broker(*f, false);
    }
    tokio::time::timeout(Duration::from_secs(30), sent)
        .await
        .expect("the command is answered")
        .unwrap()
}

const REPEATED: &str = "courier_broker_repeated_commands_total";

/// A create sent again after its leader died with the answer: the next leader
/// commits the first attempt's entry and answers the resend with that job. One job
/// is created, not two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_sent_again_after_its_leader_died_creates_one_job() {
    let _g = serial().await;
    let (mut cluster, c) = slow_electing_cluster("once").await;
    let create = {
        let c = c.clone();
        async move { c.create_job(NewJob::new("once")).await }
    };
    let job = sent_as_its_leader_dies(&mut cluster, create)
        .await
        .expect("the create succeeds on the next leader");
    // Both replicas left hold the one job, and remember the create (and maybe
    // activations of the polls that waited for the leaders).
    wait_until(Duration::from_secs(10), "the replicas' gauges", || async {
        cluster.broker_metric("courier_broker_partition_jobs").await == 2.0
            && cluster
                .broker_metric("courier_broker_partition_remembered_requests")
                .await
                >= 2.0
    })
    .await;
    let jobs = c
        .activate_jobs(poll("once", 10).request_timeout(Duration::from_secs(1)))
        .await
        .expect("activate");
    let keys: Vec<i64> = jobs.iter().map(|j| j.key).collect();
    assert_eq!(
        keys,
        vec![job.key],
        "one job, the one the create answered with"
    );
    assert_eq!(
        cluster.broker_metric(REPEATED).await,
        1.0,
        "the resend was answered with the first attempt's job"
    );
}

/// A fail sent again after its leader died with the answer: answered as done (the
/// first attempt's outcome), not refused because the job is no longer activated,
/// and the job failed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fail_sent_again_after_its_leader_died_succeeds_and_fails_the_job_once() {
    let _g = serial().await;
    let (mut cluster, c) = slow_electing_cluster("once-fail").await;
    let key = c
        .create_job(NewJob::new("once-fail").retries(3))
        .await
        .expect("create")
        .key;
    let got = c
        .activate_jobs(poll("once-fail", 1))
        .await
        .expect("activate");
    assert_eq!(got.first().map(|j| j.key), Some(key));
    let fail = {
        let c = c.clone();
        async move { c.fail_job(key, 2, "boom", Duration::ZERO).await }
    };
    sent_as_its_leader_dies(&mut cluster, fail)
        .await
        .expect("the fail succeeds on the next leader");
    assert_eq!(cluster.broker_metric(REPEATED).await, 1.0);
    let again = c
        .activate_jobs(poll("once-fail", 1))
        .await
        .expect("activate");
    assert_eq!(
        again.iter().map(|j| (j.key, j.retries)).collect::<Vec<_>>(),
        vec![(key, 2)],
        "runnable again, failed once"
    );
}

/// An activation sent again after its leader died with the answer: the poll gets
/// the job the first attempt activated, instead of waiting while that job sits out
/// its activation timeout (60 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_activation_sent_again_after_its_leader_died_gets_its_jobs() {
    let _g = serial().await;
    let (mut cluster, c) = slow_electing_cluster("once-poll").await;
    let key = c
        .create_job(NewJob::new("once-poll"))
        .await
        .expect("create")
        .key;
    let activate = {
        let c = c.clone();
        async move {
            c.activate_jobs(poll("once-poll", 5).request_timeout(Duration::from_secs(15)))
                .await
        }
    };
    let started = Instant::now();
    let jobs = sent_as_its_leader_dies(&mut cluster, activate)
        .await
        .expect("the poll is answered");
    assert_eq!(
        jobs.iter().map(|j| j.key).collect::<Vec<_>>(),
        vec![key],
        "after {:?}",
        started.elapsed()
    );
    assert_eq!(cluster.broker_metric(REPEATED).await, 1.0);
}

/// A poll whose client gives up (its deadline passes) before its Activate is
/// committed: the gateway waits for the Activate's answer all the same and gives
/// the job back, so it does not sit out its activation timeout (60 s here). The
/// followers are frozen while the poll is on, so the commit comes after the
/// client's deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_whose_client_gave_up_before_the_commit_strands_no_job() {
    use courier_proto::gateway_protocol::{gateway_client::GatewayClient, ActivateJobsRequest};
    let _g = serial().await;
    let (cluster, c) = one_partition_cluster("hasty").await;
    let key = c
        .create_job(NewJob::new("hasty"))
        .await
        .expect("create")
        .key;
    let mut raw = GatewayClient::connect(format!("http://{}", cluster.gateway_addr))
        .await
        .expect("connect");
    let leader = cluster.leaders().await[&1];
    let followers: Vec<u64> = (1..=3).filter(|b| *b != leader).collect();
    for f in &followers {
        cluster.freeze_broker(*f, true);
    }
    let mut request = tonic::Request::new(ActivateJobsRequest {
        r#type: "hasty".into(),
        worker: "hasty".into(),
        timeout: 60_000,
        max_jobs_to_activate: 1,
        request_timeout: 10_000,
        ..Default::default()
    });
    let patience = Duration::from_millis(300);
    request.set_timeout(patience);
    // The client's side of its deadline, as gRPC clients keep it: the call is
    // dropped (its stream reset) when it passes.
    let call = async {
        let mut answers = raw.activate_jobs(request).await?.into_inner();
        answers.message().await
    };
    let early = tokio::time::timeout(patience, call).await;
    assert!(
        !matches!(&early, Ok(Ok(Some(a))) if !a.jobs.is_empty()),
        "no commit without the followers: {early:?}"
    );
    for f in &followers {
        cluster.freeze_broker(*f, false);
    }
    let jobs = c
        .activate_jobs(poll("hasty", 1).request_timeout(Duration::from_secs(5)))
        .await
        .expect("poll");
    let keys: Vec<i64> = jobs.iter().map(|j| j.key).collect();
    assert_eq!(keys, vec![key], "given back once its activation committed");
}

/// A create whose leader appended it and then could not commit it before the
/// request's deadline (the gateway's default, 15 s: its followers are frozen)
/// fails with DEADLINE_EXCEEDED, saying the job may have been created, never
/// UNAVAILABLE (which clients resend on their own). Once the followers are back,
/// the leader commits it: one job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_not_committed_by_its_deadline_fails_as_maybe_created() {
    let _g = serial().await;
    let (cluster, c) = one_partition_cluster("unsure").await;
    let leader = cluster.leaders().await[&1];
    let followers: Vec<u64> = (1..=3).filter(|b| *b != leader).collect();
    for f in &followers {
        cluster.freeze_broker(*f, true);
    }
    let once = c.clone().with_retry_budget(Duration::ZERO);
    let started = Instant::now();
    let e = once
        .create_job(NewJob::new("unsure"))
        .await
        .expect_err("no commit without the followers");
    let took = started.elapsed();
    for f in &followers {
        cluster.freeze_broker(*f, false);
    }
    assert_eq!(
        e.code(),
        Some(Code::DeadlineExceeded),
        "{e:?} after {took:?}"
    );
    assert!(e.to_string().contains("may have been created"), "{e}");
    let jobs = c
        .activate_jobs(poll("unsure", 10).request_timeout(Duration::from_secs(5)))
        .await
        .expect("poll");
    assert_eq!(jobs.len(), 1, "created once, after all: {jobs:?}");
}

/// A create sent to a leader that then stops answering (here frozen) may have been
/// applied there, so the gateway cannot move it to another partition: it waits out
/// the failover and sends it to the partition's next leader, instead of giving up
/// with UNAVAILABLE once its time on that partition (1 s) is up. Elections take
/// 0.9-1.2 s, so each round would give up more often than not without that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_sent_to_a_leader_that_stopped_answering_waits_for_the_next_one() {
    let _g = serial().await;
    let (cluster, c) = one_partition_cluster("in-flight").await;
    let once = c.clone().with_retry_budget(Duration::ZERO);
    let mut created = Vec::new();
    for round in 0..3 {
        let leader = cluster.leaders().await[&1];
        cluster.freeze_broker(leader, true);
        let started = Instant::now();
        let r = once.create_job(NewJob::new("in-flight")).await;
        let took = started.elapsed();
        cluster.freeze_broker(leader, false);
        let job = r.unwrap_or_else(|e| panic!("round {round}: refused after {took:?}: {e}"));
        assert!(took < Duration::from_secs(5), "round {round}: {took:?}");
        created.push(job.key);
        // The old leader follows again before the next round.
        wait_until(Duration::from_secs(10), "one leader", || async {
            cluster.leaders().await.len() == 1
                && cluster
                    .broker_topology(leader)
                    .await
                    .is_some_and(|t| t.partitions.iter().all(|p| p.role == "follower"))
        })
        .await;
    }
    for k in created {
        c.get_job(k).await.expect("the job exists");
    }
}
