//! The plugin side of registration: kubelet's `pluginregistration` API, spoken as a client over the
//! plugin's registration socket.
//!
//! Timeouts are kubelet's: dial 10 s, `GetInfo` 1 s, `NotifyRegistrationStatus` 5 s. The agent keeps
//! no connection to registration sockets: one connection per registration attempt, closed after.
//!
//! # Plugins that bind before they serve
//!
//! A socket can exist before anyone listens on it (bind, then listen), and a listening socket can
//! exist before its gRPC server runs (listen, then serve). Kubelet's dial blocks with gRPC's
//! reconnect backoff and then counts the plugin as failed, so such a plugin waits out backoff
//! steps meant for broken plugins. Here:
//! - `ECONNREFUSED` (bound, not listening) is retried at once, three times in [`QUICK_LISTEN_WAIT`]
//!   (a plugin caught between its bind and its listen listens within microseconds). A socket
//!   still refusing after that ends the attempt with [`PluginCallError::NotListeningYet`]: the
//!   executor waits for its listen without an operation (the kernel's report, or a retry),
//!   within the listen wait it passes in [`Timeouts::listen`]. An attempt held open through that
//!   wait cost ~6 KB, and 17,000 bind-only sockets made at once held 100 MB. Refused to the end
//!   is [`PluginCallError::NotListening`]: the socket is *unserved* (see `liveness`), which waits
//!   for the socket to change instead of backing off;
//! - a connection whose peer has sent *nothing* when `GetInfo`'s 1 s deadline passes is a server
//!   that is not serving yet (a gRPC server sends its HTTP/2 SETTINGS as soon as it serves), so the
//!   attempt is repeated on a fresh connection, again within the dial budget. The request waits in
//!   the socket's queue, so the plugin is answered the moment it starts serving.
//!
//! A peer that sent bytes but no `GetInfo` answer within 1 s of its first bytes is a hung plugin:
//! that is a failure. (From its first bytes, not from the request: a server that starts serving
//! near the end of the request's second is not a hung one.)

mod unary;

use crate::liveness::Server;
use crate::state::{EntryKind, SocketId};
use plugin_agent_proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use std::io;
use std::os::fd::AsFd as _;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::UnixStream;
use tokio::time::Instant;
use tracing::{Instrument as _, info_span};
use unary::UnaryClient;

/// The `pluginregistration.Registration` methods (the package is the same for v1alpha1, v1beta1
/// and v1: kubelet's wire contract).
const GET_INFO: &str = "/pluginregistration.Registration/GetInfo";
const NOTIFY: &str = "/pluginregistration.Registration/NotifyRegistrationStatus";

/// How an attempt waits between tries while a plugin is not listening or not serving yet. The
/// executor's operation slot implements it by stepping out of the slot for the pause (see
/// `slots`), so sockets that only make the agent wait never hold up other plugins.
pub trait Pause: Send {
    /// Waits `duration`.
    fn pause(
        &mut self,
        duration: Duration,
    ) -> Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>>;

    /// The plugin has not answered `GetInfo` within [`SLOW_ANSWER`]: the attempt now waits on a
    /// slow or hung plugin, not on this node's CPU (the executor's slot lets its dial permit go).
    fn answer_slow(&mut self) {}
}

/// How long a `GetInfo` may take before [`Pause::answer_slow`]: a quarter of kubelet's 1 s
/// deadline, as a quarter of the executor's slots may dial (see `executor::slots`).
pub const SLOW_ANSWER: Duration = Duration::from_millis(250);

/// A plain sleep, for callers that hold nothing worth giving back.
pub struct Sleep;

impl Pause for Sleep {
    fn pause(
        &mut self,
        duration: Duration,
    ) -> Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
        Box::pin(tokio::time::sleep(duration))
    }
}

/// Deadlines for the calls to a plugin.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// Connecting and waiting for the plugin to serve (kubelet: 10 s).
    pub dial: Duration,
    /// How long, within `dial`, a socket that refuses connections (bound, not listening yet) may
    /// go on refusing before it counts as unserved (see `liveness`). The executor sets what is
    /// left of the socket's wait (see `executor::listen_wait`); an attempt itself waits only
    /// [`QUICK_LISTEN_WAIT`] of it.
    pub listen: Duration,
    /// `GetInfo` (kubelet: 1 s).
    pub get_info: Duration,
    /// `NotifyRegistrationStatus` (kubelet: 5 s).
    pub notify: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            dial: Duration::from_secs(10),
            listen: Duration::from_secs(10),
            get_info: Duration::from_secs(1),
            notify: Duration::from_secs(5),
        }
    }
}

/// How long one attempt retries a socket that refuses connections before handing the wait back
/// ([`PluginCallError::NotListeningYet`]): its three quick retries, 1 + 2 + 4 ms.
pub const QUICK_LISTEN_WAIT: Duration = Duration::from_millis(7);

/// Pause before asking a silent (not yet serving) plugin again, so a listener that accepts and
/// closes at once is not spun on. The pause doubles on each silent connection, to [`NOT_SERVING_PAUSE_MAX`]: a server that
/// accepts and hangs up at once is asked ~50 times in the dial budget instead of ~2,000 (300 of
/// them took both cores for 10 s, and a good plugin's registration with them).
const NOT_SERVING_PAUSE: Duration = Duration::from_millis(5);
/// See [`NOT_SERVING_PAUSE`].
const NOT_SERVING_PAUSE_MAX: Duration = Duration::from_millis(250);

/// Largest message accepted from a plugin. `PluginInfo` is a few hundred bytes in practice; a
/// plugin answering with megabytes is refused before it costs memory.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;

/// Limits on what a plugin may announce, checked before any handler sees it.
pub mod limits {
    /// Longest plugin type or name.
    pub const NAME_BYTES: usize = 256;
    /// Longest endpoint (PATH_MAX).
    pub const ENDPOINT_BYTES: usize = 4096;
    /// Most supported versions.
    pub const VERSIONS: usize = 64;
    /// Longest version string.
    pub const VERSION_BYTES: usize = 256;
}

/// Why talking to a plugin failed.
#[derive(Debug, thiserror::Error)]
pub enum PluginCallError {
    /// The socket vanished, or was replaced by another socket (which gets its own registration).
    #[error("socket {0} no longer exists or was replaced")]
    SocketGone(PathBuf),
    /// Nothing listened on the socket (connections refused) for as long as it was waited for:
    /// the socket is unserved, not a broken plugin.
    #[error("nothing listens on {path}: connection refused for {elapsed:?}")]
    NotListening { path: PathBuf, elapsed: Duration },
    /// The socket refuses connections (bound, not listening yet) and may still listen until
    /// `until`: the attempt ends, and the wait goes on without it (see the module docs).
    #[error("{path} refuses connections (bound, not listening yet)")]
    NotListeningYet { path: PathBuf, until: Instant },
    /// Could not connect within the dial timeout.
    #[error("dial {path}: {reason} (after {elapsed:?})")]
    Dial {
        path: PathBuf,
        reason: String,
        elapsed: Duration,
    },
    /// GetInfo failed.
    #[error("GetInfo: {0}")]
    GetInfo(String),
    /// GetInfo's deadline passed, on a connection where the plugin had spoken (so it serves, but
    /// is hung, or slow: busy starting up, say).
    #[error("GetInfo: no answer within {0:?}")]
    GetInfoTimeout(Duration),
    /// GetInfo answered something no handler should see.
    #[error("invalid PluginInfo: {0}")]
    InvalidInfo(String),
    /// NotifyRegistrationStatus failed (transport or the plugin returned an error).
    #[error("NotifyRegistrationStatus: {0}")]
    Notify(String),
}

/// A step of a plugin call, timed for whoever asked ([`StepTimer`]): each is its span's duration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Connecting, including the wait for a bound socket to listen (the `dial` span).
    Dial,
    /// The `GetInfo` call (its span).
    GetInfo,
    /// A `NotifyRegistrationStatus` call (a broken connection's re-dial asks again: a second
    /// call).
    Notify,
}

impl Step {
    /// The `call` label of the step's latency metric.
    pub fn label(self) -> &'static str {
        match self {
            Step::Dial => "dial",
            Step::GetInfo => "get_info",
            Step::Notify => "notify",
        }
    }

    /// The name of the step's span.
    pub fn span_name(self) -> &'static str {
        match self {
            Step::Dial => "dial",
            Step::GetInfo => "GetInfo",
            Step::Notify => "NotifyRegistrationStatus",
        }
    }
}

/// Told how long each step of a connection's calls took and whether it succeeded, while the
/// step's span is current (the executor records the step with that span as its exemplar; this
/// room imports no telemetry). The default times nothing.
#[derive(Clone, Default)]
pub struct StepTimer(Option<Arc<RecordStep>>);

/// What a [`StepTimer`] calls: the step, how long it took, whether it succeeded.
type RecordStep = dyn Fn(Step, Duration, bool) + Send + Sync;

impl StepTimer {
    pub fn new(record: impl Fn(Step, Duration, bool) + Send + Sync + 'static) -> Self {
        StepTimer(Some(Arc::new(record)))
    }

    fn record(&self, step: Step, took: Duration, ok: bool) {
        if let Some(record) = &self.0 {
            record(step, took, ok);
        }
    }
}

impl std::fmt::Debug for StepTimer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("StepTimer").field(&self.0.is_some()).finish()
    }
}

/// What `get_info` does with a PluginInfo no handler should see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnInvalid {
    /// Tell the plugin why (`NotifyRegistrationStatus(false, reason)`), as kubelet does.
    Notify,
    /// Say nothing to the plugin (observe mode: the agent never notifies).
    Silent,
}

/// A connection to one plugin's registration socket, for one registration attempt. Closed when
/// dropped.
pub struct PluginConnection {
    client: UnaryClient<HeardStream>,
    timeouts: Timeouts,
    /// Who serves the socket, from the connection's credentials.
    server: Option<Server>,
    steps: StepTimer,
}

impl PluginConnection {
    /// Connects to the plugin at `socket` and asks for its `PluginInfo` (see the module docs for
    /// how not-yet-serving plugins are waited for).
    /// `expected` is the socket instance being registered: if the path comes to hold another
    /// socket while this attempt waits, the attempt ends (the new socket has its own).
    /// `waiting` does the pauses between tries; `steps` is told how long each step took.
    /// `connected` is a connection already made to the socket (a look that found it
    /// listening): the first try uses it, so a plugin that serves one connection is asked on it.
    pub async fn get_info(
        socket: &Path,
        expected: SocketId,
        mut connected: Option<UnixStream>,
        timeouts: Timeouts,
        waiting: &mut dyn Pause,
        on_invalid: OnInvalid,
        steps: &StepTimer,
    ) -> Result<(PluginConnection, PluginInfo), PluginCallError> {
        let started = Instant::now();
        let budget_end = started + timeouts.dial;
        let listen_end = started + timeouts.listen.min(timeouts.dial);
        let mut not_serving_pause = NOT_SERVING_PAUSE;
        loop {
            let span = info_span!("dial");
            let dialled = Instant::now();
            let listen = ListenWait {
                until: listen_end,
                hand_back: true,
            };
            let dial = match connected.take() {
                Some(stream) => Ok(heard(stream)),
                None => {
                    connect_when_listening(socket, expected, budget_end, listen, started, waiting)
                        .instrument(span.clone())
                        .await
                }
            };
            span.in_scope(|| steps.record(Step::Dial, dialled.elapsed(), dial.is_ok()));
            let (stream, peer) = dial?;
            let server = Server::of(stream.inner.as_fd())
                .inspect_err(
                    |e| tracing::debug!(error = %e, "cannot read the plugin's credentials"),
                )
                .ok();
            let remaining = budget_end.saturating_duration_since(Instant::now());
            // The HTTP/2 steps are boxed: until a peer accepts, this future stays small (a
            // dial that waits for a bound-but-not-serving socket, or for a stale one until its
            // budget ends, costs a few hundred bytes instead of the connection's kilobytes).
            let mut client = match Box::pin(tokio::time::timeout(
                remaining,
                UnaryClient::handshake(stream, MAX_MESSAGE_BYTES),
            ))
            .await
            {
                Ok(Ok(client)) => client,
                Ok(Err(e)) => {
                    return Err(dial_error(
                        socket,
                        format!("HTTP/2 connection: {e}"),
                        started,
                    ));
                }
                Err(_) => {
                    return Err(dial_error(
                        socket,
                        "HTTP/2 connection timed out".into(),
                        started,
                    ));
                }
            };
            let span = info_span!("GetInfo");
            let asked = Instant::now();
            let called = telling_when_slow(
                Box::pin(
                    answer_within(
                        client.call::<_, PluginInfo>(GET_INFO, &InfoRequest {}, timeouts.get_info),
                        &peer,
                        timeouts.get_info,
                    )
                    .instrument(span.clone()),
                ),
                waiting,
            )
            .await;
            span.in_scope(|| {
                steps.record(Step::GetInfo, asked.elapsed(), matches!(called, Ok(Ok(_))))
            });
            let answer = match called {
                Ok(Ok(info)) => {
                    let mut connection = PluginConnection {
                        client,
                        timeouts,
                        server,
                        steps: steps.clone(),
                    };
                    if let Err(invalid) = validate_info(&info) {
                        if on_invalid == OnInvalid::Silent {
                            return Err(invalid);
                        }
                        // As kubelet does for a plugin it refuses: say why, then back off.
                        let told =
                            Box::pin(connection.notify(false, &invalid.to_string()).instrument(
                                info_span!("NotifyRegistrationStatus", registered = false),
                            ))
                            .await;
                        if let Err(e) = told {
                            tracing::debug!(error = %e, "could not tell the plugin its PluginInfo is invalid");
                        }
                        return Err(invalid);
                    }
                    return Ok((connection, info));
                }
                // The plugin's server enforcing the deadline the call carries (`grpc-timeout`),
                // when its status lands before the agent's own timer: the same missed deadline
                // (a just-started plugin then gets its quick retry, whichever side noticed first).
                Ok(Err(unary::CallError::Status {
                    code: tonic::Code::Cancelled | tonic::Code::DeadlineExceeded,
                    ..
                })) if asked.elapsed() >= timeouts.get_info => {
                    PluginCallError::GetInfoTimeout(timeouts.get_info)
                }
                Ok(Err(e)) => PluginCallError::GetInfo(e.to_string()),
                Err(_elapsed) => PluginCallError::GetInfoTimeout(timeouts.get_info),
            };
            // A peer that has sent nothing at all is not serving yet (a gRPC server speaks first):
            // ask again on a fresh connection, within the dial budget.
            if !peer.heard() && Instant::now() + not_serving_pause < budget_end {
                drop(client);
                waiting.pause(not_serving_pause).await;
                not_serving_pause = (not_serving_pause * 2).min(NOT_SERVING_PAUSE_MAX);
                continue;
            }
            if let Some(not_http2) = peer.not_http2() {
                return Err(PluginCallError::GetInfo(not_http2));
            }
            return Err(answer);
        }
    }

    /// Who serves the socket, as its connection's credentials name it.
    pub fn server(&self) -> Option<&Server> {
        self.server.as_ref()
    }

    /// Who serves the socket (learned when the connection was made), handed to `liveness` once
    /// the plugin is registered.
    pub fn take_server(&mut self) -> Option<Server> {
        self.server.take()
    }

    /// Tells the plugin whether it is registered. `registered=false` with the reason is part of
    /// every failed registration; an error from the plugin or the transport is returned.
    pub async fn notify(&mut self, registered: bool, error: &str) -> Result<(), PluginCallError> {
        self.call_notify(registered, error)
            .await
            .map_err(NotifyFailure::into_error)
    }

    /// [`Self::notify`], and once more on a fresh connection to `socket` if this one broke.
    ///
    /// A handler's Register may take up to its 45 s deadline (a CSI driver's can take a minute);
    /// meanwhile nothing is sent on the plugin's connection, and a plugin server with an idle
    /// limit (gRPC's `MaxConnectionIdle`, a proxy in between) closes it. Kubelet then loses the
    /// Notify, and node-driver-registrar v2.9+ exits when it never hears back (kubernetes PR
    /// 138170). A transport failure here re-dials (same socket instance, within the dial budget)
    /// and asks again; a plugin's own error answer or a deadline is final.
    pub async fn notify_redialing(
        &mut self,
        socket: &Path,
        expected: SocketId,
        registered: bool,
        error: &str,
        waiting: &mut dyn Pause,
    ) -> Result<(), PluginCallError> {
        let broken = match self.call_notify(registered, error).await {
            Err(NotifyFailure::Transport(broken)) => broken,
            other => return other.map_err(NotifyFailure::into_error),
        };
        tracing::info!(error = %broken, "the registration connection broke before Notify; notifying on a new one");
        let started = Instant::now();
        let budget_end = started + self.timeouts.dial;
        // Mid-registration: a listener that went away and comes back is waited for here.
        let listen = ListenWait {
            until: budget_end,
            hand_back: false,
        };
        let (stream, _) =
            connect_when_listening(socket, expected, budget_end, listen, started, waiting)
                .instrument(info_span!("dial"))
                .await
                .map_err(|e| PluginCallError::Notify(format!("{broken}; re-dial: {e}")))?;
        let remaining = budget_end.saturating_duration_since(Instant::now());
        self.client = match Box::pin(tokio::time::timeout(
            remaining,
            UnaryClient::handshake(stream, MAX_MESSAGE_BYTES),
        ))
        .await
        {
            Ok(Ok(client)) => client,
            Ok(Err(e)) => {
                return Err(PluginCallError::Notify(format!(
                    "{broken}; re-dial: HTTP/2 connection: {e}"
                )));
            }
            Err(_) => {
                return Err(PluginCallError::Notify(format!(
                    "{broken}; re-dial: HTTP/2 connection timed out"
                )));
            }
        };
        self.call_notify(registered, error)
            .await
            .map_err(NotifyFailure::into_error)
    }

    /// One `NotifyRegistrationStatus` call on this connection, timed for [`StepTimer`] (every
    /// Notify, a re-dialled one included, goes through here).
    async fn call_notify(&mut self, registered: bool, error: &str) -> Result<(), NotifyFailure> {
        let request = RegistrationStatus {
            plugin_registered: registered,
            error: error.to_string(),
        };
        let timeout = self.timeouts.notify;
        let started = Instant::now();
        let told = match tokio::time::timeout(
            timeout,
            self.client
                .call::<_, RegistrationStatusResponse>(NOTIFY, &request, timeout),
        )
        .await
        {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e @ unary::CallError::Transport(_))) => {
                Err(NotifyFailure::Transport(e.to_string()))
            }
            Ok(Err(e)) => Err(NotifyFailure::Final(e.to_string())),
            Err(_) => Err(NotifyFailure::Final(format!(
                "no answer within {timeout:?}"
            ))),
        };
        self.steps
            .record(Step::Notify, started.elapsed(), told.is_ok());
        told
    }
}

/// How a Notify failed: the connection (worth a new one), or the plugin (final).
enum NotifyFailure {
    Transport(String),
    Final(String),
}

impl NotifyFailure {
    fn into_error(self) -> PluginCallError {
        match self {
            NotifyFailure::Transport(e) | NotifyFailure::Final(e) => PluginCallError::Notify(e),
        }
    }
}

fn dial_error(socket: &Path, reason: String, started: Instant) -> PluginCallError {
    PluginCallError::Dial {
        path: socket.to_path_buf(),
        reason,
        elapsed: started.elapsed(),
    }
}

/// Rejects what would be unreasonable to hand to a handler (or to log, or to keep in memory).
fn validate_info(info: &PluginInfo) -> Result<(), PluginCallError> {
    let invalid = |what: String| Err(PluginCallError::InvalidInfo(what));
    if info.r#type.is_empty() {
        return invalid("empty type".into());
    }
    if info.name.is_empty() {
        return invalid("empty name".into());
    }
    if info.r#type.len() > limits::NAME_BYTES || info.name.len() > limits::NAME_BYTES {
        return invalid(format!(
            "type or name longer than {} bytes",
            limits::NAME_BYTES
        ));
    }
    if info.endpoint.len() > limits::ENDPOINT_BYTES {
        return invalid(format!(
            "endpoint longer than {} bytes",
            limits::ENDPOINT_BYTES
        ));
    }
    if info.supported_versions.len() > limits::VERSIONS {
        return invalid(format!(
            "{} supported versions (at most {})",
            info.supported_versions.len(),
            limits::VERSIONS
        ));
    }
    if info
        .supported_versions
        .iter()
        .any(|v| v.len() > limits::VERSION_BYTES)
    {
        return invalid(format!(
            "a supported version longer than {} bytes",
            limits::VERSION_BYTES
        ));
    }
    Ok(())
}

/// `stream`, with its peer's bytes counted from now.
fn heard(stream: UnixStream) -> (HeardStream, Arc<PeerBytes>) {
    let peer = Arc::new(PeerBytes::default());
    (
        HeardStream {
            inner: stream,
            peer: peer.clone(),
        },
        peer,
    )
}

/// How a dial waits for a socket that refuses connections (bound, not listening yet).
#[derive(Debug, Clone, Copy)]
struct ListenWait {
    /// Refused after this, the socket is unserved.
    until: Instant,
    /// Past its quick retries, the dial hands the wait back to its caller
    /// ([`PluginCallError::NotListeningYet`]) rather than pausing.
    hand_back: bool,
}

/// Connects to `socket`, retrying `ECONNREFUSED` (bound but not listening yet) as `listen` says,
/// and other transient refusals until `budget_end`.
async fn connect_when_listening(
    socket: &Path,
    expected: SocketId,
    budget_end: Instant,
    listen: ListenWait,
    started: Instant,
    waiting: &mut dyn Pause,
) -> Result<(HeardStream, Arc<PeerBytes>), PluginCallError> {
    let mut pause = Duration::from_millis(1);
    loop {
        if !matches!(EntryKind::of(socket), Ok(EntryKind::Socket(id)) if id == expected) {
            return Err(PluginCallError::SocketGone(socket.to_path_buf()));
        }
        let remaining = budget_end.saturating_duration_since(Instant::now());
        let attempt = tokio::time::timeout(remaining, UnixStream::connect(socket)).await;
        let error = match attempt {
            Ok(Ok(stream)) => return Ok(heard(stream)),
            Ok(Err(e)) => e,
            Err(_) => io::Error::new(io::ErrorKind::TimedOut, "connect timed out"),
        };
        match error.kind() {
            io::ErrorKind::NotFound => {
                return Err(PluginCallError::SocketGone(socket.to_path_buf()));
            }
            io::ErrorKind::ConnectionRefused
                if listen.hand_back
                    && started.elapsed() + pause > QUICK_LISTEN_WAIT
                    && Instant::now() < listen.until =>
            {
                return Err(PluginCallError::NotListeningYet {
                    path: socket.to_path_buf(),
                    until: listen.until,
                });
            }
            io::ErrorKind::ConnectionRefused if Instant::now() + pause < listen.until => {
                waiting.pause(pause).await;
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            io::ErrorKind::ConnectionRefused => {
                return Err(PluginCallError::NotListening {
                    path: socket.to_path_buf(),
                    elapsed: started.elapsed(),
                });
            }
            io::ErrorKind::WouldBlock if Instant::now() + pause < budget_end => {
                waiting.pause(pause).await;
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            _ => return Err(dial_error(socket, error.to_string(), started)),
        }
    }
}

/// Awaits `call`, telling `waiting` when it has taken [`SLOW_ANSWER`].
async fn telling_when_slow<F: std::future::Future + Unpin>(
    mut call: F,
    waiting: &mut dyn Pause,
) -> F::Output {
    match tokio::time::timeout(SLOW_ANSWER, &mut call).await {
        Ok(answer) => answer,
        Err(_) => {
            waiting.answer_slow();
            call.await
        }
    }
}

/// Waits for `call`'s answer for `deadline`, counted from the request or, when the peer only
/// began to speak meanwhile, from its first bytes: a gRPC server speaks first (its SETTINGS), so
/// one that starts serving while the request waits in its socket gets the whole `deadline` to
/// answer, and only a server that spoke and then left the request unanswered that long is hung.
/// (Counted from the request alone, a plugin that began serving just before the deadline was
/// taken for a hung one.)
async fn answer_within<F: std::future::Future>(
    call: F,
    peer: &PeerBytes,
    deadline: Duration,
) -> Result<F::Output, tokio::time::error::Elapsed> {
    let mut call = std::pin::pin!(call);
    let mut end = Instant::now() + deadline;
    loop {
        match tokio::time::timeout_at(end, &mut call).await {
            Ok(answer) => return Ok(answer),
            Err(elapsed) => match peer.heard_at() {
                Some(heard) if heard + deadline > end => end = heard + deadline,
                _ => return Err(elapsed),
            },
        }
    }
}

/// A Unix stream that records what the peer has sent first.
struct HeardStream {
    inner: UnixStream,
    peer: Arc<PeerBytes>,
}

/// The first bytes a plugin sent on a registration connection: enough to tell a plugin that is
/// not serving yet (nothing sent) from one that does not speak gRPC (its first frame is not the
/// HTTP/2 SETTINGS frame every gRPC server opens with).
#[derive(Debug, Default)]
struct PeerBytes {
    first: std::sync::Mutex<Vec<u8>>,
    /// When the first bytes arrived.
    heard_at: std::sync::OnceLock<Instant>,
}

/// Length of an HTTP/2 frame header: 3 bytes length, type, flags, 4 bytes stream id.
const FRAME_HEADER: usize = 9;
/// HTTP/2 frame type of SETTINGS.
const SETTINGS: u8 = 0x4;

impl PeerBytes {
    fn record(&self, data: &[u8]) {
        if !data.is_empty() {
            let _ = self.heard_at.set(Instant::now());
        }
        let mut first = self.first.lock().unwrap_or_else(|p| p.into_inner());
        let room = FRAME_HEADER.saturating_sub(first.len());
        first.extend_from_slice(&data[..room.min(data.len())]);
    }

    fn heard(&self) -> bool {
        self.heard_at.get().is_some()
    }

    fn heard_at(&self) -> Option<Instant> {
        self.heard_at.get().copied()
    }

    /// Why the peer is not an HTTP/2 server, if its first bytes prove it.
    fn not_http2(&self) -> Option<String> {
        let first = self.first.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let wrong_type = first.len() > 3 && first[3] != SETTINGS;
        let wrong_stream = first.len() == FRAME_HEADER && first[5..9] != [0, 0, 0, 0];
        (wrong_type || wrong_stream).then(|| {
            format!(
                "the plugin's listener does not speak gRPC: it sent {:?} instead of an HTTP/2 SETTINGS frame",
                String::from_utf8_lossy(&first)
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

    /// A plugin whose server starts 700 ms after the agent's `GetInfo` waits in its socket, and
    /// answers 600 ms after that: 1.3 s after the request, 0.6 s after it first spoke. It is not
    /// hung: it gets its second from its first word. (Counted from the request, the attempt
    /// failed at 1 s with "GetInfo: no answer within 1s".)
    #[tokio::test]
    async fn a_plugin_that_starts_serving_late_in_the_get_info_window_gets_its_whole_second() {
        use plugin_agent_proto::pluginregistration::registration_server::{
            Registration, RegistrationServer,
        };

        struct Late;
        #[tonic::async_trait]
        impl Registration for Late {
            async fn get_info(
                &self,
                _: tonic::Request<InfoRequest>,
            ) -> Result<tonic::Response<PluginInfo>, tonic::Status> {
                tokio::time::sleep(Duration::from_millis(600)).await;
                Ok(tonic::Response::new(PluginInfo {
                    r#type: "CSIPlugin".into(),
                    name: "late.example.com".into(),
                    endpoint: "/csi.sock".into(),
                    supported_versions: vec!["1.0.0".into()],
                }))
            }
            async fn notify_registration_status(
                &self,
                _: tonic::Request<RegistrationStatus>,
            ) -> Result<tonic::Response<RegistrationStatusResponse>, tonic::Status> {
                Ok(tonic::Response::new(RegistrationStatusResponse {}))
            }
        }

        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("late.sock");
        // Listening from the start (the agent's connection waits in the backlog), serving later.
        let listener = tokio::net::UnixListener::bind(&path).expect("bind");
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(700)).await;
            tonic::transport::Server::builder()
                .add_service(RegistrationServer::new(Late))
                .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener))
                .await
        });
        let Ok(EntryKind::Socket(socket)) = EntryKind::of(&path) else {
            panic!("no socket at {}", path.display());
        };
        let asked = std::time::Instant::now();
        let (_connection, info) = PluginConnection::get_info(
            &path,
            socket,
            None,
            Timeouts::default(),
            &mut Sleep,
            OnInvalid::Notify,
            &StepTimer::default(),
        )
        .await
        .expect("answered, not taken for hung");
        assert_eq!(info.name, "late.example.com");
        assert!(
            asked.elapsed() > Timeouts::default().get_info,
            "answered after the request's own second: {:?}",
            asked.elapsed()
        );
    }

    #[test]
    fn an_http2_settings_frame_is_not_mistaken_for_garbage() {
        let peer = PeerBytes::default();
        assert!(!peer.heard());
        peer.record(&[0, 0, 18, SETTINGS, 0, 0, 0, 0, 0, 0, 3]);
        assert!(peer.heard());
        assert_eq!(peer.not_http2(), None);
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
