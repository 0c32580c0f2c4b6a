//! The limiter: the one place that turns a request into a decision.
//!
//! Policy (by route template and method), identity (API key or address),
//! bucket key (keyed hash), then one call down the store stack. It knows
//! nothing of HTTP responses (that is [`crate::middleware`]) nor of where
//! state lives or what happens when it cannot be reached (that is the
//! [`Store`] stack, assembled in `server.rs`).

use crate::algorithm::{Decision, Limit};
use crate::clock::Clock;
use crate::descriptors::{DescriptorId, DescriptorRules, Domain};
use crate::hotkeys::HotKeys;
use crate::identity::{Identifier, Identity, IdentityError, KeyHasher, KeyKind};
use crate::metrics as m;
use crate::policy::{Policies, RoutePolicy};
use crate::store::{Check, Checked, Source, Store, StoreError};
use crate::telemetry::TARGET;
use http::{HeaderMap, Method};
use metrics::{Counter, Gauge, Histogram};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;
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

/// A limiter and the policy of its that limits a request, as
/// [`Limiter::limiting`] found it: [`Limiting::check`] decides the request
/// without looking the policy up again. The two travel together, so a
/// policy found in one generation of the config is never applied with
/// another's (a reload can reorder the policies).
#[derive(Debug, Clone)]
pub struct Limiting {
    limiter: Arc<Limiter>,
    /// In `limiter`'s policies (and its metrics).
    position: usize,
}

impl Limiting {
    /// Decide the request under this policy.
    pub async fn check(&self, headers: &HeaderMap, peer: Option<IpAddr>) -> Outcome {
        self.limiter.check_at(self.position, headers, peer).await
    }

    /// The longest [`Limiting::check`] can wait on the store, if the store
    /// stack bounds it ([`Store::longest_wait`]).
    pub fn longest_wait(&self) -> Option<Duration> {
        self.limiter.longest_wait
    }
}

/// Identity + policy + store. Shared by every request (`Arc`).
#[derive(Debug)]
pub struct Limiter {
    policies: Policies,
    identifier: Identifier,
    hasher: KeyHasher,
    store: Arc<dyn Store>,
    /// `store`'s [`Store::longest_wait`], asked once.
    longest_wait: Option<Duration>,
    clock: Arc<dyn Clock>,
    near_limit_fraction: f64,
    hot_keys: Option<Arc<HotKeys>>,
    descriptors: DescriptorRules,
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
/// dropped with its request counts out too). Only a check that waits on
/// the store: one answered when called (the in-process store, a
/// deny-cache hit, a spent lease) is never in flight, and skipping the
/// gauge spares it four atomic updates, each a serialising instruction.
struct InFlight<'a>(&'a Gauge);

impl<'a> InFlight<'a> {
    fn enter(gauge: &'a Gauge) -> Self {
        gauge.increment(1.0);
        Self(gauge)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.decrement(1.0);
    }
}

/// The `decision` label of `ratelimit_decisions_total`, by the indices
/// below.
const DECISIONS: [&str; 4] = ["allowed", "denied", "shadow_denied", "unavailable"];
const ALLOWED: usize = 0;
const DENIED: usize = 1;
const SHADOW_DENIED: usize = 2;
const UNAVAILABLE: usize = 3;
/// The `key_kind` label, by [`kind_index`].
const KINDS: [KeyKind; 4] = [
    KeyKind::ApiKey,
    KeyKind::Ip,
    KeyKind::UnknownApiKey,
    KeyKind::Descriptor,
];
/// The `source` label: a [`Source`], or no decision.
const SOURCES: [&str; 8] = [
    "redis",
    "memory",
    "local",
    "failopen",
    "deny_cache",
    "lease",
    "failclosed",
    "error",
];

fn kind_index(kind: KeyKind) -> usize {
    match kind {
        KeyKind::ApiKey => 0,
        KeyKind::Ip => 1,
        KeyKind::UnknownApiKey => 2,
        KeyKind::Descriptor => 3,
    }
}

/// Where a check's answer came from, as an index into [`SOURCES`].
fn source_index(result: &Result<Checked, StoreError>) -> usize {
    match result {
        Ok(checked) => match checked.source {
            Source::Redis => 0,
            Source::Memory => 1,
            Source::Local => 2,
            Source::FailOpen => 3,
            Source::DenyCache => 4,
            Source::Lease => 5,
        },
        Err(StoreError::Unavailable { .. }) => 6,
        Err(_) => 7,
    }
}

/// The limiter's metric handles: one set per policy, found by the
/// policy's position and the labels' indices, each series registered on
/// its first use and kept. A check indexes three arrays rather than hash
/// label values: three lookups in [`crate::metrics::Handles`] on every
/// limited request would cost far more.
#[derive(Debug)]
struct Metrics {
    in_flight: OnceLock<Gauge>,
    policies: Box<[PolicyMetrics]>,
}

#[derive(Debug)]
struct PolicyMetrics {
    name: Arc<str>,
    /// By decision, key kind, source.
    decisions: [[[OnceLock<Counter>; SOURCES.len()]; KINDS.len()]; DECISIONS.len()],
    /// By source.
    durations: [OnceLock<Histogram>; SOURCES.len()],
    /// By key kind.
    near_limit: [OnceLock<Counter>; KINDS.len()],
}

impl Metrics {
    fn new(policies: &Policies) -> Self {
        let policies = policies
            .names()
            .into_iter()
            .map(|name| PolicyMetrics {
                name,
                decisions: std::array::from_fn(|_| {
                    std::array::from_fn(|_| std::array::from_fn(|_| OnceLock::new()))
                }),
                durations: std::array::from_fn(|_| OnceLock::new()),
                near_limit: std::array::from_fn(|_| OnceLock::new()),
            })
            .collect();
        Self {
            in_flight: OnceLock::new(),
            policies,
        }
    }

    fn in_flight(&self) -> &Gauge {
        self.in_flight
            .get_or_init(|| metrics::gauge!(m::CHECKS_IN_FLIGHT))
    }
}

impl PolicyMetrics {
    fn decision(&self, decision: usize, kind: KeyKind, source: usize) -> &Counter {
        self.decisions[decision][kind_index(kind)][source].get_or_init(|| {
            metrics::counter!(
                m::DECISIONS_TOTAL,
                "policy" => Arc::clone(&self.name),
                "decision" => DECISIONS[decision],
                "key_kind" => kind.as_str(),
                "source" => SOURCES[source],
            )
        })
    }

    fn duration(&self, backend: &'static str, source: usize) -> &Histogram {
        self.durations[source].get_or_init(|| {
            metrics::histogram!(
                m::CHECK_DURATION_SECONDS,
                "backend" => backend,
                "policy" => Arc::clone(&self.name),
                "source" => SOURCES[source],
            )
        })
    }

    fn near_limit(&self, kind: KeyKind) -> &Counter {
        self.near_limit[kind_index(kind)].get_or_init(|| {
            metrics::counter!(
                m::NEAR_LIMIT_TOTAL,
                "policy" => Arc::clone(&self.name),
                "key_kind" => kind.as_str(),
            )
        })
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
            metrics: Metrics::new(&policies),
            policies,
            identifier,
            hasher,
            longest_wait: store.longest_wait(),
            store,
            clock,
            near_limit_fraction,
            hot_keys: None,
            descriptors: DescriptorRules::default(),
        }
    }

    /// The same limiter offering every check to a hot-key detector
    /// (shared, so a reload can hand it on to the next limiter).
    pub fn with_hot_keys(self, hot_keys: Option<Arc<HotKeys>>) -> Self {
        Self { hot_keys, ..self }
    }

    /// The same limiter deciding the descriptors of Envoy's rate limit
    /// service by `domains`' rules, over its own policies.
    pub fn with_descriptors(self, domains: &[Domain]) -> Self {
        let descriptors = DescriptorRules::new(domains, |name| self.policies.named(name));
        Self {
            descriptors,
            ..self
        }
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

    /// The policy that limits a request to `route` by `method`, with this
    /// limiter, or `None` where no policy applies or the policy is
    /// unlimited, which [`Limiter::check`] answers [`Outcome::Unlimited`]
    /// at once, counting nothing. The front service asks first, so such a
    /// request costs no check future, and then decides with
    /// [`Limiting::check`]: the policy is looked up once.
    pub fn limiting(self: Arc<Self>, route: &str, method: &Method) -> Option<Limiting> {
        let position = self.position(route, method)?;
        Some(Limiting {
            limiter: self,
            position,
        })
    }

    /// Whether [`Limiter::check`] would decide a request to `route` by
    /// `method` at all (see [`Limiter::limiting`]).
    pub fn decides(&self, route: &str, method: &Method) -> bool {
        self.position(route, method).is_some()
    }

    /// Where the policy limiting `route` by `method` is, if one does.
    fn position(&self, route: &str, method: &Method) -> Option<usize> {
        self.limited(self.policies.position(route, method))
    }

    /// `found`, a policy's position, unless that policy is unlimited.
    fn limited(&self, found: Option<usize>) -> Option<usize> {
        found.filter(|&i| !self.policies.get(i).is_unlimited())
    }

    /// Decide a request to `route` (a route template) by `method`.
    pub async fn check(
        &self,
        route: &str,
        method: &Method,
        headers: &HeaderMap,
        peer: Option<IpAddr>,
    ) -> Outcome {
        match self.position(route, method) {
            Some(position) => self.check_at(position, headers, peer).await,
            // Unlimited routes do not even look at identifying headers.
            None => Outcome::Unlimited,
        }
    }

    /// Decide a request under the policy at `position`, from
    /// [`Limiter::position`] on this limiter.
    async fn check_at(
        &self,
        position: usize,
        headers: &HeaderMap,
        peer: Option<IpAddr>,
    ) -> Outcome {
        let policy = self.policies.get(position);
        let metrics = &self.metrics.policies[position];
        let (identified, ignores_forwarding) = self.identifier.identify_request(headers, peer);
        if ignores_forwarding {
            metrics::counter!(m::UNTRUSTED_FORWARDED_TOTAL).increment(1);
        }
        let outcome = match identified {
            Ok((identity, kind)) => {
                self.decide(policy, metrics, identity, kind, policy.cost)
                    .await
            }
            Err(e) => {
                metrics::counter!(m::IDENTITY_ERRORS_TOTAL, "reason" => e.kind()).increment(1);
                return Outcome::BadIdentity(e);
            }
        };
        shadowed(policy, outcome)
    }

    /// Decide one descriptor sent to Envoy's rate limit service: under the
    /// policy its domain's rules name ([`crate::descriptors`]), keyed by
    /// the descriptor, at `cost` tokens (`None`: the policy's cost; 0 reads
    /// the bucket and takes nothing). [`Outcome::Unlimited`] where no rule
    /// or an unlimited policy applies.
    pub async fn check_descriptor(&self, descriptor: DescriptorId, cost: Option<u64>) -> Outcome {
        let entries = descriptor.entries.iter().map(|(k, v)| (&**k, &**v));
        let Some(position) = self.limited(self.descriptors.find(&descriptor.domain, entries))
        else {
            return Outcome::Unlimited;
        };
        let policy = self.policies.get(position);
        let identity = Identity::Descriptor(Arc::new(descriptor));
        let cost = cost.unwrap_or(policy.cost);
        let outcome = self
            .decide(
                policy,
                &self.metrics.policies[position],
                identity,
                KeyKind::Descriptor,
                cost,
            )
            .await;
        shadowed(policy, outcome)
    }

    /// Key, one call down the store stack, and the metrics, for `identity`
    /// at `cost` tokens.
    async fn decide(
        &self,
        policy: &Arc<RoutePolicy>,
        metrics: &PolicyMetrics,
        identity: Identity,
        kind: KeyKind,
        cost: u64,
    ) -> Outcome {
        let Some(limit) = policy.limit_of(&identity, kind) else {
            return Outcome::Unlimited;
        };
        let key = self.hasher.bucket_key(&policy.name, &identity);
        let now = self.clock.now();
        // A read (cost 0) takes no lease and is not a denial to remember.
        let taking = cost > 0;
        let check = Check::new(key, limit, cost, now)
            .on_failure(policy.failure_mode)
            .with_deny_cache(policy.deny_cache && taking)
            .with_lease(if taking { policy.lease } else { 0 })
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
        // quanta's counter, not `std::time::Instant`: a TSC read and a
        // scaling instead of two `clock_gettime` calls and a subtraction of
        // timespecs (compared in docs/http-cost.md), for a duration that is
        // all it is used for. Without a usable TSC quanta reads the OS
        // clock.
        let started = quanta::Instant::now();
        let result = {
            let in_flight = self.metrics.in_flight();
            // Awaited through a reference: moved into the span's wrapper
            // instead, the answer would take room in this future twice.
            let mut checking = self.store.check(check);
            let _in_flight = (!checking.is_ready()).then(|| InFlight::enter(in_flight));
            (&mut checking).instrument(span.clone()).await
        };
        let elapsed = started.elapsed().as_secs_f64();
        let source = source_index(&result);
        metrics
            .duration(self.store.backend(), source)
            .record(elapsed);
        span.record("ratelimit.source", SOURCES[source]);
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
        let count = |decision: usize| {
            span.record("ratelimit.decision", DECISIONS[decision]);
            metrics.decision(decision, kind, source).increment(1);
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
                    (true, _) => ALLOWED,
                    (false, false) => DENIED,
                    (false, true) => SHADOW_DENIED,
                });
                if decision.allowed
                    && (decision.remaining as f64)
                        < self.near_limit_fraction * decision.limit as f64
                {
                    metrics.near_limit(kind).increment(1);
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
                count(ALLOWED);
                Outcome::FailedOpen { policy }
            }
            Err(StoreError::Unavailable { retry_after }) => {
                count(UNAVAILABLE);
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

/// A shadow policy's outcome: decided and counted as usual, the request
/// passes.
fn shadowed(policy: &Arc<RoutePolicy>, outcome: Outcome) -> Outcome {
    if !policy.shadow {
        return outcome;
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every key kind. The match fails to compile when a kind is added,
    /// until it is listed here too, and so tested below.
    fn every_kind() -> [KeyKind; 4] {
        match KeyKind::Ip {
            KeyKind::ApiKey | KeyKind::Ip | KeyKind::UnknownApiKey | KeyKind::Descriptor => {}
        }
        [
            KeyKind::ApiKey,
            KeyKind::Ip,
            KeyKind::UnknownApiKey,
            KeyKind::Descriptor,
        ]
    }

    /// Every source, likewise.
    fn every_source() -> [Source; 6] {
        match Source::Redis {
            Source::Redis
            | Source::Memory
            | Source::Local
            | Source::FailOpen
            | Source::DenyCache
            | Source::Lease => {}
        }
        [
            Source::Redis,
            Source::Memory,
            Source::Local,
            Source::FailOpen,
            Source::DenyCache,
            Source::Lease,
        ]
    }

    #[test]
    fn label_indices_name_the_labels_they_stand_for() {
        for kind in every_kind() {
            assert_eq!(KINDS[kind_index(kind)], kind);
        }
        assert_eq!(
            [ALLOWED, DENIED, SHADOW_DENIED, UNAVAILABLE].map(|d| DECISIONS[d]),
            ["allowed", "denied", "shadow_denied", "unavailable"]
        );
        for source in every_source() {
            let checked = Ok(Checked {
                decision: None,
                limit: Limit::per_second(1, 1).unwrap(),
                source,
                bounded: false,
                shard: None,
                extra: 0,
            });
            assert_eq!(SOURCES[source_index(&checked)], source.as_str());
        }
        let unavailable = Err(StoreError::Unavailable {
            retry_after: std::time::Duration::ZERO,
        });
        assert_eq!(SOURCES[source_index(&unavailable)], "failclosed");
    }
}
