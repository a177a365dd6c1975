//! The exporter's settings, from `--otlp-endpoint` and OpenTelemetry's standard environment
//! variables, read as the OpenTelemetry SDK and OTLP exporter specifications define them (the
//! signal's `OTEL_EXPORTER_OTLP_TRACES_*` before the general `OTEL_EXPORTER_OTLP_*`).

use anyhow::{Context as _, bail};
use std::time::Duration;
use tonic::metadata::{AsciiMetadataKey, AsciiMetadataValue, MetadataMap};

/// OTLP/gRPC's default endpoint.
const DEFAULT_ENDPOINT: &str = "http://localhost:4317";

/// Where and how batches of spans are sent.
#[derive(Debug, Clone)]
pub struct ExportConfig {
    /// `http://host:port`: the collector's gRPC endpoint (this build speaks no TLS).
    pub endpoint: String,
    /// Sent with every export (`OTEL_EXPORTER_OTLP_{TRACES_,}HEADERS`).
    pub headers: MetadataMap,
    /// Per export (`OTEL_EXPORTER_OTLP_{TRACES_,}TIMEOUT`, capped by `OTEL_BSP_EXPORT_TIMEOUT`).
    pub timeout: Duration,
    /// `OTEL_EXPORTER_OTLP_{TRACES_,}COMPRESSION=gzip`.
    pub gzip: bool,
    /// The batching (`OTEL_BSP_*`).
    pub batch: BatchConfig,
}

/// The batch span processor's settings, with the specification's defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchConfig {
    /// Spans queued before new ones are dropped (`OTEL_BSP_MAX_QUEUE_SIZE`, 2048).
    pub max_queue_size: usize,
    /// The longest a span waits for its batch to be sent (`OTEL_BSP_SCHEDULE_DELAY`, 5000 ms).
    pub scheduled_delay: Duration,
    /// Spans per export request (`OTEL_BSP_MAX_EXPORT_BATCH_SIZE`, 512; at most the queue's).
    pub max_export_batch_size: usize,
}

impl Default for BatchConfig {
    fn default() -> Self {
        BatchConfig {
            max_queue_size: 2048,
            scheduled_delay: Duration::from_millis(5000),
            max_export_batch_size: 512,
        }
    }
}

/// Reads the environment through `var` (the process's, or a test's).
pub struct Env<F>(pub F);

impl<F: Fn(&str) -> Option<String>> Env<F> {
    fn get(&self, name: &str) -> Option<String> {
        (self.0)(name).filter(|v| !v.trim().is_empty())
    }

    /// The signal's variable, else the general one: `OTEL_EXPORTER_OTLP_TRACES_<name>`,
    /// `OTEL_EXPORTER_OTLP_<name>`.
    fn otlp(&self, name: &str) -> Option<(String, String)> {
        [
            format!("OTEL_EXPORTER_OTLP_TRACES_{name}"),
            format!("OTEL_EXPORTER_OTLP_{name}"),
        ]
        .into_iter()
        .find_map(|var| self.get(&var).map(|value| (var, value)))
    }

    /// A whole number of milliseconds in `var`; a malformed one is ignored with a warning.
    fn millis(&self, var: &str, value: &str) -> Option<Duration> {
        match value.trim().parse::<u64>() {
            Ok(ms) => Some(Duration::from_millis(ms)),
            Err(_) => {
                tracing::warn!(
                    variable = var,
                    value,
                    "not a number of milliseconds: ignored"
                );
                None
            }
        }
    }

    fn count(&self, var: &str) -> Option<usize> {
        let value = self.get(var)?;
        match value.trim().parse::<usize>() {
            Ok(n) if n > 0 => Some(n),
            _ => {
                tracing::warn!(variable = var, value, "not a positive count: ignored");
                None
            }
        }
    }

    /// The exporter's settings; `endpoint` (from `--otlp-endpoint`) overrides the environment's.
    pub fn export_config(&self, endpoint: Option<&str>) -> anyhow::Result<ExportConfig> {
        let endpoint = match endpoint.filter(|e| !e.trim().is_empty()) {
            Some(e) => e.trim().to_owned(),
            None => self
                .otlp("ENDPOINT")
                .map_or_else(|| DEFAULT_ENDPOINT.to_owned(), |(_, e)| e.trim().to_owned()),
        };
        let endpoint = self.plain_endpoint(endpoint)?;
        let headers = match self.otlp("HEADERS") {
            Some((var, value)) => headers(&var, &value),
            None => MetadataMap::new(),
        };
        let timeout = self
            .otlp("TIMEOUT")
            .and_then(|(var, value)| self.millis(&var, &value))
            .unwrap_or(Duration::from_secs(10));
        let bsp_timeout = self
            .get("OTEL_BSP_EXPORT_TIMEOUT")
            .and_then(|value| self.millis("OTEL_BSP_EXPORT_TIMEOUT", &value))
            .unwrap_or(Duration::from_secs(30));
        let gzip = match self.otlp("COMPRESSION") {
            Some((_, value)) if value.trim().eq_ignore_ascii_case("gzip") => true,
            Some((_, value)) if value.trim().eq_ignore_ascii_case("none") => false,
            Some((var, value)) => {
                tracing::warn!(variable = %var, value, "unknown compression (gzip, none): none");
                false
            }
            None => false,
        };
        Ok(ExportConfig {
            endpoint,
            headers,
            timeout: timeout.min(bsp_timeout),
            gzip,
            batch: self.batch_config(),
        })
    }

    /// `endpoint` with its scheme: `http://` only (no TLS in this build); one without a scheme
    /// is plain only when `OTEL_EXPORTER_OTLP_{TRACES_,}INSECURE=true` says so, as the
    /// specification reads a schemeless endpoint as TLS otherwise.
    fn plain_endpoint(&self, endpoint: String) -> anyhow::Result<String> {
        if endpoint.starts_with("http://") {
            return Ok(endpoint);
        }
        if endpoint.contains("://") {
            bail!(
                "OTLP endpoint {endpoint:?}: this build exports over plain http:// only (no TLS); \
                 send to a collector on the node or in the cluster network"
            );
        }
        let insecure = self
            .otlp("INSECURE")
            .is_some_and(|(_, v)| v.trim().eq_ignore_ascii_case("true"));
        if !insecure {
            bail!(
                "OTLP endpoint {endpoint:?} has no scheme, which means TLS, and this build has \
                 none: write http://{endpoint} (or set OTEL_EXPORTER_OTLP_INSECURE=true)"
            );
        }
        Ok(format!("http://{endpoint}"))
    }

    /// `OTEL_BSP_*`, with the specification's defaults for what is unset or malformed.
    pub fn batch_config(&self) -> BatchConfig {
        let default = BatchConfig::default();
        let max_queue_size = self
            .count("OTEL_BSP_MAX_QUEUE_SIZE")
            .unwrap_or(default.max_queue_size);
        let scheduled_delay = self
            .get("OTEL_BSP_SCHEDULE_DELAY")
            .and_then(|v| self.millis("OTEL_BSP_SCHEDULE_DELAY", &v))
            .unwrap_or(default.scheduled_delay);
        let max_export_batch_size = self
            .count("OTEL_BSP_MAX_EXPORT_BATCH_SIZE")
            .unwrap_or(default.max_export_batch_size)
            .min(max_queue_size);
        BatchConfig {
            max_queue_size,
            scheduled_delay,
            max_export_batch_size,
        }
    }
}

/// The process's environment.
pub fn process_env() -> Env<impl Fn(&str) -> Option<String>> {
    Env(|name: &str| std::env::var(name).ok())
}

/// `key=value` pairs separated by commas, values percent-decoded (W3C baggage format, as the
/// specification says); a pair that is not a valid gRPC header is left out with a warning.
fn headers(var: &str, value: &str) -> MetadataMap {
    let mut map = MetadataMap::new();
    for pair in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let parsed = pair.split_once('=').and_then(|(k, v)| {
            let key =
                AsciiMetadataKey::from_bytes(k.trim().to_ascii_lowercase().as_bytes()).ok()?;
            let value = AsciiMetadataValue::try_from(percent_decode(v.trim())?).ok()?;
            Some((key, value))
        });
        match parsed {
            Some((key, value)) => {
                map.append(key, value);
            }
            None => {
                let key = pair.split_once('=').map_or(pair, |(k, _)| k);
                tracing::warn!(variable = var, key, "not a valid header: left out");
            }
        }
    }
    map
}

/// `%XX` escapes decoded; `None` for a malformed escape or a result that is not UTF-8.
fn percent_decode(value: &str) -> Option<String> {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// The exporter's settings from the process's environment (see [`Env::export_config`]).
pub fn from_env(endpoint: Option<&str>) -> anyhow::Result<ExportConfig> {
    process_env()
        .export_config(endpoint)
        .context("cannot set up the OTLP trace exporter")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> Env<impl Fn(&str) -> Option<String>> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Env(move |name: &str| vars.get(name).cloned())
    }

    #[test]
    fn the_flag_wins_then_the_signal_s_variable_then_the_general_one() {
        let both = env(&[
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4317"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://all:4317"),
        ]);
        let general = env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://all:4317")]);
        let endpoint = |e: &Env<_>, flag| e.export_config(flag).expect("valid").endpoint;
        assert_eq!(
            endpoint(&both, Some("http://flag:4317")),
            "http://flag:4317"
        );
        assert_eq!(endpoint(&both, None), "http://traces:4317");
        assert_eq!(endpoint(&general, None), "http://all:4317");
        assert_eq!(endpoint(&env(&[]), None), DEFAULT_ENDPOINT);
    }

    #[test]
    fn endpoints_this_build_cannot_reach_are_refused_with_the_reason() {
        let tls = env(&[]).export_config(Some("https://collector:4317"));
        assert!(format!("{:#}", tls.expect_err("no TLS")).contains("plain http://"));
        let schemeless = env(&[]).export_config(Some("collector:4317"));
        assert!(format!("{:#}", schemeless.expect_err("TLS")).contains("http://collector:4317"));
        let insecure = env(&[("OTEL_EXPORTER_OTLP_INSECURE", "true")]);
        assert_eq!(
            insecure
                .export_config(Some("collector:4317"))
                .expect("plain")
                .endpoint,
            "http://collector:4317"
        );
    }

    #[test]
    fn headers_timeouts_and_compression_are_read_as_the_specification_says() {
        let e = env(&[
            ("OTEL_EXPORTER_OTLP_HEADERS", "ignored=1"),
            (
                "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
                "Authorization=Basic%20dXNlcg==, x-tenant = node-1 ,broken,bad key=1",
            ),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "2500"),
            ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "GZIP"),
        ]);
        let config = e.export_config(None).expect("valid");
        assert_eq!(
            config.headers.get("authorization").map(|v| v.to_str().ok()),
            Some(Some("Basic dXNlcg=="))
        );
        assert_eq!(
            config.headers.get("x-tenant").map(|v| v.to_str().ok()),
            Some(Some("node-1"))
        );
        assert_eq!(config.headers.len(), 2, "{:?}", config.headers);
        assert_eq!(config.timeout, Duration::from_millis(2500));
        assert!(config.gzip);

        let capped = env(&[
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "60000"),
            ("OTEL_BSP_EXPORT_TIMEOUT", "1000"),
            ("OTEL_EXPORTER_OTLP_COMPRESSION", "zstd"),
        ]);
        let config = capped.export_config(None).expect("valid");
        assert_eq!(config.timeout, Duration::from_secs(1));
        assert!(!config.gzip, "unknown compression: none");
        let config = env(&[("OTEL_EXPORTER_OTLP_TIMEOUT", "soon")])
            .export_config(None)
            .expect("valid");
        assert_eq!(
            config.timeout,
            Duration::from_secs(10),
            "malformed: default"
        );
    }

    #[test]
    fn batching_has_the_specification_s_defaults_and_a_batch_fits_the_queue() {
        assert_eq!(env(&[]).batch_config(), BatchConfig::default());
        let e = env(&[
            ("OTEL_BSP_MAX_QUEUE_SIZE", "100"),
            ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "512"),
            ("OTEL_BSP_SCHEDULE_DELAY", "250"),
        ]);
        assert_eq!(
            e.batch_config(),
            BatchConfig {
                max_queue_size: 100,
                scheduled_delay: Duration::from_millis(250),
                max_export_batch_size: 100,
            }
        );
        let malformed = env(&[
            ("OTEL_BSP_MAX_QUEUE_SIZE", "0"),
            ("OTEL_BSP_SCHEDULE_DELAY", "x"),
        ]);
        assert_eq!(malformed.batch_config(), BatchConfig::default());
    }

    #[test]
    fn percent_escapes_are_decoded_and_malformed_ones_refused() {
        assert_eq!(percent_decode("a%20b%2Cc").as_deref(), Some("a b,c"));
        assert_eq!(percent_decode("plain").as_deref(), Some("plain"));
        assert_eq!(percent_decode("bad%2"), None);
        assert_eq!(percent_decode("bad%zz"), None);
        assert_eq!(percent_decode("%ff"), None, "not UTF-8");
    }
}
