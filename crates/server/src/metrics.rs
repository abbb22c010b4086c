//! Prometheus metrics: requests by operation and outcome, latency, store errors. Counted
//! with atomics, so recording a request takes no lock.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency histogram's buckets, in seconds.
const BUCKETS: [f64; 12] =
    [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0];
const OPS: [&str; 9] =
    ["limit", "check", "transaction", "reset", "value", "adjust", "time", "config", "throttle"];
const OUTCOMES: [&str; 5] = ["ok", "refused", "invalid", "not_defined", "store_error"];

/// The listener a request came by: its `protocol` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// The HTTP/JSON API.
    Http = 0,
    /// The Redis protocol.
    Resp = 1,
}

const PROTOCOLS: [&str; 2] = ["http", "resp"];

/// Why the Redis protocol refused an `AUTH`: its `reason` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthFailure {
    /// A token that is none of the server's.
    WrongToken = 0,
    /// Refused unchecked: its address sent too many wrong tokens.
    Throttled = 1,
}

const AUTH_FAILURES: [&str; 2] = ["wrong_token", "throttled"];

/// The server's counters.
#[derive(Default)]
pub struct Metrics {
    requests: [[[AtomicU64; OUTCOMES.len()]; OPS.len()]; PROTOCOLS.len()],
    latency: [[Histogram; OPS.len()]; PROTOCOLS.len()],
    resp_auth_failures: [AtomicU64; AUTH_FAILURES.len()],
}

#[derive(Default)]
struct Histogram {
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_nanos: AtomicU64,
}

impl Metrics {
    /// Counts one request of `op` that came by `protocol`, ended as `outcome` and took
    /// `elapsed`. Names outside the known sets are not counted.
    pub fn record(
        &self,
        protocol: Protocol,
        op: &'static str,
        outcome: &'static str,
        elapsed: Duration,
    ) {
        let (Some(o), Some(r)) =
            (OPS.iter().position(|x| *x == op), OUTCOMES.iter().position(|x| *x == outcome))
        else {
            return;
        };
        let p = protocol as usize;
        self.requests[p][o][r].fetch_add(1, Ordering::Relaxed);
        let h = &self.latency[p][o];
        h.count.fetch_add(1, Ordering::Relaxed);
        h.sum_nanos.fetch_add(elapsed.as_nanos().try_into().unwrap_or(u64::MAX), Ordering::Relaxed);
        let secs = elapsed.as_secs_f64();
        if let Some(first) = BUCKETS.iter().position(|&bound| secs <= bound) {
            // Cumulative buckets: every bucket from the first that holds it.
            for bucket in &h.buckets[first..] {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Counts an `AUTH` the Redis protocol refused, and why.
    pub fn resp_auth_failed(&self, why: AuthFailure) {
        self.resp_auth_failures[why as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// The Prometheus text exposition; `failed_open` is the limiter's count of requests
    /// granted because the store failed and their limits fail open, `live_states` the
    /// memory store's number of states (none for other stores), `live_names` its names.
    pub fn render(
        &self,
        failed_open: u64,
        live_states: Option<usize>,
        live_names: Option<usize>,
        breaker: Option<tollgate::store::BreakerStats>,
    ) -> String {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut out = String::new();
        out.push_str(
            "# HELP tollgate_requests_total Requests by operation, outcome and protocol.\n",
        );
        out.push_str("# TYPE tollgate_requests_total counter\n");
        let mut store_errors = 0;
        for (protocol, requests) in PROTOCOLS.iter().zip(&self.requests) {
            for (op, counts) in OPS.iter().zip(requests) {
                for (outcome, n) in OUTCOMES.iter().zip(counts) {
                    let n = get(n);
                    if *outcome == "store_error" {
                        store_errors += n;
                    }
                    if n > 0 {
                        let _ = writeln!(
                            out,
                            "tollgate_requests_total{{op=\"{op}\",outcome=\"{outcome}\",\
                             protocol=\"{protocol}\"}} {n}"
                        );
                    }
                }
            }
        }
        out.push_str(
            "# HELP tollgate_store_errors_total Requests that failed because the store did.\n",
        );
        out.push_str("# TYPE tollgate_store_errors_total counter\n");
        let _ = writeln!(out, "tollgate_store_errors_total {store_errors}");
        out.push_str(
            "# HELP tollgate_failed_open_total Requests granted because the store failed and their \
             limit fails open.\n",
        );
        out.push_str("# TYPE tollgate_failed_open_total counter\n");
        let _ = writeln!(out, "tollgate_failed_open_total {failed_open}");
        if let Some(live) = live_states {
            out.push_str(
                "# HELP tollgate_live_states States the store holds (a full state is dropped, so \
                 this follows active keys): the memory store's now, SQLite's at its last sweep.\n",
            );
            out.push_str("# TYPE tollgate_live_states gauge\n");
            let _ = writeln!(out, "tollgate_live_states {live}");
        }
        if let Some(names) = live_names {
            out.push_str(
                "# HELP tollgate_live_names Limit names the memory store keeps (each segment keeps \
                 the names of its states; a name is given back once its states are gone).\n",
            );
            out.push_str("# TYPE tollgate_live_names gauge\n");
            let _ = writeln!(out, "tollgate_live_names {names}");
        }
        if let Some(b) = breaker {
            let gauge = |out: &mut String, name: &str, kind: &str, help: &str, value: u64| {
                let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
            };
            gauge(
                &mut out,
                "tollgate_store_breaker_open",
                "gauge",
                "1 while the store's circuit breaker is open (requests fail at once, unsent).",
                u64::from(b.open),
            );
            gauge(
                &mut out,
                "tollgate_store_breaker_trips_total",
                "counter",
                "Times the store's circuit breaker opened.",
                b.trips,
            );
            gauge(
                &mut out,
                "tollgate_store_breaker_rejected_total",
                "counter",
                "Requests answered at once because the breaker was open.",
                b.rejected,
            );
            gauge(
                &mut out,
                "tollgate_store_failures_total",
                "counter",
                "Requests the store failed: past the deadline, unreachable or disconnected.",
                b.failures,
            );
        }
        out.push_str(
            "# HELP tollgate_resp_auth_failures_total AUTH refused on the Redis protocol: a \
             wrong token, or throttled (refused unchecked after too many from its address).\n",
        );
        out.push_str("# TYPE tollgate_resp_auth_failures_total counter\n");
        for (reason, n) in AUTH_FAILURES.iter().zip(&self.resp_auth_failures) {
            let _ = writeln!(
                out,
                "tollgate_resp_auth_failures_total{{reason=\"{reason}\"}} {}",
                get(n)
            );
        }
        out.push_str(
            "# HELP tollgate_request_duration_seconds Time to answer, by operation and protocol.\n",
        );
        out.push_str("# TYPE tollgate_request_duration_seconds histogram\n");
        for (protocol, latency) in PROTOCOLS.iter().zip(&self.latency) {
            for (op, h) in OPS.iter().zip(latency) {
                let count = get(&h.count);
                if count == 0 {
                    continue;
                }
                let labels = format!("op=\"{op}\",protocol=\"{protocol}\"");
                for (bound, n) in BUCKETS.iter().zip(&h.buckets) {
                    let _ = writeln!(
                        out,
                        "tollgate_request_duration_seconds_bucket{{{labels},le=\"{bound}\"}} {}",
                        get(n)
                    );
                }
                let _ = writeln!(
                    out,
                    "tollgate_request_duration_seconds_bucket{{{labels},le=\"+Inf\"}} {count}"
                );
                let sum = get(&h.sum_nanos) as f64 / 1e9;
                let _ = writeln!(out, "tollgate_request_duration_seconds_sum{{{labels}}} {sum}");
                let _ =
                    writeln!(out, "tollgate_request_duration_seconds_count{{{labels}}} {count}");
            }
        }
        out
    }
}

/// The leased limits' lines: per (name, key) served from leases in this process, grants and
/// returns, requests answered from a lease and direct takes, tokens held.
pub fn render_leases(
    out: &mut String,
    stats: &[(String, Option<String>, tollgate::store::LeaseStats)],
) {
    let series: [Series<'_, tollgate::store::LeaseStats>; 10] = [
        (
            "tollgate_lease_grants_total",
            "counter",
            "Leases granted to this process (renewals too).",
            |s| s.grants as f64,
        ),
        (
            "tollgate_lease_returns_total",
            "counter",
            "Leases this process returned (near the limit, or at shutdown).",
            |s| s.returns as f64,
        ),
        (
            "tollgate_lease_local_total",
            "counter",
            "Requests answered from this process's lease, with no store call.",
            |s| s.local as f64,
        ),
        (
            "tollgate_lease_direct_total",
            "counter",
            "Requests of a leased limit sent to the store as direct takes.",
            |s| s.direct as f64,
        ),
        (
            "tollgate_lease_refused_total",
            "counter",
            "Requests refused from this process's lease with no store call (a store far away \
             and empty at the last grant).",
            |s| s.refused as f64,
        ),
        (
            "tollgate_lease_waited_total",
            "counter",
            "Requests that found this process's lease spent and waited for the next, on its way \
             (a round trip at most).",
            |s| s.waited as f64,
        ),
        ("tollgate_lease_tokens_held", "gauge", "Tokens this process holds in leases now.", |s| {
            s.held
        }),
        (
            "tollgate_lease_round_trip_ms",
            "gauge",
            "The store's round trip as this process's lease requests see it (a moving average).",
            |s| s.round_trip,
        ),
        (
            "tollgate_lease_tokens_elsewhere",
            "gauge",
            "Tokens the store counted out to the key's other holders (other processes) at this \
             process's last grant.",
            |s| s.elsewhere,
        ),
        (
            "tollgate_lease_holders",
            "gauge",
            "Holders of the key at the store at this process's last grant, this one included.",
            |s| s.holders as f64,
        ),
    ];
    let rows: Vec<_> = stats
        .iter()
        .map(|(limit, key, s)| {
            let labels = format!(
                "name=\"{}\",key=\"{}\"",
                label(limit),
                label(key.as_deref().unwrap_or(""))
            );
            (labels, s)
        })
        .collect();
    render_series(out, &series, &rows);
}

/// The leased limits' lines per name: keys leased now in this process (only hot keys are:
/// see `lease.hotAfter`), and takes no lease served (cold keys, checks, or no room left).
pub fn render_leased_names(out: &mut String, names: &[tollgate::store::LeasedName]) {
    let series: [Series<'_, tollgate::store::LeasedName>; 2] = [
        (
            "tollgate_lease_keys_leased",
            "gauge",
            "Keys of the limit with a lease in this process now (its hot keys).",
            |n| n.keys as f64,
        ),
        (
            "tollgate_lease_cold_total",
            "counter",
            "Takes of a leased limit served by no lease (a cold key, a check, or no room for another key), sent to the store as an unleased limit's.",
            |n| n.cold as f64,
        ),
    ];
    let rows: Vec<_> = names.iter().map(|n| (format!("name=\"{}\"", label(&n.name)), n)).collect();
    render_series(out, &series, &rows);
}

/// A series: its name, kind, help, and how to read it from a row.
type Series<'a, T> = (&'a str, &'a str, &'a str, fn(&T) -> f64);

/// Each series' `# HELP` and `# TYPE` lines, then a line per row with the row's labels.
fn render_series<T>(out: &mut String, series: &[Series<'_, T>], rows: &[(String, &T)]) {
    for (name, kind, help, value) in series {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, row) in rows {
            let _ = writeln!(out, "{name}{{{labels}}} {}", value(row));
        }
    }
}

/// A Prometheus label value: `\`, `"` and newlines escaped.
pub(crate) fn label(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative() {
        let m = Metrics::default();
        m.record(Protocol::Http, "limit", "ok", Duration::from_micros(300));
        m.record(Protocol::Http, "limit", "refused", Duration::from_millis(2));
        m.record(Protocol::Resp, "throttle", "ok", Duration::from_millis(2));
        m.record(Protocol::Http, "weird", "ok", Duration::ZERO);
        let text = m.render(3, Some(42), Some(7), None);
        for line in [
            "tollgate_requests_total{op=\"limit\",outcome=\"ok\",protocol=\"http\"} 1",
            "tollgate_requests_total{op=\"limit\",outcome=\"refused\",protocol=\"http\"} 1",
            "tollgate_requests_total{op=\"throttle\",outcome=\"ok\",protocol=\"resp\"} 1",
            "tollgate_request_duration_seconds_bucket{op=\"limit\",protocol=\"http\",le=\"0.00025\"} 0",
            "tollgate_request_duration_seconds_bucket{op=\"limit\",protocol=\"http\",le=\"0.0005\"} 1",
            "tollgate_request_duration_seconds_bucket{op=\"limit\",protocol=\"http\",le=\"0.0025\"} 2",
            "tollgate_request_duration_seconds_count{op=\"limit\",protocol=\"http\"} 2",
            "tollgate_request_duration_seconds_count{op=\"throttle\",protocol=\"resp\"} 1",
            "tollgate_store_errors_total 0",
            "tollgate_failed_open_total 3",
            "tollgate_live_states 42",
            "tollgate_live_names 7",
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
        assert!(!text.contains("weird"));
    }
}
