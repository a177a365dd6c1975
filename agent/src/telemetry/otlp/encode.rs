//! OTLP's protobuf for finished spans, written straight from the SDK's `SpanData` into the bytes
//! of an export request.
//!
//! ```text
//! span ends ─> span_entry: the span as one `ScopeSpans.spans` field (tag, length, body)
//!                 ...appended to the batch's bytes as it comes (batch.rs)
//! batch full or due ─> request: ExportTraceServiceRequest { resource_spans: [ResourceSpans {
//!                         resource, schema_url,              (encoded once, by prost)
//!                         scope_spans: [ScopeSpans { scope,  (encoded once, by prost)
//!                                                    spans: the batch's bytes as they are }] }] }
//! ```
//!
//! Why not the exporter crate's path: it turns every span into owned protobuf structs (a `String`
//! per name and attribute key and value, a `Vec` per ID), encodes them with their lengths computed
//! again at each level of nesting, and frees them; with the batch processor's channel in front, a
//! traced burst spent about 20,000 instructions per span on the way out, more than the agent's
//! whole untraced work for a registration. Here a span costs its bytes: field numbers and wire
//! types are OTLP's (`opentelemetry/proto/trace/v1/trace.proto`, `common/v1/common.proto`),
//! written with prost's encoding functions; the messages written once per batch (resource,
//! scope, the response) are opentelemetry-proto's types. The unit tests decode what is written
//! here with those types and compare it with the exporter crate's own conversion of the same
//! spans.

use bytes::{BufMut, Bytes, BytesMut};
use opentelemetry::trace::{SpanId, SpanKind, Status, TraceFlags, TraceId};
use opentelemetry::{Array, KeyValue, Value};
use opentelemetry_proto::tonic::common::v1::InstrumentationScope;
use opentelemetry_proto::tonic::resource::v1::Resource as ProtoResource;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans};
use opentelemetry_sdk::trace::SpanData;
use prost::Message as _;
use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len};
use std::time::{SystemTime, UNIX_EPOCH};

/// The instrumentation scope of every span the agent makes (its tracer's name); the batch
/// exporter's envelope names it.
pub const SCOPE: &str = "plugin-agent";

/// `Span.flags`: the context's "is remote" bit is known (OTLP's `SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK`).
const FLAG_HAS_IS_REMOTE: u32 = 0x100;
/// `Span.flags`: the parent is remote (`SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK`).
const FLAG_IS_REMOTE: u32 = 0x200;

/// A message field's room: key, length, body.
fn field_len(tag: u32, body: usize) -> usize {
    key_len(tag) + encoded_len_varint(body as u64) + body
}

fn put_len_delimited(tag: u32, body: usize, out: &mut impl BufMut) {
    encode_key(tag, WireType::LengthDelimited, out);
    encode_varint(body as u64, out);
}

/// A `bytes` or `string` field, left out when empty (proto3's default).
fn put_bytes(tag: u32, value: &[u8], out: &mut impl BufMut) {
    if !value.is_empty() {
        put_len_delimited(tag, value.len(), out);
        out.put_slice(value);
    }
}

fn bytes_len(tag: u32, value: &[u8]) -> usize {
    if value.is_empty() {
        0
    } else {
        field_len(tag, value.len())
    }
}

/// A `uint32` or enum field, left out when zero.
fn put_varint(tag: u32, value: u64, out: &mut impl BufMut) {
    if value != 0 {
        encode_key(tag, WireType::Varint, out);
        encode_varint(value, out);
    }
}

fn varint_len(tag: u32, value: u64) -> usize {
    if value == 0 {
        0
    } else {
        key_len(tag) + encoded_len_varint(value)
    }
}

/// A `fixed64` field (times), left out when zero.
fn put_fixed64(tag: u32, value: u64, out: &mut impl BufMut) {
    if value != 0 {
        encode_key(tag, WireType::SixtyFourBit, out);
        out.put_u64_le(value);
    }
}

fn fixed64_len(tag: u32, value: u64) -> usize {
    if value == 0 { 0 } else { key_len(tag) + 8 }
}

/// A `fixed32` field (`Span.flags`), left out when zero.
fn put_fixed32(tag: u32, value: u32, out: &mut impl BufMut) {
    if value != 0 {
        encode_key(tag, WireType::ThirtyTwoBit, out);
        out.put_u32_le(value);
    }
}

fn fixed32_len(tag: u32, value: u32) -> usize {
    if value == 0 { 0 } else { key_len(tag) + 4 }
}

/// Nanoseconds since the epoch; a time before it is 0 (the exporter crate's rule).
fn unix_nanos(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

// --- common.v1: AnyValue { string_value = 1, bool_value = 2, int_value = 3, double_value = 4,
// array_value = 5 }, ArrayValue { values = 1 }, KeyValue { key = 1, value = 2 } ---
//
// A oneof member is written even when it holds its type's default: its presence is the value.

/// The body of the `AnyValue` holding one scalar of an array.
enum Scalar<'a> {
    Bool(bool),
    I64(i64),
    F64(f64),
    Str(&'a str),
}

impl Scalar<'_> {
    fn len(&self) -> usize {
        match self {
            Scalar::Bool(_) => key_len(2) + 1,
            Scalar::I64(v) => key_len(3) + encoded_len_varint(*v as u64),
            Scalar::F64(_) => key_len(4) + 8,
            Scalar::Str(s) => field_len(1, s.len()),
        }
    }

    fn put(&self, out: &mut impl BufMut) {
        match self {
            Scalar::Bool(v) => {
                encode_key(2, WireType::Varint, out);
                encode_varint(u64::from(*v), out);
            }
            Scalar::I64(v) => {
                encode_key(3, WireType::Varint, out);
                encode_varint(*v as u64, out);
            }
            Scalar::F64(v) => {
                encode_key(4, WireType::SixtyFourBit, out);
                out.put_f64_le(*v);
            }
            Scalar::Str(s) => {
                put_len_delimited(1, s.len(), out);
                out.put_slice(s.as_bytes());
            }
        }
    }
}

fn for_each_scalar(array: &Array, mut f: impl FnMut(Scalar<'_>)) {
    match array {
        Array::Bool(v) => v.iter().for_each(|b| f(Scalar::Bool(*b))),
        Array::I64(v) => v.iter().for_each(|i| f(Scalar::I64(*i))),
        Array::F64(v) => v.iter().for_each(|x| f(Scalar::F64(*x))),
        Array::String(v) => v.iter().for_each(|s| f(Scalar::Str(s.as_str()))),
        // `Array` is non-exhaustive; anything newer is left out of the array.
        _ => {}
    }
}

/// `ArrayValue`'s body: each element an `AnyValue` message in field 1.
fn array_len(array: &Array) -> usize {
    let mut len = 0;
    for_each_scalar(array, |s| len += field_len(1, s.len()));
    len
}

/// `AnyValue`'s body.
fn any_value_len(value: &Value) -> usize {
    match value {
        Value::Bool(v) => Scalar::Bool(*v).len(),
        Value::I64(v) => Scalar::I64(*v).len(),
        Value::F64(v) => Scalar::F64(*v).len(),
        Value::String(v) => Scalar::Str(v.as_str()).len(),
        Value::Array(a) => field_len(5, array_len(a)),
        // `Value` is non-exhaustive: anything newer is written as its text.
        other => Scalar::Str(&other.as_str()).len(),
    }
}

fn put_any_value(value: &Value, out: &mut impl BufMut) {
    match value {
        Value::Bool(v) => Scalar::Bool(*v).put(out),
        Value::I64(v) => Scalar::I64(*v).put(out),
        Value::F64(v) => Scalar::F64(*v).put(out),
        Value::String(v) => Scalar::Str(v.as_str()).put(out),
        Value::Array(a) => {
            put_len_delimited(5, array_len(a), out);
            for_each_scalar(a, |s| {
                put_len_delimited(1, s.len(), out);
                s.put(out);
            });
        }
        other => Scalar::Str(&other.as_str()).put(out),
    }
}

/// `KeyValue`'s body.
fn key_value_len(kv: &KeyValue) -> usize {
    bytes_len(1, kv.key.as_str().as_bytes()) + field_len(2, any_value_len(&kv.value))
}

fn put_key_value(kv: &KeyValue, out: &mut impl BufMut) {
    put_bytes(1, kv.key.as_str().as_bytes(), out);
    put_len_delimited(2, any_value_len(&kv.value), out);
    put_any_value(&kv.value, out);
}

/// Repeated `KeyValue` field `tag`.
fn attributes_len(tag: u32, attributes: &[KeyValue]) -> usize {
    attributes
        .iter()
        .map(|kv| field_len(tag, key_value_len(kv)))
        .sum()
}

fn put_attributes(tag: u32, attributes: &[KeyValue], out: &mut impl BufMut) {
    for kv in attributes {
        put_len_delimited(tag, key_value_len(kv), out);
        put_key_value(kv, out);
    }
}

// --- trace.v1.Span { trace_id = 1, span_id = 2, trace_state = 3, parent_span_id = 4, name = 5,
// kind = 6, start_time_unix_nano = 7, end_time_unix_nano = 8, attributes = 9,
// dropped_attributes_count = 10, events = 11, dropped_events_count = 12, links = 13,
// dropped_links_count = 14, status = 15, flags = 16 };
// Event { time_unix_nano = 1, name = 2, attributes = 3, dropped_attributes_count = 4 };
// Link { trace_id = 1, span_id = 2, trace_state = 3, attributes = 4,
// dropped_attributes_count = 5, flags = 6 }; Status { message = 2, code = 3 } ---

fn kind(kind: &SpanKind) -> u64 {
    match kind {
        SpanKind::Internal => 1,
        SpanKind::Server => 2,
        SpanKind::Client => 3,
        SpanKind::Producer => 4,
        SpanKind::Consumer => 5,
    }
}

/// `Status`'s code and message: Unset 0, Ok 1, Error 2 (with its description).
fn status(status: &Status) -> (u64, &str) {
    match status {
        Status::Unset => (0, ""),
        Status::Ok => (1, ""),
        Status::Error { description } => (2, description.as_ref()),
    }
}

fn status_len(code: u64, message: &str) -> usize {
    bytes_len(2, message.as_bytes()) + varint_len(3, code)
}

fn event_len(event: &opentelemetry::trace::Event) -> usize {
    fixed64_len(1, unix_nanos(event.timestamp))
        + bytes_len(2, event.name.as_bytes())
        + attributes_len(3, &event.attributes)
        + varint_len(4, u64::from(event.dropped_attributes_count))
}

fn put_event(event: &opentelemetry::trace::Event, out: &mut impl BufMut) {
    put_fixed64(1, unix_nanos(event.timestamp), out);
    put_bytes(2, event.name.as_bytes(), out);
    put_attributes(3, &event.attributes, out);
    put_varint(4, u64::from(event.dropped_attributes_count), out);
}

fn link_flags(link: &opentelemetry::trace::Link) -> u32 {
    let cx = &link.span_context;
    span_flags(cx.trace_flags(), cx.is_remote())
}

fn link_len(link: &opentelemetry::trace::Link, state: &str) -> usize {
    let cx = &link.span_context;
    bytes_len(1, &cx.trace_id().to_bytes())
        + bytes_len(2, &cx.span_id().to_bytes())
        + bytes_len(3, state.as_bytes())
        + attributes_len(4, &link.attributes)
        + varint_len(5, u64::from(link.dropped_attributes_count))
        + fixed32_len(6, link_flags(link))
}

fn put_link(link: &opentelemetry::trace::Link, state: &str, out: &mut impl BufMut) {
    let cx = &link.span_context;
    put_bytes(1, &cx.trace_id().to_bytes(), out);
    put_bytes(2, &cx.span_id().to_bytes(), out);
    put_bytes(3, state.as_bytes(), out);
    put_attributes(4, &link.attributes, out);
    put_varint(5, u64::from(link.dropped_attributes_count), out);
    put_fixed32(6, link_flags(link), out);
}

/// A finished span as the agent records one (`telemetry::sampling::OperationTrace`): an
/// internal span with no events or links, exported as sampled.
#[derive(Debug, Clone, Copy)]
pub struct SpanRecord<'a> {
    pub trace_id: TraceId,
    pub span_id: SpanId,
    /// `SpanId::INVALID` for a root.
    pub parent: SpanId,
    /// The parent came from another context than the span's own (a discovery, for an
    /// operation), as the SDK marks a span started under a remote span context.
    pub parent_is_remote: bool,
    pub name: &'a str,
    pub start: SystemTime,
    pub end: SystemTime,
    pub attributes: &'a [KeyValue],
    /// Ends with an error status, described by the `plugin_agent.reason` attribute when there
    /// is one (the `error` attribute says what happened).
    pub failed: bool,
}

/// A failed operation's status description: the socket's reason (the verdict of `plugin-agent
/// explain`, a closed list), when the operation recorded one.
fn reason_of(attributes: &[KeyValue]) -> &str {
    attributes
        .iter()
        .find(|kv| kv.key.as_str() == "plugin_agent.reason")
        .and_then(|kv| match &kv.value {
            opentelemetry::Value::String(reason) => Some(reason.as_str()),
            _ => None,
        })
        .unwrap_or("")
}

/// What a span's body is made of, computed once for its length and its writing.
struct SpanFields<'a> {
    trace_id: [u8; 16],
    span_id: [u8; 8],
    parent: [u8; 8],
    trace_state: String,
    name: &'a str,
    kind: u64,
    start: u64,
    end: u64,
    attributes: &'a [KeyValue],
    dropped_attributes: u32,
    flags: u32,
    status: (u64, &'a str),
    /// The SDK's span, for its events and links (a record has none).
    sdk: Option<(&'a SpanData, Vec<String>)>,
}

fn span_flags(trace_flags: TraceFlags, parent_is_remote: bool) -> u32 {
    let mut flags = u32::from(trace_flags.to_u8()) | FLAG_HAS_IS_REMOTE;
    if parent_is_remote {
        flags |= FLAG_IS_REMOTE;
    }
    flags
}

impl<'a> SpanFields<'a> {
    fn of(span: &'a SpanData) -> Self {
        let cx = &span.span_context;
        let link_states = span
            .links
            .iter()
            .map(|l| l.span_context.trace_state().header())
            .collect();
        SpanFields {
            trace_id: cx.trace_id().to_bytes(),
            span_id: cx.span_id().to_bytes(),
            parent: span.parent_span_id.to_bytes(),
            trace_state: cx.trace_state().header(),
            name: span.name.as_ref(),
            kind: kind(&span.span_kind),
            start: unix_nanos(span.start_time),
            end: unix_nanos(span.end_time),
            attributes: &span.attributes,
            dropped_attributes: span.dropped_attributes_count,
            flags: span_flags(cx.trace_flags(), span.parent_span_is_remote),
            status: status(&span.status),
            sdk: Some((span, link_states)),
        }
    }

    fn record(span: &SpanRecord<'a>) -> Self {
        SpanFields {
            trace_id: span.trace_id.to_bytes(),
            span_id: span.span_id.to_bytes(),
            parent: span.parent.to_bytes(),
            trace_state: String::new(),
            name: span.name,
            kind: kind(&SpanKind::Internal),
            start: unix_nanos(span.start),
            end: unix_nanos(span.end),
            attributes: span.attributes,
            dropped_attributes: 0,
            flags: span_flags(TraceFlags::SAMPLED, span.parent_is_remote),
            status: if span.failed {
                (2, reason_of(span.attributes))
            } else {
                (0, "")
            },
            sdk: None,
        }
    }

    /// The parent's ID, empty for a root (the invalid ID is all zeroes).
    fn parent(&self) -> &[u8] {
        if self.parent == [0; 8] {
            &[]
        } else {
            &self.parent
        }
    }

    /// Events and links (fields 11 to 14): the SDK's spans only.
    fn sdk_len(&self) -> usize {
        let Some((span, link_states)) = &self.sdk else {
            return 0;
        };
        span.events
            .iter()
            .map(|e| field_len(11, event_len(e)))
            .sum::<usize>()
            + varint_len(12, u64::from(span.events.dropped_count))
            + span
                .links
                .iter()
                .zip(link_states)
                .map(|(l, s)| field_len(13, link_len(l, s)))
                .sum::<usize>()
            + varint_len(14, u64::from(span.links.dropped_count))
    }

    fn put_sdk(&self, out: &mut impl BufMut) {
        let Some((span, link_states)) = &self.sdk else {
            return;
        };
        for event in span.events.iter() {
            put_len_delimited(11, event_len(event), out);
            put_event(event, out);
        }
        put_varint(12, u64::from(span.events.dropped_count), out);
        for (link, state) in span.links.iter().zip(link_states) {
            put_len_delimited(13, link_len(link, state), out);
            put_link(link, state, out);
        }
        put_varint(14, u64::from(span.links.dropped_count), out);
    }

    fn len(&self) -> usize {
        let (code, message) = self.status;
        bytes_len(1, &self.trace_id)
            + bytes_len(2, &self.span_id)
            + bytes_len(3, self.trace_state.as_bytes())
            + bytes_len(4, self.parent())
            + bytes_len(5, self.name.as_bytes())
            + varint_len(6, self.kind)
            + fixed64_len(7, self.start)
            + fixed64_len(8, self.end)
            + attributes_len(9, self.attributes)
            + varint_len(10, u64::from(self.dropped_attributes))
            + self.sdk_len()
            + field_len(15, status_len(code, message))
            + fixed32_len(16, self.flags)
    }

    fn put(&self, out: &mut impl BufMut) {
        put_bytes(1, &self.trace_id, out);
        put_bytes(2, &self.span_id, out);
        put_bytes(3, self.trace_state.as_bytes(), out);
        put_bytes(4, self.parent(), out);
        put_bytes(5, self.name.as_bytes(), out);
        put_varint(6, self.kind, out);
        put_fixed64(7, self.start, out);
        put_fixed64(8, self.end, out);
        put_attributes(9, self.attributes, out);
        put_varint(10, u64::from(self.dropped_attributes), out);
        self.put_sdk(out);
        // The status is always there (the exporter crate always sets it).
        let (code, message) = self.status;
        put_len_delimited(15, status_len(code, message), out);
        put_bytes(2, message.as_bytes(), out);
        put_varint(3, code, out);
        put_fixed32(16, self.flags, out);
    }
}

/// One span, ready to be appended to a batch as an entry of `ScopeSpans.spans` (field 2): a
/// batch is these entries back to back, which is what the repeated field is on the wire.
pub struct Entry<'a> {
    fields: SpanFields<'a>,
    body: usize,
}

impl<'a> Entry<'a> {
    /// The SDK's `span`.
    pub fn sdk(span: &'a SpanData) -> Self {
        Self::new(SpanFields::of(span))
    }

    /// The agent's `span`.
    pub fn record(span: &SpanRecord<'a>) -> Self {
        Self::new(SpanFields::record(span))
    }

    fn new(fields: SpanFields<'a>) -> Self {
        let body = fields.len();
        Entry { fields, body }
    }

    /// The bytes [`Entry::put`] appends.
    pub fn len(&self) -> usize {
        field_len(2, self.body)
    }

    /// Appends the entry to `out`.
    pub fn put(&self, out: &mut impl BufMut) {
        put_len_delimited(2, self.body, out);
        self.fields.put(out);
    }
}

/// Appends `span` to `out` as one entry of `ScopeSpans.spans` (see [`Entry`]).
#[cfg(test)]
fn span_entry(span: &SpanData, out: &mut impl BufMut) {
    Entry::sdk(span).put(out);
}

/// Appends the agent's `span` to `out` as [`span_entry`] does an SDK span.
#[cfg(test)]
fn record_entry(span: &SpanRecord<'_>, out: &mut impl BufMut) {
    Entry::record(span).put(out);
}

/// The room [`span_entry`] takes for `span`.
#[cfg(test)]
fn span_entry_len(span: &SpanData) -> usize {
    Entry::sdk(span).len()
}

/// What every export request of this process says around its spans: the resource and the
/// instrumentation scope, encoded once.
#[derive(Debug, Clone)]
pub struct Envelope {
    /// `ResourceSpans` without its `scope_spans`: resource and schema URL.
    resource_spans: Bytes,
    /// `ScopeSpans` without its `spans`: scope and schema URL.
    scope_spans: Bytes,
}

impl Envelope {
    /// The envelope of spans from `resource`, all made by the tracer named `scope`.
    pub fn new(resource: &opentelemetry_sdk::Resource, scope: &str) -> Self {
        let attributes =
            opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema::from(
                resource,
            );
        let resource_spans = ResourceSpans {
            resource: Some(ProtoResource {
                attributes: attributes.attributes.0,
                dropped_attributes_count: 0,
                entity_refs: Vec::new(),
            }),
            scope_spans: Vec::new(),
            schema_url: attributes.schema_url.unwrap_or_default(),
        };
        let scope_spans = ScopeSpans {
            scope: Some(InstrumentationScope {
                name: scope.to_owned(),
                ..Default::default()
            }),
            spans: Vec::new(),
            schema_url: String::new(),
        };
        Envelope {
            resource_spans: resource_spans.encode_to_vec().into(),
            scope_spans: scope_spans.encode_to_vec().into(),
        }
    }

    /// An `ExportTraceServiceRequest` carrying `spans` (entries written by [`span_entry`]).
    pub fn request(&self, spans: &[u8]) -> Bytes {
        // ScopeSpans = its prefix + the entries; ResourceSpans = its prefix + ScopeSpans as
        // field 2; the request = ResourceSpans as field 1. Fields may come in any order.
        let scope_len = self.scope_spans.len() + spans.len();
        let resource_len = self.resource_spans.len() + field_len(2, scope_len);
        let mut out = BytesMut::with_capacity(field_len(1, resource_len));
        put_len_delimited(1, resource_len, &mut out);
        out.put_slice(&self.resource_spans);
        put_len_delimited(2, scope_len, &mut out);
        out.put_slice(&self.scope_spans);
        out.put_slice(spans);
        out.freeze()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{Event, Link, SpanContext, SpanId, TraceFlags, TraceId, TraceState};
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::tonic::trace::v1::Span as ProtoSpan;
    use opentelemetry_sdk::trace::{SpanEvents, SpanLinks};
    use std::borrow::Cow;
    use std::time::Duration;

    fn span(name: &'static str, parent: SpanId, attributes: Vec<KeyValue>) -> SpanData {
        let at = UNIX_EPOCH + Duration::from_nanos(1_764_000_000_123_456_789);
        SpanData {
            span_context: SpanContext::new(
                TraceId::from(0x0123_4567_89ab_cdef_0011_2233_4455_6677_u128),
                SpanId::from(0x1122_3344_5566_7788_u64),
                TraceFlags::SAMPLED,
                false,
                TraceState::default(),
            ),
            parent_span_id: parent,
            parent_span_is_remote: parent != SpanId::INVALID,
            span_kind: SpanKind::Internal,
            name: Cow::Borrowed(name),
            start_time: at,
            end_time: at + Duration::from_micros(1500),
            attributes,
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status: Status::Unset,
            instrumentation_scope: opentelemetry::InstrumentationScope::builder("plugin-agent")
                .build(),
        }
    }

    /// Every kind of value an attribute can hold, defaults included (a oneof's zero is a value).
    fn every_value() -> Vec<KeyValue> {
        vec![
            KeyValue::new("socket_path", "/var/lib/kubelet/plugins_registry/a.sock"),
            KeyValue::new("empty", ""),
            KeyValue::new("attempt", 3_i64),
            KeyValue::new("zero", 0_i64),
            KeyValue::new("negative", -7_i64),
            KeyValue::new("kernel_timestamp", true),
            KeyValue::new("no", false),
            KeyValue::new("ratio", 0.25),
            KeyValue::new("nothing", 0.0),
            KeyValue::new("pids", Value::Array(Array::I64(vec![1, 0, -2]))),
            KeyValue::new(
                "names",
                Value::Array(Array::String(vec!["a".into(), "".into()])),
            ),
            KeyValue::new("flags", Value::Array(Array::Bool(vec![true, false]))),
            KeyValue::new("floats", Value::Array(Array::F64(vec![1.5, 0.0]))),
            KeyValue::new("none", Value::Array(Array::I64(vec![]))),
        ]
    }

    fn decode_entry(span: &SpanData) -> ProtoSpan {
        let mut entries = BytesMut::new();
        span_entry(span, &mut entries);
        assert_eq!(entries.len(), span_entry_len(span));
        let envelope = Envelope::new(&opentelemetry_sdk::Resource::builder_empty().build(), "s");
        let request =
            ExportTraceServiceRequest::decode(envelope.request(&entries)).expect("a valid request");
        let mut spans = request.resource_spans[0].scope_spans[0].spans.clone();
        assert_eq!(spans.len(), 1);
        spans.remove(0)
    }

    #[test]
    fn a_span_decodes_to_what_the_exporter_crate_makes_of_it() {
        let cases = [
            span("register", SpanId::from(0x99_u64), every_value()),
            span("discovery", SpanId::INVALID, vec![]),
            {
                let mut failed = span("GetInfo", SpanId::from(7_u64), every_value());
                failed.status = Status::error("deadline exceeded");
                failed.span_kind = SpanKind::Client;
                failed.dropped_attributes_count = 2;
                failed.start_time = UNIX_EPOCH - Duration::from_secs(1);
                failed
            },
            {
                let mut eventful = span("dial", SpanId::from(8_u64), vec![]);
                eventful.status = Status::Ok;
                eventful.events.events = vec![Event::new(
                    "retry",
                    UNIX_EPOCH + Duration::from_secs(5),
                    every_value(),
                    1,
                )];
                eventful.events.dropped_count = 3;
                let linked = SpanContext::new(
                    TraceId::from(5_u128),
                    SpanId::from(6_u64),
                    TraceFlags::default(),
                    true,
                    TraceState::from_key_value([("k", "v")]).expect("state"),
                );
                eventful.links.links =
                    vec![Link::new(linked, vec![KeyValue::new("why", "retry")], 1)];
                eventful.links.dropped_count = 4;
                eventful
            },
        ];
        for case in cases {
            let expected = ProtoSpan::from(case.clone());
            assert_eq!(decode_entry(&case), expected, "{}", case.name);
        }
    }

    #[test]
    fn a_record_is_written_as_the_sdk_span_it_stands_for() {
        let attributes = every_value();
        for (parent, failed) in [(SpanId::from(0x99_u64), false), (SpanId::INVALID, true)] {
            let mut sdk = span("register", parent, attributes.clone());
            if failed {
                sdk.status = Status::error("");
            }
            let record = SpanRecord {
                trace_id: sdk.span_context.trace_id(),
                span_id: sdk.span_context.span_id(),
                parent,
                parent_is_remote: sdk.parent_span_is_remote,
                name: "register",
                start: sdk.start_time,
                end: sdk.end_time,
                attributes: &attributes,
                failed,
            };
            let (mut a, mut b) = (BytesMut::new(), BytesMut::new());
            span_entry(&sdk, &mut a);
            record_entry(&record, &mut b);
            assert_eq!(a, b, "parent {parent}, failed {failed}");
        }
    }

    #[test]
    fn a_request_carries_the_resource_the_scope_and_every_span_in_order() {
        let resource = opentelemetry_sdk::Resource::builder_empty()
            .with_service_name("plugin-agent")
            .with_attributes([KeyValue::new("k8s.node.name", "node-1")])
            .with_schema_url([], "https://opentelemetry.io/schemas/1.26.0")
            .build();
        let envelope = Envelope::new(&resource, "plugin-agent");
        let spans = [
            span("discovery", SpanId::INVALID, vec![]),
            span("register", SpanId::from(1_u64), every_value()),
            span("GetInfo", SpanId::from(2_u64), vec![]),
        ];
        let mut entries = BytesMut::new();
        for s in &spans {
            span_entry(s, &mut entries);
        }
        let request = ExportTraceServiceRequest::decode(envelope.request(&entries)).expect("valid");
        let resource_attributes =
            opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema::from(
                &resource,
            );
        let expected =
            opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope(
                spans.to_vec(),
                &resource_attributes,
            );
        assert_eq!(request.resource_spans, expected);
    }

    #[test]
    fn an_empty_batch_is_still_a_valid_request() {
        let envelope = Envelope::new(&opentelemetry_sdk::Resource::builder_empty().build(), "s");
        let request = ExportTraceServiceRequest::decode(envelope.request(&[])).expect("valid");
        assert!(request.resource_spans[0].scope_spans[0].spans.is_empty());
    }
}
