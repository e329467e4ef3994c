//! Hosts of their own on this machine: one network namespace per host, each with an address on a
//! bridge of the test's (10.231.N.0/24, N claimed per test process), partitioned and healed with
//! `iptables` inside the hosts' namespaces, links made lossy with iptables' `statistic` match. The
//! test process itself sits on the bridge (10.231.N.1): it plays the clients, and no partition
//! cuts it off. Everything is removed on drop, and what a killed test left behind is removed by
//! the next test that claims the same N. Needs root.

use std::net::Ipv4Addr;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

/// The hosts of one test and the bridge between them.
pub struct Net {
    id: u8,
    hosts: Vec<Host>,
    dir: PathBuf,
    _claim: std::fs::File,
}

/// One host: a network namespace with one interface (`eth0`) on the bridge.
pub struct Host {
    pub name: &'static str,
    pub ns: String,
    pub addr: Ipv4Addr,
}

fn run(program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}: the partition tests need iproute2 and iptables (Debian: apt-get install iproute2 iptables)"));
    assert!(
        out.status.success(),
        "{program} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn quiet(program: &str, args: &[&str]) {
    let _ = Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// The bridge's name for `id` (an interface name: at most 15 bytes).
fn bridge(id: u8) -> String {
    format!("igp{id}br")
}

/// Removes what a test with `id` left behind (a killed test process runs no drop): the
/// processes still in its namespaces (a namespace goes only with its last process), the
/// namespaces, the host ends of its veth pairs (each takes its peer with it) and the bridge.
fn remove_leftovers(id: u8) {
    let prefix = format!("igp{id}-");
    if let Ok(out) = Command::new("ip").args(["netns", "list"]).output() {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let name = line.split_whitespace().next().unwrap_or("");
            if name.starts_with(&prefix) {
                if let Ok(pids) = Command::new("ip").args(["netns", "pids", name]).output() {
                    for pid in String::from_utf8_lossy(&pids.stdout).split_whitespace() {
                        quiet("kill", &["-9", pid]);
                    }
                }
                quiet("ip", &["netns", "del", name]);
            }
        }
    }
    if let Ok(out) = Command::new("ip").args(["-o", "link", "show"]).output() {
        let veth = format!("igp{id}h");
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let name = line.split(':').nth(1).unwrap_or("").trim();
            let name = name.split('@').next().unwrap_or("");
            if name.starts_with(&veth) {
                quiet("ip", &["link", "del", name]);
            }
        }
    }
    quiet("ip", &["link", "del", &bridge(id)]);
}

/// Claims a subnet number for this process: a lock on a file named after it, held until the
/// process ends, so concurrent test processes never share a bridge.
fn claim() -> (u8, std::fs::File) {
    let start = std::process::id().wrapping_mul(2_654_435_761) % 250;
    for n in 0..250 {
        let id = u8::try_from((start + n) % 250 + 1).unwrap();
        let file = crate::support::lock_file("idemgate-e2e-locks", &format!("netns-{id}"));
        if file.try_lock().is_ok() {
            return (id, file);
        }
    }
    panic!("no free subnet number for the partition tests");
}

impl Net {
    /// Hosts named `names`, at 10.231.N.2, .3, ... in that order, all reachable from each other
    /// and from the test process.
    pub fn new(names: &[&'static str]) -> Net {
        let uid = Command::new("id").arg("-u").output().unwrap().stdout;
        assert!(
            uid.starts_with(b"0\n"),
            "the partition tests make network namespaces, which needs root: run them as root (scripts/test does, as CI does)"
        );
        let (id, claim) = claim();
        remove_leftovers(id);
        let br = bridge(id);
        run("ip", &["link", "add", &br, "type", "bridge"]);
        run(
            "ip",
            &["addr", "add", &format!("10.231.{id}.1/24"), "dev", &br],
        );
        run("ip", &["link", "set", &br, "up"]);
        let mut hosts = Vec::new();
        for (i, name) in names.iter().enumerate() {
            let ns = format!("igp{id}-{name}");
            let veth = format!("igp{id}h{i}");
            let addr = Ipv4Addr::new(10, 231, id, u8::try_from(i + 2).unwrap());
            run("ip", &["netns", "add", &ns]);
            run(
                "ip",
                &[
                    "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
                ],
            );
            run("ip", &["link", "set", &veth, "master", &br, "up"]);
            run(
                "ip",
                &[
                    "-n",
                    &ns,
                    "addr",
                    "add",
                    &format!("{addr}/24"),
                    "dev",
                    "eth0",
                ],
            );
            run("ip", &["-n", &ns, "link", "set", "eth0", "up"]);
            run("ip", &["-n", &ns, "link", "set", "lo", "up"]);
            hosts.push(Host { name, ns, addr });
        }
        let dir =
            std::env::temp_dir().join(format!("idemgate-partitions-{}-{id}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Net {
            id,
            hosts,
            dir,
            _claim: claim,
        }
    }

    pub fn host(&self, name: &str) -> &Host {
        self.hosts
            .iter()
            .find(|h| h.name == name)
            .unwrap_or_else(|| panic!("no host {name}"))
    }

    /// A scratch directory of this test (removed on drop).
    pub fn dir(&self, name: &str) -> PathBuf {
        let d = self.dir.join(name);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// Nothing passes between `a` and `b`, either way: packets are dropped, as a partition
    /// drops them (no reset: connections hang until their timeouts).
    pub fn cut(&self, a: &str, b: &str) {
        self.cut_inbound(a, b);
        self.cut_inbound(b, a);
    }

    /// Every host of `side` cut from every host of `other`.
    pub fn split(&self, side: &[&str], other: &[&str]) {
        for a in side {
            for b in other {
                self.cut(a, b);
            }
        }
    }

    /// `at` drops what comes from `from`; what `at` sends still arrives (replies are lost).
    pub fn cut_inbound(&self, at: &str, from: &str) {
        let from = self.host(from).addr.to_string();
        self.host(at)
            .iptables(&["-A", "INPUT", "-s", &from, "-j", "DROP"]);
    }

    /// Every cut and every lossy link removed.
    pub fn heal(&self) {
        for h in &self.hosts {
            h.iptables(&["-F", "INPUT"]);
        }
    }

    /// `to` drops each packet from `from` with `probability` (a lossy link, one way). `tc
    /// netem` would add delay and reordering too, but these machines' kernel has no `sch_netem`
    /// (only `htb` and `tbf` qdiscs): the loss is played with iptables' `statistic` match.
    pub fn lossy(&self, from: &str, to: &str, probability: f64) {
        let from = self.host(from).addr.to_string();
        self.host(to).iptables(&[
            "-A",
            "INPUT",
            "-s",
            &from,
            "-m",
            "statistic",
            "--mode",
            "random",
            "--probability",
            &probability.to_string(),
            "-j",
            "DROP",
        ]);
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for h in &self.hosts {
            quiet("ip", &["netns", "del", &h.ns]);
        }
        quiet("ip", &["link", "del", &bridge(self.id)]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Host {
    fn iptables(&self, args: &[&str]) {
        let mut all = vec!["netns", "exec", &self.ns, "iptables", "-w"];
        all.extend(args);
        run("ip", &all);
    }

    /// `program` run inside this host (`ip netns exec` execs it: the child is the program).
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns, program]);
        c
    }

    /// Starts `program args` inside this host, its output in `log`. Killed on drop.
    pub fn spawn(&self, program: &str, args: &[String], log: PathBuf) -> Proc {
        let out = std::fs::File::create(&log).unwrap();
        let child = self
            .command(program)
            .args(args)
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {program} in {}: {e}", self.ns));
        Proc {
            child: Some(child),
            log,
        }
    }

    /// A TCP listener on this host's `port` (bound from a thread that enters the namespace: the
    /// socket stays in it, whatever thread serves it).
    pub fn listen(&self, port: u16) -> std::net::TcpListener {
        let path = format!("/run/netns/{}", self.ns);
        let addr = (self.addr, port);
        std::thread::spawn(move || {
            let ns = std::fs::File::open(&path).unwrap();
            nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            let l = std::net::TcpListener::bind(addr).unwrap();
            l.set_nonblocking(true).unwrap();
            l
        })
        .join()
        .unwrap()
    }
}

/// A process inside a host. Killed (SIGKILL) on drop.
pub struct Proc {
    child: Option<Child>,
    pub log: PathBuf,
}

impl Proc {
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}
