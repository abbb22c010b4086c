//! What the Postgres store adds to the conformance suite: the caller's own transaction
//! (tokio-postgres), waiting for a slot's lock, the store opened and used inside a
//! `#[tokio::main]`-style runtime, and concurrency limits held from several stores at once
//! and in a caller's transaction.

#![cfg(feature = "postgres")]

use std::time::Duration;

use tokio_postgres::{Client, NoTls};
use tollgate::store::{PgStore, PgTransaction};
use tollgate::{
    Acquire, Acquired, Concurrency, Config, Error, MINUTE, ManualClock, MemoryStore, RateLimiter,
    Request, SlotsValue, Target,
};

mod common;

fn url() -> Option<String> {
    common::backend_url("TOLLGATE_POSTGRES_URL", "postgres://postgres@127.0.0.1/test")
}

/// The limiter's states in `tx`, in `table`, on `clock`.
fn in_tx<'t, 'c>(
    tx: &'t tokio_postgres::Transaction<'c>,
    table: &str,
    clock: &ManualClock,
) -> PgTransaction<'t, tokio_postgres::Transaction<'c>, ManualClock> {
    PgTransaction::with_table_and_clock(tx, table, clock.clone()).unwrap()
}

async fn connect(url: &str) -> Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.unwrap();
    tokio::spawn(connection);
    client
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_transaction_gives_the_tokens_back() {
    let Some(url) = url() else { return };
    let guard = common::DropTable::new(&url, "tollgate_tx");
    let table = guard.table.clone();
    let clock = ManualClock::new(1_700_000_000_000.0);
    // Opening a store creates the table.
    drop(PgStore::builder().table(&table).open_with_clock(&url, clock.clone()).await.unwrap());
    let limiter = RateLimiter::new(MemoryStore::new()); // only its definitions are reused
    let limit = Target::Inline("orders", Config::token_bucket(10.0, MINUTE));
    let transaction = Target::Inline("cart", Config::token_bucket(5.0, MINUTE));
    let mut client = connect(&url).await;

    let tx = client.transaction().await.unwrap();
    {
        let in_tx = limiter.on(in_tx(&tx, &table, &clock));
        let request = Request::new().key("u").count(4.0);
        assert!(in_tx.limit_async(limit, request).await.unwrap().ok);
        assert_eq!(in_tx.value_async(limit, Some("u")).await.unwrap().value, 6.0, "visible inside");
        // A transaction of two limits, in the same caller's transaction.
        let calls = [limit.with(Request::new().key("u")), transaction.with("u")];
        assert!(in_tx.transaction_async(&calls).await.unwrap().ok);
        assert_eq!(in_tx.value_async(limit, Some("u")).await.unwrap().value, 5.0);
    }
    tx.rollback().await.unwrap();
    // Read outside any transaction of the caller's: each statement on its own.
    let value = async |target| {
        let store = PgTransaction::with_table_and_clock(&client, &table, clock.clone()).unwrap();
        limiter.on(store).value_async(target, Some("u")).await.unwrap().value
    };
    assert_eq!(value(limit).await, 10.0, "rolled back: unchanged");
    assert_eq!(value(transaction).await, 5.0, "rolled back: unchanged");

    let mut client = connect(&url).await;
    let tx = client.transaction().await.unwrap();
    let request = Request::new().key("u").count(4.0);
    assert!(limiter.on(in_tx(&tx, &table, &clock)).limit_async(limit, request).await.unwrap().ok);
    tx.commit().await.unwrap();
    let store = PgTransaction::with_table_and_clock(&client, &table, clock.clone()).unwrap();
    let spent = limiter.on(store).value_async(limit, Some("u")).await.unwrap().value;
    assert_eq!(spent, 6.0, "committed: spent");
}

/// A request waits for the slot's advisory lock, held by a transaction that has taken from
/// the same limit and not committed yet: it never decides on the state that transaction is
/// about to replace. (A check writes nothing, so only the lock can make it wait.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_for_a_transaction_holding_its_slot() {
    let Some(url) = url() else { return };
    let guard = common::DropTable::new(&url, "tollgate_wait");
    // Short enough to wait out below, long enough for opening the store to wait for another
    // test opening its own (both create their tables under one advisory lock).
    let store = PgStore::builder()
        .table(&guard.table)
        .timeout(Duration::from_secs(2))
        .open(&url)
        .await
        .unwrap();
    let limiter = RateLimiter::new(store);
    let limit = Target::Inline("orders", Config::token_bucket(10.0, 60.0 * MINUTE));
    let mut client = connect(&url).await;
    let tx = client.transaction().await.unwrap();
    let in_tx =
        limiter
            .on(PgTransaction::with_table_and_clock(&tx, &guard.table, tollgate::SystemClock)
                .unwrap());
    assert!(in_tx.limit_async(limit, Request::new().key("u").count(8.0)).await.unwrap().ok);

    // Held: the store's request gives up after its lock timeout (fail closed), rather than
    // granting 8 from the 10 it would read.
    let waited = limiter.check_async(limit, Request::new().key("u").count(8.0)).await;
    assert!(matches!(waited, Err(Error::Store(_))), "{waited:?}");
    drop(in_tx);
    tx.commit().await.unwrap();
    // Released: it sees the committed take.
    let check = async |count| {
        limiter.check_async(limit, Request::new().key("u").count(count)).await.unwrap().ok
    };
    assert!(!check(8.0).await);
    assert!(check(2.0).await);
}

/// In a caller's transaction on a database without the table, the error says how to make it.
#[tokio::test]
async fn a_missing_table_is_an_error_that_says_what_to_do() {
    let Some(url) = url() else { return };
    let guard = common::DropTable::new(&url, "tollgate_missing");
    let mut client = connect(&url).await;
    let tx = client.transaction().await.unwrap();
    let store =
        PgTransaction::with_table_and_clock(&tx, &guard.table, tollgate::SystemClock).unwrap();
    let limit = Target::Inline("orders", Config::token_bucket(10.0, MINUTE));
    let err = RateLimiter::new(store).limit_async(limit, "u").await.unwrap_err();
    assert!(err.to_string().contains("opening a PgStore"), "{err}");
}

/// The store opened and used inside a multi-threaded runtime, as `#[tokio::main]` makes
/// (the sync `postgres` crate this store was built on before panicked here: it starts a
/// runtime of its own), with many requests in flight at once, every one answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opened_and_used_inside_a_runtime() {
    let Some(url) = url() else { return };
    let guard = common::DropTable::new(&url, "tollgate_in_runtime");
    let store = PgStore::builder().table(&guard.table).open(&url).await.unwrap();
    let limiter = std::sync::Arc::new(RateLimiter::new(store));
    // 1,000 a day: nothing flows back during the test.
    let limit = Target::Inline("main", Config::token_bucket(1_000.0, tollgate::DAY));
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let limiter = std::sync::Arc::clone(&limiter);
            tokio::spawn(async move {
                let key = format!("user{}", i % 20);
                limiter.limit_async(limit, key.as_str()).await.unwrap().ok
            })
        })
        .collect();
    for task in tasks {
        assert!(task.await.unwrap());
    }
    let left = limiter.value_async(limit, Some("user0")).await.unwrap().value;
    // (A day's rate flows back a few thousandths of a token while the test runs.)
    assert!((990.0..990.01).contains(&left), "10 taken from user0: {left}");
}

/// A statement that the database refuses (its arithmetic overflows a float) fails alone:
/// the grouped statement it was in goes again one take at a time, and the others are
/// answered. (A valid config cannot overflow: the state is one that something else wrote.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_take_whose_arithmetic_fails_fails_alone() {
    let Some(url) = url() else { return };
    let guard = common::DropTable::new(&url, "tollgate_overflow");
    let clock = ManualClock::new(1_700_000_000_000.0);
    let store = PgStore::builder()
        .table(&guard.table)
        .connections(1)
        .open_with_clock(&url, clock.clone())
        .await
        .unwrap();
    let limiter = std::sync::Arc::new(RateLimiter::new(store));
    // The fastest refill there is, on a state written at ts -1e300: its refill, about 1e300
    // ms x 1e18 tokens a ms, overflows a float8.
    let fast = Target::Inline("fast", Config::token_bucket(1e15, 0.001));
    let insert = format!("INSERT INTO {} VALUES ('fast', false, '', 0, 0, -1e300)", guard.table);
    common::pg_batch(&url, &insert).unwrap();
    let normal = Target::Inline("normal", Config::token_bucket(100.0, MINUTE));
    // Many at once on one connection: they wait for it, and go together.
    let tasks: Vec<_> = (0..30)
        .map(|i| {
            let limiter = std::sync::Arc::clone(&limiter);
            tokio::spawn(async move {
                let target = if i == 15 { fast } else { normal };
                (i, limiter.limit_async(target, Request::new()).await)
            })
        })
        .collect();
    for task in tasks {
        let (i, result) = task.await.unwrap();
        if i == 15 {
            assert!(matches!(result, Err(Error::Store(_))), "{result:?}");
        } else {
            assert!(result.unwrap().ok, "take {i}");
        }
    }
    assert_eq!(limiter.value_async(normal, None).await.unwrap().value, 71.0, "29 taken, once each");
}

/// Four stores, each with its own runtime, thread and connections (as four processes), run
/// 16 acquirers each on one (name, key) of 10 slots; each holds its slot a few ms, then
/// releases it. From the log of grants and releases: at no instant were more than 10 held.
///
/// Each logged interval runs from when its acquire answered (after the database committed
/// the holder) to when its release was sent (before the holder was deleted): inside the
/// time the database held the slot, so more than 10 logged at once would be more than 10
/// held at once.
#[test]
fn acquirers_from_four_stores_never_hold_more_than_max() {
    let Some(url) = url() else { return };
    let guard = common::DropTable::new(&url, "tollgate_slots_race");
    let limit = ("race", Concurrency::new(10));
    let start = std::time::Instant::now();
    let stores: Vec<_> = (0..4u64)
        .map(|n| {
            let (url, table) = (url.clone(), guard.table.clone());
            std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .unwrap();
                runtime.block_on(async move {
                    let store = PgStore::builder().table(&table).open(&url).await.unwrap();
                    let limiter = std::sync::Arc::new(RateLimiter::new(store));
                    let acquirers: Vec<_> = (0..16u64)
                        .map(|i| {
                            let limiter = std::sync::Arc::clone(&limiter);
                            tokio::spawn(async move {
                                let request = Acquire::new().key("k");
                                let mut refused = 0;
                                let ticket = loop {
                                    match limiter.acquire_async(limit, request).await.unwrap() {
                                        Acquired::Granted(ticket) => break ticket,
                                        Acquired::Refused { .. } => {
                                            refused += 1;
                                            tokio::time::sleep(Duration::from_millis(1)).await;
                                        }
                                    }
                                };
                                let granted = start.elapsed();
                                tokio::time::sleep(Duration::from_millis(hold_ms(n, i))).await;
                                let released = start.elapsed();
                                let freed =
                                    limiter.release_async(limit, Some("k"), ticket.id).await;
                                assert!(freed.unwrap(), "the ticket still held its slot");
                                (granted, released, refused)
                            })
                        })
                        .collect();
                    let mut log = Vec::new();
                    for acquirer in acquirers {
                        log.push(acquirer.await.unwrap());
                    }
                    log
                })
            })
        })
        .collect();
    let log: Vec<_> = stores.into_iter().flat_map(|s| s.join().unwrap()).collect();
    assert_eq!(log.len(), 64, "every acquirer was granted once");
    // Refused only while 10 were held: the bound was reached.
    let refused: u32 = log.iter().map(|&(_, _, refused)| refused).sum();
    assert!(refused > 0, "no acquire was refused");
    // A release at the instant of a grant is counted first: the intervals are half-open.
    let mut events: Vec<(Duration, i32)> =
        log.iter().flat_map(|&(granted, released, _)| [(granted, 1), (released, -1)]).collect();
    events.sort();
    let (mut held, mut most) = (0, 0);
    for (_, change) in events {
        held += change;
        most = most.max(held);
    }
    assert!(most <= 10, "{most} held at once");
    assert!(most >= 2, "the acquirers overlapped ({most} at most)");
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let left = runtime.block_on(async {
        let store = PgStore::builder().table(&guard.table).open(&url).await.unwrap();
        RateLimiter::new(store).slots_value_async(limit, Some("k")).await.unwrap()
    });
    assert_eq!(left, SlotsValue { in_flight: 0, max: 10, holders: 0, earliest: None });
}

/// How long acquirer `i` of store `store` holds its slot: 5 to 40 ms, spread by a hash of
/// the two (no random numbers needed, and the same every run). Long enough beside the
/// operations, each a few round trips under the (name, key)'s lock, for 10 to be held at
/// once and others refused meanwhile.
fn hold_ms(store: u64, i: u64) -> u64 {
    let mut x = (store << 32 | i).wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    5 + (x ^ (x >> 31)) % 36
}

/// An acquire inside a caller's transaction holds its slot there; rolled back, nothing is
/// held (its ticket releases nothing), and every slot is the store's again; committed, the
/// slot is held, and a release in another transaction of the caller's frees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_in_a_rolled_back_transaction_holds_nothing() {
    let Some(url) = url() else { return };
    let guard = common::DropTable::new(&url, "tollgate_slots_tx");
    let table = guard.table.clone();
    let clock = ManualClock::new(1_700_000_000_000.0);
    let store = PgStore::builder().table(&table).open_with_clock(&url, clock.clone()).await;
    let limiter = RateLimiter::new(store.unwrap());
    let gpu = ("gpu", Concurrency::new(2).with_ttl(MINUTE));
    let mut client = connect(&url).await;

    let tx = client.transaction().await.unwrap();
    let ticket = {
        let in_tx = limiter.on(in_tx(&tx, &table, &clock));
        let acquired = in_tx.acquire_async(gpu, Acquire::new().key("u").count(2)).await.unwrap();
        let value = in_tx.slots_value_async(gpu, Some("u")).await.unwrap();
        assert_eq!(value.in_flight, 2, "held inside");
        acquired.ticket().expect("both slots were free")
    };
    tx.rollback().await.unwrap();
    let value = limiter.slots_value_async(gpu, Some("u")).await.unwrap();
    assert_eq!(value, SlotsValue { in_flight: 0, max: 2, holders: 0, earliest: None });
    assert!(!limiter.release_async(gpu, Some("u"), ticket.id).await.unwrap(), "never held");
    let whole = limiter.acquire_async(gpu, Acquire::new().key("u").count(2)).await.unwrap();
    assert!(whole.ok(), "every slot is free: {whole:?}");
    limiter.reset_slots_async(gpu, Some("u")).await.unwrap();

    let tx = client.transaction().await.unwrap();
    let acquired = limiter.on(in_tx(&tx, &table, &clock)).acquire_async(gpu, "u").await.unwrap();
    tx.commit().await.unwrap();
    let ticket = acquired.ticket().expect("a slot was free");
    assert_eq!(ticket.expires_at, 1_700_000_000_000.0 + MINUTE);
    assert_eq!(limiter.slots_value_async(gpu, Some("u")).await.unwrap().in_flight, 1);
    let tx = client.transaction().await.unwrap();
    let in_tx = limiter.on(in_tx(&tx, &table, &clock));
    assert!(in_tx.release_async(gpu, Some("u"), ticket.id).await.unwrap());
    drop(in_tx);
    tx.commit().await.unwrap();
    assert_eq!(limiter.slots_value_async(gpu, Some("u")).await.unwrap().in_flight, 0);
}
