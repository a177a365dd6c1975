//! A plugin is registered only while something serves it (`agent/src/liveness.rs`).
//!
//! Each scenario runs on every source, since none of this depends on how sockets are found: the
//! server's exit is learned from the pidfd taken at registration, a refused connect decides that
//! nothing serves the socket any more, and an unserved socket is neither registered nor retried
//! until it changes. Every assertion names the mechanism the agent reported (`learned_by`).

use plugin_agent_tests::handler::HandlerProcess;
use plugin_agent_tests::{
    AgentOptions, AgentProcess, EVENT_TIMEOUT, Line, Mark, PluginDir, Scenario, Source, admin,
    per_source, plugin, seen, test_name,
};
use std::path::Path;

per_source!(
    a_sigkilled_plugin_is_deregistered_as_unserved_and_registered_again_when_restarted,
    a_plugin_that_hands_its_listener_to_a_child_and_exits_stays_registered,
    the_death_of_the_process_a_listener_was_handed_to_is_unserved,
    a_listener_taken_by_another_process_is_followed_to_it_and_its_death_is_unserved,
    a_stale_socket_at_start_is_unserved_at_once_and_never_retried,
    after_an_agent_restart_a_restored_plugin_is_watched_and_one_that_died_meanwhile_is_unserved,
    an_unserved_socket_registers_when_it_listens_by_the_kernel_s_report_or_the_safety_pass,
);

/// The agent reported the plugin at `socket` unserved, learned by `how`.
fn unserved<'a>(socket: &'a Path, how: &'a str) -> impl Fn(&Line) -> bool + 'a {
    move |l| seen::unserved(socket)(l) && learned_by(l) == how
}

/// The agent reported the plugin at `socket` unserved, learned by one of `how`.
fn unserved_by<'a>(socket: &'a Path, how: &'a [&'a str]) -> impl Fn(&Line) -> bool + 'a {
    move |l| seen::unserved(socket)(l) && how.contains(&learned_by(l).as_str())
}

/// How an `unserved` event's loss was learned: its error reads `unserved (HOW): what was found`
/// (`list`'s last error for the socket too).
fn learned_by(l: &Line) -> String {
    unserved_how(&l.field("error").unwrap_or_default())
}

/// `HOW` in `unserved (HOW): ...`.
fn unserved_how(said: &str) -> String {
    said.strip_prefix("unserved (")
        .and_then(|rest| rest.split_once(')'))
        .map(|(how, _)| how.to_string())
        .unwrap_or_default()
}

/// How a server's death is learned by `agent`: its pidfd; with eBPF on fentry also (usually
/// first) `unix_release`, which runs while the dying process's descriptors are closed (status
/// names the hooks attached).
fn death_learned_by(agent: &AgentProcess) -> &'static [&'static str] {
    let status = admin::status(agent.admin_socket());
    let fentry = status["source_description"]
        .as_str()
        .is_some_and(|hooks| hooks.contains("fentry unix_release"));
    if fentry {
        &["pidfd", "kernel_release"]
    } else {
        &["pidfd"]
    }
}

/// Waits until `list` shows `socket` unserved, learned by `how` (for a socket found unserved by
/// the start walk, perhaps before the test followed the agent's events).
async fn listed_unserved(agent: &AgentProcess, socket: &Path, how: &str) {
    let listed = agent.wait_listed(socket, "unserved").await;
    let said = listed.last_error.unwrap_or_default();
    assert_eq!(unserved_how(&said), how, "{}: {said}", socket.display());
}

fn state_of(admin_socket: &Path, socket: &Path) -> admin::Listed {
    admin::list(admin_socket)
        .remove(socket)
        .unwrap_or_else(|| panic!("{} is not listed", socket.display()))
}

/// SIGKILL (what the OOM killer sends) leaves the socket behind: the pidfd wakes the agent, one
/// refused connect confirms, the handler gets DeRegister, and `list` says `unserved` with how it
/// was learned. No registration is attempted while the socket stays; the restarted plugin (a new
/// socket at the same path) registers at once.
async fn a_sigkilled_plugin_is_deregistered_as_unserved_and_registered_again_when_restarted(
    source: Source,
) {
    let Some(s) = Scenario::start(source).await else {
        return;
    };
    let socket = s.dir.path("crashy.sock");
    let plugin = plugin!(&socket).name("crashy").spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    s.agent
        .wait_for_event(
            Mark(0),
            "registered",
            EVENT_TIMEOUT,
            seen::registered(&socket),
        )
        .await;
    let mark = s.agent.event_mark();
    let how = death_learned_by(&s.agent);
    plugin.kill().await;
    assert!(
        socket.exists(),
        "{}: a SIGKILLed plugin leaves its socket",
        s.test
    );
    let lost = s
        .agent
        .wait_for_event(
            mark,
            "unserved, learned by pidfd (or unix_release on fentry)",
            EVENT_TIMEOUT,
            unserved_by(&socket, how),
        )
        .await;
    let how_learned = learned_by(&lost);
    s.agent
        .wait_for_event(
            mark,
            "the handler told",
            EVENT_TIMEOUT,
            seen::deregistered(&socket),
        )
        .await;
    let listed = state_of(&s.dir.root().with_file_name("admin.sock"), &socket);
    assert_eq!(listed.state, "unserved", "{}: {listed:?}", s.test);
    let why = listed.last_error.unwrap_or_default();
    assert!(
        !how_learned.is_empty() && unserved_how(&why) == how_learned,
        "{}: the reason names how ({how_learned}): {why}",
        s.test
    );
    assert!(
        s.agent
            .events_since(mark, seen::registration_failed(&socket))
            .is_empty(),
        "{}: an unserved socket is not retried",
        s.test
    );

    let restarted = plugin!(&socket).name("crashy").spawn();
    restarted.wait_for_notify(true, EVENT_TIMEOUT).await;
    s.agent
        .wait_for_event(
            mark,
            "the restarted plugin registered",
            EVENT_TIMEOUT,
            seen::registered(&socket),
        )
        .await;
    assert_eq!(
        state_of(&s.dir.root().with_file_name("admin.sock"), &socket).state,
        "registered"
    );
}

/// A listener handed to a child (socket activation, fd passing) outlives the process the
/// socket's credentials name: its exit wakes the agent, the connect succeeds, the child is found
/// holding the listener, and the plugin stays registered (no DeRegister, no Notify again).
async fn a_plugin_that_hands_its_listener_to_a_child_and_exits_stays_registered(source: Source) {
    let Some(s) = Scenario::start(source).await else {
        return;
    };
    let socket = s.dir.path("activated.sock");
    let mut plugin = plugin!(&socket).name("activated").arg("--hand-off").spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    s.agent
        .wait_for_event(
            Mark(0),
            "registered",
            EVENT_TIMEOUT,
            seen::registered(&socket),
        )
        .await;
    let events = s.agent.event_mark();
    plugin.hand_off(EVENT_TIMEOUT).await;
    s.agent
        .wait_for_event(
            events,
            "the server's exit noticed and the listener found alive in the child",
            EVENT_TIMEOUT,
            holders_followed(&socket),
        )
        .await;
    assert!(
        s.agent
            .events_since(events, |l| seen::deregistered(&socket)(l)
                || unserved(&socket, "pidfd")(l))
            .is_empty(),
        "{}: a handed-on listener is not a lost plugin",
        s.test
    );
    let admin = s.dir.root().with_file_name("admin.sock");
    assert_eq!(state_of(&admin, &socket).state, "registered");
    // `list` says who serves it now: the processes holding its listener.
    let row = admin::list_json(&admin).remove(&socket).expect("listed");
    assert_eq!(seen::learned_by(&row["serving"]), "holders", "{row}");
    assert_eq!(
        plugin.notifications().len(),
        1,
        "{}: the plugin was not registered again",
        s.test
    );
}

/// A socket nobody listens on when the agent starts (a plugin that died before a reboot, say:
/// node-driver-registrar #206) is unserved after the short listen wait, not put through the
/// backoff chain; a plugin that then binds the path registers at once.
async fn a_stale_socket_at_start_is_unserved_at_once_and_never_retried(source: Source) {
    let test = test_name();
    let dir = PluginDir::new();
    let socket = dir.path("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&socket).expect("bind a socket, then close it"));
    let options = AgentOptions::new(source, &dir.root());
    let admin_socket = options.admin_socket.clone();
    let Some(agent) = AgentProcess::start(&test, options).await else {
        return;
    };
    listed_unserved(&agent, &socket, "connect_probe").await;
    assert!(
        agent
            .events_since(Mark(0), seen::registration_failed(&socket))
            .is_empty(),
        "{test}: no backoff chain for a socket nobody listens on"
    );
    assert_eq!(state_of(&admin_socket, &socket).state, "unserved");

    let plugin = plugin!(&socket).name("fresh").spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    agent
        .wait_for_event(
            Mark(0),
            "registered",
            EVENT_TIMEOUT,
            seen::registered(&socket),
        )
        .await;
    assert_eq!(state_of(&admin_socket, &socket).state, "registered");
}

/// Issue 44, item 7: with 100,000 dead sockets in the tree, each was dialled ~6 times over the
/// walk-found socket's 1 s listen wait, holding a slot for that second (38 CPU s at start). The
/// wait counts from the socket's birth: one bound longer ago than that is unserved at its first
/// refused connect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_bound_longer_ago_than_the_listen_wait_is_not_waited_for() {
    let test = test_name();
    let dir = PluginDir::new();
    let socket = dir.path("long-dead.sock");
    drop(std::os::unix::net::UnixListener::bind(&socket).expect("bind a socket, then close it"));
    // Older than the 1 s a socket found by a walk may take to listen.
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let mut options = AgentOptions::new(Source::Inotify, &dir.root());
    options
        .extra
        .extend(["--metrics-addr".into(), "127.0.0.1:0".into()]);
    let admin_socket = options.admin_socket.clone();
    let Some(agent) = AgentProcess::start(&test, options).await else {
        return;
    };
    let addr = plugin_agent_tests::http::metrics_addr(&agent).await;
    listed_unserved(&agent, &socket, "connect_probe").await;
    assert_eq!(state_of(&admin_socket, &socket).state, "unserved");
    let (_, metrics) =
        tokio::task::spawn_blocking(move || plugin_agent_tests::http::http_get(addr, "/metrics"))
            .await
            .expect("scrape");
    let dialled: f64 = metrics
        .lines()
        .filter(|l| {
            l.starts_with("plugin_agent_plugin_call_duration_seconds_sum{")
                && l.contains("call=\"dial\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(
        dialled < 0.5,
        "{test}: the dial waited {dialled} s for a socket bound 1.5 s before (want one refused connect)"
    );
}

/// A restored registration has no registration connection: the new agent learns its server with
/// a bare connect (no GetInfo, no Notify) and watches it from then on; one whose plugin died
/// while no agent ran is refused and unserved at once.
async fn after_an_agent_restart_a_restored_plugin_is_watched_and_one_that_died_meanwhile_is_unserved(
    source: Source,
) {
    let test = test_name();
    let dir = PluginDir::new();
    // A handler whose call log says what it was told by either agent.
    let handler = HandlerProcess::start(
        env!("CARGO_BIN_EXE_dra-handler"),
        &dir.outside("handler.sock"),
        &[],
    )
    .await;
    let mut options = AgentOptions::new(source, &dir.root())
        .handlers(&[&format!("DRAPlugin={}", handler.target())]);
    options.admin_socket = dir.outside("admin.sock");
    let Some(first) = AgentProcess::start(&test, options.clone()).await else {
        return;
    };
    let (alive, dying) = (dir.path("alive.sock"), dir.path("dying.sock"));
    let dra = |socket: &Path, name: &str| {
        plugin!(socket)
            .plugin_type("DRAPlugin")
            .name(name)
            .arg("--versions")
            .arg("v1.DRAPlugin")
            .spawn()
    };
    let alive_plugin = dra(&alive, "alive");
    let dying_plugin = dra(&dying, "dying");
    for socket in [&alive, &dying] {
        first
            .wait_for_event(
                Mark(0),
                "registered",
                EVENT_TIMEOUT,
                seen::registered(socket),
            )
            .await;
    }
    first.stop().await;
    dying_plugin.kill().await;

    let second = AgentProcess::start(&test, options.clone())
        .await
        .expect("started once");
    listed_unserved(&second, &dying, "connect_probe").await;
    let endpoint = dying.display().to_string();
    handler
        .wait_for_count(Mark(0), 1, "its handler told", EVENT_TIMEOUT, |l| {
            l.field_is("call", "deregister") && l.field_is("endpoint", &endpoint)
        })
        .await;
    assert_eq!(
        alive_plugin.events_since(Mark(0), "get_info").len(),
        1,
        "{test}: the restored plugin was not called again"
    );
    // Learned after the start walk, perhaps before the test followed the events: `list` says
    // how the agent knows its server, once it does.
    let learned = second
        .wait_until("the restored plugin's server learned", || {
            let row = admin::list_json(&options.admin_socket).remove(&alive)?;
            let serving = row.get("serving")?;
            let how = seen::learned_by(serving);
            (how == "record" || how == "connect_probe").then(|| serving.clone())
        })
        .await;
    // Where the first agent recorded its server's pidfs inode (Linux 6.9+), the server is found
    // again by that record, with no connection to the plugin; otherwise one connect learns it.
    let state_file = options
        .admin_socket
        .parent()
        .expect("the admin socket has a directory")
        .join("state.json");
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&state_file).expect("the first agent's state file"),
    )
    .expect("JSON");
    let recorded = state["plugins"]
        .as_array()
        .expect("plugins")
        .iter()
        .find(|p| p["path"].as_str() == Some(&*alive.to_string_lossy()))
        .is_some_and(|p| p["server"]["pidfs_ino"].is_u64());
    assert_eq!(
        seen::learned_by(&learned),
        if recorded { "record" } else { "connect_probe" },
        "{test}: how the restored plugin's server was found (recorded: {recorded}): {learned}"
    );
    assert_eq!(
        seen::serving_pids(&learned),
        [u64::from(alive_plugin.pid().expect("running"))],
        "{test}: its server: {learned}"
    );
    let mark = second.event_mark();
    let how = death_learned_by(&second);
    alive_plugin.kill().await;
    second
        .wait_for_event(
            mark,
            "the restored plugin's death, learned by pidfd (or unix_release on fentry)",
            EVENT_TIMEOUT,
            unserved_by(&alive, how),
        )
        .await;
    assert_eq!(state_of(&options.admin_socket, &alive).state, "unserved");
}

/// eBPF only: a listener closed while its process lives on has no exit to wake the agent; the
/// kernel's report of the close does, and one refused connect confirms it. (Other sources do not
/// see it: the plugin stays registered until its socket changes, as documented.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ebpf_a_listener_closed_while_its_process_lives_is_unserved_on_the_kernel_s_report() {
    let Some(s) = Scenario::start(Source::Ebpf).await else {
        return;
    };
    let socket = s.dir.path("closing.sock");
    let plugin = plugin!(&socket)
        .name("closing")
        .arg("--close-listener-on-sigusr2")
        .spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    s.agent
        .wait_for_event(
            Mark(0),
            "registered",
            EVENT_TIMEOUT,
            seen::registered(&socket),
        )
        .await;
    let mark = s.agent.event_mark();
    plugin.signal(nix::sys::signal::Signal::SIGUSR2);
    plugin
        .wait_for_event("listener_closed", EVENT_TIMEOUT)
        .await;
    s.agent
        .wait_for_event(
            mark,
            "unserved, learned from the kernel's close report",
            EVENT_TIMEOUT,
            unserved(&socket, "kernel_release"),
        )
        .await;
    s.agent
        .wait_for_event(
            mark,
            "the handler told",
            EVENT_TIMEOUT,
            seen::deregistered(&socket),
        )
        .await;
    assert!(plugin.pid().is_some(), "{}: the plugin still runs", s.test);
    assert_eq!(
        state_of(&s.dir.root().with_file_name("admin.sock"), &socket).state,
        "unserved"
    );
}

/// A socket unserved at start (bound, nobody listening) registers once its plugin listens: with
/// eBPF the moment it does, on the kernel's report of the `listen`; with the other sources at the
/// reconciler's safety pass, which connects once to each unserved socket. Nothing retried it
/// meanwhile.
async fn an_unserved_socket_registers_when_it_listens_by_the_kernel_s_report_or_the_safety_pass(
    source: Source,
) {
    let test = test_name();
    let dir = PluginDir::new();
    let socket = dir.path("late.sock");
    let plugin = plugin!(&socket)
        .name("late")
        .arg("--listen-on-sigusr2")
        .spawn();
    plugin
        .wait_for_event("waiting_for_sigusr2", EVENT_TIMEOUT)
        .await;
    let mut options = AgentOptions::new(source, &dir.root());
    if source != Source::Ebpf {
        // Short, so the test is; eBPF keeps the 30 s default, which cannot beat its listen report.
        options.extra = vec!["--safety-period".into(), "2s".into()];
    }
    let Some(agent) = AgentProcess::start(&test, options).await else {
        return;
    };
    listed_unserved(&agent, &socket, "connect_probe").await;
    plugin.signal(nix::sys::signal::Signal::SIGUSR2);
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    let how = if source == Source::Ebpf {
        "kernel_listen"
    } else {
        "safety_pass"
    };
    agent
        .wait_for_event(Mark(0), how, EVENT_TIMEOUT, |l| {
            seen::served(&socket)(l) && seen::learned_by(&l.0["serving"]) == how
        })
        .await;
    agent
        .wait_for_event(
            Mark(0),
            "registered",
            EVENT_TIMEOUT,
            seen::registered(&socket),
        )
        .await;
    assert!(
        agent
            .events_since(Mark(0), seen::registration_failed(&socket))
            .is_empty(),
        "{test}: no retries while unserved"
    );
}

/// The agent found `socket`'s listener alive in other processes and watches them (the event's
/// `serving` names them).
fn holders_followed(socket: &Path) -> impl Fn(&Line) -> bool + '_ {
    move |l| seen::served(socket)(l) && seen::learned_by(&l.0["serving"]) == "holders"
}

/// Issue 44, item 4: the process a listener was handed to dies. Its exit closes the listener
/// without a `close()`, and its pid is not the one the socket's credentials name: on syscall
/// tracepoints, fanotify and inotify nothing reported it and the plugin stayed registered with
/// nothing serving it. Liveness follows the listener to the child that holds it, and the child's
/// exit is its loss (on fentry, `unix_release` may report it first).
async fn the_death_of_the_process_a_listener_was_handed_to_is_unserved(source: Source) {
    let Some(s) = Scenario::start(source).await else {
        return;
    };
    let learned_by = death_learned_by(&s.agent);
    let learned_by: Vec<&str> = learned_by
        .iter()
        .copied()
        .chain(["kernel_release"])
        .collect();
    let socket = s.dir.path("handed.sock");
    let mut plugin = plugin!(&socket).name("handed").arg("--hand-off").spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    s.agent
        .wait_for_event(
            Mark(0),
            "registered",
            EVENT_TIMEOUT,
            seen::registered(&socket),
        )
        .await;
    let events = s.agent.event_mark();
    let child = plugin.hand_off(EVENT_TIMEOUT).await;
    let followed = s
        .agent
        .wait_for_event(
            events,
            "the parent's exit judged a hand-off",
            EVENT_TIMEOUT,
            holders_followed(&socket),
        )
        .await;
    assert!(
        seen::serving_pids(&followed.0["serving"]).contains(&u64::from(child)),
        "{}: the child {child} is not among the holders: {followed}",
        s.test
    );
    let mark = s.agent.event_mark();
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
    s.agent
        .wait_for_event(
            mark,
            "the child's death, learned from its pidfd",
            std::time::Duration::from_secs(5),
            unserved_by(&socket, &learned_by),
        )
        .await;
    assert_eq!(
        state_of(&s.dir.root().with_file_name("admin.sock"), &socket).state,
        "unserved"
    );
}

/// A process that takes a plugin's listening descriptor (`pidfd_getfd`: from the kernel's view
/// what an `SCM_RIGHTS` receiver holds) and keeps it without ever accepting; with `shutdown`,
/// it shuts the listener down and keeps the descriptor. Killed when dropped.
struct TakenListener(std::process::Child);

impl TakenListener {
    fn take(plugin_pid: u32, socket: &Path, shutdown: bool) -> TakenListener {
        const SCRIPT: &str = r#"
import ctypes, os, socket, sys, time
pid, path, shut = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
libc = ctypes.CDLL(None, use_errno=True)
pidfd = os.pidfd_open(pid)
taken = None
for name in os.listdir(f"/proc/{pid}/fd"):
    if not os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:"):
        continue
    fd = libc.syscall(438, pidfd, int(name), 0)  # pidfd_getfd
    if fd < 0:
        continue
    s = socket.socket(fileno=fd)
    if s.family == socket.AF_UNIX and s.getsockname() == path and s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        taken = s
        break
    s.detach()
    os.close(fd)
if taken is None:
    sys.exit("no listener bound to " + path)
if shut:
    taken.shutdown(socket.SHUT_RDWR)
print("holding", flush=True)
while True:
    time.sleep(3600)
"#;
        use std::io::BufRead;
        let mut child = std::process::Command::new("python3")
            .args(["-c", SCRIPT, &plugin_pid.to_string()])
            .arg(socket)
            .arg(if shutdown { "1" } else { "0" })
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3");
        let mut line = String::new();
        let stdout = child.stdout.take().expect("stdout");
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read");
        assert_eq!(line.trim(), "holding", "the listener was not taken");
        TakenListener(child)
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for TakenListener {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Issue 44, item 4: a listener held by another process (an idle one that never accepts) when
/// its server is SIGKILLed: it still queues connections, so it is served; it stays registered,
/// followed to its holder, and the holder's death makes it unserved (before: registered for
/// good, nothing answering).
async fn a_listener_taken_by_another_process_is_followed_to_it_and_its_death_is_unserved(
    source: Source,
) {
    let Some(s) = Scenario::start(source).await else {
        return;
    };
    let learned_by = death_learned_by(&s.agent);
    let learned_by: Vec<&str> = learned_by
        .iter()
        .copied()
        .chain(["kernel_release"])
        .collect();
    let socket = s.dir.path("taken.sock");
    let plugin = plugin!(&socket).name("taken").spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    s.agent
        .wait_for_event(
            Mark(0),
            "registered",
            EVENT_TIMEOUT,
            seen::registered(&socket),
        )
        .await;
    let holder = TakenListener::take(plugin.pid().expect("running"), &socket, false);
    let mark = s.agent.event_mark();
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(plugin.pid().expect("running") as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
    let followed = s
        .agent
        .wait_for_event(
            mark,
            "the server's death judged a hand-off",
            EVENT_TIMEOUT,
            holders_followed(&socket),
        )
        .await;
    assert!(
        seen::serving_pids(&followed.0["serving"]).contains(&u64::from(holder.pid())),
        "{}: the holder {} is not among the holders: {followed}",
        s.test,
        holder.pid()
    );
    let admin = s.dir.root().with_file_name("admin.sock");
    assert_eq!(state_of(&admin, &socket).state, "registered");
    let mark = s.agent.event_mark();
    drop(holder);
    s.agent
        .wait_for_event(
            mark,
            "the holder's death",
            std::time::Duration::from_secs(5),
            unserved_by(&socket, &learned_by),
        )
        .await;
    assert_eq!(state_of(&admin, &socket).state, "unserved");
}

/// Issue 44, item 4: a listener `shutdown()` while the process keeps its descriptor refuses
/// every connect, and was never found unserved (40 s and counting). The kernel reports the
/// shutdown (eBPF, either hook family) and one refused connect confirms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ebpf_a_listener_shut_down_while_its_process_keeps_it_is_unserved() {
    let Some(s) = Scenario::start(Source::Ebpf).await else {
        return;
    };
    let socket = s.dir.path("shut.sock");
    let plugin = plugin!(&socket).name("shut").spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    s.agent
        .wait_for_event(
            Mark(0),
            "registered",
            EVENT_TIMEOUT,
            seen::registered(&socket),
        )
        .await;
    let mark = s.agent.event_mark();
    let _holder = TakenListener::take(plugin.pid().expect("running"), &socket, true);
    s.agent
        .wait_for_event(
            mark,
            "the shutdown, reported by the kernel",
            std::time::Duration::from_secs(5),
            unserved(&socket, "kernel_release"),
        )
        .await;
    assert_eq!(
        state_of(&s.dir.root().with_file_name("admin.sock"), &socket).state,
        "unserved"
    );
}
