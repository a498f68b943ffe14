//! gRPC over HTTP/2: the length-prefixed messages of unary and streaming calls, statuses in
//! trailers. Messages stay bytes here: the trio thread decodes and encodes them (protobuf's
//! C code), so Rust needs no `.proto`.
//!
//! How this works: a unary call's body is read whole (within the message limit), its one
//! message is handed to the trio thread, and the answer goes out as a message then the
//! trailers. A streaming call (ModelStreamInfer) pushes `StreamOpen`, then each message as it
//! is framed, then `StreamEnd`; its responses come down an unbounded channel (the Python
//! side bounds them with credits) and each one polled out of `StreamBody` pushes a `Credit`.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{HeaderMap, Request, Response};
use tokio::sync::{mpsc, oneshot, Semaphore};

use crate::hub::{Event, GrpcReply, Hub, InFlight, Pending, StreamItem, StreamWay};

pub const OK: u32 = 0;
pub const RESOURCE_EXHAUSTED: u32 = 8;
pub const UNIMPLEMENTED: u32 = 12;
pub const INTERNAL: u32 = 13;
pub const UNAVAILABLE: u32 = 14;

/// Messages of one stream handed to Python and not yet taken up (`Frontend::stream_read`).
pub const STREAM_READ_AHEAD: usize = 64;

/// The methods of `inference.GRPCInferenceService` whose requests stream.
const STREAMING: &[&str] = &["ModelStreamInfer"];
const SERVICE: &str = "/inference.GRPCInferenceService/";

/// The response body of a gRPC call: messages, then the status in trailers.
pub struct GrpcBody {
    hub: Arc<Hub>,
    source: Source,
    done: bool,
    _flight: Option<InFlight>,
}

enum Source {
    /// A whole answer: at most one message, then the status.
    Ready(Option<Bytes>, Option<(u32, String)>),
    /// A stream's responses as they come.
    Stream(u64, mpsc::UnboundedReceiver<StreamItem>),
}

fn frame_message(message: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(message.len() + 5);
    out.put_u8(0);
    out.put_u32(message.len() as u32);
    out.extend_from_slice(message);
    out.freeze()
}

/// grpc-message is percent-encoded (the gRPC spec: space to ~ except %, as is).
fn percent_encoded(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for byte in message.bytes() {
        if (0x20..=0x7e).contains(&byte) && byte != b'%' {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

fn trailers(code: u32, message: &str) -> HeaderMap {
    let mut map = HeaderMap::new();
    map.insert("grpc-status", code.to_string().parse().unwrap());
    if !message.is_empty() {
        if let Ok(value) = percent_encoded(message).parse() {
            map.insert("grpc-message", value);
        }
    }
    map
}

impl Body for GrpcBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let this = &mut *self;
        match &mut this.source {
            Source::Ready(message, status) => {
                if let Some(message) = message.take() {
                    return Poll::Ready(Some(Ok(Frame::data(frame_message(&message)))));
                }
                let (code, text) = status.take().unwrap_or((OK, String::new()));
                this.done = true;
                Poll::Ready(Some(Ok(Frame::trailers(trailers(code, &text)))))
            }
            Source::Stream(id, receiver) => match receiver.poll_recv(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(Some(StreamItem::Message(message))) => {
                    this.hub.push(Event::Credit { id: *id });
                    Poll::Ready(Some(Ok(Frame::data(frame_message(&message)))))
                }
                Poll::Ready(Some(StreamItem::End { code, message })) => {
                    this.done = true;
                    Poll::Ready(Some(Ok(Frame::trailers(trailers(code, &message)))))
                }
                Poll::Ready(None) => {
                    // The server stopped without closing this stream.
                    this.done = true;
                    Poll::Ready(Some(Ok(Frame::trailers(trailers(
                        UNAVAILABLE,
                        "the server is shutting down",
                    )))))
                }
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

fn response(body: GrpcBody) -> Response<GrpcBody> {
    Response::builder()
        .status(200)
        .header("content-type", "application/grpc")
        .body(body)
        .unwrap()
}

fn status_only(hub: &Arc<Hub>, code: u32, message: String) -> Response<GrpcBody> {
    response(GrpcBody {
        hub: hub.clone(),
        source: Source::Ready(None, Some((code, message))),
        done: false,
        _flight: None,
    })
}

/// Splits framed messages off the front of `buffer`; an error for a compressed one, or one
/// over `limit`.
fn next_message(buffer: &mut BytesMut, limit: usize) -> Result<Option<Bytes>, (u32, String)> {
    if buffer.len() < 5 {
        return Ok(None);
    }
    let compressed = buffer[0];
    let length = u32::from_be_bytes([buffer[1], buffer[2], buffer[3], buffer[4]]) as usize;
    if compressed != 0 {
        return Err((
            UNIMPLEMENTED,
            "compressed gRPC messages are not supported: send them uncompressed".to_owned(),
        ));
    }
    if length > limit {
        // grpcio's words for the same refusal.
        return Err((
            RESOURCE_EXHAUSTED,
            format!("Received message larger than max ({length} vs. {limit})"),
        ));
    }
    if buffer.len() < 5 + length {
        return Ok(None);
    }
    buffer.advance(5);
    Ok(Some(buffer.split_to(length).freeze()))
}

/// Answers one gRPC call through the trio thread.
pub async fn serve_call(
    hub: Arc<Hub>,
    max_message: usize,
    request: Request<Incoming>,
) -> Result<Response<GrpcBody>, std::convert::Infallible> {
    let arrived = std::time::Instant::now();
    let (parts, body) = request.into_parts();
    let path = parts.uri.path();
    let Some(method) = path.strip_prefix(SERVICE).map(str::to_owned) else {
        return Ok(status_only(
            &hub,
            UNIMPLEMENTED,
            format!("Method not found: {path}"),
        ));
    };
    if STREAMING.contains(&method.as_str()) {
        return Ok(open_stream(hub, max_message, method, parts.headers, body));
    }
    let mut body = body;
    let mut buffer = BytesMut::new();
    let message = loop {
        match next_message(&mut buffer, max_message) {
            Err((code, text)) => return Ok(status_only(&hub, code, text)),
            Ok(Some(message)) => break message,
            Ok(None) => {}
        }
        match body.frame().await {
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    buffer.extend_from_slice(&data);
                }
            }
            Some(Err(_)) => {
                return Ok(status_only(
                    &hub,
                    INTERNAL,
                    "the request was cut off".to_owned(),
                ))
            }
            None => {
                return Ok(status_only(
                    &hub,
                    INTERNAL,
                    "the call ended without a request message".to_owned(),
                ))
            }
        }
    };
    let key = hub.tier.grpc_key(&method, &parts.headers, &message);
    if let Some(key) = &key {
        if let Some(stored) = hub.tier.lookup(key, arrived) {
            return Ok(response(GrpcBody {
                hub: hub.clone(),
                source: Source::Ready(Some(stored.body.clone()), None),
                done: false,
                _flight: None,
            }));
        }
    }
    let (send, receive) = oneshot::channel();
    let flight = hub.register(Pending::Unary(send, key));
    hub.push(Event::Unary {
        id: flight.id,
        method,
        headers: parts.headers,
        message,
    });
    let reply = receive.await.unwrap_or(GrpcReply {
        code: UNAVAILABLE,
        message: "the server is shutting down".to_owned(),
        body: None,
    });
    let status = if reply.code == OK && reply.body.is_some() {
        None
    } else {
        Some((reply.code, reply.message))
    };
    Ok(response(GrpcBody {
        hub: hub.clone(),
        source: Source::Ready(reply.body, status),
        done: false,
        _flight: None,
    }))
}

fn open_stream(
    hub: Arc<Hub>,
    max_message: usize,
    method: String,
    headers: HeaderMap,
    body: Incoming,
) -> Response<GrpcBody> {
    let (send, receive) = mpsc::unbounded_channel();
    let reading = Arc::new(Semaphore::new(STREAM_READ_AHEAD));
    let flight = hub.register(Pending::Stream(StreamWay {
        responses: send,
        reading: reading.clone(),
    }));
    let id = flight.id;
    hub.push(Event::StreamOpen {
        id,
        method,
        headers,
    });
    let reader_hub = hub.clone();
    // The reader ends with its body: when the client half-closes or goes away.
    tokio::spawn(async move {
        let hub = reader_hub;
        let mut body = body;
        let mut buffer = BytesMut::new();
        let error = loop {
            match next_message(&mut buffer, max_message) {
                Err((_, text)) => break Some(text),
                Ok(Some(message)) => {
                    // Read no further ahead of Python than STREAM_READ_AHEAD messages: the
                    // client then meets HTTP/2 flow control, and memory stays bounded.
                    match reading.acquire().await {
                        Ok(permit) => permit.forget(),
                        Err(_) => return, // answered or gone: nothing more to hand over
                    }
                    hub.push(Event::StreamMessage { id, message });
                    continue;
                }
                Ok(None) => {}
            }
            match body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        buffer.extend_from_slice(&data);
                    }
                }
                Some(Err(_)) => break None,
                None => {
                    break (!buffer.is_empty())
                        .then(|| "the stream ended inside a message".to_owned())
                }
            }
        };
        hub.push(Event::StreamEnd { id, error });
    });
    response(GrpcBody {
        hub,
        source: Source::Stream(id, receive),
        done: false,
        _flight: Some(flight),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_split_off_as_they_complete() {
        let mut buffer = BytesMut::new();
        buffer.extend_from_slice(&frame_message(b"hello"));
        buffer.extend_from_slice(&frame_message(b"")[..3]);
        assert_eq!(
            next_message(&mut buffer, 100).unwrap().unwrap(),
            Bytes::from("hello")
        );
        assert!(next_message(&mut buffer, 100).unwrap().is_none());
        buffer.extend_from_slice(&[0, 0]);
        assert_eq!(
            next_message(&mut buffer, 100).unwrap().unwrap(),
            Bytes::new()
        );
    }

    #[test]
    fn compressed_and_oversized_messages_are_refused() {
        let mut compressed = BytesMut::from(&[1u8, 0, 0, 0, 1, 9][..]);
        assert_eq!(
            next_message(&mut compressed, 100).unwrap_err().0,
            UNIMPLEMENTED
        );
        let mut large = BytesMut::from(&frame_message(&[0u8; 200])[..]);
        let (code, text) = next_message(&mut large, 100).unwrap_err();
        assert_eq!(code, RESOURCE_EXHAUSTED);
        assert_eq!(text, "Received message larger than max (200 vs. 100)");
    }

    #[test]
    fn grpc_message_is_percent_encoded() {
        assert_eq!(percent_encoded("a 100% é\n"), "a 100%25 %C3%A9%0A");
    }
}
