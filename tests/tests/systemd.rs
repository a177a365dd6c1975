//! The systemd unit we ship, run for real: `deploy/plugin-agent.service`, byte for byte, started
//! by systemd as PID 1 of private namespaces, with one drop-in that points it at the agent under
//! test, its configuration and a private plugin directory. A host process plays the node's plugin.
//!
//! ```text
//! test ── unshare --pid --mount --net --cgroup ... ──> sh (PID 1: private /proc, /run, /tmp,
//!   │                                                   bpffs, cgroup2) ─exec─> systemd ── unit ──> agent
//!   ├─ nsenter -m -p systemctl is-active|stop|start|show      (the operator's commands)
//!   ├─ plugin-agent --admin-socket /proc/<pid 1>/root/run/plugin-agent/agent.sock status|list
//!   ├─ GET /readyz on the namespace's loopback                 (the agent's readiness probe)
//!   └─ example-plugin in the host directory the namespace binds as the plugin directory
//! ```
//!
//! Why: the unit's sandboxing (ProtectSystem=strict, a capability bounding set, NoNewPrivileges,
//! RuntimeDirectory=, ...) can break the agent in ways no test that starts the binary itself
//! sees. Asserted through the agent's contracts only: systemd's unit state and results, `status`
//! and `list` over the admin socket, `/readyz`, the kernel's view of the agent's capabilities,
//! and the plugin's own record of the calls it received.
//!
//! Nothing of the host's boot runs (systemd sees only the test's units) and nothing stays: the
//! mounts live in the namespace's mount namespace, systemd's cgroups in one the test made, and
//! killing the namespace's PID 1 ends every process in it (see [`Namespace`]'s `Drop`).
//!
//! Root only (namespaces, mounts, eBPF), systemd at `/lib/systemd/systemd`, util-linux's
//! `unshare` and `nsenter`, and cgroup v2 mounted; a skip otherwise, a failure under `CI=true`.

use plugin_agent_tests::cgroup::TestCgroup;
use plugin_agent_tests::env::{agent_bin, privileged, skip};
use plugin_agent_tests::events::EventLog;
use plugin_agent_tests::{EVENT_TIMEOUT, PluginOptions, Source, admin, procfs, test_name};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// systemd's binary (Debian and Ubuntu also have it at `/usr/lib/systemd/systemd`).
const SYSTEMD: &str = "/lib/systemd/systemd";

/// The unit under test.
const UNIT: &str = "plugin-agent.service";

/// Where the namespace shows the test's staging directory (a bind mount): units, configuration,
/// the agent's binary and the plugin directory.
const STAGE: &str = "/run/plugin-agent-test";

/// How long systemd may take to come up and start the unit (about a second here).
const BOOT_TIMEOUT: Duration = Duration::from_secs(20);

/// `systemctl stop` must end the agent within this (the unit allows 60 s before SIGKILL; a stop
/// that slow would pass systemd unnoticed, as it would kubelet).
const STOP_BOUND: Duration = Duration::from_secs(5);

/// Polling interval for systemd's unit state and the agent's readiness probe: neither offers
/// the test an event stream (systemd's D-Bus signals would need a bus client in the namespace).
const POLL: Duration = Duration::from_millis(25);

/// What PID 1 of the namespaces runs: the mounts systemd and the unit need, made private to the
/// namespace, then systemd itself.
const PID1_SCRIPT: &str = r#"
set -eu
stage=$1 agent=$2 console=$3  # $4: systemd, $5: --unit=<the target it boots to>
# Every mount below stays in this mount namespace.
mount --make-rprivate /
# systemd's console: its own messages and the agent's output, for failure messages.
mount --bind "$console" /dev/console
mount -t proc proc /proc
# systemd's runtime state (its private socket, the unit's RuntimeDirectory=), in memory.
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir /run/plugin-agent-test
mount --bind "$stage" /run/plugin-agent-test
mount --bind "$agent" /run/plugin-agent-test/bin/plugin-agent
# PrivateTmp= makes directories in both.
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -t tmpfs -o mode=1777 tmpfs /var/tmp
# A bpffs of its own: the agent's pins go with the namespace.
mount -t bpf bpf /sys/fs/bpf
# The cgroup namespace's view: what systemd creates lands in the test's cgroup.
mount -t cgroup2 cgroup2 /sys/fs/cgroup
# SYSTEMD_UNIT_PATH: the test's units only, so nothing of the host's boot runs. `container`:
# systemd's contract for running as PID 1 of a container. The agent's output goes to the console
# (there is no journald here); the unit does not set StandardOutput=, so the unit is unchanged.
exec env SYSTEMD_UNIT_PATH=/run/plugin-agent-test/units SYSTEMD_COLORS=0 container=plugin-agent-test \
    "$4" "$5" --log-target=console \
    --default-standard-output=tty --default-standard-error=tty
"#;

fn deploy(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(file)
}

/// The value of `key=` in a unit file: its last assignment (the keys used are in one section
/// each; a comment never matches).
fn unit_setting(unit: &str, key: &str) -> Option<String> {
    unit.lines()
        .filter_map(|l| l.trim().strip_prefix(key)?.strip_prefix('='))
        .next_back()
        .map(str::to_string)
}

/// The staging directory's contents, derived from the shipped files.
struct Staged {
    /// The agent's configuration, as it will read it.
    config: toml::Table,
    /// The drop-in, as written.
    drop_in: String,
    /// The target systemd boots to: the one the unit is enabled in.
    target: String,
}

/// Writes the units, the drop-in and the configuration into `stage` (shown at [`STAGE`]).
fn stage(stage: &Path) -> Staged {
    let write = |relative: &str, text: &[u8]| {
        let path = stage.join(relative);
        let dir = path.parent().expect("a staged file has a directory");
        std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    };
    let unit = std::fs::read(deploy(UNIT)).expect("read deploy/plugin-agent.service");
    write(&format!("units/{UNIT}"), &unit);
    let unit = String::from_utf8(unit).expect("the unit is text");

    // The shipped configuration, except the plugin directory (the test's), and a handler so the
    // agent registers (the shipped file leaves the mode to observe, with no handler).
    let shipped = std::fs::read_to_string(deploy("plugin-agent.toml"))
        .expect("read deploy/plugin-agent.toml");
    let mut config: toml::Table = shipped.parse().expect("deploy/plugin-agent.toml parses");
    let shipped_dir = config
        .get("plugin_dir")
        .and_then(toml::Value::as_str)
        .expect("deploy/plugin-agent.toml names plugin_dir")
        .to_string();
    config.insert("plugin_dir".into(), format!("{STAGE}/registry").into());
    let mut handlers = toml::Table::new();
    handlers.insert("CSIPlugin".into(), "accept-all".into());
    config.insert("handlers".into(), handlers.into());
    let config_text = toml::to_string(&config).expect("the configuration serializes");
    write("plugin-agent.toml", config_text.as_bytes());

    // ExecStart as shipped but for the binary and the --config path; ReadWritePaths as shipped
    // but for the plugin directory.
    let exec = unit_setting(&unit, "ExecStart").expect("the unit has ExecStart=");
    let mut words: Vec<String> = exec.split_whitespace().map(str::to_string).collect();
    words[0] = format!("{STAGE}/bin/plugin-agent");
    let config_at = words
        .iter()
        .position(|w| w == "--config")
        .expect("the unit passes --config")
        + 1;
    words[config_at] = format!("{STAGE}/plugin-agent.toml");
    let writable = unit_setting(&unit, "ReadWritePaths").expect("the unit has ReadWritePaths=");
    // The entry that makes the shipped plugin_dir writable: the directory or an ancestor (the
    // agent re-creates a removed directory, which takes its parent), mapped to the same ancestor
    // of the test's directory.
    let shipped = Path::new(&shipped_dir);
    let test_dir = PathBuf::from(format!("{STAGE}/registry"));
    let mapped = |entry: &str| {
        let levels = shipped.strip_prefix(entry).ok()?.components().count();
        test_dir
            .ancestors()
            .nth(levels)
            .map(|p| p.display().to_string())
    };
    assert!(
        writable.split_whitespace().any(|p| mapped(p).is_some()),
        "the unit's ReadWritePaths= ({writable}) does not cover the shipped plugin_dir {shipped_dir}"
    );
    // On a fresh node kubelet (ordered after the agent) has not made the directory yet, and a
    // missing ReadWritePaths= entry fails the unit (226/NAMESPACE): StateDirectory= makes it.
    assert_eq!(
        unit_setting(&unit, "StateDirectory").map(|d| format!("/var/lib/{d}")),
        Some(shipped_dir.to_string()),
        "the unit does not create the shipped plugin_dir on a fresh node"
    );
    let writable = writable
        .split_whitespace()
        .map(|p| mapped(p).unwrap_or_else(|| p.to_string()))
        .collect::<Vec<_>>()
        .join(" ");
    let drop_in = format!(
        "# The test's only change to the shipped unit.\n\
         [Service]\n\
         # The agent under test (bind-mounted into the namespace: the unit's ProtectHome= would hide\n\
         # a checkout under /home) reading the test's configuration, not the host's /etc; the same\n\
         # arguments otherwise. The empty assignment replaces the command instead of adding one.\n\
         ExecStart=\n\
         ExecStart={}\n\
         # The test's directory (or the ancestor the unit names) instead of {shipped_dir}'s:\n\
         # systemd fails a unit (226/NAMESPACE)\n\
         # whose ReadWritePaths= does not exist, and ProtectSystem=strict makes the rest read-only.\n\
         ReadWritePaths=\n\
         ReadWritePaths={writable}\n\
         # The test's directory exists; the shipped StateDirectory= would make the host's\n\
         # /var/lib/kubelet/plugins_registry (the namespace shares the host's /var/lib).\n\
         StateDirectory=\n",
        words.join(" ")
    );
    write(&format!("units/{UNIT}.d/test.conf"), drop_in.as_bytes());

    // What `systemctl enable` makes of the unit's WantedBy= (the target systemd boots to), and
    // empty stand-ins for that target and for the boot's targets a service's default
    // dependencies require (`systemctl start` refuses a unit whose requirement is missing).
    let wanted_by = unit_setting(&unit, "WantedBy").expect("the unit has WantedBy=");
    for target in [wanted_by.as_str(), "sysinit.target", "basic.target"] {
        write(
            &format!("units/{target}"),
            b"[Unit]\nDescription=Stand-in: only what the plugin-agent test enabled\n",
        );
    }
    let wants = stage.join(format!("units/{wanted_by}.wants"));
    std::fs::create_dir_all(&wants).expect("mkdir the .wants directory");
    std::os::unix::fs::symlink(format!("../{UNIT}"), wants.join(UNIT)).expect("enable the unit");

    // The mount point of the agent's binary, and the plugin directory (the unit requires it).
    write("bin/plugin-agent", b"");
    std::fs::create_dir(stage.join("registry")).expect("mkdir the plugin directory");
    Staged {
        config,
        drop_in,
        target: wanted_by,
    }
}

/// A pseudo-terminal for systemd's console (systemd writes only to a terminal there), read into
/// an [`EventLog`]. The test keeps the terminal side open, so the log lasts as long as this does.
struct Console {
    log: EventLog,
    path: PathBuf,
    _terminal: OwnedFd,
}

impl Console {
    fn open() -> std::io::Result<Console> {
        let (mut reader, mut terminal) = (-1, -1);
        // SAFETY: openpty stores two new descriptors in the integers given; no name buffer,
        // default terminal settings and size (null pointers are allowed for all three).
        let opened = unsafe {
            libc::openpty(
                &mut reader,
                &mut terminal,
                std::ptr::null_mut(),
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        if opened != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: both descriptors were just opened and are owned by nothing else.
        let (reader, terminal) =
            unsafe { (OwnedFd::from_raw_fd(reader), OwnedFd::from_raw_fd(terminal)) };
        for fd in [&reader, &terminal] {
            // Not inherited by every process the test starts.
            // SAFETY: F_SETFD on a descriptor owned here.
            if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        // (systemd sets the terminal's modes itself: its lines end in \r\n, which JSON parsing
        // of the agent's lines ignores.)
        let path = std::fs::read_link(format!("/proc/self/fd/{}", terminal.as_raw_fd()))?;
        let log = EventLog::read_from(std::fs::File::from(reader), "systemd-console".into());
        Ok(Console {
            log,
            path,
            _terminal: terminal,
        })
    }
}

/// systemd as PID 1 of new pid, mount, network, UTS, IPC and cgroup namespaces, booted to the
/// staged units. Dropping it kills the namespace (SIGKILL to its PID 1 ends every process in
/// it, and with them its mounts and the agent's pins) and removes the cgroups systemd made.
struct Namespace {
    test: String,
    /// `unshare`: PID 1 is its child.
    unshare: Child,
    /// Its stderr: the setup script's errors.
    setup_log: EventLog,
    /// PID 1, as the host numbers it.
    pid1: u32,
    console: Console,
    /// The namespace's cgroup root, which the test made; systemd's cgroups are below it.
    cgroup: TestCgroup,
    /// The staging directory, shown at [`STAGE`] inside.
    stage: tempfile::TempDir,
    config: toml::Table,
}

impl Namespace {
    /// Stages the units and boots systemd; `None` (after [`skip`]) when this machine cannot.
    fn boot(test: &str) -> Option<Namespace> {
        if !Path::new(SYSTEMD).is_file() {
            skip(test, &format!("no systemd at {SYSTEMD}"));
            return None;
        }
        for tool in ["unshare", "nsenter"] {
            if Command::new(tool).arg("--version").output().is_err() {
                skip(test, &format!("no `{tool}` (util-linux)"));
                return None;
            }
        }
        let Some(cgroup) = TestCgroup::new("systemd") else {
            skip(
                test,
                "no writable cgroup v2 hierarchy for systemd's cgroups",
            );
            return None;
        };
        let console = match Console::open() {
            Ok(console) => console,
            Err(e) => {
                skip(
                    test,
                    &format!("no pseudo-terminal for systemd's console: {e}"),
                );
                return None;
            }
        };
        let stage_dir = tempfile::Builder::new()
            .prefix("pa-systemd-")
            .tempdir()
            .expect("create the staging directory");
        let Staged {
            config,
            drop_in,
            target,
        } = stage(stage_dir.path());
        eprintln!("{test}: drop-in {UNIT}.d/test.conf:\n{drop_in}");

        let procs =
            std::ffi::CString::new(cgroup.procs_file().into_os_string().into_encoded_bytes())
                .expect("a cgroup path has no NUL");
        // A network namespace too: systemd as PID 1 sets up loopback and network sysctls, which
        // must not be the host's, and the agent keeps the shipped metrics address (the host's
        // port may be taken).
        let mut command = Command::new("unshare");
        command
            .args([
                "--pid",
                "--fork",
                "--kill-child",
                "--mount",
                "--net",
                "--uts",
                "--ipc",
            ])
            .args(["--cgroup", "--", "sh", "-c", PID1_SCRIPT, "sh"])
            .arg(stage_dir.path())
            .arg(agent_bin())
            .arg(&console.path)
            .arg(SYSTEMD)
            .arg(format!("--unit={target}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        // SAFETY: between fork and exec only async-signal-safe calls (prctl, open, write, close)
        // on memory prepared before the fork.
        unsafe {
            use std::os::unix::process::CommandExt;
            command.pre_exec(move || {
                // A test killed outright takes the namespace with it (`--kill-child` passes
                // the signal on to PID 1).
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The cgroup namespace's root is the cgroup `unshare` is in.
                plugin_agent_tests::cgroup::join_cgroup(&procs)
            });
        }
        let mut unshare = match command.spawn() {
            Ok(child) => child,
            Err(e) => {
                skip(test, &format!("cannot start unshare: {e}"));
                return None;
            }
        };
        let setup_log = EventLog::read_from(
            unshare.stderr.take().expect("stderr is piped"),
            "systemd-setup".into(),
        );
        // PID 1 is unshare's only child; it exists as soon as unshare has forked.
        let deadline = Instant::now() + BOOT_TIMEOUT;
        let pid1 = loop {
            let children =
                std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", unshare.id()))
                    .unwrap_or_default();
            if let Some(pid) = children
                .split_whitespace()
                .next()
                .and_then(|p| p.parse().ok())
            {
                break Some(pid);
            }
            if matches!(unshare.try_wait(), Ok(Some(_))) || Instant::now() > deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let mut namespace = Namespace {
            test: test.to_string(),
            unshare,
            setup_log,
            pid1: pid1.unwrap_or(0),
            console,
            cgroup,
            stage: stage_dir,
            config,
        };
        if pid1.is_none() {
            let status = namespace.unshare.wait();
            skip(
                test,
                &format!(
                    "unshare could not make the namespaces ({status:?}):\n{}",
                    namespace.setup_log.tail(20)
                ),
            );
            return None;
        }
        // Until systemd answers, the setup may still fail (mounts refused): that is a skip too.
        loop {
            if let Ok(Some(status)) = namespace.unshare.try_wait() {
                skip(
                    test,
                    &format!(
                        "the namespace's setup failed ({status}):\n{}{}",
                        namespace.setup_log.tail(20),
                        namespace.console.log.tail(20)
                    ),
                );
                return None;
            }
            // `is-active` prints the unit's state once systemd answers on its socket.
            if !namespace.is_active().is_empty() {
                break;
            }
            if Instant::now() > deadline {
                namespace.fail("systemd did not answer");
            }
            std::thread::sleep(POLL);
        }
        Some(namespace)
    }

    /// `systemctl <args>` in the namespace (its mount namespace holds systemd's socket; its pid
    /// namespace makes systemctl see systemd as PID 1, not as a chroot).
    fn systemctl(&self, args: &[&str]) -> Output {
        Command::new("nsenter")
            .args(["-t", &self.pid1.to_string(), "-m", "-p", "--", "systemctl"])
            .args(args)
            .output()
            .expect("run nsenter systemctl")
    }

    /// `systemctl <verb> plugin-agent.service`, which must succeed.
    fn unit_command(&self, verb: &str) {
        let output = self.systemctl(&[verb, UNIT]);
        if !output.status.success() {
            self.fail(&format!(
                "systemctl {verb} {UNIT}: {}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ));
        }
    }

    /// `systemctl is-active plugin-agent.service` (`active`, `activating`, `failed`, ...).
    fn is_active(&self) -> String {
        let output = self.systemctl(&["is-active", UNIT]);
        String::from_utf8_lossy(&output.stdout).trim().to_string()
    }

    /// A property of the unit (`systemctl show -p <property> --value`).
    fn show(&self, property: &str) -> String {
        let output = self.systemctl(&["show", "-p", property, "--value", UNIT]);
        String::from_utf8_lossy(&output.stdout).trim().to_string()
    }

    /// Waits until the unit is active; fails at once if systemd gave up on it.
    fn wait_active(&self) {
        let deadline = Instant::now() + BOOT_TIMEOUT;
        loop {
            match self.is_active().as_str() {
                "active" => return,
                "failed" => self.fail("the unit failed"),
                _ if Instant::now() > deadline => self.fail("the unit did not become active"),
                _ => std::thread::sleep(POLL),
            }
        }
    }

    /// A path inside the namespace, as the host reaches it.
    fn host_path(&self, inside: &str) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root{inside}", self.pid1))
    }

    /// A setting of the agent's configuration.
    fn config(&self, key: &str) -> &str {
        self.config
            .get(key)
            .and_then(toml::Value::as_str)
            .unwrap_or_else(|| panic!("the configuration has no {key}"))
    }

    /// The admin socket, from the host.
    fn admin_socket(&self) -> PathBuf {
        self.host_path(self.config("admin_socket"))
    }

    /// The plugin directory on the host (what the namespace shows at `{STAGE}/registry`).
    fn plugin_dir(&self) -> PathBuf {
        self.stage.path().join("registry")
    }

    /// `GET /readyz` on the agent's metrics address, from a thread in the namespace's network
    /// namespace; `None` while nothing answers.
    fn readyz(&self) -> Option<u16> {
        let addr: SocketAddr = self
            .config("metrics_addr")
            .parse()
            .expect("metrics_addr is an address");
        let netns = std::fs::File::open(format!("/proc/{}/ns/net", self.pid1)).ok()?;
        std::thread::spawn(move || {
            nix::sched::setns(&netns, nix::sched::CloneFlags::CLONE_NEWNET).ok()?;
            plugin_agent_tests::http::try_http_get(addr, "/readyz")
                .ok()
                .map(|(code, _)| code)
        })
        .join()
        .ok()
        .flatten()
    }

    /// Waits until the agent reports ready (event source attached, first scan done).
    fn wait_ready(&self) {
        let deadline = Instant::now() + EVENT_TIMEOUT;
        while self.readyz() != Some(200) {
            if self.is_active() == "failed" || Instant::now() > deadline {
                self.fail(&format!(
                    "the agent is not ready: /readyz {:?}",
                    self.readyz()
                ));
            }
            std::thread::sleep(POLL);
        }
    }

    /// The agent's process as the host numbers it (systemd's MainPID is the namespace's).
    fn agent_pid(&self) -> u32 {
        let main: u32 = self
            .show("MainPID")
            .parse()
            .unwrap_or_else(|e| self.fail(&format!("MainPID: {e}")));
        let ns = std::fs::read_link(format!("/proc/{}/ns/pid", self.pid1))
            .expect("PID 1's pid namespace");
        let found = std::fs::read_dir("/proc")
            .expect("read /proc")
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .find(|pid| {
                std::fs::read_link(format!("/proc/{pid}/ns/pid")).is_ok_and(|n| n == ns)
                    && status_field(*pid, "NSpid")
                        .and_then(|ids| ids.split_whitespace().next_back()?.parse().ok())
                        == Some(main)
            });
        found.unwrap_or_else(|| self.fail(&format!("no process for MainPID {main}")))
    }

    /// [`Namespace::fail`] unless `ok`.
    fn check(&self, ok: bool, why: impl FnOnce() -> String) {
        if !ok {
            self.fail(&why());
        }
    }

    /// Panics with `why`, the unit's state and the console (systemd's and the agent's output).
    fn fail(&self, why: &str) -> ! {
        let status = self.systemctl(&["status", "--no-pager", UNIT]);
        panic!(
            "{}: {why}\n--- systemctl status ---\n{}{}--- console ---\n{}--- setup ---\n{}",
            self.test,
            String::from_utf8_lossy(&status.stdout),
            String::from_utf8_lossy(&status.stderr),
            self.console.log.tail(60),
            self.setup_log.tail(10)
        )
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        // SIGKILL to PID 1 ends every process of its pid namespace, and unshare, which reaps
        // it, then exits (its pid is still PID 1's while unshare runs).
        if self.pid1 != 0 && matches!(self.unshare.try_wait(), Ok(None)) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.pid1 as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while matches!(self.unshare.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        // Whatever is left in the test's cgroup (nothing, unless unshare hung): cgroup.kill
        // (Linux 5.14) ends it without naming a pid.
        let _ = std::fs::write(self.cgroup.procs_file().with_file_name("cgroup.kill"), "1");
        let _ = self.unshare.kill();
        let _ = self.unshare.wait();
        // systemd's cgroups (init.scope, system.slice/...), deepest first; `cgroup` removes
        // its own directory when dropped.
        let Some(root) = self.cgroup.procs_file().parent().map(Path::to_path_buf) else {
            return;
        };
        let mut dirs = Vec::new();
        let mut pending = vec![root];
        while let Some(dir) = pending.pop() {
            for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    dirs.push(entry.path());
                    pending.push(entry.path());
                }
            }
        }
        dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
        for dir in dirs {
            // A process just killed leaves its cgroup a moment later.
            let deadline = Instant::now() + Duration::from_secs(2);
            while std::fs::remove_dir(&dir).is_err() && dir.exists() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if dir.exists() {
                eprintln!("{}: cgroup {} left behind", self.test, dir.display());
            }
        }
    }
}

/// A field of `/proc/<pid>/status`.
fn status_field(pid: u32, name: &str) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(|v| v.trim().to_string())
}

/// The capability mask the agent keeps after start (`plugin_agent::privileges::KEPT`).
fn kept_mask() -> u64 {
    plugin_agent::privileges::KEPT
        .iter()
        .fold(0, |mask, cap| mask | (1u64 << cap.index()))
}

/// The shipped unit under systemd: started at boot, eBPF, a plugin registered, least privilege,
/// a clean stop within the bound, and a start that adopts the pinned programs and the state
/// without calling the registered plugin again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shipped_unit_runs_the_agent_under_systemd_and_restarts_invisibly() {
    let test = test_name();
    if !privileged(&test) {
        return;
    }
    let started = Instant::now();
    let Some(ns) = Namespace::boot(&test) else {
        return;
    };
    ns.wait_active();

    // systemd runs the shipped file, with the test's drop-in and nothing else.
    assert_eq!(
        ns.show("FragmentPath"),
        format!("{STAGE}/units/{UNIT}"),
        "{test}"
    );
    assert_eq!(
        ns.show("DropInPaths"),
        format!("{STAGE}/units/{UNIT}.d/test.conf"),
        "{test}"
    );
    let staged = std::fs::read(ns.stage.path().join("units").join(UNIT)).expect("the staged unit");
    assert_eq!(
        staged,
        std::fs::read(deploy(UNIT)).expect("the shipped unit"),
        "{test}: the unit systemd runs is not deploy/{UNIT}"
    );
    // The admin socket must be where the unit makes a directory for it.
    let runtime_dir = format!("/run/{}/", ns.show("RuntimeDirectory"));
    assert!(
        ns.config("admin_socket").starts_with(&runtime_dir),
        "{test}: admin_socket {} is not in the unit's RuntimeDirectory {runtime_dir}",
        ns.config("admin_socket")
    );

    ns.wait_ready();
    let admin = ns.admin_socket();
    let status = admin::status(&admin);
    ns.check(status["source"] == Source::Ebpf.as_arg(), || {
        format!(
            "`auto` did not choose eBPF under the unit's sandbox (an agent built without the \
             eBPF object? `cargo xtask test` builds it): {status}"
        )
    });
    eprintln!("{test}: started: {}", status["source_description"]);

    // Least privilege, as the kernel reports it, once the admin API answers (the agent drops
    // its capabilities before it serves).
    let agent = ns.agent_pid();
    let caps = procfs::caps(agent).expect("read the agent's /proc/<pid>/status");
    let kept = kept_mask();
    assert_eq!(
        (caps.effective, caps.permitted, caps.bounding),
        (kept, kept, kept),
        "{test}: CapEff, CapPrm, CapBnd should be exactly plugin_agent::privileges::KEPT \
         ({kept:#x}): {caps:x?}"
    );
    assert_eq!(
        (caps.inheritable, caps.ambient),
        (0, 0),
        "{test}: {caps:x?}"
    );
    eprintln!("{test}: agent (pid {agent}) capabilities {caps:x?}");
    assert_eq!(
        status_field(agent, "NoNewPrivs").as_deref(),
        Some("1"),
        "{test}: NoNewPrivileges=yes is not in force"
    );

    // A plugin on the host, in the directory the agent sees at {STAGE}/registry.
    let plugin = PluginOptions::new(
        env!("CARGO_BIN_EXE_example-plugin"),
        ns.plugin_dir().join("csi.sock"),
    )
    .start_listening()
    .await;
    let notified = plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    assert_eq!(
        notified.0["peer_pid"].as_u64(),
        Some(u64::from(agent)),
        "{test}: registered by another process than the unit's agent: {notified}"
    );
    let in_agent = PathBuf::from(format!("{STAGE}/registry/csi.sock"));
    let listed = admin::list(&admin);
    assert_eq!(
        listed.get(&in_agent).map(|l| l.state.as_str()),
        Some("registered"),
        "{test}: {listed:?}"
    );

    // `systemctl stop`: SIGTERM, and the agent ends by itself, cleanly, within the bound.
    let stopping = Instant::now();
    ns.unit_command("stop");
    let took = stopping.elapsed();
    ns.check(took < STOP_BOUND, || {
        format!("systemctl stop took {took:?}")
    });
    let (state, result) = (ns.is_active(), ns.show("Result"));
    ns.check(state == "inactive" && result == "success", || {
        format!("after the stop: {state}, Result={result}")
    });
    let exit = (ns.show("ExecMainCode"), ns.show("ExecMainStatus"));
    ns.check(exit == ("1".into(), "0".into()), || {
        format!("the agent did not exit 0 on SIGTERM: ExecMainCode, ExecMainStatus = {exit:?} (code 1 = exited, 2 = killed)")
    });
    eprintln!("{test}: systemctl stop took {took:?}");

    // `systemctl start`: the new agent adopts the pinned programs and carries on from the state
    // file in the preserved RuntimeDirectory; the registered plugin hears nothing.
    let mark = plugin.mark();
    ns.unit_command("start");
    ns.wait_active();
    ns.wait_ready();
    let status = admin::status(&admin);
    let adopted = status["source"] == Source::Ebpf.as_arg()
        && status["source_description"]
            .as_str()
            .is_some_and(|d| d.contains("(adopted)"));
    ns.check(adopted, || {
        format!("the started agent did not adopt the pinned programs: {status}")
    });
    eprintln!("{test}: started again: {}", status["source_description"]);
    let listed = admin::list(&admin);
    assert_eq!(
        listed.get(&in_agent).map(|l| l.state.as_str()),
        Some("registered"),
        "{test}: {listed:?}"
    );
    assert!(
        !plugin.called_since(mark),
        "{test}: the registered plugin was called again after the start:\n{}",
        plugin.events().tail(10)
    );
    eprintln!("{test}: passed in {:?}", started.elapsed());
}
