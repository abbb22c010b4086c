//! The limiter inside your own [sqlx](https://docs.rs/sqlx) transaction (features
//! `sqlx-postgres`, `sqlx-sqlite`): [`RateLimiter::limit_in`], [`RateLimiter::check_in`] and
//! [`RateLimiter::transaction_in`] take and save the states with the connection of a
//! transaction you began, so that if you roll back, the tokens are back, and if you commit,
//! they are spent together with your own writes. Concurrency limits likewise:
//! [`RateLimiter::acquire_in`], [`RateLimiter::release_in`] and [`RateLimiter::renew_in`]
//! hold, free or extend slots only if you commit.
//!
//! The states live in the table `tollgate_state` of that database, as with [`PgStore`] and
//! [`SqliteStore`] (the same rows: a limit may be used both ways), and the holders of
//! concurrency limits beside it (`tollgate_state_slots` on PostgreSQL, `tollgate_slots` on
//! SQLite). Create them once, at start-up or in your migrations, with [`create_table`].
//!
//! - **PostgreSQL**: transaction-scoped advisory locks on the request's slots, in ascending
//!   order, then one query for the states and the database's clock; correct under READ
//!   COMMITTED. The locks are held until your transaction ends, so keep it short, and take
//!   several limits in one `transaction_in` (locked in ascending order, as every tollgate
//!   request locks them) rather than in separate calls: a transaction that holds one slot
//!   and then waits for another can deadlock with a request that locks both (PostgreSQL
//!   then fails one of them with an error; nothing is admitted by it).
//! - **SQLite**: SQLite runs one writer at a time, so a request is atomic within your
//!   transaction; the time is the process's clock. Begin with `BEGIN IMMEDIATE` when other
//!   connections write to the same file (sqlx's `begin_with("BEGIN IMMEDIATE")`), or a
//!   concurrent writer may make your transaction fail with "database is locked" (an error,
//!   never an admission).
//!
//! Every call runs inside a savepoint, so a call that fails leaves your transaction as it
//! was. On PostgreSQL a connection outside a transaction is refused with an error (its
//! advisory locks would not hold).
//!
//! # Examples
//!
//! ```no_run
//! use tollgate::{Config, MemoryStore, RateLimiter, MINUTE};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/app").await?;
//! tollgate::sqlx::create_table(&mut *pool.acquire().await?).await?;
//! // The limiter's own store is not used by the *_in calls; memory is the cheapest.
//! let limiter = RateLimiter::new(MemoryStore::new());
//! let orders = ("orders", Config::token_bucket(10.0, MINUTE));
//!
//! let mut tx = pool.begin().await?;
//! if limiter.limit_in(&mut *tx, orders, "alice").await?.ok {
//!     sqlx::query("INSERT INTO orders (customer) VALUES ('alice')").execute(&mut *tx).await?;
//!     tx.commit().await?; // the token is spent together with the order
//! } // else dropped: rolled back, nothing was taken
//! # Ok(())
//! # }
//! ```
//!
#![cfg_attr(feature = "postgres", doc = "[`PgStore`]: crate::store::PgStore")]
#![cfg_attr(not(feature = "postgres"), doc = "[`PgStore`]: ../index.html#features")]
#![cfg_attr(feature = "sqlite", doc = "[`SqliteStore`]: crate::store::SqliteStore")]
#![cfg_attr(not(feature = "sqlite"), doc = "[`SqliteStore`]: ../index.html#features")]

use std::future::Future;
use std::pin::Pin;

use tollgate_algebra::slots::{Concurrency, SlotAnswer, SlotOp, Write};
use tollgate_algebra::{Decision, Outcome, Plan, State};

use crate::concurrency::{Acquire, Acquired, SlotsTarget, acquired, released, renewed, renewing};
use crate::limiter::{Call, Request, Target, TransactionDecision, TransactionTaken};
use crate::store::sql::{SlotSql, decide_slots, key_columns, saves};
use crate::{Error, RateLimiter, StoreError};

mod sealed {
    pub trait Sealed {}
}

/// A boxed future of a store call: boxed so that the futures of the `*_in` calls are `Send`
/// whatever the lifetimes (which `impl Future` in a trait cannot promise yet); one
/// allocation is nothing beside a round trip to the database.
type Boxed<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// A sqlx connection the limiter can run in: `PgConnection` (feature `sqlx-postgres`) or
/// `SqliteConnection` (feature `sqlx-sqlite`). Pass `&mut *tx` for a `sqlx::Transaction`.
pub trait Connection: sealed::Sealed + Send {
    /// Loads the plan's slots, decides, and saves what changed, within a savepoint of the
    /// connection's current transaction.
    #[doc(hidden)]
    fn execute_plan<'a, 'p: 'a>(&'a mut self, plan: &'a Plan<'p>) -> Boxed<'a, Outcome>;

    /// An operation on the holders of a concurrency limit's (name, key), within a savepoint
    /// of the connection's current transaction.
    #[doc(hidden)]
    fn slots<'a>(
        &'a mut self,
        name: &'a str,
        key: Option<&'a str>,
        limit: &'a Concurrency,
        op: &'a SlotOp,
    ) -> Boxed<'a, SlotAnswer>;

    /// Creates the table if it is missing.
    #[doc(hidden)]
    fn create_table(&mut self) -> Boxed<'_, ()>;
}

/// Creates tollgate's tables (`tollgate_state`, and the holders of concurrency limits beside
/// it) in the database of `conn` if they are missing.
/// Run it once, outside the transactions that use the limiter (a rolled-back transaction
/// would take the table with it). Instances that start together may all call it: on
/// PostgreSQL they take turns (an advisory lock, the one `PgStore` takes to create its
/// table), so none fails because another created the table at the same moment.
///
/// # Errors
///
/// The statement fails.
pub async fn create_table(conn: &mut impl Connection) -> Result<(), StoreError> {
    conn.create_table().await
}

impl<S: Sync> RateLimiter<S> {
    /// [`RateLimiter::limit`] inside your transaction on `conn` (see [the module](self)):
    /// the tokens are spent if you commit, and back if you roll back.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::limit`]; a database error is [`Error::Store`], and leaves your
    /// transaction as it was before the call.
    pub async fn limit_in<'n, 'k>(
        &self,
        conn: &mut impl Connection,
        target: impl Into<Target<'n>>,
        request: impl Into<Request<'k>>,
    ) -> Result<Decision, Error> {
        let (target, request) = (target.into(), request.into());
        self.single_in(conn, true, target, request).await
    }

    /// [`RateLimiter::check`] inside your transaction on `conn`: nothing is taken.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::limit_in`].
    pub async fn check_in<'n, 'k>(
        &self,
        conn: &mut impl Connection,
        target: impl Into<Target<'n>>,
        request: impl Into<Request<'k>>,
    ) -> Result<Decision, Error> {
        let (target, request) = (target.into(), request.into());
        self.single_in(conn, false, target, request).await
    }

    /// [`RateLimiter::transaction`] (several limits, all or nothing) inside your transaction
    /// on `conn`.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::transaction`]; a database error is [`Error::Store`].
    pub async fn transaction_in(
        &self,
        conn: &mut impl Connection,
        calls: &[Call<'_>],
    ) -> Result<TransactionDecision, Error> {
        let plan = self.plan(true, calls.iter().map(|c| (c.target, c.request)))?;
        let outcome = conn.execute_plan(&plan).await?;
        let taken: TransactionTaken = outcome.into();
        self.check_refused(calls, taken.decision.ok, &taken.decision.results)?;
        Ok(taken.decision)
    }

    /// [`RateLimiter::acquire`] inside your transaction on `conn`: the slots are held from
    /// when you commit (their `ttl` counts from this call), and never were if you roll back.
    /// Release them with [`RateLimiter::release_in`], or through a `PgStore` or
    /// `SqliteStore` on the same database (the same rows).
    ///
    /// On PostgreSQL the (name, key)'s lock is held until your transaction ends, and every
    /// other operation on it (in any process) waits for that: keep the transaction short.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::acquire`]; a database error is [`Error::Store`], and leaves your
    /// transaction as it was before the call.
    pub async fn acquire_in<'n, 'k>(
        &self,
        conn: &mut impl Connection,
        target: impl Into<SlotsTarget<'n>>,
        request: impl Into<Acquire<'k>>,
    ) -> Result<Acquired, Error> {
        let request = request.into();
        let call = self.slot_call(target.into(), request.key, |l| request.op(l))?;
        let answer = conn.slots(call.name, call.key, &call.limit, &call.op).await?;
        acquired(call.name, request.throws, answer)
    }

    /// [`RateLimiter::release`] inside your transaction on `conn`: the slots are free once
    /// you commit.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::acquire_in`].
    pub async fn release_in<'n>(
        &self,
        conn: &mut impl Connection,
        target: impl Into<SlotsTarget<'n>>,
        key: Option<&str>,
        ticket: u64,
    ) -> Result<bool, Error> {
        let call = self.slot_call(target.into(), key, |_| SlotOp::Release { ticket })?;
        released(conn.slots(call.name, call.key, &call.limit, &call.op).await?)
    }

    /// [`RateLimiter::renew`] inside your transaction on `conn`: the new expiry holds once
    /// you commit.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::acquire_in`].
    pub async fn renew_in<'n>(
        &self,
        conn: &mut impl Connection,
        target: impl Into<SlotsTarget<'n>>,
        key: Option<&str>,
        ticket: u64,
        ttl: Option<f64>,
    ) -> Result<Option<f64>, Error> {
        let call = self.slot_call(target.into(), key, renewing(ticket, ttl))?;
        renewed(conn.slots(call.name, call.key, &call.limit, &call.op).await?)
    }

    async fn single_in(
        &self,
        conn: &mut impl Connection,
        writes: bool,
        target: Target<'_>,
        request: Request<'_>,
    ) -> Result<Decision, Error> {
        let plan = self.plan(writes, std::iter::once((target, request)))?;
        let decision = conn.execute_plan(&plan).await?.decision();
        if request.throws && !decision.ok {
            return Err(crate::limiter::refused(target.name(), decision));
        }
        Ok(decision)
    }
}

fn sqlx_error(what: &str, e: sqlx::Error) -> StoreError {
    // A missing table is a setup step not taken: say which.
    let missing_table = e.as_database_error().is_some_and(|d| {
        d.code().as_deref() == Some("42P01") || d.message().contains("no such table")
    });
    let hint = if missing_table {
        "; create tollgate's table once with tollgate::sqlx::create_table (or by opening a \
         PgStore or SqliteStore on this database)"
    } else {
        ""
    };
    StoreError::with_source(format!("sqlx: {what}: {e}{hint}"), e)
}

/// Saves what a decided plan changed on `conn`: an upsert per new state, a delete per state
/// that is full again (see [`saves`]). A macro, as the two databases' query types differ.
macro_rules! save {
    // `full_at`: whether the upsert also takes when the state is full again (SQLite's does).
    ($conn:expr, $plan:expr, $states:expr, $outcome:expr, $now:expr, $upsert:expr, $delete:expr, $full_at:expr) => {
        for (slot, state) in saves($plan, &$states, &$outcome, $now) {
            let ((has_key, key), shard) = (key_columns(slot.key), i32::from(slot.shard));
            let query = sqlx::query(if state.is_some() { $upsert } else { $delete })
                .bind(slot.name)
                .bind(has_key)
                .bind(key)
                .bind(shard);
            match state {
                Some(s) if $full_at => {
                    query.bind(s.value).bind(s.ts).bind(tollgate_algebra::full_at(&slot.config, s))
                }
                Some(s) => query.bind(s.value).bind(s.ts),
                None => query,
            }
            .execute(&mut *$conn)
            .await?;
        }
    };
}

/// The write a decision on a concurrency limit's holders says, as one statement of `sql`
/// with its parameters after the (name, has_key, key) that every one takes: a macro, as the
/// two databases' query types differ.
macro_rules! save_slots {
    ($conn:expr, $sql:expr, $write:expr, $name:expr, $has_key:expr, $key:expr) => {{
        let sql: &'static SlotSql = $sql;
        // Tickets are at most 2^53 - 1 (made by the database, checked when read back),
        // counts at most 2^30: exact as the columns' signed integers.
        let query = |text: &'static str| sqlx::query(text).bind($name).bind($has_key).bind($key);
        let statement = match $write {
            Write::Nothing => None,
            Write::Add(h) => {
                Some(query(&sql.insert).bind(h.ticket as i64).bind(h.count as i32).bind(h.expiry))
            }
            Write::Remove(ticket) => Some(query(&sql.remove).bind(ticket as i64)),
            Write::Expiry(ticket, expiry) => {
                Some(query(&sql.expiry).bind(ticket as i64).bind(expiry))
            }
            Write::Clear => Some(query(&sql.clear)),
        };
        if let Some(statement) = statement {
            statement.execute(&mut *$conn).await?;
        }
    }};
}

/// Runs `body` inside `SAVEPOINT tollgate`: released when it succeeds, rolled back to when
/// it fails, so a failed call leaves the caller's transaction as it was.
macro_rules! in_savepoint {
    ($conn:expr, $body:expr) => {{
        sqlx::query("SAVEPOINT tollgate")
            .execute(&mut *$conn)
            .await
            .map_err(|e| sqlx_error("cannot make a savepoint (is a transaction begun?)", e))?;
        match $body {
            Ok(value) => {
                sqlx::query("RELEASE SAVEPOINT tollgate")
                    .execute(&mut *$conn)
                    .await
                    .map_err(|e| sqlx_error("cannot release the savepoint", e))?;
                Ok(value)
            }
            Err(e) => {
                let _ = sqlx::query("ROLLBACK TO SAVEPOINT tollgate").execute(&mut *$conn).await;
                let _ = sqlx::query("RELEASE SAVEPOINT tollgate").execute(&mut *$conn).await;
                Err(sqlx_error("request failed", e))
            }
        }
    }};
}

#[cfg(feature = "sqlx-postgres")]
mod postgres {
    use sqlx::{PgConnection, Row};

    use super::*;
    use crate::store::sql::{
        LOCK_CLASS, PG_LOCK, PgSql, SLOTS_LOCK_CLASS, lock_id, lock_ids, pg_loaded,
    };

    /// The statements of the default table, made once (and so `'static`, as sqlx asks of
    /// statement text: their only variable part is the fixed table name).
    fn sql() -> &'static PgSql {
        static SQL: std::sync::OnceLock<PgSql> = std::sync::OnceLock::new();
        SQL.get_or_init(|| PgSql::new("tollgate_state"))
    }

    impl sealed::Sealed for PgConnection {}

    impl Connection for PgConnection {
        fn execute_plan<'a, 'p: 'a>(&'a mut self, plan: &'a Plan<'p>) -> Boxed<'a, Outcome> {
            Box::pin(async move {
                // A savepoint outside a transaction block is an error in PostgreSQL: that
                // is what refuses a bare connection, whose advisory locks would not hold.
                in_savepoint!(self, execute(self, plan).await)
            })
        }

        fn slots<'a>(
            &'a mut self,
            name: &'a str,
            key: Option<&'a str>,
            limit: &'a Concurrency,
            op: &'a SlotOp,
        ) -> Boxed<'a, SlotAnswer> {
            Box::pin(async move {
                in_savepoint!(self, slots(self, name, key, limit, op).await).and_then(|a| a)
            })
        }

        fn create_table(&mut self) -> Boxed<'_, ()> {
            static CREATE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
            let create = CREATE.get_or_init(|| {
                locked_create(&format!("{}; {}", sql().create, sql().slots.create))
            });
            Box::pin(async move { create_with(self, create).await })
        }
    }

    /// `create` (a `CREATE TABLE IF NOT EXISTS`) behind the advisory lock that `PgStore`
    /// takes to create its table too. Without it, app instances that start together race: of
    /// two concurrent creates of a missing table, PostgreSQL fails one ("duplicate key value
    /// violates unique constraint"). Sent as one simple query, which PostgreSQL runs as one
    /// transaction, so the lock is held until the table exists (or to the end of the
    /// caller's transaction, if one is open).
    fn locked_create(create: &str) -> String {
        format!("SELECT pg_advisory_xact_lock({LOCK_CLASS}, 0); {create}")
    }

    async fn create_with(conn: &mut PgConnection, locked: &'static str) -> Result<(), StoreError> {
        sqlx::raw_sql(locked)
            .execute(conn)
            .await
            .map_err(|e| sqlx_error("cannot create the table", e))?;
        Ok(())
    }

    async fn execute(conn: &mut PgConnection, plan: &Plan<'_>) -> Result<Outcome, sqlx::Error> {
        let sql = sql();
        let slots = plan.slots();
        for id in lock_ids(slots) {
            sqlx::query(PG_LOCK).bind(LOCK_CLASS).bind(id).execute(&mut *conn).await?;
        }
        let names: Vec<&str> = slots.iter().map(|s| s.name).collect();
        let has_keys: Vec<bool> = slots.iter().map(|s| s.key.is_some()).collect();
        let keys: Vec<&str> = slots.iter().map(|s| s.key.unwrap_or("")).collect();
        let shards: Vec<i32> = slots.iter().map(|s| i32::from(s.shard)).collect();
        let rows = sqlx::query(sql.load.as_str())
            .bind(names)
            .bind(has_keys)
            .bind(keys)
            .bind(shards)
            .fetch_all(&mut *conn)
            .await?;
        let mut now = 0.0;
        let mut states: Vec<Option<State>> = vec![None; slots.len()];
        for row in rows {
            let i: i64 = row.try_get(0)?;
            now = row.try_get(3)?;
            let (value, ts): (Option<f64>, Option<f64>) = (row.try_get(1)?, row.try_get(2)?);
            if let (Some(value), Some(ts), Some(slot)) =
                (value, ts, usize::try_from(i - 1).ok().and_then(|i| states.get_mut(i)))
            {
                *slot = Some(State { value, ts });
            }
        }
        let outcome = plan.decide(now, &mut states);
        save!(conn, plan, states, outcome, now, sql.upsert.as_str(), sql.delete.as_str(), false);
        Ok(outcome)
    }

    /// An operation on the holders of (name, key), as `PgTransaction` runs it (see the
    /// `PgStore`'s `slots` module for why the advisory lock), on the database's clock: the
    /// (name, key)'s lock, then the holders left once those expired are deleted, with the
    /// time and (for an acquire) a new ticket, then the write. The inner error: what was
    /// read is garbage, or the operation invalid.
    async fn slots(
        conn: &mut PgConnection,
        name: &str,
        key: Option<&str>,
        limit: &Concurrency,
        op: &SlotOp,
    ) -> Result<Result<SlotAnswer, StoreError>, sqlx::Error> {
        let sql = &sql().slots;
        let (has_key, key_text) = key_columns(key);
        let lock = lock_id(name, key, 0);
        sqlx::query(PG_LOCK).bind(SLOTS_LOCK_CLASS).bind(lock).execute(&mut *conn).await?;
        let acquires = matches!(op, SlotOp::Acquire { .. });
        let rows = sqlx::query(sql.load.as_str())
            .bind(name)
            .bind(has_key)
            .bind(key_text)
            .bind(None::<f64>)
            .bind(acquires)
            .fetch_all(&mut *conn)
            .await?;
        let mut read = Vec::with_capacity(rows.len());
        for row in rows {
            let holder = match row.try_get::<Option<i64>, _>(2)? {
                Some(ticket) => {
                    Some((ticket, i64::from(row.try_get::<i32, _>(3)?), row.try_get(4)?))
                }
                None => None,
            };
            read.push((row.try_get(0)?, row.try_get(1)?, holder));
        }
        let decided = pg_loaded(read, acquires)
            .and_then(|(now, holders, ticket)| decide_slots(limit, &holders, now, op, ticket));
        let (answer, write) = match decided {
            Ok(decided) => decided,
            Err(e) => return Ok(Err(e)),
        };
        save_slots!(conn, sql, write, name, has_key, key_text);
        Ok(Ok(answer))
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use crate::store::testing::backend_url;

        /// Eight connections create one missing table at once, five times over: all succeed.
        /// (Without the lock, most rounds fail on this machine.)
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn concurrent_creates_of_a_missing_table_all_succeed() {
            let Some(url) = backend_url("TOLLGATE_POSTGRES_URL") else { return };
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(8)
                .connect(&url)
                .await
                .unwrap();
            for round in 0..5 {
                let table = format!("tollgate_create_race_{}_{round}", std::process::id());
                // sqlx takes only `'static` statement text: a test may leak a few.
                let leak = |sql: String| -> &'static str { Box::leak(sql.into_boxed_str()) };
                let drop = leak(format!("DROP TABLE IF EXISTS {table}"));
                sqlx::raw_sql(drop).execute(&pool).await.unwrap();
                let create = leak(locked_create(&PgSql::new(&table).create));
                let mut conns = Vec::new();
                for _ in 0..8 {
                    conns.push(pool.acquire().await.unwrap());
                }
                let tasks: Vec<_> = conns
                    .into_iter()
                    .map(|mut conn| {
                        tokio::spawn(async move { create_with(&mut conn, create).await })
                    })
                    .collect();
                let mut results = Vec::new();
                for task in tasks {
                    results.push(task.await.unwrap());
                }
                sqlx::raw_sql(drop).execute(&pool).await.unwrap();
                for result in results {
                    result.unwrap();
                }
            }
        }
    }
}

#[cfg(feature = "sqlx-sqlite")]
mod sqlite {
    use sqlx::{Row, SqliteConnection};
    use tollgate_algebra::{Clock, SystemClock};

    use super::*;
    use crate::store::sql::{
        SQLITE_ADD_FULL_AT, SQLITE_DELETE, SQLITE_HAS_FULL_AT, SQLITE_SCHEMA, SQLITE_SELECT,
        SQLITE_UPSERT, holders_of, next_ticket,
    };

    impl sealed::Sealed for SqliteConnection {}

    impl Connection for SqliteConnection {
        fn execute_plan<'a, 'p: 'a>(&'a mut self, plan: &'a Plan<'p>) -> Boxed<'a, Outcome> {
            Box::pin(async move { in_savepoint!(self, execute(self, plan).await) })
        }

        fn slots<'a>(
            &'a mut self,
            name: &'a str,
            key: Option<&'a str>,
            limit: &'a Concurrency,
            op: &'a SlotOp,
        ) -> Boxed<'a, SlotAnswer> {
            Box::pin(async move {
                in_savepoint!(self, slots(self, name, key, limit, op).await).and_then(|a| a)
            })
        }

        fn create_table(&mut self) -> Boxed<'_, ()> {
            Box::pin(async move {
                sqlx::raw_sql(SQLITE_SCHEMA)
                    .execute(&mut *self)
                    .await
                    .map_err(|e| sqlx_error("cannot create the table", e))?;
                sqlx::raw_sql(SlotSql::sqlite().create.as_str())
                    .execute(&mut *self)
                    .await
                    .map_err(|e| sqlx_error("cannot create the table of holders", e))?;
                // A table of an earlier version gets the column that sweeps use.
                let has_full_at = sqlx::query(SQLITE_HAS_FULL_AT)
                    .fetch_optional(&mut *self)
                    .await
                    .map_err(|e| sqlx_error("cannot read the table's columns", e))?
                    .is_some();
                if !has_full_at {
                    sqlx::raw_sql(SQLITE_ADD_FULL_AT)
                        .execute(&mut *self)
                        .await
                        .map_err(|e| sqlx_error("cannot add full_at to the table", e))?;
                }
                Ok(())
            })
        }
    }

    async fn execute(conn: &mut SqliteConnection, plan: &Plan<'_>) -> Result<Outcome, sqlx::Error> {
        let slots = plan.slots();
        let mut states: Vec<Option<State>> = Vec::with_capacity(slots.len());
        for slot in slots {
            let (has_key, key) = key_columns(slot.key);
            let row = sqlx::query(SQLITE_SELECT)
                .bind(slot.name)
                .bind(has_key)
                .bind(key)
                .bind(i32::from(slot.shard))
                .fetch_optional(&mut *conn)
                .await?;
            states.push(match row {
                Some(row) => Some(State { value: row.try_get(0)?, ts: row.try_get(1)? }),
                None => None,
            });
        }
        let now = SystemClock.now();
        let outcome = plan.decide(now, &mut states);
        save!(conn, plan, states, outcome, now, SQLITE_UPSERT, SQLITE_DELETE, true);
        Ok(outcome)
    }

    /// An operation on the holders of (name, key), as `SqliteTransaction` runs it, on the
    /// process's clock: the holders expired by then deleted, the others loaded, the last
    /// ticket made read for an acquire, the decision written (with the new last ticket).
    /// SQLite's one writer at a time makes it atomic. The inner error: what was read is
    /// garbage, or the operation invalid.
    async fn slots(
        conn: &mut SqliteConnection,
        name: &str,
        key: Option<&str>,
        limit: &Concurrency,
        op: &SlotOp,
    ) -> Result<Result<SlotAnswer, StoreError>, sqlx::Error> {
        let sql = SlotSql::sqlite();
        let (has_key, key_text) = key_columns(key);
        let now = SystemClock.now();
        let this = |text: &'static str| sqlx::query(text).bind(name).bind(has_key).bind(key_text);
        this(sql.expire.as_str()).bind(now).execute(&mut *conn).await?;
        let rows = this(sql.load.as_str()).fetch_all(&mut *conn).await?;
        let read = rows
            .iter()
            .map(|row| Ok((row.try_get(0)?, row.try_get(1)?, row.try_get(2)?)))
            .collect::<Result<Vec<(i64, i64, f64)>, sqlx::Error>>()?;
        // Only an acquire makes a ticket (the others pass decide one it does not use).
        let last: Option<Option<i64>> = match op {
            SlotOp::Acquire { .. } => {
                let row = sqlx::query(sql.last_ticket.as_str()).fetch_optional(&mut *conn).await?;
                Some(row.map(|row| row.try_get(0)).transpose()?)
            }
            _ => None,
        };
        let decided = holders_of(read).and_then(|holders| {
            let ticket = last.map_or(Ok(0), next_ticket)?;
            decide_slots(limit, &holders, now, op, ticket)
        });
        let (answer, write) = match decided {
            Ok(decided) => decided,
            Err(e) => return Ok(Err(e)),
        };
        save_slots!(conn, sql, write, name, has_key, key_text);
        if let Write::Add(h) = write {
            // Tickets are at most 2^53 - 1: exact as the column's signed integer.
            let ticket = h.ticket as i64;
            sqlx::query(sql.save_ticket.as_str()).bind(ticket).execute(&mut *conn).await?;
        }
        Ok(Ok(answer))
    }
}
