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

/// Every socket the agent knows, page by page (see `ListPlugins`).
pub async fn list_all(
    client: &mut AgentClient<Channel>,
) -> anyhow::Result<Vec<plugin_agent_proto::pluginagent::v1::PluginEntry>> {
    use plugin_agent_proto::pluginagent::v1::ListPluginsRequest;
    let mut all = Vec::new();
    let mut page_token = Vec::new();
    loop {
        let page = client
            .list_plugins(ListPluginsRequest {
                page_size: 0,
                page_token,
            })
            .await
            .context("ListPlugins")?
            .into_inner();
        all.extend(page.plugins);
        if page.next_page_token.is_empty() {
            return Ok(all);
        }
        page_token = page.next_page_token;
    }
}
