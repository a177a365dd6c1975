//! Whose a set of pins is, and whether its owner runs: what decides who may remove it.
//!
//! A set's META names its owner: the instance's runtime directory and the mount namespace in
//! which that path (and the tree's) mean what they say. Removing a set detaches the programs of
//! an agent that does not hold them, so nobody removes a set on a guess:
//!
//! ```text
//! at an agent's start (own mount namespace only; "not at all" elsewhere):
//!   another tree of this instance ........................ remove (this runtime directory is ours)
//!   a set of an earlier incarnation of this runtime dir .. remove (same path, directory made again)
//!   the tree is gone and the owner does not run .......... remove (a test's tree, an uninstalled driver)
//!   the layout before sets had owners .................... remove if its tree is ours or gone
//! cleanup: its own instance's (it holds that lock, or --force); others' only when their owner
//!   does not run (judged in the owner's namespace), or with --force
//! ```
//!
//! "Does the owner run" is its runtime directory's lock (see `runtime_dir`), reached in the
//! owner's mount namespace through `/proc/<pid>/root` of a process that lives in it; a namespace
//! with no process left has no agent in it.

use std::path::{Path, PathBuf};

use anyhow::Context;

use super::pins::{self, INSTANCE_PREFIX, Meta, Owner, PIN_ROOT};

/// The sets of one tree of one instance (or of the layout before owners).
struct Tree {
    dir: PathBuf,
    /// Its newest complete set's metadata; none while only incomplete sets are there.
    meta: Option<Meta>,
    /// The layout before sets had owners: `PIN_ROOT/<tree>/set-*`.
    legacy: bool,
}

/// Every tree directory under [`PIN_ROOT`].
fn trees() -> anyhow::Result<Vec<Tree>> {
    let entries = match std::fs::read_dir(PIN_ROOT) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("cannot read {PIN_ROOT}")),
    };
    let mut trees = Vec::new();
    for top in entries.filter_map(Result::ok) {
        let name = top.file_name();
        let is_instance = name.to_string_lossy().starts_with(INSTANCE_PREFIX);
        let dirs = if is_instance {
            pins::sets_of(&top.path())
        } else {
            vec![top.path()]
        };
        trees.extend(dirs.into_iter().map(|dir| Tree {
            meta: newest_meta(&dir),
            dir,
            legacy: !is_instance,
        }));
    }
    Ok(trees)
}

fn newest_meta(tree: &Path) -> Option<Meta> {
    let mut sets = pins::sets_of(tree);
    sets.sort();
    sets.iter().rev().find_map(|set| pins::read_meta(set).ok())
}

/// Whether the agent that owns `meta`'s set runs, judged in its own mount namespace.
fn owner_runs(meta: &Meta) -> bool {
    let lock_file = Path::new(&meta.runtime_dir).join(crate::runtime_dir::LOCK_FILE);
    if meta.mount_ns == pins::own_mount_ns() {
        return crate::runtime_dir::is_held(&lock_file);
    }
    match process_in_mount_ns(meta.mount_ns) {
        Some(pid) => {
            let relative = lock_file.strip_prefix("/").unwrap_or(&lock_file);
            crate::runtime_dir::is_held(&Path::new("/proc").join(pid).join("root").join(relative))
        }
        None => false,
    }
}

/// A process that lives in the mount namespace with inode `ns`, if any does.
fn process_in_mount_ns(ns: u64) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir("/proc")
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.bytes().all(|b| b.is_ascii_digit()))
        .find(|pid| std::fs::metadata(format!("/proc/{pid}/ns/mnt")).is_ok_and(|m| m.ino() == ns))
}

fn remove(dir: &Path) -> anyhow::Result<()> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("cannot remove {}", dir.display())),
    }
}

/// Removes instance directories left empty (a failure is another agent pinning into one now).
fn remove_empty_instances() {
    let Ok(entries) = std::fs::read_dir(PIN_ROOT) else {
        return;
    };
    for top in entries.filter_map(Result::ok) {
        if top
            .file_name()
            .to_string_lossy()
            .starts_with(INSTANCE_PREFIX)
        {
            let _ = std::fs::remove_dir(top.path());
        }
    }
}

/// At the start of `own`'s agent: removes the sets nobody will use again, judged only in this
/// mount namespace (see the module's table); returns the trees removed.
pub fn remove_orphans(own: &Owner) -> Vec<PathBuf> {
    let own_dir = own.dir();
    let own_instance = pins::instance_dir(&own.runtime_dir);
    let own_ns = pins::own_mount_ns();
    let own_runtime = own.runtime_dir.display().to_string();
    let orphan = |tree: &Tree| -> bool {
        if tree.dir == own_dir {
            return false;
        }
        if tree.dir.starts_with(&own_instance) {
            return true;
        }
        let Some(meta) = &tree.meta else {
            return false;
        };
        let tree_gone = !Path::new(&meta.root).exists();
        if tree.legacy {
            return tree_gone || Path::new(&meta.root) == own.tree;
        }
        meta.mount_ns == own_ns
            && (meta.runtime_dir == own_runtime || (tree_gone && !owner_runs(meta)))
    };
    let mut removed = Vec::new();
    for tree in trees().unwrap_or_default() {
        if orphan(&tree) {
            match remove(&tree.dir) {
                Ok(()) => removed.push(tree.dir),
                Err(e) => {
                    tracing::warn!(error = format!("{e:#}"), "cannot remove orphaned eBPF pins")
                }
            }
        }
    }
    remove_empty_instances();
    removed
}

/// What `cleanup` did with each tree's pins.
#[derive(Debug, Default)]
pub struct Cleanup {
    /// Removed: the tree directory and the tree it watched.
    pub removed: Vec<(PathBuf, String)>,
    /// Kept, and why.
    pub kept: Vec<(PathBuf, String)>,
}

/// Removes the pins of `own` (its instance's sets of its tree, and the layout before owners').
/// The caller holds the instance's runtime lock, or was told to force.
pub fn remove_own(own: &Owner) -> anyhow::Result<Cleanup> {
    let mut done = Cleanup::default();
    let legacy = Path::new(PIN_ROOT).join(pins::tree_name(&own.tree));
    let own_ns = pins::own_mount_ns();
    let own_runtime = own.runtime_dir.display().to_string();
    let own_tree = own.tree.display().to_string();
    for tree in trees()? {
        let mine = tree.dir == own.dir()
            || tree.dir == legacy
            || tree.meta.as_ref().is_some_and(|meta| {
                meta.mount_ns == own_ns && meta.runtime_dir == own_runtime && meta.root == own_tree
            });
        if mine {
            remove(&tree.dir)?;
            done.removed.push((tree.dir, own_tree.clone()));
        }
    }
    remove_empty_instances();
    Ok(done)
}

/// Removes every tree's pins whose owner does not run (and, with `force`, those of running
/// agents too, which pin theirs again within a second: they hold their programs). `own` is the
/// instance the caller holds the lock of (or forces), whose sets go whatever its lock says.
pub fn remove_all(own_runtime_dir: &Path, force: bool) -> anyhow::Result<Cleanup> {
    let mut done = Cleanup::default();
    let own_instance = pins::instance_dir(own_runtime_dir);
    for tree in trees()? {
        let root = tree
            .meta
            .as_ref()
            .map_or_else(|| "(incomplete set)".to_owned(), |m| m.root.clone());
        let keep = if force || tree.legacy || tree.dir.starts_with(&own_instance) {
            None
        } else {
            match &tree.meta {
                Some(meta) if owner_runs(meta) => Some(format!(
                    "its agent runs (runtime directory {}); stop it first, or --force",
                    meta.runtime_dir
                )),
                Some(_) => None,
                None => Some("an agent may be pinning it now; --force to remove it".to_owned()),
            }
        };
        match keep {
            Some(why) => done.kept.push((tree.dir, format!("{root}: {why}"))),
            None => {
                match remove(&tree.dir) {
                    Ok(()) => done.removed.push((tree.dir, root)),
                    // Its running agent pinned a new set the moment its pins went (see
                    // `pin_guard`): removed, and back.
                    Err(e)
                        if force
                            && e.downcast_ref::<std::io::Error>().is_some_and(|e| {
                                e.kind() == std::io::ErrorKind::DirectoryNotEmpty
                            })
                            && tree.meta.as_ref().is_some_and(owner_runs) =>
                    {
                        done.kept.push((
                            tree.dir,
                            format!(
                                "{root}: removed, and pinned again at once by its running agent"
                            ),
                        ));
                    }
                    Err(e) => return Err(e),
                }
            }
        }
    }
    remove_empty_instances();
    Ok(done)
}
