//! Concurrency limits on Redis (SPEC §6f): the holders of a (name, key) are a sorted set of
//! their tickets by expiry and a hash of their counts, under one hash tag (so that a cluster
//! keeps them in one slot), changed by one run of [`SCRIPT_SLOTS`](super::script::SCRIPT_SLOTS) per operation. The script
//! decides, as it must to be atomic; the answer is `tollgate_algebra::slots::decide`'s, on
//! what the script saw, and a script that wrote where the algebra would not (or the other way
//! round) is an error.
//!
//! Slots are never leased: a store built with leases runs every operation here, directly.

use std::fmt::Write as _;

use redis::Value;
use tollgate_algebra::slots::{Concurrency, Holder, SlotAnswer, SlotOp, Write, decide};
use tollgate_algebra::{Clock, Outcome, Plan};

#[cfg(feature = "redis-cluster")]
use super::cluster::hash_slot;
use super::keys::hash_tag;
use super::wire::{disagree, garbage, num, unpack_f64};
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
    /// Runs `op` on (name, key)'s holders in one round trip (see [`SCRIPT_SLOTS`](super::script::SCRIPT_SLOTS)). An
    /// operation that may write (an acquire, a release, a renewal, a reset) whose reply never
    /// came says it may have run: an acquire may then hold slots until its ttl ends.
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
        let mut invocation = inner.slots.prepare_invoke();
        invocation.key(&tickets).key(&counts).arg(inner.now_arg());
        let (code, which, ttl) = match *op {
            SlotOp::Acquire { count, ttl } => ("a", u64::from(count), Some(ttl)),
            SlotOp::Release { ticket } => ("r", ticket, None),
            SlotOp::Renew { ticket, ttl } => ("n", ticket, Some(ttl)),
            SlotOp::Check { count } => ("c", u64::from(count), None),
            SlotOp::Value => ("v", 0, None),
            SlotOp::Reset => ("x", 0, None),
        };
        invocation.arg(code).arg(which).arg(ttl.map(num).unwrap_or_default()).arg(limit.max());
        let writes = if op.writes() { Writes::Yes } else { Writes::No };
        let reply: Value = inner
            .on_connection(
                writes,
                |mut conn| async move { invocation.invoke_async(&mut conn).await },
            )
            .await?;
        Seen::unpack(&reply)?.answer(limit, op)
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
        let seen = Seen::unpack(&reply.pop().ok_or_else(|| garbage("no answer for slots"))?)?;
        // The slots' answer is decide's on what the script saw; the plan is then decided as
        // the script ran it, a check unless the slots were granted.
        let holders = seen.holders_for(op)?;
        let (answer, _) = decide(limit, &holders, seen.now, op, seen.ticket.max(1))
            .map_err(|e| StoreError::new(e.message()))?;
        let granted = matches!(answer, SlotAnswer::Acquired { .. });
        let checking;
        let ran = plan_ran(
            if granted {
                plan
            } else {
                checking = plan.checking();
                &checking
            },
            reply,
        )?;
        let wrote = granted && ran.outcome.ok;
        let made = (1..TICKETS_END).contains(&seen.ticket) && seen.expiry == seen.now + ttl;
        if granted != seen.ok || wrote != (seen.ticket != 0) || (wrote && !made) {
            return Err(disagree());
        }
        Ok((slots_with_answer(answer, &ran.outcome), ran.outcome))
    }
}

/// What a run of [`SCRIPT_SLOTS`](super::script::SCRIPT_SLOTS) saw and did.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Seen {
    /// Granted, free, released, renewed (as the operation goes).
    ok: bool,
    now: f64,
    /// Slots held by live holders, before the write.
    in_flight: u64,
    /// Live holders, before the write.
    holders: u64,
    /// The earliest live holder's expiry.
    earliest: Option<f64>,
    /// The ticket made (0: none).
    ticket: u64,
    /// The expiry written (NaN: none).
    expiry: f64,
}

impl Seen {
    /// Reads the script's answer: a byte, then six little-endian doubles.
    fn unpack(reply: &Value) -> Result<Seen, StoreError> {
        let Value::BulkString(bytes) = reply else {
            return Err(garbage("not a string for slots"));
        };
        if bytes.len() != 49 || bytes[0] > 1 {
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
            ticket: whole(double(4), "a ticket")?,
            expiry: double(5),
        })
    }

    /// The live holders `decide` needs to answer `op` as on all of them: for an acquire or a
    /// check, one holding every slot held until the earliest expiry (decide reads nothing
    /// else of them); for a release or a renewal, the ticket's if it was live (with a count
    /// and an expiry those answers do not read); for a reset, none.
    fn holders_for(&self, op: &SlotOp) -> Result<Vec<Holder>, StoreError> {
        Ok(match *op {
            SlotOp::Acquire { .. } | SlotOp::Check { .. } => match self.earliest {
                Some(expiry) if self.in_flight > 0 => {
                    let count = u32::try_from(self.in_flight)
                        .map_err(|_| garbage(&format!("{} slots held", self.in_flight)))?;
                    vec![Holder { ticket: 0, count, expiry }]
                }
                _ => Vec::new(),
            },
            SlotOp::Release { ticket } | SlotOp::Renew { ticket, .. } if self.ok => {
                vec![Holder { ticket, count: 1, expiry: f64::INFINITY }]
            }
            _ => Vec::new(),
        })
    }

    /// The answer to `op`, `decide`'s on what the script saw; an error if the script wrote
    /// otherwise than it says (a bug).
    fn answer(&self, limit: &Concurrency, op: &SlotOp) -> Result<SlotAnswer, StoreError> {
        if *op == SlotOp::Value {
            let Seen { in_flight, holders, earliest, .. } = *self;
            return Ok(SlotAnswer::Value { in_flight, holders, earliest });
        }
        let holders = self.holders_for(op)?;
        let (answer, write) = decide(limit, &holders, self.now, op, self.ticket)
            .map_err(|e| StoreError::new(e.message()))?;
        let agrees = match (write, answer) {
            (Write::Add(holder), _) => {
                self.ok && holder.expiry == self.expiry && (1..TICKETS_END).contains(&holder.ticket)
            }
            (Write::Expiry(_, expiry), _) => self.ok && expiry == self.expiry,
            (Write::Remove(_) | Write::Clear, _) | (Write::Nothing, SlotAnswer::Free) => self.ok,
            (Write::Nothing, _) => !self.ok,
        };
        if agrees { Ok(answer) } else { Err(disagree()) }
    }
}

#[cfg(test)]
mod tests {
    use tollgate_algebra::slots::{DEFAULT_TTL, apply};

    use super::*;

    const NOW: f64 = 1_700_000_000_000.25;

    /// What the script answers for `op` on `holders` at `now`, written out from its Lua.
    fn as_the_script(limit: &Concurrency, holders: &[Holder], op: &SlotOp, ticket: u64) -> Seen {
        let live: Vec<&Holder> = holders.iter().filter(|h| h.expiry > NOW).collect();
        let in_flight: u64 = live.iter().map(|h| u64::from(h.count)).sum();
        let fits = |count: u32| in_flight + u64::from(count) <= u64::from(limit.max());
        let found = |ticket: u64| live.iter().any(|h| h.ticket == ticket);
        let (ok, ticket, expiry) = match *op {
            SlotOp::Acquire { count, ttl } if fits(count) => (true, ticket, NOW + ttl),
            SlotOp::Check { count } => (fits(count), 0, f64::NAN),
            SlotOp::Release { ticket } => (found(ticket), 0, f64::NAN),
            SlotOp::Renew { ticket, ttl } if found(ticket) => (true, 0, NOW + ttl),
            SlotOp::Reset => (true, 0, f64::NAN),
            _ => (false, 0, f64::NAN),
        };
        Seen {
            ok,
            now: NOW,
            in_flight,
            holders: live.len() as u64,
            earliest: live.iter().map(|h| h.expiry).reduce(f64::min),
            ticket,
            expiry,
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
        for wrong in [
            Seen { ok: false, ..granted },
            Seen { expiry: NOW + 11.0, ..granted },
            Seen { ticket: 0, ..granted },
        ] {
            let error = wrong.answer(&limit, &acquire).unwrap_err();
            assert!(error.message().contains("disagree"), "{error}");
        }
        let release = SlotOp::Release { ticket: 5 };
        let unknown = as_the_script(&limit, &[], &release, 0);
        assert!(Seen { ok: true, ..unknown }.answer(&limit, &release).is_ok(), "released");
    }

    #[test]
    fn answers_are_read_exactly_or_refused() {
        let pack = |flag: u8, numbers: [f64; 6]| {
            let mut bytes = vec![flag];
            for x in numbers {
                bytes.extend_from_slice(&x.to_le_bytes());
            }
            Value::BulkString(bytes)
        };
        let seen = Seen::unpack(&pack(1, [NOW, 3.0, 2.0, NOW + 0.5, 1.8e15, NOW + 60e3])).unwrap();
        assert_eq!(
            seen,
            Seen {
                ok: true,
                now: NOW,
                in_flight: 3,
                holders: 2,
                earliest: Some(NOW + 0.5),
                ticket: 1_800_000_000_000_000,
                expiry: NOW + 60e3,
            }
        );
        let none = Seen::unpack(&pack(0, [NOW, 0.0, 0.0, f64::NAN, 0.0, f64::NAN])).unwrap();
        assert_eq!(none.earliest, None);
        for garbage in [
            pack(2, [NOW, 0.0, 0.0, f64::NAN, 0.0, f64::NAN]),
            pack(1, [NOW, 1.5, 1.0, NOW, 0.0, f64::NAN]),
            pack(1, [NOW, -1.0, 1.0, NOW, 0.0, f64::NAN]),
            pack(1, [NOW, 1.0, 1.0, NOW, 2f64.powi(53), f64::NAN]),
            Value::BulkString(vec![1; 48]),
            Value::Int(1),
        ] {
            assert!(Seen::unpack(&garbage).is_err(), "{garbage:?}");
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

    /// The keys expire with their last holder, renewed or not; with none left the set is
    /// gone and the hash keeps only the last ticket, for a second; a refusal, a check and a
    /// value write nothing.
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
        // The one renewed released: the keys live as long as the other.
        assert_eq!(run(SlotOp::Release { ticket: one }).await, SlotAnswer::Released(true));
        assert!((29_000..=30_000).contains(&pttl(&tickets)), "{}", pttl(&tickets));
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
