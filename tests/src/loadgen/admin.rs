//! The agent's side of the story, through its admin API (`pluginagent.v1.Agent`): the
//! `WatchEvents` stream gives when each socket was registered and deregistered (deregistration
//! latency, duplicate registrations), and `ListPlugins` at the end shows what is still registered
//! (stale entries).

use crate::ledger::SharedLedger;
use crate::plugins::id_of;
use anyhow::Context;
use plugin_agent_proto::pluginagent::v1 as api;
use plugin_agent_proto::pluginagent::v1::agent_client::AgentClient;
use std::collections::HashSet;
use std::path::Path;
use tonic::transport::{Channel, Endpoint};

/// Connects to the admin socket.
pub async fn connect(socket: &Path) -> anyhow::Result<AgentClient<Channel>> {
    let path = socket.to_path_buf();
    // The URI is required by tonic but unused: the connector dials the socket.
    let channel = Endpoint::from_static("http://agent.invalid")
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                tokio::net::UnixStream::connect(path)
                    .await
                    .map(hyper_util::rt::TokioIo::new)
            }
        }))
        .await
        .with_context(|| format!("connecting to the admin API at {}", socket.display()))?;
    Ok(AgentClient::new(channel).max_decoding_message_size(64 * 1024 * 1024))
}

/// Subscribes to `WatchEvents` and records every event about our plugins into `ledger` until the
/// stream ends (the agent stopped). Returns once subscribed, so nothing after it is missed.
pub async fn follow(socket: &Path, ledger: SharedLedger) -> anyhow::Result<()> {
    let mut client = connect(socket).await?;
    let mut stream = client
        .watch_events(api::WatchEventsRequest {})
        .await
        .context("WatchEvents")?
        .into_inner();
    tokio::spawn(async move {
        while let Ok(Some(event)) = stream.message().await {
            let at_ns = u64::try_from(event.time_unix_nanos).unwrap_or(0);
            match api::EventKind::try_from(event.kind) {
                Ok(api::EventKind::Registered) => {
                    if let Some(id) = id_of(&event.socket_path) {
                        ledger.admin_registered(id, at_ns);
                    }
                }
                Ok(api::EventKind::Deregistered) => {
                    if let Some(id) = id_of(&event.socket_path) {
                        ledger.admin_deregistered(id, at_ns);
                    }
                }
                Ok(api::EventKind::Lagged) => {
                    let missed = event
                        .detail
                        .split_whitespace()
                        .next()
                        .and_then(|n| n.parse().ok())
                        .unwrap_or(1);
                    ledger.admin_lagged(missed);
                }
                _ => {}
            }
        }
    });
    Ok(())
}

/// Plugin ids the agent lists as registered (or registered and being deregistered) now.
pub async fn registered_now(socket: &Path) -> anyhow::Result<HashSet<u64>> {
    let mut client = connect(socket).await?;
    // Page by page (see `ListPlugins`).
    let mut plugins = Vec::new();
    let mut page_token = Vec::new();
    loop {
        let page = client
            .list_plugins(api::ListPluginsRequest {
                page_size: 0,
                page_token,
            })
            .await
            .context("ListPlugins")?
            .into_inner();
        plugins.extend(page.plugins);
        if page.next_page_token.is_empty() {
            break;
        }
        page_token = page.next_page_token;
    }
    Ok(plugins
        .iter()
        .filter(|p| {
            matches!(
                api::PluginState::try_from(p.state),
                Ok(api::PluginState::Registered | api::PluginState::Deregistering)
            )
        })
        .filter_map(|p| id_of(&p.socket_path))
        .collect())
}
