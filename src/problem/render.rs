//! A [`Problem`] as its client gets it: the status; the body, RFC 9457 problem+json or the
//! route's `error_body`; and the headers that tell an SDK whether and when to retry
//! (`retry_hint_headers`, `Retry-After`, `retry-after-ms`). A gRPC client gets a status instead.

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderName, HeaderValue, Response};

use super::{Hint, Problem, ProblemJson, TYPE_BASE};
use crate::body::{self, Body};
use crate::config::answers::{Answers, Fields, DEFAULT_HINT};
use crate::grpc;

/// The Stainless SDKs' precise `Retry-After`, read before it.
const RETRY_AFTER_MS: HeaderName = HeaderName::from_static("retry-after-ms");

/// What [`Problem::into_response`] says when no config says otherwise.
const BUILTIN_HINTS: [HeaderName; 1] = [DEFAULT_HINT];

/// The headers rendering sets: the ones a restyled answer takes afresh.
const RENDERED: [HeaderName; 6] = [
    header::CONTENT_TYPE,
    header::CACHE_CONTROL,
    header::RETRY_AFTER,
    RETRY_AFTER_MS,
    header::ALLOW,
    header::ACCEPT_ENCODING,
];

impl Problem {
    /// The wait a retry needs without hints: the `Retry-After` of every version, and gRPC's
    /// pushback.
    fn retry_after(&self) -> Option<Duration> {
        match self {
            Problem::InFlight { retry_after } => Some(*retry_after),
            Problem::KeyQuota { retry_after } => Some(*retry_after),
            Problem::StoreUnavailable
            | Problem::StoreFull
            | Problem::Overloaded { .. }
            | Problem::ClientKeysUnavailable => Some(Duration::from_secs(1)),
            _ => None,
        }
    }

    /// The problem+json response with the built-in hint (`x-should-retry`); a route's own
    /// [`Answers`] are applied by [`restyle`].
    pub fn into_response(self) -> Response<Body> {
        self.render(&BUILTIN_HINTS, None)
    }

    fn render(
        self,
        hints: &[HeaderName],
        error_body: Option<&crate::config::answers::ErrorBody>,
    ) -> Response<Body> {
        let status = self.status();
        let kind = format!("{TYPE_BASE}{}", self.slug());
        let detail = self.detail();
        let (bytes, content_type) = match error_body {
            None => {
                let json = ProblemJson {
                    kind,
                    title: self.title(),
                    status: status.as_u16(),
                    detail,
                };
                let bytes = serde_json::to_vec(&json).unwrap_or_default();
                (bytes, HeaderValue::from_static("application/problem+json"))
            }
            Some(shape) => {
                let fields = Fields {
                    code: self.slug(),
                    type_uri: &kind,
                    title: self.title(),
                    detail: &detail,
                    status: status.as_u16(),
                };
                (shape.render(&fields), shape.content_type.clone())
            }
        };
        let mut resp = Response::new(body::full(Bytes::from(bytes)));
        *resp.status_mut() = status;
        let h = resp.headers_mut();
        h.insert(header::CONTENT_TYPE, content_type);
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        self.hint_headers(hints, h);
        if let Problem::GuardedPath { allow } = &self {
            if let Ok(allow) = HeaderValue::from_str(allow) {
                h.insert(header::ALLOW, allow);
            }
        }
        if let Problem::UnsupportedEncoding { accepted, .. } = self {
            // RFC 9110, 12.5.3: what a 415 for a content coding lists.
            h.insert(header::ACCEPT_ENCODING, HeaderValue::from_static(accepted));
        }
        if let Problem::ClientUnverified { .. } = self {
            // RFC 6750 section 3.1: what OAuth clients read to refresh their token.
            h.insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer error=\"invalid_token\""),
            );
        }
        // Kept beside the response, for [`restyle`] and [`super::for_grpc`]; extensions never
        // go on the wire.
        resp.extensions_mut().insert(self);
        resp
    }

    /// `Retry-After`, then each hint header and `retry-after-ms`. With no hint headers,
    /// `Retry-After` as every version sent it.
    fn hint_headers(&self, hints: &[HeaderName], h: &mut HeaderMap) {
        if hints.is_empty() {
            if let Some(after) = self.retry_after() {
                h.insert(header::RETRY_AFTER, seconds(after));
            }
            return;
        }
        let hint = self.hint();
        if let Hint::Retry(after) = hint {
            h.insert(header::RETRY_AFTER, seconds(after));
        }
        let said = match hint {
            Hint::Retry(_) => HeaderValue::from_static("true"),
            Hint::Final => HeaderValue::from_static("false"),
            Hint::Unsaid => return,
        };
        for name in hints {
            h.insert(name.clone(), said.clone());
        }
        if let Hint::Retry(after) = hint {
            let ms = u64::try_from(after.as_millis()).unwrap_or(u64::MAX);
            h.insert(RETRY_AFTER_MS, HeaderValue::from(ms));
        }
    }

    /// The Trailers-Only gRPC answer: the code, and `title: detail` as the message.
    pub(super) fn into_grpc_response(self) -> Response<Body> {
        let message = format!("{}: {}", self.title(), self.detail());
        let pushback = self
            .retry_after()
            .map(|after| u64::try_from(after.as_millis()).unwrap_or(u64::MAX));
        grpc::trailers_only(self.grpc_code(), &message, pushback).map(|()| body::full(Bytes::new()))
    }
}

/// Whole seconds, rounded up: a client that waits exactly this long must find the way clear.
fn seconds(after: Duration) -> HeaderValue {
    HeaderValue::from(after.as_millis().div_ceil(1000).max(1) as u64)
}

/// A response in the way `answers` says: the gateway's own answer (the one with its
/// [`Problem`] beside it) made again with the route's hint headers and body; anything else
/// (the upstream's answer, a replay) as it is. Costs one flag test where nothing is configured.
#[inline]
pub fn restyle(resp: Response<Body>, answers: &Answers) -> Response<Body> {
    match answers.is_builtin() {
        true => resp,
        false => restyled(resp, answers),
    }
}

/// Marks an answer already made in a route's way: the first way stands (a second would leave
/// the first's hint names beside its own).
#[derive(Clone, Copy)]
struct Restyled;

fn restyled(resp: Response<Body>, answers: &Answers) -> Response<Body> {
    let (mut parts, body) = resp.into_parts();
    if parts.extensions.get::<Restyled>().is_some() {
        return Response::from_parts(parts, body);
    }
    let Some(problem) = parts.extensions.remove::<Problem>() else {
        return Response::from_parts(parts, body);
    };
    let fresh = problem.render(answers.hints(), answers.error_body());
    let (fresh_parts, fresh_body) = fresh.into_parts();
    // Whatever was added after rendering (by a phase, not by it) stays.
    let mut headers = std::mem::take(&mut parts.headers);
    for name in RENDERED
        .iter()
        .chain(&[DEFAULT_HINT, header::WWW_AUTHENTICATE])
    {
        headers.remove(name);
    }
    for (name, value) in &fresh_parts.headers {
        headers.append(name.clone(), value.clone());
    }
    parts.headers = headers;
    parts.extensions.extend(fresh_parts.extensions);
    parts.extensions.insert(Restyled);
    Response::from_parts(parts, fresh_body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::answers::ErrorBody;
    use crate::store::UnknownReason;
    use http_body_util::BodyExt;
    use std::sync::Arc;

    const STRIPE: &str =
        r#"{"error": {"type": "idempotency_error", "code": "{code}", "message": "{detail}"}}"#;

    fn answers(hints: &[&'static str], template: Option<&str>) -> Answers {
        let mut a = Answers::builtin();
        a.with_hints(hints.iter().map(|h| HeaderName::from_static(h)).collect());
        a.with_error_body(
            template.map(|t| Arc::new(ErrorBody::parse("application/json", t).unwrap())),
        );
        a
    }

    fn names(resp: &Response<Body>) -> Vec<String> {
        resp.headers()
            .keys()
            .map(|n| n.as_str().to_string())
            .collect()
    }

    #[test]
    fn the_builtin_answer_is_the_old_one_and_one_hint_header() {
        let in_flight = Problem::InFlight {
            retry_after: Duration::from_millis(1500),
        }
        .into_response();
        assert_eq!(
            names(&in_flight),
            [
                "content-type",
                "cache-control",
                "retry-after",
                "x-should-retry",
                "retry-after-ms"
            ]
        );
        assert_eq!(in_flight.headers()["retry-after"], "2");
        assert_eq!(in_flight.headers()["x-should-retry"], "true");
        assert_eq!(in_flight.headers()["retry-after-ms"], "1500");
        let reused = Problem::KeyReused {
            status: http::StatusCode::CONFLICT,
        }
        .into_response();
        assert_eq!(
            names(&reused),
            ["content-type", "cache-control", "x-should-retry"]
        );
        assert_eq!(reused.headers()["x-should-retry"], "false");
        // A pass-through request's upstream failure: the client's own rules, no hint.
        let failed = Problem::UpstreamFailed.into_response();
        assert_eq!(names(&failed), ["content-type", "cache-control"]);
    }

    #[test]
    fn no_hint_headers_is_every_earlier_version_s_answer() {
        let none = answers(&[], None);
        for (problem, expected) in [
            (
                Problem::UpstreamUnreachable,
                vec!["content-type", "cache-control"],
            ),
            (
                Problem::StoreUnavailable,
                vec!["content-type", "cache-control", "retry-after"],
            ),
            (
                Problem::OutcomeUnknown {
                    reason: UnknownReason::Timeout,
                    retryable: false,
                    lookup_in: Some(Duration::from_secs(30)),
                },
                vec!["content-type", "cache-control"],
            ),
        ] {
            let resp = restyle(problem.into_response(), &none);
            assert_eq!(names(&resp), expected);
        }
    }

    #[tokio::test]
    async fn a_route_s_answers_replace_the_body_and_the_hints_and_keep_the_rest() {
        let stripe = answers(&["x-should-retry", "stripe-should-retry"], Some(STRIPE));
        let mut resp = Problem::KeyReused {
            status: http::StatusCode::BAD_REQUEST,
        }
        .into_response();
        resp.headers_mut()
            .insert("x-request-id", HeaderValue::from_static("r1"));
        let resp = restyle(resp, &stripe);
        assert_eq!(resp.status(), 400);
        let h = resp.headers();
        assert_eq!(h["content-type"], "application/json");
        assert_eq!(h["stripe-should-retry"], "false");
        assert_eq!(h["x-should-retry"], "false");
        assert_eq!(h["x-request-id"], "r1");
        assert!(
            resp.extensions().get::<Problem>().is_some(),
            "kept for gRPC"
        );
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["type"], "idempotency_error");
        assert_eq!(v["error"]["code"], "key-reused");
        assert!(v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("different request"));
        // Made in one route's way, an answer is not made again in another's.
        let again = restyle(
            restyle(Problem::StoreUnavailable.into_response(), &stripe),
            &answers(&["x-should-retry", "other-should-retry"], None),
        );
        assert_eq!(
            again
                .headers()
                .get_all("stripe-should-retry")
                .iter()
                .count(),
            1
        );
        assert!(again.headers().get("other-should-retry").is_none());
        assert_eq!(again.headers()["content-type"], "application/json");
        // The upstream's own answers are never touched.
        let upstream = Response::new(body::full(Bytes::from_static(b"{}")));
        assert_eq!(names(&restyle(upstream, &stripe)).len(), 0);
    }

    #[test]
    fn an_unknown_outcome_a_lookup_settles_never_says_to_use_a_new_key() {
        let unknown = |lookup_in| {
            Problem::OutcomeUnknown {
                reason: UnknownReason::Timeout,
                retryable: false,
                lookup_in,
            }
            .detail()
        };
        let settled = unknown(Some(Duration::from_millis(300)));
        assert!(
            settled.contains("retry with the same key, not a new one, in 1 seconds"),
            "{settled}"
        );
        let operator = unknown(None);
        assert!(
            operator.contains("before retrying with a new key"),
            "{operator}"
        );
    }

    #[test]
    fn an_unknown_outcome_says_retry_only_where_a_retry_can_learn_it() {
        let unknown = |retryable, lookup_in| Problem::OutcomeUnknown {
            reason: UnknownReason::Interrupted,
            retryable,
            lookup_in,
        };
        assert_eq!(unknown(false, None).hint(), Hint::Final);
        assert_eq!(
            unknown(false, Some(Duration::from_secs(30))).hint(),
            Hint::Retry(Duration::from_secs(30))
        );
        // Due now: still a second, so no SDK retries at once in a tight loop.
        assert_eq!(
            unknown(false, Some(Duration::ZERO)).hint(),
            Hint::Retry(Duration::from_secs(1))
        );
        assert_eq!(
            unknown(true, None).hint(),
            Hint::Retry(Duration::from_secs(1))
        );
        let resp = unknown(false, Some(Duration::from_millis(12_300))).into_response();
        assert_eq!(resp.headers()["retry-after"], "13");
        assert_eq!(resp.headers()["retry-after-ms"], "12300");
    }
}

#[cfg(test)]
mod documented {
    use super::*;
    use crate::key::KeyError;
    use crate::store::UnknownReason;

    /// One of each type (every way an unknown outcome can be), and its hint as the table of
    /// docs/problems.md says it.
    #[test]
    fn every_type_s_hint_is_the_documented_one() {
        let docs = include_str!("../../docs/problems.md");
        let unknown = |retryable, lookup_in| Problem::OutcomeUnknown {
            reason: UnknownReason::Timeout,
            retryable,
            lookup_in,
        };
        let all = [
            Problem::MissingKey { what: "k".into() },
            Problem::InvalidKey {
                what: "k".into(),
                reason: KeyError::Empty,
            },
            Problem::KeyReused {
                status: http::StatusCode::CONFLICT,
            },
            Problem::InFlight {
                retry_after: Duration::from_secs(1),
            },
            Problem::BodyTooLarge {
                limit: 1,
                decoded: false,
            },
            Problem::UnsupportedEncoding {
                what: "x".into(),
                accepted: "gzip",
            },
            Problem::InvalidMethodOverride,
            Problem::UndecodableBody { what: "x" },
            Problem::BadRequestBody,
            Problem::BodyTimeout,
            Problem::MethodNotAllowed,
            Problem::GuardedPath {
                allow: "POST".into(),
            },
            Problem::UpgradeRefused,
            Problem::SignatureRejected { why: "invalid" },
            Problem::ClientRequired { what: "x".into() },
            Problem::ClientUnverified { reason: "expired" },
            Problem::ClientKeysUnavailable,
            Problem::StoreUnavailable,
            Problem::StoreFull,
            Problem::RecordUnreadable,
            Problem::KeyQuota {
                retry_after: Duration::from_secs(60),
            },
            Problem::Overloaded { what: "memory" },
            Problem::UpstreamUnreachable,
            Problem::UpstreamTimeout,
            Problem::UpstreamFailed,
            unknown(false, None),
            unknown(true, None),
            unknown(false, Some(Duration::from_secs(5))),
        ];
        for problem in all {
            let row = docs
                .lines()
                .find(|l| l.starts_with(&format!("| `{}` |", problem.slug())))
                .unwrap_or_else(|| panic!("no row for {}", problem.slug()));
            let cell = row.split(" | ").nth(3).unwrap();
            let said = match problem.hint() {
                Hint::Retry(_) => "`true`",
                Hint::Final => "`false`",
                Hint::Unsaid => "none",
            };
            assert!(
                cell.contains(said),
                "{}: {cell:?} should say {said}",
                problem.slug()
            );
        }
    }
}
