//! Scenarios kubelet's plugin manager tests assert upstream (pluginwatcher, reconciler and the DRA
//! e2e suite), run end to end against the real agent, once per event source.

use plugin_agent_tests::{
    AgentProcess, EVENT_TIMEOUT, Mark, PluginDir, PluginProcess, Scenario, Source, admin, logs,
    per_source, plugin, test_name,
};
use std::path::{Path, PathBuf};

per_source!(
    registers_plugins_at_depth_0_1_and_2,
    registers_and_deregisters_a_plugin_over_10_serve_stop_rounds,
    tracks_10_plugins_with_the_same_name_on_different_sockets,
    deregisters_each_socket_of_a_re_registered_name_when_it_goes,
    re_registers_one_socket_path_10_times_with_a_new_name_each_time,
    registers_10_sockets_that_exist_before_the_agent_starts,
    registers_again_after_the_agent_restarts,
    stays_registered_without_a_call_after_the_agent_restarts,
    registers_again_after_the_plugin_restarts,
    recovers_after_get_info_errors_are_cleared,
);

/// Asserts the plugin at `socket` is registered exactly once after `mark`, and never failed.
fn assert_registered_once(agent: &AgentProcess, mark: Mark, socket: &Path) {
    let handler_calls = agent.logs_since(mark, logs::handler_registered(socket));
    if handler_calls.len() != 1 {
        agent.fail(&format!(
            "{}: {} handler registrations, want 1",
            socket.display(),
            handler_calls.len()
        ));
    }
    let failures = agent.logs_since(mark, logs::registration_failed(socket));
    if !failures.is_empty() {
        agent.fail(&format!(
            "{}: registration failed: {}",
            socket.display(),
            failures[0]
        ));
    }
}

async fn registers_plugins_at_depth_0_1_and_2(source: Source) {
    let Some(Scenario { test, dir, agent }) = Scenario::start(source).await else {
        return;
    };
    std::fs::create_dir_all(dir.path("d1/d2")).expect("create d1/d2");
    let sockets = [
        dir.path("p0.sock"),
        dir.path("d1/p1.sock"),
        dir.path("d1/d2/p2.sock"),
    ];
    let plugins: Vec<PluginProcess> = sockets
        .iter()
        .enumerate()
        .map(|(depth, socket)| {
            plugin!(socket)
                .name(&format!("depth-{depth}.example.com"))
                .spawn()
        })
        .collect();
    for (plugin, socket) in plugins.iter().zip(&sockets) {
        let notify = plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
        assert_eq!(
            notify.field("error").as_deref(),
            Some(""),
            "{test}: registered with an error"
        );
        agent
            .wait_for_log(
                &format!("{} registered", socket.display()),
                EVENT_TIMEOUT,
                logs::registered(socket),
            )
            .await;
    }
    for socket in &sockets {
        assert_registered_once(&agent, Mark(0), socket);
    }
    for (depth, plugin) in plugins.iter().enumerate() {
        assert_eq!(
            plugin.notifications().len(),
            1,
            "{test}: plugin at depth {depth} notified more than once"
        );
    }
}

async fn registers_and_deregisters_a_plugin_over_10_serve_stop_rounds(source: Source) {
    let Some(Scenario { test, dir, agent }) = Scenario::start(source).await else {
        return;
    };
    let socket = dir.path("rounds.sock");
    for round in 0..10 {
        let mark = agent.mark();
        let plugin = plugin!(&socket)
            .name(&format!("round-{round}.example.com"))
            .spawn();
        plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
        agent
            .wait_for_log_after(
                mark,
                &format!("round {round}: registered"),
                EVENT_TIMEOUT,
                logs::registered(&socket),
            )
            .await;
        plugin.stop().await;
        assert!(
            !socket.exists(),
            "{test}: the plugin left its socket behind"
        );
        agent
            .wait_for_log_after(
                mark,
                &format!("round {round}: deregistered"),
                EVENT_TIMEOUT,
                logs::deregistered(&socket),
            )
            .await;
        assert_registered_once(&agent, mark, &socket);
    }
}

async fn tracks_10_plugins_with_the_same_name_on_different_sockets(source: Source) {
    let Some(Scenario { dir, agent, .. }) = Scenario::start(source).await else {
        return;
    };
    let sockets: Vec<PathBuf> = (0..10)
        .map(|i| dir.path(&format!("same-{i}.sock")))
        .collect();
    let plugins: Vec<PluginProcess> = sockets
        .iter()
        .map(|s| plugin!(s).name("same.example.com").spawn())
        .collect();
    for (plugin, socket) in plugins.iter().zip(&sockets) {
        plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
        agent
            .wait_for_log(
                &format!("{} registered", socket.display()),
                EVENT_TIMEOUT,
                logs::registered(socket),
            )
            .await;
    }
    for socket in &sockets {
        assert_registered_once(&agent, Mark(0), socket);
    }

    // Handler contract since kubelet 1.33 (kubernetes PR 129832): every registered socket's
    // deletion deregisters it, with its own endpoint, also when others carry the same name.
    let mark = agent.mark();
    for plugin in plugins {
        plugin.stop().await;
    }
    let gone = agent
        .wait_for_logs(mark, 10, "10 sockets deregistered", EVENT_TIMEOUT, |l| {
            l.message() == "plugin deregistered"
        })
        .await;
    let sockets: std::collections::BTreeSet<String> =
        gone.iter().filter_map(|l| l.field("socket_path")).collect();
    if sockets.len() != 10 {
        agent.fail(&format!(
            "10 sockets of one plugin name deregistered {} distinct sockets, want 10: {gone:?}",
            sockets.len()
        ));
    }
}

async fn re_registers_one_socket_path_10_times_with_a_new_name_each_time(source: Source) {
    let Some(Scenario { test, dir, agent }) = Scenario::start(source).await else {
        return;
    };
    let socket = dir.path("rereg.sock");
    let mut previous: Option<PluginProcess> = None;
    let mut generations = Vec::new();
    for round in 0..10 {
        let name = format!("rereg-{round}.example.com");
        let mark = agent.mark();
        // The new plugin replaces the socket while the old one still runs (a plugin upgrade).
        let plugin = plugin!(&socket).name(&name).spawn();
        plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
        let registered = agent
            .wait_for_log_after(mark, &format!("{name} registered"), EVENT_TIMEOUT, |l| {
                logs::registered(&socket)(l) && l.field_is("plugin_name", &name)
            })
            .await;
        generations.push(registered.field("generation").unwrap_or_default());
        if round > 0 {
            let old = format!("rereg-{}.example.com", round - 1);
            let deregistered = agent
                .wait_for_log_after(mark, &format!("{old} deregistered"), EVENT_TIMEOUT, |l| {
                    logs::deregistered(&socket)(l) && l.field_is("plugin_name", &old)
                })
                .await;
            if deregistered.position() > registered.position() {
                agent.fail(&format!(
                    "{old} was deregistered after {name} was registered"
                ));
            }
        }
        if let Some(old) = previous.replace(plugin) {
            old.stop().await;
        }
        assert!(
            socket.exists(),
            "{test}: stopping the old plugin removed the new plugin's socket"
        );
    }
    let mut unique = generations.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(
        unique.len(),
        10,
        "{test}: a new generation (UUID) per re-registration: {generations:?}"
    );
}

async fn registers_10_sockets_that_exist_before_the_agent_starts(source: Source) {
    let test = test_name();
    let dir = PluginDir::new();
    let mut plugins = Vec::new();
    for i in 0..10 {
        let socket = if i % 2 == 0 {
            dir.path(&format!("pre-{i}.sock"))
        } else {
            dir.path(&format!("sub{i}/pre-{i}.sock"))
        };
        plugins.push(
            plugin!(socket)
                .name(&format!("pre-{i}.example.com"))
                .spawn(),
        );
    }
    for plugin in &plugins {
        plugin.wait_for_event("listening", EVENT_TIMEOUT).await;
    }
    let Some(agent) = AgentProcess::start_default(&test, source, &dir.root()).await else {
        return;
    };
    for plugin in &plugins {
        plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
        agent
            .wait_for_log(
                "registered",
                EVENT_TIMEOUT,
                logs::registered(plugin.socket()),
            )
            .await;
        assert_registered_once(&agent, Mark(0), plugin.socket());
    }
}

/// Kubelet's scenario: the plugin is registered again after the agent restarts. That is
/// kubelet's behaviour (its actual state is in memory only) and this agent's with
/// `--reregister-on-restart`; by default it carries on from its state file instead (below).
async fn registers_again_after_the_agent_restarts(source: Source) {
    restart_with(source, true).await
}

/// This agent's default: the restarted agent carries on from the state file, so the plugin,
/// whose socket did not change, is not called again and stays registered.
async fn stays_registered_without_a_call_after_the_agent_restarts(source: Source) {
    restart_with(source, false).await
}

async fn restart_with(source: Source, reregister: bool) {
    let test = test_name();
    let dir = PluginDir::new();
    let socket = dir.path("dra.sock");
    let plugin = plugin!(&socket)
        .plugin_type("DRAPlugin")
        .name("dra.example.com")
        .arg("--versions")
        .arg("v1.DRAPlugin")
        .spawn();
    let mut options = plugin_agent_tests::AgentOptions::new(source, &dir.root())
        .handlers(&["DRAPlugin=accept-all"]);
    let Some(agent) = AgentProcess::start(&test, options.clone()).await else {
        return;
    };
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    agent
        .wait_for_log("registered", EVENT_TIMEOUT, logs::registered(&socket))
        .await;
    let status = agent.stop().await;
    assert!(
        status.success(),
        "{test}: the agent did not exit cleanly on SIGTERM: {status:?}"
    );

    let mark = plugin.mark();
    if reregister {
        options.extra.push("--reregister-on-restart".into());
    }
    let Some(agent) = AgentProcess::start(&test, options.clone()).await else {
        return;
    };
    if reregister {
        plugin
            .wait_for_notify_after(mark, true, EVENT_TIMEOUT)
            .await;
        agent
            .wait_for_log(
                "registered after restart",
                EVENT_TIMEOUT,
                logs::registered(&socket),
            )
            .await;
        assert_registered_once(&agent, Mark(0), &socket);
        return;
    }
    agent
        .wait_for_log("the state file restored", EVENT_TIMEOUT, |l| {
            l.message()
                .starts_with("carrying on from the previous agent's state")
                && l.field_is("restored", "1")
        })
        .await;
    agent
        .wait_for_log("the first walk", EVENT_TIMEOUT, |l| {
            l.message() == "scanned plugin directory"
        })
        .await;
    let listed = admin::list(&options.admin_socket);
    assert_eq!(
        listed.get(&socket).map(|p| p.state.as_str()),
        Some("registered"),
        "{test}: {listed:?}"
    );
    assert!(
        !plugin.called_since(mark),
        "{test}: the unchanged plugin was called again"
    );
}

async fn registers_again_after_the_plugin_restarts(source: Source) {
    let test = test_name();
    let dir = PluginDir::new();
    let socket = dir.path("dra.sock");
    let options = plugin_agent_tests::AgentOptions::new(source, &dir.root())
        .handlers(&["DRAPlugin=accept-all"]);
    let Some(agent) = AgentProcess::start(&test, options).await else {
        return;
    };
    let start = |name: &str| {
        plugin!(&socket)
            .plugin_type("DRAPlugin")
            .name(name)
            .arg("--versions")
            .arg("v1.DRAPlugin")
            .spawn()
    };

    let first = start("dra.example.com");
    first.wait_for_notify(true, EVENT_TIMEOUT).await;
    agent
        .wait_for_log(
            "first registration",
            EVENT_TIMEOUT,
            logs::registered(&socket),
        )
        .await;
    // A crash: the socket stays behind, and the restarted plugin replaces it.
    first.kill().await;
    let mark = agent.mark();
    let second = start("dra.example.com");
    second.wait_for_notify(true, EVENT_TIMEOUT).await;
    agent
        .wait_for_log_after(
            mark,
            "registration after the plugin restarted",
            EVENT_TIMEOUT,
            logs::registered(&socket),
        )
        .await;
    let failures = agent.logs_since(mark, logs::registration_failed(&socket));
    if !failures.is_empty() {
        agent.fail(&format!(
            "the restarted plugin's registration failed first: {}",
            failures[0]
        ));
    }
}

async fn recovers_after_get_info_errors_are_cleared(source: Source) {
    let Some(Scenario { test, dir, agent }) = Scenario::start(source).await else {
        return;
    };
    let socket = dir.path("flaky.sock");
    let plugin = plugin!(&socket)
        .arg("--get-info-error")
        .arg("not ready yet")
        .arg("--get-info-error-times")
        .arg("2")
        .spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    agent
        .wait_for_log(
            "registered after GetInfo errors",
            EVENT_TIMEOUT,
            logs::registered(&socket),
        )
        .await;
    let failures = agent.logs_since(Mark(0), logs::registration_failed(&socket));
    assert_eq!(
        failures.len(),
        2,
        "{test}: want one failure per GetInfo error"
    );
    for failure in &failures {
        let error = failure.field("error").unwrap_or_default();
        assert!(
            error.contains("not ready yet"),
            "{test}: the failure does not say why: {failure}"
        );
    }
    assert_eq!(
        plugin.events_since(Mark(0), "get_info").len(),
        3,
        "{test}: want 2 failed GetInfo calls and 1 good one"
    );
}

async fn deregisters_each_socket_of_a_re_registered_name_when_it_goes(source: Source) {
    let Some(Scenario { dir, agent, .. }) = Scenario::start(source).await else {
        return;
    };
    let (old_socket, new_socket) = (dir.path("old.sock"), dir.path("new.sock"));
    let old = plugin!(&old_socket).name("moving.example.com").spawn();
    old.wait_for_notify(true, EVENT_TIMEOUT).await;
    agent
        .wait_for_log(
            "the old socket registered",
            EVENT_TIMEOUT,
            logs::registered(&old_socket),
        )
        .await;
    let new = plugin!(&new_socket).name("moving.example.com").spawn();
    new.wait_for_notify(true, EVENT_TIMEOUT).await;
    agent
        .wait_for_log(
            "the new socket registered",
            EVENT_TIMEOUT,
            logs::registered(&new_socket),
        )
        .await;

    // Deleting the old socket deregisters that socket only (kubelet 1.33+)...
    let mark = agent.mark();
    old.stop().await;
    agent
        .wait_for_log_after(
            mark,
            "the old socket's removal deregistered",
            EVENT_TIMEOUT,
            logs::deregistered(&old_socket),
        )
        .await;
    // ...and deleting the new one deregisters it too.
    new.stop().await;
    agent
        .wait_for_log_after(
            mark,
            "the new socket's removal deregistered",
            EVENT_TIMEOUT,
            logs::deregistered(&new_socket),
        )
        .await;
}
