//! `plugin-agent explain <target>`: why a plugin is or is not registered. The verdict first (the
//! reason `list` shows), then the timeline the agent observed for its socket, then each check
//! with its result and, for a failure, the fix; `-o json|yaml` prints the same as data.

use super::output::Output;
use super::render::print_structured;
use crate::admin;
use anyhow::Context;
use plugin_agent_proto::pluginagent::v1 as api;
use std::path::Path;
use std::time::{Duration, UNIX_EPOCH};

/// One explained socket as `explain` prints it.
#[derive(Debug, serde::Serialize)]
struct Explained {
    socket_path: String,
    reason: String,
    verdict: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    detail: String,
    /// The agent knows the socket (else only the file's checks applied).
    known: bool,
    #[serde(skip_serializing_if = "String::is_empty")]
    state: String,
    #[serde(rename = "type", skip_serializing_if = "String::is_empty")]
    plugin_type: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    name: String,
    timeline: Vec<Moment>,
    checks: Vec<Checked>,
}

#[derive(Debug, serde::Serialize)]
struct Moment {
    #[serde(skip_serializing_if = "Option::is_none")]
    at: Option<String>,
    what: String,
}

#[derive(Debug, serde::Serialize)]
struct Checked {
    name: String,
    result: String,
    detail: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    fix: String,
}

impl From<api::Explanation> for Explained {
    fn from(e: api::Explanation) -> Self {
        let entry = e.entry.unwrap_or_default();
        let plugin = entry.plugin.unwrap_or_default();
        let state =
            api::PluginState::try_from(entry.state).unwrap_or(api::PluginState::Unspecified);
        Explained {
            socket_path: e.socket_path,
            reason: e.reason,
            verdict: e.verdict,
            detail: e.detail,
            known: e.known,
            state: match state {
                api::PluginState::Unspecified => String::new(),
                state => state
                    .as_str_name()
                    .trim_start_matches("PLUGIN_STATE_")
                    .to_lowercase(),
            },
            plugin_type: plugin.r#type,
            name: plugin.name,
            timeline: e
                .timeline
                .into_iter()
                .map(|t| Moment {
                    at: (t.at_unix_nanos > 0).then(|| {
                        let at = UNIX_EPOCH + Duration::from_nanos(t.at_unix_nanos as u64);
                        humantime::format_rfc3339_millis(at).to_string()
                    }),
                    what: t.what,
                })
                .collect(),
            checks: e
                .checks
                .into_iter()
                .map(|c| Checked {
                    name: c.name,
                    result: c.result,
                    detail: c.detail,
                    fix: c.fix,
                })
                .collect(),
        }
    }
}

pub(super) async fn explain(socket: &Path, target: &str, output: Output) -> anyhow::Result<()> {
    // A relative path is the caller's: made absolute here, where its working directory is.
    let target = if target.contains('/') && !target.starts_with('/') {
        std::env::current_dir()
            .context("the current directory, for a relative path")?
            .join(target)
            .display()
            .to_string()
    } else {
        target.to_string()
    };
    let mut client = admin::client::connect(socket).await?;
    let answer = client
        .explain(api::ExplainRequest { target })
        .await
        .context("Explain")?
        .into_inner();
    let explained: Vec<Explained> = answer
        .explanations
        .into_iter()
        .map(Explained::from)
        .collect();
    if output != Output::Table {
        return print_structured(&explained, output);
    }
    for (i, e) in explained.iter().enumerate() {
        if i > 0 {
            out!("");
        }
        print_one(e);
    }
    Ok(())
}

fn print_one(e: &Explained) {
    let text = |s: &str| crate::text::escape(s).into_owned();
    out!(
        "{}",
        text(if e.socket_path.is_empty() {
            "(no socket)"
        } else {
            &e.socket_path
        })
    );
    if e.verdict == e.reason {
        out!("  verdict:  {}", text(&e.verdict));
    } else {
        out!("  verdict:  {} ({})", text(&e.verdict), e.reason);
    }
    if !e.detail.is_empty() {
        out!("            {}", text(&e.detail));
    }
    if !e.name.is_empty() {
        out!(
            "  plugin:   {} {} ({})",
            text(&e.plugin_type),
            text(&e.name),
            e.state
        );
    }
    if !e.timeline.is_empty() {
        out!("  timeline:");
        for t in &e.timeline {
            let at = t.at.as_deref().unwrap_or("-");
            out!("    {at:<24}  {}", text(&t.what));
        }
    }
    if e.checks.is_empty() {
        return;
    }
    out!("  checks:");
    let width = e.checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
    for c in &e.checks {
        let result = match c.result.as_str() {
            "fail" => "FAIL".to_string(),
            other => other.to_string(),
        };
        out!("    {result:<7}  {:<width$}  {}", c.name, text(&c.detail));
        if !c.fix.is_empty() {
            out!("    {:<7}  {:<width$}  fix: {}", "", "", text(&c.fix));
        }
    }
}
