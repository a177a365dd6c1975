//! The metrics and health server: the one TCP listener of the agent, on loopback by default.
//!
//! ```text
//! Prometheus ──GET /metrics──> metrics::render(registry)   (recorded metrics + state read now;
//!                              OpenMetrics with exemplars if asked for, else Prometheus text;
//!                              concurrent scrapes share one rendering, made off the runtime)
//! kubelet/systemd probes ──GET /healthz──> 200 while the process serves
//!                        ──GET /readyz───> 200 once the event source is attached and the first
//!                                          full scan is done, while a directory is watched;
//!                                          503 before, while nothing is watched, while the
//!                                          state file cannot be written, and while shutting down
//! ```
//!
//! Nothing here touches the data flow except reading state under its short locks.
//!
//! The port may be reachable by unprivileged processes, so every connection is bounded
//! ([`crate::serving::METRICS`]): at most 32 open (the rest wait in the kernel's queue), request
//! headers within [`HEADER_READ_TIMEOUT`] (and an idle keep-alive connection closed after it), 10 s
//! without progress closes a connection, and the server's stop ends every connection at once.

use super::metrics;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::registry::Registry;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tower::Service as _;

/// Time for a client to send a request's headers, counted from when the connection is ready for
/// a request (so also the longest an idle keep-alive connection stays open). A scraper sends its
/// headers in one packet.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// The default `--metrics-addr`: loopback (metrics name every plugin socket, so they are not for
/// the network unless the operator says so), port 9464 (the Prometheus exporter port the
/// OpenTelemetry convention uses, free of kubelet's 10248/10250/10255).
pub const DEFAULT_ADDR: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9464));

struct Served {
    registry: Arc<Registry>,
    /// Per format (Prometheus text, OpenMetrics): the renderings begun, and the last one.
    renderings: [Renderings; 2],
    /// `plugin_agent_metrics_renders_total`.
    renders: prometheus_client::metrics::counter::Counter,
    ready: watch::Receiver<bool>,
    watcher: Arc<super::WatcherStats>,
    stopping: CancellationToken,
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `listener` until `cancel` fires.
/// - `registry`: what `/metrics` renders (see [`metrics::Metrics::registry`]), and the counter
///   of its renderings in it ([`metrics::Metrics::renders`]);
/// - `ready`: becomes true after the first full scan (the source was attached before it);
/// - `watcher`: `/readyz` fails while no directory is watched, and says why;
/// - `cancel`: the agent is stopping: the server stops and every open connection ends.
pub async fn serve(
    listener: tokio::net::TcpListener,
    (registry, renders): (Registry, prometheus_client::metrics::counter::Counter),
    ready: watch::Receiver<bool>,
    watcher: Arc<super::WatcherStats>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let served = Arc::new(Served {
        registry: Arc::new(registry),
        renderings: Default::default(),
        renders,
        ready,
        watcher,
        stopping: cancel.clone(),
    });
    let app = Router::new()
        .route("/metrics", get(metrics_page))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(served);
    let gate = crate::serving::Gate::new("metrics", crate::serving::METRICS, cancel.clone());
    let connections = tokio_util::task::TaskTracker::new();
    while let Some(stream) = gate
        // Scrapers share the node's loopback address: peers are not told apart.
        .admit(|| async { listener.accept().await.map(|(s, _)| s) }, |_| 0)
        .await
    {
        let app = app.clone();
        let service = hyper::service::service_fn(move |request| app.clone().call(request));
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(HEADER_READ_TIMEOUT)
            .max_buf_size(64 * 1024)
            .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
        connections.spawn(async move {
            // Errors are the client's (timeouts, resets, garbage): nothing to act on.
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "metrics connection ended");
            }
        });
    }
    // The stop token has ended every connection's I/O: they finish at once.
    connections.close();
    connections.wait().await;
    Ok(())
}

/// `/metrics`: OpenMetrics with exemplars when the scraper asks for it, else the Prometheus
/// text format (see [`super::exposition`]).
async fn metrics_page(
    State(served): State<Arc<Served>>,
    headers: axum::http::HeaderMap,
) -> impl IntoResponse {
    let accept = headers
        .get(header::ACCEPT)
        .and_then(|value| value.to_str().ok());
    let openmetrics = super::exposition::wants_openmetrics(accept);
    let content_type = if openmetrics {
        metrics::CONTENT_TYPE
    } else {
        metrics::PROMETHEUS_CONTENT_TYPE
    };
    match served.renderings[usize::from(openmetrics)]
        .fresh(&served, openmetrics)
        .await
    {
        Some(bytes) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, content_type)],
            bytes,
        ),
        None => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            bytes::Bytes::from_static(b"cannot encode metrics\n"),
        ),
    }
}

/// Scrapes share renderings: with 10,000 plugins one is 2.4 MB and tens of milliseconds of
/// CPU, and each scrape rendered its own on the runtime's workers, so 32 clients scraping in a
/// loop kept registrations waiting for seconds and 32 that never read held 32 copies (150 MiB).
/// A scrape now takes the first rendering begun after it arrived: one in progress when it came
/// is not fresh enough (`list` and `/metrics` read one after the other must agree), but every
/// scrape that arrives while one renders waits for the next, and all of them share it, as bytes
/// every response points at. One rendering at a time, on a blocking thread.
#[derive(Default)]
struct Renderings {
    /// Renderings begun (written under `last`'s lock).
    begun: std::sync::atomic::AtomicU64,
    /// The last rendering and its number among those begun.
    last: tokio::sync::Mutex<Option<(u64, bytes::Bytes)>>,
}

impl Renderings {
    /// A rendering begun after this call, shared with every caller that waited for the same.
    async fn fresh(&self, served: &Served, openmetrics: bool) -> Option<bytes::Bytes> {
        let arrived = self.begun.load(Ordering::Acquire);
        let mut last = self.last.lock().await;
        if let Some((number, bytes)) = &*last
            && *number >= arrived
        {
            return Some(bytes.clone());
        }
        let number = self.begun.fetch_add(1, Ordering::AcqRel);
        let registry = served.registry.clone();
        let rendered = tokio::task::spawn_blocking(move || {
            if openmetrics {
                metrics::render(&registry)
            } else {
                metrics::render_prometheus(&registry)
            }
        })
        .await;
        served.renders.inc();
        let bytes = bytes::Bytes::from(rendered.ok()?.ok()?);
        *last = Some((number, bytes.clone()));
        Some(bytes)
    }
}

async fn readyz(State(served): State<Arc<Served>>) -> (StatusCode, &'static str) {
    if served.stopping.is_cancelled() {
        (StatusCode::SERVICE_UNAVAILABLE, "shutting down\n")
    } else if !*served.ready.borrow() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "first scan of the plugin directory not done\n",
        )
    } else if served.watcher.health.get().root.is_some()
        || served.watcher.watched_dirs.load(Ordering::Relaxed) == 0
    {
        // Nothing watched is nothing discovered: the agent is not doing its job.
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "the plugin directory is not watched (see plugin-agent status)\n",
        )
    } else if !served.watcher.health.get().conditions.is_empty() {
        // Plugins are discovered but something they need is broken (their registrations cannot
        // be recorded): as much the operator's to see as a directory not watched.
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "the agent cannot do part of its job (see plugin-agent status)\n",
        )
    } else {
        (StatusCode::OK, "ok\n")
    }
}
