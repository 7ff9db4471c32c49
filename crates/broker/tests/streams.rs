//! The long-lived streams a broker serves, over real gRPC on loopback: Raft for its
//! peers, commands for gateways. Each request gets its own reply by id, a request
//! that cannot be served gets an error reply rather than silence, and streams held
//! open by the other side do not keep the broker from shutting down.

// Test code: a failed expectation is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use courier_broker::{BrokerConfig, Durability, RaftTuning};
use courier_proto::cluster::{
    broker_client::BrokerClient, raft_client::RaftClient, ExecuteRequest, RaftCall, RaftFrame,
};
use courier_proto::codec;
use openraft::error::{Infallible, RaftError};
use openraft::raft::{VoteRequest, VoteResponse};
use openraft::Vote;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

fn frame(id: u64, partition_id: u32, call: i32, payload: &[u8]) -> RaftFrame {
    RaftFrame {
        id,
        partition_id,
        call,
        payload: payload.to_vec().into(),
        error: String::new(),
    }
}

/// The next message of `stream`, within 10 s; the stream stays open.
async fn next<T>(stream: &mut tonic::Streaming<T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .expect("a message within 10 s")
        .unwrap()
        .expect("the stream stays open")
}

/// Opens the command stream a gateway holds to the broker at `addr`: what to send
/// on it, and its answers.
async fn command_stream(
    addr: std::net::SocketAddr,
) -> (
    mpsc::Sender<ExecuteRequest>,
    tonic::Streaming<courier_proto::cluster::ExecuteReply>,
) {
    let mut commands = BrokerClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let (tx, rx) = mpsc::channel(16);
    let answers = commands
        .execute(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    (tx, answers)
}

/// A one-broker cluster on loopback: its data folder (kept while it lives), its
/// address, what stops it, and its task.
async fn start_broker() -> (
    tempfile::TempDir,
    std::net::SocketAddr,
    CancellationToken,
    tokio::task::JoinHandle<Result<(), courier_broker::Error>>,
) {
    let dir = tempfile::tempdir().unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = BrokerConfig {
        node_id: 1,
        brokers: [(1, addr.to_string())].into_iter().collect(),
        partitions: 1,
        replication_factor: 1,
        data_dir: dir.path().to_path_buf(),
        durability: Durability::Fsync,
        raft: RaftTuning::default(),
        lost_gateway_grace: Some(courier_broker::config::DEFAULT_LOST_GATEWAY_GRACE),
        hand_off_leadership: true,
        rebalance_after: None,
        cluster_tls: None,
        memory: courier_broker::config::Memory::default(),
    };
    let shutdown = CancellationToken::new();
    let broker = tokio::spawn(courier_broker::run(config, listener, shutdown.clone()));
    (dir, addr, shutdown, broker)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_answer_every_request_and_end_on_shutdown() {
    let (_dir, addr, shutdown, broker) = start_broker().await;

    let mut client = RaftClient::connect(format!("http://{addr}")).await.unwrap();
    let (tx, rx) = mpsc::channel(16);
    let mut replies = client
        .stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();

    let vote = VoteRequest::<u64> {
        vote: Vote::new(0, 2),
        last_log_id: None,
    };
    tx.send(frame(1, 99, RaftCall::AppendEntries as i32, b"x"))
        .await
        .unwrap();
    tx.send(frame(2, 1, RaftCall::AppendEntries as i32, &[0xff; 3]))
        .await
        .unwrap();
    tx.send(frame(3, 1, 7, b"")).await.unwrap();
    tx.send(frame(
        4,
        1,
        RaftCall::Vote as i32,
        &codec::to_vec(&vote).unwrap(),
    ))
    .await
    .unwrap();

    let mut got = std::collections::BTreeMap::new();
    while got.len() < 4 {
        let reply = next(&mut replies).await;
        got.insert(reply.id, reply);
    }
    assert!(
        got[&1].error.contains("partition 99"),
        "{:?}",
        got[&1].error
    );
    assert!(
        got[&2].error.contains("malformed append-entries"),
        "{:?}",
        got[&2].error
    );
    assert!(
        got[&3].error.contains("unknown raft call 7"),
        "{:?}",
        got[&3].error
    );
    assert_eq!(got[&4].error, "");
    let answer: Result<VoteResponse<u64>, RaftError<u64, Infallible>> =
        codec::decode(&got[&4].payload).unwrap();
    assert!(answer.is_ok(), "{answer:?}");

    let (ctx, mut answers) = command_stream(addr).await;
    ctx.send(ExecuteRequest {
        partition_id: 1,
        request: vec![0xff, 0xff].into(),
        id: 42,
        scope: None,
    })
    .await
    .unwrap();
    let answer = next(&mut answers).await;
    assert_eq!(answer.id, 42);
    assert_eq!(answer.error_code, tonic::Code::InvalidArgument as i32);
    assert!(
        answer.error.contains("malformed execute request"),
        "{:?}",
        answer.error
    );

    // Both streams are still open from this side: shutdown must end them, not wait.
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), broker)
        .await
        .expect("the broker stops within 10 s with a peer's stream open")
        .unwrap()
        .unwrap();
    let end = tokio::time::timeout(Duration::from_secs(10), replies.message())
        .await
        .expect("the reply stream ends");
    assert!(!matches!(end, Ok(Some(_))));
    drop((tx, ctx));
}

/// `msg`, stating data format `format` as a peer broker does.
fn stated<T>(format: u32, msg: T) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    req.metadata_mut().insert(
        courier_proto::DATA_FORMAT_HEADER,
        tonic::metadata::MetadataValue::from(format),
    );
    req
}

/// A peer that states another data format gets its Raft stream and its snapshot
/// chunks refused, with both formats named, rather than have them misread; one of
/// the same format is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raft_traffic_of_another_data_format_is_refused() {
    let (_dir, addr, shutdown, broker) = start_broker().await;
    let mut client = RaftClient::connect(format!("http://{addr}")).await.unwrap();
    let ours = courier_broker::store::DATA_FORMAT;
    let (_tx, rx) = mpsc::channel::<RaftFrame>(1);
    let refused = client
        .stream(stated(999, tokio_stream::wrappers::ReceiverStream::new(rx)))
        .await
        .expect_err("refused");
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert!(
        refused.message().contains("999") && refused.message().contains(&ours.to_string()),
        "{}",
        refused.message()
    );
    let chunk = courier_proto::cluster::SnapshotChunk {
        partition_id: 1,
        header: Default::default(),
        data: Default::default(),
    };
    let refused = client
        .install_snapshot(stated(ours + 1, chunk))
        .await
        .expect_err("refused");
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);

    let (tx, rx) = mpsc::channel::<RaftFrame>(1);
    let mut replies = client
        .stream(stated(
            ours,
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
        .await
        .expect("same format: served")
        .into_inner();
    tx.send(frame(1, 99, RaftCall::AppendEntries as i32, b"x"))
        .await
        .unwrap();
    let reply = next(&mut replies).await;
    assert!(reply.error.contains("partition 99"), "{:?}", reply.error);

    shutdown.cancel();
    drop((tx, replies));
    tokio::time::timeout(Duration::from_secs(10), broker)
        .await
        .expect("the broker stops")
        .unwrap()
        .unwrap();
}

/// The gateway's repeat of a once-only activation that reaches the leader while its
/// first attempt is still in flight there (the first attempt's answer lost with its
/// connection, say) gets the jobs that attempt activates. Were it answered by what
/// the leader has applied so far, those jobs would look claimed, the repeat would
/// come back empty, and the jobs would wait out their activation timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_activation_repeated_while_its_first_attempt_is_in_flight_gets_its_jobs() {
    use courier_proto::domain::{ActivationProps, BrokerError, Command, Reply, Request, RequestId};
    let (_dir, addr, shutdown, broker) = start_broker().await;
    let (tx, mut answers) = command_stream(addr).await;
    let send = |id: u64, request: &Request| {
        let tx = tx.clone();
        let request = codec::to_vec(request).unwrap();
        async move {
            tx.send(ExecuteRequest {
                partition_id: 1,
                request: request.into(),
                id,
                scope: None,
            })
            .await
            .unwrap();
        }
    };
    let created = create_when_led(addr, 3).await;
    assert_eq!(created.len(), 3);

    let activate = Request::Command(Command::Once {
        request: RequestId(0xfeed),
        command: Box::new(Command::Activate {
            props: ActivationProps {
                job_type: "t".into(),
                worker: "w".into(),
                timeout_ms: 60_000,
                fetch_variables: Vec::new(),
                tenant_ids: vec!["<default>".into()],
            },
            max_jobs: 10,
        }),
    });
    // Both attempts at once: the second reaches the leader before the first's entry
    // is committed (an fdatasync away).
    send(100, &activate).await;
    send(101, &activate).await;
    let mut got = std::collections::BTreeMap::new();
    while got.len() < 2 {
        let answer = next(&mut answers).await;
        let reply: Result<Reply, BrokerError> = codec::decode(&answer.reply).unwrap();
        let keys: Vec<_> = match reply {
            Ok(Reply::Activated(jobs)) => jobs.iter().map(|j| j.key).collect(),
            other => panic!("attempt {}: {other:?}", answer.id),
        };
        got.insert(answer.id, keys);
    }
    assert_eq!(got[&100], created, "the first attempt activates every job");
    assert_eq!(got[&101], created, "the repeat gets the same jobs");

    shutdown.cancel();
    drop((tx, answers));
    tokio::time::timeout(Duration::from_secs(10), broker)
        .await
        .expect("the broker stops")
        .unwrap()
        .unwrap();
}

/// Creates `n` jobs of type `t` on the broker at `addr` once it leads its partition
/// (within 30 s): their keys.
async fn create_when_led(
    addr: std::net::SocketAddr,
    n: usize,
) -> Vec<courier_proto::domain::JobKey> {
    use courier_proto::domain::{BrokerError, Command, NewJob, Reply, Request};
    let (tx, mut answers) = command_stream(addr).await;
    let job = NewJob {
        job_type: "t".into(),
        variables: "{}".into(),
        custom_headers: "{}".into(),
        retries: 3,
        tenant_id: "<default>".into(),
        process: Default::default(),
    };
    let create = codec::to_vec(&Request::Command(Command::Create(vec![job; n]))).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    for id in 1.. {
        tx.send(ExecuteRequest {
            partition_id: 1,
            request: create.clone().into(),
            id,
            scope: None,
        })
        .await
        .unwrap();
        let answer = next(&mut answers).await;
        assert_eq!(answer.id, id);
        let reply: Result<Reply, BrokerError> = codec::decode(&answer.reply).unwrap();
        match reply {
            Ok(Reply::Created(keys)) => return keys,
            other => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "no leader in 30 s: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    unreachable!()
}

/// A snapshot from a peer that cannot be decoded is refused with INVALID_ARGUMENT
/// before Raft installs it: the broker stays healthy and keeps leading, rather
/// than take the bad snapshot for a storage fault and stop for good. A chunk in the
/// middle of a snapshot never begun is answered with a mismatch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_that_cannot_be_decoded_is_refused_and_the_broker_serves_on() {
    use courier_broker::raft::SnapshotChunkHeader;
    use openraft::error::InstallSnapshotError;
    use openraft::raft::InstallSnapshotResponse;
    use openraft::{CommittedLeaderId, LogId, SnapshotMeta, StoredMembership};
    let (_dir, addr, shutdown, broker) = start_broker().await;
    create_when_led(addr, 1).await;

    let mut client = RaftClient::connect(format!("http://{addr}")).await.unwrap();
    let ours = courier_broker::store::DATA_FORMAT;
    // From a leader of a higher term, far ahead of this broker's log.
    let meta = SnapshotMeta {
        last_log_id: Some(LogId::new(CommittedLeaderId::new(100, 2), 1_000)),
        last_membership: StoredMembership::default(),
        snapshot_id: "bad-1".into(),
    };
    let chunk = |offset: u64, data: &[u8], done: bool| {
        let header = SnapshotChunkHeader {
            vote: Vote::new_committed(100, 2),
            meta: meta.clone(),
            offset,
            done,
        };
        courier_proto::cluster::SnapshotChunk {
            partition_id: 1,
            header: codec::to_vec(&header).unwrap().into(),
            data: data.to_vec().into(),
        }
    };
    type Answer = Result<InstallSnapshotResponse<u64>, RaftError<u64, InstallSnapshotError>>;

    let answer = client
        .install_snapshot(stated(ours, chunk(64, b"late", false)))
        .await
        .unwrap();
    let answer: Answer = codec::decode(&answer.into_inner().payload).unwrap();
    assert!(
        matches!(
            answer,
            Err(RaftError::APIError(InstallSnapshotError::SnapshotMismatch(
                _
            )))
        ),
        "{answer:?}"
    );

    let first = client
        .install_snapshot(stated(ours, chunk(0, &[0xff; 100], false)))
        .await
        .unwrap();
    let first: Answer = codec::decode(&first.into_inner().payload).unwrap();
    assert!(first.is_ok(), "{first:?}");
    let refused = client
        .install_snapshot(stated(ours, chunk(100, &[0x07; 100], true)))
        .await
        .expect_err("refused");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(
        refused.message().contains("cannot be decoded"),
        "{}",
        refused.message()
    );

    // Still leading, still writing.
    let keys = create_when_led(addr, 2).await;
    assert_eq!(keys.len(), 2);
    let metrics = prometheus::TextEncoder::new()
        .encode_to_string(&prometheus::gather())
        .unwrap();
    assert!(
        metrics.contains("courier_broker_snapshots_refused_total 1"),
        "{metrics}"
    );

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), broker)
        .await
        .expect("the broker stops")
        .unwrap()
        .unwrap();
}
