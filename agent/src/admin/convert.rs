//! The conversions from the agent's state, provenance and events to the admin API's wire
//! messages: pure functions, kept apart from the service (`server.rs`) that answers with them.

use super::served::StartPhases;
use crate::event_source::SourceStart;
use crate::handler::Plugin;
use crate::notifications::{AgentEvent, EventKind, PolicyReloadReport, Serving};
use crate::persist::RestoreReport;
use crate::provenance::{Actor, Contact, Creator, Process, Provenance};
use crate::state::backoff::{Backoff, FailureKind};
use crate::state::view::{PluginState, PluginStatus};
use plugin_agent_proto::pluginagent::v1 as api;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The wire form of a socket's status.
pub(super) fn to_api_entry(status: &PluginStatus) -> api::PluginEntry {
    let state = match status.state {
        PluginState::Registered => api::PluginState::Registered,
        PluginState::Observed => api::PluginState::Observed,
        PluginState::Deregistering => api::PluginState::Deregistering,
        PluginState::BackingOff => api::PluginState::BackingOff,
        PluginState::Pending => api::PluginState::Pending,
        PluginState::Unserved => api::PluginState::Unserved,
        PluginState::Rejected => api::PluginState::Rejected,
    };
    let refusal = status.backoff.as_ref().and_then(|b| match &b.kind {
        FailureKind::Rejected { refusal, .. } => Some(refusal),
        _ => None,
    });
    let (desired, registered, backoff) = (&status.desired, &status.registered, &status.backoff);
    let socket = registered
        .as_ref()
        .map(|r| r.socket)
        .or(desired.as_ref().map(|d| d.socket));
    api::PluginEntry {
        socket_path: status.path.display().to_string(),
        socket_dev: socket.map(|s| s.dev).unwrap_or_default(),
        socket_ino: socket.map(|s| s.ino).unwrap_or_default(),
        state: state as i32,
        plugin: registered
            .as_ref()
            .map(|r| &r.plugin)
            .or(backoff.as_ref().and_then(|b| b.plugin()))
            .map(to_api),
        generation: desired
            .as_ref()
            .map(|d| d.generation.to_string())
            .unwrap_or_default(),
        discovered_unix_ms: desired
            .as_ref()
            .map(|d| unix_ms(d.seen_at))
            .unwrap_or_default(),
        registered_unix_ms: registered
            .as_ref()
            .map(|r| unix_ms(r.registered_at))
            .unwrap_or_default(),
        last_error: backoff
            .as_ref()
            .map(|b| b.last_error.to_string())
            .unwrap_or_default(),
        next_retry_unix_ms: backoff
            .as_ref()
            .filter(|_| status.state == PluginState::BackingOff)
            .map(next_retry_ms)
            .unwrap_or_default(),
        failures: backoff.as_ref().map(|b| b.failures).unwrap_or_default(),
        provenance: status.provenance().as_ref().map(provenance_to_api),
        rejected_by_rule: refusal.map(|r| r.rule.to_string()).unwrap_or_default(),
        first_contact: desired.as_ref().and_then(|d| {
            d.first_contact
                .as_ref()
                .map(|contact| contact_to_api(contact, contact.after_creation(d.kernel_ns)))
        }),
        first_contact_unknown: String::new(),
        reason: status.reason.label().into(),
        serving: None,
    }
}

/// The wire form of a first contact, `after_creation` the socket's creation when it was timed.
pub(super) fn contact_to_api(contact: &Contact, after_creation: Option<Duration>) -> api::Contact {
    api::Contact {
        process: Some(actor_to_api(&contact.by)),
        at_unix_nanos: unix_nanos(contact.at),
        after_creation_us: after_creation
            .map(|d| d.as_micros() as u64)
            .unwrap_or_default(),
    }
}

/// The wire form of a socket's provenance.
pub fn provenance_to_api(provenance: &Provenance) -> api::Provenance {
    let creator = match &provenance.creator {
        Creator::Known(process) => Some(process_to_api(process)),
        Creator::Recorded(actor) => Some(actor_to_api(actor)),
        Creator::NotReported | Creator::FoundByWalk => None,
    };
    api::Provenance {
        creator,
        creator_unknown: provenance
            .creator
            .unknown_because()
            .unwrap_or_default()
            .to_string(),
        server: provenance.server.as_deref().map(process_to_api),
        creator_is_not_server: provenance.creator_is_not_server(),
    }
}

/// A creator as the event source recorded it, before the registration completed it.
fn actor_to_api(actor: &Actor) -> api::Process {
    api::Process {
        pid: actor.pid,
        uid: actor.uid,
        gid: actor.gid,
        command: actor.comm.map(|c| c.as_string()).unwrap_or_default(),
        cgroup_id: actor.cgroup_id.unwrap_or_default(),
        ..api::Process::default()
    }
}

fn process_to_api(process: &Process) -> api::Process {
    let cgroup = process.cgroup.as_deref();
    let text = |value: Option<&str>| value.map(str::to_string).unwrap_or_default();
    api::Process {
        pid: process.pid.unwrap_or_default(),
        uid: process.uid,
        gid: process.gid,
        command: text(process.command.as_deref()),
        cgroup: text(cgroup.map(|c| &*c.path)),
        cgroup_id: cgroup.and_then(|c| c.id).unwrap_or_default(),
        pod_uid: text(cgroup.and_then(|c| c.pod_uid.as_deref())),
        container_id: text(cgroup.and_then(|c| c.container_id.as_deref())),
    }
}

pub(super) fn unix_ms(at: SystemTime) -> i64 {
    at.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}

pub fn unix_nanos(at: SystemTime) -> i64 {
    at.duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or_default()
}

fn next_retry_ms(backoff: &Backoff) -> i64 {
    let wait = backoff
        .retry_at
        .saturating_duration_since(tokio::time::Instant::now());
    unix_ms(SystemTime::now() + wait)
}

/// The wire form of a plugin.
pub fn to_api(plugin: &Plugin) -> api::Plugin {
    api::Plugin {
        r#type: plugin.plugin_type.clone(),
        name: plugin.name.clone(),
        endpoint: plugin.endpoint.clone(),
        supported_versions: plugin.supported_versions.clone(),
        socket_path: plugin.socket_path.clone(),
    }
}

/// The wire form of an event.
pub fn event_to_api(event: &AgentEvent) -> api::AgentEvent {
    let kind = match event.kind {
        EventKind::SocketDiscovered => api::EventKind::SocketDiscovered,
        EventKind::SocketRemoved => api::EventKind::SocketRemoved,
        EventKind::Registered => api::EventKind::Registered,
        EventKind::Observed => api::EventKind::Observed,
        EventKind::RegistrationFailed => api::EventKind::RegistrationFailed,
        EventKind::Deregistered => api::EventKind::Deregistered,
        EventKind::Unserved => api::EventKind::Unserved,
        EventKind::Rejected => api::EventKind::Rejected,
        EventKind::Rescan => api::EventKind::Rescan,
        EventKind::FirstContact => api::EventKind::FirstContact,
        EventKind::Walked => api::EventKind::Walked,
        EventKind::Served => api::EventKind::Served,
        EventKind::RegistrationAbandoned => api::EventKind::RegistrationAbandoned,
        EventKind::PolicyReloaded => api::EventKind::PolicyReloaded,
        EventKind::PolicyReloadFailed => api::EventKind::PolicyReloadFailed,
    };
    api::AgentEvent {
        time_unix_nanos: unix_nanos(event.at),
        kind: kind as i32,
        // As `display()` writes it (invalid UTF-8 replaced), without the formatting machinery.
        socket_path: event.socket_path.to_string_lossy().into_owned(),
        plugin: event.plugin.as_ref().map(to_api),
        error: event.error.clone().unwrap_or_default(),
        latency_us: event
            .latency
            .map(|d| d.as_micros() as u64)
            .unwrap_or_default(),
        detail: event.detail.clone().unwrap_or_default(),
        provenance: event.provenance.as_ref().map(provenance_to_api),
        contact: event
            .contact
            .as_ref()
            .map(|contact| contact_to_api(contact, event.latency)),
        walk: event.walk.as_ref().map(walk_to_api),
        reason: event
            .reason
            .map(|reason| reason.label().into())
            .unwrap_or_default(),
        serving: event.serving.as_ref().map(serving_to_api),
        policy_reload: event.policy_reload.as_ref().map(policy_reload_to_api),
    }
}

/// The wire form of how the agent knows something serves a socket.
pub(super) fn serving_to_api(serving: &Serving) -> api::Serving {
    api::Serving {
        learned_by: serving.learned_by.to_string(),
        pids: serving.pids.clone(),
    }
}

/// The wire form of a policy reload's report.
fn policy_reload_to_api(reload: &PolicyReloadReport) -> api::PolicyReload {
    let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    api::PolicyReload {
        trigger: reload.trigger.to_string(),
        rules: count(reload.rules),
        refused: count(reload.refused),
        retried: count(reload.retried),
    }
}

/// The wire form of a finished walk.
fn walk_to_api(walk: &crate::notifications::Walk) -> api::Walk {
    api::Walk {
        reason: walk.reason.clone(),
        directories: walk.directories,
        sockets: walk.sockets,
        removed: walk.removed,
        kept_unread: walk.kept_unread,
    }
}

/// The wire form of how the event source started.
pub(super) fn source_start_to_api(start: &SourceStart) -> api::SourceStart {
    api::SourceStart {
        how: start.how.to_string(),
        pins: start
            .pins
            .as_ref()
            .map(|dir| dir.display().to_string())
            .unwrap_or_default(),
        object_hash: start.object_hash.clone().unwrap_or_default(),
        backlog_bytes: start.backlog_bytes,
        open_ms: ms(start.open),
    }
}

/// The wire form of what the state file carried over.
pub(super) fn restore_to_api(report: &RestoreReport) -> api::Restore {
    api::Restore {
        restored: report.restored as u64,
        handler_changed: report.handler_changed as u64,
        interrupted: report.interrupted as u64,
    }
}

/// The wire form of where the start's time went.
pub(super) fn phases_to_api(phases: &StartPhases) -> api::StartPhases {
    api::StartPhases {
        setup_ms: ms(phases.setup),
        event_source_ms: ms(phases.event_source),
        state_ms: ms(phases.state),
        first_walk_ms: ms(phases.first_walk),
        took_ms: ms(phases.took()),
    }
}

/// Milliseconds to a tenth, as the start's log line has always said them.
fn ms(took: Duration) -> f64 {
    (took.as_secs_f64() * 1e4).round() / 10.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::notifications::Walk;
    use std::path::PathBuf;

    fn event(kind: EventKind) -> AgentEvent {
        AgentEvent::new(kind, "/plugins/a.sock")
    }

    #[test]
    fn a_served_event_carries_how_the_server_was_learned_and_its_processes() {
        let mut served = event(EventKind::Served);
        served.serving = Some(Serving {
            learned_by: "holders",
            pids: vec![41, 42],
        });
        let wire = event_to_api(&served);
        assert_eq!(wire.kind, api::EventKind::Served as i32);
        assert_eq!(wire.socket_path, "/plugins/a.sock");
        assert_eq!(
            wire.serving,
            Some(api::Serving {
                learned_by: "holders".into(),
                pids: vec![41, 42],
            })
        );
        assert_eq!((wire.policy_reload, wire.walk), (None, None));
    }

    #[test]
    fn policy_reload_events_carry_their_trigger_counts_and_error() {
        let mut reloaded = event(EventKind::PolicyReloaded);
        reloaded.policy_reload = Some(PolicyReloadReport {
            trigger: "admin_api",
            rules: 2,
            refused: 1,
            retried: 3,
        });
        let wire = event_to_api(&reloaded);
        assert_eq!(wire.kind, api::EventKind::PolicyReloaded as i32);
        assert_eq!(
            wire.policy_reload,
            Some(api::PolicyReload {
                trigger: "admin_api".into(),
                rules: 2,
                refused: 1,
                retried: 3,
            })
        );
        let mut failed = event(EventKind::PolicyReloadFailed);
        failed.error = Some("line 3, column 16".into());
        failed.policy_reload = Some(PolicyReloadReport {
            trigger: "sighup",
            ..PolicyReloadReport::default()
        });
        let wire = event_to_api(&failed);
        assert_eq!(wire.kind, api::EventKind::PolicyReloadFailed as i32);
        assert_eq!(wire.error, "line 3, column 16");
        assert_eq!(
            wire.policy_reload.map(|r| (r.trigger, r.rules)),
            Some(("sighup".into(), 0))
        );
    }

    #[test]
    fn an_abandoned_registration_says_why_in_its_detail_and_walks_keep_their_counts() {
        let mut abandoned = event(EventKind::RegistrationAbandoned);
        abandoned.detail = Some("the agent is stopping".into());
        let wire = event_to_api(&abandoned);
        assert_eq!(
            (wire.kind, wire.detail.as_str(), wire.error.as_str()),
            (
                api::EventKind::RegistrationAbandoned as i32,
                "the agent is stopping",
                ""
            )
        );
        let mut walked = event(EventKind::Walked);
        walked.walk = Some(Walk {
            reason: "start".into(),
            directories: 2,
            sockets: 3,
            removed: 1,
            kept_unread: 0,
        });
        let walk = event_to_api(&walked).walk.expect("a walk");
        assert_eq!(
            (
                walk.reason.as_str(),
                walk.directories,
                walk.sockets,
                walk.removed
            ),
            ("start", 2, 3, 1)
        );
    }

    #[test]
    fn the_start_is_reported_in_tenths_of_a_millisecond_with_its_pins_and_restore() {
        let start = SourceStart {
            how: "adopted",
            pins: Some(PathBuf::from("/sys/fs/bpf/plugin-agent/i1/t2")),
            object_hash: Some("0bc5bb8c100ee8ee".into()),
            backlog_bytes: 264,
            open: Duration::from_micros(3_740),
        };
        assert_eq!(
            source_start_to_api(&start),
            api::SourceStart {
                how: "adopted".into(),
                pins: "/sys/fs/bpf/plugin-agent/i1/t2".into(),
                object_hash: "0bc5bb8c100ee8ee".into(),
                backlog_bytes: 264,
                open_ms: 3.7,
            }
        );
        let opened = source_start_to_api(&SourceStart {
            how: "opened",
            ..SourceStart::default()
        });
        assert_eq!(
            (opened.pins.as_str(), opened.object_hash.as_str()),
            ("", "")
        );
        let phases = StartPhases {
            setup: Duration::from_micros(9_400),
            event_source: Duration::from_micros(4_000),
            state: Duration::from_micros(2_900),
            first_walk: Duration::from_micros(750),
        };
        let wire = phases_to_api(&phases);
        assert_eq!(
            (
                wire.setup_ms,
                wire.event_source_ms,
                wire.state_ms,
                wire.took_ms
            ),
            (9.4, 4.0, 2.9, 17.1)
        );
        let restore = RestoreReport {
            restored: 5,
            handler_changed: 1,
            interrupted: 2,
        };
        assert_eq!(
            restore_to_api(&restore),
            api::Restore {
                restored: 5,
                handler_changed: 1,
                interrupted: 2,
            }
        );
    }
}
