//! Bodies: the one body type the gateway answers with, capped reading, and the memory budget
//! for buffered request bodies.
//!
//! Only idempotent routes buffer, and only up to a limit counted while reading (so chunked bodies
//! without `Content-Length` are capped too). Everything else streams. Every buffered request body
//! also draws on one [`Budget`] shared by all connections and streams (`server.max_buffered`):
//! a piece that does not fit fails the read ([`OverBudget`]) instead of taking memory, and what a
//! request holds is given back when its body is dropped ([`Lease`]).

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use http_body::{Body as HttpBody, Frame};
use http_body_util::{BodyExt, BodyStream, Full, StreamBody};
use prometheus_client::metrics::gauge::Gauge;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

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
pub async fn read_capped<B>(body: B, limit: usize) -> Result<Bytes, ReadError>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    if body.size_hint().lower() > limit as u64 {
        return Err(ReadError::TooLarge(limit));
    }
    match capture(body, limit).await? {
        Captured::Complete(bytes) => Ok(bytes),
        Captured::TooLarge { .. } => Err(ReadError::TooLarge(limit)),
    }
}

/// A body read up to a limit.
pub enum Captured<B> {
    /// The whole body, within the limit. Trailers, if any, are dropped.
    Complete(Bytes),
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
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ReadError::Failed(e.into()))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        total = total.saturating_add(data.len());
        head.push(data);
        if total > limit {
            return Ok(Captured::TooLarge { head, rest: body });
        }
    }
    Ok(Captured::Complete(concat(head, total)))
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
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.held > 0 {
            self.budget.used.dec_by(self.held);
        }
    }
}

/// A body whose data is counted against `lease` as it is read.
pub struct Budgeted<'a, B> {
    inner: B,
    lease: &'a mut Lease,
}

impl<'a, B> Budgeted<'a, B> {
    pub fn new(inner: B, lease: &'a mut Lease) -> Self {
        Budgeted { inner, lease }
    }
}

impl<B> HttpBody for Budgeted<'_, B>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let frame = ready!(Pin::new(&mut this.inner).poll_frame(cx));
        Poll::Ready(match frame {
            Some(Ok(frame)) => match frame.data_ref() {
                Some(data) => match this.lease.grow(data.len()) {
                    Ok(()) => Some(Ok(frame)),
                    Err(e) => Some(Err(Box::new(e))),
                },
                None => Some(Ok(frame)),
            },
            Some(Err(e)) => Some(Err(e.into())),
            None => None,
        })
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
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
        let budget = Budget::new(5, Gauge::default());
        let mut a = budget.lease();
        let read = read_capped(Budgeted::new(chunked(&[b"abc"]), &mut a), 100).await;
        assert_eq!(&read.unwrap()[..], b"abc");
        assert_eq!(budget.used(), 3);
        let mut b = budget.lease();
        let Err(ReadError::Failed(e)) =
            read_capped(Budgeted::new(chunked(&[b"de", b"fg"]), &mut b), 100).await
        else {
            panic!("expected the budget to refuse");
        };
        assert!(e.is::<OverBudget>());
        assert_eq!(
            budget.used(),
            5,
            "what b read before the refusal is still held"
        );
        drop(b);
        assert_eq!(budget.used(), 3);
        drop(a);
        assert_eq!(budget.used(), 0);
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
