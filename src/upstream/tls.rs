//! TLS to `https://` upstreams: one rustls client config for the process (`[upstream] tls_*`),
//! so that every worker's connections share its session cache and a reconnect resumes its
//! session instead of a full handshake.
//!
//! Certificates are always verified: against the system's trusted roots, or only against
//! `tls_ca_file` when it is set; the name checked (and sent as SNI) is the URL's host, or
//! `tls_server_name`. There is no setting that turns verification off. A handshake that fails
//! (unknown CA, expired certificate, another name) means nothing was sent: the key is released
//! and the client gets `502 upstream-unreachable`, and the log line says why.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use crate::config::{UpstreamProtocol, UpstreamTls};
use crate::error::BoxError;

/// Why the TLS settings could not be used (at startup).
#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    #[error("{section}.tls_ca_file {path}: {reason}")]
    Ca {
        section: &'static str,
        path: String,
        reason: String,
    },
    #[error("{0}.tls_client_cert / tls_client_key: {1}")]
    ClientAuth(&'static str, String),
    #[error("TLS: {0}")]
    Config(String),
}

/// Opens TLS connections to upstreams; one per process.
pub struct UpstreamTlsConnector {
    /// One per ALPN offer (the same session cache behind all three): `h2` and `http/1.1`,
    /// `http/1.1` only, `h2` only.
    either: TlsConnector,
    http1: TlsConnector,
    http2: TlsConnector,
    /// `tls_server_name`, for every https upstream.
    server_name: Option<ServerName<'static>>,
}

/// A rustls client config that verifies servers against `ca_file` only (or the system's roots
/// without it) and presents `client` (chain, key) to servers that ask: for upstreams and for
/// the Postgres store (`section` names the settings in errors).
pub fn client_config(
    ca_file: Option<&Path>,
    client: Option<(&Path, &Path)>,
    section: &'static str,
) -> Result<ClientConfig, TlsSetupError> {
    let mut roots = RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let shown = path.display().to_string();
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| TlsSetupError::Ca {
                    section,
                    path: shown.clone(),
                    reason: e.to_string(),
                })?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(TlsSetupError::Ca {
                    section,
                    path: shown,
                    reason: "no usable CA certificate in it".into(),
                });
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                // Only a problem if TLS is used: its connections then fail, each saying why.
                tracing::warn!(
                    section,
                    "no trusted root certificates found on this system; TLS connections need {section}.tls_ca_file"
                );
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsSetupError::Config(e.to_string()))?
        .with_root_certificates(roots);
    match client {
        Some((cert, key)) => {
            let chain = CertificateDer::pem_file_iter(cert)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| {
                    TlsSetupError::ClientAuth(section, format!("{}: {e}", cert.display()))
                })?;
            let key = PrivateKeyDer::from_pem_file(key).map_err(|e| {
                TlsSetupError::ClientAuth(section, format!("{}: {e}", key.display()))
            })?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| TlsSetupError::ClientAuth(section, e.to_string()))
        }
        None => Ok(builder.with_no_client_auth()),
    }
}

impl UpstreamTlsConnector {
    pub fn new(settings: &UpstreamTls) -> Result<Arc<Self>, TlsSetupError> {
        let client = match (&settings.client_cert, &settings.client_key) {
            (Some(cert), Some(key)) => Some((cert.as_path(), key.as_path())),
            _ => None,
        };
        let mut config = client_config(settings.ca_file.as_deref(), client, "upstream")?;
        let mut offering = |alpn: &[&[u8]]| {
            config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
            // A clone shares the session cache (`resumption` is an `Arc` inside).
            TlsConnector::from(Arc::new(config.clone()))
        };
        let either = offering(&[b"h2", b"http/1.1"]);
        let http1 = offering(&[b"http/1.1"]);
        let http2 = offering(&[b"h2"]);
        let server_name = match &settings.server_name {
            None => None,
            Some(name) => Some(
                ServerName::try_from(name.clone())
                    .map_err(|e| TlsSetupError::Config(format!("tls_server_name: {e}")))?,
            ),
        };
        Ok(Arc::new(UpstreamTlsConnector {
            either,
            http1,
            http2,
            server_name,
        }))
    }

    /// The TLS handshake on `stream` with the upstream at `host`, offering what `protocol`
    /// allows; any failure means nothing was sent. Also says whether HTTP/2 was agreed.
    pub async fn connect(
        &self,
        host: &str,
        stream: TcpStream,
        protocol: UpstreamProtocol,
    ) -> Result<(TlsStream<TcpStream>, bool), BoxError> {
        self.connect_as(host, self.server_name.as_ref(), stream, protocol)
            .await
    }

    /// [`Self::connect`] to a host that is not an upstream (a JWT issuer's key set): its own
    /// name, never `tls_server_name`, with the same roots.
    pub async fn connect_host(
        &self,
        host: &str,
        stream: TcpStream,
    ) -> Result<(TlsStream<TcpStream>, bool), BoxError> {
        self.connect_as(host, None, stream, UpstreamProtocol::Http1)
            .await
    }

    async fn connect_as(
        &self,
        host: &str,
        server_name: Option<&ServerName<'static>>,
        stream: TcpStream,
        protocol: UpstreamProtocol,
    ) -> Result<(TlsStream<TcpStream>, bool), BoxError> {
        let name = match server_name {
            Some(name) => name.clone(),
            None => ServerName::try_from(host.to_string())
                .map_err(|e| format!("upstream host {host:?} is not a TLS server name: {e}"))?,
        };
        let connector = match protocol {
            UpstreamProtocol::Auto => &self.either,
            UpstreamProtocol::Http1 => &self.http1,
            UpstreamProtocol::Http2 => &self.http2,
        };
        let stream = connector
            .connect(name, stream)
            .await
            .map_err(|e| format!("TLS handshake with the upstream failed: {e}"))?;
        // An upstream that ignores ALPN speaks HTTP/1.1, unless HTTP/2 is all we offered.
        let h2 = match stream.get_ref().1.alpn_protocol() {
            Some(p) => p == b"h2",
            None => protocol == UpstreamProtocol::Http2,
        };
        Ok((stream, h2))
    }
}
