//! Shared mappings of BPF maps: the loss counters, the ring buffer's positions and its data.
//!
//! Reads and writes of the words the kernel shares go through atomics of the word's size; a
//! ring record's bytes are read as a plain slice once its header's commit was seen (the kernel
//! does not touch a committed record until the consumer position passes it).

use std::os::fd::{AsFd, AsRawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use anyhow::Context;

/// A shared mapping of `len` bytes of a map, from byte `offset` (both whole pages).
pub struct Mapped {
    base: NonNull<libc::c_void>,
    len: usize,
}

// SAFETY: the mapping is only read through atomic loads and slices of committed records, and
// written (the ring's consumer position) through atomic stores; it is unmapped once, on drop.
unsafe impl Send for Mapped {}
// SAFETY: as above.
unsafe impl Sync for Mapped {}

impl Mapped {
    /// Maps `len` bytes (rounded up to whole pages) of the map behind `fd` read-only, from byte
    /// `offset` (a multiple of the page size).
    pub fn read_only(fd: &impl AsFd, offset: usize, len: usize) -> anyhow::Result<Self> {
        Self::new(fd, offset, len, libc::PROT_READ)
    }

    /// As [`Self::read_only`], writable (the kernel allows it for the ring's consumer page).
    pub fn read_write(fd: &impl AsFd, offset: usize, len: usize) -> anyhow::Result<Self> {
        Self::new(fd, offset, len, libc::PROT_READ | libc::PROT_WRITE)
    }

    fn new(fd: &impl AsFd, offset: usize, len: usize, prot: libc::c_int) -> anyhow::Result<Self> {
        let len = len.max(1).next_multiple_of(page_size()?);
        let offset = libc::off_t::try_from(offset).context("mapping offset out of range")?;
        // SAFETY: a fresh shared mapping of a map fd; the kernel checks the range against the map
        // and the protection against its flags.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_fd().as_raw_fd(),
                offset,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error().into());
        }
        let base = NonNull::new(base).context("mmap returned a null mapping")?;
        Ok(Mapped { base, len })
    }

    fn at<T>(&self, offset: usize) -> &T {
        let size = std::mem::size_of::<T>();
        assert!(
            offset.is_multiple_of(size) && offset + size <= self.len,
            "access outside the mapping"
        );
        // SAFETY: in bounds and aligned (checked above; the mapping is page-aligned) and mapped
        // for the lifetime of self; only atomics are made this way.
        unsafe { &*self.base.as_ptr().cast::<u8>().add(offset).cast::<T>() }
    }

    /// The u64 at byte `offset` (8-aligned, inside the mapping), with acquire ordering.
    pub fn u64_at(&self, offset: usize) -> u64 {
        self.at::<AtomicU64>(offset).load(Ordering::Acquire)
    }

    /// The u32 at byte `offset` (4-aligned, inside the mapping), with acquire ordering.
    pub fn u32_at(&self, offset: usize) -> u32 {
        self.at::<AtomicU32>(offset).load(Ordering::Acquire)
    }

    /// Stores `value` at byte `offset` with release ordering; the mapping must be writable.
    pub fn store_u64(&self, offset: usize, value: u64) {
        self.at::<AtomicU64>(offset).store(value, Ordering::Release);
    }

    /// The bytes `range` of the mapping. Only for bytes the kernel does not write while the
    /// slice lives (a committed ring record before its consumption).
    pub fn bytes(&self, range: std::ops::Range<usize>) -> &[u8] {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "bytes outside the mapping"
        );
        // SAFETY: in bounds (checked above) and mapped for the lifetime of self; the caller
        // reads only what the kernel has committed and does not rewrite until it is consumed.
        unsafe {
            std::slice::from_raw_parts(
                self.base.as_ptr().cast::<u8>().add(range.start),
                range.len(),
            )
        }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped exactly once.
        unsafe { libc::munmap(self.base.as_ptr(), self.len) };
    }
}

/// The system's page size.
pub fn page_size() -> anyhow::Result<usize> {
    // SAFETY: sysconf has no preconditions.
    usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
        .context("cannot read the page size")
}
