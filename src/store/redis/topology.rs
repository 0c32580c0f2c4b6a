//! Which Redis node serves a key: the `node` label of every per-node metric
//! and the `server.address` of every Redis span.
//!
//! A standalone server is its URL's `host:port`. In a cluster, a key lives
//! in the slot its hash tag hashes to (CRC16 mod 16384, [`slot`]), and a
//! slot on the master the cluster's slot map names: this keeps a copy of
//! that map (`CLUSTER SLOTS`), re-read every `topology_refresh` and at once
//! after a call fails for a cluster reason (a slot moved), so the label
//! follows a slot that moves. A hot node then shows as one line apart from
//! the others, whichever keys made it hot.

use super::cluster::Nodes;
use crate::key::BucketKey;
use crate::metrics::Handles;
use metrics::{Counter, Histogram};
use redis::{ConnectionAddr, IntoConnectionInfo, Value};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;
use tokio::sync::Notify;

/// Slots in a Redis Cluster.
pub const SLOTS: usize = crate::key::SLOTS;

/// A node, as labels and span attributes name it, with its metric
/// handles.
#[derive(Debug)]
pub struct Node {
    /// `host:port`.
    pub label: Arc<str>,
    /// The host.
    pub host: Arc<str>,
    /// The port.
    pub port: u16,
    /// Its series, by script (`ratelimit_redis_call_duration_seconds`) and
    /// by error kind (`ratelimit_redis_errors_total`), kept: a call then
    /// looks up one static name, not the recorder's registry with a label
    /// vector built for it (see [`crate::metrics::Handles`]).
    pub(super) durations: Handles<&'static str, Histogram>,
    pub(super) errors: Handles<&'static str, Counter>,
}

impl PartialEq for Node {
    fn eq(&self, other: &Self) -> bool {
        (&self.label, &self.host, self.port) == (&other.label, &other.host, other.port)
    }
}

impl Eq for Node {}

impl Node {
    fn new(host: &str, port: u16) -> Self {
        Self::named(Arc::from(format!("{host}:{port}")), Arc::from(host), port)
    }

    fn named(label: Arc<str>, host: Arc<str>, port: u16) -> Self {
        Self {
            label,
            host,
            port,
            durations: Handles::default(),
            errors: Handles::default(),
        }
    }

    /// Before the slot map is known (the cluster has not answered yet).
    pub(super) fn unknown() -> Self {
        Self::named(Arc::from("unknown"), Arc::from("unknown"), 0)
    }
}

/// The cluster slot of `key`: the CRC16 of its hash tag (the first
/// `{...}` with something inside) or of the whole key, mod 16384.
pub fn slot(key: &[u8]) -> u16 {
    let tagged = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(key);
    crate::key::cluster_slot(tagged)
}

/// Masters by slot.
#[derive(Debug)]
struct SlotMap {
    /// Index into `nodes` of each slot's master (`u16::MAX`: unassigned).
    owner: Box<[u16]>,
    nodes: Vec<Arc<Node>>,
}

impl SlotMap {
    fn empty() -> Self {
        Self {
            owner: vec![u16::MAX; SLOTS].into_boxed_slice(),
            nodes: Vec::new(),
        }
    }

    /// From a `CLUSTER SLOTS` reply: `[[start, end, [host, port, id, ...],
    /// replicas...], ...]`; the first address of each range is its master.
    fn parse(reply: &Value) -> Option<Self> {
        let Value::Array(ranges) = reply else {
            return None;
        };
        let mut map = Self::empty();
        for range in ranges {
            let Value::Array(fields) = range else {
                return None;
            };
            let int = |v: &Value| match v {
                Value::Int(n) => usize::try_from(*n).ok(),
                _ => None,
            };
            let (start, end) = (int(fields.first()?)?, int(fields.get(1)?)?);
            let Value::Array(master) = fields.get(2)? else {
                return None;
            };
            let host = match master.first()? {
                Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                Value::SimpleString(s) => s.clone(),
                _ => return None,
            };
            let port = u16::try_from(int(master.get(1)?)?).ok()?;
            let node = Node::new(&host, port);
            let index = match map.nodes.iter().position(|n| **n == node) {
                Some(i) => i,
                None => {
                    map.nodes.push(Arc::new(node));
                    map.nodes.len() - 1
                }
            };
            let index = u16::try_from(index).ok()?;
            if start > end || end >= SLOTS {
                return None;
            }
            map.owner[start..=end].fill(index);
        }
        Some(map)
    }

    fn same_as(&self, other: &SlotMap) -> bool {
        self.owner == other.owner
            && self.nodes.len() == other.nodes.len()
            && self.nodes.iter().zip(&other.nodes).all(|(a, b)| a == b)
    }
}

/// Where keys live. See the module docs.
#[derive(Debug)]
pub enum Topology {
    /// One server.
    Standalone(Arc<Node>),
    /// A cluster's slot map, kept fresh by a task.
    Cluster(ClusterMap),
}

/// A cluster's slot map and what refreshes it.
#[derive(Debug)]
pub struct ClusterMap {
    map: RwLock<Arc<SlotMap>>,
    unknown: Arc<Node>,
    stale: Notify,
}

impl Topology {
    /// The standalone server at `url`.
    pub fn standalone(url: &str) -> Self {
        let node = url
            .into_connection_info()
            .ok()
            .and_then(|info| match info.addr() {
                ConnectionAddr::Tcp(host, port) | ConnectionAddr::TcpTls { host, port, .. } => {
                    Some(Node::new(host, *port))
                }
                _ => None,
            })
            .unwrap_or_else(Node::unknown);
        Topology::Standalone(Arc::new(node))
    }

    /// A cluster reached through `nodes`; its slot map is read now and
    /// every `refresh` by a task that lives as long as the topology.
    pub fn cluster(nodes: Arc<Nodes>, refresh: Duration) -> Arc<Self> {
        let topology = Arc::new(Topology::Cluster(ClusterMap {
            map: RwLock::new(Arc::new(SlotMap::empty())),
            unknown: Arc::new(Node::unknown()),
            stale: Notify::new(),
        }));
        tokio::spawn(keep_fresh(Arc::downgrade(&topology), nodes, refresh));
        topology
    }

    /// The node serving `key`, and its slot in a cluster.
    pub fn node(&self, key: &[u8]) -> (Arc<Node>, Option<u16>) {
        match self {
            Topology::Standalone(node) => (Arc::clone(node), None),
            Topology::Cluster(_) => {
                let slot = slot(key);
                (self.owner(slot), Some(slot))
            }
        }
    }

    /// [`Topology::node`] of every Redis key of `bucket` (they share its
    /// hash tag, so its slot), without the key's name at hand.
    pub fn bucket_node(&self, bucket: BucketKey) -> (Arc<Node>, Option<u16>) {
        match self {
            Topology::Standalone(node) => (Arc::clone(node), None),
            Topology::Cluster(_) => {
                let slot = bucket.slot();
                (self.owner(slot), Some(slot))
            }
        }
    }

    /// The node serving `slot` (a standalone server serves every slot).
    pub fn owner(&self, slot: u16) -> Arc<Node> {
        match self {
            Topology::Standalone(node) => Arc::clone(node),
            Topology::Cluster(cluster) => {
                let map = cluster
                    .map
                    .read()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                map.owner
                    .get(usize::from(slot))
                    .and_then(|&at| map.nodes.get(usize::from(at)))
                    .map_or_else(|| Arc::clone(&cluster.unknown), Arc::clone)
            }
        }
    }

    /// The masters of the slot map, then `seeds` (whom to ask for the map,
    /// or whether the cluster answers at all), each once.
    pub fn nodes_or(&self, seeds: &[Arc<str>]) -> Vec<Arc<str>> {
        let mut nodes: Vec<Arc<str>> = match self {
            Topology::Standalone(node) => vec![Arc::clone(&node.label)],
            Topology::Cluster(cluster) => cluster
                .map
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .nodes
                .iter()
                .map(|n| Arc::clone(&n.label))
                .collect(),
        };
        for seed in seeds {
            if !nodes.contains(seed) {
                nodes.push(Arc::clone(seed));
            }
        }
        nodes
    }

    /// A call failed in a way that may mean a slot moved: re-read the map
    /// now rather than at the next refresh.
    pub fn stale(&self) {
        if let Topology::Cluster(cluster) = self {
            cluster.stale.notify_one();
        }
    }
}

/// Re-reads the slot map every `refresh` (or when told it is stale) until
/// the topology is dropped, asking the map's masters and then the seeds in
/// turn until one answers (a dead master costs an attempt, not the map).
async fn keep_fresh(topology: Weak<Topology>, nodes: Arc<Nodes>, refresh: Duration) {
    loop {
        let Some(strong) = topology.upgrade() else {
            return;
        };
        let Topology::Cluster(cluster) = &*strong else {
            return;
        };
        let mut fresh = None;
        for node in strong.nodes_or(nodes.seeds()) {
            let Ok(pipe) = nodes.pipe(&node) else {
                continue;
            };
            let reply = pipe
                .call(&redis::cmd("CLUSTER").arg("SLOTS").clone())
                .await
                .and_then(|frame| super::resp::decode(&frame));
            fresh = reply.ok().as_ref().and_then(SlotMap::parse);
            if fresh.is_some() {
                break;
            }
        }
        if let Some(fresh) = fresh {
            let mut map = cluster
                .map
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if !map.same_as(&fresh) {
                tracing::info!(nodes = fresh.nodes.len(), "redis cluster slot map changed");
                *map = Arc::new(fresh);
            }
        }
        // Wait for the next refresh without keeping the topology alive.
        let stale = async { cluster.stale.notified().await };
        tokio::select! {
            () = stale => {}
            () = tokio::time::sleep(refresh) => {}
        }
        drop(strong);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_redis_cluster_hashing() {
        // The reference value of the Redis Cluster specification:
        // CRC16 0x31C3, below 16384.
        assert_eq!(slot(b"123456789"), 12739);
        // Only the hash tag counts, so a bucket's keys share a slot.
        assert_eq!(slot(b"rl:{abc}"), slot(b"abc"));
        assert_eq!(slot(b"rl:gcra:{abc}"), slot(b"rl:{abc}"));
        // An empty tag is no tag.
        assert_eq!(slot(b"a{}b"), crate::key::cluster_slot(b"a{}b"));
    }

    #[test]
    fn the_slot_map_names_each_range_by_its_master() {
        let node = |port: i64| {
            Value::Array(vec![
                Value::BulkString(b"127.0.0.1".to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ])
        };
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                node(7000),
                node(7100),
            ]),
            Value::Array(vec![Value::Int(5461), Value::Int(16383), node(7001)]),
        ]);
        let map = SlotMap::parse(&reply).unwrap();
        let at = |slot: usize| map.nodes[usize::from(map.owner[slot])].label.to_string();
        assert_eq!(at(0), "127.0.0.1:7000");
        assert_eq!(at(5460), "127.0.0.1:7000");
        assert_eq!(at(5461), "127.0.0.1:7001");
        assert_eq!(map.nodes.len(), 2, "replicas are not nodes that serve");
        assert!(SlotMap::parse(&Value::Int(1)).is_none());
    }
}
