//! Real Postgres servers for tests: `initdb` once per test process into a template, copied per
//! server, each started on a free loopback port (never 5432) in a scratch directory. Postgres
//! refuses to run as root: as root, every server command runs as `nobody` (`setpriv`). A missing
//! installation is a failure that says what to install, never a skip.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::redis::free_port;

/// The directory of the newest installed server's binaries (Debian: /usr/lib/postgresql/N/bin).
fn bin_dir() -> PathBuf {
    let newest = std::fs::read_dir("/usr/lib/postgresql")
        .ok()
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .max();
    match newest {
        Some(v) if Path::new(&format!("/usr/lib/postgresql/{v}/bin/postgres")).exists() => {
            PathBuf::from(format!("/usr/lib/postgresql/{v}/bin"))
        }
        _ => panic!(
            "no Postgres server found under /usr/lib/postgresql: these tests need a real one. Install it (Debian: apt-get install postgresql), or run scripts/test, which does"
        ),
    }
}

fn bin(name: &str) -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(bin_dir).join(name)
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout.starts_with(b"0\n"))
        .unwrap_or(false)
}

/// `program` run as the unprivileged user when this process is root (the server refuses root).
fn as_server_user(program: &Path) -> Command {
    static ROOT: OnceLock<bool> = OnceLock::new();
    if *ROOT.get_or_init(is_root) {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"])
            .arg(program);
        c
    } else {
        Command::new(program)
    }
}

/// Gives `dir` to the server's user (as root), with the mode Postgres insists on.
fn hand_over(dir: &Path) {
    if is_root() {
        let ok = Command::new("chown")
            .args(["-R", "nobody:nogroup"])
            .arg(dir)
            .status()
            .unwrap()
            .success();
        assert!(ok, "chown {} failed", dir.display());
    }
    let ok = Command::new("chmod")
        .arg("700")
        .arg(dir)
        .status()
        .unwrap()
        .success();
    assert!(ok);
}

fn scratch(tag: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "idemgate-pg-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A data directory made by `initdb` once per machine (per server version), shared by every test
/// process (cargo-nextest runs each test in its own, and `initdb` takes seconds): made under a
/// lock in a directory of its own, then renamed into place, so a process never copies a half-made
/// one; servers start from copies and never write to it.
fn template() -> &'static Path {
    static TEMPLATE: OnceLock<PathBuf> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        let version = bin_dir()
            .parent()
            .and_then(|p| p.file_name())
            .map(|v| v.to_string_lossy().into_owned())
            .unwrap_or_default();
        let shared = std::env::temp_dir().join(format!("idemgate-pg-template-v{version}"));
        let data = shared.join("data");
        let lock = super::lock_file("idemgate-e2e-locks", &format!("pg-template-v{version}"));
        lock.lock().unwrap();
        if !data.join("PG_VERSION").exists() {
            let dir = scratch("template");
            hand_over(&dir);
            let out = as_server_user(&bin("initdb"))
                .arg("-D")
                .arg(dir.join("data"))
                .args([
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "-E",
                    "UTF8",
                    "--locale=C",
                    "--no-sync",
                ])
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "initdb failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let _ = std::fs::remove_dir_all(&shared);
            std::fs::rename(&dir, &shared).unwrap();
        }
        drop(lock);
        data
    })
}

/// A scratch directory holding a copy of the template's data directory (`data`).
fn from_template() -> PathBuf {
    let dir = scratch("server");
    let ok = Command::new("cp")
        .arg("-a")
        .arg(template())
        .arg(dir.join("data"))
        .status()
        .unwrap()
        .success();
    assert!(ok, "copying the template data directory failed");
    dir
}

/// One Postgres server on a free port. Stopped (immediately) and removed on drop.
pub struct Postgres {
    pub port: u16,
    dir: PathBuf,
    settings: Vec<String>,
    child: Option<Child>,
    /// A WAL sender this test signalled ([`Self::signal_wal_sender`]).
    wal_sender: Option<String>,
    /// The network namespace and address it runs in and listens on ([`Self::start_in`]); else
    /// this machine's loopback.
    host: Option<(String, String)>,
}

impl Postgres {
    pub fn start() -> Postgres {
        Self::start_with(&[])
    }

    /// A server with extra `-c name=value` settings.
    pub fn start_with(settings: &[&str]) -> Postgres {
        let dir = from_template();
        hand_over(&dir);
        Self::run_in(dir, settings)
    }

    /// A server that speaks TLS with this certificate and key (PEM), besides plain TCP.
    pub fn start_tls(cert: &str, key: &str) -> Postgres {
        let dir = from_template();
        let (cert_path, key_path) = (dir.join("server.crt"), dir.join("server.key"));
        std::fs::write(&cert_path, cert).unwrap();
        std::fs::write(&key_path, key).unwrap();
        // Postgres refuses a key others can read.
        assert!(Command::new("chmod")
            .arg("600")
            .arg(&key_path)
            .status()
            .unwrap()
            .success());
        hand_over(&dir);
        let settings = [
            "ssl=on".to_string(),
            format!("ssl_cert_file={}", cert_path.display()),
            format!("ssl_key_file={}", key_path.display()),
        ];
        let settings: Vec<&str> = settings.iter().map(String::as_str).collect();
        Self::run_in(dir, &settings)
    }

    /// A server in the network namespace `ns`, on `addr`:5432, accepting every address of the
    /// partition tests' bridges (10.231.0.0/16) for queries and replication, with `settings`.
    pub fn start_in(ns: &str, addr: std::net::Ipv4Addr, settings: &[&str]) -> Postgres {
        let dir = from_template();
        let hba = dir.join("data").join("pg_hba.conf");
        let mut text = std::fs::read_to_string(&hba).unwrap();
        text.push_str(
            "host all all 10.231.0.0/16 trust\nhost replication all 10.231.0.0/16 trust\n",
        );
        std::fs::write(&hba, text).unwrap();
        hand_over(&dir);
        Self::run_at(dir, settings, Some((ns.to_string(), addr.to_string())))
    }

    /// A standby of `primary` (pg_basebackup) in the network namespace `ns`, on `addr`:5432,
    /// streaming as `name` (make it synchronous with [`Self::require_sync_standby`]).
    pub fn standby_in(
        primary: &Postgres,
        ns: &str,
        addr: std::net::Ipv4Addr,
        name: &str,
    ) -> Postgres {
        let dir = Self::base_backup(primary);
        let host = Some((ns.to_string(), addr.to_string()));
        Self::run_at(dir, &[&format!("cluster_name={name}")], host)
    }

    /// A copy of `primary`'s data directory (`pg_basebackup -R`: it starts as its standby).
    fn base_backup(primary: &Postgres) -> PathBuf {
        let dir = scratch("standby");
        hand_over(&dir);
        let out = as_server_user(&bin("pg_basebackup"))
            .args([
                "-h",
                primary.addr(),
                "-U",
                "postgres",
                "-X",
                "stream",
                "-R",
                "--no-sync",
            ])
            .args(["-p", &primary.port.to_string()])
            .arg("-D")
            .arg(dir.join("data"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "pg_basebackup failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        dir
    }

    /// The address it listens on.
    pub fn addr(&self) -> &str {
        self.host
            .as_ref()
            .map_or("127.0.0.1", |(_, addr)| addr.as_str())
    }

    /// A synchronous standby of `primary` (pg_basebackup), streaming as `name`.
    pub fn standby_of(primary: &Postgres, name: &str) -> Postgres {
        let dir = Self::base_backup(primary);
        Self::run_in(dir, &[&format!("cluster_name={name}")])
    }

    fn run_in(dir: PathBuf, settings: &[&str]) -> Postgres {
        Self::run_at(dir, settings, None)
    }

    fn run_at(dir: PathBuf, settings: &[&str], host: Option<(String, String)>) -> Postgres {
        let mut server = Postgres {
            // A namespace has ports of its own.
            port: if host.is_some() {
                5432
            } else {
                free_port(false)
            },
            dir,
            settings: settings.iter().map(|s| s.to_string()).collect(),
            child: None,
            wal_sender: None,
            host,
        };
        server.launch();
        server
    }

    fn launch(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("server.log"))
            .unwrap();
        let mut cmd = match &self.host {
            None => as_server_user(&bin("postgres")),
            Some((ns, _)) => {
                let user = as_server_user(&bin("postgres"));
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns])
                    .arg(user.get_program())
                    .args(user.get_args());
                c
            }
        };
        let listen = format!("listen_addresses={}", self.addr());
        cmd.arg("-D")
            .arg(self.dir.join("data"))
            .args(["-p", &self.port.to_string(), "-k"])
            .arg(&self.dir)
            .args([
                "-c",
                &listen,
                "-c",
                "shared_buffers=16MB",
                "-c",
                "dynamic_shared_memory_type=mmap",
                "-c",
                "max_connections=200",
            ]);
        for s in &self.settings {
            cmd.args(["-c", s]);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start postgres: {e}"));
        self.child = Some(child);
        self.wait_ready();
    }

    // Blocking, as process management is here: called before a test's async part, or on drop.
    #[allow(clippy::disallowed_methods)]
    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let ready = Command::new(bin("pg_isready"))
                .args(["-h", self.addr(), "-p", &self.port.to_string(), "-t", "1"])
                .stdout(Stdio::null())
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if ready {
                return;
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                panic!("postgres exited ({status}): {}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "postgres on port {} never became ready: {}",
                self.port,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }

    /// `postgres://postgres@<address>:<port>/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@{}:{}/postgres", self.addr(), self.port)
    }

    /// Runs `sql` with psql; its unaligned output, trimmed. Panics on an error.
    pub fn psql(&self, sql: &str) -> String {
        self.try_psql(sql)
            .unwrap_or_else(|e| panic!("psql {sql:?} failed: {e}"))
    }

    pub fn try_psql(&self, sql: &str) -> Result<String, String> {
        let out = Command::new(bin("psql"))
            .args([
                "-h",
                self.addr(),
                "-U",
                "postgres",
                "-d",
                "postgres",
                "-At",
                "-X",
            ])
            .args([
                "-p",
                &self.port.to_string(),
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                sql,
            ])
            .output()
            .unwrap();
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).to_string())
        }
    }

    /// `kill -9` of the postmaster (its backends notice and exit; a stopped WAL sender is
    /// killed too).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(pid) = self.wal_sender.take() {
            signal_pid(&pid, "KILL");
        }
    }

    /// A fast shutdown (SIGINT: sessions are ended, the server checkpoints and exits).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal(&child, "INT");
            let _ = child.wait();
        }
    }

    /// Started again on the same port and data directory.
    pub fn restart(&mut self) {
        self.stop();
        self.launch();
    }

    /// Starts it again after a [`Self::stop`] or [`Self::kill`].
    pub fn start_again(&mut self) {
        self.launch();
    }

    /// Signals a primary's WAL sender (`STOP`: the standby falls behind, nothing more is sent;
    /// `KILL`: it goes, also while stopped, which it would not notice of a killed primary).
    pub fn signal_wal_sender(&mut self, signal_name: &str) {
        let pid = self.psql("SELECT pid FROM pg_stat_replication");
        assert!(!pid.is_empty(), "no WAL sender on port {}", self.port);
        self.wal_sender = Some(pid.clone());
        signal_pid(&pid, signal_name);
    }

    /// Promotes a standby (`pg_promote`, which waits until it is done).
    pub fn promote(&self) {
        assert_eq!(self.psql("SELECT pg_promote(true, 60)"), "t");
    }

    /// Makes `standby` (its `cluster_name`) the synchronous standby, and waits until it is.
    // Blocking, as process management is here: called before a test's async part, or on drop.
    #[allow(clippy::disallowed_methods)]
    pub fn require_sync_standby(&self, name: &str) {
        self.psql(&format!(
            "ALTER SYSTEM SET synchronous_standby_names = '{name}'"
        ));
        self.psql("SELECT pg_reload_conf()");
        let deadline = Instant::now() + Duration::from_secs(30);
        let query =
            format!("SELECT sync_state FROM pg_stat_replication WHERE application_name = '{name}'");
        while self.psql(&query) != "sync" {
            assert!(Instant::now() < deadline, "{name} never became synchronous");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn signal_pid(pid: &str, name: &str) {
    let _ = Command::new("kill")
        .args([&format!("-{name}"), pid])
        .status();
}

fn signal(child: &Child, name: &str) {
    let _ = Command::new("kill")
        .args([&format!("-{name}"), &child.id().to_string()])
        .status();
}

impl Drop for Postgres {
    // Blocking, as process management is here: called before a test's async part, or on drop.
    #[allow(clippy::disallowed_methods)]
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Immediate shutdown: the postmaster ends its backends itself.
            signal(&child, "QUIT");
            let deadline = Instant::now() + Duration::from_secs(10);
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
