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
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

mod spec;

pub use spec::{
    RUNTIME_DEFAULT_PROFILE, Variant, quantity_bytes, runtime_default_seccomp, runtime_spec,
};

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
