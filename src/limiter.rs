//! The limiter: the one place that turns a request into a decision.
//!
//! Policy (by route template and method), identity (API key or address),
//! bucket key (keyed hash), then one call down the store stack. It knows
//! nothing of HTTP responses (that is [`crate::middleware`]) nor of where
//! state lives or what happens when it cannot be reached (that is the
//! [`Store`] stack, assembled in `server.rs`).

use crate::algorithm::{Decision, Limit};
use crate::clock::Clock;
use crate::identity::{Identifier, IdentityError, KeyHasher, KeyKind};
use crate::metrics as m;
use crate::policy::{Policies, RoutePolicy};
use crate::store::{Check, Checked, Source, Store, StoreError};
use http::{HeaderMap, Method};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

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
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
}

impl Limiter {
    /// A limiter deciding `policies` for clients `identifier` recognises,
    /// keyed by `hasher`, through the `store` stack, at `clock`'s time.
    pub fn new(
        policies: Policies,
        identifier: Identifier,
        hasher: KeyHasher,
        store: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
    ) -> Self {
        Self {
            policies,
            identifier,
            hasher,
            store,
            clock,
        }
    }

    /// The store's backend name.
    pub fn backend(&self) -> &'static str {
        self.store.backend()
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
        let check =
            Check::new(key, limit, policy.cost, self.clock.now()).on_failure(policy.failure_mode);
        let started = Instant::now();
        let result = self.store.check(check).await;
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
        let policy = Arc::clone(policy);
        match result {
            Ok(Checked {
                decision: Some(decision),
                limit,
                source,
            }) => {
                count(
                    if decision.allowed {
                        "allowed"
                    } else {
                        "denied"
                    },
                    source.as_str(),
                );
                Outcome::Decided {
                    policy,
                    limit,
                    decision,
                    kind,
                    source,
                }
            }
            Ok(Checked {
                decision: None,
                source,
                ..
            }) => {
                count("allowed", source.as_str());
                Outcome::FailedOpen { policy }
            }
            Err(StoreError::Unavailable { retry_after }) => {
                count("unavailable", "failclosed");
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
