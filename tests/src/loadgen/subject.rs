//! What the load runs against: the agent under test, or what stands in for it (the floor, a
//! kubelet harness), and the profiling hooks run around the load.

use crate::agent::AgentUnderTest;
use crate::ledger::SharedLedger;
use crate::{admin, floor, harness};
use anyhow::Context;
use std::path::Path;

/// The pid of the agent, or of what stands in for it.
pub fn pid(agent: Option<&AgentUnderTest>, other: Option<&Other>) -> anyhow::Result<u32> {
    match (agent, other) {
        (Some(agent), _) => agent.pid(),
        (None, Some(other)) => other.pid(),
        (None, None) => None,
    }
    .context("no pid for the agent (or what stands in for it)")
}

/// Stops what stood in for the agent, if anything did.
pub async fn stop(other: Option<Other>) -> anyhow::Result<()> {
    match other {
        Some(other) => other.stop().await,
        None => Ok(()),
    }
}

/// Runs `command` (`--before-load`, `--after-load`) with `sh -c`, `$AGENT_PID` set, and waits.
pub async fn hook(command: Option<&str>, pid: u32) -> anyhow::Result<()> {
    let Some(command) = command else {
        return Ok(());
    };
    let status = tokio::process::Command::new("sh")
        .args(["-c", command])
        .env("AGENT_PID", pid.to_string())
        .stdout(std::process::Stdio::null())
        .status()
        .await
        .with_context(|| format!("running {command:?}"))?;
    anyhow::ensure!(status.success(), "{command:?}: {status}");
    Ok(())
}

/// What stands in for the agent: the floor, or a kubelet plugin-manager harness.
pub enum Other {
    Floor(floor::FloorUnderTest),
    Kubelet(harness::KubeletHarness),
}

impl Other {
    fn pid(&self) -> Option<u32> {
        match self {
            Other::Floor(floor) => floor.pid(),
            Other::Kubelet(kubelet) => kubelet.pid(),
        }
    }

    async fn stop(self) -> anyhow::Result<()> {
        match self {
            Other::Floor(floor) => floor.stop().await,
            Other::Kubelet(kubelet) => kubelet.stop().await,
        }
    }
}

/// Starts what the load runs against: the agent (following its admin events into the ledger),
/// or with `--floor` the floor (see `floor`), told of each plugin by the ledger, or with
/// `--kubelet-harness` kubelet's plugin manager (see `harness`).
pub async fn start(
    args: &crate::RunArgs,
    plugin_dir: &Path,
    work: &Path,
    agent_args: Vec<String>,
    ledger: &SharedLedger,
) -> anyhow::Result<(Option<AgentUnderTest>, Option<Other>)> {
    if args.floor {
        let floor = floor::FloorUnderTest::start(plugin_dir, ledger)?;
        return Ok((None, Some(Other::Floor(floor))));
    }
    if let Some(binary) = &args.kubelet_harness {
        let kubelet = harness::KubeletHarness::start(binary, plugin_dir)?;
        return Ok((None, Some(Other::Kubelet(kubelet))));
    }
    let mut agent = AgentUnderTest::new(
        args.agent.clone(),
        plugin_dir.to_path_buf(),
        work,
        agent_args,
    );
    agent.start().await?;
    admin::follow(&agent.admin_socket, ledger.clone()).await?;
    Ok((Some(agent), None))
}

/// What the floor holds registered now: every plugin it registered and did not deregister (a
/// kubelet harness reports neither: nothing).
pub fn other_holds(ledger: &SharedLedger) -> std::collections::HashSet<u64> {
    let l = ledger.lock();
    l.plugins
        .iter()
        .filter(|(_, r)| r.registered_events.len() > r.deregistered_events.len())
        .map(|(id, _)| *id)
        .collect()
}
