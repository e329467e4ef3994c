//! The upstream side: a pool of HTTP/1.1 connections per worker ([`pool`]) under one cap per
//! upstream shared by every worker ([`limit`]), the rewriting of a client's request for the
//! upstream ([`rewrite`]), and failure classification (here).
//!
//! Failures are sorted by what they mean for idempotency: [`UpstreamError::NotSent`] (the
//! request certainly did not reach the upstream: no connection could be made, or hyper handed the
//! request back unwritten, so the key can be released) versus [`UpstreamError::Failed`] and
//! [`UpstreamError::Timeout`] (the request may have reached the upstream, so the outcome is
//! unknown).
//!
//! The pool is ours rather than hyper-util's legacy client: that one hashes its pool key with
//! SipHash several times a request and spawns a task per request to return the connection, a large
//! share of a pass-through request's cost (bench/README.md, "bench/callgrind"). Here each worker
//! thread has its own short list of idle connections per upstream, and a connection goes back when
//! its response body has been read to the end and it is ready for another request (under load,
//! always at once; a connection still sending a request body that was answered early goes back when
//! it is done). A body still streaming to a slow client keeps its connection; a body dropped
//! half-read takes its connection down with it. What hyper-util did that matters is kept: a request
//! that a reused connection hands back unwritten (the upstream closed it while it sat idle) is sent
//! again on another one, and idle connections are dropped after 60 s.

mod limit;
pub mod oneshot;
mod pool;
mod rewrite;
mod tls;

use std::time::Duration;

use crate::error::BoxError;

pub use limit::{ConnectionLimits, NoConnectionSlot};
pub use pool::{CloseDelimited, PoolTimeouts, UpstreamBody, UpstreamPool};
pub use rewrite::{prepare_request, ClientAddr};
pub use tls::{client_config, TlsSetupError, UpstreamTlsConnector};

/// How long establishing a TCP connection to the upstream may take at most.
pub const MAX_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether a body of `got` bytes is the whole body its head declares: one that ended before
/// the length its `Content-Length` says was cut short (an HTTP/2 stream reset with `NO_ERROR` or
/// `CANCEL` mid-body reads as its end), and must not be stored as the whole answer. Not for the
/// answer to a `HEAD`.
pub fn whole(head: &http::response::Parts, got: usize) -> Result<(), UpstreamError> {
    if head.status == http::StatusCode::NO_CONTENT || head.status == http::StatusCode::NOT_MODIFIED
    {
        return Ok(());
    }
    // `Content-Length: 40, 40` (or the header twice) is one length, as hyper reads it; lengths
    // that differ never got this far.
    let mut lengths = (head.headers.get_all(http::header::CONTENT_LENGTH).iter())
        .flat_map(|v| v.to_str().unwrap_or_default().split(','))
        .map(|v| v.trim().parse::<u64>().ok());
    let declared = match lengths.next().flatten() {
        Some(n) if lengths.all(|m| m == Some(n)) => Some(n),
        _ => None,
    };
    match declared {
        Some(n) if n != got as u64 => Err(UpstreamError::Failed(
            format!("the body ended after {got} of the {n} bytes its Content-Length declares")
                .into(),
        )),
        _ => Ok(()),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// The request certainly did not reach the upstream.
    #[error("upstream not reached: {0}")]
    NotSent(BoxError),
    /// The exchange failed after the connection was made: the request may have been executed.
    #[error("upstream exchange failed: {0}")]
    Failed(BoxError),
    /// No answer within the timeout (the head, or on idempotent routes the whole response): the
    /// request may have been executed.
    #[error("upstream did not answer within {0:?}")]
    Timeout(Duration),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(status: u16, lengths: &[&str]) -> http::response::Parts {
        let mut b = http::Response::builder().status(status);
        for l in lengths {
            b = b.header(http::header::CONTENT_LENGTH, *l);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn a_body_is_whole_when_it_has_the_length_its_head_declares() {
        assert!(whole(&head(201, &["40"]), 40).is_ok());
        assert!(whole(&head(201, &["40"]), 13).is_err());
        // One length written twice is that length.
        assert!(whole(&head(201, &["40, 40"]), 40).is_ok());
        assert!(whole(&head(201, &["40", "40"]), 13).is_err());
        // Nothing declared, nothing to check; no body for 204 and 304.
        assert!(whole(&head(201, &[]), 13).is_ok());
        assert!(whole(&head(304, &["40"]), 0).is_ok());
    }
}
