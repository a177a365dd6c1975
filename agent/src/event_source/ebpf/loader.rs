//! Loads the kernel programs with this kernel's offsets and attaches them to their hooks.
//!
//! ```text
//! embedded object + layout (kernel BTF, read in a child process) + EbpfOptions
//!   --EbpfLoader (CONFIG, map sizes)--> Ebpf
//!   --hooks::select: fentry/fexit on vfs_{mknod,mkdir,unlink,rmdir,rename}: their exit checks
//!                    (tracepoints), the fexits, the fentries (FEntry/FExit load+attach, in that order)
//!                    else tracefs::ensure_mounted + TracePoint load/attach on syscalls/sys_{enter,exit}_*
//! ```
//!
//! Failures are reported in operator terms: which hook, what the kernel said, what to grant.

use std::io;
use std::time::{Duration, Instant};

use agent_ebpf::{Config, SyscallNumbers, VfsArgs, names};
use anyhow::{Context, bail};
use aya::programs::fentry::FEntryLinkId;
use aya::programs::fexit::FExitLinkId;
use aya::programs::links::FdLink;
use aya::programs::trace_point::TracePointLinkId;
use aya::programs::{FEntry, FExit, ProgramError, TracePoint};
use aya::{Ebpf, EbpfLoader};

use super::clones;
use super::hook_table::{
    CLOSE_HOOKS, CONNECT_HOOKS, FUNCTION_HOOKS, IN_FLIGHT_CHECK, LISTEN_HOOKS,
    OPTIONAL_TRACEPOINTS, SHUTDOWN_HOOKS, TRACEPOINT_HOOKS, TracepointHook,
};
use super::hooks::{self, HookChoice, HookFamily, Selection};
use super::layout::{self, KernelLayout};
use super::tracefs;

/// The kernel object, when this agent was built with it (`cargo xtask build`).
#[cfg(ebpf_object)]
static OBJECT: Option<&[u8]> = Some(aya::include_bytes_aligned!(env!(
    "PLUGIN_AGENT_EBPF_OBJ_PATH"
)));
#[cfg(not(ebpf_object))]
static OBJECT: Option<&[u8]> = None;

/// The object's FNV-1a hash, computed by the build script: telling the object apart from the one
/// a set of pins was loaded from reads none of its 200 KiB, so an agent that adopts its pins
/// (after a restart, or from its load child) never has them resident.
#[cfg(ebpf_object)]
static OBJECT_HASH: Option<&str> = Some(env!("PLUGIN_AGENT_EBPF_OBJ_FNV"));
#[cfg(not(ebpf_object))]
static OBJECT_HASH: Option<&str> = None;

/// This architecture's path syscall numbers, from the agent's own libc (same architecture as the
/// kernel it runs on). The legacy single-path syscalls exist on x86_64 only.
fn syscall_numbers() -> SyscallNumbers {
    let nr = |n: libc::c_long| i32::try_from(n).unwrap_or(-1);
    #[cfg(target_arch = "x86_64")]
    let (unlink, rmdir, mknod, mkdir, rename) = (
        nr(libc::SYS_unlink),
        nr(libc::SYS_rmdir),
        nr(libc::SYS_mknod),
        nr(libc::SYS_mkdir),
        nr(libc::SYS_rename),
    );
    #[cfg(not(target_arch = "x86_64"))]
    let (unlink, rmdir, mknod, mkdir, rename) = (-1, -1, -1, -1, -1);
    SyscallNumbers {
        unlink,
        rmdir,
        unlinkat: nr(libc::SYS_unlinkat),
        mknod,
        mknodat: nr(libc::SYS_mknodat),
        mkdir,
        mkdirat: nr(libc::SYS_mkdirat),
        rename,
        renameat: nr(libc::SYS_renameat),
        renameat2: nr(libc::SYS_renameat2),
    }
}

/// Whether this architecture has the syscall a `sys_{enter,exit}_<syscall>` tracepoint is named
/// after. arm64 has only the `*at` forms of `unlink`, `rmdir`, `mknod`, `mkdir` and `rename`, so the
/// kernel creates no tracepoint for the others, and attaching to one would fail the whole family.
fn arch_has_tracepoint(tracepoint: &str) -> bool {
    let numbers = syscall_numbers();
    let syscall = tracepoint
        .strip_prefix("sys_enter_")
        .or_else(|| tracepoint.strip_prefix("sys_exit_"))
        .unwrap_or(tracepoint);
    let nr = match syscall {
        "unlink" => numbers.unlink,
        "rmdir" => numbers.rmdir,
        "mknod" => numbers.mknod,
        "mkdir" => numbers.mkdir,
        "rename" => numbers.rename,
        // bind and the `*at` forms exist on every architecture the agent builds for.
        _ => 0,
    };
    nr >= 0
}

/// Threads the fentry family follows at once (`names::IN_FLIGHT`): an LRU that keeps every
/// thread that made a traced call, so its entry is evicted only after this many other threads
/// made calls since; ~5 MiB of kernel memory, preallocated. Where fentry is not tried, one entry.
const IN_FLIGHT_ENTRIES: u32 = 65_536;

/// What [`load`] sizes and tunes.
pub struct LoadParams {
    /// Ring buffer size in bytes (a power of two, multiple of the page size).
    pub ring_buffer_bytes: u32,
    /// Wake the reader when this many bytes are queued.
    pub wakeup_bytes: u64,
    /// Longest an event waits for a reader wake-up during a burst.
    pub batch_delay: Duration,
    /// Capacity of the watched-directory map.
    pub watched_capacity: u32,
    /// Capacity of the name map.
    pub names_capacity: u32,
    /// Which hook families may be used.
    pub hooks: HookChoice,
    /// Read the kernel layout in this process: true in the load child, which is short-lived
    /// already (its peak counts nowhere); in the agent, a layout child reads it.
    pub layout_here: bool,
}

/// The loaded object with its programs attached.
pub struct Loaded {
    /// Owns the programs and their links: dropping it detaches everything (unless the links
    /// were taken out with [`take_links`] and pinned).
    pub ebpf: Ebpf,
    /// The links of the attached programs, for [`take_links`].
    pub links: Vec<LinkId>,
    /// `category/name` of every attached tracepoint, for [`describe`](super::EbpfSource).
    pub attached: Vec<String>,
    /// Whether the loader had to mount tracefs.
    pub mounted_tracefs: bool,
    /// Where the load time went.
    pub timings: LoadTimings,
    /// The hook family in use and why preferred ones were passed over.
    pub hooks: Selection,
}

/// Where the time of one load went: every agent start (and every test that starts one) pays it,
/// and most of it is the kernel verifier walking the programs' bounded loops.
#[derive(Debug, Clone, Default)]
pub struct LoadTimings {
    /// Reading and parsing `/sys/kernel/btf/vmlinux` and resolving the offsets (userspace).
    pub btf: Duration,
    /// Parsing the object and creating its maps.
    pub object: Duration,
    /// Each program: name, time in `BPF_PROG_LOAD` (the verifier), instructions it verified.
    pub programs: Vec<(String, Duration, Option<u32>)>,
    /// Attaching to the hooks (including tracefs lookups).
    pub attach: Duration,
    /// Set when a previous agent's pinned programs were adopted instead: the time to find and
    /// open them (nothing else was spent).
    pub adopted: Option<Duration>,
}

impl LoadTimings {
    /// Total time spent in the verifier.
    pub fn verifier(&self) -> Duration {
        self.programs.iter().map(|(_, took, _)| *took).sum()
    }

    /// Everything together.
    pub fn total(&self) -> Duration {
        self.btf + self.object + self.verifier() + self.attach + self.adopted.unwrap_or_default()
    }
}

impl std::fmt::Display for LoadTimings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(adopted) = self.adopted {
            return write!(
                f,
                "adopted pinned programs in {adopted:?} (no BTF, no verifier)"
            );
        }
        write!(
            f,
            "total {:?}: BTF {:?}, object {:?}, verifier {:?}, attach {:?} (",
            self.total(),
            self.btf,
            self.object,
            self.verifier(),
            self.attach
        )?;
        for (i, (name, took, insns)) in self.programs.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            match insns {
                Some(insns) => write!(f, "{sep}{name} {took:?}/{insns} insns")?,
                None => write!(f, "{sep}{name} {took:?}")?,
            }
        }
        f.write_str(")")
    }
}

/// Loads and attaches the kernel programs, or says in operator terms why it cannot.
pub fn load(params: &LoadParams) -> anyhow::Result<Loaded> {
    let Some(object) = OBJECT else {
        bail!(
            "this plugin-agent was built without the eBPF event source (build with `cargo xtask build`)"
        );
    };
    let mut timings = LoadTimings::default();
    let started = Instant::now();
    let KernelLayout {
        offsets,
        vfs,
        fentry_refused,
    } = if params.layout_here {
        layout::resolve_here(params.hooks == HookChoice::Auto)?
    } else {
        layout::resolve(params.hooks == HookChoice::Auto)?
    };
    timings.btf = started.elapsed();
    let started = Instant::now();
    let fentry_tried =
        fentry_refused.is_none() && params.hooks != HookChoice::Only(HookFamily::Tracepoints);
    let mut ebpf = load_object(object, params, offsets, &vfs, fentry_tried)?;
    timings.object = started.elapsed();

    let mut mounted_tracefs = false;
    let mut links = Vec::new();
    let (selection, attached) = hooks::select(
        &mut ebpf,
        params.hooks,
        |ebpf, family| match family {
            HookFamily::Fentry => match &fentry_refused {
                Some(reason) => bail!("{reason}"),
                None => {
                    mounted_tracefs |= tracefs::ensure_mounted()?;
                    attach_functions(ebpf, &vfs, &mut timings, &mut links)
                }
            },
            HookFamily::Tracepoints => {
                mounted_tracefs |= tracefs::ensure_mounted()?;
                attach_tracepoints(ebpf, TRACEPOINT_HOOKS, &mut timings, &mut links)
            }
        },
        |ebpf, family| {
            if family == HookFamily::Fentry {
                detach_functions(ebpf);
            }
        },
    )?;
    // Links of a family that was passed over are gone with its programs.
    links.retain(|link| link.family() == selection.family);
    let mut attached = attached;
    mounted_tracefs |= tracefs::ensure_mounted()?;
    attach_sockets(
        &mut ebpf,
        selection.family,
        &mut attached,
        &mut timings,
        &mut links,
    )?;
    Ok(Loaded {
        ebpf,
        links,
        attached,
        mounted_tracefs,
        timings,
        hooks: selection,
    })
}

/// Loads the object with `params`' sizes and the kernel's layout in its CONFIG; attaches nothing.
fn load_object(
    object: &[u8],
    params: &LoadParams,
    offsets: agent_ebpf::KernelOffsets,
    vfs: &Result<VfsArgs, String>,
    fentry_tried: bool,
) -> anyhow::Result<Ebpf> {
    let config = Config {
        offsets,
        wakeup_bytes: params.wakeup_bytes,
        batch_ns: u64::try_from(params.batch_delay.as_nanos()).unwrap_or(u64::MAX),
        syscalls: syscall_numbers(),
        vfs: vfs.clone().unwrap_or_default(),
        ..Config::UNSET
    };
    // A loss counter per possible CPU and reason (see `stats::LossCounters`).
    let possible_cpus = aya::util::nr_cpus().map_err(|(file, err)| {
        anyhow::anyhow!("cannot read the possible CPUs from {file}: {err}")
    })?;
    let loss_slots = u32::try_from(possible_cpus)
        .ok()
        .and_then(|cpus| cpus.checked_mul(agent_ebpf::loss::COUNT))
        .context("too many possible CPUs for the loss counters")?;
    // No kernel BTF for aya's relocations: the object has none (offsets come from the layout
    // above, into CONFIG). `EbpfLoader::new()` has parsed vmlinux's BTF all the same (aya 0.14
    // has no constructor that does not; ~17 MiB for a moment, trimmed after the load); it is
    // dropped here. The fentry/fexit loads parse their own when that family is tried.
    let ebpf = EbpfLoader::new()
        .btf(None)
        .override_global(names::CONFIG, &config, true)
        .map_max_entries(names::EVENTS, params.ring_buffer_bytes)
        .map_max_entries(names::WATCHED, params.watched_capacity)
        .map_max_entries(names::NAMES, params.names_capacity)
        .map_max_entries(names::LOSSES, loss_slots)
        .map_max_entries(
            names::IN_FLIGHT,
            if fentry_tried { IN_FLIGHT_ENTRIES } else { 1 },
        )
        .load(object)
        .map_err(|err| with_hint(anyhow::Error::new(err), "cannot load the eBPF object"))?;
    Ok(ebpf)
}

/// Attaches the socket tracepoints both families use (listen, connect, and shutdown with
/// fentry or close with the tracepoints), adding their names to `attached`.
fn attach_sockets(
    ebpf: &mut Ebpf,
    family: HookFamily,
    attached: &mut Vec<String>,
    timings: &mut LoadTimings,
    links: &mut Vec<LinkId>,
) -> anyhow::Result<()> {
    let sockets = LISTEN_HOOKS.iter().chain(CONNECT_HOOKS);
    let sockets = match family {
        HookFamily::Fentry => sockets.chain(SHUTDOWN_HOOKS).collect::<Vec<_>>(),
        HookFamily::Tracepoints => sockets.chain(CLOSE_HOOKS).collect(),
    };
    for hook in sockets {
        attached.extend(attach_tracepoints(
            ebpf,
            std::slice::from_ref(hook),
            timings,
            links,
        )?);
    }
    Ok(())
}

/// Loads and attaches the fentry/fexit programs; fails at the first the kernel refuses.
fn attach_functions(
    ebpf: &mut Ebpf,
    vfs: &Result<VfsArgs, String>,
    timings: &mut LoadTimings,
    links: &mut Vec<LinkId>,
) -> anyhow::Result<Vec<String>> {
    if let Err(reason) = vfs {
        bail!(
            "the VFS functions' signatures on this kernel are not the ones the programs know: {reason}"
        );
    }
    let functions: Vec<&str> = FUNCTION_HOOKS.iter().map(|hook| hook.function).collect();
    if let Some(split) = clones::split_functions(&functions) {
        bail!("{split}");
    }
    // aya's own BTF view, which fentry/fexit loads resolve their target functions in.
    let btf = aya::Btf::from_sys_fs().context("no kernel BTF for fentry/fexit targets")?;
    // The exit checks first (see `FUNCTION_HOOKS` for the order); `attached` lists them last.
    let checks = attach_tracepoints(ebpf, std::slice::from_ref(&IN_FLIGHT_CHECK), timings, links)?;
    let mut attached = Vec::new();
    for hook in FUNCTION_HOOKS {
        let started = Instant::now();
        let program = ebpf
            .program_mut(hook.program)
            .with_context(|| format!("the eBPF object has no program {}", hook.program))?;
        let refused = |err| hooks::btf_program_error(hook.program, hook.function, err);
        let insns = if hook.exit {
            let program: &mut FExit = program
                .try_into()
                .with_context(|| format!("eBPF program {} is not fexit", hook.program))?;
            program.load(hook.function, &btf).map_err(refused)?;
            let link = program.attach().map_err(|err| {
                with_hint(
                    anyhow::Error::new(err),
                    &format!("cannot attach fexit {}", hook.function),
                )
            })?;
            links.push(LinkId::FExit(hook.program, link));
            program
                .info()
                .ok()
                .and_then(|i| i.verified_instruction_count())
        } else {
            let program: &mut FEntry = program
                .try_into()
                .with_context(|| format!("eBPF program {} is not fentry", hook.program))?;
            program.load(hook.function, &btf).map_err(refused)?;
            let link = program.attach().map_err(|err| {
                with_hint(
                    anyhow::Error::new(err),
                    &format!("cannot attach fentry {}", hook.function),
                )
            })?;
            links.push(LinkId::FEntry(hook.program, link));
            program
                .info()
                .ok()
                .and_then(|i| i.verified_instruction_count())
        };
        timings
            .programs
            .push((hook.program.to_string(), started.elapsed(), insns));
        let kind = if hook.exit { "fexit" } else { "fentry" };
        attached.push(format!("{kind} {}", hook.function));
    }
    attached.extend(checks);
    Ok(attached)
}

/// Unloads (and so detaches) whatever of the fentry/fexit family got loaded.
fn detach_functions(ebpf: &mut Ebpf) {
    if let Some(Ok(check)) = ebpf
        .program_mut(IN_FLIGHT_CHECK.program)
        .map(<&mut TracePoint>::try_from)
    {
        let _ = check.unload();
    }
    for hook in FUNCTION_HOOKS {
        let Some(program) = ebpf.program_mut(hook.program) else {
            continue;
        };
        // A program that never loaded has nothing to unload; errors here change nothing.
        if hook.exit {
            if let Ok(program) = <&mut FExit>::try_from(program) {
                let _ = program.unload();
            }
        } else if let Ok(program) = <&mut FEntry>::try_from(program) {
            let _ = program.unload();
        }
    }
}

/// Loads the tracepoint programs of `hooks` and attaches each to its syscall tracepoints.
fn attach_tracepoints(
    ebpf: &mut Ebpf,
    hooks: &[TracepointHook],
    timings: &mut LoadTimings,
    links: &mut Vec<LinkId>,
) -> anyhow::Result<Vec<String>> {
    let mut attached = Vec::new();
    for hook in hooks {
        let program: &mut TracePoint = ebpf
            .program_mut(hook.program)
            .with_context(|| format!("the eBPF object has no program {}", hook.program))?
            .try_into()
            .with_context(|| format!("eBPF program {} is not a tracepoint", hook.program))?;
        let started = Instant::now();
        program
            .load()
            .map_err(|err| load_error(hook.program, err))?;
        let insns = program
            .info()
            .ok()
            .and_then(|info| info.verified_instruction_count());
        timings
            .programs
            .push((hook.program.to_string(), started.elapsed(), insns));
        let started = Instant::now();
        for tracepoint in hook.tracepoints.iter().filter(|tracepoint| {
            arch_has_tracepoint(tracepoint)
                && (!OPTIONAL_TRACEPOINTS.contains(tracepoint)
                    || tracefs::has_event("syscalls", tracepoint))
        }) {
            let link = program.attach("syscalls", tracepoint).map_err(|err| {
                with_hint(
                    anyhow::Error::new(err),
                    &format!("cannot attach tracepoint syscalls/{tracepoint}"),
                )
            })?;
            links.push(LinkId::TracePoint(hook.program, link));
            let hook = format!("tracepoint syscalls/{tracepoint}");
            if !attached.contains(&hook) {
                attached.push(hook);
            }
        }
        timings.attach += started.elapsed();
    }
    Ok(attached)
}

/// One attachment of a program, to take out of the object as a pinnable link.
pub enum LinkId {
    TracePoint(&'static str, TracePointLinkId),
    FEntry(&'static str, FEntryLinkId),
    FExit(&'static str, FExitLinkId),
}

impl LinkId {
    /// The family the link belongs to: the fentry family's exit checks are tracepoints.
    fn family(&self) -> HookFamily {
        match self {
            LinkId::TracePoint(program, _) if *program == IN_FLIGHT_CHECK.program => {
                HookFamily::Fentry
            }
            LinkId::TracePoint(..) => HookFamily::Tracepoints,
            LinkId::FEntry(..) | LinkId::FExit(..) => HookFamily::Fentry,
        }
    }
}

/// Takes the attached links out of their programs as file-descriptor links, named for their
/// pins (`link-<program>-<n>`): held (or pinned) by the caller, they keep the programs attached
/// after the object is dropped.
pub fn take_links(ebpf: &mut Ebpf, links: Vec<LinkId>) -> anyhow::Result<Vec<(String, FdLink)>> {
    links
        .into_iter()
        .enumerate()
        .map(|(i, link)| {
            let (program, fd_link) = match link {
                LinkId::TracePoint(program, id) => {
                    let p: &mut TracePoint = program_of(ebpf, program)?.try_into()?;
                    (program, FdLink::try_from(p.take_link(id)?)?)
                }
                LinkId::FEntry(program, id) => {
                    let p: &mut FEntry = program_of(ebpf, program)?.try_into()?;
                    (program, FdLink::from(p.take_link(id)?))
                }
                LinkId::FExit(program, id) => {
                    let p: &mut FExit = program_of(ebpf, program)?.try_into()?;
                    (program, FdLink::from(p.take_link(id)?))
                }
            };
            Ok((format!("link-{program}-{i}"), fd_link))
        })
        .collect()
}

fn program_of<'a>(
    ebpf: &'a mut Ebpf,
    name: &str,
) -> anyhow::Result<&'a mut aya::programs::Program> {
    ebpf.program_mut(name)
        .with_context(|| format!("the eBPF object has no program {name}"))
}

/// The embedded kernel object's hash (see [`OBJECT_HASH`]).
pub fn object_hash() -> Option<&'static str> {
    OBJECT_HASH
}

/// A program the verifier refused: keep the end of its log, where the reason is.
fn load_error(program: &str, err: ProgramError) -> anyhow::Error {
    let what = format!("cannot load eBPF program {program}");
    match err {
        ProgramError::LoadError {
            io_error,
            verifier_log,
        } => {
            let log = verifier_log.to_string();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            let context = format!("{what}; verifier log ends with:\n{}", tail.join("\n"));
            if log.trim().is_empty() {
                with_hint(anyhow::Error::new(io_error), &context)
            } else {
                // The verifier ran and refused the program (EACCES): not a privilege problem.
                anyhow::Error::new(io_error).context(format!(
                    "{context}\nthe kernel's verifier rejected the program on this kernel"
                ))
            }
        }
        other => with_hint(anyhow::Error::new(other), &what),
    }
}

/// Adds `what` as context and, for a permission error, what the agent needs to be granted.
fn with_hint(err: anyhow::Error, what: &str) -> anyhow::Error {
    let errno = err
        .chain()
        .find_map(|cause| cause.downcast_ref::<io::Error>())
        .and_then(io::Error::raw_os_error);
    match errno {
        Some(libc::EPERM) | Some(libc::EACCES) => {
            use crate::kernel::permission_refusal;
            use caps::Capability::{CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN};
            let why = permission_refusal("bpf(2)", &[CAP_BPF, CAP_PERFMON], Some(CAP_SYS_ADMIN));
            err.context(format!("{what}: {why}"))
        }
        _ => err.context(what.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tracepoint_is_attached_where_the_architecture_has_its_syscall() {
        let all: Vec<&str> = TRACEPOINT_HOOKS
            .iter()
            .flat_map(|hook| hook.tracepoints.iter().copied())
            .collect();
        let skipped: Vec<&str> = all
            .iter()
            .copied()
            .filter(|tracepoint| !arch_has_tracepoint(tracepoint))
            .collect();
        let only_at_forms = [
            "sys_enter_unlink",
            "sys_enter_rmdir",
            "sys_enter_mknod",
            "sys_enter_mkdir",
            "sys_enter_rename",
            "sys_exit_unlink",
            "sys_exit_rmdir",
            "sys_exit_mknod",
            "sys_exit_mkdir",
            "sys_exit_rename",
        ];
        if cfg!(target_arch = "x86_64") {
            assert_eq!(skipped, Vec::<&str>::new());
        } else {
            let mut skipped = skipped;
            skipped.sort_unstable();
            skipped.dedup();
            let mut expected = only_at_forms.to_vec();
            expected.sort_unstable();
            assert_eq!(skipped, expected);
        }
        for tracepoint in ["sys_enter_bind", "sys_exit_unlinkat", "sys_enter_renameat2"] {
            assert!(arch_has_tracepoint(tracepoint), "{tracepoint}");
        }
    }

    /// The build script hashes the object file it embeds; the identity pins are matched by must
    /// be that of the bytes the agent loads.
    #[test]
    fn the_build_s_hash_is_that_of_the_embedded_object() {
        let (Some(object), Some(hash)) = (OBJECT, object_hash()) else {
            assert!(OBJECT.is_none() && object_hash().is_none());
            eprintln!("built without the eBPF object: nothing to check");
            return;
        };
        assert_eq!(hash, format!("{:016x}", super::super::fnv::fnv1a(object)));
    }

    /// `cargo xtask build-ebpf` removes the DWARF bpf-linker made the BTF from; the BTF stays
    /// (the verifier's function and line info). Section names are in the object's string tables.
    #[test]
    fn the_embedded_object_keeps_its_btf_and_carries_no_dwarf() {
        let Some(object) = OBJECT else {
            eprintln!("built without the eBPF object: nothing to check");
            return;
        };
        let has = |name: &[u8]| object.windows(name.len()).any(|w| w == name);
        assert!(
            has(b".BTF.ext\0") && has(b".BTF\0"),
            "the object lost its BTF"
        );
        for dwarf in [
            &b".debug_info"[..],
            b".debug_loc",
            b".debug_line",
            b".debug_str",
        ] {
            assert!(
                !has(dwarf),
                "{} is embedded",
                String::from_utf8_lossy(dwarf)
            );
        }
    }
}
