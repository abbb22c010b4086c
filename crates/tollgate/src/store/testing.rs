//! What the stores' own tests share: the URL of a backend, and a check that a store's
//! grouped round trip answers as one request after the other.

#[cfg(any(feature = "redis", feature = "postgres"))]
use tollgate_algebra::{Clock, Config, MINUTE, ManualClock, OneTake, SECOND, Take};

#[cfg(any(feature = "redis", feature = "postgres"))]
use super::memory::MemoryStore;
#[cfg(any(feature = "redis", feature = "postgres"))]
use super::seam::{AsyncStore, OneAnswer, Store};

/// The URL of a backend for a store's own tests, from `var`: `None` (the test returns early)
/// without it, unless `TOLLGATE_REQUIRE_BACKENDS=1`, which makes it a failure.
pub(crate) fn backend_url(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(url) if !url.is_empty() => Some(url),
        _ if std::env::var("TOLLGATE_REQUIRE_BACKENDS").as_deref() == Ok("1") => {
            panic!("{var} is required by TOLLGATE_REQUIRE_BACKENDS=1")
        }
        _ => None,
    }
}

/// The clock's start.
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) const T0: f64 = 1_700_000_000_000.0;

/// `take` as a one-take that writes.
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) fn writing<'a>(take: &Take<'a>) -> OneTake<'a> {
    OneTake::new(take, 0, true).unwrap()
}

/// Groups of 1 to 40 one-takes over four limits and three keys (repeats in a group
/// included), with counts, reservations, maxReserved and checks, each group run by
/// `send` in one round trip (answering, per take, the time it used, whether it wrote and
/// the state it loaded): every answer as the memory store's, one take after the other,
/// and every state in `store` as the memory store's after each group. Deletes its states.
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) async fn grouped_takes_answer_as_memory(
    clock: &ManualClock,
    store: &impl AsyncStore,
    send: impl AsyncFn(&[OneTake<'_>]) -> Vec<OneAnswer>,
) {
    let memory = MemoryStore::with_clock(clock.clone());
    let limits = [
        ("tb", Config::token_bucket(10.0, MINUTE)),
        ("burst", Config::token_bucket(2.0, SECOND).with_capacity(5.0).with_max_reserved(4.0)),
        ("fw", Config::fixed_window(10.0, MINUTE).with_start(T0 - 7.0 * SECOND)),
        ("fw_burst", Config::fixed_window(3.0, SECOND).with_capacity(6.0)),
    ];
    let keys = [Some("a"), Some(""), None];
    // A small LCG: the same cases every run.
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = |n: u64| {
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % n
    };
    let slot = |name, key, config| {
        let take = Take { name, key, config, count: 1.0, reserve: false };
        OneTake::new(&take, 0, false).unwrap().slot
    };
    let (mut admitted, mut refused) = (0, 0);
    for _ in 0..60 {
        clock.advance([0.0, 150.0, 1_000.0, 7_000.0][next(4) as usize]);
        let group: Vec<(Take<'_>, bool)> = (0..1 + next(40))
            .map(|_| {
                let (name, config) = limits[next(4) as usize];
                let take = Take {
                    name,
                    key: keys[next(3) as usize],
                    config,
                    count: [1.0, 2.0, 3.0, 0.5][next(4) as usize],
                    reserve: next(3) == 0,
                };
                (take, next(5) != 0)
            })
            .collect();
        let ones: Vec<OneTake<'_>> =
            group.iter().map(|(t, writes)| OneTake::new(t, 0, *writes).unwrap()).collect();
        let answers = send(&ones).await;
        assert_eq!(answers.len(), ones.len());
        for (one, (now, wrote, loaded)) in ones.iter().zip(answers) {
            assert_eq!(now, clock.now());
            let (taken, new) = one.decide(now, loaded);
            assert_eq!(wrote, new.is_some());
            let expected = Store::execute_one(&memory, one).unwrap();
            assert_eq!(taken.decision, expected.decision, "{:?}", one.slot.name);
            assert_eq!(taken.status, expected.status, "{:?}", one.slot.name);
            if taken.decision.ok {
                admitted += 1;
            } else {
                refused += 1;
            }
        }
        for (name, config) in limits {
            for key in keys {
                let slot = [slot(name, key, config)];
                assert_eq!(
                    store.read_async(&slot).await.unwrap().1,
                    Store::read(&memory, &slot).unwrap().1
                );
            }
        }
    }
    assert!(admitted > 100 && refused > 100, "both: {admitted} admitted, {refused} refused");
    for (name, _) in limits {
        for key in keys {
            store.delete_async(name, key, 1).await.unwrap();
        }
    }
}
