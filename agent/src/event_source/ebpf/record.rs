//! Turns one ring-buffer record into the [`FsEvent`] the watcher understands.
//!
//! ```text
//! ring buffer bytes --decode--> agent_ebpf::Event --translate(parent path)--> FsEvent
//! ```
//!
//! An exact event names its directory by kernel identity, which the caller maps back to the path it
//! watched; a name-only event becomes [`FsEvent::NameChanged`].

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use agent_ebpf::{DirKey, Event, NAME_LEN, kind, scope};

use crate::event_source::{FsEvent, Observed};
use crate::provenance::{Actor, Comm};

/// Reads an [`Event`] from a ring-buffer record, or `None` if the record is too short (an object
/// and agent from different builds). The kernel cuts a record after the name's used bytes (see
/// `submit` in agent-ebpf): what it left out is zeros, so the name stays NUL-terminated.
pub fn decode(bytes: &[u8]) -> Option<Event> {
    if bytes.len() < std::mem::offset_of!(Event, name) {
        return None;
    }
    let used = bytes.len().min(size_of::<Event>());
    let mut event = std::mem::MaybeUninit::<Event>::zeroed();
    // SAFETY: at most size_of::<Event>() bytes copied into the Event's own storage; Event is
    // `repr(C)` plain data for which every bit pattern (zeros included) is valid (aya::Pod).
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), event.as_mut_ptr().cast::<u8>(), used);
        Some(event.assume_init())
    }
}

/// The entry name an event carries.
pub fn name(event: &Event) -> &OsStr {
    let bytes = &event.name.bytes;
    let len = bytes.iter().position(|&b| b == 0).unwrap_or(NAME_LEN);
    OsStr::from_bytes(&bytes[..len])
}

/// What the watcher is told about `event`. `parent_path` maps a directory identity to the path the
/// watcher watches it under; `None` from it means the directory was unwatched since, and the event
/// is dropped (the watcher ignores paths outside its tree anyway). `parent_name` maps the name id
/// a name-only event may carry (see `agent_ebpf::Event::parent`) back to the name.
pub fn translate(
    event: &Event,
    parent_path: impl FnOnce(&DirKey) -> Option<PathBuf>,
    parent_name: impl FnOnce(u64) -> Option<OsString>,
) -> Option<FsEvent> {
    let name = name(event);
    if name.is_empty() || name == "." || name == ".." || name.as_bytes().contains(&b'/') {
        return None;
    }
    let observed = Observed {
        kernel_ns: Some(event.ktime_ns),
        read_ns: None,
        by: Some(Actor {
            pid: event.tgid,
            uid: Some(event.uid),
            gid: Some(event.gid),
            comm: Some(Comm(event.comm)),
            cgroup_id: Some(event.cgroup_id),
        }),
    };
    match event.scope {
        scope::EXACT => {
            let path = parent_path(&event.parent)?.join(Path::new(name));
            match event.kind {
                kind::BIND | kind::CREATE => Some(FsEvent::Created { path, observed }),
                kind::REMOVE => Some(FsEvent::Removed { path, observed }),
                kind::LISTEN | kind::RELEASE => Some(FsEvent::Serving {
                    path,
                    listening: event.kind == kind::LISTEN,
                    observed,
                }),
                kind::CONNECT => Some(FsEvent::Contacted { path, observed }),
                _ => None,
            }
        }
        scope::NAME_ONLY => Some(FsEvent::NameChanged {
            name: name.to_os_string(),
            parent: parent_name(event.parent.ino),
            observed,
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use agent_ebpf::NameKey;

    use super::*;

    fn event(kind: u32, scope: u32, name: &str) -> Event {
        Event {
            kind,
            scope,
            tgid: 42,
            name_len: name.len() as u32,
            uid: 1000,
            gid: 100,
            ktime_ns: 7,
            cgroup_id: 9,
            comm: *b"driver\0\0\0\0\0\0\0\0\0\0",
            parent: DirKey { dev: 1, ino: 2 },
            name: NameKey::new(name.as_bytes()).unwrap_or(NameKey {
                bytes: [0; NAME_LEN],
            }),
        }
    }

    fn no_name(_: u64) -> Option<OsString> {
        None
    }

    fn watched(key: &DirKey) -> Option<PathBuf> {
        (*key == DirKey { dev: 1, ino: 2 }).then(|| PathBuf::from("/plugins"))
    }

    /// When and by whom [`event`]'s records say the change was made.
    const AT_7: Observed = Observed {
        kernel_ns: Some(7),
        read_ns: None,
        by: Some(Actor {
            pid: 42,
            uid: Some(1000),
            gid: Some(100),
            comm: Some(Comm(*b"driver\0\0\0\0\0\0\0\0\0\0")),
            cgroup_id: Some(9),
        }),
    };

    #[test]
    fn exact_bind_becomes_created_under_the_watched_path() {
        assert_eq!(
            translate(&event(kind::BIND, scope::EXACT, "a.sock"), watched, no_name),
            Some(FsEvent::Created {
                path: "/plugins/a.sock".into(),
                observed: AT_7
            })
        );
    }

    #[test]
    fn exact_connect_becomes_contacted_by_the_caller() {
        assert_eq!(
            translate(
                &event(kind::CONNECT, scope::EXACT, "a.sock"),
                watched,
                no_name
            ),
            Some(FsEvent::Contacted {
                path: "/plugins/a.sock".into(),
                observed: AT_7
            })
        );
    }

    #[test]
    fn exact_unlink_becomes_removed() {
        assert_eq!(
            translate(
                &event(kind::REMOVE, scope::EXACT, "a.sock"),
                watched,
                no_name
            ),
            Some(FsEvent::Removed {
                path: "/plugins/a.sock".into(),
                observed: AT_7
            })
        );
    }

    #[test]
    fn name_only_unlink_becomes_name_changed() {
        assert_eq!(
            translate(
                &event(kind::REMOVE, scope::NAME_ONLY, "a.sock"),
                |_| None,
                no_name
            ),
            Some(FsEvent::NameChanged {
                name: "a.sock".into(),
                parent: None,
                observed: AT_7
            })
        );
    }

    #[test]
    fn name_only_event_names_its_parent_by_the_kernel_s_id() {
        let mut e = event(kind::CREATE, scope::NAME_ONLY, "d1");
        e.parent = DirKey { dev: 0, ino: 5 };
        let names = |id: u64| (id == 5).then(|| OsString::from("plugins"));
        assert_eq!(
            translate(&e, |_| None, names),
            Some(FsEvent::NameChanged {
                name: "d1".into(),
                parent: Some("plugins".into()),
                observed: AT_7
            })
        );
    }

    #[test]
    fn event_in_a_directory_no_longer_watched_is_dropped() {
        let mut e = event(kind::BIND, scope::EXACT, "a.sock");
        e.parent.ino = 3;
        assert_eq!(translate(&e, watched, no_name), None);
    }

    #[test]
    fn names_that_cannot_be_entries_are_dropped() {
        for bad in ["", ".", ".."] {
            assert_eq!(
                translate(&event(kind::BIND, scope::EXACT, bad), watched, no_name),
                None
            );
        }
    }

    /// An event with every field chosen by the fuzzer (the name too: any bytes, NUL or not).
    fn arbitrary_event() -> impl proptest::strategy::Strategy<Value = Event> {
        use proptest::prelude::*;
        (
            0u32..8,
            0u32..4,
            proptest::collection::vec(any::<u8>(), NAME_LEN),
            any::<bool>(),
            any::<u64>(),
        )
            .prop_map(|(kind, scope, name, in_watched, ino)| {
                let mut bytes = [0; NAME_LEN];
                bytes.copy_from_slice(&name);
                Event {
                    kind,
                    scope,
                    tgid: 1,
                    name_len: name.len() as u32,
                    uid: 0,
                    gid: 0,
                    ktime_ns: 7,
                    cgroup_id: 1,
                    comm: [0; 16],
                    parent: DirKey {
                        dev: 1,
                        ino: if in_watched { 2 } else { ino | 4 },
                    },
                    name: NameKey { bytes },
                }
            })
    }

    /// What a translated event may say: an entry directly below the watched directory, or a
    /// bare name (no `/`, not `.` or `..`).
    fn names_one_entry(translated: Option<FsEvent>) -> bool {
        let one_name = |name: &OsStr| {
            !name.is_empty() && name != "." && name != ".." && !name.as_bytes().contains(&b'/')
        };
        match translated {
            None | Some(FsEvent::Rescan { .. }) => true,
            Some(
                FsEvent::Created { path, .. }
                | FsEvent::Removed { path, .. }
                | FsEvent::Serving { path, .. }
                | FsEvent::Contacted { path, .. },
            ) => {
                path.parent() == Some(Path::new("/plugins"))
                    && path.file_name().is_some_and(one_name)
            }
            Some(FsEvent::NameChanged { name, .. }) => one_name(&name),
        }
    }

    proptest::proptest! {
        /// Whatever the ring buffer hands over (a record from another build, torn or hostile),
        /// decoding never panics and never reads past the record.
        #[test]
        fn arbitrary_ring_buffer_bytes_decode_without_panicking(
            bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..2 * size_of::<Event>())
        ) {
            let decoded = decode(&bytes);
            proptest::prop_assert_eq!(
                decoded.is_some(),
                bytes.len() >= std::mem::offset_of!(Event, name)
            );
            if let Some(event) = decoded {
                proptest::prop_assert!(names_one_entry(translate(&event, watched, no_name)));
            }
        }

        /// Any kind, scope, directory and name bytes: the watcher is only ever told about one
        /// entry directly inside a watched directory, or about a bare name.
        #[test]
        fn arbitrary_events_translate_to_one_entry_below_a_watched_directory(event in arbitrary_event()) {
            proptest::prop_assert!(names_one_entry(translate(&event, watched, no_name)));
        }
    }

    #[test]
    fn short_record_is_not_decoded() {
        assert!(decode(&[0u8; 8]).is_none());
        let bytes = [0u8; size_of::<Event>()];
        assert_eq!(decode(&bytes).map(|e| e.kind), Some(0));
    }

    /// The kernel writes a record up to its name's used bytes (rounded up to 8): decoded, it is
    /// the event it was cut from, whatever the name buffer held beyond.
    #[test]
    fn a_record_cut_after_its_name_is_the_whole_event() {
        fn bytes_of(event: &Event) -> &[u8] {
            // SAFETY: Event is repr(C) plain data without padding; its bytes are only compared.
            unsafe {
                std::slice::from_raw_parts((event as *const Event).cast::<u8>(), size_of::<Event>())
            }
        }
        let whole = event(kind::BIND, scope::EXACT, "plugin-with-a-long-name.sock");
        let cut = (std::mem::offset_of!(Event, name) + whole.name_len as usize + 7) & !7;
        assert!(cut < size_of::<Event>());
        let decoded = decode(&bytes_of(&whole)[..cut]).expect("a cut record decodes");
        assert_eq!(bytes_of(&decoded), bytes_of(&whole));
        assert_eq!(name(&decoded), "plugin-with-a-long-name.sock");
        assert_eq!(
            translate(&decoded, watched, no_name),
            translate(&whole, watched, no_name)
        );
    }
}
