//! The span queue between the request path and the collector: bounded, so
//! an unreachable or slow collector never slows a request or grows memory.
//!
//! `on_end` (on the request's thread) only tries to enqueue; a full queue
//! drops the span and counts it (`ratelimit_trace_spans_dropped_total
//! {reason="queue_full"}`). One task on the runtime takes batches off the
//! queue (when a batch is full, or after the batch delay) and exports them
//! with a timeout; a batch that fails is dropped and counted
//! (`reason="export_failed"`). Nothing retries: the next batch is newer.
//!
//! (opentelemetry_sdk's `BatchSpanProcessor` drops the same way but keeps
//! its count to itself until shutdown; this one shows it on `/metrics`.)

use crate::metrics as m;
use opentelemetry::Context;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter, SpanProcessor};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// Spans exported together, at most.
const MAX_BATCH: usize = 512;

/// How the queue behaves.
#[derive(Debug, Clone, Copy)]
pub struct QueueSettings {
    /// Spans waiting for export, at most; more are dropped.
    pub queue_size: usize,
    /// The longest a span waits for a batch to fill.
    pub batch_delay: Duration,
    /// The longest one export may take.
    pub export_timeout: Duration,
}

enum Message {
    Span(Box<SpanData>),
    /// Export what is queued, then answer.
    Flush(oneshot::Sender<()>),
}

/// The bounded span processor. See the module docs. Clones share the queue
/// (one goes to the tracer provider, one stays to flush at shutdown).
#[derive(Debug, Clone)]
pub struct QueueExport {
    /// `None` once shut down.
    queue: Arc<Mutex<Option<mpsc::Sender<Message>>>>,
}

impl QueueExport {
    /// Starts the export task on the current tokio runtime.
    pub fn start<E>(mut exporter: E, resource: &Resource, settings: QueueSettings) -> Self
    where
        E: SpanExporter + 'static,
    {
        exporter.set_resource(resource);
        let (sender, receiver) = mpsc::channel(settings.queue_size.max(1));
        tokio::spawn(run(exporter, receiver, settings));
        Self {
            queue: Arc::new(Mutex::new(Some(sender))),
        }
    }

    fn sender(&self) -> Option<mpsc::Sender<Message>> {
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Exports what is queued now (waiting at most `timeout`).
    pub async fn flush(&self, timeout: Duration) {
        let Some(sender) = self.sender() else {
            return;
        };
        let (done, finished) = oneshot::channel();
        if sender.send(Message::Flush(done)).await.is_ok() {
            let _ = tokio::time::timeout(timeout, finished).await;
        }
    }
}

fn dropped(reason: &'static str, n: usize) {
    metrics::counter!(m::TRACE_SPANS_DROPPED_TOTAL, "reason" => reason).increment(n as u64);
}

async fn export<E: SpanExporter>(exporter: &E, batch: &mut Vec<SpanData>, timeout: Duration) {
    if batch.is_empty() {
        return;
    }
    let spans = std::mem::take(batch);
    let n = spans.len();
    match tokio::time::timeout(timeout, exporter.export(spans)).await {
        Ok(Ok(())) => {}
        Ok(Err(_)) | Err(_) => dropped("export_failed", n),
    }
}

async fn run<E: SpanExporter>(
    exporter: E,
    mut receiver: mpsc::Receiver<Message>,
    settings: QueueSettings,
) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    loop {
        let message = if batch.is_empty() {
            receiver.recv().await
        } else {
            match tokio::time::timeout(settings.batch_delay, receiver.recv()).await {
                Ok(message) => message,
                Err(_delay_passed) => {
                    export(&exporter, &mut batch, settings.export_timeout).await;
                    continue;
                }
            }
        };
        match message {
            Some(Message::Span(span)) => {
                batch.push(*span);
                if batch.len() >= MAX_BATCH {
                    export(&exporter, &mut batch, settings.export_timeout).await;
                }
            }
            Some(Message::Flush(done)) => {
                // Everything queued before the flush is in the batch by now.
                export(&exporter, &mut batch, settings.export_timeout).await;
                let _ = done.send(());
            }
            None => {
                export(&exporter, &mut batch, settings.export_timeout).await;
                let _ = exporter.shutdown();
                return;
            }
        }
    }
}

impl SpanProcessor for QueueExport {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        let Some(sender) = self.sender() else {
            return;
        };
        match sender.try_send(Message::Span(Box::new(span))) {
            Ok(()) => {}
            // Never wait on the request path: drop, and say so.
            Err(mpsc::error::TrySendError::Full(_)) => dropped("queue_full", 1),
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        // Export happens on the runtime; `flush` is the async way to wait.
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        // Closing the queue makes the task export what is left and stop.
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        Ok(())
    }

    fn set_resource(&mut self, _resource: &Resource) {
        // Set on the exporter before it moved to the export task.
    }
}
