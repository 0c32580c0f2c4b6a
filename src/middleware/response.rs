//! What the client sees for each outcome of the limiter: the request goes
//! on to the API with rate-limit headers, or is answered here.
//!
//! | outcome | answer |
//! |---|---|
//! | admitted | the API's response, plus the `RateLimit-*` headers |
//! | denied | 429 problem+json, `Retry-After` and the `RateLimit-*` headers |
//! | unknown API key, admitted by its address's bucket | 401 problem+json, `WWW-Authenticate: Bearer`, the headers |
//! | failed open | the API's response, without headers (nothing was counted) |
//! | failed closed | 503 problem+json with `Retry-After` (the client is not at fault) |
//! | malformed identity | 400 problem+json (500 if the server lacks peer addresses) |
//! | the store refused the request itself | 500 problem+json; nothing admitted |
//! | any of these under a policy in shadow mode | the API's response, without headers |

use crate::headers::{Problem, RateLimitFields, ceil_secs};
use crate::identity::{IdentityError, KeyKind};
use crate::limiter::Outcome;
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, HeaderValue, header};

/// What the middleware does with a request.
#[derive(Debug)]
pub enum Verdict {
    /// Call the API, then set these fields on its response (none for an
    /// unlimited route, a policy in shadow mode or a request failed open).
    Pass(RateLimitFields),
    /// Answer in the API's place.
    Answer(Response),
}

/// A problem, with `headers` beside its own.
fn answer(problem: Problem, headers: HeaderMap) -> Verdict {
    Verdict::Answer((headers, problem).into_response())
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

impl From<Outcome> for Verdict {
    fn from(outcome: Outcome) -> Self {
        match outcome {
            Outcome::Unlimited => Verdict::Pass(RateLimitFields::default()),
            // Shadow mode: counted, never refused, and no headers, which
            // would tell the client of a limit that is not enforced.
            Outcome::Shadow { .. } => Verdict::Pass(RateLimitFields::default()),
            // Fail open: admitted, and no RateLimit headers, since no bucket
            // was counted and any numbers would be made up.
            Outcome::FailedOpen { .. } => Verdict::Pass(RateLimitFields::default()),
            Outcome::BadIdentity(error) => answer(identity_problem(&error), HeaderMap::new()),
            Outcome::StoreFailed { policy, error } => {
                // The store refused the request itself: a configuration
                // error (validation should make it impossible). Our fault,
                // not the client's, and nothing is admitted.
                tracing::error!(policy = %policy.name, %error, "rate limit store refused the request");
                let problem = Problem::new(
                    "internal",
                    "Internal Server Error",
                    500,
                    "the rate limiter cannot decide this request",
                );
                answer(problem, HeaderMap::new())
            }
            Outcome::Unavailable {
                policy,
                retry_after,
            } => {
                // Fail closed: 503, not 429, because the client is not at
                // fault; Retry-After is the breaker's next probe.
                let mut headers = HeaderMap::new();
                headers.insert(header::RETRY_AFTER, ceil_secs(retry_after).into());
                let problem = Problem::new(
                    "limiter-unavailable",
                    "Service Unavailable",
                    503,
                    format!(
                        "the rate limiter for policy {} cannot decide right now",
                        policy.name
                    ),
                );
                answer(problem, headers)
            }
            Outcome::Decided {
                policy,
                limit,
                decision,
                kind,
                ..
            } => {
                let fields = RateLimitFields::with_policy_field(
                    &policy.name,
                    policy.policy_field(&limit),
                    &limit,
                    &decision,
                );
                if !decision.allowed {
                    let mut response =
                        Problem::rate_limited(&policy.name, &decision).into_response();
                    fields.write_to(response.headers_mut());
                    return Verdict::Answer(response);
                }
                if kind == KeyKind::UnknownApiKey {
                    let mut response = Problem::new(
                        "unknown-api-key",
                        "Unauthorized",
                        401,
                        "the API key is not recognised",
                    )
                    .into_response();
                    fields.write_to(response.headers_mut());
                    response
                        .headers_mut()
                        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                    return Verdict::Answer(response);
                }
                Verdict::Pass(fields)
            }
        }
    }
}
