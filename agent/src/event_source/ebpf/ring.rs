//! The consumer side of the `EVENTS` ring buffer, with its data mapped once.
//!
//! ```text
//! map fd ── page 0: consumer position (ours, read-write)
//!        └─ page 1: producer position (the kernel's) + the data pages (read-only, mapped once)
//! record: 8-byte header (length | BUSY | DISCARD, page offset), then the record, 8-aligned
//! ```
//!
//! The kernel lets a consumer map the data twice in a row so that a record crossing the end of
//! the ring reads as one slice; general-purpose readers (aya's `RingBuf`, libbpf) do, and then
//! every data page is resident twice in the agent (the kernel maps the whole range at `mmap`):
//! a 2 MiB ring cost 4 MiB of RSS. Here the data is mapped once, and the rare record that
//! crosses the end is copied into a buffer.
//!
//! The protocol is the kernel's (`kernel/bpf/ringbuf.c`): the producer reserves a record by
//! advancing its position and writing the header with BUSY set, and commits it by clearing BUSY
//! (DISCARD set: skip it); the producer position is stored with release ordering after the
//! header, the header's commit is a full barrier; the consumer publishes its position with
//! release ordering once it has read a record, and only then may the kernel reuse its bytes.

use std::os::fd::{AsFd, BorrowedFd};

use anyhow::Context;
use aya::maps::MapData;

use super::mapping::{Mapped, page_size};

/// The record header's busy bit: reserved, not committed yet.
const BUSY: u32 = 1 << 31;
/// The record header's discard bit: committed as discarded, skipped.
const DISCARD: u32 = 1 << 30;
/// Bytes of the record header.
const HEADER: usize = 8;

/// See the module docs.
pub struct Ring {
    /// Owns the map's fd (epoll waits on it) for as long as the mappings live.
    map: MapData,
    cursor: Cursor,
    data: Data,
}

/// The consumer position: the mapped word the kernel reads, and our copy of it.
struct Cursor {
    page: Mapped,
    position: u64,
}

/// The producer's page followed by the data pages, and what wraps around their end.
struct Data {
    mapping: Mapped,
    /// Where the data starts in `mapping` (after the producer page).
    start: usize,
    /// Data bytes: a power of two.
    size: usize,
    /// The producer position last read.
    produced: u64,
    /// A record that crosses the end of the ring, put back together.
    wrapped: Vec<u8>,
}

impl Ring {
    /// The consumer of the ring buffer map `map`, from the consumer position stored in the
    /// map (a pinned ring adopted from an earlier agent resumes where that one stopped).
    fn new(map: MapData) -> anyhow::Result<Self> {
        let info = map
            .info()
            .context("cannot read the eBPF ring buffer's map info")?;
        let size = usize::try_from(info.max_entries()).context("ring buffer size")?;
        let page = page_size()?;
        anyhow::ensure!(
            size.is_power_of_two() && size >= page,
            "the eBPF ring buffer's size {size} is not a power of two of at least a page"
        );
        let consumer = Mapped::read_write(map.fd(), 0, page)
            .context("cannot map the eBPF ring buffer's consumer position")?;
        let mapping = Mapped::read_only(map.fd(), page, page + size)
            .context("cannot map the eBPF ring buffer's data")?;
        let position = consumer.u64_at(0);
        let produced = mapping.u64_at(0);
        Ok(Ring {
            map,
            cursor: Cursor {
                page: consumer,
                position,
            },
            data: Data {
                mapping,
                start: page,
                size,
                produced,
                wrapped: Vec::new(),
            },
        })
    }

    /// [`Self::new`] of a map taken from the loaded object or opened from a pin.
    pub fn from_map(map: aya::maps::Map) -> anyhow::Result<Self> {
        match map {
            aya::maps::Map::RingBuf(data) => Self::new(data),
            _ => anyhow::bail!("the eBPF events map is not a ring buffer"),
        }
    }

    /// The ring's data bytes, as the kernel made it (a pinned ring keeps the size it was made
    /// with).
    pub fn size(&self) -> usize {
        self.data.size
    }

    /// The next committed record, if any; it is consumed when the returned item is dropped.
    /// `None` when the ring is empty or its next record is still being written.
    pub fn next(&mut self) -> Option<Record<'_>> {
        let Ring { cursor, data, .. } = self;
        loop {
            if cursor.position == data.produced {
                // Caught up with what was last seen: look again. The fence orders the consumer
                // position stored before it with the producer position loaded after it, so either
                // this sees a record committed meanwhile or its producer sees the ring drained
                // (the programs' wake-up decision reads how much is queued).
                std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
                data.produced = data.mapping.u64_at(0);
                if cursor.position == data.produced {
                    return None;
                }
            }
            let offset = data.start + (cursor.position as usize & (data.size - 1));
            let header = data.mapping.u32_at(offset);
            if header & BUSY != 0 {
                return None;
            }
            let len = (header & !(BUSY | DISCARD)) as usize;
            if len + HEADER > data.size {
                // Never written by the kernel (its records fit the ring): read nothing more
                // rather than past the record.
                tracing::error!(
                    len,
                    size = data.size,
                    "eBPF ring buffer record longer than the ring; not reading on"
                );
                return None;
            }
            let consumed = (HEADER + len).next_multiple_of(8) as u64;
            if header & DISCARD != 0 {
                cursor.advance(consumed);
                continue;
            }
            let first = data.start + ((cursor.position as usize + HEADER) & (data.size - 1));
            let end = data.start + data.size;
            let bytes = if first + len <= end {
                data.mapping.bytes(first..first + len)
            } else {
                let tail = end - first;
                data.wrapped.clear();
                data.wrapped
                    .extend_from_slice(data.mapping.bytes(first..end));
                data.wrapped
                    .extend_from_slice(data.mapping.bytes(data.start..data.start + (len - tail)));
                &data.wrapped
            };
            return Some(Record {
                bytes,
                cursor,
                consumed,
            });
        }
    }
}

impl Cursor {
    fn advance(&mut self, bytes: u64) {
        self.position = self.position.wrapping_add(bytes);
        // The kernel reuses the record's bytes once it sees this (an acquire load of it).
        self.page.store_u64(0, self.position);
    }
}

impl AsFd for Ring {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.map.fd().as_fd()
    }
}

impl std::os::fd::AsRawFd for Ring {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.as_fd().as_raw_fd()
    }
}

/// A committed record, consumed when dropped.
pub struct Record<'a> {
    bytes: &'a [u8],
    cursor: &'a mut Cursor,
    consumed: u64,
}

impl std::ops::Deref for Record<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.bytes
    }
}

impl Drop for Record<'_> {
    fn drop(&mut self) {
        self.cursor.advance(self.consumed);
    }
}
