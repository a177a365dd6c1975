//! Loading, attaching and pinning the programs in a short-lived child process, when they are
//! pinned; the agent then adopts the pins as it does after a restart.
//!
//! Why a child: aya's loader parses vmlinux's BTF whether or not the object needs it
//! (`EbpfLoader::new()` in aya 0.14, ~17 MiB for a moment, with the object's own copies on top),
//! and a fentry load parses it again. In the agent that moment was its peak resident set for the
//! rest of its life (VmHWM ~26 MiB against ~18 MiB in use, where fanotify's agent peaks at
//! ~13 MiB), and a DaemonSet's memory limit has to be sized for the peak. Pinned programs do not
//! need the process that loaded them: their links keep them attached and their maps are opened
//! from the pins. The child is this same executable (`/proc/self/exe`), so it loads exactly the
//! object the agent embeds, with the same settings, into the pin directory the agent then
//! adopts.
//!
//! ```text
//! agent --spawn /proc/self/exe __plugin-agent-load ROOT RUNTIME_DIR ring wakeup batch_ns watched names hooks-->
//!        child: loader::load (kernel layout read here, BTF, verifier, attach), pins::pin
//!       <--stdout: "OK\n" selection "\n" timings | "ER\n" load error | "NP\n" pin error--
//! agent: adopt::adopt -> the reader, as after a restart
//! ```
//!
//! If the child cannot run (no `/proc`, a seccomp profile without `execve`) or could not pin, the
//! agent loads in its own process, as before; if it ran and the load failed, that failure is the
//! agent's (the same error, with nothing loaded twice).

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};

use super::hooks::HookChoice;
use super::loader::{self, LoadParams};
use super::pins::Owner as PinOwner;

/// The argument `main` recognises before anything else and hands to [`child_main`].
pub const CHILD_ARG: &str = "__plugin-agent-load";

const OK: &str = "OK";
const LOAD_ERROR: &str = "ER";
const PIN_ERROR: &str = "NP";

/// What the child did.
pub(super) enum Outcome {
    /// Loaded, attached and pinned: adopt the pins. The hook selection and the load's timings,
    /// as the child describes them, for the agent's log.
    Pinned { selection: String, timings: String },
    /// The load failed: the agent's load would fail the same way.
    LoadFailed(String),
    /// Loaded, but the pins could not be written (and the child's links went with it).
    NotPinned(String),
}

/// Loads and pins the programs as `owner`'s in a child process. An error: the child could not
/// run or answer (the caller loads in its own process).
pub(super) fn load_and_pin(params: &LoadParams, owner: &PinOwner) -> anyhow::Result<Outcome> {
    let args = [
        CHILD_ARG.into(),
        owner.tree.as_os_str().to_owned(),
        owner.runtime_dir.as_os_str().to_owned(),
    ]
    .into_iter()
    .chain(
        encode_params(params)
            .into_iter()
            .map(std::ffi::OsString::from),
    );
    let stdout = super::child::run_child("eBPF load", args)?;
    decode(&String::from_utf8_lossy(&stdout))
}

/// The child's whole life: load, attach, pin, say how it went on stdout, exit.
pub fn child_main() -> std::process::ExitCode {
    let answer = match decode_args(std::env::args_os().skip(2)) {
        Ok((owner, params)) => load_in_child(&owner, &params),
        Err(err) => format!("{LOAD_ERROR}\n{err:#}"),
    };
    match std::io::stdout().lock().write_all(answer.as_bytes()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(_) => std::process::ExitCode::FAILURE,
    }
}

fn load_in_child(owner: &PinOwner, params: &LoadParams) -> String {
    let Some(identity) = super::pin_load::identity(params) else {
        return format!("{LOAD_ERROR}\nthis plugin-agent was built without the eBPF event source");
    };
    let mut loaded = match loader::load(params) {
        Ok(loaded) => loaded,
        Err(err) => return format!("{LOAD_ERROR}\n{err:#}"),
    };
    match super::pin_load::pin_loaded(&mut loaded, &owner.dir(), &identity, owner) {
        Ok(_) => format!("{OK}\n{}\n{}", loaded.hooks, loaded.timings),
        Err(err) => format!("{PIN_ERROR}\n{err:#}"),
    }
}

fn encode_params(params: &LoadParams) -> Vec<String> {
    vec![
        params.ring_buffer_bytes.to_string(),
        params.wakeup_bytes.to_string(),
        params.batch_delay.as_nanos().to_string(),
        params.watched_capacity.to_string(),
        params.names_capacity.to_string(),
        match params.hooks {
            HookChoice::Auto => "auto".to_owned(),
            HookChoice::Only(super::HookFamily::Fentry) => "fentry".to_owned(),
            HookChoice::Only(super::HookFamily::Tracepoints) => "tracepoints".to_owned(),
        },
    ]
}

fn decode_args(
    mut args: impl Iterator<Item = std::ffi::OsString>,
) -> anyhow::Result<(PinOwner, LoadParams)> {
    let owner = PinOwner {
        tree: PathBuf::from(args.next().context("no tree root")?),
        runtime_dir: PathBuf::from(args.next().context("no runtime directory")?),
    };
    let mut next = |what: &str| -> anyhow::Result<String> {
        args.next()
            .and_then(|a| a.into_string().ok())
            .with_context(|| format!("no {what}"))
    };
    let params = LoadParams {
        ring_buffer_bytes: next("ring size")?.parse()?,
        wakeup_bytes: next("wake-up bytes")?.parse()?,
        batch_delay: Duration::from_nanos(next("batch delay")?.parse()?),
        watched_capacity: next("watched capacity")?.parse()?,
        names_capacity: next("names capacity")?.parse()?,
        hooks: next("hook choice")?.parse()?,
        // A short-lived process already: no layout child of its own.
        layout_here: true,
    };
    Ok((owner, params))
}

fn decode(stdout: &str) -> anyhow::Result<Outcome> {
    let (tag, rest) = stdout.split_once('\n').unwrap_or((stdout, ""));
    match tag {
        OK => {
            let (selection, timings) = rest.split_once('\n').unwrap_or((rest, ""));
            Ok(Outcome::Pinned {
                selection: selection.to_owned(),
                timings: timings.to_owned(),
            })
        }
        LOAD_ERROR => Ok(Outcome::LoadFailed(rest.to_owned())),
        PIN_ERROR => Ok(Outcome::NotPinned(rest.to_owned())),
        _ => bail!("the eBPF load child answered {stdout:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn the_parameters_reach_the_child_as_they_were() {
        let params = LoadParams {
            ring_buffer_bytes: 1 << 20,
            wakeup_bytes: 131_072,
            batch_delay: Duration::from_micros(250),
            watched_capacity: 16_384,
            names_capacity: 8_192,
            hooks: HookChoice::Only(super::super::HookFamily::Tracepoints),
            layout_here: false,
        };
        let args = ["/var/lib/kubelet/plugins_registry", "/run/plugin-agent"]
            .into_iter()
            .map(Into::into)
            .chain(encode_params(&params).into_iter().map(Into::into));
        let (owner, decoded) = decode_args(args).expect("decodes");
        assert_eq!(owner.tree, Path::new("/var/lib/kubelet/plugins_registry"));
        assert_eq!(owner.runtime_dir, Path::new("/run/plugin-agent"));
        assert_eq!(
            super::super::pin_load::identity_settings(&decoded),
            super::super::pin_load::identity_settings(&params),
            "the child pins under the identity the agent adopts"
        );
    }

    #[test]
    fn answers_are_told_apart() {
        assert!(matches!(
            decode("OK\nsyscall tracepoints\ntotal 1s"),
            Ok(Outcome::Pinned { selection, timings }) if selection == "syscall tracepoints" && timings == "total 1s"
        ));
        assert!(
            matches!(decode("ER\nno CAP_BPF"), Ok(Outcome::LoadFailed(e)) if e == "no CAP_BPF")
        );
        assert!(matches!(decode("NP\nno bpffs"), Ok(Outcome::NotPinned(e)) if e == "no bpffs"));
        assert!(decode("").is_err());
    }
}
