//! The fentry family's release hint: the last reference to a socket is dropped. The tracepoints'
//! `close` pair (`socket`) stands in where fentry is refused, without exits.

use agent_ebpf::kind;
use aya_ebpf::EbpfContext;
use aya_ebpf::macros::fentry;
use aya_ebpf::programs::FEntryContext;

use super::kernel::{bound_dentry, func_arg, is_listening, still_linked, unix_sock};
use super::report::{report_dentry, watched_parent};

/// The last reference to a socket is dropped (`unix_release`: once per socket, whoever held
/// it, by a `close` or an exit): a listening one in a watched directory is reported.
#[fentry(function = "unix_release")]
pub fn unix_release_enter(ctx: FEntryContext) -> u32 {
    let _ = try_unix_release_enter(&ctx);
    0
}

fn try_unix_release_enter(ctx: &FEntryContext) -> Option<()> {
    let sk = unix_sock(func_arg(ctx.as_ptr(), 0)? as usize)?;
    if !is_listening(sk)? {
        return None;
    }
    let dentry = bound_dentry(sk)?;
    if !still_linked(dentry) {
        return None;
    }
    let parent = watched_parent(dentry)?;
    report_dentry(dentry, parent, kind::RELEASE)
}
