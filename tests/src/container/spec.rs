//! The OCI runtime configuration of the agent's container, generated from the manifest the way
//! kubelet and containerd would: namespaces, the security context, seccomp, volumes and their
//! propagation, the environment with the downward API resolved, and the runtime's defaults.

use std::path::Path;

use serde_json::{Value, json};

use super::{Deployment, Image, Node, strings};

/// What a run changes from the manifest, to measure what each part of it is for.
#[derive(Debug, Clone, Default)]
pub struct Variant {
    /// Capabilities taken out of the manifest's `add` list (`CAP_*`).
    pub without: Vec<String>,
    /// Replaces the manifest's `seccompProfile` with `RuntimeDefault`.
    pub runtime_default_seccomp: bool,
}

/// The containers-common seccomp profile (CRI-O's and podman's `RuntimeDefault`; containerd's
/// built-in default grants the same calls to the same capabilities).
pub const RUNTIME_DEFAULT_PROFILE: &str = "/usr/share/containers/seccomp.json";

/// The OCI runtime configuration kubelet and containerd would give the agent's container:
/// the pod's namespaces (`hostPID`, `hostNetwork`), the security context, the volumes with
/// their propagation, the environment with the downward API resolved, and the runtime's
/// defaults for everything the manifest does not say.
pub fn runtime_spec(
    deployment: &Deployment,
    node: &Node,
    image: &Image,
    variant: &Variant,
    cgroup: &str,
) -> Value {
    let pod = deployment.pod();
    let container = deployment.container();
    let security = &container["securityContext"];
    assert_ne!(
        security["privileged"], true,
        "the stage runs unprivileged pods"
    );
    let caps: Vec<String> = deployment
        .capabilities()
        .into_iter()
        .filter(|c| !variant.without.contains(c))
        .collect();

    let env = environment(container);
    let mut args = image.entrypoint.clone();
    args.extend(
        strings(&container["args"])
            .iter()
            .map(|a| expand_env(a, &env)),
    );
    let mut env_list =
        vec!["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into()];
    env_list.extend(env.iter().map(|(k, v)| format!("{k}={v}")));

    let namespaces = namespaces(pod);

    let (volume_mounts, propagation) = volume_mounts(deployment, node);
    let mut mounts = runtime_mounts();
    mounts.extend(volume_mounts);

    let seccomp = seccomp(security, variant, &caps);
    let memory = container["resources"]["limits"]["memory"]
        .as_str()
        .map(quantity_bytes);

    let mut linux = json!({
        "namespaces": namespaces,
        "cgroupsPath": cgroup,
        "resources": {"memory": {"limit": memory}},
        "maskedPaths": [
            "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
            "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
            "/sys/firmware", "/sys/devices/virtual/powercap"
        ],
        "readonlyPaths": [
            "/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"
        ],
    });
    if let Some(propagation) = propagation {
        linux["rootfsPropagation"] = json!(propagation);
    }
    if !seccomp.is_null() {
        linux["seccomp"] = seccomp;
    }
    json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": security["runAsUser"].as_u64().unwrap_or(0), "gid": 0},
            "args": args,
            "env": env_list,
            "cwd": "/",
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            "noNewPrivileges": security["allowPrivilegeEscalation"] == false,
        },
        "root": {
            "path": image.rootfs,
            "readonly": security["readOnlyRootFilesystem"] == true,
        },
        "mounts": mounts,
        "linux": linux,
    })
}

/// The pod's namespaces: its own mount and IPC namespaces, the host's pid and network ones when
/// the pod asks for them.
fn namespaces(pod: &Value) -> Vec<Value> {
    let mut namespaces = vec![json!({"type": "mount"}), json!({"type": "ipc"})];
    if pod["hostPID"] != true {
        namespaces.push(json!({"type": "pid"}));
    }
    if pod["hostNetwork"] != true {
        namespaces.push(json!({"type": "network"}));
        namespaces.push(json!({"type": "uts"}));
    }
    // containerd gives a container a cgroup namespace of its own on cgroup v2 nodes (most
    // nodes now); made here on any host, so the agent's way out of it is always exercised.
    namespaces.push(json!({"type": "cgroup"}));
    namespaces
}

/// The seccomp filter of the security context's `seccompProfile` (or of the variant's
/// `RuntimeDefault`); `Null` when unconfined.
fn seccomp(security: &Value, variant: &Variant, caps: &[String]) -> Value {
    let seccomp_type = if variant.runtime_default_seccomp {
        "RuntimeDefault"
    } else {
        security["seccompProfile"]["type"]
            .as_str()
            .unwrap_or("RuntimeDefault")
    };
    match seccomp_type {
        "Unconfined" => Value::Null,
        "RuntimeDefault" => runtime_default_seccomp(caps),
        other => panic!("seccompProfile {other} is not translated by this stage"),
    }
}

/// The container's environment: literal values, and the downward API's `status.hostIP` (the
/// node's address, as kubelet fills it in).
fn environment(container: &Value) -> Vec<(String, String)> {
    container["env"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            let name = e["name"].as_str().unwrap_or_default().to_string();
            let value = match (&e["value"], &e["valueFrom"]["fieldRef"]["fieldPath"]) {
                (Value::String(v), _) => v.clone(),
                (_, Value::String(field)) if field == "status.hostIP" => host_ip(),
                (_, other) => panic!("env {name}: {other} is not translated by this stage"),
            };
            (name, value)
        })
        .collect()
}

/// `$(VAR)` in an argument, as kubelet expands it from the container's environment.
fn expand_env(arg: &str, env: &[(String, String)]) -> String {
    env.iter().fold(arg.to_string(), |a, (k, v)| {
        a.replace(&format!("$({k})"), v)
    })
}

/// The node's address: the source address of its default route.
fn host_ip() -> String {
    std::net::UdpSocket::bind("0.0.0.0:0")
        .and_then(|s| {
            s.connect("192.0.2.1:9")?;
            s.local_addr()
        })
        .map(|a| a.ip().to_string())
        .unwrap_or_else(|_| "127.0.0.1".into())
}

/// `128Mi`, `1Gi`, `500M`: a Kubernetes quantity in bytes.
pub fn quantity_bytes(quantity: &str) -> u64 {
    let units = [
        ("Ki", 1u64 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("k", 1000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
    ];
    let (number, unit) = units
        .iter()
        .find_map(|(suffix, unit)| Some((quantity.strip_suffix(suffix)?, *unit)))
        .unwrap_or((quantity, 1));
    number.parse::<u64>().expect("a quantity is a number") * unit
}

/// The mounts every container gets from containerd before its volumes: proc, a tmpfs `/dev`,
/// devpts, shm, mqueue, sysfs read-only (an unprivileged container) and its cgroups read-only.
fn runtime_mounts() -> Vec<Value> {
    vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc",
               "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
               "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        json!({"destination": "/dev/pts", "type": "devpts", "source": "devpts",
               "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]}),
        json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
               "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}),
        json!({"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
               "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs",
               "options": ["nosuid", "noexec", "nodev", "ro"]}),
        json!({"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
               "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]}),
    ]
}

/// The pod's volumes as bind mounts: `hostPath` from the node (created for
/// `DirectoryOrCreate`), ConfigMaps written out and mounted read-only (as kubelet does), each
/// with the propagation its `mountPropagation` asks for; and the root's propagation that makes
/// `rslave`/`rshared` take effect.
fn volume_mounts(deployment: &Deployment, node: &Node) -> (Vec<Value>, Option<&'static str>) {
    let mut mounts = Vec::new();
    let mut root_propagation = None;
    for mount in deployment.container()["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let name = mount["name"].as_str().unwrap_or_default();
        let volume = deployment.volume(name);
        let source = if let Some(host) = volume["hostPath"]["path"].as_str() {
            let path = node.path(Path::new(host));
            match volume["hostPath"]["type"].as_str().unwrap_or_default() {
                "DirectoryOrCreate" => std::fs::create_dir_all(&path)
                    .unwrap_or_else(|e| panic!("create hostPath {}: {e}", path.display())),
                "Directory" => assert!(path.is_dir(), "hostPath {host} must exist on the node"),
                other => panic!("hostPath type {other:?} is not translated by this stage"),
            }
            path
        } else if let Some(map) = volume["configMap"]["name"].as_str() {
            let dir = node.scratch(&format!("configmap-{name}"));
            for (file, text) in deployment.config_map(map) {
                std::fs::write(dir.join(file), text).expect("write a ConfigMap file");
            }
            dir
        } else {
            panic!("volume {name}: only hostPath and configMap are translated by this stage")
        };
        let propagation = match mount["mountPropagation"].as_str().unwrap_or("None") {
            "None" => "rprivate",
            "HostToContainer" => {
                root_propagation.get_or_insert("rslave");
                "rslave"
            }
            "Bidirectional" => {
                root_propagation = Some("rshared");
                "rshared"
            }
            other => panic!("mountPropagation {other}"),
        };
        let read_only = mount["readOnly"] == true || volume.get("configMap").is_some();
        let mut options = vec!["rbind", propagation];
        options.push(if read_only { "ro" } else { "rw" });
        mounts.push(json!({
            "destination": mount["mountPath"],
            "type": "bind",
            "source": source,
            "options": options,
        }));
    }
    (mounts, root_propagation)
}

/// The `RuntimeDefault` profile in the runtime's format: the containers-common profile's rules
/// that apply to this architecture, this kernel and the container's capabilities (its
/// `includes`/`excludes`), as the engines that ship it resolve them.
pub fn runtime_default_seccomp(caps: &[String]) -> Value {
    let text = std::fs::read_to_string(RUNTIME_DEFAULT_PROFILE).unwrap_or_else(|e| {
        panic!("read {RUNTIME_DEFAULT_PROFILE} (apt: golang-github-containers-common): {e}")
    });
    let profile: Value = serde_json::from_str(&text).expect("the seccomp profile is JSON");
    // The profile names architectures the Go way in its rules, libseccomp's way in its map.
    let (arch, go_arch) = match std::env::consts::ARCH {
        "x86_64" => ("SCMP_ARCH_X86_64", "amd64"),
        "aarch64" => ("SCMP_ARCH_AARCH64", "arm64"),
        other => panic!("no seccomp architecture for {other}"),
    };
    let kernel = kernel_version();
    let has_caps = |list: &Value| strings(list).iter().all(|c| caps.contains(c));
    let any_caps = |list: &Value| strings(list).iter().any(|c| caps.contains(c));
    let on_arch = |list: &Value| strings(list).iter().any(|a| a == go_arch);
    let rules: Vec<Value> = profile["syscalls"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|rule| {
            let inc = &rule["includes"];
            let exc = &rule["excludes"];
            (inc["caps"].is_null() || has_caps(&inc["caps"]))
                && (inc["arches"].is_null() || on_arch(&inc["arches"]))
                && inc["minKernel"]
                    .as_str()
                    .is_none_or(|min| kernel >= parse_version(min))
                && (exc["caps"].is_null() || !any_caps(&exc["caps"]))
                && (exc["arches"].is_null() || !on_arch(&exc["arches"]))
        })
        .map(|rule| {
            let mut out = json!({"names": rule["names"], "action": rule["action"]});
            if let Some(args) = rule["args"].as_array().filter(|a| !a.is_empty()) {
                out["args"] = json!(args);
            }
            if let Some(errno) = rule["errnoRet"].as_u64() {
                out["errnoRet"] = json!(errno);
            }
            out
        })
        .collect();
    let architectures: Vec<Value> = profile["archMap"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m["architecture"] == arch)
        .flat_map(|m| {
            std::iter::once(m["architecture"].clone()).chain(
                m["subArchitectures"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default(),
            )
        })
        .collect();
    let mut seccomp = json!({
        "defaultAction": profile["defaultAction"],
        "architectures": architectures,
        "syscalls": rules,
    });
    if let Some(errno) = profile["defaultErrnoRet"].as_u64() {
        seccomp["defaultErrnoRet"] = json!(errno);
    }
    seccomp
}

fn kernel_version() -> (u32, u32) {
    let release = nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default();
    parse_version(&release)
}

fn parse_version(text: &str) -> (u32, u32) {
    let mut parts = text
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|p| p.parse().ok());
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_read_as_kubernetes_writes_them() {
        assert_eq!(quantity_bytes("128Mi"), 128 << 20);
        assert_eq!(quantity_bytes("1Gi"), 1 << 30);
        assert_eq!(quantity_bytes("500M"), 500_000_000);
        assert_eq!(quantity_bytes("4096"), 4096);
    }

    #[test]
    fn arguments_expand_the_containers_environment() {
        let env = vec![("HOST_IP".to_string(), "10.0.0.7".to_string())];
        assert_eq!(
            expand_env("--metrics-addr=$(HOST_IP):9464", &env),
            "--metrics-addr=10.0.0.7:9464"
        );
        assert_eq!(expand_env("--config=/x", &env), "--config=/x");
    }

    #[test]
    fn kernel_versions_compare_by_major_then_minor() {
        assert_eq!(parse_version("6.18.0-1-amd64"), (6, 18));
        assert!(parse_version("5.10.223") < parse_version("5.15"));
    }
}
