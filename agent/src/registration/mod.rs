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
//! - where the kernel reported the bind (eBPF), the executor starts the registration only once it
//!   reports the listen too, or after a few milliseconds without it (`executor::waits`);
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

mod error;
mod heard;
mod steps;
mod unary;

pub use error::PluginCallError;
pub use steps::{Step, StepTimer};

use crate::liveness::Server;
use crate::state::{EntryKind, SocketId};
use heard::{HeardStream, PeerBytes, heard};
use http::uri::PathAndQuery;
use plugin_agent_proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use std::io;
use std::os::fd::AsFd as _;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::UnixStream;
use tokio::time::Instant;
use tracing::{Instrument as _, info_span};
use unary::UnaryClient;

/// The `pluginregistration.Registration` methods (the package is the same for v1alpha1, v1beta1
/// and v1: kubelet's wire contract).
const GET_INFO: PathAndQuery =
    PathAndQuery::from_static("/pluginregistration.Registration/GetInfo");
const NOTIFY: PathAndQuery =
    PathAndQuery::from_static("/pluginregistration.Registration/NotifyRegistrationStatus");

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
            let mut client = handshake(socket, stream, budget_end, started).await?;
            let answer = match ask_info(&mut client, &peer, timeouts.get_info, waiting, steps).await
            {
                Ok(info) => {
                    let connection = PluginConnection {
                        client,
                        timeouts,
                        server,
                        steps: steps.clone(),
                    };
                    return connection.accepting(info, on_invalid).await;
                }
                Err(answer) => answer,
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

    /// This connection and `info` if `info` is valid; else the reason, which the plugin is told
    /// unless `on_invalid` is silent.
    async fn accepting(
        mut self,
        info: PluginInfo,
        on_invalid: OnInvalid,
    ) -> Result<(PluginConnection, PluginInfo), PluginCallError> {
        let Err(invalid) = validate_info(&info) else {
            return Ok((self, info));
        };
        if on_invalid == OnInvalid::Silent {
            return Err(invalid);
        }
        // As kubelet does for a plugin it refuses: say why, then back off.
        let told = Box::pin(
            self.notify(false, &invalid.to_string())
                .instrument(info_span!("NotifyRegistrationStatus", registered = false)),
        )
        .await;
        if let Err(e) = told {
            tracing::debug!(error = %e, "could not tell the plugin its PluginInfo is invalid");
        }
        Err(invalid)
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

/// The HTTP/2 connection over a dialled `stream`, within the dial budget.
///
/// The HTTP/2 steps are boxed: until a peer accepts, the attempt's future stays small (a dial that
/// waits for a bound-but-not-serving socket, or for a stale one until its budget ends, costs a few
/// hundred bytes instead of the connection's kilobytes).
async fn handshake(
    socket: &Path,
    stream: HeardStream,
    budget_end: Instant,
    started: Instant,
) -> Result<UnaryClient<HeardStream>, PluginCallError> {
    let remaining = budget_end.saturating_duration_since(Instant::now());
    match Box::pin(tokio::time::timeout(
        remaining,
        UnaryClient::handshake(stream, MAX_MESSAGE_BYTES),
    ))
    .await
    {
        Ok(Ok(client)) => Ok(client),
        Ok(Err(e)) => Err(dial_error(
            socket,
            format!("HTTP/2 connection: {e}"),
            started,
        )),
        Err(_) => Err(dial_error(
            socket,
            "HTTP/2 connection timed out".into(),
            started,
        )),
    }
}

/// One `GetInfo` call on `client`, its second counted from the peer's first bytes (see the module
/// docs); `waiting` hears when the answer is slow.
async fn ask_info(
    client: &mut UnaryClient<HeardStream>,
    peer: &PeerBytes,
    within: Duration,
    waiting: &mut dyn Pause,
    steps: &StepTimer,
) -> Result<PluginInfo, PluginCallError> {
    let span = info_span!("GetInfo");
    let asked = Instant::now();
    let call = client.call::<_, PluginInfo>(GET_INFO, &InfoRequest {}, within);
    let called =
        Box::pin(answer_within(call, peer, within, waiting).instrument(span.clone())).await;
    span.in_scope(|| {
        steps.record(
            Step::GetInfo,
            asked.elapsed(),
            matches!(called, Some(Ok(_))),
        )
    });
    match called {
        Some(Ok(info)) => Ok(info),
        // The plugin's server enforcing the deadline the call carries (`grpc-timeout`), when its
        // status lands before the agent's own timer: the same missed deadline (a just-started
        // plugin then gets its quick retry, whichever side noticed first).
        Some(Err(unary::CallError::Status {
            code: tonic::Code::Cancelled | tonic::Code::DeadlineExceeded,
            ..
        })) if asked.elapsed() >= within => Err(PluginCallError::GetInfoTimeout(within)),
        Some(Err(e)) => Err(PluginCallError::GetInfo(e.to_string())),
        None => Err(PluginCallError::GetInfoTimeout(within)),
    }
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
        denied: false,
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
            io::ErrorKind::PermissionDenied => {
                return Err(PluginCallError::Dial {
                    path: socket.to_path_buf(),
                    reason: error.to_string(),
                    elapsed: started.elapsed(),
                    denied: true,
                });
            }
            _ => return Err(dial_error(socket, error.to_string(), started)),
        }
    }
}

/// Waits for `call`'s answer for `deadline`, counted from the request or, when the peer only
/// began to speak meanwhile, from its first bytes: a gRPC server speaks first (its SETTINGS), so
/// one that starts serving while the request waits in its socket gets the whole `deadline` to
/// answer, and only a server that spoke and then left the request unanswered that long is hung.
/// (Counted from the request alone, a plugin that began serving just before the deadline was
/// taken for a hung one.) `waiting` is told when the answer has taken [`SLOW_ANSWER`]. `None`:
/// no answer by the deadline.
///
/// One timer, moved from one deadline to the next (a timeout for each cost a timer wheel entry
/// each, on every `GetInfo`).
async fn answer_within<F: std::future::Future>(
    call: F,
    peer: &PeerBytes,
    deadline: Duration,
    waiting: &mut dyn Pause,
) -> Option<F::Output> {
    let mut call = std::pin::pin!(call);
    let asked = Instant::now();
    let mut end = asked + deadline;
    // Until `waiting` is told.
    let mut slow = Some(asked + SLOW_ANSWER);
    let next = |end: Instant, slow: Option<Instant>| slow.map_or(end, |slow| slow.min(end));
    let mut timer = std::pin::pin!(tokio::time::sleep_until(next(end, slow)));
    loop {
        tokio::select! {
            biased;
            answer = &mut call => return Some(answer),
            () = &mut timer => {}
        }
        let reached = timer.deadline();
        if reached >= end {
            match peer.heard_at() {
                Some(heard) if heard + deadline > end => end = heard + deadline,
                _ => return None,
            }
        }
        if slow.is_some_and(|slow| reached >= slow) {
            waiting.answer_slow();
            slow = None;
        }
        timer.as_mut().reset(next(end, slow));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts what an attempt tells its pauses.
    #[derive(Default)]
    struct Told {
        slow: usize,
    }

    impl Pause for Told {
        fn pause(
            &mut self,
            duration: Duration,
        ) -> Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
            Box::pin(tokio::time::sleep(duration))
        }
        fn answer_slow(&mut self) {
            self.slow += 1;
        }
    }

    /// No answer: the deadline ends the wait, its second counted from the peer's first bytes
    /// when they came later than the request; the slow answer is told once, at its quarter.
    #[tokio::test(start_paused = true)]
    async fn get_info_waits_a_deadline_from_the_request_or_the_first_bytes_and_tells_when_slow() {
        let deadline = Duration::from_secs(1);
        let silent = PeerBytes::default();
        let mut told = Told::default();
        let asked = Instant::now();
        let answer = answer_within(std::future::pending::<()>(), &silent, deadline, &mut told);
        assert_eq!(answer.await, None);
        assert_eq!((asked.elapsed(), told.slow), (deadline, 1));

        let late = Arc::new(PeerBytes::default());
        let speaks = late.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(700)).await;
            speaks.record(&[0, 0, 0, 4]);
        });
        let mut told = Told::default();
        let asked = Instant::now();
        let answer = answer_within(std::future::pending::<()>(), &late, deadline, &mut told);
        assert_eq!(answer.await, None);
        assert_eq!(asked.elapsed(), Duration::from_millis(1700));
        assert_eq!(told.slow, 1);

        let mut told = Told::default();
        let quick = tokio::time::sleep(Duration::from_millis(100));
        let answer = answer_within(quick, &silent, deadline, &mut told).await;
        assert_eq!((answer, told.slow), (Some(()), 0));
    }

    /// A plugin whose server starts 700 ms after the agent's `GetInfo` waits in its socket, and
    /// answers 600 ms after that: 1.3 s after the request, 0.6 s after it first spoke. It is not
    /// hung: it gets its second from its first word. (Counted from the request, the attempt
    /// failed at 1 s with "GetInfo: no answer within 1s".)
    #[tokio::test]
    async fn a_plugin_that_starts_serving_late_in_the_get_info_window_gets_its_whole_second() {
        use plugin_agent_tests::fake_plugin::{FakePlugin, Faults, serve};

        let versions = ["1.0.0".to_string()];
        let late = FakePlugin::new(FakePlugin::info("CSIPlugin", "late.example.com", &versions))
            .get_info(Faults {
                delay: Some(Duration::from_millis(600)),
                ..Faults::default()
            });
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("late.sock");
        // Listening from the start (the agent's connection waits in the backlog), serving later.
        let listener = tokio::net::UnixListener::bind(&path).expect("bind");
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(700)).await;
            let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
            serve::grpc(incoming, late, std::future::pending()).await
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
}
