//! Opening a store from its URL.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use tollgate::MemoryStore;
use tollgate::StoreError;
use tollgate::store::{
    CircuitBreaker, LeaseOptions, LeaseStats, PgStore, RedisStore, SqliteStore, Synchronous,
};

/// The store every server runs on, picked at run time from a URL: every call is awaited,
/// but on the memory store, which answers in-process (see `AsyncStore::immediate`).
pub type DynStore = Arc<dyn tollgate::AsyncStore>;

/// The store, as the concrete store whose keys a carry lists.
#[derive(Clone)]
pub enum Stored {
    /// In memory.
    Memory(Arc<MemoryStore>),
    /// A SQLite file.
    Sqlite(Arc<SqliteStore>),
    /// Redis, Redis Cluster, or behind Sentinel.
    Redis(Arc<RedisStore>),
    /// PostgreSQL.
    Postgres(Arc<PgStore>),
}

impl Stored {
    /// The key and shard of every state of `name` (the memory and SQLite stores' lists are
    /// made off the runtime's threads).
    pub(crate) async fn keys_of(
        &self,
        name: &str,
    ) -> Result<Vec<(Option<String>, u16)>, StoreError> {
        let name = name.to_owned();
        let blocking = |list: Box<dyn FnOnce() -> Result<_, StoreError> + Send>| async move {
            tokio::task::spawn_blocking(list)
                .await
                .unwrap_or_else(|e| Err(StoreError::new(format!("listing states failed: {e}"))))
        };
        match self {
            Stored::Memory(memory) => {
                let memory = Arc::clone(memory);
                blocking(Box::new(move || Ok(memory.keys_of(&name)))).await
            }
            Stored::Sqlite(sqlite) => {
                let sqlite = Arc::clone(sqlite);
                blocking(Box::new(move || sqlite.keys_of(&name))).await
            }
            Stored::Redis(redis) => redis.keys_of(&name).await,
            Stored::Postgres(pg) => pg.keys_of(&name).await,
        }
    }

    /// Whether the store drops a state when it is full again (PostgreSQL keeps it until a
    /// request leaves it full, so another rate, period or capacity needs nothing there).
    pub(crate) fn drops_full_states(&self) -> bool {
        !matches!(self, Stored::Postgres(_))
    }
}

/// A networked store behind its circuit breaker.
pub type Breaker = CircuitBreaker<DynStore>;

/// A store opened from a URL, with what the server needs to know about it.
pub struct Opened {
    /// The store; every call is awaited, none blocks a runtime thread.
    pub store: DynStore,
    /// The SQLite store, to sweep full states now and then.
    pub sqlite: Option<Arc<SqliteStore>>,
    /// The memory store, to sweep full states now and then and count its live states.
    pub memory: Option<Arc<MemoryStore>>,
    /// The circuit breaker of a networked store (Redis, PostgreSQL), for its metrics.
    pub breaker: Option<Arc<Breaker>>,
    /// The store when it serves leased limits: their metrics, and their leases given back
    /// on a graceful shutdown.
    pub leases: Option<Leasing>,
    /// The store as itself, whose keys a reload lists to carry them to a changed config.
    pub stored: Stored,
}

/// A store that serves leased limits (Redis or PostgreSQL), and the names it leases.
#[derive(Clone)]
pub struct Leasing {
    store: LeasingStore,
    names: Arc<[String]>,
}

#[derive(Clone)]
enum LeasingStore {
    /// On Redis, Redis Cluster or behind Sentinel.
    Redis(Arc<RedisStore>),
    /// On PostgreSQL.
    Postgres(Arc<PgStore>),
}

impl Leasing {
    fn new(store: LeasingStore, leased: &[(String, LeaseOptions)]) -> Option<Leasing> {
        let names: Arc<[String]> = leased.iter().map(|(name, _)| name.clone()).collect();
        (!names.is_empty()).then_some(Leasing { store, names })
    }

    /// Whether `name` is leased.
    pub fn leases(&self, name: &str) -> bool {
        self.names.iter().any(|n| n == name)
    }

    /// Per leased limit, its keys leased now in this process and its takes no lease served.
    pub fn names(&self) -> Vec<tollgate::store::LeasedName> {
        match &self.store {
            LeasingStore::Redis(redis) => redis.lease_names(),
            LeasingStore::Postgres(pg) => pg.lease_names(),
        }
    }

    /// What each leased (name, key) did in this process.
    pub fn stats(&self) -> Vec<(String, Option<String>, LeaseStats)> {
        match &self.store {
            LeasingStore::Redis(redis) => redis.lease_stats(),
            LeasingStore::Postgres(pg) => pg.lease_stats(),
        }
    }

    /// The tokens of (name, key) leased out now, over every process.
    ///
    /// # Errors
    ///
    /// The store's.
    pub async fn leased_out(
        &self,
        name: &str,
        key: Option<&str>,
        config: &tollgate::Config,
    ) -> Result<f64, StoreError> {
        match &self.store {
            LeasingStore::Redis(redis) => redis.leased_out(name, key, config).await,
            LeasingStore::Postgres(pg) => pg.leased_out(name, key, config).await,
        }
    }

    /// Returns every lease held.
    ///
    /// # Errors
    ///
    /// The first store error (the other leases are returned all the same).
    pub async fn release(&self) -> Result<(), StoreError> {
        match &self.store {
            LeasingStore::Redis(redis) => redis.release_leases().await,
            LeasingStore::Postgres(pg) => pg.release_leases().await,
        }
    }
}

impl Opened {
    fn local(store: DynStore, stored: Stored) -> Self {
        Opened { store, sqlite: None, memory: None, breaker: None, leases: None, stored }
    }

    /// A networked store behind a circuit breaker whose deadline is `deadline`.
    fn networked(store: DynStore, stored: Stored, deadline: Duration) -> Self {
        let breaker = Arc::new(CircuitBreaker::builder().deadline(deadline).build(store));
        Opened {
            store: Arc::clone(&breaker) as DynStore,
            sqlite: None,
            memory: None,
            breaker: Some(breaker),
            leases: None,
            stored,
        }
    }
}

/// Checks a store URL as [`open`] does before it opens anything: a store it knows, in a
/// form it takes (`memory`; `sqlite://PATH` and its options; a Redis URL and its parameters;
/// a PostgreSQL connection string). Connects to nothing: what `check-config` runs, and every
/// load of the config.
///
/// # Errors
///
/// What is wrong with the URL (shown with its password left out).
pub fn check(url: &str) -> anyhow::Result<()> {
    let shown = tollgate::store::redacted_url(url);
    if url == "memory" || url == "memory://" {
        return Ok(());
    }
    if let Some(rest) = url.strip_prefix("sqlite://") {
        sqlite_options(rest).with_context(|| format!("store {shown:?}"))?;
        return Ok(());
    }
    if REDIS_SCHEMES.iter().any(|scheme| url.starts_with(scheme)) {
        return RedisStore::check_url(url).context("the Redis store");
    }
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        return PgStore::check_url(url).with_context(|| format!("store {shown:?}"));
    }
    if url.trim().is_empty() {
        bail!("the store is empty; give memory, sqlite://PATH, redis://… or postgres://…");
    }
    bail!(
        "store {shown:?}: unknown store; use memory, sqlite://PATH, redis://HOST:PORT, \
         redis+cluster://HOST:PORT,HOST:PORT, redis+sentinel://HOST:PORT,HOST:PORT/MASTER (rediss… \
         for TLS) or postgres://USER@HOST/DB"
    )
}

/// Opens `memory` (bounded to `max_keys` live states if given),
/// `sqlite://PATH[?synchronous=full]` (`sqlite://tollgate.db` is relative to the working
/// directory, `sqlite:///var/lib/tollgate.db` absolute), `redis://HOST:PORT/DB`,
/// `redis+cluster://HOST:PORT,HOST:PORT`, `redis+sentinel://HOST:PORT,…/MASTER` (each
/// `rediss…` over TLS, checked at start) or `postgres://USER@HOST/DB`. Redis and PostgreSQL
/// go behind a circuit breaker: a request waits at most `deadline` for them, and after a
/// few failures in a row they are not asked until they answer again. SQLite waits at most
/// `deadline` for another process's write lock.
///
/// # Errors
///
/// An unknown scheme, a bad URL, or a file that cannot be opened.
pub async fn open(
    url: &str,
    max_keys: Option<usize>,
    deadline: Duration,
    leased: &[(String, LeaseOptions)],
) -> anyhow::Result<Opened> {
    check(url)?;
    // Every message names the URL with its password left out.
    let shown = tollgate::store::redacted_url(url);
    if url == "memory" || url == "memory://" {
        let mut builder = MemoryStore::builder();
        if let Some(max) = max_keys {
            builder = builder.max_keys(max);
        }
        let memory = Arc::new(builder.build());
        let stored = Stored::Memory(Arc::clone(&memory));
        return Ok(Opened { memory: Some(Arc::clone(&memory)), ..Opened::local(memory, stored) });
    }
    if let Some(rest) = url.strip_prefix("sqlite://") {
        let (path, synchronous) =
            sqlite_options(rest).with_context(|| format!("store {shown:?}"))?;
        // Waiting for another process's write lock is a wait for the store: bounded by the
        // deadline, as Redis's and PostgreSQL's round trips are.
        let sqlite = Arc::new(
            SqliteStore::builder()
                .synchronous(synchronous)
                .busy_timeout(deadline)
                .open(path)
                .with_context(|| format!("store {shown:?}"))?,
        );
        let stored = Stored::Sqlite(Arc::clone(&sqlite));
        return Ok(Opened { sqlite: Some(Arc::clone(&sqlite)), ..Opened::local(sqlite, stored) });
    }
    if REDIS_SCHEMES.iter().any(|scheme| url.starts_with(scheme)) {
        // The store's own timeout just inside the deadline: a request still waiting for its
        // connection or its round trip then is withdrawn, and says that nothing was taken
        // (the breaker's deadline, which cannot know, would say it may have been).
        let mut builder = RedisStore::builder().timeout(inside(deadline));
        for (name, options) in leased {
            builder = builder.lease(name.as_str(), *options);
        }
        // The URL is in the error, its password left out.
        let redis = builder.open(url).context("the Redis store")?;
        if url.starts_with("rediss") {
            tls_verifies(&redis, deadline).await?;
        }
        let redis = Arc::new(redis);
        let leases = Leasing::new(LeasingStore::Redis(Arc::clone(&redis)), leased);
        let stored = Stored::Redis(Arc::clone(&redis));
        return Ok(Opened { leases, ..Opened::networked(redis, stored, deadline) });
    }
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let mut builder = PgStore::builder().timeout(inside(deadline));
        for (name, options) in leased {
            builder = builder.lease(name.as_str(), *options);
        }
        let pg = Arc::new(postgres(builder, url, &shown).await?);
        let leases = Leasing::new(LeasingStore::Postgres(Arc::clone(&pg)), leased);
        let stored = Stored::Postgres(Arc::clone(&pg));
        return Ok(Opened { leases, ..Opened::networked(pg, stored, deadline) });
    }
    unreachable!("check({shown:?}) let an unknown store through")
}

/// PostgreSQL, asked once at start: credentials refused or a database that does not exist
/// stop the server with the reason; a database that cannot be reached yet (down, starting,
/// full) is only a warning: the server starts, fails closed, and uses the database once it
/// answers (its table made then), as on Redis.
async fn postgres(
    builder: tollgate::store::PgStoreBuilder,
    url: &str,
    shown: &str,
) -> anyhow::Result<PgStore> {
    match builder.clone().open(url).await {
        Ok(pg) => Ok(pg),
        Err(e) if e.is_unavailable() => {
            tracing::warn!(
                "store {shown:?} is not reachable at start ({e}); failing closed until it is"
            );
            builder.connect_lazy(url).with_context(|| format!("store {shown:?}"))
        }
        Err(e) => Err(e).with_context(|| format!("store {shown:?}")),
    }
}

/// A networked store's own timeout: four fifths of the request deadline, so that the store,
/// which knows whether a request went out, answers before the circuit breaker's deadline
/// (which must assume it did).
fn inside(deadline: Duration) -> Duration {
    deadline * 4 / 5
}

/// The schemes of the Redis store: one Redis, a Cluster, a primary behind Sentinels, each
/// plain or over TLS.
const REDIS_SCHEMES: [&str; 6] = [
    "redis://",
    "rediss://",
    "redis+cluster://",
    "rediss+cluster://",
    "redis+sentinel://",
    "rediss+sentinel://",
];

/// A TLS store is asked once at start: a certificate that does not verify (a wrong CA, a
/// name that does not match, a client certificate refused) stops the server with the
/// reason, never a silent fallback. A Redis that cannot be reached yet is only a warning:
/// the server starts and fails closed until it can, as on plain text.
async fn tls_verifies(redis: &RedisStore, deadline: Duration) -> anyhow::Result<()> {
    use tollgate::store::AsyncStore;
    let probe = tokio::time::timeout(deadline, redis.read_async(&[])).await;
    let error = match probe {
        Ok(Ok(_)) => return Ok(()),
        Ok(Err(e)) => e.to_string(),
        Err(_) => format!("no answer within {deadline:?}"),
    };
    let tls = ["certificate", "Certificate", "TLS", "tls", "handshake", "alert"];
    if tls.iter().any(|word| error.contains(word)) {
        bail!(
            "the Redis store over TLS: {error} (the server's certificate must verify against \
             ca= or the system's roots, and a client certificate, if the server asks for one, \
             be given by cert= and key=)"
        );
    }
    tracing::warn!(
        "the Redis store is not reachable at start ({error}); failing closed until it is"
    );
    Ok(())
}

/// The path and options of a SQLite store URL after `sqlite://`: `PATH` or
/// `PATH?synchronous=full|normal`.
fn sqlite_options(rest: &str) -> anyhow::Result<(&str, Synchronous)> {
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    if path.is_empty() {
        bail!("give a file, as in sqlite://tollgate.db");
    }
    let mut synchronous = Synchronous::Normal;
    for option in query.split('&').filter(|o| !o.is_empty()) {
        synchronous = match option {
            "synchronous=normal" => Synchronous::Normal,
            "synchronous=full" => Synchronous::Full,
            _ => bail!("unknown option {option:?}; the one option is synchronous=normal|full"),
        };
    }
    Ok((path, synchronous))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlite_urls_take_a_durability_option() {
        assert_eq!(sqlite_options("t.db").unwrap(), ("t.db", Synchronous::Normal));
        assert_eq!(
            sqlite_options("/a/t.db?synchronous=full").unwrap(),
            ("/a/t.db", Synchronous::Full)
        );
        let err = sqlite_options("t.db?sync=full").unwrap_err().to_string();
        assert!(err.contains("synchronous=normal|full"), "{err}");
        assert!(sqlite_options("?synchronous=full").is_err());
    }
}
