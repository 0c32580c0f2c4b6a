//! A small TCP proxy that misbehaves on demand: added latency, or a black
//! hole (bytes accepted and held, nothing delivered, as when a firewall
//! drops packets and TCP keeps retransmitting). Put between the service and
//! Redis, it shows what a slow or unreachable Redis does to requests without
//! touching either process.
//!
//! Each direction of each connection is two tasks: a reader that stamps
//! every chunk with the instant it arrived, and a writer that forwards it no
//! earlier than `arrival + latency` and not at all while the hole is open.
//! Pipelined commands therefore each get the added latency once (a reader
//! that slept per chunk would add it up), and bytes are never dropped or
//! reordered, so the Redis protocol stream survives the fault.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

#[derive(Debug, Default)]
struct Faults {
    latency_us: AtomicU64,
    blackhole: AtomicBool,
}

/// The proxy; stops accepting (and drops its connections) when dropped.
#[derive(Debug)]
pub struct FaultProxy {
    /// Where clients connect.
    pub addr: SocketAddr,
    faults: Arc<Faults>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on a free 127.0.0.1 port and forwards to `upstream`.
    pub async fn start(upstream: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let faults = Arc::new(Faults::default());
        let shared = Arc::clone(&faults);
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                let faults = Arc::clone(&shared);
                connections.spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    tokio::join!(
                        pump(client_read, server_write, Arc::clone(&faults)),
                        pump(server_read, client_write, faults),
                    );
                });
            }
        });
        Ok(Self { addr, faults, task })
    }

    /// `redis://` URL of the proxy.
    pub fn redis_url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// Adds `latency` to every chunk, each way (zero: none).
    pub fn set_latency(&self, latency: Duration) {
        let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        self.faults.latency_us.store(us, Ordering::Relaxed);
    }

    /// Holds every byte while `on` (a black hole); releases them when off.
    pub fn set_blackhole(&self, on: bool) {
        self.faults.blackhole.store(on, Ordering::Relaxed);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        // Aborting the accept loop drops its JoinSet, which aborts every
        // connection's pumps.
        self.task.abort();
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    faults: Arc<Faults>,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let reader = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.send((Instant::now(), buf[..n].to_vec())).is_err() {
                        break;
                    }
                }
            }
        }
    };
    let writer = async move {
        while let Some((arrived, chunk)) = rx.recv().await {
            while faults.blackhole.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let latency = Duration::from_micros(faults.latency_us.load(Ordering::Relaxed));
            wait_until(arrived + latency).await;
            if to.write_all(&chunk).await.is_err() {
                break;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(reader, writer);
}

/// Sleeps until `deadline`, precisely: tokio's timer ticks in whole
/// milliseconds, which would turn 0.25 ms into up to 1 ms (and 0 into a
/// tick's wait), so the last stretch sleeps on a blocking thread (the OS's
/// high-resolution timer), and a deadline already past costs nothing.
async fn wait_until(deadline: Instant) {
    const COARSE: Duration = Duration::from_millis(2);
    if deadline.saturating_duration_since(Instant::now()) > COARSE {
        tokio::time::sleep_until(deadline - COARSE).await;
    }
    let rest = deadline.saturating_duration_since(Instant::now());
    if !rest.is_zero() {
        let _ = tokio::task::spawn_blocking(move || std::thread::sleep(rest)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server behind the proxy: bytes arrive intact and in order,
    /// late by the latency, and not at all while the hole is open.
    #[tokio::test]
    async fn delays_and_holds_without_losing_bytes() {
        let echo = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = echo.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = echo.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            loop {
                let n = s.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                s.write_all(&buf[..n]).await.unwrap();
            }
        });
        let proxy = FaultProxy::start(upstream).await.unwrap();
        let mut c = TcpStream::connect(proxy.addr).await.unwrap();
        let mut got = [0u8; 5];

        c.write_all(b"hello").await.unwrap();
        c.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"hello");

        proxy.set_latency(Duration::from_millis(40));
        let started = std::time::Instant::now();
        c.write_all(b"world").await.unwrap();
        c.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"world");
        // Both directions: at least twice the latency (a lower bound only;
        // an upper bound would be a timing assertion on a shared machine).
        assert!(started.elapsed() >= Duration::from_millis(80));
        proxy.set_latency(Duration::ZERO);

        proxy.set_blackhole(true);
        c.write_all(b"held!").await.unwrap();
        let waited = tokio::time::timeout(Duration::from_millis(200), c.read_exact(&mut got)).await;
        assert!(waited.is_err(), "nothing gets through a black hole");
        proxy.set_blackhole(false);
        c.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"held!", "and nothing is lost in it");
    }
}
