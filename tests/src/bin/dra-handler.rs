//! Example handler: a DRA-style `pluginagent.v1.PluginHandler` server, as kubelet's DRA
//! registration handler behaves.
//!
//! - validate: the plugin must offer a DRA gRPC service this handler speaks; the highest one is
//!   picked (`v1.DRAPlugin` over `v1beta1.DRAPlugin`);
//! - register: keeps the instances of each driver name by endpoint (kubelet 1.33+: a rolling
//!   update runs the new instance, with its own socket and endpoint, beside the old one); the
//!   newest is the one in use. Registering an endpoint it already holds refreshes it (`replaced`);
//! - deregister: drops the instance with that endpoint; the driver is gone with its last instance
//!   (`last`).
//!
//! It prints one JSON line per call on stdout once answered, for end-to-end tests (with
//! `--delay`, another when the call arrives). `--reject-validate`,
//! `--reject-register` and `--delay` make it misbehave on purpose.

use clap::Parser;
use plugin_agent_proto::pluginagent::v1 as api;
use std::collections::HashMap;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tonic::{Request, Response, Status};

/// DRA services this handler speaks, best first.
const SERVICES: [&str; 2] = ["v1.DRAPlugin", "v1beta1.DRAPlugin"];

#[derive(Parser, Debug)]
#[command(about = "Example DRA-style plugin handler (pluginagent.v1.PluginHandler server)")]
struct Args {
    /// Where to listen: unix:///path.sock or http://127.0.0.1:PORT.
    #[arg(long)]
    listen: String,
    /// Refuse every plugin at validation with this message.
    #[arg(long)]
    reject_validate: Option<String>,
    /// Refuse every plugin at registration with this message.
    #[arg(long)]
    reject_register: Option<String>,
    /// Refuse only the first N registrations (with `--reject-register`), then accept.
    #[arg(long)]
    reject_register_times: Option<u32>,
    /// Wait this long in every call (a slow handler).
    #[arg(long, value_parser = humantime::parse_duration)]
    delay: Option<Duration>,
}

#[derive(Clone)]
struct DraHandler {
    /// Driver name -> the endpoints of its instances, newest last.
    drivers: Arc<Mutex<HashMap<String, Vec<String>>>>,
    reject_validate: Option<String>,
    reject_register: Option<String>,
    /// Registrations still to refuse; `None`: all of them.
    rejections_left: Arc<Mutex<Option<u32>>>,
    delay: Option<Duration>,
}

fn emit(value: serde_json::Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{value}");
    let _ = out.flush();
}

fn plugin_of(plugin: Option<api::Plugin>) -> Result<api::Plugin, Status> {
    plugin.ok_or_else(|| Status::invalid_argument("request has no plugin"))
}

/// The highest DRA service both sides speak.
fn pick_service(versions: &[String]) -> Option<&'static str> {
    SERVICES
        .into_iter()
        .find(|s| versions.iter().any(|v| v == s))
}

impl DraHandler {
    /// `--delay`: says the call arrived (`{"event":"received","method":...}`: not a `call` line,
    /// which is logged once answered), then waits.
    async fn pause(&self, method: &str, plugin: &api::Plugin) {
        if let Some(delay) = self.delay {
            emit(serde_json::json!({"event": "received", "method": method, "name": plugin.name}));
            tokio::time::sleep(delay).await;
        }
    }

    /// Whether this registration is one to refuse (`--reject-register-times` counts down).
    fn take_rejection(&self) -> bool {
        let mut left = self
            .rejections_left
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match left.as_mut() {
            None => true,
            Some(0) => false,
            Some(n) => {
                *n -= 1;
                true
            }
        }
    }

    fn drivers(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<String>>> {
        self.drivers.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[tonic::async_trait]
impl api::plugin_handler_server::PluginHandler for DraHandler {
    async fn validate_plugin(
        &self,
        request: Request<api::ValidatePluginRequest>,
    ) -> Result<Response<api::ValidatePluginResponse>, Status> {
        let plugin = plugin_of(request.into_inner().plugin)?;
        self.pause("validate", &plugin).await;
        let service = pick_service(&plugin.supported_versions);
        emit(
            serde_json::json!({"call": "validate", "name": plugin.name, "endpoint": plugin.endpoint, "service": service}),
        );
        if let Some(reason) = &self.reject_validate {
            return Err(Status::failed_precondition(reason.clone()));
        }
        if service.is_none() {
            return Err(Status::invalid_argument(format!(
                "none of the versions {:?} is a DRA service this handler speaks ({})",
                plugin.supported_versions,
                SERVICES.join(", ")
            )));
        }
        Ok(Response::new(api::ValidatePluginResponse {}))
    }

    async fn register_plugin(
        &self,
        request: Request<api::RegisterPluginRequest>,
    ) -> Result<Response<api::RegisterPluginResponse>, Status> {
        let plugin = plugin_of(request.into_inner().plugin)?;
        self.pause("register", &plugin).await;
        if let Some(reason) = self
            .reject_register
            .as_ref()
            .filter(|_| self.take_rejection())
        {
            emit(
                serde_json::json!({"call": "register", "name": plugin.name, "endpoint": plugin.endpoint, "rejected": reason}),
            );
            return Err(Status::internal(reason.clone()));
        }
        let (replaced, instances) = {
            let mut drivers = self.drivers();
            let instances = drivers.entry(plugin.name.clone()).or_default();
            let replaced = instances
                .iter()
                .position(|e| *e == plugin.endpoint)
                .map(|i| instances.remove(i));
            instances.push(plugin.endpoint.clone());
            (replaced, instances.len())
        };
        emit(serde_json::json!({
            "call": "register", "name": plugin.name, "endpoint": plugin.endpoint,
            "service": pick_service(&plugin.supported_versions), "replaced": replaced,
            "instances": instances,
        }));
        Ok(Response::new(api::RegisterPluginResponse {}))
    }

    async fn de_register_plugin(
        &self,
        request: Request<api::DeRegisterPluginRequest>,
    ) -> Result<Response<api::DeRegisterPluginResponse>, Status> {
        let plugin = plugin_of(request.into_inner().plugin)?;
        self.pause("deregister", &plugin).await;
        let (removed, instances) = {
            let mut drivers = self.drivers();
            let instances = drivers.entry(plugin.name.clone()).or_default();
            let removed = instances
                .iter()
                .position(|e| *e == plugin.endpoint)
                .map(|i| instances.remove(i))
                .is_some();
            let left = instances.len();
            if left == 0 {
                drivers.remove(&plugin.name);
            }
            (removed, left)
        };
        emit(serde_json::json!({
            "call": "deregister", "name": plugin.name, "endpoint": plugin.endpoint,
            "removed": removed, "instances": instances, "last": removed && instances == 0,
        }));
        Ok(Response::new(api::DeRegisterPluginResponse {}))
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let handler = DraHandler {
        drivers: Arc::default(),
        reject_validate: args.reject_validate,
        reject_register: args.reject_register,
        rejections_left: Arc::new(Mutex::new(args.reject_register_times)),
        delay: args.delay,
    };
    let service = api::plugin_handler_server::PluginHandlerServer::new(handler);
    let shutdown = async {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    };
    if let Some(path) = args.listen.strip_prefix("unix://") {
        let _ = std::fs::remove_file(path);
        let listener = tokio::net::UnixListener::bind(path)?;
        emit(serde_json::json!({"event": "listening", "address": args.listen}));
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::UnixListenerStream::new(listener),
                shutdown,
            )
            .await?;
        let _ = std::fs::remove_file(path);
    } else if let Some(addr) = args.listen.strip_prefix("http://") {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        emit(
            serde_json::json!({"event": "listening", "address": format!("http://{}", listener.local_addr()?)}),
        );
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                shutdown,
            )
            .await?;
    } else {
        anyhow::bail!("--listen must be unix:///path.sock or http://host:port");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn highest_known_service_is_picked() {
        let v = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(
            pick_service(&v(&["v1beta1.DRAPlugin", "v1.DRAPlugin"])),
            Some("v1.DRAPlugin")
        );
        assert_eq!(
            pick_service(&v(&["v1beta1.DRAPlugin"])),
            Some("v1beta1.DRAPlugin")
        );
        assert_eq!(pick_service(&v(&["v2alpha9.DRAPlugin"])), None);
    }
}
