//! What each guest of `cargo xtask kernels` recorded, read back from its files, and the table
//! made of it.

use super::matrix::{FAMILIES, Row, SUITES, in_run};
use crate::vm;
use std::fmt::Write as _;
use std::fs;
use std::path::Path;
use std::time::Duration;

/// What one row's guest recorded.
pub struct RowResult {
    pub row: Row,
    pub package: String,
    /// The probe's report, when the guest got that far.
    pub probe: Option<serde_json::Value>,
    /// (run label, exit code or None when it never ran, tests passed, tests failed)
    pub runs: Vec<SuiteRun>,
    /// Set when the row could not even boot.
    pub broken: Option<String>,
    /// CI's share was run (see `Options::ci`).
    pub ci: bool,
    pub took: Duration,
}

pub struct SuiteRun {
    pub label: String,
    pub family: String,
    pub status: Option<String>,
    pub passed: usize,
    pub failed: usize,
}

impl RowResult {
    pub fn broken(row: &Row, why: String, took: Duration) -> Self {
        RowResult {
            row: *row,
            package: String::new(),
            probe: None,
            runs: Vec::new(),
            broken: Some(why),
            ci: false,
            took,
        }
    }

    /// A row's last recorded run, if it has one.
    pub fn recorded(row: &Row, dir: &Path) -> Self {
        let work = dir.join(row.label());
        let record = fs::read_to_string(work.join("row.json"))
            .ok()
            .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok());
        match record {
            Some(record) => RowResult::read(
                row,
                record["package"].as_str().unwrap_or_default(),
                &work,
                (
                    record["ci"] == true,
                    &serde_json::from_value::<Vec<String>>(record["suites"].clone())
                        .unwrap_or_default(),
                    record["probe_only"] == true,
                ),
                Duration::from_secs(record["took_secs"].as_u64().unwrap_or_default()),
            ),
            None => RowResult::broken(row, "not run yet".into(), Duration::ZERO),
        }
    }

    /// The row's results in `work`. `run`: whether CI's share was run, the suites chosen (none:
    /// all; a suite not chosen counts only when an earlier run left its results), and whether the
    /// probe alone ran.
    pub fn read(
        row: &Row,
        package: &str,
        work: &Path,
        run: (bool, &[String], bool),
        took: Duration,
    ) -> Self {
        let (ci, chosen, probe_only) = run;
        let probe = fs::read_to_string(work.join("probe.json"))
            .ok()
            .and_then(|text| serde_json::from_str(&text).ok());
        let mut runs = Vec::new();
        for suite in SUITES
            .iter()
            .filter(|suite| in_run(suite, ci) && !probe_only)
        {
            let families: &[&str] = if suite.per_family {
                FAMILIES
            } else {
                &["auto"]
            };
            let chosen = chosen.is_empty() || chosen.iter().any(|name| name == suite.label);
            let left = families
                .iter()
                .any(|family| vm::status(work, &format!("{}-{family}", suite.label)).is_some());
            if !chosen && !left {
                continue;
            }
            for family in families {
                let label = format!("{}-{family}", suite.label);
                let log = fs::read_to_string(work.join(format!("{label}.log"))).unwrap_or_default();
                let (passed, failed) = test_counts(&log);
                runs.push(SuiteRun {
                    status: vm::status(work, &label),
                    label,
                    family: (*family).to_owned(),
                    passed,
                    failed,
                });
            }
        }
        RowResult {
            row: *row,
            package: package.to_owned(),
            probe,
            runs,
            broken: None,
            ci,
            took,
        }
    }

    /// The probe's report of one family.
    pub fn family(&self, family: &str) -> Option<&serde_json::Value> {
        self.probe.as_ref()?["families"]
            .as_array()?
            .iter()
            .find(|f| f["family"] == family)
    }

    pub fn loaded(&self, family: &str) -> bool {
        self.family(family).is_some_and(|f| f["loaded"] == true)
    }

    /// A row passes when the probe ran, at least one family loaded, and every run that should
    /// have run (each loadable family's, and the agent's own) ran and passed.
    pub fn passed(&self) -> bool {
        self.broken.is_none()
            && self.probe.is_some()
            && FAMILIES.iter().any(|f| self.loaded(f))
            && self
                .runs
                .iter()
                .all(|run| !self.expected(run) || run.status.as_deref() == Some("0"))
    }

    /// Whether `run` should have run: the agent's own choice always; a family's run where the
    /// family loads (in CI, only the family the agent picks).
    pub fn expected(&self, run: &SuiteRun) -> bool {
        run.family == "auto"
            || (self.loaded(&run.family)
                && (!self.ci || self.chosen() == Some(run.family.as_str())))
    }

    pub fn failure(&self) -> String {
        if let Some(why) = &self.broken {
            return why.clone();
        }
        if self.probe.is_none() {
            return "the probe reported nothing (see probe.stderr)".into();
        }
        if !FAMILIES.iter().any(|f| self.loaded(f)) {
            return "no hook family loaded".into();
        }
        self.runs
            .iter()
            .filter(|run| self.expected(run) && run.status.as_deref() != Some("0"))
            .map(|run| match &run.status {
                Some(code) => format!("{} exited {code}", run.label),
                None => format!("{} never finished", run.label),
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// `test result: ok. 28 passed; 0 failed; ...` lines, summed.
pub fn test_counts(log: &str) -> (usize, usize) {
    let mut passed = 0;
    let mut failed = 0;
    for line in log.lines() {
        let Some(rest) = line.trim().strip_prefix("test result: ") else {
            continue;
        };
        for part in rest.split(['.', ';']) {
            let mut words = part.split_whitespace();
            match (words.next().map(str::parse::<usize>), words.next()) {
                (Some(Ok(n)), Some("passed")) => passed += n,
                (Some(Ok(n)), Some("failed")) => failed += n,
                _ => {}
            }
        }
    }
    (passed, failed)
}

/// The matrix as one Markdown table: one line per kernel and hook family.
pub fn table(results: &[RowResult]) -> String {
    let mut out = String::from(
        "| kernel | arch | hook family | programs loaded | verifier (insns, load) | suites passed/failed | what fell back |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for result in results {
        let kernel = result
            .probe
            .as_ref()
            .and_then(|p| p["kernel"].as_str())
            .map_or_else(|| result.package.clone(), str::to_owned);
        if let Some(why) = &result.broken {
            let _ = writeln!(
                out,
                "| {} | {} | - | - | - | did not boot | {} |",
                result.row.series,
                result.row.arch.uname(),
                why.replace('|', "/").replace('\n', " ")
            );
            continue;
        }
        for family in FAMILIES {
            family_row(&mut out, result, family, &kernel);
        }
    }
    out.push('\n');
    for result in results {
        let _ = writeln!(
            out,
            "- {} {}: {} as on {}; boot and suites {} s under emulation.",
            result.row.series,
            result.row.arch.uname(),
            if result.package.is_empty() {
                "no package"
            } else {
                &result.package
            },
            result.row.nodes,
            result.took.as_secs()
        );
    }
    out
}

/// One row of the table: what `family` did on `result`'s kernel.
pub fn family_row(out: &mut String, result: &RowResult, family: &'static str, kernel: &str) {
    let report = result.family(family);
    let programs = report
        .and_then(|f| f["programs"].as_array())
        .map(|p| p.len())
        .unwrap_or(0);
    let insns: u64 = report
        .and_then(|f| f["programs"].as_array())
        .map(|p| p.iter().filter_map(|p| p["verified_insns"].as_u64()).sum())
        .unwrap_or(0);
    let load_ms = report.and_then(|f| f["load_ms"].as_f64()).unwrap_or(0.0);
    let verifier = if !result.loaded(family) {
        "-".to_owned()
    } else if insns > 0 {
        format!("{insns}, {load_ms:.0} ms")
    } else {
        format!("not reported (< 5.16), {load_ms:.0} ms")
    };
    let suites: Vec<String> = result
        .runs
        .iter()
        .filter(|run| {
            run.family == family || (run.family == "auto" && result.chosen() == Some(family))
        })
        .map(|run| match &run.status {
            Some(code) if code == "0" => format!("{} {}/0", run.label, run.passed),
            Some(_) => format!("{} {}/{} FAILED", run.label, run.passed, run.failed),
            None if result.expected(run) => {
                format!("{} never finished", run.label)
            }
            None => format!("{} not run", run.label),
        })
        .collect();
    let fell_back = if result.loaded(family) {
        result.degraded()
    } else {
        let why = report
            .and_then(|f| f["error"].as_str())
            .unwrap_or("no report");
        format!("{family} unavailable: {}", why.replace('|', "/"))
    };
    let _ = writeln!(
        out,
        "| {kernel} | {} | {family} | {} | {verifier} | {} | {fell_back} |",
        result.row.arch.uname(),
        if result.loaded(family) {
            programs.to_string()
        } else {
            "0".into()
        },
        if suites.is_empty() {
            "-".to_owned()
        } else {
            suites.join("; ")
        },
    );
}

impl RowResult {
    /// The family the agent picks on its own (`auto`).
    pub fn chosen(&self) -> Option<&'static str> {
        FAMILIES.iter().copied().find(|f| self.loaded(f))
    }

    /// The kernel features other than fentry the probe found missing.
    pub fn degraded(&self) -> String {
        let missing: Vec<String> = self
            .probe
            .as_ref()
            .and_then(|p| p["features"].as_array())
            .map(|features| {
                // fentry has its own row; the others by name (docs/operations.md says what
                // each costs).
                features
                    .iter()
                    .filter(|f| f["available"] == "false" && f["feature"] != "fentry")
                    .map(|f| format!("no {}", f["feature"].as_str().unwrap_or("?")))
                    .collect()
            })
            .unwrap_or_default();
        if missing.is_empty() {
            "nothing".into()
        } else {
            missing.join("; ")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_every_test_result_line() {
        let log = "test result: ok. 28 passed; 0 failed; 2 ignored; 0 measured; 0 filtered out\n\
                   test result: FAILED. 3 passed; 1 failed; 0 ignored; 0 measured; 5 filtered out\n";
        assert_eq!(test_counts(log), (31, 1));
    }
}
