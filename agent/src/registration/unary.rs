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
//!
//! # Why not tonic's generated client
//!
//! The project uses well-kept crates for solved problems, so the alternative was built and
//! measured: tonic's generated `RegistrationClient` over a bare hyper HTTP/2 client connection
//! (`hyper::client::conn::http2` on the connected socket; no `Channel`, tower buffer or
//! reconnect; hyper's dispatcher polled by the registering task; commit "Registration over
//! tonic's generated client on a hyper HTTP/2 connection", reverted). In a burst of 10,000
//! registrations (fanotify, plugin directory on tmpfs, release builds, runs alternated in one
//! session) it cost 2.17 / 2.38 / 2.58 s of agent CPU against 1.20 / 1.49 / 1.49 s here: +71 %,
//! over the 20 % the project accepts for a crate over hand-written code. hyper still spawns a
//! task for the HTTP/2 connection and one per request, and tonic's codec, body and status
//! machinery run for two few-byte messages. What is written here is kept small instead and
//! tested against a real tonic server (`against_tonic` below): trailers-only errors, a status
//! with a percent-encoded message, an oversize answer, a connection closed mid-call.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use h2::client::{Connection, SendRequest};
use http::header::{CONTENT_TYPE, HeaderName, HeaderValue, TE, USER_AGENT};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderMap, Method, Request, Uri};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};

/// The request's authority: a registration socket has no host name, and gRPC servers ignore it.
const AUTHORITY: Authority = Authority::from_static("plugin.invalid");
const APPLICATION_GRPC: HeaderValue = HeaderValue::from_static("application/grpc");
const TRAILERS: HeaderValue = HeaderValue::from_static("trailers");
const AGENT: HeaderValue =
    HeaderValue::from_static(concat!("plugin-agent/", env!("CARGO_PKG_VERSION")));
const GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");
const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");

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
    /// `None` once the connection has ended. Boxed: h2's connection state is kilobytes, and a
    /// client lives in the futures of operations that mostly wait.
    connection: Option<Box<Connection<T, Bytes>>>,
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
            connection: Some(Box::new(connection)),
            max_message,
        })
    }

    /// Calls `path` (`/package.Service/Method`) with `request`, waiting at most `timeout` (also
    /// sent as `grpc-timeout`, as gRPC clients do).
    pub async fn call<Q: prost::Message, A: prost::Message + Default>(
        &mut self,
        path: PathAndQuery,
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
    path: PathAndQuery,
    body: Bytes,
    timeout: Duration,
    max_message: usize,
) -> Result<Bytes, CallError> {
    let request = request_head(path, timeout)?;
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

/// The head of a call to `path`: `POST http://plugin.invalid/<path>` with gRPC's headers, in
/// this order. Built from constants: a call formats, parses and copies nothing but its timeout.
fn request_head(path: PathAndQuery, timeout: Duration) -> Result<Request<()>, CallError> {
    let mut uri = http::uri::Parts::default();
    uri.scheme = Some(Scheme::HTTP);
    uri.authority = Some(AUTHORITY);
    uri.path_and_query = Some(path);
    let uri = Uri::from_parts(uri)
        .map_err(|e| CallError::Protocol(format!("building the request: {e}")))?;
    let mut headers = HeaderMap::with_capacity(4);
    headers.insert(CONTENT_TYPE, APPLICATION_GRPC);
    headers.insert(TE, TRAILERS);
    headers.insert(GRPC_TIMEOUT, grpc_timeout(timeout)?);
    headers.insert(USER_AGENT, AGENT);
    let mut request = Request::new(());
    *request.method_mut() = Method::POST;
    *request.uri_mut() = uri;
    *request.headers_mut() = headers;
    Ok(request)
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
    let code = headers.get(GRPC_STATUS)?;
    let code = std::str::from_utf8(code.as_bytes())
        .ok()
        .and_then(|c| c.trim().parse::<i32>().ok())
        .map_or(tonic::Code::Unknown, tonic::Code::from_i32);
    if code == tonic::Code::Ok {
        return Some(Ok(()));
    }
    let message = headers
        .get(GRPC_MESSAGE)
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

/// `grpc-timeout`: at most 8 digits, in the finest unit that fits (written out by hand: the
/// formatting machinery cost more than the rest of the request head).
fn grpc_timeout(timeout: Duration) -> Result<HeaderValue, CallError> {
    const MAX: u128 = 99_999_999;
    let units: [(u128, u8); 4] = [
        (timeout.as_micros(), b'u'),
        (timeout.as_millis(), b'm'),
        (u128::from(timeout.as_secs()), b'S'),
        (u128::from(timeout.as_secs() / 60), b'M'),
    ];
    let (mut value, unit) = units
        .into_iter()
        .find(|(value, _)| *value <= MAX)
        .unwrap_or((MAX, b'H'));
    // Eight digits and the unit, filled from the end.
    let mut text = [0u8; 9];
    let mut start = text.len() - 1;
    text[start] = unit;
    loop {
        start -= 1;
        text[start] = b'0' + (value % 10) as u8;
        value /= 10;
        if value == 0 {
            break;
        }
    }
    HeaderValue::from_maybe_shared(Bytes::copy_from_slice(&text[start..]))
        .map_err(|e| CallError::Protocol(format!("grpc-timeout of {timeout:?}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_uses_the_finest_unit_with_at_most_8_digits() {
        let timeout = |d| grpc_timeout(d).expect("a header value");
        assert_eq!(timeout(Duration::from_secs(1)), "1000000u");
        assert_eq!(timeout(Duration::from_secs(5)), "5000000u");
        assert_eq!(timeout(Duration::from_secs(1000)), "1000000m");
        assert_eq!(timeout(Duration::ZERO), "0u");
        assert_eq!(timeout(Duration::from_micros(99_999_999)), "99999999u");
        assert_eq!(timeout(Duration::from_secs(6_000_000_000)), "99999999H");
    }

    /// The head every call sends: gRPC's method, path and headers, in this order.
    #[test]
    fn a_request_head_is_a_grpc_post_with_its_timeout() {
        let path = PathAndQuery::from_static("/pluginregistration.Registration/GetInfo");
        let head = request_head(path, Duration::from_secs(1)).expect("a head");
        assert_eq!(head.method(), Method::POST);
        assert_eq!(
            head.uri().to_string(),
            "http://plugin.invalid/pluginregistration.Registration/GetInfo"
        );
        let headers: Vec<_> = head
            .headers()
            .iter()
            .map(|(name, value)| (name.as_str(), value.to_str().expect("ASCII")))
            .collect();
        assert_eq!(
            headers,
            [
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                ("grpc-timeout", "1000000u"),
                (
                    "user-agent",
                    concat!("plugin-agent/", env!("CARGO_PKG_VERSION"))
                ),
            ]
        );
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

/// The client against a real tonic server (the tests' plugins are tonic servers; most plugins in
/// the field are grpc-go): error answers, oversize answers and a connection closed mid-call. The
/// server is the tests' one fake plugin (`plugin_agent_tests::fake_plugin`).
#[cfg(test)]
mod against_tonic {
    use super::*;
    use plugin_agent_proto::pluginregistration::{
        InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
    };
    use plugin_agent_tests::fake_plugin::{FakePlugin, Faults, Heard};
    use std::sync::{Arc, Mutex};
    use tokio::net::{UnixListener, UnixStream};

    const GET_INFO: PathAndQuery =
        PathAndQuery::from_static("/pluginregistration.Registration/GetInfo");
    const NOTIFY: PathAndQuery =
        PathAndQuery::from_static("/pluginregistration.Registration/NotifyRegistrationStatus");
    const MAX: usize = 64 * 1024;
    const TIMEOUT: Duration = Duration::from_secs(5);

    /// What the plugin answers to `GetInfo`.
    enum Answer {
        Info(PluginInfo),
        Status(tonic::Code, &'static str),
        /// Shut the connection down (both ways) and never answer.
        CloseConnection,
    }

    /// Serves `answer` on a fresh socket and returns a client connected to it.
    async fn plugin(answer: Answer) -> (tempfile::TempDir, UnaryClient<UnixStream>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("plugin.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        // A duplicate of the accepted connection's socket, to close it when GetInfo arrives.
        let connection: Arc<Mutex<Option<std::os::unix::net::UnixStream>>> = Arc::default();
        let fake = match answer {
            Answer::Info(info) => FakePlugin::new(info),
            Answer::Status(code, message) => {
                FakePlugin::new(info("csi.example.com")).get_info(Faults::status(code, message))
            }
            Answer::CloseConnection => {
                let connection = connection.clone();
                FakePlugin::new(info("csi.example.com"))
                    .get_info(Faults::hang())
                    .on_call(move |heard| {
                        if let (Heard::GetInfo { .. }, Some(socket)) =
                            (heard, connection.lock().expect("lock").take())
                        {
                            socket.shutdown(std::net::Shutdown::Both).expect("shutdown");
                        }
                    })
            }
        };
        let service = fake.into_service().max_encoding_message_size(4 << 20);
        let incoming = futures::stream::unfold(listener, move |listener| {
            let connection = connection.clone();
            async move {
                let accepted = listener.accept().await.and_then(|(stream, _)| {
                    let stream = stream.into_std()?;
                    *connection.lock().expect("lock") = Some(stream.try_clone()?);
                    UnixStream::from_std(stream)
                });
                Some((accepted, listener))
            }
        });
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(incoming),
        );
        let stream = UnixStream::connect(&path).await.expect("connect");
        let client = UnaryClient::handshake(stream, MAX)
            .await
            .expect("handshake");
        (dir, client)
    }

    async fn get_info(client: &mut UnaryClient<UnixStream>) -> Result<PluginInfo, CallError> {
        tokio::time::timeout(
            TIMEOUT,
            client.call::<_, PluginInfo>(GET_INFO, &InfoRequest {}, TIMEOUT),
        )
        .await
        .expect("the call ends")
    }

    fn info(name: &str) -> PluginInfo {
        PluginInfo {
            r#type: "CSIPlugin".into(),
            name: name.into(),
            endpoint: "/csi.sock".into(),
            supported_versions: vec!["1.0.0".into()],
        }
    }

    #[tokio::test]
    async fn answers_and_notifies_on_one_connection() {
        let (_dir, mut client) = plugin(Answer::Info(info("csi.example.com"))).await;
        let answer = get_info(&mut client).await.expect("answered");
        assert_eq!(answer, info("csi.example.com"));
        let status = RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        };
        client
            .call::<_, RegistrationStatusResponse>(NOTIFY, &status, TIMEOUT)
            .await
            .expect("notified");
    }

    #[tokio::test]
    async fn reads_a_trailers_only_error_answer() {
        // tonic answers a handler's error without a body: the status is in the headers.
        let (_dir, mut client) = plugin(Answer::Status(tonic::Code::Unavailable, "")).await;
        match get_info(&mut client).await {
            Err(CallError::Status { code, message }) => {
                assert_eq!((code, message.as_str()), (tonic::Code::Unavailable, ""));
            }
            other => panic!("expected Unavailable, got {other:?}"),
        }
        // An unknown method: the router's own trailers-only UNIMPLEMENTED.
        let answer = tokio::time::timeout(
            TIMEOUT,
            client.call::<_, PluginInfo>(
                PathAndQuery::from_static("/pluginregistration.Registration/NoSuchMethod"),
                &InfoRequest {},
                TIMEOUT,
            ),
        )
        .await
        .expect("the call ends");
        assert!(
            matches!(
                answer,
                Err(CallError::Status {
                    code: tonic::Code::Unimplemented,
                    ..
                })
            ),
            "{answer:?}"
        );
    }

    #[tokio::test]
    async fn reports_a_non_ok_status_with_its_percent_encoded_message() {
        let message = "not today: 100% full, naïve plugin\n";
        let (_dir, mut client) =
            plugin(Answer::Status(tonic::Code::PermissionDenied, message)).await;
        let error = get_info(&mut client).await.expect_err("refused");
        assert_eq!(
            error.to_string(),
            format!("PermissionDenied: {message}"),
            "{error:?}"
        );
    }

    #[tokio::test]
    async fn refuses_an_answer_larger_than_the_limit() {
        let (_dir, mut client) = plugin(Answer::Info(info(&"n".repeat(MAX + 1)))).await;
        let error = get_info(&mut client).await.expect_err("refused");
        assert!(
            error.to_string().contains("message length too large"),
            "{error:?}"
        );
        // Just under the limit is accepted.
        let (_dir, mut client) = plugin(Answer::Info(info(&"n".repeat(MAX - 64)))).await;
        get_info(&mut client).await.expect("answered");
    }

    #[tokio::test]
    async fn fails_when_the_server_closes_the_connection_mid_call() {
        let (_dir, mut client) = plugin(Answer::CloseConnection).await;
        let error = get_info(&mut client).await.expect_err("no answer");
        assert!(matches!(error, CallError::Transport(_)), "{error:?}");
        // The connection is gone: the next call fails at once, it does not hang.
        let again = get_info(&mut client).await.expect_err("closed");
        assert!(matches!(again, CallError::Transport(_)), "{again:?}");
    }
}
