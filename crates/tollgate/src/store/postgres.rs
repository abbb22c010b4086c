//! States in PostgreSQL, on tokio-postgres: correct under READ COMMITTED, on the database's
//! clock, and never blocking a thread.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::future::try_join_all;
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, GenericClient, NoTls, Row, Statement};
use tollgate_algebra::lease::{Lease, Leased};
use tollgate_algebra::{Clock, Kind, OneTake, Outcome, Plan, Slot, State, Taken, full_at};

use super::lease::{self, LeaseOptions, LeaseStats, LeaseStore, Leases, Step};
use super::seam::{AsyncStore, BoxFuture, OneAnswer};
use super::sql::{
    LOCK_CLASS, MAX_TABLE, PG_LOCK, PgSql, key_columns, lock_id, lock_ids, valid_table,
};
use super::ticket::{Claim, OwnedPlan, OwnedSlots, Ticket, ticket};
use crate::error::StoreError;

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
    /// A bad URL or table name, or a database that cannot be reached.
    pub async fn open(self, url: &str) -> Result<PgStore, StoreError> {
        self.build(url, None).await
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
        self.build(url, Some(clock)).await
    }

    async fn build<C: Clock>(self, url: &str, clock: Option<C>) -> Result<PgStore<C>, StoreError> {
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
        });
        create_table(&shared).await?;
        for _ in 0..self.connections {
            tokio::spawn(work(Arc::clone(&shared), None));
        }
        Ok(PgStore { shared })
    }
}

/// Creates the table and its functions if they are missing, on a connection of its own
/// (the workers' connections prepare statements that name the functions).
async fn create_table<C>(shared: &Shared<C>) -> Result<(), StoreError> {
    let create = async {
        let (client, connection) = shared.config.connect(NoTls).await?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        let sql = &shared.sql;
        // Serialized, so that servers starting together do not race on CREATE TABLE (or on
        // replacing the function, which fails when two do it at once).
        client
            .batch_execute(&format!(
                "BEGIN; SELECT pg_advisory_xact_lock({LOCK_CLASS}, 0); {}; {}; {}; {}; {}; {}; {}; \
                 COMMIT",
                sql.create,
                sql.add_leases,
                sql.create_lease_config,
                sql.drop_old,
                sql.create_lease,
                sql.create_take,
                sql.create_takes
            ))
            .await
    };
    match tokio::time::timeout(shared.timeout * 2, create).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(pg_error("cannot create the table", e)),
        Err(_) => Err(StoreError::new(format!(
            "postgres: cannot connect: no answer within {:?}",
            shared.timeout * 2
        ))),
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
}

/// A request for a worker.
enum Job {
    One(OneRow, Ticket<OneAnswer>),
    Plan(Box<OwnedPlan>, Option<f64>, Ticket<Outcome>),
    Read(OwnedSlots, Option<f64>, Ticket<(f64, Vec<Option<State>>)>),
    Delete(String, Option<String>, u16, Ticket<()>),
    Lease(Box<LeaseRow>, Ticket<(f64, Leased, Vec<f64>)>),
    /// The key and shard of each state of a name: the statement's text, the name.
    Keys(String, String, Ticket<Vec<(Option<String>, u16)>>),
    /// A leased name's config said (see `LeaseStore::announce`): the statement's text, the
    /// name, what is said, for how many ms.
    Announce(Box<(String, String, String, f64)>, Ticket<Option<String>>),
}

impl Job {
    /// Takes the request to run (see [`Ticket::take`]).
    fn take(&self) -> bool {
        match self {
            Job::One(_, t) => t.take(),
            Job::Plan(_, _, t) => t.take(),
            Job::Read(_, _, t) => t.take(),
            Job::Delete(_, _, _, t) => t.take(),
            Job::Keys(_, _, t) => t.take(),
            Job::Announce(_, t) => t.take(),
            Job::Lease(_, t) => t.take(),
        }
    }
}

/// The most one-takes a grouped statement carries.
const MOST_PER_STATEMENT: usize = 64;

impl<C> Shared<C> {
    fn push(&self, job: Job) {
        self.jobs.lock().push_back(job);
        self.ready.notify_one();
    }

    /// The next requests a worker runs together: one request, or up to
    /// [`MOST_PER_STATEMENT`] one-takes in a row; those whose callers have gone are skipped.
    fn next_batch(&self) -> Option<Batch> {
        let mut jobs = self.jobs.lock();
        let first = loop {
            let job = jobs.pop_front()?;
            if job.take() {
                break job;
            }
        };
        let Job::One(row, ticket) = first else { return Some(Batch::Other(first)) };
        let mut ones = vec![(row, ticket)];
        while ones.len() < MOST_PER_STATEMENT && matches!(jobs.front(), Some(Job::One(..))) {
            if let Some(job @ Job::One(..)) = jobs.pop_front()
                && job.take()
                && let Job::One(row, ticket) = job
            {
                ones.push((row, ticket));
            }
        }
        Some(Batch::Ones(ones))
    }
}

/// What a worker runs at once.
enum Batch {
    Ones(Vec<(OneRow, Ticket<OneAnswer>)>),
    Other(Job),
}

/// A statement of the store's: prepared on a store connection, or as text with its
/// parameters' types inside a caller's transaction. One round trip either way.
#[derive(Clone, Copy)]
enum Stmt<'a> {
    Prepared(&'a Statement),
    Text(&'a str, &'a [Type]),
}

/// Runs `stmt` with `params` on `client`.
async fn query<G: GenericClient + Sync>(
    client: &G,
    stmt: Stmt<'_>,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<Row>, tokio_postgres::Error> {
    match stmt {
        Stmt::Prepared(statement) => client.query(statement, params).await,
        Stmt::Text(sql, types) => {
            let typed: Vec<(&(dyn ToSql + Sync), Type)> =
                params.iter().zip(types).map(|(p, t)| (*p, t.clone())).collect();
            client.query_typed(sql, &typed).await
        }
    }
}

/// The statements a request runs.
struct Stmts<'a> {
    take: Stmt<'a>,
    lock: Stmt<'a>,
    load: Stmt<'a>,
    /// Whether `load` reads lease records (a store's own connection) or refuses them (a
    /// caller's transaction).
    leases: bool,
    upsert: Stmt<'a>,
    upsert_leases: Stmt<'a>,
    delete: Stmt<'a>,
    delete_all: Stmt<'a>,
}

/// The parameter types of `take` (see `take_params`), of the lock, of `load`, of `upsert`
/// and of the deletes, for statements sent as text.
const TAKE_TYPES: [Type; 15] = [
    Type::INT4,
    Type::TEXT,
    Type::BOOL,
    Type::TEXT,
    Type::INT4,
    Type::INT4,
    Type::FLOAT8,
    Type::FLOAT8,
    Type::FLOAT8,
    Type::FLOAT8,
    Type::FLOAT8,
    Type::FLOAT8,
    Type::BOOL,
    Type::BOOL,
    Type::FLOAT8,
];
const LOCK_TYPES: [Type; 2] = [Type::INT4, Type::INT4];
const LOAD_TYPES: [Type; 4] =
    [Type::TEXT_ARRAY, Type::BOOL_ARRAY, Type::TEXT_ARRAY, Type::INT4_ARRAY];
const UPSERT_TYPES: [Type; 6] =
    [Type::TEXT, Type::BOOL, Type::TEXT, Type::INT4, Type::FLOAT8, Type::FLOAT8];
const DELETE_TYPES: [Type; 4] = [Type::TEXT, Type::BOOL, Type::TEXT, Type::INT4];
const UPSERT_LEASES_TYPES: [Type; 7] = [
    Type::TEXT,
    Type::BOOL,
    Type::TEXT,
    Type::INT4,
    Type::FLOAT8,
    Type::FLOAT8,
    Type::FLOAT8_ARRAY,
];

/// `sql`'s statements as text.
fn text(sql: &PgSql) -> Stmts<'_> {
    Stmts {
        take: Stmt::Text(&sql.take, &TAKE_TYPES),
        lock: Stmt::Text(PG_LOCK, &LOCK_TYPES),
        load: Stmt::Text(&sql.load, &LOAD_TYPES),
        leases: false,
        upsert: Stmt::Text(&sql.upsert, &UPSERT_TYPES),
        upsert_leases: Stmt::Text(&sql.upsert_leases, &UPSERT_LEASES_TYPES),
        delete: Stmt::Text(&sql.delete, &DELETE_TYPES),
        delete_all: Stmt::Text(&sql.delete_all, &DELETE_TYPES),
    }
}

/// A connection of a worker, with its statements prepared.
struct Conn {
    client: Client,
    takes: Statement,
    lease: Statement,
    prepared: [Statement; 7],
}

impl Conn {
    async fn open<C>(shared: &Shared<C>) -> Result<Conn, StoreError> {
        let connect = async {
            let (client, connection) = shared.config.connect(NoTls).await?;
            tokio::spawn(async move {
                // Ends when the client is dropped, or the connection fails.
                let _ = connection.await;
            });
            let ms = shared.timeout.as_millis();
            client
                .batch_execute(&format!("SET statement_timeout = {ms}; SET lock_timeout = {ms}"))
                .await?;
            let sql = &shared.sql;
            let prepared = [
                client.prepare(&sql.take).await?,
                client.prepare(PG_LOCK).await?,
                client.prepare(&sql.load_leases).await?,
                client.prepare(&sql.upsert).await?,
                client.prepare(&sql.upsert_leases).await?,
                client.prepare(&sql.delete).await?,
                client.prepare(&sql.delete_all).await?,
            ];
            let takes = client.prepare(&sql.takes).await?;
            let lease = client.prepare(&sql.lease).await?;
            Ok::<_, tokio_postgres::Error>(Conn { client, takes, lease, prepared })
        };
        match tokio::time::timeout(shared.timeout * 2, connect).await {
            Ok(Ok(conn)) => Ok(conn),
            Ok(Err(e)) => Err(pg_error("cannot connect", e).unavailable()),
            Err(_) => Err(StoreError::new(format!(
                "postgres: cannot connect: no answer within {:?}",
                shared.timeout * 2
            ))
            .unavailable()),
        }
    }

    fn stmts(&self) -> Stmts<'_> {
        let [take, lock, load, upsert, upsert_leases, delete, delete_all] = &self.prepared;
        let p = Stmt::Prepared;
        Stmts {
            take: p(take),
            lock: p(lock),
            load: p(load),
            leases: true,
            upsert: p(upsert),
            upsert_leases: p(upsert_leases),
            delete: p(delete),
            delete_all: p(delete_all),
        }
    }
}

/// A worker: runs requests on its connection, one batch at a time, until the store is
/// dropped. A connection that fails is dropped and made again for the next batch.
async fn work<C: Clock>(shared: Arc<Shared<C>>, mut conn: Option<Conn>) {
    loop {
        let batch = loop {
            if shared.closed.load(Ordering::Acquire) {
                return;
            }
            if let Some(batch) = shared.next_batch() {
                break batch;
            }
            shared.ready.notified().await;
        };
        if conn.is_none() {
            match Conn::open(&shared).await {
                Ok(c) => conn = Some(c),
                Err(e) => {
                    batch.fail(&e);
                    continue;
                }
            }
        }
        let c = conn.as_ref().expect("connected above");
        if !batch.run(c, shared.timeout).await {
            conn = None;
        }
        // Others may be waiting, and a notification wakes only one worker.
        if !shared.jobs.lock().is_empty() {
            shared.ready.notify_one();
        }
    }
}

impl Batch {
    /// Fails every request of the batch, none of which was sent.
    fn fail(self, error: &StoreError) {
        let e = || error.copy();
        match self {
            Batch::Ones(ones) => ones.into_iter().for_each(|(_, t)| t.answer(Err(e()))),
            Batch::Other(Job::One(_, t)) => t.answer(Err(e())),
            Batch::Other(Job::Plan(_, _, t)) => t.answer(Err(e())),
            Batch::Other(Job::Read(_, _, t)) => t.answer(Err(e())),
            Batch::Other(Job::Delete(_, _, _, t)) => t.answer(Err(e())),
            Batch::Other(Job::Lease(_, t)) => t.answer(Err(e())),
            Batch::Other(Job::Keys(_, _, t)) => t.answer(Err(e())),
            Batch::Other(Job::Announce(_, t)) => t.answer(Err(e())),
        }
    }

    /// Runs the batch on `conn` and answers each request. `false` if the connection failed
    /// or a statement timed out, so that it is made again.
    async fn run(self, conn: &Conn, timeout: Duration) -> bool {
        let stmts = conn.stmts();
        match self {
            Batch::Ones(ones) => {
                let rows: Vec<&OneRow> = ones.iter().map(|(row, _)| row).collect();
                let (answers, healthy) = send_ones(conn, &rows, timeout).await;
                for ((_, ticket), answer) in ones.into_iter().zip(answers) {
                    ticket.answer(answer);
                }
                healthy
            }
            Batch::Other(Job::One(row, ticket)) => {
                let (mut answers, healthy) = send_ones(conn, &[&row], timeout).await;
                ticket.answer(answers.pop().unwrap_or_else(|| Err(StoreError::new("no answer"))));
                healthy
            }
            Batch::Other(Job::Plan(plan, now, ticket)) => {
                let plan = plan.plan();
                let request = in_own_transaction(&conn.client, &stmts, &plan, now);
                let (result, healthy) = bounded(timeout, plan.writes(), request).await;
                ticket.answer(result);
                healthy
            }
            Batch::Other(Job::Read(slots, now, ticket)) => {
                let slots = slots.slots();
                let request = async {
                    let (now, states, _) = load(&conn.client, &stmts, &slots, now, false).await?;
                    Ok((now, states))
                };
                let (result, healthy) = bounded(timeout, false, request).await;
                ticket.answer(result);
                healthy
            }
            Batch::Other(Job::Delete(name, key, shards, ticket)) => {
                let request = delete_all(&conn.client, &stmts, &name, key.as_deref(), shards);
                let (result, healthy) = bounded(timeout, true, request).await;
                ticket.answer(result);
                healthy
            }
            Batch::Other(Job::Keys(sql, name, ticket)) => {
                let params: [&(dyn ToSql + Sync); 1] = [&name];
                let request = query(&conn.client, Stmt::Text(&sql, &[Type::TEXT]), &params);
                let (result, healthy) = bounded(timeout, false, request).await;
                let keys = |rows: Vec<Row>| {
                    let key = |row: &Row| -> Result<_, tokio_postgres::Error> {
                        let (has_key, key, shard): (bool, String, i32) =
                            (row.try_get(0)?, row.try_get(1)?, row.try_get(2)?);
                        Ok((has_key.then_some(key), u16::try_from(shard).unwrap_or(u16::MAX)))
                    };
                    rows.iter()
                        .map(key)
                        .collect::<Result<_, _>>()
                        .map_err(|e| pg_error("cannot list states", e))
                };
                ticket.answer(result.and_then(keys));
                healthy
            }
            Batch::Other(Job::Announce(said, ticket)) => {
                let (sql, name, said, millis) = *said;
                let params: [&(dyn ToSql + Sync); 3] = [&name, &said, &millis];
                let types = [Type::TEXT, Type::TEXT, Type::FLOAT8];
                let request = query(&conn.client, Stmt::Text(&sql, &types), &params);
                let (result, healthy) = bounded(timeout, true, request).await;
                let before = |rows: Vec<Row>| -> Result<Option<String>, StoreError> {
                    match rows.first() {
                        Some(row) => row.try_get(0).map_err(|e| pg_error("announce failed", e)),
                        None => Ok(None),
                    }
                };
                ticket.answer(result.and_then(before));
                healthy
            }
            Batch::Other(Job::Lease(row, ticket)) => {
                let params = row.params();
                let request = query(&conn.client, Stmt::Prepared(&conn.lease), &params);
                let (result, healthy) = bounded(timeout, true, request).await;
                ticket.answer(result.and_then(|rows| lease_answer(&rows)));
                healthy
            }
        }
    }
}

/// `request` within `timeout`, and whether the connection is still good afterwards (not
/// after a timeout or a lost connection; an error answered by the database leaves it good).
/// A request that `writes` and may have reached the database before its connection failed
/// or it timed out may have run: its error says so.
async fn bounded<T>(
    timeout: Duration,
    writes: bool,
    request: impl Future<Output = Result<T, tokio_postgres::Error>>,
) -> (Result<T, StoreError>, bool) {
    match tokio::time::timeout(timeout, request).await {
        Ok(Ok(answer)) => (Ok(answer), true),
        Ok(Err(e)) => {
            let lost = e.is_closed();
            let error = request_error(e, writes);
            (Err(error), !lost)
        }
        Err(_) => (Err(timed_out(timeout, writes)), false),
    }
}

fn timed_out(timeout: Duration, writes: bool) -> StoreError {
    let error = StoreError::new(format!("postgres: no answer within {timeout:?}")).unavailable();
    if writes { error.sent() } else { error }
}

/// The error of a statement that failed: one that may have run (a lost connection) says so,
/// and one of the database being unavailable (a lost connection, a statement or lock that
/// timed out, a server shutting down) is marked so.
fn request_error(e: tokio_postgres::Error, writes: bool) -> StoreError {
    use tokio_postgres::error::SqlState;
    let lost = e.is_closed();
    let slow = e.code().is_some_and(|code| {
        [SqlState::QUERY_CANCELED, SqlState::LOCK_NOT_AVAILABLE, SqlState::ADMIN_SHUTDOWN]
            .contains(code)
            || code.code().starts_with("08")
    });
    let error = pg_error("request failed", e);
    let error = if lost && writes { error.sent() } else { error };
    if lost || slow { error.unavailable() } else { error }
}

/// One take from one unsharded limit, as the parameters of the table's `take` function.
struct OneRow {
    lock: i32,
    name: String,
    has_key: bool,
    /// The key, `""` when there is none.
    key: String,
    shard: i32,
    kind: i32,
    rate: f64,
    period: f64,
    cap: f64,
    max_reserved: Option<f64>,
    alignment: f64,
    count: f64,
    reserve: bool,
    writes: bool,
    /// `None`: the database's clock.
    now: Option<f64>,
}

impl OneRow {
    fn new(take: &OneTake<'_>, now: Option<f64>) -> Self {
        let slot = &take.slot;
        let c = &slot.config;
        let (has_key, key) = key_columns(slot.key);
        OneRow {
            lock: lock_id(slot.name, slot.key, slot.shard),
            name: slot.name.to_owned(),
            has_key,
            key: key.to_owned(),
            shard: i32::from(slot.shard),
            kind: match c.kind() {
                Kind::TokenBucket => 0,
                Kind::FixedWindow => 1,
            },
            rate: c.rate(),
            period: c.period(),
            cap: c.capacity(),
            max_reserved: c.max_reserved(),
            alignment: slot.alignment,
            count: take.count,
            reserve: take.reserve,
            writes: take.writes,
            now,
        }
    }

    /// The row as the `take` function's parameters, in order (`take_params`).
    fn params(&self) -> [&(dyn ToSql + Sync); 15] {
        [
            &self.lock,
            &self.name,
            &self.has_key,
            &self.key,
            &self.shard,
            &self.kind,
            &self.rate,
            &self.period,
            &self.cap,
            &self.max_reserved,
            &self.alignment,
            &self.count,
            &self.reserve,
            &self.writes,
            &self.now,
        ]
    }
}

/// A step on a leased shard, as the parameters of the table's `lease` function.
struct LeaseRow {
    take: OneRow,
    step: i32,
    args: Vec<f64>,
}

impl LeaseRow {
    fn new(slot: &Slot<'_>, step: Step, now: Option<f64>) -> LeaseRow {
        // Holder ids are below 2^53: exact as doubles.
        #[allow(clippy::cast_precision_loss)]
        let (code, args) = match step {
            Step::Take { count, reserve, writes } => {
                (0, vec![count, f64::from(u8::from(reserve)), f64::from(u8::from(writes))])
            }
            Step::Grant { holder, want, unused, term, share } => {
                (1, vec![holder as f64, want, unused, term, share])
            }
            Step::Release { holder, unused } => (2, vec![holder as f64, unused]),
            Step::Forget => (3, Vec::new()),
        };
        let one = OneTake { slot: *slot, count: 0.0, reserve: false, writes: true };
        LeaseRow { take: OneRow::new(&one, now), step: code, args }
    }

    fn params(&self) -> [&(dyn ToSql + Sync); 14] {
        let t = &self.take;
        [
            &t.lock,
            &t.name,
            &t.has_key,
            &t.key,
            &t.shard,
            &t.kind,
            &t.rate,
            &t.period,
            &t.cap,
            &t.max_reserved,
            &t.alignment,
            &t.now,
            &self.step,
            &self.args,
        ]
    }
}

/// Reads an answer of the `lease` function: the time it used, what it loaded, what it said.
fn lease_answer(rows: &[Row]) -> Result<(f64, Leased, Vec<f64>), StoreError> {
    let garbage = || StoreError::new("postgres: the lease function answered garbage");
    let [row] = rows else { return Err(garbage()) };
    let array: Vec<f64> = row.try_get(0).map_err(|_| garbage())?;
    let [now, had, value, ts, n, ref rest @ ..] = array[..] else { return Err(garbage()) };
    let n = n as usize;
    if rest.len() < 3 * n {
        return Err(garbage());
    }
    let (records, said) = rest.split_at(3 * n);
    Ok((now, leased((had == 1.0).then_some(State { value, ts }), records), said.to_vec()))
}

/// A row's state and lease records (holder, tokens, expiry each) as `Leased`: a value of NaN
/// is a state forgotten by a reset while leases are out.
fn leased(state: Option<State>, records: &[f64]) -> Leased {
    Leased {
        state: state.filter(|s| !s.value.is_nan()),
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        leases: records
            .chunks(3)
            .map(|r| (r[0] as u64, Lease { tokens: r[1], expiry: r[2] }))
            .collect(),
    }
}

/// Reads an answer of the `take` function (a row of `takes`): an array of the time it used,
/// whether it wrote (1 or 0), and the state it read (value and ts, or two NULLs).
fn answer(row: &Row) -> Result<OneAnswer, StoreError> {
    let garbage = || StoreError::new("postgres: the take function answered garbage");
    let array: Vec<Option<f64>> = row.try_get(0).map_err(|_| garbage())?;
    let [Some(now), Some(wrote), value, ts] = array[..] else { return Err(garbage()) };
    let state = match (value, ts) {
        (Some(value), Some(ts)) => Some(State { value, ts }),
        (None, None) => None,
        _ => return Err(garbage()),
    };
    match wrote {
        0.0 => Ok((now, false, state)),
        1.0 => Ok((now, true, state)),
        _ => Err(garbage()),
    }
}

/// Runs one-takes in one statement on `conn`: the `take` function for one, `takes` for
/// several; answers each, and whether the connection is still good.
async fn send_ones(
    conn: &Conn,
    rows: &[&OneRow],
    timeout: Duration,
) -> (Vec<Result<OneAnswer, StoreError>>, bool) {
    let any_writes = rows.iter().any(|r| r.writes);
    if let [row] = rows {
        let params = row.params();
        let request = conn.client.query_one(&conn.prepared[0], &params);
        let (result, healthy) = bounded(timeout, any_writes, request).await;
        return (vec![result.and_then(|row| answer(&row))], healthy);
    }
    let column = |f: fn(&OneRow) -> f64| rows.iter().map(|r| f(r)).collect::<Vec<f64>>();
    let flags = |f: fn(&OneRow) -> bool| rows.iter().map(|r| f(r)).collect::<Vec<bool>>();
    let ints = |f: fn(&OneRow) -> i32| rows.iter().map(|r| f(r)).collect::<Vec<i32>>();
    let names: Vec<&str> = rows.iter().map(|r| r.name.as_str()).collect();
    let keys: Vec<&str> = rows.iter().map(|r| r.key.as_str()).collect();
    let max_reserved: Vec<Option<f64>> = rows.iter().map(|r| r.max_reserved).collect();
    let now: Vec<Option<f64>> = rows.iter().map(|r| r.now).collect();
    let (locks, has_keys, shards, kinds) =
        (ints(|r| r.lock), flags(|r| r.has_key), ints(|r| r.shard), ints(|r| r.kind));
    let (rates, periods, caps) = (column(|r| r.rate), column(|r| r.period), column(|r| r.cap));
    let (alignments, counts) = (column(|r| r.alignment), column(|r| r.count));
    let (reserves, writes) = (flags(|r| r.reserve), flags(|r| r.writes));
    let params: [&(dyn ToSql + Sync); 15] = [
        &locks,
        &names,
        &has_keys,
        &keys,
        &shards,
        &kinds,
        &rates,
        &periods,
        &caps,
        &max_reserved,
        &alignments,
        &counts,
        &reserves,
        &writes,
        &now,
    ];
    match tokio::time::timeout(timeout, conn.client.query(&conn.takes, &params)).await {
        Ok(Ok(found)) if found.len() == rows.len() => (found.iter().map(answer).collect(), true),
        Ok(Ok(found)) => {
            let error =
                StoreError::new(format!("postgres: {} rows for {} takes", found.len(), rows.len()));
            (fail_all(rows.len(), &error), true)
        }
        // One take's arithmetic failed (a float out of range: a data exception), so the
        // statement was rolled back whole and nothing was taken: each goes again alone, so
        // that only that one fails.
        Ok(Err(e)) if e.code().is_some_and(|c| c.code().starts_with("22")) => {
            let mut answers = Vec::with_capacity(rows.len());
            let mut healthy = true;
            for row in rows {
                let params = row.params();
                let request = conn.client.query_one(&conn.prepared[0], &params);
                let (result, good) = bounded(timeout, row.writes, request).await;
                healthy &= good;
                answers.push(result.and_then(|row| answer(&row)));
            }
            (answers, healthy)
        }
        Ok(Err(e)) => {
            let lost = e.is_closed();
            (fail_all(rows.len(), &request_error(e, any_writes)), !lost)
        }
        Err(_) => (fail_all(rows.len(), &timed_out(timeout, any_writes)), false),
    }
}

/// The answers of a statement of `n` requests that failed as a whole.
fn fail_all<A>(n: usize, error: &StoreError) -> Vec<Result<A, StoreError>> {
    (0..n).map(|_| Err(error.copy())).collect()
}

/// Loads the states of `slots` and the time in one query (after taking their locks, in
/// ascending order, when `lock`: all sent at once, run in order).
async fn load<G: GenericClient + Sync>(
    client: &G,
    stmts: &Stmts<'_>,
    slots: &[Slot<'_>],
    now: Option<f64>,
    lock: bool,
) -> Result<Loaded, tokio_postgres::Error> {
    let ids = if lock { lock_ids(slots) } else { Vec::new() };
    let locks = ids.iter().map(|id| async move {
        let params: [&(dyn ToSql + Sync); 2] = [&LOCK_CLASS, id];
        query(client, stmts.lock, &params).await
    });
    let names: Vec<&str> = slots.iter().map(|s| s.name).collect();
    let has_keys: Vec<bool> = slots.iter().map(|s| s.key.is_some()).collect();
    let keys: Vec<&str> = slots.iter().map(|s| s.key.unwrap_or("")).collect();
    let shards: Vec<i32> = slots.iter().map(|s| i32::from(s.shard)).collect();
    let params: [&(dyn ToSql + Sync); 4] = [&names, &has_keys, &keys, &shards];
    let rows = query(client, stmts.load, &params);
    let (locked, rows) = futures_util::future::join(try_join_all(locks), rows).await;
    locked?;
    let rows = rows?;
    let mut db_now = now.unwrap_or(0.0);
    let mut states = vec![None; slots.len()];
    let mut records = vec![None; slots.len()];
    for row in rows {
        let i: i64 = row.get(0);
        let value: Option<f64> = row.get(1);
        let ts: Option<f64> = row.get(2);
        if now.is_none() {
            db_now = row.get(3);
        }
        if stmts.leases
            && let Some(slot) = records.get_mut(i as usize - 1)
        {
            *slot = row.get::<_, Option<Vec<f64>>>(4);
        }
        if let (Some(value), Some(ts), Some(slot)) = (value, ts, states.get_mut(i as usize - 1)) {
            *slot = Some(State { value, ts });
        }
    }
    if now.is_none() && slots.is_empty() {
        db_now = client
            .query_one("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::float8", &[])
            .await?
            .get(0);
    }
    Ok((db_now, states, records))
}

/// What [`load`] read: the database's time, each slot's state, and each slot's lease records
/// (holder, tokens, expiry each; `None` when its row has none, or the statement refuses them).
type Loaded = (f64, Vec<Option<State>>, Vec<Option<Vec<f64>>>);

/// Decides `plan` on what [`load`] read. A state with lease records is first refilled under
/// `capacity - outstanding` to `now` (`Leased::advance`), so a transaction takes a leased
/// limit directly, never past what its leases leave; answers the records each keeps.
fn decide(plan: &Plan<'_>, (now, mut states, records): Loaded) -> Decided {
    let kept: Vec<Option<Vec<f64>>> = plan
        .slots()
        .iter()
        .zip(states.iter_mut())
        .zip(records)
        .map(|((slot, state), records)| {
            let mut leased = leased(*state, &records?);
            *state = Some(leased.advance(&slot.config, slot.alignment, now));
            // Holder ids are below 2^53: exact as doubles.
            #[allow(clippy::cast_precision_loss)]
            let left = leased.leases.iter().flat_map(|(h, l)| [*h as f64, l.tokens, l.expiry]);
            Some(left.collect())
        })
        .collect();
    let outcome = plan.decide(now, &mut states);
    Decided { now, states, kept, outcome }
}

/// A decided plan, with what it writes.
struct Decided {
    now: f64,
    states: Vec<Option<State>>,
    /// Per slot, the lease records it keeps (`None`: its row had none).
    kept: Vec<Option<Vec<f64>>>,
    outcome: Outcome,
}

/// Writes what `decided` changed: each state, or a delete when it is full again and holds no
/// lease record; a state that had records is written with those it keeps (NULL: none), and
/// is never deleted while it keeps any.
async fn save<G: GenericClient + Sync>(
    client: &G,
    stmts: &Stmts<'_>,
    plan: &Plan<'_>,
    decided: &Decided,
) -> Result<(), tokio_postgres::Error> {
    let changed =
        plan.slots().iter().zip(&decided.states).zip(&decided.kept).zip(&decided.outcome.changed);
    let writes =
        changed.filter(|(_, changed)| **changed).filter_map(|(((slot, state), kept), _)| {
            let state = (*state)?;
            Some(async move {
                let ((has_key, key), shard) = (key_columns(slot.key), i32::from(slot.shard));
                let full = full_at(&slot.config, state) <= decided.now;
                let keeps = kept.as_ref().filter(|records| !records.is_empty());
                match kept {
                    _ if full && keeps.is_none() => {
                        query(client, stmts.delete, &[&slot.name, &has_key, &key, &shard]).await
                    }
                    Some(_) => {
                        let params: [&(dyn ToSql + Sync); 7] =
                            [&slot.name, &has_key, &key, &shard, &state.value, &state.ts, &keeps];
                        query(client, stmts.upsert_leases, &params).await
                    }
                    None => {
                        let params: [&(dyn ToSql + Sync); 6] =
                            [&slot.name, &has_key, &key, &shard, &state.value, &state.ts];
                        query(client, stmts.upsert, &params).await
                    }
                }
            })
        });
    try_join_all(writes).await?;
    Ok(())
}

/// One request within a transaction already begun: lock, load, decide, write what changed.
async fn execute_in<G: GenericClient + Sync>(
    client: &G,
    stmts: &Stmts<'_>,
    plan: &Plan<'_>,
    now: Option<f64>,
) -> Result<Outcome, tokio_postgres::Error> {
    let decided = decide(plan, load(client, stmts, plan.slots(), now, true).await?);
    save(client, stmts, plan, &decided).await?;
    Ok(decided.outcome)
}

/// One request in a transaction of its own on a store connection: `BEGIN` goes with the
/// locks and the read, `COMMIT` with the writes, so two round trips in all.
async fn in_own_transaction(
    client: &Client,
    stmts: &Stmts<'_>,
    plan: &Plan<'_>,
    now: Option<f64>,
) -> Result<Outcome, tokio_postgres::Error> {
    let (begun, loaded) = futures_util::future::join(
        client.batch_execute("BEGIN"),
        load(client, stmts, plan.slots(), now, true),
    )
    .await;
    let result = async {
        begun?;
        let decided = decide(plan, loaded?);
        let (written, committed) = futures_util::future::join(
            save(client, stmts, plan, &decided),
            client.batch_execute("COMMIT"),
        )
        .await;
        // A write that failed aborted the transaction, which COMMIT then rolled back.
        written?;
        committed?;
        Ok(decided.outcome)
    }
    .await;
    if result.is_err() && !client.is_closed() {
        let _ = client.batch_execute("ROLLBACK").await;
    }
    result
}

async fn delete_all<G: GenericClient + Sync>(
    client: &G,
    stmts: &Stmts<'_>,
    name: &str,
    key: Option<&str>,
    shards: u16,
) -> Result<(), tokio_postgres::Error> {
    let (has_key, key) = key_columns(key);
    query(client, stmts.delete_all, &[&name, &has_key, &key, &i32::from(shards)]).await?;
    Ok(())
}

fn pg_error(what: &str, e: tokio_postgres::Error) -> StoreError {
    // In a caller's transaction ([`PgTransaction`]) the table (and the functions beside it)
    // may never have been made.
    use tokio_postgres::error::SqlState;
    let missing = [SqlState::UNDEFINED_TABLE, SqlState::UNDEFINED_FUNCTION];
    let hint = if e.code().is_some_and(|code| missing.contains(code)) {
        "; create tollgate's table once by opening a PgStore on this database"
    } else {
        ""
    };
    let detail = match e.as_db_error() {
        Some(db) => format!("{}: {}", db.severity(), db.message()),
        None => e.to_string(),
    };
    StoreError::with_source(format!("postgres: {what}: {detail}{hint}"), e)
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

    /// Returns every lease this store holds (for a graceful shutdown: the tokens go back to
    /// the limit at once instead of when the leases expire). Leases are fetched again on
    /// the next take.
    ///
    /// # Errors
    ///
    /// The first store error; the other leases are returned all the same.
    pub async fn release_leases(&self) -> Result<(), StoreError> {
        lease::release_all(&*self.shared).await
    }

    /// What each leased (name, key) did in this process.
    pub fn lease_stats(&self) -> Vec<(String, Option<String>, LeaseStats)> {
        lease::stats(self.shared.leases.as_ref())
    }

    /// The tokens of the leased limit (name, key) leased out now, over every process
    /// (`/v1/value` reports them beside the value, which is what a direct take may take).
    ///
    /// # Errors
    ///
    /// The store's.
    pub async fn leased_out(
        &self,
        name: &str,
        key: Option<&str>,
        config: &tollgate_algebra::Config,
    ) -> Result<f64, StoreError> {
        lease::leased_out(&*self.shared, &lease::look_slot(name, key, *config)).await
    }
}

impl<C: Clock> LeaseStore for Shared<C> {
    const NAME: &'static str = "postgres";

    async fn lease_call(
        &self,
        slot: &Slot<'_>,
        step: Step,
    ) -> Result<(f64, Leased, Vec<f64>), StoreError> {
        let row = Box::new(LeaseRow::new(slot, step, self.now()));
        self.submit(|ticket| Job::Lease(row, ticket)).await
    }

    async fn announce(
        &self,
        name: &str,
        said: &str,
        ttl: Duration,
    ) -> Result<Option<String>, StoreError> {
        let job =
            (self.sql.announce.clone(), name.to_owned(), said.to_owned(), ttl.as_secs_f64() * 1e3);
        self.submit(|ticket| Job::Announce(Box::new(job), ticket)).await
    }

    fn leases(&self) -> Option<&Leases> {
        self.leases.as_ref()
    }

    fn clock_now(&self) -> Option<f64> {
        self.now()
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
        Box::pin(async move {
            if let Some(leases) = &self.shared.leases
                && leases.is_leased(take.slot.name)
            {
                return lease::take(&self.shared, leases, take).await;
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
                return lease::read(&*self.shared, slots).await;
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
                return lease::reset(&*self.shared, leases, name, key).await;
            }
            let (name, key) = (name.to_owned(), key.map(str::to_owned));
            self.submit(|ticket| Job::Delete(name, key, shards, ticket)).await
        })
    }
}

/// The answer to `take` from what the `take` function read and did: tollgate-algebra's, on the
/// same state and time, as for a plan.
fn decided(take: &OneTake<'_>, (db_now, wrote, state): OneAnswer) -> Result<Taken, StoreError> {
    let (taken, new) = take.decide(db_now, state);
    if wrote != new.is_some() {
        return Err(StoreError::new(
            "postgres: the database and tollgate-algebra disagree on this request; this is a bug",
        ));
    }
    Ok(taken)
}

/// The limiter inside a transaction of your own (tokio-postgres): the tokens are spent if
/// you commit and given back if you roll back. The table must exist (open a [`PgStore`]
/// once, or create it as that does). The slots' locks are held until your transaction ends:
/// take several limits in one `transaction_async` (locked in ascending order) rather than
/// one after another, or your transaction may deadlock with a request that locks them all
/// (PostgreSQL then fails one of the two with an error; nothing is admitted by it).
///
/// Works on anything tokio-postgres calls a [`GenericClient`]: a `Transaction` (the usual
/// case) or a `Client` (each statement then commits alone: use that only for tests). Each
/// request is one round trip for a one-take (the table's `take` function), two for a
/// transaction or a sharded limit.
///
/// # Examples
///
/// ```no_run
/// use tollgate::store::{PgStore, PgTransaction};
/// use tollgate::{Config, RateLimiter, MINUTE};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let url = "postgres://postgres@127.0.0.1/app";
/// let limiter = RateLimiter::new(PgStore::open(url).await?);
/// let (mut client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
/// tokio::spawn(connection);
/// let tx = client.transaction().await?;
/// let orders = ("orders", Config::token_bucket(1.0, MINUTE));
/// if limiter.on(PgTransaction::new(&tx)).limit_async(orders, "alice").await?.ok {
///     tx.execute("INSERT INTO orders (item) VALUES ('book')", &[]).await?;
///     tx.commit().await?; // the token is spent together with the order
/// } // dropped without commit: rolled back, the token is back
/// # Ok(())
/// # }
/// ```
pub struct PgTransaction<'t, T, C = tollgate_algebra::SystemClock> {
    client: &'t T,
    sql: PgSql,
    clock: Option<C>,
}

impl<'t, T: GenericClient + Sync> PgTransaction<'t, T> {
    /// The limiter's states in `client`'s transaction, in the default table, on the
    /// database's clock.
    pub fn new(client: &'t T) -> Self {
        PgTransaction { client, sql: PgSql::new("tollgate_state"), clock: None }
    }
}

impl<'t, T: GenericClient + Sync, C: Clock> PgTransaction<'t, T, C> {
    /// The same, in `table`, on `clock`: for tests.
    ///
    /// # Errors
    ///
    /// A table name other than letters, digits and `_`.
    pub fn with_table_and_clock(client: &'t T, table: &str, clock: C) -> Result<Self, StoreError> {
        if !valid_table(table) {
            return Err(StoreError::new(format!(
                "postgres: table name {table:?}: use letters, digits and _, at most {MAX_TABLE}"
            )));
        }
        Ok(PgTransaction { client, sql: PgSql::new(table), clock: Some(clock) })
    }

    fn now(&self) -> Option<f64> {
        self.clock.as_ref().map(Clock::now)
    }
}

impl<T: GenericClient + Sync, C: Clock> AsyncStore for PgTransaction<'_, T, C> {
    fn execute_async<'a>(&'a self, plan: &'a Plan<'_>) -> BoxFuture<'a, Outcome> {
        Box::pin(async move {
            execute_in(self.client, &text(&self.sql), plan, self.now())
                .await
                .map_err(|e| pg_error("request failed", e))
        })
    }

    fn execute_one_async<'a>(&'a self, take: &'a OneTake<'_>) -> BoxFuture<'a, Taken> {
        Box::pin(async move {
            let row = OneRow::new(take, self.now());
            let rows = query(self.client, text(&self.sql).take, &row.params())
                .await
                .map_err(|e| pg_error("request failed", e))?;
            let found = rows.first().ok_or_else(|| StoreError::new("postgres: no answer"))?;
            decided(take, answer(found)?)
        })
    }

    fn read_async<'a>(&'a self, slots: &'a [Slot<'_>]) -> BoxFuture<'a, (f64, Vec<Option<State>>)> {
        Box::pin(async move {
            load(self.client, &text(&self.sql), slots, self.now(), true)
                .await
                .map(|(now, states, _)| (now, states))
                .map_err(|e| pg_error("read failed", e))
        })
    }

    fn delete_async<'a>(
        &'a self,
        name: &'a str,
        key: Option<&'a str>,
        shards: u16,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            delete_all(self.client, &text(&self.sql), name, key, shards)
                .await
                .map_err(|e| pg_error("delete failed", e))
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
    use tollgate_algebra::{Config, MINUTE, ManualClock, Take};

    use super::*;
    use crate::store::sql::take_params;
    use crate::store::testing::backend_url;
    use crate::store::testing::{T0, grouped_takes_answer_as_memory, writing};

    fn url() -> Option<String> {
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
    struct OnTable {
        store: PgStore<ManualClock>,
        url: String,
        table: String,
    }

    impl OnTable {
        async fn open(url: &str, test: &str, clock: &ManualClock) -> Self {
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
                     DROP FUNCTION IF EXISTS {0}_lheld",
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

    /// Leases on PostgreSQL (issue 34): the `lease` function against tollgate-algebra's model,
    /// several leasing processes against the interval bound, the paths that would ignore
    /// lease records refused.
    mod leases {
        use proptest::prelude::*;
        use tollgate_algebra::lease::Leased;

        use super::*;
        use crate::store::lease::testing::{
            self, Leasing, Op, act, config, op, processes, run_op,
            transaction_takes_a_leased_limit_directly, worst,
        };
        use crate::store::lease::{Answer, LeaseOptions, LeaseStats};

        impl OnTable {
            async fn leasing(url: &str, test: &str, clock: &ManualClock, name: &str) -> Self {
                let table = format!("tollgate_{test}_{}", std::process::id());
                let store = PgStore::builder()
                    .table(&table)
                    .lease(name, LeaseOptions::new().term(Duration::from_millis(800)))
                    .open_with_clock(url, clock.clone())
                    .await;
                OnTable { store: store.unwrap(), url: url.to_owned(), table }
            }
        }

        impl Leasing for PgStore<ManualClock> {
            fn stats(&self) -> Vec<LeaseStats> {
                self.lease_stats().into_iter().map(|(_, _, s)| s).collect()
            }

            async fn release(&self) {
                self.release_leases().await.unwrap();
            }
        }

        fn runtime() -> tokio::runtime::Runtime {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap()
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(100))]

            /// Random steps on one leased shard, in PostgreSQL and in tollgate-algebra's model:
            /// every answer the same (checked on each step against what the function
            /// loaded, too), and what the table keeps is the model's state and records.
            #[test]
            fn postgres_runs_lease_steps_as_the_model(
                config in config(),
                ops in prop::collection::vec(op(), 1..40),
            ) {
                let Some(url) = url() else { return Ok(()) };
                runtime().block_on(async {
                    let clock = ManualClock::new(T0);
                    let on = OnTable::open(&url, "lease_model", &clock).await;
                    let take = Take { name: "t", key: None, config, count: 1.0, reserve: false };
                    let slot = writing(&take).slot;
                    let mut model = Leased::default();
                    for &op in &ops {
                        if let Op::Wait(dt) = op {
                            clock.advance(dt);
                        }
                        let now = clock.now();
                        let (answer, expected) =
                            run_op(&on.store, &*on.store.shared, &mut model, &slot, now, op).await;
                        assert_eq!(answer, expected, "{op:?} at {now}");
                    }
                    // What the table keeps (a look loads it as it is) is the model's.
                    let look = Step::Take { count: 0.0, reserve: false, writes: false };
                    let (now, kept, _) = on.store.shared.lease_call(&slot, look).await.unwrap();
                    let (c, a) = (&slot.config, slot.alignment);
                    // A state forgotten by a reset keeps its records: stored all the same.
                    if kept.state.is_some() || !kept.leases.is_empty() {
                        let (mut kept, mut model) = (kept, model.clone());
                        assert_eq!(kept.advance(c, a, now), model.advance(c, a, now));
                        assert_eq!(kept.leases, model.leases);
                    } else {
                        let mut advanced = model.clone();
                        let state = advanced.advance(c, a, now);
                        assert!(advanced.leases.is_empty() && state.value >= c.capacity());
                    }
                    on.store.delete_async("t", None, 1).await.unwrap();
                });
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(16))]

            /// Four processes, each its own store leasing the limit, on one table and one
            /// (manual) clock, take, wait, get killed and return their leases: no interval
            /// admits more than one bucket would.
            #[test]
            fn leased_processes_never_admit_more_than_the_limit(
                bucket in any::<bool>(),
                acts in prop::collection::vec(act(), 50..250),
            ) {
                let Some(url) = url() else { return Ok(()) };
                let config = if bucket {
                    Config::token_bucket(20.0, 1_000.0).with_capacity(40.0)
                } else {
                    Config::fixed_window(20.0, 1_000.0)
                };
                let admitted = runtime().block_on(async {
                    let clock = ManualClock::new(T0);
                    let on = OnTable::open(&url, "lease_processes", &clock).await;
                    let table = on.table.clone();
                    let open = async || {
                        PgStore::builder()
                            .table(&table)
                            .lease("hot", LeaseOptions::new().term(Duration::from_millis(800)))
                            .open_with_clock(&url, clock.clone())
                            .await
                            .unwrap()
                    };
                    let (admitted, _) = processes(&clock, config, &acts, open).await;
                    drop(on);
                    admitted
                });
                let worst = worst(&config, &admitted);
                prop_assert!(worst <= 1e-6, "{worst} over the bound: {admitted:?}");
            }
        }

        /// Far from its bound, a hot limit is answered from the lease, with few calls to
        /// the database.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_hot_limit_is_answered_from_the_lease() {
            let Some(url) = url() else { return };
            let clock = ManualClock::new(T0);
            let on = OnTable::leasing(&url, "lease_hot", &clock, "hot").await;
            let config = Config::token_bucket(1_000.0, 1_000.0).with_capacity(1_000.0);
            let take = Take { name: "hot", key: None, config, count: 1.0, reserve: false };
            let one = writing(&take);
            for i in 0..600 {
                assert!(on.store.execute_one_async(&one).await.unwrap().decision.ok);
                if i % 10 == 0 {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
            let stats = on.store.lease_stats()[0].2;
            assert!(stats.local >= 400 && stats.direct <= 200, "mostly from the lease: {stats:?}");
            // Returned: the table reads as if only the 600 were taken. (A grant still on its
            // way at the return would stay out until its expiry, by design: let it land.)
            tokio::time::sleep(Duration::from_millis(100)).await;
            on.store.release_leases().await.unwrap();
            let (_, states) = on.store.read_async(&[one.slot]).await.unwrap();
            assert_eq!(states[0].unwrap().value, 400.0);
        }

        /// A transaction takes a leased limit directly from the table (not from a lease),
        /// all or nothing with the others, and never past what the leases out leave; the
        /// records are kept.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_transaction_takes_a_leased_limit_directly() {
            let Some(url) = url() else { return };
            let clock = ManualClock::new(T0);
            let on = OnTable::leasing(&url, "lease_transaction", &clock, "hot").await;
            transaction_takes_a_leased_limit_directly(&on.store, &*on.store.shared, &clock).await;
        }

        /// Checks take no lease and no entry; idle keys' entries come back (see
        /// `checks_take_no_lease_and_idle_keys_make_room`).
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn checks_take_no_lease_and_idle_keys_make_room() {
            let Some(url) = url() else { return };
            let clock = ManualClock::new(T0);
            let on = OnTable::leasing(&url, "lease_room", &clock, "hot").await;
            testing::checks_take_no_lease_and_idle_keys_make_room(&on.store, &clock).await;
        }

        /// A reset from a process that never took from the leased limit (see
        /// `a_reset_needs_no_lease_of_its_own`).
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_reset_needs_no_lease_of_its_own() {
            let Some(url) = url() else { return };
            let clock = ManualClock::new(T0);
            let on = OnTable::leasing(&url, "lease_reset", &clock, "hot").await;
            testing::a_reset_needs_no_lease_of_its_own(&on.store, &*on.store.shared, &clock).await;
        }

        /// A state with lease records is refused by every path that would ignore them (the
        /// `take` function, a caller's transaction), before writing.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn paths_that_ignore_leases_refuse_a_leased_state() {
            let Some(url) = url() else { return };
            let clock = ManualClock::new(T0);
            let on = OnTable::open(&url, "lease_refused", &clock).await;
            let take = Take {
                name: "t",
                key: None,
                config: Config::token_bucket(10.0, 1_000.0),
                count: 1.0,
                reserve: false,
            };
            let one = writing(&take);
            let grant =
                Step::Grant { holder: 7, want: 10.0, unused: 0.0, term: 60_000.0, share: 1.0 };
            let (Answer::Granted(g), _, _) =
                lease::step(&*on.store.shared, &one.slot, grant).await.unwrap()
            else {
                panic!()
            };
            assert_eq!(g.tokens, 10.0);
            clock.advance(5_000.0);
            let error = on.store.execute_one_async(&one).await.unwrap_err();
            assert!(error.message().contains("t holds lease records"), "{error}");
            // A transaction of the store's own reads the records and takes directly, under
            // the cap they set (nothing left: refused); a caller's transaction refuses.
            assert!(!on.store.execute_async(&one.to_plan()).await.unwrap().ok);
            let (client, connection) = tokio_postgres::connect(&url, NoTls).await.unwrap();
            tokio::spawn(connection);
            let mut client = client;
            let transaction = client.transaction().await.unwrap();
            let theirs =
                PgTransaction::with_table_and_clock(&transaction, &on.table, clock.clone())
                    .unwrap();
            let error = theirs.execute_async(&one.to_plan()).await.unwrap_err();
            assert!(error.message().contains("t holds lease records"), "{error}");
            drop(transaction);
            // Still leased, and the bucket still capped: nothing has flowed in past the lease.
            let direct = Step::Take { count: 1.0, reserve: false, writes: true };
            let (answer, _, _) = lease::step(&*on.store.shared, &one.slot, direct).await.unwrap();
            assert_eq!(answer, Answer::Taken(false));
            let back = Step::Release { holder: 7, unused: 10.0 };
            lease::step(&*on.store.shared, &one.slot, back).await.unwrap();
            // No records left: a plain take takes it again.
            assert!(on.store.execute_one_async(&one).await.unwrap().decision.ok);
        }
    }
}
