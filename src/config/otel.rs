//! OpenTelemetry's own environment variables, read as its SDK specification
//! asks: a value that cannot be used is warned about and ignored (the
//! setting keeps the file's value or the default), never a reason to refuse
//! to start. A collector's injected `OTEL_*` must not crash-loop a service
//! on the request path, where the config's own settings (`RL_*`, the file)
//! still fail at start-up with the field named.
//!
//! They layer between the file and the flags: defaults, file, `OTEL_*`,
//! flags. `OTEL_SDK_DISABLED=true` turns trace export off whatever else
//! says so.

use super::cli::TracingFlags;
use crate::telemetry::{OtlpProtocol, SamplerKind};
use clap::ValueEnum;
use serde::Serialize;

/// What the `OTEL_*` variables set, and what they said that was ignored.
#[derive(Debug, Default, Serialize)]
pub struct OtelEnv {
    /// The settings they give, in the file's shape (`tracing.protocol`).
    pub tracing: TracingFlags,
    /// `OTEL_SDK_DISABLED=true`: no traces are exported.
    #[serde(skip)]
    pub disabled: bool,
    /// One line per variable ignored, naming it, its value and why.
    #[serde(skip)]
    pub warnings: Vec<String>,
}

impl OtelEnv {
    /// Reads the variables through `var` (the process environment, or a
    /// test's map). An empty variable counts as unset, as the
    /// specification says.
    pub fn read(var: impl Fn(&str) -> Option<String>) -> Self {
        let mut env = OtelEnv::default();
        let get = |name: &str| {
            var(name)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        if let Some(v) = get("OTEL_SDK_DISABLED") {
            match v.to_ascii_lowercase().as_str() {
                "true" => env.disabled = true,
                "false" => {}
                _ => env.ignore("OTEL_SDK_DISABLED", &v, "not true or false"),
            }
        }
        if let Some(v) = get("OTEL_EXPORTER_OTLP_ENDPOINT") {
            if v.starts_with("http://") || v.starts_with("https://") {
                env.tracing.endpoint = Some(v);
            } else {
                env.ignore(
                    "OTEL_EXPORTER_OTLP_ENDPOINT",
                    &v,
                    "not an http:// or https:// URL",
                );
            }
        }
        if let Some(v) = get("OTEL_EXPORTER_OTLP_PROTOCOL") {
            match <OtlpProtocol as ValueEnum>::from_str(&v, true) {
                Ok(protocol) => env.tracing.protocol = Some(protocol),
                Err(_) if v == "http/json" => env.ignore(
                    "OTEL_EXPORTER_OTLP_PROTOCOL",
                    &v,
                    "not supported (grpc or http/protobuf)",
                ),
                Err(_) => env.ignore(
                    "OTEL_EXPORTER_OTLP_PROTOCOL",
                    &v,
                    "not grpc or http/protobuf",
                ),
            }
        }
        if let Some(v) = get("OTEL_SERVICE_NAME") {
            env.tracing.service_name = Some(v);
        }
        if let Some(v) = get("OTEL_TRACES_SAMPLER") {
            match <SamplerKind as ValueEnum>::from_str(&v, true) {
                Ok(sampler) => env.tracing.sampler = Some(sampler),
                Err(_) => env.ignore("OTEL_TRACES_SAMPLER", &v, "not a sampler this service has"),
            }
        }
        if let Some(v) = get("OTEL_TRACES_SAMPLER_ARG") {
            match v.parse::<f64>() {
                Ok(ratio) if (0.0..=1.0).contains(&ratio) => env.tracing.sampler_arg = Some(ratio),
                _ => env.ignore("OTEL_TRACES_SAMPLER_ARG", &v, "not a ratio from 0 to 1"),
            }
        }
        env
    }

    fn ignore(&mut self, name: &str, value: &str, why: &str) {
        self.warnings.push(format!("{name}={value} ignored: {why}"));
    }
}
