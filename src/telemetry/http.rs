//! The server side of every request: the RED histogram and the server span,
//! both made by the front service (`middleware::Front`), which times and
//! counts every response: the API's, the limiter's own 429/400/401/503, the
//! operations endpoints', and 404s.
//!
//! Labels follow the OpenTelemetry HTTP semantic conventions, bounded: the
//! method (`_OTHER` for one not in the RFCs), the route template
//! (`unmatched` when no route matched), the status code.

use super::TARGET;
use crate::metrics::{self as m, Handles};
use http::{HeaderMap, Method};
use metrics::Histogram;
use opentelemetry::propagation::Extractor;
use opentelemetry::trace::TraceContextExt;
use std::borrow::Cow;
use std::sync::OnceLock;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The route label of requests no route matched.
pub const UNMATCHED: &str = "unmatched";

/// The method labels, by [`MethodLabel`]'s index: the RFCs' methods,
/// then `_OTHER` for any other.
const METHODS: [&str; 10] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH", "_OTHER",
];

/// A request's method as a bounded label: one of the RFCs' methods or `_OTHER`, kept as its
/// index so the duration series is found without hashing the name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MethodLabel(u8);

impl MethodLabel {
    /// The label of `method`.
    pub fn of(method: &Method) -> Self {
        Self(match *method {
            Method::GET => 0,
            Method::HEAD => 1,
            Method::POST => 2,
            Method::PUT => 3,
            Method::DELETE => 4,
            Method::CONNECT => 5,
            Method::OPTIONS => 6,
            Method::TRACE => 7,
            Method::PATCH => 8,
            _ => 9,
        })
    }

    /// The label's text.
    pub fn as_str(self) -> &'static str {
        METHODS[usize::from(self.0)]
    }
}

/// The statuses most answers have: their labels need no allocation, and
/// their duration series no lookup (see [`Durations`]).
const USUAL: [u16; 14] = [
    200, 201, 204, 304, 400, 401, 403, 404, 405, 422, 429, 500, 502, 503,
];
const USUAL_LABELS: [&str; USUAL.len()] = [
    "200", "201", "204", "304", "400", "401", "403", "404", "405", "422", "429", "500", "502",
    "503",
];

/// Where `status` is in [`USUAL`], if it is there.
fn usual_index(status: u16) -> Option<usize> {
    USUAL.iter().position(|&code| code == status)
}

/// The status as a label, without allocating for the usual ones.
fn status_label(status: u16) -> Cow<'static, str> {
    match usual_index(status) {
        Some(i) => Cow::Borrowed(USUAL_LABELS[i]),
        None => Cow::Owned(status.to_string()),
    }
}

/// One route's `http_server_request_duration_seconds` series, by method
/// and status, each registered on its first use. The route is known by
/// the caller. A usual status's series is found by index, as the
/// limiter's are: a table lookup in a lock-free cell, rather than a
/// hashed map behind a read lock, its key's comparison and the handle's
/// reference count on every request. Any other status goes through
/// [`Handles`].
#[derive(Debug)]
pub struct Durations {
    route: &'static str,
    /// By method, then by the status's place in [`USUAL`].
    usual: Box<[[OnceLock<Histogram>; USUAL.len()]; METHODS.len()]>,
    other: Handles<(&'static str, u16), Histogram>,
}

impl Durations {
    /// The series of `route` (a template, or [`UNMATCHED`]).
    pub fn new(route: &'static str) -> Self {
        Self {
            route,
            usual: Box::new(std::array::from_fn(|_| {
                std::array::from_fn(|_| OnceLock::new())
            })),
            other: Handles::default(),
        }
    }

    /// Registers the series of `method` and each of `statuses`, empty, so
    /// that they are scraped at zero before their first response.
    pub fn count_from_zero(&self, method: MethodLabel, statuses: &[u16]) {
        for &status in statuses {
            let register = || self.register(method, status);
            match usual_index(status) {
                Some(i) => {
                    self.usual[usize::from(method.0)][i].get_or_init(register);
                }
                None => {
                    let key = (method.as_str(), status);
                    // Kept by the handles; nothing to record yet.
                    let _registered = self.other.get(&key, || key, register);
                }
            }
        }
    }

    fn register(&self, method: MethodLabel, status: u16) -> Histogram {
        metrics::histogram!(
            m::HTTP_SERVER_REQUEST_DURATION_SECONDS,
            "http_request_method" => method.as_str(),
            "http_route" => self.route,
            "http_response_status_code" => status_label(status),
        )
    }

    /// Records one response's duration.
    pub fn record(&self, method: MethodLabel, status: u16, seconds: f64) {
        let register = || self.register(method, status);
        match usual_index(status) {
            Some(i) => self.usual[usize::from(method.0)][i]
                .get_or_init(register)
                .record(seconds),
            None => {
                let key = (method.as_str(), status);
                self.other.get(&key, || key, register).record(seconds);
            }
        }
    }
}

/// Reads W3C trace context from request headers.
struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// The server span of a request (disabled, and so free, unless traces are
/// exported), continuing the caller's trace (nginx's, say) if it sent one.
pub fn server_span(method: &'static str, headers: &HeaderMap) -> Span {
    let span = tracing::info_span!(
        target: TARGET,
        "http.server",
        otel.name = method,
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        http.request.method = method,
        http.route = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
        "http.request.header.x-request-id" = tracing::field::Empty,
    );
    if !span.is_disabled() {
        follow_caller(&span, headers);
        // The proxy's request id (nginx's, also in its access log): a trace
        // the service started is found from a log line by it.
        if let Some(id) = headers.get("x-request-id").and_then(|v| v.to_str().ok()) {
            span.record("http.request.header.x-request-id", id);
        }
    }
    span
}

/// The server span of a gRPC call to `service`/`method`, continuing the
/// caller's trace (Envoy's) from its metadata as [`server_span`] does.
pub fn rpc_span(service: &'static str, method: &'static str, metadata: &HeaderMap) -> Span {
    let span = tracing::info_span!(
        target: TARGET,
        "rpc.server",
        otel.name = format!("{service}/{method}"),
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        rpc.system = "grpc",
        rpc.service = service,
        rpc.method = method,
        rpc.grpc.status_code = tracing::field::Empty,
    );
    if !span.is_disabled() {
        follow_caller(&span, metadata);
    }
    span
}

/// Makes `span` a child of the caller's, if `headers` carry a trace
/// context (W3C `traceparent`).
fn follow_caller(span: &Span, headers: &HeaderMap) {
    let parent = opentelemetry::global::get_text_map_propagator(|propagator| {
        propagator.extract(&HeaderExtractor(headers))
    });
    let _ = span.set_parent(parent);
}

/// Names the server span by its route and records the response on it.
pub fn end_server_span(span: &Span, method: &'static str, route: &str, status: u16) {
    if span.is_disabled() {
        return;
    }
    span.record("http.route", route);
    span.record("http.response.status_code", status);
    // The OTel span has started by now: rename it there.
    span.context()
        .span()
        .update_name(format!("{method} {route}"));
    if status >= 500 {
        span.record("otel.status_code", "ERROR");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_stay_bounded() {
        assert_eq!(MethodLabel::of(&Method::GET).as_str(), "GET");
        assert_eq!(MethodLabel::of(&Method::PATCH).as_str(), "PATCH");
        assert_eq!(
            MethodLabel::of(&Method::from_bytes(b"BREW").unwrap()).as_str(),
            "_OTHER"
        );
        assert_eq!(status_label(429), "429");
        assert_eq!(status_label(418), "418");
    }

    /// Usual statuses (found by index) and others (found by hashing) each
    /// land in their own series, by method, on the route.
    #[test]
    fn every_duration_lands_in_its_series() {
        // Through the layer `/metrics` renders from.
        let recorder = crate::metrics::buckets::Buckets::new(
            metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder(),
            crate::metrics::SECONDS_BUCKETS,
        );
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            let durations = Durations::new("/api/items");
            let get = MethodLabel::of(&Method::GET);
            let post = MethodLabel::of(&Method::POST);
            durations.record(get, 200, 0.1);
            durations.record(get, 200, 0.2);
            durations.record(post, 200, 0.3);
            durations.record(get, 503, 0.4);
            durations.record(get, 418, 0.5);
            durations.record(get, 418, 0.6);
        });
        let text = handle.render();
        let count = |method: &str, status: &str| {
            let series = format!(
                "http_server_request_duration_seconds_count{{http_request_method=\"{method}\",http_route=\"/api/items\",http_response_status_code=\"{status}\"}} "
            );
            text.lines()
                .find_map(|l| l.strip_prefix(series.as_str()))
                .unwrap_or_else(|| panic!("no {series} in\n{text}"))
                .to_owned()
        };
        assert_eq!(count("GET", "200"), "2");
        assert_eq!(count("POST", "200"), "1");
        assert_eq!(count("GET", "503"), "1");
        assert_eq!(count("GET", "418"), "2");
    }

    /// Series counted from zero are scraped before their first response,
    /// so a rate sees that response; recording then goes to the same one.
    #[test]
    fn refusals_are_scraped_at_zero_before_the_first() {
        let recorder = crate::metrics::buckets::Buckets::new(
            metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder(),
            crate::metrics::SECONDS_BUCKETS,
        );
        let handle = recorder.handle();
        let durations = metrics::with_local_recorder(&recorder, || {
            let durations = Durations::new("/api/orders");
            durations.count_from_zero(MethodLabel::of(&Method::POST), &[429, 503, 418]);
            durations
        });
        let count = |text: &str, status: &str| {
            let series = format!(
                "http_server_request_duration_seconds_count{{http_request_method=\"POST\",http_route=\"/api/orders\",http_response_status_code=\"{status}\"}} "
            );
            text.lines()
                .find_map(|l| l.strip_prefix(series.as_str()))
                .map(str::to_owned)
        };
        let before = handle.render();
        for status in ["429", "503", "418"] {
            assert_eq!(count(&before, status).as_deref(), Some("0"), "{before}");
        }
        assert_eq!(count(&before, "200"), None);
        metrics::with_local_recorder(&recorder, || {
            durations.record(MethodLabel::of(&Method::POST), 503, 0.01);
        });
        assert_eq!(count(&handle.render(), "503").as_deref(), Some("1"));
    }
}
