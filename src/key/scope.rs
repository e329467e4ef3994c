//! Who a key belongs to: the client scope, derived from a client header's value (as the
//! header means it, in its place of the route's list), from a verified JWT's issuer and claims
//! ([`crate::jwt`]), or one shared or anonymous scope. Only ever kept as a hash.

use std::fmt;
use std::sync::OnceLock;

use http::{HeaderMap, HeaderName};
use sha2::{Digest, Sha256};

use super::trim_ows;

/// A client header's value as the header means it. `Authorization` and
/// `Proxy-Authorization`: the scheme is case-insensitive (RFC 9110 section 11.1) and spelled
/// `Bearer`, `Basic`, ... here, one space between it and the credentials; leading and trailing
/// whitespace goes. Other headers are taken as sent. Borrowed when nothing changes (the common
/// case costs no allocation).
pub fn canonical_value<'a>(name: &HeaderName, value: &'a [u8]) -> std::borrow::Cow<'a, [u8]> {
    use std::borrow::Cow;
    if name != http::header::AUTHORIZATION && name != http::header::PROXY_AUTHORIZATION {
        return Cow::Borrowed(value);
    }
    let trimmed = trim_ows(value);
    let Some(space) = trimmed.iter().position(|b| matches!(b, b' ' | b'\t')) else {
        return Cow::Borrowed(trimmed);
    };
    let (scheme, rest) = trimmed.split_at(space);
    let credentials = trim_ows(rest);
    let canonical_scheme = scheme.iter().enumerate().all(|(i, b)| {
        if i == 0 {
            !b.is_ascii_lowercase()
        } else {
            !b.is_ascii_uppercase()
        }
    });
    if canonical_scheme && rest.len() == credentials.len() + 1 && rest[0] == b' ' {
        return Cow::Borrowed(trimmed);
    }
    let mut out = Vec::with_capacity(scheme.len() + 1 + credentials.len());
    for (i, b) in scheme.iter().enumerate() {
        out.push(if i == 0 {
            b.to_ascii_uppercase()
        } else {
            b.to_ascii_lowercase()
        });
    }
    out.push(b' ');
    out.extend_from_slice(credentials);
    Cow::Owned(out)
}

/// Who a key belongs to: a hash of a client header's value (or a verified JWT's issuer and
/// claims, or one shared scope).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ClientScope([u8; 32]);

/// The scope a request names, and the one the gateway before issue 42 derived for it where the
/// two differ (a retry of a key stored then is looked up under it: see [`crate::gateway`]).
#[derive(Clone, Copy, Debug)]
pub struct Identified {
    pub scope: ClientScope,
    pub legacy: Option<ClientScope>,
    /// The value looks like a JWT (`Bearer eyJ...` in three segments): a scope that changes with
    /// every token refresh.
    pub jwt_like: bool,
}

impl Identified {
    /// A scope with no older derivation.
    pub fn of(scope: ClientScope) -> Self {
        Identified {
            scope,
            legacy: None,
            jwt_like: false,
        }
    }
}

/// Whether a header value looks like a JWT: `eyJ` (base64url of `{"`) and three segments,
/// after an optional `Bearer `. Cheap: most values fail at the first bytes.
fn looks_like_jwt(value: &[u8]) -> bool {
    let token = match value.get(..7) {
        Some(scheme) if scheme.eq_ignore_ascii_case(b"bearer ") => &value[7..],
        _ => value,
    };
    token.starts_with(b"eyJ") && token.iter().filter(|b| **b == b'.').count() == 2
}

impl ClientScope {
    /// The scope of the client the request names, if it carries one of `client_headers`: the
    /// first it carries decides. The value is taken as the header means it: an
    /// `Authorization` scheme in any case and spacing is one credential, and a header split over
    /// several fields (HTTP/2 sends cookies so) is the one line RFC 9110 joins them into. The
    /// header's place in the list is hashed with its value, so that the same value in two
    /// headers is two scopes; the first header's scope is derived as it always was (no name),
    /// so that keys stored before stay reachable.
    pub fn identify(headers: &HeaderMap, client_headers: &[HeaderName]) -> Option<Identified> {
        client_headers.iter().enumerate().find_map(|(place, name)| {
            let mut values = headers.get_all(name).iter();
            let first = values.next()?;
            Some(match values.next() {
                // The common case: one field, most often already in its canonical form.
                None => {
                    let value = first.as_bytes();
                    let canonical = canonical_value(name, value);
                    let scope = Self::of_header(place, name, &canonical);
                    let legacy =
                        (place > 0 || *canonical != *value).then(|| ClientScope::from_value(value));
                    Identified {
                        scope,
                        legacy,
                        jwt_like: looks_like_jwt(value),
                    }
                }
                Some(_) => Self::joined(place, name, headers),
            })
        })
    }

    /// A header split over several fields: all of them, joined as RFC 9110 (and RFC 9113 for
    /// cookies) joins them, so that no field can be left out to land in another client's scope.
    fn joined(place: usize, name: &HeaderName, headers: &HeaderMap) -> Identified {
        let separator: &[u8] = if name == http::header::COOKIE {
            b"; "
        } else {
            b", "
        };
        let (mut joined, mut legacy) = (Vec::new(), Vec::new());
        for (i, v) in headers.get_all(name).iter().enumerate() {
            if i > 0 {
                joined.extend_from_slice(separator);
                legacy.push(0);
            }
            joined.extend_from_slice(v.as_bytes());
            legacy.extend_from_slice(v.as_bytes());
        }
        let canonical = canonical_value(name, &joined);
        Identified {
            scope: Self::of_header(place, name, &canonical),
            legacy: Some(ClientScope::from_value(&legacy)),
            jwt_like: false,
        }
    }

    /// The scope of `value` (already canonical) in the header at `place` of `client_header`.
    pub fn of_header(place: usize, name: &HeaderName, value: &[u8]) -> Self {
        if place == 0 {
            return Self::from_value(value);
        }
        let mut h = Sha256::new();
        h.update(b"idemgate/client-scope/v2\x00");
        h.update((name.as_str().len() as u64).to_be_bytes());
        h.update(name.as_str().as_bytes());
        h.update(value);
        ClientScope(h.finalize().into())
    }

    /// The scope of a verified JWT: its issuer and the configured claims' values, in order (a
    /// string claim by its text, any other by its JSON), each length-prefixed.
    pub fn of_jwt<'a>(issuer: &str, claims: impl IntoIterator<Item = &'a [u8]>) -> Self {
        let mut h = Sha256::new();
        h.update(b"idemgate/client-scope/jwt/v1\x00");
        h.update((issuer.len() as u64).to_be_bytes());
        h.update(issuer.as_bytes());
        for value in claims {
            h.update((value.len() as u64).to_be_bytes());
            h.update(value);
        }
        ClientScope(h.finalize().into())
    }

    /// The scope every request shares when no client header is configured.
    pub fn shared() -> Self {
        // The two fixed scopes are hashed once, not on every request.
        static SHARED: OnceLock<ClientScope> = OnceLock::new();
        *SHARED.get_or_init(|| ClientScope::from_value(b"\x00shared"))
    }

    /// The scope of the requests that carry none of the client headers.
    pub fn anonymous() -> Self {
        static ANONYMOUS: OnceLock<ClientScope> = OnceLock::new();
        *ANONYMOUS.get_or_init(|| ClientScope::from_value(b"\x00anonymous"))
    }

    /// The hash itself (never the header's value).
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The scope of a client header value, as an operator types it (`idemgate keys --client`).
    pub fn from_value(value: &[u8]) -> Self {
        let mut h = Sha256::new();
        h.update(b"idemgate/client-scope/v1\x00");
        h.update(value);
        ClientScope(h.finalize().into())
    }
}

impl fmt::Debug for ClientScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ClientScope({})", hex::encode(&self.0[..6]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    fn names(list: &[&str]) -> Vec<HeaderName> {
        list.iter()
            .map(|n| HeaderName::from_bytes(n.as_bytes()).unwrap())
            .collect()
    }

    fn scope(pairs: &[(&str, &str)], list: &[&str]) -> Identified {
        ClientScope::identify(&headers(pairs), &names(list)).unwrap()
    }

    #[test]
    fn the_first_header_keeps_the_scope_it_always_had() {
        let got = scope(&[("authorization", "Bearer abc")], &["authorization"]);
        assert_eq!(got.scope, ClientScope::from_value(b"Bearer abc"));
        assert!(got.legacy.is_none(), "no second lookup for the common case");
        assert!(!got.jwt_like);
    }

    #[test]
    fn the_same_value_in_two_headers_is_two_scopes() {
        let list = ["x-api-key", "authorization"];
        let key = scope(&[("x-api-key", "V")], &list);
        let auth = scope(&[("authorization", "V")], &list);
        assert_ne!(key.scope, auth.scope);
        // The second header's value used to be hashed alone: its older key is looked up.
        assert_eq!(auth.legacy, Some(ClientScope::from_value(b"V")));
    }

    #[test]
    fn an_authorization_scheme_is_one_credential_in_any_case_and_spacing() {
        let list = ["authorization"];
        let canonical = scope(&[("authorization", "Bearer abc")], &list).scope;
        for sent in ["bearer abc", "BEARER abc", "Bearer  abc", "Bearer \tabc"] {
            let got = scope(&[("authorization", sent)], &list);
            assert_eq!(got.scope, canonical, "{sent:?}");
            assert_eq!(got.legacy, Some(ClientScope::from_value(sent.as_bytes())));
        }
        assert_ne!(
            scope(&[("authorization", "Bearer ABC")], &list).scope,
            canonical
        );
        // Other headers are taken as sent.
        assert_ne!(
            scope(&[("x-api-key", "bearer abc")], &["x-api-key"]).scope,
            scope(&[("x-api-key", "Bearer abc")], &["x-api-key"]).scope
        );
    }

    #[test]
    fn a_header_split_over_fields_is_the_line_it_joins_into() {
        let split = scope(&[("cookie", "a=1"), ("cookie", "b=2")], &["cookie"]);
        let line = scope(&[("cookie", "a=1; b=2")], &["cookie"]);
        assert_eq!(
            split.scope, line.scope,
            "HTTP/2 cookie fields and the HTTP/1.1 line"
        );
        assert_ne!(
            scope(&[("cookie", "a=1")], &["cookie"]).scope,
            split.scope,
            "no field can be left out"
        );
        let keys = scope(&[("x-api-key", "a"), ("x-api-key", "b")], &["x-api-key"]);
        assert_eq!(
            keys.scope,
            scope(&[("x-api-key", "a, b")], &["x-api-key"]).scope
        );
    }

    #[test]
    fn jwt_scopes_are_apart_from_header_scopes_and_from_each_other() {
        let alice = ClientScope::of_jwt("https://a/", [&b"alice"[..]]);
        assert_eq!(alice, ClientScope::of_jwt("https://a/", [&b"alice"[..]]));
        assert_ne!(alice, ClientScope::of_jwt("https://b/", [&b"alice"[..]]));
        assert_ne!(alice, ClientScope::of_jwt("https://a/", [&b"bob"[..]]));
        assert_ne!(
            ClientScope::of_jwt("i", [&b"ab"[..], &b"c"[..]]),
            ClientScope::of_jwt("i", [&b"a"[..], &b"bc"[..]])
        );
        assert_ne!(alice, ClientScope::from_value(b"alice"));
    }

    #[test]
    fn jwts_in_a_client_header_are_noticed() {
        let jwt = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJhIn0.c2ln";
        let bearer = format!("Bearer {jwt}");
        assert!(scope(&[("authorization", &bearer)], &["authorization"]).jwt_like);
        assert!(scope(&[("x-token", jwt)], &["x-token"]).jwt_like);
        assert!(
            !scope(
                &[("authorization", "Bearer sk_live_abc")],
                &["authorization"]
            )
            .jwt_like
        );
        assert!(!scope(&[("authorization", "Bearer eyJ.a")], &["authorization"]).jwt_like);
    }
}
