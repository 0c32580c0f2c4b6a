//! Ports, child processes and scratch directories.

use anyhow::{Context, bail};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Child;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Ports this process has handed out, never handed out again. Between
/// asking the kernel for a free port and a server binding it, a test on
/// another thread could be given the same port (the kernel picks one at
/// random from the ephemeral range): the second server then fails to bind,
/// and the first answers both tests. A CI run saw exactly that.
static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

/// Marks all of `ports` handed out, or none if any of them already was.
fn hand_out(ports: impl Iterator<Item = u16> + Clone) -> bool {
    let mut handed = HANDED_OUT.lock().unwrap_or_else(PoisonError::into_inner);
    if ports.clone().any(|p| handed.contains(&p)) {
        return false;
    }
    handed.extend(ports);
    true
}

fn kernel_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// A free TCP port on 127.0.0.1: free when asked, never returned twice by
/// this process (so two tests cannot be given the same one), and below the
/// kernel's ephemeral range where there is room, for the reason
/// [`free_port_block`] gives: a port the kernel just freed from that range
/// can become the local port of another test's outgoing connection before
/// the server binds it, and the server then fails to start.
pub fn free_port() -> anyhow::Result<u16> {
    free_port_block(1, false)
}

/// The cluster bus of a Redis Cluster node listens this far above its port.
pub const CLUSTER_BUS_OFFSET: u16 = 10_000;

/// The lowest port of the kernel's ephemeral range
/// (`net.ipv4.ip_local_port_range`), from which it picks the local port of
/// every outgoing connection.
fn ephemeral_low() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// `n` consecutive free ports; with `cluster_bus`, their bus ports
/// (`CLUSTER_BUS_OFFSET` above) are free and in range too, as a Redis
/// Cluster node needs. None of them is handed out twice.
///
/// The block is below the kernel's ephemeral range where there is room:
/// a whole stack binds its block one server after another, while the
/// servers already up connect to each other, and an outgoing connection
/// takes its local port from the ephemeral range: it could take a port of
/// the block before its server binds it (a stack's nginx, started last,
/// failing to listen).
pub fn free_port_block(n: u16, cluster_bus: bool) -> anyhow::Result<u16> {
    use std::hash::{BuildHasher, Hasher};
    let bus = if cluster_bus { CLUSTER_BUS_OFFSET } else { 0 };
    let free = |port: u16| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok();
    // Bases from 10000 such that the block and its bus ports end below
    // the ephemeral range.
    let room = ephemeral_low()
        .checked_sub(10_000 + n + bus)
        .filter(|&room| room > 0);
    for attempt in 0..1000 {
        let base = match room {
            // A random base: another process's tests pick theirs too.
            Some(room) if attempt < 500 => {
                let random = std::collections::hash_map::RandomState::new()
                    .build_hasher()
                    .finish();
                10_000 + u16::try_from(random % u64::from(room)).unwrap_or(0)
            }
            _ => kernel_port()?,
        };
        let in_range = base.checked_add(n - 1).and_then(|top| top.checked_add(bus));
        if in_range.is_none() {
            continue;
        }
        let block = base..base + n;
        let buses = block.clone().filter(|_| bus != 0).map(|p| p + bus);
        if block
            .clone()
            .all(|p| free(p) && (bus == 0 || free(p + bus)))
            && hand_out(block.chain(buses))
        {
            return Ok(base);
        }
    }
    bail!("no block of {n} free ports found")
}

/// Waits (up to 20 s) until something accepts connections on `port`.
pub fn wait_for_port(port: u16, what: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    bail!("{what} on 127.0.0.1:{port} did not come up in 20 s")
}

/// Waits (up to 20 s) until `child` itself listens on `port`, failing at
/// once if it exits. Something answering on the port is not enough: it
/// could be another server that took the port first while this one failed
/// to bind it, and a test would then pause, kill or count the wrong one.
pub fn wait_for_listener(child: &mut ChildGuard, port: u16, what: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = child.0.try_wait()? {
            bail!("{what} exited ({status}) before it listened on 127.0.0.1:{port}");
        }
        if listens(child.pid(), port)? {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("{what} did not listen on 127.0.0.1:{port} in 20 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether process `pid` holds a listening TCP socket on `port`: the
/// socket inodes listening on the port (/proc/<pid>/net/tcp and tcp6, its
/// network namespace) against the sockets among its open files.
fn listens(pid: u32, port: u16) -> anyhow::Result<bool> {
    let mut inodes = BTreeSet::new();
    for table in ["tcp", "tcp6"] {
        let path = format!("/proc/{pid}/net/{table}");
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue; // no IPv6, or the process is gone
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(&"0A"), Some(inode)) =
                (fields.get(1), fields.get(3), fields.get(9))
            else {
                continue; // 0A: LISTEN
            };
            let local_port = local.rsplit_once(':').map(|(_, p)| p);
            if local_port.and_then(|p| u16::from_str_radix(p, 16).ok()) == Some(port) {
                inodes.insert(format!("socket:[{inode}]"));
            }
        }
    }
    if inodes.is_empty() {
        return Ok(false);
    }
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .with_context(|| format!("cannot list the open files of process {pid}"))?;
    Ok(fds.flatten().any(|fd| {
        std::fs::read_link(fd.path())
            .is_ok_and(|target| inodes.contains(target.to_string_lossy().as_ref()))
    }))
}

/// A child process killed (SIGKILL) and reaped on drop.
#[derive(Debug)]
pub struct ChildGuard(pub Child);

impl ChildGuard {
    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A scratch directory removed on drop, unique within this process.
#[derive(Debug)]
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// A new, empty directory under the system temp dir.
    pub fn new(tag: &str) -> anyhow::Result<Self> {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("rl-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }

    /// A path inside it.
    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block and its bus ports end below the ephemeral range (where an
    /// outgoing connection could take one), each port free when handed
    /// out, and never handed out twice.
    #[test]
    fn port_blocks_stay_below_the_ephemeral_range() {
        let low = ephemeral_low();
        let mut seen = BTreeSet::new();
        for _ in 0..20 {
            let base = free_port_block(18, true).unwrap();
            assert!(base >= 10_000, "{base}");
            assert!(base + 17 + CLUSTER_BUS_OFFSET < low, "{base} against {low}");
            for port in base..base + 18 {
                assert!(seen.insert(port), "{port} handed out twice");
            }
        }
    }
}
