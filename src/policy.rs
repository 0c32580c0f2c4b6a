//! Route policies: which limit applies to a request, by route template and
//! method. Plain data, built and validated by [`crate::config`], read by the
//! [`crate::limiter`].

use crate::algorithm::Limit;
use crate::headers::policy_field;
use crate::identity::Identity;
use crate::key::KeyKind;
use crate::store::FailureMode;
use http::{HeaderValue, Method};
use std::sync::Arc;

/// A route policy as configured (validated).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Name, `[A-Za-z0-9_.-]{1,64}`: shown in headers and metric labels.
    pub name: String,
    /// Prefix of the route template (e.g. `/api/` or `/api/orders`); the
    /// longest matching prefix wins. `None`: no HTTP route, only
    /// descriptor rules ([`crate::descriptors`]) use it.
    pub route: Option<String>,
    /// Methods this policy applies to; empty means all.
    pub methods: Vec<Method>,
    /// `None`: the route is not limited.
    pub limit: Option<Limit>,
    /// The limit for clients without a verified API key (defaults to `limit`).
    pub anonymous: Option<Limit>,
    /// Tokens one request costs.
    pub cost: u64,
    /// What this policy does while Redis cannot decide (`None`: `failure.mode`).
    pub failure_mode: Option<FailureMode>,
    /// Shadow mode: decide and count as usual, never refuse.
    pub shadow: bool,
    /// Answer 429 in the instance while a denial from the store holds
    /// (see [`crate::mitigation::DenyCache`]).
    pub deny_cache: bool,
    /// Tokens an instance leases at most with a call (0: none; see
    /// [`crate::mitigation::Leases`]).
    pub lease: u64,
    /// Sub-buckets each key is split over (1: none; see
    /// [`crate::mitigation::Sharded`]).
    pub shards: u16,
    /// The keys split, by API key id or client address (empty: every key
    /// of the policy).
    pub shard_keys: Vec<String>,
    /// Keys with a limit of their own on this policy.
    pub overrides: Vec<Override>,
}

/// Some keys' own limit on a policy (a partner's contract): the limit
/// their bucket keeps instead of the policy's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Override {
    /// API key ids or client addresses (normalized as the limiter keys
    /// them).
    pub keys: Vec<String>,
    pub limit: Limit,
}

impl Policy {
    /// Every limit a bucket of this policy may keep: the keyed one, the
    /// anonymous one, and the overrides'.
    pub fn limits(&self) -> impl Iterator<Item = Limit> + '_ {
        [self.limit, self.anonymous]
            .into_iter()
            .flatten()
            .chain(self.overrides.iter().map(|o| o.limit))
    }
}

/// Whether `identity` is one of `keys` (API key ids or addresses).
fn names(keys: &[String], identity: &Identity) -> bool {
    match identity {
        Identity::ApiKey(id) => keys.iter().any(|k| k == &**id),
        Identity::Ip(ip) => keys.iter().any(|k| k.parse() == Ok(*ip)),
        Identity::Descriptor(_) => false,
    }
}

/// A route policy, resolved: shared by every request it applies to.
#[derive(Debug, Clone)]
pub struct RoutePolicy {
    /// The name shown in headers and metrics.
    pub name: Arc<str>,
    route: Option<String>,
    methods: Vec<Method>,
    keyed: Option<Limit>,
    anonymous: Option<Limit>,
    /// Tokens one request costs.
    pub cost: u64,
    /// What to do while the shared store cannot decide.
    pub failure_mode: FailureMode,
    /// Shadow mode: decide and count as usual, never refuse (for rolling a
    /// limit out: the metrics show whom it would have throttled).
    pub shadow: bool,
    /// Whether denials are cached in the instance.
    pub deny_cache: bool,
    /// Tokens leased at most with a call (0: none).
    pub lease: u64,
    shards: u16,
    shard_keys: Vec<String>,
    overrides: Vec<Override>,
    /// The `RateLimit-Policy` value of each of its limits, made once.
    policy_fields: Vec<(Limit, HeaderValue)>,
}

impl RoutePolicy {
    fn new(p: &Policy, default_mode: FailureMode) -> Self {
        Self {
            name: Arc::from(p.name.as_str()),
            route: p.route.clone(),
            methods: p.methods.clone(),
            keyed: p.limit,
            anonymous: p.anonymous,
            cost: p.cost,
            failure_mode: p.failure_mode.unwrap_or(default_mode),
            shadow: p.shadow,
            deny_cache: p.deny_cache,
            lease: p.lease,
            shards: p.shards,
            shard_keys: p.shard_keys.clone(),
            overrides: p.overrides.clone(),
            policy_fields: p
                .limits()
                .filter_map(|l| Some((l, policy_field(&p.name, &l)?)))
                .collect(),
        }
    }

    /// The `RateLimit-Policy` value for `limit`, if it is one of this
    /// policy's own (a store may answer under another, a shard's share).
    pub fn policy_field(&self, limit: &Limit) -> Option<&HeaderValue> {
        self.policy_fields
            .iter()
            .find(|(own, _)| own == limit)
            .map(|(_, value)| value)
    }

    /// Sub-buckets the key of `identity` is split over (1: not split).
    pub fn shards_for(&self, identity: &Identity) -> u16 {
        if self.shards <= 1 {
            return 1;
        }
        if self.shard_keys.is_empty() || names(&self.shard_keys, identity) {
            self.shards
        } else {
            1
        }
    }

    /// The limit for a client identified as `kind`; `None` if unlimited.
    pub fn limit_for(&self, kind: KeyKind) -> Option<Limit> {
        match kind {
            KeyKind::ApiKey | KeyKind::Descriptor => self.keyed,
            KeyKind::Ip | KeyKind::UnknownApiKey => self.anonymous,
        }
    }

    /// The limit of `identity` (identified as `kind`): its override if
    /// it has one, else the one for its kind; `None` if unlimited.
    pub fn limit_of(&self, identity: &Identity, kind: KeyKind) -> Option<Limit> {
        // By identity alone: an unknown API key is keyed by its address,
        // in the same bucket as that address's anonymous requests, which
        // must keep one limit.
        match self.overrides.iter().find(|o| names(&o.keys, identity)) {
            Some(o) => Some(o.limit),
            None => self.limit_for(kind),
        }
    }

    /// Whether no client is limited on this route.
    pub fn is_unlimited(&self) -> bool {
        self.keyed.is_none() && self.anonymous.is_none()
    }
}

/// Policies ordered so the first match is the most specific.
#[derive(Debug, Clone)]
pub struct Policies {
    list: Vec<Arc<RoutePolicy>>,
}

impl Policies {
    /// From validated policies; those without a failure mode get `default_mode`.
    pub fn new(policies: &[Policy], default_mode: FailureMode) -> Self {
        let mut list: Vec<Arc<RoutePolicy>> = policies
            .iter()
            .map(|p| Arc::new(RoutePolicy::new(p, default_mode)))
            .collect();
        // Longest prefix first; among equals, method-specific before "all".
        // Policies without a route (descriptor rules only) last.
        let len = |p: &RoutePolicy| p.route.as_ref().map(String::len);
        list.sort_by(|a, b| {
            len(b)
                .cmp(&len(a))
                .then(a.methods.is_empty().cmp(&b.methods.is_empty()))
        });
        Self { list }
    }

    /// The policies' names, in match order.
    pub fn names(&self) -> Vec<Arc<str>> {
        self.list.iter().map(|p| Arc::clone(&p.name)).collect()
    }

    /// The policy for a route template and method, if any.
    pub fn find(&self, route: &str, method: &Method) -> Option<&Arc<RoutePolicy>> {
        self.position(route, method).map(|i| &self.list[i])
    }

    /// Where in [`Policies::names`]' order the policy for a route template
    /// and method is, if any.
    pub fn position(&self, route: &str, method: &Method) -> Option<usize> {
        self.list.iter().position(|p| {
            p.route.as_deref().is_some_and(|r| route.starts_with(r))
                && (p.methods.is_empty() || p.methods.contains(method))
        })
    }

    /// Where in [`Policies::names`]' order the policy called `name` is.
    pub fn named(&self, name: &str) -> Option<usize> {
        self.list.iter().position(|p| &*p.name == name)
    }

    /// The policy at `position`.
    ///
    /// # Panics
    /// If `position` is out of range: it must come from
    /// [`Policies::position`] on these policies.
    pub fn get(&self, position: usize) -> &Arc<RoutePolicy> {
        &self.list[position]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    /// The policies of a config file's text.
    fn policies(toml: &str) -> Policies {
        let c = Config::from_toml(toml).unwrap();
        Policies::new(&c.policies, FailureMode::Local)
    }

    #[test]
    fn longest_prefix_and_method_win() {
        let p = policies(
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
        );
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
        assert!(status.is_unlimited());
    }

    /// A named key keeps its override's limit, by identity whatever its
    /// kind; every other key the policy's.
    #[test]
    fn an_override_is_the_named_keys_limit_alone() {
        let p = policies(
            r#"
            [[api_keys]]
            id = "partner"
            key = "partner-key"
            [[api_keys]]
            id = "other"
            key = "other-key"
            [[policies]]
            name = "api"
            route = "/api/"
            burst = 10
            rate = 1
            anonymous = { burst = 4, rate = 2 }
            overrides = [
                { keys = ["partner"], burst = 500, rate = 250 },
                { keys = ["192.0.2.7"], burst = 40, rate = 20 },
            ]
            "#,
        );
        let api = p.find("/api/items", &Method::GET).unwrap();
        let key = |id: &str| Identity::ApiKey(Arc::from(id));
        let ip = |a: &str| Identity::Ip(a.parse().unwrap());
        let burst = |identity: &Identity, kind| api.limit_of(identity, kind).unwrap().burst();
        assert_eq!(burst(&key("partner"), KeyKind::ApiKey), 500);
        assert_eq!(burst(&key("other"), KeyKind::ApiKey), 10);
        assert_eq!(burst(&ip("192.0.2.7"), KeyKind::Ip), 40);
        // An unknown key from that address shares the address's bucket.
        assert_eq!(burst(&ip("192.0.2.7"), KeyKind::UnknownApiKey), 40);
        assert_eq!(burst(&ip("192.0.2.8"), KeyKind::Ip), 4);
        // Its fields are made once too.
        let own = api.limit_of(&key("partner"), KeyKind::ApiKey).unwrap();
        assert_eq!(
            api.policy_field(&own).unwrap().to_str().unwrap(),
            "\"api\";q=500;w=2"
        );
    }

    /// Each of a policy's limits has its `RateLimit-Policy` value made
    /// once, as the fields would write it; any other limit (a shard's
    /// share) has none, and is written per request.
    #[test]
    fn a_policys_own_limits_have_their_policy_field_made() {
        let p = policies(
            r#"
            [[policies]]
            name = "api"
            route = "/api/"
            burst = 10
            rate = 1
            anonymous = { burst = 4, rate = 2 }
            "#,
        );
        let api = p.find("/api/items", &Method::GET).unwrap();
        for (kind, text) in [
            (KeyKind::ApiKey, "\"api\";q=10;w=10"),
            (KeyKind::Ip, "\"api\";q=4;w=2"),
        ] {
            let limit = api.limit_for(kind).unwrap();
            let made = api.policy_field(&limit).expect("made");
            assert_eq!(made.to_str().unwrap(), text, "{kind:?}");
        }
        let other = Limit::per_second(5, 1).unwrap();
        assert_eq!(api.policy_field(&other), None);
    }
}
