//! Plugins under test: `example-plugin` processes serving (or failing to serve) registration
//! sockets, whose JSON event lines the test awaits.
//!
//! ```text
//! PluginOptions::new(bin, socket).name(..).arg(..) --spawn()--> example-plugin --socket S ...
//!                                         PluginProcess <--stdout-- {"event":"notify",...}
//! ```
//!
//! Dropping a [`PluginProcess`] stops it (SIGTERM, then SIGKILL) and removes its socket if the path
//! still holds the socket it bound, so a failed test leaves neither a process nor a stale socket.

use crate::env::SharedBinary;
use crate::events::{EventLog, Line, Mark};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How long a plugin may take to bind its socket after being spawned.
const BIND_TIMEOUT: Duration = Duration::from_secs(10);

/// Options for one plugin. `new` then builder methods, then [`PluginOptions::spawn`].
#[derive(Debug, Clone)]
pub struct PluginOptions {
    bin: PathBuf,
    socket: PathBuf,
    args: Vec<String>,
    label: String,
    /// `cgroup.procs` of the cgroup the plugin starts in.
    cgroup: Option<PathBuf>,
    /// The uid and gid it runs as.
    user: Option<(u32, u32)>,
}

impl PluginOptions {
    /// A CSIPlugin called `example.plugin.test` serving at `socket`.
    pub fn new(bin: impl Into<PathBuf>, socket: impl Into<PathBuf>) -> PluginOptions {
        let socket = socket.into();
        let label = socket
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        PluginOptions {
            bin: bin.into(),
            socket,
            args: Vec::new(),
            label,
            cgroup: None,
            user: None,
        }
    }

    /// Starts the plugin in `cgroup` (it is moved there before it executes, so everything it
    /// does, its bind included, happens there).
    pub fn in_cgroup(mut self, cgroup: &crate::cgroup::TestCgroup) -> PluginOptions {
        self.cgroup = Some(cgroup.procs_file());
        self
    }

    /// Runs the plugin as `uid`:`gid` (the test runs as root; the plugin directory must let
    /// that user create its socket).
    pub fn as_user(mut self, uid: u32, gid: u32) -> PluginOptions {
        self.user = Some((uid, gid));
        self
    }

    /// `PluginInfo.name`.
    pub fn name(self, name: &str) -> PluginOptions {
        self.arg("--name").arg(name)
    }

    /// `PluginInfo.type`.
    pub fn plugin_type(self, plugin_type: &str) -> PluginOptions {
        self.arg("--type").arg(plugin_type)
    }

    /// Any other example-plugin flag.
    pub fn arg(mut self, arg: impl Into<String>) -> PluginOptions {
        self.args.push(arg.into());
        self
    }

    /// Starts the plugin without waiting for anything.
    pub fn spawn(self) -> PluginProcess {
        // Another user may not reach the checkout's binary: run a copy it can reach.
        let shared = self.user.map(|_| SharedBinary::new(&self.bin));
        let bin = shared
            .as_ref()
            .map_or(self.bin.as_path(), SharedBinary::path);
        let mut command = Command::new(bin);
        command
            .arg("--socket")
            .arg(&self.socket)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(procs) = &self.cgroup {
            let procs = std::ffi::CString::new(procs.as_os_str().as_encoded_bytes())
                .expect("a cgroup path has no NUL");
            // SAFETY: between fork and exec the closure only makes async-signal-safe calls
            // (open, write, close) on memory prepared before the fork.
            unsafe {
                use std::os::unix::process::CommandExt;
                command.pre_exec(move || crate::cgroup::join_cgroup(&procs));
            }
        }
        if let Some((uid, gid)) = self.user {
            use std::os::unix::process::CommandExt;
            command.uid(uid).gid(gid);
        }
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.bin.display()));
        let stdout = child.stdout.take().expect("stdout is piped");
        let stderr = child.stderr.take().expect("stderr is piped");
        PluginProcess {
            events: EventLog::read_from(stdout, format!("plugin-{}", self.label)),
            stderr: EventLog::read_from(stderr, format!("plugin-err-{}", self.label)),
            child: Some(child),
            socket: self.socket,
            _binary: shared,
        }
    }

    /// Starts the plugin and waits until its socket is bound (it may not listen or serve yet).
    pub async fn start(self) -> PluginProcess {
        let plugin = self.spawn();
        plugin.wait_for_event("bound", BIND_TIMEOUT).await;
        plugin
    }

    /// Starts the plugin and waits until it listens.
    pub async fn start_listening(self) -> PluginProcess {
        let plugin = self.spawn();
        plugin.wait_for_event("listening", BIND_TIMEOUT).await;
        plugin
    }
}

/// A running example plugin; stopped and cleaned up on drop.
#[derive(Debug)]
pub struct PluginProcess {
    child: Option<Child>,
    events: EventLog,
    stderr: EventLog,
    socket: PathBuf,
    /// The binary's copy for another user, kept while the plugin runs.
    _binary: Option<SharedBinary>,
}

impl PluginProcess {
    /// Where the plugin bound its socket (it may have been renamed since).
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The plugin's events.
    pub fn events(&self) -> &EventLog {
        &self.events
    }

    /// The current end of the event log.
    pub fn mark(&self) -> Mark {
        self.events.mark()
    }

    /// The plugin's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends `signal` to the plugin's process.
    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        if let Some(pid) = self.pid() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal);
        }
    }

    /// `--hand-off` plugins: hands the listener to a child process (SIGUSR1), waits for the
    /// parent's exit, and returns the child's pid.
    pub async fn hand_off(&mut self, timeout: Duration) -> u32 {
        let mark = self.mark();
        self.signal(nix::sys::signal::Signal::SIGUSR1);
        self.handed_off_after(mark, timeout).await
    }

    /// `--listen-in-child` plugins: waits until the launcher started the child that serves
    /// the socket and exited; returns the child's pid.
    pub async fn wait_for_launch(&mut self, timeout: Duration) -> u32 {
        self.handed_off_after(Mark(0), timeout).await
    }

    async fn handed_off_after(&mut self, mark: Mark, timeout: Duration) -> u32 {
        let handed = self
            .wait_for_after(mark, "handed_off", timeout, |l| l.event() == "handed_off")
            .await;
        if let Some(mut parent) = self.child.take() {
            let _ = tokio::task::spawn_blocking(move || parent.wait()).await;
        }
        handed
            .0
            .get("child")
            .and_then(serde_json::Value::as_u64)
            .and_then(|pid| u32::try_from(pid).ok())
            .unwrap_or_else(|| self.fail("handed_off without a child pid"))
    }

    /// The processes a `--hand-off` plugin handed its listener to.
    fn handed_to(&self) -> Vec<u32> {
        self.events
            .matching_since(Mark(0), |l| l.event() == "handed_off")
            .iter()
            .filter_map(|l| l.0.get("child").and_then(serde_json::Value::as_u64))
            .filter_map(|pid| u32::try_from(pid).ok())
            .collect()
    }

    /// The inode of the socket the plugin bound.
    pub fn ino(&self) -> Option<u64> {
        let bound = self
            .events
            .matching_since(Mark(0), |l| l.event() == "bound");
        bound
            .first()
            .and_then(|l| l.0.get("ino"))
            .and_then(serde_json::Value::as_u64)
    }

    /// Waits for the first event called `event`.
    pub async fn wait_for_event(&self, event: &str, timeout: Duration) -> Line {
        self.wait_for_after(Mark(0), event, timeout, |l| l.event() == event)
            .await
    }

    /// Waits until the plugin has logged `n` events called `event`, and returns them.
    pub async fn wait_for_events(&self, event: &str, n: usize, timeout: Duration) -> Vec<Line> {
        match self
            .events
            .wait_for_count(Mark(0), n, timeout, |l| l.event() == event)
            .await
        {
            Ok(lines) => lines,
            Err(e) => self.fail(&format!(
                "waiting for {n} x {event}: {e:?} (limit {timeout:?})"
            )),
        }
    }

    /// Waits for an event after `mark` matching `pred`; panics with the plugin's output otherwise.
    pub async fn wait_for_after(
        &self,
        mark: Mark,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&Line) -> bool,
    ) -> Line {
        match self.events.wait_for(mark, timeout, pred).await {
            Ok(line) => line,
            Err(e) => self.fail(&format!("waiting for {what}: {e:?} (limit {timeout:?})")),
        }
    }

    /// Waits for a `NotifyRegistrationStatus(registered)` call (from the start).
    pub async fn wait_for_notify(&self, registered: bool, timeout: Duration) -> Line {
        self.wait_for_notify_after(Mark(0), registered, timeout)
            .await
    }

    /// Waits for a `NotifyRegistrationStatus(registered)` call after `mark`.
    pub async fn wait_for_notify_after(
        &self,
        mark: Mark,
        registered: bool,
        timeout: Duration,
    ) -> Line {
        let what = format!("NotifyRegistrationStatus(registered={registered})");
        self.wait_for_after(mark, &what, timeout, |l| {
            l.event() == "notify" && l.flag("registered") == Some(registered)
        })
        .await
    }

    /// Events after `mark` called `event`.
    pub fn events_since(&self, mark: Mark, event: &str) -> Vec<Line> {
        self.events.matching_since(mark, |l| l.event() == event)
    }

    /// Whether the plugin was called (GetInfo or Notify) after `mark`: an unchanged plugin must
    /// not be, across an agent's restart.
    pub fn called_since(&self, mark: Mark) -> bool {
        !self.events_since(mark, "get_info").is_empty()
            || !self.events_since(mark, "notify").is_empty()
    }

    /// All `notify` events so far.
    pub fn notifications(&self) -> Vec<Line> {
        self.events_since(Mark(0), "notify")
    }

    /// Panics with `why` and the plugin's output.
    pub fn fail(&self, why: &str) -> ! {
        panic!(
            "plugin at {}: {why}\n--- events ---\n{}--- stderr ---\n{}",
            self.socket.display(),
            self.events.tail(40),
            self.stderr.tail(20)
        )
    }

    /// Stops the plugin with SIGTERM (it removes its socket, as real plugins do) and waits.
    pub async fn stop(mut self) -> Option<ExitStatus> {
        let child = self.child.take()?;
        tokio::task::spawn_blocking(move || terminate(child))
            .await
            .ok()
            .flatten()
    }

    /// Kills the plugin with SIGKILL: its socket stays behind (a crashed plugin).
    pub async fn kill(mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = tokio::task::spawn_blocking(move || child.wait()).await;
        }
    }
}

/// SIGTERM, then SIGKILL after 5 s; returns the exit status.
fn terminate(mut child: Child) -> Option<ExitStatus> {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            _ => {
                let _ = child.kill();
                return child.wait().ok();
            }
        }
    }
}

impl Drop for PluginProcess {
    fn drop(&mut self) {
        for pid in self.handed_to() {
            let pid = nix::unistd::Pid::from_raw(pid as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        }
        let child = self.child.take();
        if child.is_none() && self.handed_to().is_empty() {
            return;
        }
        if let Some(child) = child {
            terminate(child);
        }
        // A plugin killed before its own clean-up leaves its socket: remove it, but only if it
        // is still the one this plugin bound (another plugin may have replaced it).
        if let (Some(ino), Ok(meta)) = (self.ino(), std::fs::symlink_metadata(&self.socket))
            && meta.file_type().is_socket()
            && meta.ino() == ino
        {
            let _ = std::fs::remove_file(&self.socket);
        }
    }
}
