//! Every metric this service exports, named in one place.
//!
//! Dashboards and alerts refer to these names; keeping them here (and only
//! here) means code and dashboards cannot drift apart silently. Labels are
//! bounded: policy names come from the config, routes are route templates
//! (`middleware::Routes`), never raw URIs, keys or addresses.

pub mod buckets;
pub mod process;

use buckets::{Buckets, BucketsHandle};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{OnceLock, RwLock};

/// Histogram: every HTTP response this instance sends, its duration from
/// the request's arrival (the limiter's own 429/400/401/503 included), by
/// the OpenTelemetry semantic-convention name and labels:
/// `http_request_method` (the method, `_OTHER` for unknown ones),
/// `http_route` (the route template; `unmatched` for no route),
/// `http_response_status_code`. Request, error and throttle rates all come
/// from its `_count`.
pub const HTTP_SERVER_REQUEST_DURATION_SECONDS: &str = "http_server_request_duration_seconds";
/// Gauge: HTTP connections open now (`http.max_connections` caps it).
pub const HTTP_SERVER_OPEN_CONNECTIONS: &str = "http_server_open_connections";
/// Counter: connections closed as they arrived, over a cap. Labels:
/// `reason` (`max_connections`: the instance's cap;
/// `max_connections_per_address`: the client address's). A slowloris from
/// one host shows as the second; an instance short of room as the first.
pub const HTTP_SERVER_CONNECTIONS_REFUSED_TOTAL: &str = "http_server_connections_refused_total";
/// Counter: connections closed because a request's headers had not
/// arrived `http.header_timeout` after the connection began waiting for
/// them: slow clients, and idle keep-alive connections (the clock runs
/// while a connection waits for its next request; src/server/head_timeout.rs).
pub const HTTP_SERVER_HEADER_TIMEOUTS_TOTAL: &str = "http_server_header_timeouts_total";
/// Counter: limiter decisions. Labels: `policy`, `decision`
/// (`allowed`|`denied`|`shadow_denied`|`unavailable`), `key_kind`
/// (`api_key`|`ip`|`unknown_api_key`), `source` (`redis`|`memory`|`local`|
/// `failopen`|`failclosed`: who decided; see `store::Source`).
/// `shadow_denied`: a policy in shadow mode would have refused, and did not.
pub const DECISIONS_TOTAL: &str = "ratelimit_decisions_total";
/// Counter: admitted requests that left less than `near_limit_fraction` of
/// their limit: clients close to being throttled. Labels: `policy`,
/// `key_kind`.
pub const NEAR_LIMIT_TOTAL: &str = "ratelimit_near_limit_total";
/// Gauge: checks waiting on the store stack right now (a Redis that slows
/// down shows here first). A check the stack answers when called (the
/// in-process store, a deny-cache hit, a spent lease) never waits.
pub const CHECKS_IN_FLIGHT: &str = "ratelimit_checks_in_flight";
/// Gauge: 1 while one of this instance's Redis breakers (one per node) is
/// not closed, so the keys on that node are decided by their policy's
/// failure mode (local share, open or closed).
pub const FALLBACK_ACTIVE: &str = "ratelimit_fallback_active";
/// Gauge: the share (0 to 1) of this instance's checks over the last 10 s
/// (`failover::RECENT_WINDOW`) that its failure mode decided (local
/// share, open or closed) instead of Redis: how much it runs on its
/// fallback, which `FALLBACK_ACTIVE` (this instant only) cannot say of a
/// breaker that flaps. Set at scrape time; 0 without a shared store.
pub const FALLBACK_SHARE: &str = "ratelimit_fallback_share";
/// Counter: Redis checks that missed the deadline (their requests decided
/// by the failure mode), by what became of the call, which goes on for the
/// rest of the Redis response timeout. Labels: `outcome` (`answered`:
/// Redis answered late, so the wait was likely this instance's own, a
/// saturated CPU, and the breaker counts Redis alive; `failed`: it failed
/// or never answered, and the breaker counts a failure).
pub const LATE_ANSWERS_TOTAL: &str = "ratelimit_late_answers_total";
/// Gauge: a Redis node's circuit breaker: 0 closed, 1 half-open, 2 open.
/// Labels: `node` (`host:port`; a node no check has gone to for 10 s, as
/// a master that failed over, reads 0 and is no longer kept).
pub const BREAKER_STATE: &str = "ratelimit_breaker_state";
/// Counter: breaker state changes. Labels: `node`, `from`, `to`
/// (`closed`|`open`|`half_open`).
pub const BREAKER_TRANSITIONS_TOTAL: &str = "ratelimit_breaker_transitions_total";
/// Histogram: time spent deciding (store round trip included). Labels:
/// `backend`, `policy`, `source` (who decided, as in `DECISIONS_TOTAL`;
/// `error` when the store refused the request itself), so Redis-decided
/// checks are apart from local ones.
pub const CHECK_DURATION_SECONDS: &str = "ratelimit_check_duration_seconds";
/// Histogram: every call to Redis, by the node that served it. Labels:
/// `node` (`host:port`; for a cluster, the owner of the key's slot in the
/// slot map), `script` (the algorithm's script, or the naive store's
/// command: `naive_get`, `naive_set`, `naive_del`). A call that misses the
/// check's deadline goes on until Redis answers or the response timeout,
/// and is recorded then, with its whole duration.
pub const REDIS_CALL_DURATION_SECONDS: &str = "ratelimit_redis_call_duration_seconds";
/// Counter: failed Redis calls by node. Labels: `node`, `kind` (the Redis
/// kinds of `store::redis_error_kind`, or `deadline` for a call dropped
/// mid-flight, past the allowance a late answer has). `STORE_ERRORS_TOTAL` counts what the limiter saw; this
/// says where.
pub const REDIS_ERRORS_TOTAL: &str = "ratelimit_redis_errors_total";
/// Counter: trace spans not exported. Labels: `reason` (`queue_full`: the
/// export queue was full, so the span was dropped rather than wait;
/// `export_failed`: the collector refused or did not answer in time).
pub const TRACE_SPANS_DROPPED_TOTAL: &str = "ratelimit_trace_spans_dropped_total";
/// Counter: requests refused before a decision because their identifying
/// headers were malformed. Labels: `reason` (see `IdentityError::kind`).
pub const IDENTITY_ERRORS_TOTAL: &str = "ratelimit_identity_errors_total";
/// Counter: store errors, counted once where they happen (`store::Counted`,
/// right above the backend). Labels: `backend`, `kind` (`StoreError::kind`:
/// `deadline` when the check's deadline passed, the Redis kinds from
/// `store::redis_error_kind`, `cost_exceeds_burst` or
/// `unsupported_algorithm` for a request the store refused).
pub const STORE_ERRORS_TOTAL: &str = "ratelimit_store_errors_total";
/// Counter: in-memory buckets dropped. Labels: `reason`: `idle` (full again,
/// exact) or `pressure` (still refilling: `max_keys` is too small).
pub const MEMORY_EVICTIONS_TOTAL: &str = "ratelimit_memory_evictions_total";
/// Counter: limited requests that carried `X-Forwarded-For` from a peer
/// that is not a trusted proxy, so the header was ignored and the peer's
/// address keyed the request. A client trying to spoof does this now and
/// then; nearly every request doing it means the proxy in front is not
/// (or no longer) trusted: every client behind it shares one bucket.
pub const UNTRUSTED_FORWARDED_TOTAL: &str = "ratelimit_untrusted_forwarded_total";
/// Gauge, rendered at scrape time by `hotkeys`: checks per second of one of
/// this instance's hottest keys, over the last complete window. Labels:
/// `policy`, `key_kind`, `key` (tenant id, address or `h:` hash), `slot`,
/// `node`. At most `hot_keys.top` series.
pub const HOT_KEY_CHECKS_PER_SECOND: &str = "ratelimit_hot_key_checks_per_second";
/// Gauge, like `HOT_KEY_CHECKS_PER_SECOND`: the key's calls to the backend
/// store (Redis, or the memory store) per second; checks answered by a
/// fallback or a cache are not calls.
pub const HOT_KEY_STORE_CALLS_PER_SECOND: &str = "ratelimit_hot_key_store_calls_per_second";
/// Gauge, like `HOT_KEY_CHECKS_PER_SECOND`: the key's share (0 to 1) of
/// this instance's store calls to the node serving its slot.
pub const HOT_KEY_NODE_SHARE: &str = "ratelimit_hot_key_node_share";
/// Counter: config reloads (SIGHUP). Labels: `result` (`applied`;
/// `invalid`: the file could not be read or validated; `needs_restart`: it
/// changed fields only a restart applies). Refused reloads keep the
/// running config.
pub const CONFIG_RELOADS_TOTAL: &str = "ratelimit_config_reloads_total";
/// Histogram: every call to Envoy's rate limit service (gRPC), its
/// duration, by the OpenTelemetry semantic-convention name and labels:
/// `rpc_method` (`envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`),
/// `rpc_response_status_code` (the gRPC status: `OK`, `INVALID_ARGUMENT`,
/// ...), and `ratelimit_code` (the answer: `OK`, `OVER_LIMIT`; `none`
/// for an error status). Each descriptor's decision is also in
/// `ratelimit_decisions_total` with `key_kind="descriptor"`.
pub const RPC_SERVER_CALL_DURATION_SECONDS: &str = "rpc_server_call_duration_seconds";
/// Gauge, always 1: which instance and backend this is. Labels:
/// `instance_id` (the configured id; `instance` is Prometheus's own target
/// label), `backend`.
pub const INSTANCE_INFO: &str = "ratelimit_instance_info";

/// Every metric above and the process's, for checks that dashboards and
/// alerts name only metrics that exist.
pub const ALL: &[&str] = &[
    HTTP_SERVER_REQUEST_DURATION_SECONDS,
    HTTP_SERVER_OPEN_CONNECTIONS,
    HTTP_SERVER_CONNECTIONS_REFUSED_TOTAL,
    HTTP_SERVER_HEADER_TIMEOUTS_TOTAL,
    DECISIONS_TOTAL,
    NEAR_LIMIT_TOTAL,
    CHECKS_IN_FLIGHT,
    FALLBACK_ACTIVE,
    FALLBACK_SHARE,
    LATE_ANSWERS_TOTAL,
    BREAKER_STATE,
    BREAKER_TRANSITIONS_TOTAL,
    CHECK_DURATION_SECONDS,
    REDIS_CALL_DURATION_SECONDS,
    REDIS_ERRORS_TOTAL,
    TRACE_SPANS_DROPPED_TOTAL,
    IDENTITY_ERRORS_TOTAL,
    STORE_ERRORS_TOTAL,
    MEMORY_EVICTIONS_TOTAL,
    UNTRUSTED_FORWARDED_TOTAL,
    HOT_KEY_CHECKS_PER_SECOND,
    HOT_KEY_STORE_CALLS_PER_SECOND,
    HOT_KEY_NODE_SHARE,
    CONFIG_RELOADS_TOTAL,
    RPC_SERVER_CALL_DURATION_SECONDS,
    INSTANCE_INFO,
    process::PROCESS_CPU_SECONDS_TOTAL,
    process::PROCESS_RESIDENT_MEMORY_BYTES,
    process::PROCESS_OPEN_FDS,
    process::PROCESS_MAX_FDS,
    process::PROCESS_START_TIME_SECONDS,
];

/// Buckets for `*_seconds` histograms: from 10 µs (an in-memory check) to
/// 1 s, dense around the 0.25–5 ms a Redis round trip takes (a quantile
/// is interpolated inside its bucket: with 2 and 5 ms neighbours, checks
/// that all take 2.3 ms read as "3.5 ms"), and either side of the default
/// 10 ms deadline: a check decided at its deadline takes a little over
/// 10 ms, which one bucket from 10 to 25 ms would report as up to 25 ms.
pub const SECONDS_BUCKETS: &[f64] = &[
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.000_75, 0.001, 0.001_5, 0.002,
    0.002_5, 0.003, 0.004, 0.005, 0.007_5, 0.01, 0.012_5, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// Metric handles (`Counter`, `Gauge`, `Histogram`: each an `Arc` on its
/// series) by their label values, each registered with the recorder on
/// its first use, as the `counter!`-style macros would, and kept.
///
/// The macros build a `Key` (a label vector, owned strings) and look it
/// up in the recorder's registry on every call: that lookup
/// (`Registry::get_or_create_*`, `Key::eq`), the route label's `String`
/// and the allocations under them would run on every request. Here the
/// label values are the map key: `&'static str`s, a policy's `Arc<str>`,
/// a status code. A series still appears only once used, as with the
/// macros.
///
/// Hashed with FxHash rather than SipHash: the keys are our own label
/// values (names from the config, constants, status codes), never a
/// client's bytes, so there is no flooding to resist, and SipHash would be
/// most of the cost of the lookups a limited request makes.
#[derive(Debug)]
pub struct Handles<K, H> {
    map: RwLock<HashMap<K, H, rustc_hash::FxBuildHasher>>,
}

impl<K, H> Default for Handles<K, H> {
    fn default() -> Self {
        Self {
            map: RwLock::new(HashMap::default()),
        }
    }
}

impl<K: Hash + Eq, H: Clone> Handles<K, H> {
    /// The handle for `key` (looked up as `query`), registered by
    /// `register` the first time.
    pub fn get<Q>(&self, query: &Q, key: impl FnOnce() -> K, register: impl FnOnce() -> H) -> H
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let read = self
            .map
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(handle) = read.get(query) {
            return handle.clone();
        }
        drop(read);
        self.map
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(key())
            .or_insert_with(register)
            .clone()
    }
}

/// Installs the recorder once per process (the Prometheus exporter's,
/// with `*_seconds` histograms kept in fixed buckets in front of it: see
/// [`buckets`]) and returns its handle. Later calls (tests starting
/// several apps) get the same handle.
pub fn install() -> MetricsHandle {
    static HANDLE: OnceLock<MetricsHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new().build_recorder();
            let prometheus = recorder.handle();
            let layer = Buckets::new(recorder, SECONDS_BUCKETS);
            let buckets = layer.handle();
            // Fails only if another recorder was installed first, in which
            // case ours renders nothing; that is a wiring bug worth a log.
            if metrics::set_global_recorder(layer).is_err() {
                tracing::error!("a metrics recorder was already installed; /metrics will be empty");
            }
            describe();
            MetricsHandle {
                prometheus,
                buckets,
            }
        })
        .clone()
}

/// Renders every metric recorded through [`install`]'s recorder.
#[derive(Debug, Clone)]
pub struct MetricsHandle {
    prometheus: PrometheusHandle,
    buckets: BucketsHandle,
}

impl MetricsHandle {
    /// The Prometheus text format: the exporter's metrics, then the
    /// `*_seconds` histograms.
    pub fn render(&self) -> String {
        let mut text = self.prometheus.render();
        let ours = self.buckets.render();
        if !ours.is_empty() && !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(&ours);
        text
    }

    /// The exporter's periodic work: publishing descriptions, and draining
    /// the samples of any histogram not kept in fixed buckets (none is
    /// recorded today: every histogram is a `*_seconds` one). The fixed
    /// buckets need none.
    pub fn run_upkeep(&self) {
        self.prometheus.run_upkeep();
    }
}

fn describe() {
    metrics::describe_histogram!(
        HTTP_SERVER_REQUEST_DURATION_SECONDS,
        metrics::Unit::Seconds,
        "Duration of HTTP server responses, every status included"
    );
    metrics::describe_gauge!(HTTP_SERVER_OPEN_CONNECTIONS, "HTTP connections open now");
    metrics::describe_counter!(
        HTTP_SERVER_CONNECTIONS_REFUSED_TOTAL,
        "HTTP connections closed on arrival over a cap, by cap"
    );
    metrics::describe_counter!(
        HTTP_SERVER_HEADER_TIMEOUTS_TOTAL,
        "HTTP connections closed for request headers not received within http.header_timeout"
    );
    metrics::describe_counter!(DECISIONS_TOTAL, "Rate limiter decisions");
    metrics::describe_counter!(
        NEAR_LIMIT_TOTAL,
        "Admitted requests that left less than near_limit_fraction of their limit"
    );
    metrics::describe_gauge!(CHECKS_IN_FLIGHT, "Limiter checks waiting on the store");
    metrics::describe_histogram!(
        REDIS_CALL_DURATION_SECONDS,
        metrics::Unit::Seconds,
        "Redis calls by the node that served them"
    );
    metrics::describe_counter!(REDIS_ERRORS_TOTAL, "Failed Redis calls by node and kind");
    metrics::describe_counter!(
        TRACE_SPANS_DROPPED_TOTAL,
        "Trace spans not exported: queue full or export failed"
    );
    metrics::describe_histogram!(
        CHECK_DURATION_SECONDS,
        metrics::Unit::Seconds,
        "Time to decide one request, store round trip included"
    );
    metrics::describe_counter!(
        IDENTITY_ERRORS_TOTAL,
        "Requests refused (400) for malformed identifying headers"
    );
    metrics::describe_counter!(STORE_ERRORS_TOTAL, "Store failures by kind");
    metrics::describe_counter!(
        MEMORY_EVICTIONS_TOTAL,
        "In-memory buckets dropped: idle (exact) or pressure (max_keys too small)"
    );
    metrics::describe_counter!(
        UNTRUSTED_FORWARDED_TOTAL,
        "Limited requests with X-Forwarded-For from a peer that is not a trusted proxy (header ignored)"
    );
    metrics::describe_counter!(
        CONFIG_RELOADS_TOTAL,
        "Config reloads by result: applied, invalid, needs_restart"
    );
    metrics::describe_histogram!(
        RPC_SERVER_CALL_DURATION_SECONDS,
        metrics::Unit::Seconds,
        "Duration of rate limit service calls (gRPC)"
    );
    metrics::describe_gauge!(INSTANCE_INFO, "Instance id and backend, value 1");
    metrics::describe_gauge!(
        FALLBACK_ACTIVE,
        "1 while Redis is bypassed and the failure mode decides"
    );
    metrics::describe_gauge!(
        FALLBACK_SHARE,
        "Share of the last 10 s of checks decided by the failure mode, not Redis"
    );
    metrics::describe_counter!(
        LATE_ANSWERS_TOTAL,
        "Redis checks that missed the deadline, by whether Redis answered within its response timeout"
    );
    metrics::describe_gauge!(
        BREAKER_STATE,
        "A Redis node's circuit breaker: 0 closed, 1 half-open, 2 open"
    );
    metrics::describe_counter!(BREAKER_TRANSITIONS_TOTAL, "Circuit breaker state changes");
}
