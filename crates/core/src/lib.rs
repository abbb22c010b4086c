//! The algebra of [tollgate] rate limits, with no I/O: configs, validation, evaluation,
//! sharding and clocks.
//!
//! Every limit is two numbers per (name, key, shard), a [`State`] of `value` and `ts`,
//! updated by [`evaluate`]. A request to a store is a [`Plan`]: the store loads the plan's
//! [`Slot`]s, calls [`Plan::decide`] with the time, and saves the states it marks changed.
//! Nothing here reads a clock or touches storage, so every store, and any client that
//! fetched a state, gets the same numbers.
//!
//! # Examples
//!
//! ```
//! use tollgate_algebra::{evaluate, Config, Decision, MINUTE, SECOND};
//!
//! let config = Config::token_bucket(10.0, MINUTE);
//! let t0 = 1_700_000_000_000.0;
//! let first = evaluate(&config, None, 0.0, t0, 5.0, false);
//! let second = evaluate(&config, Some(first.state), 0.0, t0 + 6.0 * SECOND, 6.0, false);
//! assert_eq!(second.state.value, 0.0);
//! let third = evaluate(&config, Some(second.state), 0.0, t0 + 6.0 * SECOND, 10.0, false);
//! assert_eq!(third.decision, Decision { ok: false, retry_after: Some(MINUTE) });
//! ```
//!
//! [tollgate]: https://docs.rs/tollgate

mod calendar;
mod carry;
mod clock;
mod config;
mod eval;
pub mod lease;
mod plan;
pub mod slots;

pub use calendar::{Calendar, CalendarUnit, UnknownZone};
pub use carry::{Carry, carry_counts, carrying};
pub use clock::{Clock, ManualClock, SystemClock};
pub use config::{
    Config, ConfigError, DAY, HOUR, Kind, MAX_AMOUNT, MAX_SHARDS, MIN_PERIOD, MIN_RATE, MINUTE,
    Period, RawConfig, SECOND, fmt_number, serialize_number,
};
pub use eval::{
    Decision, Evaluation, InvalidRequest, MAX_KEY_BYTES, MAX_NAME_BYTES, State, Status, alignment,
    evaluate, evaluate_adjust, fresh_state, full_at, splitmix64, unit_interval,
    validate_adjust_count, validate_count, validate_name_key,
};
pub use plan::{
    Adjusted, Inline, OneTake, Outcome, Plan, Reading, Sample, Slot, Split, Take, Taken,
    longest_refusal, max_option, read, sample_shards,
};
