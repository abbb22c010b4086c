//! Time sources: milliseconds since the Unix epoch, as an `f64`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

/// A source of the current time in milliseconds since the Unix epoch.
///
/// The algebra never reads a clock; stores do, once per request, and hand the time in.
pub trait Clock: Send + Sync + 'static {
    /// The current time in ms since the Unix epoch.
    fn now(&self) -> f64;
}

/// The process's clock: the wall clock read once, then advanced by the CPU's monotonic
/// time-stamp counter (through `quanta`).
///
/// Reading `SystemTime` costs a vDSO call (41 ns on our CI machine); the counter costs 12 ns,
/// and it never goes backwards when the wall clock is stepped, which is what a rate limiter
/// wants. Over a long-lived process it drifts from the wall clock only by as much as the
/// machine's clock is slewed (parts per million). Stores whose state is shared between
/// machines use the database's clock instead.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl SystemClock {
    /// The wall clock in ms since the Unix epoch, read now (no anchor, no counter).
    pub fn wall() -> f64 {
        let d = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        d.as_secs() as f64 * 1_000.0 + f64::from(d.subsec_nanos()) / 1_000_000.0
    }
}

/// The wall clock once, and the counter's reading at that moment.
struct Anchor {
    wall: f64,
    counter: quanta::Clock,
    start: u64,
}

static ANCHOR: OnceLock<Anchor> = OnceLock::new();

impl Clock for SystemClock {
    #[inline]
    fn now(&self) -> f64 {
        let a = ANCHOR.get_or_init(|| {
            let counter = quanta::Clock::new();
            let start = counter.raw();
            Anchor { wall: SystemClock::wall(), counter, start }
        });
        // The raw counter, scaled: what quanta::Instant::now does, without its check for a
        // thread-local mock clock on every read. A counter behind `start` (another core's
        // TSC a hair behind) reads as no time passed, never as time going back.
        let nanos = a.counter.delta_as_nanos(a.start, a.counter.raw());
        a.wall + nanos as f64 * 1e-6
    }
}

/// A clock that moves only when told to: for tests and the simulator.
///
/// Clones share one time, so a test keeps a handle while a store owns another.
///
/// # Examples
///
/// ```
/// use tollgate_core::{Clock, ManualClock};
///
/// let clock = ManualClock::new(1_000.0);
/// let handle = clock.clone();
/// handle.advance(500.0);
/// assert_eq!(clock.now(), 1_500.0);
/// ```
#[derive(Clone, Debug, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock stopped at `now` ms.
    pub fn new(now: f64) -> Self {
        ManualClock(Arc::new(AtomicU64::new(now.to_bits())))
    }

    /// Sets the time to `now` ms.
    pub fn set(&self, now: f64) {
        self.0.store(now.to_bits(), Ordering::SeqCst);
    }

    /// Moves the time forward by `ms`.
    pub fn advance(&self, ms: f64) {
        let _ = self.0.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |bits| {
            Some((f64::from_bits(bits) + ms).to_bits())
        });
    }
}

impl Clock for ManualClock {
    fn now(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::SeqCst))
    }
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> f64 {
        (**self).now()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_clock_is_ms_since_epoch_and_monotonic() {
        let now = SystemClock.now();
        assert!(now > 1.7e12 && now < 1e13, "{now}");
        assert!((now - SystemClock::wall()).abs() < 1_000.0, "anchored to the wall clock");
        let mut last = now;
        for _ in 0..10_000 {
            let t = SystemClock.now();
            assert!(t >= last);
            last = t;
        }
    }

    #[test]
    fn manual_clock_is_shared() {
        let a = ManualClock::new(10.0);
        let b = a.clone();
        b.set(20.0);
        a.advance(0.5);
        assert_eq!(b.now(), 20.5);
    }
}
