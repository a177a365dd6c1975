//! Restarts, and what handlers see across them.
//!
//! The agent keeps its actual state in its runtime directory (`persist`), so a new agent carries
//! on where the last one stopped, however it stopped: plugins whose sockets did not change are
//! not called again and neither is their handler, and what changed while no agent ran (a plugin
//! gone, one replaced, one new) is delivered exactly once. These tests pin that down with 1,000
//! plugins and the example DRA handler's call log, and check that SIGTERM lets a running
//! registration finish before the agent exits.

use plugin_agent_tests::handler::HandlerProcess;
use plugin_agent_tests::host::PluginHost;
use plugin_agent_tests::{
    AgentOptions, AgentProcess, EVENT_TIMEOUT, Line, Mark, PluginDir, Source, admin, dra_plugin,
    per_source, plugin, seen, test_name,
};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

per_source!(
    after_sigkill_a_new_agent_calls_no_unchanged_plugin_and_delivers_what_changed_while_down_once
);

/// Generous: 1,000 registrations through a gRPC handler on a shared 2-core machine.
const CONVERGE_TIMEOUT: Duration = Duration::from_secs(120);

fn agent_options(source: Source, dir: &PluginDir, handler: &HandlerProcess) -> AgentOptions {
    let mut options = AgentOptions::new(source, &dir.root());
    options.handlers = vec![format!("DRAPlugin={}", handler.target())];
    options.admin_socket = dir.outside("admin.sock");
    options
}

/// Handler calls after `mark`, by plugin name, in order: `[("validate", endpoint), ...]`.
fn calls_by_name(handler: &HandlerProcess, mark: Mark) -> BTreeMap<String, Vec<Line>> {
    let mut by_name: BTreeMap<String, Vec<Line>> = BTreeMap::new();
    for line in handler
        .events()
        .matching_since(mark, |l| l.field("call").is_some())
    {
        by_name
            .entry(line.field("name").unwrap_or_default())
            .or_default()
            .push(line);
    }
    by_name
}

async fn after_sigkill_a_new_agent_calls_no_unchanged_plugin_and_delivers_what_changed_while_down_once(
    source: Source,
) {
    carries_on_after_sigkill(source, 1000).await
}

/// `plugins` (plugin-host) and three more registered; SIGKILL; while no agent runs, one plugin
/// goes, one is replaced by a new instance at its path, one is new; a new agent starts. It calls
/// none of the unchanged plugins and their handler not once, deregisters the gone and the
/// replaced instance once each, and registers the replacement and the new plugin.
async fn carries_on_after_sigkill(source: Source, plugins: usize) {
    let test = test_name();
    let dir = PluginDir::new();
    let handler = HandlerProcess::start(
        env!("CARGO_BIN_EXE_dra-handler"),
        &dir.outside("dra-handler.sock"),
        &[],
    )
    .await;
    let options = agent_options(source, &dir, &handler);
    let Some(first) = AgentProcess::start(&test, options.clone()).await else {
        return;
    };
    let host = PluginHost::start(
        env!("CARGO_BIN_EXE_plugin-host"),
        &dir.root(),
        plugins,
        &["--type", "DRAPlugin", "--versions", "v1.DRAPlugin"],
    )
    .await;
    let took = host
        .wait_registered(Mark(0), plugins, CONVERGE_TIMEOUT)
        .await;
    eprintln!("{test}: {plugins} plugins registered in {took:?}");
    let kept = dra_plugin!(&dir, "kept");
    let gone = dra_plugin!(&dir, "gone");
    let replaced = dra_plugin!(&dir, "replaced");
    for plugin in [&kept, &gone, &replaced] {
        plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    }
    // The agent reports a registration only once its state journal has it.
    first
        .wait_for_events(
            Mark(0),
            plugins + 3,
            "every registration reported",
            CONVERGE_TIMEOUT,
            seen::any_registered,
        )
        .await;

    let pid = nix::unistd::Pid::from_raw(first.pid().expect("running") as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).expect("SIGKILL");
    drop(first);
    let (handler_mark, host_mark, kept_mark) = (handler.mark(), host.mark(), kept.mark());
    // While no agent runs.
    gone.stop().await;
    replaced.stop().await;
    // A new socket instance at the same path (possibly with the freed inode number: the agent
    // tells instances apart by birth time and file handle too).
    let replaced = dra_plugin!(&dir, "replaced");
    replaced.wait_for_event("serving", EVENT_TIMEOUT).await;
    let new = dra_plugin!(&dir, "new");
    new.wait_for_event("serving", EVENT_TIMEOUT).await;

    // Started: the state file was restored before the first walk, which is over.
    let second = AgentProcess::start(&test, options.clone())
        .await
        .expect("it started once");
    replaced.wait_for_notify(true, EVENT_TIMEOUT).await;
    new.wait_for_notify(true, EVENT_TIMEOUT).await;
    handler
        .wait_for_count(
            handler_mark,
            2,
            "DeRegister of the gone and the replaced instance",
            EVENT_TIMEOUT,
            |l| l.field_is("call", "deregister"),
        )
        .await;
    // The handler logs a call after answering it, so its Register lines can trail the
    // plugins' Notify: await them before reading the log.
    handler
        .wait_for_count(
            handler_mark,
            2,
            "Register of the replacement and the new plugin",
            EVENT_TIMEOUT,
            |l| l.field_is("call", "register"),
        )
        .await;
    // The first walk was over when `start` returned (the changes above came from it); it marked
    // nothing else, so no call for an unchanged plugin can still be on its way.

    // The exact final state: every plugin listed and registered, the gone one absent.
    let listed = admin::list(&options.admin_socket);
    let registered = listed.values().filter(|e| e.state == "registered").count();
    assert_eq!(
        (listed.len(), registered),
        (plugins + 3, plugins + 3),
        "{test}: every plugin listed and registered after the restart"
    );
    assert!(
        !listed.contains_key(&dir.path("gone.sock")),
        "{test}: the plugin gone while no agent ran is not listed"
    );

    // What the handler saw after the kill, per plugin name.
    let by_name = calls_by_name(&handler, handler_mark);
    let kinds = |name: &str| -> Vec<String> {
        by_name
            .get(name)
            .map(|calls| calls.iter().filter_map(|l| l.field("call")).collect())
            .unwrap_or_default()
    };
    assert_eq!(kinds("gone"), ["deregister"], "{test}: gone: {by_name:?}");
    assert_eq!(
        kinds("replaced"),
        ["deregister", "validate", "register"],
        "{test}: replaced: {by_name:?}"
    );
    assert_eq!(kinds("new"), ["validate", "register"], "{test}: new");
    let unchanged: Vec<&String> = by_name
        .keys()
        .filter(|name| !["gone", "replaced", "new"].contains(&name.as_str()))
        .collect();
    assert!(
        unchanged.is_empty(),
        "{test}: the handler heard about unchanged plugins: {unchanged:?}"
    );
    // And the unchanged plugins heard nothing: no GetInfo, no Notify.
    assert_eq!(
        host.notified_since(host_mark),
        0,
        "{test}: host plugins notified"
    );
    assert!(
        !kept.called_since(kept_mark),
        "{test}: the unchanged plugin was called"
    );
    drop(second);
}

/// SIGTERM while a slow handler is in the middle of a registration: the agent waits for it,
/// the plugin hears the outcome, and the agent exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_registration_lets_it_finish_and_exits_0() {
    let test = "sigterm_during_a_registration_lets_it_finish_and_exits_0";
    let dir = PluginDir::new();
    let handler = HandlerProcess::start(
        env!("CARGO_BIN_EXE_dra-handler"),
        &dir.outside("dra-handler.sock"),
        &["--delay", "1500ms"],
    )
    .await;
    let agent = AgentProcess::start(test, agent_options(Source::Inotify, &dir, &handler))
        .await
        .expect("inotify needs no privileges");
    let socket = dir.path("slow.sock");
    let plugin = plugin!(&socket)
        .plugin_type("DRAPlugin")
        .name("slow.example.com")
        .arg("--versions")
        .arg("v1.DRAPlugin")
        .spawn();
    // GetInfo answered: the handler's ValidatePlugin (1.5 s, under way) and RegisterPlugin
    // (1.5 s) are next.
    handler
        .wait_for_count(Mark(0), 1, "ValidatePlugin", EVENT_TIMEOUT, |l| {
            l.field_is("event", "received") && l.field_is("method", "validate")
        })
        .await;
    let stopping = Instant::now();
    let (mark, events) = (agent.event_mark(), agent.events().clone());
    let status = agent.stop().await;
    let stopped_after = stopping.elapsed();
    eprintln!("{test}: exited {status:?} {stopped_after:?} after SIGTERM");
    assert_eq!(status.code(), Some(0), "{test}: exit status {status:?}");

    // The registration ran to its end before the exit: the handler registered the plugin and
    // the plugin was told so (a clean rollback would show Notify(false) and a deregister).
    // Each process logs a call after answering it, so await the lines the outcome implies
    // before counting: the plugin's Notify, and for a registration the handler's register.
    let told = plugin.wait_for_event("notify", EVENT_TIMEOUT).await;
    if told.flag("registered") == Some(true) {
        handler
            .wait_for_count(Mark(0), 1, "the register", EVENT_TIMEOUT, |l| {
                l.field_is("call", "register")
            })
            .await;
    }
    let registered = handler.calls_since(Mark(0), "register");
    let deregistered = handler.calls_since(Mark(0), "deregister");
    let notified = plugin.notifications();
    let outcome: Vec<_> = notified
        .iter()
        .filter_map(|l| l.flag("registered"))
        .collect();
    match (registered.len(), outcome.as_slice(), deregistered.len()) {
        (1, [true], 0) => {}
        (1, [false], 1) | (0, [false], 0) => {
            eprintln!("{test}: rolled back cleanly")
        }
        other => panic!(
            "{test}: neither finished nor rolled back (register, notify, deregister) = {other:?}\nevents:\n{}",
            events.tail(40)
        ),
    }
    // The event stream ended with the agent (`stop` waits for that): it carried the outcome.
    let outcomes = events.matching_since(mark, |l| {
        seen::registered(&socket)(l) || seen::registration_failed(&socket)(l)
    });
    assert!(
        outcomes.len() == 1,
        "{test}: the agent reported the outcome before exiting: {outcomes:?}\nevents:\n{}",
        events.tail(40)
    );
}

/// A state file the agent cannot use (corrupt, from another format, for another tree) is a
/// warning, and the agent registers every plugin, as after a reboot.
/// A SIGKILL while the handler is in the middle of two Registers: the handler may hold both, and
/// neither plugin heard Notify. Each was recorded before its Register (kubernetes issue 136462),
/// so the next agent deregisters the one whose socket went while no agent ran (kubelet, which
/// keeps its actual state in memory, never tells the handler) and registers the other again, and
/// that plugin hears its Notify.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_a_kill_interrupted_are_deregistered_if_their_sockets_went_and_finished_if_not()
 {
    let test = &test_name();
    let dir = PluginDir::new();
    let handler = HandlerProcess::start(
        env!("CARGO_BIN_EXE_dra-handler"),
        &dir.outside("dra-handler.sock"),
        &["--delay", "1s"],
    )
    .await;
    let options = agent_options(Source::Inotify, &dir, &handler);
    let first = AgentProcess::start(test, options.clone())
        .await
        .expect("inotify needs no privileges");
    let went = dra_plugin!(&dir, "went");
    let stayed = dra_plugin!(&dir, "stayed");
    handler
        .wait_for_count(Mark(0), 2, "both Registers arrive", EVENT_TIMEOUT, |l| {
            l.field_is("event", "received") && l.field_is("method", "register")
        })
        .await;
    let pid = nix::unistd::Pid::from_raw(first.pid().expect("running") as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).expect("SIGKILL");
    drop(first);
    let went_socket = went.socket().display().to_string();
    went.stop().await;

    let second = AgentProcess::start(test, options.clone())
        .await
        .expect("it started once");
    // How many registrations a kill interrupted: status's account of the restore.
    let carried = second.status()["restore"].clone();
    assert_eq!(carried["interrupted"], 2, "{test}: {carried}");
    stayed.wait_for_notify(true, EVENT_TIMEOUT).await;
    let gone = handler
        .wait_for_count(Mark(0), 1, "the DeRegister of went", EVENT_TIMEOUT, |l| {
            l.field_is("call", "deregister")
        })
        .await;
    assert_eq!(
        (gone[0].field("name").as_deref(), gone[0].field("endpoint")),
        (Some("went"), Some(went_socket)),
        "{test}: {gone:?}"
    );
    let listed = admin::list(&options.admin_socket);
    assert_eq!(
        listed
            .iter()
            .map(|(path, e)| (path.clone(), e.state.as_str()))
            .collect::<Vec<_>>(),
        [(stayed.socket().to_path_buf(), "registered")],
        "{test}: {listed:?}"
    );
    assert_eq!(
        handler.calls_since(Mark(0), "deregister").len(),
        1,
        "{test}: only went was deregistered"
    );
    drop(second);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_or_foreign_state_file_is_a_warning_and_every_plugin_registers() {
    let test = test_name();
    let cases: [(&str, &[u8]); 3] = [
        ("corrupt", b"{\"format\": 1, \"root\": \"/x\", \"plu\x00"),
        ("format", b"{\"format\": 2, \"plugins\": {}}"),
        (
            "tree",
            b"{\"format\": 1, \"root\": \"/elsewhere\", \"plugins\": []}",
        ),
    ];
    for (case, content) in cases {
        let dir = PluginDir::new();
        let handler = HandlerProcess::start(
            env!("CARGO_BIN_EXE_dra-handler"),
            &dir.outside("dra-handler.sock"),
            &[],
        )
        .await;
        let options = agent_options(Source::Inotify, &dir, &handler);
        let state_file = options
            .admin_socket
            .parent()
            .expect("the admin socket has a directory")
            .join("state.json");
        std::fs::write(&state_file, content).expect("write the state file");
        let plugin = dra_plugin!(&dir, "p");
        let agent = AgentProcess::start(&test, options)
            .await
            .expect("inotify needs no privileges");
        // The warning in the log is the feature: it is how an unusable state file is told.
        let warning = agent
            .wait_for_log("the state file warning", EVENT_TIMEOUT, |l| {
                l.message().starts_with("ignoring the state file")
            })
            .await;
        eprintln!(
            "{test}: {case}: {}",
            warning.field("error").unwrap_or_default()
        );
        plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
        // There before the agent: its registration may precede the event stream.
        agent.wait_listed(plugin.socket(), "registered").await;
        // And the agent replaced it with its own.
        assert!(agent.stop().await.success());
        let written = std::fs::read_to_string(&state_file).expect("the agent's state file");
        assert!(
            written.contains("\"format\":1") && written.contains("p.sock"),
            "{test}: {case}: {written}"
        );
    }
}

/// `--reregister-on-restart`: kubelet's behaviour for handlers that keep nothing across restarts;
/// the new agent registers the unchanged plugin again (and the plugin hears it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_reregister_on_restart_an_unchanged_plugin_is_registered_again() {
    let test = test_name();
    let dir = PluginDir::new();
    let handler = HandlerProcess::start(
        env!("CARGO_BIN_EXE_dra-handler"),
        &dir.outside("dra-handler.sock"),
        &[],
    )
    .await;
    let mut options = agent_options(Source::Inotify, &dir, &handler);
    let plugin = dra_plugin!(&dir, "p");
    let first = AgentProcess::start(&test, options.clone())
        .await
        .expect("inotify needs no privileges");
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    first.wait_listed(plugin.socket(), "registered").await;
    first.stop().await;
    let (handler_mark, plugin_mark) = (handler.mark(), plugin.mark());
    options.extra.push("--reregister-on-restart".into());
    let _second = AgentProcess::start(&test, options)
        .await
        .expect("inotify needs no privileges");
    plugin
        .wait_for_notify_after(plugin_mark, true, EVENT_TIMEOUT)
        .await;
    // The handler logs a call after answering it: await the line before reading the log.
    handler
        .wait_for_count(handler_mark, 1, "the Register", EVENT_TIMEOUT, |l| {
            l.field_is("call", "register")
        })
        .await;
    let calls: Vec<String> = handler
        .events()
        .matching_since(handler_mark, |l| l.field("call").is_some())
        .iter()
        .filter_map(|l| l.field("call"))
        .collect();
    assert_eq!(calls, ["validate", "register"], "{test}");
}
