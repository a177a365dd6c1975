//! Where the host's cgroup v2 tree is, and how the agent's `/proc/PID/cgroup` reads map onto it.
//!
//! `/proc/PID/cgroup` is written relative to the reader's cgroup namespace. In a container with
//! a namespace of its own (containerd's default on cgroup v2 nodes), a plugin in another pod reads
//! `0::/../../kubepods/...`: a path that names no pod and matches no directory. Joining the host's
//! namespace is not an option (`setns` needs ptrace rights over the host's init, which a
//! least-privilege pod does not have). The DaemonSet mounts the host's `/sys/fs/cgroup` instead:
//! `/proc/self/mountinfo` shows that mount's root as `/..` repeated once per level the agent's
//! namespace root sits below the host's, the one directory at that depth whose `cgroup.procs`
//! lists the agent is that root, and every relative path resolves against it.

use std::path::{Path, PathBuf};

/// The host's cgroup v2 tree as the agent reaches it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupView {
    /// Where the tree's root is mounted here.
    pub root: PathBuf,
    /// The agent's cgroup namespace root as the host names it (`/` outside a namespace); `None`
    /// when it could not be found, and relative paths stay as read.
    namespace_root: Option<String>,
}

impl CgroupView {
    /// A tree mounted at `root`, read from outside any cgroup namespace.
    pub fn at(root: PathBuf) -> CgroupView {
        CgroupView {
            root,
            namespace_root: Some("/".into()),
        }
    }

    /// The highest cgroup v2 mount in the agent's mount namespace (`/sys/fs/cgroup` on a
    /// unified host, `/sys/fs/cgroup/unified` on a hybrid one, the host's own bind-mounted into a
    /// pod), from `/proc/self/mountinfo`, and the agent's namespace root within it.
    pub fn discover() -> Option<CgroupView> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
        let (root, depth) = highest_cgroup2_mount(&mountinfo)?;
        let namespace_root = match depth {
            0 => Some("/".into()),
            _ => find_by_member(&root, depth, std::process::id()),
        };
        Some(CgroupView {
            root,
            namespace_root,
        })
    }

    /// `path` as `/proc/PID/cgroup` gave it, as the host names it; `None` when it is relative to
    /// a namespace root that could not be found.
    pub fn host_path(&self, path: &str) -> Option<String> {
        if !path.split('/').any(|c| c == "..") {
            return match self.namespace_root.as_deref()? {
                "/" => Some(path.to_string()),
                ns => Some(format!("{ns}{}", path.trim_end_matches('/'))),
            };
        }
        let mut parts: Vec<&str> = self
            .namespace_root
            .as_deref()?
            .split('/')
            .filter(|c| !c.is_empty())
            .collect();
        for component in path.split('/').filter(|c| !c.is_empty()) {
            if component == ".." {
                parts.pop()?;
            } else {
                parts.push(component);
            }
        }
        Some(format!("/{}", parts.join("/")))
    }
}

/// The cgroup v2 mount whose root is the host's: shown as `/` outside a namespace and as `/..`
/// segments inside one (a mount of the namespace's own root shows `/` there: the one with the
/// most `..` wins); with how many levels below it the reader's namespace root is.
fn highest_cgroup2_mount(mountinfo: &str) -> Option<(PathBuf, usize)> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let (fields, rest) = line.split_once(" - ")?;
            let fstype = rest.split_whitespace().next()?;
            let mut fields = fields.split_whitespace();
            let root = fields.nth(3)?;
            let mount_point = fields.next()?;
            let ups = root.split('/').filter(|c| !c.is_empty());
            let depth = ups.clone().count();
            (fstype == "cgroup2" && ups.clone().all(|c| c == ".."))
                .then(|| (PathBuf::from(mount_point), depth))
        })
        .max_by_key(|(_, depth)| *depth)
}

/// Directories looked at, at most, when looking for the namespace root.
const MAX_CANDIDATES: usize = 100_000;

/// The directory `depth` levels below `root` whose `cgroup.procs` lists `pid`, as a path from
/// `root`: the agent's own cgroup, its namespace's root while it has not moved.
fn find_by_member(root: &Path, depth: usize, pid: u32) -> Option<String> {
    let mut level = vec![root.to_path_buf()];
    for _ in 0..depth {
        level = level
            .iter()
            .filter_map(|dir| std::fs::read_dir(dir).ok())
            .flat_map(|entries| entries.flatten())
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.path())
            .take(MAX_CANDIDATES)
            .collect();
    }
    let wanted = pid.to_string();
    level.into_iter().find_map(|dir| {
        let procs = std::fs::read_to_string(dir.join("cgroup.procs")).ok()?;
        procs.lines().any(|p| p == wanted).then(|| {
            let below = dir.strip_prefix(root).ok()?;
            Some(format!("/{}", below.display()))
        })?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
30 25 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n\
41 30 0:26 /../../.. /host/cgroup ro - cgroup2 cgroup2 rw\n\
42 25 0:27 / /sys/fs/bpf rw - bpf bpf rw\n";

    #[test]
    fn the_hosts_tree_is_the_mount_with_the_most_levels_above_the_namespace() {
        assert_eq!(
            highest_cgroup2_mount(MOUNTINFO),
            Some((PathBuf::from("/host/cgroup"), 3))
        );
        let host = "28 1 0:26 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n";
        assert_eq!(
            highest_cgroup2_mount(host),
            Some((PathBuf::from("/sys/fs/cgroup/unified"), 0))
        );
        let pod_own = "28 1 0:26 /kubepods/x / rw - cgroup2 cgroup2 rw\n";
        assert_eq!(highest_cgroup2_mount(pod_own), None);
    }

    #[test]
    fn relative_paths_resolve_against_the_namespace_root() {
        let view = CgroupView {
            root: "/sys/fs/cgroup".into(),
            namespace_root: Some("/kubepods/burstable/podA/ctr".into()),
        };
        assert_eq!(
            view.host_path("/../../../besteffort/podB/ctr").as_deref(),
            Some("/kubepods/besteffort/podB/ctr")
        );
        assert_eq!(
            view.host_path("/../../../../system.slice").as_deref(),
            Some("/system.slice")
        );
        assert_eq!(
            view.host_path("/").as_deref(),
            Some("/kubepods/burstable/podA/ctr")
        );
        assert_eq!(
            view.host_path("/../../../../../above"),
            None,
            "above the root"
        );
        let host = CgroupView::at("/sys/fs/cgroup".into());
        assert_eq!(host.host_path("/a/b").as_deref(), Some("/a/b"));
        let lost = CgroupView {
            namespace_root: None,
            ..host
        };
        assert_eq!(lost.host_path("/../x"), None);
    }

    #[test]
    fn the_namespace_root_is_the_directory_at_its_depth_listing_the_agent() {
        let root = tempfile::tempdir().expect("tempdir");
        for dir in ["a/b", "a/c", "d/e"] {
            std::fs::create_dir_all(root.path().join(dir)).expect("mkdir");
            std::fs::write(root.path().join(dir).join("cgroup.procs"), "1\n2\n").expect("write");
        }
        std::fs::write(root.path().join("a/c/cgroup.procs"), "7\n42\n").expect("write");
        assert_eq!(find_by_member(root.path(), 2, 42).as_deref(), Some("/a/c"));
        assert_eq!(find_by_member(root.path(), 2, 43), None);
    }
}
