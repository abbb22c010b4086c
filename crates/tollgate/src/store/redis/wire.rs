//! The Redis store's wire: a request's arguments as the scripts take them (a one-take packed
//! in one string of doubles), and their answers read back (times, states, what was loaded),
//! any answer that is not one of those an error.

use redis::Value;
use tollgate_algebra::lease::Leased;
use tollgate_algebra::{Kind, OneTake, Slot, State};

use super::OneAnswer;
use super::script::SCRIPT_ERROR;
use crate::error::StoreError;

/// A slot as the scripts take it: kind, rate, period, capacity, maxReserved ("" =
/// unbounded), alignment.
pub(super) fn slot_args(invocation: &mut redis::ScriptInvocation<'_>, slot: &Slot<'_>) {
    let c = &slot.config;
    invocation
        .arg(kind_code(c.kind()))
        .arg(num(c.rate()))
        .arg(num(c.period()))
        .arg(num(c.capacity()))
        .arg(c.max_reserved().map(num).unwrap_or_default())
        .arg(num(slot.alignment));
}

/// How the scripts name a limit's kind: 0 token bucket, 1 fixed window (a byte in
/// [`one_args`], its digit as a text argument).
pub(super) fn kind_code(kind: Kind) -> u8 {
    match kind {
        Kind::TokenBucket => 0,
        Kind::FixedWindow => 1,
    }
}

/// The one argument of [`SCRIPT_ONE`](super::script::SCRIPT_ONE) for `take`; `now` is NaN for Redis `TIME`.
pub(super) fn one_args(take: &OneTake<'_>, now: f64) -> Vec<u8> {
    let c = &take.slot.config;
    let mut args = Vec::with_capacity(3 + 7 * 8);
    args.push(u8::from(take.writes));
    args.push(kind_code(c.kind()));
    args.push(u8::from(take.reserve));
    let numbers = [
        c.rate(),
        c.period(),
        c.capacity(),
        c.max_reserved().unwrap_or(f64::NAN),
        take.slot.alignment,
        take.count,
        now,
    ];
    for x in numbers {
        args.extend_from_slice(&x.to_le_bytes());
    }
    args
}

/// Reads [`SCRIPT_ONE`](super::script::SCRIPT_ONE)'s answer: the time it used, whether it wrote, and the state it
/// loaded.
pub(super) fn unpack_one(reply: &Value) -> Result<OneAnswer, StoreError> {
    let Value::BulkString(reply) = reply else {
        return Err(garbage("not a string for one slot"));
    };
    if reply.starts_with(SCRIPT_ERROR) {
        return Err(StoreError::new(format!("redis: {}", String::from_utf8_lossy(reply))));
    }
    let (wrote, state) = match reply.get(8..) {
        Some([b'0', state @ ..]) => (false, state),
        Some([b'1', state @ ..]) => (true, state),
        _ => return Err(garbage(&format!("{} bytes for one slot", reply.len()))),
    };
    let now = unpack_f64(reply).ok_or_else(|| garbage("the time"))?;
    let loaded = match state.len() {
        0 => None,
        16 => Some(State {
            value: unpack_f64(&state[..8]).ok_or_else(|| garbage("a state"))?,
            ts: unpack_f64(&state[8..]).ok_or_else(|| garbage("a state"))?,
        }),
        n => return Err(garbage(&format!("a state of {n} bytes"))),
    };
    Ok((now, wrote, loaded))
}

pub(super) fn redis_error(what: &str, e: redis::RedisError) -> StoreError {
    StoreError::with_source(format!("redis: {what}: {e}"), e)
}

pub(super) fn num(x: f64) -> String {
    // Debug prints the shortest text that reads back as the same f64.
    format!("{x:?}")
}

/// Reads a number Redis answered as text (`TIME`).
pub(super) fn parse_num(v: &Value) -> Option<f64> {
    match v {
        Value::BulkString(bytes) => std::str::from_utf8(bytes).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

/// Reads a little-endian double packed by the script.
pub(super) fn unpack_f64(bytes: &[u8]) -> Option<f64> {
    Some(f64::from_le_bytes(bytes.get(..8)?.try_into().ok()?))
}

/// Reads the time a script answered (a packed double).
pub(super) fn unpack_time(v: &Value) -> Result<f64, StoreError> {
    match v {
        Value::BulkString(bytes) => unpack_f64(bytes),
        _ => None,
    }
    .ok_or_else(|| garbage("the time"))
}

/// The error when the script wrote where tollgate-algebra, on the same states, would not (or
/// the other way round).
pub(super) fn disagree() -> StoreError {
    StoreError::new(
        "redis: the script and tollgate-algebra disagree on this request; this is a bug",
    )
}

/// Reads a stored state: `value` and `ts` as two packed doubles; anything else is no state.
pub(super) fn unpack_state(v: &Value) -> Option<State> {
    match v {
        Value::BulkString(bytes) if bytes.len() == 16 => {
            Some(State { value: unpack_f64(&bytes[..8])?, ts: unpack_f64(&bytes[8..])? })
        }
        _ => None,
    }
}

/// The state of `slot` the plan script decided on, from what it `loaded` at `now`, and the
/// most an adjust may raise it to: a plain state as stored, under its capacity; a state with
/// lease records refilled under `capacity - outstanding` to `now` (`Leased::advance`), as
/// the script did, and under that cap.
pub(super) fn loaded_state(
    slot: &Slot<'_>,
    loaded: &Value,
    now: f64,
) -> Result<(Option<State>, f64), StoreError> {
    let cap = slot.config.capacity();
    let bytes = match loaded {
        Value::BulkString(bytes) if !bytes.is_empty() => bytes,
        _ => return Ok((None, cap)),
    };
    if bytes.len() == 16 {
        return Ok((unpack_state(loaded), cap));
    }
    let mut leased = Leased::unpack(bytes).ok_or_else(|| garbage("a state"))?;
    let state = leased.advance(&slot.config, slot.alignment, now);
    Ok((Some(state), cap - leased.outstanding()))
}

/// A state as the script stores it (`struct.pack('<dd', value, ts)`).
pub(super) fn pack_state(state: State) -> Vec<u8> {
    let mut bytes = state.value.to_le_bytes().to_vec();
    bytes.extend_from_slice(&state.ts.to_le_bytes());
    bytes
}

pub(super) fn garbage(what: &str) -> StoreError {
    StoreError::new(format!("redis: unexpected answer: {what}"))
}
