//! The Kafka baseline of `bench/consumers`: a plain consumer loop with the same client library
//! as the gateway (rdkafka, and hyper for the handler), doing no deduplication at all: a consumer
//! group, up to CONCURRENCY messages POSTed at once, each message's offset stored once its POST
//! is answered (in any order: what a loop that does not track contiguous offsets does) and
//! committed by librdkafka every second. Exits once COUNT messages are answered, printing how
//! long that took. Also makes the topic and fills it for the bench.
//!
//!   plain_kafka_consumer create BROKERS TOPIC PARTITIONS
//!   plain_kafka_consumer produce BROKERS TOPIC COUNT      (one record per batch: see below)
//!   plain_kafka_consumer consume BROKERS TOPIC GROUP HANDLER_URL CONCURRENCY COUNT
//!
//! The bench's broker is tansu 0.6, whose memory engine counts a partition's high watermark in
//! record batches: each record goes in a batch of its own, or a consumer stops at the watermark.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use tokio::sync::Semaphore;

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        [_, "create", brokers, topic, partitions] => create(brokers, topic, partitions.parse()?).await,
        [_, "produce", brokers, topic, count] => produce(brokers, topic, count.parse()?).await,
        [_, "consume", brokers, topic, group, handler, concurrency, count] => {
            consume(brokers, topic, group, handler.parse()?, concurrency.parse()?, count.parse()?).await
        }
        _ => Err("usage: plain_kafka_consumer create BROKERS TOPIC PARTITIONS | produce BROKERS TOPIC COUNT | consume BROKERS TOPIC GROUP HANDLER_URL CONCURRENCY COUNT".into()),
    }
}

fn client(brokers: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers);
    c
}

async fn create(brokers: &str, topic: &str, partitions: i32) -> Result<(), Error> {
    let admin: AdminClient<DefaultClientContext> = client(brokers).create()?;
    let topic = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
    for result in admin.create_topics(&[topic], &AdminOptions::new()).await? {
        result.map_err(|(t, e)| format!("create {t}: {e}"))?;
    }
    Ok(())
}

async fn produce(brokers: &str, topic: &str, count: usize) -> Result<(), Error> {
    let producer: FutureProducer = client(brokers)
        .set("linger.ms", "0")
        .set("batch.num.messages", "1")
        .create()?;
    let mut sent = Vec::with_capacity(1000);
    for i in 1..=count {
        let body = format!(r#"{{"messageId": "m-{i}", "amount": {i}}}"#);
        let key = format!("m-{i}");
        let record = FutureRecord::to(topic).key(&key).payload(&body);
        sent.push(producer.send_result(record).map_err(|(e, _)| e)?);
        if sent.len() == 1000 {
            for s in sent.drain(..) {
                s.await?.map_err(|(e, _)| e)?;
            }
        }
    }
    for s in sent {
        s.await?.map_err(|(e, _)| e)?;
    }
    Ok(())
}

async fn consume(
    brokers: &str,
    topic: &str,
    group: &str,
    handler: http::Uri,
    concurrency: usize,
    count: usize,
) -> Result<(), Error> {
    let consumer: StreamConsumer = client(brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "true")
        .set("enable.auto.offset.store", "false")
        .set("auto.commit.interval.ms", "1000")
        .set("auto.offset.reset", "earliest")
        .create()?;
    consumer.subscribe(&[topic])?;
    let consumer = Arc::new(consumer);
    let http: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let slots = Arc::new(Semaphore::new(concurrency));
    let answered = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    while answered.load(Ordering::Relaxed) < count {
        let slot = Arc::clone(&slots).acquire_owned().await?;
        let message = match tokio::time::timeout(Duration::from_millis(100), consumer.recv()).await
        {
            Err(_) => continue,
            Ok(m) => m?,
        };
        let (partition, offset) = (message.partition(), message.offset());
        let body = Bytes::copy_from_slice(message.payload().unwrap_or_default());
        drop(message);
        let (http, handler, answered, consumer, topic) = (
            http.clone(),
            handler.clone(),
            Arc::clone(&answered),
            Arc::clone(&consumer),
            topic.to_string(),
        );
        tokio::spawn(async move {
            post(&http, &handler, body).await;
            let mut done = TopicPartitionList::new();
            let _ = done
                .add_partition_offset(&topic, partition, Offset::Offset(offset + 1))
                .and_then(|()| consumer.store_offsets(&done));
            answered.fetch_add(1, Ordering::Relaxed);
            drop(slot);
        });
    }
    println!("{:.3}", started.elapsed().as_secs_f64());
    Ok(())
}

/// POSTs `body` until the handler answers (a plain loop that gave up on a failed POST would
/// never reach COUNT and the bench would wait for ever).
async fn post(http: &Client<HttpConnector, Full<Bytes>>, handler: &http::Uri, body: Bytes) {
    loop {
        let request = http::Request::post(handler.clone())
            .header("content-type", "application/json")
            .body(Full::new(body.clone()));
        if let Ok(request) = request {
            if let Ok(response) = http.request(request).await {
                let _ = response.into_body().collect().await;
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
