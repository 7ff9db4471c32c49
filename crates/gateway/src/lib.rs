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
//! - [`auth`]: static tokens and OAuth JWTs, and the tenants of each caller.

pub mod admission;
pub mod auth;
pub mod error;
pub mod grpc;
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
use std::sync::Arc;
use std::time::Duration;
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
/// How long a stopping gateway waits for what its requests left running (a poll
/// whose client left, a give-back) before it closes its links.
const REQUESTS_DRAIN: Duration = Duration::from_secs(5);

/// How a gateway finds the cluster and treats requests.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// Where to put the gateway's [`service::Inspector`] once it serves (for a
    /// status page in the same process).
    pub inspector: Option<service::InspectorSlot>,
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
    /// TLS on the client port: the port then speaks TLS only.
    pub tls: Option<ClientPortTls>,
    /// The cluster's mutual TLS, presented to the brokers.
    pub cluster_tls: Option<courier_proto::tls::ClusterTls>,
    /// Who may call the job services; `None`: anyone, on every tenant.
    pub auth: Option<AuthConfig>,
    /// Admission bounds: connections, calls per connection, job streams, parked polls.
    pub bounds: admission::Bounds,
    /// Age past which a job stream is ended, less up to a fifth at random, for its
    /// client to reopen (perhaps on another gateway); `None`: never (default 10 min).
    pub stream_max_age: Option<Duration>,
}

/// Default of [`GatewayConfig::stream_max_age`].
pub const DEFAULT_STREAM_MAX_AGE: Duration = Duration::from_secs(600);

/// The client port's certificate and key, PEM files read again when they change.
#[derive(Clone, Debug)]
pub struct ClientPortTls {
    pub cert: std::path::PathBuf,
    pub key: std::path::PathBuf,
}

/// The credentials the gateway takes: static tokens, OAuth JWTs, or both.
#[derive(Clone, Debug, Default)]
pub struct AuthConfig {
    /// `--auth-tokens`: a JSON token file.
    pub tokens: Option<std::path::PathBuf>,
    /// `--oauth-*`: what a JWT must say.
    pub jwt: Option<auth::jwt::JwtSettings>,
}

/// Default of [`GatewayConfig::max_inflight_jobs`].
pub const DEFAULT_MAX_INFLIGHT_JOBS: usize = 100_000;
/// Default of [`GatewayConfig::max_inflight_bytes`].
pub const DEFAULT_MAX_INFLIGHT_BYTES: usize = 256 * 1024 * 1024;

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            inspector: None,
            brokers: Vec::new(),
            default_long_poll: Duration::from_secs(10),
            default_request_timeout: Duration::from_secs(15),
            topology_refresh: Duration::from_millis(500),
            client_credit: 32,
            max_inflight_jobs: DEFAULT_MAX_INFLIGHT_JOBS,
            max_inflight_bytes: DEFAULT_MAX_INFLIGHT_BYTES,
            stream_spare_percent: 50,
            push_enabled: true,
            tls: None,
            cluster_tls: None,
            auth: None,
            bounds: admission::Bounds::default(),
            stream_max_age: Some(DEFAULT_STREAM_MAX_AGE),
        }
    }
}

/// The authenticator `config` asks for, its key and token files loaded, and the
/// tasks that keep them fresh spawned on `tasks` until `stop`.
async fn authenticator(
    config: &AuthConfig,
    tasks: &TaskTracker,
    stop: &CancellationToken,
) -> Result<Arc<auth::Authenticator>, GatewayError> {
    let mut a = auth::Authenticator::default();
    if let Some(path) = &config.tokens {
        let tokens = Arc::new(auth::tokens::TokenFile::load(path)?);
        tasks.spawn(
            tokens
                .clone()
                .watch(courier_proto::tls::RELOAD_EVERY, stop.clone()),
        );
        a.tokens = Some(tokens);
    }
    if let Some(settings) = &config.jwt {
        let jwt = Arc::new(auth::jwt::JwtVerifier::new(settings.clone()));
        match (&settings.keys, jwt.load().await) {
            (_, Ok(())) => {}
            // A key file is ours to get right: a bad one stops the start.
            (auth::jwt::KeySource::File(_), Err(e)) => return Err(e.into()),
            // A provider may be down for now; tokens are refused until it answers.
            (auth::jwt::KeySource::Url(_), Err(e)) => {
                tracing::warn!(error = %e, "cannot fetch the OAuth signing keys yet; bearer JWTs are refused until they load");
            }
        }
        tasks.spawn(jwt.clone().run(stop.clone()));
        a.jwt = Some(jwt);
    }
    Ok(Arc::new(a))
}

/// Sets the gauges of the configured bounds.
fn publish_bounds(config: &GatewayConfig) {
    use admission::Bound;
    let b = &config.bounds;
    for (bound, value) in [
        (Bound::Connections, b.max_connections),
        (
            Bound::CallsPerConnection,
            usize::try_from(b.max_calls_per_connection).unwrap_or(usize::MAX),
        ),
        (Bound::JobStreams, b.max_job_streams),
        (Bound::ParkedPolls, b.max_parked_polls),
        (Bound::InflightJobs, config.max_inflight_jobs),
        (Bound::InflightBytes, config.max_inflight_bytes),
    ] {
        metrics::bound(bound, value);
    }
}

/// Serves until `shutdown` is cancelled, then stops every task it started and returns.
pub async fn serve(
    config: GatewayConfig,
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
) -> Result<(), GatewayError> {
    let connect = grpc::GrpcConnect {
        tls: config.cluster_tls.as_ref().map(|t| t.client_config()),
    };
    serve_with(config, listener, shutdown, Arc::new(connect)).await
}

/// [`serve`], reaching the brokers through `connect` (see [`courier_proto::api`]).
pub async fn serve_with(
    config: GatewayConfig,
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
    connect: Arc<dyn courier_proto::api::Connect>,
) -> Result<(), GatewayError> {
    let topology = Arc::new(topology::Topology::with_connect(&config.brokers, connect)?);
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
    let admission = admission::Admission::new(config.bounds);
    publish_bounds(&config);
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

    let requests = TaskTracker::new();
    let shared = service::Shared::new(
        topology,
        queue,
        streams,
        config.default_long_poll,
        config.default_request_timeout,
        config.push_enabled,
        &gateway_id,
        service::Phases {
            clients: clients.clone(),
            requests: requests.clone(),
            stop: stop.clone(),
        },
        admission.clone(),
        config.stream_max_age,
    );
    if let Some(slot) = &config.inspector {
        // A slot already filled (another gateway of the process) keeps the first.
        let _ = slot.set(service::Inspector(shared.clone()));
    }
    // Zeebe's clients (the Node.js SDK always) compress requests with gzip; answers
    // stay uncompressed, where compression would only add latency.
    let authenticate = auth::Authenticate(match &config.auth {
        Some(a) => Some(authenticator(a, &tasks, &stop).await?),
        None => None,
    });
    let client_tls = match &config.tls {
        Some(t) => {
            let cert = courier_proto::tls::ReloadingCert::load(&t.cert, &t.key)?;
            tasks.spawn(
                cert.clone()
                    .watch(courier_proto::tls::RELOAD_EVERY, stop.clone()),
            );
            Some(courier_proto::tls::server_config(cert, None)?)
        }
        None => None,
    };
    let gateway = tonic::service::interceptor::InterceptedService::new(
        service::JobApiOnly(
            GatewayServer::new(service::GatewayService(shared.clone()))
                .max_decoding_message_size(MAX_ZEEBE_MESSAGE)
                .accept_compressed(tonic::codec::CompressionEncoding::Gzip),
        ),
        authenticate.clone(),
    );
    let jobs = tonic::service::interceptor::InterceptedService::new(
        JobsServer::new(service::JobsService(shared))
            .max_decoding_message_size(MAX_CLIENT_MESSAGE)
            .accept_compressed(tonic::codec::CompressionEncoding::Gzip),
        authenticate,
    );

    let health = health::service(
        &[
            <GatewayServer<service::GatewayService> as NamedService>::NAME,
            <JobsServer<service::JobsService> as NamedService>::NAME,
        ],
        clients.clone(),
    );

    let connections = courier_proto::tls::ConnectionLimit::new(
        config.bounds.max_connections,
        metrics::connections,
        metrics::connection_refused,
    );
    let incoming = courier_proto::tls::incoming(
        listener,
        client_tls,
        metrics::tls_refused,
        Some(connections),
        clients.clone(),
    );

    let result = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(CLIENT_KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(CLIENT_KEEPALIVE_TIMEOUT))
        .max_concurrent_streams(Some(config.bounds.max_calls_per_connection))
        .add_service(service::ReportLoad::new(gateway, admission.clone()))
        .add_service(service::ReportLoad::new(jobs, admission))
        .add_service(health)
        .serve_with_incoming_shutdown(incoming, clients.clone().cancelled_owned())
        .await;

    // The clients are gone: what their requests left (give-backs) goes to the
    // brokers, and their streams' jobs are yielded on the links, which close once
    // those are sent.
    clients.cancel();
    requests.close();
    if tokio::time::timeout(REQUESTS_DRAIN, requests.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            "requests still running {} s into the shutdown were dropped",
            REQUESTS_DRAIN.as_secs()
        );
    }
    closing.cancel();
    link_tasks.close();
    link_tasks.wait().await;
    stop.cancel();
    tasks.close();
    tasks.wait().await;
    tracing::info!("gateway stopped");
    Ok(result?)
}
