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

mod batched;
mod btf;
mod filters;
mod fnv;
mod hooks;
mod layout;
mod load_child;
mod loader;
mod mapping;
mod name_holders;
mod pin_guard;
mod pin_owners;
mod pins;
mod reader;
mod record;
mod ring;
mod stats;
mod tracefs;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agent_ebpf::{DirKey, names};
use anyhow::Context;
use aya::maps::{Array, HashMap as BpfHashMap, MapData};
use ring::Ring;
use tokio::sync::mpsc::Sender;
use tokio_util::sync::CancellationToken;

pub use self::btf::{KernelBtf, Member, resolve_offsets};
use self::filters::{Capacities, Filters};
pub use self::hooks::{HOOKS_ENV, HookChoice, HookFamily};
pub use self::layout::{
    CHILD_ARG as KERNEL_LAYOUT_CHILD_ARG, child_main as kernel_layout_child_main,
};
pub use self::load_child::{CHILD_ARG as LOAD_CHILD_ARG, child_main as load_child_main};
use self::loader::LoadParams;
pub use self::loader::LoadTimings;
use self::reader::Reader;
use self::stats::{DeliveryStats, LossCounters, RingOccupancy};
use crate::event_source::{Entry, EventSource, FsEvent, SourceKind, SourceStats, WatchedDir};

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

/// One hook family loaded and attached on its own, then detached: `plugin-agent probe`'s report
/// of what this kernel's verifier accepts.
pub struct FamilyProbe {
    pub family: HookFamily,
    /// Where the load's time went, or why the family does not load here.
    pub result: Result<LoadTimings, String>,
}

/// Loads and attaches `family`'s programs with the default sizes, in this process, and detaches
/// them again.
pub fn probe_family(family: HookFamily) -> FamilyProbe {
    let params = load_params(&EbpfOptions::default(), HookChoice::Only(family), true);
    // Dropping what was loaded detaches it.
    let result = loader::load(&params)
        .map(|loaded| loaded.timings)
        .map_err(|e| format!("{e:#}"));
    FamilyProbe { family, result }
}

/// What a load of the programs is sized and tuned with (`layout_here`: see [`LoadParams`]).
fn load_params(options: &EbpfOptions, hooks: HookChoice, layout_here: bool) -> LoadParams {
    LoadParams {
        ring_buffer_bytes: options.ring_buffer_bytes,
        wakeup_bytes: u64::from(options.ring_buffer_bytes / 8),
        batch_delay: options.batch_delay,
        watched_capacity: options.watched_capacity,
        names_capacity: options.names_capacity,
        hooks,
        layout_here,
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
}

/// Loads and attaches the kernel programs and starts the reader task, which sends into `sink` until
/// `cancel` fires. Must be called inside a tokio runtime.
///
/// Fails, in operator terms, when the agent was built without the kernel object, the kernel has no
/// BTF or an unsupported layout, or the agent lacks the privileges (CAP_BPF, CAP_PERFMON, and
/// CAP_SYS_ADMIN if tracefs has to be mounted); the caller then falls back to another source.
pub fn open(
    sink: Sender<FsEvent>,
    cancel: CancellationToken,
    options: EbpfOptions,
) -> anyhow::Result<EbpfSource> {
    options.validate()?;
    let runtime = tokio::runtime::Handle::try_current()
        .context("the eBPF event source must be opened inside the tokio runtime")?;
    let hooks = match options.hooks {
        Some(choice) => choice,
        None => HookChoice::from_env()?,
    };
    let params = load_params(&options, hooks, false);
    let identity = identity(&params);
    let pin_dir = options.pins.as_ref().map(PinOwner::dir);
    if let Some(owner) = &options.pins {
        let orphans = pin_owners::remove_orphans(owner);
        if !orphans.is_empty() {
            tracing::info!(removed = ?orphans, "removed pinned eBPF programs nobody will use again (trees gone, earlier runs of this instance)");
        }
    }
    if let Some((adopted, how)) = adopt_or_load_child(&params, &options, &pin_dir, &identity)? {
        return start_adopted(adopted, how, sink, cancel, &options, &runtime);
    }
    open_loaded(
        &params, &options, pin_dir, &identity, sink, cancel, &runtime,
    )
}

/// The pinned set to carry on with: a previous agent's, or one the load child loads and pins
/// now; none when there is nothing to adopt (not pinned, or the child could not pin), and the
/// agent loads the programs itself. Fails when the child found the programs do not load.
fn adopt_or_load_child(
    params: &LoadParams,
    options: &EbpfOptions,
    pin_dir: &Option<PathBuf>,
    identity: &Option<pins::Identity>,
) -> anyhow::Result<Option<(pins::Adopted, Adoption)>> {
    if let (Some(dir), Some(identity)) = (pin_dir, identity) {
        match pins::adopt(dir, identity) {
            Ok(Some(adopted)) => return Ok(Some((adopted, Adoption::Restart))),
            Ok(None) => {}
            Err(e) => tracing::warn!(
                pins = %dir.display(), error = format!("{e:#}"),
                "cannot adopt the pinned eBPF programs: loading them anew"
            ),
        }
    }
    if let (Some(dir), Some(identity), Some(owner)) = (pin_dir, identity, &options.pins) {
        match load_child::load_and_pin(params, owner) {
            Ok(load_child::Outcome::Pinned { selection, timings }) => {
                match pins::adopt(dir, identity) {
                    Ok(Some(adopted)) => {
                        let how = Adoption::LoadedByChild { selection, timings };
                        return Ok(Some((adopted, how)));
                    }
                    Ok(None) => tracing::warn!(
                        pins = %dir.display(),
                        "the programs the load child pinned are not there: loading them in the agent"
                    ),
                    Err(e) => tracing::warn!(
                        pins = %dir.display(), error = format!("{e:#}"),
                        "cannot adopt the programs the load child pinned: loading them in the agent"
                    ),
                }
            }
            Ok(load_child::Outcome::LoadFailed(error)) => anyhow::bail!("{error}"),
            Ok(load_child::Outcome::NotPinned(error)) => tracing::warn!(
                pins = %dir.display(), %error,
                "the load child could not pin the eBPF programs: loading them in the agent"
            ),
            Err(e) => tracing::debug!(
                error = format!("{e:#}"),
                "the eBPF load child did not run: loading the programs in the agent"
            ),
        }
    }
    Ok(None)
}

/// Loads the programs in the agent and starts the source over them, pinned when the options
/// say so and pinning works.
fn open_loaded(
    params: &LoadParams,
    options: &EbpfOptions,
    pin_dir: Option<PathBuf>,
    identity: &Option<pins::Identity>,
    sink: Sender<FsEvent>,
    cancel: CancellationToken,
    runtime: &tokio::runtime::Handle,
) -> anyhow::Result<EbpfSource> {
    let mut loaded = loader::load(params)?;
    // Parsing the kernel's BTF for fentry/fexit targets takes tens of MiB for a moment; glibc
    // would keep them mapped for the agent's life.
    crate::memory::trim();
    let held = pin_or_reload(&mut loaded, params, options, &pin_dir, identity)?;
    let pinned = held.is_some();
    let pins = pin_dir
        .as_deref()
        .filter(|_| pinned)
        .map(|dir| dir.display().to_string());
    let object = loader::object_hash().unwrap_or_default();
    tracing::info!(timings = %loaded.timings, pinned, pins, object, "eBPF programs loaded");
    let maps = loaded_maps(&mut loaded.ebpf)?;
    let description = describe_loaded(&loaded, options, pin_dir.as_deref().filter(|_| pinned));
    // Pinned links keep the programs attached: the object (instructions, relocations, the
    // programs' own file descriptors) is not needed any more.
    let ebpf = (!pinned).then_some(loaded.ebpf);
    start(
        maps,
        Started {
            family: loaded.hooks.family,
            fentry: loaded.hooks.fentry(),
            description,
            timings: loaded.timings,
            ebpf,
            held: held.zip(pin_dir),
        },
        sink,
        cancel,
        options,
        runtime,
    )
}

/// Pins what was loaded as the tree's new set and holds it, when the options say so; when that
/// fails, loads the programs again, unpinned.
fn pin_or_reload(
    loaded: &mut loader::Loaded,
    params: &LoadParams,
    options: &EbpfOptions,
    pin_dir: &Option<PathBuf>,
    identity: &Option<pins::Identity>,
) -> anyhow::Result<Option<pin_guard::Held>> {
    Ok(match (pin_dir, identity, &options.pins) {
        (Some(dir), Some(identity), Some(owner)) => {
            match pin_loaded(loaded, dir, identity, owner)
                .and_then(|set| pin_guard::Held::open(&set))
            {
                Ok(held) => Some(held),
                Err(e) => {
                    // Links taken out and not pinned are gone: load again, unpinned.
                    tracing::warn!(
                        pins = %dir.display(), error = format!("{e:#}"),
                        "cannot pin the eBPF programs: running unpinned (a restart loads them again)"
                    );
                    *loaded = loader::load(params)?;
                    None
                }
            }
        }
        _ => None,
    })
}

/// Takes the maps the source reads and steers out of a loaded object.
fn loaded_maps(ebpf: &mut aya::Ebpf) -> anyhow::Result<Maps> {
    let agent = pins::set_agent(take_map(ebpf, names::AGENT)?)?;
    Ok(Maps {
        agent,
        watched: take_map(ebpf, names::WATCHED)?,
        names: take_map(ebpf, names::NAMES)?,
        ring: Ring::from_map(
            ebpf.take_map(names::EVENTS)
                .context("the eBPF object has no map EVENTS")?,
        )?,
        losses: take_map(ebpf, names::LOSSES)?,
    })
}

/// What a load in the agent says of itself: "eBPF <hooks>: <attached> (<ring, batch>[; mounted
/// tracefs][; pinned in <dir>])"; `pinned_in`: the pin directory, when pinned.
fn describe_loaded(
    loaded: &loader::Loaded,
    options: &EbpfOptions,
    pinned_in: Option<&std::path::Path>,
) -> String {
    format!(
        "eBPF {}: {} (ring buffer {} KiB, batch delay {:?}{}{})",
        loaded.hooks,
        loaded.attached.join(", "),
        options.ring_buffer_bytes / 1024,
        options.batch_delay,
        if loaded.mounted_tracefs {
            "; mounted tracefs"
        } else {
            ""
        },
        match pinned_in {
            Some(dir) => format!("; pinned in {}", dir.display()),
            None => String::new(),
        }
    )
}

/// The maps the source reads and steers.
struct Maps {
    agent: Array<MapData, u32>,
    watched: BpfHashMap<MapData, DirKey, u8>,
    names: name_holders::NameTable,
    ring: Ring,
    losses: Array<MapData, u64>,
}

/// Runs this executable (`/proc/self/exe`: the running binary, even after an upgrade replaced
/// the file) with `args` as one of the loader's short-lived children (`what` names it in errors),
/// and returns its stdout once it exited 0.
fn run_child<S: AsRef<std::ffi::OsStr>>(
    what: &str,
    args: impl IntoIterator<Item = S>,
) -> anyhow::Result<Vec<u8>> {
    let output = std::process::Command::new("/proc/self/exe")
        .args(args)
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .with_context(|| format!("cannot run the {what} child"))?;
    if !output.status.success() {
        anyhow::bail!("the {what} child exited with {}", output.status);
    }
    Ok(output.stdout)
}

/// The settings a pinned set was loaded with, part of its identity: a set loaded with others is
/// not adopted.
fn identity_settings(params: &LoadParams) -> String {
    format!(
        "ring={} wakeup={} batch_ns={} watched={} names={} hooks={:?}",
        params.ring_buffer_bytes,
        params.wakeup_bytes,
        params.batch_delay.as_nanos(),
        params.watched_capacity,
        params.names_capacity,
        params.hooks,
    )
}

/// The identity of the set this agent's object loads with `params`; none without an object.
fn identity(params: &LoadParams) -> Option<pins::Identity> {
    loader::object_hash().map(|hash| pins::Identity::new(hash, identity_settings(params)))
}

/// How pinned programs came to be adopted.
enum Adoption {
    /// A previous agent pinned them.
    Restart,
    /// This agent's load child loaded and pinned them just now (see `load_child`).
    LoadedByChild { selection: String, timings: String },
}

/// What the load (or the adoption) says about the programs.
struct Started {
    family: HookFamily,
    /// What became of fentry/fexit, for the kernel's feature report.
    fentry: crate::kernel::FentryFinding,
    description: String,
    timings: LoadTimings,
    ebpf: Option<aya::Ebpf>,
    /// The pinned set's objects and its tree's pin directory, for `pin_guard`.
    held: Option<(pin_guard::Held, PathBuf)>,
}

/// Takes the links out of `loaded` and pins them with its maps as the tree's new set; returns
/// the set's directory.
fn pin_loaded(
    loaded: &mut loader::Loaded,
    dir: &std::path::Path,
    identity: &pins::Identity,
    owner: &PinOwner,
) -> anyhow::Result<PathBuf> {
    let links = loader::take_links(&mut loaded.ebpf, std::mem::take(&mut loaded.links))?;
    let family = match loaded.hooks.family {
        HookFamily::Fentry => "fentry",
        HookFamily::Tracepoints => "tracepoints",
    };
    let mut meta = pins::Meta::new(identity, owner, family, loaded.attached.clone());
    meta.load_ms = u64::try_from(loaded.timings.total().as_millis()).unwrap_or(u64::MAX);
    pins::pin(&mut loaded.ebpf, links, dir, &meta)
}

/// Carries on with the programs a previous agent pinned: no BTF, no verifier; what they wrote
/// while no agent ran is in the ring, and the reader drains it first.
fn start_adopted(
    adopted: pins::Adopted,
    how: Adoption,
    sink: Sender<FsEvent>,
    cancel: CancellationToken,
    options: &EbpfOptions,
    runtime: &tokio::runtime::Handle,
) -> anyhow::Result<EbpfSource> {
    let backlog = RingOccupancy::new(&adopted.events)
        .map(|ring| ring.used_bytes())
        .unwrap_or(0);
    let family = match adopted.meta.family.as_str() {
        "fentry" => HookFamily::Fentry,
        _ => HookFamily::Tracepoints,
    };
    let timings = LoadTimings {
        adopted: Some(adopted.opened_in),
        ..LoadTimings::default()
    };
    let tree_dir = options.pins.as_ref().map(PinOwner::dir).unwrap_or_default();
    let fentry = match &how {
        Adoption::LoadedByChild { selection, .. } => hooks::fentry_finding(family, selection),
        Adoption::Restart => hooks::fentry_finding(family, ""),
    };
    let (hooks, how) = announce_adoption(&adopted, &how, family, &tree_dir, backlog);
    // The same shape as a load's description: "eBPF <hooks>: <attached> (<ring, batch>; <how>)".
    let description = format!(
        "eBPF {hooks}: {} (ring buffer {} KiB, batch delay {:?}{how})",
        adopted.meta.attached.join(", "),
        options.ring_buffer_bytes / 1024,
        options.batch_delay,
    );
    // What the previous agent watched and named is redone by this agent's first walk (watch,
    // then read; announce, then look): entries for directories gone since would only fill the
    // maps.
    let mut adopted = adopted;
    batched::empty(&mut adopted.watched);
    batched::empty(&mut adopted.names);
    let maps = Maps {
        agent: adopted.agent,
        watched: adopted.watched,
        names: adopted.names,
        ring: adopted.events,
        losses: adopted.losses,
    };
    start(
        maps,
        Started {
            family,
            fentry,
            description,
            timings,
            ebpf: None,
            held: Some((adopted.held, tree_dir)),
        },
        sink,
        cancel,
        options,
        runtime,
    )
}

/// Logs how the pinned programs came to be adopted; returns what the description says of their
/// hooks and of how they were loaded.
fn announce_adoption(
    adopted: &pins::Adopted,
    how: &Adoption,
    family: HookFamily,
    tree_dir: &std::path::Path,
    backlog: u64,
) -> (String, String) {
    let pins = tree_dir.display().to_string();
    // Which object runs (its hash, as pins are matched by): an operator tells builds apart by it.
    let object = loader::object_hash().unwrap_or_default();
    match how {
        Adoption::Restart => {
            tracing::info!(
                pins,
                object,
                opened_in = ?adopted.opened_in,
                saved_load_ms = adopted.meta.load_ms,
                backlog_bytes = backlog,
                "adopted the pinned eBPF programs: no load, nothing detached while no agent ran"
            );
            (format!("{family} (adopted)"), String::new())
        }
        Adoption::LoadedByChild { selection, timings } => {
            tracing::info!(
                timings,
                pinned = true,
                pins,
                object,
                loaded_in = "a child process",
                "eBPF programs loaded"
            );
            (
                selection.clone(),
                format!("; loaded in a child process, pinned in {pins}"),
            )
        }
    }
}

/// Builds the source over `maps` and starts its reader.
fn start(
    maps: Maps,
    started: Started,
    sink: Sender<FsEvent>,
    cancel: CancellationToken,
    options: &EbpfOptions,
    runtime: &tokio::runtime::Handle,
) -> anyhow::Result<EbpfSource> {
    let losses = Arc::new(LossCounters::new(&maps.losses)?);
    let ring_occupancy = RingOccupancy::new(&maps.ring)?;
    let filters = Arc::new(Filters::new(
        maps.watched,
        maps.names,
        maps.agent,
        Capacities {
            watched: options.watched_capacity,
            names: options.names_capacity,
        },
    ));
    let stop_reader = cancel.child_token();
    let stats = DeliveryStats {
        losses: Arc::clone(&losses),
        ring: ring_occupancy,
        ring_buffer_bytes: options.ring_buffer_bytes,
    };
    let problems = Arc::new(crate::event_source::ProblemReport::default());
    let pins_restored = started.held.map(|(held, tree_dir)| {
        let restored = Arc::new(AtomicU64::new(0));
        runtime.spawn(pin_guard::guard(
            held,
            tree_dir,
            Arc::clone(&problems),
            Arc::clone(&restored),
            stop_reader.clone(),
        ));
        restored
    });
    runtime.spawn(
        Reader {
            ring: maps.ring,
            losses,
            filters: Arc::clone(&filters),
            sink,
            cancel: stop_reader.clone(),
            batch_delay: options.batch_delay,
        }
        .run(),
    );
    Ok(EbpfSource {
        filters,
        family: started.family,
        fentry: started.fentry,
        description: started.description,
        stats,
        timings: started.timings,
        _ebpf: Mutex::new(started.ebpf),
        problems,
        pins_restored,
        stop_reader,
    })
}

pub use pin_owners::{
    Cleanup as PinCleanup, remove_all as remove_all_pins, remove_own as remove_own_pins,
};
pub use pins::Owner as PinOwner;

fn take_map<T>(ebpf: &mut aya::Ebpf, name: &str) -> anyhow::Result<T>
where
    T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf
        .take_map(name)
        .with_context(|| format!("the eBPF object has no map {name}"))?;
    T::try_from(map).with_context(|| format!("eBPF map {name} has an unexpected type"))
}

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
