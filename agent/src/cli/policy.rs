//! `plugin-agent policy reload`: the running agent reads its policy again.

use crate::admin;
use plugin_agent_proto::pluginagent::v1 as api;
use std::path::Path;

/// Asks the agent at `socket` to reload its policy and says what changed.
pub(super) async fn reload(socket: &Path) -> anyhow::Result<()> {
    let mut client = admin::client::connect(socket).await?;
    let reload = client
        .reload_policy(api::ReloadPolicyRequest {})
        .await
        .map_err(|status| anyhow::anyhow!("policy not reloaded: {}", status.message()))?
        .into_inner();
    out!(
        "policy reloaded: {} rules; {} registered plugins refused (deregistering), {} refused plugins tried again",
        reload.rules,
        reload.refused,
        reload.retried
    );
    Ok(())
}
