//! What hyper hides of a request's framing. A head with both `Transfer-Encoding: chunked` and
//! `Content-Length` reaches the service as chunked, its length removed (RFC 9112 §6.3 lets a
//! server do so, or refuse the request). A proxy in front that framed the same bytes by their
//! length would read other requests in them (request smuggling), so a server may want to refuse
//! it; to let it, the connection server keeps the raw bytes of each request head
//! (`HeadRecord`) and marks a chunked request whose head also declared a length with
//! [`ConflictingFraming`].
//!
//! A head that arrived in the same read as the bytes of an earlier request on the connection (a
//! pipelined one) is not kept, and so not marked.

/// The most of a request head kept. A longer head of a chunked request counts as conflicting:
/// what it declares past this cannot be told.
const HEAD_RECORD_LIMIT: usize = 64 * 1024;

/// A request extension: a chunked request whose head also declared a `Content-Length`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConflictingFraming;

/// The raw bytes of one request head as they arrived, and perhaps some of its body after them.
#[derive(Debug, Default)]
pub(crate) struct HeadRecord {
    bytes: Vec<u8>,
    overflowed: bool,
}

impl HeadRecord {
    /// Keeps `bytes`, up to [`HEAD_RECORD_LIMIT`] in all.
    pub(crate) fn record(&mut self, bytes: &[u8]) {
        let room = HEAD_RECORD_LIMIT.saturating_sub(self.bytes.len());
        if bytes.len() > room {
            self.overflowed = true;
        }
        self.bytes
            .extend_from_slice(&bytes[..bytes.len().min(room)]);
    }

    /// Whether the head declared a `Content-Length`, or was too long to tell.
    pub(crate) fn declares_length(&self) -> bool {
        content_length_line(&self.bytes).unwrap_or(self.overflowed)
    }
}

/// `Some(true)` when a header line of the head names `Content-Length`, `Some(false)` when the
/// head ends without one, `None` when the bytes end before the head does.
fn content_length_line(head: &[u8]) -> Option<bool> {
    let mut rest = head;
    let mut request_line_seen = false;
    loop {
        let end = rest.iter().position(|&byte| byte == b'\n')?;
        let line = &rest[..end];
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        rest = &rest[end + 1..];
        if !request_line_seen {
            // Empty lines before the request line are allowed (RFC 9112 §2.2).
            request_line_seen = !line.is_empty();
            continue;
        }
        if line.is_empty() {
            return Some(false);
        }
        let name = line.split(|&byte| byte == b':').next().unwrap_or_default();
        if name.eq_ignore_ascii_case(b"content-length") {
            return Some(true);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(head: &str) -> HeadRecord {
        let mut record = HeadRecord::default();
        record.record(head.as_bytes());
        record
    }

    #[test]
    fn a_content_length_line_in_any_letter_case_before_the_heads_end_is_a_declared_length() {
        let both = "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\ncontent-LENGTH: 5\r\n\r\n";
        assert!(record(both).declares_length());
        assert!(record(&format!("\r\n{both}")).declares_length());
        let chunked_only =
            "POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nContent-Length: 5\r\n";
        assert!(
            !record(chunked_only).declares_length(),
            "a body's line is not a header"
        );
        assert!(!record("POST /x HTTP/1.1\nX-Content-Length: 5\n\n").declares_length());
    }

    #[test]
    fn a_head_longer_than_the_record_counts_as_declaring_a_length() {
        let mut record = HeadRecord::default();
        record.record(b"POST /x HTTP/1.1\r\n");
        let filler = format!("X-Filler: {}\r\n", "a".repeat(1000));
        for _ in 0..70 {
            record.record(filler.as_bytes());
        }
        assert!(record.declares_length());
        assert!(!HeadRecord::default().declares_length());
    }
}
