//! Least privilege: what each event source needs to start, and what the agent keeps once it runs.
//!
//! Starting needs more than running. Loading and attaching BPF programs needs `CAP_BPF` and
//! `CAP_PERFMON` (and `CAP_SYS_ADMIN` if tracefs must be mounted, or on kernels before 5.8);
//! a fanotify group with an unlimited queue needs `CAP_SYS_ADMIN`; inotify needs nothing. Once
//! the source is attached, its programs, maps and queues are reached through file descriptors the
//! agent already holds, and adding a map entry, a fanotify inode mark or an inotify watch needs no
//! capability. So after start the agent drops everything except:
//!
//! - `CAP_DAC_OVERRIDE`: connect to a plugin's socket whatever its owner and mode (CSI drivers
//!   often run as other users with 0660 sockets), walk and watch sub-directories whatever their
//!   mode (on a directory it grants read and search too), and re-create the registration
//!   directory;
//!
//! from the effective, permitted, inheritable, ambient and bounding sets, so neither the agent nor
//! anything it could be tricked into executing gets them back.

use crate::event_source::SourceKind;
use caps::{CapSet, Capability, CapsHashSet};

/// Capabilities kept for the agent's whole life (see the module docs for why each).
/// `CAP_DAC_READ_SEARCH` is not among them: measured in the shipped pod without it, nothing the
/// agent does changes (tests/tests/container.rs, docs/operations.md "Least privilege, measured").
pub const KEPT: [Capability; 1] = [Capability::CAP_DAC_OVERRIDE];

/// Capabilities an event source needs to start, for documentation and error messages.
pub fn needed_to_start(source: SourceKind) -> &'static [Capability] {
    match source {
        SourceKind::Ebpf => &[Capability::CAP_BPF, Capability::CAP_PERFMON],
        SourceKind::Fanotify => &[Capability::CAP_SYS_ADMIN],
        SourceKind::Inotify => &[],
    }
}

/// What [`drop_after_start`] left.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dropped {
    /// Effective capabilities now.
    pub kept: Vec<Capability>,
    /// How many were given up.
    pub dropped: usize,
}

/// Drops every capability but [`KEPT`] from all sets. Call once the event source is attached.
pub fn drop_after_start() -> anyhow::Result<Dropped> {
    use anyhow::Context;
    let permitted =
        caps::read(None, CapSet::Permitted).context("reading permitted capabilities")?;
    let keep: CapsHashSet = KEPT
        .iter()
        .copied()
        .filter(|c| permitted.contains(c))
        .collect();
    // The bounding set needs CAP_SETPCAP to shrink, so it goes first, while we still have it.
    if permitted.contains(&Capability::CAP_SETPCAP) {
        for cap in caps::read(None, CapSet::Bounding).context("reading the bounding set")? {
            if !keep.contains(&cap) {
                caps::drop(None, CapSet::Bounding, cap)
                    .with_context(|| format!("dropping {cap} from the bounding set"))?;
            }
        }
    }
    caps::clear(None, CapSet::Ambient).context("clearing ambient capabilities")?;
    caps::set(None, CapSet::Inheritable, &CapsHashSet::new())
        .context("clearing inheritable capabilities")?;
    caps::set(None, CapSet::Effective, &keep).context("setting effective capabilities")?;
    caps::set(None, CapSet::Permitted, &keep).context("setting permitted capabilities")?;
    let mut kept: Vec<Capability> = keep.into_iter().collect();
    kept.sort_by_key(|c| c.index());
    Ok(Dropped {
        kept,
        dropped: permitted.len().saturating_sub(KEPT.len()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_document_what_they_need() {
        assert!(needed_to_start(SourceKind::Ebpf).contains(&Capability::CAP_BPF));
        assert!(needed_to_start(SourceKind::Fanotify).contains(&Capability::CAP_SYS_ADMIN));
        assert!(needed_to_start(SourceKind::Inotify).is_empty());
        assert!(!KEPT.contains(&Capability::CAP_SYS_ADMIN) && !KEPT.contains(&Capability::CAP_BPF));
    }
}
