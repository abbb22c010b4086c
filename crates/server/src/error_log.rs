//! Failures logged without flooding: one line at once, the rest of an interval summed up.
//! Shared by every listener (the HTTP API, the rate limit service), for failed requests and
//! for connections that could not be accepted.

use std::time::{Duration, Instant};

use axum::http::StatusCode;

/// How often a run of failed requests is summed up in the log.
const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Failures logged without flooding: the first of an interval of `LOG_INTERVAL` (10 s) at
/// once, the rest of it counted and summed up in one line (their count and the last message)
/// when the interval is over. One for failed requests (5xx), one for connections that could
/// not be accepted (out of file descriptors, say).
pub struct ErrorLog {
    state: parking_lot::Mutex<ErrorLogState>,
    /// What the summary counts: `requests failed`.
    what: &'static str,
}

impl Default for ErrorLog {
    fn default() -> Self {
        ErrorLog::new("requests failed")
    }
}

#[derive(Default)]
struct ErrorLogState {
    /// When the interval of the last logged line began.
    since: Option<Instant>,
    /// Failures since, not logged.
    more: u64,
    last: String,
}

impl ErrorLog {
    /// A log whose summaries count `what` (`connections could not be accepted`).
    pub fn new(what: &'static str) -> Self {
        ErrorLog { state: parking_lot::Mutex::default(), what }
    }

    /// A request of `op` failed with `status` and `message`.
    pub fn record(&self, op: &str, status: StatusCode, message: &str) {
        self.note(message, || tracing::warn!(op, status = %status, "request failed: {message}"));
    }

    /// A failure: `log` logs it, unless one was logged less than an interval ago (then it is
    /// counted, and `message` kept for the summary).
    pub fn note(&self, message: &str, log: impl FnOnce()) {
        let mut state = self.state.lock();
        let now = Instant::now();
        if state.since.is_some_and(|since| now.duration_since(since) < LOG_INTERVAL) {
            state.more += 1;
            message.clone_into(&mut state.last);
            return;
        }
        let (more, last) = (std::mem::take(&mut state.more), std::mem::take(&mut state.last));
        state.since = Some(now);
        drop(state);
        self.summary(more, &last);
        log();
    }

    /// Sums up the interval that is over, if any failures are still untold; for a timer.
    pub fn flush(&self) {
        let mut state = self.state.lock();
        if state.since.is_some_and(|since| since.elapsed() >= LOG_INTERVAL) && state.more > 0 {
            let (more, last) = (std::mem::take(&mut state.more), std::mem::take(&mut state.last));
            state.since = None;
            drop(state);
            self.summary(more, &last);
        }
    }

    fn summary(&self, more: u64, last: &str) {
        if more > 0 {
            tracing::warn!(
                count = more,
                "{more} more {} in the last {} s; the last: {last}",
                self.what,
                LOG_INTERVAL.as_secs()
            );
        }
    }
}
