//! `connect`: who first contacts a plugin socket (kubelet's first GetInfo, when the agent
//! observes beside it). Attached in every hook family: the socket a `connect` reached is known
//! only once it returned.

use agent_ebpf::kind;
use aya_ebpf::helpers::bpf_get_current_pid_tgid;
use aya_ebpf::macros::{map, tracepoint};
use aya_ebpf::maps::{HashMap, LruHashMap};
use aya_ebpf::programs::TracePointContext;

use super::kernel::{bound_dentry, fd_unix_sock, kptr, kread, offset};
use super::report::{is_agent, report_dentry, watched_parent};
use super::syscall::{parked_fd_if_succeeded, unix_path_socket_fd};

const BPF_NOEXIST: u64 = 1;

/// `connect` descriptors between entry and exit, keyed by `pid_tgid` (the thread); a table of
/// their own because a `connect` can block (on a listener that never accepts), and any process
/// anywhere could then hold thousands of entries: full, it loses contacts, never binds (tree
/// state).
#[map]
static PENDING_CONNECTS: HashMap<u64, u32> = HashMap::with_max_entries(4096, 0);

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
    let fd = unix_path_socket_fd(ctx)?;
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
    let sk = fd_unix_sock(fd)?;
    // The server's end carries the path the caller reached: the listener's, for a stream.
    let dentry = bound_dentry(kptr(sk, offset!(unix_sock_peer))?)?;
    // As for `listen`: entries of watched directories only.
    let parent = watched_parent(dentry)?;
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
