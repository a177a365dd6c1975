//! Handlers end to end: plugin <-> agent <-> handler over real sockets. The handler is the example
//! DRA handler (`dra-handler`, a real `pluginagent.v1.PluginHandler` server in its own process);
//! operators reach the agent through the admin socket with the `plugin-agent` CLI.
//!
//! Handlers do not depend on the event source, so these run on inotify only.

use plugin_agent_tests::admin::Watch;
use plugin_agent_tests::events::EventLog;
use plugin_agent_tests::{
    AgentOptions, AgentProcess, EVENT_TIMEOUT, Line, Mark, PluginDir, PluginProcess, Source,
    plugin, test_name,
};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// A running `dra-handler`; killed on drop.
struct Handler {
    child: Child,
    events: EventLog,
    target: String,
}

impl Handler {
    async fn start(socket: &Path, flags: &[&str]) -> Handler {
        let target = format!("unix://{}", socket.display());
        let mut child = Command::new(env!("CARGO_BIN_EXE_dra-handler"))
            .args(["--listen", &target])
            .args(flags)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start dra-handler");
        let stdout = child.stdout.take().expect("stdout is piped");
        let events = EventLog::read_from(stdout, format!("handler-{}", socket.display()));
        let handler = Handler {
            child,
            events,
            target,
        };
        handler
            .wait(|l| l.field_is("event", "listening"), "the handler listens")
            .await;
        handler
    }

    async fn wait(&self, pred: impl Fn(&Line) -> bool, what: &str) -> Line {
        self.wait_after(Mark(0), pred, what).await
    }

    async fn wait_after(&self, mark: Mark, pred: impl Fn(&Line) -> bool, what: &str) -> Line {
        match self.events.wait_for(mark, EVENT_TIMEOUT, pred).await {
            Ok(line) => line,
            Err(e) => panic!(
                "waiting for {what}: {e:?}; handler said:\n{}",
                self.events.tail(30)
            ),
        }
    }

    /// The first `n` calls matching `pred`, once the handler has logged them: it logs a call
    /// after answering it, so its lines can trail what the plugin saw.
    async fn wait_for_calls(
        &self,
        n: usize,
        pred: impl Fn(&Line) -> bool,
        what: &str,
    ) -> Vec<Line> {
        match self
            .events
            .wait_for_count(Mark(0), n, EVENT_TIMEOUT, pred)
            .await
        {
            Ok(lines) => lines,
            Err(e) => panic!(
                "waiting for {n} x {what}: {e:?}; handler said:\n{}",
                self.events.tail(30)
            ),
        }
    }

    fn calls(&self) -> Vec<(String, String)> {
        self.events
            .lines()
            .into_iter()
            .filter_map(|l| Some((l.field("call")?, l.field("name")?)))
            .collect()
    }
}

impl Drop for Handler {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn call(kind: &'static str, name: &'static str) -> impl Fn(&Line) -> bool {
    move |l| l.field_is("call", kind) && l.field_is("name", name)
}

fn dra_plugin(dir: &PluginDir, socket: &str, name: &str) -> PluginProcess {
    plugin!(dir.path(socket))
        .plugin_type("DRAPlugin")
        .name(name)
        .arg("--versions")
        .arg("v1beta1.DRAPlugin,v1.DRAPlugin")
        .spawn()
}

struct Setup {
    dir: PluginDir,
    agent: AgentProcess,
    admin: PathBuf,
}

async fn start_agent(test: &str, handlers: &[String], extra: &[&str]) -> Setup {
    let dir = PluginDir::new();
    let admin = dir.outside("admin/agent.sock");
    let mut options = AgentOptions::new(Source::Inotify, &dir.root());
    options.handlers = handlers.to_vec();
    options.extra = vec!["--admin-socket".into(), admin.display().to_string()];
    options.extra.extend(extra.iter().map(|s| s.to_string()));
    // Started: its admin API answered (the harness follows the agent through it).
    let agent = AgentProcess::start(test, options)
        .await
        .expect("inotify needs no privileges");
    Setup { dir, agent, admin }
}

/// Runs `plugin-agent --admin-socket A <args>`; returns (success, stdout, stderr).
fn cli(admin: &Path, args: &[&str]) -> (bool, String, String) {
    cli_as(admin, args, None)
}

fn cli_as(admin: &Path, args: &[&str], uid: Option<u32>) -> (bool, String, String) {
    use plugin_agent_tests::env::{SharedBinary, agent_bin};
    use std::os::unix::process::CommandExt;
    // Another user may not reach the checkout's binary: it runs a copy it can reach.
    let shared = uid.map(|_| SharedBinary::new(&agent_bin()));
    let mut command = match &shared {
        Some(shared) => Command::new(shared.path()),
        None => Command::new(agent_bin()),
    };
    command.arg("--admin-socket").arg(admin).args(args);
    if let Some(uid) = uid {
        command.uid(uid).gid(uid);
    }
    let out = command.output().expect("run plugin-agent CLI");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_handler_accepts_plugin_with_highest_dra_service() {
    let base = PluginDir::new();
    let handler = Handler::start(&base.outside("h.sock"), &[]).await;
    let s = start_agent(
        "grpc_handler_accepts",
        &[format!("DRAPlugin={}", handler.target)],
        &[],
    )
    .await;
    let plugin = dra_plugin(&s.dir, "gpu.sock", "gpu");
    let notify = plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    assert_eq!(notify.field("error").as_deref(), Some(""));
    let validate = handler.wait(call("validate", "gpu"), "validate").await;
    assert_eq!(validate.field("service").as_deref(), Some("v1.DRAPlugin"));
    // The handler logs a call after answering it, so its register line can
    // trail the plugin's Notify: await it, then check the order.
    handler.wait(call("register", "gpu"), "register").await;
    assert_eq!(
        handler.calls(),
        vec![
            ("validate".into(), "gpu".into()),
            ("register".into(), "gpu".into())
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejection_at_validate_reaches_the_plugin() {
    let base = PluginDir::new();
    let handler = Handler::start(
        &base.outside("h.sock"),
        &["--reject-validate", "quota exceeded on this node"],
    )
    .await;
    let s = start_agent(
        "reject_validate",
        &[format!("DRAPlugin={}", handler.target)],
        &[],
    )
    .await;
    let plugin = dra_plugin(&s.dir, "gpu.sock", "gpu");
    let notify = plugin.wait_for_notify(false, EVENT_TIMEOUT).await;
    let error = notify.field("error").unwrap_or_default();
    assert!(
        error.contains("quota exceeded on this node"),
        "plugin was told {error:?}"
    );
    assert!(
        !handler.calls().iter().any(|(c, _)| c == "register"),
        "register must not follow a failed validate"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejection_at_register_reaches_the_plugin_and_is_rolled_back() {
    let base = PluginDir::new();
    let handler = Handler::start(
        &base.outside("h.sock"),
        &["--reject-register", "no capacity"],
    )
    .await;
    let s = start_agent(
        "reject_register",
        &[format!("DRAPlugin={}", handler.target)],
        &[],
    )
    .await;
    let plugin = dra_plugin(&s.dir, "gpu.sock", "gpu");
    let notify = plugin.wait_for_notify(false, EVENT_TIMEOUT).await;
    assert!(
        notify
            .field("error")
            .unwrap_or_default()
            .contains("no capacity"),
        "{notify}"
    );
    handler
        .wait(call("deregister", "gpu"), "the rollback deregistration")
        .await;
    let (ok, out, err) = cli(&s.admin, &["list", "-o", "json"]);
    assert!(ok, "{err}");
    let list: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_ne!(list[0]["state"], "registered", "{out}");
    assert!(
        list[0]["last_error"]
            .as_str()
            .unwrap_or_default()
            .contains("no capacity"),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugins_wait_for_a_handler_that_is_down_and_register_when_it_is_back() {
    let base = PluginDir::new();
    let socket = base.outside("h.sock");
    let target = format!("unix://{}", socket.display());
    let s = start_agent(
        "handler_down_then_up",
        &[format!("DRAPlugin={target}"), "CSIPlugin=accept-all".into()],
        &[],
    )
    .await;
    let plugin = dra_plugin(&s.dir, "gpu.sock", "gpu");
    let refused = plugin.wait_for_notify(false, EVENT_TIMEOUT).await;
    assert!(
        refused
            .field("error")
            .unwrap_or_default()
            .contains("unavailable"),
        "{refused}"
    );
    // Other types are unaffected meanwhile.
    let csi = plugin!(s.dir.path("csi.sock")).name("csi").spawn();
    csi.wait_for_notify(true, EVENT_TIMEOUT).await;

    let handler = Handler::start(&socket, &[]).await;
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    handler
        .wait(call("register", "gpu"), "register once the handler is back")
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_slower_than_its_deadline_fails_the_plugin_and_delays_no_other_type() {
    let base = PluginDir::new();
    let handler = Handler::start(&base.outside("h.sock"), &["--delay", "5s"]).await;
    let s = start_agent(
        "slow_handler",
        &[
            format!("DRAPlugin={}", handler.target),
            "CSIPlugin=accept-all".into(),
        ],
        &["--handler-timeout", "500ms"],
    )
    .await;
    let slow = dra_plugin(&s.dir, "gpu.sock", "gpu");
    let csi = plugin!(s.dir.path("csi.sock")).name("csi").spawn();
    csi.wait_for_notify(true, EVENT_TIMEOUT).await;
    let refused = slow.wait_for_notify(false, EVENT_TIMEOUT).await;
    assert!(
        refused
            .field("error")
            .unwrap_or_default()
            .contains("did not answer within 500ms"),
        "{refused}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_added_through_the_cli_registers_waiting_plugins() {
    let base = PluginDir::new();
    let handler = Handler::start(&base.outside("h.sock"), &[]).await;
    let s = start_agent("handler_added_later", &["CSIPlugin=accept-all".into()], &[]).await;
    let plugin = dra_plugin(&s.dir, "gpu.sock", "gpu");
    let refused = plugin.wait_for_notify(false, EVENT_TIMEOUT).await;
    assert!(
        refused
            .field("error")
            .unwrap_or_default()
            .starts_with("no handler registered for plugin type: DRAPlugin")
    );

    let mark = plugin.mark();
    let (ok, out, err) = cli(&s.admin, &["handler", "add", "DRAPlugin", &handler.target]);
    assert!(ok, "handler add failed: {out} {err}");
    plugin
        .wait_for_notify_after(mark, true, EVENT_TIMEOUT)
        .await;
    let (ok, out, _) = cli(&s.admin, &["status", "-o", "json"]);
    assert!(ok);
    let status: serde_json::Value = serde_json::from_str(&out).expect("json");
    let types: Vec<&str> = status["handlers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|h| h["plugin_type"].as_str())
        .collect();
    assert_eq!(types, vec!["CSIPlugin", "DRAPlugin"]);
    assert_eq!(status["plugins_registered"], 1);
}

/// kubernetes PR 129832 (kubelet 1.33, DRA "seamless upgrade"): a rolling update of a DRA driver
/// starts the new pod, with its own registration socket (named with the pod UID) and endpoint,
/// before the old one exits. Both are registered, and each socket's removal deregisters its own
/// endpoint only. The agent used to report only the newest socket's removal, so when the old pod
/// exited first a handler that tracks instances (as kubelet's DRA manager does) kept its dead
/// endpoint, and when the new pod exited first the driver lost its last live instance unseen.
async fn rolling_update_deregisters_each_instance_by_its_endpoint(
    test: &str,
    old_exits_first: bool,
) {
    let base = PluginDir::new();
    let handler = Handler::start(&base.outside("h.sock"), &[]).await;
    let s = start_agent(test, &[format!("DRAPlugin={}", handler.target)], &[]).await;
    let old = dra_plugin(&s.dir, "gpu-2c1a0f8e.sock", "gpu");
    old.wait_for_notify(true, EVENT_TIMEOUT).await;
    let new = dra_plugin(&s.dir, "gpu-9b47d3c2.sock", "gpu");
    new.wait_for_notify(true, EVENT_TIMEOUT).await;
    let registers = handler
        .wait_for_calls(2, call("register", "gpu"), "both registrations")
        .await;
    assert_eq!(
        registers[1].field("instances").as_deref(),
        Some("2"),
        "{test}: both instances kept: {registers:?}"
    );
    let listed = plugin_agent_tests::admin::list(&s.admin);
    for plugin in [&old, &new] {
        assert_eq!(
            listed.get(plugin.socket()).map(|e| e.state.as_str()),
            Some("registered"),
            "{test}: {listed:?}"
        );
    }

    let (first, second) = if old_exits_first {
        (old, new)
    } else {
        (new, old)
    };
    let (first_socket, second_socket) = (
        first.socket().display().to_string(),
        second.socket().display().to_string(),
    );
    let mark = handler.events.mark();
    first.stop().await;
    let gone = handler
        .wait_after(
            mark,
            call("deregister", "gpu"),
            "the first instance's deregistration",
        )
        .await;
    assert_eq!(
        gone.field("endpoint"),
        Some(first_socket.clone()),
        "{test}: {gone}"
    );
    assert_eq!(
        gone.field("removed").as_deref(),
        Some("true"),
        "{test}: {gone}"
    );
    assert_eq!(
        gone.field("last").as_deref(),
        Some("false"),
        "{test}: {gone}"
    );
    let listed = plugin_agent_tests::admin::list(&s.admin);
    assert_eq!(
        listed.get(second.socket()).map(|e| e.state.as_str()),
        Some("registered"),
        "{test}: the other instance stays registered: {listed:?}"
    );

    let mark = handler.events.mark();
    second.stop().await;
    let gone = handler
        .wait_after(
            mark,
            call("deregister", "gpu"),
            "the second instance's deregistration",
        )
        .await;
    assert_eq!(
        gone.field("endpoint"),
        Some(second_socket.clone()),
        "{test}: {gone}"
    );
    assert_eq!(
        gone.field("last").as_deref(),
        Some("true"),
        "{test}: {gone}"
    );
    let deregistered: Vec<String> = handler
        .events
        .matching_since(Mark(0), call("deregister", "gpu"))
        .iter()
        .filter_map(|l| l.field("endpoint"))
        .collect();
    assert_eq!(
        deregistered,
        [first_socket, second_socket],
        "{test}: one DeRegister per socket, each with its own endpoint, in the order they went"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_update_deregisters_the_old_instance_by_its_endpoint_when_it_exits_first_kubernetes_pr_129832()
 {
    rolling_update_deregisters_each_instance_by_its_endpoint(&test_name(), true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_update_deregisters_the_new_instance_by_its_endpoint_when_it_exits_first_kubernetes_pr_129832()
 {
    rolling_update_deregisters_each_instance_by_its_endpoint(&test_name(), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deregistration_follows_registration_in_contract_order() {
    let base = PluginDir::new();
    let handler = Handler::start(&base.outside("h.sock"), &[]).await;
    let s = start_agent(
        "deregistration_order",
        &[format!("DRAPlugin={}", handler.target)],
        &[],
    )
    .await;
    let plugin = dra_plugin(&s.dir, "gpu.sock", "gpu");
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    plugin.stop().await;
    handler.wait(call("deregister", "gpu"), "deregister").await;
    let order: Vec<String> = handler.calls().into_iter().map(|(c, _)| c).collect();
    assert_eq!(order, vec!["validate", "register", "deregister"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_lists_plugins_and_streams_events() {
    let s = start_agent("admin_list_watch", &["CSIPlugin=accept-all".into()], &[]).await;
    let watch = Watch::start(&s.admin).await;
    let events = watch.events();
    let plugin = plugin!(s.dir.path("a.sock")).name("a").spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    let (ok, out, err) = cli(&s.admin, &["list", "-o", "json"]);
    assert!(ok, "{err}");
    let list: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(list[0]["state"], "registered", "{out}");
    assert_eq!(list[0]["name"], "a");
    assert_eq!(list[0]["supported_versions"][0], "1.0.0");
    assert!(list[0]["socket_ino"].as_u64().unwrap_or(0) > 0);
    let (ok, table, _) = cli(&s.admin, &["list"]);
    assert!(
        ok && table.starts_with("SOCKET") && table.contains("registered"),
        "{table}"
    );

    plugin.stop().await;
    let removed = events
        .wait_for(Mark(0), EVENT_TIMEOUT, |l| {
            l.field_is("kind", "deregistered")
        })
        .await;
    let removed =
        removed.unwrap_or_else(|e| panic!("no deregistered event: {e:?}\n{}", events.tail(20)));
    assert_eq!(
        removed.field("socket_path"),
        Some(s.dir.path("a.sock").display().to_string())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_is_refused_to_non_root_peers() {
    if !plugin_agent_tests::env::privileged("admin_api_is_refused_to_non_root_peers") {
        return;
    }
    let s = start_agent("admin_non_root", &["CSIPlugin=accept-all".into()], &[]).await;
    // As installed (socket 0600 in a 0700 directory), another user cannot even connect.
    let (ok, _, err) = cli_as(&s.admin, &["status"], Some(65534));
    assert!(!ok && err.contains("cannot reach"), "{err}");
    // Even if an operator loosens the permissions, the peer credential check refuses.
    use std::os::unix::fs::PermissionsExt;
    let dir = s.admin.parent().expect("admin dir");
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod dir");
    std::fs::set_permissions(&s.admin, std::fs::Permissions::from_mode(0o777))
        .expect("chmod socket");
    let (ok, _, err) = cli_as(&s.admin, &["status"], Some(65534));
    assert!(
        !ok && err.contains("may not use the plugin-agent admin API"),
        "{err}"
    );
    let (ok, _, err) = cli(&s.admin, &["status"]);
    assert!(ok, "root is allowed: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_oversized_admin_requests_are_refused_and_the_agent_carries_on() {
    use std::io::Write;
    let s = start_agent("admin_malformed", &["CSIPlugin=accept-all".into()], &[]).await;
    // Not HTTP/2 at all.
    let mut raw = std::os::unix::net::UnixStream::connect(&s.admin).expect("connect");
    let _ = raw.write_all(b"GET / HTTP/1.1\r\n\r\n\x00\xff garbage");
    drop(raw);
    // A target that is not a handler address.
    let (ok, _, err) = cli(&s.admin, &["handler", "add", "DRAPlugin", "ftp://nope"]);
    assert!(
        !ok && err.contains("expected unix:///path.sock or http://host:port"),
        "{err}"
    );
    // A request over the 64 KiB limit.
    let huge = "x".repeat(100 * 1024);
    let (ok, _, err) = cli(&s.admin, &["handler", "add", &huge, "accept-all"]);
    assert!(!ok, "an oversized request must be refused");
    assert!(
        err.len() < 8 * 1024,
        "the error should not echo the request"
    );
    // The agent still serves and still registers plugins.
    let plugin = plugin!(s.dir.path("a.sock")).name("a").spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    let (ok, out, err) = cli(&s.admin, &["status", "-o", "json"]);
    assert!(ok, "{err}");
    assert!(out.contains("\"plugins_registered\": 1"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_handler_configured_in_a_toml_file_registers_plugins() {
    let base = PluginDir::new();
    let mut child = Command::new(env!("CARGO_BIN_EXE_dra-handler"))
        .args(["--listen", "http://127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start dra-handler on loopback");
    let events = EventLog::read_from(child.stdout.take().expect("piped"), "http-handler".into());
    let listening = events
        .wait_for(Mark(0), EVENT_TIMEOUT, |l| l.field_is("event", "listening"))
        .await
        .expect("listening");
    let address = listening.field("address").expect("address");
    let config = base.outside("plugin-agent.toml");
    std::fs::write(
        &config,
        format!("[handlers]\nDRAPlugin = \"{address}\"\n\n[timeouts]\nvalidate = \"5s\"\n"),
    )
    .expect("write config");

    let s = start_agent(
        "http_handler_from_config",
        &[],
        &["--config", &config.display().to_string()],
    )
    .await;
    let plugin = dra_plugin(&s.dir, "gpu.sock", "gpu");
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    events
        .wait_for(Mark(0), EVENT_TIMEOUT, |l| {
            l.field_is("call", "register") && l.field_is("name", "gpu")
        })
        .await
        .expect("the http handler registered the plugin");
    let _ = child.kill();
    let _ = child.wait();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_watch_stream_does_not_hold_up_sigterm() {
    let s = start_agent("watch_and_sigterm", &["CSIPlugin=accept-all".into()], &[]).await;
    let mut watch = Watch::start(&s.admin).await;
    let plugin = plugin!(s.dir.path("a.sock")).name("a").spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    watch
        .events()
        .wait_for(Mark(0), EVENT_TIMEOUT, |l| l.field_is("kind", "registered"))
        .await
        .expect("the watch stream carries events");
    let stopping = std::time::Instant::now();
    let status = s.agent.stop().await;
    assert!(status.success(), "the agent exits 0 on SIGTERM: {status:?}");
    assert!(
        stopping.elapsed() < std::time::Duration::from_secs(5),
        "SIGTERM took {:?} with a watch stream open",
        stopping.elapsed()
    );
    let watch_status = watch.wait().expect("watch exits");
    assert!(
        watch_status.success(),
        "the watch command ends cleanly when the agent stops"
    );
}

/// kubernetes PR 138170: a handler's Register can take up to its deadline; meanwhile nothing is
/// sent on the plugin's registration connection, and a plugin whose server closes idle connections
/// closes it. Kubelet's Notify then fails, and node-driver-registrar v2.9+ exits when it never
/// hears back. The agent re-dials the same socket and notifies on the new connection. Before, the
/// failed Notify rolled the registration back and every retry met the same slow handler, forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifies_on_a_new_connection_when_the_plugin_closed_its_idle_one_during_a_slow_handler_kubernetes_pr_138170()
 {
    let test = &test_name();
    let base = PluginDir::new();
    let handler = Handler::start(&base.outside("h.sock"), &["--delay", "1500ms"]).await;
    let s = start_agent(test, &[format!("DRAPlugin={}", handler.target)], &[]).await;
    let plugin = plugin!(s.dir.path("slow.sock"))
        .plugin_type("DRAPlugin")
        .name("slow")
        .arg("--versions")
        .arg("v1.DRAPlugin")
        .arg("--max-connection-idle")
        .arg("300ms")
        .spawn();
    let notified = plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    let closed = plugin.events_since(Mark(0), "idle_close");
    assert!(
        !closed.is_empty(),
        "{test}: the plugin closed the idle registration connection"
    );
    // Told after its only connection closed: the agent dialled it again for Notify.
    assert!(
        closed[0].position() < notified.position(),
        "{test}: Notify came after the idle connection closed, on a new one: {closed:?} {notified}"
    );
    handler
        .wait_for_calls(1, call("register", "slow"), "the registration")
        .await;
    let registers = handler
        .events
        .matching_since(Mark(0), call("register", "slow"));
    assert_eq!(registers.len(), 1, "{test}: registered once: {registers:?}");
    assert!(
        handler
            .events
            .matching_since(Mark(0), call("deregister", "slow"))
            .is_empty(),
        "{test}: no rollback"
    );
}

/// kubernetes issue 133725 (fixed upstream by PR 133335): a registration the handler refused at
/// Register was never retried. Here it is rolled back, the plugin told why, and retried after its
/// backoff until the handler accepts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_a_registration_the_handler_refused_at_register_kubernetes_issue_133725() {
    let test = &test_name();
    let base = PluginDir::new();
    let handler = Handler::start(
        &base.outside("h.sock"),
        &[
            "--reject-register",
            "not yet",
            "--reject-register-times",
            "2",
        ],
    )
    .await;
    let s = start_agent(test, &[format!("DRAPlugin={}", handler.target)], &[]).await;
    let plugin = dra_plugin(&s.dir, "gpu.sock", "gpu");
    let refused = plugin.wait_for_notify(false, EVENT_TIMEOUT).await;
    assert!(
        refused
            .field("error")
            .unwrap_or_default()
            .contains("not yet"),
        "{test}: {refused}"
    );
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    let registers = handler
        .wait_for_calls(
            3,
            call("register", "gpu"),
            "two refusals and a registration",
        )
        .await;
    let refusals = registers
        .iter()
        .filter(|l| l.field("rejected").is_some())
        .count();
    assert_eq!(
        (registers.len(), refusals),
        (3, 2),
        "{test}: two refusals, then the retry that registers: {registers:?}"
    );
    let listed = plugin_agent_tests::admin::list(&s.admin);
    assert_eq!(
        listed.get(plugin.socket()).map(|e| e.state.as_str()),
        Some("registered"),
        "{test}: {listed:?}"
    );
}

/// Sets the file-size limit of the process `pid` (`prlimit --fsize`): at 0 every write it makes
/// to a regular file fails with EFBIG (the agent ignores SIGXFSZ, so the write's error is all).
fn limit_file_size(pid: u32, bytes: libc::rlim_t) {
    let limit = libc::rlimit {
        rlim_cur: bytes,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: prlimit reads `limit` and writes nothing (no old-limit pointer).
    let done = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_FSIZE,
            &limit,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(
        done,
        0,
        "prlimit --fsize {bytes} {pid}: {}",
        std::io::Error::last_os_error()
    );
}

/// kubernetes issue 136462: kubelet logs a failure to add a plugin to its actual state and goes
/// on to the handler's Register, so a registration it does not know about can exist. Here the
/// state is recorded before Register (in the state file, since the agent carries it across
/// restarts); when that write fails the registration fails there, the plugin is told why, the
/// handler hears nothing, and the retry after its backoff registers it once writing works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_the_agent_cannot_record_fails_before_its_handler_hears_and_is_retried_kubernetes_issue_136462()
 {
    let test = &test_name();
    let base = PluginDir::new();
    let handler = Handler::start(&base.outside("h.sock"), &[]).await;
    let s = start_agent(test, &[format!("DRAPlugin={}", handler.target)], &[]).await;
    let pid = s.agent.pid().expect("the agent runs");
    limit_file_size(pid, 0);

    let watch = Watch::start(&s.admin).await;
    let plugin = dra_plugin(&s.dir, "gpu.sock", "gpu");
    let refused = plugin.wait_for_notify(false, EVENT_TIMEOUT).await;
    // The plugin hears the refusal before the agent has recorded its backoff; the admin API's
    // event says the failure is recorded (list reads the same state).
    watch.wait_for("registration_failed", plugin.socket()).await;
    let error = refused.field("error").unwrap_or_default();
    assert!(
        error.contains("cannot record the registration") && error.contains("File too large"),
        "{test}: the plugin is told why: {refused}"
    );
    handler.wait(call("validate", "gpu"), "validate").await;
    assert!(
        !handler.calls().iter().any(|(c, _)| c == "register"),
        "{test}: the handler was asked to register what the agent could not record: {:?}",
        handler.calls()
    );
    let listed = plugin_agent_tests::admin::list(&s.admin);
    let entry = listed.get(plugin.socket()).expect("listed");
    assert!(
        entry
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("cannot record the registration")),
        "{test}: list says why: {entry:?}"
    );
    let state_file_problem = |status: &str| {
        status
            .lines()
            .any(|l| l.starts_with("PROBLEM:") && l.contains("state file: cannot be written"))
    };
    let (ok, status, err) = cli(&s.admin, &["status"]);
    assert!(
        ok && state_file_problem(&status),
        "{test}: status says the state file cannot be written: {status}{err}"
    );

    let mark = plugin.mark();
    limit_file_size(pid, libc::RLIM_INFINITY);
    plugin
        .wait_for_notify_after(mark, true, EVENT_TIMEOUT)
        .await;
    let (_, status, _) = cli(&s.admin, &["status"]);
    assert!(
        !state_file_problem(&status),
        "{test}: the problem is gone once the file is written: {status}"
    );
    let registers = handler
        .wait_for_calls(1, call("register", "gpu"), "the registration")
        .await;
    assert_eq!(registers.len(), 1, "{test}");
    let state_dir = s.admin.parent().expect("the admin socket's directory");
    let on_disk = ["state.json", "state.journal"]
        .iter()
        .map(|f| std::fs::read_to_string(state_dir.join(f)).unwrap_or_default())
        .collect::<String>();
    assert!(
        on_disk.contains(&plugin.socket().display().to_string()),
        "{test}: the registration is in the state file: {on_disk}"
    );
}
