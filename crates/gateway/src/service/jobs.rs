//! Courier's `courier.v1.Jobs` service, for producers: create, get and cancel; and
//! for Courier's worker, the end of one of its streams.

use super::*;

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
        let r = request.into_inner();
        let span = tracing::info_span!("CreateJob", job_type = %loggable(&r.r#type));
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
        let r = request.into_inner();
        let span = tracing::info_span!("CreateJobs", jobs = r.jobs.len());
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
