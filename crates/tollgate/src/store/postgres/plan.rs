//! A plan (any takes, all or nothing) in one transaction: the slots' advisory locks taken in
//! ascending order, their states and the time read in one query, tollgate-algebra deciding,
//! what changed written; in a transaction of the store's own or in one already begun (the
//! caller's). Beside it, reading states and deleting a limit's.

use futures_util::future::try_join_all;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, GenericClient};
use tollgate_algebra::{Outcome, Plan, Slot, State, full_at};

use super::schema::{Stmts, query};
use super::single::leased;
use crate::store::sql::{LOCK_CLASS, key_columns, lock_ids};

/// Loads the states of `slots` and the time in one query (after taking their locks, in
/// ascending order, when `lock`: all sent at once, run in order).
pub(super) async fn load<G: GenericClient + Sync>(
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
pub(super) type Loaded = (f64, Vec<Option<State>>, Vec<Option<Vec<f64>>>);

/// Decides `plan` on what [`load`] read. A state with lease records is first refilled under
/// `capacity - outstanding` to `now` (`Leased::advance`), so a transaction takes a leased
/// limit directly, never past what its leases leave (nor does an adjust give back past
/// it); answers the records each keeps.
pub(super) fn decide(plan: &Plan<'_>, (now, mut states, records): Loaded) -> Decided {
    // What an adjust may raise each state to: a leased one's cap (see `Plan::decide_under`).
    let mut caps = vec![f64::INFINITY; plan.slots().len()];
    let kept: Vec<Option<Vec<f64>>> = plan
        .slots()
        .iter()
        .zip(states.iter_mut())
        .zip(records)
        .zip(caps.iter_mut())
        .map(|(((slot, state), records), cap)| {
            let mut leased = leased(*state, &records?);
            *state = Some(leased.advance(&slot.config, slot.alignment, now));
            *cap = slot.config.capacity() - leased.outstanding();
            // Holder ids are below 2^53: exact as doubles.
            #[allow(clippy::cast_precision_loss)]
            let left = leased.leases.iter().flat_map(|(h, l)| [*h as f64, l.tokens, l.expiry]);
            Some(left.collect())
        })
        .collect();
    let outcome = plan.decide_under(now, &mut states, &caps);
    Decided { now, states, kept, outcome }
}

/// A decided plan, with what it writes.
pub(super) struct Decided {
    now: f64,
    states: Vec<Option<State>>,
    /// Per slot, the lease records it keeps (`None`: its row had none).
    kept: Vec<Option<Vec<f64>>>,
    pub(super) outcome: Outcome,
}

/// Writes what `decided` changed: each state, or a delete when it is full again and holds no
/// lease record; a state that had records is written with those it keeps (NULL: none), and
/// is never deleted while it keeps any.
pub(super) async fn save<G: GenericClient + Sync>(
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
pub(super) async fn execute_in<G: GenericClient + Sync>(
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
pub(super) async fn in_own_transaction(
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

pub(super) async fn delete_all<G: GenericClient + Sync>(
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
