//! redis-cell's `CL.THROTTLE key max_burst count period [quantity]` on tollgate's token
//! bucket (SPEC §6d): a bucket of `max_burst + 1` tokens refilled by `count` every `period`
//! seconds, under the server's `respThrottleName` and the given key, on whatever store the
//! server runs. GCRA, redis-cell's algorithm, is the same bucket seen through the time at
//! which it will be full again, so each of the reply's five integers is read from the
//! bucket's state after the request (see [`reply`]).

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
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Args<'a> {
    /// The key.
    pub key: &'a str,
    /// The bucket: capacity `max_burst + 1`, `count` tokens per `period` seconds.
    pub config: Config,
    /// Tokens asked for (default 1; 0 reads the bucket and takes nothing).
    pub quantity: i64,
}

/// The most any number of the command may be: tollgate's bound on amounts (1e15).
const MOST: i64 = 1_000_000_000_000_000;

/// Reads `key max_burst count period [quantity]`.
///
/// # Errors
///
/// redis-cell's kind of message: the argument and what it must be.
pub fn args<'a>(argv: &[&'a [u8]]) -> Result<Args<'a>, String> {
    if !(4..=5).contains(&argv.len()) {
        return Err("wrong number of arguments for 'cl.throttle' command".into());
    }
    let key = std::str::from_utf8(argv[0])
        .map_err(|_| "CL.THROTTLE: the key must be UTF-8 text".to_owned())?;
    let number = |i: usize, what: &str, least: i64| -> Result<i64, String> {
        let text = argv[i];
        let n = std::str::from_utf8(text).ok().and_then(|t| t.parse::<i64>().ok());
        match n {
            Some(n) if (least..=MOST).contains(&n) => Ok(n),
            Some(_) => Err(format!(
                "CL.THROTTLE: {what} is {}; it must be an integer from {least} to {MOST}",
                String::from_utf8_lossy(text)
            )),
            None => Err(format!(
                "CL.THROTTLE: {what} is {:?}; it must be an integer",
                String::from_utf8_lossy(text)
            )),
        }
    };
    let max_burst = number(1, "max_burst", 0)?;
    let count = number(2, "count", 1)?;
    let period = number(3, "period", 1)?;
    let quantity = if argv.len() == 5 { number(4, "quantity", 0)? } else { 1 };
    if max_burst >= MOST {
        return Err(format!("CL.THROTTLE: max_burst is {max_burst}; it must be below {MOST}"));
    }
    if period > MOST / 1_000 {
        return Err(format!(
            "CL.THROTTLE: period is {period} s; it must be at most {} s",
            MOST / 1_000
        ));
    }
    let config = Config::token_bucket(count as f64, period as f64 * 1_000.0)
        .with_capacity(max_burst as f64 + 1.0);
    Ok(Args { key, config, quantity })
}

/// Runs the command on `name` (the server's `respThrottleName`).
///
/// # Errors
///
/// The limiter's (the store failed).
pub async fn throttle(defined: &Defined, name: &str, args: Args<'_>) -> Result<Throttled, Error> {
    let limiter = defined.limiter();
    let target = Target::Inline(name, args.config);
    let capacity = args.config.capacity();
    let quantity = args.quantity as f64;
    if quantity > capacity {
        // More than the bucket holds can never be granted: redis-cell says limited, with
        // retry_after -1, and takes nothing. Read with a count of 0.
        let read = Request::new().key(args.key).count(0.0);
        let taken = limiter.check_with_status_async(target, read).await?;
        return Ok(reply(capacity, false, None, taken.status));
    }
    let request = Request::new().key(args.key).count(quantity);
    let taken = limiter.limit_with_status_async(target, request).await?;
    Ok(reply(capacity, taken.decision.ok, taken.decision.retry_after, taken.status))
}

/// The five integers, from the decision and the bucket's status after it (of the state as
/// it stands when refused):
/// - `remaining`: the whole tokens in the bucket;
/// - `retry_after`: the wait for the tokens asked, in seconds rounded up, -1 when granted;
/// - `reset_after`: the time until the bucket is full, in seconds rounded up.
pub fn reply(capacity: f64, ok: bool, retry_after: Option<f64>, status: Status) -> Throttled {
    // Float sums of refills may land a hair below a whole token.
    let remaining = (status.remaining + 1e-9).floor() as i64;
    let seconds = |ms: f64| (ms / 1_000.0 - 1e-9).ceil().max(0.0) as i64;
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
