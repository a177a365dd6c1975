//! What the agent costs, read from `/proc`: CPU time, resident memory and wake-ups.
//!
//! Wake-ups are counted as context switches summed over every thread of the process
//! (`/proc/<pid>/task/*/status`): a thread that sleeps and is woken switches out once per
//! wake-up (voluntary), and preemptions are counted too (involuntary). `/proc/<pid>/status` alone
//! would count the main thread only, which in a tokio agent mostly sleeps in `block_on`.

use serde::Serialize;
use std::time::Instant;

/// One reading.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    at: Instant,
    cpu_ticks: u64,
    /// Resident set now, KiB.
    pub rss_kib: u64,
    /// Peak resident set since start, KiB.
    pub rss_peak_kib: u64,
    switches: u64,
}

/// The difference between two readings.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Usage {
    /// Wall time between the readings, ms.
    pub wall_ms: u64,
    /// User + system CPU time, ms.
    pub cpu_ms: u64,
    /// Context switches, all threads.
    pub wakeups: u64,
    /// `wakeups` per second of wall time.
    pub wakeups_per_s: f64,
    /// Resident set at the second reading, KiB.
    pub rss_kib: u64,
    /// Peak resident set at the second reading, KiB.
    pub rss_peak_kib: u64,
}

impl Sample {
    /// User + system CPU time the process had spent at this reading, ms.
    pub fn cpu_ms(&self) -> u64 {
        ticks_to_ms(self.cpu_ticks)
    }
}

fn ticks_to_ms(ticks: u64) -> u64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    ticks * 1000 / hz
}

/// User + system CPU time of this process's children it has reaped so far, ms
/// (`getrusage(RUSAGE_CHILDREN)`). `/proc` forgets a process once it is reaped: the difference
/// across the wait for one agent's exit is that agent's whole CPU, its shutdown included.
pub fn reaped_children_cpu_ms() -> u64 {
    // SAFETY: an all-zero rusage is a valid value to be overwritten.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `usage` is a valid, writable rusage.
    if unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) } != 0 {
        return 0;
    }
    let ms = |t: libc::timeval| (t.tv_sec.max(0) as u64) * 1000 + (t.tv_usec.max(0) as u64) / 1000;
    ms(usage.ru_utime) + ms(usage.ru_stime)
}

/// Reads process `pid` now.
pub fn sample(pid: u32) -> std::io::Result<Sample> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may contain spaces and parentheses): state is the
    // first, utime the 12th, stime the 13th, cutime and cstime the 14th and 15th (fields 14 to
    // 17 of proc(5)): the CPU of children the agent has reaped (the eBPF source's loading child)
    // is the agent's too.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let field = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let cpu_ticks = field(11) + field(12) + field(13) + field(14);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let mut switches = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))?.flatten() {
        // A thread may exit between listing and reading: skip it.
        let Ok(status) = std::fs::read_to_string(task.path().join("status")) else {
            continue;
        };
        for line in status.lines() {
            if let Some(v) = line
                .strip_prefix("voluntary_ctxt_switches:")
                .or_else(|| line.strip_prefix("nonvoluntary_ctxt_switches:"))
            {
                switches += v.trim().parse::<u64>().unwrap_or(0);
            }
        }
    }
    Ok(Sample {
        at: Instant::now(),
        cpu_ticks,
        rss_kib: kib("VmRSS:"),
        rss_peak_kib: kib("VmHWM:"),
        switches,
    })
}

impl Sample {
    /// Context switches, all threads, at this reading.
    pub fn switches(&self) -> u64 {
        self.switches
    }

    /// What happened between `earlier` and this reading.
    pub fn since(&self, earlier: &Sample) -> Usage {
        let wall = self.at.saturating_duration_since(earlier.at);
        let wakeups = self.switches.saturating_sub(earlier.switches);
        Usage {
            wall_ms: wall.as_millis() as u64,
            cpu_ms: ticks_to_ms(self.cpu_ticks.saturating_sub(earlier.cpu_ticks)),
            wakeups,
            wakeups_per_s: wakeups as f64 / wall.as_secs_f64().max(1e-9),
            rss_kib: self.rss_kib,
            rss_peak_kib: self.rss_peak_kib,
        }
    }
}
