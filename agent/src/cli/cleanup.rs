//! `plugin-agent cleanup`: removes the pinned eBPF programs and the state file, for uninstalling.
//!
//! Both belong to an agent instance (see `ebpf::pins`, `runtime_dir`): cleanup takes the
//! instance's runtime lock first, so it never pulls the pins or the state file from under the
//! running agent, and removes another instance's pins only when that agent does not run.
//! `--force` removes running agents' pins anyway; they hold their programs, pin them again
//! within a second, and report it; a running agent's state file is never removed.

use std::path::{Path, PathBuf};

use crate::event_source::ebpf;

/// Removes the pins of `plugin_dir` (or of every tree with `all`) and the state file of the
/// instance whose admin socket is `admin_socket`; says what it removed and what it kept.
pub fn cleanup(
    plugin_dir: Option<PathBuf>,
    all: bool,
    force: bool,
    admin_socket: &Path,
) -> anyhow::Result<()> {
    let admin_socket = std::path::absolute(admin_socket)?;
    let runtime_dir = admin_socket
        .parent()
        .map_or_else(|| PathBuf::from("/"), Path::to_path_buf);
    // Held until cleanup is done, so the instance's agent cannot start half-way through.
    let lock = if runtime_dir.is_dir() {
        match crate::runtime_dir::try_lock(&admin_socket)? {
            Ok(lock) => Some(lock),
            Err(held) if force => {
                out!(
                    "an agent (pid {}) runs with {}: --force, removing its pins (it pins them again); its state file stays",
                    held.holder,
                    runtime_dir.display()
                );
                None
            }
            Err(held) => anyhow::bail!(
                "an agent (pid {}) runs with {} and owns its pins and state file: stop it first \
                 (or --force to remove its pins; it pins them again within a second)",
                held.holder,
                runtime_dir.display()
            ),
        }
    } else {
        None
    };
    let done = if all {
        ebpf::remove_all_pins(&runtime_dir, force)?
    } else {
        let dir = plugin_dir.unwrap_or_else(|| PathBuf::from(super::run::DEFAULT_PLUGIN_DIR));
        let owner = ebpf::PinOwner {
            tree: std::path::absolute(&dir)?,
            runtime_dir: runtime_dir.clone(),
        };
        let done = ebpf::remove_own_pins(&owner)?;
        if done.removed.is_empty() {
            out!("no pinned eBPF programs for {}", owner.tree.display());
        }
        done
    };
    out!("removed {} pinned program sets", done.removed.len());
    for (dir, tree) in &done.removed {
        out!("  {} ({tree})", dir.display());
    }
    if !done.kept.is_empty() {
        out!("kept {} (their agents run):", done.kept.len());
        for (dir, why) in &done.kept {
            out!("  {} {why}", dir.display());
        }
    }
    if lock.is_some() {
        let state = runtime_dir.join(crate::persist::FILE_NAME);
        for file in [state.with_extension("journal"), state] {
            match std::fs::remove_file(&file) {
                Ok(()) => out!("removed {}", file.display()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(())
}
