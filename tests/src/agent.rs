//! The agent under test: a real `plugin-agent run` process, followed through its operator
//! contract: the admin API's event stream (`plugin-agent watch`), `list` and `status`.
//!
//! ```text
//! AgentProcess::start --spawn--> plugin-agent --log-format json run --plugin-dir D --source S --handler ...
//!                     --spawn--> plugin-agent watch -o json --> EventLog --> wait_for_event(...)
//!                      <-stderr-- JSON log lines --> EventLog (failure reports; the few tests of
//!                                                   the log itself)
//! ```
//!
//! The event stream is subscribed before the start walk is known to be done (status's
//! `walks_completed`, else the `walked` event), so no event after `start` is missed; what
//! happened before (plugins registered by the start walk) is read with `list`
//! ([`AgentProcess::wait_listed`] reads it, then waits for the next event, until it holds).
//!
//! The process is killed when the handle is dropped, so a failed (panicking) test leaves nothing
//! running. [`AgentProcess::stop`] is the graceful path (SIGTERM, as systemd or kubelet's pod
//! would send).

use crate::admin::Watch;
use crate::env::{SharedBinary, Source, agent_bin, privileged, skip};
use crate::events::{EventLog, Line, Mark, WaitError};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

/// Texts of the agent's start-up error when the eBPF source is not compiled in (or not wired in
/// yet): the eBPF variants of the scenarios are skipped then, outside CI.
pub const EBPF_UNAVAILABLE: [&str; 2] = ["built without the eBPF", "not wired in yet"];

/// How long the agent may take to open its source and scan the directory (loading the eBPF
/// programs takes seconds, more on a loaded machine).
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// What to start the agent with.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// Event source under test.
    pub source: Source,
    /// Directory to watch.
    pub plugin_dir: PathBuf,
    /// `--handler TYPE=HANDLER` values.
    pub handlers: Vec<String>,
    /// The agent's admin API socket: private to the test, so parallel agents do not contend for
    /// the default `/run/plugin-agent/agent.sock` (passed as `PLUGIN_AGENT_ADMIN_SOCKET`).
    pub admin_socket: PathBuf,
    /// Anything else for `run` (`--safety-period 1s`, say).
    pub extra: Vec<String>,
    /// A command the agent is started under, e.g. `setpriv --reuid 65534 ...` (empty: none).
    pub wrapper: Vec<String>,
    /// Environment variables for the agent (`OTEL_TRACES_SAMPLER`, say), on top of the test's.
    pub env: Vec<(String, String)>,
    /// Another `plugin-agent` binary (an upgrade, say); none: the one built with the tests.
    pub binary: Option<PathBuf>,
    /// Follow the agent through its admin API (events, `list`, `status`); false for an agent
    /// whose admin socket the test cannot reach (in another mount namespace, say): then only
    /// its log says it has started.
    pub follow: bool,
}

impl AgentOptions {
    /// The usual set-up: `CSIPlugin=accept-all`.
    pub fn new(source: Source, plugin_dir: &Path) -> AgentOptions {
        AgentOptions {
            source,
            plugin_dir: plugin_dir.to_path_buf(),
            handlers: vec!["CSIPlugin=accept-all".into()],
            admin_socket: plugin_dir.with_file_name("admin.sock"),
            extra: Vec::new(),
            wrapper: Vec::new(),
            env: Vec::new(),
            binary: None,
            follow: true,
        }
    }

    /// Replaces the handler list.
    pub fn handlers(mut self, handlers: &[&str]) -> AgentOptions {
        self.handlers = handlers.iter().map(|h| h.to_string()).collect();
        self
    }
}

/// A running `plugin-agent`; killed on drop.
#[derive(Debug)]
pub struct AgentProcess {
    child: Option<Child>,
    log: EventLog,
    /// The admin API's event stream, live from before the start walk was done (none with
    /// `--no-admin`).
    watch: Option<Watch>,
    admin_socket: PathBuf,
    test: String,
    /// The binary's copy for the user a wrapper runs it as, kept while the agent runs.
    _binary: Option<SharedBinary>,
}

impl AgentProcess {
    /// A register-mode agent on `dir` in kubelet's place (inotify, the default handler), with
    /// its own runtime directory beside the tree: each agent locks the directory of its admin
    /// socket, so it can run next to the agent under test.
    pub async fn start_kubelet_stand_in(test: &str, dir: &crate::PluginDir) -> AgentProcess {
        let mut kubelet = AgentOptions::new(Source::Inotify, &dir.root());
        let runtime = dir.outside("kubelet-run");
        std::fs::create_dir_all(&runtime).expect("mkdir runtime");
        kubelet.admin_socket = runtime.join("admin.sock");
        kubelet.extra = vec!["--mode".into(), "register".into()];
        AgentProcess::start(&format!("{test}-kubelet"), kubelet)
            .await
            .expect("inotify needs no privileges")
    }

    /// Starts the agent and waits until it has scanned the plugin directory once. Returns `None`
    /// when the test must be skipped (see [`skip`]): a privileged source without root, or an eBPF
    /// source the agent was built without.
    pub async fn start(test: &str, options: AgentOptions) -> Option<AgentProcess> {
        if options.source.needs_root() && !privileged(test) {
            return None;
        }
        let binary = options.binary.clone().unwrap_or_else(agent_bin);
        // A wrapper may run the agent as another user, who may not reach the checkout.
        let shared = (!options.wrapper.is_empty()).then(|| SharedBinary::new(&binary));
        let mut command = agent_command(&options, binary, shared.as_ref());
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("{test}: cannot start plugin-agent: {e}"));
        let stderr = child.stderr.take().expect("stderr is piped");
        let log = EventLog::read_from(stderr, format!("agent-log-{test}"));
        // `--admin-socket` among the extra arguments wins over the environment, as in `run`.
        let admin_socket = options
            .extra
            .iter()
            .position(|a| a == "--admin-socket")
            .and_then(|i| options.extra.get(i + 1))
            .map_or_else(|| options.admin_socket.clone(), PathBuf::from);
        let mut agent = AgentProcess {
            child: Some(child),
            log,
            watch: None,
            admin_socket,
            test: test.to_string(),
            _binary: shared,
        };
        let served = options.follow && !options.extra.iter().any(|a| a == "--no-admin");
        let ready = match served {
            true => agent.follow_events().await,
            // Without an admin API to follow the log is all there is.
            false => agent
                .log
                .wait_for(Mark(0), START_TIMEOUT, |l| {
                    l.message() == "scanned plugin directory" && l.field_is("reason", "start")
                })
                .await
                .map(drop),
        };
        match ready {
            Ok(()) => Some(agent),
            Err(WaitError::Closed) => {
                let status = agent.wait_exit(Duration::from_secs(5));
                let output = agent.log.tail(50);
                if options.source == Source::Ebpf
                    && EBPF_UNAVAILABLE.iter().any(|m| output.contains(m))
                {
                    skip(
                        test,
                        "this plugin-agent has no eBPF source (build it with `cargo xtask test`)",
                    );
                    return None;
                }
                panic!("{test}: plugin-agent exited at start ({status:?}):\n{output}");
            }
            Err(WaitError::Timeout) => {
                panic!(
                    "{test}: plugin-agent did not finish its start walk within {START_TIMEOUT:?}:\n{}",
                    agent.log.tail(50)
                )
            }
        }
    }

    /// Subscribes to the agent's events, then waits until its start walk is done: status counts
    /// it (it was done before the subscription) or the `walked` event says so. `Closed` when the
    /// agent exited first.
    async fn follow_events(&mut self) -> Result<(), WaitError> {
        let deadline = tokio::time::Instant::now() + START_TIMEOUT;
        // The socket is bound before the source opens; a connect before that is refused.
        let watch = loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match Watch::try_start(&self.admin_socket, left).await {
                Ok(watch) => break watch,
                Err(_) if self.log.is_closed() => return Err(WaitError::Closed),
                Err(_) if left.is_zero() => return Err(WaitError::Timeout),
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        let walked = crate::admin::status(&self.admin_socket)["walks_completed"].as_u64();
        let events = watch.events().clone();
        self.watch = Some(watch);
        if walked.unwrap_or(0) > 0 {
            return Ok(());
        }
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let start_walk = events.wait_for(Mark(0), left, crate::seen::walked("start"));
        tokio::select! {
            found = start_walk => found.map(drop),
            // The agent's output ends when it exits: nothing more will come.
            _ = self.log.wait_for(Mark(0), left, |_| false) => Err(WaitError::Closed),
        }
    }

    /// Starts the agent with the usual options ([`AgentOptions::new`]).
    pub async fn start_default(
        test: &str,
        source: Source,
        plugin_dir: &Path,
    ) -> Option<AgentProcess> {
        AgentProcess::start(test, AgentOptions::new(source, plugin_dir)).await
    }

    /// The agent's log (for failure reports, and the few tests of the log itself).
    pub fn log(&self) -> &EventLog {
        &self.log
    }

    /// Waits for a log line (from the start) matching `pred`; panics with the log tail on timeout.
    /// Only for tests whose subject is the log line itself: everything else waits on events.
    pub async fn wait_for_log(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&Line) -> bool,
    ) -> Line {
        match self.log.wait_for(Mark(0), timeout, pred).await {
            Ok(line) => line,
            Err(e) => self.fail(&format!("waiting for {what}: {e:?} (limit {timeout:?})")),
        }
    }

    /// Log lines after `mark` matching `pred` (no waiting).
    pub fn logs_since(&self, mark: Mark, pred: impl Fn(&Line) -> bool) -> Vec<Line> {
        self.log.matching_since(mark, pred)
    }

    /// The admin API socket the agent serves.
    pub fn admin_socket(&self) -> &Path {
        &self.admin_socket
    }

    /// The agent's admin events (`plugin-agent watch -o json`), from just before its start walk
    /// was known to be done. Panics for an agent started with `--no-admin`.
    pub fn events(&self) -> &EventLog {
        match &self.watch {
            Some(watch) => watch.events(),
            None => self.fail("this agent serves no admin API (--no-admin): it has no events"),
        }
    }

    /// The current end of the event stream, to wait for events after it.
    pub fn event_mark(&self) -> Mark {
        self.events().mark()
    }

    /// Waits up to `limit` for an event after `mark` matching `pred` (see [`crate::seen`]); panics with
    /// the events and the log's tail otherwise.
    pub async fn wait_for_event(
        &self,
        mark: Mark,
        what: &str,
        limit: Duration,
        pred: impl Fn(&Line) -> bool,
    ) -> Line {
        match self.events().wait_for(mark, limit, pred).await {
            Ok(line) => line,
            Err(e) => self.fail(&format!(
                "waiting for the event {what}: {e:?} (limit {limit:?}); events:\n{}",
                self.events().tail(30)
            )),
        }
    }

    /// Waits for `n` events after `mark` matching `pred`, within `timeout`.
    pub async fn wait_for_events(
        &self,
        mark: Mark,
        n: usize,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&Line) -> bool,
    ) -> Vec<Line> {
        match self.events().wait_for_count(mark, n, timeout, &pred).await {
            Ok(lines) => lines,
            Err(e) => {
                let got = self.events().matching_since(mark, &pred).len();
                self.fail(&format!(
                    "waiting for {n} x the event {what}: {e:?} (limit {timeout:?}, {got} so far); events:\n{}",
                    self.events().tail(30)
                ))
            }
        }
    }

    /// Events after `mark` matching `pred` (no waiting).
    pub fn events_since(&self, mark: Mark, pred: impl Fn(&Line) -> bool) -> Vec<Line> {
        self.events().matching_since(mark, pred)
    }

    /// Waits until `plugin-agent list` shows `socket` in `state` (`registered`, `failed`, ...):
    /// for what may have happened before the test could wait for its event (a plugin the start
    /// walk found).
    pub async fn wait_listed(&self, socket: &Path, state: &str) -> crate::admin::Listed {
        let what = format!("{} listed as {state}", socket.display());
        self.wait_until(&what, || {
            crate::admin::list(&self.admin_socket)
                .remove(socket)
                .filter(|row| row.state == state)
        })
        .await
    }

    /// `plugin-agent status -o json`.
    pub fn status(&self) -> serde_json::Value {
        crate::admin::status(&self.admin_socket)
    }

    /// Waits until `look` (at `list` or `status`) finds what it wants, and returns it: for a
    /// fact that may have come before the test could wait for its event. Looks, then waits for
    /// the next event, until it holds (the agent changes what `list` and `status` say before it
    /// publishes the event that tells it). An agent not followed ([`AgentOptions::follow`]) is
    /// asked every 50 ms instead.
    pub async fn wait_until<T>(&self, what: &str, look: impl Fn() -> Option<T>) -> T {
        let deadline = tokio::time::Instant::now() + crate::EVENT_TIMEOUT;
        loop {
            let mark = self.watch.as_ref().map(|watch| watch.events().mark());
            if let Some(found) = look() {
                return found;
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let changed = match (&self.watch, mark) {
                (Some(watch), Some(mark)) => {
                    watch.events().wait_for(mark, left, |_| true).await.is_ok()
                }
                _ => {
                    tokio::time::sleep(Duration::from_millis(50).min(left)).await;
                    !left.is_zero()
                }
            };
            if !changed {
                self.fail(&format!("never {what} (within {:?})", crate::EVENT_TIMEOUT))
            }
        }
    }

    /// Panics with `why` and the end of the agent's log.
    pub fn fail(&self, why: &str) -> ! {
        panic!(
            "{}: {why}\n--- plugin-agent log (last 80 lines) ---\n{}",
            self.test,
            self.log.tail(80)
        )
    }

    /// The process id, for signals.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Stops the agent with SIGTERM and waits for it to exit (graceful shutdown).
    pub async fn stop(mut self) -> ExitStatus {
        let Some(mut child) = self.child.take() else {
            self.fail("agent already stopped")
        };
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let waited = tokio::task::spawn_blocking(move || {
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            loop {
                match child.try_wait() {
                    Ok(Some(status)) => return Ok(status),
                    Ok(None) if std::time::Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    _ => {
                        let _ = child.kill();
                        let _ = child.wait();
                        return Err("plugin-agent did not exit within 20 s of SIGTERM");
                    }
                }
            }
        })
        .await
        .expect("waiting for the agent");
        // The event stream ends with the agent: read it to its end, so the events the agent
        // published before it exited are all there for the test.
        if let (Ok(_), Some(watch)) = (&waited, &self.watch) {
            let _ = watch
                .events()
                .wait_for(Mark(0), Duration::from_secs(5), |_| false)
                .await;
        }
        match waited {
            Ok(status) => status,
            Err(why) => self.fail(why),
        }
    }

    /// Waits for an exited (or exiting) agent, killing it after `limit`.
    fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        let deadline = std::time::Instant::now() + limit;
        loop {
            match child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                _ => {
                    let _ = child.kill();
                    return child.wait().ok();
                }
            }
        }
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Predicates on agent log lines, for the few tests whose subject is the log line itself (the
/// trace and span IDs it carries, the plugin it names): everything else follows [`crate::seen`].
pub mod logs {
    use crate::events::Line;
    use std::path::Path;

    fn about(line: &Line, socket: &Path) -> bool {
        line.field_is("socket_path", &socket.to_string_lossy())
    }

    /// The executor finished registering the plugin at `socket`.
    pub fn registered(socket: &Path) -> impl Fn(&Line) -> bool + '_ {
        move |l| l.message() == "plugin registered" && about(l, socket)
    }

    /// A registration attempt for `socket` failed.
    pub fn registration_failed(socket: &Path) -> impl Fn(&Line) -> bool + '_ {
        move |l| l.message() == "plugin registration failed" && about(l, socket)
    }

    /// Any line that names `socket` (in its fields or spans).
    pub fn mentions(socket: &Path) -> impl Fn(&Line) -> bool + '_ {
        move |l| about(l, socket)
    }
}

/// The command line `start` runs: the agent (through the wrapper, if any, on the binary's shared
/// copy) with JSON debug logs, `options`' plugin directory, source, handlers and extra arguments.
fn agent_command(
    options: &AgentOptions,
    binary: PathBuf,
    shared: Option<&SharedBinary>,
) -> Command {
    let mut command = match options.wrapper.split_first() {
        Some((program, args)) => {
            let mut command = Command::new(program);
            command
                .args(args)
                .arg(shared.map_or(binary.as_path(), SharedBinary::path));
            command
        }
        None => Command::new(binary),
    };
    command
        .args([
            "--log-format",
            "json",
            "--log-level",
            "plugin_agent=debug",
            "run",
            "--plugin-dir",
        ])
        .arg(&options.plugin_dir)
        .args(["--source", options.source.as_arg()]);
    for handler in &options.handlers {
        command.args(["--handler", handler]);
    }
    command
        .env("PLUGIN_AGENT_ADMIN_SOCKET", &options.admin_socket)
        .envs(options.env.iter().map(|(k, v)| (k, v)))
        .args(&options.extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    command
}
