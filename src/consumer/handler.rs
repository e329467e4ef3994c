//! Phase `execute` for a message: one POST to the consumer's handler, its answer read in full
//! (within `max_stored_response`) and stored like an HTTP route's.

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Method, Request, Uri};

use crate::body::{self, Captured};
use crate::config::{Policy, UpstreamUrl};
use crate::fingerprint::{earlier_fingerprint, Fingerprint, IgnoredFields, RequestParts};
use crate::idempotency::{Attempt, Execute};
use crate::store::{StoredResponse, UnknownReason};
use crate::telemetry::span::Trace;
use crate::upstream::{whole, CloseDelimited, UpstreamError, UpstreamPool};

use super::spans;

/// One message's call to the handler.
pub struct HandlerCall {
    /// The consumer's name, part of the message's fingerprint as a route's name is.
    pub consumer: String,
    pub pool: UpstreamPool,
    pub handler: UpstreamUrl,
    pub policy: Policy,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// The attempt's span, when traced: the handler's call is its child.
    pub trace: Option<Trace>,
}

impl HandlerCall {
    /// What the message's fingerprint is computed over: a POST of its body to the handler's
    /// path, with the consumer's `content_type`; a message's fields are not part of it.
    pub fn fingerprinted(&self) -> RequestParts<'_> {
        RequestParts {
            method: &Method::POST,
            route: &self.consumer,
            path: &self.handler.prefix,
            query: None,
            headers: &self.headers,
            identity: &[],
            authority: None,
            body: &self.body,
        }
    }

    fn request(&self) -> Result<Request<body::Body>, http::Error> {
        let scheme = if self.handler.tls { "https" } else { "http" };
        let path = if self.handler.prefix.is_empty() {
            "/"
        } else {
            self.handler.prefix.as_str()
        };
        let uri = Uri::builder()
            .scheme(scheme)
            .authority(self.handler.authority.clone())
            .path_and_query(path)
            .build()?;
        let mut req = Request::builder()
            .method(Method::POST)
            .uri(uri)
            .body(body::full(self.body.clone()))?;
        *req.headers_mut() = self.headers.clone();
        if let Ok(host) = HeaderValue::from_str(self.handler.authority.as_str()) {
            req.headers_mut().insert(header::HOST, host);
        }
        Ok(req)
    }
}

impl Execute for HandlerCall {
    /// The handler's status.
    type Output = u16;

    fn earlier_fingerprint(&self) -> Option<Fingerprint> {
        earlier_fingerprint(&self.fingerprinted(), &IgnoredFields::default())
    }

    fn trace(&self) -> Option<&Trace> {
        self.trace.as_ref()
    }

    async fn execute(mut self) -> Attempt<u16> {
        let Some(trace) = self.trace.take() else {
            return self.call().await;
        };
        let (call, link) = spans::handler_call(&trace, &mut self.headers);
        let mut attempt = self.call().await;
        attempt.end_span(&call, link);
        attempt
    }
}

impl HandlerCall {
    /// The POST, once, and its answer.
    async fn call(self) -> Attempt<u16> {
        let req = match self.request() {
            Ok(r) => r,
            Err(e) => return Attempt::NotSent(Box::new(e)),
        };
        let timeout = self.policy.upstream_timeout;
        let exchange = async {
            let (head, body) = self
                .pool
                .exchange(req, self.handler.protocol)
                .await?
                .into_parts();
            let captured = body::capture(body, self.policy.max_stored_response)
                .await
                .map_err(|e| UpstreamError::Failed(Box::new(e)))?;
            if let Captured::Complete(b, _) = &captured {
                whole(&head, b.len())?;
            }
            Ok::<_, UpstreamError>((head, captured))
        };
        let (head, captured) = match tokio::time::timeout(timeout, exchange).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(UpstreamError::NotSent(e))) => return Attempt::NotSent(e),
            Ok(Err(e)) => {
                return Attempt::Unknown {
                    reason: UnknownReason::Interrupted,
                    error: Box::new(e),
                }
            }
            Err(_) => {
                return Attempt::Unknown {
                    reason: UnknownReason::Timeout,
                    error: format!("the handler did not answer within {timeout:?}").into(),
                }
            }
        };
        let status = head.status.as_u16();
        // An answer whose end cannot be told from a cut connection: its status and headers are
        // what it said; its body is never kept as the whole answer.
        let unframed = head.extensions.get::<CloseDelimited>().is_some();
        let (body, body_kept) = match captured {
            Captured::Complete(_, _) if unframed => (Bytes::new(), false),
            Captured::Complete(b, _) => (b, true),
            // Too large to keep: it ran, and a duplicate gets the status alone.
            Captured::TooLarge { .. } => (Bytes::new(), false),
        };
        let response = StoredResponse {
            status: head.status,
            headers: head
                .headers
                .iter()
                .map(|(n, v)| (n.clone(), v.clone()))
                .collect(),
            trailers: Vec::new(),
            body,
            body_kept,
            completed_ms: 0,
            link: None,
        };
        Attempt::Answered {
            // A gRPC handler's answer is judged by its grpc-status, as on a route.
            status: crate::grpc::effective_status(&response),
            response,
            output: status,
        }
    }
}
