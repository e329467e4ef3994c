//! redb and fjall side by side on the disk store's workload, to choose one on figures.
//!
//! Every request is what the gateway does with a new key: `reserve` (insert a 66-byte pending
//! record if the key is absent, durable before it returns) then `complete` (overwrite it with a
//! ~350-byte response, durable before it returns). `CLIENTS` threads issue requests one after
//! another; one writer thread per engine applies whatever has queued up as one transaction with
//! one fsync (group commit) and then answers every request in it. Printed per engine: requests/s,
//! p50 and p99 of a request, fsyncs per request, and the directory's size after the run and after
//! every key was deleted and as many new ones written (is space reused?).
//!
//!     cargo run --release [-- REQUESTS CLIENTS]

use std::path::Path;

use redb::ReadableTable;
use std::sync::mpsc;
use std::time::{Duration, Instant};

enum Op {
    Reserve(Vec<u8>),
    Complete(Vec<u8>),
    Delete(Vec<u8>),
}

type Job = (Op, mpsc::Sender<bool>);

trait Engine: Send + 'static {
    /// Applies the ops as one durable write; answers each (reserve: did it own the key).
    fn apply(&mut self, ops: &[Op]) -> Vec<bool>;
}

const PENDING: [u8; 66] = [1; 66];

fn completed() -> Vec<u8> {
    vec![2; 350]
}

struct Redb {
    db: redb::Database,
}

const TABLE: redb::TableDefinition<&[u8], &[u8]> = redb::TableDefinition::new("records");

impl Engine for Redb {
    fn apply(&mut self, ops: &[Op]) -> Vec<bool> {
        let mut txn = self.db.begin_write().unwrap();
        txn.set_durability(redb::Durability::Immediate).unwrap();
        let mut out = Vec::with_capacity(ops.len());
        {
            let mut t = txn.open_table(TABLE).unwrap();
            for op in ops {
                out.push(match op {
                    Op::Reserve(k) => {
                        let absent = t.get(k.as_slice()).unwrap().is_none();
                        if absent {
                            t.insert(k.as_slice(), PENDING.as_slice()).unwrap();
                        }
                        absent
                    }
                    Op::Complete(k) => {
                        t.insert(k.as_slice(), completed().as_slice()).unwrap();
                        true
                    }
                    Op::Delete(k) => t.remove(k.as_slice()).unwrap().is_some(),
                });
            }
        }
        txn.commit().unwrap();
        out
    }
}

struct Fjall {
    db: fjall::Database,
    ks: fjall::Keyspace,
}

impl Engine for Fjall {
    fn apply(&mut self, ops: &[Op]) -> Vec<bool> {
        let mut out = Vec::with_capacity(ops.len());
        let mut batch = self.db.batch();
        // The batch is applied at commit: reads see what earlier batches wrote, and a key
        // reserved twice in one batch is answered from `fresh`.
        let mut fresh = std::collections::HashSet::new();
        for op in ops {
            out.push(match op {
                Op::Reserve(k) => {
                    let absent = !fresh.contains(k) && self.ks.get(k).unwrap().is_none();
                    if absent {
                        batch.insert(&self.ks, k.clone(), PENDING.to_vec());
                        fresh.insert(k.clone());
                    }
                    absent
                }
                Op::Complete(k) => {
                    batch.insert(&self.ks, k.clone(), completed());
                    true
                }
                Op::Delete(k) => {
                    batch.remove(&self.ks, k.clone());
                    true
                }
            });
        }
        batch.commit().unwrap();
        self.db.persist(fjall::PersistMode::SyncAll).unwrap();
        out
    }
}

/// Runs the engine's writer; returns the sender and the writer's count of durable writes.
fn writer(mut engine: impl Engine) -> (mpsc::Sender<Job>, std::thread::JoinHandle<u64>) {
    let (tx, rx) = mpsc::channel::<Job>();
    let handle = std::thread::spawn(move || {
        let mut syncs = 0u64;
        while let Ok(first) = rx.recv() {
            let mut jobs = vec![first];
            while let Ok(more) = rx.try_recv() {
                jobs.push(more);
                if jobs.len() >= 1024 {
                    break;
                }
            }
            let (ops, replies): (Vec<Op>, Vec<mpsc::Sender<bool>>) = jobs.into_iter().unzip();
            let answers = engine.apply(&ops);
            syncs += 1;
            for (reply, a) in replies.into_iter().zip(answers) {
                let _ = reply.send(a);
            }
        }
        syncs
    });
    (tx, handle)
}

fn call(tx: &mpsc::Sender<Job>, op: Op) -> bool {
    let (reply, answer) = mpsc::channel();
    tx.send((op, reply)).unwrap();
    answer.recv().unwrap()
}

fn dir_size(path: &Path) -> u64 {
    let mut total = 0;
    for e in std::fs::read_dir(path).unwrap() {
        let e = e.unwrap();
        let m = e.metadata().unwrap();
        total += if m.is_dir() { dir_size(&e.path()) } else { m.len() };
    }
    total
}

fn run(name: &str, dir: &Path, engine: impl Engine, requests: usize, clients: usize) {
    let (tx, handle) = writer(engine);
    let per_client = requests / clients;
    let phase = |round: usize, tx: &mpsc::Sender<Job>| {
        let started = Instant::now();
        let threads: Vec<_> = (0..clients)
            .map(|c| {
                let tx = tx.clone();
                std::thread::spawn(move || {
                    let mut lat = Vec::with_capacity(per_client);
                    for i in 0..per_client {
                        let key = format!("{round}-{c}-{i}").into_bytes();
                        let t = Instant::now();
                        assert!(call(&tx, Op::Reserve(key.clone())));
                        call(&tx, Op::Complete(key));
                        lat.push(t.elapsed());
                    }
                    lat
                })
            })
            .collect();
        let mut lat: Vec<Duration> = threads.into_iter().flat_map(|t| t.join().unwrap()).collect();
        lat.sort();
        (started.elapsed(), lat)
    };
    let (took, lat) = phase(0, &tx);
    let size_after = dir_size(dir);
    // Expire every key (delete) and write as many again: a store with a short ttl.
    for c in 0..clients {
        for i in 0..per_client {
            call(&tx, Op::Delete(format!("0-{c}-{i}").into_bytes()));
        }
    }
    phase(1, &tx);
    let size_reused = dir_size(dir);
    drop(tx);
    let syncs = handle.join().unwrap();
    let n = lat.len();
    println!(
        "{name:6} {:8.0} req/s  p50 {:6.2} ms  p99 {:6.2} ms  fsyncs/req {:.2} (all phases)  dir {:.1} MB after {n} keys, {:.1} MB after deleting them and writing {n} more",
        n as f64 / took.as_secs_f64(),
        lat[n / 2].as_secs_f64() * 1e3,
        lat[n * 99 / 100].as_secs_f64() * 1e3,
        syncs as f64 / (n * 2 * 2 + n) as f64,
        size_after as f64 / 1e6,
        size_reused as f64 / 1e6,
    );
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let requests = args.first().copied().unwrap_or(20_000);
    let clients = args.get(1).copied().unwrap_or(32);
    let base = std::env::temp_dir().join(format!("embedded-stores-{}", std::process::id()));
    for round in 0..3 {
        let dir = base.join(format!("redb-{round}"));
        std::fs::create_dir_all(&dir).unwrap();
        let db = redb::Database::create(dir.join("records.redb")).unwrap();
        run("redb", &dir, Redb { db }, requests, clients);
        let dir = base.join(format!("fjall-{round}"));
        let db = fjall::Database::builder(&dir).open().unwrap();
        let ks = db
            .keyspace("records", fjall::KeyspaceCreateOptions::default)
            .unwrap();
        run("fjall", &dir, Fjall { db, ks }, requests, clients);
    }
    let _ = std::fs::remove_dir_all(&base);
}
