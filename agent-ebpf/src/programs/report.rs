//! What every family does with what it saw: who made the call ([`Caller`]), whether an entry is
//! in the tree ([`watched_parent`], [`report_below_watched`]), building a record
//! ([`dentry_event`]), parking it until its syscall returns ([`park`], [`report_parked`]),
//! submitting it to the ring ([`submit`], with its wake-up policy) and counting what is lost.

use core::ptr::{addr_of, addr_of_mut};

use agent_ebpf::{COMM_LEN, DirKey, Event, NAME_LEN, agent, kind, loss, scope};
use aya_ebpf::helpers::generated::bpf_get_current_cgroup_id;
use aya_ebpf::helpers::{
    bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_current_uid_gid,
    bpf_get_smp_processor_id, bpf_probe_read_kernel_str_bytes,
};
use aya_ebpf::maps::HashMap;

use super::kernel::{CONFIG, config_u64, current_tgid, dir_key, kptr, kread, now_ns, offset};
use super::maps::{AGENT, EVENTS, LAST_WAKE, LOSSES, NAMES, SCRATCH, WATCHED};

const BPF_RB_NO_WAKEUP: u64 = 1;
const BPF_RB_FORCE_WAKEUP: u64 = 2;
const BPF_RB_AVAIL_DATA: u64 = 0;
/// Directories walked up from a bound socket looking for a watched one.
const MAX_DEPTH: usize = 8;

pub(super) fn count_loss(index: u32) {
    count_losses(index, 1);
}

/// Adds `n` to this CPU's counter of loss `index`.
pub(super) fn count_losses(index: u32, n: u64) {
    // SAFETY: a helper without arguments, valid in every tracing program.
    let cpu = unsafe { bpf_get_smp_processor_id() };
    if let Some(counter) = LOSSES.get_ptr_mut(cpu.wrapping_mul(loss::COUNT).wrapping_add(index)) {
        // SAFETY: this CPU's slot (a tracepoint program is not re-entered on one CPU); an
        // aligned u64, which the agent reads whole.
        unsafe { *counter = (*counter).wrapping_add(n) };
    }
}

/// Who is making the call, as a record names its creator: tgid, uid, gid, cgroup and command,
/// taken now (the process may be gone by the time the agent reads the record).
#[derive(Clone, Copy)]
pub(super) struct Caller {
    tgid: u32,
    uid: u32,
    gid: u32,
    cgroup_id: u64,
    comm: [u8; COMM_LEN],
}

impl Caller {
    #[inline(always)]
    pub(super) fn current() -> Caller {
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
    pub(super) unsafe fn stamp(self, event: *mut Event) {
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
pub(super) fn is_agent() -> bool {
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

/// The identity of the directory holding the entry at `dentry`, if it is watched: `None` for
/// an entry of any other directory (or one whose parent cannot be read).
#[inline(always)]
pub(super) fn watched_parent(dentry: usize) -> Option<DirKey> {
    let parent = dir_key(kptr(dentry, offset!(dentry_parent))?)?;
    // SAFETY: presence check only.
    unsafe { WATCHED.get(&parent) }?;
    Some(parent)
}

/// Reports the entry at `dentry` (just created: a socket, a directory, a rename's target) if
/// it is under a watched directory: the entry itself when its directory is watched, otherwise
/// the sub-directory (created but not yet watched) on the way up that holds it, which the
/// watcher then watches and walks. Walks up at most [`MAX_DEPTH`] directories.
#[inline(always)]
pub(super) fn report_below_watched(dentry: usize, what: u32) -> Option<()> {
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

/// Copies the kernel string at `name` (a dentry's name) into `event.name`, NUL padded; returns
/// its length, or `None` if it could not be read (the name is left empty).
#[inline(always)]
pub(super) fn read_name(event: &mut Event, name: usize) -> Option<usize> {
    event.name.bytes = [0; NAME_LEN];
    // SAFETY: bpf_probe_read_kernel_str fails instead of faulting.
    unsafe { bpf_probe_read_kernel_str_bytes(name as *const u8, &mut event.name.bytes) }
        .ok()
        .map(<[u8]>::len)
}

/// Builds, in this CPU's scratch record, an exact event for the entry at `dentry` in the
/// watched directory `parent`, stamped with the caller; the caller submits or parks it.
#[inline(always)]
pub(super) fn dentry_event(dentry: usize, parent: DirKey, what: u32) -> Option<&'static mut Event> {
    let name = kptr(dentry, offset!(dentry_name))?;
    let name_len = kread::<u32>(dentry, offset!(dentry_name_len))?;
    let scratch = SCRATCH.get_ptr_mut(0)?;
    // SAFETY: the per-CPU scratch slot is ours for the duration of this program run, and no
    // caller of this function holds a reference into its `event`.
    let event = unsafe { &mut *addr_of_mut!((*scratch).event) };
    let _ = read_name(event, name);
    event.kind = what;
    event.scope = scope::EXACT;
    // SAFETY: `event` is this program run's per-CPU scratch record.
    unsafe { Caller::current().stamp(event) };
    event.name_len = name_len;
    event.parent = parent;
    Some(event)
}

/// Submits an exact event for the entry at `dentry` in the watched directory `parent`.
#[inline(always)]
pub(super) fn report_dentry(dentry: usize, parent: DirKey, what: u32) -> Option<()> {
    // Built in scratch memory and copied into the ring at its used length (see `submit`).
    let event = dentry_event(dentry, parent, what)?;
    event.ktime_ns = now_ns();
    submit(event, what == kind::LISTEN || what == kind::RELEASE);
    Some(())
}

/// Bytes of a whole event, and where its name starts (a record is cut after the name).
const EVENT_BYTES: u64 = core::mem::size_of::<Event>() as u64;
const NAME_OFFSET: u64 = core::mem::offset_of!(Event, name) as u64;

/// Ring-buffer wake-up policy, called just before this record is written: wake the reader at
/// once when
/// - it was last woken `batch_ns` ago or earlier (a quiet spell: a lone event pays no batching);
/// - or it was last woken at least `batch_ns / 16` ago and either it has consumed everything
///   (it is idle or about to be: a steady trickle under load is not held back a whole batch
///   delay) or the record is `prompt`, whatever is queued; a `bind` is the exception, it does
///   not wake the reader for having caught up: the `listen` that follows a plugin's bind
///   microseconds later is prompt and brings both, where the bind took a wake-up of its own;
/// - or the record is a `listen` and the reader has consumed everything, however recently it
///   was woken: a plugin's `listen` comes microseconds after the `bind` that woke the reader, and
///   the agent dials a socket whose bind it saw only once the listen is reported (a dial before
///   it is refused, and costs a retry), so the listen must not wait for the next batch;
/// - or `wakeup_bytes` are queued (a burst: drain before the ring fills);
///
/// otherwise let the record ride along with the previous wake-up: the reader drains once more
/// `batch_ns` after every drain that found work, which bounds its latency. Wake-ups stay at
/// most 16 per batch delay, plus one per `listen` that finds the reader idle (it has drained
/// everything, so it keeps up; one per plugin), and an idle agent gets none.
///
/// Prompt records are those the agent acts on at once and which are rare (a storm's sockets,
/// bound and unlinked again, cause none): a `listen` (a plugin can be registered), a
/// listener's release (its plugin may have to be deregistered) and the removal of a name the
/// agent knows (an entry it has seen, not noise). Behind a flood of other records they wait
/// `batch_ns / 16` at most, not a whole batch delay, and what they follow rides along.
fn wake_flags_when(prompt: bool, what: u32) -> u64 {
    let now = now_ns();
    let Some(last) = LAST_WAKE.get_ptr_mut(0) else {
        return 0;
    };
    let queued = EVENTS.query(BPF_RB_AVAIL_DATA);
    // SAFETY: the slot is shared between CPUs; a racy read or write only costs an extra or a
    // skipped wake-up decision, both of which the reader's follow-up drain tolerates.
    let elapsed = now.wrapping_sub(unsafe { *last });
    let batch_ns = config_u64(addr_of!(CONFIG.batch_ns));
    let caught_up = what != kind::BIND && (prompt || queued == 0) && elapsed >= batch_ns / 16;
    let listen_idle = what == kind::LISTEN && queued == 0;
    if caught_up
        || listen_idle
        || queued >= config_u64(addr_of!(CONFIG.wakeup_bytes))
        || elapsed >= batch_ns
    {
        // SAFETY: as above.
        unsafe { *last = now };
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    }
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
    let flags = wake_flags_when(prompt, event.kind);
    // SAFETY: `event` is a live Event (in map memory: scratch or a parked value), and `len`
    // is at most its size.
    let used =
        unsafe { core::slice::from_raw_parts(event as *const Event as *const u8, len as usize) };
    if EVENTS.output::<[u8]>(used, flags).is_err() {
        count_loss(loss::RING_FULL);
    }
}

/// Parks `event` for this thread until its syscall (or traced function) returns.
pub(super) fn park(map: &HashMap<u64, Event>, event: &Event) {
    if map.insert(bpf_get_current_pid_tgid(), event, 0).is_err() {
        count_loss(loss::PENDING_FULL);
    }
}

/// Reports (if `succeeded`) and forgets this thread's event parked in `map`; returns whether
/// there was one that concerns the tree (a removal by name only if its name is in `NAMES`
/// now, when the entry is gone: see `scope::NAME_IF_KNOWN`).
#[inline(always)]
pub(super) fn report_parked(map: &HashMap<u64, Event>, thread: u64, succeeded: bool) -> bool {
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
