//! Who holds a listening socket now: the processes with a descriptor of it.
//!
//! A socket's credentials name the process that called `listen`, which may have handed the
//! listener on (a fork, `SCM_RIGHTS`, socket activation) and exited. What serves the socket from
//! then on is whoever holds a descriptor of the listener, and their exits are what end it. The
//! kernel says who, through `/proc`, in three steps that work across mount and network
//! namespaces (plugins in pods are in both):
//!
//! ```text
//! every process P: /proc/P/fd/*  -> "socket:[N]"           which sockets each process holds
//! each network namespace (one P in it): /proc/P/net/unix  -> the listening ones among them (flag
//!                                         __SO_ACCEPTCON), each with the path it was bound to
//! that path, seen from a holder (/proc/P/root/PATH) -> the same file as the plugin's socket?
//! ```
//!
//! The bound path is the binder's view (`/csi/csi.sock` in its container); a holder in another
//! mount namespace than the binder's cannot resolve it, and then a listener bound under the same
//! file name counts (a false match keeps a registration, as before this; it never ends one).
//! Each holder's pidfd is opened and the holder checked to hold the socket still, so a recycled
//! pid is never watched in its place. The scan reads every process's descriptor table: it runs
//! only when a registered plugin's recorded server has exited and its socket still accepts
//! connections (rare), on a blocking thread.

use std::collections::{HashMap, HashSet};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use crate::state::{EntryKind, SocketId};

/// `__SO_ACCEPTCON` in `/proc/net/unix`'s flags: the socket listens.
const ACCEPTCON: u32 = 0x0001_0000;

/// A process holding the listener, and its pidfd (readable once it exits).
pub struct Holder {
    pub pid: u32,
    pub pidfd: OwnedFd,
}

/// The processes (other than this one) holding a descriptor of the socket listening at `path`,
/// whose file is `socket`.
pub fn holding(path: &Path, socket: SocketId) -> Vec<Holder> {
    let own = std::process::id();
    // Which processes hold which socket inodes.
    let mut holders_of: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut any_in_netns: HashMap<u64, u32> = HashMap::new();
    for pid in pids().filter(|pid| *pid != own) {
        let sockets = socket_inodes(pid);
        if sockets.is_empty() {
            continue;
        }
        if let Some(netns) = inode_of(&format!("/proc/{pid}/ns/net")) {
            any_in_netns.entry(netns).or_insert(pid);
        }
        for inode in sockets {
            holders_of.entry(inode).or_default().push(pid);
        }
    }
    let name = path.file_name();
    let mut found = HashSet::new();
    for reader in any_in_netns.into_values() {
        for (inode, bound) in listening(reader) {
            let Some(pids) = holders_of.get(&inode) else {
                continue;
            };
            if found.contains(&inode) {
                continue;
            }
            let ours = pids.iter().any(|pid| {
                match resolve(*pid, &bound).map(|p| EntryKind::of(&p)) {
                    Some(Ok(EntryKind::Socket(id))) => id.dev == socket.dev && id.ino == socket.ino,
                    Some(Ok(_)) => false,
                    // Not resolvable from here: the file name decides (see the module docs).
                    Some(Err(_)) | None => Path::new(&bound).file_name() == name,
                }
            });
            if ours {
                found.insert(inode);
            }
        }
    }
    found
        .iter()
        .flat_map(|inode| {
            holders_of
                .get(inode)
                .into_iter()
                .flatten()
                .map(move |pid| (*pid, *inode))
        })
        .collect::<HashSet<_>>()
        .into_iter()
        .filter_map(|(pid, inode)| {
            let pidfd = super::server::pidfd_open(pid)?;
            // Opened by pid: it is the holder only if it holds the socket after the open.
            socket_inodes(pid)
                .contains(&inode)
                .then_some(Holder { pid, pidfd })
        })
        .collect()
}

/// Every process id in `/proc`.
fn pids() -> impl Iterator<Item = u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
}

/// The socket inodes process `pid` holds descriptors of.
fn socket_inodes(pid: u32) -> HashSet<u64> {
    let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return HashSet::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let target = std::fs::read_link(entry.path()).ok()?;
            let target = target.to_str()?;
            target
                .strip_prefix("socket:[")?
                .strip_suffix(']')?
                .parse()
                .ok()
        })
        .collect()
}

fn inode_of(path: &str) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| m.ino())
}

/// The listening unix sockets of `pid`'s network namespace bound to a path: inode and path.
fn listening(pid: u32) -> Vec<(u64, String)> {
    let Ok(table) = std::fs::read_to_string(format!("/proc/{pid}/net/unix")) else {
        return Vec::new();
    };
    table.lines().skip(1).filter_map(parse_line).collect()
}

/// One line of `/proc/net/unix`: `Num RefCount Protocol Flags Type St Inode Path`; a listening
/// socket bound to a path (not an abstract name) gives its inode and path.
fn parse_line(line: &str) -> Option<(u64, String)> {
    let mut fields = line.split_whitespace();
    let flags = u32::from_str_radix(fields.nth(3)?, 16).ok()?;
    let inode = fields.nth(2)?.parse().ok()?;
    // The path is the rest of the line (it may hold spaces).
    let path = line
        .splitn(8, char::is_whitespace)
        .filter(|f| !f.is_empty())
        .nth(7);
    let path = path
        .map(str::trim)
        .filter(|p| p.starts_with('/') || !p.starts_with('@'))?;
    (flags & ACCEPTCON != 0 && !path.is_empty()).then(|| (inode, path.to_owned()))
}

/// `bound` as process `pid` sees it: through its root (and its working directory, for a
/// relative path, as bound then).
fn resolve(pid: u32, bound: &str) -> Option<PathBuf> {
    let base = if bound.starts_with('/') {
        "root"
    } else {
        "cwd"
    };
    Some(
        Path::new("/proc")
            .join(pid.to_string())
            .join(base)
            .join(bound.trim_start_matches('/')),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listening_socket_bound_to_a_path_is_read_from_its_line() {
        let listening = "0000000029816797: 00000002 00000000 00010000 0001 01 41234 /var/lib/kubelet/plugins_registry/a b.sock";
        assert_eq!(
            parse_line(listening),
            Some((41234, "/var/lib/kubelet/plugins_registry/a b.sock".into()))
        );
        let connected = "0000000029816797: 00000003 00000000 00000000 0001 03 1210 /run/x.sock";
        assert_eq!(parse_line(connected), None);
        let unbound = "0000000029816797: 00000002 00000000 00010000 0001 01 1211";
        assert_eq!(parse_line(unbound), None);
        let abstract_name = "0000000029816797: 00000002 00000000 00010000 0001 01 1212 @agent";
        assert_eq!(parse_line(abstract_name), None);
    }
}
