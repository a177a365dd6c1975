//! Event sources: the kernel-fed hints that start the data flow.
//!
//! ```text
//! kernel --(ebpf | fanotify | inotify)--> FsEvent --> watcher (verifies by stat) --> desired state
//! ```
//!
//! Every source reports the same [`FsEvent`]s into one channel. Events are *hints*: the watcher
//! stats every path it is told about, so a source may over-report (a name that turns out not to be a
//! socket, a create and delete merged into one event) but must never under-report silently. When a
//! source knows it lost events (inotify/fanotify queue overflow, a BPF ring-buffer reservation that
//! failed, its reader restarted) it sends [`FsEvent::Rescan`], and the watcher walks the whole tree.
//!
//! Delivery has back-pressure: a source awaits room in the channel, so a slow watcher makes the
//! kernel-side queue fill up, where loss is detected and turned into a rescan, instead of growing an
//! unbounded buffer in the agent.

mod event;

pub use self::event::{
    Entry, EventSource, FsEvent, Observed, ProblemReport, RescanReason, SourceKind, SourceStart,
    SourceStats, WatchedDir, monotonic_now_ns,
};

pub mod ebpf;
pub mod fanotify;
pub mod inotify;

/// `--source`: one source, or the best this kernel allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceChoice {
    /// Try [`SourceKind::PREFERENCE`] in order and take the first that opens.
    Auto,
    /// Exactly this one, or fail.
    Only(SourceKind),
}

impl std::str::FromStr for SourceChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(SourceChoice::Auto),
            other => <SourceKind as clap::ValueEnum>::from_str(other, true)
                .map(SourceChoice::Only)
                .map_err(|_| {
                    format!(
                        "unknown event source {other:?}: expected auto, ebpf, fanotify or inotify"
                    )
                }),
        }
    }
}

/// Settings every source may need.
#[derive(Debug, Clone, Default)]
pub struct SourceOptions {
    /// eBPF: ring buffer size in bytes (a power of two; 0 means the default).
    pub ring_buffer_bytes: usize,
    /// eBPF: pin the programs and maps in bpffs as this instance's for this tree, so its next
    /// agent adopts them (see `ebpf::pins`); none: they go with the agent.
    pub ebpf_pins: Option<ebpf::PinOwner>,
}

/// An open source, and the ones [`SourceChoice::Auto`] passed over before it, each with the
/// refusal that made it pass (`status` shows them: the answer to "why not eBPF?").
pub struct Opened {
    pub source: std::sync::Arc<dyn EventSource>,
    pub passed_over: Vec<String>,
    /// How it started, and what its open took.
    pub start: SourceStart,
}

/// Opens the chosen source. With [`SourceChoice::Auto`], each refusal is logged with its reason
/// and the next source is tried, so an operator can see why eBPF was not used.
pub async fn open(
    choice: SourceChoice,
    sink: tokio::sync::mpsc::Sender<FsEvent>,
    cancel: tokio_util::sync::CancellationToken,
    options: &SourceOptions,
) -> anyhow::Result<Opened> {
    let kinds: &[SourceKind] = match &choice {
        SourceChoice::Auto => &SourceKind::PREFERENCE,
        SourceChoice::Only(kind) => std::slice::from_ref(kind),
    };
    let mut refusals = Vec::new();
    for &kind in kinds {
        let opening = std::time::Instant::now();
        match open_kind(kind, sink.clone(), cancel.clone(), options) {
            Ok(source) => {
                if choice == SourceChoice::Auto {
                    tracing::info!(source = %kind, passed_over = ?refusals, "event source chosen automatically");
                }
                let start = SourceStart {
                    open: opening.elapsed(),
                    ..source.start()
                };
                return Ok(Opened {
                    source,
                    passed_over: refusals,
                    start,
                });
            }
            Err(error) => {
                if choice == SourceChoice::Auto {
                    tracing::warn!(source = %kind, error = format!("{error:#}"), "event source unavailable; trying the next");
                }
                refusals.push(format!("{kind}: {error:#}"));
            }
        }
    }
    anyhow::bail!("no event source could be opened: {}", refusals.join("; "))
}

fn open_kind(
    kind: SourceKind,
    sink: tokio::sync::mpsc::Sender<FsEvent>,
    cancel: tokio_util::sync::CancellationToken,
    options: &SourceOptions,
) -> anyhow::Result<std::sync::Arc<dyn EventSource>> {
    Ok(match kind {
        SourceKind::Ebpf => {
            let mut ebpf_options = ebpf::EbpfOptions::default();
            if options.ring_buffer_bytes != 0 {
                ebpf_options.ring_buffer_bytes =
                    u32::try_from(options.ring_buffer_bytes).map_err(|_| {
                        anyhow::anyhow!(
                            "eBPF ring buffer size {} is too large",
                            options.ring_buffer_bytes
                        )
                    })?;
            }
            ebpf_options.pins = options.ebpf_pins.clone();
            std::sync::Arc::new(ebpf::open(sink, cancel, ebpf_options)?)
        }
        SourceKind::Fanotify => std::sync::Arc::new(fanotify::open(sink, cancel)?),
        SourceKind::Inotify => std::sync::Arc::new(inotify::open(sink, cancel)?),
    })
}
