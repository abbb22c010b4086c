//! tollgate's SQL stores against the plainest write of the same database through the same
//! client, in one run; every measurement bounded by time, loopback only.
//!
//! - PostgreSQL: `limit` vs a prepared one-row `UPDATE ... SET n = n + 1` (autocommit), with 1 and 16
//!   connections, against `TOLLGATE_POSTGRES_URL` (default postgres://postgres@127.0.0.1/test).
//! - SQLite: `limit` vs a one-row upsert in its own transaction, one connection, on files in a
//!   temporary directory with the same settings (WAL, synchronous=NORMAL).
//!
//! `cargo run --release -p tollgate-bench --bin sql_bench [SECONDS] [postgres|sqlite] [ROUNDS] [CONNECTIONS]`
//! (default 5 s, both, 1 round; one alone keeps the other's disk traffic out of its figure).
//! The UPDATE gets a connection per thread; tollgate's store keeps its own pool: one
//! connection with one thread, and with 16 threads `CONNECTIONS` (default: the store's
//! default of 8), so that with more requests in flight than connections the waiting ones go
//! to the database together, one statement and one commit for all, in the next round trip.
//! With several rounds, PostgreSQL's two sides alternate (UPDATE, limit, limit, UPDATE, ...)
//! at each connection count, each round prints its ratio, and the median follows: on this
//! shared machine a slow spell then falls on both sides of a ratio alike.

use std::time::Duration;

use parking_lot::Mutex;
use tollgate::store::{PgStore, SqliteStore};
use tollgate::{RateLimiter, Request};
use tollgate_bench::{Limit, alternate, keys, loopback_url, throughput};

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
    let mut setup = postgres::Client::connect(url, postgres::NoTls).unwrap();
    setup
        .batch_execute(
            "DROP TABLE IF EXISTS tollgate_bench_counter;
             CREATE TABLE tollgate_bench_counter (id int PRIMARY KEY, n bigint NOT NULL);
             INSERT INTO tollgate_bench_counter SELECT g, 0 FROM generate_series(0, 9999) g;
             DROP TABLE IF EXISTS tollgate_bench_state;",
        )
        .unwrap();
    for connections in [1, 16] {
        // Each connection prepares the UPDATE once, as a careful app would (a statement sent
        // as text is prepared again on every call, a round trip of its own); tollgate's store
        // prepares its statements once per connection too.
        let clients: Vec<_> = (0..connections)
            .map(|_| {
                let mut client = postgres::Client::connect(url, postgres::NoTls).unwrap();
                let update = client
                    .prepare("UPDATE tollgate_bench_counter SET n = n + 1 WHERE id = $1")
                    .unwrap();
                Mutex::new((client, update))
            })
            .collect();
        let update = || {
            throughput(connections, duration, |t, n| {
                let id = ((t * 7919 + n) % keys.len()) as i32;
                let (client, update) = &mut *clients[t].lock();
                client.execute(&*update, &[&id]).unwrap();
            })
        };
        let mut store = PgStore::builder().table("tollgate_bench_state");
        if connections == 1 {
            store = store.connections(1);
        } else if let Some(pool) = pool {
            store = store.connections(pool);
        }
        let store = store.open(url).unwrap();
        let limiter = RateLimiter::new(store);
        let limit = || {
            throughput(connections, duration, |t, n| {
                let key = &keys[(t * 7919 + n) % keys.len()];
                assert!(limiter.limit(Limit::PerUser, Request::new().key(key)).unwrap().ok);
            })
        };
        let median = alternate(rounds, update, limit, |update, limit| {
            println!(
                "| PostgreSQL, {connections} | {update:.0} | {limit:.0} | {:.2}x |",
                limit / update
            );
        });
        if rounds > 1 {
            println!("| PostgreSQL, {connections}: median of {rounds} | | | {median:.3}x |");
        }
    }
    setup
        .batch_execute(
            "DROP TABLE tollgate_bench_counter; DROP TABLE tollgate_bench_state;
             DROP FUNCTION IF EXISTS tollgate_bench_state_takes;
             DROP FUNCTION IF EXISTS tollgate_bench_state_take;",
        )
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
    let median = alternate(rounds, upsert, limit, |upsert, limit| {
        println!("| SQLite, 1 | {upsert:.0} | {limit:.0} | {:.2}x |", limit / upsert);
    });
    if rounds > 1 {
        println!("| SQLite, 1: median of {rounds} | | | {median:.3}x |");
    }
}
