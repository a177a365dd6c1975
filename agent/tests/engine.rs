//! The registration engine end to end inside one process: the real watcher, reconciler and
//! executor over the inotify source, real tonic plugin servers on real Unix sockets, and a handler
//! that records every call. Scenarios from kubelet's reconciler, executor and handler-contract
//! tests, plus the cases kubelet gets wrong.

use plugin_agent::admin::server::AdminService;
use plugin_agent::agent::{AgentConfig, RunningAgent};
use plugin_agent::event_source::{SourceChoice, SourceKind};
use plugin_agent::executor::{ExecutorConfig, Scheduler, Start};
use plugin_agent::handler::{HandlerError, HandlerRegistry, Plugin, PluginHandler};
use plugin_agent_proto::pluginagent::v1::PluginState;
use plugin_agent_tests::fake_plugin::serve::Served;
use plugin_agent_tests::fake_plugin::{FakePlugin, Faults, Heard, RegistrationStatus};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(20);

/// A handler call, as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    Validate(String),
    Register(String),
    Deregister(String),
}

/// Records calls; can be told to reject.
#[derive(Default)]
struct RecordingHandler {
    calls: Mutex<Vec<Call>>,
    changed: tokio::sync::Notify,
    reject_validate: Mutex<Option<String>>,
    reject_register: Mutex<Option<String>>,
}

impl RecordingHandler {
    fn record(&self, call: Call) {
        self.calls.lock().expect("calls").push(call);
        self.changed.notify_waiters();
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().expect("calls").clone()
    }

    /// Waits until the recorded calls satisfy `done`.
    async fn wait_for(&self, what: &str, done: impl Fn(&[Call]) -> bool) {
        let waited = tokio::time::timeout(WAIT, async {
            loop {
                let notified = self.changed.notified();
                if done(&self.calls()) {
                    return;
                }
                notified.await;
            }
        })
        .await;
        assert!(
            waited.is_ok(),
            "timed out waiting for {what}; calls: {:?}",
            self.calls()
        );
    }
}

#[async_trait::async_trait]
impl PluginHandler for RecordingHandler {
    async fn validate(&self, plugin: &Plugin) -> Result<(), HandlerError> {
        self.record(Call::Validate(plugin.name.clone()));
        match self.reject_validate.lock().expect("flag").clone() {
            Some(reason) => Err(HandlerError::rejected(reason)),
            None => Ok(()),
        }
    }
    async fn register(&self, plugin: &Plugin) -> Result<(), HandlerError> {
        self.record(Call::Register(plugin.name.clone()));
        match self.reject_register.lock().expect("flag").clone() {
            Some(reason) => Err(HandlerError::rejected(reason)),
            None => Ok(()),
        }
    }
    async fn deregister(&self, plugin: &Plugin) -> Result<(), HandlerError> {
        self.record(Call::Deregister(plugin.name.clone()));
        Ok(())
    }
    fn describe(&self) -> String {
        "recording test handler".into()
    }
}

/// A kubelet-compatible plugin served in-process, and the notifications it received.
struct TestPlugin {
    notifications: mpsc::UnboundedReceiver<RegistrationStatus>,
    served: Served,
    socket: PathBuf,
}

impl TestPlugin {
    fn serve(socket: &Path, plugin_type: &str, name: &str) -> TestPlugin {
        let listener = tokio::net::UnixListener::bind(socket).expect("bind plugin socket");
        let (tx, rx) = mpsc::unbounded_channel();
        let info = FakePlugin::info(plugin_type, name, &["1.0.0".into()]);
        let plugin = FakePlugin::new(info).on_call(move |heard| {
            if let Heard::Notify { status, .. } = heard {
                let _ = tx.send(status);
            }
        });
        TestPlugin {
            notifications: rx,
            served: Served::spawn(listener, plugin),
            socket: socket.to_path_buf(),
        }
    }

    async fn next_notification(&mut self) -> RegistrationStatus {
        tokio::time::timeout(WAIT, self.notifications.recv())
            .await
            .expect("timed out waiting for NotifyRegistrationStatus")
            .expect("plugin stopped")
    }

    /// Stops serving and removes the socket, as a plugin does on exit.
    fn remove(self) {
        self.served.stop();
        let _ = std::fs::remove_file(&self.socket);
    }
}

struct Harness {
    agent: RunningAgent,
    handler: Arc<RecordingHandler>,
    dir: tempfile::TempDir,
}

async fn start_agent(handler_types: &[&str]) -> Harness {
    let dir = tempfile::tempdir().expect("temp dir");
    start_agent_in(dir, handler_types, 64).await
}

/// An agent on `dir` (which may hold sockets already) with `max_concurrent` slots.
async fn start_agent_in(
    dir: tempfile::TempDir,
    handler_types: &[&str],
    max_concurrent: usize,
) -> Harness {
    let handler = Arc::new(RecordingHandler::default());
    let handlers = Arc::new(HandlerRegistry::default());
    for t in handler_types {
        handlers.insert(t, handler.clone());
    }
    let mut config = AgentConfig::new(dir.path().to_path_buf());
    config.source = SourceChoice::Only(SourceKind::Inotify);
    config.executor = ExecutorConfig {
        max_concurrent,
        ..ExecutorConfig::default()
    };
    let mut agent = RunningAgent::start(config, handlers)
        .await
        .expect("agent starts");
    agent.wait_ready().await;
    Harness {
        agent,
        handler,
        dir,
    }
}

#[tokio::test]
async fn register_then_unregister_calls_handler_in_contract_order() {
    let h = start_agent(&["CSIPlugin"]).await;
    let mut plugin = TestPlugin::serve(&h.dir.path().join("a.sock"), "CSIPlugin", "a");
    let status = plugin.next_notification().await;
    assert!(status.plugin_registered, "error: {}", status.error);
    assert_eq!(
        h.handler.calls(),
        vec![Call::Validate("a".into()), Call::Register("a".into())]
    );
    assert_eq!(h.agent.actual.len(), 1);

    plugin.remove();
    h.handler.wait_for("deregister", |c| c.len() == 3).await;
    assert_eq!(h.handler.calls()[2], Call::Deregister("a".into()));
    assert!(h.agent.actual.is_empty());
}

#[tokio::test]
async fn nothing_to_do_leaves_handler_untouched() {
    let h = start_agent(&["CSIPlugin"]).await;
    std::fs::write(h.dir.path().join("not-a-socket"), b"x").expect("write file");
    // A sentinel plugin proves the watcher processed everything before it.
    let mut sentinel =
        TestPlugin::serve(&h.dir.path().join("sentinel.sock"), "CSIPlugin", "sentinel");
    assert!(sentinel.next_notification().await.plugin_registered);
    assert_eq!(
        h.handler.calls(),
        vec![
            Call::Validate("sentinel".into()),
            Call::Register("sentinel".into())
        ]
    );
}

#[tokio::test]
async fn socket_recreated_on_same_path_is_unregistered_then_registered() {
    let h = start_agent(&["CSIPlugin"]).await;
    let path = h.dir.path().join("p.sock");
    let mut first = TestPlugin::serve(&path, "CSIPlugin", "first");
    assert!(first.next_notification().await.plugin_registered);
    let generation = h.agent.actual.get(&path).expect("registered").generation;

    first.remove();
    let mut second = TestPlugin::serve(&path, "CSIPlugin", "second");
    assert!(second.next_notification().await.plugin_registered);
    let calls = h.handler.calls();
    let deregister = calls
        .iter()
        .position(|c| *c == Call::Deregister("first".into()))
        .expect("first deregistered");
    let register = calls
        .iter()
        .position(|c| *c == Call::Register("second".into()))
        .expect("second registered");
    assert!(
        deregister < register,
        "unregister must come before register: {calls:?}"
    );
    let entry = h.agent.actual.get(&path).expect("registered");
    assert_ne!(entry.generation, generation);
    assert_eq!(entry.plugin.name, "second");
    assert_eq!(h.agent.actual.len(), 1);
}

#[tokio::test]
async fn validation_rejection_reaches_plugin_and_nothing_is_registered() {
    let h = start_agent(&["CSIPlugin"]).await;
    *h.handler.reject_validate.lock().expect("flag") = Some("driver version too old".into());
    let mut plugin = TestPlugin::serve(&h.dir.path().join("a.sock"), "CSIPlugin", "a");
    let status = plugin.next_notification().await;
    assert!(!status.plugin_registered);
    assert!(
        status.error.contains("driver version too old"),
        "error: {}",
        status.error
    );
    assert!(h.agent.actual.is_empty());
    assert!(!h.handler.calls().contains(&Call::Register("a".into())));
}

#[tokio::test]
async fn register_failure_rolls_back_then_retries_with_backoff() {
    let h = start_agent(&["CSIPlugin"]).await;
    *h.handler.reject_register.lock().expect("flag") = Some("no capacity".into());
    let mut plugin = TestPlugin::serve(&h.dir.path().join("a.sock"), "CSIPlugin", "a");
    let status = plugin.next_notification().await;
    assert!(!status.plugin_registered);
    assert!(
        status.error.contains("no capacity"),
        "error: {}",
        status.error
    );
    h.handler
        .wait_for("rollback deregister", |c| {
            c.contains(&Call::Deregister("a".into()))
        })
        .await;
    assert!(h.agent.actual.is_empty());

    // The retry (after 500 ms) succeeds once the handler accepts.
    *h.handler.reject_register.lock().expect("flag") = None;
    let status = plugin.next_notification().await;
    assert!(status.plugin_registered, "retry failed: {}", status.error);
    assert_eq!(h.agent.actual.len(), 1);
}

#[tokio::test]
async fn plugin_without_handler_is_told_and_registers_when_handler_is_added() {
    let h = start_agent(&[]).await;
    let mut plugin = TestPlugin::serve(&h.dir.path().join("dra.sock"), "DRAPlugin", "gpu");
    let status = plugin.next_notification().await;
    assert!(!status.plugin_registered);
    assert!(
        status
            .error
            .starts_with("no handler registered for plugin type: DRAPlugin"),
        "error: {}",
        status.error
    );

    h.agent.handlers.insert("DRAPlugin", h.handler.clone());
    let status = plugin.next_notification().await;
    assert!(status.plugin_registered, "error: {}", status.error);
    assert_eq!(
        h.handler.calls(),
        vec![Call::Validate("gpu".into()), Call::Register("gpu".into())]
    );
}

/// kubelet 1.33 (kubernetes PR 129832): two sockets of one plugin name are two registrations;
/// each socket's removal deregisters that one, with its own endpoint.
#[tokio::test]
async fn each_socket_of_one_plugin_name_is_deregistered_when_it_goes() {
    let h = start_agent(&["DRAPlugin"]).await;
    let mut old = TestPlugin::serve(&h.dir.path().join("v1.sock"), "DRAPlugin", "gpu");
    assert!(old.next_notification().await.plugin_registered);
    let mut new = TestPlugin::serve(&h.dir.path().join("v2.sock"), "DRAPlugin", "gpu");
    assert!(new.next_notification().await.plugin_registered);

    old.remove();
    h.handler
        .wait_for("the old socket's deregister", |c| {
            c.iter().any(|c| matches!(c, Call::Deregister(_)))
        })
        .await;
    assert_eq!(h.agent.actual.len(), 1, "the new socket stays registered");
    new.remove();
    h.handler
        .wait_for("registry empty", |_| h.agent.actual.is_empty())
        .await;
    let deregisters = h
        .handler
        .calls()
        .iter()
        .filter(|c| matches!(c, Call::Deregister(_)))
        .count();
    assert_eq!(deregisters, 2, "calls: {:?}", h.handler.calls());
}

#[tokio::test]
async fn same_socket_runs_one_operation_at_a_time() {
    let h = start_agent(&["CSIPlugin"]).await;
    // A socket with no listener: the dial retries ECONNREFUSED for up to 10 s, holding the slot.
    let path = h.dir.path().join("stale.sock");
    let listener = std::os::unix::net::UnixListener::bind(&path).expect("bind");
    drop(listener);
    let waited = tokio::time::timeout(WAIT, async {
        while !h.agent.executor.is_running(&path) {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(waited.is_ok(), "registration never started");
    let desired = h.agent.desired.get(&path).expect("desired");
    assert!(matches!(
        h.agent.executor.register(&path, desired),
        Start::AlreadyRunning(_)
    ));
}

#[tokio::test]
async fn different_sockets_register_concurrently() {
    let h = start_agent(&["CSIPlugin"]).await;
    // A plugin that never answers GetInfo holds its operation for the GetInfo deadlines (a
    // socket nothing listens on no longer does: its wait is handed back after a few quick
    // retries, so under load it was over before the healthy plugin below registered)...
    let hung = h.dir.path().join("hung.sock");
    let info = FakePlugin::info("CSIPlugin", "hung", &["1.0.0".into()]);
    let _hung = Served::spawn(
        tokio::net::UnixListener::bind(&hung).expect("bind"),
        FakePlugin::new(info).get_info(Faults::hang()),
    );
    // ...and a healthy plugin next to it registers regardless.
    let mut plugin = TestPlugin::serve(&h.dir.path().join("ok.sock"), "CSIPlugin", "ok");
    assert!(plugin.next_notification().await.plugin_registered);
    assert!(
        h.agent.executor.is_running(&hung),
        "the hung plugin's registration should still be waiting for its answer"
    );
}

/// One slot lets four registrations wait for it (the executor's backlog); the rest of a burst
/// waits as listed paths, handed back as waiting ones get the slot: every plugin registers.
#[tokio::test]
async fn a_burst_past_the_waiting_bound_registers_every_plugin() {
    let dir = tempfile::tempdir().expect("temp dir");
    // Served before the agent starts: its first walk finds them all, for one reconcile pass.
    let mut plugins: Vec<TestPlugin> = (0..12)
        .map(|i| {
            let socket = dir.path().join(format!("p{i}.sock"));
            TestPlugin::serve(&socket, "CSIPlugin", &format!("p{i}"))
        })
        .collect();
    let h = start_agent_in(dir, &["CSIPlugin"], 1).await;
    for plugin in &mut plugins {
        let status = plugin.next_notification().await;
        assert!(status.plugin_registered, "error: {}", status.error);
    }
    assert_eq!(h.agent.actual.len(), 12);
}

#[tokio::test]
async fn a_desired_socket_that_is_gone_backs_off_instead_of_spinning() {
    let h = start_agent(&["CSIPlugin"]).await;
    // Desired state names a socket the watcher never saw go (a missed removal event): every
    // attempt finds it gone at once. It must back off, not be retried in a loop.
    let path = h.dir.path().join("gone.sock");
    let socket = plugin_agent::state::SocketId {
        dev: 1,
        ino: 42,
        birth_ns: None,
        handle: None,
    };
    h.agent
        .desired
        .add_or_update(&path, socket, None)
        .expect("desired");
    let desired = h.agent.desired.get(&path).expect("desired");
    assert_eq!(
        h.agent.executor.register(&path, desired.clone()),
        Start::Started
    );
    tokio::time::timeout(WAIT, async {
        while h
            .agent
            .executor
            .backoffs()
            .get(&path, desired.socket)
            .is_none()
        {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the attempt ends in backoff");
    assert!(matches!(
        h.agent.executor.register(&path, desired),
        Start::BackingOff { .. }
    ));
}

/// A handler that rejects its first validation, and holds the second until released: the
/// plugin's retry is then running, with its backoff expired but not yet cleared.
struct RetryGate {
    validations: Mutex<u32>,
    retrying: tokio::sync::Notify,
    release: tokio::sync::Semaphore,
}

impl Default for RetryGate {
    fn default() -> Self {
        RetryGate {
            validations: Mutex::new(0),
            retrying: tokio::sync::Notify::new(),
            release: tokio::sync::Semaphore::new(0),
        }
    }
}

#[async_trait::async_trait]
impl PluginHandler for RetryGate {
    async fn validate(&self, _: &Plugin) -> Result<(), HandlerError> {
        let attempt = {
            let mut validations = self.validations.lock().expect("count");
            *validations += 1;
            *validations
        };
        if attempt == 1 {
            return Err(HandlerError::rejected("not yet"));
        }
        self.retrying.notify_one();
        let _ = self.release.acquire().await.expect("gate open");
        Ok(())
    }
    async fn register(&self, _: &Plugin) -> Result<(), HandlerError> {
        Ok(())
    }
    async fn deregister(&self, _: &Plugin) -> Result<(), HandlerError> {
        Ok(())
    }
    fn describe(&self) -> String {
        "retry gate".into()
    }
}

/// The state the admin API lists for the only plugin.
fn listed_state(agent: &RunningAgent) -> PluginState {
    let (plugins, _) = AdminService::new(agent.served()).list(None, usize::MAX);
    assert_eq!(plugins.len(), 1, "{plugins:?}");
    PluginState::try_from(plugins[0].state).expect("known state")
}

/// `plugin_agent_plugins` series with a non-zero value, as (type, state, value) text.
async fn metric_states(addr: std::net::SocketAddr) -> Vec<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .expect("request");
    let mut text = String::new();
    stream.read_to_string(&mut text).await.expect("response");
    text.lines()
        .filter(|l| l.starts_with("plugin_agent_plugins{") && !l.ends_with(" 0"))
        .map(str::to_string)
        .collect()
}

/// Reads the listed state, the metrics, then the listed state again until the two listings
/// agree (the state did not move during the scrape), and returns both views.
async fn list_and_metrics(
    agent: &RunningAgent,
    addr: std::net::SocketAddr,
) -> (PluginState, Vec<String>) {
    loop {
        let before = listed_state(agent);
        let metrics = metric_states(addr).await;
        if listed_state(agent) == before {
            return (before, metrics);
        }
    }
}

/// Waits for the next event of `kind` on the watch stream.
async fn next_event(
    events: &mut tokio::sync::broadcast::Receiver<
        std::sync::Arc<plugin_agent::notifications::AgentEvent>,
    >,
    kind: plugin_agent::notifications::EventKind,
) {
    tokio::time::timeout(WAIT, async {
        loop {
            let event = events.recv().await.expect("event stream open");
            if event.kind == kind {
                return;
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("timed out waiting for {kind:?}"));
}

#[tokio::test]
async fn list_watch_and_metrics_agree_on_a_plugin_state_during_a_retry() {
    use plugin_agent::notifications::EventKind;
    let dir = tempfile::tempdir().expect("temp dir");
    let gate = Arc::new(RetryGate::default());
    let handlers = Arc::new(HandlerRegistry::default());
    handlers.insert("CSIPlugin", gate.clone());
    let mut config = AgentConfig::new(dir.path().to_path_buf());
    config.source = SourceChoice::Only(SourceKind::Inotify);
    config.metrics_addr = Some("127.0.0.1:0".parse().expect("address"));
    let mut agent = RunningAgent::start(config, handlers)
        .await
        .expect("agent starts");
    agent.wait_ready().await;
    let addr = agent.metrics_addr.expect("metrics served");
    let mut watch = agent.notifications.subscribe();
    let _plugin = TestPlugin::serve(&dir.path().join("a.sock"), "CSIPlugin", "a");

    // The first attempt fails: watch reports it; list and metrics say backing off until the
    // retry starts (500 ms later), and never one without the other.
    next_event(&mut watch, EventKind::RegistrationFailed).await;
    let retrying = gate.retrying.notified();
    tokio::pin!(retrying);
    tokio::time::timeout(WAIT, async {
        loop {
            let (listed, metrics) = list_and_metrics(&agent, addr).await;
            match listed {
                PluginState::BackingOff => {
                    assert_eq!(
                        metrics,
                        ["plugin_agent_plugins{type=\"unknown\",state=\"backing_off\"} 1"]
                    );
                    break;
                }
                PluginState::Pending => {
                    assert_eq!(
                        metrics,
                        ["plugin_agent_plugins{type=\"unknown\",state=\"pending\"} 1"]
                    );
                }
                other => panic!("unexpected state {other:?} after a failed attempt"),
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the failure backs off");

    // The retry runs (its backoff expired, not yet cleared): both say pending.
    tokio::time::timeout(WAIT, retrying)
        .await
        .expect("the retry starts");
    let (listed, metrics) = list_and_metrics(&agent, addr).await;
    assert_eq!(listed, PluginState::Pending);
    assert_eq!(
        metrics,
        ["plugin_agent_plugins{type=\"unknown\",state=\"pending\"} 1"]
    );

    // The retry succeeds: watch reports it, and both say registered.
    gate.release.add_permits(1);
    next_event(&mut watch, EventKind::Registered).await;
    let (listed, metrics) = list_and_metrics(&agent, addr).await;
    assert_eq!(listed, PluginState::Registered);
    assert_eq!(
        metrics,
        ["plugin_agent_plugins{type=\"CSIPlugin\",state=\"registered\"} 1"]
    );
    agent.stop().await;
}

/// A client that connects as soon as the agent logs its first scan (the e2e harness does, and so
/// may an operator's script) must reach this agent, never a previous agent's socket file with
/// nothing behind it: the socket is bound before the agent starts, and a connection made before
/// the API is served waits in the backlog and is answered once it is.
#[tokio::test]
async fn the_admin_socket_takes_connections_before_it_is_served_and_answers_them_after() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let runtime = tempfile::tempdir().expect("temp dir");
    let socket = runtime.path().join("admin.sock");
    // A previous agent's socket file, nothing listening on it.
    drop(std::os::unix::net::UnixListener::bind(&socket).expect("stale socket"));
    let refused = std::os::unix::net::UnixStream::connect(&socket)
        .expect_err("nothing listens on the stale socket");
    assert_eq!(
        refused.kind(),
        std::io::ErrorKind::ConnectionRefused,
        "{refused}"
    );

    let bound = plugin_agent::admin::server::bind(&socket).expect("binds over the stale file");
    let mut early = tokio::net::UnixStream::connect(&socket)
        .await
        .expect("a connection before the API is served waits in the backlog");
    early
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .expect("HTTP/2 preface");

    let harness = start_agent(&[]).await;
    let cancel = CancellationToken::new();
    let server = tokio::spawn(plugin_agent::admin::server::serve(
        bound,
        AdminService::new(harness.agent.served()),
        cancel.clone(),
    ));
    let mut frame_header = [0u8; 9];
    tokio::time::timeout(WAIT, early.read_exact(&mut frame_header))
        .await
        .expect("the early connection is answered once the API is served")
        .expect("reads the server's first frame");
    assert_eq!(
        frame_header[3], 0x4,
        "HTTP/2 starts with SETTINGS: {frame_header:?}"
    );

    let mut client = plugin_agent::admin::client::connect(&socket)
        .await
        .expect("connects");
    let listed = client
        .list_plugins(plugin_agent_proto::pluginagent::v1::ListPluginsRequest::default())
        .await
        .expect("lists");
    assert!(listed.into_inner().plugins.is_empty());

    cancel.cancel();
    drop(early);
    server
        .await
        .expect("server task")
        .expect("serves until cancelled");
    assert!(!socket.exists(), "the socket file is removed at shutdown");
}
