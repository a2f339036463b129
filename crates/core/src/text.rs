//! Text from workloads, made safe to show: a workload's output reaches a
//! reader's terminal (`flotilla logs`) and browser (the console), and a
//! raw escape sequence there is the workload acting on the reader's screen
//! (clearing it, retitling the window, moving the cursor to hide lines,
//! or on some terminals worse).
//!
//! [`escape_controls`] shows every control character as text: C0 controls
//! but the tab, DEL and C1 controls as `\xNN` (`\r` for a carriage
//! return), and the bidirectional overrides and isolates, which reorder
//! what a reader sees, as `\u{NNNN}`. A backslash itself is left as it is,
//! so escaped output stays readable; the store keeps the raw line, and
//! `--json` gives it unchanged (JSON-encoded) to scripts that need the
//! exact bytes.

use std::borrow::Cow;

/// Whether `c` must not reach a reader's screen as it is.
fn is_unsafe(c: char) -> bool {
    matches!(c, '\u{0}'..='\u{8}' | '\u{a}'..='\u{1f}' | '\u{7f}'..='\u{9f}')
        || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `line` with its control characters written out as text (see the
/// module doc); borrowed when it has none.
pub fn escape_controls(line: &str) -> Cow<'_, str> {
    if !line.chars().any(is_unsafe) {
        return Cow::Borrowed(line);
    }
    let mut out = String::with_capacity(line.len() + 16);
    for c in line.chars() {
        match c {
            '\r' => out.push_str("\\r"),
            c if is_unsafe(c) && (c as u32) < 0x100 => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c if is_unsafe(c) => out.push_str(&format!("\\u{{{:04x}}}", c as u32)),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_are_shown_as_text_and_plain_text_is_untouched() {
        assert!(matches!(
            escape_controls("plain\ttext é ✓"),
            Cow::Borrowed(_)
        ));
        assert_eq!(
            escape_controls("\u{1b}[2J\u{1b}]0;owned\u{7}x\r\u{0}\u{7f}"),
            "\\x1b[2J\\x1b]0;owned\\x07x\\r\\x00\\x7f"
        );
        // C1 controls (a one-character CSI) and bidi overrides.
        assert_eq!(escape_controls("a\u{9b}2Jb"), "a\\x9b2Jb");
        assert_eq!(escape_controls("\u{202e}txt.exe"), "\\u{202e}txt.exe");
        assert_eq!(escape_controls("tab\tkept"), "tab\tkept");
        let all: String = (0u8..=255).map(char::from).collect();
        let escaped = escape_controls(&all);
        assert!(!escaped.chars().any(is_unsafe));
        assert!(escaped.contains('\t'));
    }
}
