//! Every response the gateway makes itself: RFC 9457 `application/problem+json`, or for a
//! gRPC client the same problem as a gRPC status ([`for_grpc`]).
//!
//! This is the one place that decides the status, `type` URI, gRPC code, wording and retry hint
//! for each cause; [`render`] makes the response (problem+json or the route's `error_body`, and
//! the hint headers SDKs obey). Bodies never carry internal details (addresses, store errors,
//! keys); those go to the log.

mod render;
pub use render::restyle;

use std::time::Duration;

use crate::body::Body;
use crate::grpc::Code;
use crate::key::KeyError;
use crate::store::UnknownReason;
use http::{Response, StatusCode};

/// Base of every problem `type` URI; `docs/problems.md` documents each one.
pub const TYPE_BASE: &str = "https://idemgate.dev/problems/";

/// The RFC 9457 members, in the order the RFC lists them.
#[derive(serde::Serialize)]
struct ProblemJson {
    #[serde(rename = "type")]
    kind: String,
    title: &'static str,
    status: u16,
    detail: String,
}

/// Why the gateway answered instead of the upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// `what` names the key's source: "the Idempotency-Key header", "the body field /id".
    MissingKey {
        what: String,
    },
    InvalidKey {
        what: String,
        reason: KeyError,
    },
    /// The key was used before with a different request (another fingerprint).
    KeyReused {
        status: StatusCode,
    },
    /// The original request with this key is still running and `wait` ran out.
    InFlight {
        retry_after: Duration,
    },
    /// The body passes `max_body`: as sent, or once its `Content-Encoding` is undone.
    BodyTooLarge {
        limit: usize,
        decoded: bool,
    },
    /// A `Content-Encoding` the gateway cannot undo, so it cannot tell what the body says (its
    /// name, when short and a token, or why), and the codings it can (`Accept-Encoding`).
    UnsupportedEncoding {
        what: String,
        accepted: &'static str,
    },
    /// A POST's `server.method_override_header` names no method the upstream would surely
    /// take (two values, an unknown method) on an idempotent route, or a route with fewer
    /// checks than the POST's own.
    InvalidMethodOverride,
    /// The body is not what its `Content-Encoding` says.
    UndecodableBody {
        what: &'static str,
    },
    /// The client's request body could not be read (connection dropped mid-body).
    BadRequestBody,
    /// No part of the request body arrived for `server.body_timeout`.
    BodyTimeout,
    /// A method the gateway never forwards (CONNECT).
    MethodNotAllowed,
    /// A request to the path of a route that verifies its sender or requires its client (a
    /// signature, `require_client`) that is not the route's: another method, or a spelling of
    /// the path the route was not found by. `allow`: the route's methods.
    GuardedPath {
        allow: String,
    },
    /// A protocol upgrade (WebSocket) on an idempotent route: a tunnel has no response to store.
    UpgradeRefused,
    /// The route verifies its sender's signature and this delivery's did not pass: `why` is
    /// "missing", "stale" or "invalid".
    SignatureRejected {
        why: &'static str,
    },
    /// `require_client = true` and the request names no client; `what` names the headers.
    ClientRequired {
        what: String,
    },
    /// The route takes its client scope from a JWT (`client_jwt`) and this one did not verify:
    /// `reason` is why (`expired`, `signature`, ...).
    ClientUnverified {
        reason: &'static str,
    },
    /// The route's `client_jwt` key set has not been loaded yet, or is being fetched again for
    /// the key this token names.
    ClientKeysUnavailable,
    StoreUnavailable,
    StoreFull,
    /// The key's record is sealed and does not open with this gateway's keys
    /// (`store.encryption_keys_*`): never replayed, never executed again.
    RecordUnreadable,
    /// The client scope stored as many records as `max_keys_per_client` (or
    /// `max_keys_anonymous`) allows per `ttl`; nothing was forwarded or stored.
    KeyQuota {
        retry_after: Duration,
    },
    /// A limit that keeps the gateway alive refused the request before anything ran; `what`
    /// names it ("memory for request bodies", "connections to the upstream").
    Overloaded {
        what: &'static str,
    },
    /// Nothing was sent upstream; the key was released.
    UpstreamUnreachable,
    /// Pass-through only: no response within `upstream_timeout`.
    UpstreamTimeout,
    /// Pass-through only: the exchange failed after the connection was made.
    UpstreamFailed,
    /// The request reached the upstream but its outcome is unknown. With `retryable` false (the
    /// default `on_unknown = "reject"`) it will never run again under this key.
    OutcomeUnknown {
        reason: UnknownReason,
        retryable: bool,
        /// The route asks the upstream about such outcomes (`reconcile`): a retry after this
        /// long finds the lookup due (or done in the background).
        lookup_in: Option<Duration>,
    },
    /// The operator API's own refusals on the admin listener (`unauthorized`, `no-record`,
    /// `operator-api-off`, `record-live`, `record-changed`, `method-not-allowed`,
    /// `bad-operator-request`): made in [`crate::admin`].
    Operator {
        slug: &'static str,
        status: StatusCode,
        title: &'static str,
        detail: String,
    },
}

impl Problem {
    /// The stable slug that ends the `type` URI.
    pub fn slug(&self) -> &'static str {
        match self {
            Problem::MissingKey { .. } => "missing-key",
            Problem::InvalidKey { .. } => "invalid-key",
            Problem::KeyReused { .. } => "key-reused",
            Problem::InFlight { .. } => "in-flight",
            Problem::BodyTooLarge { .. } => "body-too-large",
            Problem::UnsupportedEncoding { .. } => "unsupported-content-encoding",
            Problem::UndecodableBody { .. } => "undecodable-body",
            Problem::InvalidMethodOverride => "invalid-method-override",
            Problem::BadRequestBody => "bad-request-body",
            Problem::BodyTimeout => "body-timeout",
            Problem::MethodNotAllowed | Problem::GuardedPath { .. } => "method-not-allowed",
            Problem::UpgradeRefused => "upgrade-refused",
            Problem::ClientRequired { .. } => "client-required",
            Problem::ClientUnverified { .. } => "client-unverified",
            Problem::ClientKeysUnavailable => "client-keys-unavailable",
            Problem::SignatureRejected { .. } => "signature-rejected",
            Problem::StoreUnavailable => "store-unavailable",
            Problem::StoreFull => "store-full",
            Problem::RecordUnreadable => "record-unreadable",
            Problem::KeyQuota { .. } => "key-quota",
            Problem::Overloaded { .. } => "overloaded",
            Problem::UpstreamUnreachable => "upstream-unreachable",
            Problem::UpstreamTimeout => "upstream-timeout",
            Problem::UpstreamFailed => "upstream-failed",
            Problem::OutcomeUnknown { .. } => "outcome-unknown",
            Problem::Operator { slug, .. } => slug,
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Problem::MissingKey { .. }
            | Problem::InvalidKey { .. }
            | Problem::BadRequestBody
            | Problem::UndecodableBody { .. }
            | Problem::InvalidMethodOverride => StatusCode::BAD_REQUEST,
            Problem::UnsupportedEncoding { .. } => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Problem::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            Problem::MethodNotAllowed | Problem::GuardedPath { .. } => {
                StatusCode::METHOD_NOT_ALLOWED
            }
            Problem::UpgradeRefused => StatusCode::BAD_REQUEST,
            Problem::ClientRequired { .. }
            | Problem::ClientUnverified { .. }
            | Problem::SignatureRejected { .. } => StatusCode::UNAUTHORIZED,
            Problem::ClientKeysUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            Problem::KeyReused { status } => *status,
            Problem::InFlight { .. } => StatusCode::CONFLICT,
            Problem::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Problem::StoreUnavailable | Problem::StoreFull | Problem::Overloaded { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Problem::KeyQuota { .. } => StatusCode::TOO_MANY_REQUESTS,
            Problem::UpstreamUnreachable | Problem::UpstreamFailed => StatusCode::BAD_GATEWAY,
            Problem::RecordUnreadable => StatusCode::INTERNAL_SERVER_ERROR,
            Problem::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            Problem::OutcomeUnknown { reason, .. } => match reason {
                UnknownReason::Timeout => StatusCode::GATEWAY_TIMEOUT,
                UnknownReason::Interrupted | UnknownReason::Abandoned => StatusCode::BAD_GATEWAY,
            },
            Problem::Operator { status, .. } => *status,
        }
    }

    /// The gRPC status a gRPC client gets instead: what its retry policy should make of it.
    /// Nothing the gateway cannot vouch was not executed is `UNAVAILABLE` (which clients retry).
    pub fn grpc_code(&self) -> Code {
        match self {
            Problem::MissingKey { .. }
            | Problem::InvalidKey { .. }
            | Problem::BadRequestBody
            | Problem::UnsupportedEncoding { .. }
            | Problem::UndecodableBody { .. }
            | Problem::InvalidMethodOverride
            | Problem::MethodNotAllowed
            | Problem::GuardedPath { .. }
            | Problem::UpgradeRefused => Code::InvalidArgument,
            Problem::BodyTimeout => Code::DeadlineExceeded,
            Problem::ClientRequired { .. }
            | Problem::ClientUnverified { .. }
            | Problem::SignatureRejected { .. } => Code::Unauthenticated,
            Problem::ClientKeysUnavailable => Code::Unavailable,
            Problem::KeyReused { .. } => Code::FailedPrecondition,
            Problem::InFlight { .. } => Code::Aborted,
            Problem::BodyTooLarge { .. }
            | Problem::KeyQuota { .. }
            | Problem::Overloaded { .. } => Code::ResourceExhausted,
            Problem::StoreUnavailable | Problem::StoreFull | Problem::UpstreamUnreachable => {
                Code::Unavailable
            }
            Problem::UpstreamTimeout => Code::DeadlineExceeded,
            Problem::UpstreamFailed | Problem::OutcomeUnknown { .. } => Code::Unknown,
            Problem::RecordUnreadable => Code::Internal,
            // Never a gRPC client's: the admin listener speaks HTTP only.
            Problem::Operator { .. } => Code::FailedPrecondition,
        }
    }

    fn title(&self) -> &'static str {
        match self {
            Problem::MissingKey { .. } => "Idempotency key missing",
            Problem::InvalidKey { .. } => "Idempotency key invalid",
            Problem::KeyReused { .. } => "Idempotency key reused with a different request",
            Problem::InFlight { .. } => "Request with this idempotency key is still in progress",
            Problem::BodyTooLarge { .. } => "Request body too large",
            Problem::BadRequestBody => "Request body could not be read",
            Problem::UnsupportedEncoding { .. } => "Request body's Content-Encoding not supported",
            Problem::UndecodableBody { .. } => "Request body could not be decoded",
            Problem::InvalidMethodOverride => "Method override not understood",
            Problem::BodyTimeout => "Request body stopped arriving",
            Problem::MethodNotAllowed | Problem::GuardedPath { .. } => "Method not allowed",
            Problem::UpgradeRefused => "Protocol upgrade not allowed here",
            Problem::ClientRequired { .. } => "Client identification required",
            Problem::ClientUnverified { .. } => "Client token not verified",
            Problem::ClientKeysUnavailable => "Client token keys not loaded",
            Problem::SignatureRejected { .. } => "Delivery signature not verified",
            Problem::StoreUnavailable => "Idempotency store unavailable",
            Problem::StoreFull => "Idempotency store full",
            Problem::RecordUnreadable => "Stored record unreadable",
            Problem::KeyQuota { .. } => "Too many new idempotency keys",
            Problem::Overloaded { .. } => "Gateway overloaded",
            Problem::UpstreamUnreachable => "Upstream unreachable",
            Problem::UpstreamTimeout => "Upstream timed out",
            Problem::UpstreamFailed => "Upstream connection failed",
            Problem::OutcomeUnknown { .. } => "Outcome of the original request unknown",
            Problem::Operator { title, .. } => title,
        }
    }

    fn detail(&self) -> String {
        match self {
            Problem::MissingKey { what } => format!(
                "This endpoint requires {what}: it identifies the operation, so that a retry is never executed twice. Send a unique value (a UUID) per operation and reuse it on every retry."
            ),
            Problem::InvalidKey { what, reason } => format!(
                "The idempotency key ({what}) is not valid: {reason}. Use 1 to 255 visible ASCII characters, such as a UUID."
            ),
            Problem::KeyReused { .. } => "This idempotency key was already used with a different request (method, path, query, media type or body). The stored result is kept; use a new key for a new operation.".into(),
            Problem::InFlight { retry_after } => format!(
                "The original request with this idempotency key has not finished yet. Retry with the same key after {} seconds to get its result.",
                retry_after.as_millis().div_ceil(1000).max(1)
            ),
            Problem::BodyTooLarge { limit, decoded: false } => format!(
                "The request body exceeds the {limit} bytes this endpoint accepts. It was not forwarded."
            ),
            Problem::BodyTooLarge { limit, decoded: true } => format!(
                "The request body, once its Content-Encoding is undone, exceeds the {limit} bytes this endpoint accepts. It was not forwarded."
            ),
            Problem::UnsupportedEncoding { what, accepted } => format!(
                "This endpoint compares request bodies by what they say, and cannot decode {what}. It was not forwarded: send the body as one of {accepted}, or without a Content-Encoding, with the same key."
            ),
            Problem::InvalidMethodOverride => "This endpoint is made idempotent, and this POST's method override header holds several values or a method other than GET, PUT, PATCH, DELETE or OPTIONS, or names an endpoint with fewer checks than the POST's own, so which operation the upstream would run, and under which checks, cannot be told. It was not forwarded.".into(),
            Problem::UndecodableBody { what } => format!(
                "The request body is not what its Content-Encoding says ({what} do not decode). It was not forwarded."
            ),
            Problem::BadRequestBody => "The request body ended before it was complete. It was not forwarded; retry with the same key.".into(),
            Problem::BodyTimeout => "No part of the request body arrived for too long. It was not forwarded; retry with the same key.".into(),
            Problem::MethodNotAllowed => "This gateway does not forward CONNECT requests.".into(),
            Problem::GuardedPath { allow } => format!(
                "This path is an endpoint that verifies its sender or requires its client, and answers only {allow} as written. It was not forwarded."
            ),
            Problem::UpgradeRefused => "This endpoint is made idempotent: its requests are executed once and their responses stored, which a protocol upgrade (WebSocket) cannot be. It was not forwarded.".into(),
            Problem::ClientRequired { what } => format!(
                "This endpoint requires {what}: idempotency keys are kept per client, and a request that names none cannot be told apart from another's. It was not forwarded."
            ),
            Problem::ClientUnverified { reason } => format!(
                "This endpoint keeps idempotency keys per client, identified by a token its issuer signed, and this request's token did not verify ({reason}). It was not forwarded and nothing was stored: get a new token and retry with the same idempotency key."
            ),
            Problem::ClientKeysUnavailable => "The keys that verify this endpoint's client tokens have not been loaded yet, or not the one this token names (they are being fetched). Nothing was forwarded or stored: retry shortly with the same idempotency key.".to_string(),
            Problem::SignatureRejected { why } => {
                let what = match *why {
                    "missing" => "carries no signature in the format this endpoint's sender uses",
                    "stale" => "is signed with a timestamp too far from now",
                    _ => "has a signature that matches none of this endpoint's secrets over the bytes received",
                };
                format!("This delivery {what}. It was not forwarded and nothing was stored.")
            }
            Problem::StoreUnavailable => "The idempotency store cannot be reached, so the request was not forwarded. Retry with the same key later.".into(),
            Problem::StoreFull => "The idempotency store is at its capacity, so the request was not forwarded. Retry with the same key later.".into(),
            Problem::RecordUnreadable => "An earlier request with this key was recorded, and its record cannot be read with the gateway's keys, so it is neither replayed nor run again. An operator must list its key again or release the record.".into(),
            Problem::KeyQuota { retry_after } => format!(
                "This client stored as many results under new idempotency keys as this endpoint allows for now. The request was not forwarded. Retries of earlier keys still get their results; a new key can be used in {} seconds.",
                retry_after.as_millis().div_ceil(1000).max(1)
            ),
            Problem::Overloaded { what } => format!(
                "The gateway is at its limit for {what}, so the request was not forwarded. Retry with the same key shortly."
            ),
            Problem::UpstreamUnreachable => "The upstream service could not be reached; the request was not sent. Retrying with the same key will try again.".into(),
            Problem::UpstreamTimeout => "The upstream service did not answer in time.".into(),
            Problem::UpstreamFailed => "The connection to the upstream service failed before a complete response arrived.".into(),
            Problem::OutcomeUnknown {
                reason,
                retryable,
                lookup_in,
            } => {
                let why = match reason {
                    UnknownReason::Timeout => "the upstream did not answer in time",
                    UnknownReason::Interrupted => "the connection to the upstream failed after the request was sent",
                    UnknownReason::Abandoned => "the gateway handling it stopped before the upstream answered",
                };
                if *retryable {
                    format!(
                        "The request with this idempotency key reached the upstream, but {why}, so it may or may not have been executed. This endpoint is configured as safe to run again: retrying with the same key executes it again."
                    )
                } else if let Some(wait) = lookup_in {
                    // Never "a new key": that could run it twice while the lookup would settle it.
                    format!(
                        "The request with this idempotency key reached the upstream, but {why}, so it may or may not have been executed. The gateway asks the upstream whether it was: retry with the same key, not a new one, in {} seconds to get its result (or to run it, once, if it was not).",
                        wait.as_millis().div_ceil(1000).max(1)
                    )
                } else {
                    format!(
                        "The request with this idempotency key reached the upstream, but {why}, so it may or may not have been executed. It will not be executed again automatically: check the upstream's records before retrying with a new key."
                    )
                }
            }
            Problem::Operator { detail, .. } => detail.clone(),
        }
    }

    /// Whether the same request can succeed later, and when: what the retry hint headers say
    /// (docs/problems.md lists each type's).
    fn hint(&self) -> Hint {
        const SOON: Duration = Duration::from_secs(1);
        match self {
            // Only another request (a new key, another body, a token, a signature) can pass; or,
            // for a record the keys do not open, an operator.
            Problem::RecordUnreadable
            | Problem::MissingKey { .. }
            | Problem::InvalidKey { .. }
            | Problem::KeyReused { .. }
            | Problem::BodyTooLarge { .. }
            | Problem::UnsupportedEncoding { .. }
            | Problem::UndecodableBody { .. }
            | Problem::InvalidMethodOverride
            | Problem::MethodNotAllowed
            | Problem::GuardedPath { .. }
            | Problem::UpgradeRefused
            | Problem::SignatureRejected { .. }
            | Problem::ClientRequired { .. }
            | Problem::ClientUnverified { .. } => Hint::Final,
            Problem::InFlight { retry_after } | Problem::KeyQuota { retry_after } => {
                Hint::Retry(*retry_after)
            }
            // Nothing was forwarded: the same request, sent again, runs once the way is clear.
            Problem::BadRequestBody
            | Problem::BodyTimeout
            | Problem::ClientKeysUnavailable
            | Problem::StoreUnavailable
            | Problem::StoreFull
            | Problem::Overloaded { .. }
            | Problem::UpstreamUnreachable => Hint::Retry(SOON),
            // On an idempotent route only, so the gateway knows what a retry does: runs it again
            // (on_unknown = "retry"), finds what the lookup said, or only an operator settles it.
            Problem::OutcomeUnknown {
                retryable: true, ..
            } => Hint::Retry(SOON),
            Problem::OutcomeUnknown {
                lookup_in: Some(wait),
                ..
            } => Hint::Retry((*wait).max(SOON)),
            Problem::OutcomeUnknown { .. } => Hint::Final,
            // A pass-through request's upstream failed: whether it ran, and whether it may run
            // again, is the client's and the upstream's business, as without the gateway.
            Problem::UpstreamTimeout | Problem::UpstreamFailed | Problem::Operator { .. } => {
                Hint::Unsaid
            }
        }
    }
}

/// What the retry hint headers say of a problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hint {
    /// `true`: the same request can succeed after this long (`Retry-After`, `retry-after-ms`).
    Retry(Duration),
    /// `false`: retrying the same request gets the same answer.
    Final,
    /// No hint header: the client's own rules decide.
    Unsaid,
}

/// A response for a gRPC client: a problem the gateway made becomes its gRPC status; anything
/// else (the upstream's answer, a replay) is left as it is.
pub fn for_grpc(mut resp: Response<Body>) -> Response<Body> {
    match resp.extensions_mut().remove::<Problem>() {
        Some(problem) => problem.into_grpc_response(),
        None => resp,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::body;
    use crate::grpc;
    use bytes::Bytes;
    use http::header;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn problems_are_rfc9457_json_with_a_stable_type() {
        let resp = Problem::InFlight {
            retry_after: Duration::from_secs(3),
        }
        .into_response();
        assert_eq!(resp.status(), StatusCode::CONFLICT);
        assert_eq!(
            resp.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
        assert_eq!(resp.headers()[header::RETRY_AFTER], "3");
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["type"], "https://idemgate.dev/problems/in-flight");
        assert_eq!(v["status"], 409);
        assert!(v["title"].is_string() && v["detail"].is_string());
    }

    #[tokio::test]
    async fn a_grpc_client_gets_a_status_it_will_not_retry_unless_nothing_ran() {
        let unknown = Problem::OutcomeUnknown {
            reason: UnknownReason::Timeout,
            retryable: false,
            lookup_in: None,
        };
        assert_eq!(
            unknown.grpc_code(),
            Code::Unknown,
            "never UNAVAILABLE: clients retry that"
        );
        let resp = for_grpc(unknown.into_response());
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.headers()[header::CONTENT_TYPE], "application/grpc");
        assert_eq!(resp.headers()[grpc::GRPC_STATUS], "2");
        assert!(resp.headers()[grpc::GRPC_MESSAGE]
            .to_str()
            .unwrap()
            .starts_with("Outcome of the original request unknown"));
        assert!(resp
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .is_empty());
        let in_flight = for_grpc(
            Problem::InFlight {
                retry_after: Duration::from_millis(1500),
            }
            .into_response(),
        );
        assert_eq!(in_flight.headers()[grpc::GRPC_STATUS], "10");
        assert_eq!(in_flight.headers()[grpc::GRPC_RETRY_PUSHBACK], "1500");
        // What the gateway did not make is left alone.
        let upstream = Response::new(body::full(Bytes::from_static(b"x")));
        assert_eq!(for_grpc(upstream).headers().len(), 0);
    }

    #[test]
    fn mismatch_status_is_configurable() {
        let p = Problem::KeyReused {
            status: StatusCode::UNPROCESSABLE_ENTITY,
        };
        assert_eq!(p.status(), StatusCode::UNPROCESSABLE_ENTITY);
    }
}
