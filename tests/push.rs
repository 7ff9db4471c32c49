//! Job push on a cluster of real processes: jobs reach `StreamActivatedJobs` clients
//! in the same replicated write that made them runnable, are shared round-robin,
//! survive dying clients, leaders and gateways, and are back-filled to new streams.

use crate::common;

use common::{
    all_gone, courier_bin, create_in_batches, serial, wait_broker_metric, wait_registered,
    wait_until, ClientProc, Cluster, ClusterOpts,
};
use courier_client::{ActivateJobs, Client, NewJob};
use courier_proto::cluster::{HeldQuery, PushJob};
use courier_proto::domain::DEFAULT_TENANT;
use courier_proto::gateway_protocol::{
    gateway_client::GatewayClient, ActivatedJob, FailJobRequest, StreamActivatedJobsRequest,
};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Opens a job stream on the gateway at `addr`.
async fn open_stream(
    addr: &str,
    job_type: &str,
    timeout: Duration,
) -> tonic::Streaming<ActivatedJob> {
    let mut c = GatewayClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    c.stream_activated_jobs(StreamActivatedJobsRequest {
        r#type: job_type.into(),
        worker: "push-test".into(),
        timeout: timeout.as_millis() as i64,
        fetch_variable: vec![],
        tenant_ids: vec![],
    })
    .await
    .expect("open stream")
    .into_inner()
}

/// A worker that completes every job it is pushed and records the keys.
fn completing_worker(
    client: Client,
    mut stream: tonic::Streaming<ActivatedJob>,
) -> (Arc<Mutex<Vec<i64>>>, tokio::task::JoinHandle<()>) {
    let got = Arc::new(Mutex::new(Vec::new()));
    let g = got.clone();
    let task = tokio::spawn(async move {
        while let Ok(Some(job)) = stream.message().await {
            g.lock().unwrap().push(job.key);
            let _ = client.complete_job(job.key, "").await;
        }
    });
    (got, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streaming_worker_gets_jobs_pushed_without_polling() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client();
    let mut stream = open_stream(&cluster.gateway_addr, "pushed", Duration::from_secs(60)).await;
    wait_registered(&cluster, 3.0).await;

    let mut keys = BTreeSet::new();
    for i in 0..20 {
        let job = NewJob::new("pushed").variables(format!("{{\"i\":{i}}}").as_str());
        keys.insert(c.create_job(job).await.expect("create").key);
    }
    let mut got = BTreeSet::new();
    while got.len() < keys.len() {
        let job = tokio::time::timeout(Duration::from_secs(5), stream.message())
            .await
            .expect("a pushed job within 5 s")
            .expect("stream healthy")
            .expect("stream open");
        assert_eq!(job.r#type, "pushed");
        assert_eq!(job.worker, "push-test");
        assert!(job.variables.contains("\"i\""));
        assert_eq!(job.custom_headers, "{}");
        got.insert(job.key);
        c.complete_job(job.key, "").await.expect("complete");
    }
    assert_eq!(got, keys);
    // Pushed, not polled: no ActivateJobs was ever made.
    assert_eq!(
        cluster
            .gateway_metric(0, "courier_gateway_jobs_pushed_total")
            .await,
        20.0
    );
    assert_eq!(
        cluster
            .gateway_metric(0, "courier_gateway_jobs_activated_total")
            .await,
        0.0
    );
    assert!(
        cluster
            .broker_metric("courier_broker_create_to_push_seconds_count")
            .await
            >= 20.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clients_with_the_same_properties_share_the_jobs_evenly() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client();
    let s1 = open_stream(&cluster.gateway_addr, "shared", Duration::from_secs(60)).await;
    let s2 = open_stream(&cluster.gateway_addr, "shared", Duration::from_secs(60)).await;
    // One aggregated stream, registered once per broker.
    wait_registered(&cluster, 3.0).await;
    let (got1, _t1) = completing_worker(c.clone(), s1);
    let (got2, _t2) = completing_worker(c.clone(), s2);

    let n = 200;
    let mut keys = Vec::new();
    for _ in 0..n {
        keys.push(
            c.create_job(NewJob::new("shared"))
                .await
                .expect("create")
                .key,
        );
    }
    wait_until(
        Duration::from_secs(20),
        "every job is handed out",
        || async { got1.lock().unwrap().len() + got2.lock().unwrap().len() >= n },
    )
    .await;
    let (a, b) = (got1.lock().unwrap().len(), got2.lock().unwrap().len());
    eprintln!("client 1 got {a}, client 2 got {b}");
    assert_eq!(a + b, n, "each job handed to exactly one client");
    assert!(
        (90..=110).contains(&a) && (90..=110).contains(&b),
        "not an even split: {a} / {b}"
    );
    wait_until(Duration::from_secs(10), "all completed", || {
        all_gone(&c, &keys)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_dies_mid_stream_loses_nothing() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client();
    let mut dying = open_stream(
        &cluster.gateway_addr,
        "fragile",
        Duration::from_millis(1500),
    )
    .await;
    let healthy = open_stream(
        &cluster.gateway_addr,
        "fragile",
        Duration::from_millis(1500),
    )
    .await;
    wait_registered(&cluster, 3.0).await;
    let (done, _t) = completing_worker(c.clone(), healthy);

    let mut keys = Vec::new();
    for _ in 0..40 {
        keys.push(
            c.create_job(NewJob::new("fragile"))
                .await
                .expect("create")
                .key,
        );
    }
    // The dying client takes a few jobs, never completes them, and goes away.
    let mut taken = Vec::new();
    while taken.len() < 5 {
        let job = tokio::time::timeout(Duration::from_secs(5), dying.message())
            .await
            .expect("job within 5 s")
            .expect("healthy")
            .expect("open");
        taken.push(job.key);
    }
    drop(dying);
    for _ in 0..40 {
        keys.push(
            c.create_job(NewJob::new("fragile"))
                .await
                .expect("create")
                .key,
        );
    }
    // Everything is completed in the end: what the dead client held comes back by
    // its deadline and is pushed to the healthy one.
    wait_until(Duration::from_secs(30), "every job completed", || {
        all_gone(&c, &keys)
    })
    .await;
    let done = done.lock().unwrap().clone();
    for k in &taken {
        assert!(
            done.contains(k),
            "job {k} held by the dead client was never redone"
        );
    }
    // Pushes to the dead client, refused, timed out or finished late: none is left
    // tracked once every job is done.
    wait_pushed_active(&cluster, 0.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_created_before_any_worker_are_backfilled_by_push() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client();
    let mut keys = Vec::new();
    for _ in 0..50 {
        keys.push(
            c.create_job(NewJob::new("early"))
                .await
                .expect("create")
                .key,
        );
    }
    let stream = open_stream(&cluster.gateway_addr, "early", Duration::from_secs(60)).await;
    let (got, _t) = completing_worker(c.clone(), stream);
    wait_until(Duration::from_secs(15), "the backlog is pushed", || async {
        got.lock().unwrap().len() >= 50
    })
    .await;
    let got: BTreeSet<i64> = got.lock().unwrap().iter().copied().collect();
    assert_eq!(got, keys.iter().copied().collect());
    assert_eq!(
        cluster
            .gateway_metric(0, "courier_gateway_jobs_activated_total")
            .await,
        0.0
    );
    assert!(
        cluster
            .broker_metric("courier_broker_backfilled_jobs_total")
            .await
            >= 50.0
    );
}

/// Creates a job of `job_type` and waits until `s` is pushed it.
async fn create_pushed(c: &Client, s: &mut tonic::Streaming<ActivatedJob>, job_type: &str) -> i64 {
    let key = c
        .create_job(NewJob::new(job_type))
        .await
        .expect("create")
        .key;
    assert_eq!(next(s).await.key, key);
    key
}

/// The next pushed job, within 5 s.
async fn next(s: &mut tonic::Streaming<ActivatedJob>) -> ActivatedJob {
    tokio::time::timeout(Duration::from_secs(5), s.message())
        .await
        .expect("pushed within 5 s")
        .expect("healthy")
        .expect("open")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_and_timed_out_jobs_are_pushed_again() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client();
    let mut s = open_stream(&cluster.gateway_addr, "again", Duration::from_millis(1000)).await;
    wait_registered(&cluster, 3.0).await;
    let key = c
        .create_job(NewJob::new("again"))
        .await
        .expect("create")
        .key;
    let first = next(&mut s).await;
    assert_eq!(first.key, key);
    wait_pushed_active(&cluster, 1.0).await;
    // Fail with retries and no back-off: runnable at once, pushed at once. The clock
    // starts before the call: the second activation's deadline is stamped after it.
    let t0 = Instant::now();
    c.fail_job(key, 2, "retry me", Duration::ZERO)
        .await
        .expect("fail");
    let second = next(&mut s).await;
    assert_eq!((second.key, second.retries), (key, 2));
    // Not completed: the activation times out and the job is pushed again.
    let third = next(&mut s).await;
    assert_eq!(third.key, key);
    assert!(
        t0.elapsed() >= Duration::from_millis(995),
        "{:?}",
        t0.elapsed()
    );
    wait_pushed_active(&cluster, 1.0).await;
    c.complete_job(key, "").await.expect("complete");
    // The leader forgets a pushed job once its last activation ends.
    wait_pushed_active(&cluster, 0.0).await;
}

/// A stream whose activations last 1 ms: each pushed job times out before its
/// worker can answer and is pushed again. That cycle is paced by the leader's
/// timer rounds (10 a second), not run as fast as the log commits (thousands of
/// pushes a second before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_activation_is_shorter_than_a_round_trip_is_not_pushed_in_a_tight_loop() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::one_broker(1)).await;
    let c = cluster.client();
    let mut s = open_stream(&cluster.gateway_addr, "tiny", Duration::from_millis(1)).await;
    wait_registered(&cluster, 1.0).await;
    c.create_job(NewJob::new("tiny")).await.expect("create");
    next(&mut s).await;
    let pushes = || cluster.broker_metric("courier_broker_push_attempts_total");
    let before = pushes().await;
    let window = Instant::now();
    // Watched for a while: what is measured is the pace of a loop.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let pushed = pushes().await - before;
    let took = window.elapsed().as_secs_f64();
    eprintln!("{pushed} pushes in {took:.2} s");
    assert!(pushed >= 2.0, "the job is still pushed again: {pushed}");
    assert!(
        pushed <= 15.0 * took,
        "{pushed} pushes in {took:.2} s of one job"
    );
}

/// Waits until the leaders track `n` pushed jobs whose activation has not ended.
async fn wait_pushed_active(cluster: &Cluster, n: f64) {
    wait_broker_metric(cluster, "courier_broker_pushed_jobs_active", n).await;
}

/// Streams jobs of `job_type` to a worker that completes them, creates 30, then
/// stops the leader of partition 1 with `stop` and keeps creating until a job lands
/// on partition 1 again (creates of partition 1 wait for its next leader, or move on
/// to another partition). Returns how long after `stop` that job was pushed, the
/// stopped leader, a client, and every key created.
async fn stop_a_leader_while_streaming(
    cluster: &mut Cluster,
    job_type: &str,
    stop: impl FnOnce(&mut Cluster, u64),
) -> (Duration, u64, Client, Vec<i64>) {
    let c = cluster.client();
    let registered = cluster
        .broker_metric("courier_broker_registered_streams")
        .await;
    let stream = open_stream(&cluster.gateway_addr, job_type, Duration::from_secs(2)).await;
    wait_registered(cluster, registered + 3.0).await;
    let (got, _t) = completing_worker(c.clone(), stream);
    let mut keys = Vec::new();
    for _ in 0..30 {
        keys.push(
            c.create_job(NewJob::new(job_type))
                .await
                .expect("create")
                .key,
        );
    }
    let victim = cluster.leaders().await[&1];
    stop(cluster, victim);
    let stopped = Instant::now();
    let first_on_1 = loop {
        if let Ok(r) = c.create_job(NewJob::new(job_type)).await {
            keys.push(r.key);
            if r.key >> 51 == 1 {
                break r.key;
            }
        }
    };
    wait_until(
        Duration::from_secs(10),
        "a job of partition 1 is pushed again",
        || async { got.lock().unwrap().contains(&first_on_1) },
    )
    .await;
    (stopped.elapsed(), victim, c, keys)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_resume_within_two_seconds_after_a_leader_is_killed() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts::default()).await;
    let (resumed, _, c, keys) =
        stop_a_leader_while_streaming(&mut cluster, "steady", |cluster, victim| {
            cluster.kill_broker(victim)
        })
        .await;
    eprintln!("pushes on partition 1 resumed {resumed:?} after the kill");
    assert!(
        resumed < Duration::from_secs(2),
        "resumed after {resumed:?}"
    );
    wait_until(Duration::from_secs(30), "every job completed", || {
        all_gone(&c, &keys)
    })
    .await;
}

/// A leader asked to stop (SIGTERM) first hands its partitions to up-to-date
/// followers: pushes on its partition resume sooner than any election could give
/// it a leader (openraft 0.9 waits for the leader lease, 0.6 s, and an election
/// timeout, 0.3 s at least, after the last heartbeat), the old leader exits
/// cleanly, and every job is completed, those created meanwhile by other producers
/// too.
/// How often a broker told the first gateway who leads a partition: a leader's
/// announcement, or a NotLeader answer naming the leader. Counted whether or not it
/// was news: a topology round that an early routing failure asked for may tell the
/// gateway first, right at a hand-off.
async fn told_of_leaders(cluster: &Cluster) -> f64 {
    cluster
        .gateway_metric(0, "courier_gateway_leader_reports_total")
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_asked_to_stop_hands_its_partitions_over_first() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts::default()).await;
    // Load besides, of a type with a worker of its own (so the jobs measured do not
    // queue behind it): entries are in flight when the leader is asked to stop.
    let load_stream =
        open_stream(&cluster.gateway_addr, "handed-load", Duration::from_secs(2)).await;
    let (_, _load_worker) = completing_worker(cluster.client(), load_stream);
    wait_registered(&cluster, 3.0).await;
    let loaded = Arc::new(Mutex::new(Vec::new()));
    let stop_load = tokio_util::sync::CancellationToken::new();
    let load: Vec<_> = (0..3)
        .map(|_| {
            let (c, loaded, stop) = (cluster.client(), loaded.clone(), stop_load.clone());
            tokio::spawn(async move {
                while !stop.is_cancelled() {
                    if let Ok(r) = c.create_job(NewJob::new("handed-load")).await {
                        loaded.lock().unwrap().push(r.key);
                    }
                }
            })
        })
        .collect();
    let told_before = told_of_leaders(&cluster).await;
    let (resumed, victim, c, mut keys) =
        stop_a_leader_while_streaming(&mut cluster, "handed", |cluster, victim| {
            cluster.ask_broker_to_stop(victim)
        })
        .await;
    // The gateway was told of the new leader, not left to find it in a topology round.
    wait_until(
        Duration::from_secs(5),
        "a broker told the gateway of the new leader",
        || async { told_of_leaders(&cluster).await > told_before },
    )
    .await;
    stop_load.cancel();
    for l in load {
        l.await.unwrap();
    }
    keys.extend(loaded.lock().unwrap().iter().copied());
    eprintln!("pushes on partition 1 resumed {resumed:?} after SIGTERM to its leader");
    assert!(
        resumed < Duration::from_millis(800),
        "resumed after {resumed:?}: the partition waited for an election"
    );
    assert!(
        cluster.terminate_broker(victim, Duration::from_secs(10)),
        "the old leader did not exit cleanly"
    );
    assert_ne!(cluster.leaders().await.get(&1), Some(&victim));
    wait_until(Duration::from_secs(30), "every job completed", || {
        all_gone(&c, &keys)
    })
    .await;
}

/// Two brokers asked to stop at once, a leader and the follower it would ask first
/// (the lower id): that follower, stopping too, will not stand for election, and the
/// partition goes to the follower that stays. (Both stopped, it then has no
/// majority, but it leads: only the hand-over could have made it leader.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_leader_hands_over_to_a_follower_that_is_not_stopping() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts::default()).await;
    let leader = cluster.leaders().await[&1];
    let followers: Vec<u64> = (1..=3).filter(|b| *b != leader).collect();
    let (stopping, staying) = (followers[0], followers[1]);
    cluster.ask_broker_to_stop(stopping);
    cluster.ask_broker_to_stop(leader);
    assert!(cluster.terminate_broker(leader, Duration::from_secs(10)));
    assert!(cluster.terminate_broker(stopping, Duration::from_secs(10)));
    let t = cluster.broker_topology(staying).await.expect("topology");
    let p1 = t
        .partitions
        .iter()
        .find(|p| p.partition_id == 1)
        .expect("partition 1");
    assert_eq!(p1.role, "leader", "{p1:?}");
}

/// Two of the three brokers die at once, so no partition has a majority, and come
/// back; then the third dies. Creates and completions wait for a majority (the
/// client retries them), the stream stays open at the gateway, and every
/// acknowledged job is pushed and completed, including those created during the
/// outage and those only the restarted brokers can lead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_outlive_a_lost_majority_and_every_job_is_completed_once_it_is_back() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts::default()).await;
    // Retries outlast the outage, for creates and completions alike.
    let c = cluster.client().with_retry_budget(Duration::from_secs(60));
    let stream = open_stream(&cluster.gateway_addr, "majority", Duration::from_secs(60)).await;
    wait_registered(&cluster, 3.0).await;
    let (got, _worker) = completing_worker(c.clone(), stream);
    let mut keys = create_in_batches(&c, "majority", 10, 10).await;
    wait_until(
        Duration::from_secs(10),
        "the first jobs are pushed",
        || async { got.lock().unwrap().len() >= keys.len() },
    )
    .await;

    cluster.kill_broker(1);
    cluster.kill_broker(2);
    let acked = Arc::new(Mutex::new(Vec::new()));
    let producer = tokio::spawn({
        let (c, acked) = (c.clone(), acked.clone());
        async move {
            for i in 0..50 {
                let job = NewJob::new("majority").variables(format!("{{\"i\":{i}}}").as_str());
                let key = c.create_job(job).await.expect("create, retried").key;
                acked.lock().unwrap().push(key);
            }
        }
    });
    // The outage lasts 2 s; without a majority nothing can be acknowledged.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        acked.lock().unwrap().is_empty(),
        "a create was acknowledged without a majority"
    );
    cluster.start_broker(1);
    cluster.start_broker(2);
    producer.await.expect("producer");
    keys.extend(acked.lock().unwrap().iter().copied());
    // Broker 3 may have taken every leadership; without it, brokers 1 and 2 lead,
    // and know the stream only from the gateway registering it again.
    cluster.kill_broker(3);
    keys.extend(create_in_batches(&c, "majority", 5, 10).await);

    wait_until(Duration::from_secs(30), "every job is pushed", || async {
        let got = got.lock().unwrap();
        keys.iter().all(|k| got.contains(k))
    })
    .await;
    wait_until(Duration::from_secs(30), "every job is completed", || {
        all_gone(&c, &keys)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_gateway_is_dropped_at_once_and_workers_move_to_another() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts::default()).await;
    let other = cluster.add_gateway();
    let c = cluster.client_of(other);
    // A timeout the first jobs cannot reach while the worker completes them one by one
    // (slow in a loaded CI run): one timing out would be pushed again, and that push
    // could be on its way when the gateway is killed.
    let stream = open_stream(&cluster.gateway_addr, "moving", Duration::from_secs(10)).await;
    wait_registered(&cluster, 3.0).await;
    let (got, _t) = completing_worker(c.clone(), stream);
    let mut keys = Vec::new();
    for _ in 0..20 {
        keys.push(
            c.create_job(NewJob::new("moving"))
                .await
                .expect("create")
                .key,
        );
    }
    wait_until(Duration::from_secs(10), "first jobs done", || async {
        got.lock().unwrap().len() >= 20
    })
    .await;
    // The gateway hands a job to its client before it acks the push: kill it only
    // once every push is answered, or an ack still on its way is lost with it.
    wait_pushes_accepted(&cluster, 20.0, "first pushes acked").await;

    cluster.kill_gateway(0);
    let killed = Instant::now();
    wait_registered(&cluster, 0.0).await;
    let dropped = killed.elapsed();
    eprintln!("brokers dropped the dead gateway's streams after {dropped:?}");
    assert!(dropped < Duration::from_secs(2), "{dropped:?}");
    // Created while no worker streams: they wait, then reach the worker that moved.
    for _ in 0..20 {
        keys.push(
            c.create_job(NewJob::new("moving"))
                .await
                .expect("create")
                .key,
        );
    }
    let stream = open_stream(
        &cluster.gateway_addrs[other],
        "moving",
        Duration::from_secs(2),
    )
    .await;
    let (_got2, _t2) = completing_worker(c.clone(), stream);
    wait_until(Duration::from_secs(20), "every job completed", || {
        all_gone(&c, &keys)
    })
    .await;
    // Nothing was pushed into the dead gateway and left waiting for an answer.
    let unknown = cluster
        .broker_metric("courier_broker_push_attempts_total{outcome=\"unknown\"}")
        .await;
    assert_eq!(unknown, 0.0, "pushes without an answer");
}

/// Checks that the worker got every job of `keys` and no other, and that the
/// leaders made `gone` jobs runnable again because their gateway was gone.
async fn assert_got_every_job(cluster: &Cluster, got: &Mutex<Vec<i64>>, keys: &[i64], gone: f64) {
    assert_eq!(
        got.lock().unwrap().iter().copied().collect::<BTreeSet<_>>(),
        keys.iter().copied().collect::<BTreeSet<_>>()
    );
    assert_eq!(
        cluster
            .broker_metric("courier_broker_reconciled_pushes_total{outcome=\"gateway_gone\"}")
            .await,
        gone
    );
}

/// Jobs handed out through a gateway that dies (pushed, whether its client had
/// them or they waited in its buffers, or answered to a poll) are lost with it:
/// their results cannot come back through it. Once it has been gone for the grace
/// (10 s), the leaders make them runnable again, well before their (here 120 s)
/// activation timeout, and a worker on another gateway gets them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_pushed_through_a_gateway_that_died_reach_workers_elsewhere() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts::default()).await;
    let other = cluster.add_gateway();
    let c = cluster.client_of(other);
    // A worker that takes jobs and never finishes them: 32 credit, 16 spare, all
    // reported as credit.
    let mut holding =
        open_stream(&cluster.gateway_addr, "stranded", Duration::from_secs(120)).await;
    wait_registered(&cluster, 3.0).await;
    let mut keys = Vec::new();
    for _ in 0..48 {
        keys.push(
            c.create_job(NewJob::new("stranded"))
                .await
                .expect("create")
                .key,
        );
    }
    let first = next(&mut holding).await;
    assert!(keys.contains(&first.key));
    wait_pushes_accepted(&cluster, 48.0, "every job pushed").await;
    // And a poller on the same gateway that never finishes what it got.
    let poller = cluster.client_of(0);
    for _ in 0..5 {
        keys.push(
            c.create_job(NewJob::new("stranded"))
                .await
                .expect("create")
                .key,
        );
    }
    let mut polled = 0;
    let until = Instant::now() + Duration::from_secs(10);
    while polled < 5 && Instant::now() < until {
        let got = poller
            .activate_jobs(
                ActivateJobs::new("stranded")
                    .max_jobs(10)
                    .timeout(Duration::from_secs(120))
                    .request_timeout(Duration::from_millis(500)),
            )
            .await
            .expect("poll");
        polled += got.len();
    }
    assert_eq!(polled, 5, "the jobs no stream had room for are polled");
    cluster.kill_gateway(0);
    let killed = Instant::now();
    let stream = open_stream(
        &cluster.gateway_addrs[other],
        "stranded",
        Duration::from_secs(120),
    )
    .await;
    let (got, _t) = completing_worker(c.clone(), stream);
    wait_until(Duration::from_secs(30), "every job completed", || {
        all_gone(&c, &keys)
    })
    .await;
    eprintln!(
        "every job completed {:?} after the gateway died",
        killed.elapsed()
    );
    assert_got_every_job(&cluster, &got, &keys, 53.0).await;
}

/// The keys of the jobs pushed to `s` until it has `n` of them, or 10 s have passed.
async fn pushed_up_to(s: &mut tonic::Streaming<ActivatedJob>, n: usize) -> BTreeSet<i64> {
    let mut got = BTreeSet::new();
    let until = Instant::now() + Duration::from_secs(10);
    while got.len() < n && Instant::now() < until {
        if let Ok(Ok(Some(job))) =
            tokio::time::timeout(Duration::from_millis(200), s.message()).await
        {
            got.insert(job.key);
        }
    }
    got
}

/// A backlog on one partition gets the stream's whole credit, not only the share of
/// the broker that leads it: the brokers with nothing to push give theirs up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_on_one_partition_gets_the_streams_whole_credit() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::default()).await;
    cluster.wait_for_leaders(Duration::from_secs(20)).await;
    let c = cluster.client();
    let mut holding = open_stream(&cluster.gateway_addr, "skewed", Duration::from_secs(120)).await;
    wait_registered(&cluster, 3.0).await;
    // One request: its jobs land on one partition.
    let keys = create_in_batches(&c, "skewed", 1, 60).await;
    let got = pushed_up_to(&mut holding, 32).await;
    // A Zeebe client's credit is 32: all of it is used, and no more.
    assert_eq!(got.len(), 32, "pushed to a client that never finishes one");
    assert!(got.iter().all(|k| keys.contains(k)));
    let more = tokio::time::timeout(Duration::from_millis(500), holding.message()).await;
    assert!(more.is_err(), "no push beyond the credit: {more:?}");

    // The same when the backlog is there before the stream: its back-fill says so.
    let keys = create_in_batches(&c, "skewed-before", 1, 60).await;
    let mut late = open_stream(
        &cluster.gateway_addr,
        "skewed-before",
        Duration::from_secs(120),
    )
    .await;
    let got = pushed_up_to(&mut late, 32).await;
    assert_eq!(
        got.len(),
        32,
        "back-filled to a client that never finishes one"
    );
    assert!(got.iter().all(|k| keys.contains(k)));
}

/// A whole cluster that restarts, its gateway too, elects its leaders anew: no link
/// of the old gateway ends at the new leaders, yet the jobs it
/// had handed out, pushed or polled, run again once the lost-gateway grace has
/// passed, not after their activation timeouts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_handed_out_before_a_whole_cluster_restarted_run_again_after_the_grace() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts {
        lost_gateway_grace: Some("2s"),
        ..ClusterOpts::one_broker(2)
    })
    .await;
    let c = cluster.client();
    let hold = Duration::from_secs(300);
    let mut holding = open_stream(&cluster.gateway_addr, "restarted", hold).await;
    wait_registered(&cluster, 1.0).await;
    let mut pushed = Vec::new();
    for _ in 0..4 {
        pushed.push(create_pushed(&c, &mut holding, "restarted").await);
    }
    let polled_key = c
        .create_job(NewJob::new("restarted-polled"))
        .await
        .expect("create")
        .key;
    let got = c
        .activate_jobs(ActivateJobs::new("restarted-polled").timeout(hold))
        .await
        .expect("poll");
    assert_eq!(
        got.iter().map(|j| j.key).collect::<Vec<_>>(),
        vec![polled_key]
    );

    assert!(cluster.terminate_gateway(Duration::from_secs(10)));
    assert!(cluster.terminate_broker(1, Duration::from_secs(10)));
    drop(holding);
    cluster.start_broker(1);
    cluster.start_gateway(0);
    cluster.wait_for_leaders(Duration::from_secs(20)).await;
    let restarted = Instant::now();
    let stream = open_stream(&cluster.gateway_addr, "restarted", hold).await;
    let (got, _t) = completing_worker(c.clone(), stream);
    wait_until(
        Duration::from_secs(30),
        "every pushed job completed",
        || all_gone(&c, &pushed),
    )
    .await;
    let mut again = Vec::new();
    while again.is_empty() && restarted.elapsed() < Duration::from_secs(30) {
        again = c
            .activate_jobs(
                ActivateJobs::new("restarted-polled")
                    .timeout(hold)
                    .request_timeout(Duration::from_secs(1)),
            )
            .await
            .expect("poll");
    }
    assert_eq!(
        again.iter().map(|j| j.key).collect::<Vec<_>>(),
        vec![polled_key]
    );
    eprintln!(
        "every job ran again {:?} after the restart",
        restarted.elapsed()
    );
    let mut got = got.lock().unwrap().clone();
    got.sort();
    pushed.sort();
    assert_eq!(got, pushed);
}

/// Waits (10 s at most) until the brokers have had `n` pushes accepted.
async fn wait_pushes_accepted(cluster: &Cluster, n: f64, what: &str) {
    wait_until(Duration::from_secs(10), what, || async {
        cluster
            .broker_metric("courier_broker_push_attempts_total{outcome=\"accepted\"}")
            .await
            >= n
    })
    .await;
}

/// A cluster with `--lost-gateway-grace off` and a second gateway; a client of that
/// gateway (its index), and a stream of `job_type` open on the first one.
async fn without_grace_two_gateways(
    job_type: &str,
    timeout: Duration,
) -> (Cluster, usize, Client, tonic::Streaming<ActivatedJob>) {
    let mut cluster = Cluster::start(ClusterOpts {
        lost_gateway_grace: Some("off"),
        ..ClusterOpts::default()
    })
    .await;
    let other = cluster.add_gateway();
    let c = cluster.client_of(other);
    let holding = open_stream(&cluster.gateway_addr, job_type, timeout).await;
    wait_registered(&cluster, 3.0).await;
    (cluster, other, c, holding)
}

/// With `--lost-gateway-grace off`, the jobs a gateway that died had handed to its
/// client wait for their activation timeout, as in Zeebe (their worker may still be
/// running them), and only then run again through another gateway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_lost_gateway_grace_a_dead_gateways_jobs_wait_for_their_timeout() {
    let _g = serial().await;
    // Longer than the default grace (10 s) and the time to the kill together.
    let timeout = Duration::from_secs(16);
    let (mut cluster, other, c, mut holding) = without_grace_two_gateways("kept", timeout).await;
    // Each job's activation, and so its deadline, comes after this.
    let before = Instant::now();
    let mut keys = Vec::new();
    for _ in 0..8 {
        keys.push(c.create_job(NewJob::new("kept")).await.expect("create").key);
    }
    let mut handed = BTreeSet::new();
    while handed.len() < keys.len() {
        handed.insert(next(&mut holding).await.key);
    }
    cluster.kill_gateway(0);
    let stream = open_stream(&cluster.gateway_addrs[other], "kept", timeout).await;
    let (got, _t) = completing_worker(c.clone(), stream);
    wait_until(Duration::from_secs(40), "every job completed", || {
        all_gone(&c, &keys)
    })
    .await;
    let after = before.elapsed();
    assert!(
        after >= timeout - Duration::from_secs(1),
        "the jobs ran again {after:?} after their activation, before its timeout"
    );
    assert_got_every_job(&cluster, &got, &keys, 0.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_is_told_of_a_pushed_jobs_end_only_when_another_ended_it() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts::default()).await;
    let other = cluster.add_gateway();
    let here = cluster.client();
    let there = cluster.client_of(other);
    let mut s = open_stream(&cluster.gateway_addr, "ends", Duration::from_secs(30)).await;
    wait_registered(&cluster, 3.0).await;
    let notices = |outcome: &'static str| {
        let cluster = &cluster;
        async move {
            cluster
                .broker_metric(&format!(
                    "courier_broker_finished_notices_total{{outcome=\"{outcome}\"}}"
                ))
                .await
        }
    };

    // Completed through the gateway holding it: that gateway already knows.
    let key = create_pushed(&here, &mut s, "ends").await;
    here.complete_job(key, "").await.expect("complete");
    wait_until(Duration::from_secs(10), "the end counted", || async {
        notices("sender").await == 1.0
    })
    .await;
    assert_eq!(notices("sent").await, 0.0);

    // Failed through another gateway: the one holding it is told.
    let key = create_pushed(&here, &mut s, "ends").await;
    there
        .fail_job(key, 0, "no retries", Duration::ZERO)
        .await
        .expect("fail");
    wait_until(Duration::from_secs(10), "the holder told", || async {
        notices("sent").await == 1.0
    })
    .await;
    assert_eq!(notices("sender").await, 1.0);
    wait_pushed_active(&cluster, 0.0).await;
}

/// A CompleteJob, FailJob or ThrowError the gateway turns down as invalid finishes
/// nothing: the worker still holds the job, so its credit stays in use until a valid
/// one comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_completion_leaves_the_jobs_credit_in_use() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client();
    let mut s = open_stream(&cluster.gateway_addr, "held", Duration::from_secs(60)).await;
    wait_registered(&cluster, 3.0).await;
    let key = create_pushed(&c, &mut s, "held").await;
    let in_use = || cluster.gateway_metric(0, "courier_gateway_credit_in_use");
    assert_eq!(in_use().await, 1.0);
    let invalid = Some(tonic::Code::InvalidArgument);
    let e = c.complete_job(key, "[1]").await.expect_err("not an object");
    assert_eq!(e.code(), invalid);
    let mut raw = GatewayClient::connect(format!("http://{}", cluster.gateway_addr))
        .await
        .expect("connect");
    let fail = FailJobRequest {
        job_key: key,
        retries: 1,
        error_message: "x".into(),
        variables: "[1]".into(),
        ..Default::default()
    };
    let e = raw.fail_job(fail).await.expect_err("not an object");
    assert_eq!(Some(e.code()), invalid);
    assert_eq!(
        in_use().await,
        1.0,
        "an invalid request gave the credit back"
    );
    c.complete_job(key, "").await.expect("complete");
    wait_until(Duration::from_secs(5), "the credit is back", || async {
        in_use().await == 0.0
    })
    .await;
}

/// A gateway played by the test over the broker link protocol: it links to every
/// broker (reconnecting to those that are down) as `id`, registers one stream of
/// `job_type` with `credit`, accepts every push (or refuses every one as
/// "clients_full"), and answers a leader's `HeldQuery` with the asked jobs whose
/// keys are in `hold`.
struct PlayedGateway {
    pushes: Arc<Mutex<Vec<PushJob>>>,
    queries: Arc<Mutex<Vec<HeldQuery>>>,
    hold: Arc<Mutex<BTreeSet<i64>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl PlayedGateway {
    fn start(brokers: &[String], job_type: &str) -> PlayedGateway {
        Self::start_as(brokers, job_type, "played-by-the-test", 100, true)
    }

    fn start_as(
        brokers: &[String],
        job_type: &str,
        id: &str,
        credit: u32,
        accept: bool,
    ) -> PlayedGateway {
        let mut g = PlayedGateway {
            pushes: Arc::default(),
            queries: Arc::default(),
            hold: Arc::default(),
            tasks: Vec::new(),
        };
        g.tasks = brokers
            .iter()
            .map(|addr| {
                let (addr, job_type, id) = (addr.clone(), job_type.to_string(), id.to_string());
                let (pushes, queries, hold) = (g.pushes.clone(), g.queries.clone(), g.hold.clone());
                tokio::spawn(async move {
                    loop {
                        let me = Played {
                            id: &id,
                            credit,
                            accept,
                        };
                        Self::serve(&addr, &job_type, me, &pushes, &queries, &hold).await;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                })
            })
            .collect();
        g
    }

    /// One link to the broker at `addr`, until it breaks.
    async fn serve(
        addr: &str,
        job_type: &str,
        me: Played<'_>,
        pushes: &Mutex<Vec<PushJob>>,
        queries: &Mutex<Vec<HeldQuery>>,
        hold: &Mutex<BTreeSet<i64>>,
    ) {
        use courier_proto::cluster::{
            broker_client::BrokerClient, broker_message, gateway_message, GatewayHello,
            GatewayMessage, HeldAnswer, PushAck, RegisterStream, StreamCredit, StreamProps,
        };
        let Ok(mut client) = BrokerClient::connect(format!("http://{addr}")).await else {
            return;
        };
        let (tx, rx) = futures::channel::mpsc::unbounded();
        let send = |kind| {
            let _ = tx.unbounded_send(GatewayMessage { kind: Some(kind) });
        };
        send(gateway_message::Kind::Hello(GatewayHello {
            gateway_id: me.id.into(),
        }));
        send(gateway_message::Kind::Register(RegisterStream {
            stream_id: 1,
            props: Some(StreamProps {
                r#type: job_type.into(),
                worker: "played".into(),
                timeout: 60_000,
                fetch_variable: vec![],
                tenant_ids: vec![DEFAULT_TENANT.into()],
            }),
        }));
        send(gateway_message::Kind::Credit(StreamCredit {
            stream_id: 1,
            free: me.credit,
            received: 0,
        }));
        let Ok(inbound) = client.link(rx).await else {
            return;
        };
        let mut inbound = inbound.into_inner();
        while let Ok(Some(msg)) = inbound.message().await {
            match msg.kind {
                Some(broker_message::Kind::Push(p)) => {
                    send(gateway_message::Kind::PushAck(PushAck {
                        push_id: p.push_id,
                        accepted: me.accept,
                        reason: if me.accept { "" } else { "clients_full" }.into(),
                    }));
                    pushes.lock().unwrap().push(p);
                }
                Some(broker_message::Kind::HeldQuery(q)) => {
                    let held = {
                        let hold = hold.lock().unwrap();
                        q.jobs
                            .iter()
                            .filter(|j| hold.contains(&j.key))
                            .cloned()
                            .collect()
                    };
                    send(gateway_message::Kind::HeldAnswer(HeldAnswer {
                        query_id: q.query_id,
                        held,
                    }));
                    queries.lock().unwrap().push(q);
                }
                _ => {}
            }
        }
    }

    /// The leases `key` was pushed with, in order.
    fn leases(&self, key: i64) -> Vec<u64> {
        self.pushes
            .lock()
            .unwrap()
            .iter()
            .filter(|p| p.job.as_ref().is_some_and(|j| j.key == key))
            .map(|p| p.lease)
            .collect()
    }
}

/// Who a [`PlayedGateway`] is on its links.
#[derive(Clone, Copy)]
struct Played<'a> {
    id: &'a str,
    credit: u32,
    accept: bool,
}

impl Drop for PlayedGateway {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// A leader may die after committing an activation for a push but before the push
/// leaves it, and a new leader does not carry out the effects of its predecessors'
/// entries. So the new leader asks each gateway which of the earlier pushes it
/// holds, and makes the others runnable again, without waiting for their (here
/// 60 s) activation timeout. Played here by a gateway that says it got one of two
/// pushes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_pushes_again_what_its_predecessor_pushed_to_no_one() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts {
        partitions: 1,
        ..ClusterOpts::default()
    })
    .await;
    let c = cluster.client();
    let addrs: Vec<String> = cluster.broker_addrs.values().cloned().collect();
    let played = PlayedGateway::start(&addrs, "handover");
    wait_registered(&cluster, 3.0).await;
    let kept = c
        .create_job(NewJob::new("handover"))
        .await
        .expect("create")
        .key;
    let lost = c
        .create_job(NewJob::new("handover"))
        .await
        .expect("create")
        .key;
    wait_until(Duration::from_secs(10), "both jobs are pushed", || async {
        played.leases(kept).len() == 1 && played.leases(lost).len() == 1
    })
    .await;
    let (kept_lease, lost_lease) = (played.leases(kept)[0], played.leases(lost)[0]);
    let kept_deadline = c.get_job(kept).await.expect("get").deadline;
    // The gateway holds the first; the second is as good as never sent.
    played.hold.lock().unwrap().insert(kept);
    let victim = cluster.leaders().await[&1];
    cluster.kill_broker(victim);
    wait_until(
        Duration::from_secs(15),
        "the new leader pushes the lost job again",
        || async { played.leases(lost).len() == 2 },
    )
    .await;
    let asked: BTreeSet<(i64, u64)> = played
        .queries
        .lock()
        .unwrap()
        .iter()
        .flat_map(|q| q.jobs.iter().map(|j| (j.key, j.lease)))
        .collect();
    assert_eq!(
        asked,
        BTreeSet::from([(kept, kept_lease), (lost, lost_lease)])
    );
    assert_ne!(played.leases(lost)[1], lost_lease, "a new activation");
    assert_eq!(
        played.leases(kept),
        [kept_lease],
        "the held job stays where it is"
    );
    let job = c.get_job(kept).await.expect("get");
    assert_eq!(job.deadline, kept_deadline, "its activation is untouched");
    assert_eq!(
        cluster
            .broker_metric("courier_broker_reconciled_pushes_total")
            .await,
        2.0
    );
}

/// A push the gateway its activation names refused may have been taken by another
/// gateway of the same logical stream: a new leader asks every gateway, not only
/// the one named, and leaves the job with the one that holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_leaves_a_job_with_the_gateway_that_took_it_after_another_refused() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts {
        partitions: 1,
        ..ClusterOpts::default()
    })
    .await;
    let c = cluster.client();
    let addrs: Vec<String> = cluster.broker_addrs.values().cloned().collect();
    let refusing = PlayedGateway::start_as(&addrs, "second", "refusing", 200, false);
    let taking = PlayedGateway::start_as(&addrs, "second", "taking", 100, true);
    wait_registered(&cluster, 6.0).await;
    // Streams with credit take turns: create jobs until one is tried first at the
    // gateway that refuses, then taken by the other; complete those that went to
    // the other at once.
    let mut tries = 0;
    let key = loop {
        let key = c
            .create_job(NewJob::new("second"))
            .await
            .expect("create")
            .key;
        wait_until(
            Duration::from_secs(10),
            "the second gateway takes the job",
            || async { taking.leases(key).len() == 1 },
        )
        .await;
        if !refusing.leases(key).is_empty() {
            break key;
        }
        c.complete_job(key, "").await.expect("complete");
        tries += 1;
        assert!(tries < 6, "never tried at the refusing gateway first");
    };
    assert_eq!(
        refusing.leases(key),
        taking.leases(key),
        "tried there first"
    );
    taking.hold.lock().unwrap().insert(key);
    let deadline = c.get_job(key).await.expect("get").deadline;
    let victim = cluster.leaders().await[&1];
    cluster.kill_broker(victim);
    wait_until(
        Duration::from_secs(15),
        "the new leader checked the push",
        || async {
            cluster
                .broker_metric("courier_broker_reconciled_pushes_total")
                .await
                >= 1.0
        },
    )
    .await;
    assert_eq!(
        cluster
            .broker_metric("courier_broker_reconciled_pushes_total{outcome=\"held\"}")
            .await,
        1.0,
        "the job stays with the gateway that took it"
    );
    assert!(
        !refusing.queries.lock().unwrap().is_empty(),
        "asked as well"
    );
    assert!(!taking.queries.lock().unwrap().is_empty(), "asked");
    assert_eq!(taking.leases(key).len(), 1, "not pushed again");
    assert_eq!(c.get_job(key).await.expect("get").deadline, deadline);
}

/// A gateway link that falls behind the "jobs available" notices (here one that
/// stops reading, so HTTP/2 flow control holds the broker's side back) is not
/// closed: the broker announces again every type with activatable jobs, so the
/// notices it skipped wake no fewer parked polls, and the link's streams and
/// pushes stay up. Before, the broker closed the link.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_that_falls_behind_the_notices_stays_up_and_hears_every_type_again() {
    use courier_proto::cluster::{
        broker_client::BrokerClient, broker_message, gateway_message, GatewayHello, GatewayMessage,
    };
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::one_broker(1)).await;
    let c = cluster.client();
    let addr = cluster.broker_addrs.values().next().cloned().unwrap();
    // Small windows: a few hundred notices fill them, and the broker stops sending.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .initial_stream_window_size(65_535)
        .initial_connection_window_size(65_535)
        .connect()
        .await
        .expect("connect to the broker");
    let (tx, rx) = futures::channel::mpsc::unbounded();
    tx.unbounded_send(GatewayMessage {
        kind: Some(gateway_message::Kind::Hello(GatewayHello {
            gateway_id: "falls-behind".into(),
        })),
    })
    .unwrap();
    let mut inbound = BrokerClient::new(channel)
        .link(rx)
        .await
        .expect("link")
        .into_inner();
    wait_broker_metric(&cluster, "courier_broker_gateway_links", 2.0).await;

    // A type of its own for every job, so every job is a notice of its own: more of
    // them than the broker's notice buffer (4,096) and the windows hold together.
    let long = "t".repeat(200);
    let types: BTreeSet<String> = (0..6000).map(|i| format!("{long}-{i}")).collect();
    let all: Vec<&String> = types.iter().collect();
    for chunk in all.chunks(500) {
        c.create_jobs(chunk.iter().map(|t| NewJob::new(t.as_str())))
            .await
            .expect("create");
    }

    // Now read: every type is heard of, and the link does not end.
    let mut heard = BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while heard.len() < types.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        let msg = tokio::time::timeout(left, inbound.message())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "heard of {} of {} types within 30 s",
                    heard.len(),
                    types.len()
                )
            })
            .expect("link failed");
        let Some(msg) = msg else {
            panic!(
                "the broker closed the link after {} of {} types",
                heard.len(),
                types.len()
            );
        };
        if let Some(broker_message::Kind::JobsAvailable(j)) = msg.kind {
            heard.insert(j.r#type);
        }
    }
    assert_eq!(heard, types);
    assert!(
        cluster
            .broker_metric("courier_broker_notice_catch_ups_total")
            .await
            >= 1.0,
        "the link never fell behind: the test did not test the catch-up"
    );
    // Still linked, and its notices still come.
    assert_eq!(
        cluster.broker_metric("courier_broker_gateway_links").await,
        2.0
    );
    c.create_job(NewJob::new("after")).await.expect("create");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let msg = tokio::time::timeout(left, inbound.message())
            .await
            .expect("no notice for a job created after the catch-up")
            .expect("link failed")
            .expect("link closed");
        if matches!(msg.kind, Some(broker_message::Kind::JobsAvailable(j)) if j.r#type == "after") {
            break;
        }
    }
}

/// A job whose push was refused because its stream had just gone is yielded back to
/// the log. A stream that registered, with room, while that yield was on its way was
/// back-filled before the job was runnable again, so it got nothing then: once the
/// yield applies, the leader offers the job to it. Before, the job waited for a poll
/// (a Zeebe worker that reconnects at once, and does not poll, waited indefinitely).
/// Played over the link protocol, so the order of events is the test's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_yielded_job_goes_to_a_stream_that_got_room_while_its_yield_was_on_its_way() {
    use courier_proto::cluster::{
        broker_client::BrokerClient, gateway_message, GatewayHello, GatewayMessage, PushAck,
        RegisterStream, StreamCredit, StreamProps, UnregisterStream,
    };
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::one_broker(1)).await;
    let c = cluster.client();
    let addr = cluster.broker_addrs.values().next().cloned().unwrap();
    let (tx, rx) = futures::channel::mpsc::unbounded();
    let send = |kind| {
        tx.unbounded_send(GatewayMessage { kind: Some(kind) })
            .expect("link open");
    };
    let register = |stream_id, worker: &str| {
        gateway_message::Kind::Register(RegisterStream {
            stream_id,
            props: Some(StreamProps {
                r#type: "rejoin".into(),
                worker: worker.into(),
                timeout: 60_000,
                fetch_variable: vec![],
                tenant_ids: vec![DEFAULT_TENANT.into()],
            }),
        })
    };
    let credit = |stream_id| {
        gateway_message::Kind::Credit(StreamCredit {
            stream_id,
            free: 1,
            received: 0,
        })
    };
    send(gateway_message::Kind::Hello(GatewayHello {
        gateway_id: "played-rejoin".into(),
    }));
    send(register(1, "first"));
    send(credit(1));
    let mut inbound = BrokerClient::connect(format!("http://{addr}"))
        .await
        .expect("connect to the broker")
        .link(rx)
        .await
        .expect("link")
        .into_inner();
    wait_registered(&cluster, 1.0).await;
    let key = c
        .create_job(NewJob::new("rejoin"))
        .await
        .expect("create")
        .key;
    let first = next_push(&mut inbound).await;
    assert_eq!((first.stream_id, first.job.as_ref().unwrap().key), (1, key));
    // The client leaves and comes back as a stream of its own (another worker name,
    // so the refused push cannot try it next), all before the refusal arrives.
    send(gateway_message::Kind::Unregister(UnregisterStream {
        stream_id: 1,
    }));
    send(register(2, "second"));
    send(credit(2));
    send(gateway_message::Kind::PushAck(PushAck {
        push_id: first.push_id,
        accepted: false,
        reason: "unknown_stream".into(),
    }));
    let again = next_push(&mut inbound).await;
    assert_eq!((again.stream_id, again.job.as_ref().unwrap().key), (2, key));
    assert_ne!(again.lease, first.lease, "a new activation");
    assert_eq!(
        cluster
            .broker_metric("courier_broker_yields_total{source=\"all_refused\"}")
            .await,
        1.0
    );
}

/// The next push a played gateway's link hears, within 5 s.
async fn next_push(
    inbound: &mut tonic::Streaming<courier_proto::cluster::BrokerMessage>,
) -> PushJob {
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(5), inbound.message())
            .await
            .expect("a push within 5 s")
            .expect("link healthy")
            .expect("link open");
        if let Some(courier_proto::cluster::broker_message::Kind::Push(p)) = msg.kind {
            return p;
        }
    }
}

/// A gateway stopped gracefully (SIGTERM) gives back the jobs its clients had not
/// received (those waiting in its spare room or a client's buffer) before it goes:
/// they are pushed to a worker on another gateway at once, not after the brokers'
/// lost-gateway grace (here off) or their activation timeout (here 120 s). The
/// jobs its client did receive stay with that client, as in Zeebe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_stopped_gracefully_gives_back_the_jobs_no_client_received() {
    let _g = serial().await;
    // A client that reads nothing until the end: 32 credit and 16 spare room.
    let (mut cluster, other, c, mut holding) =
        without_grace_two_gateways("graceful", Duration::from_secs(120)).await;
    let keys = create_in_batches(&c, "graceful", 8, 6).await;
    wait_pushes_accepted(&cluster, 48.0, "every job pushed").await;
    assert!(cluster.terminate_gateway(Duration::from_secs(10)));
    let stopped = Instant::now();
    // What reached the client before its stream ended.
    let mut received = BTreeSet::new();
    while let Ok(Ok(Some(job))) =
        tokio::time::timeout(Duration::from_secs(5), holding.message()).await
    {
        received.insert(job.key);
    }
    let given_back: Vec<i64> = keys
        .iter()
        .copied()
        .filter(|k| !received.contains(k))
        .collect();
    assert!(
        given_back.len() >= 8,
        "the client received {} of the 48 jobs",
        received.len()
    );
    let stream = open_stream(
        &cluster.gateway_addrs[other],
        "graceful",
        Duration::from_secs(120),
    )
    .await;
    let (got, _t) = completing_worker(c.clone(), stream);
    wait_until(
        Duration::from_secs(10),
        "the jobs no client received are completed elsewhere",
        || all_gone(&c, &given_back),
    )
    .await;
    eprintln!(
        "{} jobs given back, completed {:?} after the gateway stopped",
        given_back.len(),
        stopped.elapsed()
    );
    let got: BTreeSet<i64> = got.lock().unwrap().iter().copied().collect();
    assert_eq!(got, given_back.iter().copied().collect::<BTreeSet<_>>());
}

/// The jobs a client of a gateway stopped gracefully did receive stay with that
/// client's worker, which may finish them through another gateway: the brokers
/// leave them to their activation timeouts instead of running them again after
/// their lost-gateway grace, as they do for a gateway that died (the control here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_jobs_a_gateway_that_left_gracefully_handed_out_are_not_run_again() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts {
        lost_gateway_grace: Some("1s"),
        ..ClusterOpts::default()
    })
    .await;
    let (dying, other) = (cluster.add_gateway(), cluster.add_gateway());
    let c = cluster.client_of(other);
    // Both new gateways serve (the client retries until they do).
    cluster.client_of(dying).topology().await.expect("topology");
    c.topology().await.expect("topology");
    let timeout = Duration::from_secs(120);
    let mut leaving = open_stream(&cluster.gateway_addr, "left", timeout).await;
    let mut dead = open_stream(&cluster.gateway_addrs[dying], "died", timeout).await;
    wait_registered(&cluster, 6.0).await;
    let left = create_in_batches(&c, "left", 4, 1).await;
    let died = create_in_batches(&c, "died", 4, 1).await;
    for _ in 0..4 {
        next(&mut leaving).await;
        next(&mut dead).await;
    }
    wait_pushes_accepted(&cluster, 8.0, "every push answered").await;
    assert!(cluster.terminate_gateway(Duration::from_secs(10)));
    cluster.kill_gateway(dying);
    let (got_left, _a) = completing_worker(
        c.clone(),
        open_stream(&cluster.gateway_addrs[other], "left", timeout).await,
    );
    let (got_died, _b) = completing_worker(
        c.clone(),
        open_stream(&cluster.gateway_addrs[other], "died", timeout).await,
    );
    // The dead gateway's jobs run again after the grace (1 s)...
    wait_until(
        Duration::from_secs(20),
        "the dead gateway's jobs are completed elsewhere",
        || all_gone(&c, &died),
    )
    .await;
    assert_eq!(got_died.lock().unwrap().len(), 4);
    // ... whose clock started after the graceful stop's: its jobs would have too.
    assert!(got_left.lock().unwrap().is_empty(), "{:?}", got_left.lock());
    for k in &left {
        let job = c.get_job(*k).await.expect("still there");
        assert_eq!(job.state, courier_client::JobState::Activated as i32);
    }
}

/// Starts a `courier worker` process on gateway `addr` that takes `job_type` jobs
/// (pushed, and long-polled as its fallback) with the default activation timeout
/// (5 minutes) and appends each job's key to `seen` before completing it.
fn cli_worker(addr: &str, job_type: &str, seen: &std::path::Path, out: PathBuf) -> ClientProc {
    let handler = format!(
        "echo \"$COURIER_JOB_KEY\" >> '{}'; echo '{{}}'",
        seen.display()
    );
    ClientProc::spawn(
        std::path::Path::new(courier_bin()),
        &[
            "worker",
            job_type,
            "--address",
            addr,
            "--handler",
            &handler,
            "--json",
        ],
        out,
    )
}

/// Creates jobs through `c` in small paced batches until `stop`, recording the
/// keys of every acknowledged one; a create that fails (its gateway or every
/// leader is gone) is not acknowledged and may or may not exist.
fn producer(c: Client, job_type: &'static str, acked: Arc<Mutex<Vec<i64>>>, stop: Arc<AtomicBool>) {
    tokio::spawn(async move {
        while !stop.load(Ordering::Relaxed) {
            let jobs = (0..5).map(|_| NewJob::new(job_type));
            if let Ok(keys) = c.create_jobs(jobs).await {
                acked.lock().unwrap().extend(keys);
            }
            tokio::time::sleep(Duration::from_millis(40)).await;
        }
    });
}

/// Waits until `n` more jobs than now are acknowledged: load keeps flowing
/// between two failures.
async fn more_acked(acked: &Mutex<Vec<i64>>, n: usize, what: &str) {
    let from = acked.lock().unwrap().len();
    wait_until(Duration::from_secs(30), what, || async {
        acked.lock().unwrap().len() >= from + n
    })
    .await;
}

/// Kills the leader of `partition`, waits for another broker to lead it, and
/// restarts the one killed.
async fn kill_leader_and_restart(cluster: &mut Cluster, partition: u32) {
    let victim = cluster.leader_of(partition).await;
    cluster.kill_broker(victim);
    cluster
        .wait_led_by_another(partition, victim, Duration::from_secs(10))
        .await;
    cluster.start_broker(victim);
}

/// Failures one after another while workers stream and producers create: leaders
/// killed and restarted, the gateway one worker streams through killed and
/// restarted, and two brokers killed at once (every partition loses its majority)
/// and restarted. Every acknowledged job reaches a worker's handler and is
/// completed soon after, though the workers' activation timeout is 5 minutes: new
/// leaders, the gateway's return and the lost-gateway grace bring back every job
/// that was on its way when something died.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_job_is_completed_while_brokers_and_a_gateway_die_one_after_another() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts::default()).await;
    let other = cluster.add_gateway();
    let dir = cluster.dir.path().to_path_buf();
    let seen = dir.join("seen");
    let _w0 = cli_worker(
        &cluster.gateway_addr,
        "soak",
        &seen,
        dir.join("worker-0.out"),
    );
    let _w1 = cli_worker(
        &cluster.gateway_addrs[other],
        "soak",
        &seen,
        dir.join("worker-1.out"),
    );
    // One stream per gateway, registered with every broker.
    wait_registered(&cluster, 6.0).await;
    let acked = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    producer(cluster.client(), "soak", acked.clone(), stop.clone());
    producer(
        cluster.client_of(other),
        "soak",
        acked.clone(),
        stop.clone(),
    );
    more_acked(&acked, 200, "jobs flow").await;

    for partition in [1, 2] {
        kill_leader_and_restart(&mut cluster, partition).await;
        more_acked(&acked, 200, "jobs flow after a leader died").await;
    }
    cluster.kill_gateway(0);
    more_acked(&acked, 200, "jobs flow through the other gateway").await;
    cluster.start_gateway(0);
    cluster.wait_for_leaders(Duration::from_secs(20)).await;
    more_acked(&acked, 200, "jobs flow after the gateway came back").await;
    let a = cluster.leader_of(3).await;
    let b = a % 3 + 1;
    cluster.kill_broker(a);
    cluster.kill_broker(b);
    cluster.start_broker(a);
    cluster.start_broker(b);
    cluster.wait_for_leaders(Duration::from_secs(30)).await;
    more_acked(&acked, 200, "jobs flow after the majority came back").await;
    kill_leader_and_restart(&mut cluster, 3).await;
    more_acked(&acked, 200, "jobs flow after the last failure").await;
    stop.store(true, Ordering::Relaxed);

    let keys = acked.lock().unwrap().clone();
    let c = cluster.client_of(other);
    wait_until(Duration::from_secs(60), "every job is completed", || {
        all_gone(&c, &keys)
    })
    .await;
    // Gone could also mean lost: each one reached a handler.
    let handled: BTreeSet<i64> = std::fs::read_to_string(&seen)
        .unwrap()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    let lost: Vec<i64> = keys
        .iter()
        .filter(|k| !handled.contains(k))
        .copied()
        .collect();
    assert!(
        lost.is_empty(),
        "{} of {} acknowledged jobs never reached a handler, e.g. {:?}",
        lost.len(),
        keys.len(),
        &lost[..lost.len().min(5)]
    );
    eprintln!(
        "{} jobs acknowledged, {} handled ({} handler runs)",
        keys.len(),
        handled.len(),
        std::fs::read_to_string(&seen).unwrap().lines().count()
    );
}
