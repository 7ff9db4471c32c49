//! Exact-effect tests of every transition and rejection of the engine.

use super::*;
use courier_proto::domain::DEFAULT_TENANT;

pub(super) const P: PartitionId = PartitionId(1);
pub(super) const T0: i64 = 1_000_000;
/// The term of the entries the tests apply, unless they say otherwise.
const TERM: u64 = 3;

pub(crate) fn new_job(t: &str) -> NewJob {
    NewJob {
        job_type: t.to_string(),
        variables: r#"{"a":1,"b":2}"#.to_string(),
        custom_headers: "{}".to_string(),
        retries: 3,
        tenant_id: DEFAULT_TENANT.to_string(),
        process: ProcessContext::default(),
    }
}

pub(super) fn props(t: &str, timeout_ms: i64) -> ActivationProps {
    ActivationProps {
        job_type: t.to_string(),
        worker: "w1".to_string(),
        timeout_ms,
        fetch_variables: vec![],
        tenant_ids: vec![DEFAULT_TENANT.to_string()],
    }
}

fn finished(key: JobKey, lease: u64) -> Effect {
    Effect::Finished {
        key,
        lease: Lease(lease),
    }
}

fn available(t: &str) -> Effect {
    Effect::JobsAvailable {
        job_type: t.to_string(),
        tenant_id: DEFAULT_TENANT.to_string(),
    }
}

/// Applies one client command at `ts`, returning reply, effects and changes.
pub(super) fn run(
    s: &mut State,
    ts: i64,
    c: Command,
) -> (Result<Reply, BrokerError>, Vec<Effect>, Changes) {
    run_log(s, ts, LogCommand::client(c))
}

pub(super) fn run_log(
    s: &mut State,
    ts: i64,
    c: LogCommand,
) -> (Result<Reply, BrokerError>, Vec<Effect>, Changes) {
    run_in(s, TERM, ts, c)
}

/// Applies one command at `ts` in an entry of `term`.
fn run_in(
    s: &mut State,
    term: u64,
    ts: i64,
    c: LogCommand,
) -> (Result<Reply, BrokerError>, Vec<Effect>, Changes) {
    let mut changes = Changes::new();
    let applied = s.apply_batch(
        term,
        &Batch {
            ts,
            commands: vec![c],
            on_flushed: Default::default(),
        },
        &mut changes,
    );
    let reply = applied.replies.into_iter().next().expect("one reply");
    (reply, applied.effects, changes)
}

pub(super) fn create(s: &mut State, t: &str) -> JobKey {
    match run(s, T0, Command::Create(vec![new_job(t)])).0 {
        Ok(Reply::Created(keys)) => keys[0],
        other => panic!("create failed: {other:?}"),
    }
}

pub(super) fn activate(s: &mut State, ts: i64, t: &str, max: u32) -> Vec<ActivatedJob> {
    match run(
        s,
        ts,
        Command::Activate {
            props: props(t, 1000),
            max_jobs: max,
        },
    )
    .0
    {
        Ok(Reply::Activated(jobs)) => jobs,
        other => panic!("activate failed: {other:?}"),
    }
}

fn keys(ks: &[JobKey]) -> Changes {
    Changes {
        jobs: ks.iter().copied().collect(),
        requests: Default::default(),
        payloads: Default::default(),
    }
}

fn status(s: &State, k: JobKey) -> JobStatus {
    s.job(k).expect("job exists").status.clone()
}

#[test]
fn create_assigns_partition_keys_and_announces_the_type() {
    let mut s = State::new(PartitionId(3));
    let (reply, effects, changes) = run(
        &mut s,
        T0,
        Command::Create(vec![new_job("a"), new_job("a"), new_job("b")]),
    );
    let k1 = JobKey::new(PartitionId(3), 1);
    let k2 = JobKey::new(PartitionId(3), 2);
    let k3 = JobKey::new(PartitionId(3), 3);
    assert_eq!(reply, Ok(Reply::Created(vec![k1, k2, k3])));
    // De-duplicated per entry, in order of first occurrence.
    assert_eq!(effects, vec![available("a"), available("b")]);
    assert_eq!(changes, keys(&[k1, k2, k3]));
    assert_eq!(status(&s, k1), JobStatus::Activatable { seq: 1 });
    assert_eq!(s.job(k1).map(|j| j.created_at), Some(T0));
    assert_eq!(s.counters().last_key, 3);
}

fn create_once(id: u128, jobs: usize) -> Command {
    Command::Once {
        request: RequestId(id),
        command: Box::new(Command::Create(vec![new_job("a"); jobs])),
    }
}

fn requests(ids: &[u128]) -> BTreeSet<RequestId> {
    ids.iter().map(|i| RequestId(*i)).collect()
}

#[test]
fn a_create_sent_again_with_its_request_id_answers_the_first_keys_and_changes_nothing() {
    let mut s = State::new(P);
    let (reply, effects, changes) = run(&mut s, T0, create_once(7, 2));
    let (k1, k2) = (JobKey::new(P, 1), JobKey::new(P, 2));
    assert_eq!(reply, Ok(Reply::Created(vec![k1, k2])));
    assert_eq!(effects, vec![available("a")]);
    assert_eq!(changes.jobs, keys(&[k1, k2]).jobs);
    assert_eq!(changes.requests, requests(&[7]));
    assert_eq!(
        s.once_record(RequestId(7)),
        Some(&OnceRecord {
            ts: T0,
            outcome: Outcome::Created { first: 1, count: 2 }
        })
    );

    // Sent again after one of its jobs is gone, with a stream to push to:
    // nothing is created, activated, pushed or stored.
    let (reply, _, _) = run(&mut s, T0 + 1, Command::Cancel { key: k1 });
    assert_eq!(reply, Ok(Reply::Done));
    let again = LogCommand::Client {
        cmd: create_once(7, 2),
        push: vec![target("a", 5)],
        via: None,
    };
    let (reply, effects, changes) = run_log(&mut s, T0 + 2_000, again);
    assert_eq!(reply, Ok(Reply::Created(vec![k1, k2])), "the same keys");
    assert!(effects.is_empty(), "{effects:?}");
    assert!(changes.is_empty(), "{changes:?}");
    assert_eq!(s.job_count(), 1, "no job made again");
    assert_eq!(s.counters().last_key, 2);
    assert_eq!(status(&s, k2), JobStatus::Activatable { seq: 2 });

    // Another request id creates; the entry counts the one sent again.
    let mut changes = Changes::new();
    let applied = s.apply_batch(
        TERM,
        &Batch {
            ts: T0 + 3_000,
            commands: vec![
                LogCommand::client(create_once(8, 1)),
                LogCommand::client(create_once(7, 2)),
            ],
            on_flushed: Default::default(),
        },
        &mut changes,
    );
    assert_eq!(
        applied.replies,
        vec![
            Ok(Reply::Created(vec![JobKey::new(P, 3)])),
            Ok(Reply::Created(vec![k1, k2]))
        ]
    );
    assert_eq!(applied.repeated, 1);
    assert_eq!(changes.requests, requests(&[8]));
}

#[test]
fn creates_are_remembered_for_the_window_then_forgotten_by_entry_time() {
    let mut s = State::new(P);
    assert!(run(&mut s, T0, create_once(1, 1)).0.is_ok());
    assert!(run(&mut s, T0 + 10, create_once(2, 1)).0.is_ok());
    // The last moment the first is remembered: an entry of T0 + window.
    let (reply, _, changes) = run(&mut s, T0 + ONCE_WINDOW_MS, create_once(1, 1));
    assert_eq!(reply, Ok(Reply::Created(vec![JobKey::new(P, 1)])));
    assert!(changes.is_empty());
    // One ms later it is forgotten (and the change says so), the second is not.
    let (reply, _, changes) = run(
        &mut s,
        T0 + ONCE_WINDOW_MS + 1,
        Command::Cancel {
            key: JobKey::new(P, 2),
        },
    );
    assert_eq!(reply, Ok(Reply::Done));
    assert_eq!(changes.requests, requests(&[1]));
    assert_eq!(s.once_record(RequestId(1)), None);
    assert!(s.once_record(RequestId(2)).is_some());
    // Sent after the window, the first would be created again: the gateway never
    // sends one that late.
    let (reply, _, _) = run(&mut s, T0 + ONCE_WINDOW_MS + 2, create_once(1, 1));
    assert_eq!(reply, Ok(Reply::Created(vec![JobKey::new(P, 3)])));
    assert_eq!(s.onces().count(), 2);
}

#[test]
fn a_state_rebuilt_with_its_creates_answers_a_create_sent_again_alike() {
    let mut s = State::new(P);
    assert!(run(&mut s, T0, create_once(5, 3)).0.is_ok());
    assert!(run(&mut s, T0 + 50, create_once(6, 1)).0.is_ok());
    let mut rebuilt = State::from_parts(P, s.counters().clone(), s.jobs().cloned(), s.onces());
    for state in [&mut s, &mut rebuilt] {
        let (reply, _, changes) = run(&mut *state, T0 + ONCE_WINDOW_MS + 10, create_once(5, 3));
        // Forgotten on both by the same entry, so both create it anew.
        assert_eq!(
            reply,
            Ok(Reply::Created((5..=7).map(|c| JobKey::new(P, c)).collect()))
        );
        assert_eq!(changes.requests, requests(&[5]));
        let (reply, _, _) = run(&mut *state, T0 + ONCE_WINDOW_MS + 20, create_once(6, 1));
        assert_eq!(reply, Ok(Reply::Created(vec![JobKey::new(P, 4)])));
    }
    assert_eq!(
        s.onces().collect::<Vec<_>>(),
        rebuilt.onces().collect::<Vec<_>>()
    );
}

#[test]
fn activate_takes_oldest_first_with_deadline_lease_and_filtered_variables() {
    let mut s = State::new(P);
    let k1 = create(&mut s, "a");
    let k2 = create(&mut s, "a");
    let _other = create(&mut s, "b");
    let mut p = props("a", 5000);
    p.fetch_variables = vec!["b".to_string()];
    let (reply, effects, changes) = run(
        &mut s,
        T0 + 10,
        Command::Activate {
            props: p,
            max_jobs: 1,
        },
    );
    let Ok(Reply::Activated(jobs)) = reply else {
        panic!("{reply:?}")
    };
    assert_eq!(jobs.len(), 1);
    assert_eq!(jobs[0].key, k1);
    assert_eq!(jobs[0].deadline, T0 + 5010);
    assert_eq!(jobs[0].variables, r#"{"b":2}"#);
    assert_eq!(jobs[0].worker, "w1");
    assert_eq!(jobs[0].retries, 3);
    assert!(effects.is_empty());
    assert_eq!(changes, keys(&[k1]));
    assert_eq!(
        status(&s, k1),
        JobStatus::Activated {
            worker: "w1".into(),
            deadline: T0 + 5010,
            lease: Lease(1),
            via: None,
        }
    );
    // Next activation gets the next job with a new lease; the queue is then empty.
    let jobs = activate(&mut s, T0 + 20, "a", 10);
    assert_eq!(jobs.iter().map(|j| j.key).collect::<Vec<_>>(), vec![k2]);
    assert!(matches!(
        status(&s, k2),
        JobStatus::Activated {
            lease: Lease(2),
            ..
        }
    ));
    assert!(activate(&mut s, T0 + 30, "a", 10).is_empty());
    assert_eq!(
        s.next_deadline(),
        Some(T0 + 1020),
        "the second activation (1 s) ends first"
    );
}

/// An activation bounded in bytes takes the oldest jobs while their sizes fit, and
/// leaves the rest activatable for the next; a format-3 `Activate` is unbounded.
#[test]
fn an_activation_takes_only_the_jobs_that_fit_its_bytes_and_leaves_the_rest() {
    let mut s = State::new(P);
    let big = |n: usize| NewJob {
        variables: format!(r#"{{"x":"{}"}}"#, "v".repeat(n)),
        ..new_job("big")
    };
    let (reply, _, _) = run(
        &mut s,
        T0,
        Command::Create(vec![big(1000), big(1000), big(1000), big(10)]),
    );
    let Ok(Reply::Created(ks)) = reply else {
        panic!("{reply:?}")
    };
    let size = |n: usize| {
        activated_size_bound(
            job_text_bytes(
                "big",
                DEFAULT_TENANT,
                &format!(r#"{{"x":"{}"}}"#, "v".repeat(n)),
                "{}",
                &ProcessContext::default(),
            ),
            "w1",
        ) as u64
    };
    let within = |max_bytes| Command::ActivateWithin {
        props: props("big", 1000),
        max_jobs: 10,
        max_bytes,
    };
    // Room for two and a half: two, oldest first; the third would not fit.
    let (reply, effects, changes) = run(&mut s, T0 + 1, within(2 * size(1000) + size(1000) / 2));
    let Ok(Reply::Activated(jobs)) = reply else {
        panic!("{reply:?}")
    };
    assert_eq!(jobs.iter().map(|j| j.key).collect::<Vec<_>>(), ks[..2]);
    assert!(effects.is_empty());
    assert_eq!(changes, keys(&ks[..2]));
    // Less room than the oldest takes: none, though a smaller one waits behind it.
    let (reply, _, changes) = run(&mut s, T0 + 2, within(size(1000) - 1));
    assert_eq!(reply, Ok(Reply::Activated(Vec::new())));
    assert_eq!(changes, Changes::new());
    assert!(matches!(status(&s, ks[2]), JobStatus::Activatable { .. }));
    // Exactly the room of the rest: both.
    let (reply, _, _) = run(&mut s, T0 + 3, within(size(1000) + size(10)));
    let Ok(Reply::Activated(jobs)) = reply else {
        panic!("{reply:?}")
    };
    assert_eq!(jobs.iter().map(|j| j.key).collect::<Vec<_>>(), ks[2..]);

    // As format 3 wrote it, an activation takes every job whatever its size.
    let mut s = State::new(P);
    let (created, _, _) = run(
        &mut s,
        T0,
        Command::Create(vec![big(1000), big(1000), big(1000)]),
    );
    assert!(created.is_ok());
    assert_eq!(activate(&mut s, T0 + 1, "big", 10).len(), 3);
}

#[test]
fn activate_respects_tenants() {
    let mut s = State::new(P);
    let mut j = new_job("a");
    j.tenant_id = "acme".into();
    let (reply, effects, _) = run(&mut s, T0, Command::Create(vec![j]));
    let Ok(Reply::Created(ks)) = reply else {
        panic!()
    };
    assert_eq!(
        effects,
        vec![Effect::JobsAvailable {
            job_type: "a".into(),
            tenant_id: "acme".into()
        }]
    );
    assert!(
        activate(&mut s, T0, "a", 10).is_empty(),
        "default tenant sees nothing"
    );
    let mut p = props("a", 100);
    p.tenant_ids = vec!["acme".into(), DEFAULT_TENANT.into()];
    let (reply, _, _) = run(
        &mut s,
        T0,
        Command::Activate {
            props: p,
            max_jobs: 5,
        },
    );
    assert!(matches!(reply, Ok(Reply::Activated(ref v)) if v.len() == 1 && v[0].key == ks[0]));
}

#[test]
fn complete_removes_the_job_and_twice_is_not_found() {
    let mut s = State::new(P);
    let k = create(&mut s, "a");
    activate(&mut s, T0, "a", 1);
    let c = Command::Complete {
        key: k,
        variables: None,
    };
    let (reply, effects, changes) = run(&mut s, T0, c.clone());
    assert_eq!(reply, Ok(Reply::Done));
    assert_eq!(effects, vec![finished(k, 1)]);
    assert_eq!(changes, keys(&[k]));
    assert!(s.job(k).is_none());
    assert_eq!(s.next_deadline(), None);
    let (reply, _, changes) = run(&mut s, T0, c);
    assert!(matches!(reply, Err(BrokerError::NotFound(ref m)) if m.contains("no such job")));
    assert!(changes.is_empty());
}

#[test]
fn commands_on_a_job_that_is_not_activated_are_failed_preconditions() {
    let mut s = State::new(P);
    let k = create(&mut s, "a");
    for c in [
        Command::Complete {
            key: k,
            variables: None,
        },
        Command::Fail {
            key: k,
            retries: 1,
            error_message: "x".into(),
            retry_backoff_ms: 0,
            variables: None,
        },
        Command::ThrowError {
            key: k,
            error_code: "E".into(),
            error_message: "x".into(),
            variables: None,
        },
        Command::UpdateTimeout {
            key: k,
            timeout_ms: 10,
        },
    ] {
        let (reply, effects, changes) = run(&mut s, T0, c);
        assert!(
            matches!(reply, Err(BrokerError::FailedPrecondition(ref m)) if m.contains("activatable")),
            "{reply:?}"
        );
        assert!(effects.is_empty());
        assert!(changes.is_empty());
    }
    assert_eq!(status(&s, k), JobStatus::Activatable { seq: 1 });
}

#[test]
fn unknown_keys_are_not_found_for_every_command() {
    let mut s = State::new(P);
    let k = JobKey::new(P, 99);
    for c in [
        Command::Complete {
            key: k,
            variables: None,
        },
        Command::Fail {
            key: k,
            retries: 1,
            error_message: String::new(),
            retry_backoff_ms: 0,
            variables: None,
        },
        Command::ThrowError {
            key: k,
            error_code: "E".into(),
            error_message: String::new(),
            variables: None,
        },
        Command::UpdateRetries { key: k, retries: 1 },
        Command::UpdateTimeout {
            key: k,
            timeout_ms: 1,
        },
        Command::Cancel { key: k },
    ] {
        let (reply, effects, changes) = run(&mut s, T0, c);
        assert!(matches!(reply, Err(BrokerError::NotFound(_))), "{reply:?}");
        assert!(effects.is_empty() && changes.is_empty());
    }
}

#[test]
fn fail_with_retries_and_no_backoff_is_runnable_at_once() {
    let mut s = State::new(P);
    let k = create(&mut s, "a");
    activate(&mut s, T0, "a", 1);
    let (reply, effects, changes) = run(
        &mut s,
        T0 + 5,
        Command::Fail {
            key: k,
            retries: 2,
            error_message: "boom".into(),
            retry_backoff_ms: 0,
            variables: Some(r#"{"b":9,"c":3}"#.into()),
        },
    );
    assert_eq!(reply, Ok(Reply::Done));
    assert_eq!(effects, vec![finished(k, 1), available("a")]);
    assert_eq!(changes, keys(&[k]));
    let j = s.job(k).expect("job");
    assert_eq!(j.retries, 2);
    assert_eq!(j.error_message, "boom");
    assert_eq!(j.variables, r#"{"a":1,"b":9,"c":3}"#);
    assert_eq!(j.status, JobStatus::Activatable { seq: 2 });
    assert_eq!(s.next_deadline(), None);
    assert_eq!(activate(&mut s, T0 + 6, "a", 1)[0].retries, 2);
}

fn once(id: u128, command: Command) -> Command {
    Command::Once {
        request: RequestId(id),
        command: Box::new(command),
    }
}

fn fail(key: JobKey, retries: i32) -> Command {
    Command::Fail {
        key,
        retries,
        error_message: "boom".into(),
        retry_backoff_ms: 0,
        variables: None,
    }
}

/// What the jobs weigh follows every change of their text: creates add, a fail or
/// a thrown error with variables and a message reweighs, an end removes; a state
/// rebuilt from the same jobs weighs the same.
#[test]
fn the_weight_of_the_jobs_follows_creates_fails_errors_and_ends() {
    let mut s = State::new(P);
    let weight = |j: &NewJob, error: &str| {
        (job_text_bytes(
            &j.job_type,
            &j.tenant_id,
            &j.variables,
            &j.custom_headers,
            &j.process,
        ) + error.len()) as u64
            + JOB_OVERHEAD_BYTES
    };
    let job = new_job("w");
    let (a, b, c) = (
        create(&mut s, "w"),
        create(&mut s, "w"),
        create(&mut s, "w"),
    );
    assert_eq!(s.held_bytes(), 3 * weight(&job, ""));
    activate(&mut s, T0, "w", 3);
    let merged = NewJob {
        variables: r#"{"a":1,"b":2,"c":"more"}"#.into(),
        ..new_job("w")
    };
    let (r, _, _) = run(
        &mut s,
        T0 + 1,
        Command::Fail {
            key: a,
            retries: 2,
            error_message: "boom".into(),
            retry_backoff_ms: 0,
            variables: Some(r#"{"c":"more"}"#.into()),
        },
    );
    assert_eq!(r, Ok(Reply::Done));
    assert_eq!(
        s.held_bytes(),
        weight(&merged, "boom") + 2 * weight(&job, "")
    );
    let (r, _, _) = run(
        &mut s,
        T0 + 2,
        Command::ThrowError {
            key: b,
            error_code: "E1".into(),
            error_message: "bad".into(),
            variables: None,
        },
    );
    assert_eq!(r, Ok(Reply::Done));
    let after_error = weight(&merged, "boom") + weight(&job, "E1bad") + weight(&job, "");
    assert_eq!(s.held_bytes(), after_error);
    let rebuilt = State::from_parts(P, s.counters().clone(), s.jobs().cloned(), Vec::new());
    assert_eq!(rebuilt.held_bytes(), after_error);
    let (r, _, _) = run(
        &mut s,
        T0 + 3,
        Command::Complete {
            key: c,
            variables: None,
        },
    );
    assert_eq!(r, Ok(Reply::Done));
    let (r, _, _) = run(&mut s, T0 + 4, Command::Cancel { key: a });
    assert_eq!(r, Ok(Reply::Done));
    let (r, _, _) = run(&mut s, T0 + 5, Command::Cancel { key: b });
    assert_eq!(r, Ok(Reply::Done));
    assert_eq!(s.held_bytes(), 0);
}

/// A fail sent again after its first attempt was applied, and the job pushed to
/// another worker at once, is answered as done and leaves that activation alone.
#[test]
fn a_fail_sent_again_leaves_the_jobs_next_activation_alone() {
    let mut s = State::new(P);
    let k = create(&mut s, "a");
    activate(&mut s, T0, "a", 1);
    let first = with_push(once(4, fail(k, 2)), vec![target("a", 1)]);
    let (reply, effects, changes) = run_log(&mut s, T0 + 5, first.clone());
    assert_eq!(reply, Ok(Reply::Done));
    assert_eq!(pushes(&effects), vec![(k, 2)], "pushed again at once");
    assert_eq!(changes.requests, requests(&[4]));
    assert_eq!(
        s.once_record(RequestId(4)).map(|r| r.outcome.clone()),
        Some(Outcome::Done)
    );

    let (reply, effects, changes) = run_log(&mut s, T0 + 9, first);
    assert_eq!(reply, Ok(Reply::Done));
    assert!(effects.is_empty() && changes.is_empty());
    let j = s.job(k).expect("job");
    assert_eq!(j.retries, 2, "failed once");
    assert!(
        matches!(
            j.status,
            JobStatus::Activated {
                lease: Lease(2),
                ..
            }
        ),
        "{:?}",
        j.status
    );

    // Without the id, the same fail would have failed the new activation.
    let (reply, _, _) = run(&mut s, T0 + 9, fail(k, 1));
    assert_eq!(reply, Ok(Reply::Done));
}

/// An activation sent again after its first attempt was applied is answered with
/// the jobs that attempt activated, as far as it still holds them, and activates
/// nothing more.
#[test]
fn an_activation_sent_again_gives_the_jobs_it_still_holds() {
    let mut s = State::new(P);
    let (k1, k2, k3) = (
        create(&mut s, "a"),
        create(&mut s, "a"),
        create(&mut s, "a"),
    );
    let mut p = props("a", 5_000);
    p.fetch_variables = vec!["b".into()];
    let poll = once(
        9,
        Command::Activate {
            props: p,
            max_jobs: 2,
        },
    );
    let (reply, _, changes) = run(&mut s, T0, poll.clone());
    let Ok(Reply::Activated(first)) = reply else {
        panic!("{reply:?}")
    };
    assert_eq!(
        first.iter().map(|j| j.key).collect::<Vec<_>>(),
        vec![k1, k2]
    );
    assert_eq!(changes.requests, requests(&[9]));
    assert_eq!(
        s.once_record(RequestId(9)).map(|r| r.outcome.clone()),
        Some(Outcome::Activated {
            jobs: vec![(k1, Lease(1)), (k2, Lease(2))]
        })
    );

    // Sent again: the same jobs, exactly as first given, and nothing else.
    let (reply, effects, changes) = run(&mut s, T0 + 100, poll.clone());
    assert_eq!(reply, Ok(Reply::Activated(first.clone())));
    assert!(effects.is_empty() && changes.is_empty());
    assert_eq!(status(&s, k3), JobStatus::Activatable { seq: 3 });

    // k1 completed, k2 timed out and activated again by another poll: neither
    // is the first attempt's to give any more.
    let complete = Command::Complete {
        key: k1,
        variables: None,
    };
    assert_eq!(run(&mut s, T0 + 200, complete).0, Ok(Reply::Done));
    let (reply, _, _) = run(&mut s, T0 + 300, poll.clone());
    assert_eq!(reply, Ok(Reply::Activated(vec![first[1].clone()])));
    let timeout = LogCommand::TimeOut {
        keys: vec![k2],
        push: vec![],
    };
    assert_eq!(run_log(&mut s, T0 + 5_000, timeout).0, Ok(Reply::Done));
    let again: Vec<JobKey> = activate(&mut s, T0 + 5_001, "a", 2)
        .iter()
        .map(|j| j.key)
        .collect();
    assert_eq!(again, vec![k3, k2]);
    assert_eq!(
        run(&mut s, T0 + 5_002, poll).0,
        Ok(Reply::Activated(vec![]))
    );
}

/// A thrown error sent again is answered as done, where the plain command would be
/// refused (the job is no longer activated); a first attempt that was refused is
/// not remembered, and a cancel is not carried out once.
#[test]
fn a_thrown_error_sent_again_is_done_and_refusals_are_not_remembered() {
    let mut s = State::new(P);
    let k = create(&mut s, "a");
    let throw = once(
        5,
        Command::ThrowError {
            key: k,
            error_code: "E".into(),
            error_message: "no".into(),
            variables: None,
        },
    );
    let (reply, _, changes) = run(&mut s, T0, throw.clone());
    assert!(
        matches!(reply, Err(BrokerError::FailedPrecondition(_))),
        "{reply:?}"
    );
    assert!(changes.is_empty(), "a refusal is not remembered");
    activate(&mut s, T0, "a", 1);
    assert_eq!(run(&mut s, T0 + 1, throw.clone()).0, Ok(Reply::Done));
    assert_eq!(run(&mut s, T0 + 2, throw).0, Ok(Reply::Done));
    assert_eq!(status(&s, k), JobStatus::ErrorThrown);

    let (reply, _, changes) = run(&mut s, T0 + 3, once(6, Command::Cancel { key: k }));
    assert!(
        matches!(reply, Err(BrokerError::InvalidArgument(_))),
        "{reply:?}"
    );
    assert!(changes.is_empty());
    assert!(s.job(k).is_some());
}

#[test]
fn fail_or_thrown_error_whose_variables_would_make_the_job_too_large_is_refused_and_changes_nothing(
) {
    let big = format!("{{\"big\":\"{}\"}}", "x".repeat(MAX_JOB_BYTES));
    let commands = [
        |key, variables| Command::Fail {
            key,
            retries: 2,
            error_message: "boom".into(),
            retry_backoff_ms: 0,
            variables,
        },
        |key, variables| Command::ThrowError {
            key,
            error_code: "E".into(),
            error_message: "boom".into(),
            variables,
        },
    ];
    for command in commands {
        let mut s = State::new(P);
        let k = create(&mut s, "a");
        activate(&mut s, T0, "a", 1);
        let (reply, effects, changes) = run(&mut s, T0 + 5, command(k, Some(big.clone())));
        assert!(
            matches!(&reply, Err(BrokerError::InvalidArgument(m)) if m.contains("4 MiB")),
            "{reply:?}"
        );
        assert!(effects.is_empty() && changes.is_empty());
        let j = s.job(k).expect("job");
        assert!(
            matches!(j.status, JobStatus::Activated { .. }),
            "{:?}",
            j.status
        );
        assert_eq!(
            (j.error_message.as_str(), j.variables.as_str()),
            ("", r#"{"a":1,"b":2}"#)
        );
    }
}

#[test]
fn fail_with_backoff_waits_then_recur_makes_it_runnable() {
    let mut s = State::new(P);
    let k = create(&mut s, "a");
    activate(&mut s, T0, "a", 1);
    let (reply, effects, _) = run(
        &mut s,
        T0 + 5,
        Command::Fail {
            key: k,
            retries: 1,
            error_message: "later".into(),
            retry_backoff_ms: 100,
            variables: None,
        },
    );
    assert_eq!(reply, Ok(Reply::Done));
    assert_eq!(effects, vec![finished(k, 1)]);
    assert_eq!(status(&s, k), JobStatus::BackOff { retry_at: T0 + 105 });
    assert_eq!(s.next_retry(), Some(T0 + 105));
    assert!(activate(&mut s, T0 + 6, "a", 1).is_empty());
    assert_eq!(s.due_retries(T0 + 104, 10), vec![]);
    assert_eq!(s.due_retries(T0 + 105, 10), vec![k]);
    // A Recur applied before its time (a stale timer) is a no-op.
    let (_, effects, changes) = run_log(
        &mut s,
        T0 + 50,
        LogCommand::Recur {
            keys: vec![k],
            push: vec![],
        },
    );
    assert!(effects.is_empty() && changes.is_empty());
    let (reply, effects, changes) = run_log(
        &mut s,
        T0 + 105,
        LogCommand::Recur {
            keys: vec![k],
            push: vec![],
        },
    );
    assert_eq!(reply, Ok(Reply::Done));
    assert_eq!(effects, vec![available("a")]);
    assert_eq!(changes, keys(&[k]));
    assert!(matches!(status(&s, k), JobStatus::Activatable { .. }));
    assert_eq!(s.next_retry(), None);
}

#[test]
fn fail_without_retries_is_an_incident_until_retries_are_updated() {
    let mut s = State::new(P);
    let k = create(&mut s, "a");
    activate(&mut s, T0, "a", 1);
    let (reply, effects, _) = run(
        &mut s,
        T0,
        Command::Fail {
            key: k,
            retries: 0,
            error_message: "dead".into(),
            retry_backoff_ms: 500,
            variables: None,
        },
    );
    assert_eq!(reply, Ok(Reply::Done));
    assert_eq!(effects, vec![finished(k, 1)]);
    assert_eq!(status(&s, k), JobStatus::Incident);
    assert_eq!(s.view(k).map(|v| v.state), Some(JobStateKind::Incident));
    assert!(activate(&mut s, T0, "a", 1).is_empty());

    let (reply, _, _) = run(&mut s, T0, Command::UpdateRetries { key: k, retries: 0 });
    assert!(matches!(reply, Err(BrokerError::InvalidArgument(_))));
    let (reply, effects, changes) = run(&mut s, T0, Command::UpdateRetries { key: k, retries: 2 });
    assert_eq!(reply, Ok(Reply::Done));
    assert_eq!(effects, vec![available("a")]);
    assert_eq!(changes, keys(&[k]));
    assert_eq!(s.job(k).map(|j| j.retries), Some(2));
    assert_eq!(activate(&mut s, T0, "a", 1)[0].key, k);
}

#[test]
fn update_retries_of_a_runnable_job_only_sets_retries() {
    let mut s = State::new(P);
    let k = create(&mut s, "a");
    let (reply, effects, changes) = run(&mut s, T0, Command::UpdateRetries { key: k, retries: 7 });
    assert_eq!(reply, Ok(Reply::Done));
    assert!(effects.is_empty());
    assert_eq!(changes, keys(&[k]));
    assert_eq!(s.job(k).map(|j| j.retries), Some(7));
    assert_eq!(status(&s, k), JobStatus::Activatable { seq: 1 });
}

#[test]
fn activation_timeout_makes_the_job_runnable_again() {
    let mut s = State::new(P);
    let k = create(&mut s, "a");
    activate(&mut s, T0, "a", 1); // deadline T0 + 1000
    assert_eq!(s.due_deadlines(T0 + 999, 10), vec![]);
    assert_eq!(s.due_deadlines(T0 + 1000, 10), vec![k]);
    let (_, effects, changes) = run_log(
        &mut s,
        T0 + 999,
        LogCommand::TimeOut {
            keys: vec![k],
            push: vec![],
        },
    );
    assert!(effects.is_empty() && changes.is_empty(), "not yet due");
    let (reply, effects, changes) = run_log(
        &mut s,
        T0 + 1000,
        LogCommand::TimeOut {
            keys: vec![k],
            push: vec![],
        },
    );
    assert_eq!(reply, Ok(Reply::Done));
    assert_eq!(effects, vec![finished(k, 1), available("a")]);
    assert_eq!(changes, keys(&[k]));
    assert_eq!(
        s.job(k).map(|j| j.retries),
        Some(3),
        "a timeout costs no retry"
    );
    let again = activate(&mut s, T0 + 1001, "a", 1);
    assert_eq!(again[0].key, k);
    assert!(matches!(
        status(&s, k),
        JobStatus::Activated {
            lease: Lease(2),
            ..
        }
    ));
}

#[test]
fn update_timeout_moves_the_deadline_from_now() {
    let mut s = State::new(P);
    let k = create(&mut s, "a");
    activate(&mut s, T0, "a", 1);
    let (reply, effects, changes) = run(
        &mut s,
        T0 + 500,
        Command::UpdateTimeout {
            key: k,
            timeout_ms: 10_000,
        },
    );
    assert_eq!(reply, Ok(Reply::Done));
    assert!(effects.is_empty());
    assert_eq!(changes, keys(&[k]));
    assert_eq!(s.next_deadline(), Some(T0 + 10_500));
    assert_eq!(s.due_deadlines(T0 + 1000, 10), vec![]);
    // The old deadline no longer times the job out.
    let (_, _, changes) = run_log(
        &mut s,
        T0 + 1000,
        LogCommand::TimeOut {
            keys: vec![k],
            push: vec![],
        },
    );
    assert!(changes.is_empty());
}

#[test]
fn throw_error_is_terminal_and_keeps_code_and_message() {
    let mut s = State::new(P);
    let k = create(&mut s, "a");
    activate(&mut s, T0, "a", 1);
    let (reply, effects, changes) = run(
        &mut s,
        T0,
        Command::ThrowError {
            key: k,
            error_code: "NO_STOCK".into(),
            error_message: "out of stock".into(),
            variables: None,
        },
    );
    assert_eq!(reply, Ok(Reply::Done));
    assert_eq!(effects, vec![finished(k, 1)]);
    assert_eq!(changes, keys(&[k]));
    let v = s.view(k).expect("kept");
    assert_eq!(v.state, JobStateKind::ErrorThrown);
    assert_eq!(v.error_code, "NO_STOCK");
    assert_eq!(v.error_message, "out of stock");
    assert_eq!(s.next_deadline(), None);
    let (reply, _, _) = run(
        &mut s,
        T0,
        Command::Complete {
            key: k,
            variables: None,
        },
    );
    assert!(
        matches!(reply, Err(BrokerError::FailedPrecondition(ref m)) if m.contains("error was thrown"))
    );
    let (reply, _, _) = run(&mut s, T0, Command::UpdateRetries { key: k, retries: 1 });
    assert!(matches!(reply, Err(BrokerError::FailedPrecondition(_))));
}

#[test]
fn cancel_removes_a_job_in_any_state() {
    let mut s = State::new(P);
    let a = create(&mut s, "a");
    let b = create(&mut s, "a");
    activate(&mut s, T0, "a", 1); // a is activated, b activatable
    for (k, ended) in [(a, vec![finished(a, 1)]), (b, vec![])] {
        let (reply, effects, changes) = run(&mut s, T0, Command::Cancel { key: k });
        assert_eq!(reply, Ok(Reply::Done));
        assert_eq!(effects, ended, "only an activated job's activation ends");
        assert_eq!(changes, keys(&[k]));
        assert!(s.job(k).is_none());
    }
    assert_eq!(s.next_deadline(), None);
    assert!(s.activatable_types().is_empty());
    let (reply, _, _) = run(
        &mut s,
        T0,
        Command::Complete {
            key: a,
            variables: None,
        },
    );
    assert!(matches!(reply, Err(BrokerError::NotFound(_))));
}

#[test]
fn a_batch_answers_each_command_in_order_and_rejections_change_nothing() {
    let mut s = State::new(P);
    let mut changes = Changes::new();
    let missing = JobKey::new(P, 77);
    let applied = s.apply_batch(
        TERM,
        &Batch {
            ts: T0,
            commands: vec![
                LogCommand::client(Command::Create(vec![new_job("a")])),
                LogCommand::client(Command::Cancel { key: missing }),
                LogCommand::client(Command::Activate {
                    props: props("a", 10),
                    max_jobs: 5,
                }),
            ],
            on_flushed: Default::default(),
        },
        &mut changes,
    );
    let k = JobKey::new(P, 1);
    assert_eq!(applied.replies.len(), 3);
    assert_eq!(applied.replies[0], Ok(Reply::Created(vec![k])));
    assert!(matches!(applied.replies[1], Err(BrokerError::NotFound(_))));
    assert!(matches!(applied.replies[2], Ok(Reply::Activated(ref v)) if v.len() == 1));
    assert_eq!(applied.effects, vec![available("a")]);
    assert_eq!(changes, keys(&[k]));
}

#[test]
fn state_rebuilt_from_its_jobs_has_the_same_indexes() {
    let mut s = State::new(P);
    let a = create(&mut s, "a");
    let _b = create(&mut s, "a");
    let c = create(&mut s, "a");
    activate(&mut s, T0, "a", 1); // a activated
    assert_eq!(
        run(&mut s, T0, Command::Cancel { key: c }).0,
        Ok(Reply::Done)
    );
    let rebuilt = State::from_parts(P, s.counters().clone(), s.jobs().cloned(), s.onces());
    assert_eq!(rebuilt.next_deadline(), s.next_deadline());
    assert_eq!(rebuilt.activatable_types(), s.activatable_types());
    assert_eq!(rebuilt.due_deadlines(i64::MAX, 10), vec![a]);
    let mut s2 = rebuilt;
    assert_eq!(
        activate(&mut s2, T0, "a", 5),
        activate(&mut s, T0, "a", 5),
        "both replicas activate the same jobs with the same leases"
    );
}

// ---- Job push: inline activation at every runnable moment, leased yields, back-fill.

fn target(t: &str, max: u32) -> PushTarget {
    let mut p = props(t, 30_000);
    p.worker = "streamer".into();
    PushTarget {
        props: p,
        recipient: Recipient {
            link: LinkId(7),
            stream_id: StreamId(3),
        },
        max,
        gateway: "gw-a".into(),
    }
}

fn with_push(cmd: Command, push: Vec<PushTarget>) -> LogCommand {
    LogCommand::Client {
        cmd,
        push,
        via: None,
    }
}

fn pushes(effects: &[Effect]) -> Vec<(JobKey, u64)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Push(p) => Some((p.job.key, p.lease.0)),
            Effect::JobsAvailable { .. } | Effect::Finished { .. } => None,
        })
        .collect()
}

#[test]
fn create_with_a_stream_activates_and_pushes_in_the_same_entry() {
    let mut s = State::new(P);
    let (reply, effects, changes) = run_log(
        &mut s,
        T0,
        with_push(Command::Create(vec![new_job("a")]), vec![target("a", 10)]),
    );
    let k = JobKey::new(P, 1);
    assert_eq!(reply, Ok(Reply::Created(vec![k])));
    assert_eq!(changes, keys(&[k]));
    let expected_job = ActivatedJob {
        key: k,
        job_type: "a".into(),
        worker: "streamer".into(),
        retries: 3,
        deadline: T0 + 30_000,
        variables: r#"{"a":1,"b":2}"#.into(),
        custom_headers: "{}".into(),
        tenant_id: DEFAULT_TENANT.into(),
        process: ProcessContext::default(),
    };
    assert_eq!(
        effects,
        vec![Effect::Push(Box::new(Push {
            target: target("a", 10),
            lease: Lease(1),
            job: expected_job,
            origin: PushOrigin::Created,
        }))],
        "pushed, and no jobs-available notice"
    );
    assert_eq!(
        status(&s, k),
        JobStatus::Activated {
            worker: "streamer".into(),
            deadline: T0 + 30_000,
            lease: Lease(1),
            via: Some(Via {
                gateway: "gw-a".into(),
                term: TERM,
                pushed: true,
            }),
        }
    );
    assert!(
        activate(&mut s, T0, "a", 10).is_empty(),
        "not also pollable"
    );
}

#[test]
fn a_target_takes_only_its_type_tenant_and_budget() {
    let mut s = State::new(P);
    let mut other_tenant = new_job("a");
    other_tenant.tenant_id = "acme".into();
    let (_, effects, _) = run_log(
        &mut s,
        T0,
        with_push(
            Command::Create(vec![
                new_job("a"),
                new_job("a"),
                new_job("a"),
                new_job("b"),
                other_tenant,
            ]),
            vec![target("a", 2)],
        ),
    );
    let k = |n| JobKey::new(P, n);
    assert_eq!(pushes(&effects), vec![(k(1), 1), (k(2), 2)]);
    assert_eq!(
        effects
            .iter()
            .filter(|e| matches!(e, Effect::JobsAvailable { .. }))
            .cloned()
            .collect::<Vec<_>>(),
        vec![
            available("a"),
            available("b"),
            Effect::JobsAvailable {
                job_type: "a".into(),
                tenant_id: "acme".into()
            }
        ]
    );
    assert!(matches!(status(&s, k(3)), JobStatus::Activatable { .. }));
}

#[test]
fn fetch_variables_filter_pushed_jobs() {
    let mut s = State::new(P);
    let mut t = target("a", 1);
    t.props.fetch_variables = vec!["a".into()];
    let (_, effects, _) = run_log(
        &mut s,
        T0,
        with_push(Command::Create(vec![new_job("a")]), vec![t]),
    );
    let Some(Effect::Push(p)) = effects.first() else {
        panic!("{effects:?}")
    };
    assert_eq!(p.job.variables, r#"{"a":1}"#);
}

#[test]
fn fail_without_backoff_pushes_again_at_once_but_with_backoff_waits() {
    let mut s = State::new(P);
    let k = create(&mut s, "a");
    activate(&mut s, T0, "a", 1);
    let fail = |backoff| Command::Fail {
        key: k,
        retries: 2,
        error_message: "x".into(),
        retry_backoff_ms: backoff,
        variables: None,
    };
    let (_, effects, _) = run_log(&mut s, T0 + 1, with_push(fail(0), vec![target("a", 1)]));
    assert_eq!(pushes(&effects), vec![(k, 2)]);

    let (_, effects, _) = run_log(&mut s, T0 + 2, with_push(fail(100), vec![target("a", 1)]));
    assert_eq!(
        effects,
        vec![finished(k, 2)],
        "in back-off: the activation ends; neither pushed nor announced"
    );
    let (_, effects, _) = run_log(
        &mut s,
        T0 + 102,
        LogCommand::Recur {
            keys: vec![k],
            push: vec![target("a", 1)],
        },
    );
    assert_eq!(
        pushes(&effects),
        vec![(k, 3)],
        "pushed when the back-off elapsed"
    );
}

#[test]
fn a_timed_out_activation_is_pushed_with_a_new_lease() {
    let mut s = State::new(P);
    let k = create(&mut s, "a");
    activate(&mut s, T0, "a", 1); // lease 1, deadline T0 + 1000
    let (_, effects, _) = run_log(
        &mut s,
        T0 + 1000,
        LogCommand::TimeOut {
            keys: vec![k],
            push: vec![target("a", 5)],
        },
    );
    assert_eq!(pushes(&effects), vec![(k, 2)]);
    assert!(
        matches!(status(&s, k), JobStatus::Activated { lease: Lease(2), deadline, .. } if deadline == T0 + 31_000)
    );
}

#[test]
fn updating_the_retries_of_an_incident_pushes_it() {
    let mut s = State::new(P);
    let k = create(&mut s, "a");
    activate(&mut s, T0, "a", 1);
    assert!(run(
        &mut s,
        T0,
        Command::Fail {
            key: k,
            retries: 0,
            error_message: "x".into(),
            retry_backoff_ms: 0,
            variables: None,
        },
    )
    .0
    .is_ok());
    let (_, effects, _) = run_log(
        &mut s,
        T0,
        with_push(
            Command::UpdateRetries { key: k, retries: 1 },
            vec![target("a", 1)],
        ),
    );
    assert_eq!(pushes(&effects), vec![(k, 2)]);
}

#[test]
fn a_later_leader_learns_which_activations_earlier_leaders_pushed_and_where() {
    let mut s = State::new(P);
    let create = |s: &mut State, term: u64, push: Vec<PushTarget>| {
        let (reply, _, _) = run_in(
            s,
            term,
            T0,
            with_push(Command::Create(vec![new_job("a")]), push),
        );
        match reply {
            Ok(Reply::Created(k)) => k[0],
            other => panic!("created: {other:?}"),
        }
    };
    // Pushed in term 3 (lease 1), polled in term 3 (lease 2), pushed in term 5
    // through another gateway (lease 3), back-filled in term 5 (lease 4).
    let a = create(&mut s, 3, vec![target("a", 1)]);
    let polled = create(&mut s, 3, vec![]);
    activate(&mut s, T0, "a", 1);
    let mut elsewhere = target("a", 1);
    elsewhere.gateway = "gw-b".into();
    let c = create(&mut s, 5, vec![elsewhere]);
    let d = create(&mut s, 5, vec![]);
    let (_, effects, _) = run_in(
        &mut s,
        5,
        T0,
        LogCommand::Backfill {
            target: target("a", 5),
        },
    );
    assert_eq!(pushes(&effects), vec![(d, 4)]);
    assert!(matches!(
        status(&s, polled),
        JobStatus::Activated {
            lease: Lease(2),
            via: None,
            ..
        }
    ));
    let listed = |s: &State, term: u64| {
        s.pushed_before(term)
            .into_iter()
            .map(|e| (e.key, e.lease, e.gateway))
            .collect::<BTreeSet<_>>()
    };
    let set = |v: &[(JobKey, u64, &str)]| {
        v.iter()
            .map(|(k, l, g)| (*k, Lease(*l), g.to_string()))
            .collect::<BTreeSet<_>>()
    };
    assert!(
        listed(&s, 3).is_empty(),
        "its own term's pushes are the leader's own"
    );
    assert_eq!(listed(&s, 5), set(&[(a, 1, "gw-a")]));
    assert_eq!(
        listed(&s, 6),
        set(&[(a, 1, "gw-a"), (c, 3, "gw-b"), (d, 4, "gw-a")])
    );
    // An activation that ended is not asked about; a new one is, by its own lease.
    assert!(run_in(
        &mut s,
        6,
        T0 + 1,
        LogCommand::Yield {
            key: a,
            lease: Lease(1)
        }
    )
    .0
    .is_ok());
    assert!(run_in(
        &mut s,
        6,
        T0 + 2,
        LogCommand::client(Command::Cancel { key: c })
    )
    .0
    .is_ok());
    let timeout = LogCommand::TimeOut {
        keys: vec![d],
        push: vec![target("a", 1)],
    };
    assert!(run_in(&mut s, 6, T0 + 30_000, timeout).0.is_ok());
    assert!(matches!(status(&s, a), JobStatus::Activatable { .. }));
    assert_eq!(listed(&s, 7), set(&[(d, 5, "gw-a")]));
    assert!(listed(&s, 6).is_empty());
    // A poll that came through gw-b takes the yielded job: not a push, so no leader
    // asks about it, but it went out through gw-b.
    let poll = LogCommand::Client {
        cmd: Command::Activate {
            props: props("a", 30_000),
            max_jobs: 1,
        },
        push: vec![],
        via: Some("gw-b".into()),
    };
    match run_in(&mut s, 6, T0 + 30_001, poll).0 {
        Ok(Reply::Activated(jobs)) => assert_eq!(jobs[0].key, a),
        other => panic!("activated: {other:?}"),
    }
    assert_eq!(
        status(&s, a),
        JobStatus::Activated {
            worker: "w1".into(),
            deadline: T0 + 60_001,
            lease: Lease(6),
            via: Some(Via {
                gateway: "gw-b".into(),
                term: 6,
                pushed: false,
            }),
        }
    );
    assert_eq!(listed(&s, 7), set(&[(d, 5, "gw-a")]));
    // By gateway, pushed or polled, whatever the term: what a gateway that is gone
    // took with it.
    let through = |g: &str| {
        s.handed_through(|x| x == g)
            .into_iter()
            .map(|e| (e.key, e.lease, e.gateway))
            .collect::<BTreeSet<_>>()
    };
    assert_eq!(through("gw-a"), set(&[(d, 5, "gw-a")]));
    assert_eq!(through("gw-b"), set(&[(a, 6, "gw-b")]), "c was canceled");
}

#[test]
fn a_yield_with_the_current_lease_makes_the_job_pollable_not_pushed() {
    let mut s = State::new(P);
    assert!(run_log(
        &mut s,
        T0,
        with_push(Command::Create(vec![new_job("a")]), vec![target("a", 1)])
    )
    .0
    .is_ok());
    let k = JobKey::new(P, 1);
    let (reply, effects, changes) = run_log(
        &mut s,
        T0 + 5,
        LogCommand::Yield {
            key: k,
            lease: Lease(1),
        },
    );
    assert_eq!(reply, Ok(Reply::Done));
    assert_eq!(effects, vec![finished(k, 1), available("a")]);
    assert_eq!(changes, keys(&[k]));
    assert!(matches!(status(&s, k), JobStatus::Activatable { .. }));
    assert_eq!(s.next_deadline(), None);
    assert_eq!(activate(&mut s, T0 + 6, "a", 1)[0].key, k);
}

#[test]
fn a_stale_yield_is_a_no_op() {
    let mut s = State::new(P);
    assert!(run_log(
        &mut s,
        T0,
        with_push(Command::Create(vec![new_job("a")]), vec![target("a", 1)])
    )
    .0
    .is_ok());
    let k = JobKey::new(P, 1);
    // The push timed out and the job went to a poller: lease 2 now.
    assert!(run_log(
        &mut s,
        T0 + 30_000,
        LogCommand::TimeOut {
            keys: vec![k],
            push: vec![]
        }
    )
    .0
    .is_ok());
    activate(&mut s, T0 + 30_001, "a", 1);
    assert!(matches!(
        status(&s, k),
        JobStatus::Activated {
            lease: Lease(2),
            ..
        }
    ));
    let before = status(&s, k);
    let (reply, effects, changes) = run_log(
        &mut s,
        T0 + 30_002,
        LogCommand::Yield {
            key: k,
            lease: Lease(1),
        },
    );
    assert_eq!(reply, Ok(Reply::Done));
    assert!(effects.is_empty() && changes.is_empty());
    assert_eq!(status(&s, k), before);
    // Yields for completed or unknown jobs are no-ops too.
    assert!(run(
        &mut s,
        T0,
        Command::Complete {
            key: k,
            variables: None
        }
    )
    .0
    .is_ok());
    let (reply, effects, changes) = run_log(
        &mut s,
        T0,
        LogCommand::Yield {
            key: k,
            lease: Lease(2),
        },
    );
    assert_eq!(reply, Ok(Reply::Done));
    assert!(effects.is_empty() && changes.is_empty());
}

#[test]
fn backfill_pushes_the_oldest_backlog_up_to_its_bound() {
    let mut s = State::new(P);
    let a = create(&mut s, "a");
    let b = create(&mut s, "a");
    let c = create(&mut s, "a");
    create(&mut s, "b");
    assert_eq!(s.queued("a", DEFAULT_TENANT), 3);
    let (reply, effects, changes) = run_log(
        &mut s,
        T0 + 9,
        LogCommand::Backfill {
            target: target("a", 2),
        },
    );
    assert_eq!(reply, Ok(Reply::Done));
    assert_eq!(pushes(&effects), vec![(a, 1), (b, 2)]);
    assert!(effects
        .iter()
        .all(|e| matches!(e, Effect::Push(p) if p.origin == PushOrigin::Backfill && p.job.deadline == T0 + 30_009)));
    assert_eq!(changes, keys(&[a, b]));
    let (_, effects, _) = run_log(
        &mut s,
        T0 + 9,
        LogCommand::Backfill {
            target: target("a", 2),
        },
    );
    assert_eq!(pushes(&effects), vec![(c, 3)]);
    assert_eq!(s.queued("a", DEFAULT_TENANT), 0);
}

/// The proposer's flush signal rides in memory only: an entry with one is written
/// exactly as one without, and reads back without it.
#[test]
fn a_flush_signal_is_not_part_of_the_entry() {
    let signal = FlushSignal::new(|| {});
    let commands = vec![LogCommand::client(Command::Create(vec![new_job("a")]))];
    let with = Batch {
        ts: T0,
        commands: commands.clone(),
        on_flushed: signal,
    };
    let without = Batch {
        ts: T0,
        commands,
        on_flushed: FlushSignal::default(),
    };
    let bytes = courier_proto::codec::to_vec(&with).unwrap();
    assert_eq!(bytes, courier_proto::codec::to_vec(&without).unwrap());
    let read: Batch = courier_proto::codec::decode(&bytes).unwrap();
    assert!(!read.on_flushed.is_set());
    assert_eq!(read, with);
}

/// Firing reaches the proposer once; dropping an unfired signal (the entry never
/// reached the log) reaches it too, so it never waits forever.
#[test]
fn a_flush_signal_fires_once_or_on_drop() {
    use std::sync::atomic::{AtomicU32, Ordering};
    let fired = Arc::new(AtomicU32::new(0));
    let counting = || {
        let fired = fired.clone();
        FlushSignal::new(move || {
            fired.fetch_add(1, Ordering::SeqCst);
        })
    };
    let signal = counting();
    let copy = signal.clone();
    signal.fire();
    copy.fire();
    drop((signal, copy));
    assert_eq!(fired.load(Ordering::SeqCst), 1);

    let signal = counting();
    let copy = signal.clone();
    drop(signal);
    assert_eq!(fired.load(Ordering::SeqCst), 1, "a copy is still there");
    drop(copy);
    assert_eq!(fired.load(Ordering::SeqCst), 2);
}

/// A command limited to tenants: a job of another tenant answers as one that does
/// not exist, changes nothing and has no effect; a job of one of them is acted on
/// as without the limit.
#[test]
fn a_command_limited_to_tenants_finds_no_job_of_another_tenant() {
    let mut s = State::new(P);
    let mut job = new_job("t");
    job.tenant_id = "acme".to_string();
    let key = match run(&mut s, T0, Command::Create(vec![job])).0 {
        Ok(Reply::Created(keys)) => keys[0],
        other => panic!("create failed: {other:?}"),
    };
    let limited = |cmd: Command, tenants: &[&str]| LogCommand::ClientIn {
        cmd,
        push: Vec::new(),
        tenants: tenants.iter().map(|t| t.to_string()).collect(),
    };
    let others = ["<default>", "globex"];
    let commands = [
        (
            Command::Complete {
                key,
                variables: None,
            },
            "complete",
        ),
        (
            Command::Fail {
                key,
                retries: 1,
                error_message: String::new(),
                retry_backoff_ms: 0,
                variables: None,
            },
            "fail",
        ),
        (
            Command::ThrowError {
                key,
                error_code: "E".into(),
                error_message: String::new(),
                variables: None,
            },
            "throw an error for",
        ),
        (
            Command::UpdateRetries { key, retries: 5 },
            "update retries of",
        ),
        (
            Command::UpdateTimeout {
                key,
                timeout_ms: 10,
            },
            "update the timeout of",
        ),
        (Command::Cancel { key }, "cancel"),
    ];
    for (cmd, action) in commands.clone() {
        let once = Command::Once {
            request: RequestId(u128::from(action.len() as u32)),
            command: Box::new(cmd.clone()),
        };
        for c in [cmd, once] {
            let before = s.job(key).cloned();
            let (reply, effects, changes) = run_log(&mut s, T0 + 1, limited(c, &others));
            assert_eq!(reply, Err(not_found(key, action)), "{action}");
            assert_eq!(effects, vec![], "{action}");
            assert!(changes.jobs.is_empty(), "{action}");
            assert_eq!(s.job(key).cloned(), before, "{action}");
        }
    }
    // The same answer as for a key that never existed: nothing tells them apart.
    let missing = JobKey::new(P, 999);
    let (reply, _, _) = run_log(
        &mut s,
        T0 + 1,
        limited(Command::Cancel { key: missing }, &others),
    );
    assert_eq!(reply, Err(not_found(missing, "cancel")));
    // Its own tenant among the caller's: carried out.
    let (reply, effects, changes) = run_log(
        &mut s,
        T0 + 2,
        limited(
            Command::UpdateRetries { key, retries: 7 },
            &["globex", "acme"],
        ),
    );
    assert_eq!(reply, Ok(Reply::Done));
    assert_eq!(effects, vec![]);
    assert_eq!(changes, keys(&[key]));
    assert_eq!(s.job(key).map(|j| j.retries), Some(7));
    let (reply, _, _) = run_log(&mut s, T0 + 3, limited(Command::Cancel { key }, &["acme"]));
    assert_eq!(reply, Ok(Reply::Done));
    assert!(s.job(key).is_none());
}
