//! redis-cell's `CL.THROTTLE key max_burst count period [quantity]` on tollgate's token
//! bucket (SPEC §6d): a bucket of `max_burst + 1` tokens refilled by `count` every `period`
//! seconds, under the server's `respThrottleName` and the given key, on whatever store the
//! server runs. GCRA, redis-cell's algorithm, is the same bucket seen through the time at
//! which it will be full again, so each of the reply's five integers is read from the
//! bucket's state after the request (see [`reply`]).

use std::borrow::Cow;

use tollgate::core::{Kind, MAX_KEY_BYTES};
use tollgate::{Config, Error, Request, Status, Target};

use crate::engine::Defined;

/// What `CL.THROTTLE` answers besides errors: the five integers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Throttled {
    /// 1 when refused.
    pub limited: i64,
    /// `max_burst + 1`.
    pub limit: i64,
    /// Whole tokens left.
    pub remaining: i64,
    /// Seconds until the request would be granted; -1 when it was granted (or never can be).
    pub retry_after: i64,
    /// Seconds until the bucket is full again.
    pub reset_after: i64,
}

/// The arguments after the command's name, read as redis-cell reads them.
#[derive(Clone, Debug, PartialEq)]
pub struct Args<'a> {
    /// The key, as the store keeps it: as given, or past 1,024 bytes its beginning, `#`
    /// and its SHA-256.
    pub key: Cow<'a, str>,
    /// The bucket: capacity `max_burst + 1`, `count` tokens per `period` seconds.
    pub config: Config,
    /// Tokens asked for (default 1; 0 reads the bucket and takes nothing).
    pub quantity: i64,
}

/// The most any other number of the command may be: tollgate's bound on amounts (1e15).
const MOST: i64 = 1_000_000_000_000_000;

/// Reads `key max_burst count period [quantity]`, with `period` at most `max_period`
/// seconds.
///
/// # Errors
///
/// redis-cell's kind of message: the argument and what it must be.
pub fn args<'a>(argv: &[&'a [u8]], max_period: i64) -> Result<Args<'a>, String> {
    if !(4..=5).contains(&argv.len()) {
        return Err("wrong number of arguments for 'cl.throttle' command".into());
    }
    let key = std::str::from_utf8(argv[0])
        .map_err(|_| "CL.THROTTLE: the key must be UTF-8 text".to_owned())?;
    let number = |i: usize, what: &str, least: i64, most: i64| -> Result<i64, String> {
        let text = argv[i];
        let n = std::str::from_utf8(text).ok().and_then(|t| t.parse::<i64>().ok());
        let bound = if what == "period" { " (respMaxPeriod)" } else { "" };
        match n {
            Some(n) if (least..=most).contains(&n) => Ok(n),
            Some(_) => Err(format!(
                "CL.THROTTLE: {what} is {}; it must be an integer from {least} to {most}{bound}",
                String::from_utf8_lossy(text)
            )),
            None => Err(format!(
                "CL.THROTTLE: {what} is {:?}; it must be an integer",
                String::from_utf8_lossy(text)
            )),
        }
    };
    // max_burst + 1 is the capacity, itself at most MOST.
    let max_burst = number(1, "max_burst", 0, MOST - 1)?;
    let count = number(2, "count", 1, MOST)?;
    let period = number(3, "period", 1, max_period)?;
    let quantity = if argv.len() == 5 { number(4, "quantity", 0, MOST)? } else { 1 };
    let config = Config::token_bucket(count as f64, period as f64 * 1_000.0)
        .with_capacity(max_burst as f64 + 1.0);
    Ok(Args { key: stored_key(key), config, quantity })
}

/// A key as the store keeps it: as given, or, past [`MAX_KEY_BYTES`], its beginning, `#` and
/// its SHA-256 in hex, 1,024 bytes in all. redis-cell takes keys of any length; tollgate's
/// states take keys of at most 1,024 bytes. Two long keys that differ anywhere are two
/// buckets (their digests differ); only a key of exactly that shape, which no one writes by
/// chance, could meet one.
fn stored_key(key: &str) -> Cow<'_, str> {
    if key.len() <= MAX_KEY_BYTES {
        return Cow::Borrowed(key);
    }
    let mut cut = MAX_KEY_BYTES - 65;
    while !key.is_char_boundary(cut) {
        cut -= 1;
    }
    Cow::Owned(format!("{}#{}", &key[..cut], crate::digest::digest(key)))
}

/// Where `CL.THROTTLE` takes from, for arguments that make `config`: the limit `name`
/// (`respThrottleName`) with that config, or, when the server defines `name` in `[limits]`,
/// the rule of HTTP and `TG.LIMIT` for a defined name: its own config, and no other unless
/// `allowConfigOverride` allows it.
///
/// # Errors
///
/// The server defines `name` with another config and overrides are not allowed: the message
/// says what the arguments must be.
pub fn target<'n>(defined: &Defined, name: &'n str, config: Config) -> Result<Target<'n>, String> {
    match defined.limiter().defined_config(name) {
        None => Ok(Target::Inline(name, config)),
        Some(own) if own == config => Ok(Target::Named(name)),
        Some(_) if defined.permissions().config_override => Ok(Target::Inline(name, config)),
        Some(own) => Err(format!(
            "CL.THROTTLE: {name} is defined by the server as {}; send no other arguments for \
             it (allowConfigOverride = false), or set respThrottleName to a name the server \
             does not define",
            as_arguments(&own)
        )),
    }
}

/// A config in `CL.THROTTLE`'s words, if its arguments can make it: `max_burst 15, count
/// 30, period 60`.
pub fn as_arguments(config: &Config) -> String {
    let whole = |x: f64| x.fract() == 0.0 && x >= 0.0;
    let seconds = config.period() / 1_000.0;
    let plain = config.kind() == Kind::TokenBucket
        && config.shards() <= 1
        && config.max_reserved().is_none()
        && whole(config.capacity())
        && config.capacity() >= 1.0
        && whole(config.rate())
        && whole(seconds);
    if plain {
        format!(
            "max_burst {}, count {}, period {}",
            config.capacity() - 1.0,
            config.rate(),
            seconds
        )
    } else {
        format!("a {} that no CL.THROTTLE arguments make", config.kind().as_str())
    }
}

/// Runs the command on `target` (see [`target`]).
///
/// # Errors
///
/// The limiter's (the store failed).
pub async fn throttle(
    defined: &Defined,
    target: Target<'_>,
    args: Args<'_>,
) -> Result<Throttled, Error> {
    let limiter = defined.limiter();
    let capacity = args.config.capacity();
    let quantity = args.quantity as f64;
    if quantity > capacity {
        // More than the bucket holds can never be granted: redis-cell says limited, with
        // retry_after -1, and takes nothing. Read with a count of 0.
        let read = Request::new().key(&args.key).count(0.0);
        let taken = limiter.check_with_status_async(target, read).await?;
        return Ok(reply(capacity, false, None, taken.status));
    }
    let request = Request::new().key(&args.key).count(quantity);
    let taken = limiter.limit_with_status_async(target, request).await?;
    Ok(reply(capacity, taken.decision.ok, taken.decision.retry_after, taken.status))
}

/// The five integers, from the decision and the bucket's status after it (of the state as
/// it stands when refused):
/// - `remaining`: the whole tokens in the bucket;
/// - `retry_after`: the wait for the tokens asked, in seconds, -1 when granted;
/// - `reset_after`: the time until the bucket is full, in seconds.
///
/// Seconds are redis-cell's: whole seconds, one more when at least a millisecond is left
/// over (1.0005 s is 1, 1.001 s is 2), so that a caller never comes back too early.
pub fn reply(capacity: f64, ok: bool, retry_after: Option<f64>, status: Status) -> Throttled {
    // Float sums of refills may land a hair below a whole token. Granted because the store
    // failed (fail open, `Status::UNKNOWN`): no tokens are claimed, and no wait.
    let remaining = if status.is_known() { (status.remaining + 1e-9).floor() as i64 } else { 0 };
    let seconds = |ms: f64| {
        let ms = ms.max(0.0);
        let whole = (ms / 1_000.0).trunc();
        let left = (ms - whole * 1_000.0 + 1e-6).trunc();
        whole as i64 + i64::from(left >= 1.0)
    };
    Throttled {
        limited: i64::from(!ok),
        limit: capacity as i64,
        remaining,
        retry_after: match (ok, retry_after) {
            (false, Some(wait)) => seconds(wait),
            _ => -1,
        },
        reset_after: seconds(status.reset_after),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tollgate::{ManualClock, MemoryStore, RateLimiter};

    use super::*;
    use crate::config::DEFAULT_RESP_MAX_PERIOD;
    use crate::engine::Permissions;
    use crate::store::DynStore;

    fn words(line: &str) -> Vec<Vec<u8>> {
        line.split(' ').map(|w| w.as_bytes().to_vec()).collect()
    }

    /// redis-cell's own table of cases (its `it_rate_limits`: a burst of 5, one token a
    /// second, a clock set by the test), replayed on tollgate's token bucket: every integer
    /// the same.
    #[test]
    fn redis_cells_cases_give_its_integers() {
        let clock = ManualClock::new(1_000_000.0);
        let store: DynStore = Arc::new(MemoryStore::with_clock(clock.clone()));
        let defined = Defined::new(RateLimiter::builder(store).build(), Permissions::default());
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        // (ms after the start, quantity, remaining, reset_after ms, retry_after s, limited)
        let cases: [(f64, i64, i64, f64, i64, bool); 15] = [
            (0.0, 6, 5, 0.0, -1, true),
            (0.0, 1, 4, 1_000.0, -1, false),
            (0.0, 1, 3, 2_000.0, -1, false),
            (0.0, 1, 2, 3_000.0, -1, false),
            (0.0, 1, 1, 4_000.0, -1, false),
            (0.0, 1, 0, 5_000.0, -1, false),
            (0.0, 1, 0, 5_000.0, 1, true),
            (3_000.0, 1, 2, 3_000.0, -1, false),
            (3_100.0, 1, 1, 3_900.0, -1, false),
            (4_000.0, 1, 1, 4_000.0, -1, false),
            (8_000.0, 1, 4, 1_000.0, -1, false),
            (9_500.0, 1, 4, 1_000.0, -1, false),
            (9_500.0, 0, 4, 1_000.0, -1, false),
            (9_500.0, 2, 2, 3_000.0, -1, false),
            (9_500.0, 5, 2, 3_000.0, 3, true),
        ];
        for (i, (at, quantity, remaining, reset_ms, retry, limited)) in
            cases.into_iter().enumerate()
        {
            clock.set(1_000_000.0 + at);
            let argv = words(&format!("foo 4 1 1 {quantity}"));
            let argv: Vec<&[u8]> = argv.iter().map(Vec::as_slice).collect();
            let parsed = args(&argv, DEFAULT_RESP_MAX_PERIOD).unwrap();
            let target = target(&defined, "cl.throttle", parsed.config).unwrap();
            let t = runtime.block_on(throttle(&defined, target, parsed)).unwrap();
            // redis-cell's reply: its durations in seconds, up when a millisecond is over.
            let reset = (reset_ms / 1_000.0_f64).ceil() as i64;
            assert_eq!(
                t,
                Throttled {
                    limited: i64::from(limited),
                    limit: 5,
                    remaining,
                    retry_after: retry,
                    reset_after: reset,
                },
                "case {i}"
            );
        }
    }

    #[test]
    fn seconds_round_up_from_a_millisecond() {
        let status = |reset_after| Status { remaining: 0.0, reset_after };
        let secs = |ms| reply(1.0, true, None, status(ms)).reset_after;
        assert_eq!(
            [secs(0.0), secs(0.5), secs(999.0), secs(1_000.0), secs(1_000.5)],
            [0, 0, 1, 1, 1]
        );
        assert_eq!([secs(1_001.0), secs(1_999.999_999_9), secs(3_900.0)], [2, 2, 4]);
        let refused = reply(16.0, false, Some(1_950.0), status(31_990.0));
        assert_eq!((refused.retry_after, refused.reset_after), (2, 32));
    }

    #[test]
    fn arguments_are_read_as_redis_cell_reads_them() {
        let argv = words("user123 15 30 60");
        let argv: Vec<&[u8]> = argv.iter().map(Vec::as_slice).collect();
        let parsed = args(&argv, DEFAULT_RESP_MAX_PERIOD).unwrap();
        assert_eq!((parsed.key.as_ref(), parsed.quantity), ("user123", 1));
        assert_eq!(parsed.config, Config::token_bucket(30.0, 60_000.0).with_capacity(16.0));
        assert_eq!(as_arguments(&parsed.config), "max_burst 15, count 30, period 60");
        let fixed = Config::fixed_window(30.0, 60_000.0);
        assert_eq!(as_arguments(&fixed), "a fixed window that no CL.THROTTLE arguments make");
    }

    #[test]
    fn long_keys_are_kept_as_1024_bytes_of_their_own() {
        let long = format!("{}é{}", "k".repeat(958), "x".repeat(2_000));
        let kept = stored_key(&long);
        assert!(kept.len() <= MAX_KEY_BYTES, "{}", kept.len());
        // Cut before the two bytes of é, not inside them.
        assert!(kept.starts_with(&"k".repeat(958)) && kept.as_bytes()[958] == b'#', "{kept}");
        let other = format!("{long}y");
        assert_ne!(stored_key(&other), kept);
        assert_eq!(stored_key("short"), "short");
        assert_eq!(stored_key(&"k".repeat(MAX_KEY_BYTES)).len(), MAX_KEY_BYTES);
    }
}
