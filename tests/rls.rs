//! Envoy's rate limit service as Envoy meets it: the binary started with
//! `config/rls.toml` and `--rls-listen`, asked over gRPC by the client
//! generated from Envoy's own protos, in memory and on a real Redis. And
//! the committed generated code checked against those protos.

use ratelimiter::rls::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use ratelimiter::rls::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use ratelimiter::rls::proto::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use ratelimiter::rls::proto::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus,
};
use ratelimiter::rls::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use ratelimiter::rls::proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;
use testkit::{ChildGuard, RedisCluster, RedisServer, TempDir, free_port, wait_for_port};
use tonic::transport::Channel;

const BIN: &str = env!("CARGO_BIN_EXE_ratelimiter");
const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The binary on `config/rls.toml` with `args`; its gRPC port.
fn start(args: &[&str]) -> (ChildGuard, u16) {
    start_with(args, &[])
}

/// `command` (the binary, or a shell that runs it) given
/// `config/rls.toml` and free ports to listen on; its gRPC port.
fn on_free_ports(command: &mut Command) -> u16 {
    let (http, grpc) = (free_port().unwrap(), free_port().unwrap());
    command
        .args(["--config", &format!("{ROOT}/config/rls.toml")])
        .args(["--listen", &format!("127.0.0.1:{http}")])
        .args(["--rls-listen", &format!("127.0.0.1:{grpc}")]);
    grpc
}

/// [`start`], with `env` set.
fn start_with(args: &[&str], env: &[(&str, &str)]) -> (ChildGuard, u16) {
    let mut command = Command::new(BIN);
    let grpc = on_free_ports(&mut command);
    let child = command
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let guard = ChildGuard(child);
    wait_for_port(grpc, "the rate limit service").unwrap();
    (guard, grpc)
}

async fn client(port: u16) -> RateLimitServiceClient<Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    RateLimitServiceClient::new(channel)
}

fn descriptor(entries: &[(&str, &str)], hits: Option<u64>) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect(),
        hits_addend: hits,
        ..Default::default()
    }
}

fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>, hits: u32) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend: hits,
    }
}

async fn ask(
    client: &mut RateLimitServiceClient<Channel>,
    request: RateLimitRequest,
) -> Result<RateLimitResponse, tonic::Status> {
    client
        .should_rate_limit(request)
        .await
        .map(tonic::Response::into_inner)
}

/// One descriptor's answer.
async fn one(
    client: &mut RateLimitServiceClient<Channel>,
    entries: &[(&str, &str)],
    hits: Option<u64>,
) -> DescriptorStatus {
    let r = ask(client, request("demo", vec![descriptor(entries, hits)], 0))
        .await
        .unwrap();
    assert_eq!(r.statuses.len(), 1);
    assert_eq!(r.overall_code, r.statuses[0].code);
    r.statuses.into_iter().next().unwrap()
}

fn header<'a>(r: &'a RateLimitResponse, name: &str) -> Option<&'a str> {
    r.response_headers_to_add
        .iter()
        .find(|h| h.key == name)
        .map(|h| h.value.as_str())
}

/// 100 at once, then 10/s: the burst is admitted whole (refill only
/// adds), then a refusal within what the elapsed time refilled. The
/// refusal.
async fn burst_then_over_limit(
    c: &mut RateLimitServiceClient<Channel>,
    entries: &[(&str, &str)],
) -> DescriptorStatus {
    let started = Instant::now();
    let first = one(c, entries, None).await;
    assert_eq!(first.code, Code::Ok as i32);
    assert_eq!(first.limit_remaining, 99);
    for _ in 1..100 {
        assert_eq!(one(c, entries, None).await.code, Code::Ok as i32);
    }
    let mut admitted = 100u64;
    loop {
        let s = one(c, entries, None).await;
        if s.code == Code::OverLimit as i32 {
            return s;
        }
        admitted += 1;
        let refilled = (started.elapsed().as_secs_f64() * 10.0).ceil() as u64;
        assert!(admitted <= 100 + refilled, "{admitted} admitted");
    }
}

/// What `config/rls.toml` promises, asked as Envoy asks. `tag` keeps the
/// runs' buckets apart on a shared store.
async fn the_example_domain(port: u16, tag: &str) {
    let mut c = client(port).await;
    let key = format!("{tag}-burst");
    let api_key = [("api_key", key.as_str())];

    let refused = burst_then_over_limit(&mut c, &api_key).await;
    let limit = refused.current_limit.as_ref().expect("a limit");
    assert_eq!(
        (limit.name.as_str(), limit.requests_per_unit, limit.unit),
        ("per-api-key", 10, Unit::Second as i32)
    );
    assert_eq!(refused.limit_remaining, 0);
    // Until full: 100 tokens at 10/s, rounded up to a second.
    assert_eq!(refused.duration_until_reset.unwrap().seconds, 10);

    // The refusal's header fields, for Envoy to pass on.
    let r = ask(&mut c, request("demo", vec![descriptor(&api_key, None)], 0))
        .await
        .unwrap();
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(
        header(&r, "ratelimit-policy"),
        Some("\"per-api-key\";q=100;w=10")
    );
    assert_eq!(header(&r, "retry-after"), Some("1"));
    assert_eq!(header(&r, "ratelimit-remaining"), Some("0"));

    // hits_addend is the cost: 0 reads, a descriptor's beats the
    // request's, the request's applies otherwise, and one above the burst
    // is refused without taking anything.
    let key = format!("{tag}-hits");
    let api_key = [("api_key", key.as_str())];
    let peek = one(&mut c, &api_key, Some(0)).await;
    assert_eq!((peek.code, peek.limit_remaining), (Code::Ok as i32, 100));
    let took = one(&mut c, &api_key, Some(60)).await;
    assert_eq!((took.code, took.limit_remaining), (Code::Ok as i32, 40));
    let too_many = one(&mut c, &api_key, Some(60)).await;
    assert_eq!(too_many.code, Code::OverLimit as i32);
    assert!((40..=41).contains(&too_many.limit_remaining));
    let huge = one(&mut c, &api_key, Some(u64::MAX)).await;
    assert_eq!(huge.code, Code::OverLimit as i32);
    let r = ask(
        &mut c,
        request("demo", vec![descriptor(&api_key, None)], 30),
    )
    .await
    .unwrap();
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert!((10..=12).contains(&r.statuses[0].limit_remaining));
    let r = ask(
        &mut c,
        request("demo", vec![descriptor(&api_key, Some(0))], 30),
    )
    .await
    .unwrap();
    assert!((10..=12).contains(&r.statuses[0].limit_remaining));

    // Unmatched: no rule for the key, a value with no rule, an entry too
    // many, a rule without a policy of its own, another domain. OK, no
    // limit.
    for (domain, entries) in [
        ("demo", vec![("user", "u1")]),
        ("demo", vec![("path", "/other")]),
        ("demo", vec![("api_key", "k"), ("method", "GET")]),
        ("demo", vec![("path", "/login")]),
        ("elsewhere", vec![("api_key", "k")]),
    ] {
        let r = ask(&mut c, request(domain, vec![descriptor(&entries, None)], 0))
            .await
            .unwrap();
        assert_eq!(r.overall_code, Code::Ok as i32, "{domain} {entries:?}");
        assert_eq!(r.statuses[0].current_limit, None, "{domain} {entries:?}");
        assert!(r.response_headers_to_add.is_empty());
    }

    // Nested: per address on /login, 5 at once.
    let address = format!("{tag}-192.0.2.1");
    let login = [("path", "/login"), ("remote_address", address.as_str())];
    for _ in 0..5 {
        assert_eq!(one(&mut c, &login, None).await.code, Code::Ok as i32);
    }
    let refused = one(&mut c, &login, None).await;
    assert_eq!(refused.code, Code::OverLimit as i32);
    let limit = refused.current_limit.unwrap();
    assert_eq!(
        (limit.name.as_str(), limit.requests_per_unit, limit.unit),
        ("login", 6, Unit::Minute as i32)
    );

    // Several descriptors: each decided, the answer over the limit if
    // any is, with the refused one's fields.
    let fresh = format!("{tag}-fresh");
    let r = ask(
        &mut c,
        request(
            "demo",
            vec![
                descriptor(&[("api_key", fresh.as_str())], None),
                descriptor(&login, None),
            ],
            0,
        ),
    )
    .await
    .unwrap();
    let codes: Vec<i32> = r.statuses.iter().map(|s| s.code).collect();
    assert_eq!(codes, [Code::Ok as i32, Code::OverLimit as i32]);
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(header(&r, "ratelimit-policy"), Some("\"login\";q=5;w=50"));
}

/// Bad requests get a clear status and take nothing.
async fn bad_input(port: u16, tag: &str) {
    let mut c = client(port).await;
    let key = format!("{tag}-bad");
    let good = descriptor(&[("api_key", key.as_str())], None);
    let cases = [
        (
            request("", vec![good.clone()], 0),
            "domain must not be empty",
        ),
        (request("demo", vec![], 0), "descriptors must not be empty"),
        (
            request("demo", vec![good.clone(), descriptor(&[], None)], 0),
            "descriptors[1] has no entries",
        ),
        (
            request("demo", vec![descriptor(&[("", "v")], None)], 0),
            "descriptors[0].entries[0].key must not be empty",
        ),
        (request("demo", vec![good.clone(); 65], 0), "at most 64"),
        (
            request(
                "demo",
                vec![descriptor(&[(&"k".repeat(2000), "v")], None)],
                0,
            ),
            "descriptors[0].entries[0].key is longer than 1024 bytes",
        ),
    ];
    for (req, says) in cases {
        let status = ask(&mut c, req).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains(says), "{status:?}");
    }
    // Above rls.max_message_bytes (4 MiB): refused before it is decoded.
    let entries: Vec<(&str, &str)> = vec![("api_key", "x"); 16];
    let big = request(
        "demo",
        (0..64)
            .map(|_| {
                let mut d = descriptor(&entries, None);
                for e in &mut d.entries {
                    e.value = "v".repeat(5000);
                }
                d
            })
            .collect(),
        0,
    );
    let status = ask(&mut c, big).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::OutOfRange, "{status:?}");
    // None of it took a token, and the service still answers.
    let s = one(&mut c, &[("api_key", key.as_str())], None).await;
    assert_eq!((s.code, s.limit_remaining), (Code::Ok as i32, 99));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoys_client_gets_the_example_domain_in_memory() {
    let (_service, port) = start(&["--backend", "memory"]);
    the_example_domain(port, "m").await;
    bad_input(port, "m").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoys_client_gets_the_example_domain_on_redis() {
    let redis = RedisServer::start().unwrap();
    let (_service, port) = start(&[
        "--backend",
        "lua",
        "--redis-url",
        &redis.url(),
        "--key-secret",
        "rls-test-secret-0123456789",
    ]);
    the_example_domain(port, "r").await;
    bad_input(port, "r").await;
    // The buckets are in Redis.
    let keys = redis.cli(&["DBSIZE"]).unwrap();
    assert!(keys.trim().parse::<u64>().unwrap() >= 4, "{keys}");
}

/// On a Redis Cluster: the same answers, with the buckets spread over
/// the masters by their slots (the login policy's deny cache included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoys_client_gets_the_example_domain_on_a_cluster() {
    let cluster = RedisCluster::start().unwrap();
    let mut args = vec![
        "--backend",
        "lua",
        "--key-secret",
        "rls-test-secret-0123456789",
    ];
    let urls = cluster.urls();
    for url in &urls {
        args.extend(["--redis-cluster", url.as_str()]);
    }
    let (_service, port) = start(&args);
    the_example_domain(port, "c").await;
    bad_input(port, "c").await;
    let keys: Vec<u64> = cluster
        .nodes
        .iter()
        .map(|node| node.cli(&["DBSIZE"]).unwrap().trim().parse().unwrap())
        .collect();
    assert!(keys.iter().sum::<u64>() >= 4, "{keys:?}");
    assert!(
        keys.iter().filter(|&&n| n > 0).count() >= 2,
        "one node holds every bucket: {keys:?}"
    );
}

/// A value is what a client sent (Envoy's `request_headers` action copies
/// a header): a long one is limited like any other, never refused, since
/// Envoy lets a request the service refuses through unlimited. Each value
/// is its own bucket, whatever its length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_value_is_limited_like_any_other() {
    let (_service, port) = start(&["--backend", "memory"]);
    let mut c = client(port).await;
    let long = "k".repeat(50_000);
    burst_then_over_limit(&mut c, &[("api_key", long.as_str())]).await;
    let other = format!("{}j", &long[1..]);
    let s = one(&mut c, &[("api_key", other.as_str())], None).await;
    assert_eq!((s.code, s.limit_remaining), (Code::Ok as i32, 99));
}

/// Out of descriptors, the service waits for one to come back rather than
/// retry `accept` at once (tonic's own accept loop does, logging nothing
/// above trace, a core spinning until a descriptor frees), says so, and
/// answers again once connections close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_descriptors_the_service_waits_says_so_and_recovers() {
    let dir = TempDir::new("rls-emfile").unwrap();
    let log = dir.join("stderr");
    let mut command = Command::new("sh");
    command
        .args(["-c", "ulimit -n 64 && exec \"$0\" \"$@\""])
        .arg(BIN);
    let grpc = on_free_ports(&mut command);
    let _service = ChildGuard(
        command
            .args(["--backend", "memory"])
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    wait_for_port(grpc, "the rate limit service").unwrap();
    // More connections than descriptors: the kernel completes them all
    // and queues what the process cannot take.
    let held: Vec<_> = (0..120)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", grpc)).unwrap())
        .collect();
    let failures = || {
        std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .filter(|l| l.contains("accept failed") && l.contains("rls"))
            .count()
    };
    let deadline = Instant::now() + std::time::Duration::from_secs(10);
    while failures() == 0 {
        assert!(Instant::now() < deadline, "no accept failure logged");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // A failure a retry, a retry every 100 ms: a second is about ten.
    let before = failures();
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let in_a_second = failures() - before;
    assert!(
        (1..=30).contains(&in_a_second),
        "{in_a_second} failures in a second"
    );
    drop(held);
    let deadline = Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let answered = async {
            let channel =
                tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{grpc}"))
                    .ok()?
                    .connect()
                    .await
                    .ok()?;
            let mut c = RateLimitServiceClient::new(channel);
            ask(
                &mut c,
                request("demo", vec![descriptor(&[("api_key", "k")], None)], 1),
            )
            .await
            .ok()
        };
        if let Some(r) = answered.await {
            assert_eq!(r.overall_code, Code::Ok as i32);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not served after the connections closed"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// A call is one trace under Envoy's span: the RPC's server span, a
/// check span per descriptor under it, each check's Redis call under that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_is_one_trace_under_envoys_span() {
    const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const ENVOYS_SPAN: &str = "00f067aa0ba902b7";
    let redis = RedisServer::start().unwrap();
    let receiver = testkit::OtlpReceiver::start().await.unwrap();
    let (_service, port) = start_with(
        &[
            "--backend",
            "lua",
            "--redis-url",
            &redis.url(),
            "--key-secret",
            "rls-test-secret-0123456789",
            // About spans, not latency: no deadline misses on a busy machine.
            "--failure-deadline",
            "2s",
            "--redis-response-timeout",
            "2s",
        ],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.grpc),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("RL_TRACE_BATCH_DELAY", "100ms"),
        ],
    );
    let mut c = client(port).await;
    let mut call = tonic::Request::new(request(
        "demo",
        vec![
            descriptor(&[("api_key", "traced-a")], None),
            descriptor(&[("api_key", "traced-b")], None),
        ],
        0,
    ));
    call.metadata_mut().insert(
        "traceparent",
        format!("00-{TRACE}-{ENVOYS_SPAN}-01").parse().unwrap(),
    );
    let answer = c.should_rate_limit(call).await.unwrap().into_inner();
    assert_eq!(answer.overall_code, Code::Ok as i32);
    let spans = receiver
        .trace(TRACE, 5, std::time::Duration::from_secs(10))
        .await
        .unwrap();
    fn named<'a>(
        spans: &'a [testkit::ReceivedSpan],
        name: &'a str,
    ) -> impl Iterator<Item = &'a testkit::ReceivedSpan> {
        spans.iter().filter(move |s| s.name == name)
    }
    let rpc: Vec<_> = named(
        &spans,
        "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
    )
    .collect();
    assert_eq!(rpc.len(), 1, "{spans:#?}");
    let rpc = rpc[0];
    assert_eq!((rpc.parent_span_id.as_str(), rpc.kind), (ENVOYS_SPAN, 2));
    assert_eq!(
        rpc.attributes.get("rpc.system").map(String::as_str),
        Some("grpc")
    );
    assert_eq!(
        rpc.attributes
            .get("rpc.grpc.status_code")
            .map(String::as_str),
        Some("OK")
    );
    let checks: Vec<_> = named(&spans, "ratelimit.check").collect();
    assert_eq!(checks.len(), 2, "{spans:#?}");
    for check in &checks {
        assert_eq!(check.parent_span_id, rpc.span_id);
        assert_eq!(
            check
                .attributes
                .get("ratelimit.key_kind")
                .map(String::as_str),
            Some("descriptor")
        );
        let calls: Vec<_> = named(&spans, "EVALSHA")
            .filter(|s| s.parent_span_id == check.span_id)
            .collect();
        assert_eq!(calls.len(), 1, "{spans:#?}");
    }
    // Never a descriptor's value.
    for span in &spans {
        for value in span.attributes.values() {
            assert!(!value.contains("traced-"), "{span:#?}");
        }
    }
}

/// The generated packages committed in src/rls/generated/, by file name,
/// and the name `tonic-prost-build` gives each.
const GENERATED: [(&str, &str); 5] = [
    ("envoy.config.core.v3.rs", "envoy.config.core.v3.rs"),
    (
        "envoy.extensions.common.ratelimit.v3.rs",
        "envoy.extensions.common.ratelimit.v3.rs",
    ),
    (
        "envoy.service.ratelimit.v3.rs",
        "envoy.service.ratelimit.v3.rs",
    ),
    ("envoy.type.v3.rs", "envoy.r#type.v3.rs"),
    ("xds.core.v3.rs", "xds.core.v3.rs"),
];

#[test]
fn generated_code_is_what_envoys_protos_generate() {
    let out = testkit::TempDir::new("rls-gen").unwrap();
    let proto = Path::new(ROOT).join("proto");
    tonic_prost_build::configure()
        .out_dir(&out.0)
        .build_transport(false)
        .compile_protos(
            &[proto.join("envoy/service/ratelimit/v3/rls.proto")],
            &[proto],
        )
        .expect("protoc (Debian: protobuf-compiler, libprotobuf-dev) compiles Envoy's protos");
    let committed = Path::new(ROOT).join("src/rls/generated");
    let regenerate = std::env::var_os("RLS_REGENERATE").is_some();
    for (ours, theirs) in GENERATED {
        let fresh = std::fs::read_to_string(out.0.join(theirs)).unwrap();
        if regenerate {
            std::fs::write(committed.join(ours), &fresh).unwrap();
            continue;
        }
        let kept = std::fs::read_to_string(committed.join(ours)).unwrap();
        assert!(
            kept == fresh,
            "src/rls/generated/{ours} differs from what proto/ generates: RLS_REGENERATE=1 cargo test --test rls generated_code"
        );
    }
}

/// The Envoy example (`examples/envoy/envoy.yaml`) asks what
/// `config/rls.toml` answers: its domain, the limiter's gRPC port, and
/// descriptors that each reach a policy. No Envoy binary can be had here
/// to load it; this keeps the two files agreeing.
#[test]
fn the_envoy_example_asks_what_the_example_config_answers() {
    use ratelimiter::config::Config;
    use serde_yaml::Value;
    let envoy: Value = serde_yaml::from_str(
        &std::fs::read_to_string(format!("{ROOT}/examples/envoy/envoy.yaml")).unwrap(),
    )
    .unwrap();
    let config =
        Config::from_toml(&std::fs::read_to_string(format!("{ROOT}/config/rls.toml")).unwrap())
            .unwrap();
    let listener = &envoy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
    let filter = &listener["http_filters"][0]["typed_config"];
    assert_eq!(filter["domain"], "demo");
    assert!(config.rls.domains.iter().any(|d| d.name == "demo"));
    assert_eq!(filter["rate_limit_service"]["transport_api_version"], "V3");
    let cluster = filter["rate_limit_service"]["grpc_service"]["envoy_grpc"]["cluster_name"]
        .as_str()
        .unwrap();
    let clusters = envoy["static_resources"]["clusters"].as_sequence().unwrap();
    let rls = clusters.iter().find(|c| c["name"] == cluster).unwrap();
    let port = &rls["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
        ["port_value"];
    assert_eq!(
        port.as_u64(),
        config.rls.listen.map(|a| u64::from(a.port())),
        "the rate limit cluster's port"
    );
    // gRPC needs HTTP/2 to the limiter.
    assert!(
        rls["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
            ["explicit_http_config"]["http2_protocol_options"]
            .is_mapping()
    );

    // Each route's actions, as the descriptor entries Envoy makes of them
    // (a header's or an address's value stands in as "x"), reach a policy.
    let policies = ratelimiter::policy::Policies::new(&config.policies, config.failover.mode);
    let rules =
        ratelimiter::descriptors::DescriptorRules::new(&config.rls.domains, |n| policies.named(n));
    let routes = listener["route_config"]["virtual_hosts"][0]["routes"]
        .as_sequence()
        .unwrap();
    let mut reached = Vec::new();
    let mut most_headers = 0;
    for route in routes {
        let limits = route["route"]["rate_limits"].as_sequence().unwrap();
        // The descriptors a request on this route brings that copy a
        // header a client sent.
        let headers = limits
            .iter()
            .flat_map(|l| l["actions"].as_sequence().unwrap())
            .filter(|a| a.get("request_headers").is_some())
            .count();
        most_headers = most_headers.max(headers);
        for limit in limits {
            let entries: Vec<(String, String)> = limit["actions"]
                .as_sequence()
                .unwrap()
                .iter()
                .map(|action| {
                    if let Some(g) = action.get("generic_key") {
                        (
                            g.get("descriptor_key")
                                .and_then(Value::as_str)
                                .unwrap_or("generic_key")
                                .to_owned(),
                            g["descriptor_value"].as_str().unwrap().to_owned(),
                        )
                    } else if action.get("remote_address").is_some() {
                        ("remote_address".into(), "x".into())
                    } else if let Some(h) = action.get("request_headers") {
                        (h["descriptor_key"].as_str().unwrap().to_owned(), "x".into())
                    } else {
                        panic!("an action this test does not know: {action:?}")
                    }
                })
                .collect();
            let found = rules
                .find(
                    "demo",
                    entries.iter().map(|(k, v)| (k.as_str(), v.as_str())),
                )
                .map(|i| policies.get(i).name.to_string());
            assert!(found.is_some(), "{entries:?} reaches no policy");
            reached.extend(found);
        }
    }
    reached.sort();
    assert_eq!(reached, ["expensive", "login", "per-api-key"]);
    // A message the limiter refused for its size would go through Envoy
    // unlimited (failure_mode_deny: false): what Envoy lets a client send
    // in headers, copied into descriptors, fits well under the bound.
    assert_eq!(filter["failure_mode_deny"], false);
    let header_kb = listener["max_request_headers_kb"].as_u64().unwrap();
    assert!(most_headers >= 1, "no descriptor copies a header");
    let largest = header_kb * 1024 * most_headers as u64 + 64 * 1024;
    assert!(
        config.rls.max_message_bytes as u64 >= largest,
        "{} bytes allowed, {largest} possible",
        config.rls.max_message_bytes
    );
}
