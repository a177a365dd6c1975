//! The measures, computed from the ledger once a run is over: per plugin (a CSV row each) and in
//! total (one JSON object).
//!
//! - registration latency: socket serving -> first `Notify(true)` the plugin received;
//! - deregistration latency: socket unlinked -> the agent's `deregistered` admin event;
//! - lost: a plugin that lived at least `lost_bound` while the agent was up, and was never
//!   registered;
//! - stale: a plugin gone (socket unlinked) that the agent still lists as registered after the
//!   run has waited `stale_bound` for deregistrations;
//! - duplicates: more than one `registered` admin event for one socket identity within one agent
//!   lifetime (every plugin instance has its own path; the restart scenario's new agent
//!   registering survivors again is the contract, not a duplicate).

use crate::ledger::{Ledger, PluginRecord};
use serde::Serialize;
use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::Path;

/// Latency distribution, microseconds.
#[derive(Debug, Default, Serialize)]
pub struct Latency {
    /// Samples.
    pub n: usize,
    /// Percentiles.
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
    /// 100 quantiles (1 %, 2 %, ... 100 %), for the CDF plot.
    pub cdf_us: Vec<u64>,
}

impl Latency {
    fn of(mut samples: Vec<u64>) -> Latency {
        samples.sort_unstable();
        let q = |p: f64| percentile(&samples, p);
        Latency {
            n: samples.len(),
            p50_us: q(50.0),
            p90_us: q(90.0),
            p99_us: q(99.0),
            max_us: samples.last().copied().unwrap_or(0),
            cdf_us: if samples.is_empty() {
                Vec::new()
            } else {
                (1..=100).map(|p| q(p as f64)).collect()
            },
        }
    }
}

/// Nearest-rank percentile of sorted samples.
fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Totals of a run.
#[derive(Debug, Default, Serialize)]
pub struct Totals {
    /// Plugin instances created (the warm-up one excluded).
    pub plugins: usize,
    /// Those that received `Notify(true)`.
    pub registered: usize,
    /// See the module docs.
    pub lost: usize,
    pub stale: usize,
    pub duplicates: usize,
    /// Plugins deregistered while still serving (before they were stopped): false
    /// deregistrations.
    pub early_deregistrations: usize,
    /// `Notify(false)` received (retried by the agent; not an error by itself).
    pub rejections: u64,
    /// Plugins that could not even be started (bind failed...).
    pub start_errors: usize,
    /// Admin events this run's subscriber missed (duplicates and deregistration latency are then
    /// lower bounds).
    pub admin_events_lagged: u64,
    /// First plugin serving -> last plugin's first `Notify(true)`, ms.
    pub all_registered_ms: f64,
    pub registration: Latency,
    pub deregistration: Latency,
    /// The restart scenarios' restart.
    pub restart: Option<RestartTotals>,
}

/// What an agent restart cost, and whom it bothered.
#[derive(Debug, Default, Serialize)]
pub struct RestartTotals {
    /// Signal sent -> the old agent gone, ms.
    pub stop_ms: f64,
    /// New agent spawned -> its admin API listening (discovery running), ms.
    pub start_ms: f64,
    /// Signal sent -> the new agent listening: the window no agent watched, ms.
    pub gap_ms: f64,

    /// Plugins registered before the signal and still serving when the new agent was up: nothing
    /// about them changed, so neither they nor their handler should hear from the new agent.
    pub survivors: usize,
    /// `Notify(true)` calls survivors received after the signal (each one also cost a GetInfo).
    pub survivor_plugin_calls: usize,
    /// Admin `registered` events for survivors from a later agent lifetime: each one is a
    /// handler `Register`.
    pub survivor_handler_calls: usize,
    /// The new agent's own account of its start (its `agent started` log line).
    pub start_phases: Option<super::agent::StartPhases>,
}

fn restart_totals(ledger: &Ledger, ids: &[u64]) -> Option<RestartTotals> {
    let restart = ledger.restarts.first()?;
    let ms = |from: u64, to: u64| to.saturating_sub(from) as f64 / 1e6;
    let mut totals = RestartTotals {
        stop_ms: ms(restart.signalled_ns, restart.spawned_ns),
        start_ms: ms(restart.spawned_ns, restart.ready_ns),
        gap_ms: ms(restart.signalled_ns, restart.ready_ns),
        start_phases: restart.phases,
        ..RestartTotals::default()
    };
    for p in ids.iter().filter_map(|id| ledger.plugins.get(id)) {
        let registered_before = p.notified.iter().any(|&at| at < restart.signalled_ns);
        let served_after = p.stopped_ns.is_none_or(|at| at > restart.ready_ns);
        if !(registered_before && served_after) {
            continue;
        }
        totals.survivors += 1;
        totals.survivor_plugin_calls += p
            .notified
            .iter()
            .filter(|&&at| at >= restart.signalled_ns)
            .count();
        totals.survivor_handler_calls += p
            .registered_events
            .iter()
            .filter(|(lifetime, _)| *lifetime > 0)
            .count();
    }
    Some(totals)
}

/// Computes the totals over plugins `ids` (the measured ones), and writes one CSV row per plugin
/// to `per_plugin` if given.
/// The per-plugin CSV file at `path`, its header written.
fn per_plugin_csv(path: &Path) -> anyhow::Result<std::io::BufWriter<std::fs::File>> {
    let mut file = std::io::BufWriter::new(std::fs::File::create(path)?);
    writeln!(
        file,
        "id,serving_ns,registration_us,stopped_ns,deregistration_us,notify_true,registered_events"
    )?;
    Ok(file)
}

/// From the plugin's stop to its first deregistration event after it, in µs.
fn deregistration_us(p: &PluginRecord) -> Option<u64> {
    p.stopped_ns.and_then(|stopped| {
        p.deregistered_events
            .iter()
            .filter(|&&at| at + 1_000_000 >= stopped) // same clock, a reading apart
            .min()
            .map(|&at| at.saturating_sub(stopped) / 1000)
    })
}

/// Registrations beyond the first within one agent lifetime: a handler must see at most one.
fn duplicate_registrations(p: &PluginRecord) -> usize {
    let mut per_lifetime: BTreeMap<u32, usize> = BTreeMap::new();
    for (lifetime, _) in &p.registered_events {
        *per_lifetime.entry(*lifetime).or_default() += 1;
    }
    per_lifetime.values().map(|n| n.saturating_sub(1)).sum()
}

/// A deregistration seen before the plugin stopped (same clock, a reading apart: an event within
/// 1 ms before the stop is the stop's).
fn early_deregistration(p: &PluginRecord) -> bool {
    let stopped = p.stopped_ns.unwrap_or(u64::MAX);
    p.deregistered_events
        .iter()
        .any(|&at| at.saturating_add(1_000_000) < stopped)
}

/// One plugin's row of the per-plugin CSV (see `per_plugin_csv`).
fn write_row(
    file: &mut impl Write,
    id: u64,
    p: &PluginRecord,
    reg_us: Option<u64>,
    dereg_us: Option<u64>,
) -> anyhow::Result<()> {
    let opt = |v: Option<u64>| v.map(|v| v.to_string()).unwrap_or_default();
    writeln!(
        file,
        "{id},{},{},{},{},{},{}",
        opt(p.serving_ns),
        opt(reg_us),
        opt(p.stopped_ns),
        opt(dereg_us),
        p.notified.len(),
        p.registered_events.len()
    )?;
    Ok(())
}

pub fn summarize(
    ledger: &Ledger,
    ids: impl Iterator<Item = u64>,
    still_registered: &HashSet<u64>,
    lost_bound_ns: u64,
    end_ns: u64,
    per_plugin: Option<&Path>,
) -> anyhow::Result<Totals> {
    let mut totals = Totals {
        admin_events_lagged: ledger.admin_lagged,
        ..Totals::default()
    };
    let mut reg = Vec::new();
    let mut dereg = Vec::new();
    let (mut first_serving, mut last_registered) = (u64::MAX, 0u64);
    let mut csv = per_plugin.map(per_plugin_csv).transpose()?;
    let empty = PluginRecord::default();
    let ids: Vec<u64> = ids.collect();
    totals.restart = restart_totals(ledger, &ids);
    for &id in &ids {
        let p = ledger.plugins.get(&id).unwrap_or(&empty);
        totals.plugins += 1;
        totals.rejections += u64::from(p.rejected);
        if p.error.is_some() {
            totals.start_errors += 1;
        }
        let first_notify = p.notified.iter().min().copied();
        let reg_us = match (p.serving_ns, first_notify) {
            (Some(s), Some(n)) => {
                totals.registered += 1;
                first_serving = first_serving.min(s);
                last_registered = last_registered.max(n);
                let us = n.saturating_sub(s) / 1000;
                reg.push(us);
                Some(us)
            }
            _ => None,
        };
        let dereg_us = deregistration_us(p);
        if let Some(us) = dereg_us {
            dereg.push(us);
        }
        if first_notify.is_none() && p.serving_ns.is_some() {
            let from = p.serving_ns.unwrap_or(0);
            let to = p.stopped_ns.unwrap_or(end_ns);
            if up_overlap(&ledger.agent_up, from, to, end_ns) >= lost_bound_ns {
                totals.lost += 1;
            }
        }
        if p.stopped_ns.is_some() && still_registered.contains(&id) {
            totals.stale += 1;
        }
        totals.duplicates += duplicate_registrations(p);
        if early_deregistration(p) {
            totals.early_deregistrations += 1;
        }
        if let Some(file) = csv.as_mut() {
            write_row(file, id, p, reg_us, dereg_us)?;
        }
    }
    if let Some(mut file) = csv {
        file.flush()?;
    }
    if last_registered > 0 {
        totals.all_registered_ms = last_registered.saturating_sub(first_serving) as f64 / 1e6;
    }
    totals.registration = Latency::of(reg);
    totals.deregistration = Latency::of(dereg);
    Ok(totals)
}

/// How long `[from, to)` overlaps the agent's up intervals, ns.
fn up_overlap(up: &[(u64, Option<u64>)], from: u64, to: u64, end_ns: u64) -> u64 {
    up.iter()
        .map(|&(a, b)| {
            let b = b.unwrap_or(end_ns);
            to.min(b).saturating_sub(from.max(a))
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let s: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&s, 50.0), 50);
        assert_eq!(percentile(&s, 99.0), 99);
        assert_eq!(percentile(&[], 99.0), 0);
    }

    #[test]
    fn restart_calls_count_only_survivors_and_only_after_the_signal() {
        use crate::ledger::Restart;
        let mut ledger = Ledger {
            restarts: vec![Restart {
                signalled_ns: 100,
                spawned_ns: 150,
                ready_ns: 200,
                phases: None,
                stopped_agent_cpu_ms: 0,
                signalled_agent_cpu_ms: 0,
                ready_agent_cpu_ms: 0,
            }],
            ..Ledger::default()
        };
        let plugin =
            |notified: Vec<u64>, stopped: Option<u64>, events: Vec<(u32, u64)>| PluginRecord {
                notified,
                stopped_ns: stopped,
                registered_events: events,
                ..PluginRecord::default()
            };
        // A survivor told again by the new agent (plugin and handler).
        ledger
            .plugins
            .insert(1, plugin(vec![10, 210], None, vec![(0, 10), (1, 210)]));
        // A survivor left alone.
        ledger
            .plugins
            .insert(2, plugin(vec![20], Some(300), vec![(0, 20)]));
        // Gone during the restart: not a survivor.
        ledger
            .plugins
            .insert(3, plugin(vec![30], Some(180), vec![(0, 30)]));
        // Registered only by the new agent: not a survivor.
        ledger
            .plugins
            .insert(4, plugin(vec![250], None, vec![(1, 250)]));
        let totals = restart_totals(&ledger, &[1, 2, 3, 4]).expect("a restart");
        assert_eq!(totals.survivors, 2);
        assert_eq!(totals.survivor_plugin_calls, 1);
        assert_eq!(totals.survivor_handler_calls, 1);
        assert_eq!(totals.gap_ms, 100.0 / 1e6);
    }

    #[test]
    fn overlap_counts_only_time_the_agent_was_up() {
        let up = [(0, Some(10)), (20, None)];
        assert_eq!(up_overlap(&up, 5, 25, 30), 10);
        assert_eq!(up_overlap(&up, 11, 19, 30), 0);
    }
}
