//! The real `idemgate` binary as a child process: started on a written config, its logs
//! followed, signalled, killed on drop; and `idemgate keys`.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::time::Duration;

use super::*;

/// The real `idemgate` binary running `run --config` on a written config. Killed on drop.
pub struct GatewayProcess {
    pub addr: SocketAddr,
    pub config_path: std::path::PathBuf,
    child: std::process::Child,
    logs: std::sync::mpsc::Receiver<String>,
    _dir: TempDir,
}

impl GatewayProcess {
    /// Writes `config` and starts the binary; returns once it logged where it listens.
    pub fn start(config: &str) -> GatewayProcess {
        Self::start_with_args(config, &[])
    }

    /// The same, with extra command-line arguments (e.g. `--log-format json`).
    pub fn start_with_args(config: &str, args: &[&str]) -> GatewayProcess {
        Self::start_full(config, args, &[])
    }

    /// The same, with environment variables (e.g. `FAILPOINTS`).
    pub fn start_with_env(config: &str, env: &[(&str, &str)]) -> GatewayProcess {
        Self::start_full(config, &[], env)
    }

    fn start_full(config: &str, args: &[&str], env: &[(&str, &str)]) -> GatewayProcess {
        let dir = TempDir::new("gw");
        let config_path = dir.path.join("proxy.toml");
        std::fs::write(&config_path, config).unwrap();
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .args(args)
            .args(["run", "--config"])
            .arg(&config_path)
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let (addr, logs) = wait_listening(&mut child);
        GatewayProcess {
            addr,
            config_path,
            child,
            logs,
            _dir: dir,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal (e.g. "-TERM", "-KILL") and waits for the exit status.
    pub fn signal_and_wait(mut self, signal: &str) -> std::process::ExitStatus {
        self.signal(signal);
        self.child.wait().unwrap()
    }

    /// Sends a signal without waiting.
    pub fn signal(&self, signal: &str) {
        let pid = self.child.id().to_string();
        std::process::Command::new("kill")
            .args([signal, &pid])
            .status()
            .unwrap();
    }

    /// Waits (at most 20 s) for a log line containing `needle` and returns it.
    pub fn wait_log(&self, needle: &str) -> String {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.logs.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return line,
                Ok(_) => {}
                Err(_) => panic!("no log line containing {needle:?} within 20s"),
            }
        }
    }

    /// Log lines received so far (without waiting).
    pub fn drain_logs(&self) -> Vec<String> {
        self.logs.try_iter().collect()
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The child's stderr, line by line as it comes (also echoed, for failing tests).
pub fn follow_logs(child: &mut std::process::Child) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            eprintln!("[gateway] {line}");
            let _ = tx.send(line);
        }
    });
    rx
}

/// Reads the child's stderr until the "listening" line and returns the address it names (text
/// or JSON logs), and the channel on which the following lines keep arriving (also echoed, for
/// failing tests).
pub fn wait_listening(
    child: &mut std::process::Child,
) -> (SocketAddr, std::sync::mpsc::Receiver<String>) {
    let rx = follow_logs(child);
    loop {
        let line = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the gateway printed no 'listening' line within 20s");
        if line.contains("idemgate listening") {
            let addr = if line.trim_start().starts_with('{') {
                let v: serde_json::Value = serde_json::from_str(&line).unwrap();
                v["addr"].as_str().unwrap().to_string()
            } else {
                line.split("addr=")
                    .nth(1)
                    .unwrap()
                    .split_whitespace()
                    .next()
                    .unwrap()
                    .to_string()
            };
            return (addr.parse().unwrap(), rx);
        }
    }
}

/// `idemgate keys list --config CONFIG ARGS...`: the entries it printed, one JSON object per
/// line (through the gateway's operator API when one runs, else from the store).
pub fn keys_list(config: &std::path::Path, args: &[&str]) -> Vec<serde_json::Value> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["keys", "list", "--config"])
        .arg(config)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Runs `idemgate keys <action> --route <route> --key <part>... --config <config>`.
pub fn keys_cmd(
    config: &std::path::Path,
    action: &str,
    route: &str,
    key_parts: &[&str],
) -> std::process::Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"));
    cmd.args(["keys", action, "--route", route, "--config"])
        .arg(config);
    for part in key_parts {
        cmd.args(["--key", part]);
    }
    cmd.output().unwrap()
}
