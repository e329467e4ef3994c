//! fjall and RocksDB side by side on the disk store's workload, to choose the engine on figures.
//!
//! Every request is what the gateway does with a new key: `reserve` (insert a 66-byte pending
//! record if the key is absent, durable before it returns) then `complete` (overwrite it with a
//! ~350-byte response, durable before it returns). `CLIENTS` threads issue requests one after
//! another; one writer thread per engine applies whatever has queued up as one write batch
//! (group commit), as the gateway's disk store does. Two ways to make a batch durable:
//!
//! - `serial`: write the batch, fdatasync, answer, then take the next batch (the gateway today).
//! - `pipelined`: write the batch and hand it to a syncer thread, which fdatasyncs and answers,
//!   while the writer already takes and applies the next one. How much overlaps depends on the
//!   engine: fjall holds its journal's lock while it syncs (the next commit waits for it, the
//!   work before it does not); RocksDB's `FlushWAL(sync)` lets writes go on.
//!
//! And RocksDB's own group commit, with no writer thread: `rocksdb transactions`, each client
//! commits its own transaction (`get_for_update` then put, synced), and RocksDB's write path
//! lets one thread write and sync the log for every commit that queued up meanwhile.
//!
//! Printed per engine and mode: requests/s, p50 and p99 of a request, fsyncs per request, CPU
//! time of the process per request (on a machine whose cores are shared with the requests' other
//! work, that is what throughput is made of), and the directory's size after the run and after
//! every key was deleted and as many new ones written (is space reused?). Then the medians of the
//! rounds, and each setup's ratio to fjall serial (the gateway's today) per round, the median.
//!
//!     cargo run --release [-- REQUESTS CLIENTS ROUNDS]

use std::collections::HashSet;
use std::path::Path;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

enum Op {
    Reserve(Vec<u8>),
    Complete(Vec<u8>),
    Delete(Vec<u8>),
}

type Job = (Op, mpsc::Sender<bool>);

/// How a client thread has its ops applied.
trait Client: Send + Sync {
    fn call(&self, op: Op) -> bool;
}

/// Through a writer thread.
struct Queue(mpsc::Sender<Job>);

impl Client for Queue {
    fn call(&self, op: Op) -> bool {
        let (reply, answer) = mpsc::channel();
        self.0.send((op, reply)).unwrap();
        answer.recv().unwrap()
    }
}

/// An engine as the writer thread uses it.
trait Engine: Send + Sync + 'static {
    /// Applies the ops as one atomic batch, not yet durable; answers each (reserve: did it own
    /// the key).
    fn write(&self, ops: &[Op]) -> Vec<bool>;
    /// Makes every batch written so far durable (fdatasync of the log).
    fn sync(&self);
}

const PENDING: [u8; 66] = [1; 66];

fn completed() -> Vec<u8> {
    vec![2; 350]
}

/// A write of a batch: the key and its new value (`None`: delete).
type Write<'a> = (&'a [u8], Option<Vec<u8>>);

/// What a batch of ops answers and writes, whatever the engine; `held` says whether the engine
/// already holds a key. A batch is applied at commit, so a key reserved twice in one batch is
/// answered from the batch's own reservations.
fn plan<'a>(ops: &'a [Op], held: impl Fn(&[u8]) -> bool) -> (Vec<bool>, Vec<Write<'a>>) {
    let mut fresh = HashSet::new();
    let mut writes = Vec::with_capacity(ops.len());
    let answers = ops
        .iter()
        .map(|op| match op {
            Op::Reserve(k) => {
                let owned = !fresh.contains(k.as_slice()) && !held(k);
                if owned {
                    fresh.insert(k.as_slice());
                    writes.push((k.as_slice(), Some(PENDING.to_vec())));
                }
                owned
            }
            Op::Complete(k) => {
                writes.push((k.as_slice(), Some(completed())));
                true
            }
            Op::Delete(k) => {
                writes.push((k.as_slice(), None));
                true
            }
        })
        .collect();
    (answers, writes)
}

/// Configured as the gateway's disk store is (`src/store/disk/mod.rs`).
struct Fjall {
    db: fjall::Database,
    ks: fjall::Keyspace,
}

impl Fjall {
    fn open(dir: &Path) -> Self {
        let db = fjall::Database::builder(dir)
            .max_journaling_size(64 * 1024 * 1024)
            .worker_threads(1)
            .open()
            .unwrap();
        let ks = db
            .keyspace("records", fjall::KeyspaceCreateOptions::default)
            .unwrap();
        Fjall { db, ks }
    }
}

impl Engine for Fjall {
    fn write(&self, ops: &[Op]) -> Vec<bool> {
        let (answers, writes) = plan(ops, |k| self.ks.get(k).unwrap().is_some());
        let mut batch = self.db.batch();
        for (k, value) in writes {
            match value {
                Some(v) => batch.insert(&self.ks, k, v),
                None => batch.remove(&self.ks, k),
            }
        }
        batch.commit().unwrap();
        answers
    }

    fn sync(&self) {
        self.db.persist(fjall::PersistMode::SyncData).unwrap();
    }
}

/// RocksDB with its defaults but no compression; the log is synced with fdatasync (RocksDB's
/// default, `use_fsync = false`).
struct Rocks {
    db: rocksdb::DB,
}

impl Rocks {
    fn open(dir: &Path) -> Self {
        Rocks {
            db: rocksdb::DB::open(&rocks_options(), dir).unwrap(),
        }
    }
}

/// The options of both RocksDB setups: its defaults, no compression.
fn rocks_options() -> rocksdb::Options {
    let mut options = rocksdb::Options::default();
    options.create_if_missing(true);
    options.set_compression_type(rocksdb::DBCompressionType::None);
    options
}

impl Engine for Rocks {
    fn write(&self, ops: &[Op]) -> Vec<bool> {
        let (answers, writes) = plan(ops, |k| self.db.get_pinned(k).unwrap().is_some());
        let mut batch = rocksdb::WriteBatch::default();
        for (k, value) in writes {
            match value {
                Some(v) => batch.put(k, v),
                None => batch.delete(k),
            }
        }
        // Not synced here: `sync` does that (`FlushWAL`), serially or on the syncer thread.
        self.db.write(batch).unwrap();
        answers
    }

    fn sync(&self) {
        self.db.flush_wal(true).unwrap();
    }
}

/// RocksDB's own group commit: a `TransactionDB` that every client thread commits to itself,
/// synced; the key's lock (`get_for_update`) makes the reservation an insert-if-absent.
struct RocksTransactions {
    db: rocksdb::TransactionDB,
    /// Kept for its statistics (the log's syncs).
    options: Arc<Mutex<rocksdb::Options>>,
}

impl RocksTransactions {
    fn open(dir: &Path) -> Self {
        let mut options = rocks_options();
        options.enable_statistics();
        let db = rocksdb::TransactionDB::open(&options, &Default::default(), dir).unwrap();
        RocksTransactions {
            db,
            options: Arc::new(Mutex::new(options)),
        }
    }
}

fn synced() -> rocksdb::WriteOptions {
    let mut options = rocksdb::WriteOptions::default();
    options.set_sync(true);
    options
}

impl Client for RocksTransactions {
    fn call(&self, op: Op) -> bool {
        match op {
            Op::Reserve(k) => {
                let txn = self.db.transaction_opt(&synced(), &Default::default());
                if txn.get_pinned_for_update(&k, true).unwrap().is_some() {
                    return false;
                }
                txn.put(&k, PENDING).unwrap();
                txn.commit().unwrap();
                true
            }
            Op::Complete(k) => {
                self.db.put_opt(&k, completed(), &synced()).unwrap();
                true
            }
            Op::Delete(k) => {
                self.db.delete_opt(&k, &synced()).unwrap();
                true
            }
        }
    }
}

#[derive(Clone, Copy)]
enum Mode {
    Serial,
    Pipelined,
}

type Batch = (Vec<bool>, Vec<mpsc::Sender<bool>>);

/// Runs the engine's writer (and, pipelined, its syncer); returns the sender and a handle that
/// yields the number of fsyncs.
fn writer(
    engine: Box<dyn Engine>,
    mode: Mode,
) -> (mpsc::Sender<Job>, std::thread::JoinHandle<u64>) {
    let (tx, rx) = mpsc::channel::<Job>();
    let engine: Arc<dyn Engine> = Arc::from(engine);
    let handle = std::thread::spawn(move || {
        let (synced_tx, synced_rx) = mpsc::channel::<Batch>();
        let syncer = {
            let engine = Arc::clone(&engine);
            std::thread::spawn(move || syncer(&*engine, synced_rx))
        };
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
            let answers = engine.write(&ops);
            match mode {
                Mode::Serial => {
                    engine.sync();
                    syncs += 1;
                    answer((answers, replies));
                }
                Mode::Pipelined => synced_tx.send((answers, replies)).unwrap(),
            }
        }
        drop(synced_tx);
        syncs + syncer.join().unwrap()
    });
    (tx, handle)
}

/// Syncs whatever batches were written by then with one fsync, answers them; returns the count.
fn syncer(engine: &dyn Engine, rx: mpsc::Receiver<Batch>) -> u64 {
    let mut syncs = 0;
    while let Ok(first) = rx.recv() {
        let mut batches = vec![first];
        batches.extend(rx.try_iter());
        engine.sync();
        syncs += 1;
        batches.into_iter().for_each(answer);
    }
    syncs
}

fn answer((answers, replies): Batch) {
    for (reply, a) in replies.into_iter().zip(answers) {
        let _ = reply.send(a);
    }
}

fn dir_size(path: &Path) -> u64 {
    let mut total = 0;
    for e in std::fs::read_dir(path).unwrap() {
        let e = e.unwrap();
        let m = e.metadata().unwrap();
        total += if m.is_dir() {
            dir_size(&e.path())
        } else {
            m.len()
        };
    }
    total
}

/// User and system CPU time of the whole process so far.
fn cpu_time() -> Duration {
    // SAFETY: getrusage writes the struct it is given and nothing else.
    let usage = unsafe {
        let mut usage = std::mem::zeroed::<libc::rusage>();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

struct Figures {
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
    cpu_us: f64,
}

/// Runs the workload through `client`; `finish` (once the client is dropped) counts the fsyncs.
fn run(
    name: &str,
    dir: &Path,
    client: Box<dyn Client>,
    finish: impl FnOnce() -> u64,
    n: usize,
    c: usize,
) -> Figures {
    let client: Arc<dyn Client> = Arc::from(client);
    let per_client = n / c;
    let phase = |round: usize| {
        let (started, cpu) = (Instant::now(), cpu_time());
        let threads: Vec<_> = (0..c)
            .map(|thread| {
                let client = Arc::clone(&client);
                std::thread::spawn(move || {
                    let mut lat = Vec::with_capacity(per_client);
                    for i in 0..per_client {
                        let key = format!("{round}-{thread}-{i}").into_bytes();
                        let t = Instant::now();
                        assert!(client.call(Op::Reserve(key.clone())));
                        client.call(Op::Complete(key));
                        lat.push(t.elapsed());
                    }
                    lat
                })
            })
            .collect();
        let mut lat: Vec<Duration> = threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        lat.sort();
        (started.elapsed(), cpu_time() - cpu, lat)
    };
    let (took, cpu, lat) = phase(0);
    let size_after = dir_size(dir);
    // Expire every key (delete) and write as many again: a store with a short ttl.
    for thread in 0..c {
        for i in 0..per_client {
            client.call(Op::Delete(format!("0-{thread}-{i}").into_bytes()));
        }
    }
    phase(1);
    let size_reused = dir_size(dir);
    drop(client);
    let syncs = finish();
    let n = lat.len();
    let figures = Figures {
        rps: n as f64 / took.as_secs_f64(),
        p50_ms: lat[n / 2].as_secs_f64() * 1e3,
        p99_ms: lat[n * 99 / 100].as_secs_f64() * 1e3,
        cpu_us: cpu.as_secs_f64() * 1e6 / n as f64,
    };
    println!(
        "{name:20} {:8.0} req/s  p50 {:6.2} ms  p99 {:6.2} ms  CPU {:5.1} us/req  fsyncs/req {:.2} (all phases)  dir {:.1} MB after {n} keys, {:.1} MB after deleting them and writing {n} more",
        figures.rps,
        figures.p50_ms,
        figures.p99_ms,
        figures.cpu_us,
        syncs as f64 / (n * 2 * 2 + n) as f64,
        size_after as f64 / 1e6,
        size_reused as f64 / 1e6,
    );
    figures
}

/// Runs one setup in `dir`.
fn setup(setup: Setup, dir: &Path, n: usize, c: usize) -> Figures {
    let name = setup.name();
    let queued = |engine: Box<dyn Engine>, mode| {
        let (tx, handle) = writer(engine, mode);
        run(
            name,
            dir,
            Box::new(Queue(tx)),
            || handle.join().unwrap(),
            n,
            c,
        )
    };
    match setup {
        Setup::Fjall(mode) => queued(Box::new(Fjall::open(dir)), mode),
        Setup::Rocks(mode) => queued(Box::new(Rocks::open(dir)), mode),
        Setup::RocksTransactions => {
            let client = RocksTransactions::open(dir);
            let options = Arc::clone(&client.options);
            let synced = move || {
                let options = options.lock().unwrap();
                options.get_ticker_count(rocksdb::statistics::Ticker::WalFileSynced)
            };
            run(name, dir, Box::new(client), synced, n, c)
        }
    }
}

#[derive(Clone, Copy)]
enum Setup {
    Fjall(Mode),
    Rocks(Mode),
    RocksTransactions,
}

impl Setup {
    fn name(self) -> &'static str {
        match self {
            Setup::Fjall(Mode::Serial) => "fjall serial",
            Setup::Fjall(Mode::Pipelined) => "fjall pipelined",
            Setup::Rocks(Mode::Serial) => "rocksdb serial",
            Setup::Rocks(Mode::Pipelined) => "rocksdb pipelined",
            Setup::RocksTransactions => "rocksdb transactions",
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let requests = args.first().copied().unwrap_or(20_000);
    let clients = args.get(1).copied().unwrap_or(32);
    let rounds = args.get(2).copied().unwrap_or(3);
    let base = std::env::temp_dir().join(format!("embedded-stores-{}", std::process::id()));
    let setups = [
        Setup::Fjall(Mode::Serial),
        Setup::Fjall(Mode::Pipelined),
        Setup::Rocks(Mode::Serial),
        Setup::Rocks(Mode::Pipelined),
        Setup::RocksTransactions,
    ];
    let mut results: Vec<Vec<Figures>> = setups.iter().map(|_| Vec::new()).collect();
    for round in 0..rounds {
        for (i, s) in setups.iter().enumerate() {
            let dir = base.join(format!("{i}-{round}"));
            std::fs::create_dir_all(&dir).unwrap();
            results[i].push(setup(*s, &dir, requests, clients));
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    // On a shared machine only what ran in the same round compares: each setup's ratio to
    // fjall serial (the gateway's today) is taken per round, then the median.
    println!("\nmedians of {rounds} rounds; x fjall serial: the median of the per-round ratios (lowest-highest)");
    let baseline: Vec<f64> = results[0].iter().map(|f| f.rps).collect();
    for (s, figures) in setups.iter().zip(results) {
        let pick = |f: fn(&Figures) -> f64| median(figures.iter().map(f).collect());
        let ratios: Vec<f64> = figures
            .iter()
            .zip(&baseline)
            .map(|(f, b)| f.rps / b)
            .collect();
        let (low, high) = ratios
            .iter()
            .fold((f64::MAX, 0f64), |(l, h), r| (l.min(*r), h.max(*r)));
        println!(
            "{:20} {:8.0} req/s  p50 {:6.2} ms  p99 {:6.2} ms  CPU {:5.1} us/req  x fjall serial {:.2} ({low:.2}-{high:.2})",
            s.name(),
            pick(|f| f.rps),
            pick(|f| f.p50_ms),
            pick(|f| f.p99_ms),
            pick(|f| f.cpu_us),
            median(ratios.clone()),
        );
    }
    let _ = std::fs::remove_dir_all(&base);
}
