//! The async runtime the agent runs on: tokio's multi-thread scheduler, whose threads ask the kernel
//! for a short scheduler slice.
//!
//! Why: an event's latency on an idle node is mostly scheduling. When a plugin's `bind` wakes the
//! agent on the plugin's own CPU, EEVDF lets the plugin run on (its slice protects it) until it
//! blocks, and only then runs the agent; a woken task with a shorter slice than the running one
//! preempts it instead. The agent's work per wake-up is a few microseconds, so it gives nothing
//! away by asking for the shortest slice the kernel grants (100 µs, `sched_setattr` with
//! `sched_runtime` under `SCHED_OTHER`, Linux 6.12+, no privilege needed; older kernels ignore
//! it). Measured here (`cargo xtask bench-sources`, side by side in one run): idle detection
//! latency from the kernel timestamp to the watcher, p50 73 -> 46 µs against a plain runtime.

use std::time::Duration;

/// The slice the runtime's threads ask for: the kernel's minimum custom slice.
pub const SLICE: Duration = Duration::from_micros(100);

/// Builds the agent's runtime (all of tokio's drivers enabled, one worker per CPU).
pub fn build() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .on_thread_start(|| {
            // Logging may not be set up yet (the runtime is built first): a refusal only costs
            // latency, and `plugin-agent status` shows the source's latency either way.
            let _ = request_slice(SLICE);
        })
        .build()
}

/// `struct sched_attr` of `sched_setattr(2)`, the fields of `SCHED_ATTR_SIZE_VER0`.
#[repr(C)]
#[derive(Default)]
struct SchedAttr {
    size: u32,
    sched_policy: u32,
    sched_flags: u64,
    sched_nice: i32,
    sched_priority: u32,
    sched_runtime: u64,
    sched_deadline: u64,
    sched_period: u64,
}

/// Sets the calling thread's EEVDF slice, keeping its policy (`SCHED_OTHER`) and nice value.
pub fn request_slice(slice: Duration) -> std::io::Result<()> {
    // getpriority returns -1 both as a nice value and as an error: errno tells them apart.
    nix::errno::Errno::clear();
    // SAFETY: no memory arguments; `who` 0 is the calling thread (Linux nice values are per thread).
    let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
    if nice == -1 && nix::errno::Errno::last_raw() != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let attr = SchedAttr {
        size: std::mem::size_of::<SchedAttr>() as u32,
        sched_policy: libc::SCHED_OTHER as u32,
        sched_nice: nice,
        sched_runtime: u64::try_from(slice.as_nanos()).unwrap_or(u64::MAX),
        ..SchedAttr::default()
    };
    // SAFETY: `attr` is a valid `sched_attr` of the size it declares, only read by the kernel
    // during the call; pid 0 is the calling thread.
    let result = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &raw const attr, 0) };
    if result == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the kernel reports back for this thread: `sched_getattr(2)`.
    fn current_attr() -> SchedAttr {
        let mut attr = SchedAttr::default();
        // SAFETY: `attr` is writable and as large as the size passed.
        let result = unsafe {
            libc::syscall(
                libc::SYS_sched_getattr,
                0,
                &raw mut attr,
                std::mem::size_of::<SchedAttr>() as u32,
                0,
            )
        };
        assert_eq!(result, 0, "{}", std::io::Error::last_os_error());
        attr
    }

    #[test]
    fn runtime_threads_ask_for_the_short_slice_and_keep_policy_and_nice() {
        let plain = std::thread::spawn(current_attr)
            .join()
            .expect("plain thread");
        let runtime = build().expect("runtime");
        let worker = runtime.block_on(async {
            tokio::spawn(async { current_attr() })
                .await
                .expect("task on a worker")
        });
        assert_eq!(worker.sched_policy, libc::SCHED_OTHER as u32);
        assert_eq!(worker.sched_nice, plain.sched_nice);
        if plain.sched_runtime == 0 {
            // A kernel without custom slices (before 6.12) reports none: nothing more to check.
            return;
        }
        assert_eq!(worker.sched_runtime, SLICE.as_nanos() as u64);
        assert_ne!(plain.sched_runtime, worker.sched_runtime);
    }
}
