//! Bodies: the one body type the gateway answers with, and capped reading.
//!
//! Only idempotent routes buffer, and only up to a limit counted while reading (so chunked bodies
//! without `Content-Length` are capped too). Everything else streams.

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use http_body::{Body as HttpBody, Frame};
use http_body_util::{BodyExt, BodyStream, Full, StreamBody};

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
