//! Real `redis-server` processes for tests: one server, or a 3-master cluster, on free loopback
//! ports (never 6379), started and stopped by the tests. A missing binary is a failure that says
//! what to install, never a skip.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

fn binary(name: &str) -> PathBuf {
    for dir in ["/usr/bin", "/usr/local/bin", "/usr/sbin"] {
        let p = PathBuf::from(dir).join(name);
        if p.exists() {
            return p;
        }
    }
    if let Ok(out) = Command::new("which").arg(name).output() {
        let s = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if !s.is_empty() {
            return PathBuf::from(s);
        }
    }
    panic!(
        "{name} not found: these tests need a real Redis. Install it (Debian: apt-get install redis-server), or run scripts/test, which does"
    );
}

/// First and last port [`free_port`] hands out: below Linux's ephemeral range (32768 and up), so
/// that no socket bound to port 0 (a gateway's listener, a client connection's local end) takes
/// one between the test choosing it and its server binding it, or between a server's kill and
/// its restart on the same port; a cluster's bus ports (+10000) stay below it too.
const PORTS: std::ops::Range<u16> = 20000..22760;

/// A loopback port that is free now, never handed out before by this process (until all of
/// [`PORTS`] were) nor held by another test process, never 6379; with `bus`, port + 10000 is free
/// too (cluster bus).
///
/// cargo-nextest runs each test in a process of its own, several at once: a port is claimed with
/// a lock on a file named after it (see [`claim`]), held until the process ends, so two test
/// processes never hand out the same port, whatever their order.
pub fn free_port(bus: bool) -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    // Starts somewhere else in each process (spread by a multiplicative hash of the pid), so
    // that processes started one after the other do not all walk the same ports, nor meet ports
    // a finished one's servers may still hold in TIME_WAIT.
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let span = u32::from(PORTS.end - PORTS.start);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        std::process::id().wrapping_mul(2_654_435_761) % span,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed) % span;
        let port = PORTS.start + u16::try_from(n).unwrap();
        let free = |p: u16| TcpListener::bind(("127.0.0.1", p)).is_ok();
        if free(port) && (!bus || free(port + 10000)) && claim(port) {
            return port;
        }
    }
    panic!("no free port found in {PORTS:?}");
}

/// Claims `port` for this process: an exclusive lock on a file named after it, kept open (and
/// so held) until the process ends, when the kernel drops it, however the process ends.
fn claim(port: u16) -> bool {
    use std::sync::Mutex;
    static HELD: Mutex<Vec<std::fs::File>> = Mutex::new(Vec::new());
    let file = super::lock_file("idemgate-e2e-locks", &format!("port-{port}"));
    if file.try_lock().is_err() {
        return false;
    }
    HELD.lock().unwrap().push(file);
    true
}

fn scratch_dir(tag: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "idemgate-redis-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// One `redis-server` on a free port. Killed on drop.
pub struct RedisServer {
    pub port: u16,
    /// The CA certificate when the server speaks TLS only (`start_tls`).
    pub tls_ca: Option<PathBuf>,
    /// A client certificate and key it accepts, when it requires one (`start_mtls`).
    pub tls_client: Option<(PathBuf, PathBuf)>,
    dir: PathBuf,
    extra: Vec<String>,
    child: Option<Child>,
}

impl RedisServer {
    /// A plain server without persistence.
    pub fn start() -> RedisServer {
        Self::start_with(&[])
    }

    /// A server that survives `kill -9` with nothing lost (AOF, fsync on every write).
    pub fn start_durable() -> RedisServer {
        Self::start_with(&["--appendonly", "yes", "--appendfsync", "always"])
    }

    pub fn start_with(extra: &[&str]) -> RedisServer {
        Self::start_on(free_port(false), extra)
    }

    /// Starts on a given port (e.g. one a gateway already points at).
    pub fn start_on(port: u16, extra: &[&str]) -> RedisServer {
        let mut s = RedisServer {
            port,
            tls_ca: None,
            tls_client: None,
            dir: scratch_dir("single"),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            child: None,
        };
        s.spawn();
        s
    }

    /// A server that speaks TLS only, with a certificate for 127.0.0.1 signed by a test CA
    /// (made with `openssl`); its CA is in `tls_ca`.
    pub fn start_tls() -> RedisServer {
        Self::start_tls_with(false)
    }

    /// A TLS-only server that also requires a client certificate signed by its CA (mTLS); a
    /// valid one is in `tls_client`.
    pub fn start_mtls() -> RedisServer {
        Self::start_tls_with(true)
    }

    fn start_tls_with(client_auth: bool) -> RedisServer {
        let dir = scratch_dir("tls");
        let run = |args: &[&str]| {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(&dir)
                .output()
                .unwrap_or_else(|e| {
                    panic!("openssl is needed for the TLS tests (apt-get install openssl): {e}")
                });
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        run(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "2",
            "-subj",
            "/CN=idemgate-test-ca",
        ]);
        run(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=127.0.0.1",
        ]);
        std::fs::write(
            dir.join("ext.cnf"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
        )
        .unwrap();
        run(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.crt",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
        ]);
        if client_auth {
            std::fs::write(dir.join("client.cnf"), "extendedKeyUsage=clientAuth\n").unwrap();
            run(&[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                "client.key",
                "-out",
                "client.csr",
                "-subj",
                "/CN=idemgate",
            ]);
            run(&[
                "x509",
                "-req",
                "-in",
                "client.csr",
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                "client.crt",
                "-days",
                "2",
                // An extension makes it X.509 v3: rustls refuses v1 certificates.
                "-extfile",
                "client.cnf",
            ]);
        }
        let port = free_port(false);
        let d = |f: &str| dir.join(f).display().to_string();
        let extra = [
            "--port".to_string(),
            "0".into(),
            "--tls-port".into(),
            port.to_string(),
            "--tls-cert-file".into(),
            d("server.crt"),
            "--tls-key-file".into(),
            d("server.key"),
            "--tls-ca-cert-file".into(),
            d("ca.crt"),
            "--tls-auth-clients".into(),
            if client_auth { "yes" } else { "no" }.into(),
        ];
        let mut s = RedisServer {
            port,
            tls_ca: Some(dir.join("ca.crt")),
            tls_client: client_auth.then(|| (dir.join("client.crt"), dir.join("client.key"))),
            // Certificates and data share the directory, removed on drop.
            dir: dir.clone(),
            extra: extra.to_vec(),
            child: None,
        };
        s.spawn();
        s
    }

    pub fn url(&self) -> String {
        let scheme = if self.tls_ca.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    fn spawn(&mut self) {
        let port_args: Vec<String> = if self.tls_ca.is_some() {
            Vec::new() // `extra` carries --port 0 and --tls-port
        } else {
            vec!["--port".into(), self.port.to_string()]
        };
        let mut args: Vec<String> = port_args;
        args.extend([
            "--bind".to_string(),
            "127.0.0.1".into(),
            "--save".into(),
            "".into(),
            "--dir".into(),
            self.dir.display().to_string(),
            "--daemonize".into(),
            "no".into(),
            "--logfile".into(),
            "".into(),
        ]);
        args.extend(self.extra.iter().cloned());
        self.child = Some(start_and_wait_ready(&binary("redis-server"), &args));
    }

    /// `kill -9`: no shutdown, no final save.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts again on the same port and directory (an AOF, if enabled, is replayed).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Runs a `redis-cli` command against this server and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        cli(self.port, args)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new(binary("redis-cli"))
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Starts redis-server in the foreground and waits for its "Ready to accept connections" line.
fn start_and_wait_ready(bin: &PathBuf, args: &[String]) -> Child {
    let mut child = Command::new(bin)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            // A sentinel says neither: it is ready once it monitors its primary.
            if line.contains("Ready to accept connections") || line.contains("+monitor master") {
                if let Some(tx) = tx.take() {
                    let _ = tx.send(());
                }
            }
        }
    });
    if rx.recv_timeout(Duration::from_secs(20)).is_err() {
        let _ = child.kill();
        panic!("redis-server {args:?} did not become ready within 20s");
    }
    child
}

/// A replica of the Redis on `port`, once it has caught up with it.
pub async fn replica_of(port: u16) -> RedisServer {
    // The first sync at once, not after Redis's default 5 s wait for more replicas.
    cli(port, &["CONFIG", "SET", "repl-diskless-sync-delay", "0"]);
    let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port.to_string()]);
    let at = replica.port;
    let following = super::eventually_within(Duration::from_secs(20), || async move {
        cli(at, &["INFO", "replication"]).contains("master_link_status:up")
    })
    .await;
    assert!(following, "the replica never caught up with its primary");
    replica
}

/// One Redis Sentinel (`redis-server <conf> --sentinel`) watching the primary on `primary` as
/// `mymaster` with a quorum of 2, quick to act: the primary is down after 500 ms without an
/// answer. Killed on drop.
pub struct Sentinel {
    pub port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl Sentinel {
    pub fn start(primary: u16) -> Sentinel {
        let port = free_port(false);
        let dir = scratch_dir("sentinel");
        let conf = dir.join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {}\nsentinel monitor mymaster 127.0.0.1 {primary} 2\nsentinel down-after-milliseconds mymaster 500\nsentinel failover-timeout mymaster 5000\nsentinel parallel-syncs mymaster 2\n",
                dir.display()
            ),
        )
        .unwrap();
        let args = [
            conf.display().to_string(),
            "--sentinel".into(),
            "--logfile".into(),
            "".into(),
        ];
        let child = Some(start_and_wait_ready(&binary("redis-server"), &args));
        Sentinel { port, dir, child }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The port of the primary this sentinel names now.
    pub fn primary(&self) -> Option<u16> {
        let out = cli(
            self.port,
            &["SENTINEL", "get-master-addr-by-name", "mymaster"],
        );
        out.lines().nth(1)?.trim().parse().ok()
    }

    /// How many replicas and other sentinels this one knows of.
    pub fn knows(&self) -> (usize, usize) {
        let count = |what: &str| {
            cli(self.port, &["SENTINEL", what, "mymaster"])
                .lines()
                .filter(|l| l.trim() == "name")
                .count()
        };
        (count("replicas"), count("sentinels"))
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A 3-master Redis Cluster formed by the test itself.
pub struct RedisCluster {
    pub ports: Vec<u16>,
    dir: PathBuf,
    args: Vec<Vec<String>>,
    children: Vec<Option<Child>>,
}

impl RedisCluster {
    /// Three masters, no replicas.
    pub fn start() -> RedisCluster {
        Self::start_with(3, 0)
    }

    /// Three masters with a replica each; a master that stops answering for 1 s is failed over.
    pub fn start_with_replicas() -> RedisCluster {
        Self::start_with(6, 1)
    }

    fn start_with(nodes: usize, replicas: usize) -> RedisCluster {
        let dir = scratch_dir("cluster");
        let mut ports = Vec::new();
        let mut args = Vec::new();
        let mut children = Vec::new();
        for _ in 0..nodes {
            let port = loop {
                let p = free_port(true);
                if !ports.contains(&p) {
                    break p;
                }
            };
            let node_dir = dir.join(port.to_string());
            std::fs::create_dir_all(&node_dir).unwrap();
            let node_args: Vec<String> = [
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                if replicas > 0 { "1000" } else { "15000" },
                "--repl-diskless-sync-delay",
                "0",
                "--save",
                "",
                "--dir",
                &node_dir.display().to_string(),
                "--logfile",
                "",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            children.push(Some(start_and_wait_ready(
                &binary("redis-server"),
                &node_args,
            )));
            args.push(node_args);
            ports.push(port);
        }
        let nodes: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let out = Command::new(binary("redis-cli"))
            .args(["--cluster", "create"])
            .args(&nodes)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = RedisCluster {
            ports,
            dir,
            args,
            children,
        };
        cluster.wait_ok();
        cluster
    }

    /// Waits until every running node reports `cluster_state:ok` (redis-cli offers no blocking
    /// wait).
    #[allow(clippy::disallowed_methods)]
    pub fn wait_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        for (i, &port) in self.ports.iter().enumerate() {
            if self.children[i].is_none() {
                continue;
            }
            while !cli(port, &["cluster", "info"]).contains("cluster_state:ok") {
                assert!(
                    Instant::now() < deadline,
                    "cluster did not become ok within 30s"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// The ports of the nodes that are masters now, as `port` sees the cluster.
    pub fn masters(&self, port: u16) -> Vec<u16> {
        cli(port, &["cluster", "nodes"])
            .lines()
            .filter(|l| l.contains("master") && !l.contains("fail"))
            .filter_map(|l| {
                let addr = l.split_whitespace().nth(1)?;
                addr.split(['@', ':']).nth(1)?.parse().ok()
            })
            .collect()
    }

    /// `kill -9` of the node on `port`.
    pub fn kill(&mut self, port: u16) {
        let i = self.index(port);
        if let Some(mut c) = self.children[i].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the node on `port` again, with its cluster configuration.
    pub fn restart(&mut self, port: u16) {
        let i = self.index(port);
        self.kill(port);
        self.children[i] = Some(start_and_wait_ready(&binary("redis-server"), &self.args[i]));
    }

    fn index(&self, port: u16) -> usize {
        self.ports.iter().position(|p| *p == port).unwrap()
    }

    pub fn urls(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect()
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for c in self.children.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
