//! What `idemgate check` prints: the configuration as the gateway resolved it (every default
//! applied), one line per listener, store, upstream and route, and never a secret.

use std::fmt::Write;

use http::{HeaderName, Method};

use crate::config::{
    redact_url, Config, Policy, RedisTarget, RouteConfig, SignatureScheme, StoreConfig, SyncMode,
};

fn shown(d: std::time::Duration) -> humantime::FormattedDuration {
    humantime::format_duration(d)
}

/// A human-readable list of the resolved settings and routes.
pub fn describe(config: &Config) -> String {
    let mut out = String::new();
    server(&mut out, config);
    let _ = writeln!(out, "{}", store(&config.store));
    let _ = writeln!(
        out,
        "default upstream {} (at most {} connections to each upstream, idle ones reused for {})",
        config.upstream,
        config.upstream_max_connections,
        shown(config.upstream_idle_timeout)
    );
    for r in &config.routes {
        route(&mut out, r);
    }
    let _ = writeln!(
        out,
        "everything else: passed through to {}",
        config.upstream
    );
    out
}

fn server(out: &mut String, config: &Config) {
    let server = &config.server;
    let _ = writeln!(out, "listen {}", server.listen);
    let d = &server.deadlines;
    let _ = writeln!(
        out,
        "connections: max {}, header_timeout {}, body_timeout {}, idle_timeout {}, send_timeout {}, max_streams {}, max_buffered {}",
        server.max_connections,
        shown(d.header),
        shown(d.body),
        shown(d.idle),
        shown(d.send),
        server.max_streams,
        server.max_buffered
    );
    if !server.trusted_proxies.is_empty() {
        let list: Vec<String> = server
            .trusted_proxies
            .iter()
            .map(ToString::to_string)
            .collect();
        let _ = writeln!(out, "trusted proxies: {}", list.join(", "));
    }
    if let Some(name) = &server.method_override_header {
        let _ = writeln!(
            out,
            "method override: a POST with {name} is routed and fingerprinted as the method it names"
        );
    }
}

fn store(store: &StoreConfig) -> String {
    match store {
        StoreConfig::Memory {
            max_keys,
            max_bytes,
        } => format!("store memory (max_keys {max_keys}, max_bytes {max_bytes})"),
        StoreConfig::Disk(d) => {
            let sync = match d.sync {
                SyncMode::Always => "always".to_string(),
                SyncMode::Batch { interval } => format!("batch every {}", shown(interval)),
            };
            format!(
                "store disk {} (sync {sync}, max_disk {})",
                d.path.display(),
                d.max_disk
            )
        }
        StoreConfig::Postgres(p) => format!(
            "store postgres {} (table {}, pool_size {}, command_timeout {})",
            redact_url(&p.url),
            p.table,
            p.pool_size,
            shown(p.command_timeout)
        ),
        StoreConfig::Redis(r) => {
            let target = match &r.target {
                RedisTarget::Single(u) => redact_url(u),
                RedisTarget::Cluster(nodes) => format!(
                    "cluster [{}]",
                    nodes
                        .iter()
                        .map(|u| redact_url(u))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                RedisTarget::Sentinel { sentinels, master } => format!(
                    "primary {master:?} through sentinels [{}]",
                    sentinels
                        .iter()
                        .map(|u| redact_url(u))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            };
            let replicas = match r.replicas {
                None => String::new(),
                Some(acks) => format!(", min_replicas {} within {}", acks.min, shown(acks.timeout)),
            };
            format!(
                "store redis {target} (key_prefix {:?}, command_timeout {}{replicas})",
                r.key_prefix,
                shown(r.command_timeout)
            )
        }
    }
}

fn route(out: &mut String, r: &RouteConfig) {
    let methods: Vec<&str> = r.methods.iter().map(Method::as_str).collect();
    let p = &r.policy;
    let _ = writeln!(
        out,
        "route {:?}: {} {} -> {} (key from {}, require_key {}, ttl {}, lock_timeout {}, wait {}, max_waiters {}, mismatch {}, client scope {}, max_keys_per_client {}, max_keys_anonymous {}, anonymous_share {}%, max_body {}, max_stored_response {}, upstream_timeout {}, store_server_errors {}, unknown_statuses {:?}, on_store_error {:?}, on_unknown {:?})",
        r.name,
        methods.join(","),
        r.pattern,
        r.upstream,
        r.key.describe(),
        p.require_key,
        shown(p.ttl),
        shown(p.lock_timeout),
        shown(p.wait),
        p.max_waiters,
        p.mismatch_status.as_u16(),
        client_scope(p),
        p.max_keys_per_client,
        p.max_keys_anonymous,
        p.anonymous_share,
        p.max_body,
        p.max_stored_response,
        shown(p.upstream_timeout),
        p.store_server_errors,
        p.unknown_statuses.codes(),
        p.on_store_error,
        p.on_unknown,
    );
    fingerprint(out, r);
    signature(out, r);
    answers(out, r);
}

/// How the route's own answers speak to SDKs, where they are not the built-in ones.
fn answers(out: &mut String, r: &RouteConfig) {
    let a = &r.policy.answers;
    if a.is_builtin() {
        return;
    }
    let hints: Vec<&str> = a.hints().iter().map(HeaderName::as_str).collect();
    let hints = match hints.is_empty() {
        true => "none".to_string(),
        false => hints.join(", "),
    };
    let body = match a.error_body() {
        Some(b) => format!(
            "error_body {}",
            b.content_type.to_str().unwrap_or("(not text)")
        ),
        None => "problem+json".to_string(),
    };
    let _ = writeln!(out, "  answers: retry hints {hints}; {body}");
}

/// What besides method, path, query and body tells this route's requests apart, and whether
/// a reused key is checked at all.
fn fingerprint(out: &mut String, r: &RouteConfig) {
    let p = &r.policy;
    if !p.fingerprint_headers.is_empty() {
        let names: Vec<&str> = p
            .fingerprint_headers
            .iter()
            .map(HeaderName::as_str)
            .collect();
        let _ = writeln!(out, "  fingerprint_headers {}", names.join(", "));
    }
    if !r.check_fingerprint {
        let _ = writeln!(
            out,
            "  check_fingerprint false: a reused key gets the stored answer whatever the request{}",
            if r.key.pointers.is_empty() {
                " (a key the client picks: unchecked_header_key)"
            } else {
                ""
            }
        );
    }
}

/// The scheme and how many secrets, never a secret; and the key's headers a captured delivery
/// could change.
fn signature(out: &mut String, r: &RouteConfig) {
    let Some(sig) = &r.signature else {
        return;
    };
    let timestamps = if sig.scheme.is_timestamped() {
        format!(", timestamps within {}", shown(sig.tolerance))
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "  signature {} ({} secret{}{timestamps}): deliveries that fail get 401",
        sig.scheme.name(),
        sig.secrets.len(),
        if sig.secrets.len() == 1 { "" } else { "s" },
    );
    // Only Standard Webhooks signs its id; any other header in the key can be changed on a
    // captured delivery, which then runs again under the new key.
    let signed_id = |h: &HeaderName| {
        sig.scheme == SignatureScheme::StandardWebhooks
            && matches!(h.as_str(), "webhook-id" | "svix-id")
    };
    for h in r.key.headers.iter().filter(|h| !signed_id(h)) {
        let _ = writeln!(
            out,
            "  note: the key's header {h} is not covered by the signature: a captured delivery sent again with another {h} runs again"
        );
    }
}

/// How a route tells clients apart.
fn client_scope(p: &Policy) -> String {
    let required = if p.require_client { ", required" } else { "" };
    if let Some(jwt) = &p.client_jwt {
        return format!(
            "JWT in {} verified with {} (iss {}, {}){required}",
            jwt.header,
            jwt.keys.describe(),
            jwt.issuers.join(" or "),
            jwt.claims.join(", ")
        );
    }
    if p.client_headers.is_empty() {
        return "(one scope)".into();
    }
    let names: Vec<&str> = p.client_headers.iter().map(HeaderName::as_str).collect();
    format!("{}{required}", names.join(" or "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(extra: &str) -> Config {
        Config::parse(&format!(
            "[server]\nlisten = \"127.0.0.1:8080\"\n[upstream]\nurl = \"http://127.0.0.1:3000\"\n{extra}"
        ))
        .unwrap()
    }

    #[test]
    fn lists_routes_with_every_default_applied() {
        let text = describe(&parsed("[[routes]]\npath = \"/payments\"\n"));
        assert!(
            text.contains("route \"/payments\": POST /payments -> http://127.0.0.1:3000"),
            "{text}"
        );
        assert!(text.contains("ttl 1day"), "{text}");
        assert!(text.contains("store memory"), "{text}");
    }

    #[test]
    fn a_route_s_own_answers_are_shown() {
        let text = describe(&parsed(
            "[[routes]]\npath = \"/a\"\nretry_hint_headers = [\"x-should-retry\", \"stripe-should-retry\"]\nerror_body = { template = '{\"error\": {\"code\": \"{code}\"}}' }\n[[routes]]\npath = \"/b\"\nretry_hint_headers = []\n[[routes]]\npath = \"/c\"\n",
        ));
        assert!(
            text.contains("  answers: retry hints x-should-retry, stripe-should-retry; error_body application/json"),
            "{text}"
        );
        assert!(
            text.contains("  answers: retry hints none; problem+json"),
            "{text}"
        );
        assert_eq!(
            text.matches("answers:").count(),
            2,
            "none for the built-in: {text}"
        );
    }

    #[test]
    fn a_method_override_header_is_shown() {
        let config = Config::parse(
            "[server]\nlisten = \"127.0.0.1:8080\"\nmethod_override_header = \"X-HTTP-Method-Override\"\n[upstream]\nurl = \"http://127.0.0.1:3000\"\n",
        )
        .unwrap();
        let text = describe(&config);
        assert!(
            text.contains("method override: a POST with x-http-method-override"),
            "{text}"
        );
        assert!(!describe(&parsed("")).contains("method override"));
    }

    #[test]
    fn stores_are_shown_without_passwords() {
        let text = describe(&parsed(
            "[store]\nbackend = \"redis\"\nurl = \"redis://user:s3cret@10.0.0.5:6380/2\"\n",
        ));
        assert!(text.contains("redis://user:***@10.0.0.5:6380/2"), "{text}");
        assert!(!text.contains("s3cret"), "{text}");
        let text = describe(&parsed(
            "[store]\nbackend = \"redis\"\nsentinels = [\"redis://:s3cret@10.0.0.6:26379\"]\nmaster = \"pay\"\nmin_replicas = 1\n",
        ));
        assert!(
            text.contains("primary \"pay\" through sentinels [redis://:***@10.0.0.6:26379]")
                && text.contains("min_replicas 1 within 1s"),
            "{text}"
        );
        assert!(!text.contains("s3cret"), "{text}");
        let text = describe(&parsed(
            "[store]\nbackend = \"disk\"\npath = \"/var/lib/idemgate\"\nsync = \"batch\"\nsync_interval = \"20ms\"\n",
        ));
        assert!(
            text.contains("store disk /var/lib/idemgate (sync batch every 20ms"),
            "{text}"
        );
    }

    #[test]
    fn signatures_are_shown_without_their_secrets() {
        let dir = std::env::temp_dir().join(format!("idemgate-describe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("secret");
        std::fs::write(&file, "topsecretvalue\n").unwrap();
        let text = describe(&parsed(&format!(
            "[[routes]]\npath = \"/hooks\"\nkey = {{ header = \"x-delivery\" }}\nsignature = {{ scheme = \"github\", secret_file = \"{}\" }}\n",
            file.display()
        )));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(text.contains("signature github (1 secret)"), "{text}");
        assert!(text.contains("note: the key's header x-delivery"), "{text}");
        assert!(!text.contains("topsecretvalue"), "{text}");
    }
}
