//! Phase `classify`, for upstreams that take a POST's method from a header
//! (`server.method_override_header`, such as `X-HTTP-Method-Override`): the request is routed
//! and fingerprinted as the method the upstream will run, and forwarded as it came.
//!
//! Only a POST is overridden, as Rails, Express's method-override and ASP.NET Core's middleware
//! and Laravel do, and only to a method those accept. Since the upstream may not honour the
//! header after all, an override never loosens what the POST's own route checks: one that names
//! a method with no route stays on the POST's route (keyed and checked as it; its fingerprint
//! still has the named method), and one whose route lacks a guard the POST's route has (its
//! signature, `client_jwt`, `require_key`, `require_client`) is refused. A value the frameworks
//! would not take (two values, an unknown method) leaves the request a POST, refused on an
//! idempotent route, since what the upstream makes of it cannot be told.

use http::{HeaderMap, HeaderName, Method};

use super::Route;

/// The method an overriding header named, carried in the request's extensions to the
/// fingerprint (never sent: extensions stay in the process).
#[derive(Debug, Clone)]
pub(super) struct Overridden(pub(super) Method);

/// What a request's override header says.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Override {
    /// None applies: routed as its own method.
    None,
    /// Routed and fingerprinted as this method.
    To(Method),
    /// A value the upstream might read otherwise: routed as a POST, refused on an idempotent
    /// route.
    Unreadable,
}

/// The methods an upstream framework accepts as an override.
/// Not HEAD: its answer has no body whatever its headers say, which a POST forwarded as it came
/// could not be read as.
const OVERRIDABLE: [Method; 5] = [
    Method::GET,
    Method::PUT,
    Method::PATCH,
    Method::DELETE,
    Method::OPTIONS,
];

pub(super) fn of(method: &Method, headers: &HeaderMap, header: Option<&HeaderName>) -> Override {
    let Some(header) = header else {
        return Override::None;
    };
    if method != Method::POST {
        return Override::None;
    }
    let mut values = headers.get_all(header).iter();
    let Some(value) = values.next() else {
        return Override::None;
    };
    if values.next().is_some() {
        return Override::Unreadable;
    }
    let value = value.as_bytes().trim_ascii();
    if value.eq_ignore_ascii_case(b"POST") {
        return Override::None;
    }
    match OVERRIDABLE
        .iter()
        .find(|m| value.eq_ignore_ascii_case(m.as_str().as_bytes()))
    {
        Some(m) => Override::To(m.clone()),
        None => Override::Unreadable,
    }
}

/// Whether the `named` route checks at least what the POST's `own` route does.
pub(super) fn keeps_guards(named: &Route, own: &Route) -> bool {
    let (named, own) = (&named.config, &own.config);
    let same_or_none = |a: bool, b: bool| !a || b;
    (own.signature.is_none() || own.signature == named.signature)
        && (own.policy.client_jwt.is_none() || own.policy.client_jwt == named.policy.client_jwt)
        && same_or_none(own.policy.require_key, named.policy.require_key)
        && same_or_none(own.policy.require_client, named.policy.require_client)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append("x-http-method-override", v.parse().unwrap());
        }
        h
    }

    #[test]
    fn a_post_is_overridden_to_a_method_frameworks_accept() {
        let name = HeaderName::from_static("x-http-method-override");
        let of = |method: &Method, values: &[&str]| of(method, &with(values), Some(&name));
        assert_eq!(of(&Method::POST, &["DELETE"]), Override::To(Method::DELETE));
        assert_eq!(of(&Method::POST, &[" patch "]), Override::To(Method::PATCH));
        assert_eq!(of(&Method::POST, &["POST"]), Override::None);
        assert_eq!(of(&Method::POST, &[]), Override::None);
        assert_eq!(
            of(&Method::PUT, &["DELETE"]),
            Override::None,
            "a POST's only"
        );
        assert_eq!(of(&Method::POST, &["DELETE", "PUT"]), Override::Unreadable);
        assert_eq!(of(&Method::POST, &["PURGE"]), Override::Unreadable);
        assert_eq!(of(&Method::POST, &["CONNECT"]), Override::Unreadable);
        assert_eq!(of(&Method::POST, &["HEAD"]), Override::Unreadable);
        assert_eq!(
            super::of(&Method::POST, &with(&["DELETE"]), None),
            Override::None,
            "not configured"
        );
    }
}
