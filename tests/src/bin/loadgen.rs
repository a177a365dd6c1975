//! Load generator: hosts many real kubelet-compatible plugins in one process, each serving
//! `pluginregistration` on its own socket, and measures how long each waits from `listen` to
//! `NotifyRegistrationStatus(true)`.
//!
//! The agent under test runs separately (`cargo xtask bench` starts it). Before measuring, one
//! warm-up plugin must register, which proves the agent is watching.
//!
//! Scenarios:
//! - `sequential`: one plugin at a time: create, wait for its notification, next.
//! - `burst`: create `count` plugins as fast as possible, wait for all.
//!
//! Prints one JSON object on stdout: the scenario, counts and latency percentiles in microseconds.

use clap::{Parser, ValueEnum};
use plugin_agent_proto::pluginregistration::registration_server::{
    Registration, RegistrationServer,
};
use plugin_agent_proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

#[derive(Parser, Debug)]
#[command(about = "Hosts many kubelet plugins and measures listen -> Notify(true) latency")]
struct Args {
    /// The agent's plugin directory.
    #[arg(long)]
    plugin_dir: PathBuf,
    /// What to run.
    #[arg(long, value_enum)]
    scenario: Scenario,
    /// Plugins to create.
    #[arg(long, default_value_t = 100)]
    count: usize,
    /// Plugin type announced.
    #[arg(long, default_value = "CSIPlugin")]
    plugin_type: String,
    /// Give up waiting for any one notification after this long.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    timeout: Duration,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Scenario {
    Sequential,
    Burst,
}

/// One plugin's `NotifyRegistrationStatus`, with when it arrived.
struct Notified {
    index: usize,
    registered: bool,
    at: Instant,
}

#[derive(Clone)]
struct Plugin {
    index: usize,
    info: PluginInfo,
    notified: mpsc::UnboundedSender<Notified>,
}

#[tonic::async_trait]
impl Registration for Plugin {
    async fn get_info(
        &self,
        _: tonic::Request<InfoRequest>,
    ) -> Result<tonic::Response<PluginInfo>, tonic::Status> {
        Ok(tonic::Response::new(self.info.clone()))
    }
    async fn notify_registration_status(
        &self,
        request: tonic::Request<RegistrationStatus>,
    ) -> Result<tonic::Response<RegistrationStatusResponse>, tonic::Status> {
        let at = Instant::now();
        let registered = request.into_inner().plugin_registered;
        let _ = self.notified.send(Notified {
            index: self.index,
            registered,
            at,
        });
        Ok(tonic::Response::new(RegistrationStatusResponse {}))
    }
}

/// Binds and serves plugin `index`; returns when it is listening, with the listen instant.
fn start_plugin(
    args: &Args,
    index: usize,
    notified: &mpsc::UnboundedSender<Notified>,
    shutdown: &CancellationToken,
) -> anyhow::Result<Instant> {
    let socket = args.plugin_dir.join(format!("loadgen-{index}.sock"));
    let _ = std::fs::remove_file(&socket);
    let listener = tokio::net::UnixListener::bind(&socket)?;
    let listening = Instant::now();
    let plugin = Plugin {
        index,
        info: PluginInfo {
            r#type: args.plugin_type.clone(),
            name: format!("loadgen-{index}"),
            endpoint: String::new(),
            supported_versions: vec!["1.0.0".into()],
        },
        notified: notified.clone(),
    };
    let stop = shutdown.clone().cancelled_owned();
    tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(plugin))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::UnixListenerStream::new(listener),
                stop,
            )
            .await;
    });
    Ok(listening)
}

fn percentile(sorted: &[Duration], p: f64) -> u128 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1].as_micros()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let shutdown = CancellationToken::new();
    let (tx, mut rx) = mpsc::unbounded_channel();

    // Warm-up: proves the agent watches the directory before anything is measured.
    let warmup = args.count;
    start_plugin(&args, warmup, &tx, &shutdown)?;
    loop {
        let n = tokio::time::timeout(args.timeout, rx.recv())
            .await?
            .ok_or_else(|| anyhow::anyhow!("channel closed"))?;
        if n.index == warmup && n.registered {
            break;
        }
    }

    let mut listen_at = vec![None; args.count];
    let mut latencies = vec![None; args.count];
    let started = Instant::now();
    match args.scenario {
        Scenario::Sequential => {
            for i in 0..args.count {
                listen_at[i] = Some(start_plugin(&args, i, &tx, &shutdown)?);
                while latencies[i].is_none() {
                    let n = tokio::time::timeout(args.timeout, rx.recv())
                        .await
                        .map_err(|_| {
                            anyhow::anyhow!("plugin {i} was not notified within {:?}", args.timeout)
                        })?
                        .ok_or_else(|| anyhow::anyhow!("channel closed"))?;
                    record(&n, &listen_at, &mut latencies);
                }
            }
        }
        Scenario::Burst => {
            for (i, slot) in listen_at.iter_mut().enumerate() {
                *slot = Some(start_plugin(&args, i, &tx, &shutdown)?);
            }
            let mut done = 0;
            while done < args.count {
                let n = tokio::time::timeout(args.timeout, rx.recv())
                    .await
                    .map_err(|_| {
                        anyhow::anyhow!(
                            "only {done} of {} notified within {:?}",
                            args.count,
                            args.timeout
                        )
                    })?
                    .ok_or_else(|| anyhow::anyhow!("channel closed"))?;
                if record(&n, &listen_at, &mut latencies) {
                    done += 1;
                }
            }
        }
    }
    let total = started.elapsed();
    let mut sorted: Vec<Duration> = latencies.iter().flatten().copied().collect();
    sorted.sort();
    let report = serde_json::json!({
        "scenario": format!("{:?}", args.scenario).to_lowercase(),
        "count": args.count,
        "registered": sorted.len(),
        "total_us": total.as_micros(),
        "p50_us": percentile(&sorted, 50.0),
        "p90_us": percentile(&sorted, 90.0),
        "p99_us": percentile(&sorted, 99.0),
        "max_us": sorted.last().map(|d| d.as_micros()).unwrap_or(0),
    });
    println!("{report}");
    shutdown.cancel();
    for i in 0..=args.count {
        let _ = std::fs::remove_file(args.plugin_dir.join(format!("loadgen-{i}.sock")));
    }
    Ok(())
}

/// Records a successful first notification; true when it was new.
fn record(n: &Notified, listen_at: &[Option<Instant>], latencies: &mut [Option<Duration>]) -> bool {
    let (Some(Some(listened)), true) = (listen_at.get(n.index), n.registered) else {
        return false;
    };
    match latencies.get_mut(n.index) {
        Some(slot @ None) => {
            *slot = Some(n.at.saturating_duration_since(*listened));
            true
        }
        _ => false,
    }
}
