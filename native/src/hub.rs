//! The meeting point of the Rust threads and the interpreter's trio thread.
//!
//! How this works: a connection's task turns each request into an `Event`, keeps the way back
//! to its client in the table of pending requests (`Pending`, by id) and pushes the event onto
//! one queue. Pushing onto an empty queue writes the eventfd that a trio task waits on
//! (`trio.lowlevel.wait_readable`); that task takes the whole queue at once (`take`), resetting
//! the eventfd first so that no push can be missed. Answers come back through `Hub::pending`:
//! the trio thread looks the id up and sends on the channel its connection task waits on.
//! A connection task that is dropped before its answer (the client went away) removes its
//! entry and pushes `Event::Cancel`, so the Python side cancels the work.

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use hyper::HeaderMap;
use tokio::sync::{mpsc, oneshot, Semaphore};

use crate::cache::Tier;

/// What the trio thread is told, in arrival order.
pub enum Event {
    /// A complete HTTP request.
    Http {
        id: u64,
        method: String,
        target: String,
        headers: HeaderMap,
        body: Bytes,
    },
    /// A unary gRPC call: its method (the last part of the path) and its one message.
    Unary {
        id: u64,
        method: String,
        headers: HeaderMap,
        message: Bytes,
    },
    /// A streaming gRPC call has opened.
    StreamOpen {
        id: u64,
        method: String,
        headers: HeaderMap,
    },
    /// One message of an open stream.
    StreamMessage { id: u64, message: Bytes },
    /// The client half-closed the stream (no more messages); `error` when its framing broke.
    StreamEnd { id: u64, error: Option<String> },
    /// The client went away before its answer: cancel the work.
    Cancel { id: u64 },
    /// One response of a stream was handed to the connection: a credit for the producer.
    Credit { id: u64 },
    /// Something the Python side logs, once per episode (`Trouble`).
    Trouble { kind: Trouble, detail: String },
}

/// The kinds of trouble worth a log line.
#[derive(Clone, Copy, Debug)]
pub enum Trouble {
    /// A request head or body came too slowly: 408.
    Slow = 0,
    /// Silent connections closed for newcomers at the connection limit.
    Evicted = 1,
    /// accept(2) failed for want of descriptors or memory.
    Accept = 2,
    /// Connections turned away with 503 at the limit.
    TurnedAway = 3,
}

/// An HTTP answer.
pub struct HttpReply {
    pub status: u16,
    pub headers: Vec<(Vec<u8>, Vec<u8>)>,
    pub body: ReplyBody,
}

/// An HTTP answer's body: whole, or streamed as the trio thread sends its parts (server-sent
/// events: `Frontend::respond_stream`).
pub enum ReplyBody {
    Whole(Bytes),
    Streamed(mpsc::UnboundedReceiver<StreamItem>),
}

/// A unary gRPC answer: a message (status OK) or a status with its message.
pub struct GrpcReply {
    pub code: u32,
    pub message: String,
    pub body: Option<Bytes>,
}

/// What the trio thread sends down an open stream.
pub enum StreamItem {
    Message(Bytes),
    End { code: u32, message: String },
}

/// The way back to a waiting client.
pub enum Pending {
    /// The answer's channel, and the request's key in the cache's first tier (if any).
    Http(oneshot::Sender<HttpReply>, Option<Bytes>),
    Unary(oneshot::Sender<GrpcReply>, Option<Bytes>),
    Stream(StreamWay),
}

/// An open stream (a gRPC stream, or a streamed HTTP answer), as the trio thread reaches it: where its responses go, and the permits
/// of its reader (one per message handed over and not yet taken up by Python).
pub struct StreamWay {
    pub responses: mpsc::UnboundedSender<StreamItem>,
    pub reading: Arc<Semaphore>,
}

impl Drop for StreamWay {
    fn drop(&mut self) {
        // The stream is answered or gone: its reader stops waiting for permits.
        self.reading.close();
    }
}

pub struct Hub {
    queue: Mutex<Vec<Event>>,
    wake_fd: RawFd,
    pub pending: Mutex<HashMap<u64, Pending>>,
    next_id: AtomicU64,
    /// The response cache's first tier.
    pub tier: Tier,
}

impl Hub {
    pub fn new() -> std::io::Result<Arc<Hub>> {
        // SAFETY: eventfd has no memory-safety preconditions; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Arc::new(Hub {
            queue: Mutex::new(Vec::with_capacity(256)),
            wake_fd: fd,
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            tier: Tier::default(),
        }))
    }

    pub fn wake_fd(&self) -> RawFd {
        self.wake_fd
    }

    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    pub fn push(&self, event: Event) {
        let was_empty = {
            let mut queue = self.queue.lock().unwrap();
            let was_empty = queue.is_empty();
            queue.push(event);
            was_empty
        };
        if was_empty {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a live u64 to our own eventfd. A full counter
            // (EAGAIN) still leaves the fd readable, which is all a wake-up needs.
            unsafe {
                libc::write(self.wake_fd, &one as *const u64 as *const libc::c_void, 8);
            }
        }
    }

    /// Every queued event, oldest first. Resets the wake-up before taking the queue: a push
    /// after the reset either lands in what is taken, or writes the eventfd again.
    pub fn take(&self) -> Vec<Event> {
        let mut count: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from our own non-blocking eventfd.
        unsafe {
            libc::read(self.wake_fd, &mut count as *mut u64 as *mut libc::c_void, 8);
        }
        let mut queue = self.queue.lock().unwrap();
        std::mem::replace(&mut *queue, Vec::with_capacity(256))
    }

    /// Registers a request awaiting its answer, under a fresh id.
    pub fn register(self: &Arc<Self>, pending: Pending) -> InFlight {
        let id = self.next_id();
        self.pending.lock().unwrap().insert(id, pending);
        InFlight {
            hub: self.clone(),
            id,
        }
    }

    pub fn remove(&self, id: u64) -> Option<Pending> {
        self.pending.lock().unwrap().remove(&id)
    }

    /// Removes the way back to ``id`` if it is of the kind ``wanted`` accepts (an answer of
    /// the wrong kind leaves it waiting).
    pub fn remove_if(&self, id: u64, wanted: fn(&Pending) -> bool) -> Option<Pending> {
        let mut pending = self.pending.lock().unwrap();
        if pending.get(&id).is_some_and(wanted) {
            pending.remove(&id)
        } else {
            None
        }
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        // SAFETY: the fd is ours and closed once.
        unsafe {
            libc::close(self.wake_fd);
        }
    }
}

/// A request a client waits on. Dropped while its way back is still in the table (the
/// client went away before Python answered), it leaves the table and tells the trio thread
/// to cancel the work; once answered, Python has already taken it out.
pub struct InFlight {
    hub: Arc<Hub>,
    pub id: u64,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.hub.remove(self.id).is_some() {
            self.hub.push(Event::Cancel { id: self.id });
        }
    }
}
