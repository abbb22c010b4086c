//! Concurrency limits (SPEC §6f): how many units of work hold a slot at once, not how often
//! they start.
//!
//! A (name, key) of a [`Concurrency`] limit is its unexpired holders, each a ticket (a
//! number the store makes) holding `count` slots until its expiry, on the store's clock. A
//! holder that is never released frees its slots at its expiry (its process presumed dead);
//! [`decide`] answers every operation from the holders a store loaded, and says what the
//! store must write. Nothing here reads a clock or touches storage, so every store answers
//! the same numbers.
//!
//! ```
//! use tollgate_algebra::slots::{Concurrency, SlotAnswer, SlotOp, Write, decide};
//!
//! let gpu = Concurrency::new(2);
//! let now = 1_700_000_000_000.0;
//! let acquire = SlotOp::Acquire { count: 2, ttl: gpu.ttl() };
//! let (answer, write) = decide(&gpu, &[], now, &acquire, 7).unwrap();
//! assert_eq!(answer, SlotAnswer::Acquired { ticket: 7, expires_at: now + 60_000.0 });
//! let Write::Add(holder) = write else { unreachable!() };
//!
//! // Full: refused until the holder's expiry, a minute from now (a release may come sooner).
//! let (answer, write) = decide(&gpu, &[holder], now + 1_000.0, &acquire, 8).unwrap();
//! assert_eq!(answer, SlotAnswer::Refused { retry_after: 59_000.0 });
//! assert_eq!(write, Write::Nothing);
//! ```

use std::fmt;

use crate::config::{ConfigError, MAX_AMOUNT, fmt_number};
use crate::eval::InvalidRequest;

/// How long a slot is held before it is free again, unless released or renewed: 60 s.
pub const DEFAULT_TTL: f64 = 60_000.0;

/// The shortest `ttl`: a millisecond.
pub const MIN_TTL: f64 = 1.0;

/// The most slots a concurrency limit may have (and a request may take).
pub const MAX_SLOTS: u32 = 1 << 30;

const MAX_RULE: &str = "must be a whole number from 1 to 1073741824";
const TTL_RULE: &str = "must be a number of milliseconds from 1 to 1e15";

/// A validated concurrency limit: `max` slots, each held at most `ttl` ms unless renewed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Concurrency {
    max: u32,
    ttl: f64,
}

impl Concurrency {
    /// `max` slots, held at most [`DEFAULT_TTL`] each.
    ///
    /// # Panics
    ///
    /// If `max` is 0 or above [`MAX_SLOTS`]; [`Concurrency::try_new`] returns the error.
    pub fn new(max: u32) -> Self {
        match Concurrency::try_new(f64::from(max), DEFAULT_TTL) {
            Ok(limit) => limit,
            Err(e) => panic!("{e}"),
        }
    }

    /// The same limit with slots held at most `ttl` ms.
    ///
    /// # Panics
    ///
    /// If `ttl` is not from [`MIN_TTL`] to 1e15; [`Concurrency::try_new`] returns the error.
    #[must_use]
    pub fn with_ttl(self, ttl: f64) -> Self {
        match Concurrency::try_new(f64::from(self.max), ttl) {
            Ok(limit) => limit,
            Err(e) => panic!("{e}"),
        }
    }

    /// `max` slots held at most `ttl` ms, checked: `max` a whole number from 1 to
    /// [`MAX_SLOTS`] (a number, as JSON and TOML carry it), `ttl` from [`MIN_TTL`] to 1e15.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] naming `max` or `ttl`.
    pub fn try_new(max: f64, ttl: f64) -> Result<Self, ConfigError> {
        if !(max >= 1.0 && max <= f64::from(MAX_SLOTS) && max.fract() == 0.0) {
            return Err(ConfigError::new("max", fmt_number(max), MAX_RULE));
        }
        check_ttl(ttl).map_err(|_| ConfigError::new("ttl", fmt_number(ttl), TTL_RULE))?;
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        Ok(Concurrency { max: max as u32, ttl })
    }

    /// The slots.
    pub fn max(&self) -> u32 {
        self.max
    }

    /// How long a slot is held unless released or renewed, in ms.
    pub fn ttl(&self) -> f64 {
        self.ttl
    }
}

impl fmt::Display for Concurrency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "concurrency of {} held at most {} ms", self.max, fmt_number(self.ttl))
    }
}

fn check_ttl(ttl: f64) -> Result<(), InvalidRequest> {
    if (MIN_TTL..=MAX_AMOUNT).contains(&ttl) {
        Ok(())
    } else {
        Err(InvalidRequest::new(format!("ttl is {}; it {TTL_RULE}", fmt_number(ttl))))
    }
}

/// One holder: `count` slots held by `ticket` until `expiry` (ms on the store's clock; it
/// holds them on `[acquired, expiry)`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Holder {
    /// The id the store made for it.
    pub ticket: u64,
    /// The slots it holds.
    pub count: u32,
    /// When its slots are free again.
    pub expiry: f64,
}

/// An operation on a (name, key) of a concurrency limit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SlotOp {
    /// Takes `count` slots for `ttl` ms, if that many are free.
    Acquire {
        /// Slots to take (1 to the limit's `max`).
        count: u32,
        /// How long they are held unless released or renewed (the limit's `ttl` unless the
        /// request says otherwise).
        ttl: f64,
    },
    /// Frees a ticket's slots.
    Release {
        /// The ticket an acquire answered.
        ticket: u64,
    },
    /// Moves a ticket's expiry to `now + ttl`.
    Renew {
        /// The ticket an acquire answered.
        ticket: u64,
        /// How long from now.
        ttl: f64,
    },
    /// Whether an acquire of `count` would be granted now; changes nothing.
    Check {
        /// Slots it would take.
        count: u32,
    },
    /// How many slots are held, by how many holders.
    Value,
    /// Frees every slot.
    Reset,
}

impl SlotOp {
    /// Checks the operation against `limit`: a count from 1 to `max` (more could never be
    /// granted: an error, SPEC §6f), a `ttl` from [`MIN_TTL`] to 1e15.
    ///
    /// # Errors
    ///
    /// An [`InvalidRequest`] saying which number is wrong; nothing is changed.
    pub fn validate(&self, limit: &Concurrency) -> Result<(), InvalidRequest> {
        let count = |count: u32| {
            if count == 0 {
                Err(InvalidRequest::new("count is 0; it must be a whole number of at least 1"))
            } else if count > limit.max {
                Err(InvalidRequest::new(format!(
                    "count is {count}, more than the limit's max of {}: it could never be granted",
                    limit.max
                )))
            } else {
                Ok(())
            }
        };
        match *self {
            SlotOp::Acquire { count: n, ttl } => {
                count(n)?;
                check_ttl(ttl)
            }
            SlotOp::Check { count: n } => count(n),
            SlotOp::Renew { ttl, .. } => check_ttl(ttl),
            SlotOp::Release { .. } | SlotOp::Value | SlotOp::Reset => Ok(()),
        }
    }

    /// Whether the operation may write (a store may serve the others from a read).
    pub fn writes(&self) -> bool {
        !matches!(self, SlotOp::Check { .. } | SlotOp::Value)
    }
}

/// What an operation answers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SlotAnswer {
    /// An acquire granted: the ticket to release or renew, and when its slots are free
    /// again unless it is renewed.
    Acquired {
        /// The holder's id.
        ticket: u64,
        /// Its expiry, ms on the store's clock.
        expires_at: f64,
    },
    /// An acquire (or a check) refused: the ms until the earliest holder's expiry (a release
    /// may free slots sooner). Nothing was written.
    Refused {
        /// Ms until the earliest holder's expiry.
        retry_after: f64,
    },
    /// A check that an acquire would be granted.
    Free,
    /// A release: whether the ticket held slots (false for one unknown or expired: a release
    /// may race its expiry, and is never an error).
    Released(bool),
    /// A renewal: the new expiry, or `None` when the ticket had expired (or was never
    /// granted): its slots may be someone else's now.
    Renewed(Option<f64>),
    /// What is held.
    Value {
        /// Slots held by unexpired holders.
        in_flight: u64,
        /// Unexpired holders.
        holders: u64,
        /// The earliest holder's expiry, if any holds slots.
        earliest: Option<f64>,
    },
    /// A reset: every slot is free.
    Reset,
}

/// What a store writes after [`decide`]. Expired holders may be dropped at any time (they
/// hold nothing); stores drop them as they go.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Write {
    /// Nothing.
    Nothing,
    /// A new holder.
    Add(Holder),
    /// The holder of this ticket is gone.
    Remove(u64),
    /// The holder of this ticket now expires then.
    Expiry(u64, f64),
    /// Every holder is gone.
    Clear,
}

/// Answers `op` on the holders of a (name, key) a store loaded (expired ones may be among
/// them: they are skipped), at `now` on the store's clock; `ticket` is the id a new holder
/// gets if an acquire is granted (the store makes it, unique per (name, key) at least).
///
/// # Errors
///
/// An [`InvalidRequest`] if `op` is invalid for `limit` ([`SlotOp::validate`]).
pub fn decide(
    limit: &Concurrency,
    holders: &[Holder],
    now: f64,
    op: &SlotOp,
    ticket: u64,
) -> Result<(SlotAnswer, Write), InvalidRequest> {
    op.validate(limit)?;
    let live = || holders.iter().filter(|h| h.expiry > now);
    let in_flight = || live().map(|h| u64::from(h.count)).sum::<u64>();
    let earliest = || live().map(|h| h.expiry).reduce(f64::min);
    let fits = |count: u32| in_flight() + u64::from(count) <= u64::from(limit.max);
    // A refusal waits for the earliest expiry; something holds slots, or the count fits.
    let refused = || SlotAnswer::Refused { retry_after: earliest().map_or(0.0, |e| e - now) };
    let find = |ticket: u64| live().find(|h| h.ticket == ticket);
    Ok(match *op {
        SlotOp::Acquire { count, ttl } if fits(count) => {
            let holder = Holder { ticket, count, expiry: now + ttl };
            (SlotAnswer::Acquired { ticket, expires_at: holder.expiry }, Write::Add(holder))
        }
        SlotOp::Acquire { .. } => (refused(), Write::Nothing),
        SlotOp::Check { count } if fits(count) => (SlotAnswer::Free, Write::Nothing),
        SlotOp::Check { .. } => (refused(), Write::Nothing),
        SlotOp::Release { ticket } => match find(ticket) {
            Some(_) => (SlotAnswer::Released(true), Write::Remove(ticket)),
            None => (SlotAnswer::Released(false), Write::Nothing),
        },
        SlotOp::Renew { ticket, ttl } => match find(ticket) {
            Some(_) => (SlotAnswer::Renewed(Some(now + ttl)), Write::Expiry(ticket, now + ttl)),
            None => (SlotAnswer::Renewed(None), Write::Nothing),
        },
        SlotOp::Value => (
            SlotAnswer::Value {
                in_flight: in_flight(),
                holders: live().count() as u64,
                earliest: earliest(),
            },
            Write::Nothing,
        ),
        SlotOp::Reset => (SlotAnswer::Reset, Write::Clear),
    })
}

/// Applies `write` to a store's list of holders, dropping those expired at `now`.
pub fn apply(holders: &mut Vec<Holder>, write: &Write, now: f64) {
    holders.retain(|h| h.expiry > now);
    match *write {
        Write::Nothing => {}
        Write::Add(holder) => holders.push(holder),
        Write::Remove(ticket) => holders.retain(|h| h.ticket != ticket),
        Write::Expiry(ticket, expiry) => {
            for h in holders.iter_mut().filter(|h| h.ticket == ticket) {
                h.expiry = expiry;
            }
        }
        Write::Clear => holders.clear(),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const NOW: f64 = 1_700_000_000_000.0;

    #[test]
    fn configs_are_checked() {
        assert_eq!(Concurrency::new(4).max(), 4);
        assert_eq!(Concurrency::new(4).ttl(), DEFAULT_TTL);
        assert_eq!(Concurrency::new(4).with_ttl(5.0).ttl(), 5.0);
        for (max, ttl, field) in [
            (0.0, 1e3, "max"),
            (1.5, 1e3, "max"),
            (f64::NAN, 1e3, "max"),
            (2e9, 1e3, "max"),
            (1.0, 0.5, "ttl"),
            (1.0, f64::INFINITY, "ttl"),
            (1.0, -1.0, "ttl"),
        ] {
            assert_eq!(Concurrency::try_new(max, ttl).unwrap_err().field(), field);
        }
    }

    #[test]
    fn bad_requests_are_errors() {
        let limit = Concurrency::new(3);
        let error = |op: SlotOp| decide(&limit, &[], NOW, &op, 1).unwrap_err().to_string();
        assert!(error(SlotOp::Acquire { count: 4, ttl: 1e3 }).contains("max of 3"));
        assert!(error(SlotOp::Acquire { count: 0, ttl: 1e3 }).contains("count is 0"));
        assert!(error(SlotOp::Acquire { count: 1, ttl: 0.0 }).contains("ttl is 0"));
        assert!(error(SlotOp::Check { count: 9 }).contains("never be granted"));
        assert!(error(SlotOp::Renew { ticket: 1, ttl: f64::NAN }).contains("ttl is"));
    }

    #[test]
    fn release_renew_and_expiry() {
        let limit = Concurrency::new(2).with_ttl(1_000.0);
        let mut holders = Vec::new();
        let step = |holders: &mut Vec<Holder>, now: f64, op: SlotOp, ticket: u64| {
            let (answer, write) = decide(&limit, holders, now, &op, ticket).unwrap();
            apply(holders, &write, now);
            answer
        };
        let one = SlotOp::Acquire { count: 1, ttl: 1_000.0 };
        assert_eq!(
            step(&mut holders, NOW, one, 1),
            SlotAnswer::Acquired { ticket: 1, expires_at: NOW + 1e3 }
        );
        assert_eq!(
            step(&mut holders, NOW + 100.0, one, 2),
            SlotAnswer::Acquired { ticket: 2, expires_at: NOW + 1_100.0 }
        );
        assert_eq!(
            step(&mut holders, NOW + 200.0, one, 3),
            SlotAnswer::Refused { retry_after: 800.0 }
        );
        // Renewing ticket 1 moves the earliest expiry to ticket 2's.
        let renew = SlotOp::Renew { ticket: 1, ttl: 5_000.0 };
        assert_eq!(
            step(&mut holders, NOW + 300.0, renew, 0),
            SlotAnswer::Renewed(Some(NOW + 5_300.0))
        );
        assert_eq!(
            step(&mut holders, NOW + 300.0, one, 3),
            SlotAnswer::Refused { retry_after: 800.0 }
        );
        // Ticket 2 expires: its slot is free, its release and renewal say so.
        assert_eq!(
            step(&mut holders, NOW + 1_100.0, SlotOp::Release { ticket: 2 }, 0),
            SlotAnswer::Released(false)
        );
        let renew2 = SlotOp::Renew { ticket: 2, ttl: 1e3 };
        assert_eq!(step(&mut holders, NOW + 1_100.0, renew2, 0), SlotAnswer::Renewed(None));
        assert_eq!(
            step(&mut holders, NOW + 1_100.0, SlotOp::Value, 0),
            SlotAnswer::Value { in_flight: 1, holders: 1, earliest: Some(NOW + 5_300.0) }
        );
        // Released twice: true, then false.
        assert_eq!(
            step(&mut holders, NOW + 1_200.0, SlotOp::Release { ticket: 1 }, 0),
            SlotAnswer::Released(true)
        );
        assert_eq!(
            step(&mut holders, NOW + 1_200.0, SlotOp::Release { ticket: 1 }, 0),
            SlotAnswer::Released(false)
        );
        assert_eq!(
            step(&mut holders, NOW + 1_200.0, SlotOp::Check { count: 2 }, 0),
            SlotAnswer::Free
        );
        assert!(holders.is_empty());
    }

    proptest! {
        /// Whatever the operations and their times, the unexpired holders never hold more
        /// than `max`, a refusal writes nothing and waits for the earliest expiry, and an
        /// acquire is refused only when the count does not fit.
        #[test]
        fn never_more_than_max(
            max in 1u32..6,
            ops in proptest::collection::vec((0u8..5, 1u32..6, 0u64..8, 1.0f64..500.0, 0.0f64..100.0), 1..80),
        ) {
            let limit = Concurrency::new(max).with_ttl(200.0);
            let mut holders: Vec<Holder> = Vec::new();
            let mut now = NOW;
            let mut next = 1;
            for (kind, count, ticket, ttl, dt) in ops {
                now += dt;
                let op = match kind {
                    0 | 1 => SlotOp::Acquire { count: count.min(max), ttl },
                    2 => SlotOp::Release { ticket },
                    3 => SlotOp::Renew { ticket, ttl },
                    _ => SlotOp::Check { count: count.min(max) },
                };
                let before = holders.clone();
                let (answer, write) = decide(&limit, &holders, now, &op, next).unwrap();
                next += 1;
                let held = |hs: &[Holder]| hs.iter().filter(|h| h.expiry > now).map(|h| u64::from(h.count)).sum::<u64>();
                if let SlotAnswer::Refused { retry_after } = answer {
                    prop_assert_eq!(write, Write::Nothing);
                    let (SlotOp::Acquire { count, .. } | SlotOp::Check { count }) = op else { unreachable!() };
                    prop_assert!(held(&before) + u64::from(count) > u64::from(max));
                    let earliest = before.iter().filter(|h| h.expiry > now).map(|h| h.expiry).reduce(f64::min).unwrap();
                    prop_assert_eq!(retry_after, earliest - now);
                }
                apply(&mut holders, &write, now);
                prop_assert!(held(&holders) <= u64::from(max));
                prop_assert!(holders.iter().all(|h| h.expiry > now));
            }
        }
    }
}
