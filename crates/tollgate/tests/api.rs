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
