//! The hostile cases of `cargo xtask hostile`: what each is, what the issue measured before it,
//! and what the agent needs for it.

/// One of issue 22's cases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Case {
    /// Item 1: 1,000 directories made by absolute path.
    Dirs,
    /// Item 2 (and 6): two threads binding and unlinking sockets while the canary starts.
    Flood,
    /// Item 3: 1,000 stale sockets and 300 servers that accept and hang up.
    Stale,
    /// Item 4: 1,000 slow connections to the metrics port from uid 65534.
    Metrics,
    /// Item 6: a tree 2,039 directories deep, walked by a safety pass every second.
    Deep,
    /// Item 10: a file system mounted over a sub-directory; the canary lives in it.
    Mount,
    /// Issue 44, item 1: another instance's `cleanup --all --force` while the agent runs.
    Pins,
    /// Issue 44, item 7: more socket names in the tree than the eBPF name table's room.
    Names,
}

impl Case {
    pub const ALL: [Case; 8] = [
        Case::Dirs,
        Case::Flood,
        Case::Stale,
        Case::Metrics,
        Case::Deep,
        Case::Mount,
        Case::Pins,
        Case::Names,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Case::Dirs => "dirs",
            Case::Flood => "flood",
            Case::Stale => "stale",
            Case::Metrics => "metrics",
            Case::Deep => "deep",
            Case::Mount => "mount",
            Case::Pins => "pins",
            Case::Names => "names",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Case::Dirs => "1,000 directories made by absolute path",
            Case::Flood => "2 threads binding/unlinking sockets for 30 s; canary 5 s in",
            Case::Stale => "1,000 stale sockets + 300 servers that accept and hang up",
            Case::Metrics => "1,000 slow metrics connections from uid 65534",
            Case::Deep => "a tree 2,039 directories deep, safety pass every 1 s, for 20 s",
            Case::Mount => "tmpfs mounted over a sub-directory, canary inside it",
            Case::Pins => "`cleanup --all --force` by another instance while the agent runs",
            Case::Names => {
                "17,000 bind-only sockets (beyond the eBPF name table's room), 30 s quiet"
            }
        }
    }

    /// What the issue measured before (its figures).
    pub fn before(self) -> &'static str {
        match self {
            Case::Dirs => "eBPF 53 s (1,000 dirs; 600: 10.9 s); others 5-11 ms",
            Case::Flood => "eBPF 31.4 s, after the flood; others 6.1-6.3 s; RSS 134-167 MB",
            Case::Stale => "28.5 s (1,000 stale); 22 s (3,000 hang-ups); every source",
            Case::Metrics => "dials fail (EMFILE), RSS ~400 MB, 3 live plugins deregistered",
            Case::Deep => "RSS 40 -> 139 MB over 6 minutes",
            Case::Mount => "missed until the 30 s safety pass",
            Case::Pins => "eBPF blind: 29.2-29.8 s (the safety pass), /readyz 200",
            Case::Names => "eBPF rescans for ever: 30.4 CPU s per 30 s; canary 35-125 ms",
        }
    }

    /// Agent flags the case needs beyond the defaults.
    pub fn agent_flags(self) -> &'static [&'static str] {
        match self {
            Case::Deep => &["--safety-period", "1s"],
            _ => &[],
        }
    }
}
