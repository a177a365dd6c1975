//! Opening the eBPF source: adopting a pinned set (a previous agent's, or one the load child
//! pinned just now) or loading the programs in the agent, pinning them, and starting the reader
//! over their maps. Apart from `mod.rs`, which keeps the source's options and its
//! [`EventSource`](crate::event_source::EventSource) side.

use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use agent_ebpf::{DirKey, names};
use anyhow::Context;
use aya::maps::{Array, HashMap as BpfHashMap, MapData};
use tokio::sync::mpsc::Sender;
use tokio_util::sync::CancellationToken;

use super::filters::{Capacities, Filters};
use super::hooks::{self, HookChoice, HookFamily};
use super::loader::{self, LoadParams, LoadTimings};
use super::pin_load::{identity, pin_loaded};
use super::reader::Reader;
use super::ring::Ring;
use super::stats::{DeliveryStats, LossCounters, RingOccupancy};
use super::{
    EbpfOptions, EbpfSource, PinOwner, adopt, batched, load_child, name_holders, pin_guard,
    pin_owners, pins,
};
use crate::event_source::{FsEvent, SourceStart};

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
) -> anyhow::Result<Option<(adopt::Adopted, Adoption)>> {
    if let (Some(dir), Some(identity)) = (pin_dir, identity) {
        match adopt::adopt(dir, identity) {
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
                match adopt::adopt(dir, identity) {
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
    let source_start = SourceStart {
        how: "loaded",
        pins: pin_dir.clone().filter(|_| pinned),
        object_hash: Some(object.to_string()).filter(|hash| !hash.is_empty()),
        ..SourceStart::default()
    };
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
            start: source_start,
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
    /// How it started, for status.
    start: SourceStart,
}

/// Carries on with the programs a previous agent pinned: no BTF, no verifier; what they wrote
/// while no agent ran is in the ring, and the reader drains it first.
fn start_adopted(
    adopted: adopt::Adopted,
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
    let (hooks, how, source_start) = announce_adoption(&adopted, &how, family, &tree_dir, backlog);
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
            start: source_start,
        },
        sink,
        cancel,
        options,
        runtime,
    )
}

/// Logs how the pinned programs came to be adopted; returns what the description says of their
/// hooks and of how they were loaded, and what status says of the start.
fn announce_adoption(
    adopted: &adopt::Adopted,
    how: &Adoption,
    family: HookFamily,
    tree_dir: &std::path::Path,
    backlog: u64,
) -> (String, String, SourceStart) {
    let pins = tree_dir.display().to_string();
    // Which object runs (its hash, as pins are matched by): an operator tells builds apart by it.
    let object = loader::object_hash().unwrap_or_default();
    let start = SourceStart {
        how: match how {
            Adoption::Restart => "adopted",
            Adoption::LoadedByChild { .. } => "loaded_in_child",
        },
        pins: Some(tree_dir.to_path_buf()),
        object_hash: Some(object.to_string()).filter(|hash| !hash.is_empty()),
        backlog_bytes: backlog,
        ..SourceStart::default()
    };
    let (hooks, loaded) = match how {
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
    };
    (hooks, loaded, start)
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
        start: started.start,
    })
}

fn take_map<T>(ebpf: &mut aya::Ebpf, name: &str) -> anyhow::Result<T>
where
    T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf
        .take_map(name)
        .with_context(|| format!("the eBPF object has no map {name}"))?;
    T::try_from(map).with_context(|| format!("eBPF map {name} has an unexpected type"))
}
