//! The agent as users run it: inside a real OCI container (runc or crun), made from the
//! DaemonSet we ship, on a node whose plugins are host processes.
//!
//! ```text
//! deploy/base/daemonset.yaml ──(kustomize build, for an overlay)──> Deployment
//!   Deployment + Node + Image ──runtime_spec()──> bundle/config.json ──runc run──> Container
//!   deploy/Containerfile ──ENTRYPOINT, COPY dest──> Image (rootfs: the built binary + its libs)
//!   Node: a tmpfs standing for the node's disk, a bpffs of its own; /sys/kernel/* are the host's
//! ```
//!
//! Nothing of the container's configuration is written here by hand: capabilities, the security
//! context, volumes and their propagation, environment, arguments and probe ports are read from
//! the manifest, translated the way kubelet and containerd do (their documented defaults for
//! masked paths, read-only paths and the runtime's mounts), so the manifest and this stage cannot
//! drift apart.

use crate::events::EventLog;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The repository's `deploy/` directory.
pub fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// A deployment as the API server would receive it: every document of the rendered manifests.
#[derive(Debug, Clone)]
pub struct Deployment {
    /// `observe` (the shipped DaemonSet) or `register` (the overlay).
    pub name: String,
    documents: Vec<Value>,
}

impl Deployment {
    /// `deploy/base/daemonset.yaml` as shipped (the base kustomization renders exactly this).
    pub fn observe() -> Deployment {
        let path = deploy_dir().join("base/daemonset.yaml");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        Deployment::parse("observe", &text)
    }

    /// `deploy/register` rendered by kustomize: the overlay's patches applied by the real tool.
    pub fn register() -> Deployment {
        Deployment::parse("register", &kustomize_build(&deploy_dir().join("register")))
    }

    fn parse(name: &str, text: &str) -> Deployment {
        let documents = serde_norway::Deserializer::from_str(text)
            .map(|doc| {
                <Value as serde::Deserialize>::deserialize(doc)
                    .unwrap_or_else(|e| panic!("{name}: a manifest document is not YAML: {e}"))
            })
            .filter(|doc| !doc.is_null())
            .collect();
        Deployment {
            name: name.to_string(),
            documents,
        }
    }

    fn document(&self, kind: &str) -> &Value {
        self.documents
            .iter()
            .find(|d| d["kind"] == kind)
            .unwrap_or_else(|| panic!("{}: no {kind} in the manifests", self.name))
    }

    /// The DaemonSet's pod spec.
    pub fn pod(&self) -> &Value {
        &self.document("DaemonSet")["spec"]["template"]["spec"]
    }

    /// The agent's container.
    pub fn container(&self) -> &Value {
        &self.pod()["containers"][0]
    }

    /// A ConfigMap's data, by name.
    pub fn config_map(&self, name: &str) -> BTreeMap<String, String> {
        let map = self
            .documents
            .iter()
            .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("{}: no ConfigMap {name}", self.name));
        serde_json::from_value(map["data"].clone()).expect("ConfigMap data is strings")
    }

    /// The agent's configuration file as the container sees it, parsed: the file named by
    /// `--config` in the container's arguments, found in the volume mounted over its directory.
    pub fn agent_config(&self) -> toml::Table {
        let args = strings(&self.container()["args"]);
        let path = args
            .iter()
            .find_map(|a| a.strip_prefix("--config="))
            .expect("the container passes --config=FILE");
        let path = Path::new(path);
        let dir = path.parent().expect("a config file has a directory");
        let mount = self.container()["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|m| Path::new(m["mountPath"].as_str().unwrap_or_default()) == dir)
            .expect("the config directory is a volume mount");
        let volume = self.volume(mount["name"].as_str().unwrap_or_default());
        let map = volume["configMap"]["name"]
            .as_str()
            .expect("the config volume is a ConfigMap");
        let file = path
            .file_name()
            .and_then(|f| f.to_str())
            .unwrap_or_default();
        let text = self
            .config_map(map)
            .remove(file)
            .unwrap_or_else(|| panic!("ConfigMap {map} has no {file}"));
        text.parse().expect("the agent's configuration is TOML")
    }

    /// A pod volume, by name.
    fn volume(&self, name: &str) -> &Value {
        self.pod()["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no volume {name}"))
    }

    /// The host path behind `container_path`: the deepest volume mount holding it, its
    /// `hostPath`, on `node`.
    pub fn host_path_of(&self, node: &Node, container_path: &Path) -> PathBuf {
        let mounts = self.container()["volumeMounts"].as_array().cloned();
        let (mount, rest) = mounts
            .into_iter()
            .flatten()
            .filter_map(|m| {
                let at = PathBuf::from(m["mountPath"].as_str().unwrap_or_default());
                let rest = container_path.strip_prefix(&at).ok()?.to_path_buf();
                Some((m, rest))
            })
            .min_by_key(|(_, rest)| rest.components().count())
            .unwrap_or_else(|| panic!("{} is in no volume", container_path.display()));
        let volume = self.volume(mount["name"].as_str().unwrap_or_default());
        let host = volume["hostPath"]["path"]
            .as_str()
            .unwrap_or_else(|| panic!("volume {} is not a hostPath", volume["name"]));
        node.path(Path::new(host)).join(rest)
    }

    /// Where a probe points, as kubelet resolves it with `hostNetwork`: `host`, and the port by
    /// name from the container's ports.
    pub fn probe(&self, probe: &str) -> (std::net::SocketAddr, String) {
        let get = &self.container()[probe]["httpGet"];
        let port = match &get["port"] {
            Value::Number(n) => n.as_u64().expect("a port number") as u16,
            Value::String(name) => self.container()["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|p| p["name"] == name.as_str())
                .and_then(|p| p["containerPort"].as_u64())
                .unwrap_or_else(|| panic!("no port named {name}"))
                as u16,
            other => panic!("{probe}: port {other}"),
        };
        let host = get["host"].as_str().unwrap_or("127.0.0.1");
        let addr = format!("{host}:{port}")
            .parse()
            .expect("a probe's host is an address");
        (addr, get["path"].as_str().unwrap_or("/").to_string())
    }

    /// Capabilities the container is started with (`drop: [ALL]`, then `add`), as `CAP_*`.
    pub fn capabilities(&self) -> Vec<String> {
        let caps = &self.container()["securityContext"]["capabilities"];
        assert_eq!(
            strings(&caps["drop"]),
            ["ALL"],
            "the stage translates drop: [ALL] plus add, as the manifest has it"
        );
        strings(&caps["add"])
            .into_iter()
            .map(|c| format!("CAP_{c}"))
            .collect()
    }

    /// `terminationGracePeriodSeconds`.
    pub fn grace_period(&self) -> Duration {
        Duration::from_secs(
            self.pod()["terminationGracePeriodSeconds"]
                .as_u64()
                .unwrap_or(30),
        )
    }
}

/// `kustomize build DIR`: a standalone kustomize named by `PLUGIN_AGENT_KUSTOMIZE` (what
/// `cargo xtask manifests` installs), else the one built into kubectl.
pub fn kustomize_build(dir: &Path) -> String {
    let mut command = match std::env::var_os("PLUGIN_AGENT_KUSTOMIZE") {
        Some(bin) => {
            let mut c = Command::new(bin);
            c.arg("build");
            c
        }
        None => {
            let mut c = Command::new("kubectl");
            c.arg("kustomize");
            c
        }
    };
    let output = command.arg(dir).output().unwrap_or_else(|e| {
        panic!(
            "cannot run kustomize ({e}): set PLUGIN_AGENT_KUSTOMIZE or install kubectl \
             (`cargo xtask manifests` installs kustomize)"
        )
    });
    assert!(
        output.status.success(),
        "kustomize build {}: {}",
        dir.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("kustomize prints UTF-8")
}

/// A YAML list of strings.
pub fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect()
}

/// The node the pod runs on. Its disk (the registration directory, `/run`) is a tmpfs of the
/// test's and `/sys/fs/bpf` a bpffs instance of its own, so the test's pins and plugins are its
/// alone; the kernel's other interfaces under `/sys` (BTF, tracefs, cgroups) are the host's.
#[derive(Debug)]
pub struct Node {
    root: tempfile::TempDir,
}

impl Node {
    /// A fresh node; `None` without the privilege to mount (skip, or fail under `CI=true`).
    pub fn new() -> Option<Node> {
        use nix::mount::{MsFlags, mount};
        let root = tempfile::Builder::new()
            .prefix("pa-node-")
            .tempdir()
            .expect("create the node's directory");
        let mounted = mount(
            Some("tmpfs"),
            root.path(),
            Some("tmpfs"),
            MsFlags::empty(),
            Some("mode=0755"),
        );
        if let Err(e) = mounted {
            eprintln!("cannot mount the node's tmpfs: {e}");
            return None;
        }
        let node = Node { root };
        let bpffs = node.path(Path::new("/sys/fs/bpf"));
        std::fs::create_dir_all(&bpffs).expect("create the node's /sys/fs/bpf");
        mount(
            Some("bpf"),
            &bpffs,
            Some("bpf"),
            MsFlags::empty(),
            None::<&str>,
        )
        .expect("mount a bpffs for the node");
        Some(node)
    }

    /// Where the node's `path` is on this machine.
    pub fn path(&self, path: &Path) -> PathBuf {
        if path.starts_with("/sys") && !path.starts_with("/sys/fs/bpf") {
            return path.to_path_buf();
        }
        self.root
            .path()
            .join(path.strip_prefix("/").unwrap_or(path))
    }

    fn scratch(&self, name: &str) -> PathBuf {
        let dir = self.root.path().join("pod").join(name);
        std::fs::create_dir_all(&dir).expect("create a pod directory");
        dir
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        use nix::mount::{MntFlags, umount2};
        let _ = umount2(&self.path(Path::new("/sys/fs/bpf")), MntFlags::MNT_DETACH);
        let _ = umount2(self.root.path(), MntFlags::MNT_DETACH);
    }
}

/// The image: `deploy/Containerfile`'s final stage, made locally from the built binary (no
/// registry): the binary where the Containerfile copies it, the shared libraries it links (what
/// the distroless base provides), and the Containerfile's `ENTRYPOINT`.
#[derive(Debug)]
pub struct Image {
    rootfs: PathBuf,
    entrypoint: Vec<String>,
}

impl Image {
    /// Builds the root file system under `node`'s pod directory.
    pub fn build(node: &Node, agent: &Path) -> Image {
        let path = deploy_dir().join("Containerfile");
        let recipe = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        let last_stage = recipe
            .rsplit_once("\nFROM ")
            .map(|(_, s)| s)
            .expect("the Containerfile has stages");
        let directive = |name: &str| {
            last_stage
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(str::trim)
                .unwrap_or_else(|| panic!("the final stage has no {name}"))
        };
        let entrypoint: Vec<String> = serde_json::from_str(directive("ENTRYPOINT "))
            .expect("ENTRYPOINT is a JSON array (exec form)");
        let binary_dest = last_stage
            .lines()
            .filter_map(|l| l.strip_prefix("COPY --from=build "))
            .find_map(|l| {
                let (from, to) = l.trim().split_once(' ')?;
                from.ends_with("/plugin-agent")
                    .then(|| to.trim().to_string())
            })
            .expect("the final stage copies the built plugin-agent");

        let rootfs = node.scratch("rootfs");
        install(agent, &rootfs.join(binary_dest.trim_start_matches('/')));
        for lib in linked_libraries(agent) {
            install(&lib, &rootfs.join(lib.strip_prefix("/").unwrap_or(&lib)));
        }
        Image { rootfs, entrypoint }
    }
}

fn install(from: &Path, to: &Path) {
    std::fs::create_dir_all(to.parent().expect("a file has a directory"))
        .expect("create an image directory");
    std::fs::copy(from, to)
        .unwrap_or_else(|e| panic!("copy {} into the image: {e}", from.display()));
}

/// The shared libraries `binary` loads, and the loader, as `ldd` resolves them here.
fn linked_libraries(binary: &Path) -> Vec<PathBuf> {
    let output = Command::new("ldd").arg(binary).output().expect("run ldd");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| {
            let path = l.split("=>").last()?.split_whitespace().next()?;
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect()
}

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

    let (volume_mounts, propagation) = volume_mounts(deployment, node);
    let mut mounts = runtime_mounts();
    mounts.extend(volume_mounts);

    let seccomp_type = if variant.runtime_default_seccomp {
        "RuntimeDefault"
    } else {
        security["seccompProfile"]["type"]
            .as_str()
            .unwrap_or("RuntimeDefault")
    };
    let seccomp = match seccomp_type {
        "Unconfined" => Value::Null,
        "RuntimeDefault" => runtime_default_seccomp(&caps),
        other => panic!("seccompProfile {other} is not translated by this stage"),
    };
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

/// The cgroup every test container is placed under (`cgroupsPath`), removed once empty.
const CGROUP_PARENT: &str = "/plugin-agent-container-test";

/// The `cgroupsPath` of the container `id`.
pub fn cgroup_path(id: &str) -> String {
    format!("{CGROUP_PARENT}/{id}")
}

/// Removes the parent cgroup the runtime made in each hierarchy, where it is empty (the runtime
/// removes the container's own on delete, not the parents it created).
fn remove_cgroup_parent() {
    let hierarchies = std::fs::read_dir("/sys/fs/cgroup")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .chain(std::iter::once(PathBuf::from("/sys/fs/cgroup")));
    for hierarchy in hierarchies {
        let _ = std::fs::remove_dir(hierarchy.join(CGROUP_PARENT.trim_start_matches('/')));
    }
}

/// The OCI runtime the stage uses: `PLUGIN_AGENT_CONTAINER_RUNTIME`, else runc. (Debian
/// bookworm's crun 1.8.1 refuses this CI machine's cgroup v1/v2 hybrid layout outright: "cgroups
/// in hybrid mode not supported"; it is for cgroup v2 hosts.)
pub fn runtime() -> String {
    std::env::var("PLUGIN_AGENT_CONTAINER_RUNTIME").unwrap_or_else(|_| "runc".into())
}

/// A container run by the runtime in the foreground (`runc run`), its output (the agent's
/// JSON log) read as it comes; killed and deleted when dropped.
#[derive(Debug)]
pub struct Container {
    runtime: String,
    id: String,
    state: PathBuf,
    bundle: PathBuf,
    child: Option<Child>,
    log: EventLog,
}

impl Container {
    /// Writes the bundle (`config.json`) and starts the container.
    pub fn run(runtime: &str, node: &Node, id: &str, spec: &Value) -> Container {
        let bundle = node.scratch(&format!("bundle-{id}"));
        std::fs::write(
            bundle.join("config.json"),
            serde_json::to_vec_pretty(spec).expect("a spec serialises"),
        )
        .expect("write config.json");
        let state = node.scratch("runtime-state");
        Container::start(runtime, id, &state, &bundle)
    }

    fn start(runtime: &str, id: &str, state: &Path, bundle: &Path) -> Container {
        let (child, log) = spawn(runtime, id, state, bundle);
        Container {
            runtime: runtime.to_string(),
            id: id.to_string(),
            state: state.to_path_buf(),
            bundle: bundle.to_path_buf(),
            log,
            child: Some(child),
        }
    }

    /// The same container again, after it ended (a pod's container restart: same bundle,
    /// same node, a new process).
    pub fn restart(&mut self) {
        self.delete();
        let (child, log) = spawn(&self.runtime, &self.id, &self.state, &self.bundle);
        self.child = Some(child);
        self.log = log;
    }

    /// The container's output: the agent's JSON log lines (and the runtime's own errors).
    pub fn log(&self) -> &EventLog {
        &self.log
    }

    /// Polls `addr` `path` as kubelet's readiness probe does (every 100 ms here) until it
    /// answers 200; panics with the container's output if the container ends or `timeout`
    /// passes.
    pub fn wait_ready(&mut self, addr: std::net::SocketAddr, path: &str, timeout: Duration) {
        if let Err(why) = self.ready_or_ended(addr, path, timeout) {
            panic!("{path} never answered 200: the container {why}");
        }
    }

    /// [`Container::wait_ready`] for a run that may fail: `Err` with the container's last output
    /// when it ends first or `timeout` passes.
    pub fn ready_or_ended(
        &mut self,
        addr: std::net::SocketAddr,
        path: &str,
        timeout: Duration,
    ) -> Result<(), String> {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if let Ok(200) = crate::http::try_http_get(addr, path).map(|(code, _)| code) {
                return Ok(());
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                return Err(format!("ended ({status}):\n{}", self.log.tail(20)));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(format!(
            "was not ready in {timeout:?}:\n{}",
            self.log.tail(20)
        ))
    }

    /// The container's process on the host (`runc state`): with `hostPID`, the agent's pid.
    pub fn pid(&self) -> Option<u32> {
        let output = Command::new(&self.runtime)
            .arg("--root")
            .arg(&self.state)
            .args(["state", &self.id])
            .output()
            .ok()?;
        let state: Value = serde_json::from_slice(&output.stdout).ok()?;
        state["pid"].as_u64().map(|p| p as u32)
    }

    /// Waits for the container to end by itself (a start-up failure); `None` if it is still
    /// running after `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        let child = self.child.as_mut()?;
        while start.elapsed() < timeout {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Sends `signal` through the runtime (`runc kill`, as containerd does on a pod's
    /// deletion) and waits up to `grace` for the container to end: its exit status and how
    /// long it took.
    pub fn stop(&mut self, signal: &str, grace: Duration) -> (Option<ExitStatus>, Duration) {
        let start = Instant::now();
        let _ = Command::new(&self.runtime)
            .arg("--root")
            .arg(&self.state)
            .args(["kill", &self.id, signal])
            .status();
        let status = self.wait_exit(grace);
        (status, start.elapsed())
    }

    fn delete(&mut self) {
        if let Some(mut child) = self.child.take() {
            if let Ok(None) = child.try_wait() {
                let _ = Command::new(&self.runtime)
                    .arg("--root")
                    .arg(&self.state)
                    .args(["kill", &self.id, "KILL"])
                    .status();
            }
            let _ = child.wait();
        }
        let _ = Command::new(&self.runtime)
            .arg("--root")
            .arg(&self.state)
            .args(["delete", "--force", &self.id])
            .stderr(Stdio::null())
            .status();
        remove_cgroup_parent();
    }
}

/// `RUNTIME --root STATE run --bundle BUNDLE ID` in the foreground, its output read as it comes.
fn spawn(runtime: &str, id: &str, state: &Path, bundle: &Path) -> (Child, EventLog) {
    let mut child = Command::new(runtime)
        .arg("--root")
        .arg(state)
        .args(["run", "--bundle"])
        .arg(bundle)
        .arg(id)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {runtime} (apt: runc, crun): {e}"));
    let stderr = child.stderr.take().expect("piped");
    (
        child,
        EventLog::read_from(stderr, format!("container-{id}")),
    )
}

impl Drop for Container {
    fn drop(&mut self) {
        self.delete();
    }
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
