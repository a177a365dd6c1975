//! Discovery cases kubelet gets wrong or never tests: sockets moved in and out, trees created at
//! once, directories removed, things that are not sockets, the `sun_path` limit, sockets that
//! exist before anyone serves on them. Run once per event source.

use plugin_agent_tests::handler::HandlerProcess;
use plugin_agent_tests::{
    AgentOptions, AgentProcess, EVENT_TIMEOUT, Mark, PluginDir, PluginProcess, Scenario, Source,
    admin, per_source, plugin, seen, test_name,
};
use std::path::Path;
use std::time::{Duration, Instant};

per_source!(
    follows_a_socket_renamed_into_within_and_out_of_the_directory,
    registers_sockets_placed_at_once_in_trees_made_with_mkdir_p,
    deregisters_when_a_directory_is_removed_and_registers_when_it_is_re_created,
    re_creates_a_removed_root_directory_and_registers_plugins_in_it_again,
    ignores_regular_files_and_fifos,
    ignores_names_starting_with_a_dot,
    ignores_symlinks_to_sockets_and_to_directories,
    registers_a_socket_whose_path_is_107_bytes_long,
    registers_a_fresh_socket_at_once_after_repeated_failures_on_its_path,
    registers_a_plugin_that_binds_before_it_serves_as_soon_as_it_serves,
    registers_a_plugin_that_listens_a_second_after_it_binds_and_serves_one_connection,
    loses_no_plugin_under_a_create_delete_storm,
    deregisters_a_plugin_whose_socket_is_deleted_during_registration,
);

/// Starts a well-behaved plugin at `socket` and waits until the agent has registered it: proof
/// that every event before its creation has been handled.
async fn sentinel(agent: &AgentProcess, socket: &Path) -> PluginProcess {
    let plugin = plugin!(socket).name("sentinel.example.com").spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    agent
        .wait_for_event(
            Mark(0),
            "the sentinel registered",
            EVENT_TIMEOUT,
            seen::registered(socket),
        )
        .await;
    plugin
}

/// Fails if any agent event names `path` or `list` shows it.
fn assert_never_mentioned(agent: &AgentProcess, path: &Path, why: &str) {
    let events = agent.events_since(Mark(0), seen::about(path));
    if let Some(event) = events.first() {
        agent.fail(&format!(
            "{} should be ignored ({why}), but the agent reported: {event}",
            path.display()
        ));
    }
    if let Some(row) = admin::list(agent.admin_socket()).get(path) {
        agent.fail(&format!(
            "{} should be ignored ({why}), but the agent lists it: {row:?}",
            path.display()
        ));
    }
}

async fn follows_a_socket_renamed_into_within_and_out_of_the_directory(source: Source) {
    let Some(Scenario { dir, agent, .. }) = Scenario::start(source).await else {
        return;
    };
    let outside = dir.outside("mover.sock");
    let plugin = plugin!(&outside).spawn();
    plugin.wait_for_event("listening", EVENT_TIMEOUT).await;

    let inside = dir.path("mover.sock");
    std::fs::rename(&outside, &inside).expect("rename into the directory");
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    agent
        .wait_for_event(
            Mark(0),
            "registered after rename in",
            EVENT_TIMEOUT,
            seen::registered(&inside),
        )
        .await;

    std::fs::create_dir(dir.path("sub")).expect("mkdir sub");
    let renamed = dir.path("sub/renamed.sock");
    let mark = agent.event_mark();
    let plugin_mark = plugin.mark();
    std::fs::rename(&inside, &renamed).expect("rename within the directory");
    agent
        .wait_for_event(
            mark,
            "old name deregistered",
            EVENT_TIMEOUT,
            seen::deregistered(&inside),
        )
        .await;
    plugin
        .wait_for_notify_after(plugin_mark, true, EVENT_TIMEOUT)
        .await;
    agent
        .wait_for_event(
            mark,
            "new name registered",
            EVENT_TIMEOUT,
            seen::registered(&renamed),
        )
        .await;

    let mark = agent.event_mark();
    std::fs::rename(&renamed, &outside).expect("rename out of the directory");
    agent
        .wait_for_event(
            mark,
            "deregistered after rename out",
            EVENT_TIMEOUT,
            seen::deregistered(&renamed),
        )
        .await;
}

async fn registers_sockets_placed_at_once_in_trees_made_with_mkdir_p(source: Source) {
    let Some(Scenario { dir, agent, .. }) = Scenario::start(source).await else {
        return;
    };
    // The plugin runs `mkdir -p` on its socket's parent and binds right after, as drivers do.
    let plugins: Vec<PluginProcess> = (0..5)
        .map(|i| {
            plugin!(dir.path(&format!("t{i}/a/b/c/deep.sock")))
                .name(&format!("deep-{i}.example.com"))
                .spawn()
        })
        .collect();
    for plugin in &plugins {
        plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
        agent
            .wait_for_event(
                Mark(0),
                "deep socket registered",
                EVENT_TIMEOUT,
                seen::registered(plugin.socket()),
            )
            .await;
    }
    // And a tree moved in whole, made elsewhere first.
    let staged = dir.outside("x/y/z/moved.sock");
    let moved = plugin!(&staged).spawn();
    moved.wait_for_event("listening", EVENT_TIMEOUT).await;
    std::fs::rename(dir.outside("x"), dir.path("x")).expect("move the tree in");
    moved.wait_for_notify(true, EVENT_TIMEOUT).await;
    agent
        .wait_for_event(
            Mark(0),
            "moved-in tree registered",
            EVENT_TIMEOUT,
            seen::registered(&dir.path("x/y/z/moved.sock")),
        )
        .await;
    std::fs::rename(dir.path("x"), dir.outside("x")).expect("move the tree back out");
}

async fn deregisters_when_a_directory_is_removed_and_registers_when_it_is_re_created(
    source: Source,
) {
    let Some(Scenario { dir, agent, .. }) = Scenario::start(source).await else {
        return;
    };
    let socket = dir.path("sub/inner/p.sock");
    for round in 0..3 {
        let plugin = plugin!(&socket)
            .name(&format!("round-{round}.example.com"))
            .spawn();
        plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
        let mark = agent.event_mark();
        std::fs::remove_dir_all(dir.path("sub")).expect("rm -r sub");
        agent
            .wait_for_event(
                mark,
                &format!("round {round}: deregistered"),
                EVENT_TIMEOUT,
                seen::deregistered(&socket),
            )
            .await;
        plugin.stop().await;
    }
}

async fn re_creates_a_removed_root_directory_and_registers_plugins_in_it_again(source: Source) {
    let Some(Scenario { test, dir, agent }) = Scenario::start(source).await else {
        return;
    };
    let socket = dir.path("p.sock");
    let plugin = plugin!(&socket).spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    let mark = agent.event_mark();
    std::fs::remove_dir_all(dir.root()).expect("rm -r the plugin directory");
    agent
        .wait_for_event(
            mark,
            "deregistered with the root",
            EVENT_TIMEOUT,
            seen::deregistered(&socket),
        )
        .await;
    plugin.stop().await;
    agent
        .wait_for_event(
            mark,
            "a walk after the root was removed",
            EVENT_TIMEOUT,
            seen::any_walk,
        )
        .await;
    assert!(
        dir.root().is_dir(),
        "{test}: the agent did not re-create its plugin directory"
    );

    let again = plugin!(&socket).name("again.example.com").spawn();
    again.wait_for_notify(true, EVENT_TIMEOUT).await;
    agent
        .wait_for_event(
            mark,
            "registered in the re-created root",
            EVENT_TIMEOUT,
            seen::registered(&socket),
        )
        .await;
}

async fn ignores_regular_files_and_fifos(source: Source) {
    let test = test_name();
    let dir = PluginDir::new();
    let make = |name: &str| {
        std::fs::write(dir.path(&format!("{name}-file.sock")), b"not a socket")
            .expect("write a regular file");
        nix::unistd::mkfifo(
            &dir.path(&format!("{name}-fifo.sock")),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .expect("mkfifo");
    };
    make("before");
    let Some(agent) = AgentProcess::start_default(&test, source, &dir.root()).await else {
        return;
    };
    make("after");
    let _sentinel = sentinel(&agent, &dir.path("sentinel.sock")).await;
    for name in ["before-file", "before-fifo", "after-file", "after-fifo"] {
        assert_never_mentioned(&agent, &dir.path(&format!("{name}.sock")), "not a socket");
    }
}

async fn ignores_symlinks_to_sockets_and_to_directories(source: Source) {
    let test = test_name();
    let dir = PluginDir::new();
    let target = dir.outside("target/real.sock");
    let plugin = plugin!(&target).spawn();
    plugin.wait_for_event("listening", EVENT_TIMEOUT).await;
    std::os::unix::fs::symlink(&target, dir.path("before-link.sock"))
        .expect("symlink before start");
    let Some(agent) = AgentProcess::start_default(&test, source, &dir.root()).await else {
        return;
    };
    std::os::unix::fs::symlink(&target, dir.path("after-link.sock")).expect("symlink after start");
    std::os::unix::fs::symlink(dir.outside("target"), dir.path("linked-dir"))
        .expect("symlink to a directory");
    let _sentinel = sentinel(&agent, &dir.path("sentinel.sock")).await;
    for path in [
        dir.path("before-link.sock"),
        dir.path("after-link.sock"),
        dir.path("linked-dir/real.sock"),
    ] {
        assert_never_mentioned(&agent, &path, "symlinks are not followed, by design");
    }
    assert!(
        plugin.events_since(Mark(0), "get_info").is_empty(),
        "{test}: the agent called the plugin through a symlink"
    );
}

async fn registers_a_socket_whose_path_is_107_bytes_long(source: Source) {
    let Some(Scenario { test, dir, agent }) = Scenario::start(source).await else {
        return;
    };
    let prefix = dir.root().to_string_lossy().len() + 1;
    assert!(
        prefix + 6 <= 107,
        "{test}: the temporary directory's path is too long: {}",
        dir.root().display()
    );
    let name = format!("{}.sock", "l".repeat(107 - prefix - 5));
    let socket = dir.path(&name);
    assert_eq!(
        socket.as_os_str().len(),
        107,
        "{test}: the path is not 107 bytes"
    );
    let plugin = plugin!(&socket).spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    agent
        .wait_for_event(
            Mark(0),
            "107-byte socket registered",
            EVENT_TIMEOUT,
            seen::registered(&socket),
        )
        .await;
    let mark = agent.event_mark();
    plugin.stop().await;
    agent
        .wait_for_event(
            mark,
            "107-byte socket deregistered",
            EVENT_TIMEOUT,
            seen::deregistered(&socket),
        )
        .await;
}

async fn registers_a_fresh_socket_at_once_after_repeated_failures_on_its_path(source: Source) {
    let Some(Scenario { test, dir, agent }) = Scenario::start(source).await else {
        return;
    };
    let socket = dir.path("broken.sock");
    let broken = plugin!(&socket).arg("--mode").arg("non-grpc").spawn();
    // Four failures put the socket 4 s into backoff (500 ms, 1 s, 2 s, 4 s).
    let fourth = agent
        .wait_for_events(
            Mark(0),
            4,
            "four failed attempts",
            EVENT_TIMEOUT,
            seen::registration_failed(&socket),
        )
        .await
        .pop()
        .expect("four failures");
    // Crash: the socket stays; the restarted plugin replaces it with a new one.
    broken.kill().await;
    let started = Instant::now();
    let fresh = plugin!(&socket).name("fresh.example.com").spawn();
    fresh.wait_for_notify(true, EVENT_TIMEOUT).await;
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(2500),
        "{test}: the new socket waited out the old one's backoff ({took:?}; last failure: {fourth})"
    );
}

async fn registers_a_plugin_that_binds_before_it_serves_as_soon_as_it_serves(source: Source) {
    let Some(Scenario { test, dir, agent }) = Scenario::start(source).await else {
        return;
    };
    let socket = dir.path("slow.sock");
    let started = Instant::now();
    let plugin = plugin!(&socket)
        .arg("--listen-delay")
        .arg("2s")
        .arg("--serve-delay")
        .arg("2s")
        .spawn();
    plugin.wait_for_event("serving", EVENT_TIMEOUT).await;
    let serving = Instant::now();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    let after_serving = serving.elapsed();
    let total = started.elapsed();
    assert!(
        after_serving < Duration::from_secs(1),
        "{test}: registered {after_serving:?} after the plugin served"
    );
    assert!(
        total < Duration::from_secs(7),
        "{test}: registration took {total:?} (want well under the 10 s dial budget)"
    );
    agent
        .wait_for_event(
            Mark(0),
            "registered",
            EVENT_TIMEOUT,
            seen::registered(&socket),
        )
        .await;
    let failures = agent.events_since(Mark(0), seen::any_registration_failed);
    if let Some(failure) = failures.first() {
        agent.fail(&format!(
            "a plugin that is not serving yet was counted as failed: {failure}"
        ));
    }
}

/// A socket that refuses connections waits without an operation (see `state::backoff`); where
/// no listen is reported (fanotify, inotify) a bare connect looks for it, and the registration
/// asks on that connection: a plugin that serves exactly one connection would otherwise have
/// served the look and never the registration.
async fn registers_a_plugin_that_listens_a_second_after_it_binds_and_serves_one_connection(
    source: Source,
) {
    let Some(Scenario { test, dir, agent }) = Scenario::start(source).await else {
        return;
    };
    let socket = dir.path("once.sock");
    let plugin = plugin!(&socket)
        .name("once.example.com")
        .arg("--listen-delay")
        .arg("1s")
        .arg("--serve-once")
        .spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    let failures = agent.events_since(Mark(0), seen::any_registration_failed);
    if let Some(failure) = failures.first() {
        agent.fail(&format!(
            "{test}: a plugin that was not listening yet was counted as failed: {failure}"
        ));
    }
}

async fn loses_no_plugin_under_a_create_delete_storm(source: Source) {
    let Some(Scenario { test, dir, agent }) = Scenario::start(source).await else {
        return;
    };
    std::fs::create_dir(dir.path("storm")).expect("mkdir storm");
    // Enough churn to overflow a default inotify queue (16384 events) if the agent falls behind.
    let storm = |files: usize| {
        let storm_dir = dir.path("storm");
        tokio::task::spawn_blocking(move || {
            for i in 0..files {
                let path = storm_dir.join(format!("f{}", i % 256));
                let _ = std::fs::write(&path, b"");
                let _ = std::fs::remove_file(&path);
            }
        })
    };
    let churn = storm(20_000);
    let plugins: Vec<PluginProcess> = (0..20)
        .map(|i| {
            plugin!(dir.path(&format!("s{i}/p.sock")))
                .name(&format!("storm-{i}.example.com"))
                .spawn()
        })
        .collect();
    churn.await.expect("the storm ran");
    for plugin in &plugins {
        plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
        agent
            .wait_for_event(
                Mark(0),
                "registered during the storm",
                EVENT_TIMEOUT,
                seen::registered(plugin.socket()),
            )
            .await;
    }

    let mark = agent.event_mark();
    let churn = storm(20_000);
    let (stopped, kept): (Vec<_>, Vec<_>) = plugins
        .into_iter()
        .enumerate()
        .partition(|(i, _)| i % 2 == 0);
    let stopped_sockets: Vec<_> = stopped
        .iter()
        .map(|(_, p)| p.socket().to_path_buf())
        .collect();
    for (_, plugin) in stopped {
        plugin.stop().await;
    }
    churn.await.expect("the storm ran");
    for socket in &stopped_sockets {
        agent
            .wait_for_event(
                mark,
                "deregistered during the storm",
                EVENT_TIMEOUT,
                seen::deregistered(socket),
            )
            .await;
    }
    for (_, plugin) in &kept {
        let wrong = agent.events_since(Mark(0), seen::deregistered(plugin.socket()));
        if let Some(line) = wrong.first() {
            agent.fail(&format!("a running plugin was deregistered: {line}"));
        }
    }
    let walks = agent.events_since(Mark(0), |l| seen::any_walk(l) && !seen::walked("start")(l));
    eprintln!("{test}: {} rescans during the storms", walks.len());
}

async fn deregisters_a_plugin_whose_socket_is_deleted_during_registration(source: Source) {
    let test = test_name();
    let dir = PluginDir::new();
    // A handler whose call log says what it was told, whatever the agent's way through it.
    let handler = HandlerProcess::start(
        env!("CARGO_BIN_EXE_dra-handler"),
        &dir.outside("handler.sock"),
        &[],
    )
    .await;
    let options = AgentOptions::new(source, &dir.root())
        .handlers(&[&format!("DRAPlugin={}", handler.target())]);
    let Some(agent) = AgentProcess::start(&test, options).await else {
        return;
    };
    let socket = dir.path("short-lived.sock");
    // A DRA plugin: the `dra-handler` validates the services a plugin speaks.
    let plugin = plugin!(&socket)
        .plugin_type("DRAPlugin")
        .arg("--versions")
        .arg("v1.DRAPlugin")
        .arg("--get-info-delay")
        .arg("500ms")
        .spawn();
    plugin.wait_for_event("get_info", EVENT_TIMEOUT).await;
    // The plugin still serves (on the unlinked socket) and answers GetInfo after the deletion.
    std::fs::remove_file(&socket).expect("delete the socket during registration");
    agent
        .wait_for_event(
            Mark(0),
            "the deletion seen",
            EVENT_TIMEOUT,
            seen::removed(&socket),
        )
        .await;
    // Whatever the agent did meanwhile, it must end with the plugin not registered: every
    // handler registration is followed by a deregistration. A socket that vanished under its
    // registration is no failure: that attempt ends `registration_abandoned`.
    agent
        .wait_for_event(
            Mark(0),
            "the registration attempt ended",
            EVENT_TIMEOUT,
            |l| {
                seen::registered(&socket)(l)
                    || seen::registration_failed(&socket)(l)
                    || seen::abandoned(&socket)(l)
            },
        )
        .await;
    let registered = handler.calls_since(Mark(0), "register").len();
    if registered > 0 {
        handler
            .wait_for_count(
                Mark(0),
                registered,
                "a deregistration per registration",
                EVENT_TIMEOUT,
                |l| l.field_is("call", "deregister"),
            )
            .await;
    }
    eprintln!("{test}: {registered} handler registrations before the deletion took effect");
}

async fn ignores_names_starting_with_a_dot(source: Source) {
    let test = test_name();
    let dir = PluginDir::new();
    std::fs::create_dir(dir.path(".hidden-before")).expect("mkdir .hidden-before");
    let before = [
        plugin!(dir.path(".before.sock")).spawn(),
        plugin!(dir.path(".hidden-before/p.sock")).spawn(),
    ];
    for plugin in &before {
        plugin.wait_for_event("listening", EVENT_TIMEOUT).await;
    }
    let Some(agent) = AgentProcess::start_default(&test, source, &dir.root()).await else {
        return;
    };
    std::fs::create_dir(dir.path(".hidden-after")).expect("mkdir .hidden-after");
    let after = [
        plugin!(dir.path(".after.sock")).spawn(),
        plugin!(dir.path(".hidden-after/p.sock")).spawn(),
    ];
    for plugin in &after {
        plugin.wait_for_event("listening", EVENT_TIMEOUT).await;
    }
    let _sentinel = sentinel(&agent, &dir.path("sentinel.sock")).await;
    for plugin in before.iter().chain(&after) {
        assert_never_mentioned(&agent, plugin.socket(), "a name starting with a dot");
        assert!(
            plugin.events_since(Mark(0), "get_info").is_empty(),
            "{test}: the agent called {}",
            plugin.socket().display()
        );
    }
}
