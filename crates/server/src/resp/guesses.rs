//! Wrong tokens sent with `AUTH` (or `HELLO ... AUTH`), counted per client address, so that
//! a token cannot be guessed at the speed of a pipeline (516,000 guesses a second were taken
//! on one connection): an address may send [`BURST`] wrong tokens at once, then one a
//! second; past that, its `AUTH` is refused unchecked (a right token too) until one comes
//! back. Per address rather than per connection, since a client opens as many connections
//! as it likes; an IPv6 address counts by its /64 (what one host is given), an IPv4-mapped
//! one as its IPv4 address. A client behind the same address as a guesser (a NAT) may then
//! wait for a second or two to authenticate a new connection; pooled connections, already
//! authenticated, go on. Each wrong token and each refusal is counted
//! (`tollgate_resp_auth_failures_total`) and logged, summed up.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use crate::error_log::ErrorLog;
use crate::metrics::Metrics;

/// Wrong tokens an address may send at once.
pub const BURST: f64 = 20.0;
/// Wrong tokens an address may send a second, past [`BURST`].
pub const PER_SECOND: f64 = 1.0;

/// Addresses counted at once: past these (after the full ones are forgotten), new ones share
/// one count, so that a flood of addresses costs a bounded amount of memory.
const MOST_ADDRESSES: usize = 65_536;

/// Wrong tokens, per client address.
pub struct Guesses {
    counts: parking_lot::Mutex<HashMap<Address, Left>>,
    wrong: ErrorLog,
    throttled: ErrorLog,
}

/// Who guesses: an IPv4 address, an IPv6 /64, or any other client (one not known, or one
/// past [`MOST_ADDRESSES`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Address {
    V4(u32),
    V6(u64),
    Other,
}

impl Address {
    fn of(peer: Option<IpAddr>) -> Self {
        match peer {
            Some(IpAddr::V4(v4)) => Address::V4(v4.into()),
            Some(IpAddr::V6(v6)) => match v6.to_ipv4_mapped() {
                Some(v4) => Address::V4(v4.into()),
                None => Address::V6((u128::from(v6) >> 64) as u64),
            },
            None => Address::Other,
        }
    }
}

/// The wrong tokens an address may still send, as of `at`.
#[derive(Clone, Copy, Debug)]
struct Left {
    left: f64,
    at: Instant,
}

impl Left {
    /// What is left now: [`PER_SECOND`] came back for each second since.
    fn now(self, now: Instant) -> f64 {
        (self.left + now.duration_since(self.at).as_secs_f64() * PER_SECOND).min(BURST)
    }
}

impl Default for Guesses {
    fn default() -> Self {
        Guesses {
            counts: parking_lot::Mutex::default(),
            wrong: ErrorLog::new("wrong tokens sent with AUTH"),
            throttled: ErrorLog::new("AUTH refused unchecked after wrong tokens"),
        }
    }
}

impl Guesses {
    /// Whether `peer` may have a token checked now; if not (the refusal is counted and
    /// logged), how long until it may.
    ///
    /// # Errors
    ///
    /// The address sent too many wrong tokens: the wait until it may send one more.
    pub fn may_try(&self, peer: Option<IpAddr>, metrics: &Metrics) -> Result<(), Duration> {
        let now = Instant::now();
        let left = self.counts.lock().get(&Address::of(peer)).map_or(BURST, |l| l.now(now));
        if left >= 1.0 {
            return Ok(());
        }
        metrics.resp_auth_failed(crate::metrics::AuthFailure::Throttled);
        let wait = Duration::from_secs_f64((1.0 - left) / PER_SECOND);
        let shown = shown(peer);
        self.throttled.note(&shown, || {
            tracing::warn!(
                "resp: AUTH from {shown} refused unchecked: it sent {BURST} wrong tokens, and \
                 may send {PER_SECOND} a second"
            );
        });
        Err(wait)
    }

    /// A wrong token from `peer`: counted against it, in the metrics, and in the log.
    pub fn wrong(&self, peer: Option<IpAddr>, metrics: &Metrics) {
        let now = Instant::now();
        {
            let mut counts = self.counts.lock();
            if counts.len() >= MOST_ADDRESSES {
                // The full ones carry nothing.
                counts.retain(|_, l| l.now(now) < BURST);
            }
            let address = match Address::of(peer) {
                a if counts.len() < MOST_ADDRESSES || counts.contains_key(&a) => a,
                _ => Address::Other,
            };
            let left = counts.get(&address).map_or(BURST, |l| l.now(now));
            counts.insert(address, Left { left: left - 1.0, at: now });
        }
        metrics.resp_auth_failed(crate::metrics::AuthFailure::WrongToken);
        let shown = shown(peer);
        self.wrong.note(&shown, || tracing::warn!("resp: a wrong token from {shown} (AUTH)"));
    }

    /// Sums up, in the log, what an interval that is over did not say; for a timer.
    pub fn flush(&self) {
        self.wrong.flush();
        self.throttled.flush();
    }
}

fn shown(peer: Option<IpAddr>) -> String {
    peer.map_or_else(|| "an unknown address".to_owned(), |ip| ip.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_count_by_host() {
        let v6 = |text: &str| Address::of(Some(text.parse().unwrap()));
        assert_eq!(v6("2001:db8::1"), v6("2001:db8::ffff:1"));
        assert_ne!(v6("2001:db8::1"), v6("2001:db8:0:1::1"));
        assert_eq!(v6("::ffff:192.0.2.1"), v6("192.0.2.1"));
        assert_eq!(Address::of(None), Address::Other);
    }

    #[test]
    fn a_burst_then_refusals() {
        let (guesses, metrics) = (Guesses::default(), Metrics::default());
        let peer = Some("192.0.2.7".parse().unwrap());
        for _ in 0..BURST as usize {
            assert!(guesses.may_try(peer, &metrics).is_ok());
            guesses.wrong(peer, &metrics);
        }
        let wait = guesses.may_try(peer, &metrics).unwrap_err();
        assert!(wait > Duration::from_millis(900) && wait <= Duration::from_secs(1), "{wait:?}");
        // Another address is not held back.
        assert!(guesses.may_try(Some("192.0.2.8".parse().unwrap()), &metrics).is_ok());
    }
}
