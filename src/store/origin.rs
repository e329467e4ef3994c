//! Where a record came from, in the client's own terms: the route (or consumer) and the key
//! value the client sent. The store key is a hash of these and the client's scope, so without
//! this nothing could tell an operator which payment a stuck record is; with it, the operator
//! API lists unknown outcomes by the value that matches the upstream's logs.
//!
//! Kept only while a record's outcome is open (pending, then unknown): a completed record drops
//! it, so the raw value is not kept for the whole ttl of every key (docs/security.md).

use std::sync::Arc;

use crate::fingerprint::Fingerprint;

/// What kind of front made a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OriginKind {
    /// A `[[routes]]` entry: `name` is the route's name.
    Route,
    /// A `[[consumers]]` entry: `name` is the consumer's name.
    Consumer,
}

impl OriginKind {
    pub fn as_str(self) -> &'static str {
        match self {
            OriginKind::Route => "route",
            OriginKind::Consumer => "consumer",
        }
    }
}

/// The route or consumer and the client's key value behind a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    pub kind: OriginKind,
    pub name: String,
    pub key: String,
}

impl Origin {
    pub fn new(kind: OriginKind, name: &str, key: String) -> Arc<Origin> {
        Arc::new(Origin {
            kind,
            name: name.to_owned(),
            key,
        })
    }
}

/// What a new pending record is made of besides its owner and times: how to tell a retry from
/// a reuse of its key, and where it came from (`None` when nobody will need to find it by
/// name: tests, records made before origins were kept).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub fingerprint: Fingerprint,
    pub origin: Option<Arc<Origin>>,
}

impl From<Fingerprint> for Claim {
    fn from(fingerprint: Fingerprint) -> Claim {
        Claim {
            fingerprint,
            origin: None,
        }
    }
}

/// A span a stored answer came from: the original execution a replay links to. Kept with the
/// record ([`super::StoredResponse::link`]) as a `traceparent` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceLink {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
}

impl TraceLink {
    /// As a W3C `traceparent` value (how a record keeps it).
    pub fn traceparent(&self) -> String {
        format!(
            "00-{:032x}-{:016x}-01",
            u128::from_be_bytes(self.trace_id),
            u64::from_be_bytes(self.span_id)
        )
    }

    /// The link in a `traceparent` value [`Self::traceparent`] wrote; `None` for anything else.
    pub fn parse(value: &[u8]) -> Option<TraceLink> {
        let text = std::str::from_utf8(value).ok()?;
        let mut parts = text.split('-');
        let (Some("00"), Some(trace), Some(span), Some(_flags), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return None;
        };
        let hex = |s: &str, len| s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit());
        if !hex(trace, 32) || !hex(span, 16) {
            return None;
        }
        let trace_id = u128::from_str_radix(trace, 16).ok()?.to_be_bytes();
        let span_id = u64::from_str_radix(span, 16).ok()?.to_be_bytes();
        Some(TraceLink { trace_id, span_id })
    }
}

#[cfg(test)]
mod tests {
    use super::TraceLink;

    #[test]
    fn a_link_reads_back_as_it_was_written() {
        let link = TraceLink {
            trace_id: [0xab; 16],
            span_id: [0x01, 2, 3, 4, 5, 6, 7, 0xff],
        };
        let text = link.traceparent();
        assert_eq!(text.len(), 55);
        assert_eq!(TraceLink::parse(text.as_bytes()), Some(link));
        let signed = format!("00-+{}", &text[4..]);
        for bad in [
            "123",
            "00-ab-cd-01",
            "01-",
            "00-zz",
            &format!("{text}-x"),
            &signed,
        ] {
            assert_eq!(TraceLink::parse(bad.as_bytes()), None, "{bad}");
        }
    }
}
