//! `courier job list`, `courier stats` and `courier incidents`: what is waiting,
//! for which type, since when; which jobs are incidents and why; and retrying or
//! cancelling them over a filter.

use super::{job_json, parse_duration, state_name, ClientOpts};
use courier_client::{Client, Job, JobFilter, JobState, JobStatsResponse};
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::time::Duration;

/// Jobs asked for per page.
const PAGE: i32 = 500;

/// A job state, as the commands take it.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateArg {
    Activatable,
    Activated,
    /// Failed with retries left, waiting for its back-off.
    FailedBackOff,
    Incident,
    ErrorThrown,
}

impl From<StateArg> for JobState {
    fn from(s: StateArg) -> JobState {
        match s {
            StateArg::Activatable => JobState::Activatable,
            StateArg::Activated => JobState::Activated,
            StateArg::FailedBackOff => JobState::FailedBackOff,
            StateArg::Incident => JobState::Incident,
            StateArg::ErrorThrown => JobState::ErrorThrown,
        }
    }
}

/// Which jobs: the filter flags every inspecting command takes.
#[derive(clap::Args, Debug, PartialEq, Clone)]
pub struct FilterArgs {
    /// Only jobs of this type.
    #[arg(long = "type", value_name = "TYPE")]
    pub job_type: Option<String>,
    /// Only jobs of this tenant (repeatable).
    #[arg(long = "tenant")]
    pub tenants: Vec<String>,
    /// Only jobs created at least this long ago (e.g. 10m).
    #[arg(long, value_parser = parse_duration)]
    pub older_than: Option<Duration>,
    /// Only jobs created less than this long ago.
    #[arg(long, value_parser = parse_duration)]
    pub newer_than: Option<Duration>,
}

impl FilterArgs {
    fn filter(&self, states: &[StateArg]) -> JobFilter {
        let ago = |d: Duration| now_ms() - i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        JobFilter {
            r#type: self.job_type.clone().unwrap_or_default(),
            states: states.iter().map(|s| JobState::from(*s) as i32).collect(),
            tenant_ids: self.tenants.clone(),
            created_after: self.newer_than.map_or(0, ago),
            created_before: self.older_than.map_or(0, ago),
        }
    }
}

/// `courier job list`.
#[derive(clap::Args, Debug, PartialEq)]
pub struct ListArgs {
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Only jobs in this state (repeatable).
    #[arg(long = "state", value_enum)]
    pub states: Vec<StateArg>,
    /// Most jobs to print.
    #[arg(long, default_value_t = 100)]
    pub limit: usize,
}

/// `courier stats`.
#[derive(clap::Args, Debug)]
pub struct StatsArgs {
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Redraw every --interval until Ctrl-C.
    #[arg(long)]
    pub watch: bool,
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub interval: Duration,
}

/// `courier incidents`.
#[derive(clap::Args, Debug)]
pub struct IncidentsArgs {
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Give every matching incident this many retries: they run again.
    #[arg(long, value_name = "RETRIES", conflicts_with = "cancel")]
    pub retry: Option<i32>,
    /// Cancel every matching incident.
    #[arg(long)]
    pub cancel: bool,
    /// Most incidents to print.
    #[arg(long, default_value_t = 100)]
    pub limit: usize,
}

/// Lists the jobs matching a filter, page after page up to the limit.
pub async fn list(opts: &ClientOpts, a: ListArgs) -> anyhow::Result<()> {
    let client = opts.client()?;
    let jobs = fetch(&client, a.filter.filter(&a.states), a.limit).await?;
    if opts.json {
        out!("{}", Value::Array(jobs.iter().map(job_json).collect()));
    } else {
        out_raw!("{}", render_jobs(&jobs, now_ms()));
    }
    Ok(())
}

/// Up to `limit` jobs matching `filter`, in key order.
async fn fetch(client: &Client, filter: JobFilter, limit: usize) -> anyhow::Result<Vec<Job>> {
    let mut jobs = Vec::new();
    let mut cursor = String::new();
    while jobs.len() < limit {
        let want = i32::try_from(limit - jobs.len()).unwrap_or(PAGE).min(PAGE);
        let page = client.list_jobs(filter.clone(), &cursor, want).await?;
        jobs.extend(page.jobs);
        if page.cursor.is_empty() {
            break;
        }
        cursor = page.cursor;
    }
    jobs.truncate(limit);
    Ok(jobs)
}

/// Prints the counts per job type, once or (with --watch) until Ctrl-C.
pub async fn stats(opts: &ClientOpts, a: StatsArgs) -> anyhow::Result<()> {
    let client = opts.client()?;
    let filter = a.filter.filter(&[]);
    loop {
        let stats = client.job_stats(filter.clone()).await?;
        if opts.json {
            out!("{}", stats_json(&stats));
        } else {
            // Clear the screen and go home before each redraw.
            let clear = if a.watch { "\x1b[2J\x1b[H" } else { "" };
            out_raw!("{clear}{}", render_stats(&stats));
        }
        if !a.watch {
            return Ok(());
        }
        tokio::select! {
            _ = tokio::time::sleep(a.interval) => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
    }
}

/// Lists incidents with their errors, or retries or cancels every one matching.
pub async fn incidents(opts: &ClientOpts, a: IncidentsArgs) -> anyhow::Result<()> {
    let client = opts.client()?;
    let filter = a.filter.filter(&[StateArg::Incident]);
    if a.retry.is_none() && !a.cancel {
        let jobs = fetch(&client, filter, a.limit).await?;
        if opts.json {
            out!("{}", Value::Array(jobs.iter().map(job_json).collect()));
        } else if jobs.is_empty() {
            out!("no incidents");
        } else {
            out_raw!("{}", render_incidents(&jobs));
        }
        return Ok(());
    }
    let (mut changed, mut failed) = (Vec::new(), Vec::new());
    let mut cursor = String::new();
    loop {
        let page = match a.retry {
            Some(r) => {
                client
                    .update_jobs_retries(filter.clone(), r, &cursor, PAGE)
                    .await?
            }
            None => client.cancel_jobs(filter.clone(), &cursor, PAGE).await?,
        };
        changed.extend(page.keys);
        failed.extend(page.failures.into_iter().map(|f| (f.key, f.reason)));
        if page.cursor.is_empty() {
            break;
        }
        cursor = page.cursor;
    }
    let verb = if a.cancel { "canceled" } else { "retried" };
    if opts.json {
        out!(
            "{}",
            json!({
                verb: changed,
                "failed": failed.iter().map(|(k, r)| json!({"key": k, "reason": r})).collect::<Vec<_>>(),
            })
        );
    } else {
        out!("{verb} {} incident(s)", changed.len());
        for (key, reason) in &failed {
            out!("  {key}: not {verb}: {reason}");
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        anyhow::bail!("{} incident(s) could not be {verb}", failed.len())
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// A short age: 45s, 12m, 3h, 2d.
pub(crate) fn age(ms: i64) -> String {
    let s = ms.max(0) / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86_400 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

fn short_state(state: i32) -> String {
    state_name(state).to_lowercase().replace('_', "-")
}

fn render_jobs(jobs: &[Job], now: i64) -> String {
    if jobs.is_empty() {
        return "no jobs\n".into();
    }
    let mut out = format!(
        "{:<20} {:<24} {:<15} {:>7} {:<16} {:>6}  {}\n",
        "KEY", "TYPE", "STATE", "RETRIES", "WORKER", "AGE", "TENANT"
    );
    for j in jobs {
        let worker = if j.worker.is_empty() { "-" } else { &j.worker };
        let _ = writeln!(
            out,
            "{:<20} {:<24} {:<15} {:>7} {:<16} {:>6}  {}",
            j.key,
            j.r#type,
            short_state(j.state),
            j.retries,
            worker,
            age(now - j.created_at),
            j.tenant_id
        );
    }
    out
}

fn render_incidents(jobs: &[Job]) -> String {
    let mut out = format!(
        "{:<20} {:<24} {:<12} {}\n",
        "KEY", "TYPE", "TENANT", "ERROR"
    );
    for j in jobs {
        let error = match (j.error_code.as_str(), j.error_message.as_str()) {
            ("", m) => m.to_string(),
            (c, m) => format!("{c}: {m}"),
        };
        let _ = writeln!(
            out,
            "{:<20} {:<24} {:<12} {}",
            j.key, j.r#type, j.tenant_id, error
        );
    }
    out
}

fn render_stats(s: &JobStatsResponse) -> String {
    if s.types.is_empty() {
        return "no jobs\n".into();
    }
    let mut out = format!(
        "{:<24} {:<10} {:>8} {:>7} {:>8} {:>8} {:>9} {:>7} {:>7} {:>7} {:>6}\n",
        "TYPE",
        "TENANT",
        "WAITING",
        "OLDEST",
        "ACTIVE",
        "BACKOFF",
        "INCIDENTS",
        "ERRORS",
        "ACT/S",
        "STREAMS",
        "POLLS"
    );
    for t in &s.types {
        let oldest = match t.oldest_waiting_created_at {
            0 => "-".to_string(),
            at => age(s.now - at),
        };
        let streams: i32 = t.streams_by_gateway.values().sum();
        let _ = writeln!(
            out,
            "{:<24} {:<10} {:>8} {:>7} {:>8} {:>8} {:>9} {:>7} {:>7.1} {:>7} {:>6}",
            t.r#type,
            t.tenant_id,
            t.activatable,
            oldest,
            t.activated,
            t.failed_back_off,
            t.incident,
            t.error_thrown,
            t.activations_per_second,
            streams,
            t.parked_polls
        );
    }
    out
}

pub(crate) fn stats_json(s: &JobStatsResponse) -> Value {
    json!({
        "now": s.now,
        "types": s.types.iter().map(|t| json!({
            "type": t.r#type,
            "tenantId": t.tenant_id,
            "activatable": t.activatable,
            "activated": t.activated,
            "failedBackOff": t.failed_back_off,
            "incident": t.incident,
            "errorThrown": t.error_thrown,
            "oldestWaitingCreatedAt": t.oldest_waiting_created_at,
            "activationsPerSecond": t.activations_per_second,
            "streamsByGateway": t.streams_by_gateway,
            "parkedPolls": t.parked_polls,
        })).collect::<Vec<_>>(),
    })
}
