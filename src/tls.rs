//! TLS on the traffic listener (`server.tls_cert`, `server.tls_key`): rustls, ALPN `h2` and
//! `http/1.1`, TLS 1.2 and 1.3 (rustls has no older version).
//!
//! The certificate is kept behind a resolver that a SIGHUP swaps ([`ListenerTls::reload`]), and
//! that [`watch`] swaps too when the files change (`server.tls_recheck`, every minute by
//! default), since nobody sends a SIGHUP when kubelet updates a mounted Secret: cert-manager and
//! its kind rewrite the files in place, and the next handshake presents the new certificate while
//! every connection already open goes on undisturbed. A reload that cannot read or parse the
//! files keeps the certificate in use and says why.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use sha2::{Digest, Sha256};

use arc_swap::ArcSwap;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::ServerConfig;
use tokio_rustls::TlsAcceptor;

/// Why the listener's certificate could not be loaded.
#[derive(Debug, thiserror::Error)]
#[error("server.tls_cert / tls_key ({cert}, {key}): {reason}")]
pub struct ListenerTlsError {
    cert: String,
    key: String,
    reason: String,
}

/// The listener's TLS: its acceptor, and the certificate it presents, reloadable.
pub struct ListenerTls {
    acceptor: TlsAcceptor,
    current: Arc<Current>,
    cert: PathBuf,
    key: PathBuf,
    provider: Arc<CryptoProvider>,
    /// SHA-256 of the cert and key files as last loaded: [`watch`] reloads when they differ.
    loaded: Mutex<[u8; 32]>,
}

/// The certificate presented to every new handshake.
#[derive(Debug)]
struct Current(ArcSwap<CertifiedKey>);

impl ResolvesServerCert for Current {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.load_full())
    }
}

impl ListenerTls {
    /// With `client_ca`, every client must present a certificate signed by it.
    pub fn new(
        cert: &Path,
        key: &Path,
        client_ca: Option<&Path>,
    ) -> Result<Self, ListenerTlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let (loaded, digest) = load(cert, key, &provider)?;
        let current = Arc::new(Current(ArcSwap::from_pointee(loaded)));
        let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|e| error(cert, key, e.to_string()))?;
        let builder = match client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let bad = |reason: String| {
                    error(
                        cert,
                        key,
                        format!("server.tls_client_ca {}: {reason}", ca.display()),
                    )
                };
                let mut roots = rustls::RootCertStore::empty();
                let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(ca)
                    .and_then(|certs| certs.collect())
                    .map_err(|e| bad(e.to_string()))?;
                let (added, _) = roots.add_parsable_certificates(certs);
                if added == 0 {
                    return Err(bad("no usable CA certificate in it".into()));
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    Arc::clone(&provider),
                )
                .build()
                .map_err(|e| bad(e.to_string()))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config =
            builder.with_cert_resolver(Arc::clone(&current) as Arc<dyn ResolvesServerCert>);
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(ListenerTls {
            acceptor: TlsAcceptor::from(Arc::new(config)),
            current,
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            provider,
            loaded: Mutex::new(digest),
        })
    }

    pub fn acceptor(&self) -> &TlsAcceptor {
        &self.acceptor
    }

    /// Reads the certificate and key again; the next handshakes present them. On error the
    /// certificate in use stays.
    pub fn reload(&self) -> Result<(), ListenerTlsError> {
        let (loaded, digest) = load(&self.cert, &self.key, &self.provider)?;
        self.install(loaded, digest);
        Ok(())
    }

    /// Reloads if the files are not what was last loaded; says whether it did.
    pub fn reload_if_changed(&self) -> Result<bool, ListenerTlsError> {
        let (cert, key) = read(&self.cert, &self.key)?;
        let digest = digest(&cert, &key);
        if digest == *self.loaded.lock().unwrap_or_else(PoisonError::into_inner) {
            return Ok(false);
        }
        let loaded = parse(&self.cert, &self.key, &cert, &key, &self.provider)?;
        self.install(loaded, digest);
        Ok(true)
    }

    /// Presents `loaded` to the next handshakes, and remembers which files it came from.
    fn install(&self, loaded: CertifiedKey, digest: [u8; 32]) {
        self.current.0.store(Arc::new(loaded));
        *self.loaded.lock().unwrap_or_else(PoisonError::into_inner) = digest;
    }
}

/// Reads the certificate files every `every` and loads them when they changed. A pair caught
/// half-written (a certificate without its new key) fails to load, keeps the certificate in use,
/// and is tried again next time.
pub async fn watch(tls: Arc<ListenerTls>, every: Duration) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        match tls.reload_if_changed() {
            Ok(true) => tracing::info!("TLS certificate files changed; reloaded"),
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(error = %e, "TLS certificate files changed but cannot be loaded; keeping the one in use")
            }
        }
    }
}

/// What the client's verified certificate says about who it is, as the headers carry it.
#[derive(Debug, Clone, Default)]
pub struct CertificateIds {
    /// For [`crate::config::CLIENT_SUBJECT_HEADER`]: the subject's DER encoding in hex, exact,
    /// so that two different subjects can never read the same (a text form can: `CN=a, O=b` is
    /// one CN or two attributes). `None` for an empty subject (an identity only in a SAN): such
    /// clients would all share one.
    pub subject: Option<http::HeaderValue>,
    /// For [`crate::config::CLIENT_URI_HEADER`]: the URI SANs (a SPIFFE ID, which names the
    /// workload and stays the same across the mesh's certificate rotations), joined by ", ".
    /// `None` without one.
    pub uri: Option<http::HeaderValue>,
}

/// The identities in the client's certificate, once the handshake verified it.
pub fn client_certificate(conn: &rustls::ServerConnection) -> CertificateIds {
    let Some(leaf) = conn.peer_certificates().and_then(|c| c.first()) else {
        return CertificateIds::default();
    };
    let Ok((_, parsed)) = x509_parser::parse_x509_certificate(leaf.as_ref()) else {
        return CertificateIds::default();
    };
    let subject = parsed.subject();
    let subject = match subject.iter().next() {
        Some(_) => http::HeaderValue::from_str(&hex::encode(subject.as_raw())).ok(),
        None => None,
    };
    let uris: Vec<&str> = match parsed.subject_alternative_name() {
        Ok(Some(san)) => (san.value.general_names.iter())
            .filter_map(|name| match name {
                x509_parser::extensions::GeneralName::URI(uri) => Some(*uri),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    // A URI with bytes a header cannot carry names no one: no header rather than a guess.
    let uri = match uris.is_empty() {
        true => None,
        false => http::HeaderValue::from_str(&uris.join(", ")).ok(),
    };
    CertificateIds { subject, uri }
}

fn error(cert: &Path, key: &Path, reason: String) -> ListenerTlsError {
    ListenerTlsError {
        cert: cert.display().to_string(),
        key: key.display().to_string(),
        reason,
    }
}

/// Certificate files are a few KiB; anything past this is not one.
const MAX_PEM_FILE: u64 = 1024 * 1024;

/// The two files' bytes.
fn read(cert: &Path, key: &Path) -> Result<(Vec<u8>, Vec<u8>), ListenerTlsError> {
    let read = |path: &Path, what: &str| {
        use std::io::Read;
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_PEM_FILE + 1).read_to_end(&mut bytes))
            .map_err(|e| error(cert, key, format!("{what}: {e}")))?;
        if bytes.len() as u64 > MAX_PEM_FILE {
            return Err(error(cert, key, format!("{what}: larger than 1 MiB")));
        }
        Ok(bytes)
    };
    Ok((
        read(cert, "the certificate chain")?,
        read(key, "the private key")?,
    ))
}

fn digest(cert: &[u8], key: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update((cert.len() as u64).to_be_bytes());
    h.update(cert);
    h.update(key);
    h.finalize().into()
}

/// The chain and its key, checked to belong together, and the digest of the files.
fn load(
    cert: &Path,
    key: &Path,
    provider: &CryptoProvider,
) -> Result<(CertifiedKey, [u8; 32]), ListenerTlsError> {
    let (cert_pem, key_pem) = read(cert, key)?;
    let loaded = parse(cert, key, &cert_pem, &key_pem, provider)?;
    Ok((loaded, digest(&cert_pem, &key_pem)))
}

fn parse(
    cert: &Path,
    key: &Path,
    cert_pem: &[u8],
    key_pem: &[u8],
    provider: &CryptoProvider,
) -> Result<CertifiedKey, ListenerTlsError> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| error(cert, key, format!("the certificate chain: {e}")))?;
    if chain.is_empty() {
        return Err(error(cert, key, "no certificate in the chain file".into()));
    }
    let private = PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|e| error(cert, key, format!("the private key: {e}")))?;
    CertifiedKey::from_der(chain, private, provider).map_err(|e| {
        error(
            cert,
            key,
            format!("the key does not fit the certificate: {e}"),
        )
    })
}
