//! Which family of kernel hooks the programs run on, chosen at load time on the running kernel.
//!
//! ```text
//! HookChoice (EbpfOptions.hooks, or PLUGIN_AGENT_EBPF_HOOKS: auto | fentry | tracepoints)
//!   auto: fentry (sees dentries directly) --refused or not implemented--> syscall tracepoints
//!   --> Selection { family, passed_over: why each preferred family was not used } --> describe()
//! ```
//!
//! fentry/fexit on `vfs_*` see the dentry an operation acts on, so they need no path scan and no
//! name table: every path form lands on the parent directory's identity. But kernels may refuse
//! them by policy (EPERM at load, as on the build machine), lack BTF for the targets, or have VFS
//! signatures the programs do not know. Syscall tracepoints exist everywhere. Detection is the real
//! thing: the fentry/fexit event programs are loaded and attached; if any of them fails, those
//! already attached are detached and the tracepoint programs are used, and `describe()` (the
//! `status` command, the "event source open" log line) names the family and why the preferred one
//! was passed over.
//!
//! BPF LSM is not a family here: an LSM hook runs before the operation and cannot tell a failed
//! call from a successful one, and it attaches through the same trampoline as fentry/fexit, so a
//! kernel that allows it allows fexit too, which sees the result (docs/operations.md).

use std::fmt;

use anyhow::{Context, bail};
use aya::Ebpf;

/// Environment variable that sets [`HookChoice`] when [`EbpfOptions`](super::EbpfOptions) leaves it
/// unset: `auto`, `fentry` or `tracepoints`. For operators pinning a hook family, and for tests
/// that make the preferred family mandatory to prove the fallback to another event source.
pub const HOOKS_ENV: &str = "PLUGIN_AGENT_EBPF_HOOKS";

/// A family of kernel hooks the event programs can run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HookFamily {
    /// fentry/fexit on the VFS functions (`vfs_unlink`, `vfs_rename`, `vfs_mknod`, ...).
    Fentry,
    /// `syscalls/sys_enter_*` and `sys_exit_*` tracepoints.
    Tracepoints,
}

impl fmt::Display for HookFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            HookFamily::Fentry => "fentry/fexit",
            HookFamily::Tracepoints => "syscall tracepoints",
        })
    }
}

/// Which hook families the loader may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HookChoice {
    /// The best the kernel allows, in order: fentry, then syscall tracepoints.
    #[default]
    Auto,
    /// Exactly this family, or the eBPF source fails to open (and `--source auto` moves on).
    Only(HookFamily),
}

impl HookChoice {
    /// Reads [`HOOKS_ENV`]; unset or empty means [`HookChoice::Auto`].
    pub fn from_env() -> anyhow::Result<Self> {
        match std::env::var(HOOKS_ENV) {
            Err(std::env::VarError::NotPresent) => Ok(HookChoice::Auto),
            Ok(value) => value.parse(),
            Err(err) => Err(err).with_context(|| format!("{HOOKS_ENV} is not valid UTF-8")),
        }
    }

    fn candidates(self) -> &'static [HookFamily] {
        match self {
            HookChoice::Auto => &[HookFamily::Fentry, HookFamily::Tracepoints],
            HookChoice::Only(HookFamily::Fentry) => &[HookFamily::Fentry],
            HookChoice::Only(HookFamily::Tracepoints) => &[HookFamily::Tracepoints],
        }
    }
}

impl std::str::FromStr for HookChoice {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Self> {
        match s {
            "" | "auto" => Ok(HookChoice::Auto),
            "fentry" => Ok(HookChoice::Only(HookFamily::Fentry)),
            "tracepoints" => Ok(HookChoice::Only(HookFamily::Tracepoints)),
            other => bail!("{HOOKS_ENV}={other:?}: expected auto, fentry or tracepoints"),
        }
    }
}

/// The family chosen, and why each one preferred over it was not used.
#[derive(Debug, Clone)]
pub struct Selection {
    /// What the programs are attached to.
    pub family: HookFamily,
    /// `"<family>: <reason>"` for every family tried before `family`.
    pub passed_over: Vec<String>,
}

impl fmt::Display for Selection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "hooks: {}", self.family)?;
        if !self.passed_over.is_empty() {
            write!(f, " (passed over {})", self.passed_over.join("; "))?;
        }
        Ok(())
    }
}

impl Selection {
    /// What became of fentry/fexit: in use, passed over and why, or not tried.
    pub fn fentry(&self) -> crate::kernel::FentryFinding {
        use crate::kernel::FentryFinding;
        if self.family == HookFamily::Fentry {
            return FentryFinding::InUse;
        }
        let marker = format!("{}: ", HookFamily::Fentry);
        self.passed_over
            .iter()
            .find_map(|passed| passed.strip_prefix(&marker))
            .map_or(FentryFinding::NotTried, |why| {
                FentryFinding::Refused(why.to_owned())
            })
    }
}

/// [`Selection::fentry`] from a selection's [`Display`](fmt::Display) form, which is how the load
/// child hands it over.
pub fn fentry_finding(family: HookFamily, selection: &str) -> crate::kernel::FentryFinding {
    use crate::kernel::FentryFinding;
    if family == HookFamily::Fentry {
        return FentryFinding::InUse;
    }
    let marker = format!("{}: ", HookFamily::Fentry);
    match selection.split_once(&marker) {
        Some((_, why)) => {
            let why = why.strip_suffix(')').unwrap_or(why);
            FentryFinding::Refused(why.split("; ").next().unwrap_or(why).to_owned())
        }
        None => FentryFinding::NotTried,
    }
}

/// Attaches the first family in `choice` that the kernel allows: `attach` loads and attaches one
/// family's programs (returning the hooks attached), `detach` undoes a family that failed half way,
/// so a refused family leaves nothing behind.
pub fn select(
    ebpf: &mut Ebpf,
    choice: HookChoice,
    mut attach: impl FnMut(&mut Ebpf, HookFamily) -> anyhow::Result<Vec<String>>,
    mut detach: impl FnMut(&mut Ebpf, HookFamily),
) -> anyhow::Result<(Selection, Vec<String>)> {
    let mut passed_over = Vec::new();
    for &family in choice.candidates() {
        match attach(ebpf, family) {
            Ok(attached) => {
                let selection = Selection {
                    family,
                    passed_over,
                };
                return Ok((selection, attached));
            }
            Err(err) => {
                detach(ebpf, family);
                passed_over.push(format!("{family}: {err:#}"));
            }
        }
    }
    bail!(
        "no eBPF hook family is usable ({HOOKS_ENV} or options asked for {choice:?}): {}",
        passed_over.join("; ")
    )
}

/// What a kernel that refuses fentry/fexit by policy answers, said for operators.
pub const POLICY_REFUSAL: &str = "EPERM: fentry/fexit disallowed by policy on this node";

/// The errno behind a failed program load, if the kernel gave one.
pub fn errno(err: &aya::programs::ProgramError) -> Option<i32> {
    std::error::Error::source(err)
        .and_then(|cause| cause.downcast_ref::<std::io::Error>())
        .and_then(std::io::Error::raw_os_error)
}

/// Says what the kernel's refusal to load a BTF-typed (fentry/fexit) program means.
pub fn btf_program_error(
    program: &str,
    function: &str,
    err: aya::programs::ProgramError,
) -> anyhow::Error {
    let what = format!("{program} on {function}");
    match errno(&err) {
        Some(libc::EPERM) => anyhow::anyhow!("{what} refused by the kernel ({POLICY_REFUSAL})"),
        _ => anyhow::Error::new(err).context(format!("{what} cannot be loaded")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hook_choice_parses_what_operators_write() {
        assert_eq!("auto".parse::<HookChoice>().ok(), Some(HookChoice::Auto));
        assert_eq!("".parse::<HookChoice>().ok(), Some(HookChoice::Auto));
        assert_eq!(
            "fentry".parse::<HookChoice>().ok(),
            Some(HookChoice::Only(HookFamily::Fentry))
        );
        assert_eq!(
            "tracepoints".parse::<HookChoice>().ok(),
            Some(HookChoice::Only(HookFamily::Tracepoints))
        );
        let err = "kprobes".parse::<HookChoice>().map_err(|e| e.to_string());
        assert!(
            matches!(&err, Err(m) if m.contains("expected auto")),
            "{err:?}"
        );
    }

    #[test]
    fn a_selection_says_what_became_of_fentry() {
        use crate::kernel::FentryFinding;
        let refused = Selection {
            family: HookFamily::Tracepoints,
            passed_over: vec![format!("{}: {POLICY_REFUSAL}", HookFamily::Fentry)],
        };
        assert!(matches!(
            fentry_finding(HookFamily::Tracepoints, &refused.to_string()),
            FentryFinding::Refused(why) if why == POLICY_REFUSAL
        ));
        assert!(matches!(refused.fentry(), FentryFinding::Refused(why) if why == POLICY_REFUSAL));
        assert!(matches!(
            Selection {
                family: HookFamily::Fentry,
                passed_over: Vec::new()
            }
            .fentry(),
            FentryFinding::InUse
        ));
        let only_tracepoints = Selection {
            family: HookFamily::Tracepoints,
            passed_over: Vec::new(),
        };
        assert!(matches!(
            fentry_finding(HookFamily::Tracepoints, &only_tracepoints.to_string()),
            FentryFinding::NotTried
        ));
        assert!(matches!(
            fentry_finding(HookFamily::Fentry, "hooks: fentry/fexit (adopted)"),
            FentryFinding::InUse
        ));
    }

    #[test]
    fn auto_prefers_fentry_and_ends_with_tracepoints() {
        assert_eq!(
            HookChoice::Auto.candidates(),
            &[HookFamily::Fentry, HookFamily::Tracepoints]
        );
    }
}
