//! States in PostgreSQL, on tokio-postgres: correct under READ COMMITTED, on the database's
//! clock, and never blocking a thread.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;
use tollgate_algebra::slots::{Concurrency, SlotAnswer, SlotOp};
use tollgate_algebra::{Clock, OneTake, Outcome, Plan, Slot, State, Taken};

use super::lease::{LeaseOptions, Leases};
use super::seam::{AsyncStore, BoxFuture};
use super::sql::{MAX_TABLE, PgSql, valid_table};
use super::ticket::{Claim, OwnedPlan, OwnedSlotOp, OwnedSlots, Ticket, ticket};
use crate::error::StoreError;

mod lease;
mod plan;
mod schema;
mod single;
mod slots;
mod transaction;
mod worker;

use schema::create_table;
use single::{OneRow, decided};
pub use transaction::PgTransaction;
use worker::{Job, work};

/// Options for a [`PgStore`].
#[derive(Debug, Clone)]
pub struct PgStoreBuilder {
    table: String,
    timeout: Duration,
    connections: usize,
    leases: std::collections::HashMap<String, LeaseOptions>,
}

impl Default for PgStoreBuilder {
    fn default() -> Self {
        PgStoreBuilder {
            table: "tollgate_state".into(),
            timeout: Duration::from_secs(2),
            connections: 4,
            leases: std::collections::HashMap::new(),
        }
    }
}

impl PgStoreBuilder {
    /// The table (default `tollgate_state`): letters, digits and `_`, at most 57 of them (the
    /// store also creates two functions named after it, `<table>_take` and `<table>_takes`).
    #[must_use]
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// How long to wait to connect, and for a statement, before failing (closed); default
    /// 2 s. A request that finds no connection free for as long (all busy with slow
    /// statements) is withdrawn, never sent; one whose statement timed out may have run,
    /// and its error says so ([`StoreError::may_have_taken`]).
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How many connections to keep (default 4), each driven by a task of the store's own.
    /// A connection runs one statement at a time; the one-take requests (the common `limit`)
    /// that wait meanwhile go together in its next statement, up to 64 of them in one
    /// transaction (group commit: one round trip and one commit for all; each request is
    /// still taken on its own, in arrival order, and answered only once that transaction has
    /// committed).
    #[must_use]
    pub fn connections(mut self, connections: usize) -> Self {
        self.connections = connections.max(1);
        self
    }

    /// Serves the limit `name` from leases, as `RedisStoreBuilder::lease` does on Redis:
    /// this process takes a share of the limit's tokens ahead and answers `limit` from it
    /// with one atomic operation and no database call while the lease lasts; the table
    /// counts leased tokens against the limit (a state's records are in its `leases`
    /// column), so every process together never admits more than the limit. Near the limit
    /// every request is a direct take. A transaction of the store's own takes a leased limit
    /// directly from the table (not from the lease), under the cap its leases set; in a
    /// transaction of yours ([`PgTransaction`]) a leased limit is refused, nothing taken. A
    /// leased limit has no shards (refused).
    #[must_use]
    pub fn lease(mut self, name: impl Into<String>, options: LeaseOptions) -> Self {
        self.leases.insert(name.into(), options);
        self
    }

    /// Connects to `url` (`postgres://user@host/db`), creates the table if it is missing,
    /// and uses the database's clock. Call it inside a Tokio runtime: the store's tasks and
    /// connections run on it.
    ///
    /// # Errors
    ///
    /// A bad URL or table name, or a database that cannot be reached or refuses the
    /// connection. [`StoreError::is_unavailable`] tells the two apart: a database that is
    /// down, not reachable or not accepting connections yet (which
    /// [`PgStoreBuilder::connect_lazy`] would wait for) is unavailable; one that refused
    /// the credentials or has no such database is not.
    pub async fn open(self, url: &str) -> Result<PgStore, StoreError> {
        let store = self.build(url, None)?;
        store.shared.ensure_table().await?;
        Ok(store)
    }

    /// The store of `url`, without connecting yet: the table is created (if missing) and
    /// the connections are made when the first request needs them, and a database that is
    /// down meanwhile fails each request as unavailable (closed) until it comes up, from
    /// when on it is used without anything to rebuild. For an app that must start while
    /// its database does not answer yet (containers started together, a database
    /// restarting). Call it inside a Tokio runtime: the store's tasks run on it.
    ///
    /// # Errors
    ///
    /// A bad URL or table name (nothing is connected to).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use tollgate::store::PgStore;
    /// use tollgate::{Config, RateLimiter, MINUTE};
    ///
    /// #[tokio::main]
    /// async fn main() {
    ///     // Made at once, even if PostgreSQL is not up yet.
    ///     let store = PgStore::builder().connect_lazy("postgres://postgres@127.0.0.1/app");
    ///     let limiter = RateLimiter::new(store.unwrap());
    ///     let send = ("send", Config::token_bucket(10.0, MINUTE));
    ///     // An error while the database is down; a decision once it is up.
    ///     let _ = limiter.limit_async(send, "alice").await;
    /// }
    /// ```
    pub fn connect_lazy(self, url: &str) -> Result<PgStore, StoreError> {
        self.build(url, None)
    }

    /// The same, on `clock` instead of the database's: for tests that set the time.
    ///
    /// # Errors
    ///
    /// As for [`PgStoreBuilder::open`].
    pub async fn open_with_clock<C: Clock>(
        self,
        url: &str,
        clock: C,
    ) -> Result<PgStore<C>, StoreError> {
        let store = self.build(url, Some(clock))?;
        store.shared.ensure_table().await?;
        Ok(store)
    }

    /// The store, its workers started (they connect when the first request comes).
    fn build<C: Clock>(self, url: &str, clock: Option<C>) -> Result<PgStore<C>, StoreError> {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Err(StoreError::new(
                "postgres: the store must be opened inside a Tokio runtime, whose tasks drive \
                 its connections",
            ));
        };
        if !valid_table(&self.table) {
            return Err(StoreError::new(format!(
                "postgres: table name {:?}: use letters, digits and _, at most {MAX_TABLE}",
                self.table
            )));
        }
        let mut config: tokio_postgres::Config = url.parse().map_err(|e| {
            StoreError::with_source(
                format!("postgres: {:?}: {e}", super::url::redacted_url(url)),
                e,
            )
        })?;
        config.connect_timeout(self.timeout);
        let shared = Arc::new(Shared {
            config,
            sql: PgSql::new(&self.table),
            timeout: self.timeout,
            clock,
            jobs: Mutex::new(VecDeque::new()),
            ready: Notify::new(),
            closed: AtomicBool::new(false),
            leases: Leases::new(self.leases),
            table_made: AtomicBool::new(false),
            making_table: tokio::sync::Mutex::new(()),
        });
        for _ in 0..self.connections {
            runtime.spawn(work(Arc::clone(&shared), None));
        }
        Ok(PgStore { shared })
    }
}

/// States in PostgreSQL (SPEC §5): for apps on Postgres and several app servers.
///
/// Each request is one transaction at the default READ COMMITTED isolation. A naive
/// read-modify-write is racy there, so the request first takes a transaction-scoped advisory
/// lock on each of its (name, key, shard) slots, in ascending order (no deadlock between
/// tollgate requests), which serializes every request that touches a slot, even one whose
/// row does not exist yet; then it reads the states and the database's clock, decides, and
/// writes. The common request (one take from an unsharded limit) is one statement: the
/// table's `take` function, prepared once per connection, does all of that in one round
/// trip, and waiting ones go together through `takes` (see [`PgStoreBuilder::connections`]).
///
/// The store keeps a few connections (tokio-postgres), each driven by a task of its own on
/// the runtime that opened it; callers hand it their requests and await the answers, so no
/// thread of the runtime ever waits on the database. A database that cannot be reached or
/// times out is a [`StoreError`]; nothing is admitted, and the connection is made again.
///
/// To spend tokens inside a transaction of your own, use [`PgTransaction`].
///
/// # Examples
///
/// ```no_run
/// use tollgate::store::PgStore;
/// use tollgate::{Config, RateLimiter, MINUTE};
///
/// #[tokio::main]
/// async fn main() {
///     let store = PgStore::open("postgres://postgres@127.0.0.1/app").await.unwrap();
///     let limiter = RateLimiter::new(store);
///     let send = ("send", Config::token_bucket(10.0, MINUTE));
///     assert!(limiter.limit_async(send, "alice").await.unwrap().ok);
/// }
/// ```
pub struct PgStore<C = tollgate_algebra::SystemClock> {
    shared: Arc<Shared<C>>,
}

impl PgStore {
    /// Connects to `url` with the default options.
    ///
    /// # Errors
    ///
    /// As for [`PgStoreBuilder::open`].
    pub async fn open(url: &str) -> Result<Self, StoreError> {
        PgStoreBuilder::default().open(url).await
    }

    /// The store of `url` with the default options, connecting when the first request
    /// needs it (see [`PgStoreBuilder::connect_lazy`]).
    ///
    /// # Errors
    ///
    /// As for [`PgStoreBuilder::connect_lazy`].
    pub fn connect_lazy(url: &str) -> Result<Self, StoreError> {
        PgStoreBuilder::default().connect_lazy(url)
    }

    /// Checks `url` as [`PgStoreBuilder::open`] would parse it, without connecting: for a
    /// tool that validates a config.
    ///
    /// ```
    /// use tollgate::store::PgStore;
    ///
    /// assert!(PgStore::check_url("postgres://app@127.0.0.1/db").is_ok());
    /// assert!(PgStore::check_url("postgres://app@127.0.0.1/db?bogus=1").is_err());
    /// ```
    ///
    /// # Errors
    ///
    /// The URL does not parse (the message shows it with its password left out).
    pub fn check_url(url: &str) -> Result<(), StoreError> {
        url.parse::<tokio_postgres::Config>().map(drop).map_err(|e| {
            StoreError::with_source(
                format!("postgres: {:?}: {e}", super::url::redacted_url(url)),
                e,
            )
        })
    }

    /// Options: table, timeout, connections.
    pub fn builder() -> PgStoreBuilder {
        PgStoreBuilder::default()
    }
}

impl<C> Drop for PgStore<C> {
    fn drop(&mut self) {
        // The workers end, and with them their connections.
        self.shared.closed.store(true, Ordering::Release);
        self.shared.ready.notify_waiters();
    }
}

/// What the store and its workers share.
struct Shared<C> {
    config: tokio_postgres::Config,
    sql: PgSql,
    timeout: Duration,
    /// `None`: the database's clock.
    clock: Option<C>,
    /// Requests waiting for a worker, first come first.
    jobs: Mutex<VecDeque<Job>>,
    /// Wakes a worker when a request arrives.
    ready: Notify,
    /// Set when the store is dropped: the workers end.
    closed: AtomicBool,
    /// The leased limits and this process's holders.
    leases: Option<Leases>,
    /// Whether the table and its functions were made (or found) by this store: the
    /// workers' statements name them, so a connection is prepared only after.
    table_made: AtomicBool,
    /// Held while they are being made, so that the workers of a store opened lazily do not
    /// make them side by side.
    making_table: tokio::sync::Mutex<()>,
}

impl<C: Clock> Shared<C> {
    /// Hands `job` to a worker and awaits its answer.
    async fn submit<T>(&self, job: impl FnOnce(Ticket<T>) -> Job) -> Result<T, StoreError> {
        let (ticket, claim): (Ticket<T>, Claim<T>) = ticket();
        self.push(job(ticket));
        claim.answer(Some(self.timeout), "postgres").await
    }

    fn now(&self) -> Option<f64> {
        self.clock.as_ref().map(Clock::now)
    }
}

impl<C> Shared<C> {
    /// Makes the table and its functions unless this store already has: once, whichever
    /// comes first of the eager open and the first connection of a lazy one.
    async fn ensure_table(&self) -> Result<(), StoreError> {
        if self.table_made.load(Ordering::Acquire) {
            return Ok(());
        }
        let _making = self.making_table.lock().await;
        if !self.table_made.load(Ordering::Acquire) {
            create_table(self).await?;
            self.table_made.store(true, Ordering::Release);
        }
        Ok(())
    }
}

impl<C: Clock> PgStore<C> {
    async fn submit<T>(&self, job: impl FnOnce(Ticket<T>) -> Job) -> Result<T, StoreError> {
        self.shared.submit(job).await
    }

    fn now(&self) -> Option<f64> {
        self.shared.now()
    }

    /// The key and shard of every state stored for `name` (for
    /// [`RateLimiter::carry_async`](crate::RateLimiter::carry_async) after its config
    /// changed).
    ///
    /// # Errors
    ///
    /// The store's.
    pub async fn keys_of(&self, name: &str) -> Result<Vec<(Option<String>, u16)>, StoreError> {
        let sql = self.shared.sql.keys.clone();
        self.submit(|ticket| Job::Keys(sql, name.to_owned(), ticket)).await
    }
}

impl<C: Clock> AsyncStore for PgStore<C> {
    fn execute_async<'a>(&'a self, plan: &'a Plan<'_>) -> BoxFuture<'a, Outcome> {
        Box::pin(async move {
            // A transaction takes a leased limit directly (see `decide`), not from the lease.
            if let Some(leases) = &self.shared.leases
                && let Some(slot) =
                    plan.slots().iter().find(|s| leases.is_leased(s.name) && s.config.shards() > 1)
            {
                return Err(StoreError::new(format!(
                    "postgres: {:?} is leased, and a leased limit does not have shards yet; nothing \
                 was taken",
                    slot.name
                )));
            }
            let (plan, now) = (Box::new(OwnedPlan::new(plan)), self.now());
            self.submit(|ticket| Job::Plan(plan, now, ticket)).await
        })
    }

    /// The common request in one statement (see the `take` function of the table), alone
    /// or grouped with others that wait (see [`PgStoreBuilder::connections`]).
    fn execute_one_async<'a>(&'a self, take: &'a OneTake<'_>) -> BoxFuture<'a, Taken> {
        // A leased limit's take is a future of its own, smaller than this one (see
        // `lease::take`).
        if let Some(leases) = &self.shared.leases
            && leases.is_leased(take.slot.name)
        {
            return crate::store::lease::take(&self.shared, leases, take);
        }
        Box::pin(async move {
            if take.slot.config.calendar().is_some() {
                // The table's `take` function counts equal windows only: a calendar window is
                // decided here, through a plan.
                let outcome = self.execute_async(&take.to_plan()).await?;
                return Ok(Taken { decision: outcome.decision(), status: outcome.statuses[0] });
            }
            let row = OneRow::new(take, self.now());
            let answer = self.submit(|ticket| Job::One(row, ticket)).await?;
            decided(take, answer)
        })
    }

    fn read_async<'a>(&'a self, slots: &'a [Slot<'_>]) -> BoxFuture<'a, (f64, Vec<Option<State>>)> {
        Box::pin(async move {
            if let Some(leases) = &self.shared.leases
                && slots.iter().any(|s| leases.is_leased(s.name))
            {
                return crate::store::lease::read(&*self.shared, slots).await;
            }
            let (slots, now) = (OwnedSlots::new(slots), self.now());
            self.submit(|ticket| Job::Read(slots, now, ticket)).await
        })
    }

    fn delete_async<'a>(
        &'a self,
        name: &'a str,
        key: Option<&'a str>,
        shards: u16,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            if let Some(leases) = &self.shared.leases
                && leases.is_leased(name)
            {
                return crate::store::lease::reset(&*self.shared, leases, name, key).await;
            }
            let (name, key) = (name.to_owned(), key.map(str::to_owned));
            self.submit(|ticket| Job::Delete(name, key, shards, ticket)).await
        })
    }

    /// In a transaction of its own on a worker's connection (see the `slots` module for
    /// how it is serialized), on the store's clock; directly whatever the store leases
    /// (leases are of rate limits).
    fn slots_async<'a>(
        &'a self,
        name: &'a str,
        key: Option<&'a str>,
        limit: &'a Concurrency,
        op: &'a SlotOp,
    ) -> BoxFuture<'a, SlotAnswer> {
        Box::pin(async move {
            let (call, now) = (Box::new(OwnedSlotOp::new(name, key, limit, op)), self.now());
            self.submit(|ticket| Job::Slots(call, now, ticket)).await
        })
    }

    /// In a transaction of its own on a worker's connection, as `slots_async`, the
    /// (name, key)'s lock taken before the plan's.
    fn slots_with_async<'a>(
        &'a self,
        name: &'a str,
        key: Option<&'a str>,
        limit: &'a Concurrency,
        op: &'a SlotOp,
        plan: &'a Plan<'_>,
    ) -> BoxFuture<'a, (SlotAnswer, Outcome)> {
        Box::pin(async move {
            let with = Box::new((OwnedSlotOp::new(name, key, limit, op), OwnedPlan::new(plan)));
            let now = self.now();
            self.submit(|ticket| Job::SlotsWith(with, now, ticket)).await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn table_names_are_checked() {
        let err = PgStore::builder()
            .table("x; DROP TABLE y")
            .open("postgres://127.0.0.1:1/x")
            .await
            .err()
            .unwrap();
        assert!(err.to_string().contains("use letters, digits and _"), "{err}");
    }
}

/// The grouped statement against the memory store, on the PostgreSQL of
/// `TOLLGATE_POSTGRES_URL` (skipped without it, unless `TOLLGATE_REQUIRE_BACKENDS=1`).
#[cfg(test)]
mod group_tests {
    use tokio_postgres::NoTls;
    use tollgate_algebra::{Config, MINUTE, ManualClock, Take};

    use super::schema::Conn;
    use super::single::send_ones;
    use super::*;
    use crate::store::seam::OneAnswer;
    use crate::store::sql::take_params;
    use crate::store::testing::backend_url;
    use crate::store::testing::{T0, grouped_takes_answer_as_memory, writing};

    pub(super) fn url() -> Option<String> {
        backend_url("TOLLGATE_POSTGRES_URL")
    }

    /// Runs `sql` on the database of `url`, on a connection and a runtime of their own (on
    /// a thread of its own, so that a `Drop` can call it from inside a runtime).
    fn batch(url: &str, sql: &str) -> Result<(), tokio_postgres::Error> {
        let (url, sql) = (url.to_owned(), sql.to_owned());
        std::thread::spawn(move || {
            let runtime =
                tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(async {
                let (client, connection) = tokio_postgres::connect(&url, NoTls).await?;
                tokio::spawn(connection);
                client.batch_execute(&sql).await
            })
        })
        .join()
        .unwrap()
    }

    /// A store on a table of its own, which is dropped with its functions however the test
    /// ends.
    pub(super) struct OnTable {
        pub(super) store: PgStore<ManualClock>,
        pub(super) url: String,
        pub(super) table: String,
    }

    impl OnTable {
        pub(super) async fn open(url: &str, test: &str, clock: &ManualClock) -> Self {
            let table = format!("tollgate_{test}_{}", std::process::id());
            let store = PgStore::builder().table(&table).open_with_clock(url, clock.clone()).await;
            OnTable { store: store.unwrap(), url: url.to_owned(), table }
        }
    }

    impl Drop for OnTable {
        fn drop(&mut self) {
            let _ = batch(
                &self.url,
                &format!(
                    "DROP TABLE IF EXISTS {0}; DROP FUNCTION IF EXISTS {0}_takes; \
                     DROP FUNCTION IF EXISTS {0}_take; DROP FUNCTION IF EXISTS {0}_lease; \
                     DROP FUNCTION IF EXISTS {0}_lfill; DROP FUNCTION IF EXISTS {0}_lsum; \
                     DROP FUNCTION IF EXISTS {0}_lheld; DROP TABLE IF EXISTS {0}_slots",
                    self.table
                ),
            );
        }
    }

    /// `takes` in one statement on `conn`, at `now`.
    async fn send_group(
        conn: &Conn,
        takes: &[OneTake<'_>],
        now: f64,
    ) -> Vec<Result<OneAnswer, StoreError>> {
        let rows: Vec<OneRow> = takes.iter().map(|o| OneRow::new(o, Some(now))).collect();
        let rows: Vec<&OneRow> = rows.iter().collect();
        send_ones(conn, &rows, Duration::from_secs(5)).await.0
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn grouped_takes_answer_as_memory_one_after_the_other() {
        let Some(url) = url() else { return };
        let clock = ManualClock::new(T0);
        let on = OnTable::open(&url, "group", &clock).await;
        let conn = Conn::open(&on.store.shared).await.unwrap();
        grouped_takes_answer_as_memory(&clock, &on.store, async |ones: &[OneTake<'_>]| {
            let answers = send_group(&conn, ones, clock.now()).await;
            answers.into_iter().map(Result::unwrap).collect()
        })
        .await;
    }

    /// A table whose functions an earlier version made (answering rows, which `CREATE OR
    /// REPLACE` cannot change) gets this version's functions when a store opens on it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn functions_of_an_earlier_version_are_replaced() {
        let Some(url) = url() else { return };
        let clock = ManualClock::new(T0);
        let on = OnTable::open(&url, "earlier", &clock).await;
        let table = &on.table;
        batch(
            &url,
            &format!(
                "DROP FUNCTION {table}_take; DROP FUNCTION {table}_takes;
                 CREATE FUNCTION {table}_take({take}, OUT o_now float8, OUT o_wrote bool,
                   OUT o_value float8, OUT o_ts float8)
                   LANGUAGE sql AS 'SELECT 0::float8, false, NULL::float8, NULL::float8';
                 CREATE FUNCTION {table}_takes({takes}, OUT o_now float8, OUT o_wrote bool,
                   OUT o_value float8, OUT o_ts float8) RETURNS SETOF record
                   LANGUAGE sql AS 'SELECT 0::float8, false, NULL::float8, NULL::float8'",
                take = take_params(false, false),
                takes = take_params(false, true),
            ),
        )
        .unwrap();
        let store =
            PgStore::builder().table(table).open_with_clock(&url, clock.clone()).await.unwrap();
        let config = Config::token_bucket(10.0, MINUTE);
        let take = Take { name: "n", key: Some("k"), config, count: 4.0, reserve: false };
        for left in [6.0, 2.0] {
            let taken = store.execute_one_async(&writing(&take)).await.unwrap();
            assert_eq!(taken.status.remaining, left);
        }
        let conn = Conn::open(&store.shared).await.unwrap();
        let answers = send_group(&conn, &[writing(&take), writing(&take)], clock.now()).await;
        let wrote: Vec<bool> = answers.iter().map(|a| a.as_ref().unwrap().1).collect();
        assert_eq!(wrote, [false, false], "2 left: both refused");
    }

    /// A `take` function that answers something else than its array fails the request.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_garbled_answer_is_an_error() {
        let Some(url) = url() else { return };
        let clock = ManualClock::new(T0);
        let on = OnTable::open(&url, "garbled", &clock).await;
        let table = &on.table;
        let config = Config::token_bucket(10.0, MINUTE);
        let take = Take { name: "n", key: Some("k"), config, count: 1.0, reserve: false };
        for garbage in ["ARRAY[1, 2]", "ARRAY[1, 2, 3, NULL]", "ARRAY[NULL, 1, NULL, NULL]"] {
            batch(
                &url,
                &format!(
                    "DROP FUNCTION {table}_take; CREATE FUNCTION {table}_take({args})
                       RETURNS float8[] LANGUAGE sql AS 'SELECT {garbage}::float8[]'",
                    args = take_params(false, false),
                ),
            )
            .unwrap();
            // A fresh connection prepares the replaced function.
            let conn = Conn::open(&on.store.shared).await.unwrap();
            let answer = send_group(&conn, &[writing(&take)], clock.now()).await.pop().unwrap();
            let err = answer.and_then(|a| decided(&writing(&take), a)).unwrap_err();
            assert!(err.to_string().contains("garbage"), "{garbage}: {err}");
        }
    }
}
