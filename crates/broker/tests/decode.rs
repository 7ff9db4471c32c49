//! Every decode path of the broker (its snapshots: `store::sm` tests), fed bytes it did not write: random ones, and
//! valid encodings cut short or with bytes changed. Each must answer an error or a
//! value, never panic, overflow the stack or allocate without bound.

// Helpers outside #[test] fns are not covered by clippy.toml's allow-unwrap-in-tests.
#![allow(clippy::unwrap_used)]

use courier_broker::engine::{Counters, Job, OnceRecord};
use courier_broker::raft::{ElectRequest, SnapshotChunkHeader, TypeConfig};
use courier_proto::cluster::{BrokerMessage, GatewayMessage, RaftFrame};
use courier_proto::codec;
use courier_proto::domain::{Reply, Request};
use courier_proto::gateway_protocol as gw;
use openraft::raft::{AppendEntriesRequest, VoteRequest};
use openraft::Entry;
use proptest::prelude::*;
use prost::Message;

/// Decodes `bytes` as every type a peer or the disk hands the broker or gateway.
fn decode_all(bytes: &[u8]) {
    let _ = codec::decode::<Entry<TypeConfig>>(bytes);
    let _ = codec::decode::<AppendEntriesRequest<TypeConfig>>(bytes);
    let _ = codec::decode::<VoteRequest<u64>>(bytes);
    let _ = codec::decode::<ElectRequest>(bytes);
    let _ = codec::decode::<SnapshotChunkHeader>(bytes);
    let _ = codec::decode::<Job>(bytes);
    let _ = codec::decode::<Counters>(bytes);
    let _ = codec::decode::<OnceRecord>(bytes);
    let _ = codec::decode::<Request>(bytes);
    let _ = codec::decode::<Reply>(bytes);
    let _ = BrokerMessage::decode(bytes);
    let _ = GatewayMessage::decode(bytes);
    let _ = RaftFrame::decode(bytes);
    let _ = gw::ActivateJobsRequest::decode(bytes);
    let _ = gw::StreamActivatedJobsRequest::decode(bytes);
    let _ = gw::CompleteJobRequest::decode(bytes);
    let _ = gw::FailJobRequest::decode(bytes);
}

/// Valid encodings to cut and change.
fn seeds() -> Vec<Vec<u8>> {
    let vote = openraft::Vote::new(3, 2);
    let mut seeds = vec![
        codec::to_vec(&VoteRequest::<u64>::new(vote, None)).unwrap(),
        codec::to_vec(&AppendEntriesRequest::<TypeConfig> {
            vote,
            prev_log_id: None,
            entries: vec![Entry::<TypeConfig>::default()],
            leader_commit: None,
        })
        .unwrap(),
        codec::to_vec(&Entry::<TypeConfig>::default()).unwrap(),
    ];
    let activate = gw::ActivateJobsRequest {
        r#type: "t".into(),
        worker: "w".into(),
        timeout: 1000,
        max_jobs_to_activate: 5,
        fetch_variable: vec!["a".into(), "b".into()],
        tenant_ids: vec!["<default>".into()],
        ..Default::default()
    };
    seeds.push(activate.encode_to_vec());
    seeds
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10_000))]

    #[test]
    fn random_bytes_decode_to_an_error_or_a_value(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        decode_all(&bytes);
    }

    #[test]
    fn valid_encodings_cut_or_changed_decode_to_an_error_or_a_value(
        seed in 0usize..4,
        cut in any::<prop::sample::Index>(),
        changes in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
    ) {
        let mut bytes = seeds().swap_remove(seed);
        for (at, b) in changes {
            let i = at.index(bytes.len());
            bytes[i] = b;
        }
        let n = cut.index(bytes.len() + 1);
        bytes.truncate(n);
        decode_all(&bytes);
    }
}

#[test]
fn lengths_that_claim_more_than_the_input_are_refused_without_allocating_them() {
    // A sequence length of 2^63 in a varint, then nothing: refused, not allocated.
    let mut huge = vec![0xff; 9];
    huge.push(0x7f);
    decode_all(&huge);
    let mut with_prefix = vec![0x01, 0x02];
    with_prefix.extend_from_slice(&huge);
    decode_all(&with_prefix);
}
