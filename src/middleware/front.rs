//! [`Front`]: everything our code does to a request around the API's
//! handlers, in the order it happens, as one service around axum's router.
//!
//! 1. The clock starts, and the server span (when traces are exported).
//! 2. The route template is found ([`Routes`]). No route: the router's
//!    fallback answers 404, unlimited and without a deadline (it reads no
//!    body).
//! 3. A body declared over `http.body_limit` is answered 413 before a byte
//!    of it is read, and before the limiter: a body that cannot be taken
//!    costs no token and no Redis call.
//! 4. Within `http.request_timeout` (else 408 with `Connection: close`:
//!    the rest of a stalled body is never read): the limiter decides (for
//!    the API's routes, where a policy limits them: an unlimited policy's
//!    route costs no check) and answers 429, 400, 401, 503 or 500 itself,
//!    or the route's handler runs and the RateLimit headers go on its
//!    answer. A route whose template has no parameters is called without
//!    the router, which would only match the path again
//!    ([`Route::dispatch`]).
//! 5. Bare errors from below (axum's 405, the 408) get problem+json
//!    bodies; every response gets `X-Instance-Id`; the duration goes into
//!    `http_server_request_duration_seconds` by route, method and status.
//!
//! One service rather than a layer per step: axum clones a route's whole
//! nest of boxed layers on every request, and each layer boxes its own
//! future: allocations on every request that a bare axum handler does not
//! make. The deadline's timer is armed only if the work does not finish on
//! its first poll, so an in-process check on a route that reads no body
//! never touches the timer wheel; and
//! not over a check that the store stack bounds within the timeout (by the
//! Redis deadline), whose answer comes in time without it. The deadline is
//! an instant, the request's start plus the timeout, so arming the timer
//! reads no clock.
//!
//! The steps on the server's path borrow the request (`&mut`) rather than
//! take it: it stays where the connection's service put it, in the future
//! hyper keeps, and is taken out (`mem::take`, which leaves an empty
//! request behind) only when the handler is called. A future keeps
//! everything its `async` block captured for its whole life, so a request
//! taken by value would be held once by each step (the connection's
//! service, [`Front::answer`], `route`, the limited route's work). Those
//! steps are also functions returning an `async move` block rather than
//! `async fn`s, whose futures hold each argument twice (as captured, and
//! as the local the body moves it into). Moving a future copies all of
//! it, and a larger one spreads each request over more cache lines
//! (measured in docs/http-cost.md).
//!
//! The server passes the peer address to [`Front::answer`] as an argument
//! rather than as a `ConnectInfo` extension: the first extension a request
//! gets allocates its type map (three allocations, freed with the
//! request); a route without parameters is dispatched without axum's
//! router (see [`super::routes`]), so its request's extensions stay empty.

use super::Verdict;
use super::routes::{Peer, Route, Routes};
use crate::config::HttpConfig;
use crate::headers::Problem;
use crate::limiter::{CurrentLimiter, Limiting};
use crate::telemetry::http::{Durations, MethodLabel, UNMATCHED, end_server_span, server_span};
use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::response::{IntoResponse, Response};
use http::{HeaderName, HeaderValue, Request, StatusCode, header};
use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::time::Instant;
use tower::Service as _;
use tracing::Instrument;

/// `X-Instance-Id`: which instance answered (handy behind a balancer).
pub const INSTANCE_ID_HEADER: HeaderName = HeaderName::from_static("x-instance-id");

/// The router with the rate limiter, deadlines and telemetry in front; see
/// the module docs. Cloning is one reference count each for the router and
/// the rest.
#[derive(Debug, Clone)]
pub struct Front {
    router: Router,
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    routes: Routes,
    unmatched: Durations,
    limiter: Arc<CurrentLimiter>,
    request_timeout: Duration,
    body_limit: usize,
    /// `None` for an instance id that is no header value.
    instance_id: Option<HeaderValue>,
}

impl Front {
    /// `router` (its state set) with `routes`, the table it was built with.
    pub fn new(
        router: Router,
        routes: Routes,
        limiter: Arc<CurrentLimiter>,
        http: &HttpConfig,
        instance_id: &str,
    ) -> Self {
        Self {
            router,
            shared: Arc::new(Shared {
                routes,
                unmatched: Durations::new(UNMATCHED),
                limiter,
                request_timeout: http.request_timeout,
                body_limit: http.body_limit,
                instance_id: HeaderValue::from_str(instance_id).ok(),
            }),
        }
    }

    /// Answers `request`, from the peer in its [`ConnectInfo`] extension
    /// if it has one (as axum's `into_make_service_with_connect_info`
    /// adds); never fails (every error is an HTTP answer).
    pub async fn handle(self, mut request: Request<Body>) -> Response {
        let peer = request
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0.ip());
        self.answer(&mut request, peer).await.0
    }

    /// Answers `request` from `peer` (the connection's address, which
    /// identifies an anonymous client), and gives the instant the answer
    /// was ready: the clock reading its duration was measured to, which
    /// the connection's header timeout starts from as well (one clock read
    /// for both).
    ///
    /// The request is borrowed, so the future holds a pointer rather than
    /// a copy (see the module docs); it is taken when a handler is called,
    /// and what is left in `request` afterwards is unspecified.
    ///
    /// The peer is an argument, not an extension of the request: the
    /// first extension allocates the request's type map (a box, its table,
    /// and a box for the value), freed again when the request is dropped.
    #[allow(
        clippy::manual_async_fn,
        reason = "an async fn holds each argument twice; see the module docs"
    )]
    pub fn answer(
        self,
        request: &mut Request<Body>,
        peer: Option<IpAddr>,
    ) -> impl Future<Output = (Response, std::time::Instant)> + '_ {
        async move {
            // The runtime's clock (the same reading as std's outside
            // tests), so that the request's deadline below is an instant
            // on it: no clock read where the timer is armed.
            let started = Instant::now();
            let method = MethodLabel::of(request.method());
            let span = server_span(method.as_str(), request.headers());
            // Taken apart, so the route found in `shared` is borrowed while the
            // router is called (not a reference count more a request).
            let Front { mut router, shared } = self;
            let route = shared.routes.find(request.uri().path());
            let response = if span.is_disabled() {
                Self::route(&mut router, &shared, route, request, peer, started).await
            } else {
                Self::route(&mut router, &shared, route, request, peer, started)
                    .instrument(span.clone())
                    .await
            };
            let mut response = problem_for_bare_errors(response);
            if let Some(id) = &shared.instance_id {
                response
                    .headers_mut()
                    .insert(INSTANCE_ID_HEADER, id.clone());
            }
            let status = response.status().as_u16();
            let (template, durations) = match route {
                Some(route) => (route.template, &route.durations),
                None => (UNMATCHED, &shared.unmatched),
            };
            let answered = Instant::now();
            durations.record(method, status, (answered - started).as_secs_f64());
            end_server_span(&span, method.as_str(), template, status);
            (response, answered.into_std())
        }
    }

    #[allow(
        clippy::manual_async_fn,
        reason = "an async fn holds each argument twice; see the module docs"
    )]
    fn route<'a>(
        router: &'a mut Router,
        shared: &'a Shared,
        route: Option<&'a Route>,
        request: &'a mut Request<Body>,
        peer: Option<IpAddr>,
        started: Instant,
    ) -> impl Future<Output = Response> + 'a {
        async move {
            let Some(route) = route else {
                let Ok(response) = router.call(std::mem::take(request)).await;
                return response;
            };
            if let Some(answer) = refuse_declared_too_large(shared.body_limit, request) {
                return answer;
            }
            let deadline = started + shared.request_timeout;
            let limiting = route
                .limited
                .then(|| shared.limiter.get())
                .and_then(|limiter| limiter.limiting(route.template, request.method()));
            let answered = if let Some(limiting) = limiting {
                let bounded = limiting
                    .longest_wait()
                    .is_some_and(|wait| wait < shared.request_timeout);
                Self::limit_then_call(router, route, limiting, request, peer, deadline, bounded)
                    .await
            } else {
                if route.peer {
                    request.extensions_mut().insert(Peer(peer));
                }
                let work = std::pin::pin!(route.dispatch(router, std::mem::take(request)));
                within(deadline, work).await.map(|Ok(response)| response)
            };
            match answered {
                Some(response) => response,
                // Bare: made a problem, with `Connection: close`, on the way out.
                None => StatusCode::REQUEST_TIMEOUT.into_response(),
            }
        }
    }

    #[allow(
        clippy::manual_async_fn,
        reason = "an async fn holds each argument twice; see the module docs"
    )]
    fn limit_then_call<'a>(
        router: &'a mut Router,
        route: &'a Route,
        limiting: Limiting,
        request: &'a mut Request<Body>,
        peer: Option<IpAddr>,
        deadline: Instant,
        bounded: bool,
    ) -> impl Future<Output = Option<Response>> + 'a {
        async move {
            // A check the store stack bounds within the request timeout
            // (the Redis deadline) is not put under the
            // request's timer as well: one timer less for every check that
            // waits (docs/performance.md, "Redis checks over HTTP").
            let outcome = if bounded {
                limiting.check(request.headers(), peer).await
            } else {
                let check = std::pin::pin!(limiting.check(request.headers(), peer));
                within(deadline, check).await?
            };
            match Verdict::from(outcome) {
                Verdict::Answer(response) => Some(response),
                Verdict::Pass(fields) => {
                    let work = std::pin::pin!(route.dispatch(router, std::mem::take(request)));
                    let Ok(mut response) = within(deadline, work).await?;
                    fields.write_to(response.headers_mut());
                    Some(response)
                }
            }
        }
    }
}

/// For `tower::ServiceExt::oneshot` and other tower callers (the tests); the
/// server calls [`Front::answer`], whose future it keeps unboxed.
impl tower::Service<Request<Body>> for Front {
    type Response = Response;
    type Error = Infallible;
    type Future = crate::store::BoxFuture<'static, Result<Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let front = self.clone();
        Box::pin(async move { Ok(front.handle(request).await) })
    }
}

/// `future`'s output, or `None` once `deadline` has passed. The timer is
/// armed only if the future waits: work that finishes on its first poll
/// (most requests) never touches the timer wheel.
async fn within<F: Future + ?Sized>(
    deadline: Instant,
    mut future: Pin<&mut F>,
) -> Option<F::Output> {
    // Matched where it is made: a named first poll's answer would keep its
    // room in this future while the timer waits.
    if let Poll::Ready(output) =
        std::future::poll_fn(|cx| Poll::Ready(future.as_mut().poll(cx))).await
    {
        return Some(output);
    }
    tokio::time::timeout_at(deadline, future).await.ok()
}

/// 413 at once for a request whose declared `Content-Length` is over
/// `limit`, before a byte of its body is read (axum's own limit reads up to
/// the limit first, and a client declaring 10 GB and sending nothing would
/// be waited for). A body without a length (chunked) is cut at the limit by
/// `DefaultBodyLimit` as it is read.
fn refuse_declared_too_large(limit: usize, request: &Request<Body>) -> Option<Response> {
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let length = declared.filter(|&n| n > limit as u64)?;
    let mut answer = Problem::new(
        "too-large",
        "Content Too Large",
        StatusCode::PAYLOAD_TOO_LARGE.as_u16(),
        format!("the body declares {length} bytes; at most {limit} are taken"),
    )
    .into_response();
    // The body is never read: the connection cannot carry another request.
    answer
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    Some(answer)
}

/// Bare error responses from below the handlers, given problem+json
/// bodies: axum's 405 (its headers, `Allow` and the RateLimit fields,
/// kept; the limiter decided first, so a flood of wrong methods is limited
/// like any other request), and the deadline's 408 (with `Connection:
/// close`: the rest of a stalled body is never read, so the connection
/// cannot carry another request).
fn problem_for_bare_errors(response: Response) -> Response {
    // Every response passes here: the status first, the header only for
    // the two statuses.
    let status = response.status();
    if !matches!(
        status,
        StatusCode::METHOD_NOT_ALLOWED | StatusCode::REQUEST_TIMEOUT
    ) || response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/problem+json"))
    {
        return response;
    }
    let (parts, _) = response.into_parts();
    let mut answer = if status == StatusCode::REQUEST_TIMEOUT {
        let mut answer = Problem::new(
            "request-timeout",
            "Request Timeout",
            status.as_u16(),
            "the request was not received and answered in time",
        )
        .into_response();
        answer
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        answer
    } else {
        Problem::new(
            "method-not-allowed",
            "Method Not Allowed",
            status.as_u16(),
            "this route does not take that method; see Allow",
        )
        .into_response()
    };
    for (name, value) in &parts.headers {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            answer.headers_mut().append(name, value.clone());
        }
    }
    answer
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_deadline_is_armed_only_for_work_that_waits() {
        // Ready at once: answered, however short the limit.
        let ready = std::pin::pin!(async { 7 });
        assert_eq!(within(Instant::now(), ready).await, Some(7));
        // Waits past the limit: cut.
        let slow = std::pin::pin!(tokio::time::sleep(Duration::from_secs(2)));
        let in_a_second = || Instant::now() + Duration::from_secs(1);
        assert_eq!(within(in_a_second(), slow).await, None);
        // Waits within it: answered.
        let quick = async {
            tokio::time::sleep(Duration::from_millis(500)).await;
            8
        };
        let quick = std::pin::pin!(quick);
        assert_eq!(within(in_a_second(), quick).await, Some(8));
    }
}
