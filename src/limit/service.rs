//! Decides in `call`: pass through with headers, or answer 429/400/401/503.

use crate::headers::{PROBLEM_JSON, Problem, ceil_secs, rate_limit_headers};
use crate::identity::{IdentityError, KeyKind};
use crate::policy::{Limiter, Outcome};
use axum::body::Body;
use axum::extract::{ConnectInfo, MatchedPath};
use axum::response::Response;
use http::{HeaderMap, Request, StatusCode, header};
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::{Context, Poll};
use tower::Service;

/// The middleware service. See the [module docs](crate::limit).
#[derive(Debug, Clone)]
pub struct RateLimit<S> {
    inner: S,
    limiter: Arc<Limiter>,
}

impl<S> RateLimit<S> {
    /// Wraps `inner`, deciding through `limiter`.
    pub fn new(inner: S, limiter: Arc<Limiter>) -> Self {
        Self { inner, limiter }
    }
}

fn problem_response(problem: &Problem, extra: HeaderMap) -> Response {
    let mut response = Response::new(Body::from(problem.to_json()));
    *response.status_mut() =
        StatusCode::from_u16(problem.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    headers.extend(extra);
    headers.insert(header::CONTENT_TYPE, PROBLEM_JSON);
    response
}

fn identity_problem(error: &IdentityError) -> Problem {
    match error {
        // A wiring bug on our side, not the client's fault; say nothing more.
        IdentityError::NoPeerAddress => Problem::new(
            "internal",
            "Internal Server Error",
            500,
            "the request could not be attributed to a client",
        ),
        other => Problem::new("bad-identity", "Bad Request", 400, other.to_string()),
    }
}

impl<S> Service<Request<Body>> for RateLimit<S>
where
    S: Service<Request<Body>, Response = Response> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = crate::store::BoxFuture<'static, Result<Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Readiness is the inner service's; the limit is applied in `call`.
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        // The clone is not ready; the ready one is taken for this call
        // (the standard tower pattern for services used from a future).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let limiter = Arc::clone(&self.limiter);
        Box::pin(async move {
            let route = request
                .extensions()
                .get::<MatchedPath>()
                .map(|p| p.as_str().to_owned())
                .unwrap_or_else(|| request.uri().path().to_owned());
            let peer = request
                .extensions()
                .get::<ConnectInfo<SocketAddr>>()
                .map(|c| c.0.ip());
            let outcome = limiter
                .check(&route, request.method(), request.headers(), peer)
                .await;
            match outcome {
                Outcome::Unlimited => inner.call(request).await,
                Outcome::BadIdentity(error) => Ok(problem_response(
                    &identity_problem(&error),
                    HeaderMap::new(),
                )),
                Outcome::StoreFailed { policy, error } => {
                    // The store refused the request itself: a configuration
                    // error (validation should make it impossible). Our
                    // fault, not the client's, and nothing is admitted.
                    tracing::error!(policy = %policy.name, %error, "rate limit store refused the request");
                    let problem = Problem::new(
                        "internal",
                        "Internal Server Error",
                        500,
                        "the rate limiter cannot decide this request",
                    );
                    Ok(problem_response(&problem, HeaderMap::new()))
                }
                Outcome::Unavailable {
                    policy,
                    retry_after,
                } => {
                    // Fail closed: 503, not 429, because the client is not
                    // at fault; Retry-After is the breaker's next probe.
                    let mut extra = HeaderMap::new();
                    extra.insert(header::RETRY_AFTER, ceil_secs(retry_after).into());
                    let problem = Problem::new(
                        "limiter-unavailable",
                        "Service Unavailable",
                        503,
                        format!(
                            "the rate limiter for policy {} cannot decide right now",
                            policy.name
                        ),
                    );
                    Ok(problem_response(&problem, extra))
                }
                // Fail open: admitted, and no RateLimit headers, since no
                // bucket was counted and any numbers would be made up.
                Outcome::FailedOpen { .. } => inner.call(request).await,
                Outcome::Decided {
                    policy,
                    limit,
                    decision,
                    kind,
                    ..
                } => {
                    let headers = rate_limit_headers(&policy.name, &limit, &decision);
                    if !decision.allowed {
                        let problem = Problem::rate_limited(&policy.name, &decision);
                        return Ok(problem_response(&problem, headers));
                    }
                    if kind == KeyKind::UnknownApiKey {
                        let mut headers = headers;
                        headers.insert(
                            header::WWW_AUTHENTICATE,
                            http::HeaderValue::from_static("Bearer"),
                        );
                        let problem = Problem::new(
                            "unknown-api-key",
                            "Unauthorized",
                            401,
                            "the API key is not recognised",
                        );
                        return Ok(problem_response(&problem, headers));
                    }
                    let mut response = inner.call(request).await?;
                    response.headers_mut().extend(headers);
                    Ok(response)
                }
            }
        })
    }
}
