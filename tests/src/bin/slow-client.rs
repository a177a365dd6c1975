//! A hostile client for the agent's own servers: opens many connections (TCP or Unix), sends each
//! the same few bytes (a partial HTTP request, an HTTP/2 preface, or nothing), and holds them
//! open until its stdin closes or it is killed. Run it as another user to play an unprivileged
//! process on the node.
//!
//! Prints one JSON line once every connection was tried:
//! `{"event":"connected","connected":N,"failed":M}`.

use clap::Parser;
use std::io::{Read, Write};
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(name = "slow-client", about = "Holds many slow connections open")]
struct Args {
    /// `host:port` to connect to over TCP.
    #[arg(long, conflicts_with = "unix")]
    tcp: Option<std::net::SocketAddr>,
    /// A Unix socket path to connect to.
    #[arg(long)]
    unix: Option<std::path::PathBuf>,
    /// Connections to open.
    #[arg(long, default_value_t = 1)]
    connections: usize,
    /// Bytes to send on each (Rust escapes such as `\r\n` are understood).
    #[arg(long, default_value = "")]
    send: String,
}

/// `\r`, `\n` and `\t` escapes in a command-line argument.
fn unescape(text: &str) -> Vec<u8> {
    text.replace("\\r", "\r")
        .replace("\\n", "\n")
        .replace("\\t", "\t")
        .into_bytes()
}

enum Stream {
    Tcp(std::net::TcpStream),
    Unix(std::os::unix::net::UnixStream),
}

/// One connection, sent `payload`.
fn connect(args: &Args, payload: &[u8]) -> std::io::Result<Stream> {
    let mut stream = match (&args.tcp, &args.unix) {
        (Some(addr), _) => std::net::TcpStream::connect_timeout(addr, Duration::from_millis(250))
            .map(Stream::Tcp)?,
        (None, Some(path)) => std::os::unix::net::UnixStream::connect(path).map(Stream::Unix)?,
        (None, None) => return Err(std::io::Error::other("--tcp or --unix is required")),
    };
    if !payload.is_empty() {
        let _ = match &mut stream {
            Stream::Tcp(s) => s.write_all(payload),
            Stream::Unix(s) => s.write_all(payload),
        };
    }
    Ok(stream)
}

fn main() {
    let args = Args::parse();
    let payload = unescape(&args.send);
    // Connect from 50 threads: a connection the server's queue cannot take times out (250 ms),
    // and one after the other those would take minutes.
    let threads = 50.min(args.connections.max(1));
    let per_thread = args.connections.div_ceil(threads);
    let results: Vec<(Vec<Stream>, usize)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let (args, payload) = (&args, &payload);
                scope.spawn(move || {
                    let count = per_thread.min(args.connections.saturating_sub(t * per_thread));
                    let mut held = Vec::with_capacity(count);
                    let mut failed = 0usize;
                    for _ in 0..count {
                        match connect(args, payload) {
                            Ok(stream) => held.push(stream),
                            Err(_) => failed += 1,
                        }
                    }
                    (held, failed)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().unwrap_or_default())
            .collect()
    });
    let failed: usize = results.iter().map(|(_, f)| f).sum();
    let held: Vec<Stream> = results.into_iter().flat_map(|(h, _)| h).collect();
    println!(
        "{}",
        serde_json::json!({"event": "connected", "connected": held.len(), "failed": failed})
    );
    let _ = std::io::stdout().flush();
    // Hold everything until stdin closes.
    let mut sink = [0u8; 64];
    while matches!(std::io::stdin().read(&mut sink), Ok(n) if n > 0) {}
    drop(held);
}
