//! `*_seconds` histograms kept in fixed buckets of atomic counters, in
//! front of the Prometheus exporter's recorder.
//!
//! The exporter keeps each histogram as the samples themselves, appended
//! with their time to blocks it drains into buckets on upkeep: a record
//! reads the clock, pins crossbeam's epoch and makes two more atomic
//! updates, and every few dozen samples allocates a block. A limited
//! request records two (its duration and its check's), so all of that is
//! memory the request path touches on every request (docs/http-cost.md).
//! Here a record finds its bucket among the bounds and makes two relaxed
//! atomic updates (the bucket, the sum); the count is the buckets' total,
//! so a scrape never sees a count that disagrees with its buckets.
//!
//! [`Buckets`] is a [`Recorder`] layer: `*_seconds` histograms are
//! registered here, everything else (and every other description) goes
//! on to the exporter, and [`BucketsHandle::render`] writes these series
//! with the exporter's own formatting functions, to be put after its text.

use indexmap::IndexMap;
use metrics::{
    Counter, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};
use metrics_exporter_prometheus::LabelSet;
use metrics_exporter_prometheus::formatting::{
    write_help_line, write_metric_line, write_type_line,
};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

/// The histograms this layer keeps: every `*_seconds` one.
const SUFFIX: &str = "_seconds";

/// One series: how many samples fell at or under each bound (not
/// cumulative; the last counter is over the last bound), and their sum.
#[derive(Debug)]
struct Series {
    bounds: &'static [f64],
    counts: Box<[AtomicU64]>,
    /// An `f64`'s bits.
    sum: AtomicU64,
}

impl Series {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum: AtomicU64::new(0f64.to_bits()),
        }
    }
}

impl HistogramFn for Series {
    fn record(&self, value: f64) {
        // A value that is no number or infinite is counted past the last
        // bound and left out of the sum, which would otherwise stay NaN or
        // infinite for good.
        if !value.is_finite() {
            self.counts[self.bounds.len()].fetch_add(1, Ordering::Relaxed);
            return;
        }
        // The first bound at or over the value.
        let at = self.bounds.partition_point(|&bound| bound < value);
        self.counts[at].fetch_add(1, Ordering::Relaxed);
        // Uncontended, one compare-and-swap; a concurrent record retries.
        let _ = self
            .sum
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + value).to_bits())
            });
    }
}

#[derive(Debug, Default)]
struct Family {
    help: Option<String>,
    /// By labels, in the order the series were first registered.
    series: IndexMap<LabelSet, Arc<Series>>,
}

/// The recorder layer; see the module docs.
#[derive(Debug)]
pub struct Buckets<R> {
    inner: R,
    bounds: &'static [f64],
    families: Arc<RwLock<BTreeMap<String, Family>>>,
}

/// What renders a [`Buckets`] layer's series, kept after the layer is
/// installed.
#[derive(Debug, Clone)]
pub struct BucketsHandle {
    bounds: &'static [f64],
    families: Arc<RwLock<BTreeMap<String, Family>>>,
}

impl<R> Buckets<R> {
    /// `inner` with every `*_seconds` histogram kept here, in `bounds`
    /// (ascending).
    pub fn new(inner: R, bounds: &'static [f64]) -> Self {
        debug_assert!(bounds.windows(2).all(|w| w[0] < w[1]), "bounds ascend");
        Self {
            inner,
            bounds,
            families: Arc::default(),
        }
    }

    /// The handle that renders these series.
    pub fn handle(&self) -> BucketsHandle {
        BucketsHandle {
            bounds: self.bounds,
            families: Arc::clone(&self.families),
        }
    }

    fn families(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, Family>> {
        self.families
            .write()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

fn ours(name: &str) -> bool {
    name.ends_with(SUFFIX)
}

impl<R: Recorder> Recorder for Buckets<R> {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.inner.describe_counter(key, unit, description);
    }

    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.inner.describe_gauge(key, unit, description);
    }

    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        if ours(key.as_str()) {
            self.families()
                .entry(key.as_str().to_owned())
                .or_default()
                .help = Some(description.into_owned());
        } else {
            self.inner.describe_histogram(key, unit, description);
        }
    }

    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        self.inner.register_counter(key, metadata)
    }

    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        self.inner.register_gauge(key, metadata)
    }

    fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> Histogram {
        if !ours(key.name()) {
            return self.inner.register_histogram(key, metadata);
        }
        // No global labels: the exporter is built with none.
        let labels = LabelSet::from_key_and_global(key, &IndexMap::new());
        let series = Arc::clone(
            self.families()
                .entry(key.name().to_owned())
                .or_default()
                .series
                .entry(labels)
                .or_insert_with(|| Arc::new(Series::new(self.bounds))),
        );
        Histogram::from_arc(series)
    }
}

impl BucketsHandle {
    /// Every series recorded so far, in the Prometheus text format (as the
    /// exporter writes its histograms: cumulative buckets, `+Inf`, sum,
    /// count); a family with no series is left out.
    pub fn render(&self) -> String {
        let families = self.families.read().unwrap_or_else(PoisonError::into_inner);
        let mut text = String::new();
        for (name, family) in families.iter().filter(|(_, f)| !f.series.is_empty()) {
            if let Some(help) = &family.help {
                write_help_line(&mut text, name, None, None, help);
            }
            write_type_line(&mut text, name, None, None, "histogram");
            for (labels, series) in &family.series {
                let mut total = 0u64;
                for (at, bound) in self.bounds.iter().enumerate() {
                    total += series.counts[at].load(Ordering::Relaxed);
                    let le = Some(("le", bound));
                    write_metric_line(&mut text, name, Some("bucket"), labels, le, total, None);
                }
                total += series.counts[self.bounds.len()].load(Ordering::Relaxed);
                let le = Some(("le", "+Inf"));
                write_metric_line(&mut text, name, Some("bucket"), labels, le, total, None);
                let sum = f64::from_bits(series.sum.load(Ordering::Relaxed));
                write_metric_line::<&str, f64>(
                    &mut text,
                    name,
                    Some("sum"),
                    labels,
                    None,
                    sum,
                    None,
                );
                write_metric_line::<&str, u64>(
                    &mut text,
                    name,
                    Some("count"),
                    labels,
                    None,
                    total,
                    None,
                );
            }
            text.push('\n');
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrics_exporter_prometheus::PrometheusBuilder;

    const BOUNDS: &[f64] = &[0.001, 0.01, 0.1];

    fn layer() -> Buckets<metrics_exporter_prometheus::PrometheusRecorder> {
        Buckets::new(PrometheusBuilder::new().build_recorder(), BOUNDS)
    }

    #[test]
    fn a_series_renders_as_cumulative_buckets_with_sum_and_count() {
        let layer = layer();
        let handle = layer.handle();
        metrics::with_local_recorder(&layer, || {
            metrics::describe_histogram!("x_seconds", Unit::Seconds, "How \"long\"\nit took");
            let h = metrics::histogram!("x_seconds", "route" => "/a\"b", "code" => "200");
            // On a bound counts under it, as Prometheus's `le` says.
            for v in [0.0005, 0.001, 0.05, 0.25, f64::NAN, f64::INFINITY] {
                h.record(v);
            }
        });
        let text = handle.render();
        let expected = "# HELP x_seconds How \"long\"\\nit took\n\
             # TYPE x_seconds histogram\n\
             x_seconds_bucket{route=\"/a\\\"b\",code=\"200\",le=\"0.001\"} 2\n\
             x_seconds_bucket{route=\"/a\\\"b\",code=\"200\",le=\"0.01\"} 2\n\
             x_seconds_bucket{route=\"/a\\\"b\",code=\"200\",le=\"0.1\"} 3\n\
             x_seconds_bucket{route=\"/a\\\"b\",code=\"200\",le=\"+Inf\"} 6\n\
             x_seconds_sum{route=\"/a\\\"b\",code=\"200\"} 0.3015\n\
             x_seconds_count{route=\"/a\\\"b\",code=\"200\"} 6\n\n";
        assert_eq!(text, expected);
    }

    #[test]
    fn the_same_key_shares_its_series_and_other_metrics_go_on() {
        let layer = layer();
        let handle = layer.handle();
        let prometheus = layer.inner.handle();
        metrics::with_local_recorder(&layer, || {
            metrics::histogram!("y_seconds").record(0.5);
            // Registered again (a reloaded limiter does): the same series.
            metrics::histogram!("y_seconds").record(0.05);
            metrics::histogram!("z_bytes").record(3.0);
            metrics::counter!("c_total").increment(2);
        });
        let ours = handle.render();
        assert!(ours.contains("y_seconds_count 2\n"), "{ours}");
        assert!(ours.contains("y_seconds_sum 0.55\n"), "{ours}");
        assert!(ours.contains("y_seconds_bucket{le=\"0.1\"} 1\n"), "{ours}");
        assert!(
            !ours.contains("z_bytes") && !ours.contains("c_total"),
            "{ours}"
        );
        let theirs = prometheus.render();
        assert!(theirs.contains("z_bytes"), "{theirs}");
        assert!(theirs.contains("c_total 2"), "{theirs}");
        assert!(!theirs.contains("y_seconds"), "{theirs}");
    }
}
