//! Putting what a previous agent recorded back into desired and actual state before the first
//! walk, so that an unchanged plugin is not called again.

use super::format::Entry;
use crate::handler::{HandlerRegistry, Plugin, PluginHandler};
use crate::provenance::{Creator, Provenance};
use crate::state::SocketId;
use crate::state::actual::{ActualState, RegisteredPlugin};
use crate::state::desired::DesiredState;
use anyhow::Context;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use uuid::Uuid;

/// A plugin a previous agent registered, as read from the file.
#[derive(Debug, Clone, PartialEq)]
pub struct Restored {
    pub path: PathBuf,
    pub generation: Uuid,
    pub socket: SocketId,
    pub plugin: Plugin,
    /// The handler's description; none: observed only.
    pub handler: Option<String>,
    pub registered_at: SystemTime,
    pub provenance: Provenance,
    /// Begun and not finished: registered again, or deregistered if its socket went.
    pub interrupted: bool,
}

impl Restored {
    /// The plugin `entry` records, if it is one under `root`.
    pub(super) fn from_entry(entry: Entry<'static>, root: &Path) -> anyhow::Result<Restored> {
        let generation = Uuid::parse_str(&entry.generation)
            .with_context(|| format!("bad generation for {}", entry.path))?;
        let path = PathBuf::from(&*entry.path);
        anyhow::ensure!(
            path.starts_with(root),
            "entry {} is outside the tree",
            entry.path
        );
        Ok(Restored {
            generation,
            socket: SocketId {
                dev: entry.dev,
                ino: entry.ino,
                birth_ns: entry.birth_ns,
                handle: entry.handle,
            },
            plugin: Plugin {
                plugin_type: entry.plugin_type.into_owned(),
                name: entry.name.into_owned(),
                endpoint: entry.endpoint.into_owned(),
                supported_versions: entry.versions.into_owned(),
                socket_path: entry.path.into_owned(),
            },
            handler: entry.handler,
            registered_at: SystemTime::UNIX_EPOCH
                + Duration::from_millis(entry.registered_at_unix_ms),
            provenance: Provenance {
                creator: entry.creator.map_or(Creator::FoundByWalk, |p| {
                    Creator::Known(Arc::new(p.into_owned()))
                }),
                server: entry.server.map(|p| Arc::new(p.into_owned())),
            },
            interrupted: entry.unfinished,
            path,
        })
    }
}

/// How restoring went, for the start log line.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct RestoreReport {
    /// Entries put back: their plugins are not called again if their sockets are unchanged.
    pub restored: usize,
    /// Entries whose handler is no longer the one configured for their type (or that were
    /// observed and the agent now registers, or the other way round): registered as new.
    pub handler_changed: usize,
    /// Of the entries put back, registrations a kill interrupted: registered again, or
    /// deregistered if their sockets went.
    pub interrupted: usize,
}

/// What restoring needs to decide, per entry, whether today's agent carries on from it.
pub struct Restore<'a> {
    pub desired: &'a DesiredState,
    pub actual: &'a ActualState,
    pub handlers: &'a HandlerRegistry,
    /// Observe mode: entries are observations (no handler); register mode: registrations.
    pub observing: bool,
}

impl Restore<'_> {
    /// Puts `entries` back into desired and actual state (before the first walk).
    pub fn apply(&self, entries: Vec<Restored>) -> RestoreReport {
        let mut report = RestoreReport::default();
        for entry in entries {
            let Some(handler) = self.handler_for(&entry) else {
                report.handler_changed += 1;
                continue;
            };
            let path: Arc<Path> = Arc::from(entry.path.as_path());
            self.desired.restore(
                path.clone(),
                entry.generation,
                entry.socket,
                entry.provenance.creator.clone(),
            );
            let registered = RegisteredPlugin {
                generation: entry.generation,
                socket: entry.socket,
                plugin: entry.plugin,
                handler,
                registered_at: entry.registered_at,
                provenance: entry.provenance,
                interrupted: entry.interrupted,
            };
            report.interrupted += usize::from(registered.interrupted);
            self.actual.restore(path, registered);
            report.restored += 1;
        }
        report
    }

    /// The handler `entry` is carried on with: `Some(None)` when observed (and observing),
    /// `Some(Some(h))` when today's handler for its type is the one it was registered with.
    #[allow(clippy::option_option)]
    fn handler_for(&self, entry: &Restored) -> Option<Option<Arc<dyn PluginHandler>>> {
        match (&entry.handler, self.observing) {
            (None, true) => Some(None),
            (Some(described), false) => self
                .handlers
                .get(&entry.plugin.plugin_type)
                .filter(|handler| handler.describe() == *described)
                .map(Some),
            _ => None,
        }
    }
}
