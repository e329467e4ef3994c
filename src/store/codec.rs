//! The compact, versioned binary form of a [`Record`], as the Redis and disk stores keep every
//! record and the memory store a completed one.
//!
//! ```text
//! byte 0        version (1)
//! byte 1        state: 1 pending, 2 completed, 3 unknown
//! bytes 2..34   fingerprint
//! bytes 34..42  created_ms (u64, big endian)
//! pending:      42..58 owner token (u128)   58..66 lease_until_ms (u64)
//!               66 (optional): 1 when a waiter is waiting, set by the Redis store's `watch`
//!               so that the end of the pending state is published, else 0; ignored by
//!               `decode`. Present whenever an origin follows.
//!               67.. (optional): the origin
//! completed:    42..44 status (u16)  44..52 completed_ms  52 body_kept (0 or 1)
//!               53..55 header count (u16)
//!               then per header: name length (u16), name, value length (u32), value
//!               with trailers: trailer count (u16, never 0), then the trailers as the headers
//!               then the body: every remaining byte, raw (no base64, no length)
//!               status is the HTTP status, plus 1000 when trailers follow the headers
//!               (gRPC's `grpc-status`): a gateway from before trailers were stored reads
//!               that as a bad status and refuses the record as corrupt, rather than replay
//!               the trailers as part of the body. A record without trailers is laid out as
//!               it always was.
//! unknown:      42..50 since_ms  50 reason (1 timeout, 2 interrupted, 3 abandoned)
//!               51.. (optional): the origin, carried over from the pending record
//! origin:       kind (1 route, 2 consumer), name length (u16), name, key length (u16), key
//! link:         a completed record of a traced execution: its span's ids, as a `traceparent`
//!               value in a first `content-length` field (see `LINK_FIELD`)
//! ```
//! sealed:       with `store.encryption_keys_*` ([`super::seal`]), a completed record's part
//!               after byte 42 is `SEALED_ANSWER` (u16, where the status is) then the
//!               sealed completed part as above (status to body); an origin is kind 3 then
//!               the sealed origin. A gateway from before sealing refuses the first (a bad
//!               status: corrupt, never executed) and reads the second as no origin.
//! The origin ([`super::Origin`]) came after the first gateways that wrote this version:
//! they ignore the bytes after a pending or unknown record's fixed part, and a record they
//! wrote reads as one without an origin. An origin that does not parse reads as none: it is
//! for operators to find a record, never part of a decision.
//! The fixed offsets matter: the Redis scripts check the state byte and the owner token in place
//! (`string.byte(v, 2)`, `string.sub(v, 43, 58)`) and rewrite only the part after byte 42.

use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderName, HeaderValue, StatusCode};

use super::seal::{self, KeyId, Part, Sealer, Sealing};
use super::{
    Origin, OriginKind, OwnerToken, Record, RecordState, StoreError, StoredResponse, TraceLink,
    UnknownReason,
};
use crate::fingerprint::Fingerprint;
use crate::key::StoreKey;

pub const VERSION: u8 = 1;
pub const STATE_PENDING: u8 = 1;
pub const STATE_COMPLETED: u8 = 2;
pub const STATE_UNKNOWN: u8 = 3;
/// Length of the part every state shares: version, state, fingerprint, created_ms.
pub const HEADER_LEN: usize = 42;
/// Length of a pending record; the Redis scripts read a longer one as flagged by a waiter.
pub const PENDING_LEN: usize = HEADER_LEN + 16 + 8;
/// An origin read ([`decode_origin`]), and how it was found.
pub type Opened = (Option<Arc<Origin>>, Sealing);

/// Where a completed record's status would be: the answer is sealed (no status is 65535).
const SEALED_ANSWER: u16 = u16::MAX;
/// The origin kind of a sealed origin.
const SEALED_ORIGIN: u8 = 3;

/// How a record is written and read: sealed with these keys as the record under this store
/// key, or in the clear ([`Seal::PLAIN`]: no `store.encryption_keys_*`).
#[derive(Clone, Copy)]
pub struct Seal<'a>(Option<(&'a Sealer, &'a StoreKey)>);

impl<'a> Seal<'a> {
    pub const PLAIN: Seal<'static> = Seal(None);

    pub fn new(sealer: Option<&'a Sealer>, key: &'a StoreKey) -> Seal<'a> {
        Seal(sealer.map(|s| (s, key)))
    }

    /// Whether a record found `sealing` is written sealed: when the store seals, unless it
    /// was read in the clear (written again as it was read).
    pub fn seals(&self, sealing: &Sealing) -> bool {
        self.0.is_some() && *sealing != Sealing::Clear
    }

    /// What sealing adds to a part of a record found `sealing` (at most): its marker, the key
    /// id, nonce and tag; so that a buffer sized for the record never grows (a grown one the
    /// memory store would keep at twice the size).
    fn overhead(&self, sealing: &Sealing) -> usize {
        match self.seals(sealing) {
            true => 2 + seal::OVERHEAD,
            false => 0,
        }
    }

    /// Appends `plain` sealed to `out`: with the key the record was read with, if still
    /// listed, else the current one.
    fn seal(&self, sealing: &Sealing, part: Part, plain: &[u8], out: &mut BytesMut) {
        if let Some((sealer, key)) = self.0 {
            let with = match sealing {
                Sealing::With(id) => Some(id),
                _ => None,
            };
            sealer.seal(with, part, key, plain, out);
        }
    }

    /// Opens a sealed part: its plain bytes and the key that sealed it.
    fn open(&self, part: Part, sealed: &[u8]) -> Result<(Bytes, KeyId), StoreError> {
        let opened = match self.0 {
            Some((sealer, key)) => sealer.open(part, key, sealed),
            None => Err(seal::sealed_with(sealed).map_or_else(|e| e, seal::OpenError::NoKeys)),
        };
        match opened {
            Ok((plain, id)) => Ok((Bytes::from(plain), id)),
            Err(e) => Err(StoreError::Unreadable {
                key_id: e.key_id().map(str::to_string),
                why: e.to_string(),
                lease_until_ms: None,
            }),
        }
    }
}

/// Encodes a whole record, into a buffer of exactly its size (the memory store keeps these);
/// sealed as `seal` says, with the key it was read with if it is still listed.
pub fn encode(record: &Record, seal: Seal) -> Bytes {
    let origin = kept_origin(record);
    let sealed = seal.overhead(&record.sealing);
    let mut out = BytesMut::with_capacity(
        HEADER_LEN
            + state_len(&record.state)
            + sealed
            + origin.map_or(0, |o| 1 + origin_len(o) + sealed),
    );
    out.put_u8(VERSION);
    out.put_u8(state_byte(&record.state));
    out.put_slice(&record.fingerprint.0);
    out.put_u64(record.created_ms);
    put_state(&record.state, &record.sealing, seal, &mut out);
    if let Some(origin) = origin {
        if state_byte(&record.state) == STATE_PENDING {
            // The watched flag, clear: an origin always comes after it.
            out.put_u8(0);
        }
        put_sealed_origin(origin, &record.sealing, seal, &mut out);
    }
    out.freeze()
}

/// An origin, sealed if `seal` says so for a record found `sealing`.
fn put_sealed_origin(origin: &Origin, sealing: &Sealing, seal: Seal, out: &mut BytesMut) {
    if !seal.seals(sealing) {
        return put_origin(origin, out);
    }
    let mut plain = BytesMut::with_capacity(origin_len(origin));
    put_origin(origin, &mut plain);
    out.put_u8(SEALED_ORIGIN);
    seal.seal(sealing, Part::Origin, &plain, out);
}

/// The origin a record is stored with: only while its outcome is open, and only one whose
/// lengths fit their fields.
fn kept_origin(record: &Record) -> Option<&Origin> {
    let origin = record.origin.as_deref()?;
    let open = !matches!(record.state, RecordState::Completed(_));
    let fits = origin.name.len() <= u16::MAX as usize && origin.key.len() <= u16::MAX as usize;
    (open && fits).then_some(origin)
}

fn origin_len(origin: &Origin) -> usize {
    1 + 2 + origin.name.len() + 2 + origin.key.len()
}

fn put_origin(origin: &Origin, out: &mut BytesMut) {
    out.put_u8(match origin.kind {
        OriginKind::Route => 1,
        OriginKind::Consumer => 2,
    });
    out.put_u16(origin.name.len() as u16);
    out.put_slice(origin.name.as_bytes());
    out.put_u16(origin.key.len() as u16);
    out.put_slice(origin.key.as_bytes());
}

/// An origin in the form that follows a record's fixed part (the Postgres store keeps it in a
/// column of its own), sealed if `seal` says so; `None` when it does not fit.
pub fn encode_origin(origin: &Origin, seal: Seal) -> Option<Vec<u8>> {
    if origin.name.len() > u16::MAX as usize || origin.key.len() > u16::MAX as usize {
        return None;
    }
    let mut out = BytesMut::with_capacity(origin_len(origin));
    put_sealed_origin(origin, &Sealing::New, seal, &mut out);
    Some(out.to_vec())
}

/// The origin in `raw` (what [`encode_origin`] wrote), `None` for anything else, and the key
/// that sealed it; a sealed one that does not open is the error.
pub fn decode_origin(raw: &[u8], seal: Seal) -> Result<Opened, StoreError> {
    let raw = Bytes::copy_from_slice(raw);
    Reader { raw: &raw, pos: 0 }.sealed_origin(seal)
}

fn state_byte(state: &RecordState) -> u8 {
    match state {
        // Abandoned is how a pending record reads once its lease ran out: stored as pending.
        RecordState::Pending { .. } | RecordState::Abandoned { .. } => STATE_PENDING,
        RecordState::Completed(_) => STATE_COMPLETED,
        RecordState::Unknown { .. } => STATE_UNKNOWN,
    }
}

/// The state-specific part after byte 42 (what the scripts splice in), a new answer sealed
/// with the current key if `seal` says so.
pub fn encode_state(state: &RecordState, seal: Seal) -> Bytes {
    let mut out = BytesMut::with_capacity(state_len(state) + seal.overhead(&Sealing::New));
    put_state(state, &Sealing::New, seal, &mut out);
    out.freeze()
}

/// Added to a completed record's status when trailers follow its headers.
const WITH_TRAILERS: u16 = 1000;

/// A response has far fewer than 65536 headers (hyper caps them at 100); the cap only keeps the
/// count field honest.
fn encoded(fields: &[(HeaderName, HeaderValue)]) -> &[(HeaderName, HeaderValue)] {
    &fields[..fields.len().min(u16::MAX as usize)]
}

/// Bytes [`put_fields`] writes.
fn fields_len(fields: &[(HeaderName, HeaderValue)]) -> usize {
    2 + encoded(fields)
        .iter()
        .map(|(n, v)| 2 + n.as_str().len() + 4 + v.len())
        .sum::<usize>()
}

fn put_fields(fields: &[(HeaderName, HeaderValue)], out: &mut BytesMut) {
    let fields = encoded(fields);
    out.put_u16(fields.len() as u16);
    for (name, value) in fields {
        put_field(name.as_str(), value.as_bytes(), out);
    }
}

fn put_field(name: &str, value: &[u8], out: &mut BytesMut) {
    out.put_u16(name.len() as u16);
    out.put_slice(name.as_bytes());
    out.put_u32(value.len() as u32);
    out.put_slice(value);
}

/// How a completed record keeps the span that made it ([`StoredResponse::link`]): as a
/// `traceparent` value in a first `content-length` field. Every version of the gateway sets a
/// replay's `content-length` itself, replacing any stored one, so a gateway from before the
/// link replays such a record as it always did; and no stored `content-length` of an answer is
/// anything but digits (hyper refuses any other), so the field is never mistaken.
const LINK_FIELD: HeaderName = http::header::CONTENT_LENGTH;

/// The link a completed record is written with (`None`: no link, or no room for one more
/// field).
fn linked(r: &StoredResponse) -> Option<TraceLink> {
    r.link.filter(|_| r.headers.len() < u16::MAX as usize)
}

/// Bytes of a link's field value: a `traceparent` is always 55 characters.
const LINK_VALUE_LEN: usize = 55;

/// The headers as stored, less the link's field ([`LINK_FIELD`]), and the link.
fn unlinked(
    mut headers: Vec<(HeaderName, HeaderValue)>,
) -> (Vec<(HeaderName, HeaderValue)>, Option<TraceLink>) {
    // Only the form `linked` writes: a record reads back to the bytes it was written as (the
    // stores' compare-and-set compares them), whatever an operator's resolution held.
    let link = match headers.first() {
        Some((name, value)) if *name == LINK_FIELD => TraceLink::parse(value.as_bytes())
            .filter(|l| l.traceparent().as_bytes() == value.as_bytes()),
        _ => None,
    };
    if link.is_some() {
        headers.remove(0);
    }
    (headers, link)
}

/// Exactly what [`put_state`] writes.
fn state_len(state: &RecordState) -> usize {
    match state {
        RecordState::Pending { .. } | RecordState::Abandoned { .. } => 16 + 8,
        RecordState::Completed(r) => {
            2 + 8
                + 1
                + fields_len(&r.headers)
                + linked(r).map_or(0, |_| 2 + LINK_FIELD.as_str().len() + 4 + LINK_VALUE_LEN)
                + if r.trailers.is_empty() {
                    0
                } else {
                    fields_len(&r.trailers)
                }
                + r.body.len()
        }
        RecordState::Unknown { .. } => 8 + 1,
    }
}

fn put_state(state: &RecordState, sealing: &Sealing, seal: Seal, out: &mut BytesMut) {
    match state {
        RecordState::Pending {
            owner,
            lease_until_ms,
        }
        | RecordState::Abandoned {
            owner,
            lease_until_ms,
        } => {
            out.put_u128(owner.0);
            out.put_u64(*lease_until_ms);
        }
        RecordState::Completed(r) if seal.seals(sealing) => {
            let mut plain = BytesMut::with_capacity(state_len(state));
            put_answer(r, &mut plain);
            out.put_u16(SEALED_ANSWER);
            seal.seal(sealing, Part::Answer, &plain, out);
        }
        RecordState::Completed(r) => put_answer(r, out),
        RecordState::Unknown { since_ms, reason } => {
            out.put_u64(*since_ms);
            out.put_u8(match reason {
                UnknownReason::Timeout => 1,
                UnknownReason::Interrupted => 2,
                UnknownReason::Abandoned => 3,
            });
        }
    }
}

/// A completed record's part from its status to its body.
fn put_answer(r: &StoredResponse, out: &mut BytesMut) {
    let trailers = if r.trailers.is_empty() {
        0
    } else {
        WITH_TRAILERS
    };
    out.put_u16(r.status.as_u16() + trailers);
    out.put_u64(r.completed_ms);
    out.put_u8(u8::from(r.body_kept));
    match linked(r) {
        None => put_fields(&r.headers, out),
        // The link's field first, then the headers as they are (`linked` left room for one
        // more in the count).
        Some(link) => {
            out.put_u16(r.headers.len() as u16 + 1);
            put_field(LINK_FIELD.as_str(), link.traceparent().as_bytes(), out);
            for (name, value) in &r.headers {
                put_field(name.as_str(), value.as_bytes(), out);
            }
        }
    }
    if !r.trailers.is_empty() {
        put_fields(&r.trailers, out);
    }
    out.put_slice(&r.body);
}

/// Whether `raw` is a pending record of `owner`'s, read from the parts in the clear.
pub fn pending_of(raw: &[u8], owner: OwnerToken) -> bool {
    raw.get(1) == Some(&STATE_PENDING)
        && raw.get(HEADER_LEN..HEADER_LEN + 16) == Some(&owner_bytes(owner)[..])
}

/// The owner token as the scripts compare it (16 bytes, big endian).
pub fn owner_bytes(owner: OwnerToken) -> [u8; 16] {
    owner.0.to_be_bytes()
}

/// Decodes a record, opening what is sealed with `seal`'s keys; any malformed input is a
/// [`StoreError::Corrupt`], a sealed part that does not open [`StoreError::Unreadable`], never a
/// panic.
pub fn decode(raw: &Bytes, seal: Seal) -> Result<Record, StoreError> {
    let mut r = Reader { raw, pos: 0 };
    let version = r.u8()?;
    if version != VERSION {
        return Err(corrupt(format!("unsupported record version {version}")));
    }
    let state = r.u8()?;
    let mut fingerprint = [0u8; 32];
    fingerprint.copy_from_slice(r.take(32)?);
    let created_ms = r.u64()?;
    let (state, origin) = match state {
        STATE_PENDING => {
            let (owner, lease_until_ms) = (u128::from_be_bytes(r.array()?), r.u64()?);
            let state = RecordState::Pending {
                owner: OwnerToken(owner),
                lease_until_ms,
            };
            // The watched flag: the Redis store's business.
            let _ = r.u8();
            (
                state,
                r.sealed_origin(seal)
                    .map_err(|e| leased(e, Some(lease_until_ms)))?,
            )
        }
        STATE_COMPLETED => {
            if raw.get(r.pos..r.pos + 2) == Some(&SEALED_ANSWER.to_be_bytes()[..]) {
                let (plain, id) = seal.open(Part::Answer, &raw[r.pos + 2..])?;
                let answer = Reader {
                    raw: &plain,
                    pos: 0,
                }
                .answer()?;
                (
                    RecordState::Completed(Arc::new(answer)),
                    (None, Sealing::With(id)),
                )
            } else {
                (
                    RecordState::Completed(Arc::new(r.answer()?)),
                    (None, Sealing::Clear),
                )
            }
        }
        STATE_UNKNOWN => {
            let state = RecordState::Unknown {
                since_ms: r.u64()?,
                reason: match r.u8()? {
                    1 => UnknownReason::Timeout,
                    2 => UnknownReason::Interrupted,
                    3 => UnknownReason::Abandoned,
                    other => return Err(corrupt(format!("unknown reason {other}"))),
                },
            };
            (state, r.sealed_origin(seal)?)
        }
        other => return Err(corrupt(format!("unknown state {other}"))),
    };
    let (origin, sealing) = origin;
    Ok(Record {
        fingerprint: Fingerprint(fingerprint),
        created_ms,
        state,
        origin,
        sealing,
    })
}

/// An unreadable record's error, with the lease its clear part holds if it is pending.
pub fn leased(e: StoreError, lease: Option<u64>) -> StoreError {
    match e {
        StoreError::Unreadable { key_id, why, .. } => StoreError::Unreadable {
            key_id,
            why,
            lease_until_ms: lease,
        },
        other => other,
    }
}

fn corrupt(msg: impl Into<String>) -> StoreError {
    StoreError::Corrupt(msg.into())
}

struct Reader<'a> {
    raw: &'a Bytes,
    pos: usize,
}

impl<'a> Reader<'a> {
    /// A completed record's part from its status to its body (the body the rest of `raw`).
    fn answer(&mut self) -> Result<StoredResponse, StoreError> {
        let field = self.u16()?;
        let (status, with_trailers) = match field.checked_sub(WITH_TRAILERS) {
            Some(status) => (status, true),
            None => (field, false),
        };
        let status = StatusCode::from_u16(status).map_err(|_| corrupt("bad status"))?;
        let completed_ms = self.u64()?;
        let body_kept = match self.u8()? {
            0 => false,
            1 => true,
            other => return Err(corrupt(format!("bad body_kept {other}"))),
        };
        let (headers, link) = unlinked(self.fields()?);
        let trailers = if with_trailers {
            let trailers = self.fields()?;
            if trailers.is_empty() {
                // Never written so: each record has one encoding.
                return Err(corrupt("an empty trailer block"));
            }
            trailers
        } else {
            Vec::new()
        };
        Ok(StoredResponse {
            status,
            headers,
            trailers,
            body: self.raw.slice(self.pos..),
            body_kept,
            completed_ms,
            link,
        })
    }

    /// The origin in the rest of the record, opened if sealed, and the key that sealed it;
    /// none when there is none or a plain one does not parse (it is for operators, never part
    /// of a decision); an error when a sealed one does not open (a record this gateway cannot
    /// read all of is not read at all).
    fn sealed_origin(&mut self, seal: Seal) -> Result<Opened, StoreError> {
        if self.raw.get(self.pos) != Some(&SEALED_ORIGIN) {
            return Ok((self.origin(), Sealing::Clear));
        }
        let (plain, id) = seal.open(Part::Origin, &self.raw[self.pos + 1..])?;
        self.pos = self.raw.len();
        Ok((
            Reader {
                raw: &plain,
                pos: 0,
            }
            .origin(),
            Sealing::With(id),
        ))
    }

    /// The origin in the rest of the record, if one is there and parses.
    fn origin(&mut self) -> Option<Arc<Origin>> {
        let kind = match self.u8().ok()? {
            1 => OriginKind::Route,
            2 => OriginKind::Consumer,
            _ => return None,
        };
        let mut text = || -> Option<String> {
            let len = self.u16().ok()? as usize;
            String::from_utf8(self.take(len).ok()?.to_vec()).ok()
        };
        let name = text()?;
        let key = text()?;
        Some(Arc::new(Origin { kind, name, key }))
    }

    /// A count and that many (name, value) pairs, the values slices of the record, not copies.
    fn fields(&mut self) -> Result<Vec<(HeaderName, HeaderValue)>, StoreError> {
        let count = self.u16()? as usize;
        let mut fields = Vec::with_capacity(count.min(128));
        for _ in 0..count {
            let name_len = self.u16()? as usize;
            let name = HeaderName::from_bytes(self.take(name_len)?)
                .map_err(|_| corrupt("bad header name"))?;
            let value_len = self.u32()? as usize;
            let start = self.pos;
            self.take(value_len)?;
            let value = HeaderValue::from_maybe_shared(self.raw.slice(start..self.pos))
                .map_err(|_| corrupt("bad header value"))?;
            fields.push((name, value));
        }
        Ok(fields)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], StoreError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.raw.len())
            .ok_or_else(|| corrupt("record truncated"))?;
        let raw: &'a [u8] = self.raw;
        let s = &raw[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], StoreError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u8(&mut self) -> Result<u8, StoreError> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16, StoreError> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32, StoreError> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, StoreError> {
        Ok(u64::from_be_bytes(self.array()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn record(state: RecordState) -> Record {
        Record {
            fingerprint: Fingerprint([9; 32]),
            created_ms: 1_700_000_000_123,
            state,
            origin: None,
            sealing: Sealing::New,
        }
    }

    #[test]
    fn every_state_round_trips() {
        let states = [
            RecordState::Pending {
                owner: OwnerToken(0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10),
                lease_until_ms: 42,
            },
            RecordState::Completed(Arc::new(StoredResponse {
                trailers: vec![],
                status: StatusCode::CREATED,
                headers: vec![
                    (
                        HeaderName::from_static("set-cookie"),
                        HeaderValue::from_static("a=1"),
                    ),
                    (
                        HeaderName::from_static("set-cookie"),
                        HeaderValue::from_static("b=2"),
                    ),
                ],
                body: Bytes::from_static(b"\x00\xffraw body"),
                body_kept: true,
                completed_ms: 7,
                link: None,
            })),
            RecordState::Completed(Arc::new(StoredResponse {
                status: StatusCode::OK,
                headers: vec![(
                    HeaderName::from_static("content-type"),
                    HeaderValue::from_static("application/grpc"),
                )],
                trailers: vec![
                    (
                        HeaderName::from_static("grpc-status"),
                        HeaderValue::from_static("0"),
                    ),
                    (
                        HeaderName::from_static("grpc-message"),
                        HeaderValue::from_static(""),
                    ),
                ],
                body: Bytes::from_static(b"\x00\x00\x00\x00\x02\x08\x01"),
                body_kept: true,
                completed_ms: 9,
                link: None,
            })),
            RecordState::Unknown {
                since_ms: 5,
                reason: UnknownReason::Abandoned,
            },
        ];
        for s in states {
            let r = record(s);
            assert_eq!(decode(&encode(&r, Seal::PLAIN), Seal::PLAIN).unwrap(), r);
        }
    }

    /// Every record read is written again to the bytes it was read from (what the Redis and
    /// Postgres compare-and-set compare): read in the clear by a gateway with keys, read sealed
    /// with an older key after a rotation; and a new one is sealed with the current key.
    #[test]
    fn a_record_read_is_written_again_in_the_form_it_was_read() {
        let key = StoreKey::from_bytes([4; 32]);
        let old = Sealer::parse("old:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=").unwrap();
        let both = Sealer::parse(
            "new:HxwdHhsaGRgXFhUUExIREA8ODQwLCgkIBwYFBAMCAQA=\nold:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=",
        )
        .unwrap();
        let unknown = Record {
            origin: Some(origin()),
            ..record(RecordState::Unknown {
                since_ms: 5,
                reason: UnknownReason::Timeout,
            })
        };
        let completed = record(RecordState::Completed(Arc::new(StoredResponse {
            status: StatusCode::OK,
            headers: vec![],
            trailers: vec![],
            body: Bytes::from_static(b"secret"),
            body_kept: true,
            completed_ms: 7,
            link: None,
        })));
        let rotated = Seal::new(Some(&both), &key);
        for r in [unknown, completed] {
            for written in [
                encode(&r, Seal::PLAIN),
                encode(&r, Seal::new(Some(&old), &key)),
            ] {
                let read = decode(&written, rotated).unwrap();
                assert_eq!(encode(&read, rotated), written, "{read:?}");
            }
            let new = encode(&r, rotated);
            assert!(new.windows(4).any(|w| w == b"\x03new"), "{new:?}");
            assert!(!new.windows(6).any(|w| w == b"secret"));
        }
    }

    #[test]
    fn the_layout_the_scripts_rely_on() {
        let owner = OwnerToken(u128::MAX - 5);
        let enc = encode(
            &record(RecordState::Pending {
                owner,
                lease_until_ms: 1,
            }),
            Seal::PLAIN,
        );
        assert_eq!(enc[1], STATE_PENDING);
        assert_eq!(&enc[42..58], &owner_bytes(owner));
        assert_eq!(enc.len(), PENDING_LEN);
        assert_eq!(PENDING_LEN, 66, "the Redis scripts hard-code 66 and 67");
        // A waiter's flag after the pending record changes nothing for readers.
        let mut flagged = enc.to_vec();
        flagged.push(1);
        assert_eq!(
            decode(&Bytes::from(flagged), Seal::PLAIN).unwrap(),
            decode(&enc, Seal::PLAIN).unwrap()
        );
    }

    fn origin() -> Arc<Origin> {
        Origin::new(OriginKind::Consumer, "orders", "pay-é/1".to_owned())
    }

    #[test]
    fn an_open_record_keeps_its_origin_and_a_completed_one_drops_it() {
        let pending = Record {
            origin: Some(origin()),
            ..record(RecordState::Pending {
                owner: OwnerToken(3),
                lease_until_ms: 1,
            })
        };
        let enc = encode(&pending, Seal::PLAIN);
        // The fixed part first, as the scripts expect it; the flag clear; then the origin.
        assert_eq!(&enc[42..58], &owner_bytes(OwnerToken(3)));
        assert_eq!(enc[PENDING_LEN], 0);
        assert_eq!(decode(&enc, Seal::PLAIN).unwrap(), pending);
        let unknown = Record {
            state: RecordState::Unknown {
                since_ms: 5,
                reason: UnknownReason::Timeout,
            },
            ..pending.clone()
        };
        assert_eq!(
            decode(&encode(&unknown, Seal::PLAIN), Seal::PLAIN).unwrap(),
            unknown
        );
        let completed = Record {
            state: RecordState::Completed(Arc::new(StoredResponse {
                status: StatusCode::OK,
                headers: vec![],
                trailers: vec![],
                body: Bytes::from_static(b"ok"),
                body_kept: true,
                completed_ms: 7,
                link: None,
            })),
            ..pending.clone()
        };
        assert_eq!(
            decode(&encode(&completed, Seal::PLAIN), Seal::PLAIN)
                .unwrap()
                .origin,
            None
        );
        // What the Redis script writes when it marks a flagged pending record unknown: the
        // unknown state, then the pending record's origin as it was.
        let mut flagged = enc.to_vec();
        flagged[PENDING_LEN] = 1;
        assert_eq!(
            decode(&Bytes::from(flagged.clone()), Seal::PLAIN).unwrap(),
            pending
        );
        let mut spliced = encode(&unknown, Seal::PLAIN)[..HEADER_LEN + 9].to_vec();
        spliced.extend_from_slice(&flagged[PENDING_LEN + 1..]);
        assert_eq!(decode(&Bytes::from(spliced), Seal::PLAIN).unwrap(), unknown);
    }

    #[test]
    fn a_broken_origin_reads_as_none_never_as_a_corrupt_record() {
        let pending = record(RecordState::Pending {
            owner: OwnerToken(3),
            lease_until_ms: 1,
        });
        for tail in [
            &[0u8, 9][..],
            &[0, 1, 0, 200, b'x'],
            &[0, 1, 0, 1, 0xff, 0, 0],
        ] {
            let mut raw = encode(&pending, Seal::PLAIN).to_vec();
            raw.extend_from_slice(tail);
            assert_eq!(
                decode(&Bytes::from(raw), Seal::PLAIN).unwrap(),
                pending,
                "{tail:?}"
            );
        }
        let o = origin();
        assert_eq!(
            decode_origin(&encode_origin(&o, Seal::PLAIN).unwrap(), Seal::PLAIN),
            Ok((Some(o), Sealing::Clear))
        );
    }

    #[test]
    fn the_body_is_stored_raw() {
        let body = Bytes::from(vec![0xAB; 1000]);
        let enc = encode(
            &record(RecordState::Completed(Arc::new(StoredResponse {
                trailers: vec![],
                status: StatusCode::OK,
                headers: vec![],
                body: body.clone(),
                body_kept: true,
                completed_ms: 0,
                link: None,
            }))),
            Seal::PLAIN,
        );
        assert_eq!(enc.len(), HEADER_LEN + 13 + 1000);
        assert!(enc.ends_with(&body));
    }

    #[test]
    fn a_record_without_trailers_is_laid_out_as_before_them() {
        // Written by a gateway from before trailers were stored: flags byte 1, then headers, then
        // the body. It must still read.
        let mut old = vec![VERSION, STATE_COMPLETED];
        old.extend_from_slice(&[9; 32]);
        old.extend_from_slice(&1_700_000_000_123u64.to_be_bytes());
        old.extend_from_slice(&201u16.to_be_bytes());
        old.extend_from_slice(&7u64.to_be_bytes());
        old.push(1);
        old.extend_from_slice(&1u16.to_be_bytes());
        old.extend_from_slice(&1u16.to_be_bytes());
        old.push(b'x');
        old.extend_from_slice(&1u32.to_be_bytes());
        old.push(b'y');
        old.extend_from_slice(b"body");
        let old = Bytes::from(old);
        let record = decode(&old, Seal::PLAIN).unwrap();
        let RecordState::Completed(r) = &record.state else {
            panic!("not completed: {record:?}");
        };
        assert_eq!(r.status, StatusCode::CREATED);
        assert_eq!(r.headers.len(), 1);
        assert!(r.trailers.is_empty());
        assert_eq!(r.body, "body");
        assert_eq!(
            encode(&record, Seal::PLAIN),
            old,
            "and is written the same way again"
        );
        // A body_kept no gateway writes is refused, not guessed at.
        let mut flagged = old.to_vec();
        flagged[52] = 3;
        assert!(matches!(
            decode(&Bytes::from(flagged), Seal::PLAIN),
            Err(StoreError::Corrupt(_))
        ));
    }

    #[test]
    fn a_record_with_trailers_is_one_a_reader_from_before_them_refuses() {
        let record = record(RecordState::Completed(Arc::new(StoredResponse {
            status: StatusCode::OK,
            headers: vec![],
            trailers: vec![(
                HeaderName::from_static("grpc-status"),
                HeaderValue::from_static("0"),
            )],
            body: Bytes::from_static(b"msg"),
            body_kept: true,
            completed_ms: 1,
            link: None,
        })));
        let enc = encode(&record, Seal::PLAIN);
        // What the older decoder did first with a completed record: its status.
        let status = u16::from_be_bytes([enc[42], enc[43]]);
        assert_eq!(status, 1200);
        assert!(
            StatusCode::from_u16(status).is_err(),
            "older readers refuse it"
        );
        assert_eq!(decode(&enc, Seal::PLAIN).unwrap(), record);
    }

    #[test]
    fn a_link_rides_where_a_reader_from_before_it_drops_it() {
        let link = TraceLink {
            trace_id: [0x11; 16],
            span_id: [0x22; 8],
        };
        let response = StoredResponse {
            status: StatusCode::CREATED,
            headers: vec![(
                HeaderName::from_static("content-length"),
                HeaderValue::from_static("4"),
            )],
            trailers: vec![],
            body: Bytes::from_static(b"body"),
            body_kept: true,
            completed_ms: 1,
            link: Some(link),
        };
        let linked = record(RecordState::Completed(Arc::new(response.clone())));
        let enc = encode(&linked, Seal::PLAIN);
        assert_eq!(
            enc.len(),
            encode(
                &record(RecordState::Completed(Arc::new(StoredResponse {
                    link: None,
                    ..response.clone()
                }))),
                Seal::PLAIN
            )
            .len()
                + 2
                + 14
                + 4
                + 55
        );
        assert_eq!(decode(&enc, Seal::PLAIN).unwrap(), linked);
        // An older reader: every field a header, then the replay's own content-length set.
        let mut r = Reader {
            raw: &enc,
            pos: 55 - 2,
        };
        let fields = r.fields().unwrap();
        assert_eq!(fields.len(), 2);
        let mut replayed = http::HeaderMap::new();
        for (name, value) in fields {
            replayed.append(name, value);
        }
        replayed.insert(http::header::CONTENT_LENGTH, HeaderValue::from(4));
        assert_eq!(replayed.len(), 1, "{replayed:?}");
        assert_eq!(replayed[http::header::CONTENT_LENGTH], "4");
        // A first field in another spelling is a header, and reads back to the same bytes.
        let upper = format!("00-{}-{}-01", "AB".repeat(16), "CD".repeat(8));
        assert!(
            TraceLink::parse(upper.as_bytes()).is_some(),
            "a traceparent"
        );
        let odd = record(RecordState::Completed(Arc::new(StoredResponse {
            headers: vec![(
                http::header::CONTENT_LENGTH,
                HeaderValue::from_str(&upper).unwrap(),
            )],
            link: None,
            ..response
        })));
        let enc = encode(&odd, Seal::PLAIN);
        assert_eq!(decode(&enc, Seal::PLAIN).unwrap(), odd);
        assert_eq!(
            encode(&decode(&enc, Seal::PLAIN).unwrap(), Seal::PLAIN),
            enc
        );
    }

    #[test]
    fn other_versions_are_refused() {
        let mut enc = encode(
            &record(RecordState::Unknown {
                since_ms: 0,
                reason: UnknownReason::Timeout,
            }),
            Seal::PLAIN,
        )
        .to_vec();
        enc[0] = 2;
        assert!(matches!(
            decode(&Bytes::from(enc), Seal::PLAIN),
            Err(StoreError::Corrupt(_))
        ));
    }

    proptest! {
        #[test]
        fn any_bytes_decode_without_panic(raw in prop::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode(&Bytes::from(raw), Seal::PLAIN);
        }

        #[test]
        fn truncations_are_errors_not_panics(cut in 0usize..66) {
            let enc = encode(&record(RecordState::Pending { owner: OwnerToken(1), lease_until_ms: 2 }), Seal::PLAIN);
            prop_assert!(decode(&enc.slice(..cut), Seal::PLAIN).is_err());
        }
    }
}
