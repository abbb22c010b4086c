//! What the harnesses of leased limits share (`lease_faults`, `regions`): a log of every
//! request a process sends, with the times it was sent and answered, in a file mapped in
//! memory (what a process killed with -9 logged survives it); the check of every interval
//! against a bucket's bound; a Redis of a harness's own.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use memmap2::MmapMut;

/// Bytes of one logged request: sent and answered (ns since the run's start), flags in the
/// top bits of the second.
pub const RECORD: usize = 16;
/// The flag of an admitted request.
pub const ADMITTED: u64 = 1 << 63;
/// The flag of a request that failed (the store's error).
pub const ERROR: u64 = 1 << 62;
/// The time's bits of a record's second word.
pub const TIME_BITS: u64 = (1 << 62) - 1;

/// The value after `name` on a command line, parsed.
///
/// # Panics
///
/// If it is missing or does not parse.
pub fn flag<T: std::str::FromStr>(args: &[String], name: &str) -> Option<T> {
    let at = args.iter().position(|a| a == name)?;
    let value = args.get(at + 1).unwrap_or_else(|| panic!("{name} needs a value"));
    Some(value.parse().unwrap_or_else(|_| panic!("{name}: cannot read {value}")))
}

/// Nanoseconds since the epoch (the clock Redis's `TIME` reads).
///
/// # Panics
///
/// Before 1970.
pub fn real_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64
}

/// A process's log of its requests: a count, then a [`RECORD`] per request (at most
/// `slots`).
pub struct Log {
    map: MmapMut,
    slots: usize,
    logged: usize,
    start: u64,
}

impl Log {
    /// A log at `path` of at most `slots` requests, times counted from `start` (ns since the
    /// epoch, the run's start).
    ///
    /// # Panics
    ///
    /// If the file cannot be made or mapped.
    pub fn create(path: &Path, slots: usize, start: u64) -> Log {
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path);
        let file = file.unwrap();
        file.set_len((8 + slots * RECORD) as u64).unwrap();
        // The file is this process's alone while it runs; the harness reads it after.
        #[allow(unsafe_code)]
        let map = unsafe { MmapMut::map_mut(&file) }.unwrap();
        Log { map, slots, logged: 0, start }
    }

    /// Logs a request sent at `sent` and answered at `answered` (ns since the epoch):
    /// admitted or not, or failed (`None`). Past `slots`, nothing.
    pub fn record(&mut self, sent: u64, answered: u64, admitted: Option<bool>) {
        if self.logged == self.slots {
            return;
        }
        let flags = match admitted {
            Some(true) => ADMITTED,
            Some(false) => 0,
            None => ERROR,
        };
        let at = 8 + self.logged * RECORD;
        let map = &mut self.map;
        map[at..at + 8].copy_from_slice(&(sent - self.start).to_le_bytes());
        map[at + 8..at + 16].copy_from_slice(&((answered - self.start) | flags).to_le_bytes());
        self.logged += 1;
        // The count after the record: a kill between the two loses that one record.
        map[..8].copy_from_slice(&(self.logged as u64).to_le_bytes());
    }

    /// Whether every slot is used.
    pub fn full(&self) -> bool {
        self.logged == self.slots
    }

    /// Writes it out.
    ///
    /// # Panics
    ///
    /// If the flush fails.
    pub fn flush(&self) {
        self.map.flush().unwrap();
    }
}

/// Offers requests until `until` (ns since the epoch) or the log is full, and logs each with
/// the times it was sent and answered: whenever `room(issued, on_their_way)` says so, one
/// more is sent (`send()`, which answers admitted, refused, or `None` for an error). What is
/// on its way at `until` is waited for, then the log is written out.
///
/// # Panics
///
/// If the log cannot be written out.
pub async fn offer<F, Fut>(
    log: &mut Log,
    until: u64,
    mut room: impl FnMut(u64, usize) -> bool,
    send: F,
) where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Option<bool>>,
{
    use futures_util::StreamExt;
    let mut issued = 0u64;
    let mut pending = futures_util::stream::FuturesUnordered::new();
    let timed = || {
        let sent = real_ns();
        let decided = send();
        async move {
            let admitted = decided.await;
            (sent, real_ns(), admitted)
        }
    };
    while real_ns() < until && !log.full() {
        while room(issued, pending.len()) {
            issued += 1;
            pending.push(timed());
        }
        tokio::select! {
            biased;
            Some((sent, answered, admitted)) = pending.next(), if !pending.is_empty() => {
                log.record(sent, answered, admitted);
            }
            () = tokio::time::sleep(Duration::from_millis(1)) => {}
        }
    }
    while let Some((sent, answered, admitted)) = pending.next().await {
        log.record(sent, answered, admitted);
    }
    log.flush();
}

/// A request as logged: sent and answered (ms since the run's start), admitted, failed.
#[derive(Clone, Copy)]
pub struct Logged {
    /// When it was sent.
    pub sent: f64,
    /// When its answer came.
    pub answered: f64,
    /// Admitted.
    pub admitted: bool,
    /// Failed (the store's error).
    pub error: bool,
}

/// Adds the requests of the log at `path` to `into` (nothing if it is missing).
///
/// # Panics
///
/// On a log too short for its count.
pub fn read_log(path: &Path, into: &mut Vec<Logged>) {
    let Ok(bytes) = std::fs::read(path) else { return };
    if bytes.len() < 8 {
        return;
    }
    let count = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    for i in 0..count {
        let at = 8 + i * RECORD;
        let sent = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
        let second = u64::from_le_bytes(bytes[at + 8..at + 16].try_into().unwrap());
        into.push(Logged {
            sent: sent as f64 / 1e6,
            answered: (second & TIME_BITS) as f64 / 1e6,
            admitted: second & ADMITTED != 0,
            error: second & ERROR != 0,
        });
    }
}

/// The interval [a, b] (a a request's send time, b an answer's time) with the most
/// admissions wholly inside it over `capacity + rate (b - a)`: that excess (at most 0 when
/// exact), with the count and bound there.
pub fn worst_interval(admitted: &[&Logged], rate: f64, capacity: f64) -> (f64, (u64, f64)) {
    if admitted.is_empty() {
        return (f64::NEG_INFINITY, (0, capacity));
    }
    let mut starts: Vec<f64> = admitted.iter().map(|r| r.sent).collect();
    starts.sort_by(f64::total_cmp);
    let mut by_answer: Vec<&Logged> = admitted.to_vec();
    by_answer.sort_by(|x, y| x.answered.total_cmp(&y.answered));
    // tree[i] = count of admissions inside [starts[i], b] + rate * starts[i]
    let mut tree = MaxAdd::new(&starts.iter().map(|a| rate * a).collect::<Vec<_>>());
    let mut worst = (f64::NEG_INFINITY, (0, capacity));
    for r in by_answer {
        // Every interval starting at or before r.sent now holds r.
        let upto = starts.partition_point(|&a| a <= r.sent);
        tree.add(0, upto, 1.0);
        let b = r.answered;
        let candidates = starts.partition_point(|&a| a <= b);
        let (best, at) = tree.max(0, candidates);
        let excess = best - rate * b - capacity;
        if excess > worst.0 {
            let count = (best - rate * starts[at]).round() as u64;
            worst = (excess, (count, capacity + rate * (b - starts[at])));
        }
    }
    worst
}

/// A segment tree of values with "add to a range" and "the largest in a range (and where)".
struct MaxAdd {
    n: usize,
    max: Vec<(f64, usize)>,
    pending: Vec<f64>,
}

impl MaxAdd {
    fn new(values: &[f64]) -> MaxAdd {
        let n = values.len();
        let mut tree = MaxAdd { n, max: vec![(0.0, 0); 4 * n], pending: vec![0.0; 4 * n] };
        tree.build(1, 0, n, values);
        tree
    }

    fn build(&mut self, node: usize, lo: usize, hi: usize, values: &[f64]) {
        if hi - lo == 1 {
            self.max[node] = (values[lo], lo);
            return;
        }
        let mid = usize::midpoint(lo, hi);
        self.build(2 * node, lo, mid, values);
        self.build(2 * node + 1, mid, hi, values);
        self.max[node] = larger(self.max[2 * node], self.max[2 * node + 1]);
    }

    fn add(&mut self, from: usize, to: usize, value: f64) {
        if from < to {
            self.add_in(1, 0, self.n, from, to, value);
        }
    }

    fn add_in(&mut self, node: usize, lo: usize, hi: usize, from: usize, to: usize, value: f64) {
        if to <= lo || hi <= from {
            return;
        }
        if from <= lo && hi <= to {
            self.max[node].0 += value;
            self.pending[node] += value;
            return;
        }
        let mid = usize::midpoint(lo, hi);
        self.add_in(2 * node, lo, mid, from, to, value);
        self.add_in(2 * node + 1, mid, hi, from, to, value);
        let (m, at) = larger(self.max[2 * node], self.max[2 * node + 1]);
        self.max[node] = (m + self.pending[node], at);
    }

    fn max(&self, from: usize, to: usize) -> (f64, usize) {
        if from >= to {
            return (f64::NEG_INFINITY, 0);
        }
        self.max_in(1, 0, self.n, from, to)
    }

    fn max_in(&self, node: usize, lo: usize, hi: usize, from: usize, to: usize) -> (f64, usize) {
        if to <= lo || hi <= from {
            return (f64::NEG_INFINITY, 0);
        }
        if from <= lo && hi <= to {
            return self.max[node];
        }
        let mid = usize::midpoint(lo, hi);
        let (m, at) = larger(
            self.max_in(2 * node, lo, mid, from, to),
            self.max_in(2 * node + 1, mid, hi, from, to),
        );
        (m + self.pending[node], at)
    }
}

fn larger(a: (f64, usize), b: (f64, usize)) -> (f64, usize) {
    if b.0 > a.0 { b } else { a }
}

/// A Redis of a harness's own, in `dir`: with `aof`, an append-only file fsynced on every
/// write (so a restart keeps every state and lease it acknowledged).
pub struct OwnRedis {
    aof: bool,
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl OwnRedis {
    /// Starts one on a free port, its files under `dir`.
    ///
    /// # Panics
    ///
    /// If `redis-server` does not start.
    pub fn start(dir: &Path, aof: bool) -> OwnRedis {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let dir = dir.join("redis");
        std::fs::create_dir_all(&dir).unwrap();
        let mut redis = OwnRedis { aof, port, dir, child: None };
        redis.spawn();
        redis
    }

    /// Empties it and compacts its append-only file, so that a restart loads little.
    pub fn empty(&self) {
        let url = format!("redis://{}", self.addr());
        let mut conn = redis::Client::open(url.as_str()).unwrap().get_connection().unwrap();
        let _: () = redis::cmd("FLUSHALL").query(&mut conn).unwrap();
        if self.aof {
            let _: String = redis::cmd("BGREWRITEAOF").query(&mut conn).unwrap();
        }
    }

    /// Where it listens (loopback).
    pub fn addr(&self) -> std::net::SocketAddr {
        ([127, 0, 0, 1], self.port).into()
    }

    fn spawn(&mut self) {
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string(), "--save", ""])
            .args(if self.aof {
                ["--appendonly", "yes", "--appendfsync", "always"]
            } else {
                ["--appendonly", "no", "--appendfsync", "no"]
            })
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server on the PATH");
        self.child = Some(child);
        let url = format!("redis://{}", self.addr());
        let started = Instant::now();
        loop {
            let ping = redis::Client::open(url.as_str())
                .and_then(|c| c.get_connection())
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c));
            if ping.is_ok() {
                return;
            }
            assert!(started.elapsed() < Duration::from_secs(10), "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills it with -9 and starts it again on its files.
    pub fn restart(&mut self, down: Duration) {
        self.stop();
        std::thread::sleep(down);
        self.spawn();
    }

    /// Kills it with -9.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admitted(times: &[(f64, f64)]) -> Vec<Logged> {
        times
            .iter()
            .map(|&(sent, answered)| Logged { sent, answered, admitted: true, error: false })
            .collect()
    }

    /// The check finds an interval over the bound, and only one that certainly is.
    #[test]
    fn the_interval_check_finds_the_worst_interval() {
        // Capacity 2, rate 1 a ms: three at once is one too many; three a ms apart are not.
        let burst = admitted(&[(0.0, 0.1), (0.0, 0.1), (0.0, 0.1), (5.0, 5.1)]);
        let refs: Vec<&Logged> = burst.iter().collect();
        let (excess, (count, _)) = worst_interval(&refs, 1.0, 2.0);
        assert!((excess - 0.9).abs() < 1e-9, "{excess}");
        assert_eq!(count, 3);
        let spread = admitted(&[(0.0, 0.0), (1.0, 1.0), (2.0, 2.0), (3.0, 3.0)]);
        let refs: Vec<&Logged> = spread.iter().collect();
        assert!(worst_interval(&refs, 1.0, 2.0).0 <= 0.0);
        // Four in [10, 11] with capacity 2 and rate 1/ms: 4 - (2 + 1) = 1 over, found even
        // with admissions before and after.
        let later = admitted(&[(0.0, 0.5), (10.0, 10.2), (10.3, 10.5), (10.6, 10.8), (10.9, 11.0)]);
        let refs: Vec<&Logged> = later.iter().collect();
        let (excess, (count, bound)) = worst_interval(&refs, 1.0, 2.0);
        assert!((excess - 1.0).abs() < 1e-9, "{excess}");
        assert_eq!((count, bound), (4, 3.0));
        // A request whose answer took long may have been decided at either end: it counts
        // only in intervals that hold all of it.
        let slow = admitted(&[(0.0, 10.0), (10.0, 10.0), (10.0, 10.0), (10.0, 10.0)]);
        let refs: Vec<&Logged> = slow.iter().collect();
        let (excess, (count, _)) = worst_interval(&refs, 1.0, 2.0);
        assert!((excess - 1.0).abs() < 1e-9, "{excess}");
        assert_eq!(count, 3);
    }
}
