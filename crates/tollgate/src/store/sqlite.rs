//! States in a SQLite database: the server's embedded default, and apps that run on SQLite.

use std::path::Path;
use std::sync::{Arc, OnceLock, mpsc};
use std::time::Duration;

use parking_lot::Mutex;
use rusqlite::{Connection, OptionalExtension, params};
use tollgate_algebra::slots::{Concurrency, SlotAnswer, SlotOp, Write};
use tollgate_algebra::{
    Clock, Config, Kind, OneTake, Outcome, Plan, Slot, State, SystemClock, Taken, full_at,
};

use super::seam::{AsyncStore, BoxFuture, Store, slots_with_answer};
use super::sql::{
    SQLITE_ADD_FULL_AT, SQLITE_DELETE, SQLITE_DELETE_ALL, SQLITE_HAS_FULL_AT, SQLITE_SCHEMA,
    SQLITE_SELECT, SQLITE_SWEEP, SQLITE_UPSERT, SlotSql, decide_slots, holders_of, key_columns,
    next_ticket, saves,
};
use super::ticket::{OwnedOne, OwnedPlan, OwnedSlotOp, OwnedSlots, Ticket, ticket};
use crate::error::StoreError;

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
        let file = OpenedFile::of(path)?;
        let store = self.prepare(conn, clock, file)?;
        // A file that cannot be written (read-only, or locked by another process for longer
        // than the busy timeout) is an error now, rather than a failure of every request.
        store.check()?;
        Ok(store)
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
        self.prepare(conn, clock, None)
    }

    fn prepare<C: Clock>(
        self,
        conn: Connection,
        clock: C,
        file: Option<OpenedFile>,
    ) -> Result<SqliteStore<C>, StoreError> {
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
        // SQLite opens a file it may not write read-only, without a word.
        if conn.is_readonly(rusqlite::MAIN_DB).unwrap_or(false) {
            return Err(StoreError::new(format!(
                "sqlite: {} can only be read (check the permissions of the file and of its \
                 directory)",
                file.as_ref()
                    .map_or_else(|| "the database".into(), |f| f.path.display().to_string())
            )));
        }
        Ok(SqliteStore {
            shared: Arc::new(Shared { conn: Mutex::new(conn), clock, file }),
            writer: OnceLock::new(),
        })
    }
}

/// The file a store opened: its path, and what identifies the file itself (device and
/// inode), to notice when the path comes to name another file, or none.
struct OpenedFile {
    path: std::path::PathBuf,
    #[cfg(unix)]
    identity: (u64, u64),
}

impl OpenedFile {
    /// The file now at `path` (just opened).
    #[cfg_attr(not(unix), allow(clippy::unnecessary_wraps))]
    fn of(path: &Path) -> Result<Option<Self>, StoreError> {
        #[cfg(unix)]
        {
            use std::os::unix::fs::MetadataExt as _;
            let meta = std::fs::metadata(path).map_err(|e| {
                StoreError::new(format!("sqlite: cannot read {}: {e}", path.display()))
            })?;
            Ok(Some(OpenedFile { path: path.to_owned(), identity: (meta.dev(), meta.ino()) }))
        }
        #[cfg(not(unix))]
        Ok(Some(OpenedFile { path: path.to_owned() }))
    }

    /// An error if the path no longer names this file.
    fn still_there(&self) -> Result<(), StoreError> {
        let path = self.path.display();
        let meta = std::fs::metadata(&self.path);
        let gone = |how: &str| {
            StoreError::new(format!(
                "sqlite: {path} was {how} while this process had it open: its states now go \
                 to a file that no other process can open, and a process that opens {path} \
                 starts another; restart to use the file at {path}"
            ))
        };
        match meta {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(gone("deleted")),
            Err(e) => Err(StoreError::new(format!("sqlite: cannot read {path}: {e}"))),
            #[cfg(unix)]
            Ok(meta) => {
                use std::os::unix::fs::MetadataExt as _;
                if (meta.dev(), meta.ino()) == self.identity {
                    Ok(())
                } else {
                    Err(gone("replaced by another file"))
                }
            }
            #[cfg(not(unix))]
            Ok(_) => Ok(()),
        }
    }
}

/// Creates tollgate's tables in `conn` if they are missing (the states', and the holders of
/// concurrency limits with their tickets' counter), and brings a table of an earlier
/// version up to date (it adds the `full_at` column that sweeps use); for apps that join the
/// limiter to their own transactions ([`SqliteTransaction`]): run it once at start.
/// [`SqliteStore`] does it by itself.
///
/// # Errors
///
/// The statement fails.
pub fn create_schema(conn: &Connection) -> Result<(), StoreError> {
    conn.execute_batch(SQLITE_SCHEMA).map_err(|e| sql_error("cannot create the table", e))?;
    conn.execute_batch(&SlotSql::sqlite().create)
        .map_err(|e| sql_error("cannot create the table of holders", e))?;
    let has_full_at = conn
        .query_row(SQLITE_HAS_FULL_AT, [], |_| Ok(()))
        .optional()
        .map_err(|e| sql_error("cannot read the table's columns", e))?
        .is_some();
    if !has_full_at {
        conn.execute_batch(SQLITE_ADD_FULL_AT)
            .map_err(|e| sql_error("cannot add full_at to the table", e))?;
    }
    Ok(())
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
/// Two ways in, one database connection:
///
/// - the sync API (`limit`, ...) runs each request on the calling thread, which waits for
///   the disk: for programs without an async runtime;
/// - the async API (`limit_async`, ...) hands each request to the store's writer thread
///   (started on first use) and awaits the answer, so no runtime thread ever waits on the
///   disk. The writer runs the requests that wait for it together in one transaction (group
///   commit: one commit for all of them, each still decided on its own, in arrival order),
///   and answers each only once that transaction has committed, so an acknowledged request
///   is as durable as with the sync API.
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
/// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
/// assert!(limiter.limit_async(send, "alice").await.unwrap().ok); // in an async program
/// # });
/// ```
pub struct SqliteStore<C: Clock = SystemClock> {
    shared: Arc<Shared<C>>,
    /// The writer thread of the async API, once started.
    writer: OnceLock<mpsc::Sender<Job>>,
}

/// What the store and its writer thread share.
struct Shared<C> {
    conn: Mutex<Connection>,
    clock: C,
    /// The file (none in memory).
    file: Option<OpenedFile>,
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
    /// Checks that the store can go on writing where it should: its path still names the
    /// file it opened (not deleted, nor replaced by another), and a write transaction can
    /// begin within the busy timeout (`BEGIN IMMEDIATE`, rolled back at once). For a health
    /// check; [`SqliteStoreBuilder::open`] runs it once too.
    ///
    /// Runs on the calling thread, and may wait for the write lock up to the busy timeout.
    ///
    /// # Errors
    ///
    /// What is wrong: the file was deleted or replaced, or cannot be written (read-only,
    /// locked by another process, out of disk space).
    pub fn check(&self) -> Result<(), StoreError> {
        if let Some(file) = &self.shared.file {
            file.still_there()?;
        }
        // Under the lock no transaction of this store is open.
        let conn = self.shared.conn.lock();
        let begun = conn.execute_batch("BEGIN IMMEDIATE");
        if begun.is_ok() {
            let _ = conn.execute_batch("ROLLBACK");
        }
        begun.map_err(|e| sql_error("cannot begin a write", e))
    }

    /// Deletes every state that is full again at the store's time, whatever its name and
    /// config: it carries no information; and every holder of a concurrency limit expired
    /// by then (a (name, key) drops its own when it is next used; these are the ones of
    /// (name, key)s nobody used since). Returns how many rows, of both. The file does not
    /// shrink, but the pages are reused, so under a flood of new keys it stops growing once
    /// states are swept as fast as they come. A server runs this now and then (the
    /// `tollgate` server every minute). It reads the whole tables (no index on `full_at` or
    /// `expiry`, which would cost every write) and holds the write lock meanwhile: about
    /// 0.1 s a million states.
    ///
    /// Runs on the calling thread and waits for the disk.
    ///
    /// # Errors
    ///
    /// The statement fails.
    pub fn sweep_full(&self) -> Result<usize, StoreError> {
        let now = self.shared.clock.now();
        let conn = self.shared.conn.lock();
        let sweep = |sql: &str| conn.execute(sql, params![now]);
        let states = sweep(SQLITE_SWEEP).map_err(|e| sql_error("sweep failed", e))?;
        let holders = sweep(&SlotSql::sqlite().sweep).map_err(|e| sql_error("sweep failed", e))?;
        Ok(states + holders)
    }

    /// The key and shard of every state stored for `name` (for
    /// [`RateLimiter::carry`](crate::RateLimiter::carry) after its config changed).
    ///
    /// Runs on the calling thread and waits for the disk.
    ///
    /// # Errors
    ///
    /// The statement fails.
    pub fn keys_of(&self, name: &str) -> Result<Vec<(Option<String>, u16)>, StoreError> {
        let conn = self.shared.conn.lock();
        let mut select = conn
            .prepare("SELECT has_key, key, shard FROM tollgate_state WHERE name = ?1")
            .map_err(|e| sql_error("cannot list states", e))?;
        let rows = select
            .query_map(params![name], |row| {
                let (has_key, key, shard): (bool, String, u16) =
                    (row.get(0)?, row.get(1)?, row.get(2)?);
                Ok((has_key.then_some(key), shard))
            })
            .map_err(|e| sql_error("cannot list states", e))?;
        rows.collect::<Result<_, _>>().map_err(|e| sql_error("cannot list states", e))
    }

    /// How many states the file holds (a count of the table: reads all of it).
    ///
    /// # Errors
    ///
    /// The statement fails.
    pub fn count(&self) -> Result<usize, StoreError> {
        let conn = self.shared.conn.lock();
        let n: i64 = conn
            .query_row("SELECT count(*) FROM tollgate_state", [], |row| row.get(0))
            .map_err(|e| sql_error("count failed", e))?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// Deletes the states of `name` that are full at the store's time: they carry no
    /// information. Returns how many. For states written by an earlier version, which have
    /// no `full_at` ([`SqliteStore::sweep_full`] does the rest).
    ///
    /// Runs on the calling thread and waits for the disk (a background job of the server
    /// runs it off the async threads).
    ///
    /// # Errors
    ///
    /// The statement fails.
    pub fn sweep(&self, name: &str, config: &Config) -> Result<usize, StoreError> {
        let shard = config.per_shard();
        let now = self.shared.clock.now();
        if shard.calendar().is_some() {
            // SQL knows no time zones: a calendar window's states go when their `full_at`
            // (written by the algebra) has passed.
            let conn = self.shared.conn.lock();
            let sql = "DELETE FROM tollgate_state WHERE name = ?1 AND full_at <= ?2";
            return conn.execute(sql, params![name, now]).map_err(|e| sql_error("sweep failed", e));
        }
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
        let conn = self.shared.conn.lock();
        conn.execute(sql, params![name, now, shard.rate(), shard.period(), shard.capacity()])
            .map_err(|e| sql_error("sweep failed", e))
    }

    /// Runs `run` in a `BEGIN IMMEDIATE` transaction, committed if it succeeds and rolled
    /// back if not.
    fn immediate<T>(
        &self,
        run: impl FnOnce(&Connection, f64) -> rusqlite::Result<T>,
    ) -> Result<T, StoreError> {
        let conn = self.shared.conn.lock();
        in_transaction(&conn, &self.shared.clock, run)
    }

    /// Hands `job` to the writer thread (started on first use) and awaits its answer.
    async fn submit<T>(&self, job: impl FnOnce(Ticket<T>) -> Job) -> Result<T, StoreError> {
        let (ticket, claim) = ticket();
        let jobs = self.writer.get_or_init(|| {
            let (tx, rx) = mpsc::channel();
            let shared = Arc::clone(&self.shared);
            std::thread::Builder::new()
                .name("tollgate-sqlite".into())
                .spawn(move || write(&shared, &rx))
                .expect("cannot start the SQLite store's writer thread");
            tx
        });
        if jobs.send(job(ticket)).is_err() {
            return Err(StoreError::new("sqlite: the writer thread has stopped"));
        }
        // The writer never drops a request it has not run; a long wait is a long queue.
        claim.answer(None, "sqlite").await
    }
}

/// Runs `run` in a `BEGIN IMMEDIATE` transaction of `conn`, on the clock read once the write
/// lock is held (so times go in commit order); committed if it succeeds, rolled back if
/// not. `BEGIN` and `COMMIT` are cached statements, not parsed again per request.
fn in_transaction<T, C: Clock>(
    conn: &Connection,
    clock: &C,
    run: impl FnOnce(&Connection, f64) -> rusqlite::Result<T>,
) -> Result<T, StoreError> {
    let cached = |sql: &str| conn.prepare_cached(sql).and_then(|mut s| s.execute([]));
    cached("BEGIN IMMEDIATE").map_err(|e| sql_error("cannot begin", e))?;
    let now = clock.now();
    let result = run(conn, now).and_then(|result| cached("COMMIT").map(|_| result));
    result.map_err(|e| {
        // Whatever failed, nothing of this request stays; without a transaction still
        // open (COMMIT failed after ending it) there is nothing to roll back.
        if !conn.is_autocommit() {
            let _ = conn.execute_batch("ROLLBACK");
        }
        sql_error("request failed", e)
    })
}

/// A request for the writer thread, with copies of what it names.
enum Job {
    One(OwnedOne, Ticket<Taken>),
    Plan(Box<OwnedPlan>, Ticket<Outcome>),
    Read(OwnedSlots, Ticket<(f64, Vec<Option<State>>)>),
    Delete(Box<str>, Option<Box<str>>, u16, Ticket<()>),
    Slots(Box<OwnedSlotOp>, Ticket<SlotAnswer>),
    SlotsWith(Box<OwnedSlotOp>, Box<OwnedPlan>, Ticket<(SlotAnswer, Outcome)>),
}

/// The most requests the writer runs in one transaction.
const MOST_PER_COMMIT: usize = 256;

impl Job {
    fn take(&self) -> bool {
        match self {
            Job::One(_, t) => t.take(),
            Job::Plan(_, t) => t.take(),
            Job::Read(_, t) => t.take(),
            Job::Delete(_, _, _, t) => t.take(),
            Job::Slots(_, t) => t.take(),
            Job::SlotsWith(_, _, t) => t.take(),
        }
    }

    /// Runs the request within the transaction already begun; what it answers.
    fn run(&self, conn: &Connection, now: f64) -> rusqlite::Result<Answer> {
        Ok(match self {
            Job::One(one, _) => {
                let outcome = execute_on(conn, &one.take().to_plan(), now)?;
                Answer::One(Taken { decision: outcome.decision(), status: outcome.statuses[0] })
            }
            Job::Plan(plan, _) => Answer::Plan(execute_on(conn, &plan.plan(), now)?),
            Job::Read(slots, _) => Answer::Read(now, load(conn, &slots.slots())?),
            Job::Delete(name, key, shards, _) => {
                delete_all(conn, name, key.as_deref(), *shards)?;
                Answer::Delete
            }
            Job::Slots(call, _) => Answer::Slots(slots_on(
                conn,
                &call.name,
                call.key.as_deref(),
                &call.limit,
                &call.op,
                now,
            )?),
            Job::SlotsWith(call, plan, _) => {
                let call_parts = (&*call.name, call.key.as_deref(), &call.limit, &call.op);
                Answer::SlotsWith(slots_with_on(conn, call_parts, &plan.plan(), now)?)
            }
        })
    }

    /// Sends the caller its answer (a mismatch cannot happen: each job answers its kind).
    fn answer(self, answer: Result<Answer, StoreError>) {
        match (self, answer) {
            (Job::One(_, t), Ok(Answer::One(a))) => t.answer(Ok(a)),
            (Job::Plan(_, t), Ok(Answer::Plan(a))) => t.answer(Ok(a)),
            (Job::Read(_, t), Ok(Answer::Read(now, states))) => t.answer(Ok((now, states))),
            (Job::Delete(_, _, _, t), Ok(Answer::Delete)) => t.answer(Ok(())),
            (Job::Slots(_, t), Ok(Answer::Slots(a))) => t.answer(a),
            (Job::SlotsWith(_, _, t), Ok(Answer::SlotsWith(a))) => t.answer(a),
            (job, answer) => {
                let e = match answer {
                    Err(e) => e,
                    Ok(_) => {
                        StoreError::new("sqlite: a request got another's answer; this is a bug")
                    }
                };
                match job {
                    Job::One(_, t) => t.answer(Err(e)),
                    Job::Plan(_, t) => t.answer(Err(e)),
                    Job::Read(_, t) => t.answer(Err(e)),
                    Job::Delete(_, _, _, t) => t.answer(Err(e)),
                    Job::Slots(_, t) => t.answer(Err(e)),
                    Job::SlotsWith(_, _, t) => t.answer(Err(e)),
                }
            }
        }
    }
}

/// What a [`Job`] answers.
enum Answer {
    One(Taken),
    Plan(Outcome),
    Read(f64, Vec<Option<State>>),
    Delete,
    /// What a concurrency limit's operation answered, or its own error (an invalid
    /// operation, which wrote nothing: the others in its transaction stand).
    Slots(Result<SlotAnswer, StoreError>),
    /// What an acquire with rate limits answered, or its own error (as `Slots`).
    SlotsWith(Result<(SlotAnswer, Outcome), StoreError>),
}

/// The writer thread: takes the requests that wait (up to [`MOST_PER_COMMIT`]), runs them
/// in one transaction, commits, answers each; until the store is dropped. If the
/// transaction fails as a whole (a request failed, or the commit), nothing of it stays, and
/// each of its requests runs again in a transaction of its own, so that one request's
/// failure is its own.
fn write<C: Clock>(shared: &Shared<C>, jobs: &mpsc::Receiver<Job>) {
    while let Ok(first) = jobs.recv() {
        let mut batch: Vec<Job> = std::iter::once(first)
            .chain(std::iter::from_fn(|| jobs.try_recv().ok()).take(MOST_PER_COMMIT - 1))
            .filter(Job::take)
            .collect();
        if batch.is_empty() {
            continue;
        }
        let conn = shared.conn.lock();
        let together = in_transaction(&conn, &shared.clock, |conn, now| {
            batch.iter().map(|job| job.run(conn, now)).collect::<rusqlite::Result<Vec<_>>>()
        });
        match together {
            Ok(answers) => {
                for (job, answer) in batch.drain(..).zip(answers) {
                    job.answer(Ok(answer));
                }
            }
            Err(e) if e.is_unavailable() => {
                // The file was locked past the busy timeout: each request alone would wait as
                // long again. Every one fails, as the store did not answer in time.
                for job in batch.drain(..) {
                    job.answer(Err(e.copy()));
                }
            }
            Err(_) => {
                for job in batch.drain(..) {
                    let answer =
                        in_transaction(&conn, &shared.clock, |conn, now| job.run(conn, now));
                    job.answer(answer);
                }
            }
        }
    }
}

impl<C: Clock> Store for SqliteStore<C> {
    fn execute(&self, plan: &Plan<'_>) -> Result<Outcome, StoreError> {
        self.immediate(|conn, now| execute_on(conn, plan, now))
    }

    fn read(&self, slots: &[Slot<'_>]) -> Result<(f64, Vec<Option<State>>), StoreError> {
        let conn = self.shared.conn.lock();
        let now = self.shared.clock.now();
        let states = load(&conn, slots).map_err(|e| sql_error("read failed", e))?;
        Ok((now, states))
    }

    fn delete(&self, name: &str, key: Option<&str>, shards: u16) -> Result<(), StoreError> {
        self.immediate(|conn, _| delete_all(conn, name, key, shards))
    }

    /// In a `BEGIN IMMEDIATE` transaction of its own: SQLite's write lock serializes it with
    /// every other writer of the file (threads and processes), so no two acquires read the
    /// same free slots.
    fn slots(
        &self,
        name: &str,
        key: Option<&str>,
        limit: &Concurrency,
        op: &SlotOp,
    ) -> Result<SlotAnswer, StoreError> {
        self.immediate(|conn, now| slots_on(conn, name, key, limit, op, now))?
    }

    /// In one `BEGIN IMMEDIATE` transaction of its own, as [`Store::slots`].
    fn slots_with(
        &self,
        name: &str,
        key: Option<&str>,
        limit: &Concurrency,
        op: &SlotOp,
        plan: &Plan<'_>,
    ) -> Result<(SlotAnswer, Outcome), StoreError> {
        self.immediate(|conn, now| slots_with_on(conn, (name, key, limit, op), plan, now))?
    }
}

impl<C: Clock> AsyncStore for SqliteStore<C> {
    fn execute_async<'a>(&'a self, plan: &'a Plan<'_>) -> BoxFuture<'a, Outcome> {
        Box::pin(async move {
            let plan = Box::new(OwnedPlan::new(plan));
            self.submit(|ticket| Job::Plan(plan, ticket)).await
        })
    }

    fn execute_one_async<'a>(&'a self, take: &'a OneTake<'_>) -> BoxFuture<'a, Taken> {
        Box::pin(async move {
            let one = OwnedOne::new(take);
            self.submit(|ticket| Job::One(one, ticket)).await
        })
    }

    fn read_async<'a>(&'a self, slots: &'a [Slot<'_>]) -> BoxFuture<'a, (f64, Vec<Option<State>>)> {
        Box::pin(async move {
            let slots = OwnedSlots::new(slots);
            self.submit(|ticket| Job::Read(slots, ticket)).await
        })
    }

    fn delete_async<'a>(
        &'a self,
        name: &'a str,
        key: Option<&'a str>,
        shards: u16,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let (name, key) = (name.into(), key.map(Into::into));
            self.submit(|ticket| Job::Delete(name, key, shards, ticket)).await
        })
    }

    /// On the writer thread, as [`Store::slots`] (within the transaction of the requests
    /// that wait with it).
    fn slots_async<'a>(
        &'a self,
        name: &'a str,
        key: Option<&'a str>,
        limit: &'a Concurrency,
        op: &'a SlotOp,
    ) -> BoxFuture<'a, SlotAnswer> {
        Box::pin(async move {
            let call = Box::new(OwnedSlotOp::new(name, key, limit, op));
            self.submit(|ticket| Job::Slots(call, ticket)).await
        })
    }

    /// On the writer thread, as [`Store::slots_with`].
    fn slots_with_async<'a>(
        &'a self,
        name: &'a str,
        key: Option<&'a str>,
        limit: &'a Concurrency,
        op: &'a SlotOp,
        plan: &'a Plan<'_>,
    ) -> BoxFuture<'a, (SlotAnswer, Outcome)> {
        Box::pin(async move {
            let call = Box::new(OwnedSlotOp::new(name, key, limit, op));
            let plan = Box::new(OwnedPlan::new(plan));
            self.submit(|ticket| Job::SlotsWith(call, plan, ticket)).await
        })
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

    /// Within your transaction: the holder is there if you commit, and gone (never held) if
    /// you roll back; a release or renewal likewise. The ticket of an acquire rolled back is
    /// made again by a later one: do not release it.
    fn slots(
        &self,
        name: &str,
        key: Option<&str>,
        limit: &Concurrency,
        op: &SlotOp,
    ) -> Result<SlotAnswer, StoreError> {
        slots_on(self.conn, name, key, limit, op, self.clock.now())
            .map_err(|e| sql_error("request failed", e))?
    }

    /// Within your transaction, as [`SqliteTransaction::slots`]: the holder and the tokens
    /// are there if you commit, both gone if you roll back.
    fn slots_with(
        &self,
        name: &str,
        key: Option<&str>,
        limit: &Concurrency,
        op: &SlotOp,
        plan: &Plan<'_>,
    ) -> Result<(SlotAnswer, Outcome), StoreError> {
        slots_with_on(self.conn, (name, key, limit, op), plan, self.clock.now())
            .map_err(|e| sql_error("request failed", e))?
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
                    let full = full_at(&slot.config, s);
                    upsert.execute(params![
                        slot.name, has_key, key, slot.shard, s.value, s.ts, full
                    ])?
                }
                None => delete.execute(params![slot.name, has_key, key, slot.shard])?,
            };
        }
    }
    Ok(outcome)
}

/// An operation on the holders of a concurrency limit's (name, key) (SPEC §6f), within a
/// transaction already begun, at `now`: deletes the holders expired by then, loads the
/// others, decides, and writes what the decision says. The outer error is the database's;
/// the inner one says the operation was invalid or a row garbled, and nothing but the
/// expired holders was deleted.
fn slots_on(
    conn: &Connection,
    name: &str,
    key: Option<&str>,
    limit: &Concurrency,
    op: &SlotOp,
    now: f64,
) -> rusqlite::Result<Result<SlotAnswer, StoreError>> {
    Ok(match decide_slots_on(conn, name, key, limit, op, now)? {
        Ok((answer, write)) => {
            save_slots(conn, name, key, write)?;
            Ok(answer)
        }
        Err(e) => Err(e),
    })
}

/// What an operation on the holders of (name, key) answers at `now`, and what it would
/// write: deletes the holders expired by then, loads the others (and, for an acquire, the
/// last ticket made), decides. Errors as [`slots_on`]'s.
fn decide_slots_on(
    conn: &Connection,
    name: &str,
    key: Option<&str>,
    limit: &Concurrency,
    op: &SlotOp,
    now: f64,
) -> rusqlite::Result<Result<(SlotAnswer, Write), StoreError>> {
    let sql = SlotSql::sqlite();
    let (has_key, key) = key_columns(key);
    conn.prepare_cached(&sql.expire)?.execute(params![name, has_key, key, now])?;
    let rows: Vec<(i64, i64, f64)> = conn
        .prepare_cached(&sql.load)?
        .query_map(params![name, has_key, key], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)))?
        .collect::<rusqlite::Result<_>>()?;
    // Only an acquire makes a ticket (the others pass decide one it does not use).
    let last: Option<Option<i64>> = match op {
        SlotOp::Acquire { .. } => Some(
            conn.prepare_cached(&sql.last_ticket)?.query_row([], |row| row.get(0)).optional()?,
        ),
        _ => None,
    };
    Ok(holders_of(rows).and_then(|holders| {
        let ticket = last.map_or(Ok(0), next_ticket)?;
        decide_slots(limit, &holders, now, op, ticket)
    }))
}

/// Writes what a decision on the holders of (name, key) said (a new holder and the last
/// ticket made, a holder gone, a new expiry, or every holder gone).
fn save_slots(
    conn: &Connection,
    name: &str,
    key: Option<&str>,
    write: Write,
) -> rusqlite::Result<()> {
    let sql = SlotSql::sqlite();
    let (has_key, key) = key_columns(key);
    // Tickets are at most 2^53 - 1 (made here, checked when read back): exact as i64.
    let column = |ticket: u64| ticket as i64;
    match write {
        Write::Nothing => {}
        Write::Add(h) => {
            let t = column(h.ticket);
            conn.prepare_cached(&sql.insert)?
                .execute(params![name, has_key, key, t, h.count, h.expiry])?;
            conn.prepare_cached(&sql.save_ticket)?.execute(params![t])?;
        }
        Write::Remove(t) => {
            conn.prepare_cached(&sql.remove)?.execute(params![name, has_key, key, column(t)])?;
        }
        Write::Expiry(t, expiry) => {
            conn.prepare_cached(&sql.expiry)?.execute(params![
                name,
                has_key,
                key,
                column(t),
                expiry
            ])?;
        }
        Write::Clear => {
            conn.prepare_cached(&sql.clear)?.execute(params![name, has_key, key])?;
        }
    }
    Ok(())
}

/// An acquire with the takes of `plan`, all or nothing, within a transaction already
/// begun, at `now` (see [`Store::slots_with`]): the plan is run as any plan is (as a check
/// if the slots are full), and the holder written only if both are granted.
fn slots_with_on(
    conn: &Connection,
    (name, key, limit, op): (&str, Option<&str>, &Concurrency, &SlotOp),
    plan: &Plan<'_>,
    now: f64,
) -> rusqlite::Result<Result<(SlotAnswer, Outcome), StoreError>> {
    let (answer, write) = match decide_slots_on(conn, name, key, limit, op, now)? {
        Ok(decided) => decided,
        Err(e) => return Ok(Err(e)),
    };
    let granted = matches!(answer, SlotAnswer::Acquired { .. });
    let outcome = if granted {
        execute_on(conn, plan, now)?
    } else {
        execute_on(conn, &plan.checking(), now)?
    };
    if granted && outcome.ok {
        save_slots(conn, name, key, write)?;
    }
    Ok(Ok((slots_with_answer(answer, &outcome), outcome)))
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
    // Another writer held the file past the busy timeout: the store did not answer in time.
    let busy = matches!(
        e.sqlite_error_code(),
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
    );
    let error = StoreError::with_source(format!("sqlite: {what}: {e}"), e);
    if busy { error.unavailable() } else { error }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_algebra::{MINUTE, ManualClock, Take};

    /// A file that can only be read is an error when the store opens it, not a failure of
    /// every request after.
    #[test]
    fn a_file_that_can_only_be_read_is_an_error_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        drop(SqliteStore::open(&path).unwrap());
        // As SQLite opens a file its process may not write (a test run as root may write
        // any file, so the flag stands for the permissions).
        let conn =
            Connection::open_with_flags(&path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
        let file = OpenedFile::of(&path).unwrap();
        let Err(err) = SqliteStoreBuilder::default().prepare(conn, SystemClock, file) else {
            panic!("a read-only file was opened");
        };
        assert!(err.to_string().contains("t.db can only be read"), "{err}");
    }

    /// `check` tells when the file cannot be written (locked by another process past the
    /// busy timeout, after no longer than it) and when its path no longer names it.
    #[test]
    fn check_tells_a_locked_deleted_or_replaced_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let store =
            SqliteStore::builder().busy_timeout(Duration::from_millis(100)).open(&path).unwrap();
        store.check().unwrap();
        let other = Connection::open(&path).unwrap();
        other.execute_batch("BEGIN IMMEDIATE").unwrap();
        let start = std::time::Instant::now();
        let err = store.check().unwrap_err();
        assert!(err.is_unavailable() && err.to_string().contains("locked"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(1), "{:?}", start.elapsed());
        // And opening a store on it now is an error that says so.
        let opened = SqliteStore::builder().busy_timeout(Duration::from_millis(100)).open(&path);
        assert!(opened.is_err());
        other.execute_batch("ROLLBACK").unwrap();
        store.check().unwrap();
        drop(other);
        // Deleted (with its WAL), then another file where it was.
        for end in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{end}", path.display()));
        }
        let err = store.check().unwrap_err().to_string();
        assert!(err.contains("t.db was deleted while this process had it open"), "{err}");
        drop(SqliteStore::open(&path).unwrap());
        let err = store.check().unwrap_err().to_string();
        assert!(err.contains("t.db was replaced by another file"), "{err}");
    }

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
