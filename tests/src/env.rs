//! What a test needs from its environment: the binaries, the event source under test, a private
//! plugin directory, and the rules for skipping what this machine cannot run.
//!
//! Skipping is loud and never silent in CI: with `CI=true`, a test that cannot run fails instead.

use std::path::{Path, PathBuf};

/// The event sources every scenario runs against (`--source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// inotify: unprivileged, what kubelet uses.
    Inotify,
    /// fanotify: needs `CAP_SYS_ADMIN`.
    Fanotify,
    /// eBPF: needs root and an agent built with the eBPF object.
    Ebpf,
}

impl Source {
    /// The `--source` value.
    pub fn as_arg(self) -> &'static str {
        match self {
            Source::Inotify => "inotify",
            Source::Fanotify => "fanotify",
            Source::Ebpf => "ebpf",
        }
    }

    /// Whether the source needs root.
    pub fn needs_root(self) -> bool {
        !matches!(self, Source::Inotify)
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_arg())
    }
}

/// True when running under CI (`CI=true`), where a test that cannot run must fail, not skip.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// Reports that a test cannot run here: panics in CI, else prints the reason (so it shows with
/// `--nocapture` and in the test's captured output) and lets the caller return early.
pub fn skip(test: &str, reason: &str) {
    if in_ci() {
        panic!("{test}: cannot run in CI: {reason}");
    }
    eprintln!("SKIPPED {test}: {reason}");
}

/// Whether the test process can do what privileged sources need (root). Calls [`skip`] when not.
pub fn privileged(test: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    skip(
        test,
        "needs root (fanotify and eBPF sources need CAP_SYS_ADMIN / CAP_BPF)",
    );
    false
}

/// The `plugin-agent` binary: `PLUGIN_AGENT_BIN`, else next to the test binary's directory
/// (`target/<profile>/deps/<test>` -> `target/<profile>/plugin-agent`), where a workspace build puts it.
pub fn agent_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("PLUGIN_AGENT_BIN") {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().expect("the test binary knows its own path");
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let bin = dir.join("plugin-agent");
    assert!(
        bin.is_file(),
        "plugin-agent binary not found at {}: build it first (`cargo build -p plugin-agent`, same target dir) \
         or set PLUGIN_AGENT_BIN",
        bin.display()
    );
    bin
}

/// A binary placed where any user may execute it, for a test that runs it as another user: the
/// checkout may be under a directory only its owner can search (`/root`, `mktemp -d`: 0700).
/// A hard link in a fresh 0755 directory under the temp dir (a copy across file systems); it is
/// removed when dropped, so keep it as long as the process started from it may still exec it.
#[derive(Debug)]
pub struct SharedBinary {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl SharedBinary {
    /// Places `bin` (mode 0755, as cargo writes it) in a new directory any user can search.
    pub fn new(bin: &Path) -> SharedBinary {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::Builder::new()
            .prefix("pa-bin-")
            .tempdir()
            .expect("create a temporary directory");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("make the binary's directory searchable by anyone");
        let path = dir
            .path()
            .join(bin.file_name().expect("a binary has a file name"));
        if std::fs::hard_link(bin, &path).is_err() {
            std::fs::copy(bin, &path)
                .unwrap_or_else(|e| panic!("cannot copy {} for another user: {e}", bin.display()));
        }
        SharedBinary { _dir: dir, path }
    }

    /// Where any user can execute it.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// A private plugin registration directory, removed with everything in it when dropped.
///
/// The agent watches `root()`, which does not exist until the agent creates it (kubelet creates
/// its directory too); [`PluginDir::outside`] is a sibling on the same filesystem for sockets
/// that are renamed in and out, and for symlink targets.
#[derive(Debug)]
pub struct PluginDir {
    base: tempfile::TempDir,
}

impl PluginDir {
    /// A new empty base directory under the system temp dir (kept short: socket paths are
    /// limited to 107 bytes).
    pub fn new() -> PluginDir {
        let base = tempfile::Builder::new()
            .prefix("pa-e2e-")
            .tempdir()
            .expect("create a temporary directory");
        std::fs::create_dir(base.path().join("registry")).expect("create the plugin directory");
        std::fs::create_dir(base.path().join("outside")).expect("create the outside directory");
        PluginDir { base }
    }

    /// The directory the agent watches.
    pub fn root(&self) -> PathBuf {
        self.base.path().join("registry")
    }

    /// A path below the watched directory.
    pub fn path(&self, relative: &str) -> PathBuf {
        self.root().join(relative)
    }

    /// A path in a sibling directory the agent does not watch, on the same filesystem.
    pub fn outside(&self, relative: &str) -> PathBuf {
        self.base.path().join("outside").join(relative)
    }
}

impl Default for PluginDir {
    fn default() -> Self {
        PluginDir::new()
    }
}

impl Drop for PluginDir {
    /// An eBPF agent pins its programs for its tree, so they outlive it (see the agent's
    /// `pins`); the tree goes with this value, and so do they: otherwise they would run on every
    /// syscall until the next agent's start removed them as orphans.
    fn drop(&mut self) {
        let pinned = std::fs::read_dir("/sys/fs/bpf/plugin-agent")
            .is_ok_and(|mut entries| entries.next().is_some());
        if pinned {
            let _ = std::process::Command::new(agent_bin())
                .arg("--admin-socket")
                .arg(self.base.path().join("no-admin.sock"))
                .args(["cleanup", "--plugin-dir"])
                .arg(self.root())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
}
