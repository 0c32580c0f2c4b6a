//! The sample API being protected, and [`app`] that assembles its routes
//! behind [`Front`].
//!
//! | route | what it does | limited by |
//! |---|---|---|
//! | `GET /api/items` | lists the catalogue | policy matching `/api/items` |
//! | `GET /api/items/{id}` | one item, or 404 | policy matching `/api/items/{id}` |
//! | `POST /api/orders` | places an order (JSON `{"item_id": 1, "quantity": 2}`) | policy matching `/api/orders` |
//! | `GET /api/status` | instance id, backend, config generation, trusted proxies, policies | policy matching `/api/status` |
//! | `/decide` (any method) | a gateway's question for another service's request (nginx `auth_request`): 204 with the RateLimit fields, or the answer the API would give (429 with `Retry-After`, 401, 503, 400) | the policy matching the path in `X-Original-URI` |
//! | `GET /healthz` | liveness: the process answers | never |
//! | `GET /readyz` | readiness: `ready`, or `degraded` while Redis is away or the failure mode decided 5 % or more of the last 10 s of checks, with that share (503 only if the failure mode is `closed`: otherwise the instance still serves, by its local share or open, and pulling every instance out of the balancer would turn a Redis blip into an outage) | never |
//! | `GET /metrics` | Prometheus text | never |
//!
//! Policies match route *templates* (matched by
//! [`RouteTable`]'s table, as the router
//! matches them), so `/api/items/7` and `/api/items/8` share the policy and
//! the metric label `/api/items/{id}`.

use crate::config::HttpConfig;
use crate::failover::{BreakerHandle, BreakerState, DEGRADED_SHARE, RecentShare};
use crate::headers::{self, Problem};
use crate::limiter::CurrentLimiter;
use crate::metrics as m;
use crate::middleware::{Front, Peer, RouteTable, Verdict};
use crate::store::{FailureMode, Store};
use axum::Json;
use axum::body::Body;
use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{DefaultBodyLimit, Extension, Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use bytes::{BufMut, BytesMut};
use http::Method;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// What `/readyz` asks: the store stack (can it decide right now?), its
/// breaker if it has one, and the failure mode in force by default.
#[derive(Debug, Clone)]
pub struct Health {
    /// The store stack the limiter decides through.
    pub store: Arc<dyn Store>,
    /// The stack's circuit breaker (`None`: an in-process store has none).
    pub breaker: Option<BreakerHandle>,
    /// The failure mode of policies that do not set their own.
    pub failure_mode: FailureMode,
}

/// What handlers share: [`AppFields`] behind one reference count, which
/// is all a clone costs. axum clones a route's state twice a request
/// (with the route's service, then for the handler's call), whether the
/// handler reads it or not; with the fields cloned one by one that would
/// be five or six reference counts (by backend) taken and given back each
/// time, every one an atomic update. Reads go through to the fields
/// (`state.limiter`).
#[derive(Debug, Clone)]
pub struct AppState(Arc<AppFields>);

impl std::ops::Deref for AppState {
    type Target = AppFields;

    fn deref(&self) -> &AppFields {
        &self.0
    }
}

/// The fields of [`AppState`].
#[derive(Debug, Clone)]
pub struct AppFields {
    /// The limiter applied to `/api/` routes (replaced on a reload).
    pub limiter: Arc<CurrentLimiter>,
    /// What `/readyz` reports.
    pub health: Health,
    /// Renders `/metrics`.
    pub metrics: crate::metrics::MetricsHandle,
    /// This instance's name.
    pub instance_id: Arc<str>,
    /// The body limit and request deadline `app` applies, and the
    /// connection bounds the server applies.
    pub http: HttpConfig,
    orders: Arc<AtomicU64>,
}

impl AppState {
    /// State for one instance.
    pub fn new(
        limiter: Arc<CurrentLimiter>,
        health: Health,
        metrics: crate::metrics::MetricsHandle,
        instance_id: &str,
    ) -> Self {
        Self(Arc::new(AppFields {
            limiter,
            health,
            metrics,
            instance_id: Arc::from(instance_id),
            http: HttpConfig::default(),
            orders: Arc::new(AtomicU64::new(0)),
        }))
    }

    /// With these HTTP bounds rather than the defaults (the other fields
    /// shared with `self`'s clones, if it has any).
    pub fn with_http(self, http: HttpConfig) -> Self {
        let fields = Arc::unwrap_or_clone(self.0);
        Self(Arc::new(AppFields { http, ..fields }))
    }
}

/// One catalogue entry.
#[derive(Debug, Clone, Serialize)]
pub struct Item {
    id: u32,
    name: &'static str,
    price_cents: u32,
}

const ITEMS: [Item; 3] = [
    Item {
        id: 1,
        name: "token",
        price_cents: 100,
    },
    Item {
        id: 2,
        name: "bucket",
        price_cents: 2_500,
    },
    Item {
        id: 3,
        name: "sliding window",
        price_cents: 4_000,
    },
];

/// `GET /api/items`: the catalogue. Public so that `loadtest http-cost`'s
/// peers (`benches/peers/peer_*.rs`) serve the very same body.
pub async fn list_items() -> Response {
    json(StatusCode::OK, &ITEMS)
}

/// `application/json`.
const APPLICATION_JSON: HeaderValue = HeaderValue::from_static("application/json");

/// `value` as a JSON answer of `status`, serialized as axum's `Json`
/// serializes, in a response with room for every field the limiter adds
/// ([`headers::answer`]).
fn json<T: Serialize + ?Sized>(status: StatusCode, value: &T) -> Response {
    let mut body = BytesMut::with_capacity(128).writer();
    match serde_json::to_writer(&mut body, value) {
        Ok(()) => headers::answer(
            status,
            APPLICATION_JSON,
            Body::from(body.into_inner().freeze()),
        ),
        // Our own types always serialize; if one did not, it is our fault.
        Err(e) => problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "Internal Server Error",
            e.to_string(),
        ),
    }
}

fn problem(status: StatusCode, slug: &str, title: &'static str, detail: String) -> Response {
    Problem::new(slug, title, status.as_u16(), detail).into_response()
}

/// axum's extractor rejections as problem+json, with their status (400 a
/// malformed body or path, 413 too large, 415 not JSON, 422 the wrong
/// shape) and axum's explanation as the detail.
fn rejection(status: StatusCode, detail: String) -> Response {
    let (slug, title) = match status {
        StatusCode::PAYLOAD_TOO_LARGE => ("too-large", "Content Too Large"),
        StatusCode::UNSUPPORTED_MEDIA_TYPE => ("unsupported-media-type", "Unsupported Media Type"),
        StatusCode::UNPROCESSABLE_ENTITY => ("invalid-body", "Unprocessable Content"),
        _ => ("bad-request", "Bad Request"),
    };
    problem(status, slug, title, detail)
}

async fn get_item(id: Result<Path<u32>, PathRejection>) -> Response {
    let id = match id {
        Ok(Path(id)) => id,
        Err(e) => return rejection(e.status(), e.body_text()),
    };
    match ITEMS.iter().find(|i| i.id == id) {
        Some(item) => json(StatusCode::OK, item),
        None => problem(
            StatusCode::NOT_FOUND,
            "not-found",
            "Not Found",
            format!("no item {id}"),
        ),
    }
}

#[derive(Debug, Deserialize)]
struct NewOrder {
    item_id: u32,
    quantity: u32,
}

#[derive(Debug, Serialize)]
struct Order {
    order_id: u64,
    item_id: u32,
    quantity: u32,
    instance: Arc<str>,
}

async fn create_order(
    State(state): State<AppState>,
    order: Result<Json<NewOrder>, JsonRejection>,
) -> Response {
    let order = match order {
        Ok(Json(order)) => order,
        Err(e) => return rejection(e.status(), e.body_text()),
    };
    if !ITEMS.iter().any(|i| i.id == order.item_id) {
        return problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "unknown-item",
            "Unprocessable Content",
            format!("no item {}", order.item_id),
        );
    }
    if !(1..=100).contains(&order.quantity) {
        return problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "bad-quantity",
            "Unprocessable Content",
            "quantity must be 1 to 100".into(),
        );
    }
    let created = Order {
        order_id: state.orders.fetch_add(1, Ordering::Relaxed) + 1,
        item_id: order.item_id,
        quantity: order.quantity,
        instance: Arc::clone(&state.instance_id),
    };
    json(StatusCode::CREATED, &created)
}

async fn status(State(state): State<AppState>) -> Response {
    let limiter = state.limiter.get();
    json(
        StatusCode::OK,
        &serde_json::json!({
            "instance": &*state.instance_id,
            "backend": limiter.backend(),
            "config_generation": state.limiter.generation(),
            "trusted_proxies": limiter.trusted_proxies().iter().map(ToString::to_string).collect::<Vec<_>>(),
            "policies": limiter.policy_names(),
        }),
    )
}

/// Unknown routes: 404 problem+json.
async fn no_route(uri: axum::http::Uri) -> Response {
    problem(
        StatusCode::NOT_FOUND,
        "not-found",
        "Not Found",
        format!("no route {}", uri.path()),
    )
}

/// Where a gateway says which request it asks about: nginx's convention
/// (`X-Original-URI`, `X-Original-Method`), then Traefik's forwardAuth
/// (`X-Forwarded-Uri`, `X-Forwarded-Method`).
const ORIGINAL_URI: [&str; 2] = ["x-original-uri", "x-forwarded-uri"];
const ORIGINAL_METHOD: [&str; 2] = ["x-original-method", "x-forwarded-method"];

/// The first of `names` the request carries, as text (`Err`: not text).
fn first_header<'a>(headers: &'a http::HeaderMap, names: &[&str]) -> Result<Option<&'a str>, ()> {
    match names.iter().find_map(|name| headers.get(*name)) {
        None => Ok(None),
        Some(value) => value.to_str().map(Some).map_err(|_| ()),
    }
}

/// The decision for another service's request, asked by a gateway in
/// front of it (nginx `auth_request`): the policy is the one whose route
/// prefixes the original path, the client is identified from this
/// request's headers and peer exactly as for the API (an API key, or the
/// address a trusted proxy forwards), and one token is spent as for the
/// API. Admitted: 204 with the RateLimit fields, for the gateway to copy
/// onto its answer. Otherwise the answer the API would give (429 with
/// `Retry-After`, 401 for an unknown key, 503 failing closed, 400 for a
/// malformed identity), as problem+json. No policy for the path: 204
/// without fields, as Envoy's rate limit service answers OK for no match.
async fn decide(
    State(state): State<AppState>,
    Extension(Peer(peer)): Extension<Peer>,
    headers: http::HeaderMap,
) -> Response {
    let bad = |detail: &str| {
        problem(
            StatusCode::BAD_REQUEST,
            "bad-request",
            "Bad Request",
            detail.to_owned(),
        )
    };
    let uri = match first_header(&headers, &ORIGINAL_URI) {
        Ok(Some(uri)) => uri,
        Ok(None) => return bad("no X-Original-URI: which request is this decision for?"),
        Err(()) => return bad("X-Original-URI is not text"),
    };
    let path = uri.split(['?', '#']).next().unwrap_or_default();
    if !path.starts_with('/') {
        return bad("X-Original-URI is not a path (it starts with /)");
    }
    let method = match first_header(&headers, &ORIGINAL_METHOD) {
        Ok(None) => Method::GET,
        Ok(Some(name)) => match Method::from_bytes(name.as_bytes()) {
            Ok(method) => method,
            Err(_) => return bad("X-Original-Method is not an HTTP method"),
        },
        Err(()) => return bad("X-Original-Method is not text"),
    };
    let Some(limiting) = state.limiter.get().limiting(path, &method) else {
        return StatusCode::NO_CONTENT.into_response();
    };
    match Verdict::from(limiting.check(&headers, peer).await) {
        Verdict::Pass(fields) => {
            let mut answer = StatusCode::NO_CONTENT.into_response();
            fields.write_to(answer.headers_mut());
            answer
        }
        Verdict::Answer(answer) => answer,
    }
}

async fn healthz() -> &'static str {
    "ok\n"
}

/// How long `/readyz` waits for the store before calling it degraded.
const READY_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(500);

impl Health {
    /// How much the failure mode decided lately (`None`: no breaker, so no
    /// failure policy), with `ratelimit_fallback_share` set to it.
    fn recent(&self) -> Option<RecentShare> {
        let recent = self.breaker.as_ref().map(BreakerHandle::recent);
        metrics::gauge!(m::FALLBACK_SHARE).set(recent.map_or(0.0, |r| r.fallback_share));
        recent
    }
}

/// Readiness: `ready`, or `degraded` when the store does not answer a PING
/// or when the failure mode decided at least `DEGRADED_SHARE` of the
/// checks of the last `RECENT_WINDOW` (a breaker flapping open and shut,
/// checks missing their deadline, scripts Redis refuses: the instance is
/// running on its fallback though Redis answers this instant). Both are
/// reported as they are (`fallback_share`, `breaker_opens`), with the
/// nodes whose breaker is not closed (`degraded_nodes`: in a cluster,
/// only their keys are on the fallback; `breaker` is the worst). Only the
/// `closed` failure mode makes `degraded` a 503: otherwise the instance
/// still serves, and pulling every instance out of the balancer would turn
/// a Redis blip into an outage.
///
/// The breaker's state alone is not a reason: it stays open until a
/// request probes, so with no traffic it would hold an instance degraded
/// (and, failing closed, out of the balancer, so without traffic) for
/// ever. The share fades out with the window instead.
///
/// Readiness does not run a check of its own: a probe would write to
/// Redis (or need a key of its own) on every poll, and the real checks
/// already exercise the scripts, the ACL and the deadline; their failures
/// are what `fallback_share` counts. With no traffic, the PING is all
/// there is.
async fn readyz(State(state): State<AppState>) -> Response {
    let health = &state.health;
    let backend = health.store.backend();
    let breaker = health
        .breaker
        .as_ref()
        .map_or(BreakerState::Closed, BreakerHandle::state)
        .as_str();
    let error = match tokio::time::timeout(READY_TIMEOUT, health.store.ready()).await {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e.kind()),
        Err(_) => Some("timeout"),
    };
    let recent = health.recent();
    let on_fallback = recent.is_some_and(|r| r.fallback_share >= DEGRADED_SHARE);
    let mode = health.failure_mode;
    let mut body = serde_json::json!({
        "status": "ready", "backend": backend, "breaker": breaker,
    });
    let degraded = health
        .breaker
        .as_ref()
        .map(BreakerHandle::degraded)
        .unwrap_or_default();
    if !degraded.is_empty() {
        // The nodes whose keys the failure mode decides now; the others'
        // keys are still Redis's.
        body["degraded_nodes"] = degraded
            .iter()
            .map(|(node, state)| serde_json::json!({"node": &**node, "breaker": state.as_str()}))
            .collect();
    }
    if let Some(r) = recent {
        // Three decimals: a share, not a measurement to the last check.
        body["fallback_share"] = serde_json::json!((r.fallback_share * 1000.0).round() / 1000.0);
        body["breaker_opens"] = r.breaker_opens.into();
    }
    if error.is_none() && !on_fallback {
        return json(StatusCode::OK, &body);
    }
    body["status"] = "degraded".into();
    body["failure_mode"] = mode.as_str().into();
    if let Some(error) = error {
        body["error"] = error.into();
    }
    let status = if mode == FailureMode::Closed {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    json(status, &body)
}

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    // The share is of a window ending now: set at scrape time, so it fades
    // when traffic stops rather than keep the last check's value.
    state.health.recent();
    let mut text = state.metrics.render();
    let end_line = |text: &mut String| {
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
    };
    // The hot keys are rendered now, not kept by the recorder: a key that
    // cooled down must leave the page, and the recorder never forgets a
    // series.
    end_line(&mut text);
    text.push_str(&state.limiter.get().render_hot_keys());
    // So are the process's CPU, memory and descriptors, read from /proc.
    end_line(&mut text);
    crate::metrics::process::render(&mut text);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text)
}

/// The whole service: the sample API behind the limiter, plus operations
/// endpoints that are never limited (a throttled health check would take a
/// healthy instance out of its balancer), with [`Front`] in front.
pub fn app(state: AppState) -> Front {
    let routes = RouteTable::default()
        .limited("/api/items", &[Method::GET], get(list_items))
        .limited("/api/items/{id}", &[Method::GET], get(get_item))
        // The one route that reads a body: streamed (chunked) bodies are
        // cut at the limit as they are read. Declared lengths are refused
        // before the limiter, by `Front`.
        .limited(
            "/api/orders",
            &[Method::POST],
            post(create_order).layer(DefaultBodyLimit::max(state.http.body_limit)),
        )
        .limited("/api/status", &[Method::GET], get(status))
        .deciding("/decide", &[Method::GET], any(decide))
        .unlimited("/healthz", get(healthz))
        .unlimited("/readyz", get(readyz))
        .unlimited("/metrics", get(metrics));
    let limiter = Arc::clone(&state.limiter);
    let http = state.http.clone();
    let instance_id = Arc::clone(&state.instance_id);
    let (router, routes) = routes.finish(state);
    Front::new(
        router.fallback(no_route),
        routes,
        limiter,
        &http,
        &instance_id,
    )
}
