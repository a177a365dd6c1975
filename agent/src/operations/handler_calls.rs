//! Handler calls: each with its deadline, in a span named for the call, its latency recorded by
//! plugin type, call and outcome; and at most one call at a time per plugin (type, name).

use super::failure::RegisterFailure;
use super::report::step_exemplar;
use crate::executor::HandlerTimeouts;
use crate::handler::{HandlerError, Plugin};
use crate::telemetry::Telemetry;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use tracing::field::Empty;
use tracing::{Instrument, info_span};

/// A handler call, for span names, metric labels and error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandlerCall {
    Validate,
    Register,
    Deregister,
}

impl HandlerCall {
    fn label(self) -> &'static str {
        match self {
            HandlerCall::Validate => "validate",
            HandlerCall::Register => "register",
            HandlerCall::Deregister => "deregister",
        }
    }

    /// The name of the call's span.
    fn span_name(self) -> &'static str {
        match self {
            HandlerCall::Validate => "ValidatePlugin",
            HandlerCall::Register => "RegisterPlugin",
            HandlerCall::Deregister => "DeRegisterPlugin",
        }
    }

    fn span(self, plugin_type: &str) -> tracing::Span {
        match self {
            HandlerCall::Validate => {
                info_span!("ValidatePlugin", plugin_type, error = Empty)
            }
            HandlerCall::Register => {
                info_span!("RegisterPlugin", plugin_type, error = Empty)
            }
            HandlerCall::Deregister => {
                info_span!("DeRegisterPlugin", plugin_type, error = Empty)
            }
        }
    }

    /// The deadline of this call.
    fn deadline(self, timeouts: &HandlerTimeouts) -> Duration {
        match self {
            HandlerCall::Validate => timeouts.validate,
            HandlerCall::Register => timeouts.register,
            HandlerCall::Deregister => timeouts.deregister,
        }
    }

    /// The handler's `error` in this call for `plugin`, as a registration's failure.
    pub fn failure(self, error: HandlerError, plugin: &Plugin) -> RegisterFailure {
        let (what, rejected) = match self {
            HandlerCall::Validate => ("plugin validation failed", "validation_rejected"),
            _ => ("plugin registration failed", "registration_rejected"),
        };
        RegisterFailure::Handler {
            message: format!("{what}: {}", error.message),
            unavailable: error.unavailable,
            plugin_type: plugin.plugin_type.clone(),
            outcome: if error.unavailable {
                "handler_unavailable"
            } else {
                rejected
            },
        }
    }
}

/// Calls handlers with deadlines, recording each call (see the module docs).
pub struct HandlerCalls {
    timeouts: HandlerTimeouts,
    telemetry: Arc<Telemetry>,
    names: NameLocks,
}

impl HandlerCalls {
    /// Calls with `timeouts`, recorded in `telemetry`.
    pub fn new(timeouts: HandlerTimeouts, telemetry: Arc<Telemetry>) -> Self {
        HandlerCalls {
            timeouts,
            telemetry,
            names: NameLocks::default(),
        }
    }

    /// Waits until no other operation calls a handler about `plugin`; calls are theirs alone
    /// while the guard lives.
    pub async fn one_at_a_time(&self, plugin: &Plugin) -> NameGuard<'_> {
        self.names.lock(&plugin.plugin_type, &plugin.name).await
    }

    /// Calls a handler with `call`'s deadline, in a span named for the call, recording its
    /// latency by plugin type (a handler's type: bounded), call and outcome.
    pub async fn call(
        &self,
        call: HandlerCall,
        plugin_type: &str,
        future: impl std::future::Future<Output = Result<(), HandlerError>>,
    ) -> Result<(), HandlerError> {
        let deadline = call.deadline(&self.timeouts);
        let span = call.span(plugin_type);
        let started = Instant::now();
        let answer = tokio::time::timeout(deadline, future)
            .instrument(span.clone())
            .await;
        let (outcome, result) = match answer {
            Ok(Ok(())) => ("ok", Ok(())),
            Ok(Err(e)) if e.unavailable => ("unavailable", Err(e)),
            Ok(Err(e)) => ("rejected", Err(e)),
            Err(_) => (
                "timeout",
                Err(HandlerError::rejected(format!(
                    "handler did not answer within {deadline:?}"
                ))),
            ),
        };
        // A failed or slow call makes its operation failed or slow: its trace is exported.
        let took = started.elapsed();
        let exemplar = step_exemplar(call.span_name(), took, result.is_err(), || {
            let mut attributes = vec![opentelemetry::KeyValue::new(
                "plugin_type",
                plugin_type.to_string(),
            )];
            if let Err(e) = &result {
                attributes.push(opentelemetry::KeyValue::new("error", e.message.clone()));
            }
            attributes
        });
        self.telemetry
            .metrics
            .handler_call(plugin_type, call.label(), outcome, took, exemplar);
        if let Err(e) = &result {
            span.record("error", e.message.as_str());
        }
        result
    }
}

/// One async lock per (plugin type, name): handler calls for one plugin are strictly sequential.
#[derive(Default)]
struct NameLocks {
    locks: Mutex<Locks>,
}

/// (plugin type, plugin name).
type PluginKey = (String, String);

/// The locks held or waited for, hashed with foldhash (SipHash cost more than the rest of a
/// lock's taking and release).
type Locks = HashMap<PluginKey, Arc<tokio::sync::Mutex<()>>, foldhash::fast::RandomState>;

impl NameLocks {
    async fn lock(&self, plugin_type: &str, name: &str) -> NameGuard<'_> {
        let key = (plugin_type.to_string(), name.to_string());
        let lock = self.map().entry(key.clone()).or_default().clone();
        let guard = lock.clone().lock_owned().await;
        NameGuard {
            locks: self,
            key,
            lock,
            guard: Some(guard),
        }
    }

    fn map(&self) -> std::sync::MutexGuard<'_, Locks> {
        self.locks
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Releases the name lock, and drops the map entry when nobody else holds or waits for it.
pub struct NameGuard<'a> {
    locks: &'a NameLocks,
    key: PluginKey,
    lock: Arc<tokio::sync::Mutex<()>>,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl Drop for NameGuard<'_> {
    fn drop(&mut self) {
        self.guard.take();
        let mut map = self.locks.map();
        // Held by the map, by `self.lock`, and by nobody else: no waiter, so the entry can go.
        if Arc::strong_count(&self.lock) == 2 {
            map.remove(&self.key);
        }
    }
}
