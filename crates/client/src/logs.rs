//! The follow stream of an instance's log (NDJSON, one [`LogLine`] a line).

use std::collections::VecDeque;

use flotilla_core::api::{ErrorBody, LogLine};

use crate::error::Error;
use crate::Result;

/// The follow stream of an instance's log: one [`LogLine`] per NDJSON line.
/// A server without streaming answers one page; its lines are handed out
/// and the stream ends, so the caller reconnects from the next sequence.
#[derive(Debug)]
pub struct LogFollow {
    server: String,
    resp: Option<reqwest::Response>,
    buf: Vec<u8>,
    pending: VecDeque<LogLine>,
}

impl LogFollow {
    pub(crate) fn streaming(server: String, resp: reqwest::Response) -> Self {
        Self {
            server,
            resp: Some(resp),
            buf: Vec::new(),
            pending: VecDeque::new(),
        }
    }

    pub(crate) fn page(server: String, lines: Vec<LogLine>) -> Self {
        Self {
            server,
            resp: None,
            buf: Vec::new(),
            pending: lines.into(),
        }
    }

    /// The next line; `None` when the server ended the stream.
    pub async fn next(&mut self) -> Result<Option<LogLine>> {
        if let Some(l) = self.pending.pop_front() {
            return Ok(Some(l));
        }
        loop {
            if let Some(pos) = self.buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=pos).collect();
                match parse_ndjson_line(&line)? {
                    Some(l) => return Ok(Some(l)),
                    None => continue,
                }
            }
            let Some(resp) = self.resp.as_mut() else {
                return Ok(None);
            };
            match resp.chunk().await {
                Ok(Some(bytes)) => self.buf.extend_from_slice(&bytes),
                Ok(None) => {
                    self.resp = None;
                    let rest = std::mem::take(&mut self.buf);
                    return parse_ndjson_line(&rest);
                }
                Err(e) => {
                    self.resp = None;
                    return Err(Error::from_reqwest(&self.server, &e));
                }
            }
        }
    }
}

/// One NDJSON line: a log line, nothing (blank), or the error object a
/// server may end a stream with.
pub(crate) fn parse_ndjson_line(raw: &[u8]) -> Result<Option<LogLine>> {
    let text = String::from_utf8_lossy(raw);
    let text = text.trim();
    if text.is_empty() {
        return Ok(None);
    }
    match serde_json::from_str::<LogLine>(text) {
        Ok(line) => Ok(Some(line)),
        Err(source) => match serde_json::from_str::<ErrorBody>(text) {
            Ok(_) => Err(Error::from_answer(500, text.as_bytes(), None)),
            Err(_) => Err(Error::Decode { source }),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ndjson_lines_parse_and_blank_lines_are_skipped() {
        let l = parse_ndjson_line(
            br#"{"seq":3,"stream":"stderr","at":"2025-01-01T00:00:00Z","line":"hi"}
"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!((l.seq, l.line.as_str()), (3, "hi"));
        assert!(parse_ndjson_line(b"  \n").unwrap().is_none());
        let e = parse_ndjson_line(br#"{"error":{"code":"x","message":"boom"}}"#).unwrap_err();
        assert_eq!(e.message(), "boom");
        assert_eq!(e.code(), Some("x"));
        let e = parse_ndjson_line(b"{nope").unwrap_err();
        assert!(matches!(e, Error::Decode { .. }), "{e}");
    }
}
