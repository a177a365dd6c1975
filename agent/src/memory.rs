//! The agent's resident memory after bursts: what glibc's allocator keeps, and giving it back.
//!
//! A burst of registrations allocates per operation (a connection, HTTP/2 buffers, spans) on
//! every runtime thread, then frees it; what stays is a few hundred bytes per registered plugin.
//! glibc's malloc spreads threads over up to 8 arenas per core and returns a freed page to the
//! kernel only when it is at the top of its heap, so a burst of 10,000 left ~90 MiB resident of
//! which most was free memory pinned by long-lived entries allocated between the short-lived ones.
//! Two measures, both glibc-specific (other C libraries keep their own behaviour):
//! - [`limit_arenas`]: two arenas for the whole process (it runs a couple of busy threads);
//! - [`Trimmer`]: once the executor has no operation running after a batch of them, free pages in
//!   every arena are returned to the kernel (`malloc_trim`), at most once per batch, so an idle
//!   agent does nothing and a steady churn trims about once per [`TRIM_AFTER`] operations.
//!
//! And one measure for the agent's own tables (desired, actual, discovery records):
//! [`shrink_if_sparse`] gives a map's spare room back after a burst of removals.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Operations finished since the last trim before an idle executor trims again.
pub const TRIM_AFTER: usize = 1024;

/// Caps glibc's malloc arenas at two. Call before the runtime's threads start.
pub fn limit_arenas() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets an allocator tunable; it is called before other threads exist.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

/// Counts finished operations and trims when the executor goes idle after enough of them.
#[derive(Debug, Default)]
pub struct Trimmer {
    finished: AtomicUsize,
}

impl Trimmer {
    /// One operation finished; `idle` says no other one is running. Returns whether it trimmed.
    pub fn finished(&self, idle: bool) -> bool {
        let finished = self.finished.fetch_add(1, Ordering::Relaxed) + 1;
        if !idle || finished < TRIM_AFTER {
            return false;
        }
        self.finished.store(0, Ordering::Relaxed);
        trim();
        true
    }
}

/// Returns free memory at the top and inside every malloc arena to the kernel: after a burst,
/// and after the eBPF source's load, whose BTF parsing briefly takes tens of MiB.
pub fn trim() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases memory malloc holds free; it takes the arenas' locks.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Tables shrink after removals once they are at most a quarter full and past this capacity: a
/// burst of 10,000 removals does not leave its table behind.
pub const SHRINK_ABOVE: usize = 64;

/// Gives a map's spare room back after a burst of removals (see [`SHRINK_ABOVE`]).
pub fn shrink_if_sparse<K: Eq + std::hash::Hash, V, S: std::hash::BuildHasher>(
    map: &mut std::collections::HashMap<K, V, S>,
) {
    if map.capacity() > SHRINK_ABOVE && map.capacity() > 4 * map.len() {
        map.shrink_to_fit();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trims_only_when_idle_after_a_batch() {
        let trimmer = Trimmer::default();
        for _ in 0..TRIM_AFTER - 1 {
            assert!(!trimmer.finished(true));
        }
        assert!(!trimmer.finished(false), "busy: no trim");
        assert!(trimmer.finished(true), "idle after a batch: trim");
        assert!(!trimmer.finished(true), "the count starts again");
    }
}
