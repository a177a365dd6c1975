//! The eBPF source's pinned kernel state: a restarted agent adopts the programs a previous one
//! pinned (no load, and the kernel kept recording while no agent ran), an agent with another
//! kernel object replaces them, and `plugin-agent cleanup` removes them.

use plugin_agent_tests::{
    AgentOptions, AgentProcess, EVENT_TIMEOUT, Line, PluginDir, Source, logs, plugin, test_name,
};
use std::path::{Path, PathBuf};

fn options(dir: &PluginDir) -> AgentOptions {
    AgentOptions::new(Source::Ebpf, &dir.root())
}

/// The pin directory the agent named when it loaded and pinned its programs.
async fn pinned_at(agent: &AgentProcess) -> PathBuf {
    let loaded = agent
        .wait_for_log("programs loaded and pinned", EVENT_TIMEOUT, |l| {
            l.message() == "eBPF programs loaded" && l.field("pins").is_some()
        })
        .await;
    PathBuf::from(loaded.field("pins").unwrap_or_default())
}

/// The hash of the kernel object `agent` loaded (its log says).
async fn loaded_object(agent: &AgentProcess) -> String {
    let loaded = agent
        .wait_for_log("programs loaded", EVENT_TIMEOUT, |l| {
            l.message() == "eBPF programs loaded" && l.field("object").is_some()
        })
        .await;
    loaded.field("object").unwrap_or_default()
}

/// The pinned sets (one per load) in a tree's pin directory.
fn sets(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|entries| entries.filter_map(Result::ok).map(|e| e.path()).collect())
        .unwrap_or_default()
}

async fn adoption(agent: &AgentProcess) -> Line {
    agent
        .wait_for_log("adopted the pinned programs", EVENT_TIMEOUT, |l| {
            l.message().starts_with("adopted the pinned eBPF programs")
        })
        .await
}

/// SIGKILL, then plugins come and go while no agent runs; the next agent adopts the pinned
/// programs (no load: no BTF, no verifier), finds in the ring what the kernel recorded while no
/// agent ran, registers the new plugin and deregisters the one that went.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_adopts_the_pins_and_the_kernel_recorded_while_no_agent_ran() {
    let test = test_name();
    let dir = PluginDir::new();
    let Some(first) = AgentProcess::start(&test, options(&dir)).await else {
        return;
    };
    let pins = pinned_at(&first).await;
    let before = plugin!(dir.path("before.sock")).name("before").spawn();
    before.wait_for_notify(true, EVENT_TIMEOUT).await;
    // Reported only once recorded in the state journal.
    first
        .wait_for_log(
            "registered",
            EVENT_TIMEOUT,
            logs::registered(before.socket()),
        )
        .await;
    let pid = nix::unistd::Pid::from_raw(first.pid().expect("running") as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).expect("SIGKILL");
    drop(first);

    // While no agent runs: one plugin goes, one comes.
    let gone = before.socket().to_path_buf();
    before.stop().await;
    let during = plugin!(dir.path("during.sock")).name("during").spawn();
    during.wait_for_event("serving", EVENT_TIMEOUT).await;

    let second = AgentProcess::start(&test, options(&dir))
        .await
        .expect("started once");
    let adopted = adoption(&second).await;
    let backlog: u64 = adopted
        .field("backlog_bytes")
        .and_then(|b| b.parse().ok())
        .unwrap_or(0);
    assert!(
        backlog > 0,
        "{test}: the programs recorded nothing while no agent ran: {adopted}"
    );
    assert!(
        second
            .logs_since(plugin_agent_tests::Mark(0), |l| l.message()
                == "eBPF programs loaded")
            .is_empty(),
        "{test}: the adopting agent loaded the programs anyway"
    );
    // The start is reported phase by phase once the first walk is done, after the adoption.
    let started = second
        .wait_for_log("the start's phases", EVENT_TIMEOUT, |l| {
            l.message().starts_with("agent started")
        })
        .await;
    assert!(started.position() > adopted.position(), "{test}: {started}");
    let ms = |name: &str| -> f64 {
        started
            .field(name)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{test}: no {name} in {started}"))
    };
    let phases = ["setup_ms", "event_source_ms", "state_ms", "first_walk_ms"].map(ms);
    let took = ms("took_ms");
    assert!(
        phases.iter().all(|&p| p >= 0.0) && (phases.iter().sum::<f64>() - took).abs() <= 0.3,
        "{test}: the phases {phases:?} do not add up to took_ms {took}: {started}"
    );
    during.wait_for_notify(true, EVENT_TIMEOUT).await;
    second
        .wait_for_log(
            "the plugin gone while no agent ran, deregistered",
            EVENT_TIMEOUT,
            logs::deregistered(&gone),
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
            b"agent-ebpf/src/main.rs",
            b"agent-ebpf/src/mai2.rs"
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
    let dir = PluginDir::new();
    let Some(first) = AgentProcess::start(&test, options(&dir)).await else {
        return;
    };
    let pins = pinned_at(&first).await;
    let object = loaded_object(&first).await;
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
        pinned_at(&second).await,
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
    pinned_at(&third).await;
    assert_ne!(sets(&pins), new_sets, "{test}: replaced again");
}

/// `plugin-agent cleanup --plugin-dir` removes the tree's pins (its programs detach); a second
/// run finds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_removes_the_pins() {
    let test = test_name();
    let dir = PluginDir::new();
    let Some(agent) = AgentProcess::start(&test, options(&dir)).await else {
        return;
    };
    let pins = pinned_at(&agent).await;
    agent.stop().await;
    assert!(pins.exists(), "{test}: the pins outlive the agent");
    let cleanup = || {
        let out = std::process::Command::new(plugin_agent_tests::env::agent_bin())
            .arg("--admin-socket")
            .arg(dir.outside("admin.sock"))
            .args(["cleanup", "--plugin-dir"])
            .arg(dir.root())
            .output()
            .expect("run cleanup");
        assert!(out.status.success(), "{test}: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let said = cleanup();
    assert!(said.contains("removed the pinned eBPF programs"), "{said}");
    assert!(!pins.exists(), "{test}: {} still there", pins.display());
    assert!(cleanup().contains("no pinned eBPF programs"));
}

/// Loading in the agent parsed vmlinux's BTF in the agent (aya's loader does, whether or not the
/// object needs it): its peak resident set stayed ~10 MiB above what it used for the rest of its
/// life, beyond fanotify's whole agent. With pins, a child process loads, attaches and pins the
/// programs, and the agent adopts them: the peak is what the agent uses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_load_runs_in_a_child_and_leaves_the_agent_no_peak() {
    let test = test_name();
    let dir = PluginDir::new();
    let Some(agent) = AgentProcess::start(&test, options(&dir)).await else {
        return;
    };
    let loaded = agent
        .wait_for_log("programs loaded", EVENT_TIMEOUT, |l| {
            l.message() == "eBPF programs loaded"
        })
        .await;
    let pins = pinned_at(&agent).await;
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
    assert_eq!(
        loaded.field("loaded_in").as_deref(),
        Some("a child process"),
        "{test}: {loaded}"
    );
}
