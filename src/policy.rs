//! Route policies and the limiter that applies them.
//!
//! The limiter is the one place that turns a request into a decision:
//! policy (by route template and method), identity (API key or address),
//! bucket key (keyed hash), then one store call. It knows nothing of HTTP
//! responses (that is [`crate::limit`]) nor of where state lives (that is
//! the [`Store`]); the failure policy wraps the store ([`Failover`]).

use crate::bucket::{Decision, Limit};
use crate::clock::Clock;
use crate::config::{Config, PolicyConfig};
use crate::failover::{Failover, FailoverError, FailureMode, Source};
use crate::identity::{ApiKeys, Identifier, IdentityError, KeyHasher, KeyKind};
use crate::metrics as m;
use crate::store::{Store, StoreError};
use http::{HeaderMap, Method};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

/// A route policy, resolved.
#[derive(Debug, Clone)]
pub struct RoutePolicy {
    /// The name shown in headers and metrics.
    pub name: Arc<str>,
    route: String,
    methods: Vec<Method>,
    keyed: Option<Limit>,
    anonymous: Option<Limit>,
    /// Tokens one request costs.
    pub cost: u64,
    /// What to do while the shared store cannot decide.
    pub failure_mode: FailureMode,
}

impl RoutePolicy {
    fn new(p: &PolicyConfig, default_mode: FailureMode) -> Self {
        Self {
            name: Arc::from(p.name.as_str()),
            route: p.route.clone(),
            methods: p.methods.clone(),
            keyed: p.limit,
            anonymous: p.anonymous,
            cost: p.cost,
            failure_mode: p.failure_mode.unwrap_or(default_mode),
        }
    }
}

impl RoutePolicy {
    /// The limit for a client identified as `kind`; `None` if unlimited.
    pub fn limit_for(&self, kind: KeyKind) -> Option<Limit> {
        match kind {
            KeyKind::ApiKey => self.keyed,
            KeyKind::Ip | KeyKind::UnknownApiKey => self.anonymous,
        }
    }
}

/// Policies ordered so the first match is the most specific.
#[derive(Debug, Clone)]
pub struct Policies {
    list: Vec<Arc<RoutePolicy>>,
}

impl Policies {
    /// From validated config; policies without a failure mode get `default_mode`.
    pub fn new(configs: &[PolicyConfig], default_mode: FailureMode) -> Self {
        let mut list: Vec<Arc<RoutePolicy>> = configs
            .iter()
            .map(|p| Arc::new(RoutePolicy::new(p, default_mode)))
            .collect();
        // Longest prefix first; among equals, method-specific before "all".
        list.sort_by(|a, b| {
            b.route
                .len()
                .cmp(&a.route.len())
                .then(a.methods.is_empty().cmp(&b.methods.is_empty()))
        });
        Self { list }
    }

    /// The policy for a route template and method, if any.
    pub fn find(&self, route: &str, method: &Method) -> Option<&Arc<RoutePolicy>> {
        self.list.iter().find(|p| {
            route.starts_with(p.route.as_str())
                && (p.methods.is_empty() || p.methods.contains(method))
        })
    }
}

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
}

/// Identity + policy + store. Shared by every request (`Arc`).
#[derive(Debug)]
pub struct Limiter {
    policies: Policies,
    identifier: Identifier,
    hasher: KeyHasher,
    store: Failover,
    failure_mode: FailureMode,
    clock: Arc<dyn Clock>,
}

impl Limiter {
    /// Builds a limiter from validated config, a store and a clock.
    pub fn new(config: &Config, store: Arc<dyn Store>, clock: Arc<dyn Clock>) -> Self {
        let api_keys =
            ApiKeys::from_digests(config.api_keys.iter().map(|k| (k.id.clone(), k.sha256)));
        let secret = config.key_secret.unwrap_or_else(|| {
            let mut secret = [0u8; 16];
            // Without OS randomness the process cannot keep identities
            // private; refusing to start is better than a guessable key.
            getrandom::fill(&mut secret).expect("the OS random source is unavailable");
            secret
        });
        Self {
            policies: Policies::new(&config.policies, config.failover.mode),
            identifier: Identifier::new(
                api_keys,
                config.trusted_proxies.clone(),
                config.ipv6_prefix,
            ),
            hasher: KeyHasher::new(secret),
            store: Failover::new(
                store,
                config.failover.clone(),
                config.memory.max_keys,
                config.memory.shards,
            ),
            failure_mode: config.failover.mode,
            clock,
        }
    }

    /// The store's backend name.
    pub fn backend(&self) -> &'static str {
        self.store.backend()
    }

    /// Whether the store can decide right now.
    pub async fn ready(&self) -> Result<(), StoreError> {
        self.store.ready().await
    }

    /// The failure mode of policies that do not set their own.
    pub fn failure_mode(&self) -> FailureMode {
        self.failure_mode
    }

    /// The store with its failure policy.
    pub fn failover(&self) -> &Failover {
        &self.store
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
        if policy.keyed.is_none() && policy.anonymous.is_none() {
            // Unlimited routes do not even look at identifying headers.
            return Outcome::Unlimited;
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
        let started = Instant::now();
        let result = self
            .store
            .check(
                key,
                limit,
                policy.cost,
                self.clock.now(),
                policy.failure_mode,
            )
            .await;
        metrics::histogram!(m::CHECK_DURATION_SECONDS, "backend" => self.store.backend())
            .record(started.elapsed().as_secs_f64());
        let count = |verdict: &'static str, source: &'static str| {
            metrics::counter!(
                m::DECISIONS_TOTAL,
                "policy" => Arc::clone(&policy.name),
                "decision" => verdict,
                "key_kind" => kind.as_str(),
                "source" => source,
            )
            .increment(1);
        };
        match result {
            Ok(checked) => match checked.decision {
                Some(decision) => {
                    count(
                        if decision.allowed {
                            "allowed"
                        } else {
                            "denied"
                        },
                        checked.source.as_str(),
                    );
                    Outcome::Decided {
                        policy: Arc::clone(policy),
                        limit: checked.limit,
                        decision,
                        kind,
                        source: checked.source,
                    }
                }
                None => {
                    count("allowed", Source::FailOpen.as_str());
                    Outcome::FailedOpen {
                        policy: Arc::clone(policy),
                    }
                }
            },
            Err(FailoverError::Unavailable { retry_after }) => {
                count("unavailable", "failclosed");
                Outcome::Unavailable {
                    policy: Arc::clone(policy),
                    retry_after,
                }
            }
            Err(FailoverError::Store(error)) => {
                metrics::counter!(
                    m::STORE_ERRORS_TOTAL,
                    "backend" => self.store.backend(),
                    "kind" => error.kind(),
                )
                .increment(1);
                Outcome::StoreFailed {
                    policy: Arc::clone(policy),
                    error,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn longest_prefix_and_method_win() {
        let c = Config::from_toml(
            r#"
            [[policies]]
            name = "api"
            route = "/api/"
            burst = 10
            rate = 1
            [[policies]]
            name = "orders-write"
            route = "/api/orders"
            methods = ["POST"]
            burst = 2
            rate = 1
            [[policies]]
            name = "orders"
            route = "/api/orders"
            methods = ["GET"]
            burst = 5
            rate = 1
            [[policies]]
            name = "status"
            route = "/api/status"
            unlimited = true
            "#,
        )
        .unwrap();
        let p = Policies::new(&c.policies, FailureMode::Local);
        let name = |route, method| p.find(route, &method).map(|p| p.name.to_string());
        assert_eq!(name("/api/items", Method::GET).as_deref(), Some("api"));
        assert_eq!(
            name("/api/orders", Method::POST).as_deref(),
            Some("orders-write")
        );
        assert_eq!(
            name("/api/orders/{id}", Method::GET).as_deref(),
            Some("orders")
        );
        assert_eq!(name("/api/orders", Method::DELETE).as_deref(), Some("api"));
        assert_eq!(name("/healthz", Method::GET), None);
        let status = p.find("/api/status", &Method::GET).unwrap();
        assert_eq!(status.limit_for(KeyKind::ApiKey), None);
    }
}
