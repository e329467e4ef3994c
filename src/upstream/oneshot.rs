//! One GET on a connection of its own, for the gateway's own rare requests (reconciliation
//! lookups, JWT key sets), never for client traffic.

use bytes::Bytes;
use http::{header, Request, Response, Uri};
use http_body_util::Empty;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::UpstreamTlsConnector;
use crate::config::UpstreamProtocol;

/// Whom a GET is for: an upstream (its TLS name may be `tls_server_name`) or another host.
#[derive(Clone, Copy)]
pub enum Peer {
    Upstream,
    Other,
}

/// One GET of `url` on a connection of its own, made on this runtime (lookups and key set
/// fetches are rare; a pooled connection would be driven by whichever worker made it): HTTP/1.1, over TLS for
/// `https://` with the upstreams' TLS settings (CA, client certificate, server name).
pub async fn get(
    url: &Uri,
    tls: &UpstreamTlsConnector,
    to: Peer,
    headers: http::HeaderMap,
) -> Result<Response<Incoming>, String> {
    let (Some(scheme), Some(authority)) = (url.scheme_str(), url.authority()) else {
        return Err("the URL has no scheme or host".into());
    };
    let secure = scheme == "https";
    let port = authority
        .port_u16()
        .unwrap_or(if secure { 443 } else { 80 });
    let host = authority.host();
    let tcp = TcpStream::connect((host.trim_start_matches('[').trim_end_matches(']'), port))
        .await
        .map_err(|e| format!("cannot connect to {authority}: {e}"))?;
    let _ = tcp.set_nodelay(true);
    let mut request = Request::get(url.path_and_query().map_or("/", |p| p.as_str()))
        .header(header::HOST, authority.as_str())
        .header(header::ACCEPT, "application/json")
        .body(Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    // A trace's `traceparent`, when there is one.
    request.headers_mut().extend(headers);
    if secure {
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let connected = match to {
            Peer::Upstream => tls.connect(bare, tcp, UpstreamProtocol::Http1).await,
            Peer::Other => tls.connect_host(bare, tcp).await,
        };
        let (stream, _) = connected.map_err(|e| e.to_string())?;
        exchange(TokioIo::new(stream), request).await
    } else {
        exchange(TokioIo::new(tcp), request).await
    }
}

async fn exchange<T>(io: T, request: Request<Empty<Bytes>>) -> Result<Response<Incoming>, String>
where
    T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    sender
        .send_request(request)
        .await
        .map_err(|e| e.to_string())
}
