use super::*;
use crate::engine::{Batch, LogCommand};
use crate::store::Durability;
use courier_proto::domain::{
    Command, JobKey, NewJob, ProcessContext, Reply, RequestId, DEFAULT_TENANT,
};
use openraft::{CommittedLeaderId, RaftSnapshotBuilder};

/// Applies wake the timers only when they make something due before the time the
/// timers look again by themselves, and always while the timers read the state.
#[test]
fn timers_are_woken_only_for_something_due_sooner() {
    use futures::FutureExt;
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path(), Durability::Fsync).unwrap();
    let shared = SharedState::new(
        AppliedState {
            state: State::new(PartitionId(1)),
            last_applied: None,
            membership: StoredMembership::default(),
        },
        PayloadStore::new(db.keyspace("p1.payloads").unwrap()),
    );
    let woken = |next: Option<i64>| {
        let n = shared.applied.notified();
        tokio::pin!(n);
        n.as_mut().enable();
        shared.applied(next);
        n.now_or_never().is_some()
    };
    // Before the timers ever waited, and while they read: any timer wakes them.
    assert!(woken(Some(i64::MAX - 1)));
    shared.timers_wait_until(1_000);
    assert!(!woken(Some(1_000)));
    assert!(!woken(Some(5_000)));
    assert!(!woken(None));
    assert!(woken(Some(999)));
    shared.timers_reading();
    assert!(woken(Some(5_000)));
    assert!(!woken(None));
}

fn job() -> NewJob {
    NewJob {
        job_type: "t".into(),
        variables: "{}".into(),
        custom_headers: "{}".into(),
        retries: 3,
        tenant_id: DEFAULT_TENANT.into(),
        process: ProcessContext::default(),
    }
}

fn entry(index: u64, ts: i64, cmd: Command) -> Entry<TypeConfig> {
    Entry {
        log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
        payload: EntryPayload::Normal(Batch {
            ts,
            commands: vec![LogCommand::client(cmd)],
            on_flushed: Default::default(),
        }),
    }
}

fn create(index: u64, jobs: usize) -> Entry<TypeConfig> {
    entry(index, 1, Command::Create(vec![job(); jobs]))
}

fn create_once(id: u128, jobs: usize) -> Command {
    Command::Once {
        request: RequestId(id),
        command: Box::new(Command::Create(vec![job(); jobs])),
    }
}

/// A snapshot of `sm`'s applied state.
async fn snapshot(sm: &mut StateMachine) -> Snapshot<TypeConfig> {
    sm.get_snapshot_builder()
        .await
        .build_snapshot()
        .await
        .unwrap()
}

/// The bytes of a snapshot's data, from its start.
async fn bytes(f: &mut tokio::fs::File) -> Vec<u8> {
    use tokio::io::{AsyncReadExt, AsyncSeekExt};
    f.rewind().await.unwrap();
    let mut out = Vec::new();
    f.read_to_end(&mut out).await.unwrap();
    out
}

/// Another handle on a snapshot's data, for a second reader.
async fn another(f: &tokio::fs::File) -> Box<tokio::fs::File> {
    Box::new(f.try_clone().await.unwrap())
}

fn onces(sm: &StateMachine) -> Vec<(RequestId, OnceRecord)> {
    sm.shared().read().state.onces().collect()
}

/// What a partition remembers of its once-only commands is stored with its
/// jobs, read back on restart, carried by its snapshots and installed from
/// them; what it forgets
/// is deleted.
#[tokio::test]
async fn remembered_requests_survive_restarts_and_travel_in_snapshots() {
    use courier_proto::domain::ONCE_WINDOW_MS;
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(&dir.path().join("a"), Durability::Fsync).unwrap();
    let snaps = dir.path().join("snaps-a");
    let mut sm = StateMachine::open(&db, PartitionId(1), snaps.clone()).unwrap();
    let t0 = 1_000_000;
    sm.apply([
        entry(1, t0, create_once(10, 2)),
        entry(2, t0 + 5, create_once(11, 1)),
    ])
    .await
    .unwrap();
    let remembered = onces(&sm);
    assert_eq!(remembered.len(), 2);
    let snap = snapshot(&mut sm).await;
    drop(sm);
    let mut sm = StateMachine::open(&db, PartitionId(1), snaps.clone()).unwrap();
    assert_eq!(onces(&sm), remembered, "read back on restart");
    let again = sm
        .apply([entry(3, t0 + 10, create_once(10, 2))])
        .await
        .unwrap();
    assert_eq!(
        again[0].replies,
        vec![Ok(Reply::Created(vec![
            JobKey::new(PartitionId(1), 1),
            JobKey::new(PartitionId(1), 2)
        ]))]
    );
    assert_eq!(sm.shared().read().state.job_count(), 3);

    // Installed on a replica that had none: remembered there, and stored.
    let mut snap = snap;
    let data = SnapshotData::decode(&bytes(&mut snap.snapshot).await).unwrap();
    assert_eq!(data.onces, remembered);
    let other_db = Db::open(&dir.path().join("b"), Durability::Fsync).unwrap();
    let other_snaps = dir.path().join("snaps-b");
    let mut other = StateMachine::open(&other_db, PartitionId(1), other_snaps.clone()).unwrap();
    other
        .apply([entry(1, t0, create_once(99, 1))])
        .await
        .unwrap();
    other
        .install_snapshot(&snap.meta, another(&snap.snapshot).await)
        .await
        .unwrap();
    assert_eq!(onces(&other), remembered);
    drop(other);
    let other = StateMachine::open(&other_db, PartitionId(1), other_snaps).unwrap();
    assert_eq!(onces(&other), remembered, "stored by the install");

    // Forgotten once an entry is past the window, and deleted from the store.
    sm.apply([entry(4, t0 + 6 + ONCE_WINDOW_MS, create_once(12, 1))])
        .await
        .unwrap();
    assert_eq!(
        onces(&sm).into_iter().map(|(id, _)| id).collect::<Vec<_>>(),
        vec![RequestId(12)]
    );
    drop(sm);
    let sm = StateMachine::open(&db, PartitionId(1), snaps).unwrap();
    assert_eq!(onces(&sm).len(), 1);
}

/// A snapshot from before requests were remembered (counters and jobs only) is
/// read as one that remembers none.
#[test]
fn a_snapshot_without_requests_reads_as_one_with_none() {
    let mut state = State::new(PartitionId(1));
    let mut changes = Changes::new();
    if let EntryPayload::Normal(batch) = create(1, 2).payload {
        state.apply_batch(1, &batch, &mut changes);
    }
    let jobs: Vec<Job> = state.jobs().cloned().collect();
    let old = codec::to_vec(&(state.counters().clone(), jobs.clone())).unwrap();
    let data = SnapshotData::decode(&old).unwrap();
    assert_eq!(
        (data.counters, data.jobs, data.onces),
        (state.counters().clone(), jobs, vec![])
    );
    assert!(
        SnapshotData::decode(&old[..old.len() - 1]).is_err(),
        "a cut one is refused"
    );
}

/// The builder holds the state as it was when openraft asked for it (between two
/// applies), not as it is when the file is written; the snapshot installs on
/// another state machine as exactly that state, and survives a restart.
#[tokio::test]
async fn a_snapshot_is_the_state_when_the_builder_was_taken() {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(&dir.path().join("a"), Durability::Fsync).unwrap();
    let snaps = dir.path().join("snaps-a");
    let mut sm = StateMachine::open(&db, PartitionId(1), snaps.clone()).unwrap();
    sm.apply([create(1, 3), create(2, 4)]).await.unwrap();
    let mut builder = sm.get_snapshot_builder().await;
    sm.apply([create(3, 5)]).await.unwrap();
    let mut snap = builder.build_snapshot().await.unwrap();
    assert_eq!(snap.meta.last_log_id.map(|l| l.index), Some(2));
    let built = bytes(&mut snap.snapshot).await;
    let data = SnapshotData::decode(&built).unwrap();
    assert_eq!(data.jobs.len(), 7);
    assert_eq!(sm.shared().read().state.job_count(), 12);

    let mut current = sm.get_current_snapshot().await.unwrap().unwrap();
    assert_eq!(current.meta, snap.meta);
    assert_eq!(bytes(&mut current.snapshot).await, built);

    let other_db = Db::open(&dir.path().join("b"), Durability::Fsync).unwrap();
    let mut other =
        StateMachine::open(&other_db, PartitionId(1), dir.path().join("snaps-b")).unwrap();
    other.apply([create(1, 1)]).await.unwrap();
    other
        .install_snapshot(&snap.meta, another(&snap.snapshot).await)
        .await
        .unwrap();
    let (applied, _) = other.applied_state().await.unwrap();
    assert_eq!(applied.map(|l| l.index), Some(2));
    let keys =
        |s: &StateMachine| -> Vec<_> { s.shared().read().state.jobs().map(|j| j.key).collect() };
    let mut expected = keys(&sm);
    expected.truncate(7);
    assert_eq!(keys(&other), expected);

    drop(sm);
    let reopened = StateMachine::open(&db, PartitionId(1), snaps).unwrap();
    let loaded = reopened.snapshots.current().unwrap();
    assert_eq!(loaded.meta, snap.meta);
    assert_eq!(std::fs::read(&loaded.data).unwrap(), built);
}

/// A snapshot received through the file begun for it becomes the current data file
/// as it is (no copy); a broker that stopped mid-way leaves no files behind once it
/// opens again; and a snapshot file of data format 4 (meta and data in one file) is
/// converted to an index and a data file when the partition opens.
#[tokio::test]
async fn snapshot_files_are_received_in_place_cleaned_up_and_converted() {
    use tokio::io::AsyncWriteExt;
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(&dir.path().join("a"), Durability::Fsync).unwrap();
    let snaps = dir.path().join("snaps-a");
    let mut sm = StateMachine::open(&db, PartitionId(1), snaps.clone()).unwrap();
    sm.apply([create(1, 3)]).await.unwrap();
    let mut snap = snapshot(&mut sm).await;
    let built = bytes(&mut snap.snapshot).await;

    let other_db = Db::open(&dir.path().join("b"), Durability::Fsync).unwrap();
    let other_snaps = dir.path().join("snaps-b");
    let mut other = StateMachine::open(&other_db, PartitionId(1), other_snaps.clone()).unwrap();
    let mut receiving = other.begin_receiving_snapshot().await.unwrap();
    receiving.write_all(&built).await.unwrap();
    let begun = other.receiving.clone().unwrap();
    other.install_snapshot(&snap.meta, receiving).await.unwrap();
    let current = other.snapshots.current().unwrap();
    assert_eq!(
        current.data,
        begun.with_extension("data"),
        "renamed, not copied"
    );
    assert_eq!(std::fs::read(&current.data).unwrap(), built);
    assert_eq!(other.shared().read().state.job_count(), 3);

    // Left half-way: a transfer and a build. Both are gone after a restart.
    let _half = other.begin_receiving_snapshot().await.unwrap();
    std::fs::write(other_snaps.join("p1-1-1.part"), b"half").unwrap();
    drop(other);
    let other = StateMachine::open(&other_db, PartitionId(1), other_snaps.clone()).unwrap();
    let mut names: Vec<String> = std::fs::read_dir(&other_snaps)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("p1"))
        .collect();
    names.sort();
    let data_name = current
        .data
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(names, vec![data_name, "p1.snap".to_string()]);
    drop(other);

    // Format 4: the meta's length, the meta, the data, in `p1.snapshot`.
    let old_snaps = dir.path().join("snaps-c");
    std::fs::create_dir_all(&old_snaps).unwrap();
    let meta = codec::to_vec(&snap.meta).unwrap();
    let mut old = (meta.len() as u32).to_be_bytes().to_vec();
    old.extend_from_slice(&meta);
    old.extend_from_slice(&built);
    std::fs::write(old_snaps.join("p1.snapshot"), &old).unwrap();
    let db_c = Db::open(&dir.path().join("c"), Durability::Fsync).unwrap();
    let mut converted = StateMachine::open(&db_c, PartitionId(1), old_snaps.clone()).unwrap();
    assert!(!old_snaps.join("p1.snapshot").exists());
    let mut current = converted.get_current_snapshot().await.unwrap().unwrap();
    assert_eq!(current.meta, snap.meta);
    assert_eq!(bytes(&mut current.snapshot).await, built);
}

/// Payloads past the budget are stored apart: a fail that merges variables into
/// one (in the same apply as its create) reads it back; a restart keeps them apart
/// without loading them; a snapshot carries the jobs whole, and the replica that
/// installs it stores apart what is past its own budget.
#[tokio::test]
async fn payloads_past_the_budget_are_stored_apart_read_back_and_carried_whole() {
    use courier_proto::domain::ActivationProps;
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(&dir.path().join("a"), Durability::Fsync).unwrap();
    let snaps = dir.path().join("snaps-a");
    let big = |i: u32| NewJob {
        variables: format!(r#"{{"i":{i},"pad":"{}"}}"#, "x".repeat(1000)),
        custom_headers: r#"{"h":"v"}"#.into(),
        ..job()
    };
    let k = |n: u64| JobKey::new(PartitionId(1), n);
    let budget = 2_000;
    let mut sm = StateMachine::open(&db, PartitionId(1), snaps.clone())
        .unwrap()
        .with_payload_budget(budget);
    let t0 = 1_000_000;
    let activate = Command::Activate {
        props: ActivationProps {
            job_type: "t".into(),
            worker: "w".into(),
            timeout_ms: 60_000,
            fetch_variables: vec![],
            tenant_ids: vec![DEFAULT_TENANT.into()],
        },
        max_jobs: 3,
    };
    let fail = Command::Fail {
        key: k(3),
        retries: 1,
        error_message: "e".into(),
        retry_backoff_ms: 60_000,
        variables: Some(r#"{"more":true}"#.into()),
    };
    let out = sm
        .apply([
            entry(1, t0, Command::Create(vec![big(1), big(2), big(3)])),
            entry(2, t0, activate),
            entry(3, t0, fail),
        ])
        .await
        .unwrap();
    assert_eq!(out[1].stored, [k(2), k(3)].into_iter().collect());
    assert_eq!(out[2].replies, vec![Ok(Reply::Done)]);
    let stored = |sm: &StateMachine, n: u64| sm.shared().payloads.get(k(n)).unwrap();
    let merged = stored(&sm, 3).expect("job 3's payload stored");
    assert!(
        merged
            .variables
            .starts_with(r#"{"i":3,"more":true,"pad":"xx"#),
        "{}",
        merged.variables
    );
    assert_eq!(stored(&sm, 1), None);
    {
        let a = sm.shared();
        let a = a.read();
        assert_eq!(a.state.stored_count(), 2);
        assert_eq!(a.state.job(k(3)).unwrap().variables, "");
    }
    let snap = snapshot(&mut sm).await;
    drop(sm);

    let sm = StateMachine::open(&db, PartitionId(1), snaps)
        .unwrap()
        .with_payload_budget(budget);
    {
        let a = sm.shared();
        let a = a.read();
        assert_eq!(a.state.stored_count(), 2, "kept apart over a restart");
        assert_eq!(a.state.job(k(2)).unwrap().variables, "");
        assert_eq!(a.state.job(k(1)).unwrap().variables, big(1).variables);
    }
    assert_eq!(stored(&sm, 2).unwrap().variables, big(2).variables);

    for (name, budget, apart) in [("b", u64::MAX, 0), ("c", budget, 2)] {
        let other_db = Db::open(&dir.path().join(name), Durability::Fsync).unwrap();
        let mut other = StateMachine::open(
            &other_db,
            PartitionId(1),
            dir.path().join(format!("snaps-{name}")),
        )
        .unwrap()
        .with_payload_budget(budget);
        other
            .install_snapshot(&snap.meta, another(&snap.snapshot).await)
            .await
            .unwrap();
        let a = other.shared();
        let a = a.read();
        assert_eq!(
            a.state.stored_count(),
            apart,
            "installed with budget {budget}"
        );
        let whole = match a.state.stored_payload(k(3)) {
            Some(_) => stored(&other, 3).unwrap().variables,
            None => a.state.job(k(3)).unwrap().variables.clone(),
        };
        assert_eq!(whole, merged.variables);
    }
}

/// A snapshot's encoding with jobs (one activated) and a remembered request, to cut
/// and change.
fn snapshot_seed() -> Vec<u8> {
    let mut state = State::new(PartitionId(1));
    let mut changes = Changes::new();
    for (i, cmd) in [
        create_once(7, 3),
        Command::Create(vec![job(); 2]),
        Command::Activate {
            props: courier_proto::domain::ActivationProps {
                job_type: "t".into(),
                worker: "w".into(),
                timeout_ms: 1_000,
                fetch_variables: Vec::new(),
                tenant_ids: vec![DEFAULT_TENANT.into()],
            },
            max_jobs: 1,
        },
    ]
    .into_iter()
    .enumerate()
    {
        if let EntryPayload::Normal(batch) = entry(i as u64 + 1, 1, cmd).payload {
            state.apply_batch(i as u64 + 1, &batch, &mut changes);
        }
    }
    let jobs: Vec<Job> = state.jobs().cloned().collect();
    let onces: Vec<([u8; 16], OnceRecord)> = state
        .onces()
        .map(|(id, r)| (id.0.to_be_bytes(), r))
        .collect();
    assert_eq!((jobs.len(), onces.len()), (5, 1));
    codec::to_vec(&(state.counters().clone(), jobs, onces)).unwrap()
}

/// Reads `bytes` as a received snapshot, and installs what reads as one in a
/// state: an error or a state, never a panic.
fn read_and_install(bytes: &[u8]) {
    if let Ok(data) = SnapshotData::decode(bytes) {
        let mut state = State::from_parts(PartitionId(1), data.counters, data.jobs, data.onces);
        state.set_payload_budget(64);
        state.place_all(&mut Changes::new());
    }
}

#[test]
fn the_snapshot_seed_reads_back_whole_and_a_cut_one_does_not_check() {
    let seed = snapshot_seed();
    let data = SnapshotData::decode(&seed).unwrap();
    assert_eq!((data.jobs.len(), data.onces.len()), (5, 1));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    std::fs::write(&path, &seed).unwrap();
    intake::check(&path).unwrap();
    std::fs::write(&path, &seed[..seed.len() - 1]).unwrap();
    assert!(intake::check(&path).is_err());
    std::fs::write(&path, [seed.as_slice(), b"x"].concat()).unwrap();
    assert!(intake::check(&path).unwrap_err().contains("after the end"));
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(5_000))]

    /// Snapshot decoding, fed bytes a peer may send (random ones, and a valid
    /// snapshot cut short or with bytes changed): an error or a state, never a
    /// panic or an allocation its length prefixes claim.
    #[test]
    fn received_snapshot_bytes_read_to_an_error_or_a_state(
        random in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256),
        cut in proptest::prelude::any::<proptest::sample::Index>(),
        changes in proptest::collection::vec(
            (proptest::prelude::any::<proptest::sample::Index>(), proptest::prelude::any::<u8>()),
            0..6,
        ),
    ) {
        read_and_install(&random);
        let mut bytes = snapshot_seed();
        for (at, b) in changes {
            let i = at.index(bytes.len());
            bytes[i] = b;
        }
        bytes.truncate(cut.index(bytes.len() + 1));
        read_and_install(&bytes);
    }
}

/// A snapshot taken in by the intake in chunks, out of order after the first, is
/// checked and installed from its own file (renamed, not copied); one whose bytes
/// do not decode is refused and its file removed.
#[tokio::test]
async fn the_intake_takes_chunks_in_place_and_refuses_what_does_not_decode() {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(&dir.path().join("a"), Durability::Fsync).unwrap();
    let mut sm = StateMachine::open(&db, PartitionId(1), dir.path().join("snaps-a")).unwrap();
    sm.apply([create(1, 3)]).await.unwrap();
    let mut snap = snapshot(&mut sm).await;
    let built = bytes(&mut snap.snapshot).await;

    let other_db = Db::open(&dir.path().join("b"), Durability::Fsync).unwrap();
    let other_snaps = dir.path().join("snaps-b");
    let mut other = StateMachine::open(&other_db, PartitionId(1), other_snaps.clone()).unwrap();
    let intake = other.intake();
    let half = built.len() / 2;
    let chunk = |from: usize, to: usize| bytes::Bytes::copy_from_slice(&built[from..to]);
    assert!(intake
        .receive(&snap.meta, 0, chunk(0, 1), false)
        .await
        .unwrap()
        .is_none());
    assert!(intake
        .receive(&snap.meta, half as u64, chunk(half, built.len()), false)
        .await
        .unwrap()
        .is_none());
    let whole = intake
        .receive(&snap.meta, 1, chunk(1, half), true)
        .await
        .unwrap()
        .expect("the whole snapshot");
    let received = other.snapshots.take_received().unwrap();
    other.snapshots.received(received.clone());
    other
        .install_snapshot(&whole.meta, whole.snapshot)
        .await
        .unwrap();
    let current = other.snapshots.current().unwrap();
    assert_eq!(
        current.data,
        received.with_extension("data"),
        "renamed, not copied"
    );
    assert_eq!(std::fs::read(&current.data).unwrap(), built);
    assert_eq!(other.shared().read().state.job_count(), 3);

    let mut bad = snap.meta.clone();
    bad.snapshot_id = "bad".into();
    let refused = intake
        .receive(&bad, 0, bytes::Bytes::from_static(&[0xff; 64]), true)
        .await
        .unwrap_err();
    assert!(
        matches!(refused, IntakeError::Undecodable { .. }),
        "{refused}"
    );
    let recv_files = std::fs::read_dir(&other_snaps)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().extension() == Some("recv".as_ref()))
        .count();
    assert_eq!(recv_files, 0);
    let late = intake
        .receive(&bad, 5, chunk(5, 6), false)
        .await
        .unwrap_err();
    assert!(
        matches!(late, IntakeError::NotStarted { offset: 5, .. }),
        "{late}"
    );
}
