//! A process that holds slots of a concurrency limit and never releases them, for the test
//! that a holder killed with -9 frees its slots within the ttl
//! (`crates/bench/tests/killed_holder.rs`):
//!
//! ```text
//! slots_holder STORE_URL NAME KEY MAX TTL_MS
//! ```
//!
//! It acquires all `MAX` slots of (NAME, KEY) with `TTL_MS`, prints `held <expiresAt>` and
//! sleeps until it is killed. STORE_URL: `redis://...`, `postgres://...` or `sqlite://PATH`.

use std::sync::Arc;

use tollgate::store::{PgStore, RedisStore, SqliteStore};
use tollgate::{Acquire, AsyncStore, Concurrency, RateLimiter};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, name, key, max, ttl] = &args[..] else {
        eprintln!("usage: slots_holder STORE_URL NAME KEY MAX TTL_MS");
        std::process::exit(2);
    };
    let max: u32 = max.parse().expect("MAX: a whole number");
    let ttl: f64 = ttl.parse().expect("TTL_MS: a number");
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async move {
        let store: Arc<dyn AsyncStore> = if url.starts_with("redis") {
            Arc::new(RedisStore::open(url).expect("a Redis store"))
        } else if url.starts_with("postgres") {
            Arc::new(PgStore::open(url).await.expect("a PostgreSQL store"))
        } else {
            let path = url.strip_prefix("sqlite://").expect("redis://, postgres:// or sqlite://");
            Arc::new(SqliteStore::open(path).expect("a SQLite store"))
        };
        let limit = Concurrency::new(max).with_ttl(ttl);
        let limiter = RateLimiter::new(store);
        let request = Acquire::new().key(key).count(max);
        let acquired = limiter.acquire_async((name.as_str(), limit), request).await.unwrap();
        let ticket = acquired.ticket().expect("every slot was free");
        println!("held {}", ticket.expires_at);
        std::future::pending::<()>().await;
    });
}
