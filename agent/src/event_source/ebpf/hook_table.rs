//! Where each program of the object goes: the syscall tracepoints of each family, the socket
//! hints every family attaches, and the fentry/fexit programs on the VFS functions. Data only,
//! read by `loader` when it attaches.

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

/// An fentry or fexit program of the preferred family and the kernel function it traces.
pub struct FunctionHook {
    pub program: &'static str,
    /// fexit (after the function returned, with its result) or fentry (before it ran).
    pub exit: bool,
    pub function: &'static str,
}

/// The fentry/fexit event programs: one per VFS function that makes or removes an entry. Unix
/// `bind` creates its socket inode through `vfs_mknod`.
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
        program: "vfs_rename_enter",
        exit: false,
        function: "vfs_rename",
    },
    FunctionHook {
        program: "vfs_rename_exit",
        exit: true,
        function: "vfs_rename",
    },
    FunctionHook {
        program: "unix_release_enter",
        exit: false,
        function: "unix_release",
    },
];
