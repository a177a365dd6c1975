//! Pinned kernel state: the programs' links and the maps the agent uses live in bpffs, one
//! directory per agent instance and watched tree, so they outlive the agent that loaded them.
//!
//! ```text
//! /sys/fs/bpf/plugin-agent/i<instance>/<tree>/set-<n>/  EVENTS WATCHED NAMES LOSSES AGENT  link-<program>-<i>...  META
//!                                                        (maps)                              (keep programs attached)  (pinned last: the commit)
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
//!
//! Whose they are: an instance is named by its runtime directory (the admin socket's, which
//! `runtime_dir::lock` gives one running agent at a time) and that directory's inode, so two
//! agents on one tree (an observer beside a registrar, a host agent beside one in a container)
//! each keep their own set and never adopt or remove the other's, and a restart of the same
//! instance (a container whose runtime directory is a host path included) adopts its own.
//! `pin_owners` judges whose a set is and whether its owner runs; `pin_guard` keeps a running
//! agent's set in place.

use std::path::{Path, PathBuf};

use agent_ebpf::{META_BYTES, names};
use anyhow::{Context, bail};
use aya::maps::{Array, Map, MapData};

use super::fnv::fnv1a;

/// Where every tree's pins live.
pub const PIN_ROOT: &str = "/sys/fs/bpf/plugin-agent";

/// The format of [`Meta`]; a set written in another is never adopted. 2: sets have an owner.
const FORMAT: u32 = 2;

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
    /// The owning instance's runtime directory, as its agent names it (see `pin_owners`).
    #[serde(default)]
    pub runtime_dir: String,
    /// The inode of the owning agent's mount namespace, in which `runtime_dir` and `root` mean
    /// what they say; 0 in a set written before sets had owners.
    #[serde(default)]
    pub mount_ns: u64,
}

impl Meta {
    pub fn new(identity: &Identity, owner: &Owner, family: &str, attached: Vec<String>) -> Meta {
        Meta {
            format: FORMAT,
            object: identity.object.clone(),
            settings: identity.settings.clone(),
            root: owner.tree.display().to_string(),
            family: family.to_owned(),
            attached,
            load_ms: 0,
            runtime_dir: owner.runtime_dir.display().to_string(),
            mount_ns: own_mount_ns(),
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

    pub fn matches(&self, meta: &Meta) -> bool {
        meta.format == FORMAT && meta.object == self.object && meta.settings == self.settings
    }
}

/// Whose pins these are: the agent instance with this runtime directory, watching this tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    /// The watched tree (absolute).
    pub tree: PathBuf,
    /// The instance's runtime directory (absolute), which exists while its agent runs.
    pub runtime_dir: PathBuf,
}

impl Owner {
    /// The pin directory of this instance's sets of this tree.
    pub fn dir(&self) -> PathBuf {
        instance_dir(&self.runtime_dir).join(tree_name(&self.tree))
    }
}

/// The directory of every set of the instance whose runtime directory is `runtime_dir`: its path
/// and its inode (a runtime directory made again is another instance's; `pin_owners` removes
/// the sets its earlier self left).
pub fn instance_dir(runtime_dir: &Path) -> PathBuf {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::MetadataExt;
    let mut key = runtime_dir.as_os_str().as_bytes().to_vec();
    if let Ok(meta) = std::fs::metadata(runtime_dir) {
        key.extend_from_slice(format!("\0{}:{}", meta.dev(), meta.ino()).as_bytes());
    }
    Path::new(PIN_ROOT).join(format!("{INSTANCE_PREFIX}{:016x}", fnv1a(&key)))
}

/// What an instance directory's name starts with; a bare hash is a tree directory of the
/// layout before sets had owners (see `pin_owners::remove_legacy`).
pub const INSTANCE_PREFIX: &str = "i";

/// A tree's directory name within its instance's.
pub fn tree_name(root: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    format!("{:016x}", fnv1a(root.as_os_str().as_bytes()))
}

/// The inode of this process's mount namespace: where the paths it names mean what they say.
pub fn own_mount_ns() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/mnt").map_or(0, |m| m.ino())
}

/// Tells the programs which process is the agent (its own activity is not reported) and that
/// the name table is complete (it is empty: the first walk fills it); returns the map, through
/// which `filters` says when it is not.
pub fn set_agent(mut agent: Array<MapData, u32>) -> anyhow::Result<Array<MapData, u32>> {
    agent
        .set(agent_ebpf::agent::TGID, std::process::id(), 0)
        .context("cannot write the agent's tgid to the AGENT map")?;
    agent
        .set(agent_ebpf::agent::NAMES_INCOMPLETE, 0, 0)
        .context("cannot write the AGENT map")?;
    Ok(agent)
}

/// Pins `ebpf`'s maps and `links` as a new set of `dir` with `meta` as its commit, then removes
/// the other sets of `dir` (detaching their programs: these are attached already). Returns the
/// new set's directory.
pub fn pin(
    ebpf: &mut aya::Ebpf,
    links: Vec<(String, aya::programs::links::FdLink)>,
    dir: &Path,
    meta: &Meta,
) -> anyhow::Result<PathBuf> {
    ensure_bpffs()?;
    let others = sets_of(dir);
    let set = new_set(dir)?;
    if let Err(e) = pin_into(ebpf, links, &set, meta) {
        remove_set(&set);
        return Err(e);
    }
    for other in &others {
        remove_set(other);
    }
    Ok(set)
}

/// Makes a new, empty set directory in `dir`, named by the time (newest sorts last).
pub fn new_set(dir: &Path) -> anyhow::Result<PathBuf> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let set = dir.join(format!("set-{nanos:024}"));
    std::fs::create_dir_all(&set)
        .with_context(|| format!("cannot create the pin directory {}", set.display()))?;
    Ok(set)
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
    write_meta(
        ebpf.map_mut(names::META)
            .context("the eBPF object has no map META")?,
        meta,
    )?;
    // Last: the set is complete from here on.
    ebpf.map(names::META)
        .context("the eBPF object has no map META")?
        .pin(set.join(names::META))
        .context("cannot pin map META")
}

/// Writes `meta` into a set's META map.
pub fn write_meta(map: &mut Map, meta: &Meta) -> anyhow::Result<()> {
    let bytes = serde_json::to_vec(meta)?;
    if bytes.len() > META_BYTES {
        bail!("pin metadata is {} bytes, over {META_BYTES}", bytes.len());
    }
    let mut value = [0u8; META_BYTES];
    value[..bytes.len()].copy_from_slice(&bytes);
    let mut array: Array<&mut MapData, [u8; META_BYTES]> = map.try_into()?;
    array.set(0, value, 0).context("cannot write META")
}

/// The metadata of the set in `set`, if it is complete.
pub fn read_meta(set: &Path) -> anyhow::Result<Meta> {
    let data = MapData::from_pin(set.join(names::META))?;
    let array: Array<MapData, [u8; META_BYTES]> = Map::Array(data).try_into()?;
    let value = array.get(&0, 0)?;
    let len = value.iter().position(|b| *b == 0).unwrap_or(META_BYTES);
    Ok(serde_json::from_slice(&value[..len])?)
}

/// The sets (sub-directories) of `dir`.
pub fn sets_of(dir: &Path) -> Vec<PathBuf> {
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

/// Unpins a set: its links go, so its programs detach (unless a running agent holds them, see
/// `pin_guard`); its maps go with the last user.
pub fn remove_set(set: &Path) {
    if let Err(e) = std::fs::remove_dir_all(set) {
        tracing::warn!(pins = %set.display(), error = %e, "cannot remove pinned eBPF programs and maps");
    }
}

/// Makes sure bpffs is mounted at `/sys/fs/bpf` (systemd mounts it on most nodes; mounting it
/// needs CAP_SYS_ADMIN, which the privileged DaemonSet has).
pub fn ensure_bpffs() -> anyhow::Result<()> {
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
        let owner = Owner {
            tree: "/var/lib/kubelet/plugins_registry".into(),
            runtime_dir: "/run/plugin-agent".into(),
        };
        Meta::new(
            identity,
            &owner,
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
    fn each_instance_and_tree_has_its_own_directory() {
        let runtime = tempfile::tempdir().expect("tempdir");
        let owner = |tree: &str, runtime_dir: &Path| Owner {
            tree: tree.into(),
            runtime_dir: runtime_dir.to_path_buf(),
        };
        let a = owner("/var/lib/kubelet/plugins_registry", runtime.path()).dir();
        let b = owner("/var/lib/kubelet/plugins_registry2", runtime.path()).dir();
        assert_ne!(a, b);
        assert!(a.starts_with(PIN_ROOT));
        assert_eq!(
            a,
            owner("/var/lib/kubelet/plugins_registry", runtime.path()).dir()
        );
        // Another agent's runtime directory is another instance.
        let other = tempfile::tempdir().expect("tempdir");
        assert_ne!(
            a,
            owner("/var/lib/kubelet/plugins_registry", other.path()).dir()
        );
    }
}
