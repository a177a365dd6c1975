//! Makes sure tracefs is mounted before the loader attaches syscall tracepoints.
//!
//! ```text
//! loader --ensure_mounted--> /sys/kernel/tracing has entries? --no--> mount -t tracefs nodev ...
//!        --TracePoint::attach--> aya reads events/syscalls/<name>/id under tracefs
//! ```
//!
//! aya locates a tracepoint by its id file in tracefs, and looks for tracefs once per process, so
//! this runs before the first attach. Many node images (and containers with a fresh `/sys`) do not
//! mount tracefs; mounting it needs `CAP_SYS_ADMIN`, which the agent has as a privileged DaemonSet.

use std::path::Path;
use std::sync::Mutex;

use anyhow::Context;
use nix::mount::{MsFlags, mount};

/// Where the kernel expects tracefs, and where the agent mounts it if nobody has.
pub const TRACEFS: &str = "/sys/kernel/tracing";

/// The older location, under debugfs, which aya also accepts.
const TRACEFS_UNDER_DEBUGFS: &str = "/sys/kernel/debug/tracing";

/// Serialises concurrent loads in one process, so tracefs is mounted once.
static MOUNTING: Mutex<()> = Mutex::new(());

/// Mounts tracefs at [`TRACEFS`] unless it (or the debugfs copy) is already there. Returns whether
/// it mounted.
pub fn ensure_mounted() -> anyhow::Result<bool> {
    let _serialised = MOUNTING
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if has_entries(Path::new(TRACEFS)) || has_entries(Path::new(TRACEFS_UNDER_DEBUGFS)) {
        return Ok(false);
    }
    mount(
        Some("nodev"),
        TRACEFS,
        Some("tracefs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None::<&str>,
    )
    .with_context(|| {
        format!(
            "tracefs is not mounted and mounting it at {TRACEFS} failed; mount it \
             (`mount -t tracefs nodev {TRACEFS}`) or run the agent with CAP_SYS_ADMIN"
        )
    })?;
    tracing::info!(
        path = TRACEFS,
        "tracefs was not mounted: mounted it to attach syscall tracepoints"
    );
    Ok(true)
}

/// Whether the running kernel has the tracepoint `category/name` (tracefs mounted, see
/// [`ensure_mounted`]): one its configuration leaves out has no directory.
pub fn has_event(category: &str, name: &str) -> bool {
    [TRACEFS, TRACEFS_UNDER_DEBUGFS].iter().any(|root| {
        Path::new(root)
            .join("events")
            .join(category)
            .join(name)
            .is_dir()
    })
}

/// A mounted tracefs has entries; the bare mount point the kernel creates is empty.
fn has_entries(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|mut entries| entries.next().is_some())
}
