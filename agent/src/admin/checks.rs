//! `explain`'s live checks of a socket file: what `stat` and one connect say of it now, and
//! whether its mode and owner let kubelet (uid 0, with or without `CAP_DAC_OVERRIDE`) and the
//! agent dial it. Each check passes or fails with the fix; none blocks the agent (one connect per
//! explained socket, with [`CONNECT_TIMEOUT`]).

use crate::state::verdict::{Kubelet, SUN_PATH_MAX, Unseen};
use plugin_agent_proto::pluginagent::v1 as api;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;
use std::time::Duration;

/// How long `explain`'s connect waits: a listening socket accepts (into its backlog) at once.
pub const CONNECT_TIMEOUT: Duration = Duration::from_millis(200);

/// `CAP_DAC_OVERRIDE`'s bit in `/proc/self/status`'s `CapEff`.
const DAC_OVERRIDE_BIT: u64 = 1 << 1;

/// A check's result.
pub fn check(name: &str, result: &str, detail: impl Into<String>, fix: &str) -> api::Check {
    api::Check {
        name: name.into(),
        result: result.into(),
        detail: detail.into(),
        fix: if result == "fail" {
            fix.into()
        } else {
            String::new()
        },
    }
}

/// What the socket file checks found, for an unknown path's verdict.
pub struct FileChecks {
    pub checks: Vec<api::Check>,
    pub found: Unseen,
}

/// The checks of the file at `path` under the agent's watched tree `plugin_dir`.
pub async fn file_checks(path: &Path, plugin_dir: &Path) -> FileChecks {
    let mut checks = Vec::new();
    let bytes = path.as_os_str().as_bytes().len();
    let fits = bytes <= SUN_PATH_MAX;
    checks.push(check(
        "path_fits_sockaddr_un",
        if fits { "pass" } else { "fail" },
        format!("{bytes} bytes; a sockaddr_un holds {SUN_PATH_MAX} and the NUL"),
        "shorten the path: a shorter directory (kubelet --root-dir) or socket name; kubelet 1.37's DRA helper falls back to <driver>-<hash>-reg.sock, then dra-<hash>-reg.sock, for this reason",
    ));
    let under = path.starts_with(plugin_dir);
    checks.push(check(
        "under_watched_dir",
        if under { "pass" } else { "fail" },
        format!("the agent watches {}", plugin_dir.display()),
        "create the registration socket under the watched directory (node-driver-registrar: --kubelet-registration-path and the plugins_registry mount)",
    ));
    let meta = std::fs::symlink_metadata(path);
    let exists = meta.is_ok();
    checks.push(check(
        "exists",
        if exists { "pass" } else { "fail" },
        match &meta {
            Ok(_) => "the path exists".to_string(),
            Err(e) => e.to_string(),
        },
        "the plugin has not created its socket, or removed it: is its pod running, and does it bind this path?",
    ));
    let is_socket = meta.as_ref().is_ok_and(|m| m.file_type().is_socket());
    if let Ok(meta) = &meta {
        checks.push(check(
            "is_socket",
            if is_socket { "pass" } else { "fail" },
            format!("{} (mode {:04o})", kind_of(meta), meta.mode() & 0o7777),
            "only Unix domain sockets register: the plugin must bind() the path, not create a file there",
        ));
    }
    let mut listens = None;
    if is_socket && fits {
        let (said, answer) = connect_once(path).await;
        listens = answer;
        checks.push(said);
    }
    if let (Ok(meta), true) = (&meta, is_socket) {
        checks.extend(dial_checks(meta));
    }
    FileChecks {
        checks,
        found: Unseen {
            exists,
            is_socket,
            fits,
            under_watched_dir: under,
            listens,
        },
    }
}

fn kind_of(meta: &std::fs::Metadata) -> &'static str {
    let kind = meta.file_type();
    if kind.is_socket() {
        "a socket"
    } else if kind.is_dir() {
        "a directory"
    } else if kind.is_symlink() {
        "a symbolic link (the agent and kubelet ignore links)"
    } else if kind.is_file() {
        "a regular file"
    } else {
        "a special file"
    }
}

/// One connect: whether something listens (`None`: the connect said nothing about it).
async fn connect_once(path: &Path) -> (api::Check, Option<bool>) {
    let fix_stale = "nothing listens: the plugin's process exited (or the node rebooted) and left its socket; restart the plugin, which removes the socket and binds it again";
    let connected = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::UnixStream::connect(path));
    match connected.await {
        Ok(Ok(_stream)) => (
            check("listens", "pass", "one connect was accepted", ""),
            Some(true),
        ),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => (
            check("listens", "fail", format!("connect: {e}"), fix_stale),
            Some(false),
        ),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::PermissionDenied => (
            check(
                "listens",
                "unknown",
                format!("connect: {e}: see agent_can_dial"),
                "",
            ),
            None,
        ),
        Ok(Err(e)) => (
            check("listens", "unknown", format!("connect: {e}"), ""),
            None,
        ),
        Err(_) => (
            check(
                "listens",
                "fail",
                format!(
                    "no answer within {CONNECT_TIMEOUT:?}: its backlog is full (it does not accept)"
                ),
                "the plugin listens but does not accept connections: is it hung?",
            ),
            Some(false),
        ),
    }
}

/// Whether the socket's mode and owner let each dialler connect (connect needs write permission
/// on the socket; `CAP_DAC_OVERRIDE` skips the check).
fn dial_checks(meta: &std::fs::Metadata) -> Vec<api::Check> {
    let (mode, uid, gid) = (meta.mode() & 0o777, meta.uid(), meta.gid());
    let said = format!("mode {mode:04o}, owner {uid}:{gid}");
    let fix = "let root dial it without CAP_DAC_OVERRIDE: create it with umask 0007 (or chmod 0660) and group 0, or owned by root (node-driver-registrar under umask 0077 makes 0700 sockets)";
    let root_may = may_write(mode, uid, gid, 0, 0);
    let (agent_uid, agent_gid) = (
        nix::unistd::geteuid().as_raw(),
        nix::unistd::getegid().as_raw(),
    );
    let agent_dac = has_dac_override();
    let agent_may = agent_dac || may_write(mode, uid, gid, agent_uid, agent_gid);
    vec![
        check(
            "kubelet_can_dial",
            "pass",
            format!("{said}: kubelet runs as uid 0 with CAP_DAC_OVERRIDE"),
            "",
        ),
        check(
            "root_without_dac_override_can_dial",
            if root_may { "pass" } else { "fail" },
            format!("{said}: uid 0 without CAP_DAC_OVERRIDE needs write permission"),
            fix,
        ),
        check(
            "agent_can_dial",
            if agent_may { "pass" } else { "fail" },
            format!(
                "{said}: the agent runs as uid {agent_uid} {} CAP_DAC_OVERRIDE",
                if agent_dac { "with" } else { "without" }
            ),
            "give the agent CAP_DAC_OVERRIDE (the shipped DaemonSet does), or make the socket writable for its user or group",
        ),
    ]
}

/// Whether a process of `uid`:`gid` (no capability) may write a file of `mode` owned `owner`.
fn may_write(mode: u32, owner: u32, group: u32, uid: u32, gid: u32) -> bool {
    if uid == owner {
        mode & 0o200 != 0
    } else if gid == group {
        mode & 0o020 != 0
    } else {
        mode & 0o002 != 0
    }
}

/// Whether this process holds `CAP_DAC_OVERRIDE` (its `CapEff`).
fn has_dac_override() -> bool {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & DAC_OVERRIDE_BIT != 0)
}

/// Whether the node's kubelet watches the directory `path` is in.
pub fn kubelet_dir(path: &Path, kubelets: &[Kubelet], observe: bool) -> api::Check {
    let fix = "put the registration socket under the kubelet's <root-dir>/plugins_registry (node-driver-registrar's --kubelet-registration-path, the DaemonSet's hostPath), or run the agent on the directory kubelet watches";
    if !observe {
        return check(
            "kubelet_dir",
            "skip",
            "register mode: the agent registers plugins with its handlers, not kubelet",
            "",
        );
    }
    if kubelets.is_empty() {
        return check(
            "kubelet_dir",
            "unknown",
            "cannot tell: no process named kubelet runs in the agent's view of /proc",
            "",
        );
    }
    let described: Vec<String> = kubelets
        .iter()
        .map(|k| {
            format!(
                "kubelet pid {} watches {} ({})",
                k.pid,
                k.plugins_registry.display(),
                k.root_dir_from
            )
        })
        .collect();
    let watched = kubelets
        .iter()
        .any(|k| path.starts_with(&k.plugins_registry));
    check(
        "kubelet_dir",
        if watched { "pass" } else { "fail" },
        described.join("; "),
        fix,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_permission_follows_owner_then_group_then_others() {
        // A 0700 socket of uid 65534: root without CAP_DAC_OVERRIDE may not connect.
        assert!(!may_write(0o700, 65534, 65534, 0, 0));
        assert!(may_write(0o700, 65534, 65534, 65534, 65534));
        // 0660 with group 0: root may, through its group.
        assert!(may_write(0o660, 65534, 0, 0, 0));
        assert!(may_write(0o777, 65534, 65534, 0, 0));
        // The owner's bits decide for the owner even when others may.
        assert!(!may_write(0o077, 0, 0, 0, 0));
    }
}
