//! `accept-all`: a built-in handler that accepts every plugin (and logs it at debug: the executor
//! logs each outcome at info), for operators who only
//! need discovery, and for benchmarks that measure the agent rather than a handler.

use super::contract::{HandlerError, Plugin, PluginHandler};

/// Accepts every plugin of the type it is installed for.
#[derive(Debug, Default, Clone, Copy)]
pub struct AcceptAll;

#[async_trait::async_trait]
impl PluginHandler for AcceptAll {
    async fn validate(&self, _plugin: &Plugin) -> Result<(), HandlerError> {
        Ok(())
    }

    async fn register(&self, plugin: &Plugin) -> Result<(), HandlerError> {
        tracing::debug!(
            socket_path = %plugin.socket_path, plugin_name = %plugin.name, plugin_type = %plugin.plugin_type,
            endpoint = %plugin.endpoint, versions = ?plugin.supported_versions, "plugin registered (accept-all)"
        );
        Ok(())
    }

    async fn deregister(&self, plugin: &Plugin) -> Result<(), HandlerError> {
        tracing::debug!(
            socket_path = %plugin.socket_path, plugin_name = %plugin.name, plugin_type = %plugin.plugin_type,
            "plugin deregistered (accept-all)"
        );
        Ok(())
    }

    fn describe(&self) -> String {
        "accept-all (built in)".into()
    }
}
