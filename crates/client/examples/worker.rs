//! A worker for `email` jobs: it "sends" each mail, completes the job with
//! `{"sent": true}`, fails jobs without a recipient, and stops cleanly on Ctrl-C.
//!
//! ```sh
//! courier dev                                              # in another terminal
//! cargo run -p courier-client --example producer -- 20     # some jobs
//! cargo run -p courier-client --example worker             # work them off
//! ```
//! The gateway address comes from `COURIER_ADDRESS` (default `127.0.0.1:26500`).

use courier_client::{ActivatedJob, Client, JobOutcome, JobWorker};
use serde_json::{json, Value};
use std::time::Duration;

/// Handles one job. An `Err` would fail the job with its message, as a panic would.
async fn send_email(job: ActivatedJob) -> Result<JobOutcome, serde_json::Error> {
    let vars: Value = serde_json::from_str(&job.variables)?;
    let Some(to) = vars["to"].as_str() else {
        // A failure the job cannot recover from by retrying: use up its retries.
        return Ok(JobOutcome::fail_with("no recipient", 0, Duration::ZERO));
    };
    tokio::time::sleep(Duration::from_millis(50)).await; // the SMTP call
    println!("sent mail to {to} (job {})", job.key);
    Ok(JobOutcome::complete_with(json!({ "sent": true })))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let address = std::env::var("COURIER_ADDRESS").unwrap_or_else(|_| "127.0.0.1:26500".into());
    let client = Client::connect(&address)?;
    let worker = JobWorker::builder(client, "email", send_email)
        .name("example-mailer")
        .max_jobs_active(8)
        .timeout(Duration::from_secs(30))
        .spawn()?;
    println!("working on email jobs from {address}; Ctrl-C stops");

    tokio::signal::ctrl_c().await?;
    let metrics = worker.metrics().clone();
    worker.shutdown().await;
    let s = metrics.snapshot();
    println!(
        "stopped: {} completed, {} failed; {} pushed, {} polled",
        s.completed, s.failed, s.pushed, s.polled
    );
    Ok(())
}
