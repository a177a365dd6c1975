//! Hostile input: plugins, handlers and trees that misbehave on purpose. For each, the agent
//! says what is wrong in a clear log line, keeps its memory bounded (the peak resident set stays
//! under the DaemonSet's 128 MiB limit), and the good plugins around it register as usual.
//!
//! What touches discovery runs once per event source; what only touches the plugin or handler
//! side runs on inotify.

use plugin_agent_tests::procfs;
use plugin_agent_tests::{
    AgentOptions, AgentProcess, EVENT_TIMEOUT, Mark, PluginDir, PluginProcess, Scenario, Source,
    admin, logs, per_source, plugin, test_name,
};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

per_source!(
    ignores_10000_non_socket_files_and_registers_the_plugins_among_them,
    ignores_symlink_loops_and_registers_the_plugins_next_to_them,
    walks_a_mode_000_sub_directory_with_its_cap_dac_read_search,
    registers_a_socket_path_at_the_108_byte_limit_and_reports_one_beyond_it,
    converges_on_a_plugin_recreating_its_socket_100_times_a_second,
    registers_a_plugin_promptly_after_1000_directories_made_by_absolute_path,
    registers_a_plugin_made_during_a_sustained_socket_flood_before_the_flood_ends,
);

/// The DaemonSet's memory limit: the agent's peak resident set must stay below it.
const MEMORY_LIMIT_KIB: u64 = 128 * 1024;

/// Starts three well-behaved plugins and waits until each is registered.
async fn good_plugins_register(dir: &PluginDir, agent: &AgentProcess) -> Vec<PluginProcess> {
    let good: Vec<_> = (0..3)
        .map(|i| {
            plugin!(dir.path(&format!("good/good-{i}.sock")))
                .name(&format!("good-{i}.example.com"))
                .spawn()
        })
        .collect();
    for plugin in &good {
        plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
        agent
            .wait_for_log(
                "a good plugin registered",
                EVENT_TIMEOUT,
                logs::registered(plugin.socket()),
            )
            .await;
    }
    good
}

/// Fails the test if the agent's peak resident set reached the memory limit; returns it.
fn memory_stayed_bounded(test: &str, agent: &AgentProcess) -> u64 {
    let pid = agent.pid().expect("running");
    let peak = procfs::peak_rss_kib(pid).expect("VmHWM");
    eprintln!("{test}: agent peak RSS {} MiB", peak / 1024);
    assert!(
        peak < MEMORY_LIMIT_KIB,
        "{test}: agent peak RSS {peak} KiB reached the {MEMORY_LIMIT_KIB} KiB limit"
    );
    peak
}

async fn ignores_10000_non_socket_files_and_registers_the_plugins_among_them(source: Source) {
    let test = test_name();
    let dir = PluginDir::new();
    // Half before start (found by the walk), half after (reported as events).
    let noise = |from: usize, to: usize| {
        for i in from..to {
            let sub = dir.path(&format!("noise-{}", i % 20));
            std::fs::create_dir_all(&sub).expect("mkdir");
            let path = sub.join(format!("file-{i}"));
            if i % 10 == 0 {
                nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o644))
                    .expect("mkfifo");
            } else {
                std::fs::write(&path, b"not a socket").expect("write");
            }
        }
    };
    noise(0, 5_000);
    let Some(agent) = AgentProcess::start_default(&test, source, &dir.root()).await else {
        return;
    };
    noise(5_000, 10_000);
    let _good = good_plugins_register(&dir, &agent).await;
    let discovered = agent.logs_since(Mark(0), |l| l.message() == "socket discovered");
    assert_eq!(
        discovered.len(),
        3,
        "{test}: only the 3 sockets are plugins"
    );
    assert_eq!(
        admin::list(&dir.root().with_file_name("admin.sock")).len(),
        3
    );
    memory_stayed_bounded(&test, &agent);
}

async fn ignores_symlink_loops_and_registers_the_plugins_next_to_them(source: Source) {
    let test = test_name();
    let dir = PluginDir::new();
    let link = |target: &str, at: &str| {
        std::os::unix::fs::symlink(target, dir.path(at)).expect("symlink");
    };
    std::fs::create_dir_all(dir.path("sub")).expect("mkdir");
    link("loop-b", "loop-a");
    link("loop-a", "loop-b");
    link(".", "self");
    let Some(agent) = AgentProcess::start_default(&test, source, &dir.root()).await else {
        return;
    };
    // After start too: reported as events.
    link("..", "sub/up");
    link("../sub", "sub/again");
    let outside = plugin!(dir.outside("elsewhere.sock"))
        .start_listening()
        .await;
    link(
        &outside.socket().display().to_string(),
        "sub/elsewhere.sock",
    );
    link(&dir.outside("").display().to_string(), "outside-dir");
    let good = good_plugins_register(&dir, &agent).await;
    link(&good[0].socket().display().to_string(), "alias.sock");
    // A plugin started after the links registers too: the watcher is not stuck in a loop.
    let late = plugin!(dir.path("sub/late.sock"))
        .name("late.example.com")
        .spawn();
    late.wait_for_notify(true, EVENT_TIMEOUT).await;
    let listed = admin::list(&dir.root().with_file_name("admin.sock"));
    let expected: Vec<PathBuf> = good
        .iter()
        .map(|p| p.socket().to_path_buf())
        .chain([late.socket().to_path_buf()])
        .collect();
    let mut listed_paths: Vec<PathBuf> = listed.keys().cloned().collect();
    listed_paths.sort();
    let mut expected_sorted = expected.clone();
    expected_sorted.sort();
    assert_eq!(
        listed_paths, expected_sorted,
        "{test}: symlinks are never plugins"
    );
    assert!(
        outside.notifications().is_empty(),
        "{test}: a socket outside the tree was reached through a symlink"
    );
    memory_stayed_bounded(&test, &agent);
}

async fn walks_a_mode_000_sub_directory_with_its_cap_dac_read_search(source: Source) {
    let test = test_name();
    let dir = PluginDir::new();
    if !plugin_agent_tests::env::privileged(&test) {
        return;
    }
    let Some(agent) = AgentProcess::start_default(&test, source, &dir.root()).await else {
        return;
    };
    // The agent runs as root but keeps only DAC_OVERRIDE and DAC_READ_SEARCH; mode 000 does not
    // stop those, by design (the agent must see every driver's directory).
    let locked = dir.path("locked");
    std::fs::create_dir(&locked).expect("mkdir");
    let socket = locked.join("driver.sock");
    let plugin = plugin!(&socket)
        .arg("--listen-delay")
        .arg("1s")
        .start()
        .await;
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o000)).expect("chmod");
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    let _good = good_plugins_register(&dir, &agent).await;
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o755)).expect("chmod back");
}

/// Without the DAC capabilities (an agent run as an ordinary user, inotify), an unreadable
/// directory is reported and skipped, and its siblings register.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_an_unreadable_sub_directory_when_running_without_dac_capabilities() {
    let test = "reports_an_unreadable_sub_directory_without_dac_capabilities";
    let dir = PluginDir::new();
    if !plugin_agent_tests::env::privileged(test) {
        return;
    }
    let base = dir.root().parent().expect("base").to_path_buf();
    std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o755)).expect("chmod base");
    let locked = dir.path("locked");
    std::fs::create_dir(&locked).expect("mkdir");
    let hidden = plugin!(locked.join("driver.sock")).start_listening().await;
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o000)).expect("chmod");

    let mut options = AgentOptions::new(Source::Inotify, &dir.root());
    options.wrapper = [
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
    ]
    .map(String::from)
    .to_vec();
    options.extra = vec!["--no-admin".into(), "--no-metrics".into()];
    let agent = AgentProcess::start(test, options).await.expect("inotify");
    let unreadable = agent
        .wait_for_log("the unreadable directory reported", EVENT_TIMEOUT, |l| {
            l.message() == "cannot read directory; its plugins are not discovered"
                && l.field_is("dir", &locked.display().to_string())
        })
        .await;
    eprintln!("{test}: {unreadable}");
    // A sibling plugin whose socket the unprivileged agent may connect to.
    let socket = dir.path("open/ok.sock");
    let good = plugin!(&socket)
        .arg("--listen-delay")
        .arg("1s")
        .start()
        .await;
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).expect("chmod");
    good.wait_for_notify(true, EVENT_TIMEOUT).await;
    assert!(
        hidden.notifications().is_empty(),
        "{test}: the hidden plugin was reached"
    );
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o755)).expect("chmod back");
}

async fn registers_a_socket_path_at_the_108_byte_limit_and_reports_one_beyond_it(source: Source) {
    let Some(Scenario { test, dir, agent }) = Scenario::start(source).await else {
        return;
    };
    // sun_path holds 108 bytes with the terminating NUL: 107 is the longest path to connect to.
    let root_len = dir.root().as_os_str().len();
    let filler = 107 - root_len - "/".len() - "/x.sock".len();
    let at_limit = dir.root().join("d".repeat(filler)).join("x.sock");
    assert_eq!(at_limit.as_os_str().len(), 107);
    let fits = plugin!(&at_limit).name("at-limit.example.com").spawn();
    fits.wait_for_notify(true, EVENT_TIMEOUT).await;

    // One byte more: bound through /proc/<pid>/fd/<dir> (short), found by its real path (108
    // bytes), which no connect(2) can name.
    let long_dir = dir.root().join("e".repeat(filler));
    std::fs::create_dir(&long_dir).expect("mkdir");
    let dir_fd = std::fs::File::open(&long_dir).expect("open dir");
    let beyond = long_dir.join("xy.sock");
    assert_eq!(beyond.as_os_str().len(), 108);
    let short = format!(
        "/proc/{}/fd/{}/xy.sock",
        std::process::id(),
        std::os::fd::AsRawFd::as_raw_fd(&dir_fd)
    );
    let _too_long = plugin!(&short)
        .name("beyond.example.com")
        .start_listening()
        .await;
    let failure = agent
        .wait_for_log(
            "the over-long path reported",
            EVENT_TIMEOUT,
            logs::registration_failed(&beyond),
        )
        .await;
    eprintln!("{test}: {}", failure.field("error").unwrap_or_default());
    let _good = good_plugins_register(&dir, &agent).await;
    memory_stayed_bounded(&test, &agent);
}

async fn converges_on_a_plugin_recreating_its_socket_100_times_a_second(source: Source) {
    let Some(Scenario { test, dir, agent }) = Scenario::start(source).await else {
        return;
    };
    let socket = dir.path("flappy.sock");
    let flapping = {
        let socket = socket.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            let mut listener = None;
            for _ in 0..300 {
                tick.tick().await;
                drop(listener.take());
                let _ = std::fs::remove_file(&socket);
                listener = Some(std::os::unix::net::UnixListener::bind(&socket).expect("bind"));
            }
            drop(listener);
            let _ = std::fs::remove_file(&socket);
        })
    };
    let _good = good_plugins_register(&dir, &agent).await;
    flapping.await.expect("flapping plugin");
    // It settles: the last socket is a real plugin, and it is the one registered.
    let settled = plugin!(&socket).name("settled.example.com").spawn();
    settled.wait_for_notify(true, EVENT_TIMEOUT).await;
    let ino = std::fs::symlink_metadata(&socket).expect("stat").ino();
    let listed = admin::list(&dir.root().with_file_name("admin.sock"));
    let entry = listed.get(&socket).expect("listed");
    assert_eq!(
        (entry.state.as_str(), entry.socket_ino),
        ("registered", ino),
        "{test}"
    );
    assert_eq!(
        listed.len(),
        4,
        "{test}: one entry for the flapping path: {listed:?}"
    );
    memory_stayed_bounded(&test, &agent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_a_4_mib_get_info_answer_with_bounded_memory() {
    let test = "refuses_a_4_mib_get_info_answer_with_bounded_memory";
    let dir = PluginDir::new();
    let agent = AgentProcess::start_default(test, Source::Inotify, &dir.root())
        .await
        .expect("inotify");
    let socket = dir.path("huge.sock");
    let huge = plugin!(&socket)
        .arg("--huge-name-bytes")
        .arg(((4 << 20) + 1).to_string())
        .spawn();
    let failure = agent
        .wait_for_log(
            "the huge answer refused",
            EVENT_TIMEOUT,
            logs::registration_failed(&socket),
        )
        .await;
    let error = failure.field("error").unwrap_or_default();
    eprintln!("{test}: {error}");
    assert!(
        error.contains("GetInfo"),
        "{test}: the failure names GetInfo: {failure}"
    );
    // Retried after backoff, refused again, and still bounded.
    huge.wait_for_events("get_info", 2, EVENT_TIMEOUT).await;
    let _good = good_plugins_register(&dir, &agent).await;
    memory_stayed_bounded(test, &agent);
}

/// Connections a listener has open now, and the most it ever had.
#[derive(Default)]
struct Connections {
    open: AtomicUsize,
    most: AtomicUsize,
    total: AtomicUsize,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opens_one_connection_at_a_time_to_a_plugin_that_accepts_and_never_answers() {
    let test = "opens_one_connection_at_a_time_to_a_silent_plugin";
    let dir = PluginDir::new();
    let agent = AgentProcess::start_default(test, Source::Inotify, &dir.root())
        .await
        .expect("inotify");
    let socket = dir.path("silent.sock");
    let listener = tokio::net::UnixListener::bind(&socket).expect("bind");
    let connections = Arc::new(Connections::default());
    let counting = connections.clone();
    let silent = tokio::spawn(async move {
        // Accept everything, hold it open, answer nothing; count until the agent hangs up.
        while let Ok((mut stream, _)) = listener.accept().await {
            let open = counting.open.fetch_add(1, Ordering::SeqCst) + 1;
            counting.most.fetch_max(open, Ordering::SeqCst);
            counting.total.fetch_add(1, Ordering::SeqCst);
            let counting = counting.clone();
            tokio::spawn(async move {
                let mut sink = [0u8; 4096];
                while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
                counting.open.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    let started = Instant::now();
    let failure = agent
        .wait_for_log(
            "the silent plugin reported",
            EVENT_TIMEOUT,
            logs::registration_failed(&socket),
        )
        .await;
    eprintln!(
        "{test}: reported after {:?}: {}; connections: {} in all, {} at most at once",
        started.elapsed(),
        failure.field("error").unwrap_or_default(),
        connections.total.load(Ordering::SeqCst),
        connections.most.load(Ordering::SeqCst)
    );
    let _good = good_plugins_register(&dir, &agent).await;
    // One attempt at a time; the connection being torn down may overlap the next by a moment.
    assert!(
        connections.most.load(Ordering::SeqCst) <= 2,
        "{test}: the agent held {} connections to one plugin at once",
        connections.most.load(Ordering::SeqCst)
    );
    // One attempt is 10 s of 1 s GetInfo deadlines on fresh connections: about ten.
    assert!(
        connections.total.load(Ordering::SeqCst) <= 20,
        "{test}: {} connections for one failed attempt",
        connections.total.load(Ordering::SeqCst)
    );
    let fds = procfs::open_fds(agent.pid().expect("running")).expect("fds");
    assert!(fds < 64, "{test}: the agent has {fds} descriptors open");
    silent.abort();
}

/// A server on `listener` that answers every connection with bytes that are not HTTP/2.
fn garbage_server<L, S>(mut accept: L) -> tokio::task::JoinHandle<()>
where
    L: FnMut() -> std::pin::Pin<Box<dyn std::future::Future<Output = Option<S>> + Send>>
        + Send
        + 'static,
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        while let Some(mut stream) = accept().await {
            tokio::spawn(async move {
                let _ = stream
                    .write_all(b"HTTP/1.1 418 I'm a teapot\r\n\r\n\x00\xff\xfe garbage \x07\x07")
                    .await;
                let mut sink = [0u8; 1024];
                let _ =
                    tokio::time::timeout(Duration::from_millis(100), stream.read(&mut sink)).await;
            });
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_a_handler_that_answers_garbage_and_keeps_other_types_registering() {
    let test = "reports_a_handler_that_answers_garbage";
    let dir = PluginDir::new();
    let tcp = Arc::new(
        tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind tcp"),
    );
    let tcp_addr = tcp.local_addr().expect("addr");
    let tcp_server = garbage_server(move || {
        let tcp = tcp.clone();
        Box::pin(async move { tcp.accept().await.ok().map(|(s, _)| s) })
    });
    let unix_path = dir.outside("garbage-handler.sock");
    let unix = Arc::new(tokio::net::UnixListener::bind(&unix_path).expect("bind unix"));
    let unix_server = garbage_server(move || {
        let unix = unix.clone();
        Box::pin(async move { unix.accept().await.ok().map(|(s, _)| s) })
    });
    let options = AgentOptions::new(Source::Inotify, &dir.root()).handlers(&[
        &format!("DRAPlugin=http://{tcp_addr}"),
        &format!("DevicePlugin=unix://{}", unix_path.display()),
        "CSIPlugin=accept-all",
    ]);
    let agent = AgentProcess::start(test, options).await.expect("inotify");
    let victims: Vec<(PathBuf, PluginProcess)> =
        [("DRAPlugin", "dra.sock"), ("DevicePlugin", "dev.sock")]
            .into_iter()
            .map(|(plugin_type, name)| {
                let socket = dir.path(name);
                let plugin = plugin!(&socket).plugin_type(plugin_type).name(name).spawn();
                (socket, plugin)
            })
            .collect();
    for (socket, _) in &victims {
        let failure = agent
            .wait_for_log(
                "the garbage handler reported",
                EVENT_TIMEOUT,
                logs::registration_failed(socket),
            )
            .await;
        eprintln!(
            "{test}: {}: {}",
            socket.display(),
            failure.field("error").unwrap_or_default()
        );
    }
    let _good = good_plugins_register(&dir, &agent).await;
    // No hot loop on a handler that is reachable but speaks no gRPC: over two seconds the
    // plugins waiting for it are retried a bounded number of times.
    // (A rate needs a window of time: this is the one wait here that is not for an event.)
    let mark = agent.mark();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let failures = agent.logs_since(mark, logs::any_registration_failed).len();
    eprintln!("{test}: {failures} failures logged in 2 s");
    assert!(
        failures <= 20,
        "{test}: {failures} registration failures in 2 s: a retry loop"
    );
    for (_, plugin) in &victims {
        let told: Vec<_> = plugin
            .notifications()
            .iter()
            .filter_map(|l| l.flag("registered"))
            .collect();
        assert!(
            !told.contains(&true),
            "{test}: a plugin was told it registered with a garbage handler"
        );
    }
    memory_stayed_bounded(test, &agent);
    tcp_server.abort();
    unix_server.abort();
}

/// Directories created by absolute path reach the eBPF tracepoints as name hints (the kernel
/// cannot resolve the path); a burst of them once cost one `stat` per name and watched directory
/// (53 s for 1,000 here). Every source must stay linear in the tree.
async fn registers_a_plugin_promptly_after_1000_directories_made_by_absolute_path(source: Source) {
    let Some(Scenario { test, dir, agent }) = Scenario::start(source).await else {
        return;
    };
    for i in 0..1000 {
        std::fs::create_dir(dir.path(&format!("d{i}"))).expect("mkdir");
    }
    let made = Instant::now();
    let plugin = plugin!(dir.path("d999/after.sock"))
        .name("after.example.com")
        .spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    eprintln!(
        "{test}: registered {:?} after the last mkdir",
        made.elapsed()
    );
    for i in 0..1000 {
        std::fs::remove_dir(dir.path(&format!("d{i}"))).ok();
    }
    let _good = good_plugins_register(&dir, &agent).await;
    memory_stayed_bounded(&test, &agent);
}

/// Two threads bind and unlink sockets as fast as they can for up to 30 s; a plugin started
/// a second in must be registered while the flood still runs, not after it (eBPF lost every
/// record to the full ring and once rescanned only when the flood ended). The eBPF agent gets a
/// one-page ring, so the flood overflows it on any machine and the loss path is what is tested.
async fn registers_a_plugin_made_during_a_sustained_socket_flood_before_the_flood_ends(
    source: Source,
) {
    const FLOOD_FOR: Duration = Duration::from_secs(30);
    let test = test_name();
    let dir = PluginDir::new();
    let mut options = AgentOptions::new(source, &dir.root());
    options.extra = vec!["--ring-buffer-bytes".into(), "4096".into()];
    let Some(agent) = AgentProcess::start(&test, options).await else {
        return;
    };
    std::fs::create_dir(dir.path("flood")).expect("mkdir");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flooders: Vec<_> = (0..2)
        .map(|t| {
            let stop = Arc::clone(&stop);
            let base = dir.path(&format!("flood/f{t}"));
            std::thread::spawn(move || {
                let started = Instant::now();
                let mut made = 0u64;
                while !stop.load(Ordering::Relaxed) && started.elapsed() < FLOOD_FOR {
                    let path = base.with_extension(format!("{}.sock", made % 64));
                    let _ = std::fs::remove_file(&path);
                    drop(std::os::unix::net::UnixListener::bind(&path));
                    let _ = std::fs::remove_file(&path);
                    made += 1;
                }
                made
            })
        })
        .collect();
    // Let the flood fill whatever queue the source has before the plugin appears.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let flood_started = Instant::now();
    let plugin = plugin!(dir.path("during.sock"))
        .name("during.example.com")
        .spawn();
    plugin.wait_for_notify(true, FLOOD_FOR).await;
    let registered_after = flood_started.elapsed();
    let flood_was_running = flooders.iter().all(|f| !f.is_finished());
    stop.store(true, Ordering::Relaxed);
    let made: u64 = flooders
        .into_iter()
        .map(|f| f.join().expect("flood thread"))
        .sum();
    eprintln!("{test}: registered {registered_after:?} into the flood ({made} sockets bound)");
    assert!(
        flood_was_running,
        "{test}: the plugin registered only after the flood ended ({registered_after:?})"
    );
    if source == Source::Ebpf {
        let status = admin::status(&dir.root().with_file_name("admin.sock"));
        assert!(
            status["loss_rescans"].as_u64() > Some(0),
            "{test}: the one-page ring never overflowed, so the loss path was not tested: {status}"
        );
    }
    let _good = good_plugins_register(&dir, &agent).await;
    memory_stayed_bounded(&test, &agent);
}

/// Sockets nobody listens on (1,000 bound then closed, like crashed plugins' leftovers) and
/// servers that accept and close at once (300) are retried within the 10 s dial budget. They used
/// to hold an operation slot each for all of it, so a good plugin waited behind them (28.5 s for
/// 1,000 stale sockets). Dial waits give their slot back now. The starvation is the executor's,
/// the same on every source, so this runs on inotify.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_a_plugin_promptly_beside_1000_stale_sockets_and_300_servers_that_hang_up() {
    let test = &test_name();
    let dir = PluginDir::new();
    std::fs::create_dir_all(dir.path("stale")).expect("mkdir");
    for i in 0..1000 {
        drop(
            std::os::unix::net::UnixListener::bind(dir.path(&format!("stale/s{i}.sock")))
                .expect("bind"),
        );
    }
    let hang_ups: Vec<_> = (0..300)
        .map(|i| {
            let listener = tokio::net::UnixListener::bind(dir.path(&format!("stale/h{i}.sock")))
                .expect("bind");
            tokio::spawn(async move {
                while let Ok((stream, _)) = listener.accept().await {
                    drop(stream);
                }
            })
        })
        .collect();
    let Some(agent) = AgentProcess::start_default(test, Source::Inotify, &dir.root()).await else {
        return;
    };
    let started = Instant::now();
    let plugin = plugin!(dir.path("good.sock"))
        .name("good.example.com")
        .spawn();
    // A plugin queued behind slots held by dial waits waits out a whole 10 s dial budget (it took
    // 10.1 s here before the fix, 0.4 s after); half the budget tells the two apart on any machine.
    plugin.wait_for_notify(true, Duration::from_secs(5)).await;
    eprintln!(
        "{test}: registered {:?} after it started",
        started.elapsed()
    );
    let listed = admin::list(&dir.root().with_file_name("admin.sock"));
    assert_eq!(
        listed.get(&dir.path("good.sock")).map(|e| e.state.as_str()),
        Some("registered"),
        "{test}"
    );
    memory_stayed_bounded(test, &agent);
    for task in hang_ups {
        task.abort();
    }
}
