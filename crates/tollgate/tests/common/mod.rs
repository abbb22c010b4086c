//! What the backend test files share: where a backend is, stores that own what they were
//! made on, and the limiter's operations through either of its two APIs. Each test file
//! uses some of it.
#![allow(dead_code)]

use std::future::Future;
use std::sync::Arc;

use tokio::runtime::Runtime;
use tollgate::core::{OneTake, Outcome, Plan, Slot, State, Taken};
use tollgate::{
    AsyncStore, Call, Config, Decision, Error, RateLimiter, Reading, Request, Store, StoreError,
    Target, TransactionDecision, TransactionTaken,
};

/// The URL of a backend server, from the environment variable `var`. Unset: the caller skips,
/// and this says why (once per process, past libtest's capture, which takes only the print
/// macros, so a skip is visible), unless `TOLLGATE_REQUIRE_BACKENDS=1` (as in CI), which makes
/// a missing backend a failure rather than a silent skip.
pub(crate) fn backend_url(var: &str, example: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(url) if !url.is_empty() => Some(url),
        _ if std::env::var("TOLLGATE_REQUIRE_BACKENDS").as_deref() == Ok("1") => {
            panic!("{var} is not set, and TOLLGATE_REQUIRE_BACKENDS=1 requires this backend")
        }
        _ => {
            // Once per variable, not once per test.
            static SAID: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
            let mut said = SAID.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if !said.iter().any(|v| v == var) {
                said.push(var.to_owned());
                use std::io::Write as _;
                let _ = writeln!(
                    std::io::stderr(),
                    "skipped the {var} backend tests: set {var} (for example {var}={example}) to run them"
                );
            }
            None
        }
    }
}

/// A multi-threaded runtime with two worker threads, as on this project's CI machines: the
/// async API's calls, and the tasks of the stores that have them, run on it.
pub(crate) fn runtime() -> Arc<Runtime> {
    Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a runtime"),
    )
}

/// The limiter's operations, through its sync API ([`SyncApi`]) or its async one
/// ([`AsyncApi`]), so that one suite runs both.
pub(crate) trait Api: Send + Sync + 'static {
    fn limit<'n, 'k>(
        &self,
        t: impl Into<Target<'n>>,
        r: impl Into<Request<'k>>,
    ) -> Result<Decision, Error>;
    fn check<'n, 'k>(
        &self,
        t: impl Into<Target<'n>>,
        r: impl Into<Request<'k>>,
    ) -> Result<Decision, Error>;
    fn limit_with_status<'n, 'k>(
        &self,
        t: impl Into<Target<'n>>,
        r: impl Into<Request<'k>>,
    ) -> Result<Taken, Error>;
    fn check_with_status<'n, 'k>(
        &self,
        t: impl Into<Target<'n>>,
        r: impl Into<Request<'k>>,
    ) -> Result<Taken, Error>;
    fn transaction(&self, calls: &[Call<'_>]) -> Result<TransactionDecision, Error>;
    fn transaction_with_status(&self, calls: &[Call<'_>]) -> Result<TransactionTaken, Error>;
    fn reset<'a>(&self, t: impl Into<Target<'a>>, key: Option<&str>) -> Result<(), Error>;
    fn forget(&self, name: &str, key: Option<&str>) -> Result<(), Error>;
    fn carry(
        &self,
        name: &str,
        key: Option<&str>,
        old: &Config,
        new: &Config,
    ) -> Result<usize, Error>;
    fn value_sampled<'a>(
        &self,
        t: impl Into<Target<'a>>,
        key: Option<&str>,
        sample_shards: u16,
    ) -> Result<Reading, Error>;
    fn value<'a>(&self, t: impl Into<Target<'a>>, key: Option<&str>) -> Result<Reading, Error> {
        self.value_sampled(t, key, 1)
    }
    /// `callers` concurrent callers (threads for the sync API; tasks of a two-thread runtime
    /// for the async one), all started before any calls, each taking one token from `limit`
    /// `calls` times: how many were admitted.
    fn race(&self, limit: Target<'static>, callers: usize, calls: usize) -> usize;
}

/// The sync API.
pub(crate) struct SyncApi<S>(pub(crate) Arc<RateLimiter<S>>);

impl<S: Store + Send + Sync + 'static> Api for SyncApi<S> {
    fn limit<'n, 'k>(
        &self,
        t: impl Into<Target<'n>>,
        r: impl Into<Request<'k>>,
    ) -> Result<Decision, Error> {
        self.0.limit(t, r)
    }
    fn check<'n, 'k>(
        &self,
        t: impl Into<Target<'n>>,
        r: impl Into<Request<'k>>,
    ) -> Result<Decision, Error> {
        self.0.check(t, r)
    }
    fn limit_with_status<'n, 'k>(
        &self,
        t: impl Into<Target<'n>>,
        r: impl Into<Request<'k>>,
    ) -> Result<Taken, Error> {
        self.0.limit_with_status(t, r)
    }
    fn check_with_status<'n, 'k>(
        &self,
        t: impl Into<Target<'n>>,
        r: impl Into<Request<'k>>,
    ) -> Result<Taken, Error> {
        self.0.check_with_status(t, r)
    }
    fn transaction(&self, calls: &[Call<'_>]) -> Result<TransactionDecision, Error> {
        self.0.transaction(calls)
    }
    fn transaction_with_status(&self, calls: &[Call<'_>]) -> Result<TransactionTaken, Error> {
        self.0.transaction_with_status(calls)
    }
    fn reset<'a>(&self, t: impl Into<Target<'a>>, key: Option<&str>) -> Result<(), Error> {
        self.0.reset(t, key)
    }
    fn forget(&self, name: &str, key: Option<&str>) -> Result<(), Error> {
        self.0.forget(name, key)
    }
    fn carry(
        &self,
        name: &str,
        key: Option<&str>,
        old: &Config,
        new: &Config,
    ) -> Result<usize, Error> {
        self.0.carry(name, key, old, new)
    }
    fn value_sampled<'a>(
        &self,
        t: impl Into<Target<'a>>,
        key: Option<&str>,
        sample_shards: u16,
    ) -> Result<Reading, Error> {
        self.0.value_sampled(t, key, sample_shards)
    }
    fn race(&self, limit: Target<'static>, callers: usize, calls: usize) -> usize {
        let start = Arc::new(std::sync::Barrier::new(callers));
        let threads: Vec<_> = (0..callers)
            .map(|_| {
                let (l, start) = (Arc::clone(&self.0), Arc::clone(&start));
                std::thread::spawn(move || {
                    start.wait();
                    (0..calls).filter(|_| l.limit(limit, Request::new()).unwrap().ok).count()
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).sum()
    }
}

/// The async API, each call awaited on a runtime of two threads (as a test's thread blocks
/// on it; the calls themselves never block a runtime thread).
pub(crate) struct AsyncApi<S> {
    pub(crate) limiter: Arc<RateLimiter<S>>,
    pub(crate) runtime: Arc<Runtime>,
}

impl<S> AsyncApi<S> {
    fn on<T>(&self, call: impl Future<Output = T>) -> T {
        self.runtime.block_on(call)
    }
}

impl<S: AsyncStore + 'static> Api for AsyncApi<S> {
    fn limit<'n, 'k>(
        &self,
        t: impl Into<Target<'n>>,
        r: impl Into<Request<'k>>,
    ) -> Result<Decision, Error> {
        self.on(self.limiter.limit_async(t.into(), r.into()))
    }
    fn check<'n, 'k>(
        &self,
        t: impl Into<Target<'n>>,
        r: impl Into<Request<'k>>,
    ) -> Result<Decision, Error> {
        self.on(self.limiter.check_async(t.into(), r.into()))
    }
    fn limit_with_status<'n, 'k>(
        &self,
        t: impl Into<Target<'n>>,
        r: impl Into<Request<'k>>,
    ) -> Result<Taken, Error> {
        self.on(self.limiter.limit_with_status_async(t.into(), r.into()))
    }
    fn check_with_status<'n, 'k>(
        &self,
        t: impl Into<Target<'n>>,
        r: impl Into<Request<'k>>,
    ) -> Result<Taken, Error> {
        self.on(self.limiter.check_with_status_async(t.into(), r.into()))
    }
    fn transaction(&self, calls: &[Call<'_>]) -> Result<TransactionDecision, Error> {
        self.on(self.limiter.transaction_async(calls))
    }
    fn transaction_with_status(&self, calls: &[Call<'_>]) -> Result<TransactionTaken, Error> {
        self.on(self.limiter.transaction_with_status_async(calls))
    }
    fn reset<'a>(&self, t: impl Into<Target<'a>>, key: Option<&str>) -> Result<(), Error> {
        self.on(self.limiter.reset_async(t.into(), key))
    }
    fn forget(&self, name: &str, key: Option<&str>) -> Result<(), Error> {
        self.on(self.limiter.forget_async(name, key))
    }
    fn carry(
        &self,
        name: &str,
        key: Option<&str>,
        old: &Config,
        new: &Config,
    ) -> Result<usize, Error> {
        self.on(self.limiter.carry_async(name, key, old, new))
    }
    fn value_sampled<'a>(
        &self,
        t: impl Into<Target<'a>>,
        key: Option<&str>,
        sample_shards: u16,
    ) -> Result<Reading, Error> {
        self.on(self.limiter.value_sampled_async(t.into(), key, sample_shards))
    }
    fn race(&self, limit: Target<'static>, callers: usize, calls: usize) -> usize {
        self.on(async {
            let start = Arc::new(tokio::sync::Barrier::new(callers));
            let tasks: Vec<_> = (0..callers)
                .map(|_| {
                    let (l, start) = (Arc::clone(&self.limiter), Arc::clone(&start));
                    tokio::spawn(async move {
                        start.wait().await;
                        let mut admitted = 0;
                        for _ in 0..calls {
                            admitted +=
                                usize::from(l.limit_async(limit, Request::new()).await.unwrap().ok);
                        }
                        admitted
                    })
                })
                .collect();
            let mut admitted = 0;
            for task in tasks {
                admitted += task.await.unwrap();
            }
            admitted
        })
    }
}

/// A store together with what it was made on (a temporary directory, a table of its own),
/// which goes away with it.
pub(crate) struct Owned<S, R> {
    pub(crate) store: S,
    pub(crate) resource: R,
}

// Every method forwarded, so that the suites run each store's own fast paths, not the
// defaults.
impl<S: Store, R> Store for Owned<S, R> {
    fn execute(&self, plan: &Plan<'_>) -> Result<Outcome, StoreError> {
        self.store.execute(plan)
    }
    fn execute_one(&self, take: &OneTake<'_>) -> Result<Taken, StoreError> {
        self.store.execute_one(take)
    }
    fn execute_each(&self, takes: &[OneTake<'_>], answers: &mut [Taken]) -> Result<(), StoreError> {
        self.store.execute_each(takes, answers)
    }
    fn read(&self, slots: &[Slot<'_>]) -> Result<(f64, Vec<Option<State>>), StoreError> {
        self.store.read(slots)
    }
    fn delete(&self, name: &str, key: Option<&str>, shards: u16) -> Result<(), StoreError> {
        self.store.delete(name, key, shards)
    }
}

impl<S: AsyncStore, R: Send + Sync> AsyncStore for Owned<S, R> {
    type Immediate = S::Immediate;
    fn immediate(&self) -> Option<&S::Immediate> {
        self.store.immediate()
    }
    fn execute_async(
        &self,
        plan: &Plan<'_>,
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send {
        AsyncStore::execute_async(&self.store, plan)
    }
    fn execute_one_async(
        &self,
        take: &OneTake<'_>,
    ) -> impl Future<Output = Result<Taken, StoreError>> + Send {
        AsyncStore::execute_one_async(&self.store, take)
    }
    fn read_async(
        &self,
        slots: &[Slot<'_>],
    ) -> impl Future<Output = Result<(f64, Vec<Option<State>>), StoreError>> + Send {
        AsyncStore::read_async(&self.store, slots)
    }
    fn delete_async(
        &self,
        name: &str,
        key: Option<&str>,
        shards: u16,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        AsyncStore::delete_async(&self.store, name, key, shards)
    }
}

/// Runs `sql` on the PostgreSQL at `url`, on a connection and a runtime of its own (on a
/// thread of its own, so that it works from inside a runtime too, as from a `Drop`).
#[cfg(feature = "postgres")]
pub(crate) fn pg_batch(url: &str, sql: &str) -> Result<(), tokio_postgres::Error> {
    let (url, sql) = (url.to_owned(), sql.to_owned());
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await?;
            tokio::spawn(connection);
            client.batch_execute(&sql).await
        })
    })
    .join()
    .expect("the statement's thread")
}

/// A table of a test's own in a test database, dropped when this is.
#[cfg(feature = "postgres")]
pub(crate) struct DropTable {
    pub(crate) url: String,
    pub(crate) table: String,
}

#[cfg(feature = "postgres")]
impl DropTable {
    /// A fresh table name for this process: `<prefix>_<pid>_<n>`.
    pub(crate) fn new(url: &str, prefix: &str) -> Self {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        DropTable { url: url.to_owned(), table: format!("{prefix}_{}_{n}", std::process::id()) }
    }
}

#[cfg(feature = "postgres")]
impl Drop for DropTable {
    fn drop(&mut self) {
        // The store made functions beside its table, for its one-statement requests.
        let _ = pg_batch(
            &self.url,
            &format!(
                "DROP TABLE IF EXISTS {0}; DROP FUNCTION IF EXISTS {0}_takes; \
                 DROP FUNCTION IF EXISTS {0}_take",
                self.table
            ),
        );
    }
}
