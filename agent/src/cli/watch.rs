//! `plugin-agent watch`: the agent's events as they happen, one line (or JSON object) each.

use super::output::Output;
use super::render::{ContactRow, ProvenanceRow, ServingRow};
use crate::admin;
use plugin_agent_proto::pluginagent::v1 as api;
use std::time::{Duration, UNIX_EPOCH};

/// An event as `watch` prints it.
#[derive(Debug, serde::Serialize)]
struct EventRow {
    time: String,
    kind: String,
    socket_path: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    plugin: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    latency_us: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    provenance: Option<ProvenanceRow>,
    #[serde(skip_serializing_if = "Option::is_none")]
    contact: Option<ContactRow>,
    #[serde(skip_serializing_if = "Option::is_none")]
    walk: Option<WalkRow>,
    /// The socket's reason (`explain`'s verdict) when the event was published.
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    serving: Option<ServingRow>,
    #[serde(skip_serializing_if = "Option::is_none")]
    policy_reload: Option<PolicyReloadRow>,
}

/// A policy reload, as `watch` prints it (the wire's `PolicyReload`).
#[derive(Debug, serde::Serialize)]
struct PolicyReloadRow {
    trigger: String,
    rules: u32,
    refused: u32,
    retried: u32,
}

impl From<api::PolicyReload> for PolicyReloadRow {
    fn from(reload: api::PolicyReload) -> Self {
        PolicyReloadRow {
            trigger: reload.trigger,
            rules: reload.rules,
            refused: reload.refused,
            retried: reload.retried,
        }
    }
}

/// A finished walk, as `watch` prints it (the wire's `Walk`).
#[derive(Debug, serde::Serialize)]
struct WalkRow {
    reason: String,
    directories: u64,
    sockets: u64,
    removed: u64,
    kept_unread: u64,
}

impl From<api::Walk> for WalkRow {
    fn from(walk: api::Walk) -> Self {
        WalkRow {
            reason: walk.reason,
            directories: walk.directories,
            sockets: walk.sockets,
            removed: walk.removed,
            kept_unread: walk.kept_unread,
        }
    }
}

impl From<api::AgentEvent> for EventRow {
    fn from(event: api::AgentEvent) -> Self {
        let kind = api::EventKind::try_from(event.kind).unwrap_or(api::EventKind::Unspecified);
        EventRow {
            time: humantime::format_rfc3339_micros(
                UNIX_EPOCH + Duration::from_nanos(event.time_unix_nanos.max(0) as u64),
            )
            .to_string(),
            kind: kind
                .as_str_name()
                .trim_start_matches("EVENT_KIND_")
                .to_lowercase(),
            socket_path: event.socket_path,
            plugin: event.plugin.map(|p| format!("{}/{}", p.r#type, p.name)),
            error: (!event.error.is_empty()).then_some(event.error),
            latency_us: (event.latency_us > 0).then_some(event.latency_us),
            detail: (!event.detail.is_empty()).then_some(event.detail),
            provenance: event.provenance.map(ProvenanceRow::from),
            contact: event.contact.map(ContactRow::from),
            walk: event.walk.map(WalkRow::from),
            reason: (!event.reason.is_empty()).then_some(event.reason),
            serving: event.serving.map(ServingRow::from),
            policy_reload: event.policy_reload.map(PolicyReloadRow::from),
        }
    }
}

pub(super) async fn watch(socket: &std::path::Path, output: Output) -> anyhow::Result<()> {
    let mut client = admin::client::connect(socket).await?;
    let mut stream = client
        .watch_events(api::WatchEventsRequest {})
        .await?
        .into_inner();
    // The agent subscribed before it answered: from here no event is missed. Said on stderr so
    // scripts (and tests) can start acting once the stream is live, without polluting stdout.
    eprintln!("watching events of {}", socket.display());
    while let Some(event) = stream.message().await? {
        let row = EventRow::from(event);
        match output {
            Output::Json => out!("{}", serde_json::to_string(&row)?),
            Output::Yaml => out_raw!("---\n{}", serde_norway::to_string(&row)?),
            Output::Table => {
                let mut line = format!("{} {:<20} {}", row.time, row.kind, row.socket_path);
                if let Some(p) = &row.plugin {
                    line += &format!(" plugin={p}");
                }
                if let Some(p) = &row.provenance {
                    line += &format!(
                        " server={:?} creator={:?}",
                        p.server_summary(),
                        p.creator_summary()
                    );
                }
                if let Some(c) = &row.contact {
                    line += &format!(" by={:?}", c.summary());
                }
                if let Some(w) = &row.walk {
                    line += &format!(
                        " reason={:?} directories={} sockets={} removed={} kept_unread={}",
                        w.reason, w.directories, w.sockets, w.removed, w.kept_unread
                    );
                }
                if let Some(s) = &row.serving {
                    line += &format!(" learned_by={} pids={:?}", s.learned_by, s.pids);
                }
                if let Some(r) = &row.policy_reload {
                    line += &format!(
                        " trigger={} rules={} refused={} retried={}",
                        r.trigger, r.rules, r.refused, r.retried
                    );
                }
                if let Some(l) = row.latency_us {
                    line += &format!(" latency={:.3}ms", l as f64 / 1000.0);
                }
                if let Some(e) = &row.error {
                    line += &format!(" error={e:?}");
                }
                if let Some(r) = &row.reason {
                    line += &format!(" reason={r}");
                }
                if let Some(d) = &row.detail {
                    line += &format!(" ({d})");
                }
                out!("{}", crate::text::escape(&line));
            }
        }
    }
    Ok(())
}
