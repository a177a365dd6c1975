//! `Explain`: why a plugin is or is not registered. The verdict is the state's
//! ([`crate::state::verdict`], the reason `list` shows); this puts beside it the timeline the agent
//! observed for the socket (from what it keeps: provenance, first contact, the registration, the
//! backoff and its last error, the policy's refusal, the unserved mark) and the checks, each
//! passed or failed with the fix. A target is resolved by lookups (a path, the index of plugin
//! names), never a pass over every plugin's entry, so an answer on a node of 10,000 plugins costs
//! what one plugin's does (the file-name fallback compares paths only).

use super::checks::{self, check, file_checks};
use super::convert::{to_api_entry, unix_nanos};
use crate::provenance::Creator;
use crate::state::backoff::FailureKind;
use crate::state::verdict::{self, Circumstances, Duplicate, Reason};
use crate::state::view::{PluginStatus, StateView};
use plugin_agent_proto::pluginagent::v1 as api;
use std::path::{Path, PathBuf};
use std::time::SystemTime;
use tokio::time::Instant;

/// At most this many sockets are explained for one name (a driver name carried by every
/// socket of a tree would otherwise make one answer of the whole tree).
const MAX_SOCKETS: usize = 16;

/// The explanations of `target` (see the module docs).
pub async fn explain(state: &StateView, plugin_dir: &Path, target: &str) -> api::ExplainResponse {
    // The verdicts below read the node's kubelets as they are now.
    state.circumstances.kubelets(true);
    let paths = resolve(state, target);
    let mut explanations = Vec::with_capacity(paths.len());
    for path in &paths {
        explanations.push(explain_path(state, plugin_dir, path).await);
    }
    if explanations.is_empty() {
        explanations.push(api::Explanation {
            reason: Reason::NotFound.label().into(),
            verdict: Reason::NotFound.verdict().into(),
            detail: format!(
                "no socket the agent knows has the path, the plugin name or the file name {target:?}"
            ),
            ..api::Explanation::default()
        });
    }
    api::ExplainResponse { explanations }
}

/// The sockets `target` names: a path (given with a `/`), else those registered under the
/// plugin name, else those that failed under it (refused, or after a valid GetInfo), else desired
/// sockets of that file name.
fn resolve(state: &StateView, target: &str) -> Vec<PathBuf> {
    if target.contains('/') {
        return vec![PathBuf::from(target)];
    }
    let mut paths: Vec<PathBuf> = state
        .actual
        .named(target)
        .into_iter()
        .map(|(path, _)| path)
        .collect();
    if paths.is_empty() {
        paths = state.backoff.named(target);
    }
    if paths.is_empty() {
        let name = std::ffi::OsStr::new(target);
        paths = state
            .desired
            .paths_where(|p| p.file_name() == Some(name))
            .into_iter()
            .collect();
    }
    paths.sort();
    paths.truncate(MAX_SOCKETS);
    paths
}

async fn explain_path(state: &StateView, plugin_dir: &Path, path: &Path) -> api::Explanation {
    let status = state.status(path, Instant::now());
    let known = status.desired.is_some() || status.registered.is_some();
    let files = file_checks(path, plugin_dir).await;
    let circumstances = &state.circumstances;
    let mut checks = files.checks;
    let kubelets = circumstances.kubelets(false);
    checks.push(checks::kubelet_dir(path, &kubelets, circumstances.observe));
    if !known {
        let reason = verdict::unseen(files.found);
        return api::Explanation {
            socket_path: path.display().to_string(),
            reason: reason.label().into(),
            verdict: reason.verdict().into(),
            detail: "the agent has not seen this socket: only the checks of the file apply".into(),
            checks,
            ..api::Explanation::default()
        };
    }
    let duplicates = state.duplicates(&status);
    checks.extend(plugin_checks(&status, circumstances, &duplicates));
    let mut entry = to_api_entry(&status);
    entry.reason = status.reason.label().into();
    api::Explanation {
        socket_path: path.display().to_string(),
        reason: status.reason.label().into(),
        verdict: status.reason.verdict().into(),
        detail: detail(&status, &duplicates),
        known,
        entry: Some(entry),
        timeline: timeline(&status),
        checks,
    }
}

/// What is specific to this socket's verdict.
fn detail(status: &PluginStatus, duplicates: &[Duplicate]) -> String {
    let backoff = status.backoff.as_ref();
    match status.reason {
        Reason::InvalidInfo => status
            .registered
            .as_ref()
            .and_then(|r| verdict::kubelet_refusal(&r.plugin))
            .or_else(|| backoff.map(|b| b.last_error.to_string()))
            .unwrap_or_default(),
        Reason::DuplicateDriver => duplicates
            .iter()
            .filter(|d| d.newer)
            .map(|d| format!("{} is newer: kubelet 1.33+ uses it", d.path.display()))
            .collect::<Vec<_>>()
            .join("; "),
        _ => backoff
            .map(|b| b.last_error.to_string())
            .unwrap_or_default(),
    }
}

/// The checks of what the agent knows of the plugin: its GetInfo answer, other sockets with its
/// name, the policy, kubelet's contact, its registration.
fn plugin_checks(
    status: &PluginStatus,
    circumstances: &Circumstances,
    duplicates: &[Duplicate],
) -> Vec<api::Check> {
    let mut checks = vec![get_info_check(status), unique_check(duplicates)];
    let refusal = status.backoff.as_ref().and_then(|b| match &b.kind {
        FailureKind::Rejected { refusal, .. } => Some(refusal.clone()),
        _ => None,
    });
    checks.push(match refusal {
        Some(refusal) => check(
            "policy",
            "fail",
            format!("rule {:?}: {}", refusal.rule, refusal.reason),
            "change the rule or what the plugin runs as, then `plugin-agent policy reload` (or SIGHUP)",
        ),
        None => check("policy", "pass", "no rule refuses it", ""),
    });
    checks.extend(contact_checks(status, circumstances));
    checks.push(match &status.backoff {
        Some(b) if !b.kind.is_waiting() && !b.kind.is_held() => check(
            "registration",
            "fail",
            format!("{} (failures in a row: {})", b.last_error, b.failures),
            "see the error: the agent retries with backoff (500 ms doubling to 2 m 2 s) and at once when the socket is bound again",
        ),
        _ => check("registration", "pass", "no failed attempt on this socket", ""),
    });
    checks
}

/// Whether kubelet would take the plugin's GetInfo answer, and its endpoint exists.
fn get_info_check(status: &PluginStatus) -> api::Check {
    let plugin = status
        .registered
        .as_ref()
        .map(|r| &r.plugin)
        .or_else(|| status.backoff.as_ref().and_then(|b| b.plugin()));
    let fix = "announce a type kubelet handles (CSIPlugin, DevicePlugin, DRAPlugin), a name, a service endpoint that exists, and a version kubelet speaks (CSI 1.x, device plugins v1beta1, DRA v1beta1.DRAPlugin or v1.DRAPlugin)";
    let Some(plugin) = plugin.filter(|p| !p.plugin_type.is_empty()) else {
        let why = match status.backoff.as_ref().map(|b| &b.kind) {
            Some(FailureKind::InvalidInfo) => {
                let error = status.backoff.as_ref().map(|b| b.last_error.to_string());
                return check("get_info_valid", "fail", error.unwrap_or_default(), fix);
            }
            _ => "no GetInfo answer is known (not asked yet, or observe mode without contact)",
        };
        return check("get_info_valid", "unknown", why, "");
    };
    let said = format!(
        "type {}, name {:?}, endpoint {}, versions {:?}",
        plugin.plugin_type, plugin.name, plugin.endpoint, plugin.supported_versions
    );
    let endpoint = Path::new(&plugin.endpoint);
    let endpoint_missing = endpoint.is_absolute()
        && !std::fs::symlink_metadata(endpoint).is_ok_and(|m| {
            use std::os::unix::fs::FileTypeExt;
            m.file_type().is_socket()
        });
    match verdict::kubelet_refusal(plugin) {
        Some(refusal) => check("get_info_valid", "fail", format!("{said}: {refusal}"), fix),
        None if endpoint_missing => check(
            "get_info_valid",
            "fail",
            format!("{said}: the endpoint is not a socket that exists"),
            fix,
        ),
        None => check("get_info_valid", "pass", said, ""),
    }
}

/// Whether another socket announces the same type and name, and which is newer.
fn unique_check(duplicates: &[Duplicate]) -> api::Check {
    if duplicates.is_empty() {
        return check(
            "unique_driver",
            "pass",
            "no other socket announces its name",
            "",
        );
    }
    let said: Vec<String> = duplicates
        .iter()
        .map(|d| {
            format!(
                "{} (registered {}) is {}",
                d.path.display(),
                rfc3339(d.registered_at),
                if d.newer { "newer" } else { "older" }
            )
        })
        .collect();
    let newer = duplicates.iter().any(|d| d.newer);
    check(
        "unique_driver",
        if newer { "fail" } else { "pass" },
        format!(
            "{}; kubelet 1.33+ keeps every socket of a name registered and uses the newest (a DRA rolling update; a device plugin's newer endpoint replaces the older)",
            said.join("; ")
        ),
        "if the older plugin's pod is gone, remove its stale socket; else this is a rolling update in progress and ends when the old instance exits",
    )
}

/// Observe mode: kubelet's first contact, and whether the plugin stopped serving right after.
fn contact_checks(status: &PluginStatus, circumstances: &Circumstances) -> Vec<api::Check> {
    if !circumstances.observe {
        return vec![check(
            "kubelet_contact",
            "skip",
            "register mode: the agent, not kubelet, registers plugins",
            "",
        )];
    }
    let desired = status.desired.as_ref();
    let contact = desired.and_then(|d| d.first_contact.as_ref());
    let first = match (contact, circumstances.sees_contacts) {
        (Some(c), _) => check(
            "kubelet_contact",
            "pass",
            format!(
                "pid {} ({}) connected at {}",
                c.by.pid,
                c.by.comm.map(|c| c.as_string()).unwrap_or_default(),
                rfc3339(c.at)
            ),
            "",
        ),
        (None, false) => check(
            "kubelet_contact",
            "unknown",
            "cannot tell: only the eBPF source sees connections",
            "",
        ),
        (None, true) if status.reason == Reason::KubeletNeverConnected => check(
            "kubelet_contact",
            "fail",
            "no process but the agent connected since the socket was created",
            "kubelet's plugin watcher did not see the socket: is it under the directory kubelet watches (kubelet_dir), and does kubelet run? (its reconciler dials new sockets within a second)",
        ),
        (None, true) => check(
            "kubelet_contact",
            "unknown",
            "no contact seen yet (or the socket is older than the agent)",
            "",
        ),
    };
    let mut checks = vec![first];
    if status.reason == Reason::StoppedAfterKubeletContact {
        checks.push(check(
            "served_after_kubelet_contact",
            "fail",
            format!(
                "it stopped serving within {:?} of kubelet's first contact{}",
                verdict::STOPPED_AFTER_CONTACT,
                exited(status)
            ),
            "kubelet most likely answered Notify(false) (node-driver-registrar exits on it): look for `RegisterPlugin error` in kubelet's log (journalctl -u kubelet | grep 'RegisterPlugin error') for the reason kubelet refused it",
        ));
    }
    checks
}

/// Whether the socket's creator or server process still runs.
fn exited(status: &PluginStatus) -> String {
    let provenance = status.provenance();
    let pid = provenance
        .as_ref()
        .and_then(|p| p.server.as_ref().and_then(|s| s.pid).or(p.creator.pid()));
    match pid {
        Some(pid) if runs(pid) => format!("; its process {pid} still runs"),
        Some(pid) => format!("; its process {pid} has exited"),
        None => String::new(),
    }
}

/// Whether process `pid` runs: it is in `/proc` and not a zombie waiting for its parent.
fn runs(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // `pid (comm) S ...`: the state follows the command, which may hold spaces and parentheses.
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.trim_start().chars().next());
    !matches!(state, Some('Z' | 'X') | None)
}

/// What the agent observed of the socket, oldest first.
fn timeline(status: &PluginStatus) -> Vec<api::TimelineEntry> {
    let mut entries: Vec<(SystemTime, String)> = Vec::new();
    if let Some(desired) = &status.desired {
        let created = desired.socket.born().unwrap_or(desired.seen_at);
        entries.push((created, format!("created by {}", creator(&desired.creator))));
        let how = if desired.by_event {
            "an event"
        } else {
            "a walk"
        };
        entries.push((
            desired.seen_at,
            format!("discovered by the agent through {how}"),
        ));
        if let Some(contact) = &desired.first_contact {
            let command = contact.by.comm.map(|c| c.as_string()).unwrap_or_default();
            entries.push((
                contact.at,
                format!(
                    "first contact by pid {} ({command}): kubelet, beside the agent",
                    contact.by.pid
                ),
            ));
        }
        if let Some(listening) = &desired.listening {
            let how = listening.seen_by.describe();
            entries.push((listening.at, format!("listening (seen by {how})")));
        }
    }
    if let Some(registered) = &status.registered {
        let plugin = &registered.plugin;
        let server = registered.provenance.server.as_deref();
        entries.push((
            registered.registered_at,
            format!(
                "GetInfo answered {}; {} (served by {})",
                said(plugin),
                if registered.handler.is_some() {
                    "handler registered it, Notify(true)"
                } else {
                    "observed: no Notify"
                },
                server.map_or_else(|| "unknown".into(), ToString::to_string)
            ),
        ));
    }
    if let Some(backoff) = &status.backoff {
        if let (None, Some(answered)) = (&status.registered, &backoff.answered) {
            entries.push((
                answered.at,
                format!("GetInfo answered {}", said(&answered.plugin)),
            ));
        }
        entries.push(backoff_entry(backoff));
    }
    entries.sort_by_key(|(at, _)| *at);
    entries
        .into_iter()
        .map(|(at, what)| api::TimelineEntry {
            at_unix_nanos: unix_nanos(at),
            what,
        })
        .collect()
}

/// The backoff entry's moment in the timeline.
fn backoff_entry(backoff: &crate::state::backoff::Backoff) -> (SystemTime, String) {
    let now = (SystemTime::now(), Instant::now());
    let wall = |at: Instant| now.0 - now.1.saturating_duration_since(at);
    match &backoff.kind {
        FailureKind::Unserved { learned_by, since } => (
            wall(*since),
            format!(
                "nothing serves it (learned by {learned_by}): {}",
                backoff.last_error
            ),
        ),
        FailureKind::Rejected { refusal, .. } => (
            now.0,
            format!(
                "refused by policy rule {:?}: {}; told Notify(false)",
                refusal.rule, refusal.reason
            ),
        ),
        _ => (
            wall(
                backoff
                    .retry_at
                    .checked_sub(backoff.delay)
                    .unwrap_or(backoff.retry_at),
            ),
            format!(
                "attempt {} failed: {}",
                backoff.failures, backoff.last_error
            ),
        ),
    }
}

/// What a plugin's GetInfo answer said.
fn said(plugin: &crate::handler::Plugin) -> String {
    format!(
        "type {} name {:?} endpoint {} versions {:?}",
        plugin.plugin_type, plugin.name, plugin.endpoint, plugin.supported_versions
    )
}

fn creator(creator: &Creator) -> String {
    match creator {
        Creator::Known(process) => process.to_string(),
        Creator::Recorded(actor) => format!(
            "pid {} ({})",
            actor.pid,
            actor.comm.map(|c| c.as_string()).unwrap_or_default()
        ),
        other => format!("unknown: {}", other.unknown_because().unwrap_or_default()),
    }
}

fn rfc3339(at: SystemTime) -> String {
    humantime::format_rfc3339_millis(at).to_string()
}
