//! plugin-agent's kernel programs (see lib.rs for the shared types).
#![cfg_attr(target_arch = "bpf", no_std, no_main)]

#[cfg(not(target_arch = "bpf"))]
fn main() {
    eprintln!("agent-ebpf is a kernel program: build it with `cargo xtask build-ebpf`");
}
