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

use super::failure::Rejection;
use super::report::record_provenance;
use crate::handler::Plugin;
use crate::liveness::Server;
use crate::policy::{Policy, Refusal, Subject};
use crate::provenance::{Creator, Process, Provenance, Resolver};
use crate::state::desired::DesiredPlugin;
use std::sync::{Arc, RwLock};

/// The provenance resolver and the policy in force.
#[derive(Debug, Default)]
pub struct Admission {
    provenance: RwLock<Arc<Resolver>>,
    policy: RwLock<Arc<Policy>>,
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

impl Admission {
    /// Uses `provenance` (the agent's resolver: interned cgroups, servers read once per second
    /// per process) and `policy`; set before the first operation.
    pub fn set(&self, provenance: Arc<Resolver>, policy: Policy) {
        *write(&self.provenance) = provenance;
        self.put_in_force(policy);
    }

    /// Puts `policy` in force for the next verdicts.
    pub fn put_in_force(&self, policy: Policy) {
        *write(&self.policy) = Arc::new(policy);
    }

    fn resolver(&self) -> Arc<Resolver> {
        read(&self.provenance).clone()
    }

    /// The process serving a connection, completed from `/proc`.
    fn server_process(&self, server: Option<&Server>) -> Option<Arc<Process>> {
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
    pub fn provenance_of(
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
    pub fn check(
        &self,
        plugin_type: &str,
        name: &str,
        provenance: &Provenance,
    ) -> Result<(), Refusal> {
        let policy = read(&self.policy).clone();
        policy.check(Subject {
            plugin_type,
            name,
            creator: &provenance.creator,
            server: provenance.server.as_ref(),
        })
    }

    /// The provenance of the socket `desired` whose plugin a connection to `server` described
    /// (put on the operation's span), and whether the policy lets the plugin register.
    pub fn admit_described(
        &self,
        desired: &DesiredPlugin,
        server: Option<&Server>,
        plugin: &Plugin,
    ) -> Result<Provenance, Box<Rejection>> {
        let provenance = self.provenance_of(desired, self.server_process(server));
        record_provenance(&tracing::Span::current(), &provenance);
        match self.check(&plugin.plugin_type, &plugin.name, &provenance) {
            Ok(()) => Ok(provenance),
            Err(refusal) => Err(Box::new(Rejection {
                refusal,
                plugin: plugin.clone(),
                provenance,
            })),
        }
    }
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
