//! Which keys are hot: a bounded heavy-hitter detector over the keys this
//! instance checks, and the metrics that name them.
//!
//! A hot key concentrates load on one Redis slot, so on one node: the node's
//! CPU climbs, every check it serves slows down, and the limiter starts to
//! slow down the traffic it protects. Per-node metrics show *which node*;
//! this shows *which key*, and whom it belongs to.
//!
//! Every check the limiter sends down the store stack is offered to a
//! [`space_saving::SpaceSaving`] summary of fixed size (`hot_keys.tracked`),
//! together with whether the backend store itself was called (Redis, or
//! the memory store) rather than a fallback or a cache. Summaries cover
//! fixed windows (`hot_keys.window`); `/metrics` shows the last complete
//! one, so a scrape always reads a whole window and a key that cooled down
//! leaves the list after one window. Its top `hot_keys.top` keys are
//! exported as gauges, labelled with what an operator needs to act:
//!
//! - `policy` and `key_kind` (`api_key`, `ip`, `unknown_api_key`);
//! - `key`: the tenant id for API keys; for addresses `h:` and the first 8
//!   hex digits of the bucket key (which are also the start of its Redis
//!   key's hash tag), or with `hot_keys.addresses = "show"` the address;
//! - `slot` and `node`: the bucket's cluster slot and the node serving it
//!   now (`memory` for the in-process backend);
//!
//! and valued with its checks per second, its store calls per second, and
//! its share of this instance's calls to that node. These labels name keys
//! and addresses on purpose, the one exception to the rule that labels never
//! do: at most `top` series per metric per instance, replaced as the
//! traffic changes (the series are rendered at scrape time, not kept by the
//! metrics recorder, so a key that left the list leaves `/metrics` too).
//!
//! Rates are Space-Saving's guaranteed lower bounds (`count - error`): the
//! detector may miss a little of a key's traffic, never blame a key for
//! traffic it did not send. Store calls are counted from the moment the
//! key was tracked, so they are lower bounds too.

pub mod space_saving;
#[cfg(test)]
mod tests;

use crate::clock::Micros;
use crate::identity::Identity;
use crate::key::{BucketKey, BuildKeyBits, KeyKind, SLOTS};
use crate::metrics as m;
use serde::{Deserialize, Serialize};
use space_saving::SpaceSaving;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How a hot address is shown in the `key` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AddressDisplay {
    /// The address itself (an IPv6 client as its prefix): an opt-in, for a
    /// drill or an incident where the operator may see client addresses.
    Show,
    /// `h:` and the first 8 hex digits of the bucket key: the default, so
    /// that no client address reaches the metrics unless asked for.
    #[default]
    Hash,
}

/// The detector's settings (`[hot_keys]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HotKeySettings {
    /// Keys tracked at once (0: no detection).
    pub tracked: usize,
    /// Keys exported.
    pub top: usize,
    /// The length of one summary.
    pub window: Duration,
    /// How addresses are shown.
    pub addresses: AddressDisplay,
}

/// What is kept beside a tracked key.
#[derive(Debug, Clone)]
struct Meta {
    policy: Arc<str>,
    kind: KeyKind,
    identity: Identity,
    store_calls: u64,
}

/// One window's summary.
#[derive(Debug)]
struct Window {
    started: Micros,
    /// Bucket keys are keyed hashes: the index uses their bits.
    keys: SpaceSaving<BucketKey, Meta, BuildKeyBits>,
    /// Store calls per slot, to divide a key's calls by its node's (one
    /// count for every key when the store has one node).
    slot_calls: Box<[u32]>,
}

impl Window {
    fn new(started: Micros, tracked: usize, slots: usize) -> Self {
        Self {
            started,
            keys: SpaceSaving::new(tracked),
            slot_calls: vec![0; slots].into_boxed_slice(),
        }
    }

    fn clear(&mut self, started: Micros) {
        self.started = started;
        self.keys.clear();
        self.slot_calls.fill(0);
    }
}

#[derive(Debug)]
struct Windows {
    current: Window,
    /// The last complete window (empty if nothing was checked in it).
    last: Window,
}

/// The detector. Shared by every request; one short lock per check.
#[derive(Debug)]
pub struct HotKeys {
    settings: HotKeySettings,
    /// Whether keys are counted by Redis Cluster slot (else all on one
    /// node).
    slotted: bool,
    window_us: Micros,
    windows: Mutex<Windows>,
}

/// One exported key.
#[derive(Debug, Clone, PartialEq)]
pub struct HotKey {
    /// The policy.
    pub policy: Arc<str>,
    /// How the client was identified.
    pub kind: KeyKind,
    /// The `key` label.
    pub display: String,
    /// The bucket.
    pub key: BucketKey,
    /// Checks per second (a lower bound).
    pub checks_per_second: f64,
    /// Calls to the backend store per second (a lower bound).
    pub store_calls_per_second: f64,
    /// Its share of this instance's store calls to its node.
    pub node_share: f64,
    /// The node serving its slot.
    pub node: Arc<str>,
}

impl HotKeys {
    /// A detector with `settings`, counting store calls by Redis Cluster
    /// slot; `None` when `tracked` is 0.
    pub fn new(settings: HotKeySettings) -> Option<Self> {
        Self::counting(settings, true)
    }

    /// A detector for a store on one node (`Store::one_node`: the
    /// in-process one, or a standalone Redis): a key's share is of all the
    /// store's calls, and no check computes its key's slot (a CRC16 over
    /// its 32 hex digits, on every check, for a label that cannot differ).
    /// The node a key is reported on is still the store's owner of its
    /// slot (the standalone server's address, or "memory"). `None` when
    /// `tracked` is 0.
    pub fn on_one_node(settings: HotKeySettings) -> Option<Self> {
        Self::counting(settings, false)
    }

    fn counting(settings: HotKeySettings, slotted: bool) -> Option<Self> {
        if settings.tracked == 0 {
            return None;
        }
        let window_us = u64::try_from(settings.window.as_micros())
            .unwrap_or(u64::MAX)
            .max(1);
        let slots = if slotted { SLOTS } else { 1 };
        Some(Self {
            settings,
            slotted,
            window_us,
            windows: Mutex::new(Windows {
                current: Window::new(0, settings.tracked, slots),
                last: Window::new(0, settings.tracked, slots),
            }),
        })
    }

    /// The settings it runs with.
    pub fn settings(&self) -> HotKeySettings {
        self.settings
    }

    /// Whether it counts store calls by Redis Cluster slot (a store on
    /// several nodes) rather than all together (one node).
    pub fn counts_slots(&self) -> bool {
        self.slotted
    }

    /// Counts one check of `key` at `now`; `store_call`: the backend store
    /// decided it (not a fallback or a cache).
    pub fn record(
        &self,
        now: Micros,
        key: BucketKey,
        policy: &Arc<str>,
        kind: KeyKind,
        identity: &Identity,
        store_call: bool,
    ) {
        // A std Mutex: nothing awaits while it is held, and the work inside
        // is a hash lookup (a scan of `tracked` counts for a new key).
        let mut windows = self
            .windows
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.rotate(&mut windows, now);
        let window = &mut windows.current;
        let entry = window.keys.offer(key, 1, || Meta {
            policy: Arc::clone(policy),
            kind,
            identity: identity.clone(),
            store_calls: 0,
        });
        if store_call {
            entry.value.store_calls += 1;
            let slot = if self.slotted { key.slot() } else { 0 };
            let slot = &mut window.slot_calls[usize::from(slot)];
            *slot = slot.saturating_add(1);
        }
    }

    /// Moves to the window holding `now`: the current one becomes the last
    /// complete one, or, if a whole window passed with no checks, an empty
    /// one does.
    fn rotate(&self, windows: &mut Windows, now: Micros) {
        let started = windows.current.started;
        if now < started.saturating_add(self.window_us) {
            return;
        }
        if started == 0 && windows.current.keys.total() == 0 {
            // The first check: windows start here.
            windows.current.started = now;
            return;
        }
        let passed = (now - started) / self.window_us;
        std::mem::swap(&mut windows.current, &mut windows.last);
        let current_start = started + passed * self.window_us;
        windows.current.clear(current_start);
        if passed >= 2 {
            windows.last.clear(current_start - self.window_us);
        }
    }

    /// The top keys of the last complete window before `now`, each with
    /// the node `owner` says serves its slot (`None`: the in-process store).
    pub fn top(&self, now: Micros, owner: &dyn Fn(u16) -> Option<Arc<str>>) -> Vec<HotKey> {
        let (entries, slot_calls) = {
            let mut windows = self
                .windows
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            self.rotate(&mut windows, now);
            let last = &windows.last;
            let entries: Vec<_> = last
                .keys
                .top(self.settings.top)
                .into_iter()
                .filter(|e| e.guaranteed() > 0)
                .map(|e| (e.key, e.guaranteed(), e.value.clone()))
                .collect();
            let slot_calls: Vec<(u16, u64)> = if entries.is_empty() {
                Vec::new()
            } else {
                (0..SLOTS as u16)
                    .zip(last.slot_calls.iter())
                    .filter(|(_, n)| **n > 0)
                    .map(|(slot, n)| (slot, u64::from(*n)))
                    .collect()
            };
            (entries, slot_calls)
        };
        // Outside the lock: the owner lookups read the slot map.
        let memory: Arc<str> = Arc::from("memory");
        let node_of = |slot: u16| owner(slot).unwrap_or_else(|| Arc::clone(&memory));
        let mut node_calls: HashMap<Arc<str>, u64> = HashMap::new();
        for (slot, n) in slot_calls {
            *node_calls.entry(node_of(slot)).or_default() += n;
        }
        let seconds = self.window_us as f64 / 1e6;
        entries
            .into_iter()
            .map(|(key, checks, meta)| {
                let node = node_of(key.slot());
                let on_node = node_calls.get(&node).copied().unwrap_or(0);
                HotKey {
                    display: self.display(key, &meta.identity),
                    policy: meta.policy,
                    kind: meta.kind,
                    key,
                    checks_per_second: checks as f64 / seconds,
                    store_calls_per_second: meta.store_calls as f64 / seconds,
                    node_share: if on_node == 0 {
                        0.0
                    } else {
                        meta.store_calls as f64 / on_node as f64
                    },
                    node,
                }
            })
            .collect()
    }

    fn display(&self, key: BucketKey, identity: &Identity) -> String {
        match (identity, self.settings.addresses) {
            (Identity::ApiKey(id), _) => id.to_string(),
            (Identity::Ip(ip), AddressDisplay::Show) => ip.to_string(),
            (Identity::Ip(_), AddressDisplay::Hash) => format!("h:{}", &key.to_string()[..8]),
            // A value is whatever a client sent, of any length: a label
            // keeps its start.
            (Identity::Descriptor(d), AddressDisplay::Show) => shortened(d.to_string()),
            // Descriptor values are often addresses or user ids (Envoy's
            // `remote_address`): the domain and keys, the values hashed.
            (Identity::Descriptor(d), AddressDisplay::Hash) => {
                let mut shown = d.domain.to_string();
                for (k, _) in &d.entries {
                    shown.push(' ');
                    shown.push_str(k);
                }
                format!("{shown} h:{}", &key.to_string()[..8])
            }
        }
    }

    /// The top keys in the Prometheus text format, to append to `/metrics`.
    pub fn render(&self, now: Micros, owner: &dyn Fn(u16) -> Option<Arc<str>>) -> String {
        render(&self.top(now, owner))
    }
}

/// The longest descriptor shown in a label, in bytes.
const MAX_SHOWN: usize = 128;

/// `text` cut to [`MAX_SHOWN`] bytes (at a character), marked if cut.
fn shortened(mut text: String) -> String {
    if text.len() > MAX_SHOWN {
        let mut end = MAX_SHOWN;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    text
}

/// A gauge of the hot keys: its name, help text and value.
type Gauge = (&'static str, &'static str, fn(&HotKey) -> f64);

/// `keys` as three gauges in the Prometheus text format.
pub fn render(keys: &[HotKey]) -> String {
    let mut out = String::new();
    let series: [Gauge; 3] = [
        (
            m::HOT_KEY_CHECKS_PER_SECOND,
            "Checks per second of this instance's hottest keys in the last complete window (a lower bound)",
            |k| k.checks_per_second,
        ),
        (
            m::HOT_KEY_STORE_CALLS_PER_SECOND,
            "Backend store calls per second of the hottest keys (a lower bound)",
            |k| k.store_calls_per_second,
        ),
        (
            m::HOT_KEY_NODE_SHARE,
            "A hot key's share of this instance's store calls to its node",
            |k| k.node_share,
        ),
    ];
    for (name, help, value) in series {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} gauge");
        for key in keys {
            let _ = writeln!(
                out,
                "{name}{{policy=\"{}\",key_kind=\"{}\",key=\"{}\",slot=\"{}\",node=\"{}\"}} {}",
                escape(&key.policy),
                key.kind.as_str(),
                escape(&key.display),
                key.key.slot(),
                escape(&key.node),
                value(key),
            );
        }
    }
    out
}

/// A label value as the text format writes it.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
