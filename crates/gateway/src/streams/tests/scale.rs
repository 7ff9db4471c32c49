//! What a push, a finish, a credit report, a client joining and one leaving cost
//! as a stream's idle clients grow: the same, not in proportion to them.

use super::*;

fn worker_props(job_type: &str, worker: &str) -> ActivationProps {
    let r = gw::StreamActivatedJobsRequest {
        r#type: job_type.into(),
        worker: worker.into(),
        timeout: 600_000,
        ..Default::default()
    };
    courier_proto::convert::stream_request(&r).unwrap()
}

const ROUNDS: i64 = 2_000;

/// The least time, of three tries, of [`ROUNDS`] rounds of: a job pushed, taken
/// by its client and finished, the credit reports flushed, a client leaving and
/// another joining, on a stream with `idle` idle clients besides, and `others`
/// streams of other types (a notice of available jobs looks at the streams of its
/// type only).
fn rounds(idle: usize, others: usize) -> std::time::Duration {
    (0..3)
        .map(|_| {
            let s = AggregatedStreams::new(Limits {
                client_credit: 4,
                max_inflight_jobs: 1_000_000,
                max_inflight_bytes: 1 << 30,
                spare_percent: 0,
            });
            let (link, mut rx) = s.attach_link(1, hello());
            let mut clients: VecDeque<ClientStream> = (0..idle)
                .map(|_| s.join(worker_props("t", "w"), None))
                .collect();
            let _other_streams: Vec<ClientStream> = (0..others)
                .map(|i| s.join(worker_props(&format!("t{i}"), "w"), None))
                .collect();
            let id = clients[0].stream_id();
            s.flush();
            while rx.try_recv().is_ok() {}
            let start = std::time::Instant::now();
            for key in 0..ROUNDS {
                let ack = link.push(push(id, key)).unwrap();
                assert!(ack.accepted, "{ack:?}");
                s.jobs_available(1, "t", courier_proto::domain::DEFAULT_TENANT);
                s.finished(JobKey(key), lease(key));
                s.flush();
                while rx.try_recv().is_ok() {}
                clients.pop_front();
                clients.push_back(s.join(worker_props("t", "w"), None));
            }
            start.elapsed()
        })
        .min()
        .unwrap()
}

#[test]
fn the_cost_of_a_job_does_not_grow_with_idle_clients_or_other_streams() {
    let few = rounds(100, 10);
    let many_clients = rounds(100_000, 10);
    let many_streams = rounds(100, 20_000);
    // In proportion to the clients, it would be a thousand times as much; to the
    // streams, two thousand. Both get a wide margin for a noisy machine.
    assert!(
        many_clients < few * 10,
        "{ROUNDS} rounds: {few:?} with 100 clients, {many_clients:?} with 100,000"
    );
    assert!(
        many_streams < few * 10,
        "{ROUNDS} rounds: {few:?} with 10 other streams, {many_streams:?} with 20,000"
    );
}
