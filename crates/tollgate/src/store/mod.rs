//! Where states live: the [`Store`] trait and its implementations.
//!
//! A store's only job is to load and save (name, key, shard) states atomically for a whole
//! request; `tollgate-core` decides. Each request arrives as a [`Plan`]: the store loads the
//! states of [`Plan::slots`], reads its clock once, calls [`Plan::decide`], and saves the
//! states that the [`Outcome`] marks changed, all within one atomic unit. Because deciding
//! is a pure function of (states, time), a store that loses a race may simply run it again.
//!
//! # How each store does it
//!
//! - **Memory** ([`MemoryStore`]): the slots' segments are locked in a fixed order, so a
//!   transaction over several limits is atomic and cannot deadlock.
//! - **SQLite** ([`SqliteStore`], feature `sqlite`): `BEGIN IMMEDIATE` takes the write lock
//!   up front (no upgrade deadlock), a `SELECT` per slot, `decide`, an upsert (or a delete,
//!   when full) per changed slot, `COMMIT`. [`SqliteTransaction`] runs the same inside the
//!   caller's own transaction.
//! - **PostgreSQL** ([`PgStore`], feature `postgres`): within its own transaction or the
//!   caller's ([`PgTransaction`]), transaction-scoped advisory locks on the slots, in
//!   ascending order, serialize every request touching a slot (even before its row exists),
//!   which is correct under READ COMMITTED; one query then reads the states and the
//!   database's time (`clock_timestamp()`); `decide`; upserts or deletes.
//! - **Redis** ([`RedisStore`], feature `redis`): a Lua script receives the plan (slots,
//!   per-shard configs, counts, reserve flags and the shard choices already made), loads the
//!   states, decides with `TIME` and writes, all in one round trip; it answers with what it
//!   loaded and the time it used, and `tollgate-core` computes the answer from those. Keys
//!   expire when they are full again.
//! - **Redis Cluster** (the same [`RedisStore`] on a `redis+cluster://` URL, feature
//!   `redis-cluster`): as Redis when a request's states share a hash slot; a sharded take
//!   whose two shards are on different nodes runs as atomic one-shard steps
//!   ([`tollgate_core::Plan::split`]); a transaction over several slots is refused.
//!
//! Stores that read their own clock accept a fixed one in tests (for the memory store,
//! [`MemoryStore::with_clock`] and a [`tollgate_core::ManualClock`]).
//!
//! (A store whose feature this build lacks links to the [list of features](crate#features).)
//!
#![cfg_attr(not(feature = "sqlite"), doc = "[`SqliteStore`]: ../index.html#features")]
#![cfg_attr(not(feature = "sqlite"), doc = "[`SqliteTransaction`]: ../index.html#features")]
#![cfg_attr(not(feature = "postgres"), doc = "[`PgStore`]: ../index.html#features")]
#![cfg_attr(not(feature = "postgres"), doc = "[`PgTransaction`]: ../index.html#features")]
#![cfg_attr(not(feature = "redis"), doc = "[`RedisStore`]: ../index.html#features")]

#[cfg(any(feature = "redis", feature = "postgres"))]
mod group;
mod memory;
#[cfg(any(feature = "redis", feature = "postgres"))]
mod pool;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis;
#[cfg(any(
    feature = "sqlite",
    feature = "postgres",
    feature = "sqlx-sqlite",
    feature = "sqlx-postgres"
))]
pub(crate) mod sql;
#[cfg(feature = "sqlite")]
mod sqlite;

pub use memory::{MemoryStore, MemoryStoreBuilder};
#[cfg(feature = "postgres")]
pub use postgres::{PgStore, PgStoreBuilder, PgTransaction};
#[cfg(feature = "redis")]
pub use redis::{RedisStore, RedisStoreBuilder};
#[cfg(feature = "sqlite")]
pub use sqlite::{SqliteStore, SqliteStoreBuilder, SqliteTransaction, Synchronous, create_schema};

use tollgate_core::{OneTake, Outcome, Plan, Slot, State, Taken};

use crate::StoreError;

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
}

/// A store that always fails, like one whose server is down: for testing how an app (or a
/// middleware) behaves when the limiter cannot decide. Every call is a [`StoreError`] with
/// the given message.
///
/// # Examples
///
/// ```
/// use tollgate::store::Unavailable;
/// use tollgate::{Config, Error, RateLimiter, MINUTE};
///
/// let limiter = RateLimiter::new(Unavailable::new("connection refused"));
/// let err = limiter.limit(("send", Config::token_bucket(1.0, MINUTE)), "alice").unwrap_err();
/// assert!(matches!(err, Error::Store(_)));
/// ```
#[derive(Debug, Clone)]
pub struct Unavailable(String);

impl Unavailable {
    /// A store whose every call fails with `message`.
    pub fn new(message: impl Into<String>) -> Self {
        Unavailable(message.into())
    }
}

impl Store for Unavailable {
    fn execute(&self, _: &Plan<'_>) -> Result<Outcome, StoreError> {
        Err(StoreError::new(self.0.clone()))
    }
    fn execute_one(&self, _: &OneTake<'_>) -> Result<Taken, StoreError> {
        Err(StoreError::new(self.0.clone()))
    }
    fn read(&self, _: &[Slot<'_>]) -> Result<(f64, Vec<Option<State>>), StoreError> {
        Err(StoreError::new(self.0.clone()))
    }
    fn delete(&self, _: &str, _: Option<&str>, _: u16) -> Result<(), StoreError> {
        Err(StoreError::new(self.0.clone()))
    }
}

impl<S: Store + ?Sized> Store for std::sync::Arc<S> {
    fn execute(&self, plan: &Plan<'_>) -> Result<Outcome, StoreError> {
        (**self).execute(plan)
    }
    fn execute_one(&self, take: &OneTake<'_>) -> Result<Taken, StoreError> {
        (**self).execute_one(take)
    }
    fn execute_each(&self, takes: &[OneTake<'_>], answers: &mut [Taken]) -> Result<(), StoreError> {
        (**self).execute_each(takes, answers)
    }

    fn read(&self, slots: &[Slot<'_>]) -> Result<(f64, Vec<Option<State>>), StoreError> {
        (**self).read(slots)
    }
    fn delete(&self, name: &str, key: Option<&str>, shards: u16) -> Result<(), StoreError> {
        (**self).delete(name, key, shards)
    }
}

/// What an array of [`Taken`]s holds before a store has written it.
const UNSET: Taken = Taken {
    decision: tollgate_core::Decision { ok: false, retry_after: None },
    status: tollgate_core::Status { remaining: 0.0, reset_after: 0.0 },
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

/// The URL of a backend for a store's own tests, from `var`: `None` (the test returns early)
/// without it, unless `TOLLGATE_REQUIRE_BACKENDS=1`, which makes it a failure.
#[cfg(all(test, any(feature = "redis", feature = "postgres", feature = "sqlx-postgres")))]
pub(crate) fn backend_url(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(url) if !url.is_empty() => Some(url),
        _ if std::env::var("TOLLGATE_REQUIRE_BACKENDS").as_deref() == Ok("1") => {
            panic!("{var} is required by TOLLGATE_REQUIRE_BACKENDS=1")
        }
        _ => None,
    }
}
