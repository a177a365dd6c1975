//! `--source auto` picks the best source this kernel and build allow, and says so: eBPF here (a
//! kernel with BTF and syscall tracepoints, the agent built with `cargo xtask`, root).

use plugin_agent_tests::events::EventLog;
use plugin_agent_tests::{EVENT_TIMEOUT, Mark, PluginDir, env};
use std::process::{Command, Stdio};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_picks_ebpf_where_the_kernel_and_build_allow_it() {
    let test = "auto_picks_ebpf_where_the_kernel_and_build_allow_it";
    if !env::privileged(test) {
        return;
    }
    let dir = PluginDir::new();
    let mut agent = Command::new(env::agent_bin())
        .args([
            "--log-format",
            "json",
            "run",
            "--source",
            "auto",
            "--no-metrics",
            "--plugin-dir",
        ])
        .arg(dir.root())
        .arg("--admin-socket")
        .arg(dir.outside("admin.sock"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start plugin-agent");
    let log = EventLog::read_from(agent.stderr.take().expect("piped"), test.into());
    let open = log
        .wait_for(Mark(0), EVENT_TIMEOUT * 3, |l| {
            l.message() == "event source open"
        })
        .await;
    let _ = agent.kill();
    let _ = agent.wait();
    let open =
        open.unwrap_or_else(|e| panic!("{test}: no source opened ({e:?}):\n{}", log.tail(20)));
    let source = open.field("source").unwrap_or_default();
    if source != "ebpf" {
        let why = log.tail(20);
        if why.contains("built without the eBPF") && !env::in_ci() {
            env::skip(
                test,
                "this plugin-agent has no eBPF source (build it with `cargo xtask test`)",
            );
            return;
        }
        panic!("{test}: auto chose {source:?} instead of ebpf:\n{why}");
    }
    // Which hooks: fentry/fexit where the kernel allows them, else syscall tracepoints with the
    // reason the preferred family was passed over (this machine: EPERM by kernel policy).
    let attached = open.field("attached").unwrap_or_default();
    assert!(
        attached.contains("hooks: fentry/fexit: fexit vfs_mknod")
            || (attached.contains("hooks: syscall tracepoints (passed over fentry/fexit: ")
                && attached.contains("tracepoint syscalls/sys_exit_bind")),
        "{test}: the open line does not say which hooks are attached and why: {attached}"
    );
    // A policy that refuses fentry (EPERM) refuses the layout child's probe too: the agent then
    // loads no program of that family (docs/operations.md, "Memory").
    if attached.contains("(passed over fentry/fexit: ") && attached.contains("EPERM") {
        assert!(
            attached.contains(
                "passed over fentry/fexit: a probe (a trivial fentry program on bpf_fentry_test1) \
                 refused by the kernel (EPERM"
            ),
            "{test}: fentry refused by policy, yet not by the probe: {attached}"
        );
    }
    let chosen = log.matching_since(Mark(0), |l| {
        l.message() == "event source chosen automatically"
    });
    assert_eq!(
        chosen.len(),
        1,
        "{test}: the choice is logged once:\n{}",
        log.tail(20)
    );
}

/// `status`, the metric and `plugin-agent probe` say the same of the kernel, and it is the
/// kernel's truth: fentry as the hook selection found it, `SO_PEERPIDFD` and pidfs as this test
/// finds them itself. Run on every kernel `cargo xtask vm-test` boots, the answers differ (6.1:
/// fentry, no `SO_PEERPIDFD`, no pidfs; the build machine's 6.18: the reverse).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_metrics_and_probe_report_what_this_kernel_gives() {
    use plugin_agent_tests::admin;
    use plugin_agent_tests::http::{http_get, metrics_addr};
    use plugin_agent_tests::{AgentOptions, AgentProcess, Source};
    use std::collections::BTreeMap;

    let test = "status_metrics_and_probe_report_what_this_kernel_gives";
    let dir = PluginDir::new();
    let mut options = AgentOptions::new(Source::Ebpf, &dir.root());
    options.extra = vec!["--metrics-addr".into(), "127.0.0.1:0".into()];
    let admin_socket = options.admin_socket.clone();
    let Some(agent) = AgentProcess::start(test, options).await else {
        return;
    };
    let status = admin::status(&admin_socket);
    let features: BTreeMap<String, String> = status["kernel_features"]
        .as_array()
        .unwrap_or_else(|| panic!("{test}: no kernel_features in {status}"))
        .iter()
        .map(|f| {
            let name = f["feature"].as_str().unwrap_or_default().to_owned();
            (name, f["available"].as_str().unwrap_or_default().to_owned())
        })
        .collect();
    let names: Vec<&str> = features.keys().map(String::as_str).collect();
    assert_eq!(
        names,
        [
            "btf",
            "fentry",
            "pidfd",
            "pidfs",
            "ring_buffer",
            "so_peerpidfd"
        ],
        "{test}: {status}"
    );
    // The eBPF source opened: the kernel has BTF, a ring buffer, and says what became of fentry.
    assert_eq!(features["btf"], "true", "{test}: {status}");
    assert_eq!(features["ring_buffer"], "true", "{test}: {status}");
    let description = status["source_description"].as_str().unwrap_or_default();
    let fentry = if description.starts_with("eBPF hooks: fentry/fexit") {
        "true"
    } else if description.contains("passed over fentry/fexit") {
        "false"
    } else {
        "unknown"
    };
    assert_eq!(features["fentry"], fentry, "{test}: {description}");
    assert_eq!(
        features["so_peerpidfd"],
        available(peer_pidfd_works()),
        "{test}"
    );
    assert_eq!(features["pidfs"], available(pidfd_on_pidfs()), "{test}");
    assert_eq!(
        features["pidfd"], "true",
        "{test}: every kernel of the matrix has it"
    );

    // The metric: one series per feature, the same availability.
    let (code, body) = http_get(metrics_addr(&agent).await, "/metrics");
    assert_eq!(code, 200, "{test}");
    for (feature, availability) in &features {
        let series = format!(
            "plugin_agent_kernel_features{{feature=\"{feature}\",available=\"{availability}\"}} 1"
        );
        assert!(body.contains(&series), "{test}: no `{series}` in:\n{body}");
    }
    assert_eq!(
        body.matches("plugin_agent_kernel_features{").count(),
        features.len(),
        "{test}: one series per feature"
    );

    // `probe`, with no agent involved, finds the same (it loads fentry itself: the same answer).
    let probe = Command::new(env::agent_bin())
        .args(["probe", "-o", "json"])
        .output()
        .expect("run plugin-agent probe");
    assert!(
        probe.status.success(),
        "{test}: probe failed: {}",
        String::from_utf8_lossy(&probe.stderr)
    );
    let probe: serde_json::Value = serde_json::from_slice(&probe.stdout).expect("probe JSON");
    for f in probe["features"].as_array().expect("features") {
        let name = f["feature"].as_str().unwrap_or_default();
        assert_eq!(
            f["available"].as_str(),
            features.get(name).map(String::as_str),
            "{test}: probe and status disagree on {name}: {probe}"
        );
    }
    let loaded = |family: &str| {
        probe["families"]
            .as_array()
            .and_then(|all| all.iter().find(|f| f["family"] == family))
            .map(|f| f["loaded"] == true)
    };
    assert_eq!(loaded("fentry"), Some(fentry == "true"), "{test}: {probe}");
    assert_eq!(loaded("tracepoints"), Some(true), "{test}: {probe}");
    agent.stop().await;
}

fn available(yes: bool) -> &'static str {
    if yes { "true" } else { "false" }
}

/// `SO_PEERPIDFD` on a socket pair (Linux 6.5).
fn peer_pidfd_works() -> bool {
    use std::os::fd::AsRawFd;
    let (one, _other) = std::os::unix::net::UnixStream::pair().expect("socketpair");
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `fd`.
    let rc = unsafe {
        libc::getsockopt(
            one.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERPIDFD,
            (&raw mut fd).cast(),
            &raw mut len,
        )
    };
    if rc == 0 && fd >= 0 {
        // SAFETY: the kernel gave us this descriptor.
        unsafe { libc::close(fd) };
        return true;
    }
    false
}

/// Whether a pidfd of this process lives on pidfs (Linux 6.9).
fn pidfd_on_pidfs() -> bool {
    // SAFETY: pidfd_open takes a pid and flags.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, libc::getpid(), 0) } as libc::c_int;
    assert!(fd >= 0, "pidfd_open: {}", std::io::Error::last_os_error());
    let mut fs = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: `fs` is written by fstatfs before it is read.
    let rc = unsafe { libc::fstatfs(fd, fs.as_mut_ptr()) };
    // SAFETY: our descriptor.
    unsafe { libc::close(fd) };
    assert_eq!(rc, 0, "fstatfs");
    // SAFETY: fstatfs returned 0.
    let magic = unsafe { fs.assume_init() }.f_type;
    magic == 0x5049_4446
}
