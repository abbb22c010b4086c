//! The PostgreSQL store's workers: requests wait in a queue, first come first; a worker takes
//! the next batch (one request, or the one-takes in a row, together in one statement), runs it
//! on its connection within the store's timeout and answers each; a connection that failed is
//! made again.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio_postgres::Row;
use tokio_postgres::types::{ToSql, Type};
use tollgate_algebra::lease::Leased;
use tollgate_algebra::slots::SlotAnswer;
use tollgate_algebra::{Clock, Outcome, State};

use super::Shared;
use super::plan::{delete_all, in_own_transaction, load};
use super::schema::{Conn, Stmt, bounded, pg_error, query};
use super::single::{LeaseRow, OneRow, lease_answer, send_ones};
use super::slots::{SlotCall, slots_in_own_transaction, slots_with_in_own_transaction, split};
use crate::error::StoreError;
use crate::store::seam::OneAnswer;
use crate::store::ticket::{OwnedPlan, OwnedSlotOp, OwnedSlots, Ticket};

/// A request for a worker.
pub(super) enum Job {
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
    /// An operation on a concurrency limit's holders, at the store's time (`None`: the
    /// database's).
    Slots(Box<OwnedSlotOp>, Option<f64>, Ticket<SlotAnswer>),
    /// An acquire with the takes of a plan, all or nothing, at the store's time.
    SlotsWith(Box<(OwnedSlotOp, OwnedPlan)>, Option<f64>, Ticket<(SlotAnswer, Outcome)>),
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
            Job::Slots(_, _, t) => t.take(),
            Job::SlotsWith(_, _, t) => t.take(),
        }
    }
}

/// The most one-takes a grouped statement carries.
const MOST_PER_STATEMENT: usize = 64;

impl<C> Shared<C> {
    pub(super) fn push(&self, job: Job) {
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

/// A worker: runs requests on its connection, one batch at a time, until the store is
/// dropped. A connection that fails is dropped and made again for the next batch.
pub(super) async fn work<C: Clock>(shared: Arc<Shared<C>>, mut conn: Option<Conn>) {
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
            Batch::Other(Job::Slots(_, _, t)) => t.answer(Err(e())),
            Batch::Other(Job::SlotsWith(_, _, t)) => t.answer(Err(e())),
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
            Batch::Other(Job::Slots(call, now, ticket)) => {
                let call = SlotCall {
                    name: &call.name,
                    key: call.key.as_deref(),
                    limit: &call.limit,
                    op: &call.op,
                };
                let request = async {
                    split(slots_in_own_transaction(&conn.client, &stmts, call, now).await)
                };
                let (result, healthy) = bounded(timeout, call.op.writes(), request).await;
                ticket.answer(result.and_then(|answer| answer));
                healthy
            }
            Batch::Other(Job::SlotsWith(with, now, ticket)) => {
                let (call, taken) = &*with;
                let call = SlotCall {
                    name: &call.name,
                    key: call.key.as_deref(),
                    limit: &call.limit,
                    op: &call.op,
                };
                let taken = taken.plan();
                let request = async {
                    let answer =
                        slots_with_in_own_transaction(&conn.client, &stmts, call, &taken, now);
                    split(answer.await)
                };
                let (result, healthy) = bounded(timeout, true, request).await;
                ticket.answer(result.and_then(|answer| answer));
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
