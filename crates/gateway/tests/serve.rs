//! The gateway served over real TCP with no broker reachable: what it answers on its
//! own (validation, topology, long-poll ends) and that it shuts down cleanly. Routing
//! to real brokers is tested by the cluster tests in the workspace's `tests/`.

// Helpers outside #[test] fns are not covered by clippy.toml's allow-unwrap-in-tests.
#![allow(clippy::unwrap_used)]

use courier_gateway::admission::Bounds;
use courier_gateway::{serve, GatewayConfig};
use courier_proto::courier_v1 as v1;
use courier_proto::courier_v1::jobs_client::JobsClient;
use courier_proto::gateway_protocol as gw;
use courier_proto::gateway_protocol::gateway_client::GatewayClient;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};
use tonic::Code;

async fn dead_address() -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    l.local_addr().unwrap().to_string()
}

type Server = tokio::task::JoinHandle<Result<(), courier_gateway::GatewayError>>;

async fn start() -> (Channel, CancellationToken, Server) {
    let (addr, token, server) = start_with(Bounds::default()).await;
    (connect(&addr).await.unwrap(), token, server)
}

/// A gateway with these bounds and no broker reachable, and its address.
async fn start_with(bounds: Bounds) -> (String, CancellationToken, Server) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let config = GatewayConfig {
        brokers: vec![dead_address().await],
        default_request_timeout: Duration::from_millis(400),
        topology_refresh: Duration::from_millis(50),
        bounds,
        ..Default::default()
    };
    let token = CancellationToken::new();
    let server = tokio::spawn(serve(config, listener, token.clone()));
    (addr, token, server)
}

/// A new connection to `addr`.
async fn connect(addr: &str) -> Result<Channel, tonic::transport::Error> {
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
}

fn activate(request_timeout: i64) -> gw::ActivateJobsRequest {
    gw::ActivateJobsRequest {
        r#type: "t".into(),
        worker: "w".into(),
        timeout: 1000,
        max_jobs_to_activate: 5,
        request_timeout,
        ..Default::default()
    }
}

#[tokio::test]
async fn answers_what_it_can_without_brokers() {
    let (channel, token, server) = start().await;
    let mut gateway = GatewayClient::new(channel.clone());
    let mut jobs = JobsClient::new(channel);

    let t = gateway
        .topology(gw::TopologyRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(t.brokers.is_empty());
    assert_eq!(t.gateway_version, env!("CARGO_PKG_VERSION"));

    let e = gateway
        .complete_job(gw::CompleteJobRequest {
            job_key: 5,
            variables: String::new(),
        })
        .await
        .unwrap_err();
    // Its top bits name no partition: no such job, as Zeebe answers.
    assert_eq!(e.code(), Code::NotFound);
    assert!(e.message().contains("no job with key 5"), "{e:?}");

    let mut bad = activate(-1);
    bad.worker = " ".into();
    let e = gateway.activate_jobs(bad).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("worker"), "{e:?}");

    // No long polling: the stream ends at once, without a message.
    let start = Instant::now();
    let mut s = gateway
        .activate_jobs(activate(-1))
        .await
        .unwrap()
        .into_inner();
    assert!(s.message().await.unwrap().is_none());
    assert!(start.elapsed() < Duration::from_millis(300));

    // A long poll ends cleanly at its requestTimeout.
    let start = Instant::now();
    let mut s = gateway
        .activate_jobs(activate(150))
        .await
        .unwrap()
        .into_inner();
    assert!(s.message().await.unwrap().is_none());
    assert!(start.elapsed() >= Duration::from_millis(150));

    let e = gateway
        .stream_activated_jobs(gw::StreamActivatedJobsRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("type"), "{e:?}");

    let e = jobs
        .create_jobs(v1::CreateJobsRequest { jobs: vec![] })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);

    // Nothing to route to: UNAVAILABLE once the request's deadline is spent.
    let e = jobs
        .create_job(v1::CreateJobRequest {
            r#type: "t".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");

    token.cancel();
    let stopped = tokio::time::timeout(Duration::from_secs(5), server).await;
    assert!(matches!(stopped, Ok(Ok(Ok(())))), "{stopped:?}");
}

#[tokio::test]
async fn shutdown_ends_parked_long_polls() {
    let (channel, token, server) = start().await;
    let mut gateway = GatewayClient::new(channel);
    let mut request = tonic::Request::new(activate(60_000));
    request.set_timeout(Duration::from_secs(60));
    let poll = tokio::spawn(async move {
        let mut s = gateway.activate_jobs(request).await?.into_inner();
        s.message().await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!poll.is_finished(), "the poll must be parked");
    token.cancel();
    let ended = tokio::time::timeout(Duration::from_secs(5), poll).await;
    assert!(matches!(ended, Ok(Ok(Ok(None)))), "{ended:?}");
    let stopped = tokio::time::timeout(Duration::from_secs(5), server).await;
    assert!(matches!(stopped, Ok(Ok(Ok(())))), "{stopped:?}");
}

#[tokio::test]
async fn a_job_stream_stays_open_until_shutdown() {
    let (channel, token, server) = start().await;
    let mut gateway = GatewayClient::new(channel);
    let request = gw::StreamActivatedJobsRequest {
        r#type: "t".into(),
        worker: "w".into(),
        timeout: 1000,
        ..Default::default()
    };
    let mut s = gateway
        .stream_activated_jobs(request)
        .await
        .unwrap()
        .into_inner();
    let next = tokio::spawn(async move { s.message().await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!next.is_finished(), "the stream must stay open");
    token.cancel();
    let ended = tokio::time::timeout(Duration::from_secs(5), next).await;
    assert!(matches!(ended, Ok(Ok(Ok(None)))), "{ended:?}");
    let stopped = tokio::time::timeout(Duration::from_secs(5), server).await;
    assert!(matches!(stopped, Ok(Ok(Ok(())))), "{stopped:?}");
}

#[tokio::test]
async fn serves_grpc_health_checks_for_itself_and_its_services() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;

    let (channel, token, server) = start().await;
    let mut health = HealthClient::new(channel);
    for service in ["", "gateway_protocol.Gateway", "courier.v1.Jobs"] {
        let answer = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap_or_else(|e| panic!("health of '{service}': {e:?}"))
            .into_inner();
        assert_eq!(answer.status(), ServingStatus::Serving, "'{service}'");
    }
    let e = health
        .check(HealthCheckRequest {
            service: "no.such.Service".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);

    // An unknown service can be watched: SERVICE_UNKNOWN, and the call stays open.
    let mut unknown = health
        .watch(HealthCheckRequest {
            service: "no.such.Service".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = unknown.message().await.unwrap().unwrap();
    assert_eq!(first.status(), ServingStatus::ServiceUnknown);
    let open = tokio::time::timeout(Duration::from_millis(200), unknown.message()).await;
    assert!(open.is_err(), "the watch stays open: {open:?}");

    // A watcher learns that the gateway stops serving.
    let mut watch = health
        .watch(HealthCheckRequest {
            service: "gateway_protocol.Gateway".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = watch.message().await.unwrap().unwrap();
    assert_eq!(first.status(), ServingStatus::Serving);
    token.cancel();
    let next = tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .expect("told at once")
        .unwrap()
        .expect("a change");
    assert_eq!(next.status(), ServingStatus::NotServing);
    // The watch then ends, and does not hold the shutdown up.
    let end = tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .expect("the watch ends");
    assert!(matches!(end, Ok(None)), "{end:?}");
    let end = tokio::time::timeout(Duration::from_secs(5), unknown.message())
        .await
        .expect("the unknown service's watch ends too");
    assert!(matches!(end, Ok(None)), "{end:?}");
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("the gateway stops with a watch open")
        .unwrap()
        .unwrap();
}

/// Sends and receives raw protobuf bytes, to send what no generated client would.
#[derive(Default)]
struct RawCodec;

struct RawEncoder;
struct RawDecoder;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawEncoder;
    type Decoder = RawDecoder;

    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }

    fn decoder(&mut self) -> RawDecoder {
        RawDecoder
    }
}

impl tonic::codec::Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn encode(
        &mut self,
        item: Vec<u8>,
        buf: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        prost::bytes::BufMut::put_slice(buf, &item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawDecoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn decode(
        &mut self,
        buf: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Vec<u8>>, tonic::Status> {
        let n = prost::bytes::Buf::remaining(buf);
        Ok(Some(prost::bytes::Buf::copy_to_bytes(buf, n).to_vec()))
    }
}

#[tokio::test]
async fn a_request_that_does_not_decode_is_an_invalid_argument() {
    let (channel, token, server) = start().await;
    let mut grpc = tonic::client::Grpc::new(channel);
    // CompleteJobRequest { jobKey: 1, variables: [0xff, 0xfe] }: not UTF-8.
    let bytes = vec![0x08, 0x01, 0x12, 0x02, 0xff, 0xfe];
    grpc.ready().await.unwrap();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(
        "/gateway_protocol.Gateway/CompleteJob",
    );
    let e = grpc
        .unary(tonic::Request::new(bytes), path, RawCodec)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("UTF-8"), "{e:?}");
    token.cancel();
    server.await.unwrap().unwrap();
}

fn stream_request() -> gw::StreamActivatedJobsRequest {
    gw::StreamActivatedJobsRequest {
        r#type: "t".into(),
        worker: "w".into(),
        timeout: 1000,
        ..Default::default()
    }
}

/// The value of a counter of the process's default registry, by one label.
fn counter(name: &str, label: (&str, &str)) -> u64 {
    prometheus::gather()
        .iter()
        .filter(|f| f.name() == name)
        .flat_map(|f| f.get_metric().iter())
        .filter(|m| {
            m.get_label()
                .iter()
                .any(|l| l.name() == label.0 && l.value() == label.1)
        })
        .map(|m| m.get_counter().get_value() as u64)
        .sum()
}

#[tokio::test]
async fn past_its_bounds_the_gateway_refuses_at_once_and_takes_again_when_a_place_frees() {
    let (addr, token, server) = start_with(Bounds {
        max_connections: 2,
        max_calls_per_connection: 3,
        max_job_streams: 2,
        max_parked_polls: 1,
    })
    .await;
    let refused = |bound| counter("courier_gateway_admission_refused_total", ("bound", bound));
    let refused_before = (refused("job_streams"), refused("parked_polls"));
    let first = connect(&addr).await.unwrap();
    let second = connect(&addr).await.unwrap();
    let mut a = GatewayClient::new(first);
    let mut b = GatewayClient::new(second);

    // Job streams: two held, the third refused at once.
    let s1 = a.stream_activated_jobs(stream_request()).await.unwrap();
    let _s2 = a.stream_activated_jobs(stream_request()).await.unwrap();
    let start = Instant::now();
    let e = b.stream_activated_jobs(stream_request()).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("limit of 2 job streams"), "{e:?}");
    assert!(start.elapsed() < Duration::from_secs(1));

    // Parked polls: one parked, the next refused once it finds nothing. Until the
    // first is parked, the second may park in its place (and the first be refused):
    // then both are asked again.
    let park = |mut client: GatewayClient<Channel>| {
        let mut request = tonic::Request::new(activate(30_000));
        request.set_timeout(Duration::from_secs(30));
        tokio::spawn(async move {
            let mut s = client.activate_jobs(request).await?.into_inner();
            s.message().await
        })
    };
    let mut poll = park(a.clone());
    let deadline = Instant::now() + Duration::from_secs(10);
    let e = loop {
        assert!(Instant::now() < deadline, "never refused");
        if poll.is_finished() {
            poll = park(a.clone());
        }
        // A moment for the first to park before the second asks.
        tokio::time::sleep(Duration::from_millis(50)).await;
        match b.activate_jobs(activate(100)).await.map(|s| s.into_inner()) {
            Ok(mut s) => {
                if let Err(e) = s.message().await {
                    break e;
                }
            }
            Err(e) => break e,
        }
    };
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("parked ActivateJobs"), "{e:?}");
    assert!(!poll.is_finished(), "the first poll stays parked");

    // Calls per connection: `a` has three open (two streams, one poll), so a fourth
    // waits for a free one while the other connection is served.
    let mut a4 = a.clone();
    let fourth = tokio::spawn(async move { a4.topology(gw::TopologyRequest {}).await });
    b.topology(gw::TopologyRequest {}).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !fourth.is_finished(),
        "a fourth call on one connection waits"
    );
    drop(s1);
    let answered = tokio::time::timeout(Duration::from_secs(5), fourth).await;
    assert!(matches!(answered, Ok(Ok(Ok(_)))), "{answered:?}");

    // A place freed (the stream dropped): a stream is taken again.
    b.stream_activated_jobs(stream_request()).await.unwrap();

    // Connections: a third is closed at once.
    let third = tokio::time::timeout(Duration::from_secs(5), async {
        let mut c = GatewayClient::new(connect(&addr).await?);
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(c.topology(gw::TopologyRequest {}).await?)
    })
    .await
    .expect("refused at once, not left waiting");
    assert!(third.is_err(), "a third connection is refused: {third:?}");

    assert!(refused("job_streams") > refused_before.0);
    assert!(refused("parked_polls") > refused_before.1);
    assert!(refused("connections") >= 1);
    token.cancel();
    let stopped = tokio::time::timeout(Duration::from_secs(5), server).await;
    assert!(matches!(stopped, Ok(Ok(Ok(())))), "{stopped:?}");
}
