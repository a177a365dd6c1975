//! What the eBPF source knows about its own delivery: loss counters and ring-buffer occupancy, read
//! by the reader (to decide on a rescan) and by metrics scrapes ([`SourceStats`]).
//!
//! ```text
//! kernel programs --count_loss--> LOSSES (u64 per CPU and reason) --LossCounters::totals (mmap)--> reader, metrics
//! EVENTS ring: consumer page | producer page --RingOccupancy (read-only mmap)--> bytes queued, metrics
//! ```
//!
//! The ring's positions are read from a second, read-only mapping of the ring's first two pages (the
//! kernel allows any number of read-only mappings), so a scrape never touches the reader's mapping.

use std::os::fd::AsFd;

use agent_ebpf::loss;
use anyhow::Context;
use aya::maps::{Array, IterableMap, MapData};

use super::mapping::{Mapped, page_size};
use crate::event_source::SourceStats;

/// The programs' loss counters: for each CPU, one per [`agent_ebpf::loss`] reason, at
/// `cpu * loss::COUNT + reason`, read from a read-only mapping of the map. The reader reads them
/// after every drain; through `bpf` syscalls (a per-CPU array) that was three syscalls per drain,
/// a tenth of the agent's syscalls under churn.
pub struct LossCounters {
    counters: Mapped,
    slots: usize,
}

impl LossCounters {
    /// Maps the `LOSSES` array read-only.
    pub fn new(map: &Array<MapData, u64>) -> anyhow::Result<Self> {
        let data = map.map();
        let info = data
            .info()
            .context("cannot read the eBPF loss counters' map info")?;
        anyhow::ensure!(
            info.value_size() == 8,
            "the eBPF loss counters are {} bytes each, not 8",
            info.value_size()
        );
        let slots = usize::try_from(info.max_entries()).unwrap_or(usize::MAX);
        // The layout is `loss::COUNT` per possible CPU; a map made by another object (another
        // count) is never handed here (a pinned set is adopted only with this object's hash),
        // and this says so if one ever were, rather than misreading its counters.
        let cpus = aya::util::nr_cpus().map_err(|(file, err)| {
            anyhow::anyhow!("cannot read the possible CPUs from {file}: {err}")
        })?;
        anyhow::ensure!(
            slots == cpus.saturating_mul(loss::COUNT as usize),
            "the eBPF loss counters hold {slots} slots, not {} per possible CPU ({cpus}): made \
             by another build of the programs",
            loss::COUNT
        );
        let counters = Mapped::read_only(data.fd(), 0, slots * 8)
            .context("cannot map the eBPF loss counters read-only")?;
        Ok(LossCounters { counters, slots })
    }

    /// Each reason's count summed over CPUs since the programs were loaded.
    pub fn totals(&self) -> [u64; loss::COUNT as usize] {
        let mut totals = [0u64; loss::COUNT as usize];
        for slot in 0..self.slots {
            let reason = slot % loss::COUNT as usize;
            totals[reason] = totals[reason].wrapping_add(self.counters.u64_at(slot * 8));
        }
        totals
    }

    /// Events the kernel side recorded nothing for: a full ring buffer, a syscall whose entry
    /// could not be tracked to its exit, or a VFS call whose fexit programs the kernel skipped.
    /// (A full name table loses no event, only precision.)
    pub fn dropped(&self) -> u64 {
        let totals = self.totals();
        [loss::RING_FULL, loss::PENDING_FULL, loss::FEXIT_SKIPPED]
            .iter()
            .map(|&index| totals[index as usize])
            .fold(0, u64::wrapping_add)
    }
}

/// A read-only view of the ring buffer's consumer and producer positions.
///
/// A BPF ring buffer map's mmap layout is: page 0 the consumer position (written by the reader),
/// page 1 the producer position (written by the kernel), then the data pages twice.
pub struct RingOccupancy {
    positions: Mapped,
    page: usize,
}

impl RingOccupancy {
    /// Maps the position pages of the ring buffer behind `ring` (its map fd) read-only.
    pub fn new(ring: &impl AsFd) -> anyhow::Result<Self> {
        let page = page_size()?;
        let positions = Mapped::read_only(ring, 0, 2 * page)
            .context("cannot map the eBPF ring buffer's positions read-only")?;
        Ok(RingOccupancy { positions, page })
    }

    /// Bytes committed or reserved by the kernel and not yet consumed by the reader (record headers
    /// included).
    pub fn used_bytes(&self) -> u64 {
        let consumer = self.positions.u64_at(0);
        let producer = self.positions.u64_at(self.page);
        producer.saturating_sub(consumer)
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
            pins_restored: None,
            name_table_incomplete: None,
        }
    }
}
