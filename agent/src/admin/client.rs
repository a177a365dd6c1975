//! Connecting to a running agent's admin API, for the CLI's operator commands.

use anyhow::Context;
use plugin_agent_proto::pluginagent::v1::agent_client::AgentClient;
use std::path::Path;
use tonic::transport::Channel;

/// Connects to the admin socket; the error says what to check.
pub async fn connect(socket: &Path) -> anyhow::Result<AgentClient<Channel>> {
    let channel = crate::unix_channel::connect(socket.to_path_buf())
        .await
        .with_context(|| {
            format!(
                "cannot reach the plugin-agent admin API at {} (is the agent running? are you root?)",
                socket.display()
            )
        })?;
    Ok(AgentClient::new(channel).max_decoding_message_size(16 * 1024 * 1024))
}
