//! Which family of kernel hooks the programs run on, chosen at load time on the running kernel.
//!
//! ```text
//! HookChoice (EbpfOptions.hooks, or PLUGIN_AGENT_EBPF_HOOKS: auto | fentry | tracepoints)
//!   auto: fentry (sees dentries directly) --refused or not implemented--> syscall tracepoints
//!   --> Selection { family, passed_over: why each preferred family was not used } --> describe()
//! ```
//!
//! fentry/fexit on `vfs_*` (and BPF LSM) see the dentry an operation acts on, so they need no path
//! scan and no per-thread parking between entry and exit; but kernels may refuse them by policy
//! (EPERM at load, as on the build machine) or lack BTF for the target. Syscall tracepoints exist
//! everywhere. Detection loads a minimal fentry program on `vfs_unlink`; this build implements the
//! event programs on syscall tracepoints only, so a kernel that accepts fentry still gets
//! tracepoints, and `describe()` says so.

use std::fmt;

use anyhow::{Context, bail};
use aya::Ebpf;
use aya::programs::FEntry;

/// Environment variable that sets [`HookChoice`] when [`EbpfOptions`](super::EbpfOptions) leaves it
/// unset: `auto`, `fentry` or `tracepoints`. For operators pinning a hook family, and for tests
/// that make the preferred family mandatory to prove the fallback to another event source.
pub const HOOKS_ENV: &str = "PLUGIN_AGENT_EBPF_HOOKS";

/// Program the fentry probe loads, and the kernel function it targets.
const FENTRY_PROBE: &str = "fentry_probe";
const FENTRY_PROBE_TARGET: &str = "vfs_unlink";

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
            HookFamily::Fentry => "fentry",
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

/// Picks the first family in `choice` that the kernel allows and this build implements.
pub fn select(ebpf: &mut Ebpf, choice: HookChoice) -> anyhow::Result<Selection> {
    let mut passed_over = Vec::new();
    for &family in choice.candidates() {
        match usable(ebpf, family) {
            Ok(()) => {
                return Ok(Selection {
                    family,
                    passed_over,
                });
            }
            Err(err) => passed_over.push(format!("{family}: {err:#}")),
        }
    }
    bail!(
        "no eBPF hook family is usable ({HOOKS_ENV} or options asked for {choice:?}): {}",
        passed_over.join("; ")
    )
}

fn usable(ebpf: &mut Ebpf, family: HookFamily) -> anyhow::Result<()> {
    match family {
        HookFamily::Tracepoints => Ok(()),
        HookFamily::Fentry => {
            probe_fentry(ebpf)?;
            bail!(
                "the kernel accepts fentry, but this build implements the event programs on \
                 syscall tracepoints only"
            )
        }
    }
}

/// Loads (never attaches) the fentry probe: fails with the kernel's reason when fentry is refused.
fn probe_fentry(ebpf: &mut Ebpf) -> anyhow::Result<()> {
    let btf = aya::Btf::from_sys_fs().context("no kernel BTF for fentry targets")?;
    let program: &mut FEntry = ebpf
        .program_mut(FENTRY_PROBE)
        .with_context(|| format!("the eBPF object has no program {FENTRY_PROBE}"))?
        .try_into()
        .with_context(|| format!("eBPF program {FENTRY_PROBE} is not an fentry program"))?;
    program.load(FENTRY_PROBE_TARGET, &btf).map_err(|err| {
        let errno = std::error::Error::source(&err)
            .and_then(|cause| cause.downcast_ref::<std::io::Error>())
            .and_then(std::io::Error::raw_os_error);
        let what = format!("fentry program on {FENTRY_PROBE_TARGET}");
        match errno {
            Some(libc::EPERM) => anyhow::anyhow!(
                "{what} refused by the kernel (EPERM: fentry disallowed by policy on this node)"
            ),
            _ => anyhow::Error::new(err).context(format!("{what} cannot be loaded")),
        }
    })?;
    // Loaded only to learn the answer; unload so it holds no kernel memory.
    let _ = program.unload();
    Ok(())
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
    fn auto_prefers_fentry_and_ends_with_tracepoints() {
        assert_eq!(
            HookChoice::Auto.candidates(),
            &[HookFamily::Fentry, HookFamily::Tracepoints]
        );
    }
}
