//! The common request, one take from one unsharded limit, in one statement: the table's
//! `take` function, or `takes` for the one-takes a worker runs together; each answer read
//! back and checked against tollgate-algebra's. A step on a leased shard is one statement
//! too, the table's `lease` function: its parameters and its answer are here.

use std::time::Duration;

use tokio_postgres::Row;
use tokio_postgres::types::ToSql;
use tollgate_algebra::lease::{Lease, Leased};
use tollgate_algebra::{Kind, OneTake, Slot, State, Taken};

use super::schema::{Conn, bounded, request_error, timed_out};
use crate::error::StoreError;
use crate::store::lease::Step;
use crate::store::seam::OneAnswer;
use crate::store::sql::{key_columns, lock_id};

/// One take from one unsharded limit, as the parameters of the table's `take` function.
pub(super) struct OneRow {
    pub(super) lock: i32,
    pub(super) name: String,
    pub(super) has_key: bool,
    /// The key, `""` when there is none.
    pub(super) key: String,
    pub(super) shard: i32,
    pub(super) kind: i32,
    pub(super) rate: f64,
    pub(super) period: f64,
    pub(super) cap: f64,
    pub(super) max_reserved: Option<f64>,
    pub(super) alignment: f64,
    count: f64,
    reserve: bool,
    writes: bool,
    /// `None`: the database's clock.
    pub(super) now: Option<f64>,
}

impl OneRow {
    pub(super) fn new(take: &OneTake<'_>, now: Option<f64>) -> Self {
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
    pub(super) fn params(&self) -> [&(dyn ToSql + Sync); 15] {
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

/// Reads an answer of the `take` function (a row of `takes`): an array of the time it used,
/// whether it wrote (1 or 0), and the state it read (value and ts, or two NULLs).
pub(super) fn answer(row: &Row) -> Result<OneAnswer, StoreError> {
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
pub(super) async fn send_ones(
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

/// The answer to `take` from what the `take` function read and did: tollgate-algebra's, on the
/// same state and time, as for a plan.
pub(super) fn decided(
    take: &OneTake<'_>,
    (db_now, wrote, state): OneAnswer,
) -> Result<Taken, StoreError> {
    let (taken, new) = take.decide(db_now, state);
    if wrote != new.is_some() {
        return Err(StoreError::new(
            "postgres: the database and tollgate-algebra disagree on this request; this is a bug",
        ));
    }
    Ok(taken)
}

/// A step on a leased shard, as the parameters of the table's `lease` function.
pub(super) struct LeaseRow {
    take: OneRow,
    step: i32,
    args: Vec<f64>,
}

impl LeaseRow {
    pub(super) fn new(slot: &Slot<'_>, step: Step, now: Option<f64>) -> LeaseRow {
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

    pub(super) fn params(&self) -> [&(dyn ToSql + Sync); 14] {
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
pub(super) fn lease_answer(rows: &[Row]) -> Result<(f64, Leased, Vec<f64>), StoreError> {
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
pub(super) fn leased(state: Option<State>, records: &[f64]) -> Leased {
    Leased {
        state: state.filter(|s| !s.value.is_nan()),
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        leases: records
            .chunks(3)
            .map(|r| (r[0] as u64, Lease { tokens: r[1], expiry: r[2] }))
            .collect(),
    }
}
