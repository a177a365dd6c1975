//! What liveness knows of who serves a registered plugin, and how it learned it: kept with each
//! watch for `list`, and published as a `Served` event when it is learned after the
//! registration (a restored registration's server found again, a listener followed to the
//! processes holding it, an unserved socket that listens again).

use crate::notifications::{AgentEvent, EventKind, NotificationBus, Serving};
use std::path::Path;

/// How the agent learned that something serves a socket: the `learned_by` of `Served` events
/// and of `list`'s `serving`, as [`super::LearnedBy`] is a loss's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServedBy {
    /// The registration connection's peer (`SO_PEERCRED`, `SO_PEERPIDFD`).
    Registration,
    /// A restored registration's server, found again by the pid and pidfs inode the previous
    /// agent recorded: no connection to the plugin.
    Record,
    /// One bare connect's peer: a restored registration whose record names no running process.
    ConnectProbe,
    /// The server exited and the listener lives on in other processes (found in `/proc`).
    Holders,
    /// The kernel reported a `listen()` on an unserved socket (eBPF).
    KernelListen,
    /// The safety pass's connect to an unserved socket was accepted.
    SafetyPass,
}

impl ServedBy {
    pub fn label(self) -> &'static str {
        match self {
            ServedBy::Registration => "registration",
            ServedBy::Record => "record",
            ServedBy::ConnectProbe => "connect_probe",
            ServedBy::Holders => "holders",
            ServedBy::KernelListen => "kernel_listen",
            ServedBy::SafetyPass => "safety_pass",
        }
    }
}

/// Who serves a watched registration, and how that was learned. A server is one process (no
/// allocation: one of these per registered plugin); only holders are several.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Known {
    pub(super) by: ServedBy,
    pids: Pids,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Pids {
    One(Option<u32>),
    Many(Box<[u32]>),
}

impl Known {
    /// Served by the process `pid` (when known), learned `by`.
    pub(super) fn server(by: ServedBy, pid: Option<u32>) -> Known {
        Known {
            by,
            pids: Pids::One(pid),
        }
    }

    /// Served by the processes holding the listener.
    pub(super) fn holders(pids: &[u32]) -> Known {
        Known {
            by: ServedBy::Holders,
            pids: Pids::Many(pids.into()),
        }
    }

    /// The server's pid, when one process serves it and its pid is known.
    pub(super) fn pid(&self) -> Option<u32> {
        match &self.pids {
            Pids::One(pid) => *pid,
            Pids::Many(_) => None,
        }
    }

    /// As `list` and the `Served` event report it.
    pub(super) fn serving(&self) -> Serving {
        let pids = match &self.pids {
            Pids::One(pid) => pid.iter().copied().collect(),
            Pids::Many(pids) => pids.to_vec(),
        };
        Serving {
            learned_by: self.by.label(),
            pids,
        }
    }
}

/// Publishes that `serving` serves the socket at `path`.
pub(super) fn publish(notifications: &NotificationBus, path: &Path, serving: Serving) {
    let mut event = AgentEvent::new(EventKind::Served, path);
    event.serving = Some(serving);
    notifications.publish(event);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_is_its_pid_and_holders_are_theirs_with_how_each_was_learned() {
        let record = Known::server(ServedBy::Record, Some(42)).serving();
        assert_eq!((record.learned_by, record.pids), ("record", vec![42]));
        let unknown = Known::server(ServedBy::KernelListen, None).serving();
        assert_eq!(
            (unknown.learned_by, unknown.pids),
            ("kernel_listen", vec![])
        );
        let holders = Known::holders(&[7, 9]).serving();
        assert_eq!((holders.learned_by, holders.pids), ("holders", vec![7, 9]));
    }
}
