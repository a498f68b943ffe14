//! The HTTP/1.1 and HTTP/2 front end: bodies read within their limits, handed to the trio
//! thread whole, answered with what it sends back.
//!
//! How this works: hyper parses and frames; `serve_request` reads the body (the size limit,
//! a stall timeout and a whole deadline that grows with what arrived, as the Python server
//! does), registers the request in the hub, pushes it, and waits for the answer. Everything
//! about routes, checks and error texts lives once, in Python.
//!
//! An answer comes whole, or streamed (server-sent events): then its body (`AnswerBody`)
//! takes the parts the trio thread sends as hyper asks for them, and each part taken pushes a
//! `Credit`, so that Python, which sends only while it holds credits, is held back by a
//! client that reads slowly. The body owns the request's `InFlight`: a client that goes away
//! mid-stream drops it, which cancels the work.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Request, Response};

use crate::conn::Busy;
use tokio::sync::{mpsc, oneshot};
use tokio::time::{timeout_at, Instant};

use crate::hub::{Event, HttpReply, Hub, InFlight, Pending, ReplyBody, StreamItem, Trouble};

/// The body of an HTTP answer: whole, or the parts of a streamed one.
pub enum AnswerBody {
    Whole(Option<Bytes>),
    Streamed {
        hub: Arc<Hub>,
        id: u64,
        parts: mpsc::UnboundedReceiver<StreamItem>,
        done: bool,
        _flight: InFlight,
    },
}

impl AnswerBody {
    fn whole(body: Bytes) -> Self {
        AnswerBody::Whole(Some(body))
    }
}

impl Body for AnswerBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match &mut *self {
            AnswerBody::Whole(body) => Poll::Ready(body.take().map(|b| Ok(Frame::data(b)))),
            AnswerBody::Streamed {
                hub,
                id,
                parts,
                done,
                ..
            } => {
                if *done {
                    return Poll::Ready(None);
                }
                match parts.poll_recv(cx) {
                    Poll::Pending => Poll::Pending,
                    Poll::Ready(Some(StreamItem::Message(part))) => {
                        hub.push(Event::Credit { id: *id });
                        Poll::Ready(Some(Ok(Frame::data(part))))
                    }
                    Poll::Ready(Some(StreamItem::End { .. })) => {
                        *done = true;
                        Poll::Ready(None)
                    }
                    Poll::Ready(None) => {
                        // The server stopped mid-answer: cut the connection, so that the
                        // client does not take what it got for the whole answer.
                        *done = true;
                        Poll::Ready(Some(Err(std::io::Error::other(
                            "the server stopped in the middle of a streamed answer",
                        ))))
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            AnswerBody::Whole(body) => body.is_none(),
            AnswerBody::Streamed { done, .. } => *done,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            AnswerBody::Whole(Some(body)) => SizeHint::with_exact(body.len() as u64),
            AnswerBody::Whole(None) => SizeHint::with_exact(0),
            AnswerBody::Streamed { .. } => SizeHint::default(),
        }
    }
}

/// The limits of one listener, from `orchestrion serve`'s flags.
#[derive(Clone, Copy, Debug)]
pub struct HttpLimits {
    pub max_body: usize,
    pub body_timeout: Duration,
    /// Bytes per second a body must average after `body_timeout` (0: no such deadline).
    pub body_min_rate: f64,
}

pub fn json_error(message: &str) -> Bytes {
    let mut out = String::with_capacity(message.len() + 16);
    out.push_str("{\"error\": \"");
    for c in message.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push_str("\"}");
    Bytes::from(out)
}

fn refusal(status: u16, message: &str, close: bool) -> Response<AnswerBody> {
    let mut response = Response::builder()
        .status(status)
        .header("content-type", "application/json");
    if close {
        response = response.header("connection", "close");
    }
    response
        .body(AnswerBody::whole(json_error(message)))
        .unwrap()
}

fn too_large(size: usize, limit: usize) -> String {
    // Triton's words: clients match on them.
    format!(
        "request JSON size of {size} bytes exceeds the maximum allowed input size of {limit} \
         bytes. Use --http-max-input-size to increase the limit."
    )
}

enum BodyError {
    TooLarge(usize),
    TooSlow(String),
    Broken,
}

async fn read_body(
    body: Incoming,
    declared: Option<usize>,
    limits: HttpLimits,
) -> Result<Bytes, BodyError> {
    if let Some(size) = declared {
        if size > limits.max_body {
            return Err(BodyError::TooLarge(size));
        }
    }
    let mut body = body;
    let mut buffer = BytesMut::with_capacity(declared.unwrap_or(0).min(limits.max_body));
    let start = Instant::now();
    loop {
        let whole = if limits.body_min_rate > 0.0 {
            start
                + limits.body_timeout
                + Duration::from_secs_f64(buffer.len() as f64 / limits.body_min_rate)
        } else {
            Instant::now() + Duration::from_secs(365 * 24 * 3600)
        };
        let stall = Instant::now() + limits.body_timeout;
        let deadline = whole.min(stall);
        match timeout_at(deadline, body.frame()).await {
            Err(_) => {
                let elapsed = start.elapsed().as_secs_f64();
                let message = if Instant::now() >= whole {
                    format!(
                        "the request body arrived too slowly: {} bytes in {:.0} s, below {} \
                         bytes/s after the first {} s (--http-body-min-rate, --http-body-timeout)",
                        buffer.len(),
                        elapsed,
                        crate::conn::seconds(Duration::from_secs_f64(limits.body_min_rate)),
                        crate::conn::seconds(limits.body_timeout)
                    )
                } else {
                    format!(
                        "the request body made no progress for {} s ({} bytes received; \
                         --http-body-timeout)",
                        crate::conn::seconds(limits.body_timeout),
                        buffer.len()
                    )
                };
                return Err(BodyError::TooSlow(message));
            }
            Ok(None) => return Ok(buffer.freeze()),
            Ok(Some(Err(_))) => return Err(BodyError::Broken),
            Ok(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    if buffer.len() + data.len() > limits.max_body {
                        return Err(BodyError::TooLarge(buffer.len() + data.len()));
                    }
                    buffer.extend_from_slice(&data);
                }
            }
        }
    }
}

/// Answers one HTTP request through the trio thread.
pub async fn serve_request(
    hub: Arc<Hub>,
    limits: HttpLimits,
    request: Request<Incoming>,
    busy: &Busy,
) -> Result<Response<AnswerBody>, std::convert::Infallible> {
    let arrived = std::time::Instant::now();
    let (parts, body) = request.into_parts();
    let declared = parts
        .headers
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    let body = match read_body(body, declared, limits).await {
        Ok(body) => {
            busy.body_read();
            body
        }
        Err(BodyError::TooLarge(size)) => {
            return Ok(refusal(413, &too_large(size, limits.max_body), true));
        }
        Err(BodyError::TooSlow(message)) => {
            let answer = refusal(408, &message, true);
            hub.push(Event::Trouble {
                kind: Trouble::Slow,
                detail: message,
            });
            return Ok(answer);
        }
        Err(BodyError::Broken) => return Ok(refusal(400, "the request body was cut off", true)),
    };
    let target = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "/".to_owned());
    let key = hub
        .tier
        .http_key(parts.method.as_str(), &target, &parts.headers, &body);
    if let Some(key) = &key {
        if let Some(stored) = hub.tier.lookup(key, arrived) {
            let body = AnswerBody::whole(stored.body.clone());
            return Ok(answer(stored.status, &stored.headers, body));
        }
    }
    let (send, receive) = oneshot::channel();
    let flight = hub.register(Pending::Http(send, key));
    hub.push(Event::Http {
        id: flight.id,
        method: parts.method.as_str().to_owned(),
        target,
        headers: parts.headers,
        body,
    });
    let reply = match receive.await {
        Ok(reply) => reply,
        // The server stopped without an answer for this request.
        Err(_) => HttpReply {
            status: 503,
            headers: vec![(b"content-type".to_vec(), b"application/json".to_vec())],
            body: ReplyBody::Whole(json_error("the server is shutting down")),
        },
    };
    let body = match reply.body {
        ReplyBody::Whole(body) => AnswerBody::whole(body),
        ReplyBody::Streamed(parts) => AnswerBody::Streamed {
            hub: hub.clone(),
            id: flight.id,
            parts,
            done: false,
            _flight: flight,
        },
    };
    Ok(answer(reply.status, &reply.headers, body))
}

fn answer(status: u16, headers: &[(Vec<u8>, Vec<u8>)], body: AnswerBody) -> Response<AnswerBody> {
    let mut response = Response::builder().status(status);
    for (name, value) in headers {
        response = response.header(name.as_slice(), value.as_slice());
    }
    response
        .body(body)
        .unwrap_or_else(|_| refusal(500, "the answer had a malformed header", false))
}
