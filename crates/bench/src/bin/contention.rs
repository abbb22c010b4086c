//! Many threads on one key, and on the transaction of three, for tollgate's memory store and
//! for governor: wall time per call over all threads, and the latency of single calls
//! (percentiles over every call of every thread), with as many threads as cores and with
//! more. `cargo run --release -p tollgate-bench --bin contention [CALLS] [THREADS...]`
//! (defaults: 800,000 calls in all, split over the threads; 2, 8 and 32 threads).
//!
//! Each call is timed on its own (`Instant` before and after), which adds the same few tens
//! of nanoseconds to both libraries; compare wall times with `profile_loop`'s, not these.
use std::hint::black_box;
use std::time::{Duration, Instant};

use tollgate_bench::{GovernorThree, Limit, USER, governor_keyed, tollgate, transaction_calls};

fn main() {
    let mut args = std::env::args().skip(1).map(|a| {
        a.parse::<usize>().unwrap_or_else(|_| {
            panic!("usage: contention [CALLS] [THREADS...]: {a:?} is not a whole number")
        })
    });
    let calls = args.next().unwrap_or(800_000);
    let threads: Vec<usize> = args.collect();
    let threads = if threads.is_empty() { vec![2, 8, 32] } else { threads };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("{cores} cores; {calls} calls in all per line");
    println!("library   scenario  threads  ns/call(wall)  p50  p99  p99.9  p99.99  max (ns)");
    let t = tollgate();
    let (gov, three) = (governor_keyed(), GovernorThree::new());
    let key = String::from(USER);
    for &n in &threads {
        let per = calls / n.max(1);
        run("tollgate", "one key", n, per, &|| {
            black_box(t.limit(Limit::PerUser, black_box(USER)).unwrap());
        });
        run("governor", "one key", n, per, &|| {
            let _ = black_box(gov.check_key(black_box(&key)));
        });
        run("tollgate", "tx of 3", n, per, &|| {
            black_box(t.transaction(&transaction_calls()).unwrap());
        });
        run("governor", "tx of 3", n, per, &|| {
            black_box(three.check());
        });
    }
}

/// Runs `op` `per` times on each of `threads` threads at once and prints the line.
fn run(library: &str, scenario: &str, threads: usize, per: usize, op: &(dyn Fn() + Sync)) {
    let start = Instant::now();
    let mut latencies: Vec<Duration> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(move || {
                    let mut own = Vec::with_capacity(per);
                    for _ in 0..per {
                        let before = Instant::now();
                        op();
                        own.push(before.elapsed());
                    }
                    own
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().expect("a worker")).collect()
    });
    let wall = start.elapsed();
    latencies.sort_unstable();
    let n = latencies.len().max(1);
    let at =
        |q: f64| latencies.get(((n as f64 * q) as usize).min(n - 1)).map_or(0, |d| d.as_nanos());
    println!(
        "{library:<9} {scenario:<9} {threads:>7}  {:>13.0}  {:>3}  {:>3}  {:>5}  {:>6}  {}",
        wall.as_nanos() as f64 / n as f64,
        at(0.5),
        at(0.99),
        at(0.999),
        at(0.9999),
        latencies.last().map_or(0, |d| d.as_nanos()),
    );
}
