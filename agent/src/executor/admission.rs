//! Whether a described plugin may register: who serves it (its provenance) and what the policy
//! says about that, asked after GetInfo and before any handler hears of it; and what a policy
//! reload does to the plugins already registered or refused.
//!
//! ```text
//! GetInfo answered -> server = provenance of the connection's credentials
//!                  -> policy.check(type, name, creator, server)
//!                       allowed: on to the handler
//!                       refused: Notify(false, refusal), no handler call, state::backoff held
//!                                (rejected) until the socket or the policy changes
//! reload           -> registered plugins that now fail: held (rejected), the reconciler
//!                     deregisters them; refused ones: released, tried again
//! ```

use super::OperationExecutor;
use crate::handler::Plugin;
use crate::liveness::Server;
use crate::notifications::{AgentEvent, EventKind};
use crate::policy::{Policy, Refusal, Subject};
use crate::provenance::{Creator, Process, Provenance, Resolver};
use crate::state::SocketId;
use crate::state::backoff::FailureKind;
use crate::state::desired::DesiredPlugin;
use std::path::Path;
use std::sync::{Arc, RwLock};
use tracing::{info, warn};

/// The executor's provenance resolver and the policy in force.
#[derive(Debug, Default)]
pub(super) struct Admission {
    provenance: RwLock<Arc<Resolver>>,
    policy: RwLock<Arc<Policy>>,
}

/// A plugin the policy refused, with what it said it is and who made and serves its socket.
#[derive(Debug)]
pub(super) struct Rejection {
    pub(super) refusal: Refusal,
    pub(super) plugin: Plugin,
    pub(super) provenance: Provenance,
}

/// What a policy reload changed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PolicyReload {
    /// Rules in the new policy.
    pub rules: usize,
    /// Registered plugins the new policy refuses: deregistered.
    pub refused: usize,
    /// Plugins the old policy refused: tried again under the new one.
    pub retried: usize,
}

impl OperationExecutor {
    /// Uses `provenance` (the agent's resolver: interned cgroups, servers read once per second
    /// per process) and `policy`; set before the first operation.
    pub fn with_admission(&self, provenance: Arc<Resolver>, policy: Policy) {
        *write(&self.admission.provenance) = provenance;
        *write(&self.admission.policy) = Arc::new(policy);
    }

    fn resolver(&self) -> Arc<Resolver> {
        read(&self.admission.provenance).clone()
    }

    /// The process serving a connection, completed from `/proc`.
    pub(super) fn server_process(&self, server: Option<&Server>) -> Option<Arc<Process>> {
        let server = server?;
        let resolver = self.resolver();
        Some(resolver.server(
            server.identity(),
            server.pid,
            server.pidfd(),
            server.uid,
            server.gid,
        ))
    }

    /// `desired`'s provenance once its server is known: a recorded creator completed (from the
    /// server when it is the same process).
    pub(super) fn provenance_of(
        &self,
        desired: &DesiredPlugin,
        server: Option<Arc<Process>>,
    ) -> Provenance {
        let creator = match &desired.creator {
            Creator::Recorded(actor) => {
                Creator::Known(self.resolver().creator(actor, server.as_ref()))
            }
            known_or_not => known_or_not.clone(),
        };
        Provenance { creator, server }
    }

    /// The policy's verdict on a described plugin.
    pub(super) fn admit(
        &self,
        plugin_type: &str,
        name: &str,
        provenance: &Provenance,
    ) -> Result<(), Refusal> {
        let policy = read(&self.admission.policy).clone();
        policy.check(Subject {
            plugin_type,
            name,
            creator: &provenance.creator,
            server: provenance.server.as_ref(),
        })
    }

    /// The provenance of the socket `desired` whose plugin a connection to `server` described
    /// (put on the operation's span), and whether the policy lets the plugin register.
    pub(super) fn admit_described(
        &self,
        desired: &DesiredPlugin,
        server: Option<&Server>,
        plugin: &Plugin,
    ) -> Result<Provenance, Box<Rejection>> {
        let provenance = self.provenance_of(desired, self.server_process(server));
        super::operation::record_provenance(&tracing::Span::current(), &provenance);
        match self.admit(&plugin.plugin_type, &plugin.name, &provenance) {
            Ok(()) => Ok(provenance),
            Err(refusal) => Err(Box::new(Rejection {
                refusal,
                plugin: plugin.clone(),
                provenance,
            })),
        }
    }

    /// The policy refuses the plugin at `path`: held until the socket or the policy changes.
    pub(super) fn record_rejected(&self, path: &Path, socket: SocketId, rejected: Rejection) {
        let Rejection {
            refusal,
            plugin,
            provenance,
        } = rejected;
        let said = refusal.to_string();
        self.telemetry.metrics.policy_rejection(&refusal.rule);
        warn!(rule = %refusal.rule, reason = %refusal.reason, server = %refusal.server.as_deref().map(ToString::to_string).unwrap_or_default(), "plugin rejected by policy: not registered until its socket or the policy changes");
        let kind = FailureKind::Rejected {
            refusal: Arc::new(refusal),
            plugin: Arc::new(plugin.clone()),
            provenance: Box::new(provenance.clone()),
        };
        self.backoff.hold(path, socket, said.clone(), kind);
        if let Some(timer) = self.lock_retry_timers().remove(path) {
            timer.cancel();
        }
        let mut event = AgentEvent::new(EventKind::Rejected, path);
        event.error = Some(said);
        event.plugin = Some(plugin);
        event.provenance = Some(provenance);
        self.notifications.publish(event);
    }

    /// Puts `policy` in force and applies it to every plugin: registered ones it refuses are
    /// held (the reconciler deregisters them), refused ones are tried again.
    pub fn reload_policy(&self, policy: Policy) -> PolicyReload {
        let rules = policy.len();
        *write(&self.admission.policy) = Arc::new(policy);
        let mut reload = PolicyReload {
            rules,
            ..PolicyReload::default()
        };
        // Refusals of the old policy first: the plugins refused below are refused by this one.
        for path in self.backoff.release_rejected() {
            reload.retried += 1;
            self.queue.mark(path);
        }
        for (path, entry) in self.actual.snapshot() {
            let verdict = self.admit(
                &entry.plugin.plugin_type,
                &entry.plugin.name,
                &entry.provenance,
            );
            if let Err(refusal) = verdict {
                reload.refused += 1;
                let rejected = Rejection {
                    refusal,
                    plugin: entry.plugin,
                    provenance: entry.provenance,
                };
                self.record_rejected(&path, entry.socket, rejected);
                self.queue.mark(path);
            }
        }
        info!(
            rules = reload.rules,
            refused = reload.refused,
            retried = reload.retried,
            "policy reloaded"
        );
        reload
    }
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
