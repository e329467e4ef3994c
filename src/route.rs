//! Route matching: which configured route, if any, a request belongs to. Pure code, no I/O.
//!
//! A pattern is a `/`-separated list of segments: a literal, `*` (exactly one segment) or a
//! trailing `**` (one or more segments). Request paths are normalised before matching (segments
//! percent-decoded, empty and `.` segments dropped, `..` resolved), so `/pay%6Dents`,
//! `//payments` or `/x/../payments` cannot slip past the `/payments` route. Whatever else an
//! upstream's framework may route to the same handler counts as the route too, so that no
//! variant reaches it unchecked: literals compare without regard to ASCII case (unless
//! `server.case_sensitive_routes`), and a path also matches as it reads with its `;params`
//! dropped and `%2F` taken as a separator (`/payments;x`, `/orders%2F1%2Fcapture`).
//! Config validation refuses two routes that could match the same request, so at most one route
//! matches and the order of routes in the file never matters.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use http::Method;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    One,
    Rest,
}

/// A parsed `path` of a `[[routes]]` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutePattern {
    raw: String,
    segments: Vec<Segment>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PatternError {
    #[error("a path starting with \"/\", such as \"/payments\" or \"/orders/*/capture\"")]
    NotAbsolute,
    #[error(
        "\"**\" only as the last segment (\"/files/**\"); \"*\" and \"**\" only as whole segments"
    )]
    BadWildcard,
    #[error("a path without query (\"?\") or fragment (\"#\")")]
    HasQuery,
}

impl RoutePattern {
    pub fn parse(raw: &str) -> Result<Self, PatternError> {
        let rest = raw.strip_prefix('/').ok_or(PatternError::NotAbsolute)?;
        if raw.contains('?') || raw.contains('#') {
            return Err(PatternError::HasQuery);
        }
        let mut segments = Vec::new();
        let parts: Vec<&str> = split_segments(rest).collect();
        for (i, part) in parts.iter().enumerate() {
            let seg = match *part {
                "*" => Segment::One,
                "**" if i + 1 == parts.len() => Segment::Rest,
                p if p.contains('*') => return Err(PatternError::BadWildcard),
                p => Segment::Literal(decode(p).into_owned()),
            };
            segments.push(seg);
        }
        Ok(RoutePattern {
            raw: raw.to_string(),
            segments,
        })
    }

    /// Whether the request path (without query) matches, case-sensitively and as written; see
    /// [`Router::find`] for every variant.
    pub fn matches(&self, path: &str) -> bool {
        normalize(path).is_some_and(|parts| self.matches_segments(&parts, true))
    }

    /// Whether already normalised segments match.
    fn matches_segments(&self, parts: &[Cow<'_, str>], case_sensitive: bool) -> bool {
        let mut parts = parts.iter();
        for seg in &self.segments {
            match seg {
                Segment::Rest => return parts.next().is_some(),
                Segment::One => {
                    if parts.next().is_none() {
                        return false;
                    }
                }
                Segment::Literal(lit) => match parts.next() {
                    Some(p) if p.as_ref() == lit.as_str() => {}
                    Some(p) if !case_sensitive && p.eq_ignore_ascii_case(lit) => {}
                    _ => return false,
                },
            }
        }
        parts.next().is_none()
    }

    /// A path both patterns match, if there is one.
    pub fn overlap_example(&self, other: &RoutePattern) -> Option<String> {
        let (a, b) = (&self.segments, &other.segments);
        let mut example = String::new();
        let mut i = 0;
        loop {
            match (a.get(i), b.get(i)) {
                (None, None) => break,
                (Some(Segment::Rest), Some(_)) | (Some(_), Some(Segment::Rest)) => {
                    // `**` takes whatever the other has left, as long as it is at least one segment.
                    let longer = if matches!(a.get(i), Some(Segment::Rest)) {
                        b
                    } else {
                        a
                    };
                    for seg in &longer[i..] {
                        push_example(&mut example, seg);
                    }
                    break;
                }
                // Compared as requests are by default: routes differing only in case overlap.
                (Some(Segment::Literal(x)), Some(Segment::Literal(y)))
                    if !x.eq_ignore_ascii_case(y) =>
                {
                    return None
                }
                (Some(Segment::Literal(x)), Some(_)) | (Some(_), Some(Segment::Literal(x))) => {
                    example.push('/');
                    example.push_str(x);
                }
                (Some(Segment::One), Some(Segment::One)) => example.push_str("/x"),
                _ => return None,
            }
            i += 1;
        }
        if example.is_empty() {
            example.push('/');
        }
        Some(example)
    }
}

fn push_example(out: &mut String, seg: &Segment) {
    match seg {
        Segment::Literal(l) => {
            out.push('/');
            out.push_str(l);
        }
        Segment::One | Segment::Rest => out.push_str("/x"),
    }
}

impl fmt::Display for RoutePattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.raw)
    }
}

/// A request path as segments, normalised as most upstream servers do: percent-decoded, empty
/// and `.` segments dropped, `..` resolved. Otherwise `//payments` or `/x/../payments` would
/// reach `/payments` unprotected. `None` for a path that does not start with `/`.
fn normalize(path: &str) -> Option<Vec<Cow<'_, str>>> {
    let rest = path.strip_prefix('/')?;
    let mut parts: Vec<Cow<'_, str>> = Vec::with_capacity(8);
    for raw in rest.split('/') {
        let seg = decode(raw);
        match seg.as_ref() {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            _ => parts.push(seg),
        }
    }
    Some(parts)
}

/// The path as a framework that drops `;params` and decodes `%2F` before routing reads it;
/// `None` when that reads the same as [`normalize`].
fn normalize_loose(path: &str) -> Option<Vec<String>> {
    if !path.contains(';') && !path.contains("%2F") && !path.contains("%2f") {
        return None;
    }
    let rest = path.strip_prefix('/')?;
    let mut parts: Vec<String> = Vec::new();
    for raw in rest.split('/') {
        let raw = raw.split(';').next().unwrap_or("");
        for seg in decode(raw).split('/') {
            match seg {
                "" | "." => {}
                ".." => {
                    parts.pop();
                }
                _ => parts.push(seg.to_string()),
            }
        }
    }
    Some(parts)
}

/// The path as a framework that resolves `..` as written and then drops `;params` reads it
/// (`/payments/;/../;jsessionid=1` is `/payments/;jsessionid=1`, then `/payments`: found by
/// cargo-fuzz); `None` without a `;`.
fn normalize_dots_first(path: &str) -> Option<Vec<String>> {
    if !path.contains(';') {
        return None;
    }
    let parts = normalize(path)?;
    Some(
        parts
            .iter()
            .map(|seg| seg.split(';').next().unwrap_or(""))
            .filter(|seg| !seg.is_empty() && *seg != ".")
            .map(str::to_string)
            .collect(),
    )
}

/// The path as a server that also takes `\\` for `/` and decodes more than once reads it (`%5C`,
/// `%255C`, `%2567` for `g`); `None` when it has nothing such a server reads otherwise.
fn normalize_broad(path: &str) -> Option<Vec<String>> {
    let suspicious = |p: &str| p.contains('\\') || p.contains('%');
    if !suspicious(path) {
        return None;
    }
    // Decoded until it no longer changes, a few times at most; each `\\` a `/`.
    let mut text: Cow<'_, str> = Cow::Borrowed(path);
    for _ in 0..4 {
        let decoded = percent_encoding::percent_decode_str(&text)
            .decode_utf8_lossy()
            .into_owned();
        if decoded == text {
            break;
        }
        text = Cow::Owned(decoded);
    }
    let text = text.replace('\\', "/");
    let rest = text.strip_prefix('/')?;
    let mut parts: Vec<String> = Vec::new();
    for raw in rest.split('/') {
        match raw.split(';').next().unwrap_or("") {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            seg => parts.push(seg.to_string()),
        }
    }
    Some(parts)
}

/// Splits `a/b/` into `a`, `b`: one trailing slash does not make an extra (empty) segment.
fn split_segments(rest: &str) -> impl Iterator<Item = &str> {
    let trimmed = rest.strip_suffix('/').unwrap_or(rest);
    let empty = trimmed.is_empty();
    trimmed.split('/').filter(move |_| !empty)
}

fn decode(segment: &str) -> Cow<'_, str> {
    percent_encoding::percent_decode_str(segment).decode_utf8_lossy()
}

/// What the router needs to know of a route; the rest is the caller's.
pub trait Routed {
    fn pattern(&self) -> &RoutePattern;
    fn methods(&self) -> &[Method];
}

/// The routes of one config, each found by method and path.
#[derive(Debug)]
pub struct Router<T> {
    routes: Vec<Arc<T>>,
    case_sensitive: bool,
}

impl<T: Routed> Router<T> {
    pub fn new(routes: impl IntoIterator<Item = T>, case_sensitive: bool) -> Self {
        Router {
            routes: routes.into_iter().map(Arc::new).collect(),
            case_sensitive,
        }
    }

    /// Every route, in config order.
    pub fn routes(&self) -> &[Arc<T>] {
        &self.routes
    }

    /// The route this request belongs to. Config validation refuses overlapping routes, so
    /// there is at most one.
    pub fn find(&self, method: &Method, path: &str) -> Option<&Arc<T>> {
        let by_method = || self.routes.iter().filter(|r| r.methods().contains(method));
        by_method().next()?;
        let cs = self.case_sensitive;
        let parts = normalize(path)?;
        if let Some(r) = by_method().find(|r| r.pattern().matches_segments(&parts, cs)) {
            return Some(r);
        }
        for loose in [normalize_loose(path), normalize_dots_first(path)]
            .into_iter()
            .flatten()
        {
            let loose: Vec<Cow<'_, str>> = loose.into_iter().map(Cow::Owned).collect();
            if let Some(r) = by_method().find(|r| r.pattern().matches_segments(&loose, cs)) {
                return Some(r);
            }
        }
        let broad: Vec<Cow<'_, str>> = normalize_broad(path)?.into_iter().map(Cow::Owned).collect();
        by_method().find(|r| r.pattern().matches_segments(&broad, cs))
    }

    /// A route `guards` says protects its path whose path this is, for any method, however
    /// spelled (any case, `;params`, `%2F`, `\\`, encoded twice): what a request must not pass
    /// by. With `found` (the route the request was found for), only a reading of the path that
    /// `found` does not match counts: `/api/..%5Cwebhooks` is `/api/*`'s as written, and
    /// `/webhooks`'s to a server that takes `\\` for `/`.
    pub fn guarded(
        &self,
        path: &str,
        guards: impl Fn(&T) -> bool,
        found: Option<&Arc<T>>,
    ) -> Option<&Arc<T>> {
        let mut guarded = self.routes.iter().filter(|r| guards(r)).peekable();
        guarded.peek()?;
        let spellings: Vec<Vec<Cow<'_, str>>> = [
            normalize(path),
            normalize_loose(path).map(|p| p.into_iter().map(Cow::Owned).collect()),
            normalize_dots_first(path).map(|p| p.into_iter().map(Cow::Owned).collect()),
            normalize_broad(path).map(|p| p.into_iter().map(Cow::Owned).collect()),
        ]
        .into_iter()
        .flatten()
        .collect();
        let found_reads = |parts: &[Cow<'_, str>]| {
            found.is_some_and(|f| f.pattern().matches_segments(parts, false))
        };
        guarded.find(|r| {
            !found.is_some_and(|f| Arc::ptr_eq(f, r))
                && spellings
                    .iter()
                    .any(|parts| r.pattern().matches_segments(parts, false) && !found_reads(parts))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn p(s: &str) -> RoutePattern {
        RoutePattern::parse(s).unwrap()
    }

    struct R(RoutePattern);
    impl Routed for R {
        fn pattern(&self) -> &RoutePattern {
            &self.0
        }
        fn methods(&self) -> &[Method] {
            std::slice::from_ref(&Method::POST)
        }
    }

    fn router(case_sensitive: bool) -> Router<R> {
        Router::new(
            [p("/payments"), p("/orders/*/capture")].map(R),
            case_sensitive,
        )
    }

    fn found(r: &Router<R>, path: &str) -> Option<String> {
        r.find(&Method::POST, path).map(|r| r.0.raw.clone())
    }

    /// Variants that some framework routes to the same handler are the route too.
    #[test]
    fn variants_an_upstream_may_route_alike_are_the_route() {
        let r = router(false);
        for path in [
            "/PAYMENTS",
            "/Payments/",
            "/payments;jsessionid=1",
            "/payments;x/",
            "/x%2F..%2Fpayments",
            "/pay%6Dents",
        ] {
            assert_eq!(found(&r, path).as_deref(), Some("/payments"), "{path}");
        }
        for path in [
            "/orders%2F1%2Fcapture",
            "/orders;v=1/1/CAPTURE",
            "/orders/a%2Fb/capture",
        ] {
            assert_eq!(
                found(&r, path).as_deref(),
                Some("/orders/*/capture"),
                "{path}"
            );
        }
        for path in [
            "/orders\\1\\capture",
            "/orders/1/%2563apture",
            "/orders%5C1%5Ccapture",
        ] {
            assert_eq!(
                found(&r, path).as_deref(),
                Some("/orders/*/capture"),
                "{path}"
            );
        }
        assert_eq!(found(&r, "/payment"), None);
        assert_eq!(found(&r, "/payments/1"), None);
        assert_eq!(r.find(&Method::GET, "/payments").map(|_| ()), None);
    }

    #[test]
    fn a_guarded_path_is_found_for_any_method_and_spelling() {
        let r = router(true);
        let all = |_: &R| true;
        for path in [
            "/payments",
            "/PAYMENTS",
            "/pay%256Dents",
            "/orders\\1\\capture",
        ] {
            assert!(r.guarded(path, all, None).is_some(), "{path}");
        }
        assert!(r.guarded("/payments/1", all, None).is_none());
        assert!(r.guarded("/payments", |_| false, None).is_none());
        // Found for one route as written, another's to a server that takes `\\` for `/`.
        let r = Router::new([p("/api/*"), p("/webhooks/stripe")].map(R), false);
        let signed = |x: &R| x.0.raw == "/webhooks/stripe";
        let path = "/api/..%5Cwebhooks%5Cstripe";
        let found = r.find(&Method::POST, path);
        assert_eq!(found.map(|f| f.0.raw.as_str()), Some("/api/*"));
        let guard = r.guarded(path, signed, found);
        assert_eq!(guard.map(|g| g.0.raw.as_str()), Some("/webhooks/stripe"));
        let own = r.find(&Method::POST, "/api/x");
        assert!(r.guarded("/api/x", signed, own).is_none());
    }

    #[test]
    fn case_sensitive_routes_compare_case() {
        let r = router(true);
        assert_eq!(found(&r, "/PAYMENTS"), None);
        assert_eq!(found(&r, "/payments;x").as_deref(), Some("/payments"));
    }

    #[test]
    fn routes_differing_only_in_case_overlap() {
        assert!(p("/Payments").overlap_example(&p("/payments")).is_some());
    }

    #[test]
    fn exact_paths() {
        let pat = p("/payments");
        assert!(pat.matches("/payments"));
        assert!(pat.matches("/payments/"));
        assert!(pat.matches("/pay%6Dents"));
        assert!(pat.matches("//payments"));
        assert!(pat.matches("/./payments"));
        assert!(pat.matches("/x/../payments"));
        assert!(pat.matches("/x/%2e%2e/payments"));
        assert!(pat.matches("/payments/x/.."));
        assert!(!pat.matches("/payments/../refunds"));
        assert!(!pat.matches("/payments/1"));
        assert!(!pat.matches("/payment"));
        assert!(!pat.matches("/"));
        assert!(!pat.matches("payments"));
    }

    #[test]
    fn root_only_matches_root() {
        let pat = p("/");
        assert!(pat.matches("/"));
        assert!(!pat.matches("/a"));
    }

    #[test]
    fn one_segment_wildcard() {
        let pat = p("/orders/*/capture");
        assert!(pat.matches("/orders/42/capture"));
        assert!(!pat.matches("/orders/capture"));
        assert!(!pat.matches("/orders/4/2/capture"));
        assert!(!pat.matches("/orders/42/capture/now"));
    }

    #[test]
    fn rest_wildcard_needs_one_segment() {
        let pat = p("/files/**");
        assert!(pat.matches("/files/a"));
        assert!(pat.matches("/files/a/b/c"));
        assert!(!pat.matches("/files"));
        assert!(!pat.matches("/files/"));
        assert!(!pat.matches("/other/a"));
    }

    #[test]
    fn bad_patterns_are_refused() {
        assert_eq!(
            RoutePattern::parse("payments"),
            Err(PatternError::NotAbsolute)
        );
        assert_eq!(
            RoutePattern::parse("/a/**/b"),
            Err(PatternError::BadWildcard)
        );
        assert_eq!(RoutePattern::parse("/a*"), Err(PatternError::BadWildcard));
        assert_eq!(RoutePattern::parse("/a?x=1"), Err(PatternError::HasQuery));
    }

    #[test]
    fn overlaps() {
        assert_eq!(
            p("/orders/*/capture").overlap_example(&p("/orders/42/capture")),
            Some("/orders/42/capture".into())
        );
        assert_eq!(
            p("/files/**").overlap_example(&p("/files/a/b")),
            Some("/files/a/b".into())
        );
        assert_eq!(p("/files/**").overlap_example(&p("/files")), None);
        assert_eq!(p("/a").overlap_example(&p("/b")), None);
        assert_eq!(p("/a/*").overlap_example(&p("/a")), None);
        assert_eq!(p("/*/b").overlap_example(&p("/a/*")), Some("/a/b".into()));
        assert_eq!(p("/").overlap_example(&p("/")), Some("/".into()));
    }

    fn segment() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("a".to_string()),
            Just("b".to_string()),
            Just("*".to_string())
        ]
    }

    fn concrete() -> impl Strategy<Value = String> {
        prop::collection::vec(prop_oneof![Just("a"), Just("b"), Just("c")], 0..5)
            .prop_map(|s| format!("/{}", s.join("/")))
    }

    fn pattern() -> impl Strategy<Value = String> {
        (prop::collection::vec(segment(), 0..4), any::<bool>()).prop_map(|(s, rest)| {
            let mut out = format!("/{}", s.join("/"));
            if rest {
                out.push_str(if out.ends_with('/') { "**" } else { "/**" });
            }
            out
        })
    }

    proptest! {
        /// The overlap check is exact: it finds a shared path whenever some concrete path matches
        /// both patterns, and the example it gives really matches both.
        #[test]
        fn overlap_is_exact(a in pattern(), b in pattern(), paths in prop::collection::vec(concrete(), 0..40)) {
            let (pa, pb) = (p(&a), p(&b));
            match pa.overlap_example(&pb) {
                Some(ex) => {
                    prop_assert!(pa.matches(&ex), "{a} should match its example {ex}");
                    prop_assert!(pb.matches(&ex), "{b} should match its example {ex}");
                }
                None => {
                    for path in paths {
                        prop_assert!(!(pa.matches(&path) && pb.matches(&path)), "{a} and {b} both match {path}");
                    }
                }
            }
        }

        #[test]
        fn matching_never_panics(pat in pattern(), path in ".{0,40}") {
            let _ = p(&pat).matches(&path);
        }
    }
}
