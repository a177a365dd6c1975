//! `plugin-agent list`: every socket the agent knows, with its state, as a table, JSON or YAML.

use super::Output;
use super::render::{print_structured, print_table, timestamp};
use crate::admin;
use plugin_agent_proto::pluginagent::v1 as api;

/// A plugin socket as `list` prints it.
#[derive(Debug, serde::Serialize)]
struct PluginRow {
    socket_path: String,
    state: String,
    #[serde(rename = "type")]
    plugin_type: String,
    name: String,
    endpoint: String,
    supported_versions: Vec<String>,
    socket_dev: u64,
    socket_ino: u64,
    registered_at: Option<String>,
    last_error: Option<String>,
    next_retry: Option<String>,
    failures: u32,
}

impl From<api::PluginEntry> for PluginRow {
    fn from(e: api::PluginEntry) -> Self {
        let plugin = e.plugin.unwrap_or_default();
        let state = api::PluginState::try_from(e.state).unwrap_or(api::PluginState::Unspecified);
        PluginRow {
            socket_path: e.socket_path,
            state: state
                .as_str_name()
                .trim_start_matches("PLUGIN_STATE_")
                .to_lowercase(),
            plugin_type: plugin.r#type,
            name: plugin.name,
            endpoint: plugin.endpoint,
            supported_versions: plugin.supported_versions,
            socket_dev: e.socket_dev,
            socket_ino: e.socket_ino,
            registered_at: (e.registered_unix_ms > 0).then(|| timestamp(e.registered_unix_ms)),
            last_error: (!e.last_error.is_empty()).then_some(e.last_error),
            next_retry: (e.next_retry_unix_ms > 0).then(|| timestamp(e.next_retry_unix_ms)),
            failures: e.failures,
        }
    }
}

pub(super) async fn list(socket: &std::path::Path, output: Output) -> anyhow::Result<()> {
    let mut client = admin::client::connect(socket).await?;
    let rows: Vec<PluginRow> = client
        .list_plugins(api::ListPluginsRequest {})
        .await?
        .into_inner()
        .plugins
        .into_iter()
        .map(PluginRow::from)
        .collect();
    if output != Output::Table {
        return print_structured(&rows, output);
    }
    let table: Vec<[String; 6]> = rows
        .iter()
        .map(|r| {
            let note = match (&r.last_error, &r.next_retry) {
                (Some(e), Some(at)) => format!("retry {at}: {e}"),
                (Some(e), None) => e.clone(),
                _ => r
                    .registered_at
                    .clone()
                    .map(|at| format!("since {at}"))
                    .unwrap_or_default(),
            };
            [
                r.socket_path.clone(),
                r.state.clone(),
                r.plugin_type.clone(),
                r.name.clone(),
                r.supported_versions.join(","),
                note,
            ]
        })
        .collect();
    print_table(
        &["SOCKET", "STATE", "TYPE", "NAME", "VERSIONS", "NOTE"],
        &table,
    );
    Ok(())
}
