//! Answers sealed at rest (`store.encryption_keys_file`): through real gateways on a real Redis
//! and on the disk store, what the store holds (every Redis value; the disk store's files)
//! shows neither the answer's body nor its headers nor the key the client sent; retries replay
//! byte for byte, across instances sharing the keys; a rotation keeps old records replaying and
//! seals new ones with the new key; a gateway without the record's key refuses it (`500
//! record-unreadable`) and never executes it again.

use std::path::{Path, PathBuf};

use idemgate::config::{Config, TokenSource};

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
    let mut config = Config::parse(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nshutdown_grace = \"5s\"\n{store}\n[upstream]\nurl = \"{upstream}\"\n{PAYMENTS}upstream_timeout = \"300ms\"\n"
    ))
    .unwrap();
    config.store_keys = keys.map(|p| TokenSource::File(p.to_path_buf()));
    Running::start(config).await.unwrap()
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
    let store = format!(
        "[store]\nbackend = \"redis\"\nurl = \"{}\"\ncommand_timeout = \"2s\"",
        redis.url()
    );
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
    let later = start(&up.url(), &store, Some(&only_new)).await;
    assert_eq!(
        pay(&later, CLIENT_KEY).await.problem_type(),
        "record-unreadable"
    );
    assert_eq!(pay(&later, "SECRET-client-key-2").await.body, second.body);
    // Executed: the first payment, the unknown one and the one after the rotation; nothing
    // else, whatever the refusals.
    assert_eq!(up.executions(), 3);
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
