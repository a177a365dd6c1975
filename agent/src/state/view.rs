//! A plugin's state, derived from desired state, actual state and the backoff table in exactly one
//! place.
//!
//! The admin API (`plugin-agent list`), and the `plugin_agent_plugins` metric all report it; when
//! each derived it on its own they disagreed (a socket whose backoff had expired and whose retry
//! was running was `pending` in one and `backing_off` in the other). Anything that shows a plugin's
//! state reads it from [`StateView`]; a new state is added to [`PluginState`] and [`derive`], and
//! the compiler then points at every view that must say how it shows it.
//!
//! ```text
//! desired  registered (same generation)  backoff (retry_at > now)  ->  state
//!   yes      yes, a kill interrupted it          -                   Pending
//!   yes      yes, with a handler                 not held            Registered
//!   yes      yes, observed (no handler)          not held            Observed
//!   any      yes (other generation, none,        -                   Deregistering
//!            or its socket is unserved/rejected)
//!   yes      no                                  unserved            Unserved
//!   yes      no                                  rejected            Rejected
//!   yes      no                                  waiting (listen,    Pending
//!                                                kubelet's contact)
//!   yes      no                                  yes                 BackingOff
//!   yes      no                                  no (none, or due)   Pending
//! ```

use super::actual::{ActualState, Registered, RegisteredPlugin};
use super::backoff::{Backoff, BackoffTable, FailureKind};
use super::desired::{DesiredPlugin, DesiredState};
pub use super::plugin_state::PluginState;
use super::verdict::{self, Circumstances, Reason};
use crate::provenance::Provenance;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::time::Instant;

/// Everything known about one socket path, and the state derived from it.
#[derive(Debug, Clone)]
pub struct PluginStatus {
    /// The socket path.
    pub path: PathBuf,
    /// Its desired-state entry, while the socket is under the tree.
    pub desired: Option<DesiredPlugin>,
    /// Its actual-state entry, while registered.
    pub registered: Option<RegisteredPlugin>,
    /// The backoff of the desired socket instance, if its last attempt failed.
    pub backoff: Option<Backoff>,
    /// The state, from [`derive`].
    pub state: PluginState,
    /// Why it is in that state, from [`verdict::derive`].
    pub reason: Reason,
}

impl PluginStatus {
    /// Who created the socket and who serves it, as far as known: the registration's, else
    /// what a refusal saw, else the creator alone.
    pub fn provenance(&self) -> Option<Provenance> {
        if let Some(registered) = &self.registered {
            return Some(registered.provenance.clone());
        }
        if let Some(FailureKind::Rejected { provenance, .. }) =
            self.backoff.as_ref().map(|b| &b.kind)
        {
            return Some(Provenance::clone(provenance));
        }
        let desired = self.desired.as_ref()?;
        Some(Provenance {
            creator: desired.creator.clone(),
            server: None,
        })
    }
}

/// What a path needs next, from its desired socket (its generation), its registration and
/// whether its socket is held (unserved, or refused by the policy): the one rule behind both
/// the state a view shows ([`derive`]) and the reconciler's pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Registered from the socket that is desired now: nothing to do.
    Keep,
    /// Registered from a socket that is no longer desired (gone or re-created) or no longer
    /// served (or refused): deregister it; a registration of the new socket follows.
    Deregister,
    /// Not registered, and held: nothing until the socket (or the policy) changes.
    Hold,
    /// Desired and not registered, or registered by a run a kill interrupted: register it
    /// (unless it backs off).
    Register,
    /// Neither desired nor registered: forget what is kept about it.
    Forget,
}

/// The rule of [`Next`]. `desired` is the generation of the socket desired at the path; when
/// nothing is registered and the socket is held, it is not looked at (the reconciler need not
/// read the entry of every dead socket in a tree).
pub fn next(desired: Option<uuid::Uuid>, registered: Option<Registered>, held: bool) -> Next {
    match registered {
        Some(r) if desired == Some(r.generation) && !held => {
            if r.interrupted {
                Next::Register
            } else {
                Next::Keep
            }
        }
        Some(_) => Next::Deregister,
        None if held => Next::Hold,
        None if desired.is_some() => Next::Register,
        None => Next::Forget,
    }
}

/// The one derivation of a plugin's state; see the module docs for the table. What to do next
/// is [`next`]'s, and this only says how each answer is shown.
pub fn derive(
    desired: Option<&DesiredPlugin>,
    registered: Option<&RegisteredPlugin>,
    backoff: Option<&Backoff>,
    now: Instant,
) -> PluginState {
    let held = backoff.map(|b| &b.kind).filter(|kind| kind.is_held());
    match (
        next(
            desired.map(|d| d.generation),
            registered.map(RegisteredPlugin::summary),
            held.is_some(),
        ),
        registered,
    ) {
        (Next::Keep, Some(r)) if r.handler.is_none() => PluginState::Observed,
        (Next::Keep, _) => PluginState::Registered,
        // Registered by an interrupted run: it is registered again.
        (Next::Register, Some(_)) => PluginState::Pending,
        (Next::Deregister, _) => PluginState::Deregistering,
        (Next::Hold, _) if held.is_some_and(|kind| kind.is_unserved()) => PluginState::Unserved,
        (Next::Hold, _) => PluginState::Rejected,
        _ if backoff.is_some_and(|b| b.kind.is_waiting()) => PluginState::Pending,
        _ if backoff.is_some_and(|b| b.retry_at > now) => PluginState::BackingOff,
        _ => PluginState::Pending,
    }
}

/// Read access to the three tables a plugin's state is derived from; cheap to clone.
#[derive(Debug, Clone)]
pub struct StateView {
    /// Desired state.
    pub desired: Arc<DesiredState>,
    /// Actual state.
    pub actual: Arc<ActualState>,
    /// The executor's backoff table.
    pub backoff: Arc<BackoffTable>,
    /// What the node says, for the verdict ([`PluginStatus::reason`]).
    pub circumstances: Arc<Circumstances>,
}

impl StateView {
    /// The status of the socket at `path` at `now`.
    pub fn status(&self, path: &Path, now: Instant) -> PluginStatus {
        let desired = self.desired.get(path);
        let registered = self.actual.get(path);
        let backoff = desired
            .as_ref()
            .and_then(|d| self.backoff.get(path, d.socket));
        let state = derive(desired.as_ref(), registered.as_ref(), backoff.as_ref(), now);
        let mut status = PluginStatus {
            path: path.to_path_buf(),
            desired,
            registered,
            backoff,
            state,
            reason: Reason::Pending,
        };
        let duplicates = self.duplicates(&status);
        let seen = verdict::Seen {
            path: &status.path,
            state: status.state,
            desired: status.desired.as_ref(),
            registered: status.registered.as_ref(),
            backoff: status.backoff.as_ref(),
        };
        status.reason = verdict::derive(&seen, &self.circumstances, &duplicates);
        status
    }

    /// The other sockets registered with the plugin name of `status`'s (a lookup by name).
    pub fn duplicates(&self, status: &PluginStatus) -> Vec<verdict::Duplicate> {
        match &status.registered {
            Some(registered) if !registered.plugin.name.is_empty() => verdict::duplicates(
                &status.path,
                registered,
                self.actual.others_named(&status.path, &registered.plugin),
            ),
            _ => Vec::new(),
        }
    }

    /// The status of every socket desired or registered at `now`, sorted by path.
    pub fn all(&self, now: Instant) -> Vec<PluginStatus> {
        self.page(None, usize::MAX, now).0
    }

    /// The status at `now` of the first `limit` sockets desired or registered whose paths sort
    /// after `after`, in path order, and whether more follow. Only those are looked at and
    /// copied: a page of 100,000 sockets costs their paths, not their entries.
    pub fn page(
        &self,
        after: Option<&Path>,
        limit: usize,
        now: Instant,
    ) -> (Vec<PluginStatus>, bool) {
        let keep = |path: &Path| after.is_none_or(|after| path > after);
        let mut paths = self.desired.paths_where(keep);
        // Registered and no longer desired (being deregistered): each path once.
        let gone: Vec<PathBuf> = self
            .actual
            .paths_where(keep)
            .into_iter()
            .filter(|path| !self.desired.contains(path))
            .collect();
        paths.extend(gone);
        // The first `limit` (and one more, to know there are more) without sorting the rest.
        if paths.len() > limit.saturating_add(1) {
            paths.select_nth_unstable(limit);
            paths.truncate(limit + 1);
        }
        paths.sort_unstable();
        let more = paths.len() > limit;
        paths.truncate(limit);
        (
            paths.iter().map(|path| self.status(path, now)).collect(),
            more,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handler::Plugin;
    use crate::handler::accept_all::AcceptAll;
    use crate::state::SocketId;
    use crate::state::backoff::FailureKind;
    use std::time::Duration;

    fn socket() -> SocketId {
        SocketId {
            dev: 1,
            ino: 2,
            birth_ns: None,
            handle: None,
        }
    }

    fn view() -> StateView {
        StateView {
            desired: Arc::new(DesiredState::default()),
            actual: Arc::new(ActualState::default()),
            backoff: Arc::new(BackoffTable::default()),
            circumstances: Arc::new(Circumstances::default()),
        }
    }

    /// `list` pages (issue 44, item 7): in path order, each socket once (registered and
    /// desired, or registered only while it is deregistered), `more` until the last page.
    #[test]
    fn pages_cover_every_socket_once_in_path_order() {
        let (view, registered, _) = registered_at_a();
        for name in ["d", "b", "e", "c"] {
            let path = PathBuf::from(format!("/r/{name}.sock"));
            view.desired
                .add_or_update(&path, socket(), None)
                .expect("desired");
        }
        // Registered and no longer desired: being deregistered, listed once all the same.
        let gone = PathBuf::from("/r/f.sock");
        let entry = view.actual.get(registered).expect("registered");
        view.actual.add(
            Arc::from(gone.as_path()),
            entry.generation,
            entry.socket,
            entry.plugin.clone(),
            Arc::new(AcceptAll),
            crate::provenance::Provenance::default(),
        );
        let now = Instant::now();
        let mut seen = Vec::new();
        let mut after: Option<PathBuf> = None;
        loop {
            let (page, more) = view.page(after.as_deref(), 2, now);
            assert!(page.len() <= 2);
            seen.extend(page.iter().map(|status| status.path.clone()));
            after = page.last().map(|status| status.path.clone());
            if !more {
                break;
            }
        }
        let names: Vec<String> = seen
            .iter()
            .map(|p| {
                p.file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        assert_eq!(
            names,
            ["a.sock", "b.sock", "c.sock", "d.sock", "e.sock", "f.sock"]
        );
        assert_eq!(view.all(now).len(), 6);
        assert_eq!(view.status(&gone, now).state, PluginState::Deregistering);
        assert_eq!(view.status(registered, now).state, PluginState::Registered);
    }

    /// A view where `/r/a.sock` is desired and registered from that socket.
    fn registered_at_a() -> (StateView, &'static Path, RegisteredPlugin) {
        let view = view();
        let path = Path::new("/r/a.sock");
        view.desired
            .add_or_update(path, socket(), None)
            .expect("desired");
        let desired = view.desired.get(path).expect("desired");
        let plugin = Plugin {
            plugin_type: "CSIPlugin".into(),
            name: "a".into(),
            endpoint: String::new(),
            supported_versions: vec!["1.0.0".into()],
            socket_path: path.display().to_string(),
        };
        let entry = view.actual.add(
            desired.path.clone(),
            desired.generation,
            desired.socket,
            plugin,
            Arc::new(AcceptAll),
            crate::provenance::Provenance::default(),
        );
        (view, path, entry)
    }

    #[test]
    fn a_retry_whose_backoff_expired_is_pending_and_backing_off_only_before() {
        let view = view();
        let path = Path::new("/r/a.sock");
        view.desired
            .add_or_update(path, socket(), None)
            .expect("desired");
        let failed_at = Instant::now();
        view.backoff
            .fail(path, socket(), "boom".into(), FailureKind::Other, failed_at);
        assert_eq!(view.status(path, failed_at).state, PluginState::BackingOff);
        let retrying = failed_at + Duration::from_secs(1);
        let status = view.status(path, retrying);
        assert_eq!(status.state, PluginState::Pending);
        assert!(status.backoff.is_some(), "the failure is still reported");
    }

    #[test]
    fn a_socket_waiting_to_listen_or_for_kubelet_is_pending_not_backing_off() {
        let view = view();
        let now = Instant::now();
        let (listen, kubelet) = (Path::new("/r/bound.sock"), Path::new("/r/observed.sock"));
        for path in [listen, kubelet] {
            view.desired
                .add_or_update(path, socket(), None)
                .expect("desired");
        }
        let until = now + Duration::from_secs(10);
        view.backoff
            .wait_to_listen(listen, socket(), until, true, "bound".into(), now);
        view.backoff
            .wait_for_kubelet(kubelet, socket(), until, "kubelet first".into());
        for path in [listen, kubelet] {
            let status = view.status(path, now);
            assert_eq!(status.state, PluginState::Pending, "{}", path.display());
            assert!(status.backoff.is_some(), "what it waits for is reported");
        }
    }

    #[test]
    fn registered_and_deregistering_follow_the_generations() {
        let (view, path, _) = registered_at_a();
        let now = Instant::now();
        assert_eq!(view.status(path, now).state, PluginState::Registered);
        view.desired.remove(path);
        assert_eq!(view.status(path, now).state, PluginState::Deregistering);
        assert_eq!(view.all(now).len(), 1);
    }

    #[test]
    fn a_restored_registration_a_kill_interrupted_is_pending_then_deregistering_once_gone() {
        let (view, path, mut entry) = registered_at_a();
        entry.interrupted = true;
        view.actual.restore(Arc::from(path), entry);
        let now = Instant::now();
        assert_eq!(view.status(path, now).state, PluginState::Pending);
        view.desired.remove(path);
        assert_eq!(view.status(path, now).state, PluginState::Deregistering);
    }

    #[test]
    fn an_unserved_socket_is_deregistering_while_registered_then_unserved_for_good() {
        let (view, path, entry) = registered_at_a();
        let now = Instant::now();
        let kind = FailureKind::Unserved {
            learned_by: "pidfd",
            since: now,
        };
        view.backoff
            .hold(path, socket(), "its server exited".into(), kind);
        assert_eq!(view.status(path, now).state, PluginState::Deregistering);
        view.actual.remove(path, entry.generation);
        let years = now + Duration::from_secs(10 * 365 * 24 * 3600);
        assert_eq!(view.status(path, years).state, PluginState::Unserved);
        // A new socket at the path is a new key: pending, not unserved.
        let other = SocketId { ino: 3, ..socket() };
        view.desired
            .add_or_update(path, other, None)
            .expect("desired");
        assert_eq!(view.status(path, now).state, PluginState::Pending);
    }

    #[test]
    fn a_rejected_socket_is_deregistering_while_registered_then_rejected_until_the_policy_changes()
    {
        let view = view();
        let path = Path::new("/r/a.sock");
        view.desired
            .add_or_update(path, socket(), None)
            .expect("desired");
        let desired = view.desired.get(path).expect("desired");
        let plugin = Plugin {
            plugin_type: "CSIPlugin".into(),
            name: "a".into(),
            endpoint: String::new(),
            supported_versions: vec!["1.0.0".into()],
            socket_path: path.display().to_string(),
        };
        let server = Arc::new(crate::provenance::Process {
            uid: Some(1000),
            ..crate::provenance::Process::default()
        });
        let entry = view.actual.add(
            desired.path.clone(),
            desired.generation,
            desired.socket,
            plugin.clone(),
            Arc::new(AcceptAll),
            Provenance {
                server: Some(server.clone()),
                ..Provenance::default()
            },
        );
        let now = Instant::now();
        let refusal = crate::policy::Refusal {
            rule: "root-only".into(),
            reason: "uid 1000 not in allow_uids [0]".into(),
            server: Some(server.clone()),
        };
        let kind = FailureKind::Rejected {
            refusal: Arc::new(refusal),
            plugin: Arc::new(plugin),
            provenance: Box::new(Provenance {
                server: Some(server.clone()),
                ..Provenance::default()
            }),
        };
        view.backoff.hold(path, socket(), "refused".into(), kind);
        assert_eq!(view.status(path, now).state, PluginState::Deregistering);
        view.actual.remove(path, entry.generation);
        let status = view.status(path, now + Duration::from_secs(10 * 365 * 24 * 3600));
        assert_eq!(status.state, PluginState::Rejected);
        assert_eq!(
            status.provenance().and_then(|p| p.server),
            Some(server),
            "a refused socket shows the server the policy saw"
        );
        assert_eq!(view.backoff.release_rejected(), vec![path.to_path_buf()]);
        assert_eq!(view.status(path, now).state, PluginState::Pending);
    }
}
