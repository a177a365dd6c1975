//! The policy read again and applied to every socket, on SIGHUP or the admin API's
//! `ReloadPolicy`: what it changed, or why the file did not load, is published as an event
//! (`policy_reloaded`, `policy_reload_failed`) as well as logged.

use crate::config::PolicySource;
use crate::notifications::{AgentEvent, EventKind, NotificationBus, PolicyReloadReport};
use crate::operations::{PolicyReload, Runner};
use crate::policy::Policy;
use std::sync::Arc;
use tracing::warn;

/// What asked for a policy reload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReloadTrigger {
    /// SIGHUP.
    Sighup,
    /// The admin API's `ReloadPolicy` (`plugin-agent policy reload`).
    AdminApi,
}

impl ReloadTrigger {
    /// As the reload's event says it.
    pub fn label(self) -> &'static str {
        match self {
            ReloadTrigger::Sighup => "sighup",
            ReloadTrigger::AdminApi => "admin_api",
        }
    }
}

/// Reads the policy again and applies it to every socket; cheap to clone.
#[derive(Clone)]
pub struct PolicyReloader {
    source: PolicySource,
    runner: Arc<Runner>,
    notifications: NotificationBus,
    trigger: ReloadTrigger,
}

impl PolicyReloader {
    /// Reads `source` and applies it through `runner`, for `trigger`; tells `notifications`.
    pub(super) fn new(
        source: PolicySource,
        runner: Arc<Runner>,
        notifications: NotificationBus,
        trigger: ReloadTrigger,
    ) -> Self {
        PolicyReloader {
            source,
            runner,
            notifications,
            trigger,
        }
    }

    /// A policy that does not load changes nothing: the error says why (file, line, column),
    /// and the agent runs on with the policy it had.
    pub fn reload(&self) -> anyhow::Result<PolicyReload> {
        let policy = self
            .source
            .rules()
            .and_then(|rules| Policy::compile(rules.as_slice()));
        let mut report = PolicyReloadReport {
            trigger: self.trigger.label(),
            ..PolicyReloadReport::default()
        };
        // The events name the file the rules were read from (none: the command line's only).
        let source = self.source.file.clone().unwrap_or_default();
        match policy {
            Ok(policy) => {
                let reload = self.runner.reload_policy(policy);
                report.rules = reload.rules;
                report.refused = reload.refused;
                report.retried = reload.retried;
                let mut event = AgentEvent::new(EventKind::PolicyReloaded, &source);
                event.policy_reload = Some(report);
                self.notifications.publish(event);
                Ok(reload)
            }
            Err(e) => {
                let error = format!("{e:#}");
                warn!(error, "policy not reloaded: keeping the policy in force");
                let mut event = AgentEvent::new(EventKind::PolicyReloadFailed, source);
                event.error = Some(error);
                event.policy_reload = Some(report);
                self.notifications.publish(event);
                Err(e)
            }
        }
    }
}

impl crate::admin::server::PolicyReloading for PolicyReloader {
    fn reload(&self) -> anyhow::Result<PolicyReload> {
        PolicyReloader::reload(self)
    }
}
