//! Pinned kernel state: the programs' links and the maps the agent uses live in bpffs, one
//! directory per watched tree, so they outlive the agent that loaded them.
//!
//! ```text
//! /sys/fs/bpf/plugin-agent/<tree>/set-<n>/  EVENTS WATCHED NAMES LOSSES AGENT  link-<program>-<i>...  META
//!                                            (maps)                              (keep programs attached)  (pinned last: the commit)
//! start: a set whose META says this object and these settings --> adopt: open the maps, write
//!        AGENT (own tgid); no BTF, no verifier, nothing detached, nothing missed in between
//!        else --> load, attach, pin a new set, then remove the others (their programs detach)
//! ```
//!
//! Why: loading costs hundreds of milliseconds (BTF, the verifier) and, before this, every agent
//! exit detached the programs, so a restart was a window in which the kernel recorded nothing and
//! plugins made in it waited for the new agent's walk. Adopted programs never stopped recording
//! (into the same ring, which the new agent drains). A set is complete once its `META` map is
//! pinned, so a crash mid-pin leaves an incomplete set that the next start removes. Removing a
//! set's directory unpins its links, which detaches its programs: `plugin-agent cleanup` does
//! that for good; stopping the agent does not.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agent_ebpf::{DirKey, META_BYTES, names};
use anyhow::{Context, bail};
use aya::maps::{Array, HashMap as BpfHashMap, Map, MapData};

use super::fnv::fnv1a;
use super::ring::Ring;

/// Where every tree's pins live.
pub const PIN_ROOT: &str = "/sys/fs/bpf/plugin-agent";

/// The format of [`Meta`]; a set written in another is never adopted.
const FORMAT: u32 = 1;

/// The maps userspace opens from a set (the others are the programs' own, kept by them).
const PINNED_MAPS: [&str; 5] = [
    names::EVENTS,
    names::WATCHED,
    names::NAMES,
    names::LOSSES,
    names::AGENT,
];

/// What an adopting agent checks, and what it needs that the loader computed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Meta {
    format: u32,
    /// Hash of the kernel object's bytes: another object (an upgrade) is loaded anew.
    pub object: String,
    /// The settings the maps and programs were made with (sizes, wake-up tuning, hook choice).
    pub settings: String,
    /// The watched tree, so stale sets of trees that are gone can be found and removed.
    pub root: String,
    /// The hook family attached (`fentry` or `tracepoints`).
    pub family: String,
    /// What is attached, for `describe`.
    pub attached: Vec<String>,
    /// How long the original load took (what adopting saves).
    pub load_ms: u64,
}

impl Meta {
    pub fn new(identity: &Identity, root: &Path, family: &str, attached: Vec<String>) -> Meta {
        Meta {
            format: FORMAT,
            object: identity.object.clone(),
            settings: identity.settings.clone(),
            root: root.display().to_string(),
            family: family.to_owned(),
            attached,
            load_ms: 0,
        }
    }
}

/// What must match for a set to be adopted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub object: String,
    pub settings: String,
}

impl Identity {
    /// The object's hash (see `loader::object_hash`) and the settings it was loaded with.
    pub fn new(object_hash: &str, settings: String) -> Identity {
        Identity {
            object: object_hash.to_owned(),
            settings,
        }
    }

    fn matches(&self, meta: &Meta) -> bool {
        meta.format == FORMAT && meta.object == self.object && meta.settings == self.settings
    }
}

/// The pin directory of the tree at `root`.
pub fn tree_dir(root: &Path) -> PathBuf {
    use std::os::unix::ffi::OsStrExt;
    Path::new(PIN_ROOT).join(format!("{:016x}", fnv1a(root.as_os_str().as_bytes())))
}

/// The maps of an adopted set, and what the loader that made it computed.
pub struct Adopted {
    pub events: Ring,
    pub watched: BpfHashMap<MapData, DirKey, u8>,
    pub names: super::name_holders::NameTable,
    pub losses: Array<MapData, u64>,
    pub meta: Meta,
    /// Time to find and open the set.
    pub opened_in: Duration,
}

/// Adopts the set of `dir` made with `identity`, if there is one; removes every other set of
/// `dir` only when one is adopted (a failed adoption leaves them for the load that follows,
/// which replaces them).
pub fn adopt(dir: &Path, identity: &Identity) -> anyhow::Result<Option<Adopted>> {
    let started = Instant::now();
    let mut sets = sets_of(dir);
    // Newest first: the set names carry their creation time.
    sets.sort();
    sets.reverse();
    for set in &sets {
        let Ok(meta) = read_meta(set) else { continue };
        if !identity.matches(&meta) {
            continue;
        }
        let open = |name: &str| -> anyhow::Result<Map> {
            let data = MapData::from_pin(set.join(name))
                .with_context(|| format!("cannot open pinned map {}", set.join(name).display()))?;
            Ok(match name {
                names::EVENTS => Map::RingBuf(data),
                names::WATCHED | names::NAMES => Map::HashMap(data),
                _ => Map::Array(data),
            })
        };
        let agent: Array<MapData, u32> = open(names::AGENT)?.try_into()?;
        let adopted = Adopted {
            events: Ring::from_map(open(names::EVENTS)?)?,
            watched: open(names::WATCHED)?.try_into()?,
            names: open(names::NAMES)?.try_into()?,
            losses: open(names::LOSSES)?.try_into()?,
            meta,
            opened_in: Duration::ZERO,
        };
        set_agent(agent)?;
        for other in sets.iter().filter(|s| *s != set) {
            remove_set(other);
        }
        return Ok(Some(Adopted {
            opened_in: started.elapsed(),
            ..adopted
        }));
    }
    Ok(None)
}

/// Tells the programs which process is the agent (its own activity is not reported).
pub fn set_agent(mut agent: Array<MapData, u32>) -> anyhow::Result<()> {
    agent
        .set(0, std::process::id(), 0)
        .context("cannot write the agent's tgid to the AGENT map")
}

/// Pins `ebpf`'s maps and `links` as a new set of `dir` with `meta` as its commit, then removes
/// the other sets of `dir` (detaching their programs: these are attached already).
pub fn pin(
    ebpf: &mut aya::Ebpf,
    links: Vec<(String, aya::programs::links::FdLink)>,
    dir: &Path,
    meta: &Meta,
) -> anyhow::Result<()> {
    ensure_bpffs()?;
    let others = sets_of(dir);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let set = dir.join(format!("set-{nanos:024}"));
    std::fs::create_dir_all(&set)
        .with_context(|| format!("cannot create the pin directory {}", set.display()))?;
    let pinned = pin_into(ebpf, links, &set, meta);
    if pinned.is_err() {
        remove_set(&set);
        return pinned;
    }
    for other in &others {
        remove_set(other);
    }
    Ok(())
}

fn pin_into(
    ebpf: &mut aya::Ebpf,
    links: Vec<(String, aya::programs::links::FdLink)>,
    set: &Path,
    meta: &Meta,
) -> anyhow::Result<()> {
    for name in PINNED_MAPS {
        ebpf.map(name)
            .with_context(|| format!("the eBPF object has no map {name}"))?
            .pin(set.join(name))
            .with_context(|| format!("cannot pin map {name}"))?;
    }
    for (name, link) in links {
        link.pin(set.join(&name))
            .with_context(|| format!("cannot pin link {name}"))?;
    }
    let bytes = serde_json::to_vec(meta)?;
    if bytes.len() > META_BYTES {
        bail!("pin metadata is {} bytes, over {META_BYTES}", bytes.len());
    }
    let mut value = [0u8; META_BYTES];
    value[..bytes.len()].copy_from_slice(&bytes);
    let map = ebpf
        .map_mut(names::META)
        .context("the eBPF object has no map META")?;
    let mut array: Array<&mut MapData, [u8; META_BYTES]> = map.try_into()?;
    array.set(0, value, 0).context("cannot write META")?;
    // Last: the set is complete from here on.
    ebpf.map(names::META)
        .context("the eBPF object has no map META")?
        .pin(set.join(names::META))
        .context("cannot pin map META")
}

fn read_meta(set: &Path) -> anyhow::Result<Meta> {
    let data = MapData::from_pin(set.join(names::META))?;
    let array: Array<MapData, [u8; META_BYTES]> = Map::Array(data).try_into()?;
    let value = array.get(&0, 0)?;
    let len = value.iter().position(|b| *b == 0).unwrap_or(META_BYTES);
    Ok(serde_json::from_slice(&value[..len])?)
}

/// The sets (sub-directories) of `dir`.
fn sets_of(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default()
}

/// Unpins a set: its links go, so its programs detach; its maps go with the last user.
fn remove_set(set: &Path) {
    if let Err(e) = std::fs::remove_dir_all(set) {
        tracing::warn!(pins = %set.display(), error = %e, "cannot remove pinned eBPF programs and maps");
    }
}

/// Removes the pins of the tree at `root` (its programs detach); returns whether there were any.
pub fn remove_tree(root: &Path) -> anyhow::Result<bool> {
    let dir = tree_dir(root);
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e).with_context(|| format!("cannot remove {}", dir.display())),
    }
}

/// Removes every tree's pins; returns the trees' directories removed.
pub fn remove_all() -> anyhow::Result<Vec<PathBuf>> {
    remove_trees(|_| true)
}

/// Removes the pins of trees whose watched directory no longer exists (a test's temporary tree,
/// a driver's uninstalled directory), so their programs stop running on every syscall.
pub fn remove_orphans() -> Vec<PathBuf> {
    remove_trees(|sets| {
        sets.iter()
            .filter_map(|set| read_meta(set).ok())
            .all(|meta| !Path::new(&meta.root).exists())
    })
    .unwrap_or_default()
}

fn remove_trees(remove: impl Fn(&[PathBuf]) -> bool) -> anyhow::Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    let entries = match std::fs::read_dir(PIN_ROOT) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(removed),
        Err(e) => return Err(e).with_context(|| format!("cannot read {PIN_ROOT}")),
    };
    for dir in entries.filter_map(Result::ok).map(|e| e.path()) {
        let sets = sets_of(&dir);
        if !sets.is_empty() && remove(&sets) {
            std::fs::remove_dir_all(&dir)
                .with_context(|| format!("cannot remove {}", dir.display()))?;
            removed.push(dir);
        }
    }
    Ok(removed)
}

/// Makes sure bpffs is mounted at `/sys/fs/bpf` (systemd mounts it on most nodes; mounting it
/// needs CAP_SYS_ADMIN, which the privileged DaemonSet has).
fn ensure_bpffs() -> anyhow::Result<()> {
    let bpffs = Path::new("/sys/fs/bpf");
    if is_bpffs(bpffs) {
        return Ok(());
    }
    nix::mount::mount(
        Some("bpf"),
        bpffs,
        Some("bpf"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .context("bpffs is not mounted at /sys/fs/bpf and mounting it failed")?;
    tracing::info!("bpffs was not mounted: mounted it at /sys/fs/bpf to pin the eBPF programs");
    Ok(())
}

fn is_bpffs(path: &Path) -> bool {
    nix::sys::statfs::statfs(path)
        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::BPF_FS_MAGIC)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(identity: &Identity) -> Meta {
        Meta::new(
            identity,
            Path::new("/var/lib/kubelet/plugins_registry"),
            "tracepoints",
            vec!["tracepoint syscalls/sys_enter_bind".into()],
        )
    }

    #[test]
    fn a_set_is_adopted_only_with_the_same_object_and_settings() {
        let identity = Identity::new("0123456789abcdef", "ring=2097152".into());
        assert!(identity.matches(&meta(&identity)));
        let upgraded = Identity::new("fedcba9876543210", "ring=2097152".into());
        assert!(!upgraded.matches(&meta(&identity)));
        let resized = Identity::new("0123456789abcdef", "ring=4194304".into());
        assert!(!resized.matches(&meta(&identity)));
        let mut old_format = meta(&identity);
        old_format.format = FORMAT + 1;
        assert!(!identity.matches(&old_format));
    }

    #[test]
    fn metadata_fits_its_map_value() {
        let identity = Identity::new("0123456789abcdef", "x".repeat(200));
        let mut meta = meta(&identity);
        meta.attached = (0..30)
            .map(|i| format!("tracepoint syscalls/sys_enter_renameat{i}"))
            .collect();
        assert!(serde_json::to_vec(&meta).expect("json").len() < META_BYTES);
    }

    #[test]
    fn each_tree_has_its_own_directory() {
        let a = tree_dir(Path::new("/var/lib/kubelet/plugins_registry"));
        let b = tree_dir(Path::new("/var/lib/kubelet/plugins_registry2"));
        assert_ne!(a, b);
        assert!(a.starts_with(PIN_ROOT));
        assert_eq!(a, tree_dir(Path::new("/var/lib/kubelet/plugins_registry")));
    }
}
