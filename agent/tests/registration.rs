//! The plugin client against real tonic servers on real Unix sockets: kubelet's Notify semantics,
//! its timeouts, the bounded answer size, and plugins that bind or listen before they serve.

use plugin_agent::registration::{
    OnInvalid, Pause, PluginCallError, PluginConnection, Sleep, StepTimer, Timeouts,
};
use plugin_agent::state::{EntryKind, SocketId};
use plugin_agent_tests::fake_plugin::serve::Served;
use plugin_agent_tests::fake_plugin::{FakePlugin, Faults, PluginInfo};
use std::path::Path;
use std::time::Duration;

/// A CSI plugin called `name` announcing `versions` supported versions.
fn info(name: &str, versions: usize) -> PluginInfo {
    let versions: Vec<String> = (0..versions).map(|i| format!("1.{i}.0")).collect();
    FakePlugin::info("CSIPlugin", name, &versions)
}

/// A well-behaved CSI plugin called `name`.
fn plugin(name: &str) -> FakePlugin {
    FakePlugin::new(info(name, 1))
}

/// Serves `plugin` on `listener` until the handle is dropped.
fn serve(listener: tokio::net::UnixListener, plugin: FakePlugin) -> Served {
    Served::spawn(listener, plugin)
}

fn identity(path: &Path) -> SocketId {
    match EntryKind::of(path).expect("stat socket") {
        EntryKind::Socket(id) => id,
        other => panic!("not a socket: {other:?}"),
    }
}

fn fast() -> Timeouts {
    Timeouts {
        dial: Duration::from_secs(5),
        listen: Duration::from_secs(5),
        get_info: Duration::from_millis(300),
        notify: Duration::from_secs(2),
    }
}

#[tokio::test]
async fn notify_registered_true_is_ok_and_plugin_error_is_reported() {
    let dir = tempfile::tempdir().expect("dir");
    let ok = dir.path().join("ok.sock");
    let _stop = serve(
        tokio::net::UnixListener::bind(&ok).expect("bind"),
        plugin("ok"),
    );
    let (mut connection, info) = PluginConnection::get_info(
        &ok,
        identity(&ok),
        None,
        fast(),
        &mut Sleep,
        OnInvalid::Notify,
        &StepTimer::default(),
    )
    .await
    .expect("GetInfo");
    assert_eq!(info.name, "ok");
    connection.notify(true, "").await.expect("notify true");

    let failing = dir.path().join("failing.sock");
    let plugin = plugin("f").notify(Faults::error("disk full"));
    let _stop2 = serve(
        tokio::net::UnixListener::bind(&failing).expect("bind"),
        plugin,
    );
    let (mut connection, _) = PluginConnection::get_info(
        &failing,
        identity(&failing),
        None,
        fast(),
        &mut Sleep,
        OnInvalid::Notify,
        &StepTimer::default(),
    )
    .await
    .expect("GetInfo");
    match connection.notify(false, "rejected").await {
        Err(PluginCallError::Notify(message)) => {
            assert!(message.contains("disk full"), "{message}")
        }
        other => panic!("expected the plugin's error, got {other:?}"),
    }
}

#[tokio::test]
async fn notify_transport_error_is_wrapped() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("p.sock");
    let stop = serve(
        tokio::net::UnixListener::bind(&path).expect("bind"),
        plugin("p"),
    );
    let (mut connection, _) = PluginConnection::get_info(
        &path,
        identity(&path),
        None,
        fast(),
        &mut Sleep,
        OnInvalid::Notify,
        &StepTimer::default(),
    )
    .await
    .expect("GetInfo");
    stop.stop();
    // Wait for the server to close the connection; then Notify has no transport.
    let mut result = connection.notify(true, "").await;
    for _ in 0..50 {
        if result.is_err() {
            break;
        }
        tokio::task::yield_now().await;
        result = connection.notify(true, "").await;
    }
    assert!(
        matches!(result, Err(PluginCallError::Notify(_))),
        "got {result:?}"
    );
}

#[tokio::test]
async fn plugin_bound_before_listening_is_reached_once_it_listens() {
    use nix::sys::socket::{
        AddressFamily, Backlog, SockFlag, SockType, UnixAddr, bind, listen, socket,
    };
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("late.sock");
    let fd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )
    .expect("socket");
    bind(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &UnixAddr::new(&path).expect("addr"),
    )
    .expect("bind");
    let id = identity(&path);
    let attempt = tokio::spawn({
        let path = path.clone();
        async move {
            PluginConnection::get_info(
                &path,
                id,
                None,
                fast(),
                &mut Sleep,
                OnInvalid::Notify,
                &StepTimer::default(),
            )
            .await
        }
    });
    // The client is now getting ECONNREFUSED; start listening and serving.
    tokio::task::yield_now().await;
    listen(&fd, Backlog::new(16).expect("backlog")).expect("listen");
    let listener = tokio::net::UnixListener::from_std(std::os::unix::net::UnixListener::from(fd))
        .expect("listener");
    let _stop = serve(listener, plugin("late"));
    let (_, info) = attempt.await.expect("join").expect("GetInfo after listen");
    assert_eq!(info.name, "late");
}

#[tokio::test]
async fn a_socket_refusing_connections_hands_its_wait_back_then_is_not_listening_at_its_end() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&path).expect("bind, then close"));
    let wait = |listen| Timeouts { listen, ..fast() };
    let started = tokio::time::Instant::now();
    // Within its wait: a few quick retries, then the wait is the caller's (no attempt is held
    // open through it).
    let within = PluginConnection::get_info(
        &path,
        identity(&path),
        None,
        wait(Duration::from_secs(5)),
        &mut Sleep,
        OnInvalid::Notify,
        &StepTimer::default(),
    )
    .await;
    match within {
        Err(PluginCallError::NotListeningYet { until, .. }) => {
            assert!(
                until >= started + Duration::from_secs(5),
                "the wait's end is the caller's listen wait"
            );
            assert!(
                started.elapsed() < Duration::from_secs(1),
                "the attempt waited for the listen itself"
            );
        }
        other => panic!("got {:?}", other.map(|(_, info)| info)),
    }
    // At its end (what the caller passes then): not listening.
    let at_end = PluginConnection::get_info(
        &path,
        identity(&path),
        None,
        wait(Duration::ZERO),
        &mut Sleep,
        OnInvalid::Notify,
        &StepTimer::default(),
    )
    .await;
    assert!(
        matches!(at_end, Err(PluginCallError::NotListening { .. })),
        "got {:?}",
        at_end.map(|(_, info)| info)
    );
}

/// A look that found the socket listening hands its connection to the attempt, which asks on
/// it: a plugin that serves exactly one connection is not robbed of it by the look.
#[tokio::test]
async fn a_connection_already_made_is_the_one_asked() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("once.sock");
    let listener = tokio::net::UnixListener::bind(&path).expect("bind");
    let looked = tokio::net::UnixStream::connect(&path)
        .await
        .expect("the look's connect");
    // Serves the first connection in its queue (the look's), and no other: the listener closes.
    let (accepted, _) = listener.accept().await.expect("accept");
    drop(listener);
    let _stop = Served::spawn_on_connection(accepted, plugin("once"));
    let (_, info) = PluginConnection::get_info(
        &path,
        identity(&path),
        Some(looked),
        fast(),
        &mut Sleep,
        OnInvalid::Notify,
        &StepTimer::default(),
    )
    .await
    .expect("answered on the look's connection");
    assert_eq!(info.name, "once");
}

#[tokio::test]
async fn the_connection_names_the_process_that_serves_the_socket() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("served.sock");
    let _stop = serve(
        tokio::net::UnixListener::bind(&path).expect("bind"),
        plugin("served"),
    );
    let (mut connection, _) = PluginConnection::get_info(
        &path,
        identity(&path),
        None,
        fast(),
        &mut Sleep,
        OnInvalid::Notify,
        &StepTimer::default(),
    )
    .await
    .expect("GetInfo");
    let server = connection.take_server().expect("credentials read");
    assert_eq!(server.pid, Some(std::process::id()));
    assert_eq!(server.uid, nix::unistd::getuid().as_raw());
    assert!(server.watchable(), "a pidfd for a live server");
}

#[tokio::test]
async fn plugin_listening_but_not_yet_serving_is_answered_when_it_serves() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("slow.sock");
    let listener = tokio::net::UnixListener::bind(&path).expect("bind");
    let id = identity(&path);
    let attempt = tokio::spawn({
        let path = path.clone();
        async move {
            PluginConnection::get_info(
                &path,
                id,
                None,
                fast(),
                &mut Sleep,
                OnInvalid::Notify,
                &StepTimer::default(),
            )
            .await
        }
    });
    // Serve only after more than one GetInfo deadline (300 ms) has passed.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let _stop = serve(listener, plugin("slow"));
    let (_, info) = attempt.await.expect("join").expect("GetInfo once serving");
    assert_eq!(info.name, "slow");
}

#[tokio::test]
async fn hung_get_info_fails_after_its_deadline() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("hung.sock");
    let plugin = plugin("hung").get_info(Faults::hang());
    let _stop = serve(tokio::net::UnixListener::bind(&path).expect("bind"), plugin);
    let started = tokio::time::Instant::now();
    let result = PluginConnection::get_info(
        &path,
        identity(&path),
        None,
        fast(),
        &mut Sleep,
        OnInvalid::Notify,
        &StepTimer::default(),
    )
    .await;
    assert!(
        matches!(result, Err(PluginCallError::GetInfoTimeout(_))),
        "got {:?}",
        result.err()
    );
    assert!(
        started.elapsed() < fast().dial,
        "a serving but hung plugin must fail on the GetInfo deadline"
    );
}

#[tokio::test]
async fn oversized_or_unreasonable_plugin_info_is_rejected() {
    let dir = tempfile::tempdir().expect("dir");
    let huge = dir.path().join("huge.sock");
    let plugin = FakePlugin::new(info(&"x".repeat(100 * 1024), 1));
    let _stop = serve(tokio::net::UnixListener::bind(&huge).expect("bind"), plugin);
    let result = PluginConnection::get_info(
        &huge,
        identity(&huge),
        None,
        fast(),
        &mut Sleep,
        OnInvalid::Notify,
        &StepTimer::default(),
    )
    .await;
    assert!(
        matches!(result, Err(PluginCallError::GetInfo(_))),
        "got {:?}",
        result.err()
    );

    let many = dir.path().join("many.sock");
    let plugin = FakePlugin::new(info("many", 1000));
    let _stop2 = serve(tokio::net::UnixListener::bind(&many).expect("bind"), plugin);
    let result = PluginConnection::get_info(
        &many,
        identity(&many),
        None,
        fast(),
        &mut Sleep,
        OnInvalid::Notify,
        &StepTimer::default(),
    )
    .await;
    assert!(
        matches!(result, Err(PluginCallError::InvalidInfo(_))),
        "got {:?}",
        result.err()
    );
}

#[tokio::test]
async fn socket_replaced_while_dialling_ends_the_attempt() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&path).expect("bind stale"));
    let stale = identity(&path);
    let attempt = tokio::spawn({
        let path = path.clone();
        async move {
            PluginConnection::get_info(
                &path,
                stale,
                None,
                fast(),
                &mut Sleep,
                OnInvalid::Notify,
                &StepTimer::default(),
            )
            .await
        }
    });
    std::fs::remove_file(&path).expect("unlink stale");
    let _stop = serve(
        tokio::net::UnixListener::bind(&path).expect("bind fresh"),
        plugin("fresh"),
    );
    let result = attempt.await.expect("join");
    assert!(
        matches!(result, Err(PluginCallError::SocketGone(_))),
        "got {:?}",
        result.err()
    );
}

/// Sleeps, and says when the attempt was told its plugin is slow to answer.
struct TellingPause(tokio::sync::mpsc::UnboundedSender<()>);

impl Pause for TellingPause {
    fn pause(
        &mut self,
        duration: Duration,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
        Box::pin(tokio::time::sleep(duration))
    }

    fn answer_slow(&mut self) {
        let _ = self.0.send(());
    }
}

#[tokio::test]
async fn get_info_tells_its_pause_when_the_answer_is_slow() {
    let dir = tempfile::tempdir().expect("dir");
    let socket = dir.path().join("slow.sock");
    let answer = std::sync::Arc::new(tokio::sync::Notify::new());
    let _stop = serve(
        tokio::net::UnixListener::bind(&socket).expect("bind"),
        plugin("slow").get_info(Faults::gate(answer.clone())),
    );
    let (told_tx, mut told) = tokio::sync::mpsc::unbounded_channel();
    let timeouts = Timeouts {
        get_info: Duration::from_secs(30),
        ..fast()
    };
    let attempt = tokio::spawn({
        let socket = socket.clone();
        async move {
            PluginConnection::get_info(
                &socket,
                identity(&socket),
                None,
                timeouts,
                &mut TellingPause(told_tx),
                OnInvalid::Notify,
                &StepTimer::default(),
            )
            .await
            .map(|(_, info)| info.name)
        }
    });
    // The plugin answers only once the attempt has been told it is slow: were it never told,
    // the attempt would time out (30 s) and drop its pause, and `recv` would fail.
    told.recv().await.expect("told the answer is slow");
    answer.notify_one();
    assert_eq!(attempt.await.expect("task").expect("GetInfo"), "slow");
    assert!(told.try_recv().is_err(), "told more than once");
}
