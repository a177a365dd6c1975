//! Connecting to a running agent's admin API, for the CLI's operator commands.

use anyhow::Context;
use plugin_agent_proto::pluginagent::v1::agent_client::AgentClient;
use std::path::Path;
use tonic::transport::{Channel, Endpoint};

/// Connects to the admin socket; the error says what to check.
pub async fn connect(socket: &Path) -> anyhow::Result<AgentClient<Channel>> {
    let path = socket.to_path_buf();
    // The URI is required but unused: the connector dials the socket.
    let channel = Endpoint::from_static("http://agent.invalid")
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move { tokio::net::UnixStream::connect(path).await.map(hyper_util::rt::TokioIo::new) }
        }))
        .await
        .with_context(|| {
            format!(
                "cannot reach the plugin-agent admin API at {} (is the agent running? are you root?)",
                socket.display()
            )
        })?;
    Ok(AgentClient::new(channel).max_decoding_message_size(16 * 1024 * 1024))
}
