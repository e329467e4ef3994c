//! Phase `read_body` on an idempotent route: the body buffered within `max_body` and the
//! memory budget, and its content decoded ([`super::coding`]) for the key and the fingerprint.

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

/// A body read in full: the bytes as sent (what is forwarded and signed), their content when a
/// `Content-Encoding` was undone, and their share of the memory budget.
pub(super) struct Received {
    pub(super) raw: Bytes,
    pub(super) decoded: Option<Bytes>,
    pub(super) lease: Lease,
}

impl ReqBody {
    /// The bytes sent so far (nothing while unread).
    pub(super) fn raw(&self) -> &[u8] {
        match self {
            ReqBody::Unread(_) => &[],
            ReqBody::Read(r) => &r.raw,
        }
    }

    /// What the body says, decoded (nothing while unread).
    pub(super) fn content(&self) -> &[u8] {
        match self {
            ReqBody::Unread(_) => &[],
            ReqBody::Read(r) => r.decoded.as_deref().unwrap_or(&r.raw),
        }
    }

    /// The whole body, reading it (up to `limit`, within `budget`) and decoding it unless
    /// already done.
    pub(super) async fn read(
        self,
        headers: &HeaderMap,
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
        let decoded = coding::decode(headers, &raw, limit, &mut lease).map_err(|e| match e {
            DecodeError::Unsupported(coding) => Problem::UnsupportedEncoding {
                coding,
                accepted: coding::DECODED,
            },
            DecodeError::Corrupt(what) => Problem::UndecodableBody { what },
            DecodeError::TooLarge => Problem::BodyTooLarge {
                limit,
                decoded: true,
            },
            DecodeError::OverBudget => over_budget(),
        })?;
        Ok(Received {
            raw,
            decoded,
            lease,
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

fn over_budget() -> Problem {
    Problem::Overloaded {
        what: "memory for request bodies",
    }
}
