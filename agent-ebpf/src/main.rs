//! plugin-agent's kernel programs: the first stage of the data flow (see lib.rs for the shared types).
//!
//! ```text
//! sys_enter_bind  --AF_UNIX, path--> PENDING_BINDS[thread] = fd
//! sys_exit_bind   --ret 0--> fd -> file -> socket -> unix_sock.path.dentry -> parent in WATCHED?
//!                        --> EVENTS (exact: parent identity + name)
//! sys_enter_{unlink,unlinkat,rmdir,mknod,mknodat,mkdir,mkdirat,rename,renameat,renameat2}
//!   path_enter (first path; told apart by __syscall_nr), rename_target_enter (second path)
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
//! and set in [`CONFIG`](agent_ebpf::Config): Rust eBPF has no CO-RE relocations. The programs are
//! written for the oldest verifier they are tested on (Debian's 6.1, `cargo xtask vm-test`): no
//! ring-buffer memory as a map key, and array indexes masked where the verifier sees the mask.
//! Every event that cannot be recorded bumps a `LOSSES` counter, which the agent turns into a
//! rescan.
#![cfg_attr(target_arch = "bpf", no_std, no_main)]

#[cfg(not(target_arch = "bpf"))]
fn main() {
    eprintln!("agent-ebpf is a kernel program: build it with `cargo xtask build-ebpf`");
}

#[cfg(target_arch = "bpf")]
mod programs {
    use core::ptr::{addr_of, addr_of_mut, read_volatile};

    use agent_ebpf::{
        COMM_LEN, Config, DirKey, Event, META_BYTES, NAME_LEN, NameHolder, NameKey, PATH_BUF_LEN,
        agent, kind, loss, scope,
    };
    use aya_ebpf::EbpfContext;
    use aya_ebpf::helpers::generated::bpf_get_current_cgroup_id;
    use aya_ebpf::helpers::generated::bpf_probe_read_kernel as raw_probe_read_kernel;
    use aya_ebpf::helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_current_task,
        bpf_get_current_uid_gid, bpf_get_smp_processor_id, bpf_ktime_get_ns, bpf_probe_read_kernel,
        bpf_probe_read_kernel_str_bytes, bpf_probe_read_user, bpf_probe_read_user_str_bytes,
    };
    use aya_ebpf::macros::{fentry, fexit, map, tracepoint};
    use aya_ebpf::maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf};
    use aya_ebpf::programs::{FEntryContext, FExitContext, TracePointContext};

    /// Kernels refuse `bpf_probe_read_kernel` to programs without a GPL-compatible license.
    #[unsafe(no_mangle)]
    #[unsafe(link_section = "license")]
    static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

    /// Offsets, own tgid and wake-up policy; set by the loader (see [`Config`]).
    #[unsafe(no_mangle)]
    static CONFIG: Config = Config::UNSET;

    /// Sized by the loader (`EbpfOptions::ring_buffer_bytes`); this is only the object's default.
    #[map]
    static EVENTS: RingBuf = RingBuf::with_byte_size(2 << 20, 0);

    #[map]
    static WATCHED: HashMap<DirKey, u8> = HashMap::with_max_entries(16384, 0);

    #[map]
    static NAMES: HashMap<NameKey, NameHolder> =
        HashMap::with_max_entries(16384, BPF_F_NO_PREALLOC);

    /// Each CPU's counter per reason, at `cpu * loss::COUNT + reason`; the loader sizes it to the
    /// possible CPUs. A plain array, not a per-CPU one, because it can be mapped: the agent reads
    /// it after every drain of the ring from its own memory, where a per-CPU array costs a `bpf`
    /// syscall per counter. Each CPU writes only its own slots.
    #[map]
    static LOSSES: Array<u64> = Array::with_max_entries(loss::COUNT, BPF_F_MMAPABLE);

    /// `bind` arguments between entry and exit, keyed by `pid_tgid` (the thread).
    #[map]
    static PENDING_BINDS: HashMap<u64, u32> = HashMap::with_max_entries(4096, 0);

    /// `connect` descriptors between entry and exit, likewise; a table of their own because a
    /// `connect` can block (on a listener that never accepts), and any process anywhere could
    /// then hold thousands of entries: full, it loses contacts, never binds (tree state).
    #[map]
    static PENDING_CONNECTS: HashMap<u64, u32> = HashMap::with_max_entries(4096, 0);

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

    /// The agent's tgid and whether the name table is incomplete (see `names::AGENT`).
    #[map]
    static AGENT: Array<u32> = Array::with_max_entries(agent::SLOTS, 0);

    /// What the loader computed, for an agent that adopts these programs (see `names::META`).
    #[map]
    static META: Array<[u8; META_BYTES]> = Array::with_max_entries(1, 0);

    /// Per-CPU working memory too big for the 512-byte BPF stack.
    #[map]
    static SCRATCH: PerCpuArray<Scratch> = PerCpuArray::with_max_entries(1, 0);

    #[repr(C)]
    struct Scratch {
        path: [u8; PATH_BUF_LEN],
        event: Event,
        /// The component before the last one, for [`parent_known`].
        parent: NameKey,
        /// The NAMES value of `parent` when [`parent_known`] found it (0: none).
        parent_id: u64,
        start: u64,
        len: u64,
        dfd: i64,
        path_ptr: u64,
        op: u64,
        word: u64,
    }

    const BPF_F_NO_PREALLOC: u32 = 1;
    const BPF_F_MMAPABLE: u32 = 1 << 10;
    const BPF_NOEXIST: u64 = 1;
    const BPF_RB_NO_WAKEUP: u64 = 1;
    const BPF_RB_FORCE_WAKEUP: u64 = 2;
    const BPF_RB_AVAIL_DATA: u64 = 0;
    const AF_UNIX: u16 = 1;
    const AT_FDCWD: i64 = -100;
    /// Directories walked up from a bound socket looking for a watched one.
    const MAX_DEPTH: usize = 8;
    const RENAME_EXCHANGE: u64 = 2;
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
        // SAFETY: a helper without arguments, valid in every tracing program.
        let cpu = unsafe { bpf_get_smp_processor_id() };
        if let Some(counter) = LOSSES.get_ptr_mut(cpu.wrapping_mul(loss::COUNT).wrapping_add(index))
        {
            // SAFETY: this CPU's slot (a tracepoint program is not re-entered on one CPU); an
            // aligned u64, which the agent reads whole.
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

    /// Who is making the call, as a record names its creator: tgid, uid, gid, cgroup and command,
    /// taken now (the process may be gone by the time the agent reads the record).
    #[derive(Clone, Copy)]
    struct Caller {
        tgid: u32,
        uid: u32,
        gid: u32,
        cgroup_id: u64,
        comm: [u8; COMM_LEN],
    }

    impl Caller {
        #[inline(always)]
        fn current() -> Caller {
            let uid_gid = bpf_get_current_uid_gid();
            Caller {
                tgid: current_tgid(),
                uid: uid_gid as u32,
                gid: (uid_gid >> 32) as u32,
                // SAFETY: a helper without arguments, valid in every tracing program.
                cgroup_id: unsafe { bpf_get_current_cgroup_id() },
                comm: bpf_get_current_comm().unwrap_or([0; COMM_LEN]),
            }
        }

        /// Writes the caller into `event` (scratch or ring memory).
        ///
        /// # Safety
        /// `event` points at an `Event` this program run owns exclusively.
        #[inline(always)]
        unsafe fn stamp(self, event: *mut Event) {
            // SAFETY: the caller's promise.
            unsafe {
                (*event).tgid = self.tgid;
                (*event).uid = self.uid;
                (*event).gid = self.gid;
                (*event).cgroup_id = self.cgroup_id;
                (*event).comm = self.comm;
            }
        }
    }

    /// The agent's own filesystem activity is not reported back. The tgid is in a map, not in
    /// CONFIG: an agent that adopts pinned programs writes its own.
    fn is_agent() -> bool {
        let agent = AGENT.get(agent::TGID).copied().unwrap_or(0);
        agent != 0 && current_tgid() == agent
    }

    /// Whether some socket names are not in `NAMES` (see `agent::NAMES_INCOMPLETE`).
    #[inline(always)]
    fn names_incomplete() -> bool {
        AGENT
            .get(agent::NAMES_INCOMPLETE)
            .is_some_and(|flag| *flag != 0)
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

    /// Bytes of a whole event, and where its name starts (a record is cut after the name).
    const EVENT_BYTES: u64 = core::mem::size_of::<Event>() as u64;
    const NAME_OFFSET: u64 = core::mem::offset_of!(Event, name) as u64;

    /// Ring-buffer wake-up policy, called just before this record is written: wake the reader at
    /// once when
    /// - it was last woken `batch_ns` ago or earlier (a quiet spell: a lone event pays no batching);
    /// - or it was last woken at least `batch_ns / 16` ago and either it has consumed everything
    ///   (it is idle or about to be: a steady trickle under load is not held back a whole batch
    ///   delay) or the record is `prompt`, whatever is queued;
    /// - or `wakeup_bytes` are queued (a burst: drain before the ring fills);
    ///
    /// otherwise let the record ride along with the previous wake-up: the reader drains once more
    /// `batch_ns` after every drain that found work, which bounds its latency. Wake-ups stay at
    /// most 16 per batch delay, and an idle agent gets none.
    ///
    /// Prompt records are those the agent acts on at once and which are rare (a storm's sockets,
    /// bound and unlinked again, cause none): a `listen` (a plugin can be registered), a
    /// listener's release (its plugin may have to be deregistered) and the removal of a name the
    /// agent knows (an entry it has seen, not noise). Behind a flood of other records they wait
    /// `batch_ns / 16` at most, not a whole batch delay, and what they follow rides along.
    fn wake_flags_when(prompt: bool) -> u64 {
        let now = now_ns();
        let Some(last) = LAST_WAKE.get_ptr_mut(0) else {
            return 0;
        };
        let queued = EVENTS.query(BPF_RB_AVAIL_DATA);
        // SAFETY: the slot is shared between CPUs; a racy read or write only costs an extra or a
        // skipped wake-up decision, both of which the reader's follow-up drain tolerates.
        let elapsed = now.wrapping_sub(unsafe { *last });
        let batch_ns = config_u64(addr_of!(CONFIG.batch_ns));
        let caught_up = (prompt || queued == 0) && elapsed >= batch_ns / 16;
        if caught_up || queued >= config_u64(addr_of!(CONFIG.wakeup_bytes)) || elapsed >= batch_ns {
            // SAFETY: as above.
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
        let fd = arg_u64(ctx, 0)?;
        if !unix_path_address(arg_u64(ctx, 1)?, arg_u64(ctx, 2)?) {
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

    /// The descriptor this thread's `bind`, `listen` or `connect` entry parked in `pending`
    /// (taken out here, whatever the result), if the syscall returned 0.
    #[inline(always)]
    fn parked_fd_if_succeeded(pending: &HashMap<u64, u32>, ctx: &TracePointContext) -> Option<u32> {
        let thread = bpf_get_current_pid_tgid();
        // SAFETY: the value is copied out before the entry is removed.
        let fd = unsafe { pending.get(&thread) }.copied()?;
        let _ = pending.remove(&thread);
        // SAFETY: offset within a sys_exit_* record.
        (unsafe { ctx.read_at::<i64>(RET) }.ok()? == 0).then_some(fd)
    }

    /// Whether the `struct sockaddr *` of a `bind` or `connect` (user memory, `addrlen` bytes)
    /// names a filesystem `AF_UNIX` address.
    #[inline(always)]
    fn unix_path_address(addr: u64, addrlen: u64) -> bool {
        // sa_family (2 bytes) and at least the first byte of sun_path.
        if addrlen < 3 {
            return false;
        }
        // SAFETY: bpf_probe_read_user fails instead of faulting on a bad address.
        let Ok(head) = (unsafe { bpf_probe_read_user(addr as *const [u8; 3]) }) else {
            return false;
        };
        // sun_path[0] == 0 is an abstract socket: no filesystem entry.
        u16::from_ne_bytes([head[0], head[1]]) == AF_UNIX && head[2] != 0
    }

    #[tracepoint]
    pub fn bind_exit(ctx: TracePointContext) -> u32 {
        let _ = try_bind_exit(&ctx);
        0
    }

    fn try_bind_exit(ctx: &TracePointContext) -> Option<()> {
        let fd = parked_fd_if_succeeded(&PENDING_BINDS, ctx)?;
        // The socket's own dentry: relative paths, chroots and other mount namespaces all resolve
        // to the same directory identity the agent watches.
        let file = fd_file(u64::from(fd))?;
        let socket = kptr(file, offset!(file_private_data))?;
        let sk = kptr(socket, offset!(socket_sk))?;
        if kread::<u16>(sk, offset!(sock_family))? != AF_UNIX {
            return None;
        }
        let dentry = kptr(sk, offset!(unix_sock_dentry))?;
        report_below_watched(dentry, kind::BIND)
    }

    /// Reports the entry at `dentry` (just created: a socket, a directory, a rename's target) if
    /// it is under a watched directory: the entry itself when its directory is watched, otherwise
    /// the sub-directory (created but not yet watched) on the way up that holds it, which the
    /// watcher then watches and walks. Walks up at most [`MAX_DEPTH`] directories.
    #[inline(always)]
    fn report_below_watched(dentry: usize, what: u32) -> Option<()> {
        let mut entry_dentry = dentry;
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
        let what = if entry_dentry == dentry {
            what
        } else {
            kind::CREATE
        };
        report_dentry(entry_dentry, parent, what)
    }

    /// Submits an exact event for the entry at `dentry` in the watched directory `parent`.
    #[inline(always)]
    fn report_dentry(dentry: usize, parent: DirKey, what: u32) -> Option<()> {
        let name = kptr(dentry, offset!(dentry_name))?;
        let name_len = kread::<u32>(dentry, offset!(dentry_name_len))?;
        // Built in scratch memory and copied into the ring at its used length (see `submit`).
        let scratch = SCRATCH.get_ptr_mut(0)?;
        // SAFETY: the per-CPU scratch slot is ours for the duration of this program run, and no
        // caller of this function holds a reference into its `event`.
        let event = unsafe { &mut *addr_of_mut!((*scratch).event) };
        event.name.bytes = [0; NAME_LEN];
        // SAFETY: bpf_probe_read_kernel_str fails instead of faulting.
        let _ =
            unsafe { bpf_probe_read_kernel_str_bytes(name as *const u8, &mut event.name.bytes) };
        event.kind = what;
        event.scope = scope::EXACT;
        // SAFETY: `event` is this program run's per-CPU scratch record.
        unsafe { Caller::current().stamp(event) };
        event.name_len = name_len;
        event.ktime_ns = now_ns();
        event.parent = parent;
        submit(event, what == kind::LISTEN || what == kind::RELEASE);
        Some(())
    }

    /// Copies `event` into the ring as a record of its used length: the fixed fields and the
    /// name's bytes (rounded up to 8), not the whole name buffer, so a record of a 20-byte name
    /// takes 104 bytes of the ring rather than 336, and a ring holds three times the events
    /// (the reader zero-fills the rest: `record::decode`). `bpf_ringbuf_output` rather than a
    /// reservation, whose size the verifier wants constant.
    #[inline(always)]
    fn submit(event: &Event, prompt: bool) {
        let name_len = u64::from(event.name_len);
        let name_len = if name_len > NAME_LEN as u64 {
            NAME_LEN as u64
        } else {
            name_len
        };
        let used = (NAME_OFFSET + name_len + 7) & !7;
        let len = if used > EVENT_BYTES {
            EVENT_BYTES
        } else {
            used
        };
        let flags = wake_flags_when(prompt);
        // SAFETY: `event` is a live Event (in map memory: scratch or a parked value), and `len`
        // is at most its size.
        let used = unsafe {
            core::slice::from_raw_parts(event as *const Event as *const u8, len as usize)
        };
        if EVENTS.output::<[u8]>(used, flags).is_err() {
            count_loss(loss::RING_FULL);
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
        /// A directory appears (`mkdir`): common system-wide, so a multi-component path is reported
        /// only when its parent component is a name in NAMES (a watched directory's, plausibly).
        /// A socket later bound inside a new directory is found by the bind programs' walk up to
        /// the watched ancestor in any case.
        CreateDir,
        /// The target of a rename: any path is classified, and the caller decides whether a
        /// name-only target is reported (see `rename_target_enter`).
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

    /// The syscall number of a `sys_enter_*` record (`__syscall_nr`, at offset 8 of every one).
    fn syscall_nr(ctx: &TracePointContext) -> Option<i32> {
        // SAFETY: offset within the sys_enter_* record.
        unsafe { ctx.read_at::<i32>(8) }.ok()
    }

    /// Whether `nr` is the syscall whose number the loader put at `field` of CONFIG.syscalls.
    fn is_syscall(nr: i32, field: *const i32) -> bool {
        // SAFETY: `field` points into CONFIG; see `offset!`.
        let expected = unsafe { read_volatile(field) };
        expected >= 0 && nr == expected
    }

    macro_rules! sys {
        ($nr:expr, $name:ident) => {
            is_syscall($nr, addr_of!(CONFIG.syscalls.$name))
        };
    }

    /// The first path argument of every path syscall this object watches, in one program.
    ///
    /// One program on all ten `sys_enter_*` tracepoints, told apart by `__syscall_nr`, rather than
    /// one per syscall: the path scan is what the verifier spends its time on, and this way it is
    /// verified once (plus once in [`rename_target_enter`]) instead of ten times.
    #[tracepoint]
    pub fn path_enter(ctx: TracePointContext) -> u32 {
        let _ = try_path_enter(&ctx);
        0
    }

    fn try_path_enter(ctx: &TracePointContext) -> Option<()> {
        if is_agent() {
            return None;
        }
        let nr = syscall_nr(ctx)?;
        let (dfd, path, op, flags) = if sys!(nr, unlink) || sys!(nr, rmdir) {
            (AT_FDCWD, arg_u64(ctx, 0)?, PathOp::Remove, 0)
        } else if sys!(nr, unlinkat) {
            (arg_dfd(ctx, 0)?, arg_u64(ctx, 1)?, PathOp::Remove, 0)
        } else if sys!(nr, mknod) {
            if arg_u64(ctx, 1)? & S_IFMT != S_IFSOCK {
                return None;
            }
            (AT_FDCWD, arg_u64(ctx, 0)?, PathOp::CreateSocket, 0)
        } else if sys!(nr, mknodat) {
            if arg_u64(ctx, 2)? & S_IFMT != S_IFSOCK {
                return None;
            }
            (arg_dfd(ctx, 0)?, arg_u64(ctx, 1)?, PathOp::CreateSocket, 0)
        } else if sys!(nr, mkdir) {
            (AT_FDCWD, arg_u64(ctx, 0)?, PathOp::CreateDir, 0)
        } else if sys!(nr, mkdirat) {
            (arg_dfd(ctx, 0)?, arg_u64(ctx, 1)?, PathOp::CreateDir, 0)
        } else if sys!(nr, rename) {
            (AT_FDCWD, arg_u64(ctx, 0)?, PathOp::Remove, 0)
        } else if sys!(nr, renameat) {
            (arg_dfd(ctx, 0)?, arg_u64(ctx, 1)?, PathOp::Remove, 0)
        } else if sys!(nr, renameat2) {
            (
                arg_dfd(ctx, 0)?,
                arg_u64(ctx, 1)?,
                PathOp::Remove,
                arg_u64(ctx, 4)?,
            )
        } else {
            return None;
        };
        let scratch = SCRATCH.get_ptr_mut(0)?;
        // SAFETY: the per-CPU scratch slot is ours for the duration of this program run.
        let scratch = unsafe { &mut *scratch };
        let (dfd, path, op) = forget_origin(scratch, dfd, path, op);
        classify(scratch, dfd, path, op)?;
        // The source of a RENAME_EXCHANGE is replaced, not removed: reported as a creation (the
        // watcher stats what is there now).
        if flags & RENAME_EXCHANGE != 0 {
            scratch.event.kind = kind::CREATE;
        }
        park(&PENDING, &scratch.event);
        Some(())
    }

    /// Passes the dispatch's results through memory, so the verifier meets one unknown `(dfd,
    /// path, op)` at the path scan instead of a separately explored constant per syscall.
    #[inline(always)]
    fn forget_origin(scratch: &mut Scratch, dfd: i64, path: u64, op: PathOp) -> (i64, u64, PathOp) {
        scratch.dfd = dfd;
        scratch.path_ptr = path;
        scratch.op = op as u64;
        // SAFETY: plain fields of the scratch slot, just written.
        let (dfd, path, op) = unsafe {
            (
                read_volatile(addr_of!(scratch.dfd)),
                read_volatile(addr_of!(scratch.path_ptr)),
                read_volatile(addr_of!(scratch.op)),
            )
        };
        let op = match op {
            x if x == PathOp::CreateSocket as u64 => PathOp::CreateSocket,
            x if x == PathOp::CreateDir as u64 => PathOp::CreateDir,
            x if x == PathOp::MoveTo as u64 => PathOp::MoveTo,
            _ => PathOp::Remove,
        };
        (dfd, path, op)
    }

    /// Decides whether `op` on `path` (relative to `dfd`) concerns the tree and fills
    /// `scratch.event` if so.
    #[inline(always)]
    fn classify(scratch: &mut Scratch, dfd: i64, path: u64, op: PathOp) -> Option<()> {
        scratch.parent_id = 0;
        let single = last_component(scratch, path)?;
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
            scratch.event.scope = scope::EXACT;
            scratch.event.parent = parent;
        } else {
            // "dir/name" or "/abs/name": only names can be checked.
            match op {
                // Reported or not when the syscall returns (see `scope::NAME_IF_KNOWN`); the
                // parent component's id, when NAMES has it, is not a filter but where userspace
                // looks: one `stat` in the watched directories so named instead of a read of
                // every watched directory (a churn's removals by absolute path, in batches).
                PathOp::Remove | PathOp::CreateSocket => {
                    let _ = parent_known(scratch);
                }
                // `rename_target_enter` looks the parent up itself when it needs to.
                PathOp::MoveTo => {}
                PathOp::CreateDir => {
                    if !parent_known(scratch) {
                        return None;
                    }
                }
            }
            scratch.event.scope = if op == PathOp::Remove {
                scope::NAME_IF_KNOWN
            } else {
                scope::NAME_ONLY
            };
            scratch.event.parent = name_only_parent(scratch);
        }
        let event = &mut scratch.event;
        event.kind = if op == PathOp::Remove {
            kind::REMOVE
        } else {
            kind::CREATE
        };
        // SAFETY: `event` is this program run's per-CPU scratch record.
        unsafe { Caller::current().stamp(event) };
        Some(())
    }

    /// Parks `event` for this thread until its syscall returns.
    fn park(map: &HashMap<u64, Event>, event: &Event) {
        if map.insert(bpf_get_current_pid_tgid(), event, 0).is_err() {
            count_loss(loss::PENDING_FULL);
        }
    }

    // ---------------------------------------------------------------------------------------------
    // rename, renameat, renameat2: the second path

    // The source of a rename is classified by `path_enter` like a removal; the target by this
    // program on the same tracepoints, so each program scans one path. The sides meet at exit, where
    // a target reported only because its source was in the tree is emitted if the source was.

    /// The target of a rename appears (with `RENAME_EXCHANGE` too: the source's entry lands there).
    /// A multi-component target is reported by name if the name is known (it replaces an entry),
    /// if its parent component is a known name (a move into a watched directory from anywhere,
    /// to a new name), or, decided at exit, if the source was in the tree (a move within it).
    #[tracepoint]
    pub fn rename_target_enter(ctx: TracePointContext) -> u32 {
        let _ = try_rename_target_enter(&ctx);
        0
    }

    fn try_rename_target_enter(ctx: &TracePointContext) -> Option<()> {
        if is_agent() {
            return None;
        }
        let nr = syscall_nr(ctx)?;
        let (dfd, new) = if sys!(nr, rename) {
            (AT_FDCWD, arg_u64(ctx, 1)?)
        } else if sys!(nr, renameat) || sys!(nr, renameat2) {
            (arg_dfd(ctx, 2)?, arg_u64(ctx, 3)?)
        } else {
            return None;
        };
        let scratch = SCRATCH.get_ptr_mut(0)?;
        // SAFETY: the per-CPU scratch slot is ours for the duration of this program run.
        let scratch = unsafe { &mut *scratch };
        let (dfd, new, _) = forget_origin(scratch, dfd, new, PathOp::MoveTo);
        classify(scratch, dfd, new, PathOp::MoveTo)?;
        // SAFETY: presence check only.
        let known = unsafe { NAMES.get(&scratch.event.name) }.is_some();
        if scratch.event.scope == scope::EXACT || known || parent_known(scratch) {
            if scratch.event.scope == scope::NAME_ONLY {
                scratch.event.parent = name_only_parent(scratch);
            }
            park(&PENDING_TARGET, &scratch.event);
        } else {
            park(&PENDING_IF_SOURCE, &scratch.event);
        }
        Some(())
    }

    /// `b'/'` in every byte of a word.
    const SLASHES: u64 = 0x2f2f_2f2f_2f2f_2f2f;
    /// 1 in every byte.
    const ONES: u64 = 0x0101_0101_0101_0101;
    /// The top bit of every byte.
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    /// Words of `Scratch::path` scanned back from the end: enough to cover a `NAME_MAX` name and
    /// the slash before it, wherever the name starts within a word.
    const SCANNED_WORDS: usize = NAME_LEN / 8 + 1;
    /// Masks a word index into `Scratch::path` so the verifier sees it in bounds.
    const WORD_MASK: usize = PATH_BUF_LEN / 8 - 1;

    /// Copies the last component of the user string at `path` into `scratch.event.name` (NUL
    /// padded) and its length into `name_len`. Returns whether the path is that single component.
    /// The path stays in `scratch.path` and the component's start in `scratch.start`, for
    /// [`parent_known`].
    ///
    /// Written for the verifier, whose work is (instructions per iteration) x (iterations): the
    /// last slash is found eight bytes per step (see [`component_start`]); the name is copied by a
    /// helper rather than a loop; loops are bounded by constants, indexes are masked, and positions
    /// found by one loop go through memory before the next so their ranges do not multiply the
    /// states the verifier explores.
    #[inline(always)]
    fn last_component(scratch: &mut Scratch, path: u64) -> Option<bool> {
        // SAFETY: bpf_probe_read_user_str fails instead of faulting on a bad address.
        let mut end =
            unsafe { bpf_probe_read_user_str_bytes(path as *const u8, &mut scratch.path) }
                .ok()?
                .len();
        // Trailing slashes ("dir/") do not belong to the name.
        for _ in 0..8 {
            if end > 1 && path_byte(scratch, end - 1) == b'/' {
                end -= 1;
            }
        }
        if end == 0 {
            return None;
        }
        let (start, single) = component_start(scratch, end);
        if single && end >= NAME_LEN {
            return None;
        }
        let name = addr_of_mut!(scratch.event.name);
        let len = copy_component(scratch, start, end, name)?;
        scratch.event.name_len = len as u32;
        Some(single)
    }

    /// Whether the directory component before the last one (`b` in `/a/b/name`), copied into
    /// `scratch.parent`, is a name present under the tree, NAMES holding every watched directory's
    /// name (the root's too, as an entry of its watched parent). Called after [`last_component`]
    /// found a multi-component path; lets a move or `mkdir` into the tree by a path the kernel
    /// cannot resolve pass the filter when its target directory is plausibly watched, while moves
    /// and `mkdir`s between unrelated directories stay filtered out in the kernel.
    #[inline(always)]
    fn parent_known(scratch: &mut Scratch) -> bool {
        // SAFETY: a plain field of the scratch slot, written by `last_component`.
        let mut end = unsafe { read_volatile(addr_of!(scratch.start)) } as usize & PATH_MASK;
        // The slash before the last component, and any repeated ones ("a//name").
        for _ in 0..4 {
            if end > 0 && path_byte(scratch, end - 1) == b'/' {
                end -= 1;
            }
        }
        if end == 0 {
            // "/name": the parent is the filesystem root, never a watched directory's name.
            return false;
        }
        let (start, _) = component_start(scratch, end);
        let parent = addr_of_mut!(scratch.parent);
        if copy_component(scratch, start, end, parent).is_none() {
            return false;
        }
        // SAFETY: the value is copied out at once.
        match unsafe { NAMES.get(&scratch.parent) } {
            Some(holder) => {
                scratch.parent_id = u64::from(holder.id);
                true
            }
            None => false,
        }
    }

    /// The `parent` of a name-only event: no identity (dev 0), and in `ino` the NAMES id of
    /// the path's parent component when [`parent_known`] found one, so userspace checks the name
    /// only in the watched directories so named (0: unknown, check everywhere).
    #[inline(always)]
    fn name_only_parent(scratch: &Scratch) -> DirKey {
        DirKey {
            dev: 0,
            ino: scratch.parent_id,
        }
    }

    /// Where the component that ends at `end` (exclusive) in `scratch.path` starts: after the last
    /// slash before `end` within a name's reach, or 0; and whether there was no such slash.
    ///
    /// The slash is found a word at a time (a word holds a slash iff `(x - ONES) & !x & HIGHS` is
    /// non-zero for `x = word ^ SLASHES`), then byte by byte within that one word.
    #[inline(always)]
    fn component_start(scratch: &mut Scratch, end: usize) -> (usize, bool) {
        // The word holding the last slash before `end`, if any within reach of a name.
        let last_word = (end - 1) / 8;
        let words = scratch.path.as_ptr().cast::<u64>();
        let mut slash_word = None;
        for back in 0..SCANNED_WORDS {
            if back > last_word {
                break;
            }
            let w = last_word - back;
            // Through memory, so the compiler cannot turn the masked index into a pointer it
            // steps down (which the verifier cannot bound).
            scratch.word = w as u64;
            // SAFETY: `Scratch` is 8-aligned with `path` first, and the index is masked to it.
            let mut x = unsafe {
                let index = read_volatile(addr_of!(scratch.word)) as usize & WORD_MASK;
                *words.add(index)
            } ^ SLASHES;
            if back == 0 {
                // Bytes at or past `end` (the NUL, stale bytes, the name after it) must not match.
                let valid = end - w * 8;
                if valid < 8 {
                    x |= !0u64 << ((8 * valid) & 63);
                }
            }
            if x.wrapping_sub(ONES) & !x & HIGHS != 0 {
                slash_word = Some(w);
                break;
            }
        }
        if let Some(w) = slash_word {
            // The bit trick can flag a byte above a real slash too; find the real one exactly.
            for i in (0..8).rev() {
                let at = w * 8 + i;
                if at < end && path_byte(scratch, at) == b'/' {
                    return (at + 1, false);
                }
            }
        }
        (0, true)
    }

    /// `scratch.path[index]`, the index masked where the verifier sees it. The index goes through
    /// memory first, so the compiler cannot drop the mask as redundant after a comparison that
    /// already bounds it (`at < end`, `end > 0`): older verifiers (6.1's) learn no bounds from
    /// comparing two registers or from `x != 0`, and reject the access without the mask.
    #[inline(always)]
    fn path_byte(scratch: &mut Scratch, index: usize) -> u8 {
        scratch.word = index as u64;
        // SAFETY: a plain field of the scratch slot, just written.
        let index = unsafe { read_volatile(addr_of!(scratch.word)) } as usize & PATH_MASK;
        scratch.path[index]
    }

    /// Copies `scratch.path[start..end]` NUL-padded into `dst` (a name buffer in the scratch slot)
    /// and records `start` in `scratch.start`; returns the length, or `None` if it is empty or too
    /// long for a name.
    #[inline(always)]
    fn copy_component(
        scratch: &mut Scratch,
        start: usize,
        end: usize,
        dst: *mut NameKey,
    ) -> Option<usize> {
        scratch.start = start as u64;
        scratch.len = end.saturating_sub(start) as u64;
        // SAFETY: plain fields of the scratch slot; reloaded so the verifier meets fresh unknowns
        // instead of the product of the loops' ranges.
        let (start, len) = unsafe {
            (
                read_volatile(addr_of!(scratch.start)) as usize,
                read_volatile(addr_of!(scratch.len)) as usize,
            )
        };
        if len == 0 || len >= NAME_LEN {
            return None;
        }
        // SAFETY: `dst` is a name buffer inside the scratch slot, exclusively ours.
        unsafe { (*dst).bytes = [0; NAME_LEN] };
        // SAFETY: copies `len` (< NAME_LEN, masked so the verifier sees it) bytes within the scratch
        // slot: from `path[start..]` (start + len <= end < PATH_BUF_LEN) to the name buffer.
        let copied = unsafe {
            raw_probe_read_kernel(
                addr_of_mut!((*dst).bytes).cast(),
                (len & (NAME_LEN - 1)) as u32,
                scratch.path.as_ptr().add(start & PATH_MASK).cast(),
            )
        };
        (copied == 0).then_some(len)
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
    /// there was one that concerns the tree (a removal by name only if its name is in `NAMES`
    /// now, when the entry is gone: see `scope::NAME_IF_KNOWN`).
    #[inline(always)]
    fn report_parked(map: &HashMap<u64, Event>, thread: u64, succeeded: bool) -> bool {
        let Some(pending) = map.get_ptr(&thread) else {
            return false;
        };
        // SAFETY: `pending` is a live map value of this thread; its name is a whole key.
        let by_name = unsafe { (*pending).scope } == scope::NAME_IF_KNOWN;
        // A name the table may lack (it is incomplete) counts when the path's parent component
        // is a known name: the agent looks for it in the directories so named.
        let concerns_tree = !by_name
            || unsafe { NAMES.get(&(*pending).name) }.is_some()
            || (names_incomplete() && unsafe { (*pending).parent.ino } != 0);
        // A known name's removal, or a listener's release (see `wake_flags_when`).
        let prompt = by_name || unsafe { (*pending).kind } == kind::RELEASE;
        if succeeded && concerns_tree {
            let pending = pending.cast_mut();
            // SAFETY: `pending` is a live map value of this thread, removed below: its last use.
            unsafe {
                (*pending).ktime_ns = now_ns();
                if by_name {
                    (*pending).scope = scope::NAME_ONLY;
                }
                submit(&*pending, prompt);
            }
        }
        let _ = map.remove(&thread);
        concerns_tree
    }

    // ---------------------------------------------------------------------------------------------
    // listen, close, shutdown: whether something serves a socket (the agent's liveness hints)

    // Attached in every hook family (there is no VFS function for any). A bound socket that
    // starts listening is reported so an unserved plugin registers the moment it serves; a closed
    // (or shut down: connects are refused from then on, though the process keeps the descriptor)
    // descriptor of a listening socket whose file is still there is reported so the agent checks,
    // with one connect, whether the listener went with it (another descriptor, in a child say,
    // may still hold it); after an unlink, the removal has said it all (`still_linked`). A process
    // that exits closes its descriptors without `close`: that is the pidfd the agent holds for
    // each process serving a registered plugin.

    /// `TCP_LISTEN`, the state of a listening socket (unix sockets reuse the TCP states).
    const TCP_LISTEN: u8 = 10;

    /// The path-bound `AF_UNIX` socket behind descriptor `fd` of the current task: its dentry in
    /// the tree, and whether it listens. `None` for anything else (the common case, decided by the
    /// inode's mode before anything socket-specific is read).
    #[inline(always)]
    fn bound_unix_socket(fd: u64) -> Option<(usize, bool)> {
        let file = fd_file(fd)?;
        let file_dentry = kptr(file, offset!(file_dentry))?;
        let inode = kptr(file_dentry, offset!(dentry_inode))?;
        let mode = kread::<u16>(inode, offset!(inode_mode))?;
        if u64::from(mode) & S_IFMT != S_IFSOCK {
            return None;
        }
        let socket = kptr(file, offset!(file_private_data))?;
        let sk = kptr(socket, offset!(socket_sk))?;
        if kread::<u16>(sk, offset!(sock_family))? != AF_UNIX {
            return None;
        }
        // Unbound and abstract sockets have no dentry.
        let dentry = kptr(sk, offset!(unix_sock_dentry))?;
        let listening = kread::<u8>(sk, offset!(sock_state))? == TCP_LISTEN;
        Some((dentry, listening))
    }

    #[tracepoint]
    pub fn listen_enter(ctx: TracePointContext) -> u32 {
        let _ = try_listen_enter(&ctx);
        0
    }

    fn try_listen_enter(ctx: &TracePointContext) -> Option<()> {
        if is_agent() {
            return None;
        }
        let fd = arg_u64(ctx, 0)?;
        // Only path-bound unix sockets, and only their first listen (a second changes nothing).
        let (_, listening) = bound_unix_socket(fd)?;
        if listening {
            return None;
        }
        // A thread runs one syscall at a time: bind's table holds listen's descriptor as well.
        if PENDING_BINDS
            .insert(bpf_get_current_pid_tgid(), fd as u32, 0)
            .is_err()
        {
            count_loss(loss::PENDING_FULL);
        }
        Some(())
    }

    #[tracepoint]
    pub fn listen_exit(ctx: TracePointContext) -> u32 {
        let _ = try_listen_exit(&ctx);
        0
    }

    fn try_listen_exit(ctx: &TracePointContext) -> Option<()> {
        let fd = parked_fd_if_succeeded(&PENDING_BINDS, ctx)?;
        let (dentry, listening) = bound_unix_socket(u64::from(fd))?;
        if !listening {
            return None;
        }
        // Plugin sockets are entries of watched directories (every directory of the tree is);
        // one in a directory not watched yet was reported by its bind, as that directory.
        let parent = dir_key(kptr(dentry, offset!(dentry_parent))?)?;
        // SAFETY: presence check only.
        unsafe { WATCHED.get(&parent) }?;
        report_dentry(dentry, parent, kind::LISTEN)
    }

    // ---------------------------------------------------------------------------------------------
    // connect: who first contacts a plugin socket (kubelet's first GetInfo, when the agent
    // observes beside it)

    /// One socket instance: its file's dentry and inode, and the inode's number and generation.
    /// A socket unlinked and bound again at the same name can get the same dentry (kept negative
    /// in between), the same inode memory and even the same number (ext4 reuses them at once),
    /// never the same generation too (filesystems draw it at random for every new inode).
    #[repr(C)]
    struct ContactKey {
        dentry: u64,
        inode: u64,
        ino: u64,
        generation: u64,
    }

    /// The socket instances whose first contact was reported, so that a process that connects
    /// again and again (a client of the plugin, a hostile loop) costs one record per instance.
    /// LRU: bounded, and an instance evicted by 16,384 newer ones is at worst reported again.
    #[map]
    static CONTACTED: LruHashMap<ContactKey, u8> = LruHashMap::with_max_entries(16384, 0);

    #[tracepoint]
    pub fn connect_enter(ctx: TracePointContext) -> u32 {
        let _ = try_connect_enter(&ctx);
        0
    }

    fn try_connect_enter(ctx: &TracePointContext) -> Option<()> {
        if is_agent() {
            return None;
        }
        let fd = arg_u64(ctx, 0)?;
        if !unix_path_address(arg_u64(ctx, 1)?, arg_u64(ctx, 2)?) {
            return None;
        }
        // A full table loses a contact, which describes a plugin and is not tree state: no
        // rescan.
        PENDING_CONNECTS
            .insert(bpf_get_current_pid_tgid(), fd as u32, 0)
            .ok()
    }

    #[tracepoint]
    pub fn connect_exit(ctx: TracePointContext) -> u32 {
        let _ = try_connect_exit(&ctx);
        0
    }

    fn try_connect_exit(ctx: &TracePointContext) -> Option<()> {
        let fd = parked_fd_if_succeeded(&PENDING_CONNECTS, ctx)?;
        let file = fd_file(u64::from(fd))?;
        let socket = kptr(file, offset!(file_private_data))?;
        let sk = kptr(socket, offset!(socket_sk))?;
        if kread::<u16>(sk, offset!(sock_family))? != AF_UNIX {
            return None;
        }
        // The server's end carries the path the caller reached: the listener's, for a stream.
        let peer = kptr(sk, offset!(unix_sock_peer))?;
        let dentry = kptr(peer, offset!(unix_sock_dentry))?;
        // As for `listen`: entries of watched directories only.
        let parent = dir_key(kptr(dentry, offset!(dentry_parent))?)?;
        // SAFETY: presence check only.
        unsafe { WATCHED.get(&parent) }?;
        let inode = kptr(dentry, offset!(dentry_inode))?;
        let key = ContactKey {
            dentry: dentry as u64,
            inode: inode as u64,
            ino: kread::<u64>(inode, offset!(inode_ino))?,
            generation: u64::from(kread::<u32>(inode, offset!(inode_generation))?),
        };
        // Only the first contact of an instance inserts its key.
        CONTACTED.insert(&key, &1, BPF_NOEXIST).ok()?;
        report_dentry(dentry, parent, kind::CONNECT)
    }

    /// Whether the socket inode at `dentry` still has a name. A plugin going away unlinks its
    /// socket, then closes its listener: that release says nothing the removal did not, and as a
    /// second prompt record per plugin it cost the agent a wake-up and a hand-over in the middle
    /// of its deregistrations. The bound socket holds its dentry, which stays positive after the
    /// unlink, its inode's `i_nlink` 0.
    #[inline(always)]
    fn still_linked(dentry: usize) -> bool {
        kptr(dentry, offset!(dentry_inode))
            .and_then(|inode| kread::<u32>(inode, offset!(inode_nlink)))
            .is_some_and(|links| links != 0)
    }

    /// A listening socket's descriptor closes or is shut down (`close` and `shutdown` both take
    /// it first): parked until the call returns, then reported if it succeeded (by `close_exit`).
    #[tracepoint]
    pub fn close_enter(ctx: TracePointContext) -> u32 {
        let _ = try_close_enter(&ctx);
        0
    }

    fn try_close_enter(ctx: &TracePointContext) -> Option<()> {
        if is_agent() {
            return None;
        }
        let (dentry, listening) = bound_unix_socket(arg_u64(ctx, 0)?)?;
        if !listening || !still_linked(dentry) {
            return None;
        }
        // As for `listen`: entries of watched directories only.
        let parent = dir_key(kptr(dentry, offset!(dentry_parent))?)?;
        // SAFETY: presence check only.
        unsafe { WATCHED.get(&parent) }?;
        let name = kptr(dentry, offset!(dentry_name))?;
        let name_len = kread::<u32>(dentry, offset!(dentry_name_len))?;
        let scratch = SCRATCH.get_ptr_mut(0)?;
        // SAFETY: the per-CPU scratch slot is ours for the duration of this program run.
        let event = unsafe { &mut *addr_of_mut!((*scratch).event) };
        event.name.bytes = [0; NAME_LEN];
        // SAFETY: bpf_probe_read_kernel_str fails instead of faulting.
        let _ =
            unsafe { bpf_probe_read_kernel_str_bytes(name as *const u8, &mut event.name.bytes) };
        event.kind = kind::RELEASE;
        event.scope = scope::EXACT;
        // SAFETY: `event` is this program run's per-CPU scratch record.
        unsafe { Caller::current().stamp(event) };
        event.name_len = name_len;
        event.parent = parent;
        park(&PENDING, event);
        Some(())
    }

    /// The last reference to a socket is dropped (`unix_release`: once per socket, whoever held
    /// it, by a `close` or an exit): a listening one in a watched directory is reported. The
    /// fentry family's release hint; the tracepoints' `close` pair stands in where fentry is
    /// refused, without exits.
    #[fentry(function = "unix_release")]
    pub fn unix_release_enter(ctx: FEntryContext) -> u32 {
        let _ = try_unix_release_enter(&ctx);
        0
    }

    fn try_unix_release_enter(ctx: &FEntryContext) -> Option<()> {
        let socket = func_arg(ctx.as_ptr(), 0)? as usize;
        let sk = kptr(socket, offset!(socket_sk))?;
        if kread::<u16>(sk, offset!(sock_family))? != AF_UNIX
            || kread::<u8>(sk, offset!(sock_state))? != TCP_LISTEN
        {
            return None;
        }
        let dentry = kptr(sk, offset!(unix_sock_dentry))?;
        if !still_linked(dentry) {
            return None;
        }
        let parent = dir_key(kptr(dentry, offset!(dentry_parent))?)?;
        // SAFETY: presence check only.
        unsafe { WATCHED.get(&parent) }?;
        report_dentry(dentry, parent, kind::RELEASE)
    }

    #[tracepoint]
    pub fn close_exit(ctx: TracePointContext) -> u32 {
        let thread = bpf_get_current_pid_tgid();
        // Most closes parked nothing: one lookup, then out.
        if unsafe { PENDING.get(&thread) }.is_none() {
            return 0;
        }
        // SAFETY: offset within the sys_exit_close record.
        let succeeded = matches!(unsafe { ctx.read_at::<i64>(RET) }, Ok(0));
        report_parked(&PENDING, thread, succeeded);
        0
    }

    // ---------------------------------------------------------------------------------------------
    // fentry/fexit on the VFS: the preferred family, where the kernel allows it

    // These see the dentry an operation acts on, so every path form (relative, `..`, chroot,
    // another mount namespace, a multi-component path into a directory just created) lands on the
    // parent's identity with no path scan and no name table. Unix `bind` creates its inode with
    // `vfs_mknod(S_IFSOCK)`, so one program covers `bind` and `mknod`. Argument positions and
    // `struct renamedata` offsets come from the running kernel's BTF ([`VfsArgs`](agent_ebpf::VfsArgs)).
    //
    // The build machine's kernel refuses fentry/fexit (EPERM) and the loader falls back to the
    // tracepoints above there (and says why); `cargo xtask vm-test` runs these on Debian's 6.1.

    /// Argument `n` of the traced function, read with a helper from the program's context (an
    /// array of u64 on the trampoline's stack) so it is a plain number to the verifier: `n` comes
    /// from CONFIG, and offset arithmetic on it follows.
    #[inline(always)]
    fn func_arg(ctx: *mut core::ffi::c_void, n: u32) -> Option<u64> {
        if n >= 12 {
            return None;
        }
        let slot = (ctx as *const u64).wrapping_add((n & 15) as usize);
        // SAFETY: bpf_probe_read_kernel fails instead of faulting; `slot` is within the context.
        unsafe { bpf_probe_read_kernel(slot) }.ok()
    }

    macro_rules! vfs {
        ($field:ident) => {
            // SAFETY: see `offset!`.
            unsafe { read_volatile(addr_of!(CONFIG.vfs.$field)) }
        };
    }

    /// The traced function's return value, from the context slot after its `slot` arguments
    /// (the trampoline stores it there for fexit programs on every kernel that has them;
    /// `bpf_get_func_ret`, which `FExitContext::ret` calls, arrived only in 5.17).
    #[inline(always)]
    fn func_ret(ctx: *mut core::ffi::c_void, slot: u32) -> Option<u64> {
        func_arg(ctx, slot)
    }

    /// Whether an `int`-returning VFS function succeeded (0; the upper half of the register is
    /// not defined for an `int`).
    fn int_ok(ret: Option<u64>) -> bool {
        matches!(ret, Some(r) if r as u32 == 0)
    }

    /// A socket inode created: `bind` of a unix socket to a path, or `mknod(S_IFSOCK)`.
    #[fexit(function = "vfs_mknod")]
    pub fn vfs_mknod_exit(ctx: FExitContext) -> u32 {
        let _ = try_vfs_mknod_exit(&ctx);
        0
    }

    fn try_vfs_mknod_exit(ctx: &FExitContext) -> Option<()> {
        if is_agent() || !int_ok(func_ret(ctx.as_ptr(), vfs!(mknod_ret))) {
            return None;
        }
        let mode = func_arg(ctx.as_ptr(), vfs!(mknod_mode))?;
        if mode & S_IFMT != S_IFSOCK {
            return None;
        }
        let dentry = func_arg(ctx.as_ptr(), vfs!(mknod_dentry))? as usize;
        report_below_watched(dentry, kind::CREATE)
    }

    /// A directory created: joins the watched set at once (`mkdir -p a/b/c` reports `a`).
    #[fexit(function = "vfs_mkdir")]
    pub fn vfs_mkdir_exit(ctx: FExitContext) -> u32 {
        let _ = try_vfs_mkdir_exit(&ctx);
        0
    }

    fn try_vfs_mkdir_exit(ctx: &FExitContext) -> Option<()> {
        if is_agent() {
            return None;
        }
        let ret = func_ret(ctx.as_ptr(), vfs!(mkdir_ret));
        let dentry = if vfs!(mkdir_returns_ptr) != 0 {
            // The new directory's dentry (which may not be the argument's, then released), or an
            // ERR_PTR (the top 4095 values).
            match ret {
                Some(r) if r != 0 && r < (-4095i64) as u64 => r as usize,
                _ => return None,
            }
        } else if int_ok(ret) {
            func_arg(ctx.as_ptr(), vfs!(mkdir_dentry))? as usize
        } else {
            return None;
        };
        report_below_watched(dentry, kind::CREATE)
    }

    /// An entry unlinked.
    #[fexit(function = "vfs_unlink")]
    pub fn vfs_unlink_exit(ctx: FExitContext) -> u32 {
        let _ = try_vfs_removal_exit(&ctx, vfs!(unlink_dentry), vfs!(unlink_ret));
        0
    }

    /// A directory removed.
    #[fexit(function = "vfs_rmdir")]
    pub fn vfs_rmdir_exit(ctx: FExitContext) -> u32 {
        let _ = try_vfs_removal_exit(&ctx, vfs!(rmdir_dentry), vfs!(rmdir_ret));
        0
    }

    fn try_vfs_removal_exit(ctx: &FExitContext, dentry_arg: u32, ret_slot: u32) -> Option<()> {
        if is_agent() || !int_ok(func_ret(ctx.as_ptr(), ret_slot)) {
            return None;
        }
        // The dentry is negative now, but keeps its parent and name.
        let dentry = func_arg(ctx.as_ptr(), dentry_arg)? as usize;
        let parent = dir_key(kptr(dentry, offset!(dentry_parent))?)?;
        // SAFETY: presence check only.
        unsafe { WATCHED.get(&parent) }?;
        report_dentry(dentry, parent, kind::REMOVE)
    }

    /// Before a rename: the source's directory and name, which the move overwrites, parked for
    /// the thread until [`vfs_rename_exit`].
    #[fentry(function = "vfs_rename")]
    pub fn vfs_rename_enter(ctx: FEntryContext) -> u32 {
        let _ = try_vfs_rename_enter(&ctx);
        0
    }

    fn try_vfs_rename_enter(ctx: &FEntryContext) -> Option<()> {
        if is_agent() {
            return None;
        }
        let rd = func_arg(ctx.as_ptr(), vfs!(rename_data))? as usize;
        let old = kptr(rd, vfs!(renamedata_old_dentry) as usize)?;
        let flags = kread::<u32>(rd, vfs!(renamedata_flags) as usize)?;
        let parent = dir_key(kptr(old, offset!(dentry_parent))?)?;
        // SAFETY: presence check only.
        unsafe { WATCHED.get(&parent) }?;
        let scratch = SCRATCH.get_ptr_mut(0)?;
        // SAFETY: the per-CPU scratch slot is ours for the duration of this program run.
        let event = unsafe { &mut (*scratch).event };
        let name = kptr(old, offset!(dentry_name))?;
        event.name.bytes = [0; NAME_LEN];
        // SAFETY: bpf_probe_read_kernel_str fails instead of faulting.
        let len =
            unsafe { bpf_probe_read_kernel_str_bytes(name as *const u8, &mut event.name.bytes) }
                .ok()?
                .len();
        event.name_len = len as u32;
        // The source of a RENAME_EXCHANGE is replaced, not removed (the watcher stats it anyway).
        event.kind = if u64::from(flags) & RENAME_EXCHANGE != 0 {
            kind::CREATE
        } else {
            kind::REMOVE
        };
        event.scope = scope::EXACT;
        event.parent = parent;
        // SAFETY: `event` is this program run's per-CPU scratch record.
        unsafe { Caller::current().stamp(event) };
        park(&PENDING, event);
        Some(())
    }

    /// After a rename: the parked source, if it succeeded, and the target, which the source's
    /// dentry now is (`d_move` gave it the target's parent and name).
    #[fexit(function = "vfs_rename")]
    pub fn vfs_rename_exit(ctx: FExitContext) -> u32 {
        let succeeded = int_ok(func_ret(ctx.as_ptr(), vfs!(rename_ret)));
        let thread = bpf_get_current_pid_tgid();
        report_parked(&PENDING, thread, succeeded);
        if succeeded && !is_agent() {
            let _ = try_vfs_rename_target(&ctx);
        }
        0
    }

    fn try_vfs_rename_target(ctx: &FExitContext) -> Option<()> {
        let rd = func_arg(ctx.as_ptr(), vfs!(rename_data))? as usize;
        let moved = kptr(rd, vfs!(renamedata_old_dentry) as usize)?;
        report_below_watched(moved, kind::CREATE)
    }

    #[panic_handler]
    fn panic(_info: &core::panic::PanicInfo) -> ! {
        // SAFETY: the verifier rejects any program with a reachable panic path.
        unsafe { core::hint::unreachable_unchecked() }
    }
}
