//! Scenarios kubelet's plugin manager tests assert upstream (pluginwatcher, reconciler and the DRA
//! e2e suite), run end to end against the real agent, once per event source.

use plugin_agent_tests::{
    AgentProcess, EVENT_TIMEOUT, Mark, PluginDir, PluginProcess, Scenario, Source, admin,
    per_source, plugin, seen, test_name,
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

/// Asserts the plugin at `socket` is registered exactly once after the event `mark`, and never
/// failed.
fn assert_registered_once(agent: &AgentProcess, mark: Mark, socket: &Path) {
    let registrations = agent.events_since(mark, seen::registered(socket));
    if registrations.len() != 1 {
        agent.fail(&format!(
            "{}: {} registrations, want 1: {registrations:?}",
            socket.display(),
            registrations.len()
        ));
    }
    let failures = agent.events_since(mark, seen::registration_failed(socket));
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
            .wait_for_event(
                Mark(0),
                &format!("{} registered", socket.display()),
                EVENT_TIMEOUT,
                seen::registered(socket),
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
        let mark = agent.event_mark();
        let plugin = plugin!(&socket)
            .name(&format!("round-{round}.example.com"))
            .spawn();
        plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
        agent
            .wait_for_event(
                mark,
                &format!("round {round}: registered"),
                EVENT_TIMEOUT,
                seen::registered(&socket),
            )
            .await;
        plugin.stop().await;
        assert!(
            !socket.exists(),
            "{test}: the plugin left its socket behind"
        );
        agent
            .wait_for_event(
                mark,
                &format!("round {round}: deregistered"),
                EVENT_TIMEOUT,
                seen::deregistered(&socket),
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
            .wait_for_event(
                Mark(0),
                &format!("{} registered", socket.display()),
                EVENT_TIMEOUT,
                seen::registered(socket),
            )
            .await;
    }
    for socket in &sockets {
        assert_registered_once(&agent, Mark(0), socket);
    }

    // Handler contract since kubelet 1.33 (kubernetes PR 129832): every registered socket's
    // deletion deregisters it, with its own endpoint, also when others carry the same name.
    let mark = agent.event_mark();
    for plugin in plugins {
        plugin.stop().await;
    }
    let gone = agent
        .wait_for_events(mark, 10, "10 sockets deregistered", EVENT_TIMEOUT, |l| {
            l.field_is("kind", "deregistered")
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
        let mark = agent.event_mark();
        // The new plugin replaces the socket while the old one still runs (a plugin upgrade).
        let plugin = plugin!(&socket).name(&name).spawn();
        plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
        let registered = agent
            .wait_for_event(mark, &format!("{name} registered"), EVENT_TIMEOUT, |l| {
                seen::registered(&socket)(l) && l.field_is("plugin", &format!("CSIPlugin/{name}"))
            })
            .await;
        // The registration `list` shows now is this one (the next round has not begun).
        let listed = admin::list_json(agent.admin_socket());
        let row = &listed[&socket];
        assert_eq!(row["name"], name.as_str(), "{test}: {row}");
        generations.push(row["generation"].as_str().unwrap_or_default().to_string());
        if round > 0 {
            let old = format!("rereg-{}.example.com", round - 1);
            let deregistered = agent
                .wait_for_event(mark, &format!("{old} deregistered"), EVENT_TIMEOUT, |l| {
                    seen::deregistered(&socket)(l)
                        && l.field_is("plugin", &format!("CSIPlugin/{old}"))
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
    // Registered by the start walk, maybe before the test could follow the agent's events:
    // `list` says it, and each plugin's own record says it was told once.
    for plugin in &plugins {
        plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
        agent.wait_listed(plugin.socket(), "registered").await;
        assert_notified_once(&test, plugin, Mark(0));
    }
}

/// Asserts `plugin` was told once after `mark` (its own record), and that it is registered: a
/// failed attempt would have told it `false` first.
fn assert_notified_once(test: &str, plugin: &PluginProcess, mark: Mark) {
    let told: Vec<_> = plugin.events_since(mark, "notify");
    assert!(
        told.len() == 1 && told[0].flag("registered") == Some(true),
        "{test}: {} should be told once that it is registered: {told:?}",
        plugin.socket().display()
    );
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
    // The plugin was there before the agent: its registration may precede the event stream.
    agent.wait_listed(&socket, "registered").await;
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
        // Registered by the start walk: `list` says it, whenever the test began to follow.
        agent.wait_listed(&socket, "registered").await;
        assert_notified_once(&test, &plugin, mark);
        return;
    }
    // Started: the state file was restored before the start walk, which is done; the entry
    // carried on is registered without a call.
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
        .wait_for_event(
            Mark(0),
            "first registration",
            EVENT_TIMEOUT,
            seen::registered(&socket),
        )
        .await;
    // A crash: the socket stays behind, and the restarted plugin replaces it.
    first.kill().await;
    let mark = agent.event_mark();
    let second = start("dra.example.com");
    second.wait_for_notify(true, EVENT_TIMEOUT).await;
    agent
        .wait_for_event(
            mark,
            "registration after the plugin restarted",
            EVENT_TIMEOUT,
            seen::registered(&socket),
        )
        .await;
    let failures = agent.events_since(mark, seen::registration_failed(&socket));
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
        .wait_for_event(
            Mark(0),
            "registered after GetInfo errors",
            EVENT_TIMEOUT,
            seen::registered(&socket),
        )
        .await;
    let failures = agent.events_since(Mark(0), seen::registration_failed(&socket));
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
        .wait_for_event(
            Mark(0),
            "the old socket registered",
            EVENT_TIMEOUT,
            seen::registered(&old_socket),
        )
        .await;
    let new = plugin!(&new_socket).name("moving.example.com").spawn();
    new.wait_for_notify(true, EVENT_TIMEOUT).await;
    agent
        .wait_for_event(
            Mark(0),
            "the new socket registered",
            EVENT_TIMEOUT,
            seen::registered(&new_socket),
        )
        .await;

    // Deleting the old socket deregisters that socket only (kubelet 1.33+)...
    let mark = agent.event_mark();
    old.stop().await;
    agent
        .wait_for_event(
            mark,
            "the old socket's removal deregistered",
            EVENT_TIMEOUT,
            seen::deregistered(&old_socket),
        )
        .await;
    // ...and deleting the new one deregisters it too.
    new.stop().await;
    agent
        .wait_for_event(
            mark,
            "the new socket's removal deregistered",
            EVENT_TIMEOUT,
            seen::deregistered(&new_socket),
        )
        .await;
}
