//! The floor: the least CPU a registration can cost, measured against the same plugins as the
//! agent (issue 49). `loadgen run --floor` starts this in place of an agent (`loadgen floor`, a
//! process of its own, so `/proc/<pid>` measures it as it measures the agent).
//!
//! It does only what a registration must: connect to the plugin's socket, `GetInfo`,
//! `NotifyRegistrationStatus(true)`, over the h2 crate the agent's registration client speaks
//! gRPC with (one connection per plugin, polled by the registering task, nothing spawned for
//! it), under a tokio multi-thread runtime as the agent's. It learns of each plugin the cheapest
//! way: the coordinator tells it on stdin once the plugin listens (no discovery, no `stat`, no
//! retry of a socket not listening yet), and a deregistration is nothing but being told. It
//! keeps no state beyond the set of plugins it registered, writes no journal, calls no handler,
//! records no metric, no span, no log.
//!
//! Protocol, one line each way per message:
//! - coordinator -> floor (stdin): `+ <id>` (plugin `id` listens: register it), `- <id>` (it is
//!   gone); end of input ends the floor;
//! - floor -> coordinator (stdout): `R <id> <ns>` (registered: Notify(true) answered),
//!   `D <id> <ns>` (deregistered), `E <id> <error>`; wall-clock ns, as the workers' reports.

use crate::ledger::SharedLedger;
use crate::plugins::{now_ns, socket_name};
use anyhow::Context;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use plugin_agent_proto::pluginregistration::{InfoRequest, PluginInfo, RegistrationStatus};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::UnixStream;
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::{Semaphore, mpsc};

/// As many registrations at once as the agent's default concurrency (256 operations).
const CONCURRENCY: usize = 256;

const GET_INFO: &str = "/pluginregistration.Registration/GetInfo";
const NOTIFY: &str = "/pluginregistration.Registration/NotifyRegistrationStatus";

/// Runs the floor (`loadgen floor`): obeys stdin, reports on stdout, until stdin closes.
pub async fn serve(dir: PathBuf) -> anyhow::Result<()> {
    let (tx, mut rx) = mpsc::unbounded_channel::<String>();
    let writer = tokio::spawn(async move {
        let mut out = BufWriter::new(tokio::io::stdout());
        while let Some(line) = rx.recv().await {
            if out.write_all(line.as_bytes()).await.is_err() {
                return;
            }
            // Batch while lines queue up; flush as soon as none is waiting.
            if rx.is_empty() && out.flush().await.is_err() {
                return;
            }
        }
        let _ = out.flush().await;
    });
    let slots = Arc::new(Semaphore::new(CONCURRENCY));
    let registered = Arc::new(std::sync::Mutex::new(HashSet::<u64>::new()));
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        let (sign, id) = line
            .split_once(' ')
            .context("floor: a command is `+ id` or `- id`")?;
        let id: u64 = id.trim().parse().context("floor: plugin id")?;
        let tx = tx.clone();
        match sign {
            "+" => {
                let path = dir.join(socket_name(id));
                let slots = slots.clone();
                let registered = registered.clone();
                tokio::spawn(async move {
                    let Ok(slot) = slots.acquire_owned().await else {
                        return;
                    };
                    let line = match register(&path).await {
                        Ok(()) => {
                            registered
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .insert(id);
                            format!("R {id} {}\n", now_ns())
                        }
                        Err(e) => format!("E {id} {}\n", format!("{e:#}").replace('\n', " ")),
                    };
                    drop(slot);
                    let _ = tx.send(line);
                });
            }
            "-" => {
                if registered
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&id)
                {
                    let _ = tx.send(format!("D {id} {}\n", now_ns()));
                }
            }
            _ => anyhow::bail!("floor: cannot parse command {line:?}"),
        }
    }
    drop(tx);
    let _ = writer.await;
    Ok(())
}

/// One registration: connect, `GetInfo`, `NotifyRegistrationStatus(true)`, close.
async fn register(path: &Path) -> anyhow::Result<()> {
    let stream = UnixStream::connect(path)
        .await
        .with_context(|| format!("connecting to {}", path.display()))?;
    // The agent's settings (registration/unary.rs): a stream window for one 64 KiB answer.
    let (send, connection) = h2::client::Builder::new()
        .initial_window_size(64 * 1024 + 5)
        .max_header_list_size(16 * 1024)
        .handshake(stream)
        .await?;
    let calls = async move {
        let _: PluginInfo = call(send.clone(), GET_INFO, &InfoRequest {}).await?;
        let status = RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        };
        let _: plugin_agent_proto::pluginregistration::RegistrationStatusResponse =
            call(send, NOTIFY, &status).await?;
        anyhow::Ok(())
    };
    let mut calls = std::pin::pin!(calls);
    // The connection is polled by this task while the calls run (as the agent's client does).
    tokio::select! {
        biased;
        done = &mut calls => done,
        ended = connection => {
            ended?;
            calls.await
        }
    }
}

/// One unary gRPC call on `send`'s connection.
async fn call<Q: prost::Message, A: prost::Message + Default>(
    send: h2::client::SendRequest<Bytes>,
    path: &'static str,
    request: &Q,
) -> anyhow::Result<A> {
    let head = http::Request::post(format!("http://plugin.invalid{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())?;
    let mut send = send.ready().await?;
    let (response, mut stream) = send.send_request(head, false)?;
    let mut body = BytesMut::with_capacity(5 + request.encoded_len());
    body.put_u8(0);
    body.put_u32(u32::try_from(request.encoded_len())?);
    request.encode(&mut body)?;
    stream.send_data(body.freeze(), true)?;
    let (head, mut body) = response.await?.into_parts();
    anyhow::ensure!(head.status == http::StatusCode::OK, "HTTP {}", head.status);
    let mut received = BytesMut::new();
    while let Some(data) = body.data().await {
        let data = data?;
        let _ = body.flow_control().release_capacity(data.len());
        received.extend_from_slice(&data);
    }
    let trailers = body.trailers().await?.unwrap_or_default();
    let status = trailers
        .get("grpc-status")
        .or(head.headers.get("grpc-status"));
    anyhow::ensure!(
        status.is_some_and(|s| s.as_bytes() == b"0"),
        "{path}: grpc-status {status:?}"
    );
    let mut message = received.freeze();
    anyhow::ensure!(message.len() >= 5, "{path}: no message in the answer");
    message.advance(5);
    Ok(A::decode(message)?)
}

/// The coordinator's handle on the floor process: what it is told, and its reports into the
/// ledger (as the agent's admin events are: `registered`, `deregistered`).
pub struct FloorUnderTest {
    child: Child,
    ledger: SharedLedger,
    /// Writes what the ledger tells the floor; ends (closing the floor's input) once the ledger
    /// stops telling it.
    forward: tokio::task::JoinHandle<()>,
}

impl FloorUnderTest {
    /// Starts `loadgen floor` for the plugins in `dir`; the ledger tells it of every plugin that
    /// listens or goes, and its reports go into the ledger.
    pub fn start(dir: &Path, ledger: &SharedLedger) -> anyhow::Result<FloorUnderTest> {
        let exe = std::env::current_exe().context("locating the loadgen binary")?;
        let mut child = Command::new(&exe)
            .arg("floor")
            .arg("--plugin-dir")
            .arg(dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("spawning the floor")?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            anyhow::bail!("floor pipes missing");
        };
        let (tell, told) = mpsc::unbounded_channel();
        ledger.tell_floor(Some(tell));
        let forward = tokio::spawn(forward(told, BufWriter::new(stdin)));
        let reports = ledger.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let mut words = line.splitn(3, ' ');
                let (tag, id) = (words.next(), words.next().and_then(|w| w.parse().ok()));
                let at = words.next().and_then(|w| w.parse().ok());
                match (tag, id, at) {
                    (Some("R"), Some(id), Some(at)) => reports.admin_registered(id, at),
                    (Some("D"), Some(id), Some(at)) => reports.admin_deregistered(id, at),
                    _ => eprintln!("loadgen: floor: {line}"),
                }
            }
        });
        Ok(FloorUnderTest {
            child,
            ledger: ledger.clone(),
            forward,
        })
    }

    /// The floor's process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Closes its input and waits for it to end.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.ledger.tell_floor(None);
        let _ = self.forward.await;
        self.child.wait().await?;
        Ok(())
    }
}

/// Writes what the ledger tells the floor to its stdin, flushing once nothing more is queued.
async fn forward(mut told: mpsc::UnboundedReceiver<String>, mut stdin: BufWriter<ChildStdin>) {
    while let Some(line) = told.recv().await {
        if stdin.write_all(line.as_bytes()).await.is_err() {
            return;
        }
        if told.is_empty() && stdin.flush().await.is_err() {
            return;
        }
    }
}
