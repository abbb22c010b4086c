//! Concurrency limits (SPEC §6f) in PostgreSQL: an operation on the holders of a (name, key),
//! a row each in `{table}_slots`, in one transaction of the store's own or the caller's.
//!
//! Concurrent acquirers in many connections and processes must never hold more than `max`:
//! each operation first takes a transaction-scoped advisory lock on its (name, key) (a class
//! of its own, [`SLOTS_LOCK_CLASS`]), which serializes every operation on it until its
//! transaction ends, then reads the holders in a statement of its own, whose snapshot
//! (READ COMMITTED) sees every commit before the lock was granted. `SELECT ... FOR UPDATE`
//! on the holders would not do: with no holder yet it locks nothing, and two first
//! acquirers would both see every slot free. The lock is taken on the (name, key), not per
//! row, so a (name, key) needs no parent row to lock either.

use futures_util::future::join;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, GenericClient};
use tollgate_algebra::slots::{Concurrency, Holder, SlotAnswer, SlotOp, Write};
use tollgate_algebra::{Outcome, Plan};

use super::plan;
use super::schema::{Stmts, pg_error, query};
use crate::error::StoreError;
use crate::store::seam::slots_with_answer;
use crate::store::sql::{SLOTS_LOCK_CLASS, decide_slots, key_columns, lock_id, pg_loaded};

/// An operation on the holders of (name, key) of a concurrency limit.
#[derive(Clone, Copy)]
pub(super) struct SlotCall<'a> {
    pub(super) name: &'a str,
    pub(super) key: Option<&'a str>,
    pub(super) limit: &'a Concurrency,
    pub(super) op: &'a SlotOp,
}

/// Why an operation failed: the database, or what it read (a row that is garbage, or an
/// operation that is invalid, which the limiter checks first).
pub(super) enum Failed {
    Db(tokio_postgres::Error),
    Store(StoreError),
}

impl From<tokio_postgres::Error> for Failed {
    fn from(e: tokio_postgres::Error) -> Self {
        Failed::Db(e)
    }
}

impl From<StoreError> for Failed {
    fn from(e: StoreError) -> Self {
        Failed::Store(e)
    }
}

impl Failed {
    /// The error a caller of a transaction of its own sees.
    pub(super) fn into_store_error(self) -> StoreError {
        match self {
            Failed::Db(e) => pg_error("request failed", e),
            Failed::Store(e) => e,
        }
    }
}

/// `result` as the store's workers bound a request (`schema::bounded`): the database's
/// error outside, what it read inside.
pub(super) fn split<T>(
    result: Result<T, Failed>,
) -> Result<Result<T, StoreError>, tokio_postgres::Error> {
    match result {
        Ok(answer) => Ok(Ok(answer)),
        Err(Failed::Store(e)) => Ok(Err(e)),
        Err(Failed::Db(e)) => Err(e),
    }
}

/// What [`load`] read: the time it used, the holders left, and the new ticket (0 when the
/// operation is not an acquire, which makes none).
struct Loaded {
    now: f64,
    holders: Vec<Holder>,
    ticket: u64,
}

/// Takes the (name, key)'s lock, then (in the same round trip) drops its holders expired by
/// the time and loads the others, with that time and, for an acquire, a new ticket.
async fn load<G: GenericClient + Sync>(
    client: &G,
    stmts: &Stmts<'_>,
    call: SlotCall<'_>,
    now: Option<f64>,
) -> Result<Loaded, Failed> {
    let (has_key, key) = key_columns(call.key);
    let id = lock_id(call.name, call.key, 0);
    let lock: [&(dyn ToSql + Sync); 2] = [&SLOTS_LOCK_CLASS, &id];
    let acquires = matches!(call.op, SlotOp::Acquire { .. });
    let params: [&(dyn ToSql + Sync); 5] = [&call.name, &has_key, &key, &now, &acquires];
    // Sent together and run in order: the load waits for the lock in the database.
    let (locked, rows) =
        join(query(client, stmts.lock, &lock), query(client, stmts.slots.load, &params)).await;
    locked?;
    let mut read = Vec::new();
    for row in rows? {
        // No holder (NULLs) in the one row there is when there is none.
        let holder = match row.try_get::<_, Option<i64>>(2)? {
            Some(ticket) => Some((ticket, i64::from(row.try_get::<_, i32>(3)?), row.try_get(4)?)),
            None => None,
        };
        read.push((row.try_get(0)?, row.try_get(1)?, holder));
    }
    let (now, holders, ticket) = pg_loaded(read, acquires)?;
    Ok(Loaded { now, holders, ticket })
}

/// Writes what the decision says.
async fn save<G: GenericClient + Sync>(
    client: &G,
    stmts: &Stmts<'_>,
    call: SlotCall<'_>,
    write: Write,
) -> Result<(), tokio_postgres::Error> {
    let (has_key, key) = key_columns(call.key);
    let name = call.name;
    // Tickets are at most 2^53 - 1 (made by the table's sequence, checked when read back),
    // counts at most 2^30: exact as the columns' signed integers.
    let column = |ticket: u64| ticket as i64;
    match write {
        Write::Nothing => return Ok(()),
        Write::Add(h) => {
            let (ticket, count) = (column(h.ticket), h.count as i32);
            let params: [&(dyn ToSql + Sync); 6] =
                [&name, &has_key, &key, &ticket, &count, &h.expiry];
            query(client, stmts.slots.insert, &params).await?
        }
        Write::Remove(ticket) => {
            let ticket = column(ticket);
            query(client, stmts.slots.remove, &[&name, &has_key, &key, &ticket]).await?
        }
        Write::Expiry(ticket, expiry) => {
            let ticket = column(ticket);
            let params: [&(dyn ToSql + Sync); 5] = [&name, &has_key, &key, &ticket, &expiry];
            query(client, stmts.slots.expiry, &params).await?
        }
        Write::Clear => query(client, stmts.slots.clear, &[&name, &has_key, &key]).await?,
    };
    Ok(())
}

/// The operation within a transaction already begun (the caller's): lock, load, decide at
/// the time the load used, write. Two round trips (one when nothing is written).
pub(super) async fn slots_in<G: GenericClient + Sync>(
    client: &G,
    stmts: &Stmts<'_>,
    call: SlotCall<'_>,
    now: Option<f64>,
) -> Result<SlotAnswer, Failed> {
    let loaded = load(client, stmts, call, now).await?;
    let (answer, write) =
        decide_slots(call.limit, &loaded.holders, loaded.now, call.op, loaded.ticket)?;
    save(client, stmts, call, write).await?;
    Ok(answer)
}

/// The operation in a transaction of its own on a store connection: `BEGIN` goes with the
/// lock and the load, `COMMIT` with the write, so two round trips in all. Anything that
/// fails rolls it all back.
pub(super) async fn slots_in_own_transaction(
    client: &Client,
    stmts: &Stmts<'_>,
    call: SlotCall<'_>,
    now: Option<f64>,
) -> Result<SlotAnswer, Failed> {
    let (begun, loaded) = join(client.batch_execute("BEGIN"), load(client, stmts, call, now)).await;
    let result = async {
        begun?;
        let loaded = loaded?;
        let (answer, write) =
            decide_slots(call.limit, &loaded.holders, loaded.now, call.op, loaded.ticket)?;
        let (written, committed) =
            join(save(client, stmts, call, write), client.batch_execute("COMMIT")).await;
        // A write that failed aborted the transaction, which COMMIT then rolled back.
        written?;
        committed?;
        Ok(answer)
    }
    .await;
    if result.is_err() && !client.is_closed() {
        let _ = client.batch_execute("ROLLBACK").await;
    }
    result
}

/// What an acquire with rate limits decided: the answers, and what to write (only when
/// both are granted).
struct DecidedWith {
    answer: SlotAnswer,
    outcome: Outcome,
    writes: Option<(Write, plan::Decided)>,
}

/// An acquire with the takes of `plan`, all or nothing (`Store::slots_with`): the
/// (name, key)'s lock and its holders, then the plan's locks and states, in one round trip
/// (the slots' lock first: every operation that takes both takes them in this order); the
/// plan decided as a check if the slots are full.
async fn decide_with<G: GenericClient + Sync>(
    client: &G,
    stmts: &Stmts<'_>,
    call: SlotCall<'_>,
    taken: &Plan<'_>,
    now: Option<f64>,
) -> Result<DecidedWith, Failed> {
    let (holders, states) =
        join(load(client, stmts, call, now), plan::load(client, stmts, taken.slots(), now, true))
            .await;
    let (holders, states) = (holders?, states?);
    let (answer, write) =
        decide_slots(call.limit, &holders.holders, holders.now, call.op, holders.ticket)?;
    let granted = matches!(answer, SlotAnswer::Acquired { .. });
    let decided =
        if granted { plan::decide(taken, states) } else { plan::decide(&taken.checking(), states) };
    let outcome = decided.outcome.clone();
    let writes = (granted && outcome.ok).then_some((write, decided));
    Ok(DecidedWith { answer: slots_with_answer(answer, &outcome), outcome, writes })
}

/// Writes what [`decide_with`] decided, if anything.
async fn save_with<G: GenericClient + Sync>(
    client: &G,
    stmts: &Stmts<'_>,
    call: SlotCall<'_>,
    taken: &Plan<'_>,
    writes: Option<(Write, plan::Decided)>,
) -> Result<(), tokio_postgres::Error> {
    if let Some((write, decided)) = writes {
        let (holder, states) =
            join(save(client, stmts, call, write), plan::save(client, stmts, taken, &decided))
                .await;
        holder?;
        states?;
    }
    Ok(())
}

/// An acquire with the takes of `plan`, all or nothing, within a transaction already begun
/// (the caller's). Two round trips (one when nothing is written).
pub(super) async fn slots_with_in<G: GenericClient + Sync>(
    client: &G,
    stmts: &Stmts<'_>,
    call: SlotCall<'_>,
    taken: &Plan<'_>,
    now: Option<f64>,
) -> Result<(SlotAnswer, Outcome), Failed> {
    let decided = decide_with(client, stmts, call, taken, now).await?;
    save_with(client, stmts, call, taken, decided.writes).await?;
    Ok((decided.answer, decided.outcome))
}

/// The same in a transaction of its own on a store connection: `BEGIN` goes with the locks
/// and loads, `COMMIT` with the writes. Anything that fails rolls it all back.
pub(super) async fn slots_with_in_own_transaction(
    client: &Client,
    stmts: &Stmts<'_>,
    call: SlotCall<'_>,
    taken: &Plan<'_>,
    now: Option<f64>,
) -> Result<(SlotAnswer, Outcome), Failed> {
    let (begun, decided) =
        join(client.batch_execute("BEGIN"), decide_with(client, stmts, call, taken, now)).await;
    let result = async {
        begun?;
        let decided = decided?;
        let (written, committed) = join(
            save_with(client, stmts, call, taken, decided.writes),
            client.batch_execute("COMMIT"),
        )
        .await;
        // A write that failed aborted the transaction, which COMMIT then rolled back.
        written?;
        committed?;
        Ok((decided.answer, decided.outcome))
    }
    .await;
    if result.is_err() && !client.is_closed() {
        let _ = client.batch_execute("ROLLBACK").await;
    }
    result
}
