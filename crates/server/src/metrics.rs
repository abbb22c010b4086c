//! Prometheus metrics: requests by operation and outcome, latency, store errors.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use parking_lot::Mutex;

/// Upper bounds of the latency histogram's buckets, in seconds.
const BUCKETS: [f64; 12] =
    [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0];

/// The server's counters.
#[derive(Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    requests: BTreeMap<(&'static str, &'static str), u64>,
    latency: BTreeMap<&'static str, Histogram>,
}

#[derive(Default)]
struct Histogram {
    buckets: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Metrics {
    /// Counts one request of `op` that ended as `outcome` and took `elapsed`.
    pub fn record(&self, op: &'static str, outcome: &'static str, elapsed: Duration) {
        let secs = elapsed.as_secs_f64();
        let mut inner = self.inner.lock();
        *inner.requests.entry((op, outcome)).or_default() += 1;
        let h = inner.latency.entry(op).or_default();
        h.count += 1;
        h.sum += secs;
        for (bucket, bound) in h.buckets.iter_mut().zip(BUCKETS) {
            if secs <= bound {
                *bucket += 1;
            }
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let inner = self.inner.lock();
        let mut out = String::new();
        out.push_str("# HELP tollgate_requests_total Requests by operation and outcome.\n");
        out.push_str("# TYPE tollgate_requests_total counter\n");
        for ((op, outcome), n) in &inner.requests {
            let _ =
                writeln!(out, "tollgate_requests_total{{op=\"{op}\",outcome=\"{outcome}\"}} {n}");
        }
        out.push_str(
            "# HELP tollgate_store_errors_total Requests that failed because the store did.\n",
        );
        out.push_str("# TYPE tollgate_store_errors_total counter\n");
        let store_errors: u64 =
            inner.requests.iter().filter(|((_, o), _)| *o == "store_error").map(|(_, n)| n).sum();
        let _ = writeln!(out, "tollgate_store_errors_total {store_errors}");
        out.push_str("# HELP tollgate_request_duration_seconds Time to answer, by operation.\n");
        out.push_str("# TYPE tollgate_request_duration_seconds histogram\n");
        for (op, h) in &inner.latency {
            for (bound, n) in BUCKETS.iter().zip(h.buckets) {
                let _ = writeln!(
                    out,
                    "tollgate_request_duration_seconds_bucket{{op=\"{op}\",le=\"{bound}\"}} {n}"
                );
            }
            let _ = writeln!(
                out,
                "tollgate_request_duration_seconds_bucket{{op=\"{op}\",le=\"+Inf\"}} {}",
                h.count
            );
            let _ = writeln!(out, "tollgate_request_duration_seconds_sum{{op=\"{op}\"}} {}", h.sum);
            let _ =
                writeln!(out, "tollgate_request_duration_seconds_count{{op=\"{op}\"}} {}", h.count);
        }
        out
    }
}
