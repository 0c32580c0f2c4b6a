//! What the stack's Prometheus saw during a run, through its HTTP API: the
//! check latency the instances measured and how the Redis calls spread
//! over the nodes. The node share is the dashboards' per-node call rate;
//! the check quantile is the dashboards' check p99 over the whole fleet
//! (`sum by (le)`, where the panel splits by instance).

use serde_json::Value;
use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

#[derive(Debug, Clone)]
pub struct Prometheus {
    url: String,
    client: reqwest::Client,
}

/// One series of a query: its labels and its value.
pub type Sample = (BTreeMap<String, String>, f64);

/// Check p99 and the hot node's share, every few seconds of a run.
#[derive(Debug, Clone, Default)]
pub struct Timeline {
    /// Seconds since the run started.
    pub seconds: Vec<f64>,
    /// The check p99 over all instances (seconds), if any checks.
    pub check_p99: Vec<Option<f64>>,
    /// The busiest node's share of the Redis calls, and the node.
    pub hot_share: Vec<Option<(String, f64)>>,
}

/// The check latency quantile the dashboards show.
pub fn check_quantile_query(q: f64, window_secs: u64) -> String {
    format!(
        "histogram_quantile({q}, sum by (le) (rate(ratelimit_check_duration_seconds_bucket[{window_secs}s])))"
    )
}

/// Redis calls per second, by node (the dashboards' per-node call rate).
pub fn node_rate_query(window_secs: u64) -> String {
    format!("sum by (node) (rate(ratelimit_redis_call_duration_seconds_count[{window_secs}s]))")
}

/// The busiest node and its share of all calls.
pub fn hot_share(rates: &[Sample]) -> Option<(String, f64)> {
    let total: f64 = rates.iter().map(|(_, v)| v).filter(|v| v.is_finite()).sum();
    if total <= 0.0 {
        return None;
    }
    rates
        .iter()
        .filter(|(_, v)| v.is_finite())
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(labels, v)| (labels.get("node").cloned().unwrap_or_default(), v / total))
}

fn unix(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

fn number(v: &Value) -> Option<f64> {
    v.as_str()?.parse::<f64>().ok().filter(|x| x.is_finite())
}

fn labels(v: &Value) -> BTreeMap<String, String> {
    v["metric"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                .collect()
        })
        .unwrap_or_default()
}

impl Prometheus {
    pub fn new(url: &str) -> Self {
        Self {
            url: url.trim_end_matches('/').to_owned(),
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .expect("a plain HTTP client"),
        }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// Whether it answers at all.
    pub async fn ready(&self) -> bool {
        matches!(
            self.client.get(format!("{}/-/ready", self.url)).send().await,
            Ok(r) if r.status().is_success()
        )
    }

    async fn api(&self, path: &str, params: &[(&str, String)]) -> anyhow::Result<Value> {
        let url = reqwest::Url::parse_with_params(&format!("{}{path}", self.url), params)?;
        let body: Value =
            serde_json::from_slice(&self.client.get(url).send().await?.bytes().await?)?;
        anyhow::ensure!(body["status"] == "success", "prometheus: {body}");
        Ok(body["data"]["result"].clone())
    }

    /// An instant query at `at`.
    pub async fn query(&self, expr: &str, at: SystemTime) -> anyhow::Result<Vec<Sample>> {
        let result = self
            .api(
                "/api/v1/query",
                &[("query", expr.into()), ("time", format!("{:.3}", unix(at)))],
            )
            .await?;
        Ok(result
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| Some((labels(s), number(&s["value"][1])?)))
            .collect())
    }

    /// A range query: each series' labels and its (unix time, value) points.
    pub async fn query_range(
        &self,
        expr: &str,
        from: SystemTime,
        until: SystemTime,
        step: Duration,
    ) -> anyhow::Result<Vec<(BTreeMap<String, String>, Vec<(f64, f64)>)>> {
        let result = self
            .api(
                "/api/v1/query_range",
                &[
                    ("query", expr.into()),
                    ("start", format!("{:.3}", unix(from))),
                    ("end", format!("{:.3}", unix(until))),
                    ("step", format!("{}s", step.as_secs().max(1))),
                ],
            )
            .await?;
        Ok(result
            .as_array()
            .into_iter()
            .flatten()
            .map(|s| {
                let points = s["values"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|p| Some((p[0].as_f64()?, number(&p[1])?)))
                    .collect();
                (labels(s), points)
            })
            .collect())
    }

    /// The check latency `q` quantile over the `window` before `at`
    /// (seconds), or `None` without checks.
    pub async fn check_quantile(&self, q: f64, window: u64, at: SystemTime) -> Option<f64> {
        let samples = self
            .query(&check_quantile_query(q, window), at)
            .await
            .ok()?;
        samples.first().map(|(_, v)| *v)
    }

    /// The busiest Redis node over the `window` before `at` and its share.
    pub async fn hot_node_share(&self, window: u64, at: SystemTime) -> Option<(String, f64)> {
        hot_share(&self.query(&node_rate_query(window), at).await.ok()?)
    }

    /// Check p99 and the hot node's share every 5 s from `from` to `until`.
    pub async fn timeline(&self, from: SystemTime, until: SystemTime) -> anyhow::Result<Timeline> {
        let step = Duration::from_secs(5);
        let p99 = self
            .query_range(&check_quantile_query(0.99, 15), from, until, step)
            .await?;
        let rates = self
            .query_range(&node_rate_query(15), from, until, step)
            .await?;
        let t0 = unix(from);
        let mut timeline = Timeline::default();
        let points = |series: &[(f64, f64)], t: f64| {
            series
                .iter()
                .find(|(at, _)| (at - t).abs() < 0.5)
                .map(|(_, v)| *v)
        };
        let mut times: Vec<f64> = p99
            .iter()
            .chain(&rates)
            .flat_map(|(_, pts)| pts.iter().map(|(at, _)| *at))
            .collect();
        times.sort_by(f64::total_cmp);
        times.dedup_by(|a, b| (*a - *b).abs() < 0.5);
        for at in times {
            timeline.seconds.push(at - t0);
            timeline
                .check_p99
                .push(p99.first().and_then(|(_, pts)| points(pts, at)));
            let node_rates: Vec<Sample> = rates
                .iter()
                .filter_map(|(labels, pts)| Some((labels.clone(), points(pts, at)?)))
                .collect();
            timeline.hot_share.push(hot_share(&node_rates));
        }
        Ok(timeline)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, v: f64) -> Sample {
        (BTreeMap::from([("node".to_owned(), name.to_owned())]), v)
    }

    #[test]
    fn the_hot_node_is_the_busiest_and_its_share_of_the_total() {
        let rates = [node("a:1", 10.0), node("b:2", 30.0), node("c:3", 60.0)];
        let (hot, share) = hot_share(&rates).unwrap();
        assert_eq!(hot, "c:3");
        assert!((share - 0.6).abs() < 1e-12);
        assert_eq!(hot_share(&[node("a:1", 0.0)]), None);
        assert_eq!(hot_share(&[]), None);
    }
}
