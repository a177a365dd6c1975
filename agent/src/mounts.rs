//! Mounts on the way to a directory or under it, and a wake-up when they change.
//!
//! A file system mounted over a directory (a bind mount, a tmpfs) hides what was there and shows
//! what the new one holds, and no file event says so. Over a sub-directory of the plugin tree:
//! inotify watches the covered directory, fanotify marks the old mount, the eBPF programs saw no
//! socket change, so only a walk finds out. Over the bpffs (or a directory of the agent's pin
//! set): the pins the agent checks are no longer the ones it made. The kernel does announce mount
//! table changes: `/proc/self/mountinfo` polls as `POLLPRI` after each one (the same signal
//! `findmnt --poll` and systemd use). On that wake-up the mount points on the path to the root
//! and under it are read again, and `changed` returns when they differ.
//!
//! ```text
//! mount / umount anywhere -> /proc/self/mountinfo POLLPRI -> read the mount points over root
//!                                                         -> changed: MountWatch::changed returns
//! ```

use std::collections::BTreeSet;
use std::io::{Read, Seek};
use std::path::{Path, PathBuf};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// Where the kernel lists this mount namespace's mounts.
const MOUNTINFO: &str = "/proc/self/mountinfo";

/// Follows the mount points that can hide one directory: it, its ancestors, and below it.
pub struct MountWatch {
    root: PathBuf,
    file: AsyncFd<std::fs::File>,
    over_root: BTreeSet<PathBuf>,
}

impl MountWatch {
    /// Starts following the mounts over `root`.
    pub fn open(root: &Path) -> std::io::Result<MountWatch> {
        let file = std::fs::File::open(MOUNTINFO)?;
        // SAFETY: the `File` owns its descriptor, and it is neither closed nor replaced while
        // the `AsyncFd` holds it.
        let file = unsafe { AsyncFd::register_with_interest(file, Interest::PRIORITY)? };
        let mut watch = MountWatch {
            root: root.to_path_buf(),
            file,
            over_root: BTreeSet::new(),
        };
        // Reading the file is also what re-arms its POLLPRI.
        watch.over_root = watch.read()?;
        Ok(watch)
    }

    /// Returns once the mount points over the root differ from what was last seen
    /// (mounts elsewhere wake it briefly, and it waits on). An error: the file cannot be read
    /// any more (the caller stops following mounts).
    pub async fn changed(&mut self) -> std::io::Result<()> {
        loop {
            let mut ready = self.file.ready(Interest::PRIORITY).await?;
            ready.clear_ready();
            let now = self.read()?;
            if now != self.over_root {
                self.over_root = now;
                return Ok(());
            }
        }
    }

    /// The mount points over the root, as the table says now.
    fn read(&mut self) -> std::io::Result<BTreeSet<PathBuf>> {
        let file = self.file.get_mut();
        file.rewind()?;
        let mut table = String::new();
        file.read_to_string(&mut table)?;
        Ok(mount_points_over(&table, &self.root))
    }
}

/// The mount points in `mountinfo` (the fifth field of each line) that can hide `root`: at or
/// under it, or one of its ancestors.
fn mount_points_over(mountinfo: &str, root: &Path) -> BTreeSet<PathBuf> {
    mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|point| PathBuf::from(unescape(point)))
        .filter(|point| point.starts_with(root) || root.starts_with(point))
        .collect()
}

/// Undoes the octal escapes (`\040` for a space, `\011`, `\012`, `\134`) the kernel writes
/// for whitespace and backslashes in mount points.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|digits| bytes[i] == b'\\' && digits.iter().all(|d| (b'0'..=b'7').contains(d)));
        match octal {
            Some(digits) => {
                let value = digits
                    .iter()
                    .fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
                out.push(u8::try_from(value).unwrap_or(b'?'));
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "\
22 1 252:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
61 22 0:52 / /var/lib/kubelet/plugins_registry/sub rw shared:30 - tmpfs tmpfs rw
62 22 0:53 / /var/lib/kubelet/plugins_registry\\040other rw shared:31 - tmpfs tmpfs rw
63 22 0:54 / /var/lib/kubelet/plugins_registry/with\\040space rw shared:32 - tmpfs tmpfs rw
64 22 0:55 / /run rw shared:33 - tmpfs tmpfs rw
";

    #[test]
    fn mount_points_over_the_root_are_read_with_their_escapes_undone() {
        let root = Path::new("/var/lib/kubelet/plugins_registry");
        let points: Vec<PathBuf> = mount_points_over(TABLE, root).into_iter().collect();
        assert_eq!(
            points,
            [Path::new("/"), &root.join("sub"), &root.join("with space")],
            "an ancestor can hide it; a sibling whose name extends the root's cannot"
        );
        assert_eq!(unescape("a\\134b\\011c\\9"), "a\\b\tc\\9");
    }

    #[tokio::test]
    async fn the_table_of_this_process_is_followed() {
        let mut watch = MountWatch::open(Path::new("/")).expect("mountinfo");
        assert!(
            watch.over_root.contains(Path::new("/")),
            "the root file system is a mount: {:?}",
            watch.over_root
        );
        // Nothing changed: it does not return.
        let waited = tokio::time::timeout(std::time::Duration::from_millis(50), watch.changed());
        assert!(waited.await.is_err());
    }
}
