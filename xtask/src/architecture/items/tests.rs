use super::*;

const SAMPLE: &str = r##"//! A sample.
use crate::state::{self, desired::Desired, queue::*};
pub use operation::{Outcome as Result, register};
pub(crate) use self::claims::Claim;

/// Says "}" and '{'.
pub fn short() -> &'static str {
    let s = "fn fake() { }";
    let r = r#"} crate::not::this"#;
    // crate::nor::this
    s
}

impl<'a, T: Into<u8>> Trait<T> for Wrapper<'a, T> where T: Copy {
    fn method(&self) {
        super::super::up::call();
        claims::take();
        fn inner() {}
    }
}

pub trait Named: Send {
    fn name(&self) -> String;
    fn greeting(&self) -> String {
        format!("hello {}", crate::text::escape(&self.name()))
    }
}

mod inline {
    pub fn helper() { super::Outcome::new(); }
}

#[cfg(test)]
#[allow(dead_code)]
mod tests {
    use crate::cli;
    fn long_test() {
        crate::admin::x();
    }
}

#[cfg(test)]
mod more_tests;

#[cfg(all(test, target_os = "linux"))]
fn test_helper() { crate::watcher::y(); }
"##;

#[test]
fn functions_are_found_with_their_scope_and_lines() {
    let facts = scan(SAMPLE);
    let found: Vec<(&str, usize, usize)> = facts
        .functions
        .iter()
        .map(|f| (f.name.as_str(), f.line, f.end))
        .collect();
    assert_eq!(
        found,
        [
            ("short", 7, 12),
            ("Wrapper::method", 15, 19),
            ("Wrapper::method::inner", 18, 18),
            ("Named::greeting", 24, 26),
            ("inline::helper", 30, 30),
        ]
    );
}

#[test]
fn test_items_are_neither_counted_nor_scanned() {
    let facts = scan(SAMPLE);
    let counted: Vec<usize> = (0..facts.counted.len())
        .filter(|&l| facts.counted[l])
        .map(|l| l + 1)
        .collect();
    // Line 31 closes `mod inline`; what follows is test code.
    assert!(
        counted.contains(&31) && counted.iter().all(|&l| l <= 31),
        "{counted:?}"
    );
    // The `//!`, `///` and `//` lines.
    assert!(!counted.contains(&1) && !counted.contains(&6) && !counted.contains(&10));
    let mods: Vec<(&str, bool)> = facts
        .mods
        .iter()
        .map(|m| (m.name.as_str(), m.test))
        .collect();
    assert_eq!(mods, [("inline", false), ("more_tests", true)]);
    let named = |p: &PathRef| p.segments.join("::");
    let paths: Vec<String> = facts.paths.iter().map(named).collect();
    for test_only in ["crate::admin::x", "crate::watcher::y", "crate::not::this"] {
        assert!(!paths.contains(&test_only.to_string()), "{paths:?}");
    }
}

#[test]
fn paths_keep_their_leading_segments_and_inline_scope() {
    let facts = scan(SAMPLE);
    let paths: Vec<(String, String, usize)> = facts
        .paths
        .iter()
        .map(|p| (p.scope.join("::"), p.segments.join("::"), p.line))
        .collect();
    let expected = [
        ("", "super::super::up::call", 16),
        ("", "claims::take", 17),
        ("", "crate::text::escape", 25),
        ("inline", "super::Outcome::new", 30),
    ];
    let expected: Vec<(String, String, usize)> = expected
        .iter()
        .map(|(s, p, l)| (s.to_string(), p.to_string(), *l))
        .collect();
    assert_eq!(paths, expected);
}

#[test]
fn use_trees_are_expanded_one_path_per_name() {
    let facts = scan(SAMPLE);
    let uses: Vec<(String, Option<&str>, bool, bool)> = facts
        .uses
        .iter()
        .map(|u| {
            (
                u.path.join("::"),
                u.bound.as_deref(),
                u.public,
                u.named_elsewhere,
            )
        })
        .collect();
    let expected = [
        ("crate::state", Some("state"), false, false),
        (
            "crate::state::desired::Desired",
            Some("Desired"),
            false,
            false,
        ),
        ("crate::state::queue::*", None, false, false),
        ("operation::Outcome", Some("Result"), true, false),
        ("operation::register", Some("register"), true, false),
        ("self::claims::Claim", Some("Claim"), true, false),
    ];
    let expected: Vec<(String, Option<&str>, bool, bool)> = expected
        .iter()
        .map(|(p, b, public, named)| (p.to_string(), *b, *public, *named))
        .collect();
    assert_eq!(uses, expected);
}

#[test]
fn a_re_exported_name_used_in_the_file_is_named_elsewhere() {
    let facts = scan("pub use child::Thing;\nfn f() -> Thing { Thing::new() }\n");
    assert!(facts.uses[0].public && facts.uses[0].named_elsewhere);
}

#[test]
fn an_inner_cfg_test_makes_the_whole_file_test_code() {
    let facts = scan("#![cfg(test)]\nfn f() { crate::a::b(); }\n");
    assert!(facts.counted.iter().all(|c| !c) && facts.paths.is_empty());
}
