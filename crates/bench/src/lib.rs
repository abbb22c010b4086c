//! What the benchmarks of tollgate share: the scenarios, built the same way for tollgate and
//! for governor, so the criterion bench and the memory report measure the same thing.

use std::num::NonZeroU32;

use governor::{DefaultKeyedRateLimiter, Quota};
use tollgate::{Config, Limits, MemoryStore, RateLimiter, SECOND};

/// A generous rate, so that every scenario measures the admit path of both libraries.
pub const RATE_PER_SECOND: u32 = 1_000_000_000;

/// The limits of the scenarios, declared as a user would.
#[derive(Clone, Copy, Debug)]
pub enum Limit {
    /// A per-user limit.
    PerUser,
    /// A per-team limit.
    PerTeam,
    /// One global limit.
    Global,
}

impl Limits for Limit {
    fn name(self) -> &'static str {
        match self {
            Limit::PerUser => "perUser",
            Limit::PerTeam => "perTeam",
            Limit::Global => "global",
        }
    }
    fn config(self) -> Config {
        const GENEROUS: Config = Config::token_bucket(RATE_PER_SECOND as f64, SECOND);
        GENEROUS
    }
}

/// A tollgate limiter on the memory store.
pub fn tollgate() -> RateLimiter<MemoryStore> {
    RateLimiter::new(MemoryStore::new())
}

/// governor's keyed limiter (dashmap, quanta clock: its defaults) with the same rate.
pub fn governor_keyed() -> DefaultKeyedRateLimiter<String> {
    governor::RateLimiter::keyed(quota())
}

/// governor's direct (unkeyed) limiter with the same rate.
pub fn governor_direct() -> governor::DefaultDirectRateLimiter {
    governor::RateLimiter::direct(quota())
}

fn quota() -> Quota {
    Quota::per_second(NonZeroU32::new(RATE_PER_SECOND).expect("non-zero"))
}

/// `n` distinct keys shaped like user ids.
pub fn keys(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("user-{i:08}")).collect()
}
