//! The operator's view of a running agent: `plugin-agent list -o json` over its admin socket, as
//! an operator would run it, for end-state assertions ("every live plugin registered, nothing
//! else listed").

use crate::env::agent_bin;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// One row of `plugin-agent list -o json`.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Listed {
    /// The registration socket.
    pub socket_path: PathBuf,
    /// `registered`, `registering`, `failed`, ...
    pub state: String,
    /// `PluginInfo.name` (empty until GetInfo answered).
    pub name: String,
    /// Inode of the socket the entry is about.
    pub socket_ino: u64,
    /// The last error, for failed entries.
    pub last_error: Option<String>,
}

/// `plugin-agent status -o json`, as JSON. Panics with the CLI's output if it fails.
pub fn status(admin_socket: &Path) -> serde_json::Value {
    let output = Command::new(agent_bin())
        .arg("--admin-socket")
        .arg(admin_socket)
        .args(["status", "-o", "json"])
        .output()
        .expect("run plugin-agent status");
    assert!(
        output.status.success(),
        "plugin-agent status failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("plugin-agent status -o json prints JSON")
}

/// Every socket the agent listening on `admin_socket` knows, by path. Panics with the CLI's
/// output if it fails.
pub fn list(admin_socket: &Path) -> BTreeMap<PathBuf, Listed> {
    let output = Command::new(agent_bin())
        .arg("--admin-socket")
        .arg(admin_socket)
        .args(["list", "-o", "json"])
        .output()
        .expect("run plugin-agent list");
    assert!(
        output.status.success(),
        "plugin-agent list failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let rows: Vec<Listed> =
        serde_json::from_slice(&output.stdout).expect("plugin-agent list -o json prints JSON");
    rows.into_iter()
        .map(|r| (r.socket_path.clone(), r))
        .collect()
}
