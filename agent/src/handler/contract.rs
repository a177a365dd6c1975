//! The handler contract: the plugin as handlers see it, the error a handler answers with, and the
//! [`PluginHandler`] trait every handler implements. It sits in its own file so the handlers
//! (`accept_all`, `grpc`) and the registry in `mod.rs` share it without importing each other; the
//! call contract itself is described in the `handler` module docs.

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
#[error("{message}")]
pub struct HandlerError {
    /// What the handler (or the transport to it) said.
    pub message: String,
    /// The handler could not be reached: the plugin is not at fault, so it waits for the
    /// handler to come back rather than backing off.
    pub unavailable: bool,
}

impl HandlerError {
    /// The handler refused the plugin, or failed handling it.
    pub fn rejected(message: impl Into<String>) -> Self {
        HandlerError {
            message: message.into(),
            unavailable: false,
        }
    }

    /// The handler could not be reached.
    pub fn unavailable(message: impl Into<String>) -> Self {
        HandlerError {
            message: message.into(),
            unavailable: true,
        }
    }
}

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

    /// Reachability, for handlers that can be down (remote ones): `true` when the last contact
    /// worked. The registry watches it and retries the plugins waiting for this handler as soon
    /// as it turns `true`. `None`: always reachable (in-process handlers).
    fn health(&self) -> Option<tokio::sync::watch::Receiver<bool>> {
        None
    }

    /// The last error talking to the handler, for status reporting.
    fn last_error(&self) -> Option<String> {
        None
    }
}
