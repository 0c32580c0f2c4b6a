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
use opentelemetry::propagation::Extractor;
use opentelemetry::trace::TraceContextExt;
use std::borrow::Cow;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The route label of requests no route matched.
pub const UNMATCHED: &str = "unmatched";

/// The method as a bounded label.
pub fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::CONNECT => "CONNECT",
        Method::OPTIONS => "OPTIONS",
        Method::TRACE => "TRACE",
        Method::PATCH => "PATCH",
        _ => "_OTHER",
    }
}

/// The status as a label, without allocating for the usual ones.
fn status_label(status: u16) -> Cow<'static, str> {
    const USUAL: [(u16, &str); 14] = [
        (200, "200"),
        (201, "201"),
        (204, "204"),
        (304, "304"),
        (400, "400"),
        (401, "401"),
        (403, "403"),
        (404, "404"),
        (405, "405"),
        (422, "422"),
        (429, "429"),
        (500, "500"),
        (502, "502"),
        (503, "503"),
    ];
    match USUAL.iter().find(|(code, _)| *code == status) {
        Some((_, label)) => Cow::Borrowed(label),
        None => Cow::Owned(status.to_string()),
    }
}

/// One route's `http_server_request_duration_seconds` series, by method
/// and status, each registered on its first use (see [`Handles`]). The
/// route is known by the caller, so only the small key is hashed.
#[derive(Debug)]
pub struct Durations {
    route: &'static str,
    by_code: Handles<(&'static str, u16), metrics::Histogram>,
}

impl Durations {
    /// The series of `route` (a template, or [`UNMATCHED`]).
    pub fn new(route: &'static str) -> Self {
        Self {
            route,
            by_code: Handles::default(),
        }
    }

    /// Records one response's duration.
    pub fn record(&self, method: &'static str, status: u16, seconds: f64) {
        let route = self.route;
        self.by_code
            .get(
                &(method, status),
                || (method, status),
                || {
                    metrics::histogram!(
                        m::HTTP_SERVER_REQUEST_DURATION_SECONDS,
                        "http_request_method" => method,
                        "http_route" => route,
                        "http_response_status_code" => status_label(status),
                    )
                },
            )
            .record(seconds);
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
    );
    if !span.is_disabled() {
        let parent = opentelemetry::global::get_text_map_propagator(|propagator| {
            propagator.extract(&HeaderExtractor(headers))
        });
        let _ = span.set_parent(parent);
    }
    span
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
        assert_eq!(method_label(&Method::GET), "GET");
        assert_eq!(
            method_label(&Method::from_bytes(b"BREW").unwrap()),
            "_OTHER"
        );
        assert_eq!(status_label(429), "429");
        assert_eq!(status_label(418), "418");
    }
}
