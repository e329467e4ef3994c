//! Real RabbitMQ nodes for tests: Debian's `rabbitmq-server`, each node its own (name, data and
//! log directories, an `epmd` of its own) on free loopback ports (never 5672), started and
//! killed by the test. A missing installation is a failure that says what to install.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

use super::redis::free_port;
use super::TempDir;

const SERVER: &str = "/usr/lib/rabbitmq/bin/rabbitmq-server";

pub struct RabbitMq {
    pub port: u16,
    /// With [`RabbitMq::start_tls`]: the AMQPS listener.
    pub tls_port: Option<u16>,
    dist_port: u16,
    epmd_port: u16,
    dir: TempDir,
    node: Option<Child>,
    epmd: Option<Child>,
}

impl RabbitMq {
    /// A node, once it takes AMQP connections.
    pub async fn start() -> RabbitMq {
        Self::start_with(None).await
    }

    /// A node that also takes AMQPS connections on `tls_port`, presenting `cert` (with `key`,
    /// both PEM) and trusting `ca` for clients that present one.
    pub async fn start_tls(cert: &str, key: &str, ca: &str) -> RabbitMq {
        Self::start_with(Some((cert, key, ca))).await
    }

    async fn start_with(tls: Option<(&str, &str, &str)>) -> RabbitMq {
        assert!(
            Path::new(SERVER).exists(),
            "no RabbitMQ server at {SERVER}: these tests need a real one. Install it (Debian: apt-get install rabbitmq-server), or run scripts/test, which does"
        );
        let dir = TempDir::new("rabbitmq");
        std::fs::create_dir_all(dir.path.join("mnesia")).unwrap();
        std::fs::write(dir.path.join("enabled_plugins"), "[].\n").unwrap();
        let mut conf = "log.console = false\n".to_string();
        let tls_port = tls.map(|(cert, key, ca)| {
            let port = free_port(false);
            for (name, pem) in [("cert.pem", cert), ("key.pem", key), ("ca.pem", ca)] {
                std::fs::write(dir.path.join(name), pem).unwrap();
            }
            let at = |name: &str| dir.path.join(name).display().to_string();
            conf.push_str(&format!(
                "listeners.ssl.1 = 127.0.0.1:{port}\nssl_options.certfile = {}\nssl_options.keyfile = {}\nssl_options.cacertfile = {}\nssl_options.verify = verify_none\nssl_options.fail_if_no_peer_cert = false\n",
                at("cert.pem"),
                at("key.pem"),
                at("ca.pem")
            ));
            port
        });
        std::fs::write(dir.path.join("rabbitmq.conf"), conf).unwrap();
        let mut node = RabbitMq {
            port: free_port(false),
            tls_port,
            dist_port: free_port(false),
            epmd_port: free_port(false),
            dir,
            node: None,
            epmd: None,
        };
        node.boot().await;
        node
    }

    async fn boot(&mut self) {
        let epmd = Command::new("epmd")
            .args(["-port", &self.epmd_port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("epmd (Debian: apt-get install erlang-base, a dependency of rabbitmq-server)");
        self.epmd = Some(epmd);
        let d = &self.dir.path;
        let log = std::fs::File::create(d.join("out.log")).unwrap();
        let node = Command::new(SERVER)
            .env("HOME", d)
            .env(
                "RABBITMQ_NODENAME",
                format!("rabbit-{}@localhost", self.port),
            )
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("ERL_EPMD_PORT", self.epmd_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", d.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", d.join("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d.join("enabled_plugins"))
            .env("RABBITMQ_CONFIG_FILE", d.join("rabbitmq.conf"))
            .env("RABBITMQ_PID_FILE", d.join("pid"))
            // The Erlang VM takes over a terminal it finds on its input.
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            // One group: the script, the VM and its helpers are killed together.
            .process_group(0)
            .spawn()
            .expect("starting rabbitmq-server");
        self.node = Some(node);
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            if Connection::connect(&self.url(), ConnectionProperties::default())
                .await
                .is_ok()
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "RabbitMQ did not start: {}",
                std::fs::read_to_string(d.join("out.log")).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// The AMQPS URL of a node made by [`RabbitMq::start_tls`].
    pub fn tls_url(&self) -> String {
        let port = self.tls_port.expect("a node started with TLS");
        format!("amqps://guest:guest@127.0.0.1:{port}/%2f")
    }

    /// Kills the node with SIGKILL and starts it again on the same ports and data: durable
    /// queues and their persistent messages are still there.
    pub async fn restart(&mut self) {
        self.kill();
        self.boot().await;
    }

    fn kill(&mut self) {
        for child in [self.node.take(), self.epmd.take()].into_iter().flatten() {
            let mut child = child;
            if let Ok(pgid) = i32::try_from(child.id()) {
                let _ = nix::sys::signal::killpg(
                    nix::unistd::Pid::from_raw(pgid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            let _ = child.wait();
        }
    }

    /// A channel of a connection of its own, in confirm mode.
    pub async fn channel(&self) -> (Connection, Channel) {
        let conn = Connection::connect(&self.url(), ConnectionProperties::default())
            .await
            .unwrap();
        let channel = conn.create_channel().await.unwrap();
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        (conn, channel)
    }

    /// Declares a durable queue: a quorum queue (which counts deliveries) or a classic one.
    pub async fn declare(&self, queue: &str, quorum: bool) {
        let args: &[(&str, AMQPValue)] = if quorum {
            &[(
                "x-queue-type",
                AMQPValue::LongString(LongString::from("quorum")),
            )]
        } else {
            &[]
        };
        self.declare_with(queue, args).await;
    }

    /// Declares a durable queue with these arguments (`x-queue-type`, `x-delivery-limit`,
    /// `x-overflow`, ...).
    pub async fn declare_with(&self, queue: &str, arguments: &[(&str, AMQPValue)]) {
        let (_conn, channel) = self.channel().await;
        let mut args = FieldTable::default();
        for (name, value) in arguments {
            args.insert((*name).into(), value.clone());
        }
        channel
            .queue_declare(queue.into(), QueueDeclareOptions::durable(), args)
            .await
            .unwrap();
    }

    /// Publishes each body to `queue` (persistent, confirmed), with its message id.
    pub async fn publish(&self, queue: &str, messages: &[(String, Vec<u8>)]) {
        let (_conn, channel) = self.channel().await;
        for (id, body) in messages {
            let properties = BasicProperties::default()
                .with_delivery_mode(2)
                .with_message_id(id.as_str().into())
                .with_content_type("application/json".into());
            channel
                .basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions::default(),
                    body,
                    properties,
                )
                .await
                .unwrap()
                .await
                .unwrap();
        }
    }

    /// Messages ready in `queue` (not delivered, or given back unacknowledged).
    pub async fn ready(&self, queue: &str) -> u32 {
        let (_conn, channel) = self.channel().await;
        let options = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        channel
            .queue_declare(queue.into(), options, FieldTable::default())
            .await
            .unwrap()
            .message_count()
    }

    /// Takes every message in `queue`: body, and headers as text.
    pub async fn drain(&self, queue: &str) -> Vec<(String, Vec<(String, String)>)> {
        let (_conn, channel) = self.channel().await;
        let mut out = Vec::new();
        while let Some(m) = channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            let headers = m
                .delivery
                .properties
                .headers()
                .as_ref()
                .map(|h| {
                    h.inner()
                        .iter()
                        .map(|(k, v)| {
                            let v = match v {
                                AMQPValue::LongString(s) => {
                                    String::from_utf8_lossy(s.as_bytes()).into_owned()
                                }
                                other => format!("{other:?}"),
                            };
                            (k.as_str().to_owned(), v)
                        })
                        .collect()
                })
                .unwrap_or_default();
            out.push((
                String::from_utf8_lossy(&m.delivery.data).into_owned(),
                headers,
            ));
        }
        out
    }
}

impl Drop for RabbitMq {
    fn drop(&mut self) {
        self.kill();
    }
}
