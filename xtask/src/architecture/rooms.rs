//! The agent's rooms and the rooms each may import: the architecture as a checked contract.
//!
//! A Rust table rather than a data file: it needs no parser, a typo in its shape is a compile
//! error, and it sits beside the check that reads it. `cargo xtask lint` fails when the code
//! imports a room its entry does not list, when an entry lists a room no code imports any more
//! (so the table cannot go stale), and when a room is missing here or listed but gone; each
//! message says which line to change. An import is written `"room"` or `"room (why)"`: the why
//! is shown in docs/architecture.md's generated section. Keep entries and imports sorted.

use super::graph::Graph;

/// One top-level module of `agent/src`.
pub struct Room {
    pub name: &'static str,
    /// What the room is, in one line (docs/architecture.md's prose says the rest).
    pub is: &'static str,
    /// The rooms it may import, each `"room"` or `"room (why)"`.
    pub imports: &'static [&'static str],
}

impl Room {
    /// The imported rooms' names, without their whys.
    pub fn import_names(&self) -> impl Iterator<Item = &'static str> {
        self.imports.iter().map(|i| import_name(i))
    }
}

/// `"state (SocketId)"` -> `"state"`.
pub fn import_name(import: &str) -> &str {
    import.split(' ').next().unwrap_or_default()
}

/// Where this table is, for the messages that ask to change it.
pub const TABLE: &str = "xtask/src/architecture/rooms.rs";

pub const ROOMS: &[Room] = &[
    Room {
        name: "admin",
        is: "the operator API (`pluginagent.v1.Agent`) on a Unix socket: its server and the CLI's client",
        imports: &[
            "event_source (SourceStart: how the source started, for status)",
            "handler",
            "kernel (the features status reports)",
            "liveness (who serves a registered plugin, for list)",
            "notifications",
            "operations (PolicyReload)",
            "persist (RestoreReport: what the state file carried over, for status)",
            "provenance",
            "registration (name limits)",
            "serving",
            "state",
            "telemetry",
            "unix_channel",
        ],
    },
    Room {
        name: "agent",
        is: "assembles the flow from an `AgentConfig` and owns its tasks and their shutdown",
        imports: &[
            "admin",
            "config",
            "event_source",
            "executor",
            "handler",
            "kernel",
            "kubelet",
            "liveness",
            "mode",
            "notifications",
            "operations",
            "persist (restored before the watcher starts, its writer stopped last)",
            "policy",
            "privileges",
            "provenance",
            "reconciler",
            "runtime_dir",
            "shutdown (its deadline)",
            "state",
            "telemetry",
            "watcher",
        ],
    },
    Room {
        name: "cli",
        is: "the command line, one file per subcommand; the top of the graph",
        imports: &[
            "admin",
            "agent",
            "config",
            "event_source",
            "executor",
            "handler",
            "kernel",
            "mode",
            "persist",
            "policy",
            "reconciler",
            "registration",
            "runtime_dir",
            "telemetry",
            "text",
        ],
    },
    Room {
        name: "config",
        is: "the TOML file, and where a policy reload reads the rules",
        imports: &["mode", "policy"],
    },
    Room {
        name: "event_source",
        is: "the kernel-facing side: eBPF, fanotify or inotify reports turned into `FsEvent` hints",
        imports: &[
            "kernel (`FentryFinding`)",
            "memory",
            "mounts",
            "provenance (`Actor`, who made a change)",
            "runtime_dir",
        ],
    },
    Room {
        name: "executor",
        is: "runs operations: one per path, bounded concurrency, backoff, retries",
        imports: &[
            "handler",
            "liveness",
            "memory",
            "mode",
            "registration",
            "shutdown",
            "state",
            "telemetry",
        ],
    },
    Room {
        name: "handler",
        is: "the consumer side: the `PluginHandler` trait, the registry, the two transports",
        imports: &["unix_channel"],
    },
    Room {
        name: "kernel",
        is: "the kernel features the agent uses that not every kernel has, probed once at start",
        imports: &[],
    },
    Room {
        name: "kubelet",
        is: "a running kubelet and the directory it watches, read from `/proc`",
        imports: &[],
    },
    Room {
        name: "liveness",
        is: "whether something still serves a registered plugin (pidfds, one confirming connect)",
        imports: &[
            "handler (Plugin, for the unserved events)",
            "kernel (the pidfd calls: `pidfd_open`, `SO_PEERPIDFD`, pidfs)",
            "notifications",
            "state",
            "telemetry",
        ],
    },
    Room {
        name: "memory",
        is: "returning freed memory to the system after bursts",
        imports: &[],
    },
    Room {
        name: "mode",
        is: "register or observe",
        imports: &[],
    },
    Room {
        name: "mounts",
        is: "the mount table's wake-up for a directory (the watched tree, the eBPF pin set)",
        imports: &[],
    },
    Room {
        name: "notifications",
        is: "the broadcast bus of `AgentEvent`s for the admin API's watchers; never blocks",
        imports: &[
            "handler (`Plugin`)",
            "provenance (what registered and rejected events carry)",
            "state (the view an event's reason is derived from, when it is published)",
        ],
    },
    Room {
        name: "operations",
        is: "what an operation does and what its outcome means (kubelet's operation generator): register, deregister, observe-mode reporting, admission",
        imports: &[
            "event_source (the kernel timestamps' clock)",
            "executor (the seam it implements)",
            "handler",
            "liveness",
            "mode",
            "notifications",
            "persist",
            "policy",
            "provenance",
            "registration",
            "shutdown",
            "state",
            "telemetry",
        ],
    },
    Room {
        name: "persist",
        is: "the registrations on disk: the journal, its compaction, the restore at start",
        imports: &[
            "handler (the registry: an entry is carried on only with its handler)",
            "memory",
            "provenance",
            "state",
        ],
    },
    Room {
        name: "policy",
        is: "who may register what: the `[[policy]]` rules and the verdict on a plugin",
        imports: &["provenance"],
    },
    Room {
        name: "privileges",
        is: "the capabilities needed to start, dropped after",
        imports: &["event_source (what each source needs)"],
    },
    Room {
        name: "provenance",
        is: "who made and who serves a socket: processes, cgroups, pods, read from `/proc`",
        imports: &[],
    },
    Room {
        name: "reconciler",
        is: "what to do per path: desired against actual state; the safety pass",
        imports: &["executor", "state"],
    },
    Room {
        name: "registration",
        is: "the plugin side of the wire: kubelet's pluginregistration client",
        imports: &[
            "liveness (the server's credentials, `liveness::Server`)",
            "state (`SocketId`, to check the socket it dialled is the one desired)",
        ],
    },
    Room {
        name: "runtime",
        is: "the tokio runtime and its scheduler slice",
        imports: &[],
    },
    Room {
        name: "runtime_dir",
        is: "the exclusive lock on the runtime directory",
        imports: &[],
    },
    Room {
        name: "serving",
        is: "the connection gate and timeouts the metrics and admin servers share",
        imports: &[],
    },
    Room {
        name: "shutdown",
        is: "the SIGTERM deadline and the \"start nothing once stopping\" wrapper",
        imports: &[],
    },
    Room {
        name: "state",
        is: "the agent's facts: desired, actual, backoff, queue, safety pass, and their view",
        imports: &[
            "handler (the `Plugin` and handler types an actual-state entry holds)",
            "memory",
            "policy (a refused socket's `Refusal`)",
            "provenance",
        ],
    },
    Room {
        name: "telemetry",
        is: "a sink: metrics, discovery traces, logging, the HTTP server, the OTLP exporter",
        imports: &[
            "event_source (source kind and counters, `RescanReason`)",
            "handler",
            "kernel",
            "memory",
            "provenance (`Contact`, for the first-contact span)",
            "serving",
            "shutdown",
            "state",
            "text",
            "watch_health",
        ],
    },
    Room {
        name: "text",
        is: "escaping what plugins announce before it reaches a terminal or a text log",
        imports: &[],
    },
    Room {
        name: "unix_channel",
        is: "tonic over Unix sockets",
        imports: &[],
    },
    Room {
        name: "watch_health",
        is: "what the last walk could not see, and the conditions other rooms report",
        imports: &["text"],
    },
    Room {
        name: "watcher",
        is: "the watched-directory set: hints turned into desired state by `stat`",
        imports: &[
            "event_source",
            "liveness",
            "mounts",
            "notifications",
            "provenance",
            "state",
            "telemetry",
            "text",
            "watch_health",
        ],
    },
];

/// Every difference between the table and the rooms' graph, each saying what to change.
pub fn check(graph: &Graph) -> Vec<String> {
    let mut problems = Vec::new();
    for (room, imports) in graph {
        let Some(entry) = ROOMS.iter().find(|r| r.name == room) else {
            let names: Vec<String> = imports.keys().map(|i| format!("{i:?}")).collect();
            problems.push(format!(
                "agent/src/{room}: room `{room}` is not in {TABLE}: add `Room {{ name: {room:?}, is: \"...\", imports: &[{}] }}`",
                names.join(", ")
            ));
            continue;
        };
        for (import, files) in imports {
            if !entry.import_names().any(|i| i == import) {
                let at: Vec<String> = files.iter().map(|(f, l)| format!("{f}:{l}")).collect();
                problems.push(format!(
                    "{}: `{room}` imports `{import}`, which {TABLE} does not allow: add {import:?} to `{room}`'s imports there, or remove the import",
                    at.join(", ")
                ));
            }
        }
        for import in entry.import_names().filter(|i| !imports.contains_key(*i)) {
            problems.push(format!(
                "{TABLE}: `{room}` may import `{import}` but no code of it does any more: remove {import:?} from `{room}`'s imports"
            ));
        }
    }
    for entry in ROOMS.iter().filter(|r| !graph.contains_key(r.name)) {
        problems.push(format!(
            "{TABLE}: room `{}` is listed but agent/src has no such module: remove its `Room {{ name: {:?}, .. }}`",
            entry.name, entry.name
        ));
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn the_table_is_sorted_and_names_each_room_once() {
        let names: Vec<&str> = ROOMS.iter().map(|r| r.name).collect();
        assert!(
            names.is_sorted() && names.windows(2).all(|w| w[0] != w[1]),
            "{names:?}"
        );
        for room in ROOMS {
            let imports: Vec<&str> = room.import_names().collect();
            assert!(imports.is_sorted(), "{}: {imports:?}", room.name);
        }
    }

    #[test]
    fn every_difference_says_what_to_change() {
        let mut graph = Graph::new();
        for room in ROOMS {
            let imports = graph.entry(room.name.to_string()).or_default();
            for import in room.import_names() {
                imports
                    .entry(import.into())
                    .or_default()
                    .insert("agent/src/x.rs".into(), 1);
            }
        }
        assert!(check(&graph).is_empty(), "{:?}", check(&graph));
        let mut changed = graph.clone();
        changed
            .get_mut("mode")
            .unwrap()
            .entry("cli".into())
            .or_default()
            .insert("agent/src/mode.rs".into(), 7);
        changed.get_mut("config").unwrap().remove("policy");
        changed.remove("kubelet");
        changed.insert("newroom".into(), BTreeMap::new());
        let problems = check(&changed);
        assert_eq!(problems.len(), 4, "{problems:#?}");
        assert!(
            problems[0].contains("`config` may import `policy`")
                && problems[0].contains("remove \"policy\"")
        );
        assert!(
            problems[1].starts_with("agent/src/mode.rs:7: `mode` imports `cli`")
                && problems[1].contains("add \"cli\" to `mode`'s imports")
        );
        assert!(problems[2].contains("room `newroom` is not in"));
        assert!(problems[3].contains("room `kubelet` is listed"));
    }
}
