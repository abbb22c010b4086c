//! What the Postgres store adds to the conformance suite: the caller's own transaction.

#![cfg(feature = "postgres")]

use postgres::{Client, NoTls};
use tollgate::store::{PgStore, PgTransaction};
use tollgate::{Config, MINUTE, ManualClock, MemoryStore, RateLimiter, Request, Target};

mod common;

fn url() -> Option<String> {
    common::backend_url("TOLLGATE_POSTGRES_URL", "postgres://postgres@127.0.0.1/test")
}

#[test]
fn a_rolled_back_transaction_gives_the_tokens_back() {
    let Some(url) = url() else { return };
    let guard = common::DropTable::new(&url, "tollgate_tx");
    let table = guard.table.clone();
    let clock = ManualClock::new(1_700_000_000_000.0);
    // Opening a store creates the table.
    drop(PgStore::builder().table(&table).open_with_clock(&url, clock.clone()).unwrap());
    let limiter = RateLimiter::new(MemoryStore::new()); // only its definitions are reused
    let limit = Target::Inline("orders", Config::token_bucket(10.0, MINUTE));
    let mut client = Client::connect(&url, NoTls).unwrap();
    let value = |client: &mut Client| {
        let mut tx = client.transaction().unwrap();
        let store = PgTransaction::with_table_and_clock(&mut tx, &table, clock.clone()).unwrap();
        limiter.on(store).value(limit, Some("u")).unwrap().value
    };

    let mut tx = client.transaction().unwrap();
    {
        let in_tx = limiter
            .on(PgTransaction::with_table_and_clock(&mut tx, &table, clock.clone()).unwrap());
        assert!(in_tx.limit(limit, Request::new().key("u").count(4.0)).unwrap().ok);
        assert_eq!(in_tx.value(limit, Some("u")).unwrap().value, 6.0, "visible inside");
    }
    tx.rollback().unwrap();
    assert_eq!(value(&mut client), 10.0, "rolled back: unchanged");

    let mut tx = client.transaction().unwrap();
    {
        let in_tx = limiter
            .on(PgTransaction::with_table_and_clock(&mut tx, &table, clock.clone()).unwrap());
        assert!(in_tx.limit(limit, Request::new().key("u").count(4.0)).unwrap().ok);
    }
    tx.commit().unwrap();
    assert_eq!(value(&mut client), 6.0, "committed: spent");
}

/// A request waits for the slot's advisory lock, held by a transaction that has taken from
/// the same limit and not committed yet: it never decides on the state that transaction is
/// about to replace. (A check writes nothing, so only the lock can make it wait.)
#[test]
fn a_request_waits_for_a_transaction_holding_its_slot() {
    let Some(url) = url() else { return };
    let guard = common::DropTable::new(&url, "tollgate_wait");
    // Short enough to wait out below, long enough for opening the store to wait for another
    // test opening its own (both create their tables under one advisory lock): 300 ms was
    // not, once, in CI.
    let store = PgStore::builder()
        .table(&guard.table)
        .timeout(std::time::Duration::from_secs(2))
        .open(&url)
        .unwrap();
    let limiter = RateLimiter::new(store);
    let limit = Target::Inline("orders", Config::token_bucket(10.0, 60.0 * MINUTE));
    let mut client = Client::connect(&url, NoTls).unwrap();
    let mut tx = client.transaction().unwrap();
    let in_tx = limiter.on(PgTransaction::with_table_and_clock(
        &mut tx,
        &guard.table,
        tollgate::SystemClock,
    )
    .unwrap());
    assert!(in_tx.limit(limit, Request::new().key("u").count(8.0)).unwrap().ok);

    // Held: the store's request gives up after its lock timeout (fail closed), rather than
    // granting 8 from the 10 it would read.
    let waited = limiter.check(limit, Request::new().key("u").count(8.0));
    assert!(matches!(waited, Err(tollgate::Error::Store(_))), "{waited:?}");
    drop(in_tx);
    tx.commit().unwrap();
    // Released: it sees the committed take.
    assert!(!limiter.check(limit, Request::new().key("u").count(8.0)).unwrap().ok);
    assert!(limiter.check(limit, Request::new().key("u").count(2.0)).unwrap().ok);
}

/// In a caller's transaction on a database without the table, the error says how to make it.
#[test]
fn a_missing_table_is_an_error_that_says_what_to_do() {
    let Some(url) = url() else { return };
    let guard = common::DropTable::new(&url, "tollgate_missing");
    let mut client = Client::connect(&url, NoTls).unwrap();
    let mut tx = client.transaction().unwrap();
    let store =
        PgTransaction::with_table_and_clock(&mut tx, &guard.table, tollgate::SystemClock).unwrap();
    let limit = Target::Inline("orders", Config::token_bucket(10.0, MINUTE));
    let err = RateLimiter::new(store).limit(limit, "u").unwrap_err();
    assert!(err.to_string().contains("opening a PgStore"), "{err}");
}
