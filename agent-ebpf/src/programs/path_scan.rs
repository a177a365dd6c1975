//! The path scan of the path syscalls' tracepoints: a user path's last component (and the one
//! before it) copied out of user memory and looked up, written for the verifier.

use core::ptr::{addr_of, addr_of_mut, read_volatile};

use agent_ebpf::{DirKey, NAME_LEN, NameKey, PATH_BUF_LEN};
use aya_ebpf::helpers::bpf_probe_read_user_str_bytes;
use aya_ebpf::helpers::generated::bpf_probe_read_kernel as raw_probe_read_kernel;

use super::maps::{NAMES, Scratch};

/// Masks an index into `Scratch::path` so the verifier sees it in bounds.
const PATH_MASK: usize = PATH_BUF_LEN - 1;
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
pub(super) fn last_component(scratch: &mut Scratch, path: u64) -> Option<bool> {
    // SAFETY: bpf_probe_read_user_str fails instead of faulting on a bad address.
    let mut end = unsafe { bpf_probe_read_user_str_bytes(path as *const u8, &mut scratch.path) }
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
pub(super) fn parent_known(scratch: &mut Scratch) -> bool {
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
pub(super) fn name_only_parent(scratch: &Scratch) -> DirKey {
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
