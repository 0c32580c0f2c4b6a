//! `[rls]`: where Envoy's rate limit service listens, and its descriptor
//! rules, each naming a policy that exists.

use super::invalid;
use crate::config::file::{DescriptorFile, RlsFile};
use crate::config::{ConfigError, RlsConfig};
use crate::descriptors::{Domain, Rule};
use crate::policy::Policy;

/// Envoy's filter's domains and descriptor entries are short: a longer
/// value in the file is a mistake, not a rule.
const MAX_TEXT: usize = 256;

fn text(field: &str, value: &str, may_be_empty: bool) -> Result<(), ConfigError> {
    if value.is_empty() && !may_be_empty {
        return Err(invalid(field, "must not be empty"));
    }
    if value.len() > MAX_TEXT || value.chars().any(char::is_control) {
        return Err(invalid(
            field,
            format!("must be at most {MAX_TEXT} bytes with no control characters"),
        ));
    }
    Ok(())
}

pub(in crate::config) fn rls(s: RlsFile, policies: &[Policy]) -> Result<RlsConfig, ConfigError> {
    let listen = s
        .listen
        .map(|l| {
            l.parse()
                .map_err(|_| invalid("rls.listen", format!("{l:?} is not an address:port")))
        })
        .transpose()?;
    if s.max_message_bytes < 1024 {
        return Err(invalid(
            "rls.max_message_bytes",
            "must be at least 1024: a request of a few descriptors must fit",
        ));
    }
    let mut domains: Vec<Domain> = Vec::with_capacity(s.domains.len());
    for (i, d) in s.domains.into_iter().enumerate() {
        let field = format!("rls.domains[{i}]");
        text(&format!("{field}.domain"), &d.domain, false)?;
        if domains.iter().any(|o| o.name == d.domain) {
            return Err(invalid(
                format!("{field}.domain"),
                format!("duplicate domain {:?}", d.domain),
            ));
        }
        domains.push(Domain {
            name: d.domain,
            descriptors: rules(&format!("{field}.descriptors"), d.descriptors, policies)?,
        });
    }
    Ok(RlsConfig {
        listen,
        max_message_bytes: s.max_message_bytes,
        domains,
    })
}

/// The rules of one level, `field` naming the list.
fn rules(
    field: &str,
    list: Vec<DescriptorFile>,
    policies: &[Policy],
) -> Result<Vec<Rule>, ConfigError> {
    let mut out: Vec<Rule> = Vec::with_capacity(list.len());
    for (j, d) in list.into_iter().enumerate() {
        let field = format!("{field}[{j}]");
        text(&format!("{field}.key"), &d.key, false)?;
        if let Some(value) = &d.value {
            text(&format!("{field}.value"), value, true)?;
        }
        if out.iter().any(|o| o.key == d.key && o.value == d.value) {
            return Err(invalid(
                &field,
                format!(
                    "a second rule for key {:?}{}",
                    d.key,
                    d.value
                        .as_ref()
                        .map(|v| format!(" and value {v:?}"))
                        .unwrap_or_else(|| " with any value".into())
                ),
            ));
        }
        if let Some(name) = &d.policy
            && !policies.iter().any(|p| &p.name == name)
        {
            return Err(invalid(
                format!("{field}.policy"),
                format!("no policy is named {name:?}"),
            ));
        }
        if d.policy.is_none() && d.descriptors.is_empty() {
            return Err(invalid(
                &field,
                "limits nothing: name a policy, or nest descriptors that do",
            ));
        }
        out.push(Rule {
            key: d.key,
            value: d.value,
            policy: d.policy,
            descriptors: rules(&format!("{field}.descriptors"), d.descriptors, policies)?,
        });
    }
    Ok(out)
}
