//! States in a SQLite database: the server's embedded default, and apps that run on SQLite.

use std::path::Path;
use std::time::Duration;

use parking_lot::Mutex;
use rusqlite::{Connection, OptionalExtension, params};
use tollgate_core::{Clock, Config, Kind, Outcome, Plan, Slot, State, SystemClock};

use super::Store;
use super::sql::{
    SQLITE_DELETE, SQLITE_DELETE_ALL, SQLITE_SCHEMA, SQLITE_SELECT, SQLITE_UPSERT, key_columns,
    saves,
};
use crate::StoreError;

/// How SQLite makes a commit durable; see [`SqliteStoreBuilder::synchronous`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Synchronous {
    /// `synchronous=NORMAL` in WAL mode: a commit survives the process being killed
    /// (`kill -9`), but may be lost if the machine loses power before the WAL is checkpointed.
    #[default]
    Normal,
    /// `synchronous=FULL`: every commit is flushed to disk before it is acknowledged; it
    /// survives power loss, at the cost of an fsync per request.
    Full,
}

/// Options for a [`SqliteStore`].
#[derive(Debug, Clone)]
pub struct SqliteStoreBuilder {
    synchronous: Synchronous,
    busy_timeout: Duration,
}

impl Default for SqliteStoreBuilder {
    fn default() -> Self {
        SqliteStoreBuilder {
            synchronous: Synchronous::default(),
            busy_timeout: Duration::from_secs(5),
        }
    }
}

impl SqliteStoreBuilder {
    /// How durable a commit is (default [`Synchronous::Normal`]).
    #[must_use]
    pub fn synchronous(mut self, synchronous: Synchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// How long a request waits for another process's write lock before failing (closed)
    /// with a [`StoreError`]; default 5 s.
    #[must_use]
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// Opens (or creates) the database file at `path`, on the system clock.
    ///
    /// # Errors
    ///
    /// The file cannot be opened or the table created.
    pub fn open(self, path: impl AsRef<Path>) -> Result<SqliteStore, StoreError> {
        self.open_with_clock(path, SystemClock)
    }

    /// Opens (or creates) the database file at `path`, on `clock`.
    ///
    /// # Errors
    ///
    /// The file cannot be opened or the table created.
    pub fn open_with_clock<C: Clock>(
        self,
        path: impl AsRef<Path>,
        clock: C,
    ) -> Result<SqliteStore<C>, StoreError> {
        let path = path.as_ref();
        let conn = Connection::open(path)
            .map_err(|e| sql_error(&format!("cannot open {}", path.display()), e))?;
        self.prepare(conn, clock)
    }

    /// A private database in memory, gone when the store is dropped: for tests.
    ///
    /// # Errors
    ///
    /// The table cannot be created.
    pub fn open_in_memory_with_clock<C: Clock>(
        self,
        clock: C,
    ) -> Result<SqliteStore<C>, StoreError> {
        let conn = Connection::open_in_memory().map_err(|e| sql_error("cannot open", e))?;
        self.prepare(conn, clock)
    }

    fn prepare<C: Clock>(self, conn: Connection, clock: C) -> Result<SqliteStore<C>, StoreError> {
        let sync = match self.synchronous {
            Synchronous::Normal => "NORMAL",
            Synchronous::Full => "FULL",
        };
        conn.busy_timeout(self.busy_timeout)
            .map_err(|e| sql_error("cannot set busy_timeout", e))?;
        // journal_mode answers with a row, so it is queried rather than executed.
        let mode: String = conn
            .query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))
            .map_err(|e| sql_error("cannot enable WAL", e))?;
        if !mode.eq_ignore_ascii_case("wal") && !mode.eq_ignore_ascii_case("memory") {
            return Err(StoreError::new(format!("sqlite: journal_mode is {mode}, not WAL")));
        }
        conn.execute_batch(&format!("PRAGMA synchronous = {sync};"))
            .map_err(|e| sql_error("cannot set synchronous", e))?;
        create_schema(&conn)?;
        Ok(SqliteStore { conn: Mutex::new(conn), clock })
    }
}

/// Creates tollgate's table in `conn` if it is missing; for apps that join the limiter to
/// their own transactions ([`SqliteTransaction`]). [`SqliteStore`] does it by itself.
///
/// # Errors
///
/// The statement fails.
pub fn create_schema(conn: &Connection) -> Result<(), StoreError> {
    conn.execute_batch(SQLITE_SCHEMA).map_err(|e| sql_error("cannot create the table", e))
}

/// States in a SQLite file (SPEC §5): the server's embedded default.
///
/// Each request is one `BEGIN IMMEDIATE` transaction, which takes the database's write lock
/// before reading, so concurrent writers (threads, or other processes on the same file)
/// queue up instead of deadlocking on a lock upgrade; a writer that waits longer than the
/// busy timeout gets a [`StoreError`] and nothing is admitted. The file is in WAL mode.
/// A state that a request leaves full is deleted; [`SqliteStore::sweep`] deletes those that
/// have refilled since.
///
/// # Examples
///
/// ```
/// use tollgate::store::SqliteStore;
/// use tollgate::{Config, RateLimiter, MINUTE};
///
/// let dir = tempfile::tempdir().unwrap();
/// let limiter = RateLimiter::new(SqliteStore::open(dir.path().join("limits.db")).unwrap());
/// let send = ("send", Config::token_bucket(10.0, MINUTE));
/// assert!(limiter.limit(send, "alice").unwrap().ok);
/// ```
pub struct SqliteStore<C: Clock = SystemClock> {
    conn: Mutex<Connection>,
    clock: C,
}

impl SqliteStore {
    /// Opens (or creates) the database file at `path` with the default options.
    ///
    /// # Errors
    ///
    /// The file cannot be opened or the table created.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        SqliteStoreBuilder::default().open(path)
    }

    /// Options: durability, busy timeout.
    pub fn builder() -> SqliteStoreBuilder {
        SqliteStoreBuilder::default()
    }
}

impl<C: Clock> SqliteStore<C> {
    /// Deletes the states of `name` that are full at the store's time: they carry no
    /// information. Returns how many. A server runs this now and then for its limits.
    ///
    /// # Errors
    ///
    /// The statement fails.
    pub fn sweep(&self, name: &str, config: &Config) -> Result<usize, StoreError> {
        let shard = config.per_shard();
        let now = self.clock.now();
        // The states that evaluate to capacity now (SPEC §2 with count 0).
        let sql = match shard.kind() {
            Kind::TokenBucket => {
                "DELETE FROM tollgate_state WHERE name = ?1 AND ts <= ?2 \
                 AND value + (?2 - ts) * ?3 / ?4 >= ?5"
            }
            Kind::FixedWindow => {
                "DELETE FROM tollgate_state WHERE name = ?1 AND ts <= ?2 \
                 AND value + ?3 * CAST((?2 - ts) / ?4 AS INTEGER) >= ?5"
            }
        };
        let conn = self.conn.lock();
        conn.execute(sql, params![name, now, shard.rate(), shard.period(), shard.capacity()])
            .map_err(|e| sql_error("sweep failed", e))
    }

    /// Runs `run` in a `BEGIN IMMEDIATE` transaction, committed if it succeeds and rolled
    /// back if not. `BEGIN` and `COMMIT` are cached statements, not parsed again per request.
    fn immediate<T>(
        &self,
        run: impl FnOnce(&Connection, f64) -> rusqlite::Result<T>,
    ) -> Result<T, StoreError> {
        let conn = self.conn.lock();
        let cached = |sql: &str| conn.prepare_cached(sql).and_then(|mut s| s.execute([]));
        cached("BEGIN IMMEDIATE").map_err(|e| sql_error("cannot begin", e))?;
        // Read the clock once the write lock is held, so times go in commit order.
        let now = self.clock.now();
        let result = run(&conn, now).and_then(|result| cached("COMMIT").map(|_| result));
        result.map_err(|e| {
            // Whatever failed, nothing of this request stays; without a transaction still
            // open (COMMIT failed after ending it) there is nothing to roll back.
            if !conn.is_autocommit() {
                let _ = conn.execute_batch("ROLLBACK");
            }
            sql_error("request failed", e)
        })
    }
}

impl<C: Clock> Store for SqliteStore<C> {
    fn execute(&self, plan: &Plan<'_>) -> Result<Outcome, StoreError> {
        self.immediate(|conn, now| execute_on(conn, plan, now))
    }

    fn read(&self, slots: &[Slot<'_>]) -> Result<(f64, Vec<Option<State>>), StoreError> {
        let conn = self.conn.lock();
        let now = self.clock.now();
        let states = load(&conn, slots).map_err(|e| sql_error("read failed", e))?;
        Ok((now, states))
    }

    fn delete(&self, name: &str, key: Option<&str>, shards: u16) -> Result<(), StoreError> {
        self.immediate(|conn, _| delete_all(conn, name, key, shards))
    }
}

/// The limiter inside a transaction of your own, on your own connection: the tokens are
/// spent if you commit and given back if you roll back.
///
/// Begin the transaction with `TransactionBehavior::Immediate`, so that it holds the write
/// lock before tollgate reads (a deferred one may fail to upgrade under concurrent writers,
/// which tollgate reports as a [`StoreError`]). Create the table once with
/// [`create_schema`].
///
/// # Examples
///
/// ```
/// use rusqlite::{Connection, TransactionBehavior};
/// use tollgate::store::{create_schema, SqliteStore, SqliteTransaction};
/// use tollgate::{Config, RateLimiter, MINUTE};
///
/// let mut conn = Connection::open_in_memory().unwrap();
/// create_schema(&conn).unwrap();
/// conn.execute_batch("CREATE TABLE orders (item TEXT)").unwrap();
/// let limiter = RateLimiter::new(tollgate::MemoryStore::new()); // its definitions are reused
/// let orders = ("orders", Config::token_bucket(1.0, MINUTE));
///
/// // The order fails after the limit was taken: roll back, and the token is back.
/// let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).unwrap();
/// assert!(limiter.on(SqliteTransaction::new(&tx)).limit(orders, "alice").unwrap().ok);
/// tx.rollback().unwrap();
///
/// let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).unwrap();
/// assert!(limiter.on(SqliteTransaction::new(&tx)).limit(orders, "alice").unwrap().ok);
/// tx.execute("INSERT INTO orders VALUES ('book')", []).unwrap();
/// tx.commit().unwrap(); // spent, together with the order
///
/// let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).unwrap();
/// assert!(!limiter.on(SqliteTransaction::new(&tx)).limit(orders, "alice").unwrap().ok);
/// ```
pub struct SqliteTransaction<'c, C: Clock = SystemClock> {
    conn: &'c Connection,
    clock: C,
}

impl<'c> SqliteTransaction<'c> {
    /// The limiter's states in `conn`'s current transaction (a `rusqlite::Transaction`
    /// dereferences to its connection), on the system clock.
    pub fn new(conn: &'c Connection) -> Self {
        SqliteTransaction { conn, clock: SystemClock }
    }
}

impl<'c, C: Clock> SqliteTransaction<'c, C> {
    /// The same, on `clock`.
    pub fn with_clock(conn: &'c Connection, clock: C) -> Self {
        SqliteTransaction { conn, clock }
    }
}

impl<C: Clock> Store for SqliteTransaction<'_, C> {
    fn execute(&self, plan: &Plan<'_>) -> Result<Outcome, StoreError> {
        execute_on(self.conn, plan, self.clock.now()).map_err(|e| sql_error("request failed", e))
    }

    fn read(&self, slots: &[Slot<'_>]) -> Result<(f64, Vec<Option<State>>), StoreError> {
        let states = load(self.conn, slots).map_err(|e| sql_error("read failed", e))?;
        Ok((self.clock.now(), states))
    }

    fn delete(&self, name: &str, key: Option<&str>, shards: u16) -> Result<(), StoreError> {
        delete_all(self.conn, name, key, shards).map_err(|e| sql_error("delete failed", e))
    }
}

fn load(conn: &Connection, slots: &[Slot<'_>]) -> rusqlite::Result<Vec<Option<State>>> {
    let mut select = conn.prepare_cached(SQLITE_SELECT)?;
    slots
        .iter()
        .map(|slot| {
            let (has_key, key) = key_columns(slot.key);
            select
                .query_row(params![slot.name, has_key, key, slot.shard], |row| {
                    Ok(State { value: row.get(0)?, ts: row.get(1)? })
                })
                .optional()
        })
        .collect()
}

/// One request within a transaction already begun: load, decide, save what changed
/// (deleting states that are full).
fn execute_on(conn: &Connection, plan: &Plan<'_>, now: f64) -> rusqlite::Result<Outcome> {
    let mut states = load(conn, plan.slots())?;
    let outcome = plan.decide(now, &mut states);
    if outcome.any_changed() {
        let mut upsert = conn.prepare_cached(SQLITE_UPSERT)?;
        let mut delete = conn.prepare_cached(SQLITE_DELETE)?;
        for (slot, state) in saves(plan, &states, &outcome, now) {
            let (has_key, key) = key_columns(slot.key);
            match state {
                Some(s) => {
                    upsert.execute(params![slot.name, has_key, key, slot.shard, s.value, s.ts])?
                }
                None => delete.execute(params![slot.name, has_key, key, slot.shard])?,
            };
        }
    }
    Ok(outcome)
}

fn delete_all(
    conn: &Connection,
    name: &str,
    key: Option<&str>,
    shards: u16,
) -> rusqlite::Result<()> {
    let (has_key, key) = key_columns(key);
    conn.execute(SQLITE_DELETE_ALL, params![name, has_key, key, shards])?;
    Ok(())
}

fn sql_error(what: &str, e: rusqlite::Error) -> StoreError {
    StoreError::with_source(format!("sqlite: {what}: {e}"), e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_core::{MINUTE, ManualClock, Take};

    #[test]
    fn sweep_deletes_only_full_states() {
        let clock = ManualClock::new(1_000_000.0);
        let store = SqliteStore::builder().open_in_memory_with_clock(clock.clone()).unwrap();
        let config = Config::token_bucket(10.0, MINUTE);
        for (key, count) in [("a", 1.0), ("b", 5.0)] {
            let mut plan = Plan::new(true);
            plan.push(&Take { name: "n", key: Some(key), config, count, reserve: false }, 0, 0)
                .unwrap();
            store.execute(&plan).unwrap();
        }
        clock.advance(6_000.0); // "a" is full again, "b" needs 30 s
        assert_eq!(store.sweep("n", &config).unwrap(), 1);
        clock.advance(24_000.0);
        assert_eq!(store.sweep("n", &config).unwrap(), 1);
        assert_eq!(store.sweep("n", &config).unwrap(), 0);
    }
}
