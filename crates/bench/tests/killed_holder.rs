//! A holder killed with -9 frees its slots within the ttl (issue 60's goal): a process
//! (`slots_holder`) takes every slot of a concurrency limit with a ttl of 1.5 s and is killed
//! at once; an acquire is refused while its ticket lives, and granted within the ttl (and
//! the poll's 20 ms) of the kill, not much sooner: nothing but the expiry freed it. On
//! SQLite, Redis and PostgreSQL.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tollgate::store::{PgStore, RedisStore, SqliteStore};
use tollgate::{AsyncStore, Concurrency, RateLimiter};

const TTL_MS: u64 = 1_500;

fn backend(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            assert!(
                std::env::var("TOLLGATE_REQUIRE_BACKENDS").as_deref() != Ok("1"),
                "{var} is not set, and TOLLGATE_REQUIRE_BACKENDS=1 requires it"
            );
            eprintln!("skipped: set {var} to run this test");
            None
        }
    }
}

fn freed_within_the_ttl(url: &str) {
    let name = "killedHolder";
    let key = format!("k{}", std::process::id());
    let mut holder = Command::new(env!("CARGO_BIN_EXE_slots_holder"))
        .args([url, name, &key, "3", &TTL_MS.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(holder.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert!(line.starts_with("held "), "{url}: the holder said {line:?}");
    assert!(
        Command::new("kill").args(["-KILL", &holder.id().to_string()]).status().unwrap().success()
    );
    let killed = Instant::now();
    let _ = holder.wait();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let store: Arc<dyn AsyncStore> = if url.starts_with("redis") {
            Arc::new(RedisStore::open(url).unwrap())
        } else if url.starts_with("postgres") {
            Arc::new(PgStore::open(url).await.unwrap())
        } else {
            Arc::new(SqliteStore::open(url.strip_prefix("sqlite://").unwrap()).unwrap())
        };
        let limiter = RateLimiter::new(store);
        let limit = (name, Concurrency::new(3).with_ttl(TTL_MS as f64));
        let first = limiter.acquire_async(limit, key.as_str()).await.unwrap();
        assert!(!first.ok(), "{url}: the killed holder's slots are still held: {first:?}");
        loop {
            let acquired = limiter.acquire_async(limit, key.as_str()).await.unwrap();
            let after = killed.elapsed();
            if let Some(ticket) = acquired.ticket() {
                assert!(
                    after <= Duration::from_millis(TTL_MS + 200),
                    "{url}: freed {after:?} after the kill, where the ttl is {TTL_MS} ms"
                );
                assert!(
                    after >= Duration::from_millis(TTL_MS - 500),
                    "{url}: freed {after:?} after the kill: before its ttl"
                );
                limiter.release_async(limit, Some(&key), ticket.id).await.unwrap();
                eprintln!("{url}: freed {after:?} after the kill (ttl {TTL_MS} ms)");
                return;
            }
            assert!(after < Duration::from_secs(5), "{url}: never freed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
}

#[test]
fn a_killed_holder_frees_its_slots_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    freed_within_the_ttl(&format!("sqlite://{}", dir.path().join("slots.db").display()));
}

#[test]
fn a_killed_holder_frees_its_slots_on_redis() {
    if let Some(url) = backend("TOLLGATE_REDIS_URL") {
        freed_within_the_ttl(&url);
    }
}

#[test]
fn a_killed_holder_frees_its_slots_on_postgres() {
    if let Some(url) = backend("TOLLGATE_POSTGRES_URL") {
        freed_within_the_ttl(&url);
    }
}
