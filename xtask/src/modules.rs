//! `cargo xtask modules`: the agent's module graph, and a check that it has no cycle.
//!
//! Each top-level module of `agent/src` (a room: `executor`, `state`, `telemetry`, ...) is a node;
//! an edge `a -> b` means some file of `a`, outside its `#[cfg(test)] mod tests`, names `crate::b`
//! (in a path or a `use crate::{...}` group). A cycle means two rooms each need the other, so
//! neither can be read, tested or changed alone; `cargo xtask lint` fails on one. This reads the
//! source text rather than compiling it: cheap, and enough because the agent only reaches other
//! rooms through `crate::` paths (`super::` stays inside a room).

use anyhow::{Context, bail};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Room -> (room it imports -> files that import it).
type Graph = BTreeMap<String, BTreeMap<String, BTreeSet<String>>>;

/// Prints the graph and fails if it has a cycle.
pub fn modules() -> anyhow::Result<()> {
    let graph = graph(&crate::shell::workspace_root().join("agent/src"))?;
    for (room, imports) in &graph {
        let names: Vec<&str> = imports.keys().map(String::as_str).collect();
        println!("{room} -> {}", names.join(", "));
    }
    check()
}

/// Fails, naming the rooms and the files involved, if the agent's module graph has a cycle.
pub fn check() -> anyhow::Result<()> {
    let graph = graph(&crate::shell::workspace_root().join("agent/src"))?;
    let cycles = cycles(&graph);
    if cycles.is_empty() {
        println!("xtask: modules: no import cycle among agent/src's modules");
        return Ok(());
    }
    for cycle in &cycles {
        eprintln!("import cycle among agent/src modules: {}", cycle.join(", "));
        for a in cycle {
            for (b, files) in &graph[a] {
                if cycle.contains(b) {
                    eprintln!("  {a} -> {b} in {files:?}");
                }
            }
        }
    }
    bail!("{} import cycle(s) among agent/src's modules", cycles.len())
}

/// Reads every `.rs` file under `src` into the room graph.
fn graph(src: &Path) -> anyhow::Result<Graph> {
    let mut graph = Graph::new();
    let mut pending = vec![src.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?
        {
            let path = entry?.path();
            if path.is_dir() {
                pending.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let relative = path.strip_prefix(src)?.to_string_lossy().into_owned();
            let Some(room) = room_of(&relative) else {
                continue;
            };
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            let imports = graph.entry(room.clone()).or_default();
            for target in imports_of(&text) {
                if target != room {
                    imports.entry(target).or_default().insert(relative.clone());
                }
            }
        }
    }
    Ok(graph)
}

/// `executor/claims.rs` -> `executor`; `watcher.rs` -> `watcher`; the crate root has no room.
fn room_of(relative: &str) -> Option<String> {
    let first = relative.split('/').next()?;
    let room = first.strip_suffix(".rs").unwrap_or(first);
    (!matches!(room, "lib" | "main")).then(|| room.to_string())
}

/// The rooms a file names through `crate::`, its unit tests left out.
fn imports_of(text: &str) -> BTreeSet<String> {
    let code = text
        .split("#[cfg(test)]\nmod tests")
        .next()
        .unwrap_or_default();
    let code: String = code
        .lines()
        .map(|line| line.split("//").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n");
    let mut rooms = BTreeSet::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            rooms.extend(group_heads(group));
        } else {
            rooms.insert(ident(rest).to_string());
        }
    }
    rooms.retain(|r| !r.is_empty());
    rooms
}

/// The first path segment of each item in a `{a, b::c, d::{e, f}}` group (`group` starts after
/// its opening brace).
fn group_heads(group: &str) -> Vec<String> {
    let mut heads = Vec::new();
    let mut depth = 0usize;
    let mut at_item_start = true;
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => at_item_start = true,
            c if at_item_start && !c.is_whitespace() => {
                heads.push(ident(&group[i..]).to_string());
                at_item_start = false;
            }
            _ => {}
        }
    }
    heads
}

/// The identifier at the start of `text`.
fn ident(text: &str) -> &str {
    let end = text
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    &text[..end]
}

/// Strongly connected components of more than one room (Tarjan's algorithm).
fn cycles(graph: &Graph) -> Vec<Vec<String>> {
    struct Walk<'a> {
        graph: &'a Graph,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        found: Vec<Vec<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a str) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            for w in self.graph.get(v).into_iter().flat_map(|m| m.keys()) {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w]);
                    self.low.insert(v, low);
                } else if self.stack.contains(&w) {
                    let low = self.low[v].min(self.index[w]);
                    self.low.insert(v, low);
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    component.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.found.push(component);
                }
            }
        }
    }
    let mut walk = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        found: Vec::new(),
    };
    for room in graph.keys() {
        if !walk.index.contains_key(room.as_str()) {
            walk.visit(room);
        }
    }
    walk.found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn use_groups_and_paths_name_their_first_segment() {
        let text = "use crate::state::{a, b};\nuse crate::{executor::X, handler::{self, Y}};\nfn f() { crate::memory::trim(); }\n// crate::watcher in a comment\n#[cfg(test)]\nmod tests {\n use crate::cli;\n}";
        let rooms: Vec<String> = imports_of(text).into_iter().collect();
        assert_eq!(rooms, ["executor", "handler", "memory", "state"]);
    }

    #[test]
    fn a_cycle_is_found_and_a_chain_is_not() {
        let edge = |a: &str, b: &str, g: &mut Graph| {
            g.entry(a.into()).or_default().entry(b.into()).or_default();
            g.entry(b.into()).or_default();
        };
        let mut chain = Graph::new();
        edge("reconciler", "executor", &mut chain);
        edge("executor", "state", &mut chain);
        assert!(cycles(&chain).is_empty());
        let mut cycle = chain.clone();
        edge("state", "reconciler", &mut cycle);
        assert_eq!(cycles(&cycle), [["executor", "reconciler", "state"]]);
    }
}
