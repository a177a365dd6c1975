//! The processes a soak or hostile run starts (the agent, the handler, plugins, a metrics flood),
//! each killed when dropped, and where a run keeps its files: shared by `cargo xtask soak` and
//! `cargo xtask hostile`.

use crate::shell;
use anyhow::Context;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child process killed (SIGKILL) and reaped when dropped.
pub(crate) struct Guard(pub(crate) Child);

impl Guard {
    pub(crate) fn pid(&self) -> u32 {
        self.0.id()
    }
    pub(crate) fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
    /// SIGTERM, then SIGKILL after 10 s.
    pub(crate) fn terminate(&mut self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Where things are for one run (of the soak, or of one hostile case).
pub(crate) struct Run {
    pub(crate) bin: PathBuf,
    pub(crate) dir: PathBuf,
    pub(crate) registry: PathBuf,
    pub(crate) admin: PathBuf,
    pub(crate) handler_socket: PathBuf,
    pub(crate) source: String,
    /// Where the agent serves metrics (floods are aimed there).
    pub(crate) metrics: std::net::SocketAddr,
}

impl Run {
    /// A run of the binaries in `bin` with everything under `dir`: the plugin directory, the
    /// admin and handler sockets, the logs; metrics on a free loopback port.
    pub(crate) fn new(bin: PathBuf, dir: PathBuf, source: &str) -> anyhow::Result<Run> {
        let registry = dir.join("registry");
        std::fs::create_dir_all(&registry)?;
        Ok(Run {
            bin,
            registry,
            admin: dir.join("admin.sock"),
            handler_socket: dir.join("handler.sock"),
            source: source.to_string(),
            metrics: std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .context("a free port for the agent's metrics")?,
            dir,
        })
    }

    pub(crate) fn log(&self, name: &str) -> anyhow::Result<std::fs::File> {
        Ok(std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(name))?)
    }

    pub(crate) fn start_handler(&self) -> anyhow::Result<Guard> {
        let child = Command::new(self.bin.join("dra-handler"))
            .arg("--listen")
            .arg(format!("unix://{}", self.handler_socket.display()))
            .stdin(Stdio::null())
            .stdout(self.log("handler.log")?)
            .stderr(self.log("handler.log")?)
            .spawn()
            .context("starting dra-handler")?;
        Ok(Guard(child))
    }

    pub(crate) fn start_agent(&self) -> anyhow::Result<Guard> {
        self.start_agent_with(&[])
    }

    /// The agent with `flags` added to `run`'s.
    pub(crate) fn start_agent_with(&self, flags: &[&str]) -> anyhow::Result<Guard> {
        let child = Command::new(self.bin.join("plugin-agent"))
            .args([
                "--log-format",
                "json",
                "--log-level",
                "warn",
                "run",
                "--plugin-dir",
            ])
            .arg(&self.registry)
            .args(["--source", &self.source, "--metrics-addr"])
            .arg(self.metrics.to_string())
            .arg("--admin-socket")
            .arg(&self.admin)
            .arg("--handler")
            .arg(format!(
                "DRAPlugin=unix://{}",
                self.handler_socket.display()
            ))
            .args(flags)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(self.log("agent.log")?)
            .spawn()
            .context("starting plugin-agent")?;
        Ok(Guard(child))
    }

    /// `connections` connections to the metrics port, each sent half a request and held open (until the
    /// guard goes), by uid 65534 when run as root: an unprivileged process on the node; `stdout`
    /// gets its line once every connection was tried.
    pub(crate) fn start_flood(&self, connections: usize, stdout: Stdio) -> anyhow::Result<Guard> {
        let client = self.bin.join("slow-client");
        // SAFETY: geteuid has no preconditions.
        let mut command = if unsafe { libc::geteuid() } == 0 {
            let mut command = Command::new("setpriv");
            command
                .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
                .arg(client);
            command
        } else {
            Command::new(client)
        };
        let child = command
            .arg("--tcp")
            .arg(self.metrics.to_string())
            .args(["--connections", &connections.to_string()])
            .args(["--send", "GET /metrics HTTP/1.1\\r\\n"])
            .stdin(Stdio::piped())
            .stdout(stdout)
            .stderr(self.log("slow-client.log")?)
            .spawn()
            .context("starting slow-client")?;
        Ok(Guard(child))
    }

    /// An `example-plugin` that misbehaves with `flags`.
    pub(crate) fn start_bad_plugin(&self, name: &str, flags: &[&str]) -> anyhow::Result<Guard> {
        let child = Command::new(self.bin.join("example-plugin"))
            .arg("--socket")
            .arg(self.registry.join("bad").join(name))
            .args(["--type", "DRAPlugin", "--versions", "v1.DRAPlugin"])
            .args(flags)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(self.log("bad-plugins.log")?)
            .spawn()
            .context("starting example-plugin")?;
        Ok(Guard(child))
    }

    /// `plugin-agent list -o json`: (socket, state) of every entry, or None while the agent
    /// is not answering (restarting).
    pub(crate) fn list(&self) -> Option<Vec<(PathBuf, String)>> {
        let output = Command::new(self.bin.join("plugin-agent"))
            .arg("--admin-socket")
            .arg(&self.admin)
            .args(["list", "-o", "json"])
            .output()
            .ok()?;
        if !output.status.success() {
            return None;
        }
        let rows: serde_json::Value = serde_json::from_slice(&output.stdout).ok()?;
        Some(
            rows.as_array()?
                .iter()
                .map(|r| {
                    (
                        PathBuf::from(r["socket_path"].as_str().unwrap_or_default()),
                        r["state"].as_str().unwrap_or_default().to_string(),
                    )
                })
                .collect(),
        )
    }
}

/// RSS of `pid` in KiB.
pub(crate) fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// The target directory cargo builds into (CARGO_TARGET_DIR, else `target/`).
pub(crate) fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|p| {
            if p.is_absolute() {
                p
            } else {
                shell::workspace_root().join(p)
            }
        })
        .unwrap_or_else(|| shell::workspace_root().join("target"))
}
