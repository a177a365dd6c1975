//! Output helpers shared by the admin subcommands: structured output (JSON, YAML), aligned
//! tables, and timestamps.

use super::output::Output;
use plugin_agent_proto::pluginagent::v1 as api;
use std::time::{Duration, UNIX_EPOCH};

pub(super) fn timestamp(unix_ms: i64) -> String {
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(unix_ms.max(0) as u64))
        .to_string()
}

pub(super) fn print_structured<T: serde::Serialize>(
    value: &T,
    output: Output,
) -> anyhow::Result<()> {
    match output {
        Output::Json => out!("{}", serde_json::to_string_pretty(value)?),
        Output::Yaml => out_raw!("{}", serde_norway::to_string(value)?),
        Output::Table => unreachable!("tables are printed by each command"),
    }
    Ok(())
}

pub(super) fn print_table<const N: usize>(header: &[&str; N], rows: &[[String; N]]) {
    // Cells hold what plugins announce: no control character reaches the terminal.
    let rows: Vec<[String; N]> = rows
        .iter()
        .map(|row| {
            row.clone()
                .map(|cell| crate::text::escape(&cell).into_owned())
        })
        .collect();
    let rows = rows.as_slice();
    let mut widths: [usize; N] = header.map(str::len);
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out!("{}", padded.join("  ").trim_end());
    };
    line(header.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}

/// How the agent knows something serves a socket, as `list` and `watch` print it.
#[derive(Debug, Clone, serde::Serialize)]
pub(super) struct ServingRow {
    pub learned_by: String,
    pub pids: Vec<u32>,
}

impl From<api::Serving> for ServingRow {
    fn from(serving: api::Serving) -> Self {
        ServingRow {
            learned_by: serving.learned_by,
            pids: serving.pids,
        }
    }
}

/// A socket's provenance as `list` and `watch` print it (JSON and YAML keep every field).
#[derive(Debug, Clone, serde::Serialize)]
pub(super) struct ProvenanceRow {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub creator: Option<ProcessRow>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub creator_unknown: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server: Option<ProcessRow>,
    pub creator_is_not_server: bool,
}

/// A process as `list` and `watch` print it.
#[derive(Debug, Clone, serde::Serialize)]
pub(super) struct ProcessRow {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_id: Option<String>,
}

fn some(text: String) -> Option<String> {
    (!text.is_empty()).then_some(text)
}

impl From<api::Process> for ProcessRow {
    fn from(p: api::Process) -> Self {
        ProcessRow {
            pid: (p.pid > 0).then_some(p.pid),
            uid: p.uid,
            gid: p.gid,
            command: some(p.command),
            cgroup: some(p.cgroup),
            pod_uid: some(p.pod_uid),
            container_id: some(p.container_id),
        }
    }
}

impl From<api::Provenance> for ProvenanceRow {
    fn from(p: api::Provenance) -> Self {
        ProvenanceRow {
            creator: p.creator.map(ProcessRow::from),
            creator_unknown: some(p.creator_unknown),
            server: p.server.map(ProcessRow::from),
            creator_is_not_server: p.creator_is_not_server,
        }
    }
}

impl ProcessRow {
    /// `42/driver uid=0`.
    pub fn summary(&self) -> String {
        let mut out = self.pid.map(|p| p.to_string()).unwrap_or("?".into());
        if let Some(command) = &self.command {
            out += &format!("/{command}");
        }
        if let Some(uid) = self.uid {
            out += &format!(" uid={uid}");
        }
        out
    }

    /// `pod <uid> container <12 hex>`, else the cgroup path.
    pub fn place(&self) -> String {
        match (&self.pod_uid, &self.container_id, &self.cgroup) {
            (Some(pod), Some(id), _) => format!("pod {pod} container {}", &id[..id.len().min(12)]),
            (Some(pod), None, _) => format!("pod {pod}"),
            (None, _, Some(cgroup)) => cgroup.clone(),
            _ => String::new(),
        }
    }
}

impl ProvenanceRow {
    /// The server, for a table cell.
    pub fn server_summary(&self) -> String {
        self.server
            .as_ref()
            .map_or_else(|| "-".into(), ProcessRow::summary)
    }

    /// The creator, for a table cell: `same` when it is the server.
    pub fn creator_summary(&self) -> String {
        match (&self.creator, &self.server) {
            (Some(c), Some(s)) if c.pid.is_some() && c.pid == s.pid => "same".into(),
            (Some(c), _) => c.summary(),
            (None, _) => "unknown".into(),
        }
    }
}

/// A socket's first contact as `list` and `watch` print it.
#[derive(Debug, Clone, serde::Serialize)]
pub(super) struct ContactRow {
    pub process: Option<ProcessRow>,
    pub at: String,
    /// Milliseconds from the socket's creation to the contact, when timed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub after_creation_ms: Option<f64>,
}

impl From<api::Contact> for ContactRow {
    fn from(c: api::Contact) -> Self {
        ContactRow {
            process: c.process.map(ProcessRow::from),
            at: humantime::format_rfc3339_micros(
                UNIX_EPOCH + Duration::from_nanos(c.at_unix_nanos.max(0) as u64),
            )
            .to_string(),
            after_creation_ms: (c.after_creation_us > 0)
                .then(|| c.after_creation_us as f64 / 1000.0),
        }
    }
}

impl ContactRow {
    /// `4242/kubelet uid=0 +812.4ms`, for a table cell.
    pub fn summary(&self) -> String {
        let who = self
            .process
            .as_ref()
            .map_or_else(|| "?".into(), ProcessRow::summary);
        match self.after_creation_ms {
            Some(ms) => format!("{who} +{ms:.1}ms"),
            None => format!("{who} at {}", self.at),
        }
    }
}
