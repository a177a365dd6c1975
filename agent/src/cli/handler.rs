//! `plugin-agent handler add|remove`: changes which handler consumes a plugin type, at run time.

use crate::admin;
use clap::Subcommand;
use plugin_agent_proto::pluginagent::v1 as api;
use std::path::Path;

/// `plugin-agent handler ...`.
#[derive(Subcommand, Debug)]
pub enum HandlerCommand {
    /// Install or replace the handler for a plugin type; waiting plugins register at once.
    #[command(
        after_help = "Example:\n  plugin-agent handler add DRAPlugin unix:///run/dra-handler.sock"
    )]
    Add {
        /// Plugin type, e.g. CSIPlugin, DevicePlugin, DRAPlugin.
        plugin_type: String,
        /// `accept-all`, `unix:///path.sock` or `http://host:port`.
        target: String,
    },
    /// Remove the handler for a plugin type (registered plugins stay until their sockets go).
    Remove {
        /// Plugin type.
        plugin_type: String,
    },
}

/// Sends the handler change to the agent at `socket` and says what it did.
pub(super) async fn execute(socket: &Path, command: HandlerCommand) -> anyhow::Result<()> {
    let mut client = admin::client::connect(socket).await?;
    match command {
        HandlerCommand::Add {
            plugin_type,
            target,
        } => {
            client
                .add_handler(api::AddHandlerRequest {
                    plugin_type: plugin_type.clone(),
                    target: target.clone(),
                })
                .await?;
            out!("handler for {plugin_type} is now {target}");
        }
        HandlerCommand::Remove { plugin_type } => {
            let removed = client
                .remove_handler(api::RemoveHandlerRequest {
                    plugin_type: plugin_type.clone(),
                })
                .await?
                .into_inner()
                .removed;
            out!(
                "{}",
                if removed {
                    format!("handler for {plugin_type} removed")
                } else {
                    format!("no handler for {plugin_type}")
                }
            );
        }
    }
    Ok(())
}
