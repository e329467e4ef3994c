//! Operator commands: list the unknown outcomes, look at one key's record, release or resolve
//! it (`idemgate keys list|get|release|resolve`, and the operator API's `/keys`).
//!
//! Keys are stored hashed, so the operator names them the way a client sent them: route name,
//! key and (if the route scopes keys per client) the client header's value. Deleting is for
//! after an unknown outcome, once the operator has checked the upstream's own records: the next
//! retry with that key then executes.

use std::fmt::Write;
use std::time::{Duration, UNIX_EPOCH};

mod scope;

use crate::config::{Config, StoreConfig};
use crate::key::{combine, parse_key_value, ClientScope, KeyPart, KeySource, StoreKey};
use crate::store::{self, now_ms, OriginKind, Record, RecordState, Scanned, Store, StoreError};

/// How long a command waits for the store to answer its first command.
const CONNECT_WAIT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    #[error("no route or consumer named {0:?} in the config (names: {1})")]
    NoRoute(String, String),
    #[error("invalid key: {0}")]
    BadKey(crate::key::KeyError),
    #[error("this route's key has {0} part(s), {1}: give one --key per part, in that order")]
    Parts(usize, String),
    #[error("backend = \"memory\" keeps records inside the running gateway process; `idemgate keys` needs a store it can open (backend = \"disk\", with the gateway stopped, or \"redis\")")]
    MemoryStore,
    #[error("{0}")]
    Store(String),
    #[error("{0}")]
    Client(String),
}

/// Who a key's client is, as an operator names it: nothing (the anonymous scope), a client
/// header's value, or a JWT client's claims.
#[derive(Debug, Default, Clone)]
pub struct ClientName {
    /// The client header's value, as the client sent it ("Bearer ...", an API key).
    pub value: Option<String>,
    /// Which of the route's `client_header` names it was sent in; the first by default.
    pub header: Option<String>,
    /// For a `client_jwt` route: the token's issuer (by default the only one configured) and
    /// its scope claims' values, `name=value`, for every claim the route names.
    pub issuer: Option<String>,
    pub claims: Vec<(String, String)>,
}

/// The stored key for (route, key parts, client), as the gateway derives it. A route keyed by
/// one header takes one part, its value as sent; a route keyed by several headers or body fields
/// takes one part per header and field, in the order the route lists them (headers first). A
/// consumer's name works as well as a route's (its messages have no client).
pub fn locate(
    config: &Config,
    route: &str,
    parts: &[String],
    client: &ClientName,
) -> Result<StoreKey, OperatorError> {
    let parts: Vec<KeyPart> = parts.iter().cloned().map(KeyPart::Text).collect();
    located(config, route, &parts, client).map(|(key, _)| key)
}

/// [`locate`], and which scope it hashed, said for the operator (`idemgate keys id`).
pub fn located(
    config: &Config,
    route: &str,
    parts: &[KeyPart],
    client: &ClientName,
) -> Result<(StoreKey, String), OperatorError> {
    let (source, policy) = match config.routes.iter().find(|r| r.name == route) {
        // A signed route keeps its sender's deliveries in one scope, whatever client header
        // they carry (as the gateway does).
        Some(r) if r.signature.is_some() && r.policy.client_jwt.is_none() => {
            let scope = match r.policy.client_headers.is_empty() {
                true => ClientScope::shared(),
                false => ClientScope::anonymous(),
            };
            let key = route_key(&r.key, parts)?;
            let said = "the one scope of a signed route's deliveries".to_string();
            return Ok((StoreKey::new(&scope, route, &key), said));
        }
        Some(r) => (&r.key, Some(&r.policy)),
        None => match config.consumers.iter().find(|c| c.name == route) {
            Some(c) => (&c.key, None),
            None => {
                let names: Vec<&str> = (config.routes.iter().map(|r| r.name.as_str()))
                    .chain(config.consumers.iter().map(|c| c.name.as_str()))
                    .collect();
                return Err(OperatorError::NoRoute(route.to_string(), names.join(", ")));
            }
        },
    };
    let key = route_key(source, parts)?;
    let (scope, said) = match policy {
        None => (
            ClientScope::shared(),
            "the one scope of a consumer's messages".to_string(),
        ),
        Some(policy) => scope::of(policy, client)?,
    };
    Ok((StoreKey::new(&scope, route, &key), said))
}

/// The key the operator's `parts` make for a route or consumer keyed by `source`.
fn route_key(source: &KeySource, parts: &[KeyPart]) -> Result<String, OperatorError> {
    let expected = source.headers.len() + source.pointers.len();
    match parts {
        [KeyPart::Text(one)] if source.is_single_header() => {
            parse_key_value(one.as_bytes()).map_err(OperatorError::BadKey)
        }
        [_] if source.is_single_header() => {
            Err(OperatorError::BadKey(crate::key::KeyError::Malformed))
        }
        parts if !source.is_single_header() && parts.len() == expected => Ok(combine(parts)),
        _ => Err(OperatorError::Parts(expected, source.describe())),
    }
}

/// Opens the configured shared store and waits until it answers.
pub async fn open_store(config: &Config) -> Result<std::sync::Arc<dyn Store>, OperatorError> {
    let sealer = crate::store::seal::Sealer::configured(config.store_keys.as_ref())
        .map_err(|e| OperatorError::Store(format!("store.encryption_keys_*: {e}")))?;
    let store = match &config.store {
        StoreConfig::Memory { .. } => return Err(OperatorError::MemoryStore),
        // The file is the running gateway's while it runs: fjall lets one process at a time open
        // it, and a second writer could not keep the gateway's view of its keys true.
        StoreConfig::Disk(_) => store::open(&config.store, sealer).map_err(|e| {
            OperatorError::Store(format!(
                "{e}\nThe disk store is opened by one process at a time: stop the gateway, run `idemgate keys` again, then start the gateway."
            ))
        })?,
        StoreConfig::Redis(_) | StoreConfig::Postgres(_) => {
            store::open(&config.store, sealer).map_err(|e| OperatorError::Store(e.to_string()))?
        }
    };
    let deadline = tokio::time::Instant::now() + CONNECT_WAIT;
    loop {
        match store.ping().await {
            Ok(()) => return Ok(store),
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(OperatorError::Store(format!("cannot reach the store: {e}")))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// A record as an operator reads it.
pub fn describe(key: &StoreKey, route: &str, record: &Record) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "key          {key}");
    let _ = writeln!(out, "route        {route}");
    if let Some(origin) = record.origin.as_deref() {
        let _ = writeln!(out, "client key   {}", origin.key);
    }
    let now = now_ms();
    match &record.state {
        RecordState::Pending { lease_until_ms, .. } => {
            let _ = writeln!(
                out,
                "state        pending (in flight; lease valid for {} more)",
                human_ms(lease_until_ms.saturating_sub(now))
            );
        }
        RecordState::Abandoned { lease_until_ms, .. } => {
            let _ = writeln!(
                out,
                "state        pending, lease expired {} ago: its gateway stopped mid-flight; outcome unknown",
                human_ms(now.saturating_sub(*lease_until_ms))
            );
        }
        RecordState::Completed(_) => {
            let _ = writeln!(out, "state        completed");
        }
        RecordState::Unknown { since_ms, reason } => {
            let _ = writeln!(
                out,
                "state        unknown ({}) since {}",
                reason.as_str(),
                timestamp(*since_ms)
            );
        }
    }
    let _ = writeln!(out, "fingerprint  {}", record.fingerprint);
    let _ = writeln!(out, "created      {}", timestamp(record.created_ms));
    if let RecordState::Completed(r) = &record.state {
        let _ = writeln!(out, "completed    {}", timestamp(r.completed_ms));
        let _ = writeln!(out, "status       {}", r.status.as_u16());
        let _ = writeln!(out, "headers      {}", r.headers.len());
        if r.body_kept {
            let _ = writeln!(out, "body         {} bytes", r.body.len());
        } else {
            let _ = writeln!(
                out,
                "body         not kept (larger than max_stored_response)"
            );
        }
    }
    out
}

/// The last instant RFC 3339 can write (9999-12-31T23:59:59.999Z), in ms since the epoch.
const LAST_RFC3339_MS: u64 = 253_402_300_799_999;

/// A record's time as RFC 3339. A corrupt record's time past year 9999 is written as the last
/// one there is: humantime's formatting fails past it, and `to_string` would panic on that.
pub fn timestamp(ms: u64) -> String {
    let ms = ms.min(LAST_RFC3339_MS);
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

fn human_ms(ms: u64) -> String {
    humantime::format_duration(Duration::from_millis(ms / 1000 * 1000)).to_string()
}

/// How long an operator's change holds a record while it replaces it (it never waits).
const OPERATOR_LEASE: Duration = Duration::from_secs(30);

/// What an operator's change to a record came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    Done,
    /// No record under this key (never used, expired or released).
    NotFound,
    /// A pending record whose lease still runs: its request may still be executing.
    Live,
    /// A completed record: its request ran and retries replay its answer. Releasing or
    /// overwriting it needs `force` (a wrong id must not re-enable a payment that completed).
    Completed,
    /// The record changed between the read and the change: read it again.
    Changed,
    /// The record is sealed and does not open with the gateway's keys: whether its request
    /// still runs cannot be told. Releasing it needs `force`; it cannot be resolved.
    Unreadable,
}

/// Why `record` may be changed only with `force`: a pending record whose owner's lease still
/// runs, or a completed one.
fn guarded(record: &Record) -> Option<Change> {
    match record.state {
        RecordState::Pending { .. } => Some(Change::Live),
        RecordState::Completed(_) => Some(Change::Completed),
        RecordState::Abandoned { .. } | RecordState::Unknown { .. } => None,
    }
}

/// Replaces the record the operator saw, and nothing else: a compare and set through the store
/// contract (`take_over` of exactly that record, then `then` as its new owner), so that an owner
/// completing meanwhile is never overwritten. A live pending record or a completed one only
/// with `force`. `ttl` bounds the replacement if `then` fails midway: it then reads as
/// abandoned, never as free; a take-over whose own answer is lost leaves the record as it was.
/// `seen`: the record the decision was made on, when the caller read it itself (a
/// reconciliation decides on a lookup made after its read: a record settled meanwhile must not
/// be replaced by that answer); else the record as it is now.
async fn replace<F, Fut>(
    store: &dyn Store,
    (key, seen): (&StoreKey, Option<&Record>),
    force: bool,
    ttl: Duration,
    then: F,
) -> Result<Change, StoreError>
where
    F: FnOnce(store::OwnerToken) -> Fut,
    Fut: std::future::Future<Output = Result<(), StoreError>>,
{
    let record = match seen {
        Some(record) => record.clone(),
        None => match store.get(key).await? {
            Some(record) => record,
            None => return Ok(Change::NotFound),
        },
    };
    if let (Some(refusal), false) = (guarded(&record), force) {
        return Ok(refusal);
    }
    // The origin stays with the record, so that it is still listed if `then` fails midway.
    let claim = store::Claim {
        fingerprint: record.fingerprint,
        origin: record.origin.clone(),
    };
    match store
        .take_over(key, &record, &claim, OPERATOR_LEASE, ttl)
        .await?
    {
        None => Ok(Change::Changed),
        Some(owner) => then(owner).await.map(|()| Change::Done),
    }
}

/// Releases a record: the operator says its request did not happen, so the next retry executes.
/// `seen`: only if the record is still exactly this one (see [`replace`]).
pub async fn release(
    store: &dyn Store,
    (key, seen): (&StoreKey, Option<&Record>),
    force: bool,
    ttl: Duration,
) -> Result<Change, StoreError> {
    let released = replace(store, (key, seen), force, ttl, |owner| {
        store.release(key, owner)
    })
    .await;
    match released {
        // Nothing of it can be read, so nothing compared: deleted whatever it holds, and only
        // when the operator says so.
        // Pending, its lease running: its owner may still be executing, force or not. The lease
        // is another clock's (the owner's, the database's): running until `max_clock_skew` past.
        Err(StoreError::Unreadable {
            lease_until_ms: Some(lease),
            ..
        }) if lease_live(lease, now_ms(), store.max_clock_skew()) => Ok(Change::Live),
        Err(StoreError::Unreadable { .. }) if force => match store.delete(key).await? {
            true => Ok(Change::Done),
            false => Ok(Change::NotFound),
        },
        Err(StoreError::Unreadable { .. }) => Ok(Change::Unreadable),
        other => other,
    }
}

/// Whether a lease ending at `lease` (another clock's) may still run at `now` (this one's): until
/// `skew` past it, as a store's read judges it ([`Record::checked_lease_skewed_at`]).
fn lease_live(lease: u64, now: u64, skew: Duration) -> bool {
    lease.saturating_add(store::millis(skew)) >= now
}

/// Resolves a record as completed with `response`: retries replay exactly that, kept for `ttl`.
pub async fn resolve(
    store: &dyn Store,
    (key, seen): (&StoreKey, Option<&Record>),
    response: store::StoredResponse,
    force: bool,
    ttl: Duration,
) -> Result<Change, StoreError> {
    let resolved = replace(store, (key, seen), force, ttl, |owner| {
        store.complete(key, owner, response, ttl)
    })
    .await;
    match resolved {
        Err(StoreError::Unreadable { .. }) => Ok(Change::Unreadable),
        other => other,
    }
}

/// The most records a listing page holds.
pub const MAX_LIST: usize = 1000;
/// Store pages one listing page reads at most ([`store::SCAN_BUDGET`] records each) before it
/// answers with what it found and a cursor: a large store is listed over several pages, each
/// of bounded cost.
const LIST_ROUNDS: usize = 8;

/// Which unknown outcomes a listing wants.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    /// Only this route's (`Route`) or consumer's (`Consumer`).
    pub from: Option<(OriginKind, String)>,
}

impl Filter {
    fn admits(&self, found: &Scanned) -> bool {
        let Some((kind, name)) = &self.from else {
            return true;
        };
        found
            .record
            .origin
            .as_deref()
            .is_some_and(|o| o.kind == *kind && o.name == *name)
    }
}

/// One page of unknown outcomes (marked unknown, or abandoned mid-flight): up to `limit`
/// (at most [`MAX_LIST`]), from `cursor` (a previous page's `next`). A short page with a
/// cursor means the page's read budget ran out first: go on with the cursor.
pub async fn list_unknown(
    store: &dyn Store,
    filter: &Filter,
    mut cursor: Option<String>,
    limit: usize,
) -> Result<(Vec<Scanned>, Option<String>), StoreError> {
    let limit = limit.clamp(1, MAX_LIST);
    let mut found = Vec::new();
    for _ in 0..LIST_ROUNDS {
        let page = store
            .scan_unknown(cursor.as_deref(), limit.saturating_sub(found.len()))
            .await?;
        found.extend(page.records.into_iter().filter(|s| filter.admits(s)));
        cursor = page.cursor;
        if found.len() >= limit || cursor.is_none() {
            break;
        }
    }
    Ok((found, cursor))
}

/// A listed record as the operator API shows it (JSON): [`view`] and its expiry.
pub fn listed(found: &Scanned) -> serde_json::Value {
    let mut out = view(&found.key, &found.record);
    if let (Some(out), Some(ms)) = (out.as_object_mut(), found.expires_ms) {
        out.insert("expires".into(), timestamp(ms).into());
    }
    out
}

/// A record as the operator API shows it (JSON).
fn view(key: &StoreKey, record: &Record) -> serde_json::Value {
    use serde_json::json;
    let mut out = json!({
        "id": key.hex(),
        "fingerprint": record.fingerprint.to_string(),
        "created": timestamp(record.created_ms),
    });
    if let (Some(out), Some(origin)) = (out.as_object_mut(), record.origin.as_deref()) {
        out.insert(origin.kind.as_str().into(), origin.name.clone().into());
        out.insert("key".into(), origin.key.clone().into());
    }
    let fields = match &record.state {
        RecordState::Pending { lease_until_ms, .. } => {
            json!({"state": "pending", "lease_until": timestamp(*lease_until_ms)})
        }
        RecordState::Abandoned { lease_until_ms, .. } => json!({
            "state": "unknown",
            "reason": "abandoned",
            "lease_until": timestamp(*lease_until_ms),
        }),
        RecordState::Unknown { since_ms, reason } => json!({
            "state": "unknown",
            "reason": reason.as_str(),
            "since": timestamp(*since_ms),
        }),
        RecordState::Completed(r) => json!({
            "state": "completed",
            "completed": timestamp(r.completed_ms),
            "status": r.status.as_u16(),
            "headers": r.headers.iter()
                .map(|(n, v)| [n.as_str().to_string(), String::from_utf8_lossy(v.as_bytes()).into_owned()])
                .collect::<Vec<_>>(),
            "body_bytes": r.body.len(),
            "body_kept": r.body_kept,
        }),
    };
    if let (Some(out), serde_json::Value::Object(fields)) = (out.as_object_mut(), fields) {
        out.extend(fields);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::store::memory::MemoryStore;

    /// A lease another clock wrote runs until `max_clock_skew` past it, as the stores read it:
    /// never released as run out before a store would read it as abandoned.
    #[test]
    fn a_lease_runs_until_max_clock_skew_past_it() {
        let skew = Duration::from_millis(500);
        assert!(lease_live(1_000, 1_500, skew));
        assert!(!lease_live(1_000, 1_501, skew));
        assert!(lease_live(1_000, 1_000, Duration::ZERO));
        assert!(lease_live(u64::MAX, u64::MAX, Duration::MAX));
        // The same boundary as a read's.
        let record = |lease_until_ms| Record {
            fingerprint: crate::fingerprint::Fingerprint([1; 32]),
            created_ms: 0,
            state: RecordState::Pending {
                owner: store::OwnerToken(1),
                lease_until_ms,
            },
            origin: None,
            sealing: store::seal::Sealing::New,
        };
        for now in [1_499, 1_500, 1_501, 1_502] {
            let read = record(1_000).checked_lease_skewed_at(now, skew);
            assert_eq!(lease_live(1_000, now, skew), !read.is_unknown(), "at {now}");
        }
    }
    use crate::store::{Reservation, StoredResponse, UnknownReason};

    fn answer() -> StoredResponse {
        StoredResponse {
            status: http::StatusCode::CREATED,
            headers: vec![],
            trailers: vec![],
            body: bytes::Bytes::from_static(b"ok"),
            body_kept: true,
            completed_ms: 1,
            link: None,
        }
    }

    #[test]
    fn a_time_past_year_9999_is_written_not_panicked_on() {
        assert_eq!(timestamp(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(timestamp(u64::MAX), "9999-12-31T23:59:59.999Z");
        assert_eq!(timestamp(LAST_RFC3339_MS + 1), "9999-12-31T23:59:59.999Z");
    }

    /// A record the keys no longer open: never resolved; released only when forced, and never
    /// while it is pending with its lease running (its owner may still be executing).
    #[tokio::test]
    async fn an_unreadable_record_is_released_only_when_forced_and_not_live() {
        use crate::store::seal::Sealer;
        let k1 = "k1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
        let sealer = std::sync::Arc::new(Sealer::parse(k1).unwrap());
        let store = MemoryStore::sealed(100, 1 << 20, Some(std::sync::Arc::clone(&sealer)));
        let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(60));
        let origin = store::Origin::new(OriginKind::Route, "payments", "k".into());
        let claim = store::Claim {
            fingerprint: Fingerprint([1; 32]),
            origin: Some(origin),
        };
        let (live, done) = (StoreKey::from_bytes([5; 32]), StoreKey::from_bytes([6; 32]));
        store.reserve(&live, &claim, lease, ttl).await.unwrap();
        let Reservation::Owner(t) = store.reserve(&done, &claim, lease, ttl).await.unwrap() else {
            panic!("a new key");
        };
        store.complete(&done, t, answer(), ttl).await.unwrap();
        sealer
            .reload("k2:HxwdHhsaGRgXFhUUExIREA8ODQwLCgkIBwYFBAMCAQA=")
            .unwrap();
        for key in [&live, &done] {
            assert!(matches!(
                store.get(key).await,
                Err(StoreError::Unreadable { .. })
            ));
            let resolved = resolve(&store, (key, None), answer(), true, ttl).await;
            assert_eq!(resolved, Ok(Change::Unreadable));
        }
        assert_eq!(
            release(&store, (&live, None), false, ttl).await,
            Ok(Change::Live)
        );
        assert_eq!(
            release(&store, (&done, None), false, ttl).await,
            Ok(Change::Unreadable)
        );
        assert_eq!(
            release(&store, (&live, None), true, ttl).await,
            Ok(Change::Live)
        );
        assert_eq!(
            release(&store, (&done, None), true, ttl).await,
            Ok(Change::Done)
        );
        assert!(store.get(&done).await.unwrap().is_none());
    }

    /// A reconciliation decides on the record it read before asking the upstream: if a retry
    /// settled the key meanwhile, the late answer changes nothing.
    #[tokio::test]
    async fn a_change_made_on_a_stale_read_leaves_the_record_as_it_is() {
        let store = MemoryStore::new(100, 1 << 20);
        let key = StoreKey::from_bytes([3; 32]);
        let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(60));
        let claim = Fingerprint([1; 32]).into();
        let Reservation::Owner(t) = store.reserve(&key, &claim, lease, ttl).await.unwrap() else {
            panic!("a new key");
        };
        store
            .mark_unknown(&key, t, UnknownReason::Timeout)
            .await
            .unwrap();
        let seen = store.get(&key).await.unwrap().unwrap();
        // Meanwhile, the key is released, runs again and completes.
        let t2 = store
            .take_over(&key, &seen, &claim, lease, ttl)
            .await
            .unwrap()
            .unwrap();
        store.complete(&key, t2, answer(), ttl).await.unwrap();
        for change in [
            release(&store, (&key, Some(&seen)), false, ttl).await,
            resolve(&store, (&key, Some(&seen)), answer(), false, ttl).await,
        ] {
            assert_eq!(change, Ok(Change::Changed));
        }
        assert!(matches!(
            store.get(&key).await.unwrap().unwrap().state,
            RecordState::Completed(_)
        ));
        // Without a record of its own, an operator's release applies to the record as it is:
        // a completed one only with force.
        assert_eq!(
            release(&store, (&key, None), false, ttl).await,
            Ok(Change::Completed)
        );
        assert_eq!(
            resolve(&store, (&key, None), answer(), false, ttl).await,
            Ok(Change::Completed)
        );
        assert!(store.get(&key).await.unwrap().is_some());
        assert_eq!(
            release(&store, (&key, None), true, ttl).await,
            Ok(Change::Done)
        );
        assert_eq!(store.get(&key).await.unwrap(), None);
    }
}
