//! A worker's job streams. It keeps one, and opens more, each on another gateway,
//! while its credit is fully used or its polls find jobs the streams were not
//! pushed (more gateways then push to it); one that carried nothing for a while is
//! closed, down to one. The credit (max jobs active) is split between the streams,
//! weighted toward those that carry the jobs, and their credits together never
//! exceed it: a stream's credit is lowered (it reopens) before another's is raised.

use super::sources::{stream_loop, StreamState};
use super::{lock, Ctx};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{watch, Notify};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How often the worker looks at its streams' load.
const LOOK_EVERY: Duration = Duration::from_secs(1);
/// Looks in a row that saw pressure before a stream is added.
const GROW_AFTER: u32 = 2;
/// The least time between two changes of the set of streams.
const SETTLE: Duration = Duration::from_secs(2);
/// How often credit is moved toward the streams that carry the jobs.
const REBALANCE_EVERY: Duration = Duration::from_secs(5);
/// How long a lowered stream may take to reopen before others are raised anyway
/// (a stream that is down holds no credit at its gateway).
const SHRINK_WAIT: Duration = Duration::from_secs(5);
/// Streams a worker keeps at most by default (never more than its gateways).
pub const MAX_STREAMS: usize = 4;
/// How long a stream beside others may carry nothing before it is closed.
pub const PRUNE_AFTER: Duration = Duration::from_secs(30);

/// One of the worker's streams.
pub(super) struct Lane {
    pub(super) id: usize,
    /// The credit it is to open with.
    credit: AtomicU32,
    /// The credit its open stream stated; 0 while it is not open.
    open_credit: AtomicU32,
    /// Jobs pushed through it.
    carried: AtomicU64,
    /// When it last carried a job (ms since the lanes began).
    last_job_ms: AtomicU64,
    /// Told to reopen with its new credit.
    pub(super) resized: Notify,
    /// Cancelled when it is closed (or the worker stops).
    pub(super) close: CancellationToken,
    /// The gateway its stream is on, or was last on while it reopens: the worker's
    /// other streams keep off it, even when two (re)open at the same moment.
    gateway: Mutex<Option<String>>,
    /// Told to reopen on another gateway: it shares one with another stream.
    moving: AtomicBool,
    state: AtomicU8,
}

impl Lane {
    pub(super) fn credit(&self) -> u32 {
        self.credit.load(Relaxed)
    }

    /// Its stream opened on `gateway` stating `credit`.
    pub(super) fn opened(&self, ctx: &Ctx, gateway: &str, credit: u32) {
        *lock(&self.gateway) = Some(gateway.to_string());
        let was = self.open_credit.swap(credit, Relaxed);
        ctx.metrics
            .stream_credit(i64::from(credit) - i64::from(was));
    }

    /// Its stream ended (its gateway stays claimed until it reopens elsewhere).
    pub(super) fn ended(&self, ctx: &Ctx) {
        let was = self.open_credit.swap(0, Relaxed);
        ctx.metrics.stream_credit(-i64::from(was));
    }

    /// Whether it was told to move to another gateway (and clears that).
    pub(super) fn take_move(&self) -> bool {
        self.moving.swap(false, Relaxed)
    }
}

/// The worker's streams, what each holds, and the state the poller sees.
pub(super) struct Lanes {
    began: Instant,
    live: Mutex<Vec<Arc<Lane>>>,
    /// Job key -> the lane whose stream pushed it, declared held when that lane
    /// reopens. Polled jobs, and those of closed lanes, are declared by lane 0.
    owners: Mutex<HashMap<i64, usize>>,
    state: watch::Sender<StreamState>,
    /// Jobs polls found beside an open stream since the last look.
    polled_beside: AtomicU64,
}

impl Lanes {
    pub(super) fn new(state: watch::Sender<StreamState>) -> Lanes {
        Lanes {
            began: Instant::now(),
            live: Mutex::new(Vec::new()),
            owners: Mutex::new(HashMap::new()),
            state,
            polled_beside: AtomicU64::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        self.began.elapsed().as_millis() as u64
    }

    fn add(&self, id: usize, credit: u32, stop: &CancellationToken) -> Arc<Lane> {
        let lane = Arc::new(Lane {
            id,
            credit: AtomicU32::new(credit),
            open_credit: AtomicU32::new(0),
            carried: AtomicU64::new(0),
            last_job_ms: AtomicU64::new(self.now_ms()),
            resized: Notify::new(),
            close: stop.child_token(),
            gateway: Mutex::new(None),
            moving: AtomicBool::new(false),
            state: AtomicU8::new(StreamState::Opening as u8),
        });
        lock(&self.live).push(lane.clone());
        self.publish();
        lane
    }

    fn remove(&self, id: usize) {
        lock(&self.live).retain(|l| l.id != id);
        self.publish();
    }

    /// Lane `lane`'s stream is now in `state`.
    pub(super) fn set_state(&self, lane: &Lane, state: StreamState) {
        lane.state.store(state as u8, Relaxed);
        self.publish();
    }

    /// What the poller sees: open while any stream is, opening while any is.
    fn publish(&self) {
        let states: Vec<u8> = lock(&self.live)
            .iter()
            .map(|l| l.state.load(Relaxed))
            .collect();
        let seen = if states.contains(&(StreamState::Open as u8)) {
            StreamState::Open
        } else if states.contains(&(StreamState::Opening as u8)) {
            StreamState::Opening
        } else {
            StreamState::Down
        };
        self.state.send_if_modified(|s| {
            let changed = *s != seen;
            *s = seen;
            changed
        });
    }

    /// A job came through `lane`'s stream.
    pub(super) fn carried(&self, ctx: &Ctx, lane: &Lane, key: i64) {
        lane.carried.fetch_add(1, Relaxed);
        lane.last_job_ms.store(self.now_ms(), Relaxed);
        let owned = {
            let mut owners = lock(&self.owners);
            owners.insert(key, lane.id);
            owners.len()
        };
        // Owners of jobs that finished are dropped now and then: the map stays
        // within a few times what the worker can hold, at O(1) a job on average.
        if owned > 4 * ctx.capacity.max() + 64 {
            let held: HashSet<i64> = ctx.jobs_held().into_iter().map(|(k, _)| k).collect();
            lock(&self.owners).retain(|k, _| held.contains(k));
        }
    }

    /// Polls found `n` jobs while a stream was open.
    pub(super) fn polled_beside(&self, n: usize) {
        self.polled_beside.fetch_add(n as u64, Relaxed);
    }

    /// The gateways of the streams other than `lane`'s (where they are, or
    /// reopen from).
    pub(super) fn other_gateways(&self, lane: &Lane) -> Vec<String> {
        lock(&self.live)
            .iter()
            .filter(|l| l.id != lane.id)
            .filter_map(|l| lock(&l.gateway).clone())
            .collect()
    }

    /// Of the jobs the worker holds, those `lane` declares when it (re)opens.
    pub(super) fn held_by(&self, lane: &Lane, held: Vec<(i64, i64)>) -> Vec<(i64, i64)> {
        let live: HashSet<usize> = lock(&self.live).iter().map(|l| l.id).collect();
        let mut owners = lock(&self.owners);
        let now: HashSet<i64> = held.iter().map(|(k, _)| *k).collect();
        // Jobs no longer held need no owner.
        owners.retain(|k, _| now.contains(k));
        held.into_iter()
            .filter(|(k, _)| match owners.get(k) {
                Some(o) if live.contains(o) => *o == lane.id,
                _ => lane.id == 0,
            })
            .collect()
    }
}

impl Lanes {
    /// How many of the jobs held now came through `lane`'s stream (polled ones,
    /// which its gateway does not count, left out).
    fn pushed_held(&self, lane: &Lane, held: Vec<(i64, i64)>) -> usize {
        let owners = lock(&self.owners);
        held.iter()
            .filter(|(k, _)| owners.get(k) == Some(&lane.id))
            .count()
    }
}

/// Splits `total` credit between streams by `weights` (jobs each carried lately),
/// half evenly and half by weight, each at least 1; the shares sum to `total`.
pub(super) fn split(total: u32, weights: &[u64]) -> Vec<u32> {
    let n = weights.len();
    if n == 0 {
        return Vec::new();
    }
    let sum: u64 = weights.iter().sum();
    let wanted: Vec<f64> = weights
        .iter()
        .map(|&w| {
            let even = f64::from(total) / n as f64;
            let by_weight = if sum == 0 {
                even
            } else {
                f64::from(total) * w as f64 / sum as f64
            };
            (even + by_weight) / 2.0
        })
        .collect();
    let mut shares: Vec<u32> = wanted.iter().map(|w| (w.floor() as u32).max(1)).collect();
    // Hand out what flooring left, largest remainders first; take back what the
    // floor of 1 added, from the largest shares.
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| {
        let ra = wanted[a] - wanted[a].floor();
        let rb = wanted[b] - wanted[b].floor();
        rb.total_cmp(&ra)
    });
    let mut given: u32 = shares.iter().sum();
    let mut i = 0;
    while given < total {
        shares[order[i % n]] += 1;
        given += 1;
        i += 1;
    }
    while given > total {
        let Some(big) = (0..n).filter(|&i| shares[i] > 1).max_by_key(|&i| shares[i]) else {
            break;
        };
        shares[big] -= 1;
        given -= 1;
    }
    shares
}

/// Of `open` streams (lane id, gateway), the one to move to another gateway: the
/// latest of two or more on one gateway, while a gateway in `live` has none.
fn crowded(open: &[(usize, String)], live: &[String]) -> Option<usize> {
    let held: HashSet<&str> = open.iter().map(|(_, g)| g.as_str()).collect();
    if live.iter().all(|g| held.contains(g.as_str())) {
        return None;
    }
    open.iter()
        .filter(|(id, g)| open.iter().any(|(other, h)| other < id && h == g))
        .map(|(id, _)| *id)
        .max()
}

/// Whether moving from `old` to `new` credits is worth reopening streams for.
fn worth_it(old: &[u32], new: &[u32]) -> bool {
    old.iter().zip(new).any(|(&o, &n)| {
        let d = o.abs_diff(n);
        d >= 2 && d * 4 >= o.max(n)
    })
}

/// Gives `lanes` the credits `shares`: lowered ones reopen first, and the raised
/// ones only once those have, and hold no more jobs than their new credit (or
/// [`SHRINK_WAIT`] passed), so the credits stated at the gateways never sum to
/// more than the worker's and no gateway pushes into room that is not there.
async fn apply(ctx: &Ctx, all: &Lanes, lanes: &[Arc<Lane>], shares: &[u32]) {
    let mut lowered = Vec::new();
    for (lane, &share) in lanes.iter().zip(shares) {
        if share < lane.credit() {
            lane.credit.store(share, Relaxed);
            lane.resized.notify_one();
            lowered.push(lane.clone());
        }
    }
    let deadline = Instant::now() + SHRINK_WAIT;
    let over = |l: &Arc<Lane>| {
        l.open_credit.load(Relaxed) > l.credit()
            || all.pushed_held(l, ctx.jobs_held()) > l.credit() as usize
    };
    while lowered.iter().any(over) && Instant::now() < deadline {
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(20)) => {}
            () = ctx.stop.cancelled() => return,
        }
    }
    for (lane, &share) in lanes.iter().zip(shares) {
        if share > lane.credit() {
            lane.credit.store(share, Relaxed);
            lane.resized.notify_one();
        }
    }
}

/// Runs the worker's streams until shutdown: one at first, more under pressure,
/// fewer when idle.
pub(super) async fn run(ctx: Arc<Ctx>, lanes: Arc<Lanes>) {
    let total = ctx.config.max_jobs_active;
    let mut tasks = tokio::task::JoinSet::new();
    let first = lanes.add(0, total, &ctx.stop);
    tasks.spawn(stream_loop(ctx.clone(), lanes.clone(), first));
    let mut next_id = 1;
    let mut tick = tokio::time::interval(LOOK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut pressed = 0;
    let mut changed = Instant::now();
    let mut rebalanced = Instant::now();
    let mut carried_then: HashMap<usize, u64> = HashMap::new();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = ctx.stop.cancelled() => break,
        }
        // Reap lanes that ended.
        while let Some(done) = tasks.try_join_next() {
            if let Err(e) = done {
                tracing::warn!(error = %e, "a job stream task ended abnormally");
            }
        }
        let live: Vec<Arc<Lane>> = lock(&lanes.live).clone();
        let most = ctx
            .config
            .max_streams
            .min(ctx.once.gateway_count())
            .min(total as usize)
            .max(1);
        let busy = ctx.capacity.filled_since_asked() || lanes.polled_beside.swap(0, Relaxed) > 0;
        pressed = if busy { pressed + 1 } else { 0 };
        let settled = changed.elapsed() >= SETTLE;
        if pressed >= GROW_AFTER && live.len() < most && settled {
            // The new lane starts with no credit and is raised once the others
            // have given some up.
            let lane = lanes.add(next_id, 0, &ctx.stop);
            next_id += 1;
            tracing::debug!(
                job_type = %ctx.config.job_type,
                streams = live.len() + 1,
                "jobs wait: opening another job stream"
            );
            tasks.spawn(stream_loop(ctx.clone(), lanes.clone(), lane.clone()));
            let mut all = live;
            all.push(lane);
            let shares = split(total, &vec![0; all.len()]);
            apply(&ctx, &lanes, &all, &shares).await;
            (pressed, changed, rebalanced) = (0, Instant::now(), Instant::now());
            continue;
        }
        let now = lanes.now_ms();
        let idle_after = ctx.config.prune_after.as_millis() as u64;
        let idle = live
            .iter()
            .find(|l| l.id != 0 && now.saturating_sub(l.last_job_ms.load(Relaxed)) >= idle_after);
        if let (Some(idle), false, true) = (idle, busy, settled) {
            tracing::debug!(
                job_type = %ctx.config.job_type,
                streams = live.len() - 1,
                "a job stream carried nothing for a while: closing it"
            );
            idle.close.cancel();
            lanes.remove(idle.id);
            // Its credit goes to the others once its stream has ended.
            let deadline = Instant::now() + SHRINK_WAIT;
            while idle.open_credit.load(Relaxed) > 0 && Instant::now() < deadline {
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(20)) => {}
                    () = ctx.stop.cancelled() => break,
                }
            }
            let rest: Vec<Arc<Lane>> = live.iter().filter(|l| l.id != idle.id).cloned().collect();
            let shares = split(total, &vec![0; rest.len()]);
            apply(&ctx, &lanes, &rest, &shares).await;
            (changed, rebalanced) = (Instant::now(), Instant::now());
            continue;
        }
        // Two streams on one gateway while another is live and has none (one
        // reopened beside the other while that gateway was passed over, or both
        // chose at once): the later one moves, so more gateways push to the worker.
        if settled && live.len() > 1 {
            let open: Vec<(usize, String)> = live
                .iter()
                .filter(|l| l.state.load(Relaxed) == StreamState::Open as u8)
                .filter_map(|l| lock(&l.gateway).clone().map(|g| (l.id, g)))
                .collect();
            if let Some(id) = crowded(&open, &ctx.once.live_gateways()) {
                if let Some(lane) = live.iter().find(|l| l.id == id) {
                    tracing::debug!(
                        job_type = %ctx.config.job_type,
                        "two job streams share a gateway while another has none: moving one"
                    );
                    lane.moving.store(true, Relaxed);
                    lane.resized.notify_one();
                    changed = Instant::now();
                    continue;
                }
            }
        }
        if live.len() > 1 && rebalanced.elapsed() >= REBALANCE_EVERY {
            let recent: Vec<u64> = live
                .iter()
                .map(|l| {
                    let c = l.carried.load(Relaxed);
                    c - carried_then.insert(l.id, c).unwrap_or(0).min(c)
                })
                .collect();
            let old: Vec<u32> = live.iter().map(|l| l.credit()).collect();
            let new = split(total, &recent);
            if worth_it(&old, &new) {
                apply(&ctx, &lanes, &live, &new).await;
            }
            rebalanced = Instant::now();
        }
    }
    while tasks.join_next().await.is_some() {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credit_is_split_half_evenly_half_by_load_never_above_the_total_and_at_least_one_each() {
        assert_eq!(split(32, &[0, 0]), [16, 16]);
        assert_eq!(split(32, &[0, 0, 0]).iter().sum::<u32>(), 32);
        assert_eq!(split(32, &[300, 100]), [20, 12]);
        assert_eq!(split(10, &[1000, 0, 0]), [7, 2, 1]);
        assert_eq!(split(1, &[0]), [1]);
        for (total, weights) in [
            (1u32, vec![7u64]),
            (7, vec![1, 2, 3]),
            (100, vec![0, 1, 99, 5]),
        ] {
            let s = split(total, &weights);
            assert_eq!(s.iter().sum::<u32>(), total, "{total} {weights:?} -> {s:?}");
            assert!(s.iter().all(|&c| c >= 1), "{s:?}");
        }
    }

    #[test]
    fn a_stream_sharing_a_gateway_moves_only_while_another_gateway_is_live_and_free() {
        let open = |v: &[(usize, &str)]| -> Vec<(usize, String)> {
            v.iter().map(|(i, g)| (*i, g.to_string())).collect()
        };
        let live = |v: &[&str]| -> Vec<String> { v.iter().map(|g| g.to_string()).collect() };
        assert_eq!(
            crowded(&open(&[(0, "a"), (1, "a")]), &live(&["a", "b"])),
            Some(1)
        );
        // The other gateway is passed over: nowhere better to go.
        assert_eq!(crowded(&open(&[(0, "a"), (1, "a")]), &live(&["a"])), None);
        assert_eq!(
            crowded(&open(&[(0, "a"), (1, "b")]), &live(&["a", "b"])),
            None
        );
        assert_eq!(
            crowded(
                &open(&[(0, "a"), (2, "b"), (3, "a")]),
                &live(&["a", "b", "c"])
            ),
            Some(3)
        );
        // Every live gateway has a stream: sharing one is then fine.
        assert_eq!(
            crowded(&open(&[(0, "a"), (1, "b"), (2, "a")]), &live(&["a", "b"])),
            None
        );
        assert_eq!(crowded(&open(&[(0, "a")]), &live(&["a", "b"])), None);
    }

    #[test]
    fn small_moves_of_credit_are_not_worth_reopening_for() {
        assert!(!worth_it(&[16, 16], &[17, 15]));
        assert!(worth_it(&[16, 16], &[22, 10]));
        assert!(!worth_it(&[2, 2], &[3, 1]));
    }
}
