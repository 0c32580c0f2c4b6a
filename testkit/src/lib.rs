//! Real servers for the workspace's tests and load runs, started on free
//! loopback ports and stopped when dropped: what `tests/` and `loadtest`
//! share (redis-rs's `redis-test` and tower's `tower-test` are the model).
//!
//! - [`process`]: free ports, waiting for a listener, child processes
//!   killed and reaped on drop, scratch directories removed on drop;
//! - [`redis`]: `redis-server` standalone (kill, restart empty, pause,
//!   resume, a CPU limit) and a 3-master Redis Cluster;
//! - [`cgroup`]: a fraction of a core for a process (cgroup v1 `cpu`), as
//!   `cpus:` does in compose;
//! - [`fleet`]: N API instances as separate processes, and the hammer that
//!   sends one key's requests at them concurrently;
//! - [`otlp`]: a real OTLP trace receiver (gRPC and HTTP/protobuf) that
//!   keeps the spans it is sent;
//! - [`stack`]: the native stack (`scripts/stack`) on free ports, stopped
//!   on drop;
//! - [`tls`]: a test PKI made with `openssl` (a CA, server and client
//!   certificates), for `redis-server` over TLS.
//!
//! It does not depend on the service crate: it starts programs by path, so
//! the service's own tests and the load tool use it alike. Fakes of the
//! service's traits stay in the service crate's tests.
//!
//! Everything here needs the binaries (Debian: `redis-server`,
//! `redis-tools`, `openssl`); `scripts/test` installs them.

pub mod cgroup;
pub mod fleet;
pub mod otlp;
pub mod process;
pub mod redis;
pub mod stack;
pub mod tls;

pub use cgroup::CpuLimit;
pub use fleet::{Fleet, Tally, hammer};
pub use otlp::{OtlpReceiver, ReceivedSpan};
pub use process::{
    ChildGuard, TempDir, free_port, free_port_block, wait_for_listener, wait_for_port,
};
pub use redis::{RedisCluster, RedisServer, redis_cli};
pub use stack::NativeStack;
pub use tls::TestCerts;
