//! Unary gRPC calls over one HTTP/2 connection driven by the calling task: the smallest client
//! that speaks kubelet's `pluginregistration` wire protocol.
//!
//! A registration makes two calls (`GetInfo`, `NotifyRegistrationStatus`) on a connection used
//! once and closed. A tonic `Channel` is built for long-lived connections: a buffer worker task,
//! reconnect machinery, and hyper's connection and per-request tasks, all spawned and torn down
//! again per plugin. Here the `h2` connection is polled by the task that makes the call, so a
//! registration spawns nothing and its connection goes away with it.
//!
//! The wire format is gRPC's: `POST /package.Service/Method` with `content-type:
//! application/grpc`, `te: trailers` and `grpc-timeout`, one length-prefixed message each way,
//! the outcome in the `grpc-status` / `grpc-message` trailers (or headers, for a trailers-only
//! answer). Compression is neither offered nor accepted.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use h2::client::{Connection, SendRequest};
use http::{HeaderMap, Request};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};

/// Why a call failed. `Status` is a gRPC status the plugin answered; the others are transport.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The plugin answered with a non-OK gRPC status.
    #[error("{}", status_text(*.code, .message))]
    Status { code: tonic::Code, message: String },
    /// HTTP/2 failed (connection closed, reset, protocol error...).
    #[error("transport: {0}")]
    Transport(String),
    /// The answer is not a gRPC answer to this call.
    #[error("{0}")]
    Protocol(String),
}

fn status_text(code: tonic::Code, message: &str) -> String {
    if message.is_empty() {
        format!("{code:?}")
    } else {
        format!("{code:?}: {message}")
    }
}

impl From<h2::Error> for CallError {
    fn from(e: h2::Error) -> Self {
        CallError::Transport(e.to_string())
    }
}

/// One HTTP/2 client connection: the handle that opens streams, and the connection itself, which
/// is polled only while a call runs (nothing else happens on a registration connection).
pub struct UnaryClient<T> {
    send: SendRequest<Bytes>,
    /// `None` once the connection has ended.
    connection: Option<Connection<T, Bytes>>,
    /// The largest message accepted in an answer.
    max_message: usize,
}

impl<T: AsyncRead + AsyncWrite + Unpin> UnaryClient<T> {
    /// Starts HTTP/2 on `io` (sends the client preface and SETTINGS; does not wait for the
    /// server's, so a request can wait in the socket for a server that is not serving yet).
    pub async fn handshake(io: T, max_message: usize) -> Result<Self, CallError> {
        let (send, connection) = h2::client::Builder::new()
            // Answers larger than this are refused anyway; the window bounds what is buffered.
            .initial_window_size(window_for(max_message))
            .max_header_list_size(16 * 1024)
            .handshake(io)
            .await?;
        Ok(UnaryClient {
            send,
            connection: Some(connection),
            max_message,
        })
    }

    /// Calls `path` (`/package.Service/Method`) with `request`, waiting at most `timeout` (also
    /// sent as `grpc-timeout`, as gRPC clients do).
    pub async fn call<Q: prost::Message, A: prost::Message + Default>(
        &mut self,
        path: &'static str,
        request: &Q,
        timeout: Duration,
    ) -> Result<A, CallError> {
        let max_message = self.max_message;
        let send = self.send.clone();
        let call = async move {
            let answer = exchange(send, path, frame(request), timeout, max_message).await?;
            A::decode(answer)
                .map_err(|e| CallError::Protocol(format!("cannot decode the answer: {e}")))
        };
        let mut call = std::pin::pin!(call);
        let Some(connection) = self.connection.as_mut() else {
            return call.await;
        };
        let ended = tokio::select! {
            biased;
            answer = &mut call => return answer,
            ended = connection => ended,
        };
        // The connection ended (the peer closed it, or broke the protocol): the call finishes
        // with what arrived, or fails; the connection's own error says more than the stream's.
        self.connection = None;
        match (call.await, ended) {
            (Err(CallError::Transport(_)), Err(e)) => Err(e.into()),
            (answer, _) => answer,
        }
    }
}

/// A stream window that holds the largest accepted message with its 5-byte prefix.
fn window_for(max_message: usize) -> u32 {
    u32::try_from(max_message + 5)
        .unwrap_or(u32::MAX)
        .max(65_535)
}

/// One gRPC message: compressed flag (0), big-endian length, the encoded message.
fn frame<Q: prost::Message>(request: &Q) -> Bytes {
    let len = request.encoded_len();
    let mut buf = BytesMut::with_capacity(5 + len);
    buf.put_u8(0);
    // Requests are the agent's own few-byte messages.
    buf.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
    // Encoding into a buffer with enough capacity cannot fail.
    let _ = request.encode(&mut buf);
    buf.freeze()
}

/// Sends one request and returns the answer's message bytes (prefix stripped) if the call
/// succeeded.
async fn exchange(
    mut send: SendRequest<Bytes>,
    path: &'static str,
    body: Bytes,
    timeout: Duration,
    max_message: usize,
) -> Result<Bytes, CallError> {
    let request = Request::post(format!("http://plugin.invalid{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("grpc-timeout", grpc_timeout(timeout))
        .header(
            "user-agent",
            concat!("plugin-agent/", env!("CARGO_PKG_VERSION")),
        )
        .body(())
        .map_err(|e| CallError::Protocol(format!("building the request: {e}")))?;
    send = send.ready().await?;
    let (response, mut stream) = send.send_request(request, false)?;
    stream.send_data(body, true)?;
    let response = response.await?;
    let (head, mut body) = response.into_parts();
    if head.status != http::StatusCode::OK {
        return Err(CallError::Protocol(format!(
            "HTTP status {} instead of a gRPC answer",
            head.status
        )));
    }
    // A trailers-only answer: the status is in the headers and there is no message.
    if let Some(status) = grpc_status(&head.headers) {
        return Err(status.err().unwrap_or_else(|| {
            CallError::Protocol("the answer has no message (trailers-only OK)".into())
        }));
    }
    let mut received = BytesMut::new();
    while let Some(data) = body.data().await {
        let data = data?;
        let _ = body.flow_control().release_capacity(data.len());
        if received.len() + data.len() > max_message + 5 {
            return Err(CallError::Protocol(format!(
                "message length too large: the answer exceeds {max_message} bytes"
            )));
        }
        received.extend_from_slice(&data);
    }
    let trailers = body.trailers().await?.unwrap_or_default();
    match grpc_status(&trailers) {
        Some(Ok(())) => {}
        Some(Err(status)) => return Err(status),
        None => {
            return Err(CallError::Protocol(
                "the answer ended without a grpc-status".into(),
            ));
        }
    }
    unframe(received.freeze(), max_message)
}

/// The single message of an answer.
fn unframe(mut data: Bytes, max_message: usize) -> Result<Bytes, CallError> {
    if data.len() < 5 {
        return Err(CallError::Protocol(format!(
            "the answer has {} bytes, not a gRPC message",
            data.len()
        )));
    }
    let compressed = data.get_u8();
    let len = data.get_u32() as usize;
    if compressed != 0 {
        return Err(CallError::Protocol(
            "the answer is compressed, which was not offered".into(),
        ));
    }
    if len > max_message {
        return Err(CallError::Protocol(format!(
            "message length too large: the answer exceeds {max_message} bytes"
        )));
    }
    if data.len() != len {
        return Err(CallError::Protocol(format!(
            "the answer's message is {} bytes, its prefix says {len}",
            data.len()
        )));
    }
    Ok(data)
}

/// `grpc-status` (and `grpc-message`) from headers or trailers: `None` when absent.
fn grpc_status(headers: &HeaderMap) -> Option<Result<(), CallError>> {
    let code = headers.get("grpc-status")?;
    let code = std::str::from_utf8(code.as_bytes())
        .ok()
        .and_then(|c| c.trim().parse::<i32>().ok())
        .map_or(tonic::Code::Unknown, tonic::Code::from_i32);
    if code == tonic::Code::Ok {
        return Some(Ok(()));
    }
    let message = headers
        .get("grpc-message")
        .map(|m| percent_decode(m.as_bytes()))
        .unwrap_or_default();
    Some(Err(CallError::Status { code, message }))
}

/// gRPC's percent-encoding of `grpc-message` (invalid escapes are kept as they are).
fn percent_decode(raw: &[u8]) -> String {
    let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        if raw[i] == b'%'
            && i + 2 < raw.len()
            && let (Some(hi), Some(lo)) = (hex(raw[i + 1]), hex(raw[i + 2]))
        {
            out.push(hi << 4 | lo);
            i += 3;
        } else {
            out.push(raw[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `grpc-timeout`: at most 8 digits, in the finest unit that fits.
fn grpc_timeout(timeout: Duration) -> String {
    const MAX: u128 = 99_999_999;
    let units: [(u128, char); 4] = [
        (timeout.as_micros(), 'u'),
        (timeout.as_millis(), 'm'),
        (u128::from(timeout.as_secs()), 'S'),
        (u128::from(timeout.as_secs() / 60), 'M'),
    ];
    units.iter().find(|(value, _)| *value <= MAX).map_or_else(
        || format!("{MAX}H"),
        |(value, unit)| format!("{value}{unit}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_uses_the_finest_unit_with_at_most_8_digits() {
        assert_eq!(grpc_timeout(Duration::from_secs(1)), "1000000u");
        assert_eq!(grpc_timeout(Duration::from_secs(5)), "5000000u");
        assert_eq!(grpc_timeout(Duration::from_secs(1000)), "1000000m");
    }

    #[test]
    fn status_messages_are_percent_decoded() {
        assert_eq!(percent_decode(b"bad%20plugin%3A%20no"), "bad plugin: no");
        assert_eq!(percent_decode(b"50%"), "50%");
        assert_eq!(percent_decode(b"%zz"), "%zz");
        let mut headers = HeaderMap::new();
        headers.insert("grpc-status", "12".parse().expect("header"));
        headers.insert("grpc-message", "not%20here".parse().expect("header"));
        let status = grpc_status(&headers)
            .expect("a status")
            .expect_err("not OK");
        assert_eq!(status.to_string(), "Unimplemented: not here");
    }

    #[test]
    fn answers_are_unframed_or_refused() {
        let ok = Bytes::from_static(&[0, 0, 0, 0, 2, 8, 1]);
        assert_eq!(
            unframe(ok, 64).expect("framed"),
            Bytes::from_static(&[8, 1])
        );
        let compressed = Bytes::from_static(&[1, 0, 0, 0, 1, 8]);
        assert!(unframe(compressed, 64).is_err());
        let too_big = Bytes::from_static(&[0, 0, 1, 0, 0]);
        assert!(unframe(too_big, 64).is_err());
        let short = Bytes::from_static(&[0, 0, 0, 0, 3, 8]);
        assert!(unframe(short, 64).is_err());
    }
}
