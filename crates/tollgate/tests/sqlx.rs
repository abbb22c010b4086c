//! The limiter inside the caller's own sqlx transaction: rolled back, the tokens are back;
//! committed, they are spent with the caller's writes; on PostgreSQL, exact under concurrent
//! transactions. Concurrency limits' slots likewise: held only once committed.

#![cfg(all(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]

use std::sync::Arc;

use sqlx::Row;
use tollgate::{
    Concurrency, Config, Decision, Error, MINUTE, MemoryStore, RateLimiter, Request, Target,
};

mod common;

/// A limit name of this process's own, so runs never see each other's rows.
fn name(base: &str) -> &'static str {
    Box::leak(format!("{base}-{}", std::process::id()).into_boxed_str())
}

/// The stored value of (name, no key, shard 0), if a row exists (none: full).
async fn stored<'e, E>(conn: E, name: &str) -> Option<f64>
where
    E: sqlx::Executor<'e>,
    f64: for<'r> sqlx::Decode<'r, E::Database> + sqlx::Type<E::Database>,
    for<'q> <E::Database as sqlx::Database>::Arguments: sqlx::IntoArguments<E::Database>,
    for<'q> &'q str: sqlx::Encode<'q, E::Database> + sqlx::Type<E::Database>,
    usize: sqlx::ColumnIndex<<E::Database as sqlx::Database>::Row>,
{
    sqlx::query("SELECT value FROM tollgate_state WHERE name = $1 AND has_key = false")
        .bind(name)
        .fetch_optional(conn)
        .await
        .unwrap()
        .map(|row| row.get(0))
}

fn postgres_url() -> Option<String> {
    common::backend_url("TOLLGATE_POSTGRES_URL", "postgres://postgres@127.0.0.1/test")
}

#[tokio::test]
async fn postgres_rollback_gives_back_and_commit_spends() {
    let Some(url) = postgres_url() else { return };
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    tollgate::sqlx::create_table(&mut *pool.acquire().await.unwrap()).await.unwrap();
    let limiter = RateLimiter::new(MemoryStore::new());
    let orders = Target::Inline(name("sqlx-orders"), Config::token_bucket(3.0, 60.0 * MINUTE));
    sqlx::query("CREATE TABLE IF NOT EXISTS tollgate_sqlx_orders (who text)")
        .execute(&pool)
        .await
        .unwrap();

    // Rolled back: the tokens are back.
    let mut tx = pool.begin().await.unwrap();
    assert_eq!(
        limiter.limit_in(&mut *tx, orders, Request::new().count(2.0)).await.unwrap(),
        Decision::ADMIT
    );
    assert_eq!(stored(&mut *tx, orders_name(orders)).await, Some(1.0), "seen inside");
    assert!(!limiter.check_in(&mut *tx, orders, Request::new().count(2.0)).await.unwrap().ok);
    tx.rollback().await.unwrap();
    assert_eq!(stored(&pool, orders_name(orders)).await, None, "rolled back: full again");

    // Committed: spent together with the app's own write.
    let mut tx = pool.begin().await.unwrap();
    assert!(limiter.limit_in(&mut *tx, orders, Request::new().count(2.0)).await.unwrap().ok);
    sqlx::query("INSERT INTO tollgate_sqlx_orders (who) VALUES ('alice')")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let left = stored(&pool, orders_name(orders)).await.unwrap();
    assert!((0.99..1.01).contains(&left), "{left}");

    // All or nothing inside the transaction too; throws names the limit.
    let other = Target::Inline(name("sqlx-other"), Config::token_bucket(5.0, MINUTE));
    let mut tx = pool.begin().await.unwrap();
    let t = limiter
        .transaction_in(
            &mut *tx,
            &[other.with(Request::new()), orders.with(Request::new().count(2.0))],
        )
        .await
        .unwrap();
    assert!(!t.ok);
    assert_eq!(stored(&mut *tx, orders_name(other)).await, None, "nothing taken from the other");
    let err = limiter.limit_in(&mut *tx, orders, Request::new().count(2.0).throws()).await;
    assert!(matches!(err, Err(Error::RateLimited { .. })), "{err:?}");
    // The transaction is still usable after a refusal or an error.
    assert!(limiter.limit_in(&mut *tx, other, Request::new()).await.unwrap().ok);
    tx.commit().await.unwrap();
    assert_eq!(stored(&pool, orders_name(other)).await, Some(4.0));
    sqlx::query("DELETE FROM tollgate_state WHERE name = $1 OR name = $2")
        .bind(orders_name(orders))
        .bind(orders_name(other))
        .execute(&pool)
        .await
        .unwrap();
}

fn orders_name(t: Target<'_>) -> &str {
    match t {
        Target::Inline(name, _) | Target::Named(name) => name,
    }
}

#[tokio::test]
async fn postgres_refuses_a_connection_outside_a_transaction() {
    let Some(url) = postgres_url() else { return };
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    // The table exists whichever test runs first: the check below reads it.
    tollgate::sqlx::create_table(&mut *pool.acquire().await.unwrap()).await.unwrap();
    let limiter = RateLimiter::new(MemoryStore::new());
    let mut conn = pool.acquire().await.unwrap();
    let limit = Target::Inline(name("sqlx-bare"), Config::token_bucket(3.0, MINUTE));
    let err = limiter.limit_in(&mut *conn, limit, Request::new()).await.unwrap_err();
    assert!(matches!(err, Error::Store(_)), "{err:?}");
    assert!(err.to_string().contains("transaction"), "{err}");
    assert_eq!(stored(&pool, name("sqlx-bare")).await, None, "nothing taken");
}

/// 24 concurrent transactions race for a limit of 10, each taking one token and committing:
/// exactly 10 are admitted (the advisory locks serialize them under READ COMMITTED).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_concurrent_transactions_admit_exactly_the_limit() {
    let Some(url) = postgres_url() else { return };
    let pool =
        sqlx::postgres::PgPoolOptions::new().max_connections(12).connect(&url).await.unwrap();
    tollgate::sqlx::create_table(&mut *pool.acquire().await.unwrap()).await.unwrap();
    let limiter = Arc::new(RateLimiter::new(MemoryStore::new()));
    let race = Target::Inline(name("sqlx-race"), Config::token_bucket(10.0, 24.0 * 60.0 * MINUTE));
    let tasks: Vec<_> = (0..24)
        .map(|_| {
            let (pool, limiter) = (pool.clone(), Arc::clone(&limiter));
            tokio::spawn(async move {
                let mut tx = pool.begin().await.unwrap();
                let ok = limiter.limit_in(&mut *tx, race, Request::new()).await.unwrap().ok;
                tx.commit().await.unwrap();
                ok
            })
        })
        .collect();
    let mut admitted = 0;
    for task in tasks {
        admitted += usize::from(task.await.unwrap());
    }
    assert_eq!(admitted, 10);
    sqlx::query("DELETE FROM tollgate_state WHERE name = $1")
        .bind(name("sqlx-race"))
        .execute(&pool)
        .await
        .unwrap();
}

#[tokio::test]
async fn sqlite_rollback_gives_back_and_commit_spends() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("app.db").display());
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    tollgate::sqlx::create_table(&mut *pool.acquire().await.unwrap()).await.unwrap();
    let limiter = RateLimiter::new(MemoryStore::new());
    let orders = Target::Inline("orders", Config::token_bucket(3.0, 60.0 * MINUTE));

    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    assert!(limiter.limit_in(&mut *tx, orders, Request::new().count(2.0)).await.unwrap().ok);
    assert!(!limiter.check_in(&mut *tx, orders, Request::new().count(2.0)).await.unwrap().ok);
    tx.rollback().await.unwrap();
    assert_eq!(stored(&pool, "orders").await, None, "rolled back: full again");

    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    assert!(limiter.limit_in(&mut *tx, orders, Request::new().count(2.0)).await.unwrap().ok);
    tx.commit().await.unwrap();
    let left = stored(&pool, "orders").await.unwrap();
    assert!((0.99..1.01).contains(&left), "{left}");

    // The same rows as the SqliteStore on that file: both ways see one limit.
    #[cfg(feature = "sqlite")]
    {
        let store = tollgate::store::SqliteStore::open(dir.path().join("app.db")).unwrap();
        let value = RateLimiter::new(store).value(orders, None).unwrap().value;
        assert!((0.99..1.01).contains(&value), "{value}");
    }
}

/// Without the table, the error says how to create it, and the caller's transaction goes on.
#[tokio::test]
async fn a_missing_table_is_an_error_that_says_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("empty.db").display());
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    let limiter = RateLimiter::new(MemoryStore::new());
    let orders = Target::Inline("orders", Config::token_bucket(3.0, MINUTE));
    let mut tx = pool.begin().await.unwrap();
    let err = limiter.limit_in(&mut *tx, orders, Request::new()).await.unwrap_err();
    assert!(err.to_string().contains("tollgate::sqlx::create_table"), "{err}");
    sqlx::query("CREATE TABLE t (x INTEGER)").execute(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();
}

/// On `pool`, each transaction begun with `begin`: an acquire rolled back holds nothing, one
/// committed holds its slot (refused from another transaction) until a release in a later
/// transaction commits; a renewal there answers the new expiry.
async fn slots_are_held_only_once_committed<DB>(
    pool: &sqlx::Pool<DB>,
    begin: &'static str,
    name: &'static str,
) where
    DB: sqlx::Database,
    DB::Connection: tollgate::sqlx::Connection,
{
    let limiter = RateLimiter::new(MemoryStore::new());
    let one = (name, Concurrency::new(1).with_ttl(MINUTE));
    let mut tx = pool.begin_with(begin).await.unwrap();
    assert!(limiter.acquire_in(&mut *tx, one, "u").await.unwrap().ok());
    assert!(!limiter.acquire_in(&mut *tx, one, "u").await.unwrap().ok(), "held inside");
    tx.rollback().await.unwrap();

    let mut tx = pool.begin_with(begin).await.unwrap();
    let acquired = limiter.acquire_in(&mut *tx, one, "u").await.unwrap();
    let ticket = acquired.ticket().expect("rolled back: free");
    tx.commit().await.unwrap();

    let mut tx = pool.begin_with(begin).await.unwrap();
    let refused = limiter.acquire_in(&mut *tx, one, "u").await.unwrap();
    assert!(refused.retry_after().is_some(), "committed: held ({refused:?})");
    let renewed = limiter.renew_in(&mut *tx, one, Some("u"), ticket.id, None).await.unwrap();
    assert!(renewed.is_some_and(|at| at >= ticket.expires_at), "{renewed:?}");
    assert!(limiter.release_in(&mut *tx, one, Some("u"), ticket.id).await.unwrap());
    tx.commit().await.unwrap();

    let mut tx = pool.begin_with(begin).await.unwrap();
    let again = limiter.acquire_in(&mut *tx, one, "u").await.unwrap();
    let again = again.ticket().expect("released: free");
    assert_ne!(again.id, ticket.id, "a fresh ticket");
    assert!(limiter.release_in(&mut *tx, one, Some("u"), again.id).await.unwrap());
    tx.commit().await.unwrap();
}

#[tokio::test]
async fn sqlite_slots_are_held_only_once_committed() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("app.db").display());
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    tollgate::sqlx::create_table(&mut *pool.acquire().await.unwrap()).await.unwrap();
    slots_are_held_only_once_committed(&pool, "BEGIN IMMEDIATE", "gpu").await;
}

#[tokio::test]
async fn postgres_slots_are_held_only_once_committed() {
    let Some(url) = postgres_url() else { return };
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    tollgate::sqlx::create_table(&mut *pool.acquire().await.unwrap()).await.unwrap();
    slots_are_held_only_once_committed(&pool, "BEGIN", name("sqlx-gpu")).await;
}
