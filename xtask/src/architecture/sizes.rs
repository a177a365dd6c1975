//! Size limits: a function of at most 80 lines of code, a file of at most 500.
//!
//! A line of code is a line with anything but whitespace outside comments, outside
//! `#[cfg(test)]` items (see [`lex`](super::lex), [`items`](super::items)). A function is
//! counted from its `fn` line to its closing brace. A file may be over 500 lines when its first
//! `//!` line says why, in these words: `over 500 lines because ...` (for example
//! `//! The journal's format, one module: over 500 lines because its reader and writer are one
//! contract.`); a file that says so but is not over is reported too, so the reason cannot go
//! stale. docs/architecture.md lists each reason.

use super::graph::SourceFile;

pub const FILE_LIMIT: usize = 500;
pub const FUNCTION_LIMIT: usize = 80;
/// The words a file's first `//!` line uses to say why it is over [`FILE_LIMIT`].
pub const REASON_MARK: &str = "over 500 lines because";

pub struct FileSize {
    pub path: String,
    pub lines: usize,
    /// What follows [`REASON_MARK`] in the file's first doc line.
    pub reason: Option<String>,
}

pub struct FunctionSize {
    pub path: String,
    pub name: String,
    pub line: usize,
    pub lines: usize,
}

/// The sizes of a set of files and of their functions.
#[derive(Default)]
pub struct Sizes {
    pub files: Vec<FileSize>,
    /// Longest first.
    pub functions: Vec<FunctionSize>,
}

impl Sizes {
    pub fn of<'a>(files: impl IntoIterator<Item = &'a SourceFile>) -> Sizes {
        let mut sizes = Sizes::default();
        for f in files {
            let counted = &f.facts.counted;
            let reason = f.first_doc.as_deref().and_then(|d| {
                let at = d.find(REASON_MARK)? + REASON_MARK.len();
                Some(d[at..].trim().trim_end_matches('.').to_string())
            });
            sizes.files.push(FileSize {
                path: f.path.clone(),
                lines: counted.iter().filter(|c| **c).count(),
                reason,
            });
            for function in &f.facts.functions {
                let range = function.line - 1..function.end.min(counted.len());
                sizes.functions.push(FunctionSize {
                    path: f.path.clone(),
                    name: function.name.clone(),
                    line: function.line,
                    lines: counted[range].iter().filter(|c| **c).count(),
                });
            }
        }
        sizes.functions.sort_by(|a, b| {
            b.lines
                .cmp(&a.lines)
                .then(a.path.cmp(&b.path))
                .then(a.line.cmp(&b.line))
        });
        sizes
    }

    pub fn lines(&self) -> usize {
        self.files.iter().map(|f| f.lines).sum()
    }

    /// Files over the limit, longest first.
    pub fn files_over(&self) -> Vec<&FileSize> {
        let mut over: Vec<&FileSize> = self.files.iter().filter(|f| f.lines > FILE_LIMIT).collect();
        over.sort_by(|a, b| b.lines.cmp(&a.lines).then(a.path.cmp(&b.path)));
        over
    }

    pub fn functions_over(&self) -> impl Iterator<Item = &FunctionSize> {
        self.functions
            .iter()
            .take_while(|f| f.lines > FUNCTION_LIMIT)
    }

    /// Every file over the limit without a reason, every reason on a file not over it, and every
    /// function over its limit.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        for f in self.files_over().into_iter().filter(|f| f.reason.is_none()) {
            problems.push(format!(
                "{}: {} lines of code, over the limit of {FILE_LIMIT}: split it, or say why in its first //! line (\"... {REASON_MARK} ...\")",
                f.path, f.lines
            ));
        }
        for f in self
            .files
            .iter()
            .filter(|f| f.reason.is_some() && f.lines <= FILE_LIMIT)
        {
            problems.push(format!(
                "{}: its first //! line says \"{REASON_MARK}\" but it has {} lines of code: remove the reason",
                f.path, f.lines
            ));
        }
        for f in self.functions_over() {
            problems.push(format!(
                "{}:{}: `{}` is {} lines of code, over the limit of {FUNCTION_LIMIT}: split it",
                f.path, f.line, f.name, f.lines
            ));
        }
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::architecture::items::scan;

    fn file(path: &str, text: &str) -> SourceFile {
        SourceFile {
            path: path.into(),
            module: Vec::new(),
            first_doc: text
                .lines()
                .next()
                .map(|l| l.trim_start_matches("//!").trim().to_string()),
            facts: scan(text),
        }
    }

    fn long_function(name: &str, lines: usize) -> String {
        let body: String = (0..lines - 2)
            .map(|i| format!("    let _x{i} = {i}; // c\n\n"))
            .collect();
        format!("fn {name}() {{\n{body}}}\n")
    }

    #[test]
    fn functions_and_files_are_measured_in_lines_of_code() {
        let text = format!(
            "//! A file.\n{}{}#[cfg(test)]\nmod tests {{\n{}}}\n",
            long_function("at_limit", FUNCTION_LIMIT),
            long_function("over", FUNCTION_LIMIT + 1),
            long_function("in_tests", 200)
        );
        let sizes = Sizes::of([&file("a.rs", &text)]);
        let found: Vec<(&str, usize)> = sizes
            .functions
            .iter()
            .map(|f| (f.name.as_str(), f.lines))
            .collect();
        assert_eq!(found, [("over", 81), ("at_limit", 80)]);
        assert_eq!(sizes.lines(), 161);
        let problems = sizes.problems();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].starts_with("a.rs:160: `over` is 81 lines of code"),
            "{problems:?}"
        );
    }

    #[test]
    fn a_long_file_needs_its_reason_and_a_reason_needs_a_long_file() {
        let long: String = (0..FILE_LIMIT + 1)
            .map(|i| format!("const C{i}: u8 = 0;\n"))
            .collect();
        let reason = "//! Tables: over 500 lines because they are one list.\n";
        let files = [
            file("plain.rs", &long),
            file("reasoned.rs", &format!("{reason}{long}")),
            file("short.rs", reason),
        ];
        let sizes = Sizes::of(&files);
        assert_eq!(
            sizes.files_over()[1].reason.as_deref(),
            Some("they are one list")
        );
        let problems = sizes.problems();
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].starts_with("plain.rs: 501 lines of code, over the limit of 500"));
        assert!(problems[1].starts_with("short.rs: its first //! line says"));
    }
}
