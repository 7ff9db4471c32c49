use super::*;
use courier_proto::domain::DEFAULT_TENANT;

fn props(t: &str, worker: &str) -> ActivationProps {
    ActivationProps {
        job_type: t.into(),
        worker: worker.into(),
        timeout_ms: 1000,
        fetch_variables: vec![],
        tenant_ids: vec![DEFAULT_TENANT.into()],
    }
}

/// Streams registered from several threads at once leave the gauge at the
/// number registered, whichever thread counted last: rounds in which every
/// thread registers one at the same moment, the gauge checked after each.
#[test]
fn the_streams_gauge_counts_registrations_made_at_once() {
    const THREADS: u64 = 4;
    const ROUNDS: u64 = 300;
    let reg = Arc::new(JobStreamRegistry::for_node(90_001));
    // Many job types, so that counting them takes a while.
    for i in 0..2000 {
        reg.register(LinkId(99), StreamId(i), props(&format!("filler-{i}"), "w"));
    }
    let barrier = Arc::new(std::sync::Barrier::new(THREADS as usize + 1));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (reg, barrier) = (reg.clone(), barrier.clone());
            std::thread::spawn(move || {
                for i in 0..ROUNDS {
                    barrier.wait();
                    reg.register(LinkId(t + 1), StreamId(i), props("a", "w"));
                    barrier.wait();
                }
            })
        })
        .collect();
    let gauge = metrics::STREAMS.with_label_values(&["90001"]);
    let mut wrong = Vec::new();
    for round in 0..ROUNDS {
        barrier.wait();
        barrier.wait();
        let expected = 2000 + THREADS * (round + 1);
        if gauge.get() != expected as i64 {
            wrong.push((round, gauge.get(), expected));
        }
    }
    for t in threads {
        t.join().unwrap();
    }
    assert!(wrong.is_empty(), "(round, gauge, registered): {wrong:?}");
}

/// Job 1 of type "a", activated.
fn job_one() -> ActivatedJob {
    ActivatedJob {
        key: courier_proto::domain::JobKey(1),
        job_type: "a".into(),
        worker: "w".into(),
        retries: 1,
        deadline: 0,
        variables: "{}".into(),
        custom_headers: "{}".into(),
        tenant_id: DEFAULT_TENANT.into(),
        process: Default::default(),
    }
}

#[test]
fn lookups_find_streams_by_type_and_tenant_and_take_turns() {
    let reg = JobStreamRegistry::default();
    let (l1, _rx1) = reg.add_link();
    let (l2, _rx2) = reg.add_link();
    assert!(reg.lookup("a", DEFAULT_TENANT, 1).is_none());
    reg.register(l1.id, StreamId(10), props("a", "w"));
    reg.register(l2.id, StreamId(20), props("a", "w"));
    assert!(
        reg.lookup("a", DEFAULT_TENANT, 1).is_none(),
        "no credit reported yet"
    );
    assert!(
        reg.report_credit(l1.id, StreamId(10), 100, 0),
        "first credit"
    );
    assert!(reg.report_credit(l2.id, StreamId(20), 100, 0));
    assert!(reg.lookup("b", DEFAULT_TENANT, 1).is_none());
    assert!(reg.lookup("a", "acme", 1).is_none(), "other tenant");
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..4 {
        let t = reg.lookup("a", DEFAULT_TENANT, 5).expect("a stream");
        assert_eq!(t.props, props("a", "w"));
        assert_eq!(t.max, 5);
        seen.insert(t.recipient.stream_id);
    }
    // Both gateways get turns.
    assert_eq!(
        seen.into_iter().collect::<Vec<_>>(),
        vec![StreamId(10), StreamId(20)],
        "both gateways get turns"
    );
    let first = Recipient {
        link: l1.id,
        stream_id: StreamId(10),
    };
    assert_eq!(
        reg.others(&props("a", "w"), &first),
        vec![Recipient {
            link: l2.id,
            stream_id: StreamId(20)
        }]
    );
}

#[test]
fn streams_with_room_are_those_of_the_type_and_tenant_with_credit() {
    let reg = JobStreamRegistry::default();
    let (l1, _rx1) = reg.add_link();
    reg.register(l1.id, StreamId(1), props("a", "w1"));
    reg.register(l1.id, StreamId(2), props("a", "w2"));
    reg.register(l1.id, StreamId(3), props("b", "w1"));
    assert!(
        reg.streams_with_room("a", DEFAULT_TENANT).is_empty(),
        "no credit yet"
    );
    reg.report_credit(l1.id, StreamId(2), 1, 0);
    reg.report_credit(l1.id, StreamId(3), 1, 0);
    assert_eq!(
        reg.streams_with_room("a", DEFAULT_TENANT),
        vec![props("a", "w2")]
    );
    assert!(
        reg.streams_with_room("a", "acme").is_empty(),
        "other tenant"
    );
    assert!(
        reg.streams_with_room("c", DEFAULT_TENANT).is_empty(),
        "no stream"
    );
    // Its one credit held for a push: no room left.
    let t = reg.target_for(&props("a", "w2"), 1).expect("room");
    assert_eq!(t.max, 1);
    assert!(reg.streams_with_room("a", DEFAULT_TENANT).is_empty());
}

#[test]
fn a_link_that_ends_takes_its_streams_with_it() {
    let reg = JobStreamRegistry::default();
    let (l1, _rx1) = reg.add_link();
    let (l2, _rx2) = reg.add_link();
    reg.register(l1.id, StreamId(1), props("a", "w"));
    reg.register(l1.id, StreamId(2), props("b", "w"));
    reg.register(l2.id, StreamId(1), props("a", "w"));
    for (l, s) in [(l1.id, 1), (l1.id, 2), (l2.id, 1)] {
        reg.report_credit(l, StreamId(s), 10, 0);
    }
    reg.remove_link(l1.id);
    assert!(reg.lookup("b", DEFAULT_TENANT, 1).is_none());
    let t = reg
        .lookup("a", DEFAULT_TENANT, 1)
        .expect("l2 still has one");
    assert_eq!(t.recipient.link, l2.id);
    assert!(reg.link(l1.id).is_none());
    reg.unregister(l2.id, StreamId(1));
    assert!(reg.lookup("a", DEFAULT_TENANT, 1).is_none());
    assert!(reg.all_props().is_empty());
}

#[test]
fn credit_is_held_refunded_and_reconciled_with_the_gateways_count() {
    let reg = JobStreamRegistry::default();
    let (l, _rx) = reg.add_link();
    reg.register(l.id, StreamId(1), props("a", "w"));
    let r = Recipient {
        link: l.id,
        stream_id: StreamId(1),
    };
    assert!(reg.report_credit(l.id, StreamId(1), 5, 0));
    // A command for 3 jobs holds 3; the next may hold the 2 left, then none.
    assert_eq!(reg.lookup("a", DEFAULT_TENANT, 3).map(|t| t.max), Some(3));
    assert_eq!(reg.lookup("a", DEFAULT_TENANT, 3).map(|t| t.max), Some(2));
    assert!(
        reg.lookup("a", DEFAULT_TENANT, 3).is_none(),
        "no credit: no push"
    );
    assert!(!reg.take_one(&r));
    // The first command pushed only 1 of its 3: 2 come back.
    reg.refund(&r, 2);
    assert_eq!(reg.lookup("a", DEFAULT_TENANT, 9).map(|t| t.max), Some(2));
    // 5 sent; the gateway saw 4 of them and has 1 free of its share 2: 1 push is
    // on its way, so nothing is free here.
    assert!(
        !reg.report_credit(l.id, StreamId(1), 1, 4),
        "no more than before"
    );
    assert!(reg.lookup("a", DEFAULT_TENANT, 1).is_none());
    // It saw all 5 and 3 finished: 3 free, after none.
    assert!(
        reg.report_credit(l.id, StreamId(1), 3, 5),
        "credit after none: back-fill"
    );
    assert_eq!(reg.lookup("a", DEFAULT_TENANT, 9).map(|t| t.max), Some(3));
}

#[test]
fn recipients_with_credit_take_turns_whatever_their_credit() {
    let reg = JobStreamRegistry::default();
    let (l1, _rx1) = reg.add_link();
    let (l2, _rx2) = reg.add_link();
    reg.register(l1.id, StreamId(1), props("a", "w"));
    reg.register(l2.id, StreamId(1), props("a", "w2"));
    reg.report_credit(l1.id, StreamId(1), 2, 0);
    reg.report_credit(l2.id, StreamId(1), 7, 0);
    let workers: Vec<String> = (0..6)
        .map(|_| {
            let t = reg.lookup("a", DEFAULT_TENANT, 1).expect("credit");
            t.props.worker
        })
        .collect();
    // Each in turn while both have credit; then w, out of credit, drops out.
    assert_eq!(
        workers.iter().filter(|w| *w == "w").count(),
        2,
        "{workers:?}"
    );
    assert_ne!(workers[0], workers[1], "{workers:?}");
    assert_ne!(workers[2], workers[3], "{workers:?}");
    assert_eq!(&workers[4..], ["w2", "w2"], "{workers:?}");
    assert!(reg.target_for(&props("a", "w"), 5).is_none());
    assert_eq!(reg.target_for(&props("a", "w2"), 9).map(|t| t.max), Some(3));
}

#[tokio::test(start_paused = true)]
async fn pushes_end_with_the_gateways_answer_or_unknown() {
    let reg = JobStreamRegistry::default();
    let (link, mut rx) = reg.add_link();
    let job = job_one();
    // Sent, then the gateway's answer (or none), as the leader's pushes are.
    let push = |link: &Arc<Link>, lease: u64, job: ActivatedJob| {
        let sent = link.send_push(StreamId(9), PartitionId(2), Lease(lease), job);
        async move {
            match sent {
                Ok(sent) => sent.outcome().await,
                Err(refused) => refused,
            }
        }
    };
    let l = link.clone();
    let answer = tokio::spawn(async move {
        let Some(BrokerMessage {
            kind: Some(broker_message::Kind::Push(p)),
        }) = rx.recv().await
        else {
            panic!("expected a push")
        };
        assert_eq!((p.stream_id, p.partition_id, p.lease), (9, 2, 4));
        l.acked(p.push_id, false, "clients_full".into());
        rx
    });
    let outcome = push(&link, 4, job.clone()).await;
    assert_eq!(outcome, PushOutcome::Refused("clients_full".into()));
    let _rx = answer.await.expect("answered");
    // No answer at all: unknown after the ack timeout, never a retry.
    assert_eq!(push(&link, 5, job.clone()).await, PushOutcome::Unknown);
    // The link ended before the answer: unknown as well.
    let l = link.clone();
    let id = link.id;
    let pending = tokio::spawn(push(&l, 6, job.clone()));
    tokio::task::yield_now().await;
    reg.remove_link(id);
    assert_eq!(pending.await.expect("push"), PushOutcome::Unknown);
    // Unless the gateway said it leaves: it had no client left to take it.
    let (leaving, _rx) = reg.add_link();
    reg.hello(&leaving, "gw-leaving".into());
    let l = leaving.clone();
    let pending = tokio::spawn(push(&l, 7, job));
    tokio::task::yield_now().await;
    reg.leaving(&leaving);
    reg.remove_link(leaving.id);
    assert_eq!(
        pending.await.expect("push"),
        PushOutcome::Refused(GATEWAY_LEFT.into())
    );
}

#[test]
fn a_gateway_that_says_it_leaves_is_remembered_as_gone_gracefully() {
    let reg = JobStreamRegistry::default();
    let (link, _rx) = reg.add_link();
    let (other, _rx2) = reg.add_link();
    reg.hello(&link, "gw-1".into());
    reg.hello(&other, "gw-2".into());
    assert!(!reg.left("gw-1"));
    reg.leaving(&link);
    assert!(reg.left("gw-1"));
    assert!(!reg.left("gw-2"));
    // Remembered after its link is gone, for a later leader's check.
    reg.remove_link(link.id);
    assert!(reg.left("gw-1"));
}

#[tokio::test]
async fn a_held_query_gets_its_own_answer_or_none_when_the_link_ends() {
    let reg = JobStreamRegistry::default();
    let (link, mut rx) = reg.add_link();
    let mark = reg.hellos();
    reg.hello(&link, "gw-1".into());
    assert!(reg.said_hello_since("gw-1", mark));
    assert!(!reg.said_hello_since("gw-1", reg.hellos()));
    assert!(!reg.said_hello_since("gw-2", 0));
    assert!(reg.link_of_gateway("gw-2").is_none());
    assert!(reg.link_of_gateway("").is_none(), "no hello is no gateway");
    let found = reg.link_of_gateway("gw-1").expect("linked");
    let asked = vec![HeldJob { key: 1, lease: 4 }, HeldJob { key: 2, lease: 5 }];
    let answer = found.query_held(PartitionId(3), asked.clone());
    let Some(BrokerMessage {
        kind: Some(broker_message::Kind::HeldQuery(q)),
    }) = rx.recv().await
    else {
        panic!("expected a held query")
    };
    assert_eq!((q.partition_id, q.jobs), (3, asked));
    // Answers to other queries are ignored; a question dropped unanswered is
    // forgotten.
    drop(found.query_held(PartitionId(3), vec![]));
    assert_eq!(link.queries.len(), 1);
    link.answered(q.query_id + 1, vec![]);
    link.answered(q.query_id, vec![HeldJob { key: 2, lease: 5 }]);
    assert_eq!(answer.await, Some(vec![HeldJob { key: 2, lease: 5 }]));
    // The link ends before an answer: none.
    let waiting = tokio::spawn(link.query_held(PartitionId(3), vec![]));
    tokio::task::yield_now().await;
    reg.remove_link(link.id);
    assert_eq!(waiting.await.expect("query"), None);
    // A link that cannot take the question: none at once.
    drop(rx);
    assert_eq!(link.query_held(PartitionId(3), vec![]).await, None);
}

#[test]
fn a_push_that_cannot_be_queued_gives_its_credit_back() {
    let reg = JobStreamRegistry::default();
    let (link, rx) = reg.add_link();
    reg.register(link.id, StreamId(1), props("a", "w"));
    assert!(reg.report_credit(link.id, StreamId(1), 1, 0));
    let job = job_one();
    let t = reg.lookup("a", DEFAULT_TENANT, 1).expect("credit");
    assert!(reg.lookup("a", DEFAULT_TENANT, 1).is_none(), "held");
    // The link's queue is gone (as when full): the push is refused here, and
    // the recipient may be pushed to again.
    drop(rx);
    let sent = reg.send_push(&t.recipient, PartitionId(1), Lease(1), job.clone());
    assert!(matches!(sent, Some(Err(PushOutcome::Refused(ref r))) if r == "link_gone"));
    let t = reg
        .lookup("a", DEFAULT_TENANT, 1)
        .expect("credit given back");
    // A push that was queued keeps its credit until the gateway reports it.
    let (link2, _rx2) = reg.add_link();
    reg.register(link2.id, StreamId(1), props("b", "w"));
    reg.report_credit(link2.id, StreamId(1), 1, 0);
    let t2 = reg.lookup("b", DEFAULT_TENANT, 1).expect("credit");
    assert!(matches!(
        reg.send_push(&t2.recipient, PartitionId(1), Lease(1), job),
        Some(Ok(_))
    ));
    assert!(reg.lookup("b", DEFAULT_TENANT, 1).is_none());
    drop(t);
}

/// The least time, of three tries, to register `n` streams of one type with
/// distinct properties (one worker each), look a target up for each, and
/// unregister them all.
fn register_lookup_unregister(n: u64) -> std::time::Duration {
    (0..3)
        .map(|_| {
            let reg = JobStreamRegistry::for_node(90_002);
            let start = std::time::Instant::now();
            for i in 0..n {
                reg.register(LinkId(1), StreamId(i), props("t", &format!("w{i}")));
                reg.report_credit(LinkId(1), StreamId(i), 4, 0);
            }
            for _ in 0..n {
                let target = reg.lookup("t", DEFAULT_TENANT, 1).unwrap();
                reg.refund(&target.recipient, 1);
            }
            for i in 0..n {
                reg.unregister(LinkId(1), StreamId(i));
            }
            assert!(reg.all_props().is_empty());
            start.elapsed()
        })
        .min()
        .unwrap()
}

#[test]
fn registrations_of_many_distinct_properties_cost_in_proportion_to_their_number() {
    let few = register_lookup_unregister(1_000);
    let many = register_lookup_unregister(20_000);
    // 20 times as many: 20 times the work when each costs the same, 400 times when
    // each costs in proportion to those already there. A wide margin for noise.
    assert!(
        many < few * 60,
        "1,000 streams: {few:?}; 20,000 streams: {many:?}"
    );
}
