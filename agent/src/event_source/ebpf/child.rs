//! The loader's short-lived children (the kernel layout, the eBPF load): this executable run
//! again with a child argument. Its own file so that `layout` and `load_child` reach it without
//! importing the room's `mod.rs`.

use anyhow::Context;

/// Runs this executable (`/proc/self/exe`: the running binary, even after an upgrade replaced
/// the file) with `args` as one of the loader's short-lived children (`what` names it in errors),
/// and returns its stdout once it exited 0.
pub fn run_child<S: AsRef<std::ffi::OsStr>>(
    what: &str,
    args: impl IntoIterator<Item = S>,
) -> anyhow::Result<Vec<u8>> {
    let output = std::process::Command::new("/proc/self/exe")
        .args(args)
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .with_context(|| format!("cannot run the {what} child"))?;
    if !output.status.success() {
        anyhow::bail!("the {what} child exited with {}", output.status);
    }
    Ok(output.stdout)
}
