//! OpenTelemetry: a job's spans in the gateway, the broker and `courier worker`
//! join its producer's trace, exported over OTLP/gRPC to a collector run here.

use crate::common;
use common::{courier_bin, serial, wait_until, Cluster, ClusterOpts};
use courier_proto::courier_v1::{jobs_client::JobsClient, CreateJobRequest};
use opentelemetry_proto::tonic::collector::trace::v1::{
    trace_service_server::{TraceService, TraceServiceServer},
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One exported span, its ids in hex.
#[derive(Clone, Debug)]
struct Seen {
    service: String,
    name: String,
    trace: String,
    span: String,
    parent: String,
}

/// An OTLP trace collector keeping every span it is sent.
#[derive(Clone, Default)]
struct Collector(Arc<Mutex<Vec<Seen>>>);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        let mut seen = self.0.lock().unwrap();
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                    Value::StringValue(s) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for span in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                seen.push(Seen {
                    service: service.clone(),
                    name: span.name,
                    trace: hex(&span.trace_id),
                    span: hex(&span.span_id),
                    parent: hex(&span.parent_span_id),
                });
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

impl Collector {
    /// The spans of `trace` exported by `service` under `name`.
    fn find(&self, service: &str, name: &str, trace: &str) -> Vec<Seen> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.service == service && s.name == name && s.trace == trace)
            .cloned()
            .collect()
    }
}

/// A producer's trace context (as an instrumented Zeebe or Courier client sends it)
/// reaches the gateway's and the broker's spans of the create, the gateway's push,
/// and the worker's span of the job, which its handler's own trace context names
/// as parent; each process names itself as its service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_spans_in_gateway_broker_and_worker_join_its_producers_trace() {
    let _g = serial().await;
    let collector = Collector::default();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{}", common::free_port())
        .parse()
        .unwrap();
    let endpoint = format!("http://{addr}");
    let server = tokio::spawn({
        let collector = collector.clone();
        async move {
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(collector))
                .serve(addr)
                .await
        }
    });
    let cluster = Cluster::start(ClusterOpts {
        otlp_endpoint: Some(endpoint.clone()),
        ..ClusterOpts::one_broker(1)
    })
    .await;

    let dir = tempfile::tempdir().unwrap();
    let handed = dir.path().join("traceparent");
    let _worker = Killed(
        std::process::Command::new(courier_bin())
            .args([
                "worker",
                "traced",
                "--handler",
                r#"printf '%s' "$TRACEPARENT" > "$HANDED"; echo '{}'"#,
                "--address",
                &cluster.gateway_addr,
                "--otlp-endpoint",
                &endpoint,
            ])
            .env("HANDED", &handed)
            // Spans leave the worker within 100 ms, not the default 5 s.
            .env("OTEL_BSP_SCHEDULE_DELAY", "100")
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );

    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let producer_span = "00f067aa0ba902b7";
    let mut jobs = JobsClient::connect(format!("http://{}", cluster.gateway_addr))
        .await
        .unwrap();
    let mut request = tonic::Request::new(CreateJobRequest {
        r#type: "traced".into(),
        custom_headers: r#"{"region":"eu"}"#.into(),
        ..Default::default()
    });
    request.metadata_mut().insert(
        "traceparent",
        format!("00-{trace}-{producer_span}-01").parse().unwrap(),
    );
    jobs.create_job(request).await.expect("create");

    wait_until(Duration::from_secs(30), "the handler ran", || async {
        handed.exists()
    })
    .await;
    wait_until(
        Duration::from_secs(30),
        "spans of the gateway, the broker and the worker are collected",
        || async {
            !collector
                .find("courier-gateway", "CreateJob", trace)
                .is_empty()
                && !collector
                    .find("courier-gateway", "PushJob", trace)
                    .is_empty()
                && !collector
                    .find("courier-broker", "CreateJobs", trace)
                    .is_empty()
                && !collector.find("courier-worker", "job", trace).is_empty()
        },
    )
    .await;
    for (service, name) in [
        ("courier-gateway", "CreateJob"),
        ("courier-gateway", "PushJob"),
        ("courier-broker", "CreateJobs"),
        ("courier-worker", "job"),
    ] {
        let spans = collector.find(service, name, trace);
        assert!(
            spans.iter().all(|s| s.parent == producer_span),
            "{service}'s {name} is not a child of the producer's span: {spans:?}"
        );
    }
    let job_span = &collector.find("courier-worker", "job", trace)[0].span;
    let passed = std::fs::read_to_string(&handed).unwrap();
    assert_eq!(
        passed,
        format!("00-{trace}-{job_span}-01"),
        "the handler's TRACEPARENT names the worker's span of the job"
    );
    // A span of another trace never takes this one's parent.
    let all = collector.0.lock().unwrap().clone();
    assert!(all
        .iter()
        .filter(|s| s.trace != trace)
        .all(|s| s.parent != producer_span));
    server.abort();
}

/// A process killed when the test ends, passed or not.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
