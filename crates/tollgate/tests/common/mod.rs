//! What the backend test files share: where a backend is, stores that own what they were
//! made on, and (from `tollgate::testing`) the limiter's operations through either of its two
//! APIs. Each test file
//! uses some of it.
#![allow(dead_code)]

use tollgate::core::slots::{Concurrency, SlotAnswer, SlotOp};
use tollgate::core::{OneTake, Outcome, Plan, Slot, State, Taken};
use tollgate::store::BoxFuture;
use tollgate::{AsyncStore, Store, StoreError};

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

// The suite's own harness (the sync and async APIs behind one trait), which the tests that
// compare stores share.
#[cfg(feature = "testing")]
#[allow(unused_imports)]
pub(crate) use tollgate::testing::{Api, AsyncApi, SyncApi, runtime};

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
    fn slots(
        &self,
        name: &str,
        key: Option<&str>,
        limit: &Concurrency,
        op: &SlotOp,
    ) -> Result<SlotAnswer, StoreError> {
        self.store.slots(name, key, limit, op)
    }
    fn slots_with(
        &self,
        name: &str,
        key: Option<&str>,
        limit: &Concurrency,
        op: &SlotOp,
        plan: &Plan<'_>,
    ) -> Result<(SlotAnswer, Outcome), StoreError> {
        self.store.slots_with(name, key, limit, op, plan)
    }
}

impl<S: AsyncStore, R: Send + Sync> AsyncStore for Owned<S, R> {
    fn immediate(&self) -> Option<&dyn Store> {
        self.store.immediate()
    }
    fn execute_async<'a>(&'a self, plan: &'a Plan<'_>) -> BoxFuture<'a, Outcome> {
        self.store.execute_async(plan)
    }
    fn execute_one_async<'a>(&'a self, take: &'a OneTake<'_>) -> BoxFuture<'a, Taken> {
        self.store.execute_one_async(take)
    }
    fn read_async<'a>(&'a self, slots: &'a [Slot<'_>]) -> BoxFuture<'a, (f64, Vec<Option<State>>)> {
        self.store.read_async(slots)
    }
    fn delete_async<'a>(
        &'a self,
        name: &'a str,
        key: Option<&'a str>,
        shards: u16,
    ) -> BoxFuture<'a, ()> {
        self.store.delete_async(name, key, shards)
    }
    fn slots_async<'a>(
        &'a self,
        name: &'a str,
        key: Option<&'a str>,
        limit: &'a Concurrency,
        op: &'a SlotOp,
    ) -> BoxFuture<'a, SlotAnswer> {
        self.store.slots_async(name, key, limit, op)
    }
    fn slots_with_async<'a>(
        &'a self,
        name: &'a str,
        key: Option<&'a str>,
        limit: &'a Concurrency,
        op: &'a SlotOp,
        plan: &'a Plan<'_>,
    ) -> BoxFuture<'a, (SlotAnswer, Outcome)> {
        self.store.slots_with_async(name, key, limit, op, plan)
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
        // The store made functions beside its table, for its one-statement requests, and
        // the table of concurrency limits' holders.
        let _ = pg_batch(
            &self.url,
            &format!(
                "DROP TABLE IF EXISTS {0}; DROP FUNCTION IF EXISTS {0}_takes; \
                 DROP FUNCTION IF EXISTS {0}_take; DROP TABLE IF EXISTS {0}_slots",
                self.table
            ),
        );
    }
}
