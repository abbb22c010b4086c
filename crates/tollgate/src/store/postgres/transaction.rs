//! The limiter inside a transaction of the caller's ([`PgTransaction`]): each request as
//! statements sent as text on the caller's client, on the table a store made.

use tokio_postgres::GenericClient;
use tollgate_algebra::slots::{Concurrency, SlotAnswer, SlotOp};
use tollgate_algebra::{Clock, OneTake, Outcome, Plan, Slot, State, Taken};

use super::plan::{delete_all, execute_in, load};
use super::schema::{pg_error, query, text};
use super::single::{OneRow, answer, decided};
use super::slots::{SlotCall, slots_in, slots_with_in};
use crate::error::StoreError;
use crate::store::seam::{AsyncStore, BoxFuture};
use crate::store::sql::{MAX_TABLE, PgSql, valid_table};

/// The limiter inside a transaction of your own (tokio-postgres): the tokens are spent if
/// you commit and given back if you roll back. The table must exist (open a [`PgStore`]
/// once, or create it as that does). The slots' locks are held until your transaction ends:
/// take several limits in one `transaction_async` (locked in ascending order) rather than
/// one after another, or your transaction may deadlock with a request that locks them all
/// (PostgreSQL then fails one of the two with an error; nothing is admitted by it).
///
/// Works on anything tokio-postgres calls a [`GenericClient`]: a `Transaction` (the usual
/// case) or a `Client` (each statement then commits alone: use that only for tests). Each
/// request is one round trip for a one-take (the table's `take` function), two for a
/// transaction or a sharded limit.
///
/// # Examples
///
/// ```no_run
/// use tollgate::store::{PgStore, PgTransaction};
/// use tollgate::{Config, RateLimiter, MINUTE};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let url = "postgres://postgres@127.0.0.1/app";
/// let limiter = RateLimiter::new(PgStore::open(url).await?);
/// let (mut client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
/// tokio::spawn(connection);
/// let tx = client.transaction().await?;
/// let orders = ("orders", Config::token_bucket(1.0, MINUTE));
/// if limiter.on(PgTransaction::new(&tx)).limit_async(orders, "alice").await?.ok {
///     tx.execute("INSERT INTO orders (item) VALUES ('book')", &[]).await?;
///     tx.commit().await?; // the token is spent together with the order
/// } // dropped without commit: rolled back, the token is back
/// # Ok(())
/// # }
/// ```
///
/// [`PgStore`]: super::PgStore
pub struct PgTransaction<'t, T, C = tollgate_algebra::SystemClock> {
    client: &'t T,
    sql: PgSql,
    clock: Option<C>,
}

impl<'t, T: GenericClient + Sync> PgTransaction<'t, T> {
    /// The limiter's states in `client`'s transaction, in the default table, on the
    /// database's clock.
    pub fn new(client: &'t T) -> Self {
        PgTransaction { client, sql: PgSql::new("tollgate_state"), clock: None }
    }
}

impl<'t, T: GenericClient + Sync, C: Clock> PgTransaction<'t, T, C> {
    /// The same, in `table`, on `clock`: for tests.
    ///
    /// # Errors
    ///
    /// A table name other than letters, digits and `_`.
    pub fn with_table_and_clock(client: &'t T, table: &str, clock: C) -> Result<Self, StoreError> {
        if !valid_table(table) {
            return Err(StoreError::new(format!(
                "postgres: table name {table:?}: use letters, digits and _, at most {MAX_TABLE}"
            )));
        }
        Ok(PgTransaction { client, sql: PgSql::new(table), clock: Some(clock) })
    }

    fn now(&self) -> Option<f64> {
        self.clock.as_ref().map(Clock::now)
    }
}

impl<T: GenericClient + Sync, C: Clock> AsyncStore for PgTransaction<'_, T, C> {
    fn execute_async<'a>(&'a self, plan: &'a Plan<'_>) -> BoxFuture<'a, Outcome> {
        Box::pin(async move {
            execute_in(self.client, &text(&self.sql), plan, self.now())
                .await
                .map_err(|e| pg_error("request failed", e))
        })
    }

    fn execute_one_async<'a>(&'a self, take: &'a OneTake<'_>) -> BoxFuture<'a, Taken> {
        Box::pin(async move {
            let row = OneRow::new(take, self.now());
            let rows = query(self.client, text(&self.sql).take, &row.params())
                .await
                .map_err(|e| pg_error("request failed", e))?;
            let found = rows.first().ok_or_else(|| StoreError::new("postgres: no answer"))?;
            decided(take, answer(found)?)
        })
    }

    fn read_async<'a>(&'a self, slots: &'a [Slot<'_>]) -> BoxFuture<'a, (f64, Vec<Option<State>>)> {
        Box::pin(async move {
            load(self.client, &text(&self.sql), slots, self.now(), true)
                .await
                .map(|(now, states, _)| (now, states))
                .map_err(|e| pg_error("read failed", e))
        })
    }

    fn delete_async<'a>(
        &'a self,
        name: &'a str,
        key: Option<&'a str>,
        shards: u16,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            delete_all(self.client, &text(&self.sql), name, key, shards)
                .await
                .map_err(|e| pg_error("delete failed", e))
        })
    }

    /// Within your transaction: the holder is there if you commit, and gone (never held) if
    /// you roll back; a release or renewal likewise. The (name, key)'s lock is held until
    /// your transaction ends, so every other operation on it waits for that.
    fn slots_async<'a>(
        &'a self,
        name: &'a str,
        key: Option<&'a str>,
        limit: &'a Concurrency,
        op: &'a SlotOp,
    ) -> BoxFuture<'a, SlotAnswer> {
        Box::pin(async move {
            let call = SlotCall { name, key, limit, op };
            slots_in(self.client, &text(&self.sql), call, self.now())
                .await
                .map_err(super::slots::Failed::into_store_error)
        })
    }

    /// Within your transaction, as `slots_async`: the holder and the tokens are there if
    /// you commit, both gone if you roll back.
    fn slots_with_async<'a>(
        &'a self,
        name: &'a str,
        key: Option<&'a str>,
        limit: &'a Concurrency,
        op: &'a SlotOp,
        plan: &'a Plan<'_>,
    ) -> BoxFuture<'a, (SlotAnswer, Outcome)> {
        Box::pin(async move {
            let call = SlotCall { name, key, limit, op };
            slots_with_in(self.client, &text(&self.sql), call, plan, self.now())
                .await
                .map_err(super::slots::Failed::into_store_error)
        })
    }
}
