//! The measurement shared by both arms: one writer at a time (commit latency), then
//! many writers at once (throughput and CPU per write), each against a 3-node group
//! in this process. Only the Raft layer differs between the arms.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Payload bytes per entry: about one created job.
pub const PAYLOAD: usize = 200;

/// CPU time (user + system) this process has used so far.
pub fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    let hz = 100; // USER_HZ on Linux
    Duration::from_millis((ticks(11) + ticks(12)) * 1000 / hz)
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i].as_secs_f64() * 1000.0
}

/// Runs both measurements with `write` (one replicated write, answered once
/// applied on the leader) and prints one line each.
pub async fn measure<W, F>(
    arm: &str,
    mode: &str,
    write: W,
    sequential: usize,
    seconds: u64,
    writers: usize,
) where
    W: Fn() -> F + Clone + Send + Sync + 'static,
    F: Future<Output = bool> + Send,
{
    // Warm-up.
    for _ in 0..200 {
        write().await;
    }
    let mut lat = Vec::with_capacity(sequential);
    let cpu0 = cpu_time();
    let t0 = Instant::now();
    for _ in 0..sequential {
        let s = Instant::now();
        assert!(write().await, "a write failed");
        lat.push(s.elapsed());
    }
    let wall = t0.elapsed();
    let cpu = cpu_time() - cpu0;
    row(arm, mode, "1 at a time", lat, sequential as u64, wall, cpu);

    let done = Arc::new(AtomicU64::new(0));
    let stop = Instant::now() + Duration::from_secs(seconds);
    let cpu0 = cpu_time();
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    let lats = Arc::new(std::sync::Mutex::new(Vec::<Duration>::new()));
    for _ in 0..writers {
        let (write, done, lats) = (write.clone(), Arc::clone(&done), Arc::clone(&lats));
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            while Instant::now() < stop {
                let s = Instant::now();
                if write().await {
                    mine.push(s.elapsed());
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }
            lats.lock().unwrap().extend(mine);
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let wall = t0.elapsed();
    let cpu = cpu_time() - cpu0;
    let n = done.load(Ordering::Relaxed);
    let lat = std::mem::take(&mut *lats.lock().unwrap());
    row(arm, mode, &format!("{writers} at once"), lat, n, wall, cpu);
}

/// One Markdown row: latency percentiles, writes per second, CPU per write.
fn row(
    arm: &str,
    mode: &str,
    writers: &str,
    mut lat: Vec<Duration>,
    n: u64,
    wall: Duration,
    cpu: Duration,
) {
    lat.sort();
    println!(
        "| {arm} | {mode} | {writers} | {:.3} | {:.3} | {:.3} | {:.0} | {:.0} |",
        pct(&lat, 0.5),
        pct(&lat, 0.99),
        pct(&lat, 0.999),
        n as f64 / wall.as_secs_f64(),
        cpu.as_secs_f64() * 1e6 / n.max(1) as f64,
    );
}

/// `--fsync` in the arguments: each node's log appends are written to a file and
/// fdatasync'ed before they are reported flushed.
pub fn fsync_wanted() -> bool {
    std::env::args().any(|a| a == "--fsync")
}

/// A node's log file, appended to and synced in a blocking thread.
pub struct LogFile(pub Arc<std::sync::Mutex<std::fs::File>>);

impl LogFile {
    pub fn create(dir: &std::path::Path, node: u64) -> LogFile {
        let path = dir.join(format!("node-{node}.log"));
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .expect("log file");
        LogFile(Arc::new(std::sync::Mutex::new(f)))
    }

    /// Writes `bytes` and syncs them, off the runtime's threads.
    pub async fn write_synced(&self, bytes: Vec<u8>) -> std::io::Result<()> {
        let f = Arc::clone(&self.0);
        tokio::task::spawn_blocking(move || {
            use std::io::Write;
            let mut f = f.lock().unwrap();
            f.write_all(&bytes)?;
            f.sync_data()
        })
        .await
        .map_err(std::io::Error::other)?
    }
}
