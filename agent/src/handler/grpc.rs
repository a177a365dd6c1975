//! Handlers over gRPC: the agent calls `pluginagent.v1.PluginHandler` on a handler process, over
//! a Unix socket (`unix:///path.sock`) or TCP (`http://127.0.0.1:PORT`).
//!
//! The channel connects lazily and reconnects on each call after a failure, so a handler that
//! restarts needs nothing from the operator. While it is unreachable, calls fail as
//! *unavailable* (the plugin waits rather than backing off), and a probe connects to it on a
//! short schedule (50 ms doubling to 2 s, only while it is down); when the probe succeeds the
//! handler reports healthy and the registry retries the plugins that were waiting for it.

use super::contract::{HandlerError, Plugin, PluginHandler};
use api::plugin_handler_client::PluginHandlerClient;
use plugin_agent_proto::pluginagent::v1 as api;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tonic::transport::{Channel, Endpoint};

/// Largest answer accepted from a handler (answers are empty messages).
const MAX_MESSAGE_BYTES: usize = 64 * 1024;

/// Where a remote handler listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    /// A Unix socket path.
    Unix(PathBuf),
    /// An `http://host:port` URI.
    Http(String),
}

impl Address {
    /// Parses `unix:///path.sock` or `http://host:port`.
    pub fn parse(target: &str) -> Result<Address, String> {
        if let Some(path) = target.strip_prefix("unix://") {
            if !path.starts_with('/') {
                return Err(format!(
                    "{target:?}: a unix:// target needs an absolute path (unix:///run/x.sock)"
                ));
            }
            return Ok(Address::Unix(PathBuf::from(path)));
        }
        if target.starts_with("http://") {
            Endpoint::from_shared(target.to_string()).map_err(|e| format!("{target:?}: {e}"))?;
            return Ok(Address::Http(target.to_string()));
        }
        Err(format!(
            "{target:?}: expected unix:///path.sock or http://host:port"
        ))
    }
}

/// See the module docs.
pub struct GrpcHandler {
    target: String,
    address: Address,
    client: PluginHandlerClient<Channel>,
    healthy: watch::Sender<bool>,
    probing: Arc<AtomicBool>,
    last_error: Mutex<Option<String>>,
}

impl GrpcHandler {
    /// A handler at `target` (`unix:///path.sock` or `http://host:port`). Does not connect yet.
    pub fn new(target: &str) -> Result<GrpcHandler, String> {
        let address = Address::parse(target)?;
        let channel = match &address {
            Address::Unix(path) => crate::unix_channel::lazy(path.clone()),
            Address::Http(uri) => Endpoint::from_shared(uri.clone())
                .map_err(|e| format!("{target:?}: {e}"))?
                .connect_timeout(Duration::from_secs(5))
                .connect_lazy(),
        };
        let client = PluginHandlerClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        Ok(GrpcHandler {
            target: target.to_string(),
            address,
            client,
            healthy: watch::channel(true).0,
            probing: Arc::new(AtomicBool::new(false)),
            last_error: Mutex::new(None),
        })
    }

    fn outcome<T>(
        &self,
        result: Result<tonic::Response<T>, tonic::Status>,
    ) -> Result<(), HandlerError> {
        match result {
            Ok(_) => {
                self.healthy
                    .send_if_modified(|healthy| !std::mem::replace(healthy, true));
                Ok(())
            }
            Err(status) if is_unreachable(&status) => {
                let message = format!("handler {} unavailable: {}", self.target, status.message());
                self.set_last_error(&message);
                self.went_down();
                Err(HandlerError::unavailable(message))
            }
            Err(status) => {
                let message = status.message().to_string();
                self.set_last_error(&message);
                Err(HandlerError::rejected(if message.is_empty() {
                    format!("{:?}", status.code())
                } else {
                    message
                }))
            }
        }
    }

    fn set_last_error(&self, message: &str) {
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(message.to_string());
    }

    /// Marks the handler down and starts the reachability probe (once).
    fn went_down(&self) {
        self.healthy
            .send_if_modified(|healthy| std::mem::replace(healthy, false));
        if self.probing.swap(true, Ordering::AcqRel) {
            return;
        }
        let address = self.address.clone();
        let healthy = self.healthy.clone();
        let probing = self.probing.clone();
        tokio::spawn(async move {
            let mut pause = Duration::from_millis(50);
            loop {
                if healthy.is_closed() {
                    break;
                }
                if reachable(&address).await {
                    healthy.send_replace(true);
                    break;
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            probing.store(false, Ordering::Release);
        });
    }
}

/// Transport-level failures: the handler is not there (as opposed to refusing the plugin).
fn is_unreachable(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::Unavailable
}

async fn reachable(address: &Address) -> bool {
    let connect = async {
        match address {
            Address::Unix(path) => tokio::net::UnixStream::connect(path).await.is_ok(),
            Address::Http(uri) => {
                let authority = uri
                    .trim_start_matches("http://")
                    .split('/')
                    .next()
                    .unwrap_or_default()
                    .to_string();
                tokio::net::TcpStream::connect(authority).await.is_ok()
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(1), connect)
        .await
        .unwrap_or(false)
}

fn to_api(plugin: &Plugin) -> Option<api::Plugin> {
    Some(api::Plugin {
        r#type: plugin.plugin_type.clone(),
        name: plugin.name.clone(),
        endpoint: plugin.endpoint.clone(),
        supported_versions: plugin.supported_versions.clone(),
        socket_path: plugin.socket_path.clone(),
    })
}

#[async_trait::async_trait]
impl PluginHandler for GrpcHandler {
    async fn validate(&self, plugin: &Plugin) -> Result<(), HandlerError> {
        let result = self
            .client
            .clone()
            .validate_plugin(api::ValidatePluginRequest {
                plugin: to_api(plugin),
            })
            .await;
        self.outcome(result)
    }

    async fn register(&self, plugin: &Plugin) -> Result<(), HandlerError> {
        let result = self
            .client
            .clone()
            .register_plugin(api::RegisterPluginRequest {
                plugin: to_api(plugin),
            })
            .await;
        self.outcome(result)
    }

    async fn deregister(&self, plugin: &Plugin) -> Result<(), HandlerError> {
        let result = self
            .client
            .clone()
            .de_register_plugin(api::DeRegisterPluginRequest {
                plugin: to_api(plugin),
            })
            .await;
        self.outcome(result)
    }

    fn describe(&self) -> String {
        self.target.clone()
    }

    fn health(&self) -> Option<watch::Receiver<bool>> {
        Some(self.healthy.subscribe())
    }

    fn last_error(&self) -> Option<String> {
        self.last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_unix_and_http_and_reject_others() {
        assert_eq!(
            Address::parse("unix:///run/h.sock"),
            Ok(Address::Unix("/run/h.sock".into()))
        );
        assert_eq!(
            Address::parse("http://127.0.0.1:7000"),
            Ok(Address::Http("http://127.0.0.1:7000".into()))
        );
        assert!(Address::parse("unix://relative.sock").is_err());
        assert!(Address::parse("tcp://1.2.3.4:5").is_err());
        assert!(Address::parse("/run/h.sock").is_err());
    }
}
