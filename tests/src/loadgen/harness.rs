//! A kubelet plugin-manager harness side by side with the agent (`loadgen run
//! --kubelet-harness PATH`): a program that runs kubelet's plugin manager over a directory,
//! started as `PATH --plugin-dir DIR`. None is committed (building kubelet is not this
//! repository's job); given one, its CPU is measured from `/proc/<pid>` as the agent's is.
//!
//! It has no admin API: its registrations are the plugins' `Notify(true)` (the ledger's own),
//! and its deregistrations are not seen (kubelet tells the plugin nothing), so its rows have no
//! deregistration latency and no stale count.

use anyhow::Context;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;
use tokio::process::{Child, Command};

/// See the module docs.
pub struct KubeletHarness {
    child: Child,
}

impl KubeletHarness {
    /// Starts `binary --plugin-dir dir`, its output discarded.
    pub fn start(binary: &Path, dir: &Path) -> anyhow::Result<KubeletHarness> {
        let child = Command::new(binary)
            .arg("--plugin-dir")
            .arg(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        Ok(KubeletHarness { child })
    }

    /// Its process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// SIGTERM, then waits (kills it after 10 s).
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(pid) = self.child.id() {
            let pid = nix::unistd::Pid::from_raw(pid as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        }
        if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            self.child.kill().await?;
        }
        Ok(())
    }
}
