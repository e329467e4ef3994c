//! The client scope an operator names, derived as the gateway derives it for a request: a
//! client header's value (canonical, in its place of the route's list), a JWT client's issuer
//! and claims, or the anonymous or shared scope.

use http::HeaderName;

use super::{ClientName, OperatorError};
use crate::config::Policy;
use crate::key::{canonical_value, ClientScope};

/// The scope, and what it is, in words.
pub(super) fn of(
    policy: &Policy,
    client: &ClientName,
) -> Result<(ClientScope, String), OperatorError> {
    let bad = |why: String| Err(OperatorError::Client(why));
    if let Some(jwt) = &policy.client_jwt {
        if client.claims.is_empty() && client.issuer.is_none() {
            if client.value.is_some() {
                return bad("this route scopes keys by a verified JWT (client_jwt): name its client with --jwt-claim NAME=VALUE (and --jwt-issuer when the route accepts several issuers), not --client".into());
            }
            return Ok((
                ClientScope::anonymous(),
                "the anonymous scope (requests without a token)".into(),
            ));
        }
        let issuer = match (&client.issuer, jwt.issuers.as_slice()) {
            (Some(i), issuers) if issuers.contains(i) => i.clone(),
            (None, [only]) => only.clone(),
            (given, issuers) => {
                return bad(format!(
                    "--jwt-issuer {given:?}: the route accepts {issuers:?}; name one of them"
                ));
            }
        };
        let mut values = Vec::with_capacity(jwt.claims.len());
        for name in &jwt.claims {
            match client.claims.iter().find(|(n, _)| n == name) {
                Some((_, v)) => values.push(v.as_bytes()),
                None => return bad(format!("give --jwt-claim {name}=VALUE: the route's scope is the issuer and the claims {:?}", jwt.claims)),
            }
        }
        if let Some((extra, _)) = client.claims.iter().find(|(n, _)| !jwt.claims.contains(n)) {
            return bad(format!(
                "--jwt-claim {extra}: not one of the route's scope claims {:?}",
                jwt.claims
            ));
        }
        let named: Vec<String> = (jwt.claims.iter().zip(&values))
            .map(|(n, v)| format!("{n}={}", String::from_utf8_lossy(v)))
            .collect();
        let said = format!("the JWT client iss={issuer} {}", named.join(" "));
        return Ok((ClientScope::of_jwt(&issuer, values), said));
    }
    if policy.client_headers.is_empty() {
        return Ok((
            ClientScope::shared(),
            "the one scope every caller shares (client_header = \"\")".into(),
        ));
    }
    let Some(value) = &client.value else {
        return Ok((
            ClientScope::anonymous(),
            "the anonymous scope (requests with no client header)".into(),
        ));
    };
    let place = match &client.header {
        None => 0,
        Some(name) => match (policy.client_headers.iter())
            .position(|h| h.as_str().eq_ignore_ascii_case(name))
        {
            Some(place) => place,
            None => {
                return bad(format!(
                    "--client-header {name}: not one of the route's client_header {:?}",
                    names(&policy.client_headers)
                ))
            }
        },
    };
    let Some(header) = policy.client_headers.get(place) else {
        return bad("the route names no client header".into());
    };
    let canonical = canonical_value(header, value.as_bytes());
    Ok((
        ClientScope::of_header(place, header, &canonical),
        format!("the {header} header's value"),
    ))
}

fn names(headers: &[HeaderName]) -> Vec<&str> {
    headers.iter().map(HeaderName::as_str).collect()
}
