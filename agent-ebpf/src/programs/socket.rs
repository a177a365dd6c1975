//! A socket's life on syscall tracepoints: `bind` (a socket appears in the tree), `listen` and
//! `close`/`shutdown` (whether something serves it: the agent's liveness hints).
//!
//! `listen` and `shutdown` are attached in every hook family (there is no VFS function for
//! either), `bind` and `close` where fentry is refused. A bound socket that starts listening is
//! reported so an unserved plugin registers the moment it serves; a closed (or shut down: connects
//! are refused from then on, though the process keeps the descriptor) descriptor of a listening
//! socket whose file is still there is reported so the agent checks, with one connect, whether the
//! listener went with it (another descriptor, in a child say, may still hold it); after an unlink,
//! the removal has said it all (`still_linked`). A process that exits closes its descriptors
//! without `close`: that is the pidfd the agent holds for each process serving a registered
//! plugin.

use agent_ebpf::{kind, loss};
use aya_ebpf::helpers::bpf_get_current_pid_tgid;
use aya_ebpf::macros::{map, tracepoint};
use aya_ebpf::maps::HashMap;
use aya_ebpf::programs::TracePointContext;

use super::kernel::{bound_dentry, bound_unix_socket, fd_unix_sock, still_linked};
use super::maps::PENDING;
use super::report::{
    count_loss, dentry_event, is_agent, park, report_below_watched, report_dentry, report_parked,
    watched_parent,
};
use super::syscall::{arg_u64, parked_fd_if_succeeded, returned_zero, unix_path_socket_fd};

/// `bind` arguments between entry and exit, keyed by `pid_tgid` (the thread); `listen`'s too.
#[map]
static PENDING_BINDS: HashMap<u64, u32> = HashMap::with_max_entries(4096, 0);

/// Parks descriptor `fd` for this thread's `bind` or `listen` exit.
#[inline(always)]
fn park_fd(fd: u64) {
    // A thread runs one syscall at a time: bind's table holds listen's descriptor as well.
    if PENDING_BINDS
        .insert(bpf_get_current_pid_tgid(), fd as u32, 0)
        .is_err()
    {
        count_loss(loss::PENDING_FULL);
    }
}

// -------------------------------------------------------------------------------------------------
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
    let fd = unix_path_socket_fd(ctx)?;
    park_fd(fd);
    Some(())
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
    let dentry = bound_dentry(fd_unix_sock(fd)?)?;
    report_below_watched(dentry, kind::BIND)
}

// -------------------------------------------------------------------------------------------------
// listen

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
    park_fd(fd);
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
    let parent = watched_parent(dentry)?;
    report_dentry(dentry, parent, kind::LISTEN)
}

// -------------------------------------------------------------------------------------------------
// close, shutdown

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
    let parent = watched_parent(dentry)?;
    let event = dentry_event(dentry, parent, kind::RELEASE)?;
    park(&PENDING, event);
    Some(())
}

#[tracepoint]
pub fn close_exit(ctx: TracePointContext) -> u32 {
    let thread = bpf_get_current_pid_tgid();
    // Most closes parked nothing: one lookup, then out.
    // SAFETY: presence check only.
    if unsafe { PENDING.get(&thread) }.is_none() {
        return 0;
    }
    report_parked(&PENDING, thread, returned_zero(&ctx));
    0
}
