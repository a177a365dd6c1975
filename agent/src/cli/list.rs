//! `plugin-agent list`: every socket the agent knows, with its state, as a table, JSON or YAML.

use super::output::Output;
use super::render::{
    ContactRow, ProvenanceRow, ServingRow, print_structured, print_table, timestamp,
};
use crate::admin;
use plugin_agent_proto::pluginagent::v1 as api;

/// A plugin socket as `list` prints it.
#[derive(Debug, serde::Serialize)]
struct PluginRow {
    socket_path: String,
    state: String,
    /// Why it is in that state (`plugin-agent explain`'s verdict).
    reason: String,
    #[serde(rename = "type")]
    plugin_type: String,
    name: String,
    endpoint: String,
    supported_versions: Vec<String>,
    socket_dev: u64,
    socket_ino: u64,
    /// The registration's identity (a UUID per registration), while registered.
    #[serde(skip_serializing_if = "Option::is_none")]
    generation: Option<String>,
    registered_at: Option<String>,
    last_error: Option<String>,
    next_retry: Option<String>,
    failures: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    provenance: Option<ProvenanceRow>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rejected_by_rule: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    first_contact: Option<ContactRow>,
    #[serde(skip_serializing_if = "Option::is_none")]
    first_contact_unknown: Option<String>,
    /// Registered: how the agent knows something serves it, whose exits it waits for.
    #[serde(skip_serializing_if = "Option::is_none")]
    serving: Option<ServingRow>,
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
            reason: e.reason,
            plugin_type: plugin.r#type,
            name: plugin.name,
            endpoint: plugin.endpoint,
            supported_versions: plugin.supported_versions,
            socket_dev: e.socket_dev,
            socket_ino: e.socket_ino,
            generation: (!e.generation.is_empty()).then_some(e.generation),
            registered_at: (e.registered_unix_ms > 0).then(|| timestamp(e.registered_unix_ms)),
            last_error: (!e.last_error.is_empty()).then_some(e.last_error),
            next_retry: (e.next_retry_unix_ms > 0).then(|| timestamp(e.next_retry_unix_ms)),
            failures: e.failures,
            provenance: e.provenance.map(ProvenanceRow::from),
            rejected_by_rule: (!e.rejected_by_rule.is_empty()).then_some(e.rejected_by_rule),
            first_contact: e.first_contact.map(ContactRow::from),
            first_contact_unknown: (!e.first_contact_unknown.is_empty())
                .then_some(e.first_contact_unknown),
            serving: e.serving.map(ServingRow::from),
        }
    }
}

pub(super) async fn list(
    socket: &std::path::Path,
    output: Output,
    wide: bool,
) -> anyhow::Result<()> {
    let mut client = admin::client::connect(socket).await?;
    let rows: Vec<PluginRow> = admin::client::list_all(&mut client)
        .await?
        .into_iter()
        .map(PluginRow::from)
        .collect();
    if output != Output::Table {
        return print_structured(&rows, output);
    }
    if wide {
        let table: Vec<[String; 10]> = rows.iter().map(wide_row).collect();
        print_table(
            &[
                "SOCKET",
                "STATE",
                "REASON",
                "TYPE",
                "NAME",
                "SERVER",
                "CREATOR",
                "FIRST CONTACT",
                "WHERE",
                "NOTE",
            ],
            &table,
        );
    } else {
        let table: Vec<[String; 6]> = rows
            .iter()
            .map(|r| {
                [
                    r.socket_path.clone(),
                    r.state.clone(),
                    r.plugin_type.clone(),
                    r.name.clone(),
                    r.supported_versions.join(","),
                    note(r),
                ]
            })
            .collect();
        print_table(
            &["SOCKET", "STATE", "TYPE", "NAME", "VERSIONS", "NOTE"],
            &table,
        );
    }
    Ok(())
}

/// The last error (and when it is retried), else since when it is registered.
fn note(r: &PluginRow) -> String {
    match (&r.last_error, &r.next_retry) {
        (Some(e), Some(at)) => format!("retry {at}: {e}"),
        (Some(e), None) => e.clone(),
        _ => r
            .registered_at
            .clone()
            .map(|at| format!("since {at}"))
            .unwrap_or_default(),
    }
}

/// `--wide`: why it is in its state (`explain`'s verdict), who serves and who created each socket, who first contacted it, and where the
/// server runs (its pod and container, else its cgroup).
fn wide_row(r: &PluginRow) -> [String; 10] {
    let (server, creator, place) = match &r.provenance {
        Some(p) => (
            p.server_summary(),
            p.creator_summary(),
            p.server.as_ref().map(|s| s.place()).unwrap_or_default(),
        ),
        None => ("-".into(), "unknown".into(), String::new()),
    };
    [
        r.socket_path.clone(),
        r.state.clone(),
        r.reason.clone(),
        r.plugin_type.clone(),
        r.name.clone(),
        server,
        creator,
        r.first_contact
            .as_ref()
            .map_or_else(|| "-".into(), ContactRow::summary),
        place,
        note(r),
    ]
}
