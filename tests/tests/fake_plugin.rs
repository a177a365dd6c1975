//! The fake plugin's own options that no agent test reaches through the agent: checked with a
//! bare registration client, so a broken option fails here rather than as an agent bug.

use plugin_agent_proto::pluginregistration::InfoRequest;
use plugin_agent_proto::pluginregistration::registration_client::RegistrationClient;
use plugin_agent_tests::{EVENT_TIMEOUT, PluginDir, plugin};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use tonic::transport::Channel;

/// A registration client on `socket`, as the agent or kubelet dials it.
async fn client(socket: &Path) -> RegistrationClient<Channel> {
    let channel = plugin_agent::unix_channel::connect(socket.to_path_buf())
        .await
        .expect("connects to the plugin");
    RegistrationClient::new(channel)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashes_on_the_call_it_is_told_to_and_leaves_its_socket_behind() {
    let dir = PluginDir::new();
    let socket = dir.path("crash.sock");
    let plugin = plugin!(&socket)
        .arg("--crash-on")
        .arg("get-info")
        .start_listening()
        .await;
    let answer = client(&socket).await.get_info(InfoRequest {}).await;
    assert!(answer.is_err(), "a crashed plugin answered: {answer:?}");
    plugin.wait_for_event("get_info", EVENT_TIMEOUT).await;
    assert!(
        socket.exists(),
        "a crash runs no clean-up: the socket stays"
    );
    let status = plugin.stop().await.expect("exit status");
    assert_eq!(status.signal(), Some(libc::SIGABRT), "{status:?}");
}
