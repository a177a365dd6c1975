//! What the state files hold: the snapshot's shape and the journal's lines, as written (serde_json
//! of these types, borrowing from actual state) and as read. Both the journal (writing) and the
//! start (reading back) speak it; nothing here touches a file.

use crate::provenance::Process;
use crate::state::actual::RegisteredPlugin;
use std::borrow::Cow;
use std::time::SystemTime;

/// The format this agent writes and reads; another is ignored (with a warning), never guessed at.
pub const FORMAT: u32 = 1;

/// The snapshot.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(super) struct StateFile {
    pub(super) format: u32,
    /// The watched tree the entries are under: another tree's file is not this agent's.
    pub(super) root: String,
    pub(super) plugins: Vec<Entry<'static>>,
}

/// One registered (or, in observe mode, observed) plugin: owned as read, borrowed from actual
/// state as written (a snapshot of 10,000 copies none of their strings; the generation is
/// formatted on the stack).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(super) struct Entry<'a> {
    pub(super) path: Cow<'a, str>,
    pub(super) generation: Cow<'a, str>,
    pub(super) dev: u64,
    pub(super) ino: u64,
    pub(super) birth_ns: Option<i64>,
    pub(super) handle: Option<u64>,
    #[serde(rename = "type")]
    pub(super) plugin_type: Cow<'a, str>,
    pub(super) name: Cow<'a, str>,
    pub(super) endpoint: Cow<'a, str>,
    pub(super) versions: Cow<'a, [String]>,
    /// The handler's description (its target) it was registered with; none when observed.
    pub(super) handler: Option<String>,
    pub(super) registered_at_unix_ms: u64,
    /// Who created the socket, when known (absent in files of agents before provenance: an
    /// older agent reading a newer file ignores them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) creator: Option<Cow<'a, Process>>,
    /// Who served the registration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) server: Option<Cow<'a, Process>>,
    /// Begun and not finished (see the module docs).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(super) unfinished: bool,
}

impl<'a> Entry<'a> {
    /// `entry`, registered from `path`, as the files hold it. `generation` is its generation
    /// formatted (lowercase, hyphenated: `Uuid::hyphenated().encode_lower` into a stack buffer);
    /// `unfinished` is the journal's record of it (not the plugin's `interrupted`, which is what
    /// the previous agent left).
    pub(super) fn of(
        path: &'a str,
        entry: &'a RegisteredPlugin,
        generation: &'a str,
        unfinished: bool,
    ) -> Entry<'a> {
        Entry {
            path: Cow::Borrowed(path),
            generation: Cow::Borrowed(generation),
            dev: entry.socket.dev,
            ino: entry.socket.ino,
            birth_ns: entry.socket.birth_ns,
            handle: entry.socket.handle,
            plugin_type: Cow::Borrowed(&entry.plugin.plugin_type),
            name: Cow::Borrowed(&entry.plugin.name),
            endpoint: Cow::Borrowed(&entry.plugin.endpoint),
            versions: Cow::Borrowed(&entry.plugin.supported_versions),
            handler: entry.handler.as_ref().map(|h| h.describe()),
            registered_at_unix_ms: entry
                .registered_at
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            creator: entry.provenance.creator.process().map(Cow::Borrowed),
            server: entry.provenance.server.as_deref().map(Cow::Borrowed),
            unfinished,
        }
    }
}

/// One journal line, as read (written as a [`Line`]).
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum Op {
    /// A registration began (unfinished); an agent before this line was written fails to read
    /// it and registers everything again.
    Begin(Box<Entry<'static>>),
    /// A registration finished: the whole entry when it was not begun in the journal (observe
    /// mode), else only which one.
    Add(Box<Entry<'static>>),
    Done {
        path: String,
        generation: String,
    },
    Remove {
        path: String,
        generation: String,
    },
}

/// A journal line as written, borrowing everything (a `done` or `remove` line builds no entry).
/// Reads as [`Op`].
#[derive(serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum Line<'a> {
    Begin(&'a Entry<'a>),
    Add(&'a Entry<'a>),
    Done { path: &'a str, generation: &'a str },
    Remove { path: &'a str, generation: &'a str },
}
