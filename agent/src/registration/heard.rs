//! The registration connection's byte stream, counting what the plugin sends first: a peer that
//! sent nothing is not serving yet (retried), one whose first frame is not HTTP/2 SETTINGS does not
//! speak gRPC (named in the error), and `GetInfo`'s second runs from the peer's first bytes.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::UnixStream;
use tokio::time::Instant;

/// `stream`, with its peer's bytes counted from now.
pub(super) fn heard(stream: UnixStream) -> (HeardStream, Arc<PeerBytes>) {
    let peer = Arc::new(PeerBytes::default());
    (
        HeardStream {
            inner: stream,
            peer: peer.clone(),
        },
        peer,
    )
}

/// A Unix stream that records what the peer has sent first.
pub(super) struct HeardStream {
    /// The connection, for its credentials.
    pub(super) inner: UnixStream,
    peer: Arc<PeerBytes>,
}

/// The first bytes a plugin sent on a registration connection: enough to tell a plugin that is
/// not serving yet (nothing sent) from one that does not speak gRPC (its first frame is not the
/// HTTP/2 SETTINGS frame every gRPC server opens with).
#[derive(Debug, Default)]
pub(super) struct PeerBytes {
    /// The first bytes and how many of them arrived (at most a frame header).
    first: std::sync::Mutex<([u8; FRAME_HEADER], usize)>,
    /// When the first bytes arrived.
    heard_at: std::sync::OnceLock<Instant>,
    /// All of a frame header is in `first`: later reads record nothing (every read of the
    /// connection passes here; this spares them the lock and the clock).
    full: AtomicBool,
}

/// Length of an HTTP/2 frame header: 3 bytes length, type, flags, 4 bytes stream id.
const FRAME_HEADER: usize = 9;
/// HTTP/2 frame type of SETTINGS.
const SETTINGS: u8 = 0x4;

impl PeerBytes {
    pub(super) fn record(&self, data: &[u8]) {
        if data.is_empty() || self.full.load(Ordering::Acquire) {
            return;
        }
        if self.heard_at.get().is_none() {
            let _ = self.heard_at.set(Instant::now());
        }
        let mut first = self.first.lock().unwrap_or_else(|p| p.into_inner());
        let (bytes, len) = &mut *first;
        let taken = (FRAME_HEADER - *len).min(data.len());
        bytes[*len..*len + taken].copy_from_slice(&data[..taken]);
        *len += taken;
        if *len == FRAME_HEADER {
            self.full.store(true, Ordering::Release);
        }
    }

    pub(super) fn heard(&self) -> bool {
        self.heard_at.get().is_some()
    }

    pub(super) fn heard_at(&self) -> Option<Instant> {
        self.heard_at.get().copied()
    }

    /// Why the peer is not an HTTP/2 server, if its first bytes prove it.
    pub(super) fn not_http2(&self) -> Option<String> {
        let (bytes, len) = *self.first.lock().unwrap_or_else(|p| p.into_inner());
        let first = &bytes[..len];
        let wrong_type = first.len() > 3 && first[3] != SETTINGS;
        let wrong_stream = first.len() == FRAME_HEADER && first[5..9] != [0, 0, 0, 0];
        (wrong_type || wrong_stream).then(|| {
            format!(
                "the plugin's listener does not speak gRPC: it sent {:?} instead of an HTTP/2 SETTINGS frame",
                String::from_utf8_lossy(first)
            )
        })
    }
}

impl AsyncRead for HeardStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(poll, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            let received = &buf.filled()[before..];
            self.peer.record(received);
        }
        poll
    }
}

impl AsyncWrite for HeardStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_http2_settings_frame_is_not_mistaken_for_garbage() {
        let peer = PeerBytes::default();
        assert!(!peer.heard());
        peer.record(&[0, 0, 18, SETTINGS, 0, 0, 0, 0, 0, 0, 3]);
        assert!(peer.heard());
        assert_eq!(peer.not_http2(), None);
    }

    /// A frame header split over reads is put together; what follows it is not kept.
    #[test]
    fn the_first_frame_header_is_gathered_across_reads() {
        let peer = PeerBytes::default();
        peer.record(&[0, 0, 18]);
        let heard_at = peer.heard_at();
        assert!(heard_at.is_some());
        peer.record(&[SETTINGS, 0, 0, 0, 0]);
        peer.record(&[0, 0, 3, 0xff]);
        assert_eq!(peer.not_http2(), None);
        assert_eq!(peer.heard_at(), heard_at, "heard when the first bytes came");
        let split = PeerBytes::default();
        split.record(b"HTTP/1");
        split.record(b".1 400 Bad Request");
        let why = split.not_http2().expect("not HTTP/2");
        assert!(why.contains("\"HTTP/1.1 \""), "{why}");
    }

    #[test]
    fn http1_or_garbage_first_bytes_are_named() {
        let peer = PeerBytes::default();
        peer.record(b"HTTP/1.1 400 Bad Request\r\n");
        let why = peer.not_http2().expect("not HTTP/2");
        assert!(why.contains("HTTP/1.1"), "{why}");
        let peer = PeerBytes::default();
        peer.record(&[0, 0, 0, SETTINGS, 0, 0, 0, 0, 7]);
        assert!(
            peer.not_http2().is_some(),
            "SETTINGS on a non-zero stream is not a preface"
        );
    }
}
