//! HTTP connections as the Python front end keeps them: deadlines on request heads, idle
//! keep-alive connections closed, the connection limit, and silent connections making room.
//!
//! How this works: every accepted socket is wrapped in `Watched`, which notes the first byte
//! (a connection that has sent nothing is *silent*, and sits in `Connections::silent`, oldest
//! first), when a request head starts arriving, and whether the client speaks HTTP/2. The
//! service marks a connection busy while it answers (`Busy`). A watchdog beside each HTTP/1
//! connection sleeps until the connection's deadline: the first head must arrive within
//! `header_timeout` of the accept, a later one within `header_timeout` of its first byte,
//! and an idle connection goes after `keep_alive`. A head cut off gets a JSON 408 and a
//! close; a silent or idle connection is closed without a word. At the connection limit, a
//! newcomer takes the place of the oldest silent connection; when every connection has
//! spoken it gets a JSON 503 and a close.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::http::json_error;
use crate::target::{blank_prefix, encoded_request_line, HeldLine};

/// The deadlines of an HTTP listener's connections.
#[derive(Clone, Copy, Debug)]
pub struct ConnectionLimits {
    pub header_timeout: Duration,
    pub keep_alive: Duration,
    pub max_connections: usize,
}

#[derive(Default)]
struct Timing {
    /// When the head now arriving sent its first byte (None: no head under way).
    head_started: Option<Instant>,
    /// When the last answer was handed over (None: none yet).
    last_done: Option<Instant>,
}

/// One connection, as its watchdog and the limit see it.
pub struct ConnState {
    id: u64,
    fd: RawFd,
    accepted: Instant,
    spoke: AtomicBool,
    http2: AtomicBool,
    busy: AtomicUsize,
    evicted: AtomicBool,
    /// A request was answered before its body was read to the end (hyper drains or drops
    /// what is left): from then on no arrival is taken for the start of a head.
    heads_lost: AtomicBool,
    timing: Mutex<Timing>,
    changed: Notify,
}

/// What the watchdog does when a deadline passes.
pub enum Expiry {
    /// Close without a word (silent, idle or evicted).
    Close,
    /// A head cut off: 408, then close.
    TooSlow(String),
}

impl ConnState {
    fn deadline(&self, limits: &ConnectionLimits) -> Option<Instant> {
        if self.busy.load(Ordering::Acquire) > 0 {
            return None;
        }
        let spoke = self.spoke.load(Ordering::Acquire);
        if spoke && self.http2.load(Ordering::Acquire) {
            return None; // HTTP/2 keeps its own pings and deadlines
        }
        let timing = self.timing.lock().unwrap();
        Some(match (timing.last_done, timing.head_started) {
            (None, _) => self.accepted + limits.header_timeout,
            (Some(_), Some(started)) => started + limits.header_timeout,
            (Some(done), None) => done + limits.keep_alive,
        })
    }

    /// Waits until the connection's deadline passes, and says what to do.
    pub async fn expired(&self, limits: ConnectionLimits) -> Expiry {
        loop {
            if self.evicted.load(Ordering::Acquire) {
                return Expiry::Close;
            }
            match self.deadline(&limits) {
                None => self.changed.notified().await,
                Some(deadline) => {
                    tokio::select! {
                        _ = tokio::time::sleep_until(deadline) => {
                            if self.evicted.load(Ordering::Acquire) {
                                return Expiry::Close;
                            }
                            // Still due, with what happened meanwhile counted?
                            if self.deadline(&limits).is_some_and(|d| d <= Instant::now()) {
                                let (head, first) = {
                                    let timing = self.timing.lock().unwrap();
                                    (timing.head_started.is_some(), timing.last_done.is_none())
                                };
                                let spoke = self.spoke.load(Ordering::Acquire);
                                if head || (first && spoke) {
                                    return Expiry::TooSlow(format!(
                                        "the request head did not arrive within {} s \
                                         (--http-header-timeout)",
                                        seconds(limits.header_timeout)
                                    ));
                                }
                                return Expiry::Close;
                            }
                        }
                        _ = self.changed.notified() => {}
                    }
                }
            }
        }
    }

    /// Writes a final answer straight to the socket (only while nothing else writes: no
    /// request is being answered).
    pub fn send_raw(&self, bytes: &[u8]) {
        let mut sent = 0;
        while sent < bytes.len() {
            // SAFETY: the fd is open for as long as the connection's task holds its stream,
            // which outlives this call; the slice is live.
            let n = unsafe {
                libc::send(
                    self.fd,
                    bytes[sent..].as_ptr() as *const libc::c_void,
                    bytes.len() - sent,
                    libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
                )
            };
            if n <= 0 {
                return; // the client is gone, or not reading: it gets the close
            }
            sent += n as usize;
        }
    }
}

impl ConnState {
    /// A second handle on the socket, to finish a refusal after the HTTP connection is
    /// dropped (None if the process is out of descriptors).
    pub fn duplicate(&self) -> Option<TcpStream> {
        use std::os::fd::FromRawFd;
        // SAFETY: the fd is open (see `send_raw`); dup gives a new descriptor we own.
        let fd = unsafe { libc::dup(self.fd) };
        if fd < 0 {
            return None;
        }
        // SAFETY: `fd` is a fresh descriptor of a connected TCP socket, owned from here on.
        let stream = unsafe { std::net::TcpStream::from_raw_fd(fd) };
        stream.set_nonblocking(true).ok()?;
        TcpStream::from_std(stream).ok()
    }
}

/// Closes a refused connection gracefully: no more writes, then what the client still
/// sends is read and dropped for a moment (64 KiB, 1 s at most), so that closing with its
/// bytes unread does not reset the connection before it reads the answer.
pub async fn linger(mut stream: TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = stream.shutdown().await;
        let mut sink = [0u8; 4096];
        let mut drained = 0;
        while drained < 64 * 1024 {
            match stream.read(&mut sink).await {
                Ok(n) if n > 0 => drained += n,
                _ => break,
            }
        }
    })
    .await;
}

/// A whole-number display of seconds, as Python's ``:g`` shows them.
pub fn seconds(duration: Duration) -> String {
    let s = duration.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{}", s as u64)
    } else {
        format!("{s}")
    }
}

/// A raw HTTP/1.1 answer with a JSON error body, and a close.
pub fn raw_answer(status: u16, reason: &str, message: &str) -> Vec<u8> {
    let body = json_error(message);
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out
}

/// The connections of one listener.
#[derive(Default)]
pub struct Connections {
    next: AtomicU64,
    pub open: AtomicUsize,
    silent: Mutex<BTreeMap<u64, Arc<ConnState>>>,
}

impl Connections {
    /// A newly accepted connection, silent until its first byte.
    pub fn admit(self: &Arc<Self>, stream: TcpStream) -> (Watched, Arc<ConnState>) {
        let state = Arc::new(ConnState {
            id: self.next.fetch_add(1, Ordering::Relaxed),
            fd: stream.as_raw_fd(),
            accepted: Instant::now(),
            spoke: AtomicBool::new(false),
            http2: AtomicBool::new(false),
            busy: AtomicUsize::new(0),
            evicted: AtomicBool::new(false),
            heads_lost: AtomicBool::new(false),
            timing: Mutex::new(Timing::default()),
            changed: Notify::new(),
        });
        self.silent.lock().unwrap().insert(state.id, state.clone());
        self.open.fetch_add(1, Ordering::AcqRel);
        let watched = Watched {
            stream,
            state: state.clone(),
            connections: self.clone(),
            line: HeldLine::default(),
        };
        (watched, state)
    }

    /// The connection's task has ended.
    pub fn closed(&self, state: &ConnState) {
        self.silent.lock().unwrap().remove(&state.id);
        self.open.fetch_sub(1, Ordering::AcqRel);
    }

    /// Closes the oldest silent connection for a newcomer; false when every connection has
    /// spoken.
    pub fn evict_oldest_silent(&self) -> bool {
        let oldest = self.silent.lock().unwrap().pop_first();
        match oldest {
            Some((_, state)) => {
                state.evicted.store(true, Ordering::Release);
                state.changed.notify_one();
                true
            }
            None => false,
        }
    }

    fn spoke(&self, state: &ConnState) {
        self.silent.lock().unwrap().remove(&state.id);
    }
}

/// Marks a connection busy while a request on it is being answered; the answer says when it
/// has read the request's body to the end (`body_read`).
pub struct Busy {
    state: Arc<ConnState>,
    body_read: AtomicBool,
}

impl Busy {
    pub fn new(state: Arc<ConnState>) -> Busy {
        state.busy.fetch_add(1, Ordering::AcqRel);
        state.timing.lock().unwrap().head_started = None;
        Busy {
            state,
            body_read: AtomicBool::new(false),
        }
    }

    /// The request's body was read to its end: the next bytes start the next head.
    pub fn body_read(&self) {
        self.body_read.store(true, Ordering::Release);
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        if !self.body_read.load(Ordering::Acquire) {
            self.state.heads_lost.store(true, Ordering::Release);
        }
        self.state.timing.lock().unwrap().last_done = Some(Instant::now());
        self.state.busy.fetch_sub(1, Ordering::AcqRel);
        self.state.changed.notify_one();
    }
}

/// A socket that tells its `ConnState` what arrives, and holds back the first line of each
/// HTTP/1 request head until it ends, to percent-encode the target's bytes that the `http`
/// crate refuses (`target`). A head starts with the connection's first bytes (unless they
/// are HTTP/2's preface), and with the first bytes after an answer was handed over while
/// none is being answered, if every earlier request's body was read to its end (a request
/// pipelined behind another's answer goes on as it came).
pub struct Watched {
    stream: TcpStream,
    state: Arc<ConnState>,
    connections: Arc<Connections>,
    line: HeldLine,
}

/// What a held line is read through: hyper's first reads of a connection take 24 bytes.
const HOLDING_READ: usize = 8 * 1024;

impl Watched {
    /// Notes what arrived; whether it starts a request head.
    fn arrived(&self, arrived: &[u8]) -> bool {
        let state = &self.state;
        let mut starts_head = false;
        if !state.spoke.swap(true, Ordering::AcqRel) {
            self.connections.spoke(state);
            if arrived.starts_with(b"PRI") {
                state.http2.store(true, Ordering::Release);
            } else {
                starts_head = true;
            }
            state.changed.notify_one();
        }
        if state.busy.load(Ordering::Acquire) == 0 {
            let mut timing = state.timing.lock().unwrap();
            if timing.head_started.is_none() && timing.last_done.is_some() {
                timing.head_started = Some(Instant::now());
                drop(timing);
                state.changed.notify_one();
                starts_head = !state.http2.load(Ordering::Acquire)
                    && !state.heads_lost.load(Ordering::Acquire);
            }
        }
        starts_head
    }

    /// Bytes for the held line; an HTTP/2 preface turns the connection to HTTP/2.
    fn hold(&mut self, arrived: &[u8]) {
        if self.line.take(arrived) {
            self.state.http2.store(true, Ordering::Release);
        }
    }
}

/// Whether ``arrived``, the start of a request head, holds its whole first line and that line
/// needs no encoding (blank lines before it included).
fn line_stays(arrived: &[u8]) -> bool {
    let start = blank_prefix(arrived);
    match arrived[start..].iter().position(|&b| b == b'\n') {
        Some(end) => encoded_request_line(&arrived[start..=start + end]).is_none(),
        None => false,
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.line.ready() || buf.remaining() == 0 {
                this.line.hand_over(buf);
                return Poll::Ready(Ok(()));
            }
            if this.line.holding() {
                // Read on in bigger pieces than the caller's until the line ends.
                let mut storage = [0u8; HOLDING_READ];
                let mut more = ReadBuf::new(&mut storage);
                let polled = Pin::new(&mut this.stream).poll_read(cx, &mut more);
                let Poll::Ready(Ok(())) = polled else {
                    return polled;
                };
                if more.filled().is_empty() {
                    this.line.release(); // the end, mid-line: the line goes on as it came
                    continue;
                }
                this.arrived(more.filled());
                this.hold(more.filled());
                continue;
            }
            let before = buf.filled().len();
            let polled = Pin::new(&mut this.stream).poll_read(cx, buf);
            let Poll::Ready(Ok(())) = polled else {
                return polled;
            };
            let arrived = &buf.filled()[before..];
            if arrived.is_empty() || !this.arrived(arrived) || line_stays(arrived) {
                return Poll::Ready(Ok(())); // the end, or the common case: no copy
            }
            let arrived = buf.filled()[before..].to_vec();
            buf.set_filled(before);
            this.hold(&arrived);
        }
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A `Watched` server side and its client, on loopback.
    async fn pair() -> (Watched, Arc<ConnState>, TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        let (watched, state) = Arc::new(Connections::default()).admit(server);
        (watched, state, client)
    }

    /// The server side's next ``want`` bytes, read 24 at a time (as hyper-util's first
    /// reads of a connection are).
    async fn read_n(watched: &mut Watched, want: usize) -> Vec<u8> {
        let mut out = Vec::new();
        let mut piece = [0u8; 24];
        while out.len() < want {
            let read = tokio::time::timeout(Duration::from_secs(5), watched.read(&mut piece));
            let n = read.await.expect("no bytes within 5 s").unwrap();
            assert!(n > 0, "the end, after {out:?}");
            out.extend_from_slice(&piece[..n]);
        }
        out
    }

    /// Sends ``pieces`` 30 ms apart while the server side reads; whether it read ``expected``.
    async fn trickled(
        watched: &mut Watched,
        client: &mut TcpStream,
        pieces: &[&[u8]],
        expected: &[u8],
    ) {
        let send = async {
            for piece in pieces {
                client.write_all(piece).await.unwrap();
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
        };
        let (_, got) = tokio::join!(send, read_n(watched, expected.len()));
        assert_eq!(
            String::from_utf8_lossy(&got),
            String::from_utf8_lossy(expected)
        );
    }

    #[tokio::test]
    async fn a_first_line_in_pieces_reaches_hyper_encoded() {
        let (mut watched, _state, mut client) = pair().await;
        let pieces: [&[u8]; 3] = [
            b"GE",
            b"T /v2/models/a<",
            b"b>/config HTTP/1.1\r\nHost: x\r\n\r\n",
        ];
        let expected = b"GET /v2/models/a%3Cb%3E/config HTTP/1.1\r\nHost: x\r\n\r\n";
        trickled(&mut watched, &mut client, &pieces, expected).await;
    }

    #[tokio::test]
    async fn an_http2_preface_split_after_its_first_bytes_makes_the_connection_http2() {
        let (mut watched, state, mut client) = pair().await;
        let preface: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
        trickled(
            &mut watched,
            &mut client,
            &[&preface[..2], &preface[2..]],
            preface,
        )
        .await;
        assert!(state.http2.load(Ordering::Acquire));
    }

    #[tokio::test]
    async fn only_the_first_line_after_an_answer_whose_body_was_read_is_held() {
        let (mut watched, state, mut client) = pair().await;
        let head: &[u8] = b"POST /x HTTP/1.1\r\ncontent-length: 19\r\n\r\n";
        trickled(&mut watched, &mut client, &[head], head).await;
        // While the request is answered, its body goes on as it came.
        let busy = Busy::new(state.clone());
        let body: &[u8] = b"GET /<x> HTTP/1.1\r\n";
        trickled(&mut watched, &mut client, &[body], body).await;
        busy.body_read();
        drop(busy);
        // The next request's line is encoded.
        let next: &[u8] = b"GET /<y> HTTP/1.1\r\n\r\n";
        trickled(
            &mut watched,
            &mut client,
            &[next],
            b"GET /%3Cy%3E HTTP/1.1\r\n\r\n",
        )
        .await;
        // An answer given before its body was read: nothing is taken for a head any more.
        drop(Busy::new(state.clone()));
        let after: &[u8] = b"GET /<z> HTTP/1.1\r\n\r\n";
        trickled(&mut watched, &mut client, &[after], after).await;
    }
}
