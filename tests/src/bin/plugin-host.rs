//! `plugin-host`: many well-behaved kubelet plugins in one process, for tests that need a
//! thousand of them (one `example-plugin` process each would cost a thousand processes).
//!
//! ```text
//! plugin-host --dir D --count N --> D/p0000.sock .. D/p<N-1>.sock, each serving pluginregistration
//!   stdout: {"event":"serving","count":N} once all listen, then one {"event":"notify",...} per call
//!   stdin:  "churn R"  replace R plugins a second (stop one, start a new one, sometimes in a new
//!                       sub-directory, sometimes re-created on the same path)
//!           "pause"    stop churning; answer {"event":"live","sockets":[...]} (every socket served now)
//!           EOF        stop every plugin, remove their sockets, exit
//! ```
//!
//! Every plugin answers GetInfo at once and accepts every notification, so anything a test sees
//! go wrong is the agent's (or the misbehaving plugins it runs next to these).

use clap::Parser;
use plugin_agent_tests::fake_plugin::serve::Served;
use plugin_agent_tests::fake_plugin::{FakePlugin, Heard, socket};
use serde_json::json;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::io::AsyncBufReadExt;

#[derive(Parser, Debug)]
#[command(about = "Hosts many kubelet registration plugins in one process")]
struct Args {
    /// The agent's plugin directory (sockets go in it and in sub-directories of it).
    #[arg(long)]
    dir: PathBuf,
    /// Plugins served from the start.
    #[arg(long, default_value_t = 1000)]
    count: usize,
    /// `PluginInfo.type`.
    #[arg(long = "type", default_value = "CSIPlugin")]
    plugin_type: String,
    /// `PluginInfo.supported_versions`, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1.0.0")]
    versions: Vec<String>,
    /// Plugin names are `<prefix>-<index>`.
    #[arg(long, default_value = "host.plugin.test")]
    name_prefix: String,
}

/// Prints one event line and flushes it at once, for the harness reading it.
fn emit(event: serde_json::Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{event}");
    let _ = out.flush();
}

/// One hosted plugin: its server, and its socket, removed when it stops.
struct Hosted {
    served: Served,
    socket: PathBuf,
}

impl Hosted {
    /// Binds `socket` (replacing what is there) and serves `plugin` on it.
    fn start(socket: &Path, plugin: FakePlugin) -> std::io::Result<Hosted> {
        let listener = socket::bind_listening(socket, 4096)?;
        Ok(Hosted {
            served: Served::spawn(listener, plugin),
            socket: socket.to_path_buf(),
        })
    }

    async fn stop(self) {
        self.served.stopped().await;
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// Every plugin this process serves, by socket path.
struct Host {
    args: Args,
    served: BTreeMap<PathBuf, Hosted>,
    next: usize,
}

impl Host {
    /// Starts plugin number `index` at `socket`.
    fn start(&mut self, index: usize, socket: PathBuf) -> anyhow::Result<()> {
        let name = format!("{}-{index}", self.args.name_prefix);
        let info = FakePlugin::info(&self.args.plugin_type, &name, &self.args.versions);
        let path = socket.display().to_string();
        let plugin = FakePlugin::new(info).on_call(move |heard| {
            if let Heard::Notify { status, .. } = heard {
                emit(json!({
                    "event": "notify", "socket": path, "name": name,
                    "registered": status.plugin_registered, "error": status.error,
                }));
            }
        });
        let served = Hosted::start(&socket, plugin)
            .map_err(|e| anyhow::anyhow!("cannot serve {}: {e}", socket.display()))?;
        self.served.insert(socket, served);
        Ok(())
    }

    /// One churn step: a plugin goes away and a new one appears. Every third step re-creates the
    /// socket on the same path (a plugin restart); every fifth puts the newcomer in a new
    /// sub-directory (a driver creating its own directory).
    async fn churn_once(&mut self) -> anyhow::Result<()> {
        let step = self.next;
        self.next += 1;
        let victim = self
            .served
            .keys()
            .nth(step % self.served.len().max(1))
            .cloned();
        let socket = match victim {
            Some(path) => {
                if let Some(served) = self.served.remove(&path) {
                    served.stop().await;
                }
                // A driver that goes away takes its own directory with it (kept flat: the
                // agent's watched set must not grow with churn).
                if let Some(parent) = path.parent().filter(|p| *p != self.args.dir)
                    && !step.is_multiple_of(3)
                {
                    let _ = std::fs::remove_dir(parent);
                }
                if step.is_multiple_of(3) {
                    path
                } else if step.is_multiple_of(5) {
                    self.args.dir.join(format!("d{step}/p{step:04}.sock"))
                } else {
                    self.args.dir.join(format!("p{step:04}.sock"))
                }
            }
            None => self.args.dir.join(format!("p{step:04}.sock")),
        };
        self.start(step, socket)
    }

    fn live(&self) -> Vec<String> {
        self.served
            .keys()
            .map(|p| p.display().to_string())
            .collect()
    }

    async fn stop_all(&mut self) {
        for (_, served) in std::mem::take(&mut self.served) {
            served.stop().await;
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    std::fs::create_dir_all(&args.dir)?;
    let count = args.count;
    let mut host = Host {
        served: BTreeMap::new(),
        next: count,
        args,
    };
    for index in 0..count {
        let socket = host.args.dir.join(format!("p{index:04}.sock"));
        host.start(index, socket)?;
    }
    emit(json!({"event": "serving", "count": count}));

    let mut stdin = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    let mut churn: Option<tokio::time::Interval> = None;
    loop {
        let tick = async {
            match churn.as_mut() {
                Some(interval) => interval.tick().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            line = stdin.next_line() => {
                let Ok(Some(line)) = line else { break };
                let mut words = line.split_whitespace();
                match (words.next(), words.next().and_then(|r| r.parse::<f64>().ok())) {
                    (Some("churn"), Some(rate)) if rate > 0.0 => {
                        let mut interval = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
                        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                        churn = Some(interval);
                    }
                    (Some("pause"), _) => {
                        churn = None;
                        emit(json!({"event": "live", "sockets": host.live()}));
                    }
                    _ => emit(json!({"event": "error", "error": format!("unknown command {line:?}")})),
                }
            }
            _ = tick => {
                if let Err(e) = host.churn_once().await {
                    emit(json!({"event": "error", "error": format!("{e:#}")}));
                }
            }
        }
    }
    host.stop_all().await;
    emit(json!({"event": "stopped"}));
    Ok(())
}
