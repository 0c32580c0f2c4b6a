//! The dashboards' and alerts' queries on a real Prometheus that scraped a
//! real instance, Redis, exporters and the cgroup counters under load; and
//! what breaks outright (a node killed, an instance stopped) firing its
//! alerts there.

use super::*;
use std::process::Stdio;
use std::time::{Duration, Instant};
use testkit::{ChildGuard, RedisServer, TempDir, free_port, wait_for_listener};

/// Runs a real instance (lua backend), a real Redis and its exporter, and a
/// real Prometheus scraping them every second, under load.
struct Scraped {
    prometheus: String,
    exporter_metrics: String,
    cgroup_metrics: String,
    /// The instance (killed by the test of what breaks).
    instance: ChildGuard,
    _children: Vec<ChildGuard>,
    redis: RedisServer,
    _dir: TempDir,
    load: tokio::task::JoinHandle<()>,
}

/// redis_exporter on the Redis at `url`, listening on a free port: the
/// exporter and its port.
fn redis_exporter(url: &str) -> (ChildGuard, u16) {
    let port = free_port().unwrap();
    let mut exporter = ChildGuard(
        Command::new("prometheus-redis-exporter")
            .args(["--redis.addr", url])
            .args(["--web.listen-address", &format!("127.0.0.1:{port}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus-redis-exporter is installed (Debian package)"),
    );
    wait_for_listener(&mut exporter, port, "redis exporter").unwrap();
    (exporter, port)
}

/// What `/metrics` on 127.0.0.1:`port` serves.
async fn metrics_text(port: u16) -> String {
    reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

async fn scraped() -> Scraped {
    let dir = TempDir::new("observability").unwrap();
    let mut redis = RedisServer::start().unwrap();
    let mut children = Vec::new();
    // Its cap, recorded as scripts/stack records a node's, and the stack's
    // own exporter of it.
    redis.limit_cpu(0.5).unwrap();
    std::fs::create_dir_all(dir.join("run")).unwrap();
    std::fs::write(
        dir.join("run/redis-1.cgroup"),
        redis.cpu_limit().unwrap().dir().display().to_string(),
    )
    .unwrap();
    let cgroup_port = free_port().unwrap();
    let mut cgroups = ChildGuard(
        Command::new(repo("scripts/cgroup-exporter"))
            .arg(format!("127.0.0.1:{cgroup_port}"))
            .arg(&dir.0)
            .stdout(Stdio::null())
            .spawn()
            .expect("python3 runs scripts/cgroup-exporter"),
    );
    // This exporter, not another test's that took the same port first.
    wait_for_listener(&mut cgroups, cgroup_port, "cgroup exporter").unwrap();
    children.push(cgroups);
    // redis_exporter on its Redis.
    let (exporter, exporter_port) = redis_exporter(&redis.url());
    children.push(exporter);
    // The instance: small limits, so throttling, near-limit and shadow
    // denials all happen under a little load.
    let api_port = free_port().unwrap();
    let config = dir.join("api.toml");
    std::fs::write(
        &config,
        "key_secret = \"observability-test-secret\"\n\
         [[api_keys]]\nid = \"tenant-a\"\nkey = \"key-a\"\n\
         [[policies]]\nname = \"api\"\nroute = \"/api/\"\nburst = 20\nrate = 10\n\
         [[policies]]\nname = \"orders-shadow\"\nroute = \"/api/orders\"\nburst = 2\nrate = 1\nshadow = true\n",
    )
    .unwrap();
    let mut instance = ChildGuard(
        Command::new(BIN)
            .args([
                "--listen",
                &format!("127.0.0.1:{api_port}"),
                "--backend",
                "lua",
            ])
            .args(["--redis-url", &redis.url(), "--instance-id", "api-1"])
            // Hot keys appear once a detector window is complete.
            .args(["--hot-keys-window", "1s"])
            .arg("--config")
            .arg(&config)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for_listener(&mut instance, api_port, "ratelimiter").unwrap();
    // Prometheus: every second, with the repository's alert rules and its
    // relabelling of the cgroup counters (redis-1 is this node).
    let prometheus_port = free_port().unwrap();
    let prometheus_config = dir.join("prometheus.yml");
    let repo_config: serde_yaml::Value =
        serde_yaml::from_str(&read("prometheus/prometheus.yml")).unwrap();
    let relabel = repo_config["scrape_configs"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|job| job["job_name"] == "cgroups")
        .map(|job| serde_yaml::to_string(&job["metric_relabel_configs"]).unwrap())
        .expect("prometheus.yml scrapes the cgroup counters")
        .replace("172.28.0.11:6379", &format!("127.0.0.1:{}", redis.port));
    let relabel: String = relabel.lines().map(|l| format!("      {l}\n")).collect();
    // The runbook links' base, as prometheus.yml takes it from the
    // environment (RUNBOOK_BASE_URL, below).
    let base = repo_config["global"]["external_labels"]["runbook_base_url"]
        .as_str()
        .expect("prometheus.yml names the runbooks' base")
        .to_owned();
    std::fs::write(
        &prometheus_config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             \x20 external_labels:\n    runbook_base_url: '{base}'\n\
             rule_files:\n  - {}\n\
             scrape_configs:\n\
             \x20 - job_name: ratelimiter\n    static_configs:\n      - targets: ['127.0.0.1:{api_port}']\n\
             \x20 - job_name: redis\n    static_configs:\n      - targets: ['127.0.0.1:{exporter_port}']\n        labels: {{node: '127.0.0.1:{redis_port}'}}\n\
             \x20 - job_name: cgroups\n    static_configs:\n      - targets: ['127.0.0.1:{cgroup_port}']\n    metric_relabel_configs:\n{relabel}",
            repo("prometheus/rules/ratelimiter.yml").display(),
            redis_port = redis.port,
        ),
    )
    .unwrap();
    let mut prometheus = ChildGuard(
        Command::new("prometheus")
            .arg(format!("--config.file={}", prometheus_config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{prometheus_port}"))
            // Prometheus 2 expands the environment in external labels only
            // when asked (3 always does).
            .arg("--enable-feature=expand-external-labels")
            .env("RUNBOOK_BASE_URL", SERVED_RUNBOOKS)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus is installed (Debian package)"),
    );
    wait_for_listener(&mut prometheus, prometheus_port, "prometheus").unwrap();
    children.push(prometheus);
    // Load until dropped: keyed (throttled past 20), anonymous, the shadow
    // policy's POSTs, a 404.
    let base = format!("http://127.0.0.1:{api_port}");
    let load = tokio::spawn(async move {
        let http = reqwest::Client::new();
        loop {
            let _ = http
                .get(format!("{base}/api/items"))
                .header("x-api-key", "key-a")
                .send()
                .await;
            // Anonymous, through a "proxy" the instance does not trust.
            let _ = http
                .get(format!("{base}/api/items/1"))
                .header("x-forwarded-for", "198.51.100.7")
                .send()
                .await;
            let _ = http
                .post(format!("{base}/api/orders"))
                .header("content-type", "application/json")
                .body(r#"{"item_id":1,"quantity":1}"#)
                .send()
                .await;
            let _ = http.get(format!("{base}/nope")).send().await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    let exporter_metrics = metrics_text(exporter_port).await;
    let cgroup_metrics = metrics_text(cgroup_port).await;
    Scraped {
        prometheus: format!("http://127.0.0.1:{prometheus_port}"),
        exporter_metrics,
        cgroup_metrics,
        instance,
        _children: children,
        redis,
        _dir: dir,
        load,
    }
}

async fn query(prometheus: &str, expr: &str) -> Result<Vec<Value>, String> {
    let response: Value = reqwest::Client::new()
        .get(format!("{prometheus}/api/v1/query"))
        .query(&[("query", expr)])
        .send()
        .await
        .map_err(|e| e.to_string())?
        .json()
        .await
        .map_err(|e| e.to_string())?;
    if response["status"] != "success" {
        return Err(response.to_string());
    }
    Ok(response["data"]["result"]
        .as_array()
        .cloned()
        .unwrap_or_default())
}

/// Panels that show nothing on a healthy, untraced stack: errors,
/// breaker transitions and dropped spans happen only when something fails.
const MAY_BE_EMPTY: &[&str] = &[
    "Errors by kind",
    "Breaker transitions",
    "Trace spans dropped",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_panel_query_runs_on_a_real_prometheus_and_shows_data() {
    let stack = scraped().await;
    // Wait for enough scrapes for a 4 s rate window and a rule evaluation.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ready = query(
            &stack.prometheus,
            "count_over_time(ratelimit_instance_info[10s]) >= 6",
        )
        .await
        .unwrap_or_default();
        let exporter = query(&stack.prometheus, "count_over_time(redis_up[10s]) >= 6")
            .await
            .unwrap_or_default();
        if !ready.is_empty() && !exporter.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "Prometheus did not scrape 6 times in 60 s"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let mut failures = Vec::new();
    for (file, title, expr) in panel_queries() {
        // What Grafana substitutes: every instance and node, and a rate
        // window of four scrape intervals.
        let expr_run = expr
            .replace("$__rate_interval", "4s")
            .replace("$instance", ".*")
            .replace("$node", ".*")
            .replace("$redis", ".*");
        match query(&stack.prometheus, &expr_run).await {
            Err(e) => failures.push(format!("{file}: {title}: {expr}: {e}")),
            Ok(result) if result.is_empty() && !MAY_BE_EMPTY.contains(&title.as_str()) => {
                failures.push(format!("{file}: {title}: no data for {expr}"))
            }
            Ok(_) => {}
        }
    }
    // The template variables' label_values(metric, label).
    for (file, json) in dashboards() {
        for variable in json["templating"]["list"].as_array().unwrap() {
            let definition = variable["definition"].as_str().unwrap();
            let inner = definition
                .strip_prefix("label_values(")
                .and_then(|s| s.strip_suffix(')'))
                .unwrap();
            let (metric, label) = inner.split_once(',').unwrap();
            let values: Value = reqwest::Client::new()
                .get(format!(
                    "{}/api/v1/label/{}/values",
                    stack.prometheus,
                    label.trim()
                ))
                .query(&[("match[]", metric.trim())])
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            if values["data"].as_array().is_none_or(Vec::is_empty) {
                failures.push(format!("{file}: variable {definition}: no values"));
            }
        }
    }
    // Every alert rule evaluates without error.
    let rules: Value = reqwest::get(format!("{}/api/v1/rules", stack.prometheus))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut evaluated = 0;
    for group in rules["data"]["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            evaluated += 1;
            if rule["health"] != "ok" {
                failures.push(format!("rule {}: {}", rule["name"], rule));
            }
        }
    }
    if evaluated < 5 {
        failures.push(format!("only {evaluated} rules loaded"));
    }
    stack.load.abort();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// What redis_exporter serves for a Redis Cluster node: the cluster's
/// own metrics (`redis_cluster_state`) appear only in cluster mode.
async fn cluster_exporter_metrics() -> String {
    let node = RedisServer::start_with(&["--cluster-enabled", "yes"]).unwrap();
    let (_exporter, port) = redis_exporter(&node.url());
    let text = metrics_text(port).await;
    assert!(text.contains("redis_cluster_enabled 1"), "{text}");
    text
}

/// Every metric a panel or an alert names exists: defined in
/// `src/metrics.rs`, or exported by redis_exporter (of a standalone node
/// or a cluster's), counted by mtail's program, or Prometheus's `up`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboards_and_alerts_name_is_exported() {
    let stack = scraped().await;
    stack.load.abort();
    let cluster_metrics = cluster_exporter_metrics().await;
    // redis_exporter's names and the cgroup counters' (cAdvisor's names).
    let exporter: BTreeSet<&str> = stack
        .exporter_metrics
        .lines()
        .chain(cluster_metrics.lines())
        .chain(stack.cgroup_metrics.lines())
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect();
    assert!(
        exporter.contains("container_cpu_cfs_throttled_periods_total"),
        "the cgroup exporter serves the capped node: {}",
        stack.cgroup_metrics
    );
    // mtail's counters, by the names its program declares.
    let mtail_program = read("nginx/nginx.mtail");
    let mtail: BTreeSet<&str> = mtail_program
        .lines()
        .filter_map(|l| l.strip_prefix("counter "))
        .map(str::trim)
        .collect();
    assert!(
        mtail.contains("nginx_http_server_errors_total"),
        "{mtail:?}"
    );
    // Recording rules, by the names they record.
    let recorded: BTreeSet<String> = read("prometheus/rules/ratelimiter.yml")
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- record:"))
        .map(|n| n.trim().to_owned())
        .collect();
    let ours: BTreeSet<&str> = ratelimiter::metrics::ALL.iter().copied().collect();
    let mut exprs: Vec<String> = panel_queries().into_iter().map(|(_, _, e)| e).collect();
    exprs.extend(rule_exprs());
    let mut unknown = BTreeSet::new();
    for expr in &exprs {
        for name in metric_names(expr) {
            let base = ["_bucket", "_count", "_sum"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(&name);
            if !(ours.contains(base)
                || exporter.contains(name.as_str())
                || mtail.contains(name.as_str())
                || recorded.contains(&name)
                || name == "up")
            {
                unknown.insert(name);
            }
        }
    }
    assert!(unknown.is_empty(), "named but not exported: {unknown:?}");
    // And the check sees the names at all.
    assert!(
        metric_names("sum(rate(ratelimit_decisions_total{x=\"redis_up\"}[1m])) + up")
            .into_iter()
            .eq(["ratelimit_decisions_total".to_owned(), "up".to_owned()])
    );
    assert!(
        metric_names("a:b:c / container_spec_cpu_quota[5m:1m]")
            .into_iter()
            .eq(["a:b:c".to_owned(), "container_spec_cpu_quota".to_owned()])
    );
}

/// What breaks outright, broken for real: Redis killed while its exporter
/// answers fires `RedisNodeDown` within its 30 s, and the instance stopped
/// fires `RateLimitInstanceDown` within its minute, on a real Prometheus
/// evaluating the repository's rules.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_node_and_a_stopped_instance_fire_their_alerts() {
    let mut stack = scraped().await;
    stack.load.abort();
    stack.redis.kill().unwrap();
    stack.instance.0.kill().unwrap();
    let _ = stack.instance.0.wait();
    let wanted = ["RedisNodeDown", "RateLimitInstanceDown"];
    let deadline = Instant::now() + Duration::from_secs(150);
    let mut firing = BTreeSet::new();
    while Instant::now() < deadline {
        firing = query(&stack.prometheus, "ALERTS{alertstate=\"firing\"}")
            .await
            .unwrap()
            .iter()
            .filter_map(|a| a["metric"]["alertname"].as_str().map(str::to_owned))
            .collect();
        if wanted.iter().all(|w| firing.contains(*w)) {
            // Each links to its runbook section, absolutely, under the
            // base this Prometheus was given.
            let alerts: Value = reqwest::get(format!("{}/api/v1/alerts", stack.prometheus))
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let link = |name: &str| {
                alerts["data"]["alerts"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|a| a["labels"]["alertname"] == name)
                    .and_then(|a| a["annotations"]["runbook_url"].as_str())
                    .map(str::to_owned)
            };
            assert_eq!(
                link("RedisNodeDown").as_deref(),
                Some(&*format!(
                    "{SERVED_RUNBOOKS}/runbooks/redis-down.md#redisnodedown"
                ))
            );
            assert_eq!(
                link("RateLimitInstanceDown").as_deref(),
                Some(&*format!(
                    "{SERVED_RUNBOOKS}/runbooks/availability.md#ratelimitinstancedown"
                ))
            );
            return;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    panic!("firing after 150 s: {firing:?}, wanted {wanted:?}");
}
