// The algebra of tollgate's SPEC §2 in TypeScript: the same operations in the same order as
// the server's, so that the numbers agree to the last bit (tests compare them over random
// cases through `tollgate simulate`).

/**
 * A duration: a number of milliseconds (`60_000`, `MINUTE`), or a string of a number and its
 * unit as the server's config file writes it: `"250ms"`, `"10s"`, `"1m"`, `"1h"`, `"1d"`
 * (`"1.5s"` too). Every duration of tollgate's options and configs takes either.
 */
export type Duration = number | `${number}${"ms" | "s" | "m" | "h" | "d"}`;

/** Milliseconds in a second. Durations in tollgate are milliseconds. */
export const SECOND = 1_000;
/** Milliseconds in a minute. */
export const MINUTE = 60 * SECOND;
/** Milliseconds in an hour. */
export const HOUR = 60 * MINUTE;
/** Milliseconds in a day. */
export const DAY = 24 * HOUR;

interface CommonConfig {
  /** Tokens added per `period`: finite, > 0. */
  rate: number;
  /** A duration: milliseconds, or a string such as `"1m"`; finite, > 0. (A calendar window
   *  has none: its windows are its own.) */
  period: Duration;
  /** Most tokens that can accumulate; default `rate`. */
  capacity?: number;
  /** Most tokens that may be reserved ahead (how negative the value may go); default: no bound. */
  maxReserved?: number;
  /** Independent shards the capacity is split over, 1..=1024; default 1. */
  shards?: number;
}

/** Tokens flow in continuously, `rate` every `period`, up to `capacity`. */
export interface TokenBucketConfig extends CommonConfig {
  kind: "token bucket";
}

/** `rate` tokens are granted at the start of each window of `period`, up to `capacity`. */
export interface FixedWindowConfig extends CommonConfig {
  kind: "fixed window";
  /** Window alignment, ms from the Unix epoch; default: random per key (on the server). */
  start?: number;
  calendar?: undefined;
}

/** The unit of a calendar window. */
export type CalendarUnit = "day" | "week" | "month" | "year";

/** `rate` tokens are granted at the start of each calendar period (local midnight of a day,
 *  of an ISO week's Monday, of the 1st, of January 1st) in `timeZone`, up to `capacity`: windows
 *  of unequal lengths, in place of `period` and `start`. */
export interface CalendarWindowConfig extends Omit<CommonConfig, "period"> {
  kind: "fixed window";
  calendar: CalendarUnit;
  /** The IANA time zone; default `"UTC"`. */
  timeZone?: string;
  period?: undefined;
  start?: undefined;
}

/** A limit's config (SPEC §1). */
export type RateLimitConfig = TokenBucketConfig | FixedWindowConfig | CalendarWindowConfig;

/** The two numbers stored per limit and key. */
export interface RateLimitState {
  /** Tokens available at `ts`; negative after a reservation. */
  value: number;
  /** Milliseconds since the Unix epoch. */
  ts: number;
}

/** What `calculateRateLimit` finds. */
export interface Calculation {
  /** Whether `count` tokens would be granted (with `reserve`, possibly booked ahead). */
  ok: boolean;
  /** Milliseconds to wait: before a retry succeeds when refused, before doing the work when a
   *  reservation was granted. Absent when granted with tokens on hand. */
  retryAfter?: number;
  /** The value after taking `count` (what a granted `limit` stores). */
  value: number;
  /** The ts that goes with it. */
  ts: number;
}

/**
 * Evaluates a limit at `now` for `count` tokens, as the server does (SPEC §2).
 *
 * `state` is a stored state (from `getValue`), or `null`/`undefined` for a key without one: a
 * token bucket then starts full at `now`, a fixed window full at the start of the window that
 * holds `now` (aligned to `config.start`, or to 0 without it). `config` is the whole limit's
 * config; for a sharded limit, give the total that `getValue` reports and the whole config.
 */
export function calculateRateLimit(
  state: RateLimitState | null | undefined,
  config: RateLimitConfig,
  now: number,
  count = 1,
  reserve = false,
): Calculation {
  const from = state ?? fresh(config, now);
  const next = advance(config, from, now, count);
  const maxReserved = config.maxReserved ?? Infinity;
  const ok = next.value >= 0 || (reserve && !(-next.value > maxReserved));
  if (!(next.value < 0)) {
    return { ok, value: next.value, ts: next.ts };
  }
  const wait =
    config.kind === "token bucket"
      ? (-next.value * periodOf(config)) / config.rate
      : windowsAfter(config, next.ts, Math.ceil(-next.value / config.rate)) - now;
  const retryAfter = ok
    ? // A reservation: the booked tokens have flowed in once the new state is back at 0.
      settle(now, wait, (at) => advance(config, next, at, 0).value >= 0)
    : // A refusal: the same request, made again at now + retryAfter, is granted.
      settle(now, wait, (at) => advance(config, from, at, count).value >= 0);
  return { ok, retryAfter, value: next.value, ts: next.ts };
}

const UNITS: Record<string, number> = { ms: 1, s: 1_000, m: 60_000, h: 3_600_000, d: 86_400_000 };

/** The milliseconds of `text` by the server's grammar (tollgate-algebra's parse_duration):
 *  a decimal number, then one of the units, spaces around either; undefined otherwise. */
export function parseDuration(text: string): number | undefined {
  const trimmed = text.trim();
  const split = trimmed.search(/[A-Za-z]/);
  if (split < 0) return undefined;
  const number = trimmed.slice(0, split).trim();
  const unit = UNITS[trimmed.slice(split)];
  if (unit === undefined || !/^[+-]?(\d+(\.\d*)?|\.\d+)$/.test(number)) return undefined;
  return Number(number) * unit;
}

/**
 * The milliseconds of the duration `value` (`what` names it in the error): a number as it is,
 * a string such as `"10s"` by the server's grammar. Throws a `TypeError` for anything else.
 */
export function durationMs(value: unknown, what: string): number {
  const ms = typeof value === "number" ? value : typeof value === "string" ? parseDuration(value) : undefined;
  if (ms === undefined) {
    throw new TypeError(
      `${what} must be milliseconds or a duration such as "500ms", "10s", "1m", "1h", "1d"; got ${JSON.stringify(value) ?? String(value)}`,
    );
  }
  return ms;
}

/** A config's period in milliseconds (a string read each time: numbers are the common case). */
function periodOf(config: { period: Duration }): number {
  const { period } = config;
  return typeof period === "number" ? period : durationMs(period, "period");
}

function capacity(config: RateLimitConfig): number {
  return config.capacity ?? config.rate;
}

function fresh(config: RateLimitConfig, now: number): RateLimitState {
  if (config.kind === "token bucket") {
    return { value: capacity(config), ts: now };
  }
  if (config.calendar !== undefined) {
    return { value: capacity(config), ts: calendarStart(calendarOf(config), now) };
  }
  const alignment = config.start ?? 0;
  const period = periodOf(config);
  const ts = alignment + Math.floor((now - alignment) / period) * period;
  return { value: capacity(config), ts };
}

/** The start of the `k`-th window after the one starting at `ts`. */
function windowsAfter(config: FixedWindowConfig | CalendarWindowConfig, ts: number, k: number): number {
  if (config.calendar !== undefined) return calendarAfter(calendarOf(config), ts, k);
  return ts + periodOf(config) * k;
}

function advance(
  config: RateLimitConfig,
  state: RateLimitState,
  now: number,
  count: number,
): RateLimitState {
  const { rate } = config;
  const max = capacity(config);
  if (config.kind === "token bucket") {
    const period = periodOf(config);
    return { value: atMost(state.value + ((now - state.ts) * rate) / period, max) - count, ts: now };
  }
  if (config.calendar !== undefined) {
    // windows: the window starts in (ts, now]; ts' the start of the one holding now.
    const calendar = calendarOf(config);
    const windows = calendarWindows(calendar, state.ts, now);
    const ts = windows > 0 ? calendarStart(calendar, now) : state.ts;
    return { value: atMost(state.value + rate * windows, max) - count, ts };
  }
  const period = periodOf(config);
  const windows = Math.floor((now - state.ts) / period);
  return { value: atMost(state.value + rate * windows, max) - count, ts: state.ts + windows * period };
}

// Calendar windows (SPEC §2): the same counting as the server's (tollgate-algebra's
// calendar.rs), on the platform's time zone database through Intl. A window's index is its
// day, ISO week, month or year since the epoch in the zone's calendar; it starts at local
// midnight of its first date, read as the server reads it when a change skips or repeats
// midnight (the offset in force before a skipped midnight; the earlier of a repeated one).

interface Calendar {
  unit: CalendarUnit;
  zone: string;
}

function calendarOf(config: CalendarWindowConfig): Calendar {
  return { unit: config.calendar, zone: config.timeZone ?? "UTC" };
}

const LONGEST: Record<CalendarUnit, number> = {
  day: 25 * HOUR,
  week: 7 * DAY + HOUR,
  month: 31 * DAY + HOUR,
  year: 366 * DAY + HOUR,
};

// The instants dates are counted for, as the server's (years -9998 to 9998).
const FIRST_MS = -377_642_044_800_000;
const LAST_MS = 253_370_678_400_000;

const formats = new Map<string, Intl.DateTimeFormat>();

/** The wall clock of `zone` at `t` (ms, whole seconds): [year, month, day, hour, minute, second]. */
function wall(zone: string, t: number): number[] {
  let format = formats.get(zone);
  if (format === undefined) {
    format = new Intl.DateTimeFormat("en-US", {
      timeZone: zone,
      hourCycle: "h23",
      era: "short",
      year: "numeric",
      month: "numeric",
      day: "numeric",
      hour: "numeric",
      minute: "numeric",
      second: "numeric",
    });
    formats.set(zone, format);
  }
  const parts: Record<string, string> = {};
  for (const p of format.formatToParts(new Date(t))) parts[p.type] = p.value;
  const year = parts.era === "BC" || parts.era === "B" ? 1 - Number(parts.year) : Number(parts.year);
  return [year, Number(parts.month), Number(parts.day), Number(parts.hour), Number(parts.minute), Number(parts.second)];
}

/** Ms since the epoch of the proleptic Gregorian date and time, read as UTC. */
function utc(y: number, m: number, d: number, h = 0, mi = 0, s = 0): number {
  const date = new Date(0);
  date.setUTCFullYear(y, m - 1, d);
  date.setUTCHours(h, mi, s, 0);
  return date.getTime();
}

/** The zone's offset from UTC at `t`, in ms. */
function offset(zone: string, t: number): number {
  const whole = Math.floor(t / 1000) * 1000;
  const [y, m, d, h, mi, s] = wall(zone, whole);
  return utc(y, m, d, h, mi, s) - whole;
}

function localDays(zone: string, t: number): number {
  const clamped = Math.floor(Math.min(Math.max(t, FIRST_MS), LAST_MS));
  const [y, m, d] = wall(zone, clamped);
  return utc(y, m, d) / DAY;
}

function index(c: Calendar, t: number): number {
  const days = localDays(c.zone, t);
  if (c.unit === "day") return days;
  // 1970-01-01 was a Thursday: its ISO week began on Monday 1969-12-29 (day -3).
  if (c.unit === "week") return Math.floor((days + 3) / 7);
  const date = new Date(days * DAY);
  if (c.unit === "month") return date.getUTCFullYear() * 12 + date.getUTCMonth();
  return date.getUTCFullYear();
}

function startOf(c: Calendar, i: number): number {
  let y: number, m: number, d: number;
  if (c.unit === "day" || c.unit === "week") {
    const date = new Date((c.unit === "day" ? i : i * 7 - 3) * DAY);
    [y, m, d] = [date.getUTCFullYear(), date.getUTCMonth() + 1, date.getUTCDate()];
  } else if (c.unit === "month") {
    [y, m, d] = [Math.floor(i / 12), (((i % 12) + 12) % 12) + 1, 1];
  } else {
    [y, m, d] = [i, 1, 1];
  }
  // Local midnight: the offsets a day before and after are the candidates; a repeated
  // midnight is the earlier instant, a skipped one read with the offset before it.
  const midnight = utc(y, m, d);
  const before = offset(c.zone, midnight - DAY);
  const after = offset(c.zone, midnight + DAY);
  const valid = [before, after].map((o) => midnight - o).filter((at) => offset(c.zone, at) === midnight - at);
  return valid.length > 0 ? Math.min(...valid) : midnight - before;
}

function calendarStart(c: Calendar, t: number): number {
  return startOf(c, index(c, t));
}

function calendarAfter(c: Calendar, t: number, k: number): number {
  const i = index(c, t);
  const last = index(c, LAST_MS);
  const reach = last - i;
  return k <= reach ? startOf(c, i + k) : startOf(c, last) + (k - reach) * LONGEST[c.unit];
}

function calendarWindows(c: Calendar, ts: number, now: number): number {
  return now <= ts ? 0 : index(c, now) - index(c, ts);
}

// `x < max ? x : max`, which is not Math.min for NaN: the server's choice, kept.
function atMost(x: number, max: number): number {
  return x < max ? x : max;
}

// The formula's wait is exact in real numbers; in floating point, evaluating again at
// now + wait may fall a rounding error short. As the server does: move it up one
// representable time at a time (at most 8) until `done` holds.
function settle(now: number, wait: number, done: (at: number) => boolean): number {
  let at = now + wait;
  for (let i = 0; i < 8; i++) {
    if (done(at)) {
      return Math.max(at - now, wait);
    }
    at = nextUp(at);
  }
  return wait;
}

const view = new DataView(new ArrayBuffer(8));

/** The least double greater than `x` (Rust's `f64::next_up`). */
export function nextUp(x: number): number {
  if (Number.isNaN(x) || x === Infinity) return x;
  if (x === 0) return Number.MIN_VALUE;
  view.setFloat64(0, x);
  const bits = view.getBigUint64(0);
  view.setBigUint64(0, x > 0 ? bits + 1n : bits - 1n);
  return view.getFloat64(0);
}
