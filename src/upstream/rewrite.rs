//! A client's request made into the upstream's: target URI, HTTP/1.1, hop-by-hop headers
//! removed, forwarding headers set.

use std::net::SocketAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{self, PathAndQuery, Scheme};
use http::{request, Uri, Version};

use crate::config::UpstreamUrl;

/// The client end of a connection, its address already formatted for `X-Forwarded-For`: built
/// once per connection rather than once per request.
#[derive(Clone, Debug)]
pub struct ClientAddr {
    ip: HeaderValue,
    /// The peer is one of `server.trusted_proxies`: its forwarding headers are believed.
    trusted: bool,
    /// It came over TLS (`X-Forwarded-Proto: https`).
    tls: bool,
}

impl ClientAddr {
    /// The peer's address as text (what `X-Forwarded-For` gets).
    pub fn ip(&self) -> &str {
        self.ip.to_str().unwrap_or("")
    }

    pub fn new(addr: SocketAddr, trusted: bool) -> Self {
        // An IP address always formats to a valid header value; the fallback is unreachable.
        let ip = HeaderValue::from_str(&addr.ip().to_canonical().to_string())
            .unwrap_or(HeaderValue::from_static("unknown"));
        ClientAddr {
            ip,
            trusted,
            tls: false,
        }
    }

    /// The same peer, on the TLS listener.
    /// Whether the connection came over TLS.
    pub fn tls(&self) -> bool {
        self.tls
    }

    pub fn over_tls(self, tls: bool) -> Self {
        ClientAddr { tls, ..self }
    }
}

const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const FORWARDED: HeaderName = HeaderName::from_static("forwarded");

/// Rewrites the client's request head for the upstream: target URI, HTTP/1.1, hop-by-hop headers
/// removed (RFC 9110 7.6.1) and `X-Forwarded-For/-Proto/-Host` set as a reverse proxy does.
///
/// The original `Host` is kept, so the upstream sees the name the client used. From a trusted
/// proxy (`server.trusted_proxies`, a load balancer in front), its `X-Forwarded-Proto`/`-Host`
/// and `Forwarded` are kept and the peer's address is appended to `X-Forwarded-For`; from anyone
/// else they are what this gateway saw, and `Forwarded` is removed: a client cannot make the
/// upstream believe it came from elsewhere, over HTTPS, or for another host.
pub fn prepare_request(
    parts: &mut request::Parts,
    target: &UpstreamUrl,
    peer: &ClientAddr,
) -> Result<(), http::Error> {
    // Taken apart rather than re-parsed: this runs on every forwarded request.
    let original = std::mem::take(&mut parts.uri).into_parts();
    let path_and_query = match (target.prefix.as_str(), original.path_and_query) {
        ("", Some(pq)) => pq,
        ("", None) => PathAndQuery::from_static("/"),
        (prefix, pq) => {
            let pq = pq.as_ref().map_or("/", PathAndQuery::as_str);
            PathAndQuery::try_from(format!("{prefix}{pq}"))?
        }
    };
    let mut uri = uri::Parts::default();
    uri.scheme = Some(if target.tls {
        Scheme::HTTPS
    } else {
        Scheme::HTTP
    });
    uri.authority = Some(target.authority.clone());
    uri.path_and_query = Some(path_and_query);
    parts.uri = Uri::from_parts(uri)?;
    parts.version = Version::HTTP_11;

    let headers = &mut parts.headers;
    strip_request_hop_by_hop(headers);
    if !headers.contains_key(header::HOST) {
        // HTTP/2 clients send :authority instead of Host.
        if let Some(a) = &original.authority {
            if let Ok(v) = HeaderValue::from_str(a.as_str()) {
                headers.insert(header::HOST, v);
            }
        }
    }
    if !peer.trusted {
        headers.remove(X_FORWARDED_FOR);
        headers.remove(X_FORWARDED_PROTO);
        headers.remove(X_FORWARDED_HOST);
        headers.remove(FORWARDED);
    }
    let forwarded_for = match headers.get(X_FORWARDED_FOR) {
        None => peer.ip.clone(),
        Some(prior) => {
            let mut v = Vec::with_capacity(prior.len() + 2 + peer.ip.len());
            v.extend_from_slice(prior.as_bytes());
            v.extend_from_slice(b", ");
            v.extend_from_slice(peer.ip.as_bytes());
            HeaderValue::from_bytes(&v)?
        }
    };
    headers.insert(X_FORWARDED_FOR, forwarded_for);
    if !headers.contains_key(X_FORWARDED_PROTO) {
        let proto = if peer.tls { "https" } else { "http" };
        headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static(proto));
    }
    if !headers.contains_key(X_FORWARDED_HOST) {
        if let Some(host) = headers.get(header::HOST).cloned() {
            headers.insert(X_FORWARDED_HOST, host);
        }
    }
    Ok(())
}

/// Whether a header is connection-specific by definition (RFC 9110 7.6.1, plus the legacy
/// `Keep-Alive` and `Proxy-Connection`).
fn is_hop_by_hop(name: &HeaderName) -> bool {
    name == header::CONNECTION
        || name == header::TE
        || name == header::TRAILER
        || name == header::TRANSFER_ENCODING
        || name == header::UPGRADE
        || name == header::PROXY_AUTHENTICATE
        || name == header::PROXY_AUTHORIZATION
        || name == KEEP_ALIVE
        || name == PROXY_CONNECTION
}

/// Removes a client request's connection-specific headers: the fixed list of RFC 9110 only. The
/// headers its `Connection` names stay (as nginx does): a client could otherwise remove from
/// the upstream's view a header the gateway decided on (the idempotency key, the client scope,
/// `Content-Type`, `Host`).
///
/// `TE: trailers` is kept (as that, whatever else `TE` said): gRPC needs it to reach an HTTP/2
/// upstream, where it is the one `TE` allowed; the pool drops it for HTTP/1.1.
fn strip_request_hop_by_hop(headers: &mut HeaderMap) {
    let doomed: Vec<HeaderName> = headers
        .keys()
        .filter(|name| is_hop_by_hop(name))
        .cloned()
        .collect();
    if doomed.is_empty() {
        return;
    }
    // Looked at only when `TE` is there (gRPC calls), not on every request.
    let trailers = doomed.contains(&header::TE)
        && headers
            .get_all(header::TE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| {
                t.split(';')
                    .next()
                    .is_some_and(|t| t.trim().eq_ignore_ascii_case("trailers"))
            });
    for name in doomed {
        headers.remove(name);
    }
    if trailers {
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
    }
}

/// Removes an upstream response's connection-specific headers: the fixed list of RFC 9110 and
/// any header its `Connection` names.
pub(super) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the names; most messages carry none of these (or only `Connection`), so
    // nothing is allocated or hashed again for them.
    let mut doomed: Vec<HeaderName> = headers
        .keys()
        .filter(|name| is_hop_by_hop(name))
        .cloned()
        .collect();
    if doomed.is_empty() {
        return;
    }
    doomed.extend(
        headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok()),
    );
    for name in doomed {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

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
                ("te", "gzip, trailers;q=1"),
                ("x-forwarded-for", "10.0.0.1"),
                ("x-kept", "yes"),
            ],
        );
        let target = UpstreamUrl::parse("upstream.url", "http://127.0.0.1:3000/api").unwrap();
        prepare_request(
            &mut p,
            &target,
            &ClientAddr::new("192.0.2.7:5555".parse().unwrap(), true),
        )
        .unwrap();
        assert_eq!(p.uri.to_string(), "http://127.0.0.1:3000/api/payments?x=1");
        assert!(p.headers.get("connection").is_none());
        // Named in Connection, kept: see strip_request_hop_by_hop.
        assert_eq!(p.headers["x-secret-hop"], "1");
        // Only `trailers` is left of TE, for gRPC over HTTP/2.
        assert_eq!(p.headers["te"], "trailers");
        assert_eq!(p.headers["x-forwarded-for"], "10.0.0.1, 192.0.2.7");
        assert_eq!(p.headers["x-forwarded-proto"], "http");
        assert_eq!(p.headers["x-forwarded-host"], "api.example");
        assert_eq!(p.headers["host"], "api.example");
        assert_eq!(p.headers["x-kept"], "yes");
    }

    #[test]
    fn keeps_forwarded_proto_set_by_a_trusted_load_balancer() {
        let mut p = parts("/", &[("x-forwarded-proto", "https")]);
        let target = UpstreamUrl::parse("upstream.url", "http://127.0.0.1:3000").unwrap();
        prepare_request(
            &mut p,
            &target,
            &ClientAddr::new("[::1]:5555".parse().unwrap(), true),
        )
        .unwrap();
        assert_eq!(p.headers["x-forwarded-proto"], "https");
        assert_eq!(p.headers["x-forwarded-for"], "::1");
    }

    #[test]
    fn replaces_what_an_untrusted_client_claims() {
        let mut p = parts(
            "/",
            &[
                ("host", "api.example"),
                ("x-forwarded-proto", "https"),
                ("x-forwarded-host", "admin.internal"),
                ("x-forwarded-for", "10.0.0.1"),
                ("forwarded", "for=10.0.0.1;proto=https"),
            ],
        );
        let target = UpstreamUrl::parse("upstream.url", "http://127.0.0.1:3000").unwrap();
        // An IPv4 client on a dual-stack listener is shown as IPv4.
        let peer = ClientAddr::new("[::ffff:192.0.2.7]:5555".parse().unwrap(), false);
        prepare_request(&mut p, &target, &peer).unwrap();
        assert_eq!(p.headers["x-forwarded-for"], "192.0.2.7");
        assert_eq!(p.headers["x-forwarded-proto"], "http");
        assert_eq!(p.headers["x-forwarded-host"], "api.example");
        assert!(p.headers.get("forwarded").is_none());
    }

    #[test]
    fn keeps_path_and_query_as_sent_without_a_prefix() {
        let mut p = parts("/payments/p%2F1?a=1&b=%20", &[("host", "api.example")]);
        let target = UpstreamUrl::parse("upstream.url", "http://127.0.0.1:3000").unwrap();
        prepare_request(
            &mut p,
            &target,
            &ClientAddr::new("192.0.2.7:1".parse().unwrap(), false),
        )
        .unwrap();
        assert_eq!(
            p.uri.to_string(),
            "http://127.0.0.1:3000/payments/p%2F1?a=1&b=%20"
        );
        assert_eq!(p.headers["x-forwarded-for"], "192.0.2.7");
    }

    #[test]
    fn strips_every_hop_by_hop_header_and_nothing_else() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("keep-alive", "timeout=5"),
            ("proxy-connection", "keep-alive"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "h2c"),
            ("trailer", "x-sum"),
            ("proxy-authorization", "Basic eA=="),
            ("x-request-id", "r1"),
            ("content-type", "application/json"),
        ] {
            h.insert(HeaderName::from_static(k), HeaderValue::from_static(v));
        }
        strip_hop_by_hop(&mut h);
        let mut left: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["content-type", "x-request-id"]);

        // Without any of them the map is left exactly as it was.
        let before = h.clone();
        strip_hop_by_hop(&mut h);
        assert_eq!(h, before);
    }
}
