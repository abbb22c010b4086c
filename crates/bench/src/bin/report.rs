//! Prints BENCHMARKS.md's table: per scenario, tollgate's and governor's ns/op (read from the
//! last `cargo bench -p tollgate-bench` run) and their ratio; then measures bytes per live key
//! for both at 100k String keys with a counting allocator; then, unless `--no-rounds`, runs
//! the scenarios with a target again in interleaved rounds (tollgate, governor, governor,
//! tollgate, ...) and prints each round's ratio and their median: on a shared machine whose
//! caches other tenants use, a slow spell then falls on both sides of a ratio alike. The
//! rounds end with one extra, not a target: the transaction's three limits as three separate
//! `limit` calls, the floor under a transaction of three.

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicIsize, Ordering};
use tollgate_bench::{
    GovernorThree, Limit, ManyKeys, USER, alternate, governor_keyed, keys, ns_per_call,
    ns_per_call_on_two_threads, three_limits, tollgate, transaction_calls,
};

/// Counts the bytes currently allocated, to measure what live keys cost.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts sizes.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const SCENARIOS: [&str; 5] = [
    "one_key_one_thread",
    "global_one_thread",
    "100k_string_keys",
    "one_key_two_threads",
    "transaction_of_3",
];

fn criterion_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target"), PathBuf::from);
    target.join("criterion")
}

fn mean_ns(group: &str, id: &str) -> Option<f64> {
    let path = criterion_dir().join(group).join(id).join("new/estimates.json");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
    json["mean"]["point_estimate"].as_f64()
}

/// Bytes allocated per key after `n` live keys, beyond the keys' own bytes.
fn bytes_per_key(n: usize, fill: impl FnOnce(&[String]) -> Box<dyn std::any::Any>) -> f64 {
    let keys = keys(n);
    let key_bytes: usize = keys.iter().map(String::len).sum();
    let before = LIVE.load(Ordering::Relaxed);
    let kept = fill(&keys);
    let after = LIVE.load(Ordering::Relaxed);
    drop(kept);
    ((after - before) as f64 - key_bytes as f64) / n as f64
}

fn main() {
    println!("| scenario | tollgate ns/op | governor ns/op | ratio (tollgate / governor) |");
    println!("|---|---:|---:|---:|");
    let mut missing = false;
    for s in SCENARIOS {
        match (mean_ns(s, "tollgate"), mean_ns(s, "governor")) {
            (Some(t), Some(g)) => println!("| {s} | {t:.1} | {g:.1} | {:.2}x |", t / g),
            _ => {
                missing = true;
                println!("| {s} | – | – | not measured |");
            }
        }
    }
    if missing {
        println!(
            "\n(run `cargo bench -p tollgate-bench` first: scenarios without results are marked)"
        );
    }
    let n = 100_000;
    let t = bytes_per_key(n, |keys| {
        let t = tollgate();
        for k in keys {
            t.limit(Limit::PerUser, k.as_str()).unwrap();
        }
        assert_eq!(t.store().len(), n);
        Box::new(t)
    });
    let g = bytes_per_key(n, |keys| {
        let g = governor_keyed();
        for k in keys {
            let _ = g.check_key(k);
        }
        assert_eq!(g.len(), n);
        Box::new(g)
    });
    println!();
    println!("| memory at {n} live String keys | bytes per key beyond the key's own bytes |");
    println!("|---|---:|");
    println!("| tollgate | {t:.1} |");
    println!("| governor | {g:.1} |");
    if std::env::args().any(|a| a == "--no-rounds") {
        return;
    }
    println!();
    println!("Interleaved rounds ({ROUNDS} per scenario; ns/op tollgate / governor, ratio):");
    println!();
    rounds();
}

const ROUNDS: usize = 9;

/// Runs both sides of a one-thread scenario, `n` calls a round, in alternating rounds;
/// prints each round and the median ratio.
fn interleave(name: &str, n: usize, mut ours: impl FnMut(usize), mut theirs: impl FnMut(usize)) {
    interleave_timed(name, || ns_per_call(n, &mut ours), || ns_per_call(n, &mut theirs));
}

/// The same for sides that time themselves (ns/op).
fn interleave_timed(name: &str, ours: impl FnMut() -> f64, theirs: impl FnMut() -> f64) {
    let mut line = String::new();
    let median = alternate(ROUNDS, theirs, ours, |g, t| {
        line.push_str(&format!(" {t:.0}/{g:.0} ({:.2}x)", t / g));
    });
    println!("- {name}: median {median:.2}x;{line}");
}

fn rounds() {
    let t = tollgate();
    let gov = governor_keyed();
    let key = String::from(USER);
    interleave(
        "one_key_one_thread",
        2_000_000,
        |_| {
            black_box(t.limit(Limit::PerUser, black_box(USER)).unwrap());
        },
        |_| {
            black_box(gov.check_key(black_box(&key)).is_ok());
        },
    );

    let keys = ManyKeys::new(100_000);
    let (t, gov) = keys.filled();
    interleave(
        "100k_string_keys",
        1_000_000,
        |i| {
            black_box(t.limit(Limit::PerUser, keys.at(i).as_str()).unwrap());
        },
        |i| {
            black_box(gov.check_key(keys.at(i)).is_ok());
        },
    );

    // Wall time over all calls of both threads, as in the criterion scenario.
    let (t, gov) = (tollgate(), governor_keyed());
    let calls = 2_000_000;
    interleave_timed(
        "one_key_two_threads",
        || {
            let ours = || {
                black_box(t.limit(Limit::PerUser, black_box(USER)).unwrap());
            };
            ns_per_call_on_two_threads(calls, &ours)
        },
        || {
            let theirs = || {
                black_box(gov.check_key(black_box(&key)).is_ok());
            };
            ns_per_call_on_two_threads(calls, &theirs)
        },
    );

    let (t, gov) = (tollgate(), GovernorThree::new());
    interleave(
        "transaction_of_3",
        1_000_000,
        |_| {
            black_box(t.transaction(&transaction_calls()).unwrap().ok);
        },
        |_| {
            black_box(gov.check());
        },
    );

    // Not a target: the same three limits as three separate `limit` calls (not atomic), the
    // work a transaction of three does at the least, against the same three checks.
    let t = tollgate();
    interleave(
        "three_limits (extra, not a target)",
        1_000_000,
        |_| {
            black_box(three_limits(&t));
        },
        |_| {
            black_box(gov.check());
        },
    );
}
