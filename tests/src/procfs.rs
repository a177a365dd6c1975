//! What the kernel says about a running process (`/proc/<pid>/status`): its capability sets and
//! its resident memory, for least-privilege and bounded-memory assertions.

/// The capability sets of a process, as bit masks (bit n = capability number n).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// `CapEff`.
    pub effective: u64,
    /// `CapPrm`.
    pub permitted: u64,
    /// `CapInh`.
    pub inheritable: u64,
    /// `CapBnd`.
    pub bounding: u64,
    /// `CapAmb`.
    pub ambient: u64,
}

/// `CAP_DAC_OVERRIDE` (1): what the agent keeps after start.
pub const DAC_OVERRIDE: u64 = 1 << 1;

fn status(pid: u32) -> std::io::Result<String> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
}

fn field<'a>(status: &'a str, name: &str) -> Option<&'a str> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
}

/// The capability sets of `pid`.
pub fn caps(pid: u32) -> std::io::Result<Caps> {
    let status = status(pid)?;
    let mask = |name: &str| {
        field(&status, name)
            .and_then(|hex| u64::from_str_radix(hex, 16).ok())
            .unwrap_or(u64::MAX)
    };
    Ok(Caps {
        effective: mask("CapEff"),
        permitted: mask("CapPrm"),
        inheritable: mask("CapInh"),
        bounding: mask("CapBnd"),
        ambient: mask("CapAmb"),
    })
}

/// Resident set size of `pid` in KiB (`VmRSS`).
pub fn rss_kib(pid: u32) -> std::io::Result<u64> {
    let status = status(pid)?;
    field(&status, "VmRSS")
        .and_then(|v| v.trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no VmRSS for {pid}")))
}

/// Highest resident set size of `pid` so far in KiB (`VmHWM`).
pub fn peak_rss_kib(pid: u32) -> std::io::Result<u64> {
    let status = status(pid)?;
    field(&status, "VmHWM")
        .and_then(|v| v.trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no VmHWM for {pid}")))
}

/// Open file descriptors of `pid` (sockets and connections included).
pub fn open_fds(pid: u32) -> std::io::Result<usize> {
    Ok(std::fs::read_dir(format!("/proc/{pid}/fd"))?.count())
}
