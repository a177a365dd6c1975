//! An operation in observe mode (see [`crate::mode`]): describe the plugin, record it, tell no
//! one. Scheduling, claims, backoff of a failed GetInfo and telemetry are the register path's.

use super::failure::RegisterFailure;
use super::register::{plugin_of, record_plugin};
use super::runner::Runner;
use crate::executor::Slot;
use crate::handler::Plugin;
use crate::liveness::Server;
use crate::mode::{Contact, KUBELET_FIRST};
use crate::registration::OnInvalid;
use crate::state::actual::RegisteredPlugin;
use crate::state::desired::DesiredPlugin;
use std::path::Path;

impl Runner {
    /// GetInfo (unless `contact` is off; by default only after kubelet's) and an actual-state
    /// entry without a handler. The
    /// connection is dropped unanswered: kubelet, which owns the directory, notifies the plugin.
    pub(super) async fn run_observe(
        &self,
        path: &Path,
        desired: &DesiredPlugin,
        slot: &mut Slot,
        found: Option<tokio::net::UnixStream>,
        contact: Contact,
    ) -> Result<(RegisteredPlugin, Option<Server>), RegisterFailure> {
        let mut server = None;
        let plugin = match contact {
            Contact::Never => Plugin {
                plugin_type: String::new(),
                name: String::new(),
                endpoint: path.display().to_string(),
                supported_versions: Vec::new(),
                socket_path: path.display().to_string(),
            },
            Contact::AfterKubelet | Contact::GetInfo => {
                if contact == Contact::AfterKubelet {
                    self.after_kubelet(path, desired)?;
                }
                let (mut unanswered, info) = self
                    .dial_for_info(path, desired, slot, found, OnInvalid::Silent)
                    .await?;
                server = unanswered.take_server();
                plugin_of(path, info)
            }
        };
        record_plugin(&plugin);
        // Observing tells nobody anything, so a refusal is only recorded (and shown). Without
        // contact there is no server and no name to judge: what is known is shown.
        let provenance = match contact {
            Contact::AfterKubelet | Contact::GetInfo => self
                .admission
                .admit_described(desired, server.as_ref(), &plugin)
                .map_err(RegisterFailure::Rejected)?,
            Contact::Never => self.admission.provenance_of(desired, None),
        };
        let entry = self.actual.add_observed(
            desired.path.clone(),
            desired.generation,
            desired.socket,
            plugin,
            provenance,
        );
        Ok((entry, server))
    }

    /// Whether the plugin may be asked now: kubelet (any process but the agent) has connected
    /// to the socket, or [`KUBELET_FIRST`] has passed since the socket was made; the agent is
    /// never a plugin's first caller. A socket made long ago (found by the start's walk) is
    /// asked at once. Otherwise the operation ends, and the socket waits without one (an
    /// operation held open through the wait cost ~3 KB: 17,000 sockets made at once, 50 MB).
    fn after_kubelet(&self, path: &Path, desired: &DesiredPlugin) -> Result<(), RegisterFailure> {
        let made = desired.socket.born().unwrap_or(desired.seen_at);
        let left = (made + KUBELET_FIRST)
            .duration_since(std::time::SystemTime::now())
            .unwrap_or_default();
        let contacted = desired.first_contact.is_some()
            || self
                .desired
                .get()
                .is_some_and(|contacts| contacts.contacted_since(path, desired.generation));
        if left.is_zero() || contacted {
            return Ok(());
        }
        Err(RegisterFailure::WaitingForKubelet {
            until: tokio::time::Instant::now() + left,
        })
    }
}
