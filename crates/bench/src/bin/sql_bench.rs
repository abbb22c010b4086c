//! tollgate's SQL stores against the plainest write of the same database through the same
//! client, in one run; every measurement bounded by time, loopback only.
//!
//! - PostgreSQL: `limit_async` vs a prepared one-row `UPDATE ... SET n = n + 1` (autocommit),
//!   both on tokio-postgres, with 1 and 16 requests in flight (tasks of a runtime with two
//!   threads), against `TOLLGATE_POSTGRES_URL` (default postgres://postgres@127.0.0.1/test).
//!   The UPDATE goes out on as many connections as requests in flight, up to 4, round robin
//!   (pipelined on each); the store keeps its own (`CONNECTIONS`, default 4), whose one-takes
//!   that wait go together, one statement and one commit for all.
//! - SQLite: `limit` (sync, on the calling thread) vs a one-row upsert in its own
//!   transaction, one thread; then `limit_async` with 32 requests in flight, which the
//!   store's writer thread commits together. Files in a temporary directory, the same
//!   settings (WAL, synchronous=NORMAL).
//!
//! `cargo run --release -p tollgate-bench --bin sql_bench [SECONDS] [postgres|sqlite] [ROUNDS] [CONNECTIONS]`
//! (default 5 s, both, 1 round; one alone keeps the other's disk traffic out of its figure).
//! With several rounds the two sides alternate (plain, limit, limit, plain, ...), each round
//! prints its ratio, and the median follows: on this shared machine a slow spell then falls
//! on both sides of a ratio alike.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tollgate::store::{PgStore, SqliteStore};
use tollgate::{RateLimiter, Request};
use tollgate_bench::{Limit, alternate, async_throughput, keys, loopback_url, throughput};

fn main() {
    let secs: u64 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(5);
    let duration = Duration::from_secs(secs);
    let keys = keys(10_000);
    let url = loopback_url("TOLLGATE_POSTGRES_URL", "postgres://postgres@127.0.0.1/test");

    let only = std::env::args().nth(2);
    let rounds: usize = std::env::args().nth(3).and_then(|a| a.parse().ok()).unwrap_or(1).max(1);
    let pool: Option<usize> = std::env::args().nth(4).and_then(|a| a.parse().ok());
    println!("| database, connections | plain write ops/s | tollgate limit ops/s | ratio |");
    println!("|---|---:|---:|---:|");
    if only.as_deref() != Some("sqlite") {
        postgres(&url, duration, &keys, rounds, pool);
    }
    if only.as_deref() != Some("postgres") {
        sqlite(duration, &keys, rounds);
    }
}

fn postgres(url: &str, duration: Duration, keys: &[String], rounds: usize, pool: Option<usize>) {
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let connect = || async {
        let (client, connection) =
            tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(connection);
        client
    };
    let setup = runtime.block_on(connect());
    runtime
        .block_on(setup.batch_execute(
            "DROP TABLE IF EXISTS tollgate_bench_counter;
             CREATE TABLE tollgate_bench_counter (id int PRIMARY KEY, n bigint NOT NULL);
             INSERT INTO tollgate_bench_counter SELECT g, 0 FROM generate_series(0, 9999) g;
             DROP TABLE IF EXISTS tollgate_bench_state;",
        ))
        .unwrap();
    let keys: Arc<[String]> = keys.into();
    for in_flight in [1, 16] {
        // Each connection prepares the UPDATE once, as a careful app would (a statement sent
        // as text is prepared again on every call, a round trip of its own); tollgate's store
        // prepares its statements once per connection too.
        let clients: Arc<Vec<_>> = Arc::new(runtime.block_on(async {
            let mut clients = Vec::new();
            for _ in 0..in_flight.min(4) {
                let client = connect().await;
                let update = client
                    .prepare("UPDATE tollgate_bench_counter SET n = n + 1 WHERE id = $1")
                    .await
                    .unwrap();
                clients.push((client, update));
            }
            clients
        }));
        let update = || {
            let (clients, n_keys) = (Arc::clone(&clients), keys.len());
            async_throughput(&runtime, in_flight, duration, move |t, n| {
                let clients = Arc::clone(&clients);
                async move {
                    let id = ((t * 7919 + n) % n_keys) as i32;
                    let (client, update) = &clients[(t + n) % clients.len()];
                    client.execute(update, &[&id]).await.unwrap();
                }
            })
        };
        let mut store = PgStore::builder().table("tollgate_bench_state");
        if in_flight == 1 {
            store = store.connections(1);
        } else if let Some(pool) = pool {
            store = store.connections(pool);
        }
        let limiter = Arc::new(RateLimiter::new(runtime.block_on(store.open(url)).unwrap()));
        let limit = || {
            let (limiter, keys) = (Arc::clone(&limiter), Arc::clone(&keys));
            async_throughput(&runtime, in_flight, duration, move |t, n| {
                let (limiter, keys) = (Arc::clone(&limiter), Arc::clone(&keys));
                async move {
                    let key = &keys[(t * 7919 + n) % keys.len()];
                    let decision = limiter.limit_async(Limit::PerUser, Request::new().key(key));
                    assert!(decision.await.unwrap().ok);
                }
            })
        };
        let median = alternate(rounds, update, limit, |update, limit| {
            println!(
                "| PostgreSQL, {in_flight} in flight | {update:.0} | {limit:.0} | {:.2}x |",
                limit / update
            );
        });
        if rounds > 1 {
            println!("| PostgreSQL, {in_flight}: median of {rounds} | | | {median:.3}x |");
        }
    }
    runtime
        .block_on(setup.batch_execute(
            "DROP TABLE tollgate_bench_counter; DROP TABLE tollgate_bench_state;
             DROP FUNCTION IF EXISTS tollgate_bench_state_takes;
             DROP FUNCTION IF EXISTS tollgate_bench_state_take;",
        ))
        .unwrap();
}

fn sqlite(duration: Duration, keys: &[String], rounds: usize) {
    let dir = tempfile::tempdir().unwrap();
    let conn = rusqlite::Connection::open(dir.path().join("plain.db")).unwrap();
    conn.query_row("PRAGMA journal_mode = WAL", [], |_| Ok(())).unwrap();
    conn.execute_batch("PRAGMA synchronous = NORMAL; CREATE TABLE counter (id INTEGER PRIMARY KEY, n INTEGER NOT NULL);").unwrap();
    let conn = Mutex::new(conn);
    let upsert = || {
        throughput(1, duration, |_, n| {
            let mut conn = conn.lock();
            let tx =
                conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate).unwrap();
            tx.execute(
                "INSERT INTO counter (id, n) VALUES (?1, 1) ON CONFLICT (id) DO UPDATE SET n = n + 1",
                [(n % keys.len()) as i64],
            )
            .unwrap();
            tx.commit().unwrap();
        })
    };
    let limiter = RateLimiter::new(SqliteStore::open(dir.path().join("tollgate.db")).unwrap());
    let limit = || {
        throughput(1, duration, |_, n| {
            let key = &keys[n % keys.len()];
            assert!(limiter.limit(Limit::PerUser, Request::new().key(key)).unwrap().ok);
        })
    };
    let median = alternate(rounds, &upsert, limit, |upsert, limit| {
        println!("| SQLite, 1 thread, sync | {upsert:.0} | {limit:.0} | {:.2}x |", limit / upsert);
    });
    if rounds > 1 {
        println!("| SQLite, 1 thread, sync: median of {rounds} | | | {median:.3}x |");
    }
    // The async calls: 32 in flight, committed together by the store's writer thread.
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let limiter = Arc::new(limiter);
    let keys: Arc<[String]> = keys.into();
    let limit_async = || {
        let (limiter, keys) = (Arc::clone(&limiter), Arc::clone(&keys));
        async_throughput(&runtime, 32, duration, move |t, n| {
            let (limiter, keys) = (Arc::clone(&limiter), Arc::clone(&keys));
            async move {
                let key = &keys[(t * 7919 + n) % keys.len()];
                let decision = limiter.limit_async(Limit::PerUser, Request::new().key(key));
                assert!(decision.await.unwrap().ok);
            }
        })
    };
    let median = alternate(rounds, &upsert, limit_async, |upsert, limit| {
        println!(
            "| SQLite, 32 in flight, async | {upsert:.0} | {limit:.0} | {:.2}x |",
            limit / upsert
        );
    });
    if rounds > 1 {
        println!("| SQLite, 32 in flight, async: median of {rounds} | | | {median:.3}x |");
    }
}
