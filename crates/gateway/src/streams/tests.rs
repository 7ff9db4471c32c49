use super::*;
use courier_proto::cluster::gateway_message::Kind;
use courier_proto::domain::DEFAULT_TENANT;
use futures::FutureExt;
use futures::StreamExt;

mod scale;

/// Declared held jobs as `join_holding` takes them.
fn jobs_held(pairs: &[(i64, i64)]) -> Vec<(JobKey, i64)> {
    pairs.iter().map(|&(k, d)| (JobKey(k), d)).collect()
}

fn limits(client_credit: u32) -> Limits {
    Limits {
        client_credit,
        max_inflight_jobs: 100_000,
        max_inflight_bytes: 256 << 20,
        spare_percent: 0,
    }
}

fn registry(client_credit: u32) -> Arc<AggregatedStreams> {
    AggregatedStreams::new(limits(client_credit))
}

fn props(job_type: &str, fetch: &[&str], tenants: &[&str]) -> ActivationProps {
    let r = gw::StreamActivatedJobsRequest {
        r#type: job_type.into(),
        worker: "w".into(),
        timeout: 1000,
        fetch_variable: fetch.iter().map(|s| s.to_string()).collect(),
        tenant_ids: tenants.iter().map(|s| s.to_string()).collect(),
    };
    courier_proto::convert::stream_request(&r).unwrap()
}

fn t() -> ActivationProps {
    props("t", &[], &[])
}

/// Like [`t`], with a 10-minute activation timeout: sweeps in the tests' future
/// release no job's credit.
fn long_t() -> ActivationProps {
    let r = gw::StreamActivatedJobsRequest {
        r#type: "t".into(),
        worker: "w".into(),
        timeout: 600_000,
        ..Default::default()
    };
    courier_proto::convert::stream_request(&r).unwrap()
}

/// A push of job `key`, activation lease `key + 500`, without a deadline (held
/// for the stream's 1 s timeout).
fn push(stream_id: StreamId, key: i64) -> PushJob {
    PushJob {
        push_id: key as u64 + 1000,
        stream_id: stream_id.0,
        partition_id: 1,
        lease: key as u64 + 500,
        job: Some(gw::ActivatedJob {
            key,
            ..Default::default()
        }),
    }
}

fn lease(key: i64) -> Lease {
    Lease(key as u64 + 500)
}

use courier_proto::domain::epoch_ms;

fn hello() -> GatewayMessage {
    GatewayMessage {
        kind: Some(Kind::Hello(Default::default())),
    }
}

/// Everything queued on a link so far.
fn drain(rx: &mut mpsc::Receiver<GatewayMessage>) -> Vec<Kind> {
    std::iter::from_fn(|| rx.try_recv().ok())
        .filter_map(|m| m.kind)
        .collect()
}

/// The credit reports queued on a link so far: (stream, free, received); any
/// other message fails the test.
fn reports(rx: &mut mpsc::Receiver<GatewayMessage>) -> Vec<(StreamId, u32, u64)> {
    drain(rx)
        .into_iter()
        .map(|k| match k {
            Kind::Credit(c) => (StreamId(c.stream_id), c.free, c.received),
            other => panic!("not a credit report: {other:?}"),
        })
        .collect()
}

/// Keys of the jobs yielded on a link so far; other messages are skipped.
fn yielded_keys(rx: &mut mpsc::Receiver<GatewayMessage>) -> Vec<i64> {
    drain(rx)
        .into_iter()
        .filter_map(|k| match k {
            Kind::YieldJob(y) => Some(y.key),
            _ => None,
        })
        .collect()
}

/// Keys of every job buffered for a client so far.
fn keys(c: &mut ClientStream) -> Vec<i64> {
    std::iter::from_fn(|| c.next().now_or_never().flatten())
        .map(|j| j.key)
        .collect()
}

fn ack(l: &AttachedLink, p: PushJob) -> (bool, String) {
    let a = l.push(p).unwrap();
    (a.accepted, a.reason)
}

fn ok() -> (bool, String) {
    (true, String::new())
}

fn refused(reason: &str) -> (bool, String) {
    (false, reason.to_string())
}

#[test]
fn equal_props_share_a_stream_and_different_ones_do_not() {
    let s = registry(32);
    let a = s.join(props("t", &["x", "y"], &["b", "a"]), None);
    let b = s.join(props("t", &["y", "x", "y"], &["a", "b"]), None);
    assert_eq!(a.stream_id(), b.stream_id());
    let others = [
        props("u", &["x", "y"], &["a", "b"]),
        props("t", &["x"], &["a", "b"]),
        props("t", &["x", "y"], &["a"]),
        props("t", &["x", "y"], &[DEFAULT_TENANT]),
    ];
    let mut ids = vec![a.stream_id()];
    let clients: Vec<ClientStream> = others.into_iter().map(|p| s.join(p, None)).collect();
    ids.extend(clients.iter().map(|c| c.stream_id()));
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 5, "{ids:?}");
    assert_eq!(s.stream_count(), 5);
    assert_eq!(s.client_count(), 6);
    drop(clients);
    drop(a);
    assert_eq!(s.stream_count(), 1);
    drop(b);
    assert_eq!((s.stream_count(), s.client_count()), (0, 0));
    // A stream created again after it went away gets a new id: stale pushes for the
    // old one are refused rather than delivered to the wrong stream generation.
    let c = s.join(t(), None);
    let d = s.join(props("t", &["x", "y"], &["a", "b"]), None);
    assert!(d.stream_id() > c.stream_id());
}

#[test]
fn streams_are_registered_with_every_link_on_first_join_and_unregistered_on_last_leave() {
    let s = registry(32);
    let (_l1, mut rx1) = s.attach_link(1, hello());
    let (_l2, mut rx2) = s.attach_link(2, hello());
    assert!(matches!(drain(&mut rx1)[..], [Kind::Hello(_)]));
    assert!(matches!(drain(&mut rx2)[..], [Kind::Hello(_)]));

    let a = s.join(t(), None);
    let id = a.stream_id();
    for rx in [&mut rx1, &mut rx2] {
        match &drain(rx)[..] {
            [Kind::Register(r)] => {
                assert_eq!(StreamId(r.stream_id), id);
                assert_eq!(r.props, Some(StreamProps::from(&t())));
            }
            other => panic!("{other:?}"),
        }
    }
    let b = s.join(t(), None);
    drop(a);
    assert!(drain(&mut rx1).is_empty());
    assert!(drain(&mut rx2).is_empty());

    // A link (re)connecting gets the hello, then every current stream, then every
    // stream's credit.
    let u = s.join(props("u", &[], &[]), None);
    let (l3, mut rx3) = s.attach_link(3, hello());
    let got = drain(&mut rx3);
    assert!(matches!(got[0], Kind::Hello(_)), "{got:?}");
    let mut registered: Vec<String> = got[1..3]
        .iter()
        .map(|k| match k {
            Kind::Register(r) => r.props.as_ref().unwrap().r#type.clone(),
            other => panic!("{other:?}"),
        })
        .collect();
    registered.sort();
    assert_eq!(registered, ["t", "u"]);
    let mut credited: Vec<StreamId> = got[3..]
        .iter()
        .map(|k| match k {
            Kind::Credit(c) => StreamId(c.stream_id),
            other => panic!("{other:?}"),
        })
        .collect();
    credited.sort();
    assert_eq!(credited, [id, u.stream_id()]);
    drain(&mut rx1);
    drain(&mut rx2);

    // A detached link hears nothing more.
    drop(l3);
    drop(b);
    for rx in [&mut rx1, &mut rx2] {
        match &drain(rx)[..] {
            [Kind::Unregister(u)] => assert_eq!(StreamId(u.stream_id), id),
            other => panic!("{other:?}"),
        }
    }
    assert!(drain(&mut rx3).is_empty());
}

#[test]
fn a_link_that_cannot_take_a_message_is_reset() {
    let s = registry(32);
    let (l1, _rx1) = s.attach_link(1, hello());
    // Fill the queue as a broker that stopped reading would.
    for _ in 0..OUTBOUND_BUFFER {
        l1.send(hello(), "ack");
    }
    assert!(!l1.broken().is_cancelled());
    let _a = s.join(t(), None);
    assert!(l1.broken().is_cancelled());
    // Forgotten: the reconnect registers everything afresh.
    let (_l1, mut rx1) = s.attach_link(1, hello());
    assert!(matches!(
        drain(&mut rx1)[..],
        [Kind::Hello(_), Kind::Register(_), Kind::Credit(_)]
    ));
}

#[test]
fn a_client_never_holds_more_than_its_credit() {
    let s = registry(3);
    let (l, _rx) = s.attach_link(1, hello());
    let mut a = s.join(t(), None);
    let id = a.stream_id();
    for k in 0..3 {
        assert_eq!(ack(&l, push(id, k)), ok());
    }
    assert_eq!(ack(&l, push(id, 3)), refused(CLIENTS_FULL));
    // Taking jobs from the buffer is not finishing them.
    assert_eq!(keys(&mut a), [0, 1, 2]);
    assert_eq!(ack(&l, push(id, 4)), refused(CLIENTS_FULL));
    drop(s.finished_here(JobKey(1), Instant::now()));
    assert_eq!(ack(&l, push(id, 5)), ok());
    assert_eq!(ack(&l, push(id, 6)), refused(CLIENTS_FULL));
    assert_eq!(keys(&mut a), [5]);
    assert_eq!(s.inflight().0, 3);
}

/// Which of `keys` (each asked with its own lease, `key + 500`, or a stale
/// one) the gateway says it holds.
fn held_of(s: &AggregatedStreams, asked: &[(i64, u64)]) -> Vec<i64> {
    let answer = s.held(HeldQuery {
        query_id: 7,
        partition_id: 1,
        jobs: asked
            .iter()
            .map(|&(key, lease)| courier_proto::cluster::HeldJob { key, lease })
            .collect(),
    });
    assert_eq!(answer.query_id, 7);
    answer.held.into_iter().map(|h| h.key).collect()
}

#[test]
fn a_new_leader_hears_which_pushes_are_held_here_or_finishing_through_here() {
    let s = registry(4);
    let (l, _rx) = s.attach_link(1, hello());
    let mut a = s.join(t(), None);
    let id = a.stream_id();
    // Job 1 handed over, 2 still buffered, 3 handed over and being completed,
    // 4 never arrived; job 1 asked about under a stale lease too.
    assert_eq!(ack(&l, push(id, 1)), ok());
    assert_eq!(ack(&l, push(id, 3)), ok());
    assert_eq!(keys(&mut a), [1, 3]);
    assert_eq!(ack(&l, push(id, 2)), ok());
    let completing = s.finished_here(JobKey(3), Instant::now());
    let asked = [(1, 501), (2, 502), (3, 503), (4, 504)];
    assert_eq!(held_of(&s, &asked), [1, 2, 3]);
    assert_eq!(held_of(&s, &[(1, 9)]), Vec::<i64>::new());
    // Once the completion has its answer, job 3 is nobody's here.
    drop(completing);
    assert_eq!(held_of(&s, &asked), [1, 2]);
    // A client that left may still finish what it was handed: still held. Its
    // buffered job went back to the broker.
    drop(a);
    assert_eq!(held_of(&s, &asked), [1]);
    // A job polled through another gateway (gone, say) and being completed
    // through this one counts as held too, until the completion has its answer.
    let polled = s.finished_here(JobKey(99), Instant::now());
    let twice = s.finished_here(JobKey(99), Instant::now());
    assert_eq!(held_of(&s, &[(99, 1)]), [99]);
    drop(polled);
    assert_eq!(held_of(&s, &[(99, 1)]), [99]);
    drop(twice);
    assert_eq!(held_of(&s, &[(99, 1)]), Vec::<i64>::new());
    assert!(s.lock().finishing.is_empty());
    // The push of job 4 arrives late (its leader was slow, not dead): the leader
    // that asked has made it runnable again, so it is refused. Another
    // activation of it is not.
    let b = s.join(t(), None);
    let late = push(b.stream_id(), 4);
    assert_eq!(ack(&l, late.clone()), refused(DISOWNED));
    let again = PushJob { lease: 9, ..late };
    assert_eq!(ack(&l, again), ok());
}

#[test]
fn a_job_in_the_spare_room_is_given_up_to_the_leader_that_asks() {
    // Job 1 handed to the client, 2 and 3 in the spare room.
    let (s, _l, _rx, mut a) = one_full_client_and_two_spare_jobs();
    assert_eq!(held_of(&s, &[(1, lease(1).0), (2, lease(2).0)]), [1]);
    // The other spare job still goes to the first client that frees credit;
    // the one given up never does.
    drop(s.finished_here(JobKey(1), Instant::now()));
    assert_eq!(keys(&mut a), [3]);
}

#[test]
fn jobs_a_joining_client_holds_already_count_against_its_credit() {
    let s = registry(4);
    let (l, _rx) = s.attach_link(1, hello());
    // Another client holds job 9.
    let mut other = s.join(t(), Some(1));
    let id = other.stream_id();
    assert_eq!(ack(&l, push(id, 9)), ok());
    assert_eq!(keys(&mut other), [9]);
    // Job 1 was handed to a client that left; its worker still runs it.
    let mut first = s.join(t(), None);
    assert_eq!(ack(&l, push(id, 1)), ok());
    assert_eq!(keys(&mut first), [1]);
    drop(first);

    // The worker is back holding job 1, job 2 (polled, or from another gateway),
    // job 3 (past its deadline) and job 9 (not its own).
    let later = epoch_ms() + 60_000;
    let declared = [(1, later), (2, later), (3, epoch_ms() - 1), (9, later)];
    let mut back = s.join_holding(t(), None, &jobs_held(&declared));
    assert_eq!(back.stream_id(), id);
    assert_eq!(s.inflight().0, 3, "jobs 1, 2 and 9");
    // Two of its four are taken: two more pushes fit.
    assert_eq!(ack(&l, push(id, 4)), ok());
    assert_eq!(ack(&l, push(id, 5)), ok());
    assert_eq!(ack(&l, push(id, 6)), refused(CLIENTS_FULL));
    // A declared job finished through here frees its room ...
    drop(s.finished_here(JobKey(2), Instant::now()));
    assert_eq!(ack(&l, push(id, 7)), ok());
    // ... as does the end of job 1's activation, now counted for this client.
    s.finished(JobKey(1), lease(1));
    assert_eq!(ack(&l, push(id, 8)), ok());
    assert_eq!(ack(&l, push(id, 10)), refused(CLIENTS_FULL));
    assert_eq!(keys(&mut back), [4, 5, 7, 8]);
    assert!(keys(&mut other).is_empty());
    // A broker asking about a job a client declared hears that it is held here,
    // whatever the lease (the client cannot know it).
    let mut again = s.join_holding(props("u", &[], &[]), None, &jobs_held(&[(20, later)]));
    assert_eq!(held_of(&s, &[(20, 77), (21, 78)]), [20]);
    assert!(keys(&mut again).is_empty());

    // Never more than its credit, and a declared job's deadline ends its hold.
    let s = registry(2);
    let (l, _rx) = s.attach_link(1, hello());
    let soon = epoch_ms() + 1_000;
    let c = s.join_holding(t(), None, &jobs_held(&[(1, soon), (2, later), (3, later)]));
    assert_eq!(s.inflight().0, 2);
    assert_eq!(ack(&l, push(c.stream_id(), 4)), refused(CLIENTS_FULL));
    s.sweep(Instant::now() + Duration::from_secs(2));
    assert_eq!(ack(&l, push(c.stream_id(), 4)), ok());
    assert_eq!(ack(&l, push(c.stream_id(), 5)), refused(CLIENTS_FULL));
}

#[test]
fn a_stated_credit_overrides_the_default() {
    let s = registry(32);
    let (l, _rx) = s.attach_link(1, hello());
    assert_eq!(s.join(t(), None).credit(), 32);
    let a = s.join(t(), Some(2));
    assert_eq!(a.credit(), 2);
    assert_eq!(ack(&l, push(a.stream_id(), 1)), ok());
    assert_eq!(ack(&l, push(a.stream_id(), 2)), ok());
    assert_eq!(ack(&l, push(a.stream_id(), 3)), refused(CLIENTS_FULL));
    // A credit of zero would be a client that can never take a job.
    let z = AggregatedStreams::new(limits(0));
    let (l, _rx) = z.attach_link(1, hello());
    let mut c = z.join(t(), None);
    assert_eq!(c.credit(), 1);
    assert_eq!(ack(&l, push(c.stream_id(), 1)), ok());
    assert_eq!(ack(&l, push(c.stream_id(), 2)), refused(CLIENTS_FULL));
    assert_eq!(keys(&mut c), [1]);
}

#[test]
fn clients_take_turns_and_one_without_credit_is_skipped() {
    let s = registry(32);
    let (l, _rx) = s.attach_link(1, hello());
    let mut a = s.join(t(), Some(2));
    let id = a.stream_id();
    let mut b = s.join(t(), Some(10));
    for k in 0..4 {
        assert_eq!(ack(&l, push(id, k)), ok());
    }
    // In turn until a has no credit left (2), then only b.
    for k in 4..10 {
        assert_eq!(ack(&l, push(id, k)), ok());
    }
    assert_eq!(keys(&mut a), vec![0, 2]);
    assert_eq!(keys(&mut b), vec![1, 3, 4, 5, 6, 7, 8, 9]);
    // b has 2 left; then nobody has credit.
    assert_eq!(ack(&l, push(id, 10)), ok());
    assert_eq!(ack(&l, push(id, 11)), ok());
    assert_eq!(ack(&l, push(id, 12)), refused(CLIENTS_FULL));
}

#[test]
fn clients_with_credit_take_turns() {
    let s = registry(64);
    let (l, _rx) = s.attach_link(1, hello());
    let mut a = s.join(t(), None);
    let mut b = s.join(t(), None);
    for k in 0..100 {
        assert_eq!(ack(&l, push(a.stream_id(), k)), ok());
    }
    let (ka, kb) = (keys(&mut a), keys(&mut b));
    assert_eq!((ka.len(), kb.len()), (50, 50));
    // Strictly alternating, not just balanced.
    assert!(ka.iter().all(|k| k % 2 == 0), "{ka:?}");
    assert!(kb.iter().all(|k| k % 2 == 1), "{kb:?}");
}

#[test]
fn a_job_finished_through_this_gateway_or_any_other_frees_one_credit() {
    let s = registry(2);
    let (l, _rx) = s.attach_link(1, hello());
    let mut a = s.join(t(), None);
    let id = a.stream_id();
    assert_eq!(ack(&l, push(id, 1)), ok());
    assert_eq!(ack(&l, push(id, 2)), ok());
    assert_eq!(ack(&l, push(id, 3)), refused(CLIENTS_FULL));
    // The worker has them.
    assert_eq!(keys(&mut a), [1, 2]);
    // JobFinished: only for the activation held, and only once.
    s.finished(JobKey(1), Lease(lease(1).0 + 1));
    s.finished(JobKey(99), Lease(1));
    assert_eq!(ack(&l, push(id, 3)), refused(CLIENTS_FULL));
    s.finished(JobKey(1), lease(1));
    assert_eq!(ack(&l, push(id, 3)), ok());
    assert_eq!(keys(&mut a), [3]);
    s.finished(JobKey(1), lease(1));
    assert_eq!(ack(&l, push(id, 4)), refused(CLIENTS_FULL));
    // Completed through this gateway.
    drop(s.finished_here(JobKey(2), Instant::now()));
    drop(s.finished_here(JobKey(2), Instant::now()));
    assert_eq!(ack(&l, push(id, 4)), ok());
    assert_eq!(ack(&l, push(id, 5)), refused(CLIENTS_FULL));
    assert_eq!(s.inflight().0, 2);
}

#[tokio::test(start_paused = true)]
async fn a_finish_whose_request_began_before_the_hand_off_frees_nothing() {
    let s = registry(1);
    let (l, _rx) = s.attach_link(1, hello());
    let mut a = s.join(t(), None);
    let since = Instant::now();
    tokio::time::sleep(Duration::from_millis(1)).await;
    // Failed with retries left, and pushed again before the FailJob reply.
    assert_eq!(ack(&l, push(a.stream_id(), 1)), ok());
    assert_eq!(keys(&mut a), [1]);
    drop(s.finished_here(JobKey(1), since));
    s.timeout_updated(JobKey(1), 60_000, since);
    assert_eq!(ack(&l, push(a.stream_id(), 2)), refused(CLIENTS_FULL));
    drop(s.finished_here(JobKey(1), Instant::now()));
    assert_eq!(ack(&l, push(a.stream_id(), 2)), ok());
}

#[tokio::test(start_paused = true)]
async fn a_passed_deadline_frees_one_credit_and_update_timeout_moves_it() {
    let s = registry(1);
    let stop = CancellationToken::new();
    let (_tx, leaders) = watch::channel(BTreeMap::new());
    let task = tokio::spawn(s.clone().run(leaders, stop.clone()));
    let (l, _rx) = s.attach_link(1, hello());
    let mut a = s.join(t(), None);
    let id = a.stream_id();
    let with_deadline = |key: i64, in_ms: i64| {
        let mut p = push(id, key);
        if let Some(j) = p.job.as_mut() {
            j.deadline = epoch_ms() + in_ms;
        }
        p
    };
    assert_eq!(ack(&l, with_deadline(1, 1000)), ok());
    assert_eq!(keys(&mut a), [1]);
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert_eq!(ack(&l, push(id, 2)), refused(CLIENTS_FULL));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(s.inflight().0, 0);
    assert_eq!(ack(&l, with_deadline(2, 1000)), ok());
    assert_eq!(keys(&mut a), [2]);

    // At 500 ms the timeout is set to 2 s from then.
    tokio::time::sleep(Duration::from_millis(500)).await;
    s.timeout_updated(JobKey(2), 2000, Instant::now());
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(ack(&l, push(id, 3)), refused(CLIENTS_FULL));
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(ack(&l, push(id, 3)), ok());
    assert_eq!(keys(&mut a), [3]);

    // A push without a deadline is held for the stream's activation timeout.
    drop(s.finished_here(JobKey(3), Instant::now()));
    assert_eq!(ack(&l, push(id, 4)), ok());
    assert_eq!(keys(&mut a), [4]);
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert_eq!(s.inflight().0, 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(s.inflight().0, 0);

    stop.cancel();
    tokio::time::timeout(Duration::from_secs(1), task)
        .await
        .expect("the task stops on shutdown")
        .unwrap();
}

#[test]
fn the_gateway_refuses_past_its_jobs_bound() {
    let s = AggregatedStreams::new(Limits {
        max_inflight_jobs: 2,
        ..limits(32)
    });
    let (l, mut rx) = s.attach_link(1, hello());
    let a = s.join(t(), None);
    let b = s.join(props("u", &[], &[]), None);
    assert_eq!(ack(&l, push(a.stream_id(), 1)), ok());
    assert_eq!(ack(&l, push(b.stream_id(), 2)), ok());
    assert_eq!(ack(&l, push(a.stream_id(), 3)), refused(GATEWAY_FULL));
    assert_eq!(s.inflight().0, 2);
    drain(&mut rx);
    s.flush();
    let mut got = reports(&mut rx);
    got.sort();
    assert_eq!(got, [(a.stream_id(), 0, 2), (b.stream_id(), 0, 1)]);
    // One released: one more fits, and both streams may have it.
    drop(s.finished_here(JobKey(2), Instant::now()));
    s.flush();
    let mut got = reports(&mut rx);
    got.sort();
    assert_eq!(got, [(a.stream_id(), 1, 2), (b.stream_id(), 1, 1)]);
    assert_eq!(ack(&l, push(a.stream_id(), 3)), ok());
}

#[test]
fn the_gateway_refuses_past_its_bytes_bound() {
    let s = AggregatedStreams::new(Limits {
        max_inflight_bytes: 100,
        ..limits(32)
    });
    let (l, mut rx) = s.attach_link(1, hello());
    let a = s.join(t(), None);
    let id = a.stream_id();
    let sized = |key: i64, vars: usize, headers: usize| {
        let mut p = push(id, key);
        if let Some(j) = p.job.as_mut() {
            j.variables = "v".repeat(vars);
            j.custom_headers = "h".repeat(headers);
        }
        p
    };
    assert_eq!(ack(&l, sized(1, 40, 20)), ok());
    assert_eq!(s.inflight(), (1, 60));
    assert_eq!(ack(&l, sized(2, 30, 20)), refused(GATEWAY_FULL));
    drain(&mut rx);
    s.flush();
    // No room reported until something is released, though a smaller job fits.
    assert_eq!(reports(&mut rx), [(id, 0, 2)]);
    assert_eq!(ack(&l, sized(3, 30, 10)), ok());
    assert_eq!(s.inflight(), (2, 100));
    s.finished(JobKey(1), lease(1));
    assert_eq!(s.inflight(), (1, 40));
    s.flush();
    assert_eq!(reports(&mut rx), [(id, 30, 3)]);
    assert_eq!(ack(&l, sized(2, 30, 20)), ok());
}

#[test]
fn credit_is_split_by_led_partitions_with_the_remainder_in_turn() {
    assert_eq!(split(10, &[2, 1, 0], 0), [7, 3, 0]);
    assert_eq!(split(10, &[2, 1, 0], 1), [6, 4, 0]);
    assert_eq!(split(10, &[2, 1, 0], 2), [7, 3, 0]);
    // No leader known: equal shares.
    assert_eq!(split(10, &[0, 0, 0], 0), [4, 3, 3]);
    assert_eq!(split(10, &[0, 0, 0], 1), [3, 4, 3]);
    // A single credit goes round.
    let firsts: Vec<Vec<u32>> = (0..3).map(|r| split(1, &[1, 1, 1], r)).collect();
    assert_eq!(firsts, [[1, 0, 0], [0, 1, 0], [0, 0, 1]]);
    assert_eq!(split(0, &[3, 1], 5), [0, 0]);
    assert!(split(7, &[], 0).is_empty());
    for free in [0, 1, 2, 9, 10, 11, 1000, u32::MAX] {
        for r in 0..4 {
            for w in [[2, 1, 0], [0, 0, 0], [5, 5, 1], [1, 0, 0]] {
                let shares = split(free, &w, r);
                let sum: u64 = shares.iter().map(|&s| u64::from(s)).sum();
                assert_eq!(sum, u64::from(free), "{free} {w:?} {r}");
                if w.iter().any(|&x| x > 0) {
                    assert!(w.iter().zip(&shares).all(|(&w, &s)| w > 0 || s == 0));
                }
            }
        }
    }
}

#[test]
fn each_link_hears_its_share_of_the_streams_free_credit() {
    let s = registry(10);
    let links: Vec<_> = (1..=3).map(|n| s.attach_link(n, hello())).collect();
    let mut rxs: Vec<_> = links.into_iter().collect();
    let a = s.join(t(), None);
    let id = a.stream_id();
    s.set_leaders(BTreeMap::from([(1, 2), (2, 1)]));
    let mut first = Vec::new();
    for round in 0..2 {
        s.flush();
        let shares: Vec<u32> = rxs
            .iter_mut()
            .map(|(_, rx)| {
                let got: Vec<_> = drain(rx)
                    .into_iter()
                    .filter_map(|k| match k {
                        Kind::Credit(c) => Some((c.stream_id, c.free, c.received)),
                        _ => None,
                    })
                    .collect();
                match got[..] {
                    [(sid, free, 0)] if StreamId(sid) == id => free,
                    // Nothing sent: unchanged, or not worth reporting yet.
                    [] => 0,
                    _ => panic!("{got:?}"),
                }
            })
            .collect();
        if round == 0 {
            assert!(shares == [7, 3, 0] || shares == [6, 4, 0], "{shares:?}");
            first = shares;
        } else if first == [7, 3, 0] {
            // The remainder moved on: the share that shrank is told at once; the
            // one that grew by a credit, with the broker's view still above half
            // of it, is not.
            assert_eq!(shares, [6, 0, 0]);
        } else {
            assert_eq!(shares, [0, 3, 0]);
        }
        // Something changed: the next flush re-splits.
        s.set_leaders(BTreeMap::from([(1, 2), (2, 1), (3, 0)]));
    }
}

#[test]
fn a_types_credit_gauges_go_with_its_last_stream() {
    let series = || {
        prometheus::default_registry()
            .gather()
            .iter()
            .filter(|f| f.name().starts_with("courier_gateway_credit_"))
            .flat_map(|f| f.get_metric())
            .filter(|m| m.get_label().iter().any(|l| l.value() == "gone-type"))
            .count()
    };
    let s = registry(8);
    let a = s.join(props("gone-type", &[], &[]), None);
    let b = s.join(props("gone-type", &["x"], &[]), None);
    assert_eq!(series(), 2);
    drop(a);
    assert_eq!(series(), 2, "another stream of the type is left");
    drop(b);
    assert_eq!(series(), 0);
}

#[test]
fn brokers_with_jobs_they_had_no_credit_for_take_the_streams_free_credit() {
    let s = registry(30);
    let (l1, mut rx1) = s.attach_link(1, hello());
    let (_l2, mut rx2) = s.attach_link(2, hello());
    s.set_leaders(BTreeMap::from([(1, 1), (2, 2)]));
    let mut a = s.join(long_t(), None);
    let id = a.stream_id();
    drain(&mut rx1);
    drain(&mut rx2);
    s.flush();
    assert_eq!(reports(&mut rx1), [(id, 10, 0)]);
    assert_eq!(reports(&mut rx2), [(id, 20, 0)]);

    // Broker 1 has jobs it could not push: the credit goes to it alone. A notice
    // for another type or tenant changes nothing.
    s.jobs_available(2, "u", DEFAULT_TENANT);
    s.jobs_available(2, "t", "other");
    s.flush();
    assert!(drain(&mut rx1).is_empty());
    assert!(drain(&mut rx2).is_empty());
    s.jobs_available(1, "t", DEFAULT_TENANT);
    s.flush();
    assert_eq!(reports(&mut rx1), [(id, 30, 0)]);
    assert_eq!(reports(&mut rx2), [(id, 0, 0)]);

    // It pushes all it may: no free credit, so its demand lasts however long
    // the client holds the jobs.
    for k in 0..30 {
        assert_eq!(ack(&l1, push(id, k)), ok());
    }
    assert_eq!(keys(&mut a).len(), 30);
    let later = Instant::now() + DEMAND_WINDOW * 3;
    s.sweep(later);
    s.flush();
    assert!(drain(&mut rx2).is_empty());
    for k in 0..6 {
        drop(s.finished_here(JobKey(k), Instant::now()));
    }
    s.flush();
    assert_eq!(reports(&mut rx1), [(id, 6, 30)]);
    assert!(drain(&mut rx2).is_empty());

    // With free credit and neither notices nor pushes for the window, the
    // backlog is gone: the split by led partitions is back.
    s.sweep(later + DEMAND_WINDOW + Duration::from_millis(1));
    assert!(s.lock().streams[&id].wanted.is_empty());
    s.flush();
    assert_eq!(reports(&mut rx1), [(id, 2, 30)]);
    assert_eq!(reports(&mut rx2), [(id, 4, 0)]);

    // Now broker 2 has jobs it could not push.
    s.jobs_available(2, "t", DEFAULT_TENANT);
    s.flush();
    assert_eq!(reports(&mut rx1), [(id, 0, 30)]);
    assert_eq!(reports(&mut rx2), [(id, 6, 0)]);
}

#[test]
fn a_broker_whose_jobs_wait_for_credit_gets_the_next_free_credit_and_keeps_its_demand() {
    // One credit, three brokers with a partition each: only one can hold it.
    let s = registry(1);
    let (_links, mut rxs): (Vec<_>, Vec<_>) = (1..=3).map(|n| s.attach_link(n, hello())).unzip();
    s.set_leaders(BTreeMap::from([(1, 1), (2, 1), (3, 1)]));
    let a = s.join(t(), None);
    let id = a.stream_id();
    // What each broker was told last.
    let mut told = [0u32; 3];
    let mut hear = |rxs: &mut Vec<mpsc::Receiver<GatewayMessage>>| {
        for (i, rx) in rxs.iter_mut().enumerate() {
            for k in drain(rx) {
                if let Kind::Credit(c) = k {
                    assert_eq!(StreamId(c.stream_id), id);
                    told[i] = c.free;
                }
            }
        }
        told
    };
    s.flush();
    let first = hear(&mut rxs);
    assert_eq!(first.iter().sum::<u32>(), 1, "{first:?}");
    // Brokers 1 and 3 announce jobs they could not push: one of them gets it.
    s.jobs_available(1, "t", DEFAULT_TENANT);
    s.jobs_available(3, "t", DEFAULT_TENANT);
    s.flush();
    let (with, without) = match hear(&mut rxs) {
        [1, 0, 0] => (0, 2),
        [0, 0, 1] => (2, 0),
        other => panic!("{other:?}"),
    };
    // The other one announces again (a new job it could not push): the credit
    // moves to it now, not once the first one's demand has aged out.
    s.jobs_available(without as NodeId + 1, "t", DEFAULT_TENANT);
    s.flush();
    let now = hear(&mut rxs);
    assert_eq!((now[without], now[with], now[1]), (1, 0, 0), "{now:?}");

    // It pushes nothing (its job went elsewhere, say to a poll): once that has
    // lasted the window its demand is gone. The first's stays, however long: it
    // was told of no credit, so it could not show its demand by pushing.
    s.sweep(Instant::now() + DEMAND_WINDOW * 3);
    s.flush();
    let now = hear(&mut rxs);
    assert_eq!((now[with], now[without]), (1, 0), "{now:?}");
    let wanted: Vec<NodeId> = s.lock().streams[&id].wanted.keys().copied().collect();
    assert_eq!(wanted, [with as NodeId + 1]);
    drop(a);
}

#[test]
fn pushes_alone_send_no_report_and_a_release_sends_one_per_link() {
    let s = registry(32);
    let (l1, mut rx1) = s.attach_link(1, hello());
    let (_l2, mut rx2) = s.attach_link(2, hello());
    s.set_leaders(BTreeMap::from([(1, 1), (2, 1)]));
    let mut a = s.join(t(), None);
    let id = a.stream_id();
    s.flush();
    drain(&mut rx1);
    drain(&mut rx2);
    for k in 0..20 {
        assert_eq!(ack(&l1, push(id, k)), ok());
    }
    assert_eq!(keys(&mut a).len(), 20);
    s.flush();
    assert!(drain(&mut rx1).is_empty());
    assert!(drain(&mut rx2).is_empty());
    // Eight released before the flush: one report per link. Broker 1 thinks it
    // has no credit left (16 told, 20 received), so it hears of its new share
    // of 10; broker 2's share shrank from 16.
    for k in 0..8 {
        drop(s.finished_here(JobKey(k), Instant::now()));
    }
    s.flush();
    assert_eq!(reports(&mut rx1), [(id, 10, 20)]);
    assert_eq!(reports(&mut rx2), [(id, 10, 0)]);
    s.flush();
    assert!(drain(&mut rx1).is_empty());
    // A client joining or leaving changes the stream's credit too. Joining adds
    // 32: both brokers' views are below half of their new shares of 26.
    let b = s.join(t(), None);
    s.flush();
    assert_eq!(reports(&mut rx1), [(id, 26, 20)]);
    assert_eq!(reports(&mut rx2), [(id, 26, 0)]);
    drop(b);
    s.flush();
    assert_eq!(reports(&mut rx1), [(id, 10, 20)]);
    assert_eq!(reports(&mut rx2), [(id, 10, 0)]);
}

#[test]
fn credit_that_grew_is_reported_once_the_brokers_view_falls_to_half_of_it() {
    let s = registry(32);
    let (l1, mut rx1) = s.attach_link(1, hello());
    let mut a = s.join(t(), None);
    let id = a.stream_id();
    s.flush();
    drain(&mut rx1);
    for k in 0..20 {
        assert_eq!(ack(&l1, push(id, k)), ok());
    }
    assert_eq!(keys(&mut a).len(), 20);
    // Three come back: the broker thinks it may push 12 more, of 15.
    for k in 0..3 {
        drop(s.finished_here(JobKey(k), Instant::now()));
    }
    s.flush();
    assert!(drain(&mut rx1).is_empty());
    // A client of credit 1 joins and leaves: 12 of 16, then of 15 again.
    let b = s.join(t(), Some(1));
    s.flush();
    drop(b);
    s.flush();
    assert!(drain(&mut rx1).is_empty());
    // Its pushes wear its view down: 4 of 7 is more than half...
    for k in 20..28 {
        assert_eq!(ack(&l1, push(id, k)), ok());
    }
    s.flush();
    assert!(drain(&mut rx1).is_empty());
    // ...3 of 6 is not: the push that took it there has the report sent.
    assert_eq!(ack(&l1, push(id, 28)), ok());
    assert!(s.lock().dirty.contains(&id));
    s.flush();
    assert_eq!(reports(&mut rx1), [(id, 6, 29)]);
    assert_eq!(keys(&mut a).len(), 9);
    // A share that shrinks is told at once, however little: a second broker
    // leads a partition too.
    let (_l2, mut rx2) = s.attach_link(2, hello());
    s.set_leaders(BTreeMap::from([(1, 1), (2, 1)]));
    s.flush();
    assert_eq!(reports(&mut rx1), [(id, 3, 29)]);
    assert!(drain(&mut rx2)
        .iter()
        .any(|k| matches!(k, Kind::Credit(c) if StreamId(c.stream_id) == id)));
}

#[tokio::test(start_paused = true)]
async fn the_flusher_coalesces_releases_and_follows_leadership() {
    let s = registry(32);
    let stop = CancellationToken::new();
    let (leaders_tx, leaders) = watch::channel(BTreeMap::from([(1, 1), (2, 1)]));
    let task = tokio::spawn(s.clone().run(leaders, stop.clone()));
    let (l1, mut rx1) = s.attach_link(1, hello());
    let (_l2, mut rx2) = s.attach_link(2, hello());
    let mut a = s.join(t(), None);
    let id = a.stream_id();
    tokio::time::sleep(Duration::from_millis(10)).await;
    drain(&mut rx1);
    drain(&mut rx2);
    for k in 0..20 {
        assert_eq!(ack(&l1, push(id, k)), ok());
    }
    assert_eq!(keys(&mut a).len(), 20);
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(drain(&mut rx1).is_empty());
    assert!(drain(&mut rx2).is_empty());
    for k in 0..4 {
        s.finished(JobKey(k), lease(k));
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(reports(&mut rx1), [(id, 8, 20)]);
    assert_eq!(reports(&mut rx2), [(id, 8, 0)]);
    // Broker 2 now leads both partitions.
    leaders_tx.send_replace(BTreeMap::from([(2, 2)]));
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(reports(&mut rx1), [(id, 0, 20)]);
    assert_eq!(reports(&mut rx2), [(id, 16, 0)]);
    stop.cancel();
    task.await.unwrap();
}

#[test]
fn a_reconnected_link_hears_every_report_again_with_its_pushes_counted_afresh() {
    let s = registry(8);
    let (l1, mut rx1) = s.attach_link(1, hello());
    let mut a = s.join(t(), None);
    let id = a.stream_id();
    s.flush();
    assert_eq!(drain(&mut rx1).len(), 3);
    for k in 0..3 {
        assert_eq!(ack(&l1, push(id, k)), ok());
    }
    assert_eq!(keys(&mut a), [0, 1, 2]);
    // Refused pushes count as received too.
    assert_eq!(ack(&l1, push(StreamId(77), 9)), refused(UNKNOWN_STREAM));
    drop(s.finished_here(JobKey(0), Instant::now()));
    // Broker 1 has jobs waiting for credit: it hears of every credit that comes back.
    s.jobs_available(1, "t", DEFAULT_TENANT);
    s.flush();
    assert_eq!(reports(&mut rx1), [(id, 6, 3)]);
    drop(l1);
    let (l1, mut rx1) = s.attach_link(1, hello());
    match &drain(&mut rx1)[..] {
        [Kind::Hello(_), Kind::Register(r), Kind::Credit(c)] => {
            assert_eq!(StreamId(r.stream_id), id);
            assert_eq!((StreamId(c.stream_id), c.free, c.received), (id, 6, 0));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(ack(&l1, push(id, 5)), ok());
    assert_eq!(keys(&mut a), [5]);
    drop(s.finished_here(JobKey(1), Instant::now()));
    s.flush();
    assert_eq!(reports(&mut rx1), [(id, 6, 1)]);
}

#[test]
fn a_client_whose_buffer_holds_released_jobs_reports_again_when_it_takes_one() {
    let s = registry(2);
    let (l, mut rx) = s.attach_link(1, hello());
    let mut a = s.join(t(), None);
    let id = a.stream_id();
    assert_eq!(ack(&l, push(id, 1)), ok());
    assert_eq!(ack(&l, push(id, 2)), ok());
    // Canceled while still buffered (the client's window is full): the credit is
    // back but the buffer has no room.
    s.finished(JobKey(1), lease(1));
    s.finished(JobKey(2), lease(2));
    drain(&mut rx);
    s.flush();
    assert_eq!(reports(&mut rx), [(id, 0, 2)]);
    assert_eq!(ack(&l, push(id, 3)), refused(CLIENTS_FULL));
    // Their activations ended: the client takes them out of its buffer but is
    // not handed them.
    assert_eq!(keys(&mut a), Vec::<i64>::new());
    s.flush();
    assert_eq!(reports(&mut rx), [(id, 2, 3)]);
    assert_eq!(ack(&l, push(id, 3)), ok());
    assert_eq!(keys(&mut a), [3]);
}

#[test]
fn a_buffered_job_whose_activation_ended_never_reaches_its_client() {
    let s = registry(4);
    let (l, _rx) = s.attach_link(1, hello());
    let mut a = s.join(t(), None);
    let id = a.stream_id();
    for k in 1..=3 {
        assert_eq!(ack(&l, push(id, k)), ok());
    }
    // While the client has not read them: job 1 timed out and was pushed again
    // under a new lease, job 2 was completed through another gateway.
    let mut again = push(id, 1);
    again.lease = lease(1).0 + 1;
    again.push_id += 1;
    assert_eq!(ack(&l, again), ok());
    s.finished(JobKey(2), lease(2));
    // Each job once, under the activation that is current; nothing run twice.
    assert_eq!(keys(&mut a), [3, 1]);
    assert_eq!(s.inflight().0, 2);
}

#[test]
fn unknown_streams_and_malformed_pushes_are_refused() {
    let s = registry(2);
    let (l, _rx) = s.attach_link(1, hello());
    assert_eq!(ack(&l, push(StreamId(77), 1)), refused(UNKNOWN_STREAM));
    let a = s.join(t(), None);
    let id = a.stream_id();
    drop(a);
    // Gone with its last client.
    assert_eq!(ack(&l, push(id, 1)), refused(UNKNOWN_STREAM));
    let mut p = push(id, 1);
    p.job = None;
    assert!(l.push(p).is_none());
    let ack = l.push(push(id, 9));
    assert_eq!(ack.map(|a| a.push_id), Some(1009));
    assert_eq!(s.inflight(), (0, 0));
}

#[test]
fn a_leaving_clients_buffered_jobs_go_to_the_next_client_with_their_credit() {
    let s = registry(4);
    let (l1, mut rx1) = s.attach_link(1, hello());
    let a = s.join(t(), None);
    let mut b = s.join(t(), None);
    let id = a.stream_id();
    for k in 0..4 {
        assert_eq!(ack(&l1, push(id, k)), ok());
    }
    drop(a);
    let mut got = keys(&mut b);
    got.sort();
    assert_eq!(got, [0, 1, 2, 3]);
    assert_eq!(s.client_count(), 1);
    // Nothing yielded, the stream is still registered.
    assert!(matches!(
        drain(&mut rx1)[..],
        [Kind::Hello(_), Kind::Register(_)]
    ));
    // The moved jobs count against b now.
    assert_eq!(ack(&l1, push(id, 4)), refused(CLIENTS_FULL));
    s.finished(JobKey(0), lease(0));
    assert_eq!(ack(&l1, push(id, 4)), ok());
}

fn with_spare(client_credit: u32, spare_percent: u32) -> Arc<AggregatedStreams> {
    AggregatedStreams::new(Limits {
        spare_percent,
        ..limits(client_credit)
    })
}

#[test]
fn spare_room_is_a_quarter_of_the_credit_rounded_up() {
    assert_eq!(spare_share(32, 25), 8);
    assert_eq!(spare_share(4, 25), 1);
    assert_eq!(spare_share(1, 25), 1);
    assert_eq!(spare_share(10, 0), 0);
    assert_eq!(spare_share(u32::MAX, 100), u32::MAX);
}

#[test]
fn spare_jobs_wait_for_the_first_client_that_frees_credit_never_exceeding_it() {
    // Credit 2 each, spare 50%: one spare place per client, reported as credit.
    let s = with_spare(2, 50);
    let (l, mut rx) = s.attach_link(1, hello());
    let mut a = s.join(t(), None);
    let mut b = s.join(t(), None);
    let id = a.stream_id();
    drain(&mut rx);
    s.flush();
    assert_eq!(reports(&mut rx).last(), Some(&(id, 6, 0)));
    for k in 1..=4 {
        assert_eq!(ack(&l, push(id, k)), ok());
    }
    // Both clients are full; the next two wait in the spare room.
    assert_eq!(ack(&l, push(id, 5)), ok());
    assert_eq!(ack(&l, push(id, 6)), ok());
    assert_eq!(keys(&mut a), [1, 3]);
    assert_eq!(keys(&mut b), [2, 4]);
    assert_eq!(s.inflight().0, 6);
    // b finishes one: the oldest spare job goes to b at once, not to a.
    drop(s.finished_here(JobKey(4), Instant::now()));
    assert_eq!(keys(&mut b), [5]);
    assert!(keys(&mut a).is_empty());
    drop(s.finished_here(JobKey(1), Instant::now()));
    assert_eq!(keys(&mut a), [6]);
    // The spare room is empty again and reported as free.
    s.flush();
    assert_eq!(reports(&mut rx).last(), Some(&(id, 2, 6)));
}

#[test]
fn spare_jobs_that_wait_too_long_go_back_and_the_spare_room_pauses() {
    let s = with_spare(1, 100);
    let (l, mut rx) = s.attach_link(1, hello());
    let mut a = s.join(long_t(), None);
    let id = a.stream_id();
    for k in 1..=3 {
        assert_eq!(ack(&l, push(id, k)), ok());
    }
    assert_eq!(keys(&mut a), [1]);
    drain(&mut rx);
    s.sweep(Instant::now() + SPARE_WAIT / 2);
    assert!(yielded_keys(&mut rx).is_empty(), "not yet");
    // The client is stuck: its spare jobs go back for others to run.
    s.sweep(Instant::now() + SPARE_WAIT);
    let mut back = yielded_keys(&mut rx);
    back.sort();
    assert_eq!(back, [2, 3]);
    assert_eq!(s.inflight().0, 1);
    // And the spare room is neither offered nor filled while it stays stuck.
    s.flush();
    assert_eq!(reports(&mut rx).last(), Some(&(id, 0, 3)));
    assert_eq!(ack(&l, push(id, 4)), refused(CLIENTS_FULL));
    // It frees its credit: room for it, and the spare room again.
    drop(s.finished_here(JobKey(1), Instant::now()));
    s.flush();
    assert_eq!(reports(&mut rx).last(), Some(&(id, 2, 4)));
}

/// Credit 1 and spare 100% (one place reported, one more of tolerance): job 1
/// taken by the client, jobs 2 and 3 in the spare room.
fn one_full_client_and_two_spare_jobs() -> (
    Arc<AggregatedStreams>,
    AttachedLink,
    mpsc::Receiver<GatewayMessage>,
    ClientStream,
) {
    let s = with_spare(1, 100);
    let (l, rx) = s.attach_link(1, hello());
    let mut a = s.join(t(), None);
    let id = a.stream_id();
    assert_eq!(ack(&l, push(id, 1)), ok());
    assert_eq!(ack(&l, push(id, 2)), ok());
    assert_eq!(ack(&l, push(id, 3)), ok());
    assert_eq!(keys(&mut a), [1]);
    (s, l, rx, a)
}

#[test]
fn pushes_beyond_the_reported_spare_room_are_taken_up_to_as_much_again() {
    let (s, l, _rx, mut a) = one_full_client_and_two_spare_jobs();
    let id = a.stream_id();
    assert_eq!(ack(&l, push(id, 4)), refused(CLIENTS_FULL));
    drop(s.finished_here(JobKey(1), Instant::now()));
    assert_eq!(keys(&mut a), [2]);
    assert_eq!(ack(&l, push(id, 4)), ok());
    assert_eq!(ack(&l, push(id, 5)), refused(CLIENTS_FULL));
}

#[test]
fn a_spare_job_whose_activation_ended_is_never_handed_out() {
    let (s, _l, _rx, mut a) = one_full_client_and_two_spare_jobs();
    // Job 2 timed out at the broker (or was canceled) while it waited.
    s.finished(JobKey(2), lease(2));
    assert_eq!(s.inflight().0, 2);
    drop(s.finished_here(JobKey(1), Instant::now()));
    assert_eq!(keys(&mut a), [3]);
    assert_eq!(s.inflight().0, 1);
}

#[tokio::test(start_paused = true)]
async fn a_spare_job_past_half_its_timeout_goes_back_to_its_broker() {
    // The stream's timeout is 1 s (see `props`).
    let (s, _l, mut rx, mut a) = one_full_client_and_two_spare_jobs();
    drain(&mut rx);
    tokio::time::advance(Duration::from_millis(400)).await;
    drop(s.finished_here(JobKey(1), Instant::now()));
    assert_eq!(keys(&mut a), [2]);
    tokio::time::advance(Duration::from_millis(200)).await;
    drop(s.finished_here(JobKey(2), Instant::now()));
    // Job 3 has 400 ms of its 1 s left: yielded, not handed out.
    assert!(keys(&mut a).is_empty());
    let yielded = yielded_keys(&mut rx);
    assert_eq!(yielded, [3]);
    assert_eq!(s.inflight().0, 0);
}

#[test]
fn spare_jobs_are_yielded_when_the_last_client_leaves() {
    let s = with_spare(1, 100);
    let (l, mut rx) = s.attach_link(1, hello());
    let a = s.join(t(), None);
    let id = a.stream_id();
    assert_eq!(ack(&l, push(id, 1)), ok());
    assert_eq!(ack(&l, push(id, 2)), ok());
    drain(&mut rx);
    drop(a);
    let yielded = yielded_keys(&mut rx);
    assert_eq!(yielded, [1, 2]);
    assert_eq!(s.inflight(), (0, 0));
}

#[test]
fn a_leaving_clients_buffered_jobs_wait_in_the_spare_room_for_the_others() {
    let s = with_spare(1, 100);
    let (l, mut rx) = s.attach_link(1, hello());
    let a = s.join(t(), None);
    let mut b = s.join(t(), None);
    let id = a.stream_id();
    assert_eq!(ack(&l, push(id, 1)), ok());
    assert_eq!(ack(&l, push(id, 2)), ok());
    drain(&mut rx);
    // a leaves with job 1 in its buffer; b is full: job 1 waits for b.
    drop(a);
    assert!(drain(&mut rx)
        .iter()
        .all(|k| !matches!(k, Kind::YieldJob(_))));
    assert_eq!(keys(&mut b), [2]);
    drop(s.finished_here(JobKey(2), Instant::now()));
    assert_eq!(keys(&mut b), [1]);
}

#[test]
fn jobs_no_client_can_take_are_yielded_to_every_broker() {
    let s = registry(4);
    let (l1, mut rx1) = s.attach_link(1, hello());
    let (l2, mut rx2) = s.attach_link(2, hello());
    let a = s.join(t(), None);
    let id = a.stream_id();
    assert_eq!(ack(&l1, push(id, 10)), ok());
    assert_eq!(ack(&l2, push(id, 20)), ok());
    assert_eq!(ack(&l1, push(id, 11)), ok());
    drain(&mut rx1);
    drain(&mut rx2);
    drop(a);
    let yields = |rx: &mut mpsc::Receiver<GatewayMessage>| -> Vec<(u32, i64, u64)> {
        drain(rx)
            .into_iter()
            .filter_map(|k| match k {
                Kind::YieldJob(y) => Some((y.partition_id, y.key, y.lease)),
                Kind::Unregister(_) => None,
                other => panic!("{other:?}"),
            })
            .collect()
    };
    // Whichever leads the partition now acts on them; the lease guards the rest.
    let all = [(1, 10, 510), (1, 20, 520), (1, 11, 511)];
    assert_eq!(yields(&mut rx1), all);
    assert_eq!(yields(&mut rx2), all);
    assert_eq!(s.stream_count(), 0);
    assert_eq!(s.inflight(), (0, 0));
}

#[test]
fn jobs_the_remaining_clients_have_no_credit_for_are_yielded() {
    let s = registry(1);
    let (l1, mut rx1) = s.attach_link(1, hello());
    let a = s.join(t(), None);
    let mut b = s.join(t(), None);
    let id = a.stream_id();
    assert_eq!(ack(&l1, push(id, 1)), ok());
    assert_eq!(ack(&l1, push(id, 2)), ok());
    drain(&mut rx1);
    drop(a);
    match &drain(&mut rx1)[..] {
        [Kind::YieldJob(y)] => assert_eq!(y.key, 1),
        other => panic!("{other:?}"),
    }
    assert_eq!(keys(&mut b), [2]);
    // b stays in the rotation alone, with its credit.
    s.finished(JobKey(2), lease(2));
    assert_eq!(ack(&l1, push(id, 3)), ok());
    assert_eq!(keys(&mut b), [3]);
}

#[test]
fn jobs_of_a_client_that_left_count_against_the_gateway_until_they_finish() {
    let s = registry(4);
    let (l1, _rx1) = s.attach_link(1, hello());
    let mut a = s.join(t(), None);
    let id = a.stream_id();
    let mut p = push(id, 1);
    if let Some(j) = p.job.as_mut() {
        j.variables = "{}".into();
    }
    assert_eq!(ack(&l1, p), ok());
    // Its worker has it.
    assert_eq!(keys(&mut a), [1]);
    drop(a);
    assert_eq!(s.inflight(), (1, 2));
    s.finished(JobKey(1), lease(1));
    assert_eq!(s.inflight(), (0, 0));
}

#[test]
fn a_job_pushed_again_replaces_its_earlier_activation() {
    let s = registry(2);
    let (l1, _rx1) = s.attach_link(1, hello());
    let a = s.join(t(), None);
    let id = a.stream_id();
    assert_eq!(ack(&l1, push(id, 1)), ok());
    let mut again = push(id, 1);
    again.lease = 9000;
    assert_eq!(ack(&l1, again), ok());
    assert_eq!(s.inflight().0, 1);
    // The earlier activation's end is stale; the current one's is not.
    s.finished(JobKey(1), lease(1));
    assert_eq!(s.inflight().0, 1);
    s.finished(JobKey(1), Lease(9000));
    assert_eq!(s.inflight().0, 0);
}

#[test]
fn the_rotation_continues_past_a_removed_client() {
    let s = registry(8);
    let (l, _rx) = s.attach_link(1, hello());
    let mut a = s.join(t(), None);
    let mut b = s.join(t(), None);
    let mut c = s.join(t(), None);
    let id = a.stream_id();
    // a, b: next is c.
    assert_eq!(ack(&l, push(id, 0)), ok());
    assert_eq!(ack(&l, push(id, 1)), ok());
    assert_eq!(keys(&mut b), [1]);
    drop(b);
    assert_eq!(ack(&l, push(id, 2)), ok());
    assert_eq!(ack(&l, push(id, 3)), ok());
    assert_eq!(keys(&mut a), [0, 3]);
    assert_eq!(keys(&mut c), [2]);
}
