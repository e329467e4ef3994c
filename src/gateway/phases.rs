//! The phases of a request on an idempotent route, in order (the diagram in [`super`]): each
//! returns what the next one needs, or the [`Problem`] that ends the request.

use std::sync::Arc;
use std::time::Duration;

use http::{request, HeaderMap, HeaderName, HeaderValue, Request, Response};

use super::forward::{not_sent_problem, replay, Forward, UpstreamTime};
use super::received::{Received, ReqBody};
use super::{ClientConn, Gateway, Route};
use crate::body::{self, Body};
use crate::config::{Policy, RouteConfig};
use crate::conn::ClientBody;
use crate::idempotency::legacy::older_stored;
use crate::idempotency::{Decision, Execute, Keys, Refusal, Rules, Settled, Sought};
use crate::jwt::{Rejected, Verifier};
use crate::key::{ClientScope, Identified, Sent, StoreKey};
use crate::metrics::{Metrics, Outcome};
use crate::problem::Problem;
use crate::quota::{Quota, QuotaId, Share};
use crate::reconcile::Lookup;
use crate::signature;
use crate::store::{now_ms, Claim, Origin, OriginKind, StoreError, TraceLink};

/// Marks an answer forwarded without idempotency because the store could not be used
/// (`on_store_error = "pass"`): its retry may run again.
const BYPASSED_HEADER: &str = "idempotency-bypassed";

/// What became of a request: the response, what to count it as, and its key if it had one.
pub(super) struct Answer {
    pub(super) response: Response<Body>,
    pub(super) outcome: Outcome,
    pub(super) key: Option<StoreKey>,
    /// A replay's: the span of the execution whose answer it is.
    pub(super) link: Option<TraceLink>,
}

impl Answer {
    fn problem(p: Problem) -> Self {
        Answer {
            outcome: outcome_of(&p),
            response: p.into_response(),
            key: None,
            link: None,
        }
    }

    fn of(response: Response<Body>, outcome: Outcome) -> Self {
        Answer {
            response,
            outcome,
            key: None,
            link: None,
        }
    }
}

/// How far the phases before the core took a request.
// Moved once, from `admit` to its caller: boxing the keyed variant would allocate for every
// keyed request to save a copy of a few words.
#[allow(clippy::large_enum_variant)]
enum Admitted {
    /// A key, the whole body, and what the client may store: for the core.
    Keyed {
        key: StoreKey,
        body: Received,
        allowance: Allowance,
        /// How to ask the upstream about this key's unknown outcome (`reconcile`); boxed, as
        /// few routes have one.
        lookup: Option<Box<Lookup>>,
        /// The route and the client's key, kept with the record while its outcome is open.
        origin: Arc<Origin>,
        /// The key as versions before issues 42 and 45 derived it, where it differs (see
        /// [`Gateway::older_key`]); empty (no allocation) for nearly every request.
        legacy: Vec<StoreKey>,
    },
    /// No key where none is required: forwarded as it is.
    Unkeyed(Body),
}

impl Gateway {
    pub(super) async fn idempotent(
        &self,
        route: &Arc<Route>,
        req: Request<ClientBody>,
        conn: &Arc<ClientConn>,
    ) -> Answer {
        let (parts, incoming) = req.into_parts();
        match self.admit(route, &parts, incoming).await {
            Err(problem) => Answer::problem(problem),
            Ok(Admitted::Unkeyed(body)) => {
                // Boxed, as every branch a keyed request does not take: an `async fn` holds the
                // futures it awaits inline, so this one would size, and be copied with, every
                // request's (bench/README.md, "Before and after issue 32").
                let response = Box::pin(self.pass_through_route(route, parts, body, conn)).await;
                Answer::of(response, Outcome::Passthrough)
            }
            Ok(Admitted::Keyed {
                key,
                body,
                allowance,
                lookup,
                origin,
                legacy,
            }) => {
                let caller = (allowance, lookup, origin);
                self.keyed(route, parts, body, conn, (key, legacy), caller)
                    .await
            }
        }
    }

    /// Phases `identify`, `read_body` (first when the key lives in the body, as for deliveries
    /// keyed by message or business id, or the body is signed), `verify`, `extract_key`,
    /// `verify_token` (on `client_jwt` routes), then `read_body` once the key is known to be
    /// valid.
    async fn admit(
        &self,
        route: &Route,
        parts: &request::Parts,
        incoming: ClientBody,
    ) -> Result<Admitted, Problem> {
        let config = &route.config;
        let policy = &config.policy;
        let caller = identify(route, &self.metrics, &parts.headers)?;
        let mut body = ReqBody::Unread(incoming);
        if config.key.needs_body() || config.signature.is_some() {
            body = ReqBody::Read(body.read(policy.max_body, &self.budget).await?);
        }
        // The signature is over the bytes sent, checked before anything is decoded; the key is
        // in what they say.
        self.verify(route, &parts.headers, body.raw())?;
        // Only a key in the body needs it decoded before the key is known.
        let content = if config.key.needs_body() {
            body.content(&parts.headers, policy.max_body, &self.budget)?
        } else {
            &[]
        };
        let Some(sent) = extract_key(config, &parts.headers, content)? else {
            return Ok(Admitted::Unkeyed(body.into_body()));
        };
        let (identified, allowance) = match caller {
            Caller::Known(identified, allowance) => (identified, allowance),
            // Boxed: inline, its future (the key set's refetch among it) would size, and be
            // copied with, every keyed request's (bench/README.md, "Before and after issue 42").
            Caller::Token(verifier, token) => {
                Box::pin(self.verify_token(route, verifier, token)).await?
            }
        };
        let key = StoreKey::new(&identified.scope, &config.name, &sent.key);
        let legacy = self.legacy_keys(policy, &identified, &sent, &config.name);
        let lookup = Lookup::of(policy, &sent.sent).map(Box::new);
        // Kept with the record while its outcome is open, for operators to find it by.
        let origin = Origin::new(OriginKind::Route, &config.name, sent.sent);
        let mut body = body.read(policy.max_body, &self.budget).await?;
        body.decode(&parts.headers, policy.max_body, &self.budget)?;
        Ok(Admitted::Keyed {
            key,
            legacy,
            body,
            allowance,
            lookup,
            origin,
        })
    }

    /// Keys stored before this derivation, while one could still be kept: the key the previous
    /// version made of a number or boolean part (issue 45), under this scope and the one before
    /// issue 42 (another header of the list, an `Authorization` scheme spelled otherwise, a
    /// header split over fields), which also derived keys the older way.
    fn legacy_keys(
        &self,
        policy: &Policy,
        identified: &Identified,
        sent: &Sent,
        route: &str,
    ) -> Vec<StoreKey> {
        if (identified.legacy.is_none() && sent.older.is_none()) || !self.legacy.open(policy.ttl) {
            return Vec::new();
        }
        let older = sent.older.as_deref().unwrap_or(&sent.key);
        let mut keys = Vec::with_capacity(2);
        if sent.older.is_some() {
            keys.push(StoreKey::new(&identified.scope, route, older));
        }
        if let Some(scope) = &identified.legacy {
            keys.push(StoreKey::new(scope, route, older));
        }
        keys
    }

    /// A key stored under an older derivation is used where its record answers this request,
    /// so that a retry across the upgrade replays; an extra store read for those requests only,
    /// and only for one `ttl` after start ([`crate::idempotency::legacy`]).
    async fn older_key(
        &self,
        conn: &ClientConn,
        key: StoreKey,
        older: &[StoreKey],
        (check_fingerprint, sought): (bool, &Sought<'_>),
    ) -> Result<StoreKey, Problem> {
        older_stored(&*conn.worker.store, key, older, (check_fingerprint, sought))
            .await
            .map_err(|e| {
                tracing::warn!(error = %e, "a key's older derivation not read; refused");
                match e {
                    StoreError::Unreadable { .. } => Problem::RecordUnreadable,
                    _ => Problem::StoreUnavailable,
                }
            })
    }

    /// Phase `verify_token`: the scope of a verified JWT, or the 401 (503 before the route's
    /// keys are loaded) that ends the request before anything is stored or forwarded.
    async fn verify_token(
        &self,
        route: &Route,
        verifier: &Verifier,
        token: &str,
    ) -> Result<(Identified, Allowance), Problem> {
        match verifier.scope(token).await {
            Ok(scope) => Ok((
                Identified {
                    scope,
                    legacy: None,
                    jwt_like: false,
                },
                allowance(&route.config, &scope, Share::Identified),
            )),
            Err(Rejected::NoKeys) => Err(Problem::ClientKeysUnavailable),
            Err(Rejected::Unverified(why)) => {
                let reason = why.as_str();
                self.metrics.client_unverified(&route.metrics, reason);
                // Never the token: the reason and the route are enough to find the issuer's
                // side of it.
                tracing::info!(route = %route.config.name, reason, "client token not verified");
                Err(Problem::ClientUnverified { reason })
            }
        }
    }

    /// Phase `verify`: a delivery that its sender did not sign claims no key and reaches no
    /// handler.
    fn verify(&self, route: &Route, headers: &HeaderMap, body: &[u8]) -> Result<(), Problem> {
        let Some(sig) = &route.config.signature else {
            return Ok(());
        };
        let checked = signature::verify(sig, headers, body, now_s());
        self.metrics.signature(
            &route.metrics,
            checked.map_or_else(|why| why.as_str(), |()| "verified"),
        );
        checked.map_err(|why| {
            tracing::info!(route = %route.config.name, scheme = sig.scheme.name(), why = why.as_str(), "delivery signature rejected");
            Problem::SignatureRejected { why: why.as_str() }
        })
    }

    /// Phase `fingerprint`, then the core.
    async fn keyed(
        &self,
        route: &Arc<Route>,
        parts: request::Parts,
        body: Received,
        conn: &Arc<ClientConn>,
        (key, legacy): (StoreKey, Vec<StoreKey>),
        (allowance, lookup, origin): (Allowance, Option<Box<Lookup>>, Arc<Origin>),
    ) -> Answer {
        let config = &route.config;
        let rules = rules(config, allowance);
        let Received {
            raw,
            lease,
            decoded,
            ..
        } = body;
        let forward = Forward {
            route: Arc::clone(route),
            parts,
            body: raw,
            conn: Arc::clone(conn),
            metrics: Arc::clone(&self.metrics),
            key,
            _lease: lease,
        };
        let fp = forward.fingerprint(decoded.as_ref().map(|(content, _)| content));
        // Its memory given back before the upstream is waited on.
        drop(decoded);
        let keys = match legacy.is_empty() {
            true => Keys::of(key),
            false => {
                let earlier = || forward.earlier_fingerprint();
                let sought = Sought::new(fp, &earlier);
                let older = self.older_key(conn, key, &legacy, (config.check_fingerprint, &sought));
                match Box::pin(older).await {
                    Ok(chosen) => Keys {
                        key: chosen,
                        instead: (chosen != key).then_some(key),
                    },
                    Err(problem) => return Answer::problem(problem),
                }
            }
        };
        let key = keys.key;
        let mut forward = forward;
        forward.key = key;
        // Boxed: inline, the core's future (several KB) is copied into this one and this one
        // into its caller's at every call.
        let decision = Box::pin(self.core.run(
            &conn.worker.store,
            keys,
            Claim {
                fingerprint: fp,
                origin: Some(origin),
            },
            (rules, lookup.as_deref()),
            forward,
        ))
        .await;
        let mut answer = match decision {
            Decision::Owned { settled, took } => {
                // A lookup is made `after` and `max_clock_skew` past the time it is marked.
                let skew = conn.worker.store.max_clock_skew();
                let lookup_in = lookup.as_ref().map(|l| l.after.saturating_add(skew));
                let mut answer = settled_answer(settled, lookup_in);
                // For the request's log line; extensions never go on the wire.
                answer.response.extensions_mut().insert(UpstreamTime(took));
                answer
            }
            Decision::Replay { response, waited } => Answer {
                link: response.link,
                ..Answer::of(
                    replay(&config.policy, &response),
                    if waited {
                        Outcome::Waited
                    } else {
                        Outcome::Replayed
                    },
                )
            },
            Decision::Refused(refusal) => Answer::problem(refusal_problem(&config.policy, refusal)),
            Decision::Bypass(Forward {
                route, parts, body, ..
            }) => {
                let mut response =
                    Box::pin(self.pass_through_route(&route, parts, body::full(body), conn)).await;
                // The client learns that this answer, and its retry, had no idempotency.
                response
                    .headers_mut()
                    .insert(BYPASSED_HEADER, HeaderValue::from_static("true"));
                Answer::of(response, Outcome::Bypassed)
            }
        };
        answer.key = Some(key);
        answer
    }
}

/// Who a request says it is, before anything is read: a scope, or a token to verify once the
/// request turns out to be keyed.
enum Caller<'a> {
    Known(Identified, Allowance),
    Token(&'a Verifier, &'a str),
}

/// Phase `identify`: whose operation this is, before anything is read or stored; and the quota
/// of records that caller may store.
fn identify<'a>(
    route: &'a Route,
    metrics: &Metrics,
    headers: &'a HeaderMap,
) -> Result<Caller<'a>, Problem> {
    let config = &route.config;
    let policy = &config.policy;
    if let Some(verifier) = &route.jwt {
        if let Some(token) = bearer_token(headers, &verifier.config().header) {
            return Ok(Caller::Token(verifier, token));
        }
        if policy.require_client {
            return Err(Problem::ClientRequired {
                what: format!("a bearer token in the {} header", verifier.config().header),
            });
        }
        return Ok(anonymous(config));
    }
    if config.signature.is_some() {
        return signed_caller(config, headers);
    }
    match ClientScope::identify(headers, &policy.client_headers) {
        Some(identified) => {
            if identified.jwt_like {
                noticed_jwt(route, metrics);
            }
            let allowance = allowance(config, &identified.scope, Share::Identified);
            Ok(Caller::Known(identified, allowance))
        }
        None if policy.require_client => Err(Problem::ClientRequired {
            what: describe_headers(&policy.client_headers),
        }),
        // One scope for every caller by the operator's choice: the store's bounds are its quota.
        None if policy.client_headers.is_empty() => Ok(Caller::Known(
            Identified::of(ClientScope::shared()),
            Allowance {
                quota: None,
                share: Share::Unshared,
            },
        )),
        None => Ok(anonymous(config)),
    }
}

/// The caller of a signed route: its sender, whom the signature names, in one scope whatever
/// client header a delivery carries. Scoped by a header no signature covers, a captured
/// delivery sent again with any `Authorization` would land in a scope of its own and run again.
/// The scope is the one a delivery without a client header always had; a delivery with one is
/// also looked up in that header's scope, where the version before issue 45 stored it, while one
/// could be kept.
fn signed_caller(config: &RouteConfig, headers: &HeaderMap) -> Result<Caller<'static>, Problem> {
    let policy = &config.policy;
    let named = ClientScope::identify(headers, &policy.client_headers);
    if named.is_none() && policy.require_client {
        return Err(Problem::ClientRequired {
            what: describe_headers(&policy.client_headers),
        });
    }
    let (scope, share) = match policy.client_headers.is_empty() {
        true => (ClientScope::shared(), Share::Unshared),
        false => (
            ClientScope::anonymous(),
            Share::Anonymous(policy.anonymous_share),
        ),
    };
    let allowance = match share {
        Share::Unshared => Allowance { quota: None, share },
        _ => allowance(config, &scope, share),
    };
    let identified = Identified {
        scope,
        legacy: named.map(|n| n.scope),
        jwt_like: false,
    };
    Ok(Caller::Known(identified, allowance))
}

/// The one scope of the requests that name no client.
fn anonymous(config: &RouteConfig) -> Caller<'static> {
    let scope = ClientScope::anonymous();
    let share = Share::Anonymous(config.policy.anonymous_share);
    Caller::Known(Identified::of(scope), allowance(config, &scope, share))
}

/// What a caller in `scope` may store.
fn allowance(config: &RouteConfig, scope: &ClientScope, share: Share) -> Allowance {
    let policy = &config.policy;
    let limit = match share {
        Share::Identified => policy.max_keys_per_client,
        Share::Anonymous(_) => policy.max_keys_anonymous,
        Share::Unshared => 0,
    };
    let quota = (limit > 0).then(|| Quota {
        id: QuotaId::new(&config.name, scope),
        limit,
        window: policy.ttl,
    });
    Allowance { quota, share }
}

/// The token in `header`: after a `Bearer` scheme (any case), or the whole value in a header
/// other than `Authorization`. Another scheme (`Basic ...`) is a token that will not verify.
fn bearer_token<'a>(headers: &'a HeaderMap, header: &HeaderName) -> Option<&'a str> {
    // Not visible ASCII: an empty token, which does not verify.
    let value = headers.get(header)?.to_str().unwrap_or("").trim();
    match value.split_once([' ', '\t']) {
        Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") => Some(token.trim()),
        _ => Some(value),
    }
}

/// A route scoped by a header whose values are JWTs: each token refresh is a new scope, and a
/// retry after one executes again. Said once per route in the log, counted always.
fn noticed_jwt(route: &Route, metrics: &Metrics) {
    metrics.jwt_in_client_header(&route.metrics);
    if !route
        .jwt_noticed
        .swap(true, std::sync::atomic::Ordering::Relaxed)
    {
        tracing::warn!(route = %route.config.name, "this route's client_header carries JWTs: every token refresh makes a new client scope, so a retry with a refreshed token executes again; set client_jwt to scope keys by the token's issuer and subject (docs/security.md, \"Client scope\")");
    }
}

/// What a caller may store: its count per window, and its share of the store.
#[derive(Debug, Clone, Copy)]
pub(super) struct Allowance {
    quota: Option<Quota>,
    share: Share,
}

/// What the core applies to a route's operations: its policy, and what the caller may store.
fn rules(config: &RouteConfig, allowance: Allowance) -> Rules {
    Rules {
        quota: allowance.quota,
        share: allowance.share,
        ..Rules::of(&config.policy, config.check_fingerprint)
    }
}

/// Phase `extract_key`: `None` when there is none and none is required.
fn extract_key(
    config: &RouteConfig,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Option<Sent>, Problem> {
    match config.key.extract_sent(headers, body) {
        Ok(Some(k)) => Ok(Some(k)),
        Ok(None) if !config.policy.require_key => Ok(None),
        Ok(None) => Err(Problem::MissingKey {
            what: config.key.describe(),
        }),
        Err(reason) => Err(Problem::InvalidKey {
            what: config.key.describe(),
            reason,
        }),
    }
}

/// The answer to the owner of a key, once the core has settled what its execution means.
/// `lookup_in`: the route's `reconcile` wait, when it has one.
fn settled_answer(settled: Settled<Response<Body>>, lookup_in: Option<Duration>) -> Answer {
    match settled {
        // Not stored: the client still gets the real answer; its retries find the pending
        // record until the store's background write of it lands (Redis, Postgres:
        // `store::complete_later`), then replay it; or, if it never does, an unknown outcome.
        Settled::Stored(r) | Settled::NotStored { output: r, .. } => {
            Answer::of(r, Outcome::Executed)
        }
        Settled::Released(r) => Answer::of(r, Outcome::Released),
        Settled::NotSent(e) => Answer::problem(not_sent_problem(&*e)),
        Settled::Unknown { reason, retryable } => Answer::of(
            Problem::OutcomeUnknown {
                reason,
                retryable,
                lookup_in,
            }
            .into_response(),
            Outcome::Unknown,
        ),
        // The upstream's own answer (a proxy's 502 or 504), passed on as it came.
        Settled::AnsweredUnknown { output, .. } => Answer::of(output, Outcome::Unknown),
    }
}

/// The problem a refusal is answered with.
fn refusal_problem(policy: &Policy, refusal: Refusal) -> Problem {
    match refusal {
        Refusal::KeyReused => Problem::KeyReused {
            status: policy.mismatch_status,
        },
        Refusal::InFlight => Problem::InFlight {
            retry_after: Duration::from_secs(1),
        },
        Refusal::OutcomeUnknown(reason) => Problem::OutcomeUnknown {
            reason,
            retryable: false,
            lookup_in: None,
        },
        // The background asks as soon as a lookup is free.
        Refusal::Reconciling(reason) => Problem::OutcomeUnknown {
            reason,
            retryable: false,
            lookup_in: Some(Duration::ZERO),
        },
        Refusal::LookupDue { reason, due_ms } => Problem::OutcomeUnknown {
            reason,
            retryable: false,
            lookup_in: Some(Duration::from_millis(due_ms.saturating_sub(now_ms()))),
        },
        Refusal::StoreUnavailable => Problem::StoreUnavailable,
        Refusal::StoreFull => Problem::StoreFull,
        Refusal::Unreadable => Problem::RecordUnreadable,
        Refusal::OverQuota { retry_after } => Problem::KeyQuota { retry_after },
    }
}

/// What a response the gateway made itself counts as.
pub(super) fn outcome_of(p: &Problem) -> Outcome {
    match p {
        Problem::MissingKey { .. } => Outcome::MissingKey,
        Problem::InvalidKey { .. } => Outcome::InvalidKey,
        Problem::KeyReused { .. } => Outcome::Mismatch,
        Problem::InFlight { .. } => Outcome::InFlightRejected,
        Problem::BodyTooLarge { .. } => Outcome::TooLarge,
        Problem::BadRequestBody
        | Problem::UnsupportedEncoding { .. }
        | Problem::UndecodableBody { .. }
        | Problem::InvalidMethodOverride
        | Problem::BodyTimeout
        | Problem::MethodNotAllowed
        | Problem::GuardedPath { .. }
        | Problem::ClientRequired { .. }
        | Problem::ClientUnverified { .. }
        | Problem::SignatureRejected { .. }
        | Problem::UpgradeRefused
        // Never made on the traffic port.
        | Problem::Operator { .. } => Outcome::BadRequest,
        Problem::StoreUnavailable | Problem::StoreFull | Problem::RecordUnreadable => {
            Outcome::StoreError
        }
        Problem::KeyQuota { .. } | Problem::Overloaded { .. } | Problem::ClientKeysUnavailable => {
            Outcome::Limited
        }
        Problem::UpstreamUnreachable | Problem::UpstreamTimeout | Problem::UpstreamFailed => {
            Outcome::UpstreamError
        }
        Problem::OutcomeUnknown { .. } => Outcome::Unknown,
    }
}

/// "the Authorization header", "the Authorization or Cookie header".
fn describe_headers(names: &[http::HeaderName]) -> String {
    let names: Vec<&str> = names.iter().map(http::HeaderName::as_str).collect();
    format!("the {} header", names.join(" or "))
}

/// Seconds since the Unix epoch, for signed timestamps (0 if the clock is before 1970).
fn now_s() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}
