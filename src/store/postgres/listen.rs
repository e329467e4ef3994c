//! Waking waiters: one connection per store that `LISTEN`s on the table's channel. A statement
//! that ends a pending state a waiter flagged sends `NOTIFY` in its own transaction (delivered
//! when it commits, on whichever instance), and this connection fans it out in process.
//!
//! The connection is checked every few seconds and made again when it fails, on whichever
//! host is the primary then; every waiter re-reads when listening starts again, since
//! notifications sent meanwhile are lost. Waiters also re-read once a second on their own.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio_postgres::AsyncMessage;

use super::connect::{explain, Connect};
use crate::key::StoreKey;
use crate::store::changes::Waiters;

/// How often the listening connection proves it is alive.
const CHECK_EVERY: Duration = Duration::from_secs(5);

/// Listens until the store is dropped (the task is aborted then).
pub(super) async fn listen(
    connect: Connect,
    channel: String,
    waiters: Waiters,
    listening: Arc<AtomicBool>,
    timeout: Duration,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        match listen_once(&connect, &channel, &waiters, &listening, timeout).await {
            Ok(()) => backoff = Duration::from_millis(100),
            Err(e) => {
                tracing::warn!(error = %e, "Postgres notifications: not listening; retrying");
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
        listening.store(false, Ordering::Release);
        tokio::time::sleep(backoff).await;
    }
}

/// One connection's life: `Ok` when it ended after listening, `Err` when it never did.
async fn listen_once(
    connect: &Connect,
    channel: &str,
    waiters: &Waiters,
    listening: &AtomicBool,
    timeout: Duration,
) -> Result<(), String> {
    let (client, mut connection) = tokio::time::timeout(timeout * 5, connect.open())
        .await
        .map_err(|_| "no connection within the timeout".to_string())?
        .map_err(|e| explain(&e))?;
    let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
    let statement = format!("LISTEN {channel}");
    let listen = client.batch_execute(&statement);
    tokio::pin!(listen);
    let mut started = false;
    // The liveness probe in flight: polled beside the messages, which drive its answer.
    let mut probe: Option<Pin<Box<dyn Future<Output = bool> + Send + '_>>> = None;
    let mut check = tokio::time::interval(CHECK_EVERY);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            done = &mut listen, if !started => {
                done.map_err(|e| explain(&e))?;
                started = true;
                listening.store(true, Ordering::Release);
                // Whatever was notified before now was missed: every waiter reads again.
                waiters.notify_all();
            }
            message = messages.next() => match message {
                Some(Ok(AsyncMessage::Notification(n))) => {
                    if let Some(key) = StoreKey::from_hex(n.payload()) {
                        waiters.notify(&key);
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => return finished(started, explain(&e)),
                None => return finished(started, "connection closed".into()),
            },
            _ = check.tick(), if started && probe.is_none() => {
                let answer = tokio::time::timeout(timeout, client.simple_query("SELECT 1"));
                probe = Some(Box::pin(async { matches!(answer.await, Ok(Ok(_))) }));
            }
            alive = async { match probe.as_mut() { Some(p) => p.await, None => false } }, if probe.is_some() => {
                probe = None;
                if !alive {
                    return finished(started, "the listening connection stopped answering".into());
                }
            }
        }
    }
}

fn finished(started: bool, why: String) -> Result<(), String> {
    if started {
        tracing::warn!(reason = %why, "Postgres notifications: connection lost; listening again");
        Ok(())
    } else {
        Err(why)
    }
}
