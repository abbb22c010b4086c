//! A plain loop of one operation, for profilers (`valgrind --tool=callgrind`) and quick
//! timing: `cargo run --release -p tollgate-bench --bin profile_loop [ITERATIONS] [parts|one|global|runtime_config|tx|tx1|tx2|limit3|governor|govtx]`.
use std::time::Instant;

use tollgate::{Config, MemoryStore, RateLimiter, SECOND};
use tollgate_bench::{Limit, tollgate};

fn main() {
    if std::env::args().nth(2).as_deref() == Some("parts") {
        return parts(std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(200_000));
    }
    let n: u32 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(200_000);
    let t = tollgate();
    // `tx`: the transaction of three, as in the criterion scenario; `tx1`, `tx2`: its first
    // one or two calls, to tell a transaction's fixed cost from its cost per take.
    let tx = std::env::args().nth(2).and_then(|m| match m.as_str() {
        "tx" | "tx3" => Some(3),
        "tx2" => Some(2),
        "tx1" => Some(1),
        _ => None,
    });
    if let Some(k) = tx {
        let start = Instant::now();
        for _ in 0..n {
            let calls = [
                tollgate::Target::from(Limit::PerUser).with(std::hint::black_box("user-00000001")),
                tollgate::Target::from(Limit::PerTeam).with(std::hint::black_box("team-0001")),
                tollgate::Target::from(Limit::Global).with(tollgate::Request::new()),
            ];
            let _ = std::hint::black_box(t.transaction(&calls[..k]));
        }
        let per = start.elapsed().as_nanos() as f64 / f64::from(n);
        println!("transaction of {k}: {per:.1} ns/op");
        return;
    }
    if std::env::args().nth(2).as_deref() == Some("limit3") {
        // The transaction's three limits as three separate `limit`s (not atomic): the work a
        // transaction of three cannot do without.
        let start = Instant::now();
        for _ in 0..n {
            let a = t.limit(Limit::PerUser, std::hint::black_box("user-00000001"));
            let b = t.limit(Limit::PerTeam, std::hint::black_box("team-0001"));
            let c = t.limit(Limit::Global, tollgate::Request::new());
            let _ = std::hint::black_box((a, b, c));
        }
        let per = start.elapsed().as_nanos() as f64 / f64::from(n);
        println!("three limits: {per:.1} ns/op");
        return;
    }
    if std::env::args().nth(2).as_deref() == Some("runtime_config") {
        // The one-key `limit` with its config hidden from the compiler, as a transaction's
        // configs are (they arrive in a slice): what folding a typed limit's constant saves.
        let config = tollgate::Limits::config(Limit::PerUser);
        for _ in 0..n {
            let target = ("perUser", std::hint::black_box(config));
            let _ = std::hint::black_box(t.limit(target, std::hint::black_box("user-00000001")));
        }
        return;
    }
    if std::env::args().nth(2).as_deref() == Some("govtx") {
        // governor's side of the transaction scenario: its three checks.
        let (users, teams, global) = (
            tollgate_bench::governor_keyed(),
            tollgate_bench::governor_keyed(),
            tollgate_bench::governor_direct(),
        );
        let (user, team) = (String::from("user-00000001"), String::from("team-0001"));
        let start = Instant::now();
        for _ in 0..n {
            let ok = users.check_key(std::hint::black_box(&user)).is_ok()
                && teams.check_key(std::hint::black_box(&team)).is_ok()
                && global.check().is_ok();
            std::hint::black_box(ok);
        }
        let per = start.elapsed().as_nanos() as f64 / f64::from(n);
        println!("governor's three checks: {per:.1} ns/op");
        return;
    }
    if std::env::args().nth(2).as_deref() == Some("governor") {
        // governor's keyed check on one key, for the same instruction count.
        let gov = tollgate_bench::governor_keyed();
        let key = String::from("user-00000001");
        for _ in 0..n {
            let _ = std::hint::black_box(gov.check_key(std::hint::black_box(&key)).is_ok());
        }
        return;
    }
    if std::env::args().nth(2).as_deref() == Some("global") {
        // The typed unkeyed `limit`.
        for _ in 0..n {
            let _ = std::hint::black_box(t.limit(Limit::Global, tollgate::Request::new()));
        }
        return;
    }
    if std::env::args().nth(2).as_deref() == Some("one") {
        // Only the typed one-key `limit`, for instruction counts per call.
        for _ in 0..n {
            let _ = std::hint::black_box(
                t.limit(Limit::PerUser, std::hint::black_box("user-00000001")),
            );
        }
        return;
    }
    let start = Instant::now();
    let mut ok = 0usize;
    for _ in 0..n {
        ok +=
            usize::from(t.limit(Limit::PerUser, std::hint::black_box("user-00000001")).unwrap().ok);
    }
    let per = start.elapsed().as_nanos() as f64 / f64::from(n);
    println!("limit, one key: {per:.1} ns/op ({ok} admitted)");
    let manual = RateLimiter::new(MemoryStore::with_clock(tollgate::ManualClock::new(0.0)));
    let c = Config::token_bucket(1.0, SECOND).with_capacity(4e9);
    let start = Instant::now();
    for _ in 0..n {
        ok +=
            usize::from(manual.limit(("x", c), std::hint::black_box("user-00000001")).unwrap().ok);
    }
    let per = start.elapsed().as_nanos() as f64 / f64::from(n);
    println!("limit, one key, manual clock: {per:.1} ns/op");
    let start = Instant::now();
    for _ in 0..n {
        ok +=
            usize::from(t.check(Limit::PerUser, std::hint::black_box("user-00000001")).unwrap().ok);
    }
    let per = start.elapsed().as_nanos() as f64 / f64::from(n);
    println!("check, one key: {per:.1} ns/op ({ok} granted in all)");
}

fn parts(n: u32) {
    use tollgate::Store;
    use tollgate::core::{OneTake, Take};
    let store = MemoryStore::new();
    let config = tollgate::Limits::config(Limit::PerUser);
    let take =
        Take { name: "perUser", key: Some("user-00000001"), config, count: 1.0, reserve: false };
    let one = OneTake::new(&take, 0, true).unwrap();
    let start = Instant::now();
    for _ in 0..n {
        std::hint::black_box(store.execute_one(std::hint::black_box(&one)).unwrap());
    }
    println!(
        "store.execute_one alone: {:.1} ns/op",
        start.elapsed().as_nanos() as f64 / f64::from(n)
    );
    let start = Instant::now();
    for _ in 0..n {
        std::hint::black_box(OneTake::new(std::hint::black_box(&take), 0, true).unwrap());
    }
    println!("OneTake::new alone: {:.1} ns/op", start.elapsed().as_nanos() as f64 / f64::from(n));
    let start = Instant::now();
    for _ in 0..n {
        let take = std::hint::black_box(&take);
        std::hint::black_box(store.execute_one(&OneTake::new(take, 0, true).unwrap()).unwrap());
    }
    println!(
        "OneTake::new + store.execute_one: {:.1} ns/op",
        start.elapsed().as_nanos() as f64 / f64::from(n)
    );
    let clock = tollgate::SystemClock;
    let start = Instant::now();
    for _ in 0..n {
        std::hint::black_box(tollgate::Clock::now(&clock));
    }
    println!(
        "SystemClock::now alone: {:.1} ns/op",
        start.elapsed().as_nanos() as f64 / f64::from(n)
    );
}
