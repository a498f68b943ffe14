//! The first tier of the response cache: answers as the client received them, keyed on the
//! request as it came over the wire, answered without the interpreter.
//!
//! How this works: an inference request that may be cached (HTTP `POST .../infer`, gRPC
//! `ModelInfer`, no `traceparent`, at most `MAX_KEYED` bytes) gets a key: the route, the
//! headers that change the answer, and the body. A key that is stored is answered here. One
//! that is not goes to Python as usual, keeping its key; when Python answers it from a model
//! with the response cache on (whose own cache semantics decided it may be stored), it hands
//! the answer back with the model's *tag* and the server's *generation* of loaded models,
//! and the answer is stored if that generation is still current. Any load, reload or unload
//! clears the tier (`clear`), so an answer never outlives the revision that computed it. The
//! same bytes in always give the same bytes out: the key holds every byte of the request
//! (the model, its version, the inputs, the request id and parameters), compared whole on a
//! hit. Hits are counted per tag, for Python to add to the model's statistics.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use bytes::{BufMut, Bytes, BytesMut};
use hyper::HeaderMap;
use lru::LruCache;

/// Requests larger than this are never keyed (large answers go through Python's cache).
pub const MAX_KEYED: usize = 1024 * 1024;

/// The request headers that can change an HTTP answer's bytes.
const ANSWER_HEADERS: &[&str] = &[
    "content-type",
    "content-encoding",
    "accept-encoding",
    "inference-header-content-length",
];

/// A stored answer.
pub struct Stored {
    pub tag: u32,
    pub status: u16,
    pub headers: Vec<(Vec<u8>, Vec<u8>)>,
    pub body: Bytes,
}

impl Stored {
    fn size(&self, key: &Bytes) -> usize {
        key.len()
            + self.body.len()
            + self
                .headers
                .iter()
                .map(|(n, v)| n.len() + v.len())
                .sum::<usize>()
            + 64
    }
}

#[derive(Default, Clone, Copy)]
pub struct Hits {
    pub count: u64,
    /// From the request's arrival to its answer.
    pub total_ns: u64,
    /// The lookups' share of it.
    pub lookup_ns: u64,
}

struct Inner {
    entries: LruCache<Bytes, std::sync::Arc<Stored>>,
    used: usize,
    capacity: usize,
    generation: u64,
    hits: HashMap<u32, Hits>,
    evictions: u64,
}

pub struct Tier {
    inner: Mutex<Inner>,
}

impl Default for Tier {
    fn default() -> Self {
        Tier {
            inner: Mutex::new(Inner {
                entries: LruCache::unbounded(),
                used: 0,
                capacity: 0,
                generation: 0,
                hits: HashMap::new(),
                evictions: 0,
            }),
        }
    }
}

fn key_of(kind: u8, route: &[u8], headers: &HeaderMap, names: &[&str], body: &[u8]) -> Bytes {
    let mut key = BytesMut::with_capacity(route.len() + body.len() + 64);
    key.put_u8(kind);
    key.put_u32(route.len() as u32);
    key.extend_from_slice(route);
    for name in names {
        let value = headers.get(*name).map(|v| v.as_bytes()).unwrap_or(b"");
        key.put_u32(value.len() as u32);
        key.extend_from_slice(value);
    }
    key.extend_from_slice(body);
    key.freeze()
}

impl Tier {
    pub fn enabled(&self) -> bool {
        self.inner.lock().unwrap().capacity > 0
    }

    /// The key of an HTTP request, if it may be answered from the tier.
    pub fn http_key(
        &self,
        method: &str,
        target: &str,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Option<Bytes> {
        if method != "POST"
            || body.len() > MAX_KEYED
            || headers.contains_key("traceparent")
            || !target
                .split('?')
                .next()
                .unwrap_or("")
                .trim_end_matches('/')
                .ends_with("/infer")
            || !self.enabled()
        {
            return None;
        }
        Some(key_of(
            b'h',
            target.as_bytes(),
            headers,
            ANSWER_HEADERS,
            body,
        ))
    }

    /// The key of a unary gRPC call, if it may be answered from the tier.
    pub fn grpc_key(&self, method: &str, headers: &HeaderMap, message: &[u8]) -> Option<Bytes> {
        if method != "ModelInfer"
            || message.len() > MAX_KEYED
            || headers.contains_key("traceparent")
            || !self.enabled()
        {
            return None;
        }
        Some(key_of(b'g', method.as_bytes(), headers, &[], message))
    }

    /// The stored answer of ``key``, counted as a hit of its tag (``arrived``: when the
    /// request's body was complete).
    pub fn lookup(&self, key: &Bytes, arrived: Instant) -> Option<std::sync::Arc<Stored>> {
        let looking = Instant::now();
        let mut inner = self.inner.lock().unwrap();
        let stored = inner.entries.get(key)?.clone();
        let now = Instant::now();
        let hits = inner.hits.entry(stored.tag).or_default();
        hits.count += 1;
        hits.lookup_ns += (now - looking).as_nanos() as u64;
        hits.total_ns += (now - arrived).as_nanos() as u64;
        Some(stored)
    }

    /// Stores an answer computed at ``generation`` (ignored when the models changed since,
    /// or when it is larger than the whole tier).
    pub fn store(&self, key: Bytes, stored: Stored, generation: u64) {
        let mut inner = self.inner.lock().unwrap();
        let size = stored.size(&key);
        if generation != inner.generation || size > inner.capacity {
            return;
        }
        if let Some(old) = inner.entries.pop(&key) {
            inner.used -= old.size(&key);
        }
        while inner.used + size > inner.capacity {
            match inner.entries.pop_lru() {
                Some((old_key, old)) => {
                    inner.used -= old.size(&old_key);
                    inner.evictions += 1;
                }
                None => break,
            }
        }
        inner.used += size;
        inner.entries.put(key, std::sync::Arc::new(stored));
    }

    /// Empties the tier; answers computed before ``generation`` are no longer stored.
    pub fn clear(&self, generation: u64) {
        let mut inner = self.inner.lock().unwrap();
        inner.entries.clear();
        inner.used = 0;
        inner.generation = generation;
    }

    /// Turns the tier on (``capacity`` bytes) or off (0), empty.
    pub fn configure(&self, capacity: usize, generation: u64) {
        let mut inner = self.inner.lock().unwrap();
        inner.capacity = capacity;
        inner.entries.clear();
        inner.used = 0;
        inner.generation = generation;
    }

    /// The hits counted since the last call, by tag.
    pub fn take_hits(&self) -> Vec<(u32, Hits)> {
        let mut inner = self.inner.lock().unwrap();
        inner.hits.drain().collect()
    }

    /// Entries, bytes used, capacity, evictions.
    pub fn usage(&self) -> (usize, usize, usize, u64) {
        let inner = self.inner.lock().unwrap();
        (
            inner.entries.len(),
            inner.used,
            inner.capacity,
            inner.evictions,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(tag: u32, size: usize) -> Stored {
        Stored {
            tag,
            status: 200,
            headers: vec![],
            body: Bytes::from(vec![7u8; size]),
        }
    }

    fn key(text: &str) -> Bytes {
        Bytes::copy_from_slice(text.as_bytes())
    }

    #[test]
    fn a_stored_answer_is_found_and_counted_for_its_tag() {
        let tier = Tier::default();
        tier.configure(10_000, 3);
        tier.store(key("a"), answer(5, 100), 3);
        let found = tier.lookup(&key("a"), Instant::now()).expect("stored");
        assert_eq!(found.body.len(), 100);
        assert!(tier.lookup(&key("b"), Instant::now()).is_none());
        let hits = tier.take_hits();
        assert_eq!(hits.len(), 1);
        assert_eq!((hits[0].0, hits[0].1.count), (5, 1));
        assert!(tier.take_hits().is_empty());
    }

    #[test]
    fn answers_of_an_older_generation_are_not_stored_and_a_clear_forgets_all() {
        let tier = Tier::default();
        tier.configure(10_000, 1);
        tier.store(key("a"), answer(0, 10), 1);
        tier.clear(2);
        assert!(tier.lookup(&key("a"), Instant::now()).is_none());
        tier.store(key("b"), answer(0, 10), 1); // computed before the change
        assert!(tier.lookup(&key("b"), Instant::now()).is_none());
        assert_eq!(tier.usage().0, 0);
    }

    #[test]
    fn the_least_recently_used_answers_go_first_and_bytes_stay_bounded() {
        let tier = Tier::default();
        tier.configure(1_000, 0);
        for name in ["a", "b", "c"] {
            tier.store(key(name), answer(0, 200), 0);
        }
        assert!(tier.lookup(&key("a"), Instant::now()).is_some()); // a is now the newest
        tier.store(key("d"), answer(0, 200), 0);
        tier.store(key("e"), answer(0, 200), 0);
        assert!(tier.lookup(&key("a"), Instant::now()).is_some());
        assert!(tier.lookup(&key("b"), Instant::now()).is_none());
        let (entries, used, capacity, evictions) = tier.usage();
        assert!(used <= capacity, "{used} > {capacity}");
        assert_eq!((entries, evictions), (3, 2));
        tier.store(key("huge"), answer(0, 5_000), 0); // larger than the tier: not stored
        assert!(tier.lookup(&key("huge"), Instant::now()).is_none());
    }

    #[test]
    fn keys_cover_the_route_the_answer_headers_and_every_byte() {
        let tier = Tier::default();
        tier.configure(1_000, 0);
        let mut headers = HeaderMap::new();
        let one = tier
            .http_key("POST", "/v2/models/m/infer", &headers, b"{}")
            .unwrap();
        let other_model = tier
            .http_key("POST", "/v2/models/n/infer", &headers, b"{}")
            .unwrap();
        let other_body = tier
            .http_key("POST", "/v2/models/m/infer", &headers, b"{ }")
            .unwrap();
        headers.insert("accept-encoding", "gzip".parse().unwrap());
        let gzip = tier
            .http_key("POST", "/v2/models/m/infer", &headers, b"{}")
            .unwrap();
        assert!(one != other_model && one != other_body && one != gzip);
        assert!(tier
            .http_key("GET", "/v2/models/m/infer", &headers, b"")
            .is_none());
        assert!(tier
            .http_key("POST", "/v2/models/m/config", &headers, b"")
            .is_none());
        headers.insert("traceparent", "00-1-2-01".parse().unwrap());
        assert!(tier
            .http_key("POST", "/v2/models/m/infer", &headers, b"{}")
            .is_none());
        assert!(tier
            .grpc_key("ModelInfer", &HeaderMap::new(), b"x")
            .is_some());
        assert!(tier
            .grpc_key("ModelConfig", &HeaderMap::new(), b"x")
            .is_none());
        tier.configure(0, 0);
        assert!(tier
            .grpc_key("ModelInfer", &HeaderMap::new(), b"x")
            .is_none());
    }
}
