use super::*;

fn pool_of(addrs: &[&str]) -> Gateways {
    Gateways::from_members(
        addrs
            .iter()
            .map(|a| Arc::new(Member::new(a.to_string(), AuthChannel::new(lazy(a), None))))
            .collect(),
    )
}

fn picks(g: &Gateways, n: usize) -> std::collections::BTreeMap<String, usize> {
    let mut seen = std::collections::BTreeMap::new();
    for _ in 0..n {
        let p = g.pick();
        *seen.entry(p.member.addr.clone()).or_insert(0) += 1;
    }
    seen
}

/// One call to `addr` answered after `took` ms (paused time).
async fn answered(g: &Gateways, addr: &str, took: u64) {
    loop {
        let p = g.pick();
        if p.member.addr == addr {
            tokio::time::advance(Duration::from_millis(took)).await;
            p.record(&Ok::<(), Status>(()), true);
            return;
        }
    }
}

/// What a call to a port where nothing listens ends with: the transport's own error.
async fn refused() -> Status {
    let mut c = GatewayClient::new(lazy("127.0.0.1:1"));
    c.topology(courier_proto::gateway_protocol::TopologyRequest {})
        .await
        .expect_err("nothing listens on port 1")
}

#[tokio::test]
async fn addresses_are_comma_separated_and_checked_each() {
    let g = Gateways::connect(" 127.0.0.1:1, http://127.0.0.1:2 ,", &Security::default())
        .expect("two addresses");
    assert_eq!(g.addresses(), ["127.0.0.1:1", "http://127.0.0.1:2"]);
    let err = Gateways::connect("127.0.0.1:1,gw", &Security::default()).err();
    assert!(
        err.as_ref()
            .is_some_and(|e| e.to_string().contains("expected host:port")),
        "{err:?}"
    );
    let err = Gateways::connect(" , ", &Security::default()).err();
    assert!(
        err.as_ref()
            .is_some_and(|e| e.to_string().contains("no gateway address")),
        "{err:?}"
    );
}

/// Of two gateways, each call goes to the one with fewer calls outstanding, so
/// calls spread out rather than piling onto one.
#[tokio::test]
async fn a_call_goes_to_the_gateway_with_fewer_calls_outstanding() {
    let g = pool_of(&["127.0.0.1:1", "127.0.0.1:2"]);
    let mut held = Vec::new();
    for _ in 0..10 {
        held.push(g.pick());
    }
    let per: Vec<u32> = g
        .pool
        .members()
        .iter()
        .map(|m| m.outstanding.load(Ordering::Relaxed))
        .collect();
    assert_eq!(per, [5, 5], "ten calls held spread evenly");
    drop(held);
    let busy = g.pick();
    let other = g.pick();
    assert_ne!(busy.member.addr, other.member.addr);
}

/// A gateway that answers slower gets fewer calls: its cost is its outstanding calls
/// times its recent latency.
#[tokio::test(start_paused = true)]
async fn a_slower_gateway_is_picked_less() {
    let g = pool_of(&["127.0.0.1:1", "127.0.0.1:2"]);
    answered(&g, "127.0.0.1:1", 10).await;
    answered(&g, "127.0.0.1:2", 1).await;
    // The fast one takes calls until it holds ten times the slow one's.
    let mut held = Vec::new();
    for _ in 0..11 {
        held.push(g.pick());
    }
    let seen: Vec<_> = held.iter().map(|p| p.member.addr.as_str()).collect();
    let fast = seen.iter().filter(|a| **a == "127.0.0.1:2").count();
    assert!(fast >= 9, "{seen:?}");
}

/// A gateway that could not be reached is passed over while another can be, and
/// tried again after a while.
#[tokio::test(start_paused = true)]
async fn an_unreachable_gateway_is_passed_over_for_a_while() {
    let g = pool_of(&["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]);
    let status = refused().await;
    assert!(unreachable(&status), "{status:?}");
    assert!(!unreachable(&Status::unavailable(
        "no leader for partition 1"
    )));
    loop {
        let p = g.pick();
        if p.member.addr == "127.0.0.1:1" {
            p.record(&Err::<(), _>(status.clone()), true);
            break;
        }
    }
    let seen = picks(&g, 200);
    assert!(!seen.contains_key("127.0.0.1:1"), "{seen:?}");
    assert_eq!(seen.values().sum::<usize>(), 200);
    tokio::time::advance(PASS_OVER_FOR + Duration::from_millis(1)).await;
    let seen = picks(&g, 200);
    assert!(seen.get("127.0.0.1:1").is_some_and(|n| *n > 0), "{seen:?}");
    // With every gateway unreachable, calls still go somewhere.
    let all = pool_of(&["127.0.0.1:1", "127.0.0.1:2"]);
    for _ in 0..2 {
        for p in [all.pick(), all.pick()] {
            p.record(&Err::<(), _>(status.clone()), true);
        }
    }
    assert_eq!(picks(&all, 10).values().sum::<usize>(), 10);
}

/// A host name stands for every address it resolves to.
#[tokio::test]
async fn a_host_name_becomes_a_gateway_per_address() {
    let g = Gateways::connect("localhost:26599", &Security::default()).expect("a name");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let addrs = g.addresses();
        if addrs.iter().any(|a| a == "127.0.0.1:26599") {
            assert!(!addrs.iter().any(|a| a == "localhost:26599"), "{addrs:?}");
            break;
        }
        assert!(Instant::now() < deadline, "never resolved: {addrs:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A gateway passed over for a slow answer is tried again once that answer has
/// faded, rather than never again.
#[tokio::test(start_paused = true)]
async fn a_slow_answer_fades() {
    let g = pool_of(&["127.0.0.1:1", "127.0.0.1:2"]);
    answered(&g, "127.0.0.1:1", 50).await;
    answered(&g, "127.0.0.1:2", 1).await;
    assert_eq!(g.pick().member.addr, "127.0.0.1:2");
    tokio::time::advance(LATENCY_HALF_LIFE * 8).await;
    answered(&g, "127.0.0.1:2", 1).await;
    assert_eq!(g.pick().member.addr, "127.0.0.1:1");
}

/// A pool of three whose gateways report `counts` streams.
fn reporting(counts: [u64; 3]) -> Gateways {
    let g = pool_of(&["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]);
    for (m, c) in g.pool.members().iter().zip(counts) {
        m.streams.store(c, Ordering::Relaxed);
    }
    g
}

fn stream_on(g: &Gateways, i: usize) -> StreamGateway {
    StreamGateway {
        member: g.pool.members()[i].clone(),
        pool: g.pool.clone(),
    }
}

/// Where `n` streams would go: the count per gateway index.
fn placed(g: &Gateways, from: Option<usize>, n: usize) -> [usize; 3] {
    let from = from.map(|i| stream_on(g, i));
    let members = g.pool.members();
    let mut seen = [0; 3];
    for _ in 0..n {
        let p = g.pick_for_stream(from.as_ref(), &[]);
        let i = members
            .iter()
            .position(|m| Arc::ptr_eq(m, &p.member))
            .unwrap();
        seen[i] += 1;
    }
    seen
}

#[tokio::test]
async fn an_answer_tells_how_many_streams_its_gateway_holds() {
    let g = pool_of(&["127.0.0.1:1"]);
    let p = g.pick();
    let mut answer = tonic::Response::new(());
    answer
        .metadata_mut()
        .insert(GATEWAY_STREAMS_HEADER, 17.into());
    p.record(&Ok(answer), true);
    assert_eq!(p.member.streams.load(Ordering::Relaxed), 17);
    // A stream opened there counts at once.
    let _s = p.stream_opened();
    assert_eq!(p.member.streams.load(Ordering::Relaxed), 18);
}

#[tokio::test]
async fn new_streams_go_mostly_to_the_lightest_gateways_but_not_all_to_one() {
    let seen = placed(&reporting([30, 0, 0]), None, 3000);
    assert!(seen[0] < 300, "{seen:?}");
    for light in [seen[1], seen[2]] {
        assert!((1100..=1600).contains(&light), "{seen:?}");
    }
    let seen = placed(&reporting([10, 10, 10]), None, 3000);
    assert!(seen.iter().all(|n| (850..=1150).contains(n)), "{seen:?}");
}

#[tokio::test]
async fn a_stream_at_its_age_leaves_a_gateway_with_the_share_of_its_excess() {
    // 30 of 30 streams on the first: two thirds of them should leave, no more.
    let seen = placed(&reporting([30, 0, 0]), Some(0), 3000);
    assert!((850..=1150).contains(&seen[0]), "a third stays: {seen:?}");
    assert!(seen[1].abs_diff(seen[2]) < 250, "the rest split: {seen:?}");
    // At its share, or one over: it stays.
    assert_eq!(placed(&reporting([10, 10, 10]), Some(0), 500), [500, 0, 0]);
    assert_eq!(placed(&reporting([11, 10, 9]), Some(0), 500), [500, 0, 0]);
}

#[tokio::test]
async fn a_stream_leaving_a_gateway_that_is_passed_over_goes_elsewhere() {
    let g = reporting([10, 10, 10]);
    stream_on(&g, 0).pass_over();
    let seen = placed(&g, Some(0), 500);
    assert_eq!(seen[0], 0, "{seen:?}");
    let status = refused().await;
    let g = reporting([10, 10, 10]);
    stream_on(&g, 1).broke(&status);
    assert_eq!(placed(&g, None, 500)[1], 0);
    // A status the gateway answered with is no reason to pass it over.
    let g = reporting([10, 10, 10]);
    stream_on(&g, 1).broke(&Status::internal("oops"));
    assert!(placed(&g, None, 500)[1] > 0);
}
