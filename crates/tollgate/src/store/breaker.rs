//! A store that is slow is treated as failing, fast: [`CircuitBreaker`].

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::task::Poll;
use std::time::Duration;
use tollgate_algebra::slots::{Concurrency, SlotAnswer, SlotOp};

use parking_lot::Mutex;
use tollgate_algebra::{OneTake, Outcome, Plan, Slot, State, Taken};

use super::seam::{AsyncStore, BoxFuture};
use crate::error::StoreError;

/// Options for a [`CircuitBreaker`].
#[derive(Debug, Clone)]
pub struct CircuitBreakerBuilder {
    deadline: Duration,
    trip_after: u32,
    probe_every: Duration,
}

impl Default for CircuitBreakerBuilder {
    fn default() -> Self {
        CircuitBreakerBuilder {
            deadline: Duration::from_millis(250),
            trip_after: 3,
            probe_every: Duration::from_millis(250),
        }
    }
}

impl CircuitBreakerBuilder {
    /// How long a request may wait for the store (default 250 ms): past it the request
    /// fails, as if the store had. A request that may have reached the store by then says
    /// so ([`StoreError::may_have_taken`]).
    #[must_use]
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// How many failures of the store in a row open the breaker (default 3; at least 1): a
    /// failure is a request past its deadline or one the store could not serve (unreachable,
    /// a lost connection: [`StoreError::is_unavailable`]), not a request the store refused.
    #[must_use]
    pub fn trip_after(mut self, failures: u32) -> Self {
        self.trip_after = failures.max(1);
        self
    }

    /// How often an open breaker asks the store whether it answers again (default 250 ms):
    /// a read of nothing, within the deadline; the first that succeeds closes the breaker.
    #[must_use]
    pub fn probe_every(mut self, every: Duration) -> Self {
        self.probe_every = every;
        self
    }

    /// The breaker around `store`.
    pub fn build<S>(self, store: S) -> CircuitBreaker<S> {
        CircuitBreaker {
            shared: Arc::new(Shared {
                store,
                options: self,
                state: Mutex::new(Mode::Closed { failures: 0 }),
                trips: AtomicU64::new(0),
                rejected: AtomicU64::new(0),
                failures: AtomicU64::new(0),
            }),
        }
    }
}

/// A store that fails fast when its store is slow or down: each request waits at most a
/// deadline, and after a few failures in a row the breaker *opens*: every request fails at
/// once, never sent (so nothing was taken), while a background task asks the store every
/// so often whether it answers again, and *closes* the breaker when it does.
///
/// With the limiter's [fail-open](crate::RateLimiterBuilder::fail_open) limits, an open
/// breaker means an immediate grant instead of a wait for a store that hangs; every other
/// limit gets [`crate::Error::Store`] at once (a server answers 503). Only the first
/// requests of an outage (those that open the breaker) wait their deadline, and only those
/// that were sent before it may have taken their tokens.
///
/// The states: **closed** (requests go to the store; failures in a row are counted, a
/// success resets the count), **open** (requests fail at once; a probe runs every
/// [`probe_every`](CircuitBreakerBuilder::probe_every)). [`CircuitBreaker::is_open`] and
/// [`CircuitBreaker::stats`] tell them, for metrics.
///
/// The probe task runs on the Tokio runtime of the request that opened the breaker.
///
/// # Examples
///
/// ```no_run
/// use std::time::Duration;
/// use tollgate::store::{CircuitBreaker, RedisStore};
/// use tollgate::{Config, RateLimiter, MINUTE};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let redis = RedisStore::builder().timeout(Duration::from_millis(200)).open("redis://127.0.0.1:6379")?;
/// let store = CircuitBreaker::builder().deadline(Duration::from_millis(250)).build(redis);
/// let limiter = RateLimiter::builder(store).fail_open("search").build();
/// let search = ("search", Config::token_bucket(100.0, MINUTE));
/// // Granted within 250 ms whatever Redis does; at once while the breaker is open.
/// assert!(limiter.limit_async(search, "alice").await?.ok);
/// # Ok(())
/// # }
/// ```
pub struct CircuitBreaker<S> {
    shared: Arc<Shared<S>>,
}

/// What the breaker and its probe share.
struct Shared<S> {
    store: S,
    options: CircuitBreakerBuilder,
    state: Mutex<Mode>,
    trips: AtomicU64,
    rejected: AtomicU64,
    failures: AtomicU64,
}

#[derive(Clone, Copy, Debug)]
enum Mode {
    Closed { failures: u32 },
    Open,
}

/// What a breaker has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BreakerStats {
    /// Whether the breaker is open now.
    pub open: bool,
    /// How many times it opened.
    pub trips: u64,
    /// Requests answered at once because it was open (never sent).
    pub rejected: u64,
    /// Requests the store failed: past their deadline, or it could not be reached or lost
    /// the connection ([`StoreError::is_unavailable`]). Not those an open breaker answered.
    pub failures: u64,
}

impl CircuitBreaker<()> {
    /// Options: deadline, failures to open, probe interval.
    pub fn builder() -> CircuitBreakerBuilder {
        CircuitBreakerBuilder::default()
    }
}

impl<S> CircuitBreaker<S> {
    /// The breaker around `store`, with the default options.
    pub fn new(store: S) -> Self {
        CircuitBreakerBuilder::default().build(store)
    }

    /// The store inside.
    pub fn store(&self) -> &S {
        &self.shared.store
    }

    /// Whether the breaker is open: requests fail at once.
    pub fn is_open(&self) -> bool {
        matches!(*self.shared.state.lock(), Mode::Open)
    }

    /// What the breaker has done so far.
    pub fn stats(&self) -> BreakerStats {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        BreakerStats {
            open: self.is_open(),
            trips: get(&self.shared.trips),
            rejected: get(&self.shared.rejected),
            failures: get(&self.shared.failures),
        }
    }
}

impl<S: AsyncStore + 'static> CircuitBreaker<S> {
    /// An error if the breaker is open: then the request must not be made at all (a store
    /// that answers in-process does its work when its call is made, not when awaited).
    fn closed(&self) -> Result<(), StoreError> {
        let shared = &self.shared;
        if matches!(*shared.state.lock(), Mode::Open) {
            shared.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(StoreError::new(format!(
                "the store failed {} times in a row and is not asked until it answers again \
                 (circuit breaker open); nothing was sent, nothing taken",
                shared.options.trip_after
            ))
            .unavailable());
        }
        Ok(())
    }

    /// The store's answer to `call`, within the deadline.
    async fn guarded<T>(
        &self,
        writes: bool,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let deadline = self.shared.options.deadline;
        // Polled once before the deadline is set: an answer ready at once (a take from a
        // lease) needs no timer, whose clock read and runtime handle were a tenth of such a
        // take. What waits then waits at most `deadline` more.
        let mut call = std::pin::pin!(call);
        let first = std::future::poll_fn(|cx| Poll::Ready(call.as_mut().poll(cx))).await;
        let answered = match first {
            Poll::Ready(answer) => Ok(answer),
            Poll::Pending => tokio::time::timeout(deadline, call).await,
        };
        match answered {
            Ok(Err(e)) if e.is_unavailable() => {
                self.failed();
                Err(e)
            }
            // The store answered, an error or not: it is there.
            Ok(answer) => {
                self.answered();
                answer
            }
            Err(_) => {
                self.failed();
                let error =
                    StoreError::new(format!("the store did not answer within {deadline:?}"))
                        .unavailable();
                Err(if writes { error.sent() } else { error })
            }
        }
    }

    fn answered(&self) {
        let mut state = self.shared.state.lock();
        if let Mode::Closed { failures } = &mut *state {
            *failures = 0;
        }
    }

    /// Counts a failure; the one that reaches the count opens the breaker and starts the
    /// probe.
    fn failed(&self) {
        self.shared.failures.fetch_add(1, Ordering::Relaxed);
        let mut state = self.shared.state.lock();
        let Mode::Closed { failures } = &mut *state else { return };
        *failures += 1;
        if *failures < self.shared.options.trip_after {
            return;
        }
        *state = Mode::Open;
        drop(state);
        self.shared.trips.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(probe(Arc::downgrade(&self.shared)));
    }
}

/// Asks the store every `probe_every` whether it answers (a read of nothing, within the
/// deadline) and closes the breaker when it does; ends with it, or when the breaker is gone.
async fn probe<S: AsyncStore + 'static>(shared: Weak<Shared<S>>) {
    loop {
        let every = match shared.upgrade() {
            Some(shared) => shared.options.probe_every,
            None => return,
        };
        tokio::time::sleep(every).await;
        let Some(shared) = shared.upgrade() else { return };
        let deadline = shared.options.deadline;
        if let Ok(Ok(_)) = tokio::time::timeout(deadline, shared.store.read_async(&[])).await {
            *shared.state.lock() = Mode::Closed { failures: 0 };
            return;
        }
    }
}

impl<S: AsyncStore + 'static> AsyncStore for CircuitBreaker<S> {
    fn execute_async<'a>(&'a self, plan: &'a Plan<'_>) -> BoxFuture<'a, Outcome> {
        Box::pin(async move {
            self.closed()?;
            self.guarded(plan.writes(), self.shared.store.execute_async(plan)).await
        })
    }

    fn execute_one_async<'a>(&'a self, take: &'a OneTake<'_>) -> BoxFuture<'a, Taken> {
        Box::pin(async move {
            self.closed()?;
            self.guarded(take.writes, self.shared.store.execute_one_async(take)).await
        })
    }

    fn read_async<'a>(&'a self, slots: &'a [Slot<'_>]) -> BoxFuture<'a, (f64, Vec<Option<State>>)> {
        Box::pin(async move {
            self.closed()?;
            self.guarded(false, self.shared.store.read_async(slots)).await
        })
    }

    fn delete_async<'a>(
        &'a self,
        name: &'a str,
        key: Option<&'a str>,
        shards: u16,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            self.closed()?;
            self.guarded(true, self.shared.store.delete_async(name, key, shards)).await
        })
    }

    fn slots_async<'a>(
        &'a self,
        name: &'a str,
        key: Option<&'a str>,
        limit: &'a Concurrency,
        op: &'a SlotOp,
    ) -> BoxFuture<'a, SlotAnswer> {
        Box::pin(async move {
            self.closed()?;
            self.guarded(op.writes(), self.shared.store.slots_async(name, key, limit, op)).await
        })
    }

    fn slots_with_async<'a>(
        &'a self,
        name: &'a str,
        key: Option<&'a str>,
        limit: &'a Concurrency,
        op: &'a SlotOp,
        plan: &'a Plan<'_>,
    ) -> BoxFuture<'a, (SlotAnswer, Outcome)> {
        Box::pin(async move {
            self.closed()?;
            let answer = self.shared.store.slots_with_async(name, key, limit, op, plan);
            self.guarded(true, answer).await
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use tollgate_algebra::{Config, MINUTE, ManualClock, Take};

    use super::*;
    use crate::store::memory::MemoryStore;
    use crate::store::seam::Store;

    /// The memory store, made to hang or to fail as a networked store would.
    struct Flaky {
        memory: MemoryStore<ManualClock>,
        hang: AtomicBool,
        down: AtomicBool,
        calls: AtomicU64,
    }

    impl Flaky {
        async fn call<T>(
            &self,
            answer: impl FnOnce() -> Result<T, StoreError>,
        ) -> Result<T, StoreError> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            if self.hang.load(Ordering::Relaxed) {
                std::future::pending::<()>().await;
            }
            if self.down.load(Ordering::Relaxed) {
                return Err(StoreError::new("connection refused").unavailable());
            }
            answer()
        }
    }

    impl AsyncStore for Flaky {
        fn execute_async<'a>(&'a self, plan: &'a Plan<'_>) -> BoxFuture<'a, Outcome> {
            Box::pin(async move { self.call(|| Store::execute(&self.memory, plan)).await })
        }
        fn read_async<'a>(
            &'a self,
            slots: &'a [Slot<'_>],
        ) -> BoxFuture<'a, (f64, Vec<Option<State>>)> {
            Box::pin(async move { self.call(|| Store::read(&self.memory, slots)).await })
        }
        fn delete_async<'a>(
            &'a self,
            name: &'a str,
            key: Option<&'a str>,
            shards: u16,
        ) -> BoxFuture<'a, ()> {
            Box::pin(
                async move { self.call(|| Store::delete(&self.memory, name, key, shards)).await },
            )
        }
    }

    fn take(count: f64) -> OneTake<'static> {
        let config = Config::token_bucket(10.0, MINUTE);
        let take = Take { name: "t", key: Some("k"), config, count, reserve: false };
        OneTake::new(&take, 0, true).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn a_hanging_store_opens_the_breaker_and_a_probe_closes_it() {
        let flaky = Flaky {
            memory: MemoryStore::with_clock(ManualClock::new(0.0)),
            hang: AtomicBool::new(true),
            down: AtomicBool::new(false),
            calls: AtomicU64::new(0),
        };
        let breaker = CircuitBreaker::builder()
            .deadline(Duration::from_millis(100))
            .trip_after(3)
            .probe_every(Duration::from_millis(50))
            .build(flaky);
        // Three requests wait their deadline, and may have taken (they were sent).
        for _ in 0..3 {
            let err = breaker.execute_one_async(&take(1.0)).await.unwrap_err();
            assert!(err.may_have_taken() && err.is_unavailable(), "{err}");
        }
        assert!(breaker.is_open());
        // Now at once, never sent.
        let calls = breaker.store().calls.load(Ordering::Relaxed);
        let start = tokio::time::Instant::now();
        let err = breaker.execute_one_async(&take(1.0)).await.unwrap_err();
        assert_eq!(start.elapsed(), Duration::ZERO);
        assert!(!err.may_have_taken() && err.message().contains("circuit breaker open"), "{err}");
        assert_eq!(breaker.store().calls.load(Ordering::Relaxed), calls, "not sent");
        // The store answers again: the next probe closes the breaker.
        breaker.store().hang.store(false, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!breaker.is_open());
        let taken = breaker.execute_one_async(&take(4.0)).await.unwrap();
        assert_eq!(taken.status.remaining, 6.0, "the three sent before never reached memory");
        let stats = breaker.stats();
        assert_eq!((stats.trips, stats.rejected, stats.failures), (1, 1, 3));
    }

    #[tokio::test(start_paused = true)]
    async fn failures_must_come_in_a_row_and_refusals_do_not_count() {
        let flaky = Flaky {
            memory: MemoryStore::builder().max_keys(1).build_with_clock(ManualClock::new(0.0)),
            hang: AtomicBool::new(false),
            down: AtomicBool::new(true),
            calls: AtomicU64::new(0),
        };
        let breaker = CircuitBreaker::builder().trip_after(3).build(flaky);
        for _ in 0..2 {
            assert!(breaker.execute_one_async(&take(1.0)).await.is_err());
        }
        breaker.store().down.store(false, Ordering::Relaxed);
        assert!(breaker.execute_one_async(&take(1.0)).await.is_ok(), "resets the count");
        breaker.store().down.store(true, Ordering::Relaxed);
        for _ in 0..2 {
            assert!(breaker.execute_one_async(&take(1.0)).await.is_err());
        }
        assert!(!breaker.is_open(), "two in a row, not three");
        // A store that refuses (full) is answering: never opens the breaker.
        breaker.store().down.store(false, Ordering::Relaxed);
        let other = |key| {
            let config = Config::token_bucket(10.0, MINUTE);
            let take = Take { name: "t", key: Some(key), config, count: 1.0, reserve: false };
            OneTake::new(&take, 0, true).unwrap()
        };
        for key in ["a", "b", "c", "d"] {
            let err = breaker.execute_one_async(&other(key)).await.unwrap_err();
            assert!(err.message().contains("full"), "{err}");
        }
        assert!(!breaker.is_open());
    }
}
