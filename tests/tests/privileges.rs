//! Least privilege, per event source: once its source is attached the agent holds exactly
//! `CAP_DAC_OVERRIDE` (what the kernel reports in `/proc/<pid>/status`), and that is enough to keep discovering and registering plugins in directories and sockets
//! created afterwards by other users with private modes.

use plugin_agent_tests::procfs::{self, DAC_OVERRIDE};
use plugin_agent_tests::{
    AgentProcess, EVENT_TIMEOUT, PluginDir, Source, per_source, plugin, test_name,
};
use std::os::unix::fs::PermissionsExt;

per_source!(
    keeps_only_dac_capabilities_and_still_registers_plugins_in_private_directories_created_later
);

/// `nobody`: an owner the agent is not.
const OTHER_UID: u32 = 65534;

async fn keeps_only_dac_capabilities_and_still_registers_plugins_in_private_directories_created_later(
    source: Source,
) {
    let test = test_name();
    let dir = PluginDir::new();
    // Privileges only mean something with root's capabilities to drop.
    if !plugin_agent_tests::env::privileged(&test) {
        return;
    }
    let Some(agent) = AgentProcess::start_default(&test, source, &dir.root()).await else {
        return;
    };
    // Started: the admin API that said so is served only once the capabilities are dropped.
    let pid = agent.pid().expect("running");
    let caps = procfs::caps(pid).expect("read /proc/<pid>/status");
    assert_eq!(
        caps.effective, DAC_OVERRIDE,
        "{test}: CapEff should be DAC_OVERRIDE: {caps:x?}"
    );
    assert_eq!(caps.permitted, DAC_OVERRIDE, "{test}: CapPrm {caps:x?}");
    assert_eq!(caps.bounding, DAC_OVERRIDE, "{test}: CapBnd {caps:x?}");
    assert_eq!(
        (caps.inheritable, caps.ambient),
        (0, 0),
        "{test}: {caps:x?}"
    );

    // A driver directory made after the drop: another owner, mode 0700 (CAP_DAC_OVERRIDE walks
    // it), holding a socket of that owner with mode 0600 (CAP_DAC_OVERRIDE connects to it). Both are in place before the plugin listens.
    let private_dir = dir.path("vendor/private");
    std::fs::create_dir_all(&private_dir).expect("mkdir");
    for d in [dir.path("vendor"), private_dir.clone()] {
        std::os::unix::fs::chown(&d, Some(OTHER_UID), Some(OTHER_UID)).expect("chown dir");
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).expect("chmod dir");
    }
    let socket = private_dir.join("driver.sock");
    let plugin = plugin!(&socket)
        .name("private.example.com")
        .arg("--listen-delay")
        .arg("1s")
        .start()
        .await;
    std::os::unix::fs::chown(&socket, Some(OTHER_UID), Some(OTHER_UID)).expect("chown socket");
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600))
        .expect("chmod socket");
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    agent
        .wait_for_event(
            plugin_agent_tests::Mark(0),
            "the private plugin registered",
            EVENT_TIMEOUT,
            plugin_agent_tests::seen::registered(&socket),
        )
        .await;
    assert_eq!(
        procfs::caps(pid).expect("status").effective,
        DAC_OVERRIDE,
        "{test}: no capability came back"
    );
}
