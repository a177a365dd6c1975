//! The manifests in `deploy/` checked against the agent they deploy: every argument they pass
//! parses with the agent's own command line and configuration code, the probes reach endpoints a
//! real agent serves, and the capabilities granted are exactly what `plugin_agent::privileges`
//! says the agent needs to start plus what it keeps.

use plugin_agent::cli::{Cli, Command as CliCommand, RunArgs};
use plugin_agent::config::ConfigFile;
use plugin_agent::event_source::SourceKind;
use plugin_agent::privileges;
use plugin_agent_tests::{AgentOptions, AgentProcess, PluginDir, Source};
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};

fn deploy(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(file)
}

fn read(file: &str) -> String {
    std::fs::read_to_string(deploy(file)).unwrap_or_else(|e| panic!("deploy/{file}: {e}"))
}

/// Every document of `deploy/base/daemonset.yaml`, as JSON values (easier to index).
fn daemonset_documents() -> Vec<Value> {
    let text = read("base/daemonset.yaml");
    serde_norway::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).expect("every document of daemonset.yaml parses"))
        .collect()
}

fn document(kind: &str) -> Value {
    daemonset_documents()
        .into_iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("daemonset.yaml has no {kind}"))
}

fn container() -> Value {
    let daemonset = document("DaemonSet");
    let containers = daemonset["spec"]["template"]["spec"]["containers"]
        .as_array()
        .expect("containers");
    containers
        .iter()
        .find(|c| c["name"] == "plugin-agent")
        .cloned()
        .expect("a plugin-agent container")
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// `plugin-agent <args>` parsed by the agent's own CLI, expecting `run`.
fn parse_run(args: &[String]) -> RunArgs {
    use clap::Parser;
    let cli = Cli::try_parse_from(
        std::iter::once("plugin-agent".to_string()).chain(args.iter().cloned()),
    )
    .unwrap_or_else(|e| panic!("the agent does not accept {args:?}: {e}"));
    match cli.command {
        CliCommand::Run(run) => *run,
        other => panic!("{args:?} is not `run`: {other:?}"),
    }
}

/// What the agent needs at some point of its life: to start any source, and to keep running,
/// plus CAP_SETPCAP to shrink its bounding set when it drops the rest.
fn needed_capabilities() -> BTreeSet<String> {
    let mut needed: BTreeSet<String> = privileges::KEPT.iter().map(|c| c.to_string()).collect();
    for source in SourceKind::PREFERENCE {
        needed.extend(
            privileges::needed_to_start(source)
                .iter()
                .map(|c| c.to_string()),
        );
    }
    needed.insert("CAP_SETPCAP".into());
    needed
}

#[test]
fn daemonset_has_every_required_field() {
    let docs = daemonset_documents();
    for doc in &docs {
        for field in ["apiVersion", "kind"] {
            assert!(doc[field].is_string(), "a document lacks {field}: {doc}");
        }
        assert!(
            doc["metadata"]["name"].is_string(),
            "unnamed {}",
            doc["kind"]
        );
    }
    let daemonset = document("DaemonSet");
    assert_eq!(daemonset["apiVersion"], "apps/v1");
    let spec = &daemonset["spec"];
    let selector = spec["selector"]["matchLabels"]
        .as_object()
        .expect("spec.selector.matchLabels");
    let labels = &spec["template"]["metadata"]["labels"];
    for (key, value) in selector {
        assert_eq!(
            &labels[key], value,
            "the selector must match the pod template's labels"
        );
    }
    let container = container();
    assert!(container["image"].is_string(), "container image");
    let requests = &container["resources"]["requests"];
    assert!(
        requests["cpu"].is_string() && requests["memory"].is_string(),
        "resource requests"
    );
    assert!(
        container["resources"]["limits"]["memory"].is_string(),
        "a memory limit"
    );
    assert!(
        spec["template"]["spec"]["terminationGracePeriodSeconds"].as_u64() >= Some(30),
        "SIGTERM drains running registrations: give it time"
    );
}

#[test]
fn daemonset_args_parse_with_the_agents_own_command_line() {
    let container = container();
    let run = parse_run(&strings(&container["args"]));
    let config = run.config.clone().expect("the DaemonSet passes --config");
    let mounts = container["volumeMounts"].as_array().expect("volumeMounts");
    let config_mount = mounts
        .iter()
        .find(|m| config.starts_with(m["mountPath"].as_str().unwrap_or("/nonexistent")))
        .unwrap_or_else(|| panic!("{} is on no mounted volume", config.display()));
    let configmap = document("ConfigMap");
    let key = config
        .file_name()
        .and_then(|n| n.to_str())
        .expect("file name");
    let toml = configmap["data"][key]
        .as_str()
        .unwrap_or_else(|| panic!("the ConfigMap has no {key} for {}", config.display()));
    let volume = config_mount["name"].as_str().expect("mount name");
    let volumes = document("DaemonSet")["spec"]["template"]["spec"]["volumes"].clone();
    assert!(
        strings(&Value::Array(
            volumes
                .as_array()
                .expect("volumes")
                .iter()
                .filter(|v| v["name"] == volume)
                .map(|v| v["configMap"]["name"].clone())
                .collect()
        ))
        .contains(
            &configmap["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        ),
        "the config volume must be the ConfigMap"
    );
    let file = ConfigFile::parse(toml).expect("the ConfigMap's TOML parses");
    let settings = run
        .resolve(file, None)
        .expect("the ConfigMap's settings resolve");
    assert!(
        settings.agent.executor.mode.observes(),
        "beside kubelet the DaemonSet observes: {}",
        settings.agent.executor.mode
    );
    assert_eq!(
        settings.agent.plugin_dir,
        PathBuf::from("/var/lib/kubelet/plugins_registry"),
        "it observes kubelet's directory"
    );
    let admin = settings.admin_socket.expect("the admin API is served");
    let admin_dir = admin.parent().expect("admin socket directory");
    assert!(
        mounts
            .iter()
            .any(|m| m["mountPath"] == admin_dir.to_string_lossy().as_ref()),
        "the admin socket's directory {} is a host mount, so operators reach it",
        admin_dir.display()
    );
}

#[test]
fn daemonset_mounts_the_registration_dir_bpffs_btf_and_tracefs_from_the_host() {
    let daemonset = document("DaemonSet");
    let volumes = daemonset["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .expect("volumes")
        .clone();
    let mounts = container()["volumeMounts"]
        .as_array()
        .expect("volumeMounts")
        .clone();
    for path in [
        "/var/lib/kubelet/plugins_registry",
        "/sys/fs/bpf",
        "/sys/kernel/btf",
        "/sys/kernel/tracing",
    ] {
        let volume = volumes
            .iter()
            .find(|v| v["hostPath"]["path"] == path)
            .unwrap_or_else(|| panic!("no hostPath volume for {path}"));
        let mount = mounts
            .iter()
            .find(|m| m["name"] == volume["name"])
            .unwrap_or_else(|| panic!("the hostPath volume for {path} is not mounted"));
        assert_eq!(
            mount["mountPath"], path,
            "{path} is mounted where the agent looks"
        );
    }
    let registry = mounts
        .iter()
        .find(|m| m["mountPath"] == "/var/lib/kubelet/plugins_registry")
        .expect("registry mount");
    assert_eq!(
        registry["mountPropagation"], "HostToContainer",
        "sub-directories mounted on the host after start must be visible"
    );
}

#[test]
fn daemonset_grants_exactly_the_capabilities_the_agent_documents() {
    let security = &container()["securityContext"];
    assert_ne!(
        security["privileged"], true,
        "the agent runs unprivileged with capabilities"
    );
    assert_eq!(strings(&security["capabilities"]["drop"]), ["ALL"]);
    let granted: BTreeSet<String> = strings(&security["capabilities"]["add"])
        .into_iter()
        .map(|c| format!("CAP_{c}"))
        .collect();
    assert_eq!(
        granted,
        needed_capabilities(),
        "capabilities added by the DaemonSet vs. KEPT + needed_to_start(every source) + SETPCAP"
    );
}

/// A free loopback port (bound, then released for the agent).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn http_status(addr: SocketAddr, path: &str) -> u16 {
    let mut stream = TcpStream::connect(addr).expect("connect to the metrics port");
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").expect("request");
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemonset_probes_reach_health_endpoints_the_agent_serves() {
    let container = container();
    let run = parse_run(&strings(&container["args"]));
    let metrics = run.metrics_addr.expect("the DaemonSet sets --metrics-addr");
    let ports = container["ports"].as_array().expect("ports");
    let port = ports
        .iter()
        .find(|p| p["containerPort"].as_u64() == Some(u64::from(metrics.port())))
        .unwrap_or_else(|| panic!("no containerPort {} (the metrics port)", metrics.port()));
    let mut probed = Vec::new();
    for probe in ["livenessProbe", "readinessProbe"] {
        let get = &container[probe]["httpGet"];
        assert!(
            get["port"] == port["name"] || get["port"].as_u64() == Some(u64::from(metrics.port())),
            "{probe} must target the metrics port: {get}"
        );
        probed.push(get["path"].as_str().expect("probe path").to_string());
    }
    assert_eq!(probed, ["/healthz", "/readyz"]);

    // The same paths on a real agent, on a private port.
    let dir = PluginDir::new();
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
    let mut options = AgentOptions::new(Source::Inotify, &dir.root());
    options.extra = vec!["--metrics-addr".into(), addr.to_string()];
    let agent = AgentProcess::start("daemonset_probes", options)
        .await
        .expect("inotify needs no privileges");
    // Serving there, as status says (the agent's own word on what it bound).
    assert_eq!(
        agent.status()["metrics_address"],
        addr.to_string(),
        "the agent serves its metrics where it was told"
    );
    for path in &probed {
        let status = tokio::task::spawn_blocking({
            let path = path.clone();
            move || http_status(addr, &path)
        })
        .await
        .expect("probe");
        assert_eq!(status, 200, "GET {path} on a running agent");
    }
}

#[test]
fn sample_config_parses_and_resolves_with_the_agents_own_code() {
    let file = ConfigFile::load(&deploy("plugin-agent.toml")).expect("deploy/plugin-agent.toml");
    let settings = RunArgs::default()
        .resolve(file.clone(), None)
        .expect("the sample resolves");
    assert_eq!(
        settings.agent.plugin_dir,
        PathBuf::from("/var/lib/kubelet/plugins_registry")
    );
    assert!(
        file.metrics_addr.is_some(),
        "the sample documents metrics_addr"
    );
    assert!(
        file.admin_socket.is_some(),
        "the sample documents admin_socket"
    );
}

/// `Key=value` lines of the `[Service]` section, in order.
fn service_settings(unit: &str) -> Vec<(String, String)> {
    let mut section = String::new();
    let mut settings = Vec::new();
    for line in unit.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if line.starts_with('[') {
            section = line.to_string();
            continue;
        }
        let (key, value) = line
            .split_once('=')
            .unwrap_or_else(|| panic!("not a Key=value line: {line:?}"));
        if section == "[Service]" {
            settings.push((key.trim().to_string(), value.trim().to_string()));
        }
    }
    settings
}

#[test]
fn systemd_unit_bounding_set_covers_what_the_agent_needs() {
    let settings = service_settings(&read("plugin-agent.service"));
    let get = |key: &str| {
        settings
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .collect::<Vec<_>>()
    };
    let bounding: BTreeSet<String> = get("CapabilityBoundingSet")
        .iter()
        .flat_map(|v| v.split_whitespace().map(String::from).collect::<Vec<_>>())
        .collect();
    let needed = needed_capabilities();
    let missing: Vec<_> = needed.difference(&bounding).collect();
    assert!(
        missing.is_empty(),
        "CapabilityBoundingSet lacks {missing:?}"
    );
    let extra: Vec<_> = bounding.difference(&needed).collect();
    assert!(
        extra.is_empty(),
        "CapabilityBoundingSet grants {extra:?}, which the agent never uses"
    );
    assert_eq!(get("NoNewPrivileges"), ["yes"]);
    assert_eq!(
        get("KillSignal"),
        ["SIGTERM"],
        "SIGTERM drains running operations"
    );

    let exec = get("ExecStart").pop().expect("ExecStart");
    let mut words = exec.split_whitespace().map(String::from);
    let program = words.next().expect("program");
    assert!(
        program.ends_with("/plugin-agent"),
        "ExecStart runs the agent"
    );
    let run = parse_run(&words.collect::<Vec<_>>());
    assert!(
        run.config.is_some(),
        "the unit runs from the configuration file"
    );
}

#[test]
fn systemd_unit_passes_systemd_analyze_verify() {
    let Ok(which) = std::process::Command::new("systemd-analyze")
        .arg("--version")
        .output()
    else {
        eprintln!("systemd-analyze is not installed: the unit is checked by the parser test only");
        return;
    };
    assert!(which.status.success());
    // verify insists that ExecStart exists: point it at the binary under test.
    let dir = tempfile::tempdir().expect("tempdir");
    let unit = read("plugin-agent.service").replace(
        "/usr/local/bin/plugin-agent",
        &plugin_agent_tests::env::agent_bin().display().to_string(),
    );
    let path = dir.path().join("plugin-agent.service");
    std::fs::write(&path, unit).expect("write unit");
    let output = std::process::Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .expect("systemd-analyze verify");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let about_unit: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("plugin-agent.service"))
        .collect();
    assert!(
        output.status.success() && about_unit.is_empty(),
        "systemd-analyze verify: {}\n{stderr}",
        output.status
    );
}

#[test]
fn containerfile_runs_the_binary_it_builds_with_arguments_the_agent_accepts() {
    let text = read("Containerfile");
    let instruction = |name: &str| {
        text.lines()
            .filter(|l| l.starts_with(name))
            .map(|l| l[name.len()..].trim().to_string())
            .collect::<Vec<_>>()
    };
    let json_words = |s: &str| -> Vec<String> {
        serde_json::from_str(s).unwrap_or_else(|e| panic!("exec form expected: {s}: {e}"))
    };
    let entrypoint = json_words(&instruction("ENTRYPOINT").pop().expect("ENTRYPOINT"));
    let copies = instruction("COPY");
    assert!(
        copies.iter().any(|c| c.ends_with(&entrypoint[0])),
        "ENTRYPOINT {} is copied into the image",
        entrypoint[0]
    );
    let cmd = json_words(&instruction("CMD").pop().expect("CMD"));
    let run = parse_run(&cmd);
    let config = run.config.expect("CMD passes --config");
    assert!(
        copies
            .iter()
            .any(|c| c.ends_with(&*config.to_string_lossy())),
        "{} is copied into the image",
        config.display()
    );
}

/// Issue 22, item 4: the DaemonSet bound metrics on 0.0.0.0, where any process or pod could flood
/// them. They are on the node's loopback, in the host network, where only the kubelet's probes
/// and a node-local scraper reach them.
#[test]
fn daemonset_serves_metrics_on_the_node_loopback_only_and_probes_reach_them_there() {
    let daemonset = document("DaemonSet");
    let pod = &daemonset["spec"]["template"]["spec"];
    assert_eq!(pod["hostNetwork"], true, "loopback must be the node's");
    assert_eq!(
        pod["dnsPolicy"], "ClusterFirstWithHostNet",
        "cluster DNS (an OTLP collector's service name) still resolves on the host network"
    );
    let container = container();
    let run = parse_run(&strings(&container["args"]));
    let metrics = run.metrics_addr.expect("the DaemonSet sets --metrics-addr");
    assert!(metrics.ip().is_loopback(), "metrics on {metrics}");
    for probe in ["livenessProbe", "readinessProbe"] {
        assert_eq!(
            container[probe]["httpGet"]["host"], "127.0.0.1",
            "{probe} must probe the loopback address the agent serves on"
        );
    }
    let env = container["env"].as_array().expect("env");
    assert!(
        env.iter().any(|e| e["name"] == "HOST_IP"
            && e["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"),
        "HOST_IP is offered for --metrics-addr=$(HOST_IP):9464"
    );
}

/// The register-mode overlay (`kubectl apply -k deploy/register`): its configuration registers
/// with a handler on a directory that is not kubelet's, and its JSON patches point at the base
/// DaemonSet's registration volume and mount, so the host directory is where the agent watches.
#[test]
fn register_overlay_registers_on_a_directory_the_agent_owns_and_patches_the_right_volume() {
    let overlay = read("register/configmap.yaml");
    let configmap: Value = serde_norway::from_str(&overlay).expect("register/configmap.yaml");
    let toml = configmap["data"]["plugin-agent.toml"]
        .as_str()
        .expect("the overlay's plugin-agent.toml");
    let settings = RunArgs::default()
        .resolve(ConfigFile::parse(toml).expect("parses"), None)
        .expect("resolves");
    assert_eq!(
        settings.agent.executor.mode,
        plugin_agent::mode::Mode::Register
    );
    assert!(!settings.handlers.is_empty(), "register mode has a handler");
    let owned = settings.agent.plugin_dir.clone();
    assert!(
        !owned.starts_with("/var/lib/kubelet"),
        "{} is not kubelet's",
        owned.display()
    );
    let kustomization: Value =
        serde_norway::from_str(&read("register/kustomization.yaml")).expect("kustomization");
    let patch_text = kustomization["patches"]
        .as_array()
        .expect("patches")
        .iter()
        .find_map(|p| p["patch"].as_str())
        .expect("the DaemonSet patch");
    let patch: Value = serde_norway::from_str(patch_text).expect("the JSON patch");
    let daemonset = document("DaemonSet");
    for op in patch.as_array().expect("ops") {
        let path = op["path"].as_str().expect("path");
        let target = daemonset
            .pointer(path)
            .unwrap_or_else(|| panic!("{path} is not in the base DaemonSet"));
        assert!(
            target == "/var/lib/kubelet/plugins_registry",
            "{path} is the registration directory's: {target}"
        );
        assert_eq!(op["value"].as_str(), Some(owned.to_str().expect("utf-8")));
    }
}
