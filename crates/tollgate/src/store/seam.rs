//! The seam between the limiter and a store: [`Store`], called on the caller's thread, and
//! [`AsyncStore`], awaited (object-safe: `Arc<dyn AsyncStore>` holds a store picked at run
//! time), and what the stores share to implement them.
//!
//! One piece beside the two traits is hidden from store authors: `AsyncStore::on_immediate`
//! and the `OnImmediate` it takes, through which the limiter's async calls reach an
//! in-process store with its own type rather than as the `&dyn Store` that
//! [`AsyncStore::immediate`] hands out. Through `&dyn Store` the memory store's fast paths
//! (a take's status never worked out for `limit`, a transaction's takes unrolled and
//! inlined) stop at the call: measured with criterion against the seam of an associated
//! `Immediate` type, interleaved, the async transaction of three took 136-148 ns against
//! 121-127 ns (1.12x) and the async `limit` 46-49 ns against 42-44 ns; with `on_immediate`
//! both are as before (callgrind: 1,527 instructions a transaction against 1,525, 383 a
//! take against 383). A store behind a `dyn AsyncStore` (the server's) takes the `&dyn
//! Store` path, which still builds no future.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use tollgate_algebra::slots::{Concurrency, SlotAnswer, SlotOp};
use tollgate_algebra::{OneTake, Outcome, Plan, Slot, State, Taken};

use crate::error::StoreError;

/// Loads and saves limit states atomically per request.
///
/// Implementations must make [`Store::execute`] atomic: no other request may change the
/// plan's slots between the load and the save, or limits over-admit.
///
/// A store shared between threads is `Send + Sync` (the memory and SQLite stores are); a
/// store over a borrowed transaction need not be.
pub trait Store {
    /// Loads the plan's slots, decides at the store's current time, and saves the changed
    /// states, atomically. States that are full again by then may be dropped instead.
    ///
    /// # Errors
    ///
    /// A [`StoreError`] if the states cannot be loaded or saved; nothing is admitted.
    fn execute(&self, plan: &Plan<'_>) -> Result<Outcome, StoreError>;

    /// One take from an unsharded limit, atomically: load the slot, [`OneTake::decide`],
    /// save. The default builds a [`Plan`]; a store may serve this common request directly.
    ///
    /// # Errors
    ///
    /// A [`StoreError`] if the state cannot be loaded or saved; nothing is admitted.
    fn execute_one(&self, take: &OneTake<'_>) -> Result<Taken, StoreError> {
        self.execute(&take.to_plan())
            .map(|outcome| Taken { decision: outcome.decision(), status: outcome.statuses[0] })
    }

    /// A transaction of one-takes (each from an unsharded limit), all or nothing: the same
    /// answers as [`Plan::of_one_takes`] executed, written to `answers` (one per take, in
    /// order). The default executes that plan; the memory store decides takes of distinct
    /// states one by one, without a plan's bookkeeping.
    ///
    /// # Errors
    ///
    /// A [`StoreError`] if the states cannot be loaded or saved; nothing is admitted.
    ///
    /// # Panics
    ///
    /// If `answers` is shorter than `takes`.
    fn execute_each(&self, takes: &[OneTake<'_>], answers: &mut [Taken]) -> Result<(), StoreError> {
        each_through_plan(self, takes, answers)
    }

    /// [`Store::execute_each`] of exactly `N` takes, the count known to the compiler, keeping
    /// what `answer` picks of each take's result (as [`Store::execute_one_then`] does).
    /// `statuses` says whether `answer` keeps the statuses; when it does not, a store may
    /// hand it results whose statuses were not worked out (not to be read). The default calls
    /// [`Store::execute_each`]; the memory store unrolls its loops over the takes and applies
    /// `answer` before a result leaves it, so that what the caller drops (the statuses, for
    /// `transaction`) is never worked out, and a refused transaction does not find its states
    /// again for statuses that nobody reads.
    ///
    /// # Errors
    ///
    /// As for [`Store::execute_each`].
    #[inline(always)]
    fn execute_each_of<const N: usize, T>(
        &self,
        takes: &[OneTake<'_>; N],
        answers: &mut [T; N],
        answer: impl Fn(Taken) -> T,
        statuses: bool,
    ) -> Result<(), StoreError>
    where
        Self: Sized,
    {
        let _ = statuses; // every take's status is worked out here
        let mut taken = [UNSET; N];
        self.execute_each(takes, &mut taken)?;
        for (a, t) in answers.iter_mut().zip(taken) {
            *a = answer(t);
        }
        Ok(())
    }

    /// [`Store::execute_one`], keeping only what `answer` picks of the result. The default
    /// maps the result; an in-process store may apply `answer` before its result leaves the
    /// store, so that what the caller drops (the status, for `limit`) is never worked out.
    ///
    /// # Errors
    ///
    /// As for [`Store::execute_one`].
    #[inline(always)]
    fn execute_one_then<T>(
        &self,
        take: &OneTake<'_>,
        answer: impl FnOnce(Taken) -> T,
    ) -> Result<T, StoreError>
    where
        Self: Sized,
    {
        self.execute_one(take).map(answer)
    }

    /// Reads the states of `slots` without changing them; returns the store's time too.
    ///
    /// # Errors
    ///
    /// A [`StoreError`] if the states cannot be read.
    fn read(&self, slots: &[Slot<'_>]) -> Result<(f64, Vec<Option<State>>), StoreError>;

    /// Deletes the states of every shard of (name, key).
    ///
    /// # Errors
    ///
    /// A [`StoreError`] if the states cannot be deleted.
    fn delete(&self, name: &str, key: Option<&str>, shards: u16) -> Result<(), StoreError>;

    /// An operation on (name, key) of a concurrency limit (SPEC §6f), atomically: loads its
    /// holders, answers with [`tollgate_algebra::slots::decide`] at the store's time, makes
    /// the new holder's ticket, and writes what it says. The limiter has checked `op`
    /// against `limit`. The default is an error: a store holds concurrency limits only if it
    /// says so (every store of this crate does).
    ///
    /// # Errors
    ///
    /// A [`StoreError`] if the holders cannot be loaded or saved; nothing is acquired.
    fn slots(
        &self,
        name: &str,
        key: Option<&str>,
        limit: &Concurrency,
        op: &SlotOp,
    ) -> Result<SlotAnswer, StoreError> {
        let _ = (name, key, limit, op);
        Err(no_slots())
    }

    /// An acquire of (name, key) of a concurrency limit and the takes of `plan`, all or
    /// nothing (SPEC §6f): the holder is added and the plan's states written only if both
    /// are granted, atomically with every other operation on them. Answers the plan's
    /// outcome and what the acquire answered:
    /// - [`SlotAnswer::Acquired`]: both granted, both written;
    /// - [`SlotAnswer::Refused`]: the slots are full; the plan was decided as a check
    ///   ([`Plan::checking`](tollgate_algebra::Plan::checking)), nothing written;
    /// - [`SlotAnswer::Free`]: a slot was free but the plan was refused; nothing written.
    ///
    /// `op` is an acquire the limiter has checked against `limit`. The default is an error.
    ///
    /// # Errors
    ///
    /// A [`StoreError`] if anything cannot be loaded or saved; nothing is written.
    fn slots_with(
        &self,
        name: &str,
        key: Option<&str>,
        limit: &Concurrency,
        op: &SlotOp,
        plan: &Plan<'_>,
    ) -> Result<(SlotAnswer, Outcome), StoreError> {
        let _ = (name, key, limit, op, plan);
        Err(no_slots_with())
    }
}

/// What a store that holds no concurrency limits answers.
pub(crate) fn no_slots() -> StoreError {
    StoreError::new("this store holds no concurrency limits")
}

/// What a store that cannot take a slot and rate limits together answers.
pub(crate) fn no_slots_with() -> StoreError {
    StoreError::new("this store cannot take a concurrency slot and rate limits in one transaction")
}

/// An answer of [`Store::slots_with`] from a holder's decision and the plan's outcome:
/// [`SlotAnswer::Acquired`] stands only if the plan was granted too (else `Free`).
pub(crate) fn slots_with_answer(answer: SlotAnswer, outcome: &Outcome) -> SlotAnswer {
    match answer {
        SlotAnswer::Acquired { .. } if !outcome.ok => SlotAnswer::Free,
        answer => answer,
    }
}

/// Loads and saves limit states atomically per request, awaited: the seam of every store
/// that waits on a network or a disk (Redis, PostgreSQL, SQLite), and of the memory store
/// too, so that one async API (`RateLimiter::limit_async` and its kin) serves them all.
///
/// The methods are those of [`Store`] without its in-process fast paths: a round trip to a
/// server costs far more than the bookkeeping those save. Each returns a boxed future, so
/// that the trait is object-safe: an `Arc<dyn AsyncStore>` (or a `Box`) holds a store picked
/// at run time, and is an `AsyncStore` itself. The box is one allocation per call, nothing
/// beside a round trip.
///
/// A store that answers in-process without waiting (the memory store) hands out its
/// synchronous form from [`AsyncStore::immediate`]; the limiter's async calls then answer
/// through that at once, on the calling thread, exactly as its sync calls do, and never
/// build a future for the store (nor box one, behind a `dyn AsyncStore` too).
///
/// The futures are `Send`, so they can be awaited in any task of a multi-threaded runtime
/// (axum handlers, tonic services). Implementations must never block the thread that polls
/// them: I/O is awaited, or done on a thread of the store's own.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use tollgate::{AsyncStore, Config, MemoryStore, RateLimiter, MINUTE};
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let limiter = RateLimiter::new(MemoryStore::new()); // every store has the async API
/// let send = ("send", Config::token_bucket(10.0, MINUTE));
/// assert!(limiter.limit_async(send, "alice").await.unwrap().ok);
///
/// // A store picked at run time.
/// let store: Arc<dyn AsyncStore> = Arc::new(MemoryStore::new());
/// let limiter = RateLimiter::new(store);
/// assert!(limiter.limit_async(send, "alice").await.unwrap().ok);
/// # });
/// ```
pub trait AsyncStore: Send + Sync {
    /// The store as a synchronous [`Store`], if it answers in-process without waiting: the
    /// limiter's async calls then run its sync path through it. `None` (the default) for a
    /// store that waits on I/O.
    fn immediate(&self) -> Option<&dyn Store> {
        None
    }

    /// `visit` on `immediate`, what [`AsyncStore::immediate`] handed out, or on the store
    /// itself with its own type where it is known: the limiter's async calls on an in-process
    /// store then compile to its sync path exactly, inlined. Not for store authors (the
    /// default, on `immediate`, is right for every store): tollgate's in-process stores
    /// override it (see the module's doc for why it exists).
    #[doc(hidden)]
    #[inline(always)]
    fn on_immediate<V: OnImmediate>(&self, immediate: &dyn Store, visit: V) -> V::Output
    where
        Self: Sized,
    {
        visit.on(&immediate)
    }

    /// Loads the plan's slots, decides at the store's current time, and saves the changed
    /// states, atomically (as [`Store::execute`]).
    ///
    /// # Errors
    ///
    /// A [`StoreError`] if the states cannot be loaded or saved; nothing is admitted, unless
    /// the error says that the request may have been applied (a reply that timed out).
    fn execute_async<'a>(&'a self, plan: &'a Plan<'_>) -> BoxFuture<'a, Outcome>;

    /// One take from an unsharded limit, atomically (as [`Store::execute_one`]). The default
    /// executes [`OneTake::to_plan`]; a store may serve this common request directly.
    ///
    /// # Errors
    ///
    /// As for [`AsyncStore::execute_async`].
    fn execute_one_async<'a>(&'a self, take: &'a OneTake<'_>) -> BoxFuture<'a, Taken> {
        Box::pin(async move {
            let outcome = self.execute_async(&take.to_plan()).await?;
            Ok(Taken { decision: outcome.decision(), status: outcome.statuses[0] })
        })
    }

    /// Reads the states of `slots` without changing them; returns the store's time too.
    ///
    /// # Errors
    ///
    /// A [`StoreError`] if the states cannot be read.
    fn read_async<'a>(&'a self, slots: &'a [Slot<'_>]) -> BoxFuture<'a, (f64, Vec<Option<State>>)>;

    /// Deletes the states of every shard of (name, key).
    ///
    /// # Errors
    ///
    /// A [`StoreError`] if the states cannot be deleted.
    fn delete_async<'a>(
        &'a self,
        name: &'a str,
        key: Option<&'a str>,
        shards: u16,
    ) -> BoxFuture<'a, ()>;

    /// An operation on (name, key) of a concurrency limit, atomically (as [`Store::slots`]).
    /// The default answers through [`AsyncStore::immediate`], or is an error for a store
    /// that has none.
    ///
    /// # Errors
    ///
    /// As for [`Store::slots`]; an acquire whose reply timed out may have been granted (its
    /// slots are free again at its expiry).
    fn slots_async<'a>(
        &'a self,
        name: &'a str,
        key: Option<&'a str>,
        limit: &'a Concurrency,
        op: &'a SlotOp,
    ) -> BoxFuture<'a, SlotAnswer> {
        let answer = match self.immediate() {
            Some(store) => store.slots(name, key, limit, op),
            None => Err(no_slots()),
        };
        Box::pin(std::future::ready(answer))
    }

    /// An acquire and the takes of `plan`, all or nothing (as [`Store::slots_with`]). The
    /// default answers through [`AsyncStore::immediate`], or is an error for a store that
    /// has none.
    ///
    /// # Errors
    ///
    /// As for [`Store::slots_with`]; one whose reply timed out may have been granted (the
    /// slots are free again at their expiry, the tokens are spent).
    fn slots_with_async<'a>(
        &'a self,
        name: &'a str,
        key: Option<&'a str>,
        limit: &'a Concurrency,
        op: &'a SlotOp,
        plan: &'a Plan<'_>,
    ) -> BoxFuture<'a, (SlotAnswer, Outcome)> {
        let answer = match self.immediate() {
            Some(store) => store.slots_with(name, key, limit, op, plan),
            None => Err(no_slots_with()),
        };
        Box::pin(std::future::ready(answer))
    }
}

/// What the limiter runs on an in-process store's sync path (see
/// [`AsyncStore::on_immediate`]): generic over the store's type, which a closure cannot be.
#[doc(hidden)]
pub trait OnImmediate: Sized {
    /// What it answers.
    type Output;
    /// Runs on `store`.
    fn on<S: Store>(self, store: &S) -> Self::Output;
}

/// The future of an [`AsyncStore`] call: boxed, `Send`, answering a [`StoreError`] or `T`.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// An [`AsyncStore`] behind a pointer (`Arc<S>`, `Box<S>`, `S` a `dyn AsyncStore` too) is one.
macro_rules! forward_async_store {
    ($($pointer:ident),*) => {$(
        impl<S: AsyncStore + ?Sized> AsyncStore for $pointer<S> {
            #[inline(always)]
            fn immediate(&self) -> Option<&dyn Store> {
                (**self).immediate()
            }
            fn execute_async<'a>(&'a self, plan: &'a Plan<'_>) -> BoxFuture<'a, Outcome> {
                (**self).execute_async(plan)
            }
            fn execute_one_async<'a>(&'a self, take: &'a OneTake<'_>) -> BoxFuture<'a, Taken> {
                (**self).execute_one_async(take)
            }
            fn read_async<'a>(
                &'a self,
                slots: &'a [Slot<'_>],
            ) -> BoxFuture<'a, (f64, Vec<Option<State>>)> {
                (**self).read_async(slots)
            }
            fn delete_async<'a>(
                &'a self,
                name: &'a str,
                key: Option<&'a str>,
                shards: u16,
            ) -> BoxFuture<'a, ()> {
                (**self).delete_async(name, key, shards)
            }
            fn slots_async<'a>(
                &'a self,
                name: &'a str,
                key: Option<&'a str>,
                limit: &'a Concurrency,
                op: &'a SlotOp,
            ) -> BoxFuture<'a, SlotAnswer> {
                (**self).slots_async(name, key, limit, op)
            }
            fn slots_with_async<'a>(
                &'a self,
                name: &'a str,
                key: Option<&'a str>,
                limit: &'a Concurrency,
                op: &'a SlotOp,
                plan: &'a Plan<'_>,
            ) -> BoxFuture<'a, (SlotAnswer, Outcome)> {
                (**self).slots_with_async(name, key, limit, op, plan)
            }
        }
    )*};
}
forward_async_store!(Arc, Box);

/// A store that answers in-process, as an [`AsyncStore`]: its async calls answer at once,
/// through its sync ones, and the limiter's async calls take its sync path directly.
macro_rules! immediate_async_store {
    ($(impl$([$($generics:tt)*])? for $store:ty;)*) => {$(
        impl$(<$($generics)*>)? $crate::store::seam::AsyncStore for $store {
            #[inline(always)]
            fn immediate(&self) -> Option<&dyn $crate::store::seam::Store> {
                Some(self)
            }
            #[inline(always)]
            fn on_immediate<V: $crate::store::seam::OnImmediate>(
                &self,
                _: &dyn $crate::store::seam::Store,
                visit: V,
            ) -> V::Output {
                visit.on(self)
            }
            fn execute_async<'a>(
                &'a self,
                plan: &'a tollgate_algebra::Plan<'_>,
            ) -> $crate::store::seam::BoxFuture<'a, tollgate_algebra::Outcome> {
                Box::pin(std::future::ready($crate::store::seam::Store::execute(self, plan)))
            }
            fn execute_one_async<'a>(
                &'a self,
                take: &'a tollgate_algebra::OneTake<'_>,
            ) -> $crate::store::seam::BoxFuture<'a, tollgate_algebra::Taken> {
                Box::pin(std::future::ready($crate::store::seam::Store::execute_one(self, take)))
            }
            fn read_async<'a>(
                &'a self,
                slots: &'a [tollgate_algebra::Slot<'_>],
            ) -> $crate::store::seam::BoxFuture<'a, (f64, Vec<Option<tollgate_algebra::State>>)> {
                Box::pin(std::future::ready($crate::store::seam::Store::read(self, slots)))
            }
            fn delete_async<'a>(
                &'a self,
                name: &'a str,
                key: Option<&'a str>,
                shards: u16,
            ) -> $crate::store::seam::BoxFuture<'a, ()> {
                Box::pin(std::future::ready($crate::store::seam::Store::delete(self, name, key, shards)))
            }
            fn slots_async<'a>(
                &'a self,
                name: &'a str,
                key: Option<&'a str>,
                limit: &'a tollgate_algebra::slots::Concurrency,
                op: &'a tollgate_algebra::slots::SlotOp,
            ) -> $crate::store::seam::BoxFuture<'a, tollgate_algebra::slots::SlotAnswer> {
                Box::pin(std::future::ready($crate::store::seam::Store::slots(self, name, key, limit, op)))
            }
            fn slots_with_async<'a>(
                &'a self,
                name: &'a str,
                key: Option<&'a str>,
                limit: &'a tollgate_algebra::slots::Concurrency,
                op: &'a tollgate_algebra::slots::SlotOp,
                plan: &'a tollgate_algebra::Plan<'_>,
            ) -> $crate::store::seam::BoxFuture<'a, (tollgate_algebra::slots::SlotAnswer, tollgate_algebra::Outcome)> {
                Box::pin(std::future::ready($crate::store::seam::Store::slots_with(self, name, key, limit, op, plan)))
            }
        }
    )*};
}
pub(crate) use immediate_async_store;

/// A store behind a pointer is one: a borrowed one (the limiter's async calls run the sync
/// path on what [`AsyncStore::immediate`] hands out, a `&dyn Store`, for a store behind a
/// `dyn AsyncStore`, whose type is not known), or a shared one.
macro_rules! forward_store {
    ($($pointer:ty),*) => {$(
        impl<S: Store + ?Sized> Store for $pointer {
            #[inline(always)]
            fn execute(&self, plan: &Plan<'_>) -> Result<Outcome, StoreError> {
                (**self).execute(plan)
            }
            #[inline(always)]
            fn execute_one(&self, take: &OneTake<'_>) -> Result<Taken, StoreError> {
                (**self).execute_one(take)
            }
            #[inline(always)]
            fn execute_each(
                &self,
                takes: &[OneTake<'_>],
                answers: &mut [Taken],
            ) -> Result<(), StoreError> {
                (**self).execute_each(takes, answers)
            }
            #[inline(always)]
            fn read(&self, slots: &[Slot<'_>]) -> Result<(f64, Vec<Option<State>>), StoreError> {
                (**self).read(slots)
            }
            #[inline(always)]
            fn delete(&self, name: &str, key: Option<&str>, shards: u16) -> Result<(), StoreError> {
                (**self).delete(name, key, shards)
            }
            #[inline(always)]
            fn slots(
                &self,
                name: &str,
                key: Option<&str>,
                limit: &Concurrency,
                op: &SlotOp,
            ) -> Result<SlotAnswer, StoreError> {
                (**self).slots(name, key, limit, op)
            }
            #[inline(always)]
            fn slots_with(
                &self,
                name: &str,
                key: Option<&str>,
                limit: &Concurrency,
                op: &SlotOp,
                plan: &Plan<'_>,
            ) -> Result<(SlotAnswer, Outcome), StoreError> {
                (**self).slots_with(name, key, limit, op, plan)
            }
        }
    )*};
}
forward_store!(&S, Arc<S>);

/// What a store's one-take function or script answers for a take: the time it used,
/// whether it wrote, and the state it loaded (from which `tollgate-algebra` decides).
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) type OneAnswer = (f64, bool, Option<State>);

/// What an array of [`Taken`]s holds before a store has written it.
pub(crate) const UNSET: Taken = Taken {
    decision: tollgate_algebra::Decision { ok: false, retry_after: None },
    status: tollgate_algebra::Status { remaining: 0.0, reset_after: 0.0 },
};

/// [`Store::execute_each`] through the plan of the takes.
pub(crate) fn each_through_plan<S: Store + ?Sized>(
    store: &S,
    takes: &[OneTake<'_>],
    answers: &mut [Taken],
) -> Result<(), StoreError> {
    let outcome = store.execute(&Plan::of_one_takes(takes))?;
    let each = outcome.results.iter().zip(&outcome.statuses);
    for (answer, (&decision, &status)) in answers[..takes.len()].iter_mut().zip(each) {
        *answer = Taken { decision, status };
    }
    Ok(())
}
