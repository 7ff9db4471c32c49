//! The peer: NATS JetStream, measured like `e2e` so the rows are comparable.
//!
//! A stream (replicas 3, file storage, created fresh per run under a unique name and
//! deleted at the end) and a durable push consumer with explicit ack, `max_ack_pending`
//! = `--credit` (Courier's worker credit) and a deliver group shared by the workers.
//! Creating a job = a JetStream publish that waits for the PubAck (the stream leader
//! answers once a majority has the message: JetStream's acknowledged create). Each
//! message's body is `{"t":<µs>,"p":"x..."}`, the same bytes as Courier's job
//! variables; the handler records `now - t` then acks (Courier's complete).
//! `--publish-only`: publish-acknowledged latency one at a time, the analogue of
//! Courier's `create --concurrency 1` (one Raft commit).

use crate::drive::{self, created_us, now_us, Seen, Window};
use crate::{histogram, payload, Outcome};
use anyhow::{anyhow, Context as _};
use async_nats::jetstream::{
    self,
    consumer::{push, AckPolicy, DeliverPolicy},
    stream::{self, RetentionPolicy, StorageType},
};
use futures::StreamExt;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Which server the benchmark's clients (publisher and workers) connect to.
#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Connect {
    /// The stream's Raft leader: no forwarding hop, JetStream's best case, and the
    /// same placement from run to run.
    Leader,
    /// The first of --servers, wherever the leader is.
    First,
}

/// Where the consumer's Raft leader (the server that pushes) sits.
#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Placement {
    /// Moved (by leader step-downs) onto the stream leader's server: messages are
    /// pushed as soon as the stream leader commits them, with no follower's lag,
    /// JetStream's best case and the same from run to run.
    Colocated,
    /// Wherever the meta leader put it (random).
    AsPlaced,
}

/// What happens to an acked message.
#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Retention {
    /// Deleted once acked, as Courier deletes a completed job.
    WorkQueue,
    /// Kept (JetStream's default retention).
    Limits,
}

#[derive(clap::Args)]
pub struct JetStreamArgs {
    /// Server URLs, comma-separated, as `benchmarks/jetstream.sh start` prints them.
    #[arg(long)]
    pub servers: String,
    #[arg(long, default_value = "JetStream R3, file")]
    pub label: String,
    /// Workers, each with its own connection, sharing the consumer (deliver group).
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// Jobs per second, open loop; without it, one job at a time (unloaded).
    #[arg(long)]
    pub rate: Option<u64>,
    #[arg(long, default_value_t = 10)]
    pub duration: u64,
    #[arg(long, default_value_t = 2)]
    pub warmup: u64,
    #[arg(long, default_value_t = 100)]
    pub payload: usize,
    /// The consumer's max_ack_pending (Courier's worker credit is 32).
    #[arg(long, default_value_t = 32)]
    pub credit: i64,
    /// Only publish, one at a time, waiting for each PubAck (one replicated write).
    #[arg(long)]
    pub publish_only: bool,
    #[arg(long, value_enum, default_value = "leader")]
    pub connect: Connect,
    #[arg(long, value_enum, default_value = "colocated")]
    pub placement: Placement,
    #[arg(long, value_enum, default_value = "work-queue")]
    pub retention: Retention,
    #[arg(long, default_value_t = 3)]
    pub replicas: usize,
}

/// A message created at `created` (µs since the epoch), which it carries.
fn body(pad: &str, created: u64) -> String {
    format!("{{\"t\":{created},\"p\":\"{pad}\"}}")
}

async fn connect(url: &str) -> anyhow::Result<async_nats::Client> {
    async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .connect(url)
        .await
        .with_context(|| format!("connecting to {url}"))
}

/// Publishes and waits for the PubAck.
async fn publish(
    js: &jetstream::Context,
    subject: &str,
    pad: &str,
    created: u64,
) -> anyhow::Result<()> {
    js.publish(subject.to_string(), body(pad, created).into())
        .await?
        .await?;
    Ok(())
}

async fn worker(
    url: String,
    stream: String,
    durable: String,
    seen: Seen,
    ready: mpsc::Sender<()>,
) -> anyhow::Result<()> {
    let js = jetstream::new(connect(&url).await?);
    let consumer: jetstream::consumer::PushConsumer = js
        .get_stream(&stream)
        .await?
        .get_consumer(&durable)
        .await
        .map_err(|e| anyhow!("getting consumer {durable}: {e}"))?;
    let mut messages = consumer.messages().await?;
    // The queue subscription is sent; a round trip makes sure the server has it.
    js.client().flush().await?;
    let _ = ready.send(()).await;
    while let Some(m) = messages.next().await {
        let m = m.map_err(|e| anyhow!("{e}"))?;
        if let Some(t) = created_us(&m.payload) {
            let _ = seen.send((t, now_us().saturating_sub(t)));
        }
        m.ack().await.map_err(|e| anyhow!("{e}"))?;
    }
    Ok(())
}

pub async fn run(a: JetStreamArgs) -> anyhow::Result<()> {
    let urls: Vec<String> = a
        .servers
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect();
    let first = urls.first().context("--servers is empty")?.clone();
    let admin = jetstream::new(connect(&first).await?);
    let id = now_us();
    let name = format!("COURIER_BENCH_{id}");
    let subject = format!("courier.bench.{id}");
    let config = stream::Config {
        name: name.clone(),
        subjects: vec![subject.clone()],
        num_replicas: a.replicas,
        storage: StorageType::File,
        retention: match a.retention {
            Retention::WorkQueue => RetentionPolicy::WorkQueue,
            Retention::Limits => RetentionPolicy::Limits,
        },
        ..Default::default()
    };
    // Right after start-up the meta leader may not know all peers yet: retry briefly.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut s = loop {
        match admin.create_stream(config.clone()).await {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline => {
                eprintln!("jetstream: creating stream {name}: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(anyhow!("creating stream {name}: {e}")),
        }
    };
    let result = measure(&a, &urls, &mut s, &name, &subject).await;
    if let Err(e) = admin.delete_stream(&name).await {
        eprintln!("jetstream: deleting stream {name}: {e}");
    }
    result
}

/// Steps the consumer's leader down until the election puts it on the stream leader's
/// server (each new election picks one of the other replicas).
async fn colocate(
    js: &jetstream::Context,
    s: &stream::Stream,
    name: &str,
    durable: &str,
    leader: Option<&str>,
    mut current: Option<String>,
) -> anyhow::Result<Option<String>> {
    let leader_of =
        |i: &jetstream::consumer::Info| i.cluster.as_ref().and_then(|c| c.leader.clone());
    for _ in 0..20 {
        if current.is_some() && current.as_deref() == leader {
            return Ok(current);
        }
        if current.is_some() {
            let r: serde_json::Value = js
                .request(
                    format!("CONSUMER.LEADER.STEPDOWN.{name}.{durable}"),
                    &serde_json::json!({}),
                )
                .await
                .map_err(|e| anyhow!("consumer leader step-down: {e}"))?;
            if let Some(e) = r.get("error") {
                eprintln!("jetstream: consumer leader step-down: {e}");
            }
        }
        // Until a new leader is elected (not the one that stepped down).
        let before = current.take();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if let Ok(i) = s.consumer_info(durable).await {
                let l = leader_of(&i);
                if l.is_some() && l != before {
                    current = l;
                    break;
                }
            }
        }
    }
    eprintln!(
        "jetstream: consumer leader {} not moved to the stream leader {}",
        current.as_deref().unwrap_or("?"),
        leader.unwrap_or("?")
    );
    Ok(current)
}

/// The server a client should connect to, by --connect.
async fn target(
    a: &JetStreamArgs,
    urls: &[String],
    leader: Option<&str>,
) -> anyhow::Result<String> {
    if a.connect == Connect::Leader {
        if let Some(leader) = leader {
            for u in urls {
                let c = connect(u).await?;
                let is_leader = c.server_info().server_name == leader;
                drop(c);
                if is_leader {
                    return Ok(u.clone());
                }
            }
            eprintln!("jetstream: stream leader {leader} is none of --servers; using the first");
        }
    }
    Ok(urls[0].clone())
}

async fn measure(
    a: &JetStreamArgs,
    urls: &[String],
    s: &mut stream::Stream,
    name: &str,
    subject: &str,
) -> anyhow::Result<()> {
    let leader = s
        .info()
        .await
        .map_err(|e| anyhow!("stream info: {e}"))?
        .cluster
        .as_ref()
        .and_then(|c| c.leader.clone());
    let url = target(a, urls, leader.as_deref()).await?;
    let js = jetstream::new(connect(&url).await?);
    let pad = payload(a.payload);
    let pad = pad
        .trim_start_matches("{\"p\":\"")
        .trim_end_matches("\"}")
        .to_string();
    let measure_from = Instant::now() + Duration::from_secs(a.warmup);
    let until = measure_from + Duration::from_secs(a.duration);

    if a.publish_only {
        eprintln!(
            "jetstream: stream {name} leader {}, clients on {url}",
            leader.as_deref().unwrap_or("?")
        );
        let mut h = histogram()?;
        let mut errors = 0u64;
        while Instant::now() < until {
            let t0 = Instant::now();
            let r = publish(&js, subject, &pad, now_us()).await;
            if t0 < measure_from {
                continue;
            }
            match r {
                Ok(()) => h.saturating_record(t0.elapsed().as_micros() as u64),
                Err(_) => errors += 1,
            }
        }
        crate::report(
            &a.label,
            "publish acknowledged (one commit), 1 at a time",
            &Outcome {
                latency: h,
                errors,
                elapsed: Duration::from_secs(a.duration),
            },
        );
        return Ok(());
    }

    let durable = "workers".to_string();
    let consumer: jetstream::consumer::PushConsumer = s
        .create_consumer(push::Config {
            durable_name: Some(durable.clone()),
            deliver_subject: format!("courier.deliver.{name}"),
            deliver_group: Some(durable.clone()),
            deliver_policy: DeliverPolicy::All,
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            max_ack_pending: a.credit,
            ..Default::default()
        })
        .await
        .map_err(|e| anyhow!("creating consumer: {e}"))?;
    let mut consumer_leader = consumer
        .cached_info()
        .cluster
        .as_ref()
        .and_then(|c| c.leader.clone());
    if a.placement == Placement::Colocated && leader.is_some() {
        consumer_leader =
            colocate(&js, s, name, &durable, leader.as_deref(), consumer_leader).await?;
    }
    eprintln!(
        "jetstream: stream {name} leader {}, consumer leader {}, clients on {url}",
        leader.as_deref().unwrap_or("?"),
        consumer_leader.as_deref().unwrap_or("?")
    );

    let (tx, mut rx) = mpsc::unbounded_channel();
    let (ready_tx, mut ready_rx) = mpsc::channel(a.workers.max(1));
    let mut workers = Vec::new();
    for _ in 0..a.workers.max(1) {
        let w = worker(
            url.clone(),
            name.to_string(),
            durable.clone(),
            tx.clone(),
            ready_tx.clone(),
        );
        workers.push(tokio::spawn(async move {
            if let Err(e) = w.await {
                eprintln!("jetstream: worker: {e:#}");
            }
        }));
    }
    drop((tx, ready_tx));
    for _ in 0..a.workers.max(1) {
        ready_rx
            .recv()
            .await
            .context("a worker failed to subscribe")?;
    }
    // As `e2e`, let the subscriptions settle (interest propagates to the consumer leader).
    tokio::time::sleep(Duration::from_millis(500)).await;

    let w = Window::new(a.warmup, a.duration);
    let mut h = histogram()?;
    let mut errors = 0u64;
    let load = match a.rate {
        None => {
            errors += drive::unloaded(&w, &mut rx, &mut h, |created| {
                publish(&js, subject, &pad, created)
            })
            .await;
            "push unloaded, 1 job at a time".to_string()
        }
        Some(rate) => {
            errors += drive::open_loop(&w, rate, &mut rx, &mut h, |created| {
                let (js, s, p) = (js.clone(), subject.to_string(), pad.clone());
                async move {
                    publish(&js, &s, &p, created)
                        .await
                        .map_err(|e| format!("{e:#}"))
                }
            })
            .await;
            format!("push {rate} jobs/s, {} workers", a.workers)
        }
    };
    for worker in workers {
        worker.abort();
    }
    crate::report(
        &a.label,
        &load,
        &Outcome {
            latency: h,
            errors,
            elapsed: Duration::from_secs(a.duration),
        },
    );
    Ok(())
}
