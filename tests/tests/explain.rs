//! "Why isn't my plugin registered?" (issue 48): `plugin-agent explain`, one scenario per
//! verdict, with the real agent, real plugin processes and, where kubelet's part matters, a
//! register-mode agent or a process named `kubelet` in its place. Each asserts through the admin
//! API (`explain -o json`, `list -o json`, `watch`): the verdict's reason, the failed check and its
//! fix, and that `list` gives the same reason as `explain`.

use plugin_agent_tests::admin::{self, check};
use plugin_agent_tests::http::{http_get, metrics_addr};
use plugin_agent_tests::{
    AgentOptions, AgentProcess, EVENT_TIMEOUT, Mark, PluginDir, Source, plugin, seen, test_name,
};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// A stand-in `kubelet` process makes every observer's kubelet check look at it: the test that
/// starts one runs alone (write); the other observe-mode tests share (read).
static KUBELET: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// `nobody`: an owner the agent is not.
const NOBODY: u32 = 65534;

async fn agent(
    test: &str,
    source: Source,
    dir: &Path,
    handlers: &[&str],
    extra: &[&str],
) -> Option<AgentProcess> {
    let mut options = AgentOptions::new(source, dir).handlers(handlers);
    options.extra = extra.iter().map(|s| s.to_string()).collect();
    AgentProcess::start(test, options).await
}

/// The one explanation of `target`, once its reason is `reason` (some verdicts come with time:
/// a retry's failure, kubelet's missing contact), asserting `list` says the same.
async fn explained(agent: &AgentProcess, target: &Path, reason: &str) -> Value {
    let deadline = std::time::Instant::now() + EVENT_TIMEOUT;
    loop {
        let mut all = admin::explain(agent.admin_socket(), &target.to_string_lossy());
        assert_eq!(all.len(), 1, "{all:#?}");
        let one = all.remove(0);
        if one["reason"] == reason {
            if one["known"] == true {
                let listed = admin::list_json(agent.admin_socket());
                assert_eq!(
                    listed[target]["reason"], reason,
                    "list disagrees: {listed:#?}"
                );
            }
            return one;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{}: never {reason}: {one:#}",
            target.display()
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Registered: `explain` finds the plugin by path, by the driver name GetInfo announced and by
/// file name, with hashed file names (kubelet 1.37's `<driver>-<hash>-reg.sock`,
/// `dra-<hash>-reg.sock`) from which nothing is inferred; `list` and `watch` carry the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_plugin_is_explained_by_path_and_driver_name_never_by_its_hashed_file_name() {
    let test = &test_name();
    let dir = PluginDir::new();
    let handlers = ["CSIPlugin=accept-all", "DRAPlugin=accept-all"];
    let agent = agent(test, Source::Inotify, &dir.root(), &handlers, &[])
        .await
        .expect("inotify");
    let csi = plugin!(dir.path("csi.example.com-5f2c9a1e-reg.sock"))
        .name("csi.example.com")
        .spawn();
    let dra = plugin!(dir.path("dra-0c1d2e3f4a5b-reg.sock"))
        .plugin_type("DRAPlugin")
        .name("gpu.example.com")
        .arg("--versions")
        .arg("v1.DRAPlugin")
        .spawn();
    for plugin in [&csi, &dra] {
        plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
        let event = agent
            .wait_for_event(
                Mark(0),
                "registered",
                EVENT_TIMEOUT,
                seen::registered(plugin.socket()),
            )
            .await;
        assert_eq!(
            event.field("reason").as_deref(),
            Some("registered"),
            "{test}: {event}"
        );
    }
    let by_path = explained(&agent, dra.socket(), "registered").await;
    assert_eq!(
        by_path["name"], "gpu.example.com",
        "{test}: identity is GetInfo's: {by_path:#}"
    );
    assert_eq!(by_path["type"], "DRAPlugin", "{test}");
    for name in [
        "exists",
        "is_socket",
        "listens",
        "path_fits_sockaddr_un",
        "get_info_valid",
        "unique_driver",
    ] {
        assert_eq!(
            check(&by_path, name).0,
            "pass",
            "{test}: {name}: {by_path:#}"
        );
    }
    let timeline = by_path["timeline"].to_string();
    assert!(
        timeline.contains("GetInfo answered type DRAPlugin name \\\"gpu.example.com\\\""),
        "{test}: {timeline}"
    );
    // By the driver name: the socket whose GetInfo said it, whatever its file is called.
    let by_name = admin::explain(agent.admin_socket(), "gpu.example.com");
    assert_eq!(by_name.len(), 1, "{test}: {by_name:#?}");
    assert_eq!(
        by_name[0]["socket_path"],
        dra.socket().to_string_lossy().as_ref()
    );
    // Parts of a hashed name are no name: `csi.example.com` is the CSI plugin by GetInfo, and
    // `dra` names nothing.
    let csi_by_name = admin::explain(agent.admin_socket(), "csi.example.com");
    assert_eq!(
        csi_by_name[0]["socket_path"],
        csi.socket().to_string_lossy().as_ref(),
        "{test}"
    );
    let nothing = admin::explain(agent.admin_socket(), "dra");
    assert_eq!(nothing[0]["reason"], "not_found", "{test}: {nothing:#?}");
    let by_file = admin::explain(agent.admin_socket(), "dra-0c1d2e3f4a5b-reg.sock");
    assert_eq!(
        by_file[0]["name"], "gpu.example.com",
        "{test}: {by_file:#?}"
    );
}

/// A socket left by a plugin from before a "reboot": the file is there, nothing listens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_socket_after_a_reboot_is_served_by_nobody() {
    let test = &test_name();
    let dir = PluginDir::new();
    let stale = dir.path("stale.sock");
    std::fs::create_dir_all(dir.root()).expect("mkdir");
    drop(std::os::unix::net::UnixListener::bind(&stale).expect("bind"));
    let agent = agent(
        test,
        Source::Inotify,
        &dir.root(),
        &["CSIPlugin=accept-all"],
        &["--metrics-addr", "127.0.0.1:0"],
    )
    .await
    .expect("inotify");
    let metrics = metrics_addr(&agent).await;
    let one = explained(&agent, &stale, "served_by_nobody").await;
    let (result, detail, fix) = check(&one, "listens");
    assert_eq!(result, "fail", "{test}: {one:#}");
    assert!(detail.contains("refused"), "{test}: {detail}");
    assert!(fix.contains("restart the plugin"), "{test}: {fix}");
    assert_eq!(check(&one, "exists").0, "pass", "{test}");
    // Every surface says the same: the watch event (its reason stamped when it was published),
    // and the metric counts the one stale socket.
    let unserved = agent
        .wait_for_event(Mark(0), "unserved", EVENT_TIMEOUT, seen::unserved(&stale))
        .await;
    assert_eq!(
        unserved.field("reason").as_deref(),
        Some("served_by_nobody"),
        "{test}: {unserved}"
    );
    problems_become(metrics, "served_by_nobody", 1).await;
    // The fix: the plugin serves the path again (it binds a new socket there).
    let plugin = plugin!(&stale).name("stale.example.com").spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    problems_become(metrics, "served_by_nobody", 0).await;
    explained(&agent, &stale, "registered").await;
}

/// Waits until the agent's `plugin_agent_plugin_problems{reason}` is `count`.
async fn problems_become(metrics: std::net::SocketAddr, reason: &str, count: u64) {
    let series = format!("plugin_agent_plugin_problems{{reason=\"{reason}\"}} ");
    let deadline = std::time::Instant::now() + EVENT_TIMEOUT;
    loop {
        let (status, body) = tokio::task::spawn_blocking(move || http_get(metrics, "/metrics"))
            .await
            .expect("scrape");
        assert_eq!(status, 200, "{body}");
        let now = body
            .lines()
            .find_map(|line| line.strip_prefix(&series))
            .and_then(|n| n.trim().parse::<u64>().ok());
        if now == Some(count) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{series}never {count}, last {now:?}:\n{body}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// A 0700 socket served by a non-root plugin (umask 0077, uid 65534), dialled by an agent that
/// runs as root without `CAP_DAC_OVERRIDE`: refused, and `explain` says which dialler may.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_0700_socket_of_a_non_root_plugin_refuses_root_without_dac_override() {
    let test = &test_name();
    if !plugin_agent_tests::env::privileged(test) {
        return;
    }
    let dir = PluginDir::new();
    let private = dir.path("nobody");
    std::fs::create_dir_all(&private).expect("mkdir");
    open_to_nobody(&dir, &private);
    let mut options = AgentOptions::new(Source::Inotify, &dir.root());
    options.wrapper = [
        "setpriv",
        "--bounding-set",
        "-dac_override",
        "--inh-caps",
        "-dac_override",
        "--",
    ]
    .map(String::from)
    .to_vec();
    let agent = AgentProcess::start(test, options).await.expect("inotify");
    let socket = private.join("driver.sock");
    let plugin = plugin!(&socket)
        .name("private.example.com")
        .arg("--umask")
        .arg("0077")
        .as_user(NOBODY, NOBODY)
        .spawn();
    plugin.wait_for_event("serving", EVENT_TIMEOUT).await;
    let one = explained(&agent, &socket, "socket_permissions").await;
    assert!(
        check(&one, "kubelet_can_dial")
            .1
            .contains("mode 0700, owner 65534:65534"),
        "{test}: {one:#}"
    );
    assert_eq!(
        check(&one, "root_without_dac_override_can_dial").0,
        "fail",
        "{test}: {one:#}"
    );
    let (result, detail, _) = check(&one, "agent_can_dial");
    assert_eq!(result, "fail", "{test}: {one:#}");
    assert!(
        detail.contains("without CAP_DAC_OVERRIDE"),
        "{test}: {detail}"
    );
}

/// Lets uid 65534 search the test's directories and create its socket in `private`.
fn open_to_nobody(dir: &PluginDir, private: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let base = dir.root().parent().expect("a base").to_path_buf();
    for d in [base, dir.root()] {
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    std::os::unix::fs::chown(private, Some(NOBODY), Some(NOBODY)).expect("chown");
}

/// A registration directory deep enough that the plugin's socket path is 108 bytes or more: the
/// plugin binds it through its directory's descriptor, nothing can dial it by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_path_of_108_bytes_or_more_is_too_long() {
    let test = &test_name();
    let dir = PluginDir::new();
    let agent = agent(
        test,
        Source::Inotify,
        &dir.root(),
        &["CSIPlugin=accept-all"],
        &[],
    )
    .await
    .expect("inotify");
    let mut deep = dir.root();
    while deep.as_os_str().len() < 100 {
        deep = deep.join("rolling-update");
    }
    let socket = deep.join("driver.example.com-reg.sock");
    assert!(socket.as_os_str().len() >= 108, "{}", socket.display());
    let plugin = plugin!(&socket).name("driver.example.com").spawn();
    plugin.wait_for_event("serving", EVENT_TIMEOUT).await;
    let one = explained(&agent, &socket, "path_too_long").await;
    let (result, detail, fix) = check(&one, "path_fits_sockaddr_un");
    assert_eq!(result, "fail", "{test}: {one:#}");
    assert!(
        detail.starts_with(&format!("{} bytes", socket.as_os_str().len())),
        "{test}: {detail}"
    );
    assert!(fix.contains("shorten"), "{test}: {fix}");
    assert!(
        plugin.events_since(Mark(0), "get_info").is_empty(),
        "{test}: nothing can dial a path that long"
    );
}

/// Observe mode beside a kubelet whose `--root-dir` is elsewhere: the plugin's directory is not
/// the one kubelet watches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_outside_the_directory_kubelet_watches_is_outside_kubelet_dir() {
    let test = &test_name();
    let _alone = KUBELET.write().await;
    let dir = PluginDir::new();
    let root = dir.outside("kubelet-root");
    std::fs::create_dir_all(root.join("plugins_registry")).expect("mkdir");
    let kubelet = dir.outside("bin/kubelet");
    std::fs::create_dir_all(kubelet.parent().expect("bin")).expect("mkdir bin");
    std::fs::copy("/bin/sh", &kubelet).expect("copy sh");
    let mut fake = Command::new(&kubelet)
        .args(["-c", "read line", "kubelet"])
        .arg(format!("--root-dir={}", root.display()))
        .stdin(Stdio::piped())
        .spawn()
        .expect("fake kubelet");
    let agent = agent(
        test,
        Source::Inotify,
        &dir.root(),
        &[],
        &["--observe-contact", "get-info"],
    )
    .await
    .expect("inotify");
    let plugin = plugin!(dir.path("csi.sock"))
        .name("csi.example.com")
        .spawn();
    plugin.wait_for_event("get_info", EVENT_TIMEOUT).await;
    let one = explained(&agent, plugin.socket(), "outside_kubelet_dir").await;
    let (result, detail, fix) = check(&one, "kubelet_dir");
    assert_eq!(result, "fail", "{test}: {one:#}");
    let registry = root.join("plugins_registry");
    assert!(
        detail.contains(&format!(
            "kubelet pid {} watches {} (--root-dir)",
            fake.id(),
            registry.display()
        )),
        "{test}: {detail}"
    );
    assert!(fix.contains("plugins_registry"), "{test}: {fix}");
    let _ = fake.kill();
    let _ = fake.wait();
}

/// Beside kubelet's plugin manager (a register-mode agent in its place, with no handler for the
/// plugin's type, so it answers `Notify(false)`), a plugin that exits on `Notify(false)`, as
/// node-driver-registrar does: the observing agent (eBPF, which sees kubelet's contact) says
/// kubelet most likely told it `Notify(false)` and where to read why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_that_exits_on_notify_false_beside_kubelet_stopped_after_kubelet_contact() {
    let test = &test_name();
    let _shared = KUBELET.read().await;
    let dir = PluginDir::new();
    let mut options = AgentOptions::new(Source::Ebpf, &dir.root()).handlers(&[]);
    options.admin_socket = dir.root().with_file_name("observer.sock");
    let Some(observer) = AgentProcess::start(test, options).await else {
        return;
    };
    let _kubelet = AgentProcess::start_kubelet_stand_in(test, &dir).await;
    let plugin = plugin!(dir.path("registrar.sock"))
        .plugin_type("DRAPlugin")
        .name("dra.example.com")
        .arg("--exit-on-notify-false")
        .spawn();
    plugin.wait_for_event("exiting", EVENT_TIMEOUT).await;
    let one = explained(&observer, plugin.socket(), "stopped_after_kubelet_contact").await;
    assert_eq!(check(&one, "kubelet_contact").0, "pass", "{test}: {one:#}");
    let (result, detail, fix) = check(&one, "served_after_kubelet_contact");
    assert_eq!(result, "fail", "{test}: {one:#}");
    assert!(detail.contains("has exited"), "{test}: {detail}");
    assert!(fix.contains("RegisterPlugin error"), "{test}: {fix}");
}

/// Two sockets announce one driver name: the older is the duplicate, the newer is what kubelet
/// 1.33+ uses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_name_on_two_sockets_makes_the_older_a_duplicate() {
    let test = &test_name();
    let dir = PluginDir::new();
    let agent = agent(
        test,
        Source::Inotify,
        &dir.root(),
        &["CSIPlugin=accept-all"],
        &[],
    )
    .await
    .expect("inotify");
    let old = plugin!(dir.path("old.sock"))
        .name("csi.example.com")
        .spawn();
    old.wait_for_notify(true, EVENT_TIMEOUT).await;
    let new = plugin!(dir.path("new.sock"))
        .name("csi.example.com")
        .spawn();
    new.wait_for_notify(true, EVENT_TIMEOUT).await;
    let older = explained(&agent, old.socket(), "duplicate_driver").await;
    let (result, detail, _) = check(&older, "unique_driver");
    assert_eq!(result, "fail", "{test}: {older:#}");
    assert!(
        detail.contains(&format!("{} (registered", new.socket().display()))
            && detail.contains("is newer"),
        "{test}: {detail}"
    );
    let newer = explained(&agent, new.socket(), "registered").await;
    assert!(
        check(&newer, "unique_driver").1.contains("is older"),
        "{test}: {newer:#}"
    );
    // By name: both.
    assert_eq!(
        admin::explain(agent.admin_socket(), "csi.example.com").len(),
        2,
        "{test}"
    );
}

/// GetInfo answers kubelet would refuse: versions it does not speak, a type it has no handler
/// for (observe mode: kubelet's call), an empty name (refused by the agent itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_info_answer_kubelet_refuses_is_invalid_info() {
    let test = &test_name();
    let _shared = KUBELET.read().await;
    let dir = PluginDir::new();
    let agent = agent(
        test,
        Source::Inotify,
        &dir.root(),
        &[],
        &["--observe-contact", "get-info"],
    )
    .await
    .expect("inotify");
    let versions = plugin!(dir.path("versions.sock"))
        .name("csi.example.com")
        .arg("--versions")
        .arg("9.9.9")
        .spawn();
    let unknown = plugin!(dir.path("type.sock"))
        .plugin_type("FooPlugin")
        .name("foo.example.com")
        .spawn();
    let nameless = plugin!(dir.path("nameless.sock"))
        .arg("--name")
        .arg("")
        .spawn();
    let one = explained(&agent, versions.socket(), "invalid_info").await;
    let (result, detail, fix) = check(&one, "get_info_valid");
    assert_eq!(result, "fail", "{test}: {one:#}");
    assert!(
        detail.contains(
            "none of the supported versions [\"9.9.9\"] is one kubelet speaks for CSIPlugin"
        ),
        "{test}: {detail}"
    );
    assert!(fix.contains("CSI 1.x"), "{test}: {fix}");
    let one = explained(&agent, unknown.socket(), "invalid_info").await;
    assert!(
        check(&one, "get_info_valid")
            .1
            .contains("unknown plugin type \"FooPlugin\""),
        "{test}: {one:#}"
    );
    let one = explained(&agent, nameless.socket(), "invalid_info").await;
    assert!(
        check(&one, "get_info_valid").1.contains("empty name"),
        "{test}: {one:#}"
    );
}

/// The policy refuses the plugin (served by uid 65534, only uid 0 allowed); explained by the
/// driver name it announced, though nothing registered under it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_the_policy_refuses_is_rejected_by_policy() {
    let test = &test_name();
    if !plugin_agent_tests::env::privileged(test) {
        return;
    }
    let dir = PluginDir::new();
    let agent = agent(
        test,
        Source::Inotify,
        &dir.root(),
        &["CSIPlugin=accept-all"],
        &["--policy-allow-uid", "0"],
    )
    .await
    .expect("inotify");
    use std::os::unix::fs::PermissionsExt;
    let base = dir.root().parent().expect("a base").to_path_buf();
    std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::set_permissions(dir.root(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let plugin = plugin!(dir.path("nobody.sock"))
        .name("nobody.example.com")
        .as_user(NOBODY, NOBODY)
        .spawn();
    plugin.wait_for_notify(false, EVENT_TIMEOUT).await;
    let one = explained(&agent, plugin.socket(), "rejected_by_policy").await;
    let (result, detail, fix) = check(&one, "policy");
    assert_eq!(result, "fail", "{test}: {one:#}");
    assert!(
        detail.contains("uid 65534 not in allow_uids [0]"),
        "{test}: {detail}"
    );
    assert!(fix.contains("policy reload"), "{test}: {fix}");
    let by_name = admin::explain(agent.admin_socket(), "nobody.example.com");
    assert_eq!(
        by_name[0]["reason"], "rejected_by_policy",
        "{test}: {by_name:#?}"
    );
}

/// Observe mode on eBPF, with no kubelet: nobody but the agent ever connects to the socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_kubelet_never_contacts_is_kubelet_never_connected() {
    let test = &test_name();
    let _shared = KUBELET.read().await;
    let dir = PluginDir::new();
    let Some(agent) = agent(test, Source::Ebpf, &dir.root(), &[], &[]).await else {
        return;
    };
    let plugin = plugin!(dir.path("lonely.sock"))
        .name("lonely.example.com")
        .spawn();
    agent
        .wait_for_event(
            Mark(0),
            "observed",
            EVENT_TIMEOUT,
            seen::observed(plugin.socket()),
        )
        .await;
    let one = explained(&agent, plugin.socket(), "kubelet_never_connected").await;
    let (result, _, fix) = check(&one, "kubelet_contact");
    assert_eq!(result, "fail", "{test}: {one:#}");
    assert!(fix.contains("kubelet_dir"), "{test}: {fix}");
}

/// The timeline says when the socket was first seen listening, between its creation and the
/// GetInfo answer: the kernel's report of its `listen()` (eBPF), else the agent's first connect
/// that succeeded (inotify: the registration's dial, or its look when the plugin listened late).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_timeline_says_when_the_socket_was_first_seen_listening() {
    for (source, seen_by) in [
        (Source::Ebpf, "the kernel's report of its listen()"),
        (Source::Inotify, "the agent's first connect that succeeded"),
    ] {
        let test = &format!("{}-{source:?}", test_name());
        let dir = PluginDir::new();
        let Some(agent) = agent(test, source, &dir.root(), &["CSIPlugin=accept-all"], &[]).await
        else {
            continue;
        };
        let plugin = plugin!(dir.path("listening.sock"))
            .name("listening.example.com")
            .spawn();
        plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
        // The registration's dial may reach the socket before the watcher reads the kernel's
        // report of its listen(), which then replaces the dial's time.
        let deadline = std::time::Instant::now() + EVENT_TIMEOUT;
        let one = loop {
            let one = explained(&agent, plugin.socket(), "registered").await;
            if one["timeline"].to_string().contains(seen_by) {
                break one;
            }
            assert!(std::time::Instant::now() < deadline, "{test}: {one:#}");
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        };
        let whats: Vec<&str> = one["timeline"]
            .as_array()
            .expect("a timeline")
            .iter()
            .map(|t| t["what"].as_str().unwrap_or_default())
            .collect();
        let at = |prefix: &str| {
            whats
                .iter()
                .position(|w| w.starts_with(prefix))
                .unwrap_or_else(|| panic!("{test}: no {prefix:?} in {whats:#?}"))
        };
        let listening = at("listening (seen by ");
        assert!(whats[listening].contains(seen_by), "{test}: {whats:#?}");
        assert!(
            at("created by") < listening && listening < at("GetInfo answered"),
            "{test}: oldest first: {whats:#?}"
        );
    }
}

/// A plugin that failed after a valid GetInfo (no handler for its type) is found by the driver
/// name it announced, and its timeline shows the answer before the failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_without_a_handler_is_found_by_driver_name_with_its_get_info_answer() {
    let test = &test_name();
    let dir = PluginDir::new();
    let agent = agent(
        test,
        Source::Inotify,
        &dir.root(),
        &["DRAPlugin=accept-all"],
        &["--mode", "register"],
    )
    .await
    .expect("inotify");
    let plugin = plugin!(dir.path("csi-7f3e2a-reg.sock"))
        .name("unhandled.example.com")
        .spawn();
    plugin.wait_for_notify(false, EVENT_TIMEOUT).await;
    let mut by_name = Vec::new();
    let deadline = std::time::Instant::now() + EVENT_TIMEOUT;
    while by_name
        .first()
        .is_none_or(|one: &Value| one["reason"] != "no_handler")
    {
        assert!(std::time::Instant::now() < deadline, "{test}: {by_name:#?}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        by_name = admin::explain(agent.admin_socket(), "unhandled.example.com");
    }
    assert_eq!(by_name.len(), 1, "{test}: {by_name:#?}");
    let one = &by_name[0];
    assert_eq!(
        one["socket_path"],
        plugin.socket().to_string_lossy().as_ref(),
        "{test}"
    );
    assert_eq!(one["name"], "unhandled.example.com", "{test}: {one:#}");
    assert_eq!(check(one, "get_info_valid").0, "pass", "{test}: {one:#}");
    let whats: Vec<&str> = one["timeline"]
        .as_array()
        .expect("a timeline")
        .iter()
        .map(|t| t["what"].as_str().unwrap_or_default())
        .collect();
    let answered = whats.iter().position(|w| {
        w.starts_with("GetInfo answered type CSIPlugin name \"unhandled.example.com\"")
    });
    let failed = whats.iter().position(|w| w.starts_with("attempt "));
    assert!(
        matches!((answered, failed), (Some(a), Some(f)) if a < f),
        "{test}: {whats:#?}"
    );
}

/// Targets the agent never saw get the checks that still apply: a name, a path outside the
/// tree, a path under it that is no socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn targets_the_agent_never_saw_get_the_checks_that_apply() {
    let test = &test_name();
    let dir = PluginDir::new();
    let agent = agent(
        test,
        Source::Inotify,
        &dir.root(),
        &["CSIPlugin=accept-all"],
        &[],
    )
    .await
    .expect("inotify");
    let nothing = admin::explain(agent.admin_socket(), "never.example.com");
    assert_eq!(nothing[0]["reason"], "not_found", "{test}: {nothing:#?}");
    let outside = dir.outside("elsewhere.sock");
    drop(std::os::unix::net::UnixListener::bind(&outside).expect("bind"));
    let one = &admin::explain(agent.admin_socket(), &outside.to_string_lossy())[0];
    assert_eq!(one["reason"], "outside_watched_dir", "{test}: {one:#}");
    assert_eq!(one["known"], false, "{test}");
    assert_eq!(check(one, "listens").0, "fail", "{test}: {one:#}");
    let file: PathBuf = dir.path("plain-file.sock");
    std::fs::write(&file, b"").expect("write");
    let one = &admin::explain(agent.admin_socket(), &file.to_string_lossy())[0];
    assert_eq!(one["reason"], "not_a_socket", "{test}: {one:#}");
    let gone = dir.path("gone.sock");
    let one = &admin::explain(agent.admin_socket(), &gone.to_string_lossy())[0];
    assert_eq!(one["reason"], "not_found", "{test}: {one:#}");
}

/// Among 10,000 registered plugins `explain` finds the one plugin by path, by driver name and by
/// file name, and prints how long the command's whole run took (its start, the connection, the
/// answer; the median of 20 each). The numbers are docs/benchmarks.md's ("explain among 10,000
/// plugins"); the test asserts what was found, not a wall time, which the machine's load decides.
/// Heavy (10,000 plugins): run alone with `--ignored`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "10,000 plugins: run alone, `cargo test -p plugin-agent-tests --test explain -- --ignored`"]
async fn explain_finds_the_plugin_among_10_000_by_path_driver_name_and_file_name() {
    const PLUGINS: usize = 10_000;
    let test = &test_name();
    let dir = PluginDir::new();
    let agent = agent(
        test,
        Source::Inotify,
        &dir.root(),
        &["CSIPlugin=accept-all"],
        &[],
    )
    .await
    .expect("inotify");
    let host = plugin_agent_tests::host::PluginHost::start(
        env!("CARGO_BIN_EXE_plugin-host"),
        &dir.root(),
        PLUGINS,
        &[],
    )
    .await;
    host.wait_registered(Mark(0), PLUGINS, std::time::Duration::from_secs(300))
        .await;
    let listed = admin::list_json(agent.admin_socket());
    assert_eq!(listed.len(), PLUGINS, "{test}");
    let (path, row) = listed.iter().nth(PLUGINS / 2).expect("a middle plugin");
    let name = row["name"].as_str().expect("a name").to_string();
    let file = path
        .file_name()
        .expect("a file name")
        .to_string_lossy()
        .into_owned();
    let mut report = Vec::new();
    for target in [path.to_string_lossy().into_owned(), name.clone(), file] {
        let mut took: Vec<std::time::Duration> = (0..20)
            .map(|_| {
                let started = std::time::Instant::now();
                let answer = admin::explain(agent.admin_socket(), &target);
                let took = started.elapsed();
                assert_eq!(answer.len(), 1, "{test}: {answer:#?}");
                let one = &answer[0];
                assert_eq!(
                    one["socket_path"],
                    path.to_string_lossy().as_ref(),
                    "{test}: {target}: {one:#}"
                );
                assert_eq!(one["name"], name.as_str(), "{test}: {one:#}");
                assert_eq!(one["reason"], "registered", "{test}: {one:#}");
                took
            })
            .collect();
        took.sort();
        report.push(format!(
            "{target}: median {:?}, max {:?}",
            took[took.len() / 2],
            took[took.len() - 1]
        ));
    }
    eprintln!("{test}: explain among {PLUGINS} plugins: {report:#?}");
}
