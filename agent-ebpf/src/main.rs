//! plugin-agent's kernel programs: the first stage of the data flow (see lib.rs for the shared types).
//!
//! ```text
//! sys_enter_bind  --AF_UNIX, path--> PENDING_BINDS[thread] = fd
//! sys_exit_bind   --ret 0--> fd -> file -> socket -> unix_sock.path.dentry -> parent in WATCHED?
//!                        --> EVENTS (exact: parent identity + name); NAMES += name
//! sys_enter_{unlink,unlinkat,rmdir,mknod,mknodat,mkdir,mkdirat,rename,renameat,renameat2}
//!                      --> path "name" relative to a WATCHED dir: exact; "a/b/name": name in NAMES?
//!                      --> PENDING*[thread] = event
//! sys_exit_*           --ret 0--> EVENTS
//! ```
//!
//! Syscall tracepoints are used because they exist on every kernel and need no kernel symbol; the
//! price is that a path argument cannot be resolved in BPF. `bind` does not need it (the bound
//! socket's own dentry is reachable from its fd at exit); `unlink` does, so a single-component path
//! is located exactly by its start directory and any other path is matched by its last component
//! against the names present under the tree (the agent turns those into "check this name" hints).
//!
//! Every kernel struct member is read at an offset the agent resolved from the running kernel's BTF
//! and set in [`CONFIG`](agent_ebpf::Config): Rust eBPF has no CO-RE relocations. Every event that
//! cannot be recorded bumps a `LOSSES` counter, which the agent turns into a rescan.
#![cfg_attr(target_arch = "bpf", no_std, no_main)]

#[cfg(not(target_arch = "bpf"))]
fn main() {
    eprintln!("agent-ebpf is a kernel program: build it with `cargo xtask build-ebpf`");
}

#[cfg(target_arch = "bpf")]
mod programs {
    use core::ptr::{addr_of, addr_of_mut, read_volatile};

    use agent_ebpf::{Config, DirKey, Event, NAME_LEN, NameKey, PATH_BUF_LEN, kind, loss, scope};
    use aya_ebpf::helpers::{
        bpf_get_current_pid_tgid, bpf_get_current_task, bpf_ktime_get_ns, bpf_probe_read_kernel,
        bpf_probe_read_kernel_str_bytes, bpf_probe_read_user, bpf_probe_read_user_str_bytes,
    };
    use aya_ebpf::macros::{map, tracepoint};
    use aya_ebpf::maps::{Array, HashMap, PerCpuArray, RingBuf};
    use aya_ebpf::programs::TracePointContext;

    /// Kernels refuse `bpf_probe_read_kernel` to programs without a GPL-compatible license.
    #[unsafe(no_mangle)]
    #[unsafe(link_section = "license")]
    static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

    /// Offsets, own tgid and wake-up policy; set by the loader (see [`Config`]).
    #[unsafe(no_mangle)]
    static CONFIG: Config = Config::UNSET;

    #[map]
    static EVENTS: RingBuf = RingBuf::with_byte_size(4 << 20, 0);

    #[map]
    static WATCHED: HashMap<DirKey, u8> = HashMap::with_max_entries(16384, 0);

    #[map]
    static NAMES: HashMap<NameKey, u8> = HashMap::with_max_entries(16384, BPF_F_NO_PREALLOC);

    #[map]
    static LOSSES: PerCpuArray<u64> = PerCpuArray::with_max_entries(loss::COUNT, 0);

    /// `bind` arguments between entry and exit, keyed by `pid_tgid` (the thread).
    #[map]
    static PENDING_BINDS: HashMap<u64, u32> = HashMap::with_max_entries(4096, 0);

    /// A removal that passed the filter at entry, reported at exit if the call succeeded.
    #[map]
    static PENDING: HashMap<u64, Event> = HashMap::with_max_entries(4096, 0);

    /// The target of a rename parked like PENDING (the source goes in PENDING).
    #[map]
    static PENDING_TARGET: HashMap<u64, Event> = HashMap::with_max_entries(4096, 0);

    /// The target of a rename by a multi-component path to a new name: reported only if the
    /// source was in the tree (a move within it).
    #[map]
    static PENDING_IF_SOURCE: HashMap<u64, Event> = HashMap::with_max_entries(4096, 0);

    /// When the reader was last woken (`bpf_ktime_get_ns`), shared by all CPUs.
    #[map]
    static LAST_WAKE: Array<u64> = Array::with_max_entries(1, 0);

    /// Per-CPU working memory too big for the 512-byte BPF stack.
    #[map]
    static SCRATCH: PerCpuArray<Scratch> = PerCpuArray::with_max_entries(1, 0);

    #[repr(C)]
    struct Scratch {
        path: [u8; PATH_BUF_LEN],
        event: Event,
        start: u64,
        len: u64,
    }

    const BPF_F_NO_PREALLOC: u32 = 1;
    const BPF_NOEXIST: u64 = 1;
    const BPF_RB_NO_WAKEUP: u64 = 1;
    const BPF_RB_FORCE_WAKEUP: u64 = 2;
    const BPF_RB_AVAIL_DATA: u64 = 0;
    const EEXIST: i32 = 17;
    const AF_UNIX: u16 = 1;
    const AT_FDCWD: i64 = -100;
    /// Directories walked up from a bound socket looking for a watched one.
    const MAX_DEPTH: usize = 4;
    const RENAME_EXCHANGE: u64 = 2;
    /// x86_64 syscall number of renameat2 (the only arch this object is built for, see
    /// `bpf_target_arch`).
    const SYS_RENAMEAT2: i32 = 316;
    const S_IFMT: u64 = 0o170000;
    const S_IFSOCK: u64 = 0o140000;
    /// Masks an index into `Scratch::path` so the verifier sees it in bounds.
    const PATH_MASK: usize = PATH_BUF_LEN - 1;

    /// Byte offset of syscall argument `n` in a `sys_enter_*` record (`struct syscall_trace_enter`:
    /// an 8-byte common header, `int nr`, then `unsigned long args[6]`).
    const fn arg(n: usize) -> usize {
        16 + 8 * n
    }
    /// Byte offset of the return value in a `sys_exit_*` record (`struct syscall_trace_exit`).
    const RET: usize = 16;

    macro_rules! offset {
        ($field:ident) => {
            // SAFETY: CONFIG is a plain static; the volatile read stops the compiler from folding
            // the zero it is initialised with, since the loader rewrites it.
            unsafe { read_volatile(addr_of!(CONFIG.offsets.$field)) as usize }
        };
    }

    fn config_u64(field: *const u64) -> u64 {
        // SAFETY: `field` points into CONFIG; see `offset!`.
        unsafe { read_volatile(field) }
    }

    /// Reads a `T` at `base + offset` in kernel memory.
    #[inline(always)]
    fn kread<T>(base: usize, offset: usize) -> Option<T> {
        // SAFETY: bpf_probe_read_kernel checks the address and fails instead of faulting.
        unsafe { bpf_probe_read_kernel((base + offset) as *const T) }.ok()
    }

    /// Reads a non-null kernel pointer at `base + offset`.
    #[inline(always)]
    fn kptr(base: usize, offset: usize) -> Option<usize> {
        kread::<usize>(base, offset).filter(|&p| p != 0)
    }

    fn count_loss(index: u32) {
        if let Some(counter) = LOSSES.get_ptr_mut(index) {
            // SAFETY: per-CPU slot, and a tracepoint program is not re-entered on one CPU.
            unsafe { *counter += 1 };
        }
    }

    /// The current task (`struct task_struct *`).
    fn current_task() -> usize {
        // SAFETY: a helper without arguments, valid in every tracing program.
        unsafe { bpf_get_current_task() as usize }
    }

    /// `CLOCK_MONOTONIC` now, in nanoseconds.
    fn now_ns() -> u64 {
        // SAFETY: a helper without arguments.
        unsafe { bpf_ktime_get_ns() }
    }

    fn current_tgid() -> u32 {
        (bpf_get_current_pid_tgid() >> 32) as u32
    }

    /// The agent's own filesystem activity is not reported back.
    fn is_agent() -> bool {
        // SAFETY: see `offset!`.
        let agent = unsafe { read_volatile(addr_of!(CONFIG.agent_tgid)) };
        agent != 0 && current_tgid() == agent
    }

    /// The kernel identity of the directory `dentry` names.
    fn dir_key(dentry: usize) -> Option<DirKey> {
        let inode = kptr(dentry, offset!(dentry_inode))?;
        let ino = kread::<u64>(inode, offset!(inode_ino))?;
        let sb = kptr(dentry, offset!(dentry_sb))?;
        let dev = kread::<u32>(sb, offset!(sb_dev))?;
        Some(DirKey {
            dev: u64::from(dev),
            ino,
        })
    }

    /// The current task's `struct file *` for descriptor `fd`.
    fn fd_file(fd: u64) -> Option<usize> {
        let task = current_task();
        let files = kptr(task, offset!(task_files))?;
        let fdt = kptr(files, offset!(files_fdt))?;
        let max_fds = kread::<u32>(fdt, offset!(fdtable_max_fds))?;
        if fd >= u64::from(max_fds) {
            return None;
        }
        let table = kptr(fdt, offset!(fdtable_fd))?;
        kptr(table, fd as usize * 8)
    }

    /// The current task's working directory.
    fn cwd_dentry() -> Option<usize> {
        let task = current_task();
        let fs = kptr(task, offset!(task_fs))?;
        kptr(fs, offset!(fs_pwd_dentry))
    }

    /// Ring-buffer wake-up policy: wake the reader at once when it was idle (last woken at least
    /// `batch_ns` ago) or when `wakeup_bytes` are queued; otherwise let the event ride along with the
    /// previous wake-up, which the reader follows with one more drain `batch_ns` later. Bursts cost
    /// one wake-up per `batch_ns`, a lone event none of its latency, and an idle agent nothing.
    fn wake_flags() -> u64 {
        let now = now_ns();
        let Some(last) = LAST_WAKE.get_ptr_mut(0) else {
            return 0;
        };
        let queued = EVENTS.query(BPF_RB_AVAIL_DATA);
        // SAFETY: the slot is shared between CPUs; a racy read or write only costs an extra or a
        // skipped wake-up decision, both of which the reader's follow-up drain tolerates.
        let elapsed = now.wrapping_sub(unsafe { *last });
        if queued >= config_u64(addr_of!(CONFIG.wakeup_bytes))
            || elapsed >= config_u64(addr_of!(CONFIG.batch_ns))
        {
            unsafe { *last = now };
            BPF_RB_FORCE_WAKEUP
        } else {
            BPF_RB_NO_WAKEUP
        }
    }

    // ---------------------------------------------------------------------------------------------
    // bind

    #[tracepoint]
    pub fn bind_enter(ctx: TracePointContext) -> u32 {
        let _ = try_bind_enter(&ctx);
        0
    }

    fn try_bind_enter(ctx: &TracePointContext) -> Option<()> {
        if is_agent() {
            return None;
        }
        // SAFETY: offsets within the sys_enter_bind record.
        let fd = unsafe { ctx.read_at::<u64>(arg(0)) }.ok()?;
        let addr = unsafe { ctx.read_at::<u64>(arg(1)) }.ok()?;
        let addrlen = unsafe { ctx.read_at::<u64>(arg(2)) }.ok()?;
        // sa_family (2 bytes) and at least the first byte of sun_path.
        if addrlen < 3 {
            return None;
        }
        // SAFETY: bpf_probe_read_user fails instead of faulting on a bad address.
        let head = unsafe { bpf_probe_read_user(addr as *const [u8; 3]) }.ok()?;
        // sun_path[0] == 0 is an abstract socket: no filesystem entry.
        if u16::from_ne_bytes([head[0], head[1]]) != AF_UNIX || head[2] == 0 {
            return None;
        }
        if PENDING_BINDS
            .insert(bpf_get_current_pid_tgid(), fd as u32, 0)
            .is_err()
        {
            count_loss(loss::PENDING_FULL);
        }
        Some(())
    }

    #[tracepoint]
    pub fn bind_exit(ctx: TracePointContext) -> u32 {
        let _ = try_bind_exit(&ctx);
        0
    }

    fn try_bind_exit(ctx: &TracePointContext) -> Option<()> {
        let thread = bpf_get_current_pid_tgid();
        // SAFETY: the value is copied out before the entry is removed.
        let fd = unsafe { PENDING_BINDS.get(&thread) }.copied()?;
        let _ = PENDING_BINDS.remove(&thread);
        // SAFETY: offset within the sys_exit_bind record.
        let ret = unsafe { ctx.read_at::<i64>(RET) }.ok()?;
        if ret != 0 {
            return None;
        }
        // The socket's own dentry: relative paths, chroots and other mount namespaces all resolve
        // to the same directory identity the agent watches.
        let file = fd_file(u64::from(fd))?;
        let socket = kptr(file, offset!(file_private_data))?;
        let sk = kptr(socket, offset!(socket_sk))?;
        if kread::<u16>(sk, offset!(sock_family))? != AF_UNIX {
            return None;
        }
        // Walk up from the socket to the first watched directory: the socket itself when its
        // directory is watched, otherwise the sub-directory (created but not yet watched) that
        // holds it, which the watcher then watches and walks.
        let mut entry_dentry = kptr(sk, offset!(unix_sock_dentry))?;
        let mut watched = None;
        for _ in 0..MAX_DEPTH {
            let parent_dentry = kptr(entry_dentry, offset!(dentry_parent))?;
            if parent_dentry == entry_dentry {
                break; // the root of its filesystem
            }
            let key = dir_key(parent_dentry)?;
            // SAFETY: presence check only.
            if unsafe { WATCHED.get(&key) }.is_some() {
                watched = Some(key);
                break;
            }
            entry_dentry = parent_dentry;
        }
        let parent = watched?;
        let name = kptr(entry_dentry, offset!(dentry_name))?;
        let name_len = kread::<u32>(entry_dentry, offset!(dentry_name_len))?;
        let Some(mut entry) = EVENTS.reserve::<Event>(0) else {
            count_loss(loss::RING_FULL);
            return None;
        };
        let event = entry.as_mut_ptr();
        // SAFETY: `event` points at a reserved, exclusively owned ring-buffer record.
        unsafe {
            (*event).kind = kind::BIND;
            (*event).scope = scope::EXACT;
            (*event).tgid = current_tgid();
            (*event).name_len = name_len;
            (*event).ktime_ns = now_ns();
            (*event).parent = parent;
            (*event).name.bytes = [0; NAME_LEN];
            let _ = bpf_probe_read_kernel_str_bytes(
                name as *const u8,
                &mut *addr_of_mut!((*event).name.bytes),
            );
            remember_name(&(*event).name);
        }
        entry.submit(wake_flags());
        Some(())
    }

    /// Adds a name reported under the tree to NAMES, so its later removal by a multi-component path
    /// is recognised.
    fn remember_name(name: &NameKey) {
        match NAMES.insert(name, 0, BPF_NOEXIST) {
            Ok(()) => {}
            Err(err) if err == -EEXIST => {}
            Err(_) => count_loss(loss::NAMES_FULL),
        }
    }

    // ---------------------------------------------------------------------------------------------
    // unlink, unlinkat, rmdir, mknod(at) of sockets, mkdir(at): one path argument

    /// What a path syscall does to the tree, and so how a path that cannot be resolved is handled.
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum PathOp {
        /// An entry goes (`unlink`, `rmdir`): a multi-component path is matched by name in NAMES.
        Remove,
        /// A socket inode appears (`mknod S_IFSOCK`): rare enough to report any path by name.
        CreateSocket,
        /// A directory appears (`mkdir`): common system-wide, so only a path relative to a watched
        /// directory is reported. A socket later bound inside the new directory is still found by
        /// the bind programs' walk up to the watched ancestor.
        CreateDir,
        /// The target of a rename: any path is classified, and the caller decides whether a
        /// name-only target is reported (see `target_enter`).
        MoveTo,
    }

    /// Reads syscall argument `n`.
    fn arg_u64(ctx: &TracePointContext, n: usize) -> Option<u64> {
        // SAFETY: offsets within a sys_enter_* record.
        unsafe { ctx.read_at::<u64>(arg(n)) }.ok()
    }

    /// Reads a `dfd` argument (an `int`, sign-extended).
    fn arg_dfd(ctx: &TracePointContext, n: usize) -> Option<i64> {
        arg_u64(ctx, n).map(|v| i64::from(v as i32))
    }

    #[tracepoint]
    pub fn remove_enter(ctx: TracePointContext) -> u32 {
        if let Some(path) = arg_u64(&ctx, 0) {
            let _ = path_enter(AT_FDCWD, path, PathOp::Remove);
        }
        0
    }

    #[tracepoint]
    pub fn unlinkat_enter(ctx: TracePointContext) -> u32 {
        if let (Some(dfd), Some(path)) = (arg_dfd(&ctx, 0), arg_u64(&ctx, 1)) {
            let _ = path_enter(dfd, path, PathOp::Remove);
        }
        0
    }

    #[tracepoint]
    pub fn mknod_enter(ctx: TracePointContext) -> u32 {
        if let (Some(path), Some(mode)) = (arg_u64(&ctx, 0), arg_u64(&ctx, 1))
            && mode & S_IFMT == S_IFSOCK
        {
            let _ = path_enter(AT_FDCWD, path, PathOp::CreateSocket);
        }
        0
    }

    #[tracepoint]
    pub fn mknodat_enter(ctx: TracePointContext) -> u32 {
        if let (Some(dfd), Some(path), Some(mode)) =
            (arg_dfd(&ctx, 0), arg_u64(&ctx, 1), arg_u64(&ctx, 2))
            && mode & S_IFMT == S_IFSOCK
        {
            let _ = path_enter(dfd, path, PathOp::CreateSocket);
        }
        0
    }

    #[tracepoint]
    pub fn mkdir_enter(ctx: TracePointContext) -> u32 {
        if let Some(path) = arg_u64(&ctx, 0) {
            let _ = path_enter(AT_FDCWD, path, PathOp::CreateDir);
        }
        0
    }

    #[tracepoint]
    pub fn mkdirat_enter(ctx: TracePointContext) -> u32 {
        if let (Some(dfd), Some(path)) = (arg_dfd(&ctx, 0), arg_u64(&ctx, 1)) {
            let _ = path_enter(dfd, path, PathOp::CreateDir);
        }
        0
    }

    /// Decides at syscall entry whether `op` on `path` (relative to `dfd`) concerns the tree, and
    /// if so parks the event until the exit says whether the call succeeded.
    fn path_enter(dfd: i64, path: u64, op: PathOp) -> Option<()> {
        if is_agent() {
            return None;
        }
        let scratch = SCRATCH.get_ptr_mut(0)?;
        // SAFETY: the per-CPU scratch slot is ours for the duration of this program run.
        let scratch = unsafe { &mut *scratch };
        classify(scratch, dfd, path, op)?;
        park(&PENDING, &scratch.event);
        Some(())
    }

    /// Fills `scratch.event` for `op` on `path` if it concerns the tree.
    #[inline(always)]
    fn classify(scratch: &mut Scratch, dfd: i64, path: u64, op: PathOp) -> Option<()> {
        let single = last_component(scratch, path)?;
        let event = &mut scratch.event;
        if single {
            // "name": its parent is the start directory, which the kernel can name exactly.
            let start = if dfd == AT_FDCWD {
                cwd_dentry()?
            } else {
                kptr(fd_file(dfd as u64)?, offset!(file_dentry))?
            };
            let parent = dir_key(start)?;
            // SAFETY: presence check only.
            unsafe { WATCHED.get(&parent) }?;
            event.scope = scope::EXACT;
            event.parent = parent;
        } else {
            // "dir/name" or "/abs/name": only the name can be checked.
            let known = || {
                // SAFETY: presence check only.
                unsafe { NAMES.get(&event.name) }.map(|_| ())
            };
            match op {
                PathOp::Remove => known()?,
                PathOp::CreateSocket | PathOp::MoveTo => {}
                PathOp::CreateDir => return None,
            }
            event.scope = scope::NAME_ONLY;
            event.parent = DirKey { dev: 0, ino: 0 };
        }
        event.kind = if op == PathOp::Remove {
            kind::REMOVE
        } else {
            kind::CREATE
        };
        event.tgid = current_tgid();
        Some(())
    }

    /// Parks `event` for this thread until its syscall returns.
    fn park(map: &HashMap<u64, Event>, event: &Event) {
        if map.insert(bpf_get_current_pid_tgid(), event, 0).is_err() {
            count_loss(loss::PENDING_FULL);
        }
    }

    // ---------------------------------------------------------------------------------------------
    // rename, renameat, renameat2: two paths

    // Each side of a rename is classified by its own program on the same tracepoint: one path per
    // program keeps the verifier's work that of a single-path syscall. The sides meet at exit,
    // where a target reported only because its source was in the tree is emitted if the source was.

    #[tracepoint]
    pub fn rename_source_enter(ctx: TracePointContext) -> u32 {
        if let Some(old) = arg_u64(&ctx, 0) {
            let _ = source_enter(AT_FDCWD, old, 0);
        }
        0
    }

    #[tracepoint]
    pub fn rename_target_enter(ctx: TracePointContext) -> u32 {
        if let Some(new) = arg_u64(&ctx, 1) {
            let _ = target_enter(AT_FDCWD, new);
        }
        0
    }

    #[tracepoint]
    pub fn renameat_source_enter(ctx: TracePointContext) -> u32 {
        if let (Some(dfd), Some(old)) = (arg_dfd(&ctx, 0), arg_u64(&ctx, 1)) {
            let flags = if renameat2(&ctx) {
                arg_u64(&ctx, 4)
            } else {
                Some(0)
            };
            if let Some(flags) = flags {
                let _ = source_enter(dfd, old, flags);
            }
        }
        0
    }

    #[tracepoint]
    pub fn renameat_target_enter(ctx: TracePointContext) -> u32 {
        if let (Some(dfd), Some(new)) = (arg_dfd(&ctx, 2), arg_u64(&ctx, 3)) {
            let _ = target_enter(dfd, new);
        }
        0
    }

    /// Whether this `sys_enter_renameat*` record is renameat2's (which has a flags argument):
    /// `__syscall_nr` sits at offset 8 of every `sys_enter_*` record.
    fn renameat2(ctx: &TracePointContext) -> bool {
        // SAFETY: offset within the sys_enter_* record.
        matches!(unsafe { ctx.read_at::<i32>(8) }, Ok(SYS_RENAMEAT2))
    }

    /// The source of a rename goes; with `RENAME_EXCHANGE` it is replaced, which is reported as a
    /// creation (the watcher stats what is there now). Either way it is matched like a removal.
    fn source_enter(dfd: i64, old: u64, flags: u64) -> Option<()> {
        if is_agent() {
            return None;
        }
        let scratch = SCRATCH.get_ptr_mut(0)?;
        // SAFETY: the per-CPU scratch slot is ours for the duration of this program run.
        let scratch = unsafe { &mut *scratch };
        classify(scratch, dfd, old, PathOp::Remove)?;
        if flags & RENAME_EXCHANGE != 0 {
            scratch.event.kind = kind::CREATE;
        }
        park(&PENDING, &scratch.event);
        Some(())
    }

    /// The target of a rename appears (with `RENAME_EXCHANGE` too: the source's entry lands there).
    /// A multi-component target is reported by name if the name is known (it replaces an entry) or,
    /// decided at exit, if the source was in the tree (a move within it).
    fn target_enter(dfd: i64, new: u64) -> Option<()> {
        if is_agent() {
            return None;
        }
        let scratch = SCRATCH.get_ptr_mut(0)?;
        // SAFETY: the per-CPU scratch slot is ours for the duration of this program run.
        let scratch = unsafe { &mut *scratch };
        classify(scratch, dfd, new, PathOp::MoveTo)?;
        // SAFETY: presence check only.
        let known = unsafe { NAMES.get(&scratch.event.name) }.is_some();
        if scratch.event.scope == scope::EXACT || known {
            park(&PENDING_TARGET, &scratch.event);
        } else {
            park(&PENDING_IF_SOURCE, &scratch.event);
        }
        Some(())
    }

    /// Copies the last component of the user string at `path` into `scratch.event.name` (NUL
    /// padded) and its length into `name_len`. Returns whether the path is that single component.
    ///
    /// Written for the verifier: loops are bounded by constants, indexes are masked, and positions
    /// found by one loop go through memory before the next loop so their ranges do not multiply
    /// the states the verifier explores.
    #[inline(always)]
    fn last_component(scratch: &mut Scratch, path: u64) -> Option<bool> {
        // SAFETY: bpf_probe_read_user_str fails instead of faulting on a bad address.
        let mut end =
            unsafe { bpf_probe_read_user_str_bytes(path as *const u8, &mut scratch.path) }
                .ok()?
                .len();
        // Trailing slashes ("dir/") do not belong to the name.
        for _ in 0..8 {
            if end > 1 && scratch.path[(end - 1) & PATH_MASK] == b'/' {
                end -= 1;
            }
        }
        let mut start = 0;
        let mut single = true;
        for back in 1..=NAME_LEN {
            if back > end {
                break;
            }
            if scratch.path[(end - back) & PATH_MASK] == b'/' {
                start = end - back + 1;
                single = false;
                break;
            }
        }
        if single && end >= NAME_LEN {
            return None;
        }
        scratch.start = start as u64;
        scratch.len = end.saturating_sub(start) as u64;
        // SAFETY: plain fields of the scratch slot; see the doc comment for why they are reloaded.
        let (start, len) = unsafe {
            (
                read_volatile(addr_of!(scratch.start)) as usize,
                read_volatile(addr_of!(scratch.len)) as usize,
            )
        };
        if len == 0 || len >= NAME_LEN {
            return None;
        }
        let name = &mut scratch.event.name.bytes;
        for i in 0..NAME_LEN {
            name[i] = if i < len {
                scratch.path[(start + i) & PATH_MASK]
            } else {
                0
            };
        }
        scratch.event.name_len = len as u32;
        Some(single)
    }

    /// Reports the parked path events of this thread if its syscall succeeded.
    #[tracepoint]
    pub fn path_exit(ctx: TracePointContext) -> u32 {
        // SAFETY: offset within the sys_exit_* record.
        let succeeded = matches!(unsafe { ctx.read_at::<i64>(RET) }, Ok(0));
        let thread = bpf_get_current_pid_tgid();
        let source_in_tree = report_parked(&PENDING, thread, succeeded);
        report_parked(&PENDING_TARGET, thread, succeeded);
        report_parked(&PENDING_IF_SOURCE, thread, succeeded && source_in_tree);
        0
    }

    /// Reports (if `succeeded`) and forgets this thread's event parked in `map`; returns whether
    /// there was one.
    #[inline(always)]
    fn report_parked(map: &HashMap<u64, Event>, thread: u64, succeeded: bool) -> bool {
        let Some(pending) = map.get_ptr(&thread) else {
            return false;
        };
        if succeeded {
            match EVENTS.reserve::<Event>(0) {
                Some(mut entry) => {
                    // SAFETY: `pending` is a live map value of this thread; `entry` is reserved
                    // and exclusively ours. Copied in place: two Events do not fit the BPF stack.
                    unsafe {
                        let event = entry.as_mut_ptr();
                        core::ptr::copy_nonoverlapping(pending, event, 1);
                        (*event).ktime_ns = now_ns();
                        if (*event).kind == kind::CREATE && (*event).scope == scope::EXACT {
                            remember_name(&(*pending).name);
                        }
                    }
                    entry.submit(wake_flags());
                }
                None => count_loss(loss::RING_FULL),
            }
        }
        let _ = map.remove(&thread);
        true
    }

    #[panic_handler]
    fn panic(_info: &core::panic::PanicInfo) -> ! {
        // SAFETY: the verifier rejects any program with a reachable panic path.
        unsafe { core::hint::unreachable_unchecked() }
    }
}
