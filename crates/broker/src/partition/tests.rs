use super::*;

fn proposal(cmd: Command) -> Proposal {
    Proposal {
        cmd: LogCommand::client(cmd),
        ends_from: None,
        reply: oneshot::channel().0,
    }
}

fn complete(n: u64) -> Proposal {
    proposal(Command::Complete {
        key: JobKey::new(PartitionId(1), n),
        variables: None,
    })
}

fn create() -> Proposal {
    proposal(Command::Create(vec![crate::engine::tests::new_job("t")]))
}

#[test]
fn the_next_entry_waits_for_the_previous_flush_and_the_inflight_limit() {
    let pending = vec![create()];
    let (now, hold) = (Duration::ZERO, COMPLETION_HOLD);
    assert!(ready_to_propose(&pending, false, false, 0, now, hold));
    assert!(ready_to_propose(
        &pending,
        false,
        false,
        MAX_INFLIGHT - 1,
        now,
        hold
    ));
    assert!(!ready_to_propose(&pending, false, true, 0, now, hold));
    assert!(!ready_to_propose(
        &pending,
        false,
        false,
        MAX_INFLIGHT,
        now,
        hold
    ));
    assert!(!ready_to_propose(&[], false, false, 0, hold, hold));
    assert!(!ready_to_propose(&[], false, false, 0, now, Duration::ZERO));
}

#[test]
fn completions_alone_wait_for_work_to_ride_with() {
    let mut pending = vec![complete(1), complete(2)];
    let (short, hold) = (COMPLETION_HOLD / 2, COMPLETION_HOLD);
    // Even with nothing in flight, they wait ...
    assert!(!ready_to_propose(&pending, false, false, 0, short, hold));
    // ... until the hold is over ...
    assert!(ready_to_propose(&pending, false, false, 0, hold, hold));
    // ... and then not past the flush and in-flight limits ...
    assert!(!ready_to_propose(&pending, false, true, 0, hold, hold));
    // ... or until the batch is full ...
    assert!(ready_to_propose(&pending, true, false, 1, short, hold));
    // ... or a command that makes work runnable joins them.
    pending.push(create());
    assert!(ready_to_propose(&pending, false, false, 1, short, hold));
    // Without a hold (a quiet partition), completions go at once.
    pending.pop();
    assert!(ready_to_propose(
        &pending,
        false,
        false,
        0,
        Duration::ZERO,
        Duration::ZERO
    ));
}

#[test]
fn completions_are_held_only_while_work_is_flowing() {
    let t0 = tokio::time::Instant::now();
    let (close, far) = (BUSY_LOOKBACK, BUSY_LOOKBACK + Duration::from_millis(1));
    // Nothing else ever proposed: a quiet partition.
    assert_eq!(hold_for(t0, None, None), Duration::ZERO);
    // Creates coming close together, the last just before: more are likely
    // within the hold.
    assert_eq!(hold_for(t0 + close, Some(t0), Some(close)), COMPLETION_HOLD);
    // One create just before, the one before it long ago (a lone job created,
    // then completed): nothing to wait for.
    assert_eq!(hold_for(t0 + close, Some(t0), Some(far)), Duration::ZERO);
    assert_eq!(hold_for(t0, Some(t0), None), Duration::ZERO);
    // The last create long ago: nothing to wait for.
    assert_eq!(hold_for(t0 + far, Some(t0), Some(close)), Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn pending_completions_hold_only_after_recent_work() {
    let mut pending = Pending::default();
    pending.add(complete(1));
    assert_eq!(pending.hold(), Duration::ZERO, "nothing else was proposed");
    pending.take();
    pending.add(create());
    pending.take();
    tokio::time::advance(BUSY_LOOKBACK / 2).await;
    pending.add(complete(2));
    assert_eq!(pending.hold(), Duration::ZERO, "a lone create");
    pending.take();
    pending.add(create());
    pending.take();
    tokio::time::advance(BUSY_LOOKBACK / 2).await;
    pending.add(complete(3));
    assert_eq!(pending.hold(), COMPLETION_HOLD, "creates are flowing");
    pending.take();
    tokio::time::advance(BUSY_LOOKBACK * 2).await;
    pending.add(complete(4));
    assert_eq!(
        pending.hold(),
        Duration::ZERO,
        "the last create is long past"
    );
}
