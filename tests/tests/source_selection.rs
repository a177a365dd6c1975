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
