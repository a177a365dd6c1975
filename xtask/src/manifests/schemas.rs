//! kubernetes-validate, the schema checker `cargo xtask manifests` runs: the Kubernetes minors
//! it is asked for (every one from the oldest the manifests claim to the newest it ships), its
//! install in a venv, and one document set's verdict against one minor.

use crate::shell;
use anyhow::{Context, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The oldest Kubernetes minor the manifests claim to deploy on; every newer one the validator
/// ships schemas for is checked too.
const OLDEST_CLAIMED: Minor = Minor {
    major: 1,
    minor: 30,
};

/// kubernetes-validate, pinned so that a PyPI release (new schemas, a new newest minor) changes
/// the result only when this line changes.
pub const VALIDATOR_VERSION: &str = "1.37.0";

/// A Kubernetes release line, e.g. 1.30.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub struct Minor {
    major: u32,
    minor: u32,
}

impl std::fmt::Display for Minor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// `1.30.0` (or `1.30`, `v1.30.0`) -> 1.30.
fn parse_minor(version: &str) -> Option<Minor> {
    let mut parts = version.trim().trim_start_matches('v').split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some(Minor { major, minor })
}

/// The minors to check: every one the validator ships from [`OLDEST_CLAIMED`] on. An error when
/// a claimed minor has no schemas (a validator too new to carry 1.30, or a gap): checking fewer
/// releases than we claim must not pass quietly.
pub fn claimed(shipped: &[&str]) -> Result<Vec<Minor>, String> {
    let mut minors: Vec<Minor> = shipped.iter().filter_map(|v| parse_minor(v)).collect();
    minors.sort();
    minors.dedup();
    let (Some(first), Some(newest)) = (minors.first().copied(), minors.last().copied()) else {
        return Err("it ships no Kubernetes schemas".into());
    };
    let wanted: Vec<Minor> = minors
        .into_iter()
        .filter(|m| *m >= OLDEST_CLAIMED)
        .collect();
    let missing: Vec<String> = (OLDEST_CLAIMED.minor..=newest.minor)
        .map(|minor| Minor {
            major: OLDEST_CLAIMED.major,
            minor,
        })
        .filter(|m| !wanted.contains(m))
        .map(|m| m.to_string())
        .collect();
    if wanted.is_empty() || !missing.is_empty() {
        return Err(format!(
            "it ships schemas for {first} to {newest}, without {} (we claim {OLDEST_CLAIMED} on)",
            if missing.is_empty() {
                OLDEST_CLAIMED.to_string()
            } else {
                missing.join(", ")
            }
        ));
    }
    Ok(wanted)
}

/// One validator run's verdict: the resources that passed (`kind/name`), or why it failed. It
/// passes only if it exits 0 and every line says a resource passed against exactly `minor`:
/// kubernetes-validate only warns, and exits 0, for an object it has no schema for (a mistyped
/// kind or apiVersion), and an empty document set validates nothing.
fn judge(success: bool, output: &str, minor: Minor) -> Result<Vec<String>, String> {
    let suffix = format!(" against version {minor}");
    let mut passed = Vec::new();
    let mut other = Vec::new();
    for line in output.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let resource = line
            .strip_prefix("INFO ")
            .and_then(|rest| rest.strip_suffix(&suffix))
            .and_then(|rest| rest.split_once(" passed for resource "))
            .map(|(_, resource)| resource.to_owned());
        match resource {
            Some(resource) => passed.push(resource),
            None => other.push(line),
        }
    }
    if !other.is_empty() {
        return Err(other.join("\n"));
    }
    if !success {
        return Err("kubernetes-validate failed without saying why".into());
    }
    if passed.is_empty() {
        return Err("no Kubernetes object in it".into());
    }
    Ok(passed)
}

/// Python code printing the installed kubernetes-validate's version, then every Kubernetes
/// version it ships schemas for (the list its own CLI picks the default from).
const PROBE: &str = "import importlib.metadata as m, kubernetes_validate.utils as u; \
                     print(m.version('kubernetes-validate')); print(*u.all_versions())";

/// kubernetes-validate [`VALIDATOR_VERSION`] in the venv at `venv`, installed unless it is there;
/// returns its command and the Kubernetes versions it ships schemas for.
pub fn validator(venv: &Path) -> anyhow::Result<(PathBuf, Vec<String>)> {
    let python = venv.join("bin/python");
    let probe = || -> Option<(String, Vec<String>)> {
        let output = Command::new(&python).args(["-c", PROBE]).output().ok()?;
        if !output.status.success() {
            return None;
        }
        let text = String::from_utf8_lossy(&output.stdout).into_owned();
        let mut lines = text.lines();
        let version = lines.next()?.trim().to_owned();
        let shipped = lines
            .next()?
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        Some((version, shipped))
    };
    let found = probe();
    let shipped = match found {
        Some((version, shipped)) if version == VALIDATOR_VERSION => shipped,
        _ => {
            let why = match &found {
                Some((version, _)) => format!("{version} is there"),
                None => "not there yet".into(),
            };
            eprintln!(
                "xtask: manifests: installing kubernetes-validate {VALIDATOR_VERSION} from PyPI \
                 into {} ({why})",
                venv.display()
            );
            if !python.exists() {
                shell::run(Command::new("python3").args(["-m", "venv"]).arg(venv)).context(
                    "creating the venv (on Debian's python3, `apt-get install python3-venv`)",
                )?;
            }
            shell::run(Command::new(&python).args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                &format!("kubernetes-validate=={VALIDATOR_VERSION}"),
            ]))?;
            match probe() {
                Some((version, shipped)) if version == VALIDATOR_VERSION => shipped,
                _ => bail!(
                    "kubernetes-validate {VALIDATOR_VERSION} does not import in {}",
                    venv.display()
                ),
            }
        }
    };
    Ok((venv.join("bin/kubernetes-validate"), shipped))
}

/// One set against one minor.
pub fn validate_one(validator: &Path, file: &str, minor: Minor) -> Result<Vec<String>, String> {
    let mut command = Command::new(validator);
    command
        .args(["--strict", "-k", &minor.to_string(), file])
        .current_dir(shell::workspace_root());
    let output = command
        .output()
        .map_err(|e| format!("cannot start {}: {e}", shell::display(&command)))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    judge(output.status.success(), &text, minor)
        .map_err(|why| format!("{why}\n  ({})", shell::display(&command)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(minor: u32) -> Minor {
        Minor { major: 1, minor }
    }

    #[test]
    fn claimed_minors_run_from_1_30_to_the_newest_shipped() {
        let shipped = ["1.25.0", "1.29.0", "1.30.0", "1.31.0", "1.32.0"];
        assert_eq!(claimed(&shipped), Ok(vec![m(30), m(31), m(32)]));
        // Minors compare as numbers: 1.100 is after 1.99, not between 1.10 and 1.11.
        assert_eq!(parse_minor("v1.100.2"), Some(m(100)));
        assert!(m(100) > m(99));
    }

    #[test]
    fn a_claimed_minor_without_schemas_is_an_error() {
        let error = claimed(&["1.31.0", "1.32.0"]).unwrap_err();
        assert!(error.contains("without 1.30"), "{error}");
        let error = claimed(&["1.30.0", "1.32.0"]).unwrap_err();
        assert!(error.contains("without 1.31"), "{error}");
        let error = claimed(&["1.25.0", "1.29.0"]).unwrap_err();
        assert!(error.contains("without 1.30"), "{error}");
        assert!(claimed(&[]).is_err());
    }

    #[test]
    fn only_resources_passed_against_the_asked_minor_pass() {
        let ok = "INFO deploy/base/daemonset.yaml passed for resource configmap/plugin-agent against \
                  version 1.30\nINFO deploy/base/daemonset.yaml passed for resource \
                  daemonset/plugin-agent against version 1.30\n";
        assert_eq!(
            judge(true, ok, m(30)),
            Ok(vec![
                "configmap/plugin-agent".into(),
                "daemonset/plugin-agent".into()
            ])
        );
        // A fallback to other schemas than the minor asked for is not a pass for it.
        assert!(judge(true, ok, m(31)).is_err());
        // No schema for a kind: kubernetes-validate warns and exits 0.
        let warned = "WARN x.yaml Couldn't find schema for kind Nope with api version v9 for \
                      kubernetes version 1.30";
        assert_eq!(judge(true, warned, m(30)), Err(warned.into()));
        let error = "ERROR x.yaml did not validate for resource configmap/x against version \
                     1.30: : Additional properties are not allowed ('bogus' was unexpected)";
        assert_eq!(judge(false, error, m(30)), Err(error.into()));
        assert!(judge(true, "", m(30)).is_err());
    }
}
