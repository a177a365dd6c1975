//! FNV-1a, 64 bits: stable across builds and machines (std's hasher is not), so an upgraded agent
//! finds the same pin directory, and the build script and the agent agree on the object's hash.
//! Not a security boundary (the pin directory is root's): it only tells objects and trees apart.

/// The hash of `bytes`.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
