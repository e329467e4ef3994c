//! The baseline of `bench/consumers`: a plain Redis Streams consumer loop with the same client
//! library as the gateway (redis-rs, and hyper for the handler), doing no deduplication at all:
//! XREADGROUP, POST each entry's `body` field to the handler (at most CONCURRENCY at once), XACK.
//! Exits once COUNT entries are acknowledged, printing how long that took.
//!
//!   plain_consumer REDIS_URL STREAM GROUP HANDLER_URL CONCURRENCY COUNT

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use redis::Value;
use tokio::sync::Semaphore;

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().collect();
    let [_, url, stream, group, handler, concurrency, count] = args.as_slice() else {
        return Err(
            "usage: plain_consumer REDIS_URL STREAM GROUP HANDLER_URL CONCURRENCY COUNT".into(),
        );
    };
    let (concurrency, count): (usize, usize) = (concurrency.parse()?, count.parse()?);
    let handler: http::Uri = handler.parse()?;
    let client = redis::Client::open(url.as_str())?;
    let mut reader = client.get_multiplexed_async_connection().await?;
    let writer = client.get_multiplexed_async_connection().await?;
    let _: Result<Value, _> = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(stream)
        .arg(group)
        .arg("0")
        .arg("MKSTREAM")
        .query_async(&mut reader)
        .await;
    let http: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let slots = Arc::new(Semaphore::new(concurrency));
    let acked = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    while acked.load(Ordering::Relaxed) < count {
        let free = slots.available_permits().max(1);
        let reply: Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(group)
            .arg("plain")
            .arg("COUNT")
            .arg(free)
            .arg("BLOCK")
            .arg(100)
            .arg("STREAMS")
            .arg(stream)
            .arg(">")
            .query_async(&mut reader)
            .await?;
        for (id, body) in entries(reply) {
            let slot = Arc::clone(&slots).acquire_owned().await?;
            let (http, handler, mut writer) = (http.clone(), handler.clone(), writer.clone());
            let (acked, stream, group) = (Arc::clone(&acked), stream.clone(), group.clone());
            tokio::spawn(async move {
                let req = http::Request::post(handler)
                    .header("content-type", "application/json")
                    .body(Full::new(body))
                    .map_err(Error::from)?;
                let resp = http.request(req).await?;
                resp.into_body().collect().await?;
                let _: Value = redis::cmd("XACK")
                    .arg(&stream)
                    .arg(&group)
                    .arg(&id)
                    .query_async(&mut writer)
                    .await?;
                acked.fetch_add(1, Ordering::Relaxed);
                drop(slot);
                Ok::<_, Error>(())
            });
        }
    }
    println!("{:.3}", started.elapsed().as_secs_f64());
    Ok(())
}

/// (id, body field) of each entry of an XREADGROUP reply on one stream.
fn entries(reply: Value) -> Vec<(String, Bytes)> {
    let Value::Array(streams) = reply else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for s in streams {
        let Value::Array(mut pair) = s else { continue };
        let Some(Value::Array(items)) = pair.pop() else {
            continue;
        };
        for item in items {
            let Value::Array(entry) = item else { continue };
            let [Value::BulkString(id), Value::Array(fields)] = entry.as_slice() else {
                continue;
            };
            let mut body = Bytes::new();
            for kv in fields.chunks(2) {
                if let [Value::BulkString(k), Value::BulkString(v)] = kv {
                    if k == b"body" {
                        body = Bytes::copy_from_slice(v);
                    }
                }
            }
            out.push((String::from_utf8_lossy(id).to_string(), body));
        }
    }
    out
}
