//! Serving a [`FakePlugin`] on a listening socket: as gRPC (every connection, or only the first;
//! connections closed after an idle limit), or as a server that is not gRPC at all (garbage
//! bytes, or silence). [`Served`] is the in-process handle: a task that stops when told or when
//! the handle is dropped.

use super::FakePlugin;
use std::future::Future;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::{Stream, StreamExt as _};
use tokio_util::sync::CancellationToken;

/// A plugin served by a task of this process; dropping it stops the server (the socket file
/// stays: removing it is the owner's step, as for a real plugin).
pub struct Served {
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Served {
    /// Serves `plugin` on every connection `listener` accepts.
    pub fn spawn(listener: UnixListener, plugin: FakePlugin) -> Served {
        Served::on(
            tokio_stream::wrappers::UnixListenerStream::new(listener),
            plugin,
        )
    }

    /// Serves `plugin` on `connection` only (accepted already, by a listener since closed).
    pub fn spawn_on_connection(connection: UnixStream, plugin: FakePlugin) -> Served {
        let incoming =
            tokio_stream::once(Ok::<_, std::io::Error>(connection)).chain(tokio_stream::pending());
        Served::on(incoming, plugin)
    }

    fn on(
        incoming: impl Stream<Item = std::io::Result<UnixStream>> + Send + 'static,
        plugin: FakePlugin,
    ) -> Served {
        let stop = CancellationToken::new();
        let stopped = stop.clone().cancelled_owned();
        let task = tokio::spawn(async move {
            let _ = grpc(incoming, plugin, stopped).await;
        });
        Served {
            stop,
            task: Some(task),
        }
    }

    /// Stops serving now (connections are closed; the task ends soon after).
    pub fn stop(&self) {
        self.stop.cancel();
    }

    /// Stops serving and waits until the server has ended.
    pub async fn stopped(mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Serves `plugin` as gRPC on the connections of `incoming` until `shutdown`.
pub async fn grpc<S>(
    incoming: impl Stream<Item = std::io::Result<S>> + Send + 'static,
    plugin: FakePlugin,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error>
where
    S: AsyncRead + AsyncWrite + tonic::transport::server::Connected + Unpin + Send + 'static,
{
    tonic::transport::Server::builder()
        .add_service(plugin.into_service())
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}

/// The first connection accepted on `listener`, which is then closed (`closed` is called); the
/// stream stays open, so the server goes on serving that connection until its client is done.
pub fn one_connection(
    listener: UnixListener,
    closed: impl FnOnce() + Send + 'static,
) -> impl Stream<Item = std::io::Result<UnixStream>> {
    futures::stream::unfold(Some((listener, closed)), |listener| async move {
        let Some((listener, closed)) = listener else {
            return std::future::pending().await;
        };
        let accepted = listener.accept().await.map(|(stream, _)| stream);
        drop(listener);
        closed();
        Some((accepted, None))
    })
}

/// Not gRPC: writes bytes that are not HTTP/2 on every connection and closes it.
pub async fn garbage(listener: UnixListener, accepted: impl Fn()) -> std::io::Result<()> {
    loop {
        let (mut stream, _) = listener.accept().await?;
        accepted();
        let _ = stream
            .write_all(b"HELLO this is not HTTP/2\r\n\r\n\x00\x01garbage")
            .await;
        let _ = stream.shutdown().await;
    }
}

/// Not gRPC: accepts every connection and never reads or writes.
pub async fn silent(listener: UnixListener, accepted: impl Fn()) -> std::io::Result<()> {
    let mut held = Vec::new();
    loop {
        let (stream, _) = listener.accept().await?;
        accepted();
        held.push(stream);
    }
}

/// A served connection that ends (reads end-of-file, so the server closes it) after its limit
/// without a byte from the client, as gRPC-Go servers with `MaxConnectionIdle` (or a proxy's
/// idle timeout) do; no limit: the plain stream.
pub struct IdleLimited {
    inner: UnixStream,
    limit: Option<(Duration, Pin<Box<tokio::time::Sleep>>)>,
    closed: fn(),
}

impl IdleLimited {
    /// `inner`, closed after `limit` without a byte from the client (`closed` is called then).
    pub fn new(inner: UnixStream, limit: Option<Duration>, closed: fn()) -> IdleLimited {
        let limit = limit.map(|d| (d, Box::pin(tokio::time::sleep(d))));
        IdleLimited {
            inner,
            limit,
            closed,
        }
    }
}

impl AsyncRead for IdleLimited {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        if let Some((_, deadline)) = this.limit.as_mut()
            && deadline.as_mut().poll(cx).is_ready()
        {
            (this.closed)();
            this.limit = None;
            let _ = nix::sys::socket::shutdown(
                this.inner.as_raw_fd(),
                nix::sys::socket::Shutdown::Both,
            );
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let read = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let (Poll::Ready(Ok(())), Some((limit, deadline))) = (&read, this.limit.as_mut())
            && buf.filled().len() > before
        {
            deadline
                .as_mut()
                .reset(tokio::time::Instant::now() + *limit);
        }
        read
    }
}

impl AsyncWrite for IdleLimited {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for IdleLimited {
    type ConnectInfo = tonic::transport::server::UdsConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}
