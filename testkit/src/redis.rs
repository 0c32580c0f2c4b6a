//! `redis-server` processes: standalone, or three masters made a cluster
//! (`RedisCluster::start_replicated` gives each a replica, for failover),
//! over plain TCP or TLS only.

use crate::cgroup::CpuLimit;
use crate::process::{ChildGuard, TempDir, free_port, wait_for_listener};
use crate::tls::TestCerts;
use anyhow::{Context, bail, ensure};
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A real `redis-server` on a loopback port, persistence off, in a scratch
/// directory; killed on drop. Fault scenarios can kill it, restart it on
/// the same port (empty, as a server without persistence comes back),
/// pause and resume it, and cap its CPU.
#[derive(Debug)]
pub struct RedisServer {
    /// Its port on 127.0.0.1.
    pub port: u16,
    // Field order is drop order: the process dies before its cgroup and
    // its directory go.
    child: Option<ChildGuard>,
    cpu_limit: Option<CpuLimit>,
    pin: Option<usize>,
    extra: Vec<String>,
    tls: Option<ServerTls>,
    dir: TempDir,
}

/// How a TLS-only server is started and how redis-cli reaches it.
#[derive(Debug, Clone)]
struct ServerTls {
    /// `--tls-port`, the certificate, key and CA, client certificates.
    server_args: Vec<String>,
    /// redis-cli's `--tls --cacert ...` (and a client certificate).
    cli_args: Vec<String>,
}

impl ServerTls {
    fn new(certs: &TestCerts, client_auth: bool) -> Self {
        let path = |p: &std::path::Path| p.display().to_string();
        let mut server_args = vec![
            "--tls-cert-file".into(),
            path(&certs.server_cert),
            "--tls-key-file".into(),
            path(&certs.server_key),
            "--tls-ca-cert-file".into(),
            path(&certs.ca),
            "--tls-auth-clients".into(),
            if client_auth { "yes" } else { "no" }.into(),
        ];
        // A cluster's bus and replication speak TLS too (harmless alone).
        server_args.extend(["--tls-cluster", "yes", "--tls-replication", "yes"].map(String::from));
        let mut cli_args = vec!["--tls".into(), "--cacert".into(), path(&certs.ca)];
        if client_auth {
            cli_args.extend([
                "--cert".into(),
                path(&certs.client_cert),
                "--key".into(),
                path(&certs.client_key),
            ]);
        }
        Self {
            server_args,
            cli_args,
        }
    }
}

impl RedisServer {
    /// On a free port.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with(&[])
    }

    /// On a free port, with extra server arguments.
    pub fn start_with(extra: &[&str]) -> anyhow::Result<Self> {
        Self::on_a_free_port(|port| Self::start_on(port, extra))
    }

    /// `start` on a free port, again on another if the server could not
    /// listen: a port free when handed out can be taken before the server
    /// binds it (an outgoing connection's ephemeral port, another process's
    /// test), and a test must not fail for that.
    fn on_a_free_port(start: impl Fn(u16) -> anyhow::Result<Self>) -> anyhow::Result<Self> {
        let mut last = None;
        for _ in 0..3 {
            match start(free_port()?) {
                Ok(server) => return Ok(server),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("three attempts")).context("redis-server on a free port, three times")
    }

    /// On a given port (a test that has pointed a service at it already).
    pub fn start_on(port: u16, extra: &[&str]) -> anyhow::Result<Self> {
        Self::launch(port, extra, None)
    }

    /// On a free port, pinned to one CPU with `taskset` (so a benchmark's
    /// client and server do not share a core).
    pub fn start_pinned(cpu: usize) -> anyhow::Result<Self> {
        Self::on_a_free_port(|port| Self::launch(port, &[], Some(cpu)))
    }

    /// On a free port that speaks TLS only (`rediss://`), with `certs`'
    /// server certificate; with `client_auth`, clients must show one the
    /// CA signed. redis-cli ([`RedisServer::cli`]) speaks TLS to it.
    pub fn start_tls(certs: &TestCerts, client_auth: bool, extra: &[&str]) -> anyhow::Result<Self> {
        Self::on_a_free_port(|port| {
            Self::launch_tls(port, extra, Some(ServerTls::new(certs, client_auth)))
        })
    }

    fn launch(port: u16, extra: &[&str], pin: Option<usize>) -> anyhow::Result<Self> {
        let mut server = Self::new(port, extra, pin, None)?;
        server.spawn()?;
        Ok(server)
    }

    fn launch_tls(port: u16, extra: &[&str], tls: Option<ServerTls>) -> anyhow::Result<Self> {
        let mut server = Self::new(port, extra, None, tls)?;
        server.spawn()?;
        Ok(server)
    }

    fn new(
        port: u16,
        extra: &[&str],
        pin: Option<usize>,
        tls: Option<ServerTls>,
    ) -> anyhow::Result<Self> {
        Ok(Self {
            port,
            child: None,
            cpu_limit: None,
            pin,
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
            tls,
            dir: TempDir::new(&format!("redis-{port}"))?,
        })
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        let mut command = match self.pin {
            Some(cpu) => {
                let mut c = Command::new("taskset");
                c.args(["-c", &cpu.to_string(), "redis-server"]);
                c
            }
            None => Command::new("redis-server"),
        };
        let port = self.port.to_string();
        match &self.tls {
            None => command.args(["--port", &port]),
            // The plaintext port off: nothing reaches it without TLS.
            Some(tls) => command
                .args(["--port", "0", "--tls-port", &port])
                .args(&tls.server_args),
        };
        let child = command
            .args(["--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir.0)
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("cannot start redis-server (Debian: apt-get install redis-server)")?;
        let mut child = ChildGuard(child);
        if let Some(limit) = &self.cpu_limit {
            limit.add(child.pid())?;
        }
        let listening = wait_for_listener(&mut child, self.port, "redis-server");
        self.child = Some(child);
        listening
    }

    /// `redis://127.0.0.1:<port>` (`rediss://` if it speaks TLS).
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(ChildGuard::pid)
    }

    /// Runs a redis-cli command against this server (over TLS if it speaks
    /// TLS); its output. Options such as `--user` may precede the command.
    pub fn cli(&self, args: &[&str]) -> anyhow::Result<String> {
        let tls = self.tls.as_ref().map_or(&[][..], |t| &t.cli_args[..]);
        let mut all: Vec<&str> = tls.iter().map(String::as_str).collect();
        all.extend(args);
        redis_cli(self.port, &all)
    }

    fn signal(&self, signal: Signal) -> anyhow::Result<()> {
        let pid = self.pid().context("redis-server is not running")?;
        nix::sys::signal::kill(Pid::from_raw(i32::try_from(pid)?), signal)?;
        Ok(())
    }

    /// SIGKILL: the server vanishes with its data; connections are reset.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        // Dropping the guard sends SIGKILL and reaps the process.
        self.child.take().context("redis-server is not running")?;
        Ok(())
    }

    /// Starts a fresh, empty server on the same port (under the same CPU
    /// limit, if any).
    pub fn restart(&mut self) -> anyhow::Result<()> {
        ensure!(self.child.is_none(), "redis-server is still running");
        self.spawn()
    }

    /// SIGSTOP: the server hangs; connections stay open, nothing answers.
    pub fn pause(&self) -> anyhow::Result<()> {
        self.signal(Signal::SIGSTOP)?;
        // kill(2) returns once the signal is sent, not once the server has
        // stopped: until the kernel says so, a command sent next could
        // still be answered (a test saw it). Wait for the stopped state.
        let pid = self.pid().context("redis-server is not running")?;
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
            let state = stat
                .rsplit_once(") ")
                .and_then(|(_, rest)| rest.chars().next());
            if state == Some('T') {
                return Ok(());
            }
            ensure!(Instant::now() < deadline, "redis-server {pid} did not stop");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// SIGCONT: the hung server carries on with what queued up.
    pub fn resume(&self) -> anyhow::Result<()> {
        self.signal(Signal::SIGCONT)
    }

    /// Caps the server at `cores` of CPU time (0.25: a quarter of one core),
    /// through a cgroup of its own; a restart stays under it.
    pub fn limit_cpu(&mut self, cores: f64) -> anyhow::Result<()> {
        let limit = CpuLimit::new(&format!("redis-{}", self.port), cores)?;
        self.cap(limit)
    }

    /// Caps the server at `cores` of CPU time in periods of `period_us`.
    pub fn limit_cpu_with_period(&mut self, cores: f64, period_us: u64) -> anyhow::Result<()> {
        let limit = CpuLimit::with_period(&format!("redis-{}", self.port), cores, period_us)?;
        self.cap(limit)
    }

    /// Caps the server as the stacks cap a Redis node: `cores` of CPU time
    /// in periods of `period_us`, every thread kept on CPU `cpu` (where a
    /// capped process that moves between CPUs is held back in periods it
    /// has barely used: docs/stack.md).
    pub fn limit_cpu_pinned(
        &mut self,
        cores: f64,
        period_us: u64,
        cpu: usize,
    ) -> anyhow::Result<()> {
        self.limit_cpu_with_period(cores, period_us)?;
        let pid = self.pid().context("redis-server is not running")?;
        let status = std::process::Command::new("taskset")
            .args(["-a", "-p", "-c", &cpu.to_string(), &pid.to_string()])
            .stdout(std::process::Stdio::null())
            .status()
            .context("cannot run taskset (util-linux)")?;
        anyhow::ensure!(status.success(), "taskset could not pin {pid} to CPU {cpu}");
        Ok(())
    }

    /// Puts the server under `limit`.
    fn cap(&mut self, limit: CpuLimit) -> anyhow::Result<()> {
        let pid = self.pid().context("redis-server is not running")?;
        limit.add(pid)?;
        self.cpu_limit = Some(limit);
        Ok(())
    }

    /// The CPU limit set by [`RedisServer::limit_cpu`], if any.
    pub fn cpu_limit(&self) -> Option<&CpuLimit> {
        self.cpu_limit.as_ref()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // A stopped process still dies of SIGKILL, but resume anyway so
        // nothing lingers in the stopped state if the kill were refused.
        if self.child.is_some() {
            let _ = self.resume();
        }
    }
}

/// Runs `redis-cli -p port args...`; its output, or an error with its stderr.
pub fn redis_cli(port: u16, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .context("cannot run redis-cli (Debian: apt-get install redis-tools)")?;
    if !out.status.success() {
        bail!(
            "redis-cli {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A 3-master Redis Cluster on loopback, made with `redis-cli --cluster
/// create`, ready (`cluster_state:ok` on every node) when returned.
#[derive(Debug)]
pub struct RedisCluster {
    /// The masters.
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// On free ports (their cluster bus ports free and in range too).
    pub fn start() -> anyhow::Result<Self> {
        let base = crate::process::free_port_block(3, true)?;
        Self::start_on([base, base + 1, base + 2])
    }

    /// On given ports.
    pub fn start_on(ports: [u16; 3]) -> anyhow::Result<Self> {
        Self::launch(&ports, 0, None, &[])
    }

    /// Three masters with a replica each, as people run a cluster, on free
    /// ports: `nodes[0..3]` are the masters, `nodes[3..6]` the replicas,
    /// each in sync with its master when returned. `extra` goes to every
    /// node (a shorter `--cluster-node-timeout` makes a failover quicker).
    pub fn start_replicated(extra: &[&str]) -> anyhow::Result<Self> {
        let base = crate::process::free_port_block(6, true)?;
        let ports: Vec<u16> = (0..6).map(|i| base + i).collect();
        Self::launch(&ports, 1, None, extra)
    }

    /// On free ports, speaking TLS only: to clients, and between nodes.
    pub fn start_tls(certs: &TestCerts) -> anyhow::Result<Self> {
        let base = crate::process::free_port_block(3, true)?;
        Self::launch(
            &[base, base + 1, base + 2],
            0,
            Some(ServerTls::new(certs, false)),
            &[],
        )
    }

    fn launch(
        ports: &[u16],
        replicas: usize,
        tls: Option<ServerTls>,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        let mut args = vec!["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"];
        args.extend(extra);
        let nodes = ports
            .iter()
            .map(|&port| RedisServer::launch_tls(port, &args, tls.clone()))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let addresses: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let mut args = vec!["--cluster", "create"];
        args.extend(addresses.iter().map(String::as_str));
        let replicas_arg = replicas.to_string();
        args.extend(["--cluster-replicas", &replicas_arg, "--cluster-yes"]);
        nodes[0].cli(&args)?;
        // Wait until every node agrees the cluster is up.
        let deadline = Instant::now() + Duration::from_secs(20);
        for node in &nodes {
            while !node.cli(&["cluster", "info"])?.contains("cluster_state:ok") {
                ensure!(
                    Instant::now() < deadline,
                    "the cluster did not converge in 20 s"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let cluster = Self { nodes };
        // redis-cli makes the first `ports.len() / (replicas + 1)` nodes
        // the masters; each replica has its copy before a test kills one.
        let masters = ports.len() / (replicas + 1);
        for replica in &cluster.nodes[masters..] {
            while !replica
                .cli(&["info", "replication"])?
                .contains("master_link_status:up")
            {
                ensure!(
                    Instant::now() < deadline,
                    "replica {} did not sync in 20 s",
                    replica.port
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(cluster)
    }

    /// Kills master `i` (SIGKILL) and returns when other nodes serve the
    /// slots it served (one in 512 looked at) and the survivors agree the
    /// cluster is ok: its replica was promoted. Returns how long that took.
    pub fn kill_master(&mut self, i: usize) -> anyhow::Result<Duration> {
        let slots: Vec<u16> = (0..16384u16)
            .step_by(512)
            .filter(|&s| self.owner(s).ok() == Some(i))
            .collect();
        ensure!(!slots.is_empty(), "node {i} serves no slot");
        self.nodes[i].kill()?;
        let killed = Instant::now();
        let deadline = killed + Duration::from_secs(30);
        loop {
            let moved = slots
                .iter()
                .all(|&s| matches!(self.owner(s), Ok(owner) if owner != i));
            let ok = self
                .nodes
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .all(|(_, n)| {
                    n.cli(&["cluster", "info"])
                        .is_ok_and(|info| info.contains("cluster_state:ok"))
                });
            if moved && ok {
                return Ok(killed.elapsed());
            }
            ensure!(
                Instant::now() < deadline,
                "node {i}'s slots were not failed over in 30 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The nodes' `redis://` URLs (seeds for a cluster client).
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// Node `i`'s cluster id.
    pub fn node_id(&self, i: usize) -> anyhow::Result<String> {
        Ok(self.nodes[i].cli(&["cluster", "myid"])?.trim().to_owned())
    }

    /// The slot `key` hashes to, as the cluster computes it.
    pub fn keyslot(&self, key: &str) -> anyhow::Result<u16> {
        Ok(self.nodes[0]
            .cli(&["cluster", "keyslot", key])?
            .trim()
            .parse()?)
    }

    /// The index of the node that serves `slot`.
    pub fn owner(&self, slot: u16) -> anyhow::Result<usize> {
        for (i, node) in self.nodes.iter().enumerate() {
            if node.pid().is_none() {
                continue; // killed
            }
            // Each node's own view of what it serves.
            let nodes = node.cli(&["cluster", "nodes"])?;
            let me = nodes
                .lines()
                .find(|l| l.contains("myself"))
                .context("CLUSTER NODES without myself")?;
            if serves(me, slot) {
                return Ok(i);
            }
        }
        bail!("no node serves slot {slot}")
    }

    /// Moves `slot` and its keys to node `to`, as `redis-cli --cluster
    /// reshard` does: importing/migrating, MIGRATE the keys, then every node
    /// told the new owner. Returns when every node agrees.
    pub fn move_slot(&self, slot: u16, to: usize) -> anyhow::Result<()> {
        let from = self.owner(slot)?;
        ensure!(from != to, "node {to} already serves slot {slot}");
        let (from_id, to_id) = (self.node_id(from)?, self.node_id(to)?);
        let slot_arg = slot.to_string();
        self.nodes[to].cli(&["cluster", "setslot", &slot_arg, "importing", &from_id])?;
        self.nodes[from].cli(&["cluster", "setslot", &slot_arg, "migrating", &to_id])?;
        loop {
            let keys = self.nodes[from].cli(&["cluster", "getkeysinslot", &slot_arg, "100"])?;
            let keys: Vec<&str> = keys.split_whitespace().collect();
            if keys.is_empty() {
                break;
            }
            let port = self.nodes[to].port.to_string();
            let mut args = vec!["migrate", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
            args.extend(keys);
            self.nodes[from].cli(&args)?;
        }
        for node in &self.nodes {
            node.cli(&["cluster", "setslot", &slot_arg, "node", &to_id])?;
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.owner(slot)? != to {
            ensure!(
                Instant::now() < deadline,
                "slot {slot} did not move in 20 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }
}

/// Whether a `CLUSTER NODES` line serves `slot` (ranges `a-b` or single
/// slots after the eighth field).
fn serves(line: &str, slot: u16) -> bool {
    line.split_whitespace().skip(8).any(|range| {
        let mut bounds = range.splitn(2, '-').map(str::parse::<u16>);
        match (bounds.next(), bounds.next()) {
            (Some(Ok(a)), Some(Ok(b))) => (a..=b).contains(&slot),
            (Some(Ok(a)), None) => a == slot,
            _ => false,
        }
    })
}
