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
