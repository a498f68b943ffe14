//! Request lines whose target holds a byte the `http` crate refuses, percent-encoded first.
//!
//! How this works: hyper parses a request line with httparse, which takes any visible byte in
//! the target, then builds an `http::Uri`, which refuses `<`, `>` and a backtick in the path
//! and `"`, `<`, `>` in the query; hyper then answers a bare 400 before any handler runs.
//! Triton's server, curl and the Python front end take them as they are, and Triton's QA sends
//! model names such as ``model<test>`` raw to check that they are refused in Triton's words.
//! So the connection (`conn::Watched`) holds back the first line of each request head, and
//! `encoded_request_line` writes those four bytes as ``%3C``, ``%3E``, ``%60`` and ``%22``,
//! which the handlers decode as they decode any percent-encoding. Nothing else changes: a
//! line that is not a request line (method, one space, a target from ``/``, one space,
//! ``HTTP/``) is left as it came.

/// The bytes percent-encoded in a target: those httparse takes and `http::Uri` refuses.
const REFUSED: &[u8] = b"<>`\"";

/// How long a request line may grow while held back; past it the bytes go on as they came
/// (hyper refuses a head that long anyway).
pub const MAX_LINE: usize = 64 * 1024;

/// The request line ``line`` (up to and including its line feed) with the target's refused
/// bytes percent-encoded; None when nothing needs to change.
pub fn encoded_request_line(line: &[u8]) -> Option<Vec<u8>> {
    let method_end = line.iter().position(|&b| b == b' ')?;
    if method_end == 0 || !line[..method_end].iter().all(|&b| is_token(b)) {
        return None;
    }
    let target_start = method_end + 1;
    let target_len = line[target_start..].iter().position(|&b| b == b' ')?;
    let target = &line[target_start..target_start + target_len];
    let version = &line[target_start + target_len + 1..];
    if target.first() != Some(&b'/') || !version.starts_with(b"HTTP/") {
        return None;
    }
    if !target.iter().any(|b| REFUSED.contains(b)) {
        return None;
    }
    let mut out = Vec::with_capacity(line.len() + 2 * target.len());
    out.extend_from_slice(&line[..target_start]);
    for &b in target {
        if REFUSED.contains(&b) {
            out.extend_from_slice(format!("%{b:02X}").as_bytes());
        } else {
            out.push(b);
        }
    }
    out.extend_from_slice(&line[target_start + target_len..]);
    Some(out)
}

/// A byte of an HTTP token (RFC 9110's tchar), as a method is made of.
fn is_token(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// The first line of a request head, held back until it ends, then handed over (encoded
/// where needed) with whatever came after it.
#[derive(Default)]
pub struct HeldLine {
    held: Vec<u8>,
    holding: bool,
    ready: Vec<u8>,
    handed: usize,
}

impl HeldLine {
    /// Whether a request line is being held back.
    pub fn holding(&self) -> bool {
        self.holding
    }

    /// Bytes that arrived at the start of a request head, or while one's first line is held.
    pub fn take(&mut self, arrived: &[u8]) {
        self.holding = true;
        self.held.extend_from_slice(arrived);
        if let Some(end) = self.held.iter().position(|&b| b == b'\n') {
            let line = &self.held[..=end];
            let encoded = encoded_request_line(line);
            let rest = self.held.split_off(end + 1);
            let line = std::mem::take(&mut self.held);
            self.ready
                .extend_from_slice(encoded.as_deref().unwrap_or(&line));
            self.ready.extend_from_slice(&rest);
            self.holding = false;
        } else if self.held.len() > MAX_LINE {
            self.release();
        }
    }

    /// The connection ended mid-line: what was held goes on as it came.
    pub fn release(&mut self) {
        self.ready.append(&mut self.held);
        self.holding = false;
    }

    /// Whether bytes wait to be handed over.
    pub fn ready(&self) -> bool {
        self.handed < self.ready.len()
    }

    /// Hands over as many waiting bytes as ``buf`` takes.
    pub fn hand_over(&mut self, buf: &mut tokio::io::ReadBuf<'_>) {
        let n = buf.remaining().min(self.ready.len() - self.handed);
        buf.put_slice(&self.ready[self.handed..self.handed + n]);
        self.handed += n;
        if self.handed == self.ready.len() {
            self.ready.clear();
            self.handed = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(line: &str) -> Option<String> {
        encoded_request_line(line.as_bytes()).map(|b| String::from_utf8(b).unwrap())
    }

    #[test]
    fn refused_bytes_of_the_target_are_percent_encoded() {
        assert_eq!(
            encoded("POST /v2/repository/models/model<test>/load HTTP/1.1\r\n").as_deref(),
            Some("POST /v2/repository/models/model%3Ctest%3E/load HTTP/1.1\r\n")
        );
        assert_eq!(
            encoded("GET /v2/models/model`test`?a=\"b\" HTTP/1.0\n").as_deref(),
            Some("GET /v2/models/model%60test%60?a=%22b%22 HTTP/1.0\n")
        );
    }

    #[test]
    fn other_lines_are_left_as_they_came() {
        assert_eq!(encoded("GET /v2/models/plain/ready HTTP/1.1\r\n"), None);
        assert_eq!(encoded("GET /v2/models/a%3Cb/ready HTTP/1.1\r\n"), None);
        assert_eq!(encoded("{\"a\": \"<b>\"} HTTP/1.1\r\n"), None); // not a method
        assert_eq!(encoded("GET <b> HTTP/1.1\r\n"), None); // target not from /
        assert_eq!(encoded("GET /<b> SPDY/3\r\n"), None); // not HTTP
        assert_eq!(encoded("GET /<b>\r\n"), None); // no version
        assert_eq!(encoded(" /<b> HTTP/1.1\r\n"), None); // no method
        assert_eq!(encoded("PRI * HTTP/2.0\r\n"), None);
    }

    fn through(pieces: &[&[u8]]) -> Vec<u8> {
        let mut line = HeldLine::default();
        let mut out = Vec::new();
        for piece in pieces {
            line.take(piece);
            let mut storage = [0u8; 7]; // smaller than what waits: handed over in parts
            while line.ready() {
                let mut buf = tokio::io::ReadBuf::new(&mut storage);
                line.hand_over(&mut buf);
                out.extend_from_slice(buf.filled());
            }
        }
        out
    }

    #[test]
    fn a_line_in_pieces_is_held_until_it_ends_then_handed_over_with_what_follows() {
        let out = through(&[b"GET /a<", b"b> HTTP/1.1", b"\r\nHost: x\r\n\r\nBODY<"]);
        assert_eq!(out, b"GET /a%3Cb%3E HTTP/1.1\r\nHost: x\r\n\r\nBODY<");
    }

    #[test]
    fn a_line_longer_than_the_limit_goes_on_as_it_came() {
        let mut line = HeldLine::default();
        let long = vec![b'a'; MAX_LINE + 1];
        line.take(&long);
        assert!(!line.holding());
        assert!(line.ready());
    }
}
