//! The agent's HTTP side as a scraper sees it: the address it bound (as status says) and plain
//! HTTP/1.0 GETs on loopback.

use crate::AgentProcess;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// The address the agent serves metrics on (started with `--metrics-addr 127.0.0.1:0`: status
/// names the port it bound).
pub async fn metrics_addr(agent: &AgentProcess) -> SocketAddr {
    let status = agent.status();
    status["metrics_address"]
        .as_str()
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| agent.fail(&format!("no metrics address in status: {status}")))
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
