//! The operator API on the admin listener: one record, by its id (the hex of its store key, as
//! `idemgate keys get` prints it), read, released or resolved while the gateway runs, on every
//! store. Off unless a bearer token is configured (`server.admin_token_env` or
//! `admin_token_file`); only its SHA-256 is kept, compared in constant time, and never logged.
//! Every change, and every refused token, is an audit line (target `idemgate::audit`): peer,
//! action, key id, result.
//!
//! - `GET /keys?state=unknown[&route=NAME|&consumer=NAME][&limit=N][&cursor=C]`: the unknown
//!   outcomes (marked unknown, or abandoned mid-flight), each with its id, route or consumer
//!   and the key the client sent; `next_cursor` goes on, `null` at the end
//!   ([`operator::list_unknown`]).
//! - `GET /keys/{id}`: the record (state, times; stored status, headers, body size).
//! - `DELETE /keys/{id}[?force=true]`: release: the request did not happen, the next retry
//!   executes. A pending record whose lease still runs, or a completed one, needs `force`.
//! - `PUT /keys/{id}[?force=true]` with `{"status", "headers", "body" | "body_base64"}`: resolve
//!   as completed; retries replay exactly that. The same records need `force`.
//!
//! Both changes replace exactly the record read (compare and set, [`operator::release`]).

use std::net::SocketAddr;
use std::time::Duration;

use base64::Engine;
use bytes::Bytes;
use http::{header, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use opentelemetry::trace::SpanKind;
use opentelemetry::KeyValue;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::body::{self, Body};
use crate::config::TokenSource;
use crate::conn::ClientBody;
use crate::key::StoreKey;
use crate::operator::{self, Change, Filter};
use crate::problem::Problem;
use crate::store::{now_ms, OriginKind, Store, StoreError, StoredResponse};
use crate::telemetry::span::Trace;
use crate::telemetry::traces::Traces;

/// The largest `PUT` body: a stored response the operator types in.
const MAX_RESOLUTION: usize = 1 << 20;
/// A token shorter than this is no secret.
const MIN_TOKEN: usize = 16;

/// The operator API's settings, made at startup.
pub struct Operator {
    token: [u8; 32],
    /// How long a resolved record is kept ([`crate::config::Config::longest_ttl`]).
    ttl: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("server.admin_token_env: the environment variable {0} is not set or empty")]
    Env(String),
    #[error("server.admin_token_file {path}: {reason}")]
    File { path: String, reason: String },
    #[error("the admin token is shorter than {MIN_TOKEN} characters: use a long random one (openssl rand -hex 32)")]
    TooShort,
}

impl Operator {
    /// Reads the token where the config says; keeps its hash only.
    pub fn load(source: &TokenSource, ttl: Duration) -> Result<Operator, TokenError> {
        let token = read_token(source)?;
        Ok(Operator {
            token: Sha256::digest(token.as_bytes()).into(),
            ttl,
        })
    }

    /// Whether the request carries the token (`Authorization: Bearer <token>`).
    fn admits(&self, req: &Request<ClientBody>) -> bool {
        let presented = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or_default();
        let hash: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        bool::from(hash.ct_eq(&self.token))
    }
}

/// The operator token, where the config says it is (for the gateway, and for `idemgate keys`).
pub fn read_token(source: &TokenSource) -> Result<String, TokenError> {
    let token = match source {
        TokenSource::Env(name) => std::env::var(name)
            .ok()
            .filter(|t| !t.is_empty())
            .ok_or_else(|| TokenError::Env(crate::config::shown_name(name)))?,
        TokenSource::File(path) => std::fs::read_to_string(path)
            .map_err(|e| TokenError::File {
                path: crate::config::shown_name(&path.display().to_string()),
                reason: e.to_string(),
            })?
            .trim()
            .to_string(),
    };
    if token.len() < MIN_TOKEN {
        return Err(TokenError::TooShort);
    }
    Ok(token)
}

/// Serves `/keys/...`; `None`: the API is off.
pub(super) async fn handle(
    operator: Option<&Operator>,
    (store, routes_ttl): (&dyn Store, Option<Duration>),
    req: Request<ClientBody>,
    peer: SocketAddr,
) -> Response<Body> {
    let Some(operator) = operator else {
        return problem(
            StatusCode::NOT_FOUND,
            "operator-api-off",
            "Operator API off",
            "The operator API is off: set server.admin_token_env or server.admin_token_file."
                .into(),
        );
    };
    let action = action(req.method());
    if !operator.admits(&req) {
        let path = logged_path(req.uri().path());
        tracing::warn!(target: "idemgate::audit", %peer, action, path = %path, "operator request refused: no valid token");
        let mut resp = problem(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "Operator token required",
            "Send Authorization: Bearer <token> with the token the gateway was configured with."
                .into(),
        );
        resp.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return resp;
    }
    if req.uri().path() == "/keys" {
        if !matches!(*req.method(), Method::GET | Method::HEAD) {
            return not_allowed("GET, HEAD", "The listing is GET /keys?state=unknown.");
        }
        return list(store, req.uri().query().unwrap_or_default()).await;
    }
    let Some(key) = req
        .uri()
        .path()
        .strip_prefix("/keys/")
        .and_then(StoreKey::from_hex)
    else {
        return bad("The path is /keys/{id}, the id being 64 lowercase hex digits, as `idemgate keys get` prints it.".into());
    };
    // Never shorter than any running route's ttl.
    let ttl = routes_ttl.map_or(operator.ttl, |t| t.max(operator.ttl));
    let force = req
        .uri()
        .query()
        .is_some_and(|q| q.split('&').any(|p| p == "force=true"));
    // The audit line is written as soon as the change is made, before the follow-up read: a
    // client that hangs up meanwhile drops this future, and the change would go unaudited.
    let audit = |done: &Result<Change, StoreError>| {
        let status = status_of(done);
        tracing::info!(target: "idemgate::audit", %peer, action, key_id = %key, force, status, "operator change");
    };
    match *req.method() {
        Method::GET | Method::HEAD => read(store, &key).await.unwrap_or_else(|e| e),
        Method::DELETE => {
            let done = operator::release(store, (&key, None), force, ttl).await;
            audit(&done);
            changed(store, &key, done, "released").await
        }
        Method::PUT => match resolution(req.into_body()).await {
            Ok(response) => {
                let done = operator::resolve(store, (&key, None), response, force, ttl).await;
                audit(&done);
                changed(store, &key, done, "resolved").await
            }
            Err(why) => bad(why),
        },
        _ => not_allowed(
            "GET, HEAD, PUT, DELETE",
            "A record is read (GET), resolved (PUT) or released (DELETE).",
        ),
    }
}

/// An operator change's server span (`DELETE /keys/{id}`, `PUT /keys/{id}`) when traces are
/// on, continuing the operator's `traceparent`; reads are not traced.
pub(super) fn change_span(traces: &Traces, req: &Request<ClientBody>) -> Option<Trace> {
    if !matches!(*req.method(), Method::DELETE | Method::PUT) {
        return None;
    }
    let mut attributes = vec![
        KeyValue::new("http.request.method", req.method().as_str().to_owned()),
        KeyValue::new("http.route", "/keys/{id}"),
    ];
    if let Some(key) = req
        .uri()
        .path()
        .strip_prefix("/keys/")
        .and_then(StoreKey::from_hex)
    {
        attributes.push(KeyValue::new("idemgate.key.id", key.short()));
    }
    let name = format!("{} /keys/{{id}}", req.method());
    Some(traces.span(name, SpanKind::Server, req.headers(), attributes))
}

pub(super) fn end_change_span(span: &Trace, resp: &Response<Body>) {
    let status = resp.status().as_u16();
    span.set(KeyValue::new(
        "http.response.status_code",
        i64::from(status),
    ));
    span.end((status >= 500).then_some(""));
}

/// The status a change's answer has (a change made is 200 even if the follow-up read of the
/// record then fails).
fn status_of(done: &Result<Change, StoreError>) -> u16 {
    match done {
        Ok(Change::Done) => 200,
        Ok(Change::NotFound) => 404,
        Ok(Change::Live | Change::Completed | Change::Changed | Change::Unreadable) => 409,
        Err(_) => 503,
    }
}

/// `GET /keys?...`: one page of the unknown outcomes.
async fn list(store: &dyn Store, query: &str) -> Response<Body> {
    let (filter, cursor, limit) = match listing(query) {
        Ok(l) => l,
        Err(why) => return bad(why),
    };
    match operator::list_unknown(store, &filter, cursor, limit).await {
        Ok((found, next)) => json(
            StatusCode::OK,
            &serde_json::json!({
                "keys": found.iter().map(operator::listed).collect::<Vec<_>>(),
                "next_cursor": next,
            }),
        ),
        Err(StoreError::BadCursor) => {
            bad("cursor: not one this gateway's store handed out; start without it.".into())
        }
        Err(e) => store_failed(&e),
    }
}

/// The listing's query: its filter, cursor and limit (default 100).
fn listing(query: &str) -> Result<(Filter, Option<String>, usize), String> {
    let (mut filter, mut cursor, mut limit) = (Filter::default(), None, 100);
    let mut state = None;
    for (name, value) in form_urlencoded::parse(query.as_bytes()) {
        match &*name {
            "state" => state = Some(value.into_owned()),
            "route" | "consumer" if filter.from.is_some() => {
                return Err("Give route or consumer once, not both.".into())
            }
            "route" => filter.from = Some((OriginKind::Route, value.into_owned())),
            "consumer" => filter.from = Some((OriginKind::Consumer, value.into_owned())),
            "cursor" => cursor = Some(value.into_owned()),
            "limit" => {
                limit = value
                    .parse()
                    .ok()
                    .filter(|n| (1..=operator::MAX_LIST).contains(n))
                    .ok_or_else(|| format!("limit: a number from 1 to {}", operator::MAX_LIST))?;
            }
            other => {
                return Err(format!(
                    "Unknown parameter {other:?}: state, route, consumer, limit, cursor."
                ))
            }
        }
    }
    if state.as_deref() != Some("unknown") {
        return Err(
            "The listing needs state=unknown (the records nobody knows the outcome of).".into(),
        );
    }
    Ok((filter, cursor, limit))
}

fn action(method: &Method) -> &'static str {
    match *method {
        Method::DELETE => "release",
        Method::PUT => "resolve",
        _ => "read",
    }
}

/// `GET /keys/{id}`: the record, and when it expires (the moment a retry would execute
/// again); no record, or a store that fails, is the `Err` answer.
async fn read(store: &dyn Store, key: &StoreKey) -> Result<Response<Body>, Response<Body>> {
    let record = match store.get(key).await {
        Ok(Some(record)) => record,
        Ok(None) => return Err(no_record()),
        Err(StoreError::Unreadable { key_id, .. }) => {
            return Ok(unreadable(store, key, key_id).await)
        }
        Err(e) => return Err(store_failed(&e)),
    };
    // Read after the record: one that expired in between shows without it.
    let expires_ms = store.expires_ms(key).await.map_err(|e| store_failed(&e))?;
    let found = crate::store::Scanned {
        key: *key,
        record,
        expires_ms,
    };
    Ok(json(StatusCode::OK, &operator::listed(&found)))
}

/// A record that does not open with the gateway's keys, as far as it can be shown: its id, the
/// id of the key that sealed it, and when it goes.
async fn unreadable(store: &dyn Store, key: &StoreKey, key_id: Option<String>) -> Response<Body> {
    let mut view = serde_json::json!({"id": key.hex(), "state": "unreadable", "key_id": key_id});
    if let Ok(Some(ms)) = store.expires_ms(key).await {
        view["expires"] = crate::operator::timestamp(ms).into();
    }
    json(StatusCode::OK, &view)
}

/// The answer to a change: the record as it is now (or that it is gone), or why not.
/// `made`: what a change made is called when the record cannot be shown (`released`,
/// `resolved`).
async fn changed(
    store: &dyn Store,
    key: &StoreKey,
    done: Result<Change, StoreError>,
    made: &str,
) -> Response<Body> {
    match done {
        // A change made is 200, with the resolved record as it is now (and when it expires),
        // or only what was done: never a retryable 503 because a follow-up read failed, which
        // would have the operator's tool make the change again, on whatever record is there
        // by then.
        Ok(Change::Done) => {
            let shown = match made {
                "resolved" => read(store, key).await.ok(),
                _ => None,
            };
            shown.unwrap_or_else(|| {
                json(StatusCode::OK, &serde_json::json!({"id": key.hex(), "state": made}))
            })
        }
        Ok(Change::NotFound) => no_record(),
        Ok(Change::Live) => problem(StatusCode::CONFLICT, "record-live", "Request still running", "The record is pending and its lease still runs: its request may still be executing. Wait, or add ?force=true.".into()),
        Ok(Change::Completed) => problem(StatusCode::CONFLICT, "record-completed", "Request completed", "The record is completed: its request ran, and retries replay its answer. Releasing it would let the next retry run the request again; overwriting it would replay another answer. If that is what you mean, add ?force=true.".into()),
        Ok(Change::Changed) => problem(StatusCode::CONFLICT, "record-changed", "Record changed", "The record changed while it was being replaced, and was left as it is now: read it again.".into()),
        Ok(Change::Unreadable) => problem(StatusCode::CONFLICT, "record-unreadable", "Record unreadable", "The record is sealed and does not open with the gateway's keys (store.encryption_keys_*), so whether its request still runs cannot be told. List its key again; or release it with ?force=true (it cannot be resolved).".into()),
        Err(e) => {
            tracing::warn!(error = %e, "operator change: the store did not answer");
            // The operator API is behind a token: the store's own words help here.
            problem(StatusCode::SERVICE_UNAVAILABLE, "store-unavailable", "Store unavailable", format!("The store did not answer the change ({e}), which may or may not have been made: read the record again. Where the record could not be taken over, the key is never freed by it: the record is as it was, or reads as in flight until the change's 30 s lease ends and then as an unknown outcome."))
        }
    }
}

/// What `PUT` stores: `{"status": 201, "headers": [["name", "value"]], "body": "..."}`, the
/// headers also as an object (`{"name": "value"}`, or a list of values for a repeated one).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Resolution {
    /// A JSON number: `201.0` is the integer 201 to JSON (and to JSON Schema).
    status: serde_json::Number,
    #[serde(default)]
    headers: Headers,
    #[serde(default)]
    body: Option<String>,
    #[serde(default)]
    body_base64: Option<String>,
}

/// A resolution's headers: pairs in order, or an object.
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum Headers {
    Pairs(Vec<(String, String)>),
    Object(serde_json::Map<String, serde_json::Value>),
}

impl Default for Headers {
    fn default() -> Self {
        Headers::Pairs(Vec::new())
    }
}

impl Headers {
    /// As name-value pairs: an object's names in name order (their order across names means
    /// nothing to HTTP), a list's values one pair each, in order.
    fn pairs(self) -> Result<Vec<(String, String)>, String> {
        let object = match self {
            Headers::Pairs(pairs) => return Ok(pairs),
            Headers::Object(object) => object,
        };
        let mut pairs = Vec::with_capacity(object.len());
        for (name, value) in object {
            match value {
                serde_json::Value::String(v) => pairs.push((name, v)),
                serde_json::Value::Array(values) => {
                    for v in values {
                        let serde_json::Value::String(v) = v else {
                            return Err(format!("header {name}: each value is a string"));
                        };
                        pairs.push((name.clone(), v));
                    }
                }
                _ => return Err(format!("header {name}: a string or a list of strings")),
            }
        }
        Ok(pairs)
    }
}

/// Base64 as operators' tools write it: padding or none, and bits past the last byte ignored.
const LENIENT_BASE64: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    base64::engine::GeneralPurposeConfig::new()
        .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent)
        .with_decode_allow_trailing_bits(true),
);

/// The response a `PUT` stores, or why its body is refused.
async fn resolution(body: ClientBody) -> Result<StoredResponse, String> {
    let bytes = Limited::new(body, MAX_RESOLUTION)
        .collect()
        .await
        .map_err(|e| format!("The body could not be read (at most {MAX_RESOLUTION} bytes): {e}"))?
        .to_bytes();
    resolution_of(&bytes)
}

/// A `PUT` body (`{"status", "headers", "body" | "body_base64"}`) as the response to store.
pub fn resolution_of(bytes: &[u8]) -> Result<StoredResponse, String> {
    let r: Resolution = serde_json::from_slice(bytes).map_err(|e| {
        format!("The body must be {{\"status\", \"headers\", \"body\" or \"body_base64\"}}: {e}")
    })?;
    // 1xx are not final; past 599 is no status class clients know.
    let status = (r.status.as_u64())
        .or_else(|| {
            r.status
                .as_f64()
                .filter(|f| f.fract() == 0.0)
                .map(|f| f as u64)
        })
        .filter(|s| (200..=599).contains(s))
        .and_then(|s| StatusCode::from_u16(s as u16).ok())
        .ok_or_else(|| format!("status {}: a final HTTP status, 200 to 599", r.status))?;
    let headers = r
        .headers
        .pairs()?
        .iter()
        .map(|(n, v)| {
            let name =
                HeaderName::from_bytes(n.as_bytes()).map_err(|_| format!("header name {n:?}"))?;
            // Visible ASCII, spaces and tabs: what RFC 9110 asks of new values (no obs-text).
            let value = Some(v)
                .filter(|v| v.bytes().all(|b| b == b'\t' || (b' '..=b'~').contains(&b)))
                .and_then(|v| HeaderValue::from_str(v).ok())
                .ok_or_else(|| {
                    format!("header {n}: not a valid value (visible ASCII, spaces, tabs)")
                })?;
            Ok((name, value))
        })
        .collect::<Result<Vec<_>, String>>()?;
    // A replay sets its own Content-Length; one stored would only be mistaken for something.
    let headers = (headers.into_iter())
        .filter(|(name, _)| *name != header::CONTENT_LENGTH)
        .collect();
    let body = match (r.body, r.body_base64) {
        (Some(_), Some(_)) => return Err("Give body or body_base64, not both.".into()),
        (Some(text), None) => Bytes::from(text),
        (None, Some(b64)) => Bytes::from(
            LENIENT_BASE64
                .decode(b64)
                .map_err(|e| format!("body_base64: {e}"))?,
        ),
        (None, None) => Bytes::new(),
    };
    Ok(StoredResponse {
        status,
        headers,
        trailers: Vec::new(),
        body,
        body_kept: true,
        completed_ms: now_ms(),
        link: None,
    })
}

fn json(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    let mut resp = Response::new(body::full(Bytes::from(value.to_string())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

fn problem(
    status: StatusCode,
    slug: &'static str,
    title: &'static str,
    detail: String,
) -> Response<Body> {
    Problem::Operator {
        slug,
        status,
        title,
        detail,
    }
    .into_response()
}

fn bad(detail: String) -> Response<Body> {
    problem(
        StatusCode::BAD_REQUEST,
        "bad-operator-request",
        "Bad operator request",
        detail,
    )
}

/// `405` with the methods the path answers (`Allow`).
fn not_allowed(allow: &'static str, detail: &str) -> Response<Body> {
    let mut resp = problem(
        StatusCode::METHOD_NOT_ALLOWED,
        "method-not-allowed",
        "Method not allowed",
        detail.into(),
    );
    resp.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static(allow));
    resp
}

fn no_record() -> Response<Body> {
    problem(
        StatusCode::NOT_FOUND,
        "no-record",
        "No record",
        "No record under this id: never used, expired, or released.".into(),
    )
}

fn store_failed(e: &StoreError) -> Response<Body> {
    tracing::warn!(error = %e, "operator request: store failed");
    Problem::StoreUnavailable.into_response()
}

/// A client-supplied path as an audit line shows it: at most [`LOGGED_PATH`] bytes, then how
/// long it was, so that refused calls cannot write lines of 64 KiB each.
fn logged_path(path: &str) -> std::borrow::Cow<'_, str> {
    if path.len() <= LOGGED_PATH {
        return path.into();
    }
    let mut end = LOGGED_PATH;
    while !path.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes)", &path[..end], path.len()).into()
}

const LOGGED_PATH: usize = 128;

#[cfg(test)]
mod tests {
    #[test]
    fn a_resolutions_headers_may_be_an_object() {
        let body = br#"{"status": 201, "headers": {"content-type": "application/json", "set-cookie": ["a=1", "b=2"]}, "body": "ok"}"#;
        let r = super::resolution_of(body).unwrap();
        let got: Vec<(&str, &str)> = (r.headers.iter())
            .map(|(n, v)| (n.as_str(), v.to_str().unwrap()))
            .collect();
        assert_eq!(
            got,
            [
                ("content-type", "application/json"),
                ("set-cookie", "a=1"),
                ("set-cookie", "b=2")
            ]
        );
        let integral = super::resolution_of(br#"{"status": 403.0}"#).unwrap();
        assert_eq!(integral.status, 403);
        for (b64, body) in [("YQ==", "a"), ("YQ", "a"), ("YR", "a"), ("", "")] {
            let json = format!(r#"{{"status": 200, "body_base64": "{b64}", "body": null}}"#);
            assert_eq!(
                super::resolution_of(json.as_bytes()).unwrap().body,
                body,
                "{b64}"
            );
        }
        for bad in [
            r#"{"status": 201.5}"#,
            r#"{"status": 199}"#,
            r#"{"status": 600}"#,
            r#"{"status": -201}"#,
            r#"{"status": 1e300}"#,
            r#"{"status": 201, "body": "a", "body_base64": "YQ=="}"#,
            r#"{"status": 201, "headers": {"x": 1}}"#,
            r#"{"status": 201, "headers": {"x": "\u0084"}}"#,
            r#"{"status": 201, "headers": [["x", "a\nb"]]}"#,
            r#"{"status": 201, "headers": {"x": [1]}}"#,
            r#"{"status": 201, "headers": "x"}"#,
        ] {
            assert!(super::resolution_of(bad.as_bytes()).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_resolutions_content_length_is_not_kept() {
        let body = br#"{"status": 201, "headers": [["content-length", "00-abababababababababababababababab-cdcdcdcdcdcdcdcd-01"], ["x-a", "1"]], "body": "ok"}"#;
        let r = super::resolution_of(body).unwrap();
        assert_eq!(r.headers.len(), 1, "{:?}", r.headers);
        assert_eq!(r.headers[0].0, "x-a");
        assert_eq!(r.link, None);
    }

    #[test]
    fn a_long_path_is_logged_cut() {
        let long = format!("/keys/{}", "é".repeat(40_000));
        let shown = super::logged_path(&long);
        assert!(shown.len() < 160, "{}", shown.len());
        assert!(shown.ends_with(&format!("({} bytes)", long.len())));
        assert_eq!(super::logged_path("/keys/abc"), "/keys/abc");
    }
}
