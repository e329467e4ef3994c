//! Certificates made for the tests (rcgen): a CA, server leaves, client certificates with a
//! subject and URI SANs (SPIFFE IDs), and a TLS client of the gateway's listener.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, Certificate, CertificateParams, DnType, IsCa, KeyPair, SanType};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// A certificate authority for the tests.
pub struct Ca {
    pub cert: Certificate,
    pub key: KeyPair,
}

impl Ca {
    pub fn new(name: &str) -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        Ca {
            cert: params.self_signed(&key).unwrap(),
            key,
        }
    }

    /// A leaf for `names` (DNS names, or 127.0.0.1), valid now unless `expired`: (cert, key)
    /// in PEM.
    pub fn leaf(&self, names: &[&str], expired: bool) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(
            names
                .iter()
                .filter(|n| n.parse::<std::net::IpAddr>().is_err())
                .map(|n| n.to_string())
                .collect::<Vec<_>>(),
        )
        .unwrap();
        for n in names {
            if let Ok(ip) = n.parse() {
                params.subject_alt_names.push(SanType::IpAddress(ip));
            }
        }
        if expired {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        }
        let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

impl Ca {
    /// A client certificate: `subject` as (type, value) pairs, `uris` as URI SANs; (DER, key).
    pub fn client(
        &self,
        subject: &[(DnType, &str)],
        uris: &[&str],
    ) -> (CertificateDer<'static>, Vec<u8>) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        for (kind, value) in subject {
            params.distinguished_name.push(kind.clone(), *value);
        }
        for uri in uris {
            params
                .subject_alt_names
                .push(SanType::URI((*uri).try_into().unwrap()));
        }
        let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
        (cert.der().clone(), key.serialize_der())
    }

    /// An HTTP/1.1 session with the gateway's TLS listener at `addr` (trusting this CA), as the
    /// client `identity` (`None`: no certificate); `None` if the handshake fails.
    pub async fn session(
        &self,
        addr: SocketAddr,
        identity: Option<(CertificateDer<'static>, Vec<u8>)>,
    ) -> Option<hyper::client::conn::http1::SendRequest<Full<Bytes>>> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.cert.der().clone()).unwrap();
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
        let config = match identity {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => builder
                .with_client_auth_cert(vec![cert], PrivateKeyDer::Pkcs8(key.into()))
                .unwrap(),
        };
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(
                rustls::pki_types::ServerName::try_from("localhost").unwrap(),
                tcp,
            )
            .await
            .ok()?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .ok()?;
        tokio::spawn(conn);
        Some(sender)
    }
}
