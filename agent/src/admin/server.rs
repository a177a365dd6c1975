//! The admin API server: a read-mostly view of the agent's state, its event stream, and handler
//! changes. Runs beside the data flow and never blocks it (state is read from the caches; events
//! come from the broadcast bus).

use super::MAX_MESSAGE_BYTES;
pub use super::convert::{event_to_api, provenance_to_api, to_api};
use super::convert::{
    phases_to_api, restore_to_api, serving_to_api, source_start_to_api, to_api_entry, unix_ms,
};
pub use super::served::{AgentStatus, PolicyReloading, Served, StartPhases, StartReport};
use crate::handler::{self, HandlerRegistry};
use crate::liveness::Liveness;
use crate::notifications::NotificationBus;
use crate::state::view::{PluginStatus, StateView};
use crate::telemetry::WatcherStats;
use anyhow::Context;
use plugin_agent_proto::pluginagent::v1 as api;
use std::path::Path;
use std::pin::Pin;

/// A `list` page when the client names no size, and the most it may ask for (entries are a few
/// hundred bytes each: a page stays far below the 16 MiB message limit).
const DEFAULT_PAGE: usize = 1_000;
const MAX_PAGE: usize = 5_000;
use std::sync::Arc;
use tokio_stream::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::transport::server::UdsConnectInfo;
use tonic::{Request, Response, Status};

/// The service; cheap to clone.
#[derive(Clone)]
pub struct AdminService {
    state: StateView,
    handlers: Arc<HandlerRegistry>,
    notifications: NotificationBus,
    stats: Arc<WatcherStats>,
    status: AgentStatus,
    allowed_uid: u32,
    /// Observe mode uses no handler: adding one is refused rather than silently ignored.
    observes: bool,
    /// Reads the policy again (`ReloadPolicy`).
    policy: Arc<dyn PolicyReloading>,
    /// Who serves each registered plugin (`list`).
    liveness: Arc<Liveness>,
    /// Ends the event streams when the server stops: a graceful shutdown waits for every open
    /// response, and a `watch` stream would otherwise never end.
    shutdown: CancellationToken,
}

impl AdminService {
    /// A view of what `served` holds. Callers other than root and the agent's own user are
    /// refused.
    pub fn new(served: Served) -> Self {
        AdminService {
            state: served.state,
            handlers: served.handlers,
            notifications: served.notifications,
            stats: served.stats,
            status: served.status,
            allowed_uid: nix::unistd::geteuid().as_raw(),
            observes: served.observes,
            policy: served.policy,
            liveness: served.liveness,
            shutdown: CancellationToken::new(),
        }
    }

    fn authorize<T>(&self, request: &Request<T>) -> Result<(), Status> {
        let uid = request
            .extensions()
            .get::<UdsConnectInfo>()
            .and_then(|info| info.peer_cred)
            .map(|cred| cred.uid());
        match uid {
            Some(0) => Ok(()),
            Some(uid) if uid == self.allowed_uid => Ok(()),
            Some(uid) => Err(Status::permission_denied(format!(
                "uid {uid} may not use the plugin-agent admin API (root or uid {} only)",
                self.allowed_uid
            ))),
            None => Err(Status::permission_denied("caller credentials unknown")),
        }
    }

    /// The first `limit` known sockets (desired and registered) whose paths sort after `after`,
    /// in path order, and the path to continue after when more follow.
    pub fn list(
        &self,
        after: Option<&Path>,
        limit: usize,
    ) -> (Vec<api::PluginEntry>, Option<std::path::PathBuf>) {
        let now = tokio::time::Instant::now();
        let (page, more) = self.state.page(after, limit, now);
        let next = page.last().filter(|_| more).map(|last| last.path.clone());
        let entries = page
            .iter()
            .map(|status| {
                let mut entry = to_api_entry(status);
                if entry.first_contact.is_none() {
                    entry.first_contact_unknown = self.first_contact_unknown(status);
                }
                entry.serving = status
                    .registered
                    .as_ref()
                    .and_then(|r| self.liveness.serving(&status.path, r.generation))
                    .map(|serving| serving_to_api(&serving));
                entry
            })
            .collect();
        (entries, next)
    }

    /// Why `list` shows no first contact for a socket.
    fn first_contact_unknown(&self, status: &PluginStatus) -> String {
        match &status.desired {
            _ if !self.status.sees_contacts => format!(
                "the {} source does not see connections (eBPF only)",
                self.status.source
            ),
            None => "the socket is gone".into(),
            Some(desired) if desired.by_event => {
                "no process other than the agent has connected yet".into()
            }
            Some(_) => "no process other than the agent has connected since it started (the socket is older)".into(),
        }
    }

    /// The status report.
    pub fn status(&self) -> api::AgentStatus {
        use std::sync::atomic::Ordering::Relaxed;
        api::AgentStatus {
            version: env!("CARGO_PKG_VERSION").to_string(),
            source: self.status.source.clone(),
            source_description: self.status.source_description.clone(),
            loss_rescans: self.stats.loss_rescans.load(Relaxed),
            rescans: self.stats.rescans.load(Relaxed),
            plugins_desired: self.state.desired.len() as u64,
            plugins_registered: self.state.actual.len() as u64,
            handlers: self
                .handlers
                .list()
                .into_iter()
                .map(|(plugin_type, h)| api::HandlerStatus {
                    plugin_type,
                    target: h.describe(),
                    healthy: h.health().map(|rx| *rx.borrow()).unwrap_or(true),
                    last_error: h.last_error().unwrap_or_default(),
                })
                .collect(),
            started_unix_ms: unix_ms(self.status.started_at),
            plugin_dir: self.status.plugin_dir.clone(),
            reconcile_mode: self.status.reconcile_mode.clone(),
            mode: self.status.mode.clone(),
            kernel: format!(
                "{} ({})",
                self.status.kernel.release, self.status.kernel.machine
            ),
            kernel_features: self
                .status
                .kernel
                .features
                .iter()
                .map(|f| api::KernelFeature {
                    feature: f.name.into(),
                    available: f.availability.as_str().into(),
                    since: f.since.into(),
                    detail: f.detail.clone(),
                    without: f.without.into(),
                })
                .collect(),
            watched_directories: self.stats.watched_dirs.load(Relaxed),
            walks_completed: self
                .stats
                .walks_completed
                .load(std::sync::atomic::Ordering::Acquire),
            metrics_address: self
                .status
                .metrics_addr
                .map(|addr| addr.to_string())
                .unwrap_or_default(),
            source_start: Some(source_start_to_api(&self.status.start.source)),
            restore: self.status.start.restore.as_ref().map(restore_to_api),
            start_phases: self.status.start.phases.get().map(phases_to_api),
            problems: {
                let problems = self.stats.health.get();
                problems
                    .root
                    .into_iter()
                    .chain(problems.lines)
                    .chain(problems.conditions)
                    .collect()
            },
        }
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<api::AgentEvent, Status>> + Send>>;

#[tonic::async_trait]
impl api::agent_server::Agent for AdminService {
    async fn list_plugins(
        &self,
        request: Request<api::ListPluginsRequest>,
    ) -> Result<Response<api::ListPluginsResponse>, Status> {
        self.authorize(&request)?;
        use std::os::unix::ffi::{OsStrExt, OsStringExt};
        let request = request.into_inner();
        let limit = match request.page_size {
            0 => DEFAULT_PAGE,
            size => (size as usize).min(MAX_PAGE),
        };
        // The token is the last path of the previous page, as bytes (paths need not be UTF-8).
        let after = (!request.page_token.is_empty())
            .then(|| Path::new(std::ffi::OsStr::from_bytes(&request.page_token)));
        let (plugins, next) = self.list(after, limit);
        let next_page_token = next
            .map(|path| path.into_os_string().into_vec())
            .unwrap_or_default();
        Ok(Response::new(api::ListPluginsResponse {
            plugins,
            next_page_token,
        }))
    }

    type WatchEventsStream = EventStream;

    async fn watch_events(
        &self,
        request: Request<api::WatchEventsRequest>,
    ) -> Result<Response<EventStream>, Status> {
        self.authorize(&request)?;
        let stream =
            super::event_feed::until_stopped(self.notifications.subscribe(), self.shutdown.clone())
                .map(|fed| Ok(super::event_feed::to_wire(fed)));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn explain(
        &self,
        request: Request<api::ExplainRequest>,
    ) -> Result<Response<api::ExplainResponse>, Status> {
        self.authorize(&request)?;
        let target = request.into_inner().target;
        if target.is_empty() || target.len() > 4096 {
            return Err(Status::invalid_argument(
                "target must be a socket path, a plugin name or a socket's file name (1 to 4096 bytes)",
            ));
        }
        let plugin_dir = std::path::PathBuf::from(&self.status.plugin_dir);
        let answer = super::explain::explain(&self.state, &plugin_dir, &target).await;
        Ok(Response::new(answer))
    }

    async fn get_status(
        &self,
        request: Request<api::GetStatusRequest>,
    ) -> Result<Response<api::AgentStatus>, Status> {
        self.authorize(&request)?;
        Ok(Response::new(self.status()))
    }

    async fn add_handler(
        &self,
        request: Request<api::AddHandlerRequest>,
    ) -> Result<Response<api::AddHandlerResponse>, Status> {
        self.authorize(&request)?;
        let request = request.into_inner();
        validate_type(&request.plugin_type)?;
        if self.observes {
            return Err(Status::failed_precondition(
                "the agent observes (--mode observe): it never calls handlers; run it with --mode register on a directory it owns",
            ));
        }
        let handler = handler::from_target(&request.target).map_err(Status::invalid_argument)?;
        tracing::info!(plugin_type = %request.plugin_type, handler = %request.target, "handler added through the admin API");
        self.handlers.insert(&request.plugin_type, handler);
        Ok(Response::new(api::AddHandlerResponse {}))
    }

    async fn remove_handler(
        &self,
        request: Request<api::RemoveHandlerRequest>,
    ) -> Result<Response<api::RemoveHandlerResponse>, Status> {
        self.authorize(&request)?;
        let request = request.into_inner();
        validate_type(&request.plugin_type)?;
        let removed = self.handlers.remove(&request.plugin_type);
        tracing::info!(plugin_type = %request.plugin_type, removed, "handler removed through the admin API");
        Ok(Response::new(api::RemoveHandlerResponse { removed }))
    }

    async fn reload_policy(
        &self,
        request: Request<api::ReloadPolicyRequest>,
    ) -> Result<Response<api::ReloadPolicyResponse>, Status> {
        self.authorize(&request)?;
        let reloader = self.policy.clone();
        // Reads a file and looks at every registered plugin: off the runtime's workers.
        let reloaded = tokio::task::spawn_blocking(move || reloader.reload())
            .await
            .map_err(|e| Status::internal(format!("policy reload did not finish: {e}")))?;
        let reload = reloaded.map_err(|e| Status::invalid_argument(format!("{e:#}")))?;
        let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        Ok(Response::new(api::ReloadPolicyResponse {
            rules: count(reload.rules),
            refused: count(reload.refused),
            retried: count(reload.retried),
        }))
    }
}

fn validate_type(plugin_type: &str) -> Result<(), Status> {
    if plugin_type.is_empty() || plugin_type.len() > crate::registration::limits::NAME_BYTES {
        return Err(Status::invalid_argument(
            "plugin_type must be 1 to 256 bytes",
        ));
    }
    Ok(())
}

/// How long open admin calls get to end gracefully at shutdown before their connections are cut.
const CLOSE_GRACE: std::time::Duration = std::time::Duration::from_millis(300);

/// The admin API's socket, bound and not yet served.
pub struct AdminListener {
    listener: tokio::net::UnixListener,
    socket: std::path::PathBuf,
}

/// Binds the admin socket. Called before the agent starts, so that by the time it reports its
/// first scan a client's connection waits in the backlog instead of being refused (or reaching
/// a previous agent's stale socket file). The socket's directory is created 0700 and the socket
/// chmod 0600; a stale socket file from a previous run is replaced.
pub fn bind(socket: &Path) -> anyhow::Result<AdminListener> {
    use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
    if let Some(dir) = socket.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("cannot create admin socket directory {}", dir.display()))?;
    }
    match std::fs::symlink_metadata(socket) {
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(socket)
            .with_context(|| format!("cannot replace stale admin socket {}", socket.display()))?,
        Ok(_) => anyhow::bail!(
            "{} exists and is not a socket; refusing to replace it",
            socket.display()
        ),
        Err(_) => {}
    }
    let listener = tokio::net::UnixListener::bind(socket)
        .with_context(|| format!("cannot bind admin socket {}", socket.display()))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("cannot chmod admin socket {}", socket.display()))?;
    Ok(AdminListener {
        listener,
        socket: socket.to_path_buf(),
    })
}

/// Serves the admin API on a bound socket until `cancel` fires, then removes the socket file.
pub async fn serve(
    bound: AdminListener,
    service: AdminService,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let AdminListener { listener, socket } = bound;
    tracing::info!(admin_socket = %socket.display(), "admin API listening");
    let service = AdminService {
        shutdown: cancel.clone(),
        ..service
    };
    let server = api::agent_server::AgentServer::new(service)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(16 * 1024 * 1024);
    // Bounded connections (see `serving`): a client that connects and goes quiet, sends only the
    // HTTP/2 preface, or stops reading its `watch` stream cannot hold the agent open at shutdown
    // or take the descriptors plugin dials need.
    // At shutdown tonic first ends every call gracefully (a `watch` stream ends with its status,
    // so `plugin-agent watch` exits 0); what is still open CLOSE_GRACE later is cut.
    let cut = CancellationToken::new();
    let gate = crate::serving::Gate::new("admin", crate::serving::ADMIN, cut.clone());
    let cutter = {
        let (cut, cancel) = (cut.clone(), cancel.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = cut.cancelled() => {}
                _ = async {
                    cancel.cancelled().await;
                    tokio::time::sleep(CLOSE_GRACE).await;
                } => cut.cancel(),
            }
        })
    };
    let incoming = futures::stream::unfold((listener, gate), |(listener, gate)| async move {
        // Peers told apart by process, so a flood from one cannot close another's `watch`.
        let stream = gate
            .admit(
                || async { listener.accept().await.map(|(s, _)| s) },
                |stream: &tokio::net::UnixStream| {
                    stream
                        .peer_cred()
                        .ok()
                        .and_then(|cred| cred.pid())
                        .map_or(0, |pid| u64::from(pid.unsigned_abs()))
                },
            )
            .await?;
        Some((Ok::<_, std::io::Error>(stream), (listener, gate)))
    });
    let result = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(crate::serving::ADMIN_KEEPALIVE))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(10)))
        .add_service(server)
        .serve_with_incoming_shutdown(incoming, cancel.cancelled_owned())
        .await;
    cut.cancel();
    let _ = cutter.await;
    let _ = std::fs::remove_file(&socket);
    result.context("admin API server failed")
}
