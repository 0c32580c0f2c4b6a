//! The testkit's servers do what the fault scenarios rely on.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;
use testkit::RedisServer;

/// One RESP command over a fresh connection; `None` if nothing came back
/// within `wait`.
fn ask(port: u16, command: &str, wait: Duration) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(wait)).ok()?;
    stream.write_all(command.as_bytes()).ok()?;
    let mut buf = [0u8; 256];
    let n = stream.read(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
}

#[test]
fn a_redis_server_can_be_killed_restarted_empty_paused_and_resumed() {
    let mut redis = RedisServer::start().unwrap();
    let port = redis.port;
    assert_eq!(redis.cli(&["set", "k", "v"]).unwrap().trim(), "OK");
    redis.kill().unwrap();
    assert!(
        TcpStream::connect(("127.0.0.1", port)).is_err(),
        "still listening"
    );
    redis.restart().unwrap();
    assert_eq!(redis.port, port, "same port");
    assert_eq!(
        redis.cli(&["get", "k"]).unwrap().trim(),
        "",
        "restarted empty"
    );

    redis.pause().unwrap();
    // Connections are accepted by the kernel, but nobody answers.
    assert_eq!(ask(port, "PING\r\n", Duration::from_millis(300)), None);
    redis.resume().unwrap();
    assert_eq!(
        ask(port, "PING\r\n", Duration::from_secs(5)).as_deref(),
        Some("+PONG\r\n")
    );
}

#[test]
fn a_cpu_limit_holds_the_server_across_a_restart() {
    let mut redis = RedisServer::start().unwrap();
    redis.limit_cpu(0.25).unwrap();
    let limit = redis.cpu_limit().unwrap();
    assert_eq!(limit.quota_us(), 25_000, "a quarter of each 100 ms period");
    assert_eq!(limit.pids().unwrap(), vec![redis.pid().unwrap()]);
    redis.kill().unwrap();
    redis.restart().unwrap();
    let limit = redis.cpu_limit().unwrap();
    assert_eq!(limit.pids().unwrap(), vec![redis.pid().unwrap()]);
}

#[test]
fn no_port_is_handed_out_twice() {
    // The kernel picks free ports at random from about 14 000: two
    // thousand asks without the record would repeat some hundreds of times.
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..2000 {
        let port = testkit::free_port().unwrap();
        assert!(seen.insert(port), "port {port} was handed out twice");
    }
    let block = testkit::free_port_block(3, true).unwrap();
    for port in block..block + 3 {
        assert!(seen.insert(port), "port {port} was handed out twice");
    }
}

#[test]
fn a_server_that_cannot_bind_its_port_does_not_start() {
    // Another server answering on the port is not this one being up: a
    // test would pause or count the wrong server.
    let first = RedisServer::start().unwrap();
    let port = first.url().rsplit_once(':').unwrap().1.parse().unwrap();
    let error = RedisServer::start_on(port, &[]).unwrap_err().to_string();
    assert!(error.contains("exited"), "{error}");
}
