//! The metrics and health server: the one TCP listener of the agent, on loopback by default.
//!
//! ```text
//! Prometheus ──GET /metrics──> metrics::render(registry)   (recorded metrics + state read now)
//! kubelet/systemd probes ──GET /healthz──> 200 while the process serves
//!                        ──GET /readyz───> 200 once the event source is attached and the first
//!                                          full scan is done; 503 before, and while shutting down
//! ```
//!
//! Nothing here touches the data flow except reading state under its short locks.

use super::metrics;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::registry::Registry;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// The default `--metrics-addr`: loopback (metrics name every plugin socket, so they are not for
/// the network unless the operator says so), port 9464 (the Prometheus exporter port the
/// OpenTelemetry convention uses, free of kubelet's 10248/10250/10255).
pub const DEFAULT_ADDR: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9464));

struct Served {
    registry: Registry,
    ready: watch::Receiver<bool>,
    stopping: CancellationToken,
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `listener` until `cancel` fires.
/// - `registry`: what `/metrics` renders (see [`metrics::Metrics::registry`]);
/// - `ready`: becomes true after the first full scan (the source was attached before it);
/// - `cancel`: the agent is stopping: `/readyz` turns 503 and the server stops.
pub async fn serve(
    listener: tokio::net::TcpListener,
    registry: Registry,
    ready: watch::Receiver<bool>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let served = Arc::new(Served {
        registry,
        ready,
        stopping: cancel.clone(),
    });
    let app = Router::new()
        .route("/metrics", get(metrics_page))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(served);
    axum::serve(listener, app)
        .with_graceful_shutdown(cancel.cancelled_owned())
        .await?;
    Ok(())
}

async fn metrics_page(State(served): State<Arc<Served>>) -> impl IntoResponse {
    match metrics::render(&served.registry) {
        Ok(text) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, metrics::CONTENT_TYPE)],
            text,
        ),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            "cannot encode metrics\n".to_string(),
        ),
    }
}

async fn readyz(State(served): State<Arc<Served>>) -> (StatusCode, &'static str) {
    if served.stopping.is_cancelled() {
        (StatusCode::SERVICE_UNAVAILABLE, "shutting down\n")
    } else if *served.ready.borrow() {
        (StatusCode::OK, "ok\n")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "first scan of the plugin directory not done\n",
        )
    }
}
