//! orchestrion's native front end, as a Python module.
//!
//! How this works: a `Frontend` owns a tokio runtime (its own threads) that accepts
//! connections and serves HTTP/1.1, HTTP/2 and gRPC with hyper. Requests reach the
//! interpreter through the hub (`hub.rs`): the trio thread waits on `wake_fd`, takes every
//! queued event at once with `take`, and answers with `respond` (HTTP), `reply` (a unary
//! gRPC call), `stream_send` and `stream_close` (a stream). No Python code runs on the
//! runtime's threads, and none of them holds the GIL while a socket waits.

mod cache;
mod conn;
mod grpc;
mod http;
mod hub;
mod target;

use std::net::{SocketAddr, TcpListener as StdListener, ToSocketAddrs};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyOSError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::TcpListener;
use tokio::runtime::Runtime;
use tokio::sync::watch;

use cache::Stored;
use conn::{raw_answer, Busy, ConnectionLimits, Connections, Expiry};
use hub::{Event, GrpcReply, HttpReply, Hub, Pending, ReplyBody, StreamItem, StreamWay, Trouble};

/// The largest request line plus headers (larger: 431), as the Python front end.
const MAX_HEAD_SIZE: usize = 64 * 1024;
/// HTTP/2 flow-control windows: wide enough that a burst of small gRPC messages on one
/// stream (each its own DATA frame) never trips h2's guard against floods of small frames,
/// whose budget is half the connection window.
const H2_CONNECTION_WINDOW: u32 = 16 * 1024 * 1024;
const H2_STREAM_WINDOW: u32 = 4 * 1024 * 1024;

/// Event kinds, as `take` reports them (the first item of each tuple).
const HTTP: u8 = 0;
const UNARY: u8 = 1;
const STREAM_OPEN: u8 = 2;
const STREAM_MESSAGE: u8 = 3;
const STREAM_END: u8 = 4;
const CANCEL: u8 = 5;
const CREDIT: u8 = 6;
const TROUBLE: u8 = 7;

/// The native front end: listeners served by hyper on threads of its own.
#[pyclass(module = "orchestrion_native._native")]
struct Frontend {
    runtime: Mutex<Option<Runtime>>,
    hub: Arc<Hub>,
    stopping: watch::Sender<bool>,
    graceful: Arc<Mutex<Option<GracefulShutdown>>>,
    /// Set once every connection has closed after `stop_accepting`.
    closed: Mutex<Option<std::sync::mpsc::Receiver<()>>>,
    http_connections: Arc<Connections>,
}

/// A listening socket on ``host:port`` (the first address that binds). ``reuse_port``: with
/// SO_REUSEPORT, so that the processes of `orchestrion serve --workers` share the port (the
/// kernel spreads connections across them).
fn bound(host: &str, port: u16, reuse_port: bool) -> PyResult<StdListener> {
    let addresses: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| PyOSError::new_err(format!("{host}:{port}: {e}")))?
        .collect();
    let mut last = None;
    for address in addresses {
        match listening(address, reuse_port) {
            Ok(listener) => return Ok(listener),
            Err(e) => last = Some(e),
        }
    }
    Err(PyOSError::new_err(match last {
        Some(e) => format!("{host}:{port}: {e}"),
        None => format!("{host}:{port}: no address"),
    }))
}

fn listening(address: SocketAddr, reuse_port: bool) -> std::io::Result<StdListener> {
    let socket = Socket::new(
        Domain::for_address(address),
        Type::STREAM,
        Some(Protocol::TCP),
    )?;
    socket.set_reuse_address(true)?; // as std's TcpListener::bind does on Unix
    if reuse_port {
        socket.set_reuse_port(true)?;
    }
    socket.bind(&address.into())?;
    socket.listen(1024)?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

fn header_list<'py>(py: Python<'py>, headers: &hyper::HeaderMap) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for (name, value) in headers {
        list.append((
            PyBytes::new(py, name.as_str().as_bytes()),
            PyBytes::new(py, value.as_bytes()),
        ))?;
    }
    Ok(list)
}

/// A region of a Python buffer, read without the GIL while its owner is kept alive.
struct Region(*const u8, usize);

// SAFETY: the regions point into bytes objects and buffer views that `joined` keeps alive
// (and so unmoved) until the copy is done; nothing writes them meanwhile.
unsafe impl Send for Region {}

/// The bytes of ``chunks`` (bytes, or an iterable of buffers), joined. The copy runs with the
/// GIL released: a large answer (tens of MiB, first-touch pages on a VM) holds no other
/// thread up, and `respond` on a worker thread holds no event loop up.
fn joined<'py>(chunks: &Bound<'py, PyAny>) -> PyResult<Bytes> {
    let py = chunks.py();
    let mut keep: Vec<Bound<'py, PyAny>> = Vec::new();
    let mut views: Vec<PyBuffer<u8>> = Vec::new();
    let mut regions: Vec<Region> = Vec::new();
    let mut add = |chunk: Bound<'py, PyAny>| -> PyResult<()> {
        if let Ok(bytes) = chunk.downcast::<PyBytes>() {
            let data = bytes.as_bytes();
            regions.push(Region(data.as_ptr(), data.len()));
            keep.push(chunk);
        } else {
            let view = PyBuffer::<u8>::get(&chunk)?;
            if !view.is_c_contiguous() {
                return Err(pyo3::exceptions::PyValueError::new_err(
                    "an answer's buffers must be contiguous",
                ));
            }
            regions.push(Region(view.buf_ptr() as *const u8, view.len_bytes()));
            views.push(view);
        }
        Ok(())
    };
    if chunks.downcast::<PyBytes>().is_ok() {
        add(chunks.clone())?;
    } else {
        for chunk in chunks.try_iter()? {
            add(chunk?)?;
        }
    }
    let total: usize = regions.iter().map(|r| r.1).sum();
    let out = py.allow_threads(move || {
        let mut out = BytesMut::with_capacity(total);
        for Region(start, length) in regions {
            // SAFETY: see `Region`: live, unmoved, unwritten until this returns.
            out.extend_from_slice(unsafe { std::slice::from_raw_parts(start, length) });
        }
        out.freeze()
    });
    drop(views);
    drop(keep);
    Ok(out)
}

/// Requests larger than this reach Python as a `Body` to take in a worker thread, not as
/// bytes made on the event loop's thread.
const LARGE: usize = 1024 * 1024;

/// A large request body or message, handed over without a copy; `take` makes the bytes.
#[pyclass(module = "orchestrion_native._native")]
struct Body {
    data: Mutex<Option<Bytes>>,
}

#[pymethods]
impl Body {
    /// The bytes (once), copied with the GIL released: call it in a worker thread.
    fn take<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let data = self
            .data
            .lock()
            .unwrap()
            .take()
            .ok_or_else(|| PyRuntimeError::new_err("the body was taken already"))?;
        PyBytes::new_with(py, data.len(), |target| {
            py.allow_threads(|| target.copy_from_slice(&data));
            Ok(())
        })
    }

    fn __len__(&self) -> usize {
        self.data.lock().unwrap().as_ref().map_or(0, Bytes::len)
    }
}

/// ``data`` as Python sees it: bytes, or a `Body` when large.
fn handed<'py>(py: Python<'py>, data: Bytes) -> PyResult<Bound<'py, PyAny>> {
    if data.len() > LARGE {
        let body = Body {
            data: Mutex::new(Some(data)),
        };
        return Ok(Bound::new(py, body)?.into_any());
    }
    Ok(PyBytes::new(py, &data).into_any())
}

#[pymethods]
impl Frontend {
    #[new]
    #[pyo3(signature = (threads = 2))]
    fn new(threads: usize) -> PyResult<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .thread_name("orchestrion-native")
            .enable_all()
            .build()
            .map_err(|e| PyRuntimeError::new_err(format!("cannot start the runtime: {e}")))?;
        let hub = Hub::new().map_err(|e| PyOSError::new_err(format!("eventfd: {e}")))?;
        let (stopping, _) = watch::channel(false);
        Ok(Frontend {
            runtime: Mutex::new(Some(runtime)),
            hub,
            stopping,
            graceful: Arc::new(Mutex::new(Some(GracefulShutdown::new()))),
            closed: Mutex::new(None),
            http_connections: Arc::new(Connections::default()),
        })
    }

    /// The eventfd that is readable while events wait to be taken.
    #[getter]
    fn wake_fd(&self) -> i32 {
        self.hub.wake_fd()
    }

    /// Serve HTTP/1.1 and HTTP/2 (cleartext) on ``host:port``; returns the bound port.
    #[pyo3(signature = (host, port, *, max_body, body_timeout, body_min_rate, header_timeout, keep_alive, max_connections, reuse_port=false))]
    #[allow(clippy::too_many_arguments)]
    fn listen_http(
        &self,
        host: &str,
        port: u16,
        max_body: usize,
        body_timeout: f64,
        body_min_rate: f64,
        header_timeout: f64,
        keep_alive: f64,
        max_connections: usize,
        reuse_port: bool,
    ) -> PyResult<u16> {
        let listener = bound(host, port, reuse_port)?;
        let local = listener.local_addr()?.port();
        let limits = http::HttpLimits {
            max_body,
            body_timeout: Duration::from_secs_f64(body_timeout.max(0.001)),
            body_min_rate,
        };
        let connection_limits = ConnectionLimits {
            header_timeout: Duration::from_secs_f64(header_timeout.max(0.001)),
            keep_alive: Duration::from_secs_f64(keep_alive.max(0.001)),
            max_connections: max_connections.max(1),
        };
        let (listener, handle) = self.on_runtime(listener)?;
        handle.spawn(accept_http(
            listener,
            self.hub.clone(),
            self.graceful.clone(),
            self.stopping.subscribe(),
            limits,
            connection_limits,
            self.http_connections.clone(),
        ));
        Ok(local)
    }

    /// Serve gRPC (HTTP/2, cleartext) on ``host:port``; returns the bound port.
    #[pyo3(signature = (host, port, *, max_message, reuse_port=false))]
    fn listen_grpc(
        &self,
        host: &str,
        port: u16,
        max_message: usize,
        reuse_port: bool,
    ) -> PyResult<u16> {
        let listener = bound(host, port, reuse_port)?;
        let local = listener.local_addr()?.port();
        let (listener, handle) = self.on_runtime(listener)?;
        handle.spawn(accept_grpc(
            listener,
            self.hub.clone(),
            self.graceful.clone(),
            self.stopping.subscribe(),
            max_message,
        ));
        Ok(local)
    }

    /// Every event that has arrived since the last call, oldest first, as tuples:
    /// ``(0, id, method, target, headers, body)`` an HTTP request; ``(1, id, method, headers,
    /// message)`` a unary gRPC call; ``(2, id, method, headers)`` a stream opened; ``(3, id,
    /// message)`` a stream's message; ``(4, id, error)`` a stream's input ended; ``(5, id)``
    /// the client went away; ``(6, id)`` a stream's response was handed to its connection;
    /// ``(7, kind, detail)`` trouble to log (0 slow clients, 1 silent connections closed for
    /// newcomers, 2 accept failing, 3 connections turned away).
    fn take<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for event in self.hub.take() {
            let item = match event {
                Event::Http {
                    id,
                    method,
                    target,
                    headers,
                    body,
                } => {
                    let headers = header_list(py, &headers)?;
                    (HTTP, id, method, target, headers, handed(py, body)?).into_pyobject(py)?
                }
                Event::Unary {
                    id,
                    method,
                    headers,
                    message,
                } => {
                    let headers = header_list(py, &headers)?;
                    (UNARY, id, method, headers, handed(py, message)?).into_pyobject(py)?
                }
                Event::StreamOpen {
                    id,
                    method,
                    headers,
                } => (STREAM_OPEN, id, method, header_list(py, &headers)?).into_pyobject(py)?,
                Event::StreamMessage { id, message } => {
                    (STREAM_MESSAGE, id, PyBytes::new(py, &message)).into_pyobject(py)?
                }
                Event::StreamEnd { id, error } => (STREAM_END, id, error).into_pyobject(py)?,
                Event::Cancel { id } => (CANCEL, id).into_pyobject(py)?,
                Event::Credit { id } => (CREDIT, id).into_pyobject(py)?,
                Event::Trouble { kind, detail } => {
                    (TROUBLE, kind as u8, detail).into_pyobject(py)?
                }
            };
            list.append(item)?;
        }
        Ok(list)
    }

    /// Answer HTTP request ``id``: its status, headers and body (bytes, or an iterable of
    /// buffers). ``cache``: ``(tag, generation)`` to store the answer in the cache's first
    /// tier (see `enable_cache`). False when the client has gone.
    #[pyo3(signature = (id, status, headers, body, cache = None))]
    fn respond(
        &self,
        id: u64,
        status: u16,
        headers: Vec<(Vec<u8>, Vec<u8>)>,
        body: &Bound<'_, PyAny>,
        cache: Option<(u32, u64)>,
    ) -> PyResult<bool> {
        let body = joined(body)?;
        Ok(
            match self.hub.remove_if(id, |p| matches!(p, Pending::Http(..))) {
                Some(Pending::Http(send, key)) => {
                    if let (Some(key), Some((tag, generation)), 200) = (key, cache, status) {
                        let stored = Stored {
                            tag,
                            status,
                            headers: headers.clone(),
                            body: body.clone(),
                        };
                        self.hub.tier.store(key, stored, generation);
                    }
                    send.send(HttpReply {
                        status,
                        headers,
                        body: ReplyBody::Whole(body),
                    })
                    .is_ok()
                }
                _ => false,
            },
        )
    }

    /// Start a streamed answer to HTTP request ``id`` (chunked, or HTTP/2 DATA frames): its
    /// status and headers now, its parts through `stream_send` (each taken by the
    /// connection pushes a credit), its end through `stream_close`. False when the client
    /// has gone.
    fn respond_stream(&self, id: u64, status: u16, headers: Vec<(Vec<u8>, Vec<u8>)>) -> bool {
        // One lock for the swap: the request's InFlight never finds the id missing between.
        let mut pending = self.hub.pending.lock().unwrap();
        if !matches!(pending.get(&id), Some(Pending::Http(..))) {
            return false;
        }
        let Some(Pending::Http(send, _)) = pending.remove(&id) else {
            return false;
        };
        let (parts, receiver) = tokio::sync::mpsc::unbounded_channel();
        let reading = Arc::new(tokio::sync::Semaphore::new(0));
        let reply = HttpReply {
            status,
            headers,
            body: ReplyBody::Streamed(receiver),
        };
        if send.send(reply).is_err() {
            return false;
        }
        pending.insert(
            id,
            Pending::Stream(StreamWay {
                responses: parts,
                reading,
            }),
        );
        true
    }

    /// Answer unary gRPC call ``id``: a serialized message (status OK), or a status code and
    /// message with ``body`` None. ``cache``: as for `respond`. False when the client has gone.
    #[pyo3(signature = (id, code, message, body = None, cache = None))]
    fn reply(
        &self,
        id: u64,
        code: u32,
        message: String,
        body: Option<&Bound<'_, PyAny>>,
        cache: Option<(u32, u64)>,
    ) -> PyResult<bool> {
        let body = body.map(joined).transpose()?;
        Ok(
            match self.hub.remove_if(id, |p| matches!(p, Pending::Unary(..))) {
                Some(Pending::Unary(send, key)) => {
                    if let (Some(key), Some((tag, generation)), Some(body), 0) =
                        (key, cache, &body, code)
                    {
                        let stored = Stored {
                            tag,
                            status: 200,
                            headers: Vec::new(),
                            body: body.clone(),
                        };
                        self.hub.tier.store(key, stored, generation);
                    }
                    send.send(GrpcReply {
                        code,
                        message,
                        body,
                    })
                    .is_ok()
                }
                _ => false,
            },
        )
    }

    /// Turn the cache's first tier on with ``capacity`` bytes (0: off), empty, for the
    /// models as loaded at ``generation``.
    fn enable_cache(&self, capacity: usize, generation: u64) {
        self.hub.tier.configure(capacity, generation);
    }

    /// Empty the first tier: the loaded models changed (now at ``generation``).
    fn clear_cache(&self, generation: u64) {
        self.hub.tier.clear(generation);
    }

    /// The first tier's hits since the last call: ``(tag, count, total_ns, lookup_ns)``.
    fn take_cache_hits(&self) -> Vec<(u32, u64, u64, u64)> {
        self.hub
            .tier
            .take_hits()
            .into_iter()
            .map(|(tag, hits)| (tag, hits.count, hits.total_ns, hits.lookup_ns))
            .collect()
    }

    /// The first tier's entries, bytes used, capacity and evictions.
    fn cache_usage(&self) -> (usize, usize, usize, u64) {
        self.hub.tier.usage()
    }

    /// Send one serialized response down stream ``id``. False when the client has gone.
    fn stream_send(&self, id: u64, message: &Bound<'_, PyAny>) -> PyResult<bool> {
        let message = joined(message)?;
        let pending = self.hub.pending.lock().unwrap();
        Ok(match pending.get(&id) {
            Some(Pending::Stream(way)) => way.responses.send(StreamItem::Message(message)).is_ok(),
            _ => false,
        })
    }

    /// Python has taken up ``count`` more messages of stream ``id``: its reader may hand
    /// over that many more.
    fn stream_read(&self, id: u64, count: usize) {
        if let Some(Pending::Stream(way)) = self.hub.pending.lock().unwrap().get(&id) {
            way.reading.add_permits(count);
        }
    }

    /// End stream ``id`` with a status. False when the client has gone.
    fn stream_close(&self, id: u64, code: u32, message: String) -> bool {
        match self.hub.remove_if(id, |p| matches!(p, Pending::Stream(..))) {
            Some(Pending::Stream(way)) => way
                .responses
                .send(StreamItem::End { code, message })
                .is_ok(),
            _ => false,
        }
    }

    /// Stop accepting connections and ask open ones to close once their answers are out
    /// (HTTP/1.1: after the current response; HTTP/2: GOAWAY).
    fn stop_accepting(&self) {
        let _ = self.stopping.send(true);
        if let Some(graceful) = self.graceful.lock().unwrap().take() {
            if let Some(runtime) = self.runtime.lock().unwrap().as_ref() {
                let (done, closed) = std::sync::mpsc::channel();
                *self.closed.lock().unwrap() = Some(closed);
                runtime.spawn(async move {
                    graceful.shutdown().await;
                    let _ = done.send(());
                });
            }
        }
    }

    /// Stop everything. Requests still waiting for Python are answered 503 (gRPC:
    /// UNAVAILABLE); connections get ``timeout`` seconds to send what they have, then are
    /// cut, and the runtime's threads are joined.
    #[pyo3(signature = (timeout = 1.0))]
    fn close(&self, py: Python<'_>, timeout: f64) {
        self.stop_accepting();
        let timeout = Duration::from_secs_f64(timeout.max(0.0));
        // Dropping the pending senders answers each waiting client.
        let pending: Vec<Pending> = self
            .hub
            .pending
            .lock()
            .unwrap()
            .drain()
            .map(|(_, p)| p)
            .collect();
        drop(pending);
        let closed = self.closed.lock().unwrap().take();
        let runtime = self.runtime.lock().unwrap().take();
        py.allow_threads(|| {
            if let Some(closed) = closed {
                let _ = closed.recv_timeout(timeout);
            }
            if let Some(runtime) = runtime {
                runtime.shutdown_timeout(Duration::from_millis(100));
            }
        });
    }
}

impl Frontend {
    /// ``listener`` registered with the runtime, and the runtime to spawn its task on.
    fn on_runtime(&self, listener: StdListener) -> PyResult<(TcpListener, tokio::runtime::Handle)> {
        let guard = self.runtime.lock().unwrap();
        let runtime = guard
            .as_ref()
            .ok_or_else(|| PyRuntimeError::new_err("the front end is closed"))?;
        let handle = runtime.handle().clone();
        let _entered = handle.enter();
        Ok((TcpListener::from_std(listener)?, handle.clone()))
    }
}

/// Capacity errors of accept(2): the process or the system is out of something; retry.
fn out_of_capacity(error: &std::io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOMEM | libc::ENOBUFS)
    )
}

/// An accept failure as the log names it: ``EMFILE (Too many open files)``.
fn described(error: &std::io::Error) -> String {
    let name = match error.raw_os_error() {
        Some(libc::EMFILE) => "EMFILE",
        Some(libc::ENFILE) => "ENFILE",
        Some(libc::ENOMEM) => "ENOMEM",
        Some(libc::ENOBUFS) => "ENOBUFS",
        _ => "error",
    };
    let text = error.to_string();
    let text = text.split(" (os error").next().unwrap_or(&text).to_owned();
    format!("{name} ({text})")
}

/// The next connection of ``listener``, or None once the front end stops. Capacity errors
/// are reported (once per episode, by the Python side) and retried every 0.1 s.
async fn next_connection(
    listener: &TcpListener,
    stopping: &mut watch::Receiver<bool>,
    hub: &Hub,
) -> Option<tokio::net::TcpStream> {
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stopping.wait_for(|stop| *stop) => return None,
        };
        match accepted {
            Ok((stream, _)) => {
                let _ = stream.set_nodelay(true);
                return Some(stream);
            }
            Err(error) => {
                if out_of_capacity(&error) {
                    hub.push(Event::Trouble {
                        kind: Trouble::Accept,
                        detail: described(&error),
                    });
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn accept_http(
    listener: TcpListener,
    hub: Arc<Hub>,
    graceful: Arc<Mutex<Option<GracefulShutdown>>>,
    mut stopping: watch::Receiver<bool>,
    limits: http::HttpLimits,
    connection_limits: ConnectionLimits,
    connections: Arc<Connections>,
) {
    while let Some(stream) = next_connection(&listener, &mut stopping, &hub).await {
        let open = connections.open.load(Ordering::Acquire);
        if open >= connection_limits.max_connections {
            if connections.evict_oldest_silent() {
                hub.push(Event::Trouble {
                    kind: Trouble::Evicted,
                    detail: format!(
                        "{open} open, --http-max-connections {}",
                        connection_limits.max_connections
                    ),
                });
            } else {
                hub.push(Event::Trouble {
                    kind: Trouble::TurnedAway,
                    detail: format!(
                        "{open} open, --http-max-connections {}",
                        connection_limits.max_connections
                    ),
                });
                tokio::spawn(turn_away(stream, open));
                continue;
            }
        }
        let (watched, state) = connections.admit(stream);
        let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .max_buf_size(MAX_HEAD_SIZE);
        builder
            .http2()
            .timer(TokioTimer::new())
            .initial_connection_window_size(H2_CONNECTION_WINDOW)
            .initial_stream_window_size(H2_STREAM_WINDOW);
        let service_hub = hub.clone();
        let service_state = state.clone();
        let service = service_fn(move |request| {
            let hub = service_hub.clone();
            let busy = Busy::new(service_state.clone());
            async move {
                let answer = http::serve_request(hub, limits, request, &busy).await;
                drop(busy);
                answer
            }
        });
        let connection = builder
            .serve_connection(TokioIo::new(watched), service)
            .into_owned();
        let connection = {
            let graceful = graceful.lock().unwrap();
            let Some(graceful) = graceful.as_ref() else {
                break;
            };
            graceful.watch(connection)
        };
        let connections = connections.clone();
        let hub = hub.clone();
        tokio::spawn(async move {
            let mut connection = Box::pin(connection);
            let expiry = tokio::select! {
                _ = &mut connection => None,
                expiry = state.expired(connection_limits) => Some(expiry),
            };
            if let Some(Expiry::TooSlow(message)) = expiry {
                state.send_raw(&raw_answer(408, "Request Timeout", &message));
                let lingering = state.duplicate();
                drop(connection);
                hub.push(Event::Trouble {
                    kind: Trouble::Slow,
                    detail: message,
                });
                if let Some(stream) = lingering {
                    conn::linger(stream).await;
                }
            }
            connections.closed(&state);
        });
    }
}

/// Answers a connection over the limit with a JSON 503, then reads what it sends for a
/// moment (closing with a request unread would reset the connection before it reads the
/// answer), and closes.
async fn turn_away(mut stream: tokio::net::TcpStream, open: usize) {
    use tokio::io::AsyncWriteExt;
    let message = format!(
        "too many connections: the server already holds {open} (--http-max-connections); \
         retry later"
    );
    let answer = raw_answer(503, "Service Unavailable", &message);
    let written = tokio::time::timeout(Duration::from_secs(5), stream.write_all(&answer)).await;
    if matches!(written, Ok(Ok(()))) {
        conn::linger(stream).await;
    }
}

async fn accept_grpc(
    listener: TcpListener,
    hub: Arc<Hub>,
    graceful: Arc<Mutex<Option<GracefulShutdown>>>,
    mut stopping: watch::Receiver<bool>,
    max_message: usize,
) {
    while let Some(stream) = next_connection(&listener, &mut stopping, &hub).await {
        let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
        builder
            .timer(TokioTimer::new())
            .initial_connection_window_size(H2_CONNECTION_WINDOW)
            .initial_stream_window_size(H2_STREAM_WINDOW)
            .max_concurrent_streams(4096)
            .max_send_buf_size(4 * 1024 * 1024);
        let service_hub = hub.clone();
        let service =
            service_fn(move |request| grpc::serve_call(service_hub.clone(), max_message, request));
        let connection = builder.serve_connection(TokioIo::new(stream), service);
        let connection = {
            let graceful = graceful.lock().unwrap();
            let Some(graceful) = graceful.as_ref() else {
                break;
            };
            graceful.watch(connection)
        };
        tokio::spawn(async move {
            let _ = connection.await;
        });
    }
}

#[pymodule]
fn _native(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<Frontend>()?;
    module.add_class::<Body>()?;
    module.add("HTTP", HTTP)?;
    module.add("UNARY", UNARY)?;
    module.add("STREAM_OPEN", STREAM_OPEN)?;
    module.add("STREAM_MESSAGE", STREAM_MESSAGE)?;
    module.add("STREAM_END", STREAM_END)?;
    module.add("CANCEL", CANCEL)?;
    module.add("CREDIT", CREDIT)?;
    module.add("TROUBLE", TROUBLE)?;
    module.add("TROUBLE_SLOW", Trouble::Slow as u8)?;
    module.add("TROUBLE_EVICTED", Trouble::Evicted as u8)?;
    module.add("TROUBLE_ACCEPT", Trouble::Accept as u8)?;
    module.add("TROUBLE_TURNED_AWAY", Trouble::TurnedAway as u8)?;
    Ok(())
}
