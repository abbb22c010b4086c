//! What the dashboard charts: per limit name, the tokens granted, refused and reserved by
//! `limit` and `transaction` requests, in 10-second buckets over the last 10 minutes. Memory
//! is bounded: 60 buckets a name, at most [`MAX_NAMES`] names (the rest counted under
//! `(other)`).

use std::collections::HashMap;

use parking_lot::Mutex;

/// The width of a bucket.
pub const BUCKET_MS: u64 = 10_000;
/// Buckets kept: 10 minutes.
pub const BUCKETS: usize = 60;
/// Names kept apart; beyond, requests count under [`OTHER`].
pub const MAX_NAMES: usize = 1_000;
/// Where the names beyond [`MAX_NAMES`] count.
pub const OTHER: &str = "(other)";

/// What became of a take (for the dashboard's charts and the simulator's plot).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Taken {
    /// Granted with tokens on hand.
    Granted = 0,
    /// Refused.
    Refused = 1,
    /// Granted by booking tokens ahead.
    Reserved = 2,
}

impl Taken {
    /// The outcome of a decision: granted with a wait is a reservation.
    pub fn of(ok: bool, retry_after: Option<f64>) -> Taken {
        match (ok, retry_after) {
            (false, _) => Taken::Refused,
            (true, Some(_)) => Taken::Reserved,
            (true, None) => Taken::Granted,
        }
    }

    /// Its name, as a CSS class of the plot.
    pub fn name(self) -> &'static str {
        match self {
            Taken::Granted => "granted",
            Taken::Refused => "refused",
            Taken::Reserved => "reserved",
        }
    }
}

#[derive(Clone)]
struct Series {
    /// [granted, refused, reserved] requests per bucket, a ring indexed by bucket number.
    counts: [[u64; 3]; BUCKETS],
    /// The newest bucket number written.
    newest: u64,
}

impl Series {
    fn new(bucket: u64) -> Self {
        Series { counts: [[0; 3]; BUCKETS], newest: bucket }
    }

    /// Moves the ring on to `bucket`, zeroing the buckets it passes.
    fn advance(&mut self, bucket: u64) {
        if bucket <= self.newest {
            return;
        }
        let gap = (bucket - self.newest).min(BUCKETS as u64);
        for i in 1..=gap {
            self.counts[((self.newest + i) % BUCKETS as u64) as usize] = [0; 3];
        }
        self.newest = bucket;
    }
}

/// The counts of every name.
#[derive(Default)]
pub struct Stats {
    series: Mutex<HashMap<String, Series>>,
    /// Counts nothing (see [`Stats::off`]).
    off: bool,
}

/// One name's counts, oldest bucket first, the last one the bucket now under way.
#[derive(Debug, PartialEq, Eq)]
pub struct Counts {
    /// Granted requests per bucket.
    pub granted: Vec<u64>,
    /// Refused requests per bucket.
    pub refused: Vec<u64>,
    /// Reserved requests per bucket.
    pub reserved: Vec<u64>,
}

impl Stats {
    /// Stats that count nothing, for an engine without a dashboard (see
    /// [`crate::engine::Engine::in_process`]).
    pub fn off() -> Self {
        Stats { off: true, ..Stats::default() }
    }

    /// Whether requests are counted (see [`Stats::off`]).
    pub fn counts(&self) -> bool {
        !self.off
    }

    /// Counts a request of `name` at `now_ms` (Unix ms).
    pub fn record(&self, name: &str, taken: Taken, now_ms: u64) {
        if self.off {
            return;
        }
        let bucket = now_ms / BUCKET_MS;
        let mut series = self.series.lock();
        let name =
            if series.len() >= MAX_NAMES && !series.contains_key(name) { OTHER } else { name };
        let s = match series.get_mut(name) {
            Some(s) => s,
            None => series.entry(name.to_owned()).or_insert_with(|| Series::new(bucket)),
        };
        s.advance(bucket);
        if bucket + (BUCKETS as u64) > s.newest {
            s.counts[(bucket % BUCKETS as u64) as usize][taken as usize] += 1;
        }
    }

    /// Every name's counts for the 10 minutes up to `now_ms`.
    pub fn snapshot(&self, now_ms: u64) -> Vec<(String, Counts)> {
        let bucket = now_ms / BUCKET_MS;
        let mut series = self.series.lock();
        let mut out: Vec<(String, Counts)> = series
            .iter_mut()
            .map(|(name, s)| {
                s.advance(bucket);
                let mut counts =
                    Counts { granted: Vec::new(), refused: Vec::new(), reserved: Vec::new() };
                for back in (0..BUCKETS as u64).rev() {
                    let b = bucket - back.min(bucket);
                    let c = if back > bucket {
                        [0; 3]
                    } else {
                        s.counts[(b % BUCKETS as u64) as usize]
                    };
                    counts.granted.push(c[0]);
                    counts.refused.push(c[1]);
                    counts.reserved.push(c[2]);
                }
                (name.clone(), counts)
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_roll_and_names_are_bounded() {
        let stats = Stats::default();
        let t0 = 1_700_000_000_000;
        stats.record("a", Taken::Granted, t0);
        stats.record("a", Taken::Granted, t0 + 1);
        stats.record("a", Taken::Refused, t0 + BUCKET_MS);
        stats.record("a", Taken::Reserved, t0 + 2 * BUCKET_MS);
        let snap = stats.snapshot(t0 + 2 * BUCKET_MS);
        let (name, c) = &snap[0];
        assert_eq!(name, "a");
        assert_eq!(c.granted.len(), BUCKETS);
        assert_eq!(&c.granted[BUCKETS - 3..], [2, 0, 0]);
        assert_eq!(&c.refused[BUCKETS - 3..], [0, 1, 0]);
        assert_eq!(&c.reserved[BUCKETS - 3..], [0, 0, 1]);
        // Ten minutes on, all of it has rolled out.
        let later = stats.snapshot(t0 + (BUCKETS as u64 + 3) * BUCKET_MS);
        assert!(later[0].1.granted.iter().chain(&later[0].1.refused).all(|n| *n == 0));
        for i in 0..MAX_NAMES + 5 {
            stats.record(&format!("n{i}"), Taken::Granted, t0);
        }
        let snap = stats.snapshot(t0);
        assert_eq!(snap.len(), MAX_NAMES + 1);
        let other = snap.iter().find(|(n, _)| n == OTHER).unwrap();
        assert_eq!(other.1.granted[BUCKETS - 1], 6);
    }
}
