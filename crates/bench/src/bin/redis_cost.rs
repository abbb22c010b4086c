//! Where a request's time goes with one request in flight: for `INCR`, an empty script, and
//! tollgate's `limit_async` on the Redis store (driven by a runtime of one thread), the wall time per request and the CPU time per
//! request of this client and of the Redis server (user and system, from `/proc`), with
//! Redis's own time per call from `INFO commandstats`.
//!
//! `cargo run --release -p tollgate-bench --bin redis_cost [SECONDS] [ROUNDS]` (default 2 s a
//! side, 3 rounds) against `TOLLGATE_REDIS_URL` (default redis://127.0.0.1:6379). Linux only,
//! and only for a Redis on this machine (its process id comes from `INFO server`); loopback
//! only; each measurement is bounded by time. CPU times are counted in the kernel's ticks
//! (10 ms), so a side needs a second or more to be read to a tenth of a microsecond a request.

use std::time::{Duration, Instant};

use tollgate::store::RedisStore;
use tollgate::{RateLimiter, Request};
use tollgate_bench::{Limit, command_stats, counter_key, delete_counters, keys, loopback_url};

/// User and system CPU time of a process so far, in microseconds.
fn cpu_us(pid: &str) -> (f64, f64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("Linux /proc");
    // After the command's name, in parentheses: field 14 (utime) and 15 (stime) of proc(5).
    let fields: Vec<&str> =
        stat.rsplit_once(')').expect("a stat line").1.split_whitespace().collect();
    let ticks = |i: usize| fields[i].parse::<f64>().expect("a tick count");
    let us_per_tick = 1e6 / 100.0; // USER_HZ is 100 on Linux
    (ticks(11) * us_per_tick, ticks(12) * us_per_tick)
}

struct Side<'a> {
    name: &'static str,
    command: &'static str,
    op: Box<dyn FnMut(usize) + 'a>,
}

fn main() {
    let secs: f64 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(2.0);
    let rounds: usize = std::env::args().nth(2).and_then(|a| a.parse().ok()).unwrap_or(3);
    let url = loopback_url("TOLLGATE_REDIS_URL", "redis://127.0.0.1:6379");
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut stats = client.get_connection().unwrap();
    let info: String = redis::cmd("INFO").arg("server").query(&mut stats).unwrap();
    let pid = info
        .lines()
        .find_map(|l| l.strip_prefix("process_id:"))
        .expect("INFO server names the process id")
        .trim()
        .to_string();
    assert!(
        std::path::Path::new(&format!("/proc/{pid}/stat")).exists(),
        "the Redis server (pid {pid}) is not a process of this machine"
    );

    let keys = keys(10_000);
    let mut incr_conn = client.get_connection().unwrap();
    let mut script_conn = client.get_connection().unwrap();
    let empty = redis::Script::new("return 1");
    let packed = [7u8; 59]; // as long as the store's one argument
    let limiter =
        RateLimiter::new(RedisStore::builder().prefix("tollgate-bench:").open(&url).unwrap());
    // The store's connection lives on this runtime; each call is driven on this thread.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut sides = [
        Side {
            name: "INCR",
            command: "incr",
            op: Box::new(|n| {
                let key = counter_key(&keys[n % keys.len()]);
                let _: i64 = redis::cmd("INCR").arg(key).query(&mut incr_conn).unwrap();
            }),
        },
        Side {
            name: "empty script",
            command: "evalsha",
            op: Box::new(|n| {
                let key = format!("tollgate-bench:empty:{}", keys[n % keys.len()]);
                let _: i64 = empty.key(key).arg(&packed[..]).invoke(&mut script_conn).unwrap();
            }),
        },
        Side {
            name: "tollgate limit",
            command: "evalsha",
            op: Box::new(|n| {
                let key = &keys[n % keys.len()];
                let decision = limiter.limit_async(Limit::PerUser, Request::new().key(key));
                assert!(runtime.block_on(decision).unwrap().ok);
            }),
        },
    ];
    println!("One request in flight; per request, in microseconds:");
    println!();
    println!(
        "| round | request | wall | Redis time a call | client user | client system | Redis user | Redis system |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|---:|");
    let duration = Duration::from_secs_f64(secs);
    for round in 1..=rounds {
        for side in &mut sides {
            let (calls0, usec0) = command_stats(&mut stats, side.command);
            let (cu0, cs0) = cpu_us("self");
            let (ru0, rs0) = cpu_us(&pid);
            let start = Instant::now();
            let mut n = 0;
            while start.elapsed() < duration {
                for _ in 0..100 {
                    (side.op)(n);
                    n += 1;
                }
            }
            let wall = start.elapsed().as_secs_f64() * 1e6;
            let (cu1, cs1) = cpu_us("self");
            let (ru1, rs1) = cpu_us(&pid);
            let (calls1, usec1) = command_stats(&mut stats, side.command);
            let per = |x: f64| x / n as f64;
            println!(
                "| {round} | {} | {:.1} | {:.2} | {:.1} | {:.1} | {:.1} | {:.1} |",
                side.name,
                per(wall),
                (usec1 - usec0) / (calls1 - calls0).max(1.0),
                per(cu1 - cu0),
                per(cs1 - cs0),
                per(ru1 - ru0),
                per(rs1 - rs0),
            );
        }
    }
    delete_counters(&mut stats, &keys);
}
