use super::raw::ROUTE_OWN_KEYS;
use super::*;
use http::HeaderName;

const MINIMAL: &str = r#"
[server]
listen = "127.0.0.1:8080"
[upstream]
url = "http://127.0.0.1:3000"
[[routes]]
path = "/payments"
"#;

fn with(extra: &str) -> Result<Config, ConfigError> {
    Config::parse(&format!("{MINIMAL}{extra}"))
}

fn invalid_field(r: Result<Config, ConfigError>) -> (String, String) {
    match r {
        Err(ConfigError::Invalid { field, value, .. }) => (field, value),
        other => panic!("expected Invalid, got {other:?}"),
    }
}

#[test]
fn the_shipped_proxy_toml_is_valid() {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/proxy.toml")).unwrap();
    let c = Config::parse(&text).unwrap();
    assert_eq!(c.routes.len(), 2);
    assert_eq!(c.routes[0].name, "payments");
}

#[test]
fn minimal_config_gets_the_documented_defaults() {
    let c = with("").unwrap();
    let r = &c.routes[0];
    assert_eq!(r.name, "/payments");
    assert_eq!(r.methods, vec![Method::POST]);
    assert_eq!(r.policy, Policy::builtin());
    assert_eq!(r.upstream.to_string(), "http://127.0.0.1:3000");
    assert_eq!(
        c.store,
        StoreConfig::Memory {
            max_keys: 1_000_000,
            max_bytes: 256 << 20
        }
    );
    assert_eq!(c.server.shutdown_grace, Duration::from_secs(30));
    assert!(c.server.workers >= 1);
}

#[test]
fn workers_are_bounded() {
    let server = |workers: &str| {
        Config::parse(&format!(
            "[server]\nlisten = \"127.0.0.1:1\"\nworkers = {workers}\n[upstream]\nurl = \"http://a:1\"\n"
        ))
    };
    assert_eq!(server("3").unwrap().server.workers, 3);
    for bad in ["0", "-1", "257"] {
        assert_eq!(
            invalid_field(server(bad)).0,
            "server.workers",
            "workers = {bad}"
        );
    }
}

#[test]
fn route_values_override_defaults_which_override_builtins() {
    let c = Config::parse(
        r#"
[server]
listen = "127.0.0.1:8080"
[upstream]
url = "http://127.0.0.1:3000"
[defaults]
ttl = "1h"
wait = "0s"
mismatch_status = 422
max_body = 2048
[[routes]]
path = "/a"
ttl = "2h"
client_header = ""
upstream = "http://10.0.0.1:9000/api/"
[[routes]]
path = "/b"
methods = ["put", "PATCH"]
max_stored_response = "512KiB"
"#,
    )
    .unwrap();
    let (a, b) = (&c.routes[0].policy, &c.routes[1].policy);
    assert_eq!(a.ttl, Duration::from_secs(7200));
    assert_eq!(b.ttl, Duration::from_secs(3600));
    assert_eq!(a.wait, Duration::ZERO);
    assert_eq!(a.mismatch_status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(a.max_body, 2048);
    assert!(a.client_headers.is_empty());
    assert_eq!(b.client_headers, vec![http::header::AUTHORIZATION]);
    assert_eq!(b.max_stored_response, 512 * 1024);
    assert_eq!(c.routes[0].upstream.prefix, "/api");
    assert_eq!(c.routes[1].methods, vec![Method::PUT, Method::PATCH]);
}

#[test]
fn unknown_keys_are_refused_with_their_name() {
    for extra in [
        "\n[defaults]\nttll = \"1h\"\n",
        "\n[[routes]]\npath = \"/x\"\nttll = \"1h\"\n",
    ] {
        match with(extra) {
            Err(ConfigError::Syntax(msg)) => assert!(msg.contains("ttll"), "{msg}"),
            other => panic!("expected Syntax, got {other:?}"),
        }
    }
    assert!(matches!(
        Config::parse("[server]\nlisten=\"127.0.0.1:1\"\nport = 1\n"),
        Err(ConfigError::Syntax(_))
    ));
}

#[test]
fn bad_values_name_field_and_value() {
    assert_eq!(
        invalid_field(with("ttl = \"soon\"")),
        ("routes[0].ttl".into(), "soon".into())
    );
    assert_eq!(
        invalid_field(with("max_body = \"lots\"")),
        ("routes[0].max_body".into(), "lots".into())
    );
    assert_eq!(
        invalid_field(with("max_body = \"2GiB\"")),
        ("routes[0].max_body".into(), "2GiB".into())
    );
    assert_eq!(
        invalid_field(with("max_body = -1")),
        ("routes[0].max_body".into(), "-1".into())
    );
    assert_eq!(
        invalid_field(with("mismatch_status = 500")),
        ("routes[0].mismatch_status".into(), "500".into())
    );
    assert_eq!(
        invalid_field(with("key_header = \"bad header\"")),
        ("routes[0].key_header".into(), "bad header".into())
    );
    assert_eq!(
        invalid_field(with("lock_timeout = \"2d\"")).0,
        "routes[0].lock_timeout"
    );
    assert_eq!(invalid_field(with("ttl = \"500ms\"")).0, "routes[0].ttl");
    assert_eq!(invalid_field(with("wait = \"1h\"")).0, "routes[0].wait");
    assert_eq!(
        invalid_field(with("upstream_timeout = \"0s\"")).0,
        "routes[0].upstream_timeout"
    );
    assert_eq!(invalid_field(with("methods = []")).0, "routes[0].methods");
    assert_eq!(
        invalid_field(with("methods = [\"PO ST\"]")).0,
        "routes[0].methods"
    );
    assert_eq!(
        invalid_field(with("fingerprint_ignore = [\"meta\"]")).0,
        "routes[0].fingerprint_ignore"
    );
    assert!(
        with("upstream = \"https://x\"").unwrap().routes[0]
            .upstream
            .tls
    );
    assert_eq!(
        invalid_field(with("upstream = \"ftp://x\"")).0,
        "routes[0].upstream"
    );
    assert_eq!(
        invalid_field(with("replay_header = \"Idempotency-Key\"")).0,
        "routes[0].replay_header"
    );
    assert_eq!(
        invalid_field(Config::parse(
            "[server]\nlisten = \"localhost\"\n[upstream]\nurl = \"http://a:1\"\n"
        )),
        ("server.listen".into(), "localhost".into())
    );
    assert_eq!(
        invalid_field(Config::parse("[server]\nlisten = \"127.0.0.1:1\"\n[store]\nbackend = \"etcd\"\n[upstream]\nurl = \"http://a:1\"\n")),
        ("store.backend".into(), "etcd".into())
    );
    let path = with("\n[[routes]]\npath = \"/a/**/b\"\n");
    assert_eq!(
        invalid_field(path),
        ("routes[1].path".into(), "/a/**/b".into())
    );
}

#[test]
fn durations_are_bounded_and_a_pending_record_outlives_the_call() {
    // Shorter than upstream_timeout + lock_timeout (30s + 30s): could expire mid-flight.
    assert_eq!(invalid_field(with("ttl = \"40s\"")).0, "routes[0].ttl");
    assert!(with("ttl = \"40s\"\nupstream_timeout = \"10s\"\nlock_timeout = \"10s\"").is_ok());
    assert_eq!(invalid_field(with("ttl = \"400days\"")).0, "routes[0].ttl");
    assert_eq!(
        invalid_field(with("upstream_timeout = \"2h\"\nttl = \"3h\"")).0,
        "routes[0].upstream_timeout"
    );
    assert_eq!(
        invalid_field(Config::parse("[server]\nlisten = \"127.0.0.1:1\"\nshutdown_grace = \"300000000000y\"\n[upstream]\nurl = \"http://a:1\"\n")).0,
        "server.shutdown_grace"
    );
}

#[test]
fn error_messages_say_what_is_allowed() {
    let msg = with("ttl = \"soon\"").unwrap_err().to_string();
    assert!(
        msg.contains("routes[0].ttl") && msg.contains("soon") && msg.contains("24h"),
        "{msg}"
    );
}

#[test]
fn missing_required_fields() {
    assert_eq!(
        Config::parse("[upstream]\nurl = \"http://a:1\"\n").unwrap_err(),
        ConfigError::Missing {
            field: "server.listen".into()
        }
    );
    assert_eq!(
        Config::parse("[server]\nlisten = \"127.0.0.1:1\"\n").unwrap_err(),
        ConfigError::Missing {
            field: "upstream.url".into()
        }
    );
    assert_eq!(
        with("\n[[routes]]\nmethods = [\"POST\"]\n").unwrap_err(),
        ConfigError::Missing {
            field: "routes[1].path".into()
        }
    );
}

#[test]
fn overlapping_routes_are_refused() {
    let err = with("\n[[routes]]\npath = \"/*\"\n").unwrap_err();
    assert_eq!(
        err,
        ConfigError::Overlap {
            first: "/payments".into(),
            second: "/*".into(),
            method: "POST".into(),
            example: "/payments".into()
        }
    );
    // Same path, disjoint methods: fine.
    assert!(
        with("\n[[routes]]\nname = \"put\"\npath = \"/payments\"\nmethods = [\"PUT\"]\n").is_ok()
    );
}

#[test]
fn route_names_are_unique() {
    assert_eq!(
        with("\n[[routes]]\nname = \"/payments\"\npath = \"/refunds\"\n").unwrap_err(),
        ConfigError::DuplicateName {
            index: 1,
            name: "/payments".into()
        }
    );
}

/// The names serde accepts in one table, read from its "unknown field" error.
fn accepted_keys(section: &str) -> Vec<String> {
    let text = match section {
        "routes" => format!("{MINIMAL}__probe__ = 1\n"),
        "routes-own" => return ROUTE_OWN_KEYS.iter().map(|s| s.to_string()).collect(),
        "server" => "[server]\n__probe__ = 1\n".to_string(),
        other => format!("[server]\nlisten = \"127.0.0.1:1\"\n[{other}]\n__probe__ = 1\n"),
    };
    let msg = match Config::parse(&text) {
        Err(ConfigError::Syntax(m)) => m,
        other => panic!("{section}: expected an unknown-field error, got {other:?}"),
    };
    // serde says "expected `url`" for a single field and "expected one of `a`, `b`" for more.
    let list = msg
        .split("expected")
        .nth(1)
        .unwrap_or_else(|| panic!("{msg}"));
    list.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

#[test]
fn every_config_key_is_documented() {
    let docs = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/configuration.md"
    ))
    .unwrap();
    let mut missing = Vec::new();
    for (section, prefix) in [
        ("server", "server."),
        ("store", "store."),
        ("upstream", "upstream."),
        ("defaults", ""),
        ("routes-own", "routes."),
        ("routes", ""),
    ] {
        let keys = accepted_keys(section);
        assert!(!keys.is_empty(), "{section}");
        for k in keys {
            let documented = format!("`{prefix}{k}`");
            if !docs.contains(&documented) {
                missing.push(documented);
            }
        }
    }
    assert!(
        missing.is_empty(),
        "docs/configuration.md does not document {missing:?}"
    );
}

fn store(section: &str) -> Result<Config, ConfigError> {
    Config::parse(&format!(
        "[server]\nlisten = \"127.0.0.1:8080\"\n[store]\n{section}\n[upstream]\nurl = \"http://127.0.0.1:3000\"\n"
    ))
}

#[test]
fn the_store_keys_are_named_never_written() {
    let c = store("encryption_keys_file = \"/run/secrets/store-keys\"").unwrap();
    assert_eq!(
        c.store_keys,
        Some(TokenSource::File("/run/secrets/store-keys".into()))
    );
    let c = store("encryption_keys_env = \"IDEMGATE_STORE_KEYS\"").unwrap();
    assert_eq!(
        c.store_keys,
        Some(TokenSource::Env("IDEMGATE_STORE_KEYS".into()))
    );
    assert_eq!(store("").unwrap().store_keys, None);
    // A key pasted where a variable's name goes is refused, and never shown.
    let pasted = "k1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
    let e = store(&format!("encryption_keys_env = \"{pasted}\"")).unwrap_err();
    assert!(!e.to_string().contains("AAECAwQF"), "{e}");
    assert_eq!(invalid_field(Err(e)).0, "store.encryption_keys_env");
    let both = "encryption_keys_env = \"K\"\nencryption_keys_file = \"f\"";
    assert_eq!(invalid_field(store(both)).0, "store.encryption_keys_file");
}

#[test]
fn redis_store_settings() {
    let c = store("backend = \"redis\"\nurl = \"redis://user:s3cret@10.0.0.5:6380/2\"").unwrap();
    assert_eq!(
        c.store,
        StoreConfig::Redis(RedisSettings {
            target: RedisTarget::Single("redis://user:s3cret@10.0.0.5:6380/2".into()),
            key_prefix: "idemgate:".into(),
            command_timeout: Duration::from_millis(500),
            max_clock_skew: Duration::from_secs(1),
            tls_ca_file: None,
            require_noeviction: false,
            tls_client: None,
            replicas: None,
        })
    );
    // What `idemgate check` prints is tested in cli::describe.
    assert!(!format!("{:?}", c.store).contains("s3cret"));

    let c = store("backend = \"redis\"\ncluster = [\"redis://a:7000\", \"redis://b:7000\"]\nkey_prefix = \"pay:\"\ncommand_timeout = \"1s\"").unwrap();
    let StoreConfig::Redis(r) = c.store else {
        panic!()
    };
    assert_eq!(
        r.target,
        RedisTarget::Cluster(vec!["redis://a:7000".into(), "redis://b:7000".into()])
    );
    assert_eq!(r.key_prefix, "pay:");
}

#[test]
fn the_admin_token_is_named_never_written() {
    let server = |lines: &str| {
        Config::parse(&format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n{lines}\n[upstream]\nurl = \"http://127.0.0.1:1\"\n"
        ))
    };
    let c =
        server("admin = \"127.0.0.1:9090\"\nadmin_token_env = \"IDEMGATE_ADMIN_TOKEN\"").unwrap();
    assert_eq!(
        c.server.admin_token,
        Some(TokenSource::Env("IDEMGATE_ADMIN_TOKEN".into()))
    );
    let c =
        server("admin = \"127.0.0.1:9090\"\nadmin_token_file = \"/run/secrets/token\"").unwrap();
    assert_eq!(
        c.server.admin_token,
        Some(TokenSource::File("/run/secrets/token".into()))
    );
    assert_eq!(server("").unwrap().server.admin_token, None);
    // A token pasted where its variable's name goes, both at once, or no admin listener.
    for (lines, field) in [
        (
            "admin = \"127.0.0.1:9090\"\nadmin_token_env = \"s3cr3t-t0ken!\"",
            "server.admin_token_env",
        ),
        (
            "admin = \"127.0.0.1:9090\"\nadmin_token_env = \"T\"\nadmin_token_file = \"f\"",
            "server.admin_token_file",
        ),
        ("admin_token_env = \"T\"", "server.admin_token_env"),
    ] {
        assert_eq!(invalid_field(server(lines)).0, field, "{lines}");
    }
}

#[test]
fn reconcile_names_an_http_lookup_with_the_key_in_it() {
    let route = |reconcile: &str| {
        Config::parse(&format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nurl = \"http://127.0.0.1:1\"\n[[routes]]\npath = \"/p\"\nupstream_timeout = \"5s\"\nreconcile = {reconcile}\n"
        ))
    };
    let c = route("{ url = \"http://pay:3000/payments/by-key/{key}\" }").unwrap();
    let r = c.routes[0].policy.reconcile.clone().unwrap();
    assert_eq!(
        (r.url.as_str(), r.after),
        ("http://pay:3000/payments/by-key/{key}", None)
    );
    let c = route("{ url = \"http://pay/p?key={key}\", after = \"30s\" }").unwrap();
    assert_eq!(
        c.routes[0].policy.reconcile.clone().unwrap().after,
        Some(Duration::from_secs(30))
    );
    for bad in [
        "{ url = \"http://pay/payments\" }",
        "{ url = \"ftp://pay/{key}\" }",
        "{ url = \"/by-key/{key}\" }",
    ] {
        assert_eq!(
            invalid_field(route(bad)).0,
            "routes[0].reconcile.url",
            "{bad}"
        );
    }
    assert_eq!(
        invalid_field(route("{ url = \"http://pay/{key}\", after = \"2h\" }")).0,
        "routes[0].reconcile.after"
    );
    assert!(route("{ url = \"http://pay/{key}\", retries = 3 }").is_err());
    assert!(route("{ url = \"https://pay/{key}\" }").is_ok());
}

#[test]
fn max_header_bytes_is_bounded() {
    let server = |line: &str| {
        Config::parse(&format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n{line}\n[upstream]\nurl = \"http://127.0.0.1:1\"\n"
        ))
    };
    assert_eq!(server("").unwrap().server.max_header_bytes, 64 << 10);
    assert_eq!(
        server("max_header_bytes = \"16KiB\"")
            .unwrap()
            .server
            .max_header_bytes,
        16 << 10
    );
    for bad in ["\"4KiB\"", "\"2MiB\""] {
        assert_eq!(
            invalid_field(server(&format!("max_header_bytes = {bad}"))).0,
            "server.max_header_bytes"
        );
    }
}

#[test]
fn postgres_store_settings() {
    let c = store("backend = \"postgres\"\nurl = \"postgres://app:s3cret@db:5432/pay\"").unwrap();
    assert_eq!(
        c.store,
        StoreConfig::Postgres(PostgresSettings {
            url: "postgres://app:s3cret@db:5432/pay".into(),
            table: "idemgate_records".into(),
            pool_size: 16,
            workers: c.server.workers,
            command_timeout: Duration::from_secs(1),
            max_clock_skew: Duration::from_secs(1),
            tls_ca_file: None,
            tls_client: None,
            allow_async_commit: false,
        })
    );
    assert!(!format!("{:?}", c.store).contains("s3cret"));
    let c = store(
        "backend = \"postgres\"\nurl = \"postgresql://a:5432,b:5433/pay?target_session_attrs=read-write&sslmode=require\"\ntable = \"billing.keys\"\npool_size = 40\ncommand_timeout = \"3s\"",
    )
    .unwrap();
    let StoreConfig::Postgres(p) = c.store else {
        panic!()
    };
    assert_eq!((p.table.as_str(), p.pool_size), ("billing.keys", 40));
    assert_eq!(p.command_timeout, Duration::from_secs(3));
}

#[test]
fn bad_postgres_settings_are_refused() {
    let pg = |rest: &str| store(&format!("backend = \"postgres\"\n{rest}"));
    assert!(
        matches!(pg(""), Err(ConfigError::Missing { field }) if field.starts_with("store.url"))
    );
    assert_eq!(
        invalid_field(pg("url = \"redis://u:pw@a:1\"")),
        ("store.url".into(), "redis://u:***@a:1".into())
    );
    // The driver's own parser: a bad option, with the password still hidden.
    let (field, value) = invalid_field(pg("url = \"postgres://u:pw@a:1/db?sslmode=sometimes\""));
    assert_eq!(
        (field.as_str(), value.as_str()),
        ("store.url", "postgres://u:***@a:1/db?sslmode=sometimes")
    );
    for table in [
        "Records",
        "1st",
        "a;drop table x",
        "a.b.c",
        "\"quoted\"",
        "",
    ] {
        assert_eq!(
            invalid_field(pg(&format!("url = \"postgres://a/db\"\ntable = {table:?}"))).0,
            "store.table",
            "{table}"
        );
    }
    assert_eq!(
        invalid_field(pg("url = \"postgres://a/db\"\npool_size = 0")).0,
        "store.pool_size"
    );
    assert_eq!(
        invalid_field(pg("url = \"postgres://a/db\"\ncommand_timeout = \"2m\"")).0,
        "store.command_timeout"
    );
    // Redis's own settings are not Postgres's, and Postgres's not Redis's.
    for other in [
        "key_prefix = \"x:\"",
        "min_replicas = 1",
        "cluster = [\"redis://a:1\"]",
    ] {
        let (field, _) = invalid_field(pg(&format!("url = \"postgres://a/db\"\n{other}")));
        assert!(
            other.starts_with(field.trim_start_matches("store.")),
            "{field}"
        );
    }
    assert_eq!(
        invalid_field(store(
            "backend = \"redis\"\nurl = \"redis://a:1\"\ntable = \"t\""
        )),
        ("store.table".into(), "(set)".into())
    );
    assert_eq!(
        invalid_field(store("backend = \"disk\"\npath = \"d\"\npool_size = 4")).0,
        "store.pool_size"
    );
}

#[test]
fn bad_redis_settings_are_refused() {
    assert_eq!(
        store("backend = \"redis\"").unwrap_err(),
        ConfigError::Missing {
            field: "store.url (or store.cluster, or store.sentinels)".into()
        }
    );
    assert_eq!(
        invalid_field(store(
            "backend = \"redis\"\nurl = \"redis://a:1\"\ncluster = [\"redis://b:1\"]"
        ))
        .0,
        "store.cluster"
    );
    assert_eq!(
        invalid_field(store("backend = \"redis\"\ncluster = []")).0,
        "store.cluster"
    );
    assert!(store("backend = \"redis\"\nurl = \"rediss://u:pw@a:1\"").is_ok());
    assert_eq!(
        invalid_field(store("backend = \"redis\"\nurl = \"rediz://u:pw@a:1\"")),
        ("store.url".into(), "rediz://u:***@a:1".into())
    );
    assert_eq!(
        invalid_field(store(
            "backend = \"redis\"\nurl = \"rediss://a:1\"\ntls_ca_file = \"/nonexistent/ca.pem\""
        ))
        .0,
        "store.tls_ca_file"
    );
    assert_eq!(
        invalid_field(store("backend = \"redis\"\nurl = \"http://a:1\"")).0,
        "store.url"
    );
    assert_eq!(
        invalid_field(store(
            "backend = \"redis\"\nurl = \"redis://a:1\"\nmax_keys = 5"
        ))
        .0,
        "store.max_keys"
    );
    assert_eq!(
        invalid_field(store("backend = \"memory\"\nurl = \"redis://a:1\"")).0,
        "store.url"
    );
    assert_eq!(
        invalid_field(store(
            "backend = \"redis\"\nurl = \"redis://a:1\"\nkey_prefix = \"{x}\""
        ))
        .0,
        "store.key_prefix"
    );
    assert_eq!(
        invalid_field(store(
            "backend = \"redis\"\nurl = \"redis://a:1\"\ncommand_timeout = \"0s\""
        ))
        .0,
        "store.command_timeout"
    );
}

#[test]
fn max_clock_skew_is_a_shared_stores_bounded_setting() {
    let redis = |extra: &str| {
        store(&format!(
            "backend = \"redis\"\nurl = \"redis://a:1\"\n{extra}"
        ))
    };
    assert_eq!(
        redis("max_clock_skew = \"250ms\"")
            .unwrap()
            .store
            .max_clock_skew(),
        Duration::from_millis(250)
    );
    assert_eq!(
        redis("max_clock_skew = \"0s\"")
            .unwrap()
            .store
            .max_clock_skew(),
        Duration::ZERO
    );
    let (field, value) = invalid_field(redis("max_clock_skew = \"2m\""));
    assert_eq!(
        (field.as_str(), value.as_str()),
        ("store.max_clock_skew", "2m")
    );
    let pg = store("backend = \"postgres\"\nurl = \"postgres://a/db\"\nmax_clock_skew = \"3s\"");
    assert_eq!(pg.unwrap().store.max_clock_skew(), Duration::from_secs(3));
    // One process reads and writes an embedded store: no other clock to allow for.
    assert_eq!(
        invalid_field(store("max_clock_skew = \"1s\"")).0,
        "store.max_clock_skew"
    );
    assert_eq!(store("").unwrap().store.max_clock_skew(), Duration::ZERO);
}

#[test]
fn on_store_error_is_reject_or_pass() {
    assert_eq!(
        with("").unwrap().routes[0].policy.on_store_error,
        OnStoreError::Reject
    );
    assert_eq!(
        with("on_store_error = \"pass\"").unwrap().routes[0]
            .policy
            .on_store_error,
        OnStoreError::Pass
    );
    assert_eq!(
        invalid_field(with("on_store_error = \"maybe\"")),
        ("routes[0].on_store_error".into(), "maybe".into())
    );
}

#[test]
fn urls_are_redacted() {
    assert_eq!(redact_url("redis://:pw@h:1/0"), "redis://:***@h:1/0");
    assert_eq!(redact_url("redis://user@h:1"), "redis://***@h:1");
    assert_eq!(redact_url("redis://h:1"), "redis://h:1");
    assert_eq!(redact_url("redis://:pa/ss@h:1/0"), "redis://:***@h:1/0");
    assert_eq!(redact_url("redis://u:p@ss#?@h:1"), "redis://u:***@h:1");
    assert_eq!(
        redact_url("postgres://u@h1:5432,h2:5433/db?sslmode=require&password=secret&x=1"),
        "postgres://***@h1:5432,h2:5433/db?sslmode=require&password=***&x=1"
    );
}

#[test]
fn syntax_errors_never_quote_the_offending_line() {
    let err = Config::parse("[server]\nlisten = \"127.0.0.1:1\"\n[store]\nbackend = \"redis\"\nurl = \"redis://:s3cret@h:1\" junk\n")
        .unwrap_err()
        .to_string();
    assert!(!err.contains("s3cret"), "{err}");
    assert!(err.contains("line 5"), "{err}");
}

#[test]
fn on_unknown_is_reject_or_retry() {
    assert_eq!(
        with("").unwrap().routes[0].policy.on_unknown,
        OnUnknown::Reject
    );
    assert_eq!(
        with("on_unknown = \"retry\"").unwrap().routes[0]
            .policy
            .on_unknown,
        OnUnknown::Retry
    );
    assert_eq!(
        invalid_field(with("on_unknown = \"again\"")).0,
        "routes[0].on_unknown"
    );
}

#[test]
fn key_sources() {
    let r = &with("").unwrap().routes[0];
    assert_eq!(
        r.key,
        KeySource::header(HeaderName::from_static("idempotency-key"))
    );
    assert!(r.check_fingerprint);
    let r = &with("key = { header = \"webhook-id\" }").unwrap().routes[0];
    assert_eq!(
        r.key,
        KeySource::header(HeaderName::from_static("webhook-id"))
    );
    let r = &with("key = { json = [\"/data/object/id\", \"/type\"] }\ncheck_fingerprint = false")
        .unwrap()
        .routes[0];
    assert_eq!(
        r.key.pointers,
        vec!["/data/object/id".to_string(), "/type".to_string()]
    );
    assert!(r.key.headers.is_empty());
    assert!(!r.check_fingerprint);
    let r = &with("key = { header = [\"ce-id\", \"ce-source\"] }")
        .unwrap()
        .routes[0];
    assert_eq!(r.key.headers.len(), 2);
    let r = &with("fingerprint_headers = [\"X-Tenant\", \"host\"]")
        .unwrap()
        .routes[0];
    assert_eq!(
        r.policy.fingerprint_headers,
        vec![HeaderName::from_static("x-tenant"), http::header::HOST]
    );
    assert_eq!(
        invalid_field(with("fingerprint_headers = [\"bad name\"]")).0,
        "routes[0].fingerprint_headers"
    );
    // A key the client picks, unchecked: refused unless accepted in so many words.
    let refused = with("check_fingerprint = false");
    let why = refused
        .as_ref()
        .map(|_| String::new())
        .unwrap_or_else(|e| e.to_string());
    assert!(why.contains("unchecked_header_key"), "{why}");
    assert_eq!(invalid_field(refused).0, "routes[0].check_fingerprint");
    assert_eq!(
        invalid_field(with(
            "key = { header = \"webhook-id\" }\ncheck_fingerprint = false"
        ))
        .0,
        "routes[0].check_fingerprint"
    );
    let r = &with("check_fingerprint = false\nunchecked_header_key = true")
        .unwrap()
        .routes[0];
    assert!(!r.check_fingerprint);
    assert_eq!(
        invalid_field(with("key = { json = \"id\" }")).0,
        "routes[0].key.json"
    );
    assert_eq!(invalid_field(with("key = {}")).0, "routes[0].key");
    assert_eq!(
        invalid_field(with("key = { header = \"bad header\" }")).0,
        "routes[0].key.header"
    );
    assert!(matches!(
        with("key = { headers = \"x\" }"),
        Err(ConfigError::Syntax(_))
    ));
}

/// The configs shipped for Compose and Kubernetes are valid, as `idemgate check` would say.
#[test]
fn the_deployment_configs_are_valid() {
    let root = env!("CARGO_MANIFEST_DIR");
    let compose = std::fs::read_to_string(format!("{root}/deploy/compose/proxy.toml")).unwrap();
    let c = Config::parse(&compose).unwrap();
    assert!(matches!(c.store, StoreConfig::Redis(_)));
    assert!(c.server.admin.is_some());

    // proxy.toml as embedded in the ConfigMap: the block under `proxy.toml: |`, dedented.
    let cm = std::fs::read_to_string(format!("{root}/deploy/kubernetes/configmap.yaml")).unwrap();
    let mut lines = cm
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("proxy.toml: |"))
        .skip(1);
    let first = lines.next().unwrap();
    let indent = first.len() - first.trim_start().len();
    let mut text = format!("{}\n", &first[indent..]);
    for l in lines {
        if !l.trim().is_empty() && l.len() - l.trim_start().len() < indent {
            break;
        }
        text.push_str(l.get(indent..).unwrap_or(""));
        text.push('\n');
    }
    let k = Config::parse(&text).unwrap_or_else(|e| panic!("configmap proxy.toml: {e}\n{text}"));
    assert!(matches!(k.store, StoreConfig::Redis(_)));
    assert_eq!(k.routes[0].name, "payments");
}

#[test]
fn disk_store_settings() {
    let c = store("backend = \"disk\"\npath = \"data\"").unwrap();
    assert_eq!(
        c.store,
        StoreConfig::Disk(DiskSettings {
            path: "data".into(),
            sync: SyncMode::Always,
            max_disk: 1 << 30,
        })
    );
    let c = store(
        "backend = \"disk\"\npath = \"/var/lib/idemgate\"\nsync = \"batch\"\nsync_interval = \"20ms\"\nmax_disk = \"64MiB\"",
    )
    .unwrap();
    assert_eq!(
        c.store,
        StoreConfig::Disk(DiskSettings {
            path: "/var/lib/idemgate".into(),
            sync: SyncMode::Batch {
                interval: Duration::from_millis(20)
            },
            max_disk: 64 << 20,
        })
    );
}

#[test]
fn bad_disk_settings_are_refused() {
    assert_eq!(
        store("backend = \"disk\"").unwrap_err(),
        ConfigError::Missing {
            field: "store.path".into()
        }
    );
    for (section, field) in [
        ("backend = \"disk\"\npath = \" \"", "store.path"),
        (
            "backend = \"disk\"\npath = \"d\"\nsync = \"sometimes\"",
            "store.sync",
        ),
        (
            "backend = \"disk\"\npath = \"d\"\nsync_interval = \"1s\"",
            "store.sync_interval",
        ),
        (
            "backend = \"disk\"\npath = \"d\"\nsync = \"batch\"\nsync_interval = \"0s\"",
            "store.sync_interval",
        ),
        (
            "backend = \"disk\"\npath = \"d\"\nmax_disk = \"1KiB\"",
            "store.max_disk",
        ),
        (
            "backend = \"disk\"\npath = \"d\"\nmax_keys = 5",
            "store.max_keys",
        ),
        (
            "backend = \"disk\"\npath = \"d\"\nurl = \"redis://h:1\"",
            "store.url",
        ),
        ("backend = \"memory\"\npath = \"d\"", "store.path"),
        (
            "backend = \"redis\"\nurl = \"redis://h:1\"\nsync = \"always\"",
            "store.sync",
        ),
    ] {
        assert_eq!(invalid_field(store(section)).0, field, "{section}");
    }
}

#[test]
fn client_header_takes_a_list_and_require_client_needs_one() {
    let base =
        "[server]\nlisten = \"127.0.0.1:8080\"\n[upstream]\nurl = \"http://127.0.0.1:3000\"\n";
    let c = Config::parse(&format!(
        "{base}[defaults]\nclient_header = [\"Authorization\", \"X-API-Key\"]\nrequire_client = true\n[[routes]]\npath = \"/a\"\n"
    ))
    .unwrap();
    let p = &c.routes[0].policy;
    assert_eq!(p.client_headers.len(), 2);
    assert_eq!(p.client_headers[1].as_str(), "x-api-key");
    assert!(p.require_client);
    let err = Config::parse(&format!(
        "{base}[[routes]]\npath = \"/a\"\nclient_header = \"\"\nrequire_client = true\n"
    ))
    .unwrap_err()
    .to_string();
    assert!(err.contains("require_client"), "{err}");
    let err = Config::parse(&format!(
        "{base}[[routes]]\npath = \"/a\"\nclient_header = []\n"
    ))
    .unwrap_err()
    .to_string();
    assert!(err.contains("client_header"), "{err}");
}

#[test]
fn server_deadlines_and_trusted_proxies_are_checked() {
    let base = "[upstream]\nurl = \"http://127.0.0.1:3000\"\n";
    let c = Config::parse(&format!(
        "[server]\nlisten = \"127.0.0.1:8080\"\nheader_timeout = \"5s\"\ntrusted_proxies = [\"10.0.0.0/8\", \"192.0.2.7\"]\n{base}"
    ))
    .unwrap();
    assert_eq!(c.server.deadlines.header, Duration::from_secs(5));
    assert_eq!(c.server.deadlines.idle, Duration::from_secs(60));
    assert!(c.server.is_trusted_proxy("10.1.2.3".parse().unwrap()));
    assert!(c
        .server
        .is_trusted_proxy("::ffff:192.0.2.7".parse().unwrap()));
    assert!(!c.server.is_trusted_proxy("192.0.2.8".parse().unwrap()));
    for bad in [
        "header_timeout = \"0s\"",
        "idle_timeout = \"2h\"",
        "max_streams = 0",
        "trusted_proxies = [\"10.0.0.0/33\"]",
    ] {
        let err = Config::parse(&format!(
            "[server]\nlisten = \"127.0.0.1:8080\"\n{bad}\n{base}"
        ))
        .unwrap_err()
        .to_string();
        assert!(err.contains("server."), "{bad}: {err}");
    }
}

fn signed_route(signature: &str) -> Result<Config, ConfigError> {
    with(&format!("signature = {signature}\n"))
}

#[test]
fn signature_settings_are_checked_and_secrets_never_shown() {
    let dir = std::env::temp_dir().join(format!("idemgate-sig-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("secret");
    std::fs::write(&file, "  topsecretvalue\n").unwrap();
    let f = file.display();
    let ok = signed_route(&format!("{{ scheme = \"github\", secret_file = \"{f}\" }}")).unwrap();
    let sig = ok.routes[0].signature.as_ref().unwrap();
    assert_eq!(sig.secrets[0].key(), b"topsecretvalue", "trimmed");
    assert!(
        !format!("{ok:?}").contains("topsecretvalue"),
        "Debug shows a secret"
    );

    let refused = [
        (format!("{{ scheme = \"gitlab\", secret_file = \"{f}\" }}"), "routes[0].signature.scheme"),
        (format!("{{ scheme = \"github\", secret_file = \"{f}\", tolerance = \"1m\" }}"), "routes[0].signature.tolerance"),
        (format!("{{ scheme = \"stripe\", secret_file = \"{f}\", tolerance = \"2h\" }}"), "routes[0].signature.tolerance"),
        (format!("{{ scheme = \"github\", secret_file = \"{f}\", header = \"x\" }}"), "routes[0].signature.header"),
        (format!("{{ scheme = \"hmac-sha256\", header = \"x-sig\", encoding = \"b32\", secret_file = \"{f}\" }}"), "routes[0].signature.encoding"),
        ("{ scheme = \"github\", secret_file = \"/nonexistent/idemgate-secret\" }".to_string(), "routes[0].signature.secret_file"),
        ("{ scheme = \"github\", secret_env = \"IDEMGATE_TEST_SURELY_UNSET_VARIABLE\" }".to_string(), "routes[0].signature.secret_env"),
    ];
    for (text, field) in refused {
        let (got, _) = invalid_field(signed_route(&text));
        assert_eq!(got, field, "{text}");
    }
    // A standard-webhooks secret that is not whsec_ base64: named by where it came from.
    let err = signed_route(&format!(
        "{{ scheme = \"standard-webhooks\", secret_file = \"{f}\" }}"
    ))
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("secret_file") && !err.contains("topsecretvalue"),
        "{err}"
    );
    assert!(matches!(
        signed_route("{ scheme = \"github\" }"),
        Err(ConfigError::Missing { .. })
    ));
    // "whsec_" alone would be an empty key, which anyone can sign with.
    let empty = dir.join("empty-whsec");
    std::fs::write(&empty, "whsec_").unwrap();
    let err = signed_route(&format!(
        "{{ scheme = \"standard-webhooks\", secret_file = \"{}\" }}",
        empty.display()
    ))
    .unwrap_err()
    .to_string();
    assert!(err.contains("24 to 64 bytes"), "{err}");
    // A secret pasted where a variable's name goes is not echoed.
    let err = signed_route("{ scheme = \"github\", secret_env = \"s3cr3t value!\" }")
        .unwrap_err()
        .to_string();
    assert!(!err.contains("s3cr3t"), "{err}");
    // A record must outlive twice the tolerance of a timestamped scheme (a timestamp a
    // tolerance ahead is accepted for twice the tolerance).
    let ttl = |ttl: &str| {
        with(&format!(
            "ttl = \"{ttl}\"\nupstream_timeout = \"10s\"\nlock_timeout = \"10s\"\nsignature = {{ scheme = \"stripe\", secret_file = \"{f}\" }}\n"
        ))
    };
    // Whole-second timestamps: a second more.
    for short in ["2m", "5m", "9m59s", "10m"] {
        let (field, _) = invalid_field(ttl(short));
        assert_eq!(field, "routes[0].ttl", "{short}");
    }
    assert!(ttl("10m 1s").is_ok());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_certificate_subject_header_is_a_scope_only_where_certificates_are_verified() {
    let (field, value) = invalid_field(with("client_header = \"X-Client-Cert-Subject\"\n"));
    assert_eq!(field, "client_header");
    assert_eq!(value, "x-client-cert-subject");
    let (field, _) = invalid_field(Config::parse(
        "[server]\nlisten = \"127.0.0.1:1\"\ntls_client_ca = \"/etc/ca.pem\"\n[upstream]\nurl = \"http://127.0.0.1:1\"\n",
    ));
    assert_eq!(field, "server.tls_client_ca", "needs tls_cert");
}

#[test]
fn each_upstream_has_one_protocol() {
    use crate::config::UpstreamProtocol;
    let base = "[server]\nlisten = \"127.0.0.1:1\"\n[upstream]\nurl = \"http://a:1\"\nprotocol = \"http2\"\n";
    let route = |extra: &str| {
        Config::parse(&format!(
            "{base}[[routes]]\nname = \"r\"\npath = \"/r\"\nmethods = [\"POST\"]\n{extra}"
        ))
    };
    let c = route("").unwrap();
    assert_eq!(c.upstream.protocol, UpstreamProtocol::Http2);
    assert_eq!(
        c.routes[0].upstream.protocol,
        UpstreamProtocol::Http2,
        "inherited"
    );
    let c = route("upstream = \"https://b:2\"\nprotocol = \"http1\"\n").unwrap();
    assert_eq!(c.routes[0].upstream.protocol, UpstreamProtocol::Http1);
    // The same upstream as [upstream], another protocol: refused, both named.
    let err = route("upstream = \"http://a:1/v2\"\nprotocol = \"auto\"\n").unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("routes[0].protocol") && text.contains("http2"),
        "{text}"
    );
    let (field, value) = invalid_field(route("protocol = \"h3\"\n"));
    assert_eq!(
        (field.as_str(), value.as_str()),
        ("routes[0].protocol", "h3")
    );
    let (field, _) = invalid_field(Config::parse(&base.replace("http2", "http/2")));
    assert_eq!(field, "upstream.protocol");
    // tls_recheck only with a certificate to read again.
    let (field, _) = invalid_field(Config::parse(
        "[server]\nlisten = \"127.0.0.1:1\"\ntls_recheck = \"10s\"\n[upstream]\nurl = \"http://a:1\"\n",
    ));
    assert_eq!(field, "server.tls_recheck");
}

const REDIS_STORE: &str = r#"
[store]
backend = "redis"
url = "redis://127.0.0.1:6390"
"#;

fn consumer(store: &str, table: &str) -> Result<Config, ConfigError> {
    with(&format!("{store}\n[[consumers]]\n{table}"))
}

const ORDERS: &str = r#"
name = "orders"
source = { redis_stream = "orders" }
handler = "http://127.0.0.1:3000/orders"
key = { json = "/messageId" }
"#;

#[test]
fn a_consumer_gets_the_documented_defaults_and_the_store_s_redis() {
    let c = consumer(REDIS_STORE, ORDERS).unwrap();
    let k = &c.consumers[0];
    assert_eq!(k.name, "orders");
    assert_eq!(k.handler.to_string(), "http://127.0.0.1:3000/orders");
    assert_eq!(k.key.pointers, vec!["/messageId".to_string()]);
    assert_eq!((k.concurrency, k.max_attempts), (16, 5));
    assert_eq!(k.backoff, Duration::from_secs(1));
    assert_eq!(k.max_backoff, Duration::from_secs(60));
    assert_eq!(k.body_field, "body");
    assert_eq!(k.content_type, "application/json");
    assert_eq!(k.policy.on_store_error, OnStoreError::Reject);
    let SourceConfig::RedisStream {
        stream,
        group,
        redis,
        dead_letter,
        claim_idle,
    } = &k.source
    else {
        panic!("a Redis stream source: {:?}", k.source);
    };
    assert_eq!((stream.as_str(), group.as_str()), ("orders", "idemgate"));
    assert_eq!(dead_letter, "orders:dead");
    assert_eq!(*claim_idle, Duration::from_secs(60));
    assert_eq!(
        redis.target,
        RedisTarget::Single("redis://127.0.0.1:6390".into())
    );
}

#[test]
fn a_consumer_key_names_entry_fields() {
    let c = consumer(
        REDIS_STORE,
        &ORDERS.replace(
            r#"{ json = "/messageId" }"#,
            r#"{ field = ["source", "messageId"] }"#,
        ),
    )
    .unwrap();
    let names: Vec<&str> = c.consumers[0]
        .key
        .headers
        .iter()
        .map(|h| h.as_str())
        .collect();
    assert_eq!(names, ["source", "messageid"]);
}

#[test]
fn a_consumer_without_redis_or_with_bad_values_is_refused() {
    // The disk store has no stream: the consumer must name its Redis.
    let (field, _) = invalid_field(consumer("", ORDERS));
    assert_eq!(field, "consumers[0].source.url");
    let ok = ORDERS.replace(
        r#"{ redis_stream = "orders" }"#,
        r#"{ redis_stream = "orders", url = "redis://10.0.0.1:6379" }"#,
    );
    assert!(consumer("", &ok).is_ok());
    for (table, bad) in [
        (
            ORDERS.replace("key = { json = \"/messageId\" }", "key = {}"),
            "consumers[0].key",
        ),
        (
            ORDERS.replace("\"/messageId\"", "\"messageId\""),
            "consumers[0].key.json",
        ),
        (
            format!("{ORDERS}concurrency = 0"),
            "consumers[0].concurrency",
        ),
        (
            format!("{ORDERS}max_attempts = 100000"),
            "consumers[0].max_attempts",
        ),
        (
            format!("{ORDERS}backoff = \"10s\"\nmax_backoff = \"1s\""),
            "consumers[0].max_backoff",
        ),
        (
            format!("{ORDERS}max_backoff = \"25h\""),
            "consumers[0].max_backoff",
        ),
        (
            ORDERS.replace(
                r#"{ redis_stream = "orders" }"#,
                r#"{ redis_stream = "orders", dead_letter = "orders" }"#,
            ),
            "consumers[0].source.dead_letter",
        ),
        (
            ORDERS.replace(
                r#"{ redis_stream = "orders" }"#,
                r#"{ redis_stream = "orders", claim_idle = "10ms" }"#,
            ),
            "consumers[0].source.claim_idle",
        ),
        (
            ORDERS.replace("http://127.0.0.1:3000/orders", "ftp://x/orders"),
            "consumers[0].handler",
        ),
    ] {
        let (field, _) = invalid_field(consumer(REDIS_STORE, &table));
        assert_eq!(field, bad, "{table}");
    }
    // A route of the same name would share its records (both can use the shared scope).
    let (field, _) = invalid_field(consumer(
        REDIS_STORE,
        &ORDERS.replace("name = \"orders\"", "name = \"/payments\""),
    ));
    assert_eq!(field, "consumers[0].name");
    let twice = format!("{ORDERS}\n[[consumers]]\n{ORDERS}");
    let (field, value) = invalid_field(consumer(REDIS_STORE, &twice));
    assert_eq!(
        (field.as_str(), value.as_str()),
        ("consumers[1].name", "orders")
    );
    // Keys that mean nothing for a message are refused, not ignored.
    assert!(matches!(
        consumer(
            REDIS_STORE,
            &format!("{ORDERS}client_header = \"x-tenant\"")
        ),
        Err(ConfigError::Syntax(_))
    ));
    assert!(matches!(
        consumer(REDIS_STORE, &ORDERS.replace("name = \"orders\"\n", "")),
        Err(ConfigError::Missing { .. })
    ));
}

#[test]
fn a_nats_consumer_needs_its_url_and_dead_letter_subject() {
    let nats = ORDERS.replace(
        r#"{ redis_stream = "orders" }"#,
        r#"{ nats_stream = "ORDERS", url = "nats://127.0.0.1:4222", subject = "orders.>", dead_letter = "dead.orders" }"#,
    );
    let c = consumer("", &nats).unwrap();
    let SourceConfig::NatsStream(NatsSource {
        stream,
        subject,
        durable,
        ack_wait,
        ..
    }) = &c.consumers[0].source
    else {
        panic!("a NATS source");
    };
    assert_eq!(stream, "ORDERS");
    assert_eq!(subject.as_deref(), Some("orders.>"));
    assert_eq!(durable, "idemgate");
    assert_eq!(*ack_wait, Duration::from_secs(30));
    for (from, to, field) in [
        (
            ", dead_letter = \"dead.orders\"",
            "",
            "consumers[0].source.dead_letter",
        ),
        (
            "url = \"nats://127.0.0.1:4222\"",
            "url = \"http://x\"",
            "consumers[0].source.url",
        ),
        ("subject", "group", "consumers[0].source.group"),
        ("nats_stream = \"ORDERS\", ", "", "consumers[0].source"),
    ] {
        let r = consumer("", &nats.replace(from, to));
        match r {
            Err(ConfigError::Invalid { field: f, .. }) | Err(ConfigError::Missing { field: f }) => {
                assert_eq!(f, field, "{from} -> {to}")
            }
            other => panic!("{from} -> {to}: {other:?}"),
        }
    }
}

#[test]
fn a_rabbitmq_consumer_needs_its_url_and_another_dead_letter_queue() {
    let rabbit = ORDERS.replace(
        r#"{ redis_stream = "orders" }"#,
        r#"{ rabbitmq_queue = "orders", url = "amqp://app:secret@127.0.0.1:5672/%2f", dead_letter = "orders.dead" }"#,
    );
    let c = consumer("", &rabbit).unwrap();
    let SourceConfig::RabbitQueue(r) = &c.consumers[0].source else {
        panic!("a RabbitMQ source");
    };
    assert_eq!(
        (r.queue.as_str(), r.dead_letter.as_str()),
        ("orders", "orders.dead")
    );
    for (from, to, field) in [
        (
            ", dead_letter = \"orders.dead\"",
            "",
            "consumers[0].source.dead_letter",
        ),
        (
            "dead_letter = \"orders.dead\"",
            "dead_letter = \"orders\"",
            "consumers[0].source.dead_letter",
        ),
        ("amqp://", "http://", "consumers[0].source.url"),
        ("url", "group", "consumers[0].source.group"),
        ("rabbitmq_queue = \"orders\", ", "", "consumers[0].source"),
        (
            "dead_letter = \"orders.dead\"",
            "dead_letter = \"orders.dead\", tls_ca_file = \"/nonexistent.pem\"",
            "consumers[0].source.tls_ca_file",
        ),
    ] {
        match consumer("", &rabbit.replace(from, to)) {
            Err(ConfigError::Invalid {
                field: f, value, ..
            }) => {
                assert_eq!(f, field, "{from} -> {to}");
                assert!(!value.contains("secret"), "the password was shown: {value}");
            }
            Err(ConfigError::Missing { field: f }) => assert_eq!(f, field, "{from} -> {to}"),
            other => panic!("{from} -> {to}: {other:?}"),
        }
    }
    assert!(consumer(
        "",
        &rabbit.replace(
            "name = \"orders\"\n",
            "name = \"orders\"\nbody_field = \"b\"\n"
        )
    )
    .is_err());
}

#[test]
fn a_kafka_consumer_needs_brokers_and_another_dead_letter_topic_and_keeps_its_offsets_setting() {
    let kafka = ORDERS.replace(
        r#"{ redis_stream = "orders" }"#,
        r#"{ kafka_topic = "orders", brokers = ["127.0.0.1:9092"], dead_letter = "orders.dead", options = { "sasl.password" = "secret" } }"#,
    );
    let c = consumer("", &kafka).unwrap();
    let SourceConfig::KafkaTopic(k) = &c.consumers[0].source else {
        panic!("a Kafka source");
    };
    assert_eq!(
        (k.topic.as_str(), k.group.as_str(), k.dead_letter.as_str()),
        ("orders", "idemgate", "orders.dead")
    );
    assert_eq!(k.brokers, vec!["127.0.0.1:9092"]);
    assert!(
        !format!("{k:?}").contains("secret"),
        "options' values stay out of logs"
    );
    for (from, to, field) in [
        (
            ", dead_letter = \"orders.dead\"",
            "",
            "consumers[0].source.dead_letter",
        ),
        (
            "dead_letter = \"orders.dead\"",
            "dead_letter = \"orders\"",
            "consumers[0].source.dead_letter",
        ),
        ("[\"127.0.0.1:9092\"]", "[]", "consumers[0].source.brokers"),
        (
            "[\"127.0.0.1:9092\"]",
            "[\"kafka://127.0.0.1:9092\"]",
            "consumers[0].source.brokers",
        ),
        (
            "kafka_topic = \"orders\"",
            "kafka_topic = \"or ders\"",
            "consumers[0].source.kafka_topic",
        ),
        (
            "\"sasl.password\"",
            "\"enable.auto.commit\"",
            "consumers[0].source.options.enable.auto.commit",
        ),
        (
            "brokers =",
            "url = \"x\", brokers =",
            "consumers[0].source.url",
        ),
        ("kafka_topic = \"orders\", ", "", "consumers[0].source"),
    ] {
        match consumer("", &kafka.replace(from, to)) {
            Err(ConfigError::Invalid { field: f, .. }) | Err(ConfigError::Missing { field: f }) => {
                assert_eq!(f, field, "{from} -> {to}")
            }
            other => panic!("{from} -> {to}: {other:?}"),
        }
    }
}

/// Certificate and key files are parsed, not searched for a marker: a file that only looks
/// like PEM is refused when the config loads, not when the first TLS handshake needs it.
#[test]
fn pem_files_must_parse() {
    let dir = std::env::temp_dir().join(format!("idemgate-pem-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let good_cert = write("cert.pem", &cert.cert.pem());
    let good_key = write("key.pem", &cert.key_pair.serialize_pem());
    let fake = write(
        "fake.pem",
        "-----BEGIN CERTIFICATE-----\nnot base64 at all!\n-----END CERTIFICATE-----\n",
    );
    let tls = |c: &str, k: &str| {
        Config::parse(&format!(
            "[server]\nlisten = \"127.0.0.1:1\"\ntls_cert = \"{c}\"\ntls_key = \"{k}\"\n[upstream]\nurl = \"http://127.0.0.1:2\"\n"
        ))
    };
    assert!(tls(&good_cert, &good_key).is_ok());
    let refused = |r: Result<Config, ConfigError>| match r {
        Err(ConfigError::Invalid { field, allowed, .. }) => (field, allowed),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        refused(tls(&fake, &good_key)),
        (
            "server.tls_cert".to_string(),
            "a PEM file with a CERTIFICATE block".to_string()
        )
    );
    assert_eq!(
        refused(tls(&good_cert, &good_cert)),
        (
            "server.tls_key".to_string(),
            "a PEM file with a PRIVATE KEY block".to_string()
        )
    );
    let (field, allowed) = refused(tls(
        &dir.join("missing.pem").display().to_string(),
        &good_key,
    ));
    assert_eq!(field, "server.tls_cert");
    assert_eq!(allowed, "a readable PEM file (entity not found)");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A value of the wrong kind is refused where serde reads it, however deep: the message still
/// names the whole path, the value as written and what is allowed.
#[test]
fn a_value_of_the_wrong_kind_is_named_by_its_path() {
    let redis = "\n[store]\nbackend = \"redis\"\nurl = \"redis://127.0.0.1:1\"\n";
    let nested = ORDERS.replace(
        r#"{ redis_stream = "orders" }"#,
        r#"{ redis_stream = "orders", claim_idle = "later" }"#,
    );
    assert_ne!(nested, ORDERS);
    match consumer(redis, &nested) {
        Err(ConfigError::Invalid {
            field,
            value,
            allowed,
        }) => {
            assert_eq!(field, "consumers[0].source.claim_idle");
            assert_eq!(value, "later");
            assert!(allowed.contains("\"30s\""), "{allowed}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        invalid_field(with("on_unknown = \"maybe\"")),
        ("routes[0].on_unknown".into(), "maybe".into())
    );
    assert_eq!(
        invalid_field(with("max_stored_response = true")),
        ("routes[0].max_stored_response".into(), "true".into())
    );
    // A mistyped key that is not one of those kinds stays a syntax error, naming its table.
    match with("require_key = \"yes\"") {
        Err(ConfigError::Syntax(msg)) => assert!(msg.contains("routes[0]"), "{msg}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn min_replicas_asks_for_acknowledgements_within_replica_timeout() {
    let redis = "backend = \"redis\"\nurl = \"redis://127.0.0.1:1\"\n";
    let acks = |extra: &str| match store(&format!("{redis}{extra}")).map(|c| c.store) {
        Ok(StoreConfig::Redis(r)) => Ok(r.replicas),
        Ok(other) => panic!("{other:?}"),
        Err(e) => Err(e),
    };
    assert_eq!(acks(""), Ok(None));
    assert_eq!(acks("min_replicas = 0"), Ok(None));
    assert_eq!(
        acks("min_replicas = 1"),
        Ok(Some(ReplicaAcks {
            min: 1,
            timeout: Duration::from_secs(1)
        }))
    );
    assert_eq!(
        acks("min_replicas = 2\nreplica_timeout = \"250ms\""),
        Ok(Some(ReplicaAcks {
            min: 2,
            timeout: Duration::from_millis(250)
        }))
    );
    for (extra, field) in [
        ("min_replicas = -1", "store.min_replicas"),
        ("min_replicas = 17", "store.min_replicas"),
        ("replica_timeout = \"1s\"", "store.replica_timeout"),
        (
            "min_replicas = 1\nreplica_timeout = \"5ms\"",
            "store.replica_timeout",
        ),
        (
            "min_replicas = 1\nreplica_timeout = \"2m\"",
            "store.replica_timeout",
        ),
        (
            "min_replicas = 1\nreplica_timeout = \"soon\"",
            "store.replica_timeout",
        ),
    ] {
        let refused = invalid_field(store(&format!("{redis}{extra}")));
        assert_eq!(refused.0, field, "{extra}");
    }
    // A Redis setting, refused with another backend.
    assert_eq!(
        invalid_field(store("backend = \"memory\"\nmin_replicas = 1")).0,
        "store.min_replicas"
    );
}

#[test]
fn sentinels_name_the_primary_they_watch() {
    let c = store("backend = \"redis\"\nsentinels = [\"redis://:pw@10.0.0.1:26379\", \"redis://10.0.0.2:26379\"]\nmaster = \"mymaster\"").unwrap();
    let StoreConfig::Redis(r) = c.store else {
        panic!("{:?}", c.store)
    };
    assert_eq!(
        r.target,
        RedisTarget::Sentinel {
            sentinels: vec![
                "redis://:pw@10.0.0.1:26379".into(),
                "redis://10.0.0.2:26379".into()
            ],
            master: "mymaster".into()
        }
    );
    assert!(!format!("{:?}", r.target).contains("pw"));
    let refused = |extra: &str| invalid_field(store(&format!("backend = \"redis\"\n{extra}"))).0;
    assert_eq!(
        refused("sentinels = [\"redis://a:26379\"]\nmaster = \"my master\""),
        "store.master"
    );
    assert_eq!(refused("sentinels = []\nmaster = \"m\""), "store.sentinels");
    assert_eq!(
        refused("sentinels = [\"http://a:26379\"]\nmaster = \"m\""),
        "store.sentinels"
    );
    assert_eq!(
        refused("url = \"redis://a:1\"\nsentinels = [\"redis://a:26379\"]\nmaster = \"m\""),
        "store.sentinels"
    );
    assert_eq!(
        refused("url = \"redis://a:1\"\nmaster = \"m\""),
        "store.master"
    );
    assert_eq!(
        store("backend = \"redis\"\nsentinels = [\"redis://a:26379\"]").unwrap_err(),
        ConfigError::Missing {
            field: "store.master (with store.sentinels)".into()
        }
    );
}

#[test]
fn method_override_header_is_a_header_of_its_own() {
    let with = |name: &str| {
        Config::parse(&format!(
            "[server]\nlisten = \"127.0.0.1:8080\"\nmethod_override_header = \"{name}\"\n[upstream]\nurl = \"http://127.0.0.1:3000\"\n"
        ))
    };
    let c = with("X-HTTP-Method-Override").unwrap();
    assert_eq!(
        c.server.method_override_header.unwrap().as_str(),
        "x-http-method-override"
    );
    for bad in [
        "Content-Type",
        "host",
        "Connection",
        "Idempotency-Key",
        "not a name",
    ] {
        let e = with(bad).unwrap_err().to_string();
        assert!(e.contains("server.method_override_header"), "{bad}: {e}");
    }
    let unset = Config::parse(
        "[server]\nlisten = \"127.0.0.1:8080\"\n[upstream]\nurl = \"http://127.0.0.1:3000\"\n",
    )
    .unwrap();
    assert_eq!(unset.server.method_override_header, None);
}

#[test]
fn a_mistyped_value_is_never_echoed_in_the_error() {
    const PW: &str = "s3cretpw";
    let base =
        "[server]\nlisten = \"127.0.0.1:8080\"\n[upstream]\nurl = \"http://127.0.0.1:3000\"\n";
    let url = format!("redis://:{PW}@redis:6379");
    let cases = [
        // A string where a list goes, a list where a string goes, a table where either goes.
        format!("{base}[store]\nbackend = \"redis\"\ncluster = \"{url}\"\n"),
        format!("{base}[store]\nbackend = \"redis\"\nsentinels = \"{url}\"\nmaster = \"m\"\n"),
        format!("{base}[store]\nbackend = \"redis\"\nurl = [\"{url}\"]\n"),
        format!("{base}[store]\nbackend = \"{url}\"\n"),
        format!("[server]\nlisten = \"127.0.0.1:8080\"\n[upstream]\nurl = [\"https://u:{PW}@up\"]\n"),
        format!("{base}[[routes]]\npath = \"/p\"\nupstream = [\"https://u:{PW}@up\"]\n"),
        format!("{base}[[routes]]\npath = \"/p\"\nreconcile = {{ url = [\"https://u:{PW}@up/{{key}}\"] }}\n"),
        format!("{base}[[routes]]\npath = \"/p\"\nreconcile = \"https://u:{PW}@up/{{key}}\"\n"),
        format!("{base}[[routes]]\npath = \"/p\"\nclient_jwt = {{ jwks_url = [\"https://u:{PW}@idp\"], issuer = \"i\" }}\n"),
        format!("{base}[[consumers]]\nname = \"c\"\nhandler = \"http://127.0.0.1:3000/h\"\nsource = {{ rabbitmq_queue = \"q\", url = [\"amqp://u:{PW}@mq\"] }}\n"),
        format!("{base}[[consumers]]\nname = \"c\"\nhandler = \"http://127.0.0.1:3000/h\"\nsource = {{ kafka_topic = \"t\", brokers = \"u:{PW}@k:9092\" }}\n"),
        format!("{base}[[consumers]]\nname = \"c\"\nhandler = \"http://127.0.0.1:3000/h\"\nsource = \"nats://u:{PW}@n\"\n"),
        format!("{base}[server]\nadmin_token_env = [\"{PW}\"]\n"),
        format!("{base}[store]\nbackend = \"postgres\"\nurl = {{ dsn = \"postgres://a:{PW}@db/p\" }}\n"),
        format!("{base}[store]\nbackend = \"memory\"\nmax_keys = \"{PW}\"\n"),
        format!("{base}[store]\nbackend = \"a`redis://:{PW}@h\"\n"),
        format!("[server]\nlisten = [\"redis://:{PW}@h\"]\n[upstream]\nurl = \"http://127.0.0.1:3000\"\n"),
    ];
    for text in &cases {
        let e = Config::parse(text).expect_err(text).to_string();
        assert!(!e.contains(PW), "{text}\n=> {e}");
    }
    // Still says where and what.
    let e = Config::parse(&cases[0]).unwrap_err().to_string();
    assert!(
        e.contains("invalid type: a string, expected a sequence"),
        "{e}"
    );
}

/// A secret in a value of the right type that validation then refuses: a URL with credentials
/// where none may go, a URL without `://`, a number where a string goes, a secret pasted where a
/// variable's name or a file's path goes.
#[test]
fn a_refused_value_never_shows_a_secret() {
    const PW: &str = "9f8e7d6c5b4a39281706f5e4d3c2b1a0";
    let base =
        "[server]\nlisten = \"127.0.0.1:8080\"\n[upstream]\nurl = \"http://127.0.0.1:3000\"\n";
    let consumer = |source: String| {
        format!("{base}[[consumers]]\nname = \"c\"\nhandler = \"http://127.0.0.1:3000/h\"\nsource = {source}\n")
    };
    let cases = [
        format!("[server]\nlisten = \"127.0.0.1:8080\"\n[upstream]\nurl = \"https://u:{PW}@up\"\n"),
        format!("[server]\nlisten = \"127.0.0.1:8080\"\n[upstream]\nurl = \"https://u:{PW} x@up\"\n"),
        format!("{base}[[routes]]\npath = \"/p\"\nupstream = \"https://u:{PW}@up\"\n"),
        format!("{base}[[consumers]]\nname = \"c\"\nhandler = \"http://u:{PW}@h/x\"\nsource = {{ redis_stream = \"s\" }}\n"),
        format!("{base}[[routes]]\npath = \"/p\"\nreconcile = {{ url = \"https://u:{PW}@up/by-key\" }}\n"),
        format!("{base}[[routes]]\npath = \"/p\"\nreconcile = {{ url = \"https://u:{PW}@up/{{key}}\" }}\n"),
        format!("{base}[[routes]]\npath = \"/p\"\nclient_jwt = {{ jwks_url = \"https://u:{PW} x@idp/jwks\", issuer = \"i\" }}\n"),
        format!("{base}[store]\nbackend = \"postgres\"\nurl = \"host=db user=app password={PW} dbname=pay\"\n"),
        format!("{base}[store]\nbackend = \"redis\"\nurl = \"redis:/:{PW}@h\"\n"),
        consumer(format!("{{ rabbitmq_queue = \"q\", url = \"amqp:/u:{PW}@mq\", dead_letter = \"d\" }}")),
        consumer(format!("{{ nats_stream = \"S\", url = \"u:{PW}@nats:4222\", dead_letter = \"d\" }}")),
        consumer(format!("{{ kafka_topic = \"t\", brokers = [\"SASL_SSL://u:{PW}@k:9092\"], dead_letter = \"d\" }}")),
        consumer(format!("{{ kafka_topic = \"t\", brokers = [\"u:{PW}@k:9092\"], dead_letter = \"d\" }}")),
        consumer("{ kafka_topic = \"t\", brokers = [\"k:9092\"], dead_letter = \"d\", options = { \"sasl.password\" = 987654321012 } }".into()),
        format!("{base}[[routes]]\npath = \"/p\"\nsignature = {{ scheme = \"github\", secret_env = \"{PW}\" }}\n"),
        format!("{base}[[routes]]\npath = \"/p\"\nsignature = {{ scheme = \"github\", secret_file = \"-----BEGIN {PW}\" }}\n"),
        format!("[server]\nlisten = \"127.0.0.1:8080\"\ntls_cert = \"/nonexistent/cert.pem\"\ntls_key = \"-----BEGIN PRIVATE KEY-----\\n{PW}\\n\"\n[upstream]\nurl = \"http://127.0.0.1:3000\"\n"),
    ];
    for text in &cases {
        let e = match Config::parse(text) {
            Ok(_) => panic!("accepted: {text}"),
            Err(e) => e.to_string(),
        };
        assert!(
            !e.contains(PW) && !e.contains("987654321012"),
            "{text}\n=> {e}"
        );
        // Refused for what it is, not for the TOML around it.
        assert!(!e.contains("TOML parse") && !e.contains("duplicate"), "{e}");
    }
    // `{key}` never names the host the lookup connects to.
    let e = Config::parse(&format!(
        "{base}[[routes]]\npath = \"/p\"\nreconcile = {{ url = \"http://pay-{{key}}.svc/x\" }}\n"
    ));
    assert_eq!(invalid_field(e).0, "routes[0].reconcile.url");
}
