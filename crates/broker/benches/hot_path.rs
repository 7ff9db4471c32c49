//! Micro-benchmarks of the broker's hot path, so a regression shows without a
//! cluster: the engine applying an entry, the stream registry's lookup, and the
//! log append (encode and write; and with the fdatasync that makes it durable).
//!
//! `cargo bench -p courier-broker --bench hot_path`

// A benchmark, like a test, stops at the first thing that goes wrong.
#![allow(clippy::expect_used)]

use courier_broker::engine::{Batch, LogCommand, PushTarget, Recipient, State};
use courier_broker::raft::TypeConfig;
use courier_broker::registry::JobStreamRegistry;
use courier_broker::store::log::LogStore;
use courier_broker::store::{Db, Durability};
use courier_proto::domain::{
    ActivationProps, Command, JobKey, LinkId, NewJob, PartitionId, ProcessContext, Reply, StreamId,
    DEFAULT_TENANT,
};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use openraft::{Entry, EntryPayload, LogId};
use std::hint::black_box;

/// Jobs per log entry in these benchmarks: a busy partition's group commit.
const BATCH: usize = 64;

fn props() -> ActivationProps {
    ActivationProps {
        job_type: "payment".into(),
        worker: "bench".into(),
        timeout_ms: 30_000,
        fetch_variables: Vec::new(),
        tenant_ids: vec![DEFAULT_TENANT.into()],
    }
}

fn new_job() -> NewJob {
    NewJob {
        job_type: "payment".into(),
        variables: format!("{{\"orderId\":\"{}\",\"amount\":42.5}}", "x".repeat(64)),
        custom_headers: "{}".into(),
        retries: 3,
        tenant_id: DEFAULT_TENANT.into(),
        process: ProcessContext::default(),
    }
}

/// One entry creating `BATCH` jobs, each pushed (activated inline) to one stream.
fn create_batch(ts: i64) -> Batch {
    Batch {
        ts,
        on_flushed: Default::default(),
        commands: vec![LogCommand::Client {
            cmd: Command::Create((0..BATCH).map(|_| new_job()).collect()),
            push: vec![PushTarget {
                props: props(),
                recipient: Recipient {
                    link: LinkId(1),
                    stream_id: StreamId(1),
                },
                max: BATCH as u32,
                gateway: "gateway-1".into(),
            }],
            via: None,
        }],
    }
}

fn complete_batch(ts: i64, keys: &[JobKey]) -> Batch {
    Batch {
        ts,
        on_flushed: Default::default(),
        commands: keys
            .iter()
            .map(|&key| {
                LogCommand::client(Command::Complete {
                    key,
                    variables: None,
                })
            })
            .collect(),
    }
}

/// A partition holding `n` activatable jobs of another type, so indexes are not empty.
fn loaded_state(n: usize) -> State {
    let mut state = State::new(PartitionId(1));
    let mut changes = Default::default();
    let mut other = new_job();
    other.job_type = "backlog".into();
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let batch = Batch {
            ts: 1,
            on_flushed: Default::default(),
            commands: vec![LogCommand::client(Command::Create(
                chunk.iter().map(|_| other.clone()).collect(),
            ))],
        };
        state.apply_batch(1, &batch, &mut changes);
    }
    state
}

fn engine(c: &mut Criterion) {
    let mut g = c.benchmark_group("engine");
    g.throughput(Throughput::Elements(BATCH as u64));
    // Create (activated inline for a stream) then complete: the push path's two
    // entries, leaving the state as it was.
    g.bench_function("create_pushed_then_complete_64", |b| {
        let mut state = loaded_state(10_000);
        let mut ts = 1_000;
        b.iter(|| {
            ts += 1;
            let mut changes = Default::default();
            let created = state.apply_batch(1, &create_batch(ts), &mut changes);
            let keys = match created.replies.first() {
                Some(Ok(Reply::Created(keys))) => keys.clone(),
                other => panic!("unexpected reply {other:?}"),
            };
            let done = state.apply_batch(1, &complete_batch(ts, &keys), &mut changes);
            black_box((created.effects.len(), done.effects.len(), changes.len()))
        });
    });
    // Back-fill: activate 64 of a 10,000-job backlog for a stream.
    g.bench_function("backfill_64_of_10k", |b| {
        let base = loaded_state(10_000);
        let mut p = props();
        p.job_type = "backlog".into();
        let batch = Batch {
            ts: 2,
            on_flushed: Default::default(),
            commands: vec![LogCommand::Backfill {
                target: PushTarget {
                    props: p,
                    recipient: Recipient {
                        link: LinkId(1),
                        stream_id: StreamId(1),
                    },
                    max: BATCH as u32,
                    gateway: "gateway-1".into(),
                },
            }],
        };
        b.iter_batched_ref(
            || base.clone(),
            |state| {
                let mut changes = Default::default();
                black_box(state.apply_batch(1, &batch, &mut changes).effects.len())
            },
            BatchSize::LargeInput,
        );
    });
    g.finish();
}

fn registry(c: &mut Criterion) {
    let r = JobStreamRegistry::default();
    // 20 job types with 3 gateways each; the one looked up has credit on all three.
    for t in 0..20 {
        let mut p = props();
        p.job_type = format!("type-{t}");
        for link in 1..=3u64 {
            r.register(LinkId(link), StreamId(t), p.clone());
            r.report_credit(LinkId(link), StreamId(t), 1_000_000, 0);
        }
    }
    let mut g = c.benchmark_group("registry");
    g.bench_function("lookup_and_refund", |b| {
        b.iter(|| {
            let target = r
                .lookup(black_box("type-7"), DEFAULT_TENANT, 1)
                .expect("a stream with credit");
            r.refund(&target.recipient, u64::from(target.max));
            black_box(target.max)
        });
    });
    g.bench_function("lookup_miss", |b| {
        b.iter(|| black_box(r.lookup(black_box("no-such-type"), DEFAULT_TENANT, 1)));
    });
    g.finish();
}

fn entry(index: u64) -> Entry<TypeConfig> {
    Entry {
        log_id: LogId::new(openraft::CommittedLeaderId::new(1, 1), index),
        payload: EntryPayload::Normal(create_batch(index as i64)),
    }
}

fn log_append(c: &mut Criterion) {
    let mut g = c.benchmark_group("log_append");
    g.throughput(Throughput::Elements(BATCH as u64));
    for (name, durable) in [
        ("entry_of_64_creates", false),
        ("entry_of_64_creates_fdatasync", true),
    ] {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = Db::open(dir.path(), Durability::Fsync).expect("fjall");
        let log = LogStore::open(&db, 1, 1).expect("log");
        let mut index = 0u64;
        g.bench_function(name, |b| {
            b.iter(|| {
                index += 1;
                log.write([entry(index)]).expect("write");
                if durable {
                    db.sync().expect("fdatasync");
                }
            });
        });
    }
    g.finish();
}

criterion_group!(benches, engine, registry, log_append);
criterion_main!(benches);
