//! A request handed to a store's own worker (a thread, or a task that owns a connection),
//! and its answer: the caller awaits it, so no thread of the caller's runtime ever waits on
//! I/O. What the request names is copied ([`OwnedPlan`], [`OwnedSlots`]): the worker must
//! not borrow from a caller that may go away.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use tokio::sync::oneshot;
#[cfg(feature = "sqlite")]
use tollgate_algebra::OneTake;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
use tollgate_algebra::slots::{Concurrency, SlotOp};
#[cfg(any(feature = "sqlite", feature = "postgres"))]
use tollgate_algebra::{Plan, Slot};

use crate::error::StoreError;

/// A request waits to be taken by the worker.
const QUEUED: u8 = 0;
/// The worker took it: it is being (or was) sent.
const TAKEN: u8 = 1;
/// Its caller gave up before the worker took it: it is never sent.
const ABANDONED: u8 = 2;

/// The worker's side of a request: where its answer goes.
pub(crate) struct Ticket<T> {
    state: Arc<AtomicU8>,
    reply: oneshot::Sender<Result<T, StoreError>>,
}

/// The caller's side of a request: its answer, when it comes.
pub(crate) struct Claim<T> {
    state: Arc<AtomicU8>,
    reply: oneshot::Receiver<Result<T, StoreError>>,
}

/// A request's two sides.
pub(crate) fn ticket<T>() -> (Ticket<T>, Claim<T>) {
    let state = Arc::new(AtomicU8::new(QUEUED));
    let (tx, rx) = oneshot::channel();
    (Ticket { state: Arc::clone(&state), reply: tx }, Claim { state, reply: rx })
}

impl<T> Ticket<T> {
    /// Takes the request to be sent. `false` if its caller has gone (its future was
    /// dropped) or gave up waiting: the worker must then skip it, and nothing is taken.
    pub(crate) fn take(&self) -> bool {
        !self.reply.is_closed()
            && self
                .state
                .compare_exchange(QUEUED, TAKEN, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
    }

    /// Answers the caller (if it still waits).
    pub(crate) fn answer(self, answer: Result<T, StoreError>) {
        let _ = self.reply.send(answer);
    }
}

impl<T> Claim<T> {
    /// The answer. A request still waiting for the worker after `patience` (if any) is
    /// withdrawn (never sent: nothing taken) and fails; one the worker has taken by then is
    /// waited for to the end (the worker bounds its own round trip).
    pub(crate) async fn answer(
        mut self,
        patience: Option<Duration>,
        store: &str,
    ) -> Result<T, StoreError> {
        let Some(patience) = patience else {
            let answer = (&mut self.reply).await;
            return answer.unwrap_or_else(|_| Err(self.lost(store)));
        };
        if let Ok(answer) = tokio::time::timeout(patience, &mut self.reply).await {
            return answer.unwrap_or_else(|_| Err(self.lost(store)));
        }
        if self
            .state
            .compare_exchange(QUEUED, ABANDONED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            return Err(StoreError::new(format!(
                "{store}: no connection was free within {patience:?} (the store is overloaded or \
                 its server slow); nothing was sent"
            ))
            .unavailable());
        }
        let lost =
            StoreError::new(format!("{store}: the store's worker stopped before answering")).sent();
        self.reply.await.unwrap_or(Err(lost))
    }

    /// The error for a request whose worker went away without answering (its runtime shut
    /// down).
    fn lost(&self, store: &str) -> StoreError {
        let error =
            StoreError::new(format!("{store}: the store's worker stopped before answering"));
        if self.state.load(Ordering::Acquire) == TAKEN { error.sent() } else { error }
    }
}

/// A plan with copies of the names and keys it borrows.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) struct OwnedPlan {
    text: Vec<Box<str>>,
    shape: Plan<'static>,
}

#[cfg(any(feature = "sqlite", feature = "postgres"))]
impl OwnedPlan {
    pub(crate) fn new(plan: &Plan<'_>) -> Self {
        let mut text = Vec::new();
        let shape = plan.with_text(|s| {
            text.push(s.into());
            ""
        });
        OwnedPlan { text, shape }
    }

    /// The plan again, borrowing from the copies.
    pub(crate) fn plan(&self) -> Plan<'_> {
        let mut text = self.text.iter();
        self.shape.with_text(|_| text.next().map_or("", |s| s))
    }
}

/// Slots with copies of the names and keys they borrow.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) struct OwnedSlots {
    text: Vec<Box<str>>,
    shape: Vec<Slot<'static>>,
}

#[cfg(any(feature = "sqlite", feature = "postgres"))]
impl OwnedSlots {
    pub(crate) fn new(slots: &[Slot<'_>]) -> Self {
        let mut text = Vec::new();
        let mut copy = |s: &str| -> &'static str {
            text.push(s.into());
            ""
        };
        let shape = slots.iter().map(|slot| slot.with_text(&mut copy)).collect();
        OwnedSlots { text, shape }
    }

    /// The slots again, borrowing from the copies.
    pub(crate) fn slots(&self) -> Vec<Slot<'_>> {
        let mut text = self.text.iter();
        let mut next = |_: &str| text.next().map_or("", |s| &**s);
        self.shape.iter().map(|slot| slot.with_text(&mut next)).collect()
    }
}

/// An operation on the holders of a concurrency limit's (name, key), with copies of the name
/// and key.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) struct OwnedSlotOp {
    pub(crate) name: Box<str>,
    pub(crate) key: Option<Box<str>>,
    pub(crate) limit: Concurrency,
    pub(crate) op: SlotOp,
}

#[cfg(any(feature = "sqlite", feature = "postgres"))]
impl OwnedSlotOp {
    pub(crate) fn new(name: &str, key: Option<&str>, limit: &Concurrency, op: &SlotOp) -> Self {
        OwnedSlotOp { name: name.into(), key: key.map(Into::into), limit: *limit, op: *op }
    }
}

/// A one-take with copies of the name and key it borrows.
#[cfg(feature = "sqlite")]
pub(crate) struct OwnedOne {
    name: Box<str>,
    key: Option<Box<str>>,
    shape: OneTake<'static>,
}

#[cfg(feature = "sqlite")]
impl OwnedOne {
    pub(crate) fn new(take: &OneTake<'_>) -> Self {
        let (name, key) = (take.slot.name.into(), take.slot.key.map(Into::into));
        OwnedOne { name, key, shape: take.with_text(|_| "") }
    }

    /// The take again, borrowing from the copies.
    pub(crate) fn take(&self) -> OneTake<'_> {
        let mut first = true;
        self.shape.with_text(|_| {
            let s: &str = if first { &self.name } else { self.key.as_deref().unwrap_or("") };
            first = false;
            s
        })
    }
}

#[cfg(test)]
mod tests {
    #[cfg(all(feature = "sqlite", feature = "postgres"))]
    use tollgate_algebra::{Config, MINUTE, OneTake, Plan, Slot, Take};

    use super::*;

    #[cfg(all(feature = "sqlite", feature = "postgres"))]
    #[test]
    fn copies_give_back_the_same_requests() {
        let config = Config::token_bucket(10.0, MINUTE).with_shards(4);
        let mut plan = Plan::new(true);
        for (name, key) in [("a", Some("k")), ("b", None), ("a", Some(""))] {
            let take = Take { name, key, config, count: 1.0, reserve: false };
            plan.push(&take, 7, 99).unwrap();
        }
        let owned = OwnedPlan::new(&plan);
        let again = owned.plan();
        let names = |p: &Plan<'_>| -> Vec<(String, Option<String>, u16)> {
            p.slots()
                .iter()
                .map(|s| (s.name.to_owned(), s.key.map(str::to_owned), s.shard))
                .collect()
        };
        assert_eq!(names(&again), names(&plan));
        assert_eq!(again.takes().collect::<Vec<_>>(), plan.takes().collect::<Vec<_>>());
        let slots = OwnedSlots::new(plan.slots());
        assert!(slots.slots().iter().zip(plan.slots()).all(|(a, b)| a.same_state(b)));

        let one = Take {
            name: "one",
            key: Some("key"),
            config: Config::token_bucket(1.0, 1.0),
            count: 2.0,
            reserve: true,
        };
        let one = OneTake::new(&one, 0, true).unwrap();
        let owned = OwnedOne::new(&one);
        let again = owned.take();
        assert!(again.slot.same_state(&one.slot));
        assert_eq!((again.count, again.reserve, again.writes), (2.0, true, true));
        let unkeyed = OneTake { slot: Slot { key: None, ..one.slot }, ..one };
        assert_eq!(OwnedOne::new(&unkeyed).take().slot.key, None);
    }

    #[tokio::test]
    async fn a_request_that_waits_too_long_is_withdrawn_and_never_sent() {
        let (ticket, claim) = super::ticket::<u32>();
        let err = claim.answer(Some(Duration::from_millis(10)), "test").await.unwrap_err();
        assert!(err.message().contains("nothing was sent"), "{err}");
        assert!(!err.may_have_taken());
        assert!(!ticket.take(), "withdrawn: the worker skips it");

        let (ticket, claim) = super::ticket::<u32>();
        assert!(ticket.take());
        let answer = tokio::spawn(claim.answer(Some(Duration::from_millis(10)), "test"));
        tokio::time::sleep(Duration::from_millis(30)).await;
        ticket.answer(Ok(7));
        assert_eq!(answer.await.unwrap().unwrap(), 7, "taken: waited for to the end");

        let (ticket, claim) = super::ticket::<u32>();
        assert!(ticket.take());
        drop(ticket);
        let err = claim.answer(Some(Duration::from_secs(1)), "test").await.unwrap_err();
        assert!(err.may_have_taken(), "taken, then lost: it may have run");

        let (ticket, claim) = super::ticket::<u32>();
        drop(claim);
        assert!(!ticket.take(), "its caller has gone: never sent");
    }
}
