//! A growing log of JSON lines read from a child process, which tests await lines of.
//!
//! ```text
//! child stdout/stderr --(reader thread)--> EventLog (every line kept) --> wait_for(pred) in tests
//! ```
//!
//! Every line is kept for the whole test, so a failed wait can print what the process did, and so
//! a test can look for a line that arrived before it started waiting. [`Mark`]s let a test wait
//! only for lines that arrive after some point (the 2nd registration of the same socket, say).

use serde_json::Value;
use std::io::BufRead;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// One line of output: the parsed JSON object, or the raw text wrapped as `{"message": raw}` when
/// it is not JSON (panics, usage errors), so predicates still see it.
#[derive(Debug, Clone)]
pub struct Line(pub Value);

impl Line {
    fn parse(raw: &str) -> Line {
        match serde_json::from_str::<Value>(raw) {
            Ok(value @ Value::Object(_)) => Line(value),
            _ => Line(serde_json::json!({ "message": raw, "unparsed": true })),
        }
    }

    /// The `message` field of an agent log line (empty when absent).
    pub fn message(&self) -> &str {
        self.0.get("message").and_then(Value::as_str).unwrap_or("")
    }

    /// The `event` field of a plugin event line (empty when absent).
    pub fn event(&self) -> &str {
        self.0.get("event").and_then(Value::as_str).unwrap_or("")
    }

    /// A field as text, looked up in the event itself, then in its current span, then in the
    /// enclosing spans (innermost first): the agent records identifiers such as `socket_path` on
    /// spans, and its JSON logs carry them there rather than on the event.
    pub fn field(&self, name: &str) -> Option<String> {
        let text = |v: &Value| match v {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        if let Some(v) = self.0.get(name) {
            return Some(text(v));
        }
        if let Some(v) = self.0.get("span").and_then(|s| s.get(name)) {
            return Some(text(v));
        }
        let spans = self.0.get("spans").and_then(Value::as_array)?;
        spans.iter().rev().find_map(|s| s.get(name)).map(text)
    }

    /// True when the field is present and equal to `value`.
    pub fn field_is(&self, name: &str, value: &str) -> bool {
        self.field(name).as_deref() == Some(value)
    }

    /// Position in its log (0-based), to assert the order of two lines.
    pub fn position(&self) -> usize {
        self.0.get("_line").and_then(Value::as_u64).unwrap_or(0) as usize
    }

    /// A boolean field of the event itself.
    pub fn flag(&self, name: &str) -> Option<bool> {
        self.0.get(name).and_then(Value::as_bool)
    }
}

impl std::fmt::Display for Line {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A position in an [`EventLog`]: waits "after a mark" ignore the lines before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Mark(pub usize);

/// Why a wait ended without the line it wanted.
#[derive(Debug)]
pub enum WaitError {
    /// The deadline passed.
    Timeout,
    /// The process closed its output (it exited) and no line matched.
    Closed,
}

#[derive(Debug)]
struct Shared {
    lines: Mutex<Vec<Line>>,
    closed: AtomicBool,
    count: watch::Sender<usize>,
}

/// The lines of one output stream of one child process. Cheap to clone (shared).
#[derive(Debug, Clone)]
pub struct EventLog {
    shared: Arc<Shared>,
}

impl Default for EventLog {
    fn default() -> Self {
        EventLog {
            shared: Arc::new(Shared {
                lines: Mutex::new(Vec::new()),
                closed: AtomicBool::new(false),
                count: watch::channel(0).0,
            }),
        }
    }
}

impl EventLog {
    /// Starts a thread that reads `stream` line by line into a new log until end of file. A
    /// thread rather than a task, so the log fills whether or not the test's runtime is polling.
    pub fn read_from(stream: impl std::io::Read + Send + 'static, label: String) -> EventLog {
        let log = EventLog::default();
        let writer = log.clone();
        let spawned = std::thread::Builder::new().name(label).spawn(move || {
            let reader = std::io::BufReader::new(stream);
            for raw in reader.lines() {
                let Ok(raw) = raw else { break };
                if raw.trim().is_empty() {
                    continue;
                }
                writer.push(Line::parse(&raw));
            }
            writer.shared.closed.store(true, Ordering::SeqCst);
            writer.shared.count.send_modify(|_| {});
        });
        if let Err(e) = spawned {
            panic!("cannot start an output reader thread: {e}");
        }
        log
    }

    fn push(&self, mut line: Line) {
        let len = {
            let mut lines = self.lock();
            if let Value::Object(map) = &mut line.0 {
                map.insert("_line".into(), Value::from(lines.len()));
            }
            lines.push(line);
            lines.len()
        };
        self.shared.count.send_replace(len);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Line>> {
        self.shared.lines.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The current end of the log.
    pub fn mark(&self) -> Mark {
        Mark(self.lock().len())
    }

    /// Whether the stream has ended.
    pub fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::SeqCst)
    }

    /// All lines so far.
    pub fn lines(&self) -> Vec<Line> {
        self.lock().clone()
    }

    /// Lines from `mark` on that satisfy `pred`.
    pub fn matching_since(&self, mark: Mark, pred: impl Fn(&Line) -> bool) -> Vec<Line> {
        self.lock()
            .iter()
            .skip(mark.0)
            .filter(|l| pred(l))
            .cloned()
            .collect()
    }

    /// The last `n` lines, one per text line, for failure messages.
    pub fn tail(&self, n: usize) -> String {
        let lines = self.lock();
        let start = lines.len().saturating_sub(n);
        let mut out = String::new();
        for line in &lines[start..] {
            out.push_str("    ");
            out.push_str(&line.to_string());
            out.push('\n');
        }
        out
    }

    /// Waits until `n` lines from `mark` on satisfy `pred`, and returns them.
    pub async fn wait_for_count(
        &self,
        mark: Mark,
        n: usize,
        timeout: Duration,
        pred: impl Fn(&Line) -> bool,
    ) -> Result<Vec<Line>, WaitError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut changes = self.shared.count.subscribe();
        loop {
            changes.borrow_and_update();
            let found = self.matching_since(mark, &pred);
            if found.len() >= n {
                return Ok(found.into_iter().take(n).collect());
            }
            if self.is_closed() {
                return Err(WaitError::Closed);
            }
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Err(WaitError::Closed),
                Err(_) => return Err(WaitError::Timeout),
            }
        }
    }

    /// Waits for the first line from `mark` on that satisfies `pred`.
    pub async fn wait_for(
        &self,
        mark: Mark,
        timeout: Duration,
        pred: impl Fn(&Line) -> bool,
    ) -> Result<Line, WaitError> {
        let mut found = self.wait_for_count(mark, 1, timeout, pred).await?;
        found.pop().ok_or(WaitError::Closed)
    }
}
