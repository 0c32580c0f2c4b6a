//! The limiter: the one place that turns a request into a decision.
//!
//! Policy (by route template and method), identity (API key or address),
//! bucket key (keyed hash), then one call down the store stack. It knows
//! nothing of HTTP responses (that is [`crate::middleware`]) nor of where
//! state lives or what happens when it cannot be reached (that is the
//! [`Store`] stack, assembled in `server.rs`).

use crate::algorithm::{Decision, Limit};
use crate::clock::Clock;
use crate::hotkeys::HotKeys;
use crate::identity::{Identifier, IdentityError, KeyHasher, KeyKind};
use crate::metrics::{self as m, Handles};
use crate::policy::{Policies, RoutePolicy};
use crate::store::{Check, Checked, Source, Store, StoreError};
use crate::telemetry::TARGET;
use http::{HeaderMap, Method};
use metrics::{Counter, Gauge, Histogram};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Instant;
use tracing::Instrument;

/// What the limiter concluded about one request.
#[derive(Debug)]
pub enum Outcome {
    /// No policy applies, or the policy is unlimited.
    Unlimited,
    /// A store decided (the shared one, or the local share).
    Decided {
        /// The policy applied.
        policy: Arc<RoutePolicy>,
        /// The limit applied (keyed or anonymous; its local share when the
        /// source is `Local`).
        limit: Limit,
        /// The decision.
        decision: Decision,
        /// How the client was identified.
        kind: KeyKind,
        /// Who decided.
        source: Source,
    },
    /// Nobody could decide and the policy fails open: admitted uncounted.
    FailedOpen {
        /// The policy applied.
        policy: Arc<RoutePolicy>,
    },
    /// Nobody could decide and the policy fails closed.
    Unavailable {
        /// The policy applied.
        policy: Arc<RoutePolicy>,
        /// When to retry.
        retry_after: std::time::Duration,
    },
    /// The identifying headers are malformed.
    BadIdentity(IdentityError),
    /// The store refused the request itself (a configuration error).
    StoreFailed {
        /// The policy that applied.
        policy: Arc<RoutePolicy>,
        /// Why.
        error: StoreError,
    },
    /// A policy in shadow mode decided (and counted) as usual; the request
    /// passes whatever the decision, with no rate-limit headers that would
    /// mislead the client.
    Shadow {
        /// The policy applied.
        policy: Arc<RoutePolicy>,
    },
}

/// Identity + policy + store. Shared by every request (`Arc`).
#[derive(Debug)]
pub struct Limiter {
    policies: Policies,
    identifier: Identifier,
    hasher: KeyHasher,
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    near_limit_fraction: f64,
    hot_keys: Option<Arc<HotKeys>>,
    metrics: Metrics,
}

/// The limiter in force, replaced whole when the config is reloaded.
///
/// A request takes the current limiter once and keeps it to the end, so a
/// reload never mixes two configs in one decision. The store stack under
/// the limiter is shared by every generation: buckets, the local share and
/// the breaker carry on across a reload.
#[derive(Debug)]
pub struct CurrentLimiter {
    // A std RwLock around an Arc: a reader holds the lock only to clone
    // the Arc (nothing awaits under it), and writers come once per reload.
    current: RwLock<Arc<Limiter>>,
    generation: AtomicU64,
}

impl CurrentLimiter {
    /// `limiter`, as generation 1.
    pub fn new(limiter: Limiter) -> Self {
        Self {
            current: RwLock::new(Arc::new(limiter)),
            generation: AtomicU64::new(1),
        }
    }

    /// The limiter in force now.
    pub fn get(&self) -> Arc<Limiter> {
        Arc::clone(
            &self
                .current
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// Puts `limiter` in force for every request that starts from now.
    pub fn replace(&self, limiter: Limiter) {
        *self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(limiter);
        self.generation.fetch_add(1, Ordering::Relaxed);
    }

    /// How many limiters have been in force (1 until the first reload).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }
}

/// Counts a check in `ratelimit_checks_in_flight` while it lives (a check
/// dropped with its request counts out too).
struct InFlight(Gauge);

impl InFlight {
    fn enter(gauge: Gauge) -> Self {
        gauge.increment(1.0);
        Self(gauge)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.decrement(1.0);
    }
}

/// The limiter's metric handles, each registered on its first use and
/// kept (see [`Handles`]): no label vector built, no registry lookup, per
/// check.
#[derive(Debug, Default)]
struct Metrics {
    in_flight: OnceLock<Gauge>,
    /// By policy, decision, key kind, source.
    decisions: Handles<(Arc<str>, &'static str, &'static str, &'static str), Counter>,
    /// By policy, source.
    durations: Handles<(Arc<str>, &'static str), Histogram>,
    /// By policy, key kind.
    near_limit: Handles<(Arc<str>, &'static str), Counter>,
}

impl Metrics {
    fn in_flight(&self) -> Gauge {
        self.in_flight
            .get_or_init(|| metrics::gauge!(m::CHECKS_IN_FLIGHT))
            .clone()
    }

    fn decision(
        &self,
        policy: &Arc<str>,
        decision: &'static str,
        kind: &'static str,
        source: &'static str,
    ) -> Counter {
        let key = (Arc::clone(policy), decision, kind, source);
        self.decisions.get(
            &key,
            || key.clone(),
            || {
                metrics::counter!(
                    m::DECISIONS_TOTAL,
                    "policy" => Arc::clone(policy),
                    "decision" => decision,
                    "key_kind" => kind,
                    "source" => source,
                )
            },
        )
    }

    fn duration(
        &self,
        backend: &'static str,
        policy: &Arc<str>,
        source: &'static str,
    ) -> Histogram {
        let key = (Arc::clone(policy), source);
        self.durations.get(
            &key,
            || key.clone(),
            || {
                metrics::histogram!(
                    m::CHECK_DURATION_SECONDS,
                    "backend" => backend,
                    "policy" => Arc::clone(policy),
                    "source" => source,
                )
            },
        )
    }

    fn near_limit(&self, policy: &Arc<str>, kind: &'static str) -> Counter {
        let key = (Arc::clone(policy), kind);
        self.near_limit.get(
            &key,
            || key.clone(),
            || {
                metrics::counter!(
                    m::NEAR_LIMIT_TOTAL,
                    "policy" => Arc::clone(policy),
                    "key_kind" => kind,
                )
            },
        )
    }
}

impl Limiter {
    /// A limiter deciding `policies` for clients `identifier` recognises,
    /// keyed by `hasher`, through the `store` stack, at `clock`'s time.
    /// Admissions that leave less than `near_limit_fraction` of the limit
    /// are counted as near it.
    pub fn new(
        policies: Policies,
        identifier: Identifier,
        hasher: KeyHasher,
        store: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
        near_limit_fraction: f64,
    ) -> Self {
        Self {
            policies,
            identifier,
            hasher,
            store,
            clock,
            near_limit_fraction,
            hot_keys: None,
            metrics: Metrics::default(),
        }
    }

    /// The same limiter offering every check to a hot-key detector
    /// (shared, so a reload can hand it on to the next limiter).
    pub fn with_hot_keys(self, hot_keys: Option<Arc<HotKeys>>) -> Self {
        Self { hot_keys, ..self }
    }

    /// How it keys buckets.
    pub fn hasher(&self) -> &KeyHasher {
        &self.hasher
    }

    /// Its hot-key detector.
    pub fn hot_keys(&self) -> Option<&Arc<HotKeys>> {
        self.hot_keys.as_ref()
    }

    /// The proxies whose `X-Forwarded-For` it believes.
    pub fn trusted_proxies(&self) -> &[ipnet::IpNet] {
        self.identifier.trusted_proxies()
    }

    /// Whom a connection from `peer` counts against (see
    /// [`Identifier::connection_owner`]; `None`: a trusted proxy).
    pub fn connection_owner(&self, peer: std::net::IpAddr) -> Option<std::net::IpAddr> {
        self.identifier.connection_owner(peer)
    }

    /// The names of its policies, in match order.
    pub fn policy_names(&self) -> Vec<Arc<str>> {
        self.policies.names()
    }

    /// The hot keys of the last complete window, in the Prometheus text
    /// format (empty without a detector), each with the node serving it.
    pub fn render_hot_keys(&self) -> String {
        match &self.hot_keys {
            Some(hot) => hot.render(self.clock.now(), &|slot| self.store.slot_owner(slot)),
            None => String::new(),
        }
    }

    /// The store's backend name.
    pub fn backend(&self) -> &'static str {
        self.store.backend()
    }

    /// Whether [`Limiter::check`] would decide a request to `route` by
    /// `method` at all: `false` where no policy applies or the policy is
    /// unlimited, which `check` answers [`Outcome::Unlimited`] at once,
    /// counting nothing. The front service asks first, so such a request
    /// costs no check future.
    pub fn decides(&self, route: &str, method: &Method) -> bool {
        self.policies
            .find(route, method)
            .is_some_and(|policy| !policy.is_unlimited())
    }

    /// Decide a request to `route` (a route template) by `method`.
    pub async fn check(
        &self,
        route: &str,
        method: &Method,
        headers: &HeaderMap,
        peer: Option<IpAddr>,
    ) -> Outcome {
        let Some(policy) = self.policies.find(route, method) else {
            return Outcome::Unlimited;
        };
        if policy.is_unlimited() {
            // Unlimited routes do not even look at identifying headers.
            return Outcome::Unlimited;
        }
        let outcome = self.decide(policy, headers, peer).await;
        if !policy.shadow {
            return outcome;
        }
        // Shadow mode: decided and counted above; the request passes.
        match outcome {
            Outcome::StoreFailed { policy, error } => {
                tracing::error!(policy = %policy.name, %error, "rate limit store refused a shadow policy's request");
                Outcome::Shadow { policy }
            }
            _ => Outcome::Shadow {
                policy: Arc::clone(policy),
            },
        }
    }

    /// Identity, key, one call down the store stack, and the metrics.
    async fn decide(
        &self,
        policy: &Arc<RoutePolicy>,
        headers: &HeaderMap,
        peer: Option<IpAddr>,
    ) -> Outcome {
        if self.identifier.ignores_forwarding(headers, peer) {
            metrics::counter!(m::UNTRUSTED_FORWARDED_TOTAL).increment(1);
        }
        let (identity, kind) = match self.identifier.identify(headers, peer) {
            Ok(found) => found,
            Err(e) => {
                metrics::counter!(m::IDENTITY_ERRORS_TOTAL, "reason" => e.kind()).increment(1);
                return Outcome::BadIdentity(e);
            }
        };
        let Some(limit) = policy.limit_for(kind) else {
            return Outcome::Unlimited;
        };
        let key = self.hasher.bucket_key(&policy.name, &identity);
        let now = self.clock.now();
        let check = Check::new(key, limit, policy.cost, now)
            .on_failure(policy.failure_mode)
            .with_deny_cache(policy.deny_cache)
            .with_lease(policy.lease)
            .with_shards(policy.shards_for(&identity));
        // Never the key itself, nor the address or credential behind it.
        let span = tracing::info_span!(
            target: TARGET,
            "ratelimit.check",
            ratelimit.policy = &*policy.name,
            ratelimit.algorithm = limit.algorithm().as_str(),
            ratelimit.key_kind = kind.as_str(),
            ratelimit.decision = tracing::field::Empty,
            ratelimit.source = tracing::field::Empty,
        );
        let started = Instant::now();
        let result = {
            let _in_flight = InFlight::enter(self.metrics.in_flight());
            self.store.check(check).instrument(span.clone()).await
        };
        let elapsed = started.elapsed().as_secs_f64();
        let source = match &result {
            Ok(checked) => checked.source.as_str(),
            Err(StoreError::Unavailable { .. }) => "failclosed",
            Err(_) => "error",
        };
        self.metrics
            .duration(self.store.backend(), &policy.name, source)
            .record(elapsed);
        span.record("ratelimit.source", source);
        if let Some(hot) = &self.hot_keys {
            let store_call = matches!(
                &result,
                Ok(Checked {
                    source: Source::Redis | Source::Memory,
                    ..
                })
            );
            // A sharded key is tracked by the sub-bucket the store served:
            // its slot and node are where the load went.
            let served = match &result {
                Ok(Checked {
                    shard: Some(sub), ..
                }) => *sub,
                _ => key,
            };
            hot.record(now, served, &policy.name, kind, &identity, store_call);
        }
        let count = |verdict: &'static str| {
            span.record("ratelimit.decision", verdict);
            self.metrics
                .decision(&policy.name, verdict, kind.as_str(), source)
                .increment(1);
        };
        let policy = Arc::clone(policy);
        match result {
            Ok(Checked {
                decision: Some(decision),
                limit,
                source,
                ..
            }) => {
                count(match (decision.allowed, policy.shadow) {
                    (true, _) => "allowed",
                    (false, false) => "denied",
                    (false, true) => "shadow_denied",
                });
                if decision.allowed
                    && (decision.remaining as f64)
                        < self.near_limit_fraction * decision.limit as f64
                {
                    self.metrics
                        .near_limit(&policy.name, kind.as_str())
                        .increment(1);
                }
                Outcome::Decided {
                    policy,
                    limit,
                    decision,
                    kind,
                    source,
                }
            }
            Ok(Checked { decision: None, .. }) => {
                count("allowed");
                Outcome::FailedOpen { policy }
            }
            Err(StoreError::Unavailable { retry_after }) => {
                count("unavailable");
                Outcome::Unavailable {
                    policy,
                    retry_after,
                }
            }
            // Counted where it happened (`store::Counted`).
            Err(error) => Outcome::StoreFailed { policy, error },
        }
    }
}
