//! The Raft stream a broker serves to its peers, over real gRPC on loopback: each
//! request gets its own reply by id, a request that cannot be served gets an error
//! reply rather than silence, and a stream a peer holds open does not keep the
//! broker from shutting down.

use courier_broker::{BrokerConfig, Durability, RaftTuning};
use courier_proto::cluster::{raft_client::RaftClient, RaftCall, RaftFrame};
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raft_stream_answers_every_request_and_ends_on_shutdown() {
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
    };
    let shutdown = CancellationToken::new();
    let broker = tokio::spawn(courier_broker::run(config, listener, shutdown.clone()));

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
        let reply = tokio::time::timeout(Duration::from_secs(10), replies.message())
            .await
            .expect("a reply within 10 s")
            .unwrap()
            .expect("the stream stays open");
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

    // The stream is still open from this side: shutdown must end it, not wait for it.
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
    drop(tx);
}
