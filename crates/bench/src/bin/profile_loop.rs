//! A plain loop of one operation, for profilers (`valgrind --tool=callgrind`) and quick
//! timing: `cargo run --profile profiling -p tollgate-bench --bin profile_loop [ITERATIONS] [parts|one|one_async|two|global|runtime_config|tx|tx_async|tx1|tx2|txrefused|limit3|governor|govtwo|govtx|keys|govkeys|keybytes]`.
use std::hint::black_box;

use tollgate::{Config, MemoryStore, RateLimiter, Request, SECOND, Target};
use tollgate_bench::{
    GovernorThree, Limit, ManyKeys, TEAM, USER, ns_per_call, ns_per_call_on_two_threads,
    three_limits, tollgate, transaction_calls,
};

fn main() {
    let n: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(200_000);
    let mode = std::env::args().nth(2);
    let t = tollgate();
    let per = match mode.as_deref() {
        Some("parts") => return parts(n),
        // The transaction of three, as in the criterion scenario; `tx1`, `tx2`: its first one
        // or two calls, to tell a transaction's fixed cost from its cost per take.
        Some(m @ ("tx" | "tx3" | "tx2" | "tx1")) => {
            let k = match m {
                "tx1" => 1,
                "tx2" => 2,
                _ => 3,
            };
            ns_per_call(n, |_| {
                black_box(t.transaction(&transaction_calls()[..k]).unwrap().ok);
            })
        }
        // The transaction of three refused: its third limit (one token an hour) is spent
        // after the first call, so every later call is refused, as under overload.
        Some("txrefused") => {
            let spent = Config::token_bucket(1.0, tollgate::HOUR).with_capacity(1.0);
            let mut refused = 0usize;
            let per = ns_per_call(n, |_| {
                let [user, team, _] = transaction_calls();
                let calls = [user, team, Target::Inline("spent", spent).with(Request::new())];
                refused += usize::from(!t.transaction(&calls).unwrap().ok);
            });
            assert!(refused + 1 >= n, "refused {refused} of {n}");
            per
        }
        // The transaction's three limits as three separate `limit`s (not atomic): the work a
        // transaction of three cannot do without.
        Some("limit3") => ns_per_call(n, |_| {
            black_box(three_limits(&t));
        }),
        // governor's side of the transaction scenario: its three checks.
        Some("govtx") => {
            let gov = GovernorThree::new();
            ns_per_call(n, |_| {
                black_box(gov.check());
            })
        }
        // The one-key `limit` with its config hidden from the compiler, as a transaction's
        // configs are (they arrive in a slice): what folding a typed limit's constant saves.
        Some("runtime_config") => {
            let config = tollgate::Limits::config(Limit::PerUser);
            ns_per_call(n, |_| {
                let target = ("perUser", black_box(config));
                let _ = black_box(t.limit(target, black_box(USER)));
            })
        }
        // governor's keyed check on one key, for the same instruction count.
        Some("governor") => {
            let gov = tollgate_bench::governor_keyed();
            let key = String::from(USER);
            ns_per_call(n, |_| {
                let _ = black_box(gov.check_key(black_box(&key)).is_ok());
            })
        }
        // One key shared by two threads, as in the criterion scenario: wall time over all the
        // calls of both, so a lock that the two threads pass back and forth shows here.
        Some("two") => ns_per_call_on_two_threads(n as u64, &|| {
            let _ = black_box(t.limit(Limit::PerUser, black_box(USER)));
        }),
        Some("govtwo") => {
            let gov = tollgate_bench::governor_keyed();
            let key = String::from(USER);
            ns_per_call_on_two_threads(n as u64, &|| {
                let _ = black_box(gov.check_key(black_box(&key)).is_ok());
            })
        }
        // The one-key `limit` and the transaction of three through the async API, each
        // future polled once (on the memory store it is ready at once).
        Some("one_async") => ns_per_call(n, |_| {
            let _ =
                black_box(tollgate_bench::ready(t.limit_async(Limit::PerUser, black_box(USER))));
        }),
        Some("tx_async") => ns_per_call(n, |_| {
            let calls = transaction_calls();
            black_box(tollgate_bench::ready(t.transaction_async(&calls)).unwrap().ok);
        }),
        // The typed unkeyed `limit`.
        Some("global") => ns_per_call(n, |_| {
            let _ = black_box(t.limit(Limit::Global, tollgate::Request::new()));
        }),
        // The 100k-key scenario, one library at a time, for `perf`: where a call waits.
        Some(m @ ("keys" | "govkeys")) => {
            let keys = ManyKeys::new(100_000);
            let (t, gov) = keys.filled();
            if m == "keys" {
                ns_per_call(n, |i| {
                    let _ = black_box(t.limit(Limit::PerUser, keys.at(i).as_str()));
                })
            } else {
                ns_per_call(n, |i| {
                    black_box(gov.check_key(keys.at(i)).is_ok());
                })
            }
        }
        // The same keys only read and hashed (with foldhash, the memory store's hasher, over
        // the key alone), with no limiter: the benchmark's own share of the 100k-key scenario
        // when nothing else is in the way.
        Some("keybytes") => {
            use std::hash::BuildHasher;
            let keys = ManyKeys::new(100_000);
            let hasher = foldhash::fast::RandomState::default();
            ns_per_call(n, |i| {
                black_box(hasher.hash_one(keys.at(i).as_str()));
            })
        }
        // Only the typed one-key `limit`, for instruction counts per call.
        Some("one") => ns_per_call(n, |_| {
            let _ = black_box(t.limit(Limit::PerUser, black_box(USER)));
        }),
        _ => return several(&t, n),
    };
    println!("{}: {per:.1} ns/op", mode.as_deref().unwrap_or_default());
}

/// With no mode: `limit` and `check` on one key, and `limit` on a manual clock.
fn several(t: &RateLimiter<MemoryStore>, n: usize) {
    let mut ok = 0usize;
    let per = ns_per_call(n, |_| {
        ok += usize::from(t.limit(Limit::PerUser, black_box(USER)).unwrap().ok);
    });
    println!("limit, one key: {per:.1} ns/op ({ok} admitted)");
    let manual = RateLimiter::new(MemoryStore::with_clock(tollgate::ManualClock::new(0.0)));
    let c = Config::token_bucket(1.0, SECOND).with_capacity(4e9);
    let per = ns_per_call(n, |_| {
        ok += usize::from(manual.limit(("x", c), black_box(USER)).unwrap().ok);
    });
    println!("limit, one key, manual clock: {per:.1} ns/op");
    let per = ns_per_call(n, |_| {
        ok += usize::from(t.check(Limit::PerUser, black_box(USER)).unwrap().ok);
    });
    println!("check, one key: {per:.1} ns/op ({ok} granted in all)");
}

fn parts(n: usize) {
    use tollgate::Store;
    use tollgate::core::{OneTake, Take};
    let store = MemoryStore::new();
    let config = tollgate::Limits::config(Limit::PerUser);
    let take = Take { name: "perUser", key: Some(USER), config, count: 1.0, reserve: false };
    let one = OneTake::new(&take, 0, true).unwrap();
    let per = ns_per_call(n, |_| {
        black_box(store.execute_one(black_box(&one)).unwrap());
    });
    println!("store.execute_one alone: {per:.1} ns/op");
    let names = ["perUser", "perTeam", "global"];
    let keys = [Some(USER), Some(TEAM), None];
    let takes: Vec<OneTake<'_>> = (0..3)
        .map(|i| {
            let take = Take { name: names[i], key: keys[i], config, count: 1.0, reserve: false };
            OneTake::new(&take, 0, true).unwrap()
        })
        .collect();
    let unset = tollgate::core::Taken { decision: Default::default(), status: Default::default() };
    for k in 1..=3 {
        let mut answers = [unset; 4];
        let per = ns_per_call(n, |_| {
            store.execute_each(black_box(&takes[..k]), &mut answers).unwrap();
            black_box(&answers);
        });
        println!("store.execute_each of {k} alone: {per:.1} ns/op");
    }
    let per = ns_per_call(n, |_| {
        black_box(OneTake::new(black_box(&take), 0, true).unwrap());
    });
    println!("OneTake::new alone: {per:.1} ns/op");
    let per = ns_per_call(n, |_| {
        let take = black_box(&take);
        black_box(store.execute_one(&OneTake::new(take, 0, true).unwrap()).unwrap());
    });
    println!("OneTake::new + store.execute_one: {per:.1} ns/op");
    let clock = tollgate::SystemClock;
    let per = ns_per_call(n, |_| {
        black_box(tollgate::Clock::now(&clock));
    });
    println!("SystemClock::now alone: {per:.1} ns/op");
}
