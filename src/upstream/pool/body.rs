//! The body of an upstream response, which gives its connection back: an HTTP/1.1 connection
//! to the pool once the body has been read to the end (closed if it is dropped before), an
//! HTTP/2 stream's place once the body is gone.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;

use super::{Key, Pool, Stream};
use crate::body::Body;

/// An upstream response body; its connection returns to the pool once it has been read to the
/// end, and closes if it is dropped before. On HTTP/2, it holds its stream's place until then.
pub struct UpstreamBody {
    inner: Incoming,
    reuse: Option<Reuse>,
    _stream: Option<Stream>,
}

/// Where a connection goes back to: its pool, its entry, itself.
type Reuse = (Arc<Pool>, Key, SendRequest<Body>);

impl UpstreamBody {
    pub(super) fn new(
        inner: Incoming,
        pool: Arc<Pool>,
        key: Key,
        sender: SendRequest<Body>,
    ) -> Self {
        let mut body = UpstreamBody {
            inner,
            reuse: Some((pool, key, sender)),
            _stream: None,
        };
        // No body at all (204, 304, `Content-Length: 0`): nobody will poll it.
        if body.inner.is_end_stream() {
            body.give_back();
        }
        body
    }

    /// A body whose connection is not given back (a protocol switch's).
    pub(super) fn unpooled(inner: Incoming) -> Self {
        UpstreamBody {
            inner,
            reuse: None,
            _stream: None,
        }
    }

    /// An HTTP/2 stream's body: its connection stays in the pool meanwhile; its stream's place
    /// is given back with the body.
    pub(super) fn on_stream(inner: Incoming, stream: Stream) -> Self {
        UpstreamBody {
            inner,
            reuse: None,
            _stream: Some(stream),
        }
    }

    fn give_back(&mut self) {
        let Some((pool, authority, mut sender)) = self.reuse.take() else {
            return;
        };
        if sender.is_ready() {
            // The usual case: the connection took in the end of the response before we did.
            pool.give_back(authority, sender);
        } else if !sender.is_closed() {
            // Still sending a request body the upstream answered early, or not yet past the
            // response's end: pooled once ready, so no request ever queues behind another.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(async move {
                    if sender.ready().await.is_ok() {
                        pool.give_back(authority, sender);
                    }
                });
            }
        }
    }
}

impl HttpBody for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        let frame = ready!(Pin::new(&mut this.inner).poll_frame(cx));
        match &frame {
            // hyper's server stops polling a body once it reports its end, so the end is
            // caught after the last frame as well as at `None`.
            None => this.give_back(),
            Some(Ok(_)) if this.inner.is_end_stream() => this.give_back(),
            Some(Err(_)) => this.reuse = None,
            Some(Ok(_)) => {}
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
