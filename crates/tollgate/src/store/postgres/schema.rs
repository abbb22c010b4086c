//! The PostgreSQL store's schema and statements: the table and its functions, created once
//! when a store opens; the statements a request runs, prepared on a worker's connection
//! ([`Conn`]) or sent as text with their parameters' types in a caller's transaction
//! ([`text`]); a statement bounded by the store's timeout, and the error of one that failed.

use std::future::Future;
use std::time::Duration;

use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, GenericClient, NoTls, Row, Statement};

use super::Shared;
use crate::error::StoreError;
use crate::store::sql::{LOCK_CLASS, PG_LOCK, PgSql};

/// Creates the table and its functions if they are missing, on a connection of its own
/// (the workers' connections prepare statements that name the functions). A database that
/// cannot be reached, or does not accept connections yet, is unavailable (a lazy store waits
/// for it); one that refuses the credentials or has no such database is not.
pub(super) async fn create_table<C>(shared: &Shared<C>) -> Result<(), StoreError> {
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
                 {}; COMMIT",
                sql.create,
                sql.slots.create,
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
        Ok(Err(e)) => {
            let refused = refused_for_good(&e);
            let error = pg_error("cannot create the table", e);
            Err(if refused { error } else { error.unavailable() })
        }
        Err(_) => Err(StoreError::new(format!(
            "postgres: cannot connect: no answer within {:?}",
            shared.timeout * 2
        ))
        .unavailable()),
    }
}

/// Whether the database answered, and refused what no retry will change: the credentials
/// (SQLSTATE class 28), a database that does not exist (3D000), or the statements (a role
/// without the right to create the table). Not reached, closed, or not accepting
/// connections yet (57P03, starting up; 53300, too many connections) is worth waiting for.
fn refused_for_good(e: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    let Some(code) = e.code() else { return false };
    let transient = [
        SqlState::CANNOT_CONNECT_NOW,
        SqlState::TOO_MANY_CONNECTIONS,
        SqlState::ADMIN_SHUTDOWN,
        SqlState::CRASH_SHUTDOWN,
    ];
    !transient.contains(code)
}

/// A statement of the store's: prepared on a store connection, or as text with its
/// parameters' types inside a caller's transaction. One round trip either way.
#[derive(Clone, Copy)]
pub(super) enum Stmt<'a> {
    Prepared(&'a Statement),
    Text(&'a str, &'a [Type]),
}

/// Runs `stmt` with `params` on `client`.
pub(super) async fn query<G: GenericClient + Sync>(
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
pub(super) struct Stmts<'a> {
    pub(super) take: Stmt<'a>,
    pub(super) lock: Stmt<'a>,
    pub(super) load: Stmt<'a>,
    /// Whether `load` reads lease records (a store's own connection) or refuses them (a
    /// caller's transaction).
    pub(super) leases: bool,
    pub(super) upsert: Stmt<'a>,
    pub(super) upsert_leases: Stmt<'a>,
    pub(super) delete: Stmt<'a>,
    pub(super) delete_all: Stmt<'a>,
    pub(super) slots: SlotStmts<'a>,
}

/// The statements on the holders of concurrency limits (see `SlotSql`).
pub(super) struct SlotStmts<'a> {
    pub(super) load: Stmt<'a>,
    pub(super) insert: Stmt<'a>,
    pub(super) remove: Stmt<'a>,
    pub(super) expiry: Stmt<'a>,
    pub(super) clear: Stmt<'a>,
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
const SLOTS_LOAD_TYPES: [Type; 5] = [Type::TEXT, Type::BOOL, Type::TEXT, Type::FLOAT8, Type::BOOL];
const SLOTS_INSERT_TYPES: [Type; 6] =
    [Type::TEXT, Type::BOOL, Type::TEXT, Type::INT8, Type::INT4, Type::FLOAT8];
const SLOTS_REMOVE_TYPES: [Type; 4] = [Type::TEXT, Type::BOOL, Type::TEXT, Type::INT8];
const SLOTS_EXPIRY_TYPES: [Type; 5] =
    [Type::TEXT, Type::BOOL, Type::TEXT, Type::INT8, Type::FLOAT8];
const SLOTS_CLEAR_TYPES: [Type; 3] = [Type::TEXT, Type::BOOL, Type::TEXT];
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
pub(super) fn text(sql: &PgSql) -> Stmts<'_> {
    Stmts {
        take: Stmt::Text(&sql.take, &TAKE_TYPES),
        lock: Stmt::Text(PG_LOCK, &LOCK_TYPES),
        load: Stmt::Text(&sql.load, &LOAD_TYPES),
        leases: false,
        upsert: Stmt::Text(&sql.upsert, &UPSERT_TYPES),
        upsert_leases: Stmt::Text(&sql.upsert_leases, &UPSERT_LEASES_TYPES),
        delete: Stmt::Text(&sql.delete, &DELETE_TYPES),
        delete_all: Stmt::Text(&sql.delete_all, &DELETE_TYPES),
        slots: SlotStmts {
            load: Stmt::Text(&sql.slots.load, &SLOTS_LOAD_TYPES),
            insert: Stmt::Text(&sql.slots.insert, &SLOTS_INSERT_TYPES),
            remove: Stmt::Text(&sql.slots.remove, &SLOTS_REMOVE_TYPES),
            expiry: Stmt::Text(&sql.slots.expiry, &SLOTS_EXPIRY_TYPES),
            clear: Stmt::Text(&sql.slots.clear, &SLOTS_CLEAR_TYPES),
        },
    }
}

/// A connection of a worker, with its statements prepared.
pub(super) struct Conn {
    pub(super) client: Client,
    pub(super) takes: Statement,
    pub(super) lease: Statement,
    pub(super) prepared: [Statement; 7],
    /// The statements on holders (in [`SlotStmts`]'s order).
    pub(super) slots: [Statement; 5],
}

impl Conn {
    /// A connection with the store's statements prepared (the table and its functions made
    /// first, if this store has not made them yet).
    pub(super) async fn open<C>(shared: &Shared<C>) -> Result<Conn, StoreError> {
        shared.ensure_table().await?;
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
            let slots = [
                client.prepare_typed(&sql.slots.load, &SLOTS_LOAD_TYPES).await?,
                client.prepare_typed(&sql.slots.insert, &SLOTS_INSERT_TYPES).await?,
                client.prepare_typed(&sql.slots.remove, &SLOTS_REMOVE_TYPES).await?,
                client.prepare_typed(&sql.slots.expiry, &SLOTS_EXPIRY_TYPES).await?,
                client.prepare_typed(&sql.slots.clear, &SLOTS_CLEAR_TYPES).await?,
            ];
            Ok::<_, tokio_postgres::Error>(Conn { client, takes, lease, prepared, slots })
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

    pub(super) fn stmts(&self) -> Stmts<'_> {
        let [take, lock, load, upsert, upsert_leases, delete, delete_all] = &self.prepared;
        let [slots_load, insert, remove, expiry, clear] = &self.slots;
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
            slots: SlotStmts {
                load: p(slots_load),
                insert: p(insert),
                remove: p(remove),
                expiry: p(expiry),
                clear: p(clear),
            },
        }
    }
}

pub(super) fn pg_error(what: &str, e: tokio_postgres::Error) -> StoreError {
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

/// `request` within `timeout`, and whether the connection is still good afterwards (not
/// after a timeout or a lost connection; an error answered by the database leaves it good).
/// A request that `writes` and may have reached the database before its connection failed
/// or it timed out may have run: its error says so.
pub(super) async fn bounded<T>(
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

pub(super) fn timed_out(timeout: Duration, writes: bool) -> StoreError {
    let error = StoreError::new(format!("postgres: no answer within {timeout:?}")).unavailable();
    if writes { error.sent() } else { error }
}

/// The error of a statement that failed: one that may have run (a lost connection) says so,
/// and one of the database being unavailable (a lost connection, a statement or lock that
/// timed out, a server shutting down) is marked so.
pub(super) fn request_error(e: tokio_postgres::Error, writes: bool) -> StoreError {
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
