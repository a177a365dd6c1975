//! What a load is pinned as: the identity a pinned set is adopted by (the object's hash and the
//! settings it was loaded with), and pinning a load's links and maps as a tree's new set. Shared by
//! the agent's own load (`open`) and the load child (`load_child`).

use std::path::PathBuf;

use super::hooks::HookFamily;
use super::loader::{self, LoadParams};
use super::pins::{self, Owner as PinOwner};

/// The settings a pinned set was loaded with, part of its identity: a set loaded with others is
/// not adopted.
pub fn identity_settings(params: &LoadParams) -> String {
    format!(
        "ring={} wakeup={} batch_ns={} watched={} names={} hooks={:?}",
        params.ring_buffer_bytes,
        params.wakeup_bytes,
        params.batch_delay.as_nanos(),
        params.watched_capacity,
        params.names_capacity,
        params.hooks,
    )
}

/// The identity of the set this agent's object loads with `params`; none without an object.
pub fn identity(params: &LoadParams) -> Option<pins::Identity> {
    loader::object_hash().map(|hash| pins::Identity::new(hash, identity_settings(params)))
}

/// Takes the links out of `loaded` and pins them with its maps as the tree's new set; returns
/// the set's directory.
pub fn pin_loaded(
    loaded: &mut loader::Loaded,
    dir: &std::path::Path,
    identity: &pins::Identity,
    owner: &PinOwner,
) -> anyhow::Result<PathBuf> {
    let links = loader::take_links(&mut loaded.ebpf, std::mem::take(&mut loaded.links))?;
    let family = match loaded.hooks.family {
        HookFamily::Fentry => "fentry",
        HookFamily::Tracepoints => "tracepoints",
    };
    let mut meta = pins::Meta::new(identity, owner, family, loaded.attached.clone());
    meta.load_ms = u64::try_from(loaded.timings.total().as_millis()).unwrap_or(u64::MAX);
    pins::pin(&mut loaded.ebpf, links, dir, &meta)
}
