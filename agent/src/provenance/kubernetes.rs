//! The pod and container a cgroup v2 path belongs to, read from the path alone (no API server).
//!
//! kubelet names a pod's cgroup after its UID and the runtime names the container's after its ID,
//! under either cgroup driver:
//!
//! ```text
//! systemd:  /kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid, _ for ->.slice/
//!               cri-containerd-<id>.scope | crio-<id>.scope | docker-<id>.scope
//! cgroupfs: /kubepods/burstable/pod<uid>/<id> | crio-<id> | docker-<id>
//! ```
//!
//! Guaranteed pods have no QoS level (`kubepods-pod<uid>.slice`, `/kubepods/pod<uid>`). A cgroup
//! nested below the container's (a runtime's sub-cgroup, systemd inside the container) still
//! belongs to it: the path is read from the root down and the deepest container component wins.

/// What a cgroup path says about Kubernetes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodCgroup {
    /// `metadata.uid` of the pod, with dashes (`k8s.pod.uid`).
    pub pod_uid: Option<Box<str>>,
    /// The container runtime's container ID, 64 hex digits (`container.id`).
    pub container_id: Option<Box<str>>,
}

/// Reads `path` (a cgroup v2 path as `/proc/PID/cgroup` shows it). Paths outside `kubepods`
/// say nothing.
pub fn parse(path: &str) -> PodCgroup {
    let mut found = PodCgroup::default();
    let mut in_kubepods = false;
    for component in path.split('/') {
        if component == "kubepods" || component.starts_with("kubepods.") {
            in_kubepods = true;
            continue;
        }
        if !in_kubepods {
            continue;
        }
        if let Some(uid) = pod_uid(component) {
            found.pod_uid = Some(uid.into());
        } else if found.pod_uid.is_some()
            && let Some(id) = container_id(component)
        {
            found.container_id = Some(id.into());
        }
    }
    found
}

/// `pod<uid>` (cgroupfs) or `kubepods[-<qos>]-pod<uid with _>.slice` (systemd).
fn pod_uid(component: &str) -> Option<String> {
    let slice = component
        .strip_prefix("kubepods-")
        .and_then(|rest| rest.strip_suffix(".slice"));
    let raw = match slice {
        Some(rest) => rest.rsplit_once("pod").map(|(_, uid)| uid)?,
        None => component.strip_prefix("pod")?,
    };
    let uid = raw.replace('_', "-");
    is_uid(&uid).then_some(uid)
}

/// `<runtime>-<id>.scope` (systemd), `<runtime>-<id>` or a bare `<id>` (cgroupfs), where the
/// runtime prefix is containerd's, CRI-O's or Docker's. CRI-O's `crio-conmon-<id>` is its
/// monitor process, not the container.
fn container_id(component: &str) -> Option<&str> {
    let name = component.strip_suffix(".scope").unwrap_or(component);
    let id = ["cri-containerd-", "crio-", "docker-", "cri-dockerd-"]
        .iter()
        .find_map(|prefix| name.strip_prefix(prefix))
        .unwrap_or(name);
    is_container_id(id).then_some(id)
}

fn is_container_id(id: &str) -> bool {
    id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A UUID in its 8-4-4-4-12 form (what Kubernetes gives every object).
fn is_uid(uid: &str) -> bool {
    let groups: Vec<&str> = uid.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, len)| g.len() == len && g.bytes().all(|b| b.is_ascii_hexdigit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "5c1d8a3e-2f4b-4c6d-9e8f-0a1b2c3d4e5f";
    const ID: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn both(path: &str) -> (Option<String>, Option<String>) {
        let found = parse(path);
        (
            found.pod_uid.map(String::from),
            found.container_id.map(String::from),
        )
    }

    fn want() -> (Option<String>, Option<String>) {
        (Some(UID.to_string()), Some(ID.to_string()))
    }

    #[test]
    fn systemd_driver_with_each_runtime() {
        let pod = format!(
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice",
            UID.replace('-', "_")
        );
        for runtime in ["cri-containerd-", "crio-", "docker-"] {
            assert_eq!(
                both(&format!("{pod}/{runtime}{ID}.scope")),
                want(),
                "{runtime}"
            );
        }
        let guaranteed = format!(
            "/kubepods.slice/kubepods-pod{}.slice/cri-containerd-{ID}.scope",
            UID.replace('-', "_")
        );
        assert_eq!(both(&guaranteed), want());
    }

    #[test]
    fn cgroupfs_driver_with_each_runtime() {
        assert_eq!(both(&format!("/kubepods/besteffort/pod{UID}/{ID}")), want());
        assert_eq!(both(&format!("/kubepods/pod{UID}/crio-{ID}")), want());
        assert_eq!(
            both(&format!("/kubepods/burstable/pod{UID}/docker-{ID}")),
            want()
        );
    }

    #[test]
    fn a_nested_cgroup_belongs_to_its_container_and_a_pod_cgroup_to_no_container() {
        assert_eq!(
            both(&format!("/kubepods/burstable/pod{UID}/{ID}/init.scope")),
            want()
        );
        assert_eq!(
            both(&format!("/kubepods/burstable/pod{UID}")),
            (Some(UID.to_string()), None)
        );
        assert_eq!(
            both(&format!("/kubepods/pod{UID}/crio-conmon-{ID}.scope")),
            (Some(UID.to_string()), None),
            "CRI-O's monitor is not the container"
        );
    }

    #[test]
    fn paths_outside_kubepods_or_malformed_say_nothing() {
        for path in [
            "/",
            "/system.slice/containerd.service",
            &format!("/user.slice/pod{UID}/{ID}"),
            "/kubepods/burstable/podnot-a-uid/abc",
            "/kubepods.slice/kubepods-burstable.slice",
            "",
        ] {
            assert_eq!(both(path), (None, None), "{path}");
        }
        assert_eq!(
            both(&format!("/kubepods/pod{UID}/{}", &ID[1..])),
            (Some(UID.to_string()), None),
            "63 hex digits are not a container ID"
        );
    }
}
