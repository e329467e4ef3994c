//! What a route's stored keys are derived from, and the check that a reload does not change it.
//!
//! Every stored key is `SHA-256(client scope, route name, key)`: the route's `name` (its `path`
//! when it has none), the headers that name the client (`client_header`) and where the key
//! comes from (`key`, `key_header`). A reload that changes one of them for requests the running
//! gateway already serves makes every key stored for them unreachable: a completed payment's
//! retry would run again, and so would an unknown outcome's, beside an original still in
//! flight. Such a reload is refused ([`rekeyed`]); a restart applies it, on purpose
//! (docs/operations.md, "Reloading the config").

use http::Method;

use super::RouteConfig;
use crate::route::RoutePattern;

/// The parts of a route that its stored keys are derived from, with what it matches: as the
/// running gateway reports them (`GET /routes` on the admin listener) and as a config says.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KeyIdentity {
    pub name: String,
    /// Whether `name` was written in the config, rather than taken from `path`.
    pub named: bool,
    pub path: String,
    pub methods: Vec<String>,
    /// `client_header`, in order (empty where `client_jwt` names the client).
    pub client_headers: Vec<String>,
    /// `client_jwt`'s header, then its scope claims in order (with the token's `iss`), where it
    /// names the client: a token looked for elsewhere is, for a client that keeps sending it
    /// where it did, no token (the anonymous scope).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_jwt: Option<Vec<String>>,
    /// Where the key comes from: headers, then body fields.
    pub key: Vec<String>,
}

impl KeyIdentity {
    pub fn of(route: &RouteConfig) -> KeyIdentity {
        KeyIdentity {
            name: route.name.clone(),
            named: route.named,
            path: route.pattern.to_string(),
            methods: route.methods.iter().map(|m| m.to_string()).collect(),
            client_headers: match (&route.policy.client_jwt, &route.signature) {
                (Some(_), _) => Vec::new(),
                // A signed route's deliveries are its sender's, in one scope whatever header
                // they carry: the anonymous one where clients are named, else the shared one.
                (None, Some(_)) if route.policy.client_headers.is_empty() => Vec::new(),
                (None, Some(_)) => vec!["(signed: one scope)".to_string()],
                (None, None) => (route.policy.client_headers.iter())
                    .map(|h| h.as_str().to_string())
                    .collect(),
            },
            client_jwt: (route.policy.client_jwt.as_ref()).map(|j| {
                std::iter::once(format!("header {}", j.header))
                    .chain(j.claims.iter().cloned())
                    .collect()
            }),
            key: (route.key.headers.iter().map(|h| h.as_str().to_string()))
                .chain(route.key.pointers.iter().map(|p| format!("body {p}")))
                .collect(),
        }
    }

    /// A path both routes match with a method both take, if there is one.
    fn shared_request(&self, other: &KeyIdentity) -> Option<String> {
        let method = self
            .methods
            .iter()
            .find(|m| other.methods.contains(m))
            .and_then(|m| m.parse::<Method>().ok())?;
        let (a, b) = (
            RoutePattern::parse(&self.path).ok()?,
            RoutePattern::parse(&other.path).ok()?,
        );
        a.overlap_example(&b).map(|path| format!("{method} {path}"))
    }
}

/// Why a reload from `running` to `new` would change the keys of requests the running gateway
/// already serves: one line per pair of routes that match the same requests and derive their
/// keys differently. Empty when it would not.
pub fn rekeyed(running: &[KeyIdentity], new: &[KeyIdentity]) -> Vec<String> {
    let mut why = Vec::new();
    for old in running {
        for now in new {
            let Some(request) = old.shared_request(now) else {
                continue;
            };
            let mut changed = Vec::new();
            if old.name != now.name {
                let from_path = |r: &KeyIdentity| if r.named { "" } else { " (from its path)" };
                changed.push(format!(
                    "its name {:?}{} becomes {:?}{}",
                    old.name,
                    from_path(old),
                    now.name,
                    from_path(now)
                ));
            }
            if old.client_headers != now.client_headers {
                changed.push(format!(
                    "client_header {:?} becomes {:?}",
                    old.client_headers, now.client_headers
                ));
            }
            if old.client_jwt != now.client_jwt {
                let said = |j: &Option<Vec<String>>| match j {
                    Some(named) => format!("the JWT (its {named:?}, with iss)"),
                    None => "a header".to_string(),
                };
                changed.push(format!(
                    "its client scope from {} becomes from {}",
                    said(&old.client_jwt),
                    said(&now.client_jwt)
                ));
            }
            if old.key != now.key {
                changed.push(format!("its key {:?} becomes {:?}", old.key, now.key));
            }
            if !changed.is_empty() {
                why.push(format!(
                    "route {:?} ({request}, ...): {}; every key stored for these requests would be unreachable, and their retries would run again",
                    old.name,
                    changed.join(", ")
                ));
            }
        }
    }
    why
}

/// The routes that take their name from their path: editing the path then changes their keys.
pub fn unnamed(routes: &[RouteConfig]) -> Vec<String> {
    routes
        .iter()
        .filter(|r| !r.named)
        .map(|r| {
            format!(
                "warning: route {:?} has no name: its stored keys follow its path, so editing the path makes them unreachable; give it name = {:?}",
                r.name, r.name
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(name: &str, named: bool, path: &str, client: &str) -> KeyIdentity {
        KeyIdentity {
            name: name.into(),
            named,
            path: path.into(),
            methods: vec!["POST".into()],
            client_headers: vec![client.into()],
            client_jwt: None,
            key: vec!["idempotency-key".into()],
        }
    }

    fn jwt(claims: &[&str]) -> KeyIdentity {
        KeyIdentity {
            client_headers: Vec::new(),
            client_jwt: Some(claims.iter().map(|c| c.to_string()).collect()),
            ..route("pay", true, "/pay", "")
        }
    }

    #[test]
    fn the_same_routes_are_no_change() {
        let routes = [route("pay", true, "/pay", "authorization")];
        assert!(rekeyed(&routes, &routes).is_empty());
    }

    #[test]
    fn a_name_a_path_it_names_or_a_client_header_changed_is_a_change() {
        let pay = || route("pay", true, "/pay", "authorization");
        let cases = [
            (
                pay(),
                route("payments", true, "/pay", "authorization"),
                "\"pay\" becomes \"payments\"",
            ),
            (
                route("/pay/*", false, "/pay/*", "authorization"),
                route("/pay/**", false, "/pay/**", "authorization"),
                "(from its path)",
            ),
            (
                pay(),
                route("pay", true, "/pay", "x-api-key"),
                "client_header",
            ),
            (
                pay(),
                jwt(&["header authorization", "sub"]),
                "becomes from the JWT",
            ),
            (
                jwt(&["header authorization", "sub"]),
                pay(),
                "from a header",
            ),
            (
                jwt(&["header authorization", "sub"]),
                jwt(&["header authorization", "sub", "tenant_id"]),
                "tenant_id",
            ),
            (
                jwt(&["header authorization", "sub"]),
                jwt(&["header x-token", "sub"]),
                "x-token",
            ),
        ];
        for (old, new, said) in cases {
            let why = rekeyed(&[old], &[new]);
            assert_eq!(why.len(), 1, "{why:?}");
            assert!(why[0].contains(said), "{said}: {why:?}");
        }
    }

    #[test]
    fn routes_that_share_no_request_are_no_change() {
        let other_path = rekeyed(
            &[route("pay", true, "/pay", "authorization")],
            &[route("refund", true, "/refund", "authorization")],
        );
        assert!(other_path.is_empty());
        let mut get = route("payments", true, "/pay", "authorization");
        get.methods = vec!["GET".into()];
        assert!(rekeyed(&[route("pay", true, "/pay", "authorization")], &[get]).is_empty());
    }
}
