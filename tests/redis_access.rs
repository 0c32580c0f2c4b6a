//! Reaching Redis the way a managed one demands, on real redis-server
//! processes: TLS (a CA file, client certificates, a cluster) and a
//! password.

mod support;

use ratelimiter::algorithm::{Algorithm, Limit};
use ratelimiter::clock::ManualClock;
use ratelimiter::config::Config;
use ratelimiter::store::redis::{ClientIdentity, RedisConnection, RedisSettings, RedisTls};
use ratelimiter::store::{BucketKey, Check, LuaStore, Store, StoreError};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use testkit::{RedisCluster, RedisServer, TestCerts};

const T0: u64 = 1_800_000_000_000_000;

/// Settings for `urls` under the default prefix, with timeouts for a
/// shared test machine.
fn settings(urls: Vec<String>, cluster: bool) -> RedisSettings {
    RedisSettings {
        urls,
        cluster,
        prefix: "rl:".into(),
        connect_timeout: Duration::from_secs(2),
        response_timeout: Duration::from_secs(2),
        retries: 1,
        // Long: a test's keys must outlive a slow machine's pauses.
        ttl_margin: Duration::from_secs(60),
        topology_refresh: Duration::from_secs(1),
        tls: RedisTls::default(),
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
