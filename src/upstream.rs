//! The upstream side: one pooled HTTP/1.1 client, request rewriting, and failure classification.
//!
//! Failures are sorted by what they mean for idempotency: [`UpstreamError::NotSent`] (the
//! connection was never made, so the request certainly did not run and the key can be released)
//! versus [`UpstreamError::Failed`] and [`UpstreamError::Timeout`] (the request may have reached
//! the upstream, so the outcome is unknown).

use std::net::SocketAddr;
use std::time::Duration;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{request, Request, Response, Uri, Version};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::body::{Body, BoxError};
use crate::config::UpstreamUrl;

/// How long establishing a TCP connection to the upstream may take at most.
pub const MAX_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// No connection could be made: the request was certainly not sent.
    #[error("upstream not reached: {0}")]
    NotSent(BoxError),
    /// The exchange failed after the connection was made: the request may have been executed.
    #[error("upstream exchange failed: {0}")]
    Failed(BoxError),
    /// No response head within the timeout: the request may have been executed.
    #[error("upstream did not answer within {0:?}")]
    Timeout(Duration),
}

/// The shared, pooled client.
#[derive(Clone)]
pub struct UpstreamClient {
    client: Client<HttpConnector, Body>,
}

impl UpstreamClient {
    /// `connect_timeout` is capped at [`MAX_CONNECT_TIMEOUT`].
    pub fn new(connect_timeout: Duration) -> Self {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_connect_timeout(Some(connect_timeout.min(MAX_CONNECT_TIMEOUT)));
        http.enforce_http(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(256)
            .build(http);
        UpstreamClient { client }
    }

    /// Sends `req` and waits for the response head for at most `timeout`.
    pub async fn send(
        &self,
        req: Request<Body>,
        timeout: Duration,
    ) -> Result<Response<Incoming>, UpstreamError> {
        match tokio::time::timeout(timeout, self.client.request(req)).await {
            Err(_) => Err(UpstreamError::Timeout(timeout)),
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) if e.is_connect() => Err(UpstreamError::NotSent(e.into())),
            Ok(Err(e)) => Err(UpstreamError::Failed(e.into())),
        }
    }
}

/// Rewrites the client's request head for the upstream: target URI, HTTP/1.1, hop-by-hop headers
/// removed (RFC 9110 7.6.1) and `X-Forwarded-For/-Proto/-Host` set as a reverse proxy does.
///
/// The original `Host` is kept, so the upstream sees the name the client used; an existing
/// `X-Forwarded-Proto`/`-Host` (from a load balancer in front) is kept too, and the client's
/// address is appended to `X-Forwarded-For`.
pub fn prepare_request(
    parts: &mut request::Parts,
    target: &UpstreamUrl,
    peer: SocketAddr,
) -> Result<(), http::Error> {
    let original_authority = parts.uri.authority().cloned();
    let path_and_query = parts
        .uri
        .path_and_query()
        .map(|pq| pq.as_str())
        .unwrap_or("/");
    let uri = Uri::builder()
        .scheme("http")
        .authority(target.authority.clone())
        .path_and_query(format!("{}{}", target.prefix, path_and_query))
        .build()?;
    parts.uri = uri;
    parts.version = Version::HTTP_11;

    let headers = &mut parts.headers;
    strip_hop_by_hop(headers);
    if !headers.contains_key(header::HOST) {
        // HTTP/2 clients send :authority instead of Host.
        if let Some(a) = &original_authority {
            if let Ok(v) = HeaderValue::from_str(a.as_str()) {
                headers.insert(header::HOST, v);
            }
        }
    }
    let client_ip = peer.ip().to_string();
    let xff = HeaderName::from_static("x-forwarded-for");
    let forwarded_for = match headers.get(&xff).and_then(|v| v.to_str().ok()) {
        Some(prior) => format!("{prior}, {client_ip}"),
        None => client_ip,
    };
    if let Ok(v) = HeaderValue::from_str(&forwarded_for) {
        headers.insert(xff, v);
    }
    let proto = HeaderName::from_static("x-forwarded-proto");
    if !headers.contains_key(&proto) {
        headers.insert(proto, HeaderValue::from_static("http"));
    }
    let fwd_host = HeaderName::from_static("x-forwarded-host");
    if !headers.contains_key(&fwd_host) {
        if let Some(host) = headers.get(header::HOST).cloned() {
            headers.insert(fwd_host, host);
        }
    }
    Ok(())
}

/// Removes connection-specific headers: the fixed list of RFC 9110 and any header the
/// `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in [
        header::CONNECTION,
        HeaderName::from_static("keep-alive"),
        HeaderName::from_static("proxy-connection"),
        header::PROXY_AUTHENTICATE,
        header::PROXY_AUTHORIZATION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ] {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(uri: &str, headers: &[(&str, &str)]) -> request::Parts {
        let mut b = Request::builder().method("POST").uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn rewrites_target_and_forwarding_headers() {
        let mut p = parts(
            "/payments?x=1",
            &[
                ("host", "api.example"),
                ("connection", "keep-alive, x-secret-hop"),
                ("x-secret-hop", "1"),
                ("te", "trailers"),
                ("x-forwarded-for", "10.0.0.1"),
                ("x-kept", "yes"),
            ],
        );
        let target = UpstreamUrl::parse("upstream.url", "http://127.0.0.1:3000/api").unwrap();
        prepare_request(&mut p, &target, "192.0.2.7:5555".parse().unwrap()).unwrap();
        assert_eq!(p.uri.to_string(), "http://127.0.0.1:3000/api/payments?x=1");
        assert!(p.headers.get("connection").is_none());
        assert!(p.headers.get("x-secret-hop").is_none());
        assert!(p.headers.get("te").is_none());
        assert_eq!(p.headers["x-forwarded-for"], "10.0.0.1, 192.0.2.7");
        assert_eq!(p.headers["x-forwarded-proto"], "http");
        assert_eq!(p.headers["x-forwarded-host"], "api.example");
        assert_eq!(p.headers["host"], "api.example");
        assert_eq!(p.headers["x-kept"], "yes");
    }

    #[test]
    fn keeps_forwarded_proto_set_by_a_load_balancer() {
        let mut p = parts("/", &[("x-forwarded-proto", "https")]);
        let target = UpstreamUrl::parse("upstream.url", "http://127.0.0.1:3000").unwrap();
        prepare_request(&mut p, &target, "[::1]:5555".parse().unwrap()).unwrap();
        assert_eq!(p.headers["x-forwarded-proto"], "https");
        assert_eq!(p.headers["x-forwarded-for"], "::1");
    }
}
