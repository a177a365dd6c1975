//! `plugin-agent cleanup`: removes the pinned eBPF programs and the state file, for uninstalling.

use std::path::{Path, PathBuf};

use crate::event_source::ebpf;

/// Removes the pins of `plugin_dir` (or of every tree with `all`) and the state file beside the
/// admin socket `admin_socket`; says what it removed.
pub fn cleanup(plugin_dir: Option<PathBuf>, all: bool, admin_socket: &Path) -> anyhow::Result<()> {
    if all {
        let removed = ebpf::remove_all_pins()?;
        out!("removed {} pinned program sets", removed.len());
        for dir in removed {
            out!("  {}", dir.display());
        }
    } else {
        let dir = plugin_dir.unwrap_or_else(|| PathBuf::from(super::DEFAULT_PLUGIN_DIR));
        let dir = std::path::absolute(&dir)?;
        if ebpf::remove_pins(&dir)? {
            out!("removed the pinned eBPF programs of {}", dir.display());
        } else {
            out!("no pinned eBPF programs for {}", dir.display());
        }
    }
    if let Some(runtime_dir) = admin_socket.parent() {
        let state = runtime_dir.join(crate::persist::FILE_NAME);
        match std::fs::remove_file(&state) {
            Ok(()) => out!("removed {}", state.display()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}
