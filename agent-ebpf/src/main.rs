//! plugin-agent's kernel programs: the first stage of the data flow (see lib.rs for the shared
//! types, and `programs/mod.rs` for the programs, one file per family).
#![cfg_attr(target_arch = "bpf", no_std, no_main)]

#[cfg(not(target_arch = "bpf"))]
fn main() {
    eprintln!("agent-ebpf is a kernel program: build it with `cargo xtask build-ebpf`");
}

#[cfg(target_arch = "bpf")]
mod programs;
