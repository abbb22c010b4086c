//! [`RateLimiter`]: the operations of SPEC §4 over any [`Store`].

use std::cell::Cell;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use foldhash::fast::RandomState;
use hashbrown::HashMap;
use smallvec::SmallVec;
use tollgate_algebra::{
    Adjusted, Carry, Config, Decision, Inline, OneTake, Outcome, Plan, Reading, Sample, Slot,
    Status, Take, Taken, alignment, carry_counts, carrying, read, splitmix64, unit_interval,
};

use tollgate_algebra::slots::Concurrency;

use crate::error::Error;
use crate::store::{AsyncStore, MemoryStore, OnImmediate, Store};

/// A set of limits declared once, in a type of your own, so that a misspelled name does not
/// compile.
///
/// # Examples
///
/// ```
/// use tollgate::{Config, Limits, ManualClock, MemoryStore, RateLimiter, Request, HOUR, MINUTE};
///
/// #[derive(Clone, Copy)]
/// enum Limit {
///     SendMessage,
///     FreeTrialSignUp,
/// }
///
/// impl Limits for Limit {
///     fn name(self) -> &'static str {
///         match self {
///             Limit::SendMessage => "sendMessage",
///             Limit::FreeTrialSignUp => "freeTrialSignUp",
///         }
///     }
///     fn config(self) -> Config {
///         match self {
///             // Checked at compile time: an invalid constant does not build.
///             Limit::SendMessage => const { Config::token_bucket(10.0, MINUTE).with_capacity(3.0) },
///             Limit::FreeTrialSignUp => const { Config::fixed_window(100.0, HOUR) },
///         }
///     }
/// }
///
/// // A stopped clock makes the numbers exact; use MemoryStore::new() for the real one.
/// let limiter = RateLimiter::new(MemoryStore::with_clock(ManualClock::new(0.0)));
/// for _ in 0..3 {
///     assert!(limiter.limit(Limit::SendMessage, Request::new().key("alice")).unwrap().ok);
/// }
/// let refused = limiter.limit(Limit::SendMessage, Request::new().key("alice")).unwrap();
/// assert!(!refused.ok);
/// assert_eq!(refused.retry_after, Some(6_000.0)); // one token flows back every 6 s
/// // Other keys are independent.
/// assert!(limiter.limit(Limit::SendMessage, Request::new().key("bob")).unwrap().ok);
/// ```
pub trait Limits: Copy {
    /// The limit's name, as stored.
    fn name(self) -> &'static str;
    /// The limit's config.
    fn config(self) -> Config;
}

/// Which limit a call is about: a typed limit, an inline `(name, config)`, or a name defined
/// on the limiter at run time.
#[derive(Clone, Copy, Debug)]
pub enum Target<'a> {
    /// A name defined with [`RateLimiterBuilder::define`]; [`Error::NotDefined`] otherwise.
    Named(&'a str),
    /// A name with its config given at the call.
    Inline(&'a str, Config),
}

impl<L: Limits> From<L> for Target<'static> {
    fn from(limit: L) -> Self {
        Target::Inline(limit.name(), limit.config())
    }
}

impl<'a> From<&'a str> for Target<'a> {
    fn from(name: &'a str) -> Self {
        Target::Named(name)
    }
}

impl<'a> From<(&'a str, Config)> for Target<'a> {
    fn from((name, config): (&'a str, Config)) -> Self {
        Target::Inline(name, config)
    }
}

impl<'a> Target<'a> {
    /// Pairs the target with a request, for [`RateLimiter::transaction`].
    pub fn with<'c, 'k: 'c>(self, request: impl Into<Request<'k>>) -> Call<'c>
    where
        'a: 'c,
    {
        Call { target: self, request: request.into() }
    }

    pub(crate) fn name(&self) -> &'a str {
        match *self {
            Target::Named(name) | Target::Inline(name, _) => name,
        }
    }
}

/// The options of one request: key, count, reserve, throws.
///
/// # Examples
///
/// ```
/// use tollgate::Request;
///
/// let request = Request::new().key("alice").count(3.0).reserve();
/// assert_eq!(request, Request::from("alice").count(3.0).reserve());
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Request<'a> {
    key: Option<&'a str>,
    count: f64,
    reserve: bool,
    pub(crate) throws: bool,
}

impl Default for Request<'_> {
    fn default() -> Self {
        Request { key: None, count: 1.0, reserve: false, throws: false }
    }
}

impl<'a> Request<'a> {
    /// One token from the global (unkeyed) value of the limit.
    pub fn new() -> Self {
        Self::default()
    }

    /// Uses the value of `key` (a user, a team, an IP), independent of other keys.
    #[must_use]
    pub fn key(mut self, key: &'a str) -> Self {
        self.key = Some(key);
        self
    }

    /// Asks for `count` tokens instead of one.
    #[must_use]
    pub fn count(mut self, count: f64) -> Self {
        self.count = count;
        self
    }

    /// Books a shortfall ahead instead of refusing: the answer is ok with a `retry_after`
    /// to wait before doing the work (up to the config's `max_reserved`).
    #[must_use]
    pub fn reserve(mut self) -> Self {
        self.reserve = true;
        self
    }

    /// Turns a refusal into [`Error::RateLimited`] (a granted reservation is not an error).
    #[must_use]
    pub fn throws(mut self) -> Self {
        self.throws = true;
        self
    }
}

impl<'a> Request<'a> {
    /// What this request takes from the limit `name` with `config`.
    #[inline(always)]
    fn take(&self, name: &'a str, config: Config) -> Take<'a> {
        Take { name, key: self.key, config, count: self.count, reserve: self.reserve }
    }
}

impl<'a> From<&'a str> for Request<'a> {
    fn from(key: &'a str) -> Self {
        Request::new().key(key)
    }
}

/// One limit of a [`RateLimiter::transaction`]: a target and its request.
#[derive(Clone, Copy, Debug)]
pub struct Call<'a> {
    pub(crate) target: Target<'a>,
    pub(crate) request: Request<'a>,
}

impl<'a> Call<'a> {
    /// A call of `target` with `request`.
    pub fn new<'n: 'a, 'k: 'a>(
        target: impl Into<Target<'n>>,
        request: impl Into<Request<'k>>,
    ) -> Self {
        Call { target: target.into(), request: request.into() }
    }
}

impl From<tollgate_algebra::Outcome> for TransactionTaken {
    fn from(outcome: tollgate_algebra::Outcome) -> Self {
        TransactionTaken {
            decision: TransactionDecision {
                ok: outcome.ok,
                retry_after: outcome.retry_after,
                results: outcome.results,
            },
            statuses: outcome.statuses,
        }
    }
}

/// The answer to a transaction: all granted, or nothing written.
#[derive(Clone, Debug, PartialEq)]
pub struct TransactionDecision {
    /// Whether every limit granted its tokens (and so all were taken).
    pub ok: bool,
    /// The largest wait among the results.
    pub retry_after: Option<f64>,
    /// One decision per call, in order (held inline up to four calls: no allocation).
    pub results: Inline<Decision>,
}

/// The answer to a transaction with what each limit has left
/// ([`RateLimiter::transaction_with_status`]).
#[derive(Clone, Debug, PartialEq)]
pub struct TransactionTaken {
    /// Granted or refused, and the waits.
    pub decision: TransactionDecision,
    /// Per call, what its limit has left afterwards (after the transaction if it was
    /// granted, as it stands if not).
    pub statuses: Inline<Status>,
}

/// What a transaction keeps of each take: its decision ([`RateLimiter::transaction`]), or
/// its decision and status ([`RateLimiter::transaction_with_status`]). Chosen before the
/// take leaves the store, so that a status that is not asked for is never worked out (a
/// division per take).
trait Answer: Copy {
    /// The answer to the whole transaction.
    type Transaction;
    /// What an array of answers holds before the store has written it.
    const UNSET: Self;
    /// Whether the answer keeps the take's status.
    const STATUSES: bool;
    fn of(taken: Taken) -> Self;
    fn decision(&self) -> Decision;
    fn from_taken(taken: TransactionTaken) -> Self::Transaction;
    fn transaction<const N: usize>(
        decision: TransactionDecision,
        answers: &[Self; N],
    ) -> Self::Transaction;
}

impl Answer for Decision {
    type Transaction = TransactionDecision;
    const UNSET: Self = Decision { ok: false, retry_after: None };
    const STATUSES: bool = false;
    #[inline(always)]
    fn of(taken: Taken) -> Self {
        taken.decision
    }
    #[inline(always)]
    fn decision(&self) -> Decision {
        *self
    }
    fn from_taken(taken: TransactionTaken) -> TransactionDecision {
        taken.decision
    }
    #[inline(always)]
    fn transaction<const N: usize>(
        decision: TransactionDecision,
        _: &[Self; N],
    ) -> Self::Transaction {
        decision
    }
}

impl Answer for Taken {
    type Transaction = TransactionTaken;
    const UNSET: Self = Taken {
        decision: Decision { ok: false, retry_after: None },
        status: Status { remaining: 0.0, reset_after: 0.0 },
    };
    const STATUSES: bool = true;
    #[inline(always)]
    fn of(taken: Taken) -> Self {
        taken
    }
    #[inline(always)]
    fn decision(&self) -> Decision {
        self.decision
    }
    fn from_taken(taken: TransactionTaken) -> TransactionTaken {
        taken
    }
    #[inline(always)]
    fn transaction<const N: usize>(
        decision: TransactionDecision,
        answers: &[Self; N],
    ) -> TransactionTaken {
        let mut statuses = [Self::UNSET.status; 4];
        for (status, taken) in statuses.iter_mut().zip(answers) {
            *status = taken.status;
        }
        TransactionTaken { decision, statuses: Inline::from_buf_and_len(statuses, N) }
    }
}

/// Application-layer rate limiting over a [`Store`] (SPEC §4).
///
/// Cheap to share: wrap it in an `Arc`, or keep it in a `static` with `LazyLock`. Every
/// method takes `&self`.
///
/// # Examples
///
/// Inline configs with string names, for limits that are only known at run time:
///
/// ```
/// use tollgate::{MemoryStore, RateLimiter, Request};
/// use tollgate::{Config, SECOND};
///
/// let limiter = RateLimiter::builder(MemoryStore::new())
///     .define("search", Config::token_bucket(5.0, SECOND))
///     .build();
/// assert!(limiter.limit("search", Request::new().key("alice")).unwrap().ok);
/// // Or at the call site:
/// let once_a_second = Config::fixed_window(1.0, SECOND);
/// assert!(limiter.limit(("export", once_a_second), Request::new()).unwrap().ok);
/// // An undefined name without a config is an error, not a refusal:
/// assert!(limiter.limit("serch", Request::new()).is_err());
/// ```
pub struct RateLimiter<S = MemoryStore> {
    store: S,
    setup: Arc<Setup>,
}

/// What a limiter knows besides its store, shared by [`RateLimiter::on`].
struct Setup {
    defined: HashMap<Box<str>, Config, RandomState>,
    /// Concurrency limits defined at run time ([`RateLimiterBuilder::define_concurrency`]).
    concurrency: HashMap<Box<str>, Concurrency, RandomState>,
    seed: u64,
    draws: Option<AtomicU64>,
    /// Names that are granted when the store fails ([`RateLimiterBuilder::fail_open`]).
    fail_open: Vec<Box<str>>,
    /// How many requests were granted that way.
    failed_open: AtomicU64,
}

/// Options for a [`RateLimiter`].
pub struct RateLimiterBuilder<S> {
    store: S,
    defined: HashMap<Box<str>, Config, RandomState>,
    concurrency: HashMap<Box<str>, Concurrency, RandomState>,
    seed: Option<u64>,
    fail_open: Vec<Box<str>>,
}

impl<S> RateLimiterBuilder<S> {
    /// Defines a named limit, to be used by name ([`Target::Named`]).
    #[must_use]
    pub fn define(mut self, name: impl Into<Box<str>>, config: Config) -> Self {
        self.defined.insert(name.into(), config);
        self
    }

    /// Defines a named concurrency limit, to be used by name with
    /// [`RateLimiter::acquire`] and its kin.
    #[must_use]
    pub fn define_concurrency(mut self, name: impl Into<Box<str>>, limit: Concurrency) -> Self {
        self.concurrency.insert(name.into(), limit);
        self
    }

    /// Fixes every random choice (fixed-window alignments, shard choices, jitter is not
    /// affected) so that runs repeat exactly; for the simulator and tests.
    ///
    /// Without a seed, shard choices come from a per-thread generator, and fixed-window
    /// alignments from seed 0, so that every process sharing a store agrees on them.
    #[must_use]
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Makes the limit `name` fail open: when the store fails (down, slow, answering
    /// garbage), a `limit` or `check` of it is granted instead of returning
    /// [`Error::Store`], with [`Status::UNKNOWN`] for its status (no RateLimit header
    /// fields are written for it), and
    /// [`RateLimiter::failed_open`] counts it. A transaction fails open only if every one
    /// of its limits does.
    ///
    /// The trade: the app keeps serving while the store is down, at the price of no limit
    /// at all on `name` while it is. Choose it for limits that protect capacity (where an
    /// outage of the limiter should not become an outage of the app), not for limits that
    /// protect money or abuse (sign-ups, paid API calls, log-in attempts), which should fail
    /// closed, as every limit does by default. Invalid requests are errors either way.
    ///
    /// # Examples
    ///
    /// ```
    /// use tollgate::store::Unavailable;
    /// use tollgate::{Config, RateLimiter, MINUTE};
    ///
    /// let limiter = RateLimiter::builder(Unavailable::new("connection refused"))
    ///     .fail_open("search")
    ///     .build();
    /// let search = ("search", Config::token_bucket(100.0, MINUTE));
    /// let signup = ("signup", Config::token_bucket(3.0, MINUTE));
    /// assert!(limiter.limit(search, "alice").unwrap().ok);
    /// assert!(limiter.limit(signup, "alice").is_err(), "fails closed");
    /// assert_eq!(limiter.failed_open(), 1);
    /// // Nothing is known of the limit meanwhile: no header fields are written for it.
    /// let taken = limiter.limit_with_status(search, "alice").unwrap();
    /// assert!(taken.decision.ok && !taken.status.is_known());
    /// ```
    #[must_use]
    pub fn fail_open(mut self, name: impl Into<Box<str>>) -> Self {
        self.fail_open.push(name.into());
        self
    }

    /// Builds the limiter.
    pub fn build(self) -> RateLimiter<S> {
        let setup = Setup {
            defined: self.defined,
            concurrency: self.concurrency,
            seed: self.seed.unwrap_or(0),
            draws: self.seed.map(AtomicU64::new),
            fail_open: self.fail_open,
            failed_open: AtomicU64::new(0),
        };
        RateLimiter { store: self.store, setup: Arc::new(setup) }
    }
}

impl<S> RateLimiter<S> {
    /// A limiter over `store` with no names defined (use typed [`Limits`] or inline configs).
    pub fn new(store: S) -> Self {
        Self::builder(store).build()
    }

    /// Options: names defined at run time, a seed.
    pub fn builder(store: S) -> RateLimiterBuilder<S> {
        RateLimiterBuilder {
            store,
            defined: HashMap::default(),
            concurrency: HashMap::default(),
            seed: None,
            fail_open: Vec::new(),
        }
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The same limiter (its defined names and seed) over another store: for example the
    /// caller's own database transaction, so that the tokens are spent or given back with
    /// it. Cheap: the definitions are shared, not copied.
    pub fn on<T>(&self, store: T) -> RateLimiter<T> {
        RateLimiter { store, setup: Arc::clone(&self.setup) }
    }

    /// The config of a name defined at run time, if it is.
    pub fn defined_config(&self, name: &str) -> Option<Config> {
        self.setup.defined.get(name).copied()
    }

    /// How many requests were granted because the store failed and their limits
    /// [fail open](RateLimiterBuilder::fail_open): watch it, since while it grows those
    /// limits do not limit.
    pub fn failed_open(&self) -> u64 {
        self.setup.failed_open.load(Ordering::Relaxed)
    }

    /// Whether every limit of `names` fails open; if so, counts the request.
    #[cold]
    fn fails_open<'n>(&self, mut names: impl Iterator<Item = &'n str>) -> bool {
        let open = names.all(|name| self.setup.fail_open.iter().any(|n| **n == *name));
        if open {
            self.setup.failed_open.fetch_add(1, Ordering::Relaxed);
        }
        open
    }

    /// The names defined at run time, with their configs.
    pub fn defined(&self) -> impl Iterator<Item = (&str, &Config)> {
        self.setup.defined.iter().map(|(name, config)| (&**name, config))
    }

    /// The concurrency limit defined as `name`, if it is.
    pub fn concurrency_limit(&self, name: &str) -> Option<Concurrency> {
        self.setup.concurrency.get(name).copied()
    }

    /// The concurrency limits defined at run time.
    pub fn defined_concurrency(&self) -> impl Iterator<Item = (&str, &Concurrency)> {
        self.setup.concurrency.iter().map(|(name, limit)| (&**name, limit))
    }
}

/// The synchronous API: for the in-process memory store, SQLite, and a caller's own SQL
/// transaction. Each call returns when the store has answered; on the memory store that is
/// at once, on SQLite after its transaction has committed (on the calling thread: in an
/// async program use the `*_async` calls, which never block a runtime thread).
impl<S: Store> RateLimiter<S> {
    /// Takes tokens: `ok` and, when refused or reserved, how long to wait.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] or [`Error::NotDefined`] for a request that can never succeed;
    /// [`Error::Store`] if the store fails; [`Error::RateLimited`] for a refusal when the
    /// request [`throws`](Request::throws). Nothing is consumed when an error is returned.
    pub fn limit<'n, 'k>(
        &self,
        target: impl Into<Target<'n>>,
        request: impl Into<Request<'k>>,
    ) -> Result<Decision, Error> {
        self.single(&self.store, true, target.into(), request.into(), |t| t.decision)
    }

    /// Like [`RateLimiter::limit`], but never takes anything: would it be granted now?
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::limit`].
    pub fn check<'n, 'k>(
        &self,
        target: impl Into<Target<'n>>,
        request: impl Into<Request<'k>>,
    ) -> Result<Decision, Error> {
        self.single(&self.store, false, target.into(), request.into(), |t| t.decision)
    }

    /// Like [`RateLimiter::limit`], with what the limit has left afterwards (for the IETF
    /// RateLimit header fields, or a dashboard).
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::limit`].
    ///
    /// # Examples
    ///
    /// ```
    /// use tollgate::{Config, ManualClock, MemoryStore, RateLimiter, MINUTE};
    ///
    /// let limiter = RateLimiter::new(MemoryStore::with_clock(ManualClock::new(0.0)));
    /// let limit = ("send", Config::token_bucket(10.0, MINUTE).with_capacity(3.0));
    /// limiter.limit(limit, "alice").unwrap();
    /// let taken = limiter.limit_with_status(limit, "alice").unwrap();
    /// assert_eq!(taken.status.remaining, 1.0);
    /// assert_eq!(taken.status.reset_after, 12_000.0); // two tokens at one per 6 s
    /// ```
    pub fn limit_with_status<'n, 'k>(
        &self,
        target: impl Into<Target<'n>>,
        request: impl Into<Request<'k>>,
    ) -> Result<Taken, Error> {
        self.single(&self.store, true, target.into(), request.into(), |t| t)
    }

    /// Like [`RateLimiter::check`], with what the limit has left.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::limit`].
    pub fn check_with_status<'n, 'k>(
        &self,
        target: impl Into<Target<'n>>,
        request: impl Into<Request<'k>>,
    ) -> Result<Taken, Error> {
        self.single(&self.store, false, target.into(), request.into(), |t| t)
    }

    /// Takes tokens from several limits at once, all or nothing: if any is refused (or
    /// invalid), nothing is taken from any. `retry_after` is the largest wait.
    ///
    /// Two calls to the same limit and key add up. What each limit has left is not worked
    /// out: ask [`RateLimiter::transaction_with_status`] for it.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::limit`]; with `throws` on any call, a refusal is
    /// [`Error::RateLimited`] naming the call with the longest wait.
    ///
    /// # Examples
    ///
    /// ```
    /// use tollgate::{MemoryStore, RateLimiter, Target};
    /// use tollgate::{Config, MINUTE};
    ///
    /// let limiter = RateLimiter::new(MemoryStore::new());
    /// let per_user = Target::Inline("perUser", Config::token_bucket(10.0, MINUTE));
    /// let global = Target::Inline("global", Config::token_bucket(3.0, MINUTE));
    /// let t = limiter.transaction(&[per_user.with("alice"), global.with(tollgate::Request::new().count(4.0).reserve())]).unwrap();
    /// assert!(t.ok);
    /// assert_eq!(t.retry_after, Some(20_000.0)); // the global limit booked one token ahead
    /// ```
    pub fn transaction(&self, calls: &[Call<'_>]) -> Result<TransactionDecision, Error> {
        self.transaction_answering::<S, Decision>(&self.store, calls)
    }

    /// Like [`RateLimiter::transaction`], with what each limit has left afterwards (for the
    /// IETF RateLimit header fields, or a dashboard).
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::transaction`].
    ///
    /// # Examples
    ///
    /// ```
    /// use tollgate::{Config, ManualClock, MemoryStore, RateLimiter, Request, Target, MINUTE};
    ///
    /// let limiter = RateLimiter::new(MemoryStore::with_clock(ManualClock::new(0.0)));
    /// let per_user = Target::Inline("perUser", Config::token_bucket(10.0, MINUTE));
    /// let global = Target::Inline("global", Config::token_bucket(100.0, MINUTE));
    /// let calls = [per_user.with("alice"), global.with(Request::new())];
    /// let t = limiter.transaction_with_status(&calls).unwrap();
    /// assert!(t.decision.ok);
    /// assert_eq!(t.statuses[0].remaining, 9.0);
    /// assert_eq!(t.statuses[1].remaining, 99.0);
    /// ```
    pub fn transaction_with_status(&self, calls: &[Call<'_>]) -> Result<TransactionTaken, Error> {
        self.transaction_answering::<S, Taken>(&self.store, calls)
    }

    /// Forgets the state of (name, key) in every shard of its config: the next request
    /// starts fresh.
    ///
    /// # Errors
    ///
    /// [`Error::NotDefined`] for an unknown name; [`Error::Store`] if the store fails.
    pub fn reset<'a>(&self, target: impl Into<Target<'a>>, key: Option<&str>) -> Result<(), Error> {
        let (name, shards) = self.to_reset(target.into(), key)?;
        Ok(self.store.delete(name, key, shards)?)
    }

    /// Forgets the state of (name, key) in every shard there can be (1024), whatever config
    /// made them: needs no config, and works for a name that is not defined (a server's
    /// `reset` of a limit its clients sent inline configs for, or one whose shards changed).
    /// More work than [`RateLimiter::reset`] for the stores that delete shard by shard
    /// (memory, Redis): a lookup or a key per shard.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] for a name or key out of bounds; [`Error::Store`] if the store fails.
    pub fn forget(&self, name: &str, key: Option<&str>) -> Result<(), Error> {
        tollgate_algebra::validate_name_key(name, key)?;
        Ok(self.store.delete(name, key, tollgate_algebra::MAX_SHARDS)?)
    }

    /// Carries the states of (name, key) stored under `old` over to `new`, a config that
    /// replaces it (a new release of the app, a server's reload): afterwards the key reads
    /// under `new` as SPEC §2 says, and holds no more than `old` gave it (see
    /// [`tollgate_algebra::Carry`] and [`tollgate_algebra::carry_counts`]). Returns how many states
    /// it rewrote.
    ///
    /// Needed when the kind or the number of shards changes (else the stored numbers would be
    /// misread, and the shards a layout adds would read as full), and on a store that drops
    /// full states (memory, SQLite, Redis) when the rate, period or capacity changes (else a
    /// state would be dropped when it is full under `old`, while still short of full under
    /// `new`). It only takes tokens, never gives any back, so it may run while requests are
    /// served, and run again. A store's `keys_of` lists the keys to carry.
    ///
    /// # Examples
    ///
    /// ```
    /// use tollgate::{Config, MemoryStore, RateLimiter, HOUR};
    ///
    /// let limiter = RateLimiter::new(MemoryStore::new());
    /// let old = Config::token_bucket(100.0, HOUR);
    /// for _ in 0..100 {
    ///     assert!(limiter.limit(("api", old), "alice").unwrap().ok);
    /// }
    /// // Now spread over ten shards: the nine new ones would read as full.
    /// let new = old.with_shards(10);
    /// assert_eq!(limiter.carry("api", Some("alice"), &old, &new).unwrap(), 10);
    /// assert!(!limiter.check(("api", new), "alice").unwrap().ok);
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] for a name or key out of bounds; [`Error::Store`] if the store
    /// fails (the states carried before it stay carried).
    pub fn carry(
        &self,
        name: &str,
        key: Option<&str>,
        old: &Config,
        new: &Config,
    ) -> Result<usize, Error> {
        let Some(slots) = self.carry_slots(name, key, old, new)? else { return Ok(0) };
        let (now, states) = self.store.read(&slots)?;
        let mut carried = 0;
        for take in carrying_takes(old, new, &slots, &states, now) {
            self.store.execute_one(&take)?;
            carried += 1;
        }
        Ok(carried)
    }

    /// Settles a cost known only after the work (SPEC §4, `adjust`): `count`, signed, is what
    /// the work used beyond (+) or below (-) what was taken for it. Never refused: the limit's
    /// value may go negative (a debt that delays the next requests; [`Adjusted::retry_after`]
    /// says until when) and is never raised above its capacity (what does not fit is
    /// dropped). The pattern: take (or reserve) an estimate, do the work, settle the
    /// difference. With shards, a positive count is taken from the fuller of two sampled
    /// shards, a negative one given to the emptier.
    ///
    /// A store failure is an error even for a limit that fails open: nothing was settled.
    ///
    /// # Errors
    ///
    /// [`Error::NotDefined`] for an unknown name; [`Error::Invalid`] for a bad key or a count
    /// that is not finite; [`Error::Store`] if the store fails.
    ///
    /// # Examples
    ///
    /// ```
    /// use tollgate::{Config, ManualClock, MemoryStore, RateLimiter, Request, MINUTE};
    ///
    /// let limiter = RateLimiter::new(MemoryStore::with_clock(ManualClock::new(0.0)));
    /// let tokens = ("llmTokens", Config::token_bucket(1_000.0, MINUTE)); // 1000 a minute
    /// // Take the estimate before the call...
    /// assert!(limiter.limit(tokens, Request::new().key("alice").count(300.0)).unwrap().ok);
    /// // ...which used 450: settle the other 150.
    /// let settled = limiter.adjust(tokens, Some("alice"), 150.0).unwrap();
    /// assert_eq!(settled.value, 550.0);
    /// // A call that used 100 of its 300 gives 200 back.
    /// assert!(limiter.limit(tokens, Request::new().key("alice").count(300.0)).unwrap().ok);
    /// assert_eq!(limiter.adjust(tokens, Some("alice"), -200.0).unwrap().value, 450.0);
    /// ```
    pub fn adjust<'a>(
        &self,
        target: impl Into<Target<'a>>,
        key: Option<&'a str>,
        count: f64,
    ) -> Result<Adjusted, Error> {
        let plan = self.adjust_plan(target.into(), key, count)?;
        adjusted(self.store.execute(&plan)?)
    }

    /// The value of (name, key): one shard's stored state, or for a sharded limit the total
    /// estimated from one sampled shard. See [`RateLimiter::value_sampled`].
    ///
    /// # Errors
    ///
    /// [`Error::NotDefined`] for an unknown name; [`Error::Store`] if the store fails.
    pub fn value<'a>(
        &self,
        target: impl Into<Target<'a>>,
        key: Option<&str>,
    ) -> Result<Reading, Error> {
        self.value_sampled(target, key, 1)
    }

    /// The value of (name, key) (SPEC §4, `value`).
    ///
    /// For an unsharded limit: its stored state (`capacity` at ts 0 if none) and its config
    /// with every default filled in (a fixed window's `start` set to its alignment), so a
    /// client can run [`tollgate_algebra::evaluate`] itself. For a sharded limit: the total
    /// estimated from `sample_shards` sampled shards brought to the current time, and the
    /// fullest sampled shard.
    ///
    /// # Errors
    ///
    /// [`Error::NotDefined`] for an unknown name; [`Error::Store`] if the store fails.
    pub fn value_sampled<'a>(
        &self,
        target: impl Into<Target<'a>>,
        key: Option<&str>,
        sample_shards: u16,
    ) -> Result<Reading, Error> {
        let (config, slots) = self.to_read(target.into(), key, sample_shards)?;
        let (now, states) = self.store.read(&slots)?;
        Ok(reading(&config, &slots, now, states))
    }
}

/// The async API: for every store, and the one to use in an async program. On a store that
/// waits on I/O (Redis, PostgreSQL, SQLite) each call awaits it and never blocks the thread
/// that polls it; on the memory store each answers as its sync twin does, at once.
///
/// # Examples
///
/// ```
/// use tollgate::{Config, MemoryStore, RateLimiter, Request, MINUTE};
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let limiter = RateLimiter::new(MemoryStore::new()); // or RedisStore, PgStore, SqliteStore
/// let send = ("send", Config::token_bucket(10.0, MINUTE).with_capacity(3.0));
/// for _ in 0..3 {
///     assert!(limiter.limit_async(send, "alice").await.unwrap().ok);
/// }
/// let refused = limiter.limit_async(send, "alice").await.unwrap();
/// assert!(!refused.ok && refused.retry_after.is_some());
/// # });
/// ```
impl<S: AsyncStore> RateLimiter<S> {
    /// [`RateLimiter::limit`], awaited.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::limit`]. A store whose reply timed out may have taken the
    /// tokens: its [`Error::Store`] says so (see [`crate::error::StoreError::may_have_taken`]).
    pub async fn limit_async<'n, 'k>(
        &self,
        target: impl Into<Target<'n>>,
        request: impl Into<Request<'k>>,
    ) -> Result<Decision, Error> {
        self.one_async(true, target.into(), request.into(), |t| t.decision).await
    }

    /// [`RateLimiter::check`], awaited.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::limit`].
    pub async fn check_async<'n, 'k>(
        &self,
        target: impl Into<Target<'n>>,
        request: impl Into<Request<'k>>,
    ) -> Result<Decision, Error> {
        self.one_async(false, target.into(), request.into(), |t| t.decision).await
    }

    /// [`RateLimiter::limit_with_status`], awaited.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::limit_async`].
    pub async fn limit_with_status_async<'n, 'k>(
        &self,
        target: impl Into<Target<'n>>,
        request: impl Into<Request<'k>>,
    ) -> Result<Taken, Error> {
        self.one_async(true, target.into(), request.into(), |t| t).await
    }

    /// [`RateLimiter::check_with_status`], awaited.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::limit_async`].
    pub async fn check_with_status_async<'n, 'k>(
        &self,
        target: impl Into<Target<'n>>,
        request: impl Into<Request<'k>>,
    ) -> Result<Taken, Error> {
        self.one_async(false, target.into(), request.into(), |t| t).await
    }

    /// [`RateLimiter::transaction`], awaited: several limits, all or nothing.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::transaction`].
    pub async fn transaction_async(
        &self,
        calls: &[Call<'_>],
    ) -> Result<TransactionDecision, Error> {
        if let Some(now) = self.store.immediate() {
            let transaction = Transaction { limiter: self, calls, answer: PhantomData::<Decision> };
            return self.store.on_immediate(now, transaction);
        }
        self.planned_transaction_async(calls).await.map(|t| t.decision)
    }

    /// [`RateLimiter::transaction_with_status`], awaited.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::transaction`].
    pub async fn transaction_with_status_async(
        &self,
        calls: &[Call<'_>],
    ) -> Result<TransactionTaken, Error> {
        if let Some(now) = self.store.immediate() {
            let transaction = Transaction { limiter: self, calls, answer: PhantomData::<Taken> };
            return self.store.on_immediate(now, transaction);
        }
        self.planned_transaction_async(calls).await
    }

    /// [`RateLimiter::reset`], awaited.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::reset`].
    pub async fn reset_async<'a>(
        &self,
        target: impl Into<Target<'a>>,
        key: Option<&str>,
    ) -> Result<(), Error> {
        let (name, shards) = self.to_reset(target.into(), key)?;
        Ok(self.store.delete_async(name, key, shards).await?)
    }

    /// [`RateLimiter::forget`], awaited.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::forget`].
    pub async fn forget_async(&self, name: &str, key: Option<&str>) -> Result<(), Error> {
        tollgate_algebra::validate_name_key(name, key)?;
        Ok(self.store.delete_async(name, key, tollgate_algebra::MAX_SHARDS).await?)
    }

    /// [`RateLimiter::carry`], awaited.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::carry`].
    pub async fn carry_async(
        &self,
        name: &str,
        key: Option<&str>,
        old: &Config,
        new: &Config,
    ) -> Result<usize, Error> {
        let Some(slots) = self.carry_slots(name, key, old, new)? else { return Ok(0) };
        let (now, states) = self.store.read_async(&slots).await?;
        let mut carried = 0;
        for take in carrying_takes(old, new, &slots, &states, now) {
            self.store.execute_one_async(&take).await?;
            carried += 1;
        }
        Ok(carried)
    }

    /// [`RateLimiter::adjust`], awaited.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::adjust`].
    pub async fn adjust_async<'a>(
        &self,
        target: impl Into<Target<'a>>,
        key: Option<&'a str>,
        count: f64,
    ) -> Result<Adjusted, Error> {
        let plan = self.adjust_plan(target.into(), key, count)?;
        if let Some(now) = self.store.immediate() {
            return adjusted(now.execute(&plan)?);
        }
        adjusted(self.store.execute_async(&plan).await?)
    }

    /// [`RateLimiter::value`], awaited.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::value`].
    pub async fn value_async<'a>(
        &self,
        target: impl Into<Target<'a>>,
        key: Option<&str>,
    ) -> Result<Reading, Error> {
        self.value_sampled_async(target, key, 1).await
    }

    /// [`RateLimiter::value_sampled`], awaited.
    ///
    /// # Errors
    ///
    /// As for [`RateLimiter::value`].
    pub async fn value_sampled_async<'a>(
        &self,
        target: impl Into<Target<'a>>,
        key: Option<&str>,
        sample_shards: u16,
    ) -> Result<Reading, Error> {
        let (config, slots) = self.to_read(target.into(), key, sample_shards)?;
        let (now, states) = self.store.read_async(&slots).await?;
        Ok(reading(&config, &slots, now, states))
    }

    /// One take: on a store that answers at once, its sync path; else awaited.
    #[inline(always)]
    async fn one_async<T>(
        &self,
        writes: bool,
        target: Target<'_>,
        request: Request<'_>,
        answer: impl Fn(Taken) -> T,
    ) -> Result<T, Error> {
        if let Some(now) = self.store.immediate() {
            let one = One { limiter: self, writes, target, request, answer: &answer };
            return self.store.on_immediate(now, one);
        }
        self.single_async(writes, target, request, answer).await
    }

    /// One take through the store's async calls: the one-take request, or a sharded one
    /// through a [`Plan`].
    async fn single_async<T>(
        &self,
        writes: bool,
        target: Target<'_>,
        request: Request<'_>,
        answer: impl Fn(Taken) -> T,
    ) -> Result<T, Error> {
        let config = *self.resolve(&target)?;
        let name = target.name();
        let take = request.take(name, config);
        if config.shards() != 1 {
            // A future of its own, boxed: a plan's inline arrays held across its await made
            // every one-take's future as large as a sharded one's (1,368 bytes for the Node
            // package's take, allocated and copied at each call).
            let sharded = Box::pin(self.sharded_async(writes, &take, request.throws));
            return sharded.await.map(answer);
        }
        let one = OneTake::new(&take, self.setup.seed, writes)?;
        match self.store.execute_one_async(&one).await {
            Ok(taken) if taken.decision.ok || !request.throws => Ok(answer(taken)),
            Ok(taken) => Err(refused(name, taken.decision)),
            Err(e) => self.store_failed(e, name).map(answer),
        }
    }

    /// A sharded take through a [`Plan`], awaited.
    async fn sharded_async(
        &self,
        writes: bool,
        take: &Take<'_>,
        throws: bool,
    ) -> Result<Taken, Error> {
        let plan = self.sharded_plan(writes, take)?;
        let outcome = self.store.execute_async(&plan).await;
        self.sharded_answer(outcome, take, throws)
    }

    /// A transaction through a [`Plan`], awaited.
    async fn planned_transaction_async(
        &self,
        calls: &[Call<'_>],
    ) -> Result<TransactionTaken, Error> {
        let plan = self.plan(true, calls.iter().map(|c| (c.target, c.request)))?;
        let outcome = self.store.execute_async(&plan).await;
        self.planned_answer(calls, outcome)
    }
}

/// One take on an in-process store's sync path, for the async API (see
/// [`AsyncStore::on_immediate`]).
struct One<'l, 'n, 'k, 'a, S, F> {
    limiter: &'l RateLimiter<S>,
    writes: bool,
    target: Target<'n>,
    request: Request<'k>,
    answer: &'a F,
}

impl<S, T, F: Fn(Taken) -> T> OnImmediate for One<'_, '_, '_, '_, S, F> {
    type Output = Result<T, Error>;
    #[inline(always)]
    fn on<St: Store>(self, store: &St) -> Result<T, Error> {
        self.limiter.single(store, self.writes, self.target, self.request, self.answer)
    }
}

/// A transaction on an in-process store's sync path, for the async API.
struct Transaction<'l, 'c, S, A> {
    limiter: &'l RateLimiter<S>,
    calls: &'c [Call<'c>],
    answer: PhantomData<A>,
}

impl<S, A: Answer> OnImmediate for Transaction<'_, '_, S, A> {
    type Output = Result<A::Transaction, Error>;
    #[inline(always)]
    fn on<St: Store>(self, store: &St) -> Result<A::Transaction, Error> {
        self.limiter.transaction_answering::<St, A>(store, self.calls)
    }
}

/// The operations on a given synchronous store, shared by the sync API and the async API's
/// path for immediate stores ([`AsyncStore::immediate`]), and what both APIs share besides.
impl<S> RateLimiter<S> {
    /// [`RateLimiter::limit_with_status`] of a [`Call`] on `store`, for the tower layer.
    #[cfg(feature = "tower")]
    pub(crate) fn limit_call_with_status_on<St: Store>(
        &self,
        store: &St,
        call: &Call<'_>,
    ) -> Result<Taken, Error> {
        self.single(store, true, call.target, call.request, |t| t)
    }

    /// [`RateLimiter::transaction_with_status`] on `store`, for the tower layer.
    #[cfg(feature = "tower")]
    pub(crate) fn transaction_with_status_on<St: Store>(
        &self,
        store: &St,
        calls: &[Call<'_>],
    ) -> Result<TransactionTaken, Error> {
        self.transaction_answering::<St, Taken>(store, calls)
    }

    /// One take: the common request. Inlined into `limit` and its kin so that, for a typed
    /// limit, the config is a constant and the decision never goes through memory (returning
    /// it through a call costs more than deciding it); what is rare lives out of line.
    ///
    /// `answer` picks what the caller returns, so that `limit` never builds the status.
    #[inline(always)]
    fn single<St: Store, T>(
        &self,
        store: &St,
        writes: bool,
        target: Target<'_>,
        request: Request<'_>,
        answer: impl Fn(Taken) -> T,
    ) -> Result<T, Error> {
        let config = *self.resolve(&target)?;
        let name = target.name();
        let take = request.take(name, config);
        if config.shards() != 1 {
            return self.sharded(store, writes, &take, request.throws).map(&answer);
        }
        OneTake::check(&take)?;
        let one = OneTake::of_valid(&take, self.setup.seed, writes);
        let throws = request.throws;
        // A refusal that throws keeps its decision; everything else is answered in the store.
        let kept = store.execute_one_then(&one, |taken: Taken| {
            if taken.decision.ok || !throws { Ok(answer(taken)) } else { Err(taken.decision) }
        });
        match kept {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(decision)) => Err(refused(name, decision)),
            Err(e) => self.store_failed(e, name).map(&answer),
        }
    }

    /// One take from a sharded limit, through a [`Plan`].
    #[inline(never)]
    fn sharded<St: Store>(
        &self,
        store: &St,
        writes: bool,
        take: &Take<'_>,
        throws: bool,
    ) -> Result<Taken, Error> {
        let plan = self.sharded_plan(writes, take)?;
        self.sharded_answer(store.execute(&plan), take, throws)
    }

    /// The plan of one take from a sharded limit.
    fn sharded_plan<'a>(&self, writes: bool, take: &Take<'a>) -> Result<Plan<'a>, Error> {
        let mut plan = Plan::new(writes);
        plan.push(take, self.setup.seed, self.draw())?;
        Ok(plan)
    }

    /// The answer to one take from a sharded limit, from what the store did with its plan.
    fn sharded_answer(
        &self,
        outcome: Result<Outcome, crate::error::StoreError>,
        take: &Take<'_>,
        throws: bool,
    ) -> Result<Taken, Error> {
        match outcome {
            Ok(outcome) if outcome.ok || !throws => {
                Ok(Taken { decision: outcome.decision(), status: outcome.statuses[0] })
            }
            Ok(outcome) => Err(refused(take.name, outcome.decision())),
            Err(e) => self.store_failed(e, take.name),
        }
    }

    /// A store error for one take: admitted if its limit fails open, else the error.
    #[cold]
    #[inline(never)]
    fn store_failed(&self, e: crate::error::StoreError, name: &str) -> Result<Taken, Error> {
        if self.fails_open(std::iter::once(name)) {
            return Ok(Taken { decision: Decision::ADMIT, status: Status::UNKNOWN });
        }
        Err(e.into())
    }

    /// A transaction, keeping `A` of each take.
    #[inline(always)]
    fn transaction_answering<St: Store, A: Answer>(
        &self,
        store: &St,
        calls: &[Call<'_>],
    ) -> Result<A::Transaction, Error> {
        // With the number of calls known to the compiler, the loops over them are unrolled
        // and what is kept per call lives in arrays of exactly that size.
        match calls.len() {
            0 => self.transaction_of::<St, 0, A>(store, &[]),
            1 => self.transaction_of::<St, 1, A>(store, calls.try_into().expect("1 call")),
            2 => self.transaction_of::<St, 2, A>(store, calls.try_into().expect("2 calls")),
            3 => self.transaction_of::<St, 3, A>(store, calls.try_into().expect("3 calls")),
            4 => self.transaction_of::<St, 4, A>(store, calls.try_into().expect("4 calls")),
            _ => self.planned_transaction(store, calls).map(A::from_taken),
        }
    }

    /// A transaction of `N` calls: of unsharded limits, it goes to the store as one-takes;
    /// with a sharded limit, through a [`Plan`].
    fn transaction_of<St: Store, const N: usize, A: Answer>(
        &self,
        store: &St,
        calls: &[Call<'_>; N],
    ) -> Result<A::Transaction, Error> {
        /// What `takes` holds until the loop below has built each take.
        const PLACEHOLDER: OneTake<'static> = OneTake {
            slot: Slot {
                name: "",
                key: None,
                shard: 0,
                config: Config::token_bucket(1.0, 1.0),
                alignment: 0.0,
            },
            count: 0.0,
            reserve: false,
            writes: false,
        };
        let mut takes = [PLACEHOLDER; N];
        for (take, call) in takes.iter_mut().zip(calls) {
            let config = self.resolve(&call.target)?;
            if config.shards() != 1 {
                return self.planned_transaction(store, calls).map(A::from_taken);
            }
            // Checked and built from the call's fields, not through a `Take` (see
            // `OneTake::check_parts`).
            let (name, r) = (call.target.name(), &call.request);
            OneTake::check_parts(name, r.key, config, r.count, r.reserve)?;
            let seed = self.setup.seed;
            *take = OneTake::of_valid_parts(name, r.key, config, r.count, r.reserve, seed, true);
        }
        let mut answers = [A::UNSET; N];
        if let Err(e) = store.execute_each_of(&takes, &mut answers, A::of, A::STATUSES) {
            return self.transaction_failed(calls, e).map(A::from_taken);
        }
        let mut results = [Decision::ADMIT; 4];
        let (mut ok, mut retry_after) = (true, None);
        for (result, answer) in results.iter_mut().zip(&answers) {
            *result = answer.decision();
            ok &= result.ok;
            retry_after = tollgate_algebra::max_option(retry_after, result.retry_after);
        }
        // Checked before the answer is built, so that it is built where it is returned: built
        // first, it was copied there afterwards (through `memcpy`).
        self.check_refused(calls, ok, &results[..N])?;
        let results = Inline::from_buf_and_len(results, N);
        Ok(A::transaction(TransactionDecision { ok, retry_after, results }, &answers))
    }

    /// A transaction with a sharded limit, through a [`Plan`].
    #[inline(never)]
    fn planned_transaction<St: Store>(
        &self,
        store: &St,
        calls: &[Call<'_>],
    ) -> Result<TransactionTaken, Error> {
        let plan = self.plan(true, calls.iter().map(|c| (c.target, c.request)))?;
        self.planned_answer(calls, store.execute(&plan))
    }

    /// The answer to a transaction, from what the store did with its plan.
    fn planned_answer(
        &self,
        calls: &[Call<'_>],
        outcome: Result<Outcome, crate::error::StoreError>,
    ) -> Result<TransactionTaken, Error> {
        match outcome {
            Ok(outcome) => {
                let taken: TransactionTaken = outcome.into();
                self.check_refused(calls, taken.decision.ok, &taken.decision.results)?;
                Ok(taken)
            }
            Err(e) => self.transaction_failed(calls, e),
        }
    }

    /// A store error for a transaction: admitted if all its limits fail open, else the error.
    #[cold]
    #[inline(never)]
    fn transaction_failed(
        &self,
        calls: &[Call<'_>],
        e: crate::error::StoreError,
    ) -> Result<TransactionTaken, Error> {
        if calls.is_empty() || !self.fails_open(calls.iter().map(|c| c.target.name())) {
            return Err(e.into());
        }
        let statuses = calls.iter().map(|_| Status::UNKNOWN).collect();
        Ok(TransactionTaken {
            decision: TransactionDecision {
                ok: true,
                retry_after: None,
                results: Inline::from_elem(Decision::ADMIT, calls.len()),
            },
            statuses,
        })
    }

    /// A plan of `calls`, validated.
    pub(crate) fn plan<'a>(
        &self,
        writes: bool,
        calls: impl Iterator<Item = (Target<'a>, Request<'a>)>,
    ) -> Result<Plan<'a>, Error> {
        let mut plan = Plan::new(writes);
        for (target, request) in calls {
            self.push(&mut plan, &target, &request)?;
        }
        Ok(plan)
    }

    /// A refused transaction is an error if it can never be granted (its takes of one state
    /// add up past what the limit can ever grant: invalid, as a single count past it is), or
    /// if a call throws. Checked only once refused, so that a granted transaction pays
    /// nothing for it: one that can never be granted is always refused.
    pub(crate) fn check_refused(
        &self,
        calls: &[Call<'_>],
        ok: bool,
        results: &[Decision],
    ) -> Result<(), Error> {
        if ok {
            return Ok(());
        }
        self.never_fits(calls)?;
        if calls.iter().any(|c| c.request.throws)
            && let Some(i) = tollgate_algebra::longest_refusal(results)
        {
            return Err(refused(calls[i].target.name(), results[i]));
        }
        Ok(())
    }

    /// An error if the takes of one state (of an unsharded limit: a sharded one's may go to
    /// different shards), added up in order, ever pass what the limit can grant: its
    /// capacity, or with `reserve` its capacity and `maxReserved` (without `maxReserved`, a
    /// reservation can always be booked). The state's first call gives its config, as the
    /// transaction's plan does.
    #[cold]
    fn never_fits(&self, calls: &[Call<'_>]) -> Result<(), Error> {
        // foldhash's, as elsewhere: hashbrown's own default hasher is a feature left off.
        let mut sums: HashMap<(&str, Option<&str>), (f64, Config), RandomState> =
            HashMap::with_capacity_and_hasher(calls.len(), RandomState::default());
        for call in calls {
            let config = *self.resolve(&call.target)?;
            let name = call.target.name();
            let (sum, config) = sums.entry((name, call.request.key)).or_insert((0.0, config));
            if config.shards() != 1 {
                continue;
            }
            *sum += call.request.count;
            let allowed = match (call.request.reserve, config.max_reserved()) {
                (false, _) => config.capacity(),
                (true, Some(max_reserved)) => config.capacity() + max_reserved,
                (true, None) => continue,
            };
            if *sum > allowed {
                return Err(tollgate_algebra::InvalidRequest::new(format!(
                    "Rate limit {name} count {} exceeds {}: a transaction's takes of one key add \
                     up.",
                    tollgate_algebra::fmt_number(*sum),
                    tollgate_algebra::fmt_number(allowed)
                ))
                .into());
            }
        }
        Ok(())
    }

    /// The slots [`RateLimiter::carry`] reads: every shard of both configs, each under the
    /// config that carrying takes it with (`new`'s shards) or reads it under (`old`'s beyond
    /// them); `None` when the change asks nothing.
    fn carry_slots<'a>(
        &self,
        name: &'a str,
        key: Option<&'a str>,
        old: &Config,
        new: &Config,
    ) -> Result<Option<SmallVec<[Slot<'a>; 4]>>, Error> {
        tollgate_algebra::validate_name_key(name, key)?;
        if Carry::of(old, new) == Carry::Nothing {
            return Ok(None);
        }
        let shards = old.shards().max(new.shards());
        let slots = (0..shards)
            .map(|shard| {
                let config = if shard < new.shards() { new } else { old };
                let alignment = alignment(&config.per_shard(), self.setup.seed, name, key, shard);
                Slot { name, key, shard, config: carrying(config), alignment }
            })
            .collect();
        Ok(Some(slots))
    }

    /// What a reset of (target, key) deletes: the name and its number of shards.
    fn to_reset<'a>(&self, target: Target<'a>, key: Option<&str>) -> Result<(&'a str, u16), Error> {
        let shards = self.resolve(&target)?.shards();
        tollgate_algebra::validate_name_key(target.name(), key)?;
        Ok((target.name(), shards))
    }

    /// The plan of an adjust of (target, key) by `count`, validated.
    fn adjust_plan<'a>(
        &self,
        target: Target<'a>,
        key: Option<&'a str>,
        count: f64,
    ) -> Result<Plan<'a>, Error> {
        let config = *self.resolve(&target)?;
        let random = if config.shards() > 1 { self.draw() } else { 0 };
        let take = Take { name: target.name(), key, config, count, reserve: false };
        Ok(Plan::adjust(&take, self.setup.seed, random)?)
    }

    /// What a reading of (target, key) reads: the config and the sampled slots.
    fn to_read<'a>(
        &self,
        target: Target<'a>,
        key: Option<&'a str>,
        sample_shards: u16,
    ) -> Result<(Config, SmallVec<[Slot<'a>; 4]>), Error> {
        let config = *self.resolve(&target)?;
        let name = target.name();
        tollgate_algebra::validate_name_key(name, key)?;
        let per_shard = config.per_shard();
        let shards = if config.shards() == 1 {
            SmallVec::from_slice(&[0])
        } else {
            tollgate_algebra::sample_shards(config.shards(), sample_shards, self.draw())
        };
        let slots = shards
            .iter()
            .map(|&shard| Slot {
                name,
                key,
                shard,
                config: per_shard,
                alignment: alignment(&per_shard, self.setup.seed, name, key, shard),
            })
            .collect();
        Ok((config, slots))
    }

    /// The config of `target`: a typed or inline target carries it (inlined, so that a typed
    /// limit's config is a constant at the call); a name is looked up.
    ///
    /// A reference, not a copy: a config copied into a `Result` and out again is read back
    /// in pieces other than those it was written in, which stalls the processor.
    #[inline(always)]
    fn resolve<'t>(&'t self, target: &'t Target<'_>) -> Result<&'t Config, Error> {
        match target {
            Target::Inline(_, config) => Ok(config),
            Target::Named(name) => self.resolve_name(name),
        }
    }

    #[inline(never)]
    fn resolve_name(&self, name: &str) -> Result<&Config, Error> {
        self.setup.defined.get(name).ok_or_else(|| Error::NotDefined { name: name.to_owned() })
    }

    fn push<'a>(
        &self,
        plan: &mut Plan<'a>,
        target: &Target<'a>,
        request: &Request<'a>,
    ) -> Result<(), Error> {
        let config = self.resolve(target)?;
        let random = if config.shards() > 1 { self.draw() } else { 0 };
        plan.push(&request.take(target.name(), *config), self.setup.seed, random)?;
        Ok(())
    }

    /// 64 random bits: from the seeded sequence if any, else from a per-thread generator.
    fn draw(&self) -> u64 {
        match &self.setup.draws {
            Some(counter) => splitmix64(counter.fetch_add(1, Ordering::Relaxed)),
            None => thread_random(),
        }
    }
}

/// What a store's outcome of an adjust's plan says: a store that answers it with the
/// outcome of takes is broken, an error rather than a made-up value.
fn adjusted(outcome: Outcome) -> Result<Adjusted, Error> {
    let broken = || crate::error::StoreError::new("the store answered an adjust as takes");
    Ok(outcome.adjusted().ok_or_else(broken)?)
}

/// The takes that carry (name, key) from `old` to `new` (see [`RateLimiter::carry`]), given
/// the states of its `slots` read at `now`: under [`Carry::Refill`] a take of nothing from each
/// stored state, under [`Carry::Convert`] [`carry_counts`] from each shard of `new` that has a
/// state or something to take.
fn carrying_takes<'a>(
    old: &Config,
    new: &Config,
    slots: &[Slot<'a>],
    states: &[Option<tollgate_algebra::State>],
    now: f64,
) -> Vec<OneTake<'a>> {
    let counts = match Carry::of(old, new) {
        Carry::Nothing => return Vec::new(),
        Carry::Refill => SmallVec::from_elem(0.0, usize::from(new.shards())),
        Carry::Convert => carry_counts(old, new, states, now),
    };
    (0..usize::from(new.shards()))
        .filter(|&j| states[j].is_some() || counts[j] > 0.0)
        .map(|j| OneTake { slot: slots[j], count: counts[j], reserve: true, writes: true })
        .collect()
}

/// A reading of the states `read` for `slots` at `now`.
fn reading(
    config: &Config,
    slots: &[Slot<'_>],
    now: f64,
    states: Vec<Option<tollgate_algebra::State>>,
) -> Reading {
    let samples: SmallVec<[Sample; 4]> = slots
        .iter()
        .zip(states)
        .map(|(slot, state)| Sample { shard: slot.shard, state, alignment: slot.alignment })
        .collect();
    read(config, &samples, now)
}

pub(crate) fn refused(name: &str, decision: Decision) -> Error {
    Error::RateLimited { name: name.to_owned(), retry_after: decision.retry_after.unwrap_or(0.0) }
}

thread_local! {
    static RNG: Cell<u64> = Cell::new({
        // Each thread starts from a different point: the address of its own state and the time.
        let local = 0u8;
        let time = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        splitmix64(std::ptr::from_ref(&local) as u64 ^ time)
    });
}

/// 64 bits from a per-thread splitmix64 sequence: fast, not cryptographic; enough to spread
/// shard choices and retries.
fn thread_random() -> u64 {
    RNG.with(|state| {
        let next = state.get().wrapping_add(0x9e37_79b9_7f4a_7c15);
        state.set(next);
        splitmix64(next)
    })
}

/// Adds jitter to a wait: `retry_after + u * period` with `u` uniform in `[0, 1)`, so that
/// many refused clients do not all come back at the same instant.
///
/// # Examples
///
/// ```
/// let wait = tollgate::jitter(6_000.0, 60_000.0);
/// assert!((6_000.0..66_000.0).contains(&wait));
/// ```
pub fn jitter(retry_after: f64, period: f64) -> f64 {
    retry_after + unit_interval(thread_random()) * period
}
