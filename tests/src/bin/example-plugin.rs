//! `example-plugin`: a kubelet-compatible registration plugin with knobs for misbehaving.
//!
//! It serves `pluginregistration.Registration` on a Unix socket exactly as CSI node-driver-registrar,
//! device plugins and DRA drivers do, so the end-to-end tests drive the real `plugin-agent` binary
//! against a real plugin. Flags make it fail, hang, bind before it serves, or speak no gRPC at all,
//! which is how the tests reach the agent's error paths.
//!
//! It prints one JSON object per event on stdout (flushed at once), which the test harness reads:
//! `{"event":"bound"}`, `{"event":"listening","socket":..,"ino":..}`, `{"event":"serving"}`,
//! `{"event":"get_info","peer_pid":..}`,
//! `{"event":"notify","registered":..,"error":..,"refused":..,"peer_pid":..}` (the caller's pid),
//! `{"event":"accepted"}` (raw modes), `{"event":"idle_close"}` (`--max-connection-idle`),
//! `{"event":"handed_off","child":..}` (`--hand-off`), `{"event":"stopped"}`; every line also
//! carries `at_ns`, the wall-clock time it was printed.
//!
//! With `--hand-off`, SIGUSR1 makes it hand its listening socket to a child process (a copy of
//! itself that serves the inherited descriptor without calling `listen()` again, as a
//! socket-activated service does) and exit without removing the socket: the listener outlives
//! the process that created it, and the socket's credentials still name the exited parent.
//!
//! With `--listen-in-child` it binds the socket and has a copy of itself `listen()` on it and
//! serve it, then exits: the socket's creator and its server are different processes.
//!
//! On SIGTERM or SIGINT it removes its socket (only if the path still holds the socket it bound, so
//! a plugin that replaced it keeps its own) and exits 0, as real plugins do.

use clap::{Parser, ValueEnum};
use nix::sys::socket::{
    AddressFamily, Backlog, SockFlag, SockType, UnixAddr, bind, listen, socket,
};
use plugin_agent_proto::pluginregistration::registration_server::{
    Registration, RegistrationServer,
};
use plugin_agent_proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use serde_json::json;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;

/// What the plugin does with connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// Serve the registration API (the normal case).
    Grpc,
    /// Write bytes that are not HTTP/2 and close each connection.
    NonGrpc,
    /// Accept connections and never read or write.
    AcceptSilent,
}

/// Command line of the example plugin.
#[derive(Parser, Debug)]
#[command(
    name = "example-plugin",
    about = "A kubelet registration plugin with knobs for misbehaving"
)]
struct Args {
    /// Registration socket to create (parent directories are created, an old socket is replaced).
    #[arg(long)]
    socket: PathBuf,
    /// `PluginInfo.type`.
    #[arg(long = "type", default_value = "CSIPlugin")]
    plugin_type: String,
    /// `PluginInfo.name`.
    #[arg(long, default_value = "example.plugin.test")]
    name: String,
    /// `PluginInfo.endpoint` (empty: the agent uses the socket path).
    #[arg(long, default_value = "")]
    endpoint: String,
    /// `PluginInfo.supported_versions`, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1.0.0")]
    versions: Vec<String>,
    /// Answer GetInfo with this error (status UNKNOWN).
    #[arg(long)]
    get_info_error: Option<String>,
    /// Fail only the first N GetInfo calls (with `--get-info-error`), then answer normally.
    #[arg(long)]
    get_info_error_times: Option<u32>,
    /// Never answer GetInfo.
    #[arg(long)]
    get_info_hang: bool,
    /// Wait this long before answering GetInfo.
    #[arg(long, value_parser = humantime::parse_duration)]
    get_info_delay: Option<Duration>,
    /// Delay only the first N GetInfo answers (with `--get-info-delay`), then answer at once.
    #[arg(long)]
    get_info_delay_times: Option<u32>,
    /// Answer NotifyRegistrationStatus with this error (status UNKNOWN).
    #[arg(long)]
    notify_error: Option<String>,
    /// Fail only the first N NotifyRegistrationStatus calls (with `--notify-error`).
    #[arg(long)]
    notify_error_times: Option<u32>,
    /// Keep the socket bound but not listening this long (connections are refused meanwhile).
    #[arg(long, value_parser = humantime::parse_duration)]
    listen_delay: Option<Duration>,
    /// Keep the socket listening but not served this long (connections wait in the backlog).
    #[arg(long, value_parser = humantime::parse_duration)]
    serve_delay: Option<Duration>,
    /// Answer GetInfo with a name of this many bytes (instead of `--name`).
    #[arg(long)]
    huge_name_bytes: Option<usize>,
    /// Announce this many supported versions (instead of `--versions`).
    #[arg(long)]
    versions_count: Option<usize>,
    /// What to do with connections.
    #[arg(long, value_enum, default_value_t = Mode::Grpc)]
    mode: Mode,
    /// Close a connection after this long without a byte from the client, as gRPC-Go servers
    /// with `MaxConnectionIdle` (or a proxy's idle timeout) do.
    #[arg(long, value_parser = humantime::parse_duration)]
    max_connection_idle: Option<Duration>,
    /// On SIGUSR1, hand the listening socket to a child process and exit (see the module docs).
    #[arg(long)]
    hand_off: bool,
    /// Keep the socket bound but not listening until SIGUSR2 (connections are refused meanwhile).
    #[arg(long)]
    listen_on_sigusr2: bool,
    /// On SIGUSR2, close the listening socket and keep running (a server whose listener died
    /// while its process lives on); prints `{"event":"listener_closed"}`.
    #[arg(long)]
    close_listener_on_sigusr2: bool,
    /// Bind the socket, then have a child process listen on it and serve it, and exit: the
    /// socket's creator (this process) is not its server (the child), as with a launcher that
    /// binds for a service it starts. Prints `handed_off` with the child's pid.
    #[arg(long)]
    listen_in_child: bool,
    /// Accept one connection, serve it, then close the listener and live on (a plugin that
    /// expects exactly one caller: kubelet); prints `listener_closed`.
    #[arg(long)]
    serve_once: bool,
    /// Serve the listening socket inherited as this descriptor (the child of `--hand-off`).
    #[arg(long, hide = true)]
    serve_fd: Option<i32>,
    /// The descriptor of `--serve-fd` is bound but not listening yet: call `listen()` on it (the
    /// child of `--listen-in-child`).
    #[arg(long, hide = true)]
    listen_inherited: bool,
}

/// Prints one event line and flushes it, so the harness sees it at once. A closed stdout is not
/// a reason to stop serving.
fn emit(mut event: serde_json::Value) {
    // When it happened (wall clock, ns), for load generators that time plugins from outside.
    let at_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    if let Some(fields) = event.as_object_mut() {
        fields.insert("at_ns".into(), at_ns.into());
    }
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{event}");
    let _ = out.flush();
}

/// Counts down the failures a flag asked for: `None` means "always fail".
#[derive(Debug)]
struct FailBudget(Mutex<Option<u32>>);

impl FailBudget {
    /// True if this call should fail.
    fn take(&self) -> bool {
        let mut left = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match left.as_mut() {
            None => true,
            Some(0) => false,
            Some(n) => {
                *n -= 1;
                true
            }
        }
    }
}

/// The registration service with its configured behaviour.
struct ExamplePlugin {
    info: PluginInfo,
    get_info_error: Option<(String, FailBudget)>,
    get_info_hang: bool,
    get_info_delay: Option<(Duration, FailBudget)>,
    notify_error: Option<(String, FailBudget)>,
}

#[tonic::async_trait]
impl Registration for ExamplePlugin {
    async fn get_info(
        &self,
        request: tonic::Request<InfoRequest>,
    ) -> Result<tonic::Response<PluginInfo>, tonic::Status> {
        emit(json!({"event": "get_info", "peer_pid": peer_pid(&request)}));
        if self.get_info_hang {
            std::future::pending::<()>().await;
        }
        if let Some((delay, budget)) = &self.get_info_delay
            && budget.take()
        {
            tokio::time::sleep(*delay).await;
        }
        if let Some((message, budget)) = &self.get_info_error
            && budget.take()
        {
            emit(json!({"event": "get_info_failed", "error": message}));
            return Err(tonic::Status::unknown(message.clone()));
        }
        Ok(tonic::Response::new(self.info.clone()))
    }

    async fn notify_registration_status(
        &self,
        request: tonic::Request<RegistrationStatus>,
    ) -> Result<tonic::Response<RegistrationStatusResponse>, tonic::Status> {
        let peer = peer_pid(&request);
        let status = request.into_inner();
        let refuse = self
            .notify_error
            .as_ref()
            .filter(|(_, budget)| budget.take());
        emit(json!({
            "event": "notify",
            "registered": status.plugin_registered,
            "error": status.error,
            "refused": refuse.is_some(),
            "peer_pid": peer,
        }));
        match refuse {
            Some((message, _)) => Err(tonic::Status::unknown(message.clone())),
            None => Ok(tonic::Response::new(RegistrationStatusResponse {})),
        }
    }
}

impl ExamplePlugin {
    fn from_args(args: &Args) -> Self {
        let name = match args.huge_name_bytes {
            Some(bytes) => "n".repeat(bytes),
            None => args.name.clone(),
        };
        let supported_versions = match args.versions_count {
            Some(count) => (0..count).map(|i| format!("v{i}")).collect(),
            None => args.versions.clone(),
        };
        let budget = |times: Option<u32>| FailBudget(Mutex::new(times));
        ExamplePlugin {
            info: PluginInfo {
                r#type: args.plugin_type.clone(),
                name,
                endpoint: args.endpoint.clone(),
                supported_versions,
            },
            get_info_error: args
                .get_info_error
                .clone()
                .map(|m| (m, budget(args.get_info_error_times))),
            get_info_hang: args.get_info_hang,
            get_info_delay: args
                .get_info_delay
                .map(|d| (d, budget(args.get_info_delay_times))),
            notify_error: args
                .notify_error
                .clone()
                .map(|m| (m, budget(args.notify_error_times))),
        }
    }
}

/// Binds the socket (replacing an old socket at the path, as real plugins do) without listening.
fn bind_socket(path: &Path) -> anyhow::Result<std::os::fd::OwnedFd> {
    use anyhow::Context;
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).with_context(|| format!("create {}", parent.display()))?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(path)
            .with_context(|| format!("remove old socket {}", path.display()))?,
        Ok(_) => anyhow::bail!("{} exists and is not a socket", path.display()),
        Err(_) => {}
    }
    let fd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .context("socket")?;
    let addr = UnixAddr::new(path).with_context(|| format!("socket address {}", path.display()))?;
    bind(fd.as_raw_fd(), &addr).with_context(|| format!("bind {}", path.display()))?;
    Ok(fd)
}

/// Listens on the bound socket after `--listen-delay`, then serves after `--serve-delay`.
async fn run(args: Args, fd: std::os::fd::OwnedFd, ino: u64) -> anyhow::Result<()> {
    use anyhow::Context;
    if let Some(delay) = args.listen_delay {
        tokio::time::sleep(delay).await;
    }
    if args.listen_on_sigusr2 {
        let mut usr2 =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined2())?;
        emit(json!({"event": "waiting_for_sigusr2"}));
        usr2.recv().await;
    }
    if args.listen_in_child {
        let inheritable = nix::unistd::dup(&fd).context("dup the bound socket")?;
        start_copy(inheritable, "--listen-in-child", &["--listen-inherited"]);
    }
    // An inherited listener is served as it is: listen() again would make this process the one
    // the socket's credentials name.
    if args.serve_fd.is_none() || args.listen_inherited {
        let backlog = Backlog::new(128).context("backlog")?;
        listen(&fd, backlog).context("listen")?;
    }
    if args.hand_off {
        let inheritable = nix::unistd::dup(&fd).context("dup the listener")?;
        let handed = hand_off_on_sigusr1(inheritable)?;
        tokio::spawn(handed);
    }
    let listener = std::os::unix::net::UnixListener::from(fd);
    listener.set_nonblocking(true).context("set_nonblocking")?;
    let listener = UnixListener::from_std(listener).context("register listener")?;
    emit(json!({"event": "listening", "socket": args.socket.to_string_lossy(), "ino": ino}));
    if let Some(delay) = args.serve_delay {
        tokio::time::sleep(delay).await;
    }
    emit(
        json!({"event": "serving", "mode": format!("{:?}", args.mode), "pid": std::process::id()}),
    );
    match args.mode {
        Mode::Grpc => {
            use tokio_stream::StreamExt as _;
            let service = RegistrationServer::new(ExamplePlugin::from_args(&args));
            let idle = args.max_connection_idle;
            let incoming: std::pin::Pin<
                Box<
                    dyn tokio_stream::Stream<Item = std::io::Result<tokio::net::UnixStream>> + Send,
                >,
            > = if args.serve_once {
                Box::pin(one_connection(listener))
            } else {
                Box::pin(UnixListenerStream::new(listener))
            };
            let incoming =
                incoming.map(move |stream| stream.map(|stream| IdleLimited::new(stream, idle)));
            let closing = args.close_listener_on_sigusr2;
            let mut usr2 =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined2())?;
            let close = async move {
                if closing {
                    usr2.recv().await;
                } else {
                    std::future::pending::<()>().await;
                }
            };
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(incoming, close)
                .await
                .context("gRPC server")?;
            // The listener is closed; the process lives on.
            emit(json!({"event": "listener_closed"}));
            std::future::pending::<()>().await;
        }
        Mode::NonGrpc => loop {
            let (mut stream, _) = listener.accept().await.context("accept")?;
            emit(json!({"event": "accepted"}));
            let _ = stream
                .write_all(b"HELLO this is not HTTP/2\r\n\r\n\x00\x01garbage")
                .await;
            let _ = stream.shutdown().await;
        },
        Mode::AcceptSilent => {
            let mut held = Vec::new();
            loop {
                let (stream, _) = listener.accept().await.context("accept")?;
                emit(json!({"event": "accepted"}));
                held.push(stream);
            }
        }
    }
    Ok(())
}

/// The first connection accepted on `listener`, which is then closed (`listener_closed`); the
/// stream stays open, so the server goes on serving that connection until its client is done.
fn one_connection(
    listener: UnixListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::UnixStream>> {
    futures::stream::unfold(Some(listener), |listener| async move {
        let Some(listener) = listener else {
            return std::future::pending().await;
        };
        let accepted = listener.accept().await.map(|(stream, _)| stream);
        drop(listener);
        emit(json!({"event": "listener_closed"}));
        Some((accepted, None))
    })
}

/// A served connection that ends (reads end-of-file, so the server closes it) after its limit
/// without a byte from the client; no limit: the plain stream.
struct IdleLimited {
    inner: tokio::net::UnixStream,
    limit: Option<(Duration, std::pin::Pin<Box<tokio::time::Sleep>>)>,
}

impl IdleLimited {
    fn new(inner: tokio::net::UnixStream, limit: Option<Duration>) -> IdleLimited {
        let limit = limit.map(|d| (d, Box::pin(tokio::time::sleep(d))));
        IdleLimited { inner, limit }
    }
}

impl tokio::io::AsyncRead for IdleLimited {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::future::Future as _;
        let this = &mut *self;
        if let Some((_, deadline)) = this.limit.as_mut()
            && deadline.as_mut().poll(cx).is_ready()
        {
            emit(json!({"event": "idle_close"}));
            this.limit = None;
            let _ = nix::sys::socket::shutdown(
                this.inner.as_raw_fd(),
                nix::sys::socket::Shutdown::Both,
            );
            return std::task::Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let read = std::pin::Pin::new(&mut this.inner).poll_read(cx, buf);
        if let (std::task::Poll::Ready(Ok(())), Some((limit, deadline))) =
            (&read, this.limit.as_mut())
            && buf.filled().len() > before
        {
            deadline
                .as_mut()
                .reset(tokio::time::Instant::now() + *limit);
        }
        read
    }
}

impl tokio::io::AsyncWrite for IdleLimited {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for IdleLimited {
    type ConnectInfo = tonic::transport::server::UdsConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

/// The pid of the process on the other end of `request`'s connection (`SO_PEERCRED`), so a test
/// with two agents on one directory can tell whose call it was.
fn peer_pid<T>(request: &tonic::Request<T>) -> Option<i32> {
    request
        .extensions()
        .get::<tonic::transport::server::UdsConnectInfo>()
        .and_then(|info| info.peer_cred)
        .and_then(|cred| cred.pid())
}

/// Installs the SIGTERM and SIGINT handlers now and returns a future that resolves on either.
fn stop_signal() -> std::io::Result<impl std::future::Future<Output = &'static str>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        }
    })
}

/// Installs the SIGUSR1 handler now; returns the task that, on SIGUSR1, starts a copy of this
/// plugin serving `listener` (a descriptor without close-on-exec) and exits this process
/// without removing the socket.
fn hand_off_on_sigusr1(
    listener: std::os::fd::OwnedFd,
) -> anyhow::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut usr1 = signal(SignalKind::user_defined1())?;
    Ok(async move {
        usr1.recv().await;
        start_copy(listener, "--hand-off", &[]);
    })
}

/// Starts a copy of this plugin (without `drop_flag`, with `extra`) serving `socket` (a
/// descriptor without close-on-exec), says so, and exits this process without removing the
/// socket.
fn start_copy(socket: std::os::fd::OwnedFd, drop_flag: &str, extra: &[&str]) {
    let exe = std::env::current_exe().unwrap_or_else(|_| "example-plugin".into());
    let args = std::env::args()
        .skip(1)
        .filter(|a| a != drop_flag)
        .collect::<Vec<_>>();
    let child = std::process::Command::new(exe)
        .args(args)
        .args(extra)
        .arg("--serve-fd")
        .arg(socket.as_raw_fd().to_string())
        .spawn();
    match child {
        Ok(child) => {
            emit(json!({"event": "handed_off", "child": child.id()}));
            std::process::exit(0);
        }
        Err(e) => eprintln!("example-plugin: cannot start the child to hand off to: {e}"),
    }
}

/// Removes the socket if the path still holds the one this process bound.
fn remove_own_socket(path: &Path, ino: u64) {
    if let Ok(meta) = std::fs::symlink_metadata(path)
        && meta.file_type().is_socket()
        && meta.ino() == ino
    {
        let _ = std::fs::remove_file(path);
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("example-plugin: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let socket = args.socket.clone();
    runtime.block_on(async move {
        // Signal handlers first, so a SIGTERM sent right after start is not fatal.
        let stop = match stop_signal() {
            Ok(stop) => stop,
            Err(e) => {
                eprintln!("example-plugin: cannot install signal handlers: {e}");
                return ExitCode::FAILURE;
            }
        };
        let bound = match args.serve_fd {
            // SAFETY: the parent handed this descriptor over for this process to own.
            Some(fd) => {
                Ok(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
            }
            None => bind_socket(&socket),
        };
        let fd = match bound {
            Ok(fd) => fd,
            Err(e) => {
                eprintln!("example-plugin: {e:#}");
                return ExitCode::FAILURE;
            }
        };
        let ino = std::fs::symlink_metadata(&socket)
            .map(|m| m.ino())
            .unwrap_or(0);
        if args.serve_fd.is_none() {
            emit(json!({"event": "bound", "socket": socket.to_string_lossy(), "ino": ino}));
        }
        let code = tokio::select! {
            signal = stop => {
                emit(json!({"event": "stopped", "signal": signal}));
                ExitCode::SUCCESS
            }
            result = run(args, fd, ino) => match result {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("example-plugin: {e:#}");
                    ExitCode::FAILURE
                }
            },
        };
        remove_own_socket(&socket, ino);
        code
    })
}
