//! The structural layer of the architecture checks: what a file declares and what it names.
//!
//! Works on [`lex`](super::lex)'s masked text, so it only ever sees code: it splits it into
//! tokens, pairs its brackets, and walks it once, keeping a stack of the items it is inside
//! (inline `mod`s, `impl`s, `trait`s, `fn`s). It records each function with a body (where it
//! starts and ends), each `mod` declaration, each `use` (expanded to one path per name it binds)
//! and each other path that starts with `crate`, `super`, `self` or another lower-case name
//! followed by `::` (which of those are the crate's own modules is decided later, by
//! [`graph`](super::graph), which knows the module tree). An item carrying `#[cfg(test)]` (or
//! `#[cfg(all(test, ...))]`) is skipped whole and its lines are marked as test code.

use super::lex::{Lexed, is_ident_byte, lex};
use std::collections::HashSet;

/// What one file declares and names, its test-only items left out.
#[derive(Default)]
pub struct Facts {
    /// Per line (0-based): code outside `#[cfg(test)]` items.
    pub counted: Vec<bool>,
    pub functions: Vec<Function>,
    pub mods: Vec<ModDecl>,
    pub uses: Vec<Use>,
    pub paths: Vec<PathRef>,
}

/// A function with a body; lines are 1-based, `end` is its closing brace's line.
pub struct Function {
    /// `Type::name` inside an `impl`/`trait`, `outer::name` for a nested one, else `name`.
    pub name: String,
    pub line: usize,
    pub end: usize,
}

/// `mod name;` or `mod name { ... }`, in the inline modules `scope`.
pub struct ModDecl {
    pub scope: Vec<String>,
    pub name: String,
    pub test: bool,
}

/// One name a `use` binds: `use a::b::{c as d, e::*}` gives `a::b::c` (bound as `d`) and
/// `a::b::e::*` (bound as nothing).
pub struct Use {
    pub scope: Vec<String>,
    pub path: Vec<String>,
    pub bound: Option<String>,
    /// `pub use` (any visibility): a re-export, which by itself is not a dependency.
    pub public: bool,
    /// Whether the bound name appears in the file's code outside `use` items.
    pub named_elsewhere: bool,
    pub line: usize,
}

/// A path such as `crate::state::Desired` or `operation::register` outside `use` items.
pub struct PathRef {
    pub scope: Vec<String>,
    pub segments: Vec<String>,
    pub line: usize,
}

/// Lexes and scans a file.
pub fn scan(text: &str) -> Facts {
    let Lexed { masked, code } = lex(text);
    let tokens = tokenize(&masked);
    let close = pair_brackets(&tokens, &masked);
    let mut walk = Walk {
        src: &masked,
        toks: &tokens,
        close: &close,
        test_lines: vec![false; code.len()],
        facts: Facts::default(),
        scope: Vec::new(),
        elsewhere: HashSet::new(),
        public_at: None,
    };
    walk.block(0, tokens.len());
    let Walk {
        mut facts,
        test_lines,
        elsewhere,
        ..
    } = walk;
    for u in &mut facts.uses {
        u.named_elsewhere = u.bound.as_deref().is_some_and(|b| elsewhere.contains(b));
    }
    facts.counted = code
        .iter()
        .zip(&test_lines)
        .map(|(c, t)| *c && !t)
        .collect();
    facts
}

#[derive(Clone, Copy)]
struct Tok {
    start: usize,
    end: usize,
    line: usize,
    /// An identifier (a raw identifier `r#fn` is not one: it can never be a keyword).
    ident: bool,
}

fn tokenize(src: &str) -> Vec<Tok> {
    let b = src.as_bytes();
    let mut toks = Vec::new();
    let (mut i, mut line) = (0, 0);
    while i < b.len() {
        let c = b[i];
        if c == b'\n' {
            line += 1;
        }
        if c.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        let raw = b[i..].starts_with(b"r#") && b.get(i + 2).is_some_and(|&n| is_ident_byte(n));
        let start = if raw { i + 2 } else { i };
        let end = if is_ident_byte(b[start]) {
            start + b[start..].iter().take_while(|&&n| is_ident_byte(n)).count()
        } else if [b"::", b"->", b"=>"].iter().any(|p| b[i..].starts_with(*p)) {
            i + 2
        } else {
            i + 1
        };
        let ident = !raw && is_ident_byte(c) && !c.is_ascii_digit();
        toks.push(Tok {
            start,
            end,
            line,
            ident,
        });
        i = end;
    }
    toks
}

/// For each opening bracket, the index of its closing one (unpaired ones close at the end).
fn pair_brackets(toks: &[Tok], src: &str) -> Vec<usize> {
    let mut close = vec![toks.len(); toks.len()];
    let mut open: Vec<(usize, u8)> = Vec::new();
    for (i, t) in toks.iter().enumerate() {
        let c = src.as_bytes()[t.start];
        match c {
            b'(' | b'[' | b'{' => open.push((i, c)),
            b')' | b']' | b'}' => {
                let want = match c {
                    b')' => b'(',
                    b']' => b'[',
                    _ => b'{',
                };
                if let Some(at) = open.iter().rposition(|(_, o)| *o == want) {
                    close[open[at].0] = i;
                    open.truncate(at);
                }
            }
            _ => {}
        }
    }
    close
}

/// Keywords an item (what `#[cfg(test)]` can remove) starts with, once past its qualifiers.
const ITEM_KEYWORDS: &[&str] = &[
    "fn",
    "mod",
    "impl",
    "trait",
    "struct",
    "enum",
    "union",
    "use",
    "const",
    "static",
    "type",
    "macro_rules",
    "extern",
];
/// Items that end with their first `{ ... }` (unless a `;` comes first: `mod a;`, `struct A;`).
const BLOCK_ITEMS: &[&str] = &[
    "fn",
    "mod",
    "impl",
    "trait",
    "struct",
    "enum",
    "union",
    "macro_rules",
    "extern",
];

struct Walk<'a> {
    src: &'a str,
    toks: &'a [Tok],
    close: &'a [usize],
    test_lines: Vec<bool>,
    facts: Facts,
    /// The items the walk is inside: `(name, is an inline module)`.
    scope: Vec<(String, bool)>,
    /// Identifiers seen outside `use` items.
    elsewhere: HashSet<&'a str>,
    /// The token after the last `pub` visibility (`pub`, `pub(crate)`): a `use` there re-exports.
    public_at: Option<usize>,
}

impl<'a> Walk<'a> {
    fn text(&self, i: usize) -> &'a str {
        self.toks.get(i).map_or("", |t| &self.src[t.start..t.end])
    }

    fn is(&self, i: usize, word: &str) -> bool {
        self.text(i) == word
    }

    fn ident(&self, i: usize) -> bool {
        self.toks.get(i).is_some_and(|t| t.ident)
    }

    fn line(&self, i: usize) -> usize {
        self.toks.get(i).map_or(0, |t| t.line)
    }

    fn module_scope(&self) -> Vec<String> {
        let mods = self.scope.iter().filter(|(_, is_mod)| *is_mod);
        mods.map(|(name, _)| name.clone()).collect()
    }

    /// Walks tokens `from..to` at the current scope.
    fn block(&mut self, from: usize, to: usize) {
        let mut i = from;
        let mut test_attr: Option<usize> = None;
        while i < to {
            if self.is(i, "#") {
                let bang = usize::from(self.is(i + 1, "!"));
                if self.is(i + 1 + bang, "[") {
                    let end = self.close[i + 1 + bang];
                    if self.is_test_cfg(i + 2 + bang, end) {
                        if bang == 1 {
                            // `#![cfg(test)]`: the whole file is test code.
                            self.test_lines.iter_mut().for_each(|l| *l = true);
                            return;
                        }
                        test_attr.get_or_insert(i);
                    }
                    i = end + 1;
                    continue;
                }
            }
            if let Some(attr) = test_attr.take()
                && let Some(end) = self.test_item(attr, i)
            {
                i = end + 1;
                continue;
            }
            i = self.step(i);
        }
    }

    /// Whether the attribute tokens `from..to` are `cfg(test)` or `cfg(all(test, ...))`.
    fn is_test_cfg(&self, from: usize, to: usize) -> bool {
        let words: String = (from..to).map(|i| self.text(i)).collect();
        words == "cfg(test)" || words.starts_with("cfg(all(test,") || words == "cfg(all(test))"
    }

    /// Index of the first token past the qualifiers (`pub(crate) unsafe async ...`) at `i`.
    fn past_qualifiers(&self, mut i: usize) -> usize {
        loop {
            if self.is(i, "pub") {
                i += 1;
                if self.is(i, "(") {
                    i = self.close[i] + 1;
                }
            } else if ["unsafe", "async", "default"].contains(&self.text(i))
                || (["const", "extern"].contains(&self.text(i))
                    && ["fn", "unsafe", "async", "extern"].contains(&self.text(i + 1)))
            {
                i += 1;
            } else {
                return i;
            }
        }
    }

    /// Skips the item a `#[cfg(test)]` at `attr` applies to, which starts at `i`, marking its
    /// lines as test code; returns its last token, or `None` when what follows is no item.
    fn test_item(&mut self, attr: usize, i: usize) -> Option<usize> {
        let keyword = self.past_qualifiers(i);
        if !ITEM_KEYWORDS.contains(&self.text(keyword)) {
            return None;
        }
        let end = self.item_end(keyword);
        if self.is(keyword, "mod") && self.is(end, ";") {
            let decl = ModDecl {
                scope: self.module_scope(),
                name: self.text(keyword + 1).to_string(),
                test: true,
            };
            self.facts.mods.push(decl);
        }
        let lines = self.line(attr)..=self.line(end.min(self.toks.len().saturating_sub(1)));
        self.test_lines[lines].iter_mut().for_each(|l| *l = true);
        Some(end)
    }

    /// The last token of the item whose keyword is at `keyword`: its body's `}` or its `;`.
    fn item_end(&self, keyword: usize) -> usize {
        let block = BLOCK_ITEMS.contains(&self.text(keyword));
        let mut i = keyword + 1;
        while i < self.toks.len() {
            match self.text(i) {
                ";" => return i,
                "{" if block => return self.close[i],
                "(" | "[" | "{" => i = self.close[i] + 1,
                _ => i += 1,
            }
        }
        i
    }

    /// Handles the token at `i` (an item, a `use`, a path, or anything else); returns the next.
    fn step(&mut self, i: usize) -> usize {
        if !self.ident(i) {
            return i + 1;
        }
        match self.text(i) {
            "pub" => {
                let next = if self.is(i + 1, "(") {
                    self.close[i + 1] + 1
                } else {
                    i + 1
                };
                self.public_at = Some(next);
                return next;
            }
            "use" => return self.use_item(i),
            "mod" if self.ident(i + 1) => return self.module(i),
            "fn" if self.ident(i + 1) => return self.function(i),
            "impl" | "trait" => return self.impl_or_trait(i),
            _ => {}
        }
        self.elsewhere.insert(self.text(i));
        let after_path_sep = i > 0 && self.is(i - 1, "::");
        if !after_path_sep && self.is(i + 1, "::") {
            return self.path(i);
        }
        i + 1
    }

    fn module(&mut self, i: usize) -> usize {
        let name = self.text(i + 1).to_string();
        let decl = ModDecl {
            scope: self.module_scope(),
            name: name.clone(),
            test: false,
        };
        self.facts.mods.push(decl);
        let end = self.item_end(i);
        if self.is(end, "}") {
            let open = (i..end).find(|&j| self.is(j, "{")).unwrap_or(end);
            self.nested(name, true, open, end);
        }
        end + 1
    }

    fn function(&mut self, i: usize) -> usize {
        let end = self.item_end(i);
        if !self.is(end, "}") {
            return end + 1;
        }
        let mut name: Vec<&str> = self.scope.iter().map(|(n, _)| n.as_str()).collect();
        name.push(self.text(i + 1));
        let function = Function {
            name: name.join("::"),
            line: self.line(i) + 1,
            end: self.line(end) + 1,
        };
        self.facts.functions.push(function);
        let open = (i..end).find(|&j| self.is(j, "{")).unwrap_or(end);
        self.nested(self.text(i + 1).to_string(), false, open, end);
        end + 1
    }

    /// An `impl` or `trait` block, named after its type (`impl<T> Trait for Type<T>` is `Type`).
    fn impl_or_trait(&mut self, i: usize) -> usize {
        let end = self.item_end(i);
        let Some(open) = (i..end).find(|&j| self.is(j, "{") && self.close[j] == end) else {
            return i + 1;
        };
        if self.is(i, "trait") {
            self.nested(self.text(i + 1).to_string(), false, open, end);
            return end + 1;
        }
        let mut name = "";
        let mut depth = 0i32;
        for j in i + 1..open {
            match self.text(j) {
                "<" => depth += 1,
                ">" => depth -= 1,
                "where" if depth == 0 => break,
                "for" if depth == 0 => name = "",
                _ if depth == 0 && self.ident(j) && !["dyn", "mut"].contains(&self.text(j)) => {
                    name = self.text(j)
                }
                _ => {}
            }
        }
        self.nested(name.to_string(), false, open, end);
        end + 1
    }

    /// Walks a body `{` at `open` .. `}` at `close` inside the scope `name`.
    fn nested(&mut self, name: String, is_mod: bool, open: usize, close: usize) {
        self.scope.push((name, is_mod));
        self.block(open + 1, close);
        self.scope.pop();
    }

    /// A path outside `use`: its leading identifiers (`a::b::C` of `a::b::C::<T>::new`).
    fn path(&mut self, i: usize) -> usize {
        let mut segments = vec![self.text(i).to_string()];
        let mut j = i + 1;
        while self.is(j, "::") && self.ident(j + 1) {
            segments.push(self.text(j + 1).to_string());
            self.elsewhere.insert(self.text(j + 1));
            j += 2;
        }
        let first = segments[0].as_str();
        let lower = first.starts_with(|c: char| c.is_ascii_lowercase() || c == '_');
        if lower && !["std", "core", "alloc"].contains(&first) {
            let line = self.line(i) + 1;
            let scope = self.module_scope();
            self.facts.paths.push(PathRef {
                scope,
                segments,
                line,
            });
        }
        j
    }

    /// A `use` item starting at `i`; returns the token after its `;`.
    fn use_item(&mut self, i: usize) -> usize {
        let public = self.public_at == Some(i);
        let end = self.item_end(i);
        let mut bound = Vec::new();
        self.use_tree(i + 1, end, Vec::new(), &mut bound);
        for (path, name) in bound {
            let entry = Use {
                scope: self.module_scope(),
                path,
                bound: name,
                public,
                named_elsewhere: false,
                line: self.line(i) + 1,
            };
            self.facts.uses.push(entry);
        }
        end + 1
    }

    /// One use tree at `i` (before `to`) under `prefix`; returns the index after it.
    fn use_tree(
        &self,
        mut i: usize,
        to: usize,
        mut path: Vec<String>,
        out: &mut Vec<(Vec<String>, Option<String>)>,
    ) -> usize {
        if self.is(i, "::") {
            i += 1;
        }
        while i < to {
            if self.is(i, "*") {
                path.push("*".into());
                out.push((path, None));
                return i + 1;
            }
            if self.is(i, "{") {
                let close = self.close[i];
                let mut j = i + 1;
                while j < close {
                    j = self.use_tree(j, close, path.clone(), out);
                    if self.is(j, ",") {
                        j += 1;
                    }
                }
                return close + 1;
            }
            if !self.ident(i) {
                return i + 1;
            }
            path.push(self.text(i).to_string());
            if self.is(i + 1, "::") {
                i += 2;
                continue;
            }
            if path.last().is_some_and(|s| s == "self") {
                path.pop();
            }
            let alias = self.is(i + 1, "as").then(|| self.text(i + 2).to_string());
            let next = if alias.is_some() { i + 3 } else { i + 1 };
            let name = alias.or_else(|| path.last().cloned()).filter(|n| n != "_");
            out.push((path, name));
            return next;
        }
        i
    }
}

#[cfg(test)]
mod tests;
