//! A real OTLP trace receiver, both transports: gRPC (opentelemetry-proto's
//! generated tonic server) and HTTP (protobuf at `/v1/traces`). It keeps
//! every span it is sent, flattened for assertions.

use anyhow::Context;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use prost::Message;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

/// One received span, flattened: ids in hex, attributes as text.
#[derive(Debug, Clone, PartialEq)]
pub struct ReceivedSpan {
    /// 32 hex digits.
    pub trace_id: String,
    /// 16 hex digits.
    pub span_id: String,
    /// 16 hex digits, empty for a root.
    pub parent_span_id: String,
    /// The span's name.
    pub name: String,
    /// OTLP's `SpanKind`: 1 internal, 2 server, 3 client.
    pub kind: i32,
    /// Its attributes.
    pub attributes: BTreeMap<String, String>,
    /// Its events' names.
    pub events: Vec<String>,
    /// Its resource's attributes.
    pub resource: BTreeMap<String, String>,
    /// Which transport brought it: `grpc` or `http`.
    pub transport: &'static str,
}

/// What a receiver keeps: every span, or (a sink) only their count.
#[derive(Debug, Default)]
struct Kept {
    spans: Vec<ReceivedSpan>,
    count: usize,
    discard: bool,
}

type Spans = Arc<Mutex<Kept>>;

fn text(value: &Option<AnyValue>) -> String {
    match value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::IntValue(n)) => n.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

fn attributes(list: &[KeyValue]) -> BTreeMap<String, String> {
    list.iter()
        .map(|kv| (kv.key.clone(), text(&kv.value)))
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn keep(spans: &Spans, request: ExportTraceServiceRequest, transport: &'static str) {
    let mut kept = spans.lock().unwrap_or_else(PoisonError::into_inner);
    if kept.discard {
        kept.count += request
            .resource_spans
            .iter()
            .flat_map(|r| &r.scope_spans)
            .map(|s| s.spans.len())
            .sum::<usize>();
        return;
    }
    for resource_spans in request.resource_spans {
        let resource = resource_spans
            .resource
            .map(|r| attributes(&r.attributes))
            .unwrap_or_default();
        for scope in resource_spans.scope_spans {
            for span in scope.spans {
                kept.count += 1;
                kept.spans.push(ReceivedSpan {
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: hex(&span.parent_span_id),
                    name: span.name,
                    kind: span.kind,
                    attributes: attributes(&span.attributes),
                    events: span.events.into_iter().map(|e| e.name).collect(),
                    resource: resource.clone(),
                    transport,
                });
            }
        }
    }
}

#[derive(Debug, Clone)]
struct Grpc(Spans);

#[tonic::async_trait]
impl TraceService for Grpc {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        keep(&self.0, request.into_inner(), "grpc");
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// The receiver. Its servers stop when it is dropped.
#[derive(Debug)]
pub struct OtlpReceiver {
    /// `http://127.0.0.1:<port>` of the gRPC server.
    pub grpc: String,
    /// `http://127.0.0.1:<port>` of the HTTP server (it serves `/v1/traces`).
    pub http: String,
    spans: Spans,
    tasks: Vec<JoinHandle<()>>,
}

impl OtlpReceiver {
    /// Both servers, on free loopback ports, keeping every span.
    pub async fn start() -> anyhow::Result<Self> {
        Self::launch(false).await
    }

    /// Both servers, counting spans and keeping none (for load).
    pub async fn sink() -> anyhow::Result<Self> {
        Self::launch(true).await
    }

    async fn launch(discard: bool) -> anyhow::Result<Self> {
        let spans: Spans = Arc::new(Mutex::new(Kept {
            discard,
            ..Kept::default()
        }));
        let grpc_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let grpc_addr = grpc_listener.local_addr()?;
        let grpc = tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(Grpc(Arc::clone(&spans))))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(grpc_listener));
        let http_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let http_addr = http_listener.local_addr()?;
        let for_http = Arc::clone(&spans);
        let router = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: axum::body::Bytes| {
                let spans = Arc::clone(&for_http);
                async move {
                    match ExportTraceServiceRequest::decode(body) {
                        Ok(request) => {
                            keep(&spans, request, "http");
                            (
                                axum::http::StatusCode::OK,
                                [("content-type", "application/x-protobuf")],
                                ExportTraceServiceResponse {
                                    partial_success: None,
                                }
                                .encode_to_vec(),
                            )
                        }
                        Err(_) => (
                            axum::http::StatusCode::BAD_REQUEST,
                            [("content-type", "text/plain")],
                            b"not an ExportTraceServiceRequest".to_vec(),
                        ),
                    }
                }
            }),
        );
        let tasks = vec![
            tokio::spawn(async move {
                let _ = grpc.await;
            }),
            tokio::spawn(async move {
                let _ = axum::serve(http_listener, router).await;
            }),
        ];
        Ok(Self {
            grpc: format!("http://{grpc_addr}"),
            http: format!("http://{http_addr}"),
            spans,
            tasks,
        })
    }

    /// Every span received so far (none for a sink).
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .spans
            .clone()
    }

    /// How many spans arrived so far.
    pub fn count(&self) -> usize {
        self.spans
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .count
    }

    /// The spans of `trace_id`, once there are at least `count` of them
    /// (waiting up to `timeout`).
    pub async fn trace(
        &self,
        trace_id: &str,
        count: usize,
        timeout: Duration,
    ) -> anyhow::Result<Vec<ReceivedSpan>> {
        let deadline = Instant::now() + timeout;
        loop {
            let spans: Vec<ReceivedSpan> = self
                .spans()
                .into_iter()
                .filter(|s| s.trace_id == trace_id)
                .collect();
            if spans.len() >= count {
                return Ok(spans);
            }
            if Instant::now() >= deadline {
                return Err(anyhow::anyhow!(
                    "{} of {count} spans of trace {trace_id} arrived in {timeout:?}: {spans:#?}",
                    spans.len()
                ))
                .context("waiting for spans");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}
