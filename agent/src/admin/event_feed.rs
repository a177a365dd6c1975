//! One watcher's events, from its subscription until the agent stops. At the stop, what was
//! published before it is still delivered, then the stream ends: an operation the stop let finish
//! publishes its outcome just before the agent's tasks end, and a watcher must not lose it to the
//! race between that publish and the admin server's cancel (cutting the stream at once did, one
//! time in three under load).
//!
//! An event goes out as it was published, with the reason stamped then (see `notifications`):
//! nothing about it is derived again at delivery, however late the watcher reads.

use std::sync::Arc;

use tokio::sync::broadcast::{self, error::RecvError, error::TryRecvError};
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;

use crate::notifications::AgentEvent;
use plugin_agent_proto::pluginagent::v1 as api;

/// What a watcher is sent: an event, or how many it missed because it fell behind.
pub enum Fed {
    Event(Arc<AgentEvent>),
    Lagged(u64),
}

/// The wire form of what a watcher is sent.
pub fn to_wire(fed: Fed) -> api::AgentEvent {
    match fed {
        Fed::Event(event) => super::convert::event_to_api(&event),
        Fed::Lagged(missed) => api::AgentEvent {
            time_unix_nanos: super::convert::unix_nanos(std::time::SystemTime::now()),
            kind: api::EventKind::Lagged as i32,
            detail: format!("{missed} events dropped: this watcher fell behind"),
            ..Default::default()
        },
    }
}

/// The events of `subscription` until `stop`, then those already queued, then the end.
pub fn until_stopped(
    subscription: broadcast::Receiver<Arc<AgentEvent>>,
    stop: CancellationToken,
) -> impl Stream<Item = Fed> {
    futures::stream::unfold(
        (subscription, stop, false),
        |(mut subscription, stop, stopping)| async move {
            if !stopping {
                let received = tokio::select! {
                    received = subscription.recv() => Some(received),
                    () = stop.cancelled() => None,
                };
                match received {
                    Some(Ok(event)) => {
                        return Some((Fed::Event(event), (subscription, stop, false)));
                    }
                    Some(Err(RecvError::Lagged(missed))) => {
                        return Some((Fed::Lagged(missed), (subscription, stop, false)));
                    }
                    Some(Err(RecvError::Closed)) => return None,
                    None => {}
                }
            }
            // Stopping: only what is queued already.
            match subscription.try_recv() {
                Ok(event) => Some((Fed::Event(event), (subscription, stop, true))),
                Err(TryRecvError::Lagged(missed)) => {
                    Some((Fed::Lagged(missed), (subscription, stop, true)))
                }
                Err(TryRecvError::Empty | TryRecvError::Closed) => None,
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::notifications::{EventKind, NotificationBus};
    use tokio_stream::StreamExt;

    #[tokio::test]
    async fn events_published_before_the_stop_reach_the_watcher_then_the_stream_ends() {
        let bus = NotificationBus::default();
        let stop = CancellationToken::new();
        let mut feed = Box::pin(until_stopped(bus.subscribe(), stop.clone()));
        bus.publish(AgentEvent::new(
            EventKind::SocketDiscovered,
            "/plugins/a.sock",
        ));
        bus.publish(AgentEvent::new(
            EventKind::SocketDiscovered,
            "/plugins/a.sock",
        ));
        stop.cancel();
        let mut delivered = 0;
        while let Some(fed) = feed.next().await {
            assert!(matches!(fed, Fed::Event(_)));
            delivered += 1;
        }
        assert_eq!(delivered, 2);
    }

    /// A watcher that reads after the socket's state moved on still sees each event with the
    /// reason of its moment: published while the socket was pending, delivered after it
    /// registered, the event says pending (deriving it at delivery said registered).
    #[tokio::test]
    async fn an_event_carries_the_reason_of_when_it_was_published_not_of_its_delivery() {
        use crate::state::view::StateView;
        use std::path::Path;
        let view = StateView {
            desired: Arc::default(),
            actual: Arc::default(),
            backoff: Arc::default(),
            circumstances: Arc::default(),
        };
        let bus = NotificationBus::deriving_reasons(view.clone());
        let stop = CancellationToken::new();
        let mut feed = Box::pin(until_stopped(bus.subscribe(), stop.clone()));
        let path = Path::new("/plugins/a.sock");
        let socket = crate::state::SocketId {
            dev: 1,
            ino: 2,
            birth_ns: None,
            handle: None,
        };
        view.desired
            .add_or_update(path, socket, None)
            .expect("desired");
        bus.publish(AgentEvent::new(EventKind::SocketDiscovered, path));
        // Registered before the watcher reads the discovery.
        let desired = view.desired.get(path).expect("desired");
        let plugin = crate::handler::Plugin {
            plugin_type: "CSIPlugin".into(),
            name: "a.example.com".into(),
            endpoint: String::new(),
            supported_versions: vec!["1.0.0".into()],
            socket_path: path.display().to_string(),
        };
        view.actual.add(
            desired.path.clone(),
            desired.generation,
            socket,
            plugin,
            Arc::new(crate::handler::accept_all::AcceptAll),
            crate::provenance::Provenance::default(),
        );
        bus.publish(AgentEvent::new(EventKind::Registered, path));
        stop.cancel();
        let mut reasons = Vec::new();
        while let Some(fed) = feed.next().await {
            reasons.push(to_wire(fed).reason);
        }
        assert_eq!(reasons, ["pending", "registered"]);
    }
}
