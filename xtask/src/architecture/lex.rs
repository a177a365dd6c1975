//! The lexical layer of the architecture checks: which bytes of a Rust file are code.
//!
//! Comments (nested block comments included) and the insides of string, raw string, byte string
//! and char literals are blanked out, newlines kept, so that every brace, `fn` and `crate::`
//! found in the result afterwards is code, on the line it was written on. A lifetime (`'a`) is
//! told from a char literal (`'a'`) by what follows its first character. The same pass says
//! which lines hold code: a line counts when it has anything but whitespace outside comments (a
//! line inside a multi-line string counts; a `///` line does not).

/// A file's text with comments and literal contents blanked, and its lines of code.
pub struct Lexed {
    /// The text, same length and lines, with every comment and literal replaced by spaces.
    pub masked: String,
    /// Per line (0-based): whether it holds code.
    pub code: Vec<bool>,
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Code,
    Comment,
    Literal,
}

/// Blanks `text`'s comments and literals and finds its lines of code.
pub fn lex(text: &str) -> Lexed {
    let src = text.as_bytes();
    let lines = src.iter().filter(|&&b| b == b'\n').count() + 1;
    let mut lexer = Lexer {
        src,
        out: Vec::with_capacity(src.len()),
        code: vec![false; lines],
        line: 0,
    };
    let mut at = 0;
    while at < src.len() {
        // Most bytes start nothing: copy the run of them up to the next that might.
        let plain = src[at..]
            .iter()
            .position(|b| matches!(b, b'/' | b'"' | b'\'' | b'r' | b'b' | b'c'))
            .unwrap_or(src.len() - at);
        if plain > 0 {
            lexer.take(at, plain, Kind::Code);
            at += plain;
            continue;
        }
        let (len, kind) = token_at(src, at);
        let len = len.max(1);
        lexer.take(at, len, kind);
        at += len;
    }
    Lexed {
        // Only ASCII bytes were replaced (by spaces), whole characters at a time.
        masked: String::from_utf8(lexer.out).unwrap_or_default(),
        code: lexer.code,
    }
}

struct Lexer<'a> {
    src: &'a [u8],
    out: Vec<u8>,
    code: Vec<bool>,
    line: usize,
}

impl Lexer<'_> {
    /// Copies `src[at..at + len]` (blanked unless it is code) and marks its lines.
    fn take(&mut self, at: usize, len: usize, kind: Kind) {
        let end = (at + len).min(self.src.len());
        for &b in &self.src[at..end] {
            if b == b'\n' {
                self.line += 1;
                self.out.push(b);
                continue;
            }
            if kind != Kind::Comment && !b.is_ascii_whitespace() {
                self.code[self.line] = true;
            }
            self.out.push(if kind == Kind::Code { b } else { b' ' });
        }
    }
}

/// The length and kind of what starts at `at`: a comment, a literal, or one byte of code.
fn token_at(src: &[u8], at: usize) -> (usize, Kind) {
    let rest = &src[at..];
    if rest.starts_with(b"//") {
        let len = rest.iter().position(|&b| b == b'\n').unwrap_or(rest.len());
        return (len, Kind::Comment);
    }
    if rest.starts_with(b"/*") {
        return (block_comment_len(rest), Kind::Comment);
    }
    if let Some(len) = raw_string_len(src, at) {
        return (len, Kind::Literal);
    }
    match rest[0] {
        b'"' => (string_len(rest), Kind::Literal),
        b'\'' => match char_literal_len(rest) {
            Some(len) => (len, Kind::Literal),
            None => (1, Kind::Code),
        },
        _ => (1, Kind::Code),
    }
}

/// `/* ... */`, nesting as Rust's block comments do.
fn block_comment_len(rest: &[u8]) -> usize {
    let mut depth = 0usize;
    let mut i = 0;
    while i < rest.len() {
        if rest[i..].starts_with(b"/*") {
            depth += 1;
            i += 2;
        } else if rest[i..].starts_with(b"*/") {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return i;
            }
        } else {
            i += 1;
        }
    }
    rest.len()
}

/// `"..."` with its escapes (`rest` starts at the opening quote).
fn string_len(rest: &[u8]) -> usize {
    let mut i = 1;
    while i < rest.len() {
        match rest[i] {
            b'\\' => i += 2,
            b'"' => return i + 1,
            _ => i += 1,
        }
    }
    rest.len()
}

/// `r"..."`, `r#"..."#`, `br"..."`, `cr#"..."#` starting at `at`, if one does.
fn raw_string_len(src: &[u8], at: usize) -> Option<usize> {
    if at > 0 && is_ident_byte(src[at - 1]) {
        return None;
    }
    let rest = &src[at..];
    let prefix = match rest {
        [b'r', ..] => 1,
        [b'b' | b'c', b'r', ..] => 2,
        _ => return None,
    };
    let hashes = rest[prefix..].iter().take_while(|&&b| b == b'#').count();
    if rest.get(prefix + hashes) != Some(&b'"') {
        return None;
    }
    let body = prefix + hashes + 1;
    let mut i = body;
    while i < rest.len() {
        if rest[i] == b'"'
            && rest[i + 1..]
                .iter()
                .take(hashes)
                .filter(|&&b| b == b'#')
                .count()
                == hashes
        {
            return Some(i + 1 + hashes);
        }
        i += 1;
    }
    Some(rest.len())
}

/// `'x'`, `'\n'`, `'\u{1F600}'`, `'é'` (`rest` starts at the quote); `None` for a lifetime or
/// label (`'a`, `'static`), whose character is not followed by a closing quote.
fn char_literal_len(rest: &[u8]) -> Option<usize> {
    if rest.get(1) == Some(&b'\\') {
        // The escaped character is skipped, so `'\''` closes at its last quote.
        let close = rest.iter().skip(3).take(10).position(|&b| b == b'\'')?;
        return Some(3 + close + 1);
    }
    let first = *rest.get(1)?;
    let width = match first {
        0x00..=0x7f => 1,
        0xc0..=0xdf => 2,
        0xe0..=0xef => 3,
        _ => 4,
    };
    (rest.get(1 + width) == Some(&b'\'') && first != b'\'').then_some(width + 2)
}

/// A byte that can be part of an identifier (non-ASCII bytes included: they only appear in
/// identifiers once comments and literals are gone).
pub fn is_ident_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b >= 0x80
}

#[cfg(test)]
mod tests {
    use super::*;

    fn masked(text: &str) -> String {
        lex(text).masked
    }

    #[test]
    fn comments_and_literals_are_blanked_and_code_is_kept() {
        let text = "let a = \"{ // }\"; // { crate::x\nlet b = '{'; /* { /* } */ } */ let c = 1;";
        let out = masked(text);
        assert_eq!(out.len(), text.len());
        assert!(
            !out.contains('{') && !out.contains('}') && !out.contains("crate"),
            "{out}"
        );
        assert!(out.contains("let a") && out.contains("let b") && out.contains("let c = 1;"));
    }

    #[test]
    fn raw_strings_escapes_and_byte_literals() {
        let text =
            "r#\"a \" { \"# + r\"}\" + br##\"\"# {\"## + \"\\\" {\" + b'{' + '\\'' + '\\u{7b}' + x";
        let out = masked(text);
        assert!(!out.contains('{') && !out.contains('}'), "{out}");
        assert!(out.trim_end().ends_with("+ x"), "{out}");
    }

    #[test]
    fn lifetimes_and_labels_stay_code() {
        let text = "fn f<'a>(x: &'a str) -> &'static str { 'outer: loop { break 'outer; } }";
        assert_eq!(masked(text), text);
        // A char literal right after a lifetime-like tick is still a literal.
        let out = masked("['{', 'é', '}']");
        assert!(
            !out.contains(['{', '}', '\'']) && out.len() == "['{', 'é', '}']".len(),
            "{out}"
        );
    }

    #[test]
    fn raw_identifiers_are_not_raw_strings() {
        let text = "let r#type = 1; let bar = \"x\";";
        assert_eq!(masked(text), "let r#type = 1; let bar =    ;");
    }

    #[test]
    fn lines_of_code_skip_blank_and_comment_lines_but_not_string_lines() {
        let text = "//! doc\nfn f() {\n\n    // note\n    let s = \"a\nb\n\";  // trailing\n    /* block\n    still */\n}\n";
        let code: Vec<usize> = lex(text)
            .code
            .iter()
            .enumerate()
            .filter(|(_, c)| **c)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(code, [1, 4, 5, 6, 9]);
    }
}
