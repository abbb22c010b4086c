//! What the SQLite store adds to the conformance suite: several connections on one file,
//! states that outlive the process's store, the caller's own transactions, and concurrency
//! limits' holders in those and swept at expiry.

#![cfg(feature = "sqlite")]

use std::sync::Arc;

use rusqlite::{Connection, TransactionBehavior};
use tollgate::store::{SqliteStore, SqliteTransaction, create_schema};
use tollgate::{
    Acquire, Concurrency, Config, MINUTE, ManualClock, MemoryStore, RateLimiter, Request, Target,
};

const DAY: f64 = 24.0 * 3_600_000.0;

#[test]
fn connections_racing_on_one_file_admit_exactly_the_limit() {
    // Like several processes: each thread has its own connection to the same file.
    let dir = tempfile::tempdir().unwrap();
    let path = Arc::new(dir.path().join("race.db"));
    SqliteStore::open(&*path).unwrap();
    let limit = Target::Inline("race", Config::token_bucket(500.0, DAY));
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let path = Arc::clone(&path);
            std::thread::spawn(move || {
                let l = RateLimiter::new(SqliteStore::open(&*path).unwrap());
                (0..100).filter(|_| l.limit(limit, Request::new()).unwrap().ok).count()
            })
        })
        .collect();
    let admitted: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert_eq!(admitted, 500, "800 requests against a limit of 500");
    let l = RateLimiter::new(SqliteStore::open(&*path).unwrap());
    assert!(!l.limit(limit, Request::new()).unwrap().ok, "and nothing more");
    assert!(l.value(limit, None).unwrap().value < 1.0);
}

#[test]
fn states_outlive_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("restart.db");
    let clock = ManualClock::new(1_700_000_000_000.0);
    let limit = Target::Inline("r", Config::token_bucket(10.0, MINUTE));
    {
        let l =
            RateLimiter::new(SqliteStore::builder().open_with_clock(&path, clock.clone()).unwrap());
        l.limit(limit, Request::new().key("k").count(7.0)).unwrap();
    }
    let l = RateLimiter::new(SqliteStore::builder().open_with_clock(&path, clock).unwrap());
    assert_eq!(l.value(limit, Some("k")).unwrap().value, 3.0);
    assert!(!l.limit(limit, Request::new().key("k").count(4.0)).unwrap().ok);
}

#[test]
fn a_rolled_back_transaction_gives_the_tokens_back() {
    let mut conn = Connection::open_in_memory().unwrap();
    create_schema(&conn).unwrap();
    let clock = ManualClock::new(1_700_000_000_000.0);
    let limiter = RateLimiter::new(MemoryStore::new());
    let limit = Target::Inline("orders", Config::token_bucket(10.0, MINUTE));
    let value = |conn: &Connection| {
        limiter
            .on(SqliteTransaction::with_clock(conn, clock.clone()))
            .value(limit, Some("u"))
            .unwrap()
            .value
    };

    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).unwrap();
    let in_tx = limiter.on(SqliteTransaction::with_clock(&tx, clock.clone()));
    assert!(in_tx.limit(limit, Request::new().key("u").count(4.0)).unwrap().ok);
    assert_eq!(in_tx.value(limit, Some("u")).unwrap().value, 6.0, "visible inside");
    tx.rollback().unwrap();
    assert_eq!(value(&conn), 10.0, "rolled back: unchanged");

    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).unwrap();
    let in_tx = limiter.on(SqliteTransaction::with_clock(&tx, clock.clone()));
    assert!(in_tx.limit(limit, Request::new().key("u").count(4.0)).unwrap().ok);
    tx.commit().unwrap();
    assert_eq!(value(&conn), 6.0, "committed: spent");
}

/// `keys_of` lists a name's states; a state carried to a slower refill gets its new
/// `full_at`, so the sweep by `full_at` keeps it until it is full under the new config.
#[test]
fn keys_of_and_a_carried_state_outliving_its_old_full_at() {
    let clock = tollgate::ManualClock::new(1_700_000_000_000.0);
    let store = SqliteStore::builder().open_in_memory_with_clock(clock.clone()).unwrap();
    let limiter = RateLimiter::new(store);
    let fast = Config::token_bucket(10.0, tollgate::SECOND);
    let slow = Config::token_bucket(10.0, 100.0 * tollgate::SECOND);
    assert!(limiter.limit(("a", fast), Request::new().key("k").count(10.0)).unwrap().ok);
    assert!(limiter.limit(("a", fast), Request::new().count(1.0)).unwrap().ok);
    assert!(limiter.limit(("ab", fast), "k").unwrap().ok);
    let mut keys = limiter.store().keys_of("a").unwrap();
    keys.sort();
    assert_eq!(keys, [(None, 0), (Some("k".to_owned()), 0)]);
    assert_eq!(limiter.carry("a", Some("k"), &fast, &slow).unwrap(), 1);
    clock.advance(5.0 * tollgate::SECOND);
    assert_eq!(limiter.store().sweep_full().unwrap(), 2);
    assert_eq!(limiter.store().keys_of("a").unwrap(), [(Some("k".to_owned()), 0)]);
    clock.advance(101.0 * tollgate::SECOND);
    assert_eq!(limiter.store().sweep_full().unwrap(), 1);
}

/// Concurrency limits in a caller's transaction: an acquire rolled back holds nothing, one
/// committed holds its slot. A ticket is never made twice, not even once the newest holder
/// is gone (a late release of an expired ticket must not free another's slots); and
/// `sweep_full` deletes the holders past their expiry that nobody touches again.
#[test]
fn slots_in_a_transaction_fresh_tickets_and_the_sweep() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("slots.db");
    let clock = ManualClock::new(1_700_000_000_000.0);
    let store = SqliteStore::builder().open_with_clock(&path, clock.clone()).unwrap();
    let limiter = RateLimiter::new(store);
    let gpu = ("gpu", Concurrency::new(2).with_ttl(MINUTE));
    let mut conn = Connection::open(&path).unwrap();

    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).unwrap();
    let in_tx = limiter.on(SqliteTransaction::with_clock(&tx, clock.clone()));
    assert!(in_tx.acquire(gpu, Acquire::new().key("u").count(2)).unwrap().ok());
    assert_eq!(in_tx.slots_value(gpu, Some("u")).unwrap().in_flight, 2, "held inside");
    drop(in_tx);
    tx.rollback().unwrap();
    assert_eq!(limiter.slots_value(gpu, Some("u")).unwrap().in_flight, 0, "rolled back");

    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).unwrap();
    let in_tx = limiter.on(SqliteTransaction::with_clock(&tx, clock.clone()));
    let first = in_tx.acquire(gpu, "u").unwrap().ticket().expect("a slot is free");
    drop(in_tx);
    tx.commit().unwrap();
    assert_eq!(limiter.slots_value(gpu, Some("u")).unwrap().in_flight, 1, "committed");
    assert!(limiter.release(gpu, Some("u"), first.id).unwrap());
    let second = limiter.acquire(gpu, "u").unwrap().ticket().expect("a slot is free");
    assert_ne!(second.id, first.id, "a fresh ticket");
    assert!(!limiter.release(gpu, Some("u"), first.id).unwrap(), "the old one frees nothing");

    // Another key's holder, never touched again; both expire a minute on.
    assert!(limiter.acquire(gpu, "v").unwrap().ok());
    clock.advance(MINUTE);
    assert_eq!(limiter.store().sweep_full().unwrap(), 2);
    assert_eq!(limiter.store().sweep_full().unwrap(), 0);
    let third = limiter.acquire(gpu, "v").unwrap().ticket().expect("expired: free");
    assert!(third.id > second.id, "tickets go on from the last one made");
}
