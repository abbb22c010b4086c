//! Concurrency limits on a [`RateLimiter`] (SPEC §6f): how many units of work run at once,
//! exact across every process sharing the store. An acquire gets a ticket holding slots
//! until it is released, renewed, or expires (its holder presumed dead).
//!
//! # Examples
//!
//! ```
//! use tollgate::{Acquire, Concurrency, ManualClock, MemoryStore, RateLimiter};
//!
//! let limiter = RateLimiter::builder(MemoryStore::with_clock(ManualClock::new(0.0)))
//!     .define_concurrency("gpu", Concurrency::new(2).with_ttl(30_000.0))
//!     .build();
//! let first = limiter.hold("gpu", "tenant-1").unwrap().expect("a slot is free");
//! let second = limiter.acquire("gpu", "tenant-1").unwrap();
//! assert!(second.ok());
//! // Both slots are held: refused until the earliest holder's expiry (or a release).
//! let third = limiter.acquire("gpu", "tenant-1").unwrap();
//! assert_eq!(third.retry_after(), Some(30_000.0));
//! drop(first); // released on drop
//! assert!(limiter.acquire("gpu", "tenant-1").unwrap().ok());
//! // Several slots at once, and the slots in flight.
//! assert!(!limiter.acquire("gpu", Acquire::new().key("tenant-1").count(2)).unwrap().ok());
//! assert_eq!(limiter.slots_value("gpu", Some("tenant-1")).unwrap().in_flight, 2);
//! ```

use std::sync::Arc;

use tollgate_algebra::slots::{Concurrency, SlotAnswer, SlotOp};
use tollgate_algebra::{Decision, Outcome, validate_name_key};

use crate::error::{Error, StoreError};
use crate::limiter::{Call, RateLimiter, TransactionTaken};
use crate::store::{AsyncStore, Store};

/// Which concurrency limit a call is about: a name defined with
/// [`RateLimiterBuilder::define_concurrency`](crate::RateLimiterBuilder::define_concurrency),
/// or a name with its limit given at the call.
#[derive(Clone, Copy, Debug)]
pub enum SlotsTarget<'a> {
    /// A defined name; [`Error::NotDefined`] otherwise.
    Named(&'a str),
    /// A name and its limit.
    Inline(&'a str, Concurrency),
}

impl<'a> From<&'a str> for SlotsTarget<'a> {
    fn from(name: &'a str) -> Self {
        SlotsTarget::Named(name)
    }
}

impl<'a> From<(&'a str, Concurrency)> for SlotsTarget<'a> {
    fn from((name, limit): (&'a str, Concurrency)) -> Self {
        SlotsTarget::Inline(name, limit)
    }
}

impl<'a> SlotsTarget<'a> {
    fn name(&self) -> &'a str {
        match *self {
            SlotsTarget::Named(name) | SlotsTarget::Inline(name, _) => name,
        }
    }
}

/// The options of an acquire: key, count, ttl, throws.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Acquire<'a> {
    pub(crate) key: Option<&'a str>,
    count: Option<u32>,
    ttl: Option<f64>,
    pub(crate) throws: bool,
}

impl<'a> Acquire<'a> {
    /// One slot of the global (unkeyed) limit, held for the limit's `ttl`.
    pub fn new() -> Self {
        Self::default()
    }

    /// The slots of `key` (a tenant, a user), independent of other keys.
    #[must_use]
    pub fn key(mut self, key: &'a str) -> Self {
        self.key = Some(key);
        self
    }

    /// Takes `count` slots instead of one (at most the limit's `max`, else an error).
    #[must_use]
    pub fn count(mut self, count: u32) -> Self {
        self.count = Some(count);
        self
    }

    /// Holds them `ttl` ms unless released or renewed, instead of the limit's `ttl`.
    #[must_use]
    pub fn ttl(mut self, ttl: f64) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// Turns a refusal into [`Error::RateLimited`].
    #[must_use]
    pub fn throws(mut self) -> Self {
        self.throws = true;
        self
    }

    pub(crate) fn op(&self, limit: &Concurrency) -> SlotOp {
        SlotOp::Acquire { count: self.count.unwrap_or(1), ttl: self.ttl.unwrap_or(limit.ttl()) }
    }
}

impl<'a> From<&'a str> for Acquire<'a> {
    fn from(key: &'a str) -> Self {
        Acquire::new().key(key)
    }
}

/// A granted acquire: the ticket to release or renew, and when its slots are free again
/// unless it is renewed (ms on the store's clock).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Ticket {
    /// The ticket the store made.
    pub id: u64,
    /// When its slots are free again, ms since the epoch on the store's clock.
    pub expires_at: f64,
}

/// The answer to an acquire.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Acquired {
    /// Granted.
    Granted(Ticket),
    /// Refused; nothing was written. Ms until the earliest holder's expiry (a release may
    /// free a slot sooner).
    Refused {
        /// Ms until the earliest holder's expiry.
        retry_after: f64,
    },
}

impl Acquired {
    /// Whether it was granted.
    pub fn ok(&self) -> bool {
        matches!(self, Acquired::Granted(_))
    }

    /// The ticket, if granted.
    pub fn ticket(&self) -> Option<Ticket> {
        match *self {
            Acquired::Granted(ticket) => Some(ticket),
            Acquired::Refused { .. } => None,
        }
    }

    /// The wait, if refused.
    pub fn retry_after(&self) -> Option<f64> {
        match *self {
            Acquired::Granted(_) => None,
            Acquired::Refused { retry_after } => Some(retry_after),
        }
    }
}

/// The answer to an acquire taken together with rate limits
/// ([`RateLimiter::acquire_with`]): the slot and every token, or nothing.
#[derive(Clone, Debug, PartialEq)]
pub struct AcquiredWith {
    /// Whether the slot and every rate limit were granted (and so all were taken).
    pub ok: bool,
    /// The ticket to release (or renew) when the work is done, when `ok`.
    pub ticket: Option<Ticket>,
    /// The wait before trying again, when refused: the largest of the refusals' (the
    /// slots' is until the earliest holder's expiry; a release may come sooner).
    pub retry_after: Option<f64>,
    /// The slot's own answer: granted if one was free, whether taken or not.
    pub slot: Decision,
    /// The rate limits' answers, one per call in order, with what each has left (decided
    /// as a check, nothing taken, when the slots were full).
    pub limits: TransactionTaken,
}

/// What a (name, key) of a concurrency limit holds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SlotsValue {
    /// Slots held now by unexpired holders.
    pub in_flight: u64,
    /// The limit's slots.
    pub max: u32,
    /// Unexpired holders.
    pub holders: u64,
    /// The earliest holder's expiry, if any holds slots.
    pub earliest: Option<f64>,
}

/// A checked call: the limit, its name, the key, the operation.
pub(crate) struct SlotCall<'a> {
    pub(crate) name: &'a str,
    pub(crate) key: Option<&'a str>,
    pub(crate) limit: Concurrency,
    pub(crate) op: SlotOp,
}

impl<S> RateLimiter<S> {
    /// The limit a concurrency call is about: a defined name's, or the one given.
    pub(crate) fn concurrency_of(&self, target: SlotsTarget<'_>) -> Result<Concurrency, Error> {
        match target {
            SlotsTarget::Inline(_, limit) => Ok(limit),
            SlotsTarget::Named(name) => self
                .concurrency_limit(name)
                .ok_or_else(|| Error::NotDefined { name: name.to_string() }),
        }
    }

    pub(crate) fn slot_call<'a>(
        &self,
        target: SlotsTarget<'a>,
        key: Option<&'a str>,
        op: impl FnOnce(&Concurrency) -> SlotOp,
    ) -> Result<SlotCall<'a>, Error> {
        let limit = self.concurrency_of(target)?;
        let name = target.name();
        validate_name_key(name, key)?;
        let op = op(&limit);
        op.validate(&limit)?;
        Ok(SlotCall { name, key, limit, op })
    }

    /// The answer to an acquire with rate limits `calls`, from what the store answered;
    /// an error as a transaction's if a call throws or can never be granted.
    fn acquired_with(
        &self,
        call: &SlotCall<'_>,
        throws: bool,
        calls: &[Call<'_>],
        (answer, outcome): (SlotAnswer, Outcome),
    ) -> Result<AcquiredWith, Error> {
        let limits = TransactionTaken::from(outcome);
        self.check_refused(calls, limits.decision.ok, &limits.decision.results)?;
        let (ticket, slot) = match answer {
            SlotAnswer::Acquired { ticket, expires_at } => {
                (Some(Ticket { id: ticket, expires_at }), Decision::ADMIT)
            }
            SlotAnswer::Free => (None, Decision::ADMIT),
            SlotAnswer::Refused { retry_after } => {
                (None, Decision { ok: false, retry_after: Some(retry_after) })
            }
            other => return Err(unexpected(other)),
        };
        let ok = slot.ok && limits.decision.ok;
        if ok != ticket.is_some() {
            let said = format!("the store answered a slot {slot:?} with rate limits {limits:?}");
            return Err(Error::Store(StoreError::new(said)));
        }
        let retry_after =
            tollgate_algebra::max_option(slot.retry_after, limits.decision.retry_after);
        if !ok && throws {
            let name = call.name.to_string();
            return Err(Error::RateLimited { name, retry_after: retry_after.unwrap_or(0.0) });
        }
        Ok(AcquiredWith { ok, ticket, retry_after, slot, limits })
    }
}

/// A renewal of `ticket` for `ttl` ms, the limit's `ttl` if `None`.
pub(crate) fn renewing(ticket: u64, ttl: Option<f64>) -> impl FnOnce(&Concurrency) -> SlotOp {
    move |limit| SlotOp::Renew { ticket, ttl: ttl.unwrap_or(limit.ttl()) }
}

fn unexpected(answer: SlotAnswer) -> Error {
    Error::Store(StoreError::new(format!("the store answered {answer:?} out of turn")))
}

pub(crate) fn acquired(name: &str, throws: bool, answer: SlotAnswer) -> Result<Acquired, Error> {
    match answer {
        SlotAnswer::Acquired { ticket, expires_at } => {
            Ok(Acquired::Granted(Ticket { id: ticket, expires_at }))
        }
        SlotAnswer::Refused { retry_after } if throws => {
            Err(Error::RateLimited { name: name.to_string(), retry_after })
        }
        SlotAnswer::Refused { retry_after } => Ok(Acquired::Refused { retry_after }),
        other => Err(unexpected(other)),
    }
}

pub(crate) fn released(answer: SlotAnswer) -> Result<bool, Error> {
    match answer {
        SlotAnswer::Released(held) => Ok(held),
        other => Err(unexpected(other)),
    }
}

pub(crate) fn renewed(answer: SlotAnswer) -> Result<Option<f64>, Error> {
    match answer {
        SlotAnswer::Renewed(expiry) => Ok(expiry),
        other => Err(unexpected(other)),
    }
}

fn checked(answer: SlotAnswer) -> Result<Decision, Error> {
    match answer {
        SlotAnswer::Free => Ok(Decision { ok: true, retry_after: None }),
        SlotAnswer::Refused { retry_after } => {
            Ok(Decision { ok: false, retry_after: Some(retry_after) })
        }
        other => Err(unexpected(other)),
    }
}

fn valued(limit: &Concurrency, answer: SlotAnswer) -> Result<SlotsValue, Error> {
    match answer {
        SlotAnswer::Value { in_flight, holders, earliest } => {
            Ok(SlotsValue { in_flight, max: limit.max(), holders, earliest })
        }
        other => Err(unexpected(other)),
    }
}

fn was_reset(answer: SlotAnswer) -> Result<(), Error> {
    match answer {
        SlotAnswer::Reset => Ok(()),
        other => Err(unexpected(other)),
    }
}

/// Concurrency limits, synchronous: for the memory store, SQLite, and a caller's own SQL
/// transaction (in an async program use the `*_async` calls).
impl<S: Store> RateLimiter<S> {
    fn run_slots(&self, call: &SlotCall<'_>) -> Result<SlotAnswer, Error> {
        Ok(self.store().slots(call.name, call.key, &call.limit, &call.op)?)
    }

    /// Takes slots of a concurrency limit: a [`Ticket`] to release (or renew) when the work
    /// is done, or a refusal with the wait until the earliest holder's expiry.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] (a count of 0 or over the limit's `max`, a bad `ttl`, name or key)
    /// or [`Error::NotDefined`]; [`Error::Store`] if the store fails; [`Error::RateLimited`]
    /// for a refusal when the request [`throws`](Acquire::throws). Nothing is held when an
    /// error is returned.
    pub fn acquire<'n, 'k>(
        &self,
        target: impl Into<SlotsTarget<'n>>,
        request: impl Into<Acquire<'k>>,
    ) -> Result<Acquired, Error> {
        let request = request.into();
        let call = self.slot_call(target.into(), request.key, |l| request.op(l))?;
        acquired(call.name, request.throws, self.run_slots(&call)?)
    }

    /// Takes slots of a concurrency limit and tokens of rate limits together, all or
    /// nothing (SPEC §6f): the work gets its slot and every token, or holds none of them,
    /// not even for a moment. `calls` are as a [`transaction`](RateLimiter::transaction)'s.
    /// When the slots are full, the rate limits are decided as a check (nothing taken), so
    /// the answer still says what each would have answered.
    ///
    /// ```
    /// use tollgate::{Acquire, Call, Concurrency, Config, ManualClock, MemoryStore, RateLimiter, Request, MINUTE};
    ///
    /// let limiter = RateLimiter::builder(MemoryStore::with_clock(ManualClock::new(0.0)))
    ///     .define_concurrency("llmInFlight", Concurrency::new(4))
    ///     .define("llmTokens", Config::token_bucket(10_000.0, MINUTE))
    ///     .build();
    /// let budget = [Call::new("llmTokens", Request::new().key("acme").count(8_000.0))];
    /// let first = limiter.acquire_with("llmInFlight", "acme", &budget).unwrap();
    /// assert!(first.ok);
    /// // The tokens are refused: no slot is held for it.
    /// let second = limiter.acquire_with("llmInFlight", "acme", &budget).unwrap();
    /// assert!(!second.ok && second.slot.ok && second.ticket.is_none());
    /// assert_eq!(limiter.slots_value("llmInFlight", Some("acme")).unwrap().in_flight, 1);
    /// ```
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::acquire`] and [`RateLimiter::transaction`] (a call invalid or
    /// never granted, a name not defined); [`Error::Store`] also for a store that cannot
    /// take them together (every store of this crate can; on Redis Cluster the slots and
    /// the rate limits' states must share a hash slot: give the key a hash tag, such as
    /// `{user42}`; on Redis a calendar window is not taken with a slot). Nothing is taken
    /// when an error is returned. [`Error::RateLimited`] for a refusal when the acquire
    /// [`throws`](Acquire::throws), naming the concurrency limit.
    pub fn acquire_with<'n, 'k>(
        &self,
        target: impl Into<SlotsTarget<'n>>,
        request: impl Into<Acquire<'k>>,
        calls: &[Call<'_>],
    ) -> Result<AcquiredWith, Error> {
        let request = request.into();
        let call = self.slot_call(target.into(), request.key, |l| request.op(l))?;
        let plan = self.plan(true, calls.iter().map(|c| (c.target, c.request)))?;
        let answered = self.store().slots_with(call.name, call.key, &call.limit, &call.op, &plan);
        self.acquired_with(&call, request.throws, calls, answered?)
    }

    /// [`RateLimiter::acquire`], answered with a guard that releases the slots when it is
    /// dropped (`None` when refused).
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::acquire`].
    pub fn hold<'n, 'k>(
        &self,
        target: impl Into<SlotsTarget<'n>>,
        request: impl Into<Acquire<'k>>,
    ) -> Result<Option<Held<'_, S>>, Error> {
        let target = target.into();
        let request = request.into();
        let Some(ticket) = self.acquire(target, request)?.ticket() else { return Ok(None) };
        let limit = self.concurrency_of(target)?;
        Ok(Some(Held {
            limiter: self,
            name: target.name().to_string(),
            key: request.key.map(str::to_string),
            limit,
            ticket,
            released: false,
        }))
    }

    /// Frees a ticket's slots: `true`, or `false` for a ticket unknown or expired (never an
    /// error: a release may race its expiry).
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] or [`Error::NotDefined`]; [`Error::Store`] if the store fails.
    pub fn release<'n>(
        &self,
        target: impl Into<SlotsTarget<'n>>,
        key: Option<&str>,
        ticket: u64,
    ) -> Result<bool, Error> {
        let call = self.slot_call(target.into(), key, |_| SlotOp::Release { ticket })?;
        released(self.run_slots(&call)?)
    }

    /// Moves a ticket's expiry to now + `ttl` (the limit's `ttl` if `None`), for a long
    /// task: the new expiry, or `None` when the ticket had expired (its slots may be someone
    /// else's now: stop the work, or acquire again).
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] or [`Error::NotDefined`]; [`Error::Store`] if the store fails.
    pub fn renew<'n>(
        &self,
        target: impl Into<SlotsTarget<'n>>,
        key: Option<&str>,
        ticket: u64,
        ttl: Option<f64>,
    ) -> Result<Option<f64>, Error> {
        let call = self.slot_call(target.into(), key, renewing(ticket, ttl))?;
        renewed(self.run_slots(&call)?)
    }

    /// Whether an acquire would be granted now; holds nothing.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::acquire`], but a refusal is never an error.
    pub fn check_slots<'n, 'k>(
        &self,
        target: impl Into<SlotsTarget<'n>>,
        request: impl Into<Acquire<'k>>,
    ) -> Result<Decision, Error> {
        let request = request.into();
        let count = request.count.unwrap_or(1);
        let call = self.slot_call(target.into(), request.key, |_| SlotOp::Check { count })?;
        checked(self.run_slots(&call)?)
    }

    /// How many slots are held, and by how many holders.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] or [`Error::NotDefined`]; [`Error::Store`] if the store fails.
    pub fn slots_value<'n>(
        &self,
        target: impl Into<SlotsTarget<'n>>,
        key: Option<&str>,
    ) -> Result<SlotsValue, Error> {
        let call = self.slot_call(target.into(), key, |_| SlotOp::Value)?;
        valued(&call.limit, self.run_slots(&call)?)
    }

    /// Frees every slot of (name, key).
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] or [`Error::NotDefined`]; [`Error::Store`] if the store fails.
    pub fn reset_slots<'n>(
        &self,
        target: impl Into<SlotsTarget<'n>>,
        key: Option<&str>,
    ) -> Result<(), Error> {
        let call = self.slot_call(target.into(), key, |_| SlotOp::Reset)?;
        was_reset(self.run_slots(&call)?)
    }
}

/// Concurrency limits, awaited: every store. The futures are `Send`.
impl<S: AsyncStore> RateLimiter<S> {
    async fn run_slots_async(&self, call: &SlotCall<'_>) -> Result<SlotAnswer, Error> {
        Ok(self.store().slots_async(call.name, call.key, &call.limit, &call.op).await?)
    }

    /// [`RateLimiter::acquire`], awaited.
    ///
    /// A future dropped while the store is answering may leave its slots held, unknown to
    /// the caller, until their expiry (`ttl`): keep the `ttl` near the work's length.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::acquire`].
    pub async fn acquire_async<'n, 'k>(
        &self,
        target: impl Into<SlotsTarget<'n>>,
        request: impl Into<Acquire<'k>>,
    ) -> Result<Acquired, Error> {
        let request = request.into();
        let call = self.slot_call(target.into(), request.key, |l| request.op(l))?;
        acquired(call.name, request.throws, self.run_slots_async(&call).await?)
    }

    /// [`RateLimiter::acquire_with`], awaited.
    ///
    /// A future dropped while the store is answering may leave its slot held and its
    /// tokens taken, unknown to the caller (the slot until its expiry).
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::acquire_with`].
    pub async fn acquire_with_async<'n, 'k>(
        &self,
        target: impl Into<SlotsTarget<'n>>,
        request: impl Into<Acquire<'k>>,
        calls: &[Call<'_>],
    ) -> Result<AcquiredWith, Error> {
        let request = request.into();
        let call = self.slot_call(target.into(), request.key, |l| request.op(l))?;
        let plan = self.plan(true, calls.iter().map(|c| (c.target, c.request)))?;
        let store = self.store();
        let answered = store.slots_with_async(call.name, call.key, &call.limit, &call.op, &plan);
        self.acquired_with(&call, request.throws, calls, answered.await?)
    }

    /// [`RateLimiter::acquire_async`], answered with a guard that releases the slots when it
    /// is dropped (`None` when refused): on a task of the current tokio runtime, or at once
    /// on an in-process store. Prefer [`HeldAsync::release`], which says whether it did.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::acquire`].
    pub async fn hold_async<'n, 'k>(
        self: &Arc<Self>,
        target: impl Into<SlotsTarget<'n>>,
        request: impl Into<Acquire<'k>>,
    ) -> Result<Option<HeldAsync<S>>, Error>
    where
        S: 'static,
    {
        let target = target.into();
        let request = request.into();
        let limit = self.concurrency_of(target)?;
        let Some(ticket) = self.acquire_async(target, request).await?.ticket() else {
            return Ok(None);
        };
        // No await from here: a future cancelled now has the guard, which releases.
        Ok(Some(HeldAsync {
            limiter: Some(Arc::clone(self)),
            name: target.name().into(),
            key: request.key.map(Into::into),
            limit,
            ticket,
        }))
    }

    /// [`RateLimiter::release`], awaited.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::release`].
    pub async fn release_async<'n>(
        &self,
        target: impl Into<SlotsTarget<'n>>,
        key: Option<&str>,
        ticket: u64,
    ) -> Result<bool, Error> {
        let call = self.slot_call(target.into(), key, |_| SlotOp::Release { ticket })?;
        released(self.run_slots_async(&call).await?)
    }

    /// [`RateLimiter::renew`], awaited.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::renew`].
    pub async fn renew_async<'n>(
        &self,
        target: impl Into<SlotsTarget<'n>>,
        key: Option<&str>,
        ticket: u64,
        ttl: Option<f64>,
    ) -> Result<Option<f64>, Error> {
        let call = self.slot_call(target.into(), key, renewing(ticket, ttl))?;
        renewed(self.run_slots_async(&call).await?)
    }

    /// [`RateLimiter::check_slots`], awaited.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::check_slots`].
    pub async fn check_slots_async<'n, 'k>(
        &self,
        target: impl Into<SlotsTarget<'n>>,
        request: impl Into<Acquire<'k>>,
    ) -> Result<Decision, Error> {
        let request = request.into();
        let count = request.count.unwrap_or(1);
        let call = self.slot_call(target.into(), request.key, |_| SlotOp::Check { count })?;
        checked(self.run_slots_async(&call).await?)
    }

    /// [`RateLimiter::slots_value`], awaited.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::slots_value`].
    pub async fn slots_value_async<'n>(
        &self,
        target: impl Into<SlotsTarget<'n>>,
        key: Option<&str>,
    ) -> Result<SlotsValue, Error> {
        let call = self.slot_call(target.into(), key, |_| SlotOp::Value)?;
        valued(&call.limit, self.run_slots_async(&call).await?)
    }

    /// [`RateLimiter::reset_slots`], awaited.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::reset_slots`].
    pub async fn reset_slots_async<'n>(
        &self,
        target: impl Into<SlotsTarget<'n>>,
        key: Option<&str>,
    ) -> Result<(), Error> {
        let call = self.slot_call(target.into(), key, |_| SlotOp::Reset)?;
        was_reset(self.run_slots_async(&call).await?)
    }
}

/// Slots held, released when dropped ([`RateLimiter::hold`]); a store error on that
/// release is dropped too (the slots are free at their expiry anyway).
#[must_use = "the slots are released when this is dropped"]
pub struct Held<'l, S: Store> {
    limiter: &'l RateLimiter<S>,
    name: String,
    key: Option<String>,
    limit: Concurrency,
    ticket: Ticket,
    released: bool,
}

impl<S: Store> Held<'_, S> {
    /// The ticket.
    pub fn ticket(&self) -> Ticket {
        self.ticket
    }

    /// Moves the expiry to now + `ttl` (the limit's `ttl` if `None`); `None` if the ticket
    /// had expired.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] if the store fails.
    pub fn renew(&mut self, ttl: Option<f64>) -> Result<Option<f64>, Error> {
        let target = SlotsTarget::Inline(&self.name, self.limit);
        let expiry = self.limiter.renew(target, self.key.as_deref(), self.ticket.id, ttl)?;
        if let Some(expires_at) = expiry {
            self.ticket.expires_at = expires_at;
        }
        Ok(expiry)
    }

    /// Releases now: whether the ticket still held its slots.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] if the store fails (the slots are free at their expiry anyway).
    pub fn release(mut self) -> Result<bool, Error> {
        self.released = true;
        let target = SlotsTarget::Inline(&self.name, self.limit);
        self.limiter.release(target, self.key.as_deref(), self.ticket.id)
    }
}

impl<S: Store> Drop for Held<'_, S> {
    fn drop(&mut self) {
        if !self.released {
            let target = SlotsTarget::Inline(&self.name, self.limit);
            let _ = self.limiter.release(target, self.key.as_deref(), self.ticket.id);
        }
    }
}

/// Slots held, released when dropped ([`RateLimiter::hold_async`]).
#[must_use = "the slots are released when this is dropped"]
pub struct HeldAsync<S: AsyncStore + 'static> {
    limiter: Option<Arc<RateLimiter<S>>>,
    name: Box<str>,
    key: Option<Box<str>>,
    limit: Concurrency,
    ticket: Ticket,
}

impl<S: AsyncStore + 'static> HeldAsync<S> {
    /// The guard of `ticket`, granted by an acquire of `name` and `key` (for callers that
    /// need the refusal's wait, which [`RateLimiter::hold_async`] does not give).
    pub(crate) fn new(
        limiter: Arc<RateLimiter<S>>,
        name: &str,
        key: Option<&str>,
        limit: Concurrency,
        ticket: Ticket,
    ) -> Self {
        HeldAsync {
            limiter: Some(limiter),
            name: name.into(),
            key: key.map(Into::into),
            limit,
            ticket,
        }
    }

    /// The ticket.
    pub fn ticket(&self) -> Ticket {
        self.ticket
    }

    /// Moves the expiry to now + `ttl` (the limit's `ttl` if `None`); `None` if the ticket
    /// had expired.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] if the store fails.
    pub async fn renew(&mut self, ttl: Option<f64>) -> Result<Option<f64>, Error> {
        let Some(limiter) = &self.limiter else { return Ok(None) };
        let target = SlotsTarget::Inline(&self.name, self.limit);
        let expiry = limiter.renew_async(target, self.key.as_deref(), self.ticket.id, ttl).await?;
        if let Some(expires_at) = expiry {
            self.ticket.expires_at = expires_at;
        }
        Ok(expiry)
    }

    /// Releases now: whether the ticket still held its slots.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] if the store fails (the slots are free at their expiry anyway).
    pub async fn release(mut self) -> Result<bool, Error> {
        let Some(limiter) = self.limiter.take() else { return Ok(false) };
        let target = SlotsTarget::Inline(&self.name, self.limit);
        limiter.release_async(target, self.key.as_deref(), self.ticket.id).await
    }
}

impl<S: AsyncStore + 'static> Drop for HeldAsync<S> {
    fn drop(&mut self) {
        let Some(limiter) = self.limiter.take() else { return };
        let (name, key, limit, id) =
            (self.name.clone(), self.key.clone(), self.limit, self.ticket.id);
        match limiter.store().immediate() {
            Some(store) => {
                let op = SlotOp::Release { ticket: id };
                let _ = store.slots(&name, key.as_deref(), &limit, &op);
            }
            None => release_later(limiter, name, key, limit, id),
        }
    }
}

/// Releases a dropped guard's ticket on a task of the current tokio runtime, if there is
/// one; else its slots are free at their expiry.
#[cfg(any(feature = "redis", feature = "postgres", feature = "sqlite"))]
fn release_later<S: AsyncStore + 'static>(
    limiter: Arc<RateLimiter<S>>,
    name: Box<str>,
    key: Option<Box<str>>,
    limit: Concurrency,
    id: u64,
) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move {
            let target = SlotsTarget::Inline(&name, limit);
            let _ = limiter.release_async(target, key.as_deref(), id).await;
        });
    }
}

/// Without tokio (no networked store is built in), a dropped guard of a store that waits
/// leaves its slots to their expiry.
#[cfg(not(any(feature = "redis", feature = "postgres", feature = "sqlite")))]
fn release_later<S: AsyncStore + 'static>(
    _: Arc<RateLimiter<S>>,
    _: Box<str>,
    _: Option<Box<str>>,
    _: Concurrency,
    _: u64,
) {
}
