//! Who created and who serves every plugin socket, and the policy that refuses impostors
//! (`agent/src/provenance`, `agent/src/policy.rs`).
//!
//! Real processes in real cgroups: each test makes cgroup v2 children and starts plugins in
//! them (moved in before they execute, so their bind happens there), or runs a plugin as
//! another user. Provenance is asserted per source: the creator as eBPF records it in the
//! kernel, as fanotify's pid names it, and as unknown on inotify; the server from the
//! registration connection's credentials on all three.

use plugin_agent_tests::cgroup::TestCgroup;
use plugin_agent_tests::env::privileged;
use plugin_agent_tests::http::{http_get, metrics_addr};
use plugin_agent_tests::{
    AgentOptions, AgentProcess, EVENT_TIMEOUT, Mark, PluginDir, Source, admin, per_source, plugin,
    seen, test_name,
};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

per_source!(
    the_creator_and_the_server_are_named_with_their_cgroup,
    an_impostor_from_a_disallowed_cgroup_is_refused_while_the_real_plugin_stays_registered,
    a_socket_bound_by_one_process_and_served_by_another_is_flagged,
);

/// The agent's admin socket for an agent started with [`AgentOptions::new`] on `dir`.
fn admin_socket(dir: &PluginDir) -> PathBuf {
    dir.root().with_file_name("admin.sock")
}

/// `plugin-agent list -o json`'s row for `socket`.
fn listed(dir: &PluginDir, socket: &Path) -> Value {
    admin::list_json(&admin_socket(dir))
        .remove(socket)
        .unwrap_or_else(|| panic!("{} is not listed", socket.display()))
}

/// A cgroup for the test, or a failure: the tests here run as root, which can make one.
fn cgroup(label: &str) -> TestCgroup {
    TestCgroup::new(label).unwrap_or_else(|| panic!("cannot create a cgroup v2 child ({label})"))
}

/// Starts the agent on `source` with `extra` arguments; `None`: skipped.
async fn agent(
    test: &str,
    source: Source,
    dir: &PluginDir,
    extra: &[&str],
) -> Option<AgentProcess> {
    let mut options = AgentOptions::new(source, &dir.root());
    options.extra = extra.iter().map(|a| a.to_string()).collect();
    AgentProcess::start(test, options).await
}

/// Writes `text` as the agent's configuration file in `dir`'s base.
fn write_config(dir: &PluginDir, text: &str) -> PathBuf {
    let path = dir.root().with_file_name("agent.toml");
    std::fs::write(&path, text).expect("write the configuration file");
    path
}

/// `plugin-agent policy reload` against the agent of `dir`: success, stdout, stderr.
fn policy_reload(dir: &PluginDir) -> (bool, String, String) {
    let output = Command::new(plugin_agent_tests::env::agent_bin())
        .arg("--admin-socket")
        .arg(admin_socket(dir))
        .args(["policy", "reload"])
        .output()
        .expect("run plugin-agent policy reload");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// A plugin started in its own cgroup is named, on every source, as its server (pid, uid, gid,
/// command, cgroup) from the registration connection; its creator is recorded in the kernel
/// with eBPF, taken from fanotify's pid, and unknown (saying why) with inotify. The registration's
/// log line names both.
async fn the_creator_and_the_server_are_named_with_their_cgroup(source: Source) {
    let test = test_name();
    if !privileged(&test) {
        return;
    }
    let group = cgroup("driver");
    let dir = PluginDir::new();
    let Some(agent) = agent(&test, source, &dir, &[]).await else {
        return;
    };
    let socket = dir.path("driver.sock");
    let plugin = plugin!(&socket)
        .name("driver.csi.example.com")
        .in_cgroup(&group)
        .spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    let registered = agent
        .wait_for_event(
            Mark(0),
            "registered",
            EVENT_TIMEOUT,
            seen::registered(&socket),
        )
        .await;
    let pid = plugin.pid().expect("the plugin runs");

    let provenance = listed(&dir, &socket)["provenance"].clone();
    let server = &provenance["server"];
    assert_eq!(server["pid"], pid, "{provenance}");
    assert_eq!(server["uid"], 0, "{provenance}");
    assert_eq!(server["gid"], 0, "{provenance}");
    assert_eq!(server["command"], "example-plugin", "{provenance}");
    assert_eq!(server["cgroup"], group.path(), "{provenance}");
    let creator = &provenance["creator"];
    match source {
        Source::Ebpf | Source::Fanotify => {
            assert_eq!(creator["pid"], pid, "{provenance}");
            assert_eq!(creator["uid"], 0, "{provenance}");
            assert_eq!(creator["command"], "example-plugin", "{provenance}");
            assert_eq!(creator["cgroup"], group.path(), "{provenance}");
            assert_eq!(provenance["creator_is_not_server"], false, "{provenance}");
        }
        Source::Inotify => {
            assert!(creator.is_null(), "inotify names no creator: {provenance}");
            let why = provenance["creator_unknown"].as_str().unwrap_or_default();
            assert!(why.contains("inotify"), "{provenance}");
        }
    }
    let said = &registered.0["provenance"]["server"];
    assert!(
        said["pid"] == pid && said["cgroup"] == group.path(),
        "the registered event names the server: {registered}"
    );
}

/// The policy allows the driver name only from one cgroup. An impostor with the same name in
/// another cgroup is told why in NotifyRegistrationStatus, never reaches the handler, is listed
/// `rejected` with the rule and the name it claimed, and is counted by rule; the real plugin
/// stays registered throughout.
async fn an_impostor_from_a_disallowed_cgroup_is_refused_while_the_real_plugin_stays_registered(
    source: Source,
) {
    let test = test_name();
    if !privileged(&test) {
        return;
    }
    let (trusted, elsewhere) = (cgroup("trusted"), cgroup("elsewhere"));
    let dir = PluginDir::new();
    let config = write_config(
        &dir,
        &format!(
            r#"
            [[policy]]
            id = "example-csi"
            type = "CSIPlugin"
            name = "*.csi.example.com"
            allow_cgroups = ["{}"]
            "#,
            trusted.path()
        ),
    );
    let config = config.display().to_string();
    let extra = ["--config", &config, "--metrics-addr", "127.0.0.1:0"];
    let Some(agent) = agent(&test, source, &dir, &extra).await else {
        return;
    };
    let real_socket = dir.path("real.sock");
    let real = plugin!(&real_socket)
        .name("ebs.csi.example.com")
        .in_cgroup(&trusted)
        .spawn();
    real.wait_for_notify(true, EVENT_TIMEOUT).await;

    let mark = agent.event_mark();
    let fake_socket = dir.path("fake.sock");
    let fake = plugin!(&fake_socket)
        .name("ebs.csi.example.com")
        .in_cgroup(&elsewhere)
        .spawn();
    let refused = fake.wait_for_notify(false, EVENT_TIMEOUT).await;
    let error = refused.field("error").unwrap_or_default();
    assert!(
        error.starts_with("rejected by policy: example-csi (cgroup ")
            && error.contains(&format!("served by uid 0 cgroup {}", elsewhere.path())),
        "{refused}"
    );
    let rejected = agent
        .wait_for_event(
            mark,
            "the refusal",
            EVENT_TIMEOUT,
            seen::rejected(&fake_socket),
        )
        .await;
    assert!(
        rejected
            .field("error")
            .is_some_and(|e| e.starts_with("rejected by policy: example-csi (cgroup ")),
        "the rejected event carries the refusal: {rejected}"
    );

    let fake_row = listed(&dir, &fake_socket);
    assert_eq!(fake_row["state"], "rejected", "{fake_row}");
    assert_eq!(fake_row["rejected_by_rule"], "example-csi", "{fake_row}");
    assert_eq!(fake_row["name"], "ebs.csi.example.com", "{fake_row}");
    assert_eq!(fake_row["provenance"]["server"]["cgroup"], elsewhere.path());
    assert_eq!(listed(&dir, &real_socket)["state"], "registered");
    // A handler that heard of it would have registered it, or failed it (and rolled back):
    // every event about the impostor is a refusal.
    let heard: Vec<_> = agent
        .events_since(mark, seen::about(&fake_socket))
        .into_iter()
        .filter(|e| {
            seen::registered(&fake_socket)(e)
                || seen::registration_failed(&fake_socket)(e)
                || seen::deregistered(&fake_socket)(e)
        })
        .collect();
    assert!(
        heard.is_empty(),
        "the handler never heard of the impostor: {heard:?}"
    );
    assert!(
        fake.events_since(plugin_agent_tests::Mark(0), "notify")
            .iter()
            .all(|n| n.flag("registered") == Some(false)),
        "the impostor was never told it is registered"
    );
    let addr = metrics_addr(&agent).await;
    let (_, metrics) = tokio::task::spawn_blocking(move || http_get(addr, "/metrics"))
        .await
        .expect("scrape");
    assert!(
        metrics
            .lines()
            .any(|l| l == r#"plugin_agent_policy_rejections_total{rule="example-csi"} 1"#),
        "one refusal counted by rule:\n{}",
        metrics
            .lines()
            .filter(|l| l.contains("policy"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// A launcher binds the socket and a child it starts listens on it and serves it, then the
/// launcher exits: the creator (kept as the kernel recorded it with eBPF, though the process is
/// gone) and the server are different processes, and the agent says so. inotify cannot know.
async fn a_socket_bound_by_one_process_and_served_by_another_is_flagged(source: Source) {
    let test = test_name();
    if !privileged(&test) {
        return;
    }
    let dir = PluginDir::new();
    let Some(_agent) = agent(&test, source, &dir, &[]).await else {
        return;
    };
    let socket = dir.path("launched.sock");
    let mut launcher = plugin!(&socket).arg("--listen-in-child").spawn();
    let launcher_pid = launcher.pid().expect("the launcher runs");
    let served_by = launcher.wait_for_launch(EVENT_TIMEOUT).await;
    launcher.wait_for_notify(true, EVENT_TIMEOUT).await;

    let provenance = listed(&dir, &socket)["provenance"].clone();
    assert_eq!(provenance["server"]["pid"], served_by, "{provenance}");
    match source {
        Source::Ebpf | Source::Fanotify => {
            assert_eq!(provenance["creator"]["pid"], launcher_pid, "{provenance}");
            assert_eq!(provenance["creator_is_not_server"], true, "{provenance}");
        }
        Source::Inotify => {
            assert!(provenance["creator"].is_null(), "{provenance}");
            assert_eq!(provenance["creator_is_not_server"], false, "{provenance}");
        }
    }
    if source == Source::Ebpf {
        assert_eq!(
            provenance["creator"]["command"], "example-plugin",
            "the kernel's record outlives the creator: {provenance}"
        );
    }
}

/// `--policy-allow-uid 0`: a plugin served by uid 65534 is refused, saying which uid; one
/// served by root registers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_uid_rule_refuses_a_plugin_served_by_another_user() {
    let test = test_name();
    if !privileged(&test) {
        return;
    }
    let dir = PluginDir::new();
    let Some(_agent) = agent(&test, Source::Inotify, &dir, &["--policy-allow-uid", "0"]).await
    else {
        return;
    };
    // Another user must be able to reach the directory and create its socket there.
    use std::os::unix::fs::PermissionsExt;
    let base = dir.root().parent().expect("a base").to_path_buf();
    std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::set_permissions(dir.root(), std::fs::Permissions::from_mode(0o777)).expect("chmod");

    let nobody_socket = dir.path("nobody.sock");
    let nobody = plugin!(&nobody_socket)
        .name("nobody.example.com")
        .as_user(65534, 65534)
        .spawn();
    let refused = nobody.wait_for_notify(false, EVENT_TIMEOUT).await;
    let error = refused.field("error").unwrap_or_default();
    assert!(
        error.starts_with("rejected by policy: command-line (uid 65534 not in allow_uids [0])")
            && error.contains("served by uid 65534"),
        "{refused}"
    );
    let row = listed(&dir, &nobody_socket);
    assert_eq!(row["state"], "rejected", "{row}");
    assert_eq!(row["provenance"]["server"]["uid"], 65534, "{row}");

    let root_socket = dir.path("root.sock");
    let root = plugin!(&root_socket).name("root.example.com").spawn();
    root.wait_for_notify(true, EVENT_TIMEOUT).await;
    assert_eq!(listed(&dir, &root_socket)["state"], "registered");
}

/// A cgroup rule is not fooled by a recycled pid. A process in a disallowed cgroup listens,
/// hands its listener to a child and exits; a process in the allowed cgroup takes its pid before
/// the agent dials. `SO_PEERCRED` names the pid of the process that listened, and `/proc` says
/// of that pid what the newcomer is: the agent takes nothing read by a pid whose process is gone,
/// so the server's cgroup is unknown and the plugin refused, never registered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recycled_pid_in_an_allowed_cgroup_does_not_pass_a_cgroup_rule() {
    let test = test_name();
    if !privileged(&test) {
        return;
    }
    let (allowed, disallowed) = (cgroup("allowed"), cgroup("disallowed"));
    let dir = PluginDir::new();
    let socket = dir.path("impostor.sock");
    let mut impostor = plugin!(&socket)
        .name("impostor.example.com")
        .arg("--hand-off")
        .in_cgroup(&disallowed)
        .start_listening()
        .await;
    let listener = impostor.pid().expect("the plugin runs");
    let server = impostor.hand_off(EVENT_TIMEOUT).await;
    assert_ne!(server, listener);
    let newcomer = NewcomerWithPid::start(listener, &allowed);

    let Some(_agent) = agent(
        &test,
        Source::Inotify,
        &dir,
        &["--policy-allow-cgroup", allowed.path()],
    )
    .await
    else {
        return;
    };
    let refused = impostor.wait_for_notify(false, EVENT_TIMEOUT).await;
    let error = refused.field("error").unwrap_or_default();
    assert!(
        error.starts_with("rejected by policy: command-line (the server's cgroup is unknown)"),
        "{refused}"
    );
    let row = listed(&dir, &socket);
    assert_eq!(row["state"], "rejected", "{row}");
    assert_eq!(row["provenance"]["server"]["pid"], listener, "{row}");
    assert!(
        row["provenance"]["server"]["cgroup"].is_null(),
        "the newcomer's cgroup is not the server's: {row}"
    );
    drop(newcomer);
}

/// A process (`sleep`) in `cgroup` holding the pid `pid`, which must be free (its process
/// reaped): the kernel gives the next fork the pid after `ns_last_pid`, so that is set one
/// below, and set again if another fork on the machine took the pid first. Killed when dropped.
struct NewcomerWithPid(std::process::Child);

impl NewcomerWithPid {
    fn start(pid: u32, cgroup: &TestCgroup) -> NewcomerWithPid {
        for _ in 0..200 {
            std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string())
                .expect("set ns_last_pid (root)");
            let mut child = Command::new("sleep")
                .arg("300")
                .spawn()
                .expect("start sleep");
            if child.id() == pid {
                std::fs::write(cgroup.procs_file(), pid.to_string())
                    .expect("move the newcomer into the allowed cgroup");
                return NewcomerWithPid(child);
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("could not start a process with pid {pid}");
    }
}

impl Drop for NewcomerWithPid {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A reload applies the new policy to every socket: a registered plugin it refuses is
/// deregistered (the handler hears it) and listed `rejected`; a policy file that does not parse
/// is refused with its line and column, by `policy reload` and on SIGHUP alike, and the agent runs
/// on with the policy it had; a reload that allows the plugin again registers it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_deregisters_what_the_new_policy_refuses_and_a_broken_file_changes_nothing() {
    let test = test_name();
    if !privileged(&test) {
        return;
    }
    let dir = PluginDir::new();
    let allow = |uid: u32| format!("[[policy]]\nid = \"owner\"\nallow_uids = [{uid}]\n");
    let config = write_config(&dir, &allow(0));
    let config_arg = config.display().to_string();
    let Some(agent) = agent(&test, Source::Inotify, &dir, &["--config", &config_arg]).await else {
        return;
    };
    let socket = dir.path("reloaded.sock");
    let plugin = plugin!(&socket).name("reloaded.example.com").spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;

    let mark = agent.event_mark();
    std::fs::write(&config, allow(4242)).expect("rewrite the configuration");
    let (ok, said, errors) = policy_reload(&dir);
    assert!(ok, "policy reload failed: {errors}");
    assert!(
        said.contains("1 registered plugins refused"),
        "policy reload says what it did: {said}"
    );
    // So does its event, for whoever follows the agent.
    let reloaded = agent
        .wait_for_event(mark, "the reload", EVENT_TIMEOUT, seen::policy_reloaded)
        .await;
    assert_eq!(
        reloaded.0["policy_reload"],
        serde_json::json!({"trigger": "admin_api", "rules": 1, "refused": 1, "retried": 0}),
        "{reloaded}"
    );
    agent
        .wait_for_event(
            mark,
            "the handler's DeRegister",
            EVENT_TIMEOUT,
            seen::deregistered(&socket),
        )
        .await;
    let row = listed(&dir, &socket);
    assert_eq!(row["state"], "rejected", "{row}");
    assert_eq!(row["rejected_by_rule"], "owner", "{row}");

    // A broken file: refused with where it breaks, by the CLI and on SIGHUP; nothing changes.
    std::fs::write(&config, "[[policy]]\nid = \"owner\"\nallow_uids = [0\n").expect("write");
    let (ok, _, errors) = policy_reload(&dir);
    assert!(!ok, "a broken policy must not load");
    assert!(
        errors.contains("line 3, column"),
        "the error names the line and column: {errors}"
    );
    let mark = agent.event_mark();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent.pid().expect("running") as i32),
        nix::sys::signal::Signal::SIGHUP,
    )
    .expect("SIGHUP");
    let refused = agent
        .wait_for_event(
            mark,
            "the refused reload",
            EVENT_TIMEOUT,
            seen::policy_reload_failed,
        )
        .await;
    assert_eq!(
        (
            refused.0.pointer("/policy_reload/trigger"),
            refused
                .field("error")
                .is_some_and(|e| e.contains("line 3, column")),
        ),
        (Some(&serde_json::json!("sighup")), true),
        "{refused}"
    );
    assert_eq!(listed(&dir, &socket)["state"], "rejected");

    // Allowed again (SIGHUP this time): tried again and registered.
    let (notified, mark) = (plugin.mark(), agent.event_mark());
    std::fs::write(&config, allow(0)).expect("write");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent.pid().expect("running") as i32),
        nix::sys::signal::Signal::SIGHUP,
    )
    .expect("SIGHUP");
    plugin
        .wait_for_notify_after(notified, true, EVENT_TIMEOUT)
        .await;
    assert_eq!(listed(&dir, &socket)["state"], "registered");
    let retried = agent
        .wait_for_event(mark, "the reload", EVENT_TIMEOUT, seen::policy_reloaded)
        .await;
    assert_eq!(
        retried.0["policy_reload"],
        serde_json::json!({"trigger": "sighup", "rules": 1, "refused": 0, "retried": 1}),
        "{retried}"
    );
}

/// `run` with a policy that does not parse fails at once, naming the file, line and column.
#[test]
fn run_with_a_malformed_policy_fails_with_the_line_and_column() {
    let dir = PluginDir::new();
    let config = write_config(&dir, "[[policy]]\ntype = \"CSIPlugin\"\nallow_uid = [0]\n");
    let output = Command::new(plugin_agent_tests::env::agent_bin())
        .args(["run", "--source", "inotify", "--no-metrics", "--no-admin"])
        .arg("--plugin-dir")
        .arg(dir.root())
        .arg("--config")
        .arg(&config)
        .output()
        .expect("run plugin-agent");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "a malformed policy must fail run: {stderr}"
    );
    assert!(
        stderr.contains("line 3, column 1") && stderr.contains("allow_uid"),
        "the error names the line, the column and the key: {stderr}"
    );
}
