//! Adopting a pinned set: finding the tree's newest set made with this object and settings,
//! opening its maps and holding its objects (see `pin_guard`). Apart from `pins`, which writes and
//! names the sets and which `pin_guard` uses to pin a damaged set again.

use std::path::Path;
use std::time::{Duration, Instant};

use agent_ebpf::{DirKey, names};
use anyhow::Context;
use aya::maps::{Array, HashMap as BpfHashMap, Map, MapData};

use super::name_holders::NameTable;
use super::pin_guard::Held;
use super::pins::{
    Identity, Meta, own_mount_ns, read_meta, remove_set, set_agent, sets_of, write_meta,
};
use super::ring::Ring;

/// The maps of an adopted set, and what the loader that made it computed.
pub struct Adopted {
    pub events: Ring,
    pub watched: BpfHashMap<MapData, DirKey, u8>,
    pub names: NameTable,
    pub losses: Array<MapData, u64>,
    pub agent: Array<MapData, u32>,
    pub meta: Meta,
    /// The set's objects, held so that they outlive a removal of the pins (see `pin_guard`).
    pub held: Held,
    /// Time to find and open the set.
    pub opened_in: Duration,
}

/// Adopts the set of `dir` made with `identity`, if there is one; removes every other set of
/// `dir` only when one is adopted (a failed adoption leaves them for the load that follows,
/// which replaces them).
pub fn adopt(dir: &Path, identity: &Identity) -> anyhow::Result<Option<Adopted>> {
    let started = Instant::now();
    let mut sets = sets_of(dir);
    // Newest first: the set names carry their creation time.
    sets.sort();
    sets.reverse();
    for set in &sets {
        let Ok(mut meta) = read_meta(set) else {
            continue;
        };
        if !identity.matches(&meta) {
            continue;
        }
        let open = |name: &str| -> anyhow::Result<Map> {
            let data = MapData::from_pin(set.join(name))
                .with_context(|| format!("cannot open pinned map {}", set.join(name).display()))?;
            Ok(match name {
                names::EVENTS => Map::RingBuf(data),
                names::WATCHED | names::NAMES => Map::HashMap(data),
                _ => Map::Array(data),
            })
        };
        let agent = set_agent(open(names::AGENT)?.try_into()?)?;
        let held = Held::open(set)?;
        // A restarted container is in a mount namespace of its own: the set is judged in it now.
        let mount_ns = own_mount_ns();
        if meta.mount_ns != mount_ns {
            meta.mount_ns = mount_ns;
            let mut map = Map::Array(MapData::from_pin(set.join(names::META))?);
            write_meta(&mut map, &meta)?;
        }
        let adopted = Adopted {
            events: Ring::from_map(open(names::EVENTS)?)?,
            watched: open(names::WATCHED)?.try_into()?,
            names: open(names::NAMES)?.try_into()?,
            losses: open(names::LOSSES)?.try_into()?,
            agent,
            meta,
            held,
            opened_in: Duration::ZERO,
        };
        for other in sets.iter().filter(|s| *s != set) {
            remove_set(other);
        }
        return Ok(Some(Adopted {
            opened_in: started.elapsed(),
            ..adopted
        }));
    }
    Ok(None)
}
