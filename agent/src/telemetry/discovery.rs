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
//! A discovery the head sampler picks is exported at once (written straight into the exporter's
//! queue, `otlp::SpanRecord`); one it does not pick is not: its record keeps the IDs, times and
//! attributes its spans would have ([`UnbuiltRoot`]), exported only if an operation under it is
//! kept by the tail rule (failed or slow). A burst of fast registrations with one trace in ten
//! sampled exports a tenth of the discovery spans.
//!
//! One entry per desired path, replaced on every discovery, and only while traces are exported:
//! the table is as bounded as the desired state, and empty otherwise (the `event_source` label
//! of a registration comes from its desired-state entry, [`Discoveries::label`]).

use super::metrics::TraceExemplar;
use super::otlp::SpanRecord;
use super::sampling::{self, Root, UnbuiltRoot};
use crate::event_source::{SourceKind, monotonic_now_ns};
use crate::provenance::Contact;
use opentelemetry::global::BoxedTracer;
use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceState, Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::ShouldSample;
use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
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

/// A discovery the head sampler did not pick: its spans, not built (see the module docs).
#[derive(Debug)]
struct Unbuilt {
    ids: SpanContext,
    path: Arc<OsStr>,
    found: Found,
    source: &'static str,
    kernel_timestamp: bool,
    started: SystemTime,
    ended: SystemTime,
    /// The socket's `first_contact` when it came before the root was built (see
    /// [`Discoveries::first_contact`]).
    first_contact: Mutex<Option<(SpanId, Contact, SystemTime)>>,
    built: AtomicBool,
}

impl UnbuiltRoot for Unbuilt {
    fn span_context(&self) -> &SpanContext {
        &self.ids
    }

    fn build(&self) {
        if self.built.swap(true, Ordering::AcqRel) {
            return;
        }
        export_discovery(
            &self.ids,
            Path::new(&self.path),
            self.found,
            self.source,
            self.kernel_timestamp,
            self.started,
            self.ended,
        );
        let contact = self
            .first_contact
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some((id, contact, started)) = contact {
            export_first_contact(&self.ids, id, Path::new(&self.path), &contact, started);
        }
    }
}

#[derive(Debug, Clone)]
enum Record {
    Built(SpanContext),
    Unbuilt(Arc<Unbuilt>),
}

/// The tracer, and the head sampler that decides which discoveries it builds as they happen.
struct Tracing {
    tracer: BoxedTracer,
    head: Box<dyn ShouldSample>,
}

/// See the module docs.
pub struct Discoveries {
    source: SourceKind,
    tracing: Option<Tracing>,
    /// Keyed by the path's bytes: `Path`'s own hash walks it component by component, which
    /// cost a traced burst more than the rest of the record.
    records: Mutex<HashMap<Arc<OsStr>, Record>>,
}

impl std::fmt::Debug for Discoveries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Discoveries")
            .field("source", &self.source)
            .field("traced", &self.tracing.is_some())
            .finish_non_exhaustive()
    }
}

impl Discoveries {
    /// Records for an agent fed by `source`; `traced` makes `discovery` spans (only worth it
    /// when an exporter is installed, see [`super::otlp`]), sampled by the operator's sampler.
    pub fn new(source: SourceKind, traced: bool) -> Self {
        Self::with_sampler(source, traced.then(sampling::head_sampler))
    }

    fn with_sampler(source: SourceKind, head: Option<Box<dyn ShouldSample>>) -> Self {
        Discoveries {
            source,
            tracing: head.map(|head| Tracing {
                tracer: super::otlp::tracer(),
                head,
            }),
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
        let Some(Tracing { head, .. }) = self.tracing.as_ref() else {
            return;
        };
        let source = self.label(via);
        let now = SystemTime::now();
        let started = kernel_ns.map_or(now, |ns| wall_time_of(ns, monotonic_now_ns(), now));
        let trace = sampling::random_trace_id();
        let path: Arc<OsStr> = Arc::from(path.as_os_str());
        let record = if sampling::head_samples(head.as_ref(), trace, "discovery") {
            let ids = SpanContext::new(
                trace,
                sampling::random_span_id(),
                TraceFlags::SAMPLED,
                false,
                TraceState::default(),
            );
            export_discovery(
                &ids,
                Path::new(&path),
                found,
                source,
                kernel_ns.is_some(),
                started,
                now,
            );
            Record::Built(ids)
        } else {
            Record::Unbuilt(Arc::new(Unbuilt {
                ids: SpanContext::new(
                    trace,
                    sampling::random_span_id(),
                    TraceFlags::default(),
                    false,
                    TraceState::default(),
                ),
                path: path.clone(),
                found,
                source,
                kernel_timestamp: kernel_ns.is_some(),
                started,
                ended: now,
                first_contact: Mutex::new(None),
                built: AtomicBool::new(false),
            }))
        };
        self.lock().insert(path, record);
    }

    /// A `first_contact` span in the trace of the socket at `path` (a child of its discovery):
    /// from the socket's creation (`after_creation` before the contact, when an event timed it;
    /// else the contact alone) to the first connect by another process, which the span names.
    /// Returns the span as an exemplar for the first-contact histogram when its trace is
    /// exported. Under a discovery the head sampler did not pick, the span is kept with it,
    /// exported if the discovery is (a contact after that is not traced), and has no exemplar; a
    /// socket with no discovery record has no trace to join, and its contact is not traced.
    pub fn first_contact(
        &self,
        path: &Path,
        contact: &Contact,
        after_creation: Option<Duration>,
    ) -> Option<TraceExemplar> {
        self.tracing.as_ref()?;
        let contacted = contact.at;
        let started = after_creation
            .and_then(|after| contacted.checked_sub(after))
            .unwrap_or(contacted);
        let root = match self.lock().get(path.as_os_str()) {
            Some(Record::Built(cx)) => cx.clone(),
            Some(Record::Unbuilt(root)) => {
                if !root.built.load(Ordering::Acquire) {
                    *root.first_contact.lock().unwrap_or_else(|p| p.into_inner()) =
                        Some((sampling::random_span_id(), *contact, started));
                }
                return None;
            }
            // No discovery of the socket to be part of (traces were off then): not traced.
            None => return None,
        };
        let id = sampling::random_span_id();
        export_first_contact(&root, id, path, contact, started);
        let cx = SpanContext::new(
            root.trace_id(),
            id,
            root.trace_flags(),
            false,
            TraceState::default(),
        );
        TraceExemplar::of(&cx)
    }

    /// What operations at `path` are children of (its latest discovery), when traces are on.
    pub fn parent_of(&self, path: &Path) -> Option<Root> {
        self.tracing.as_ref()?;
        self.lock()
            .get(path.as_os_str())
            .map(|record| match record {
                Record::Built(cx) => Root::Built(cx.clone()),
                Record::Unbuilt(root) => Root::Unbuilt(root.clone()),
            })
    }

    /// A span `name` with `attributes` under the discovery of `path`, built and ended now (an
    /// event in the socket's life outside any operation), and a context to log in it; `None`
    /// when traces are off or `path` has no record.
    pub fn event_span(
        &self,
        path: &Path,
        name: &'static str,
        attributes: Vec<KeyValue>,
    ) -> Option<Context> {
        let tracer = &self.tracing.as_ref()?.tracer;
        let parent = self.parent_of(path)?.context();
        let mut span = tracer
            .span_builder(name)
            .with_attributes(attributes)
            .start_with_context(tracer, &parent);
        span.end();
        Some(parent.with_remote_span_context(span.span_context().clone()))
    }

    /// `path` is neither desired nor registered: drop its record.
    pub fn forget(&self, path: &Path) {
        if self.tracing.is_none() {
            return;
        }
        let mut records = self.lock();
        records.remove(path.as_os_str());
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

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Arc<OsStr>, Record>> {
        // Single inserts and removes: a poisoned map is still consistent.
        self.records
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Exports the `discovery` span `ids` of `path`, from `started` to `ended`: a trace's root.
fn export_discovery(
    ids: &SpanContext,
    path: &Path,
    found: Found,
    source: &'static str,
    kernel_timestamp: bool,
    started: SystemTime,
    ended: SystemTime,
) {
    let attributes = [
        KeyValue::new("socket_path", path.to_string_lossy().into_owned()),
        KeyValue::new("change", found.as_str()),
        KeyValue::new("event_source", source),
        KeyValue::new("kernel_timestamp", kernel_timestamp),
    ];
    super::otlp::export(&SpanRecord {
        trace_id: ids.trace_id(),
        span_id: ids.span_id(),
        parent: SpanId::INVALID,
        parent_is_remote: false,
        name: "discovery",
        start: started,
        end: ended,
        attributes: &attributes,
        failed: false,
    });
}

/// Exports the `first_contact` span `id` under the discovery `root`, from `started` to the
/// `contact`, which it names.
fn export_first_contact(
    root: &SpanContext,
    id: SpanId,
    path: &Path,
    contact: &Contact,
    started: SystemTime,
) {
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
    super::otlp::export(&SpanRecord {
        trace_id: root.trace_id(),
        span_id: id,
        parent: root.span_id(),
        parent_is_remote: true,
        name: "first_contact",
        start: started,
        end: contact.at,
        attributes: &attributes,
        failed: false,
    });
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

    fn contact() -> Contact {
        Contact {
            by: crate::provenance::Actor {
                pid: 42,
                ..Default::default()
            },
            kernel_ns: 1,
            at: SystemTime::now(),
        }
    }

    #[test]
    fn discoveries_the_head_sampler_drops_are_kept_unbuilt_and_built_once() {
        use opentelemetry_sdk::trace::Sampler;
        let d = Discoveries::with_sampler(SourceKind::Ebpf, Some(Box::new(Sampler::AlwaysOff)));
        let path = Path::new("/r/a.sock");
        d.record(path, Found::Created, Via::Event, Some(monotonic_now_ns()));
        let Some(Root::Unbuilt(root)) = d.parent_of(path) else {
            panic!("an unsampled discovery is a parent to build later");
        };
        assert!(root.span_context().is_valid());
        assert!(!root.span_context().is_sampled());
        let Some(Record::Unbuilt(unbuilt)) = d.lock().get(path.as_os_str()).cloned() else {
            panic!("kept unbuilt");
        };
        assert_eq!(
            d.first_contact(path, &contact(), Some(Duration::from_millis(1))),
            None,
            "no exemplar for a trace that may never be exported"
        );
        assert!(unbuilt.first_contact.lock().expect("lock").is_some());
        root.build();
        assert!(unbuilt.built.load(Ordering::Acquire));
        assert!(
            unbuilt.first_contact.lock().expect("lock").is_none(),
            "built with its root"
        );
        assert_eq!(d.first_contact(path, &contact(), None), None);
        assert!(
            unbuilt.first_contact.lock().expect("lock").is_none(),
            "a contact after the root was built is not kept"
        );
        // A new discovery of the same path is a new trace.
        d.record(path, Found::Replaced, Via::Event, None);
        let Some(Root::Unbuilt(again)) = d.parent_of(path) else {
            panic!("unsampled");
        };
        assert_ne!(
            again.span_context().trace_id(),
            root.span_context().trace_id()
        );
    }

    #[test]
    fn discoveries_the_head_sampler_picks_are_traced_as_they_happen() {
        use opentelemetry_sdk::trace::Sampler;
        let d = Discoveries::with_sampler(SourceKind::Ebpf, Some(Box::new(Sampler::AlwaysOn)));
        d.record(Path::new("/r/a.sock"), Found::Created, Via::Scan, None);
        assert!(matches!(
            d.parent_of(Path::new("/r/a.sock")),
            Some(Root::Built(_))
        ));
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
