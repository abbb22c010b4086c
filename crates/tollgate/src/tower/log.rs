//! Store failures logged without flooding: the first of an interval at once, the rest of it
//! counted and summed up in one line when the interval is over, whether or not another
//! failure comes.
//!
//! The server's `ErrorLog` does the same for its listeners; it flushes from a timer of its
//! own runtime. The layer has no runtime it may count on (tower services run on any), so
//! the summary is written by a short-lived thread, started when the first failure of an
//! interval is held back and gone when the interval is over: it sleeps on no runtime thread,
//! and a run of failures starts at most one thread per interval.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// Failures logged without flooding; see the module doc.
pub(super) struct FailureLog {
    state: Mutex<State>,
    interval: Duration,
    /// Writes a line (to `tracing`, or to a test's buffer).
    write: fn(&str),
}

struct State {
    /// When the interval of the last line written began; `None` once summed up.
    since: Option<Instant>,
    /// Failures since, not written.
    more: u64,
    /// The message of the last of them.
    last: String,
    /// Whether a thread is waiting to sum them up.
    timer: bool,
}

/// The layer's log of store failures: a line at most every 10 s, `tracing`'s target
/// `tollgate::tower`.
pub(super) static STORE_FAILURES: FailureLog = FailureLog::new(Duration::from_secs(10), warn);

fn warn(line: &str) {
    tracing::warn!(target: "tollgate::tower", "{line}");
}

impl FailureLog {
    pub(super) const fn new(interval: Duration, write: fn(&str)) -> Self {
        FailureLog {
            state: Mutex::new(State { since: None, more: 0, last: String::new(), timer: false }),
            interval,
            write,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A store failure: written at once if none was in this interval, else counted.
    pub(super) fn note(&'static self, error: &crate::StoreError) {
        use std::fmt::Write as _;
        let mut state = self.lock();
        let now = Instant::now();
        if state.since.is_some_and(|since| now.duration_since(since) < self.interval) {
            state.more += 1;
            state.last.clear();
            let _ = write!(state.last, "{error}");
            if !state.timer {
                state.timer = self.start_timer();
            }
            return;
        }
        let (more, last) = (std::mem::take(&mut state.more), std::mem::take(&mut state.last));
        state.since = Some(now);
        drop(state);
        self.summary(more, &last);
        (self.write)(&format!("rate limit store failed: {error}"));
    }

    /// A thread that sums up the interval when it is over; false if none could be started
    /// (then the next failure after the interval writes the summary, as it always may).
    fn start_timer(&'static self) -> bool {
        std::thread::Builder::new()
            .name("tollgate-log".into())
            .spawn(move || self.flush_when_over())
            .is_ok()
    }

    fn flush_when_over(&self) {
        loop {
            let mut state = self.lock();
            let left = state
                .since
                .map_or(Duration::ZERO, |since| self.interval.saturating_sub(since.elapsed()));
            if left.is_zero() {
                let (more, last) =
                    (std::mem::take(&mut state.more), std::mem::take(&mut state.last));
                state.since = None;
                state.timer = false;
                drop(state);
                self.summary(more, &last);
                return;
            }
            drop(state);
            std::thread::sleep(left);
        }
    }

    /// When the current interval began and how many failures it holds back: a failure
    /// changes one or the other.
    #[cfg(test)]
    pub(super) fn noted(&self) -> (Option<Instant>, u64) {
        let state = self.lock();
        (state.since, state.more)
    }

    fn summary(&self, more: u64, last: &str) {
        if more > 0 {
            let s = if more == 1 { "" } else { "s" };
            (self.write)(&format!(
                "and {more} more rate limit store failure{s} in the {} ms since; the last: {last}",
                self.interval.as_millis()
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());

    fn record(line: &str) {
        LINES.lock().unwrap().push(line.to_owned());
    }

    fn lines() -> Vec<String> {
        LINES.lock().unwrap().clone()
    }

    /// The count of an interval's held-back failures is written when the interval is over,
    /// with no later failure to carry it (before, it waited for one, forever if none came).
    #[test]
    fn the_summary_comes_when_the_interval_is_over_without_another_failure() {
        static LOG: FailureLog = FailureLog::new(Duration::from_millis(500), record);
        let error = |n: u32| crate::StoreError::new(format!("connection refused #{n}"));
        for n in 1..=3 {
            LOG.note(&error(n));
        }
        assert_eq!(lines(), ["rate limit store failed: rate limit store: connection refused #1"]);
        let deadline = Instant::now() + Duration::from_secs(5);
        while lines().len() < 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(
            lines()[1..],
            ["and 2 more rate limit store failures in the 500 ms since; the last: \
              rate limit store: connection refused #3"]
        );
        // The interval was summed up: the next failure is written at once, and alone.
        LOG.note(&error(4));
        assert_eq!(lines().len(), 3);
        assert_eq!(lines()[2], "rate limit store failed: rate limit store: connection refused #4");
    }
}
