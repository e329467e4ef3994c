//! A real `nats-server` with JetStream on a free loopback port, started and stopped by the
//! tests, and the few client calls they make (async-nats). A missing binary is a failure that
//! says what to install, never a skip.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use async_nats::jetstream;

pub struct NatsServer {
    pub port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl NatsServer {
    pub fn start() -> NatsServer {
        let port = super::redis::free_port(false);
        let dir = std::env::temp_dir().join(format!("idemgate-nats-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut s = NatsServer {
            port,
            dir,
            child: None,
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let bin = ["/usr/sbin/nats-server", "/usr/bin/nats-server", "/usr/local/bin/nats-server"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
            .unwrap_or_else(|| {
                panic!("nats-server not found: these tests need a real NATS server with JetStream. Install it (Debian: apt-get install nats-server), or run scripts/test, which does")
            });
        let mut child = Command::new(bin)
            .args([
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-sd",
            ])
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains("Server is ready") {
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(());
                    }
                }
            }
        });
        rx.recv_timeout(Duration::from_secs(20))
            .expect("nats-server did not become ready within 20s");
        self.child = Some(child);
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub async fn jetstream(&self) -> jetstream::Context {
        jetstream::new(async_nats::connect(self.url()).await.unwrap())
    }

    /// A stream named `name` on `subjects`.
    pub async fn stream(&self, name: &str, subjects: &[&str]) {
        self.jetstream()
            .await
            .create_stream(jetstream::stream::Config {
                name: name.to_string(),
                subjects: subjects.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            })
            .await
            .unwrap();
    }

    pub async fn publish(&self, subject: &str, payload: &str) {
        self.jetstream()
            .await
            .publish(subject.to_string(), payload.to_string().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// The durable consumer's (ack pending, not yet delivered) messages.
    pub async fn outstanding(&self, stream: &str, durable: &str) -> Option<(usize, u64)> {
        let js = self.jetstream().await;
        let mut consumer: jetstream::consumer::PullConsumer = js
            .get_stream(stream)
            .await
            .ok()?
            .get_consumer(durable)
            .await
            .ok()?;
        let info = consumer.info().await.ok()?;
        Some((info.num_ack_pending, info.num_pending))
    }

    /// Every message of a stream, in order: headers and payload.
    pub async fn messages(&self, stream: &str) -> Vec<(async_nats::HeaderMap, String)> {
        let js = self.jetstream().await;
        let mut s = js.get_stream(stream).await.unwrap();
        let last = s.info().await.unwrap().state.last_sequence;
        let mut out = Vec::new();
        for seq in 1..=last {
            if let Ok(m) = s.get_raw_message(seq).await {
                out.push((m.headers, String::from_utf8_lossy(&m.payload).to_string()));
            }
        }
        out
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
