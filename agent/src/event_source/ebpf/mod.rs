//! The eBPF event source: kernel programs on VFS or syscall hooks, filtered in the kernel by the
//! watched directories, feeding a ring buffer (see agent-ebpf for the kernel side).
//!
//! ```text
//! open: layout (btf in a child process: offsets, VFS signatures) -> loader (load, hooks::select,
//!       attach) -> filters + reader task
//! kernel: bind, unlink, mkdir, rename... --WATCHED, NAMES--> EVENTS ring --reader--> FsEvent --> watcher
//!                                                       LOSSES ---reader--> FsEvent::Rescan
//! watcher --watch / unwatch / entry_present--> filters (BPF maps)
//! ```
//!
//! Two hook families, chosen at load (see `hooks`): fentry/fexit on `vfs_mknod`, `vfs_mkdir`,
//! `vfs_unlink`, `vfs_rmdir`, `vfs_rename` where the kernel allows them, which see every entry's
//! dentry and so report every call exactly by its parent's identity; else syscall tracepoints,
//! which report (only calls that succeeded):
//! - `bind` of an `AF_UNIX` socket to a path, by the socket's own dentry, so relative paths, chroots
//!   and other mount namespaces all land on the directory identity that is watched:
//!   [`FsEvent::Created`]; a socket in a sub-directory not yet watched (up to 8 levels down) reports
//!   that sub-directory instead, which the watcher then watches and walks;
//! - `unlink`, `unlinkat`, `rmdir`, `mknod(at)` of `S_IFSOCK`, `mkdir(at)`, `rename`, `renameat`,
//!   `renameat2` (incl. `RENAME_EXCHANGE`) with a single-component path relative to a watched
//!   directory (cwd or dirfd): [`FsEvent::Created`] / [`FsEvent::Removed`];
//! - the same calls by any other path (`/registration/x.sock` from a container): the path cannot be
//!   resolved in BPF, so names decide, all in the kernel, and the event is a
//!   [`FsEvent::NameChanged`] the watcher checks in every watched directory, or, when the path's
//!   parent component matched a name in the name table, only in the watched directories of that
//!   name (the kernel reports the table's id for it; see `filters`). A removal (or rename
//!   source) passes when its last component is a name present under the tree when the syscall
//!   returns (decided at exit: at entry it raced with the watcher announcing a name); a socket `mknod`
//!   always; a rename target when its name is known, when its source was in the tree, or when its
//!   parent component is a watched directory's name (a move in from anywhere to a new name);
//!   a `mkdir` when its parent component is a watched directory's name (`mkdir -p` trees are also
//!   caught by the bind walk above);
//! - any record the kernel could not queue: [`FsEvent::Rescan`].
//!
//! The agent's own process is filtered out in the kernel.
//!
//! [`FsEvent::Created`]: crate::event_source::FsEvent::Created
//! [`FsEvent::Removed`]: crate::event_source::FsEvent::Removed
//! [`FsEvent::NameChanged`]: crate::event_source::FsEvent::NameChanged
//! [`FsEvent::Rescan`]: crate::event_source::FsEvent::Rescan

mod adopt;
mod batched;
mod btf;
mod child;
mod clones;
mod filters;
mod fnv;
mod hook_table;
mod hooks;
mod layout;
mod load_child;
mod loader;
mod mapping;
mod name_holders;
mod open;
mod pin_guard;
mod pin_load;
mod pin_owners;
mod pins;
mod reader;
mod record;
mod ring;
mod stats;
mod tracefs;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

pub use self::btf::{KernelBtf, Member, resolve_offsets};
use self::filters::Filters;
pub use self::hooks::{HOOKS_ENV, HookChoice, HookFamily};
pub use self::layout::{
    CHILD_ARG as KERNEL_LAYOUT_CHILD_ARG, child_main as kernel_layout_child_main,
};
pub use self::load_child::{CHILD_ARG as LOAD_CHILD_ARG, child_main as load_child_main};
pub use self::loader::LoadTimings;
pub use self::open::{FamilyProbe, open, probe_family};
use self::stats::DeliveryStats;
use crate::event_source::{Entry, EventSource, SourceKind, SourceStats, WatchedDir};

/// Tuning of the eBPF source; [`Default`] suits a node with a few hundred plugins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EbpfOptions {
    /// Ring buffer size in bytes: a power of two and a multiple of the page size (default 2 MiB,
    /// about 6,900 records: over 70 ms of the fastest churn measured here). It absorbs bursts while
    /// the agent is busy; when it fills, events are lost and the source asks for a rescan. It
    /// counts twice in the agent's RSS: the kernel maps the data pages twice, back to back.
    pub ring_buffer_bytes: u32,
    /// Longest a record waits for a reader wake-up during a burst (default 2 ms). The first record
    /// after a quiet spell wakes the reader at once; later ones are collected in batches, which is
    /// what keeps the reader from waking per event under load.
    pub batch_delay: Duration,
    /// How many directories the tree may have (default 16384).
    pub watched_capacity: u32,
    /// How many distinct entry names the kernel remembers for matching removals (default 16384).
    pub names_capacity: u32,
    /// Which kernel hooks may be used; `None` (the default) reads [`HOOKS_ENV`], which defaults to
    /// [`HookChoice::Auto`] (fentry where the kernel allows it, else syscall tracepoints).
    pub hooks: Option<HookChoice>,
    /// The agent instance and watched tree whose programs and maps are pinned in bpffs (see
    /// `pins`), so the instance's next agent adopts them instead of loading; `None`: nothing
    /// outlives the agent.
    pub pins: Option<PinOwner>,
}

impl Default for EbpfOptions {
    fn default() -> Self {
        EbpfOptions {
            ring_buffer_bytes: 2 << 20,
            batch_delay: Duration::from_millis(2),
            watched_capacity: 16384,
            names_capacity: 16384,
            hooks: None,
            pins: None,
        }
    }
}

impl EbpfOptions {
    fn validate(&self) -> anyhow::Result<()> {
        let page = 4096;
        anyhow::ensure!(
            self.ring_buffer_bytes.is_power_of_two() && self.ring_buffer_bytes >= page,
            "eBPF ring buffer size {} is not a power of two of at least {page} bytes",
            self.ring_buffer_bytes
        );
        anyhow::ensure!(
            self.watched_capacity > 0 && self.names_capacity > 0,
            "eBPF map capacities must be positive"
        );
        Ok(())
    }
}

/// The running eBPF source. Dropping it detaches the programs and stops its reader.
pub struct EbpfSource {
    filters: Arc<Filters>,
    /// What the programs are attached to: the tracepoints match calls by name, fentry/fexit see
    /// every dentry and need no name table.
    family: HookFamily,
    fentry: crate::kernel::FentryFinding,
    description: String,
    /// Loss counters and ring occupancy, for [`EventSource::stats`].
    stats: DeliveryStats,
    /// Where the load time went.
    timings: LoadTimings,
    /// Owns the programs and their links when they are not pinned; kept for its `Drop`. Pinned
    /// (or adopted) programs need no object: their pinned links keep them attached, and
    /// `pin_guard` holds them while the agent runs.
    _ebpf: Mutex<Option<aya::Ebpf>>,
    /// What is wrong with the source now (its pins damaged), for status and /readyz.
    problems: Arc<crate::event_source::ProblemReport>,
    /// How many times the pins were found damaged and pinned again; none when not pinned.
    pins_restored: Option<Arc<AtomicU64>>,
    /// Stops the reader when the source is dropped before the agent's token fires.
    stop_reader: CancellationToken,
    /// How it started (loaded, or pins adopted), for status.
    start: crate::event_source::SourceStart,
}

pub use pin_owners::{
    Cleanup as PinCleanup, remove_all as remove_all_pins, remove_own as remove_own_pins,
};
pub use pins::Owner as PinOwner;

impl EbpfSource {
    /// Where this source's load time went (BTF, verifier per program, attach): every agent start
    /// pays it, so tests and benchmarks report it.
    pub fn load_timings(&self) -> &LoadTimings {
        &self.timings
    }

    /// The hook family the kernel allowed: it decides how exact the events are (fentry/fexit report
    /// every call by its directory's identity; the tracepoints report some calls by name only).
    pub fn hook_family(&self) -> HookFamily {
        self.family
    }
}

impl Drop for EbpfSource {
    fn drop(&mut self) {
        self.stop_reader.cancel();
    }
}

impl EventSource for EbpfSource {
    fn kind(&self) -> SourceKind {
        SourceKind::Ebpf
    }

    fn fentry(&self) -> crate::kernel::FentryFinding {
        self.fentry.clone()
    }

    fn start(&self) -> crate::event_source::SourceStart {
        self.start.clone()
    }

    /// What is attached and how it is tuned: fixed at open. (The watched-directory count is the
    /// watcher's, reported live by status and metrics; a count here would be frozen at open.)
    fn describe(&self) -> String {
        self.description.clone()
    }

    fn watch(&self, dir: &WatchedDir) -> anyhow::Result<()> {
        self.filters.watch(dir)
    }

    fn unwatch(&self, dir: &WatchedDir) {
        self.filters.unwatch(dir);
    }

    fn stats(&self) -> SourceStats {
        SourceStats {
            pins_restored: self
                .pins_restored
                .as_ref()
                .map(|restored| restored.load(Ordering::Relaxed)),
            name_table_incomplete: Some(self.filters.names_left_out()),
            ..self.stats.snapshot()
        }
    }

    fn report_problems_to(&self, report: Box<dyn Fn(Option<String>) + Send + Sync>) {
        self.problems.connect(report);
    }

    fn entry_present(&self, dir: &WatchedDir, name: &std::ffi::OsStr, entry: Entry) -> bool {
        if self.family != HookFamily::Tracepoints {
            return false;
        }
        match self.filters.remember_name(dir, name, entry) {
            Ok(new) => new,
            Err(filters::NamesFull) => {
                names_full(1);
                false
            }
        }
    }

    fn sockets_present(&self, dir: &WatchedDir, names: &[&std::ffi::OsStr]) -> Vec<bool> {
        if self.family != HookFamily::Tracepoints {
            return vec![false; names.len()];
        }
        match self.filters.remember_sockets(dir, names) {
            Ok(new) => new,
            Err(filters::NamesFull) => {
                names_full(names.len());
                vec![false; names.len()]
            }
        }
    }

    fn entry_absent(&self, dir: &WatchedDir, name: &std::ffi::OsStr) {
        if self.family == HookFamily::Tracepoints {
            self.filters.forget_name(dir, name);
        }
    }
}

/// `names` announced did not all fit the name table: the reader clears it and asks for a rescan,
/// which refills it.
fn names_full(names: usize) {
    tracing::warn!(names, "eBPF name table is full: clearing it and rescanning");
}
