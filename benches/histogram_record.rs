//! Nanoseconds per histogram record: a `*_seconds` series in our fixed
//! buckets (`metrics::buckets`) against the Prometheus exporter's own
//! histogram, which appends each sample with its time and sorts the
//! samples into buckets on upkeep.
//!
//! A limited request records two durations (its own and its check's), so
//! this is on the request path. Both run in one criterion process with the
//! same bounds (`SECONDS_BUCKETS`) and the same values; the exporter's
//! upkeep, which in the service runs every five seconds, runs here every
//! 4 096 records inside the timed loop, so its draining is counted as the
//! service pays it. In a loop the caches stay warm: what the request path
//! also saves in cache lines touched shows in callgrind's cache simulation
//! instead (docs/http-cost.md).
//!
//! `cargo bench --bench histogram_record`

use criterion::{Criterion, criterion_group, criterion_main};
use metrics::Histogram;
use metrics_exporter_prometheus::PrometheusBuilder;
use ratelimiter::metrics::SECONDS_BUCKETS;
use ratelimiter::metrics::buckets::Buckets;
use std::hint::black_box;
use std::time::{Duration, Instant};

const UPKEEP_EVERY: u64 = 4096;

/// Durations of an in-memory check and of a request: 20-500 µs.
fn value(i: u64) -> f64 {
    0.000_02 + (i % 25) as f64 * 0.000_02
}

fn run(histogram: &Histogram, upkeep: &dyn Fn(), iters: u64) -> Duration {
    let started = Instant::now();
    for i in 0..iters {
        histogram.record(black_box(value(i)));
        if i % UPKEEP_EVERY == UPKEEP_EVERY - 1 {
            upkeep();
        }
    }
    started.elapsed()
}

fn record(c: &mut Criterion) {
    let mut group = c.benchmark_group("record");

    let exporter = PrometheusBuilder::new()
        .set_buckets(SECONDS_BUCKETS)
        .expect("static, non-empty bounds")
        .build_recorder();
    let handle = exporter.handle();
    let theirs = metrics::with_local_recorder(
        &exporter,
        || metrics::histogram!("bench_duration_seconds", "route" => "/api/items"),
    );
    group.bench_function("exporter", |b| {
        b.iter_custom(|iters| run(&theirs, &|| handle.run_upkeep(), iters));
    });

    let layer = Buckets::new(PrometheusBuilder::new().build_recorder(), SECONDS_BUCKETS);
    let ours = metrics::with_local_recorder(
        &layer,
        || metrics::histogram!("bench_duration_seconds", "route" => "/api/items"),
    );
    group.bench_function("fixed_buckets", |b| {
        b.iter_custom(|iters| run(&ours, &|| (), iters));
    });
    group.finish();
}

criterion_group!(benches, record);
criterion_main!(benches);
