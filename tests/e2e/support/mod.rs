//! Test harness: a real upstream and the real gateway on loopback port 0, a small client, and
//! real Redis servers ([`redis`]).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod client;
pub mod nats;
mod process;
pub mod redis;
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
