//! The conversions from the agent's state, provenance and events to the admin API's wire
//! messages: pure functions, kept apart from the service (`server.rs`) that answers with them.

use crate::handler::Plugin;
use crate::notifications::{AgentEvent, EventKind};
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
    };
    api::AgentEvent {
        time_unix_nanos: unix_nanos(event.at),
        kind: kind as i32,
        socket_path: event.socket_path.display().to_string(),
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
