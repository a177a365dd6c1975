//! The JSON the journal writes, straight from actual state into a buffer: its lines and the
//! snapshot, byte for byte what serde_json writes for [`format`](super::format)'s types (a
//! property test holds them to it), so an older agent reads what this one writes and the other
//! way round. Reading stays serde_json's.
//!
//! Why not serde_json here: it checks every byte of every key and string against its escape table
//! one at a time (~200 instructions a string, 25 strings an entry: 5,400 of the 7,200
//! instructions an entry cost, callgrind, burst of 1,000), and the entry it serializes is built
//! first (the generation formatted into a `String`). Here the keys are constants written with the
//! punctuation around them, a string is checked whole for anything to escape (no early exit, so
//! the compiler checks many bytes an instruction) and copied at once, numbers go through `itoa`,
//! and a generation is formatted on the stack.

use crate::provenance::{Cgroup, Process};
use crate::state::actual::RegisteredPlugin;
use std::time::SystemTime;
use uuid::Uuid;

/// `{"begin":ENTRY}` and its newline: a registration began (unfinished).
pub(super) fn begin(out: &mut Vec<u8>, path: &str, plugin: &RegisteredPlugin) {
    out.extend_from_slice(b"{\"begin\":");
    entry(out, path, plugin, true);
    out.extend_from_slice(b"}\n");
}

/// `{"add":ENTRY}` and its newline: a registration finished that was not begun in the journal.
pub(super) fn add(out: &mut Vec<u8>, path: &str, plugin: &RegisteredPlugin) {
    out.extend_from_slice(b"{\"add\":");
    entry(out, path, plugin, false);
    out.extend_from_slice(b"}\n");
}

/// `{"done":{"path":...,"generation":...}}` and its newline: the registration began finished.
pub(super) fn done(out: &mut Vec<u8>, path: &str, generation: Uuid) {
    let generation = generation.hyphenated();
    which(
        out,
        b"{\"done\":{\"path\":",
        path,
        generation.encode_lower(&mut Uuid::encode_buffer()),
    );
}

/// `{"remove":{"path":...,"generation":...}}` and its newline: the entry is gone.
pub(super) fn remove(out: &mut Vec<u8>, path: &str, generation: &str) {
    which(out, b"{\"remove\":{\"path\":", path, generation);
}

/// A line that names an entry only: `start` is its opening up to the path.
fn which(out: &mut Vec<u8>, start: &[u8], path: &str, generation: &str) {
    out.extend_from_slice(start);
    string(out, path);
    out.extend_from_slice(b",\"generation\":");
    string(out, generation);
    out.extend_from_slice(b"}}\n");
}

/// The snapshot up to its first entry; then [`entry`]s separated by commas, then
/// [`snapshot_end`].
pub(super) fn snapshot_start(out: &mut Vec<u8>, format: u32, root: &str) {
    out.extend_from_slice(b"{\"format\":");
    number(out, format);
    out.extend_from_slice(b",\"root\":");
    string(out, root);
    out.extend_from_slice(b",\"plugins\":[");
}

pub(super) fn snapshot_end(out: &mut Vec<u8>) {
    out.extend_from_slice(b"]}");
}

/// One entry: `plugin` registered from `path`; `unfinished` is the journal's record of it (not
/// the plugin's `interrupted`, which is what the previous agent left).
pub(super) fn entry(out: &mut Vec<u8>, path: &str, plugin: &RegisteredPlugin, unfinished: bool) {
    let (socket, info) = (&plugin.socket, &plugin.plugin);
    out.extend_from_slice(b"{\"path\":");
    string(out, path);
    out.extend_from_slice(b",\"generation\":\"");
    let generation = plugin.generation.hyphenated();
    out.extend_from_slice(
        generation
            .encode_lower(&mut Uuid::encode_buffer())
            .as_bytes(),
    );
    out.extend_from_slice(b"\",\"dev\":");
    number(out, socket.dev);
    out.extend_from_slice(b",\"ino\":");
    number(out, socket.ino);
    out.extend_from_slice(b",\"birth_ns\":");
    optional(out, socket.birth_ns);
    out.extend_from_slice(b",\"handle\":");
    optional(out, socket.handle);
    out.extend_from_slice(b",\"type\":");
    string(out, &info.plugin_type);
    out.extend_from_slice(b",\"name\":");
    string(out, &info.name);
    out.extend_from_slice(b",\"endpoint\":");
    string(out, &info.endpoint);
    out.extend_from_slice(b",\"versions\":[");
    for (i, version) in info.supported_versions.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        string(out, version);
    }
    out.extend_from_slice(b"],\"handler\":");
    match &plugin.handler {
        Some(handler) => string(out, &handler.describe()),
        None => out.extend_from_slice(b"null"),
    }
    out.extend_from_slice(b",\"registered_at_unix_ms\":");
    number(out, unix_ms(plugin.registered_at));
    if let Some(creator) = plugin.provenance.creator.process() {
        out.extend_from_slice(b",\"creator\":");
        process(out, creator);
    }
    if let Some(server) = plugin.provenance.server.as_deref() {
        out.extend_from_slice(b",\"server\":");
        process(out, server);
    }
    if unfinished {
        out.extend_from_slice(b",\"unfinished\":true");
    }
    out.push(b'}');
}

/// When an entry was registered, as the file holds it.
pub(super) fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A [`Process`]: the fields it knows, in its declared order (serde's, absent ones left out).
fn process(out: &mut Vec<u8>, process: &Process) {
    // Every field named: one added to `Process` (and so to its serde form) stops the build here.
    let Process {
        pid,
        uid,
        gid,
        command,
        cgroup,
        pidfs_ino,
    } = process;
    let mut object = Object::open(out);
    if let Some(pid) = pid {
        number(object.field(b"pid"), *pid);
    }
    if let Some(uid) = uid {
        number(object.field(b"uid"), *uid);
    }
    if let Some(gid) = gid {
        number(object.field(b"gid"), *gid);
    }
    if let Some(command) = command {
        string(object.field(b"command"), command);
    }
    if let Some(cgroup) = cgroup {
        self::cgroup(object.field(b"cgroup"), cgroup);
    }
    if let Some(pidfs_ino) = pidfs_ino {
        number(object.field(b"pidfs_ino"), *pidfs_ino);
    }
    object.close();
}

fn cgroup(out: &mut Vec<u8>, cgroup: &Cgroup) {
    let Cgroup {
        path,
        id,
        pod_uid,
        container_id,
    } = cgroup;
    let mut object = Object::open(out);
    string(object.field(b"path"), path);
    if let Some(id) = id {
        number(object.field(b"id"), *id);
    }
    if let Some(pod_uid) = pod_uid {
        string(object.field(b"pod_uid"), pod_uid);
    }
    if let Some(container_id) = container_id {
        string(object.field(b"container_id"), container_id);
    }
    object.close();
}

/// An object whose fields are each there or not: a comma before every field but the first.
struct Object<'a> {
    out: &'a mut Vec<u8>,
    empty: bool,
}

impl<'a> Object<'a> {
    fn open(out: &'a mut Vec<u8>) -> Object<'a> {
        out.push(b'{');
        Object { out, empty: true }
    }

    /// Writes `"key":` (a key is a constant with nothing to escape); the value goes after it.
    fn field(&mut self, key: &[u8]) -> &mut Vec<u8> {
        if !std::mem::replace(&mut self.empty, false) {
            self.out.push(b',');
        }
        self.out.push(b'"');
        self.out.extend_from_slice(key);
        self.out.extend_from_slice(b"\":");
        self.out
    }

    fn close(self) {
        self.out.push(b'}');
    }
}

fn number(out: &mut Vec<u8>, n: impl itoa::Integer) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

fn optional(out: &mut Vec<u8>, n: Option<impl itoa::Integer>) {
    match n {
        Some(n) => number(out, n),
        None => out.extend_from_slice(b"null"),
    }
}

/// A JSON string: copied whole when nothing in it needs escaping (paths, names, versions, cgroups
/// almost always), else escaped character by character as serde_json does.
fn string(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    // `fold`, not `any`: no early exit, so the check is vectorized.
    if s.bytes().fold(false, |escape, b| escape | needs_escape(b)) {
        escaped(out, s);
    } else {
        out.extend_from_slice(s.as_bytes());
    }
    out.push(b'"');
}

/// What JSON strings cannot hold as they are: control characters, the quote and the backslash.
/// (serde_json escapes nothing else: not DEL, nothing beyond ASCII.)
fn needs_escape(b: u8) -> bool {
    (b < 0x20) | (b == b'"') | (b == b'\\')
}

/// Serde_json's escapes: the short ones where JSON has them, else `\u00XX` in lowercase hex.
fn escaped(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for &b in s.as_bytes() {
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'\x08' => out.extend_from_slice(b"\\b"),
            b'\t' => out.extend_from_slice(b"\\t"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\x0c' => out.extend_from_slice(b"\\f"),
            b'\r' => out.extend_from_slice(b"\\r"),
            0..0x20 => out.extend_from_slice(&[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[usize::from(b >> 4)],
                HEX[usize::from(b & 0xf)],
            ]),
            _ => out.push(b),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::format::{Entry, Line};
    use super::*;
    use crate::handler::Plugin;
    use crate::handler::accept_all::AcceptAll;
    use crate::provenance::{Creator, Provenance};
    use crate::state::SocketId;
    use proptest::option;
    use proptest::prelude::*;
    use std::path::Path;
    use std::sync::Arc;
    use std::time::Duration;

    /// Any string, often with what JSON escapes in it.
    fn text() -> impl Strategy<Value = String> {
        let char = prop_oneof![
            4 => any::<char>(),
            1 => (0u8..0x20).prop_map(char::from),
            1 => prop::sample::select(vec!['"', '\\', '\u{7f}', '/', 'é', '\u{2028}']),
        ];
        prop::collection::vec(char, 0..40).prop_map(String::from_iter)
    }

    prop_compose! {
        fn cgroup()(
            path in text(),
            id in option::of(any::<u64>()),
            pod_uid in option::of(text()),
            container_id in option::of(text()),
        ) -> Cgroup {
            Cgroup {
                path: path.into(),
                id,
                pod_uid: pod_uid.map(Into::into),
                container_id: container_id.map(Into::into),
            }
        }
    }

    prop_compose! {
        fn process()(
            pid in option::of(any::<u32>()),
            uid in option::of(any::<u32>()),
            gid in option::of(any::<u32>()),
            command in option::of(text()),
            cgroup in option::of(cgroup()),
            pidfs_ino in option::of(any::<u64>()),
        ) -> Process {
            Process { pid, uid, gid, command: command.map(Into::into), cgroup: cgroup.map(Arc::new), pidfs_ino }
        }
    }

    prop_compose! {
        fn plugin()(
            plugin_type in text(),
            name in text(),
            endpoint in text(),
            supported_versions in prop::collection::vec(text(), 0..3),
            socket_path in text(),
        ) -> Plugin {
            Plugin { plugin_type, name, endpoint, supported_versions, socket_path }
        }
    }

    prop_compose! {
        fn registered()(
            generation in any::<u128>(),
            (dev, ino, birth_ns, handle) in (any::<u64>(), any::<u64>(), option::of(any::<i64>()), option::of(any::<u64>())),
            plugin in plugin(),
            handled in any::<bool>(),
            registered_at_ms in any::<u64>(),
            creator in option::of(process()),
            server in option::of(process()),
            interrupted in any::<bool>(),
        ) -> RegisteredPlugin {
            RegisteredPlugin {
                generation: Uuid::from_u128(generation),
                socket: SocketId { dev, ino, birth_ns, handle },
                plugin,
                handler: handled.then(|| Arc::new(AcceptAll) as Arc<dyn crate::handler::PluginHandler>),
                registered_at: SystemTime::UNIX_EPOCH + Duration::from_millis(registered_at_ms),
                provenance: Provenance {
                    creator: creator.map_or(Creator::NotReported, |p| Creator::Known(Arc::new(p))),
                    server: server.map(Arc::new),
                },
                interrupted,
            }
        }
    }

    /// What serde_json writes for `line`, with the journal's newline.
    fn serde_line(line: &Line<'_>) -> Vec<u8> {
        let mut bytes = serde_json::to_vec(line).expect("serializable");
        bytes.push(b'\n');
        bytes
    }

    fn written(write: impl FnOnce(&mut Vec<u8>)) -> String {
        let mut out = Vec::new();
        write(&mut out);
        String::from_utf8(out).expect("UTF-8")
    }

    proptest! {
        /// Byte for byte what serde_json wrote before (and an older agent writes): each reads
        /// the other's files.
        #[test]
        fn lines_and_snapshots_are_what_serde_json_writes(
            path in text(),
            registered in registered(),
            other in registered(),
            generation in text(),
            root in text(),
        ) {
            let of = |unfinished| {
                let mut entry = Entry::of(Path::new(&path), &registered).expect("UTF-8");
                entry.unfinished = unfinished;
                entry
            };
            let serde = |line: &Line<'_>| String::from_utf8(serde_line(line)).expect("UTF-8");
            prop_assert_eq!(written(|out| begin(out, &path, &registered)), serde(&Line::Begin(&of(true))));
            prop_assert_eq!(written(|out| add(out, &path, &registered)), serde(&Line::Add(&of(false))));
            let done_line = Line::Done { path: &path, generation: registered.generation.to_string() };
            prop_assert_eq!(written(|out| done(out, &path, registered.generation)), serde(&done_line));
            let remove_line = Line::Remove { path: &path, generation: generation.clone() };
            prop_assert_eq!(written(|out| remove(out, &path, &generation)), serde(&remove_line));

            #[derive(serde::Serialize)]
            struct Snapshot<'a> {
                format: u32,
                root: &'a str,
                plugins: Vec<Entry<'a>>,
            }
            let mut second = Entry::of(Path::new(&path), &other).expect("UTF-8");
            second.unfinished = true;
            let plugins = vec![of(false), second];
            let snapshot = Snapshot { format: super::super::FORMAT, root: &root, plugins };
            let mine = written(|out| {
                snapshot_start(out, super::super::FORMAT, &root);
                entry(out, &path, &registered, false);
                out.push(b',');
                entry(out, &path, &other, true);
                snapshot_end(out);
            });
            prop_assert_eq!(mine, serde_json::to_string(&snapshot).expect("serializable"));
        }
    }

    /// The whole-string check finds what needs escaping wherever it is, in strings of every length
    /// around the sizes it checks at once.
    #[test]
    fn an_escape_anywhere_in_a_string_is_found() {
        for len in 1..80 {
            for at in 0..len {
                for special in [0u8, b'\n', 0x1f, b'"', b'\\'] {
                    let mut bytes = vec![b'a'; len];
                    bytes[at] = special;
                    let s = String::from_utf8(bytes).expect("ASCII");
                    let json = written(|out| string(out, &s));
                    assert_eq!(json, serde_json::to_string(&s).expect("string"), "{s:?}");
                }
            }
        }
    }
}
