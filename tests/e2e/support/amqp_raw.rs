//! Publishing over raw AMQP 0-9-1, for tests of messages lapin cannot send.
//!
//! lapin (amq-protocol) holds a short string as a Rust `String`, so it cannot write a message
//! id or a header name that is not UTF-8. RabbitMQ takes such messages and delivers them byte
//! for byte (checked against 3.10.8, classic and quorum queues); a consumer has to live with
//! them. This writes the frames by hand: handshake (PLAIN guest/guest, no heartbeats), one
//! channel in confirm mode, one mandatory persistent publish to the default exchange, the
//! broker's Basic.Ack, then Channel.Close and Connection.Close, each answered before it returns.
//! Every server frame is read whole. It has no timeout of its own: wrap it in one.
#![allow(dead_code)]

use std::io::{Error, ErrorKind, Result};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const METHOD: u8 = 1;
const HEADER: u8 = 2;
const BODY: u8 = 3;
const HEARTBEAT: u8 = 8;
const FRAME_END: u8 = 0xCE;

/// Publishes `body` to `queue` (which must exist) through the default exchange, persistent,
/// with `message_id` and one header `header_name` = longstr "raw", and waits for the broker's
/// confirm. An unroutable message (no such queue) is an error.
pub async fn publish_raw(
    port: u16,
    queue: &str,
    message_id: &[u8],
    header_name: &[u8],
    body: &[u8],
) -> Result<()> {
    // Built first: a string too long for its field fails before anything is sent.
    let mut publish = 0u16.to_be_bytes().to_vec();
    short(&mut publish, b"")?; // the default exchange
    short(&mut publish, queue.as_bytes())?;
    publish.push(1); // mandatory: an unroutable message comes back as Basic.Return
    let mut table = Vec::new();
    short(&mut table, header_name)?;
    table.push(b'S');
    long(&mut table, b"raw")?;
    let mut header = Vec::new();
    header.extend_from_slice(&60u16.to_be_bytes()); // class
    header.extend_from_slice(&0u16.to_be_bytes()); // weight
    header.extend_from_slice(&(body.len() as u64).to_be_bytes());
    // Property flags: headers, delivery-mode, message-id; the values follow in that order.
    header.extend_from_slice(&((1u16 << 13) | (1 << 12) | (1 << 7)).to_be_bytes());
    long(&mut header, &table)?;
    header.push(2); // persistent
    short(&mut header, message_id)?;
    let mut c = Conn(TcpStream::connect(("127.0.0.1", port)).await?);
    c.0.write_all(b"AMQP\x00\x00\x09\x01").await?;
    c.expect(0, 10, 10).await?; // Connection.Start
    let mut args = Vec::new();
    long(&mut args, b"")?; // client properties: an empty table
    short(&mut args, b"PLAIN")?;
    long(&mut args, b"\x00guest\x00guest")?;
    short(&mut args, b"en_US")?;
    c.method(0, 10, 11, &args).await?; // Start-Ok
    let tune = c.expect(0, 10, 30).await?;
    let tune = tune
        .get(..6)
        .ok_or_else(|| invalid("Connection.Tune too short"))?;
    let frame_max = u32::from_be_bytes([tune[2], tune[3], tune[4], tune[5]]);
    let mut args = tune.to_vec(); // channel-max and frame-max as offered
    args.extend_from_slice(&0u16.to_be_bytes()); // heartbeat: none
    c.method(0, 10, 31, &args).await?; // Tune-Ok
    let mut args = Vec::new();
    short(&mut args, b"/")?;
    short(&mut args, b"")?;
    args.push(0);
    c.method(0, 10, 40, &args).await?; // Connection.Open
    c.expect(0, 10, 41).await?;
    c.method(1, 20, 10, &[0]).await?; // Channel.Open (reserved empty shortstr)
    c.expect(1, 20, 11).await?;
    c.method(1, 85, 10, &[0]).await?; // Confirm.Select
    c.expect(1, 85, 11).await?;

    c.method(1, 60, 40, &publish).await?; // Basic.Publish
    c.send(HEADER, 1, &header).await?;
    let chunk = usize::try_from(frame_max)
        .ok()
        .filter(|&max| max > 8)
        .map_or(usize::MAX, |max| max - 8);
    for part in body.chunks(chunk) {
        c.send(BODY, 1, part).await?;
    }
    let ack = c.recv().await?;
    match (ack.0, ack.1, ack.2) {
        (1, 60, 80) => {}
        (_, 60, 50) => {
            let why = reply(&ack.3);
            return Err(invalid(format!(
                "the broker returned the message ({why}): no queue {queue}?"
            )));
        }
        (_, 60, 120) => return Err(invalid("the broker refused the message (Basic.Nack)")),
        (ch, class, method) => {
            return Err(invalid(format!(
                "expected Basic.Ack, got {class}.{method} on channel {ch}"
            )))
        }
    }

    let mut close = 200u16.to_be_bytes().to_vec();
    short(&mut close, b"done")?;
    close.extend_from_slice(&[0, 0, 0, 0]); // class and method: none
    c.method(1, 20, 40, &close).await?; // Channel.Close
    c.expect(1, 20, 41).await?;
    c.method(0, 10, 50, &close).await?; // Connection.Close
    c.expect(0, 10, 51).await?;
    Ok(())
}

struct Conn(TcpStream);

impl Conn {
    async fn send(&mut self, kind: u8, channel: u16, payload: &[u8]) -> Result<()> {
        let size = u32::try_from(payload.len())
            .map_err(|_| Error::new(ErrorKind::InvalidInput, "frame over 4 GiB"))?;
        let mut frame = vec![kind];
        frame.extend_from_slice(&channel.to_be_bytes());
        frame.extend_from_slice(&size.to_be_bytes());
        frame.extend_from_slice(payload);
        frame.push(FRAME_END);
        self.0.write_all(&frame).await
    }

    async fn method(&mut self, channel: u16, class: u16, method: u16, args: &[u8]) -> Result<()> {
        let mut payload = class.to_be_bytes().to_vec();
        payload.extend_from_slice(&method.to_be_bytes());
        payload.extend_from_slice(args);
        self.send(METHOD, channel, &payload).await
    }

    /// The broker's next method frame, read whole: channel, class, method, arguments. A close
    /// from the broker (channel or connection) is an error that carries its reply.
    async fn recv(&mut self) -> Result<(u16, u16, u16, Vec<u8>)> {
        loop {
            let mut head = [0u8; 7];
            self.0.read_exact(&mut head).await?;
            let channel = u16::from_be_bytes([head[1], head[2]]);
            let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]);
            let size = usize::try_from(size).map_err(|_| invalid("frame too large"))?;
            let mut payload = vec![0u8; size + 1];
            self.0.read_exact(&mut payload).await?;
            if payload.pop() != Some(FRAME_END) {
                return Err(invalid("frame without its end octet"));
            }
            if head[0] == HEARTBEAT {
                continue;
            }
            if head[0] != METHOD || payload.len() < 4 {
                return Err(invalid(format!(
                    "expected a method frame, got type {}",
                    head[0]
                )));
            }
            let class = u16::from_be_bytes([payload[0], payload[1]]);
            let method = u16::from_be_bytes([payload[2], payload[3]]);
            let args = payload.split_off(4);
            if (class, method) == (10, 50) || (class, method) == (20, 40) {
                let what = if class == 10 { "connection" } else { "channel" };
                return Err(Error::new(
                    ErrorKind::ConnectionAborted,
                    format!("the broker closed the {what}: {}", reply(&args)),
                ));
            }
            return Ok((channel, class, method, args));
        }
    }

    /// The arguments of the broker's next method, which must be `class`.`method` on `channel`.
    async fn expect(&mut self, channel: u16, class: u16, method: u16) -> Result<Vec<u8>> {
        let (ch, cl, me, args) = self.recv().await?;
        if (ch, cl, me) != (channel, class, method) {
            return Err(invalid(format!(
                "expected {class}.{method} on channel {channel}, got {cl}.{me} on channel {ch}"
            )));
        }
        Ok(args)
    }
}

/// "code text" from a Close or Return: a reply-code short, then a reply-text shortstr.
fn reply(args: &[u8]) -> String {
    let code = args
        .get(..2)
        .map_or(0, |b| u16::from_be_bytes([b[0], b[1]]));
    let len = args.get(2).map_or(0, |&n| usize::from(n));
    let text = args.get(3..3 + len).unwrap_or_default();
    format!("{code} {}", String::from_utf8_lossy(text))
}

fn invalid(what: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidData, what.into())
}

fn short(out: &mut Vec<u8>, s: &[u8]) -> Result<()> {
    let len = u8::try_from(s.len()).map_err(|_| {
        Error::new(
            ErrorKind::InvalidInput,
            "a short string is at most 255 bytes",
        )
    })?;
    out.push(len);
    out.extend_from_slice(s);
    Ok(())
}

fn long(out: &mut Vec<u8>, s: &[u8]) -> Result<()> {
    let len = u32::try_from(s.len())
        .map_err(|_| Error::new(ErrorKind::InvalidInput, "a long string is at most 4 GiB"))?;
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(s);
    Ok(())
}
