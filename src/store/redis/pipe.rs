//! Our own pipelined connection to a standalone Redis: the client side of
//! every check.
//!
//! A check is one small EVALSHA whose answer is one short bulk string. The
//! redis crate's multiplexed connection costs this process too much CPU
//! per check beside what the script costs Redis (the goal is in
//! docs/performance.md, "Redis checks over HTTP"): per call a boxed future
//! and a connection clone (`ConnectionManager`), an mpsc send to the driver
//! task and a oneshot back, a response timer, and a combinator parser
//! building a `Value`. Here a call locks a mutex, writes its command
//! straight into the bytes the driver will send, queues a oneshot and wakes
//! the driver only if it was idle; the driver writes whatever has queued in
//! as few writes as the socket takes (when more are likely on the way it
//! first lets the tasks ready to run queue theirs: see [`gather`]), cuts
//! the replies it reads into frames without parsing them (each frame a
//! slice of one read buffer), and hands each to the next caller in line.
//! The caller decodes its own frame: the check reads its bulk string in
//! place, anything else becomes a redis crate `Value`, so the rest of the
//! store (the naive store, readiness, script loads) keeps the redis
//! crate's types.
//!
//! What the redis crate's `ConnectionManager` did, kept:
//! - Lazy: the first call connects (TCP, TLS for `rediss://`, then AUTH
//!   and SELECT as the URL says), so the service starts while Redis is
//!   away; a failed connection is tried again `retries` times, 1 to 50 ms
//!   apart, and then again by a later call.
//! - A lost connection fails the calls on it and the next call reconnects.
//! - A call unanswered `response_timeout` after it was queued (sent or
//!   not: a write stuck behind a full socket counts; or after the
//!   connection was made, if it was queued while connecting, which the
//!   connect timeout bounds) fails as a timeout; the connection stays (a
//!   Redis that was only slow answers the calls after it), and its late
//!   reply, when it comes, is dropped. One
//!   timer serves the whole connection: replies come in order, so only the
//!   oldest call can be the next to time out.
//!
//! The bytes on the wire are [`super::resp`]'s.

use super::resp::{Command, decode, frame_len};
use super::tls::RedisTls;
use bytes::{Bytes, BytesMut};
use gather::Gather;
use redis::{
    Cmd, ConnectionAddr, ConnectionInfo, ErrorKind, Pipeline, RedisError, RedisFuture, RedisResult,
    Value,
};
use std::collections::VecDeque;
use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::time::{Instant, Sleep};

mod gather;

/// What a connection is opened to, and how long things may take.
#[derive(Debug, Clone)]
pub struct PipeSettings {
    /// The server, credentials and database (a parsed `redis://` or
    /// `rediss://` URL).
    pub info: ConnectionInfo,
    /// What TLS trusts and shows, for `rediss://`.
    pub tls: RedisTls,
    /// Time allowed to open a connection (TCP, TLS, AUTH and SELECT).
    pub connect_timeout: Duration,
    /// Time allowed for a call's answer, from when it was queued.
    pub response_timeout: Duration,
    /// Further connection attempts when one fails.
    pub retries: u32,
}

/// A pipelined connection; clones share it. See the module docs.
#[derive(Clone)]
pub struct Pipe {
    handle: Arc<Handle>,
}

impl std::fmt::Debug for Pipe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.handle.shared.lock();
        f.debug_struct("Pipe")
            .field("running", &state.running)
            .field("waiting", &state.waiting.len())
            .finish_non_exhaustive()
    }
}

/// Held by every [`Pipe`] clone; the last one dropped stops the driver.
struct Handle {
    shared: Arc<Shared>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state.closed = true;
        if let Some(driver) = state.driver.take() {
            driver.wake();
        }
    }
}

struct Shared {
    settings: PipeSettings,
    state: Mutex<State>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[derive(Default)]
struct State {
    /// Commands queued and not yet taken by the driver.
    out: Vec<u8>,
    /// One per call written or queued, oldest first: replies come in order.
    waiting: VecDeque<Waiter>,
    /// How many of `waiting` (the oldest) have timed out. Calls are queued
    /// in time order and time out in it, so these are a prefix: the timer
    /// looks past them, not through them, while a stalled Redis leaves
    /// their replies to come.
    expired: usize,
    /// The driver's waker, while it runs.
    driver: Option<Waker>,
    /// Whether a driver task runs (connecting or connected).
    running: bool,
    /// Every handle is gone.
    closed: bool,
}

/// A call waiting for its reply frames.
struct Waiter {
    /// Frames still to come for this call.
    left: usize,
    /// When it was queued: its response timeout runs from then, whether
    /// or not its command could be written yet.
    queued: Instant,
    /// Where the reply goes; `None` once the call has timed out (its
    /// frames are still read, then dropped).
    to: Option<Sink>,
}

enum Sink {
    One(oneshot::Sender<RedisResult<Bytes>>),
    Many(Vec<Bytes>, oneshot::Sender<RedisResult<Vec<Bytes>>>),
}

impl Sink {
    fn fail(self, error: RedisError) {
        // A receiver gone (its call dropped) needs no answer.
        match self {
            Sink::One(to) => drop(to.send(Err(error))),
            Sink::Many(_, to) => drop(to.send(Err(error))),
        }
    }
}

impl Pipe {
    /// A connection opened on first use. Must be called in a tokio
    /// runtime's context only when used.
    pub fn new(settings: PipeSettings) -> Self {
        Self {
            handle: Arc::new(Handle {
                shared: Arc::new(Shared {
                    settings,
                    state: Mutex::new(State::default()),
                }),
            }),
        }
    }

    /// The database the URL selects.
    pub fn db(&self) -> i64 {
        self.handle.shared.settings.info.redis_settings().db()
    }

    /// Sends `command` and returns its reply frame, undecoded (see
    /// [`super::resp::decode`]).
    pub async fn call(&self, command: &impl Command) -> RedisResult<Bytes> {
        let (to, reply) = oneshot::channel();
        self.queue(1, Sink::One(to), |out| command.write_resp(out));
        reply.await.unwrap_or_else(|_| Err(stopped()))
    }

    /// Sends the commands of `pipeline` and returns the reply frames of
    /// `count` of them after the first `offset` (a transaction's are its
    /// `EXEC`'s), as the redis crate's `req_packed_commands`.
    pub async fn call_many(
        &self,
        pipeline: &Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Bytes>> {
        let frames = offset + count;
        if frames == 0 {
            // Nothing to send (an empty pipeline): no reply will come.
            return Ok(Vec::new());
        }
        let (to, reply) = oneshot::channel();
        self.queue(frames, Sink::Many(Vec::with_capacity(frames), to), |out| {
            out.extend_from_slice(&pipeline.get_packed_pipeline())
        });
        let mut frames = reply.await.unwrap_or_else(|_| Err(stopped()))?;
        Ok(frames.split_off(offset.min(frames.len())))
    }

    fn queue(&self, frames: usize, to: Sink, write: impl FnOnce(&mut Vec<u8>)) {
        let shared = &self.handle.shared;
        let mut state = shared.lock();
        let was_idle = state.out.is_empty();
        write(&mut state.out);
        state.waiting.push_back(Waiter {
            left: frames,
            queued: Instant::now(),
            to: Some(to),
        });
        if state.running {
            if was_idle && let Some(driver) = &state.driver {
                driver.wake_by_ref();
            }
            return;
        }
        state.running = true;
        drop(state);
        // Spawned with the lock released and the `Stop` already made: if
        // the task is dropped unpolled (its runtime shutting down), or
        // there is no runtime to spawn on, `Stop` still runs, and the next
        // call starts a driver rather than wait for one that never ran.
        let stop = Stop {
            shared: Arc::clone(shared),
            error: None,
        };
        tokio::spawn(drive(stop));
    }
}

fn stopped() -> RedisError {
    RedisError::from(io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "redis connection task stopped",
    ))
}

/// The driver task: connects, then moves bytes until the connection fails
/// or every handle is gone, then fails whatever still waits.
async fn drive(mut stop: Stop) {
    let shared = Arc::clone(&stop.shared);
    stop.error = match connect(&shared.settings).await {
        Ok(stream) => {
            let mut connection = Connection::new(stream, shared.settings.response_timeout);
            poll_fn(|cx| connection.poll(&shared, cx)).await
        }
        Err(e) => Some(e),
    };
}

/// What a driver leaves behind, however it ends: with an error, because
/// every handle is gone, or dropped with its runtime. The calls still
/// waiting fail (rather than wait for a driver that is gone) and the next
/// call starts a new one.
struct Stop {
    shared: Arc<Shared>,
    error: Option<RedisError>,
}

impl Drop for Stop {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state.running = false;
        state.driver = None;
        state.out.clear();
        state.expired = 0;
        let error = self.error.take().unwrap_or_else(stopped);
        for waiter in state.waiting.drain(..) {
            if let Some(to) = waiter.to {
                to.fail(error.clone());
            }
        }
    }
}

trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

/// Opens a connection, trying again `retries` times.
async fn connect(settings: &PipeSettings) -> RedisResult<Box<dyn Io>> {
    let mut delay = Duration::from_millis(1);
    let mut attempt = 0;
    loop {
        let result = tokio::time::timeout(settings.connect_timeout, open(settings))
            .await
            .unwrap_or_else(|_| {
                Err(RedisError::from(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "redis connect timed out",
                )))
            });
        match result {
            Err(e) if attempt < settings.retries && retryable(&e) => {
                attempt += 1;
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_millis(50));
            }
            result => return result,
        }
    }
}

/// Failures a second attempt may not meet; a refused password, a database
/// that does not exist or a certificate not trusted will not change.
fn retryable(e: &RedisError) -> bool {
    e.is_io_error() && !super::tls::is_tls_error(e)
}

async fn open(settings: &PipeSettings) -> RedisResult<Box<dyn Io>> {
    let (host, port, tls) = match settings.info.addr() {
        ConnectionAddr::Tcp(host, port) => (host, *port, false),
        ConnectionAddr::TcpTls { host, port, .. } => (host, *port, true),
        _ => {
            return Err(RedisError::from((
                ErrorKind::InvalidClientConfig,
                "only redis:// and rediss:// URLs",
            )));
        }
    };
    let tcp = connect_tcp(host, port).await?;
    let mut stream: Box<dyn Io> = if tls {
        // Off the runtime's threads: the system's roots are files read
        // (and the PEM parsed) at each connection attempt.
        let tls_settings = settings.tls.clone();
        let config = tokio::task::spawn_blocking(move || tls_settings.client_config())
            .await
            .map_err(|e| io::Error::other(e.to_string()))??;
        let name = rustls::pki_types::ServerName::try_from(host.clone()).map_err(|e| {
            RedisError::from((
                ErrorKind::InvalidClientConfig,
                "not a TLS server name",
                e.to_string(),
            ))
        })?;
        let connector = tokio_rustls::TlsConnector::from(config);
        Box::new(connector.connect(name, tcp).await?)
    } else {
        Box::new(tcp)
    };
    handshake(&mut stream, &settings.info).await?;
    Ok(stream)
}

/// A TCP connection to `host:port` with Nagle's algorithm off (see
/// [`super::tcp_settings`]: a check written while the last one is
/// unacknowledged must not wait for that ACK).
pub(super) async fn connect_tcp(host: &str, port: u16) -> io::Result<TcpStream> {
    let tcp = TcpStream::connect((host, port)).await?;
    tcp.set_nodelay(true)?;
    Ok(tcp)
}

/// AUTH and SELECT, as the URL says; each must answer OK.
async fn handshake(stream: &mut Box<dyn Io>, info: &ConnectionInfo) -> RedisResult<()> {
    let redis = info.redis_settings();
    let mut commands = Vec::new();
    if let Some(password) = redis.password() {
        let mut auth = redis::cmd("AUTH");
        if let Some(user) = redis.username() {
            auth.arg(user);
        }
        commands.push(auth.arg(password).clone());
    }
    if redis.db() != 0 {
        commands.push(redis::cmd("SELECT").arg(redis.db()).clone());
    }
    if commands.is_empty() {
        return Ok(());
    }
    let mut out = Vec::new();
    for command in &commands {
        command.write_packed_command(&mut out);
    }
    stream.write_all(&out).await?;
    stream.flush().await?;
    let mut read = BytesMut::with_capacity(256);
    for _ in &commands {
        let frame = loop {
            if let Some(len) = frame_len(&read)? {
                break read.split_to(len);
            }
            if tokio::io::AsyncReadExt::read_buf(stream, &mut read).await? == 0 {
                return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
            }
        };
        decode(&frame)?;
    }
    Ok(())
}

/// A connected driver's buffers and timer.
struct Connection {
    stream: Box<dyn Io>,
    /// What is being written, and how much of it is.
    write: Vec<u8>,
    written: usize,
    /// Written, not yet flushed (TLS keeps records until then).
    unflushed: bool,
    /// Bytes read and not yet cut into frames.
    read: BytesMut,
    /// Frames cut from the last read, to hand over under one lock.
    frames: Vec<Bytes>,
    response_timeout: Duration,
    /// When the connection was made: a call queued while it was being made
    /// (TCP, TLS, AUTH: bounded by the connect timeout instead) has its
    /// response timeout counted from then.
    connected: Instant,
    /// Armed while calls wait; it may fire early (the oldest call was
    /// answered since), and is then armed again.
    timer: Pin<Box<Sleep>>,
    timer_armed: bool,
    /// Whether to write queued commands at once or yield first.
    gather: Gather,
}

/// What [`Connection::take_output`] did.
enum Take {
    /// Took the queued commands to write.
    Took,
    /// Nothing to take: nothing queued, or the last write is still going.
    Nothing,
    /// Commands are queued, and more are likely to be in a moment: the
    /// driver should yield once before it takes them.
    Later,
}

impl Connection {
    fn new(stream: Box<dyn Io>, response_timeout: Duration) -> Self {
        Self {
            stream,
            write: Vec::new(),
            written: 0,
            unflushed: false,
            read: BytesMut::with_capacity(16 * 1024),
            frames: Vec::new(),
            response_timeout,
            connected: Instant::now(),
            timer: Box::pin(tokio::time::sleep(Duration::ZERO)),
            timer_armed: false,
            gather: Gather::default(),
        }
    }

    /// One turn of the driver: `Ready(None)` when every handle is gone,
    /// `Ready(Some(error))` when the connection failed.
    fn poll(&mut self, shared: &Shared, cx: &mut Context<'_>) -> Poll<Option<RedisError>> {
        // Write until the socket is full or nothing is queued: a call
        // queued while an earlier write was still going out did not wake
        // the driver (it found commands queued already), so it is taken
        // here rather than a round trip later, when a reply wakes it.
        loop {
            match self.take_output(shared, cx) {
                Err(e) => return Poll::Ready(e),
                Ok(Take::Later) => {
                    // To the back of the runtime's queue, behind the tasks
                    // ready now: woken by their task, the driver would run
                    // next (tokio's LIFO slot) and write one command a
                    // syscall. Replies are still read below. (Deferring
                    // instead, `tokio::task::yield_now`, costs the same
                    // wake-up of an idle worker, plus a poll of epoll.)
                    cx.waker().wake_by_ref();
                    break;
                }
                Ok(Take::Nothing) if self.written == self.write.len() && !self.unflushed => break,
                Ok(Take::Nothing | Take::Took) => {}
            }
            match self.poll_write(cx) {
                Poll::Ready(Err(e)) => return Poll::Ready(Some(e.into())),
                Poll::Ready(Ok(())) => {}
                Poll::Pending => break,
            }
        }
        if let Poll::Ready(e) = self.poll_read(shared, cx) {
            return Poll::Ready(Some(e));
        }
        self.poll_timer(shared, cx);
        Poll::Pending
    }

    /// Takes the queued commands once the last ones are written, and
    /// leaves the driver's waker for callers.
    ///
    /// When other commands are likely on the way, it first yields, once,
    /// so that they go out together ([`gather`] says when, and why).
    fn take_output(
        &mut self,
        shared: &Shared,
        cx: &mut Context<'_>,
    ) -> Result<Take, Option<RedisError>> {
        let mut state = shared.lock();
        if state.closed {
            return Err(None);
        }
        if !state
            .driver
            .as_ref()
            .is_some_and(|w| w.will_wake(cx.waker()))
        {
            state.driver = Some(cx.waker().clone());
        }
        if self.written == self.write.len() && !state.out.is_empty() {
            if !self.gather.take_now(state.out.len(), state.waiting.len()) {
                return Ok(Take::Later);
            }
            self.write.clear();
            self.written = 0;
            std::mem::swap(&mut self.write, &mut state.out);
            return Ok(Take::Took);
        }
        Ok(Take::Nothing)
    }

    fn poll_write(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.written < self.write.len() {
            let n = ready!(Pin::new(&mut self.stream).poll_write(cx, &self.write[self.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
            self.unflushed = true;
        }
        if self.unflushed {
            // TLS holds records until flushed; TCP flushes at once.
            ready!(Pin::new(&mut self.stream).poll_flush(cx))?;
            self.unflushed = false;
        }
        Poll::Ready(Ok(()))
    }

    /// Reads what has arrived and hands each whole frame to its caller.
    fn poll_read(&mut self, shared: &Shared, cx: &mut Context<'_>) -> Poll<RedisError> {
        loop {
            if self.read.capacity() - self.read.len() < 4096 {
                self.read.reserve(16 * 1024);
            }
            match tokio_util::io::poll_read_buf(Pin::new(&mut self.stream), cx, &mut self.read) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(e.into()),
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(
                        io::Error::new(io::ErrorKind::UnexpectedEof, "redis closed the connection")
                            .into(),
                    );
                }
                Poll::Ready(Ok(_)) => {}
            }
            loop {
                match frame_len(&self.read) {
                    Ok(Some(len)) => self.frames.push(self.read.split_to(len).freeze()),
                    Ok(None) => break,
                    Err(e) => return Poll::Ready(e.into()),
                }
            }
            if !self.frames.is_empty() {
                self.gather.read(self.frames.len());
                if let Err(e) = deliver(&mut shared.lock(), self.frames.drain(..)) {
                    return Poll::Ready(e);
                }
            }
        }
    }

    /// Fails the calls unanswered past the response timeout, and keeps the
    /// timer armed while calls wait.
    fn poll_timer(&mut self, shared: &Shared, cx: &mut Context<'_>) {
        loop {
            if self.timer_armed {
                if self.timer.as_mut().poll(cx).is_pending() {
                    return;
                }
                self.timer_armed = false;
            }
            let mut state = shared.lock();
            let now = Instant::now();
            let mut oldest = None;
            let from = state.expired;
            let mut expired = 0;
            for waiter in state.waiting.range_mut(from..) {
                let due = waiter.queued.max(self.connected) + self.response_timeout;
                if due > now {
                    oldest = Some(due);
                    break;
                }
                if let Some(to) = waiter.to.take() {
                    to.fail(RedisError::from(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "redis did not answer in time",
                    )));
                }
                expired += 1;
            }
            state.expired += expired;
            drop(state);
            let Some(due) = oldest else {
                // Nothing waits (a call queued later wakes the driver,
                // which comes here again and arms the timer for it).
                return;
            };
            self.timer.as_mut().reset(due);
            self.timer_armed = true;
        }
    }
}

/// Hands `frames`, in order, to the calls waiting for them.
fn deliver(state: &mut State, frames: impl Iterator<Item = Bytes>) -> Result<(), RedisError> {
    for frame in frames {
        let Some(waiter) = state.waiting.front_mut() else {
            return Err(RedisError::from((
                ErrorKind::Parse,
                "redis sent a reply nobody asked for",
            )));
        };
        waiter.left -= 1;
        let done = waiter.left == 0;
        match (&mut waiter.to, done) {
            (Some(Sink::Many(got, _)), false) => got.push(frame),
            (None, _) => {}
            (Some(_), true) => {
                let Some(to) = waiter.to.take() else {
                    unreachable!()
                };
                match to {
                    Sink::One(to) => drop(to.send(Ok(frame))),
                    Sink::Many(mut got, to) => {
                        got.push(frame);
                        drop(to.send(Ok(got)));
                    }
                }
            }
            (Some(Sink::One(_)), false) => unreachable!("a single call waits for one frame"),
        }
        if done {
            state.waiting.pop_front();
            state.expired = state.expired.saturating_sub(1);
        }
    }
    Ok(())
}

impl redis::aio::ConnectionLike for Pipe {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move { decode(&self.call(cmd).await?) })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            // Each reply as a value, error replies included: the redis
            // crate's pipeline code reads those itself (`ignore_errors`, a
            // transaction's per-command errors).
            self.call_many(pipeline, offset, count)
                .await?
                .iter()
                .map(|frame| redis::parse_redis_value(frame))
                .collect()
        })
    }

    fn get_db(&self) -> i64 {
        self.db()
    }
}
