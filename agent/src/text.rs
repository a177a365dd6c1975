//! Making text that plugins control safe to print for a person.
//!
//! A plugin names itself (`PluginInfo.name`, `type`, `endpoint`, versions) and its socket (any
//! byte but `/` and NUL may be in a file name). Printed raw, a newline forges a log line and an
//! escape sequence (`ESC]0;…`, `ESC[2J`) drives the operator's terminal. Text output goes through
//! [`escape`]; JSON output does not need it (serde escapes control characters) and stays exact.

use std::borrow::Cow;
use std::fmt::Write as _;

/// `text` with every control character (C0, DEL, C1: newlines and escapes among them) written as
/// a Rust-style escape (`\n`, `\u{1b}`). Text without any is returned as it is, without copying.
/// (A backslash is left alone: text that was escaped once, like a `Debug` string, stays readable;
/// what matters is that no control character reaches the output.)
pub fn escape(text: &str) -> Cow<'_, str> {
    if !text.chars().any(needs_escape) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if needs_escape(c) {
            // `escape_default` gives `\n`, `\t` and `\u{1b}` forms.
            let _ = write!(out, "{}", c.escape_default());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

fn needs_escape(c: char) -> bool {
    c.is_control()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_text_is_not_copied() {
        assert!(matches!(escape("csi.example.com/v1"), Cow::Borrowed(_)));
        assert_eq!(escape("naïve plugin"), "naïve plugin");
    }

    #[test]
    fn newlines_and_terminal_escapes_are_made_visible() {
        let hostile = "evil\nlevel=error msg=forged\x1b]0;owned\x07\x1b[2J\u{9b}";
        let escaped = escape(hostile);
        assert!(!escaped.chars().any(char::is_control), "{escaped}");
        assert_eq!(
            escaped,
            "evil\\nlevel=error msg=forged\\u{1b}]0;owned\\u{7}\\u{1b}[2J\\u{9b}"
        );
    }
}
