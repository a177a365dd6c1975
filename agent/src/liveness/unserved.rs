//! What the agent keeps about sockets nothing serves: the mark that holds them (a backoff entry
//! that never expires, `state::backoff`), what is reported when one is marked (metric, log, the
//! `unserved` event and span), and the safety pass's look that lifts the mark when one accepts
//! connections again. Marked from two places: a registered plugin's loss ([`Unserved::lost`],
//! what [`super::Liveness`] reports) and a registration that found nothing listening
//! ([`Unserved::record`]).

use super::{LearnedBy, Loss};
use crate::handler::Plugin;
use crate::notifications::{AgentEvent, EventKind, NotificationBus};
use crate::state::SocketId;
use crate::state::actual::ActualState;
use crate::state::backoff::{BackoffTable, FailureKind, ListenReleased};
use crate::state::queue::ReconcileQueue;
use crate::state::safety_pass::SafetyPass;
use crate::telemetry::Telemetry;
use opentelemetry::KeyValue;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::time::Instant;
use tracing::{info, info_span, warn};

/// Connects in flight at once in a safety pass's look at unserved sockets.
const RECHECKS_AT_ONCE: usize = 32;

/// See the module docs.
pub struct Unserved {
    actual: Arc<ActualState>,
    backoff: Arc<BackoffTable>,
    queue: Arc<ReconcileQueue>,
    notifications: NotificationBus,
    telemetry: Arc<Telemetry>,
    /// A safety pass's look at unserved sockets is running (see [`Unserved::recheck`]).
    rechecking: AtomicBool,
}

impl Unserved {
    /// Marks in `backoff`, reads registrations from `actual`, tells the reconciler through
    /// `queue`, and reports to `notifications` and `telemetry`.
    pub fn new(
        actual: Arc<ActualState>,
        backoff: Arc<BackoffTable>,
        queue: Arc<ReconcileQueue>,
        notifications: NotificationBus,
        telemetry: Arc<Telemetry>,
    ) -> Arc<Self> {
        Arc::new(Unserved {
            actual,
            backoff,
            queue,
            notifications,
            telemetry,
            rechecking: AtomicBool::new(false),
        })
    }

    /// A registered plugin's server is gone: marked, and the reconciler deregisters it. Returns
    /// its path when it was marked (the loss is of the registration there now).
    pub fn lost(&self, loss: Loss) -> Option<PathBuf> {
        let registered = self
            .actual
            .get(&loss.path)
            .filter(|r| r.generation == loss.generation)?;
        let span = info_span!(
            "unserved", socket_path = %loss.path.display(), plugin_name = %registered.plugin.name,
            plugin_type = %registered.plugin.plugin_type, learned_by = loss.learned_by.label(),
            reason = %loss.reason
        );
        // Its span in the socket's trace, and its log line in that span.
        let traced = self.telemetry.discovery.event_span(
            &loss.path,
            "unserved",
            vec![
                KeyValue::new("socket_path", loss.path.display().to_string()),
                KeyValue::new("plugin_name", registered.plugin.name.clone()),
                KeyValue::new("plugin_type", registered.plugin.plugin_type.clone()),
                KeyValue::new("learned_by", loss.learned_by.label()),
                KeyValue::new("reason", loss.reason.clone()),
            ],
        );
        let _in_trace = traced.map(opentelemetry::Context::attach);
        let _in_span = span.enter();
        self.record(
            &loss.path,
            registered.socket,
            Some(registered.plugin),
            loss.learned_by,
            loss.since,
            loss.reason,
        );
        self.queue.mark(loss.path.clone());
        Some(loss.path)
    }

    /// Nothing serves `socket` at `path` (learned `since`, by `learned_by`): no retry until it
    /// changes. `plugin` is the registration it ends, if any.
    pub fn record(
        &self,
        path: &Path,
        socket: SocketId,
        plugin: Option<Plugin>,
        learned_by: LearnedBy,
        since: Instant,
        reason: String,
    ) {
        let kind = FailureKind::Unserved {
            learned_by: learned_by.label(),
            since,
        };
        let said = format!("unserved ({}): {reason}", learned_by.label());
        self.backoff.hold(path, socket, said.clone(), kind);
        self.telemetry.metrics.liveness_loss(learned_by.label());
        warn!(learned_by = learned_by.label(), %reason, "plugin unserved: not registered until its socket changes");
        let mut event = AgentEvent::new(EventKind::Unserved, path);
        event.error = Some(said);
        event.plugin = plugin;
        self.notifications.publish(event);
    }

    /// The safety pass's look at unserved sockets: one connect each, and a socket that accepts
    /// again (it started listening, and no kernel hint said so: another source, or a hint lost
    /// with the events of an overflow) is registered. Nothing else ever retries them. `None`
    /// while the previous pass's look still runs (it is not doubled).
    ///
    /// One future, a few connects at a time: a task per socket at once was 100,000 tasks and
    /// connects with 100,000 dead sockets in the tree (the agent's resident set up by ~90 MB for
    /// the length of each pass). What the connects took is added to `safety`'s cost of the pass.
    pub fn recheck(
        self: &Arc<Self>,
        safety: &Arc<SafetyPass>,
    ) -> Option<impl Future<Output = ()> + Send + 'static> {
        use futures::StreamExt;
        if self.rechecking.swap(true, Ordering::AcqRel) {
            return None;
        }
        let unserved = self.backoff.unserved_sockets();
        let this = self.clone();
        let safety = safety.clone();
        Some(async move {
            let started = Instant::now();
            futures::stream::iter(unserved)
                .for_each_concurrent(RECHECKS_AT_ONCE, |(path, socket)| {
                    let this = &this;
                    async move {
                        if super::accepts(&path, socket).await
                            && this.backoff.release_on_listen(&path, socket)
                                == ListenReleased::Unserved
                        {
                            info!(socket_path = %path.display(), "an unserved socket accepts connections again (safety pass): registering it");
                            this.queue.mark(path);
                        }
                    }
                })
                .await;
            safety.spent(started.elapsed());
            this.rechecking.store(false, Ordering::Release);
        })
    }
}
