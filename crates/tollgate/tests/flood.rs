//! Floods of distinct keys, as a hostile client sends: the memory store holds a state only
//! while it is not full again (its documented policy), gives the memory back once the
//! buckets have refilled and a sweep has run, and with `max_keys` never holds more; the
//! SQLite file stops growing once full states are swept, reusing their pages. Each test
//! prints its figures (BENCHMARKS.md, "Key floods").

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use tollgate::{Config, Error, MINUTE, ManualClock, MemoryStore, RateLimiter};

/// Counts the bytes currently allocated by this test binary.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts sizes.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn allocated() -> isize {
    LIVE.load(Ordering::Relaxed)
}

const T0: f64 = 1_700_000_000_000.0;

/// One token a minute per key: each take leaves a state that is full again a minute later.
const PER_KEY: Config = Config::token_bucket(1.0, MINUTE);

/// One test at a time: they count one allocator.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn the_memory_store_follows_active_keys_and_gives_memory_back() {
    let _one = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let clock = ManualClock::new(T0);
    let store = MemoryStore::with_clock(clock.clone());
    let limiter = RateLimiter::new(store);
    let base = allocated();
    let wave = 200_000;
    let mut peak = 0;
    for round in 0..3 {
        // A flood of keys never seen before, each taking its one token.
        for i in 0..wave {
            let key = format!("flood-{round}-{i:07}");
            assert!(limiter.limit(("perKey", PER_KEY), key.as_str()).unwrap().ok);
        }
        let live = limiter.store().len();
        assert_eq!(live, wave, "round {round}: every state is live until it refills");
        peak = peak.max(allocated() - base);
        // A minute later every bucket is full again: a sweep drops them all (the store keeps
        // a state up to a second past its refill: expiries are whole seconds, rounded up),
        // and the tables shrink.
        clock.advance(MINUTE + 1_000.0);
        assert_eq!(limiter.store().sweep(), wave, "round {round}");
        assert_eq!(limiter.store().len(), 0);
        let after = allocated() - base;
        eprintln!(
            "memory store, round {round}: {wave} live keys, {:.1} MiB at the peak; after the \
             refill and a sweep {:.1} KiB",
            peak as f64 / 1048576.0,
            after as f64 / 1024.0
        );
        assert!(after < 1 << 20, "round {round}: {after} bytes still held after the sweep");
    }
    // The peak does not grow from wave to wave: memory follows the live keys only.
    assert!(peak < wave as isize * 128, "{peak} bytes for {wave} keys");
}

#[test]
fn with_max_keys_the_memory_store_never_holds_more() {
    let _one = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let clock = ManualClock::new(T0);
    let store = MemoryStore::builder().max_keys(50_000).build_with_clock(clock.clone());
    let limiter = RateLimiter::new(store);
    let (mut admitted, mut refused) = (0, 0);
    for i in 0..80_000 {
        let key = format!("capped-{i:07}");
        match limiter.limit(("perKey", PER_KEY), key.as_str()) {
            Ok(d) => admitted += usize::from(d.ok),
            Err(Error::Store(_)) => refused += 1,
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!((admitted, refused), (50_000, 30_000), "new keys fail closed at the bound");
    assert_eq!(limiter.store().len(), 50_000);
    // Once the states are full again, room comes back by itself (a full store sweeps).
    clock.advance(MINUTE + 1_000.0);
    assert!(limiter.limit(("perKey", PER_KEY), "a new key").unwrap().ok);
    assert_eq!(limiter.store().len(), 1);
    eprintln!("memory store, max_keys 50000: 80000 new keys, 50000 admitted, 30000 refused");
}

#[cfg(feature = "sqlite")]
#[test]
fn the_sqlite_file_stops_growing_once_full_states_are_swept() {
    use tollgate::store::SqliteStore;

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("flood.db");
    let clock = ManualClock::new(T0);
    let store = SqliteStore::builder().open_with_clock(&path, clock.clone()).unwrap();
    let limiter = RateLimiter::new(store);
    let pages = || -> i64 {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(())).unwrap();
        conn.query_row("PRAGMA page_count", [], |row| row.get(0)).unwrap()
    };
    let wave = 20_000;
    let mut sizes = Vec::new();
    for round in 0..4 {
        for i in 0..wave {
            let key = format!("flood-{round}-{i:07}");
            assert!(limiter.limit(("inline", PER_KEY), key.as_str()).unwrap().ok);
        }
        sizes.push(pages());
        clock.advance(MINUTE);
        // Every state full again, whatever its config: the name is not defined anywhere.
        assert_eq!(limiter.store().sweep_full().unwrap(), wave, "round {round}");
    }
    eprintln!("SQLite, waves of {wave} new keys, pages after each wave: {sizes:?}");
    let first = sizes[0];
    for (round, size) in sizes.iter().enumerate() {
        assert!(
            *size <= first + first / 10,
            "round {round}: {size} pages, {first} after the first"
        );
    }
}
