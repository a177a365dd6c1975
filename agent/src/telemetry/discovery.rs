//! Discovery records: the first step of every operation's trace, kept per socket path.
//!
//! ```text
//! watcher: socket found / gone ──> Discoveries::record ──> "discovery" span (started at the kernel
//!                                          │               event's timestamp when the source has one)
//! executor: register / deregister <────────┘ parent context, `source` label, attempt's root
//! reconciler: path neither desired nor registered ──> Discoveries::forget
//! ```
//!
//! The `discovery` span covers the time from the kernel event (eBPF timestamps it) or from the
//! watcher's receipt (fanotify, inotify, scans) until the watcher verified the entry by `stat`;
//! it ends at once, and the `register` or `deregister` spans of the operations it caused are its
//! children, so one trace tells the whole story of a socket instance, retries included. With
//! eBPF, a `first_contact` span runs from the socket's creation to the first connect by another
//! process (kubelet's first GetInfo, beside it), as another child.
//!
//! One entry per desired path, replaced on every discovery, and only while traces are exported:
//! the table is as bounded as the desired state, and empty otherwise (the `event_source` label
//! of a registration comes from its desired-state entry, [`Discoveries::label`]).

use super::metrics::TraceExemplar;
use crate::event_source::{SourceKind, monotonic_now_ns};
use crate::provenance::Contact;
use opentelemetry::trace::{Span as _, TraceContextExt as _, Tracer as _};
use opentelemetry::{Context, KeyValue};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

/// How the watcher learned about an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// An event from the agent's event source (a new directory walked because of an event counts).
    Event,
    /// A walk of the whole tree: start-up, a safety pass, or a rescan after event loss.
    Scan,
}

/// What the watcher saw happen to the socket path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// A socket appeared where none was desired.
    Created,
    /// A different socket instance replaced the one desired.
    Replaced,
    /// The socket left the tree.
    Removed,
}

impl Found {
    fn as_str(self) -> &'static str {
        match self {
            Found::Created => "created",
            Found::Replaced => "replaced",
            Found::Removed => "removed",
        }
    }
}

#[derive(Debug, Clone)]
struct Record {
    context: Context,
}

/// See the module docs.
pub struct Discoveries {
    source: SourceKind,
    tracer: Option<opentelemetry::global::BoxedTracer>,
    records: Mutex<HashMap<PathBuf, Record>>,
}

impl std::fmt::Debug for Discoveries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Discoveries")
            .field("source", &self.source)
            .field("traced", &self.tracer.is_some())
            .finish_non_exhaustive()
    }
}

impl Discoveries {
    /// Records for an agent fed by `source`; `traced` makes `discovery` spans (only worth it
    /// when an exporter is installed, see [`super::otlp`]).
    pub fn new(source: SourceKind, traced: bool) -> Self {
        Discoveries {
            source,
            tracer: traced.then(|| opentelemetry::global::tracer("plugin-agent")),
            records: Mutex::new(HashMap::new()),
        }
    }

    /// The `source` label for an entry found `via`: the event source's name, or `scan`.
    pub fn label(&self, via: Via) -> &'static str {
        match via {
            Via::Event => self.source.as_str(),
            Via::Scan => "scan",
        }
    }

    /// The watcher verified a change at `path`; `kernel_ns` is the kernel event's
    /// `CLOCK_MONOTONIC` timestamp when the source provides one.
    /// Without traces nothing is kept.
    pub fn record(&self, path: &Path, found: Found, via: Via, kernel_ns: Option<u64>) {
        let Some(tracer) = self.tracer.as_ref() else {
            return;
        };
        let source = self.label(via);
        let context = {
            let started = kernel_ns.map_or_else(SystemTime::now, |ns| {
                wall_time_of(ns, monotonic_now_ns(), SystemTime::now())
            });
            let mut span = tracer
                .span_builder("discovery")
                .with_start_time(started)
                .with_attributes([
                    KeyValue::new("socket_path", path.to_string_lossy().into_owned()),
                    KeyValue::new("change", found.as_str()),
                    KeyValue::new("event_source", source),
                    KeyValue::new("kernel_timestamp", kernel_ns.is_some()),
                ])
                .start(tracer);
            span.end();
            Context::new().with_remote_span_context(span.span_context().clone())
        };
        self.lock().insert(path.to_path_buf(), Record { context });
    }

    /// A `first_contact` span in the trace of the socket at `path` (a child of its discovery):
    /// from the socket's creation (`after_creation` before the contact, when an event timed it;
    /// else the contact alone) to the first connect by another process, which the span names.
    /// Returns the span as an exemplar for the first-contact histogram, when traces are on.
    pub fn first_contact(
        &self,
        path: &Path,
        contact: &Contact,
        after_creation: Option<Duration>,
    ) -> Option<TraceExemplar> {
        let tracer = self.tracer.as_ref()?;
        let parent = self.parent_of(path).unwrap_or_default();
        let contacted = contact.at;
        let started = after_creation
            .and_then(|after| contacted.checked_sub(after))
            .unwrap_or(contacted);
        let by = &contact.by;
        let mut attributes = vec![
            KeyValue::new("socket_path", path.to_string_lossy().into_owned()),
            KeyValue::new("process.pid", i64::from(by.pid)),
        ];
        if let Some(comm) = by.comm {
            attributes.push(KeyValue::new("process.executable.name", comm.as_string()));
        }
        if let Some(uid) = by.uid {
            attributes.push(KeyValue::new("process.user.id", i64::from(uid)));
        }
        let mut span = tracer
            .span_builder("first_contact")
            .with_start_time(started)
            .with_attributes(attributes)
            .start_with_context(tracer, &parent);
        span.end_with_timestamp(contacted);
        TraceExemplar::of(span.span_context())
    }

    /// The context operations at `path` are children of, when traces are on.
    pub fn parent_of(&self, path: &Path) -> Option<Context> {
        self.tracer.as_ref()?;
        self.lock().get(path).map(|r| r.context.clone())
    }

    /// `path` is neither desired nor registered: drop its record.
    pub fn forget(&self, path: &Path) {
        if self.tracer.is_none() {
            return;
        }
        let mut records = self.lock();
        records.remove(path);
        crate::memory::shrink_if_sparse(&mut records);
    }

    /// Paths with a record, for tests of boundedness.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// True when nothing is recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PathBuf, Record>> {
        // Single inserts and removes: a poisoned map is still consistent.
        self.records
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The wall-clock time of a kernel timestamp `kernel_ns` (`bpf_ktime_get_ns`: `CLOCK_MONOTONIC`,
/// which neither jumps with the wall clock nor counts suspend), given the two clocks read now
/// (`monotonic_now_ns`, `wall_now`): now minus how long ago it happened. Read just after the
/// event, the two clocks cannot drift apart by more than a clock adjustment in between. A
/// timestamp from the future (never, but it is input) is taken as now.
pub fn wall_time_of(kernel_ns: u64, monotonic_now_ns: u64, wall_now: SystemTime) -> SystemTime {
    let ago = Duration::from_nanos(monotonic_now_ns.saturating_sub(kernel_ns));
    wall_now.checked_sub(ago).unwrap_or(wall_now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_timestamps_become_the_wall_time_they_happened_at() {
        let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        // An event 1.5 ms before "now" on CLOCK_MONOTONIC (boot + 100 s).
        let now_ns = 100_000_000_000;
        let at = wall_time_of(now_ns - 1_500_000, now_ns, wall);
        assert_eq!(
            wall.duration_since(at).expect("before"),
            Duration::from_micros(1500)
        );
        assert_eq!(wall_time_of(now_ns + 5, now_ns, wall), wall, "future: now");
    }

    #[test]
    fn scans_and_events_are_labelled_apart() {
        let d = Discoveries::new(SourceKind::Fanotify, false);
        assert_eq!(d.label(Via::Scan), "scan");
        assert_eq!(d.label(Via::Event), "fanotify");
    }

    #[test]
    fn without_traces_nothing_is_kept() {
        let d = Discoveries::new(SourceKind::Fanotify, false);
        d.record(Path::new("/r/a.sock"), Found::Created, Via::Scan, None);
        d.record(Path::new("/r/b.sock"), Found::Created, Via::Event, Some(1));
        assert!(d.is_empty());
        assert!(d.parent_of(Path::new("/r/b.sock")).is_none());
    }

    #[test]
    fn traced_records_give_parents_and_are_forgotten() {
        let d = Discoveries::new(SourceKind::Fanotify, true);
        d.record(Path::new("/r/a.sock"), Found::Created, Via::Scan, None);
        d.record(Path::new("/r/b.sock"), Found::Created, Via::Event, None);
        assert_eq!(d.len(), 2);
        assert!(d.parent_of(Path::new("/r/b.sock")).is_some());
        d.forget(Path::new("/r/a.sock"));
        d.forget(Path::new("/r/b.sock"));
        assert!(d.is_empty());
    }
}
