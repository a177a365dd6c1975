//! Batched operations on BPF hash maps: a few `bpf` syscalls where aya's map API makes one or
//! two per entry.
//!
//! - Emptying. An agent that adopts pinned programs empties their watched-directory and name
//!   tables (its first walk refills them), and a name table that filled up is emptied before the
//!   rescan that refills it. Entry by entry that is a `BPF_MAP_GET_NEXT_KEY` and a
//!   `BPF_MAP_DELETE_ELEM` each: measured here, 5 ms of a restart with 1,000 plugins, before the
//!   new agent looked at anything, and ten times that with 10,000.
//!   `BPF_MAP_LOOKUP_AND_DELETE_BATCH` takes out a chunk of entries per call.
//! - Inserting. A walk announces every socket it finds to the name table: one
//!   `BPF_MAP_UPDATE_ELEM` each was 7 ms of a restart's first walk with 1,000 plugins (fanotify's
//!   walk has nothing to announce). `BPF_MAP_UPDATE_BATCH` inserts a directory's worth per call.
//!
//! Both commands are Linux 5.6's; a kernel or map that refuses them gets the per-entry calls.

use std::os::fd::{AsFd, AsRawFd};

use aya::Pod;
use aya::maps::{HashMap as BpfHashMap, IterableMap, MapData};

/// `enum bpf_cmd`'s `BPF_MAP_LOOKUP_AND_DELETE_BATCH`.
const BPF_MAP_LOOKUP_AND_DELETE_BATCH: libc::c_long = 25;
/// `enum bpf_cmd`'s `BPF_MAP_UPDATE_BATCH`.
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;

/// Entries taken out per call: keys of up to 256 bytes (a name), so a 64 KiB buffer.
const CHUNK: usize = 256;

/// The `batch` member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// The map's descriptor as `bpf_attr` carries it.
fn map_fd<K: Pod, V: Pod>(map: &BpfHashMap<MapData, K, V>) -> Result<u32, (usize, std::io::Error)> {
    let fd = map.map().fd().as_fd().as_raw_fd();
    u32::try_from(fd).map_err(|_| (0, std::io::Error::from_raw_os_error(libc::EBADF)))
}

/// `bpf(cmd, attr)`; the kernel updates `attr.count` (also on an error).
///
/// # Safety
/// `attr`'s key, value and batch-position pointers must be valid for what `cmd` reads or writes
/// through them: `count` keys and values, a u32 position.
unsafe fn batch_call(cmd: libc::c_long, attr: &mut BatchAttr) -> std::io::Result<()> {
    // SAFETY: `attr` is a valid `bpf_attr` prefix of the size passed; the caller vouches for the
    // buffers it points to.
    let result = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_mut(attr),
            size_of::<BatchAttr>(),
        )
    };
    if result < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Removes every entry of `map`; returns how many were removed.
pub fn empty<K: Pod, V: Pod>(map: &mut BpfHashMap<MapData, K, V>) -> usize {
    match take_out_in_chunks::<K, V>(map) {
        Ok(removed) => removed,
        Err((removed, error)) => {
            tracing::debug!(%error, "batched emptying of a BPF map refused; one entry at a time");
            removed + one_by_one(map)
        }
    }
}

/// `BPF_MAP_LOOKUP_AND_DELETE_BATCH` until the kernel says the map is exhausted (`ENOENT`).
/// On another error, how many were removed before it.
fn take_out_in_chunks<K: Pod, V: Pod>(
    map: &BpfHashMap<MapData, K, V>,
) -> Result<usize, (usize, std::io::Error)> {
    let map_fd = map_fd(map)?;
    let mut keys = vec![0u8; CHUNK * size_of::<K>()];
    let mut values = vec![0u8; CHUNK * size_of::<V>()];
    // A hash map's batch position is a bucket index (u32), written by one call and passed to the
    // next; the first call passes none.
    let mut position: u32 = 0;
    let mut next: u32 = 0;
    let mut removed = 0;
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { &raw const position as u64 },
            out_batch: &raw mut next as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: CHUNK as u32,
            map_fd,
            ..BatchAttr::default()
        };
        // SAFETY: the kernel writes at most `count` keys and values into buffers sized for
        // `CHUNK` of each, reads a u32 from `position` and writes one into `next`, all of which
        // outlive the call.
        let result = unsafe { batch_call(BPF_MAP_LOOKUP_AND_DELETE_BATCH, &mut attr) };
        // Filled in on success and on ENOENT (the last, possibly partial, chunk).
        removed += attr.count as usize;
        match result {
            Ok(()) => {}
            Err(error) if error.raw_os_error() == Some(libc::ENOENT) => return Ok(removed),
            Err(error) => return Err((removed, error)),
        }
        position = next;
        first = false;
    }
}

/// Inserts (or overwrites) `entries` in order; returns how many are in the map. The first one
/// that does not fit (the map is full) and those after it are not.
pub fn insert<K: Pod, V: Pod>(map: &mut BpfHashMap<MapData, K, V>, entries: &[(K, V)]) -> usize {
    let mut inserted = 0;
    for chunk in entries.chunks(CHUNK) {
        match insert_chunk(map, chunk) {
            Ok(()) => inserted += chunk.len(),
            Err((done, error)) => {
                if error.raw_os_error() != Some(libc::E2BIG) {
                    tracing::debug!(%error, "batched insertion into a BPF map refused; one entry at a time");
                }
                // E2BIG (full) stops at the same entry again; anything else may be the command.
                let rest = &entries[inserted + done..];
                let more = rest
                    .iter()
                    .take_while(|(key, value)| map.insert(key, value, 0).is_ok())
                    .count();
                return inserted + done + more;
            }
        }
    }
    inserted
}

/// One `BPF_MAP_UPDATE_BATCH` of at most [`CHUNK`] entries. On an error, how many went in first
/// (the kernel inserts in order and stops at the first failure).
fn insert_chunk<K: Pod, V: Pod>(
    map: &BpfHashMap<MapData, K, V>,
    chunk: &[(K, V)],
) -> Result<(), (usize, std::io::Error)> {
    let map_fd = map_fd(map)?;
    let keys: Vec<K> = chunk.iter().map(|(key, _)| *key).collect();
    let values: Vec<V> = chunk.iter().map(|(_, value)| *value).collect();
    let mut attr = BatchAttr {
        keys: keys.as_ptr() as u64,
        values: values.as_ptr() as u64,
        count: chunk.len() as u32,
        map_fd,
        ..BatchAttr::default()
    };
    // SAFETY: the kernel reads `count` keys and values from arrays of exactly that many, which
    // outlive the call.
    unsafe { batch_call(BPF_MAP_UPDATE_BATCH, &mut attr) }
        .map_err(|error| (attr.count as usize, error))
}

/// What aya's API offers: one lookup of the next key and one deletion per entry.
fn one_by_one<K: Pod, V: Pod>(map: &mut BpfHashMap<MapData, K, V>) -> usize {
    let keys: Vec<K> = map.keys().filter_map(Result::ok).collect();
    keys.iter().filter(|key| map.remove(key).is_ok()).count()
}

#[cfg(test)]
pub(crate) mod tests {
    use std::os::fd::{FromRawFd, OwnedFd};

    use agent_ebpf::{NameHolder, NameKey};
    use aya::maps::Map;

    use super::*;

    /// A name table as the programs declare it: see [`hash_map`].
    pub(crate) fn name_table(max_entries: u32) -> Option<BpfHashMap<MapData, NameKey, NameHolder>> {
        hash_map(max_entries)
    }

    /// A hash map as the programs declare theirs (`BPF_F_NO_PREALLOC`), created directly, or
    /// `None` where this process may not create BPF maps (the test fails instead under `CI=true`,
    /// except where there is no `bpf` syscall at all: qemu-user, which `cargo xtask cross-test`
    /// runs the arm64 build under, does not emulate it; the host stage runs these natively).
    pub(crate) fn hash_map<K: Pod, V: Pod>(max_entries: u32) -> Option<BpfHashMap<MapData, K, V>> {
        // BPF_MAP_TYPE_HASH, BPF_F_NO_PREALLOC
        let data = create_map(1, size_of::<K>(), size_of::<V>(), max_entries, 1)?;
        Some(BpfHashMap::try_from(Map::HashMap(data)).expect("a hash map"))
    }

    /// An array of `u32`, as the programs' `AGENT` map (see [`hash_map`]).
    pub(crate) fn array_u32(max_entries: u32) -> Option<aya::maps::Array<MapData, u32>> {
        // BPF_MAP_TYPE_ARRAY
        let data = create_map(2, 4, 4, max_entries, 0)?;
        Some(aya::maps::Array::try_from(Map::Array(data)).expect("an array"))
    }

    fn create_map(
        map_type: u32,
        key_size: usize,
        value_size: usize,
        max_entries: u32,
        map_flags: u32,
    ) -> Option<MapData> {
        #[repr(C)]
        #[derive(Default)]
        struct CreateAttr {
            map_type: u32,
            key_size: u32,
            value_size: u32,
            max_entries: u32,
            map_flags: u32,
        }
        let attr = CreateAttr {
            map_type,
            key_size: key_size as u32,
            value_size: value_size as u32,
            max_entries,
            map_flags,
        };
        // SAFETY: a valid `bpf_attr` prefix of the size passed, only read by the kernel.
        let fd =
            unsafe { libc::syscall(libc::SYS_bpf, 0, &raw const attr, size_of::<CreateAttr>()) };
        if fd < 0 {
            let error = std::io::Error::last_os_error();
            assert!(
                std::env::var("CI").as_deref() != Ok("true")
                    || error.raw_os_error() == Some(libc::ENOSYS),
                "cannot create a BPF map: {error}"
            );
            eprintln!("skipping: cannot create a BPF map: {error}");
            return None;
        }
        // SAFETY: the kernel just returned this descriptor, and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        Some(MapData::from_fd(fd).expect("aya opens the map"))
    }

    fn fill(map: &mut BpfHashMap<MapData, NameKey, NameHolder>, count: u32) {
        for i in 0..count {
            let key = NameKey::new(format!("p-{i}.sock").as_bytes()).expect("a short name");
            map.insert(key, NameHolder { id: i, dir: 1 }, 0)
                .expect("room in the map");
        }
    }

    #[test]
    fn a_map_of_many_chunks_is_emptied_and_every_entry_counted() {
        let Some(mut map) = name_table(4096) else {
            return;
        };
        // Not a multiple of the chunk, so the last call returns a partial chunk with ENOENT.
        fill(&mut map, 3000);
        assert_eq!(
            take_out_in_chunks(&map)
                .map_err(|(_, e)| e)
                .expect("batched"),
            3000
        );
        assert_eq!(map.keys().count(), 0);
        // An empty map: nothing to take out, and no error.
        assert_eq!(empty(&mut map), 0);
        fill(&mut map, 10);
        assert_eq!(empty(&mut map), 10);
        assert_eq!(map.keys().count(), 0);
    }

    #[test]
    fn a_batch_insertion_goes_in_whole_and_stops_at_a_full_map() {
        let Some(mut map) = name_table(600) else {
            return;
        };
        let entries: Vec<(NameKey, NameHolder)> = (0..700u32)
            .map(|i| {
                let key = NameKey::new(format!("n-{i}").as_bytes()).expect("a short name");
                (key, NameHolder { id: i, dir: i + 1 })
            })
            .collect();
        // Three chunks fit (a partial one last); the map's 600 stop the rest.
        assert_eq!(insert(&mut map, &entries[..550]), 550);
        assert_eq!(map.get(&entries[549].0, 0).ok(), Some(entries[549].1));
        assert_eq!(map.keys().count(), 550);
        // Overwriting what is there takes no room; the 51st new one does not fit.
        assert_eq!(insert(&mut map, &entries[500..]), 100);
        assert_eq!(map.keys().count(), 600);
        assert!(map.get(&entries[600].0, 0).is_err());
    }

    #[test]
    fn the_per_entry_fallback_empties_the_map_too() {
        let Some(mut map) = name_table(1024) else {
            return;
        };
        fill(&mut map, 700);
        assert_eq!(one_by_one(&mut map), 700);
        assert_eq!(map.keys().count(), 0);
    }
}
