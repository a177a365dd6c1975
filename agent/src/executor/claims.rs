//! Claims: at most one operation per socket path (kubelet's `nestedpendingoperations`). A claim is
//! released by a guard, so an operation that ends any way, a panic included, frees its path, and
//! the path is looked at again.

use crate::state::PathMap;
use crate::state::queue::ReconcileQueue;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// Kind of operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OperationKind {
    /// Registering the socket's plugin.
    Register,
    /// Deregistering it.
    Deregister,
}

/// The paths operations hold now.
pub struct Claims {
    /// Keyed by the path the claim holds (one allocation for the key and the claim).
    in_flight: Mutex<PathMap<Arc<Path>, Claim>>,
    /// Told about every released path: the reconciler looks at it again.
    queue: Arc<ReconcileQueue>,
    trimmer: crate::memory::Trimmer,
}

impl Claims {
    /// Claims that mark each released path in `queue`.
    pub fn new(queue: Arc<ReconcileQueue>) -> Arc<Self> {
        Arc::new(Claims {
            in_flight: Mutex::new(PathMap::default()),
            queue,
            trimmer: crate::memory::Trimmer::default(),
        })
    }

    /// Claims `path` for one operation, or says which operation holds it.
    pub fn claim(
        self: &Arc<Self>,
        path: &Path,
        kind: OperationKind,
    ) -> Result<InFlight, OperationKind> {
        let mut in_flight = self.lock();
        if let Some(running) = in_flight.get(path) {
            return Err(running.kind);
        }
        let listened = Arc::new(tokio::sync::Notify::new());
        let path: Arc<Path> = Arc::from(path);
        in_flight.insert(
            path.clone(),
            Claim {
                kind,
                listened: listened.clone(),
            },
        );
        Ok(InFlight {
            claims: self.clone(),
            path,
            listened,
        })
    }

    /// Whether an operation holds `path`.
    pub fn is_claimed(&self, path: &Path) -> bool {
        self.lock().contains_key(path)
    }

    /// The kernel reported a `listen` on `path`: the operation that holds it, if it is waiting
    /// for the socket to listen, stops waiting now (or at its next wait, if it is between two).
    pub fn listened(&self, path: &Path) {
        if let Some(claim) = self.lock().get(path) {
            claim.listened.notify_one();
        }
    }

    /// Whether the kernel reported a `listen` on `path` that the operation holding it has not
    /// waited for (one that came after its last refused connect). Takes the report.
    pub fn listen_reported(&self, path: &Path) -> bool {
        use futures::FutureExt as _;
        let Some(listened) = self.lock().get(path).map(|claim| claim.listened.clone()) else {
            return false;
        };
        // A report nobody waited for is kept as the Notify's permit: polling takes it.
        listened.notified().now_or_never().is_some()
    }

    fn release(&self, path: &Path) {
        let idle = {
            let mut in_flight = self.lock();
            in_flight.remove(path);
            in_flight.is_empty()
        };
        self.queue.mark(path.to_path_buf());
        // After a burst, give what its operations freed back to the kernel (see `memory`).
        self.trimmer.finished(idle);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PathMap<Arc<Path>, Claim>> {
        self.in_flight
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// What holds a path: the operation's kind, and how a `listen` the kernel reports reaches it.
struct Claim {
    kind: OperationKind,
    listened: Arc<tokio::sync::Notify>,
}

/// An operation's claim on its socket path. Released when the operation ends, however it ends (a
/// panic included: otherwise the path would stay claimed and no pass would ever retry it), and
/// the path is then looked at again.
pub struct InFlight {
    claims: Arc<Claims>,
    path: Arc<Path>,
    listened: Arc<tokio::sync::Notify>,
}

impl InFlight {
    /// Notified when the kernel reports a `listen` on the path (eBPF source only).
    pub fn listened(&self) -> Arc<tokio::sync::Notify> {
        self.listened.clone()
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.claims.release(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt as _;

    #[tokio::test]
    async fn a_listen_the_kernel_reports_reaches_the_operation_that_holds_the_path() {
        let queue = Arc::new(ReconcileQueue::default());
        let claims = Claims::new(queue.clone());
        let path = Path::new("/plugins/a.sock");
        let claim = claims
            .claim(path, OperationKind::Register)
            .unwrap_or_else(|_| panic!("the path was free"));
        let listened = claim.listened();
        assert_eq!(
            claims.claim(path, OperationKind::Deregister).err(),
            Some(OperationKind::Register),
            "a second operation on the path"
        );

        // Another path's listen is not this operation's.
        claims.listened(Path::new("/plugins/b.sock"));
        assert!(
            listened.notified().now_or_never().is_none(),
            "woken by another socket's listen"
        );

        // Its own is, also when it comes before the operation waits (kept until then).
        claims.listened(path);
        assert!(
            listened.notified().now_or_never().is_some(),
            "the listen did not reach the operation"
        );

        // Once the operation ended, the path is free and looked at again, and a listen on it
        // reaches nothing (and costs nothing).
        drop(claim);
        assert!(!claims.is_claimed(path));
        assert!(queue.take().is_some(), "the released path was not marked");
        claims.listened(path);
        assert!(listened.notified().now_or_never().is_none());
    }
}
