//! States in PostgreSQL: correct under READ COMMITTED, on the database's clock.

use std::cell::RefCell;
use std::time::Duration;

use postgres::{Client, GenericClient, NoTls, Statement, ToStatement};
use tollgate_core::{Clock, Kind, OneTake, Outcome, Plan, Slot, State, Taken};

use super::Store;
use super::group::{Group, OneAnswer, fail_all};
use super::pool::Pool;
use super::sql::{
    LOCK_CLASS, MAX_TABLE, PG_LOCK, PgSql, key_columns, lock_id, lock_ids, saves, valid_table,
};
use crate::StoreError;

/// Options for a [`PgStore`].
#[derive(Debug, Clone)]
pub struct PgStoreBuilder {
    table: String,
    timeout: Duration,
    connections: usize,
}

impl Default for PgStoreBuilder {
    fn default() -> Self {
        PgStoreBuilder {
            table: "tollgate_state".into(),
            timeout: Duration::from_secs(2),
            connections: 8,
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

    /// How long to wait to connect, and for a statement, before failing (closed); default 2 s.
    /// A request that waits for a grouped statement (see [`PgStoreBuilder::connections`])
    /// fails after twice this: one statement of others, then its own; if it was never sent,
    /// nothing was taken.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How many connections to keep (default 8); a request holds one for its transaction.
    /// A one-take request (the common `limit`) that finds every connection busy waits for
    /// the next statement, which carries up to 64 waiting requests in one transaction
    /// (group commit: one round trip and one commit for all of them; each request is still
    /// taken on its own, in arrival order, and answered only once that transaction has
    /// committed).
    #[must_use]
    pub fn connections(mut self, connections: usize) -> Self {
        self.connections = connections.max(1);
        self
    }

    /// Connects to `url` (`postgres://user@host/db`), creates the table if it is missing, and
    /// uses the database's clock.
    ///
    /// # Errors
    ///
    /// A bad URL or table name, or a database that cannot be reached.
    pub fn open(self, url: &str) -> Result<PgStore, StoreError> {
        self.build(url, None)
    }

    /// The same, on `clock` instead of the database's: for tests that set the time.
    ///
    /// # Errors
    ///
    /// As for [`PgStoreBuilder::open`].
    pub fn open_with_clock<C: Clock>(self, url: &str, clock: C) -> Result<PgStore<C>, StoreError> {
        self.build(url, Some(clock))
    }

    fn build<C>(self, url: &str, clock: Option<C>) -> Result<PgStore<C>, StoreError> {
        if !valid_table(&self.table) {
            return Err(StoreError::new(format!(
                "postgres: table name {:?}: use letters, digits and _, at most {MAX_TABLE}",
                self.table
            )));
        }
        let mut config: postgres::Config = url
            .parse()
            .map_err(|e| StoreError::with_source(format!("postgres: {url:?}: {e}"), e))?;
        config.connect_timeout(self.timeout);
        let sql = PgSql::new(&self.table);
        let store = PgStore {
            config,
            connections: Pool::new(self.connections),
            group: Group::new(self.connections, MOST_PER_STATEMENT),
            timeout: self.timeout,
            sql,
            clock,
        };
        store.with_conn(|conn| create_table(&mut conn.client, &store.sql))?;
        Ok(store)
    }
}

fn create_table(client: &mut Client, sql: &PgSql) -> Result<(), postgres::Error> {
    // Serialized, so that servers starting together do not race on CREATE TABLE (or on
    // replacing the function, which fails when two do it at once).
    let mut tx = client.transaction()?;
    tx.execute("SELECT pg_advisory_xact_lock($1, 0)", &[&LOCK_CLASS])?;
    tx.batch_execute(&sql.create)?;
    tx.batch_execute(&sql.drop_old)?;
    tx.batch_execute(&sql.create_take)?;
    tx.batch_execute(&sql.create_takes)?;
    tx.commit()
}

/// A pooled connection and its statements, prepared on first use: a statement given as text
/// is prepared by the server on every call, a round trip of its own.
struct PgConn {
    client: Client,
    prepared: Option<Prepared>,
}

struct Prepared {
    statements: Statements<Statement>,
    take: Statement,
    takes: Statement,
}

impl PgConn {
    fn prepared(&mut self, sql: &PgSql) -> Result<(&mut Client, &Prepared), postgres::Error> {
        if self.prepared.is_none() {
            let c = &mut self.client;
            let statements = text(sql).map(|q| c.prepare(q))?;
            let (take, takes) = (c.prepare(&sql.take)?, c.prepare(&sql.takes)?);
            self.prepared = Some(Prepared { statements, take, takes });
        }
        Ok((&mut self.client, self.prepared.as_ref().expect("prepared above")))
    }
}

/// The statements a request runs: as text in a caller's transaction ([`PgTransaction`]), or
/// prepared once per pooled connection ([`PgStore`]).
struct Statements<S> {
    lock: S,
    load: S,
    upsert: S,
    delete: S,
    delete_all: S,
}

impl<S> Statements<S> {
    /// Each statement through `f`, in order.
    fn map<'s, T, E>(
        &'s self,
        mut f: impl FnMut(&'s S) -> Result<T, E>,
    ) -> Result<Statements<T>, E> {
        Ok(Statements {
            lock: f(&self.lock)?,
            load: f(&self.load)?,
            upsert: f(&self.upsert)?,
            delete: f(&self.delete)?,
            delete_all: f(&self.delete_all)?,
        })
    }

    /// The same statements, borrowed.
    fn by_ref(&self) -> Statements<&S> {
        self.map(Ok::<_, std::convert::Infallible>).unwrap_or_else(|never| match never {})
    }
}

/// `sql`'s statements as text.
fn text(sql: &PgSql) -> Statements<&str> {
    Statements {
        lock: PG_LOCK,
        load: &sql.load,
        upsert: &sql.upsert,
        delete: &sql.delete,
        delete_all: &sql.delete_all,
    }
}

/// States in PostgreSQL (SPEC §5): for apps on Postgres and several app servers.
///
/// Each request is one transaction at the default READ COMMITTED isolation. A naive
/// read-modify-write is racy there, so the request first takes a transaction-scoped advisory
/// lock on each of its (name, key, shard) slots, in ascending order (no deadlock between
/// tollgate requests), which serializes every request that touches a slot, even one whose
/// row does not exist yet; then it reads the states and the database's clock in one query,
/// decides, and writes. A database that cannot be reached or times out is a [`StoreError`];
/// nothing is admitted, and the next request connects again.
///
/// To spend tokens inside a transaction of your own, use [`PgTransaction`].
///
/// # Examples
///
/// ```no_run
/// use tollgate::store::PgStore;
/// use tollgate::{Config, RateLimiter, MINUTE};
///
/// let limiter = RateLimiter::new(PgStore::open("postgres://postgres@127.0.0.1/app").unwrap());
/// assert!(limiter.limit(("send", Config::token_bucket(10.0, MINUTE)), "alice").unwrap().ok);
/// ```
pub struct PgStore<C = tollgate_core::SystemClock> {
    config: postgres::Config,
    connections: Pool<PgConn>,
    /// One-takes, sent together when every connection is busy.
    group: Group<OneRow, OneAnswer>,
    timeout: Duration,
    sql: PgSql,
    /// `None`: the database's clock.
    clock: Option<C>,
}

impl PgStore {
    /// Connects to `url` with the default options.
    ///
    /// # Errors
    ///
    /// As for [`PgStoreBuilder::open`].
    pub fn open(url: &str) -> Result<Self, StoreError> {
        PgStoreBuilder::default().open(url)
    }

    /// Options: table, timeout, connections.
    pub fn builder() -> PgStoreBuilder {
        PgStoreBuilder::default()
    }
}

/// The most one-takes a grouped statement carries.
const MOST_PER_STATEMENT: usize = 64;

/// One take from one unsharded limit, as the parameters of the table's `take` function.
struct OneRow {
    lock: i32,
    name: String,
    key: Option<String>,
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
        OneRow {
            lock: lock_id(slot.name, slot.key, slot.shard),
            name: slot.name.to_owned(),
            key: slot.key.map(str::to_owned),
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
}

/// Reads an answer of the `take` function (a row of `takes`): an array of the time it used,
/// whether it wrote (1 or 0), and the state it read (value and ts, or two NULLs).
fn answer(row: &postgres::Row) -> Result<OneAnswer, StoreError> {
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

impl<C> PgStore<C> {
    /// Runs one-takes in one statement: the `take` function for one, `takes` for several;
    /// answers each.
    fn send_ones(&self, rows: &[&OneRow]) -> Vec<Result<OneAnswer, StoreError>> {
        let answers = self.with_conn(|conn| {
            let (client, prepared) = conn.prepared(&self.sql)?;
            if let [r] = rows {
                let (has_key, key) = key_columns(r.key.as_deref());
                let row = client.query_one(
                    &prepared.take,
                    &[
                        &r.lock,
                        &r.name,
                        &has_key,
                        &key,
                        &r.shard,
                        &r.kind,
                        &r.rate,
                        &r.period,
                        &r.cap,
                        &r.max_reserved,
                        &r.alignment,
                        &r.count,
                        &r.reserve,
                        &r.writes,
                        &r.now,
                    ],
                )?;
                return Ok(Some(vec![answer(&row)]));
            }
            let column = |f: fn(&OneRow) -> f64| rows.iter().map(|r| f(r)).collect::<Vec<f64>>();
            let flags = |f: fn(&OneRow) -> bool| rows.iter().map(|r| f(r)).collect::<Vec<bool>>();
            let ints = |f: fn(&OneRow) -> i32| rows.iter().map(|r| f(r)).collect::<Vec<i32>>();
            let names: Vec<&str> = rows.iter().map(|r| r.name.as_str()).collect();
            let keys: Vec<&str> = rows.iter().map(|r| key_columns(r.key.as_deref()).1).collect();
            let max_reserved: Vec<Option<f64>> = rows.iter().map(|r| r.max_reserved).collect();
            let now: Vec<Option<f64>> = rows.iter().map(|r| r.now).collect();
            let found = match client.query(
                &prepared.takes,
                &[
                    &ints(|r| r.lock),
                    &names,
                    &flags(|r| r.key.is_some()),
                    &keys,
                    &ints(|r| r.shard),
                    &ints(|r| r.kind),
                    &column(|r| r.rate),
                    &column(|r| r.period),
                    &column(|r| r.cap),
                    &max_reserved,
                    &column(|r| r.alignment),
                    &column(|r| r.count),
                    &flags(|r| r.reserve),
                    &flags(|r| r.writes),
                    &now,
                ],
            ) {
                Ok(found) => found,
                // One take's arithmetic failed (a float out of range: a data exception), so
                // the statement was rolled back whole and nothing was taken: each goes again
                // alone, below, so that only that one fails.
                Err(e) if e.code().is_some_and(|c| c.code().starts_with("22")) => {
                    return Ok(None);
                }
                Err(e) => return Err(e),
            };
            Ok(Some(found.iter().map(answer).collect::<Vec<_>>()))
        });
        let answers = match answers {
            Ok(None) => return rows.iter().flat_map(|r| self.send_ones(&[r])).collect(),
            Ok(Some(answers)) => Ok(answers),
            Err(e) => Err(e),
        };
        match answers {
            Ok(answers) if answers.len() == rows.len() => answers,
            Ok(answers) => fail_all(
                rows.len(),
                StoreError::new(format!(
                    "postgres: {} rows for {} takes",
                    answers.len(),
                    rows.len()
                )),
            ),
            Err(e) => fail_all(rows.len(), e),
        }
    }
}

impl<C> PgStore<C> {
    fn with_conn<T>(
        &self,
        f: impl FnOnce(&mut PgConn) -> Result<T, postgres::Error>,
    ) -> Result<T, StoreError> {
        let connect = || {
            let mut client =
                self.config.connect(NoTls).map_err(|e| pg_error("cannot connect", e))?;
            let ms = self.timeout.as_millis();
            client
                .batch_execute(&format!("SET statement_timeout = {ms}; SET lock_timeout = {ms}"))
                .map_err(|e| pg_error("cannot set timeouts", e))?;
            Ok(PgConn { client, prepared: None })
        };
        self.connections.run(connect, f, |e| pg_error("request failed", e))
    }
}

impl<C: Clock> Store for PgStore<C> {
    fn execute(&self, plan: &Plan<'_>) -> Result<Outcome, StoreError> {
        let now = self.clock.as_ref().map(Clock::now);
        self.with_conn(|conn| {
            let (client, prepared) = conn.prepared(&self.sql)?;
            let mut tx = client.transaction()?;
            let outcome = execute_in(&mut tx, &prepared.statements.by_ref(), plan, now)?;
            tx.commit()?;
            Ok(outcome)
        })
    }

    /// The common request in one statement (see the `take` function of the table), alone
    /// or grouped with others that wait (see [`PgStoreBuilder::connections`]).
    fn execute_one(&self, take: &OneTake<'_>) -> Result<Taken, StoreError> {
        let row = OneRow::new(take, self.clock.as_ref().map(Clock::now));
        let (db_now, wrote, state) =
            self.group.run(row, 2 * self.timeout, |rows| self.send_ones(rows))?;
        // As for a plan: the answer is tollgate-core's, on what the function read.
        let (taken, new) = take.decide(db_now, state);
        if wrote != new.is_some() {
            return Err(StoreError::new(
                "postgres: the database and tollgate-core disagree on this request; this is a bug",
            ));
        }
        Ok(taken)
    }

    fn read(&self, slots: &[Slot<'_>]) -> Result<(f64, Vec<Option<State>>), StoreError> {
        let now = self.clock.as_ref().map(Clock::now);
        self.with_conn(|conn| {
            let (client, prepared) = conn.prepared(&self.sql)?;
            load(client, &prepared.statements.by_ref(), slots, now)
        })
    }

    fn delete(&self, name: &str, key: Option<&str>, shards: u16) -> Result<(), StoreError> {
        self.with_conn(|conn| {
            let (client, prepared) = conn.prepared(&self.sql)?;
            delete_all(client, &prepared.statements.by_ref(), name, key, shards)
        })
    }
}

/// The limiter inside a transaction of your own: the tokens are spent if you commit and
/// given back if you roll back. The table must exist (open a [`PgStore`] once, or create it
/// as that does). The slots' locks are held until your transaction ends: take several
/// limits in one `transaction` (locked in ascending order) rather than one after another,
/// or your transaction may deadlock with a request that locks them all (PostgreSQL then
/// fails one of the two with an error; nothing is admitted by it).
///
/// # Examples
///
/// ```no_run
/// use tollgate::store::{PgStore, PgTransaction};
/// use tollgate::{Config, RateLimiter, MINUTE};
///
/// let url = "postgres://postgres@127.0.0.1/app";
/// let limiter = RateLimiter::new(PgStore::open(url).unwrap());
/// let mut client = postgres::Client::connect(url, postgres::NoTls).unwrap();
/// let mut tx = client.transaction().unwrap();
/// let orders = ("orders", Config::token_bucket(1.0, MINUTE));
/// let ok = limiter.on(PgTransaction::new(&mut tx)).limit(orders, "alice").unwrap().ok;
/// if ok {
///     tx.execute("INSERT INTO orders (item) VALUES ('book')", &[]).unwrap();
///     tx.commit().unwrap(); // the token is spent together with the order
/// } // dropped without commit: rolled back, the token is back
/// ```
pub struct PgTransaction<'t, 'c, C = tollgate_core::SystemClock> {
    tx: RefCell<&'t mut postgres::Transaction<'c>>,
    sql: PgSql,
    clock: Option<C>,
}

impl<'t, 'c> PgTransaction<'t, 'c> {
    /// The limiter's states in `tx`, in the default table, on the database's clock.
    pub fn new(tx: &'t mut postgres::Transaction<'c>) -> Self {
        PgTransaction { tx: RefCell::new(tx), sql: PgSql::new("tollgate_state"), clock: None }
    }
}

impl<'t, 'c, C: Clock> PgTransaction<'t, 'c, C> {
    /// The same, in `table`, on `clock`: for tests.
    ///
    /// # Errors
    ///
    /// A table name other than letters, digits and `_`.
    pub fn with_table_and_clock(
        tx: &'t mut postgres::Transaction<'c>,
        table: &str,
        clock: C,
    ) -> Result<Self, StoreError> {
        if !valid_table(table) {
            return Err(StoreError::new(format!(
                "postgres: table name {table:?}: use letters, digits and _, at most {MAX_TABLE}"
            )));
        }
        Ok(PgTransaction { tx: RefCell::new(tx), sql: PgSql::new(table), clock: Some(clock) })
    }
}

impl<C: Clock> Store for PgTransaction<'_, '_, C> {
    fn execute(&self, plan: &Plan<'_>) -> Result<Outcome, StoreError> {
        let now = self.clock.as_ref().map(Clock::now);
        execute_in(&mut **self.tx.borrow_mut(), &text(&self.sql), plan, now)
            .map_err(|e| pg_error("request failed", e))
    }

    fn read(&self, slots: &[Slot<'_>]) -> Result<(f64, Vec<Option<State>>), StoreError> {
        let now = self.clock.as_ref().map(Clock::now);
        load(&mut **self.tx.borrow_mut(), &text(&self.sql), slots, now)
            .map_err(|e| pg_error("read failed", e))
    }

    fn delete(&self, name: &str, key: Option<&str>, shards: u16) -> Result<(), StoreError> {
        delete_all(&mut **self.tx.borrow_mut(), &text(&self.sql), name, key, shards)
            .map_err(|e| pg_error("delete failed", e))
    }
}

/// Locks the slots (ascending), then loads their states and the time in one query.
fn load<S: ToStatement + ?Sized>(
    client: &mut impl GenericClient,
    sql: &Statements<&S>,
    slots: &[Slot<'_>],
    now: Option<f64>,
) -> Result<(f64, Vec<Option<State>>), postgres::Error> {
    for id in &lock_ids(slots) {
        client.execute(sql.lock, &[&LOCK_CLASS, id])?;
    }
    let names: Vec<&str> = slots.iter().map(|s| s.name).collect();
    let has_keys: Vec<bool> = slots.iter().map(|s| s.key.is_some()).collect();
    let keys: Vec<&str> = slots.iter().map(|s| s.key.unwrap_or("")).collect();
    let shards: Vec<i32> = slots.iter().map(|s| i32::from(s.shard)).collect();
    let rows = client.query(sql.load, &[&names, &has_keys, &keys, &shards])?;
    let mut db_now = now.unwrap_or(0.0);
    let mut states = vec![None; slots.len()];
    for row in rows {
        let i: i64 = row.get(0);
        let value: Option<f64> = row.get(1);
        let ts: Option<f64> = row.get(2);
        if now.is_none() {
            db_now = row.get(3);
        }
        if let (Some(value), Some(ts), Some(slot)) = (value, ts, states.get_mut(i as usize - 1)) {
            *slot = Some(State { value, ts });
        }
    }
    if now.is_none() && slots.is_empty() {
        db_now = client
            .query_one("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::float8", &[])?
            .get(0);
    }
    Ok((db_now, states))
}

/// One request within a transaction already begun: lock, load, decide, write what changed.
fn execute_in<S: ToStatement + ?Sized>(
    client: &mut impl GenericClient,
    sql: &Statements<&S>,
    plan: &Plan<'_>,
    now: Option<f64>,
) -> Result<Outcome, postgres::Error> {
    let (now, mut states) = load(client, sql, plan.slots(), now)?;
    let outcome = plan.decide(now, &mut states);
    for (slot, state) in saves(plan, &states, &outcome, now) {
        let ((has_key, key), shard) = (key_columns(slot.key), i32::from(slot.shard));
        match state {
            Some(s) => client
                .execute(sql.upsert, &[&slot.name, &has_key, &key, &shard, &s.value, &s.ts])?,
            None => client.execute(sql.delete, &[&slot.name, &has_key, &key, &shard])?,
        };
    }
    Ok(outcome)
}

fn delete_all<S: ToStatement + ?Sized>(
    client: &mut impl GenericClient,
    sql: &Statements<&S>,
    name: &str,
    key: Option<&str>,
    shards: u16,
) -> Result<(), postgres::Error> {
    let (has_key, key) = key_columns(key);
    client.execute(sql.delete_all, &[&name, &has_key, &key, &i32::from(shards)])?;
    Ok(())
}

fn pg_error(what: &str, e: postgres::Error) -> StoreError {
    // In a caller's transaction ([`PgTransaction`]) the table may never have been made.
    let hint = if e.code() == Some(&postgres::error::SqlState::UNDEFINED_TABLE) {
        "; create tollgate's table once by opening a PgStore on this database"
    } else {
        ""
    };
    StoreError::with_source(format!("postgres: {what}: {e}{hint}"), e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_checked() {
        let err = PgStore::builder()
            .table("x; DROP TABLE y")
            .open("postgres://127.0.0.1:1/x")
            .err()
            .unwrap();
        assert!(err.to_string().contains("use letters, digits and _"), "{err}");
    }
}

/// The grouped statement against the memory store, on the PostgreSQL of
/// `TOLLGATE_POSTGRES_URL` (skipped without it, unless `TOLLGATE_REQUIRE_BACKENDS=1`).
#[cfg(test)]
mod group_tests {
    use tollgate_core::{Config, MINUTE, ManualClock, Take};

    use super::*;
    use crate::store::group::testing::{T0, backend_url, grouped_takes_answer_as_memory, writing};
    use crate::store::sql::take_params;

    fn url() -> Option<String> {
        backend_url("TOLLGATE_POSTGRES_URL")
    }

    /// `takes` in one statement, at `now`.
    fn send_group(
        store: &PgStore<ManualClock>,
        takes: &[OneTake<'_>],
        now: f64,
    ) -> Vec<Result<OneAnswer, StoreError>> {
        let rows: Vec<OneRow> = takes.iter().map(|o| OneRow::new(o, Some(now))).collect();
        store.send_ones(&rows.iter().collect::<Vec<_>>())
    }

    /// A store on a table of its own, which is dropped with its functions however the test
    /// ends.
    struct OnTable {
        store: PgStore<ManualClock>,
        url: String,
        table: String,
    }

    impl OnTable {
        fn open(url: &str, test: &str, clock: &ManualClock) -> Self {
            let table = format!("tollgate_{test}_{}", std::process::id());
            let store = PgStore::builder().table(&table).open_with_clock(url, clock.clone());
            OnTable { store: store.unwrap(), url: url.to_owned(), table }
        }
    }

    impl OnTable {
        /// Runs `sql` on the table's database, on a connection of its own.
        fn batch(&self, sql: &str) -> Result<(), postgres::Error> {
            postgres::Client::connect(&self.url, NoTls)?.batch_execute(sql)
        }
    }

    impl Drop for OnTable {
        fn drop(&mut self) {
            let _ = self.batch(&format!(
                "DROP TABLE IF EXISTS {0}; DROP FUNCTION IF EXISTS {0}_takes; \
                 DROP FUNCTION IF EXISTS {0}_take",
                self.table
            ));
        }
    }

    #[test]
    fn grouped_takes_answer_as_memory_one_after_the_other() {
        let Some(url) = url() else { return };
        let clock = ManualClock::new(T0);
        let on = OnTable::open(&url, "group", &clock);
        let store = &on.store;
        grouped_takes_answer_as_memory(&clock, store, |ones| {
            send_group(store, ones, clock.now()).into_iter().map(Result::unwrap).collect()
        });
    }

    /// A table whose functions an earlier version made (answering rows, which `CREATE OR
    /// REPLACE` cannot change) gets this version's functions when a store opens on it.
    #[test]
    fn functions_of_an_earlier_version_are_replaced() {
        let Some(url) = url() else { return };
        let clock = ManualClock::new(T0);
        let on = OnTable::open(&url, "earlier", &clock);
        let table = &on.table;
        on.batch(&format!(
            "DROP FUNCTION {table}_take; DROP FUNCTION {table}_takes;
             CREATE FUNCTION {table}_take({take}, OUT o_now float8, OUT o_wrote bool,
               OUT o_value float8, OUT o_ts float8)
               LANGUAGE sql AS 'SELECT 0::float8, false, NULL::float8, NULL::float8';
             CREATE FUNCTION {table}_takes({takes}, OUT o_now float8, OUT o_wrote bool,
               OUT o_value float8, OUT o_ts float8) RETURNS SETOF record
               LANGUAGE sql AS 'SELECT 0::float8, false, NULL::float8, NULL::float8'",
            take = take_params(false, false),
            takes = take_params(false, true),
        ))
        .unwrap();
        let store = PgStore::builder().table(table).open_with_clock(&url, clock.clone()).unwrap();
        let config = Config::token_bucket(10.0, MINUTE);
        let take = Take { name: "n", key: Some("k"), config, count: 4.0, reserve: false };
        for left in [6.0, 2.0] {
            let taken = store.execute_one(&writing(&take)).unwrap();
            assert_eq!(taken.status.remaining, left);
        }
        let answers = send_group(&store, &[writing(&take), writing(&take)], clock.now());
        let wrote: Vec<bool> = answers.iter().map(|a| a.as_ref().unwrap().1).collect();
        assert_eq!(wrote, [false, false], "2 left: both refused");
    }

    /// A `take` function that answers something else than its array fails the request.
    #[test]
    fn a_garbled_answer_is_an_error() {
        let Some(url) = url() else { return };
        let clock = ManualClock::new(T0);
        let on = OnTable::open(&url, "garbled", &clock);
        let table = &on.table;
        let config = Config::token_bucket(10.0, MINUTE);
        let take = Take { name: "n", key: Some("k"), config, count: 1.0, reserve: false };
        for garbage in ["ARRAY[1, 2]", "ARRAY[1, 2, 3, NULL]", "ARRAY[NULL, 1, NULL, NULL]"] {
            on.batch(&format!(
                "DROP FUNCTION {table}_take; CREATE FUNCTION {table}_take({args})
                   RETURNS float8[] LANGUAGE sql AS 'SELECT {garbage}::float8[]'",
                args = take_params(false, false),
            ))
            .unwrap();
            let err = on.store.execute_one(&writing(&take)).unwrap_err();
            assert!(err.to_string().contains("garbage"), "{garbage}: {err}");
        }
    }

    /// A take whose arithmetic fails in PostgreSQL (a refill that overflows a float8) fails
    /// alone: the group goes again one take at a time, and the others are taken once.
    #[test]
    fn a_take_whose_arithmetic_fails_fails_alone() {
        let Some(url) = url() else { return };
        let clock = ManualClock::new(T0);
        let on = OnTable::open(&url, "overflow", &clock);
        let store = &on.store;
        let huge = Config::token_bucket(1e300, 1.0);
        let normal = Config::token_bucket(10.0, MINUTE);
        let take =
            |name, config, count| Take { name, key: Some("k"), config, count, reserve: false };
        // A state of the huge limit; 11 days later its refill, 1e9 ms x 1e300, overflows.
        assert!(store.execute_one(&writing(&take("huge", huge, 1e299))).unwrap().decision.ok);
        clock.advance(1e9);
        let takes =
            [take("normal", normal, 1.0), take("huge", huge, 1.0), take("normal", normal, 2.0)];
        let answers = send_group(store, &takes.each_ref().map(writing), clock.now());
        assert!(answers[1].is_err(), "{:?}", answers[1]);
        assert!(answers[0].as_ref().unwrap().1 && answers[2].as_ref().unwrap().1, "both wrote");
        let slot = [writing(&takes[0]).slot];
        let now = clock.now();
        assert_eq!(store.read(&slot).unwrap().1, [Some(State { value: 7.0, ts: now })]);
    }
}
