//! Rate limits that commit and roll back with the app's own writes, in a sqlx transaction.
//!
//! ```sh
//! cargo run -p tollgate --example sqlx_orders --features sqlx-sqlite
//! ```
//!
//! A shop allows each customer 2 orders a minute. An order takes its token inside the same
//! transaction that inserts it, so an order that fails after taking its token (here: an item
//! out of stock) rolls back and gives the token back.

use tollgate::{Config, MINUTE, MemoryStore, RateLimiter};

const ORDERS: (&str, Config) = ("orders", Config::token_bucket(2.0, MINUTE));

async fn place_order(
    pool: &sqlx::SqlitePool,
    limiter: &RateLimiter,
    customer: &str,
    item: &str,
) -> Result<String, Box<dyn std::error::Error>> {
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
    let decision = limiter.limit_in(&mut *tx, ORDERS, customer).await?;
    if !decision.ok {
        let wait = decision.retry_after.unwrap_or(0.0) / 1_000.0;
        return Ok(format!("refused: too many orders, retry in {wait:.0} s"));
    }
    sqlx::query("INSERT INTO orders (customer, item) VALUES (?1, ?2)")
        .bind(customer)
        .bind(item)
        .execute(&mut *tx)
        .await?;
    if item == "unicorn" {
        // Dropping `tx` rolls back the order and the token it took.
        return Ok("failed: out of stock (rolled back, the token is given back)".into());
    }
    tx.commit().await?;
    Ok("placed".into())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("tollgate-sqlx-orders-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let url = format!("sqlite://{}?mode=rwc", dir.join("shop.db").display());
    let pool = sqlx::SqlitePool::connect(&url).await?;
    tollgate::sqlx::create_table(&mut *pool.acquire().await?).await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS orders (customer TEXT, item TEXT)")
        .execute(&pool)
        .await?;
    // The *_in calls keep the states in the transaction's database, not in this store.
    let limiter = RateLimiter::new(MemoryStore::new());

    for item in ["book", "unicorn", "lamp", "chair"] {
        let answer = place_order(&pool, &limiter, "alice", item).await?;
        println!("alice orders a {item:<8} {answer}");
    }
    let placed: i64 = sqlx::query_scalar("SELECT count(*) FROM orders").fetch_one(&pool).await?;
    println!("orders in the database: {placed}");
    pool.close().await;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
