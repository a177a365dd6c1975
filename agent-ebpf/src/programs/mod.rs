//! The kernel programs, one file per family, over a few shared pieces.
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
//!
//! The families (each program keeps the name the agent's loader attaches it by):
//! - [`path_syscalls`]: `path_enter`, `rename_target_enter`, `path_exit` (unlink, mknod, mkdir,
//!   rename by path), with the path scan in [`path_scan`];
//! - [`socket`]: `bind_*`, `listen_*`, `close_*` (a socket's life: bound, served, closed);
//! - [`connect`]: `connect_*` (who first contacts a plugin socket);
//! - [`release`]: `unix_release_enter` (fentry: a listener's last reference dropped);
//! - [`vfs`]: the fentry/fexit programs on the VFS, the preferred family, with [`in_flight`]
//!   (`in_flight_check`): the calls whose fexit the kernel skipped, counted as a loss.
//!
//! Shared by them: [`kernel`] (CONFIG, kernel memory reads, the descriptor -> file -> socket ->
//! sock -> dentry walk), [`maps`], [`report`] (the caller, the tree filter, building, parking and
//! submitting records, the wake-up policy, loss counting) and [`syscall`] (a tracepoint record's
//! arguments and result).

mod connect;
mod in_flight;
mod kernel;
mod maps;
mod path_scan;
mod path_syscalls;
mod release;
mod report;
mod socket;
mod syscall;
mod vfs;

/// Kernels refuse `bpf_probe_read_kernel` to programs without a GPL-compatible license.
#[unsafe(no_mangle)]
#[unsafe(link_section = "license")]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // SAFETY: the verifier rejects any program with a reachable panic path.
    unsafe { core::hint::unreachable_unchecked() }
}
