//! Phases `read_body` and `decode` on an idempotent route: the body buffered within `max_body`
//! and the memory budget, then, once its signature (over the bytes sent) has been checked, its
//! content decoded ([`super::coding`]) for the key and the fingerprint.

use std::sync::Arc;

use bytes::Bytes;
use http::HeaderMap;

use super::coding::{self, DecodeError};
use crate::body::{self, Body, Budget, Lease, OverBudget, ReadError};
use crate::conn::{BodyTimeout, ClientBody};
use crate::problem::Problem;

/// A request body on an idempotent route: still on the wire, or read.
pub(super) enum ReqBody {
    Unread(ClientBody),
    Read(Received),
}

/// A body read in full: the bytes as sent (what is forwarded and signed) with their share of
/// the memory budget, and their content when a `Content-Encoding` was undone, with its own
/// share (given back as soon as the fingerprint is made).
pub(super) struct Received {
    pub(super) raw: Bytes,
    pub(super) lease: Lease,
    pub(super) decoded: Option<(Bytes, Lease)>,
    /// Whether [`Received::decode`] ran.
    decoded_yet: bool,
}

impl Received {
    /// What the body says: decoded once [`Received::decode`] ran.
    pub(super) fn content(&self) -> &Bytes {
        self.decoded.as_ref().map_or(&self.raw, |(d, _)| d)
    }

    /// Phase `decode`: undoes the body's `Content-Encoding`, within `limit` and `budget`; once.
    pub(super) fn decode(
        &mut self,
        headers: &HeaderMap,
        limit: usize,
        budget: &Arc<Budget>,
    ) -> Result<(), Problem> {
        if std::mem::replace(&mut self.decoded_yet, true) {
            return Ok(());
        }
        let mut lease = budget.lease();
        let decoded =
            coding::decode(headers, &self.raw, limit, &mut lease).map_err(|e| match e {
                DecodeError::Unsupported(Some(name)) => unsupported(format!("the coding {name:?}")),
                DecodeError::Unsupported(None) => unsupported("this Content-Encoding".into()),
                DecodeError::TooMany => unsupported("more than two codings stacked".into()),
                DecodeError::Corrupt(what) => Problem::UndecodableBody { what },
                DecodeError::TooLarge => Problem::BodyTooLarge {
                    limit,
                    decoded: true,
                },
                DecodeError::OverBudget => over_budget(),
            })?;
        self.decoded = decoded.map(|d| (d, lease));
        Ok(())
    }
}

impl ReqBody {
    /// The bytes sent so far (nothing while unread).
    pub(super) fn raw(&self) -> &[u8] {
        match self {
            ReqBody::Unread(_) => &[],
            ReqBody::Read(r) => &r.raw,
        }
    }

    /// What the body says (nothing while unread), decoding it first if it is read.
    pub(super) fn content(
        &mut self,
        headers: &HeaderMap,
        limit: usize,
        budget: &Arc<Budget>,
    ) -> Result<&[u8], Problem> {
        match self {
            ReqBody::Unread(_) => Ok(&[]),
            ReqBody::Read(r) => {
                r.decode(headers, limit, budget)?;
                Ok(r.content())
            }
        }
    }

    /// The whole body as sent, reading it (up to `limit`, within `budget`) unless already read.
    pub(super) async fn read(
        self,
        limit: usize,
        budget: &Arc<Budget>,
    ) -> Result<Received, Problem> {
        let incoming = match self {
            ReqBody::Read(r) => return Ok(r),
            ReqBody::Unread(incoming) => incoming,
        };
        let mut lease = budget.lease();
        let read = body::read_within(incoming, limit, &mut lease).await;
        let raw = read.map_err(|e| match e {
            ReadError::TooLarge(limit) => Problem::BodyTooLarge {
                limit,
                decoded: false,
            },
            ReadError::Failed(e) if e.is::<BodyTimeout>() => Problem::BodyTimeout,
            ReadError::Failed(e) if e.is::<OverBudget>() => over_budget(),
            ReadError::Failed(_) => Problem::BadRequestBody,
        })?;
        Ok(Received {
            raw,
            lease,
            decoded: None,
            decoded_yet: false,
        })
    }

    /// For forwarding as is: streaming if unread.
    pub(super) fn into_body(self) -> Body {
        match self {
            ReqBody::Unread(incoming) => body::boxed(incoming),
            ReqBody::Read(r) => body::full(r.raw),
        }
    }
}

fn unsupported(what: String) -> Problem {
    Problem::UnsupportedEncoding {
        what,
        accepted: coding::DECODED,
    }
}

fn over_budget() -> Problem {
    Problem::Overloaded {
        what: "memory for request bodies",
    }
}
