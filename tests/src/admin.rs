//! The operator's view of a running agent: `plugin-agent list -o json` over its admin socket, as
//! an operator would run it, for end-state assertions ("every live plugin registered, nothing
//! else listed").

use crate::env::agent_bin;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

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

/// `plugin-agent <command> -o json` against the agent on `admin_socket`, parsed. Panics with the
/// CLI's output if it fails.
fn json_of<T: serde::de::DeserializeOwned>(admin_socket: &Path, command: &str) -> T {
    let output = Command::new(agent_bin())
        .arg("--admin-socket")
        .arg(admin_socket)
        .args([command, "-o", "json"])
        .output()
        .unwrap_or_else(|e| panic!("run plugin-agent {command}: {e}"));
    assert!(
        output.status.success(),
        "plugin-agent {command} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("plugin-agent {command} -o json prints no JSON: {e}"))
}

/// `plugin-agent status -o json`, as JSON.
pub fn status(admin_socket: &Path) -> serde_json::Value {
    json_of(admin_socket, "status")
}

/// Every socket the agent listening on `admin_socket` knows, by path.
pub fn list(admin_socket: &Path) -> BTreeMap<PathBuf, Listed> {
    let rows: Vec<Listed> = json_of(admin_socket, "list");
    rows.into_iter()
        .map(|r| (r.socket_path.clone(), r))
        .collect()
}

/// Every row of `plugin-agent list -o json` as JSON, by socket path: for the fields
/// [`Listed`] leaves out (provenance, the refusing rule).
pub fn list_json(admin_socket: &Path) -> BTreeMap<PathBuf, serde_json::Value> {
    let rows: Vec<serde_json::Value> = json_of(admin_socket, "list");
    rows.into_iter()
        .map(|row| {
            let path = PathBuf::from(row["socket_path"].as_str().unwrap_or_default());
            (path, row)
        })
        .collect()
}

/// `plugin-agent watch -o json` against an agent, live: the stream has no history, so it is
/// returned only once the command says (on stderr) that the agent subscribed it. The process
/// is killed when dropped.
#[derive(Debug)]
pub struct Watch {
    child: std::process::Child,
    events: crate::events::EventLog,
}

impl Watch {
    /// Starts watching the agent on `admin_socket`.
    pub async fn start(admin_socket: &Path) -> Watch {
        match Watch::try_start(admin_socket, crate::EVENT_TIMEOUT).await {
            Ok(watch) => watch,
            Err(said) => panic!("`watch` never went live:\n{said}"),
        }
    }

    /// Starts watching the agent on `admin_socket`; what the command said when it ended or
    /// timed out before it went live (nothing listens there, say).
    pub async fn try_start(admin_socket: &Path, timeout: Duration) -> Result<Watch, String> {
        use crate::events::{EventLog, Mark};
        let mut child = Command::new(agent_bin())
            .arg("--admin-socket")
            .arg(admin_socket)
            .args(["watch", "-o", "json"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("plugin-agent watch");
        let events = EventLog::read_from(child.stdout.take().expect("piped"), "watch".into());
        let said = EventLog::read_from(child.stderr.take().expect("piped"), "watch-err".into());
        // The CLI's own word on stderr (see `cli/watch.rs`), not the agent's log.
        match said
            .wait_for(Mark(0), timeout, |l| {
                l.message().starts_with("watching events of")
            })
            .await
        {
            Ok(_) => Ok(Watch { child, events }),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(format!("{e:?}\n{}", said.tail(20)))
            }
        }
    }

    /// The events so far and to come, one JSON object each.
    pub fn events(&self) -> &crate::events::EventLog {
        &self.events
    }

    /// Waits for the command to end by itself (the agent went away).
    pub fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        self.child.wait()
    }

    /// Waits for an event of `kind` about `socket` (as the agent names it).
    pub async fn wait_for(&self, kind: &str, socket: &Path) -> crate::events::Line {
        let socket = socket.display().to_string();
        self.events
            .wait_for(crate::events::Mark(0), crate::EVENT_TIMEOUT, |l| {
                l.field_is("kind", kind) && l.field_is("socket_path", &socket)
            })
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "no {kind} event for {socket} ({e:?}); events:\n{}",
                    self.events.tail(30)
                )
            })
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `plugin-agent explain <target> -o json` against the agent on `admin_socket`: one JSON object
/// per socket explained (`reason`, `verdict`, `timeline`, `checks`, ...).
pub fn explain(admin_socket: &Path, target: &str) -> Vec<serde_json::Value> {
    let output = Command::new(agent_bin())
        .arg("--admin-socket")
        .arg(admin_socket)
        .args(["explain", target, "-o", "json"])
        .output()
        .unwrap_or_else(|e| panic!("run plugin-agent explain: {e}"));
    assert!(
        output.status.success(),
        "plugin-agent explain {target} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("plugin-agent explain -o json prints no JSON: {e}"))
}

/// The check called `name` of one explanation (`explain`'s JSON), as (result, detail, fix).
pub fn check<'a>(explained: &'a serde_json::Value, name: &str) -> (&'a str, &'a str, &'a str) {
    let found = explained["checks"]
        .as_array()
        .and_then(|checks| checks.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no check {name} in {explained:#}"));
    let text = |key: &str| found[key].as_str().unwrap_or_default();
    (text("result"), text("detail"), text("fix"))
}
