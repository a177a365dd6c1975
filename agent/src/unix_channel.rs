//! gRPC over Unix sockets: tonic dials TCP URIs, so the agent's clients of Unix-socket servers
//! (handlers at `unix:///path.sock`, the admin API for the CLI) give it a connector that dials the
//! socket path instead. Plugin registration sockets are different: one connection per attempt,
//! never redialled (see `registration`).

use hyper_util::rt::TokioIo;
use std::path::PathBuf;
use tokio::net::UnixStream;
use tonic::codegen::http::Uri;
use tonic::transport::{Channel, Endpoint};

/// A channel that connects to `path` on first use and redials it after a failure, so a server
/// that restarts needs nothing from the caller.
pub fn lazy(path: PathBuf) -> Channel {
    endpoint().connect_with_connector_lazy(dialer(path))
}

/// A channel connected to `path` now; fails if nothing listens there.
pub async fn connect(path: PathBuf) -> Result<Channel, tonic::transport::Error> {
    endpoint().connect_with_connector(dialer(path)).await
}

/// The URI is required by the API but unused: the connector dials the socket.
fn endpoint() -> Endpoint {
    Endpoint::from_static("http://unix.socket.invalid")
}

fn dialer(
    path: PathBuf,
) -> impl tower::Service<Uri, Response = TokioIo<UnixStream>, Error = std::io::Error, Future: Send>
+ Clone
+ Send
+ 'static {
    tower::service_fn(move |_: Uri| {
        let path = path.clone();
        async move { UnixStream::connect(path).await.map(TokioIo::new) }
    })
}
