//! The plugin's registration socket, in the steps a real plugin takes and a test may sit
//! between: bound (connections refused), listening (connections wait in the backlog), served
//! (see `serve`), and handed on to a successor process (the listener outlives its creator).

use nix::sys::socket::{AddressFamily, Backlog, SockFlag, SockType, UnixAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

/// The flag a successor process is told its inherited socket's descriptor with.
pub const SERVE_FD_FLAG: &str = "--serve-fd";

/// Binds `path` without listening (connecting is refused until [`listen`]). Parent directories
/// are created; an old socket at the path is replaced (as real plugins do), anything else there
/// is an error.
pub fn bind(path: &Path) -> std::io::Result<OwnedFd> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(path)?,
        Ok(_) => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ));
        }
        Err(_) => {}
    }
    let fd = nix::sys::socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    if path.as_os_str().len() < MAX_SUN_PATH {
        nix::sys::socket::bind(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
    } else {
        bind_long(&fd, path)?;
    }
    Ok(fd)
}

/// Bytes of a `sockaddr_un`'s path, its NUL included.
const MAX_SUN_PATH: usize = 108;

/// Binds `fd` at a path too long for a `sockaddr_un` (108 bytes or more), through its directory's
/// descriptor: `/proc/self/fd/N/<name>` is short, and the kernel resolves it to the directory.
/// The socket exists at `path`, where nothing can connect to it by name: what a plugin with too
/// long a path leaves (kubernetes #139166).
fn bind_long(fd: &OwnedFd, path: &Path) -> std::io::Result<()> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(std::io::Error::other(
            "a socket path needs a directory and a name",
        ));
    };
    let dir = std::fs::File::open(dir)?;
    let short = Path::new("/proc/self/fd")
        .join(dir.as_raw_fd().to_string())
        .join(name);
    nix::sys::socket::bind(fd.as_raw_fd(), &UnixAddr::new(&short)?)?;
    Ok(())
}

/// Listens on a bound socket with room for `backlog` waiting connections.
pub fn listen(fd: &OwnedFd, backlog: i32) -> std::io::Result<()> {
    let backlog = Backlog::new(backlog).unwrap_or(Backlog::MAXCONN);
    Ok(nix::sys::socket::listen(fd, backlog)?)
}

/// A listening socket, handed to tokio.
pub fn listener(fd: OwnedFd) -> std::io::Result<tokio::net::UnixListener> {
    let listener = std::os::unix::net::UnixListener::from(fd);
    listener.set_nonblocking(true)?;
    tokio::net::UnixListener::from_std(listener)
}

/// [`bind`], [`listen`] and [`listener`] at once.
pub fn bind_listening(path: &Path, backlog: i32) -> std::io::Result<tokio::net::UnixListener> {
    let fd = bind(path)?;
    listen(&fd, backlog)?;
    listener(fd)
}

/// The socket a predecessor handed this process as descriptor `fd` ([`SERVE_FD_FLAG`]).
///
/// # Safety
/// `fd` must be an open descriptor nothing else in this process owns.
pub unsafe fn inherited(fd: RawFd) -> OwnedFd {
    // SAFETY: the caller vouches that the descriptor is this process's to own.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// Starts a successor: this program again with `args` and `--serve-fd N`, where N is `socket`
/// (bound or listening, as it is), the one descriptor of it the successor inherits. Returns the
/// successor's pid; the caller then exits without removing the socket, which lives on in the
/// successor. A copy kept for a later hand-off is made with `OwnedFd::try_clone` (close-on-exec).
pub fn hand_off(socket: OwnedFd, args: &[String]) -> std::io::Result<u32> {
    use nix::fcntl::{FcntlArg, FdFlag, fcntl};
    fcntl(&socket, FcntlArg::F_SETFD(FdFlag::empty()))?;
    let exe = std::env::current_exe()?;
    let child = std::process::Command::new(exe)
        .args(args)
        .arg(SERVE_FD_FLAG)
        .arg(socket.as_raw_fd().to_string())
        .spawn()?;
    Ok(child.id())
}

/// Removes the socket at `path` if it is still the one of inode `ino` (a plugin that replaced
/// it keeps its own).
pub fn remove_own(path: &Path, ino: u64) {
    if let Ok(meta) = std::fs::symlink_metadata(path)
        && meta.file_type().is_socket()
        && meta.ino() == ino
    {
        let _ = std::fs::remove_file(path);
    }
}
