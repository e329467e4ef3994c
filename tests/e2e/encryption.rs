//! Answers sealed at rest (`store.encryption_keys_file`): through real gateways on a real Redis
//! and on the disk store, what the store holds (every Redis value; the disk store's files)
//! shows neither the answer's body nor its headers nor the key the client sent; retries replay
//! byte for byte, across instances sharing the keys; a rotation keeps old records replaying and
//! seals new ones with the new key; a gateway without the record's key refuses it (`500
//! record-unreadable`) and never executes it again.

use std::path::{Path, PathBuf};

use idemgate::config::{Config, TokenSource};

use crate::support::postgres::Postgres;
use crate::support::redis::RedisServer;
use crate::support::*;

const BODY: &str = "card-4242-SECRET-in-the-body";
const HEADER: &str = "SECRET-in-a-header";
const CLIENT_KEY: &str = "SECRET-client-key-1";
/// What every sealed byte string must not show.
const MARK: &str = "SECRET";

const K1: &str = "k1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
const K2: &str = "k2:HxwdHhsaGRgXFhUUExIREA8ODQwLCgkIBwYFBAMCAQA=";

/// An upstream answering with the secrets, and never answering keys starting with "hang".
async fn upstream() -> Upstream {
    Upstream::start(|seen, _| {
        let hang = (seen.headers.get("idempotency-key"))
            .is_some_and(|k| k.as_bytes().starts_with(b"SECRET-hang"));
        if hang {
            return Reply::Hang;
        }
        Reply::Respond {
            status: 201,
            headers: vec![
                ("content-type", "application/json".into()),
                ("x-card", HEADER.into()),
            ],
            body: format!("{{\"note\":\"{BODY}\"}}").into(),
        }
    })
    .await
}

fn keys_file(dir: &TempDir, name: &str, lines: &[&str]) -> PathBuf {
    let path = dir.path.join(name);
    std::fs::write(&path, lines.join("\n")).unwrap();
    path
}

/// A gateway on `store` (a `[store]` section) sealing with the keys in `keys`, if any.
async fn start(upstream: &str, store: &str, keys: Option<&Path>) -> Running {
    Running::start(config(upstream, store, keys)).await.unwrap()
}

fn config(upstream: &str, store: &str, keys: Option<&Path>) -> Config {
    let mut config = Config::parse(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nshutdown_grace = \"5s\"\n{store}\n[upstream]\nurl = \"{upstream}\"\n{PAYMENTS}upstream_timeout = \"300ms\"\n"
    ))
    .unwrap();
    config.store_keys = keys.map(|p| TokenSource::File(p.to_path_buf()));
    config
}

const TOKEN: &str = "operator-token-sealed-0042";

/// `/keys/{id}` on `admin` with the operator token.
async fn operator(admin: std::net::SocketAddr, method: &str, path: &str) -> Got {
    Http::new(admin)
        .request(method, path)
        .header("authorization", &format!("Bearer {TOKEN}"))
        .send()
        .await
}

async fn pay(gw: &Running, key: &str) -> Got {
    Http::new(gw.addr())
        .request("POST", "/payments")
        .header("idempotency-key", key)
        .header("authorization", "Bearer SECRET-token")
        .json("{\"amount\":100}")
        .send()
        .await
}

/// The `[store]` section of a gateway on `redis`.
fn redis_section(redis: &RedisServer) -> String {
    format!(
        "[store]\nbackend = \"redis\"\nurl = \"{}\"\ncommand_timeout = \"2s\"",
        redis.url()
    )
}

/// Every value the Redis server holds, as text.
fn redis_values(redis: &RedisServer) -> Vec<String> {
    let keys = redis.cli(&["--scan"]);
    keys.lines()
        .filter(|k| !k.is_empty())
        .map(|k| redis.cli(&["GET", k]))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sealed_records_on_redis_show_nothing_replay_everywhere_and_rotate() {
    let redis = RedisServer::start();
    let up = upstream().await;
    let dir = TempDir::new("sealed-redis");
    let store = redis_section(&redis);
    let first = keys_file(&dir, "keys-1", &[K1]);
    let gw = start(&up.url(), &store, Some(&first)).await;
    let original = pay(&gw, CLIENT_KEY).await;
    assert_eq!(original.status, 201, "{}", original.text());
    assert!(original.text().contains(BODY));
    // Left as an unknown outcome: its record keeps the key the client sent (its origin).
    let unknown = pay(&gw, "SECRET-hang-1").await;
    assert!(unknown.status.is_server_error(), "{}", unknown.text());
    let replay = pay(&gw, CLIENT_KEY).await;
    assert!(replay.is_replay());
    assert_eq!(
        (replay.status, &replay.body, replay.header("x-card")),
        (original.status, &original.body, Some(HEADER))
    );
    let values = redis_values(&redis);
    assert!(values.len() >= 2, "{values:?}");
    for value in &values {
        assert!(!value.contains(MARK), "in the clear in Redis: {value:?}");
    }
    // Another instance with the same keys replays it.
    let other = start(&up.url(), &store, Some(&first)).await;
    assert_eq!(pay(&other, CLIENT_KEY).await.body, original.body);
    // An instance without keys refuses the sealed record: not replayed, not executed.
    let plain = start(&up.url(), &store, None).await;
    let refused = pay(&plain, CLIENT_KEY).await;
    assert_eq!(refused.status, 500, "{}", refused.text());
    assert_eq!(refused.problem_type(), "record-unreadable");
    assert!(!refused.text().contains(BODY));
    // A rotation: a new first key, the old one still listed. Old records replay; new ones are
    // sealed with the new key.
    let rotated = keys_file(&dir, "keys-2", &[K2, K1]);
    let after = start(&up.url(), &store, Some(&rotated)).await;
    assert_eq!(pay(&after, CLIENT_KEY).await.body, original.body);
    let second = pay(&after, "SECRET-client-key-2").await;
    assert_eq!(second.status, 201);
    let sealed_with = |id: &str| {
        let tagged = format!("\u{2}{id}");
        redis_values(&redis)
            .iter()
            .filter(|v| v.contains(&tagged))
            .count()
    };
    assert_eq!(sealed_with("k2"), 1, "{:?}", redis_values(&redis));
    assert_eq!(sealed_with("k1"), 2, "{:?}", redis_values(&redis));
    // The old key removed: its records are refused, never run again.
    let only_new = keys_file(&dir, "keys-3", &[K2]);
    let token = keys_file(&dir, "token", &[TOKEN]);
    let mut with_admin = config(&up.url(), &store, Some(&only_new)).with_admin();
    with_admin.server.admin_token = Some(TokenSource::File(token));
    let later = Running::start(with_admin).await.unwrap();
    assert_eq!(
        pay(&later, CLIENT_KEY).await.problem_type(),
        "record-unreadable"
    );
    assert_eq!(pay(&later, "SECRET-client-key-2").await.body, second.body);
    // Executed: the first payment, the unknown one and the one after the rotation; nothing
    // else, whatever the refusals.
    assert_eq!(up.executions(), 3);
    // The operator sees it as unreadable, with its key id; it cannot be resolved, and is
    // released only when forced. Then the next retry runs it.
    let admin = later.admin_addr().unwrap();
    let plain = config(&up.url(), &store, None);
    let client = idemgate::operator::ClientName {
        value: Some("Bearer SECRET-token".into()),
        ..Default::default()
    };
    let id = idemgate::operator::locate(&plain, "payments", &[CLIENT_KEY.into()], &client)
        .unwrap()
        .hex();
    let shown = operator(admin, "GET", &format!("/keys/{id}")).await;
    assert_eq!(shown.status, 200, "{}", shown.text());
    let view: serde_json::Value = serde_json::from_slice(&shown.body).unwrap();
    assert_eq!(
        (view["state"].as_str(), view["key_id"].as_str()),
        (Some("unreadable"), Some("k1"))
    );
    assert!(view["expires"].is_string(), "{view}");
    for (method, path) in [
        ("DELETE", format!("/keys/{id}")),
        ("PUT", format!("/keys/{id}?force=true")),
    ] {
        let refused = Http::new(admin)
            .request(method, &path)
            .header("authorization", &format!("Bearer {TOKEN}"))
            .json("{\"status\": 200}")
            .send()
            .await;
        assert_eq!(refused.status, 409, "{method}: {}", refused.text());
        assert_eq!(refused.problem_type(), "record-unreadable");
    }
    let released = operator(admin, "DELETE", &format!("/keys/{id}?force=true")).await;
    assert_eq!(released.status, 200, "{}", released.text());
    assert_eq!(pay(&later, CLIENT_KEY).await.status, 201);
    assert_eq!(up.executions(), 4);
}

/// The Postgres table's rows: no column holds the answer or the client's key in the clear
/// (checked first with the records in the clear, where they do).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sealed_records_in_the_postgres_table_show_nothing() {
    let up = upstream().await;
    for sealed in [false, true] {
        let pg = Postgres::start();
        let dir = TempDir::new("sealed-postgres");
        let keys = keys_file(&dir, "keys", &[K1]);
        let store = format!("[store]\nbackend = \"postgres\"\nurl = \"{}\"", pg.url());
        let gw = start(&up.url(), &store, sealed.then_some(keys.as_path())).await;
        let original = pay(&gw, CLIENT_KEY).await;
        assert_eq!(original.status, 201, "{}", original.text());
        // Left pending and then unknown: its row keeps the client's key (origin, then outcome).
        assert!(pay(&gw, "SECRET-hang-3").await.status.is_server_error());
        assert_eq!(pay(&gw, CLIENT_KEY).await.body, original.body);
        let rows = pg.psql(
            "SELECT coalesce(encode(outcome, 'escape'), '') || coalesce(encode(origin, 'escape'), '') FROM idemgate_records",
        );
        assert_eq!(rows.contains(MARK), !sealed, "{rows}");
        if sealed {
            // escape encoding shows the key id's length byte (2) as it is.
            assert!(rows.matches("\u{2}k1").count() >= 2, "{rows}");
        }
    }
}

/// The disk store's files, after the gateway stopped (its journal and tables flushed), hold
/// none of it; the same requests without keys do show it there (so the search can fail).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sealed_records_in_the_disk_stores_files_show_nothing() {
    let up = upstream().await;
    for sealed in [true, false] {
        let dir = TempDir::new("sealed-disk");
        let keys = keys_file(&dir, "keys", &[K1]);
        let store = format!(
            "[store]\nbackend = \"disk\"\npath = \"{}\"",
            dir.path.join("data").display()
        );
        let gw = start(&up.url(), &store, sealed.then_some(keys.as_path())).await;
        let original = pay(&gw, CLIENT_KEY).await;
        assert_eq!(original.status, 201, "{}", original.text());
        assert!(pay(&gw, "SECRET-hang-2").await.status.is_server_error());
        assert_eq!(pay(&gw, CLIENT_KEY).await.body, original.body);
        gw.shutdown().await;
        let found = files_containing(&dir.path.join("data"), MARK.as_bytes());
        if sealed {
            assert!(found.is_empty(), "in the clear on disk: {found:?}");
            // Reopened with the keys, the record replays; without, it is refused.
            let gw = start(&up.url(), &store, Some(&keys)).await;
            assert_eq!(pay(&gw, CLIENT_KEY).await.body, original.body);
            gw.shutdown().await;
            let gw = start(&up.url(), &store, None).await;
            assert_eq!(
                pay(&gw, CLIENT_KEY).await.problem_type(),
                "record-unreadable"
            );
            gw.shutdown().await;
        } else {
            assert!(!found.is_empty(), "the control run stored nothing readable");
        }
    }
}

/// Records stored in the clear before keys were configured: a gateway with keys replays them,
/// and changes them in the form they were stored in (the take-over's compare-and-set matches),
/// so an operator can release an unknown outcome left from before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_stored_before_keys_stay_readable_and_changeable() {
    let redis = RedisServer::start();
    let up = upstream().await;
    let dir = TempDir::new("sealed-after");
    let store = redis_section(&redis);
    let before = start(&up.url(), &store, None).await;
    let original = pay(&before, CLIENT_KEY).await;
    assert_eq!(original.status, 201);
    assert!(pay(&before, "SECRET-hang-4").await.status.is_server_error());
    let keys = keys_file(&dir, "keys", &[K1]);
    let token = keys_file(&dir, "token", &[TOKEN]);
    let mut config = config(&up.url(), &store, Some(&keys)).with_admin();
    config.server.admin_token = Some(TokenSource::File(token));
    let client = idemgate::operator::ClientName {
        value: Some("Bearer SECRET-token".into()),
        ..Default::default()
    };
    let id = idemgate::operator::locate(&config, "payments", &["SECRET-hang-4".into()], &client)
        .unwrap()
        .hex();
    let after = Running::start(config).await.unwrap();
    assert_eq!(pay(&after, CLIENT_KEY).await.body, original.body);
    let released = operator(
        after.admin_addr().unwrap(),
        "DELETE",
        &format!("/keys/{id}"),
    )
    .await;
    assert_eq!(released.status, 200, "{}", released.text());
    assert_eq!(up.executions(), 2);
}

/// SIGHUP reads the keys again: new records are sealed with a new first key at once; a keys
/// file that cannot be read keeps the keys in use and fails readiness until one can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sighup_rotates_the_keys_and_a_broken_file_fails_readiness() {
    let redis = RedisServer::start();
    let up = upstream().await;
    let dir = TempDir::new("sealed-reload");
    let keys = keys_file(&dir, "keys", &[K1]);
    let admin: std::net::SocketAddr =
        format!("127.0.0.1:{}", crate::support::redis::free_port(false))
            .parse()
            .unwrap();
    let gw = GatewayProcess::start(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin = \"{admin}\"\n[store]\nbackend = \"redis\"\nurl = \"{}\"\nencryption_keys_file = \"{}\"\n[upstream]\nurl = \"{}\"\n{PAYMENTS}",
        redis.url(),
        keys.display(),
        up.url()
    ));
    let http = Http::new(gw.addr);
    let sealed_with = |id: &str| {
        let tagged = format!("\u{2}{id}");
        redis_values(&redis)
            .iter()
            .filter(|v| v.contains(&tagged))
            .count()
    };
    assert_eq!(http.post("/payments", "a", "{}").await.status, 201);
    assert_eq!(sealed_with("k1"), 1);
    std::fs::write(&keys, format!("{K2}\n{K1}\n")).unwrap();
    gw.signal("-HUP");
    gw.wait_log("store keys reloaded");
    assert_eq!(http.post("/payments", "b", "{}").await.status, 201);
    assert_eq!(sealed_with("k2"), 1);
    assert!(http.post("/payments", "a", "{}").await.is_replay());
    // A file that does not parse: the keys in use stay (new records sealed with k2), and
    // readiness says why until a reload succeeds.
    std::fs::write(&keys, "k3:not-a-key\n").unwrap();
    gw.signal("-HUP");
    gw.wait_log("store keys reload failed");
    let (status, why) = admin_get(admin, "/readyz").await;
    assert_eq!(status, 503, "{why}");
    assert!(
        why.contains("encryption_keys") && !why.contains("not-a-key"),
        "{why}"
    );
    assert_eq!(http.post("/payments", "c", "{}").await.status, 201);
    assert_eq!(sealed_with("k2"), 2);
    std::fs::write(&keys, format!("{K2}\n{K1}\n")).unwrap();
    gw.signal("-HUP");
    gw.wait_log("store keys reloaded");
    assert_eq!(admin_get(admin, "/readyz").await.0, 200);
    // Opens are counted per key id: the replay of "a" opened a k1 record.
    let metrics = scrape(admin).await;
    let opened = |id: &str| {
        metrics
            .get(&format!(
                "idemgate_store_sealed_opened_total{{key_id=\"{id}\"}}"
            ))
            .copied()
    };
    assert!(opened("k1").is_some_and(|n| n >= 1.0), "{metrics:?}");
    assert_eq!(up.executions(), 3);
}

/// Files under `dir` whose bytes contain `needle`.
fn files_containing(dir: &Path, needle: &[u8]) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if std::fs::read(&path)
                .is_ok_and(|bytes| bytes.windows(needle.len()).any(|w| w == needle))
            {
                found.push(path);
            }
        }
    }
    found
}
