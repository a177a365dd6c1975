//! Restarts, and what handlers see across them.
//!
//! The agent keeps no state across restarts: a new agent rescans and registers every plugin it
//! finds, so every plugin gets ValidatePlugin + RegisterPlugin again, and handlers must treat a
//! RegisterPlugin for a (name, endpoint) they already hold as a refresh (docs/operations.md).
//! These tests pin exactly that down with 1,000 plugins and the example DRA handler's call log,
//! and check that SIGTERM lets a running registration finish before the agent exits.

use plugin_agent_tests::handler::HandlerProcess;
use plugin_agent_tests::host::PluginHost;
use plugin_agent_tests::{
    AgentOptions, AgentProcess, EVENT_TIMEOUT, Line, Mark, PluginDir, Source, admin, per_source,
    plugin, test_name,
};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

per_source!(converges_after_sigkill_with_1000_plugins_and_handlers_see_one_refresh_each);

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

async fn converges_after_sigkill_with_1000_plugins_and_handlers_see_one_refresh_each(
    source: Source,
) {
    converges_after_sigkill(source, 1000).await
}

/// SIGKILL with `plugins` registered, start again: every plugin registered again, and the
/// handler saw exactly one validate + register (a refresh) per plugin, no deregister.
async fn converges_after_sigkill(source: Source, plugins: usize) {
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
    // Every plugin's own account: it was told Notify(true).
    let took = host
        .wait_registered(Mark(0), plugins, CONVERGE_TIMEOUT)
        .await;
    eprintln!("{test}: {plugins} plugins registered in {took:?}");

    // SIGKILL: no deregistration, no clean-up; the handler still holds all 1,000.
    let pid = nix::unistd::Pid::from_raw(first.pid().expect("running") as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).expect("SIGKILL");
    drop(first);
    let handler_mark = handler.mark();
    let host_mark = host.mark();

    let restarted = Instant::now();
    let second = AgentProcess::start(&test, options.clone())
        .await
        .expect("it started once");
    let took = host
        .wait_registered(host_mark, plugins, CONVERGE_TIMEOUT)
        .await;
    let converged = restarted.elapsed();
    eprintln!(
        "{test}: after SIGKILL, restart to {plugins} registered took {converged:?} ({took:?} after the wait began)"
    );

    // No plugin missing: the agent lists every socket, registered.
    let listed = admin::list(&options.admin_socket);
    let registered = listed.values().filter(|e| e.state == "registered").count();
    assert_eq!(
        (listed.len(), registered),
        (plugins, plugins),
        "{test}: every plugin listed and registered after the restart"
    );

    // What the handler saw: per plugin, exactly Validate then Register for the same endpoint,
    // which it already held (a refresh), and never a DeRegister.
    handler
        .wait_for_count(
            handler_mark,
            plugins,
            "a register per plugin",
            EVENT_TIMEOUT,
            |l| l.field_is("call", "register"),
        )
        .await;
    let by_name = calls_by_name(&handler, handler_mark);
    assert_eq!(by_name.len(), plugins, "{test}: every plugin seen again");
    for (name, calls) in &by_name {
        let kinds: Vec<String> = calls.iter().filter_map(|l| l.field("call")).collect();
        assert_eq!(kinds, ["validate", "register"], "{test}: {name}: {calls:?}");
        let endpoint = calls[1].field("endpoint").unwrap_or_default();
        assert_eq!(
            calls[1].field("replaced").as_deref(),
            Some(endpoint.as_str()),
            "{test}: {name}: the Register after the restart refreshes the same endpoint: {}",
            calls[1]
        );
    }
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
    // GetInfo answered: the handler's ValidatePlugin (1.5 s) and RegisterPlugin (1.5 s) are next.
    agent
        .wait_for_log("GetInfo answered", EVENT_TIMEOUT, |l| {
            l.message() == "GetInfo answered"
        })
        .await;
    let stopping = Instant::now();
    let mark = agent.mark();
    let log = agent.log().clone();
    let status = agent.stop().await;
    let stopped_after = stopping.elapsed();
    eprintln!("{test}: exited {status:?} {stopped_after:?} after SIGTERM");
    assert_eq!(status.code(), Some(0), "{test}: exit status {status:?}");

    // The registration ran to its end before the exit: the handler registered the plugin and
    // the plugin was told so (a clean rollback would show Notify(false) and a deregister).
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
            "{test}: neither finished nor rolled back (register, notify, deregister) = {other:?}\n{}",
            log.tail(40)
        ),
    }
    assert!(
        log.matching_since(mark, |l| l.message() == "plugin registered")
            .len()
            + log
                .matching_since(mark, |l| l.message() == "plugin registration failed")
                .len()
            == 1,
        "{test}: the agent logged the outcome before exiting:\n{}",
        log.tail(40)
    );
}
