//! Provenance: which process created a plugin socket and which one serves it.
//!
//! Any process that can write into the registration directory can create a socket that answers
//! GetInfo with another driver's name; kubelet hands it to the CSI manager all the same. The kernel
//! knows who did what, so every socket carries two [`Process`]es:
//!
//! ```text
//! creator  the process that bound it (or made it, or moved it in), as the event source recorded
//!          it at the time: eBPF records pid, uid, gid, command and cgroup id in the kernel;
//!          fanotify gives the pid, the rest is read from /proc while the process lives;
//!          inotify and the walks know nobody
//! server   the process that listen()ed on it: SO_PEERCRED on the registration connection (pid,
//!          uid, gid; every source), the rest from /proc
//! contact  the first process other than the agent that connected to it (kubelet's first
//!          GetInfo, beside it), and when: eBPF only, recorded by the kernel at the connect
//! ```
//!
//! Each process's cgroup v2 path comes with what it says about Kubernetes (pod UID, container ID:
//! [`kubernetes`]), read from the path alone. A creator that exited before it could be looked up
//! keeps what the kernel recorded. Nothing here talks to an API server or blocks for long: one or
//! two small `/proc` reads per process, and cgroup paths are interned, so the thousand plugins of one
//! pod share one.
//!
//! This room imports nothing: the event sources, the watcher, the executor, state and the policy
//! all speak its types.

pub mod cgroup_view;
pub mod kubernetes;

use cgroup_view::CgroupView;

use std::collections::HashMap;
use std::fmt;
use std::os::fd::BorrowedFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// What an event source recorded about the process that made a change, when it made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Actor {
    /// Thread-group id in the agent's pid namespace (eBPF: the initial one); 0 when not known.
    pub pid: u32,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    /// The calling thread's name (`task_struct.comm`, 15 bytes at most): the process's command
    /// unless the thread was named (see [`Resolver::actor`]).
    pub comm: Option<Comm>,
    /// The cgroup v2 id (the cgroup directory's inode number).
    pub cgroup_id: Option<u64>,
}

/// A command name as the kernel keeps it: NUL-padded, at most 15 bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Comm(pub [u8; 16]);

impl Comm {
    pub fn as_string(&self) -> String {
        let len = self.0.iter().position(|&b| b == 0).unwrap_or(self.0.len());
        String::from_utf8_lossy(&self.0[..len]).into_owned()
    }
}

impl fmt::Debug for Comm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.as_string())
    }
}

/// A process, as far as it could be known.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Process {
    /// In the agent's pid namespace; `None` when outside it or not known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
    /// The command name (`/proc/PID/comm`, or the kernel's record).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Box<str>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<Arc<Cgroup>>,
    /// A plugin server's pidfd inode on pidfs (Linux 6.9+), as the registration connection gave
    /// it: it names this process and no other for as long as the machine runs, so the next agent
    /// finds the server again by its pid without connecting to its sockets (see `liveness`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pidfs_ino: Option<u64>,
}

impl Process {
    /// The cgroup path, for messages and globs.
    pub fn cgroup_path(&self) -> Option<&str> {
        self.cgroup.as_deref().map(|c| &*c.path)
    }

    /// Whether `self` and `other` are known to be in the same cgroup (by id where both have one,
    /// else by path).
    pub fn same_cgroup(&self, other: &Process) -> bool {
        match (self.cgroup.as_deref(), other.cgroup.as_deref()) {
            (Some(a), Some(b)) => match (a.id, b.id) {
                (Some(x), Some(y)) => x == y,
                _ => a.path == b.path,
            },
            _ => false,
        }
    }
}

impl fmt::Display for Process {
    /// `pid 42 (csi-driver) uid 0 cgroup /kubepods.slice/...`: what a log line or a refusal says.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut sep = "";
        if let Some(pid) = self.pid {
            write!(f, "pid {pid}")?;
            sep = " ";
        }
        if let Some(command) = &self.command {
            write!(f, "{sep}({command})")?;
            sep = " ";
        }
        if let Some(uid) = self.uid {
            write!(f, "{sep}uid {uid}")?;
            sep = " ";
        }
        if let Some(path) = self.cgroup_path() {
            write!(f, "{sep}cgroup {path}")?;
            sep = " ";
        }
        if sep.is_empty() {
            f.write_str("an unknown process")?;
        }
        Ok(())
    }
}

/// A cgroup v2 and what its path says about Kubernetes.
#[derive(Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Cgroup {
    /// The path below the cgroup v2 root, as `/proc/PID/cgroup` shows it.
    pub path: Box<str>,
    /// Its id (the directory's inode number); `None` when it could not be looked up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<Box<str>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_id: Option<Box<str>>,
}

/// Who created a socket: known, or why not.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Creator {
    Known(Arc<Process>),
    /// What the event source recorded, not yet completed from `/proc` (the watcher reads
    /// nothing; the executor completes it at registration, from the server when it is the same
    /// process).
    Recorded(Actor),
    /// The event source reports no process (inotify).
    NotReported,
    /// A walk found the socket, not an event (at start, after a loss, or before the agent ran).
    #[default]
    FoundByWalk,
}

impl Creator {
    pub fn process(&self) -> Option<&Process> {
        match self {
            Creator::Known(process) => Some(process),
            _ => None,
        }
    }

    /// The creator's pid, when known.
    pub fn pid(&self) -> Option<u32> {
        match self {
            Creator::Known(process) => process.pid,
            Creator::Recorded(actor) => (actor.pid != 0).then_some(actor.pid),
            _ => None,
        }
    }

    /// Why the creator is not known, for the places that show it.
    pub fn unknown_because(&self) -> Option<&'static str> {
        match self {
            Creator::Known(_) | Creator::Recorded(_) => None,
            Creator::NotReported => Some("the event source does not report processes (inotify)"),
            Creator::FoundByWalk => Some("found by a walk of the directory, not an event"),
        }
    }
}

/// Both ends of one socket: who created it and who serves it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Provenance {
    pub creator: Creator,
    /// Learned from the registration connection; `None` until one was made (observe mode with
    /// contact off, a restored registration before its first connect).
    pub server: Option<Arc<Process>>,
}

impl Provenance {
    /// Whether the creator is known to be another process than the server (a socket bound by
    /// one process and served by another: a hand-off, or an impostor serving a socket it did not
    /// make). Unknown either side: `false`.
    pub fn creator_is_not_server(&self) -> bool {
        match (
            self.creator.pid(),
            self.server.as_deref().and_then(|s| s.pid),
        ) {
            (Some(creator), Some(server)) => creator != server,
            _ => false,
        }
    }
}

/// The first process other than the agent to connect to a socket instance, as the kernel
/// recorded it when its `connect` returned (eBPF only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Contact {
    pub by: Actor,
    /// `CLOCK_MONOTONIC` nanoseconds of the connect.
    pub kernel_ns: u64,
    /// The same moment on the wall clock, as the agent reckoned it on receipt.
    pub at: std::time::SystemTime,
}

impl Contact {
    /// How long after the socket's creation (`created_ns`, the kernel's timestamp of its bind,
    /// when an event recorded one) the contact came.
    pub fn after_creation(&self, created_ns: Option<u64>) -> Option<std::time::Duration> {
        created_ns
            .and_then(|created| self.kernel_ns.checked_sub(created))
            .map(std::time::Duration::from_nanos)
    }
}

/// Turns pids and kernel records into [`Process`]es, at registration (the executor's; the
/// watcher only keeps the record).
/// Cgroups are interned by path and by id, so looking one up twice costs a hash lookup.
#[derive(Debug)]
pub struct Resolver {
    proc_root: PathBuf,
    /// The host's cgroup v2 tree (`None`: no cgroup v2 here; paths come from /proc alone).
    cgroups_view: Option<CgroupView>,
    cgroups: Mutex<Interned>,
    /// Servers by process identity (see [`Self::server`]), with when they were read.
    servers: Mutex<HashMap<u64, (std::time::Instant, Arc<Process>)>>,
    /// Read nothing (see [`Self::kernel_only`]).
    kernel_only: bool,
}

/// How long what `/proc` said of a server stands for its next socket: long enough for a burst
/// of one process's sockets, short enough that a process moved to another cgroup is seen anew.
const SERVER_TTL: std::time::Duration = std::time::Duration::from_secs(1);

#[derive(Debug, Default)]
struct Interned {
    by_path: HashMap<Box<str>, Arc<Cgroup>>,
    by_id: HashMap<u64, Arc<Cgroup>>,
}

/// Interned cgroups kept at most; past it the table starts again (a node has a few thousand).
const MAX_INTERNED: usize = 65_536;

impl Default for Resolver {
    fn default() -> Self {
        Resolver::new(Path::new("/proc"), CgroupView::discover())
    }
}

impl Resolver {
    pub fn new(proc_root: &Path, cgroups_view: Option<CgroupView>) -> Resolver {
        Resolver {
            proc_root: proc_root.to_path_buf(),
            cgroups_view,
            cgroups: Mutex::new(Interned::default()),
            servers: Mutex::new(HashMap::new()),
            kernel_only: false,
        }
    }

    /// A resolver that reads nothing: processes are what the kernel reported (credentials,
    /// and with eBPF the command), cgroups unknown (`--provenance false`).
    pub fn kernel_only() -> Resolver {
        Resolver {
            kernel_only: true,
            ..Resolver::new(Path::new("/proc"), None)
        }
    }

    /// The process `pid` as `/proc` shows it now, with the credentials the caller already knows
    /// (`SO_PEERCRED`'s) taking precedence; a process gone or outside the pid namespace keeps
    /// only those.
    pub fn process(&self, pid: Option<u32>, uid: Option<u32>, gid: Option<u32>) -> Process {
        let mut process = Process {
            pid,
            uid,
            gid,
            ..Process::default()
        };
        let Some(pid) = pid.filter(|_| !self.kernel_only) else {
            return process;
        };
        let dir = self.proc_root.join(pid.to_string());
        process.command = self.live_command(Some(pid));
        if uid.is_none() || gid.is_none() {
            let status = read_small(&dir.join("status")).unwrap_or_default();
            process.uid = uid.or_else(|| status_id(&status, "Uid:"));
            process.gid = gid.or_else(|| status_id(&status, "Gid:"));
        }
        process.cgroup = read_small(&dir.join("cgroup"))
            .and_then(|text| unified_path(&text).map(|path| self.host_path(path)))
            .map(|path| self.cgroup_by_path(&path));
        process
    }

    /// The creator `actor` recorded, completed: from `server` when it is the same process (the
    /// usual case: a plugin binds the socket it serves; nothing is read), else from `/proc`
    /// where the record lacks it and the process still lives (fanotify records only the pid).
    /// The command is the process's (its main thread's): the kernel names the calling thread,
    /// and a Go or tokio plugin's threads have names of their own; once the process is gone,
    /// the thread name the kernel recorded.
    pub fn creator(&self, actor: &Actor, server: Option<&Arc<Process>>) -> Arc<Process> {
        let pid = (actor.pid != 0).then_some(actor.pid);
        if let Some(server) = server.filter(|s| pid.is_some() && s.pid == pid) {
            let same_cgroup = match (actor.cgroup_id, server.cgroup.as_deref()) {
                (None, _) => true,
                (Some(id), Some(cgroup)) => cgroup.id == Some(id),
                (Some(_), None) => false,
            };
            if same_cgroup && actor.uid.is_none_or(|uid| server.uid == Some(uid)) {
                return server.clone();
            }
        }
        Arc::new(self.actor(actor))
    }

    /// What the kernel recorded about `actor`, completed from `/proc` where the record lacks it
    /// and the process still lives (see [`Self::creator`]).
    pub fn actor(&self, actor: &Actor) -> Process {
        let pid = (actor.pid != 0).then_some(actor.pid);
        let recorded_by_kernel = actor.comm.is_some() || actor.cgroup_id.is_some();
        if !recorded_by_kernel {
            return self.process(pid, actor.uid, actor.gid);
        }
        let cgroup = actor
            .cgroup_id
            .filter(|_| !self.kernel_only)
            .and_then(|id| self.cgroup_by_id(id, pid));
        let command = self
            .live_command(pid)
            .or_else(|| actor.comm.map(|c| c.as_string().into()));
        Process {
            pid,
            uid: actor.uid,
            gid: actor.gid,
            command,
            cgroup,
            pidfs_ino: None,
        }
    }

    /// The process `pid` serving a connection whose pidfd is the pidfs inode `identity` (unique
    /// per process for as long as the machine runs, so never another process's): looked up once
    /// per second per process, so a process serving many sockets costs two `/proc` reads, not
    /// two per socket. Without an identity (no pidfs: Linux before 6.9), read every time.
    ///
    /// `pid` is `SO_PEERCRED`'s, the process that called `listen`; `pidfd` the kernel's handle
    /// on that process (`SO_PEERPIDFD`). A pid is a number the kernel hands out again once its
    /// process is reaped, so `/proc/PID` is read only with a pidfd, and what was read is kept
    /// only if the pidfd's process still holds its pid afterwards: otherwise it may have been
    /// another process's (a listener handed on, its first owner gone, and the pid recycled by a
    /// process in a cgroup the policy allows). Without, the server is what the kernel's
    /// credentials say (uid, gid), its cgroup unknown: a policy on cgroups refuses it.
    pub fn server(
        &self,
        identity: Option<u64>,
        pid: Option<u32>,
        pidfd: Option<BorrowedFd<'_>>,
        uid: u32,
        gid: u32,
    ) -> Arc<Process> {
        let now = std::time::Instant::now();
        if let Some(key) = identity
            && let Some((at, process)) = self.servers().get(&key)
            && now.duration_since(*at) < SERVER_TTL
            && process.uid == Some(uid)
            && process.gid == Some(gid)
        {
            return process.clone();
        }
        let known = Process {
            pid,
            uid: Some(uid),
            gid: Some(gid),
            pidfs_ino: identity,
            ..Process::default()
        };
        let process = match pidfd {
            Some(pidfd) if !self.kernel_only => {
                let read = self.process(pid, Some(uid), Some(gid));
                if holds_its_pid(pidfd) {
                    Process {
                        pidfs_ino: identity,
                        ..read
                    }
                } else {
                    known
                }
            }
            _ => known,
        };
        let process = Arc::new(process);
        if let Some(key) = identity {
            let mut servers = self.servers();
            if servers.len() >= MAX_INTERNED {
                servers.retain(|_, (at, _)| now.duration_since(*at) < SERVER_TTL);
            }
            servers.insert(key, (now, process.clone()));
        }
        process
    }

    fn servers(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<u64, (std::time::Instant, Arc<Process>)>> {
        self.servers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `/proc/PID/comm`: the process's (main thread's) command name, while it lives.
    fn live_command(&self, pid: Option<u32>) -> Option<Box<str>> {
        let pid = pid.filter(|_| !self.kernel_only)?;
        read_small(&self.proc_root.join(pid.to_string()).join("comm")).map(|c| c.trim_end().into())
    }

    /// The interned cgroup at `path`, its id from the directory's inode where cgroup v2 is here.
    fn cgroup_by_path(&self, path: &str) -> Arc<Cgroup> {
        if let Some(found) = self.interned().by_path.get(path) {
            return found.clone();
        }
        let id = self
            .cgroups_view
            .as_ref()
            .and_then(|view| std::fs::metadata(view.root.join(path.trim_start_matches('/'))).ok())
            .map(|meta| meta.ino());
        self.intern(path, id)
    }

    /// The cgroup with id `id`: interned, or the one `/proc/PID/cgroup` names when its id
    /// matches, or found by walking the cgroup v2 tree (a creator that exited, in a cgroup not
    /// seen before).
    fn cgroup_by_id(&self, id: u64, pid: Option<u32>) -> Option<Arc<Cgroup>> {
        if let Some(found) = self.interned().by_id.get(&id) {
            return Some(found.clone());
        }
        if let Some(pid) = pid {
            let text = read_small(&self.proc_root.join(pid.to_string()).join("cgroup"));
            if let Some(path) = text.as_deref().and_then(unified_path) {
                let cgroup = self.cgroup_by_path(&self.host_path(path));
                if cgroup.id == Some(id) {
                    return Some(cgroup);
                }
            }
        }
        let root = &self.cgroups_view.as_ref()?.root;
        let path = find_cgroup(root, id)?;
        Some(self.intern(&path, Some(id)))
    }

    fn intern(&self, path: &str, id: Option<u64>) -> Arc<Cgroup> {
        let pod = kubernetes::parse(path);
        let cgroup = Arc::new(Cgroup {
            path: path.into(),
            id,
            pod_uid: pod.pod_uid,
            container_id: pod.container_id,
        });
        let mut interned = self.interned();
        if interned.by_path.len() >= MAX_INTERNED {
            *interned = Interned::default();
        }
        interned.by_path.insert(path.into(), cgroup.clone());
        if let Some(id) = id {
            interned.by_id.insert(id, cgroup.clone());
        }
        cgroup
    }

    /// A path `/proc/PID/cgroup` gave, as the host names it (kept as read where it cannot be
    /// resolved: a namespace root not found).
    fn host_path(&self, path: &str) -> String {
        self.cgroups_view
            .as_ref()
            .and_then(|view| view.host_path(path))
            .unwrap_or_else(|| path.to_string())
    }

    fn interned(&self) -> std::sync::MutexGuard<'_, Interned> {
        self.cgroups.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A `/proc` file of a few hundred bytes; `None` when the process is gone or it is unreadable.
/// Whether the process behind `pidfd` has not been reaped, so that its pid still names it
/// (`pidfd_send_signal` with signal 0: `ESRCH` once it is gone; `EPERM` says it exists but the
/// agent, without `CAP_KILL`, may not signal it).
fn holds_its_pid(pidfd: BorrowedFd<'_>) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: pidfd_send_signal takes a descriptor, a signal (0: none is sent), a null info
    // pointer and flags 0; it reads and writes no memory of ours.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            0,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

fn read_small(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

/// The real id on a `Uid:`/`Gid:` line of `/proc/PID/status`.
fn status_id(status: &str, key: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|line| line.strip_prefix(key))
        .and_then(|ids| ids.split_whitespace().next())
        .and_then(|id| id.parse().ok())
}

/// The cgroup v2 line (`0::/path`) of `/proc/PID/cgroup`.
fn unified_path(text: &str) -> Option<&str> {
    text.lines()
        .find_map(|line| line.strip_prefix("0::"))
        .map(str::trim_end)
}

/// Directories visited at most when looking for a cgroup by id.
const MAX_WALK: usize = 100_000;

/// The path (below `root`, with a leading `/`) of the cgroup directory whose inode is `id`.
fn find_cgroup(root: &Path, id: u64) -> Option<String> {
    if std::fs::metadata(root).ok()?.ino() == id {
        return Some("/".to_string());
    }
    let mut stack = vec![root.to_path_buf()];
    let mut visited = 0;
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            if !kind.is_dir() {
                continue;
            }
            visited += 1;
            if visited > MAX_WALK {
                return None;
            }
            let path = entry.path();
            if entry.metadata().is_ok_and(|m| m.ino() == id) {
                let below = path.strip_prefix(root).ok()?;
                return Some(format!("/{}", below.display()));
            }
            stack.push(path);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_live_process_is_read_from_proc_with_the_given_credentials_first() {
        let resolver = Resolver::default();
        let me = std::process::id();
        let found = resolver.process(Some(me), None, Some(4242));
        assert_eq!(found.pid, Some(me));
        assert_eq!(found.uid, Some(nix::unistd::getuid().as_raw()));
        assert_eq!(found.gid, Some(4242), "the caller's gid wins over /proc");
        let comm = std::fs::read_to_string("/proc/self/comm").expect("comm");
        assert_eq!(found.command.as_deref(), Some(comm.trim_end()));
        let own = std::fs::read_to_string("/proc/self/cgroup").expect("cgroup");
        assert_eq!(found.cgroup_path(), unified_path(&own));
    }

    #[test]
    fn a_gone_process_keeps_what_was_given_and_what_the_kernel_recorded() {
        let resolver = Resolver::new(Path::new("/nonexistent-proc"), None);
        let found = resolver.process(Some(7), Some(1000), None);
        assert_eq!(
            found,
            Process {
                pid: Some(7),
                uid: Some(1000),
                ..Process::default()
            }
        );
        let mut comm = [0; 16];
        comm[..6].copy_from_slice(b"driver");
        let recorded = resolver.actor(&Actor {
            pid: 7,
            uid: Some(0),
            gid: Some(0),
            comm: Some(Comm(comm)),
            cgroup_id: Some(99),
        });
        assert_eq!(recorded.command.as_deref(), Some("driver"));
        assert_eq!(recorded.uid, Some(0));
        assert_eq!(recorded.cgroup, None, "no cgroup v2 to look id 99 up in");
    }

    #[test]
    fn a_cgroup_is_found_by_id_in_a_tree_and_interned() {
        let root = tempfile::tempdir().expect("tempdir");
        let pod = "kubepods/besteffort/pod5c1d8a3e-2f4b-4c6d-9e8f-0a1b2c3d4e5f";
        std::fs::create_dir_all(root.path().join(pod)).expect("mkdir");
        let id = std::fs::metadata(root.path().join(pod))
            .expect("stat")
            .ino();
        let resolver = Resolver::new(
            Path::new("/nonexistent-proc"),
            Some(CgroupView::at(root.path().into())),
        );
        let actor = Actor {
            pid: 7,
            cgroup_id: Some(id),
            ..Actor::default()
        };
        let found = resolver.actor(&actor).cgroup.expect("found by walking");
        assert_eq!(&*found.path, format!("/{pod}"));
        assert_eq!(
            found.pod_uid.as_deref(),
            Some("5c1d8a3e-2f4b-4c6d-9e8f-0a1b2c3d4e5f")
        );
        std::fs::remove_dir_all(root.path().join("kubepods")).expect("rm");
        let again = resolver.actor(&actor).cgroup.expect("interned");
        assert!(Arc::ptr_eq(&found, &again));
    }

    #[test]
    fn status_and_cgroup_files_are_parsed() {
        let status = "Name:\tx\nUid:\t1000\t1000\t1000\t1000\nGid:\t20\t20\t20\t20\n";
        assert_eq!(status_id(status, "Uid:"), Some(1000));
        assert_eq!(status_id(status, "Gid:"), Some(20));
        assert_eq!(status_id("", "Uid:"), None);
        assert_eq!(unified_path("4:memory:/x\n0::/a/b\n"), Some("/a/b"));
        assert_eq!(unified_path("4:memory:/x\n"), None);
    }

    #[test]
    fn display_says_what_is_known() {
        let process = Process {
            pid: Some(42),
            uid: Some(0),
            command: Some("driver".into()),
            ..Process::default()
        };
        assert_eq!(process.to_string(), "pid 42 (driver) uid 0");
        assert_eq!(Process::default().to_string(), "an unknown process");
    }

    #[test]
    fn a_creator_that_is_the_server_is_the_server_and_another_is_read_on_its_own() {
        let resolver = Resolver::new(Path::new("/nonexistent-proc"), None);
        let server = Arc::new(Process {
            pid: Some(42),
            uid: Some(0),
            gid: Some(0),
            command: Some("driver".into()),
            cgroup: None,
            pidfs_ino: None,
        });
        let fanotify = Actor {
            pid: 42,
            ..Actor::default()
        };
        assert!(Arc::ptr_eq(
            &resolver.creator(&fanotify, Some(&server)),
            &server
        ));
        let launcher = Actor {
            pid: 41,
            uid: Some(0),
            comm: Some(Comm(*b"launcher\0\0\0\0\0\0\0\0")),
            ..Actor::default()
        };
        let other = resolver.creator(&launcher, Some(&server));
        assert_eq!(other.pid, Some(41));
        assert_eq!(
            other.command.as_deref(),
            Some("launcher"),
            "gone: the kernel's record"
        );
        let elsewhere = Actor {
            pid: 42,
            cgroup_id: Some(7),
            ..Actor::default()
        };
        assert!(
            !Arc::ptr_eq(&resolver.creator(&elsewhere, Some(&server)), &server),
            "the same pid in another cgroup than the server's is not taken on trust"
        );
    }

    #[test]
    fn a_server_is_read_once_per_identity_and_again_for_other_credentials() {
        let resolver = Resolver::default();
        let me = std::process::id();
        let (uid, gid) = (
            nix::unistd::getuid().as_raw(),
            nix::unistd::getgid().as_raw(),
        );
        let pidfd = pidfd_of(me);
        let pidfd = Some(pidfd.as_fd());
        let first = resolver.server(Some(9), Some(me), pidfd, uid, gid);
        assert!(Arc::ptr_eq(
            &first,
            &resolver.server(Some(9), Some(me), pidfd, uid, gid)
        ));
        assert!(!Arc::ptr_eq(
            &first,
            &resolver.server(Some(9), Some(me), pidfd, uid + 1, gid)
        ));
        assert!(!Arc::ptr_eq(
            &first,
            &resolver.server(None, Some(me), pidfd, uid, gid)
        ));
        assert_eq!(first.pid, Some(me));
        assert!(first.cgroup.is_some(), "a live server is read from /proc");
    }

    fn pidfd_of(pid: u32) -> std::os::fd::OwnedFd {
        use std::os::fd::FromRawFd;
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        assert!(fd >= 0, "pidfd_open: {}", std::io::Error::last_os_error());
        // SAFETY: a new descriptor that nothing else owns.
        unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) }
    }

    /// A server whose process is gone by the time it is read (its pid free for another process)
    /// keeps only the kernel's credentials: nothing read by its pid is taken as its own. Without
    /// a pidfd at all (the listener's process exited before the connection), nothing is read.
    #[test]
    fn a_server_whose_process_is_gone_is_not_read_by_its_pid() {
        let resolver = Resolver::default();
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("start a short-lived process");
        let pid = child.id();
        let pidfd = pidfd_of(pid);
        child.wait().expect("reap it");
        // Its pid is free now: what /proc says of it is whatever process holds it next. Read as
        // this process's pid, a recycled pid's reading would name this process's cgroup.
        let me = std::process::id();
        let gone = resolver.server(None, Some(me), Some(pidfd.as_fd()), 0, 0);
        assert_eq!(gone.pid, Some(me));
        assert_eq!((gone.uid, gone.gid), (Some(0), Some(0)));
        assert_eq!(
            gone.cgroup, None,
            "nothing read by a pid whose process is gone"
        );
        assert_eq!(gone.command, None);
        let unknown = resolver.server(None, Some(me), None, 0, 0);
        assert_eq!(unknown.cgroup, None, "nothing read without a pidfd");
    }
}
