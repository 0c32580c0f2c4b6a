//! Envoy's rate limit service (RLS v3) over gRPC: the limiter in front of
//! any service Envoy proxies.
//!
//! `ShouldRateLimit` decides each descriptor of a request on its own, as
//! envoy ratelimit does: the policy its domain's rules name
//! ([`crate::descriptors`]), one bucket per domain and entries, through
//! the same store stack as an HTTP request (every algorithm, Redis or
//! Cluster, the failure modes, deny cache, leases, shards, hot keys,
//! metrics and spans). The answer is `OVER_LIMIT` if any descriptor is.
//!
//! What each outcome answers:
//!
//! | outcome | descriptor status |
//! |---|---|
//! | no rule, unknown domain, unlimited policy, shadow policy, failed open | `OK`, no limit |
//! | decided | `OK` or `OVER_LIMIT`, `current_limit` (the policy's rate), `limit_remaining`, `duration_until_reset` (until the bucket is full) |
//! | the store is away and the policy fails closed | `OVER_LIMIT`, `duration_until_reset` until a retry may succeed |
//! | a cost above the burst (a huge `hits_addend`) | `OVER_LIMIT`, `limit_remaining` 0: it could never be admitted |
//!
//! The cost of a descriptor is its own `hits_addend` if set (0 reads the
//! bucket and takes nothing), else the request's if not 0, else the
//! policy's `cost`. The response carries the RateLimit header fields of
//! the most restrictive descriptor (and `Retry-After` when over the
//! limit) in `response_headers_to_add`, for Envoy to pass to the client.
//!
//! Bad input is refused with `INVALID_ARGUMENT` naming the field, and
//! never reaches a store: an empty domain, no descriptors, a descriptor
//! without entries, an entry without a key, and more than
//! [`MAX_DESCRIPTORS`] descriptors, [`MAX_ENTRIES`] entries or
//! [`MAX_TEXT`] bytes in the domain or a key. A message above
//! `rls.max_message_bytes` is refused by the gRPC layer (`OUT_OF_RANGE`).
//! Envoy applies its own `failure_mode_deny` to an error status, and with
//! the usual `false` passes the request unlimited, so only what Envoy's
//! configuration builds is refused: the domain, the keys and the number
//! of descriptors. A value is what a client sent (a header, its address)
//! and is never refused for its length: it is hashed into the bucket's key
//! like any other, so a client cannot slip past its limit by sending a
//! long one. The message bound's default (4 MiB) is far above what Envoy
//! forwards with its default header limit (60 KiB).

pub mod proto;

use crate::algorithm::{Decision, Limit};
use crate::descriptors::DescriptorId;
use crate::headers::{RateLimitFields, ceil_secs};
use crate::limiter::{CurrentLimiter, Outcome};
use crate::metrics as m;
use crate::store::StoreError;
use crate::telemetry::http::rpc_span;
use proto::envoy::config::core::v3::HeaderValue as EnvoyHeader;
use proto::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use proto::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use proto::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use std::sync::Arc;
use std::time::Duration;
use tonic::{Request, Response, Status};
use tracing::Instrument;

/// Most descriptors one request may carry.
pub const MAX_DESCRIPTORS: usize = 64;
/// Most entries one descriptor may carry.
pub const MAX_ENTRIES: usize = 16;
/// The longest domain or entry key, in bytes (values are not bounded:
/// see the module docs).
pub const MAX_TEXT: usize = 1024;

const SERVICE: &str = "envoy.service.ratelimit.v3.RateLimitService";
const METHOD: &str = "ShouldRateLimit";
const RPC_METHOD: &str = "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// The rate limit service, deciding with the limiter in force (a reload
/// replaces its rules with its policies).
#[derive(Debug, Clone)]
pub struct RateLimiter {
    limiter: Arc<CurrentLimiter>,
}

impl RateLimiter {
    /// The service over `limiter`.
    pub fn new(limiter: Arc<CurrentLimiter>) -> Self {
        Self { limiter }
    }

    /// The gRPC service, refusing messages above `max_message_bytes`.
    pub fn into_service(self, max_message_bytes: usize) -> RateLimitServiceServer<Self> {
        RateLimitServiceServer::new(self).max_decoding_message_size(max_message_bytes)
    }

    /// Answers one request (the RPC without its transport).
    pub async fn decide(&self, request: RateLimitRequest) -> Result<RateLimitResponse, Status> {
        let descriptors = parse(request)?;
        let limiter = self.limiter.get();
        // Every descriptor at once: on Redis, their calls share a round trip.
        let outcomes = futures_util::future::join_all(
            descriptors
                .into_iter()
                .map(|(id, cost)| limiter.check_descriptor(id, cost)),
        )
        .await;
        let mut statuses = Vec::with_capacity(outcomes.len());
        let mut strictest: Option<Fields> = None;
        for outcome in &outcomes {
            let (status, fields) = answer(outcome)?;
            statuses.push(status);
            if let Some(fields) = fields
                && strictest.as_ref().is_none_or(|s| fields.stricter_than(s))
            {
                strictest = Some(fields);
            }
        }
        let over = statuses.iter().any(|s| s.code == Code::OverLimit as i32);
        Ok(RateLimitResponse {
            overall_code: if over { Code::OverLimit } else { Code::Ok } as i32,
            statuses,
            response_headers_to_add: strictest.map(Fields::headers).unwrap_or_default(),
            ..Default::default()
        })
    }
}

#[tonic::async_trait]
impl RateLimitService for RateLimiter {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let started = quanta::Instant::now();
        let (metadata, _, message) = request.into_parts();
        let span = rpc_span(SERVICE, METHOD, metadata.as_ref());
        let result = self.decide(message).instrument(span.clone()).await;
        let (grpc, code) = match &result {
            Ok(r) if r.overall_code == Code::OverLimit as i32 => ("OK", "OVER_LIMIT"),
            Ok(_) => ("OK", "OK"),
            Err(status) => (grpc_code_name(status.code()), "none"),
        };
        span.record("rpc.grpc.status_code", grpc);
        if result.is_err() {
            span.record("otel.status_code", "ERROR");
        }
        metrics::histogram!(
            m::RPC_SERVER_CALL_DURATION_SECONDS,
            "rpc_method" => RPC_METHOD,
            "rpc_response_status_code" => grpc,
            "ratelimit_code" => code,
        )
        .record(started.elapsed().as_secs_f64());
        result.map(Response::new)
    }
}

/// The gRPC status code's name, as the semantic conventions label it.
fn grpc_code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

/// Each descriptor of a valid request, with its cost (`None`: the
/// policy's).
fn parse(request: RateLimitRequest) -> Result<Vec<(DescriptorId, Option<u64>)>, Status> {
    fn invalid<T>(message: String) -> Result<T, Status> {
        Err(Status::invalid_argument(message))
    }
    let text = |field: &str, value: &str| {
        if value.len() > MAX_TEXT {
            return invalid(format!("{field} is longer than {MAX_TEXT} bytes"));
        }
        Ok(())
    };
    if request.domain.is_empty() {
        return invalid("domain must not be empty".into());
    }
    text("domain", &request.domain)?;
    if request.descriptors.is_empty() {
        return invalid("descriptors must not be empty".into());
    }
    if request.descriptors.len() > MAX_DESCRIPTORS {
        return invalid(format!(
            "{} descriptors: at most {MAX_DESCRIPTORS} are decided in one request",
            request.descriptors.len()
        ));
    }
    // Unset is 0 in proto3: a request adds 1 unless it says more.
    let request_cost = (request.hits_addend > 0).then_some(u64::from(request.hits_addend));
    let domain: Box<str> = request.domain.into();
    let mut out = Vec::with_capacity(request.descriptors.len());
    for (i, descriptor) in request.descriptors.into_iter().enumerate() {
        if descriptor.entries.is_empty() {
            return invalid(format!("descriptors[{i}] has no entries"));
        }
        if descriptor.entries.len() > MAX_ENTRIES {
            return invalid(format!(
                "descriptors[{i}] has {} entries, more than {MAX_ENTRIES}",
                descriptor.entries.len()
            ));
        }
        let mut entries = Vec::with_capacity(descriptor.entries.len());
        for (j, entry) in descriptor.entries.into_iter().enumerate() {
            if entry.key.is_empty() {
                return invalid(format!(
                    "descriptors[{i}].entries[{j}].key must not be empty"
                ));
            }
            text(&format!("descriptors[{i}].entries[{j}].key"), &entry.key)?;
            entries.push((entry.key.into_boxed_str(), entry.value.into_boxed_str()));
        }
        let id = DescriptorId {
            domain: domain.clone(),
            entries: entries.into_boxed_slice(),
        };
        out.push((id, descriptor.hits_addend.or(request_cost)));
    }
    Ok(out)
}

/// The header fields one decided descriptor would send the client.
#[derive(Debug)]
struct Fields {
    policy: Arc<str>,
    limit: Limit,
    decision: Decision,
}

impl Fields {
    /// Refused before admitted; among refusals the longer wait, among
    /// admissions the smaller share of the limit left.
    fn stricter_than(&self, other: &Fields) -> bool {
        let (a, b) = (&self.decision, &other.decision);
        match (a.allowed, b.allowed) {
            (false, true) => true,
            (true, false) => false,
            (false, false) => a.retry_after > b.retry_after,
            (true, true) => {
                u128::from(a.remaining) * u128::from(b.limit.max(1))
                    < u128::from(b.remaining) * u128::from(a.limit.max(1))
            }
        }
    }

    fn headers(self) -> Vec<EnvoyHeader> {
        let mut map = http::HeaderMap::new();
        RateLimitFields::new(&self.policy, &self.limit, &self.decision).write_to(&mut map);
        map.iter()
            .filter_map(|(name, value)| {
                Some(EnvoyHeader {
                    key: name.as_str().to_owned(),
                    value: value.to_str().ok()?.to_owned(),
                    ..Default::default()
                })
            })
            .collect()
    }
}

/// One descriptor's status, and the header fields of a decision.
fn answer(outcome: &Outcome) -> Result<(DescriptorStatus, Option<Fields>), Status> {
    let ok = DescriptorStatus {
        code: Code::Ok as i32,
        ..Default::default()
    };
    Ok(match outcome {
        Outcome::Unlimited | Outcome::FailedOpen { .. } | Outcome::Shadow { .. } => (ok, None),
        Outcome::Decided {
            policy,
            limit,
            decision,
            ..
        } => (
            DescriptorStatus {
                code: if decision.allowed {
                    Code::Ok
                } else {
                    Code::OverLimit
                } as i32,
                current_limit: Some(current_limit(&policy.name, limit)),
                limit_remaining: u32::try_from(decision.remaining).unwrap_or(u32::MAX),
                duration_until_reset: Some(duration(decision.reset)),
                ..Default::default()
            },
            Some(Fields {
                policy: Arc::clone(&policy.name),
                limit: *limit,
                decision: *decision,
            }),
        ),
        Outcome::Unavailable { retry_after, .. } => (
            DescriptorStatus {
                code: Code::OverLimit as i32,
                duration_until_reset: Some(duration(*retry_after)),
                ..Default::default()
            },
            None,
        ),
        Outcome::StoreFailed {
            policy,
            error: StoreError::CostExceedsBurst(_),
        } => (
            DescriptorStatus {
                code: Code::OverLimit as i32,
                current_limit: policy
                    .limit_for(crate::key::KeyKind::Descriptor)
                    .map(|l| current_limit(&policy.name, &l)),
                limit_remaining: 0,
                ..Default::default()
            },
            None,
        ),
        Outcome::StoreFailed { policy, error } => {
            tracing::error!(policy = %policy.name, %error, "rate limit store refused a descriptor");
            return Err(Status::internal(format!(
                "policy {}: the store refused the check",
                policy.name
            )));
        }
        // Descriptors are not identified from headers.
        Outcome::BadIdentity(e) => return Err(Status::invalid_argument(e.to_string())),
    })
}

/// A `google.protobuf.Duration`, rounded up to whole seconds as the
/// RateLimit header fields are, so the two never disagree.
fn duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(ceil_secs(d)).unwrap_or(i64::MAX),
        nanos: 0,
    }
}

/// The policy's long-run rate as Envoy reads a limit: requests per unit,
/// in the shortest unit that holds it in whole requests (a day if none
/// does, rounded down). Its burst is in the `RateLimit-Policy` field.
fn current_limit(name: &str, limit: &Limit) -> RateLimit {
    const UNITS: [(Unit, u128); 4] = [
        (Unit::Second, 1_000_000),
        (Unit::Minute, 60_000_000),
        (Unit::Hour, 3_600_000_000),
        (Unit::Day, 86_400_000_000),
    ];
    let rate = u128::from(limit.rate_units_per_us());
    let per_token = u128::from(limit.units_per_token()).max(1);
    let (unit, requests) = UNITS
        .iter()
        .find(|(_, us)| (rate * us) % per_token == 0 && rate * us / per_token > 0)
        .map(|&(unit, us)| (unit, rate * us / per_token))
        .unwrap_or((Unit::Day, rate * UNITS[3].1 / per_token));
    RateLimit {
        name: name.to_owned(),
        requests_per_unit: u32::try_from(requests).unwrap_or(u32::MAX),
        unit: unit as i32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rate_is_told_in_the_shortest_unit_that_holds_it_whole() {
        let told = |burst, rate, per| {
            let limit = Limit::new(burst, rate, Duration::from_secs(per)).unwrap();
            let r = current_limit("p", &limit);
            (Unit::try_from(r.unit).unwrap(), r.requests_per_unit)
        };
        assert_eq!(told(100, 10, 1), (Unit::Second, 10));
        assert_eq!(told(5, 1, 2), (Unit::Minute, 30));
        assert_eq!(told(5, 1, 60), (Unit::Minute, 1));
        assert_eq!(told(5, 1, 450), (Unit::Hour, 8));
        // 205.7 a day: rounded down.
        assert_eq!(told(5, 1, 420), (Unit::Day, 205));
        assert_eq!(told(5, 1, 3600), (Unit::Hour, 1));
        assert_eq!(told(5, 1, 86_400), (Unit::Day, 1));
    }

    #[test]
    fn a_refusal_is_stricter_than_any_admission() {
        let fields = |allowed, remaining, retry| Fields {
            policy: Arc::from("p"),
            limit: Limit::per_second(10, 1).unwrap(),
            decision: Decision {
                allowed,
                limit: 10,
                remaining,
                retry_after: Duration::from_secs(retry),
                reset: Duration::ZERO,
            },
        };
        assert!(fields(false, 0, 1).stricter_than(&fields(true, 0, 0)));
        assert!(!fields(true, 0, 0).stricter_than(&fields(false, 0, 1)));
        assert!(fields(false, 0, 5).stricter_than(&fields(false, 0, 1)));
        assert!(fields(true, 2, 0).stricter_than(&fields(true, 5, 0)));
    }
}
