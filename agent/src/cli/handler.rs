//! `plugin-agent handler add|remove`: changes which handler consumes a plugin type, at run time.

use super::HandlerCommand;
use crate::admin;
use plugin_agent_proto::pluginagent::v1 as api;
use std::path::Path;

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
