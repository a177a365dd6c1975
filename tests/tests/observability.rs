//! Observability end to end: the real agent scraped by a real Prometheus server, its traces
//! received by a real OTLP/gRPC receiver (the collector's `TraceService`, generated from the OTLP
//! protobuf definitions), its health endpoints, and its logs.
//!
//! ```text
//! example-plugin ──> plugin-agent ──/metrics──> prometheus (started here, loopback, temp storage)
//!                         │                        └──/api/v1/query──> test
//!                         └──OTLP/gRPC──> TraceService receiver (in this test) ──spans──> test
//! ```
//!
//! The Prometheus test needs Debian's `prometheus` package (`cargo xtask deps` installs it): it
//! is skipped with a message when the binary is absent, except under `CI=true`, where that fails.
//! Everything but the kernel-timestamp test runs on the inotify source (that one needs root and
//! the eBPF source, and fails under `CI=true` without them).

use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use plugin_agent_tests::env::skip;
use plugin_agent_tests::http::{http_get, metrics_addr};
use plugin_agent_tests::{
    AgentOptions, AgentProcess, EVENT_TIMEOUT, Mark, PluginDir, Source, logs, plugin, seen,
};
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Starts an agent on the inotify source with `extra` arguments.
async fn agent(test: &str, dir: &PluginDir, extra: &[&str]) -> AgentProcess {
    let mut options = AgentOptions::new(Source::Inotify, &dir.root());
    options.extra = extra.iter().map(|a| a.to_string()).collect();
    AgentProcess::start(test, options)
        .await
        .unwrap_or_else(|| panic!("{test}: the inotify source needs nothing special"))
}

fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A loopback port nobody listens on now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn find_binary(name: &str) -> Option<PathBuf> {
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// A Prometheus server scraping one target every second, on loopback, with its own storage;
/// killed on drop.
struct Prometheus {
    child: Child,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    /// Starts it (with `flags`, such as `--enable-feature=exemplar-storage`) and waits until it
    /// is ready; `None` when the test must be skipped.
    fn start(test: &str, target: SocketAddr, flags: &[&str]) -> Option<Prometheus> {
        let Some(binary) = find_binary("prometheus") else {
            skip(
                test,
                "prometheus is not installed (Debian's prometheus package: cargo xtask deps)",
            );
            return None;
        };
        let dir = tempfile::tempdir().expect("temp dir");
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: plugin-agent\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .expect("config");
        let addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        let mut child = Command::new(binary)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .args(flags)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start prometheus");
        let stderr = child.stderr.take().expect("piped");
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut tail = Vec::new();
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains("Server is ready to receive web requests") {
                    let _ = ready_tx.send(Ok(()));
                }
                tail.push(line);
            }
            let _ = ready_tx.send(Err(tail.join("\n")));
        });
        let mut server = Prometheus {
            child,
            addr,
            _dir: dir,
        };
        match ready_rx.recv_timeout(EVENT_TIMEOUT) {
            Ok(Ok(())) => Some(server),
            Ok(Err(log)) => {
                let _ = server.child.kill();
                panic!("{test}: prometheus exited:\n{log}")
            }
            Err(_) => panic!("{test}: prometheus not ready within {EVENT_TIMEOUT:?}"),
        }
    }

    /// An instant query's result vector, as JSON values.
    fn query(&self, promql: &str) -> Vec<serde_json::Value> {
        let (status, body) = http_get(
            self.addr,
            &format!("/api/v1/query?query={}", percent_encode(promql)),
        );
        assert_eq!(status, 200, "query {promql}: {body}");
        let answer: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        answer["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// Asks `promql` until it returns at least `n` series. Prometheus has no way to push a
    /// result, so this is the one place the tests ask again: every 200 ms, up to `limit` (a
    /// bound for broken runs; passing ones take a scrape interval or two).
    fn wait_for_series(&self, promql: &str, n: usize, limit: Duration) -> Vec<serde_json::Value> {
        let deadline = Instant::now() + limit;
        loop {
            let result = self.query(promql);
            if result.len() >= n {
                return result;
            }
            assert!(
                Instant::now() < deadline,
                "{promql}: {} series after {limit:?}, wanted {n}",
                result.len()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Prometheus {
    /// The exemplars stored for `promql` over the last hour: (trace_id, span_id) pairs.
    fn exemplars(&self, promql: &str) -> Vec<(String, String)> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs();
        let (status, body) = http_get(
            self.addr,
            &format!(
                "/api/v1/query_exemplars?query={}&start={}&end={}",
                percent_encode(promql),
                now - 3600,
                now + 60
            ),
        );
        assert_eq!(status, 200, "exemplars {promql}: {body}");
        let answer: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        let mut found = Vec::new();
        for series in answer["data"].as_array().into_iter().flatten() {
            for exemplar in series["exemplars"].as_array().into_iter().flatten() {
                let labels = &exemplar["labels"];
                if let (Some(trace), Some(span)) =
                    (labels["trace_id"].as_str(), labels["span_id"].as_str())
                {
                    found.push((trace.to_string(), span.to_string()));
                }
            }
        }
        found
    }

    /// Asks for exemplars of `promql` until there is one (every 200 ms, up to `limit`, as
    /// [`Prometheus::wait_for_series`]).
    fn wait_for_exemplars(&self, promql: &str, limit: Duration) -> Vec<(String, String)> {
        let deadline = Instant::now() + limit;
        loop {
            let found = self.exemplars(promql);
            if !found.is_empty() {
                return found;
            }
            assert!(
                Instant::now() < deadline,
                "{promql}: no exemplar after {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_the_kubelet_gauge_and_registration_metrics_of_a_registered_plugin() {
    let test =
        "prometheus_scrapes_the_kubelet_gauge_and_registration_metrics_of_a_registered_plugin";
    if find_binary("prometheus").is_none() {
        skip(test, "prometheus is not installed (cargo xtask deps)");
        return;
    }
    let dir = PluginDir::new();
    let agent = agent(test, &dir, &["--metrics-addr", "127.0.0.1:0"]).await;
    let addr = metrics_addr(&agent).await;
    let socket = dir.path("csi.sock");
    let plugin = plugin!(&socket).name("csi.example.com").spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    agent
        .wait_for_event(
            Mark(0),
            "registered",
            EVENT_TIMEOUT,
            seen::registered(&socket),
        )
        .await;

    let socket_text = socket.to_string_lossy().into_owned();
    let query_task = tokio::task::spawn_blocking(move || {
        let prometheus = Prometheus::start(test, addr, &[])?;
        let limit = Duration::from_secs(30);
        let kubelet = prometheus.wait_for_series(
            &format!("plugin_manager_total_plugins{{socket_path=\"{socket_text}\"}}"),
            2,
            limit,
        );
        let registered = prometheus.wait_for_series(
            "plugin_agent_operations_total{kind=\"register\",outcome=\"success\"}",
            1,
            limit,
        );
        let latency = prometheus.wait_for_series(
            "plugin_agent_registration_duration_seconds_count{outcome=\"success\"}",
            1,
            limit,
        );
        let by_type = prometheus.wait_for_series(
            "plugin_agent_plugins{type=\"CSIPlugin\",state=\"registered\"}",
            1,
            limit,
        );
        let steps = prometheus.wait_for_series(
            "plugin_agent_plugin_call_duration_seconds_count{outcome=\"ok\"}",
            3,
            limit,
        );
        Some((kubelet, registered, latency, by_type, steps))
    });
    let Some((kubelet, registered, latency, by_type, steps)) = query_task.await.expect("queries")
    else {
        return;
    };
    let mut calls: Vec<&str> = steps
        .iter()
        .filter_map(|s| s["metric"]["call"].as_str())
        .collect();
    calls.sort();
    assert_eq!(calls, ["dial", "get_info", "notify"], "{steps:?}");
    let mut states: Vec<String> = kubelet
        .iter()
        .map(|s| s["metric"]["state"].as_str().unwrap_or("").to_string())
        .collect();
    states.sort();
    assert_eq!(states, ["actual_state_of_world", "desired_state_of_world"]);
    for series in &kubelet {
        assert_eq!(series["value"][1], "1", "{series}");
        assert_eq!(series["metric"]["job"], "plugin-agent");
    }
    assert_eq!(registered[0]["value"][1], "1", "{registered:?}");
    assert_eq!(latency[0]["metric"]["source"], "inotify", "{latency:?}");
    assert_eq!(by_type[0]["value"][1], "1", "{by_type:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_answers_and_readyz_reports_ready_after_the_first_scan() {
    let test = "healthz_answers_and_readyz_reports_ready_after_the_first_scan";
    let dir = PluginDir::new();
    // AgentProcess::start returns once the first scan is logged: ready from then on.
    let agent = agent(test, &dir, &["--metrics-addr", "127.0.0.1:0"]).await;
    let addr = metrics_addr(&agent).await;
    let (healthz, readyz, metrics) = tokio::task::spawn_blocking(move || {
        (
            http_get(addr, "/healthz"),
            http_get(addr, "/readyz"),
            http_get(addr, "/metrics"),
        )
    })
    .await
    .expect("requests");
    assert_eq!(healthz.0, 200, "{healthz:?}");
    assert_eq!(readyz.0, 200, "{readyz:?}");
    assert_eq!(metrics.0, 200);
    assert!(
        metrics
            .1
            .contains("plugin_agent_event_source_info{source=\"inotify\"} 1"),
        "{}",
        metrics.1
    );
    assert!(
        metrics
            .1
            .contains("plugin_agent_rescans_total{reason=\"start\"} 1")
    );
}

/// A receiver on a loopback port: its endpoint URL and the spans it receives.
async fn otlp_receiver() -> (String, mpsc::UnboundedReceiver<Span>) {
    plugin_agent_tests::otlp::receiver()
        .await
        .expect("an OTLP receiver on loopback")
}

fn attribute(span: &Span, key: &str) -> Option<String> {
    let value = span.attributes.iter().find(|kv| kv.key == key)?;
    match value.value.as_ref()?.value.as_ref()? {
        AnyValue::StringValue(s) => Some(s.clone()),
        AnyValue::IntValue(i) => Some(i.to_string()),
        AnyValue::BoolValue(b) => Some(b.to_string()),
        other => Some(format!("{other:?}")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traces_of_a_registration_arrive_over_otlp_as_discovery_register_and_step_spans() {
    let test = "traces_of_a_registration_arrive_over_otlp_as_discovery_register_and_step_spans";
    let (endpoint, mut spans) = otlp_receiver().await;
    let dir = PluginDir::new();
    let agent = agent(test, &dir, &["--no-metrics", "--otlp-endpoint", &endpoint]).await;
    let socket = dir.path("traced.sock");
    let plugin = plugin!(&socket).name("traced.example.com").spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    agent
        .wait_for_event(
            Mark(0),
            "registered",
            EVENT_TIMEOUT,
            seen::registered(&socket),
        )
        .await;
    // SIGTERM flushes the batch: the spans are sent now rather than at the next batch tick.
    let status = agent.stop().await;
    assert!(status.success(), "{status:?}");

    let wanted = [
        "discovery",
        "register",
        "dial",
        "GetInfo",
        "ValidatePlugin",
        "RegisterPlugin",
        "NotifyRegistrationStatus",
    ];
    let socket_text = socket.to_string_lossy().into_owned();
    let mut by_name: HashMap<String, Span> = HashMap::new();
    let collect = async {
        while !wanted.iter().all(|n| by_name.contains_key(*n)) {
            let Some(span) = spans.recv().await else {
                break;
            };
            // Keep the spans of this plugin's trace (discovery/register carry the socket path;
            // the steps are checked by parent below).
            if matches!(span.name.as_str(), "discovery" | "register")
                && attribute(&span, "socket_path").as_deref() != Some(&socket_text)
            {
                continue;
            }
            by_name.entry(span.name.clone()).or_insert(span);
        }
    };
    if tokio::time::timeout(EVENT_TIMEOUT, collect).await.is_err() {
        panic!(
            "{test}: spans received: {:?}",
            by_name.keys().collect::<Vec<_>>()
        );
    }
    let discovery = &by_name["discovery"];
    let register = &by_name["register"];
    assert!(discovery.parent_span_id.is_empty(), "discovery is the root");
    assert_eq!(register.trace_id, discovery.trace_id, "one trace");
    assert_eq!(register.parent_span_id, discovery.span_id);
    assert_eq!(
        attribute(discovery, "event_source").as_deref(),
        Some("inotify")
    );
    assert_eq!(attribute(discovery, "change").as_deref(), Some("created"));
    assert!(discovery.start_time_unix_nano <= register.start_time_unix_nano);
    for step in &wanted[2..] {
        let span = &by_name[*step];
        assert_eq!(span.trace_id, register.trace_id, "{step} in the trace");
        assert_eq!(
            span.parent_span_id, register.span_id,
            "{step} under register"
        );
    }
    // The server by OpenTelemetry's semantic conventions; inotify names no creator, and says so.
    let pid = plugin.pid().expect("the plugin runs").to_string();
    let own_uid = nix::unistd::getuid().as_raw().to_string();
    let own_cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("its cgroup");
    let own_cgroup = own_cgroup
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .unwrap_or_default();
    for (key, value) in [
        ("socket_path", socket_text.as_str()),
        ("plugin_name", "traced.example.com"),
        ("plugin_type", "CSIPlugin"),
        ("event_source", "inotify"),
        ("attempt", "1"),
        ("outcome", "success"),
        ("process.pid", pid.as_str()),
        ("process.executable.name", "example-plugin"),
        ("process.user.id", own_uid.as_str()),
        ("process.linux.cgroup", own_cgroup),
        (
            "plugin_agent.creator.unknown",
            "the event source does not report processes (inotify)",
        ),
    ] {
        assert_eq!(
            attribute(register, key).as_deref(),
            Some(value),
            "register span attribute {key}"
        );
    }
    assert_eq!(
        attribute(&by_name["ValidatePlugin"], "plugin_type").as_deref(),
        Some("CSIPlugin")
    );
}

/// A plugin that dies is traced in its socket's trace: an `unserved` span under its discovery, its
/// log line carrying that span's IDs, then the `deregister` span. Built without the operations'
/// machinery (the agent makes no span from `tracing`), so checked on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unserved_plugin_s_span_and_log_line_are_in_its_socket_s_trace() {
    let test = "an_unserved_plugin_s_span_and_log_line_are_in_its_socket_s_trace";
    let (endpoint, mut spans) = otlp_receiver().await;
    let dir = PluginDir::new();
    let agent = agent(test, &dir, &["--no-metrics", "--otlp-endpoint", &endpoint]).await;
    let socket = dir.path("dies.sock");
    let plugin = plugin!(&socket).name("dies.example.com").spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    agent
        .wait_for_event(
            Mark(0),
            "registered",
            EVENT_TIMEOUT,
            seen::registered(&socket),
        )
        .await;
    plugin.kill().await;
    let socket_text = socket.to_string_lossy().into_owned();
    // The log line is the subject here: it must carry the socket's trace.
    let line = agent
        .wait_for_log("unserved", EVENT_TIMEOUT, |l| {
            l.message() == "plugin unserved: not registered until its socket changes"
                && l.field_is("socket_path", &socket_text)
        })
        .await;
    agent
        .wait_for_event(
            Mark(0),
            "deregistered",
            EVENT_TIMEOUT,
            seen::deregistered(&socket),
        )
        .await;
    let status = agent.stop().await;
    assert!(status.success(), "{status:?}");

    let received = drain(&mut spans);
    let of_socket = |name: &str| -> Vec<&Span> {
        received
            .iter()
            .filter(|s| {
                s.name == name && attribute(s, "socket_path").as_deref() == Some(&*socket_text)
            })
            .collect()
    };
    let unserved = of_socket("unserved");
    assert_eq!(
        unserved.len(),
        1,
        "{test}: {:?}",
        received.iter().map(|s| &s.name).collect::<Vec<_>>()
    );
    let unserved = unserved[0];
    let discovery = of_socket("discovery");
    let root = discovery
        .iter()
        .find(|d| d.span_id == unserved.parent_span_id)
        .unwrap_or_else(|| {
            panic!("{test}: the unserved span is not under a discovery of its socket")
        });
    assert_eq!(root.trace_id, unserved.trace_id);
    assert_eq!(
        attribute(unserved, "plugin_name").as_deref(),
        Some("dies.example.com")
    );
    assert!(
        attribute(unserved, "learned_by").is_some(),
        "{test}: {unserved:?}"
    );
    assert_eq!(
        line.field("trace_id").as_deref(),
        Some(hex(&unserved.trace_id).as_str()),
        "{test}: {line}"
    );
    assert_eq!(
        line.field("span_id").as_deref(),
        Some(hex(&unserved.span_id).as_str()),
        "{test}: {line}"
    );
    let deregister = of_socket("deregister");
    assert!(
        deregister
            .iter()
            .any(|d| d.trace_id == unserved.trace_id && d.parent_span_id == root.span_id),
        "{test}: the deregistration is in the same trace, under the same discovery"
    );
}

/// Accepts TCP connections and never answers: a collector that hangs (worse than one that
/// refuses). Connections are held until the listener thread ends with the test process.
fn blackhole_collector() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            held.push(stream);
        }
    });
    format!("http://{addr}")
}

/// Registers `n` plugins one after the other; returns each one's time from spawn to
/// `Notify(true)`.
async fn registration_times(agent: &AgentProcess, dir: &PluginDir, n: usize) -> Vec<Duration> {
    let mut times = Vec::new();
    let mut plugins = Vec::new();
    for i in 0..n {
        let socket = dir.path(&format!("p{i}.sock"));
        let started = Instant::now();
        let plugin = plugin!(&socket).name(&format!("p{i}.example.com")).spawn();
        plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
        times.push(started.elapsed());
        agent
            .wait_for_event(
                Mark(0),
                "registered",
                EVENT_TIMEOUT,
                seen::registered(&socket),
            )
            .await;
        plugins.push(plugin);
    }
    times
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_collector_does_not_slow_registration() {
    let test = "a_dead_collector_does_not_slow_registration";
    const N: usize = 8;
    let baseline_dir = PluginDir::new();
    let baseline = agent(test, &baseline_dir, &["--no-metrics"]).await;
    let base = registration_times(&baseline, &baseline_dir, N).await;
    drop(baseline);

    let dead = blackhole_collector();
    let dir = PluginDir::new();
    let agent = agent(test, &dir, &["--no-metrics", "--otlp-endpoint", &dead]).await;
    let traced = registration_times(&agent, &dir, N).await;

    let max = |t: &[Duration]| t.iter().max().copied().unwrap_or_default();
    let sum = |t: &[Duration]| t.iter().sum::<Duration>();
    eprintln!(
        "{test}: spawn-to-registered, {N} plugins: no tracing: total {:?}, max {:?}; hung collector: total {:?}, max {:?}",
        sum(&base),
        max(&base),
        sum(&traced),
        max(&traced)
    );
    // Plugin start-up dominates both; a blocked export would add its 10 s timeout.
    assert!(
        max(&traced) < max(&base) + Duration::from_secs(1),
        "registration with a hung collector: {traced:?}; without tracing: {base:?}"
    );
    assert!(
        agent
            .events_since(Mark(0), seen::any_registration_failed)
            .is_empty()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_lines_about_a_plugin_carry_its_socket_path_and_name() {
    let test = "log_lines_about_a_plugin_carry_its_socket_path_and_name";
    let dir = PluginDir::new();
    let agent = agent(test, &dir, &["--no-metrics"]).await;
    let socket = dir.path("named.sock");
    let plugin = plugin!(&socket).name("named.example.com").spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    agent
        .wait_for_log("registered", EVENT_TIMEOUT, logs::registered(&socket))
        .await;
    // The log lines are the subject here. Every line after GetInfo answered, inside the
    // registration, names the plugin.
    let lines = agent.logs_since(Mark(0), logs::mentions(&socket));
    let answered = lines
        .iter()
        .position(|l| l.message() == "GetInfo answered")
        .unwrap_or_else(|| agent.fail("no GetInfo line"));
    for line in &lines[answered..] {
        if line.message() == "socket discovered" || line.message().starts_with("socket removed") {
            continue;
        }
        assert!(
            line.field_is("plugin_name", "named.example.com"),
            "{test}: line without the plugin's name: {line}"
        );
    }
    assert!(lines.len() > answered + 1, "{lines:?}");
}

/// Every span the receiver got until now (the agent has stopped and flushed).
fn drain(spans: &mut mpsc::UnboundedReceiver<Span>) -> Vec<Span> {
    let mut all = Vec::new();
    while let Ok(span) = spans.try_recv() {
        all.push(span);
    }
    all
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_latency_exemplar_in_prometheus_names_a_trace_the_collector_received_and_the_log_lines_of_it()
 {
    let test = "a_latency_exemplar_in_prometheus_names_a_trace_the_collector_received_and_the_log_lines_of_it";
    if find_binary("prometheus").is_none() {
        skip(test, "prometheus is not installed (cargo xtask deps)");
        return;
    }
    let (endpoint, mut spans) = otlp_receiver().await;
    let dir = PluginDir::new();
    let agent = agent(
        test,
        &dir,
        &[
            "--metrics-addr",
            "127.0.0.1:0",
            "--otlp-endpoint",
            &endpoint,
        ],
    )
    .await;
    let addr = metrics_addr(&agent).await;
    let socket = dir.path("exemplar.sock");
    let plugin = plugin!(&socket).name("exemplar.example.com").spawn();
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    // The log line is the subject: it carries the trace the exemplar names.
    let registered = agent
        .wait_for_log("registered", EVENT_TIMEOUT, logs::registered(&socket))
        .await;

    let exemplars = tokio::task::spawn_blocking(move || {
        let prometheus = Prometheus::start(test, addr, &["--enable-feature=exemplar-storage"])?;
        let limit = Duration::from_secs(30);
        Some((
            prometheus.wait_for_exemplars(
                "plugin_agent_registration_duration_seconds_bucket{outcome=\"success\"}",
                limit,
            ),
            prometheus.wait_for_exemplars(
                "plugin_agent_plugin_call_duration_seconds_bucket{call=\"get_info\",outcome=\"ok\"}",
                limit,
            ),
        ))
    })
    .await
    .expect("queries");
    let Some((exemplars, step_exemplars)) = exemplars else {
        return;
    };
    let (trace_id, span_id) = exemplars[0].clone();
    assert_eq!(trace_id.len(), 32, "{exemplars:?}");

    // The log line of the registration carries the same trace.
    assert_eq!(
        registered.field("trace_id").as_deref(),
        Some(trace_id.as_str()),
        "{registered}"
    );
    assert_eq!(
        registered.field("span_id").as_deref(),
        Some(span_id.as_str())
    );

    let status = agent.stop().await;
    assert!(status.success(), "{status:?}");
    let received = drain(&mut spans);
    let register = received
        .iter()
        .find(|s| s.name == "register" && hex(&s.trace_id) == trace_id)
        .unwrap_or_else(|| panic!("{test}: no register span of trace {trace_id} received"));
    assert_eq!(hex(&register.span_id), span_id);
    assert!(
        received
            .iter()
            .any(|s| s.name == "discovery" && hex(&s.trace_id) == trace_id),
        "the discovery root of the trace was exported too"
    );
    // The GetInfo step's latency leads to that step's own span, under the same register span.
    let (step_trace, step_span) = step_exemplars[0].clone();
    assert_eq!(step_trace, trace_id, "{step_exemplars:?}");
    let get_info = received
        .iter()
        .find(|s| s.name == "GetInfo" && hex(&s.span_id) == step_span)
        .unwrap_or_else(|| panic!("{test}: no GetInfo span {step_span} received"));
    assert_eq!(hex(&get_info.parent_span_id), span_id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_sampling_ratio_of_zero_failed_and_slow_registrations_are_exported_and_fast_ones_not()
 {
    let test = "with_a_sampling_ratio_of_zero_failed_and_slow_registrations_are_exported_and_fast_ones_not";
    let (endpoint, mut spans) = otlp_receiver().await;
    let dir = PluginDir::new();
    let mut options = AgentOptions::new(Source::Inotify, &dir.root());
    options.extra = ["--no-metrics", "--otlp-endpoint", &endpoint]
        .iter()
        .map(|a| a.to_string())
        .chain(["--trace-keep-slower-than".into(), "450ms".into()])
        .collect();
    options.env = vec![
        (
            "OTEL_TRACES_SAMPLER".into(),
            "parentbased_traceidratio".into(),
        ),
        ("OTEL_TRACES_SAMPLER_ARG".into(), "0".into()),
    ];
    let agent = AgentProcess::start(test, options)
        .await
        .unwrap_or_else(|| panic!("{test}: the inotify source needs nothing special"));

    let fast = dir.path("fast.sock");
    let slow = dir.path("slow.sock");
    let failed = dir.path("failed.sock");
    let fast_plugin = plugin!(&fast).name("fast.example.com").spawn();
    // Over the threshold by 200 ms, and 350 ms within the agent's 1 s GetInfo deadline: slow by
    // the agent's rule on a loaded machine too, and a fast registration has 450 ms of room.
    let slow_plugin = plugin!(&slow)
        .name("slow.example.com")
        .arg("--get-info-delay")
        .arg("650ms")
        .spawn();
    // No handler serves this type: the registration fails.
    let failed_plugin = plugin!(&failed)
        .name("failed.example.com")
        .plugin_type("NoSuchType")
        .spawn();
    fast_plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    slow_plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    failed_plugin.wait_for_notify(false, EVENT_TIMEOUT).await;
    // The log lines are the subject: each carries its registration's trace id, or none.
    let slow_line = agent
        .wait_for_log("slow registered", EVENT_TIMEOUT, logs::registered(&slow))
        .await;
    let failed_line = agent
        .wait_for_log(
            "failed registration",
            EVENT_TIMEOUT,
            logs::registration_failed(&failed),
        )
        .await;
    agent
        .wait_for_event(
            Mark(0),
            "fast registered",
            EVENT_TIMEOUT,
            seen::registered(&fast),
        )
        .await;
    let status = agent.stop().await;
    assert!(status.success(), "{status:?}");

    let received = drain(&mut spans);
    let registers = |socket: &std::path::Path| -> Vec<&Span> {
        let text = socket.to_string_lossy();
        received
            .iter()
            .filter(|s| {
                s.name == "register" && attribute(s, "socket_path").as_deref() == Some(&*text)
            })
            .collect()
    };
    let slow_spans = registers(&slow);
    assert!(
        !slow_spans.is_empty(),
        "{test}: the slow registration was not exported"
    );
    assert_eq!(
        attribute(slow_spans[0], "tail_kept").as_deref(),
        Some("slow")
    );
    let failed_spans = registers(&failed);
    assert!(
        !failed_spans.is_empty(),
        "{test}: the failed registration was not exported"
    );
    assert_eq!(
        attribute(failed_spans[0], "tail_kept").as_deref(),
        Some("failed")
    );
    // A kept trace is exported whole: its discovery root and its steps.
    let trace = &failed_spans[0].trace_id;
    assert!(
        received
            .iter()
            .any(|s| s.name == "discovery" && &s.trace_id == trace)
    );
    assert!(
        received
            .iter()
            .any(|s| s.name == "GetInfo" && &s.trace_id == trace)
    );
    assert!(
        registers(&fast).is_empty(),
        "{test}: a fast successful registration was exported though not sampled"
    );
    let fast_text = fast.to_string_lossy();
    assert!(
        !received
            .iter()
            .any(|s| attribute(s, "socket_path").as_deref() == Some(&*fast_text)),
        "{test}: a span of the fast registration's trace was exported (its discovery is built \
         only if an operation under it is kept)"
    );
    // Unsampled operations are built only once kept, with the IDs their log lines named while
    // they ran, under their discovery, with their steps' real times.
    for (line, span) in [(&slow_line, slow_spans[0]), (&failed_line, failed_spans[0])] {
        assert_eq!(
            line.field("trace_id").as_deref(),
            Some(hex(&span.trace_id).as_str()),
            "{test}: {line}"
        );
        assert_eq!(
            line.field("span_id").as_deref(),
            Some(hex(&span.span_id).as_str()),
            "{test}: {line}"
        );
        let discoveries: Vec<&Span> = received
            .iter()
            .filter(|s| s.name == "discovery" && s.trace_id == span.trace_id)
            .collect();
        // Built once, however many attempts under it were kept (the failed one retries).
        assert_eq!(discoveries.len(), 1, "{test}: {discoveries:?}");
        let discovery = discoveries[0];
        // Built inside the operation that kept it, it is still the trace's root.
        assert!(
            discovery.parent_span_id.is_empty(),
            "{test}: the discovery has a parent: {discovery:?}"
        );
        assert_eq!(span.parent_span_id, discovery.span_id, "{test}");
        // Built only once kept, it still says what the watcher saw.
        assert_eq!(
            attribute(discovery, "socket_path"),
            attribute(span, "socket_path"),
            "{test}"
        );
        assert_eq!(
            attribute(discovery, "change").as_deref(),
            Some("created"),
            "{test}"
        );
    }
    let slow_get_info = received
        .iter()
        .find(|s| {
            s.name == "GetInfo"
                && s.trace_id == slow_spans[0].trace_id
                && s.parent_span_id == slow_spans[0].span_id
        })
        .unwrap_or_else(|| panic!("{test}: the slow registration's GetInfo was not exported"));
    let took = slow_get_info
        .end_time_unix_nano
        .saturating_sub(slow_get_info.start_time_unix_nano);
    assert!(
        took >= 600_000_000,
        "{test}: the slow GetInfo span lasted {took} ns, the plugin waited 650 ms"
    );
    let register_took = slow_spans[0]
        .end_time_unix_nano
        .saturating_sub(slow_spans[0].start_time_unix_nano);
    assert!(
        register_took >= took,
        "{test}: the step outlasts its operation"
    );
}

/// The span's start or end as wall-clock nanoseconds since the epoch.
fn unix_nanos(at: std::time::SystemTime) -> u64 {
    at.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// With eBPF, a socket's trace starts at the kernel's moment: the `discovery` span starts when
/// the plugin's `bind` returned (`kernel_timestamp=true`), before the plugin itself could say it
/// listens; and the first process other than the agent to connect (here the test, standing in
/// for kubelet) adds a `first_contact` span under it, from the bind to the connect, naming the
/// caller. (docs/observability.md, "Where the discovery span starts".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_ebpf_the_trace_starts_at_the_kernel_s_bind_and_shows_the_first_contact() {
    let test = "with_ebpf_the_trace_starts_at_the_kernel_s_bind_and_shows_the_first_contact";
    let (endpoint, mut spans) = otlp_receiver().await;
    let dir = PluginDir::new();
    let mut options = AgentOptions::new(Source::Ebpf, &dir.root());
    options.extra = ["--no-metrics", "--otlp-endpoint", &endpoint]
        .iter()
        .map(|a| a.to_string())
        .collect();
    let Some(agent) = AgentProcess::start(test, options).await else {
        return;
    };
    let socket = dir.path("kernel-timed.sock");
    let spawned = unix_nanos(std::time::SystemTime::now());
    let plugin = plugin!(&socket).name("kernel.example.com").spawn();
    let listening = plugin.wait_for_event("listening", EVENT_TIMEOUT).await;
    let listening_at: u64 = listening
        .field("at_ns")
        .and_then(|ns| ns.parse().ok())
        .expect("the plugin's events carry at_ns");
    plugin.wait_for_notify(true, EVENT_TIMEOUT).await;
    let connected = unix_nanos(std::time::SystemTime::now());
    drop(std::os::unix::net::UnixStream::connect(&socket).expect("connect to the plugin"));
    let socket_text = socket.to_string_lossy().into_owned();
    agent
        .wait_for_event(Mark(0), "the first contact", EVENT_TIMEOUT, |l| {
            l.field_is("kind", "first_contact") && l.field_is("socket_path", &socket_text)
        })
        .await;
    assert!(agent.stop().await.success());

    let mut by_name: HashMap<String, Span> = HashMap::new();
    let collect = async {
        while !(by_name.contains_key("discovery") && by_name.contains_key("first_contact")) {
            let Some(span) = spans.recv().await else {
                break;
            };
            if attribute(&span, "socket_path").as_deref() == Some(&socket_text) {
                by_name.entry(span.name.clone()).or_insert(span);
            }
        }
    };
    if tokio::time::timeout(EVENT_TIMEOUT, collect).await.is_err() {
        panic!("{test}: spans received: {:?}", by_name.keys());
    }
    let discovery = &by_name["discovery"];
    assert_eq!(
        attribute(discovery, "kernel_timestamp").as_deref(),
        Some("true")
    );
    assert_eq!(
        attribute(discovery, "event_source").as_deref(),
        Some("ebpf")
    );
    // The kernel's timestamp, turned into wall time: after the plugin was spawned, before it
    // printed that it listens (1 ms for the two clocks read a moment apart).
    let slack = 1_000_000;
    assert!(
        spawned <= discovery.start_time_unix_nano
            && discovery.start_time_unix_nano <= listening_at + slack,
        "{test}: discovery starts at {} (spawned {spawned}, listening {listening_at})",
        discovery.start_time_unix_nano
    );
    let contact = &by_name["first_contact"];
    assert_eq!(contact.trace_id, discovery.trace_id, "one trace");
    assert_eq!(contact.parent_span_id, discovery.span_id);
    assert_eq!(
        attribute(contact, "process.pid"),
        Some(std::process::id().to_string())
    );
    assert!(
        contact
            .start_time_unix_nano
            .abs_diff(discovery.start_time_unix_nano)
            <= slack,
        "{test}: first_contact starts at the bind: {} vs {}",
        contact.start_time_unix_nano,
        discovery.start_time_unix_nano
    );
    assert!(
        connected <= contact.end_time_unix_nano + slack
            && contact.end_time_unix_nano > contact.start_time_unix_nano,
        "{test}: first_contact ends at the connect ({connected}): {contact:?}"
    );
}

/// Plugins do not control `/metrics`. In observe mode a plugin's type is whatever it answers:
/// twenty plugins answering twenty types make one `other` series, not twenty. Socket names that
/// are not UTF-8 (and one whose text is what such a name would be escaped to) are each their
/// own `plugin_manager_total_plugins` series, and the exposition parses (`promtool check
/// metrics`) with no series twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_types_and_socket_names_neither_mint_labels_nor_collide() {
    use std::os::unix::ffi::OsStrExt;
    let test = "plugin_types_and_socket_names_neither_mint_labels_nor_collide";
    let Some(promtool) = find_binary("promtool") else {
        skip(test, "promtool is not installed (cargo xtask deps)");
        return;
    };
    let dir = PluginDir::new();
    let mut options = AgentOptions::new(Source::Inotify, &dir.root()).handlers(&[]);
    options.extra = vec!["--metrics-addr".into(), "127.0.0.1:0".into()];
    let agent = AgentProcess::start(test, options)
        .await
        .expect("inotify needs no privileges");
    let addr = metrics_addr(&agent).await;
    const TYPES: usize = 20;
    let mut plugins: Vec<_> = (0..TYPES)
        .map(|i| {
            plugin!(dir.path(&format!("t{i}.sock")))
                .plugin_type(&format!("VendorType{i}"))
                .spawn()
        })
        .collect();
    let names: [&[u8]; 3] = [b"bad\xff.sock", b"bad\xfe.sock", b"bad\\xff.sock"];
    for name in names {
        let socket = dir.root().join(std::ffi::OsStr::from_bytes(name));
        plugins.push(plugin!(socket).spawn());
    }
    let observed_other =
        format!("plugin_agent_plugins{{type=\"other\",state=\"observed\"}} {TYPES}");
    let deadline = Instant::now() + EVENT_TIMEOUT;
    let metrics = loop {
        let (_, body) = tokio::task::spawn_blocking(move || http_get(addr, "/metrics"))
            .await
            .expect("scrape");
        let observed_csi = body
            .lines()
            .any(|l| l == "plugin_agent_plugins{type=\"CSIPlugin\",state=\"observed\"} 3");
        if body.lines().any(|l| l == observed_other) && observed_csi {
            break body;
        }
        assert!(
            Instant::now() < deadline,
            "{test}: not all plugins observed:\n{}",
            body.lines()
                .filter(|l| l.starts_with("plugin_agent_plugins"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let types: std::collections::BTreeSet<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("plugin_agent_plugins{"))
        .filter_map(|l| l.split("type=\"").nth(1)?.split('"').next())
        .collect();
    assert!(
        types
            .iter()
            .all(|t| ["CSIPlugin", "DevicePlugin", "DRAPlugin", "other", "unknown"].contains(t)),
        "{test}: type labels are a bounded set: {types:?}"
    );
    let series: Vec<&str> = metrics
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.rsplit_once(' ').map(|(series, _)| series))
        .collect();
    let unique: std::collections::BTreeSet<&&str> = series.iter().collect();
    assert_eq!(
        unique.len(),
        series.len(),
        "{test}: a series twice:\n{metrics}"
    );
    let observed_paths = series
        .iter()
        .filter(|s| {
            s.starts_with("plugin_manager_total_plugins{socket_path=\"")
                && s.contains("bad")
                && s.contains("desired_state_of_world")
        })
        .count();
    assert_eq!(
        observed_paths,
        names.len(),
        "{test}: one series per socket:\n{metrics}"
    );

    let mut check = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start promtool");
    use std::io::Write as _;
    check
        .stdin
        .take()
        .expect("piped")
        .write_all(metrics.as_bytes())
        .expect("feed promtool");
    let out = check.wait_with_output().expect("promtool");
    assert!(
        out.status.success(),
        "{test}: promtool check metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
