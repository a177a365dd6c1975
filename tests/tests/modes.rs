//! Register and observe modes (issue 19): beside kubelet, which owns `plugins_registry` and
//! notifies its plugins, the agent observes and never notifies; it registers only where told to,
//! and warns when that directory is one a running kubelet watches. Real plugin, handler and agent
//! processes; the mode is the executor's, the same on every source, so these run on inotify.

use plugin_agent_tests::{
    AgentOptions, AgentProcess, EVENT_TIMEOUT, Mark, PluginDir, Source, admin, plugin, seen,
    test_name,
};
use std::process::{Command, Stdio};

async fn agent(test: &str, dir: &PluginDir, handlers: &[&str], extra: &[&str]) -> AgentProcess {
    let mut options = AgentOptions::new(Source::Inotify, &dir.root()).handlers(handlers);
    options.extra = extra.iter().map(|s| s.to_string()).collect();
    AgentProcess::start(test, options)
        .await
        .expect("inotify needs no privileges")
}

/// With no handler configured the agent observes: the plugin is asked GetInfo and never told
/// anything, `list` says `observed` with what GetInfo said, and its socket's removal calls no one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_handler_the_agent_observes_asks_get_info_and_never_notifies() {
    let test = &test_name();
    let dir = PluginDir::new();
    let agent = agent(test, &dir, &[], &[]).await;
    let status = admin::status(agent.admin_socket());
    assert!(
        status["mode"]
            .as_str()
            .is_some_and(|m| m.starts_with("observe")),
        "{test}: no handler configured: observing: {status}"
    );
    let plugin = plugin!(dir.path("csi.sock"))
        .name("csi.example.com")
        .spawn();
    plugin.wait_for_event("get_info", EVENT_TIMEOUT).await;
    agent
        .wait_for_event(Mark(0), "observed", EVENT_TIMEOUT, |l| {
            seen::observed(plugin.socket())(l) && l.field_is("plugin", "CSIPlugin/csi.example.com")
        })
        .await;
    let listed = admin::list(&dir.root().with_file_name("admin.sock"));
    let entry = listed.get(plugin.socket()).expect("listed");
    assert_eq!(entry.state, "observed", "{test}: {listed:?}");
    assert_eq!(entry.name, "csi.example.com", "{test}");
    assert!(
        plugin.events_since(Mark(0), "notify").is_empty(),
        "{test}: observe mode never notifies"
    );
    let mark = agent.event_mark();
    let socket = plugin.socket().to_path_buf();
    plugin.stop().await;
    agent
        .wait_for_event(mark, "the removal", EVENT_TIMEOUT, |l| {
            seen::deregistered(&socket)(l) && l.field_is("detail", "observed: no handler to tell")
        })
        .await;
}

/// `--mode observe --observe-contact never`: the agent never connects to a plugin socket; the
/// socket is listed, observed, without a name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_mode_without_contact_never_connects_to_a_plugin() {
    let test = &test_name();
    let dir = PluginDir::new();
    let agent = agent(
        test,
        &dir,
        &["CSIPlugin=accept-all"],
        &["--mode", "observe", "--observe-contact", "never"],
    )
    .await;
    let plugin = plugin!(dir.path("quiet.sock")).spawn();
    plugin.wait_for_event("serving", EVENT_TIMEOUT).await;
    agent
        .wait_for_event(
            Mark(0),
            "observed",
            EVENT_TIMEOUT,
            seen::observed(plugin.socket()),
        )
        .await;
    let listed = admin::list(&dir.root().with_file_name("admin.sock"));
    let entry = listed.get(plugin.socket()).expect("listed");
    assert_eq!(
        (entry.state.as_str(), entry.name.as_str()),
        ("observed", ""),
        "{test}"
    );
    assert!(
        !plugin.called_since(Mark(0)),
        "{test}: the plugin was contacted"
    );
    // The handler configured is not used, and adding one through the admin API is refused.
    let added = Command::new(plugin_agent_tests::env::agent_bin())
        .arg("--admin-socket")
        .arg(dir.root().with_file_name("admin.sock"))
        .args(["handler", "add", "DRAPlugin", "accept-all"])
        .stderr(Stdio::piped())
        .output()
        .expect("plugin-agent handler add");
    assert!(
        !added.status.success(),
        "{test}: a handler added in observe mode"
    );
    assert!(
        String::from_utf8_lossy(&added.stderr).contains("observes"),
        "{test}: {}",
        String::from_utf8_lossy(&added.stderr)
    );
}

/// A process named `kubelet` with `--root-dir` whose `plugins_registry` is the agent's directory:
/// register mode warns, naming the conflict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_mode_on_a_directory_a_running_kubelet_watches_warns() {
    let test = &test_name();
    let base = PluginDir::new();
    let root = base.outside("kubelet-root");
    let registry = root.join("plugins_registry");
    std::fs::create_dir_all(&registry).expect("mkdir");
    // A stand-in kubelet: a copy of sh named `kubelet` (the command name is the file's), blocked
    // reading its stdin, with kubelet's flag on its command line.
    let kubelet = base.outside("bin/kubelet");
    std::fs::create_dir_all(kubelet.parent().expect("bin")).expect("mkdir bin");
    std::fs::copy("/bin/sh", &kubelet).expect("copy sh");
    let mut fake = Command::new(&kubelet)
        .args(["-c", "read line", "kubelet"])
        .arg(format!("--root-dir={}", root.display()))
        .stdin(Stdio::piped())
        .spawn()
        .expect("fake kubelet");
    let mut options =
        AgentOptions::new(Source::Inotify, &registry).handlers(&["CSIPlugin=accept-all"]);
    options.extra = vec!["--mode".into(), "register".into()];
    let agent = AgentProcess::start(test, options).await.expect("inotify");
    // The warning in the log is the feature: it is how the conflict is told.
    let warning = agent
        .wait_for_log("the conflict", EVENT_TIMEOUT, |l| {
            l.message()
                .starts_with("register mode on a directory a running kubelet also watches")
        })
        .await;
    assert_eq!(
        warning.field("kubelet_pid"),
        Some(fake.id().to_string()),
        "{test}: {warning}"
    );
    let _ = fake.kill();
    let _ = fake.wait();
}

/// Kubelet's place taken by a register-mode agent (inotify, `CSIPlugin` handled, `DRAPlugin`
/// not), and beside it the agent as the shipped DaemonSet runs it: observing the same directory,
/// no handler, eBPF. Every plugin hears from the stand-in only: the CSI plugin exactly one
/// `Notify(true)`, the DRA plugin (a type nobody handles) the stand-in's `Notify(false)`s and
/// nothing from the observer. The observer lists both with what GetInfo said, who created and
/// serves each socket, and who first contacted it and when (the stand-in, after the socket's
/// creation); it follows a plugin's death as `unserved` without telling anyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observer_beside_a_registering_agent_never_notifies_and_reports_the_first_contact() {
    let test = &test_name();
    let dir = PluginDir::new();
    let mut options = AgentOptions::new(Source::Ebpf, &dir.root()).handlers(&[]);
    options.admin_socket = dir.root().with_file_name("observer.sock");
    let Some(observer) = AgentProcess::start(test, options.clone()).await else {
        return;
    };
    let kubelet = AgentProcess::start_kubelet_stand_in(test, &dir).await;
    let kubelet_admin = kubelet.admin_socket().to_path_buf();
    let kubelet_pid = kubelet.pid().expect("the stand-in runs");
    let observer_pid = observer.pid().expect("the observer runs");

    let csi = plugin!(dir.path("csi.sock"))
        .name("csi.example.com")
        .spawn();
    let dra = plugin!(dir.path("dra.sock"))
        .plugin_type("DRAPlugin")
        .name("dra.example.com")
        .spawn();
    csi.wait_for_notify(true, EVENT_TIMEOUT).await;
    dra.wait_for_notify(false, EVENT_TIMEOUT).await;
    for plugin in [&csi, &dra] {
        let socket = plugin.socket();
        observer
            .wait_for_event(
                Mark(0),
                "the observation",
                EVENT_TIMEOUT,
                seen::observed(socket),
            )
            .await;
        observer
            .wait_for_event(Mark(0), "the first contact", EVENT_TIMEOUT, |l| {
                seen::about(socket)(l) && l.field_is("kind", "first_contact")
            })
            .await;
    }

    // The observer asked GetInfo of each and told nobody anything; the stand-in told the CSI
    // plugin once.
    for plugin in [&csi, &dra] {
        let callers = |event: &str| -> Vec<i64> {
            plugin
                .events_since(Mark(0), event)
                .iter()
                .filter_map(|l| l.field("peer_pid").and_then(|p| p.parse().ok()))
                .collect()
        };
        assert!(
            callers("get_info").contains(&i64::from(observer_pid)),
            "{test}: the observer never asked {:?} GetInfo",
            plugin.socket()
        );
        let notifiers = callers("notify");
        assert!(
            !notifiers.is_empty() && notifiers.iter().all(|pid| *pid == i64::from(kubelet_pid)),
            "{test}: {:?} was notified by {notifiers:?}; only the stand-in ({kubelet_pid}) may",
            plugin.socket()
        );
    }
    let csi_notifications = csi.notifications();
    assert_eq!(
        csi_notifications.len(),
        1,
        "{test}: the CSI plugin heard {csi_notifications:?}"
    );

    let listed = admin::list_json(&options.admin_socket);
    for (plugin, plugin_type, name) in [
        (&csi, "CSIPlugin", "csi.example.com"),
        (&dra, "DRAPlugin", "dra.example.com"),
    ] {
        let entry = &listed[plugin.socket()];
        let pid = i64::from(plugin.pid().expect("running"));
        assert_eq!(entry["state"], "observed", "{test}: {entry}");
        assert_eq!(
            (entry["type"].as_str(), entry["name"].as_str()),
            (Some(plugin_type), Some(name)),
            "{test}: {entry}"
        );
        assert_eq!(
            entry["provenance"]["server"]["pid"].as_i64(),
            Some(pid),
            "{test}: {entry}"
        );
        assert_eq!(
            entry["provenance"]["creator"]["pid"].as_i64(),
            Some(pid),
            "{test}: {entry}"
        );
        let contact = &entry["first_contact"];
        assert_eq!(
            contact["process"]["pid"].as_i64(),
            Some(i64::from(kubelet_pid)),
            "{test}: the first contact is the stand-in's: {entry}"
        );
        assert!(
            contact["process"]["command"]
                .as_str()
                .is_some_and(|c| !c.is_empty()),
            "{test}: {entry}"
        );
        assert!(
            contact["after_creation_ms"]
                .as_f64()
                .is_some_and(|ms| ms > 0.0),
            "{test}: the contact is timed from the socket's creation: {entry}"
        );
    }
    // The stand-in lists what it registered; it saw no contact (inotify) and says why.
    let stand_in = admin::list_json(&kubelet_admin);
    let entry = &stand_in[csi.socket()];
    assert_eq!(entry["state"], "registered", "{test}: {entry}");
    assert_eq!(
        entry["first_contact_unknown"], "the inotify source does not see connections (eBPF only)",
        "{test}: {entry}"
    );

    // Liveness in observe mode: the CSI plugin dies (its socket stays); the observer says so.
    let csi_socket = csi.socket().to_path_buf();
    let mark = observer.event_mark();
    csi.kill().await;
    observer
        .wait_for_event(
            mark,
            "the plugin's death",
            EVENT_TIMEOUT,
            seen::unserved(&csi_socket),
        )
        .await;
    let listed = admin::list_json(&options.admin_socket);
    assert_eq!(listed[&csi_socket]["state"], "unserved", "{test}");
    let _ = std::fs::remove_file(&csi_socket);
    assert!(
        dra.events_since(Mark(0), "notify")
            .iter()
            .all(|l| l.field("peer_pid") != Some(observer_pid.to_string())),
        "{test}: the observer notified the DRA plugin"
    );
}

/// An observer is never a plugin's first caller. A plugin that serves exactly one connection
/// (kubelet's) and then closes its listener: beside a kubelet stand-in that dials it half a
/// second after it listens, as kubelet's reconciler does (a register-mode agent started then), the
/// observer waits for that first call (seen by eBPF; on inotify, which cannot see it, for 3 s
/// after the bind) before it asks GetInfo, so the plugin registers with the stand-in. (An
/// observer that asked at once took the plugin's one connection: the stand-in's GetInfo failed
/// and the plugin never registered.)
async fn an_observer_leaves_kubelet_the_first_call(source: Source) {
    let test = &test_name();
    let dir = PluginDir::new();
    let mut options = AgentOptions::new(source, &dir.root()).handlers(&[]);
    options.admin_socket = dir.root().with_file_name("observer.sock");
    let Some(observer) = AgentProcess::start(test, options.clone()).await else {
        return;
    };
    let once = plugin!(dir.path("once.sock"))
        .name("once.example.com")
        .arg("--serve-once")
        .start_listening()
        .await;
    // kubelet's reconciler dials a new socket within its 1 s period, not at once: the stand-in
    // starts half a second after the plugin listens (its first walk finds it).
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let kubelet = AgentProcess::start_kubelet_stand_in(test, &dir).await;
    let kubelet_pid = i64::from(kubelet.pid().expect("the stand-in runs"));
    once.wait_for_notify(true, EVENT_TIMEOUT).await;
    let callers: Vec<i64> = once
        .events_since(Mark(0), "get_info")
        .iter()
        .filter_map(|l| l.field("peer_pid").and_then(|p| p.parse().ok()))
        .collect();
    assert_eq!(
        callers,
        [kubelet_pid],
        "{test}: only the stand-in was served, first"
    );
    // The observer asked once the stand-in had called; the listener is closed by then, and it
    // lists the plugin as what it is now: nothing serves it.
    let deadline = std::time::Instant::now() + EVENT_TIMEOUT;
    loop {
        let listed = admin::list_json(&options.admin_socket);
        let state = listed[once.socket()]["state"].as_str().map(str::to_owned);
        if state.as_deref() == Some("unserved") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{test}: the observer lists {state:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    drop(observer);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observer_leaves_kubelet_the_first_call_on_ebpf() {
    an_observer_leaves_kubelet_the_first_call(Source::Ebpf).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observer_leaves_kubelet_the_first_call_on_inotify() {
    an_observer_leaves_kubelet_the_first_call(Source::Inotify).await;
}
