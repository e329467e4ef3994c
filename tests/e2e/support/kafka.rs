//! A real Kafka-protocol broker for tests: `tansu` 0.6.0 (a Kafka-compatible broker in Rust,
//! built by scripts/test with `cargo install`; no Java Kafka can be installed here), each test its
//! own broker on a free loopback port (never 9092) with in-memory storage, started and killed by
//! the test. A missing binary is a failure that says how to install it.
//!
//! tansu's memory engine counts a partition's high watermark in record batches, not records, so
//! [`Kafka::produce`] sends one record per batch, and the watermark is the number of records
//! (what [`Kafka::all_committed`] compares the group's offsets with).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};

use super::redis::free_port;

pub const TANSU_VERSION: &str = "0.6.0";

/// One message as the tests produce and read them.
#[derive(Debug, Clone, Default)]
pub struct Record {
    pub key: Option<String>,
    pub value: String,
    pub headers: Vec<(String, String)>,
}

impl Record {
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map_or("", |(_, v)| v.as_str())
    }
}

pub struct Kafka {
    /// Where clients connect: the broker's port, or the TLS relay's in front of it.
    pub port: u16,
    /// With [`Kafka::start_tls`]: the CA file clients trust.
    tls_ca: Option<PathBuf>,
    broker: Child,
}

/// `$TANSU` (scripts/test sets it), else the build scripts/test keeps, else a `cargo install`ed
/// one.
fn tansu() -> PathBuf {
    let kept = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .map(|c| c.join(format!("idemgate/tansu-{TANSU_VERSION}-debug/bin/tansu")));
    let candidates = std::env::var_os("TANSU")
        .map(PathBuf::from)
        .into_iter()
        .chain(kept)
        .chain(std::env::var_os("CARGO_HOME").map(|h| PathBuf::from(h).join("bin/tansu")))
        .chain(std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo/bin/tansu")));
    for c in candidates {
        if c.exists() {
            return c;
        }
    }
    panic!(
        "no tansu broker found ($TANSU, $CARGO_HOME/bin or ~/.cargo/bin): the Kafka tests need one. Run scripts/test, which builds it, or install it with `cargo install tansu --version {TANSU_VERSION} --features dynostore --locked`"
    )
}

impl Kafka {
    /// A broker, once it answers a metadata request.
    pub async fn start() -> Kafka {
        let port = free_port(false);
        Self::start_with(port, port, None).await
    }

    /// A broker on `port` that clients reach only over TLS, through a relay on `advertised`
    /// (tansu 0.6 takes TLS settings but serves none), trusting `ca`.
    pub async fn start_tls(port: u16, advertised: u16, ca: PathBuf) -> Kafka {
        Self::start_with(port, advertised, Some(ca)).await
    }

    /// A broker on `port` that tells clients to connect to `advertised` (a relay in front of
    /// it, which a test can stall).
    pub async fn start_advertised(port: u16, advertised: u16) -> Kafka {
        Self::start_with(port, advertised, None).await
    }

    async fn start_with(port: u16, advertised: u16, tls_ca: Option<PathBuf>) -> Kafka {
        let listener = format!("tcp://127.0.0.1:{port}");
        let advertised_url = format!("tcp://127.0.0.1:{advertised}");
        let broker = Command::new(tansu())
            .args(["broker", "--listener-url", &listener])
            .args(["--advertised-listener-url", &advertised_url])
            .args(["--storage-engine", "memory://tansu/"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start tansu");
        let kafka = Kafka {
            port: advertised,
            tls_ca,
            broker,
        };
        let admin = kafka.admin();
        let ready = super::eventually_within(Duration::from_secs(20), || async {
            admin
                .inner()
                .fetch_metadata(None, Duration::from_millis(500))
                .is_ok()
        })
        .await;
        assert!(ready, "tansu did not answer on port {port}");
        kafka
    }

    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn client(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", self.brokers());
        if let Some(ca) = &self.tls_ca {
            c.set("security.protocol", "ssl")
                .set("ssl.ca.location", ca.display().to_string());
        }
        c
    }

    fn admin(&self) -> AdminClient<DefaultClientContext> {
        self.client().create().unwrap()
    }

    pub async fn create_topic(&self, name: &str, partitions: i32) {
        let topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
        let result = self
            .admin()
            .create_topics(&[topic], &AdminOptions::new())
            .await
            .unwrap();
        for r in result {
            r.unwrap_or_else(|(t, e)| panic!("create topic {t}: {e}"));
        }
    }

    /// Produces `records` in order, one record per batch (see the module doc), each to the
    /// partition its key hashes to (keyless ones spread by the client).
    pub async fn produce(&self, topic: &str, records: &[Record]) {
        let producer: FutureProducer = self
            .client()
            .set("linger.ms", "0")
            .set("batch.num.messages", "1")
            .set("max.in.flight.requests.per.connection", "1")
            .create()
            .unwrap();
        for r in records {
            let mut headers = OwnedHeaders::new();
            for (n, v) in &r.headers {
                headers = headers.insert(Header {
                    key: n,
                    value: Some(v),
                });
            }
            let mut record = FutureRecord::to(topic).payload(&r.value).headers(headers);
            if let Some(k) = &r.key {
                record = record.key(k);
            }
            producer
                .send(record, Duration::from_secs(10))
                .await
                .unwrap_or_else(|(e, _)| panic!("produce to {topic}: {e}"));
        }
    }

    /// Whether `group` has committed every partition of `topic` up to its end: nothing was left
    /// unfinished.
    pub fn all_committed(&self, topic: &str, group: &str) -> Result<(), String> {
        let consumer: BaseConsumer = self.client().set("group.id", group).create().unwrap();
        let metadata = consumer
            .fetch_metadata(Some(topic), Duration::from_secs(5))
            .unwrap();
        let mut list = TopicPartitionList::new();
        for p in metadata.topics()[0].partitions() {
            list.add_partition(topic, p.id());
        }
        let committed = consumer
            .committed_offsets(list, Duration::from_secs(5))
            .unwrap();
        for p in committed.elements() {
            let (_, high) = consumer
                .fetch_watermarks(topic, p.partition(), Duration::from_secs(5))
                .unwrap();
            let at = match p.offset() {
                Offset::Offset(n) => n,
                _ => 0,
            };
            if at != high {
                return Err(format!(
                    "partition {}: committed {:?}, end {high}",
                    p.partition(),
                    p.offset()
                ));
            }
        }
        Ok(())
    }

    /// Every record of `topic` once at least `n` are there (or 30 s have passed), read from the
    /// start of each partition.
    pub async fn read(&self, topic: &str, n: usize) -> Vec<Record> {
        self.read_for(topic, n, Duration::from_secs(30)).await
    }

    /// [`Kafka::read`], waiting at most `within` for the `n` records.
    pub async fn read_for(&self, topic: &str, n: usize, within: Duration) -> Vec<Record> {
        let (client, topic) = (self.client(), topic.to_string());
        tokio::task::spawn_blocking(move || read(client, &topic, n, within))
            .await
            .unwrap()
    }
}

/// [`Kafka::read`], on a thread that may block.
fn read(mut client: ClientConfig, topic: &str, n: usize, within: Duration) -> Vec<Record> {
    let consumer: BaseConsumer = client
        .set("group.id", "test-reader")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let metadata = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(5))
        .unwrap();
    let mut list = TopicPartitionList::new();
    for p in metadata.topics()[0].partitions() {
        list.add_partition_offset(topic, p.id(), Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&list).unwrap();
    let deadline = std::time::Instant::now() + within;
    let mut out = Vec::new();
    while out.len() < n && std::time::Instant::now() < deadline {
        let Some(m) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let m = m.unwrap();
        out.push(Record {
            key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
            value: String::from_utf8_lossy(m.payload().unwrap_or_default()).into_owned(),
            headers: m
                .headers()
                .map(|h| {
                    h.iter()
                        .map(|h| {
                            (
                                h.key.to_string(),
                                String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default(),
        });
    }
    out
}

impl Drop for Kafka {
    fn drop(&mut self) {
        let _ = self.broker.kill();
        let _ = self.broker.wait();
    }
}
