//! Whether the compiler split a hooked VFS function on this kernel: callers in its own file then
//! call the clone (`vfs_rmdir.part.0`, `.isra.N`, `.constprop.N` in `/proc/kallsyms`), which
//! fentry/fexit on the function's own symbol never see, so the loader passes over the family
//! there (docs/kernels.md).

/// Why fentry/fexit on `functions` would miss calls on this kernel, if they would: the compiler
/// split or cloned one of them (`vfs_rmdir.part.0`, `.isra.N`, `.constprop.N` in
/// `/proc/kallsyms`), and callers in its own file call the clone, which a program on the
/// function's own symbol never sees (Debian's 5.10: `do_rmdir` calls `vfs_rmdir.part.0`, so no
/// rmdir(2) reaches fexit `vfs_rmdir`). The tracepoints see every call; a kernel whose symbols
/// cannot be read is given the benefit of the doubt (its BTF and loads decide, as before).
pub fn split_functions(functions: &[&str]) -> Option<String> {
    let kallsyms = std::fs::File::open("/proc/kallsyms").ok()?;
    split_functions_in(std::io::BufReader::new(kallsyms), functions)
}

/// [`split_functions`] on a `kallsyms` text.
fn split_functions_in(kallsyms: impl std::io::BufRead, functions: &[&str]) -> Option<String> {
    let mut clones = Vec::new();
    for line in kallsyms.lines() {
        let Ok(line) = line else { break };
        // "<address> <type> <name>[ [module]]": only the kernel's own text.
        let mut fields = line.split_ascii_whitespace();
        let (Some(_), Some(kind), Some(name), None) =
            (fields.next(), fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        if !matches!(kind, "t" | "T") {
            continue;
        }
        let Some((base, suffix)) = name.split_once('.') else {
            continue;
        };
        let cloned = ["part.", "isra.", "constprop."]
            .iter()
            .any(|kind| suffix.starts_with(kind));
        if cloned && functions.contains(&base) {
            clones.push(name.to_owned());
        }
    }
    (!clones.is_empty()).then(|| {
        format!(
            "the compiler split {} on this kernel: callers call the clone, which fentry/fexit on \
             the function itself do not see",
            clones.join(", ")
        )
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_hooked_function_the_compiler_split_is_named_and_others_are_not() {
        let kallsyms = "ffffffff8170b090 t vfs_kern_mount.part.0\n\
                        ffffffff81733270 t vfs_statfs.part.0.isra.0\n\
                        ffffffff81733280 t __pfx_vfs_rmdir.part.0\n\
                        ffffffff81733290 T vfs_rmdir\n\
                        ffffffff817332a0 t vfs_rmdir.part.0\n\
                        ffffffff817332b0 t vfs_unlink.cold\n\
                        ffffffffc0a00000 t vfs_mknod.isra.0\t[some_module]\n";
        let hooked = ["vfs_rmdir", "vfs_unlink", "vfs_mknod"];
        let split = super::split_functions_in(kallsyms.as_bytes(), &hooked);
        assert_eq!(
            split.as_deref(),
            Some(
                "the compiler split vfs_rmdir.part.0 on this kernel: callers call the clone, \
                 which fentry/fexit on the function itself do not see"
            ),
            "a cold section is no clone, a module's symbol is not the kernel's"
        );
        let none = super::split_functions_in(kallsyms.as_bytes(), &["vfs_unlink"]);
        assert_eq!(none, None);
    }
}
