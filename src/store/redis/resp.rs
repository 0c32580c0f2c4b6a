//! RESP, as far as our connection ([`super::pipe`]) needs it: commands
//! written as arrays of bulk strings, and replies cut into frames without
//! being parsed (a frame is decoded by the call it answers, with the redis
//! crate's parser unless it is the bulk string a script returns).
//!
//! Replies are read as RESP2, what Redis speaks until a client says HELLO 3
//! (ours never does).

use redis::{Cmd, RedisResult, Value};
use std::borrow::Cow;
use std::io;

/// A command as bytes: written as RESP straight into the connection's
/// buffer, or made into the redis crate's `Cmd` (for its cluster
/// connection). A check's EVALSHA writes itself, with no `Cmd` between.
pub trait Command {
    /// Appends the command, as a RESP array of bulk strings, to `out`.
    fn write_resp(&self, out: &mut Vec<u8>);
    /// The same command as the redis crate's.
    fn cmd(&self) -> Cow<'_, Cmd>;
    /// The cluster slot of its keys (`None`: it has none, any node will
    /// do), for a command sent on our own cluster connections.
    fn slot(&self) -> Option<u16> {
        None
    }
}

impl Command for Cmd {
    fn write_resp(&self, out: &mut Vec<u8>) {
        self.write_packed_command(out);
    }

    fn cmd(&self) -> Cow<'_, Cmd> {
        Cow::Borrowed(self)
    }
}

/// Writes the header of a RESP array of `len` elements.
pub fn write_array_len(out: &mut Vec<u8>, len: usize) {
    write_header(out, b'*', len);
}

/// Writes the header of a RESP bulk string of `len` bytes; the caller
/// writes the bytes, then [`end_bulk`].
pub fn write_bulk_len(out: &mut Vec<u8>, len: usize) {
    write_header(out, b'$', len);
}

fn write_header(out: &mut Vec<u8>, kind: u8, len: usize) {
    out.push(kind);
    out.extend_from_slice(itoa::Buffer::new().format(len).as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// Ends a bulk string.
pub fn end_bulk(out: &mut Vec<u8>) {
    out.extend_from_slice(b"\r\n");
}

/// Writes `bytes` as a RESP bulk string.
pub fn write_bulk(out: &mut Vec<u8>, bytes: &[u8]) {
    write_bulk_len(out, bytes.len());
    out.extend_from_slice(bytes);
    end_bulk(out);
}

/// Writes `n`'s decimal digits as a RESP bulk string, as Redis reads a
/// number argument. (At most 20 digits, so the length is written without
/// a second formatting pass: this runs several times per check.)
pub fn write_number(out: &mut Vec<u8>, n: u64) {
    let mut digits = itoa::Buffer::new();
    let digits = digits.format(n).as_bytes();
    let len = digits.len();
    // Assembled on the stack and appended once: `$<len>\r\n<digits>\r\n`
    // is at most 27 bytes, and each append checks the `Vec`'s capacity.
    let mut frame = [0u8; 27];
    let head = if len >= 10 {
        frame[..5].copy_from_slice(&[
            b'$',
            b'0' + (len / 10) as u8,
            b'0' + (len % 10) as u8,
            b'\r',
            b'\n',
        ]);
        5
    } else {
        frame[..4].copy_from_slice(&[b'$', b'0' + len as u8, b'\r', b'\n']);
        4
    };
    let end = head + len;
    frame[head..end].copy_from_slice(digits);
    frame[end..end + 2].copy_from_slice(b"\r\n");
    out.extend_from_slice(&frame[..end + 2]);
}

/// Decodes a reply frame into the redis crate's `Value`; an error reply
/// becomes the error the redis crate would return (NOSCRIPT, MOVED, ...).
pub fn decode(frame: &[u8]) -> RedisResult<Value> {
    redis::parse_redis_value(frame)?.extract_error()
}

/// A bulk string reply's contents, read in place; `None` for any other
/// frame.
pub fn bulk_string(frame: &[u8]) -> Option<&[u8]> {
    let rest = frame.strip_prefix(b"$")?;
    let line = rest.iter().position(|&b| b == b'\r')?;
    let len: usize = std::str::from_utf8(&rest[..line]).ok()?.parse().ok()?;
    let body = rest.get(line + 2..)?;
    (body.len() == len + 2 && body.ends_with(b"\r\n")).then(|| &body[..len])
}

/// The length of the RESP2 frame at the start of `buf`: `Ok(None)` while
/// it is incomplete, an error if it is not RESP2.
pub(super) fn frame_len(buf: &[u8]) -> io::Result<Option<usize>> {
    let bad =
        |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("redis reply: {what}"));
    let mut at = 0;
    // Frames still to read: the first, then the elements of arrays.
    let mut pending: usize = 1;
    while pending > 0 {
        let Some(newline) = buf[at..].iter().position(|&b| b == b'\n') else {
            return Ok(None);
        };
        if newline < 2 || buf[at + newline - 1] != b'\r' {
            // No CR, or not even a type byte before the CRLF.
            return Err(bad("a line without a type or CRLF"));
        }
        let kind = buf[at];
        let line = &buf[at + 1..at + newline - 1];
        at += newline + 1;
        pending -= 1;
        let number = || -> io::Result<i64> {
            std::str::from_utf8(line)
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| bad("a length that is not a number"))
        };
        match kind {
            b'+' | b'-' | b':' => {}
            b'$' => {
                if let Ok(len) = usize::try_from(number()?) {
                    let end = at + len;
                    if buf.len() < end + 2 {
                        return Ok(None);
                    }
                    if &buf[end..end + 2] != b"\r\n" {
                        return Err(bad("a bulk string longer than its length"));
                    }
                    at = end + 2;
                }
            }
            b'*' => {
                if let Ok(len) = usize::try_from(number()?) {
                    pending = pending
                        .checked_add(len)
                        .ok_or_else(|| bad("an array too long"))?;
                }
            }
            _ => return Err(bad("a type this client does not speak")),
        }
    }
    Ok(Some(at))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_cut_at_their_ends() {
        for frame in [
            &b"+OK\r\n"[..],
            b"-NOSCRIPT No matching script\r\n",
            b":42\r\n",
            b"$13\r\n1 99 0 100000\r\n",
            b"$0\r\n\r\n",
            b"$-1\r\n",
            b"*-1\r\n",
            b"*0\r\n",
            b"$4\r\na\r\nb\r\n",
            b"*2\r\n*3\r\n:0\r\n:5460\r\n*2\r\n$9\r\n127.0.0.1\r\n:7000\r\n$2\r\nhi\r\n",
        ] {
            assert_eq!(frame_len(frame).unwrap(), Some(frame.len()), "{frame:?}");
            // Every shorter prefix is incomplete, never a frame or an error.
            for cut in 0..frame.len() {
                assert_eq!(
                    frame_len(&frame[..cut]).unwrap(),
                    None,
                    "{frame:?} at {cut}"
                );
            }
            // A frame followed by the next one ends where it ends.
            let two = [frame, b":1\r\n"].concat();
            assert_eq!(frame_len(&two).unwrap(), Some(frame.len()));
        }
        for bad in [
            &b"!3\r\nabc\r\n"[..],
            b"$x\r\n",
            b"$3\r\nabcd\r\n",
            b"+OK\n",
            b"\r\n",
            b"\n",
            b"*1\r\n\r\n",
            b"*2\r\n:1\r\n\n",
        ] {
            assert!(frame_len(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn numbers_and_bulk_strings_are_written_as_the_redis_crate_writes_them() {
        for n in [0, 9, 10, 99, 123_456_789, 1_234_567_890, u64::MAX] {
            let mut ours = Vec::new();
            write_array_len(&mut ours, 2);
            write_number(&mut ours, n);
            write_bulk(&mut ours, b"x y");
            let theirs = redis::cmd(&n.to_string()).arg("x y").get_packed_command();
            assert_eq!(ours, theirs, "{n}");
        }
    }

    #[test]
    fn frames_decode_as_the_redis_crate_reads_them() {
        assert_eq!(
            bulk_string(b"$13\r\n1 99 0 100000\r\n"),
            Some(&b"1 99 0 100000"[..])
        );
        assert_eq!(bulk_string(b"$0\r\n\r\n"), Some(&b""[..]));
        for other in [&b"$-1\r\n"[..], b"+OK\r\n", b"$3\r\nab\r\n", b":1\r\n"] {
            assert_eq!(bulk_string(other), None, "{other:?}");
        }
        assert_eq!(decode(b"+OK\r\n").unwrap(), Value::Okay);
        assert_eq!(decode(b":7\r\n").unwrap(), Value::Int(7));
        assert_eq!(decode(b"$-1\r\n").unwrap(), Value::Nil);
        let error = decode(b"-NOSCRIPT No matching script.\r\n").unwrap_err();
        assert_eq!(
            error.kind(),
            redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
        );
    }
}
