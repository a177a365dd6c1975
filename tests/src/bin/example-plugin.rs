//! `example-plugin`: a kubelet-compatible registration plugin with knobs for misbehaving.
//!
//! It serves `pluginregistration.Registration` on a Unix socket exactly as CSI node-driver-registrar,
//! device plugins and DRA drivers do, so the end-to-end tests drive the real `plugin-agent` binary
//! against a real plugin. Flags make it fail, hang, crash, bind before it serves, or speak no gRPC
//! at all, which is how the tests reach the agent's error paths. The plugin itself is
//! `plugin_agent_tests::fake_plugin` (shared with the in-process fakes); this file is its command
//! line, its event lines and its signals.
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
use plugin_agent_tests::fake_plugin::serve::{self, IdleLimited};
use plugin_agent_tests::fake_plugin::{FakePlugin, Faults, Heard, PluginInfo, socket};
use serde_json::json;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use tokio_stream::StreamExt as _;

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

/// A call of the registration API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Call {
    GetInfo,
    Notify,
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
    /// Abort when this call arrives (after printing it): a plugin crashing mid-registration, its
    /// socket left behind.
    #[arg(long, value_enum)]
    crash_on: Option<Call>,
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
    /// Exit (status 1, the socket left behind) once it has answered a `Notify(false)`, as
    /// node-driver-registrar does (`os.Exit(1)`): prints `{"event":"exiting"}` first.
    #[arg(long)]
    exit_on_notify_false: bool,
    /// The file mode creation mask to bind under, in octal (`0077`: a socket only its owner, or
    /// a process with `CAP_DAC_OVERRIDE`, can connect to).
    #[arg(long, value_parser = parse_octal)]
    umask: Option<u32>,
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

/// The event line of a call the plugin heard.
fn emit_heard(heard: Heard) {
    emit(match heard {
        Heard::GetInfo { peer_pid } => json!({"event": "get_info", "peer_pid": peer_pid}),
        Heard::GetInfoFailed { error } => json!({"event": "get_info_failed", "error": error}),
        Heard::Notify {
            status,
            refused,
            peer_pid,
        } => json!({
            "event": "notify",
            "registered": status.plugin_registered,
            "error": status.error,
            "refused": refused,
            "peer_pid": peer_pid,
        }),
    });
}

fn parse_octal(text: &str) -> Result<u32, std::num::ParseIntError> {
    u32::from_str_radix(text, 8)
}

/// Exits with status 1 shortly after a `Notify(false)` (its answer is sent first), without
/// removing the socket: what node-driver-registrar does when kubelet refuses it.
fn exit_after_notify_false(heard: &Heard) {
    let Heard::Notify { status, .. } = heard else {
        return;
    };
    if status.plugin_registered {
        return;
    }
    emit(json!({"event": "exiting", "error": status.error}));
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_millis(50));
        std::process::exit(1);
    });
}

/// The plugin the flags describe.
fn plugin(args: &Args) -> FakePlugin {
    let name = match args.huge_name_bytes {
        Some(bytes) => "n".repeat(bytes),
        None => args.name.clone(),
    };
    let supported_versions = match args.versions_count {
        Some(count) => (0..count).map(|i| format!("v{i}")).collect(),
        None => args.versions.clone(),
    };
    let info = PluginInfo {
        r#type: args.plugin_type.clone(),
        name,
        endpoint: args.endpoint.clone(),
        supported_versions,
    };
    FakePlugin::new(info)
        .get_info(Faults {
            crash: args.crash_on == Some(Call::GetInfo),
            hang: args.get_info_hang,
            delay: args.get_info_delay,
            delay_times: args.get_info_delay_times,
            error: args.get_info_error.clone(),
            error_times: args.get_info_error_times,
            ..Faults::default()
        })
        .notify(Faults {
            crash: args.crash_on == Some(Call::Notify),
            error: args.notify_error.clone(),
            error_times: args.notify_error_times,
            ..Faults::default()
        })
        .on_call({
            let exit = args.exit_on_notify_false;
            move |heard| {
                let stops = exit.then(|| heard.clone());
                emit_heard(heard);
                if let Some(heard) = stops {
                    exit_after_notify_false(&heard);
                }
            }
        })
}

/// Listens on the bound socket after `--listen-delay`, then serves after `--serve-delay`.
async fn run(args: Args, fd: OwnedFd, ino: u64) -> anyhow::Result<()> {
    use anyhow::Context;
    use tokio::signal::unix::{SignalKind, signal};
    if let Some(delay) = args.listen_delay {
        tokio::time::sleep(delay).await;
    }
    if args.listen_on_sigusr2 {
        let mut usr2 = signal(SignalKind::user_defined2())?;
        emit(json!({"event": "waiting_for_sigusr2"}));
        usr2.recv().await;
    }
    if args.listen_in_child {
        let bound = fd.try_clone().context("copy the bound socket")?;
        hand_off(bound, "--listen-in-child", &["--listen-inherited"]);
    }
    // An inherited listener is served as it is: listen() again would make this process the one
    // the socket's credentials name.
    if args.serve_fd.is_none() || args.listen_inherited {
        socket::listen(&fd, 128).context("listen")?;
    }
    if args.hand_off {
        let listening = fd.try_clone().context("copy the listener")?;
        let mut usr1 = signal(SignalKind::user_defined1())?;
        tokio::spawn(async move {
            usr1.recv().await;
            hand_off(listening, "--hand-off", &[]);
        });
    }
    let listener = socket::listener(fd).context("register listener")?;
    emit(json!({"event": "listening", "socket": args.socket.to_string_lossy(), "ino": ino}));
    if let Some(delay) = args.serve_delay {
        tokio::time::sleep(delay).await;
    }
    emit(
        json!({"event": "serving", "mode": format!("{:?}", args.mode), "pid": std::process::id()}),
    );
    let accepted = || emit(json!({"event": "accepted"}));
    match args.mode {
        Mode::Grpc => {
            let incoming: std::pin::Pin<
                Box<
                    dyn tokio_stream::Stream<Item = std::io::Result<tokio::net::UnixStream>> + Send,
                >,
            > = if args.serve_once {
                Box::pin(serve::one_connection(listener, || {
                    emit(json!({"event": "listener_closed"}))
                }))
            } else {
                Box::pin(tokio_stream::wrappers::UnixListenerStream::new(listener))
            };
            let idle = args.max_connection_idle;
            let idle_closed = || emit(json!({"event": "idle_close"}));
            let incoming = incoming.map(move |stream| {
                stream.map(|stream| IdleLimited::new(stream, idle, idle_closed))
            });
            let mut usr2 = signal(SignalKind::user_defined2())?;
            let closing = args.close_listener_on_sigusr2;
            let close = async move {
                if closing {
                    usr2.recv().await;
                } else {
                    std::future::pending::<()>().await;
                }
            };
            serve::grpc(incoming, plugin(&args), close)
                .await
                .context("gRPC server")?;
            // The listener is closed; the process lives on.
            emit(json!({"event": "listener_closed"}));
            std::future::pending::<()>().await;
        }
        Mode::NonGrpc => serve::garbage(listener, accepted).await.context("accept")?,
        Mode::AcceptSilent => serve::silent(listener, accepted).await.context("accept")?,
    }
    Ok(())
}

/// Hands `socket` to a copy of this plugin (its flags without `drop_flag`, with `extra`), says
/// so, and exits this process without removing the socket.
fn hand_off(socket: OwnedFd, drop_flag: &str, extra: &[&str]) {
    let args = std::env::args()
        .skip(1)
        .filter(|a| a != drop_flag)
        .chain(extra.iter().map(|a| a.to_string()))
        .collect::<Vec<_>>();
    match socket::hand_off(socket, &args) {
        Ok(child) => {
            emit(json!({"event": "handed_off", "child": child}));
            std::process::exit(0);
        }
        Err(e) => eprintln!("example-plugin: cannot start the child to hand off to: {e}"),
    }
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
    let path = args.socket.clone();
    runtime.block_on(async move {
        // Signal handlers first, so a SIGTERM sent right after start is not fatal.
        let stop = match stop_signal() {
            Ok(stop) => stop,
            Err(e) => {
                eprintln!("example-plugin: cannot install signal handlers: {e}");
                return ExitCode::FAILURE;
            }
        };
        if let Some(mask) = args.umask {
            nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(mask));
        }
        let bound = match args.serve_fd {
            // SAFETY: the parent handed this descriptor over for this process to own.
            Some(fd) => Ok(unsafe { socket::inherited(fd) }),
            None => socket::bind(&path),
        };
        let fd = match bound {
            Ok(fd) => fd,
            Err(e) => {
                eprintln!("example-plugin: bind {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
        };
        let ino = std::fs::symlink_metadata(&path).map_or(0, |m| m.ino());
        if args.serve_fd.is_none() {
            emit(json!({"event": "bound", "socket": path.to_string_lossy(), "ino": ino}));
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
        socket::remove_own(&path, ino);
        code
    })
}
