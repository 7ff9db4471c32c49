//! Courier's gateway: stateless, it serves workers and producers over gRPC and forwards
//! each request to the leader of the right partition among the brokers.
//!
//! # Layout
//! - [`topology`]: the learned cluster view (membership, leaders) and broker channels.
//! - [`router`]: sends a request to a partition's leader, retrying until its deadline.
//! - [`long_poll`]: [`long_poll::LongPollQueue`], where ActivateJobs requests park.
//! - [`streams`]: [`streams::AggregatedStreams`], job push: StreamActivatedJobs clients
//!   aggregated by activation properties, registered with every broker link, and
//!   flow control (client credit, in-flight bounds, credit reports to brokers).
//! - [`link`]: one task per broker keeping the gateway <-> broker link open.
//! - [`service`]: the `gateway_protocol.Gateway` and `courier.v1.Jobs` services.
//! - [`metrics`]: Prometheus metrics in the default registry.
//! - [`error`]: [`GatewayError`] and its mapping to gRPC statuses.
//! - [`backoff`]: full-jitter exponential back-off.

pub mod backoff;
pub mod error;
mod health;
pub mod link;
pub mod long_poll;
pub mod metrics;
pub mod router;
pub mod service;
pub mod streams;
pub mod topology;

pub use error::GatewayError;

use courier_proto::courier_v1::jobs_server::JobsServer;
use courier_proto::gateway_protocol::gateway_server::GatewayServer;
use futures::StreamExt;
use std::sync::Arc;
use std::time::Duration;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::server::NamedService;

/// Largest message accepted by Courier's job API: a CreateJob may carry 4 MiB of
/// variables plus headers, and CreateJobs many of them.
const MAX_CLIENT_MESSAGE: usize = 64 * 1024 * 1024;
/// Largest message accepted by the Zeebe gateway API: the largest valid one is a
/// CompleteJob, FailJob or ThrowError with 4 MiB of variables. Zeebe's gateway takes
/// at most 4 MiB; a larger message is refused before it is read whole.
const MAX_ZEEBE_MESSAGE: usize = courier_proto::domain::MAX_VARIABLES_BYTES + 64 * 1024;
/// HTTP/2 pings on client connections, so dead workers' connections are closed.
const CLIENT_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
const CLIENT_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);
/// Pause after a failed accept (e.g. out of file descriptors), so the accept loop
/// does not spin while the condition lasts.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);

/// How a gateway finds the cluster and treats requests.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// Broker addresses ("host:port") to learn the cluster from; need not be all brokers.
    pub brokers: Vec<String>,
    /// Long-poll time when ActivateJobs says requestTimeout = 0 (default 10 s).
    pub default_long_poll: Duration,
    /// Deadline for a request that carries no grpc-timeout (default 15 s).
    pub default_request_timeout: Duration,
    /// How often topology is refreshed from the brokers (default 500 ms).
    pub topology_refresh: Duration,
    /// Pushed jobs a StreamActivatedJobs client may hold unfinished, unless its
    /// request states its own in the `courier-max-jobs-active` header (default 32,
    /// Zeebe clients' default maxJobsActive).
    pub client_credit: u32,
    /// Pushed jobs held unfinished across all clients past which pushes are refused
    /// with `gateway_full` (default 100,000).
    pub max_inflight_jobs: usize,
    /// Bytes (variables and custom headers) of those jobs past which pushes are
    /// refused with `gateway_full` (default 256 MiB).
    pub max_inflight_bytes: usize,
    /// Spare room of each aggregated stream, in percent of its clients' credit: pushed
    /// jobs kept at the gateway for the first client that frees credit, so a worker
    /// that finishes a job gets the next without a round trip to a broker (default
    /// 50; 0 turns it off).
    pub stream_spare_percent: u32,
    /// Whether StreamActivatedJobs is served; without it workers long-poll
    /// (default true).
    pub push_enabled: bool,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            brokers: Vec::new(),
            default_long_poll: Duration::from_secs(10),
            default_request_timeout: Duration::from_secs(15),
            topology_refresh: Duration::from_millis(500),
            client_credit: 32,
            max_inflight_jobs: 100_000,
            max_inflight_bytes: 256 * 1024 * 1024,
            stream_spare_percent: 50,
            push_enabled: true,
        }
    }
}

/// Serves until `shutdown` is cancelled, then stops every task it started and returns.
pub async fn serve(
    config: GatewayConfig,
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
) -> Result<(), GatewayError> {
    let topology = Arc::new(topology::Topology::new(&config.brokers)?);
    // The gateway's own tasks stop on `stop`, after the clients are gone and the
    // links closed (a graceful stop: see `BrokerLink::close`); they also stop when
    // the server fails, without cancelling the caller's token. What serves clients
    // stops on `clients`, first.
    let clients = shutdown.child_token();
    let closing = CancellationToken::new();
    let stop = CancellationToken::new();
    let tasks = TaskTracker::new();
    let link_tasks = TaskTracker::new();
    let queue = long_poll::LongPollQueue::new();
    let streams = streams::AggregatedStreams::new(streams::Limits {
        client_credit: config.client_credit,
        max_inflight_jobs: config.max_inflight_jobs,
        max_inflight_bytes: config.max_inflight_bytes,
        spare_percent: config.stream_spare_percent,
    });
    let gateway_id = format!("gateway-{:016x}", rand::random::<u64>());
    tracing::info!(
        gateway_id,
        addr = ?listener.local_addr().ok(),
        brokers = ?config.brokers,
        "gateway starting"
    );

    let t = topology.clone();
    let (every, token) = (config.topology_refresh, stop.clone());
    let leadership = topology.leadership();
    tasks.spawn(async move { t.run(every, token).await });
    tasks.spawn(streams.clone().run(leadership, stop.clone()));
    let links = link::BrokerLink::new(
        topology.clone(),
        queue.clone(),
        streams.clone(),
        gateway_id.clone(),
        closing.clone(),
        shutdown.clone(),
        stop.clone(),
    );
    tasks.spawn(links.supervise(link_tasks.clone()));

    let shared = service::Shared::new(
        topology,
        queue,
        streams,
        config.default_long_poll,
        config.default_request_timeout,
        config.push_enabled,
        &gateway_id,
        clients.clone(),
    );
    // Zeebe's clients (the Node.js SDK always) compress requests with gzip; answers
    // stay uncompressed, where compression would only add latency.
    let gateway = service::JobApiOnly(
        GatewayServer::new(service::GatewayService(shared.clone()))
            .max_decoding_message_size(MAX_ZEEBE_MESSAGE)
            .accept_compressed(tonic::codec::CompressionEncoding::Gzip),
    );
    let jobs = JobsServer::new(service::JobsService(shared))
        .max_decoding_message_size(MAX_CLIENT_MESSAGE)
        .accept_compressed(tonic::codec::CompressionEncoding::Gzip);

    let health = health::service(
        &[
            <GatewayServer<service::GatewayService> as NamedService>::NAME,
            <JobsServer<service::JobsService> as NamedService>::NAME,
        ],
        clients.clone(),
    );

    let incoming = TcpListenerStream::new(listener).then(|accepted| async move {
        match &accepted {
            Ok(stream) => {
                // serve_with_incoming ignores the server's tcp_nodelay setting.
                if let Err(e) = stream.set_nodelay(true) {
                    tracing::debug!(error = %e, "cannot set TCP_NODELAY");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
            }
        }
        accepted
    });

    let result = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(CLIENT_KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(CLIENT_KEEPALIVE_TIMEOUT))
        .add_service(gateway)
        .add_service(jobs)
        .add_service(health)
        .serve_with_incoming_shutdown(incoming, clients.clone().cancelled_owned())
        .await;

    // The clients are gone: their streams' jobs are yielded on the links, which
    // close once those are sent.
    clients.cancel();
    closing.cancel();
    link_tasks.close();
    link_tasks.wait().await;
    stop.cancel();
    tasks.close();
    tasks.wait().await;
    tracing::info!("gateway stopped");
    Ok(result?)
}
