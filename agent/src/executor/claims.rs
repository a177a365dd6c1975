//! Claims: at most one operation per socket path (kubelet's `nestedpendingoperations`), and at
//! most one handler call at a time per plugin (type, name). Both are released by guards, so an
//! operation that ends any way, a panic included, frees what it held.

use super::{OperationExecutor, OperationKind};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

impl OperationExecutor {
    /// Claims `path` for one operation, or says which operation holds it.
    pub(super) fn claim(
        self: &Arc<Self>,
        path: &Path,
        kind: OperationKind,
    ) -> Result<InFlight, OperationKind> {
        let mut in_flight = self.lock_in_flight();
        if let Some(running) = in_flight.get(path) {
            return Err(running.kind);
        }
        let listened = Arc::new(tokio::sync::Notify::new());
        in_flight.insert(
            path.to_path_buf(),
            Claim {
                kind,
                listened: listened.clone(),
            },
        );
        Ok(InFlight {
            executor: self.clone(),
            path: path.to_path_buf(),
            listened,
        })
    }

    /// The kernel reported a `listen` on `path`: the operation that holds it, if it is waiting
    /// for the socket to listen, stops waiting now (or at its next wait, if it is between two).
    pub(super) fn listened(&self, path: &Path) {
        if let Some(claim) = self.lock_in_flight().get(path) {
            claim.listened.notify_one();
        }
    }

    /// Whether the kernel reported a `listen` on `path` that the operation holding it has not
    /// waited for (one that came after its last refused connect). Takes the report.
    pub(super) fn listen_reported_to_claim(&self, path: &Path) -> bool {
        use futures::FutureExt as _;
        let Some(listened) = self
            .lock_in_flight()
            .get(path)
            .map(|claim| claim.listened.clone())
        else {
            return false;
        };
        // A report nobody waited for is kept as the Notify's permit: polling takes it.
        listened.notified().now_or_never().is_some()
    }

    fn finish(&self, path: &Path) {
        let idle = {
            let mut in_flight = self.lock_in_flight();
            in_flight.remove(path);
            in_flight.is_empty()
        };
        self.queue.mark(path.to_path_buf());
        // After a burst, give what its operations freed back to the kernel (see `memory`).
        self.trimmer.finished(idle);
    }

    pub(super) fn lock_in_flight(&self) -> std::sync::MutexGuard<'_, HashMap<PathBuf, Claim>> {
        self.in_flight
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// What holds a path: the operation's kind, and how a `listen` the kernel reports reaches it.
pub(super) struct Claim {
    kind: OperationKind,
    listened: Arc<tokio::sync::Notify>,
}

/// An operation's claim on its socket path. Released when the operation ends, however it ends (a
/// panic included: otherwise the path would stay claimed and no pass would ever retry it), and
/// the path is then looked at again.
pub(super) struct InFlight {
    executor: Arc<OperationExecutor>,
    path: PathBuf,
    listened: Arc<tokio::sync::Notify>,
}

impl InFlight {
    /// Notified when the kernel reports a `listen` on the path (eBPF source only).
    pub(super) fn listened(&self) -> Arc<tokio::sync::Notify> {
        self.listened.clone()
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.executor.finish(&self.path);
    }
}

/// One async lock per (plugin type, name): handler calls for one plugin are strictly sequential.
#[derive(Default)]
pub(super) struct NameLocks {
    locks: Mutex<HashMap<PluginKey, Arc<tokio::sync::Mutex<()>>>>,
}

/// (plugin type, plugin name).
type PluginKey = (String, String);

impl NameLocks {
    pub(super) async fn lock(&self, plugin_type: &str, name: &str) -> NameGuard<'_> {
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

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<PluginKey, Arc<tokio::sync::Mutex<()>>>> {
        self.locks
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Releases the name lock, and drops the map entry when nobody else holds or waits for it.
pub(super) struct NameGuard<'a> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event_source::SourceKind;
    use futures::FutureExt as _;

    fn executor() -> Arc<OperationExecutor> {
        OperationExecutor::new(
            Arc::default(),
            Arc::default(),
            Arc::default(),
            super::super::ExecutorConfig::default(),
            crate::notifications::NotificationBus::default(),
            crate::telemetry::Telemetry::new(SourceKind::Ebpf),
            tokio_util::sync::CancellationToken::new(),
        )
    }

    #[tokio::test]
    async fn a_listen_the_kernel_reports_reaches_the_operation_that_holds_the_path() {
        let executor = executor();
        let path = Path::new("/plugins/a.sock");
        let claim = executor
            .claim(path, OperationKind::Register)
            .unwrap_or_else(|_| panic!("the path was free"));
        let listened = claim.listened();

        // Another path's listen is not this operation's.
        executor
            .liveness()
            .kernel_hint(Path::new("/plugins/b.sock"), true);
        assert!(
            listened.notified().now_or_never().is_none(),
            "woken by another socket's listen"
        );

        // Its own is, also when it comes before the operation waits (kept until then).
        executor.liveness().kernel_hint(path, true);
        assert!(
            listened.notified().now_or_never().is_some(),
            "the listen did not reach the operation"
        );

        // Once the operation ended, a listen on the path reaches nothing (and costs nothing).
        drop(claim);
        executor.liveness().kernel_hint(path, true);
        assert!(listened.notified().now_or_never().is_none());
    }
}
