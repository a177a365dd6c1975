//! Embeds the eBPF object when the build names one.
//!
//! `cargo xtask build` compiles `agent-ebpf` for `bpfel-unknown-none` with Debian's rustc-web and
//! bpf-linker, then builds this crate with `PLUGIN_AGENT_EBPF_OBJ` set to that object's path. A plain
//! `cargo build` (no eBPF toolchain on the machine) leaves it unset: the agent is then built without
//! the eBPF event source, says so at start, and `--source auto` falls back to fanotify or inotify.

use std::path::Path;

#[path = "src/event_source/ebpf/fnv.rs"]
mod fnv;

fn main() {
    println!("cargo:rerun-if-env-changed=PLUGIN_AGENT_EBPF_OBJ");
    let Some(object) = std::env::var_os("PLUGIN_AGENT_EBPF_OBJ").filter(|p| !p.is_empty()) else {
        return;
    };
    let object = Path::new(&object);
    println!("cargo:rerun-if-changed={}", object.display());
    if !object.is_file() {
        panic!(
            "PLUGIN_AGENT_EBPF_OBJ names {}, which is not a file; build it with `cargo xtask build`",
            object.display()
        );
    }
    let bytes = std::fs::read(object)
        .unwrap_or_else(|err| panic!("cannot read {}: {err}", object.display()));
    println!("cargo:rustc-cfg=ebpf_object");
    println!(
        "cargo:rustc-env=PLUGIN_AGENT_EBPF_OBJ_FNV={:016x}",
        fnv::fnv1a(&bytes)
    );
    println!(
        "cargo:rustc-env=PLUGIN_AGENT_EBPF_OBJ_PATH={}",
        object.display()
    );
}
