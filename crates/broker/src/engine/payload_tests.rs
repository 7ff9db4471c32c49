use super::super::tests::{activate, create, new_job, props, run, P, T0};
use super::*;

/// What one job of the tests weighs with its payload in memory.
fn weight_of_one() -> u64 {
    let mut s = State::new(P);
    create(&mut s, "t");
    s.held_bytes()
}

fn created(s: &mut State) -> (JobKey, Changes) {
    match run(s, T0, Command::Create(vec![new_job("t")])) {
        (Ok(Reply::Created(keys)), _, changes) => (keys[0], changes),
        other => panic!("create failed: {other:?}"),
    }
}

fn applied(s: &mut State, cmd: Command) -> (Applied, Changes) {
    let mut changes = Changes::new();
    let batch = Batch {
        ts: T0 + 1,
        commands: vec![LogCommand::client(cmd)],
        on_flushed: Default::default(),
    };
    (s.apply_batch(3, &batch, &mut changes), changes)
}

/// Past the budget a new job's payload leaves memory: its record holds none, the
/// changes carry it to the store, the jobs' weight leaves it out, and a job handed
/// out without it is named so the leader reads it in.
#[test]
fn a_payload_past_the_budget_is_stored_apart_and_named_when_handed_out() {
    let one = weight_of_one();
    let payload = Payload {
        variables: new_job("t").variables,
        custom_headers: new_job("t").custom_headers,
    };
    let size = (payload.variables.len() + payload.custom_headers.len()) as u64;
    let mut s = State::new(P);
    s.set_payload_budget(2 * one);
    let (a, ch) = created(&mut s);
    assert!(ch.payloads.is_empty());
    let (b, ch) = created(&mut s);
    assert!(ch.payloads.is_empty());
    let (c, ch) = created(&mut s);
    assert_eq!(ch.payloads, BTreeMap::from([(c, Some(payload.clone()))]));
    assert!(ch.jobs.contains(&c));
    assert_eq!(s.stored_payload(c), Some(size));
    assert_eq!(s.stored_payload(a), None);
    let job = s.job(c).expect("job c");
    assert_eq!(
        (job.variables.as_str(), job.custom_headers.as_str()),
        ("", "")
    );
    assert_eq!(s.held_bytes(), 3 * one - size);
    // Sizes that bound an answer count the payload wherever it is.
    assert_eq!(
        s.full_text_bytes(s.job(c).expect("c")),
        s.full_text_bytes(s.job(b).expect("b"))
    );

    let (out, _) = applied(
        &mut s,
        Command::Activate {
            props: props("t", 1000),
            max_jobs: 3,
        },
    );
    let Ok(Reply::Activated(jobs)) = &out.replies[0] else {
        panic!("{out:?}");
    };
    assert_eq!(jobs.len(), 3);
    assert_eq!(out.stored, BTreeSet::from([c]));
    let handed = jobs.iter().find(|j| j.key == c).expect("c handed out");
    assert_eq!(handed.variables, "");
    assert_eq!(
        jobs.iter()
            .find(|j| j.key == a)
            .map(|j| j.variables.as_str()),
        Some(payload.variables.as_str())
    );

    // A fail that merges variables needs the payload back first.
    let fail = Command::Fail {
        key: c,
        retries: 2,
        error_message: "boom".into(),
        retry_backoff_ms: 0,
        variables: Some(r#"{"b":3}"#.into()),
    };
    let batch = Batch {
        ts: T0 + 2,
        commands: vec![LogCommand::client(fail.clone())],
        on_flushed: Default::default(),
    };
    assert_eq!(s.payloads_wanted(&batch), vec![c]);
    let mut changes = Changes::new();
    s.hydrate(c, payload.clone(), &mut changes);
    assert_eq!(s.stored_payload(c), None);
    let out = s.apply_batch(3, &batch, &mut changes);
    assert_eq!(out.replies, vec![Ok(Reply::Done)]);
    // Merged, and stored apart again: the jobs still weigh more than the budget.
    let merged = Payload {
        variables: r#"{"a":1,"b":3}"#.into(),
        custom_headers: payload.custom_headers.clone(),
    };
    assert_eq!(
        changes.payloads,
        BTreeMap::from([(c, Some(merged.clone()))])
    );
    assert_eq!(s.stored_payload(c), Some(merged.variables.len() as u64 + 2));

    // A job that ends drops its stored payload.
    let (out, changes) = applied(&mut s, Command::Cancel { key: c });
    assert_eq!(out.replies, vec![Ok(Reply::Done)]);
    assert_eq!(changes.payloads, BTreeMap::from([(c, None)]));
    assert_eq!(s.stored_count(), 0);
    assert_eq!(s.held_bytes(), 2 * one);
}

/// A state rebuilt from records keeps each payload where it was; one rebuilt whole
/// (from a snapshot) stores the newest jobs' payloads until it fits its budget.
#[test]
fn a_rebuilt_state_keeps_or_places_payloads_by_its_budget() {
    let one = weight_of_one();
    let mut s = State::new(P);
    s.set_payload_budget(one);
    let keys: Vec<JobKey> = (0..3).map(|_| created(&mut s).0).collect();
    assert_eq!(s.stored_count(), 2);
    let records: Vec<(Job, Option<u64>)> = s
        .jobs()
        .map(|j| (j.clone(), s.stored_payload(j.key)))
        .collect();
    let rebuilt = State::from_stored(P, s.counters().clone(), records, Vec::new());
    assert_eq!(rebuilt.held_bytes(), s.held_bytes());
    assert_eq!(rebuilt.stored_count(), 2);

    let whole: Vec<Job> = (0..3)
        .map(|_| {
            let mut t = State::new(P);
            create(&mut t, "t");
            let job = t.jobs().next().cloned();
            job.expect("a job")
        })
        .zip(&keys)
        .map(|(mut j, k)| {
            j.key = *k;
            j
        })
        .collect();
    let mut placed = State::from_parts(P, s.counters().clone(), whole, Vec::new());
    placed.set_payload_budget(3 * one - 1);
    let mut changes = Changes::new();
    placed.place_all(&mut changes);
    assert_eq!(
        changes.payloads.keys().copied().collect::<Vec<_>>(),
        vec![keys[2]]
    );
    assert_eq!(placed.stored_count(), 1);
    assert!(placed.held_bytes() < 3 * one);
    activate(&mut placed, T0 + 1, "t", 3);
}
