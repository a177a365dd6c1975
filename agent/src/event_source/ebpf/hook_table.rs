//! Where each program of the object goes: the syscall tracepoints of each family, the socket
//! hints every family attaches, and the fentry/fexit programs on the VFS functions with their
//! exit checks. Data only, read by `loader` when it attaches.

/// A syscall tracepoint program and the tracepoints it is attached to.
pub struct TracepointHook {
    pub program: &'static str,
    pub tracepoints: &'static [&'static str],
}

/// Every program in the object and where it goes. One program serves every syscall whose entry
/// (or exit) it handles alike, told apart by `__syscall_nr`: each program is verified once, and
/// the path scan is most of the verifier's work.
pub const TRACEPOINT_HOOKS: &[TracepointHook] = &[
    TracepointHook {
        program: "bind_enter",
        tracepoints: &["sys_enter_bind"],
    },
    TracepointHook {
        program: "bind_exit",
        tracepoints: &["sys_exit_bind"],
    },
    TracepointHook {
        program: "path_enter",
        tracepoints: &[
            "sys_enter_unlink",
            "sys_enter_rmdir",
            "sys_enter_unlinkat",
            "sys_enter_mknod",
            "sys_enter_mknodat",
            "sys_enter_mkdir",
            "sys_enter_mkdirat",
            "sys_enter_rename",
            "sys_enter_renameat",
            "sys_enter_renameat2",
        ],
    },
    TracepointHook {
        program: "rename_target_enter",
        tracepoints: &[
            "sys_enter_rename",
            "sys_enter_renameat",
            "sys_enter_renameat2",
        ],
    },
    TracepointHook {
        program: "path_exit",
        tracepoints: &[
            "sys_exit_unlink",
            "sys_exit_unlinkat",
            "sys_exit_rmdir",
            "sys_exit_mknod",
            "sys_exit_mknodat",
            "sys_exit_mkdir",
            "sys_exit_mkdirat",
            "sys_exit_rename",
            "sys_exit_renameat",
            "sys_exit_renameat2",
        ],
    },
];

/// The liveness hint `listen` of a bound socket, attached in every family (no VFS function to
/// prefer).
pub const LISTEN_HOOKS: &[TracepointHook] = &[
    TracepointHook {
        program: "listen_enter",
        tracepoints: &["sys_enter_listen"],
    },
    TracepointHook {
        program: "listen_exit",
        tracepoints: &["sys_exit_listen"],
    },
];

/// Who first contacts a plugin socket (`kind::CONNECT`), attached in every family: the socket a
/// `connect` reached is known only once it returned.
pub const CONNECT_HOOKS: &[TracepointHook] = &[
    TracepointHook {
        program: "connect_enter",
        tracepoints: &["sys_enter_connect"],
    },
    TracepointHook {
        program: "connect_exit",
        tracepoints: &["sys_exit_connect"],
    },
];

/// The tracepoint family's release hints: a `close` of a listening socket's descriptor (the
/// fentry family has `unix_release` instead, which also sees exits), and a `shutdown` of it (the
/// process keeps the descriptor, and every connect is refused from then on). The programs read
/// the descriptor alike from both calls' first argument.
pub const CLOSE_HOOKS: &[TracepointHook] = &[
    TracepointHook {
        program: "close_enter",
        tracepoints: &["sys_enter_close", "sys_enter_shutdown"],
    },
    TracepointHook {
        program: "close_exit",
        tracepoints: &["sys_exit_close", "sys_exit_shutdown"],
    },
];

/// The fentry family's `shutdown` hint (`unix_release` sees no shutdown: the socket lives on).
pub const SHUTDOWN_HOOKS: &[TracepointHook] = &[
    TracepointHook {
        program: "close_enter",
        tracepoints: &["sys_enter_shutdown"],
    },
    TracepointHook {
        program: "close_exit",
        tracepoints: &["sys_exit_shutdown"],
    },
];

/// The fentry family's check for calls whose fexit the kernel skipped (`loss::FEXIT_SKIPPED`):
/// the exit of every syscall by which a user thread reaches the traced VFS functions. `bind`
/// creates its inode with `vfs_mknod` (and unlinks it again when the bind fails after);
/// io_uring runs a `bind` (6.11+) in the submitting thread, while its `unlinkat`, `mkdirat` and
/// `renameat` always go to its worker threads, which pass no syscall exit (docs/operations.md).
pub const IN_FLIGHT_CHECK: TracepointHook = TracepointHook {
    program: "in_flight_check",
    tracepoints: &[
        "sys_exit_bind",
        "sys_exit_mknod",
        "sys_exit_mknodat",
        "sys_exit_mkdir",
        "sys_exit_mkdirat",
        "sys_exit_unlink",
        "sys_exit_unlinkat",
        "sys_exit_rmdir",
        "sys_exit_rename",
        "sys_exit_renameat",
        "sys_exit_renameat2",
        "sys_exit_io_uring_enter",
    ],
};

/// Tracepoints a kernel may lack by its configuration (`CONFIG_IO_URING=n`), attached where
/// they exist: without io_uring, no call comes that way.
pub const OPTIONAL_TRACEPOINTS: &[&str] = &["sys_exit_io_uring_enter"];

/// An fentry or fexit program of the preferred family and the kernel function it traces.
pub struct FunctionHook {
    pub program: &'static str,
    /// fexit (after the function returned, with its result) or fentry (before it ran).
    pub exit: bool,
    pub function: &'static str,
}

/// The fentry/fexit event programs, one fexit per VFS function that makes or removes an entry
/// (unix `bind` creates its socket inode through `vfs_mknod`) and an fentry on each that counts
/// its calls in (`in_flight`), in the order they are attached, after [`IN_FLIGHT_CHECK`]: every
/// exit check, then every fexit, then the fentries. Each attachment rebuilds the function's
/// trampoline, so a call inside the function then leaves without the fexit programs it entered
/// with; in this order no such call was counted in (its fentry was not there yet), so the
/// agent's own start counts no loss for calls it never followed, and every call counted in
/// meets an fexit and an exit check already attached (a later rebuild by someone else skips
/// that fexit, and the check counts it). A call in flight during the attachment is the start's
/// race, as in every family (no hook sees a call that began before it existed): the start's
/// walk, which follows the attachment, sees what the call did if it returned before the walk
/// looked, the safety pass otherwise.
pub const FUNCTION_HOOKS: &[FunctionHook] = &[
    FunctionHook {
        program: "vfs_mknod_exit",
        exit: true,
        function: "vfs_mknod",
    },
    FunctionHook {
        program: "vfs_mkdir_exit",
        exit: true,
        function: "vfs_mkdir",
    },
    FunctionHook {
        program: "vfs_unlink_exit",
        exit: true,
        function: "vfs_unlink",
    },
    FunctionHook {
        program: "vfs_rmdir_exit",
        exit: true,
        function: "vfs_rmdir",
    },
    FunctionHook {
        program: "vfs_rename_exit",
        exit: true,
        function: "vfs_rename",
    },
    FunctionHook {
        program: "vfs_mknod_enter",
        exit: false,
        function: "vfs_mknod",
    },
    FunctionHook {
        program: "vfs_mkdir_enter",
        exit: false,
        function: "vfs_mkdir",
    },
    FunctionHook {
        program: "vfs_unlink_enter",
        exit: false,
        function: "vfs_unlink",
    },
    FunctionHook {
        program: "vfs_rmdir_enter",
        exit: false,
        function: "vfs_rmdir",
    },
    FunctionHook {
        program: "vfs_rename_enter",
        exit: false,
        function: "vfs_rename",
    },
    FunctionHook {
        program: "unix_release_enter",
        exit: false,
        function: "unix_release",
    },
];

#[cfg(test)]
mod tests {
    use super::*;

    /// The order `FUNCTION_HOOKS` documents: every fexit before any fentry, so no call is
    /// counted in before its function's fexit is there; and every function with an fexit has
    /// an fentry counting its calls in.
    #[test]
    fn every_fexit_attaches_before_any_fentry_and_has_one() {
        let first_fentry = FUNCTION_HOOKS.iter().position(|hook| !hook.exit);
        let last_fexit = FUNCTION_HOOKS.iter().rposition(|hook| hook.exit);
        assert!(
            matches!((first_fentry, last_fexit), (Some(entry), Some(exit)) if exit < entry),
            "{first_fentry:?} {last_fexit:?}"
        );
        for exit in FUNCTION_HOOKS.iter().filter(|hook| hook.exit) {
            assert!(
                FUNCTION_HOOKS
                    .iter()
                    .any(|hook| !hook.exit && hook.function == exit.function),
                "nothing counts {}'s calls in",
                exit.function
            );
        }
    }

    /// Every syscall whose exit the tracepoint family reports is checked in the fentry family.
    #[test]
    fn the_exit_checks_cover_every_path_syscall() {
        let path_exits = TRACEPOINT_HOOKS
            .iter()
            .filter(|hook| hook.program.ends_with("_exit"))
            .flat_map(|hook| hook.tracepoints.iter());
        for tracepoint in path_exits {
            assert!(
                IN_FLIGHT_CHECK.tracepoints.contains(tracepoint),
                "{tracepoint}"
            );
        }
    }
}
