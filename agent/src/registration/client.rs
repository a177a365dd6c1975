//! tonic's generated `Registration` client over one hyper HTTP/2 client connection: no tonic
//! `Channel`, no tower buffer, no reconnect.
//!
//! A registration makes two calls (`GetInfo`, `NotifyRegistrationStatus`) on a connection used
//! once and closed. The hyper connection's dispatcher is polled by the registering task while a
//! call runs; hyper itself runs the HTTP/2 connection and each response in tasks of its
//! executor, which end when the registration drops the connection.

use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo};
use plugin_agent_proto::pluginregistration::registration_client::RegistrationClient;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite};

type Body = tonic::body::Body;

/// hyper's `SendRequest` as the tower service tonic's generated clients call.
#[derive(Clone)]
pub struct Http2(http2::SendRequest<Body>);

impl tower::Service<http::Request<Body>> for Http2 {
    type Response = http::Response<hyper::body::Incoming>;
    type Error = hyper::Error;
    type Future =
        Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send + 'static>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        Box::pin(self.0.send_request(request))
    }
}

/// One registration connection: tonic's client, and hyper's connection dispatcher (`None` once
/// it has ended).
pub struct Client<T>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    pub grpc: RegistrationClient<Http2>,
    connection: Option<Pin<Box<http2::Connection<TokioIo<T>, Body, TokioExecutor>>>>,
}

impl<T> Client<T>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    /// Starts HTTP/2 on `io` (sends the client preface and SETTINGS; does not wait for the
    /// server's, so a request can wait in the socket for a server that is not serving yet).
    pub async fn handshake(io: T, max_message: usize) -> Result<Self, hyper::Error> {
        // Answers larger than this are refused anyway; the window bounds what is buffered.
        let window = u32::try_from(max_message + 5)
            .unwrap_or(u32::MAX)
            .max(65_535);
        let (send, connection) = http2::Builder::new(TokioExecutor::new())
            .initial_stream_window_size(window)
            .initial_connection_window_size(window)
            .max_header_list_size(16 * 1024)
            .handshake(TokioIo::new(io))
            .await?;
        let origin = http::Uri::from_static("http://plugin.invalid");
        let grpc = RegistrationClient::with_origin(Http2(send), origin)
            .max_decoding_message_size(max_message)
            .max_encoding_message_size(max_message);
        Ok(Client {
            grpc,
            connection: Some(Box::pin(connection)),
        })
    }

    /// Runs `call` (made with `self.grpc`) while polling the connection's dispatcher.
    pub async fn drive<F, R>(
        connection: &mut Option<Pin<Box<http2::Connection<TokioIo<T>, Body, TokioExecutor>>>>,
        call: F,
    ) -> R
    where
        F: Future<Output = R>,
    {
        let mut call = std::pin::pin!(call);
        let Some(conn) = connection.as_mut() else {
            return call.await;
        };
        tokio::select! {
            biased;
            answer = &mut call => return answer,
            _ended = conn => {}
        }
        // The connection ended: the call finishes with what arrived, or fails.
        *connection = None;
        call.await
    }

    /// `GetInfo`, sending `timeout` as `grpc-timeout`.
    pub async fn get_info(
        &mut self,
        timeout: std::time::Duration,
    ) -> Result<plugin_agent_proto::pluginregistration::PluginInfo, tonic::Status> {
        let mut request =
            tonic::Request::new(plugin_agent_proto::pluginregistration::InfoRequest {});
        request.set_timeout(timeout);
        let call = self.grpc.get_info(request);
        Self::drive(&mut self.connection, call)
            .await
            .map(tonic::Response::into_inner)
    }

    /// `NotifyRegistrationStatus`, sending `timeout` as `grpc-timeout`.
    pub async fn notify(
        &mut self,
        status: plugin_agent_proto::pluginregistration::RegistrationStatus,
        timeout: std::time::Duration,
    ) -> Result<(), tonic::Status> {
        let mut request = tonic::Request::new(status);
        request.set_timeout(timeout);
        let call = self.grpc.notify_registration_status(request);
        Self::drive(&mut self.connection, call).await.map(|_| ())
    }
}

/// A status as the agent reports it: the code, and the plugin's message if any.
pub fn status_text(status: &tonic::Status) -> String {
    if status.message().is_empty() {
        format!("{:?}", status.code())
    } else {
        format!("{:?}: {}", status.code(), status.message())
    }
}
