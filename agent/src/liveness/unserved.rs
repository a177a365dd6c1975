//! What the agent keeps about sockets nothing serves: the mark that holds them (a backoff entry
//! that never expires, `state::backoff`), what is reported when one is marked (metric, log, the
//! `unserved` event and span), and the safety pass's look that lifts the mark when one accepts
//! connections again. Marked from two places: a registered plugin's loss ([`Unserved::lost`],
//! what [`super::Liveness`] reports) and a registration that found nothing listening
//! ([`Unserved::record`]).

use super::loss::{LearnedBy, Loss};
use super::served::ServedBy;
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

    /// An unserved socket listens again (its mark was lifted), as learned `by` the kernel's
    /// report or the safety pass's look: told, and registered next.
    pub fn served_again(&self, path: PathBuf, by: ServedBy) {
        info!(socket_path = %path.display(), learned_by = by.label(), "an unserved socket listens again: registering it");
        let serving = super::served::Known::server(by, None).serving();
        super::served::publish(&self.notifications, &path, serving);
        self.queue.mark(path);
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
                            this.served_again(path, ServedBy::SafetyPass);
                        }
                    }
                })
                .await;
            safety.spent(started.elapsed());
            this.rechecking.store(false, Ordering::Release);
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event_source::SourceKind;
    use crate::state::EntryKind;
    use crate::state::queue::Work;

    struct Harness {
        unserved: Arc<Unserved>,
        backoff: Arc<BackoffTable>,
        queue: Arc<ReconcileQueue>,
        events: tokio::sync::broadcast::Receiver<Arc<AgentEvent>>,
    }

    fn harness() -> Harness {
        let (backoff, queue) = (
            Arc::<BackoffTable>::default(),
            Arc::<ReconcileQueue>::default(),
        );
        let notifications = NotificationBus::default();
        let events = notifications.subscribe();
        let unserved = Unserved::new(
            Arc::default(),
            backoff.clone(),
            queue.clone(),
            notifications,
            Telemetry::new(SourceKind::Inotify),
        );
        Harness {
            unserved,
            backoff,
            queue,
            events,
        }
    }

    /// A socket bound at `path` (not listening), and its identity.
    fn bound(path: &Path) -> (std::os::unix::net::UnixListener, SocketId) {
        let listener = std::os::unix::net::UnixListener::bind(path).expect("bind");
        let Ok(EntryKind::Socket(socket)) = EntryKind::of(path) else {
            panic!("not a socket");
        };
        (listener, socket)
    }

    /// Marked: held (never retried by time), reported once; the safety pass's look finds it
    /// accepting again, lifts the mark and hands the path to the reconciler.
    #[tokio::test]
    async fn a_marked_socket_is_held_until_the_safety_pass_finds_it_accepting() {
        let mut h = harness();
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("p.sock");
        let (listener, socket) = bound(&path);
        let since = Instant::now();
        let reason = "refused".to_string();
        h.unserved
            .record(&path, socket, None, LearnedBy::ConnectProbe, since, reason);
        assert!(h.backoff.is_held(&path, socket));
        assert!(h.backoff.is_unserved(&path, socket));
        let event = h.events.try_recv().expect("an event");
        assert_eq!(event.kind, EventKind::Unserved);
        assert_eq!(event.socket_path, path);

        let safety = Arc::new(SafetyPass::default());
        let look = h.unserved.recheck(&safety).expect("a look");
        assert!(
            h.unserved.recheck(&safety).is_none(),
            "a second look at once"
        );
        // `listener` is bound and accepts connections: the look finds it served, and says so.
        look.await;
        assert!(!h.backoff.is_held(&path, socket), "the mark was not lifted");
        let served = h.events.try_recv().expect("an event");
        assert_eq!(
            (&served.kind, &served.socket_path, &served.serving),
            (
                &EventKind::Served,
                &path,
                &Some(crate::notifications::Serving {
                    learned_by: "safety_pass",
                    pids: Vec::new(),
                })
            )
        );
        match h.queue.take() {
            Some(Work::Paths(paths)) => assert!(paths.contains(&path)),
            other => panic!("marked {other:?}"),
        }
        assert!(
            h.unserved.recheck(&safety).is_some(),
            "the next pass looks again"
        );
        drop(listener);
    }

    /// A loss of a registration that is no longer the one at the path changes nothing.
    #[test]
    fn a_loss_of_another_registration_is_ignored() {
        let h = harness();
        let loss = Loss {
            path: PathBuf::from("/plugins/gone.sock"),
            generation: uuid::Uuid::new_v4(),
            learned_by: LearnedBy::Pidfd,
            reason: "exited".into(),
            since: Instant::now(),
        };
        assert_eq!(h.unserved.lost(loss), None);
        assert!(h.queue.take().is_none());
        assert!(h.backoff.unserved_sockets().is_empty());
    }
}
