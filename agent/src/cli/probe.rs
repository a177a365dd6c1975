//! `plugin-agent probe`: what this node's kernel gives the agent, found without running it. Each
//! kernel feature the agent uses (and what it does without one), then each eBPF hook family
//! loaded through the verifier, attached and detached again: programs, instructions verified,
//! load time, or the kernel's refusal. For an operator deciding on a node, and for
//! `cargo xtask kernels`, which runs it on every kernel of its matrix.

use serde::Serialize;

use super::output::Output;
use super::render::print_table;
use crate::event_source::ebpf::{self, HookFamily};
use crate::kernel::{self, FentryFinding};

#[derive(Serialize)]
struct Report {
    kernel: String,
    machine: String,
    agent: &'static str,
    features: Vec<FeatureReport>,
    families: Vec<FamilyReport>,
}

#[derive(Serialize)]
struct FeatureReport {
    feature: &'static str,
    /// `true`, `false` or `unknown`.
    available: &'static str,
    since: &'static str,
    detail: String,
    without: &'static str,
}

/// One hook family. `family` and `loaded` come first: `cargo xtask kernels`' guest script looks
/// for `"family":"<name>","loaded":true` in the compact JSON.
#[derive(Serialize)]
struct FamilyReport {
    family: &'static str,
    loaded: bool,
    error: Option<String>,
    /// The whole load: BTF, object, verifier, attach.
    load_ms: f64,
    programs: Vec<ProgramReport>,
}

#[derive(Serialize)]
struct ProgramReport {
    name: String,
    load_ms: f64,
    /// What the verifier reports it walked (Linux 5.16+).
    verified_insns: Option<u32>,
}

/// Probes the kernel and prints the report; fails only when no hook family loads.
pub fn probe(output: Output) -> anyhow::Result<()> {
    let families: Vec<FamilyReport> = [HookFamily::Fentry, HookFamily::Tracepoints]
        .into_iter()
        .map(|family| family_report(ebpf::probe_family(family)))
        .collect();
    let fentry = match &families[0] {
        // Without the object nothing was tried on this kernel.
        _ if !cfg!(ebpf_object) => FentryFinding::NotTried,
        FamilyReport { loaded: true, .. } => FentryFinding::InUse,
        FamilyReport {
            error: Some(why), ..
        } => FentryFinding::Refused(why.clone()),
        _ => FentryFinding::NotTried,
    };
    let found = kernel::probe(fentry);
    let report = Report {
        kernel: found.release.clone(),
        machine: found.machine.clone(),
        agent: env!("CARGO_PKG_VERSION"),
        features: found
            .features
            .iter()
            .map(|f| FeatureReport {
                feature: f.name,
                available: f.availability.as_str(),
                since: f.since,
                detail: f.detail.clone(),
                without: f.without,
            })
            .collect(),
        families,
    };
    match output {
        // One line: a machine reads it.
        Output::Json => out!("{}", serde_json::to_string(&report)?),
        Output::Yaml => out_raw!("{}", serde_norway::to_string(&report)?),
        Output::Table => print_report(&report),
    }
    if !report.families.iter().any(|f| f.loaded) {
        anyhow::bail!("no eBPF hook family loads on this kernel: the agent would use fanotify");
    }
    Ok(())
}

fn family_report(probe: ebpf::FamilyProbe) -> FamilyReport {
    let family = match probe.family {
        HookFamily::Fentry => "fentry",
        HookFamily::Tracepoints => "tracepoints",
    };
    match probe.result {
        Ok(timings) => FamilyReport {
            family,
            loaded: true,
            error: None,
            load_ms: ms(timings.total()),
            programs: timings
                .programs
                .iter()
                .map(|(name, took, insns)| ProgramReport {
                    name: name.clone(),
                    load_ms: ms(*took),
                    verified_insns: *insns,
                })
                .collect(),
        },
        Err(error) => FamilyReport {
            family,
            loaded: false,
            // The reason, without the "no family is usable (... asked for Only(..)): <family>: "
            // the selection puts before it.
            error: Some(
                error
                    .split_once(&format!("{}: ", probe.family))
                    .map_or(error.as_str(), |(_, why)| why)
                    .to_owned(),
            ),
            load_ms: 0.0,
            programs: Vec::new(),
        },
    }
}

fn ms(took: std::time::Duration) -> f64 {
    took.as_secs_f64() * 1e3
}

fn print_report(report: &Report) {
    out!("kernel {} ({})", report.kernel, report.machine);
    let features: Vec<[String; 4]> = report
        .features
        .iter()
        .map(|f| {
            let note = if f.available == "true" {
                String::new()
            } else {
                format!("{}; without it: {}", f.detail, f.without)
            };
            [
                f.feature.to_string(),
                f.available.to_string(),
                f.since.to_string(),
                note,
            ]
        })
        .collect();
    print_table(&["FEATURE", "AVAILABLE", "SINCE", "NOTE"], &features);
    out!("");
    let families: Vec<[String; 4]> = report
        .families
        .iter()
        .map(|f| {
            let insns: u32 = f.programs.iter().filter_map(|p| p.verified_insns).sum();
            [
                f.family.to_string(),
                if f.loaded {
                    format!("{} programs", f.programs.len())
                } else {
                    "no".into()
                },
                if f.loaded {
                    format!("{:.0} ms, {insns} insns verified", f.load_ms)
                } else {
                    String::new()
                },
                f.error.clone().unwrap_or_default(),
            ]
        })
        .collect();
    print_table(&["HOOKS", "LOADED", "LOAD", "ERROR"], &families);
}
