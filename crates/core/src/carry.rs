//! What a change of a limit's config (a server's reload, a new release of an app) does to the
//! states stored under the old one.
//!
//! SPEC §2 reads a stored state under whatever config reads it: a slower rate refills it more
//! slowly from its `ts`, a higher capacity lets it fill further. Two things break that if
//! nothing is done:
//!
//! - A store drops a state once it is full again (SPEC §5), and fixes that moment when it
//!   writes the state, from the config of that write. Under a slower rate, a longer period
//!   or a higher capacity the state is full later, so it would be dropped while still short
//!   of full, and read as full: [`Carry::Refill`] rewrites such states under the new config
//!   (a take of nothing), which moves their expiry to when they are full under it.
//! - A change of kind or of shards changes what the two numbers mean (a fixed window's `ts`
//!   is the start of a window, a token bucket's the last refill; shard `j` of ten holds a
//!   tenth of the capacity, shard 0 of one holds all of it), and the shards a new layout
//!   adds have no state, so they read as full. [`Carry::Convert`] brings each (name, key) to
//!   at most the value the old config gives it now: see [`carry_counts`].
//!
//! Carrying only ever takes tokens (never gives any back), so it can run while requests are
//! served, and run again, without ever letting more through than the new config allows from
//! what was consumed under the old one.

use smallvec::SmallVec;

use crate::config::{Config, Kind};
use crate::eval::{State, evaluate};

/// What a change of config from `old` to `new` asks of the states stored under `old`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Carry {
    /// Nothing: the numbers are read as before and no state is full later than its store
    /// expects (no change; `maxReserved`; a fixed window's `start`, which places only states
    /// not yet stored; a faster refill or a lower capacity, under which a state is full no
    /// later, so its store drops it no earlier than it may).
    Nothing,
    /// The same kind and shards with a slower refill (a lower rate, a longer period) or a
    /// higher capacity: each stored state is read under the new config as SPEC §2 says, but
    /// it may be full later than the old config said, which is when its store drops it. A
    /// take of nothing under the new config rewrites it, and its expiry with it.
    Refill,
    /// Another kind or number of shards: each (name, key) with a stored state is brought to
    /// at most what the old config gives it now (see [`carry_counts`]).
    Convert,
}

impl Carry {
    /// What the change from `old` to `new` asks.
    ///
    /// ```
    /// use tollgate_algebra::{Carry, Config, HOUR, SECOND};
    ///
    /// let before = Config::token_bucket(10.0, 10.0 * SECOND);
    /// assert_eq!(Carry::of(&before, &Config::token_bucket(10.0, HOUR)), Carry::Refill);
    /// assert_eq!(Carry::of(&before, &before.with_shards(4)), Carry::Convert);
    /// assert_eq!(Carry::of(&before, &before.with_max_reserved(5.0)), Carry::Nothing);
    /// ```
    pub fn of(old: &Config, new: &Config) -> Carry {
        if old.kind() != new.kind() || old.shards() != new.shards() {
            return Carry::Convert;
        }
        // When a state (value v, ts) is full: a token bucket at ts + (capacity - v) * period /
        // rate, a fixed window at ts + ceil((capacity - v) / rate) * period. Later for some v
        // exactly when the capacity rises or the refill slows.
        let slower = match new.kind() {
            Kind::TokenBucket => new.period() * old.rate() > old.period() * new.rate(),
            // A calendar window (or a change of one) may be full later than the old windows
            // say: rewritten, as a slower refill is.
            Kind::FixedWindow => {
                new.rate() < old.rate()
                    || new.period() > old.period()
                    || new.calendar() != old.calendar()
            }
        };
        if slower || new.capacity() > old.capacity() { Carry::Refill } else { Carry::Nothing }
    }
}

/// The config of the takes that carry states over to `new`: one shard of it, as a limit of
/// its own, with reservations unbounded (so that a carrying take, which may leave a state
/// below zero, is never refused).
pub fn carrying(new: &Config) -> Config {
    new.unbounded_shard()
}

/// The tokens to take from each shard of `new` (under [`carrying`]`(new)`, with `reserve`)
/// so that one (name, key) whose states were stored under `old` reads under `new` as at most
/// what `old` gives it at `now`.
///
/// `states[j]` is the stored state of shard `j`, for every `j` below the larger of the two
/// shard counts. Under `old` the (name, key) holds `V`, the sum of its shards' values at
/// `now` (a shard with no state is full). Each shard `j` of `new` is then brought down to:
///
/// - with as many shards as before (a change of kind): shard `j`'s own value under `old`;
/// - with another number of shards: `V / new.shards()`, the old total spread evenly.
///
/// A shard already lower under `new` (a decrease of shards that keeps a shard emptier than
/// that share) keeps its value: carrying takes, it never gives back. So the (name, key) as a
/// whole never holds more than `V` and a shard never more than its capacity. The shards
/// beyond `new`'s count are not read any more (a reset of the key deletes them).
///
/// # Examples
///
/// One shard of 100 with 40 left becomes ten shards of 10: each is taken down to 4.
///
/// ```
/// use tollgate_algebra::{carry_counts, Config, State, HOUR};
///
/// let old = Config::token_bucket(100.0, HOUR);
/// let new = old.with_shards(10);
/// let mut states = vec![None; 10];
/// states[0] = Some(State { value: 40.0, ts: 0.0 });
/// let counts = carry_counts(&old, &new, &states, 0.0);
/// assert_eq!(counts.iter().sum::<f64>(), 60.0); // 6 from each of the ten shards of 10
/// assert!(counts.iter().all(|&c| c == 6.0));
/// ```
///
/// # Panics
///
/// If `states` is shorter than the larger shard count.
pub fn carry_counts(
    old: &Config,
    new: &Config,
    states: &[Option<State>],
    now: f64,
) -> SmallVec<[f64; 4]> {
    let (n_old, n_new) = (usize::from(old.shards()), usize::from(new.shards()));
    assert!(states.len() >= n_old.max(n_new), "a state (or None) for every shard of both");
    let old_shard = carrying(old);
    let new_shard = carrying(new);
    let value = |shard: &Config, state: Option<State>| {
        // The alignment only places a state not stored yet, which starts full either way.
        evaluate(shard, state, 0.0, now, 0.0, true).state.value
    };
    let old_values: SmallVec<[f64; 4]> =
        states[..n_old].iter().map(|&state| value(&old_shard, state)).collect();
    let total: f64 = old_values.iter().sum();
    (0..n_new)
        .map(|j| {
            let target = if n_old == n_new { old_values[j] } else { total / n_new as f64 };
            let now_new = value(&new_shard, states[j]);
            // f64::max drops a NaN: a state that reads as no number is not taken from.
            (now_new - target).max(0.0)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{HOUR, MINUTE, SECOND};

    const T0: f64 = 1_700_000_000_000.0;

    /// What a (name, key) holds in all under `config` at `now`, the states after the takes.
    fn total(config: &Config, states: &[Option<State>], now: f64) -> f64 {
        let shard = carrying(config);
        (0..usize::from(config.shards()))
            .map(|j| evaluate(&shard, states[j], 0.0, now, 0.0, true).state.value)
            .sum()
    }

    /// The states after taking `counts` under `new` at `now`.
    fn taken(
        new: &Config,
        states: &[Option<State>],
        counts: &[f64],
        now: f64,
    ) -> Vec<Option<State>> {
        let shard = carrying(new);
        let mut after = states.to_vec();
        for (j, &count) in counts.iter().enumerate() {
            if count > 0.0 || states[j].is_some() {
                let e = evaluate(&shard, states[j], 0.0, now, count, true);
                assert!(e.decision.ok, "a carrying take is never refused");
                after[j] = Some(e.state);
            }
        }
        after
    }

    #[test]
    fn what_each_change_asks() {
        let tb = Config::token_bucket(10.0, MINUTE);
        assert_eq!(Carry::of(&tb, &tb), Carry::Nothing);
        assert_eq!(Carry::of(&tb, &tb.with_capacity(20.0)), Carry::Refill);
        assert_eq!(Carry::of(&tb, &Config::token_bucket(5.0, MINUTE)), Carry::Refill);
        assert_eq!(Carry::of(&tb, &Config::token_bucket(10.0, HOUR)), Carry::Refill);
        // Faster, or smaller: every state is full no later than before.
        assert_eq!(Carry::of(&tb, &tb.with_capacity(5.0)), Carry::Nothing);
        let faster = Config::token_bucket(20.0, MINUTE).with_capacity(10.0);
        assert_eq!(Carry::of(&tb, &faster), Carry::Nothing);
        // Twice the rate over twice the period: the same refill.
        let same = Config::token_bucket(20.0, 2.0 * MINUTE).with_capacity(10.0);
        assert_eq!(Carry::of(&tb, &same), Carry::Nothing);
        let window = Config::fixed_window(10.0, MINUTE);
        let longer = Config::fixed_window(20.0, 2.0 * MINUTE).with_capacity(10.0);
        assert_eq!(Carry::of(&window, &longer), Carry::Refill);
        let more_often = Config::fixed_window(20.0, MINUTE).with_capacity(10.0);
        assert_eq!(Carry::of(&window, &more_often), Carry::Nothing);
        assert_eq!(Carry::of(&tb, &Config::fixed_window(10.0, MINUTE)), Carry::Convert);
        assert_eq!(Carry::of(&tb, &tb.with_shards(2)), Carry::Convert);
        let fw = Config::fixed_window(10.0, MINUTE);
        assert_eq!(Carry::of(&fw, &fw.with_start(5.0)), Carry::Nothing);
        assert_eq!(carrying(&fw.with_shards(4)).kind(), Kind::FixedWindow);
        assert_eq!(carrying(&fw.with_shards(4).with_max_reserved(1.0)).max_reserved(), None);
        assert_eq!(carrying(&fw.with_shards(4)).shards(), 1);
        assert_eq!(carrying(&fw.with_shards(4)).capacity(), 2.5);
    }

    /// The issue's case: 100 an hour, exhausted, then `shards = 10`: nothing comes back.
    #[test]
    fn adding_shards_to_an_exhausted_limit_gives_nothing_back() {
        let old = Config::token_bucket(100.0, HOUR);
        let new = old.with_shards(10);
        let mut states = vec![None; 10];
        states[0] = Some(State { value: 0.0, ts: T0 });
        let counts = carry_counts(&old, &new, &states, T0);
        assert_eq!(counts[0], 0.0);
        assert!(counts[1..].iter().all(|&c| c == 10.0), "{counts:?}");
        assert_eq!(total(&new, &taken(&new, &states, &counts, T0), T0), 0.0);
    }

    /// Fewer shards: a kept shard keeps its own value, and one with no state (full under the
    /// old config: a tenth) is taken down to the old total, never read as the new capacity.
    #[test]
    fn removing_shards_never_reads_a_missing_shard_as_full() {
        let old = Config::token_bucket(100.0, HOUR).with_shards(10);
        let new = Config::token_bucket(100.0, HOUR);
        // Shard 0 never used (full, 10), the nine others exhausted: 10 in all.
        let mut states: Vec<Option<State>> = vec![Some(State { value: 0.0, ts: T0 }); 10];
        states[0] = None;
        let counts = carry_counts(&old, &new, &states, T0);
        assert_eq!(counts.as_slice(), &[90.0]);
        assert_eq!(total(&new, &taken(&new, &states, &counts, T0), T0), 10.0);
        // Shard 0 with 3 left, the others full: it keeps its 3 (never raised).
        let mut states = vec![None; 10];
        states[0] = Some(State { value: 3.0, ts: T0 });
        let counts = carry_counts(&old, &new, &states, T0);
        assert_eq!(counts.as_slice(), &[0.0]);
    }

    /// A fixed window's `ts` is its window's start; read as a token bucket's last refill it
    /// would bring back what flowed since. Converted, it holds what the window left.
    #[test]
    fn a_fixed_window_becomes_a_token_bucket_at_its_value() {
        let old = Config::fixed_window(100.0, HOUR);
        let new = Config::token_bucket(100.0, HOUR);
        let window = T0 - 30.0 * MINUTE; // half an hour into the window, 63 taken
        let states = [Some(State { value: 37.0, ts: window })];
        let counts = carry_counts(&old, &new, &states, T0);
        // Read as a token bucket, half an hour brought 50 more (capped at 100): 87.
        assert_eq!(counts.as_slice(), &[50.0]);
        let after = taken(&new, &states, &counts, T0);
        assert_eq!(after[0], Some(State { value: 37.0, ts: T0 }));
    }

    /// A token bucket's state read as a fixed window counts whole windows since its last
    /// refill: never more than the bucket had, so nothing to take; the take of nothing
    /// rewrites it under the new config.
    #[test]
    fn a_token_bucket_becomes_a_fixed_window_at_most_at_its_value() {
        let old = Config::token_bucket(10.0, SECOND);
        let new = Config::fixed_window(10.0, SECOND);
        let states = [Some(State { value: 2.0, ts: T0 - 500.0 })];
        let counts = carry_counts(&old, &new, &states, T0);
        assert_eq!(counts.as_slice(), &[0.0]); // the bucket has 7, the window reads 2
    }

    /// Reservations outstanding (a negative total) carry over as debt: spread over the new
    /// shards, except that a shard deeper in debt than its share stays so (carrying never
    /// gives back).
    #[test]
    fn debt_is_carried_as_debt() {
        let old = Config::token_bucket(10.0, HOUR);
        let new = old.with_shards(2);
        let states = [Some(State { value: -4.0, ts: T0 }), None];
        let counts = carry_counts(&old, &new, &states, T0);
        let after = taken(&new, &states, &counts, T0);
        assert_eq!(after[0].unwrap().value, -4.0);
        assert_eq!(after[1].unwrap().value, -2.0);
        let two = [Some(State { value: -1.0, ts: T0 }), Some(State { value: -3.0, ts: T0 })];
        let counts = carry_counts(&new, &old, &[two[0], two[1]], T0);
        assert_eq!(counts.as_slice(), &[3.0]); // shard 0 becomes the old total, -4
    }

    proptest::proptest! {
        /// Whatever the change of kind or shards, the (name, key) holds at most what the old
        /// config gave it, no shard more than its capacity; carrying again takes nothing more
        /// than carrying once left to take, and never raises anything.
        #[test]
        fn carrying_never_raises_a_limit(
            n_old in 1u16..6, n_new in 1u16..6,
            old_window: bool, new_window: bool,
            values in proptest::collection::vec(proptest::option::of(-20.0f64..20.0), 6),
            ages in proptest::collection::vec(0.0f64..120_000.0, 6),
        ) {
            let kind = |window: bool| if window {
                Config::fixed_window(12.0, MINUTE)
            } else {
                Config::token_bucket(12.0, MINUTE)
            };
            let old = kind(old_window).with_shards(n_old);
            let new = kind(new_window).with_shards(n_new);
            let cap_old = carrying(&old).capacity();
            let states: Vec<Option<State>> = values
                .iter()
                .zip(&ages)
                .map(|(v, age)| v.map(|v| State { value: v.min(cap_old), ts: T0 - age }))
                .collect();
            let counts = carry_counts(&old, &new, &states, T0);
            proptest::prop_assert!(counts.iter().all(|&c| c >= 0.0 && c.is_finite()));
            let after = taken(&new, &states, &counts, T0);
            let before = total(&old, &states, T0);
            let now = total(&new, &after, T0);
            proptest::prop_assert!(now <= before + 1e-9, "{} > {}", now, before);
            let cap_new = carrying(&new).capacity();
            for state in after.iter().take(usize::from(n_new)).flatten() {
                proptest::prop_assert!(state.value <= cap_new + 1e-9);
            }
        }
    }
}
