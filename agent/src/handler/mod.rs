//! Handlers: the components that consume plugins (a CSI, device-plugin or DRA manager), by plugin
//! type. The operation executor calls them; they never call the agent.
//!
//! The per-plugin state machine every handler can rely on:
//!
//! ```text
//!   socket created ──> validate ──ok──> register ──ok──> (serving) ── socket deleted ──> deregister
//!                         │                 │
//!                         └─err─> rejected  └─err─> deregister (rollback), rejected
//!   rejected: the plugin is told Notify(false, reason) and retried with backoff.
//! ```
//!
//! - Calls for one plugin name (and type) are strictly sequential: never two at once.
//! - Re-registration: a new socket announcing a name that is already registered goes through
//!   validate -> register again. Only the deletion of the *newest* socket triggers deregister; the
//!   older socket's deletion is not reported (its registration was superseded).
//! - A handler's errors reach the plugin verbatim in `NotifyRegistrationStatus(false, error)`.
//! - Every call has a deadline set by the executor; a handler that hangs costs only its own
//!   plugins.

pub mod accept_all;

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

/// A plugin as handlers see it: what GetInfo returned plus where it was discovered.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Plugin {
    /// `CSIPlugin`, `DevicePlugin`, `DRAPlugin`, or any type a handler is registered for.
    #[serde(rename = "type")]
    pub plugin_type: String,
    /// The plugin's name, unique per type on a node.
    pub name: String,
    /// Where the plugin's own service listens (GetInfo's endpoint, else the registration socket).
    pub endpoint: String,
    /// API versions the plugin supports.
    pub supported_versions: Vec<String>,
    /// The registration socket it was discovered on.
    pub socket_path: String,
}

/// Why a handler refused a plugin or failed; the message reaches the plugin.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct HandlerError(pub String);

/// Consumes plugins of one type. See the module docs for the call contract.
#[async_trait::async_trait]
pub trait PluginHandler: Send + Sync {
    /// May the plugin register? Called before any state changes.
    async fn validate(&self, plugin: &Plugin) -> Result<(), HandlerError>;
    /// Start using the plugin.
    async fn register(&self, plugin: &Plugin) -> Result<(), HandlerError>;
    /// Stop using the plugin (its socket is gone, or registration is being rolled back).
    async fn deregister(&self, plugin: &Plugin) -> Result<(), HandlerError>;
    /// One line for logs and status: what this handler is and where it lives.
    fn describe(&self) -> String;
}

/// Handlers by plugin type. It can change while the agent runs: adding a handler makes the
/// plugins that were waiting for it register at once (the executor is told through `on_change`).
pub struct HandlerRegistry {
    handlers: RwLock<HashMap<String, Arc<dyn PluginHandler>>>,
    on_change: RwLock<Vec<ChangeCallback>>,
}

/// Called with the plugin type whose handler was added, replaced or removed.
type ChangeCallback = Box<dyn Fn(&str) + Send + Sync>;

impl Default for HandlerRegistry {
    fn default() -> Self {
        HandlerRegistry {
            handlers: RwLock::new(HashMap::new()),
            on_change: RwLock::new(Vec::new()),
        }
    }
}

impl HandlerRegistry {
    /// The handler for a plugin type.
    pub fn get(&self, plugin_type: &str) -> Option<Arc<dyn PluginHandler>> {
        self.read().get(plugin_type).cloned()
    }

    /// Installs (or replaces) the handler for `plugin_type`.
    pub fn insert(&self, plugin_type: &str, handler: Arc<dyn PluginHandler>) {
        self.handlers
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(plugin_type.to_string(), handler);
        self.changed(plugin_type);
    }

    /// Removes the handler for `plugin_type`; plugins registered with it stay registered until
    /// their sockets go (deregistration reaches the handler they were registered with).
    pub fn remove(&self, plugin_type: &str) -> bool {
        let removed = self
            .handlers
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(plugin_type)
            .is_some();
        if removed {
            self.changed(plugin_type);
        }
        removed
    }

    /// `(type, description)` of every handler, sorted by type.
    pub fn list(&self) -> Vec<(String, String)> {
        let mut list: Vec<_> = self
            .read()
            .iter()
            .map(|(t, h)| (t.clone(), h.describe()))
            .collect();
        list.sort();
        list
    }

    /// Calls `callback(plugin_type)` after every insert or remove.
    pub fn subscribe(&self, callback: impl Fn(&str) + Send + Sync + 'static) {
        self.on_change
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(Box::new(callback));
    }

    fn changed(&self, plugin_type: &str) {
        for callback in self
            .on_change
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .iter()
        {
            callback(plugin_type);
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, Arc<dyn PluginHandler>>> {
        self.handlers
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
