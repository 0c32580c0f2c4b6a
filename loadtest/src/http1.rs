//! The load generators' own HTTP/1.1: the few lines of it that a client on
//! keep-alive connections needs, as wrk's are. A request is written from
//! one buffer; the answer's head is parsed in place by `httparse` and its
//! body read past by its length (a `Content-Length` or chunked body). No connection task,
//! channel, header map or body stream of a general client stands between
//! the socket and the measurement: at thousands of requests a second on 2
//! cores, those are what made the generator, not the system under test,
//! the thing that saturated (docs/load.md, docs/capacity.md).
//!
//! [`parse`] reads an answer from bytes (the `http-cost` driver's
//! blocking connections use it alone); [`Client`] is one connection of an
//! async generator (`hotkey`'s surge, `capacity`), reopened when needed.

use crate::traffic;
use std::net::{IpAddr, SocketAddr};
use std::ops::Range;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Puts a request onto the end of `buf`: its line, `fields` in their
/// order and, with a `body`, that JSON with its type and length. The one
/// place the generators' requests are framed, so none of them can send a
/// body without its length or a field without its line end.
pub(crate) fn write_request<'a>(
    buf: &mut Vec<u8>,
    method: &str,
    path: &str,
    fields: impl IntoIterator<Item = (&'a str, &'a str)>,
    body: Option<&str>,
) {
    for part in [method, " ", path, " HTTP/1.1\r\n"] {
        buf.extend_from_slice(part.as_bytes());
    }
    for (name, value) in fields {
        for part in [name, ": ", value, "\r\n"] {
            buf.extend_from_slice(part.as_bytes());
        }
    }
    if let Some(json) = body {
        let length = json.len().to_string();
        for part in [
            "content-type: application/json\r\ncontent-length: ",
            &length,
            "\r\n\r\n",
            json,
        ] {
            buf.extend_from_slice(part.as_bytes());
        }
    } else {
        buf.extend_from_slice(b"\r\n");
    }
}

/// An answer's header fields as [`traffic::check`] reads them (names are
/// case insensitive; a value that is no UTF-8 is absent).
pub(crate) struct Fields<'a>(&'a [httparse::Header<'a>]);

impl traffic::Headers for Fields<'_> {
    fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .and_then(|h| std::str::from_utf8(h.value).ok())
    }
}

/// The most header fields an answer may carry.
const MAX_FIELDS: usize = 32;

/// A whole answer at the start of some bytes.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Answer<T> {
    /// What the caller read from its status and fields.
    pub(crate) read: T,
    /// Its body (for a chunked one, the chunks with their framing); the
    /// answer ends where the body does.
    pub(crate) body: Range<usize>,
    /// The body is chunked.
    pub(crate) chunked: bool,
    /// The server closes the connection after it.
    pub(crate) close: bool,
}

/// The answer at the start of `bytes` once all of it is there, with what
/// `read` makes of its status and fields; `None` while more is to come.
/// An answer whose end cannot be told (no length, not chunked) is an
/// error: on a keep-alive connection it would end only with the
/// connection. So is an interim 1xx answer, which no request here asks
/// for (none sends `Expect`), and a chunked body with trailer fields.
pub(crate) fn parse<T>(
    bytes: &[u8],
    read: impl FnOnce(u16, &Fields) -> T,
) -> Result<Option<Answer<T>>, &'static str> {
    let mut fields = [httparse::EMPTY_HEADER; MAX_FIELDS];
    let mut response = httparse::Response::new(&mut fields);
    let head = match response.parse(bytes) {
        Ok(httparse::Status::Complete(length)) => length,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(_) => return Err("response"),
    };
    let status = response.code.ok_or("response")?;
    if status < 200 {
        return Err("response");
    }
    let fields = Fields(response.headers);
    let field = |name| traffic::Headers::get(&fields, name).map(str::trim);
    let rest = &bytes[head..];
    let chunked = field("transfer-encoding").is_some_and(|t| t.eq_ignore_ascii_case("chunked"));
    let length = if status == 204 || status == 304 {
        // No body, whatever its fields say (a 304's Content-Length is the
        // representation's it stands for).
        Some(0)
    } else if chunked {
        chunked_end(rest)?
    } else {
        let length = field("content-length")
            .ok_or("response")?
            .parse()
            .map_err(|_| "response")?;
        (rest.len() >= length).then_some(length)
    };
    let Some(length) = length else {
        return Ok(None);
    };
    let close = field("connection").is_some_and(|c| c.eq_ignore_ascii_case("close"));
    Ok(Some(Answer {
        read: read(status, &fields),
        body: head..head + length,
        chunked,
        close,
    }))
}

/// Where a chunked body that starts at `bytes[0]` ends (past its last
/// chunk and the empty line after it), `None` while it is partial.
fn chunked_end(bytes: &[u8]) -> Result<Option<usize>, &'static str> {
    let mut at = 0;
    loop {
        let (line, size) = match httparse::parse_chunk_size(&bytes[at..]) {
            Ok(httparse::Status::Complete(chunk)) => chunk,
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(_) => return Err("body"),
        };
        let size = usize::try_from(size).map_err(|_| "body")?;
        // The chunk's data and the CRLF after it (after the last, empty,
        // chunk: the empty line that ends the body, as no trailer field
        // may come first).
        let data = at + line;
        let end = data
            .checked_add(size)
            .and_then(|n| n.checked_add(2))
            .ok_or("body")?;
        if bytes.len() < end {
            return Ok(None);
        }
        if &bytes[end - 2..end] != b"\r\n" {
            return Err("body");
        }
        if size == 0 {
            return Ok(Some(end));
        }
        at = end;
    }
}

/// One client of an async load generator: a keep-alive connection to its
/// target, opened when first needed and again after the server closed it
/// or an exchange failed; one request at a time.
pub(crate) struct Client {
    target: SocketAddr,
    /// The address it connects from (a client address of its own).
    local: Option<IpAddr>,
    /// How long one exchange, connecting included, may take.
    timeout: Duration,
    open: Option<Connection>,
}

impl Client {
    pub(crate) fn new(target: SocketAddr, local: Option<IpAddr>, timeout: Duration) -> Self {
        Self {
            target,
            local,
            timeout,
            open: None,
        }
    }

    /// Sends `request` (a whole HTTP/1.1 request) and reads its answer
    /// whole, returning what `read` makes of its status and fields. After
    /// an error the connection is dropped, and the next request opens
    /// another.
    pub(crate) async fn exchange<T>(
        &mut self,
        request: &[u8],
        read: impl Fn(u16, &Fields) -> T,
    ) -> Result<T, &'static str> {
        let answer = tokio::time::timeout(self.timeout, self.try_exchange(request, read))
            .await
            .unwrap_or(Err("timeout"));
        match answer {
            Ok((read, close)) => {
                if close {
                    self.open = None;
                }
                Ok(read)
            }
            Err(why) => {
                self.open = None;
                Err(why)
            }
        }
    }

    async fn try_exchange<T>(
        &mut self,
        request: &[u8],
        read: impl Fn(u16, &Fields) -> T,
    ) -> Result<(T, bool), &'static str> {
        if self.open.as_mut().is_some_and(Connection::closed) {
            self.open = None;
        }
        let connection = match &mut self.open {
            Some(connection) => connection,
            open => open.insert(Connection {
                stream: connect(self.target, self.local).await?,
                read: Vec::with_capacity(4096),
            }),
        };
        connection
            .stream
            .write_all(request)
            .await
            .map_err(|_| "request")?;
        connection.answer(read).await
    }
}

/// A keep-alive connection and the bytes read from it not yet used.
struct Connection {
    stream: TcpStream,
    read: Vec<u8>,
}

impl Connection {
    /// The server has closed this idle connection (an instance closes
    /// one after its idle timeout): a request written to it would fail
    /// for want of a connection, not for anything the server did. Free
    /// unless the socket became readable since its last answer: tokio
    /// reads only a socket it was told is ready.
    fn closed(&mut self) -> bool {
        matches!(self.stream.try_read_buf(&mut self.read), Ok(0))
    }

    /// Reads one answer whole, and whether the server closes after it.
    async fn answer<T>(
        &mut self,
        read: impl Fn(u16, &Fields) -> T,
    ) -> Result<(T, bool), &'static str> {
        let answer = loop {
            if let Some(answer) = parse(&self.read, &read)? {
                break answer;
            }
            if self.read.len() > 1 << 20 {
                return Err("response");
            }
            match self.stream.read_buf(&mut self.read).await {
                Ok(0) | Err(_) => return Err("closed"),
                Ok(_) => {}
            }
        };
        // Whatever follows belongs to the next answer (none is sent before
        // its request, but a server may say more than it was asked).
        self.read.drain(..answer.body.end);
        Ok((answer.read, answer.close))
    }
}

/// A connection to `target`, from `local` if given.
async fn connect(target: SocketAddr, local: Option<IpAddr>) -> Result<TcpStream, &'static str> {
    let socket = match target {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
    }
    .map_err(|_| "connect")?;
    if let Some(ip) = local {
        socket.bind(SocketAddr::new(ip, 0)).map_err(|_| "connect")?;
    }
    let stream = socket.connect(target).await.map_err(|_| "connect")?;
    stream.set_nodelay(true).map_err(|_| "connect")?;
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::traffic::Verdict;

    const FIELDS: &str = "ratelimit-limit: 5\r\nratelimit-remaining: 4\r\nratelimit-reset: 1\r\n\
        ratelimit-policy: \"p\";q=5;w=1\r\nratelimit: \"p\";r=4;t=0\r\n";

    fn answer(head: &str) -> String {
        format!("HTTP/1.1 200 OK\r\n{FIELDS}{head}\r\n")
    }

    fn verdict(bytes: &[u8]) -> Result<Option<Answer<Verdict>>, &'static str> {
        parse(bytes, |status, fields| traffic::check(status, fields))
    }

    #[test]
    fn a_request_is_framed_with_its_fields_and_its_body_length() {
        let mut buf = b"left ".to_vec();
        write_request(
            &mut buf,
            "GET",
            "/api/items",
            [("host", "h"), ("x-api-key", "k")],
            None,
        );
        assert_eq!(
            buf,
            b"left GET /api/items HTTP/1.1\r\nhost: h\r\nx-api-key: k\r\n\r\n"
        );
        buf.clear();
        write_request(
            &mut buf,
            "POST",
            "/api/orders",
            [("host", "h")],
            Some("{\"a\":1}"),
        );
        let mut fields = [httparse::EMPTY_HEADER; 4];
        let mut request = httparse::Request::new(&mut fields);
        let head = match request.parse(&buf) {
            Ok(httparse::Status::Complete(head)) => head,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            (request.method, request.path),
            (Some("POST"), Some("/api/orders"))
        );
        let length = request.headers.iter().find(|f| f.name == "content-length");
        assert_eq!(length.map(|f| f.value), Some(&b"7"[..]));
        assert_eq!(&buf[head..], b"{\"a\":1}");
    }

    #[test]
    fn an_answer_is_taken_only_once_all_of_it_is_there() {
        let text = answer("content-length: 2\r\n") + "[]next";
        let end = text.len() - 4;
        let said = verdict(text.as_bytes()).unwrap().unwrap();
        assert_eq!(said.read, Verdict::Admitted);
        assert_eq!(said.body, end - 2..end);
        assert!(!said.close);
        for cut in 0..end {
            assert!(verdict(&text.as_bytes()[..cut]).unwrap().is_none(), "{cut}");
        }
    }

    #[test]
    fn an_answer_is_checked_as_goose_checks_it() {
        let missing = "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
        let said = verdict(missing.as_bytes()).unwrap().unwrap();
        assert!(matches!(said.read, Verdict::Broken(_)), "{said:?}");
        let limited = format!(
            "HTTP/1.1 429 Too Many Requests\r\n{FIELDS}retry-after: 1\r\ncontent-length: 0\r\n\r\n"
        );
        let said = verdict(limited.as_bytes()).unwrap().unwrap();
        assert_eq!(said.read, Verdict::Throttled);
        let down =
            "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        let said = verdict(down.as_bytes()).unwrap().unwrap();
        assert!(matches!(said.read, Verdict::Unavailable(_)));
        assert!(said.close);
    }

    #[test]
    fn an_answer_whose_end_cannot_be_told_is_refused() {
        assert!(verdict(answer("").as_bytes()).is_err());
        assert!(verdict(b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n").is_err());
        assert!(verdict(b"nonsense\r\n\r\n").is_err());
        assert!(verdict(b"SSH-2.0-OpenSSH\r\n\r\n").is_err());
        // No request here asks for an interim answer.
        assert!(verdict(b"HTTP/1.1 100 Continue\r\n\r\n").is_err());
    }

    #[test]
    fn a_204_or_304_has_no_body_whatever_its_fields_say() {
        let empty = "HTTP/1.1 204 No Content\r\n\r\n";
        assert_eq!(verdict(empty.as_bytes()).unwrap().unwrap().body, 27..27);
        let cached = b"HTTP/1.1 304 Not Modified\r\ncontent-length: 120\r\n\r\n";
        let said = verdict(cached).unwrap().unwrap();
        assert_eq!(said.body, cached.len()..cached.len());
    }

    #[test]
    fn a_chunked_body_ends_after_its_last_chunk() {
        let text = answer("transfer-encoding: chunked\r\n");
        let body = b"2\r\n[]\r\n10\r\n0123456789abcdef\r\n0\r\n\r\nnext";
        let whole = [text.as_bytes(), body].concat();
        let end = whole.len() - 4;
        let said = verdict(&whole).unwrap().unwrap();
        assert_eq!(said.body, text.len()..end);
        assert!(said.chunked);
        for cut in 0..end {
            assert!(verdict(&whole[..cut]).unwrap().is_none(), "{cut}");
        }
        assert!(chunked_end(b"zz\r\n").is_err());
        // Data longer than its size says, and a trailer field, misframe
        // the answer: refused, not read past.
        assert!(chunked_end(b"2\r\n[]]\r\n0\r\n\r\n").is_err());
        assert!(chunked_end(b"0\r\nx-trailer: 1\r\n\r\n").is_err());
    }

    /// A server that answers each request on a connection with `answers`
    /// in turn (an empty one: it closes without a word), and then closes
    /// it; every connection it accepted counted.
    async fn serve(
        answers: &'static [&'static str],
    ) -> (SocketAddr, tokio::task::JoinHandle<usize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let mut accepted = 0;
            while let Ok(Ok((mut socket, _))) =
                tokio::time::timeout(Duration::from_millis(500), listener.accept()).await
            {
                accepted += 1;
                let mut buf = vec![0u8; 4096];
                for answer in answers {
                    // Every test request fits one read.
                    match socket.read(&mut buf).await {
                        Ok(n) if n > 0 => {}
                        _ => break,
                    }
                    if answer.is_empty() || socket.write_all(answer.as_bytes()).await.is_err() {
                        break;
                    }
                }
            }
            accepted
        });
        (addr, server)
    }

    const REQUEST: &[u8] = b"GET / HTTP/1.1\r\nhost: test\r\n\r\n";

    #[tokio::test]
    async fn a_client_keeps_its_connection_until_the_server_closes_it() {
        let (addr, server) = serve(&[
            "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n[]",
            "HTTP/1.1 429 Too Many Requests\r\ntransfer-encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n",
            "HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
        ])
        .await;
        let mut client = Client::new(addr, None, Duration::from_secs(5));
        let status = |status: u16, _: &Fields| status;
        let mut got = Vec::new();
        for _ in 0..4 {
            got.push(client.exchange(REQUEST, status).await.unwrap());
        }
        // Three answers on the first connection, the fourth on a second.
        assert_eq!(got, [200, 429, 503, 200]);
        drop(client);
        assert_eq!(server.await.unwrap(), 2);
    }

    #[tokio::test]
    async fn a_client_reconnects_after_a_failed_exchange() {
        // The server closes without answering the second request.
        let (addr, server) = serve(&["HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n", ""]).await;
        let mut client = Client::new(addr, None, Duration::from_secs(5));
        let status = |status: u16, _: &Fields| status;
        assert_eq!(client.exchange(REQUEST, status).await, Ok(200));
        assert_eq!(client.exchange(REQUEST, status).await, Err("closed"));
        assert_eq!(client.exchange(REQUEST, status).await, Ok(200));
        drop(client);
        assert_eq!(server.await.unwrap(), 2);
    }

    #[tokio::test]
    async fn a_connection_the_server_closed_while_idle_is_not_an_error() {
        // The server closes each connection after one answer, as an
        // instance does one idle past its timeout.
        let (addr, server) = serve(&["HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"]).await;
        let mut client = Client::new(addr, None, Duration::from_secs(5));
        let status = |status: u16, _: &Fields| status;
        for _ in 0..3 {
            assert_eq!(client.exchange(REQUEST, status).await, Ok(200));
            // Idle long enough for the close to arrive and be seen.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        drop(client);
        assert_eq!(server.await.unwrap(), 3);
    }

    #[tokio::test]
    async fn an_exchange_that_takes_too_long_fails_by_its_deadline() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = Client::new(
            listener.local_addr().unwrap(),
            None,
            Duration::from_millis(100),
        );
        // Accepted by the kernel, never answered.
        let answer = client.exchange(REQUEST, |status, _| status).await;
        assert_eq!(answer, Err("timeout"));
        assert!(client.open.is_none(), "the connection is dropped");
    }
}
