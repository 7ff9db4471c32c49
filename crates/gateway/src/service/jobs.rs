//! Courier's `courier.v1.Jobs` service, for producers: create, get and cancel; and
//! for Courier's worker, the end of one of its streams.

use super::inspect::page_limit;
use super::*;
use courier_proto::trace;

/// Courier's producer service.
#[derive(Clone)]
pub struct JobsService(pub Arc<Shared>);

#[tonic::async_trait]
impl Jobs for JobsService {
    async fn create_job(
        &self,
        request: tonic::Request<v1::CreateJobRequest>,
    ) -> Result<Response<v1::CreateJobResponse>, Status> {
        let deadline = self.0.deadline(&request);
        let caller = auth::caller(&request);
        let incoming = traceparent_in(&request);
        let mut r = request.into_inner();
        let span = tracing::info_span!("CreateJob", job_type = %loggable(&r.r#type));
        let carried = traced(&span, incoming);
        carry(&mut r, carried.as_deref());
        unary("CreateJob", span, async {
            let mut job = convert::create_request(&r).map_err(invalid)?;
            auth::own_tenant(caller.as_deref(), &mut job, r.tenant_id.is_empty())?;
            let (keys, partition) = self.0.create(vec![job], deadline).await?;
            let key = keys.first().ok_or_else(|| {
                GatewayError::from(BrokerError::Internal("broker created no job".into()))
            })?;
            tracing::debug!(job_key = key.0, "created");
            Ok(v1::CreateJobResponse {
                key: key.0,
                partition_id: to_i32(partition.0.into()),
            })
        })
        .await
    }

    async fn create_jobs(
        &self,
        request: tonic::Request<v1::CreateJobsRequest>,
    ) -> Result<Response<v1::CreateJobsResponse>, Status> {
        let deadline = self.0.deadline(&request);
        let caller = auth::caller(&request);
        let incoming = traceparent_in(&request);
        let mut r = request.into_inner();
        let span = tracing::info_span!("CreateJobs", jobs = r.jobs.len());
        let carried = traced(&span, incoming);
        for job in &mut r.jobs {
            carry(job, carried.as_deref());
        }
        unary("CreateJobs", span, async {
            let mut jobs = create_batch(&r.jobs)?;
            for (job, asked) in jobs.iter_mut().zip(&r.jobs) {
                auth::own_tenant(caller.as_deref(), job, asked.tenant_id.is_empty())?;
            }
            let (keys, partition) = self.0.create(jobs, deadline).await?;
            Ok(v1::CreateJobsResponse {
                keys: keys.into_iter().map(|k| k.0).collect(),
                partition_id: to_i32(partition.0.into()),
            })
        })
        .await
    }

    async fn get_job(
        &self,
        request: tonic::Request<v1::GetJobRequest>,
    ) -> Result<Response<v1::GetJobResponse>, Status> {
        let deadline = self.0.deadline(&request);
        let caller = auth::caller(&request);
        let r = request.into_inner();
        let span = tracing::info_span!("GetJob", job_key = r.key);
        unary("GetJob", span, async {
            let key = JobKey(r.key);
            match self
                .0
                .on_job(caller.as_deref(), key, Request::GetJob { key }, deadline)
                .await?
            {
                Reply::Job(view) => Ok(v1::GetJobResponse {
                    job: Some(view.into()),
                }),
                other => Err(unexpected(&other)),
            }
        })
        .await
    }

    async fn cancel_job(
        &self,
        request: tonic::Request<v1::CancelJobRequest>,
    ) -> Result<Response<v1::CancelJobResponse>, Status> {
        let deadline = self.0.deadline(&request);
        let caller = auth::caller(&request);
        let r = request.into_inner();
        let span = tracing::info_span!("CancelJob", job_key = r.key);
        unary("CancelJob", span, async {
            let command = Command::Cancel { key: JobKey(r.key) };
            self.0
                .job_command(caller.as_deref(), r.key, Ok(command), deadline)
                .await?;
            Ok(v1::CancelJobResponse {})
        })
        .await
    }

    async fn list_jobs(
        &self,
        request: tonic::Request<v1::ListJobsRequest>,
    ) -> Result<Response<v1::ListJobsResponse>, Status> {
        let deadline = self.0.deadline(&request);
        let caller = auth::caller(&request);
        let r = request.into_inner();
        let span = tracing::info_span!("ListJobs", limit = r.limit);
        unary("ListJobs", span, async {
            let filter = convert::job_filter(r.filter.as_ref()).map_err(invalid)?;
            let cursor = convert::cursor(&r.cursor).map_err(invalid)?;
            let (jobs, next) = self
                .0
                .list_jobs(
                    caller.as_deref(),
                    &filter,
                    cursor,
                    page_limit(r.limit),
                    deadline,
                )
                .await?;
            Ok(v1::ListJobsResponse {
                jobs: jobs.into_iter().map(v1::Job::from).collect(),
                cursor: next.map(|k| k.to_string()).unwrap_or_default(),
            })
        })
        .await
    }

    async fn job_stats(
        &self,
        request: tonic::Request<v1::JobStatsRequest>,
    ) -> Result<Response<v1::JobStatsResponse>, Status> {
        let deadline = self.0.deadline(&request);
        let caller = auth::caller(&request);
        let r = request.into_inner();
        let span = tracing::info_span!("JobStats");
        unary("JobStats", span, async {
            let filter = convert::job_filter(r.filter.as_ref()).map_err(invalid)?;
            let types = self
                .0
                .job_stats(caller.as_deref(), &filter, deadline)
                .await?;
            Ok(v1::JobStatsResponse {
                types,
                now: epoch_ms(),
            })
        })
        .await
    }

    async fn update_jobs_retries(
        &self,
        request: tonic::Request<v1::UpdateJobsRetriesRequest>,
    ) -> Result<Response<v1::BulkResponse>, Status> {
        let deadline = self.0.deadline(&request);
        let caller = auth::caller(&request);
        let r = request.into_inner();
        let span = tracing::info_span!("UpdateJobsRetries", retries = r.retries);
        unary("UpdateJobsRetries", span, async {
            let change = Bulk::UpdateRetries(r.retries);
            self.bulk(
                caller.as_deref(),
                r.filter.as_ref(),
                &r.cursor,
                r.limit,
                change,
                deadline,
            )
            .await
        })
        .await
    }

    async fn cancel_jobs(
        &self,
        request: tonic::Request<v1::CancelJobsRequest>,
    ) -> Result<Response<v1::BulkResponse>, Status> {
        let deadline = self.0.deadline(&request);
        let caller = auth::caller(&request);
        let r = request.into_inner();
        let span = tracing::info_span!("CancelJobs");
        unary("CancelJobs", span, async {
            self.bulk(
                caller.as_deref(),
                r.filter.as_ref(),
                &r.cursor,
                r.limit,
                Bulk::Cancel,
                deadline,
            )
            .await
        })
        .await
    }

    async fn end_stream(
        &self,
        request: tonic::Request<v1::EndStreamRequest>,
    ) -> Result<Response<v1::EndStreamResponse>, Status> {
        let id = request.get_ref().stream_id;
        let span = tracing::debug_span!("EndStream", stream = id);
        unary("EndStream", span, async {
            Ok(v1::EndStreamResponse {
                ended: self.0.endable.end(id),
            })
        })
        .await
    }

    async fn stream_alive(
        &self,
        request: tonic::Request<v1::StreamAliveRequest>,
    ) -> Result<Response<v1::StreamAliveResponse>, Status> {
        let id = request.get_ref().stream_id;
        let span = tracing::trace_span!("StreamAlive", stream = id);
        unary("StreamAlive", span, async {
            Ok(v1::StreamAliveResponse {
                open: self.0.endable.alive(id),
            })
        })
        .await
    }
}

impl JobsService {
    async fn bulk(
        &self,
        caller: Option<&Caller>,
        filter: Option<&v1::JobFilter>,
        cursor: &str,
        limit: i32,
        change: Bulk,
        deadline: Instant,
    ) -> Result<v1::BulkResponse, GatewayError> {
        let filter = convert::job_filter(filter).map_err(invalid)?;
        let cursor = convert::cursor(cursor).map_err(invalid)?;
        let out = self
            .0
            .bulk(caller, filter, cursor, page_limit(limit), change, deadline)
            .await?;
        tracing::info!(
            changed = out.changed.len(),
            failed = out.failed.len(),
            ?change,
            "bulk change"
        );
        Ok(v1::BulkResponse {
            keys: out.changed.into_iter().map(|k| k.0).collect(),
            failures: out
                .failed
                .into_iter()
                .map(|(k, reason)| v1::BulkFailure { key: k.0, reason })
                .collect(),
            cursor: out.cursor.map(|k| k.to_string()).unwrap_or_default(),
        })
    }
}

/// The gateway's clock, epoch ms.
fn epoch_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Validates a CreateJobs batch; errors name the offending entry.
pub(super) fn create_batch(jobs: &[v1::CreateJobRequest]) -> Result<Vec<NewJob>, GatewayError> {
    if jobs.is_empty() {
        return Err(invalid("jobs must not be empty"));
    }
    if jobs.len() > MAX_BATCH {
        return Err(invalid(format!(
            "jobs has {} entries, more than the limit of {MAX_BATCH}",
            jobs.len()
        )));
    }
    jobs.iter()
        .enumerate()
        .map(|(i, j)| convert::create_request(j).map_err(|e| invalid(format!("jobs[{i}]: {e}"))))
        .collect()
}

/// The W3C trace context a caller sent in its metadata, when well-formed.
fn traceparent_in<T>(request: &tonic::Request<T>) -> Option<String> {
    let tp = request.metadata().get(trace::TRACEPARENT)?.to_str().ok()?;
    trace::parse(tp).map(|_| tp.to_owned())
}

/// Makes `span` a child of the caller's trace, if it sent one; returns the trace
/// context the created jobs carry: the caller's, or else this span's when this
/// gateway exports spans.
fn traced(span: &tracing::Span, incoming: Option<String>) -> Option<String> {
    match incoming {
        Some(tp) => {
            trace::set_parent(span, &tp);
            Some(tp)
        }
        None if trace::enabled() => trace::traceparent_of(span),
        None => None,
    }
}

/// Adds the trace context to a job's custom headers, unless its producer put one
/// there itself.
fn carry(job: &mut v1::CreateJobRequest, traceparent: Option<&str>) {
    if let Some(headers) =
        traceparent.and_then(|tp| trace::with_traceparent(&job.custom_headers, tp))
    {
        job.custom_headers = headers;
    }
}
