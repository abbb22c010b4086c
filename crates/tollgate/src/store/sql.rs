//! What the SQL stores share, whichever client runs them: the statements, and the advisory
//! lock ids of the PostgreSQL stores.
#![cfg_attr(
    not(all(
        feature = "sqlite",
        feature = "postgres",
        feature = "sqlx-sqlite",
        feature = "sqlx-postgres"
    )),
    allow(dead_code)
)]

use tollgate_algebra::slots::{Concurrency, Holder, SlotAnswer, SlotOp, Write, decide};
use tollgate_algebra::{Outcome, Plan, Slot, State, full_at};

use crate::error::StoreError;

/// SQLite's table, created if missing. Two numbers per (name, key, shard), and when the state
/// is full again (`full_at`, ms), so that a sweep can drop the states that carry no
/// information whatever config made them; `has_key` tells no key from the empty key without
/// relying on NULL in a primary key. (A table of an earlier version gets `full_at` from
/// [`SQLITE_ADD_FULL_AT`]; its rows keep NULL there until they are written again.)
pub(crate) const SQLITE_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS tollgate_state (
    name    TEXT    NOT NULL,
    has_key INTEGER NOT NULL,
    key     TEXT    NOT NULL,
    shard   INTEGER NOT NULL,
    value   REAL    NOT NULL,
    ts      REAL    NOT NULL,
    full_at REAL,
    PRIMARY KEY (name, has_key, key, shard)
) WITHOUT ROWID;
";

/// Adds `full_at` to a table made by an earlier version (run when it is missing).
pub(crate) const SQLITE_ADD_FULL_AT: &str = "ALTER TABLE tollgate_state ADD COLUMN full_at REAL";

/// Whether `tollgate_state` has the `full_at` column: one row (of `pragma_table_info`) if so.
pub(crate) const SQLITE_HAS_FULL_AT: &str =
    "SELECT 1 FROM pragma_table_info('tollgate_state') WHERE name = 'full_at'";

/// SQLite: drops every state that is full again by ?1 (ms): whatever its config, it carries
/// no information.
pub(crate) const SQLITE_SWEEP: &str = "DELETE FROM tollgate_state WHERE full_at <= ?1";

/// SQLite: one slot's state.
pub(crate) const SQLITE_SELECT: &str = "SELECT value, ts FROM tollgate_state \
    WHERE name = ?1 AND has_key = ?2 AND key = ?3 AND shard = ?4";
/// SQLite: saves one slot's state, and when it is full again (?7).
pub(crate) const SQLITE_UPSERT: &str = "INSERT INTO tollgate_state (name, has_key, key, shard, value, ts, full_at) \
    VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) \
    ON CONFLICT (name, has_key, key, shard) DO UPDATE SET value = excluded.value, ts = excluded.ts, \
    full_at = excluded.full_at";
/// SQLite: deletes one slot's state (it is full again).
pub(crate) const SQLITE_DELETE: &str =
    "DELETE FROM tollgate_state WHERE name = ?1 AND has_key = ?2 AND key = ?3 AND shard = ?4";
/// SQLite: deletes the first ?4 shards of (name, key).
pub(crate) const SQLITE_DELETE_ALL: &str =
    "DELETE FROM tollgate_state WHERE name = ?1 AND has_key = ?2 AND key = ?3 AND shard < ?4";

/// The key columns of a state: `has_key`, and the key (`""` when there is none).
pub(crate) fn key_columns(key: Option<&str>) -> (bool, &str) {
    (key.is_some(), key.unwrap_or(""))
}

/// What saving a decided plan writes: per slot that [`Outcome::changed`] marks, its new
/// state, or `None` when that state is full again by `now` (the row is deleted: it carries
/// no information).
pub(crate) fn saves<'s, 'p>(
    plan: &'s Plan<'p>,
    states: &'s [Option<State>],
    outcome: &'s Outcome,
    now: f64,
) -> impl Iterator<Item = (&'s Slot<'p>, Option<State>)> + 's {
    plan.slots().iter().zip(states).zip(&outcome.changed).filter_map(
        move |((slot, state), &changed)| {
            let state = state.filter(|_| changed)?;
            Some((slot, (full_at(&slot.config, state) > now).then_some(state)))
        },
    )
}

/// The largest ticket of a concurrency limit's holder: tickets travel as JSON numbers (the
/// server's answers, the packages' values), exact as doubles only up to 2^53.
pub(crate) const MAX_TICKET: u64 = (1 << 53) - 1;

/// The statements on the holders of concurrency limits (SPEC §6f), a row per holder in a
/// table beside the states': (name, key as the states' table keeps it, ticket), its slots
/// (`count`) and its `expiry` (ms on the store's clock). Every statement takes the (name,
/// key) as its first three parameters (name, has_key, key).
pub(crate) struct SlotSql {
    /// Creates the table of holders (and on SQLite the tickets' counter) if it is missing.
    pub(crate) create: String,
    /// SQLite: deletes the holders of (name, key) expired by ?4. (PostgreSQL's `load` does.)
    pub(crate) expire: String,
    /// Loads the holders of (name, key): ticket, count, expiry per row. PostgreSQL's first
    /// deletes those expired by the time it uses, and answers that time and (when $5) a new
    /// ticket in the first two columns of every row, with one row of NULL holder columns
    /// when there is none: see [`SlotSql::postgres`].
    pub(crate) load: String,
    /// Adds a holder: ticket, count, expiry as the fourth to sixth parameters.
    pub(crate) insert: String,
    /// Deletes the holder of the ticket (fourth parameter).
    pub(crate) remove: String,
    /// Sets the expiry (fifth parameter) of the holder of the ticket (fourth).
    pub(crate) expiry: String,
    /// Deletes every holder of (name, key).
    pub(crate) clear: String,
    /// SQLite: the last ticket made (no row: none yet).
    pub(crate) last_ticket: String,
    /// SQLite: saves the last ticket made (?1).
    pub(crate) save_ticket: String,
    /// Deletes every holder expired by the first parameter, whatever its (name, key).
    pub(crate) sweep: String,
}

impl SlotSql {
    /// The statements that are the same text on both databases but for the placeholders
    /// (`?1` on SQLite, `$1` on PostgreSQL) and the table.
    fn common(table: &str, p: &str) -> [String; 5] {
        let this = format!("name = {p}1 AND has_key = {p}2 AND key = {p}3");
        [
            format!(
                "INSERT INTO {table} (name, has_key, key, ticket, count, expiry) \
                 VALUES ({p}1, {p}2, {p}3, {p}4, {p}5, {p}6)"
            ),
            format!("DELETE FROM {table} WHERE {this} AND ticket = {p}4"),
            format!("UPDATE {table} SET expiry = {p}5 WHERE {this} AND ticket = {p}4"),
            format!("DELETE FROM {table} WHERE {this}"),
            format!("DELETE FROM {table} WHERE expiry <= {p}1"),
        ]
    }

    /// SQLite's, on `tollgate_slots` beside `tollgate_state`, made once.
    ///
    /// A ticket is the last one made plus one, kept in a one-row table (`tollgate_tickets`)
    /// and saved in the same transaction as the holder it names. SQLite runs one write
    /// transaction at a time, so no two transactions make the same ticket; and the counter
    /// never goes back (as a `max(ticket) + 1` over the holders would once the newest
    /// holder is gone), so a late release of a holder that expired never frees another's
    /// slots. (A ticket of a transaction that was rolled back may be made again: it was
    /// never held, and must not be released.)
    pub(crate) fn sqlite() -> &'static SlotSql {
        static SQL: std::sync::OnceLock<SlotSql> = std::sync::OnceLock::new();
        SQL.get_or_init(|| {
            let [insert, remove, expiry, clear, sweep] = SlotSql::common("tollgate_slots", "?");
            SlotSql {
                create: "CREATE TABLE IF NOT EXISTS tollgate_slots (
                    name    TEXT    NOT NULL,
                    has_key INTEGER NOT NULL,
                    key     TEXT    NOT NULL,
                    ticket  INTEGER NOT NULL,
                    count   INTEGER NOT NULL,
                    expiry  REAL    NOT NULL,
                    PRIMARY KEY (name, has_key, key, ticket)
                ) WITHOUT ROWID;
                CREATE TABLE IF NOT EXISTS tollgate_tickets (
                    id   INTEGER PRIMARY KEY CHECK (id = 0),
                    last INTEGER NOT NULL
                );"
                .into(),
                expire: "DELETE FROM tollgate_slots \
                    WHERE name = ?1 AND has_key = ?2 AND key = ?3 AND expiry <= ?4"
                    .into(),
                load: "SELECT ticket, count, expiry FROM tollgate_slots \
                    WHERE name = ?1 AND has_key = ?2 AND key = ?3"
                    .into(),
                insert,
                remove,
                expiry,
                clear,
                last_ticket: "SELECT last FROM tollgate_tickets WHERE id = 0".into(),
                save_ticket: "INSERT INTO tollgate_tickets (id, last) VALUES (0, ?1) \
                    ON CONFLICT (id) DO UPDATE SET last = excluded.last"
                    .into(),
                sweep,
            }
        })
    }

    /// PostgreSQL's, on `{table}_slots` beside the states' `table`.
    ///
    /// A ticket comes from the sequence of the table's identity column (`nextval`, taken
    /// only for an acquire): unique in the table whatever the (name, key), never made again
    /// (a sequence does not go back, not even when the transaction that took a number rolls
    /// back), and never waited for (a sequence is not locked by a transaction). It stops at
    /// 2^53 - 1 ([`MAX_TICKET`]; an error after that): 285 years of a million acquires a
    /// second.
    ///
    /// `load` ($1 name, $2 has_key, $3 key, $4 the store's time or NULL for the database's,
    /// $5 whether to make a ticket) is one statement: it reads the time once (after the
    /// caller took the (name, key)'s lock, in an earlier statement: this one's snapshot
    /// sees every commit before the lock was granted), deletes the holders expired by then,
    /// and answers the time and the ticket (NULL when $5 is false) with each holder left,
    /// or with NULLs in one row when none is.
    pub(crate) fn postgres(table: &str) -> SlotSql {
        let slots = format!("{table}_slots");
        let [insert, remove, expiry, clear, sweep] = SlotSql::common(&slots, "$");
        SlotSql {
            create: format!(
                "CREATE TABLE IF NOT EXISTS {slots} (
                    name text COLLATE \"C\" NOT NULL, has_key boolean NOT NULL,
                    key text COLLATE \"C\" NOT NULL,
                    ticket bigint GENERATED BY DEFAULT AS IDENTITY (MAXVALUE {MAX_TICKET}),
                    count integer NOT NULL, expiry double precision NOT NULL,
                    PRIMARY KEY (name, has_key, key, ticket))"
            ),
            expire: String::new(),
            load: format!(
                "WITH t AS (
                   SELECT coalesce($4::float8,
                            (extract(epoch FROM clock_timestamp()) * 1000)::float8) AS now,
                          CASE WHEN $5::bool
                            THEN nextval(pg_get_serial_sequence('{slots}', 'ticket')) END AS next),
                 gone AS (
                   DELETE FROM {slots} s USING t
                   WHERE s.name = $1 AND s.has_key = $2 AND s.key = $3 AND s.expiry <= t.now)
                 SELECT t.now, t.next, s.ticket, s.count, s.expiry
                 FROM t LEFT JOIN {slots} s
                   ON s.name = $1 AND s.has_key = $2 AND s.key = $3 AND s.expiry > t.now"
            ),
            insert,
            remove,
            expiry,
            clear,
            last_ticket: String::new(),
            save_ticket: String::new(),
            sweep,
        }
    }
}

/// [`decide`] on the holders a SQL store loaded, at `now`, `ticket` the one a granted acquire
/// gets. An invalid operation (which the limiter checks before it calls a store) is a
/// [`StoreError`]: nothing is written.
pub(crate) fn decide_slots(
    limit: &Concurrency,
    holders: &[Holder],
    now: f64,
    op: &SlotOp,
    ticket: u64,
) -> Result<(SlotAnswer, Write), StoreError> {
    decide(limit, holders, now, op, ticket).map_err(|e| StoreError::new(e.message()))
}

/// The holders of the rows a SQL store read (ticket, count, expiry each).
pub(crate) fn holders_of(
    rows: impl IntoIterator<Item = (i64, i64, f64)>,
) -> Result<Vec<Holder>, StoreError> {
    rows.into_iter()
        .map(|(ticket, count, expiry)| {
            Ok(Holder { ticket: ticket_of(ticket)?, count: count_of(count)?, expiry })
        })
        .collect()
}

/// PostgreSQL: a row the holders' `load` answered (see [`SlotSql::postgres`]): the time,
/// the new ticket, and a holder (ticket, count, expiry) or none.
pub(crate) type PgHolderRow = (f64, Option<i64>, Option<(i64, i64, f64)>);

/// PostgreSQL: what the holders' `load` answered, as the time, the holders and the ticket
/// to decide with (0 when the operation, not an acquire, made none).
pub(crate) fn pg_loaded(
    rows: Vec<PgHolderRow>,
    acquires: bool,
) -> Result<(f64, Vec<Holder>, u64), StoreError> {
    let &(now, next, _) = rows.first().ok_or_else(|| StoreError::new("postgres: no answer"))?;
    let ticket = match (acquires, next) {
        (true, Some(next)) => ticket_of(next)?,
        (true, None) => return Err(StoreError::new("postgres: no ticket was made")),
        (false, _) => 0,
    };
    Ok((now, holders_of(rows.into_iter().filter_map(|(_, _, holder)| holder))?, ticket))
}

/// SQLite: the ticket after the last one made (`None`: none yet).
pub(crate) fn next_ticket(last: Option<i64>) -> Result<u64, StoreError> {
    match last.map_or(Ok(0), ticket_of)? {
        last if last < MAX_TICKET => Ok(last + 1),
        _ => Err(StoreError::new("sqlite: every ticket up to 2^53 - 1 was made")),
    }
}

/// A ticket read back from a database: an error unless from 1 to [`MAX_TICKET`] (the
/// stores make no other).
pub(crate) fn ticket_of(stored: i64) -> Result<u64, StoreError> {
    u64::try_from(stored).ok().filter(|t| (1..=MAX_TICKET).contains(t)).ok_or_else(|| {
        StoreError::new(format!("a holder's ticket in the database is {stored}: garbage"))
    })
}

/// A holder's `count` read back from a database (its column is a signed integer).
fn count_of(stored: i64) -> Result<u32, StoreError> {
    u32::try_from(stored).ok().filter(|c| *c >= 1).ok_or_else(|| {
        StoreError::new(format!("a holder's count in the database is {stored}: garbage"))
    })
}

/// PostgreSQL: a transaction-scoped advisory lock on (class, id).
pub(crate) const PG_LOCK: &str = "SELECT pg_advisory_xact_lock($1, $2)";

/// The class of tollgate's advisory locks (`'toll'`), so they never meet an app's own.
pub(crate) const LOCK_CLASS: i32 = 0x746f_6c6c;

/// The class of the advisory locks of concurrency limits' (name, key)s (`'tols'`), so that
/// a concurrency limit never waits for a rate limit of the same name.
pub(crate) const SLOTS_LOCK_CLASS: i32 = 0x746f_6c73;

/// A stable 32-bit id of a slot for its advisory lock: FNV-1a, the same in every process and
/// build (std's hashers promise neither). A collision only makes two slots wait for each other.
pub(crate) fn lock_id(name: &str, key: Option<&str>, shard: u16) -> i32 {
    let mut h: u32 = 0x811c_9dc5;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
        }
    };
    eat(name.as_bytes());
    match key {
        Some(key) => {
            eat(&[0xff]);
            eat(key.as_bytes());
        }
        None => eat(&[0xfe]),
    }
    eat(&shard.to_le_bytes());
    h as i32
}

/// The distinct lock ids of `slots`, ascending: the order every request takes them in, so
/// two requests never wait for each other in a cycle.
pub(crate) fn lock_ids(slots: &[Slot<'_>]) -> Vec<i32> {
    let mut ids: Vec<i32> = slots.iter().map(|s| lock_id(s.name, s.key, s.shard)).collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// The longest table name: PostgreSQL keeps 63 bytes of a name, and the store names
/// functions after the table with `_take`, `_takes` and `_lease` added, and tables with
/// `_lconf` and `_slots`.
pub(crate) const MAX_TABLE: usize = 57;

/// Whether `table` is a name that may go into a statement as it is: letters, digits and `_`,
/// at most [`MAX_TABLE`] of them.
pub(crate) fn valid_table(table: &str) -> bool {
    !table.is_empty()
        && table.len() <= MAX_TABLE
        && table.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The parameters of the `take` function, in order, with their types; `takes` has each as
/// an array.
const TAKE_PARAMS: [(&str, &str); 15] = [
    ("p_lock", "int4"),
    ("p_name", "text"),
    ("p_has_key", "bool"),
    ("p_key", "text"),
    ("p_shard", "int4"),
    ("p_kind", "int4"),
    ("p_rate", "float8"),
    ("p_period", "float8"),
    ("p_cap", "float8"),
    ("p_maxr", "float8"),
    ("p_align", "float8"),
    ("p_count", "float8"),
    ("p_reserve", "bool"),
    ("p_writes", "bool"),
    ("p_now", "float8"),
];

/// `take`'s parameters as a function declares them (`named`) or as its signature names it
/// (types only), each type an array for `takes` (`arrays`).
pub(crate) fn take_params(named: bool, arrays: bool) -> String {
    let suffix = if arrays { "[]" } else { "" };
    let param = |(name, ty): (&str, &str)| {
        if named { format!("{name} {ty}{suffix}") } else { format!("{ty}{suffix}") }
    };
    TAKE_PARAMS.map(param).join(", ")
}

/// The arguments of a call of `take`: its parameters' `$1` to `$15` for a statement, or
/// (`element`) element `i` of each of `takes`'s array parameters.
fn take_args(element: bool) -> String {
    let args = TAKE_PARAMS
        .iter()
        .enumerate()
        .map(|(at, (name, _))| if element { format!("{name}[i]") } else { format!("${}", at + 1) });
    args.collect::<Vec<_>>().join(", ")
}

/// PostgreSQL's statements, for one table.
pub(crate) struct PgSql {
    pub(crate) create: String,
    /// Drops the `take` and `takes` functions of an earlier version, which answered rows
    /// instead of arrays (`CREATE OR REPLACE` cannot change what a function returns).
    pub(crate) drop_old: String,
    /// Creates (or replaces) the function behind [`PgSql::take`].
    pub(crate) create_take: String,
    /// Creates (or replaces) the function behind [`PgSql::takes`].
    pub(crate) create_takes: String,
    pub(crate) load: String,
    /// [`PgSql::load`] for a leasing store's own transactions: a state's lease records are
    /// read (a fifth column), not refused.
    pub(crate) load_leases: String,
    pub(crate) upsert: String,
    /// [`PgSql::upsert`] with the state's lease records (NULL: none).
    pub(crate) upsert_leases: String,
    pub(crate) delete: String,
    pub(crate) delete_all: String,
    /// The key and shard of each state of a name ($1).
    pub(crate) keys: String,
    /// Adds the `leases` column to a table of an earlier version.
    pub(crate) add_leases: String,
    /// Creates the table of the configs processes lease names under (`{table}_lconf`).
    pub(crate) create_lease_config: String,
    /// Says a process's config of a leased name ($1) as $2 for $3 ms: answers the config
    /// another said of it before, if that has not expired.
    pub(crate) announce: String,
    /// Creates (or replaces) the functions behind [`PgSql::lease`].
    pub(crate) create_lease: String,
    /// A step on a leased shard: see [`PgSql::new`].
    pub(crate) lease: String,
    /// The statements on the holders of concurrency limits, in `{table}_slots`.
    pub(crate) slots: SlotSql,
    /// The common request in one statement: see [`PgSql::new`].
    pub(crate) take: String,
    /// Several common requests in one statement, one transaction: see [`PgSql::new`].
    pub(crate) takes: String,
}

impl PgSql {
    /// The statements of `table` (checked with [`valid_table`] by the caller).
    ///
    /// `take` runs the common request (one take from one unsharded limit) in one statement,
    /// so in one round trip and one commit: a PL/pgSQL function that takes the slot's
    /// advisory lock, then reads the state (a function's statements each take a fresh
    /// snapshot under READ COMMITTED, so the read sees the last holder's commit), evaluates
    /// with the algebra of SPEC §2 (the same expressions, in the same order, as
    /// `tollgate-algebra`, which the differential test checks), and writes. It answers an
    /// array: the time it used, whether it wrote (1 or 0), and the state it read (two NULLs
    /// for none), from which `tollgate-algebra` computes the answer itself. An array, called in
    /// the select list: a function called in FROM answers through a tuple store, which cost
    /// PostgreSQL about 6 us more a call (measured with pgbench).
    ///
    /// `takes` runs several such requests, given as arrays of the same parameters, in one
    /// statement (group commit: one round trip and one commit for all): a function that
    /// first takes the advisory locks of all their slots in ascending order (as a plan's
    /// locks are taken, so no two tollgate requests deadlock), then runs `take` for each in
    /// turn, a later one seeing what an earlier one wrote, and answers a row (`take`'s
    /// array) for each, in order.
    pub(crate) fn new(table: &str) -> Self {
        // The load of a plan's slots, `fifth` its fifth column.
        let load = |fifth: &str| {
            format!(
                "SELECT s.i, t.value, t.ts, (extract(epoch FROM clock_timestamp()) * 1000)::float8,
                        {fifth}
                 FROM unnest($1::text[], $2::bool[], $3::text[], $4::int4[])
                      WITH ORDINALITY AS s(name, has_key, key, shard, i)
                 LEFT JOIN {table} t USING (name, has_key, key, shard)
                 ORDER BY s.i"
            )
        };
        PgSql {
            create: format!(
                "CREATE TABLE IF NOT EXISTS {table} (
                    name text COLLATE \"C\" NOT NULL, has_key boolean NOT NULL,
                    key text COLLATE \"C\" NOT NULL, shard integer NOT NULL,
                    value double precision NOT NULL, ts double precision NOT NULL,
                    leases double precision[],
                    PRIMARY KEY (name, has_key, key, shard)) WITH (fillfactor = 80)"
            ),
            drop_old: format!(
                "DO $do$ DECLARE f regprocedure; BEGIN
                  FOREACH f IN ARRAY ARRAY[to_regprocedure('{table}_take({take})'),
                      to_regprocedure('{table}_takes({takes})')] LOOP
                    IF f IS NOT NULL AND (SELECT p.prorettype FROM pg_proc p WHERE p.oid = f)
                        <> 'float8[]'::regtype THEN
                      EXECUTE 'DROP FUNCTION ' || f;
                    END IF;
                  END LOOP;
                END $do$",
                take = take_params(false, false),
                takes = take_params(false, true),
            ),
            create_take: format!(
                "CREATE OR REPLACE FUNCTION {table}_take({params})
                RETURNS float8[] LANGUAGE plpgsql VOLATILE AS $fn$
                DECLARE row_id tid; o_now float8; o_value float8; o_ts float8; o_wrote bool;
                  v float8; t float8; nv float8; nts float8; w float8; full_at float8;
                  leased bool;
                BEGIN
                  PERFORM pg_advisory_xact_lock({LOCK_CLASS}, p_lock);
                  SELECT s.value, s.ts, s.ctid, s.leases IS NOT NULL
                    INTO o_value, o_ts, row_id, leased FROM {table} s
                    WHERE s.name = p_name AND s.has_key = p_has_key AND s.key = p_key
                      AND s.shard = p_shard;
                  IF leased THEN
                    PERFORM {table}_lheld(p_name);
                  END IF;
                  o_now := coalesce(p_now, date_part('epoch', clock_timestamp()) * 1000);
                  IF o_value IS NOT NULL THEN
                    v := o_value; t := o_ts;
                  ELSIF p_kind = 0 THEN
                    v := p_cap; t := o_now;
                  ELSE
                    v := p_cap; t := p_align + floor((o_now - p_align) / p_period) * p_period;
                  END IF;
                  IF p_kind = 0 THEN
                    nv := least(v + (o_now - t) * p_rate / p_period, p_cap) - p_count;
                    nts := o_now;
                  ELSE
                    w := floor((o_now - t) / p_period);
                    nv := least(v + p_rate * w, p_cap) - p_count;
                    nts := t + w * p_period;
                  END IF;
                  o_wrote := p_writes AND (nv >= 0 OR (p_reserve AND (p_maxr IS NULL OR -nv <= p_maxr)));
                  IF o_wrote THEN
                    full_at := nts;
                    IF p_cap - nv > 0 THEN
                      IF p_kind = 0 THEN
                        full_at := nts + (p_cap - nv) * p_period / p_rate;
                      ELSE
                        full_at := nts + ceil((p_cap - nv) / p_rate) * p_period;
                      END IF;
                    END IF;
                    IF full_at <= o_now THEN
                      DELETE FROM {table} s WHERE s.name = p_name AND s.has_key = p_has_key
                        AND s.key = p_key AND s.shard = p_shard;
                    ELSE
                      -- The row just read, by its address: no second index lookup. Every
                      -- tollgate writer holds the slot's lock, so it is still there, unless
                      -- something else (a reset) changed it meanwhile: then by its key.
                      IF row_id IS NOT NULL THEN
                        UPDATE {table} s SET value = nv, ts = nts WHERE s.ctid = row_id;
                      END IF;
                      IF row_id IS NULL OR NOT FOUND THEN
                        INSERT INTO {table} (name, has_key, key, shard, value, ts)
                          VALUES (p_name, p_has_key, p_key, p_shard, nv, nts)
                          ON CONFLICT (name, has_key, key, shard)
                          DO UPDATE SET value = excluded.value, ts = excluded.ts;
                      END IF;
                    END IF;
                  END IF;
                  RETURN ARRAY[o_now, o_wrote::int, o_value, o_ts];
                END $fn$",
                params = take_params(true, false),
            ),
            create_takes: format!(
                "CREATE OR REPLACE FUNCTION {table}_takes({params})
                RETURNS SETOF float8[] LANGUAGE plpgsql VOLATILE AS $fn$
                DECLARE id int4;
                BEGIN
                  FOR id IN SELECT DISTINCT l FROM unnest(p_lock) l ORDER BY l LOOP
                    PERFORM pg_advisory_xact_lock({LOCK_CLASS}, id);
                  END LOOP;
                  FOR i IN 1 .. coalesce(array_length(p_lock, 1), 0) LOOP
                    RETURN NEXT {table}_take({elements});
                  END LOOP;
                END $fn$",
                params = take_params(true, true),
                elements = take_args(true),
            ),
            add_leases: format!(
                "ALTER TABLE {table} ADD COLUMN IF NOT EXISTS leases double precision[]"
            ),
            create_lease_config: format!(
                "CREATE TABLE IF NOT EXISTS {table}_lconf (name text PRIMARY KEY, \
                 said text NOT NULL, until timestamptz NOT NULL)"
            ),
            announce: format!(
                "WITH old AS (SELECT said FROM {table}_lconf \
                   WHERE name = $1 AND until > clock_timestamp()) \
                 INSERT INTO {table}_lconf (name, said, until) \
                   VALUES ($1, $2, clock_timestamp() + $3 * interval '1 millisecond') \
                 ON CONFLICT (name) DO UPDATE SET said = excluded.said, until = excluded.until \
                 RETURNING (SELECT said FROM old)"
            ),
            create_lease: pg_lease_functions(table),
            slots: SlotSql::postgres(table),
            lease: format!("SELECT {table}_lease($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)"),
            take: format!("SELECT {table}_take({args})", args = take_args(false)),
            takes: format!("SELECT a FROM {table}_takes({args}) a", args = take_args(false)),
            // One row per slot, in order, with the database's time once the locks are held.
            // A state with lease records is refused (an error that names it), whichever
            // client runs this, on a table of any version (read through `to_jsonb`, a
            // table made before leases has no `leases` column).
            load: load(
                "CASE WHEN jsonb_typeof(to_jsonb(t) -> 'leases') = 'array' THEN
                   ('tollgate: ' || t.name || ' holds lease records: a transaction of \
yours does not take a leased limit (a PgStore''s own transactions do); nothing was taken')::int END",
            ),
            load_leases: load("t.leases"),
            upsert_leases: format!(
                "INSERT INTO {table} (name, has_key, key, shard, value, ts, leases)
                 VALUES ($1, $2, $3, $4, $5, $6, $7)
                 ON CONFLICT (name, has_key, key, shard) DO UPDATE
                 SET value = excluded.value, ts = excluded.ts, leases = excluded.leases"
            ),
            upsert: format!(
                "INSERT INTO {table} (name, has_key, key, shard, value, ts) VALUES ($1, $2, $3, $4, $5, $6)
                 ON CONFLICT (name, has_key, key, shard) DO UPDATE SET value = excluded.value, ts = excluded.ts"
            ),
            delete: format!("DELETE FROM {table} WHERE name = $1 AND has_key = $2 AND key = $3 AND shard = $4"),
            delete_all: format!("DELETE FROM {table} WHERE name = $1 AND has_key = $2 AND key = $3 AND shard < $4"),
            keys: format!("SELECT has_key, key, shard FROM {table} WHERE name = $1"),
        }
    }
}

/// The functions of leases on `table` (issue 34), the same steps as `tollgate_algebra::lease`'s
/// `Leased` (the same expressions in the same order; the differential test checks them):
///
/// - `{table}_lease(lock, name, has_key, key, shard, kind, rate, period, cap, maxr, align,
///   now, step, args)`: takes the slot's advisory lock, loads the state and its records
///   (`leases`: holder, tokens, expiry per record, by holder), refills it under the cap
///   `capacity - outstanding` (each expired record dropped at its expiry), runs the step
///   (0 take: count, reserve, writes; 1 grant: holder, want, unused, term, share; 2 return:
///   holder, unused; 3 reset) and saves the state with its records (`leases` NULL when
///   there are none, so a plain take may take it; the row deleted when it is full and holds
///   none). Answers the time it used, what it loaded (1 and value, ts, the number of records
///   and the records; or 0, 0, 0, 0), then what the step said (1 or 0 for a take; kept,
///   tokens and expiry for a grant).
/// - `{table}_lfill`: the refill of a state to a time under a cap; `{table}_lsum`: the
///   tokens of the records; `{table}_lheld(name)`: raises the error of a leased state met by the
///   `take` function of a store that does not lease it (which would refill it past its cap).
fn pg_lease_functions(table: &str) -> String {
    format!(
        "CREATE OR REPLACE FUNCTION {table}_lheld(p_name text) RETURNS float8
        LANGUAGE plpgsql VOLATILE AS $fn$
        BEGIN
          RAISE EXCEPTION 'tollgate: % holds lease records: it is taken by a store that leases \
it (lease on the store''s builder, lease = true in the server); nothing was taken', p_name;
        END $fn$;
        CREATE OR REPLACE FUNCTION {table}_lsum(recs float8[]) RETURNS float8
        LANGUAGE plpgsql IMMUTABLE AS $fn$
        DECLARE total float8 := 0;
        BEGIN
          FOR i IN 1 .. coalesce(array_length(recs, 1), 0) / 3 LOOP
            total := total + recs[3 * i - 1];
          END LOOP;
          RETURN total;
        END $fn$;
        CREATE OR REPLACE FUNCTION {table}_lfill(p_kind int4, p_rate float8, p_period float8,
            v float8, t float8, p_to float8, c float8, OUT o_v float8, OUT o_t float8)
        LANGUAGE plpgsql IMMUTABLE AS $fn$
        DECLARE w float8;
        BEGIN
          o_v := v; o_t := t;
          IF p_to <= t THEN
            o_v := least(v, c);
          ELSIF p_kind = 0 THEN
            o_v := least(v + (p_to - t) * p_rate / p_period, c);
            o_t := p_to;
          ELSE
            w := floor((p_to - t) / p_period);
            IF w >= 1 THEN
              o_v := least(v + p_rate * w, c);
              o_t := t + w * p_period;
            END IF;
          END IF;
        END $fn$;
        CREATE OR REPLACE FUNCTION {table}_lease(p_lock int4, p_name text, p_has_key bool,
            p_key text, p_shard int4, p_kind int4, p_rate float8, p_period float8, p_cap float8,
            p_maxr float8, p_align float8, p_now float8, p_step int4, p_args float8[])
        RETURNS float8[] LANGUAGE plpgsql VOLATILE AS $fn$
        DECLARE o_now float8; v float8; t float8; recs float8[]; loaded float8[];
          said float8[] := '{{}}'; save bool := true; n int; fi int; e float8;
          holder float8; kept float8; room float8; tokens float8; expiry float8; pos int;
          nv float8; ok bool; full_at float8;
        BEGIN
          PERFORM pg_advisory_xact_lock({LOCK_CLASS}, p_lock);
          SELECT s.value, s.ts, s.leases INTO v, t, recs FROM {table} s
            WHERE s.name = p_name AND s.has_key = p_has_key AND s.key = p_key
              AND s.shard = p_shard;
          o_now := coalesce(p_now, date_part('epoch', clock_timestamp()) * 1000);
          recs := coalesce(recs, '{{}}');
          IF v IS NOT NULL THEN
            loaded := ARRAY[1, v, t, coalesce(array_length(recs, 1), 0) / 3]::float8[] || recs;
          ELSE
            loaded := ARRAY[0, 0, 0, 0]::float8[];
          END IF;
          -- None yet, or forgotten by a reset (a value of NaN) while leases are out: fresh,
          -- the records expired by now dropped, as full as the others allow.
          IF v IS NULL OR v = 'NaN'::float8 THEN
            FOR i IN REVERSE coalesce(array_length(recs, 1), 0) / 3 .. 1 LOOP
              IF recs[3 * i] <= o_now THEN
                recs := recs[1 : 3 * i - 3] || recs[3 * i + 1 :];
              END IF;
            END LOOP;
            v := least(p_cap, p_cap - {table}_lsum(recs));
            IF p_kind = 0 THEN
              t := o_now;
            ELSE
              t := p_align + floor((o_now - p_align) / p_period) * p_period;
            END IF;
          END IF;
          -- Each record expired by now counts until its expiry, the first first.
          LOOP
            fi := NULL;
            FOR i IN 1 .. coalesce(array_length(recs, 1), 0) / 3 LOOP
              IF recs[3 * i] <= o_now AND (fi IS NULL OR recs[3 * i] < recs[3 * fi]) THEN
                fi := i;
              END IF;
            END LOOP;
            EXIT WHEN fi IS NULL;
            e := recs[3 * fi];
            IF p_kind = 0 THEN
              SELECT * INTO v, t FROM {table}_lfill(p_kind, p_rate, p_period, v, t, e,
                p_cap - {table}_lsum(recs));
              recs := recs[1 : 3 * fi - 3] || recs[3 * fi + 1 :];
            ELSE
              recs := recs[1 : 3 * fi - 3] || recs[3 * fi + 1 :];
              SELECT * INTO v, t FROM {table}_lfill(p_kind, p_rate, p_period, v, t, e,
                p_cap - {table}_lsum(recs));
            END IF;
          END LOOP;
          SELECT * INTO v, t FROM {table}_lfill(p_kind, p_rate, p_period, v, t, o_now,
            p_cap - {table}_lsum(recs));
          n := coalesce(array_length(recs, 1), 0) / 3;
          IF p_step = 0 THEN
            nv := v - p_args[1];
            ok := nv >= 0 OR (p_args[2] = 1 AND NOT (p_maxr IS NOT NULL AND -nv > p_maxr));
            IF ok AND p_args[3] = 1 THEN v := nv; END IF;
            said := ARRAY[ok::int]::float8[];
            save := ok AND p_args[3] = 1;
          ELSIF p_step = 1 THEN
            holder := p_args[1];
            kept := 0;
            FOR i IN 1 .. n LOOP
              IF recs[3 * i - 2] = holder THEN
                kept := least(recs[3 * i - 1], greatest(p_args[3], 0));
                recs := recs[1 : 3 * i - 3] || recs[3 * i + 1 :];
                n := n - 1;
                EXIT;
              END IF;
            END LOOP;
            room := p_args[5] * p_cap - {table}_lsum(recs) - kept;
            tokens := greatest(least(least(p_args[2], v), room), 0);
            expiry := o_now + p_args[4];
            IF p_kind <> 0 THEN expiry := least(expiry, t + p_period); END IF;
            v := v - tokens;
            IF kept + tokens > 0 THEN
              pos := n + 1;
              FOR i IN 1 .. n LOOP
                IF recs[3 * i - 2] > holder THEN pos := i; EXIT; END IF;
              END LOOP;
              recs := recs[1 : 3 * pos - 3] || ARRAY[holder, kept + tokens, expiry]
                || recs[3 * pos - 2 :];
            END IF;
            said := ARRAY[kept, tokens, expiry];
          ELSIF p_step = 2 THEN
            -- Nothing to return: nothing written.
            save := false;
            FOR i IN 1 .. n LOOP
              IF recs[3 * i - 2] = p_args[1] THEN
                v := v + least(recs[3 * i - 1], greatest(p_args[2], 0));
                recs := recs[1 : 3 * i - 3] || recs[3 * i + 1 :];
                save := true;
                EXIT;
              END IF;
            END LOOP;
          ELSIF p_step = 3 THEN
            -- Forgotten (a reset; the slot's config is not read): kept with a value of NaN
            -- while records are out, deleted when none are.
            save := false;
            IF n = 0 THEN
              DELETE FROM {table} s WHERE s.name = p_name AND s.has_key = p_has_key
                AND s.key = p_key AND s.shard = p_shard;
            ELSE
              INSERT INTO {table} (name, has_key, key, shard, value, ts, leases)
                VALUES (p_name, p_has_key, p_key, p_shard, 'NaN'::float8, o_now, recs)
                ON CONFLICT (name, has_key, key, shard)
                DO UPDATE SET value = excluded.value, ts = excluded.ts, leases = excluded.leases;
            END IF;
          ELSE
            RAISE EXCEPTION 'tollgate: unknown lease step %', p_step;
          END IF;
          IF save THEN
            n := coalesce(array_length(recs, 1), 0) / 3;
            -- Deleted only when it holds no record and is full again: no sooner may a
            -- missing row read as a full bucket.
            full_at := t;
            IF p_cap - v > 0 THEN
              IF p_kind = 0 THEN
                full_at := t + (p_cap - v) * p_period / p_rate;
              ELSE
                full_at := t + ceil((p_cap - v) / p_rate) * p_period;
              END IF;
            END IF;
            IF n = 0 AND full_at <= o_now THEN
              DELETE FROM {table} s WHERE s.name = p_name AND s.has_key = p_has_key
                AND s.key = p_key AND s.shard = p_shard;
            ELSE
              INSERT INTO {table} (name, has_key, key, shard, value, ts, leases)
                VALUES (p_name, p_has_key, p_key, p_shard, v, t,
                  CASE WHEN n = 0 THEN NULL ELSE recs END)
                ON CONFLICT (name, has_key, key, shard)
                DO UPDATE SET value = excluded.value, ts = excluded.ts, leases = excluded.leases;
            END IF;
          END IF;
          RETURN ARRAY[o_now] || loaded || said;
        END $fn$"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_ids_are_stable_and_tell_keys_apart() {
        assert_eq!(lock_id("send", Some("alice"), 0), lock_id("send", Some("alice"), 0));
        assert_ne!(lock_id("send", None, 0), lock_id("send", Some(""), 0));
        assert_ne!(lock_id("send", Some("alice"), 0), lock_id("send", Some("alice"), 1));
        // Fixed, whatever the build: the same id in every app server.
        assert_eq!(lock_id("", None, 0), 1_649_693_001); // FNV-1a of fe 00 00
    }

    #[test]
    fn table_names_are_checked() {
        assert!(valid_table("tollgate_state2"));
        assert!(!valid_table("x; DROP TABLE y"));
        assert!(valid_table(&"t".repeat(MAX_TABLE)));
        assert!(!valid_table(&"t".repeat(MAX_TABLE + 1)), "its function's name would be cut");
        assert!(!valid_table(""));
    }
}
