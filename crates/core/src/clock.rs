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
/// Reading `SystemTime` costs a vDSO call (39-41 ns on our CI machines); a read of this clock
/// costs 15 ns (`cargo run --release -p tollgate-bench --bin host_costs` measures both), and
/// it never goes backwards when the wall clock is stepped, which is what a rate limiter
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

/// The wall clock once, the counter's reading at that moment, and the counter's rate.
struct Anchor {
    wall: f64,
    counter: quanta::Clock,
    start: u64,
    /// Milliseconds per unit of the counter, from quanta's calibration.
    ms_per_tick: f64,
}

/// The span of counter units over which `ms_per_tick` is read off quanta's integer scaling:
/// long enough that its rounding is below a part in 10^12.
const CALIBRATION_TICKS: u64 = 1 << 40;

static ANCHOR: OnceLock<Anchor> = OnceLock::new();

impl Clock for SystemClock {
    #[inline]
    fn now(&self) -> f64 {
        let a = ANCHOR.get_or_init(|| {
            let counter = quanta::Clock::new();
            let start = counter.raw();
            let ms_per_tick = counter.delta_as_nanos(0, CALIBRATION_TICKS) as f64
                / CALIBRATION_TICKS as f64
                * 1e-6;
            Anchor { wall: SystemClock::wall(), counter, start, ms_per_tick }
        });
        // The raw counter since the anchor, scaled by one multiplication. The units go to
        // `f64` as a signed integer (one instruction; an unsigned one takes several), which
        // with quanta's own integer scaling before it cost about a fifth of a read (18.2 ns
        // against 14.8 on our CI machine, `host_costs`). A counter behind `start` (another
        // core's TSC a hair behind) reads as no time passed, never as time going back.
        let ticks = (a.counter.raw().wrapping_sub(a.start) as i64).max(0);
        a.wall + ticks as f64 * a.ms_per_tick
    }
}

/// A clock that moves only when told to: for tests and the simulator.
///
/// Clones share one time, so a test keeps a handle while a store owns another.
///
/// # Examples
///
/// ```
/// use tollgate_algebra::{Clock, ManualClock};
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
    fn system_clock_runs_at_the_rate_of_real_time() {
        // A wrong scale of the counter (off by a factor, or ns read as ms) shows over a sleep.
        // Each read of the clock is bracketed by two reads of `Instant`, so the clock's span
        // lies between the inner and the outer span of those, however long the thread waits
        // between reads on a busy machine.
        use std::time::{Duration, Instant};
        let (outer, clock, inner) = (Instant::now(), SystemClock.now(), Instant::now());
        std::thread::sleep(Duration::from_millis(200));
        let (inner_end, clock_end, outer_end) = (Instant::now(), SystemClock.now(), Instant::now());
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let (least, most) = (ms(inner_end - inner), ms(outer_end - outer));
        let clock = clock_end - clock;
        assert!(least >= 200.0, "{least}");
        assert!(0.9 * least <= clock && clock <= 1.1 * most, "{clock} ms, not in {least}..{most}");
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
