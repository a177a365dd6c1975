//! The kernel layout the programs are loaded with (struct member offsets, the VFS functions'
//! argument positions), read from vmlinux's BTF in a short-lived child process.
//!
//! Why a child: parsing vmlinux's BTF takes about 30 MiB for a moment. In the agent, that moment
//! was its peak resident set for the rest of its life (VmHWM 46 MiB against 20 to 29 MiB in use),
//! and a DaemonSet's memory limit has to be sized for the peak. The child is this same executable
//! (`/proc/self/exe`, which names the running binary even after an upgrade replaced the file), so
//! the bytes it writes are the agent's own `#[repr(C)]` types; the parent checks their length and
//! tag. If the child cannot run at all (no `/proc`, a seccomp profile without `execve`), the agent
//! parses in its own process, as before.
//!
//! The child also asks the kernel, when the loader chooses the family, whether it loads and
//! attaches a tracing program at all (aya's probe: a trivial fentry on `bpf_fentry_test1`). Loading
//! the real fentry programs needs aya's own view of vmlinux's BTF, another 19 MiB for a moment in
//! the agent; a kernel that refuses fentry by policy (EPERM, as on the build machine) is now
//! known before that, and the agent goes straight to the tracepoints without the peak. A kernel that
//! allows the probe still decides with the real programs.
//!
//! ```text
//! agent --spawn /proc/self/exe __plugin-agent-kernel-layout [probe-fentry]--> child: parse BTF, resolve, probe
//!       <--stdout: "OK" offsets (0 | 1 len reason) (vfs-tag vfs-args | vfs-tag error) | "ER" error--
//! ```

use std::io::Write;

use agent_ebpf::{KernelOffsets, VfsArgs};
use anyhow::{Context, bail};

use super::btf::{KernelBtf, resolve_offsets, resolve_vfs_args};
use super::hooks;

/// The argument `main` recognises before anything else and hands to [`child_main`].
pub const CHILD_ARG: &str = "__plugin-agent-kernel-layout";

/// The child's second argument when the loader chooses the hook family (`auto`): probe whether
/// fentry/fexit can be used. (An operator who asks for fentry only gets the real programs' error.)
const PROBE_FENTRY_ARG: &str = "probe-fentry";

/// What the load needs from the kernel's BTF.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelLayout {
    /// Struct member offsets for every program.
    pub offsets: KernelOffsets,
    /// Argument positions for the fentry/fexit family, or why they are not the ones the
    /// programs know (the tracepoints are then used).
    pub vfs: Result<VfsArgs, String>,
    /// Why this kernel loads no fentry/fexit program, when the child's probe found out (`None`:
    /// not probed, or the probe passed; the real programs decide).
    pub fentry_refused: Option<String>,
}

const OK: &[u8; 2] = b"OK";
const ERROR: &[u8; 2] = b"ER";

/// Resolves the layout of the running kernel, in a child process if one can run; with
/// `probe_fentry`, the child also probes whether fentry/fexit programs load here.
pub fn resolve(probe_fentry: bool) -> anyhow::Result<KernelLayout> {
    match in_child(probe_fentry) {
        Ok(Answer::Layout(layout)) => Ok(layout),
        Ok(Answer::Error(message)) => bail!("{message}"),
        Err(err) => {
            tracing::debug!(error = %format!("{err:#}"), "kernel layout child failed; parsing BTF in the agent");
            in_process()
        }
    }
}

/// Parses the running kernel's BTF in this process.
pub fn in_process() -> anyhow::Result<KernelLayout> {
    let btf = KernelBtf::running_kernel()?;
    let offsets = resolve_offsets(&btf).context("the running kernel's layout is not supported")?;
    // Only the fentry/fexit family needs these; a kernel where they cannot be found still gets
    // the tracepoints.
    let vfs = resolve_vfs_args(&btf).map_err(|err| format!("{err:#}"));
    Ok(KernelLayout {
        offsets,
        vfs,
        fentry_refused: None,
    })
}

/// Whether the kernel loads and attaches a tracing (fentry) program: `Some(why not)` when it does
/// not, `None` when it does or the probe could not tell (the real programs then decide).
fn probe_fentry() -> Option<String> {
    use aya::programs::ProgramType;
    match aya::sys::is_program_supported(ProgramType::Tracing) {
        Ok(true) => None,
        Ok(false) => Some("the kernel has no fentry/fexit (BPF_PROG_TYPE_TRACING)".into()),
        Err(err) => (hooks::errno(&err) == Some(libc::EPERM)).then(|| {
            format!(
                "a probe (a trivial fentry program on bpf_fentry_test1) refused by the kernel \
                 ({})",
                hooks::POLICY_REFUSAL
            )
        }),
    }
}

/// What the child does, for a process that may take the parse's peak (the child itself, or the
/// load child): parse here and, with `probe_fentry`, probe whether fentry/fexit programs load.
pub fn resolve_here(probe_fentry: bool) -> anyhow::Result<KernelLayout> {
    in_process().map(|mut layout| {
        if probe_fentry && layout.vfs.is_ok() {
            layout.fentry_refused = self::probe_fentry();
        }
        layout
    })
}

/// The child's whole life: resolve (and probe, when asked), write the answer to stdout, exit.
pub fn child_main() -> std::process::ExitCode {
    let probe = std::env::args_os().nth(2).as_deref() == Some(PROBE_FENTRY_ARG.as_ref());
    let bytes = encode(&resolve_here(probe).map_err(|err| format!("{err:#}")));
    match std::io::stdout().lock().write_all(&bytes) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(_) => std::process::ExitCode::FAILURE,
    }
}

enum Answer {
    Layout(KernelLayout),
    /// The child ran and could not resolve: the same error the agent would get.
    Error(String),
}

fn in_child(probe_fentry: bool) -> anyhow::Result<Answer> {
    let args = std::iter::once(CHILD_ARG).chain(probe_fentry.then_some(PROBE_FENTRY_ARG));
    decode(&super::child::run_child("kernel layout", args)?)
}

fn encode(answer: &Result<KernelLayout, String>) -> Vec<u8> {
    let mut bytes = Vec::new();
    match answer {
        Ok(layout) => {
            bytes.extend_from_slice(OK);
            bytes.extend_from_slice(pod_bytes(&layout.offsets));
            match &layout.fentry_refused {
                None => bytes.push(0),
                Some(reason) => {
                    bytes.push(1);
                    let len = u32::try_from(reason.len()).unwrap_or(u32::MAX);
                    bytes.extend_from_slice(&len.to_le_bytes());
                    bytes.extend_from_slice(&reason.as_bytes()[..len as usize]);
                }
            }
            match &layout.vfs {
                Ok(vfs) => {
                    bytes.push(1);
                    bytes.extend_from_slice(pod_bytes(vfs));
                }
                Err(reason) => {
                    bytes.push(0);
                    bytes.extend_from_slice(reason.as_bytes());
                }
            }
        }
        Err(message) => {
            bytes.extend_from_slice(ERROR);
            bytes.extend_from_slice(message.as_bytes());
        }
    }
    bytes
}

fn decode(bytes: &[u8]) -> anyhow::Result<Answer> {
    let (tag, rest) = bytes.split_at_checked(2).context("empty answer")?;
    if tag == ERROR {
        return Ok(Answer::Error(String::from_utf8_lossy(rest).into_owned()));
    }
    if tag != OK {
        bail!("unknown answer");
    }
    let (offsets, rest) = rest
        .split_at_checked(size_of::<KernelOffsets>())
        .context("short answer")?;
    let offsets = read_pod::<KernelOffsets>(offsets);
    let (fentry_refused, rest) = match rest.split_first() {
        Some((0, rest)) => (None, rest),
        Some((1, rest)) => {
            let (len, rest) = rest.split_at_checked(4).context("short answer")?;
            let len = u32::from_le_bytes(len.try_into().context("short answer")?);
            let (reason, rest) = rest
                .split_at_checked(usize::try_from(len).context("long answer")?)
                .context("short answer")?;
            (Some(String::from_utf8_lossy(reason).into_owned()), rest)
        }
        _ => bail!("malformed answer"),
    };
    let vfs = match rest.split_first() {
        Some((1, vfs)) if vfs.len() == size_of::<VfsArgs>() => Ok(read_pod::<VfsArgs>(vfs)),
        Some((0, reason)) => Err(String::from_utf8_lossy(reason).into_owned()),
        _ => bail!("malformed answer"),
    };
    Ok(Answer::Layout(KernelLayout {
        offsets,
        vfs,
        fentry_refused,
    }))
}

/// The bytes of a `#[repr(C)]` struct of `u32`s only (no padding: every byte is initialised).
fn pod_bytes<T: aya::Pod>(value: &T) -> &[u8] {
    // SAFETY: `T` is plain old data made of u32 fields (KernelOffsets, VfsArgs), so all
    // `size_of::<T>()` bytes behind the reference are initialised and readable as u8.
    unsafe { std::slice::from_raw_parts((value as *const T).cast::<u8>(), size_of::<T>()) }
}

/// Reads a `T` from exactly `size_of::<T>()` bytes written by [`pod_bytes`].
fn read_pod<T: aya::Pod>(bytes: &[u8]) -> T {
    assert_eq!(bytes.len(), size_of::<T>(), "checked by the caller");
    // SAFETY: the length is checked above, any bit pattern is a valid `T` (`aya::Pod`), and
    // `read_unaligned` has no alignment requirement.
    unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(vfs: Result<VfsArgs, String>) -> KernelLayout {
        let offsets = KernelOffsets {
            task_fs: 1234,
            dentry_name: 40,
            ..KernelOffsets::default()
        };
        KernelLayout {
            offsets,
            vfs,
            fentry_refused: None,
        }
    }

    #[test]
    fn a_layout_survives_the_round_trip_with_and_without_vfs_arguments() {
        let vfs = VfsArgs {
            rename_data: 2,
            ..VfsArgs::default()
        };
        let refused = KernelLayout {
            fentry_refused: Some("refused by the kernel (EPERM)".into()),
            ..layout(Ok(vfs))
        };
        for original in [layout(Ok(vfs)), layout(Err("no vfs_mkdir".into())), refused] {
            match decode(&encode(&Ok(original.clone()))).expect("decodes") {
                Answer::Layout(decoded) => assert_eq!(decoded, original),
                Answer::Error(e) => panic!("decoded as an error: {e}"),
            }
        }
    }

    #[test]
    fn the_childs_error_comes_back_as_its_message() {
        match decode(&encode(&Err("no BTF here".into()))).expect("decodes") {
            Answer::Error(message) => assert_eq!(message, "no BTF here"),
            Answer::Layout(_) => panic!("an error decoded as a layout"),
        }
    }

    #[test]
    fn truncated_or_foreign_answers_are_refused() {
        let whole = encode(&Ok(layout(Ok(VfsArgs::default()))));
        for cut in [0, 1, 2, 10, whole.len() - 1] {
            assert!(decode(&whole[..cut]).is_err(), "accepted {cut} bytes");
        }
        assert!(decode(b"HELLO").is_err());
    }

    /// The child is this test binary here, which does not know the argument: the answer is
    /// refused and [`resolve`] would parse in process instead.
    #[test]
    fn a_child_that_does_not_answer_is_an_error_not_a_layout() {
        assert!(in_child(false).is_err());
    }
}
