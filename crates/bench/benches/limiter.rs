//! tollgate's memory store against governor, on the calls a user makes, in one run.
//!
//! `cargo bench -p tollgate-bench`, then `cargo run -p tollgate-bench --bin report` for the
//! table of BENCHMARKS.md.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use tollgate::Request;
use tollgate_bench::{
    GovernorThree, Limit, ManyKeys, USER, governor_direct, governor_keyed, ready, tollgate,
    transaction_calls, two_threads,
};

fn one_key_one_thread(c: &mut Criterion) {
    let mut g = c.benchmark_group("one_key_one_thread");
    let t = tollgate();
    g.bench_function("tollgate", |b| b.iter(|| t.limit(Limit::PerUser, black_box(USER)).unwrap()));
    let gov = governor_keyed();
    let key = String::from(USER);
    g.bench_function("governor", |b| b.iter(|| gov.check_key(black_box(&key)).is_ok()));
    g.finish();
}

fn global_one_thread(c: &mut Criterion) {
    // tollgate's unkeyed limit against governor's direct limiter (which has no map at all).
    let mut g = c.benchmark_group("global_one_thread");
    let t = tollgate();
    g.bench_function("tollgate", |b| b.iter(|| t.limit(Limit::Global, Request::new()).unwrap()));
    let gov = governor_direct();
    g.bench_function("governor", |b| b.iter(|| gov.check().is_ok()));
    g.finish();
}

fn many_keys(c: &mut Criterion) {
    // 100k distinct String keys, visited in a fixed shuffled order: every call hits a live key
    // in a table far larger than the CPU caches' share per key.
    let keys = ManyKeys::new(100_000);
    let (t, gov) = keys.filled();
    let mut g = c.benchmark_group("100k_string_keys");
    let mut i = 0;
    g.bench_function("tollgate", |b| {
        b.iter(|| {
            i += 1;
            t.limit(Limit::PerUser, keys.at(i).as_str()).unwrap()
        })
    });
    let mut i = 0;
    g.bench_function("governor", |b| {
        b.iter(|| {
            i += 1;
            gov.check_key(keys.at(i)).is_ok()
        })
    });
    g.finish();
}

fn one_key_two_threads(c: &mut Criterion) {
    let mut g = c.benchmark_group("one_key_two_threads");
    let t = tollgate();
    g.bench_function("tollgate", |b| {
        b.iter_custom(|iters| {
            two_threads(iters, &|| {
                black_box(t.limit(Limit::PerUser, black_box(USER)).unwrap());
            })
        })
    });
    let gov = governor_keyed();
    let key = String::from(USER);
    g.bench_function("governor", |b| {
        b.iter_custom(|iters| {
            two_threads(iters, &|| {
                black_box(gov.check_key(black_box(&key)).is_ok());
            })
        })
    });
    g.finish();
}

fn transaction_of_three(c: &mut Criterion) {
    // tollgate takes three limits all or nothing; governor has no transaction (see
    // `GovernorThree`).
    let mut g = c.benchmark_group("transaction_of_3");
    let t = tollgate();
    g.bench_function("tollgate", |b| b.iter(|| t.transaction(&transaction_calls()).unwrap().ok));
    let gov = GovernorThree::new();
    g.bench_function("governor", |b| b.iter(|| gov.check()));
    g.finish();
}

fn async_on_memory(c: &mut Criterion) {
    // The memory store through the async API against the sync one: each future polled once
    // with a no-op waker (it is ready at once), so no runtime's cost is in the figure.
    let t = tollgate();
    let mut g = c.benchmark_group("async_one_key");
    g.bench_function("sync", |b| b.iter(|| t.limit(Limit::PerUser, black_box(USER)).unwrap()));
    g.bench_function("async", |b| {
        b.iter(|| ready(t.limit_async(Limit::PerUser, black_box(USER))).unwrap())
    });
    g.finish();
    let mut g = c.benchmark_group("async_transaction_of_three");
    g.bench_function("sync", |b| b.iter(|| t.transaction(&transaction_calls()).unwrap().ok));
    g.bench_function("async", |b| {
        b.iter(|| ready(t.transaction_async(&transaction_calls())).unwrap().ok)
    });
    g.finish();
}

fn async_on_a_store_picked_at_run_time(c: &mut Criterion) {
    // The memory store behind `Arc<dyn AsyncStore>`, as the server holds its store: the
    // async API against the sync one on the same store, each future polled once.
    let t = tollgate();
    let store: std::sync::Arc<dyn tollgate::AsyncStore> =
        std::sync::Arc::new(tollgate::MemoryStore::new());
    let d = tollgate::RateLimiter::new(store);
    let mut g = c.benchmark_group("dyn_store_one_key");
    g.bench_function("sync", |b| b.iter(|| t.limit(Limit::PerUser, black_box(USER)).unwrap()));
    g.bench_function("async", |b| {
        b.iter(|| ready(d.limit_async(Limit::PerUser, black_box(USER))).unwrap())
    });
    g.finish();
    let mut g = c.benchmark_group("dyn_store_transaction_of_three");
    g.bench_function("sync", |b| b.iter(|| t.transaction(&transaction_calls()).unwrap().ok));
    g.bench_function("async", |b| {
        b.iter(|| ready(d.transaction_async(&transaction_calls())).unwrap().ok)
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3));
    targets = one_key_one_thread, global_one_thread, many_keys, one_key_two_threads, transaction_of_three,
        async_on_memory, async_on_a_store_picked_at_run_time
}
criterion_main!(benches);
