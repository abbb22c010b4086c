//! Concurrency limits on Redis (SPEC §6f): the holders of a (name, key) are a sorted set of
//! their tickets by expiry and a hash of their counts, under one hash tag (so that a cluster
//! keeps them in one slot), changed by one script run per operation: a lean script each for
//! an acquire, a release and a renewal ([`SCRIPT_ACQUIRE`](super::script::SCRIPT_ACQUIRE)
//! and its neighbours), one for the rest. The scripts decide, as they must to be atomic; an
//! acquire's or a check's answer is `tollgate_algebra::slots::decide`'s, on what the script
//! saw, and a script that granted where the algebra would not (or the other way round) is an
//! error.
//!
//! Slots are never leased: a store built with leases runs every operation here, directly.

use std::fmt::Write as _;

use redis::Value;
use tollgate_algebra::slots::{Concurrency, Holder, SlotAnswer, SlotOp, Write, decide};
use tollgate_algebra::{Clock, Outcome, Plan};

#[cfg(feature = "redis-cluster")]
use super::cluster::hash_slot;
use super::keys::hash_tag;
use super::wire::{disagree, garbage, num, unpack_f64, unpack_time};
use super::{Inner, RedisStore, Writes, plan_ran};
use crate::error::StoreError;
use crate::store::seam::slots_with_answer;

/// Tickets are below 2^53, so that a double (Lua's numbers, JavaScript's) holds each exactly.
const TICKETS_END: u64 = 1 << 53;

impl<C> Inner<C> {
    /// The keys of (name, key)'s holders: its tickets by expiry, then their counts.
    ///
    /// Both start `<prefix>slots:`, which no state key does (those go on with a digit), then
    /// the name and key as a state's key has them (lengths first). A cluster must keep both
    /// in one hash slot: if that text has a hash tag (the prefix's, the name's, or the key's,
    /// such as `{user42}`, which then puts the slots beside the rate limits of that key),
    /// it places both; else the name and key become their tag. (A prefix whose first `{` is
    /// followed by `}` leaves both placed by their whole text: a cluster refuses the script,
    /// `CROSSSLOT`.)
    pub(super) fn slot_keys(&self, name: &str, key: Option<&str>) -> [String; 2] {
        let mut rest = format!("{}:{name}:", name.len());
        match key {
            Some(key) => {
                let _ = write!(rest, "k{}:{key}", key.len());
            }
            None => rest.push('n'),
        }
        let head = format!("{}slots:", self.prefix);
        let plain = format!("{head}{rest}");
        let base =
            if hash_tag(plain.as_bytes()).is_some() { plain } else { format!("{head}{{{rest}}}") };
        [format!("{base}:expiries"), format!("{base}:counts")]
    }
}

impl<C: Clock> RedisStore<C> {
    /// Runs `op` on (name, key)'s holders in one round trip, by its script (see
    /// [`SCRIPT_ACQUIRE`](super::script::SCRIPT_ACQUIRE)). An operation that may write (an
    /// acquire, a release, a renewal, a reset) whose reply never came says it may have run:
    /// an acquire may then hold slots until its ttl ends.
    pub(super) async fn slots(
        &self,
        name: &str,
        key: Option<&str>,
        limit: &Concurrency,
        op: &SlotOp,
    ) -> Result<SlotAnswer, StoreError> {
        op.validate(limit).map_err(|e| StoreError::new(e.message()))?;
        let inner = &self.inner;
        let [tickets, counts] = inner.slot_keys(name, key);
        // A test's own time; `None`: Redis `TIME`, read by the script if it needs the time.
        let clock = inner.clock.as_ref().map(Clock::now);
        let script = match op {
            SlotOp::Acquire { .. } => &inner.acquire,
            SlotOp::Release { .. } => &inner.release,
            SlotOp::Renew { .. } => &inner.renew,
            SlotOp::Check { .. } | SlotOp::Value | SlotOp::Reset => &inner.slots,
        };
        let mut invocation = script.prepare_invoke();
        invocation.key(&tickets).key(&counts).arg(clock.map(num).unwrap_or_default());
        match *op {
            SlotOp::Acquire { count, ttl } => invocation.arg(count).arg(num(ttl)).arg(limit.max()),
            SlotOp::Release { ticket } => invocation.arg(ticket),
            SlotOp::Renew { ticket, ttl } => invocation.arg(ticket).arg(num(ttl)),
            SlotOp::Check { count } => invocation.arg("c").arg(count).arg(limit.max()),
            SlotOp::Value => invocation.arg("v"),
            SlotOp::Reset => invocation.arg("x"),
        };
        let writes = if op.writes() { Writes::Yes } else { Writes::No };
        let reply: Value = inner
            .on_connection(
                writes,
                |mut conn| async move { invocation.invoke_async(&mut conn).await },
            )
            .await?;
        Seen::read(&reply, op, clock)?.answer(limit, op)
    }

    /// Runs an acquire of (name, key)'s slots with `plan`, all or nothing, in one round trip
    /// (see [`SCRIPT_SLOTS_WITH`](super::script::SCRIPT_SLOTS_WITH)). On a cluster the
    /// plan's states and the slots must share a hash slot: give the key a hash tag (such as
    /// `{user42}`), which places the slots beside that key's rate limits. Calendar windows
    /// are not taken with slots here (their starts are decided outside the script).
    pub(super) async fn slots_with(
        &self,
        name: &str,
        key: Option<&str>,
        limit: &Concurrency,
        op: &SlotOp,
        plan: &Plan<'_>,
    ) -> Result<(SlotAnswer, Outcome), StoreError> {
        op.validate(limit).map_err(|e| StoreError::new(e.message()))?;
        let SlotOp::Acquire { count, ttl } = *op else {
            return Err(StoreError::new("redis: only an acquire is taken with rate limits"));
        };
        let inner = &self.inner;
        if plan.slots().iter().any(|s| s.config.calendar().is_some()) {
            return Err(StoreError::new(
                "redis: a calendar window is not taken with a concurrency slot; nothing was taken",
            ));
        }
        inner.no_leased_shards(plan)?;
        let keys: Vec<String> =
            plan.slots().iter().map(|s| inner.key(s.name, s.key, s.shard)).collect();
        let [tickets, counts] = inner.slot_keys(name, key);
        #[cfg(feature = "redis-cluster")]
        if inner.is_cluster() {
            let first = hash_slot(tickets.as_bytes());
            if keys.iter().any(|k| hash_slot(k.as_bytes()) != first) {
                return Err(StoreError::new(
                    "redis: on a cluster, a slot taken with rate limits must share their hash \
                     slot: give the key a hash tag, such as {user42}; nothing was taken",
                ));
            }
        }
        let mut invocation = inner.plan_invocation(&inner.slots_with, plan, &keys);
        invocation.key(&tickets).key(&counts).arg(count).arg(num(ttl)).arg(limit.max());
        let mut reply: Vec<Value> = inner
            .on_connection(Writes::Yes, |mut conn| async move {
                invocation.invoke_async(&mut conn).await
            })
            .await?;
        let slots = reply.pop().ok_or_else(|| garbage("no answer for slots"))?;
        let now = unpack_time(reply.first().ok_or_else(|| garbage("no time"))?)?;
        let seen = Seen::read(&slots, op, Some(now))?;
        // The slots' answer is decide's on what the script saw (a ticket stands in for one
        // the script did not make); the plan is then decided as the script ran it, a check
        // unless the slots were granted.
        let made = seen.ticket;
        let answer = Seen { ticket: made.max(1), ..seen }.answer(limit, op)?;
        let granted = matches!(answer, SlotAnswer::Acquired { .. });
        let checking;
        let taken = if granted {
            plan
        } else {
            checking = plan.checking();
            &checking
        };
        let ran = plan_ran(taken, reply)?;
        if (granted && ran.outcome.ok) != (made != 0) {
            return Err(disagree());
        }
        Ok((slots_with_answer(answer, &ran.outcome), ran.outcome))
    }
}

/// What a script run on slots saw and did.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Seen {
    /// Granted, free, released, renewed, reset (as the operation goes).
    ok: bool,
    /// The time it used (NaN: a release's, which the store does not need).
    now: f64,
    /// Slots held by live holders, before the write.
    in_flight: u64,
    /// Live holders (a value's and a check's; 0 for the others, which do not count them).
    holders: u64,
    /// The earliest live holder's expiry (not said by an acquire granted).
    earliest: Option<f64>,
    /// The ticket made (0: none).
    ticket: u64,
}

impl Seen {
    /// Reads what `op`'s script answered (see the scripts); `clock` is the time the store
    /// gave it, if any.
    fn read(reply: &Value, op: &SlotOp, clock: Option<f64>) -> Result<Seen, StoreError> {
        let none =
            Seen { ok: false, now: f64::NAN, in_flight: 0, holders: 0, earliest: None, ticket: 0 };
        // The time a script used: the store's, or Redis `TIME` in whole ms.
        let now = |ms: &Value| match (clock, ms) {
            (Some(now), _) => Ok(now),
            #[allow(clippy::cast_precision_loss)]
            (None, Value::Int(ms)) if (1..1 << 53).contains(ms) => Ok(*ms as f64),
            _ => Err(garbage(&format!("{ms:?} for the time"))),
        };
        match (op, reply) {
            (SlotOp::Acquire { .. }, Value::Array(values)) => {
                let [ok, time, in_flight, earliest, ticket] = values.as_slice() else {
                    return Err(garbage(&format!("{} values for an acquire", values.len())));
                };
                let earliest = match earliest {
                    Value::BulkString(b) if b.is_empty() => None,
                    Value::BulkString(b) => Some(
                        std::str::from_utf8(b)
                            .ok()
                            .and_then(|s| s.parse::<f64>().ok())
                            .filter(|e| e.is_finite())
                            .ok_or_else(|| garbage("the earliest expiry"))?,
                    ),
                    other => return Err(garbage(&format!("{other:?} for the earliest expiry"))),
                };
                Ok(Seen {
                    ok: flag(ok)?,
                    now: now(time)?,
                    in_flight: whole(in_flight, "slots held")?,
                    earliest,
                    ticket: whole(ticket, "a ticket")?,
                    ..none
                })
            }
            (SlotOp::Release { .. }, flagged) => Ok(Seen { ok: flag(flagged)?, ..none }),
            (SlotOp::Renew { .. }, Value::Array(values)) => match values.as_slice() {
                [ok] if !flag(ok)? => Ok(none),
                [ok, time] if flag(ok)? => Ok(Seen { ok: true, now: now(time)?, ..none }),
                _ => Err(garbage(&format!("{values:?} for a renewal"))),
            },
            (SlotOp::Check { .. } | SlotOp::Value | SlotOp::Reset, Value::BulkString(bytes)) => {
                Seen::unpack(bytes)
            }
            (_, other) => Err(garbage(&format!("{other:?} for slots"))),
        }
    }

    /// Reads the answer of the script for a check, a value and a reset: a byte, then four
    /// little-endian doubles.
    fn unpack(bytes: &[u8]) -> Result<Seen, StoreError> {
        if bytes.len() != 33 || bytes[0] > 1 {
            return Err(garbage(&format!("{} bytes for slots", bytes.len())));
        }
        let double = |i: usize| unpack_f64(&bytes[1 + 8 * i..]).unwrap_or(f64::NAN);
        // A count the script summed: a whole number, exact in a double.
        let whole = |x: f64, what: &str| {
            if x >= 0.0 && x < TICKETS_END as f64 && x.fract() == 0.0 {
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                Ok(x as u64)
            } else {
                Err(garbage(&format!("{what} of {x}")))
            }
        };
        let earliest = double(3);
        Ok(Seen {
            ok: bytes[0] == 1,
            now: double(0),
            in_flight: whole(double(1), "slots held")?,
            holders: whole(double(2), "holders")?,
            earliest: (!earliest.is_nan()).then_some(earliest),
            ticket: 0,
        })
    }

    /// The answer to `op`: for an acquire and a check, `decide`'s on what the script saw,
    /// and an error if the script granted otherwise (a bug); for the others, what the script
    /// did.
    fn answer(&self, limit: &Concurrency, op: &SlotOp) -> Result<SlotAnswer, StoreError> {
        let Seen { ok, now, in_flight, holders, earliest, ticket } = *self;
        match *op {
            SlotOp::Acquire { .. } | SlotOp::Check { .. } => {
                // One holder holding every slot held until the earliest expiry: decide reads
                // nothing else of them, and no expiry of a grant (whose script leaves it out).
                let count = u32::try_from(in_flight)
                    .map_err(|_| garbage(&format!("{in_flight} slots held")))?;
                let summary = match earliest {
                    _ if count == 0 => Vec::new(),
                    Some(expiry) => vec![Holder { ticket: 0, count, expiry }],
                    None if ok => vec![Holder { ticket: 0, count, expiry: f64::INFINITY }],
                    None => return Err(garbage("a refusal without an expiry")),
                };
                let (answer, write) = decide(limit, &summary, now, op, ticket)
                    .map_err(|e| StoreError::new(e.message()))?;
                let agrees = match write {
                    Write::Add(holder) => ok && (1..TICKETS_END).contains(&holder.ticket),
                    _ => ok == (answer == SlotAnswer::Free),
                };
                if agrees { Ok(answer) } else { Err(disagree()) }
            }
            SlotOp::Release { .. } => Ok(SlotAnswer::Released(ok)),
            SlotOp::Renew { ttl, .. } => Ok(SlotAnswer::Renewed(ok.then_some(now + ttl))),
            SlotOp::Value => Ok(SlotAnswer::Value { in_flight, holders, earliest }),
            SlotOp::Reset if ok => Ok(SlotAnswer::Reset),
            SlotOp::Reset => Err(disagree()),
        }
    }
}

/// A script's 1 or 0.
fn flag(v: &Value) -> Result<bool, StoreError> {
    match v {
        Value::Int(0) => Ok(false),
        Value::Int(1) => Ok(true),
        other => Err(garbage(&format!("{other:?} for a yes or no"))),
    }
}

/// A count or a ticket a script answered: a whole number below 2^53.
fn whole(v: &Value, what: &str) -> Result<u64, StoreError> {
    match v {
        Value::Int(n) => u64::try_from(*n).ok().filter(|n| *n < TICKETS_END),
        _ => None,
    }
    .ok_or_else(|| garbage(&format!("{v:?} for {what}")))
}

#[cfg(test)]
mod tests {
    use tollgate_algebra::slots::{DEFAULT_TTL, apply};

    use super::*;

    const NOW: f64 = 1_700_000_000_000.25;

    /// What the script of `op` answers on `holders` at `now`, as [`Seen::read`] reads it,
    /// written out from its Lua.
    fn as_the_script(limit: &Concurrency, holders: &[Holder], op: &SlotOp, ticket: u64) -> Seen {
        let live: Vec<&Holder> = holders.iter().filter(|h| h.expiry > NOW).collect();
        let in_flight: u64 = live.iter().map(|h| u64::from(h.count)).sum();
        let fits = |count: u32| in_flight + u64::from(count) <= u64::from(limit.max());
        let found = |ticket: u64| live.iter().any(|h| h.ticket == ticket);
        let earliest = live.iter().map(|h| h.expiry).reduce(f64::min);
        let none =
            Seen { ok: false, now: f64::NAN, in_flight: 0, holders: 0, earliest: None, ticket: 0 };
        let summed = Seen { now: NOW, in_flight, earliest, ..none };
        match *op {
            SlotOp::Acquire { count, .. } if fits(count) => {
                Seen { ok: true, ticket, earliest: None, ..summed }
            }
            SlotOp::Acquire { .. } => summed,
            SlotOp::Release { ticket } => Seen { ok: found(ticket), ..none },
            SlotOp::Renew { ticket, .. } if found(ticket) => Seen { ok: true, now: NOW, ..none },
            SlotOp::Renew { .. } => none,
            SlotOp::Check { count } => {
                Seen { ok: fits(count), holders: live.len() as u64, ..summed }
            }
            SlotOp::Value => Seen { holders: live.len() as u64, ..summed },
            SlotOp::Reset => Seen { ok: true, now: NOW, ..none },
        }
    }

    /// On lists of holders live and expired, every operation answers from the script's
    /// summary exactly as `decide` on the whole list.
    #[test]
    fn answers_are_decides_on_the_whole_list() {
        let limit = Concurrency::new(5).with_ttl(1_000.0);
        let mut seed = 7_u64;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _ in 0..2_000 {
            let mut holders = Vec::new();
            for ticket in 1..=next(5) {
                #[allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]
                let holder = Holder {
                    ticket,
                    count: 1 + next(2) as u32,
                    expiry: NOW - 500.0 + next(1_500) as f64,
                };
                holders.push(holder);
            }
            // Never more than max live: as a store keeps them.
            let mut kept = Vec::new();
            for h in holders {
                let mut with = kept.clone();
                apply(&mut with, &Write::Add(h), NOW);
                if with.iter().map(|h| h.count).sum::<u32>() <= limit.max() {
                    kept.push(h);
                }
            }
            #[allow(clippy::cast_possible_truncation)]
            let count = 1 + next(5) as u32;
            let ticket = next(7);
            let ops = [
                SlotOp::Acquire { count, ttl: DEFAULT_TTL },
                SlotOp::Check { count },
                SlotOp::Release { ticket },
                SlotOp::Renew { ticket, ttl: 250.5 },
                SlotOp::Value,
                SlotOp::Reset,
            ];
            for op in ops {
                let seen = as_the_script(&limit, &kept, &op, 99);
                let (expected, _) = decide(&limit, &kept, NOW, &op, 99).unwrap();
                assert_eq!(seen.answer(&limit, &op).unwrap(), expected, "{op:?} on {kept:?}");
            }
        }
    }

    /// Both keys of a (name, key) carry one hash tag, whatever the prefix, name and key hold;
    /// a tag already there is kept.
    #[test]
    fn the_two_keys_of_a_limits_holders_share_a_hash_tag() {
        let keys = |prefix: &str, name: &str, key: Option<&str>| {
            let store = RedisStore::builder().prefix(prefix).open("redis://127.0.0.1:1").unwrap();
            store.inner.slot_keys(name, key)
        };
        assert_eq!(
            keys("tollgate:", "gpu", Some("t1")),
            ["tollgate:slots:{3:gpu:k2:t1}:expiries", "tollgate:slots:{3:gpu:k2:t1}:counts"]
        );
        // The key's own tag: the slots go beside that key's rate limits on a cluster.
        assert_eq!(
            keys("tollgate:", "gpu", Some("{user42}"))[0],
            "tollgate:slots:3:gpu:k8:{user42}:expiries"
        );
        assert_eq!(keys("{tg}:", "gpu", None)[1], "{tg}:slots:3:gpu:n:counts");
        let odd = [
            ("tollgate:", Some("a}b")),
            ("tollgate:", Some("{}")),
            ("tollgate:", Some("{")),
            ("tollgate:", Some("")),
            ("tollgate:", None),
            ("t{", Some("x")),
        ];
        for (prefix, key) in odd {
            let [a, b] = keys(prefix, "n", key);
            assert!(a.starts_with(prefix) && b.starts_with(prefix), "{a}");
            let tag = hash_tag(a.as_bytes());
            assert!(tag.is_some() && tag == hash_tag(b.as_bytes()), "{a} {b}");
        }
        assert_ne!(keys("t:", "a:b", Some("c")), keys("t:", "a", Some("b:c")));
        assert_ne!(keys("t:", "a", None), keys("t:", "a", Some("")));
    }

    #[test]
    fn a_script_that_wrote_otherwise_is_an_error() {
        let limit = Concurrency::new(2);
        let acquire = SlotOp::Acquire { count: 1, ttl: 10.0 };
        let granted = as_the_script(&limit, &[], &acquire, 5);
        assert!(granted.answer(&limit, &acquire).is_ok());
        let full = [Holder { ticket: 1, count: 2, expiry: NOW + 5.0 }];
        let refused = as_the_script(&limit, &full, &acquire, 0);
        assert!(refused.answer(&limit, &acquire).is_ok());
        let check = SlotOp::Check { count: 1 };
        let free = as_the_script(&limit, &[], &check, 0);
        for (wrong, op) in [
            (Seen { ok: false, ..granted }, acquire),
            (Seen { ticket: 0, ..granted }, acquire),
            (Seen { ok: true, ticket: 6, ..refused }, acquire),
            (Seen { ok: false, ..free }, check),
        ] {
            let error = wrong.answer(&limit, &op).unwrap_err();
            assert!(error.message().contains("disagree"), "{error}");
        }
        let release = SlotOp::Release { ticket: 5 };
        let unknown = as_the_script(&limit, &[], &release, 0);
        assert!(Seen { ok: true, ..unknown }.answer(&limit, &release).is_ok(), "released");
    }

    #[test]
    fn answers_are_read_exactly_or_refused() {
        let int = |n: i64| Value::Int(n);
        let text = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        let acquire = SlotOp::Acquire { count: 1, ttl: 60e3 };
        let (ms, us) = (1_800_000_000_000, 1_800_000_000_000_123);
        #[allow(clippy::cast_precision_loss)]
        let time = ms as f64;
        let granted =
            Value::Array(vec![int(1), int(ms), int(3), text("1800000000500.25"), int(us)]);
        let none =
            Seen { ok: false, now: f64::NAN, in_flight: 0, holders: 0, earliest: None, ticket: 0 };
        assert_eq!(
            Seen::read(&granted, &acquire, None).unwrap(),
            Seen {
                ok: true,
                now: time,
                in_flight: 3,
                earliest: Some(1_800_000_000_500.25),
                ticket: 1_800_000_000_000_123,
                ..none
            }
        );
        // On a test's clock the script says 0 for the time: the store's is used.
        let first = Value::Array(vec![int(1), int(0), int(0), text(""), int(us)]);
        let seen = Seen::read(&first, &acquire, Some(NOW)).unwrap();
        assert_eq!((seen.now, seen.earliest), (NOW, None));
        assert!(Seen::read(&int(1), &SlotOp::Release { ticket: 1 }, None).unwrap().ok);
        let renew = SlotOp::Renew { ticket: 1, ttl: 5.5 };
        let renewed = Seen::read(&Value::Array(vec![int(1), int(ms)]), &renew, None).unwrap();
        assert_eq!(
            renewed.answer(&Concurrency::new(1), &renew).unwrap(),
            SlotAnswer::Renewed(Some(time + 5.5))
        );
        let expired = Seen::read(&Value::Array(vec![int(0)]), &renew, None).unwrap();
        assert_eq!(
            expired.answer(&Concurrency::new(1), &renew).unwrap(),
            SlotAnswer::Renewed(None)
        );

        let pack = |flag: u8, numbers: [f64; 4]| {
            let mut bytes = vec![flag];
            for x in numbers {
                bytes.extend_from_slice(&x.to_le_bytes());
            }
            Value::BulkString(bytes)
        };
        let seen = Seen::read(&pack(1, [NOW, 3.0, 2.0, NOW + 0.5]), &SlotOp::Value, None).unwrap();
        assert_eq!(
            seen,
            Seen {
                ok: true,
                now: NOW,
                in_flight: 3,
                holders: 2,
                earliest: Some(NOW + 0.5),
                ticket: 0
            }
        );
        let empty = Seen::read(&pack(0, [NOW, 0.0, 0.0, f64::NAN]), &SlotOp::Value, None).unwrap();
        assert_eq!(empty.earliest, None);

        let garbage = [
            (pack(2, [NOW, 0.0, 0.0, f64::NAN]), SlotOp::Value),
            (pack(1, [NOW, 1.5, 1.0, NOW]), SlotOp::Value),
            (pack(1, [NOW, -1.0, 1.0, NOW]), SlotOp::Value),
            (Value::BulkString(vec![1; 48]), SlotOp::Reset),
            (int(1), SlotOp::Value),
            (int(2), SlotOp::Release { ticket: 1 }),
            (Value::Array(vec![int(1)]), renew),
            (Value::Array(vec![int(0), int(ms)]), renew),
            (Value::Array(vec![int(1), int(ms), int(3), text("x"), int(us)]), acquire),
            (Value::Array(vec![int(1), int(ms), int(-1), text(""), int(us)]), acquire),
            (Value::Array(vec![int(1), int(ms), int(0), text(""), int(1 << 53)]), acquire),
            (Value::Array(vec![int(1), int(0), int(0), text(""), int(us)]), acquire),
            (Value::Array(vec![int(1), int(ms), int(0), Value::Nil]), acquire),
        ];
        for (reply, op) in garbage {
            assert!(Seen::read(&reply, &op, None).is_err(), "{reply:?} for {op:?}");
        }
    }
}

/// The keys on the Redis of `TOLLGATE_REDIS_URL` (skipped without it, unless
/// `TOLLGATE_REQUIRE_BACKENDS=1`).
#[cfg(test)]
mod on_redis_tests {
    use tollgate_algebra::{ManualClock, SECOND};

    use super::*;
    use crate::store::testing::T0;

    /// The keys expire no sooner than their latest holder, renewed or not (a grant or a
    /// renewal may move their expiry, never before a live holder's; a release leaves it);
    /// with none left the set is gone and the hash keeps only the last ticket, for a second;
    /// a refusal, a check and a value write nothing.
    #[tokio::test]
    async fn the_keys_live_as_long_as_the_last_holder() {
        let Some(url) = crate::store::testing::backend_url("TOLLGATE_REDIS_URL") else { return };
        let clock = ManualClock::new(T0);
        let prefix = format!("tollgate-slot-keys:{}:", std::process::id());
        let store = RedisStore::builder().prefix(prefix).open_with_clock(&url, clock).unwrap();
        let [tickets, counts] = store.inner.slot_keys("gpu", Some("k"));
        let client = redis::Client::open(url.as_str()).unwrap();
        let mut conn = client.get_connection().unwrap();
        let mut pttl = |key: &str| -> i64 { redis::cmd("PTTL").arg(key).query(&mut conn).unwrap() };
        let limit = Concurrency::new(2);
        let run = async |op: SlotOp| store.slots("gpu", Some("k"), &limit, &op).await.unwrap();
        let granted = |answer| match answer {
            SlotAnswer::Acquired { ticket, .. } => ticket,
            other => panic!("refused: {other:?}"),
        };

        let one = granted(run(SlotOp::Acquire { count: 1, ttl: 20.0 * SECOND }).await);
        let two = granted(run(SlotOp::Acquire { count: 1, ttl: 30.0 * SECOND }).await);
        assert!(two > one && two < TICKETS_END, "{one} then {two}");
        for key in [&tickets, &counts] {
            assert!((29_000..=30_000).contains(&pttl(key)), "{key}: {}", pttl(key));
        }
        // Renewed past the other: the keys live as long as it.
        let renewed = run(SlotOp::Renew { ticket: one, ttl: 50.0 * SECOND }).await;
        assert_eq!(renewed, SlotAnswer::Renewed(Some(T0 + 50.0 * SECOND)));
        assert!((49_000..=50_000).contains(&pttl(&counts)), "{}", pttl(&counts));
        // Full: a refusal, a check and a value leave the keys as they were.
        let refused = run(SlotOp::Acquire { count: 1, ttl: SECOND }).await;
        assert_eq!(refused, SlotAnswer::Refused { retry_after: 30.0 * SECOND });
        assert_eq!(run(SlotOp::Check { count: 1 }).await, refused);
        assert_eq!(
            run(SlotOp::Value).await,
            SlotAnswer::Value { in_flight: 2, holders: 2, earliest: Some(T0 + 30.0 * SECOND) }
        );
        assert!((49_000..=50_000).contains(&pttl(&counts)), "{}", pttl(&counts));
        // The one renewed released: the keys keep their expiry (a release never moves it).
        assert_eq!(run(SlotOp::Release { ticket: one }).await, SlotAnswer::Released(true));
        assert!((49_000..=50_000).contains(&pttl(&tickets)), "{}", pttl(&tickets));
        // The latest holder renewed sooner: the keys outlive it (Redis 7 keeps their later
        // expiry; before 7 they are given the holder's).
        let renewed = run(SlotOp::Renew { ticket: two, ttl: 40.0 * SECOND }).await;
        assert_eq!(renewed, SlotAnswer::Renewed(Some(T0 + 40.0 * SECOND)));
        assert!((39_000..=50_000).contains(&pttl(&counts)), "{}", pttl(&counts));
        // A grant, or a renewal, expiring sooner than the latest holder leaves them so.
        let short = granted(run(SlotOp::Acquire { count: 1, ttl: 20.0 * SECOND }).await);
        let renewed = run(SlotOp::Renew { ticket: short, ttl: 30.0 * SECOND }).await;
        assert_eq!(renewed, SlotAnswer::Renewed(Some(T0 + 30.0 * SECOND)));
        for key in [&tickets, &counts] {
            assert!((39_000..=50_000).contains(&pttl(key)), "{key}: {}", pttl(key));
        }
        assert_eq!(run(SlotOp::Release { ticket: short }).await, SlotAnswer::Released(true));
        // None left: the set gone, the hash holding the last ticket alone, for a second.
        assert_eq!(run(SlotOp::Release { ticket: two }).await, SlotAnswer::Released(true));
        assert_eq!(pttl(&tickets), -2, "no such key");
        assert!((0..=1_000).contains(&pttl(&counts)), "{}", pttl(&counts));
        let left: Vec<String> =
            redis::cmd("HKEYS").arg(&counts).query(&mut client.get_connection().unwrap()).unwrap();
        assert_eq!(left, ["next"]);
        // Tickets go on from it.
        let three = granted(run(SlotOp::Acquire { count: 2, ttl: SECOND }).await);
        assert!(three > two, "{two} then {three}");
        assert_eq!(run(SlotOp::Reset).await, SlotAnswer::Reset);
        assert_eq!(pttl(&tickets), -2, "no such key");
    }

    /// `replicas=1` on a Redis with no replica: an acquire runs on the primary, is not
    /// acknowledged, and fails closed saying it may have taken (it did: its slot is held);
    /// a value, which writes nothing, is not held up.
    #[tokio::test]
    async fn an_acquire_that_may_have_run_says_so() {
        let Some(url) = crate::store::testing::backend_url("TOLLGATE_REDIS_URL") else { return };
        let waits = format!("{url}{}replicas=1", if url.contains('?') { '&' } else { '?' });
        let prefix = format!("tollgate-slot-replicas:{}:", std::process::id());
        let store = RedisStore::builder()
            .prefix(&prefix)
            .timeout(std::time::Duration::from_millis(200))
            .open(&waits)
            .unwrap();
        let limit = Concurrency::new(3);
        let acquire = SlotOp::Acquire { count: 2, ttl: 10.0 * SECOND };
        let error = store.slots("gpu", None, &limit, &acquire).await.unwrap_err();
        assert!(error.may_have_taken() && error.is_unavailable(), "{error}");
        let SlotAnswer::Value { in_flight, .. } =
            store.slots("gpu", None, &limit, &SlotOp::Value).await.unwrap()
        else {
            panic!("not a value");
        };
        assert_eq!(in_flight, 2, "taken on the primary");
        let plain = RedisStore::builder().prefix(prefix).open(&url).unwrap();
        assert_eq!(
            plain.slots("gpu", None, &limit, &SlotOp::Reset).await.unwrap(),
            SlotAnswer::Reset
        );
    }
}
