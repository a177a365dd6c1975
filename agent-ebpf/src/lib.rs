//! Types shared by the kernel programs and the agent: the ring-buffer event record, map keys and the
//! kernel struct offsets that userspace resolves from BTF at load time.
#![no_std]
