//! One watcher's events, from its subscription until the agent stops. At the stop, what was
//! published before it is still delivered, then the stream ends: an operation the stop let finish
//! publishes its outcome just before the agent's tasks end, and a watcher must not lose it to the
//! race between that publish and the admin server's cancel (cutting the stream at once did, one
//! time in three under load).

use std::sync::Arc;

use tokio::sync::broadcast::{self, error::RecvError, error::TryRecvError};
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;

use crate::notifications::AgentEvent;

/// What a watcher is sent: an event, or how many it missed because it fell behind.
pub enum Fed {
    Event(Arc<AgentEvent>),
    Lagged(u64),
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
}
