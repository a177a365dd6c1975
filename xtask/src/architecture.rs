//! `cargo xtask architecture`: the architecture as a checked contract, part of `cargo xtask lint`.
//!
//! Four checks, every finding listed (none stops the others):
//! - the agent's rooms (top-level modules of `agent/src`) import exactly what the table in
//!   [`rooms`] allows, and every import it allows is still made;
//! - no import cycle at any level of the agent's or xtask's module tree: among the rooms, among a
//!   room's files and sub-modules, and so on down ([`graph`]);
//! - functions of at most 80 lines of code and files of at most 500 (or saying why) in the
//!   product and tooling crates ([`sizes`]); the test targets' sizes are only counted;
//! - docs/architecture.md's generated section is what the table and the source say ([`doc`]).
//!
//! It reads the source text rather than compiling it: a lexer that blanks comments and literals
//! ([`lex`]) and a scan of the tokens left ([`items`]). `syn` would parse more exactly, but in the
//! dev profile xtask is built with it took 3 s for the workspace's 2.4 MB (0.8 s for
//! `proc-macro2`'s tokenizer alone), where this takes a few tens of milliseconds; and the agent
//! only reaches other modules through paths, which tokens show.

mod debts;
mod doc;
mod graph;
mod items;
mod lex;
mod rooms;
mod sizes;

use graph::{Graph, SourceFile};
use sizes::Sizes;
use std::collections::BTreeMap;
use std::path::Path;

/// The crates the size limits hold in.
const ENFORCED: &[&str] = &[
    "agent/src",
    "agent-ebpf/src",
    "proto/src",
    "tests/src",
    "xtask/src",
];
/// The test targets, whose sizes are only counted.
const TEST_TARGETS: &[&str] = &["agent/tests", "tests/tests"];
/// The crates whose module trees must be free of cycles.
const ACYCLIC: &[&str] = &["agent/src", "xtask/src"];

#[derive(clap::Args)]
pub struct Options {
    /// Rewrite docs/architecture.md's generated section (between `<!-- rooms:begin` and
    /// `<!-- rooms:end -->`) before checking.
    #[arg(long)]
    write: bool,
}

/// Prints the rooms, their sizes and the longest functions, then every finding; fails if any.
pub fn architecture(options: &Options) -> anyhow::Result<()> {
    let survey = Survey::read(&crate::shell::workspace_root())?;
    if options.write {
        doc::write(&crate::shell::workspace_root(), &survey.section())?;
    }
    survey.print_overview();
    survey.verdict()
}

/// `cargo xtask lint`'s part: every finding, or one line saying all holds.
pub fn check() -> anyhow::Result<()> {
    Survey::read(&crate::shell::workspace_root())?.verdict()
}

/// Everything the checks look at, read once.
struct Survey {
    root: std::path::PathBuf,
    crates: BTreeMap<&'static str, Vec<SourceFile>>,
    test_targets: Vec<SourceFile>,
    rooms: Graph,
    room_lines: BTreeMap<String, usize>,
}

impl Survey {
    fn read(root: &Path) -> anyhow::Result<Survey> {
        let mut crates = BTreeMap::new();
        for dir in ENFORCED {
            crates.insert(*dir, graph::load(root, dir)?);
        }
        let mut test_targets = Vec::new();
        for dir in TEST_TARGETS {
            test_targets.extend(graph::load(root, dir)?);
        }
        let agent = &crates["agent/src"];
        let rooms = graph::levels(agent).swap_remove(0).1;
        let mut room_lines = BTreeMap::new();
        for f in agent.iter().filter(|f| !f.module.is_empty()) {
            *room_lines.entry(f.module[0].clone()).or_default() += Sizes::of([f]).lines();
        }
        Ok(Survey {
            root: root.to_path_buf(),
            crates,
            test_targets,
            rooms,
            room_lines,
        })
    }

    fn enforced(&self) -> Sizes {
        Sizes::of(self.crates.values().flatten())
    }

    fn section(&self) -> String {
        let agent = Sizes::of(&self.crates["agent/src"]);
        doc::section(&doc::Inputs {
            room_lines: &self.room_lines,
            agent: &agent,
            enforced: &self.enforced(),
            enforced_names: "`agent/src`, `agent-ebpf/src`, `proto/src`, `tests/src` and `xtask/src`",
        })
    }

    /// Every import cycle, at every level of each acyclic crate, with the files making it.
    fn cycles(&self) -> Vec<String> {
        let mut found = Vec::new();
        for dir in ACYCLIC {
            for (level, graph) in graph::levels(&self.crates[dir]) {
                for cycle in graph::cycles(&graph) {
                    let within = match level.is_empty() {
                        true => format!("{dir}'s top-level modules"),
                        false => format!("the modules of {dir}'s `{}`", level.join("::")),
                    };
                    let mut text = format!("import cycle among {within}: {}", cycle.join(", "));
                    for edge in graph::describe_cycle(&graph, &cycle) {
                        text.push_str(&format!("\n      {edge}"));
                    }
                    found.push(text);
                }
            }
        }
        found
    }

    /// Every finding, grouped by check.
    fn findings(&self) -> Vec<(&'static str, Vec<String>)> {
        let doc = doc::check(&self.root, &self.section());
        vec![
            ("rooms table", rooms::check(&self.rooms)),
            ("import cycles", self.cycles()),
            ("sizes", self.enforced().problems()),
            ("docs", doc.into_iter().collect()),
        ]
    }

    fn verdict(&self) -> anyhow::Result<()> {
        let tests = Sizes::of(&self.test_targets);
        println!(
            "xtask: architecture: test targets ({}, not enforced): {} of {} files over {} lines of code, {} functions over {}",
            TEST_TARGETS.join(", "),
            tests.files_over().len(),
            tests.files.len(),
            sizes::FILE_LIMIT,
            tests.functions_over().count(),
            sizes::FUNCTION_LIMIT
        );
        let all = self.findings();
        let (findings, known) = debts::settle(&all, debts::DEBTS);
        for (finding, debt) in &known {
            println!("xtask: architecture: known debt ({}): {finding}", debt.why);
        }
        let total: usize = findings.iter().map(|(_, f)| f.len()).sum();
        if total == 0 {
            println!(
                "xtask: architecture: rooms as {} says, no import cycle, sizes within limits, {} up to date",
                rooms::TABLE,
                doc::DOC
            );
            return Ok(());
        }
        for (check, problems) in findings.iter().filter(|(_, p)| !p.is_empty()) {
            eprintln!("architecture: {check}: {} problem(s)", problems.len());
            for problem in problems {
                eprintln!("  - {problem}");
            }
        }
        let counts: Vec<String> = findings
            .iter()
            .filter(|(_, p)| !p.is_empty())
            .map(|(check, p)| format!("{check}: {}", p.len()))
            .collect();
        anyhow::bail!("architecture: {total} problem(s) ({})", counts.join(", "))
    }

    /// The rooms with their imports and lines of code, and the ten longest functions.
    fn print_overview(&self) {
        for (room, imports) in &self.rooms {
            let names: Vec<&str> = imports.keys().map(String::as_str).collect();
            let lines = self.room_lines.get(room).copied().unwrap_or_default();
            println!("{room} ({lines} lines) -> {}", names.join(", "));
        }
        let total: usize = self.room_lines.values().sum();
        println!(
            "agent/src: {total} lines of code in {} rooms",
            self.room_lines.len()
        );
        println!("longest functions ({}):", ENFORCED.join(", "));
        for f in self.enforced().functions.iter().take(10) {
            println!("  {}:{} {}: {}", f.path, f.line, f.name, f.lines);
        }
    }
}
