//! The one fake kubelet plugin every test uses: kubelet's `pluginregistration.Registration`
//! service with an answer it is told to give and the ways a real plugin goes wrong, as options.
//!
//! ```text
//! FakePlugin::new(info) .get_info(Faults) .notify(Faults) .on_call(|Heard| ..)
//!   -> socket::bind / socket::listen (bound, listening: two steps, so a test can sit between)
//!   -> serve::Served::spawn (in process: engine tests, loadgen workers, plugin-host)
//!      serve::grpc / serve::garbage / serve::silent (the `example-plugin` process)
//!   -> socket::hand_off (the listener passed on to a successor process)
//! ```
//!
//! Kubelet's v1alpha1, v1beta1 and v1 registration APIs are one gRPC package
//! (`pluginregistration`) with the same messages and service, so this one service answers a
//! client of any of them (`proto/pluginregistration.proto`); what a v1beta1 device plugin and a
//! v1 DRA driver announce differently is `PluginInfo.supported_versions`, which is the caller's.
//!
//! - hang: [`Faults::hang`] (never answers) or [`Faults::gate`] (answers when released);
//! - lie: the [`PluginInfo`] it is given (empty, oversized, thousands of versions: the agent
//!   must refuse it), [`Faults::error`] (a gRPC error), or not gRPC at all (`serve::garbage`,
//!   `serve::silent`);
//! - crash: [`Faults::crash`] aborts the process on that call, its socket left behind;
//! - hand off: `socket::hand_off` starts a successor serving the same listening socket.
//!
//! What it hears is reported as [`Heard`] to the [`FakePlugin::on_call`] callback: the binary
//! prints it as JSON lines, in-process users send it on a channel.

pub mod serve;
pub mod socket;

use plugin_agent_proto::pluginregistration::registration_server::{
    Registration, RegistrationServer,
};
use plugin_agent_proto::pluginregistration::{InfoRequest, RegistrationStatusResponse};
pub use plugin_agent_proto::pluginregistration::{PluginInfo, RegistrationStatus};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How one of the two calls misbehaves; the default answers at once. Applied in this order:
/// crash, hang, gate, delay, error.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// Abort the process when the call arrives (after reporting it): a plugin that crashes
    /// mid-registration, its socket left behind. Only for a plugin in its own process.
    pub crash: bool,
    /// Never answer.
    pub hang: bool,
    /// Answer only once this is notified (one permit per call).
    pub gate: Option<Arc<tokio::sync::Notify>>,
    /// Wait this long before answering ...
    pub delay: Option<Duration>,
    /// ... the first N calls only (`None`: every call).
    pub delay_times: Option<u32>,
    /// Answer with this error (with `code`: gRPC status UNKNOWN when none) ...
    pub error: Option<String>,
    /// ... of this gRPC status code (a plugin that is unavailable, or refuses the caller).
    pub code: Option<tonic::Code>,
    /// ... the first N calls only (`None`: every call).
    pub error_times: Option<u32>,
}

impl Faults {
    /// Never answers.
    pub fn hang() -> Faults {
        Faults {
            hang: true,
            ..Faults::default()
        }
    }

    /// Answers every call with `message` as a gRPC error.
    pub fn error(message: impl Into<String>) -> Faults {
        Faults {
            error: Some(message.into()),
            ..Faults::default()
        }
    }

    /// Answers every call with `message` as a gRPC error of status `code`.
    pub fn status(code: tonic::Code, message: impl Into<String>) -> Faults {
        Faults {
            code: Some(code),
            ..Faults::error(message)
        }
    }

    /// Answers only once `gate` is notified.
    pub fn gate(gate: Arc<tokio::sync::Notify>) -> Faults {
        Faults {
            gate: Some(gate),
            ..Faults::default()
        }
    }
}

/// What the plugin heard, reported as it happens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Heard {
    /// A GetInfo call arrived (from `peer_pid`, as `SO_PEERCRED` names it).
    GetInfo { peer_pid: Option<i32> },
    /// A GetInfo call was answered with this error ([`Faults::error`]).
    GetInfoFailed { error: String },
    /// A NotifyRegistrationStatus call arrived; `refused`: it is answered with an error.
    Notify {
        status: RegistrationStatus,
        refused: bool,
        peer_pid: Option<i32>,
    },
}

/// Where [`Heard`] goes.
type Report = Arc<dyn Fn(Heard) + Send + Sync>;

/// The registration service with its configured answers; serve it with [`serve`].
pub struct FakePlugin {
    info: PluginInfo,
    get_info: Calls,
    notify: Calls,
    report: Report,
}

impl FakePlugin {
    /// A plugin that answers GetInfo with `info` and accepts every notification.
    pub fn new(info: PluginInfo) -> FakePlugin {
        FakePlugin {
            info,
            get_info: Calls::new(Faults::default()),
            notify: Calls::new(Faults::default()),
            report: Arc::new(|_| {}),
        }
    }

    /// `PluginInfo` of `plugin_type` and `name`, the registration socket as its endpoint, one
    /// supported version per entry of `versions`.
    pub fn info(plugin_type: &str, name: &str, versions: &[String]) -> PluginInfo {
        PluginInfo {
            r#type: plugin_type.to_owned(),
            name: name.to_owned(),
            endpoint: String::new(),
            supported_versions: versions.to_vec(),
        }
    }

    /// How GetInfo misbehaves.
    pub fn get_info(mut self, faults: Faults) -> FakePlugin {
        self.get_info = Calls::new(faults);
        self
    }

    /// How NotifyRegistrationStatus misbehaves.
    pub fn notify(mut self, faults: Faults) -> FakePlugin {
        self.notify = Calls::new(faults);
        self
    }

    /// Calls `report` with every call heard (on the server's task: it must not block).
    pub fn on_call(mut self, report: impl Fn(Heard) + Send + Sync + 'static) -> FakePlugin {
        self.report = Arc::new(report);
        self
    }

    /// The tonic service.
    pub fn into_service(self) -> RegistrationServer<FakePlugin> {
        RegistrationServer::new(self)
    }
}

/// One call's faults and what is left of their budgets.
struct Calls {
    faults: Faults,
    delays_left: Budget,
    errors_left: Budget,
}

impl Calls {
    fn new(faults: Faults) -> Calls {
        Calls {
            delays_left: Budget(Mutex::new(faults.delay_times)),
            errors_left: Budget(Mutex::new(faults.error_times)),
            faults,
        }
    }

    /// The error this call answers with, if it fails (taking from the budget).
    fn error(&self) -> Option<String> {
        let message = self.faults.error.as_ref()?;
        self.errors_left.take().then(|| message.clone())
    }

    /// The error `message` as the gRPC status this call answers with.
    fn status(&self, message: String) -> tonic::Status {
        tonic::Status::new(self.faults.code.unwrap_or(tonic::Code::Unknown), message)
    }

    /// Crashes, hangs, waits for the gate and the delay, as configured.
    async fn misbehave(&self) {
        if self.faults.crash {
            // A crash, not an exit: no destructor runs, the socket stays.
            std::process::abort();
        }
        if self.faults.hang {
            std::future::pending::<()>().await;
        }
        if let Some(gate) = &self.faults.gate {
            gate.notified().await;
        }
        if let Some(delay) = self.faults.delay
            && self.delays_left.take()
        {
            tokio::time::sleep(delay).await;
        }
    }
}

/// Counts down the calls a fault applies to: `None` means every call.
#[derive(Debug)]
struct Budget(Mutex<Option<u32>>);

impl Budget {
    /// True if this call is one the fault applies to.
    fn take(&self) -> bool {
        let mut left = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match left.as_mut() {
            None => true,
            Some(0) => false,
            Some(n) => {
                *n -= 1;
                true
            }
        }
    }
}

#[tonic::async_trait]
impl Registration for FakePlugin {
    async fn get_info(
        &self,
        request: tonic::Request<InfoRequest>,
    ) -> Result<tonic::Response<PluginInfo>, tonic::Status> {
        (self.report)(Heard::GetInfo {
            peer_pid: peer_pid(&request),
        });
        self.get_info.misbehave().await;
        if let Some(error) = self.get_info.error() {
            (self.report)(Heard::GetInfoFailed {
                error: error.clone(),
            });
            return Err(self.get_info.status(error));
        }
        Ok(tonic::Response::new(self.info.clone()))
    }

    async fn notify_registration_status(
        &self,
        request: tonic::Request<RegistrationStatus>,
    ) -> Result<tonic::Response<RegistrationStatusResponse>, tonic::Status> {
        let peer_pid = peer_pid(&request);
        let refusal = self.notify.error();
        (self.report)(Heard::Notify {
            status: request.into_inner(),
            refused: refusal.is_some(),
            peer_pid,
        });
        self.notify.misbehave().await;
        match refusal {
            Some(error) => Err(self.notify.status(error)),
            None => Ok(tonic::Response::new(RegistrationStatusResponse {})),
        }
    }
}

/// The pid of the process on the other end of `request`'s connection (`SO_PEERCRED`), so a test
/// with two agents on one directory can tell whose call it was.
fn peer_pid<T>(request: &tonic::Request<T>) -> Option<i32> {
    request
        .extensions()
        .get::<tonic::transport::server::UdsConnectInfo>()
        .and_then(|info| info.peer_cred)
        .and_then(|cred| cred.pid())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_fails_the_first_n_calls_or_every_call() {
        let twice = Budget(Mutex::new(Some(2)));
        assert_eq!(
            [twice.take(), twice.take(), twice.take()],
            [true, true, false]
        );
        let always = Budget(Mutex::new(None));
        assert!((0..5).all(|_| always.take()));
    }
}
