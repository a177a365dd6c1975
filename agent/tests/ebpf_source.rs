//! The eBPF event source against the running kernel: real programs, real syscalls, exact event lists.
//!
//! The source filters the agent's own process in the kernel, and the test process is the agent
//! here, so every filesystem action runs in a helper process (this test binary re-executed, see
//! [`helper_process_performs_actions`]), which also gives relative paths their own working
//! directory. Each script ends with the helper binding a sentinel socket in the watched directory;
//! events are collected until the sentinel's arrives (the ring buffer keeps one thread's records
//! in order), so a test asserts exactly what was reported, without sleeping.
//!
//! Needs root (CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN for tracefs) and an agent built with the kernel
//! object (`PLUGIN_AGENT_EBPF_OBJ`, see `cargo xtask build`). Without either, the tests print why
//! and pass, or fail when `CI=true`.

use std::ffi::OsString;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram, UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use plugin_agent::event_source::ebpf::{self, EbpfOptions, EbpfSource, HookChoice, HookFamily};
use plugin_agent::event_source::{
    self, Entry, EventSource, FsEvent, Observed, SourceChoice, SourceKind, SourceOptions,
    WatchedDir, monotonic_now_ns,
};
use tempfile::TempDir;
use tokio::sync::mpsc;
use tokio_util::sync::{CancellationToken, DropGuard};

/// Environment variable carrying the helper's script, one action per line.
const SCRIPT_ENV: &str = "EBPF_SOURCE_SCRIPT";

/// How long a step may take before the test gives up (a guard against hangs, not a wait).
const STEP_TIMEOUT: Duration = Duration::from_secs(20);

/// Held shared by every test while it has a source loaded, and alone by the one that rebuilds a
/// trampoline on purpose with a call inside the function: every loaded fentry source counts
/// that call's skipped fexit as a loss, whoever made it, and the other tests' event lists would
/// carry its rescan. (A lock of its own because the standard one's guards cannot cross the
/// awaits of a multi-threaded test.)
static LOADED: Mutex<Holders> = Mutex::new(Holders {
    shared: 0,
    alone: false,
    waiting_alone: 0,
});
static LOADED_CHANGED: Condvar = Condvar::new();

/// Who holds [`LOADED`], and who waits to hold it alone (new shared holders wait behind them).
struct Holders {
    shared: u32,
    alone: bool,
    waiting_alone: u32,
}

/// A test's hold on [`LOADED`], released when dropped.
struct Loaded {
    alone: bool,
}

impl Loaded {
    fn shared() -> Loaded {
        let mut holders = LOADED.lock().unwrap_or_else(|p| p.into_inner());
        while holders.alone || holders.waiting_alone > 0 {
            holders = LOADED_CHANGED
                .wait(holders)
                .unwrap_or_else(|p| p.into_inner());
        }
        holders.shared += 1;
        Loaded { alone: false }
    }

    fn alone() -> Loaded {
        let mut holders = LOADED.lock().unwrap_or_else(|p| p.into_inner());
        holders.waiting_alone += 1;
        while holders.alone || holders.shared > 0 {
            holders = LOADED_CHANGED
                .wait(holders)
                .unwrap_or_else(|p| p.into_inner());
        }
        holders.waiting_alone -= 1;
        holders.alone = true;
        Loaded { alone: true }
    }
}

impl Drop for Loaded {
    fn drop(&mut self) {
        let mut holders = LOADED.lock().unwrap_or_else(|p| p.into_inner());
        if self.alone {
            holders.alone = false;
        } else {
            holders.shared -= 1;
        }
        LOADED_CHANGED.notify_all();
    }
}

/// Why these tests cannot run here, if they cannot.
fn skip_reason() -> Option<&'static str> {
    if !cfg!(ebpf_object) {
        return Some(
            "plugin-agent was built without the eBPF object (set PLUGIN_AGENT_EBPF_OBJ, see `cargo xtask build`)",
        );
    }
    if !nix::unistd::geteuid().is_root() {
        return Some("the eBPF source needs root (CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN)");
    }
    None
}

/// True when the test can run; prints why not and returns false, or panics under `CI=true`.
fn can_run() -> bool {
    match skip_reason() {
        None => true,
        Some(reason) if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("cannot run the eBPF source tests under CI: {reason}")
        }
        Some(reason) => {
            eprintln!("skipping: {reason}");
            false
        }
    }
}

/// One filesystem action for the helper process.
#[derive(Debug, Clone)]
enum Action {
    /// `bind` an `AF_UNIX` socket at a path (relative paths resolve against the helper's cwd).
    Bind(PathBuf),
    /// `bind` and `listen`, and keep the listener until the helper exits (no `close`).
    BindKept(PathBuf),
    /// `bind` and `listen` at `dir/name`, `unlinkat(open(dir), name, 0)`, then `close` the
    /// listener: a plugin going away.
    BindUnlinkClose(PathBuf, String),
    /// `connect` to a listening socket, then close the connection.
    Connect(PathBuf),
    /// Listen at a path with a backlog of 0 and never accept, then start this many threads that
    /// each `connect` to it (all but the first block there), and wait to be killed.
    ConnectBlocked(PathBuf, usize),
    /// `bind` an `AF_UNIX` datagram socket (it cannot listen), then close it.
    BindDatagram(PathBuf),
    /// Sleep this many microseconds.
    Pause(u64),
    /// `bind` expecting `EADDRINUSE`.
    BindFails(PathBuf),
    /// `bind` an abstract socket (no filesystem entry).
    BindAbstract(String),
    /// `chdir`.
    Chdir(PathBuf),
    /// `unlink(path)`.
    Unlink(PathBuf),
    /// `unlink(path)` expecting `ENOENT`.
    UnlinkFails(PathBuf),
    /// `unlinkat(open(dir), name, 0)`.
    UnlinkAt(PathBuf, String),
    /// `mkdir`.
    Mkdir(PathBuf),
    /// `rmdir`.
    Rmdir(PathBuf),
    /// `mknod(path, S_IFSOCK | 0600)`: a socket inode without a listening socket.
    MknodSocket(PathBuf),
    /// `rename(old, new)`.
    Rename(PathBuf, PathBuf),
    /// `renameat2(open(old dir), old name, open(new dir), new name, flags)`, expecting this errno
    /// (0 for success).
    RenameAt2 {
        from: (PathBuf, String),
        to: (PathBuf, String),
        flags: u32,
        errno: i32,
    },
    /// Enter a new mount namespace (private propagation) and bind-mount the first directory onto
    /// the second there, as a container runtime does for a plugin's registration directory.
    UnshareBindMount(PathBuf, PathBuf),
    /// Bind `dir/name` and `unlinkat` it again, as fast as possible for this many milliseconds,
    /// then print `syscalls=<count>`.
    BindUnlinkFor(PathBuf, String, u64),
    /// Bind `dir/name` and `unlinkat` it again this many times, as fast as possible, then print
    /// `syscalls=<count>`.
    BindUnlinkCount(PathBuf, String, u64),
    /// Bind `dir/<prefix>-<i>` for i in 0..count, one every this many microseconds, printing
    /// `<name> <CLOCK_MONOTONIC ns when bind returned>` for each.
    BindPaced(PathBuf, String, u64, u64),
    /// Create a regular file and `unlink` it while its inode is locked, so that the unlink
    /// waits inside `vfs_unlink`; print [`BLOCKED`] then, and let it finish once a line
    /// arrives on stdin (see [`unlink_blocked_in_vfs`]).
    UnlinkBlockedInVfs(PathBuf),
}

impl Action {
    fn encode(&self) -> String {
        let p = |p: &Path| p.to_str().expect("test paths are UTF-8").to_owned();
        match self {
            Action::Bind(path) => format!("bind\t{}", p(path)),
            Action::BindKept(path) => format!("bind_kept\t{}", p(path)),
            Action::BindUnlinkClose(dir, name) => {
                format!("bind_unlink_close\t{}\t{name}", p(dir))
            }
            Action::Connect(path) => format!("connect\t{}", p(path)),
            Action::ConnectBlocked(path, threads) => {
                format!("connect_blocked\t{}\t{threads}", p(path))
            }
            Action::BindDatagram(path) => format!("bind_datagram\t{}", p(path)),
            Action::Pause(us) => format!("pause\t{us}"),
            Action::BindFails(path) => format!("bind_fails\t{}", p(path)),
            Action::BindAbstract(name) => format!("bind_abstract\t{name}"),
            Action::Chdir(path) => format!("chdir\t{}", p(path)),
            Action::Unlink(path) => format!("unlink\t{}", p(path)),
            Action::UnlinkFails(path) => format!("unlink_fails\t{}", p(path)),
            Action::UnlinkAt(dir, name) => format!("unlinkat\t{}\t{name}", p(dir)),
            Action::Mkdir(path) => format!("mkdir\t{}", p(path)),
            Action::Rmdir(path) => format!("rmdir\t{}", p(path)),
            Action::MknodSocket(path) => format!("mknod_socket\t{}", p(path)),
            Action::Rename(from, to) => format!("rename\t{}\t{}", p(from), p(to)),
            Action::RenameAt2 {
                from,
                to,
                flags,
                errno,
            } => format!(
                "renameat2\t{}\t{}\t{}\t{}\t{flags}\t{errno}",
                p(&from.0),
                from.1,
                p(&to.0),
                to.1
            ),
            Action::UnshareBindMount(from, onto) => {
                format!("unshare_bind_mount\t{}\t{}", p(from), p(onto))
            }
            Action::BindUnlinkFor(dir, name, ms) => {
                format!("bind_unlink_for\t{}\t{name}\t{ms}", p(dir))
            }
            Action::BindUnlinkCount(dir, name, count) => {
                format!("bind_unlink_count\t{}\t{name}\t{count}", p(dir))
            }
            Action::BindPaced(dir, prefix, count, gap_us) => {
                format!("bind_paced\t{}\t{prefix}\t{count}\t{gap_us}", p(dir))
            }
            Action::UnlinkBlockedInVfs(path) => format!("unlink_blocked_in_vfs\t{}", p(path)),
        }
    }

    /// Runs one encoded action in the helper; panics (failing the helper) if it misbehaves. Sockets
    /// are closed at once: a bound path stays until it is unlinked.
    fn perform(line: &str) {
        let fields: Vec<&str> = line.split('\t').collect();
        match fields[..] {
            ["bind", path] => drop(UnixListener::bind(path).expect(path)),
            ["bind_kept", path] => std::mem::forget(UnixListener::bind(path).expect(path)),
            ["bind_unlink_close", dir, name] => {
                let listener = UnixListener::bind(Path::new(dir).join(name)).expect(name);
                let dir = std::fs::File::open(dir).expect(dir);
                nix::unistd::unlinkat(&dir, name, nix::unistd::UnlinkatFlags::NoRemoveDir)
                    .expect(name);
                drop(listener);
            }
            ["bind_datagram", path] => {
                drop(UnixDatagram::bind(path).expect(path));
            }
            ["pause", us] => {
                std::thread::sleep(Duration::from_micros(us.parse().expect(us)));
            }
            ["connect", path] => drop(UnixStream::connect(path).expect(path)),
            ["bind_fails", path] => {
                let err = UnixListener::bind(path).expect_err(path);
                assert_eq!(err.raw_os_error(), Some(libc::EADDRINUSE), "{path}");
            }
            ["bind_abstract", name] => {
                let addr = SocketAddr::from_abstract_name(name.as_bytes()).expect(name);
                drop(UnixListener::bind_addr(&addr).expect(name));
            }
            ["chdir", path] => std::env::set_current_dir(path).expect(path),
            ["unlink", path] => std::fs::remove_file(path).expect(path),
            ["unlink_fails", path] => {
                let err = std::fs::remove_file(path).expect_err(path);
                assert_eq!(err.raw_os_error(), Some(libc::ENOENT), "{path}");
            }
            ["unlinkat", dir, name] => {
                let dir = std::fs::File::open(dir).expect(dir);
                nix::unistd::unlinkat(&dir, name, nix::unistd::UnlinkatFlags::NoRemoveDir)
                    .expect(name);
            }
            ["mkdir", path] => std::fs::create_dir(path).expect(path),
            ["rmdir", path] => std::fs::remove_dir(path).expect(path),
            ["mknod_socket", path] => {
                use nix::sys::stat::{Mode, SFlag, mknod};
                mknod(path, SFlag::S_IFSOCK, Mode::from_bits_truncate(0o600), 0).expect(path);
            }
            ["rename", from, to] => std::fs::rename(from, to).expect(from),
            _ => Self::perform_namespaced_or_load(line, &fields),
        }
    }

    /// The actions of [`Self::perform`] that rename across directories with flags, change the mount
    /// namespace, or generate load.
    fn perform_namespaced_or_load(line: &str, fields: &[&str]) {
        match *fields {
            ["renameat2", from_dir, from, to_dir, to, flags, errno] => {
                let from_dir = std::fs::File::open(from_dir).expect(from_dir);
                let to_dir = std::fs::File::open(to_dir).expect(to_dir);
                let result = nix::fcntl::renameat2(
                    &from_dir,
                    from,
                    &to_dir,
                    to,
                    nix::fcntl::RenameFlags::from_bits_truncate(flags.parse().expect(flags)),
                );
                let got = result.err().map_or(0, |e| e as i32);
                assert_eq!(
                    got,
                    errno.parse::<i32>().expect(errno),
                    "renameat2 {from} {to}"
                );
            }
            ["unshare_bind_mount", from, onto] => {
                use nix::mount::{MsFlags, mount};
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).expect("unshare");
                let private = MsFlags::MS_REC | MsFlags::MS_PRIVATE;
                mount(None::<&str>, "/", None::<&str>, private, None::<&str>).expect("private");
                mount(
                    Some(from),
                    onto,
                    None::<&str>,
                    MsFlags::MS_BIND,
                    None::<&str>,
                )
                .expect("bind mount");
            }
            ["connect_blocked", path, threads] => {
                use nix::sys::socket::{
                    AddressFamily, Backlog, SockFlag, SockType, UnixAddr, bind, listen, socket,
                };
                let listener = socket(
                    AddressFamily::Unix,
                    SockType::Stream,
                    SockFlag::empty(),
                    None,
                )
                .expect("socket");
                bind(
                    std::os::fd::AsRawFd::as_raw_fd(&listener),
                    &UnixAddr::new(path).expect(path),
                )
                .expect(path);
                listen(&listener, Backlog::new(0).expect("backlog")).expect("listen");
                let threads = threads.parse::<usize>().expect(threads);
                // Every blocked connect holds a socket: often more descriptors than the soft
                // limit (1,024 in the VM stage's guest) or even the hard one allows; raising the
                // hard limit needs CAP_SYS_RESOURCE, which root has there.
                let needed = (threads + 64) as libc::rlim_t;
                let mut limit = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                // SAFETY: getrlimit and setrlimit read or write the struct passed, nothing else.
                unsafe {
                    assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
                    if limit.rlim_cur < needed {
                        limit.rlim_cur = needed;
                        limit.rlim_max = limit.rlim_max.max(needed);
                        assert_eq!(
                            libc::setrlimit(libc::RLIMIT_NOFILE, &limit),
                            0,
                            "{needed} descriptors: {}",
                            std::io::Error::last_os_error()
                        );
                    }
                }
                for _ in 0..threads {
                    let path = path.to_string();
                    std::thread::Builder::new()
                        .stack_size(64 << 10)
                        .spawn(move || {
                            let _connected = UnixStream::connect(&path);
                            loop {
                                std::thread::park();
                            }
                        })
                        .expect("a thread");
                }
                loop {
                    std::thread::park();
                }
            }
            ["bind_unlink_for", dir, name, ms] => {
                let path = Path::new(dir).join(name);
                let dir = std::fs::File::open(dir).expect(dir);
                let until = Instant::now() + Duration::from_millis(ms.parse().expect(ms));
                let mut syscalls = 0u64;
                while Instant::now() < until {
                    drop(UnixListener::bind(&path).expect(name));
                    nix::unistd::unlinkat(&dir, name, nix::unistd::UnlinkatFlags::NoRemoveDir)
                        .expect(name);
                    syscalls += 2;
                }
                println!("syscalls={syscalls}");
            }
            ["bind_unlink_count", dir, name, count] => {
                let path = Path::new(dir).join(name);
                let dir = std::fs::File::open(dir).expect(dir);
                let count: u64 = count.parse().expect(count);
                for _ in 0..count {
                    drop(UnixListener::bind(&path).expect(name));
                    nix::unistd::unlinkat(&dir, name, nix::unistd::UnlinkatFlags::NoRemoveDir)
                        .expect(name);
                }
                println!("syscalls={}", 2 * count);
            }
            ["bind_paced", dir, prefix, count, gap_us] => {
                let gap = Duration::from_micros(gap_us.parse().expect(gap_us));
                for i in 0..count.parse::<u64>().expect(count) {
                    let name = format!("{prefix}-{i}");
                    drop(UnixListener::bind(Path::new(dir).join(&name)).expect(&name));
                    println!("{name} {}", monotonic_now_ns());
                    std::thread::sleep(gap);
                }
            }
            ["unlink_blocked_in_vfs", path] => unlink_blocked_in_vfs(path),
            _ => panic!("unknown helper action {line:?}"),
        }
    }
}

/// Not a test of its own: the helper process entry point. It does nothing unless re-executed by
/// [`run_helper`] with a script.
#[test]
fn helper_process_performs_actions() {
    let Ok(script) = std::env::var(SCRIPT_ENV) else {
        return;
    };
    for line in script.lines() {
        Action::perform(line);
    }
}

/// Runs `actions` in a helper process, waits for it to finish successfully, returns its stdout.
fn run_helper(actions: &[Action]) -> String {
    run_helper_with_pid(actions).1
}

/// [`run_helper`], also returning the helper's pid (the caller every record should name).
fn run_helper_with_pid(actions: &[Action]) -> (u32, String) {
    let script: Vec<String> = actions.iter().map(Action::encode).collect();
    let exe = std::env::current_exe().expect("test executable");
    let helper = Command::new(exe)
        .args(["--exact", "helper_process_performs_actions", "--nocapture"])
        .args(["--test-threads", "1"])
        .env(SCRIPT_ENV, script.join("\n"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn helper process");
    let pid = helper.id();
    let output = helper.wait_with_output().expect("wait for the helper");
    assert!(
        output.status.success(),
        "helper failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (pid, String::from_utf8_lossy(&output.stdout).into_owned())
}

/// An event without its timestamp, for comparing lists.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    Created(PathBuf),
    Removed(PathBuf),
    NameChanged(OsString),
    Rescan,
    Serving(PathBuf, bool),
    /// A first contact, and the pid of the process that connected.
    Contacted(PathBuf, u32),
}

impl From<FsEvent> for Seen {
    fn from(event: FsEvent) -> Self {
        match event {
            FsEvent::Created { path, observed } => {
                assert!(
                    observed.kernel_ns.is_some(),
                    "eBPF events carry kernel time"
                );
                Seen::Created(path)
            }
            FsEvent::Removed { path, .. } => Seen::Removed(path),
            FsEvent::NameChanged { name, .. } => Seen::NameChanged(name),
            FsEvent::Rescan { .. } => Seen::Rescan,
            FsEvent::Serving {
                path, listening, ..
            } => Seen::Serving(path, listening),
            FsEvent::Contacted { path, observed } => {
                assert!(
                    observed.kernel_ns.is_some(),
                    "eBPF events carry kernel time"
                );
                Seen::Contacted(path, observed.by.map_or(0, |by| by.pid))
            }
        }
    }
}

/// A loaded source watching `<tmp>/watched`, with `<tmp>/elsewhere` left unwatched. Names are
/// prefixed with the test's name: every test's programs see every process's syscalls, and a
/// removal is matched by name.
struct Fixture {
    source: EbpfSource,
    _loaded: Loaded,
    events: mpsc::Receiver<FsEvent>,
    _stop: DropGuard,
    _tmp: TempDir,
    watched: PathBuf,
    elsewhere: PathBuf,
    prefix: String,
    /// Whether `collect_until` keeps the serving hints (`listen`, a listener's `close`): every
    /// `Action::Bind` listens and closes, and most tests are about entries only.
    keep_serving: bool,
}

impl Fixture {
    fn open(test: &str, options: EbpfOptions, channel: usize) -> Fixture {
        Self::open_holding(Loaded::shared(), test, options, channel)
    }

    /// [`Fixture::open`] with no other test's source loaded meanwhile (see [`LOADED`]).
    fn open_alone(test: &str, options: EbpfOptions, channel: usize) -> Fixture {
        Self::open_holding(Loaded::alone(), test, options, channel)
    }

    fn open_holding(loaded: Loaded, test: &str, options: EbpfOptions, channel: usize) -> Fixture {
        let tmp = tempfile::Builder::new()
            .prefix("ebpf-source-")
            .tempdir()
            .expect("tempdir");
        let watched = tmp.path().join("watched");
        let elsewhere = tmp.path().join("elsewhere");
        std::fs::create_dir(&watched).expect("mkdir watched");
        std::fs::create_dir(&elsewhere).expect("mkdir elsewhere");
        let (sink, events) = mpsc::channel(channel);
        let cancel = CancellationToken::new();
        let source = ebpf::open(sink, cancel.clone(), options)
            .unwrap_or_else(|err| panic!("open the eBPF source: {err:#}"));
        source
            .watch(&WatchedDir::stat(&watched).expect("stat watched"))
            .expect("watch");
        Fixture {
            source,
            _loaded: loaded,
            events,
            _stop: cancel.drop_guard(),
            _tmp: tmp,
            watched,
            elsewhere,
            prefix: test.to_owned(),
            keep_serving: false,
        }
    }

    fn name(&self, name: &str) -> String {
        format!("{}-{name}", self.prefix)
    }

    /// Whether `name` is one this fixture's `name` made (possibly behind a leading dot).
    fn is_ours(&self, name: &std::ffi::OsStr) -> bool {
        let name = name.to_string_lossy();
        let name = name.strip_prefix('.').unwrap_or(&name);
        name.strip_prefix(self.prefix.as_str())
            .is_some_and(|rest| rest.starts_with('-'))
    }

    /// Whether every call is reported by its directory's identity: fentry/fexit see the dentries;
    /// the syscall tracepoints report a call by a path they cannot resolve by its name only. The
    /// suite runs on both (`cargo xtask vm-test` boots a kernel that allows fentry).
    fn exact(&self) -> bool {
        self.source.hook_family() == HookFamily::Fentry
    }

    /// `exact` on fentry/fexit, else a name hint for the same entry.
    fn exact_or_name(&self, exact: Seen) -> Seen {
        if self.exact() {
            return exact;
        }
        let path = match &exact {
            Seen::Created(path) | Seen::Removed(path) => path,
            other => panic!("{other:?} is not an exact event"),
        };
        Seen::NameChanged(path.file_name().expect("a name").into())
    }

    fn in_watched(&self, name: &str) -> PathBuf {
        self.watched.join(self.name(name))
    }

    fn in_elsewhere(&self, name: &str) -> PathBuf {
        self.elsewhere.join(self.name(name))
    }

    /// Runs `actions` then binds a sentinel in the watched directory, and returns every event
    /// reported before the sentinel's.
    async fn events_of(&mut self, actions: &[Action], sentinel: &str) -> Vec<Seen> {
        let sentinel = self.in_watched(sentinel);
        let mut actions = actions.to_vec();
        actions.push(Action::Bind(sentinel.clone()));
        run_helper(&actions);
        self.collect_until(&Seen::Created(sentinel)).await
    }

    /// Tells the source the entry at `path` exists, as the watcher does after its `stat`.
    fn announce(&self, path: &Path) {
        let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
            return;
        };
        if let Ok(dir) = WatchedDir::stat(dir) {
            let entry = if path.is_dir() {
                Entry::Directory
            } else {
                Entry::Socket
            };
            self.source.entry_present(&dir, name, entry);
        }
    }

    /// The next event as the source sent it, or a panic naming what was awaited and seen.
    async fn next_event(&mut self, awaited: impl FnOnce() -> String) -> FsEvent {
        tokio::time::timeout(STEP_TIMEOUT, self.events.recv())
            .await
            .unwrap_or_else(|_| panic!("{}", awaited()))
            .expect("source closed its channel")
    }

    async fn collect_until(&mut self, last: &Seen) -> Vec<Seen> {
        let mut seen = Vec::new();
        loop {
            let event = self
                .next_event(|| format!("no {last:?} after {seen:?}"))
                .await;
            let event = Seen::from(event);
            if matches!(event, Seen::Serving(..)) && !self.keep_serving {
                continue;
            }
            // A socket made by `mknod` with a path the tracepoints cannot resolve is reported by
            // its name to every loaded source, wherever it is (rare enough to let through): one
            // from a test running beside this one is not this test's.
            if matches!(&event, Seen::NameChanged(name) if !self.is_ours(name)) {
                continue;
            }
            // The watcher announces every entry it finds (the agent is the name table's one
            // writer): what is created here is announced the same way, so its later removal by
            // a path the tracepoints cannot resolve is matched by name.
            if let Seen::Created(path) = &event {
                self.announce(path);
            }
            if &event == last {
                return seen;
            }
            seen.push(event);
        }
    }
}

/// A listener still open when its process exits is released without a `close`: fentry on
/// `unix_release` (the last reference dropped, whoever held it) reports it; the tracepoint family
/// sees only `close` calls, and says nothing (the agent's pidfd covers a registered server's exit).
#[tokio::test]
async fn a_listener_released_by_its_process_exit_is_reported_where_fentry_runs() {
    if !can_run() {
        return;
    }
    let mut f = Fixture::open("released", EbpfOptions::default(), 1024);
    f.keep_serving = true;
    let kept = f.in_watched("kept.sock");
    run_helper(&[Action::BindKept(kept.clone())]);
    let sentinel = f.in_watched("sentinel.sock");
    run_helper(&[Action::Bind(sentinel.clone())]);
    let seen = f.collect_until(&Seen::Created(sentinel)).await;
    let mut expected = vec![
        Seen::Created(kept.clone()),
        Seen::Serving(kept.clone(), true),
    ];
    if f.exact() {
        expected.push(Seen::Serving(kept, false));
    }
    assert_eq!(seen, expected);
}

/// The first process other than the agent to connect to a socket in the tree is reported, once
/// per socket instance and naming that process (kubelet's first contact, when the agent observes
/// beside it); a second connect to the same instance, and connects outside the tree, are not. The
/// same name bound again after an unlink is a new instance (it may get the old dentry, inode
/// memory and inode number back; never the same inode generation) and is reported again.
#[tokio::test]
async fn the_first_connect_to_each_socket_instance_in_the_tree_names_its_caller() {
    if !can_run() {
        return;
    }
    let mut f = Fixture::open("contact", EbpfOptions::default(), 1024);
    let socket = f.in_watched("served.sock");
    let outside = f.in_elsewhere("outside.sock");
    let (first, _) = run_helper_with_pid(&[
        Action::BindKept(socket.clone()),
        Action::BindKept(outside.clone()),
        Action::Connect(socket.clone()),
        Action::Connect(socket.clone()),
        Action::Connect(outside.clone()),
    ]);
    let (second, _) = run_helper_with_pid(&[
        Action::Unlink(socket.clone()),
        Action::BindKept(socket.clone()),
        Action::Connect(socket.clone()),
        Action::Connect(socket.clone()),
    ]);
    let sentinel = f.in_watched("sentinel.sock");
    run_helper(&[Action::Bind(sentinel.clone())]);
    let contacts: Vec<Seen> = f
        .collect_until(&Seen::Created(sentinel))
        .await
        .into_iter()
        .filter(|seen| matches!(seen, Seen::Contacted(..)))
        .collect();
    assert_eq!(
        contacts,
        vec![
            Seen::Contacted(socket.clone(), first),
            Seen::Contacted(socket, second)
        ]
    );
}

/// Threads of this process that are inside a `connect` call now (`/proc/PID/task/*/syscall`).
fn threads_in_connect(pid: u32) -> usize {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    let connect = format!("{} ", libc::SYS_connect);
    tasks
        .filter_map(Result::ok)
        .filter_map(|task| std::fs::read_to_string(task.path().join("syscall")).ok())
        .filter(|syscall| syscall.starts_with(&connect))
        .count()
}

/// A `connect` can block, so any process could keep thousands of them parked between the
/// programs' entry and exit: they have a table of their own, and binds in the tree are still
/// reported exactly, with nothing lost (sharing bind's 4,096-entry table, they filled it, the bind
/// was lost and the agent had to rescan).
#[tokio::test]
async fn blocked_connects_anywhere_do_not_cost_a_bind_in_the_tree() {
    if !can_run() {
        return;
    }
    let mut f = Fixture::open("blocked", EbpfOptions::default(), 1024);
    let script = Action::ConnectBlocked(f.in_elsewhere("never-accepts.sock"), 4200).encode();
    let mut blocker = Command::new(std::env::current_exe().expect("test executable"))
        .args(["--exact", "helper_process_performs_actions", "--nocapture"])
        .args(["--test-threads", "1"])
        .env(SCRIPT_ENV, script)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn the blocking helper");
    // Thousands of threads start slowly under emulation (the VM stage): a longer bound.
    let deadline = Instant::now() + 3 * STEP_TIMEOUT;
    while threads_in_connect(blocker.id()) < 4150 {
        assert!(
            Instant::now() < deadline,
            "only {} threads blocked in connect",
            threads_in_connect(blocker.id())
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let bound = f.in_watched("bound.sock");
    let seen = f
        .events_of(&[Action::Bind(bound.clone())], "sentinel.sock")
        .await;
    let _ = blocker.kill();
    let _ = blocker.wait();
    assert_eq!(seen, vec![Seen::Created(bound)]);
}

/// Every `Action::Bind` is a listener (bind, listen, close): in the tree, its `listen` and its
/// `close` are reported after its creation, each exactly; outside the tree, nothing.
#[tokio::test]
async fn a_listen_and_a_listener_s_close_in_the_tree_are_reported_and_nothing_else() {
    if !can_run() {
        return;
    }
    let mut f = Fixture::open("serving", EbpfOptions::default(), 1024);
    f.keep_serving = true;
    let served = f.in_watched("served.sock");
    let actions = [
        Action::Bind(f.in_elsewhere("elsewhere.sock")),
        Action::Bind(served.clone()),
        Action::MknodSocket(f.in_watched("inode-only.sock")),
    ];
    let sentinel = f.in_watched("sentinel.sock");
    let mut all = actions.to_vec();
    all.push(Action::Bind(sentinel.clone()));
    run_helper(&all);
    let seen = f.collect_until(&Seen::Created(sentinel)).await;
    assert_eq!(
        seen,
        vec![
            Seen::Created(served.clone()),
            Seen::Serving(served.clone(), true),
            Seen::Serving(served, false),
            f.exact_or_name(Seen::Created(f.in_watched("inode-only.sock"))),
        ]
    );
}

/// A plugin going away unlinks its socket, then closes its listener: the removal says it all,
/// and the close of a listener whose socket has no name left is not reported (one closed while
/// its socket is still there is, as above).
#[tokio::test]
async fn a_listener_closed_after_its_socket_was_unlinked_is_not_reported() {
    if !can_run() {
        return;
    }
    let mut f = Fixture::open("unlinked-release", EbpfOptions::default(), 1024);
    f.keep_serving = true;
    let gone = f.in_watched("gone.sock");
    let sentinel = f.in_watched("sentinel.sock");
    run_helper(&[
        Action::BindUnlinkClose(f.watched.clone(), f.name("gone.sock")),
        Action::Bind(sentinel.clone()),
    ]);
    let seen = f.collect_until(&Seen::Created(sentinel)).await;
    assert_eq!(
        seen,
        vec![
            Seen::Created(gone.clone()),
            Seen::Serving(gone.clone(), true),
            Seen::Removed(gone),
        ]
    );
}

/// A bind does not wake the reader for having caught up (the `listen` that follows a plugin's
/// bind brings both), so a socket bound and never listening must still arrive on its own: here
/// a datagram socket, bound half a millisecond after a plugin's `listen` woke the reader, with
/// nothing after it where the tracepoints run (the helper's exit closes its listener without a
/// `close`; fentry's `unix_release` reports that exit).
#[tokio::test]
async fn a_bind_that_no_listen_follows_arrives_with_no_event_after_it() {
    if !can_run() {
        return;
    }
    let mut f = Fixture::open("bind-only", EbpfOptions::default(), 1024);
    f.keep_serving = true;
    let served = f.in_watched("served.sock");
    let unserved = f.in_watched("unserved.sock");
    run_helper(&[
        Action::BindKept(served.clone()),
        Action::Pause(500),
        Action::BindDatagram(unserved.clone()),
    ]);
    let seen = f.collect_until(&Seen::Created(unserved)).await;
    assert_eq!(
        seen,
        vec![Seen::Created(served.clone()), Seen::Serving(served, true)]
    );
}

#[tokio::test]
async fn binds_into_the_watched_directory_are_reported_and_nothing_else() {
    if !can_run() {
        return;
    }
    let mut f = Fixture::open("binds", EbpfOptions::default(), 1024);
    let parent = f.watched.parent().expect("parent").to_path_buf();
    let actions = [
        Action::Bind(f.in_watched("absolute.sock")),
        Action::Chdir(f.watched.clone()),
        Action::Bind(f.name("relative.sock").into()),
        Action::Chdir(parent.clone()),
        Action::Bind(Path::new("watched").join(f.name("multi.sock"))),
        Action::Bind(f.in_elsewhere("elsewhere.sock")),
        Action::BindAbstract(f.name("abstract")),
        Action::BindFails(f.in_watched("absolute.sock")),
    ];
    let seen = f.events_of(&actions, "sentinel.sock").await;
    assert_eq!(
        seen,
        vec![
            Seen::Created(f.in_watched("absolute.sock")),
            Seen::Created(f.in_watched("relative.sock")),
            Seen::Created(f.in_watched("multi.sock")),
        ]
    );
}

/// Every record names its caller as the kernel saw it at the call, for the socket's provenance:
/// the process (tgid), its uid and gid, the calling thread's name (libtest runs the helper on a
/// thread named after its test: `comm` is that name's first 15 bytes), and its cgroup v2 id (the
/// helper's cgroup directory's inode: the test's own cgroup, which the helper inherits).
#[tokio::test]
async fn a_bind_names_its_caller_as_the_kernel_recorded_it() {
    if !can_run() {
        return;
    }
    let mut f = Fixture::open("caller", EbpfOptions::default(), 1024);
    let socket = f.in_watched("made.sock");
    let (helper_pid, _) = run_helper_with_pid(&[Action::Bind(socket.clone())]);
    let by = loop {
        let event = f.next_event(|| "the bind is not reported".into()).await;
        if let FsEvent::Created { path, observed } = event
            && path == socket
        {
            break observed.by.expect("an eBPF record names its caller");
        }
    };
    assert_eq!(by.pid, helper_pid);
    assert_eq!(by.uid, Some(nix::unistd::getuid().as_raw()));
    assert_eq!(by.gid, Some(nix::unistd::getgid().as_raw()));
    assert_eq!(
        by.comm.map(|c| c.as_string()).as_deref(),
        Some(&"helper_process_performs_actions"[..15])
    );
    let own = std::fs::read_to_string("/proc/self/cgroup").expect("own cgroup");
    let own = own
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .expect("a cgroup v2 line");
    let root = plugin_agent::provenance::cgroup_view::CgroupView::discover()
        .expect("cgroup v2 is mounted")
        .root;
    let dir = root.join(own.trim_start_matches('/'));
    use std::os::unix::fs::MetadataExt;
    let id = std::fs::metadata(&dir).expect("stat own cgroup").ino();
    assert_eq!(by.cgroup_id, Some(id), "the cgroup of {}", dir.display());
}

#[tokio::test]
async fn removals_are_exact_from_the_directory_and_by_name_from_anywhere_else() {
    if !can_run() {
        return;
    }
    let mut f = Fixture::open("removals", EbpfOptions::default(), 1024);
    let setup = [
        Action::Bind(f.in_watched("at.sock")),
        Action::Bind(f.in_watched("cwd.sock")),
        Action::Bind(f.in_watched("absolute.sock")),
        Action::Bind(f.in_elsewhere("elsewhere.sock")),
        Action::Bind(f.in_elsewhere("at.sock")),
    ];
    let seen = f.events_of(&setup, "setup.sock").await;
    assert_eq!(
        seen,
        vec![
            Seen::Created(f.in_watched("at.sock")),
            Seen::Created(f.in_watched("cwd.sock")),
            Seen::Created(f.in_watched("absolute.sock")),
        ]
    );

    let removals = [
        Action::UnlinkAt(f.watched.clone(), f.name("at.sock")),
        Action::Chdir(f.watched.clone()),
        Action::Unlink(f.name("cwd.sock").into()),
        Action::Unlink(f.in_watched("absolute.sock")),
        Action::UnlinkFails(f.name("never-existed.sock").into()),
        Action::Unlink(f.in_elsewhere("elsewhere.sock")),
        // Same name as a watched entry, in an unwatched directory: a hint the watcher checks.
        Action::UnlinkAt(f.elsewhere.clone(), f.name("at.sock")),
    ];
    let seen = f.events_of(&removals, "done.sock").await;
    assert_eq!(
        seen,
        vec![
            Seen::Removed(f.in_watched("at.sock")),
            Seen::Removed(f.in_watched("cwd.sock")),
            f.exact_or_name(Seen::Removed(f.in_watched("absolute.sock"))),
        ]
    );
}

#[tokio::test]
async fn a_name_the_watcher_found_matches_its_removal_by_full_path() {
    if !can_run() {
        return;
    }
    let mut f = Fixture::open("found", EbpfOptions::default(), 1024);
    // The agent's own bind is not reported (the test process is the agent here)...
    let own = f.in_watched("own.sock");
    let _listener = UnixListener::bind(&own).expect("bind own socket");
    let watched = WatchedDir::stat(&f.watched).expect("stat");
    // ...so the name becomes known the way the watcher's walk makes it known.
    f.source
        .entry_present(&watched, own.file_name().expect("name"), Entry::Socket);
    let seen = f
        .events_of(&[Action::Unlink(own.clone())], "sentinel.sock")
        .await;
    assert_eq!(seen, vec![f.exact_or_name(Seen::Removed(own))]);
}

/// On the tracepoints, a removal or a socket `mknod` by a multi-component path is reported by
/// name; when the path's parent component is a name the agent announced (the watched root's
/// name is, as an entry of its parent), the record carries that name's id, so the watcher looks
/// in the directories so named only (one `stat`) instead of reading every watched directory.
#[tokio::test]
async fn a_name_only_record_names_its_parent_directory_when_the_agent_knows_that_name() {
    if !can_run() {
        return;
    }
    let mut f = Fixture::open("parent", EbpfOptions::default(), 1024);
    if f.exact() {
        eprintln!("fentry/fexit: every call is reported exactly, nothing to name");
        return;
    }
    let root = f.watched.parent().expect("a parent").to_path_buf();
    let watched_name = f.watched.file_name().expect("a name").to_os_string();
    f.source.entry_present(
        &WatchedDir::stat(&root).expect("stat"),
        &watched_name,
        Entry::Directory,
    );
    let gone = f.in_watched("gone.sock");
    let seen = f
        .events_of(&[Action::Bind(gone.clone())], "bound.sock")
        .await;
    assert_eq!(seen, vec![Seen::Created(gone.clone())]);
    let actions = [
        Action::Unlink(gone.clone()),
        Action::MknodSocket(f.in_watched("made.sock")),
    ];
    assert_eq!(
        name_only_parents(&mut f, &actions, "sentinel.sock").await,
        vec![
            (f.name("gone.sock").into(), Some(watched_name.clone())),
            (f.name("made.sock").into(), Some(watched_name)),
        ]
    );
}

/// Only a directory's name gets an id a record can carry: the same name announced as a socket
/// still lets a removal by a multi-component path through (it is in the table), but names no
/// parent; announced as a directory later, it does.
#[tokio::test]
async fn a_name_announced_as_a_socket_names_no_parent_until_a_directory_carries_it() {
    if !can_run() {
        return;
    }
    let mut f = Fixture::open("parent-kind", EbpfOptions::default(), 1024);
    if f.exact() {
        eprintln!("fentry/fexit: every call is reported exactly, nothing to name");
        return;
    }
    let root = WatchedDir::stat(f.watched.parent().expect("a parent")).expect("stat");
    let watched_name = f.watched.file_name().expect("a name").to_os_string();
    assert!(
        f.source.entry_present(&root, &watched_name, Entry::Socket),
        "a name new to the table is new in its directory"
    );
    let first = f.in_watched("first.sock");
    let setup = [Action::Bind(first.clone())];
    assert_eq!(
        f.events_of(&setup, "bound-1.sock").await,
        vec![Seen::Created(first.clone())]
    );
    assert_eq!(
        name_only_parents(&mut f, &[Action::Unlink(first)], "sentinel-1.sock").await,
        vec![(f.name("first.sock").into(), None)]
    );
    assert!(
        !f.source
            .entry_present(&root, &watched_name, Entry::Directory),
        "the directory holds the name already"
    );
    let second = f.in_watched("second.sock");
    let setup = [Action::Bind(second.clone())];
    assert_eq!(
        f.events_of(&setup, "bound-2.sock").await,
        vec![Seen::Created(second.clone())]
    );
    assert_eq!(
        name_only_parents(&mut f, &[Action::Unlink(second)], "sentinel-2.sock").await,
        vec![(f.name("second.sock").into(), Some(watched_name))]
    );
}

/// Runs `actions`, then binds `sentinel` in the watched directory; returns the name-only records
/// of the test's own names seen before the sentinel's creation, with the parent each named.
async fn name_only_parents(
    f: &mut Fixture,
    actions: &[Action],
    sentinel: &str,
) -> Vec<(OsString, Option<OsString>)> {
    let sentinel = f.in_watched(sentinel);
    let mut actions = actions.to_vec();
    actions.push(Action::Bind(sentinel.clone()));
    run_helper(&actions);
    let mut parents = Vec::new();
    loop {
        let event = f
            .next_event(|| format!("no sentinel after {parents:?}"))
            .await;
        match event {
            FsEvent::Created { path, .. } if path == sentinel => return parents,
            FsEvent::NameChanged { name, parent, .. } if f.is_ours(&name) => {
                parents.push((name, parent));
            }
            _ => {}
        }
    }
}

#[tokio::test]
async fn an_unwatched_directory_is_no_longer_reported() {
    if !can_run() {
        return;
    }
    let mut f = Fixture::open("unwatch", EbpfOptions::default(), 1024);
    let elsewhere = WatchedDir::stat(&f.elsewhere).expect("stat");
    f.source.watch(&elsewhere).expect("watch elsewhere");
    let seen = f
        .events_of(&[Action::Bind(f.in_elsewhere("first.sock"))], "s1.sock")
        .await;
    assert_eq!(seen, vec![Seen::Created(f.in_elsewhere("first.sock"))]);

    f.source.unwatch(&elsewhere);
    let seen = f
        .events_of(&[Action::Bind(f.in_elsewhere("second.sock"))], "s2.sock")
        .await;
    assert_eq!(seen, vec![]);
}

#[tokio::test]
async fn socket_inodes_and_directories_made_next_to_a_watched_cwd_are_reported() {
    if !can_run() {
        return;
    }
    let mut f = Fixture::open("mk", EbpfOptions::default(), 1024);
    let actions = [
        Action::Chdir(f.watched.clone()),
        Action::Mkdir(f.name("sub").into()),
        Action::MknodSocket(f.name("relative.sock").into()),
        // By a multi-component path: a socket inode is reported by name; a directory is not
        // (mkdir is common system-wide), see the sub-directory test for how that is covered.
        Action::MknodSocket(f.in_watched("absolute.sock")),
        Action::Mkdir(f.in_watched("absolute-dir")),
        Action::Rmdir(f.name("sub").into()),
        // By a multi-component path before anyone announced the name: the tracepoints do not
        // report it (the watcher, announcing the name and then looking, finds it gone).
        Action::Unlink(f.in_watched("relative.sock")),
        Action::MknodSocket(f.in_elsewhere("elsewhere.sock")),
        Action::Mkdir(f.in_elsewhere("elsewhere-dir")),
    ];
    let seen = f.events_of(&actions, "sentinel.sock").await;
    let expected = if f.exact() {
        // Every entry by its directory's identity; nothing from the unwatched directory.
        vec![
            Seen::Created(f.in_watched("sub")),
            Seen::Created(f.in_watched("relative.sock")),
            Seen::Created(f.in_watched("absolute.sock")),
            Seen::Created(f.in_watched("absolute-dir")),
            Seen::Removed(f.in_watched("sub")),
            Seen::Removed(f.in_watched("relative.sock")),
        ]
    } else {
        vec![
            Seen::Created(f.in_watched("sub")),
            Seen::Created(f.in_watched("relative.sock")),
            Seen::NameChanged(f.name("absolute.sock").into()),
            Seen::Removed(f.in_watched("sub")),
            Seen::NameChanged(f.name("elsewhere.sock").into()),
        ]
    };
    assert_eq!(seen, expected);
}

#[tokio::test]
async fn renames_into_out_of_and_within_the_tree_are_reported() {
    if !can_run() {
        return;
    }
    let mut f = Fixture::open("rename", EbpfOptions::default(), 1024);
    let names = ["a", "b", "c", "x1", "x2"].map(|n| f.name(&format!("{n}.sock")));
    let mut setup: Vec<Action> = names
        .iter()
        .map(|n| Action::Bind(f.watched.join(n)))
        .collect();
    setup.push(Action::Bind(f.in_elsewhere("out.sock")));
    let seen = f.events_of(&setup, "setup.sock").await;
    assert_eq!(seen.len(), names.len(), "{seen:?}");

    let at = |dir: &Path, name: &str| (dir.to_path_buf(), f.name(name));
    let (watched, elsewhere) = (f.watched.clone(), f.elsewhere.clone());
    let actions = [
        // Within the tree, relative to a watched cwd: exact on both sides.
        Action::Chdir(watched.clone()),
        Action::Rename(f.name("a.sock").into(), f.name("a2.sock").into()),
        // Within the tree by full paths: by name on both sides.
        Action::Rename(f.in_watched("b.sock"), f.in_watched("b2.sock")),
        // Out of the tree by full paths: the source by name (the target's name too, as a move).
        Action::Rename(f.in_watched("c.sock"), f.in_elsewhere("c.sock")),
        // Into the tree by dirfds: the target exactly; the source was never in the tree.
        Action::RenameAt2 {
            from: at(&elsewhere, "out.sock"),
            to: at(&watched, "in.sock"),
            flags: 0,
            errno: 0,
        },
        Action::RenameAt2 {
            from: at(&watched, "x1.sock"),
            to: at(&watched, "x2.sock"),
            flags: libc::RENAME_EXCHANGE,
            errno: 0,
        },
        Action::RenameAt2 {
            from: at(&watched, "x1.sock"),
            to: at(&watched, "x2.sock"),
            flags: libc::RENAME_NOREPLACE,
            errno: libc::EEXIST,
        },
        Action::RenameAt2 {
            from: at(&watched, "x1.sock"),
            to: at(&watched, "x3.sock"),
            flags: libc::RENAME_NOREPLACE,
            errno: 0,
        },
    ];
    let seen = f.events_of(&actions, "sentinel.sock").await;
    let name = |n: &str| Seen::NameChanged(f.name(n).into());
    let by_path = if f.exact() {
        // Both sides by identity: the source leaves, the target arrives, c leaves the tree.
        vec![
            Seen::Removed(f.in_watched("b.sock")),
            Seen::Created(f.in_watched("b2.sock")),
            Seen::Removed(f.in_watched("c.sock")),
        ]
    } else {
        vec![
            name("b.sock"),
            name("b2.sock"),
            name("c.sock"),
            name("c.sock"),
        ]
    };
    let mut expected = vec![
        Seen::Removed(f.in_watched("a.sock")),
        Seen::Created(f.in_watched("a2.sock")),
    ];
    expected.extend(by_path);
    expected.extend([
        Seen::Created(f.in_watched("in.sock")),
        Seen::Created(f.in_watched("x1.sock")),
        Seen::Created(f.in_watched("x2.sock")),
        Seen::Removed(f.in_watched("x1.sock")),
        Seen::Created(f.in_watched("x3.sock")),
    ]);
    assert_eq!(seen, expected);
}

#[tokio::test]
async fn moves_and_mkdirs_into_a_watched_directory_by_full_path_pass_by_its_name() {
    if !can_run() {
        return;
    }
    let mut f = Fixture::open("parent-name", EbpfOptions::default(), 1024);
    // The watcher announces every watched directory's name (the root's, in its watched parent).
    let tmp = WatchedDir::stat(f.watched.parent().expect("tmp")).expect("stat tmp");
    f.source
        .entry_present(&tmp, std::ffi::OsStr::new("watched"), Entry::Directory);
    let setup = [
        Action::Bind(f.in_elsewhere("new.sock")),
        Action::Bind(f.in_elsewhere("x.sock")),
    ];
    assert_eq!(f.events_of(&setup, "setup.sock").await.len(), 0);
    let actions = [
        // From an unwatched directory to a name never seen, by full paths: the target's parent
        // component is a watched directory's name.
        Action::Rename(f.in_elsewhere("new.sock"), f.in_watched("moved.sock")),
        Action::Mkdir(f.in_watched("dir")),
        // Between unrelated directories: filtered out in the kernel.
        Action::Mkdir(f.in_elsewhere("other")),
        Action::Rename(f.in_elsewhere("x.sock"), f.in_elsewhere("y.sock")),
    ];
    // Other tests' fixtures also call their directory "watched": `collect_until` keeps this
    // test's names only.
    let seen = f.events_of(&actions, "sentinel.sock").await;
    assert_eq!(
        seen,
        vec![
            f.exact_or_name(Seen::Created(f.in_watched("moved.sock"))),
            f.exact_or_name(Seen::Created(f.in_watched("dir"))),
        ]
    );
}

#[tokio::test]
async fn a_bind_in_a_sub_directory_not_yet_watched_reports_that_sub_directory() {
    if !can_run() {
        return;
    }
    let mut f = Fixture::open("subdir", EbpfOptions::default(), 1024);
    let new = f.in_watched("new");
    let actions = [
        Action::Mkdir(new.clone()),
        Action::Mkdir(new.join("deeper")),
        Action::Bind(new.join("deeper").join("x.sock")),
        Action::Bind(f.in_elsewhere("x.sock")),
    ];
    let seen = f.events_of(&actions, "sentinel.sock").await;
    // The watcher stats it, watches it, and walks it: that is where x.sock is found. fentry/fexit
    // also see both mkdirs (the second one under `new`, not watched yet, reports `new` again).
    let times = if f.exact() { 3 } else { 1 };
    assert_eq!(seen, vec![Seen::Created(new); times]);
}

#[tokio::test]
async fn a_plugin_in_its_own_mount_namespace_is_seen_by_directory_identity() {
    if !can_run() {
        return;
    }
    let mut f = Fixture::open("mntns", EbpfOptions::default(), 1024);
    // The plugin sees the watched directory at <tmp>/elsewhere/registration, in its namespace only.
    let registration = f.elsewhere.join("registration");
    std::fs::create_dir(&registration).expect("mkdir mount point");
    let actions = [
        Action::UnshareBindMount(f.watched.clone(), registration.clone()),
        Action::Bind(registration.join(f.name("plugin.sock"))),
        Action::Unlink(registration.join(f.name("plugin.sock"))),
    ];
    let seen = f.events_of(&actions, "sentinel.sock").await;
    let mut expected = vec![Seen::Created(f.in_watched("plugin.sock"))];
    // The tracepoints match the unlink by name, and nobody announced the name before it (the
    // watcher's look after announcing finds the socket gone); fentry sees the dentry.
    if f.exact() {
        expected.push(Seen::Removed(f.in_watched("plugin.sock")));
    }
    assert_eq!(seen, expected);
}

#[tokio::test]
async fn describe_names_the_attached_hooks_and_ring_size() {
    if !can_run() {
        return;
    }
    let f = Fixture::open("describe", EbpfOptions::default(), 16);
    let description = f.source.describe();
    eprintln!("{description}");
    let hooks: Vec<&str> = if f.exact() {
        vec![
            "hooks: fentry/fexit",
            "fexit vfs_mknod",
            "fexit vfs_mkdir",
            "fexit vfs_unlink",
            "fexit vfs_rmdir",
            "fentry vfs_rename",
            "fexit vfs_rename",
            "fentry unix_release",
            "fentry vfs_unlink",
            "sys_exit_unlinkat",
            "sys_exit_listen",
            "sys_exit_connect",
        ]
    } else {
        // The legacy single-path syscalls (`unlink`, `rmdir`, ...) exist on x86_64 only; arm64
        // has their `*at` forms alone.
        #[cfg(target_arch = "x86_64")]
        let legacy = ["sys_enter_unlink", "sys_exit_rmdir"].as_slice();
        #[cfg(not(target_arch = "x86_64"))]
        let legacy = ["sys_exit_unlinkat"].as_slice();
        let common = [
            "hooks: syscall tracepoints",
            "sys_exit_bind",
            "sys_exit_unlinkat",
            "sys_enter_mknodat",
            "sys_enter_renameat2",
            "sys_exit_listen",
            "sys_exit_connect",
            "sys_enter_close",
        ];
        [common.as_slice(), legacy].concat()
    };
    for hook in hooks.iter().chain(&["2048 KiB"]) {
        assert!(description.contains(hook), "{description}");
    }
}

#[tokio::test]
async fn the_last_component_is_cut_exactly_at_every_length_and_word_alignment() {
    if !can_run() {
        return;
    }
    let mut f = Fixture::open("scan", EbpfOptions::default(), 1024);
    // The kernel side finds the last slash a word at a time: names ending at every offset within a
    // word, the longest name there is, and a name starting with '.' (the byte after a slash that
    // the word test can flag too).
    let mut names: Vec<String> = (1..=17).map(|len| f.name(&"x".repeat(len))).collect();
    names.push(format!(".{}", f.name("dot")));
    let longest = 255 - f.name("").len();
    names.push(f.name(&"y".repeat(longest)));
    let mut actions: Vec<Action> = names
        .iter()
        .map(|name| Action::MknodSocket(f.elsewhere.join(name)))
        .collect();
    // A trailing slash is not part of the name.
    let dir = f.name("dir");
    actions.push(Action::Mkdir(f.watched.join(&dir)));
    actions.push(Action::Chdir(f.watched.clone()));
    actions.push(Action::Rmdir(PathBuf::from(format!("{dir}//"))));
    let seen = f.events_of(&actions, "sentinel.sock").await;
    let mut expected: Vec<Seen> = if f.exact() {
        // No path is scanned: the sockets are in an unwatched directory, the mkdir is seen.
        vec![Seen::Created(f.watched.join(&dir))]
    } else {
        names
            .iter()
            .map(|name| Seen::NameChanged(name.into()))
            .collect()
    };
    expected.push(Seen::Removed(f.watched.join(&dir)));
    assert_eq!(seen, expected);
}

#[tokio::test]
async fn hooks_are_fentry_where_the_kernel_allows_them_and_tracepoints_where_it_refuses() {
    if !can_run() {
        return;
    }
    // The preferred family made mandatory: it opens, or fails with the kernel's reason.
    let (sink, _events) = mpsc::channel(1);
    let only_fentry = EbpfOptions {
        hooks: Some(HookChoice::Only(HookFamily::Fentry)),
        ..EbpfOptions::default()
    };
    let mandatory = {
        let _loaded = Loaded::shared();
        ebpf::open(sink, CancellationToken::new(), only_fentry)
            .map(|source| source.describe())
            .map_err(|e| format!("{e:#}"))
    };
    eprintln!("fentry only: {mandatory:?}");
    let auto = EbpfOptions {
        hooks: Some(HookChoice::Auto),
        ..EbpfOptions::default()
    };
    let mut f = Fixture::open("selection", auto, 64);
    let description = f.source.describe();
    eprintln!("auto: {description}");
    match &mandatory {
        // A kernel that allows fentry (the one `cargo xtask vm-test` boots): auto takes it.
        Ok(fentry) => {
            assert!(fentry.starts_with("eBPF hooks: fentry/fexit: "), "{fentry}");
            assert!(
                description.starts_with("eBPF hooks: fentry/fexit: fexit vfs_mknod"),
                "{description}"
            );
            assert!(!description.contains("passed over"), "{description}");
            // Only the liveness hints and the exit checks of the calls followed into the VFS
            // are tracepoints in this family: no tracepoint event program runs.
            assert!(!description.contains("sys_enter_bind"), "{description}");
            assert!(
                description.contains("tracepoint syscalls/sys_exit_unlinkat"),
                "{description}"
            );
            assert!(
                description.contains("tracepoint syscalls/sys_exit_listen"),
                "{description}"
            );
        }
        // A kernel that refuses it by policy (EPERM at load, like the build machine's): the
        // mandatory open fails saying so, and auto falls back naming the first program refused,
        // with nothing of the refused family left attached. (This test binary is no agent, so
        // the kernel layout is parsed in process and no probe runs: the agent's own probe is
        // `source_selection`'s to check.)
        // Or one where fexit would miss calls (Debian's 5.10: the compiler split `vfs_rmdir`, and
        // rmdir(2) calls the clone): passed over before any program loads, naming the clone.
        Err(refused) => {
            let why = if refused.contains("the compiler split ") {
                "the compiler split "
            } else {
                "vfs_mknod_exit on vfs_mknod refused by the kernel (EPERM"
            };
            assert!(
                refused.contains("no eBPF hook family is usable") && refused.contains(why),
                "{refused}"
            );
            assert!(
                description.contains(&format!(
                    "hooks: syscall tracepoints (passed over fentry/fexit: {why}"
                )),
                "{description}"
            );
            assert!(!description.contains("fexit vfs_"), "{description}");
            assert!(
                description.contains("tracepoint syscalls/sys_exit_bind"),
                "{description}"
            );
        }
    }
    let seen = f
        .events_of(&[Action::Bind(f.in_watched("a.sock"))], "sentinel.sock")
        .await;
    assert_eq!(seen, vec![Seen::Created(f.in_watched("a.sock"))]);
}

/// Kills the agent process when the test ends, however it ends.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn source_auto_falls_back_to_fanotify_on_a_kernel_without_btf() {
    if !can_run() {
        return;
    }
    use std::io::BufRead;
    let tmp = tempfile::tempdir().expect("tempdir");
    let plugins = tmp.path().join("plugins");
    std::fs::create_dir(&plugins).expect("mkdir plugins");
    let mut agent = Command::new(env!("CARGO_BIN_EXE_plugin-agent"));
    agent
        .args([
            "--log-format",
            "json",
            "run",
            "--source",
            "auto",
            "--plugin-dir",
        ])
        .arg(&plugins)
        .env("PLUGIN_AGENT_ADMIN_SOCKET", tmp.path().join("admin.sock"))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    // The agent runs in its own mount namespace with an empty /sys/kernel/btf, as on a kernel
    // built without CONFIG_DEBUG_INFO_BTF: the eBPF source cannot resolve a single offset, on any
    // kernel and whatever hooks it allows.
    // SAFETY: between fork and exec the closure makes only syscalls (unshare, mount) and
    // allocates nothing.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut agent, || {
            use nix::mount::{MsFlags, mount};
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)?;
            let private = MsFlags::MS_REC | MsFlags::MS_PRIVATE;
            mount(None::<&str>, "/", None::<&str>, private, None::<&str>)?;
            mount(
                Some("tmpfs"),
                "/sys/kernel/btf",
                Some("tmpfs"),
                MsFlags::empty(),
                None::<&str>,
            )?;
            Ok(())
        })
    };
    let child = agent.spawn().expect("start plugin-agent");
    let mut agent = KillOnDrop(child);
    let stderr = agent.0.stderr.take().expect("piped stderr");
    let (lines_tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut log = Vec::new();
    let opened = loop {
        let line = lines
            .recv_timeout(STEP_TIMEOUT)
            .unwrap_or_else(|_| panic!("no \"event source open\" in:\n{}", log.join("\n")));
        log.push(line.clone());
        if line.contains("\"event source open\"") {
            break line;
        }
    };
    let log = log.join("\n");
    assert!(opened.contains("\"source\":\"fanotify\""), "{log}");
    assert!(
        log.contains("event source unavailable")
            && log.contains("CONFIG_DEBUG_INFO_BTF")
            && log.contains("/sys/kernel/btf/vmlinux"),
        "{log}"
    );
}

#[tokio::test]
async fn load_time_is_measured_per_program() {
    if !can_run() {
        return;
    }
    let f = Fixture::open("load-time", EbpfOptions::default(), 16);
    let timings = f.source.load_timings();
    eprintln!("eBPF load: {timings}");
    assert!(!timings.programs.is_empty(), "{timings}");
    assert!(timings.verifier() <= timings.total(), "{timings}");
}

#[tokio::test]
async fn a_full_ring_buffer_becomes_a_rescan_and_counted_drops() {
    if !can_run() {
        return;
    }
    // One page of ring (13 records) and a channel of one, not read until the helper is done: the
    // reader blocks on the channel, the ring fills, and reservations fail.
    let options = EbpfOptions {
        ring_buffer_bytes: 4096,
        ..EbpfOptions::default()
    };
    let mut f = Fixture::open("overflow", options, 1);
    let before = f.source.stats();
    assert_eq!(before.dropped, 0);
    assert_eq!(before.ring_buffer_size_bytes, Some(4096));
    // Far from full before the binds, which is all the test needs. Not necessarily empty: a
    // socket `mknod` by a path the tracepoints cannot resolve is reported by name to every loaded
    // source (see `collect_until`), and the suite's other tests make some beside this one; once
    // in CI one such record (104 bytes: one short name) was queued when this test began.
    assert!(
        before
            .ring_buffer_used_bytes
            .is_some_and(|used| used < 4096 / 2),
        "{before:?}"
    );
    let actions: Vec<Action> = (0..64)
        .map(|i| Action::Bind(f.in_watched(&format!("{i}.sock"))))
        .collect();
    run_helper(&actions);
    // The reader is stuck on the channel: the ring is (nearly) full and the drops are counted.
    let stuck = f.source.stats();
    assert!(stuck.dropped > 0, "{stuck:?}");
    assert!(
        stuck.ring_buffer_used_bytes.is_some_and(|used| used > 2048),
        "{stuck:?}"
    );
    // What fitted arrives in order, then the rescan that covers the rest.
    let seen = f.collect_until(&Seen::Rescan).await;
    let fitted: Vec<Seen> = (0..seen.len())
        .map(|i| Seen::Created(f.in_watched(&format!("{i}.sock"))))
        .collect();
    assert_eq!(seen, fitted);
    assert!(
        seen.len() < 64,
        "{} events for 64 binds in a 4 KiB ring",
        seen.len()
    );

    // The source keeps working after the loss, and the drops stay counted (for metrics) while the
    // ring empties again.
    let seen = f.events_of(&[], "after.sock").await;
    assert_eq!(seen, vec![]);
    let after = f.source.stats();
    assert_eq!(after.dropped, stuck.dropped, "{after:?}");
    assert_eq!(after.ring_buffer_used_bytes, Some(0), "{after:?}");
}

/// A call inside a traced VFS function when its trampoline is rebuilt (any program attached to
/// the function or detached from it: a second agent, any other tool) returns without running
/// its fexit programs, so its event is lost: the loss is counted (`dropped`) and rescanned, never
/// silent. An `unlink` is held inside `vfs_unlink` (its file's inode lock held by a `write`
/// waiting on a userfaultfd page), a second fexit is attached there and detached, and the
/// unlink is let go.
#[tokio::test]
async fn a_call_whose_fexit_a_trampoline_rebuild_skipped_is_a_counted_loss() {
    if !can_run() {
        return;
    }
    let mut f = Fixture::open_alone("rebuilt", EbpfOptions::default(), 1024);
    if !f.exact() {
        eprintln!("syscall tracepoints: no trampoline to rebuild, no exit to skip");
        return;
    }
    assert_eq!(f.source.stats().dropped, 0);
    let held = f.in_watched("held");
    let path = held.clone();
    let waited_at = tokio::task::spawn_blocking(move || {
        let mut helper = Interactive::spawn(&[Action::UnlinkBlockedInVfs(path)]);
        let waited_at = helper.line_after(BLOCKED);
        rebuild_the_trampoline_of("vfs_unlink", "vfs_unlink_exit");
        helper.finish();
        waited_at
    })
    .await
    .expect("the held unlink");
    eprintln!("the unlink waited in the kernel at {waited_at}");
    let sentinel = f.in_watched("sentinel.sock");
    run_helper(&[Action::Bind(sentinel.clone())]);
    let mut seen = f.collect_until(&Seen::Created(sentinel)).await;
    // The count moved when the unlink returned, before the sentinel was bound.
    let dropped = f.source.stats().dropped;
    assert!(
        !seen.contains(&Seen::Removed(held.clone())),
        "the unlink's fexit ran: it was not inside vfs_unlink across the rebuild: {seen:?}"
    );
    assert!(
        dropped >= 1,
        "the removal of {} was lost, and no loss was counted: {seen:?}",
        held.display()
    );
    // The reader reads the counters after each drain: the rescan may follow the sentinel.
    while !seen.contains(&Seen::Rescan) {
        let event = f.next_event(|| format!("no rescan after {seen:?}")).await;
        match Seen::from(event) {
            Seen::Serving(..) => {}
            other => seen.push(other),
        }
    }
    assert_eq!(seen, vec![Seen::Rescan]);
    assert_eq!(f.source.stats().dropped, dropped);
}

/// What [`unlink_blocked_in_vfs`] prints once its unlink waits inside `vfs_unlink`, followed by
/// where (`/proc/<tid>/wchan`).
const BLOCKED: &str = "unlink-blocked-in-vfs";

/// userfaultfd(2)'s interface (`linux/userfaultfd.h`), for [`unlink_blocked_in_vfs`]: the
/// calls are made directly, as the crate's dependencies have none of them.
mod uffd {
    #[repr(C)]
    pub struct Api {
        pub api: u64,
        pub features: u64,
        pub ioctls: u64,
    }
    #[repr(C)]
    pub struct Range {
        pub start: u64,
        pub len: u64,
    }
    #[repr(C)]
    pub struct Register {
        pub range: Range,
        pub mode: u64,
        pub ioctls: u64,
    }
    #[repr(C)]
    pub struct Zeropage {
        pub range: Range,
        pub mode: u64,
        pub zeropage: i64,
    }
    pub const API: u64 = 0xAA;
    pub const REGISTER_MODE_MISSING: u64 = 1;
    /// `_IOWR(0xAA, nr, T)` (the same encoding on x86_64 and arm64).
    const fn iowr<T>(nr: u64) -> u64 {
        (3 << 30) | ((core::mem::size_of::<T>() as u64) << 16) | (API << 8) | nr
    }
    pub const IOC_API: u64 = iowr::<Api>(0x3F);
    pub const IOC_REGISTER: u64 = iowr::<Register>(0x00);
    pub const IOC_ZEROPAGE: u64 = iowr::<Zeropage>(0x04);
    /// A `struct uffd_msg`, whose first byte says what happened.
    pub const MSG_BYTES: usize = 32;
    pub const EVENT_PAGEFAULT: u8 = 0x12;

    /// `ioctl(fd, request, arg)`, or the error it returned.
    pub fn ioctl<T>(
        fd: &impl std::os::fd::AsRawFd,
        request: u64,
        arg: &mut T,
    ) -> std::io::Result<()> {
        // SAFETY: `arg` is the struct `request` reads and writes, alive for the call.
        let ret = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, arg as *mut T) };
        if ret == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }
}

/// The helper's side of the rebuild test: writes `path` from a page that is not there yet
/// (registered with userfaultfd, missing), so the write holds the file's inode lock while it
/// waits for the page; then unlinks `path` from another thread, which waits for that lock
/// inside `vfs_unlink` (uninterruptibly: the first lock an unlink can wait for in that state,
/// the parent directory's being free). Prints [`BLOCKED`], and on a line from stdin supplies
/// the page: the write, then the unlink, complete.
fn unlink_blocked_in_vfs(path: &str) {
    use std::io::{BufRead, Write};
    use std::os::fd::{FromRawFd, OwnedFd};
    std::fs::write(path, b"held").expect(path);
    // SAFETY: userfaultfd takes flags only; the descriptor it returns is owned below.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) };
    assert!(fd >= 0, "userfaultfd: {}", std::io::Error::last_os_error());
    // SAFETY: a new descriptor nothing else owns.
    let uffd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut api = uffd::Api {
        api: uffd::API,
        features: 0,
        ioctls: 0,
    };
    uffd::ioctl(&uffd, uffd::IOC_API, &mut api).expect("UFFDIO_API");
    // SAFETY: sysconf reads a constant.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    // SAFETY: a fresh anonymous mapping, never unmapped (the helper exits after).
    let buf = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(buf, libc::MAP_FAILED, "mmap");
    let range = || uffd::Range {
        start: buf as u64,
        len: page as u64,
    };
    let mut register = uffd::Register {
        range: range(),
        mode: uffd::REGISTER_MODE_MISSING,
        ioctls: 0,
    };
    uffd::ioctl(&uffd, uffd::IOC_REGISTER, &mut register).expect("UFFDIO_REGISTER");
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .expect(path);
    let address = buf as usize;
    let writer = std::thread::spawn(move || {
        // SAFETY: the page stays mapped for the helper's life; reading it waits for the fault.
        let data = unsafe { std::slice::from_raw_parts(address as *const u8, page) };
        (&file).write(data)
    });
    // The write's fault: from now on it holds the file's inode lock.
    let mut msg = [0u8; uffd::MSG_BYTES];
    let read = nix::unistd::read(&uffd, &mut msg).expect("read the fault");
    assert_eq!((read, msg[0]), (uffd::MSG_BYTES, uffd::EVENT_PAGEFAULT));
    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    let unlinked = path.to_owned();
    let unlinker = std::thread::spawn(move || {
        tid_tx.send(nix::unistd::gettid()).expect("send the tid");
        std::fs::remove_file(&unlinked)
    });
    let tid = tid_rx.recv().expect("the unlinker's tid");
    let stat = format!("/proc/self/task/{tid}/stat");
    let until = Instant::now() + STEP_TIMEOUT;
    loop {
        let line = std::fs::read_to_string(&stat).expect(&stat);
        // The state follows the command, which is in parentheses.
        let state = line
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next());
        if state == Some("D") {
            break;
        }
        assert!(Instant::now() < until, "the unlink never waited: {line}");
        std::thread::sleep(Duration::from_millis(1));
    }
    let wchan = std::fs::read_to_string(format!("/proc/self/task/{tid}/wchan")).unwrap_or_default();
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{BLOCKED} {wchan}").expect("stdout");
    stdout.flush().expect("stdout");
    drop(stdout);
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).expect("stdin");
    let mut zeropage = uffd::Zeropage {
        range: range(),
        mode: 0,
        zeropage: 0,
    };
    uffd::ioctl(&uffd, uffd::IOC_ZEROPAGE, &mut zeropage).expect("UFFDIO_ZEROPAGE");
    let written = writer.join().expect("the writer").expect("the write");
    assert_eq!(written, page);
    unlinker.join().expect("the unlinker").expect("the unlink");
}

/// A helper process the test talks to while it runs (stdin and stdout piped).
struct Interactive {
    child: std::process::Child,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl Interactive {
    fn spawn(actions: &[Action]) -> Interactive {
        let script: Vec<String> = actions.iter().map(Action::encode).collect();
        let exe = std::env::current_exe().expect("test executable");
        let mut child = Command::new(exe)
            .args(["--exact", "helper_process_performs_actions", "--nocapture"])
            .args(["--test-threads", "1"])
            .env(SCRIPT_ENV, script.join("\n"))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("spawn helper process");
        let stdout = std::io::BufReader::new(child.stdout.take().expect("piped stdout"));
        Interactive { child, stdout }
    }

    /// What follows `mark` on the first line the helper prints with it (the test harness
    /// prints the test's name before it on the same line); it fails the test if the helper ends
    /// first (its own waits are bounded).
    fn line_after(&mut self, mark: &str) -> String {
        use std::io::BufRead;
        let mut printed = String::new();
        loop {
            let mut line = String::new();
            let read = self.stdout.read_line(&mut line).expect("helper stdout");
            assert!(read > 0, "the helper ended without {mark:?}:\n{printed}");
            if let Some((_, rest)) = line.split_once(mark) {
                return rest.trim().to_owned();
            }
            printed.push_str(&line);
        }
    }

    /// Tells the helper to go on, and waits for it to end well.
    fn finish(mut self) {
        use std::io::{Read, Write};
        let mut stdin = self.child.stdin.take().expect("piped stdin");
        stdin.write_all(b"go\n").expect("helper stdin");
        drop(stdin);
        let mut rest = String::new();
        let _ = self.stdout.read_to_string(&mut rest);
        let status = self.child.wait().expect("wait for the helper");
        assert!(status.success(), "helper failed: {rest}");
    }
}

/// Attaches a second copy of the fexit program `program` (from this agent's own object) to
/// `function` and detaches it again: the kernel rebuilds the function's trampoline twice, as
/// for a second agent or any other tool attaching there.
fn rebuild_the_trampoline_of(function: &str, program: &str) {
    let Some(path) = option_env!("PLUGIN_AGENT_EBPF_OBJ_PATH") else {
        panic!("built without the eBPF object");
    };
    let object = std::fs::read(path).expect(path);
    let mut ebpf = aya::EbpfLoader::new()
        .btf(None)
        .map_max_entries(agent_ebpf::names::IN_FLIGHT, 1)
        .load(&object)
        .expect("load the object");
    let btf = aya::Btf::from_sys_fs().expect("the kernel's BTF");
    let fexit: &mut aya::programs::FExit = ebpf
        .program_mut(program)
        .expect(program)
        .try_into()
        .expect("an fexit program");
    fexit.load(function, &btf).expect("load the fexit");
    let link = fexit.attach().expect("attach the fexit");
    fexit.detach(link).expect("detach the fexit");
}

/// The reader maps the ring's data once, so a record that crosses the ring's end is read in two
/// pieces and put back together: through a one-page ring, binds whose names have every length
/// from 1 to 40 bytes (records of different sizes, so they straddle the end at every offset)
/// arrive whole and in order, ~20 times round the ring, with nothing lost.
#[tokio::test]
async fn records_that_cross_the_end_of_the_ring_arrive_whole() {
    if !can_run() {
        return;
    }
    let options = EbpfOptions {
        ring_buffer_bytes: 4096,
        ..EbpfOptions::default()
    };
    let mut f = Fixture::open("wrap", options, 4096);
    for batch in 0..50 {
        let names: Vec<String> = (0..4)
            .map(|i| {
                let n = batch * 4 + i;
                format!("{n}-{}.sock", "x".repeat(n % 40))
            })
            .collect();
        let actions: Vec<Action> = names
            .iter()
            .map(|name| Action::Bind(f.in_watched(name)))
            .collect();
        let seen = f.events_of(&actions, &format!("end-{batch}.sock")).await;
        let expected: Vec<Seen> = names
            .iter()
            .map(|name| Seen::Created(f.in_watched(name)))
            .collect();
        assert_eq!(seen, expected, "batch {batch}");
    }
    assert_eq!(f.source.stats().dropped, 0);
}

/// The online CPU count.
fn online_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// Binds and unlinks as fast as one helper process can for a few seconds and prints how many
/// events per second the agent received, and whether any were lost. Run with
/// `cargo test --test ebpf_source -- --ignored --nocapture bench`.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
#[ignore = "benchmark: prints events/s"]
async fn bench_bind_unlink_throughput() {
    if !can_run() {
        return;
    }
    let mut f = Fixture::open("bench", EbpfOptions::default(), 4096);
    let seconds = std::env::var("EBPF_BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3u64);
    let dir = f.watched.clone();
    let name = f.name("b.sock");
    let helper =
        std::thread::spawn(move || bind_unlink_loop(&dir, &name, Duration::from_secs(seconds)));
    let start = Instant::now();
    let mut last_event = start;
    let (mut events, mut rescans) = (0u64, 0u64);
    loop {
        match tokio::time::timeout(Duration::from_millis(500), f.events.recv()).await {
            Ok(Some(FsEvent::Rescan { reason })) => {
                rescans += 1;
                eprintln!("rescan: {reason}");
            }
            Ok(Some(_)) => {
                events += 1;
                last_event = Instant::now();
            }
            Ok(None) => break,
            Err(_) if helper.is_finished() => break,
            Err(_) => {}
        }
    }
    let elapsed = last_event.duration_since(start).as_secs_f64();
    let syscalls = helper.join().expect("helper thread");
    eprintln!(
        "eBPF source: {syscalls} binds+unlinks, {events} events received in {elapsed:.2} s = {:.0} events/s; {rescans} rescans (losses)",
        events as f64 / elapsed
    );
    assert_eq!(rescans, 0, "events were lost");
    assert_eq!(events, syscalls, "every bind and unlink is reported");
}

/// Runs a helper process that binds and unlinks (by dirfd) one name in `dir` for `duration`, and
/// returns how many syscalls it made.
fn bind_unlink_loop(dir: &Path, name: &str, duration: Duration) -> u64 {
    let millis = u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
    let stdout = run_helper(&[Action::BindUnlinkFor(
        dir.to_path_buf(),
        name.to_owned(),
        millis,
    )]);
    stdout
        .lines()
        .find_map(|line| line.split("syscalls=").nth(1))
        .and_then(|count| count.trim().parse().ok())
        .unwrap_or_else(|| panic!("helper printed no syscall count: {stdout}"))
}

// -------------------------------------------------------------------------------------------------
// Steady load and the sources benchmark (`cargo xtask bench-sources`)

/// A source under measurement, any kind, watching a fresh directory.
struct Measured {
    kind: SourceKind,
    source: std::sync::Arc<dyn EventSource>,
    /// The eBPF source's load timings (it is opened directly to read them).
    load: Option<String>,
    events: mpsc::Receiver<FsEvent>,
    _stop: DropGuard,
    _loaded: Loaded,
    _tmp: TempDir,
    dir: PathBuf,
}

impl Measured {
    async fn open(kind: SourceKind, channel: usize) -> Measured {
        let loaded = Loaded::shared();
        let tmp = tempfile::Builder::new()
            .prefix("bench-sources-")
            .tempdir()
            .expect("tempdir");
        let dir = tmp.path().join("plugins");
        std::fs::create_dir(&dir).expect("mkdir plugins");
        let (sink, events) = mpsc::channel(channel);
        let cancel = CancellationToken::new();
        let (source, load): (std::sync::Arc<dyn EventSource>, _) = match kind {
            SourceKind::Ebpf => {
                let source = ebpf::open(sink, cancel.clone(), EbpfOptions::default())
                    .unwrap_or_else(|err| panic!("open the eBPF source: {err:#}"));
                let load = source.load_timings().to_string();
                (std::sync::Arc::new(source), Some(load))
            }
            other => {
                let choice = SourceChoice::Only(other);
                let options = SourceOptions::default();
                let source = event_source::open(choice, sink, cancel.clone(), &options)
                    .await
                    .unwrap_or_else(|err| panic!("open the {other} source: {err:#}"));
                (source.source, None)
            }
        };
        source
            .watch(&WatchedDir::stat(&dir).expect("stat plugins"))
            .expect("watch");
        Measured {
            kind,
            source,
            load,
            events,
            _stop: cancel.drop_guard(),
            _loaded: loaded,
            _tmp: tmp,
            dir,
        }
    }
}

/// This process's resident set, KiB (all sources so far included: a trend, not a per-source cost).
fn rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Percentile `p` (0..=100) of sorted `values`.
fn percentile(sorted: &[u64], p: usize) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) * p / 100).min(sorted.len() - 1)]
}

/// Detection latency of binds spaced `gap` apart by a helper process, each hop separately.
#[derive(Debug, Default)]
struct Latency {
    /// Syscall return (helper's `CLOCK_MONOTONIC` after `bind`) to receipt, ns, sorted.
    from_return: Vec<u64>,
    /// Kernel timestamp (`bpf_ktime_get_ns` at the syscall's exit) to receipt, ns, sorted (eBPF).
    from_kernel: Vec<u64>,
    /// Kernel timestamp to the reader taking the record off the ring (wake-up + scheduling).
    kernel_to_reader: Vec<u64>,
    /// Reader to receipt by the consumer (the channel and the consumer task's wake-up).
    reader_to_consumer: Vec<u64>,
}

impl Latency {
    /// Matches the paced helper's `name sent_ns` lines with what the consumer received.
    fn of(stdout: &str, received: &std::collections::HashMap<String, (u64, Observed)>) -> Latency {
        let mut latency = Latency::default();
        for line in stdout.lines() {
            // The last two fields: libtest may print its own text earlier on the same line.
            let mut fields = line.split(' ').rev();
            let (Some(sent), Some(name)) = (fields.next(), fields.next()) else {
                continue;
            };
            let (Ok(sent), Some(&(got, observed))) = (sent.parse::<u64>(), received.get(name))
            else {
                continue;
            };
            // The reader can get the event before the helper reads its clock after bind returns.
            latency.from_return.push(got.saturating_sub(sent));
            if let Some(kernel) = observed.kernel_ns {
                latency.from_kernel.push(got.saturating_sub(kernel));
                if let Some(read) = observed.read_ns {
                    latency.kernel_to_reader.push(read.saturating_sub(kernel));
                    latency.reader_to_consumer.push(got.saturating_sub(read));
                }
            }
        }
        for v in [
            &mut latency.from_return,
            &mut latency.from_kernel,
            &mut latency.kernel_to_reader,
            &mut latency.reader_to_consumer,
        ] {
            v.sort_unstable();
        }
        latency
    }

    /// p50/p99/max in microseconds per hop, `null` for hops the source has no timestamps for.
    fn json(&self) -> serde_json::Value {
        let summary = |v: &[u64]| {
            (!v.is_empty()).then(|| {
                serde_json::json!({
                    "p50": percentile(v, 50) as f64 / 1000.0,
                    "p99": percentile(v, 99) as f64 / 1000.0,
                    "max": v.last().copied().unwrap_or(0) as f64 / 1000.0,
                })
            })
        };
        serde_json::json!({
            "samples": self.from_return.len(),
            "from_syscall_return_us": summary(&self.from_return),
            "from_kernel_timestamp_us": summary(&self.from_kernel),
            "kernel_to_reader_us": summary(&self.kernel_to_reader),
            "reader_to_consumer_us": summary(&self.reader_to_consumer),
        })
    }
}

/// The paced helper's events received so far: name -> (receipt, what the source observed).
type Receipts = std::collections::HashMap<String, (u64, Observed)>;

/// Records `event` in `received` if it is a paced bind named `<prefix>-*` in the measured directory.
fn receipt(received: &mut Receipts, event: &FsEvent, prefix: &str) -> bool {
    let now = monotonic_now_ns();
    if let FsEvent::Created { path, observed } = event {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        if let Some(name) = name.filter(|n| n.starts_with(prefix)) {
            received.insert(name, (now, *observed));
            return true;
        }
    }
    false
}

/// Detection latency at idle: binds spaced `gap` apart, nothing else happening.
async fn idle_latency(m: &mut Measured, samples: u64, gap: Duration) -> Latency {
    let dir = m.dir.clone();
    let gap_us = u64::try_from(gap.as_micros()).unwrap_or(u64::MAX);
    let helper = std::thread::spawn(move || {
        run_helper(&[Action::BindPaced(dir, "lat".into(), samples, gap_us)])
    });
    let mut received = Receipts::new();
    while (received.len() as u64) < samples {
        let event = tokio::time::timeout(STEP_TIMEOUT, m.events.recv())
            .await
            .unwrap_or_else(|_| panic!("{}: {} of {samples} binds seen", m.kind, received.len()))
            .expect("source closed its channel");
        receipt(&mut received, &event, "lat-");
    }
    let stdout = helper.join().expect("latency helper");
    Latency::of(&stdout, &received)
}

/// What a churn run delivered.
#[derive(Debug)]
struct Churn {
    /// bind + unlink syscalls the helpers made.
    syscalls: u64,
    /// Created / Removed events in the churned directory received before the end sentinel.
    events: u64,
    /// Rescans received (each covers what was lost).
    rescans: u64,
    /// From the helpers' start to the end sentinel's receipt.
    elapsed: Duration,
    /// The source's dropped counter afterwards.
    dropped: u64,
    /// Latency of the paced binds made during the churn, if asked for.
    loaded: Option<Latency>,
}

/// `processes` helper processes each bind and unlink one name `pairs` times in the watched
/// directory, as fast as they can, while this task consumes; then a last helper binds a sentinel,
/// and the run ends when the sentinel's event arrives. With `paced` (samples, gap), one more
/// helper binds that many sockets `gap` apart meanwhile: their latency is the loaded one (those
/// seen before the sentinel count).
async fn churn(
    m: &mut Measured,
    processes: u64,
    pairs: u64,
    paced: Option<(u64, Duration)>,
) -> Churn {
    let start = Instant::now();
    let paced_helper = paced.map(|(samples, gap)| {
        let dir = m.dir.clone();
        let gap_us = u64::try_from(gap.as_micros()).unwrap_or(u64::MAX);
        std::thread::spawn(move || {
            run_helper(&[Action::BindPaced(dir, "load".into(), samples, gap_us)])
        })
    });
    let mut received = Receipts::new();
    let helpers: Vec<_> = (0..processes)
        .map(|i| {
            let dir = m.dir.clone();
            std::thread::spawn(move || {
                let stdout = run_helper(&[Action::BindUnlinkCount(dir, format!("c{i}"), pairs)]);
                stdout
                    .lines()
                    .find_map(|line| line.split("syscalls=").nth(1))
                    .and_then(|count| count.trim().parse::<u64>().ok())
                    .unwrap_or(0)
            })
        })
        .collect();
    let sentinel = m.dir.join("done.sock");
    let mut sentinel_helper = None;
    let (mut events, mut rescans) = (0u64, 0u64);
    loop {
        if sentinel_helper.is_none() && helpers.iter().all(|h| h.is_finished()) {
            let sentinel = sentinel.clone();
            sentinel_helper = Some(std::thread::spawn(move || {
                run_helper(&[Action::Bind(sentinel)])
            }));
        }
        let event = match tokio::time::timeout(Duration::from_millis(50), m.events.recv()).await {
            Ok(event) => event.expect("source closed its channel"),
            Err(_) if start.elapsed() > 10 * STEP_TIMEOUT => {
                panic!("{}: no end sentinel after {events} events", m.kind)
            }
            Err(_) => continue,
        };
        if receipt(&mut received, &event, "load-") {
            continue;
        }
        match event {
            FsEvent::Created { ref path, .. } if path == &sentinel => break,
            FsEvent::Rescan { reason } => {
                rescans += 1;
                eprintln!("{}: rescan: {reason}", m.kind);
            }
            // Only this run's entries: other tests' multi-component mknods reach every eBPF source
            // as name-only hints (allowed over-reporting).
            FsEvent::Created { path, .. } | FsEvent::Removed { path, .. }
                if path.parent() == Some(m.dir.as_path()) =>
            {
                events += 1;
            }
            _ => {}
        }
    }
    let elapsed = start.elapsed();
    // The reader reads the loss counters after each drain, so the rescan for a loss counted
    // before the sentinel's record can follow the sentinel's event: wait for it.
    if rescans == 0 && m.source.stats().dropped > 0 {
        loop {
            let event = tokio::time::timeout(STEP_TIMEOUT, m.events.recv())
                .await
                .unwrap_or_else(|_| panic!("{}: a counted loss was never rescanned", m.kind))
                .expect("source closed its channel");
            if let FsEvent::Rescan { reason } = event {
                rescans += 1;
                eprintln!("{}: rescan: {reason}", m.kind);
                break;
            }
        }
    }
    let syscalls = helpers
        .into_iter()
        .map(|h| h.join().expect("churn helper"))
        .sum();
    if let Some(helper) = sentinel_helper {
        helper.join().expect("sentinel helper");
    }
    let loaded = paced_helper.map(|helper| {
        let stdout = helper.join().expect("paced helper");
        Latency::of(&stdout, &received)
    });
    Churn {
        syscalls,
        events,
        rescans,
        elapsed,
        dropped: m.source.stats().dropped,
        loaded,
    }
}

/// The default 2 MiB ring at full churn from two processes, with the consumer keeping up: nothing
/// is lost, so every bind and unlink is reported; and if the kernel ever did drop, the drop is
/// counted and a rescan was sent (so the watcher converges on the directory).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_ring_loses_nothing_under_full_churn_from_two_processes() {
    if !can_run() {
        return;
    }
    let mut m = Measured::open(SourceKind::Ebpf, 4096).await;
    let result = churn(&mut m, 2, 20_000, None).await;
    eprintln!("steady load: {result:?}");
    assert_eq!(result.syscalls, 80_000, "{result:?}");
    assert_eq!(result.rescans > 0, result.dropped > 0, "{result:?}");
    if result.rescans == 0 {
        assert_eq!(result.events, result.syscalls, "{result:?}");
    }
    // Only the sentinel is left: the directory the watcher would converge on.
    let left: Vec<_> = std::fs::read_dir(&m.dir)
        .expect("read plugins")
        .filter_map(|e| e.ok().map(|e| e.file_name()))
        .collect();
    assert_eq!(left, vec![std::ffi::OsString::from("done.sock")]);
}

/// Detection latency at idle and sustained throughput under churn, eBPF vs fanotify vs inotify in
/// one run; writes JSON to `$BENCH_SOURCES_OUT` (default: stdout only). Run by
/// `cargo xtask bench-sources`.
/// It runs on the agent's own runtime (`plugin_agent::runtime::build`), whose scheduling is part of
/// what is measured; the eBPF idle latency is also measured on a plain tokio runtime, side by side,
/// for what the runtime's short scheduler slice buys.
#[test]
#[ignore = "benchmark: run by cargo xtask bench-sources"]
fn bench_sources() {
    if !can_run() {
        return;
    }
    let env = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let samples = env("BENCH_SOURCES_SAMPLES", 500);
    let pairs = env("BENCH_SOURCES_PAIRS", 100_000);
    let plain = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a plain tokio runtime")
        .block_on(async {
            tokio::spawn(async move {
                let mut m = Measured::open(SourceKind::Ebpf, 4096).await;
                idle_latency(&mut m, samples, Duration::from_millis(5))
                    .await
                    .json()
            })
            .await
            .expect("the measurement task")
        });
    eprintln!("eBPF idle on a plain tokio runtime: {plain}");
    let floor = serde_json::json!({
        "same_cpu_us": wake_up_floor(samples, 0, 0),
        "other_cpu_us": (online_cpus() > 1).then(|| wake_up_floor(samples, 0, 1)),
    });
    eprintln!("wake-up floor: {floor}");
    plugin_agent::runtime::build()
        .expect("the agent's runtime")
        .block_on(measure_sources(samples, pairs, plain, floor));
}

/// The machine's floor for any event source: one thread writes an eventfd every 5 ms, another
/// blocked on it wakes; p50/p99 of write -> wake, with the two pinned to `writer_cpu` and
/// `reader_cpu`. Waking a thread on an idle CPU is what an idle agent pays on every event.
fn wake_up_floor(samples: u64, writer_cpu: usize, reader_cpu: usize) -> serde_json::Value {
    use nix::sys::eventfd::{EfdFlags, EventFd};
    let pin = |cpu: usize| {
        let mut set = nix::sched::CpuSet::new();
        set.set(cpu).expect("cpu index");
        nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
            .unwrap_or_else(|err| panic!("pin to CPU {cpu}: {err}"));
    };
    let eventfd =
        std::sync::Arc::new(EventFd::from_flags(EfdFlags::EFD_SEMAPHORE).expect("eventfd"));
    let (sent_tx, sent_rx) = std::sync::mpsc::channel::<u64>();
    let reader = {
        let eventfd = std::sync::Arc::clone(&eventfd);
        std::thread::spawn(move || {
            pin(reader_cpu);
            let mut delays = Vec::new();
            for _ in 0..samples {
                eventfd.read().expect("eventfd read");
                let woke = monotonic_now_ns();
                let sent = sent_rx.recv().expect("sent time");
                delays.push(woke.saturating_sub(sent));
            }
            delays
        })
    };
    std::thread::scope(|scope| {
        scope.spawn(|| {
            pin(writer_cpu);
            for _ in 0..samples {
                std::thread::sleep(Duration::from_millis(5));
                sent_tx.send(monotonic_now_ns()).expect("send time");
                eventfd.write(1).expect("eventfd write");
            }
        });
    });
    let mut delays = reader.join().expect("floor reader");
    delays.sort_unstable();
    serde_json::json!({
        "p50": percentile(&delays, 50) as f64 / 1000.0,
        "p99": percentile(&delays, 99) as f64 / 1000.0,
    })
}

async fn measure_sources(
    samples: u64,
    pairs: u64,
    ebpf_idle_on_plain_runtime: serde_json::Value,
    wake_up_floor: serde_json::Value,
) {
    let mut rows = Vec::new();
    for kind in [SourceKind::Ebpf, SourceKind::Fanotify, SourceKind::Inotify] {
        // Consumed in a spawned task, as the agent's watcher is (not on the test's own thread,
        // which would add a cross-thread wake-up the agent does not pay).
        let row = tokio::spawn(measure(kind, samples, pairs))
            .await
            .expect("the measurement task");
        eprintln!("{row}");
        rows.push(row);
    }
    let report = serde_json::json!({
        "sources": rows,
        "ebpf_idle_latency_on_plain_tokio_runtime": ebpf_idle_on_plain_runtime,
        "wake_up_floor": wake_up_floor,
    });
    let text = serde_json::to_string_pretty(&report).expect("serialise the report");
    match std::env::var_os("BENCH_SOURCES_OUT") {
        Some(path) => std::fs::write(&path, text).expect("write BENCH_SOURCES_OUT"),
        None => println!("{text}"),
    }
}

/// One row of the sources benchmark: idle latency, then churn with latency under load.
async fn measure(kind: SourceKind, samples: u64, pairs: u64) -> serde_json::Value {
    let mut m = Measured::open(kind, 4096).await;

    // Idle: one bind every 5 ms and nothing else.
    let idle = idle_latency(&mut m, samples, Duration::from_millis(5)).await;
    // 100,000 bind+unlink pairs in total, from two processes, with a bind every 2 ms meanwhile
    // for the latency under load.
    let result = churn(
        &mut m,
        2,
        pairs / 2,
        Some((samples, Duration::from_millis(2))),
    )
    .await;
    let seconds = result.elapsed.as_secs_f64();
    let idle = idle.json();
    let loaded = result.loaded.as_ref().map(Latency::json);
    let row = serde_json::json!({
        "source": kind.as_str(),
        "latency_samples": idle["samples"],
        "latency_from_syscall_return_us": idle["from_syscall_return_us"],
        "latency_from_kernel_timestamp_us": idle["from_kernel_timestamp_us"],
        "idle_latency": idle,
        "loaded_latency": loaded,
        "churn_pairs": pairs,
        "churn_processes": 2,
        "churn_syscalls": result.syscalls,
        "churn_events_received": result.events,
        "churn_seconds": seconds,
        "syscall_events_per_second": result.syscalls as f64 / seconds,
        "events_received_per_second": result.events as f64 / seconds,
        "rescans": result.rescans,
        "kernel_dropped": result.dropped,
        "load": m.load,
        "describe": m.source.describe(),
        "rss_kib": rss_kib(),
    });
    row
}
