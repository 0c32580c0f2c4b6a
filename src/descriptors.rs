//! Descriptor rules: which policy limits a request to Envoy's rate limit
//! service, by its domain and descriptor entries. Plain data, built by
//! [`crate::config`], read by the [`crate::limiter`]; the gRPC side is
//! [`crate::rls`].
//!
//! The matching is envoy ratelimit's: a descriptor's entries are walked
//! in order down its domain's tree; at each level an entry matches a rule
//! with its key and value first, else a rule with its key and no value
//! (any value). The rule reached by the last entry names the policy; a
//! descriptor that leaves the tree early, or ends on a rule without a
//! policy, is not limited. The bucket is the domain and every entry, so a
//! rule without a value keeps one bucket per value.

use std::collections::HashMap;
use std::fmt;

/// A `[[rls.domains]]` entry, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Domain {
    /// The domain Envoy's filter sends.
    pub name: String,
    /// Its top-level rules.
    pub descriptors: Vec<Rule>,
}

/// One descriptor rule, validated: `key`, optionally `value`, the policy
/// a descriptor ending here gets, and the rules for a next entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// The entry's key.
    pub key: String,
    /// The entry's value (`None`: any value, a bucket per value).
    pub value: Option<String>,
    /// The policy's name (`None`: only its nested rules limit).
    pub policy: Option<String>,
    /// Rules for the next entry.
    pub descriptors: Vec<Rule>,
}

/// One descriptor as a request names it: its domain and entries. What a
/// bucket of a descriptor rule is keyed by.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DescriptorId {
    /// The domain.
    pub domain: Box<str>,
    /// The entries, (key, value), in order.
    pub entries: Box<[(Box<str>, Box<str>)]>,
}

impl fmt::Display for DescriptorId {
    /// `demo api_key=V path=/login`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.domain)?;
        for (key, value) in &self.entries {
            write!(f, " {key}={value}")?;
        }
        Ok(())
    }
}

/// The rules of every domain, with each policy resolved to its place in
/// one generation's policies.
#[derive(Debug, Clone, Default)]
pub struct DescriptorRules {
    domains: HashMap<String, Level>,
}

/// The rules one entry is matched against, by key.
#[derive(Debug, Clone, Default)]
struct Level {
    by_key: HashMap<String, Keyed>,
}

/// The rules of one key: by value, and for any value.
#[derive(Debug, Clone, Default)]
struct Keyed {
    by_value: HashMap<String, Node>,
    any: Option<Node>,
}

#[derive(Debug, Clone, Default)]
struct Node {
    policy: Option<usize>,
    next: Level,
}

impl DescriptorRules {
    /// The rules of `domains`, each policy name looked up with `position`
    /// (`Policies::named`); a name not found (validation keeps that from
    /// happening) limits nothing.
    pub fn new(domains: &[Domain], position: impl Fn(&str) -> Option<usize>) -> Self {
        fn level(rules: &[Rule], position: &dyn Fn(&str) -> Option<usize>) -> Level {
            let mut out = Level::default();
            for rule in rules {
                let node = Node {
                    policy: rule.policy.as_deref().and_then(position),
                    next: level(&rule.descriptors, position),
                };
                let keyed = out.by_key.entry(rule.key.clone()).or_default();
                match &rule.value {
                    Some(value) => {
                        keyed.by_value.insert(value.clone(), node);
                    }
                    None => keyed.any = Some(node),
                }
            }
            out
        }
        Self {
            domains: domains
                .iter()
                .map(|d| (d.name.clone(), level(&d.descriptors, &position)))
                .collect(),
        }
    }

    /// The position of the policy limiting a descriptor of `entries`
    /// (key, value) in `domain`, if one does.
    pub fn find<'a>(
        &self,
        domain: &str,
        entries: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Option<usize> {
        let mut level = self.domains.get(domain)?;
        let mut reached = None;
        for (key, value) in entries {
            let keyed = level.by_key.get(key)?;
            let node = keyed.by_value.get(value).or(keyed.any.as_ref())?;
            reached = Some(node);
            level = &node.next;
        }
        reached?.policy
    }

    /// Whether any domain has rules.
    pub fn is_empty(&self) -> bool {
        self.domains.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::policy::Policies;

    fn rules(toml: &str) -> (DescriptorRules, Policies) {
        let config = Config::from_toml(toml).unwrap();
        let policies = Policies::new(&config.policies, config.failover.mode);
        (
            DescriptorRules::new(&config.rls.domains, |name| policies.named(name)),
            policies,
        )
    }

    const RULES: &str = r#"
        [[policies]]
        name = "per-key"
        burst = 100
        rate = 10

        [[policies]]
        name = "partner"
        burst = 1000
        rate = 100

        [[policies]]
        name = "login"
        burst = 5
        rate = 1

        [[policies]]
        name = "login-per-address"
        burst = 2
        rate = 1

        [[rls.domains]]
        domain = "demo"

        [[rls.domains.descriptors]]
        key = "api_key"
        policy = "per-key"

        [[rls.domains.descriptors]]
        key = "api_key"
        value = "partner"
        policy = "partner"

        [[rls.domains.descriptors]]
        key = "path"
        value = "/login"
        policy = "login"

        [[rls.domains.descriptors.descriptors]]
        key = "remote_address"
        policy = "login-per-address"

        [[rls.domains.descriptors]]
        key = "tenant"

        [[rls.domains.descriptors.descriptors]]
        key = "api_key"
        policy = "per-key"
    "#;

    fn name(found: Option<usize>, policies: &Policies) -> Option<String> {
        found.map(|i| policies.get(i).name.to_string())
    }

    #[test]
    fn a_value_rule_wins_over_its_keys_rule_and_a_key_rule_takes_any_value() {
        let (rules, policies) = rules(RULES);
        let find =
            |entries: &[(&str, &str)]| name(rules.find("demo", entries.iter().copied()), &policies);
        assert_eq!(find(&[("api_key", "a")]).as_deref(), Some("per-key"));
        assert_eq!(find(&[("api_key", "partner")]).as_deref(), Some("partner"));
        assert_eq!(find(&[("path", "/login")]).as_deref(), Some("login"));
        assert_eq!(
            find(&[("path", "/login"), ("remote_address", "192.0.2.1")]).as_deref(),
            Some("login-per-address")
        );
        assert_eq!(
            find(&[("tenant", "t1"), ("api_key", "k")]).as_deref(),
            Some("per-key")
        );
    }

    #[test]
    fn what_leaves_the_tree_or_ends_without_a_policy_is_not_limited() {
        let (rules, policies) = rules(RULES);
        let find = |domain: &str, entries: &[(&str, &str)]| {
            name(rules.find(domain, entries.iter().copied()), &policies)
        };
        // Another domain, an unknown key, a value with no rule and no
        // key rule, one entry too many, a rule with no policy of its own.
        assert_eq!(find("other", &[("api_key", "a")]), None);
        assert_eq!(find("demo", &[("user", "a")]), None);
        assert_eq!(find("demo", &[("path", "/other")]), None);
        assert_eq!(find("demo", &[("api_key", "a"), ("method", "GET")]), None);
        assert_eq!(find("demo", &[("tenant", "t1")]), None);
        assert_eq!(find("demo", &[]), None);
    }
}
