//! Wire contracts, generated at build time from `proto/*.proto`.
//!
//! - [`pluginregistration`]: kubelet's plugin registration API. Plugins serve it on the socket they
//!   create in the registration directory; the agent is the client. Wire-exact with kubelet, so every
//!   existing plugin (CSI node-driver-registrar, device plugins, DRA drivers) works unchanged.
//! - [`pluginagent::v1`]: the agent's own services: `PluginHandler` (served by handlers, called by
//!   the agent) and `Agent`, the operator-facing admin API the agent serves on its admin socket
//!   (`plugin-agent list`, `watch`, `status`, `handler add/remove`).

/// Kubelet's `pluginregistration` package (shared by v1alpha1, v1beta1 and v1).
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");
}

/// The agent's own gRPC package, `pluginagent.v1`.
pub mod pluginagent {
    /// Version 1 of the agent's services.
    pub mod v1 {
        tonic::include_proto!("pluginagent.v1");
    }
}
