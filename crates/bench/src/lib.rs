//! What the benchmarks of tollgate share: the scenarios, built the same way for tollgate and
//! for governor, so the criterion bench and the memory report measure the same thing.

pub mod admissions;
pub mod proxy;

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use governor::{DefaultKeyedRateLimiter, Quota};
use tollgate::{Call, Config, Limits, MemoryStore, RateLimiter, Request, SECOND, Target};

/// A burst large enough that every request of a run is admitted, with a slow refill, so that
/// states stay live (not full) for the whole run: both libraries then measure the admit path
/// on resident keys. (With a fast refill, states are full again at once and tollgate's memory
/// store drops them, which would measure insertion instead.) 4e9 is about governor's largest
/// burst (a `NonZeroU32`).
pub const BURST: u32 = 4_000_000_000;

/// The limits of the scenarios, declared as a user would.
#[derive(Clone, Copy, Debug)]
pub enum Limit {
    /// A per-user limit.
    PerUser,
    /// A per-team limit.
    PerTeam,
    /// One global limit.
    Global,
}

impl Limits for Limit {
    fn name(self) -> &'static str {
        match self {
            Limit::PerUser => "perUser",
            Limit::PerTeam => "perTeam",
            Limit::Global => "global",
        }
    }
    fn config(self) -> Config {
        const RESIDENT: Config = Config::token_bucket(1.0, SECOND).with_capacity(BURST as f64);
        RESIDENT
    }
}

/// A tollgate limiter on the memory store.
pub fn tollgate() -> RateLimiter<MemoryStore> {
    RateLimiter::new(MemoryStore::new())
}

/// The key of the one-key scenarios and of the transaction's user: both libraries are given
/// this one.
pub const USER: &str = "user-00000001";
/// The key of the transaction's team, for both libraries.
pub const TEAM: &str = "team-0001";

/// tollgate's side of the transaction scenario: one user, one team and the global limit, the
/// keys hidden from the compiler.
#[inline(always)]
pub fn transaction_calls() -> [Call<'static>; 3] {
    [
        Target::from(Limit::PerUser).with(black_box(USER)),
        Target::from(Limit::PerTeam).with(black_box(TEAM)),
        Target::from(Limit::Global).with(Request::new()),
    ]
}

/// The transaction's three limits as three separate `limit` calls (not atomic): the work a
/// transaction of three does at the least. Whether all three admitted.
#[inline(always)]
pub fn three_limits(t: &RateLimiter<MemoryStore>) -> bool {
    t.limit(Limit::PerUser, black_box(USER)).unwrap().ok
        && t.limit(Limit::PerTeam, black_box(TEAM)).unwrap().ok
        && t.limit(Limit::Global, Request::new()).unwrap().ok
}

/// governor's side of the transaction scenario: governor has no transaction, so it checks
/// the three limiters one after another (not atomic: the first two are spent even when the
/// third refuses), the global one on its direct limiter.
pub struct GovernorThree {
    users: DefaultKeyedRateLimiter<String>,
    teams: DefaultKeyedRateLimiter<String>,
    global: governor::DefaultDirectRateLimiter,
    user: String,
    team: String,
}

impl GovernorThree {
    /// Fresh limiters with the scenarios' rate.
    pub fn new() -> Self {
        GovernorThree {
            users: governor_keyed(),
            teams: governor_keyed(),
            global: governor_direct(),
            user: String::from(USER),
            team: String::from(TEAM),
        }
    }

    /// The three checks; whether all three admitted.
    #[inline(always)]
    pub fn check(&self) -> bool {
        self.users.check_key(black_box(&self.user)).is_ok()
            && self.teams.check_key(black_box(&self.team)).is_ok()
            && self.global.check().is_ok()
    }
}

impl Default for GovernorThree {
    fn default() -> Self {
        Self::new()
    }
}

/// ns per call of `op`, over `n` calls (`op` gets the call's index).
pub fn ns_per_call(n: usize, mut op: impl FnMut(usize)) -> f64 {
    let start = Instant::now();
    for i in 0..n {
        op(i);
    }
    start.elapsed().as_nanos() as f64 / n as f64
}

/// governor's keyed limiter (dashmap, quanta clock: its defaults) with the same rate.
pub fn governor_keyed() -> DefaultKeyedRateLimiter<String> {
    governor::RateLimiter::keyed(quota())
}

/// governor's direct (unkeyed) limiter with the same rate.
pub fn governor_direct() -> governor::DefaultDirectRateLimiter {
    governor::RateLimiter::direct(quota())
}

fn quota() -> Quota {
    let one = NonZeroU32::new(1).expect("non-zero");
    Quota::per_second(one).allow_burst(NonZeroU32::new(BURST).expect("non-zero"))
}

/// The URL in the environment variable `var`, else `default`; panics unless it is a loopback
/// address: the load scripts never target another machine.
pub fn loopback_url(var: &str, default: &str) -> String {
    let url = std::env::var(var).unwrap_or_else(|_| default.into());
    assert!(
        url.contains("127.0.0.1") || url.contains("localhost") || url.contains("[::1]"),
        "loopback only: {url}"
    );
    url
}

/// The Redis key of the `INCR` counter of `key`, the plain operation the Redis store is
/// measured against.
pub fn counter_key(key: &str) -> String {
    format!("tollgate-bench:incr:{key}")
}

/// Deletes the `INCR` counters of `keys`, which have no expiry (tollgate's states do), so a
/// run leaves the server as it was.
pub fn delete_counters(conn: &mut redis::Connection, keys: &[String]) {
    for chunk in keys.chunks(1000) {
        let names: Vec<String> = chunk.iter().map(|k| counter_key(k)).collect();
        let _: () = redis::cmd("DEL").arg(names).query(conn).unwrap();
    }
}

/// Calls and microseconds of `command` so far, from `INFO commandstats`.
pub fn command_stats(conn: &mut redis::Connection, command: &str) -> (f64, f64) {
    let info: String = redis::cmd("INFO").arg("commandstats").query(conn).unwrap();
    let prefix = format!("cmdstat_{command}:");
    let Some(line) = info.lines().find_map(|l| l.strip_prefix(prefix.as_str())) else {
        return (0.0, 0.0);
    };
    let field = |name: &str| {
        line.split(',').find_map(|kv| kv.strip_prefix(name)).map_or(0.0, |v| v.parse().unwrap())
    };
    (field("calls="), field("usec="))
}

/// `n` distinct keys shaped like user ids.
pub fn keys(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("user-{i:08}")).collect()
}

/// The keys of the 100k-key scenario: distinct `String` keys and a fixed shuffled order to
/// visit them in, so that each call goes to a live key far in memory from the last one's.
pub struct ManyKeys {
    keys: Vec<String>,
    order: Vec<usize>,
}

impl ManyKeys {
    /// `n` keys (see [`keys`]), visited in the order of `i * 48,271 mod n`: a permutation of
    /// them, since 48,271 is a prime that does not divide `n` (true of the scenario's 100,000).
    pub fn new(n: usize) -> Self {
        assert!(n > 0 && !n.is_multiple_of(48_271), "the order must visit every key");
        ManyKeys { keys: keys(n), order: (0..n).map(|i| (i * 48_271) % n).collect() }
    }

    /// The key of call `i` (any `i`: the order repeats every `n` calls).
    #[inline(always)]
    pub fn at(&self, i: usize) -> &String {
        &self.keys[self.order[i % self.keys.len()]]
    }

    /// A tollgate limiter (on the scenario's per-user limit) and a governor keyed limiter,
    /// each with every key live.
    pub fn filled(&self) -> (RateLimiter<MemoryStore>, DefaultKeyedRateLimiter<String>) {
        let (t, gov) = (tollgate(), governor_keyed());
        for k in &self.keys {
            t.limit(Limit::PerUser, k.as_str()).unwrap();
            let _ = gov.check_key(k);
        }
        (t, gov)
    }
}

/// Runs `op(thread, iteration)` on `threads` threads for `duration`, as fast as they go;
/// returns operations per second over all threads. For load against a server, where each
/// operation is a round trip.
pub fn throughput(threads: usize, duration: Duration, op: impl Fn(usize, usize) + Sync) -> f64 {
    let stop = AtomicBool::new(false);
    let start = Instant::now();
    let total: usize = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let (stop, op) = (&stop, &op);
                s.spawn(move || {
                    let mut n = 0;
                    while !stop.load(Ordering::Relaxed) {
                        op(t, n);
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        std::thread::sleep(duration);
        stop.store(true, Ordering::Relaxed);
        workers.into_iter().map(|w| w.join().unwrap()).sum()
    });
    total as f64 / start.elapsed().as_secs_f64()
}

/// The output of `future`, which must be ready at once (the memory store's async calls
/// are): polled once with a no-op waker, so no runtime's cost is in the figure.
///
/// # Panics
///
/// If the future is not ready on its first poll.
#[inline(always)]
pub fn ready<F: std::future::Future>(future: F) -> F::Output {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match std::pin::pin!(future).poll(&mut cx) {
        std::task::Poll::Ready(output) => output,
        std::task::Poll::Pending => panic!("the memory store's async calls are ready at once"),
    }
}

/// Runs `op(task, iteration)` on `tasks` concurrent tasks of `runtime` for `duration`, each
/// awaiting one operation after another; returns operations per second over all tasks. For
/// load against a server through an async client: `tasks` requests in flight.
pub fn async_throughput<F, Fut>(
    runtime: &tokio::runtime::Runtime,
    tasks: usize,
    duration: Duration,
    op: F,
) -> f64
where
    F: Fn(usize, usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let op = std::sync::Arc::new(op);
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let total: usize = runtime.block_on(async {
        let workers: Vec<_> = (0..tasks)
            .map(|t| {
                let (op, stop) = (std::sync::Arc::clone(&op), std::sync::Arc::clone(&stop));
                tokio::spawn(async move {
                    let mut n = 0;
                    while !stop.load(Ordering::Relaxed) {
                        op(t, n).await;
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        tokio::time::sleep(duration).await;
        stop.store(true, Ordering::Relaxed);
        let mut total = 0;
        for worker in workers {
            total += worker.await.unwrap();
        }
        total
    });
    total as f64 / start.elapsed().as_secs_f64()
}

/// Runs `op` on two threads at once, `iters` times in all; the time per op is wall time over
/// all ops, so it falls if the threads truly run in parallel.
pub fn two_threads(iters: u64, op: &(dyn Fn() + Sync)) -> Duration {
    let barrier = Barrier::new(2);
    std::thread::scope(|s| {
        let worker = s.spawn(|| {
            barrier.wait();
            for _ in 0..iters / 2 {
                op();
            }
        });
        barrier.wait();
        let start = Instant::now();
        for _ in 0..iters - iters / 2 {
            op();
        }
        worker.join().unwrap();
        start.elapsed()
    })
}

/// ns per call of [`two_threads`]: wall time over all `calls` of both threads.
pub fn ns_per_call_on_two_threads(calls: u64, op: &(dyn Fn() + Sync)) -> f64 {
    two_threads(calls, op).as_nanos() as f64 / calls as f64
}

/// Measures the two sides of a comparison in `rounds` rounds (at least one) that alternate
/// which side goes first (`a` in even rounds), so that a slow spell of a shared machine falls
/// on both alike; calls `each(a, b)` with the two figures of every round, and returns the
/// median over the rounds of `b / a`.
pub fn alternate(
    rounds: usize,
    mut a: impl FnMut() -> f64,
    mut b: impl FnMut() -> f64,
    mut each: impl FnMut(f64, f64),
) -> f64 {
    let mut ratios = Vec::new();
    for round in 0..rounds.max(1) {
        let (x, y) = if round % 2 == 0 {
            let x = a();
            (x, b())
        } else {
            let y = b();
            (a(), y)
        };
        each(x, y);
        ratios.push(y / x);
    }
    ratios.sort_by(f64::total_cmp);
    ratios[ratios.len() / 2]
}

/// Starts `binary serve` with `args` in `dir` (its working directory, for a relative SQLite
/// file) and reads its banner until `wanted` picks a line: the process and what `wanted`
/// returned. The rest of the banner is read away in the background, so that the server
/// never blocks on a full pipe.
///
/// # Panics
///
/// The binary cannot be started, or its banner ends before `wanted` finds its line.
pub fn serve<T>(
    binary: &str,
    args: &[&str],
    dir: &std::path::Path,
    mut wanted: impl FnMut(&str) -> Option<T>,
) -> (std::process::Child, T) {
    use std::io::BufRead as _;
    std::fs::create_dir_all(dir).unwrap();
    // It runs in `dir`: its path from here.
    let binary = std::fs::canonicalize(binary).unwrap_or_else(|e| panic!("{binary}: {e}"));
    let mut child = std::process::Command::new(&binary)
        .arg("serve")
        .args(args)
        .current_dir(dir)
        .env("RUST_LOG", "error")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", binary.display()));
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let found = loop {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the banner has no such line");
        if let Some(found) = wanted(line.trim()) {
            break found;
        }
    };
    std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
    (child, found)
}
