//! Zeebe's `gateway_protocol.Gateway` service: the job API workers use, the
//! cluster topology as Zeebe clients expect it, and UNIMPLEMENTED for the rest.

use super::*;

/// The Zeebe gateway service.
#[derive(Clone)]
pub struct GatewayService(pub Arc<Shared>);

/// The stream type of ActivateJobs: at most one response, then the end.
pub type ActivateJobsStream =
    Pin<Box<dyn Stream<Item = Result<gw::ActivateJobsResponse, Status>> + Send + 'static>>;

/// The stream type of StreamActivatedJobs: pushed jobs until the client leaves or the
/// gateway shuts down.
pub type JobStream = Pin<Box<dyn Stream<Item = Result<gw::ActivatedJob, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl Gateway for GatewayService {
    type ActivateJobsStream = ActivateJobsStream;
    type StreamActivatedJobsStream = JobStream;

    async fn activate_jobs(
        &self,
        request: tonic::Request<gw::ActivateJobsRequest>,
    ) -> Result<Response<Self::ActivateJobsStream>, Status> {
        let observer = RequestObserver::start("ActivateJobs");
        let stated = stated_timeout(request.metadata());
        let caller = auth::caller(&request);
        let req = request.into_inner();
        let deadline = instant_after(activate_timeout(
            stated,
            req.request_timeout,
            self.0.default_request_timeout,
            self.0.default_long_poll,
        ));
        let span = tracing::info_span!(
            "ActivateJobs",
            job_type = %loggable(&req.r#type),
            worker = %loggable(&req.worker),
            max_jobs = req.max_jobs_to_activate,
            request_timeout = req.request_timeout,
        );
        let (mut props, max) = match convert::activate_request(&req) {
            Ok(v) => v,
            Err(m) => {
                observer.finish(tonic::Code::InvalidArgument);
                return Err(Status::invalid_argument(m));
            }
        };
        if let Err(e) = auth::worker_tenants(caller.as_deref(), &mut props, &req.tenant_ids) {
            observer.finish(tonic::Code::PermissionDenied);
            return Err(e.into());
        }
        let shared = self.0.clone();
        // The poll runs on a task of its own, so that a client going away while an
        // Activate is on its way to a broker cannot lose the jobs it activates: the
        // stream is dropped then, which cancels `gone` (ending a parked poll), and
        // an answer that finds nobody to take it is given back.
        let gone = CancellationToken::new();
        let client = gone.clone().drop_guard();
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.0.requests.clone().spawn(
            async move {
                let result = shared
                    .activate(props, max, req.request_timeout, deadline, &gone)
                    .await
                    .map_err(Status::from);
                let code = result
                    .as_ref()
                    .map_or_else(|s| s.code(), |_| tonic::Code::Ok);
                match tx.send(result) {
                    Ok(()) => observer.finish(code),
                    Err(unsent) => {
                        observer.finish(tonic::Code::Cancelled);
                        if let Ok(Some(answer)) = unsent {
                            tracing::debug!(
                                jobs = answer.jobs.len(),
                                "client gone; giving the jobs back"
                            );
                            shared.give_back(answer.jobs, GIVE_BACK_MESSAGE).await;
                        }
                    }
                }
            }
            .instrument(span),
        );
        let answer = async move {
            let _client = client;
            rx.await
                .unwrap_or_else(|_| Err(Status::internal("the long poll ended without an answer")))
        };
        let stream =
            futures::stream::once(answer).filter_map(|r| std::future::ready(r.transpose()));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn stream_activated_jobs(
        &self,
        request: tonic::Request<gw::StreamActivatedJobsRequest>,
    ) -> Result<Response<Self::StreamActivatedJobsStream>, Status> {
        let observer = RequestObserver::start("StreamActivatedJobs");
        if !self.0.push_enabled {
            observer.finish(tonic::Code::Unimplemented);
            return Err(Status::unimplemented(
                "job push is switched off on this gateway",
            ));
        }
        let mut props = match convert::stream_request(request.get_ref()) {
            Ok(p) => p,
            Err(m) => {
                observer.finish(tonic::Code::InvalidArgument);
                return Err(Status::invalid_argument(m));
            }
        };
        let caller = auth::caller(&request);
        if let Err(e) =
            auth::worker_tenants(caller.as_deref(), &mut props, &request.get_ref().tenant_ids)
        {
            observer.finish(tonic::Code::PermissionDenied);
            return Err(e.into());
        }
        let place = match self.0.admission.job_stream() {
            Ok(p) => p,
            Err(e) => {
                observer.finish(tonic::Code::ResourceExhausted);
                return Err(e.into());
            }
        };
        let (job_type, worker) = (props.job_type.clone(), props.worker.clone());
        let credit = stated_credit(request.metadata());
        let held = self
            .0
            .confirmed_held(caller.as_deref(), &props, declared_held(request.metadata()))
            .await;
        let client = self.0.streams.join_holding(props, credit, &held);
        tracing::debug!(
            stream_id = %client.stream_id(),
            credit = client.credit(),
            job_type = loggable(&job_type),
            worker = loggable(&worker),
            "stream client joined"
        );
        // Tonic drops the stream when the client goes away, and with it the client
        // (see `ClientStream`); shutdown and the maximum age end it (see `lifetime`).
        let life = lifetime::Life::of(self.0.stream_max_age, request.metadata(), &self.0.endable);
        let mut md = tonic::metadata::MetadataMap::new();
        life.announce(&mut md);
        let jobs = lifetime::job_stream(client, life, self.0.clients.clone(), place, observer);
        let mut response = Response::new(jobs);
        *response.metadata_mut() = md;
        Ok(response)
    }

    async fn complete_job(
        &self,
        request: tonic::Request<gw::CompleteJobRequest>,
    ) -> Result<Response<gw::CompleteJobResponse>, Status> {
        // Credit is released only for a hand-off before this request began.
        let since = Instant::now();
        let deadline = self.0.deadline(&request);
        let caller = auth::caller(&request);
        let r = request.into_inner();
        let span = tracing::info_span!("CompleteJob", job_key = r.job_key);
        unary("CompleteJob", span, async {
            // A request that is not valid finishes nothing: the worker still holds
            // the job. A valid one means the worker is done with it: its credit
            // comes back now, so the next job is on its way while this one commits.
            let command = convert::complete_request(&r).map_err(invalid)?;
            let _finishing = self.0.streams.finished_here(JobKey(r.job_key), since);
            self.0
                .job_command(caller.as_deref(), r.job_key, Ok(command), deadline)
                .await?;
            Ok(gw::CompleteJobResponse {})
        })
        .await
    }

    async fn fail_job(
        &self,
        request: tonic::Request<gw::FailJobRequest>,
    ) -> Result<Response<gw::FailJobResponse>, Status> {
        // Credit is released only for a hand-off before this request began.
        let since = Instant::now();
        let deadline = self.0.deadline(&request);
        let caller = auth::caller(&request);
        let r = request.into_inner();
        let span = tracing::info_span!("FailJob", job_key = r.job_key, retries = r.retries);
        unary("FailJob", span, async {
            // A request that is not valid finishes nothing: the worker still holds
            // the job. A valid one means the worker is done with it: its credit
            // comes back now, so the next job is on its way while this one commits.
            let command = convert::fail_request(&r).map_err(invalid)?;
            let _finishing = self.0.streams.finished_here(JobKey(r.job_key), since);
            self.0
                .job_command(caller.as_deref(), r.job_key, Ok(command), deadline)
                .await?;
            Ok(gw::FailJobResponse {})
        })
        .await
    }

    async fn throw_error(
        &self,
        request: tonic::Request<gw::ThrowErrorRequest>,
    ) -> Result<Response<gw::ThrowErrorResponse>, Status> {
        // Credit is released only for a hand-off before this request began.
        let since = Instant::now();
        let deadline = self.0.deadline(&request);
        let caller = auth::caller(&request);
        let r = request.into_inner();
        let span = tracing::info_span!("ThrowError", job_key = r.job_key, error_code = %loggable(&r.error_code));
        unary("ThrowError", span, async {
            // A request that is not valid finishes nothing: the worker still holds
            // the job. A valid one means the worker is done with it: its credit
            // comes back now, so the next job is on its way while this one commits.
            let command = convert::throw_error_request(&r).map_err(invalid)?;
            let _finishing = self.0.streams.finished_here(JobKey(r.job_key), since);
            self.0
                .job_command(caller.as_deref(), r.job_key, Ok(command), deadline)
                .await?;
            Ok(gw::ThrowErrorResponse {})
        })
        .await
    }

    async fn update_job_retries(
        &self,
        request: tonic::Request<gw::UpdateJobRetriesRequest>,
    ) -> Result<Response<gw::UpdateJobRetriesResponse>, Status> {
        let deadline = self.0.deadline(&request);
        let caller = auth::caller(&request);
        let r = request.into_inner();
        let span =
            tracing::info_span!("UpdateJobRetries", job_key = r.job_key, retries = r.retries);
        unary("UpdateJobRetries", span, async {
            let command = convert::update_retries_request(&r);
            self.0
                .job_command(caller.as_deref(), r.job_key, command, deadline)
                .await?;
            Ok(gw::UpdateJobRetriesResponse {})
        })
        .await
    }

    async fn update_job_timeout(
        &self,
        request: tonic::Request<gw::UpdateJobTimeoutRequest>,
    ) -> Result<Response<gw::UpdateJobTimeoutResponse>, Status> {
        // Only a hand-off before this request began gets the new deadline.
        let since = Instant::now();
        let deadline = self.0.deadline(&request);
        let caller = auth::caller(&request);
        let r = request.into_inner();
        let span =
            tracing::info_span!("UpdateJobTimeout", job_key = r.job_key, timeout = r.timeout);
        unary("UpdateJobTimeout", span, async {
            let command = convert::update_timeout_request(&r);
            self.0
                .job_command(caller.as_deref(), r.job_key, command, deadline)
                .await?;
            self.0
                .streams
                .timeout_updated(JobKey(r.job_key), r.timeout, since);
            Ok(gw::UpdateJobTimeoutResponse {})
        })
        .await
    }

    async fn topology(
        &self,
        _request: tonic::Request<gw::TopologyRequest>,
    ) -> Result<Response<gw::TopologyResponse>, Status> {
        let span = tracing::info_span!("Topology");
        unary("Topology", span, async {
            Ok(zeebe_topology(&self.0.topology.snapshot()))
        })
        .await
    }
}

/// The cluster as Zeebe clients expect to see it. A broker that did not answer the
/// last round is listed without partitions; one that never answered, without a
/// version. Roles are those of the last round, except that the leader the gateway
/// knows now (a broker's own word since, a hand-off, a failover) is the partition's
/// only leader: between rounds a broker that handed its partitions over, or stopped,
/// would still be listed as leading them.
pub fn zeebe_topology(view: &ClusterView) -> gw::TopologyResponse {
    use gw::partition::{PartitionBrokerHealth as Health, PartitionBrokerRole as Role};
    let brokers = view
        .members
        .iter()
        .map(|(&node, addr)| {
            let (host, port) = split_host_port(addr);
            let partitions = view
                .reports
                .get(&node)
                .into_iter()
                .flatten()
                .map(|p| {
                    let known = view.leaders.get(&p.partition).map(|l| l.node);
                    // As Zeebe's brokers do, a replica that is not leading and
                    // still takes part (standing for election, or catching up as
                    // a learner) is a follower; one shutting down is inactive.
                    let role = match (p.role.as_str(), known) {
                        (_, Some(leader)) if leader == node => Role::Leader,
                        ("leader", Some(_)) | ("follower" | "candidate" | "learner", _) => {
                            Role::Follower
                        }
                        ("leader", None) => Role::Leader,
                        _ => Role::Inactive,
                    };
                    // A broker whose storage failed stopped its replicas for good.
                    let health = if view.storage_failures.contains_key(&node) {
                        Health::Dead
                    } else if view.healthy(p.partition) {
                        Health::Healthy
                    } else {
                        Health::Unhealthy
                    };
                    gw::Partition {
                        partition_id: to_i32(p.partition.0.into()),
                        role: role as i32,
                        health: health as i32,
                    }
                })
                .collect();
            gw::BrokerInfo {
                node_id: to_i32(node),
                host,
                port,
                partitions,
                version: view.versions.get(&node).cloned().unwrap_or_default(),
            }
        })
        .collect();
    gw::TopologyResponse {
        brokers,
        cluster_size: to_i32(view.members.len() as u64),
        partitions_count: to_i32(view.partitions_count.into()),
        replication_factor: to_i32(view.replication_factor.into()),
        gateway_version: VERSION.to_string(),
    }
}

pub(super) fn to_i32(n: u64) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

/// Splits "host:port" (also "http://host:port" and "[::1]:port"); port 0 if absent.
pub(super) fn split_host_port(addr: &str) -> (String, i32) {
    let rest = addr.split_once("://").map_or(addr, |(_, r)| r);
    let rest = rest.trim_end_matches('/');
    match rest.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && !port.contains(']') => (
            host.trim_start_matches('[')
                .trim_end_matches(']')
                .to_string(),
            port.parse().unwrap_or(0),
        ),
        _ => (rest.to_string(), 0),
    }
}

/// The methods of Zeebe's gateway service that Courier implements: its job API.
pub const JOB_API: [&str; 8] = [
    "ActivateJobs",
    "StreamActivatedJobs",
    "CompleteJob",
    "FailJob",
    "ThrowError",
    "UpdateJobRetries",
    "UpdateJobTimeout",
    "Topology",
];

/// Zeebe's gateway service as Courier serves it: the job API goes to the service
/// inside; every other method of Zeebe's (processes, messages, deployments, ...)
/// answers UNIMPLEMENTED with a message that says what is served instead, where
/// tonic would answer with none.
#[derive(Clone)]
pub struct JobApiOnly<S>(pub S);

impl<S: tonic::server::NamedService> tonic::server::NamedService for JobApiOnly<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> tonic::codegen::Service<tonic::codegen::http::Request<tonic::body::Body>> for JobApiOnly<S>
where
    S: tonic::codegen::Service<
        tonic::codegen::http::Request<tonic::body::Body>,
        Response = tonic::codegen::http::Response<tonic::body::Body>,
        Error = std::convert::Infallible,
    >,
{
    type Response = S::Response;
    type Error = std::convert::Infallible;
    type Future = futures::future::Either<
        S::Future,
        std::future::Ready<Result<Self::Response, std::convert::Infallible>>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: tonic::codegen::http::Request<tonic::body::Body>) -> Self::Future {
        let method = request.uri().path().rsplit('/').next().unwrap_or_default();
        if JOB_API.contains(&method) {
            return futures::future::Either::Left(self.0.call(request));
        }
        let status = Status::unimplemented(format!(
            "{method} is not served: Courier's gateway speaks the job API of Zeebe's \
             gateway protocol ({}); jobs are created through courier.v1.Jobs (CreateJob)",
            JOB_API.join(", ")
        ));
        futures::future::Either::Right(std::future::ready(Ok(status.into_http())))
    }
}
