//! What the eBPF source knows about its own delivery: loss counters and ring-buffer occupancy, read
//! by the reader (to decide on a rescan) and by metrics scrapes ([`SourceStats`]).
//!
//! ```text
//! kernel programs --count_loss--> LOSSES (per-CPU u64 per reason) --LossCounters::totals--> reader, metrics
//! EVENTS ring: consumer page | producer page --RingOccupancy (read-only mmap)--> bytes queued, metrics
//! ```
//!
//! The ring's positions are read from a second, read-only mapping of the ring's first two pages (the
//! kernel allows any number of read-only mappings), so a scrape never touches the reader's mapping.

use std::os::fd::AsFd;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use agent_ebpf::loss;
use anyhow::Context;
use aya::maps::{MapData, PerCpuArray};

use crate::event_source::SourceStats;

/// The programs' per-CPU loss counters, one per [`agent_ebpf::loss`] reason.
pub struct LossCounters {
    map: PerCpuArray<MapData, u64>,
}

impl LossCounters {
    /// Wraps the `LOSSES` map taken from the loaded object.
    pub fn new(map: PerCpuArray<MapData, u64>) -> Self {
        LossCounters { map }
    }

    /// Each reason's count summed over CPUs since the programs were loaded. A counter that cannot
    /// be read is reported as `None`, so the caller can say so instead of assuming no loss.
    pub fn totals(&self) -> [Option<u64>; loss::COUNT as usize] {
        let mut totals = [None; loss::COUNT as usize];
        for (index, total) in (0..loss::COUNT).zip(totals.iter_mut()) {
            *total = self
                .map
                .get(&index, 0)
                .ok()
                .map(|per_cpu| per_cpu.iter().copied().fold(0, u64::wrapping_add));
        }
        totals
    }

    /// Events the kernel side recorded nothing for: a full ring buffer, or a syscall whose entry
    /// could not be tracked to its exit. (A full name table loses no event, only precision.)
    pub fn dropped(&self) -> u64 {
        let totals = self.totals();
        [loss::RING_FULL, loss::PENDING_FULL]
            .iter()
            .filter_map(|&index| totals[index as usize])
            .fold(0, u64::wrapping_add)
    }
}

/// A read-only view of the ring buffer's consumer and producer positions.
///
/// A BPF ring buffer map's mmap layout is: page 0 the consumer position (written by the reader),
/// page 1 the producer position (written by the kernel), then the data pages twice.
pub struct RingOccupancy {
    base: NonNull<libc::c_void>,
    page: usize,
}

// SAFETY: the mapping is read-only and only read through atomic loads; it is unmapped once, on
// drop, by the owner.
unsafe impl Send for RingOccupancy {}
// SAFETY: as above; concurrent atomic loads are fine.
unsafe impl Sync for RingOccupancy {}

impl RingOccupancy {
    /// Maps the position pages of the ring buffer behind `ring` (its map fd) read-only.
    pub fn new(ring: &impl AsFd) -> anyhow::Result<Self> {
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
            .context("cannot read the page size")?;
        // SAFETY: a fresh shared read-only mapping of a ring buffer map fd; the kernel checks the
        // range (two pages from offset 0 always exist) and the protection.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                2 * page,
                libc::PROT_READ,
                libc::MAP_SHARED,
                ring.as_fd().as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error())
                .context("cannot map the eBPF ring buffer's positions read-only");
        }
        let base = NonNull::new(base).context("mmap returned a null mapping")?;
        Ok(RingOccupancy { base, page })
    }

    fn position(&self, page_index: usize) -> u64 {
        // SAFETY: both pages are mapped for the lifetime of self, page-aligned (so the u64 at the
        // start of each is aligned), and the kernel and the reader only ever store whole u64s there.
        let position = unsafe {
            &*self
                .base
                .as_ptr()
                .cast::<u8>()
                .add(page_index * self.page)
                .cast::<AtomicU64>()
        };
        position.load(Ordering::Acquire)
    }

    /// Bytes committed or reserved by the kernel and not yet consumed by the reader (record headers
    /// included).
    pub fn used_bytes(&self) -> u64 {
        let consumer = self.position(0);
        let producer = self.position(1);
        producer.saturating_sub(consumer)
    }
}

impl Drop for RingOccupancy {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped exactly once.
        unsafe { libc::munmap(self.base.as_ptr(), 2 * self.page) };
    }
}

/// Everything [`SourceStats`] is made of, owned by the source.
pub struct DeliveryStats {
    /// Shared with the reader.
    pub losses: std::sync::Arc<LossCounters>,
    /// The ring's positions.
    pub ring: RingOccupancy,
    /// The ring's size as loaded.
    pub ring_buffer_bytes: u32,
}

impl DeliveryStats {
    /// The current counters, for a metrics scrape.
    pub fn snapshot(&self) -> SourceStats {
        SourceStats {
            dropped: self.losses.dropped(),
            ring_buffer_size_bytes: Some(u64::from(self.ring_buffer_bytes)),
            ring_buffer_used_bytes: Some(self.ring.used_bytes()),
        }
    }
}
