//! A crate's module tree and its import graphs, one per level, and the cycles in them.
//!
//! A file's module path comes from where it is (`executor/mod.rs` and `registration.rs` are
//! `executor` and `registration`, `event_source/ebpf/pins.rs` is `event_source::ebpf::pins`);
//! a file a `#[cfg(test)] mod name;` declares is test code and left out. Every path a file names
//! (`crate::`, `super::`, `self::`, or a child module's name) is resolved to the module it
//! reaches. A *level* is a module with child module files: its nodes are its children (each with
//! everything below it) and, except at the crate root, its own file. An edge `a -> b` at a level
//! means a file of `a` names something of `b`. A name `b` only re-exports (`pub use c::X` in `b`'s
//! file, X named nowhere else in it) leads to `c`, the module that has it, so a facade module
//! is not a dependency of its children. The crate root's level is the rooms: the graph
//! `rooms.rs`'s table states.

use super::items::{Facts, scan};
use anyhow::Context;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

/// A source file: its workspace-relative path, module path and facts.
pub struct SourceFile {
    pub path: String,
    pub module: Vec<String>,
    pub facts: Facts,
    /// The file's first `//!` line, without the `//!`.
    pub first_doc: Option<String>,
}

/// Node -> node it imports -> file of the importing node -> first line that does.
pub type Graph = BTreeMap<String, BTreeMap<String, BTreeMap<String, usize>>>;

/// Reads and scans every `.rs` file under `root/dir`, test-only module files left out.
pub fn load(root: &Path, dir: &str) -> anyhow::Result<Vec<SourceFile>> {
    let mut files = Vec::new();
    let mut pending = vec![root.join(dir)];
    while let Some(at) = pending.pop() {
        let entries =
            std::fs::read_dir(&at).with_context(|| format!("reading {}", at.display()))?;
        for entry in entries {
            let path = entry?.path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path)
                    .with_context(|| format!("reading {}", path.display()))?;
                let inside = path
                    .strip_prefix(root.join(dir))?
                    .to_string_lossy()
                    .into_owned();
                files.push(SourceFile {
                    path: format!("{dir}/{inside}"),
                    module: module_of(&inside),
                    first_doc: first_doc(&text),
                    facts: scan(&text),
                });
            }
        }
    }
    files.sort_by(|a, b| a.path.cmp(&b.path));
    let test_modules: Vec<Vec<String>> = files
        .iter()
        .flat_map(|f| {
            f.facts
                .mods
                .iter()
                .filter(|m| m.test)
                .map(|m| join(&f.module, &m.scope, &m.name))
        })
        .collect();
    files.retain(|f| !test_modules.iter().any(|t| f.module.starts_with(t)));
    Ok(files)
}

/// `executor/mod.rs` and `executor.rs` -> `[executor]`; `lib.rs`, `main.rs` -> `[]`.
fn module_of(inside: &str) -> Vec<String> {
    let stem = inside.strip_suffix(".rs").unwrap_or(inside);
    let mut module: Vec<String> = stem.split('/').map(str::to_string).collect();
    if module.last().is_some_and(|m| m == "mod") || matches!(stem, "lib" | "main") {
        module.pop();
    }
    module
}

fn first_doc(text: &str) -> Option<String> {
    let line = text.lines().find(|l| l.trim_start().starts_with("//!"))?;
    Some(
        line.trim_start()
            .trim_start_matches("//!")
            .trim()
            .to_string(),
    )
}

fn join(module: &[String], scope: &[String], name: &str) -> Vec<String> {
    let mut path = module.to_vec();
    path.extend(scope.iter().cloned());
    path.push(name.to_string());
    path
}

/// Every level of the crate (the root first), each with its graph.
pub fn levels(files: &[SourceFile]) -> Vec<(Vec<String>, Graph)> {
    let mut levels: BTreeSet<Vec<String>> = BTreeSet::from([Vec::new()]);
    for f in files.iter().filter(|f| !f.module.is_empty()) {
        levels.insert(f.module[..f.module.len() - 1].to_vec());
    }
    let modules = all_modules(files);
    levels
        .into_iter()
        .map(|level| {
            let graph = level_graph(files, &modules, &level);
            (level, graph)
        })
        .collect()
}

/// Every module path: files and the `mod` items in them.
fn all_modules(files: &[SourceFile]) -> BTreeSet<Vec<String>> {
    let mut modules = BTreeSet::new();
    for f in files {
        modules.insert(f.module.clone());
        for m in f.facts.mods.iter().filter(|m| !m.test) {
            modules.insert(join(&f.module, &m.scope, &m.name));
        }
    }
    modules
}

/// Where a path named in module `here` leads, as an absolute module path plus item names.
fn resolve(
    modules: &BTreeSet<Vec<String>>,
    here: &[String],
    segments: &[String],
) -> Option<Vec<String>> {
    let first = segments.first()?.as_str();
    let (mut at, mut rest) = match first {
        "crate" => (Vec::new(), &segments[1..]),
        "self" => (here.to_vec(), &segments[1..]),
        "super" => (here.to_vec(), segments),
        _ if modules.contains(&join(here, &[], first)) => (here.to_vec(), segments),
        _ => return None,
    };
    while rest.first().is_some_and(|s| s == "super") {
        at.pop()?;
        rest = &rest[1..];
    }
    at.extend(rest.iter().filter(|s| *s != "*").cloned());
    Some(at)
}

/// The graph at `level`: which of its nodes names which.
fn level_graph(files: &[SourceFile], modules: &BTreeSet<Vec<String>>, level: &[String]) -> Graph {
    let children: BTreeSet<&str> = files
        .iter()
        .filter(|f| f.module.len() > level.len() && f.module.starts_with(level))
        .map(|f| f.module[level.len()].as_str())
        .collect();
    let bindings = bindings(files, modules, level);
    let node = |module: &[String]| -> Option<String> {
        let rest = module.strip_prefix(level)?;
        let name = match rest.first() {
            Some(s) if children.contains(s.as_str()) => s.clone(),
            Some(s) => match bindings.get(s.as_str()).and_then(|b| b.strip_prefix(level)) {
                Some([c, ..]) if children.contains(c.as_str()) => c.clone(),
                None if bindings.contains_key(s.as_str()) => return None,
                _ => String::new(),
            },
            None => String::new(),
        };
        match (name.is_empty(), level.is_empty()) {
            (true, true) => None,
            (true, false) => Some(level.join("::")),
            (false, _) => Some(join(level, &[], &name).join("::")),
        }
    };
    let mut graph = Graph::new();
    for c in &children {
        graph.entry(join(level, &[], c).join("::")).or_default();
    }
    for f in files.iter().filter(|f| f.module.starts_with(level)) {
        let Some(from) = node(&f.module) else {
            continue;
        };
        for (scope, segments, line) in references(f) {
            let mut here = f.module.clone();
            here.extend(scope.iter().cloned());
            let to = resolve(modules, &here, segments).and_then(|target| node(&target));
            if let Some(to) = to.filter(|to| *to != from) {
                let files = graph
                    .entry(from.clone())
                    .or_default()
                    .entry(to)
                    .or_default();
                let first = files.entry(f.path.clone()).or_insert(line);
                *first = (*first).min(line);
            }
        }
    }
    graph
}

/// What a file depends on: its paths, and its `use`s except pure re-exports.
fn references(f: &SourceFile) -> impl Iterator<Item = (&[String], &[String], usize)> {
    let uses = f
        .facts
        .uses
        .iter()
        .filter(|u| !u.public || u.named_elsewhere);
    let uses = uses.map(|u| (u.scope.as_slice(), u.path.as_slice(), u.line));
    let paths = f.facts.paths.iter();
    uses.chain(paths.map(|p| (p.scope.as_slice(), p.segments.as_slice(), p.line)))
}

/// The names the level's own file binds with `use` at its top, each with where it leads.
fn bindings(
    files: &[SourceFile],
    modules: &BTreeSet<Vec<String>>,
    level: &[String],
) -> HashMap<String, Vec<String>> {
    let own = files.iter().filter(|f| f.module == level);
    let uses = own.flat_map(|f| f.facts.uses.iter().filter(|u| u.scope.is_empty()));
    uses.filter_map(|u| Some((u.bound.clone()?, resolve(modules, level, &u.path)?)))
        .collect()
}

/// Strongly connected components of more than one node (Tarjan's algorithm), sorted.
pub fn cycles(graph: &Graph) -> Vec<Vec<String>> {
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
    for node in graph.keys() {
        if !walk.index.contains_key(node.as_str()) {
            walk.visit(node);
        }
    }
    walk.found.sort();
    walk.found
}

/// The edges of `graph` inside `cycle`, one line each with the files and lines that make them.
pub fn describe_cycle(graph: &Graph, cycle: &[String]) -> Vec<String> {
    let mut lines = Vec::new();
    for a in cycle {
        for (b, files) in graph.get(a).into_iter().flatten() {
            if cycle.contains(b) {
                let at: Vec<String> = files.iter().map(|(f, l)| format!("{f}:{l}")).collect();
                lines.push(format!("{a} -> {b}: {}", at.join(", ")));
            }
        }
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str, text: &str) -> SourceFile {
        let inside = path.strip_prefix("src/").unwrap_or(path);
        SourceFile {
            path: path.into(),
            module: module_of(inside),
            first_doc: first_doc(text),
            facts: scan(text),
        }
    }

    fn edges(graph: &Graph) -> Vec<String> {
        let pairs = graph
            .iter()
            .flat_map(|(a, to)| to.keys().map(move |b| format!("{a} -> {b}")));
        pairs.collect()
    }

    fn crate_of() -> Vec<SourceFile> {
        vec![
            file("src/lib.rs", "pub mod exec;\npub mod state;\n"),
            file(
                "src/state.rs",
                "//! State.\npub struct S;\n#[cfg(test)]\nmod tests { use crate::exec::X; }\n",
            ),
            file(
                "src/exec/mod.rs",
                "mod op;\nmod admit;\npub use op::Outcome;\npub use admit::Admit;\npub struct Exec;\nfn run() { op::go(); let _: Admit; }\n",
            ),
            file(
                "src/exec/op.rs",
                "use super::Exec;\npub struct Outcome;\npub fn go() { crate::exec::admit::check(); }\n",
            ),
            file(
                "src/exec/admit.rs",
                "use crate::state::S;\npub struct Admit;\npub fn check() { super::Outcome; }\n",
            ),
        ]
    }

    #[test]
    fn rooms_are_the_crate_root_level() {
        let files = crate_of();
        let levels = levels(&files);
        assert_eq!(levels[0].0, Vec::<String>::new());
        assert_eq!(edges(&levels[0].1), ["exec -> state"]);
        assert_eq!(levels[0].1["exec"]["state"]["src/exec/admit.rs"], 1);
        assert!(cycles(&levels[0].1).is_empty());
    }

    #[test]
    fn a_room_s_files_form_the_level_below_and_re_exports_lead_through() {
        let files = crate_of();
        let (level, graph) = &levels(&files)[1];
        assert_eq!(level, &["exec"]);
        // `super::Outcome` in admit.rs leads to op.rs (exec/mod.rs only re-exports it), while
        // `Admit` is named in mod.rs's code, so that re-export is mod.rs's own dependency.
        assert_eq!(
            edges(graph),
            [
                "exec -> exec::admit",
                "exec -> exec::op",
                "exec::admit -> exec::op",
                "exec::op -> exec",
                "exec::op -> exec::admit"
            ]
        );
        assert_eq!(cycles(graph), [["exec", "exec::admit", "exec::op"]]);
        let described = describe_cycle(graph, &cycles(graph)[0]);
        assert!(
            described.contains(&"exec::op -> exec: src/exec/op.rs:1".to_string()),
            "{described:?}"
        );
    }

    #[test]
    fn a_chain_has_no_cycle() {
        let mut graph = Graph::new();
        graph
            .entry("a".into())
            .or_default()
            .entry("b".into())
            .or_default();
        graph
            .entry("b".into())
            .or_default()
            .entry("c".into())
            .or_default();
        assert!(cycles(&graph).is_empty());
        graph
            .entry("c".into())
            .or_default()
            .entry("a".into())
            .or_default();
        assert_eq!(cycles(&graph), [["a", "b", "c"]]);
    }

    #[test]
    fn test_module_files_are_left_out() {
        let root = std::env::temp_dir().join(format!("xtask-graph-{}", std::process::id()));
        std::fs::create_dir_all(root.join("src/a")).unwrap();
        std::fs::write(root.join("src/lib.rs"), "mod a;\n").unwrap();
        std::fs::write(root.join("src/a/mod.rs"), "#[cfg(test)]\nmod tests;\n").unwrap();
        std::fs::write(root.join("src/a/tests.rs"), "fn t() {}\n").unwrap();
        let files = load(&root, "src").unwrap();
        std::fs::remove_dir_all(&root).unwrap();
        let paths: Vec<&str> = files.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(paths, ["src/a/mod.rs", "src/lib.rs"]);
    }
}
