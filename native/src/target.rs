//! Request lines whose target holds a byte the `http` crate refuses, percent-encoded first.
//!
//! How this works: hyper parses a request line with httparse, which takes any visible byte in
//! the target, then builds an `http::Uri`, which refuses `<`, `>` and a backtick in the path
//! and `"`, `<`, `>` in the query; hyper then answers a bare 400 before any handler runs.
//! Triton's server, curl and the Python front end take them as they are, and Triton's QA sends
//! model names such as ``model<test>`` raw to check that they are refused in Triton's words.
//! So the connection (`conn::Watched`) holds back the first line of each request head
//! (`HeldLine`: blank lines before it pass; bytes that cannot start a request line pass at
//! once; HTTP/2's preface line is told apart), and `encoded_request_line` writes those four
//! bytes as ``%3C``, ``%3E``, ``%60`` and ``%22``, which the handlers decode as they decode any
//! percent-encoding. Nothing else changes: a line that is not a request line (method, one
//! space, a target from ``/``, one space, ``HTTP/``) is left as it came.

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

/// The longest method a held line may start with.
const MAX_METHOD: usize = 32;

/// Whether ``prefix`` (a line's start, no line feed yet) may still become a request line: a
/// method, then a target from ``/`` (or ``*``). Anything else goes on at once.
fn could_be_request_line(prefix: &[u8]) -> bool {
    match prefix.iter().position(|&b| b == b' ') {
        None => prefix.len() <= MAX_METHOD && prefix.iter().all(|&b| is_token(b)),
        Some(space) => {
            space > 0
                && prefix[..space].iter().all(|&b| is_token(b))
                && !matches!(prefix.get(space + 1), Some(&b) if b != b'/' && b != b'*')
        }
    }
}

/// How many of ``bytes`` are the blank lines (CR, LF) a request head may start with.
pub fn blank_prefix(bytes: &[u8]) -> usize {
    bytes
        .iter()
        .take_while(|&&b| b == b'\r' || b == b'\n')
        .count()
}

/// HTTP/2's connection preface starts with this line.
const PREFACE_LINE: &[u8] = b"PRI * HTTP/2.0\r\n";

/// The first line of a request head, held back until it ends, then handed over (encoded
/// where needed) with whatever came after it. Blank lines before it go on as they came.
#[derive(Default)]
pub struct HeldLine {
    held: Vec<u8>,
    holding: bool,
    ready: Vec<u8>,
    handed: usize,
}

impl HeldLine {
    /// Whether a request line is awaited or being held back.
    pub fn holding(&self) -> bool {
        self.holding
    }

    /// Bytes that arrived at the start of a request head, or while one's first line is
    /// awaited; true when the line turned out to be HTTP/2's preface.
    pub fn take(&mut self, arrived: &[u8]) -> bool {
        self.holding = true;
        let mut arrived = arrived;
        if self.held.is_empty() {
            let blank = blank_prefix(arrived);
            self.ready.extend_from_slice(&arrived[..blank]);
            arrived = &arrived[blank..];
        }
        let scanned = self.held.len();
        self.held.extend_from_slice(arrived);
        if let Some(offset) = self.held[scanned..].iter().position(|&b| b == b'\n') {
            let rest = self.held.split_off(scanned + offset + 1);
            let line = std::mem::take(&mut self.held);
            let preface = line == PREFACE_LINE;
            match encoded_request_line(&line) {
                Some(encoded) => self.ready.extend_from_slice(&encoded),
                None => self.ready.extend_from_slice(&line),
            }
            self.ready.extend_from_slice(&rest);
            self.holding = false;
            return preface;
        }
        if !self.held.is_empty()
            && (self.held.len() > MAX_LINE || !could_be_request_line(&self.held))
        {
            self.release();
        }
        false
    }

    /// What was held goes on as it came (the connection ended, or it is no request line).
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
            self.ready.shrink_to(4096); // a long line's buffer does not stay for good
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
    fn blank_lines_before_the_request_line_go_on_and_the_line_is_still_encoded() {
        let out = through(&[b"\r\n", b"\r\nGET /a<b> HTTP/1.1\r\n\r\n"]);
        assert_eq!(out, b"\r\n\r\nGET /a%3Cb%3E HTTP/1.1\r\n\r\n");
    }

    #[test]
    fn a_line_trickled_byte_by_byte_is_encoded_whole() {
        let line = b"POST /v2/repository/models/m<t>/load HTTP/1.1\r\n";
        let pieces: Vec<&[u8]> = line.chunks(1).collect();
        assert_eq!(
            through(&pieces),
            b"POST /v2/repository/models/m%3Ct%3E/load HTTP/1.1\r\n"
        );
    }

    #[test]
    fn bytes_that_cannot_start_a_request_line_go_on_at_once() {
        for start in [
            &b"\x16\x03\x01\x02\x00"[..],
            b"GET ../x",
            b"G\x00",
            &[b'A'; 40],
        ] {
            let mut line = HeldLine::default();
            line.take(start);
            assert!(!line.holding(), "{start:?}");
            assert!(line.ready());
        }
        let mut line = HeldLine::default();
        line.take(b"OPTIONS * HT"); // may still be one
        assert!(line.holding());
    }

    #[test]
    fn http2s_preface_line_is_told_apart() {
        let mut line = HeldLine::default();
        assert!(!line.take(b"PR"));
        assert!(line.take(b"I * HTTP/2.0\r\n\r\nSM\r\n\r\n"));
        assert!(!line.holding());
    }

    #[test]
    fn a_line_longer_than_the_limit_goes_on_as_it_came() {
        let mut line = HeldLine::default();
        let mut long = b"GET /".to_vec();
        long.resize(MAX_LINE + 1, b'a');
        line.take(&long);
        assert!(!line.holding());
        assert!(line.ready());
    }
}
