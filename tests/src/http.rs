//! The agent's HTTP side as a scraper sees it: the address it bound (from its log) and plain
//! HTTP/1.0 GETs on loopback.

use crate::{AgentProcess, EVENT_TIMEOUT};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// The agent's log line that names the bound metrics address.
pub const SERVING: &str = "serving /metrics, /healthz and /readyz";

/// The address the agent serves metrics on (started with `--metrics-addr 127.0.0.1:0`).
pub async fn metrics_addr(agent: &AgentProcess) -> SocketAddr {
    let line = agent
        .wait_for_log("the metrics server", EVENT_TIMEOUT, |l| {
            l.message() == SERVING
        })
        .await;
    line.field("addr")
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| agent.fail(&format!("no address in {line}")))
}

/// A plain HTTP/1.0 GET on loopback: status code and body.
pub fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    try_http_get(addr, path).unwrap_or_else(|e| panic!("GET {addr}{path}: {e}"))
}

/// [`http_get`], for a probe that may find nothing listening yet.
pub fn try_http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}
