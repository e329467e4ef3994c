//! Test harness: a real upstream and the real gateway on loopback port 0, a small client, and
//! real Redis servers ([`redis`]).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod amqp_raw;
pub mod certs;
mod client;
pub mod issuer;
pub mod kafka;
pub mod kafka_raw;
pub mod nats;
pub mod nginx;
pub mod otlp;
pub mod postgres;
mod process;
pub mod rabbitmq;
pub mod redis;
pub mod relay;
mod upstream;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use idemgate::config::Config;
pub use idemgate::server::Running;
pub use tokio::sync::Semaphore;

pub use client::*;
pub use process::*;
pub use upstream::*;

/// A gateway config for tests: listens on port 0, `extra` is appended (defaults and routes).
pub fn config(upstream: &str, extra: &str) -> Config {
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nshutdown_grace = \"5s\"\n[upstream]\nurl = \"{upstream}\"\n{extra}"
    );
    Config::parse(&text).unwrap_or_else(|e| panic!("test config invalid: {e}\n{text}"))
}

/// Test-only additions to a parsed config.
pub trait ConfigExt {
    /// Serves the admin endpoints on a free loopback port.
    fn with_admin(self) -> Config;
}

impl ConfigExt for Config {
    fn with_admin(mut self) -> Config {
        self.server.admin = Some("127.0.0.1:0".parse().unwrap());
        self
    }
}

/// Starts the real gateway in-process on loopback port 0.
pub async fn gateway(upstream: &str, extra: &str) -> Running {
    Running::start(config(upstream, extra)).await.unwrap()
}

/// The standard payments route.
pub const PAYMENTS: &str =
    "[[routes]]\nname = \"payments\"\npath = \"/payments\"\nmethods = [\"POST\"]\n";

/// GETs an admin path; returns status and body.
pub async fn admin_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let got = Http::new(addr).request("GET", path).send().await;
    (got.status.as_u16(), got.text())
}

/// Scrapes `/metrics` into `name{labels}` -> value.
pub async fn scrape(admin: SocketAddr) -> HashMap<String, f64> {
    let (status, text) = admin_get(admin, "/metrics").await;
    assert_eq!(status, 200);
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// Polls `check` every 10 ms for at most 10 s: a test waits on a condition, not on a guessed
/// duration. Returns whether the condition came true.
pub async fn eventually<F, Fut>(check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    eventually_within(Duration::from_secs(10), check).await
}

/// [`eventually`] with another limit, for conditions that take long on a slow machine.
pub async fn eventually_within<F, Fut>(limit: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..limit.as_millis().div_ceil(10) {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

/// A scratch directory (tempfile's), removed on drop.
pub struct TempDir {
    pub path: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let dir = tempfile::Builder::new()
            .prefix(&format!("idemgate-{tag}-"))
            .tempdir()
            .unwrap();
        TempDir {
            path: dir.path().to_path_buf(),
            _dir: dir,
        }
    }
}

/// A file to lock (`File::lock`, `try_lock`) between test processes: `name` in the directory
/// `dir` under the temporary directory, both made open to every user (1777, 0666), so that runs
/// as root and as another user on one machine can share them.
pub fn lock_file(dir: &str, name: &str) -> std::fs::File {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let dir = std::env::temp_dir().join(dir);
    if std::fs::create_dir(&dir).is_ok() {
        let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777));
    }
    let path = dir.join(name);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o666)
        .open(&path)
        .unwrap_or_else(|e| panic!("cannot open the lock file {}: {e}", path.display()));
    let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666));
    file
}

/// A config's text edited as TOML, not as text: a key is set in its table (made if missing), so
/// an edit can neither miss its target silently nor land in another table; the gateway then
/// refuses a misspelt key as it would in a file.
pub struct TomlConfig(toml::Table);

impl TomlConfig {
    pub fn parse(text: &str) -> TomlConfig {
        TomlConfig(
            text.parse()
                .unwrap_or_else(|e| panic!("test config is not TOML: {e}\n{text}")),
        )
    }

    /// Sets the key at `path`: dotted table names, `name[N]` for an entry of an array of
    /// tables (`consumers[0].source.dead_letter`).
    pub fn set(mut self, path: &str, value: impl Into<toml::Value>) -> TomlConfig {
        let (tables, key) = path.rsplit_once('.').unwrap_or(("", path));
        self.table_mut(tables, path)
            .insert(key.to_string(), value.into());
        self
    }

    /// The string at `path`, if there is one.
    pub fn get(&self, path: &str) -> Option<String> {
        let (tables, key) = path.rsplit_once('.').unwrap_or(("", path));
        let mut table = &self.0;
        for part in tables.split('.').filter(|p| !p.is_empty()) {
            table = match part.split_once('[') {
                Some((name, index)) => {
                    let i: usize = index.trim_end_matches(']').parse().unwrap();
                    table.get(name)?.as_array()?.get(i)?.as_table()?
                }
                None => table.get(part)?.as_table()?,
            };
        }
        table.get(key)?.as_str().map(str::to_string)
    }

    /// Removes the key at `path` (which must be there).
    pub fn remove(mut self, path: &str) -> TomlConfig {
        let (tables, key) = path.rsplit_once('.').unwrap_or(("", path));
        let table = self.table_mut(tables, path);
        assert!(table.remove(key).is_some(), "{path}: no such key");
        self
    }

    pub fn text(&self) -> String {
        toml::to_string(&self.0).unwrap()
    }

    /// The table at dotted `tables` (made if missing; `name[N]` must exist).
    fn table_mut(&mut self, tables: &str, path: &str) -> &mut toml::Table {
        let mut table = &mut self.0;
        for part in tables.split('.').filter(|p| !p.is_empty()) {
            table = match part.split_once('[') {
                Some((name, index)) => {
                    let i: usize = index.trim_end_matches(']').parse().unwrap();
                    match table.get_mut(name) {
                        Some(toml::Value::Array(items)) => match items.get_mut(i) {
                            Some(toml::Value::Table(t)) => t,
                            _ => panic!("{path}: no table {name}[{i}]"),
                        },
                        _ => panic!("{path}: no array of tables {name}"),
                    }
                }
                None => match table
                    .entry(part)
                    .or_insert_with(|| toml::Value::Table(toml::Table::new()))
                {
                    toml::Value::Table(t) => t,
                    _ => panic!("{path}: {part} is not a table"),
                },
            };
        }
        table
    }
}

/// Writes a completed `201` record with `body` under `key`, claimed with a made-up fingerprint,
/// as a previous version of the gateway would have left it; kept `ttl`.
pub async fn store_completed(
    store: &dyn idemgate::store::Store,
    key: &idemgate::key::StoreKey,
    body: &'static [u8],
    ttl: Duration,
) {
    use idemgate::store::{Claim, Reservation, StoredResponse};
    let claim = Claim::from(idemgate::fingerprint::Fingerprint([9; 32]));
    let Reservation::Owner(owner) = store
        .reserve(key, &claim, Duration::from_secs(30), ttl)
        .await
        .unwrap()
    else {
        panic!("a fresh key");
    };
    let answer = StoredResponse {
        trailers: vec![],
        status: http::StatusCode::CREATED,
        headers: vec![],
        body: bytes::Bytes::from_static(body),
        body_kept: true,
        completed_ms: 1,
        link: None,
    };
    store.complete(key, owner, answer, ttl).await.unwrap();
}

/// Opens a WebSocket through the gateway at `addr` (an HTTP/1.1 upgrade of `GET /chat`) and
/// returns the socket once the `101` head has been read, with the head.
pub async fn websocket(addr: SocketAddr) -> (tokio::net::TcpStream, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /chat HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
        .await
        .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(s.read(&mut byte).await.unwrap(), 1, "closed during the 101");
        head.push(byte[0]);
    }
    (s, String::from_utf8_lossy(&head).into_owned())
}
