//! Limit configurations: the validated [`Config`] and its serde form [`RawConfig`].

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::calendar::{Calendar, CalendarUnit, Packed};

/// One second in milliseconds.
pub const SECOND: f64 = 1_000.0;
/// One minute in milliseconds.
pub const MINUTE: f64 = 60.0 * SECOND;
/// One hour in milliseconds.
pub const HOUR: f64 = 60.0 * MINUTE;
/// One day in milliseconds.
pub const DAY: f64 = 24.0 * HOUR;

/// The most shards a limit may be split over.
pub const MAX_SHARDS: u16 = 1024;

/// The shortest period, in ms: a microsecond. A shorter window is narrower than the spacing
/// of the clock's own numbers (about 0.24 us at today's ms since the epoch), and its
/// arithmetic breaks (a window that starts after `now`).
pub const MIN_PERIOD: f64 = 0.001;

/// The most of any amount of a config or request: the longest period (ms, about 31,700
/// years), the largest rate, capacity, `maxReserved`, count and `|start|`. Within these
/// bounds (and a rate of at least [`MIN_RATE`]) every number the algebra computes is
/// finite: no wait, value or time overflows (the longest wait is about 2e39 ms).
pub const MAX_AMOUNT: f64 = 1e15;

/// The smallest rate: a billionth of a token per period.
pub const MIN_RATE: f64 = 1e-9;

/// How tokens come back to a limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Tokens flow back continuously at `rate` per `period`, up to `capacity`.
    TokenBucket,
    /// `rate` tokens come back at once at the start of every window of `period`, up to `capacity`.
    FixedWindow,
}

impl Kind {
    /// The spelling used in JSON and TOML: `"token bucket"` or `"fixed window"`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Kind::TokenBucket => "token bucket",
            Kind::FixedWindow => "fixed window",
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A validated rate limit configuration (SPEC §1).
///
/// A `Config` cannot hold an invalid value. The `const` constructors panic on invalid input,
/// which turns a bad constant into a compile error; input that arrives at run time (JSON, TOML)
/// goes through [`RawConfig`] and [`Config::try_from`], which return a [`ConfigError`] instead.
///
/// # Examples
///
/// ```
/// use tollgate_algebra::{Config, MINUTE};
///
/// // 10 per minute, bursts of up to 3.
/// const SEND_MESSAGE: Config = Config::token_bucket(10.0, MINUTE).with_capacity(3.0);
/// assert_eq!(SEND_MESSAGE.capacity(), 3.0);
/// ```
///
/// A constant that breaks the rules does not compile:
///
/// ```compile_fail
/// use tollgate_algebra::Config;
/// const BROKEN: Config = Config::token_bucket(10.0, 0.0); // period must be > 0
/// ```
#[derive(Clone, Copy)]
pub struct Config {
    kind: Kind,
    shards: u16,
    /// A fixed window of calendar periods (in the padding beside `kind` and `shards`: the
    /// config stays 48 bytes). Its `period` is then the unit's longest window.
    calendar: Packed,
    rate: f64,
    period: f64,
    capacity: f64,
    /// Unbounded is `INFINITY`, so the config is 48 bytes instead of 64: it is copied
    /// through every request.
    max_reserved: f64,
    /// None is NaN (a valid `start` is finite).
    start: f64,
}

impl PartialEq for Config {
    fn eq(&self, other: &Self) -> bool {
        // Compared as the public view: NaN for "no start" would never equal itself.
        (self.kind, self.shards, self.rate, self.period, self.capacity)
            == (other.kind, other.shards, other.rate, other.period, other.capacity)
            && self.max_reserved() == other.max_reserved()
            && self.start() == other.start()
            && self.calendar == other.calendar
    }
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("kind", &self.kind)
            .field("rate", &self.rate)
            .field("period", &self.period)
            .field("capacity", &self.capacity)
            .field("max_reserved", &self.max_reserved())
            .field("shards", &self.shards)
            .field("start", &self.start())
            .field("calendar", &self.calendar.get())
            .finish()
    }
}

/// A rate: finite, in [`MIN_RATE`]..=[`MAX_AMOUNT`].
const fn rate_ok(x: f64) -> bool {
    x.is_finite() && x >= MIN_RATE && x <= MAX_AMOUNT
}

/// A period: finite, in [`MIN_PERIOD`]..=[`MAX_AMOUNT`] ms.
const fn period_ok(x: f64) -> bool {
    x.is_finite() && x >= MIN_PERIOD && x <= MAX_AMOUNT
}

/// An amount: finite, >= 0, at most [`MAX_AMOUNT`].
const fn amount_ok(x: f64) -> bool {
    x.is_finite() && x >= 0.0 && x <= MAX_AMOUNT
}

/// A window alignment: finite, within [`MAX_AMOUNT`] of the epoch.
const fn start_ok(x: f64) -> bool {
    x.is_finite() && x >= -MAX_AMOUNT && x <= MAX_AMOUNT
}

/// What the rules of each field say, for messages and panics.
const RATE_RULE: &str = "must be finite, at least 1e-9 and at most 1e15";
const PERIOD_BOUNDS: &str = "must be finite, at least 0.001 (a microsecond) and at most 1e15 ms";
const CAPACITY_RULE: &str = "must be finite, >= 0 and at most 1e15";
const START_RULE: &str = "must be finite and within 1e15 ms of the epoch";

impl Config {
    const fn new(kind: Kind, rate: f64, period: f64) -> Self {
        assert!(rate_ok(rate), "rate must be finite, at least 1e-9 and at most 1e15");
        assert!(period_ok(period), "period must be finite, at least 0.001 and at most 1e15 ms");
        Config {
            kind,
            rate,
            period,
            capacity: rate,
            max_reserved: f64::INFINITY,
            shards: 1,
            calendar: Packed::NONE,
            start: f64::NAN,
        }
    }

    /// A token bucket that adds `rate` tokens per `period` milliseconds; capacity defaults to `rate`.
    ///
    /// # Panics
    ///
    /// If `rate` or `period` is not finite and > 0 (a compile error in a `const`).
    pub const fn token_bucket(rate: f64, period: f64) -> Self {
        Self::new(Kind::TokenBucket, rate, period)
    }

    /// A fixed window that grants `rate` tokens every `period` milliseconds; capacity defaults
    /// to `rate`.
    ///
    /// # Panics
    ///
    /// If `rate` or `period` is not finite and > 0 (a compile error in a `const`).
    pub const fn fixed_window(rate: f64, period: f64) -> Self {
        Self::new(Kind::FixedWindow, rate, period)
    }

    /// Sets the most tokens that can accumulate (default: `rate`).
    ///
    /// # Panics
    ///
    /// If `capacity` is not finite and >= 0.
    #[must_use]
    pub const fn with_capacity(mut self, capacity: f64) -> Self {
        assert!(amount_ok(capacity), "capacity must be finite, >= 0 and at most 1e15");
        self.capacity = capacity;
        self
    }

    /// Sets the most tokens that may be reserved ahead (default: unbounded).
    ///
    /// # Panics
    ///
    /// If `max_reserved` is not finite and >= 0.
    #[must_use]
    pub const fn with_max_reserved(mut self, max_reserved: f64) -> Self {
        assert!(amount_ok(max_reserved), "maxReserved must be finite, >= 0 and at most 1e15");
        self.max_reserved = max_reserved;
        self
    }

    /// Splits the limit over `shards` independent shards (SPEC §3; default 1).
    ///
    /// # Panics
    ///
    /// If `shards` is not in `1..=1024`.
    #[must_use]
    pub const fn with_shards(mut self, shards: u16) -> Self {
        assert!(shards >= 1 && shards <= MAX_SHARDS, "shards must be an integer in 1..=1024");
        self.shards = shards;
        self
    }

    /// Aligns a fixed window's windows to `start` (ms since the Unix epoch); without it each
    /// (name, key, shard) gets its own pseudo-random alignment.
    ///
    /// # Panics
    ///
    /// If `start` is not finite, or the config is a token bucket.
    #[must_use]
    pub const fn with_start(mut self, start: f64) -> Self {
        assert!(start_ok(start), "start must be finite and within 1e15 ms of the epoch");
        assert!(matches!(self.kind, Kind::FixedWindow), "start applies to fixed windows only");
        assert!(self.calendar.is_none(), "a calendar window takes no start");
        self.start = start;
        self
    }

    /// Makes a fixed window's windows the periods of `calendar` (SPEC §1 `calendar` and
    /// `timeZone`): each window is one day, ISO week, month or year of its time zone, of
    /// unequal lengths, in place of `period` and `start`. [`Config::period`] is then the
    /// unit's longest window (25 hours for a day).
    ///
    /// # Examples
    ///
    /// ```
    /// use tollgate_algebra::{Calendar, CalendarUnit, Config};
    ///
    /// // 1,000 a month, reset on the 1st at midnight in Berlin.
    /// let month = Calendar::new(CalendarUnit::Month, "Europe/Berlin").unwrap();
    /// let quota = Config::fixed_window(1_000.0, 1.0).with_calendar(month);
    /// assert_eq!(quota.calendar(), Some(month));
    /// ```
    ///
    /// # Panics
    ///
    /// If the config is a token bucket, or has a `start`.
    #[must_use]
    pub const fn with_calendar(mut self, calendar: Calendar) -> Self {
        assert!(matches!(self.kind, Kind::FixedWindow), "calendar applies to fixed windows only");
        assert!(self.start.is_nan(), "a calendar window takes no start");
        self.period = calendar.unit().longest();
        self.calendar = Packed::of(calendar);
        self
    }

    /// A fixed window's calendar, if its windows are calendar periods.
    pub const fn calendar(&self) -> Option<Calendar> {
        self.calendar.get()
    }

    /// The limit's kind.
    pub const fn kind(&self) -> Kind {
        self.kind
    }
    /// Tokens added per period.
    pub const fn rate(&self) -> f64 {
        self.rate
    }
    /// The period in milliseconds.
    pub const fn period(&self) -> f64 {
        self.period
    }
    /// The most tokens that can accumulate.
    pub const fn capacity(&self) -> f64 {
        self.capacity
    }
    /// The most tokens that may be reserved ahead, if bounded.
    pub const fn max_reserved(&self) -> Option<f64> {
        if self.max_reserved.is_finite() { Some(self.max_reserved) } else { None }
    }
    /// [`Self::max_reserved`] with no bound as infinity, for the algebra: more reserved than
    /// this is one comparison, never true without a bound.
    pub(crate) const fn reserved_bound(&self) -> f64 {
        self.max_reserved
    }
    /// The number of shards.
    pub const fn shards(&self) -> u16 {
        self.shards
    }
    /// A fixed window's explicit alignment, if any.
    pub const fn start(&self) -> Option<f64> {
        if self.start.is_nan() { None } else { Some(self.start) }
    }

    /// `shardFactor` of SPEC §2: 1 below three shards, else half the shard count.
    #[inline]
    pub fn shard_factor(&self) -> f64 {
        if self.shards < 3 { 1.0 } else { f64::from(self.shards) / 2.0 }
    }

    /// The parameters of one shard: rate, capacity and `maxReserved` divided by the shard count.
    #[inline]
    pub fn per_shard(&self) -> Config {
        let n = f64::from(self.shards);
        if self.shards == 1 {
            return *self;
        }
        Config {
            rate: self.rate / n,
            capacity: self.capacity / n,
            max_reserved: self.max_reserved / n,
            ..*self
        }
    }

    /// One shard as a limit of its own (one shard), with reservations unbounded: the config
    /// of the takes that carry states over a change of config ([`crate::carrying`]).
    pub(crate) fn unbounded_shard(&self) -> Config {
        Config { shards: 1, max_reserved: f64::INFINITY, ..self.per_shard() }
    }

    /// The config with a fixed window's `start` set to `alignment` (when it has none), as the
    /// `value` operation reports it.
    #[must_use]
    pub fn with_alignment(mut self, alignment: f64) -> Config {
        if self.kind == Kind::FixedWindow && self.start.is_nan() && self.calendar.is_none() {
            self.start = alignment;
        }
        self
    }

    /// The serializable form with every default filled in.
    pub fn to_raw(&self) -> RawConfig {
        RawConfig {
            kind: self.kind.as_str().to_owned(),
            rate: self.rate,
            period: self.calendar.is_none().then_some(Period::Millis(self.period)),
            calendar: self.calendar().map(|c| c.unit().as_str().to_owned()),
            time_zone: self.calendar().map(|c| c.time_zone().to_owned()),
            capacity: Some(self.capacity),
            max_reserved: self.max_reserved(),
            shards: Some(f64::from(self.shards)),
            start: self.start(),
        }
    }
}

impl Serialize for Config {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.to_raw().serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Config {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = RawConfig::deserialize(deserializer)?;
        Config::try_from(raw).map_err(serde::de::Error::custom)
    }
}

/// A period as written in JSON or TOML: milliseconds, or a duration string such as `"10s"`.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Period {
    /// Milliseconds.
    Millis(#[serde(serialize_with = "serialize_number")] f64),
    /// A number followed by a unit: `ms`, `s`, `m`, `h` or `d` (`"1.5s"`, `"10m"`).
    Text(String),
}

/// By hand rather than `#[serde(untagged)]`, whose error for anything else names the
/// Rust enum ("did not match any variant of untagged enum Period").
impl<'de> Deserialize<'de> for Period {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Either;
        impl serde::de::Visitor<'_> for Either {
            type Value = Period;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number (ms) or a duration such as \"1m\"")
            }
            fn visit_f64<E>(self, ms: f64) -> Result<Period, E> {
                Ok(Period::Millis(ms))
            }
            #[expect(clippy::cast_precision_loss, reason = "a period is an f64 of ms")]
            fn visit_u64<E>(self, ms: u64) -> Result<Period, E> {
                Ok(Period::Millis(ms as f64))
            }
            #[expect(clippy::cast_precision_loss, reason = "a period is an f64 of ms")]
            fn visit_i64<E>(self, ms: i64) -> Result<Period, E> {
                Ok(Period::Millis(ms as f64))
            }
            fn visit_str<E>(self, text: &str) -> Result<Period, E> {
                Ok(Period::Text(text.to_owned()))
            }
        }
        deserializer.deserialize_any(Either)
    }
}

impl Period {
    /// The period in milliseconds.
    ///
    /// # Errors
    ///
    /// A string that is not a number followed by one of the units.
    pub fn millis(&self) -> Result<f64, ConfigError> {
        match self {
            Period::Millis(ms) => Ok(*ms),
            Period::Text(text) => parse_duration(text)
                .ok_or_else(|| ConfigError::new("period", format!("{text:?}"), PERIOD_RULE)),
        }
    }
}

const PERIOD_RULE: &str =
    "must be milliseconds > 0 or a duration such as \"500ms\", \"10s\", \"1m\", \"1h\", \"1d\"";

fn parse_duration(text: &str) -> Option<f64> {
    let text = text.trim();
    let split = text.find(|c: char| c.is_ascii_alphabetic())?;
    let (number, unit) = text.split_at(split);
    let number: f64 = number.trim().parse().ok()?;
    let unit_ms = match unit {
        "ms" => 1.0,
        "s" => SECOND,
        "m" => MINUTE,
        "h" => HOUR,
        "d" => DAY,
        _ => return None,
    };
    Some(number * unit_ms)
}

/// A limit configuration as written in JSON or TOML (camelCase), before validation.
///
/// # Examples
///
/// ```
/// use tollgate_algebra::{Config, RawConfig};
///
/// let raw: RawConfig = serde_json::from_str(
///     r#"{ "kind": "token bucket", "rate": 10, "period": "1m", "capacity": 3 }"#,
/// ).unwrap();
/// let config = Config::try_from(raw).unwrap();
/// assert_eq!(config.period(), 60_000.0);
///
/// let raw: RawConfig = serde_json::from_str(r#"{ "kind": "token bucket", "rate": -1, "period": 1000 }"#).unwrap();
/// let err = Config::try_from(raw).unwrap_err();
/// assert_eq!(err.to_string(), "invalid config: rate is -1; it must be finite, at least 1e-9 and at most 1e15");
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RawConfig {
    /// `"token bucket"` or `"fixed window"`.
    pub kind: String,
    /// Tokens added per period.
    #[serde(serialize_with = "serialize_number")]
    pub rate: f64,
    /// Milliseconds, or a duration string; none with `calendar`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub period: Option<Period>,
    /// A fixed window's calendar unit, in place of `period` and `start`: `"day"`, `"week"`
    /// (ISO, from Monday), `"month"` or `"year"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calendar: Option<String>,
    /// The IANA time zone of `calendar` windows; default `"UTC"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_zone: Option<String>,
    /// Most tokens that can accumulate; default `rate`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "serialize_some_number"
    )]
    pub capacity: Option<f64>,
    /// Most tokens that may be reserved ahead; default unbounded.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "serialize_some_number"
    )]
    pub max_reserved: Option<f64>,
    /// Number of shards, an integer in 1..=1024; default 1.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "serialize_some_number"
    )]
    pub shards: Option<f64>,
    /// Fixed window alignment, ms since the Unix epoch.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "serialize_some_number"
    )]
    pub start: Option<f64>,
}

impl TryFrom<RawConfig> for Config {
    type Error = ConfigError;

    fn try_from(raw: RawConfig) -> Result<Self, ConfigError> {
        Config::try_from(&raw)
    }
}

impl TryFrom<&RawConfig> for Config {
    type Error = ConfigError;

    fn try_from(raw: &RawConfig) -> Result<Self, ConfigError> {
        let kind = match raw.kind.as_str() {
            "token bucket" => Kind::TokenBucket,
            "fixed window" => Kind::FixedWindow,
            other => {
                return Err(ConfigError::new(
                    "kind",
                    format!("{other:?}"),
                    "must be \"token bucket\" or \"fixed window\"",
                ));
            }
        };
        let check = |field: &'static str, value: f64, ok: bool, rule: &'static str| {
            if ok { Ok(value) } else { Err(ConfigError::new(field, fmt_number(value), rule)) }
        };
        let rate = check("rate", raw.rate, rate_ok(raw.rate), RATE_RULE)?;
        let calendar = calendar_of(raw, kind)?;
        let period = match (&raw.period, calendar) {
            (Some(period), None) => period.millis()?,
            (None, Some(calendar)) => calendar.unit().longest(),
            (Some(_), Some(_)) => {
                return Err(ConfigError::new(
                    "period",
                    "given".into(),
                    "must not be given with calendar (a calendar window's length is its own)",
                ));
            }
            (None, None) => {
                return Err(ConfigError::new(
                    "period",
                    "missing".into(),
                    "is required (milliseconds or a duration such as \"1m\"), unless a fixed \
                     window has a calendar",
                ));
            }
        };
        let period = check("period", period, period_ok(period), PERIOD_BOUNDS)?;
        let mut config = Config::new(kind, rate, period);
        config.calendar = calendar.map_or(Packed::NONE, Packed::of);
        if let Some(capacity) = raw.capacity {
            config.capacity = check("capacity", capacity, amount_ok(capacity), CAPACITY_RULE)?;
        }
        if let Some(max) = raw.max_reserved {
            config.max_reserved = check("maxReserved", max, amount_ok(max), CAPACITY_RULE)?;
        }
        if config.capacity == 0.0 && config.max_reserved == 0.0 {
            return Err(ConfigError::new(
                "capacity",
                "0".into(),
                "must be > 0 when maxReserved is 0: such a limit can never admit a token",
            ));
        }
        if let Some(shards) = raw.shards {
            let ok = shards.fract() == 0.0 && (1.0..=f64::from(MAX_SHARDS)).contains(&shards);
            config.shards = check("shards", shards, ok, "must be an integer in 1..=1024")? as u16;
        }
        if let Some(start) = raw.start {
            if calendar.is_some() {
                return Err(ConfigError::new(
                    "start",
                    fmt_number(start),
                    "must not be given with calendar (calendar windows begin at local midnight)",
                ));
            }
            if kind != Kind::FixedWindow {
                return Err(ConfigError::new(
                    "start",
                    fmt_number(start),
                    "applies to fixed windows only",
                ));
            }
            config.start = check("start", start, start_ok(start), START_RULE)?;
        }
        Ok(config)
    }
}

/// The calendar of `raw`, if it has one, checked (SPEC §1: fixed windows only; a zone the
/// database knows; `timeZone` only with `calendar`).
fn calendar_of(raw: &RawConfig, kind: Kind) -> Result<Option<Calendar>, ConfigError> {
    let Some(unit) = &raw.calendar else {
        return match &raw.time_zone {
            Some(zone) => Err(ConfigError::new(
                "timeZone",
                format!("{zone:?}"),
                "applies to calendar windows only (set calendar too)",
            )),
            None => Ok(None),
        };
    };
    let Some(unit) = CalendarUnit::parse(unit) else {
        return Err(ConfigError::new(
            "calendar",
            format!("{unit:?}"),
            "must be \"day\", \"week\", \"month\" or \"year\"",
        ));
    };
    if kind != Kind::FixedWindow {
        return Err(ConfigError::new(
            "calendar",
            format!("{:?}", unit.as_str()),
            "applies to fixed windows only",
        ));
    }
    let zone = raw.time_zone.as_deref().unwrap_or("UTC");
    Calendar::new(unit, zone).map(Some).map_err(|_| {
        ConfigError::new(
            "timeZone",
            format!("{zone:?}"),
            "must be a zone of the IANA time zone database",
        )
    })
}

/// Serializes an `f64` that holds an integer as a JSON/TOML integer (`10`, not `10.0`).
///
/// # Errors
///
/// Whatever the serializer returns.
pub fn serialize_number<S: serde::Serializer>(x: &f64, serializer: S) -> Result<S::Ok, S::Error> {
    // 2^53: every integer below it is exact in an f64 and in an i64.
    if x.fract() == 0.0 && x.abs() < 9_007_199_254_740_992.0 {
        serializer.serialize_i64(*x as i64)
    } else {
        serializer.serialize_f64(*x)
    }
}

fn serialize_some_number<S: serde::Serializer>(
    x: &Option<f64>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    match x {
        Some(x) => serialize_number(x, serializer),
        None => serializer.serialize_none(),
    }
}

/// Formats a number in its shortest form: `3`, `2.5`, `-1`, `NaN`, `inf`.
pub fn fmt_number(x: f64) -> String {
    // As JavaScript prints numbers: plain, unless very large or very small, where the plain
    // form would run to hundreds of digits (5e-324).
    if x != 0.0 && x.is_finite() && !(1e-6..1e21).contains(&x.abs()) {
        format!("{x:e}")
    } else {
        format!("{x}")
    }
}

/// A config that breaks the rules of SPEC §1, naming the field and the value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    field: &'static str,
    value: String,
    rule: &'static str,
}

impl ConfigError {
    pub(crate) fn new(field: &'static str, value: String, rule: &'static str) -> Self {
        ConfigError { field, value, rule }
    }

    /// The offending field, in its JSON spelling (`maxReserved`).
    pub fn field(&self) -> &'static str {
        self.field
    }

    /// The offending value as written.
    pub fn value(&self) -> &str {
        &self.value
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid config: {} is {}; it {}", self.field, self.value, self.rule)
    }
}

impl std::error::Error for ConfigError {}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<Config, String> {
        let raw: RawConfig = serde_json::from_str(json).map_err(|e| e.to_string())?;
        Config::try_from(raw).map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_follow_spec() {
        let c = parse(r#"{"kind":"fixed window","rate":100,"period":3600000}"#).unwrap();
        assert_eq!(c.kind(), Kind::FixedWindow);
        assert_eq!(c.capacity(), 100.0);
        assert_eq!(c.max_reserved(), None);
        assert_eq!(c.shards(), 1);
        assert_eq!(c.start(), None);
    }

    #[test]
    fn period_strings() {
        for (text, ms) in [
            ("10s", 10_000.0),
            ("1m", 60_000.0),
            ("1h", 3_600_000.0),
            ("250ms", 250.0),
            ("1.5s", 1500.0),
            ("2d", 2.0 * DAY),
        ] {
            let c =
                parse(&format!(r#"{{"kind":"token bucket","rate":1,"period":"{text}"}}"#)).unwrap();
            assert_eq!(c.period(), ms, "{text}");
        }
        let err =
            parse(r#"{"kind":"token bucket","rate":1,"period":"10 fortnights"}"#).unwrap_err();
        assert!(err.starts_with("invalid config: period is \"10 fortnights\""), "{err}");
    }

    #[test]
    fn errors_name_field_and_value() {
        let cases = [
            (
                r#"{"kind":"leaky bucket","rate":1,"period":1}"#,
                "invalid config: kind is \"leaky bucket\"; it must be \"token bucket\" or \"fixed window\"",
            ),
            (
                r#"{"kind":"token bucket","rate":0,"period":1}"#,
                "invalid config: rate is 0; it must be finite, at least 1e-9 and at most 1e15",
            ),
            (
                r#"{"kind":"token bucket","rate":1,"period":-5}"#,
                "invalid config: period is -5; it must be finite, at least 0.001 (a microsecond) and at most 1e15 ms",
            ),
            (
                r#"{"kind":"token bucket","rate":1,"period":1,"capacity":-0.5}"#,
                "invalid config: capacity is -0.5; it must be finite, >= 0 and at most 1e15",
            ),
            (
                r#"{"kind":"token bucket","rate":1,"period":1,"maxReserved":-1}"#,
                "invalid config: maxReserved is -1; it must be finite, >= 0 and at most 1e15",
            ),
            (
                r#"{"kind":"token bucket","rate":1,"period":1,"shards":2.5}"#,
                "invalid config: shards is 2.5; it must be an integer in 1..=1024",
            ),
            (
                r#"{"kind":"token bucket","rate":1,"period":1,"shards":1025}"#,
                "invalid config: shards is 1025; it must be an integer in 1..=1024",
            ),
            (
                r#"{"kind":"token bucket","rate":1,"period":1,"start":0}"#,
                "invalid config: start is 0; it applies to fixed windows only",
            ),
        ];
        for (json, want) in cases {
            assert_eq!(parse(json).unwrap_err(), want, "{json}");
        }
        assert!(
            parse(r#"{"kind":"token bucket","rate":1,"period":1,"burst":3}"#)
                .unwrap_err()
                .contains("unknown field `burst`")
        );
    }

    /// Configs whose numbers are valid floats but would overflow the algebra (a window
    /// narrower than the clock's spacing, a wait past any float) are refused, naming the
    /// field; the bounds themselves are accepted.
    #[test]
    fn out_of_range_configs_are_refused() {
        let refused = [
            (r#"{"kind":"fixed window","rate":1,"period":5e-324}"#, "period is 5e-324"),
            (r#"{"kind":"token bucket","rate":1,"period":1.7e308}"#, "period is 1.7e308"),
            (r#"{"kind":"token bucket","rate":1e16,"period":1}"#, "rate is 10000000000000000"),
            (r#"{"kind":"token bucket","rate":1e-300,"period":1e15}"#, "rate is 1e-300"),
            (r#"{"kind":"token bucket","rate":1e-10,"period":1}"#, "rate is 1e-10"),
            (
                r#"{"kind":"token bucket","rate":1,"period":1,"capacity":1e16}"#,
                "capacity is 10000000000000000",
            ),
            (r#"{"kind":"fixed window","rate":1,"period":1,"start":1e300}"#, "start is 1e300"),
        ];
        for (json, want) in refused {
            let err = parse(json).unwrap_err();
            assert!(err.starts_with(&format!("invalid config: {want}; it must")), "{json}: {err}");
        }
        let bounds = r#"{"kind":"token bucket","rate":1e15,"period":0.001,"capacity":1e15,"maxReserved":1e15}"#;
        assert!(parse(bounds).is_ok());
        assert!(
            parse(r#"{"kind":"token bucket","rate":1e-9,"period":1e15,"capacity":1e15}"#).is_ok()
        );
        assert!(parse(r#"{"kind":"fixed window","rate":1,"period":1e15,"start":-1e15}"#).is_ok());
        let never =
            parse(r#"{"kind":"token bucket","rate":1,"period":1,"capacity":0,"maxReserved":0}"#);
        assert!(never.unwrap_err().contains("can never admit a token"));
        // Capacity 0 with room to reserve: a limit that only books ahead.
        assert!(parse(r#"{"kind":"token bucket","rate":1,"period":1,"capacity":0}"#).is_ok());
        assert_eq!(fmt_number(5e-324), "5e-324");
        assert_eq!(fmt_number(60_000.0), "60000");
        assert_eq!(fmt_number(0.5), "0.5");
    }

    #[test]
    fn non_finite_values_are_refused() {
        let raw = RawConfig {
            kind: "token bucket".into(),
            rate: f64::INFINITY,
            period: Some(Period::Millis(1.0)),
            calendar: None,
            time_zone: None,
            capacity: None,
            max_reserved: None,
            shards: None,
            start: None,
        };
        assert_eq!(
            Config::try_from(raw).unwrap_err().to_string(),
            "invalid config: rate is inf; it must be finite, at least 1e-9 and at most 1e15"
        );
        let raw = RawConfig {
            kind: "token bucket".into(),
            rate: 1.0,
            period: Some(Period::Millis(f64::NAN)),
            calendar: None,
            time_zone: None,
            capacity: None,
            max_reserved: None,
            shards: None,
            start: None,
        };
        assert_eq!(Config::try_from(raw).unwrap_err().field(), "period");
    }

    #[test]
    fn round_trips_with_defaults_filled() {
        let c = Config::token_bucket(10.0, MINUTE).with_shards(4);
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(
            json,
            r#"{"kind":"token bucket","rate":10,"period":60000,"capacity":10,"shards":4}"#
        );
        let back: Config = serde_json::from_str(&json).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn config_is_small() {
        assert_eq!(std::mem::size_of::<Config>(), 48);
        let c = Config::fixed_window(1.0, 1.0);
        assert_eq!((c.max_reserved(), c.start()), (None, None));
        let c = c.with_max_reserved(0.0).with_start(-5.0);
        assert_eq!((c.max_reserved(), c.start()), (Some(0.0), Some(-5.0)));
    }

    #[test]
    fn per_shard_divides() {
        let c = Config::token_bucket(40.0, MINUTE)
            .with_capacity(20.0)
            .with_max_reserved(8.0)
            .with_shards(4);
        let s = c.per_shard();
        assert_eq!((s.rate(), s.capacity(), s.max_reserved()), (10.0, 5.0, Some(2.0)));
        assert_eq!(c.shard_factor(), 2.0);
        assert_eq!(Config::token_bucket(1.0, 1.0).with_shards(2).shard_factor(), 1.0);
    }
}
