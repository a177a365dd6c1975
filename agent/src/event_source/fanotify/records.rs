//! The wire format of fanotify events in FID mode, parsed without trusting any length.
//!
//! ```text
//! read(2) buffer --Events--> Event { mask, pid, DirRecord { fsid, handle, name } } --> Reader
//! ```
//!
//! The kernel hands over a stream of `fanotify_event_metadata` headers, each followed by info
//! records; every length in them is checked before it is used, and a bad one is an error value.

use std::fmt;

/// `struct fanotify_event_metadata`: event_len u32, vers u8, reserved u8, metadata_len u16,
/// mask u64, fd i32, pid i32.
const METADATA_LEN: usize = 24;
/// `struct fanotify_event_info_header`: info_type u8, pad u8, len u16.
const INFO_HEADER_LEN: usize = 4;
/// Header, `__kernel_fsid_t` (8 bytes), `struct file_handle` header (handle_bytes u32,
/// handle_type i32); the handle bytes and, for `*_NAME` records, the name follow.
const FID_FIXED_LEN: usize = INFO_HEADER_LEN + 8 + 8;

/// One event, borrowing from the read buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Event<'a> {
    pub mask: u64,
    pub pid: i32,
    /// The directory record (`DFID_NAME`, `DFID`, or `FID`), if the event has one.
    pub dir: Option<DirRecord<'a>>,
}

/// A directory file handle and, for `DFID_NAME` records, the entry name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct DirRecord<'a> {
    pub fsid: [u8; 8],
    pub handle_type: i32,
    pub handle: &'a [u8],
    /// Without the terminating NUL; `"."` when the event is on the directory itself.
    pub name: Option<&'a [u8]>,
}

/// Why a buffer did not parse; the reader logs it and rescans.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Malformed {
    pub offset: usize,
    pub what: &'static str,
}

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} at byte {}", self.what, self.offset)
    }
}

/// A name the kernel could report for an entry of a directory: one path component.
pub(super) fn is_entry_name(name: &[u8]) -> bool {
    !name.is_empty() && name != b"." && name != b".." && !name.contains(&b'/')
}

/// Iterates over the events in one `read(2)` result. A malformed event yields an error and,
/// when its length is trustworthy, parsing resumes after it; otherwise iteration ends.
pub(super) struct Events<'a> {
    buf: &'a [u8],
    offset: usize,
}

impl<'a> Events<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Events { buf, offset: 0 }
    }

    fn stop(&mut self, what: &'static str) -> Malformed {
        let offset = self.offset;
        self.offset = self.buf.len();
        Malformed { offset, what }
    }
}

impl<'a> Iterator for Events<'a> {
    type Item = Result<Event<'a>, Malformed>;

    fn next(&mut self) -> Option<Self::Item> {
        let rest = self.buf.get(self.offset..)?;
        if rest.is_empty() {
            return None;
        }
        if rest.len() < METADATA_LEN {
            return Some(Err(self.stop("truncated event metadata")));
        }
        let event_len = u32_at(rest, 0) as usize;
        let version = rest[4];
        let metadata_len = u16_at(rest, 6) as usize;
        if version != libc::FANOTIFY_METADATA_VERSION {
            return Some(Err(self.stop("unknown fanotify metadata version")));
        }
        if metadata_len < METADATA_LEN || event_len < metadata_len || event_len > rest.len() {
            return Some(Err(self.stop("event length out of bounds")));
        }
        let start = self.offset;
        self.offset += event_len;
        let event = &rest[..event_len];
        let mask = u64_at(event, 8);
        let pid = i32_at(event, 20);
        match dir_record(&event[metadata_len..]) {
            Ok(dir) => Some(Ok(Event { mask, pid, dir })),
            Err((at, what)) => Some(Err(Malformed {
                offset: start + metadata_len + at,
                what,
            })),
        }
    }
}

/// Finds the first directory record among the info records of one event.
fn dir_record(mut records: &[u8]) -> Result<Option<DirRecord<'_>>, (usize, &'static str)> {
    let mut at = 0;
    let mut found = None;
    while !records.is_empty() {
        if records.len() < INFO_HEADER_LEN {
            return Err((at, "truncated info record header"));
        }
        let info_type = records[0];
        let len = u16_at(records, 2) as usize;
        if len < INFO_HEADER_LEN || len > records.len() {
            return Err((at, "info record length out of bounds"));
        }
        let record = &records[..len];
        let named = match info_type {
            libc::FAN_EVENT_INFO_TYPE_DFID_NAME => Some(true),
            libc::FAN_EVENT_INFO_TYPE_DFID | libc::FAN_EVENT_INFO_TYPE_FID => Some(false),
            _ => None, // pidfd, error, range...: not ours, skip
        };
        if let (Some(named), None) = (named, &found) {
            found = Some(fid_record(record, named).map_err(|what| (at, what))?);
        }
        records = &records[len..];
        at += len;
    }
    Ok(found)
}

fn fid_record(record: &[u8], named: bool) -> Result<DirRecord<'_>, &'static str> {
    if record.len() < FID_FIXED_LEN {
        return Err("truncated fid record");
    }
    let mut fsid = [0u8; 8];
    fsid.copy_from_slice(&record[4..12]);
    let handle_bytes = u32_at(record, 12) as usize;
    let handle_type = i32_at(record, 16);
    let after_handle = FID_FIXED_LEN
        .checked_add(handle_bytes)
        .filter(|end| *end <= record.len())
        .ok_or("file handle longer than its record")?;
    let handle = &record[FID_FIXED_LEN..after_handle];
    let name = if named {
        let tail = &record[after_handle..];
        let nul = tail
            .iter()
            .position(|b| *b == 0)
            .ok_or("entry name not NUL-terminated")?;
        Some(&tail[..nul])
    } else {
        None
    };
    Ok(DirRecord {
        fsid,
        handle_type,
        handle,
        name,
    })
}

// Callers check bounds first; the fixed-size copies cannot fail after that.
fn bytes<const N: usize>(buf: &[u8], at: usize) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&buf[at..at + N]);
    out
}

fn u16_at(buf: &[u8], at: usize) -> u16 {
    u16::from_ne_bytes(bytes(buf, at))
}

fn u32_at(buf: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes(bytes(buf, at))
}

fn i32_at(buf: &[u8], at: usize) -> i32 {
    i32::from_ne_bytes(bytes(buf, at))
}

fn u64_at(buf: &[u8], at: usize) -> u64 {
    u64::from_ne_bytes(bytes(buf, at))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds one event the way the kernel lays it out.
    fn event(mask: u64, pid: i32, records: &[Vec<u8>]) -> Vec<u8> {
        let body: Vec<u8> = records.concat();
        let len = (METADATA_LEN + body.len()) as u32;
        let mut out = Vec::new();
        out.extend_from_slice(&len.to_ne_bytes());
        out.push(libc::FANOTIFY_METADATA_VERSION);
        out.push(0);
        out.extend_from_slice(&(METADATA_LEN as u16).to_ne_bytes());
        out.extend_from_slice(&mask.to_ne_bytes());
        out.extend_from_slice(&libc::FAN_NOFD.to_ne_bytes());
        out.extend_from_slice(&pid.to_ne_bytes());
        out.extend_from_slice(&body);
        out
    }

    /// A fid record, padded to 4 bytes like the kernel does.
    fn fid(info_type: u8, handle: &[u8], name: Option<&[u8]>) -> Vec<u8> {
        let mut body = Vec::new();
        body.extend_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        body.extend_from_slice(&(handle.len() as u32).to_ne_bytes());
        body.extend_from_slice(&1i32.to_ne_bytes());
        body.extend_from_slice(handle);
        if let Some(name) = name {
            body.extend_from_slice(name);
            body.push(0);
        }
        while !(body.len() + INFO_HEADER_LEN).is_multiple_of(4) {
            body.push(0);
        }
        let mut out = vec![info_type, 0];
        out.extend_from_slice(&((body.len() + INFO_HEADER_LEN) as u16).to_ne_bytes());
        out.extend_from_slice(&body);
        out
    }

    fn parse(buf: &[u8]) -> Vec<Result<Event<'_>, Malformed>> {
        Events::new(buf).collect()
    }

    #[test]
    fn dfid_name_record_gives_handle_and_name() {
        let buf = event(
            libc::FAN_CREATE,
            42,
            &[fid(
                libc::FAN_EVENT_INFO_TYPE_DFID_NAME,
                &[9; 8],
                Some(b"a.sock"),
            )],
        );
        let events = parse(&buf);
        assert_eq!(events.len(), 1);
        let ev = events[0].as_ref().expect("parses");
        assert_eq!((ev.mask, ev.pid), (libc::FAN_CREATE, 42));
        let dir = ev.dir.as_ref().expect("dir record");
        assert_eq!(dir.fsid, [1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!((dir.handle_type, dir.handle), (1, &[9u8; 8][..]));
        assert_eq!(dir.name, Some(&b"a.sock"[..]));
    }

    #[test]
    fn several_events_in_one_read_all_parse() {
        let mut buf = event(
            libc::FAN_DELETE,
            1,
            &[fid(
                libc::FAN_EVENT_INFO_TYPE_DFID_NAME,
                &[1; 12],
                Some(b"x"),
            )],
        );
        buf.extend(event(libc::FAN_Q_OVERFLOW, 0, &[]));
        buf.extend(event(
            libc::FAN_DELETE_SELF | libc::FAN_ONDIR,
            2,
            &[fid(libc::FAN_EVENT_INFO_TYPE_DFID, &[2; 8], None)],
        ));
        let events: Vec<_> = parse(&buf)
            .into_iter()
            .map(|e| e.expect("parses"))
            .collect();
        assert_eq!(events.len(), 3);
        assert_eq!(events[1].mask, libc::FAN_Q_OVERFLOW);
        assert_eq!(events[1].dir, None);
        assert_eq!(events[2].dir.as_ref().and_then(|d| d.name), None);
    }

    #[test]
    fn unknown_records_are_skipped_and_first_dir_record_wins() {
        let pidfd = vec![libc::FAN_EVENT_INFO_TYPE_PIDFD, 0, 8, 0, 7, 0, 0, 0];
        let buf = event(
            libc::FAN_MOVED_TO,
            3,
            &[
                pidfd,
                fid(libc::FAN_EVENT_INFO_TYPE_DFID_NAME, &[3; 8], Some(b"first")),
                fid(
                    libc::FAN_EVENT_INFO_TYPE_DFID_NAME,
                    &[4; 8],
                    Some(b"second"),
                ),
            ],
        );
        let events = parse(&buf);
        let dir = events[0]
            .as_ref()
            .expect("parses")
            .dir
            .clone()
            .expect("dir");
        assert_eq!(dir.name, Some(&b"first"[..]));
    }

    #[test]
    fn truncated_metadata_is_malformed_and_stops() {
        let buf = event(libc::FAN_CREATE, 1, &[]);
        let events = parse(&buf[..10]);
        assert_eq!(events.len(), 1);
        assert!(events[0].is_err());
    }

    #[test]
    fn event_length_past_the_buffer_is_malformed() {
        let mut buf = event(libc::FAN_CREATE, 1, &[]);
        buf[0..4].copy_from_slice(&1000u32.to_ne_bytes());
        assert!(matches!(parse(&buf)[..], [Err(_)]));
    }

    #[test]
    fn zero_event_length_does_not_loop() {
        let mut buf = event(libc::FAN_CREATE, 1, &[]);
        buf[0..4].copy_from_slice(&0u32.to_ne_bytes());
        assert!(matches!(parse(&buf)[..], [Err(_)]));
    }

    #[test]
    fn wrong_version_is_malformed() {
        let mut buf = event(libc::FAN_CREATE, 1, &[]);
        buf[4] = 2;
        assert!(matches!(parse(&buf)[..], [Err(_)]));
    }

    #[test]
    fn record_length_past_the_event_is_malformed_but_next_event_parses() {
        let mut bad = event(
            libc::FAN_CREATE,
            1,
            &[fid(
                libc::FAN_EVENT_INFO_TYPE_DFID_NAME,
                &[1; 8],
                Some(b"a"),
            )],
        );
        bad[METADATA_LEN + 2..METADATA_LEN + 4].copy_from_slice(&500u16.to_ne_bytes());
        bad.extend(event(libc::FAN_Q_OVERFLOW, 0, &[]));
        let events = parse(&bad);
        assert_eq!(events.len(), 2);
        assert!(events[0].is_err());
        assert_eq!(events[1].as_ref().map(|e| e.mask), Ok(libc::FAN_Q_OVERFLOW));
    }

    #[test]
    fn zero_record_length_is_malformed() {
        let mut bad = event(
            libc::FAN_CREATE,
            1,
            &[fid(
                libc::FAN_EVENT_INFO_TYPE_DFID_NAME,
                &[1; 8],
                Some(b"a"),
            )],
        );
        bad[METADATA_LEN + 2..METADATA_LEN + 4].copy_from_slice(&0u16.to_ne_bytes());
        assert!(matches!(parse(&bad)[..], [Err(_)]));
    }

    #[test]
    fn handle_longer_than_record_is_malformed() {
        let mut bad = event(
            libc::FAN_CREATE,
            1,
            &[fid(
                libc::FAN_EVENT_INFO_TYPE_DFID_NAME,
                &[1; 8],
                Some(b"a"),
            )],
        );
        let at = METADATA_LEN + 12;
        bad[at..at + 4].copy_from_slice(&4096u32.to_ne_bytes());
        assert!(matches!(parse(&bad)[..], [Err(_)]));
    }

    #[test]
    fn name_without_nul_is_malformed() {
        let mut record = fid(libc::FAN_EVENT_INFO_TYPE_DFID_NAME, &[1; 8], Some(b"abc"));
        for b in record.iter_mut().skip(FID_FIXED_LEN + 8) {
            *b = b'z';
        }
        let buf = event(libc::FAN_CREATE, 1, &[record]);
        assert!(matches!(parse(&buf)[..], [Err(_)]));
    }

    #[test]
    fn entry_names_are_single_components() {
        assert!(is_entry_name(b"plugin.sock"));
        assert!(is_entry_name(b".hidden"));
        for bad in [&b""[..], b".", b"..", b"a/b"] {
            assert!(!is_entry_name(bad), "{bad:?}");
        }
    }
}
