//! Handlers: the components that consume plugins (a CSI, device-plugin or DRA manager), by plugin
//! type. The operation executor calls them; they never call the agent.
//!
//! The per-plugin state machine every handler can rely on:
//!
//! ```text
//!   socket created ──> validate ──ok──> register ──ok──> (serving) ── socket deleted ──> deregister
//!                         │                 │                    └─ server gone ──> deregister (unserved)
//!                         └─err─> rejected  └─err─> deregister (rollback), rejected
//!   rejected: the plugin is told Notify(false, reason) and retried with backoff.
//!   unserved: the process serving the socket exited and nothing listens on it any more (the
//!   socket file stayed: a crash, an OOM kill); not registered again until the socket changes.
//! ```
//!
//! - Calls for one plugin name (and type) are strictly sequential: never two at once.
//! - Several sockets may announce one name at once (a DRA driver's rolling update starts the new
//!   pod, with its own registration socket, before the old one exits; kubelet 1.33+, kubernetes
//!   PR 129832). Each goes through validate -> register with its own endpoint, and **every**
//!   registered socket's deletion is reported: `deregister` carries that socket's endpoint, so a
//!   handler that tracks instances drops exactly the one that went, and one that tracks a single
//!   endpoint per name ignores a deregistration whose endpoint is not the one it uses.
//! - A handler's errors reach the plugin verbatim in `NotifyRegistrationStatus(false, error)`.
//! - Every call has a deadline set by the executor; a handler that hangs costs only its own
//!   plugins.

pub mod accept_all;
mod contract;
pub mod grpc;

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

pub use contract::{HandlerError, Plugin, PluginHandler};

/// Handlers by plugin type. It can change while the agent runs: adding a handler makes the
/// plugins that were waiting for it register at once (the executor is told through `on_change`).
pub struct HandlerRegistry {
    handlers: RwLock<Handlers>,
    on_change: RwLock<Vec<ChangeCallback>>,
}

/// Handlers by plugin type, looked up once per operation: hashed with foldhash (SipHash's
/// lookup cost as much as the in-process handler's call).
type Handlers = HashMap<String, Arc<dyn PluginHandler>, foldhash::fast::RandomState>;

/// Called with the plugin type whose handler was added, replaced or removed.
type ChangeCallback = Box<dyn Fn(&str) + Send + Sync>;

impl Default for HandlerRegistry {
    fn default() -> Self {
        HandlerRegistry {
            handlers: RwLock::new(Handlers::default()),
            on_change: RwLock::new(Vec::new()),
        }
    }
}

impl HandlerRegistry {
    /// The handler for a plugin type.
    pub fn get(&self, plugin_type: &str) -> Option<Arc<dyn PluginHandler>> {
        self.read().get(plugin_type).cloned()
    }

    /// Installs (or replaces) the handler for `plugin_type`. A handler that reports health is
    /// watched: each time it becomes reachable again, the plugins waiting for it are retried.
    pub fn insert(self: &Arc<Self>, plugin_type: &str, handler: Arc<dyn PluginHandler>) {
        if let Some(mut health) = handler.health() {
            let registry = Arc::downgrade(self);
            let plugin_type = plugin_type.to_string();
            let watched = Arc::downgrade(&handler);
            tokio::spawn(async move {
                while health.changed().await.is_ok() {
                    let Some(registry) = registry.upgrade() else {
                        return;
                    };
                    // Stop when this handler was replaced or removed.
                    let current = registry.get(&plugin_type);
                    let still_installed = match (current, watched.upgrade()) {
                        (Some(current), Some(watched)) => Arc::ptr_eq(&current, &watched),
                        _ => false,
                    };
                    if !still_installed {
                        return;
                    }
                    if *health.borrow_and_update() {
                        registry.changed(&plugin_type);
                    }
                }
            });
        }
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

    /// Every handler by type, sorted by type.
    pub fn list(&self) -> Vec<(String, Arc<dyn PluginHandler>)> {
        let mut list: Vec<_> = self
            .read()
            .iter()
            .map(|(t, h)| (t.clone(), h.clone()))
            .collect();
        list.sort_by(|a, b| a.0.cmp(&b.0));
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

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Handlers> {
        self.handlers
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// What `--handler TYPE=TARGET`, the config file and the admin API's AddHandler accept as a
/// target: `accept-all`, `unix:///path.sock` or `http://host:port`.
pub fn from_target(target: &str) -> Result<Arc<dyn PluginHandler>, String> {
    match target {
        "accept-all" => Ok(Arc::new(accept_all::AcceptAll)),
        other => Ok(Arc::new(grpc::GrpcHandler::new(other)?)),
    }
}
