//! The load drivers `e2e` (Courier) and `jetstream` (the peer) share, so both systems
//! are driven by the same code: one job at a time, or open loop at a fixed rate.
//! Handlers report `(creation time µs, latency µs)` on a channel; a job counts when
//! it was created after the warm-up.

use hdrhistogram::Histogram;
use std::future::Future;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

/// Where handlers report `(creation time µs, latency µs)`.
pub type Seen = mpsc::UnboundedSender<(u64, u64)>;

/// Wall-clock µs since the epoch: what a job carries as its creation time.
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// The creation time a job carries in its body or variables, `{"t":<µs>,...}`.
pub fn created_us(body: &[u8]) -> Option<u64> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    v.get("t")?.as_u64()
}

/// A run's time: `warmup` seconds from now, then `duration` measured.
pub struct Window {
    pub start: Instant,
    pub until: Instant,
    /// Jobs created from then on are measured.
    pub measure_from_us: u64,
    /// Print each measured job slower than this on stderr (creation time and
    /// latency), to line stalls up with the brokers' logs.
    pub print_slower_than_us: Option<u64>,
}

impl Window {
    pub fn new(warmup: u64, duration: u64) -> Window {
        let start = Instant::now();
        Window {
            start,
            until: start + Duration::from_secs(warmup + duration),
            measure_from_us: now_us() + warmup * 1_000_000,
            print_slower_than_us: None,
        }
    }

    fn record(&self, h: &mut Histogram<u64>, (created, latency): (u64, u64)) {
        if created >= self.measure_from_us {
            if self.print_slower_than_us.is_some_and(|t| latency > t) {
                eprintln!("slow job: created_us={created} latency_us={latency}");
            }
            h.saturating_record(latency);
        }
    }
}

/// One job at a time: `send` it, wait until a handler has it. Returns the errors
/// (sends that failed, jobs no handler reported within 15 s).
pub async fn unloaded<F, Fut, T, E>(
    w: &Window,
    rx: &mut mpsc::UnboundedReceiver<(u64, u64)>,
    h: &mut Histogram<u64>,
    mut send: F,
) -> u64
where
    F: FnMut(u64) -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let mut errors = 0;
    while Instant::now() < w.until {
        if send(now_us()).await.is_err() {
            errors += 1;
            continue;
        }
        match tokio::time::timeout(Duration::from_secs(15), rx.recv()).await {
            Ok(Some(seen)) => w.record(h, seen),
            _ => errors += 1,
        }
    }
    errors
}

/// Open loop: `rate` sends a second, each a task of its own (a send that fails
/// is said on stderr, so a missing job can be told from a failed send), then the
/// stragglers are awaited for at most 15 s. Returns the errors: jobs sent in the
/// measured window that no handler reported.
pub async fn open_loop<F, Fut, T, E>(
    w: &Window,
    rate: u64,
    rx: &mut mpsc::UnboundedReceiver<(u64, u64)>,
    h: &mut Histogram<u64>,
    mut send: F,
) -> u64
where
    F: FnMut(u64) -> Fut,
    Fut: Future<Output = Result<T, E>> + Send + 'static,
    E: std::fmt::Display,
{
    let interval = Duration::from_secs_f64(1.0 / rate.max(1) as f64);
    let mut n = 0u64;
    let mut expected = 0u64;
    loop {
        let due = w.start + interval.mul_f64(n as f64);
        if due >= w.until {
            break;
        }
        tokio::time::sleep_until(due.into()).await;
        // The job carries this creation time, and is expected by the same one the
        // handlers' reports are counted by (a second clock reading here once counted
        // a job created a few µs before the window that no report would ever match).
        let created = now_us();
        let sent = send(created);
        tokio::spawn(async move {
            if let Err(e) = sent.await {
                eprintln!("send failed: {e}");
            }
        });
        n += 1;
        if created >= w.measure_from_us {
            expected += 1;
        }
        while let Ok(seen) = rx.try_recv() {
            w.record(h, seen);
        }
    }
    let drain_until = Instant::now() + Duration::from_secs(15);
    while h.len() < expected && Instant::now() < drain_until {
        if let Ok(Some(seen)) = tokio::time::timeout(Duration::from_millis(500), rx.recv()).await {
            w.record(h, seen);
        }
    }
    expected.saturating_sub(h.len())
}
