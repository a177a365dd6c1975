//! Misbehaving plugins: each is reported with a clear log line, and the plugins around it
//! register as if it were not there. Run once per event source.

use plugin_agent_tests::{
    AgentOptions, AgentProcess, EVENT_TIMEOUT, Line, Mark, PluginDir, PluginOptions, Source, logs,
    per_source, plugin, test_name,
};
use std::time::{Duration, Instant};

per_source!(
    times_out_a_hung_get_info_without_delaying_other_plugins,
    rolls_back_and_retries_when_notify_registration_status_fails,
    tells_a_plugin_of_a_type_without_handler_that_it_is_not_registered,
    refuses_a_get_info_answer_larger_than_64_kib,
    refuses_an_overlong_plugin_name,
    refuses_thousands_of_supported_versions,
    reports_a_listener_that_does_not_speak_grpc,
    reports_a_listener_that_accepts_and_stays_silent,
);

/// Starts `bad` and three good plugins, waits for the good ones to register and for the agent to
/// report `bad` failed with an error containing `expect`, and returns that log line.
async fn bad_plugin_is_reported_and_others_register(
    test: &str,
    source: Source,
    bad: &str,
    expect: &str,
) -> Option<Line> {
    let dir = PluginDir::new();
    let agent = AgentProcess::start_default(test, source, &dir.root()).await?;
    let bad_socket = dir.path("bad.sock");
    let bad_plugin = bad_options(plugin!(&bad_socket), bad).spawn();
    bad_plugin.wait_for_event("serving", EVENT_TIMEOUT).await;
    let good: Vec<_> = (0..3)
        .map(|i| {
            plugin!(dir.path(&format!("good-{i}.sock")))
                .name(&format!("good-{i}.example.com"))
                .spawn()
        })
        .collect();
    for plugin in &good {
        plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
        agent
            .wait_for_log(
                "a good plugin registered",
                EVENT_TIMEOUT,
                logs::registered(plugin.socket()),
            )
            .await;
    }
    let failure = agent
        .wait_for_log(
            "the bad plugin reported",
            EVENT_TIMEOUT,
            logs::registration_failed(&bad_socket),
        )
        .await;
    let error = failure.field("error").unwrap_or_default();
    eprintln!("{test}: reported as: {error}");
    if !error.contains(expect) {
        agent.fail(&format!("the failure should say {expect:?}: {failure}"));
    }
    let registered = bad_plugin
        .events_since(Mark(0), "notify")
        .into_iter()
        .filter(|l| l.flag("registered") == Some(true))
        .count();
    assert_eq!(
        registered, 0,
        "{test}: the bad plugin was told it is registered"
    );
    assert!(
        agent
            .logs_since(Mark(0), logs::handler_registered(&bad_socket))
            .is_empty(),
        "{test}: a handler saw the bad plugin"
    );
    Some(failure)
}

/// Applies the space-separated example-plugin flags in `bad`.
fn bad_options(options: PluginOptions, bad: &str) -> PluginOptions {
    bad.split_whitespace().fold(options, PluginOptions::arg)
}

async fn times_out_a_hung_get_info_without_delaying_other_plugins(source: Source) {
    let test = test_name(
        "times_out_a_hung_get_info_without_delaying_other_plugins",
        source,
    );
    let dir = PluginDir::new();
    let Some(agent) = AgentProcess::start_default(&test, source, &dir.root()).await else {
        return;
    };
    let hung_socket = dir.path("hung.sock");
    let hung = plugin!(&hung_socket).arg("--get-info-hang").spawn();
    hung.wait_for_event("get_info", EVENT_TIMEOUT).await;
    // While the agent waits on the hung plugin, others register at full speed.
    let started = Instant::now();
    let good: Vec<_> = (0..3)
        .map(|i| {
            plugin!(dir.path(&format!("good-{i}.sock")))
                .name(&format!("good-{i}.example.com"))
                .spawn()
        })
        .collect();
    for plugin in &good {
        plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(1),
        "{test}: other plugins took {took:?} to register next to a hung one"
    );
    let failure = agent
        .wait_for_log(
            "the hung GetInfo timed out",
            EVENT_TIMEOUT,
            logs::registration_failed(&hung_socket),
        )
        .await;
    let error = failure.field("error").unwrap_or_default();
    assert!(
        error.contains("GetInfo"),
        "{test}: the failure should name GetInfo: {failure}"
    );
    // And it is retried after its backoff.
    hung.wait_for_events("get_info", 2, EVENT_TIMEOUT).await;
}

async fn rolls_back_and_retries_when_notify_registration_status_fails(source: Source) {
    let test = test_name(
        "rolls_back_and_retries_when_notify_registration_status_fails",
        source,
    );
    let dir = PluginDir::new();
    let Some(agent) = AgentProcess::start_default(&test, source, &dir.root()).await else {
        return;
    };
    let socket = dir.path("picky.sock");
    let plugin = plugin!(&socket)
        .arg("--notify-error")
        .arg("refused by plugin")
        .arg("--notify-error-times")
        .arg("1")
        .spawn();
    let refused = plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    assert_eq!(
        refused.flag("refused"),
        Some(true),
        "{test}: the first notification should be the refused one"
    );
    let rollback = agent
        .wait_for_log(
            "rollback",
            EVENT_TIMEOUT,
            logs::handler_deregistered(&socket),
        )
        .await;
    let failure = agent
        .wait_for_log(
            "the failure",
            EVENT_TIMEOUT,
            logs::registration_failed(&socket),
        )
        .await;
    let error = failure.field("error").unwrap_or_default();
    assert!(
        error.contains("refused by plugin"),
        "{test}: the failure should carry the plugin's error: {failure}"
    );
    assert!(
        rollback.position() < failure.position(),
        "{test}: rolled back after reporting the failure"
    );
    // Retried after backoff, and registered for good.
    let accepted = plugin
        .wait_for_after(Mark(0), "a second notification", EVENT_TIMEOUT, |l| {
            l.event() == "notify" && l.flag("refused") == Some(false)
        })
        .await;
    assert_eq!(
        accepted.flag("registered"),
        Some(true),
        "{test}: the retry should register"
    );
    agent
        .wait_for_log(
            "registered on retry",
            EVENT_TIMEOUT,
            logs::registered(&socket),
        )
        .await;
    let handler_calls = agent
        .logs_since(Mark(0), logs::handler_registered(&socket))
        .len();
    assert_eq!(
        handler_calls, 2,
        "{test}: the handler should have seen the first attempt and the retry"
    );
    let mark = agent.mark();
    plugin.stop().await;
    agent
        .wait_for_log_after(
            mark,
            "deregistered at the end",
            EVENT_TIMEOUT,
            logs::deregistered(&socket),
        )
        .await;
}

async fn tells_a_plugin_of_a_type_without_handler_that_it_is_not_registered(source: Source) {
    let test = test_name(
        "tells_a_plugin_of_a_type_without_handler_that_it_is_not_registered",
        source,
    );
    let dir = PluginDir::new();
    let options = AgentOptions::new(source, &dir.root()).handlers(&["CSIPlugin=accept-all"]);
    let Some(agent) = AgentProcess::start(&test, options).await else {
        return;
    };
    let socket = dir.path("device.sock");
    let device = plugin!(&socket)
        .plugin_type("DevicePlugin")
        .name("vendor.com/gpu")
        .arg("--versions")
        .arg("v1beta1")
        .spawn();
    let csi = plugin!(dir.path("csi.sock")).spawn();
    let refusal = device.wait_for_notify(false, EVENT_TIMEOUT).await;
    let error = refusal.field("error").unwrap_or_default();
    assert!(
        error.starts_with("no handler registered for plugin type: DevicePlugin"),
        "{test}: the plugin should be told kubelet's reason: {refusal}"
    );
    csi.wait_for_notify(true, EVENT_TIMEOUT).await;
    agent
        .wait_for_log(
            "the refusal logged",
            EVENT_TIMEOUT,
            logs::registration_failed(&socket),
        )
        .await;
}

async fn refuses_a_get_info_answer_larger_than_64_kib(source: Source) {
    let test = test_name("refuses_a_get_info_answer_larger_than_64_kib", source);
    bad_plugin_is_reported_and_others_register(&test, source, "--huge-name-bytes 70000", "GetInfo")
        .await;
}

async fn refuses_an_overlong_plugin_name(source: Source) {
    let test = test_name("refuses_an_overlong_plugin_name", source);
    bad_plugin_is_reported_and_others_register(
        &test,
        source,
        "--huge-name-bytes 1000",
        "invalid PluginInfo",
    )
    .await;
}

async fn refuses_thousands_of_supported_versions(source: Source) {
    let test = test_name("refuses_thousands_of_supported_versions", source);
    bad_plugin_is_reported_and_others_register(
        &test,
        source,
        "--versions-count 5000",
        "supported versions",
    )
    .await;
}

async fn reports_a_listener_that_does_not_speak_grpc(source: Source) {
    let test = test_name("reports_a_listener_that_does_not_speak_grpc", source);
    bad_plugin_is_reported_and_others_register(&test, source, "--mode non-grpc", "GetInfo").await;
}

async fn reports_a_listener_that_accepts_and_stays_silent(source: Source) {
    let test = test_name("reports_a_listener_that_accepts_and_stays_silent", source);
    // Indistinguishable from a plugin that listens but does not serve yet, so it may be given the
    // whole dial budget (10 s) before it is reported.
    bad_plugin_is_reported_and_others_register(&test, source, "--mode accept-silent", "GetInfo")
        .await;
}
