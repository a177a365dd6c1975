//! What every event source shares with the watcher and with each other: the [`EventSource`]
//! trait, the events it sends ([`FsEvent`]), the directories it watches ([`WatchedDir`]) and what
//! it reports of itself. Its own file so that the sources (`ebpf`, `fanotify`, `inotify`) import
//! it without importing the room's `mod.rs`, which opens them.

use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};

/// Which kernel interface feeds the watcher.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SourceKind {
    /// BPF programs on syscall tracepoints (or fentry/LSM where allowed) feeding a ring buffer.
    Ebpf,
    /// fanotify with `FAN_REPORT_DFID_NAME` directory-entry events.
    Fanotify,
    /// inotify, one watch per directory (what kubelet uses).
    Inotify,
}

impl SourceKind {
    /// Preference order for `--source auto`: the first that opens wins.
    pub const PREFERENCE: [SourceKind; 3] =
        [SourceKind::Ebpf, SourceKind::Fanotify, SourceKind::Inotify];

    /// Whether the source reports who first connects to a socket ([`FsEvent::Contacted`]): only
    /// the kernel's programs see a `connect`.
    pub fn reports_contacts(self) -> bool {
        self == SourceKind::Ebpf
    }

    /// Whether the source reports a socket's `listen` (liveness's kernel hints): only the
    /// kernel's programs see it.
    pub fn reports_listens(self) -> bool {
        self == SourceKind::Ebpf
    }

    /// The lowercase name used on the command line, in logs and in metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            SourceKind::Ebpf => "ebpf",
            SourceKind::Fanotify => "fanotify",
            SourceKind::Inotify => "inotify",
        }
    }
}

impl fmt::Display for SourceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// When the kernel saw the change (for latency measurement; absent for sources without
/// timestamps), and who made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Observed {
    /// `CLOCK_MONOTONIC` nanoseconds at the kernel event (`bpf_ktime_get_ns`).
    pub kernel_ns: Option<u64>,
    /// `CLOCK_MONOTONIC` nanoseconds when the source's reader took the event off the kernel's
    /// queue (eBPF), so latency splits into kernel -> reader and reader -> consumer.
    pub read_ns: Option<u64>,
    /// Who made the change, as the source recorded it then (eBPF: pid, uid, gid, command,
    /// cgroup; fanotify: the pid; inotify: nobody): the socket's creator (see `provenance`).
    pub by: Option<crate::provenance::Actor>,
}

/// `CLOCK_MONOTONIC` now, in nanoseconds: the clock `bpf_ktime_get_ns` reads, so kernel event
/// timestamps and userspace receipt can be subtracted.
pub fn monotonic_now_ns() -> u64 {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|ts| ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64);
    now.unwrap_or(0)
}

/// A hint that something under the watched tree changed. See the module docs for the promise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FsEvent {
    /// An entry may have appeared at `path`: a socket bound or created, something moved in, a
    /// directory created. The watcher stats it to learn what it is.
    Created { path: PathBuf, observed: Observed },
    /// The entry at `path` may have gone: unlinked, moved out, a directory removed.
    Removed { path: PathBuf, observed: Observed },
    /// An entry called `name` changed in a watched directory the source could not pin down (a
    /// path resolved in another mount namespace, say): the watcher checks `name` in every watched
    /// directory.
    ///
    /// `parent`, when the source knows it, is the name of the directory the path named as the
    /// entry's parent (`b` in `/a/b/name`): the entry is then in a watched directory of that name
    /// if it is in the tree at all.
    NameChanged {
        name: OsString,
        parent: Option<OsString>,
        observed: Observed,
    },
    /// Events may have been lost; the watcher walks the whole tree and converges on it. `reason`
    /// says what was lost, for operators (it becomes [`RescanReason::EventLoss`]).
    Rescan { reason: String },
    /// (eBPF only) The socket at `path` started listening (`listening`), or a descriptor of its
    /// listener was closed: a hint about whether something serves it, for `liveness`. Loss of
    /// these costs only their speed: a server's exit is also learned from its pidfd.
    Serving {
        path: PathBuf,
        listening: bool,
        observed: Observed,
    },
    /// (eBPF only) A process other than the agent connected to the socket at `path`, for the
    /// first time since it was bound (the kernel reports each socket instance once): the plugin's
    /// first contact, kubelet's first `GetInfo` when the agent observes beside it. `observed.by`
    /// is the process that connected, `observed.kernel_ns` when its `connect` returned.
    Contacted { path: PathBuf, observed: Observed },
}

/// Why the watcher walks the whole tree. Counted by class in metrics and status (loss apart from
/// the routine walks), and published with the rescan event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RescanReason {
    /// The agent started (or its source restarted the watcher).
    Start,
    /// The reconciler's slow safety pass asked for it; nothing was lost.
    Periodic,
    /// The root directory itself was removed; it was re-created.
    RootRemoved,
    /// A file system was mounted or unmounted at or under the root (see `watcher::mounts`).
    MountsChanged,
    /// The event source lost events or stopped (an [`FsEvent::Rescan`]); the text says how.
    EventLoss(String),
}

impl RescanReason {
    /// The bounded class, for metric labels: `start`, `periodic`, `root_removed`,
    /// `mounts_changed`, `event_loss`.
    pub fn class(&self) -> &'static str {
        match self {
            RescanReason::Start => "start",
            RescanReason::Periodic => "periodic",
            RescanReason::RootRemoved => "root_removed",
            RescanReason::MountsChanged => "mounts_changed",
            RescanReason::EventLoss(_) => "event_loss",
        }
    }

    /// Whether events were lost (rescans for any other reason are routine).
    pub fn is_loss(&self) -> bool {
        matches!(self, RescanReason::EventLoss(_))
    }
}

impl std::fmt::Display for RescanReason {
    /// The wording operators have always seen in logs and in the rescan event's detail.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RescanReason::Start => f.write_str("start"),
            RescanReason::Periodic => f.write_str("periodic safety pass"),
            RescanReason::RootRemoved => f.write_str("the root directory was removed"),
            RescanReason::MountsChanged => {
                f.write_str("a file system was mounted or unmounted in the plugin directory")
            }
            RescanReason::EventLoss(what) => f.write_str(what),
        }
    }
}

/// A directory the watcher wants events for, with the identity sources filter by.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct WatchedDir {
    /// Path in the agent's mount namespace.
    pub path: PathBuf,
    /// `st_dev` as userspace sees it (`makedev` encoding, not the kernel's `s_dev`).
    pub dev: u64,
    /// `st_ino`.
    pub ino: u64,
}

impl WatchedDir {
    /// Stats `path` (following no symlink) and returns its identity if it is a directory.
    pub fn stat(path: &Path) -> std::io::Result<Self> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::symlink_metadata(path)?;
        if !meta.is_dir() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotADirectory,
                format!("{} is not a directory", path.display()),
            ));
        }
        Ok(WatchedDir {
            path: path.to_path_buf(),
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }
}

/// A source of [`FsEvent`]s for a set of directories that the watcher grows and shrinks.
///
/// Contract:
/// - [`watch`](Self::watch) takes effect before it returns, so the watcher can watch a directory and
///   then walk it without a window in which a new entry goes unseen (watch-then-walk).
/// - Events for a directory may still arrive after [`unwatch`](Self::unwatch); the watcher ignores
///   paths outside its tree.
/// - Events describe changes made by other processes; the agent's own filesystem activity (creating
///   the root directory, say) is not reported back.
/// - Loss is never silent: see [`FsEvent::Rescan`].
///
/// The reader task a source spawns stops when the agent's cancellation token fires.
pub trait EventSource: Send + Sync {
    /// Which interface this is.
    fn kind(&self) -> SourceKind;

    /// Operator-facing summary of what is attached (hooks, marks, queue sizes), logged at start.
    fn describe(&self) -> String;

    /// What this source found out about the kernel's fentry/fexit (eBPF only).
    fn fentry(&self) -> crate::kernel::FentryFinding {
        crate::kernel::FentryFinding::NotTried
    }

    /// Start reporting changes directly inside `dir` (not recursively: the watcher calls this for
    /// every directory of the tree).
    fn watch(&self, dir: &WatchedDir) -> anyhow::Result<()>;

    /// Stop reporting changes inside `dir` (it was removed or left the tree).
    fn unwatch(&self, dir: &WatchedDir);

    /// The watcher found an entry of type `entry` called `name` inside `dir`. Sources that
    /// filter removals by name in the kernel use this; others ignore it. Calling it again for the
    /// same entry changes nothing.
    ///
    /// Returns true when the source did not know the name in `dir` before this call: a removal
    /// of the entry by a multi-component path made before it may not have been reported, so the
    /// caller must look at the entry after this call (announce, then look: the same order as
    /// watch, then walk), and withdraw the name ([`entry_absent`](Self::entry_absent)) when the
    /// look finds no such entry. False: nothing to look at again, and nothing to withdraw.
    fn entry_present(&self, _dir: &WatchedDir, _name: &std::ffi::OsStr, _entry: Entry) -> bool {
        false
    }

    /// [`entry_present`](Self::entry_present) for the sockets `names` a walk found in `dir`, at
    /// once (a source with a kernel table updates it in one call, not one per name). Returns,
    /// name by name, whether the source did not know it in `dir`.
    fn sockets_present(&self, dir: &WatchedDir, names: &[&std::ffi::OsStr]) -> Vec<bool> {
        names
            .iter()
            .map(|name| self.entry_present(dir, name, Entry::Socket))
            .collect()
    }

    /// The entry called `name` inside `dir` is gone (removed, or its directory left the tree).
    /// A source that keeps a name table drops the name once no entry carries it, so the table
    /// holds what is in the tree and not every name that ever passed through it.
    fn entry_absent(&self, _dir: &WatchedDir, _name: &std::ffi::OsStr) {}

    /// The source's own counters, read when metrics are scraped. Sources without a kernel-side
    /// buffer to report on keep the default (nothing dropped, no ring buffer).
    fn stats(&self) -> SourceStats {
        SourceStats::default()
    }

    /// Hands the source where to say that it cannot do part of its job (and when that ends), for
    /// status and /readyz. Sources that cannot break that way ignore it.
    fn report_problems_to(&self, _report: Box<dyn Fn(Option<String>) + Send + Sync>) {}

    /// How the source started, for status (its `open` is the opener's to time).
    fn start(&self) -> SourceStart {
        SourceStart {
            how: "opened",
            ..SourceStart::default()
        }
    }
}

/// How a source started, as status reports it: an operator reads after a restart or an upgrade
/// whether the eBPF programs were loaded or adopted, and what the kernel recorded meanwhile.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SourceStart {
    /// eBPF: `loaded` (in the agent), `loaded_in_child` (pinned by the load child and adopted)
    /// or `adopted` (a previous agent's pinned programs); `opened` for the other sources.
    pub how: &'static str,
    /// eBPF: the tree's pin directory, when the programs are pinned.
    pub pins: Option<PathBuf>,
    /// eBPF: the embedded kernel object's hash (pins are matched by it).
    pub object_hash: Option<String>,
    /// eBPF, adopted: bytes the kernel recorded in the ring while no agent ran.
    pub backlog_bytes: u64,
    /// What opening the source took (timed by `event_source::open`).
    pub open: std::time::Duration,
}

/// A source's current problem, told to whoever is connected (the agent connects once it has a
/// place to show problems; the source may have found one before that).
#[derive(Default)]
pub struct ProblemReport {
    inner: std::sync::Mutex<ProblemSink>,
}

#[derive(Default)]
struct ProblemSink {
    now: Option<String>,
    report: Option<Box<dyn Fn(Option<String>) + Send + Sync>>,
}

impl ProblemReport {
    /// The problem now (`None`: it ended).
    pub fn set(&self, problem: Option<String>) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(report) = &inner.report {
            report(problem.clone());
        }
        inner.now = problem;
    }

    /// Reports to `report` from now on, starting with the problem now.
    pub fn connect(&self, report: Box<dyn Fn(Option<String>) + Send + Sync>) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        report(inner.now.clone());
        inner.report = Some(report);
    }
}

/// What the watcher announces to [`EventSource::entry_present`]. Only a directory's name can be
/// the parent component of a path the kernel reports by name, so a source that names parents
/// (the eBPF tracepoints) keeps an id, and the memory for it, for directories only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    Socket,
    Directory,
}

/// What a source knows about its own delivery, for metrics (`plugin_agent_event_source_*`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SourceStats {
    /// Events the kernel side could not deliver since the source opened (BPF ring buffer
    /// reservations that failed, queue overflows); each one also leads to a rescan.
    pub dropped: u64,
    /// Size of the BPF ring buffer, for sources that have one.
    pub ring_buffer_size_bytes: Option<u64>,
    /// Bytes waiting in the BPF ring buffer now (producer minus consumer position).
    pub ring_buffer_used_bytes: Option<u64>,
    /// Times the source's pins were found removed or replaced and pinned again, for sources
    /// whose pins are guarded.
    pub pins_restored: Option<u64>,
    /// For sources with a kernel name table (eBPF): whether more sockets are in the tree than it
    /// keeps room for, so the names of the rest are left out.
    pub name_table_incomplete: Option<bool>,
}
