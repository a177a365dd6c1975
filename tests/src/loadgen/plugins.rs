//! Plugins hosted in this process: each one a real `pluginregistration` gRPC server on its own
//! Unix socket, as a CSI node-driver-registrar or a DRA kubelet plugin serves it (the tests'
//! `fake_plugin`, well-behaved).
//!
//! A worker process holds thousands of these; the coordinator tells it which to start and stop
//! (see `workers`). What happens to each plugin is reported as a [`Report`] with wall-clock
//! timestamps, so that reports from several processes and the agent's own admin events (which
//! carry Unix-epoch times) line up on one clock.

use plugin_agent_tests::fake_plugin::serve;
use plugin_agent_tests::fake_plugin::{FakePlugin, Heard, socket};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Nanoseconds since the Unix epoch: the one clock shared by workers, the coordinator and the
/// agent's admin events.
pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// The socket file name of plugin `id`; [`id_of`] inverts it.
pub fn socket_name(id: u64) -> String {
    format!("p-{id}.sock")
}

/// The plugin id a socket path names, if it is one of ours.
pub fn id_of(path: &str) -> Option<u64> {
    let name = Path::new(path).file_name()?.to_str()?;
    name.strip_prefix("p-")?.strip_suffix(".sock")?.parse().ok()
}

/// What a plugin announces in `GetInfo`.
#[derive(Debug, Clone)]
pub struct Announce {
    /// `CSIPlugin`, `DRAPlugin`, ...
    pub plugin_type: String,
    /// `supported_versions` (the DRA example handler wants `v1.DRAPlugin`).
    pub versions: Vec<String>,
}

/// What happened to one plugin, as seen from the plugin's side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Report {
    /// Socket bound at `bound_ns`; `accept` started (listen + serve) at `serving_ns`.
    Serving {
        id: u64,
        bound_ns: u64,
        serving_ns: u64,
    },
    /// `NotifyRegistrationStatus` arrived.
    Notified {
        id: u64,
        registered: bool,
        at_ns: u64,
    },
    /// The socket was unlinked (the plugin went away) at `at_ns`.
    Stopped { id: u64, at_ns: u64 },
    /// The plugin could not be started.
    Failed { id: u64, error: String },
}

impl Report {
    /// One line of the worker protocol.
    pub fn to_line(&self) -> String {
        match self {
            Report::Serving {
                id,
                bound_ns,
                serving_ns,
            } => format!("L {id} {bound_ns} {serving_ns}"),
            Report::Notified {
                id,
                registered,
                at_ns,
            } => format!("N {id} {} {at_ns}", u8::from(*registered)),
            Report::Stopped { id, at_ns } => format!("S {id} {at_ns}"),
            Report::Failed { id, error } => format!("E {id} {}", error.replace('\n', " ")),
        }
    }

    /// Parses [`Self::to_line`]'s output.
    pub fn parse(line: &str) -> Option<Report> {
        let mut words = line.splitn(4, ' ');
        let tag = words.next()?;
        let id = words.next()?.parse().ok()?;
        let mut num = || words.next().and_then(|w| w.parse::<u64>().ok());
        Some(match tag {
            "L" => Report::Serving {
                id,
                bound_ns: num()?,
                serving_ns: num()?,
            },
            "N" => Report::Notified {
                id,
                registered: num()? == 1,
                at_ns: num()?,
            },
            "S" => Report::Stopped { id, at_ns: num()? },
            "E" => Report::Failed {
                id,
                error: line.splitn(3, ' ').nth(2).unwrap_or("").to_owned(),
            },
            _ => return None,
        })
    }
}

/// The plugins of this process, by id.
pub struct PluginHost {
    dir: PathBuf,
    announce: Announce,
    reports: mpsc::UnboundedSender<Report>,
    running: HashMap<u64, CancellationToken>,
}

impl PluginHost {
    /// Plugins are created in `dir`, announce `announce`, and report to `reports`.
    pub fn new(dir: PathBuf, announce: Announce, reports: mpsc::UnboundedSender<Report>) -> Self {
        PluginHost {
            dir,
            announce,
            reports,
            running: HashMap::new(),
        }
    }

    /// Binds plugin `id`'s socket now and serves it after `serve_delay` (zero: at once). A
    /// delayed plugin has a socket nobody accepts on (connect is refused), as a plugin that binds
    /// before its gRPC server is ready.
    pub fn start(&mut self, id: u64, serve_delay: Duration) {
        let path = self.dir.join(socket_name(id));
        let fd = match socket::bind(&path) {
            Ok(fd) => fd,
            Err(e) => {
                let _ = self.reports.send(Report::Failed {
                    id,
                    error: format!("bind {}: {e}", path.display()),
                });
                return;
            }
        };
        let bound_ns = now_ns();
        let stop = CancellationToken::new();
        self.running.insert(id, stop.clone());
        let info = FakePlugin::info(
            &self.announce.plugin_type,
            &format!("loadgen-{id}"),
            &self.announce.versions,
        );
        let reports = self.reports.clone();
        let plugin = FakePlugin::new(info).on_call(move |heard| {
            if let Heard::Notify { status, .. } = heard {
                let _ = reports.send(Report::Notified {
                    id,
                    registered: status.plugin_registered,
                    at_ns: now_ns(),
                });
            }
        });
        let reports = self.reports.clone();
        tokio::spawn(async move {
            if !serve_delay.is_zero() {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(serve_delay) => {}
                }
            }
            let listener = match socket::listen(&fd, 1024).and_then(|()| socket::listener(fd)) {
                Ok(listener) => listener,
                Err(e) => {
                    let _ = reports.send(Report::Failed {
                        id,
                        error: format!("listen: {e}"),
                    });
                    return;
                }
            };
            let _ = reports.send(Report::Serving {
                id,
                bound_ns,
                serving_ns: now_ns(),
            });
            let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
            let _ = serve::grpc(incoming, plugin, stop.cancelled_owned()).await;
        });
    }

    /// Plugin `id` goes away: its socket is unlinked (the moment reported), then its server stops.
    pub fn stop(&mut self, id: u64) {
        let Some(stop) = self.running.remove(&id) else {
            return;
        };
        let _ = std::fs::remove_file(self.dir.join(socket_name(id)));
        let _ = self.reports.send(Report::Stopped {
            id,
            at_ns: now_ns(),
        });
        stop.cancel();
    }

    /// Stops every plugin still running.
    pub fn stop_all(&mut self) {
        let ids: Vec<u64> = self.running.keys().copied().collect();
        for id in ids {
            self.stop(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_round_trip_through_the_worker_protocol() {
        for report in [
            Report::Serving {
                id: 7,
                bound_ns: 1,
                serving_ns: 2,
            },
            Report::Notified {
                id: 8,
                registered: true,
                at_ns: 3,
            },
            Report::Stopped { id: 9, at_ns: 4 },
            Report::Failed {
                id: 10,
                error: "bind x: no space".into(),
            },
        ] {
            assert_eq!(Report::parse(&report.to_line()), Some(report));
        }
    }

    #[test]
    fn socket_names_map_back_to_ids() {
        assert_eq!(id_of(&format!("/d/{}", socket_name(42))), Some(42));
        assert_eq!(id_of("/d/noise-1.sock"), None);
    }
}
