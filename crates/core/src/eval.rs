//! The algebra of SPEC §2: one shard's state, evaluated at a time, for a count.

use std::fmt;

use crate::calendar::Calendar;
use crate::config::{Config, Kind, fmt_number};

/// The two numbers stored per (name, key, shard).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct State {
    /// Tokens available at `ts`; negative after a reservation.
    pub value: f64,
    /// Milliseconds since the Unix epoch: a token bucket's last evaluation, or the start of a
    /// fixed window's current window.
    pub ts: f64,
}

/// The answer to a request: admitted or refused, and when to come back.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct Decision {
    /// Whether the tokens were (or, for a check, would be) granted.
    pub ok: bool,
    /// Milliseconds to wait: before retrying when refused, before doing the work when a
    /// reservation was granted. `None` when granted with tokens on hand.
    pub retry_after: Option<f64>,
}

impl Decision {
    /// Granted with tokens on hand.
    pub const ADMIT: Decision = Decision { ok: true, retry_after: None };
}

/// The result of evaluating one shard: the state it would store and the decision.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Evaluation {
    /// `value'` and `ts'`. Stored only when `decision.ok` and the operation writes.
    pub state: State,
    /// The decision for this shard alone.
    pub decision: Decision,
}

impl Evaluation {
    /// What the limit has left after this evaluation: of the new state if it was granted, of
    /// the state as it stands (nothing taken) if it was refused.
    #[inline]
    pub fn status(&self, shard: &Config, count: f64, now: f64) -> Status {
        let state = if self.decision.ok {
            self.state
        } else {
            State { value: self.state.value + count, ts: self.state.ts }
        };
        Status {
            remaining: state.value.max(0.0),
            reset_after: (full_at(shard, state) - now).max(0.0),
        }
    }
}

/// What a limit has left right after a request: for the IETF RateLimit header fields and for
/// dashboards.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct Status {
    /// Tokens available now, never negative (0 while reservations are outstanding). For a
    /// sharded limit, estimated for the whole limit from the shards the request used.
    pub remaining: f64,
    /// Milliseconds until the limit is full again; 0 when it is full.
    pub reset_after: f64,
}

impl Status {
    /// Nothing is known: a request granted because the store failed and its limit fails open
    /// (both numbers NaN). The RateLimit header fields are left out for it, rather than
    /// claim a full limit while no one can tell.
    pub const UNKNOWN: Status = Status { remaining: f64::NAN, reset_after: f64::NAN };

    /// Whether the numbers are known (see [`Status::UNKNOWN`]).
    pub fn is_known(&self) -> bool {
        !self.remaining.is_nan()
    }
}

/// The state a shard without a stored state starts from.
///
/// A token bucket starts full at `now`. A fixed window starts full at the start of the window
/// that contains `now`, with windows aligned to `alignment` (the config's `start`, or the
/// pseudo-random offset of [`alignment`]).
#[inline]
pub fn fresh_state(shard: &Config, alignment: f64, now: f64) -> State {
    let ts = match shard.kind() {
        Kind::TokenBucket => now,
        Kind::FixedWindow => match shard.calendar() {
            Some(calendar) => calendar.start(now),
            None => window_start(alignment, shard.period(), now),
        },
    };
    State { value: shard.capacity(), ts }
}

/// The start of the window containing `now`, for windows of `period` aligned to `alignment`.
#[inline]
fn window_start(alignment: f64, period: f64, now: f64) -> f64 {
    alignment + ((now - alignment) / period).floor() * period
}

/// Evaluates one shard (SPEC §2).
///
/// `shard` holds one shard's parameters ([`Config::per_shard`]); `state` is the stored state,
/// or `None` for a fresh one aligned to `alignment` (see [`fresh_state`]). This is a pure
/// function: clients that fetched a state with the `value` operation can run it themselves to
/// learn a limit's value at any time.
///
/// # Examples
///
/// ```
/// use tollgate_algebra::{evaluate, Config, State, MINUTE};
///
/// let config = Config::token_bucket(10.0, MINUTE);
/// // 5 tokens at t = 0; six seconds later one more has flowed back.
/// let at_6s = evaluate(&config, Some(State { value: 5.0, ts: 0.0 }), 0.0, 6_000.0, 0.0, false);
/// assert_eq!(at_6s.state.value, 6.0);
/// ```
#[inline(always)]
pub fn evaluate(
    shard: &Config,
    state: Option<State>,
    alignment: f64,
    now: f64,
    count: f64,
    reserve: bool,
) -> Evaluation {
    let state = state.unwrap_or_else(|| fresh_state(shard, alignment, now));
    let next = advance(shard, state, now, count);
    let over_reserved = -next.value > shard.reserved_bound();
    let ok = next.value >= 0.0 || (reserve && !over_reserved);
    let retry_after = (next.value < 0.0).then(|| {
        let (rate, period) = (shard.rate(), shard.period());
        let wait = match shard.kind() {
            // retryAfter = -value' / (rate / period)
            Kind::TokenBucket => -next.value * period / rate,
            // retryAfter = ts' + period * ceil(-value' / rate) - now
            Kind::FixedWindow => windows_after(shard, next.ts, (-next.value / rate).ceil()) - now,
        };
        if ok {
            // A reservation: the booked tokens have flowed in once the new state is back at 0.
            settle(now, wait, |at| advance(shard, next, at, 0.0).value >= 0.0)
        } else {
            // A refusal: the same request, made again at now + wait, is granted.
            settle(now, wait, |at| advance(shard, state, at, count).value >= 0.0)
        }
    });
    Evaluation { state: next, decision: Decision { ok, retry_after } }
}

/// Settles a cost known only after the work on one shard (SPEC §4, `adjust`): the state
/// brought to `now` as SPEC §2 does, then `value' = min(value_now - count, cap)` whatever its
/// sign. `count` is signed (what the work used beyond what was taken for it: positive takes
/// more, negative gives back); `cap` is the most the state may be raised to: the shard's
/// capacity, or less where leases hold some of it (`capacity - outstanding`). Never refused:
/// the decision is always `ok`, with the `retryAfter` of SPEC §2 when the value is negative
/// (the wait until it is back at 0).
///
/// # Examples
///
/// ```
/// use tollgate_algebra::{evaluate_adjust, Config, State, MINUTE};
///
/// let config = Config::token_bucket(10.0, MINUTE); // one token each 6 s
/// // 2 tokens left; the work used 5 more than was taken for it: 3 in debt, 18 s to pay back.
/// let e = evaluate_adjust(&config, Some(State { value: 2.0, ts: 0.0 }), 0.0, 0.0, 5.0, 10.0);
/// assert_eq!(e.state.value, -3.0);
/// assert_eq!(e.decision.retry_after, Some(18_000.0));
/// // Giving back never raises a state above its capacity.
/// let e = evaluate_adjust(&config, Some(State { value: 9.0, ts: 0.0 }), 0.0, 0.0, -4.0, 10.0);
/// assert_eq!(e.state.value, 10.0);
/// ```
#[inline]
pub fn evaluate_adjust(
    shard: &Config,
    state: Option<State>,
    alignment: f64,
    now: f64,
    count: f64,
    cap: f64,
) -> Evaluation {
    let state = state.unwrap_or_else(|| fresh_state(shard, alignment, now));
    let current = advance(shard, state, now, 0.0);
    let next = State { value: (current.value - count).min(cap), ts: current.ts };
    let retry_after = (next.value < 0.0).then(|| {
        let (rate, period) = (shard.rate(), shard.period());
        let wait = match shard.kind() {
            Kind::TokenBucket => -next.value * period / rate,
            Kind::FixedWindow => windows_after(shard, next.ts, (-next.value / rate).ceil()) - now,
        };
        settle(now, wait, |at| advance(shard, next, at, 0.0).value >= 0.0)
    });
    Evaluation { state: next, decision: Decision { ok: true, retry_after } }
}

/// Validates an `adjust`'s signed count: finite, and within [`MAX_AMOUNT`] either way.
///
/// # Errors
///
/// An [`InvalidRequest`] naming the limit and the count.
///
/// [`MAX_AMOUNT`]: crate::MAX_AMOUNT
pub fn validate_adjust_count(name: &str, count: f64) -> Result<(), InvalidRequest> {
    if count.is_finite() && count.abs() <= crate::config::MAX_AMOUNT {
        return Ok(());
    }
    Err(InvalidRequest::new(format!(
        "Rate limit {name} adjust count {} must be a finite number from -{max} to {max}.",
        fmt_number(count),
        max = fmt_number(crate::config::MAX_AMOUNT),
    )))
}

/// `value'` and `ts'` of SPEC §2 for `count` tokens taken from `state` at `now`.
#[inline]
fn advance(shard: &Config, State { value, ts }: State, now: f64, count: f64) -> State {
    let (rate, period, max) = (shard.rate(), shard.period(), shard.capacity());
    match shard.kind() {
        // value' = min(value + (now - ts) * rate / period, max) - count; ts' = now
        Kind::TokenBucket => {
            State { value: at_most(value + (now - ts) * rate / period, max) - count, ts: now }
        }
        Kind::FixedWindow => {
            if let Some(calendar) = shard.calendar() {
                return calendar_advance(calendar, rate, max, State { value, ts }, now, count);
            }
            // windows = floor((now - ts) / period); value' = min(value + rate * windows, max) - count
            let windows = ((now - ts) / period).floor();
            State { value: at_most(value + rate * windows, max) - count, ts: ts + windows * period }
        }
    }
}

/// [`advance`] of a calendar window (SPEC §2): `windows` is the number of window starts in
/// `(ts, now]`, and `ts'` the start of the window holding `now` (`ts` when none began).
#[cold]
#[inline(never)]
fn calendar_advance(
    calendar: Calendar,
    rate: f64,
    max: f64,
    State { value, ts }: State,
    now: f64,
    count: f64,
) -> State {
    let windows = calendar.windows(ts, now);
    let ts = if windows > 0.0 { calendar.start(now) } else { ts };
    State { value: at_most(value + rate * windows, max) - count, ts }
}

/// The start of the `k`-th window after the one starting at `ts` (k a whole number): `ts +
/// k * period`, or `next^k(ts)` of a calendar window.
#[inline(always)]
fn windows_after(shard: &Config, ts: f64, k: f64) -> f64 {
    match shard.calendar() {
        Some(calendar) => calendar_after(calendar, ts, k),
        None => ts + shard.period() * k,
    }
}

/// [`Calendar::after`], out of the common path.
#[cold]
#[inline(never)]
fn calendar_after(calendar: Calendar, ts: f64, k: f64) -> f64 {
    calendar.after(ts, k)
}

/// `x.min(max)` for a `max` that is not NaN (a capacity): the same value for every `x` (a
/// NaN `x` gives `max` either way), in one instruction (`minsd` on x86) where `f64::min`,
/// which must also order a NaN `max`, takes about five: about seven fewer a take in all
/// (BENCHMARKS.md, "Sixteenth session").
#[inline(always)]
fn at_most(x: f64, max: f64) -> f64 {
    if x < max { x } else { max }
}

/// Makes a wait exact in floating point: the formula's `wait` is exact in real numbers, but
/// evaluating again at `now + wait` may fall a rounding error short. Moves it up, one
/// representable time at a time, until `done(now + wait)` holds, so that a retry at
/// `retry_after` succeeds (SPEC §2). Exact waits, like the SPEC's examples, stay as they are;
/// if a few steps do not settle it, the formula's wait stands.
fn settle(now: f64, wait: f64, done: impl Fn(f64) -> bool) -> f64 {
    let mut at = now + wait;
    for _ in 0..8 {
        if done(at) {
            return (at - now).max(wait);
        }
        at = at.next_up();
    }
    wait
}

/// When a stored state will have refilled to capacity and so carry no information: from then
/// on a store may drop it (the memory store sweeps it, Redis expires it).
///
/// A token bucket is full once `capacity - value` tokens have flowed back. A fixed window is
/// full at the start of the first window by which enough whole windows have been granted.
#[inline]
pub fn full_at(shard: &Config, state: State) -> f64 {
    let missing = shard.capacity() - state.value;
    if missing <= 0.0 {
        return state.ts;
    }
    match shard.kind() {
        Kind::TokenBucket => state.ts + missing * shard.period() / shard.rate(),
        Kind::FixedWindow => windows_after(shard, state.ts, (missing / shard.rate()).ceil()),
    }
}

/// A fixed window's pseudo-random alignment for (name, key, shard): an offset in
/// `[0, period)` from the Unix epoch, or the config's `start` when it has one.
///
/// SPEC §1 asks for a random alignment per (name, key, shard) so that refused clients do not
/// all come back at the same instant. Deriving it from a hash instead of drawing it keeps it
/// the same in every process that shares a store and across the state being dropped when full,
/// so dropping a full state never moves a window. `seed` changes every alignment at once.
#[inline]
pub fn alignment(config: &Config, seed: u64, name: &str, key: Option<&str>, shard: u16) -> f64 {
    if let Some(start) = config.start() {
        return start;
    }
    if config.kind() == Kind::TokenBucket {
        return 0.0;
    }
    hashed_alignment(config.period(), seed, name, key, shard)
}

#[inline(never)]
fn hashed_alignment(period: f64, seed: u64, name: &str, key: Option<&str>, shard: u16) -> f64 {
    let mut h = Fnv::new(seed);
    h.write(name.as_bytes());
    match key {
        // A byte that cannot appear in UTF-8 separates name and key, and tells None from "".
        Some(key) => {
            h.write(&[0xff]);
            h.write(key.as_bytes());
        }
        None => h.write(&[0xfe]),
    }
    h.write(&shard.to_le_bytes());
    unit_interval(h.finish()) * period
}

/// Maps 64 random bits to a float uniform in `[0, 1)`.
pub fn unit_interval(bits: u64) -> f64 {
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// FNV-1a with a splitmix64 finish: stable across platforms, versions and processes, which
/// is what an alignment shared between processes needs (std's and foldhash's hashers are not).
struct Fnv(u64);

impl Fnv {
    fn new(seed: u64) -> Self {
        Fnv(0xcbf2_9ce4_8422_2325 ^ splitmix64(seed))
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn finish(&self) -> u64 {
        splitmix64(self.0)
    }
}

/// The splitmix64 finalizer: a cheap, well-mixed bijection on 64 bits.
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A request that can never succeed, refused before any evaluation (SPEC §2).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidRequest(String);

impl InvalidRequest {
    /// An invalid request with this message.
    pub fn new(message: impl Into<String>) -> Self {
        InvalidRequest(message.into())
    }
    /// The message, as SPEC §2 words it.
    pub fn message(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for InvalidRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InvalidRequest {}

/// The longest a name may be, in bytes.
pub const MAX_NAME_BYTES: usize = 256;
/// The longest a key may be, in bytes.
pub const MAX_KEY_BYTES: usize = 1024;

/// Checks a name and key against the limits of SPEC §1.
///
/// # Errors
///
/// An empty name, a name over 256 bytes, a key over 1024 bytes, or a NUL character (U+0000)
/// in either: PostgreSQL's text cannot hold one, so no store would keep such a state as the
/// others do, and every store refuses it alike, before it is asked.
#[inline(always)]
pub fn validate_name_key(name: &str, key: Option<&str>) -> Result<(), InvalidRequest> {
    let key = key.unwrap_or("").as_bytes();
    if !name.is_empty()
        && name.len() <= MAX_NAME_BYTES
        && key.len() <= MAX_KEY_BYTES
        && !name.as_bytes().contains(&0)
        && !key.contains(&0)
    {
        return Ok(());
    }
    name_key_error(name, key)
}

/// The error of [`validate_name_key`], out of the hot path.
#[cold]
#[inline(never)]
fn name_key_error(name: &str, key: &[u8]) -> Result<(), InvalidRequest> {
    if name.is_empty() {
        return Err(InvalidRequest::new("Rate limit name must not be empty."));
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(InvalidRequest::new(format!(
            "Rate limit name is {} bytes; the most is {MAX_NAME_BYTES}.",
            name.len()
        )));
    }
    if name.as_bytes().contains(&0) {
        return Err(InvalidRequest::new(
            "Rate limit name contains a NUL character (U+0000), which names may not.",
        ));
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(InvalidRequest::new(format!(
            "Rate limit {name} key is {} bytes; the most is {MAX_KEY_BYTES}.",
            key.len()
        )));
    }
    if key.contains(&0) {
        return Err(InvalidRequest::new(format!(
            "Rate limit {name} key contains a NUL character (U+0000), which keys may not."
        )));
    }
    Ok(())
}

/// Checks that `count` tokens could ever be granted (SPEC §2, validation).
///
/// # Errors
///
/// A count that is not finite or is negative, or exceeds what the limit can ever grant, with
/// the message of SPEC §2 (`Rate limit <name> count <count> exceeds <limitMax>.`).
///
/// # Examples
///
/// ```
/// use tollgate_algebra::{validate_count, Config, MINUTE};
///
/// let config = Config::token_bucket(10.0, MINUTE).with_capacity(3.0);
/// let err = validate_count("sendMessage", &config, 4.0, false).unwrap_err();
/// assert_eq!(err.to_string(), "Rate limit sendMessage count 4 exceeds 3.");
/// assert!(validate_count("sendMessage", &config, 4.0, true).is_ok());
/// ```
#[inline(always)]
pub fn validate_count(
    name: &str,
    config: &Config,
    count: f64,
    reserve: bool,
) -> Result<(), InvalidRequest> {
    // The common case first: a count within capacity, unsharded, not reserving (NaN fails
    // the comparison and takes the long way).
    if !reserve && config.shards() == 1 && (0.0..=config.capacity()).contains(&count) {
        return Ok(());
    }
    validate_count_slow(name, config, count, reserve)
}

/// The rest of [`validate_count`]: reservations, shards, and the errors, out of the hot path.
#[cold]
#[inline(never)]
fn validate_count_slow(
    name: &str,
    config: &Config,
    count: f64,
    reserve: bool,
) -> Result<(), InvalidRequest> {
    if !count.is_finite() || count < 0.0 {
        return Err(InvalidRequest::new(format!(
            "Rate limit {name} count {} must be a finite number >= 0.",
            fmt_number(count)
        )));
    }
    let factor = config.shard_factor();
    let limit_max = config.capacity() / factor;
    let allowed = match (reserve, config.max_reserved()) {
        (false, _) => limit_max,
        (true, Some(max_reserved)) => limit_max + max_reserved / factor,
        // Any count may book ahead, up to the bound that keeps the waits finite.
        (true, None) => crate::config::MAX_AMOUNT,
    };
    if count > allowed {
        let per_shards = if config.shards() > 1 {
            format!(" per {} shards", config.shards())
        } else {
            String::new()
        };
        return Err(InvalidRequest::new(format!(
            "Rate limit {name} count {} exceeds {}{per_shards}.",
            fmt_number(count),
            fmt_number(allowed)
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{MINUTE, SECOND};

    const T0: f64 = 1_700_000_000_000.0;

    #[test]
    fn at_most_is_min_for_every_x() {
        let xs = [f64::NAN, f64::NEG_INFINITY, -1.5, -0.0, 0.0, 2.0, 3.0, 1e300, f64::INFINITY];
        for max in [0.5, 2.0, 3.0, 1e300, f64::INFINITY] {
            for x in xs {
                assert_eq!(at_most(x, max).to_bits(), x.min(max).to_bits(), "{x} at most {max}");
            }
        }
    }

    fn run(config: &Config, steps: &[(f64, f64, bool)]) -> Vec<(Decision, State)> {
        let mut state = None;
        let alignment = config.start().unwrap_or(0.0);
        steps
            .iter()
            .map(|&(at, count, reserve)| {
                let e = evaluate(config, state, alignment, at, count, reserve);
                if e.decision.ok {
                    state = Some(e.state);
                }
                (e.decision, state.unwrap_or(e.state))
            })
            .collect()
    }

    #[test]
    fn token_bucket_spec_example() {
        let c = Config::token_bucket(10.0, MINUTE);
        let r = run(
            &c,
            &[(T0, 5.0, false), (T0 + 6.0 * SECOND, 6.0, false), (T0 + 6.0 * SECOND, 10.0, false)],
        );
        assert_eq!(r[0], (Decision::ADMIT, State { value: 5.0, ts: T0 }));
        assert_eq!(r[1], (Decision::ADMIT, State { value: 0.0, ts: T0 + 6_000.0 }));
        assert_eq!(r[2].0, Decision { ok: false, retry_after: Some(60_000.0) });
        assert_eq!(r[2].1, State { value: 0.0, ts: T0 + 6_000.0 }, "a refusal stores nothing");
    }

    #[test]
    fn token_bucket_spec_example_reserved() {
        let c = Config::token_bucket(10.0, MINUTE);
        let r = run(
            &c,
            &[(T0, 5.0, true), (T0 + 6.0 * SECOND, 6.0, true), (T0 + 6.0 * SECOND, 10.0, true)],
        );
        assert_eq!(r[1].1.value, 0.0);
        assert_eq!(
            r[2],
            (
                Decision { ok: true, retry_after: Some(60_000.0) },
                State { value: -10.0, ts: T0 + 6_000.0 }
            )
        );
    }

    #[test]
    fn fixed_window_spec_example() {
        let c = Config::fixed_window(10.0, MINUTE).with_start(T0);
        let r = run(&c, &[(T0, 5.0, false), (T0 + MINUTE, 6.0, false), (T0 + MINUTE, 10.0, false)]);
        assert_eq!(r[0], (Decision::ADMIT, State { value: 5.0, ts: T0 }));
        assert_eq!(r[1], (Decision::ADMIT, State { value: 4.0, ts: T0 + MINUTE }));
        assert_eq!(r[2].0, Decision { ok: false, retry_after: Some(MINUTE) });
        // Six seconds in, the first window still holds only 5.
        let r = run(&c, &[(T0, 5.0, false), (T0 + 6.0 * SECOND, 6.0, false)]);
        assert_eq!(r[1].0, Decision { ok: false, retry_after: Some(54_000.0) });
    }

    #[test]
    fn fixed_window_spec_example_reserved() {
        let c = Config::fixed_window(10.0, MINUTE).with_start(T0);
        let r = run(&c, &[(T0, 5.0, true), (T0 + MINUTE, 6.0, true), (T0 + MINUTE, 10.0, true)]);
        assert_eq!(
            r[2],
            (
                Decision { ok: true, retry_after: Some(MINUTE) },
                State { value: -6.0, ts: T0 + MINUTE }
            )
        );
        // 16 more would need two further windows.
        let e = evaluate(&c, Some(r[2].1), T0, T0 + MINUTE, 16.0, true);
        assert_eq!(e.decision, Decision { ok: true, retry_after: Some(3.0 * MINUTE) });
    }

    #[test]
    fn capacity_three_burst() {
        let c = Config::token_bucket(10.0, MINUTE).with_capacity(3.0);
        let r = run(&c, &[(T0, 1.0, false), (T0, 1.0, false), (T0, 1.0, false), (T0, 1.0, false)]);
        assert!(r[..3].iter().all(|(d, _)| d.ok));
        assert_eq!(r[3].0, Decision { ok: false, retry_after: Some(6_000.0) });
        // A long idle time refills only to capacity.
        let e =
            evaluate(&c, Some(State { value: 0.0, ts: T0 }), 0.0, T0 + 10.0 * MINUTE, 0.0, false);
        assert_eq!(e.state.value, 3.0);
    }

    #[test]
    fn max_reserved_bounds_reservations() {
        let c = Config::token_bucket(10.0, MINUTE).with_max_reserved(5.0);
        let r = run(&c, &[(T0, 10.0, true), (T0, 5.0, true), (T0, 1.0, true)]);
        assert_eq!(
            r[1],
            (Decision { ok: true, retry_after: Some(30_000.0) }, State { value: -5.0, ts: T0 })
        );
        assert_eq!(r[2].0, Decision { ok: false, retry_after: Some(36_000.0) });
        assert_eq!(r[2].1.value, -5.0);
        assert!(validate_count("llm", &c, 15.0, true).is_ok());
        assert_eq!(
            validate_count("llm", &c, 15.5, true).unwrap_err().to_string(),
            "Rate limit llm count 15.5 exceeds 15."
        );
    }

    #[test]
    fn zero_capacity_with_reserve_spaces_requests() {
        let c = Config::token_bucket(1.0, SECOND).with_capacity(0.0);
        let r = run(&c, &[(T0, 1.0, true), (T0, 1.0, true)]);
        assert_eq!(r[0].0.retry_after, Some(1_000.0));
        assert_eq!(r[1].0.retry_after, Some(2_000.0));
    }

    #[test]
    fn validation_messages_word_for_word() {
        let c = Config::token_bucket(10.0, MINUTE).with_capacity(3.0);
        assert_eq!(
            validate_count("a", &c, 3.5, false).unwrap_err().message(),
            "Rate limit a count 3.5 exceeds 3."
        );
        let sharded = Config::token_bucket(100.0, MINUTE).with_shards(10);
        assert_eq!(
            validate_count("b", &sharded, 21.0, false).unwrap_err().message(),
            "Rate limit b count 21 exceeds 20 per 10 shards."
        );
        assert!(validate_count("b", &sharded, 20.0, false).is_ok());
        let two = Config::token_bucket(5.0, MINUTE).with_shards(2);
        assert_eq!(
            validate_count("c", &two, 6.0, false).unwrap_err().message(),
            "Rate limit c count 6 exceeds 5 per 2 shards."
        );
        let reserved = Config::token_bucket(100.0, MINUTE).with_shards(10).with_max_reserved(10.0);
        assert_eq!(
            validate_count("d", &reserved, 23.0, true).unwrap_err().message(),
            "Rate limit d count 23 exceeds 22 per 10 shards."
        );
        assert_eq!(
            validate_count("e", &c, -1.0, false).unwrap_err().message(),
            "Rate limit e count -1 must be a finite number >= 0."
        );
        assert_eq!(
            validate_count("e", &c, f64::NAN, true).unwrap_err().message(),
            "Rate limit e count NaN must be a finite number >= 0."
        );
        assert!(
            validate_count("f", &c, 1e9, true).is_ok(),
            "unbounded reservations accept any count"
        );
        assert_eq!(
            validate_name_key("", None).unwrap_err().message(),
            "Rate limit name must not be empty."
        );
        assert!(validate_name_key(&"n".repeat(256), Some(&"k".repeat(1024))).is_ok());
        assert!(validate_name_key(&"n".repeat(257), None).is_err());
        assert!(validate_name_key("n", Some(&"k".repeat(1025))).is_err());
        let nul = validate_name_key("n", Some("a\0b")).unwrap_err();
        assert_eq!(
            nul.message(),
            "Rate limit n key contains a NUL character (U+0000), which keys may not."
        );
        assert!(validate_name_key("a\0b", Some("k")).is_err());
    }

    #[test]
    fn fixed_window_fresh_state_is_aligned() {
        let c = Config::fixed_window(10.0, MINUTE);
        let a = alignment(&c, 0, "x", Some("k"), 0);
        assert!((0.0..MINUTE).contains(&a));
        assert_eq!(a, alignment(&c, 0, "x", Some("k"), 0), "stable");
        assert_ne!(a, alignment(&c, 0, "x", None, 0), "None is not the empty key");
        assert_ne!(a, alignment(&c, 1, "x", Some("k"), 0), "the seed moves it");
        let s = fresh_state(&c, a, T0);
        assert!(s.ts <= T0 && T0 - s.ts < MINUTE);
        assert_eq!(((s.ts - a) / MINUTE).fract(), 0.0);
    }

    #[test]
    fn full_at_is_when_evaluation_reaches_capacity() {
        let tb = Config::token_bucket(10.0, MINUTE);
        let s = State { value: -2.0, ts: T0 };
        let full = full_at(&tb, s);
        assert_eq!(full, T0 + 72_000.0);
        assert_eq!(evaluate(&tb, Some(s), 0.0, full, 0.0, false).state.value, 10.0);
        let fw = Config::fixed_window(10.0, MINUTE).with_capacity(15.0);
        let s = State { value: 1.0, ts: T0 };
        assert_eq!(full_at(&fw, s), T0 + 2.0 * MINUTE);
        assert_eq!(
            evaluate(&fw, Some(s), 0.0, T0 + 2.0 * MINUTE - 1.0, 0.0, false).state.value,
            11.0
        );
        assert_eq!(evaluate(&fw, Some(s), 0.0, T0 + 2.0 * MINUTE, 0.0, false).state.value, 15.0);
    }
}
