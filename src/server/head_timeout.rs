//! The header timeout (`http.header_timeout`) with one timer per
//! connection, not one per request.
//!
//! The rule is hyper's: a connection that is waiting for a request's head
//! (since it opened, or since its last answer) is closed if the whole head
//! has not arrived within the timeout. Bytes trickling in do not restart
//! the clock; only a complete head stops it. So one setting closes both a
//! client that trickles its headers (the slowloris) and an idle keep-alive
//! connection.
//!
//! hyper's own timer keeps that rule by creating a timer for every head it
//! waits for: a boxed sleep, an entry in tokio's timer wheel, and its
//! removal when the head arrives a moment later: work on every request for
//! a timer that almost never fires (docs/http-cost.md). Here the
//! connection keeps one sleep and moves it lazily:
//!
//! - the service marks the connection answering when a head arrives
//!   ([`HeadClock::answering`]), and waiting again from the moment the
//!   answer is ready ([`HeadClock::waiting_from`], the instant the request's
//!   duration was read with, so no extra clock read);
//! - the connection's IO ([`HeadTimeout`]) keeps the sleep armed, when a
//!   read finds nothing and when an answer is written (hyper reads nothing
//!   more until its task is woken), and leaves it where it is while
//!   requests come and go. When it fires, the deadline is worked out again
//!   from the latest mark: passed and still waiting, the connection fails
//!   with [`io::ErrorKind::TimedOut`] and is counted in
//!   `http_server_header_timeouts_total`; otherwise the sleep moves to the
//!   new deadline. A busy keep-alive connection touches the timer wheel
//!   once per timeout, not once per request.
//!
//! An answer still being written when the clock would run out (a client
//! that reads a large body slowly) is not cut off: while a write waits
//! for the client, or if one did since the sleep last fired, the deadline
//! moves to a full timeout from the firing. The clock starts when the
//! service's answer is ready, that is when its head is: every answer here
//! is whole by then. A body streamed later (none is today) would count as
//! waiting from that moment, and one that produced nothing for a whole
//! timeout would be cut off.

use crate::metrics as m;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// `waiting_since` while a request is being answered: the request
/// deadline (`http.request_timeout`) governs then, not this clock.
const ANSWERING: u64 = u64::MAX;

/// When a connection began waiting for a request's head, shared by the
/// connection's service (which marks it) and its IO (which enforces it).
/// Both run in the connection's one task; the atomics (relaxed) only make
/// it shareable.
#[derive(Debug)]
pub struct HeadClock {
    opened: Instant,
    /// Nanoseconds after `opened`, or [`ANSWERING`].
    waiting_since: AtomicU64,
}

impl HeadClock {
    /// A connection opened at `opened`, waiting for its first head.
    pub fn new(opened: Instant) -> Arc<Self> {
        Arc::new(Self {
            opened,
            waiting_since: AtomicU64::new(0),
        })
    }

    /// A head arrived: the connection is answering it.
    pub fn answering(&self) {
        self.waiting_since.store(ANSWERING, Ordering::Relaxed);
    }

    /// The answer was ready at `at`: the next head is due within the
    /// timeout of it.
    pub fn waiting_from(&self, at: Instant) {
        let since = at.saturating_duration_since(self.opened).as_nanos();
        let since = u64::try_from(since).unwrap_or(ANSWERING - 1);
        self.waiting_since.store(since, Ordering::Relaxed);
    }

    /// When the next head is due (`None` while answering).
    fn due(&self, timeout: Duration) -> Option<Instant> {
        match self.waiting_since.load(Ordering::Relaxed) {
            ANSWERING => None,
            since => Some(self.opened + Duration::from_nanos(since) + timeout),
        }
    }
}

/// A connection's IO under the header timeout of its [`HeadClock`]; see
/// the module docs.
#[derive(Debug)]
pub struct HeadTimeout<T> {
    io: T,
    clock: Arc<HeadClock>,
    timeout: Duration,
    /// Armed at the first wait; moved only when it fires.
    sleep: Option<Pin<Box<Sleep>>>,
    /// The sleep was polled since it was last set: it will wake the task.
    armed: bool,
    /// A write is waiting for the client to read.
    write_waiting: bool,
    /// A write went through after waiting, since the sleep last fired.
    wrote_after_waiting: bool,
    timed_out: bool,
}

impl<T> HeadTimeout<T> {
    /// `io` closed (by a read error) once a head is `timeout` late.
    pub fn new(io: T, clock: Arc<HeadClock>, timeout: Duration) -> Self {
        Self {
            io,
            clock,
            timeout,
            sleep: None,
            armed: false,
            write_waiting: false,
            wrote_after_waiting: false,
            timed_out: false,
        }
    }

    /// Keeps the sleep in the timer wheel, so the connection's task is
    /// woken when it fires, and decides when it has: `Pending`, or the
    /// timeout's error once the head is late. Called when a read finds
    /// nothing and when an answer is written (hyper may not read again
    /// before the next request: the sleep must be armed by then).
    ///
    /// Armed and not yet fired (nearly every call) is one atomic load. The
    /// sleep keeps the task's waker from the poll that armed it; a
    /// connection's task, and so its waker, never changes.
    fn keep_armed(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.timed_out {
            return Poll::Ready(Err(timed_out()));
        }
        if let Some(sleep) = &self.sleep
            && self.armed
            && !sleep.is_elapsed()
        {
            return Poll::Pending;
        }
        // tokio's clock, the one the sleep fires by (paused in tests).
        let clock_now = || tokio::time::Instant::now().into_std();
        let sleep = self.sleep.get_or_insert_with(|| {
            let first = self
                .clock
                .due(self.timeout)
                .unwrap_or_else(|| clock_now() + self.timeout);
            Box::pin(tokio::time::sleep_until(first.into()))
        });
        // Fired (at a stale deadline, most times): decide, move it on.
        // Polled outside tokio's cooperative budget: with the task's budget
        // spent, a sleep's poll returns Pending without registering the
        // waker, and the armed sleep would then never wake the connection.
        while std::pin::pin!(tokio::task::coop::unconstrained(sleep.as_mut()))
            .poll(cx)
            .is_ready()
        {
            let now = clock_now();
            let due = match self.clock.due(self.timeout) {
                // Answering: the request deadline governs; look again later.
                None => now + self.timeout,
                Some(due)
                    if self.write_waiting || std::mem::take(&mut self.wrote_after_waiting) =>
                {
                    due.max(now + self.timeout)
                }
                Some(due) if now >= due => {
                    self.armed = false;
                    self.timed_out = true;
                    metrics::counter!(m::HTTP_SERVER_HEADER_TIMEOUTS_TOTAL).increment(1);
                    return Poll::Ready(Err(timed_out()));
                }
                Some(due) => due,
            };
            sleep.as_mut().reset(due.into());
        }
        self.armed = true;
        Poll::Pending
    }

    /// An answer's bytes went out (or waited to): keep the sleep armed,
    /// and note a write that waited for the client.
    fn wrote<R>(
        &mut self,
        cx: &mut Context<'_>,
        written: Poll<io::Result<R>>,
    ) -> Poll<io::Result<R>> {
        if written.is_pending() {
            self.write_waiting = true;
        } else if std::mem::take(&mut self.write_waiting) {
            self.wrote_after_waiting = true;
        }
        let decided = self.timed_out;
        if self.keep_armed(cx).is_ready() && !decided {
            // Timed out just now: the next read says so; make sure there
            // is one (once: waking on every later write could spin).
            cx.waker().wake_by_ref();
        }
        written
    }
}

fn timed_out() -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        "no complete request head within http.header_timeout",
    )
}

impl<T: AsyncRead + Unpin> AsyncRead for HeadTimeout<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Pending => this.keep_armed(cx),
            read => read,
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for HeadTimeout<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.io).poll_write(cx, buf);
        this.wrote(cx, written)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.wrote(cx, written)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Not a write's progress: a socket's flush is ready at once, its
        // waiting write still waiting.
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    const T: Duration = Duration::from_secs(10);
    /// tokio's timer rounds a deadline up to its next millisecond.
    const TICK: Duration = Duration::from_millis(1);

    /// tokio's (paused) clock.
    fn now() -> Instant {
        tokio::time::Instant::now().into_std()
    }

    /// The server's end under the timeout, the client's end (64 bytes of
    /// buffer each way), and the clock.
    fn connection() -> (HeadTimeout<DuplexStream>, DuplexStream, Arc<HeadClock>) {
        let (server, client) = tokio::io::duplex(64);
        let clock = HeadClock::new(now());
        (
            HeadTimeout::new(server, Arc::clone(&clock), T),
            client,
            clock,
        )
    }

    /// Reads (whatever arrives) until a read fails; how long after `from`
    /// that was. The failure must be the timeout's.
    async fn failed_after(io: &mut (impl AsyncRead + Unpin), from: Instant) -> Duration {
        let mut buf = [0u8; 64];
        loop {
            match io.read(&mut buf).await {
                Ok(0) => panic!("closed, not timed out"),
                Ok(_) => {}
                Err(e) => {
                    assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
                    return now() - from;
                }
            }
        }
    }

    /// Whether a read is still waiting (not failed) after `wait`.
    async fn still_waiting(io: &mut (impl AsyncRead + Unpin), wait: Duration) -> bool {
        let mut buf = [0u8; 64];
        tokio::time::timeout(wait, io.read(&mut buf)).await.is_err()
    }

    /// Fails at the timeout, and is counted once however often it is read
    /// or written after.
    #[tokio::test(start_paused = true)]
    async fn a_connection_that_sends_nothing_fails_at_the_timeout_counted_once() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let _local = metrics::set_default_local_recorder(&recorder);
        let (mut io, _client, _clock) = connection();
        let opened = now();
        let after = failed_after(&mut io, opened).await;
        assert!((T..=T + TICK).contains(&after), "{after:?}");
        tokio::time::sleep(3 * T).await;
        let mut buf = [0u8; 8];
        for _ in 0..3 {
            let again = io.read(&mut buf).await.unwrap_err();
            assert_eq!(again.kind(), io::ErrorKind::TimedOut);
            io.write_all(b"HTTP/1.1 408\r\n\r\n").await.unwrap();
        }
        let counted = handle.render();
        assert!(
            counted
                .lines()
                .any(|l| l == format!("{} 1", m::HTTP_SERVER_HEADER_TIMEOUTS_TOTAL)),
            "{counted}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_trickled_head_does_not_restart_the_clock() {
        let (mut io, mut client, _clock) = connection();
        let opened = now();
        tokio::spawn(async move {
            client.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
            loop {
                tokio::time::sleep(T / 8).await;
                if client.write_all(b"a").await.is_err() {
                    return;
                }
            }
        });
        let after = failed_after(&mut io, opened).await;
        assert!((T..=T + TICK).contains(&after), "{after:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn no_timeout_while_answering_and_a_full_one_after_the_answer() {
        let (mut io, _client, clock) = connection();
        clock.answering();
        assert!(still_waiting(&mut io, 5 * T).await);
        let answered = now();
        clock.waiting_from(answered);
        let after = failed_after(&mut io, answered).await;
        assert!((T..=T + TICK).contains(&after), "{after:?}");
    }

    /// Requests every 0.3 T for 3 T: the sleep armed for the first head
    /// fires at a stale deadline and moves; the connection fails a whole
    /// timeout after its last answer, not before.
    #[tokio::test(start_paused = true)]
    async fn a_busy_connection_fails_a_timeout_after_its_last_answer() {
        let (mut io, _client, clock) = connection();
        let mut answered = now();
        for _ in 0..10 {
            assert!(still_waiting(&mut io, T * 3 / 10).await);
            clock.answering();
            answered = now();
            clock.waiting_from(answered);
        }
        let after = failed_after(&mut io, answered).await;
        assert!((T..=T + TICK).contains(&after), "{after:?}");
    }

    /// hyper reads again after writing an answer (hyper 1.x's dispatcher
    /// does, to notice a closed connection), and that read arms the sleep.
    /// The answer's write arms it as well, so that the timeout does not hang
    /// on hyper's habit: here no read follows the write, and the sleep's
    /// firing still wakes the connection, whose read then fails.
    #[tokio::test(start_paused = true)]
    async fn the_answers_write_arms_the_timeout_when_no_read_waited() {
        let (mut io, mut client, clock) = connection();
        client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        let mut head = [0u8; 64];
        assert!(io.read(&mut head).await.unwrap() > 0);
        clock.answering();
        let answered = now();
        clock.waiting_from(answered);
        let mut written = false;
        let woken = std::future::poll_fn(|cx| {
            if std::mem::replace(&mut written, true) {
                return Poll::Ready(now());
            }
            let write = Pin::new(&mut io).poll_write(cx, b"HTTP/1.1 200 OK\r\n\r\n");
            assert!(matches!(write, Poll::Ready(Ok(_))));
            Poll::Pending
        });
        let woken = tokio::time::timeout(3 * T, woken)
            .await
            .expect("the connection was never woken");
        assert!(
            (T..=T + TICK).contains(&(woken - answered)),
            "{:?}",
            woken - answered
        );
        let failed = io.read(&mut head).await.unwrap_err();
        assert_eq!(failed.kind(), io::ErrorKind::TimedOut);
    }

    /// The connection's first wait can come with the task's cooperative
    /// budget spent (hyper's task polled other tokio resources first). The
    /// sleep must still be registered, or nothing would wake the
    /// connection at the timeout.
    #[tokio::test(start_paused = true)]
    async fn the_timeout_is_armed_when_the_tasks_budget_is_spent() {
        let (mut io, _client, _clock) = connection();
        let opened = now();
        let (send, mut receive) = tokio::sync::mpsc::unbounded_channel();
        for _ in 0..1000 {
            send.send(()).unwrap();
        }
        let mut first = true;
        let failed = std::future::poll_fn(|cx| {
            if std::mem::take(&mut first) {
                let mut received = 0;
                while receive.poll_recv(cx).is_ready() {
                    received += 1;
                }
                assert!(received < 1000, "the budget was never spent");
            }
            let mut buf = [0u8; 64];
            match Pin::new(&mut io).poll_read(cx, &mut ReadBuf::new(&mut buf)) {
                Poll::Ready(read) => Poll::Ready(read.unwrap_err()),
                Poll::Pending => Poll::Pending,
            }
        });
        let failed = tokio::time::timeout(3 * T, failed)
            .await
            .expect("the connection was never woken");
        assert_eq!(failed.kind(), io::ErrorKind::TimedOut, "{failed}");
        let after = now() - opened;
        assert!((T..=T + TICK).contains(&after), "{after:?}");
    }

    /// An answer the client reads slowly: no timeout while the write
    /// waits for it, and between one and two timeouts after it went out.
    /// The answer's write and the reads for the next head are polled in one
    /// task, as hyper's dispatcher polls them.
    #[tokio::test(start_paused = true)]
    async fn an_answer_still_being_written_is_not_cut_off() {
        let (mut io, mut client, clock) = connection();
        clock.answering();
        let answered = now();
        clock.waiting_from(answered);
        let client = tokio::spawn(async move {
            tokio::time::sleep(T * 5 / 2).await;
            let mut answer = vec![0u8; 4096];
            client.read_exact(&mut answer).await.unwrap();
            (now(), client)
        });
        let answer = [b'x'; 4096];
        let mut left = &answer[..];
        let (failed, failed_at) = std::future::poll_fn(|cx| {
            while !left.is_empty() {
                match Pin::new(&mut io).poll_write(cx, left) {
                    Poll::Ready(Ok(n)) => left = &left[n..],
                    Poll::Ready(Err(e)) => panic!("the write failed: {e}"),
                    Poll::Pending => break,
                }
            }
            let mut buf = [0u8; 64];
            match Pin::new(&mut io).poll_read(cx, &mut ReadBuf::new(&mut buf)) {
                Poll::Ready(Ok(())) => panic!("read {:?}, not a timeout", buf),
                Poll::Ready(Err(e)) => Poll::Ready((e, now())),
                Poll::Pending => Poll::Pending,
            }
        })
        .await;
        assert_eq!(failed.kind(), io::ErrorKind::TimedOut, "{failed}");
        assert!(left.is_empty(), "cut off with {} bytes unsent", left.len());
        let (read_at, _client) = client.await.unwrap();
        assert!(read_at - answered >= T * 5 / 2, "{:?}", read_at - answered);
        let after = failed_at - read_at;
        assert!((T..=2 * T + TICK).contains(&after), "{after:?}");
    }
}
