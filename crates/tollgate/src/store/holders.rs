//! The holders of concurrency limits (SPEC §6f) in this process: the memory store's, under
//! one lock. Each (name, key) is a short list of holders; expired ones are dropped when
//! their (name, key) is next touched, and every 4,096 operations all lists are swept, so
//! that a key nobody touches again holds no memory past its holders' expiry.

use std::collections::HashMap;

use parking_lot::Mutex;
use tollgate_algebra::slots::{Concurrency, Holder, SlotAnswer, SlotOp, Write, apply, decide};

use tollgate_algebra::Outcome;

use crate::error::StoreError;
use crate::store::seam::slots_with_answer;

/// Operations between sweeps of every list.
const SWEEP_EVERY: u64 = 4_096;

type Id = (Box<str>, Option<Box<str>>);

#[derive(Default)]
pub(crate) struct Holders {
    table: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    lists: HashMap<Id, Vec<Holder>, foldhash::fast::RandomState>,
    /// The last ticket made (tickets start at 1).
    last: u64,
    ops: u64,
}

impl Holders {
    /// Answers `op` on (name, key) at `now` and writes what it says (SPEC §6f).
    pub(crate) fn run(
        &self,
        name: &str,
        key: Option<&str>,
        limit: &Concurrency,
        op: &SlotOp,
        now: f64,
    ) -> Result<SlotAnswer, StoreError> {
        let mut table = self.table.lock();
        let (answer, write) = table.decide(name, key, limit, op, now)?;
        table.write(name, key, &write, now);
        Ok(answer)
    }

    /// Answers the acquire `op` on (name, key) at `now` together with `then`, which takes
    /// the rate limits beside it (given whether the acquire is granted: if not, it must
    /// write nothing) and answers their outcome; the holder is added only if both are
    /// granted (SPEC §6f, all or nothing). The holders' lock is held throughout, so nothing
    /// else changes them in between.
    pub(crate) fn run_with(
        &self,
        name: &str,
        key: Option<&str>,
        limit: &Concurrency,
        op: &SlotOp,
        now: f64,
        then: impl FnOnce(bool) -> Result<Outcome, StoreError>,
    ) -> Result<(SlotAnswer, Outcome), StoreError> {
        let mut table = self.table.lock();
        let (answer, write) = table.decide(name, key, limit, op, now)?;
        let granted = matches!(answer, SlotAnswer::Acquired { .. });
        let outcome = then(granted)?;
        if granted && outcome.ok {
            table.write(name, key, &write, now);
        }
        Ok((slots_with_answer(answer, &outcome), outcome))
    }
}

impl Table {
    /// What `op` answers on (name, key) at `now` and what it would write; counts the
    /// operation and sweeps every list when it is time.
    fn decide(
        &mut self,
        name: &str,
        key: Option<&str>,
        limit: &Concurrency,
        op: &SlotOp,
        now: f64,
    ) -> Result<(SlotAnswer, Write), StoreError> {
        self.ops += 1;
        if self.ops.is_multiple_of(SWEEP_EVERY) {
            self.lists.retain(|_, list| {
                list.retain(|h| h.expiry > now);
                !list.is_empty()
            });
        }
        let id: Id = (name.into(), key.map(Into::into));
        let list = self.lists.get(&id).map_or(&[][..], Vec::as_slice);
        decide(limit, list, now, op, self.last + 1).map_err(|e| StoreError::new(e.message()))
    }

    /// Writes what a decision said (a new holder's ticket is the last one made).
    fn write(&mut self, name: &str, key: Option<&str>, write: &Write, now: f64) {
        if let Write::Add(holder) = write {
            self.last = holder.ticket;
        }
        if *write != Write::Nothing {
            let id: Id = (name.into(), key.map(Into::into));
            let list = self.lists.entry(id).or_default();
            apply(list, write, now);
            if list.is_empty() {
                self.lists.remove(&(name.into(), key.map(Into::into)));
            }
        }
    }
}
