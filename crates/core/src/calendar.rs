//! Calendar windows (SPEC §1, §2): fixed windows that are each one day, ISO week (from
//! Monday), month or year of a time zone. They are of unequal length: a day is 23, 24 or 25
//! hours across a daylight-saving change, a month 28 to 31 days.
//!
//! Civil dates are counted here (a window's index is its day, week, month or year since
//! the epoch, in the zone's local calendar); instants come from [`jiff`] and the IANA time
//! zone database (the system's, else the copy bundled with jiff). A window starts at local
//! midnight of its first day, or at the first instant after it when a change skips midnight.
//!
//! A [`Calendar`] is `Copy` (it rides in every [`Config`](crate::Config)): its zone is an
//! index into this process's table of the zones configs have named.
//!
//! Why jiff: a window's start needs the IANA rules of a zone at any instant (the offset on
//! either side of a change, a skipped or repeated midnight), and that is all it needs of a
//! time library. `jiff` reads the system's database (the one Python's `zoneinfo` reads) and
//! carries a copy for machines without one (the `tzdb-bundle-always` feature), resolves a
//! civil date's start of day with the same rule as `zoneinfo`'s `fold=0` and JavaScript's
//! Temporal ("compatible"), and is maintained with the database's releases. `chrono-tz`
//! compiles one database into the binary (a rebuild for every release of the rules, and a
//! database other than the clients'); `time` has no IANA zones of its own. The civil
//! arithmetic (which window holds a date, the first date of window `i`) is a few lines here
//! (Howard Hinnant's day counting), so that the TypeScript and Python clients can repeat it
//! exactly.

use std::fmt;
use std::sync::RwLock;

use jiff::Timestamp;
use jiff::civil::Date;
use jiff::tz::TimeZone;

/// The unit of a calendar window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CalendarUnit {
    /// From local midnight to the next.
    Day,
    /// An ISO week: from Monday's local midnight to the next Monday's.
    Week,
    /// From the 1st's local midnight to the next month's.
    Month,
    /// From January 1st's local midnight to the next year's.
    Year,
}

impl CalendarUnit {
    /// The spelling in configs: `"day"`, `"week"`, `"month"`, `"year"`.
    pub const fn as_str(self) -> &'static str {
        match self {
            CalendarUnit::Day => "day",
            CalendarUnit::Week => "week",
            CalendarUnit::Month => "month",
            CalendarUnit::Year => "year",
        }
    }

    /// The unit spelled `text`, if any.
    pub fn parse(text: &str) -> Option<CalendarUnit> {
        [CalendarUnit::Day, CalendarUnit::Week, CalendarUnit::Month, CalendarUnit::Year]
            .into_iter()
            .find(|u| u.as_str() == text)
    }

    /// The usual length of a window of this unit, in ms: a day of 24 hours, a week of 7
    /// days, a month of 30, a year of 365 (for what must name one length, such as the
    /// `w` of a `RateLimit-Policy` header field).
    pub const fn usual(self) -> f64 {
        const D: f64 = 86_400_000.0;
        match self {
            CalendarUnit::Day => D,
            CalendarUnit::Week => 7.0 * D,
            CalendarUnit::Month => 30.0 * D,
            CalendarUnit::Year => 365.0 * D,
        }
    }

    /// The longest window of this unit, in ms, with a daylight-saving hour: the `period` a
    /// calendar config reports (an upper bound, for what needs one length).
    pub const fn longest(self) -> f64 {
        const H: f64 = 3_600_000.0;
        match self {
            CalendarUnit::Day => 25.0 * H,
            CalendarUnit::Week => 7.0 * 24.0 * H + H,
            CalendarUnit::Month => 31.0 * 24.0 * H + H,
            CalendarUnit::Year => 366.0 * 24.0 * H + H,
        }
    }
}

impl fmt::Display for CalendarUnit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The zones configs have named, in the order first named: a [`Calendar`] holds an index.
static ZONES: RwLock<Vec<(&'static str, TimeZone)>> = RwLock::new(Vec::new());

/// Calendar windows of a unit in a time zone (SPEC §2, `calendar` and `timeZone`).
///
/// # Examples
///
/// ```
/// use tollgate_algebra::{Calendar, CalendarUnit};
///
/// let month = Calendar::new(CalendarUnit::Month, "Europe/Berlin").unwrap();
/// // 2026-03-15T12:00:00Z is in March, whose window began at midnight in Berlin (UTC+1).
/// let t = 1_773_576_000_000.0;
/// assert_eq!(month.start(t), 1_772_319_600_000.0); // 2026-02-28T23:00:00Z
/// // April begins after the change to summer time: at 2026-03-31T22:00:00Z.
/// assert_eq!(month.after(month.start(t), 1.0), 1_774_994_400_000.0);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Calendar {
    unit: CalendarUnit,
    zone: u16,
}

/// A zone that is not in the time zone database, or a table of zones that is full.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownZone(pub String);

impl fmt::Display for UnknownZone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl Calendar {
    /// Windows of `unit` in the IANA zone `time_zone` (`"UTC"`, `"Europe/Berlin"`).
    ///
    /// # Errors
    ///
    /// A zone the time zone database does not know.
    pub fn new(unit: CalendarUnit, time_zone: &str) -> Result<Calendar, UnknownZone> {
        Ok(Calendar { unit, zone: zone_index(time_zone)? })
    }

    /// The unit.
    pub const fn unit(&self) -> CalendarUnit {
        self.unit
    }

    /// The zone's name, as the config gave it.
    pub fn time_zone(&self) -> &'static str {
        ZONES.read().expect("the zone table")[usize::from(self.zone)].0
    }

    fn tz(&self) -> TimeZone {
        ZONES.read().expect("the zone table")[usize::from(self.zone)].1.clone()
    }

    /// `w(t)`: the start of the window holding `t` (ms since the epoch).
    pub fn start(&self, t: f64) -> f64 {
        let tz = self.tz();
        start_of(self.unit, &tz, index(self.unit, &tz, t))
    }

    /// `next^k(w(t))`: the start of the `k`-th window after the one holding `t`. Past the
    /// years the time zone database covers (beyond 9999), windows count as their longest.
    pub fn after(&self, t: f64, k: f64) -> f64 {
        let tz = self.tz();
        let i = index(self.unit, &tz, t);
        let last = index(self.unit, &tz, LAST_MS);
        // k is a whole number of windows (a ceil); an index past the last is extrapolated.
        let reach = (last - i) as f64;
        if k <= reach {
            start_of(self.unit, &tz, i + k as i64)
        } else {
            start_of(self.unit, &tz, last) + (k - reach) * self.unit.longest()
        }
    }

    /// The number of window starts in `(ts, now]`: 0 when `now <= ts`.
    pub fn windows(&self, ts: f64, now: f64) -> f64 {
        if now <= ts {
            return 0.0;
        }
        let tz = self.tz();
        (index(self.unit, &tz, now) - index(self.unit, &tz, ts)) as f64
    }
}

/// A calendar or none as one plain integer, for [`Config`](crate::Config) to hold: the unit
/// (1 to 4; 0 for none) in the low byte, the zone's index above it. A plain integer rather
/// than an `Option<Calendar>` (measured with callgrind: a token bucket's take 1.5
/// instructions fewer, a transaction of three 4 fewer).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(crate) struct Packed(u32);

impl Packed {
    pub(crate) const NONE: Packed = Packed(0);

    pub(crate) const fn of(calendar: Calendar) -> Packed {
        let unit = match calendar.unit {
            CalendarUnit::Day => 1,
            CalendarUnit::Week => 2,
            CalendarUnit::Month => 3,
            CalendarUnit::Year => 4,
        };
        Packed(unit | (calendar.zone as u32) << 8)
    }

    pub(crate) const fn get(self) -> Option<Calendar> {
        let unit = match self.0 & 0xff {
            1 => CalendarUnit::Day,
            2 => CalendarUnit::Week,
            3 => CalendarUnit::Month,
            4 => CalendarUnit::Year,
            _ => return None,
        };
        Some(Calendar { unit, zone: (self.0 >> 8) as u16 })
    }

    pub(crate) const fn is_none(self) -> bool {
        self.0 == 0
    }
}

impl fmt::Debug for Calendar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Calendar")
            .field("unit", &self.unit)
            .field("time_zone", &self.time_zone())
            .finish()
    }
}

/// The index of `name` in the zone table, adding it when first named.
fn zone_index(name: &str) -> Result<u16, UnknownZone> {
    if let Some(i) = ZONES.read().expect("the zone table").iter().position(|(n, _)| *n == name) {
        return Ok(i as u16);
    }
    let tz = TimeZone::get(name)
        .map_err(|_| UnknownZone(format!("{name:?} is not a time zone of the IANA database")))?;
    let mut zones = ZONES.write().expect("the zone table");
    if let Some(i) = zones.iter().position(|(n, _)| *n == name) {
        return Ok(i as u16);
    }
    if zones.len() >= usize::from(u16::MAX) {
        return Err(UnknownZone(format!("{name:?}: too many time zones in one process")));
    }
    // Leaked once per zone named: the table holds at most the database's few hundred.
    zones.push((Box::leak(name.to_owned().into_boxed_str()), tz));
    Ok((zones.len() - 1) as u16)
}

/// The first and last instants dates are counted for (years -9998 and 9998, with a
/// day of margin for any offset): outside, an instant counts as the nearest of them.
const FIRST_MS: f64 = -377_642_044_800_000.0;
const LAST_MS: f64 = 253_370_678_400_000.0;

/// The local date of `t` in `tz` (clamped to the years dates are counted for).
fn local_date(tz: &TimeZone, t: f64) -> Date {
    let ms = t.clamp(FIRST_MS, LAST_MS).floor() as i64;
    let instant = Timestamp::from_millisecond(ms).expect("within the years counted");
    instant.to_zoned_datetime(tz.clone()).date()
}

/// The index of the window holding `t`: days, ISO weeks, months or years since the epoch
/// (1970-01-01, its Monday-started week, January 1970, 1970) in `tz`'s calendar.
fn index(unit: CalendarUnit, tz: &TimeZone, t: f64) -> i64 {
    let date = local_date(tz, t);
    let (y, m, d) = (i64::from(date.year()), i64::from(date.month()), i64::from(date.day()));
    match unit {
        CalendarUnit::Day => days_from_civil(y, m, d),
        // 1970-01-01 was a Thursday: day 0 is day 3 of week 0 (from Monday 1969-12-29).
        CalendarUnit::Week => (days_from_civil(y, m, d) + 3).div_euclid(7),
        CalendarUnit::Month => y * 12 + (m - 1),
        CalendarUnit::Year => y,
    }
}

/// The first date of window `i`.
fn first_date(unit: CalendarUnit, i: i64) -> (i64, i64, i64) {
    match unit {
        CalendarUnit::Day => civil_from_days(i),
        CalendarUnit::Week => civil_from_days(i * 7 - 3),
        CalendarUnit::Month => (i.div_euclid(12), i.rem_euclid(12) + 1, 1),
        CalendarUnit::Year => (i, 1, 1),
    }
}

/// The instant window `i` starts: local midnight of its first date, or the first instant
/// after it when a change skips midnight (jiff's start of day).
fn start_of(unit: CalendarUnit, tz: &TimeZone, i: i64) -> f64 {
    let (y, m, d) = first_date(unit, i);
    let start = Date::new(y as i16, m as i8, d as i8)
        .and_then(|date| date.to_zoned_datetime(tz.clone()))
        .and_then(|day| day.start_of_day())
        .map(|start| start.timestamp().as_millisecond() as f64);
    // Only a date outside jiff's years fails; the callers keep within them.
    start.unwrap_or(if y < 1970 { FIRST_MS } else { LAST_MS })
}

/// Days since 1970-01-01 of the proleptic Gregorian date (y, m, d).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date of day `z` since 1970-01-01.
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const H: f64 = 3_600_000.0;

    /// The instant of a local wall time in `zone`, by jiff (for the tests' expectations).
    fn local(zone: &str, y: i16, m: i8, d: i8, h: i8, min: i8) -> f64 {
        let tz = TimeZone::get(zone).unwrap();
        let dt = jiff::civil::date(y, m, d).at(h, min, 0, 0);
        dt.to_zoned_datetime(tz).unwrap().timestamp().as_millisecond() as f64
    }

    #[test]
    fn civil_days_round_trip() {
        for z in -800_000..800_000 {
            let (y, m, d) = civil_from_days(z);
            assert_eq!(days_from_civil(y, m, d), z);
        }
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
    }

    #[test]
    fn days_across_daylight_saving_are_23_and_25_hours() {
        let day = Calendar::new(CalendarUnit::Day, "Europe/Berlin").unwrap();
        // 2026-03-29: clocks go from 02:00 to 03:00 in Berlin.
        let noon = local("Europe/Berlin", 2026, 3, 29, 12, 0);
        let start = day.start(noon);
        assert_eq!(start, local("Europe/Berlin", 2026, 3, 29, 0, 0));
        assert_eq!(day.after(noon, 1.0) - start, 23.0 * H);
        // 2026-10-25: from 03:00 back to 02:00.
        let noon = local("Europe/Berlin", 2026, 10, 25, 12, 0);
        assert_eq!(day.after(noon, 1.0) - day.start(noon), 25.0 * H);
        // Lord Howe moves by half an hour.
        let day = Calendar::new(CalendarUnit::Day, "Australia/Lord_Howe").unwrap();
        let noon = local("Australia/Lord_Howe", 2026, 4, 5, 12, 0);
        assert_eq!(day.after(noon, 1.0) - day.start(noon), 24.5 * H);
    }

    #[test]
    fn a_skipped_midnight_starts_the_day_at_the_change() {
        // America/Santiago skipped 2022-09-11T00:00 (to 01:00).
        let day = Calendar::new(CalendarUnit::Day, "America/Santiago").unwrap();
        let noon = local("America/Santiago", 2022, 9, 11, 12, 0);
        assert_eq!(day.start(noon), local("America/Santiago", 2022, 9, 11, 1, 0));
        assert_eq!(day.start(noon) - day.start(noon - 13.0 * H), 24.0 * H, "the 10th");
        assert_eq!(day.after(noon, 1.0) - day.start(noon), 23.0 * H, "the 11th");
    }

    #[test]
    fn weeks_start_on_monday_months_on_the_first_years_in_january() {
        let berlin = "Europe/Berlin";
        let week = Calendar::new(CalendarUnit::Week, berlin).unwrap();
        // Thursday 2026-11-26: its week began Monday 2026-11-23.
        let t = local(berlin, 2026, 11, 26, 9, 30);
        assert_eq!(week.start(t), local(berlin, 2026, 11, 23, 0, 0));
        assert_eq!(week.after(t, 1.0), local(berlin, 2026, 11, 30, 0, 0));
        let month = Calendar::new(CalendarUnit::Month, berlin).unwrap();
        assert_eq!(month.start(t), local(berlin, 2026, 11, 1, 0, 0));
        assert_eq!(month.after(t, 3.0), local(berlin, 2027, 2, 1, 0, 0));
        assert_eq!(month.windows(month.start(t), local(berlin, 2027, 2, 1, 0, 0)), 3.0);
        assert_eq!(month.windows(t, t), 0.0);
        let year = Calendar::new(CalendarUnit::Year, "UTC").unwrap();
        assert_eq!(year.start(t), local("UTC", 2026, 1, 1, 0, 0));
        assert_eq!(year.after(t, 1.0) - year.start(t), 365.0 * 24.0 * H);
        assert_eq!(year.after(t, 2.0) - year.after(t, 1.0), 365.0 * 24.0 * H);
        assert_eq!(year.after(t, 3.0) - year.after(t, 2.0), 366.0 * 24.0 * H, "2028 is leap");
    }

    #[test]
    fn unknown_zones_are_refused() {
        let err = Calendar::new(CalendarUnit::Day, "Mars/Olympus").unwrap_err();
        assert_eq!(err.to_string(), "\"Mars/Olympus\" is not a time zone of the IANA database");
        let a = Calendar::new(CalendarUnit::Day, "Asia/Tokyo").unwrap();
        let b = Calendar::new(CalendarUnit::Day, "Asia/Tokyo").unwrap();
        assert_eq!(a, b, "a zone named twice is one entry");
        assert_eq!(a.time_zone(), "Asia/Tokyo");
    }

    /// The oracle: walks the calendar day by day from a day well before `t` and finds the
    /// window start at or before `t` by asking jiff, hour by hour, where each local day
    /// begins. Independent of the index arithmetic above.
    fn walked_start(unit: CalendarUnit, zone: &str, t: f64) -> f64 {
        let tz = TimeZone::get(zone).unwrap();
        let mut date =
            Timestamp::from_millisecond(t as i64).unwrap().to_zoned_datetime(tz.clone()).date();
        // Back, one day at a time, to the first day of the window.
        loop {
            let first = match unit {
                CalendarUnit::Day => true,
                CalendarUnit::Week => date.weekday() == jiff::civil::Weekday::Monday,
                CalendarUnit::Month => date.day() == 1,
                CalendarUnit::Year => date.day() == 1 && date.month() == 1,
            };
            if first {
                break;
            }
            date = date.yesterday().unwrap();
        }
        // The first instant whose local date is `date`: scan the day before's last hours
        // minute by minute (a change may put midnight at 00:30 or skip it).
        let noon_before = date
            .yesterday()
            .unwrap()
            .at(12, 0, 0, 0)
            .to_zoned_datetime(tz.clone())
            .unwrap()
            .timestamp()
            .as_millisecond();
        let mut at = noon_before;
        loop {
            let d = Timestamp::from_millisecond(at).unwrap().to_zoned_datetime(tz.clone()).date();
            if d == date {
                return at as f64;
            }
            at += 60_000;
        }
    }

    /// SPEC §2 with `calendar`: a monthly quota in Berlin, its refusal's wait to the 1st, a
    /// reservation's to the month after, and a refill across months.
    #[test]
    fn the_algebra_of_a_monthly_quota() {
        use crate::{Config, State, evaluate, full_at};
        let berlin = "Europe/Berlin";
        let month = Calendar::new(CalendarUnit::Month, berlin).unwrap();
        let quota = Config::fixed_window(1_000.0, 1.0).with_calendar(month);
        let now = local(berlin, 2026, 3, 20, 15, 0);
        // A missing state starts full at the start of the month holding now.
        let e = evaluate(&quota, None, 0.0, now, 1_000.0, false);
        assert!(e.decision.ok);
        assert_eq!(e.state, State { value: 0.0, ts: local(berlin, 2026, 3, 1, 0, 0) });
        // One more: refused until April 1st, midnight in Berlin (after the change to summer time).
        let refused = evaluate(&quota, Some(e.state), 0.0, now, 1.0, false);
        assert_eq!(refused.decision.retry_after, Some(local(berlin, 2026, 4, 1, 0, 0) - now));
        // 1,500 reserved: booked until May 1st (k = 2 windows).
        let booked = evaluate(&quota, Some(e.state), 0.0, now, 1_500.0, true);
        assert_eq!(booked.decision.retry_after, Some(local(berlin, 2026, 5, 1, 0, 0) - now));
        assert_eq!(full_at(&quota, booked.state), local(berlin, 2026, 6, 1, 0, 0));
        // On April 1st at 00:00 Berlin time the month's tokens are back; not a ms before.
        let april = local(berlin, 2026, 4, 1, 0, 0);
        assert!(!evaluate(&quota, Some(e.state), 0.0, april - 1.0, 1.0, false).decision.ok);
        let back = evaluate(&quota, Some(e.state), 0.0, april, 1_000.0, false);
        assert_eq!(back.state, State { value: 0.0, ts: april });
        // Three months later a debt of 1,500 is paid: two windows' worth, capped at capacity.
        let later =
            evaluate(&quota, Some(booked.state), 0.0, local(berlin, 2026, 6, 2, 8, 0), 0.0, false);
        assert_eq!(later.state, State { value: 1_000.0, ts: local(berlin, 2026, 6, 1, 0, 0) });
    }

    /// A state written under a period, read under a calendar after a change of config
    /// (SPEC §2): the calendar's window starts in `(ts, now]` count, whatever `ts` was.
    #[test]
    fn a_state_of_a_period_reads_under_a_calendar() {
        use crate::{Config, State, evaluate};
        let day = Calendar::new(CalendarUnit::Day, "Europe/Berlin").unwrap();
        let daily = Config::fixed_window(10.0, 1.0).with_calendar(day);
        // Written by an hourly window at 21:00 Berlin time on March 20th, 4 left.
        let state = State { value: 4.0, ts: local("Europe/Berlin", 2026, 3, 20, 21, 0) };
        // Read the same evening: no midnight since, nothing comes back; ts is kept.
        let evening = evaluate(
            &daily,
            Some(state),
            0.0,
            local("Europe/Berlin", 2026, 3, 20, 23, 0),
            0.0,
            false,
        );
        assert_eq!(evening.state, state);
        // The next morning: one midnight, one day's 10 (capped), ts the day's start.
        let morning = local("Europe/Berlin", 2026, 3, 21, 8, 0);
        let e = evaluate(&daily, Some(state), 0.0, morning, 0.0, false);
        assert_eq!(e.state, State { value: 10.0, ts: local("Europe/Berlin", 2026, 3, 21, 0, 0) });
        assert_eq!(
            crate::Carry::of(&Config::fixed_window(10.0, 3_600_000.0), &daily),
            crate::Carry::Refill
        );
    }

    fn zone() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec![
            "Europe/Berlin",
            "America/New_York",
            "Australia/Lord_Howe",
            "Asia/Kolkata",
            "UTC",
        ])
    }

    fn unit() -> impl Strategy<Value = CalendarUnit> {
        prop::sample::select(vec![
            CalendarUnit::Day,
            CalendarUnit::Week,
            CalendarUnit::Month,
            CalendarUnit::Year,
        ])
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        /// `w(t)` and `next(w(t))` agree with the oracle over 2019-2029 (leap years, and
        /// every daylight-saving change of those zones), at any minute.
        #[test]
        fn windows_agree_with_walking_the_calendar(
            unit in unit(),
            zone in zone(),
            minute in 0i64..(11 * 366 * 24 * 60),
        ) {
            let t = 1_546_300_800_000.0 + (minute * 60_000) as f64; // from 2019-01-01
            let cal = Calendar::new(unit, zone).unwrap();
            let start = cal.start(t);
            prop_assert_eq!(start, walked_start(unit, zone, t));
            prop_assert!(start <= t);
            let next = cal.after(t, 1.0);
            prop_assert!(next > t);
            prop_assert_eq!(next, walked_start(unit, zone, next));
            prop_assert_eq!(walked_start(unit, zone, next - 60_000.0), start);
            prop_assert_eq!(cal.windows(start, next), 1.0);
            prop_assert_eq!(cal.windows(start, next - 1.0), 0.0);
        }
    }
}

#[cfg(test)]
mod size {
    /// A calendar rides in a config's padding: the config stays 48 bytes (it is copied
    /// through every request).
    #[test]
    fn a_config_is_48_bytes() {
        assert_eq!(std::mem::size_of::<crate::Config>(), 48);
        let berlin = super::Calendar::new(super::CalendarUnit::Month, "Europe/Berlin").unwrap();
        assert_eq!(super::Packed::of(berlin).get(), Some(berlin));
        assert_eq!(super::Packed::NONE.get(), None);
    }
}
