//! What this service tells about itself beyond `/metrics`: logs, and
//! OpenTelemetry traces exported over OTLP.
//!
//! Three spans per limited request, nested:
//!
//! | span | kind | made in | attributes |
//! |---|---|---|---|
//! | `GET /api/items` | server | [`http`] | `http.request.method`, `http.route`, `http.response.status_code` |
//! | `ratelimit.check` | internal | `limiter.rs` | `ratelimit.policy`, `.algorithm`, `.decision`, `.source`, `.key_kind` |
//! | `EVALSHA` | client | `store/redis/` | `db.system.name`, `db.operation.name`, `db.redis.script`, `server.address`, `server.port`, `db.redis.slot`, `error.type` |
//!
//! An incoming W3C `traceparent` is honoured, so a trace nginx starts goes
//! on through the service. Spans never carry a key, a client address or a
//! raw URI.
//!
//! Configured the way OpenTelemetry users expect (`OTEL_EXPORTER_OTLP_ENDPOINT`,
//! `OTEL_EXPORTER_OTLP_PROTOCOL`, `OTEL_SERVICE_NAME`, `OTEL_TRACES_SAMPLER`,
//! `OTEL_TRACES_SAMPLER_ARG`), each also a `[tracing]` field of the config.
//! Without an endpoint nothing is exported and the spans are not even
//! built (no layer wants them). With one, spans go through a bounded queue
//! ([`export`]): a slow or unreachable collector drops spans, counted, and
//! never slows a request. Only this crate's spans are exported, so the
//! telemetry crates' own logs cannot feed back into the exporter.

pub mod export;
pub mod http;

use export::{QueueExport, QueueSettings};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::{KeyValue, global};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler as SdkSampler, SdkTracerProvider};
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::{EnvFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// The target of every span meant for export (and only those): the log
/// output leaves it out, the exporter takes nothing else.
pub const TARGET: &str = "ratelimiter::trace";

/// The OTLP transport (`OTEL_EXPORTER_OTLP_PROTOCOL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum OtlpProtocol {
    /// gRPC, usually port 4317.
    #[serde(rename = "grpc")]
    #[value(name = "grpc")]
    Grpc,
    /// Protobuf over HTTP, usually port 4318 (`/v1/traces` is appended).
    #[serde(rename = "http/protobuf")]
    #[value(name = "http/protobuf")]
    HttpProtobuf,
}

/// Which traces are kept (`OTEL_TRACES_SAMPLER`; the ratio is
/// `OTEL_TRACES_SAMPLER_ARG`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum SamplerKind {
    /// Every trace.
    AlwaysOn,
    /// None.
    AlwaysOff,
    /// A fraction of traces, by trace id.
    #[serde(rename = "traceidratio")]
    #[value(name = "traceidratio")]
    TraceIdRatio,
    /// As the caller decided; every trace this service starts.
    ParentbasedAlwaysOn,
    /// As the caller decided; none of the traces this service starts.
    ParentbasedAlwaysOff,
    /// As the caller decided; a fraction of the traces this service starts.
    #[serde(rename = "parentbased_traceidratio")]
    #[value(name = "parentbased_traceidratio")]
    ParentbasedTraceIdRatio,
}

/// Trace export settings (validated config).
#[derive(Debug, Clone, PartialEq)]
pub struct TracingSettings {
    /// Where to send spans (`None`: tracing off).
    pub endpoint: Option<String>,
    /// How.
    pub protocol: OtlpProtocol,
    /// `service.name`.
    pub service_name: String,
    /// Which traces to keep.
    pub sampler: SamplerKind,
    /// The ratio for the ratio samplers, 0 to 1.
    pub sampler_arg: f64,
    /// Spans waiting for export, at most.
    pub queue_size: usize,
    /// The longest a span waits for its batch.
    pub batch_delay: Duration,
    /// The longest one export may take.
    pub export_timeout: Duration,
}

impl TracingSettings {
    fn sampler(&self) -> SdkSampler {
        let ratio = || SdkSampler::TraceIdRatioBased(self.sampler_arg);
        match self.sampler {
            SamplerKind::AlwaysOn => SdkSampler::AlwaysOn,
            SamplerKind::AlwaysOff => SdkSampler::AlwaysOff,
            SamplerKind::TraceIdRatio => ratio(),
            SamplerKind::ParentbasedAlwaysOn => {
                SdkSampler::ParentBased(Box::new(SdkSampler::AlwaysOn))
            }
            SamplerKind::ParentbasedAlwaysOff => {
                SdkSampler::ParentBased(Box::new(SdkSampler::AlwaysOff))
            }
            SamplerKind::ParentbasedTraceIdRatio => SdkSampler::ParentBased(Box::new(ratio())),
        }
    }
}

/// Why telemetry could not start.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The OTLP exporter could not be built (a bad endpoint, say).
    #[error("cannot set up the OTLP exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
}

/// What stays alive while the process runs: the tracer provider and the
/// export queue, flushed on [`Telemetry::shutdown`].
#[derive(Debug)]
pub struct Telemetry {
    traces: Option<(SdkTracerProvider, QueueExport)>,
}

impl Telemetry {
    /// Exports what is queued (at most `timeout`), then stops exporting.
    pub async fn shutdown(self, timeout: Duration) {
        if let Some((provider, queue)) = self.traces {
            queue.flush(timeout).await;
            let _ = provider.shutdown();
        }
    }
}

/// The log filter: `RUST_LOG` (default `info`), never the exported spans.
fn log_filter() -> EnvFilter {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    filter.add_directive(
        format!("{TARGET}=off")
            .parse()
            .expect("a static directive parses"),
    )
}

/// Logs to stderr (filtered by `RUST_LOG`, default `info`), and, with an
/// endpoint, exports traces. Call once, inside the runtime.
pub fn init(settings: &TracingSettings, instance_id: &str) -> Result<Telemetry, TelemetryError> {
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(log_filter());
    let Some(endpoint) = &settings.endpoint else {
        // No exporter: the spans' callsites are disabled for good.
        let _ = tracing_subscriber::registry().with(logs).try_init();
        return Ok(Telemetry { traces: None });
    };
    let exporter = match settings.protocol {
        OtlpProtocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint.clone())
            .with_timeout(settings.export_timeout)
            .build()?,
        OtlpProtocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            // OTEL_EXPORTER_OTLP_ENDPOINT is the base for every signal.
            .with_endpoint(format!("{}/v1/traces", endpoint.trim_end_matches('/')))
            .with_timeout(settings.export_timeout)
            .build()?,
    };
    let resource = Resource::builder()
        .with_service_name(settings.service_name.clone())
        .with_attribute(KeyValue::new("service.instance.id", instance_id.to_owned()))
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .build();
    let queue = QueueExport::start(
        exporter,
        &resource,
        QueueSettings {
            queue_size: settings.queue_size,
            batch_delay: settings.batch_delay,
            export_timeout: settings.export_timeout,
        },
    );
    let provider = SdkTracerProvider::builder()
        .with_span_processor(queue.clone())
        .with_sampler(settings.sampler())
        .with_resource(resource)
        .build();
    global::set_text_map_propagator(TraceContextPropagator::new());
    let traces = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("ratelimiter"))
        // Only the attributes the spans set (no code location, thread,
        // target or busy/idle times).
        .with_location(false)
        .with_threads(false)
        .with_target(false)
        .with_tracked_inactivity(false)
        .with_filter(Targets::new().with_target(TARGET, tracing::Level::TRACE));
    let _ = tracing_subscriber::registry()
        .with(logs)
        .with(traces)
        .try_init();
    Ok(Telemetry {
        traces: Some((provider, queue)),
    })
}
