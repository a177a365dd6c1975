//! Real cgroup v2 children for the tests that need a plugin in a known cgroup: created under
//! the cgroup v2 mount (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified` on a hybrid host), a
//! plugin process moved in by the harness, removed when dropped.

use std::path::{Path, PathBuf};

/// A cgroup v2 the test made; removed (once empty) when dropped.
#[derive(Debug)]
pub struct TestCgroup {
    /// Its directory under the cgroup v2 mount.
    dir: PathBuf,
    /// Its path as `/proc/PID/cgroup` shows it (from the v2 root).
    path: String,
}

impl TestCgroup {
    /// A new child of the root cgroup, named after the test and `label`;
    /// `None` where cgroup v2 is not mounted or not writable (the caller skips, or fails
    /// under `CI=true`).
    pub fn new(label: &str) -> Option<TestCgroup> {
        let root = cgroup2_mount()?;
        let name = format!(
            "plugin-agent-test-{}-{}-{label}",
            std::process::id(),
            crate::test_name().replace("::", "-")
        );
        let dir = root.join(&name);
        if let Err(e) = std::fs::create_dir(&dir) {
            eprintln!("cannot create cgroup {}: {e}", dir.display());
            return None;
        }
        Some(TestCgroup {
            dir,
            path: format!("/{name}"),
        })
    }

    /// The path `/proc/PID/cgroup` shows for a process in it.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Its `cgroup.procs`, where writing a pid moves that process in.
    pub fn procs_file(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    /// Its id: the directory's inode number (what `bpf_get_current_cgroup_id` returns).
    pub fn id(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(&self.dir).map_or(0, |m| m.ino())
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // Processes still in it (a plugin being killed) keep it busy for a moment.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() || !self.dir.exists() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        eprintln!("cgroup {} left behind: still in use", self.dir.display());
    }
}

/// Where cgroup v2 is mounted, from `/proc/self/mountinfo`.
fn cgroup2_mount() -> Option<PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    mountinfo.lines().find_map(|line| {
        let (fields, rest) = line.split_once(" - ")?;
        let fstype = rest.split_whitespace().next()?;
        let mut fields = fields.split_whitespace();
        let root = fields.nth(3)?;
        let mount_point = fields.next()?;
        (fstype == "cgroup2" && root == "/").then(|| Path::new(mount_point).to_path_buf())
    })
}

/// Moves the calling process into the cgroup whose `cgroup.procs` is `procs` (writing "0" names
/// the writer). Runs between fork and exec.
pub fn join_cgroup(procs: &std::ffi::CStr) -> std::io::Result<()> {
    // SAFETY: open, write and close with valid pointers and lengths.
    unsafe {
        let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let written = libc::write(fd, b"0".as_ptr().cast(), 1);
        let error = std::io::Error::last_os_error();
        libc::close(fd);
        if written != 1 {
            return Err(error);
        }
    }
    Ok(())
}
