//! Is a kubelet running on this node, and which registration directory does it watch? Read from
//! `/proc`, with no call to any API: a process whose command name is `kubelet`, its `--root-dir`
//! flag (default `/var/lib/kubelet`), and so its `<root-dir>/plugins_registry`. The root
//! directory is a command-line flag only: kubelet's configuration file (`--config`,
//! `KubeletConfiguration`) has no field for it, so the command line is the whole answer.

use std::path::{Path, PathBuf};

/// kubelet's default `--root-dir`.
pub const DEFAULT_ROOT_DIR: &str = "/var/lib/kubelet";

/// A running kubelet and the registration directory its plugin manager watches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunningKubelet {
    /// Its process id.
    pub pid: u32,
    /// `<root-dir>/plugins_registry`.
    pub plugins_registry: PathBuf,
    /// `--root-dir`, or `default` when the flag is not given.
    pub root_dir_from: &'static str,
}

/// Every running kubelet (normally none or one), from `proc` (`/proc`).
pub fn running(proc: &Path) -> Vec<RunningKubelet> {
    let Ok(entries) = std::fs::read_dir(proc) else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let comm = std::fs::read_to_string(entry.path().join("comm")).ok()?;
            if comm.trim_end() != "kubelet" {
                return None;
            }
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let args: Vec<String> = cmdline
                .split(|b| *b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            let (root, from) = match root_dir(&args) {
                Some(root) => (root, "--root-dir"),
                None => (PathBuf::from(DEFAULT_ROOT_DIR), "default"),
            };
            Some(RunningKubelet {
                pid,
                plugins_registry: root.join("plugins_registry"),
                root_dir_from: from,
            })
        })
        .collect()
}

/// The `--root-dir` of a kubelet command line (`--root-dir=X`, `--root-dir X`; the last wins).
fn root_dir(args: &[String]) -> Option<PathBuf> {
    let mut root = None;
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let arg = arg.strip_prefix("--").or_else(|| arg.strip_prefix('-'));
        match arg.map(|a| a.split_once('=').unwrap_or((a, ""))) {
            Some(("root-dir", "")) => {
                if let Some(value) = args.next() {
                    root = Some(PathBuf::from(value));
                }
            }
            Some(("root-dir", value)) => root = Some(PathBuf::from(value)),
            _ => {}
        }
    }
    root
}

/// The kubelet among `kubelets` whose registration directory overlaps `plugin_dir` (the same,
/// or one inside the other), if any.
pub fn watching<'a>(
    kubelets: &'a [RunningKubelet],
    plugin_dir: &Path,
) -> Option<&'a RunningKubelet> {
    kubelets.iter().find(|k| {
        plugin_dir.starts_with(&k.plugins_registry) || k.plugins_registry.starts_with(plugin_dir)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<String> {
        line.split(' ').map(String::from).collect()
    }

    #[test]
    fn reads_the_root_dir_flag_in_both_forms_and_defaults_without_it() {
        assert_eq!(root_dir(&args("kubelet --v=2")), None);
        assert_eq!(
            root_dir(&args("kubelet --root-dir=/data/k")),
            Some(PathBuf::from("/data/k"))
        );
        assert_eq!(
            root_dir(&args("kubelet --root-dir /data/k --v=2")),
            Some(PathBuf::from("/data/k"))
        );
    }

    #[test]
    fn finds_a_kubelet_process_in_a_proc_tree() {
        let proc = tempfile::tempdir().expect("tempdir");
        let write = |pid: &str, comm: &str, cmdline: &[&str]| {
            let dir = proc.path().join(pid);
            std::fs::create_dir(&dir).expect("mkdir");
            std::fs::write(dir.join("comm"), format!("{comm}\n")).expect("comm");
            std::fs::write(dir.join("cmdline"), cmdline.join("\0")).expect("cmdline");
        };
        write("1", "systemd", &["/sbin/init"]);
        write(
            "42",
            "kubelet",
            &["/usr/bin/kubelet", "--root-dir=/srv/kubelet"],
        );
        std::fs::create_dir(proc.path().join("self")).expect("not a pid");
        let found = running(proc.path());
        assert_eq!(
            found,
            [RunningKubelet {
                pid: 42,
                plugins_registry: PathBuf::from("/srv/kubelet/plugins_registry"),
                root_dir_from: "--root-dir",
            }]
        );
        assert!(watching(&found, Path::new("/srv/kubelet/plugins_registry")).is_some());
        assert!(watching(&found, Path::new("/srv/kubelet/plugins_registry/sub")).is_some());
        assert!(watching(&found, Path::new("/run/plugin-agent/plugins")).is_none());
    }
}
