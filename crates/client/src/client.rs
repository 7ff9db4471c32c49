//! [`Client`]: the producer and worker calls over one or more gateways, and their
//! retries.

use crate::error::ClientError;
use crate::gateways::{Gateways, Picked, StreamGateway};
use crate::request::{millis, IntoJsonText, StreamJobs, JOBS_HELD_HEADER, MAX_JOBS_ACTIVE_HEADER};
use crate::retry::{with_retries, Backoff, DEFAULT_BACKOFF, DEFAULT_RETRY_BUDGET};
use crate::security::{AuthChannel, Security};
use courier_proto::courier_v1 as v1;
use courier_proto::gateway_protocol as gw;
use courier_proto::headers::{HEARTBEAT_HEADER, STREAM_ID_HEADER, STREAM_REOPENS_HEADER};
use std::future::Future;
use std::time::Duration;
use tonic::transport::Channel;
use tonic::Status;

/// A handle to a cluster's gateways. Cloning is cheap: clones share the channels,
/// so make one and hand clones to tasks.
///
/// Each call goes to one gateway, chosen per call by power of two choices (fewer
/// calls outstanding, then lower recent latency), passing over one that could not be
/// reached a moment ago; a retry chooses again. See [`Client::connect`] for the
/// addresses it takes.
///
/// Every call retries `UNAVAILABLE` and `RESOURCE_EXHAUSTED` (no leader right now, back
/// pressure) until the retry budget is spent. A command the gateway carried out but
/// whose answer was lost is retried too: a retried create may create a second job, a
/// retried complete may answer `NOT_FOUND`.
///
/// ```no_run
/// use courier_client::{Client, NewJob};
/// use std::time::Duration;
///
/// # async fn example() -> Result<(), courier_client::ClientError> {
/// let client = Client::connect("127.0.0.1:26500")?.with_retry_budget(Duration::from_secs(5));
/// let job = client.create_job(NewJob::new("email").retries(5)).await?;
/// let record = client.get_job(job.key).await?;
/// println!("job {} has {} retries", record.key, record.retries);
/// client.cancel_job(job.key).await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct Client {
    gateways: Gateways,
    backoff: Backoff,
    /// How long one call keeps retrying, counted from its first attempt.
    retry_budget: Duration,
}

/// A job stream as a worker holds it: its jobs, the gateway it is open on, and the
/// heartbeat interval that gateway keeps on it, if any.
pub(crate) struct OpenStream {
    pub jobs: tonic::Streaming<gw::ActivatedJob>,
    pub gateway: StreamGateway,
    pub heartbeat: Option<Duration>,
    /// The id by which the worker may ask the gateway to end it.
    pub id: Option<u64>,
}

impl Client {
    /// A client for the gateways at `addrs`: one address or several, comma-separated,
    /// each `host:port` or `http://host:port`. A host name stands for all the
    /// addresses it resolves to, resolved again every 30 s, so gateways behind one
    /// DNS name (a headless Kubernetes service) all take calls. Connects lazily, on
    /// the first call, so a gateway that is not up yet is not an error here. Must be
    /// called inside a Tokio runtime.
    pub fn connect(addrs: &str) -> Result<Client, ClientError> {
        Client::connect_with(addrs, &Security::default())
    }

    /// A client for the gateways at `addrs` (as for [`Client::connect`]) with TLS and
    /// credentials: `host:port` (TLS when `security` names a CA), `http://host:port`,
    /// or `https://host:port` (checked against `security`'s CA, or the system's roots
    /// without one).
    pub fn connect_with(addrs: &str, security: &Security) -> Result<Client, ClientError> {
        Ok(Client::from_gateways(Gateways::connect(addrs, security)?))
    }

    /// A client over a channel built elsewhere (other settings, TLS): one gateway.
    pub fn from_channel(channel: Channel) -> Client {
        Client::from_gateways(Gateways::single(AuthChannel::new(channel, None)))
    }

    fn from_gateways(gateways: Gateways) -> Client {
        Client {
            gateways,
            backoff: DEFAULT_BACKOFF,
            retry_budget: DEFAULT_RETRY_BUDGET,
        }
    }

    /// The gateway addresses calls go to, as dialled (a host name's resolved
    /// addresses once it has been resolved).
    pub fn gateway_addresses(&self) -> Vec<String> {
        self.gateways.addresses()
    }

    /// How long each call keeps retrying transient failures (default 30 s); zero
    /// turns retries off.
    pub fn with_retry_budget(mut self, budget: Duration) -> Client {
        self.retry_budget = budget;
        self
    }

    /// Creates one job; the answer names its key and partition.
    pub async fn create_job(
        &self,
        job: impl Into<v1::CreateJobRequest>,
    ) -> Result<v1::CreateJobResponse, ClientError> {
        let tp = courier_proto::trace::traceparent_of(&tracing::Span::current());
        self.call(Picked::jobs, job.into(), |mut c, r| {
            let request = with_trace(r, tp.as_deref());
            async move { c.create_job(request).await }
        })
        .await
    }

    /// Creates jobs in one request (one partition, one log entry); returns their keys
    /// in order.
    pub async fn create_jobs(
        &self,
        jobs: impl IntoIterator<Item = impl Into<v1::CreateJobRequest>>,
    ) -> Result<Vec<i64>, ClientError> {
        let request = v1::CreateJobsRequest {
            jobs: jobs.into_iter().map(Into::into).collect(),
        };
        if request.jobs.is_empty() {
            return Ok(Vec::new());
        }
        let tp = courier_proto::trace::traceparent_of(&tracing::Span::current());
        let response = self
            .call(Picked::jobs, request, |mut c, r| {
                let request = with_trace(r, tp.as_deref());
                async move { c.create_jobs(request).await }
            })
            .await?;
        Ok(response.keys)
    }

    /// The job's current record.
    pub async fn get_job(&self, key: i64) -> Result<v1::Job, ClientError> {
        let request = v1::GetJobRequest { key };
        let response = self
            .call(Picked::jobs, request, |mut c, r| async move {
                c.get_job(r).await
            })
            .await?;
        response
            .job
            .ok_or_else(|| Status::internal("GetJob answered without a job").into())
    }

    /// Cancels the job: it is gone, whatever state it was in.
    pub async fn cancel_job(&self, key: i64) -> Result<(), ClientError> {
        let request = v1::CancelJobRequest { key };
        self.call(Picked::jobs, request, |mut c, r| async move {
            c.cancel_job(r).await
        })
        .await?;
        Ok(())
    }

    /// One page of the jobs matching `filter` after `cursor` ("" for the first): the
    /// jobs (without variables and headers) and the next page's cursor ("" at the end).
    pub async fn list_jobs(
        &self,
        filter: v1::JobFilter,
        cursor: &str,
        limit: i32,
    ) -> Result<v1::ListJobsResponse, ClientError> {
        let request = v1::ListJobsRequest {
            filter: Some(filter),
            cursor: cursor.to_string(),
            limit,
        };
        self.call(Picked::jobs, request, |mut c, r| async move {
            c.list_jobs(r).await
        })
        .await
    }

    /// Counts per job type and tenant of the jobs matching `filter`.
    pub async fn job_stats(
        &self,
        filter: v1::JobFilter,
    ) -> Result<v1::JobStatsResponse, ClientError> {
        let request = v1::JobStatsRequest {
            filter: Some(filter),
        };
        self.call(Picked::jobs, request, |mut c, r| async move {
            c.job_stats(r).await
        })
        .await
    }

    /// Sets `retries` on up to `limit` jobs matching `filter` (incidents when it
    /// names no state) after `cursor`.
    pub async fn update_jobs_retries(
        &self,
        filter: v1::JobFilter,
        retries: i32,
        cursor: &str,
        limit: i32,
    ) -> Result<v1::BulkResponse, ClientError> {
        let request = v1::UpdateJobsRetriesRequest {
            filter: Some(filter),
            retries,
            limit,
            cursor: cursor.to_string(),
        };
        self.call(Picked::jobs, request, |mut c, r| async move {
            c.update_jobs_retries(r).await
        })
        .await
    }

    /// Cancels up to `limit` jobs matching `filter` (incidents when it names no
    /// state) after `cursor`.
    pub async fn cancel_jobs(
        &self,
        filter: v1::JobFilter,
        cursor: &str,
        limit: i32,
    ) -> Result<v1::BulkResponse, ClientError> {
        let request = v1::CancelJobsRequest {
            filter: Some(filter),
            limit,
            cursor: cursor.to_string(),
        };
        self.call(Picked::jobs, request, |mut c, r| async move {
            c.cancel_jobs(r).await
        })
        .await
    }

    /// Activates jobs (long polling, as the request says) and returns all the gateway
    /// streamed back. Failures before the first job are retried; once jobs have
    /// arrived they are activated and must not be dropped, so a later stream error is
    /// logged and the jobs received so far are returned.
    pub async fn activate_jobs(
        &self,
        request: impl Into<gw::ActivateJobsRequest>,
    ) -> Result<Vec<gw::ActivatedJob>, ClientError> {
        let request = request.into();
        let jobs = with_retries(self.backoff, self.retry_budget, || {
            let picked = self.gateways.pick();
            let request = request.clone();
            async move {
                let opened = picked.gateway().activate_jobs(request).await;
                // A long poll: it counts as outstanding, but its time says nothing.
                picked.record(&opened, false);
                let mut stream = opened?.into_inner();
                let mut jobs = Vec::new();
                loop {
                    match stream.message().await {
                        Ok(Some(batch)) => jobs.extend(batch.jobs),
                        Ok(None) => return Ok(jobs),
                        Err(status) if jobs.is_empty() => return Err(status),
                        Err(status) => {
                            tracing::warn!(
                                code = ?status.code(),
                                message = status.message(),
                                received = jobs.len(),
                                "activate stream broke after jobs arrived; keeping them"
                            );
                            return Ok(jobs);
                        }
                    }
                }
            }
        })
        .await?;
        Ok(jobs)
    }

    /// Opens a job stream: the gateway pushes jobs of the type to it, activated, as
    /// they become runnable, until the stream is dropped or fails. Opening is retried
    /// like any call; a stream that breaks later is the caller's to reopen (a
    /// [`JobWorker`](crate::JobWorker) does that). A gateway without job push
    /// answers `UNIMPLEMENTED`.
    ///
    /// Every job received is activated for this client: complete, fail or give it
    /// back, or it runs again only after its timeout.
    pub async fn stream_activated_jobs(
        &self,
        request: StreamJobs,
    ) -> Result<tonic::Streaming<gw::ActivatedJob>, ClientError> {
        Ok(self.open_stream(request, None, &[]).await?.jobs)
    }

    /// Gateways this client knows now.
    pub(crate) fn gateway_count(&self) -> usize {
        self.gateways.count()
    }

    /// The gateways not passed over now (none found unreachable a moment ago).
    pub(crate) fn live_gateways(&self) -> Vec<String> {
        self.gateways.live_addresses()
    }

    /// Opens a job stream where streams are fewest, or again on `from`, whose
    /// stream ended at its age, unless it holds more than its share (see
    /// [`Gateways::pick_for_stream`]).
    pub(crate) async fn open_stream(
        &self,
        request: StreamJobs,
        from: Option<&StreamGateway>,
        avoid: &[String],
    ) -> Result<OpenStream, ClientError> {
        let credit = request.credit();
        let heartbeat = request.heartbeat_ms();
        let reopens = request.reopens_stated();
        // Digits, colons and commas only: always a valid header value.
        let held = request
            .held_header()
            .and_then(|h| tonic::metadata::MetadataValue::try_from(h).ok());
        let message = gw::StreamActivatedJobsRequest::from(request);
        let opened = with_retries(self.backoff, self.retry_budget, || {
            let picked = self.gateways.pick_for_stream(from, avoid);
            let mut request = tonic::Request::new(message.clone());
            let md = request.metadata_mut();
            if let Some(n) = credit {
                md.insert(MAX_JOBS_ACTIVE_HEADER, n.into());
            }
            if let Some(held) = &held {
                md.insert(JOBS_HELD_HEADER, held.clone());
            }
            if let Some(ms) = heartbeat {
                md.insert(HEARTBEAT_HEADER, ms.into());
            }
            if reopens {
                md.insert(
                    STREAM_REOPENS_HEADER,
                    tonic::metadata::MetadataValue::from_static("1"),
                );
            }
            async move {
                let opened = picked.gateway().stream_activated_jobs(request).await;
                picked.record(&opened, false);
                if matches!(&opened, Err(s) if s.code() == tonic::Code::ResourceExhausted) {
                    // At its bound of streams: another gateway may have room.
                    picked.pass_over();
                }
                opened.map(|r| (r, picked.stream_opened()))
            }
        })
        .await?;
        let (response, gateway) = opened;
        // The interval the gateway keeps; a gateway that does not echo one sends none.
        let heartbeat = response
            .metadata()
            .get(HEARTBEAT_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|&ms| ms > 0)
            .map(Duration::from_millis);
        let id = response
            .metadata()
            .get(STREAM_ID_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        Ok(OpenStream {
            jobs: response.into_inner(),
            gateway,
            heartbeat,
            id,
        })
    }

    /// Completes an activated job. `variables` is a JSON object, or `""` for none.
    pub async fn complete_job(
        &self,
        key: i64,
        variables: impl IntoJsonText,
    ) -> Result<(), ClientError> {
        let request = gw::CompleteJobRequest {
            job_key: key,
            variables: variables.into_json_text(),
        };
        self.call(Picked::gateway, request, |mut c, r| async move {
            c.complete_job(r).await
        })
        .await?;
        Ok(())
    }

    /// Fails an activated job, leaving it `retries` more tries; with retries left it
    /// runs again after `backoff`, without it becomes an incident.
    pub async fn fail_job(
        &self,
        key: i64,
        retries: i32,
        message: impl Into<String>,
        backoff: Duration,
    ) -> Result<(), ClientError> {
        let request = gw::FailJobRequest {
            job_key: key,
            retries,
            error_message: message.into(),
            retry_back_off: millis(backoff),
            variables: String::new(),
        };
        self.call(Picked::gateway, request, |mut c, r| async move {
            c.fail_job(r).await
        })
        .await?;
        Ok(())
    }

    /// Ends an activated job with a business error.
    pub async fn throw_error(
        &self,
        key: i64,
        code: impl Into<String>,
        message: impl Into<String>,
    ) -> Result<(), ClientError> {
        let request = gw::ThrowErrorRequest {
            job_key: key,
            error_code: code.into(),
            error_message: message.into(),
            variables: String::new(),
        };
        self.call(Picked::gateway, request, |mut c, r| async move {
            c.throw_error(r).await
        })
        .await?;
        Ok(())
    }

    /// Sets the job's retries; a job that had none becomes runnable again.
    pub async fn update_job_retries(&self, key: i64, retries: i32) -> Result<(), ClientError> {
        let request = gw::UpdateJobRetriesRequest {
            job_key: key,
            retries,
            operation_reference: None,
        };
        self.call(Picked::gateway, request, |mut c, r| async move {
            c.update_job_retries(r).await
        })
        .await?;
        Ok(())
    }

    /// Moves an activated job's deadline to `timeout` from now.
    pub async fn update_job_timeout(&self, key: i64, timeout: Duration) -> Result<(), ClientError> {
        let request = gw::UpdateJobTimeoutRequest {
            job_key: key,
            timeout: millis(timeout),
            operation_reference: None,
        };
        self.call(Picked::gateway, request, |mut c, r| async move {
            c.update_job_timeout(r).await
        })
        .await?;
        Ok(())
    }

    /// The cluster as the gateway sees it: brokers, partitions, leaders, health.
    pub async fn topology(&self) -> Result<gw::TopologyResponse, ClientError> {
        self.call(
            Picked::gateway,
            gw::TopologyRequest {},
            |mut c, r| async move { c.topology(r).await },
        )
        .await
    }

    /// One unary call with retries: each attempt picks a gateway and calls `rpc` on
    /// a clone of its `stub` (the generated methods take `&mut self`) with a clone
    /// of the request.
    async fn call<S, Req, Resp, F, Fut>(
        &self,
        stub: fn(&Picked) -> S,
        request: Req,
        rpc: F,
    ) -> Result<Resp, ClientError>
    where
        Req: Clone,
        F: Fn(S, Req) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, Status>>,
    {
        let response = with_retries(self.backoff, self.retry_budget, || {
            let picked = self.gateways.pick();
            let call = rpc(stub(&picked), request.clone());
            async move {
                let outcome = call.await;
                picked.record(&outcome, true);
                outcome
            }
        })
        .await?;
        Ok(response.into_inner())
    }
}

/// A request carrying `traceparent` in its metadata: the jobs it creates join the
/// caller's trace (its current span, where the application records spans with
/// OpenTelemetry).
fn with_trace<T>(message: T, traceparent: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(value) = traceparent.and_then(|tp| tp.parse().ok()) {
        request
            .metadata_mut()
            .insert(courier_proto::trace::TRACEPARENT, value);
    }
    request
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gateways::endpoint;

    fn uri(addr: &str) -> Result<String, String> {
        endpoint(addr)
            .map(|e| e.uri().to_string())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn addresses_take_host_port_with_or_without_http() {
        assert_eq!(
            uri("127.0.0.1:26500").as_deref(),
            Ok("http://127.0.0.1:26500/")
        );
        assert_eq!(uri(" localhost:1 ").as_deref(), Ok("http://localhost:1/"));
        assert_eq!(uri("http://gw:26500").as_deref(), Ok("http://gw:26500/"));
        assert_eq!(uri("[::1]:26500").as_deref(), Ok("http://[::1]:26500/"));
    }

    #[test]
    fn unusable_addresses_are_connect_errors() {
        for bad in [
            "",
            "localhost",
            "http://gw",
            "ftp://gw:21",
            "unix:///tmp/s",
            "a b:1",
            ":26500",
        ] {
            let err = uri(bad).err();
            assert!(err.is_some(), "{bad:?} was accepted");
        }
        let err = uri("ftp://gw:21").err().unwrap_or_default();
        assert!(err.contains("unsupported scheme ftp://"), "{err}");
        assert_eq!(uri("https://gw:443").as_deref(), Ok("https://gw:443/"));
    }

    #[test]
    fn connecting_outside_a_runtime_is_an_error_not_a_panic() {
        let err = Client::connect("127.0.0.1:26500").err();
        assert!(matches!(err, Some(ClientError::Connect { .. })));
    }

    /// Callers spawn these futures, so they must stay `Send`; this fails to compile
    /// otherwise.
    #[allow(dead_code)]
    fn call_futures_are_send(c: &Client) {
        fn send<T: Send>(_: T) {}
        send(c.create_job(crate::NewJob::new("t")));
        send(c.create_jobs([crate::NewJob::new("t")]));
        send(c.activate_jobs(crate::ActivateJobs::new("t")));
        send(c.complete_job(1, "{}"));
        send(c.stream_activated_jobs(crate::StreamJobs::new("t")));
        send(c.topology());
    }

    #[tokio::test]
    async fn connecting_is_lazy() {
        // Nothing listens on port 1; the client is still made.
        let client = Client::connect("127.0.0.1:1").map(|c| c.with_retry_budget(Duration::ZERO));
        assert!(client.is_ok());
        if let Ok(c) = client {
            let code = c.topology().await.err().and_then(|e| e.code());
            assert_eq!(code, Some(tonic::Code::Unavailable));
        }
    }
}
