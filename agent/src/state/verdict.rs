//! Why a plugin is, or is not, registered: the verdict `plugin-agent explain` leads with, derived
//! here only, from what [`super::view`] derives a plugin's state from plus what the node says
//! ([`Circumstances`]: the mode, whether the source sees connections, the kubelets running). The
//! admin API's `list` and `watch`, the operations' spans and `plugin_agent_plugin_problems` all
//! read it from [`super::view::PluginStatus::reason`], so every surface says the same.
//!
//! [`Reason`] is a closed list (a metric label): the first row that holds decides.
//!
//! ```text
//! path >= 108 bytes (sockaddr_un)                              path_too_long
//! registered, socket gone or re-created                       deregistering
//! refused by the policy                                        rejected_by_policy
//! observe mode, a kubelet runs, watching another directory     outside_kubelet_dir
//! unserved, observe mode, within 15 s of kubelet's contact     stopped_after_kubelet_contact
//! unserved                                                     served_by_nobody
//! failed: no handler / GetInfo invalid / EACCES / handler no   no_handler / invalid_info /
//!                                                              socket_permissions / handler_refused
//! failed, anything else                                        registration_failed
//! waiting (to listen, for kubelet), or not tried yet           pending
//! described: kubelet would refuse its GetInfo (observe mode)   invalid_info
//! described: a newer socket announces its (type, name)         duplicate_driver
//! observed, eBPF, no kubelet contact since its creation        kubelet_never_connected
//! registered / observed                                        registered / observed
//! ```
//!
//! The socket-file rows `explain` alone reaches (a path given that the agent never saw) are
//! [`Reason::NotFound`], [`Reason::NotASocket`] and [`Reason::OutsideWatchedDir`].

use super::actual::RegisteredPlugin;
use super::backoff::{Backoff, FailureKind};
use super::desired::DesiredPlugin;
use super::plugin_state::PluginState;
use crate::handler::Plugin;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

/// The longest socket path a `sockaddr_un` holds: 108 bytes with the terminating NUL.
pub const SUN_PATH_MAX: usize = 107;

/// A plugin that stops serving this soon after kubelet's first contact most likely heard
/// kubelet's `Notify(false)` (node-driver-registrar exits on it). Longer than the agent's wait
/// for a new socket to listen (10 s), which can stand between the exit and the agent learning it.
pub const STOPPED_AFTER_CONTACT: Duration = Duration::from_secs(15);

/// How soon kubelet contacts a new socket: its reconciler looks every second, and an observer
/// leaves it three before calling itself (`mode::KUBELET_FIRST`).
pub const KUBELET_EXPECTED: Duration = Duration::from_secs(3);

/// How long the node's kubelets, read from `/proc`, are reused before they are read again.
const KUBELETS_FOR: Duration = Duration::from_secs(2);

/// Why a plugin is where it is (see the module docs); a closed list, the `reason` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    Registered,
    Observed,
    Pending,
    Deregistering,
    PathTooLong,
    NotFound,
    NotASocket,
    OutsideWatchedDir,
    OutsideKubeletDir,
    ServedByNobody,
    StoppedAfterKubeletContact,
    RejectedByPolicy,
    InvalidInfo,
    DuplicateDriver,
    NoHandler,
    HandlerRefused,
    SocketPermissions,
    KubeletNeverConnected,
    RegistrationFailed,
}

impl Reason {
    /// Every reason, in the order of the docs.
    pub const ALL: [Reason; 19] = [
        Reason::Registered,
        Reason::Observed,
        Reason::Pending,
        Reason::Deregistering,
        Reason::PathTooLong,
        Reason::NotFound,
        Reason::NotASocket,
        Reason::OutsideWatchedDir,
        Reason::OutsideKubeletDir,
        Reason::ServedByNobody,
        Reason::StoppedAfterKubeletContact,
        Reason::RejectedByPolicy,
        Reason::InvalidInfo,
        Reason::DuplicateDriver,
        Reason::NoHandler,
        Reason::HandlerRefused,
        Reason::SocketPermissions,
        Reason::KubeletNeverConnected,
        Reason::RegistrationFailed,
    ];

    /// The `reason` label and wire value.
    pub fn label(self) -> &'static str {
        match self {
            Reason::Registered => "registered",
            Reason::Observed => "observed",
            Reason::Pending => "pending",
            Reason::Deregistering => "deregistering",
            Reason::PathTooLong => "path_too_long",
            Reason::NotFound => "not_found",
            Reason::NotASocket => "not_a_socket",
            Reason::OutsideWatchedDir => "outside_watched_dir",
            Reason::OutsideKubeletDir => "outside_kubelet_dir",
            Reason::ServedByNobody => "served_by_nobody",
            Reason::StoppedAfterKubeletContact => "stopped_after_kubelet_contact",
            Reason::RejectedByPolicy => "rejected_by_policy",
            Reason::InvalidInfo => "invalid_info",
            Reason::DuplicateDriver => "duplicate_driver",
            Reason::NoHandler => "no_handler",
            Reason::HandlerRefused => "handler_refused",
            Reason::SocketPermissions => "socket_permissions",
            Reason::KubeletNeverConnected => "kubelet_never_connected",
            Reason::RegistrationFailed => "registration_failed",
        }
    }

    /// Whether the plugin has a problem (counted by `plugin_agent_plugin_problems`): not
    /// registered or observed, nor on its way there or out.
    pub fn is_problem(self) -> bool {
        !matches!(
            self,
            Reason::Registered | Reason::Observed | Reason::Pending | Reason::Deregistering
        )
    }

    /// The verdict, as a sentence.
    pub fn verdict(self) -> &'static str {
        match self {
            Reason::Registered => "registered",
            Reason::Observed => {
                "observed: kubelet contacted it and nothing the agent sees is wrong"
            }
            Reason::Pending => {
                "pending: registration not attempted yet, under way, or waiting for the socket to listen (or for kubelet)"
            }
            Reason::Deregistering => {
                "deregistering: its socket is gone, re-created or no longer served"
            }
            Reason::PathTooLong => {
                "path too long for a unix socket: 108 bytes or more cannot be dialled"
            }
            Reason::NotFound => "no such socket",
            Reason::NotASocket => "not a socket",
            Reason::OutsideWatchedDir => "outside the directory the agent watches",
            Reason::OutsideKubeletDir => {
                "outside the registration directory the node's kubelet watches"
            }
            Reason::ServedByNobody => "served by nobody: the socket exists, nothing listens on it",
            Reason::StoppedAfterKubeletContact => {
                "stopped serving right after kubelet's first contact: kubelet most likely told it Notify(false)"
            }
            Reason::RejectedByPolicy => "rejected by policy",
            Reason::InvalidInfo => "GetInfo answer invalid",
            Reason::DuplicateDriver => {
                "duplicate driver: a newer socket announces the same driver name"
            }
            Reason::NoHandler => "no handler for its plugin type",
            Reason::HandlerRefused => "refused by its handler",
            Reason::SocketPermissions => "the socket's mode and owner refuse the agent's connect",
            Reason::KubeletNeverConnected => "kubelet never connected",
            Reason::RegistrationFailed => "registration failed",
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

/// A running kubelet and the registration directory its plugin manager watches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kubelet {
    pub pid: u32,
    /// `<root-dir>/plugins_registry`.
    pub plugins_registry: PathBuf,
    /// Where the root directory was read: `--root-dir`, the `--config` file's `rootDir`, or
    /// kubelet's default.
    pub root_dir_from: &'static str,
}

/// What the node says, beside the agent's tables (see the module docs).
pub struct Circumstances {
    /// Observe mode: kubelet, not the agent, registers plugins.
    pub observe: bool,
    /// The event source reports first contacts (eBPF).
    pub sees_contacts: bool,
    kubelets: Mutex<Option<(std::time::Instant, Arc<Vec<Kubelet>>)>>,
    read_kubelets: Box<dyn Fn() -> Vec<Kubelet> + Send + Sync>,
}

impl std::fmt::Debug for Circumstances {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Circumstances")
            .field("observe", &self.observe)
            .field("sees_contacts", &self.sees_contacts)
            .finish_non_exhaustive()
    }
}

impl Default for Circumstances {
    /// Register mode, no contacts seen, no kubelet.
    fn default() -> Self {
        Circumstances::new(false, false, Vec::new)
    }
}

impl Circumstances {
    /// `read_kubelets` finds the node's running kubelets (the agent reads `/proc`).
    pub fn new(
        observe: bool,
        sees_contacts: bool,
        read_kubelets: impl Fn() -> Vec<Kubelet> + Send + Sync + 'static,
    ) -> Self {
        Circumstances {
            observe,
            sees_contacts,
            kubelets: Mutex::new(None),
            read_kubelets: Box::new(read_kubelets),
        }
    }

    /// The running kubelets, read at most every [`KUBELETS_FOR`] (`fresh`: now).
    pub fn kubelets(&self, fresh: bool) -> Arc<Vec<Kubelet>> {
        let mut cached = self.kubelets.lock().unwrap_or_else(|p| p.into_inner());
        match &*cached {
            Some((at, kubelets)) if !fresh && at.elapsed() < KUBELETS_FOR => kubelets.clone(),
            _ => {
                let kubelets = Arc::new((self.read_kubelets)());
                *cached = Some((std::time::Instant::now(), kubelets.clone()));
                kubelets
            }
        }
    }

    /// Whether a kubelet runs and none watches the directory `path` is in (observe mode only:
    /// in register mode the agent is the one that registers).
    pub fn outside_kubelets(&self, path: &Path) -> bool {
        if !self.observe {
            return false;
        }
        let kubelets = self.kubelets(false);
        !kubelets.is_empty()
            && !kubelets
                .iter()
                .any(|k| path.starts_with(&k.plugins_registry))
    }
}

/// Another socket announcing the same plugin type and name.
#[derive(Debug, Clone)]
pub struct Duplicate {
    pub path: PathBuf,
    pub registered_at: SystemTime,
    /// It was registered after this one: kubelet 1.33+ uses it.
    pub newer: bool,
}

/// The other sockets registered (or observed) with `registered`'s type and name, each said
/// newer or older (by registration time, then path).
/// `others` are those sockets, with when each was registered (`ActualState::others_named`).
pub fn duplicates(
    path: &Path,
    registered: &RegisteredPlugin,
    others: Vec<(PathBuf, SystemTime)>,
) -> Vec<Duplicate> {
    let mine = (registered.registered_at, path);
    others
        .into_iter()
        .map(|(other, registered_at)| Duplicate {
            newer: (registered_at, other.as_path()) > mine,
            registered_at,
            path: other,
        })
        .collect()
}

/// What kubelet would refuse in a plugin's GetInfo answer: a type it has no handler for, an
/// empty name, no supported version it speaks for the type (CSI: a version 1.x; device plugins:
/// `v1beta1`; DRA: the `v1beta1.DRAPlugin` or `v1.DRAPlugin` service).
pub fn kubelet_refusal(plugin: &Plugin) -> Option<String> {
    let versions = &plugin.supported_versions;
    let speaks = |ok: &dyn Fn(&str) -> bool| versions.iter().any(|v| ok(v));
    let spoken = match plugin.plugin_type.as_str() {
        "CSIPlugin" => speaks(&|v| {
            let v = v.strip_prefix('v').unwrap_or(v);
            v.split('.').next() == Some("1")
        }),
        "DevicePlugin" => speaks(&|v| v == "v1beta1"),
        "DRAPlugin" => speaks(&|v| v == "v1beta1.DRAPlugin" || v == "v1.DRAPlugin"),
        other => {
            return Some(format!(
                "unknown plugin type {other:?}: kubelet handles CSIPlugin, DevicePlugin and DRAPlugin"
            ));
        }
    };
    if plugin.name.is_empty() {
        return Some("empty name".into());
    }
    (!spoken).then(|| {
        format!(
            "none of the supported versions {versions:?} is one kubelet speaks for {}",
            plugin.plugin_type
        )
    })
}

/// What the verdict is derived from: a socket's entries and its state (`view`'s `PluginStatus`).
#[derive(Debug, Clone, Copy)]
pub struct Seen<'a> {
    pub path: &'a Path,
    pub state: PluginState,
    pub desired: Option<&'a DesiredPlugin>,
    pub registered: Option<&'a RegisteredPlugin>,
    pub backoff: Option<&'a Backoff>,
}

/// The verdict on the socket `status` describes (see the module docs for the rows);
/// `duplicates` are the other sockets with its plugin's name, when it has one.
pub fn derive(
    status: &Seen<'_>,
    circumstances: &Circumstances,
    duplicates: &[Duplicate],
) -> Reason {
    use std::os::unix::ffi::OsStrExt;
    if status.path.as_os_str().as_bytes().len() > SUN_PATH_MAX {
        return Reason::PathTooLong;
    }
    let kind = status.backoff.map(|b| &b.kind);
    match status.state {
        PluginState::Deregistering => return Reason::Deregistering,
        PluginState::Rejected => return Reason::RejectedByPolicy,
        _ if circumstances.outside_kubelets(status.path) => return Reason::OutsideKubeletDir,
        PluginState::Unserved if stopped_after_contact(status, circumstances) => {
            return Reason::StoppedAfterKubeletContact;
        }
        PluginState::Unserved => return Reason::ServedByNobody,
        PluginState::Registered | PluginState::Observed => {}
        PluginState::Pending | PluginState::BackingOff => {
            return match kind {
                Some(kind) if kind.is_waiting() => Reason::Pending,
                Some(kind) => failed(kind),
                None => Reason::Pending,
            };
        }
    }
    described(status, circumstances, duplicates)
}

/// The reason of a failure of `kind`.
fn failed(kind: &FailureKind) -> Reason {
    match kind {
        FailureKind::WaitingForHandler { .. } => Reason::NoHandler,
        FailureKind::InvalidInfo => Reason::InvalidInfo,
        FailureKind::PermissionDenied => Reason::SocketPermissions,
        FailureKind::HandlerRefused => Reason::HandlerRefused,
        _ => Reason::RegistrationFailed,
    }
}

/// The reason of a registered or observed socket.
fn described(status: &Seen<'_>, circumstances: &Circumstances, duplicates: &[Duplicate]) -> Reason {
    let observe = circumstances.observe;
    if let Some(registered) = status.registered
        && observe
        && !registered.plugin.plugin_type.is_empty()
        && kubelet_refusal(&registered.plugin).is_some()
    {
        return Reason::InvalidInfo;
    }
    if duplicates.iter().any(|d| d.newer) {
        return Reason::DuplicateDriver;
    }
    let never_contacted = status.desired.is_some_and(|d| {
        d.by_event
            && d.first_contact.is_none()
            && d.seen_at.elapsed().is_ok_and(|age| age >= KUBELET_EXPECTED)
    });
    if observe && circumstances.sees_contacts && never_contacted {
        return Reason::KubeletNeverConnected;
    }
    match status.state {
        PluginState::Observed => Reason::Observed,
        _ => Reason::Registered,
    }
}

/// Observe mode: the socket stopped being served within [`STOPPED_AFTER_CONTACT`] of kubelet's
/// first contact.
fn stopped_after_contact(status: &Seen<'_>, circumstances: &Circumstances) -> bool {
    let contact = status.desired.and_then(|d| d.first_contact.as_ref());
    let since = status.backoff.and_then(|b| match b.kind {
        FailureKind::Unserved { since, .. } => Some(since),
        _ => None,
    });
    let (Some(contact), Some(since), true) = (contact, since, circumstances.observe) else {
        return false;
    };
    let ago = tokio::time::Instant::now().saturating_duration_since(since);
    let stopped_at = SystemTime::now() - ago;
    // The contact's wall time is reckoned on its receipt: a second's slack either way.
    let slack = Duration::from_secs(1);
    stopped_at + slack >= contact.at && stopped_at <= contact.at + STOPPED_AFTER_CONTACT + slack
}

/// What `explain` found at a path the agent does not know (never desired nor registered).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unseen {
    pub exists: bool,
    pub is_socket: bool,
    pub fits: bool,
    pub under_watched_dir: bool,
    /// One connect's answer; `None` when none was tried.
    pub listens: Option<bool>,
}

/// The verdict on a path the agent does not know, from what `explain` found there.
pub fn unseen(found: Unseen) -> Reason {
    if !found.fits {
        Reason::PathTooLong
    } else if !found.exists {
        Reason::NotFound
    } else if !found.is_socket {
        Reason::NotASocket
    } else if !found.under_watched_dir {
        Reason::OutsideWatchedDir
    } else if found.listens == Some(false) {
        Reason::ServedByNobody
    } else {
        // A socket the agent has not looked at yet (it was just made).
        Reason::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::SocketId;
    use crate::state::view::StateView;
    use std::sync::Arc;
    use tokio::time::Instant;

    fn socket() -> SocketId {
        SocketId {
            dev: 1,
            ino: 2,
            birth_ns: None,
            handle: None,
        }
    }

    fn plugin(plugin_type: &str, name: &str, versions: &[&str]) -> Plugin {
        Plugin {
            plugin_type: plugin_type.into(),
            name: name.into(),
            endpoint: String::new(),
            supported_versions: versions.iter().map(|v| v.to_string()).collect(),
            socket_path: String::new(),
        }
    }

    fn view(circumstances: Circumstances) -> StateView {
        StateView {
            desired: Arc::default(),
            actual: Arc::default(),
            backoff: Arc::default(),
            circumstances: Arc::new(circumstances),
        }
    }

    fn reason_of(view: &StateView, path: &Path) -> Reason {
        view.status(path, Instant::now()).reason
    }

    #[test]
    fn every_failure_class_has_its_reason_and_a_path_of_108_bytes_is_too_long_first() {
        let view = view(Circumstances::default());
        let cases = [
            (FailureKind::InvalidInfo, Reason::InvalidInfo),
            (FailureKind::PermissionDenied, Reason::SocketPermissions),
            (FailureKind::HandlerRefused, Reason::HandlerRefused),
            (
                FailureKind::WaitingForHandler {
                    plugin_type: "CSIPlugin".into(),
                },
                Reason::NoHandler,
            ),
            (FailureKind::Other, Reason::RegistrationFailed),
        ];
        for (i, (kind, reason)) in cases.into_iter().enumerate() {
            let path = PathBuf::from(format!("/r/{i}.sock"));
            view.desired
                .add_or_update(&path, socket(), None)
                .expect("desired");
            view.backoff
                .fail(&path, socket(), "x".into(), kind, Instant::now());
            assert_eq!(reason_of(&view, &path), reason, "{}", path.display());
        }
        let long = PathBuf::from(format!("/r/{}.sock", "d".repeat(100)));
        assert_eq!(long.as_os_str().len(), 108);
        view.desired
            .add_or_update(&long, socket(), None)
            .expect("desired");
        view.backoff.fail(
            &long,
            socket(),
            "x".into(),
            FailureKind::Other,
            Instant::now(),
        );
        assert_eq!(reason_of(&view, &long), Reason::PathTooLong);
        let fits = PathBuf::from(format!("/r/{}.sock", "d".repeat(99)));
        view.desired
            .add_or_update(&fits, socket(), None)
            .expect("desired");
        assert_eq!(reason_of(&view, &fits), Reason::Pending);
    }

    #[test]
    fn the_older_of_two_sockets_with_one_driver_name_is_the_duplicate() {
        let view = view(Circumstances::default());
        let handler: Arc<dyn crate::handler::PluginHandler> =
            Arc::new(crate::handler::accept_all::AcceptAll);
        let (old, new) = (Path::new("/r/old.sock"), Path::new("/r/new.sock"));
        for path in [old, new] {
            view.desired
                .add_or_update(path, socket(), None)
                .expect("desired");
            let desired = view.desired.get(path).expect("desired");
            view.actual.add(
                desired.path.clone(),
                desired.generation,
                socket(),
                plugin("CSIPlugin", "csi.example.com", &["1.0.0"]),
                handler.clone(),
                crate::provenance::Provenance::default(),
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(reason_of(&view, old), Reason::DuplicateDriver);
        assert_eq!(reason_of(&view, new), Reason::Registered);
        // Another type with the same name is another driver.
        let other = Path::new("/r/other.sock");
        view.desired
            .add_or_update(other, socket(), None)
            .expect("desired");
        let desired = view.desired.get(other).expect("desired");
        view.actual.add(
            desired.path.clone(),
            desired.generation,
            socket(),
            plugin("DevicePlugin", "csi.example.com", &["v1beta1"]),
            handler,
            crate::provenance::Provenance::default(),
        );
        assert_eq!(reason_of(&view, other), Reason::Registered);
    }

    #[test]
    fn kubelet_refuses_unknown_types_empty_names_and_versions_it_does_not_speak() {
        assert_eq!(kubelet_refusal(&plugin("CSIPlugin", "a", &["1.0.0"])), None);
        assert_eq!(
            kubelet_refusal(&plugin("CSIPlugin", "a", &["v1.2.0"])),
            None
        );
        assert!(kubelet_refusal(&plugin("CSIPlugin", "a", &["0.3.0", "2.0.0"])).is_some());
        assert_eq!(
            kubelet_refusal(&plugin("DevicePlugin", "a", &["v1beta1"])),
            None
        );
        assert_eq!(
            kubelet_refusal(&plugin("DRAPlugin", "a", &["v1.DRAPlugin"])),
            None
        );
        assert!(kubelet_refusal(&plugin("DRAPlugin", "a", &["1.0.0"])).is_some());
        assert!(kubelet_refusal(&plugin("FooPlugin", "a", &["1.0.0"])).is_some());
        assert!(kubelet_refusal(&plugin("CSIPlugin", "", &["1.0.0"])).is_some());
    }

    #[test]
    fn a_kubelet_watching_elsewhere_matters_only_in_observe_mode() {
        let elsewhere = || {
            vec![Kubelet {
                pid: 42,
                plugins_registry: PathBuf::from("/srv/kubelet/plugins_registry"),
                root_dir_from: "--root-dir",
            }]
        };
        let path = Path::new("/var/lib/kubelet/plugins_registry/a.sock");
        for (observe, reason) in [(true, Reason::OutsideKubeletDir), (false, Reason::Pending)] {
            let view = view(Circumstances::new(observe, false, elsewhere));
            view.desired
                .add_or_update(path, socket(), None)
                .expect("desired");
            assert_eq!(reason_of(&view, path), reason, "observe: {observe}");
        }
        let none = view(Circumstances::new(true, false, Vec::new));
        none.desired
            .add_or_update(path, socket(), None)
            .expect("desired");
        assert_eq!(
            reason_of(&none, path),
            Reason::Pending,
            "no kubelet: cannot tell"
        );
    }

    #[test]
    fn an_unseen_path_is_judged_by_length_existence_type_place_then_listening() {
        let all = Unseen {
            exists: true,
            is_socket: true,
            fits: true,
            under_watched_dir: true,
            listens: Some(true),
        };
        assert_eq!(unseen(all), Reason::Pending);
        assert_eq!(
            unseen(Unseen {
                listens: Some(false),
                ..all
            }),
            Reason::ServedByNobody
        );
        assert_eq!(
            unseen(Unseen {
                under_watched_dir: false,
                ..all
            }),
            Reason::OutsideWatchedDir
        );
        assert_eq!(
            unseen(Unseen {
                is_socket: false,
                ..all
            }),
            Reason::NotASocket
        );
        assert_eq!(
            unseen(Unseen {
                exists: false,
                ..all
            }),
            Reason::NotFound
        );
        assert_eq!(
            unseen(Unseen {
                fits: false,
                exists: false,
                ..all
            }),
            Reason::PathTooLong
        );
        assert!(Reason::ALL.iter().filter(|r| r.is_problem()).count() == 15);
    }
}
