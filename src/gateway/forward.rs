//! Executing a request on an idempotent route (send it upstream and capture the answer within
//! `upstream_timeout`), replaying a stored answer, and what an upstream's failure is to a client.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, request, HeaderValue, Method, Request, Response};
use tokio::time::Instant;

use super::method_override::Overridden;
use super::{ClientConn, Route};
use crate::body::{self, Body, Captured, Lease};
use crate::config::{Policy, UpstreamProtocol};
use crate::fingerprint::{earlier_fingerprint, fingerprint, Fingerprint, RequestParts};
use crate::grpc;
use crate::idempotency::{Attempt, Execute};
use crate::key::StoreKey;
use crate::metrics::Metrics;
use crate::problem::Problem;
use crate::store::{StoredResponse, UnknownReason};
use crate::telemetry::span::Trace;
use crate::upstream::{
    prepare_request, whole, CloseDelimited, NoConnectionSlot, UpstreamBody, UpstreamError,
    UpstreamPool,
};

/// Header on a replay whose body was too large to keep: the body is deliberately empty.
const BODY_OMITTED_HEADER: &str = "idemgate-body-omitted";

#[derive(Clone, Copy)]
pub(super) struct UpstreamTime(pub(super) Duration);

/// How the core executes a request on an idempotent route: forward it and capture the answer,
/// all within `upstream_timeout`.
pub(super) struct Forward {
    pub(super) route: Arc<Route>,
    pub(super) parts: request::Parts,
    pub(super) body: Bytes,
    pub(super) conn: Arc<ClientConn>,
    /// Upstream time is counted here, inside the execution, so it is counted too when the
    /// execution finishes on its own after its client left.
    pub(super) metrics: Arc<Metrics>,
    /// For the log, should the request not even be made.
    pub(super) key: StoreKey,
    /// The request body's share of `server.max_buffered`, held until the execution is over.
    pub(super) _lease: Lease,
}

impl Forward {
    /// The request's fingerprint: of the method it was routed as (a POST's override) and of
    /// its `content` (`None`: the body as sent).
    pub(super) fn fingerprint(&self, content: Option<&Bytes>) -> Fingerprint {
        let method =
            (self.parts.extensions.get::<Overridden>()).map_or(&self.parts.method, |o| &o.0);
        let parts = self.fingerprinted(method, content.unwrap_or(&self.body));
        fingerprint(&parts, &self.route.config.fingerprint_ignore)
    }

    /// What a fingerprint is computed over: the request with `method` and `body`.
    fn fingerprinted<'a>(&'a self, method: &'a Method, body: &'a [u8]) -> RequestParts<'a> {
        let config = &self.route.config;
        RequestParts {
            method,
            route: &config.name,
            path: self.parts.uri.path(),
            query: self.parts.uri.query(),
            headers: &self.parts.headers,
            identity: &config.policy.fingerprint_headers,
            authority: self.parts.uri.authority().map(|a| a.as_str()),
            body,
        }
    }
}

impl Execute for Forward {
    type Output = Response<Body>;

    /// As the previous version computed it: of the method and the bytes as sent.
    fn earlier_fingerprint(&self) -> Option<Fingerprint> {
        let parts = self.fingerprinted(&self.parts.method, &self.body);
        earlier_fingerprint(&parts, &self.route.config.fingerprint_ignore)
    }

    fn trace(&self) -> Option<&Trace> {
        self.parts.extensions.get::<Trace>()
    }

    async fn execute(mut self) -> Attempt<Response<Body>> {
        let call = super::spans::upstream_call(&mut self.parts, &self.route.config.upstream);
        let mut attempt = self.send().await;
        if let Some(call) = call {
            super::spans::end_upstream_call(call, &mut attempt);
        }
        attempt
    }
}

impl Forward {
    /// Sends the request upstream once and captures the answer.
    async fn send(self) -> Attempt<Response<Body>> {
        let Forward {
            route,
            mut parts,
            body,
            conn,
            metrics,
            key,
            _lease,
        } = self;
        let policy = &route.config.policy;
        if let Err(e) = prepare_request(&mut parts, &route.config.upstream, &conn.addr) {
            tracing::error!(key = key.short(), error = %e, "cannot build upstream request");
            return Attempt::NotSent(Box::new(e));
        }
        let req = Request::from_parts(parts, body::full(body));
        let started = Instant::now();
        let forwarded = forward_and_capture(
            &conn.worker.upstream,
            req,
            route.config.upstream.protocol,
            policy,
        )
        .await;
        metrics.upstream(&route.metrics, started.elapsed());
        let forwarded = match forwarded {
            Ok(f) => f,
            Err(UpstreamError::NotSent(e)) => return Attempt::NotSent(e),
            Err(e) => {
                let reason = match e {
                    UpstreamError::Timeout(_) => UnknownReason::Timeout,
                    _ => UnknownReason::Interrupted,
                };
                return Attempt::Unknown {
                    reason,
                    error: Box::new(e),
                };
            }
        };
        // An answer whose end cannot be told from a cut connection (HTTP/1.1 with neither
        // Content-Length nor chunked framing): its status and headers are what it said, and it is
        // stored as such, its body never kept as the whole answer (replays say so).
        let unframed = forwarded.head.extensions.get::<CloseDelimited>().is_some();
        let kept = matches!(forwarded.body, ForwardedBody::Complete(..)) && !unframed;
        let response = StoredResponse {
            status: forwarded.head.status,
            headers: forwarded
                .head
                .headers
                .iter()
                .map(|(n, v)| (n.clone(), v.clone()))
                .collect(),
            trailers: match &forwarded.body {
                ForwardedBody::Complete(_, Some(t)) => {
                    t.iter().map(|(n, v)| (n.clone(), v.clone())).collect()
                }
                _ => Vec::new(),
            },
            body: match &forwarded.body {
                ForwardedBody::Complete(b, _) if kept => b.clone(),
                _ => Bytes::new(),
            },
            body_kept: kept,
            completed_ms: 0,
            link: None,
        };
        if grpc::ended_without_status(&response) {
            return Attempt::Unknown {
                reason: UnknownReason::Interrupted,
                error: "the gRPC answer ended without a grpc-status".into(),
            };
        }
        // The upstream's own framing headers still hold: the body is the same bytes.
        let output = Response::from_parts(
            forwarded.head,
            match forwarded.body {
                ForwardedBody::Complete(b, trailers) => body::with_trailers(b, trailers),
                ForwardedBody::Streaming { head, rest } => body::prepend(head, rest),
            },
        );
        Attempt::Answered {
            status: grpc::effective_status(&response),
            response,
            output,
        }
    }
}

/// Upstream's answer to the owner.
struct Forwarded {
    head: http::response::Parts,
    body: ForwardedBody,
}

enum ForwardedBody {
    /// Within `max_stored_response`: stored and sent as one, with its trailers (gRPC's status).
    Complete(Bytes, Option<http::HeaderMap>),
    /// Too large to store: streamed to the client, replays carry status and headers only.
    Streaming {
        head: Vec<Bytes>,
        rest: UpstreamBody,
    },
}

/// Sends the request and reads the response, all within `upstream_timeout`.
async fn forward_and_capture(
    upstream: &UpstreamPool,
    req: Request<Body>,
    protocol: UpstreamProtocol,
    policy: &Policy,
) -> Result<Forwarded, UpstreamError> {
    let head_request = req.method() == http::Method::HEAD;
    let exchange = async {
        let (head, body) = upstream.exchange(req, protocol).await?.into_parts();
        let captured = body::capture(body, policy.max_stored_response)
            .await
            // A body cut off mid-way: the upstream ran, but we do not know what it said.
            .map_err(|e| UpstreamError::Failed(Box::new(e)))?;
        let body = match captured {
            Captured::Complete(b, trailers) => {
                if !head_request {
                    whole(&head, b.len())?;
                }
                ForwardedBody::Complete(b, trailers)
            }
            // Streamed on: what the client gets is the upstream's own framing.
            Captured::TooLarge { head, rest } => ForwardedBody::Streaming { head, rest },
        };
        Ok(Forwarded { head, body })
    };
    tokio::time::timeout(policy.upstream_timeout, exchange)
        .await
        .unwrap_or(Err(UpstreamError::Timeout(policy.upstream_timeout)))
}

/// The stored response, byte for byte (trailers too), marked as a replay.
pub(super) fn replay(policy: &Policy, stored: &StoredResponse) -> Response<Body> {
    let trailers = (!stored.trailers.is_empty()).then(|| {
        let mut t = http::HeaderMap::with_capacity(stored.trailers.len());
        for (name, value) in &stored.trailers {
            t.append(name.clone(), value.clone());
        }
        t
    });
    let mut resp = Response::new(body::with_trailers(stored.body.clone(), trailers));
    *resp.status_mut() = stored.status;
    let headers = resp.headers_mut();
    for (name, value) in &stored.headers {
        headers.append(name.clone(), value.clone());
    }
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(stored.body.len()));
    if !stored.body_kept {
        headers.insert(BODY_OMITTED_HEADER, HeaderValue::from_static("true"));
    }
    headers.insert(
        policy.replay_header.clone(),
        HeaderValue::from_static("true"),
    );
    resp
}

/// Why a request was not sent: the upstream's connection cap, or the upstream unreachable.
pub(super) fn not_sent_problem(e: &(dyn std::error::Error + 'static)) -> Problem {
    if e.is::<NoConnectionSlot>() {
        Problem::Overloaded {
            what: "connections to the upstream",
        }
    } else {
        Problem::UpstreamUnreachable
    }
}

/// What a client gets when its request, not made idempotent, did not get an answer.
pub(super) fn upstream_problem(e: UpstreamError) -> Problem {
    match e {
        UpstreamError::NotSent(e) => not_sent_problem(&*e),
        UpstreamError::Timeout(_) => Problem::UpstreamTimeout,
        UpstreamError::Failed(_) => Problem::UpstreamFailed,
    }
}
