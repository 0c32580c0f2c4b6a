//! What the stack's Prometheus saw during a run, through its HTTP API:
//! instant and range queries (`panels.rs` asks them the dashboards'
//! queries).

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
}
