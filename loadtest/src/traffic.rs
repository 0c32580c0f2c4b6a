//! The traffic model of the goose scenarios (`mixed`, `hotkey`), as plain
//! data and pure functions: who sends what (tenants by Zipf popularity,
//! abusive tenants, anonymous clients, the surge), which route, and what
//! every answer must carry. The goose wiring is in `scenario.rs`.

use anyhow::Context;
use serde::Deserialize;
use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// A configured API key: the tenant id the service reports, and the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant {
    pub id: String,
    pub key: String,
}

#[derive(Deserialize)]
struct KeysFile {
    #[serde(default)]
    api_keys: Vec<KeyEntry>,
    #[serde(default)]
    policies: Vec<PolicyEntry>,
}

#[derive(Deserialize)]
struct PolicyEntry {
    #[serde(default)]
    overrides: Vec<OverrideEntry>,
}

#[derive(Deserialize)]
struct OverrideEntry {
    keys: Vec<String>,
}

#[derive(Deserialize)]
struct KeyEntry {
    id: String,
    key: Option<String>,
}

/// The plain API keys of a service config file (`config/stack.toml`): the
/// tenants the scenarios can send as. Keys given only as a hash cannot be
/// sent and are skipped.
pub fn tenants(path: &Path) -> anyhow::Result<Vec<Tenant>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the tenants' config {}", path.display()))?;
    let file: KeysFile = toml::from_str(&text)
        .with_context(|| format!("{}: not a service config", path.display()))?;
    let tenants: Vec<Tenant> = file
        .api_keys
        .into_iter()
        .filter_map(|k| k.key.map(|key| Tenant { id: k.id, key }))
        .collect();
    anyhow::ensure!(
        tenants.len() >= 4,
        "{} has {} plain api_keys; the scenarios need at least 4 tenants",
        path.display(),
        tenants.len()
    );
    Ok(tenants)
}

/// The partner: the first API key id with a limit of its own (an
/// override) on some policy of a service config file, if any.
pub fn partner(path: &Path) -> anyhow::Result<Option<String>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the tenants' config {}", path.display()))?;
    let file: KeysFile = toml::from_str(&text)
        .with_context(|| format!("{}: not a service config", path.display()))?;
    let ids: Vec<&str> = file.api_keys.iter().map(|k| k.id.as_str()).collect();
    Ok(file
        .policies
        .iter()
        .flat_map(|p| &p.overrides)
        .flat_map(|o| &o.keys)
        .find(|k| ids.contains(&k.as_str()))
        .cloned())
}

/// Zipf popularity over ranks `0..n`: rank `k` is picked with probability
/// proportional to `1 / (k + 1)^s`.
#[derive(Debug, Clone)]
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    pub fn new(n: usize, s: f64) -> Self {
        assert!(n > 0, "Zipf over no ranks");
        let weights: Vec<f64> = (1..=n).map(|k| (k as f64).powf(-s)).collect();
        let total: f64 = weights.iter().sum();
        let mut acc = 0.0;
        let cdf = weights
            .iter()
            .map(|w| {
                acc += w / total;
                acc
            })
            .collect();
        Self { cdf }
    }

    /// The rank for a uniform draw `u` in `[0, 1)`.
    pub fn pick(&self, u: f64) -> usize {
        self.cdf
            .partition_point(|&c| c <= u)
            .min(self.cdf.len() - 1)
    }

    /// The probability of rank `k`.
    #[cfg(test)]
    pub fn probability(&self, k: usize) -> f64 {
        self.cdf[k] - if k == 0 { 0.0 } else { self.cdf[k - 1] }
    }
}

/// Who a goose user is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Class {
    /// Well-behaved tenants: an API key by Zipf popularity per request.
    Tenant,
    /// Tenants far over their limit.
    Abusive,
    /// No API key: limited by client address, each user an address.
    Anonymous,
    /// The hot-key surge (`hotkey` only).
    Surge,
}

impl Class {
    pub fn name(self) -> &'static str {
        match self {
            Class::Tenant => "tenant",
            Class::Abusive => "abusive",
            Class::Anonymous => "anonymous",
            Class::Surge => "surge",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The sample API's routes the scenarios send, with their weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `GET /api/items`
    List,
    /// `GET /api/items/{id}`, an item that exists.
    Item(u32),
    /// `POST /api/orders`
    Order(u32),
}

impl Route {
    /// A route for a uniform draw `u` in `[0, 1)`: 60 % list, 30 % one
    /// item, 10 % orders (the POST, whose policy costs 2 and fails closed).
    pub fn pick(u: f64) -> Self {
        let item = 1 + ((u * 1000.0) as u32 % 3);
        if u < 0.6 {
            Route::List
        } else if u < 0.9 {
            Route::Item(item)
        } else {
            Route::Order(item)
        }
    }

    pub fn path(self) -> String {
        match self {
            Route::List => "/api/items".into(),
            Route::Item(id) => format!("/api/items/{id}"),
            Route::Order(_) => "/api/orders".into(),
        }
    }

    /// The JSON body an order sends (the other routes send none).
    pub fn body(self) -> Option<String> {
        match self {
            Route::Order(item) => Some(format!("{{\"item_id\":{item},\"quantity\":1}}")),
            _ => None,
        }
    }

    /// The name goose reports the request under (one per route template;
    /// goose adds the method).
    pub fn name(self) -> &'static str {
        match self {
            Route::List => "/api/items",
            Route::Item(_) => "/api/items/{id}",
            Route::Order(_) => "/api/orders",
        }
    }
}

/// What an answer was, once checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// 2xx with consistent RateLimit fields.
    Admitted,
    /// 429 with `Retry-After` and consistent RateLimit fields.
    Throttled,
    /// A 5xx or no answer at all (the text says which). An error for the
    /// user; under a hot key it is the incident itself (a policy that fails
    /// closed answers 503 when its check misses the deadline).
    Unavailable(String),
    /// An answer that breaks the contract: an unexpected status, or
    /// headers missing or disagreeing. Never acceptable.
    Broken(String),
}

/// The header values a check reads, by lower-case name.
pub trait Headers {
    fn get(&self, name: &str) -> Option<&str>;
}

impl Headers for reqwest::header::HeaderMap {
    fn get(&self, name: &str) -> Option<&str> {
        reqwest::header::HeaderMap::get(self, name).and_then(|v| v.to_str().ok())
    }
}

impl Headers for [(&str, &str)] {
    fn get(&self, name: &str) -> Option<&str> {
        self.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
    }
}

fn number(headers: &(impl Headers + ?Sized), name: &str) -> Result<u64, String> {
    let value = headers.get(name).ok_or_else(|| format!("no {name}"))?;
    value
        .trim()
        .parse()
        .map_err(|_| format!("{name} is not a number: {value:?}"))
}

/// The `r=` of the `RateLimit` field, and its policy name.
fn ratelimit_field(headers: &(impl Headers + ?Sized)) -> Result<(String, u64), String> {
    let value = headers.get("ratelimit").ok_or("no ratelimit")?;
    let mut parts = value.split(';');
    let policy = parts.next().unwrap_or_default().trim().to_owned();
    let remaining = parts
        .find_map(|p| p.trim().strip_prefix("r="))
        .ok_or_else(|| format!("ratelimit has no r=: {value:?}"))?;
    let remaining = remaining
        .parse()
        .map_err(|_| format!("ratelimit r= is not a number: {value:?}"))?;
    Ok((policy, remaining))
}

/// The RateLimit fields an answer carries, checked against each other.
fn rate_limit_fields(headers: &(impl Headers + ?Sized)) -> Result<(), String> {
    let limit = number(headers, "ratelimit-limit")?;
    let remaining = number(headers, "ratelimit-remaining")?;
    number(headers, "ratelimit-reset")?;
    if remaining > limit {
        return Err(format!(
            "ratelimit-remaining {remaining} > ratelimit-limit {limit}"
        ));
    }
    let policy = headers
        .get("ratelimit-policy")
        .ok_or("no ratelimit-policy")?;
    let (name, r) = ratelimit_field(headers)?;
    if r != remaining {
        return Err(format!(
            "ratelimit r={r} but ratelimit-remaining {remaining}"
        ));
    }
    if !policy.starts_with(&format!("{name};")) {
        return Err(format!(
            "ratelimit names {name}, ratelimit-policy says {policy:?}"
        ));
    }
    let quota = policy
        .split(';')
        .find_map(|p| p.trim().strip_prefix("q="))
        .and_then(|q| q.parse::<u64>().ok());
    if quota != Some(limit) {
        return Err(format!(
            "ratelimit-policy {policy:?} but ratelimit-limit {limit}"
        ));
    }
    Ok(())
}

/// Checks one answer of a limited route.
pub fn check(status: u16, headers: &(impl Headers + ?Sized)) -> Verdict {
    match status {
        200..=299 => match rate_limit_fields(headers) {
            Ok(()) => Verdict::Admitted,
            Err(why) => Verdict::Broken(format!("{status} {why}")),
        },
        429 => {
            let fields =
                rate_limit_fields(headers).and_then(|()| match number(headers, "retry-after")? {
                    0 => Err("retry-after 0".to_owned()),
                    _ => Ok(()),
                });
            match fields {
                Ok(()) => Verdict::Throttled,
                Err(why) => Verdict::Broken(format!("429 {why}")),
            }
        }
        500..=599 => Verdict::Unavailable(format!("status {status}")),
        _ => Verdict::Broken(format!("status {status}")),
    }
}

/// The loopback source addresses the anonymous users connect from, so that
/// nginx, which keys clients by their address, sees many clients on one
/// machine (all of 127.0.0.0/8 is loopback on Linux). Stays clear of
/// 127.0.0.0/24, where nginx's own `proxy_bind` address (127.0.0.2) and the
/// `proxy` cause's address live.
pub fn client_address(n: u64) -> IpAddr {
    let n = n % (254 * 254);
    IpAddr::V4(Ipv4Addr::new(
        127,
        1,
        (n / 254) as u8 + 1,
        (n % 254) as u8 + 1,
    ))
}

/// The one address every user of the `proxy` cause arrives from: the
/// front proxy nobody trusts, behind which every client looks the same.
pub const PROXY_ADDRESS: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 9));

/// Who sends a surge, as nginx's access log sees it: the user agent, and
/// the addresses it comes from. The runbook's root-cause step tells the
/// causes apart by them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SurgeClient {
    pub user_agent: &'static str,
    /// The first of its addresses (127.0.0.x), or none for many (the
    /// anonymous clients' range).
    first: Option<u8>,
    /// How many addresses from `first`.
    count: u8,
}

impl SurgeClient {
    pub fn of(cause: super::scenario::Cause) -> Self {
        use super::scenario::Cause;
        match cause {
            // One script on one host, far over its key's limit.
            Cause::Tenant => Self {
                user_agent: "report-exporter/1.4",
                first: Some(8),
                count: 1,
            },
            // Every install of one release: many addresses, one agent.
            Cause::ClientBug => Self {
                user_agent: "demo-app/2.3.0",
                first: None,
                count: 0,
            },
            // Browsers behind one proxy nobody trusts.
            Cause::Proxy => Self {
                user_agent: "Mozilla/5.0 (X11; Linux x86_64)",
                first: Some(9),
                count: 1,
            },
            // The partner's three sync servers.
            Cause::Partner => Self {
                user_agent: "partner-sync/7.2",
                first: Some(21),
                count: 3,
            },
        }
    }

    /// The address of its `n`th user.
    pub fn address(&self, n: u64) -> IpAddr {
        match self.first {
            Some(first) => IpAddr::V4(Ipv4Addr::new(
                127,
                0,
                0,
                first + (n % u64::from(self.count.max(1))) as u8,
            )),
            None => client_address(n),
        }
    }
}

/// Counts per class: admitted, throttled, unavailable, broken.
#[derive(Debug, Default)]
pub struct Tally {
    counts: [[AtomicU64; 4]; 4],
}

/// One class's counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub admitted: u64,
    pub throttled: u64,
    /// 5xx and transport errors.
    pub unavailable: u64,
    /// Contract violations.
    pub broken: u64,
}

impl Counts {
    pub fn total(&self) -> u64 {
        self.admitted + self.throttled + self.unavailable + self.broken
    }
}

impl Tally {
    pub fn record(&self, class: Class, verdict: &Verdict) {
        let i = match verdict {
            Verdict::Admitted => 0,
            Verdict::Throttled => 1,
            Verdict::Unavailable(_) => 2,
            Verdict::Broken(_) => 3,
        };
        self.counts[class.index()][i].fetch_add(1, Ordering::Relaxed);
    }

    pub fn get(&self, class: Class) -> Counts {
        let c = &self.counts[class.index()];
        Counts {
            admitted: c[0].load(Ordering::Relaxed),
            throttled: c[1].load(Ordering::Relaxed),
            unavailable: c[2].load(Ordering::Relaxed),
            broken: c[3].load(Ordering::Relaxed),
        }
    }
}

/// A latency histogram with fixed memory and about 3 % resolution: 32
/// sub-buckets per power of two of microseconds, counted atomically, so
/// every goose user records into it without a lock.
#[derive(Debug)]
pub struct Latency {
    buckets: Vec<AtomicU64>,
}

const SUB_BITS: u32 = 5;
const SUB: u64 = 1 << SUB_BITS;

impl Default for Latency {
    fn default() -> Self {
        Self {
            buckets: (0..(64 * SUB)).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

impl Latency {
    fn index(micros: u64) -> usize {
        if micros < SUB {
            return micros as usize;
        }
        let exp = 63 - micros.leading_zeros(); // >= SUB_BITS
        let sub = (micros >> (exp - SUB_BITS)) & (SUB - 1);
        (((exp - SUB_BITS + 1) as u64) * SUB + sub) as usize
    }

    /// The largest value that lands in bucket `i` (quantiles report the
    /// bucket's upper edge: never optimistic).
    fn upper(i: usize) -> u64 {
        let i = i as u64;
        if i < SUB {
            return i;
        }
        let exp = i / SUB + SUB_BITS as u64 - 1;
        let sub = i % SUB;
        ((SUB + sub + 1) << (exp - SUB_BITS as u64)) - 1
    }

    pub fn record(&self, micros: u64) {
        let i = Self::index(micros).min(self.buckets.len() - 1);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.buckets.iter().map(|b| b.load(Ordering::Relaxed)).sum()
    }

    /// The `q` quantile in microseconds (`None` with no samples).
    pub fn quantile(&self, q: f64) -> Option<u64> {
        let total = self.count();
        if total == 0 {
            return None;
        }
        let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0;
        for (i, b) in self.buckets.iter().enumerate() {
            seen += b.load(Ordering::Relaxed);
            if seen >= rank {
                return Some(Self::upper(i));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const OK: [(&str, &str); 5] = [
        ("ratelimit-limit", "100"),
        ("ratelimit-remaining", "7"),
        ("ratelimit-reset", "10"),
        ("ratelimit-policy", "\"api\";q=100;w=10"),
        ("ratelimit", "\"api\";r=7;t=0"),
    ];

    #[test]
    fn admitted_and_throttled_answers_are_checked_field_by_field() {
        assert_eq!(check(200, &OK[..]), Verdict::Admitted);
        assert_eq!(check(201, &OK[..]), Verdict::Admitted);
        let mut denied = OK.to_vec();
        denied.push(("retry-after", "1"));
        assert_eq!(check(429, &denied[..]), Verdict::Throttled);
        // A 429 without Retry-After, or with 0, breaks the contract.
        assert!(matches!(check(429, &OK[..]), Verdict::Broken(e) if e.contains("retry-after")));
        denied.pop();
        denied.push(("retry-after", "0"));
        assert!(matches!(check(429, &denied[..]), Verdict::Broken(_)));
        // Each field missing, or disagreeing with another, is an error.
        for (name, _) in OK {
            let fewer: Vec<_> = OK.iter().filter(|(n, _)| *n != name).copied().collect();
            assert!(
                matches!(check(200, &fewer[..]), Verdict::Broken(_)),
                "without {name}"
            );
        }
        let mut off = OK.to_vec();
        off[4] = ("ratelimit", "\"api\";r=6;t=0");
        assert!(matches!(check(200, &off[..]), Verdict::Broken(e) if e.contains("r=6")));
        let mut off = OK.to_vec();
        off[1] = ("ratelimit-remaining", "101");
        off[4] = ("ratelimit", "\"api\";r=101;t=0");
        assert!(matches!(check(200, &off[..]), Verdict::Broken(_)));
        // q=100 is not q=10: the quota is compared whole.
        let mut off = OK.to_vec();
        off[0] = ("ratelimit-limit", "10");
        assert!(matches!(check(200, &off[..]), Verdict::Broken(e) if e.contains("q=100")));
        let mut off = OK.to_vec();
        off[3] = ("ratelimit-policy", "\"orders\";q=100;w=10");
        assert!(matches!(check(200, &off[..]), Verdict::Broken(_)));
        // Server errors are the service unavailable; anything else
        // unexpected breaks the contract.
        for status in [500, 502, 503, 504] {
            assert!(
                matches!(check(status, &OK[..]), Verdict::Unavailable(_)),
                "{status}"
            );
        }
        for status in [401, 400, 404, 302] {
            assert!(
                matches!(check(status, &OK[..]), Verdict::Broken(_)),
                "{status}"
            );
        }
    }

    #[test]
    fn zipf_favours_the_first_ranks_and_sums_to_one() {
        let z = Zipf::new(16, 1.0);
        let total: f64 = (0..16).map(|k| z.probability(k)).sum();
        assert!((total - 1.0).abs() < 1e-9);
        assert!((z.probability(0) / z.probability(1) - 2.0).abs() < 1e-9);
        assert_eq!(z.pick(0.0), 0);
        assert_eq!(z.pick(0.999_999_999), 15);
        // Draws follow the probabilities.
        let mut hits = [0u32; 16];
        for i in 0..100_000 {
            hits[z.pick(i as f64 / 100_000.0)] += 1;
        }
        for (k, h) in hits.iter().enumerate() {
            let expected = z.probability(k) * 100_000.0;
            assert!(
                (*h as f64 - expected).abs() <= 2.0,
                "rank {k}: {h} vs {expected}"
            );
        }
    }

    #[test]
    fn routes_follow_their_weights() {
        let mut lists = 0;
        let mut orders = 0;
        for i in 0..1000 {
            match Route::pick(i as f64 / 1000.0) {
                Route::List => lists += 1,
                Route::Order(id) => {
                    assert!((1..=3).contains(&id));
                    orders += 1
                }
                Route::Item(id) => assert!((1..=3).contains(&id)),
            }
        }
        assert_eq!((lists, orders), (600, 100));
    }

    #[test]
    fn client_addresses_are_distinct_loopback_and_clear_of_nginx() {
        let mut seen = std::collections::HashSet::new();
        for n in 0..(254 * 254) {
            let a = client_address(n);
            assert!(a.is_loopback());
            assert!(matches!(a, IpAddr::V4(v4) if v4.octets()[1] != 0), "{a}");
            assert!(seen.insert(a), "{a} twice");
        }
    }

    #[test]
    fn each_cause_sends_from_its_own_addresses_and_agent() {
        use crate::scenario::Cause;
        let addresses = |cause| {
            let c = SurgeClient::of(cause);
            (0..24)
                .map(|n| c.address(n))
                .collect::<std::collections::BTreeSet<_>>()
        };
        assert_eq!(addresses(Cause::Tenant).len(), 1);
        assert_eq!(addresses(Cause::Partner).len(), 3);
        assert_eq!(addresses(Cause::ClientBug).len(), 24);
        assert_eq!(
            addresses(Cause::Proxy).into_iter().collect::<Vec<_>>(),
            [PROXY_ADDRESS]
        );
        // None is nginx's own address, which the instances trust.
        for cause in [
            Cause::Tenant,
            Cause::ClientBug,
            Cause::Proxy,
            Cause::Partner,
        ] {
            assert!(!addresses(cause).contains(&IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2))));
        }
        let agents: std::collections::BTreeSet<_> = [
            Cause::Tenant,
            Cause::ClientBug,
            Cause::Proxy,
            Cause::Partner,
        ]
        .map(|c| SurgeClient::of(c).user_agent)
        .into();
        assert_eq!(agents.len(), 4);
    }

    #[test]
    fn the_stack_config_names_its_partner() {
        let config =
            std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../config/stack.toml"));
        assert_eq!(partner(config).unwrap().as_deref(), Some("tenant-01"));
        let tenants = tenants(config).unwrap();
        assert!(tenants.iter().any(|t| t.id == "tenant-01"));
    }

    proptest! {
        #[test]
        fn a_latency_quantile_is_within_3_percent_above(samples in proptest::collection::vec(0u64..50_000_000, 1..300), q in 0.0f64..=1.0) {
            let h = Latency::default();
            for s in &samples {
                h.record(*s);
            }
            let mut sorted = samples.clone();
            sorted.sort_unstable();
            let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
            let exact = sorted[rank - 1];
            let got = h.quantile(q).unwrap();
            prop_assert!(got >= exact, "{got} < {exact}");
            prop_assert!(got as f64 <= exact as f64 * (1.0 + 1.0 / 32.0) + 1.0, "{got} vs {exact}");
        }
    }
}
