//! Workers over several gateways: streams that end at their age spread over
//! gateways started later; a gateway killed under load costs no job and little
//! latency; a stream behind a proxy that went silent is reopened elsewhere; a
//! worker under load streams from several gateways within its credit.

use crate::common;

use common::proxy::Proxy;
use common::{serial, wait_until, Cluster, ClusterOpts};
use courier_client::{ActivatedJob, Client, JobOutcome, JobWorker, NewJob};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// When each job was handled: key -> ms since the epoch.
type Handled = Arc<Mutex<HashMap<i64, i64>>>;

fn now_ms() -> i64 {
    courier_proto::domain::epoch_ms()
}

/// A worker of its own client (as a worker process would have) over `addrs`,
/// completing every job and noting when it got it.
fn worker(addrs: &str, job_type: &str, credit: u32, handled: &Handled) -> JobWorker {
    let client = Client::connect(addrs)
        .expect("client")
        .with_retry_budget(Duration::from_secs(20));
    let handled = handled.clone();
    JobWorker::builder(client, job_type, move |job: ActivatedJob| {
        let handled = handled.clone();
        async move {
            handled.lock().unwrap().insert(job.key, now_ms());
            Ok::<_, String>(JobOutcome::complete())
        }
    })
    .max_jobs_active(credit)
    .timeout(Duration::from_secs(5))
    // One stream per worker process, as the scenarios count them.
    .max_streams(1)
    .spawn()
    .expect("worker")
}

/// Creates jobs of `job_type` at about `per_sec` from 8 tasks until `stop`;
/// returns (key, created at ms) of every acknowledged job.
fn produce(
    c: &Client,
    job_type: &'static str,
    per_sec: u32,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<Vec<(i64, i64)>> {
    let c = c.clone();
    tokio::spawn(async move {
        let tasks = 8u32;
        let every = Duration::from_secs(1) * tasks / per_sec;
        let mut running = Vec::new();
        for _ in 0..tasks {
            let (c, stop) = (c.clone(), stop.clone());
            running.push(tokio::spawn(async move {
                let mut made = Vec::new();
                let mut tick = tokio::time::interval(every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                while !stop.is_cancelled() {
                    tick.tick().await;
                    let at = now_ms();
                    let job = c.create_job(NewJob::new(job_type)).await.expect("create");
                    made.push((job.key, at));
                }
                made
            }));
        }
        let mut all = Vec::new();
        for t in running {
            all.extend(t.await.expect("producer"));
        }
        all
    })
}

/// The kill scenario's load in jobs/s: CI's short run keeps it light for a debug
/// build; `benchmarks/gateways.sh` sets `COURIER_KILL_RATE` to the scenario's 2,000.
fn kill_rate() -> u32 {
    std::env::var("COURIER_KILL_RATE")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(1000)
}

/// Jobs each gateway pushed so far.
async fn pushed(cluster: &Cluster) -> Vec<f64> {
    cluster
        .gateway_metric_each("courier_gateway_jobs_pushed_total")
        .await
}

/// Job streams each gateway holds now.
async fn streams(cluster: &Cluster) -> Vec<f64> {
    cluster
        .gateway_metric_each("courier_gateway_stream_clients")
        .await
}

/// Waits until every job in `made` was handled; returns the create-to-handler
/// latencies in ms of those created at or after `since_ms`.
async fn all_handled(made: &[(i64, i64)], handled: &Handled, since_ms: i64) -> Vec<i64> {
    wait_until(Duration::from_secs(40), "every job is handled", || async {
        let h = handled.lock().unwrap();
        made.iter().all(|(k, _)| h.contains_key(k))
    })
    .await;
    let h = handled.lock().unwrap();
    let mut late: Vec<i64> = made
        .iter()
        .filter(|(_, at)| *at >= since_ms)
        .map(|(k, at)| h[k] - at)
        .collect();
    late.sort_unstable();
    late
}

fn percentile(sorted: &[i64], p: f64) -> i64 {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

/// 30 workers start while one of three gateways is up; once the other two are up,
/// streams ending at their (4 s) age reopen on the lighter gateways, and within two
/// ages every gateway pushes between a quarter and 45% of the jobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_streams_spread_over_gateways_started_after_them() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts {
        stream_max_age: Some("4s"),
        ..ClusterOpts::one_broker(2)
    })
    .await;
    cluster.reserve_gateway();
    cluster.reserve_gateway();
    let addrs = cluster.gateway_addrs.join(",");
    let handled = Handled::default();
    let workers: Vec<JobWorker> = (0..30)
        .map(|_| worker(&addrs, "spread", 4, &handled))
        .collect();
    wait_until(
        Duration::from_secs(20),
        "30 streams on the first gateway",
        || async {
            cluster
                .gateway_metric(0, "courier_gateway_stream_clients")
                .await
                == 30.0
        },
    )
    .await;
    let producer = cluster.client_of(0);
    let stop = tokio_util::sync::CancellationToken::new();
    let made = produce(&producer, "spread", 200, stop.clone());

    cluster.start_gateway(1);
    cluster.start_gateway(2);
    let up = Instant::now();
    cluster.wait_gateways_serving().await;
    // Two stream ages after the others came up.
    tokio::time::sleep(Duration::from_secs(8).saturating_sub(up.elapsed())).await;
    let held = streams(&cluster).await;
    let before = pushed(&cluster).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let after = pushed(&cluster).await;
    stop.cancel();
    let made = made.await.expect("producer");
    let shares: Vec<f64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    let total: f64 = shares.iter().sum();
    eprintln!("streams per gateway {held:?}; jobs pushed per gateway {shares:?}");
    assert!(total > 300.0, "jobs flowed: {shares:?}");
    for s in &shares {
        let share = s / total;
        assert!(
            (0.25..=0.45).contains(&share),
            "every gateway pushes 25-45% of the jobs: {shares:?} (streams {held:?})"
        );
    }
    assert_eq!(held.iter().sum::<f64>(), 30.0, "{held:?}");
    for h in &held {
        assert!(*h >= 5.0, "streams spread: {held:?}");
    }
    all_handled(&made, &handled, 0).await;
    for w in workers {
        w.shutdown().await;
    }
}

/// One of three gateways killed under load: its workers' streams reopen on the
/// others, creates go on without a one-second gap, the create-to-handler p99 of the
/// jobs created in the 10 s after the kill stays under a second, and every job is
/// handled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_under_load_loses_no_job_and_pushes_go_on() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts {
        lost_gateway_grace: Some("2s"),
        ..ClusterOpts::one_broker(2)
    })
    .await;
    cluster.add_gateway();
    cluster.add_gateway();
    cluster.wait_gateways_serving().await;
    let addrs = cluster.gateway_addrs.join(",");
    let handled = Handled::default();
    let workers: Vec<JobWorker> = (0..9)
        .map(|_| worker(&addrs, "kill", 32, &handled))
        .collect();
    wait_until(
        Duration::from_secs(20),
        "every worker's stream is open",
        || async { streams(&cluster).await.iter().sum::<f64>() == 9.0 },
    )
    .await;
    // The gateway with the most streams is killed; the producer goes through the
    // others, as producers behind a load balancer would once it saw the gateway go.
    let held = streams(&cluster).await;
    let victim = (0..3).max_by(|&a, &b| held[a].total_cmp(&held[b])).unwrap();
    let rest: Vec<usize> = (0..3).filter(|&i| i != victim).collect();
    let producer = Client::connect(&format!(
        "{},{}",
        cluster.gateway_addrs[rest[0]], cluster.gateway_addrs[rest[1]]
    ))
    .expect("producer")
    .with_retry_budget(Duration::from_secs(20));
    let stop = tokio_util::sync::CancellationToken::new();
    let rate = kill_rate();
    let made = produce(&producer, "kill", rate, stop.clone());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let pushed_before = cluster
        .gateway_metric(victim, "courier_gateway_jobs_pushed_total")
        .await;
    cluster.kill_gateway(victim);
    let killed_at = now_ms();
    tokio::time::sleep(Duration::from_secs(10)).await;
    stop.cancel();
    let made = made.await.expect("producer");
    let after = all_handled(&made, &handled, killed_at).await;
    let (p50, p99) = (percentile(&after, 0.5), percentile(&after, 0.99));
    assert!(
        pushed_before > 0.0,
        "the gateway killed was pushing: {held:?}"
    );
    eprintln!(
        "at {rate} jobs/s asked, streams before the kill {held:?}; {} jobs in all, {} created after the kill: p50 {p50} ms, p99 {p99} ms, max {} ms",
        made.len(),
        after.len(),
        after.last().copied().unwrap_or_default()
    );
    // The producer is closed-loop (a task's next create waits for its last), so how
    // many jobs it made says how fast this machine is; a stall says the kill stopped
    // creates. No second of the window may pass without a create.
    let mut created: Vec<i64> = made
        .iter()
        .map(|(_, at)| *at)
        .filter(|at| *at >= killed_at)
        .collect();
    created.sort_unstable();
    let stall = created
        .windows(2)
        .map(|w| w[1] - w[0])
        .chain(created.first().map(|first| first - killed_at))
        .max()
        .unwrap_or(i64::MAX);
    assert!(
        created.len() > 100 && stall < 1000,
        "jobs flowed after the kill: {} created, longest time without a create {stall} ms",
        created.len()
    );
    assert!(p99 < 1000, "p99 after the kill {p99} ms");
    wait_until(
        Duration::from_secs(20),
        "every stream is open on the gateways left",
        || async {
            let now = streams(&cluster).await;
            rest.iter().map(|&i| now[i]).sum::<f64>() == 9.0
        },
    )
    .await;
    for w in workers {
        w.shutdown().await;
    }
}

/// A worker's stream goes through a proxy that stops forwarding without closing
/// anything: the heartbeats stop, and within 10 s the worker has reopened its
/// stream on the other gateway and is pushed jobs there, and the gateway behind
/// the proxy, no longer told the stream is read, has ended it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_behind_a_silent_proxy_is_reopened_elsewhere_within_10_s() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts::one_broker(2)).await;
    cluster.add_gateway();
    let proxies = [
        Proxy::start(cluster.gateway_addrs[0].clone()).await,
        Proxy::start(cluster.gateway_addrs[1].clone()).await,
    ];
    let handled = Handled::default();
    let w = worker(
        &format!("{},{}", proxies[0].addr, proxies[1].addr),
        "silent",
        8,
        &handled,
    );
    wait_until(Duration::from_secs(20), "the stream is open", || async {
        streams(&cluster).await.iter().sum::<f64>() == 1.0
    })
    .await;
    let on = streams(&cluster)
        .await
        .iter()
        .position(|n| *n == 1.0)
        .expect("one gateway holds the stream");
    let other = 1 - on;
    let opens = w.metrics().snapshot().stream_opens;
    proxies[on].freeze();
    let frozen = Instant::now();
    // Jobs created straight at the other gateway, one every 100 ms.
    let producer = cluster.client_of(other);
    let stop = tokio_util::sync::CancellationToken::new();
    let made = produce(&producer, "silent", 10, stop.clone());
    wait_until(
        Duration::from_secs(10),
        "the stream is reopened on the other gateway",
        || async {
            w.metrics().snapshot().stream_opens > opens
                && cluster
                    .gateway_metric(other, "courier_gateway_stream_clients")
                    .await
                    == 1.0
        },
    )
    .await;
    let reopened = frozen.elapsed();
    let pushed_before = cluster
        .gateway_metric(other, "courier_gateway_jobs_pushed_total")
        .await;
    wait_until(
        Duration::from_secs(5),
        "jobs are pushed on the new stream",
        || async {
            cluster
                .gateway_metric(other, "courier_gateway_jobs_pushed_total")
                .await
                > pushed_before
        },
    )
    .await;
    // The gateway behind the silent proxy has heard nothing from the worker since
    // either: it ends the stream, so no more jobs are pushed into it.
    wait_until(
        Duration::from_secs(10).saturating_sub(frozen.elapsed()),
        "the gateway behind the silent proxy ends the stream",
        || async {
            cluster
                .gateway_metric(
                    on,
                    "courier_gateway_streams_ended_total{reason=\"stalled\"}",
                )
                .await
                == 1.0
                && cluster
                    .gateway_metric(on, "courier_gateway_stream_clients")
                    .await
                    == 0.0
        },
    )
    .await;
    let ended = frozen.elapsed();
    stop.cancel();
    let made = made.await.expect("producer");
    eprintln!(
        "reopened {reopened:?} after the proxy went silent; the gateway behind it ended the stream after {ended:?}"
    );
    assert!(reopened < Duration::from_secs(10));
    all_handled(&made, &handled, 0).await;
    w.shutdown().await;
}

/// One worker over two gateways whose credit stays fully used opens a second
/// stream on the other gateway, splits its credit between them (never stating more
/// than its own), is pushed jobs through both, and closes the second once idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_worker_streams_from_a_second_gateway_within_its_credit_and_closes_it_when_idle() {
    let _g = serial().await;
    let mut cluster = Cluster::start(ClusterOpts::one_broker(2)).await;
    cluster.add_gateway();
    cluster.wait_gateways_serving().await;
    let client = Client::connect(&cluster.gateway_addrs.join(","))
        .expect("client")
        .with_retry_budget(Duration::from_secs(20));
    let handled = Handled::default();
    let h = handled.clone();
    let credit = 16;
    let w = JobWorker::builder(client, "lanes", move |job: ActivatedJob| {
        let h = h.clone();
        async move {
            // Slow enough that the credit is all in use under the load below.
            tokio::time::sleep(Duration::from_millis(20)).await;
            h.lock().unwrap().insert(job.key, now_ms());
            Ok::<_, String>(JobOutcome::complete())
        }
    })
    .max_jobs_active(credit)
    .stream_prune_after(Duration::from_secs(3))
    .spawn()
    .expect("worker");
    wait_until(
        Duration::from_secs(20),
        "the first stream is open",
        || async { streams(&cluster).await.iter().sum::<f64>() == 1.0 },
    )
    .await;
    // From the load's start, no gateway counts more free credit for the worker's
    // stream than the worker's whole credit (a stream stating none would get the
    // gateway's default of 32). Credit in use may run above it for a moment: a
    // reopened stream declares the jobs waiting for room too.
    let watched = tokio_util::sync::CancellationToken::new();
    let most_free = tokio::spawn({
        let (addrs, watched) = (cluster.gateway_metrics.clone(), watched.clone());
        async move {
            let mut most = 0.0f64;
            while !watched.is_cancelled() {
                for addr in &addrs {
                    let free =
                        common::metric(addr, "courier_gateway_credit_free{type=\"lanes\"}").await;
                    most = most.max(free);
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            most
        }
    });
    let producer = cluster.client_of(0);
    // A backlog of several seconds of the worker's work, so its credit stays fully
    // used however fast the producer below goes on this machine.
    let mut backlog = Vec::new();
    for _ in 0..6 {
        let at = now_ms();
        let keys = producer
            .create_jobs((0..1000).map(|_| NewJob::new("lanes")))
            .await
            .expect("backlog");
        backlog.extend(keys.into_iter().map(|k| (k, at)));
    }
    let stop = tokio_util::sync::CancellationToken::new();
    let made = produce(&producer, "lanes", 1200, stop.clone());
    // Growing takes two busy looks a second apart after a settling time; the margin
    // is for a loaded machine. A failure says where the streams were, and what the
    // worker saw.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
    loop {
        let now = streams(&cluster).await;
        if now == [1.0, 1.0] {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no stream on each gateway within 40 s: streams per gateway {now:?}; worker {:?}",
            w.metrics().snapshot()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let before = pushed(&cluster).await;
    let mut seen = Vec::new();
    for _ in 0..40 {
        let stated = w.metrics().snapshot().stream_credit;
        assert!(
            stated <= u64::from(credit),
            "the streams state {stated} credit in all, more than the worker's {credit}"
        );
        seen.push(stated);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_until(
        Duration::from_secs(15),
        "both gateways push to the worker",
        || async {
            let now = pushed(&cluster).await;
            now.iter().zip(&before).all(|(a, b)| a > b)
        },
    )
    .await;
    watched.cancel();
    let most = most_free.await.expect("credit watcher");
    assert!(
        most <= f64::from(credit),
        "a gateway counted {most} free credit for the worker's stream"
    );
    stop.cancel();
    let mut made = made.await.expect("producer");
    made.extend(backlog);
    all_handled(&made, &handled, 0).await;
    wait_until(
        Duration::from_secs(20),
        "back to one stream once idle, with the whole credit",
        || async {
            let m = w.metrics().snapshot();
            streams(&cluster).await.iter().sum::<f64>() == 1.0
                && m.streams_open == 1
                && m.stream_credit == u64::from(credit)
        },
    )
    .await;
    eprintln!(
        "credit stated while both streams were open: {seen:?}; {:?}",
        w.metrics().snapshot()
    );
    w.shutdown().await;
}

/// A worker reopens its stream at its own age where the gateway never ends it,
/// asking the gateway to end the old one so no job is left on the wire: under a
/// steady load every job is handled, none after its activation timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_reopens_its_stream_at_its_own_age_losing_no_job() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts {
        stream_max_age: Some("off"),
        ..ClusterOpts::one_broker(2)
    })
    .await;
    let client = Client::connect(&cluster.gateway_addrs[0])
        .expect("client")
        .with_retry_budget(Duration::from_secs(20));
    let handled = Handled::default();
    let h = handled.clone();
    let w = JobWorker::builder(client, "own-age", move |job: ActivatedJob| {
        let h = h.clone();
        async move {
            h.lock().unwrap().insert(job.key, now_ms());
            Ok::<_, String>(JobOutcome::complete())
        }
    })
    // Far longer than the test: a job left on the wire would never be handled.
    .timeout(Duration::from_secs(600))
    .stream_max_age(Some(Duration::from_secs(2)))
    .spawn()
    .expect("worker");
    wait_until(Duration::from_secs(20), "the stream is open", || async {
        w.metrics().snapshot().streams_open == 1
    })
    .await;
    let producer = cluster.client_of(0);
    let stop = tokio_util::sync::CancellationToken::new();
    let made = produce(&producer, "own-age", 200, stop.clone());
    wait_until(
        Duration::from_secs(20),
        "the worker reopened its stream three times",
        || async { w.metrics().snapshot().stream_opens >= 4 },
    )
    .await;
    stop.cancel();
    let made = made.await.expect("producer");
    all_handled(&made, &handled, 0).await;
    let asked = cluster
        .gateway_metric(0, "courier_gateway_streams_ended_total{reason=\"asked\"}")
        .await;
    assert!(asked >= 3.0, "the gateway ended them as asked: {asked}");
    assert_eq!(w.metrics().snapshot().stream_failures, 0);
    w.shutdown().await;
}
