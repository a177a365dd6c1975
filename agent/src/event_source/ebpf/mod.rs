//! The eBPF event source (see agent-ebpf for the kernel programs).
