//! The public API in the shapes users write it: typed names with borrowed keys, inline
//! configs, names defined at run time.

use tollgate::{Call, Config, Limits, MINUTE, MemoryStore, RateLimiter, Request, Target};

#[derive(Clone, Copy)]
enum Limit {
    PerUser,
    Global,
}

impl Limits for Limit {
    fn name(self) -> &'static str {
        match self {
            Limit::PerUser => "perUser",
            Limit::Global => "global",
        }
    }
    fn config(self) -> Config {
        match self {
            Limit::PerUser => const { Config::token_bucket(10.0, MINUTE) },
            Limit::Global => const { Config::fixed_window(100.0, MINUTE) },
        }
    }
}

/// Keys usually come from the request being served: borrowed, not 'static.
fn serve(limiter: &RateLimiter, user: &str) -> bool {
    let owned = format!("team-of-{user}");
    let team: &str = &owned;
    limiter.limit(Limit::PerUser, user).unwrap().ok
        && limiter.check(Limit::PerUser, Request::new().key(team)).unwrap().ok
        && limiter
            .transaction(&[
                Target::from(Limit::PerUser).with(team),
                Call::new(Limit::Global, Request::new()),
                Call::new(("inline", Config::token_bucket(1.0, MINUTE)), user),
            ])
            .unwrap()
            .ok
}

#[test]
fn typed_names_take_borrowed_keys() {
    let limiter = RateLimiter::new(MemoryStore::new());
    let user = String::from("alice");
    assert!(serve(&limiter, &user));
    assert!(
        !limiter.limit(("inline", Config::token_bucket(1.0, MINUTE)), user.as_str()).unwrap().ok
    );
}

#[test]
fn names_defined_at_run_time_are_listed() {
    let limiter = RateLimiter::builder(MemoryStore::new())
        .define("a", Config::token_bucket(1.0, MINUTE))
        .build();
    let names: Vec<&str> = limiter.defined().map(|(n, _)| n).collect();
    assert_eq!(names, ["a"]);
    assert!(limiter.limit("a", Request::new()).unwrap().ok);
}

#[test]
fn only_limits_made_to_fail_open_are_granted_when_the_store_fails() {
    use tollgate::store::Unavailable;
    use tollgate::{Decision, Error};

    let limiter = RateLimiter::builder(Unavailable::new("down"))
        .fail_open("search")
        .fail_open("feed")
        .build();
    let search = Target::Inline("search", Config::token_bucket(100.0, MINUTE).with_capacity(5.0));
    let feed = Target::Inline("feed", Config::token_bucket(10.0, MINUTE).with_shards(4));
    let signup = Target::Inline("signup", Config::token_bucket(3.0, MINUTE));

    let taken = limiter.limit_with_status(search, "alice").unwrap();
    assert_eq!(taken.decision, Decision::ADMIT);
    assert!(!taken.status.is_known(), "nothing is known: no numbers ({:?})", taken.status);
    assert!(limiter.check(search, "alice").unwrap().ok);
    assert!(limiter.limit(feed, Request::new()).unwrap().ok, "sharded too");
    assert!(matches!(limiter.limit(signup, "alice"), Err(Error::Store(_))), "the default");
    // Still an error: a request that can never succeed.
    assert!(matches!(limiter.limit(search, Request::new().count(-1.0)), Err(Error::Invalid(_))));
    // A transaction fails open only if all of its limits do.
    let t = limiter.transaction(&[search.with("alice"), feed.with(Request::new())]).unwrap();
    assert!(t.ok);
    assert_eq!(t.results[..], [Decision::ADMIT; 2]);
    assert!(matches!(
        limiter.transaction(&[search.with("alice"), signup.with("alice")]),
        Err(Error::Store(_))
    ));
    assert_eq!(limiter.failed_open(), 4);
}

/// A transaction whose takes of one state add up past what the limit can ever grant is
/// invalid, as a single count past it is (not a refusal with a wait that never comes), and
/// takes nothing; in any number of calls.
fn never_fitting_transactions_are_invalid(
    label: &str,
    run: &dyn Fn(&[Call<'_>]) -> Result<tollgate::TransactionDecision, tollgate::Error>,
) {
    let hundred = Config::token_bucket(100.0, MINUTE);
    for n in [2, 4, 101] {
        let count = 101.0 / f64::from(n);
        let calls: Vec<Call<'_>> = (0..n)
            .map(|_| Target::from(("api", hundred)).with(Request::new().key("a").count(count)))
            .collect();
        let err = run(&calls).unwrap_err();
        assert!(
            matches!(err, tollgate::Error::Invalid(_))
                && err.to_string().contains("Rate limit api count 101 exceeds 100"),
            "{label} {n}: {err}"
        );
    }
    // With maxReserved, reservations may go past capacity by that much, no further.
    let reserving = Config::token_bucket(100.0, MINUTE).with_max_reserved(50.0);
    let booked = |count: f64| {
        Target::from(("booked", reserving)).with(Request::new().key("a").count(count).reserve())
    };
    let err = run(&[booked(100.0), booked(51.0)]).unwrap_err();
    assert!(err.to_string().contains("count 151 exceeds 150"), "{label}: {err}");
    assert!(run(&[booked(100.0), booked(50.0)]).unwrap().ok, "{label}");
    // Nothing was taken by the invalid ones: api still grants 100.
    let all = Target::from(("api", hundred)).with(Request::new().key("a").count(100.0));
    assert!(run(&[all]).unwrap().ok, "{label}");
    // A transaction that could fit, refused now, is a refusal with its wait.
    let one = || Target::from(("api", hundred)).with(Request::new().key("a"));
    let refused = run(&[one(), one()]).unwrap();
    assert!(!refused.ok && refused.retry_after.is_some(), "{label}");
}

#[test]
fn a_transaction_that_can_never_fit_one_state_is_invalid_memory() {
    let limiter = RateLimiter::new(MemoryStore::new());
    never_fitting_transactions_are_invalid("memory", &|calls| limiter.transaction(calls));
}

/// On a store that is awaited (the async calls of SQLite's writer thread).
#[cfg(feature = "sqlite")]
#[test]
fn a_transaction_that_can_never_fit_one_state_is_invalid_awaited() {
    let dir = tempfile::tempdir().unwrap();
    let limiter =
        RateLimiter::new(tollgate::store::SqliteStore::open(dir.path().join("t.db")).unwrap());
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    never_fitting_transactions_are_invalid("sqlite", &|calls| {
        runtime.block_on(limiter.transaction_async(calls))
    });
}
