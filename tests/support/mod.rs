//! Support for this crate's integration tests: an instance served in this
//! process on a free port, and HTTP helpers. Real processes (redis-server,
//! clusters, fleets) come from the workspace's `testkit`.

#![allow(dead_code)]

use ratelimiter::clock::Clock;
use ratelimiter::config::Config;
use ratelimiter::server;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// One API instance serving on 127.0.0.1:<free port> inside this process.
pub struct TestServer {
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

impl TestServer {
    /// Starts an instance from TOML config text with the given clock.
    pub async fn start(config_toml: &str, clock: Arc<dyn Clock>) -> Self {
        let config = Config::from_toml(config_toml).expect("test config is valid");
        let state = server::build_state(&config, clock)
            .await
            .expect("store connects");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(server::serve(listener, state, async {
            let _ = stopped.await;
        }));
        Self {
            addr,
            stop: Some(stop),
            task,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// GET `path` with extra headers.
    pub async fn get(
        &self,
        http: &reqwest::Client,
        path: &str,
        headers: &[(&str, &str)],
    ) -> reqwest::Response {
        let mut request = http.get(self.url(path));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.send().await.unwrap()
    }

    /// The text of `/metrics`.
    pub async fn metrics(&self, http: &reqwest::Client) -> String {
        self.get(http, "/metrics", &[]).await.text().await.unwrap()
    }

    /// Stops gracefully and waits for the server to finish.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        (&mut self.task).await.unwrap().unwrap();
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task.abort();
    }
}

/// A client that keeps no connection pool between tests.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(10))
        .build()
        .unwrap()
}

/// A header as text, panicking with the header name if absent.
pub fn header<'a>(r: &'a reqwest::Response, name: &str) -> &'a str {
    r.headers()
        .get(name)
        .unwrap_or_else(|| panic!("missing header {name}"))
        .to_str()
        .unwrap()
}

/// The value of the series `name{labels...}` in Prometheus text `text`
/// (0 if absent): the first line of `name` whose labels include all of
/// `labels`.
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (metric, rest) = series.split_once('{').unwrap_or((series, ""));
            (metric == name
                && labels
                    .iter()
                    .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\""))))
            .then(|| value.parse::<f64>().ok())?
        })
        .next()
        .unwrap_or(0.0)
}
