//! What this machine charges for the few operations that every check of either library pays,
//! so that ratios measured on different hosts can be told apart:
//! `cargo run --release -p tollgate-bench --bin host_costs [CALLS]` (default 10,000,000 per
//! figure, three rounds).
//!
//! - `tollgate clock`: one read of tollgate's `SystemClock` (the time-stamp counter, scaled);
//!   a `limit` reads it once, a transaction once for all its limits.
//! - `wall clock`: one read of the system's wall clock (`SystemTime`, a vDSO call), which
//!   tollgate's clock reads once per process, for comparison.
//! - `governor clock`: one read of governor's default clock (quanta's); governor reads it once
//!   per check, so three times for three limits.
//! - `compare-and-swap`: an uncontended `compare_exchange` on one word, as governor's check
//!   makes on its limit's state (once, when nobody races it).
//! - `swap + store`: an uncontended `swap` then a plain `store`, which is what taking and
//!   releasing a free segment lock of tollgate's memory store costs.
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};

use governor::clock::{Clock as _, QuantaClock};
use tollgate::core::{Clock as _, SystemClock};
use tollgate_bench::ns_per_call;

fn main() {
    let calls: usize = match std::env::args().nth(1) {
        None => 10_000_000,
        Some(a) => a
            .parse()
            .unwrap_or_else(|_| panic!("usage: host_costs [CALLS]: {a:?} is not a whole number")),
    };
    let word = AtomicU64::new(0);
    let quanta = QuantaClock::default();
    println!("ns per operation, {calls} calls each, three rounds");
    println!("round  tollgate clock  wall clock  governor clock  compare-and-swap  swap + store");
    for round in 1..=3 {
        let tollgate_clock = ns_per_call(calls, |_| {
            black_box(SystemClock.now());
        });
        let wall_clock = ns_per_call(calls, |_| {
            black_box(SystemClock::wall());
        });
        let governor_clock = ns_per_call(calls, |_| {
            black_box(quanta.now());
        });
        let cas = ns_per_call(calls, |_| {
            let v = word.load(Ordering::Relaxed);
            let swapped = word.compare_exchange(v, v + 1, Ordering::AcqRel, Ordering::Relaxed);
            black_box(swapped).expect("nobody else writes the word");
        });
        let lock = ns_per_call(calls, |_| {
            black_box(word.swap(1, Ordering::Acquire));
            word.store(0, Ordering::Release);
        });
        println!(
            "{round:>5}  {tollgate_clock:>14.1}  {wall_clock:>10.1}  {governor_clock:>14.1}  \
             {cas:>16.1}  {lock:>12.1}"
        );
    }
}
