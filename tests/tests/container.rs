//! The DaemonSet we ship, run for real: the agent inside a real OCI container (runc, or crun
//! with `PLUGIN_AGENT_CONTAINER_RUNTIME=crun`) whose configuration is generated from
//! `deploy/base/daemonset.yaml` and the `deploy/register` overlay (`plugin_agent_tests::container`),
//! host processes playing the node's plugins on the host's directory.
//!
//! Everything is asserted through the agent's contracts as a node sees them: the probes'
//! endpoints, the metrics port on the node's loopback, `plugin-agent status/list/watch` over the
//! admin socket in the host directory the pod mounts, plugin and handler calls.
//!
//! Root only (mounts, runtimes, eBPF); under `CI=true` a skip is a failure. The tests take one
//! lock: the manifest fixes the metrics port, and two pods of one node cannot share it either.

use plugin_agent_tests::admin::{self, Watch};
use plugin_agent_tests::cgroup::TestCgroup;
use plugin_agent_tests::container::{self, Container, Deployment, Image, Node, Variant};
use plugin_agent_tests::env::{agent_bin, privileged};
use plugin_agent_tests::handler::HandlerProcess;
use plugin_agent_tests::http::http_get;
use plugin_agent_tests::{EVENT_TIMEOUT, PluginOptions};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How long the pod may take to become ready (the eBPF programs load in the container).
const READY_TIMEOUT: Duration = Duration::from_secs(90);

/// The agent must end within this after the runtime's SIGTERM (the bound; the manifest's
/// grace period is far longer, so a slow stop would pass kubelet unnoticed).
const STOP_BOUND: Duration = Duration::from_secs(5);

static ONE_POD_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A pod of `deployment` on a fresh node, started and ready.
struct Pod {
    // Dropped first: the container's runtime state lives on the node.
    container: Container,
    deployment: Deployment,
    admin: PathBuf,
    registration_dir: PathBuf,
    plugin_dir_in_pod: PathBuf,
    _node: Node,
}

impl Pod {
    fn config_path(deployment: &Deployment, key: &str) -> PathBuf {
        deployment.agent_config()[key]
            .as_str()
            .map(PathBuf::from)
            .unwrap_or_else(|| panic!("{}: the configuration names no {key}", deployment.name))
    }

    /// Starts the pod on `node` and waits until its readiness probe passes.
    fn start(test: &str, deployment: Deployment, node: Node, variant: &Variant) -> Pod {
        let image = Image::build(&node, &agent_bin());
        let cgroup = container::cgroup_path(test);
        let spec = container::runtime_spec(&deployment, &node, &image, variant, &cgroup);
        let mut container = Container::run(&container::runtime(), &node, test, &spec);
        let (addr, path) = deployment.probe("readinessProbe");
        container.wait_ready(addr, &path, READY_TIMEOUT);
        let plugin_dir_in_pod = Pod::config_path(&deployment, "plugin_dir");
        let admin = deployment.host_path_of(&node, &Pod::config_path(&deployment, "admin_socket"));
        let registration_dir = deployment.host_path_of(&node, &plugin_dir_in_pod);
        Pod {
            _node: node,
            deployment,
            container,
            admin,
            registration_dir,
            plugin_dir_in_pod,
        }
    }

    /// A socket in the registration directory: where a host plugin creates it, and the path
    /// the agent in the pod reports.
    fn socket(&self, name: &str) -> (PathBuf, PathBuf) {
        (
            self.registration_dir.join(name),
            self.plugin_dir_in_pod.join(name),
        )
    }

    fn wait_ready(&mut self) {
        let (addr, path) = self.deployment.probe("readinessProbe");
        self.container.wait_ready(addr, &path, READY_TIMEOUT);
    }
}

fn plugin(socket: &Path) -> PluginOptions {
    PluginOptions::new(env!("CARGO_BIN_EXE_example-plugin"), socket)
}

/// `None` (skip) without root; a failure under `CI=true`.
fn node(test: &str) -> Option<Node> {
    if !privileged(test) {
        return None;
    }
    let node = Node::new();
    assert!(
        node.is_some() || !plugin_agent_tests::env::in_ci(),
        "{test}: cannot make a node (mounts) under CI"
    );
    node
}

fn json(line: &plugin_agent_tests::Line, field: &str) -> Value {
    line.field(field)
        .and_then(|f| serde_json::from_str(&f).ok())
        .unwrap_or(Value::Null)
}

/// The whole life of a pod of `deployment`: start, plugins found (and registered in register
/// mode), provenance and first contact, probes and metrics, a killed plugin, SIGTERM, a
/// container restart that adopts everything.
async fn pod_lifecycle(test: &str, deployment: Deployment, variant: Variant) {
    let _one = ONE_POD_AT_A_TIME.lock().await;
    let Some(node) = node(test) else { return };
    let register = deployment.agent_config()["mode"].as_str() == Some("register");
    // Register mode: the DRA handler the overlay's configuration names, on the node.
    let handler = if register {
        let handlers = deployment.agent_config()["handlers"].clone();
        let target = handlers["DRAPlugin"]
            .as_str()
            .and_then(|t| t.strip_prefix("unix://"))
            .expect("the overlay names a unix:// DRAPlugin handler");
        let socket = deployment.host_path_of(&node, Path::new(target));
        std::fs::create_dir_all(socket.parent().expect("a socket has a directory"))
            .expect("create the handler's directory on the node");
        Some(HandlerProcess::start(env!("CARGO_BIN_EXE_dra-handler"), &socket, &[]).await)
    } else {
        None
    };
    let mut pod = Pod::start(test, deployment, node, &variant);

    // The pod chose eBPF: no silent fallback.
    let status = admin::status(&pod.admin);
    assert_eq!(status["source"], "ebpf", "{test}: status {status}");
    assert_eq!(
        status["mode"].as_str().map(|m| m.starts_with(if register {
            "register"
        } else {
            "observe"
        })),
        Some(true),
        "{test}: {status}"
    );

    // Host plugins: a driver in a cgroup of its own (as a pod's container would be) and a DRA
    // driver; the agent in the pod sees them on the host's directory. Observe mode watches
    // kubelet's directory, where CSI drivers are; the register overlay's handler is for DRA.
    let first_type = if register { "DRAPlugin" } else { "CSIPlugin" };
    let watch = Watch::start(&pod.admin).await;
    let group = TestCgroup::new("csi");
    assert!(
        group.is_some() || !plugin_agent_tests::env::in_ci(),
        "{test}: no cgroup v2 to place the plugin in"
    );
    let (csi_host, csi_pod) = pod.socket("csi.example.test-reg.sock");
    let mut csi = plugin(&csi_host)
        .name("csi.example.test")
        .plugin_type(first_type);
    if register {
        csi = csi.arg("--versions").arg("v1.DRAPlugin");
    }
    if let Some(group) = &group {
        csi = csi.in_cgroup(group);
    }
    let csi = csi.start_listening().await;
    let (dra_host, dra_pod) = pod.socket("dra.example.test-reg.sock");
    let dra = plugin(&dra_host)
        .name("dra.example.test")
        .plugin_type("DRAPlugin")
        .arg("--versions")
        .arg("v1.DRAPlugin")
        .start_listening()
        .await;

    // Kubelet's part: it dials each new socket (observe mode leaves kubelet the first call).
    let mut kubelet = Vec::new();
    for socket in [&csi_host, &dra_host] {
        kubelet.push(std::os::unix::net::UnixStream::connect(socket).expect("dial the plugin"));
    }
    for socket in [&csi_pod, &dra_pod] {
        let contact = json(&watch.wait_for("first_contact", socket).await, "contact");
        assert_eq!(
            contact["process"]["pid"],
            std::process::id(),
            "{test}: {contact}"
        );
    }
    drop(kubelet);

    let outcome = if register { "registered" } else { "observed" };
    for (socket, plugin) in [(&csi_pod, &csi), (&dra_pod, &dra)] {
        let event = watch.wait_for(outcome, socket).await;
        let latency = event
            .field("latency_us")
            .and_then(|l| l.parse::<u64>().ok());
        eprintln!("{test}: {outcome} {} in {latency:?} us", socket.display());
        assert!(
            latency.is_some_and(|us| us < 1_000_000),
            "{test}: {outcome} after {latency:?} us, not within kubelet's 1 s period"
        );
        let provenance = json(&event, "provenance");
        let pid = plugin.pid().expect("the plugin runs");
        assert_eq!(provenance["server"]["pid"], pid, "{test}: {provenance}");
        assert_eq!(
            provenance["creator"]["pid"], pid,
            "{test}: host pid: {provenance}"
        );
    }
    if let Some(group) = &group {
        let row = &admin::list_json(&pod.admin)[&csi_pod];
        let provenance = &row["provenance"];
        assert_eq!(
            provenance["server"]["cgroup"],
            group.path(),
            "{test}: {row}"
        );
        assert_eq!(
            provenance["creator"]["cgroup"],
            group.path(),
            "{test}: {row}"
        );
    }
    if register {
        csi.wait_for_notify(true, EVENT_TIMEOUT).await;
        dra.wait_for_notify(true, EVENT_TIMEOUT).await;
        let handler = handler.as_ref().expect("register mode has its handler");
        handler
            .wait_for_count(
                plugin_agent_tests::Mark(0),
                1,
                "the DRA plugin registered with the handler",
                EVENT_TIMEOUT,
                |l| l.field_is("call", "register") && l.field_is("name", "dra.example.test"),
            )
            .await;
    } else {
        assert!(
            csi.notifications().is_empty() && dra.notifications().is_empty(),
            "{test}: observe mode notified a plugin"
        );
    }

    // The probes and the metrics, where the manifest points them, on the node's loopback.
    for probe in ["livenessProbe", "readinessProbe"] {
        let (addr, path) = pod.deployment.probe(probe);
        assert_eq!(http_get(addr, &path).0, 200, "{test}: {probe} {addr}{path}");
    }
    let (addr, _) = pod.deployment.probe("livenessProbe");
    let (code, metrics) = http_get(addr, "/metrics");
    assert_eq!(code, 200);
    assert!(
        metrics.contains("plugin_agent_kernel_features{"),
        "{test}: metrics without the kernel features"
    );

    // A SIGKILLed host plugin: the agent in the pod sees its server die (pidfd on a host pid).
    dra.kill().await;
    watch.wait_for("unserved", &dra_pod).await;

    // SIGTERM from the runtime: the agent ends, cleanly, well within the bound.
    let (exit, took) = pod.container.stop("TERM", pod.deployment.grace_period());
    eprintln!("{test}: stopped in {took:?} ({exit:?})");
    assert!(
        exit.is_some_and(|s| s.success()),
        "{test}: SIGTERM: {exit:?}\n{}",
        pod.container.log().tail(30)
    );
    assert!(took < STOP_BOUND, "{test}: SIGTERM took {took:?}");

    // A container restart: the same bundle on the same node adopts the pins and the state, and
    // the unchanged plugin hears nothing.
    let csi_mark = csi.mark();
    pod.container.restart();
    pod.wait_ready();
    let status = admin::status(&pod.admin);
    assert_eq!(status["source"], "ebpf", "{test}: {status}");
    assert!(
        status["source_description"]
            .as_str()
            .is_some_and(|d| d.contains("(adopted)")),
        "{test}: the restarted agent did not adopt the pins: {status}"
    );
    let listed = admin::list(&pod.admin);
    let want = if register { "registered" } else { "observed" };
    assert_eq!(
        listed.get(&csi_pod).map(|l| l.state.as_str()),
        Some(want),
        "{test}: {listed:?}"
    );
    assert!(
        !csi.called_since(csi_mark),
        "{test}: the unchanged plugin was called after the restart"
    );
    let (exit, took) = pod.container.stop("TERM", pod.deployment.grace_period());
    assert!(
        exit.is_some_and(|s| s.success()) && took < STOP_BOUND,
        "{test}: {exit:?} {took:?}"
    );
    drop(csi);
    drop(handler);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shipped_daemonset_observes_host_plugins_from_a_real_container() {
    pod_lifecycle("observe", Deployment::observe(), Variant::default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_overlay_registers_host_plugins_from_a_real_container() {
    pod_lifecycle("register", Deployment::register(), Variant::default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shipped_daemonset_works_under_the_runtime_default_seccomp_profile() {
    pod_lifecycle(
        "observe-seccomp",
        Deployment::observe(),
        Variant {
            runtime_default_seccomp: true,
            ..Variant::default()
        },
    )
    .await;
}

/// What a pod does without some of the manifest's capabilities: one row of the table in
/// docs/operations.md ("Least privilege, measured").
async fn measure(test: &str, node: Node, variant: &Variant) -> Vec<String> {
    let deployment = Deployment::observe();
    let removed = match variant.without.as_slice() {
        [] => "(none)".to_string(),
        caps => caps.join(" + "),
    };
    let seccomp = if variant.runtime_default_seccomp {
        "RuntimeDefault"
    } else {
        "Unconfined"
    };
    let image = Image::build(&node, &agent_bin());
    let cgroup = container::cgroup_path(test);
    let spec = container::runtime_spec(&deployment, &node, &image, variant, &cgroup);
    let mut pod = Container::run(&container::runtime(), &node, test, &spec);
    let (addr, path) = deployment.probe("readinessProbe");
    if let Err(why) = pod.ready_or_ended(addr, &path, READY_TIMEOUT) {
        let error = pod
            .log()
            .lines()
            .iter()
            .rev()
            .find_map(|l| l.field("error"))
            .unwrap_or(why);
        let mut cells = vec![removed, seccomp.into(), format!("no: {error}")];
        cells.resize(7, "-".into());
        return cells;
    }
    let admin = deployment.host_path_of(&node, &Pod::config_path(&deployment, "admin_socket"));
    let in_pod = Pod::config_path(&deployment, "plugin_dir");
    let on_host = deployment.host_path_of(&node, &in_pod);
    let status = admin::status(&admin);
    let source = status["source"].as_str().unwrap_or("?").to_string();
    // Why not eBPF, in the agent's words (its status), for the rows that fell back: the clause
    // that says what refused it.
    let passed_over = status["source_description"]
        .as_str()
        .and_then(|d| d.split_once("; passed over ebpf: "))
        .map(|(_, why)| {
            let first_line = why.lines().next().unwrap_or_default();
            let clause = first_line
                .split(": ")
                .find(|c| c.contains("bpf(2) refused"))
                .unwrap_or("programs refused, status says why");
            format!(" (eBPF: {clause})")
        })
        .unwrap_or_default();
    let watch = Watch::start(&admin).await;

    // A root plugin, and one of another user in a directory only that user may enter.
    let root = plugin(&on_host.join("root.sock"))
        .name("root.example.test")
        .start_listening()
        .await;
    let private = on_host.join("nobody");
    std::fs::create_dir(&private).expect("mkdir");
    nix::unistd::chown(&private, Some(65534.into()), Some(65534.into())).expect("chown");
    std::fs::set_permissions(
        &private,
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .expect("chmod");
    let nobody = plugin(&private.join("nobody.sock"))
        .name("nobody.example.test")
        .as_user(65534, 65534)
        .start_listening()
        .await;
    let mut cells = vec![
        removed,
        seccomp.into(),
        "yes".into(),
        format!("{source}{passed_over}"),
    ];
    for (host, name) in [
        (root.socket(), "root.sock"),
        (nobody.socket(), "nobody/nobody.sock"),
    ] {
        // Kubelet's dial: observe mode leaves kubelet the first call.
        let _kubelet = std::os::unix::net::UnixStream::connect(host).expect("dial");
        cells.push(outcome(&watch, &in_pod.join(name), &admin).await);
    }
    let pid = pod.pid().expect("the pod's process");
    let caps = plugin_agent_tests::procfs::caps(pid).expect("read the agent's capabilities");
    cells.push(capability_names(caps.bounding));
    let (exit, took) = pod.stop("TERM", deployment.grace_period());
    assert!(
        exit.is_some() && took < STOP_BOUND,
        "{test}: {exit:?} {took:?}"
    );
    cells
}

/// The manifest's capabilities in a `/proc/PID/status` mask, by name (others counted).
fn capability_names(mask: u64) -> String {
    let known = [
        (1, "DAC_OVERRIDE"),
        (2, "DAC_READ_SEARCH"),
        (8, "SETPCAP"),
        (21, "SYS_ADMIN"),
        (38, "PERFMON"),
        (39, "BPF"),
    ];
    let mut names: Vec<String> = known
        .iter()
        .filter(|(bit, _)| mask & (1u64 << bit) != 0)
        .map(|(_, name)| name.to_string())
        .collect();
    let others = (mask & !known.iter().fold(0, |m, (bit, _)| m | (1u64 << bit))).count_ones();
    if others > 0 {
        names.push(format!("{others} others"));
    }
    match names.is_empty() {
        true => "(none)".into(),
        false => names.join(" "),
    }
}

/// How the agent ended up with a plugin: `observed`, or the event that says otherwise, or what
/// the last walk could not see.
async fn outcome(watch: &Watch, socket: &Path, admin: &Path) -> String {
    let socket_text = socket.display().to_string();
    let kinds = ["observed", "registration_failed", "unserved", "rejected"];
    let found = watch
        .events()
        .wait_for(plugin_agent_tests::Mark(0), OUTCOME_TIMEOUT, |l| {
            l.field_is("socket_path", &socket_text) && kinds.iter().any(|k| l.field_is("kind", k))
        })
        .await;
    match found {
        Ok(line) if line.field_is("kind", "observed") => "observed".into(),
        Ok(line) => format!(
            "{}: {}",
            line.field("kind").unwrap_or_default(),
            line.field("error").unwrap_or_default()
        ),
        Err(_) => format!("not seen; problems: {}", admin::status(admin)["problems"]),
    }
}

/// How long a plugin may go without any outcome before the table says it was not seen (when
/// it works, the outcome takes milliseconds).
const OUTCOME_TIMEOUT: Duration = Duration::from_secs(5);

/// Least privilege, measured: the shipped pod with each capability of the manifest taken out in
/// turn (and the pairs that show which ones stand in for each other), under the manifest's
/// seccomp profile and the runtime's default. The table must be the one docs/operations.md
/// shows, and every capability must be needed by some row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_capability_of_the_manifest_is_needed_and_documented() {
    let test = "capabilities";
    let _one = ONE_POD_AT_A_TIME.lock().await;
    if node(test).is_none() {
        return;
    }
    let caps = Deployment::observe().capabilities();
    let mut variants: Vec<Variant> = std::iter::once(Vec::new())
        .chain(caps.iter().map(|c| vec![c.clone()]))
        .chain([
            vec!["CAP_SYS_ADMIN".to_string(), "CAP_BPF".to_string()],
            vec!["CAP_SYS_ADMIN".to_string(), "CAP_PERFMON".to_string()],
        ])
        .map(|without| Variant {
            without,
            runtime_default_seccomp: false,
        })
        .collect();
    variants.extend(
        [Vec::new(), vec!["CAP_SYS_ADMIN".to_string()]].map(|without| Variant {
            without,
            runtime_default_seccomp: true,
        }),
    );
    let mut rows = Vec::new();
    for (i, variant) in variants.iter().enumerate() {
        let node = node(test).expect("a node, as above");
        rows.push(measure(&format!("{test}-{i}"), node, variant).await);
    }
    let table = rows
        .iter()
        .map(|cells| format!("| {} |", cells.join(" | ")))
        .collect::<Vec<_>>()
        .join("\n");
    eprintln!("{table}");
    let docs = std::fs::read_to_string(container::deploy_dir().join("../docs/operations.md"))
        .expect("read docs/operations.md");
    let documented = docs
        .split_once("<!-- capabilities:begin -->")
        .and_then(|(_, rest)| rest.split_once("<!-- capabilities:end -->"))
        .map(|(table, _)| table)
        .expect("docs/operations.md has the capability table's markers");
    let documented_rows: Vec<&str> = documented
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| removed") && !l.starts_with("|--"))
        .collect();
    assert_eq!(
        documented_rows,
        table.lines().collect::<Vec<_>>(),
        "docs/operations.md's capability table is not what this run measured"
    );
    // Under the runtime's default profile without CAP_SYS_ADMIN, the agent says which call the
    // filter refused, and falls back (the last row).
    let last = rows.last().expect("rows");
    assert!(
        last[3].contains("bpf(2) refused by the process's seccomp filter"),
        "the agent does not name the seccomp refusal: {last:?}"
    );
    let baseline = &rows[0];
    for (cap, row) in caps.iter().zip(&rows[1..]) {
        let pairs_need_it = rows.iter().zip(&variants).any(|(r, v)| {
            v.without.contains(cap) && v.without.len() > 1 && r[2..] != baseline[2..]
        });
        assert!(
            row[2..] != baseline[2..] || pairs_need_it,
            "{cap}: nothing breaks without it, alone or paired: it leaves the manifest"
        );
    }
}
