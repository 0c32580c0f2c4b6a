//! Real processes for load runs: a redis-server and K API instances, each
//! on a free loopback port, all killed when dropped.

use anyhow::{Context, bail};
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child process killed and reaped on drop.
#[derive(Debug)]
pub struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A free port on 127.0.0.1.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn wait_for_port(port: u16, what: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    bail!("{what} on 127.0.0.1:{port} did not come up in 20 s")
}

/// A scratch directory removed on drop.
#[derive(Debug)]
pub struct ScratchDir(pub PathBuf);

impl ScratchDir {
    /// A new, empty directory under the system temp dir.
    pub fn new(tag: &str) -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(format!("rl-loadtest-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A redis-server started for this run (no persistence), which fault
/// scenarios can kill, restart on the same port (empty, as a server without
/// persistence comes back), pause and resume.
#[derive(Debug)]
pub struct Redis {
    /// `redis://127.0.0.1:<port>`.
    pub url: String,
    /// Its port.
    pub port: u16,
    child: Option<Killed>,
    cpu: Option<usize>,
    dir: ScratchDir,
}

impl Redis {
    /// Starts `redis-server` from PATH on a free port.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_on(None)
    }

    /// Starts `redis-server`, pinned to `cpu` (through `taskset`) if given.
    pub fn start_on(cpu: Option<usize>) -> anyhow::Result<Self> {
        let dir = ScratchDir::new("redis")?;
        let port = free_port()?;
        let mut redis = Self {
            url: format!("redis://127.0.0.1:{port}"),
            port,
            child: None,
            cpu,
            dir,
        };
        redis.spawn()?;
        Ok(redis)
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        let mut command = match self.cpu {
            Some(cpu) => {
                let mut c = Command::new("taskset");
                c.args(["-c", &cpu.to_string(), "redis-server"]);
                c
            }
            None => Command::new("redis-server"),
        };
        let child = command
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir.0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("cannot start redis-server (Debian: apt-get install redis-server), or pass --redis-url")?;
        self.child = Some(Killed(child));
        wait_for_port(self.port, "redis-server")
    }

    fn signal(&self, signal: Signal) -> anyhow::Result<()> {
        let child = self.child.as_ref().context("redis-server is not running")?;
        let pid = Pid::from_raw(i32::try_from(child.0.id())?);
        nix::sys::signal::kill(pid, signal)?;
        Ok(())
    }

    /// SIGKILL: the server vanishes with its data; connections are reset.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        // Dropping `Killed` sends SIGKILL and reaps the process.
        self.child.take().context("redis-server is not running")?;
        Ok(())
    }

    /// Starts a fresh, empty server on the same port.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        anyhow::ensure!(self.child.is_none(), "redis-server is still running");
        self.spawn()
    }

    /// SIGSTOP: the server hangs; connections stay open, nothing answers.
    pub fn pause(&self) -> anyhow::Result<()> {
        self.signal(Signal::SIGSTOP)
    }

    /// SIGCONT: the hung server carries on with what queued up.
    pub fn resume(&self) -> anyhow::Result<()> {
        self.signal(Signal::SIGCONT)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        // A stopped process still dies of SIGKILL, but resume anyway so
        // nothing lingers in the stopped state if the kill were refused.
        let _ = self.resume();
    }
}

/// K API instances: this executable re-run as `loadtest instance ...`,
/// which runs exactly what the `ratelimiter` binary runs.
#[derive(Debug)]
pub struct Instances {
    /// Base URLs, `http://127.0.0.1:<port>`.
    pub urls: Vec<String>,
    _children: Vec<Killed>,
}

impl Instances {
    /// Starts `count` instances with the given service flags, each with its
    /// own `--listen` and `--instance-id`, and waits until each answers.
    pub fn start(count: usize, flags: &[String]) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("cannot find this executable")?;
        let mut urls = Vec::with_capacity(count);
        let mut children = Vec::with_capacity(count);
        for i in 0..count {
            let port = free_port()?;
            let child = Command::new(&exe)
                .arg("instance")
                .args(["--listen", &format!("127.0.0.1:{port}")])
                .args(["--instance-id", &format!("load-{i}")])
                .args(flags)
                .env(
                    "RUST_LOG",
                    std::env::var("INSTANCE_LOG").unwrap_or_else(|_| "warn".into()),
                )
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .context("cannot start an API instance")?;
            children.push(Killed(child));
            wait_for_port(port, "API instance")?;
            urls.push(format!("http://127.0.0.1:{port}"));
        }
        Ok(Self {
            urls,
            _children: children,
        })
    }
}
