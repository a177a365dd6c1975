//! The eBPF source's pinned kernel state: a restarted agent adopts the programs a previous one
//! pinned (no load, and the kernel kept recording while no agent ran), an agent with another
//! kernel object replaces them, and `plugin-agent cleanup` removes them. Each set has an owner
//! (the agent instance, by runtime directory): nobody else adopts, replaces or removes it while
//! its agent runs, and an agent whose pins are removed anyway pins them again.

use plugin_agent_tests::handler::HandlerProcess;
use plugin_agent_tests::{
    AgentOptions, AgentProcess, EVENT_TIMEOUT, Mark, PluginDir, Source, dra_plugin, plugin, seen,
    test_name,
};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// One test at a time: `cleanup --all` in one would remove the set another's stopped agent is
/// about to adopt.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn options(dir: &PluginDir) -> AgentOptions {
    AgentOptions::new(Source::Ebpf, &dir.root())
}

/// How `agent`'s event source started (status's `source_start`): loaded or adopted, its pins,
/// the kernel object, what the kernel recorded while no agent ran.
fn source_start(agent: &AgentProcess) -> Value {
    agent.status()["source_start"].clone()
}

/// The pin directory of an agent that loaded its programs (in itself or in its load child) and
/// pinned them, as its status says.
fn pinned_at(agent: &AgentProcess) -> PathBuf {
    loaded_and_pinned(&source_start(agent))
}

/// The pins of a `source_start` that says the programs were loaded, not adopted.
fn loaded_and_pinned(start: &Value) -> PathBuf {
    let how = start["how"].as_str().unwrap_or_default();
    assert!(how.starts_with("loaded"), "not a load: {start}");
    start["pins"]
        .as_str()
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("loaded, not pinned: {start}"))
}

/// The hash of the kernel object `agent` loaded (its status says).
fn loaded_object(agent: &AgentProcess) -> String {
    let start = source_start(agent);
    loaded_and_pinned(&start);
    start["object_hash"]
        .as_str()
        .unwrap_or_else(|| panic!("no object hash: {start}"))
        .to_string()
}

/// The pinned sets (one per load) in a tree's pin directory.
fn sets(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|entries| entries.filter_map(Result::ok).map(|e| e.path()).collect())
        .unwrap_or_default()
}

/// How `agent` adopted the pinned programs: the pins, and what the kernel recorded meanwhile
/// (`backlog_bytes`), as status says; fails when it loaded them instead.
fn adoption(agent: &AgentProcess) -> Value {
    let start = source_start(agent);
    assert_eq!(
        start["how"], "adopted",
        "the programs were loaded anyway: {start}"
    );
    start
}

/// SIGKILL, then plugins come and go while no agent runs; the next agent adopts the pinned
/// programs (no load: no BTF, no verifier), finds in the ring what the kernel recorded while no
/// agent ran, registers the new plugin and deregisters the one that went (its handler hears it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_adopts_the_pins_and_the_kernel_recorded_while_no_agent_ran() {
    let test = test_name();
    let _serial = SERIAL.lock().await;
    let dir = PluginDir::new();
    let handler = HandlerProcess::start(
        env!("CARGO_BIN_EXE_dra-handler"),
        &dir.outside("dra-handler.sock"),
        &[],
    )
    .await;
    let with_handler = || options(&dir).handlers(&[&format!("DRAPlugin={}", handler.target())]);
    let Some(first) = AgentProcess::start(&test, with_handler()).await else {
        return;
    };
    let pins = pinned_at(&first);
    let before = dra_plugin!(&dir, "before");
    before.wait_for_notify(true, EVENT_TIMEOUT).await;
    // Reported only once recorded in the state journal.
    first
        .wait_for_event(
            Mark(0),
            "registered",
            EVENT_TIMEOUT,
            seen::registered(before.socket()),
        )
        .await;
    let pid = nix::unistd::Pid::from_raw(first.pid().expect("running") as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).expect("SIGKILL");
    drop(first);

    // While no agent runs: one plugin goes, one comes.
    let gone = before.socket().to_path_buf();
    before.stop().await;
    let during = dra_plugin!(&dir, "during");
    during.wait_for_event("serving", EVENT_TIMEOUT).await;

    let second = AgentProcess::start(&test, with_handler())
        .await
        .expect("started once");
    // The adopting agent loaded nothing (`adoption` checks), and found what the kernel wrote.
    let adopted = adoption(&second);
    let backlog = adopted["backlog_bytes"].as_u64().unwrap_or(0);
    assert!(
        backlog > 0,
        "{test}: the programs recorded nothing while no agent ran: {adopted}"
    );
    // The start is reported phase by phase once the first walk is done (it is: the agent
    // started), the adoption within its event-source phase.
    let status = second.status();
    let started = &status["start_phases"];
    let ms = |name: &str| -> f64 {
        started[name]
            .as_f64()
            .unwrap_or_else(|| panic!("{test}: no {name} in {started}"))
    };
    let phases = ["setup_ms", "event_source_ms", "state_ms", "first_walk_ms"].map(ms);
    let took = ms("took_ms");
    assert!(
        phases.iter().all(|&p| p >= 0.0) && (phases.iter().sum::<f64>() - took).abs() <= 0.3,
        "{test}: the phases {phases:?} do not add up to took_ms {took}: {started}"
    );
    let adopting = adopted["open_ms"].as_f64().unwrap_or(f64::MAX);
    assert!(
        adopting <= ms("event_source_ms") + 0.1,
        "{test}: the adoption ({adopting} ms) is not within the event-source phase: {status}"
    );
    during.wait_for_notify(true, EVENT_TIMEOUT).await;
    // Deregistered by the start walk's changes, perhaps before the test followed the events:
    // its handler hears the DeRegister.
    let gone = gone.display().to_string();
    handler
        .wait_for_count(
            Mark(0),
            1,
            "the plugin gone while no agent ran, deregistered",
            EVENT_TIMEOUT,
            |l| l.field_is("call", "deregister") && l.field_is("endpoint", &gone),
        )
        .await;
    assert_eq!(
        sets(&pins).len(),
        1,
        "{test}: one pinned set: {:?}",
        sets(&pins)
    );
}

/// A copy of the agent whose embedded kernel object differs (a byte of its debug information:
/// what an upgrade changes, without changing what the programs do).
fn upgraded_agent(dir: &PluginDir, object_hash: &str) -> PathBuf {
    let original = plugin_agent_tests::env::agent_bin();
    let mut bytes = std::fs::read(&original).expect("read the agent binary");
    let replace = |bytes: &mut Vec<u8>, from: &[u8], to: &[u8]| {
        let mut changed = 0;
        let mut at = 0;
        while let Some(found) = bytes[at..].windows(from.len()).position(|w| w == from) {
            let start = at + found;
            bytes[start..start + to.len()].copy_from_slice(to);
            at = start + to.len();
            changed += 1;
        }
        changed
    };
    assert!(
        replace(
            &mut bytes,
            b"agent-ebpf/src/programs/kernel.rs",
            b"agent-ebpf/src/programs/kerne2.rs"
        ) > 0,
        "the kernel object's source path is in the agent binary"
    );
    // The build hashes the object it embeds: another object comes with another hash.
    let other_hash: String = object_hash
        .chars()
        .map(|c| if c == '0' { '1' } else { '0' })
        .collect();
    assert!(
        object_hash.len() == 16
            && replace(&mut bytes, object_hash.as_bytes(), other_hash.as_bytes()) > 0,
        "the object's hash {object_hash:?} is in the agent binary"
    );
    let upgraded = dir.outside("plugin-agent-upgraded");
    std::fs::write(&upgraded, bytes).expect("write the upgraded agent");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&upgraded, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    upgraded
}

/// An agent carrying another kernel object does not adopt the pins of the old one: it loads its
/// own, pins them, removes the old set (detaching its programs), and the plugins stay registered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgraded_agent_with_another_kernel_object_replaces_the_pins() {
    let test = test_name();
    let _serial = SERIAL.lock().await;
    let dir = PluginDir::new();
    let Some(first) = AgentProcess::start(&test, options(&dir)).await else {
        return;
    };
    let pins = pinned_at(&first);
    let object = loaded_object(&first);
    let plugin = plugin!(dir.path("p.sock")).name("p").spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    let old_sets = sets(&pins);
    assert_eq!(old_sets.len(), 1, "{test}");
    first.stop().await;

    let mut upgraded = options(&dir);
    upgraded.binary = Some(upgraded_agent(&dir, &object));
    let second = AgentProcess::start(&test, upgraded)
        .await
        .expect("started once");
    assert_eq!(
        pinned_at(&second),
        pins,
        "{test}: the same tree's directory"
    );
    let new_sets = sets(&pins);
    assert_eq!(
        new_sets.len(),
        1,
        "{test}: the old set removed: {new_sets:?}"
    );
    assert_ne!(new_sets, old_sets, "{test}: a new set");
    // The new agent watches with its own programs: a plugin made now registers.
    let after = plugin!(dir.path("after.sock")).name("after").spawn();
    after.wait_for_notify(true, EVENT_TIMEOUT).await;
    second.stop().await;

    // And the original binary, next, does not adopt the upgrade's programs either.
    let third = AgentProcess::start(&test, options(&dir))
        .await
        .expect("started once");
    pinned_at(&third);
    assert_ne!(sets(&pins), new_sets, "{test}: replaced again");
}

/// `plugin-agent cleanup` as the instance whose admin socket is `admin_socket`.
fn cleanup(admin_socket: &Path, args: &[&str]) -> std::process::Output {
    std::process::Command::new(plugin_agent_tests::env::agent_bin())
        .arg("--admin-socket")
        .arg(admin_socket)
        .arg("cleanup")
        .args(args)
        .output()
        .expect("run cleanup")
}

/// Issue 44, item 1: `cleanup` removed a running agent's pins (its programs detached: it found
/// plugins only by its 30 s safety pass) and its state file. Now the instance's own cleanup is
/// refused while its agent runs, `cleanup --all` keeps every running agent's set, and once the
/// agent stopped its cleanup removes both; a second run finds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_leaves_a_running_agent_alone_and_removes_a_stopped_ones_pins_and_state() {
    let test = test_name();
    let _serial = SERIAL.lock().await;
    let dir = PluginDir::new();
    let options = options(&dir);
    let admin = options.admin_socket.clone();
    let root = dir.root();
    let root = root.to_str().expect("UTF-8 test path");
    let Some(agent) = AgentProcess::start(&test, options).await else {
        return;
    };
    let pins = pinned_at(&agent);
    let first = plugin!(dir.path("first.sock")).name("first").spawn();
    first.wait_for_notify(true, EVENT_TIMEOUT).await;
    let state = admin.with_file_name("state.json");
    let journal = admin.with_file_name("state.journal");
    let state_files = || [&state, &journal].map(|f| f.exists());
    let before = state_files();
    assert!(
        before.contains(&true),
        "{test}: no state file in {}",
        admin.display()
    );
    let set = sets(&pins);

    let refused = cleanup(&admin, &["--plugin-dir", root]);
    assert!(
        !refused.status.success(),
        "{test}: cleanup of a running agent's instance: {refused:?}"
    );
    let all = cleanup(&dir.outside("other-admin.sock"), &["--all"]);
    assert!(all.status.success(), "{test}: {all:?}");
    assert_eq!(
        sets(&pins),
        set,
        "{test}: the running agent's pins were touched"
    );
    assert_eq!(
        state_files(),
        before,
        "{test}: the running agent's state file was touched"
    );
    // Not blind: a plugin made now registers by the kernel's event, long before a safety pass.
    let second = plugin!(dir.path("second.sock")).name("second").spawn();
    second.wait_for_notify(true, Duration::from_secs(5)).await;

    agent.stop().await;
    assert!(
        cleanup(&admin, &["--plugin-dir", root]).status.success(),
        "{test}"
    );
    assert!(!pins.exists(), "{test}: {} still there", pins.display());
    assert_eq!(
        state_files(),
        [false, false],
        "{test}: the stopped agent's state file stays"
    );
    let again = cleanup(&admin, &["--plugin-dir", root]);
    assert!(
        String::from_utf8_lossy(&again.stdout).contains("removed 0 pinned program sets"),
        "{test}: {again:?}"
    );
}

/// The agent's metrics address, with `--metrics-addr 127.0.0.1:0` in `options`.
fn with_metrics(mut options: AgentOptions) -> AgentOptions {
    options
        .extra
        .extend(["--metrics-addr".into(), "127.0.0.1:0".into()]);
    options
}

/// The value of the counter `name` on `addr`'s /metrics (0 when absent).
async fn counter(addr: std::net::SocketAddr, name: &str) -> f64 {
    let (_, body) =
        tokio::task::spawn_blocking(move || plugin_agent_tests::http::http_get(addr, "/metrics"))
            .await
            .expect("scrape");
    body.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// GET `path` on `addr` until it answers `status`.
async fn http_until(addr: std::net::SocketAddr, path: &'static str, status: u16) {
    let deadline = std::time::Instant::now() + EVENT_TIMEOUT;
    loop {
        let (code, body) =
            tokio::task::spawn_blocking(move || plugin_agent_tests::http::http_get(addr, path))
                .await
                .expect("GET");
        if code == status {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "GET {path} never answered {status}; last {code}: {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The problems `status` shows, asked until `shown` holds.
async fn problems_until(admin: &Path, shown: impl Fn(&[String]) -> bool) -> Vec<String> {
    let deadline = std::time::Instant::now() + EVENT_TIMEOUT;
    loop {
        let status = plugin_agent_tests::admin::status(admin);
        let problems: Vec<String> = status["problems"]
            .as_array()
            .map(|p| {
                p.iter()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        if shown(&problems) {
            return problems;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "status never showed it; last: {problems:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Issue 44, item 1: an agent whose pins another process removed was blind for 30 s, saying
/// nothing (`/readyz` 200). Now it holds its programs (removing the pins detaches nothing: a
/// plugin made right after registers at once), notices within a second, pins them again by
/// itself, and counts it; while it cannot pin them again, `status` names the problem and
/// `/readyz` answers 503, until it could.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_whose_pins_are_removed_keeps_seeing_and_pins_them_again() {
    let test = test_name();
    let _serial = SERIAL.lock().await;
    let dir = PluginDir::new();
    let options = with_metrics(options(&dir));
    let admin = options.admin_socket.clone();
    let Some(agent) = AgentProcess::start(&test, options).await else {
        return;
    };
    let pins = pinned_at(&agent);
    let addr = plugin_agent_tests::http::metrics_addr(&agent).await;
    let first = plugin!(dir.path("first.sock")).name("first").spawn();
    first.wait_for_notify(true, EVENT_TIMEOUT).await;
    let set = sets(&pins);

    let forced = cleanup(&dir.outside("other-admin.sock"), &["--all", "--force"]);
    assert!(forced.status.success(), "{test}: {forced:?}");
    let second = plugin!(dir.path("second.sock")).name("second").spawn();
    second.wait_for_notify(true, Duration::from_secs(5)).await;
    let deadline = std::time::Instant::now() + EVENT_TIMEOUT;
    while counter(addr, "plugin_agent_event_source_pins_restored").await < 1.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "{test}: never pinned again"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let again = sets(&pins);
    assert!(
        again.len() == 1 && again != set,
        "{test}: pinned again as a new set: {again:?} (was {set:?})"
    );
    http_until(addr, "/readyz", 200).await;

    // Something in the way of the pin directory: the agent cannot pin again, and says so.
    let instance = pins.parent().expect("an instance directory").to_path_buf();
    loop {
        let _ = std::fs::remove_dir_all(&instance);
        if std::os::unix::fs::symlink("/nonexistent", &instance).is_ok() {
            break;
        }
    }
    let problems = problems_until(&admin, |p| p.iter().any(|p| p.contains("event source"))).await;
    eprintln!("{test}: {problems:?}");
    http_until(addr, "/readyz", 503).await;
    let third = plugin!(dir.path("third.sock")).name("third").spawn();
    third.wait_for_notify(true, Duration::from_secs(5)).await;
    std::fs::remove_file(&instance).expect("out of the way");
    problems_until(&admin, |p| !p.iter().any(|p| p.contains("event source"))).await;
    http_until(addr, "/readyz", 200).await;
    assert_eq!(sets(&pins).len(), 1, "{test}: pinned again");
    assert_eq!(
        counter(addr, "plugin_agent_event_source_pins_restored").await,
        2.0,
        "{test}"
    );

    // A file system mounted over the instance hides the pins (no file event says so; the mount
    // table does), and nothing can be pinned there; unmounted, the set is as the agent made it.
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "hide-the-pins"])
        .arg(&instance)
        .status()
        .expect("mount");
    assert!(mounted.success(), "{test}: mount a tmpfs over {instance:?}");
    let unmount = unmount_when_dropped(&instance);
    problems_until(&admin, |p| p.iter().any(|p| p.contains("event source"))).await;
    http_until(addr, "/readyz", 503).await;
    drop(unmount);
    problems_until(&admin, |p| !p.iter().any(|p| p.contains("event source"))).await;
    http_until(addr, "/readyz", 200).await;
    assert_eq!(
        counter(addr, "plugin_agent_event_source_pins_restored").await,
        2.0,
        "{test}: the set came back as it was, nothing pinned again"
    );
}

/// Unmounts `dir` when dropped (also when the test fails half-way).
fn unmount_when_dropped(dir: &Path) -> impl Drop {
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    Unmount(dir.to_path_buf())
}

/// Issue 44, item 1: an observer and a registrar on one directory shared one set: one adopted
/// the other's, and removals reached one of them 30 s late. Each instance (runtime directory)
/// now has its own set, adopts only its own after a restart, and never removes the other's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_agents_on_one_tree_each_keep_their_own_pins() {
    let test = test_name();
    let _serial = SERIAL.lock().await;
    let dir = PluginDir::new();
    let Some(registrar) = AgentProcess::start(&test, options(&dir)).await else {
        return;
    };
    let observer_options = || {
        let mut options = options(&dir);
        options.admin_socket = dir.outside("observer/admin.sock");
        options.extra.extend(["--mode".into(), "observe".into()]);
        options
    };
    let observer = AgentProcess::start(&test, observer_options())
        .await
        .expect("started once");
    let (registrar_pins, observer_pins) = (pinned_at(&registrar), pinned_at(&observer));
    assert_ne!(
        registrar_pins, observer_pins,
        "{test}: one set for two agents"
    );
    let registrar_set = sets(&registrar_pins);
    observer.stop().await;
    let observer = AgentProcess::start(&test, observer_options())
        .await
        .expect("started once");
    let adopted = adoption(&observer);
    assert_eq!(
        adopted["pins"].as_str().map(PathBuf::from),
        Some(observer_pins.clone()),
        "{test}: {adopted}"
    );
    assert_eq!(
        sets(&registrar_pins),
        registrar_set,
        "{test}: the registrar's set was replaced"
    );
    // Both see a removal at once.
    let plugin = plugin!(dir.path("p.sock")).name("p").spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    let socket = plugin.socket().to_path_buf();
    let (registrar_mark, observer_mark) = (registrar.event_mark(), observer.event_mark());
    plugin.stop().await;
    registrar
        .wait_for_event(
            registrar_mark,
            "the registrar's deregistration",
            Duration::from_secs(5),
            seen::deregistered(&socket),
        )
        .await;
    observer
        .wait_for_event(
            observer_mark,
            "the observer's",
            Duration::from_secs(5),
            seen::removed(&socket),
        )
        .await;
    // The directory's own cleanup (see `PluginDir`) removes the registrar's instance's pins.
    observer.stop().await;
    let root = dir.root();
    let cleaned = cleanup(
        &dir.outside("observer/admin.sock"),
        &["--plugin-dir", root.to_str().unwrap_or_default()],
    );
    assert!(
        cleaned.status.success() && !observer_pins.exists(),
        "{test}: {cleaned:?}"
    );
}

/// Issue 44, item 1: an agent in a mount namespace of its own lost its pins when a host agent
/// started and removed "the pinned programs of trees that are gone" (its tree is not on the
/// host). Trees are judged in the namespace that owns them, or not at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_agent_leaves_the_pins_of_an_agent_in_another_mount_namespace() {
    let test = test_name();
    let _serial = SERIAL.lock().await;
    let host_dir = PluginDir::new();
    // The namespaced agent's tree and runtime directory exist only in its namespace: a tmpfs
    // mounted there over an empty host directory.
    let private = host_dir.outside("private");
    std::fs::create_dir(&private).expect("mkdir");
    let tree = private.join("registry");
    let mut namespaced = AgentOptions::new(Source::Ebpf, &tree);
    // Its admin socket is in its own mount namespace: the test cannot follow its events.
    namespaced.follow = false;
    namespaced.wrapper = vec![
        "unshare".into(),
        "--mount".into(),
        "--propagation".into(),
        "private".into(),
        "sh".into(),
        "-c".into(),
        format!(
            "mount -t tmpfs tmpfs {0} && mkdir {0}/registry && exec \"$0\" \"$@\"",
            private.display()
        ),
    ];
    let Some(namespaced) = AgentProcess::start(&test, namespaced).await else {
        return;
    };
    let pins = loaded_and_pinned(&status_in_namespace_of(&namespaced, &private)["source_start"]);
    assert!(!tree.exists(), "{test}: the tree is visible on the host");
    let set = sets(&pins);
    let host = AgentProcess::start(&test, options(&host_dir))
        .await
        .expect("started once");
    pinned_at(&host);
    assert_eq!(
        sets(&pins),
        set,
        "{test}: the host agent removed (or replaced) the other namespace's pins"
    );
    drop(namespaced);
    // Its namespace is gone with it: nobody may judge its tree any more, so remove them here.
    let _ = std::fs::remove_dir_all(pins.parent().unwrap_or(&pins));
}

/// `plugin-agent status -o json` of `agent`, whose admin socket is in `runtime` in its own
/// mount namespace: asked from inside that namespace (`nsenter`).
fn status_in_namespace_of(agent: &AgentProcess, runtime: &Path) -> Value {
    let pid = agent.pid().expect("running");
    let output = std::process::Command::new("nsenter")
        .arg(format!("--mount=/proc/{pid}/ns/mnt"))
        .arg(plugin_agent_tests::env::agent_bin())
        .arg("--admin-socket")
        .arg(runtime.join("admin.sock"))
        .args(["status", "-o", "json"])
        .output()
        .expect("nsenter");
    assert!(
        output.status.success(),
        "status in the namespace: {output:?}"
    );
    serde_json::from_slice(&output.stdout).expect("status as JSON")
}

/// Loading in the agent parsed vmlinux's BTF in the agent (aya's loader does, whether or not the
/// object needs it): its peak resident set stayed ~10 MiB above what it used for the rest of its
/// life, beyond fanotify's whole agent. With pins, a child process loads, attaches and pins the
/// programs, and the agent adopts them: the peak is what the agent uses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_load_runs_in_a_child_and_leaves_the_agent_no_peak() {
    let test = test_name();
    let _serial = SERIAL.lock().await;
    let dir = PluginDir::new();
    let Some(agent) = AgentProcess::start(&test, options(&dir)).await else {
        return;
    };
    let loaded = source_start(&agent);
    let pins = pinned_at(&agent);
    assert_eq!(sets(&pins).len(), 1, "{test}: the child's set is adopted");
    let plugin = plugin!(dir.path("p.sock")).name("p").spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    let pid = agent.pid().expect("running");
    let (rss, peak) = (
        plugin_agent_tests::procfs::rss_kib(pid).expect("VmRSS"),
        plugin_agent_tests::procfs::peak_rss_kib(pid).expect("VmHWM"),
    );
    eprintln!("{test}: VmRSS {rss} KiB, VmHWM {peak} KiB");
    assert!(
        peak < rss + 4 * 1024,
        "{test}: the load left a peak of {peak} KiB over {rss} KiB in use"
    );
    assert_eq!(loaded["how"], "loaded_in_child", "{test}: {loaded}");
}
