//! A Kafka producer written at the protocol level, for what no client library writes: a header
//! whose name is not UTF-8 (rdkafka's `Header::key` is a `&str`; on the wire a name is bytes,
//! and a Go or C producer can write any). One Produce request (v3) carrying one record batch
//! (magic 2) with one record, sent to the single test broker, which leads every partition.

use std::time::{SystemTime, UNIX_EPOCH};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One record: its key, value and headers, all as bytes.
pub struct RawRecord<'a> {
    pub key: Option<&'a [u8]>,
    pub value: &'a [u8],
    pub headers: &'a [(&'a [u8], &'a [u8])],
}

/// Produces `record` to `partition` of `topic` on the broker at `addr` (acks = all), and
/// fails with the broker's error code if it refuses.
pub async fn produce_raw(addr: &str, topic: &str, partition: i32, record: &RawRecord<'_>) {
    let batch = record_batch(record);
    let mut body = Vec::new();
    body.extend(0i16.to_be_bytes()); // api key: Produce
    body.extend(3i16.to_be_bytes()); // api version
    body.extend(7i32.to_be_bytes()); // correlation id
    string(&mut body, b"idemgate-test-raw");
    body.extend((-1i16).to_be_bytes()); // transactional id: null
    body.extend((-1i16).to_be_bytes()); // acks: all
    body.extend(10_000i32.to_be_bytes()); // timeout
    body.extend(1i32.to_be_bytes()); // one topic
    string(&mut body, topic.as_bytes());
    body.extend(1i32.to_be_bytes()); // one partition
    body.extend(partition.to_be_bytes());
    body.extend(i32::try_from(batch.len()).unwrap().to_be_bytes());
    body.extend(&batch);
    let mut stream = TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect to the Kafka broker {addr}: {e}"));
    stream
        .write_all(&i32::try_from(body.len()).unwrap().to_be_bytes())
        .await
        .unwrap();
    stream.write_all(&body).await.unwrap();
    let len = stream
        .read_i32()
        .await
        .expect("the broker's Produce answer");
    let mut answer = vec![0u8; usize::try_from(len).unwrap()];
    stream.read_exact(&mut answer).await.unwrap();
    // correlation id, topics (1), topic name, partitions (1), partition index, error code.
    let name_len = usize::from(u16::from_be_bytes([answer[8], answer[9]]));
    let at = 10 + name_len + 4 + 4;
    let error = i16::from_be_bytes([answer[at], answer[at + 1]]);
    assert_eq!(
        error, 0,
        "the broker refused the raw record (Kafka error code {error})"
    );
}

/// One record batch (magic 2) holding `record` alone.
fn record_batch(record: &RawRecord<'_>) -> Vec<u8> {
    let mut r = Vec::new();
    r.push(0u8); // attributes
    varint(&mut r, 0); // timestamp delta
    varint(&mut r, 0); // offset delta
    bytes(&mut r, record.key);
    bytes(&mut r, Some(record.value));
    varint(&mut r, record.headers.len() as i64);
    for (name, value) in record.headers {
        bytes(&mut r, Some(name));
        bytes(&mut r, Some(value));
    }
    let mut records = Vec::new();
    varint(&mut records, r.len() as i64);
    records.extend(r);

    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    // What the CRC covers: attributes to the end.
    let mut tail = Vec::new();
    tail.extend(0i16.to_be_bytes()); // attributes: no compression, no transaction
    tail.extend(0i32.to_be_bytes()); // last offset delta
    tail.extend(now.to_be_bytes()); // base timestamp
    tail.extend(now.to_be_bytes()); // max timestamp
    tail.extend((-1i64).to_be_bytes()); // producer id
    tail.extend((-1i16).to_be_bytes()); // producer epoch
    tail.extend((-1i32).to_be_bytes()); // base sequence
    tail.extend(1i32.to_be_bytes()); // one record
    tail.extend(records);

    let mut batch = Vec::new();
    batch.extend(0i64.to_be_bytes()); // base offset
    let length = 4 + 1 + 4 + tail.len(); // leader epoch, magic, crc, the rest
    batch.extend(i32::try_from(length).unwrap().to_be_bytes());
    batch.extend((-1i32).to_be_bytes()); // partition leader epoch
    batch.push(2); // magic
    batch.extend(crc32c(&tail).to_be_bytes());
    batch.extend(tail);
    batch
}

fn string(out: &mut Vec<u8>, s: &[u8]) {
    out.extend(i16::try_from(s.len()).unwrap().to_be_bytes());
    out.extend(s);
}

/// A record field: its length as a varint (-1 for null), then its bytes.
fn bytes(out: &mut Vec<u8>, b: Option<&[u8]>) {
    match b {
        None => varint(out, -1),
        Some(b) => {
            varint(out, b.len() as i64);
            out.extend(b);
        }
    }
}

/// A zigzag varint, as Kafka's records write their lengths and deltas.
fn varint(out: &mut Vec<u8>, n: i64) {
    let mut z = ((n << 1) ^ (n >> 63)) as u64;
    loop {
        let byte = (z & 0x7f) as u8;
        z >>= 7;
        if z == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// CRC-32C (Castagnoli), which record batches carry.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[test]
fn crc32c_matches_its_check_value() {
    assert_eq!(crc32c(b"123456789"), 0xE306_9283);
}
