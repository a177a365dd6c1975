//! Kernel struct offsets from the running kernel's BTF: the first thing the eBPF source does at load.
//!
//! ```text
//! /sys/kernel/btf/vmlinux --KernelBtf::member("file", "f_path.dentry")--> Member { offset, size }
//!                         --resolve_offsets--> KernelOffsets --Config global--> kernel programs
//! ```
//!
//! The kernel programs are built by bpf-linker, which emits no CO-RE relocations, so every struct
//! member they read is located here, on the kernel they are about to run on, and checked for the
//! size the programs read. A kernel whose layout lacks a member fails the load with the member's
//! name instead of reading garbage.

use std::path::Path;

use agent_ebpf::{KernelOffsets, VfsArgs};
use anyhow::{Context, bail};
use btf_rs::{Btf, Type};

/// Where the kernel publishes its own BTF (`CONFIG_DEBUG_INFO_BTF=y`).
pub const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

/// The running kernel's type information, parsed once per load.
pub struct KernelBtf {
    btf: Btf,
}

/// A kernel function's parameter names in order, and whether it returns a pointer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signature {
    /// Parameter names as the kernel's BTF spells them.
    pub parameters: Vec<String>,
    /// Whether the return type is a pointer.
    pub returns_ptr: bool,
}

impl Signature {
    /// Position of the parameter called `name`, as a program argument index.
    fn position(&self, function: &str, name: &str) -> anyhow::Result<u32> {
        let index = self
            .parameters
            .iter()
            .position(|p| p == name)
            .with_context(|| {
                format!(
                    "{function}({}) has no parameter `{name}`",
                    self.parameters.join(", ")
                )
            })?;
        u32::try_from(index).context("parameter index overflows u32")
    }

    /// Where an fexit program finds the return value: the context slot after the arguments.
    fn return_slot(&self) -> anyhow::Result<u32> {
        u32::try_from(self.parameters.len()).context("parameter count overflows u32")
    }
}

/// A member located inside a struct: byte offset from the struct's start, and byte size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    /// Byte offset, summed over embedded structs and anonymous unions on the way.
    pub offset: u32,
    /// Byte size of the member's type (pointers are 8 bytes).
    pub size: u32,
}

impl KernelBtf {
    /// Parses the running kernel's BTF.
    pub fn running_kernel() -> anyhow::Result<Self> {
        Self::from_file(Path::new(VMLINUX_BTF))
            .context("the eBPF source needs a kernel built with CONFIG_DEBUG_INFO_BTF=y")
    }

    /// Parses a BTF file (a kernel's `vmlinux` BTF, or a saved copy of one). Read whole first:
    /// parsed from the file, btf-rs asks the file's position (`lseek(2)`) for every type, 52,000
    /// system calls on a 6.18 kernel's BTF at each start of the eBPF source.
    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        let bytes = std::fs::read(path)
            .with_context(|| format!("cannot read kernel BTF from {}", path.display()))?;
        let btf = Btf::from_bytes(&bytes)
            .with_context(|| format!("cannot parse kernel BTF from {}", path.display()))?;
        Ok(KernelBtf { btf })
    }

    /// Locates `path` (members separated by `.`, e.g. `f_path.dentry`) inside `struct name`.
    ///
    /// Members of anonymous structs and unions are found as if they were direct members, as in C.
    pub fn member(&self, name: &str, path: &str) -> anyhow::Result<Member> {
        let mut current = self.named_struct(name)?;
        let mut offset = 0u32;
        let mut components = path.split('.').peekable();
        let mut walked = format!("struct {name}");
        while let Some(component) = components.next() {
            let (member_offset, member_type) = self
                .find_member(&current, component)?
                .with_context(|| format!("{walked} has no member `{component}`"))?;
            offset += member_offset;
            walked.push('.');
            walked.push_str(component);
            let resolved = self.strip_qualifiers(member_type)?;
            if components.peek().is_none() {
                let size = self
                    .type_size(&resolved)
                    .with_context(|| format!("cannot size {walked}"))?;
                return Ok(Member { offset, size });
            }
            current = match resolved {
                Type::Struct(s) | Type::Union(s) => s,
                other => bail!("{walked} is a {}, not a struct", other.name()),
            };
        }
        bail!("empty member path for struct {name}")
    }

    /// The signature of kernel function `name`: each parameter's name, and whether it returns a
    /// pointer (rather than an integer).
    pub fn function(&self, name: &str) -> anyhow::Result<Signature> {
        let types = self
            .btf
            .resolve_types_by_name(name)
            .with_context(|| format!("kernel BTF has no function `{name}`"))?;
        let func = types
            .into_iter()
            .find_map(|t| match t {
                Type::Func(f) => Some(f),
                _ => None,
            })
            .with_context(|| format!("kernel BTF has no function `{name}`"))?;
        let Type::FuncProto(proto) = self.btf.resolve_chained_type(&func)? else {
            bail!("kernel BTF's `{name}` has no prototype");
        };
        let parameters = proto
            .parameters
            .iter()
            .map(|p| self.btf.resolve_name(p).unwrap_or_default())
            .collect();
        let returns = self.btf.resolve_type_by_id(proto.return_type_id());
        let returns_ptr = matches!(
            returns.map(|t| self.strip_qualifiers(t)),
            Ok(Ok(Type::Ptr(_)))
        );
        Ok(Signature {
            parameters,
            returns_ptr,
        })
    }

    /// The definition (not a forward declaration) of `struct name`.
    fn named_struct(&self, name: &str) -> anyhow::Result<btf_rs::Struct> {
        let types = self
            .btf
            .resolve_types_by_name(name)
            .with_context(|| format!("kernel BTF has no type named `{name}`"))?;
        types
            .into_iter()
            .find_map(|t| match t {
                Type::Struct(s) if !s.members.is_empty() => Some(s),
                _ => None,
            })
            .with_context(|| format!("kernel BTF has no definition of struct {name}"))
    }

    /// Finds `name` among the members of `parent`, descending into anonymous members. Returns the
    /// byte offset from `parent`'s start and the member's type.
    fn find_member(
        &self,
        parent: &btf_rs::Struct,
        name: &str,
    ) -> anyhow::Result<Option<(u32, Type)>> {
        for member in &parent.members {
            let member_name = self.btf.resolve_name(member).unwrap_or_default();
            let bit_offset = member.bit_offset();
            if member_name == name {
                if member.bitfield_size().is_some_and(|bits| bits != 0) || bit_offset % 8 != 0 {
                    bail!("member `{name}` is a bitfield; the programs read whole bytes");
                }
                let member_type = self.btf.resolve_chained_type(member)?;
                return Ok(Some((bit_offset / 8, member_type)));
            }
            if member_name.is_empty() {
                let inner = self.strip_qualifiers(self.btf.resolve_chained_type(member)?)?;
                if let Type::Struct(inner) | Type::Union(inner) = inner
                    && let Some((offset, found)) = self.find_member(&inner, name)?
                {
                    return Ok(Some((bit_offset / 8 + offset, found)));
                }
            }
        }
        Ok(None)
    }

    /// Follows typedefs and qualifiers (`const`, `volatile`, `__rcu` type tags) to the real type.
    fn strip_qualifiers(&self, mut current: Type) -> anyhow::Result<Type> {
        // A chain longer than this is a malformed BTF, not a real kernel type.
        for _ in 0..32 {
            current = match &current {
                Type::Typedef(t) => self.btf.resolve_chained_type(t)?,
                Type::Const(t) | Type::Volatile(t) | Type::Restrict(t) => {
                    self.btf.resolve_chained_type(t)?
                }
                Type::TypeTag(t) => self.btf.resolve_chained_type(t)?,
                _ => return Ok(current),
            };
        }
        bail!("type qualifier chain too long")
    }

    fn type_size(&self, resolved: &Type) -> anyhow::Result<u32> {
        let size = match resolved {
            Type::Int(i) => i.size(),
            Type::Ptr(_) => size_of::<usize>(),
            Type::Struct(s) | Type::Union(s) => s.size(),
            Type::Enum(e) => e.size(),
            Type::Enum64(e) => e.size(),
            other => bail!("unexpected member type {}", other.name()),
        };
        u32::try_from(size).context("member size overflows u32")
    }
}

/// One member the programs read: which [`KernelOffsets`] field it fills, where it is, how big.
struct Needed {
    field: fn(&mut KernelOffsets) -> &mut u32,
    strukt: &'static str,
    path: &'static str,
    size: u32,
}

/// Everything the kernel programs read, in one table: a reviewer checks agent-ebpf's
/// `programs/` against this.
const NEEDED: &[Needed] = &[
    Needed {
        field: |o| &mut o.task_files,
        strukt: "task_struct",
        path: "files",
        size: 8,
    },
    Needed {
        field: |o| &mut o.task_fs,
        strukt: "task_struct",
        path: "fs",
        size: 8,
    },
    Needed {
        field: |o| &mut o.files_fdt,
        strukt: "files_struct",
        path: "fdt",
        size: 8,
    },
    Needed {
        field: |o| &mut o.fdtable_max_fds,
        strukt: "fdtable",
        path: "max_fds",
        size: 4,
    },
    Needed {
        field: |o| &mut o.fdtable_fd,
        strukt: "fdtable",
        path: "fd",
        size: 8,
    },
    Needed {
        field: |o| &mut o.file_private_data,
        strukt: "file",
        path: "private_data",
        size: 8,
    },
    Needed {
        field: |o| &mut o.file_dentry,
        strukt: "file",
        path: "f_path.dentry",
        size: 8,
    },
    Needed {
        field: |o| &mut o.socket_sk,
        strukt: "socket",
        path: "sk",
        size: 8,
    },
    Needed {
        field: |o| &mut o.sock_family,
        strukt: "sock",
        path: "__sk_common.skc_family",
        size: 2,
    },
    Needed {
        field: |o| &mut o.unix_sock_dentry,
        strukt: "unix_sock",
        path: "path.dentry",
        size: 8,
    },
    Needed {
        field: |o| &mut o.unix_sock_peer,
        strukt: "unix_sock",
        path: "peer",
        size: 8,
    },
    Needed {
        field: |o| &mut o.fs_pwd_dentry,
        strukt: "fs_struct",
        path: "pwd.dentry",
        size: 8,
    },
    Needed {
        field: |o| &mut o.dentry_parent,
        strukt: "dentry",
        path: "d_parent",
        size: 8,
    },
    Needed {
        field: |o| &mut o.dentry_name_len,
        strukt: "dentry",
        path: "d_name.len",
        size: 4,
    },
    Needed {
        field: |o| &mut o.dentry_name,
        strukt: "dentry",
        path: "d_name.name",
        size: 8,
    },
    Needed {
        field: |o| &mut o.dentry_inode,
        strukt: "dentry",
        path: "d_inode",
        size: 8,
    },
    Needed {
        field: |o| &mut o.dentry_sb,
        strukt: "dentry",
        path: "d_sb",
        size: 8,
    },
    Needed {
        field: |o| &mut o.sock_state,
        strukt: "sock",
        path: "__sk_common.skc_state",
        size: 1,
    },
    Needed {
        field: |o| &mut o.inode_mode,
        strukt: "inode",
        path: "i_mode",
        size: 2,
    },
    Needed {
        field: |o| &mut o.inode_ino,
        strukt: "inode",
        path: "i_ino",
        size: 8,
    },
    Needed {
        field: |o| &mut o.inode_generation,
        strukt: "inode",
        path: "i_generation",
        size: 4,
    },
    Needed {
        field: |o| &mut o.inode_nlink,
        strukt: "inode",
        path: "i_nlink",
        size: 4,
    },
    Needed {
        field: |o| &mut o.sb_dev,
        strukt: "super_block",
        path: "s_dev",
        size: 4,
    },
];

/// Resolves every offset the kernel programs need, checking each member's size.
pub fn resolve_offsets(btf: &KernelBtf) -> anyhow::Result<KernelOffsets> {
    let mut offsets = KernelOffsets::UNSET;
    for needed in NEEDED {
        let member = btf
            .member(needed.strukt, needed.path)
            .with_context(|| format!("cannot locate {}.{}", needed.strukt, needed.path))?;
        if member.size != needed.size {
            bail!(
                "{}.{} is {} bytes on this kernel; the eBPF programs read {}",
                needed.strukt,
                needed.path,
                member.size,
                needed.size
            );
        }
        *(needed.field)(&mut offsets) = member.offset;
    }
    Ok(offsets)
}

/// Resolves what the fentry/fexit programs read from the VFS functions' arguments on this kernel.
/// Fails (and the loader then passes over the fentry family, saying why) when a signature is not
/// the shape the programs expect, e.g. a kernel older than `struct renamedata`.
pub fn resolve_vfs_args(btf: &KernelBtf) -> anyhow::Result<VfsArgs> {
    let unlink = btf.function("vfs_unlink")?;
    let rmdir = btf.function("vfs_rmdir")?;
    let mkdir = btf.function("vfs_mkdir")?;
    let mknod = btf.function("vfs_mknod")?;
    let rename = btf.function("vfs_rename")?;
    let pointer = |member: Member, what: &str| {
        anyhow::ensure!(
            member.size == 8,
            "{what} is {} bytes, not a pointer",
            member.size
        );
        Ok(member.offset)
    };
    let flags = btf.member("renamedata", "flags")?;
    anyhow::ensure!(
        flags.size == 4,
        "renamedata.flags is {} bytes, not 4",
        flags.size
    );
    Ok(VfsArgs {
        unlink_dentry: unlink.position("vfs_unlink", "dentry")?,
        rmdir_dentry: rmdir.position("vfs_rmdir", "dentry")?,
        mkdir_dentry: mkdir.position("vfs_mkdir", "dentry")?,
        mkdir_returns_ptr: u32::from(mkdir.returns_ptr),
        mknod_dentry: mknod.position("vfs_mknod", "dentry")?,
        mknod_mode: mknod.position("vfs_mknod", "mode")?,
        rename_data: rename.position("vfs_rename", "rd")?,
        renamedata_old_dentry: pointer(
            btf.member("renamedata", "old_dentry")?,
            "renamedata.old_dentry",
        )?,
        renamedata_new_dentry: pointer(
            btf.member("renamedata", "new_dentry")?,
            "renamedata.new_dentry",
        )?,
        renamedata_flags: flags.offset,
        unlink_ret: unlink.return_slot()?,
        rmdir_ret: rmdir.return_slot()?,
        mkdir_ret: mkdir.return_slot()?,
        mknod_ret: mknod.return_slot()?,
        rename_ret: rename.return_slot()?,
        _pad: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The running kernel's BTF, or `None` (with the reason printed) where it is absent; the BTF
    /// tests fail instead when `CI=true`.
    fn running_kernel() -> Option<KernelBtf> {
        match KernelBtf::running_kernel() {
            Ok(btf) => Some(btf),
            Err(err) if std::env::var("CI").as_deref() != Ok("true") => {
                eprintln!("skipping: {err:#}");
                None
            }
            Err(err) => panic!("{err:#}"),
        }
    }

    #[test]
    fn every_offset_the_programs_read_is_found_on_this_kernel() {
        let Some(btf) = running_kernel() else { return };
        let offsets = resolve_offsets(&btf).map_err(|e| format!("{e:#}"));
        let offsets = offsets.as_ref().map(|o| (o.dentry_parent, o.file_dentry));
        // A struct's first member is at 0, but none of these is first on any real kernel.
        assert!(
            matches!(offsets, Ok((parent, dentry)) if parent > 0 && dentry > 0),
            "{offsets:?}"
        );
    }

    #[test]
    fn the_vfs_functions_the_fentry_programs_hook_are_resolved_on_this_kernel() {
        let Some(btf) = running_kernel() else { return };
        let unlink = btf.function("vfs_unlink").map_err(|e| format!("{e:#}"));
        eprintln!("vfs_unlink: {unlink:?}");
        assert!(
            matches!(&unlink, Ok(s) if s.parameters.iter().any(|p| p == "dentry") && !s.returns_ptr),
            "{unlink:?}"
        );
        let args = resolve_vfs_args(&btf).map_err(|e| format!("{e:#}"));
        eprintln!("{args:?}");
        // The dentry follows at least the directory inode; a rename's dentries are not first.
        assert!(
            matches!(&args, Ok(a) if a.unlink_dentry >= 1 && a.renamedata_new_dentry > a.renamedata_old_dentry),
            "{args:?}"
        );
    }

    #[test]
    fn a_missing_function_is_a_clear_error() {
        let Some(btf) = running_kernel() else { return };
        let err = btf
            .function("vfs_no_such_function_xyz")
            .map_err(|e| format!("{e:#}"));
        assert!(
            matches!(&err, Err(m) if m.contains("vfs_no_such_function_xyz")),
            "{err:?}"
        );
    }

    #[test]
    fn nested_member_offsets_add_up() {
        let Some(btf) = running_kernel() else { return };
        let f_path = btf.member("file", "f_path").map_err(|e| format!("{e:#}"));
        let dentry = btf.member("path", "dentry").map_err(|e| format!("{e:#}"));
        let nested = btf
            .member("file", "f_path.dentry")
            .map_err(|e| format!("{e:#}"));
        assert_eq!(
            nested.clone().map(|m| m.offset),
            f_path.and_then(|f| dentry.map(|d| f.offset + d.offset))
        );
        assert_eq!(nested.map(|m| m.size), Ok(8));
    }

    #[test]
    fn members_of_anonymous_unions_are_found_like_direct_members() {
        let Some(btf) = running_kernel() else { return };
        // struct qstr { union { struct { u32 hash; u32 len; }; u64 hash_len; }; const char *name; }
        let len = btf.member("qstr", "len").map_err(|e| format!("{e:#}"));
        let hash_len = btf.member("qstr", "hash_len").map_err(|e| format!("{e:#}"));
        assert_eq!(len.map(|m| m.size), Ok(4));
        assert_eq!(hash_len.map(|m| (m.offset, m.size)), Ok((0, 8)));
    }

    #[test]
    fn a_missing_member_is_a_clear_error() {
        let Some(btf) = running_kernel() else { return };
        let err = btf.member("dentry", "d_no_such_member").map(|_| ());
        let message = err.map_err(|e| format!("{e:#}"));
        assert_eq!(
            message,
            Err("struct dentry has no member `d_no_such_member`".to_string())
        );
        let err = btf
            .member("no_such_struct_xyz", "x")
            .map_err(|e| format!("{e:#}"));
        assert!(
            matches!(&err, Err(m) if m.contains("no_such_struct_xyz")),
            "{err:?}"
        );
    }

    #[test]
    fn a_member_that_is_not_a_struct_cannot_be_walked_into() {
        let Some(btf) = running_kernel() else { return };
        let err = btf
            .member("dentry", "d_parent.d_name")
            .map_err(|e| format!("{e:#}"));
        assert_eq!(
            err,
            Err("struct dentry.d_parent is a ptr, not a struct".to_string())
        );
    }
}
