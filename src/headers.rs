//! Rate-limit response headers and problem bodies, as pure functions.
//!
//! Given a decision, they say to a client exactly how to back off:
//!
//! | header | value |
//! |---|---|
//! | `RateLimit-Limit` | the burst (bucket capacity) |
//! | `RateLimit-Remaining` | whole tokens left |
//! | `RateLimit-Reset` | seconds until the full limit is available again (the bucket is full, the window's count resets, the log is empty, the estimate is 0: see [`crate::algorithm`]) |
//! | `RateLimit-Policy` | `"<policy>";q=<burst>;w=<seconds to refill from empty>` (IETF draft-10) |
//! | `RateLimit` | `"<policy>";r=<remaining>;t=<seconds until another such request is admitted>` (draft-10) |
//! | `Retry-After` (429 only) | whole seconds, rounded up, at least 1 |
//!
//! Seconds are rounded **up**: a client that waits the advertised time is
//! admitted; rounding down would invite a retry that is denied again.

use crate::algorithm::{Decision, Limit};
use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use std::time::Duration;

/// `RateLimit-Limit`.
pub const RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("ratelimit-limit");
/// `RateLimit-Remaining`.
pub const RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("ratelimit-remaining");
/// `RateLimit-Reset`.
pub const RATELIMIT_RESET: HeaderName = HeaderName::from_static("ratelimit-reset");
/// `RateLimit-Policy` (draft-10 structured field).
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit` (draft-10 structured field).
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// The most header fields an admitted answer of this service carries:
/// its `Content-Type`, the `Content-Length` axum sets, `X-Instance-Id`
/// and the five RateLimit fields.
pub const ANSWER_FIELDS: usize = 8;

/// A response of `status` carrying `body` as `content_type`, its header
/// map made with room for [`ANSWER_FIELDS`].
///
/// axum's own answers (`Json`, a tuple with a header) start from an empty
/// map, which makes room for six fields at its first insert and makes room
/// again when the limiter's fields arrive: a reallocation, a second
/// allocation and every field hashed and placed again, about 1,000
/// instructions a request on the memory-limited route, nearly 5 % of it
/// (`scripts/http-instructions`'s callgrind count).
pub fn answer(status: StatusCode, content_type: HeaderValue, body: Body) -> Response {
    let mut headers = HeaderMap::with_capacity(ANSWER_FIELDS);
    headers.insert(header::CONTENT_TYPE, content_type);
    let mut response = Response::new(body);
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response
}

/// Whole seconds, rounded up (at most `u64::MAX`).
pub fn ceil_secs(d: Duration) -> u64 {
    d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0))
}

/// The `Retry-After` value for a denial: rounded up, never 0.
pub fn retry_after_secs(decision: &Decision) -> u64 {
    ceil_secs(decision.retry_after).max(1)
}

/// The rate-limit header values of one decision, ready to go into a
/// response's own headers ([`RateLimitFields::write_to`]): an admitted
/// request's fields go straight onto the API's answer, with no header map
/// of their own to build, hash and merge.
///
/// Every value is written into one buffer, digits by `itoa`, and each
/// header value is a slice of it. The buffer is held inline in the one
/// allocation that also holds its reference count (`Bytes::from_owner`),
/// so the five or six values cost one allocation: a `String` per
/// `format!` would allocate per value and run the `fmt` machinery, and a
/// `Vec` turned into `Bytes` allocates again when it is first sliced.
#[derive(Debug, Clone, Default)]
pub struct RateLimitFields {
    /// Every value's bytes, one after another; empty for no fields.
    bytes: Bytes,
    /// Where each value ends in `bytes`, by [`RateLimitFields::NAMES`]; an
    /// empty value is left out (`Retry-After` for an admitted request, and
    /// `RateLimit-Policy` when `policy_field` holds it).
    ends: [u32; 6],
    /// `RateLimit-Policy` as its policy made it once.
    policy_field: Option<HeaderValue>,
}

/// The longest policy name the inline buffer takes (config validation's
/// limit); a longer one is written into a `Vec`.
const INLINE_NAME: usize = 64;

/// Bytes enough for every value: eight numbers of at most 20 digits, and
/// the two structured fields' eight bytes of syntax around the name
/// (`"`, `";q=`, `;w=`; `"`, `";r=`, `;t=`).
const INLINE: usize = 8 * 20 + 2 * (8 + INLINE_NAME);

/// The values' bytes, owned by the `Bytes` they are sliced from.
struct Inline {
    bytes: [u8; INLINE],
    len: usize,
}

impl AsRef<[u8]> for Inline {
    fn as_ref(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

impl RateLimitFields {
    /// The header of each value, in order.
    const NAMES: [HeaderName; 6] = [
        RATELIMIT_LIMIT,
        RATELIMIT_REMAINING,
        RATELIMIT_RESET,
        RATELIMIT_POLICY,
        RATELIMIT,
        header::RETRY_AFTER,
    ];

    /// The rate-limit fields for `decision` under policy `policy` shaped
    /// `limit`, including `Retry-After` when the request was denied.
    /// `policy` must be a valid structured-field string body (config
    /// validation ensures names are `[A-Za-z0-9_.-]`).
    pub fn new(policy: &str, limit: &Limit, decision: &Decision) -> Self {
        Self::with_policy_field(policy, None, limit, decision)
    }

    /// [`RateLimitFields::new`], given the `RateLimit-Policy` value when
    /// it was made already ([`policy_field`] of the same policy and
    /// `limit`): it is the same for every decision under one limit, so a
    /// policy makes it once, not once a request.
    pub fn with_policy_field(
        policy: &str,
        made: Option<&HeaderValue>,
        limit: &Limit,
        decision: &Decision,
    ) -> Self {
        let policy_part = made.is_none();
        let (bytes, ends) = if policy.len() <= INLINE_NAME {
            let mut inline = Inline {
                bytes: [0; INLINE],
                len: 0,
            };
            let ends = Self::write(policy, policy_part, limit, decision, |part| {
                let end = inline.len + part.len();
                inline.bytes[inline.len..end].copy_from_slice(part);
                inline.len = end;
                end
            });
            (Bytes::from_owner(inline), ends)
        } else {
            let mut buf = Vec::new();
            let ends = Self::write(policy, policy_part, limit, decision, |part| {
                buf.extend_from_slice(part);
                buf.len()
            });
            (Bytes::from(buf), ends)
        };
        // At most 304 bytes inline, and a longer name is a config error;
        // saturating keeps even a 4 GiB name's values in bounds.
        Self {
            bytes,
            ends: ends.map(|end| u32::try_from(end).unwrap_or(u32::MAX)),
            policy_field: made.cloned(),
        }
    }

    /// Writes the values one after another through `push`, which appends
    /// a part and returns the length so far; returns where each value
    /// ends, by [`RateLimitFields::NAMES`]. `RateLimit-Policy`'s is left
    /// empty unless `policy_part`.
    fn write(
        policy: &str,
        policy_part: bool,
        limit: &Limit,
        decision: &Decision,
        mut push: impl FnMut(&[u8]) -> usize,
    ) -> [usize; 6] {
        let mut digits = itoa::Buffer::new();
        let mut ends = [0usize; 6];
        ends[0] = push(digits.format(decision.limit).as_bytes());
        ends[1] = push(digits.format(decision.remaining).as_bytes());
        ends[2] = push(digits.format(ceil_secs(decision.reset)).as_bytes());
        ends[3] = if policy_part {
            write_policy(policy, limit, &mut push)
        } else {
            ends[2]
        };
        // `"<policy>";r=<remaining>;t=<seconds until admitted>`
        push(b"\"");
        push(policy.as_bytes());
        push(b"\";r=");
        push(digits.format(decision.remaining).as_bytes());
        push(b";t=");
        ends[4] = push(digits.format(ceil_secs(decision.retry_after)).as_bytes());
        ends[5] = if decision.allowed {
            ends[4]
        } else {
            push(digits.format(retry_after_secs(decision)).as_bytes())
        };
        ends
    }

    /// Sets these fields in `headers` (replacing any the API set).
    ///
    /// The values are cut from the one buffer here rather than when the
    /// fields are made: the fields travel by value from the decision to
    /// the response, and kept this small (a `Bytes` and six offsets
    /// instead of six header values) they move in registers rather than
    /// by `memcpy`. Digits always make a header value; the two
    /// structured fields do for a validated name, and a value that is no
    /// header value is left out.
    pub fn write_to(self, headers: &mut HeaderMap) {
        let Self {
            bytes,
            ends,
            mut policy_field,
        } = self;
        let mut start = 0;
        let spans = ends.map(|end| {
            let span = start..(end as usize).min(bytes.len());
            start = end as usize;
            span
        });
        let made = usize::from(policy_field.is_some());
        headers.reserve(spans.iter().filter(|span| !span.is_empty()).count() + made);
        for (i, (name, span)) in Self::NAMES.into_iter().zip(spans).enumerate() {
            let value = if i == 3 && policy_field.is_some() {
                policy_field.take()
            } else {
                cut(&bytes, span)
            };
            if let Some(value) = value {
                headers.insert(name, value);
            }
        }
    }
}

/// `bytes[span]` as a header value; `None` if empty or no header value.
///
/// Not inlined: made inside [`RateLimitFields::write_to`] for each of
/// the six values, the value's validation would be compiled in six times,
/// and every line of code a request runs costs it an instruction-cache
/// miss (every server here runs more code a request than that cache
/// holds; see `scripts/http-instructions`). One copy, called per value,
/// runs the same instructions from fewer cache lines.
#[inline(never)]
fn cut(bytes: &Bytes, span: std::ops::Range<usize>) -> Option<HeaderValue> {
    if span.is_empty() {
        return None;
    }
    HeaderValue::from_maybe_shared(bytes.slice(span)).ok()
}

/// Writes `"<policy>";q=<burst>;w=<seconds to refill>` through `push`;
/// returns the length so far.
fn write_policy(policy: &str, limit: &Limit, mut push: impl FnMut(&[u8]) -> usize) -> usize {
    let mut digits = itoa::Buffer::new();
    push(b"\"");
    push(policy.as_bytes());
    push(b"\";q=");
    push(digits.format(limit.burst()).as_bytes());
    push(b";w=");
    push(digits.format(ceil_secs(limit.refill_time())).as_bytes())
}

/// The `RateLimit-Policy` value of policy `policy` shaped `limit`, for
/// [`RateLimitFields::with_policy_field`]; `None` if `policy` is no valid
/// structured-field string body.
pub fn policy_field(policy: &str, limit: &Limit) -> Option<HeaderValue> {
    let mut value = Vec::new();
    write_policy(policy, limit, |part| {
        value.extend_from_slice(part);
        value.len()
    });
    HeaderValue::from_maybe_shared(Bytes::from(value)).ok()
}

/// An RFC 9457 problem document (`application/problem+json`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Problem {
    /// A URI reference naming the problem type.
    #[serde(rename = "type")]
    pub kind: String,
    /// Short, human-readable summary of the type.
    pub title: &'static str,
    /// The HTTP status.
    pub status: u16,
    /// Human-readable explanation of this occurrence.
    pub detail: String,
    /// The policy involved, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    /// Seconds to wait, for rate-limit problems.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<u64>,
}

/// `application/problem+json`.
pub const PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");

impl Problem {
    /// A problem of type `/problems/<slug>`.
    pub fn new(slug: &str, title: &'static str, status: u16, detail: impl Into<String>) -> Self {
        Self {
            kind: format!("/problems/{slug}"),
            title,
            status,
            detail: detail.into(),
            policy: None,
            retry_after: None,
        }
    }

    /// The problem for a denied request.
    pub fn rate_limited(policy: &str, decision: &Decision) -> Self {
        let wait = retry_after_secs(decision);
        Self {
            policy: Some(policy.to_owned()),
            retry_after: Some(wait),
            ..Self::new(
                "rate-limited",
                "Too Many Requests",
                429,
                format!("rate limit of policy \"{policy}\" exceeded; retry in {wait} s"),
            )
        }
    }

    /// The body, serialized.
    pub fn to_json(&self) -> String {
        // Serializing a struct of strings and integers cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// The problem as a response: its status, `application/problem+json`, and
/// the document as the body. Every error this service answers goes
/// through here.
impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        answer(status, PROBLEM_JSON, Body::from(self.to_json()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fields as a header map of their own.
    fn rate_limit_headers(policy: &str, limit: &Limit, decision: &Decision) -> HeaderMap {
        let mut h = HeaderMap::new();
        RateLimitFields::new(policy, limit, decision).write_to(&mut h);
        h
    }

    fn get<'a>(h: &'a HeaderMap, name: &str) -> &'a str {
        h.get(name).unwrap().to_str().unwrap()
    }

    /// No fields (an unlimited route, shadow mode, a request failed open)
    /// write nothing, and leave the API's own headers alone.
    #[test]
    fn no_fields_write_nothing() {
        let mut h = HeaderMap::new();
        h.insert(RATELIMIT_LIMIT, HeaderValue::from_static("7"));
        RateLimitFields::default().write_to(&mut h);
        assert_eq!(h.len(), 1);
        assert_eq!(h[RATELIMIT_LIMIT], "7");
    }

    #[test]
    fn allowed_request_headers() {
        let limit = Limit::per_second(100, 10).unwrap();
        let d = Decision {
            allowed: true,
            limit: 100,
            remaining: 42,
            retry_after: Duration::ZERO,
            reset: Duration::from_micros(5_750_001),
        };
        let h = rate_limit_headers("api", &limit, &d);
        assert_eq!(get(&h, "ratelimit-limit"), "100");
        assert_eq!(get(&h, "ratelimit-remaining"), "42");
        assert_eq!(get(&h, "ratelimit-reset"), "6");
        assert_eq!(get(&h, "ratelimit-policy"), "\"api\";q=100;w=10");
        assert_eq!(get(&h, "ratelimit"), "\"api\";r=42;t=0");
        assert!(h.get("retry-after").is_none());
    }

    #[test]
    fn denied_request_headers_round_up_and_never_say_zero() {
        let limit = Limit::per_second(100, 10).unwrap();
        let mut d = Decision {
            allowed: false,
            limit: 100,
            remaining: 0,
            retry_after: Duration::from_millis(100),
            reset: Duration::from_secs(10),
        };
        let h = rate_limit_headers("api", &limit, &d);
        assert_eq!(get(&h, "retry-after"), "1");
        assert_eq!(get(&h, "ratelimit"), "\"api\";r=0;t=1");
        assert_eq!(get(&h, "ratelimit-reset"), "10");
        d.retry_after = Duration::from_micros(2_000_001);
        assert_eq!(
            get(&rate_limit_headers("api", &limit, &d), "retry-after"),
            "3"
        );
        d.retry_after = Duration::from_secs(2);
        assert_eq!(
            get(&rate_limit_headers("api", &limit, &d), "retry-after"),
            "2"
        );
        d.retry_after = Duration::ZERO;
        assert_eq!(retry_after_secs(&d), 1);
    }

    #[test]
    fn policy_window_rounds_up_for_slow_rates() {
        // 5 tokens, 1 per 3 s: empty to full takes 15 s; 2 per 3 s: 7.5 s -> 8.
        let slow = Limit::new(5, 1, Duration::from_secs(3)).unwrap();
        let d = Decision {
            allowed: true,
            limit: 5,
            remaining: 5,
            retry_after: Duration::ZERO,
            reset: Duration::ZERO,
        };
        assert_eq!(
            get(&rate_limit_headers("p", &slow, &d), "ratelimit-policy"),
            "\"p\";q=5;w=15"
        );
        let odd = Limit::new(5, 2, Duration::from_secs(3)).unwrap();
        assert_eq!(
            get(&rate_limit_headers("p", &odd, &d), "ratelimit-policy"),
            "\"p\";q=5;w=8"
        );
    }

    /// With the `RateLimit-Policy` value made once, the fields are the
    /// same as written whole, admitted or denied, for a short name and one
    /// too long for the inline buffer.
    #[test]
    fn a_policy_field_made_once_gives_the_same_fields() {
        let limits = [
            Limit::per_second(100, 10).unwrap(),
            Limit::new(1 << 32, 1, Duration::from_micros(1 << 20)).unwrap(),
        ];
        for name in ["api".to_owned(), "n".repeat(INLINE_NAME + 1)] {
            for limit in &limits {
                let made = policy_field(&name, limit).expect("a valid name");
                for allowed in [true, false] {
                    let d = Decision {
                        allowed,
                        limit: limit.burst(),
                        remaining: 7,
                        retry_after: Duration::from_millis(1500),
                        reset: Duration::from_secs(3),
                    };
                    let mut with = HeaderMap::new();
                    RateLimitFields::with_policy_field(&name, Some(&made), limit, &d)
                        .write_to(&mut with);
                    assert_eq!(
                        with,
                        rate_limit_headers(&name, limit, &d),
                        "{name} {allowed}"
                    );
                    assert_eq!(with.get(RATELIMIT_POLICY), Some(&made));
                }
            }
        }
    }

    /// The longest values fit the inline buffer: the longest valid name,
    /// every number of the decision at its widest and the limit at the
    /// widest `Limit::new` takes, denied (six values); a longer name
    /// than validation allows goes to the `Vec` and comes out the same.
    #[test]
    fn the_widest_values_fit_and_a_longer_name_still_works() {
        // The widest limit a policy may have (burst x period = 2^52 us).
        let limit = Limit::new(1 << 32, 1, Duration::from_micros(1 << 20)).unwrap();
        let d = Decision {
            allowed: false,
            limit: u64::MAX,
            remaining: u64::MAX,
            retry_after: Duration::MAX,
            reset: Duration::MAX,
        };
        let widest = u64::MAX.to_string();
        for name in ["n".repeat(INLINE_NAME), "n".repeat(INLINE_NAME + 1)] {
            let h = rate_limit_headers(&name, &limit, &d);
            assert_eq!(get(&h, "ratelimit-limit"), widest);
            assert_eq!(get(&h, "ratelimit-remaining"), widest);
            assert_eq!(get(&h, "ratelimit-reset"), widest);
            assert_eq!(get(&h, "retry-after"), widest);
            let policy = get(&h, "ratelimit-policy");
            assert!(policy.starts_with(&format!("\"{name}\";q=")), "{policy}");
            let field = get(&h, "ratelimit");
            assert_eq!(field, format!("\"{name}\";r={widest};t={widest}"));
        }
    }

    #[test]
    fn problem_body_is_rfc9457() {
        let d = Decision {
            allowed: false,
            limit: 1,
            remaining: 0,
            retry_after: Duration::from_millis(1500),
            reset: Duration::from_secs(2),
        };
        let v: serde_json::Value =
            serde_json::from_str(&Problem::rate_limited("api", &d).to_json()).unwrap();
        assert_eq!(v["type"], "/problems/rate-limited");
        assert_eq!(v["status"], 429);
        assert_eq!(v["title"], "Too Many Requests");
        assert_eq!(v["retry_after"], 2);
        assert_eq!(v["policy"], "api");
    }
}
