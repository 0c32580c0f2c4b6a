//! The gRPC side of `http-cost`: the same closed loop as [`super::drive`]
//! over Envoy's rate limit service, with the client generated from
//! Envoy's protos (tonic, one HTTP/2 connection per loop, driven by one
//! thread), so a decision asked over gRPC is measured beside one asked
//! over HTTP, on the same server and policy.

use super::HttpCostArgs;
use super::drive::{Tally, cpu_since, cpu_times, share};
use crate::capacity::CpuTimes;
use anyhow::Context;
use ratelimiter::rls::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use ratelimiter::rls::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use ratelimiter::rls::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use ratelimiter::rls::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use ratelimiter::rls::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use std::time::Instant;
use tonic::transport::{Channel, Endpoint};

/// The domain and descriptor every call asks about: one bucket, as every
/// HTTP request of a run is one client's.
pub(super) const DOMAIN: &str = "bench";

fn request() -> RateLimitRequest {
    RateLimitRequest {
        domain: DOMAIN.into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "api_key".into(),
                value: "bench".into(),
            }],
            ..Default::default()
        }],
        hits_addend: 0,
    }
}

/// Calls `n` times in a row on `client`, tallying into `tally` (with the
/// latencies when `measured`).
async fn calls(client: &mut RateLimitServiceClient<Channel>, n: usize, measured: bool) -> Tally {
    let mut tally = Tally::default();
    for _ in 0..n {
        let sent = Instant::now();
        let answer = client.should_rate_limit(request()).await;
        if measured {
            tally
                .latencies_us
                .push(u32::try_from(sent.elapsed().as_micros()).unwrap_or(u32::MAX));
        }
        match answer.map(tonic::Response::into_inner) {
            Ok(r) if r.overall_code == Code::Ok as i32 => tally.ok += 1,
            Ok(r) if r.overall_code == Code::OverLimit as i32 => tally.limited += 1,
            _ => tally.other += 1,
        }
    }
    tally
}

/// Drives the rate limit service on `port` with `args.connections`
/// closed loops: the warm-up, then the measured calls, reading `pids`'
/// CPU around them.
pub(super) fn drive(
    port: u16,
    pids: &[u32],
    args: &HttpCostArgs,
) -> anyhow::Result<(f64, Vec<CpuTimes>, Tally)> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let connections = args.connections.max(1);
        let mut clients = Vec::with_capacity(connections);
        for _ in 0..connections {
            let channel = Endpoint::from_shared(format!("http://127.0.0.1:{port}"))?
                .tcp_nodelay(true)
                .connect()
                .await
                .context("cannot connect to the rate limit service")?;
            clients.push(RateLimitServiceClient::new(channel));
        }
        // Each loop its own client (a clone shares its connection).
        let phase = |total: usize, measured: bool| {
            let loops = clients.iter().enumerate().map(move |(i, c)| {
                let mut c = c.clone();
                async move { calls(&mut c, share(i, total, connections), measured).await }
            });
            futures_util::future::join_all(loops)
        };
        phase(args.warmup, false).await;
        let before = cpu_times(pids);
        let started = Instant::now();
        let tallies = phase(args.requests, true).await;
        let seconds = started.elapsed().as_secs_f64();
        let used = cpu_since(pids, before);
        let mut all = Tally::default();
        for t in tallies {
            all.add(t);
        }
        all.latencies_us.sort_unstable();
        Ok((seconds, used, all))
    })
}
