//! Predicates on the agent's admin events (`plugin-agent watch -o json`), named for what the
//! agent reports: the operator's contract, where [`crate::logs`] is its wording.

use crate::events::Line;
use std::path::Path;

fn is(line: &Line, kind: &str, socket: &Path) -> bool {
    line.field_is("kind", kind) && line.field_is("socket_path", &socket.to_string_lossy())
}

/// The plugin at `socket` was registered: its handler accepted it and it got Notify(true).
pub fn registered(socket: &Path) -> impl Fn(&Line) -> bool + '_ {
    move |l| is(l, "registered", socket)
}

/// Any plugin was registered.
pub fn any_registered(l: &Line) -> bool {
    l.field_is("kind", "registered")
}

/// The plugin at `socket` was deregistered from its handler.
pub fn deregistered(socket: &Path) -> impl Fn(&Line) -> bool + '_ {
    move |l| is(l, "deregistered", socket)
}

/// A registration attempt for `socket` failed (`error` says why).
pub fn registration_failed(socket: &Path) -> impl Fn(&Line) -> bool + '_ {
    move |l| is(l, "registration_failed", socket)
}

/// Any registration attempt failed.
pub fn any_registration_failed(l: &Line) -> bool {
    l.field_is("kind", "registration_failed")
}

/// The watcher recorded a socket at `socket`.
pub fn discovered(socket: &Path) -> impl Fn(&Line) -> bool + '_ {
    move |l| is(l, "socket_discovered", socket)
}

/// The watcher forgot the socket at `socket`.
pub fn removed(socket: &Path) -> impl Fn(&Line) -> bool + '_ {
    move |l| is(l, "socket_removed", socket)
}

/// Nothing serves the plugin at `socket`.
pub fn unserved(socket: &Path) -> impl Fn(&Line) -> bool + '_ {
    move |l| is(l, "unserved", socket)
}

/// The policy refused the plugin at `socket`.
pub fn rejected(socket: &Path) -> impl Fn(&Line) -> bool + '_ {
    move |l| is(l, "rejected", socket)
}

/// Observe mode described the plugin at `socket`.
pub fn observed(socket: &Path) -> impl Fn(&Line) -> bool + '_ {
    move |l| is(l, "observed", socket)
}

/// Any event about `socket`.
pub fn about(socket: &Path) -> impl Fn(&Line) -> bool + '_ {
    move |l| l.field_is("socket_path", &socket.to_string_lossy())
}

/// A full walk for `reason` finished (`start`, `periodic safety pass`, ...).
pub fn walked(reason: &str) -> impl Fn(&Line) -> bool + '_ {
    move |l| {
        l.field_is("kind", "walked")
            && l.0.pointer("/walk/reason").and_then(|r| r.as_str()) == Some(reason)
    }
}

/// When the agent published the event (its `time`).
pub fn at(line: &Line) -> std::time::SystemTime {
    line.field("time")
        .and_then(|t| humantime::parse_rfc3339(&t).ok())
        .unwrap_or_else(|| panic!("no time in the event {line}"))
}

/// Any full walk finished.
pub fn any_walk(l: &Line) -> bool {
    l.field_is("kind", "walked")
}

/// A field of a `walked` event's walk (`directories`, `sockets`, `removed`, `kept_unread`).
pub fn walk_count(line: &Line, field: &str) -> u64 {
    line.0
        .pointer(&format!("/walk/{field}"))
        .and_then(|v| v.as_u64())
        .unwrap_or_else(|| panic!("no walk.{field} in {line}"))
}

/// The agent learned that something serves the socket at `socket` (`serving` says how).
pub fn served(socket: &Path) -> impl Fn(&Line) -> bool + '_ {
    move |l| is(l, "served", socket)
}

/// How a `served` event (or a `list` row's `serving`, as `serving`) says the server was
/// learned: `record`, `connect_probe`, `holders`, `kernel_listen`, `safety_pass`, ...
pub fn learned_by(serving: &serde_json::Value) -> &str {
    serving["learned_by"].as_str().unwrap_or_default()
}

/// The processes a `served` event's (or a `list` row's) `serving` names.
pub fn serving_pids(serving: &serde_json::Value) -> Vec<u64> {
    serving["pids"]
        .as_array()
        .map(|pids| pids.iter().filter_map(|p| p.as_u64()).collect())
        .unwrap_or_default()
}

/// A registration attempt for `socket` ended without an outcome (`detail` says why).
pub fn abandoned(socket: &Path) -> impl Fn(&Line) -> bool + '_ {
    move |l| is(l, "registration_abandoned", socket)
}

/// Any registration attempt ended without an outcome.
pub fn any_abandoned(l: &Line) -> bool {
    l.field_is("kind", "registration_abandoned")
}

/// The policy was read again and applied (`policy_reload` says what changed, and what asked).
pub fn policy_reloaded(l: &Line) -> bool {
    l.field_is("kind", "policy_reloaded")
}

/// A policy reload was refused (`error` says where the file breaks).
pub fn policy_reload_failed(l: &Line) -> bool {
    l.field_is("kind", "policy_reload_failed")
}
