//! Register and observe modes (issue 19): beside kubelet, which owns `plugins_registry` and
//! notifies its plugins, the agent observes and never notifies; it registers only where told to,
//! and warns when that directory is one a running kubelet watches. Real plugin, handler and agent
//! processes; the mode is the executor's, the same on every source, so these run on inotify.

use plugin_agent_tests::{
    AgentOptions, AgentProcess, EVENT_TIMEOUT, Mark, PluginDir, Source, admin, plugin, test_name,
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
    agent
        .wait_for_log("the mode", EVENT_TIMEOUT, |l| {
            l.message().starts_with("no handler configured: observing")
        })
        .await;
    let plugin = plugin!(dir.path("csi.sock"))
        .name("csi.example.com")
        .spawn();
    plugin.wait_for_event("get_info", EVENT_TIMEOUT).await;
    agent
        .wait_for_log("observed", EVENT_TIMEOUT, |l| {
            l.message() == "plugin observed" && l.field_is("plugin_name", "csi.example.com")
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
    let mark = agent.mark();
    plugin.stop().await;
    agent
        .wait_for_log_after(mark, "the removal", EVENT_TIMEOUT, |l| {
            l.message() == "observed plugin's socket removed"
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
        .wait_for_log("observed", EVENT_TIMEOUT, |l| {
            l.message() == "plugin observed"
        })
        .await;
    let listed = admin::list(&dir.root().with_file_name("admin.sock"));
    let entry = listed.get(plugin.socket()).expect("listed");
    assert_eq!(
        (entry.state.as_str(), entry.name.as_str()),
        ("observed", ""),
        "{test}"
    );
    assert!(
        plugin.events_since(Mark(0), "get_info").is_empty()
            && plugin.events_since(Mark(0), "notify").is_empty(),
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
