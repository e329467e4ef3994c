//! How clients are told apart beyond `client_header`: `client_jwt` (the scope taken from a
//! verified JWT's issuer and chosen claims rather than from a header's bytes, so that a client
//! keeps its keys across token refreshes) and the headers the gateway sets from a verified
//! client certificate.

use std::path::PathBuf;
use std::time::Duration;

use http::{HeaderName, Uri};

use super::Secret;

/// The header that carries the subject of a client's verified certificate (with
/// `server.tls_client_ca`); set by the gateway only, never taken from a client. Name it in
/// `client_header` to scope keys per certificate subject.
pub const CLIENT_SUBJECT_HEADER: &str = "x-client-cert-subject";

/// The header that carries the URI SANs of a client's verified certificate (a SPIFFE ID in a
/// mesh); set by the gateway only. Name it in `client_header` to scope keys per workload: it
/// survives certificate rotation, where the subject may not.
pub const CLIENT_URI_HEADER: &str = "x-client-cert-uri";

/// Whether a header is one the gateway sets from the client's certificate: public values, never
/// a secret a client proves it holds.
pub fn is_certificate_header(name: &http::HeaderName) -> bool {
    name == CLIENT_SUBJECT_HEADER || name == CLIENT_URI_HEADER
}

/// A validated `client_jwt` table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientJwt {
    /// Where the verification keys come from.
    pub keys: JwtKeys,
    /// `iss` must be one of these; the scope hashes the token's own `iss`.
    pub issuers: Vec<String>,
    /// When set, `aud` must contain it.
    pub audience: Option<String>,
    /// The claims whose values (with `iss`) are the scope, in order; `["sub"]` by default.
    pub claims: Vec<String>,
    /// The header carrying the token (`Authorization`, `Bearer` scheme, by default).
    pub header: HeaderName,
    /// Clock skew allowed on `exp` and `nbf`.
    pub leeway: Duration,
    /// How often a fetched key set is fetched again.
    pub refresh: Duration,
}

/// The keys tokens are verified with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JwtKeys {
    /// A JWKS document served over `http://` or `https://` (with the `[upstream]` TLS roots).
    Url(Uri),
    /// A JWKS document in a file, read again every `refresh`.
    File(PathBuf),
    /// One shared secret for HS256/384/512 issuers (at least 32 bytes).
    Hmac(Secret),
}

impl JwtKeys {
    /// Where the keys come from, for logs and `/readyz`: never the secret.
    pub fn describe(&self) -> String {
        match self {
            JwtKeys::Url(u) => u.to_string(),
            JwtKeys::File(p) => p.display().to_string(),
            JwtKeys::Hmac(_) => "an HMAC secret".to_string(),
        }
    }
}
