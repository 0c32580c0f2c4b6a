//! A Redis Cluster, reached the way a check needs: one of our pipelined
//! connections ([`Pipe`]) per node, each call sent to the master our slot
//! map ([`Topology`]) names for its key, redirects followed.
//!
//! Why not the redis crate's cluster connection for checks: one driver task
//! serves every node, and when a call fails it stops serving all of them
//! while it re-reads the slot map. A master that dies then stalls the
//! checks of the healthy masters too, and each failed call starts another
//! re-read until the replica is promoted (seconds): every key fell back to
//! the local share, not only the dead master's (docs/failover.md,
//! "A cluster's own faults"). Here a node is one connection: a dead master
//! fails its own calls, and the others' checks go on as before.
//!
//! What the cluster asks of a client, kept:
//! - `MOVED slot host:port`: the slot has a new owner for good; the call
//!   goes there and the slot map is re-read now;
//! - `ASK slot host:port`: the slot is being migrated and this key is
//!   already on the target; the call goes there once, after `ASKING`, and
//!   the map stays;
//! - `NOSCRIPT`: the node has not loaded the script (a promoted replica, a
//!   slot's new owner, `SCRIPT FLUSH`): it is loaded on that node, and the
//!   call sent again;
//! - `TRYAGAIN` (a multi-key call during a migration): sent again after a
//!   millisecond.
//!
//! Everything else goes through the redis crate's cluster connection, kept
//! beside for what is not a check (the naive store's commands, tests).

use super::pipe::{Pipe, PipeSettings};
use super::resp::{Command, decode};
use super::topology::Topology;
use bytes::Bytes;
use redis::{ConnectionAddr, ErrorKind, RedisError, RedisResult, Script, ServerErrorKind};
use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

/// Redirects, script loads and retries one call may take before its last
/// error is its answer: a MOVED then an ASK then a NOSCRIPT is the most a
/// migration under a flush asks for.
const HOPS: usize = 4;

/// Our connections to a cluster's nodes, made as the nodes are first
/// called. See the module docs.
#[derive(Debug)]
pub struct Nodes {
    /// The first seed's settings: each node's are these with its address.
    template: PipeSettings,
    /// The seeds, `host:port`, as given: asked for the slot map when no
    /// node of the map answers.
    seeds: Vec<Arc<str>>,
    pipes: RwLock<HashMap<Arc<str>, Pipe>>,
}

impl Nodes {
    /// Connections to the cluster that `seeds` (with their settings) are
    /// nodes of; none is opened yet.
    pub fn new(seeds: Vec<(Arc<str>, PipeSettings)>) -> Option<Self> {
        let template = seeds.first()?.1.clone();
        let pipes = seeds
            .iter()
            .map(|(label, settings)| (Arc::clone(label), Pipe::new(settings.clone())))
            .collect();
        Some(Self {
            template,
            seeds: seeds.into_iter().map(|(label, _)| label).collect(),
            pipes: RwLock::new(pipes),
        })
    }

    /// The seeds, `host:port`.
    pub fn seeds(&self) -> &[Arc<str>] {
        &self.seeds
    }

    /// The connection to `node` (`host:port`), made now if it is new.
    pub fn pipe(&self, node: &str) -> RedisResult<Pipe> {
        if let Some(pipe) = self
            .pipes
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(node)
        {
            return Ok(pipe.clone());
        }
        let (host, port) = split_address(node)?;
        let addr = match self.template.info.addr() {
            ConnectionAddr::TcpTls {
                insecure,
                tls_params,
                ..
            } => ConnectionAddr::TcpTls {
                host: host.to_owned(),
                port,
                insecure: *insecure,
                tls_params: tls_params.clone(),
            },
            _ => ConnectionAddr::Tcp(host.to_owned(), port),
        };
        let settings = PipeSettings {
            info: self.template.info.clone().set_addr(addr),
            ..self.template.clone()
        };
        let mut pipes = self.pipes.write().unwrap_or_else(PoisonError::into_inner);
        Ok(pipes
            .entry(Arc::from(node))
            .or_insert_with(|| Pipe::new(settings))
            .clone())
    }

    /// Sends `command` to the master of `slot` (`None`: any node) as
    /// `topology` has it, following redirects; with `script`, a NOSCRIPT
    /// loads it on the node that said so. Returns the reply frame, never
    /// an error reply (that is the error).
    pub async fn call(
        &self,
        topology: &Topology,
        slot: Option<u16>,
        command: &impl Command,
        script: Option<&Script>,
    ) -> RedisResult<Bytes> {
        let mut node: Arc<str> = match slot {
            Some(slot) => Arc::clone(&topology.owner(slot).label),
            None => Arc::clone(&self.seeds[0]),
        };
        if &*node == "unknown" {
            // The map is not read yet: a seed redirects us if need be.
            node = Arc::clone(&self.seeds[0]);
        }
        let mut asking = false;
        let mut loaded = false;
        let mut last = None;
        for _ in 0..HOPS {
            let pipe = self.pipe(&node)?;
            let frame = if asking {
                let mut both = redis::pipe();
                both.cmd("ASKING").add_command(command.cmd().into_owned());
                match pipe.call_many(&both, 0, 2).await {
                    // ASKING refused (an ACL without it): that is the answer.
                    Ok(frames) if frames.first().is_some_and(|f| f.first() == Some(&b'-')) => {
                        return Err(decode(&frames[0]).expect_err("an error reply"));
                    }
                    Ok(mut frames) => Ok(frames.pop().unwrap_or_default()),
                    Err(e) => Err(e),
                }
            } else {
                pipe.call(command).await
            };
            let frame = match frame {
                Ok(frame) if frame.first() != Some(&b'-') => return Ok(frame),
                Ok(frame) => frame,
                Err(e) => {
                    // The node may be gone: its slots may have a new owner.
                    topology.stale();
                    return Err(e);
                }
            };
            let error = match decode(&frame) {
                Err(e) => e,
                Ok(_) => return Ok(frame),
            };
            match error.kind() {
                ErrorKind::Server(ServerErrorKind::Moved) => {
                    topology.stale();
                    node = redirect(&error, &node)?;
                    asking = false;
                }
                ErrorKind::Server(ServerErrorKind::Ask) => {
                    node = redirect(&error, &node)?;
                    asking = true;
                }
                ErrorKind::Server(ServerErrorKind::NoScript) if !loaded => {
                    let Some(script) = script else {
                        return Err(error);
                    };
                    script.load_async(&mut pipe.clone()).await?;
                    loaded = true;
                }
                ErrorKind::Server(ServerErrorKind::TryAgain) => {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                _ => return Err(error),
            }
            last = Some(error);
        }
        Err(last.expect("at least one hop"))
    }
}

/// The node a MOVED or ASK names; an empty host is the node that said so.
fn redirect(error: &RedisError, from: &str) -> RedisResult<Arc<str>> {
    let Some((address, _slot)) = error.redirect_node() else {
        return Err(error.clone());
    };
    let (host, port) = split_address(address)?;
    if host.is_empty() || host == "?" {
        let (from_host, _) = split_address(from)?;
        return Ok(Arc::from(format!("{from_host}:{port}")));
    }
    Ok(Arc::from(address))
}

/// `host:port` (or `[v6]:port`) as its host and port.
fn split_address(address: &str) -> RedisResult<(&str, u16)> {
    address
        .rsplit_once(':')
        .and_then(|(host, port)| {
            let host = host.trim_start_matches('[').trim_end_matches(']');
            Some((host, port.parse().ok()?))
        })
        .ok_or_else(|| {
            RedisError::from((ErrorKind::Client, "not a node address", address.to_owned()))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_addresses_split_into_host_and_port() {
        assert_eq!(split_address("10.0.0.7:6379").unwrap(), ("10.0.0.7", 6379));
        assert_eq!(split_address("[::1]:7000").unwrap(), ("::1", 7000));
        assert_eq!(split_address("redis-1:6379").unwrap(), ("redis-1", 6379));
        assert!(split_address("redis-1").is_err());
        assert!(split_address("redis-1:port").is_err());
    }

    #[test]
    fn a_redirect_names_its_node_or_keeps_the_host() {
        let moved = |detail: &str| {
            let frame = format!("-MOVED {detail}\r\n");
            decode(frame.as_bytes()).unwrap_err()
        };
        let to = redirect(&moved("3999 127.0.0.1:7002"), "127.0.0.1:7000").unwrap();
        assert_eq!(&*to, "127.0.0.1:7002");
        // Redis 7 sends an empty host when it does not know its own.
        let to = redirect(&moved("3999 :7002"), "10.1.2.3:7000").unwrap();
        assert_eq!(&*to, "10.1.2.3:7002");
        let other = decode(b"-ERR nope\r\n").unwrap_err();
        assert!(redirect(&other, "127.0.0.1:7000").is_err());
    }
}
