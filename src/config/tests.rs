use super::*;
use crate::algorithm::{Algorithm, Limit};
use crate::telemetry::{OtlpProtocol, SamplerKind};
use clap::Parser;
use std::time::Duration;

#[test]
fn no_file_gives_the_documented_defaults() {
    let c = Config::load(Cli::default()).unwrap();
    assert_eq!(c.listen, "127.0.0.1:8080".parse().unwrap());
    assert_eq!(c.backend, Backend::Memory);
    assert_eq!(c.ipv6_prefix, 64);
    assert_eq!(
        c.memory,
        MemoryConfig {
            max_keys: 1_000_000,
            shards: 64
        }
    );
    assert!(c.trusted_proxies.is_empty());
    assert!(c.key_secret.is_none());
    assert_eq!(c.policies.len(), 1, "one built-in policy");
    let p = &c.policies[0];
    assert_eq!(
        (p.name.as_str(), p.route.as_deref().unwrap_or(""), p.cost),
        ("api", "/api/", 1)
    );
    assert_eq!(p.limit, Some(Limit::per_second(100, 10).unwrap()));
    assert_eq!(p.anonymous, p.limit);
    assert!(p.methods.is_empty() && p.failure_mode.is_none());
    assert!(!p.shadow && !p.deny_cache && p.lease == 0 && p.shards == 1);
    // Redis, as docs/configuration.md says.
    let r = &c.redis;
    assert_eq!(r.urls, ["redis://127.0.0.1:6379"]);
    assert!(!r.cluster);
    assert_eq!(r.prefix, "rl:");
    assert_eq!(r.connect_timeout, Duration::from_millis(200));
    assert_eq!(r.response_timeout, Duration::from_millis(50));
    assert_eq!(r.retries, 1);
    assert_eq!(r.ttl_margin, Duration::from_secs(1));
    assert_eq!(r.topology_refresh, Duration::from_secs(1));
    assert_eq!(
        *r,
        crate::store::redis::RedisSettings::new(r.urls.clone(), false),
        "RedisSettings::new is the file's defaults"
    );
    // Failure: local share, 10 ms, one instance, 5 failures, 500 ms.
    let f = &c.failover;
    assert_eq!(f.mode, crate::store::FailureMode::Local);
    assert_eq!(f.deadline, Duration::from_millis(10));
    assert_eq!(f.instances, 1);
    assert_eq!(f.breaker_failures, 5);
    assert_eq!(f.breaker_cooldown, Duration::from_millis(500));
    // The rest of the table.
    assert_eq!(c.near_limit_fraction, 0.2);
    assert_eq!(c.deny_cache_max_keys, 100_000);
    assert_eq!(c.trusted_proxy_warn_addresses, 256);
    let h = &c.hot_keys;
    assert_eq!(
        (h.tracked, h.top, h.window),
        (128, 5, Duration::from_secs(10))
    );
    // Client addresses reach the metrics only as a short hash unless an
    // operator opts in.
    assert_eq!(h.addresses, crate::hotkeys::AddressDisplay::Hash);
    let http = &c.http;
    assert_eq!(http.header_timeout, Duration::from_secs(10));
    assert_eq!(http.request_timeout, Duration::from_secs(30));
    assert_eq!(
        (http.max_connections, http.max_connections_per_address),
        (512, 128)
    );
    assert_eq!(http.body_limit, 2_097_152);
    let t = &c.tracing;
    assert!(t.endpoint.is_none());
    assert_eq!(t.service_name, "ratelimiter");
    assert_eq!(t.sampler_arg, 1.0);
    assert_eq!(t.queue_size, 2048);
    assert_eq!(t.batch_delay, Duration::from_secs(1));
    assert_eq!(t.export_timeout, Duration::from_secs(5));
}

#[test]
fn flags_override_the_file() {
    let dir = std::env::temp_dir().join(format!("rl-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("c.toml");
    std::fs::write(&path, "listen = \"127.0.0.1:1\"\ninstance_id = \"from-file\"\ntrusted_proxies = [\"10.0.0.0/8\"]\n").unwrap();
    let cli = Cli {
        config: Some(path.clone()),
        listen: Some("127.0.0.1:2".into()),
        ..Cli::default()
    };
    let c = Config::load(cli).unwrap();
    assert_eq!(c.listen.port(), 2);
    assert_eq!(c.instance_id, "from-file");
    assert_eq!(
        c.trusted_proxies,
        vec!["10.0.0.0/8".parse::<IpNet>().unwrap()]
    );
    let cli = Cli {
        config: Some(path),
        trusted_proxies: vec!["127.0.0.1".into()],
        ..Cli::default()
    };
    assert_eq!(
        Config::load(cli).unwrap().trusted_proxies,
        vec!["127.0.0.1/32".parse::<IpNet>().unwrap()]
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn cli_reads_env_names_and_flags() {
    let cli = Cli::try_parse_from([
        "ratelimiter",
        "--listen",
        "127.0.0.1:9",
        "--backend",
        "memory",
        "--trusted-proxy",
        "10.0.0.0/8",
        "--trusted-proxy",
        "192.168.0.1",
        "--instance-id",
        "api-1",
    ])
    .unwrap();
    let c = Config::load(cli).unwrap();
    assert_eq!(c.trusted_proxies.len(), 2);
    assert_eq!(c.instance_id, "api-1");
    assert!(Cli::try_parse_from(["ratelimiter", "--backend", "carrier-pigeon"]).is_err());
}

#[test]
fn the_example_config_is_valid() {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/example.toml"))
        .unwrap();
    let c = Config::from_toml(&text).unwrap();
    assert!(
        c.policies.iter().any(|p| p.limit.is_none()),
        "example shows an unlimited route"
    );
    assert!(
        c.policies.iter().any(|p| p.limit != p.anonymous),
        "example shows an anonymous limit"
    );
    assert!(!c.api_keys.is_empty());
}

#[test]
fn periods_parse() {
    assert_eq!(parse_period("500ms"), Ok(Duration::from_millis(500)));
    assert_eq!(parse_period("2m"), Ok(Duration::from_secs(120)));
    assert_eq!(parse_period("1d"), Ok(Duration::from_secs(86_400)));
    assert!(parse_period("0s").is_err());
    assert!(parse_period("10").is_err());
    assert!(parse_period("s").is_err());
    assert!(parse_period("1 week").is_err());
}

/// Every file in tests/fixtures/bad-config starts with `# field: <name>` and
/// must be refused with an error that names that field; a `# error: <text>`
/// line next says what else the error must say (for a refusal that could
/// name the right field for a wrong reason).
#[test]
fn each_bad_config_fixture_is_refused_naming_its_field() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/bad-config");
    let mut checked = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let field = text
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("# field: "))
            .unwrap_or_else(|| panic!("{} lacks a '# field:' first line", path.display()))
            .trim();
        let err = match Config::from_toml(&text) {
            Ok(_) => panic!("{} was accepted", path.display()),
            Err(e) => e.to_string(),
        };
        assert!(
            err.contains(field),
            "{}: error {err:?} does not name {field:?}",
            path.display()
        );
        if let Some(says) = text
            .lines()
            .nth(1)
            .and_then(|l| l.strip_prefix("# error: "))
        {
            assert!(
                err.contains(says.trim()),
                "{}: error {err:?} does not say {says:?}",
                path.display()
            );
        }
        checked += 1;
    }
    assert!(checked >= 15, "only {checked} fixtures found");
}

#[test]
fn a_policy_picks_its_algorithm_for_both_limits() {
    let c = Config::from_toml(
        r#"
        backend = "lua"
        key_secret = "0123456789abcdef0123"
        [[policies]]
        name = "api"
        route = "/api/"
        burst = 100
        rate = 10
        algorithm = "sliding_window"
        anonymous = { burst = 20, rate = 2 }
        [[policies]]
        name = "orders"
        route = "/api/orders"
        burst = 10
        rate = 1
        "#,
    )
    .unwrap();
    let api = &c.policies[0];
    assert_eq!(api.limit.unwrap().algorithm(), Algorithm::SlidingWindow);
    assert_eq!(api.anonymous.unwrap().algorithm(), Algorithm::SlidingWindow);
    assert_eq!(
        c.policies[1].limit.unwrap().algorithm(),
        Algorithm::TokenBucket,
        "the default"
    );
}

/// The defaults in a docs table (`| `field` | flag / env | default |`
/// rows) agree with the one declaration, `Settings::default()`. Computed
/// defaults (`instance_id`, a random `key_secret`) and empty lists are
/// described in words there and skipped here.
fn check_defaults_table(name: &str, text: &str) -> usize {
    let mut checked = 0;
    for line in text.lines() {
        let line = line.trim_start_matches("//!").trim();
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // "", field, flag / env, default, ""
        if cells.len() != 5 || !(cells[2].contains("RL_") || cells[2].contains("OTEL_")) {
            continue;
        }
        let first_code = |cell: &str| cell.split('`').nth(1).map(str::to_owned);
        let field = first_code(cells[1]).unwrap();
        let declared = default_of(&field);
        if declared == "none" {
            continue;
        }
        assert_eq!(
            first_code(cells[3]).as_deref(),
            Some(declared.as_str()),
            "{name}: the default of {field}"
        );
        checked += 1;
    }
    checked
}

#[test]
fn the_docs_state_the_declared_defaults() {
    let root = env!("CARGO_MANIFEST_DIR");
    for file in ["docs/configuration.md", "src/config/mod.rs"] {
        let text = std::fs::read_to_string(format!("{root}/{file}")).unwrap();
        let checked = check_defaults_table(file, &text);
        assert!(checked >= 15, "{file}: only {checked} defaults found");
    }
    // And the flags' help quotes them.
    let help = <Cli as clap::CommandFactory>::command()
        .render_long_help()
        .to_string();
    for (flag, key) in [
        ("--listen", "listen"),
        ("--redis-response-timeout", "redis.response_timeout"),
        ("--failure-deadline", "failure.deadline"),
        ("--memory-max-keys", "memory.max_keys"),
    ] {
        let at = help.find(flag).unwrap_or_else(|| panic!("{flag} missing"));
        let next = help[at..].find("\n  -").map_or(help.len(), |i| at + i);
        assert!(
            help[at..next].contains(&format!("[default: {}]", default_of(key))),
            "{flag}'s help: {}",
            &help[at..next]
        );
    }
}

/// Errors the layering itself finds (types, unknown keys) name the field
/// as validation does, whatever its depth.
#[test]
fn type_and_unknown_field_errors_name_the_field() {
    for (toml, field) in [
        (
            "[[policies]]\nname = \"a\"\nroute = \"/\"\nburst = \"x\"\nrate = 1\n",
            "policies[0].burst",
        ),
        (
            "[[policies]]\nname = \"a\"\nroute = \"/\"\nburst = 1\nrate = 1\nrat = 1\n",
            "policies[0].rat",
        ),
        ("[failure]\nmode = \"maybe\"\n", "failure.mode"),
        ("[redis]\nretries = -1\n", "redis.retries"),
        ("backend = \"pigeon\"\n", "backend"),
    ] {
        let err = Config::from_toml(toml).unwrap_err().to_string();
        assert!(
            err.contains(&format!("{field}: ")),
            "{err:?} does not name {field}"
        );
    }
    let err = Config::from_toml("listen = ").unwrap_err().to_string();
    assert!(err.contains("line 1"), "{err}");
}

#[test]
fn the_stack_config_is_valid_and_carries_no_secret() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/config/stack.toml");
    // As compose and scripts/stack run it: the secret and the cluster come
    // from the environment.
    let cli = Cli::try_parse_from([
        "ratelimiter",
        "--config",
        path,
        "--key-secret",
        "0123456789abcdef0123",
        "--redis-cluster",
        "redis://127.0.0.1:7001,redis://127.0.0.1:7002",
    ])
    .unwrap();
    let c = Config::load(cli).unwrap();
    assert_eq!(c.backend, Backend::Lua);
    assert_eq!(c.failover.instances, 3);
    assert_eq!(
        c.api_keys.len(),
        16,
        "the load scenarios pick among 16 tenants"
    );
    assert_eq!(
        c.trusted_proxies,
        [
            "172.28.0.10/32".parse().unwrap(),
            "127.0.0.2/32".parse().unwrap()
        ],
        "nginx alone: its address in compose, its proxy_bind natively"
    );
    assert!(c.wide_trusted_ranges().is_empty());

    // The file alone is refused for want of the secret, never run with a
    // random one (instances would not share buckets).
    let alone = Cli::try_parse_from(["ratelimiter", "--config", path]).unwrap();
    match Config::load(alone) {
        Err(ConfigError::Invalid { field, .. }) => assert_eq!(field, "key_secret"),
        other => panic!("expected key_secret refused, got {other:?}"),
    }
}

#[test]
fn trusted_ranges_wider_than_the_threshold_are_named() {
    let cli = Cli::try_parse_from([
        "ratelimiter",
        "--trusted-proxy",
        "10.0.0.0/8",
        "--trusted-proxy",
        "10.1.2.0/24",
        "--trusted-proxy",
        "10.1.3.0/23",
        "--trusted-proxy",
        "fd00::/64",
        "--trusted-proxy",
        "fd00::/120",
        "--trusted-proxy",
        "::/0",
        "--trusted-proxy",
        "192.0.2.7",
    ])
    .unwrap();
    let c = Config::load(cli).unwrap();
    assert_eq!(c.trusted_proxy_warn_addresses, 256, "the default: a /24");
    let wide: Vec<String> = c
        .wide_trusted_ranges()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(wide, ["10.0.0.0/8", "10.1.3.0/23", "fd00::/64", "::/0"]);

    let cli = Cli::try_parse_from([
        "ratelimiter",
        "--trusted-proxy",
        "10.0.0.0/8",
        "--trusted-proxy-warn-addresses",
        "16777216",
    ])
    .unwrap();
    assert!(Config::load(cli).unwrap().wide_trusted_ranges().is_empty());
}

#[test]
fn a_lease_that_could_never_be_held_or_kept_exactly_is_refused() {
    let policy = |extra: &str| {
        format!(
            "[failure]\ninstances = 3\n[[policies]]\nname = \"api\"\nroute = \"/api/\"\nburst = 30\nrate = 10\n{extra}\n"
        )
    };
    assert_eq!(
        Config::from_toml(&policy("lease = 9")).unwrap().policies[0].lease,
        9
    );
    for (extra, why) in [
        ("lease = 1", "at least 2"),
        ("lease = 10", "below the burst"),
        ("lease = 4\nalgorithm = \"gcra\"", "token_bucket"),
        ("lease = 3\ncost = 3", "above the cost 3"),
    ] {
        match Config::from_toml(&policy(extra)) {
            Err(ConfigError::Invalid { field, message }) => {
                assert_eq!(field, "policies[0].lease", "{extra}");
                assert!(message.contains(why), "{extra}: {message}");
            }
            other => panic!("{extra}: {other:?}"),
        }
    }
    // Three leases of 9 fit a burst of 28, but leave the shared bucket no
    // token to refill into: no lease could ever be granted.
    let tight = policy("lease = 9").replace("burst = 30", "burst = 28");
    match Config::from_toml(&tight) {
        Err(ConfigError::Invalid { field, message }) => {
            assert_eq!(field, "policies[0].lease");
            assert!(message.contains("plus 1 token(s) of room"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert!(Config::from_toml(&tight.replace("lease = 9", "lease = 8")).is_ok());
}

#[test]
fn overrides_give_named_keys_a_limit_of_their_own_and_bad_ones_are_refused() {
    let policy = |extra: &str| {
        format!(
            "ipv6_prefix = 48\n[failure]\ninstances = 3\n[[api_keys]]\nid = \"tenant-01\"\nkey = \"demo-key-01\"\n[[api_keys]]\nid = \"tenant-02\"\nkey = \"demo-key-02\"\n[[policies]]\nname = \"api\"\nroute = \"/api/\"\nburst = 30\nrate = 10\nalgorithm = \"gcra\"\ncost = 2\n{extra}\n"
        )
    };
    let config = Config::from_toml(&policy(
        "[[policies.overrides]]\nkeys = [\"tenant-01\", \"::ffff:10.0.0.1\"]\nburst = 6000\nrate = 3000\n[[policies.overrides]]\nkeys = [\"2001:db8:1:2::9\"]\nburst = 4\nrate = 1\nper = \"2s\"",
    ))
    .unwrap();
    let o = &config.policies[0].overrides;
    // Addresses as the limiter keys them; the policy's algorithm.
    assert_eq!(o[0].keys, ["tenant-01", "10.0.0.1"]);
    assert_eq!(o[1].keys, ["2001:db8:1::"]);
    assert_eq!(
        o[0].limit,
        Limit::new(6000, 3000, Duration::from_secs(1))
            .unwrap()
            .with_algorithm(Algorithm::Gcra)
    );
    assert_eq!(o[1].limit.burst(), 4);
    assert_eq!(config.policies[0].limits().count(), 4);
    for (extra, field, why) in [
        (
            "overrides = [{ keys = [\"tenant-9\"], burst = 10, rate = 1 }]",
            "policies[0].overrides[0].keys[0]",
            "neither a client address nor a configured api_keys id",
        ),
        (
            "overrides = [{ keys = [], burst = 10, rate = 1 }]",
            "policies[0].overrides[0].keys",
            "names no key",
        ),
        (
            "overrides = [{ keys = [\"tenant-01\"], burst = 10, rate = 1 }, { keys = [\"tenant-02\", \"tenant-01\"], burst = 20, rate = 1 }]",
            "policies[0].overrides[1].keys[1]",
            "has an override already",
        ),
        (
            "overrides = [{ keys = [\"tenant-01\"], burst = 10, rate = 0 }]",
            "policies[0].overrides[0].rate",
            "",
        ),
        (
            "overrides = [{ keys = [\"tenant-01\"], burst = 1, rate = 1 }]",
            "policies[0].overrides[0].burst",
            "below the policy's cost 2",
        ),
        (
            "overrides = [{ keys = [\"tenant-01\"], burst = 10, rate = 1, per = \"soon\" }]",
            "policies[0].overrides[0].per",
            "",
        ),
        // The override's burst is split too: 3 ways of 4 leaves 1, below the cost.
        (
            "shards = 3\noverrides = [{ keys = [\"tenant-01\"], burst = 4, rate = 1 }]",
            "policies[0].shards",
            "below the cost 2",
        ),
    ] {
        match Config::from_toml(&policy(extra)) {
            Err(ConfigError::Invalid { field: f, message }) => {
                assert_eq!(f, field, "{extra}");
                assert!(message.contains(why), "{extra}: {message}");
            }
            other => panic!("{extra}: {other:?}"),
        }
    }
    let unlimited = "[[policies]]\nname = \"s\"\nroute = \"/s\"\nunlimited = true\noverrides = [{ keys = [\"1.2.3.4\"], burst = 1, rate = 1 }]\n";
    assert!(matches!(
        Config::from_toml(unlimited),
        Err(ConfigError::Invalid { message, .. }) if message.contains("overrides")
    ));
}

#[test]
fn a_split_the_sub_buckets_cannot_keep_or_of_unknown_keys_is_refused() {
    let policy = |extra: &str| {
        format!(
            "ipv6_prefix = 48\n[failure]\ninstances = 3\n[[api_keys]]\nid = \"tenant-08\"\nkey = \"demo-key-08\"\n[[policies]]\nname = \"api\"\nroute = \"/api/\"\nburst = 30\nrate = 10\n{extra}\n"
        )
    };
    let config = Config::from_toml(&policy(
        "shards = 3\nshard_keys = [\"tenant-08\", \"::ffff:10.0.0.1\", \"2001:db8:1:2::9\"]",
    ))
    .unwrap();
    assert_eq!(config.policies[0].shards, 3);
    // Addresses as the limiter keys them: a mapped IPv4 as IPv4, IPv6 by
    // its prefix.
    assert_eq!(
        config.policies[0].shard_keys,
        ["tenant-08", "10.0.0.1", "2001:db8:1::"]
    );
    assert_eq!(
        Config::from_toml(&policy("")).unwrap().policies[0].shards,
        1
    );
    assert_eq!(
        Config::from_toml(&policy("shards = 2\nlease = 4"))
            .unwrap()
            .policies[0]
            .lease,
        4
    );
    for (extra, field, why) in [
        ("shards = 0", "policies[0].shards", "from 1"),
        ("shards = 17", "policies[0].shards", "to 16"),
        (
            "shards = 2\nalgorithm = \"fixed_window\"",
            "policies[0].shards",
            "token_bucket or gcra",
        ),
        (
            "shards = 16\ncost = 2",
            "policies[0].shards",
            "below the cost 2",
        ),
        (
            "shards = 2\nanonymous = { burst = 3, rate = 1 }\ncost = 2",
            "policies[0].shards",
            "leaves 1 tokens",
        ),
        (
            "shard_keys = [\"tenant-08\"]",
            "policies[0].shard_keys",
            "set shards too",
        ),
        (
            "shards = 2\nshard_keys = [\"tenant-8\"]",
            "policies[0].shard_keys[0]",
            "neither a client address nor a configured api_keys id",
        ),
        // 3 x 5 fits the burst 30, not a sub-bucket's 15.
        (
            "shards = 2\nlease = 5",
            "policies[0].lease",
            "sub-bucket's burst 15",
        ),
    ] {
        match Config::from_toml(&policy(extra)) {
            Err(ConfigError::Invalid { field: f, message }) => {
                assert_eq!(f, field, "{extra}");
                assert!(message.contains(why), "{extra}: {message}");
            }
            other => panic!("{extra}: {other:?}"),
        }
    }
    let unlimited = "[[policies]]\nname = \"s\"\nroute = \"/s\"\nunlimited = true\nshards = 2\n";
    assert!(matches!(
        Config::from_toml(unlimited),
        Err(ConfigError::Invalid { message, .. }) if message.contains("shards")
    ));
}

/// The `OTEL_*` variables of `vars`, as the process would see them.
fn otel(vars: &[(&str, &str)]) -> OtelEnv {
    let vars: Vec<(String, String)> = vars
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    OtelEnv::read(|name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
}

const TRACED: &str = "[tracing]\nendpoint = \"http://127.0.0.1:4318\"\nsampler = \"always_on\"\n";

#[test]
fn bad_otel_variables_are_ignored_and_each_named_once() {
    let env = otel(&[
        ("OTEL_TRACES_SAMPLER", "nope"),
        ("OTEL_TRACES_SAMPLER_ARG", "abc"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4317"),
        ("OTEL_SDK_DISABLED", "maybe"),
        ("OTEL_SERVICE_NAME", ""),
    ]);
    let c = Config::layered("<inline>".into(), TRACED, env, &Cli::default()).unwrap();
    // The file's settings and the defaults stand.
    assert_eq!(c.tracing.endpoint.as_deref(), Some("http://127.0.0.1:4318"));
    assert_eq!(c.tracing.sampler, SamplerKind::AlwaysOn);
    assert_eq!(c.tracing.sampler_arg, 1.0);
    assert_eq!(c.tracing.protocol, OtlpProtocol::HttpProtobuf);
    assert_eq!(c.tracing.service_name, "ratelimiter");
    let named: Vec<&str> = c
        .ignored_env
        .iter()
        .map(|w| w.split('=').next().unwrap())
        .collect();
    assert_eq!(
        named,
        [
            "OTEL_SDK_DISABLED",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "OTEL_TRACES_SAMPLER",
            "OTEL_TRACES_SAMPLER_ARG",
        ],
        "an empty variable is unset, not wrong: {:?}",
        c.ignored_env
    );
    assert!(
        c.ignored_env[2].contains("not supported"),
        "{:?}",
        c.ignored_env
    );
}

#[test]
fn otel_variables_layer_over_the_file_and_under_the_flags() {
    let env = || {
        otel(&[
            ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
            ("OTEL_TRACES_SAMPLER_ARG", "0.25"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317"),
            ("OTEL_SERVICE_NAME", "edge"),
        ])
    };
    let c = Config::layered("<inline>".into(), TRACED, env(), &Cli::default()).unwrap();
    assert!(c.ignored_env.is_empty(), "{:?}", c.ignored_env);
    assert_eq!(c.tracing.endpoint.as_deref(), Some("http://collector:4317"));
    assert_eq!(c.tracing.sampler, SamplerKind::ParentbasedTraceIdRatio);
    assert_eq!(c.tracing.sampler_arg, 0.25);
    assert_eq!(c.tracing.protocol, OtlpProtocol::Grpc);
    assert_eq!(c.tracing.service_name, "edge");
    // A flag is the operator's own word for this process: it wins.
    let cli = Cli::parse_from(["ratelimiter", "--traces-sampler", "always_off"]);
    let c = Config::layered("<inline>".into(), TRACED, env(), &cli).unwrap();
    assert_eq!(c.tracing.sampler, SamplerKind::AlwaysOff);
}

#[test]
fn otel_sdk_disabled_turns_trace_export_off() {
    for value in ["true", "TRUE", " True "] {
        let env = otel(&[
            ("OTEL_SDK_DISABLED", value),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"),
        ]);
        let c = Config::layered("<inline>".into(), TRACED, env, &Cli::default()).unwrap();
        assert_eq!(c.tracing.endpoint, None, "{value:?}");
    }
    let env = otel(&[("OTEL_SDK_DISABLED", "false")]);
    let c = Config::layered("<inline>".into(), TRACED, env, &Cli::default()).unwrap();
    assert!(c.tracing.endpoint.is_some());
}
