//! The holders of concurrency limits (SPEC §6f) in this process: the memory store's, under
//! one lock. Each (name, key) is a short list of holders; expired ones are dropped when
//! their (name, key) is next touched, and every 4,096 operations all lists are swept, so
//! that a key nobody touches again holds no memory past its holders' expiry.

use std::collections::HashMap;

use parking_lot::Mutex;
use tollgate_algebra::slots::{Concurrency, Holder, SlotAnswer, SlotOp, Write, apply, decide};

use crate::error::StoreError;

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
        table.ops += 1;
        if table.ops.is_multiple_of(SWEEP_EVERY) {
            table.lists.retain(|_, list| {
                list.retain(|h| h.expiry > now);
                !list.is_empty()
            });
        }
        let ticket = table.last + 1;
        let id: Id = (name.into(), key.map(Into::into));
        let list = table.lists.get(&id).map_or(&[][..], Vec::as_slice);
        let (answer, write) =
            decide(limit, list, now, op, ticket).map_err(|e| StoreError::new(e.message()))?;
        if let Write::Add(_) = write {
            table.last = ticket;
        }
        if write != Write::Nothing {
            let list = table.lists.entry(id).or_default();
            apply(list, &write, now);
            if list.is_empty() {
                table.lists.remove(&(name.into(), key.map(Into::into)));
            }
        }
        Ok(answer)
    }
}
