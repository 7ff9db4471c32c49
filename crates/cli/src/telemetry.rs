//! OpenTelemetry export of the job path's spans: `--otlp-endpoint` on the servers
//! and `courier worker`. Off unless given; the spans are those the fmt log shows
//! at `info`, of Courier's own crates.

use anyhow::Context as _;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::trace::SdkTracerProvider;

/// Longest a stopping process waits for its last spans to be exported.
const SHUTDOWN_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// The flag of every process that can export spans.
#[derive(clap::Args, Debug, Clone, Default, PartialEq)]
pub struct OtlpArgs {
    /// Export spans (creates, commits, pushes, handlers) over OTLP/gRPC to this
    /// collector, e.g. http://127.0.0.1:4317. A job carries its producer's trace
    /// context, so every process's spans of it join one trace.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT", value_name = "URL")]
    pub otlp_endpoint: Option<String>,
}

/// What exports this process's spans, if anything; [`Telemetry::shutdown`] sends
/// what is still buffered.
#[derive(Default)]
pub struct Telemetry(Option<SdkTracerProvider>);

impl Telemetry {
    /// An exporter to `endpoint` naming the process `service` (unless
    /// `OTEL_SERVICE_NAME` names it), and the tracing layer that feeds it. Must run
    /// within the tokio runtime: the gRPC channel lives there.
    pub fn otlp<S>(
        endpoint: &str,
        service: &'static str,
    ) -> anyhow::Result<(
        Telemetry,
        tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::SdkTracer>,
    )>
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .build()
            .with_context(|| format!("the OTLP exporter to {endpoint}"))?;
        let mut resource = opentelemetry_sdk::Resource::builder();
        if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
            resource = resource.with_service_name(service);
        }
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource.build())
            .build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("courier"));
        courier_proto::trace::enable();
        Ok((Telemetry(Some(provider)), layer))
    }

    /// Exports what is buffered and stops the exporter, waiting for a collector
    /// that does not answer no longer than [`SHUTDOWN_WAIT`].
    pub fn shutdown(self) {
        if let Some(provider) = self.0 {
            if let Err(e) = provider.shutdown_with_timeout(SHUTDOWN_WAIT) {
                eprintln!("warning: the last spans were not exported: {e}");
            }
        }
    }
}
