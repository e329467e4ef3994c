//! The RabbitMQ baseline of `bench/consumers`: a plain consumer loop with the same client library
//! as the gateway (lapin, and hyper for the handler), doing no deduplication at all: consume
//! with a prefetch of CONCURRENCY, POST each body to the handler, `basic.ack`. Exits once COUNT
//! messages are acknowledged, printing how long that took. Also fills the queue for the bench.
//!
//!   plain_amqp_consumer declare URL QUEUE...        (durable quorum queues)
//!   plain_amqp_consumer publish URL QUEUE COUNT     (persistent, confirmed)
//!   plain_amqp_consumer consume URL QUEUE HANDLER_URL CONCURRENCY COUNT

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use tokio::sync::Semaphore;

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        [_, "declare", url, queues @ ..] => declare(url, queues).await,
        [_, "publish", url, queue, count] => publish(url, queue, count.parse()?).await,
        [_, "consume", url, queue, handler, concurrency, count] => {
            consume(url, queue, handler.parse()?, concurrency.parse()?, count.parse()?).await
        }
        _ => Err("usage: plain_amqp_consumer declare URL QUEUE... | publish URL QUEUE COUNT | consume URL QUEUE HANDLER_URL CONCURRENCY COUNT".into()),
    }
}

async fn declare(url: &str, queues: &[&str]) -> Result<(), Error> {
    let conn = Connection::connect(url, ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    for queue in queues {
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(LongString::from("quorum")),
        );
        channel
            .queue_declare((*queue).into(), QueueDeclareOptions::durable(), args)
            .await?;
    }
    Ok(())
}

async fn publish(url: &str, queue: &str, count: usize) -> Result<(), Error> {
    let conn = Connection::connect(url, ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let mut confirms = Vec::with_capacity(1000);
    for i in 1..=count {
        let body = format!(r#"{{"messageId": "m-{i}", "amount": {i}}}"#);
        let properties = BasicProperties::default().with_delivery_mode(2);
        confirms.push(
            channel
                .basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions::default(),
                    body.as_bytes(),
                    properties,
                )
                .await?,
        );
        if confirms.len() == 1000 {
            for c in confirms.drain(..) {
                c.await?;
            }
        }
    }
    for c in confirms {
        c.await?;
    }
    Ok(())
}

async fn consume(
    url: &str,
    queue: &str,
    handler: http::Uri,
    concurrency: u16,
    count: usize,
) -> Result<(), Error> {
    let conn = Connection::connect(url, ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    channel
        .basic_qos(concurrency, BasicQosOptions::default())
        .await?;
    let mut deliveries = channel
        .basic_consume(
            queue.into(),
            "plain".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let http: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let slots = Arc::new(Semaphore::new(usize::from(concurrency)));
    let acked = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(tokio::sync::Notify::new());
    let started = Instant::now();
    while acked.load(Ordering::Relaxed) < count {
        let next = tokio::select! {
            d = deliveries.next() => d,
            () = done.notified() => continue,
        };
        let Some(delivery) = next else { break };
        let delivery = delivery?;
        let slot = Arc::clone(&slots).acquire_owned().await?;
        let (http, handler, acked, done) = (
            http.clone(),
            handler.clone(),
            Arc::clone(&acked),
            Arc::clone(&done),
        );
        tokio::spawn(async move {
            post(&http, &handler, Bytes::from(delivery.data.clone())).await;
            if delivery.ack(BasicAckOptions::default()).await.is_ok()
                && acked.fetch_add(1, Ordering::Relaxed) + 1 >= count
            {
                done.notify_one();
            }
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
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}
