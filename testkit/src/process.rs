//! Ports, child processes and scratch directories.

use anyhow::bail;
use std::path::PathBuf;
use std::process::Child;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// A free TCP port on 127.0.0.1 (free when asked; good enough for a server
/// started on it right away).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The cluster bus of a Redis Cluster node listens this far above its port.
pub const CLUSTER_BUS_OFFSET: u16 = 10_000;

/// `n` consecutive free ports; with `cluster_bus`, their bus ports
/// (`CLUSTER_BUS_OFFSET` above) are free and in range too, as a Redis
/// Cluster node needs: an ephemeral port above 55535 has no bus port, and
/// the node refuses to start on it.
pub fn free_port_block(n: u16, cluster_bus: bool) -> anyhow::Result<u16> {
    let bus = if cluster_bus { CLUSTER_BUS_OFFSET } else { 0 };
    let free = |port: u16| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok();
    for _ in 0..1000 {
        let base = free_port()?;
        let in_range = base.checked_add(n - 1).and_then(|top| top.checked_add(bus));
        if in_range.is_none() {
            continue;
        }
        if (base..base + n).all(|p| free(p) && (bus == 0 || free(p + bus))) {
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
