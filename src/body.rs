//! Bodies: the one body type the gateway answers with, capped reading, and the memory budget
//! for buffered request bodies.
//!
//! Only idempotent routes buffer, and only up to a limit counted while reading (so chunked bodies
//! without `Content-Length` are capped too). Everything else streams. Every buffered request body
//! also draws on one [`Budget`] shared by all connections and streams (`server.max_buffered`):
//! a piece that does not fit fails the read ([`OverBudget`]) instead of taking memory, and what a
//! request holds is given back when its body is dropped ([`Lease`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use http_body::{Body as HttpBody, Frame};
use http_body_util::{BodyExt, BodyStream, Full, StreamBody};
use prometheus_client::metrics::gauge::Gauge;

pub use crate::error::BoxError;

/// Every response body, and every body sent upstream.
pub type Body = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

pub fn full(bytes: Bytes) -> Body {
    Full::new(bytes)
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// Boxes any body whose errors convert into [`BoxError`].
pub fn boxed<B>(body: B) -> Body
where
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed_unsync()
}

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("body larger than {0} bytes")]
    TooLarge(usize),
    #[error("body could not be read: {0}")]
    Failed(BoxError),
}

/// Reads a request body in full, refusing it as soon as it passes `limit` bytes.
#[cfg(test)]
pub async fn read_capped<B>(body: B, limit: usize) -> Result<Bytes, ReadError>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    if body.size_hint().lower() > limit as u64 {
        return Err(ReadError::TooLarge(limit));
    }
    match capture(body, limit).await? {
        Captured::Complete(bytes, _) => Ok(bytes),
        Captured::TooLarge { .. } => Err(ReadError::TooLarge(limit)),
    }
}

/// A body read up to a limit.
pub enum Captured<B> {
    /// The whole body, within the limit, and its trailers if it had any (at most one block,
    /// bounded by the protocol's header limits).
    Complete(Bytes, Option<http::HeaderMap>),
    /// The body passed the limit: what was read so far and the unread rest.
    TooLarge { head: Vec<Bytes>, rest: B },
}

/// Reads `body` until it ends or passes `limit` bytes; never holds more than `limit` plus one
/// chunk.
pub async fn capture<B>(mut body: B, limit: usize) -> Result<Captured<B>, ReadError>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let mut head: Vec<Bytes> = Vec::new();
    let mut total = 0usize;
    let mut trailers = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ReadError::Failed(e.into()))?;
        let data = match frame.into_data() {
            Ok(data) => data,
            Err(frame) => {
                if let Ok(t) = frame.into_trailers() {
                    trailers = Some(t);
                }
                continue;
            }
        };
        total = total.saturating_add(data.len());
        head.push(data);
        if total > limit {
            return Ok(Captured::TooLarge { head, rest: body });
        }
    }
    Ok(Captured::Complete(concat(head, total), trailers))
}

fn concat(chunks: Vec<Bytes>, total: usize) -> Bytes {
    match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.into_iter().next().unwrap_or_default(),
        _ => {
            let mut buf = BytesMut::with_capacity(total);
            for c in chunks {
                buf.extend_from_slice(&c);
            }
            buf.freeze()
        }
    }
}

/// `bytes`, then `trailers` (a gRPC answer's `grpc-status`) if there are any.
pub fn with_trailers(bytes: Bytes, trailers: Option<http::HeaderMap>) -> Body {
    let Some(trailers) = trailers else {
        return full(bytes);
    };
    let data = (!bytes.is_empty()).then(|| Ok(Frame::data(bytes)));
    let frames = data.into_iter().chain([Ok(Frame::trailers(trailers))]);
    StreamBody::new(futures_util::stream::iter(frames)).boxed_unsync()
}

/// A body that yields `head` and then the rest of `rest`: how a response too large to store
/// still reaches the client whole.
pub fn prepend<B>(head: Vec<Bytes>, rest: B) -> Body
where
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let head = futures_util::stream::iter(head.into_iter().map(|b| Ok(Frame::data(b))));
    let rest = BodyStream::new(rest.map_err(Into::into));
    StreamBody::new(head.chain(rest)).boxed_unsync()
}

/// Bytes of request bodies buffered at once, all requests together (`server.max_buffered`).
pub struct Budget {
    /// Bytes held now; the metric `idemgate_buffered_request_bytes` is this very gauge.
    used: Gauge,
    max: i64,
}

/// A buffered body would pass `server.max_buffered`.
#[derive(Debug, thiserror::Error)]
#[error("the buffered request bodies would pass server.max_buffered")]
pub struct OverBudget;

impl Budget {
    /// `used` is the gauge to count in.
    pub fn new(max: usize, used: Gauge) -> Arc<Self> {
        Arc::new(Budget {
            used,
            max: i64::try_from(max).unwrap_or(i64::MAX),
        })
    }

    /// An empty lease, to grow as a body is read.
    pub fn lease(self: &Arc<Self>) -> Lease {
        Lease {
            budget: Arc::clone(self),
            held: 0,
        }
    }

    /// Bytes held now.
    #[cfg(test)]
    pub fn used(&self) -> i64 {
        self.used.get()
    }
}

/// The part of the [`Budget`] one request holds; given back when dropped.
pub struct Lease {
    budget: Arc<Budget>,
    held: i64,
}

impl Lease {
    /// Takes `n` more bytes, if they fit.
    fn grow(&mut self, n: usize) -> Result<(), OverBudget> {
        let n = i64::try_from(n).map_err(|_| OverBudget)?;
        let max = self.budget.max;
        self.budget
            .used
            .inner()
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|total| *total <= max)
            })
            .map_err(|_| OverBudget)?;
        self.held += n;
        Ok(())
    }

    /// Takes `n` more bytes for something else the request holds (its decoded body), if they
    /// fit.
    pub fn take(&mut self, n: usize) -> Result<(), OverBudget> {
        self.grow(n)
    }

    /// Counts `n` bytes already taken (an allocator that gave more than asked), fit or not.
    fn grow_past(&mut self, n: usize) {
        let n = i64::try_from(n).unwrap_or(i64::MAX);
        if n > 0 {
            self.budget.used.inc_by(n);
            self.held = self.held.saturating_add(n);
        }
    }

    /// Gives `n` bytes back (a piece copied into the joined buffer and dropped).
    fn shrink(&mut self, n: usize) {
        let n = i64::try_from(n).unwrap_or(i64::MAX).min(self.held);
        self.budget.used.dec_by(n);
        self.held -= n;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.held > 0 {
            self.budget.used.dec_by(self.held);
        }
    }
}

/// What holding one piece of a body costs beyond its bytes (its handle, its allocation's
/// header), counted so that a body sent in many tiny pieces cannot hold more than it is charged.
const PIECE_COST: usize = 64;

/// Reads a request body in full, refusing it as soon as it passes `limit` bytes, and counting
/// the memory it holds in `lease` as it grows: the first piece as it came (a body that comes in
/// one piece is not copied), then the one buffer the pieces are joined into, by its capacity.
/// A piece that does not fit in the budget fails the read with [`OverBudget`].
pub async fn read_within<B>(
    mut body: B,
    limit: usize,
    lease: &mut Lease,
) -> Result<Bytes, ReadError>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let hint = body.size_hint();
    if hint.lower() > limit as u64 {
        return Err(ReadError::TooLarge(limit));
    }
    let over = |e: OverBudget| ReadError::Failed(Box::new(e));
    let mut first: Option<Bytes> = None;
    let mut joined: Option<BytesMut> = None;
    let mut total = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ReadError::Failed(e.into()))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if data.is_empty() {
            continue;
        }
        total = total.saturating_add(data.len());
        if total > limit {
            return Err(ReadError::TooLarge(limit));
        }
        if let Some(buf) = joined.as_mut() {
            let before = buf.capacity();
            if before - buf.len() < data.len() {
                // Doubling, so that many pieces cost linear copying; never past the limit.
                let want = total.max(before.saturating_mul(2)).min(limit);
                lease.grow(want.saturating_sub(before)).map_err(over)?;
                buf.reserve(want - buf.len());
                lease.grow_past(buf.capacity().saturating_sub(want));
            }
            buf.extend_from_slice(&data);
            continue;
        }
        match first.take() {
            None => {
                lease.grow(data.len() + PIECE_COST).map_err(over)?;
                first = Some(data);
            }
            Some(head) => {
                // A second piece: one buffer for all, as large as the body says it is.
                let declared = usize::try_from(hint.exact().unwrap_or(0)).unwrap_or(limit);
                let want = total.max(declared).min(limit);
                lease.grow(want).map_err(over)?;
                let mut buf = BytesMut::with_capacity(want);
                lease.grow_past(buf.capacity().saturating_sub(want));
                buf.extend_from_slice(&head);
                buf.extend_from_slice(&data);
                lease.shrink(head.len() + PIECE_COST);
                joined = Some(buf);
            }
        }
    }
    Ok(match (joined, first) {
        (Some(buf), _) => buf.freeze(),
        (None, Some(only)) => only,
        (None, None) => Bytes::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::StreamBody;

    fn chunked(chunks: &[&'static [u8]]) -> impl HttpBody<Data = Bytes, Error = BoxError> + Unpin {
        let frames: Vec<Result<Frame<Bytes>, BoxError>> = chunks
            .iter()
            .map(|c| Ok(Frame::data(Bytes::from_static(c))))
            .collect();
        StreamBody::new(futures_util::stream::iter(frames))
    }

    #[tokio::test]
    async fn chunked_bodies_are_capped_while_reading() {
        let ok = read_capped(chunked(&[b"ab", b"cd"]), 4).await.unwrap();
        assert_eq!(&ok[..], b"abcd");
        let err = read_capped(chunked(&[b"ab", b"cd", b"e"]), 4)
            .await
            .unwrap_err();
        assert!(matches!(err, ReadError::TooLarge(4)));
    }

    #[tokio::test]
    async fn a_declared_length_over_the_cap_is_refused_before_reading() {
        let body = Full::new(Bytes::from_static(b"hello"));
        assert!(matches!(
            read_capped(body, 4).await,
            Err(ReadError::TooLarge(4))
        ));
    }

    #[tokio::test]
    async fn the_budget_refuses_what_does_not_fit_and_takes_back_what_is_dropped() {
        let budget = Budget::new(250, Gauge::default());
        let mut a = budget.lease();
        let read = read_within(chunked(&[b"abc"]), 100, &mut a).await;
        assert_eq!(&read.unwrap()[..], b"abc");
        assert_eq!(
            budget.used(),
            3 + PIECE_COST as i64,
            "one piece, kept as it came"
        );
        let mut b = budget.lease();
        let Err(ReadError::Failed(e)) =
            read_within(chunked(&[&[b'x'; 90], &[b'y'; 90]]), 1000, &mut b).await
        else {
            panic!("expected the budget to refuse");
        };
        assert!(e.is::<OverBudget>());
        assert_eq!(
            budget.used(),
            3 + 90 + 2 * PIECE_COST as i64,
            "what b read before the refusal is still held"
        );
        drop(b);
        drop(a);
        assert_eq!(budget.used(), 0);
    }

    #[tokio::test]
    async fn a_body_in_tiny_pieces_is_charged_for_the_buffer_it_takes() {
        let budget = Budget::new(1 << 20, Gauge::default());
        let mut lease = budget.lease();
        let pieces: Vec<&'static [u8]> = vec![b"a"; 10_000];
        let read = read_within(chunked(&pieces), 1 << 20, &mut lease)
            .await
            .unwrap();
        assert_eq!(read.len(), 10_000);
        let used = budget.used();
        assert!(
            (10_000..=2 * 10_000 + 64).contains(&(used as usize)),
            "{used} bytes charged for a 10000-byte body in 10000 pieces"
        );
        // Within the limit whatever the pieces, and refused past it.
        let mut other = budget.lease();
        assert!(matches!(
            read_within(chunked(&pieces), 9_999, &mut other).await,
            Err(ReadError::TooLarge(9_999))
        ));
    }

    #[tokio::test]
    async fn too_large_captures_keep_every_byte_for_streaming() {
        let Captured::TooLarge { head, rest } =
            capture(chunked(&[b"ab", b"cd", b"ef"]), 3).await.unwrap()
        else {
            panic!("expected TooLarge");
        };
        let all = prepend(head, rest).collect().await.unwrap().to_bytes();
        assert_eq!(&all[..], b"abcdef");
    }
}
