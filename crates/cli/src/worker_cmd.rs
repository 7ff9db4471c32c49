//! `courier worker TYPE --handler CMD`: a [`JobWorker`] whose handler is a shell
//! command, as with `zbctl create worker`. Each job runs `sh -c CMD` with the job's
//! variables as JSON on stdin; a JSON object printed on stdout completes the job
//! with those variables, a non-zero exit fails it with stderr as the message.

use crate::client_cmds::{or_empty_object, parse_duration, ClientOpts};
use courier_client::{ActivatedJob, JobOutcome, JobWorker};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

/// The most bytes of a job's headers passed in COURIER_JOB_HEADERS. Linux refuses
/// to start a program with one environment string over 128 KiB (E2BIG), which would
/// fail the job and spend a retry; larger headers go in a file named by
/// COURIER_JOB_HEADERS_FILE instead.
const HEADERS_IN_ENV: usize = 32 * 1024;

/// The most of a handler's stderr or stdout quoted in a failure message: the end
/// of it, where the error usually is.
const MESSAGE_LIMIT: usize = 2000;

/// The worker's options.
#[derive(clap::Args, Debug, PartialEq)]
pub struct WorkerArgs {
    /// The job type to work on.
    #[arg(value_name = "TYPE")]
    pub job_type: String,
    /// The command run for each job (with `sh -c`). It reads the job's variables as
    /// JSON on stdin; a JSON object it prints on stdout completes the job with those
    /// variables (nothing printed: no variables); a non-zero exit fails the job with
    /// stderr as the message. COURIER_JOB_KEY, COURIER_JOB_TYPE, COURIER_JOB_RETRIES
    /// and COURIER_JOB_HEADERS describe the job (headers over 32 KiB are in the file
    /// COURIER_JOB_HEADERS_FILE names instead).
    #[arg(long)]
    pub handler: String,
    /// At most this many jobs at a time.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_jobs_active: u32,
    /// How long a job may take before it runs again elsewhere.
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Only long-poll: open no job stream.
    #[arg(long)]
    pub no_stream: bool,
    /// The worker name recorded on the jobs.
    #[arg(long, default_value = "courier-worker")]
    pub name: String,
    /// On Ctrl-C or SIGTERM, how long running handlers may take to finish before
    /// their jobs are given back.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub grace: Duration,
    /// Take jobs of this tenant (repeatable; default: <default>).
    #[arg(long = "tenant")]
    pub tenants: Vec<String>,
    /// Hand the handler only this variable (repeatable; default: all).
    #[arg(long = "fetch-variable")]
    pub fetch_variables: Vec<String>,
    #[command(flatten)]
    pub otlp: crate::telemetry::OtlpArgs,
}

/// Runs the worker until Ctrl-C or SIGTERM, then shuts it down gracefully and prints
/// what it did.
pub async fn worker(opts: ClientOpts, args: WorkerArgs) -> anyhow::Result<()> {
    let json = opts.json;
    let command = Arc::new(args.handler);
    let worker = JobWorker::builder(opts.client()?, &args.job_type, move |job| {
        let command = Arc::clone(&command);
        async move { Ok::<_, Infallible>(run_handler(&command, &job).await) }
    })
    // A job's line is printed once the gateway has answered its outcome, so what
    // the worker prints is what the broker recorded.
    .on_reported(move |key, outcome, recorded| print_outcome(json, key, outcome, recorded))
    .max_jobs_active(args.max_jobs_active)
    .timeout(args.timeout)
    .name(args.name)
    .streaming(!args.no_stream)
    .shutdown_grace(args.grace)
    .tenant_ids(args.tenants)
    .fetch_variables(args.fetch_variables)
    .spawn()?;
    eprintln!(
        "working on {} jobs from {} ({}, at most {} at a time); Ctrl-C stops",
        args.job_type,
        opts.address,
        if args.no_stream {
            "polling"
        } else {
            "streaming, polling as fallback"
        },
        args.max_jobs_active
    );

    wait_for_signal().await;
    eprintln!(
        "stopping: letting running handlers finish (up to {:?}; Ctrl-C again gives their jobs back now)",
        args.grace
    );
    let metrics = worker.metrics().clone();
    let handle = worker.shutdown_handle();
    let second = tokio::spawn(async move {
        wait_for_signal().await;
        eprintln!("stopping now: giving the running handlers' jobs back");
        handle.give_back_now();
    });
    worker.shutdown().await;
    second.abort();
    let s = metrics.snapshot();
    if json {
        report!(
            "{}",
            json!({
                "completed": s.completed,
                "failed": s.failed,
                "givenBack": s.given_back_no_capacity + s.given_back_shutdown,
                "pushed": s.pushed,
                "polled": s.polled,
                "commandsFailed": s.commands_failed,
            })
        );
    } else {
        report!(
            "stopped: {} completed, {} failed, {} given back, {} outcomes not recorded; received {} pushed, {} polled",
            s.completed,
            s.failed,
            s.given_back_no_capacity + s.given_back_shutdown,
            s.commands_failed,
            s.pushed,
            s.polled
        );
    }
    Ok(())
}

/// Returns on Ctrl-C or SIGTERM.
async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

/// Runs the handler command for one job and reads its outcome.
async fn run_handler(command: &str, job: &ActivatedJob) -> JobOutcome {
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(command)
        .env("COURIER_JOB_KEY", job.key.to_string())
        .env("COURIER_JOB_TYPE", &job.r#type)
        .env("COURIER_JOB_RETRIES", job.retries.to_string());
    // A handler that records spans joins the job's trace: its parent is this
    // worker's span of the job, or the job's producer where this worker exports none.
    let span = courier_proto::trace::traceparent_of(&tracing::Span::current());
    if let Some(tp) = span.or_else(|| courier_proto::trace::in_headers(&job.custom_headers)) {
        cmd.env("TRACEPARENT", tp);
    }
    let headers = or_empty_object(&job.custom_headers);
    // Removed when the handler is done, whatever happened.
    let _headers_file = if headers.len() <= HEADERS_IN_ENV {
        cmd.env("COURIER_JOB_HEADERS", headers);
        None
    } else {
        match HeadersFile::write(job.key, headers).await {
            Ok(file) => {
                cmd.env("COURIER_JOB_HEADERS_FILE", &file.0);
                Some(file)
            }
            // This worker's own trouble, not the job's: no retry is spent on it.
            Err(e) => {
                return JobOutcome::fail_with(
                    format!("cannot write the job's headers for its handler: {e}"),
                    job.retries,
                    Duration::from_secs(5),
                );
            }
        }
    };
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // A handler abandoned at the end of the shutdown grace is killed with it.
        .kill_on_drop(true);
    // Its own process group: Ctrl-C in a terminal signals the whole foreground
    // group, and the handlers must live through it to finish within the grace.
    #[cfg(unix)]
    cmd.process_group(0);
    let mut child = match cmd.spawn() {
        Ok(child) => child,
        Err(e) => return JobOutcome::fail(format!("cannot start the handler: {e}")),
    };
    let mut group = HandlerGroup(child.id());
    let stdin = child.stdin.take();
    let variables = or_empty_object(&job.variables).to_string();
    let feed = async move {
        if let Some(mut stdin) = stdin {
            // A handler need not read its input; the broken pipe that follows is
            // no error. Dropping stdin closes it, which ends the handler's input.
            let _ = stdin.write_all(variables.as_bytes()).await;
        }
    };
    let ((), output) = tokio::join!(feed, child.wait_with_output());
    group.0 = None;
    match output {
        Ok(out) => outcome_of(out.status, &out.stdout, &out.stderr),
        Err(e) => JobOutcome::fail(format!("cannot run the handler: {e}")),
    }
}

/// A job's headers in a file of the system's temporary folder, removed on drop.
struct HeadersFile(std::path::PathBuf);

impl HeadersFile {
    async fn write(key: i64, headers: &str) -> std::io::Result<HeadersFile> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!(
            "courier-job-{key}-{}-{n}-headers.json",
            std::process::id()
        ));
        tokio::fs::write(&path, headers).await?;
        Ok(HeadersFile(path))
    }
}

impl Drop for HeadersFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The process group of a running handler (its id is the shell's pid). Dropped
/// before the handler ended (abandoned at the end of the shutdown grace, its job
/// given back), it kills the whole group: `kill_on_drop` ends only the shell, and
/// what the shell started would go on running a job that may already run elsewhere.
struct HandlerGroup(Option<u32>);

impl Drop for HandlerGroup {
    fn drop(&mut self) {
        #[cfg(unix)]
        if let Some(pgid) = self.0 {
            // The standard library has no killpg; kill(1) signals a group given as -ID.
            let killed = std::process::Command::new("kill")
                .args(["-KILL", "--", &format!("-{pgid}")])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            if let Err(e) = killed {
                tracing::warn!(error = %e, pgid, "could not kill an abandoned handler's processes");
            }
        }
    }
}

/// The job's outcome from how the handler ended and what it printed.
fn outcome_of(status: ExitStatus, stdout: &[u8], stderr: &[u8]) -> JobOutcome {
    if !status.success() {
        let stderr = String::from_utf8_lossy(stderr);
        let stderr = stderr.trim();
        return JobOutcome::fail(if stderr.is_empty() {
            format!("the handler failed ({status})")
        } else {
            tail(stderr, MESSAGE_LIMIT).to_string()
        });
    }
    let stdout = String::from_utf8_lossy(stdout);
    let stdout = stdout.trim();
    if stdout.is_empty() {
        return JobOutcome::complete();
    }
    match serde_json::from_str::<Value>(stdout) {
        Ok(v @ Value::Object(_)) => JobOutcome::complete_with(v),
        _ => JobOutcome::fail(format!(
            "the handler's output is not a JSON object: {}",
            tail(stdout, MESSAGE_LIMIT)
        )),
    }
}

/// The last `max` bytes of `s`, or a little less, cut at a character boundary.
fn tail(s: &str, max: usize) -> &str {
    let mut start = s.len().saturating_sub(max);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

/// One line per job on stdout: what the handler decided, once the broker recorded
/// it, or why it was not recorded.
fn print_outcome(
    json: bool,
    key: i64,
    outcome: &JobOutcome,
    recorded: Result<(), &courier_client::ClientError>,
) {
    if let Err(e) = recorded {
        let what = match outcome {
            JobOutcome::Complete { .. } => "completed",
            JobOutcome::Fail { .. } => "failed",
            JobOutcome::ThrowError { .. } => "errorThrown",
        };
        // The connection broke while the outcome was out: it may have been recorded.
        let unknown = e.outcome_unknown();
        if json {
            let recorded = if unknown { Value::Null } else { json!(false) };
            report!(
                "{}",
                json!({"key": key, "outcome": what, "recorded": recorded, "error": e.to_string()})
            );
        } else if unknown {
            report!("job {key} {what} by its handler, not known whether recorded: {e}");
        } else {
            report!("job {key} {what} by its handler, not recorded: {e}");
        }
        return;
    }
    match outcome {
        JobOutcome::Complete { variables } => {
            if json {
                let variables = serde_json::from_str::<Value>(or_empty_object(variables))
                    .unwrap_or_else(|_| json!({}));
                report!(
                    "{}",
                    json!({"key": key, "outcome": "completed", "recorded": true, "variables": variables})
                );
            } else {
                report!("completed job {key} {}", or_empty_object(variables));
            }
        }
        JobOutcome::Fail { message, .. } => {
            if json {
                report!(
                    "{}",
                    json!({"key": key, "outcome": "failed", "recorded": true, "message": message})
                );
            } else {
                report!("failed job {key}: {message}");
            }
        }
        JobOutcome::ThrowError { code, message } => {
            if json {
                report!(
                    "{}",
                    json!({"key": key, "outcome": "errorThrown", "recorded": true, "errorCode": code, "message": message})
                );
            } else {
                report!("threw error {code} on job {key}: {message}");
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use clap::Parser;
    use std::os::unix::process::ExitStatusExt;

    fn exit(code: i32) -> ExitStatus {
        ExitStatus::from_raw(code << 8)
    }

    #[tokio::test]
    async fn headers_too_large_for_the_environment_reach_the_handler_in_a_file() {
        let small = r#"{"a":"b"}"#.to_string();
        let large = format!(r#"{{"big":"{}"}}"#, "x".repeat(300 * 1024));
        // The handler prints how many bytes of headers it was given, whichever way.
        let handler = r#"if [ -n "$COURIER_JOB_HEADERS_FILE" ]; then n=$(wc -c < "$COURIER_JOB_HEADERS_FILE"); else n=$(printf %s "$COURIER_JOB_HEADERS" | wc -c); fi; echo "{\"bytes\": $n, \"type\": \"$COURIER_JOB_TYPE\"}""#;
        for headers in [small, large] {
            let job = ActivatedJob {
                key: 7,
                r#type: "t".into(),
                custom_headers: headers.clone(),
                ..Default::default()
            };
            let expected = format!(r#"{{"bytes":{},"type":"t"}}"#, headers.len());
            assert_eq!(
                run_handler(handler, &job).await,
                JobOutcome::complete_with(expected.as_str())
            );
        }
        let left = std::fs::read_dir(std::env::temp_dir())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| {
                let name = e.file_name().to_string_lossy().to_string();
                name.starts_with("courier-job-7-") && name.contains(&std::process::id().to_string())
            })
            .count();
        assert_eq!(left, 0, "the headers file is removed");
    }

    #[test]
    fn output_decides_the_outcome() {
        assert_eq!(
            outcome_of(exit(0), b"{\"sent\": true}\n", b"chatter"),
            JobOutcome::complete_with(r#"{"sent":true}"#)
        );
        assert_eq!(outcome_of(exit(0), b" \n", b""), JobOutcome::complete());
        assert_eq!(
            outcome_of(exit(0), b"done", b""),
            JobOutcome::fail("the handler's output is not a JSON object: done")
        );
        assert_eq!(
            outcome_of(exit(0), b"[1]", b""),
            JobOutcome::fail("the handler's output is not a JSON object: [1]")
        );
        assert_eq!(
            outcome_of(exit(3), b"{}", b"no route to host\n"),
            JobOutcome::fail("no route to host")
        );
        assert_eq!(
            outcome_of(exit(3), b"", b""),
            JobOutcome::fail("the handler failed (exit status: 3)")
        );
        assert_eq!(
            outcome_of(ExitStatus::from_raw(9), b"", b""),
            JobOutcome::fail("the handler failed (signal: 9 (SIGKILL))")
        );
        let long = format!("{}END", "é".repeat(MESSAGE_LIMIT));
        let JobOutcome::Fail { message, .. } = outcome_of(exit(1), b"", long.as_bytes()) else {
            panic!("not a failure");
        };
        assert!(message.len() <= MESSAGE_LIMIT && message.ends_with("éEND"));
    }

    #[derive(Parser, Debug)]
    struct TestCli {
        #[command(flatten)]
        args: WorkerArgs,
    }

    #[test]
    fn worker_defaults_and_options() {
        let a = TestCli::try_parse_from(["w", "email", "--handler", "cat"])
            .unwrap()
            .args;
        assert_eq!(
            a,
            WorkerArgs {
                otlp: Default::default(),
                job_type: "email".into(),
                handler: "cat".into(),
                max_jobs_active: 32,
                timeout: Duration::from_secs(300),
                no_stream: false,
                name: "courier-worker".into(),
                grace: Duration::from_secs(10),
                tenants: vec![],
                fetch_variables: vec![],
            }
        );
        let a = TestCli::try_parse_from([
            "w",
            "email",
            "--handler",
            "cat",
            "--max-jobs-active",
            "4",
            "--timeout",
            "30s",
            "--no-stream",
            "--name",
            "mailer",
            "--grace",
            "1m",
            "--tenant",
            "acme",
            "--fetch-variable",
            "to",
        ])
        .unwrap()
        .args;
        assert_eq!(
            (a.max_jobs_active, a.timeout, a.no_stream, a.name.as_str()),
            (4, Duration::from_secs(30), true, "mailer")
        );
        assert_eq!(
            (a.grace, a.tenants, a.fetch_variables),
            (
                Duration::from_secs(60),
                vec!["acme".into()],
                vec!["to".into()]
            )
        );
        for bad in [
            &["w", "email"][..],
            &["w", "--handler", "cat"],
            &["w", "email", "--handler", "cat", "--max-jobs-active", "0"],
        ] {
            assert!(
                TestCli::try_parse_from(bad).is_err(),
                "{bad:?} was accepted"
            );
        }
    }
}
