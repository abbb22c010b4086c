//! Application-layer rate limiting where each limit is two numbers.
//!
//! tollgate keeps, per (name, key, shard), a `value` and a `ts`, and updates them with the
//! exact algebra of `tollgate-algebra` inside one atomic step of a [`Store`]: token buckets
//! and fixed windows, burst `capacity`, reservations that book future tokens instead of
//! retrying, sharding with the power of two choices for hot limits, several limits taken all
//! or nothing, and a `retry_after` on every refusal.
//!
//! # Examples
//!
//! ```
//! use tollgate::{MemoryStore, RateLimiter, Request};
//! use tollgate::{Config, MINUTE};
//!
//! let limiter = RateLimiter::new(MemoryStore::new());
//! let send_message = Config::token_bucket(10.0, MINUTE).with_capacity(3.0);
//!
//! let decision = limiter.limit(("sendMessage", send_message), Request::new().key("alice")).unwrap();
//! assert!(decision.ok);
//!
//! // An LLM call of 5,000 tokens against 40,000 per minute, booked ahead when short:
//! let llm = Config::token_bucket(40_000.0, MINUTE);
//! let d = limiter.limit(("llmTokens", llm), Request::new().count(5_000.0).reserve()).unwrap();
//! if let Some(wait) = d.retry_after {
//!     // Schedule the work `wait` ms from now; the tokens are already ours.
//!     # let _ = wait;
//! }
//! ```
//!
//! Declare limits in a type of your own with [`Limits`] so that names are checked by the
//! compiler; see [`Limits`] and [`RateLimiter`].
//!
//! # Sync and async
//!
//! Every call has an async twin (`limit_async`, `transaction_async`, ...) that works on every
//! store and never blocks the thread that polls it: use those in an async program. The
//! stores that wait on a network (Redis, PostgreSQL) have only those, and run on Tokio. The
//! sync calls are for the stores that work without a runtime: the memory store (which never
//! waits: its async calls answer at once, through the same code) and SQLite (which waits for
//! the disk on the calling thread; its async calls go to a writer thread of its own).
//!
//! ```
//! use tollgate::{Config, MemoryStore, RateLimiter, MINUTE};
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let limiter = RateLimiter::new(MemoryStore::new());
//! let send = ("send", Config::token_bucket(10.0, MINUTE));
//! assert!(limiter.limit_async(send, "alice").await.unwrap().ok);
//! # });
//! ```
//!
//! # Features
//!
//! The memory store is always built; everything else is a Cargo feature, none on by default:
//!
//! | feature | adds |
//! |---|---|
//! | `sqlite` | `store::SqliteStore` and `store::SqliteTransaction`: states in a SQLite file (bundled SQLite); async calls through a writer thread |
//! | `postgres` | `store::PgStore` and `store::PgTransaction`: states in PostgreSQL, on tokio-postgres (async) |
//! | `redis` | `store::RedisStore`: states in Redis, one server-side script per request, on redis-rs (async) |
//! | `redis-cluster` | `redis+cluster://` URLs for `store::RedisStore` |
//! | `sqlx-postgres`, `sqlx-sqlite` | the `sqlx` module: limits inside your own sqlx transaction |
//! | `tower` | the `tower` module: a rate limit layer for tower, axum and tonic services |
//! | `axum` | `tower`, and keys from axum's `ConnectInfo` peer address |

mod concurrency;
mod error;
mod limiter;
#[cfg(any(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
pub mod sqlx;
pub mod store;
#[cfg(feature = "testing")]
pub mod testing;
#[cfg(feature = "tower")]
pub mod tower;

pub use concurrency::{
    Acquire, Acquired, AcquiredWith, Held, HeldAsync, SlotsTarget, SlotsValue, Ticket,
};
pub use error::{Error, StoreError};
pub use limiter::{
    Call, Limits, RateLimiter, RateLimiterBuilder, Request, Target, TransactionDecision,
    TransactionTaken, jitter,
};
pub use store::{AsyncStore, MemoryStore, MemoryStoreBuilder, Store};
pub use tollgate_algebra::{
    Adjusted, Clock, Config, ConfigError, DAY, Decision, HOUR, Kind, MINUTE, ManualClock,
    RawConfig, Reading, SECOND, State, Status, SystemClock, Taken,
};

/// The algebra, re-exported: evaluate states yourself, or build a store.
pub use tollgate_algebra as core;
pub use tollgate_algebra::slots::Concurrency;

/// The README's examples, compiled and run as doc tests so they stay true.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeDoctests;

/// The guide's chapters (`docs/src`, an mdBook), their examples compiled and run as doc tests
/// as the README's are. `crates/server/tests/book.rs` checks that every chapter is here.
#[cfg(doctest)]
mod guide {
    #[doc = include_str!("../../../docs/src/clients.md")]
    struct Clients;
    #[doc = include_str!("../../../docs/src/node.md")]
    struct Node;
    #[doc = include_str!("../../../docs/src/python.md")]
    struct Python;
    #[doc = include_str!("../../../docs/src/concepts/algorithms.md")]
    struct ConceptsAlgorithms;
    #[doc = include_str!("../../../docs/src/concepts/capacity-and-reservations.md")]
    struct ConceptsCapacityAndReservations;
    #[doc = include_str!("../../../docs/src/concepts/concurrency.md")]
    struct ConceptsConcurrency;
    #[doc = include_str!("../../../docs/src/concepts/costs-after-the-work.md")]
    struct ConceptsCostsAfterTheWork;
    #[doc = include_str!("../../../docs/src/concepts/failure.md")]
    struct ConceptsFailure;
    #[doc = include_str!("../../../docs/src/concepts/leases.md")]
    struct ConceptsLeases;
    #[doc = include_str!("../../../docs/src/concepts/regions.md")]
    struct ConceptsRegions;
    #[doc = include_str!("../../../docs/src/concepts/sharding.md")]
    struct ConceptsSharding;
    #[doc = include_str!("../../../docs/src/concepts/transactions.md")]
    struct ConceptsTransactions;
    #[doc = include_str!("../../../docs/src/concepts/two-numbers.md")]
    struct ConceptsTwoNumbers;
    #[doc = include_str!("../../../docs/src/envoy.md")]
    struct Envoy;
    #[doc = include_str!("../../../docs/src/getting-started/library.md")]
    struct GettingStartedLibrary;
    #[doc = include_str!("../../../docs/src/getting-started/server.md")]
    struct GettingStartedServer;
    #[doc = include_str!("../../../docs/src/introduction.md")]
    struct Introduction;
    #[doc = include_str!("../../../docs/src/library/calls.md")]
    struct LibraryCalls;
    #[doc = include_str!("../../../docs/src/library/middleware.md")]
    struct LibraryMiddleware;
    #[doc = include_str!("../../../docs/src/migrate/bottleneck.md")]
    struct MigrateBottleneck;
    #[doc = include_str!("../../../docs/src/migrate/convex.md")]
    struct MigrateConvex;
    #[doc = include_str!("../../../docs/src/migrate/django-ratelimit.md")]
    struct MigrateDjangoRatelimit;
    #[doc = include_str!("../../../docs/src/migrate/envoy-ratelimit.md")]
    struct MigrateEnvoyRatelimit;
    #[doc = include_str!("../../../docs/src/migrate/express-rate-limit.md")]
    struct MigrateExpressRateLimit;
    #[doc = include_str!("../../../docs/src/migrate/fastify-rate-limit.md")]
    struct MigrateFastifyRateLimit;
    #[doc = include_str!("../../../docs/src/migrate/governor.md")]
    struct MigrateGovernor;
    #[doc = include_str!("../../../docs/src/migrate/limitador.md")]
    struct MigrateLimitador;
    #[doc = include_str!("../../../docs/src/migrate/redis-cell.md")]
    struct MigrateRedisCell;
    #[doc = include_str!("../../../docs/src/migrate/redis-semaphore.md")]
    struct MigrateRedisSemaphore;
    #[doc = include_str!("../../../docs/src/migrate/slowapi.md")]
    struct MigrateSlowapi;
    #[doc = include_str!("../../../docs/src/operations/kubernetes.md")]
    struct OperationsKubernetes;
    #[doc = include_str!("../../../docs/src/operations/redis-ha.md")]
    struct OperationsRedisHa;
    #[doc = include_str!("../../../docs/src/performance.md")]
    struct Performance;
    #[doc = include_str!("../../../docs/src/server/config.md")]
    struct ServerConfig;
    #[doc = include_str!("../../../docs/src/server/dashboard.md")]
    struct ServerDashboard;
    #[doc = include_str!("../../../docs/src/server/http-api.md")]
    struct ServerHttpApi;
    #[doc = include_str!("../../../docs/src/server/index.md")]
    struct ServerIndex;
    #[doc = include_str!("../../../docs/src/server/metrics.md")]
    struct ServerMetrics;
    #[doc = include_str!("../../../docs/src/server/reload.md")]
    struct ServerReload;
    #[doc = include_str!("../../../docs/src/server/resp.md")]
    struct ServerResp;
    #[doc = include_str!("../../../docs/src/server/security.md")]
    struct ServerSecurity;
    #[doc = include_str!("../../../docs/src/simulator.md")]
    struct Simulator;
    #[doc = include_str!("../../../docs/src/stores/memory.md")]
    struct StoresMemory;
    #[doc = include_str!("../../../docs/src/stores/postgres.md")]
    struct StoresPostgres;
    #[doc = include_str!("../../../docs/src/stores/redis-cluster.md")]
    struct StoresRedisCluster;
    #[doc = include_str!("../../../docs/src/stores/redis.md")]
    struct StoresRedis;
    #[doc = include_str!("../../../docs/src/stores/sqlite.md")]
    struct StoresSqlite;
    #[doc = include_str!("../../../docs/src/stores/sqlx.md")]
    struct StoresSqlx;
    // Its store is run against the exported conformance suite.
    #[cfg(feature = "testing")]
    #[doc = include_str!("../../../docs/src/stores/writing.md")]
    struct StoresWriting;
}
