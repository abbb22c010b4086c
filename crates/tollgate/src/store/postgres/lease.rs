//! Leases on PostgreSQL (issue 34, the store's side): a step on a leased shard is one
//! statement, the table's `lease` function, which loads the state with its lease records (the
//! row's `leases` column), runs the step and saves them; the answer is the core's, computed
//! from what the function loaded (`store::lease`, shared with Redis, checks the function
//! against it on every step).

use std::time::Duration;

use tollgate_algebra::lease::Leased;
use tollgate_algebra::{Clock, Slot};

use super::single::LeaseRow;
use super::worker::Job;
use super::{PgStore, Shared};
use crate::error::StoreError;
use crate::store::lease::{self, LeaseStats, LeaseStore, Leases, Step};

impl<C: Clock> PgStore<C> {
    /// Returns every lease this store holds (for a graceful shutdown: the tokens go back to
    /// the limit at once instead of when the leases expire). Leases are fetched again on
    /// the next take.
    ///
    /// # Errors
    ///
    /// The first store error; the other leases are returned all the same.
    pub async fn release_leases(&self) -> Result<(), StoreError> {
        lease::release_all(&*self.shared).await
    }

    /// Per leased limit, its keys leased now in this process and its takes no lease served
    /// (cold keys: see [`LeaseOptions::hot_after`](crate::store::LeaseOptions::hot_after)).
    pub fn lease_names(&self) -> Vec<lease::LeasedName> {
        lease::names(self.shared.leases.as_ref())
    }

    /// What each leased (name, key) did in this process.
    pub fn lease_stats(&self) -> Vec<(String, Option<String>, LeaseStats)> {
        lease::stats(self.shared.leases.as_ref())
    }

    /// The tokens of the leased limit (name, key) leased out now, over every process
    /// (`/v1/value` reports them beside the value, which is what a direct take may take).
    ///
    /// # Errors
    ///
    /// The store's.
    pub async fn leased_out(
        &self,
        name: &str,
        key: Option<&str>,
        config: &tollgate_algebra::Config,
    ) -> Result<f64, StoreError> {
        lease::leased_out(&*self.shared, &lease::look_slot(name, key, *config)).await
    }
}

impl<C: Clock> LeaseStore for Shared<C> {
    const NAME: &'static str = "postgres";

    async fn lease_call(
        &self,
        slot: &Slot<'_>,
        step: Step,
    ) -> Result<(f64, Leased, Vec<f64>), StoreError> {
        let row = Box::new(LeaseRow::new(slot, step, self.now()));
        self.submit(|ticket| Job::Lease(row, ticket)).await
    }

    async fn announce(
        &self,
        name: &str,
        said: &str,
        ttl: Duration,
    ) -> Result<Option<String>, StoreError> {
        let job =
            (self.sql.announce.clone(), name.to_owned(), said.to_owned(), ttl.as_secs_f64() * 1e3);
        self.submit(|ticket| Job::Announce(Box::new(job), ticket)).await
    }

    fn leases(&self) -> Option<&Leases> {
        self.leases.as_ref()
    }

    fn clock_now(&self) -> Option<f64> {
        self.now()
    }
}

/// Leases on PostgreSQL (issue 34): the `lease` function against tollgate-algebra's model,
/// several leasing processes against the interval bound, the paths that would ignore
/// lease records refused.
#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use tokio_postgres::NoTls;
    use tollgate_algebra::lease::Leased;
    use tollgate_algebra::{Config, ManualClock, Take};

    use super::super::PgTransaction;
    use super::super::group_tests::{OnTable, url};
    use super::*;
    use crate::store::lease::testing::{
        self, Leasing, Op, act, an_adjust_gives_back_no_more_than_the_leases_leave, config, op,
        processes, run_op, transaction_takes_a_leased_limit_directly, worst,
    };
    use crate::store::lease::{Answer, LeaseOptions, LeaseStats};
    use crate::store::seam::AsyncStore;
    use crate::store::testing::{T0, writing};

    impl OnTable {
        /// Every key leased from its first take (`hot_after(1)`): these tests are of the
        /// leases themselves.
        async fn leasing(url: &str, test: &str, clock: &ManualClock, name: &str) -> Self {
            let options = LeaseOptions::new().term(Duration::from_millis(800)).hot_after(1);
            Self::leasing_with(url, test, clock, name, options).await
        }

        async fn leasing_with(
            url: &str,
            test: &str,
            clock: &ManualClock,
            name: &str,
            options: LeaseOptions,
        ) -> Self {
            let table = format!("tollgate_{test}_{}", std::process::id());
            let store = PgStore::builder()
                .table(&table)
                .lease(name, options)
                .open_with_clock(url, clock.clone())
                .await;
            OnTable { store: store.unwrap(), url: url.to_owned(), table }
        }
    }

    impl Leasing for PgStore<ManualClock> {
        fn stats(&self) -> Vec<LeaseStats> {
            self.lease_stats().into_iter().map(|(_, _, s)| s).collect()
        }

        fn names(&self) -> Vec<crate::store::lease::LeasedName> {
            self.lease_names()
        }

        async fn release(&self) {
            self.release_leases().await.unwrap();
        }
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(100))]

        /// Random steps on one leased shard, in PostgreSQL and in tollgate-algebra's model:
        /// every answer the same (checked on each step against what the function
        /// loaded, too), and what the table keeps is the model's state and records.
        #[test]
        fn postgres_runs_lease_steps_as_the_model(
            config in config(),
            ops in prop::collection::vec(op(), 1..40),
        ) {
            let Some(url) = url() else { return Ok(()) };
            runtime().block_on(async {
                let clock = ManualClock::new(T0);
                let on = OnTable::open(&url, "lease_model", &clock).await;
                let take = Take { name: "t", key: None, config, count: 1.0, reserve: false };
                let slot = writing(&take).slot;
                let mut model = Leased::default();
                for &op in &ops {
                    if let Op::Wait(dt) = op {
                        clock.advance(dt);
                    }
                    let now = clock.now();
                    let (answer, expected) =
                        run_op(&on.store, &*on.store.shared, &mut model, &slot, now, op).await;
                    assert_eq!(answer, expected, "{op:?} at {now}");
                }
                // What the table keeps (a look loads it as it is) is the model's.
                let look = Step::Take { count: 0.0, reserve: false, writes: false };
                let (now, kept, _) = on.store.shared.lease_call(&slot, look).await.unwrap();
                let (c, a) = (&slot.config, slot.alignment);
                // A state forgotten by a reset keeps its records: stored all the same.
                if kept.state.is_some() || !kept.leases.is_empty() {
                    let (mut kept, mut model) = (kept, model.clone());
                    assert_eq!(kept.advance(c, a, now), model.advance(c, a, now));
                    assert_eq!(kept.leases, model.leases);
                } else {
                    let mut advanced = model.clone();
                    let state = advanced.advance(c, a, now);
                    assert!(advanced.leases.is_empty() && state.value >= c.capacity());
                }
                on.store.delete_async("t", None, 1).await.unwrap();
            });
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(16))]

        /// Four processes, each its own store leasing the limit, on one table and one
        /// (manual) clock, take, wait, get killed and return their leases: no interval
        /// admits more than one bucket would.
        #[test]
        fn leased_processes_never_admit_more_than_the_limit(
            bucket in any::<bool>(),
            acts in prop::collection::vec(act(), 50..250),
        ) {
            let Some(url) = url() else { return Ok(()) };
            let config = if bucket {
                Config::token_bucket(20.0, 1_000.0).with_capacity(40.0)
            } else {
                Config::fixed_window(20.0, 1_000.0)
            };
            let admitted = runtime().block_on(async {
                let clock = ManualClock::new(T0);
                let on = OnTable::open(&url, "lease_processes", &clock).await;
                let table = on.table.clone();
                let open = async || {
                    PgStore::builder()
                        .table(&table)
                        .lease("hot", LeaseOptions::new().term(Duration::from_millis(800)).hot_after(1))
                        .open_with_clock(&url, clock.clone())
                        .await
                        .unwrap()
                };
                let (admitted, _) = processes(&clock, config, &acts, open).await;
                drop(on);
                admitted
            });
            let worst = worst(&config, &admitted);
            prop_assert!(worst <= 1e-6, "{worst} over the bound: {admitted:?}");
        }
    }

    /// Far from its bound, a hot limit is answered from the lease, with few calls to
    /// the database.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hot_limit_is_answered_from_the_lease() {
        let Some(url) = url() else { return };
        let clock = ManualClock::new(T0);
        let on = OnTable::leasing(&url, "lease_hot", &clock, "hot").await;
        let config = Config::token_bucket(1_000.0, 1_000.0).with_capacity(1_000.0);
        let take = Take { name: "hot", key: None, config, count: 1.0, reserve: false };
        let one = writing(&take);
        for i in 0..600 {
            assert!(on.store.execute_one_async(&one).await.unwrap().decision.ok);
            if i % 10 == 0 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        let stats = on.store.lease_stats()[0].2;
        assert!(stats.local >= 400 && stats.direct <= 200, "mostly from the lease: {stats:?}");
        // Returned: the table reads as if only the 600 were taken. (A grant still on its
        // way at the return would stay out until its expiry, by design: let it land.)
        tokio::time::sleep(Duration::from_millis(100)).await;
        on.store.release_leases().await.unwrap();
        let (_, states) = on.store.read_async(&[one.slot]).await.unwrap();
        assert_eq!(states[0].unwrap().value, 400.0);
    }

    /// A transaction takes a leased limit directly from the table (not from a lease),
    /// all or nothing with the others, and never past what the leases out leave; the
    /// records are kept.
    /// An adjust of a leased limit gives back no more than its leases leave room for (see
    /// `an_adjust_gives_back_no_more_than_the_leases_leave`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_adjust_keeps_the_lease_bound() {
        let Some(url) = url() else { return };
        let clock = ManualClock::new(T0);
        let on = OnTable::leasing(&url, "lease_adjust", &clock, "hot").await;
        an_adjust_gives_back_no_more_than_the_leases_leave(&on.store, &*on.store.shared).await;
    }

    /// Only hot keys are leased (see `only_hot_keys_are_leased`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn only_hot_keys_are_leased() {
        let Some(url) = url() else { return };
        let clock = ManualClock::new(T0);
        let options = LeaseOptions::new().term(Duration::from_millis(800));
        let on = OnTable::leasing_with(&url, "lease_hot_keys", &clock, "hot", options).await;
        testing::only_hot_keys_are_leased(&on.store, &*on.store.shared, &clock).await;
    }

    /// A release right after the take that asked for a lease (see
    /// `a_grant_on_its_way_at_a_release_goes_back`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_grant_on_its_way_at_a_release_goes_back() {
        let Some(url) = url() else { return };
        let on = OnTable::leasing(&url, "lease_release_race", &ManualClock::new(T0), "hot").await;
        testing::a_grant_on_its_way_at_a_release_goes_back(&on.store).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_transaction_takes_a_leased_limit_directly() {
        let Some(url) = url() else { return };
        let clock = ManualClock::new(T0);
        let on = OnTable::leasing(&url, "lease_transaction", &clock, "hot").await;
        transaction_takes_a_leased_limit_directly(&on.store, &*on.store.shared, &clock).await;
    }

    /// Checks take no lease and no entry; idle keys' entries come back (see
    /// `checks_take_no_lease_and_idle_keys_make_room`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn checks_take_no_lease_and_idle_keys_make_room() {
        let Some(url) = url() else { return };
        let clock = ManualClock::new(T0);
        let on = OnTable::leasing(&url, "lease_room", &clock, "hot").await;
        testing::checks_take_no_lease_and_idle_keys_make_room(&on.store, &clock).await;
    }

    /// A reset from a process that never took from the leased limit (see
    /// `a_reset_needs_no_lease_of_its_own`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reset_needs_no_lease_of_its_own() {
        let Some(url) = url() else { return };
        let clock = ManualClock::new(T0);
        let on = OnTable::leasing(&url, "lease_reset", &clock, "hot").await;
        testing::a_reset_needs_no_lease_of_its_own(&on.store, &*on.store.shared, &clock).await;
    }

    /// A state with lease records is refused by every path that would ignore them (the
    /// `take` function, a caller's transaction), before writing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn paths_that_ignore_leases_refuse_a_leased_state() {
        let Some(url) = url() else { return };
        let clock = ManualClock::new(T0);
        let on = OnTable::open(&url, "lease_refused", &clock).await;
        let take = Take {
            name: "t",
            key: None,
            config: Config::token_bucket(10.0, 1_000.0),
            count: 1.0,
            reserve: false,
        };
        let one = writing(&take);
        let grant = Step::Grant { holder: 7, want: 10.0, unused: 0.0, term: 60_000.0, share: 1.0 };
        let (Answer::Granted(g), _, _) =
            lease::step(&*on.store.shared, &one.slot, grant).await.unwrap()
        else {
            panic!()
        };
        assert_eq!(g.tokens, 10.0);
        clock.advance(5_000.0);
        let error = on.store.execute_one_async(&one).await.unwrap_err();
        assert!(error.message().contains("t holds lease records"), "{error}");
        // A transaction of the store's own reads the records and takes directly, under
        // the cap they set (nothing left: refused); a caller's transaction refuses.
        assert!(!on.store.execute_async(&one.to_plan()).await.unwrap().ok);
        let (client, connection) = tokio_postgres::connect(&url, NoTls).await.unwrap();
        tokio::spawn(connection);
        let mut client = client;
        let transaction = client.transaction().await.unwrap();
        let theirs =
            PgTransaction::with_table_and_clock(&transaction, &on.table, clock.clone()).unwrap();
        let error = theirs.execute_async(&one.to_plan()).await.unwrap_err();
        assert!(error.message().contains("t holds lease records"), "{error}");
        drop(transaction);
        // Still leased, and the bucket still capped: nothing has flowed in past the lease.
        let direct = Step::Take { count: 1.0, reserve: false, writes: true };
        let (answer, _, _) = lease::step(&*on.store.shared, &one.slot, direct).await.unwrap();
        assert_eq!(answer, Answer::Taken(false));
        let back = Step::Release { holder: 7, unused: 10.0 };
        lease::step(&*on.store.shared, &one.slot, back).await.unwrap();
        // No records left: a plain take takes it again.
        assert!(on.store.execute_one_async(&one).await.unwrap().decision.ok);
    }
}
