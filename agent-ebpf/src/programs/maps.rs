//! The maps more than one family uses (each family's own are in its file), and the per-CPU
//! scratch memory.

use agent_ebpf::{DirKey, Event, META_BYTES, NameHolder, NameKey, PATH_BUF_LEN, agent, loss};
use aya_ebpf::macros::map;
use aya_ebpf::maps::{Array, HashMap, PerCpuArray, RingBuf};

const BPF_F_NO_PREALLOC: u32 = 1;
const BPF_F_MMAPABLE: u32 = 1 << 10;

/// Sized by the loader (`EbpfOptions::ring_buffer_bytes`); this is only the object's default.
#[map]
pub(super) static EVENTS: RingBuf = RingBuf::with_byte_size(2 << 20, 0);

#[map]
pub(super) static WATCHED: HashMap<DirKey, u8> = HashMap::with_max_entries(16384, 0);

#[map]
pub(super) static NAMES: HashMap<NameKey, NameHolder> =
    HashMap::with_max_entries(16384, BPF_F_NO_PREALLOC);

/// Each CPU's counter per reason, at `cpu * loss::COUNT + reason`; the loader sizes it to the
/// possible CPUs. A plain array, not a per-CPU one, because it can be mapped: the agent reads
/// it after every drain of the ring from its own memory, where a per-CPU array costs a `bpf`
/// syscall per counter. Each CPU writes only its own slots.
#[map]
pub(super) static LOSSES: Array<u64> = Array::with_max_entries(loss::COUNT, BPF_F_MMAPABLE);

/// An event that passed the filter at entry, reported at exit if the call succeeded: a path
/// syscall's first path (`path_syscalls`), a rename's source (`vfs`), a listener's `close`
/// (`socket`).
#[map]
pub(super) static PENDING: HashMap<u64, Event> = HashMap::with_max_entries(4096, 0);

/// When the reader was last woken (`bpf_ktime_get_ns`), shared by all CPUs.
#[map]
pub(super) static LAST_WAKE: Array<u64> = Array::with_max_entries(1, 0);

/// The agent's tgid and whether the name table is incomplete (see `names::AGENT`).
#[map]
pub(super) static AGENT: Array<u32> = Array::with_max_entries(agent::SLOTS, 0);

/// What the loader computed, for an agent that adopts these programs (see `names::META`).
#[map]
static META: Array<[u8; META_BYTES]> = Array::with_max_entries(1, 0);

/// Per-CPU working memory too big for the 512-byte BPF stack.
#[map]
pub(super) static SCRATCH: PerCpuArray<Scratch> = PerCpuArray::with_max_entries(1, 0);

#[repr(C)]
pub(super) struct Scratch {
    pub(super) path: [u8; PATH_BUF_LEN],
    pub(super) event: Event,
    /// The component before the last one, for `path_scan::parent_known`.
    pub(super) parent: NameKey,
    /// The NAMES value of `parent` when `parent_known` found it (0: none).
    pub(super) parent_id: u64,
    pub(super) start: u64,
    pub(super) len: u64,
    pub(super) dfd: i64,
    pub(super) path_ptr: u64,
    pub(super) op: u64,
    pub(super) word: u64,
}

/// This CPU's scratch slot.
///
/// # Safety
/// One program run uses it at a time on a CPU, and the caller holds no other reference into it.
#[inline(always)]
pub(super) unsafe fn scratch_slot() -> Option<&'static mut Scratch> {
    let scratch = SCRATCH.get_ptr_mut(0)?;
    // SAFETY: the per-CPU scratch slot is ours for the duration of this program run (the
    // caller's promise).
    Some(unsafe { &mut *scratch })
}
