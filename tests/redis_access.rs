//! Reaching Redis the way a managed one demands, on real redis-server
//! processes: TLS (a CA file, client certificates, a cluster), a password,
//! the least-privilege ACL docs/redis.md documents, and the errors an
//! operator must tell apart (`oom`, `auth`, `noperm`, `tls`).

mod support;

use ratelimiter::algorithm::{Algorithm, Limit};
use ratelimiter::clock::ManualClock;
use ratelimiter::config::Config;
use ratelimiter::store::redis::topology::slot;
use ratelimiter::store::redis::{
    ClientIdentity, RedisConnection, RedisSettings, RedisTls, redis_key,
};
use ratelimiter::store::{BucketKey, Check, LuaStore, NaiveStore, Store, StoreError};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use testkit::{RedisCluster, RedisServer, TestCerts};

const T0: u64 = 1_800_000_000_000_000;
const HOUR: u64 = 3_600_000_000;

/// Settings for `urls` under the default prefix (its ACL names
/// `~rl:*`), with timeouts for a shared test machine.
fn settings(urls: Vec<String>, cluster: bool) -> RedisSettings {
    RedisSettings {
        connect_timeout: Duration::from_secs(2),
        response_timeout: Duration::from_secs(2),
        // Long: a test's keys must outlive a slow machine's pauses.
        ttl_margin: Duration::from_secs(60),
        ..RedisSettings::new(urls, cluster)
    }
}

/// TLS trusting `ca`, showing `client` (certificate, key) if given.
fn tls(ca: Option<&Path>, client: Option<(&Path, &Path)>) -> RedisTls {
    let read = |p: &Path| std::fs::read(p).unwrap();
    RedisTls {
        ca: ca.map(read),
        client: client.map(|(cert, key)| ClientIdentity {
            cert: read(cert),
            key: read(key),
        }),
    }
}

async fn lua(settings: &RedisSettings) -> LuaStore {
    LuaStore::new(RedisConnection::connect(settings).await.unwrap(), settings)
}

/// One check of `cost` on `key` at `now` under a burst of 5 at 1/s.
async fn check(
    store: &LuaStore,
    algorithm: Algorithm,
    key: u128,
    cost: u64,
    now: u64,
) -> Result<bool, StoreError> {
    let limit = Limit::per_second(5, 1).unwrap().with_algorithm(algorithm);
    let check = Check::new(BucketKey(key), limit, cost, now);
    Ok(store.decide(&check).await?.allowed)
}

/// `url` with `user:password@` inserted after the scheme.
fn with_credentials(url: &str, user: &str, password: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    format!("{scheme}://{user}:{password}@{rest}")
}

#[tokio::test]
async fn tls_with_a_ca_file_decides_through_redis() {
    let certs = TestCerts::generate().unwrap();
    let redis = RedisServer::start_tls(&certs, false, &[]).unwrap();
    assert!(redis.url().starts_with("rediss://"));
    let mut s = settings(vec![redis.url()], false);
    s.tls = tls(Some(&certs.ca), None);
    let store = lua(&s).await;
    store.ready().await.unwrap();
    for i in 0..5 {
        assert!(
            check(&store, Algorithm::TokenBucket, 1, 1, T0)
                .await
                .unwrap(),
            "{i}"
        );
    }
    assert!(
        !check(&store, Algorithm::TokenBucket, 1, 1, T0)
            .await
            .unwrap()
    );
    // The bucket is in that server, reached over TLS only (no plain port).
    assert_eq!(redis.cli(&["dbsize"]).unwrap().trim(), "1");
}

/// A server certificate the configured roots did not sign is a `tls`
/// error, never a decision: neither another CA's nor (without a CA file)
/// one the system's roots do not know. So is a server that wants a client
/// certificate it is not shown; shown one, it answers.
#[tokio::test]
async fn certificates_are_checked_both_ways_and_failures_are_tls_errors() {
    let certs = TestCerts::generate().unwrap();
    let redis = RedisServer::start_tls(&certs, true, &[]).unwrap();
    for (what, trust) in [
        ("another CA", tls(Some(&certs.other_ca), None)),
        ("the system's roots", RedisTls::default()),
        ("no client certificate", tls(Some(&certs.ca), None)),
    ] {
        let mut s = settings(vec![redis.url()], false);
        s.tls = trust;
        let store = lua(&s).await;
        let err = check(&store, Algorithm::TokenBucket, 1, 1, T0)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), "tls", "{what}: {err}");
        let err = store.ready().await.unwrap_err();
        assert_eq!(err.kind(), "tls", "{what}: {err}");
    }
    let mut s = settings(vec![redis.url()], false);
    s.tls = tls(
        Some(&certs.ca),
        Some((&certs.client_cert, &certs.client_key)),
    );
    let store = lua(&s).await;
    assert!(
        check(&store, Algorithm::TokenBucket, 1, 1, T0)
            .await
            .unwrap()
    );
}

/// A cluster over TLS: the seeds, then every node the slot map names, each
/// checked against the CA.
#[tokio::test]
async fn a_cluster_over_tls_decides_through_every_node() {
    let certs = TestCerts::generate().unwrap();
    let cluster = RedisCluster::start_tls(&certs).unwrap();
    let mut s = settings(cluster.urls(), true);
    s.tls = tls(Some(&certs.ca), None);
    let store = lua(&s).await;
    for key in 0..30u128 {
        assert!(
            check(&store, Algorithm::TokenBucket, key, 1, T0)
                .await
                .unwrap()
        );
    }
    for node in &cluster.nodes {
        let keys: u64 = node.cli(&["dbsize"]).unwrap().trim().parse().unwrap();
        assert!(keys > 0, "node {} holds none of 30 keys", node.port);
    }
}

/// The service from its config file: `rediss://` with `redis.tls_ca_file`
/// and the credentials in the URL.
#[tokio::test]
async fn the_service_reaches_a_tls_redis_with_a_password_from_its_config() {
    let certs = TestCerts::generate().unwrap();
    let redis = RedisServer::start_tls(&certs, false, &["--requirepass", "s3cret"]).unwrap();
    let url = with_credentials(&redis.url(), "", "s3cret");
    let config = format!(
        "backend = \"lua\"\nkey_secret = \"0123456789abcdef0123\"\n\
         [redis]\nurl = \"{url}\"\ntls_ca_file = \"{}\"\nresponse_timeout = \"2s\"\n\
         [failure]\ndeadline = \"2s\"\ninstances = 2\n\
         [[policies]]\nname = \"tls-api\"\nroute = \"/api/\"\nburst = 10\nrate = 1\nper = \"1h\"\n",
        certs.ca.display()
    );
    let server = support::TestServer::start(&config, Arc::new(ManualClock::new(T0))).await;
    let http = support::client();
    let r = server.get(&http, "/api/items", &[]).await;
    assert_eq!(r.status(), 200);
    // The whole limit: Redis decided (the local share would be 5).
    assert_eq!(support::header(&r, "ratelimit-limit"), "10");
    assert_eq!(support::header(&r, "ratelimit-remaining"), "9");
    let ready = server
        .get(&http, "/readyz", &[])
        .await
        .text()
        .await
        .unwrap();
    assert!(ready.contains("\"ready\""), "{ready}");
    let dbsize = redis
        .cli(&["-a", "s3cret", "--no-auth-warning", "dbsize"])
        .unwrap();
    assert_eq!(dbsize.trim(), "1");
}

/// Files that cannot work fail at start-up, naming their field.
#[test]
fn bad_tls_files_are_refused_at_start_up_naming_the_field() {
    let certs = TestCerts::generate().unwrap();
    let toml = |redis: &str| {
        format!("backend = \"lua\"\nkey_secret = \"0123456789abcdef0123\"\n[redis]\n{redis}\n")
    };
    let p = |path: &Path| path.display().to_string();
    let cases = [
        // A key that is not the certificate's.
        (
            format!(
                "url = \"rediss://127.0.0.1:1\"\ntls_client_cert = \"{}\"\ntls_client_key = \"{}\"",
                p(&certs.client_cert),
                p(&certs.server_key)
            ),
            "redis.tls_client_key",
            "does not fit the certificate",
        ),
        // A key where the certificate should be.
        (
            format!(
                "url = \"rediss://127.0.0.1:1\"\ntls_client_cert = \"{}\"\ntls_client_key = \"{}\"",
                p(&certs.client_key),
                p(&certs.client_key)
            ),
            "redis.tls_client_cert",
            "no PEM certificate",
        ),
        // A certificate where the key should be.
        (
            format!(
                "url = \"rediss://127.0.0.1:1\"\ntls_client_cert = \"{}\"\ntls_client_key = \"{}\"",
                p(&certs.client_cert),
                p(&certs.client_cert)
            ),
            "redis.tls_client_key",
            "no PEM private key",
        ),
        // TLS files for a plaintext URL would be silently unused.
        (
            format!(
                "url = \"redis://127.0.0.1:1\"\ntls_ca_file = \"{}\"",
                p(&certs.ca)
            ),
            "redis.tls_ca_file",
            "use rediss://",
        ),
    ];
    for (redis, field, message) in cases {
        let err = Config::from_toml(&toml(&redis)).unwrap_err().to_string();
        assert!(
            err.contains(&format!("{field}: ")) && err.contains(message),
            "{redis}: {err}"
        );
    }
    // And the good ones are taken as given.
    let good = format!(
        "url = \"rediss://127.0.0.1:1\"\ntls_ca_file = \"{}\"\ntls_client_cert = \"{}\"\ntls_client_key = \"{}\"",
        p(&certs.ca),
        p(&certs.client_cert),
        p(&certs.client_key)
    );
    let config = Config::from_toml(&toml(&good)).unwrap();
    assert_eq!(
        config.redis.tls,
        tls(
            Some(&certs.ca),
            Some((&certs.client_cert, &certs.client_key))
        )
    );
}

/// Redis full (`maxmemory`, `noeviction`): `oom`, not a client bug. Reads
/// still answer, so readiness holds.
#[tokio::test]
async fn redis_out_of_memory_is_oom() {
    let redis = RedisServer::start().unwrap();
    redis
        .cli(&[
            "eval",
            "for i = 1, 20000 do redis.call('SET', 'fill:' .. i, string.rep('x', 100)) end",
            "0",
        ])
        .unwrap();
    redis
        .cli(&["config", "set", "maxmemory-policy", "noeviction"])
        .unwrap();
    redis.cli(&["config", "set", "maxmemory", "1mb"]).unwrap();
    let store = lua(&settings(vec![redis.url()], false)).await;
    // Not the sliding log: its script trims (ZREMRANGEBYSCORE, a write
    // Redis does not refuse when full) before it adds, and Redis lets a
    // script that has written carry on past `maxmemory`.
    for algorithm in Algorithm::ALL
        .into_iter()
        .filter(|a| *a != Algorithm::SlidingLog)
    {
        let err = check(&store, algorithm, 1, 1, T0).await.unwrap_err();
        assert_eq!(err.kind(), "oom", "{algorithm:?}: {err}");
    }
    // The sliding log, as the runbook says, goes on past the limit.
    assert!(
        check(&store, Algorithm::SlidingLog, 1, 1, T0)
            .await
            .unwrap()
    );
    store.ready().await.unwrap();
}

/// No password, or a wrong one: `auth`, from checks and readiness alike.
#[tokio::test]
async fn a_missing_or_wrong_password_is_auth() {
    let redis = RedisServer::start_with(&["--requirepass", "s3cret"]).unwrap();
    for (what, url) in [
        ("no password", redis.url()),
        (
            "a wrong password",
            with_credentials(&redis.url(), "", "wrong"),
        ),
        (
            "an unknown user",
            with_credentials(&redis.url(), "nobody", "s3cret"),
        ),
    ] {
        let store = lua(&settings(vec![url], false)).await;
        let err = check(&store, Algorithm::TokenBucket, 1, 1, T0)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), "auth", "{what}: {err}");
        let err = store.ready().await.unwrap_err();
        assert_eq!(err.kind(), "auth", "{what}: readiness: {err}");
    }
    let store = lua(&settings(
        vec![with_credentials(&redis.url(), "", "s3cret")],
        false,
    ))
    .await;
    assert!(
        check(&store, Algorithm::TokenBucket, 1, 1, T0)
            .await
            .unwrap()
    );
}

/// The minimal ACL's lines (docs/redis.md), each a list of
/// `ACL SETUSER` arguments, by what they are for: `base` (every lua
/// deployment), an algorithm's name, `naive`, `cluster`.
fn readme_acl() -> Vec<(Vec<String>, Vec<String>)> {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/redis.md")).unwrap();
    let mut lines = Vec::new();
    for line in readme.lines() {
        let Some(rest) = line.strip_prefix("redis-cli ACL SETUSER ratelimiter ") else {
            continue;
        };
        let (args, tags) = rest.split_once('#').unwrap_or((rest, "base"));
        let args = args
            .split_whitespace()
            .map(|a| a.trim_matches('\'').to_owned())
            .collect();
        let tags = tags
            .split(',')
            .map(|t| t.split_whitespace().next().unwrap_or("").to_owned())
            .collect();
        lines.push((tags, args));
    }
    assert!(lines.len() >= 5, "the minimal ACL lines: {lines:?}");
    lines
}

/// The arguments of the lines for `tags`, in order (so `reset`, `on` and
/// `>PASSWORD` lead when the base line is among them).
fn acl_for(lines: &[(Vec<String>, Vec<String>)], tags: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    for tag in tags {
        let found = lines.iter().filter(|(t, _)| t.iter().any(|t| t == tag));
        let mut any = false;
        for (_, args) in found {
            any = true;
            out.extend(args.iter().cloned());
        }
        assert!(any, "docs/redis.md has no ACL line for {tag}");
    }
    out
}

/// Creates the user afresh with `permissions` (and the password).
fn set_user(redis: &RedisServer, permissions: &[String]) {
    redis.cli(&["ACL", "DELUSER", "ratelimiter"]).unwrap();
    let mut args = vec!["ACL", "SETUSER", "ratelimiter"];
    args.extend(permissions.iter().map(|p| {
        if p == ">PASSWORD" {
            ">acl-test-password"
        } else {
            p.as_str()
        }
    }));
    let out = redis.cli(&args).unwrap();
    assert_eq!(out.trim(), "OK", "ACL SETUSER {permissions:?}");
}

fn acl_url(redis: &RedisServer) -> String {
    with_credentials(&redis.url(), "ratelimiter", "acl-test-password")
}

/// Everything a lua store sends for `algorithm`: readiness, a check whose
/// script Redis must load first, one that writes, a peek that deletes.
async fn lua_round(redis: &RedisServer, algorithm: Algorithm) -> Result<(), StoreError> {
    redis.cli(&["script", "flush"]).unwrap();
    redis.cli(&["flushall"]).unwrap();
    let store = lua(&settings(vec![acl_url(redis)], false)).await;
    store.ready().await?;
    assert!(check(&store, algorithm, 7, 1, T0).await?, "{algorithm:?}");
    // A peek (cost 0) at a bucket full again: the key goes (DEL).
    check(&store, algorithm, 7, 0, T0 + HOUR).await?;
    Ok(())
}

/// Everything a naive store sends: readiness, GET, SET, and a DEL.
async fn naive_round(redis: &RedisServer) -> Result<(), StoreError> {
    redis.cli(&["flushall"]).unwrap();
    let s = settings(vec![acl_url(redis)], false);
    let store = NaiveStore::new(RedisConnection::connect(&s).await.unwrap(), &s);
    store.ready().await?;
    let limit = Limit::per_second(5, 1).unwrap();
    store.check(Check::new(BucketKey(7), limit, 1, T0)).await?;
    store
        .check(Check::new(BucketKey(7), limit, 0, T0 + HOUR))
        .await?;
    Ok(())
}

/// Commands the user was refused, from `ACL LOG`, as `command` or
/// `command|sub` (the client's own `CLIENT SETINFO`, whose refusal it
/// ignores, left out).
fn refused(redis: &RedisServer) -> Vec<String> {
    let log = redis.cli(&["acl", "log"]).unwrap();
    let lines: Vec<&str> = log.lines().collect();
    lines
        .windows(2)
        .filter(|w| w[0] == "object")
        .map(|w| w[1].to_owned())
        .filter(|object| object != "client|setinfo")
        .collect()
}

/// [`lua_round`] for an algorithm's name, else [`naive_round`].
async fn round(redis: &RedisServer, what: &str) -> Result<(), StoreError> {
    match Algorithm::ALL.iter().find(|a| a.as_str() == what) {
        Some(&algorithm) => lua_round(redis, algorithm).await,
        None => naive_round(redis).await,
    }
}

/// The minimal ACL, per backend and algorithm, is enough for
/// everything the service sends, and every permission in it is needed:
/// without any one of them something fails, as `noperm`.
#[tokio::test]
async fn the_readme_acl_is_exactly_enough() {
    let lines = readme_acl();
    let redis = RedisServer::start().unwrap();
    let mut rounds: Vec<(String, Vec<String>)> = Algorithm::ALL
        .iter()
        .map(|a| {
            (
                a.as_str().to_owned(),
                acl_for(&lines, &["base", a.as_str()]),
            )
        })
        .collect();
    rounds.push(("naive".into(), acl_for(&lines, &["naive"])));
    for (what, acl) in rounds {
        redis.cli(&["acl", "log", "reset"]).unwrap();
        set_user(&redis, &acl);
        round(&redis, &what)
            .await
            .unwrap_or_else(|e| panic!("{what} with {acl:?}: {e}"));
        assert_eq!(refused(&redis), Vec::<String>::new(), "{what}: refused");
        let permissions = acl
            .iter()
            .filter(|p| !["reset", "on", ">PASSWORD"].contains(&p.as_str()));
        for permission in permissions {
            let fewer: Vec<String> = acl.iter().filter(|p| *p != permission).cloned().collect();
            set_user(&redis, &fewer);
            let err = round(&redis, &what)
                .await
                .expect_err(&format!("{what} works without {permission}"));
            assert_eq!(err.kind(), "noperm", "{what} without {permission}: {err}");
        }
    }
}

/// The minimal ACL's cluster lines on every node: a cluster connection reads
/// the slot map (CLUSTER SLOTS) and follows redirects (ASKING); without
/// the slot map it decides by redirects alone, blind to which node is
/// which.
#[tokio::test]
async fn the_readme_acl_is_enough_in_a_cluster() {
    let lines = readme_acl();
    let cluster = RedisCluster::start().unwrap();
    let acl = acl_for(&lines, &["base", "token_bucket", "cluster"]);
    let set_all = |acl: &[String]| {
        for node in &cluster.nodes {
            set_user(node, acl);
        }
    };
    set_all(&acl);
    let urls: Vec<String> = cluster.nodes.iter().map(acl_url).collect();
    let store = lua(&settings(urls.clone(), true)).await;
    for key in 0..30u128 {
        assert!(
            check(&store, Algorithm::TokenBucket, key, 1, T0)
                .await
                .unwrap()
        );
    }
    // A slot half-way through a move: a key not yet on its old node is
    // asked of the new one (ASK, then ASKING and the script there).
    let name = |k: u128| redis_key("rl:", Algorithm::TokenBucket, BucketKey(k));
    let moving = slot(name(0).as_bytes());
    let mut same_slot = (1..u128::MAX).filter(|k| slot(name(*k).as_bytes()) == moving);
    let (first, second) = (same_slot.next().unwrap(), same_slot.next().unwrap());
    let slot_arg = moving.to_string();
    let from = cluster.owner(moving).unwrap();
    let to = (from + 1) % 3;
    let (from_id, to_id) = (cluster.node_id(from).unwrap(), cluster.node_id(to).unwrap());
    cluster.nodes[to]
        .cli(&["cluster", "setslot", &slot_arg, "importing", &from_id])
        .unwrap();
    cluster.nodes[from]
        .cli(&["cluster", "setslot", &slot_arg, "migrating", &to_id])
        .unwrap();
    assert!(
        check(&store, Algorithm::TokenBucket, first, 1, T0)
            .await
            .unwrap()
    );
    assert_eq!(
        cluster.nodes[to]
            .cli(&["cluster", "countkeysinslot", &slot_arg])
            .unwrap()
            .trim(),
        "1",
        "decided by the node the slot moves to"
    );
    // Without ASKING the new node sends the check back (MOVED) and the old
    // one on again (ASK): it cannot be decided.
    let without = |permission: &str| -> Vec<String> {
        acl.iter().filter(|p| *p != permission).cloned().collect()
    };
    set_all(&without("+asking"));
    let store = lua(&settings(urls.clone(), true)).await;
    let err = check(&store, Algorithm::TokenBucket, second, 1, T0)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), "noperm", "without +asking: {err}");

    // Without the slot map a check is still decided, redirected from the
    // first seed (MOVED), but the store cannot tell which node a key is
    // on: no per-node breaker, no per-node metrics.
    set_all(&without("+cluster|slots"));
    let store = lua(&settings(urls, true)).await;
    assert!(
        check(&store, Algorithm::TokenBucket, 1, 1, T0)
            .await
            .unwrap()
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        store.slot_owner(moving).as_deref(),
        Some("unknown"),
        "without +cluster|slots"
    );
}

/// The service with exactly the documented default ACL: every decision from
/// Redis, ready, nothing refused. Take a permission away and the checks
/// fail over, counted as `noperm`; take PING away and `/readyz` says
/// `noperm` too (the same label, never `auth` for one and `server` for
/// the other).
#[tokio::test]
async fn the_service_runs_on_the_readme_acl_and_names_a_refusal_noperm() {
    let lines = readme_acl();
    let redis = RedisServer::start().unwrap();
    set_user(&redis, &acl_for(&lines, &["base", "token_bucket"]));
    let config = format!(
        "backend = \"lua\"\nkey_secret = \"0123456789abcdef0123\"\n\
         [redis]\nurl = \"{}\"\nresponse_timeout = \"2s\"\n\
         [failure]\ndeadline = \"2s\"\ninstances = 2\n\
         [[policies]]\nname = \"acl-api\"\nroute = \"/api/\"\nburst = 10\nrate = 1\nper = \"1h\"\n",
        acl_url(&redis)
    );
    let server = support::TestServer::start(&config, Arc::new(ManualClock::new(T0))).await;
    let http = support::client();
    let metrics = || acl_metrics(&server, &http);
    let (_, _, noperm_before) = metrics().await;
    for i in 0..3 {
        let r = server.get(&http, "/api/items", &[]).await;
        assert_eq!(r.status(), 200);
        assert_eq!(
            support::header(&r, "ratelimit-remaining"),
            (9 - i).to_string()
        );
    }
    let ready = server
        .get(&http, "/readyz", &[])
        .await
        .text()
        .await
        .unwrap();
    assert!(ready.contains("\"ready\""), "{ready}");
    let (from_redis, local, _) = metrics().await;
    assert_eq!((from_redis, local), (3.0, 0.0));
    assert_eq!(refused(&redis), Vec::<String>::new());

    redis
        .cli(&["ACL", "SETUSER", "ratelimiter", "-set"])
        .unwrap();
    let r = server.get(&http, "/api/items", &[]).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        support::header(&r, "ratelimit-limit"),
        "5",
        "the local share"
    );
    let (from_redis, local, noperm) = metrics().await;
    assert_eq!((from_redis, local), (3.0, 1.0));
    assert!(noperm > noperm_before, "the refusal counted as noperm");

    redis
        .cli(&["ACL", "SETUSER", "ratelimiter", "-ping"])
        .unwrap();
    let ready = server
        .get(&http, "/readyz", &[])
        .await
        .text()
        .await
        .unwrap();
    assert!(ready.contains("\"error\":\"noperm\""), "{ready}");
}

/// Decisions of the `acl-api` policy from Redis and from the local share,
/// and the store errors counted as `noperm`.
async fn acl_metrics(server: &support::TestServer, http: &reqwest::Client) -> (f64, f64, f64) {
    let text = server.metrics(http).await;
    let decisions = |source| {
        support::metric(
            &text,
            "ratelimit_decisions_total",
            &[("policy", "acl-api"), ("source", source)],
        )
    };
    let noperm = support::metric(
        &text,
        "ratelimit_store_errors_total",
        &[("backend", "lua"), ("kind", "noperm")],
    );
    (decisions("redis"), decisions("local"), noperm)
}
