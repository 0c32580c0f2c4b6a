//! The server side of every request: the RED histogram and the server span.
//!
//! [`HttpLayer`] wraps the whole router, so it times and counts every
//! response: the API's, the limiter's own 429/400/401/503, the operations
//! endpoints', and 404s. The route template is known only after routing,
//! inside the router: [`MarkRouteLayer`] (a `route_layer`) copies it from the
//! request onto the response, where this layer reads it.
//!
//! Labels follow the OpenTelemetry HTTP semantic conventions, bounded: the
//! method (`_OTHER` for one not in the RFCs), the route template
//! (`unmatched` when no route matched), the status code.

use super::TARGET;
use crate::metrics::{self as m, Handles};
use axum::body::Body;
use axum::extract::{MatchedPath, Request};
use axum::response::Response;
use http::{HeaderMap, Method};
use opentelemetry::propagation::Extractor;
use opentelemetry::trace::TraceContextExt;
use std::borrow::Cow;
use std::sync::{Arc, LazyLock};
use std::task::{Context, Poll};
use std::time::Instant;
use tower::{Layer, Service};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

/// Copies the matched route template onto the response (for [`HttpLayer`]);
/// use as the router's outermost `route_layer`.
///
/// A tower layer rather than `axum::middleware::from_fn`: `from_fn` clones
/// the route's whole inner stack and boxes it as a `Next` on every request
/// (a profile of the limited route showed those `clone_box` calls, nested
/// once per layer below, and the state clones they carry). The template
/// is known before the call, so the inner service is called at once, as
/// it stands ready, and nothing is cloned.
#[derive(Debug, Clone, Copy, Default)]
pub struct MarkRouteLayer;

impl<S> Layer<S> for MarkRouteLayer {
    type Service = MarkRoute<S>;

    fn layer(&self, inner: S) -> Self::Service {
        MarkRoute { inner }
    }
}

/// The service [`MarkRouteLayer`] makes.
#[derive(Debug, Clone)]
pub struct MarkRoute<S> {
    inner: S,
}

impl<S> Service<Request<Body>> for MarkRoute<S>
where
    S: Service<Request<Body>, Response = Response>,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let route = request.extensions().get::<MatchedPath>().cloned();
        let response = self.inner.call(request);
        Box::pin(async move {
            let mut response = response.await?;
            if let Some(route) = route {
                response.extensions_mut().insert(route);
            }
            Ok(response)
        })
    }
}

/// The method as a bounded label.
fn method_label(method: &Method) -> &'static str {
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

/// Routes' duration histograms: by template, then by method and status.
type ByRoute = Handles<Box<str>, Arc<Handles<(&'static str, u16), metrics::Histogram>>>;

/// The `http_server_request_duration_seconds` series of one response,
/// registered on its first use (see [`Handles`]).
fn request_duration(method: &'static str, route: &str, status: u16) -> metrics::Histogram {
    static BY_ROUTE: LazyLock<ByRoute> = LazyLock::new(ByRoute::default);
    let by_code = BY_ROUTE.get(route, || route.into(), Arc::default);
    by_code.get(
        &(method, status),
        || (method, status),
        || {
            metrics::histogram!(
                m::HTTP_SERVER_REQUEST_DURATION_SECONDS,
                "http_request_method" => method,
                "http_route" => route.to_owned(),
                "http_response_status_code" => status_label(status),
            )
        },
    )
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

/// Times every response into `http_server_request_duration_seconds` and
/// wraps it in a server span. See the module docs.
#[derive(Debug, Clone, Copy, Default)]
pub struct HttpLayer;

impl<S> Layer<S> for HttpLayer {
    type Service = HttpService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        HttpService { inner }
    }
}

/// The service [`HttpLayer`] makes.
#[derive(Debug, Clone)]
pub struct HttpService<S> {
    inner: S,
}

impl<S> Service<Request<Body>> for HttpService<S>
where
    S: Service<Request<Body>, Response = Response> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let started = Instant::now();
        let method = method_label(request.method());
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
            // Continue the caller's trace (nginx's, say) if it sent one.
            let parent = opentelemetry::global::get_text_map_propagator(|propagator| {
                propagator.extract(&HeaderExtractor(request.headers()))
            });
            let _ = span.set_parent(parent);
        }
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            let response = inner.call(request).instrument(span.clone()).await?;
            let route = response
                .extensions()
                .get::<MatchedPath>()
                .map_or("unmatched", MatchedPath::as_str);
            let status = response.status().as_u16();
            request_duration(method, route, status).record(started.elapsed().as_secs_f64());
            if !span.is_disabled() {
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
            Ok(response)
        })
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
