//! The agent's own state files on disk: opened never through a link nor blocking on a FIFO,
//! read up to a bound, and replaced whole by a rename. Every file the journal touches goes
//! through here.

use anyhow::Context;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The snapshot goes to its file through a buffer this big, not whole from memory: with 10,000
/// plugins it is ~5 MB of JSON, which a burst's compactions built in memory (growing by
/// doubling) at the moment the agent's memory peaked.
const WRITE_BUFFER: usize = 64 * 1024;

/// The most the snapshot or the journal may hold, read: 64 MiB is a snapshot of over 100,000
/// registrations (an entry is ~500 bytes), more than a node's plugin directory holds. A larger
/// file is not this agent's (or was padded to exhaust its memory) and is refused whole.
pub(super) const MAX_FILE_BYTES: u64 = 64 << 20;

/// Opens one of the agent's own state files: never through a symbolic link (`O_NOFOLLOW`), never
/// blocking on a FIFO someone put there (`O_NONBLOCK`), and only a regular file.
pub(super) fn open_own_file(path: &Path, access: libc::c_int) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(access & libc::O_ACCMODE == libc::O_RDONLY)
        .write(access & libc::O_ACCMODE == libc::O_WRONLY)
        .append(access & libc::O_APPEND != 0)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "it is a symbolic link, which the agent never follows",
            ),
            _ => e,
        })?;
    if !file.metadata()?.file_type().is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "it is not a regular file",
        ));
    }
    Ok(file)
}

/// Reads one of the agent's own state files whole (see [`open_own_file`]), refusing one larger
/// than [`MAX_FILE_BYTES`] before reading any of it.
pub(super) fn read_own_file(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let file = open_own_file(path, libc::O_RDONLY)?;
    let size = file.metadata()?.len();
    if size > MAX_FILE_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "{size} bytes, more than the {} MiB a state file holds",
                MAX_FILE_BYTES >> 20
            ),
        ));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
    // A file that grows meanwhile is read up to the bound, and is then torn, as a kill leaves it.
    file.take(MAX_FILE_BYTES).read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// Writes what `write` writes to a temporary file beside `file` and renames it over `file`:
/// readers (the next agent) see the old content or the new, never a mix.
///
/// Not synced to disk, like the journal's lines: the state outlives the agent (a kill leaves the
/// page cache with it), not the node, whose plugins restart with it. An `fsync` here held the
/// journal's lock, and with it every registration beginning meanwhile, for as long as the disk
/// took to write ~5 MB (a runtime directory on a disk, not the default tmpfs). After a power loss a
/// short or empty file is unreadable: a warning, and every plugin registered again.
pub(super) fn write_atomically(
    file: &Path,
    write: impl FnOnce(&mut std::io::BufWriter<std::fs::File>) -> std::io::Result<()>,
) -> anyhow::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut tmp = file.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    // A file of its own, made here (`O_EXCL`): whatever was left at the name (a link, another
    // file's second name) is unlinked first, never written through.
    let _ = std::fs::remove_file(&tmp);
    let out = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .with_context(|| format!("cannot create {}", tmp.display()))?;
    let mut out = std::io::BufWriter::with_capacity(WRITE_BUFFER, out);
    write(&mut out)
        .and_then(|()| out.flush())
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, file)
        .with_context(|| format!("cannot rename {} to {}", tmp.display(), file.display()))
}
