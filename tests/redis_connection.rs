//! Our own pipelined connection to a standalone Redis
//! (`src/store/redis/pipe.rs`) against real redis-server processes: every
//! reply reaches the call that asked for it, through timeouts, lost
//! connections and a server that is not there yet.

use ratelimiter::store::redis::{RedisConnection, RedisSettings, Reply};
use redis::Value;
use std::sync::Arc;
use std::time::{Duration, Instant};
use testkit::RedisServer;

fn settings(url: String) -> RedisSettings {
    RedisSettings {
        prefix: "test:".into(),
        connect_timeout: Duration::from_millis(500),
        response_timeout: Duration::from_millis(300),
        ..RedisSettings::new(vec![url], false)
    }
}

async fn echo(connection: &RedisConnection, text: &str) -> redis::RedisResult<String> {
    let reply = connection.call(redis::cmd("ECHO").arg(text)).await?;
    match reply.into_value()? {
        Value::BulkString(bytes) => Ok(String::from_utf8(bytes).unwrap()),
        other => panic!("ECHO answered {other:?}"),
    }
}

/// A connection to `redis` whose first call has been answered: connected,
/// not just set up (the first call connects).
async fn connected(settings: &RedisSettings) -> RedisConnection {
    let connection = RedisConnection::connect(settings).await.unwrap();
    assert_eq!(echo(&connection, "connected").await.unwrap(), "connected");
    connection
}

/// Clients connected to `redis` other than the redis-cli asking.
fn clients(redis: &RedisServer) -> usize {
    let list = redis.cli(&["CLIENT", "LIST"]).unwrap();
    list.lines().filter(|l| !l.contains("cmd=client")).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_calls_each_get_their_own_reply() {
    let redis = RedisServer::start().unwrap();
    let connection = RedisConnection::connect(&settings(redis.url()))
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for task in 0..16 {
        let connection = connection.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..200 {
                let text = format!("{task}-{i}");
                if i % 10 == 0 {
                    // A pipeline's replies, in the middle of single calls.
                    let key = format!("k{task}");
                    let (set, got): (String, String) = redis::pipe()
                        .cmd("SET")
                        .arg(&key)
                        .arg(&text)
                        .cmd("GET")
                        .arg(&key)
                        .query_async(&mut connection.clone())
                        .await
                        .unwrap();
                    assert_eq!((set.as_str(), got.as_str()), ("OK", text.as_str()));
                } else {
                    assert_eq!(echo(&connection, &text).await.unwrap(), text);
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(clients(&redis), 1, "every call shares one connection");
    // A big reply, read over many reads, is one frame.
    let big = "x".repeat(1 << 20);
    assert_eq!(echo(&connection, &big).await.unwrap(), big);
    // An error reply is the redis crate's error for it.
    let error = connection
        .call(&redis::cmd("NO-SUCH-COMMAND"))
        .await
        .unwrap_err();
    assert_eq!(
        error.kind(),
        redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError)
    );
    assert_eq!(echo(&connection, "after").await.unwrap(), "after");
}

/// Read events Redis has handled since it started (`INFO stats`).
fn reads_processed(redis: &RedisServer) -> u64 {
    let info = redis.cli(&["INFO", "stats"]).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("total_reads_processed:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("total_reads_processed in INFO stats")
}

/// The shape of a loaded service on one core: one worker, and each check
/// awaited by its own task. The replies of one read wake all sixteen
/// callers at once; the first to queue its next command wakes the driver,
/// which tokio runs next (its LIFO slot). Written then, each command went
/// out in a syscall of its own, and woke Redis for it; the driver now lets
/// the others queue theirs first, and a round is one write, one read.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn calls_that_queue_together_go_out_in_one_write() {
    const TASKS: usize = 16;
    const ROUNDS: usize = 50;
    let redis = RedisServer::start().unwrap();
    let connection = connected(&settings(redis.url())).await;
    let before = reads_processed(&redis);
    // Each round starts together: the last task at the barrier wakes the
    // others, so all sixteen are ready to run when the first call queues.
    let barrier = Arc::new(tokio::sync::Barrier::new(TASKS));
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let (connection, barrier) = (connection.clone(), Arc::clone(&barrier));
            tokio::spawn(async move {
                for round in 0..ROUNDS {
                    barrier.wait().await;
                    let text = format!("{task}-{round}");
                    assert_eq!(echo(&connection, &text).await.unwrap(), text);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    // A round is one write, and so one read (the INFO calls' redis-cli
    // add a few): 52-53 here, idle or with three CPU hogs beside it.
    // Written one by one, the calls took 88-448 reads.
    let reads = reads_processed(&redis) - before;
    assert!(
        reads <= ROUNDS as u64 + 10,
        "{} calls in {ROUNDS} rounds took Redis {reads} reads: a round went out in many writes",
        TASKS * ROUNDS
    );
}

/// Parks of every worker of the current runtime so far.
fn parks() -> u64 {
    let metrics = tokio::runtime::Handle::current().metrics();
    (0..metrics.num_workers())
        .map(|w| metrics.worker_park_count(w))
        .sum()
}

/// From a worker, spawns `task(n)` for n in `0..count`, 2 ms apart; how
/// many times the runtime's workers parked meanwhile, and the tasks.
async fn parks_while_spawning<F>(
    count: u64,
    task: impl Fn(u64) -> F + Send + 'static,
) -> (u64, Vec<tokio::task::JoinHandle<F::Output>>)
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let before = parks();
    let tasks = tokio::spawn(async move {
        let mut tasks = Vec::new();
        for n in 0..count {
            tasks.push(tokio::spawn(task(n)));
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        tasks
    })
    .await
    .unwrap();
    // A worker reports its counts when it parks.
    tokio::time::sleep(Duration::from_millis(20)).await;
    (parks() - before, tasks)
}

/// Calls in flight together but queued apart, one at a time (a slow
/// Redis, requests arriving apart at a light load). Other calls in flight
/// are a sign that more commands are coming, and a yield is not free here:
/// woken by itself, the driver counts for tokio as a task yielding, and an
/// idle worker is woken to share the queue, a futex wake and a worker that
/// finds nothing and parks again, per call. So the driver trusts the sign
/// only while yielding gathers commands, and otherwise one time in 64
/// (`src/store/redis/pipe/gather.rs`), which keeps the parks near the
/// control's where taking it every time would park a worker per call
/// (the counts are in docs/performance.md, "When the driver writes").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_queued_alone_wakes_no_idle_worker() {
    const CALLS: u64 = 20;
    let redis = RedisServer::start().unwrap();
    let settings = RedisSettings {
        response_timeout: Duration::from_secs(10),
        ..settings(redis.url())
    };
    let connection = connected(&settings).await;
    // The same spawning with no Redis call: what the sleeps cost.
    let (control, _) = parks_while_spawning(CALLS, |_| async {}).await;
    // Stopped, Redis answers nothing: every call stays in flight, and each
    // new one finds the others waiting.
    redis.pause().unwrap();
    let (parked, calls) = parks_while_spawning(CALLS, move |n| {
        let connection = connection.clone();
        async move { echo(&connection, &n.to_string()).await }
    })
    .await;
    redis.resume().unwrap();
    for (n, call) in calls.into_iter().enumerate() {
        assert_eq!(call.await.unwrap().unwrap(), n.to_string());
    }
    assert!(
        parked < control + CALLS / 2,
        "{CALLS} calls queued apart: the runtime's workers parked {parked} times \
         ({control} for the same spawning without the calls)"
    );
}

/// A read that answered two calls is the other sign: their callers were
/// just woken and may call again. In a service they seldom do (a request
/// makes one check, then answers its client), so at a light load that
/// sign is as wrong as the other: pairs of calls 2 ms apart, each pair's
/// replies in one read. Trusted every time, it would cost a wasted yield
/// and an idle worker's wake-up a pair; trusted only while yields gather,
/// the parks stay within the control's own spread (the counts are in
/// docs/performance.md, "When the driver writes").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_after_a_read_that_answered_two_wake_no_idle_worker() {
    const PAIRS: u64 = 40;
    let redis = RedisServer::start().unwrap();
    let connection = connected(&settings(redis.url())).await;
    // The same spawning with one call a task: no sign at all, so never a
    // yield; what the sleeps and the round trips cost.
    let lone = connection.clone();
    let (control, singles) = parks_while_spawning(PAIRS, move |n| {
        let connection = lone.clone();
        async move {
            assert_eq!(
                echo(&connection, &n.to_string()).await.unwrap(),
                n.to_string()
            )
        }
    })
    .await;
    for single in singles {
        single.await.unwrap();
    }
    let (parked, pairs) = parks_while_spawning(PAIRS, move |n| {
        let connection = connection.clone();
        async move {
            let (a, b) = (format!("{n}a"), format!("{n}b"));
            let (got_a, got_b) = tokio::join!(echo(&connection, &a), echo(&connection, &b));
            assert_eq!((got_a.unwrap(), got_b.unwrap()), (a, b));
        }
    })
    .await;
    for pair in pairs {
        pair.await.unwrap();
    }
    assert!(
        parked < control + PAIRS / 2,
        "{PAIRS} pairs of calls apart: the runtime's workers parked {parked} times \
         ({control} for the same spawning with one call a task)"
    );
}

#[tokio::test]
async fn a_call_past_the_response_timeout_fails_and_its_late_reply_goes_nowhere() {
    let redis = RedisServer::start().unwrap();
    let connection = connected(&settings(redis.url())).await;
    redis.pause().unwrap();
    let started = Instant::now();
    let error = echo(&connection, "late").await.unwrap_err();
    assert!(error.is_timeout(), "{error}");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    redis.resume().unwrap();
    // The same connection: "late" is answered first and dropped; this call
    // gets its own reply, not that one.
    assert_eq!(echo(&connection, "next").await.unwrap(), "next");
    assert_eq!(clients(&redis), 1, "the connection was kept");
}

#[tokio::test]
async fn a_lost_connection_fails_its_calls_and_the_next_call_reconnects() {
    let mut redis = RedisServer::start().unwrap();
    let connection = connected(&settings(redis.url())).await;
    redis.kill().unwrap();
    let error = echo(&connection, "gone").await.unwrap_err();
    assert!(
        error.is_connection_dropped() || error.is_connection_refusal(),
        "{error}"
    );
    redis.restart().unwrap();
    assert_eq!(echo(&connection, "back").await.unwrap(), "back");
}

#[tokio::test]
async fn the_first_call_connects_so_a_service_can_start_before_redis() {
    let port = testkit::free_port().unwrap();
    let connection = RedisConnection::connect(&settings(format!("redis://127.0.0.1:{port}")))
        .await
        .unwrap();
    let error = echo(&connection, "nobody").await.unwrap_err();
    assert!(error.is_connection_refusal(), "{error}");
    let redis = RedisServer::start_on(port, &[]).unwrap();
    assert_eq!(echo(&connection, "there").await.unwrap(), "there");
    drop(connection);
    // The last handle gone, the connection closes.
    let deadline = Instant::now() + Duration::from_secs(5);
    while clients(&redis) > 0 {
        assert!(Instant::now() < deadline, "the connection stayed open");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn the_url_password_and_database_are_used() {
    let redis = RedisServer::start_with(&["--requirepass", "s3cret"]).unwrap();
    let url = redis.url().replace("redis://", "redis://:s3cret@") + "/3";
    let connection = RedisConnection::connect(&settings(url)).await.unwrap();
    let reply = connection
        .call(redis::cmd("SET").arg("where").arg("db3"))
        .await
        .unwrap();
    assert!(matches!(reply, Reply::Frame(_)), "{reply:?}");
    assert_eq!(reply.into_value().unwrap(), Value::Okay);
    let got = redis
        .cli(&[
            "-a",
            "s3cret",
            "--no-auth-warning",
            "-n",
            "3",
            "GET",
            "where",
        ])
        .unwrap();
    assert_eq!(got.trim(), "db3");
    // A wrong password is the server's refusal, not a network failure.
    let url = redis.url().replace("redis://", "redis://:wrong@");
    let connection = RedisConnection::connect(&settings(url)).await.unwrap();
    let error = echo(&connection, "x").await.unwrap_err();
    assert_eq!(
        ratelimiter::store::redis_error_kind(&error),
        "auth",
        "{error}"
    );
}

#[tokio::test]
async fn a_call_queued_behind_a_stuck_write_still_times_out() {
    let redis = RedisServer::start().unwrap();
    let connection = connected(&settings(redis.url())).await;
    redis.pause().unwrap();
    // 64 MiB that a hung Redis never reads: the write fills the socket's
    // buffers and stays stuck, and the next call cannot even be written.
    let big = "x".repeat(64 << 20);
    let (stuck, behind) = tokio::time::timeout(Duration::from_secs(10), async {
        tokio::join!(echo(&connection, &big), async {
            // Queued once the big write is under way, so not taken with it.
            tokio::time::sleep(Duration::from_millis(100)).await;
            echo(&connection, "behind").await
        })
    })
    .await
    .expect("calls waited past their response timeout");
    assert!(stuck.unwrap_err().is_timeout());
    let behind = behind.unwrap_err();
    assert!(behind.is_timeout(), "{behind}");
    redis.resume().unwrap();
}

#[tokio::test]
async fn an_empty_pipeline_sends_nothing_and_breaks_nothing() {
    let redis = RedisServer::start().unwrap();
    let connection = RedisConnection::connect(&settings(redis.url()))
        .await
        .unwrap();
    let () = redis::pipe()
        .query_async(&mut connection.clone())
        .await
        .unwrap();
    assert_eq!(echo(&connection, "after").await.unwrap(), "after");
}
