//! Where states live: the [`Store`] trait and its implementations.
//!
//! A store's only job is to load and save (name, key, shard) states atomically for a whole
//! request; `tollgate-algebra` decides. Each request arrives as a [`Plan`](tollgate_algebra::Plan):
//! the store loads the states of its slots, reads its clock once, calls
//! [`Plan::decide`](tollgate_algebra::Plan::decide), and saves the states that the
//! [`Outcome`](tollgate_algebra::Outcome) marks changed, all within one atomic unit. Because deciding
//! is a pure function of (states, time), a store that loses a race may simply run it again.
//!
//! The seam has two forms: [`Store`], called on the caller's thread (the memory store,
//! SQLite, a caller's own SQLite transaction), and [`AsyncStore`], awaited (every store;
//! Redis and PostgreSQL only this one; object-safe, so `Arc<dyn AsyncStore>` holds a store
//! picked at run time). A store that answers in-process hands out its sync form from
//! [`AsyncStore::immediate`], so that the async API takes the sync path on it.
//!
//! # How each store does it
//!
//! - **Memory** ([`MemoryStore`]): the slots' segments are locked in a fixed order, so a
//!   transaction over several limits is atomic and cannot deadlock. It never waits: its
//!   async calls answer at once.
//! - **SQLite** ([`SqliteStore`], feature `sqlite`): `BEGIN IMMEDIATE` takes the write lock
//!   up front (no upgrade deadlock), a `SELECT` per slot, `decide`, an upsert (or a delete,
//!   when full) per changed slot, `COMMIT`. Sync calls run on the caller's thread; async
//!   calls go to a writer thread that commits the requests waiting for it together.
//!   [`SqliteTransaction`] runs the same inside the caller's own transaction.
//! - **PostgreSQL** ([`PgStore`], feature `postgres`, on tokio-postgres): within its own
//!   transaction or the caller's ([`PgTransaction`]), transaction-scoped advisory locks on
//!   the slots, in ascending order, serialize every request touching a slot (even before its
//!   row exists), which is correct under READ COMMITTED; one query then reads the states and
//!   the database's time (`clock_timestamp()`); `decide`; upserts or deletes. A one-take is
//!   one statement (the table's `take` function), and those that wait for a connection go
//!   together in one (`takes`).
//! - **Redis** ([`RedisStore`], feature `redis`, on redis-rs's multiplexed connections): a
//!   Lua script receives the plan (slots, per-shard configs, counts, reserve flags and the
//!   shard choices already made), loads the states, decides with `TIME` and writes, all in
//!   one round trip; it answers with what it loaded and the time it used, and
//!   `tollgate-algebra` computes the answer from those. Keys expire when they are full again.
//!   One-takes that wait for a round trip go together in one script run.
//! - **Redis Cluster** (the same [`RedisStore`] on a `redis+cluster://` URL, feature
//!   `redis-cluster`): as Redis when a request's states share a hash slot; a sharded take
//!   whose two shards are on different nodes runs as atomic one-shard steps
//!   ([`tollgate_algebra::Plan::split`]); a transaction over several slots is refused.
//!
//! Stores that read their own clock accept a fixed one in tests (for the memory store,
//! [`MemoryStore::with_clock`] and a [`tollgate_algebra::ManualClock`]).
//!
//! (A store whose feature this build lacks links to the [list of features](crate#features).)
//!
#![cfg_attr(not(feature = "sqlite"), doc = "[`SqliteStore`]: ../index.html#features")]
#![cfg_attr(not(feature = "sqlite"), doc = "[`SqliteTransaction`]: ../index.html#features")]
#![cfg_attr(not(feature = "postgres"), doc = "[`PgStore`]: ../index.html#features")]
#![cfg_attr(not(feature = "postgres"), doc = "[`PgTransaction`]: ../index.html#features")]
#![cfg_attr(not(feature = "redis"), doc = "[`RedisStore`]: ../index.html#features")]

#[cfg(any(feature = "redis", feature = "postgres", feature = "sqlite"))]
mod breaker;
mod holders;
#[cfg(any(feature = "redis", feature = "postgres"))]
mod lease;
mod memory;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis;
mod seam;
#[cfg(any(
    feature = "sqlite",
    feature = "postgres",
    feature = "sqlx-sqlite",
    feature = "sqlx-postgres"
))]
pub(crate) mod sql;
#[cfg(feature = "sqlite")]
mod sqlite;
#[cfg(all(test, any(feature = "redis", feature = "postgres", feature = "sqlx-postgres")))]
pub(crate) mod testing;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "redis"))]
mod ticket;
mod unavailable;
mod url;

#[cfg(any(feature = "redis", feature = "postgres", feature = "sqlite"))]
pub use breaker::{BreakerStats, CircuitBreaker, CircuitBreakerBuilder};
#[cfg(any(feature = "redis", feature = "postgres"))]
pub use lease::{FAR_MS, HOT_AFTER, LeaseOptions, LeaseStats, LeasedName};
pub use memory::{MemoryStore, MemoryStoreBuilder};
#[cfg(feature = "postgres")]
pub use postgres::{PgStore, PgStoreBuilder, PgTransaction};
#[cfg(feature = "redis")]
pub use redis::{RedisStore, RedisStoreBuilder};
#[doc(hidden)]
pub use seam::OnImmediate;
pub use seam::{AsyncStore, BoxFuture, Store};
#[cfg(feature = "sqlite")]
pub use sqlite::{SqliteStore, SqliteStoreBuilder, SqliteTransaction, Synchronous, create_schema};
pub use unavailable::Unavailable;
pub use url::redacted_url;
