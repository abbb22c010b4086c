//! Behaviours of the memory store itself: bounded memory, max_keys, exactness under threads.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tollgate::{
    Config, Decision, MINUTE, ManualClock, MemoryStore, RateLimiter, Request, SECOND, Target,
};

const T0: f64 = 1_700_000_000_000.0;

#[test]
fn full_token_buckets_are_dropped() {
    let clock = ManualClock::new(T0);
    let l = RateLimiter::new(MemoryStore::with_clock(clock.clone()));
    let t = Target::Inline("t", Config::token_bucket(10.0, MINUTE));
    let keys: Vec<String> = (0..1000).map(|i| format!("user{i}")).collect();
    for k in &keys {
        l.limit(t, k.as_str()).unwrap();
    }
    assert_eq!(l.store().len(), 1000);
    // One token flows back in 6 s: then every state is full and carries no information.
    // Sweeps drop states within a second after that (expiry is kept in whole seconds).
    clock.advance(6.0 * SECOND);
    assert_eq!(l.store().sweep(), 0, "never before they are full");
    clock.advance(1.0 * SECOND);
    assert_eq!(l.store().sweep(), 1000);
    assert!(l.store().is_empty());
    // A dropped state is the same as a full one.
    assert_eq!(l.value(t, Some("user1")).unwrap().value, 10.0);
    // A request that leaves a state full stores nothing at all.
    l.limit(t, Request::new().key("x").count(0.0)).unwrap();
    assert!(l.store().is_empty());
}

#[test]
fn sweeps_run_by_themselves_as_keys_churn() {
    let clock = ManualClock::new(T0);
    let l = RateLimiter::new(MemoryStore::builder().segments(1).build_with_clock(clock.clone()));
    let t = Target::Inline("t", Config::token_bucket(1.0, SECOND));
    // 100 rounds of 1,000 new keys, each round a second apart: only the last rounds live.
    for round in 0..100 {
        for i in 0..1000 {
            l.limit(t, format!("r{round}k{i}").as_str()).unwrap();
        }
        clock.advance(SECOND);
    }
    assert!(l.store().len() <= 4_000, "memory follows active keys: {}", l.store().len());
}

#[test]
fn fixed_windows_are_dropped_without_moving_their_windows() {
    let clock = ManualClock::new(T0);
    let l = RateLimiter::builder(MemoryStore::with_clock(clock.clone())).seed(3).build();
    let t = Target::Inline("w", Config::fixed_window(10.0, MINUTE));
    let start = l.value(t, Some("k")).unwrap().config.start().unwrap();
    l.limit(t, Request::new().key("k").count(10.0)).unwrap();
    let window = l.value(t, Some("k")).unwrap().ts;
    // Expiry is kept in whole seconds, rounded up: the state goes within a second of full.
    clock.set(window + MINUTE + SECOND);
    assert_eq!(l.store().sweep(), 1);
    // The next window starts where the stored one would have: refused until window + 2 minutes.
    l.limit(t, Request::new().key("k").count(10.0)).unwrap();
    let d = l.limit(t, Request::new().key("k")).unwrap();
    assert_eq!(d.retry_after, Some(MINUTE - SECOND));
    assert_eq!(l.value(t, Some("k")).unwrap().config.start(), Some(start));
}

#[test]
fn max_keys_fails_closed_for_new_keys_only() {
    let clock = ManualClock::new(T0);
    let l = RateLimiter::new(MemoryStore::builder().max_keys(10).build_with_clock(clock.clone()));
    let t = Target::Inline("t", Config::token_bucket(10.0, MINUTE));
    for i in 0..10 {
        l.limit(t, format!("k{i}").as_str()).unwrap();
    }
    let err = l.limit(t, "new").unwrap_err();
    assert!(err.to_string().contains("the memory store is full"), "{err}");
    assert!(l.limit(t, "k3").unwrap().ok, "existing keys go on");
    // A transaction needing room for a new key takes nothing from the existing one.
    let before = l.value(t, Some("k4")).unwrap().value;
    assert!(l.transaction(&[t.with("k4"), t.with("new")]).is_err());
    assert_eq!(l.value(t, Some("k4")).unwrap().value, before);
    // Once states are full again, there is room: the store sweeps before refusing, for a
    // transaction as for a single limit.
    clock.advance(MINUTE);
    assert!(l.transaction(&[t.with("k4"), t.with("new2")]).unwrap().ok);
    assert!(l.limit(t, "new").unwrap().ok);
    assert_eq!(l.value(t, Some("new2")).unwrap().value, 9.0);
}

#[test]
fn transactions_of_every_size_are_all_or_nothing() {
    let l = RateLimiter::new(MemoryStore::with_clock(ManualClock::new(T0)));
    let t = Target::Inline("t", Config::token_bucket(10.0, MINUTE));
    let empty = l.transaction(&[]).unwrap();
    assert!(empty.ok && empty.retry_after.is_none() && empty.results.is_empty());
    let empty = l.transaction_with_status(&[]).unwrap();
    assert!(empty.decision.ok && empty.statuses.is_empty());
    let keys = ["a", "b", "c", "d", "e", "f"];
    let remaining = |t: &tollgate::TransactionTaken| -> Vec<f64> {
        t.statuses.iter().map(|s| s.remaining).collect()
    };
    // One to six calls (the memory store decides up to four one by one, more through a
    // plan), twice: every key left with 8 tokens.
    for n in 1..=keys.len() {
        let calls: Vec<_> = keys[..n].iter().map(|&k| t.with(k)).collect();
        let d = l.transaction(&calls).unwrap();
        assert!(d.ok, "{n} calls");
        assert_eq!(d.results.len(), n);
        let taken = l.transaction_with_status(&calls).unwrap();
        assert!(taken.decision.ok, "{n} calls");
        assert_eq!(taken.decision.results.len(), n);
        assert_eq!(remaining(&taken), vec![8.0; n]);
        for &k in &keys[..n] {
            l.reset(t, Some(k)).unwrap();
        }
    }
    // The last of n calls is refused (its key spent): nothing taken from the others.
    for n in 2..=keys.len() {
        let spent = keys[n - 1];
        assert!(l.limit(t, Request::new().key(spent).count(10.0)).unwrap().ok);
        let mut calls: Vec<_> = keys[..n].iter().map(|&k| t.with(k)).collect();
        let d = l.transaction(&calls).unwrap();
        assert!(!d.ok, "{n} calls");
        assert_eq!(d.retry_after, Some(6_000.0));
        for &k in &keys[..n - 1] {
            assert_eq!(l.value(t, Some(k)).unwrap().value, 10.0, "{n} calls, key {k}");
        }
        assert_eq!(l.value(t, Some(spent)).unwrap().value, 0.0);
        // With statuses: every limit as it stands, nothing taken (through a plan beyond four
        // calls).
        let taken = l.transaction_with_status(&calls).unwrap();
        assert!(!taken.decision.ok);
        // Each call's decision as it alone would be decided, with statuses or without (the
        // store finds no states again for `transaction`, which keeps no statuses).
        let alone = |i: usize| d.results[i].ok && d.results[i].retry_after.is_none();
        assert!((0..n - 1).all(alone), "{n} calls: {:?}", d.results);
        assert_eq!(d.results[n - 1], Decision { ok: false, retry_after: Some(6_000.0) });
        assert_eq!(d.results, taken.decision.results, "{n} calls");
        let mut expected = vec![10.0; n];
        expected[n - 1] = 0.0;
        assert_eq!(remaining(&taken), expected, "{n} calls");
        assert!(taken.statuses[..n - 1].iter().all(|s| s.reset_after == 0.0));
        assert_eq!(taken.statuses[n - 1].reset_after, MINUTE);
        // The same refusal with `throws` is an error naming the limit.
        calls[0] = t.with(Request::new().key(keys[0]).throws());
        let err = l.transaction(&calls).unwrap_err();
        assert!(matches!(err, tollgate::Error::RateLimited { ref name, .. } if name == "t"));
        l.reset(t, Some(spent)).unwrap();
    }
}

#[test]
fn transactions_count_the_states_they_keep() {
    let clock = ManualClock::new(T0);
    let store = Arc::new(MemoryStore::builder().segments(2).build_with_clock(clock.clone()));
    let l = RateLimiter::new(Arc::clone(&store));
    let t = Target::Inline("t", Config::token_bucket(10.0, MINUTE));
    let u = Target::Inline("u", Config::token_bucket(2.0, MINUTE));
    assert!(l.transaction(&[t.with("a"), t.with("b"), u.with("a")]).unwrap().ok);
    assert_eq!(store.len(), 3);
    // A take of nothing leaves a new state full: nothing kept for it.
    assert!(l.transaction(&[t.with("a"), t.with(Request::new().key("c").count(0.0))]).unwrap().ok);
    assert_eq!(store.len(), 3);
    // Refused (u has 1 left): nothing taken, nothing kept.
    let d = l.transaction(&[t.with("d"), u.with(Request::new().key("a").count(2.0))]).unwrap();
    assert!(!d.ok);
    assert_eq!(store.len(), 3);
    assert_eq!(l.value(t, Some("a")).unwrap().value, 8.0);
    // Once every state is full again, a transaction that touches them drops them.
    clock.advance(MINUTE);
    let nothing = |key| Request::new().key(key).count(0.0);
    assert!(
        l.transaction(&[t.with(nothing("a")), t.with(nothing("b")), u.with(nothing("a"))])
            .unwrap()
            .ok
    );
    assert_eq!(store.len(), 0);
}

#[test]
fn eight_threads_admit_exactly_the_limit() {
    let l = Arc::new(RateLimiter::new(MemoryStore::new()));
    // A day-long period: nothing flows back while the threads run.
    let t = Target::Inline("hot", Config::token_bucket(500.0, 24.0 * 3_600_000.0));
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let l = Arc::clone(&l);
            std::thread::spawn(move || (0..1000).filter(|_| l.limit(t, "k").unwrap().ok).count())
        })
        .collect();
    let admitted: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert_eq!(admitted, 500);
}

#[test]
fn transactions_across_threads_stay_atomic() {
    // Two limits always taken together: whatever the interleaving, both run out together.
    let store = MemoryStore::builder().segments(64).build_with_clock(ManualClock::new(T0));
    let l = Arc::new(RateLimiter::new(store));
    let a = Target::Inline("a", Config::token_bucket(300.0, 24.0 * 3_600_000.0));
    let b = Target::Inline("b", Config::token_bucket(1000.0, 24.0 * 3_600_000.0));
    let threads: Vec<_> = (0..4)
        .map(|i| {
            let l = Arc::clone(&l);
            std::thread::spawn(move || {
                let key = if i % 2 == 0 { "x" } else { "y" };
                (0..500)
                    .filter(|_| l.transaction(&[a.with(key), b.with("shared")]).unwrap().ok)
                    .count()
            })
        })
        .collect();
    let admitted: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert_eq!(admitted, 600); // 300 for each key of `a`
    assert_eq!(l.value(b, Some("shared")).unwrap().value, 400.0, "b gave exactly what a admitted");
}

/// Far more threads than cores on two segments, while the tables grow (each transaction
/// inserts a new key) and another thread sweeps them over and over (holding each segment
/// while it scans it): every thread gets through (a waiter yields its core to the holder),
/// the locks taken in opposite call orders do not deadlock, and the count stays exact.
#[test]
fn many_threads_on_two_segments_with_sweeps_stay_exact() {
    let store = MemoryStore::builder().segments(2).build_with_clock(ManualClock::new(T0));
    let l = Arc::new(RateLimiter::new(store));
    let day = 24.0 * 3_600_000.0;
    let shared = Target::Inline("shared", Config::token_bucket(1000.0, day));
    let own = Target::Inline("own", Config::token_bucket(1.0, day));
    let done = Arc::new(AtomicBool::new(false));
    let sweeper = {
        let (l, done) = (Arc::clone(&l), Arc::clone(&done));
        std::thread::spawn(move || {
            let mut sweeps = 0u64;
            while !done.load(Ordering::Relaxed) {
                assert_eq!(l.store().sweep(), 0, "nothing is full: nothing refills");
                sweeps += 1;
            }
            sweeps
        })
    };
    let threads: Vec<_> = (0..16)
        .map(|i| {
            let l = Arc::clone(&l);
            std::thread::spawn(move || {
                (0..200)
                    .filter(|j| {
                        let key = format!("{i}-{j}");
                        let (a, b) = (own.with(key.as_str()), shared.with("all"));
                        let calls = if (i + j) % 2 == 0 { [a, b] } else { [b, a] };
                        l.transaction(&calls).unwrap().ok
                    })
                    .count()
            })
        })
        .collect();
    let admitted: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    done.store(true, Ordering::Relaxed);
    assert!(sweeper.join().unwrap() > 0);
    assert_eq!(admitted, 1000, "3,200 asked, the shared limit holds 1,000");
    assert_eq!(l.value(shared, Some("all")).unwrap().value, 0.0);
    // One state per admitted key of `own` (taken to 0, not full), and the shared one.
    assert_eq!(l.store().len(), 1001);
}

/// Many names and keys in few segments, so tables grow (every entry rehashed), names
/// alternate (the last-name shortcut misses and hits), and each state stays its own.
#[test]
fn states_stay_apart_through_growth_and_many_names() {
    let clock = ManualClock::new(0.0);
    let store = MemoryStore::builder().segments(2).build_with_clock(clock);
    let limiter = RateLimiter::new(store);
    let names = ["a", "bb", "a-much-longer-name-than-sixteen", "d", "e5"];
    let config = Config::token_bucket(1_000.0, MINUTE);
    for round in 1..=3 {
        for k in 0..2_000 {
            let key = format!("key-{k}");
            for (i, name) in names.iter().enumerate() {
                // Each (name, key) takes its own amount, so any mix-up shows.
                let count = (i + 1) as f64;
                assert!(
                    limiter
                        .limit((*name, config), Request::new().key(&key).count(count))
                        .unwrap()
                        .ok
                );
            }
        }
        for k in (0..2_000).step_by(97) {
            let key = format!("key-{k}");
            for (i, name) in names.iter().enumerate() {
                let value = limiter.value((*name, config), Some(&key)).unwrap().value;
                assert_eq!(value, 1_000.0 - (i + 1) as f64 * f64::from(round), "{name} {key}");
            }
        }
    }
    assert_eq!(limiter.store().len(), 10_000);
}

/// `keys_of` lists a name's states (not those of a name it is a prefix of); a state
/// carried to a slower refill outlives the moment the old config saw it full, and is
/// swept once full under the new one.
#[test]
fn keys_of_and_a_carried_state_outliving_its_old_expiry() {
    let clock = tollgate::ManualClock::new(1_700_000_000_000.0);
    let limiter = RateLimiter::new(MemoryStore::with_clock(clock.clone()));
    let fast = Config::token_bucket(10.0, tollgate::SECOND);
    let slow = Config::token_bucket(10.0, 100.0 * tollgate::SECOND);
    assert!(limiter.limit(("a", fast), Request::new().key("k").count(10.0)).unwrap().ok);
    assert!(limiter.limit(("a", fast), Request::new().count(1.0)).unwrap().ok);
    assert!(limiter.limit(("ab", fast), "k").unwrap().ok);
    let mut keys = limiter.store().keys_of("a");
    keys.sort();
    assert_eq!(keys, [(None, 0), (Some("k".to_owned()), 0)]);
    assert!(limiter.store().keys_of("b").is_empty());
    assert_eq!(limiter.carry("a", Some("k"), &fast, &slow).unwrap(), 1);
    clock.advance(5.0 * tollgate::SECOND);
    assert_eq!(limiter.store().sweep(), 2, "the others, full under their config");
    let kept = limiter.value(("a", slow), Some("k")).unwrap();
    assert_eq!((kept.value, kept.ts), (0.0, 1_700_000_000_000.0));
    clock.advance(101.0 * tollgate::SECOND);
    assert_eq!(limiter.store().sweep(), 1);
}
