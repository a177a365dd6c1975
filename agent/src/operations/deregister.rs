//! The steps of a deregistration: the server no longer watched, actual state (through the
//! journal) before the handler's DeRegister, with this socket's own endpoint.

use super::handler_calls::HandlerCall;
use super::report;
use super::runner::Runner;
use crate::notifications::{AgentEvent, EventKind};
use crate::state::actual::RegisteredPlugin;
use std::path::Path;
use tokio::time::Instant;
use tracing::{info, warn};

impl Runner {
    /// Deregisters `registered` from `path`, asked for at `started`.
    pub(super) async fn run_deregister(
        &self,
        path: &Path,
        registered: RegisteredPlugin,
        started: Instant,
    ) {
        // Every registered socket is deregistered with its own endpoint, also when another
        // socket of the same name registered since (a DRA driver's rolling update, kubelet
        // 1.33+): the handler tells its instances apart by endpoint.
        self.liveness.forget(path, registered.generation);
        let telemetry = &self.failures.telemetry;
        let Some(entry) = self.records.take(path, registered.generation) else {
            report::deregister_ended(telemetry, "not_registered", None, started);
            return;
        };
        let mut event = AgentEvent::new(EventKind::Deregistered, path);
        event.plugin = Some(entry.plugin.clone());
        let Some(handler) = entry.handler.clone() else {
            // Observed only: no handler knows it.
            info!("observed plugin's socket removed");
            self.records.deregistered(path, registered.generation);
            event.detail = Some("observed: no handler to tell".into());
            self.failures.notifications.publish(event);
            report::deregister_ended(telemetry, "observed", None, started);
            return;
        };
        let plugin = &entry.plugin;
        let _name = self.calls.one_at_a_time(plugin).await;
        let told = self
            .calls
            .call(
                HandlerCall::Deregister,
                &plugin.plugin_type,
                handler.deregister(plugin),
            )
            .await;
        // Done either way (the handler was told, or failed to listen and is not asked again),
        // and recorded before it is reported: a kill after the report loses nothing.
        self.records.deregistered(path, registered.generation);
        match told {
            Ok(()) => {
                info!("plugin deregistered");
                report::deregister_ended(telemetry, "success", None, started);
                let backoff = &self.failures.backoff;
                report::unserved_deregistered(telemetry, backoff, path, registered.socket);
            }
            Err(e) => {
                warn!(error = %e, "handler failed to deregister plugin");
                report::deregister_ended(telemetry, "handler_error", Some(&e.message), started);
                event.error = Some(e.message);
            }
        }
        self.failures.notifications.publish(event);
    }
}
