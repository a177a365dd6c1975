//! A running agent keeps its own pins in place.
//!
//! Pins are files in a shared directory that root (another agent's `cleanup`, an operator's
//! `rm -r`) can remove. Before this, the programs' only reference was the pinned link, so a
//! removed set detached the running agent's programs: it saw nothing more and found plugins only
//! by its 30 s safety pass, while `/readyz` said 200. Now the agent holds a descriptor of every
//! object of its set (links and maps), so removing the pins never detaches its programs, and it
//! checks its set whenever something may have changed it:
//!
//! ```text
//! inotify: an entry of the set's directory created, removed or renamed; the set's directory or
//!          one on its way from /sys/fs/bpf removed or renamed (an `rm -r`, a `cleanup --force`)
//! mountinfo POLLPRI: a mount over the set, on its way or under it (a new bpffs hides the pins)
//!   --> read the set's directory (one getdents) --> every pin there with the inode it had?
//!         yes --> nothing
//!         no  --> report the problem (status, /readyz 503), pin every held object again as a new
//!                 set, remove the other sets of the tree, clear the problem; retried each second
//!                 until done
//! ```
//!
//! The wake-ups are hints; the directory read decides. An idle agent is not woken at all; where
//! inotify or the mount table cannot be followed (no instance left, a kernel without them), the
//! set is read once a second instead, as it was before.
//!
//! aya pins a link only by giving the link up, and a failed pin would then close the last
//! descriptor of a link whose pin is gone: the objects are held and pinned here by descriptor,
//! with `bpf(BPF_OBJ_GET)` and `bpf(BPF_OBJ_PIN)`.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::DirEntryExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use agent_ebpf::names;
use anyhow::Context;
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio_util::sync::CancellationToken;

use crate::mounts::MountWatch;

use super::pins;

/// How often the set is checked while it cannot be pinned again, or while its changes cannot be
/// followed: an agent is never blind for more than this without saying so.
pub const CHECK_EVERY: Duration = Duration::from_secs(1);

/// How long after a hint the set is read: the changes of one removal come as many hints.
const SETTLE: Duration = Duration::from_millis(100);

/// The objects of a set, held by descriptor, and the inode each had when pinned.
pub struct Held {
    set: PathBuf,
    /// Every pin of the set by name (META last when pinned again), with its descriptor.
    objects: Vec<(String, OwnedFd)>,
    /// The inode of each pin as this agent last saw or made it.
    inodes: BTreeMap<String, u64>,
}

impl Held {
    /// Opens every pin of the complete set in `set`.
    pub fn open(set: &Path) -> anyhow::Result<Held> {
        let inodes = pinned_inodes(set)
            .with_context(|| format!("cannot read the pin directory {}", set.display()))?;
        anyhow::ensure!(
            inodes.contains_key(names::META),
            "the pin set {} is incomplete (no META)",
            set.display()
        );
        let mut objects = Vec::with_capacity(inodes.len());
        for name in inodes.keys() {
            let fd = obj_get(&set.join(name))
                .with_context(|| format!("cannot open pin {}", set.join(name).display()))?;
            objects.push((name.clone(), fd));
        }
        // META is pinned last: a set is complete once it is there.
        objects.sort_by_key(|(name, _)| name == names::META);
        Ok(Held {
            set: set.to_path_buf(),
            objects,
            inodes,
        })
    }

    /// What is wrong with the set on disk, if anything.
    pub fn check(&self) -> Option<String> {
        let found = match pinned_inodes(&self.set) {
            Ok(found) => found,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Some(format!(
                    "the agent's pinned eBPF programs and maps ({}) were removed",
                    self.set.display()
                ));
            }
            Err(e) => return Some(format!("cannot read {}: {e}", self.set.display())),
        };
        let missing: Vec<&str> = self
            .inodes
            .iter()
            .filter(|(name, inode)| found.get(*name) != Some(inode))
            .map(|(name, _)| name.as_str())
            .collect();
        (!missing.is_empty()).then(|| {
            format!(
                "the agent's pins in {} were removed or replaced: {}",
                self.set.display(),
                missing.join(", ")
            )
        })
    }

    /// Pins every held object again as a new set of `tree_dir`, then removes the tree's other
    /// sets (the damaged one, anything put in its place).
    pub fn pin_again(&mut self, tree_dir: &Path) -> anyhow::Result<()> {
        pins::ensure_bpffs()?;
        let set = pins::new_set(tree_dir)?;
        for (name, fd) in &self.objects {
            let path = set.join(name);
            if let Err(e) = obj_pin(fd, &path) {
                pins::remove_set(&set);
                return Err(e).with_context(|| format!("cannot pin {}", path.display()));
            }
        }
        // What the next checks compare with: read as they read it.
        let inodes = match pinned_inodes(&set) {
            Ok(inodes) => inodes,
            Err(e) => {
                pins::remove_set(&set);
                return Err(e).with_context(|| format!("cannot read {}", set.display()));
            }
        };
        for other in pins::sets_of(tree_dir).iter().filter(|s| **s != set) {
            pins::remove_set(other);
        }
        self.set = set;
        self.inodes = inodes;
        Ok(())
    }
}

/// Checks the set whenever it may have changed (see the module's map) until `cancel`, pinning it
/// again when it is damaged; `report` hears the problem and its end, `restored` counts the sets
/// pinned again.
pub async fn guard(
    mut held: Held,
    tree_dir: PathBuf,
    report: Arc<crate::event_source::ProblemReport>,
    restored: Arc<AtomicU64>,
    cancel: CancellationToken,
) {
    // Followed before the first check: a change between the two wakes the next.
    let mut changes = Changes::follow(&held.set);
    let mut damaged = false;
    loop {
        let problem = held.check();
        if damaged && problem.is_none() {
            // Put right by someone else (a mount over the set gone again).
            tracing::info!(pins = %held.set.display(), "eBPF pins as the agent made them again");
            report.set(None);
            damaged = false;
        }
        if let Some(problem) = problem {
            if !damaged {
                tracing::warn!(%problem, "eBPF pins damaged: the programs stay attached (the agent holds them); pinning them again");
                report.set(Some(problem.clone()));
                damaged = true;
            }
            match held.pin_again(&tree_dir) {
                Ok(()) => {
                    restored.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(pins = %held.set.display(), "eBPF programs and maps pinned again");
                    report.set(None);
                    damaged = false;
                    changes = Changes::follow(&held.set);
                    continue;
                }
                Err(e) => {
                    let problem = format!("{problem}; pinning them again failed: {e:#}");
                    tracing::warn!(%problem, "eBPF pins still damaged: trying again in a second");
                    report.set(Some(problem));
                }
            }
        }
        let poll = damaged || !changes.followed();
        tokio::select! {
            () = cancel.cancelled() => return,
            () = changes.next() => {
                // A removal under way (an `rm -r`, a forced cleanup) finishes first, rather than
                // find the set pinned again beside it.
                tokio::time::sleep(SETTLE).await;
            }
            () = tokio::time::sleep(CHECK_EVERY), if poll => {}
        }
    }
}

/// What may change a pin set: its directory's entries, the directories on its way, the mounts
/// over it. A part that cannot be followed is dropped (with a warning) and the guard polls.
struct Changes {
    entries: Option<AsyncFd<InotifyFd>>,
    mounts: Option<MountWatch>,
}

impl Changes {
    fn follow(set: &Path) -> Changes {
        let entries = match watch_entries(set) {
            Ok(fd) => Some(fd),
            Err(e) => {
                tracing::warn!(error = %e, set = %set.display(), "cannot follow the eBPF pin set with inotify: checking it every second");
                None
            }
        };
        let mounts = match MountWatch::open(set) {
            Ok(mounts) => Some(mounts),
            Err(e) => {
                tracing::warn!(error = %e, "cannot follow mounts over the eBPF pin set (/proc/self/mountinfo): checking it every second");
                None
            }
        };
        Changes { entries, mounts }
    }

    fn followed(&self) -> bool {
        self.entries.is_some() && self.mounts.is_some()
    }

    /// Returns at the next hint that the set may have changed (never, when nothing is followed).
    async fn next(&mut self) {
        let Changes { entries, mounts } = self;
        let entry_changed = async {
            match entries.as_ref() {
                Some(fd) => drain(fd).await,
                None => std::future::pending().await,
            }
        };
        let mount_changed = async {
            match mounts.as_mut() {
                Some(mounts) => mounts.changed().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            read = entry_changed => if let Err(e) = read {
                tracing::warn!(error = %e, "stopped following the eBPF pin set with inotify: checking it every second");
                *entries = None;
            },
            changed = mount_changed => if let Err(e) = changed {
                tracing::warn!(error = %e, "stopped following mounts over the eBPF pin set: checking it every second");
                *mounts = None;
            },
        }
    }
}

/// An inotify instance watching `set`'s entries, and `set` and each directory on its way from
/// the bpffs for their removal or renaming.
fn watch_entries(set: &Path) -> std::io::Result<AsyncFd<InotifyFd>> {
    let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)?;
    let gone = AddWatchFlags::IN_DELETE_SELF
        | AddWatchFlags::IN_MOVE_SELF
        | AddWatchFlags::IN_ONLYDIR
        | AddWatchFlags::IN_DONT_FOLLOW;
    let entries = AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_MOVED_TO;
    inotify.add_watch(set, gone | entries)?;
    let bpffs = Path::new(pins::PIN_ROOT).parent().unwrap_or(Path::new("/"));
    for dir in set
        .ancestors()
        .skip(1)
        .take_while(|dir| dir.starts_with(bpffs))
    {
        inotify.add_watch(dir, gone)?;
    }
    // SAFETY: `InotifyFd` owns the descriptor (inside `Inotify`) and closes it only when the
    // `AsyncFd` is dropped; `as_raw_fd` always returns that same descriptor.
    unsafe { AsyncFd::register_with_interest(InotifyFd(inotify), Interest::READABLE) }
        .map_err(std::io::Error::from)
}

/// Waits for inotify events and reads them all (what they say does not matter: the set is read).
async fn drain(fd: &AsyncFd<InotifyFd>) -> std::io::Result<()> {
    loop {
        let mut ready = fd.readable().await?;
        match ready.try_io(|fd| fd.get_ref().0.read_events().map_err(std::io::Error::from)) {
            Ok(read) => return read.map(drop),
            Err(_would_block) => continue,
        }
    }
}

/// The inotify descriptor, in a form `AsyncFd` accepts.
struct InotifyFd(Inotify);

impl AsRawFd for InotifyFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

/// Every pin in `set` by name, with its inode (from the directory entries: no stat each).
fn pinned_inodes(set: &Path) -> std::io::Result<BTreeMap<String, u64>> {
    std::fs::read_dir(set)?
        .map(|entry| entry.map(|e| (e.file_name().to_string_lossy().into_owned(), e.ino())))
        .collect()
}

/// `union bpf_attr` for BPF_OBJ_PIN and BPF_OBJ_GET (the kernel checks that bytes past what it
/// knows are zero, so the newer `path_fd` is left 0 and this works from 4.4 on).
#[repr(C)]
#[derive(Default)]
struct ObjAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
    path_fd: i32,
    _pad: u32,
}

const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;

fn bpf_obj(cmd: libc::c_long, path: &Path, bpf_fd: u32) -> std::io::Result<libc::c_long> {
    let path = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    let attr = ObjAttr {
        pathname: path.as_ptr() as u64,
        bpf_fd,
        ..ObjAttr::default()
    };
    // SAFETY: `attr` and the path it points to outlive the call; the size is the struct's.
    let result = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            &raw const attr,
            std::mem::size_of::<ObjAttr>(),
        )
    };
    if result < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(result)
    }
}

/// A new descriptor of the object pinned at `path`.
fn obj_get(path: &Path) -> std::io::Result<OwnedFd> {
    let fd = bpf_obj(BPF_OBJ_GET, path, 0)?;
    let fd =
        i32::try_from(fd).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidData))?;
    // SAFETY: the kernel just returned this descriptor, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Pins the object of `fd` at `path`.
fn obj_pin(fd: &OwnedFd, path: &Path) -> std::io::Result<()> {
    let fd = u32::try_from(fd.as_raw_fd())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    bpf_obj(BPF_OBJ_PIN, path, fd).map(drop)
}
