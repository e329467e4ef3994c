//! The settings of what may follow a commit: `unknown_statuses`, `upstream.idle_timeout`,
//! `store.allow_async_commit`, and the ttl's margin for the store's own time.

use super::*;

/// A config of one route on `store` (its `[store]` lines), with `route` (its lines) and
/// `upstream` (lines of `[upstream]`).
fn config(store: &str, upstream: &str, route: &str) -> Result<Config, ConfigError> {
    Config::parse(&format!(
        "[server]\nlisten = \"127.0.0.1:8080\"\n[store]\n{store}\n[upstream]\nurl = \"http://127.0.0.1:3000\"\n{upstream}\n[[routes]]\npath = \"/payments\"\n{route}"
    ))
}

fn field(r: Result<Config, ConfigError>) -> String {
    match r {
        Err(ConfigError::Invalid { field, .. }) => field,
        other => panic!("expected Invalid, got {other:?}"),
    }
}

#[test]
fn unknown_statuses_are_502_and_504_by_default_and_only_5xx() {
    let c = config("", "", "").unwrap();
    assert_eq!(c.routes[0].policy.unknown_statuses.codes(), [502, 504]);
    let c = config("", "", "unknown_statuses = [500, 502, 599]").unwrap();
    assert_eq!(c.routes[0].policy.unknown_statuses.codes(), [500, 502, 599]);
    assert!(!c.routes[0].policy.unknown_statuses.contains(504));
    let none = config("", "", "unknown_statuses = []").unwrap();
    assert!(none.routes[0].policy.unknown_statuses.codes().is_empty());
    for bad in ["[404]", "[600]", "[-1]", "[70000]"] {
        let r = config("", "", &format!("unknown_statuses = {bad}"));
        assert_eq!(field(r), "routes[0].unknown_statuses", "{bad}");
    }
}

#[test]
fn the_upstream_idle_timeout_is_1s_by_default_and_bounded() {
    assert_eq!(
        config("", "", "").unwrap().upstream_idle_timeout,
        Duration::from_secs(1)
    );
    let c = config("", "idle_timeout = \"4s\"", "").unwrap();
    assert_eq!(c.upstream_idle_timeout, Duration::from_secs(4));
    for bad in ["\"50ms\"", "\"11m\""] {
        let r = config("", &format!("idle_timeout = {bad}"), "");
        assert_eq!(field(r), "upstream.idle_timeout", "{bad}");
    }
}

#[test]
fn asynchronous_commits_are_refused_unless_allowed_on_postgres_only() {
    let pg = "backend = \"postgres\"\nurl = \"postgres://u@db/pay\"";
    let StoreConfig::Postgres(p) = config(pg, "", "").unwrap().store else {
        panic!("postgres");
    };
    assert!(!p.allow_async_commit);
    let allowed = config(&format!("{pg}\nallow_async_commit = true"), "", "").unwrap();
    assert!(matches!(allowed.store, StoreConfig::Postgres(p) if p.allow_async_commit));
    let redis = "backend = \"redis\"\nurl = \"redis://r\"\nallow_async_commit = true";
    assert_eq!(field(config(redis, "", "")), "store.allow_async_commit");
}

#[test]
fn a_pending_record_outlives_the_call_and_the_stores_own_time() {
    // 30 s + 30 s, and twice a 10 s command: 80 s at least.
    let redis = "backend = \"redis\"\nurl = \"redis://r\"\ncommand_timeout = \"10s\"";
    assert_eq!(
        field(config(redis, "", "ttl = \"79s\"")),
        "routes[/payments].ttl"
    );
    assert!(config(redis, "", "ttl = \"80s\"").is_ok());
    // The embedded stores add nothing.
    assert!(config("backend = \"memory\"", "", "ttl = \"60s\"").is_ok());
}
