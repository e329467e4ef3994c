//! A TCP relay between two real parts that a test can stall (everything held in both
//! directions, as in a partition), point elsewhere (as a failover moves a virtual IP), or have
//! lose an answer (the connection cut as the server's first bytes arrive).
#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub struct Relay {
    pub port: u16,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

struct Shared {
    target: Mutex<u16>,
    stalled: watch::Sender<bool>,
    /// Bumped by [`Relay::retarget`]: every connection relayed before it is cut.
    generation: watch::Sender<u64>,
    /// Set by [`Relay::cut_next_answer`]: the next bytes from a server end their connection.
    cut_answer: AtomicBool,
}

impl Relay {
    /// Relays `127.0.0.1:<free port>` to `127.0.0.1:target`.
    pub async fn start(target: u16) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let shared = Arc::new(Shared {
            target: Mutex::new(target),
            stalled: watch::channel(false).0,
            generation: watch::channel(0).0,
            cut_answer: AtomicBool::new(false),
        });
        let s = Arc::clone(&shared);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let target = *s.target.lock().unwrap();
                let s = Arc::clone(&s);
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(("127.0.0.1", target)).await {
                        relay(client, server, &s).await;
                    }
                });
            }
        });
        Relay { port, shared, task }
    }

    /// Holds every byte, both ways, until [`Relay::resume`].
    pub fn stall(&self) {
        self.shared.stalled.send_replace(true);
    }

    pub fn resume(&self) {
        self.shared.stalled.send_replace(false);
    }

    /// The next answer a server sends is lost: its connection is closed both ways as its first
    /// bytes arrive, none passed on (the server answered; the client never hears it).
    pub fn cut_next_answer(&self) {
        self.shared.cut_answer.store(true, Ordering::SeqCst);
    }

    /// Whether the answer [`Relay::cut_next_answer`] asked for was cut.
    pub fn answer_cut(&self) -> bool {
        !self.shared.cut_answer.load(Ordering::SeqCst)
    }

    /// Cuts every connection relayed so far; new ones go to `target`.
    pub fn retarget(&self, target: u16) {
        *self.shared.target.lock().unwrap() = target;
        self.shared.generation.send_modify(|g| *g += 1);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
        self.shared.generation.send_modify(|g| *g += 1);
    }
}

async fn relay(client: TcpStream, server: TcpStream, shared: &Shared) {
    let mut cut = shared.generation.subscribe();
    cut.mark_unchanged();
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let up = pipe(client_read, server_write, shared.stalled.subscribe(), None);
    let down = pipe(
        server_read,
        client_write,
        shared.stalled.subscribe(),
        Some(&shared.cut_answer),
    );
    tokio::select! {
        _ = up => {}
        _ = down => {}
        _ = cut.changed() => {}
    }
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut stalled: watch::Receiver<bool>,
    cut: Option<&AtomicBool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if cut.is_some_and(|c| c.swap(false, Ordering::SeqCst)) {
            return;
        }
        if stalled.wait_for(|s| !*s).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
