//! `courier job ...` and `courier status`: thin commands over [`courier_client::Client`].
//! Errors come back as `CODE: message` (the client's error text), which `main` prints.

use courier_client::{ActivateJobs, ActivatedJob, Client, Job, JobState, NewJob, TopologyResponse};
use courier_proto::domain::replicas_of;
use courier_proto::gateway_protocol::partition::{PartitionBrokerHealth, PartitionBrokerRole};
use futures::StreamExt;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::io::IsTerminal as _;
use std::time::{Duration, Instant};

pub mod inspect;

/// Jobs per CreateJobs request when creating many.
const CREATE_BATCH: u32 = 500;
/// CreateJobs requests in flight at once when creating many.
const CREATE_IN_FLIGHT: usize = 4;

/// Which gateway to talk to and how to print the answers.
#[derive(clap::Args, Debug)]
pub struct ClientOpts {
    /// Gateway addresses, comma-separated: host:port, http://host:port or
    /// https://host:port. Each call goes to one of them, chosen per call; a host name
    /// stands for every address it resolves to.
    #[arg(
        long,
        env = "COURIER_ADDRESS",
        default_value = "127.0.0.1:26500",
        global = true
    )]
    pub address: String,
    /// Print machine-readable JSON (job keys as numbers) instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    /// How long to keep retrying while the cluster answers UNAVAILABLE or
    /// RESOURCE_EXHAUSTED (no leader yet, back pressure, gateway not up); 0: no retries.
    #[arg(long, default_value = "30s", value_parser = parse_duration, global = true)]
    pub retry_budget: Duration,
    #[command(flatten)]
    pub security: crate::security::ClientSecurityArgs,
}

impl ClientOpts {
    pub(crate) fn client(&self) -> anyhow::Result<Client> {
        let security = self.security.security()?;
        Ok(Client::connect_with(&self.address, &security)?.with_retry_budget(self.retry_budget))
    }
}

/// The job commands. Durations read as 500ms, 10s, 1.5s, 5m, 1h or a number of ms.
#[derive(clap::Subcommand, Debug, PartialEq)]
pub enum JobCmd {
    /// Create a job (or --count jobs) and print its key.
    Create {
        /// The job type.
        #[arg(value_name = "TYPE")]
        job_type: String,
        /// Variables: a JSON object.
        #[arg(long, value_parser = parse_json_object)]
        variables: Option<Value>,
        /// Custom headers: a JSON object of strings.
        #[arg(long, value_parser = parse_json_object)]
        headers: Option<Value>,
        /// Retries before the job becomes an incident (the gateway's default: 3).
        #[arg(long)]
        retries: Option<i32>,
        /// The tenant the job belongs to.
        #[arg(long)]
        tenant: Option<String>,
        /// Create this many identical jobs, in batches, and report the rate.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
        count: u32,
    },
    /// Activate jobs of a type and print them.
    Activate {
        /// The job type.
        #[arg(value_name = "TYPE")]
        job_type: String,
        /// At most this many jobs.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(i32).range(1..))]
        max: i32,
        /// How long the activation lasts.
        #[arg(long, default_value = "5m", value_parser = parse_duration)]
        timeout: Duration,
        /// The worker name recorded on the jobs.
        #[arg(long, default_value = "courier-cli")]
        worker: String,
        /// How long to wait for jobs when none is there; 0 answers at once.
        #[arg(long, default_value = "0", value_parser = parse_duration)]
        request_timeout: Duration,
        /// Take jobs of this tenant (repeatable; default: <default>).
        #[arg(long = "tenant")]
        tenants: Vec<String>,
        /// Fetch only this variable (repeatable; default: all).
        #[arg(long = "fetch-variable")]
        fetch_variables: Vec<String>,
    },
    /// Complete an activated job.
    Complete {
        /// The job key.
        key: i64,
        /// Variables to set: a JSON object.
        #[arg(long, value_parser = parse_json_object)]
        variables: Option<Value>,
    },
    /// Fail an activated job.
    Fail {
        /// The job key.
        key: i64,
        /// Retries left after this failure; 0 makes the job an incident.
        #[arg(long, default_value_t = 0)]
        retries: i32,
        /// Why it failed.
        #[arg(long, default_value = "")]
        message: String,
        /// Wait this long before the job may run again.
        #[arg(long, default_value = "0", value_parser = parse_duration)]
        backoff: Duration,
    },
    /// End an activated job with a business error.
    ThrowError {
        /// The job key.
        key: i64,
        /// The error code.
        #[arg(long)]
        code: String,
        /// The error message.
        #[arg(long, default_value = "")]
        message: String,
    },
    /// Set a job's retries.
    UpdateRetries {
        /// The job key.
        key: i64,
        /// The new retries (at least 1).
        #[arg(long)]
        retries: i32,
    },
    /// Move an activated job's deadline to a timeout from now.
    UpdateTimeout {
        /// The job key.
        key: i64,
        /// The new timeout, counted from now.
        #[arg(long, value_parser = parse_duration)]
        timeout: Duration,
    },
    /// Cancel a job.
    Cancel {
        /// The job key.
        key: i64,
    },
    /// Show a job's state, retries, worker, deadline, last error and variables.
    Get {
        /// The job key.
        key: i64,
    },
    /// List jobs by type, state, tenant and age (without their variables: see get).
    List(inspect::ListArgs),
}

/// Runs one job command against the gateway.
pub async fn job(opts: ClientOpts, cmd: JobCmd) -> anyhow::Result<()> {
    let client = opts.client()?;
    let json = opts.json;
    match cmd {
        JobCmd::Create {
            job_type,
            variables,
            headers,
            retries,
            tenant,
            count,
        } => {
            let mut new_job = NewJob::new(job_type);
            if let Some(v) = variables {
                new_job = new_job.variables(v);
            }
            if let Some(h) = headers {
                new_job = new_job.custom_headers(h);
            }
            if let Some(r) = retries {
                new_job = new_job.retries(r);
            }
            if let Some(t) = tenant {
                new_job = new_job.tenant_id(t);
            }
            if count == 1 {
                let created = client
                    .create_job(new_job)
                    .await
                    .map_err(|e| create_failed(e, None))?;
                if json {
                    out!(
                        "{}",
                        json!({"key": created.key, "partitionId": created.partition_id})
                    );
                } else {
                    out!("{}", created.key);
                }
            } else {
                create_many(&client, new_job, count, json).await?;
            }
        }
        JobCmd::Activate {
            job_type,
            max,
            timeout,
            worker,
            request_timeout,
            tenants,
            fetch_variables,
        } => {
            let request = ActivateJobs::new(job_type)
                .worker(worker)
                .max_jobs(max)
                .timeout(timeout)
                .request_timeout(request_timeout)
                .tenant_ids(tenants)
                .fetch_variables(fetch_variables);
            let jobs = client.activate_jobs(request).await?;
            if json {
                out!(
                    "{}",
                    Value::Array(jobs.iter().map(activated_json).collect())
                );
            } else if jobs.is_empty() {
                out!("no jobs activated");
            } else {
                for j in &jobs {
                    // Custom headers only where the job has some, as most have none.
                    let headers = or_empty_object(&j.custom_headers);
                    let headers = if headers == "{}" {
                        String::new()
                    } else {
                        format!("  headers={headers}")
                    };
                    out!(
                        "{}  type={}  retries={}  deadline={}  variables={}{headers}",
                        j.key,
                        j.r#type,
                        j.retries,
                        fmt_epoch_ms(j.deadline),
                        or_empty_object(&j.variables)
                    );
                }
            }
        }
        JobCmd::Complete { key, variables } => {
            let variables = variables.map(|v| v.to_string()).unwrap_or_default();
            client.complete_job(key, variables).await?;
            done(json, json!({"key": key, "result": "completed"}), || {
                format!("completed job {key}")
            });
        }
        JobCmd::Fail {
            key,
            retries,
            message,
            backoff,
        } => {
            client.fail_job(key, retries, message, backoff).await?;
            done(
                json,
                json!({"key": key, "result": "failed", "retries": retries}),
                || format!("failed job {key} ({retries} retries left)"),
            );
        }
        JobCmd::ThrowError { key, code, message } => {
            client.throw_error(key, code.as_str(), message).await?;
            done(
                json,
                json!({"key": key, "result": "errorThrown", "errorCode": code}),
                || format!("threw error {code} on job {key}"),
            );
        }
        JobCmd::UpdateRetries { key, retries } => {
            client.update_job_retries(key, retries).await?;
            done(
                json,
                json!({"key": key, "result": "retriesUpdated", "retries": retries}),
                || format!("set retries of job {key} to {retries}"),
            );
        }
        JobCmd::UpdateTimeout { key, timeout } => {
            client.update_job_timeout(key, timeout).await?;
            let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
            done(
                json,
                json!({"key": key, "result": "timeoutUpdated", "timeoutMs": timeout_ms}),
                || format!("job {key} now times out {timeout:?} from now"),
            );
        }
        JobCmd::Cancel { key } => {
            client.cancel_job(key).await?;
            done(json, json!({"key": key, "result": "canceled"}), || {
                format!("canceled job {key}")
            });
        }
        JobCmd::List(a) => inspect::list(&opts, a).await?,
        JobCmd::Get { key } => {
            let job = client.get_job(key).await?;
            if json {
                out!("{}", job_json(&job));
            } else {
                out_raw!("{}", render_job(&job));
            }
        }
    }
    Ok(())
}

/// Prints the cluster's topology.
pub async fn status(opts: ClientOpts) -> anyhow::Result<()> {
    let client = opts.client()?;
    let topology = client.topology().await?;
    if opts.json {
        out!("{}", topology_json(&topology));
    } else {
        out_raw!("{}", render_topology(&topology));
    }
    Ok(())
}

/// Creates `count` copies of `job` in batches, a few batches in flight, and prints
/// the rate. A person watching (stderr is a terminal) sees a progress bar meanwhile;
/// scripts and logs get only the summary.
/// Said of a create whose answer was lost: it is not retried (that could create the
/// job twice), and it may have been carried out.
const MAYBE_CREATED: &str =
    "no answer came (the connection broke, or the cluster did not answer in time): the job may have been created (look for it before creating it again)";

/// A failed create as reported: with `context`, and the warning of
/// [`MAYBE_CREATED`] when its answer was lost.
fn create_failed(e: courier_client::ClientError, context: Option<String>) -> anyhow::Error {
    let unknown = e.outcome_unknown();
    let mut e = anyhow::Error::new(e);
    if let Some(c) = context {
        e = e.context(c);
    }
    if unknown {
        e = e.context(MAYBE_CREATED);
    }
    e
}

async fn create_many(client: &Client, job: NewJob, count: u32, json: bool) -> anyhow::Result<()> {
    let progress = std::io::stderr()
        .is_terminal()
        .then(|| create_progress_bar(count));
    let start = Instant::now();
    let batches = (0..count)
        .step_by(CREATE_BATCH as usize)
        .map(|first| (count - first).min(CREATE_BATCH) as usize);
    let mut results = futures::stream::iter(batches)
        .map(|n| {
            let client = client.clone();
            let job = job.clone();
            async move { client.create_jobs(std::iter::repeat_n(job, n)).await }
        })
        .buffer_unordered(CREATE_IN_FLIGHT);
    let mut created = 0usize;
    while let Some(result) = results.next().await {
        // Earlier batches are committed; say how far it got.
        let batch = result.map_err(|e| {
            create_failed(e, Some(format!("after creating {created} of {count} jobs")))
        });
        let batch = match batch {
            Ok(keys) => keys.len(),
            Err(e) => {
                if let Some(p) = &progress {
                    p.abandon();
                }
                return Err(e);
            }
        };
        created += batch;
        if let Some(p) = &progress {
            p.inc(batch as u64);
        }
    }
    if let Some(p) = progress {
        p.finish_and_clear();
    }
    let seconds = start.elapsed().as_secs_f64();
    let rate = created as f64 / seconds.max(1e-9);
    if json {
        out!(
            "{}",
            json!({"created": created, "seconds": seconds, "rate": rate})
        );
    } else {
        out!("created {created} jobs in {seconds:.3} s ({rate:.0} jobs/s)");
    }
    Ok(())
}

/// A bar for `count` jobs with the running rate, drawn on stderr.
fn create_progress_bar(count: u32) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(u64::from(count));
    // The template is a constant; should it ever fail to parse, the default style
    // still shows progress.
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{bar:40} {human_pos}/{human_len} jobs  {rate:>12}  {elapsed_precise} (eta {eta})",
    ) {
        // indicatif's own `{per_sec}` prints every decimal of the rate.
        bar.set_style(style.with_key(
            "rate",
            |state: &indicatif::ProgressState, w: &mut dyn std::fmt::Write| {
                let _ = write!(w, "{:.0} jobs/s", state.per_sec());
            },
        ));
    }
    bar
}

/// Prints the outcome of a command that answers nothing but success.
fn done(json: bool, value: Value, text: impl FnOnce() -> String) {
    if json {
        out!("{value}");
    } else {
        out!("{}", text());
    }
}

/// A duration: `500ms`, `10s`, `1.5s`, `5m`, `1h`, or a bare number of
/// milliseconds; a whole number of milliseconds in the end.
pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let invalid = || {
        format!("invalid duration {s:?}: expected e.g. 500ms, 10s, 1.5s, 5m, 1h or a number of ms")
    };
    let end = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(end);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    // A second '.' fails the parse of the digits below.
    if whole.is_empty() {
        return Err(invalid());
    }
    let ms_per_unit: u128 = match unit {
        "" | "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        _ => return Err(invalid()),
    };
    // Exact: (whole.fraction) x unit, in ms, as a ratio of integers.
    let scale = 10u128
        .checked_pow(u32::try_from(fraction.len()).map_err(|_| invalid())?)
        .ok_or_else(invalid)?;
    let digits: u128 = format!("{whole}{fraction}")
        .parse()
        .map_err(|_| invalid())?;
    let scaled = digits.checked_mul(ms_per_unit).ok_or_else(invalid)?;
    if scaled % scale != 0 {
        return Err(format!(
            "invalid duration {s:?}: durations are whole milliseconds"
        ));
    }
    u64::try_from(scaled / scale)
        .map(Duration::from_millis)
        .map_err(|_| invalid())
}

/// A JSON object given on the command line; checked here so a typo fails before any
/// request is sent.
fn parse_json_object(s: &str) -> Result<Value, String> {
    match serde_json::from_str::<Value>(s) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err("expected a JSON object".to_string()),
        Err(e) => Err(format!("invalid JSON: {e}")),
    }
}

/// Embeds a JSON text field as JSON rather than as an escaped string; text that does
/// not parse stays a string.
fn embed(text: &str) -> Value {
    if text.is_empty() {
        return json!({});
    }
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_string()))
}

pub(crate) fn or_empty_object(text: &str) -> &str {
    if text.is_empty() {
        "{}"
    } else {
        text
    }
}

fn activated_json(j: &ActivatedJob) -> Value {
    json!({
        "key": j.key,
        "type": j.r#type,
        "worker": j.worker,
        "retries": j.retries,
        "deadline": j.deadline,
        "tenantId": j.tenant_id,
        "variables": embed(&j.variables),
        "customHeaders": embed(&j.custom_headers),
    })
}

fn state_name(state: i32) -> String {
    JobState::try_from(state)
        .map(|s| s.as_str_name().to_string())
        .unwrap_or_else(|_| format!("UNKNOWN({state})"))
}

pub(crate) fn job_json(j: &Job) -> Value {
    json!({
        "key": j.key,
        "type": j.r#type,
        "state": state_name(j.state),
        "retries": j.retries,
        "worker": j.worker,
        "deadline": j.deadline,
        "retryAt": j.retry_at,
        "errorCode": j.error_code,
        "errorMessage": j.error_message,
        "tenantId": j.tenant_id,
        "createdAt": j.created_at,
        "variables": embed(&j.variables),
        "customHeaders": embed(&j.custom_headers),
    })
}

fn render_job(j: &Job) -> String {
    let dash = |s: &str| {
        if s.is_empty() {
            "-".to_string()
        } else {
            s.to_string()
        }
    };
    let last_error = match (j.error_code.as_str(), j.error_message.as_str()) {
        ("", "") => "-".to_string(),
        ("", message) => message.to_string(),
        (code, "") => code.to_string(),
        (code, message) => format!("{code}: {message}"),
    };
    let mut out = String::new();
    let mut row = |name: &str, value: String| {
        let _ = writeln!(out, "{name:<11}{value}");
    };
    row("key", j.key.to_string());
    row("type", j.r#type.clone());
    row("state", state_name(j.state));
    row("retries", j.retries.to_string());
    row("worker", dash(&j.worker));
    row("deadline", fmt_epoch_ms(j.deadline));
    if j.retry_at != 0 {
        row("retry at", fmt_epoch_ms(j.retry_at));
    }
    row("last error", last_error);
    row("tenant", dash(&j.tenant_id));
    row("created", fmt_epoch_ms(j.created_at));
    row("variables", or_empty_object(&j.variables).to_string());
    row("headers", or_empty_object(&j.custom_headers).to_string());
    out
}

fn role_name(role: i32) -> String {
    PartitionBrokerRole::try_from(role)
        .map(|r| r.as_str_name().to_string())
        .unwrap_or_else(|_| format!("UNKNOWN({role})"))
}

fn health_name(health: i32) -> String {
    PartitionBrokerHealth::try_from(health)
        .map(|h| h.as_str_name().to_string())
        .unwrap_or_else(|_| format!("UNKNOWN({health})"))
}

pub(crate) fn topology_json(t: &TopologyResponse) -> Value {
    let brokers: Vec<Value> = t
        .brokers
        .iter()
        .map(|b| {
            let partitions: Vec<Value> = b
                .partitions
                .iter()
                .map(|p| {
                    json!({
                        "partitionId": p.partition_id,
                        "role": role_name(p.role),
                        "health": health_name(p.health),
                    })
                })
                .collect();
            json!({
                "nodeId": b.node_id,
                "host": b.host,
                "port": b.port,
                "version": b.version,
                "partitions": partitions,
            })
        })
        .collect();
    json!({
        "clusterSize": t.cluster_size,
        "partitionsCount": t.partitions_count,
        "replicationFactor": t.replication_factor,
        "gatewayVersion": t.gateway_version,
        "brokers": brokers,
    })
}

/// The topology as a text report: cluster facts, one row per broker, one line per
/// partition naming its leader.
fn render_topology(t: &TopologyResponse) -> String {
    let mut brokers: Vec<_> = t.brokers.iter().collect();
    brokers.sort_by_key(|b| b.node_id);
    let address =
        |b: &courier_proto::gateway_protocol::BrokerInfo| format!("{}:{}", b.host, b.port);
    let width = brokers
        .iter()
        .map(|b| address(b).len())
        .max()
        .unwrap_or(0)
        .max("ADDRESS".len());

    let mut out = String::new();
    let _ = writeln!(out, "cluster size        {}", t.cluster_size);
    let _ = writeln!(out, "partitions          {}", t.partitions_count);
    let _ = writeln!(out, "replication factor  {}", t.replication_factor);
    let _ = writeln!(out, "gateway version     {}", t.gateway_version);
    let _ = writeln!(out);
    let _ = writeln!(out, "BROKER  {:<width$}  VERSION  PARTITIONS", "ADDRESS");
    for b in &brokers {
        let mut partitions: Vec<_> = b.partitions.iter().collect();
        partitions.sort_by_key(|p| p.partition_id);
        let partitions: Vec<String> = partitions
            .iter()
            .map(|p| {
                format!(
                    "{} {} {}",
                    p.partition_id,
                    role_name(p.role).to_lowercase(),
                    health_name(p.health).to_lowercase()
                )
            })
            .collect();
        // The gateway lists a broker that did not answer its last round without
        // partitions (and one that never answered without a version).
        let partitions = if !partitions.is_empty() {
            partitions.join(", ")
        } else {
            let held = placed_on(t, b.node_id);
            if held.is_empty() {
                "none (holds no replica)".to_string()
            } else {
                format!("no answer: down or unreachable (replicas of {held})")
            }
        };
        let version = if b.version.is_empty() {
            "-"
        } else {
            &b.version
        };
        let _ = writeln!(
            out,
            "{:<6}  {:<width$}  {:<7}  {}",
            b.node_id,
            address(b),
            version,
            partitions
        );
    }
    let _ = writeln!(out);

    // Every partition the cluster should have, plus any a broker reports beyond that.
    let mut ids: BTreeSet<i32> = (1..=t.partitions_count).collect();
    ids.extend(
        brokers
            .iter()
            .flat_map(|b| b.partitions.iter().map(|p| p.partition_id)),
    );
    let _ = writeln!(out, "PARTITION  LEADER");
    for id in ids {
        let leaders: Vec<String> = brokers
            .iter()
            .filter(|b| {
                b.partitions
                    .iter()
                    .any(|p| p.partition_id == id && p.role == PartitionBrokerRole::Leader as i32)
            })
            .map(|b| format!("broker {} ({})", b.node_id, address(b)))
            .collect();
        let leader = if leaders.is_empty() {
            "no leader".to_string()
        } else {
            leaders.join(", ")
        };
        let _ = writeln!(out, "{id:<9}  {leader}");
    }
    let dead: Vec<String> = brokers
        .iter()
        .filter(|b| {
            b.partitions
                .iter()
                .any(|p| p.health == PartitionBrokerHealth::Dead as i32)
        })
        .map(|b| b.node_id.to_string())
        .collect();
    if !dead.is_empty() {
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "dead: the storage of broker {} failed and its replicas stopped for good; its \
             log says what failed. Fix the disk and restart it.",
            dead.join(", ")
        );
    }
    out
}

/// The partitions whose replicas the cluster places on broker `node`, as a list
/// (`1, 3`): brokers place them round-robin over every broker's id.
fn placed_on(t: &TopologyResponse, node: i32) -> String {
    let (Ok(node), Ok(rf)) = (u64::try_from(node), u32::try_from(t.replication_factor)) else {
        return String::new();
    };
    let mut ids: Vec<u64> = t
        .brokers
        .iter()
        .filter_map(|b| u64::try_from(b.node_id).ok())
        .collect();
    ids.sort_unstable();
    let partitions = u32::try_from(t.partitions_count).unwrap_or(0);
    (1..=partitions)
        .filter(|&p| replicas_of(&ids, p, rf).contains(&node))
        .map(|p| p.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Epoch milliseconds as UTC ISO 8601 (`2023-11-14T22:13:20.123Z`); `-` for 0, which
/// the wire uses for "not set".
fn fmt_epoch_ms(ms: i64) -> String {
    if ms == 0 {
        return "-".to_string();
    }
    let days = ms.div_euclid(86_400_000);
    let in_day = ms.rem_euclid(86_400_000);
    // Howard Hinnant's civil_from_days: days since 1970-01-01 -> year, month, day.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        in_day / 3_600_000,
        in_day / 60_000 % 60,
        in_day / 1000 % 60,
        in_day % 1000
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;
