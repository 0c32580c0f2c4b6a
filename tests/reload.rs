//! Reloading the config at run time (SIGHUP): a good file is put in force
//! whole while live buckets carry on; a bad file, or one that changes what
//! only a restart can, changes nothing and says exactly why. In process
//! through `server::Reloader`, and on the real binary with a real signal.

mod support;

use axum::body::Body;
use axum::extract::ConnectInfo;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use ratelimiter::api::{AppState, app};
use ratelimiter::clock::{Clock, ManualClock};
use ratelimiter::config::{Cli, Config};
use ratelimiter::middleware::Front;
use ratelimiter::server::{ReloadError, Reloader, in_process_stack, state_with_stack};
use ratelimiter::store::MemoryStore;
use std::io::Read;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use testkit::{ChildGuard, TempDir, free_port, wait_for_port};
use tower::ServiceExt;

const T0: u64 = 1_800_000_000_000_000;
const BIN: &str = env!("CARGO_BIN_EXE_ratelimiter");

/// Three requests an hour for everyone, keyed by address.
fn config_text(trusted: &str, burst: &str) -> String {
    format!(
        "trusted_proxies = [{trusted}]\n\
         [[policies]]\nname = \"api\"\nroute = \"/api/\"\nburst = {burst}\nrate = 1\nper = \"1h\"\n"
    )
}

/// The remaining tokens a GET from `peer` (with `X-Forwarded-For` if
/// given) is told, or its status if refused.
async fn remaining(app: &Front, peer: &str, forwarded: Option<&str>) -> Result<u64, u16> {
    let mut request = Request::get("/api/items");
    if let Some(f) = forwarded {
        request = request.header("x-forwarded-for", f);
    }
    let mut request = request.body(Body::empty()).unwrap();
    request.extensions_mut().insert(ConnectInfo(
        format!("{peer}:4000").parse::<SocketAddr>().unwrap(),
    ));
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let remaining = response
        .headers()
        .get("ratelimit")
        .map(|v| v.to_str().unwrap().to_owned());
    response.into_body().collect().await.unwrap();
    if status != StatusCode::OK {
        return Err(status.as_u16());
    }
    let field = remaining.expect("a RateLimit header");
    let r = field
        .split(';')
        .find_map(|p| p.trim().strip_prefix("r="))
        .expect("r=");
    Ok(r.parse().unwrap())
}

struct Instance {
    _dir: TempDir,
    file: std::path::PathBuf,
    state: AppState,
    reloader: Reloader,
}

fn instance(text: &str) -> Instance {
    let dir = TempDir::new("reload").unwrap();
    let file = dir.join("config.toml");
    std::fs::write(&file, text).unwrap();
    let cli = Cli {
        config: Some(file.clone()),
        ..Cli::default()
    };
    let config = Config::load(cli.clone()).unwrap();
    let stack = in_process_stack(MemoryStore::new(1000, 4));
    let store = Arc::clone(&stack.store);
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(T0));
    let state = state_with_stack(&config, stack, Arc::clone(&clock));
    let reloader = Reloader::new(cli, config, store, clock, &state);
    Instance {
        _dir: dir,
        file,
        state,
        reloader,
    }
}

#[tokio::test]
async fn a_good_reload_puts_the_new_trust_in_force_and_live_buckets_carry_on() {
    let it = instance(&config_text("", "3"));
    let api = app(it.state.clone());
    // Untrusted: the header is ignored, the peer is the client.
    assert_eq!(
        remaining(&api, "192.0.2.10", Some("203.0.113.5")).await,
        Ok(2)
    );
    assert_eq!(
        remaining(&api, "192.0.2.10", Some("203.0.113.6")).await,
        Ok(1)
    );
    assert_eq!(it.state.limiter.generation(), 1);

    std::fs::write(&it.file, config_text("\"192.0.2.10\"", "3")).unwrap();
    it.reloader.reload().unwrap();
    assert_eq!(it.state.limiter.generation(), 2);
    // The proxy is trusted now: each forwarded client has its own bucket.
    assert_eq!(
        remaining(&api, "192.0.2.10", Some("203.0.113.5")).await,
        Ok(2)
    );
    assert_eq!(
        remaining(&api, "192.0.2.10", Some("203.0.113.6")).await,
        Ok(2)
    );
    // The proxy's own bucket was not reset by the reload: one token left.
    assert_eq!(remaining(&api, "192.0.2.10", None).await, Ok(0));
    assert_eq!(remaining(&api, "192.0.2.10", None).await, Err(429));
}

#[tokio::test]
async fn a_bad_file_changes_nothing_and_the_error_names_the_field() {
    let it = instance(&config_text("\"192.0.2.10\"", "3"));
    let api = app(it.state.clone());
    assert_eq!(
        remaining(&api, "192.0.2.10", Some("203.0.113.5")).await,
        Ok(2)
    );

    std::fs::write(&it.file, config_text("\"192.0.2.10\"", "\"many\"")).unwrap();
    let error = it.reloader.reload().unwrap_err();
    assert!(matches!(error, ReloadError::Invalid(_)), "{error:?}");
    assert!(error.to_string().contains("policies[0].burst"), "{error}");
    std::fs::write(&it.file, config_text("\"not-an-address\"", "3")).unwrap();
    let error = it.reloader.reload().unwrap_err();
    assert!(error.to_string().contains("trusted_proxies[0]"), "{error}");
    std::fs::remove_file(&it.file).unwrap();
    let error = it.reloader.reload().unwrap_err();
    assert!(error.to_string().contains("config.toml"), "{error}");

    // The running config is untouched: still trusted, same buckets.
    assert_eq!(it.state.limiter.generation(), 1);
    assert_eq!(
        remaining(&api, "192.0.2.10", Some("203.0.113.5")).await,
        Ok(1)
    );
}

#[tokio::test]
async fn a_change_that_needs_a_restart_refuses_the_whole_file() {
    let it = instance(&config_text("", "3"));
    let api = app(it.state.clone());
    // A good change (trust) beside three that need a restart.
    std::fs::write(
        &it.file,
        format!(
            "listen = \"127.0.0.1:1\"\n{}[memory]\nmax_keys = 7\n[rls]\nlisten = \"127.0.0.1:2\"\n",
            config_text("\"192.0.2.10\"", "3")
        ),
    )
    .unwrap();
    match it.reloader.reload() {
        Err(ReloadError::NeedsRestart(fields)) => {
            assert_eq!(fields, ["listen", "memory", "rls.listen"])
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(it.state.limiter.generation(), 1);
    // Nothing of the file applied: the proxy is still not trusted.
    assert_eq!(
        remaining(&api, "192.0.2.10", Some("203.0.113.5")).await,
        Ok(2)
    );
    assert_eq!(
        remaining(&api, "192.0.2.10", Some("203.0.113.6")).await,
        Ok(1)
    );
}

/// `GET path` on the instance at `port`: status and body.
fn get(port: u16, path: &str) -> (u16, String) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let r = reqwest::get(format!("http://127.0.0.1:{port}{path}"))
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    })
}

fn status(port: u16) -> serde_json::Value {
    serde_json::from_str(&get(port, "/api/status").1).unwrap()
}

fn hangup(child: &ChildGuard) {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.pid()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).unwrap();
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "{what} within 10 s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn reloads(port: u16, result: &str) -> f64 {
    support::metric(
        &get(port, "/metrics").1,
        "ratelimit_config_reloads_total",
        &[("result", result)],
    )
}

#[test]
fn sighup_reloads_the_running_binary_and_a_bad_file_is_refused() {
    let dir = TempDir::new("sighup").unwrap();
    let file = dir.join("config.toml");
    std::fs::write(&file, config_text("", "100")).unwrap();
    let log = dir.join("stderr.log");
    let port = free_port().unwrap();
    let child = Command::new(BIN)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .arg("--config")
        .arg(&file)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let child = ChildGuard(child);
    wait_for_port(port, "ratelimiter").unwrap();
    assert_eq!(status(port)["trusted_proxies"], serde_json::json!([]));
    assert_eq!(status(port)["config_generation"], 1);

    std::fs::write(&file, config_text("\"10.9.0.0/16\"", "100")).unwrap();
    hangup(&child);
    wait_until("the reload applied", || {
        status(port)["config_generation"] == 2
    });
    assert_eq!(
        status(port)["trusted_proxies"],
        serde_json::json!(["10.9.0.0/16"])
    );
    assert_eq!(reloads(port, "applied"), 1.0);

    std::fs::write(&file, config_text("\"10.9.0.0/16\"", "0")).unwrap();
    hangup(&child);
    wait_until("the bad reload counted", || reloads(port, "invalid") == 1.0);
    assert_eq!(status(port)["config_generation"], 2);
    assert_eq!(get(port, "/api/items").0, 200, "still serving");

    drop(child);
    let mut text = String::new();
    std::fs::File::open(Path::new(&log))
        .unwrap()
        .read_to_string(&mut text)
        .unwrap();
    let refused = text
        .lines()
        .find(|l| l.contains("config reload refused"))
        .unwrap_or_else(|| panic!("no refusal logged:\n{text}"));
    assert!(refused.contains("policies[0].burst"), "{refused}");
}
