//! Rust client for Courier, a Zeebe-compatible job-push broker.
//!
//! A [`Client`] is one gRPC channel to a gateway. It creates jobs through Courier's
//! producer API (`courier.v1.Jobs`) and drives them through Zeebe's job API
//! (`gateway_protocol.Gateway`), both served on the gateway's port. Every call retries
//! `UNAVAILABLE` and `RESOURCE_EXHAUSTED` with full-jitter back-off, within the client's
//! retry budget.
//!
//! ```no_run
//! use courier_client::{ActivateJobs, Client, NewJob};
//! use serde_json::json;
//!
//! # async fn example() -> Result<(), courier_client::ClientError> {
//! let client = Client::connect("127.0.0.1:26500")?;
//! let created = client
//!     .create_job(NewJob::new("payment").variables(json!({ "amount": 42 })))
//!     .await?;
//! println!("created job {} on partition {}", created.key, created.partition_id);
//!
//! let jobs = client.activate_jobs(ActivateJobs::new("payment").worker("billing")).await?;
//! for job in jobs {
//!     client.complete_job(job.key, json!({ "paid": true })).await?;
//! }
//! # Ok(())
//! # }
//! ```
//!
//! A [`JobWorker`] runs a handler for every job of a type: jobs are pushed to it on a
//! stream the moment they are runnable, polled when push cannot deliver, and never
//! more than its max jobs active at once.
//!
//! ```no_run
//! use courier_client::{Client, JobOutcome, JobWorker};
//!
//! # async fn example() -> Result<(), courier_client::ClientError> {
//! let client = Client::connect("127.0.0.1:26500")?;
//! let worker = JobWorker::builder(client, "payment", |job| async move {
//!     println!("charging for job {}: {}", job.key, job.variables);
//!     Ok::<_, std::convert::Infallible>(JobOutcome::complete())
//! })
//! .spawn()?;
//! tokio::signal::ctrl_c().await.ok();
//! worker.shutdown().await;
//! # Ok(())
//! # }
//! ```
//!
//! # Layout
//! - [`client`]: [`Client`], the calls and their retries.
//! - [`request`]: builders for what a call sends ([`NewJob`], [`ActivateJobs`],
//!   [`StreamJobs`]) and [`IntoJsonText`] for variables and headers.
//! - `retry`: the back-off schedule and the retry budget.
//! - [`error`]: the one error type, [`ClientError`].
//! - [`worker`]: [`JobWorker`], which runs a handler for every job of a type: pushed on a
//!   stream first, polled as a fallback, within its max jobs active, with graceful
//!   shutdown and [`WorkerMetrics`].

pub mod client;
pub mod error;
mod gateways;
pub mod request;
mod retry;
pub mod security;
pub mod worker;

pub use client::Client;
pub use courier_proto::courier_v1::{
    BulkResponse, CreateJobResponse, Job, JobFilter, JobState, JobStatsResponse, ListJobsResponse,
    TypeStats,
};
pub use courier_proto::gateway_protocol::{ActivatedJob, TopologyResponse};
pub use error::ClientError;
pub use request::{
    ActivateJobs, IntoJsonText, NewJob, StreamJobs, JOBS_HELD_HEADER, MAX_DECLARED_HELD,
    MAX_JOBS_ACTIVE_HEADER,
};
pub use retry::DEFAULT_RETRY_BUDGET;
pub use security::{Credentials, OAuthCredentials, Security};
pub use worker::{
    JobOutcome, JobWorker, JobWorkerBuilder, ShutdownHandle, WorkerMetrics, WorkerMetricsSnapshot,
};
