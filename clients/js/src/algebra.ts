// The algebra of tollgate's SPEC §2 in TypeScript: the same operations in the same order as
// the server's, so that the numbers agree to the last bit (tests compare them over random
// cases through `tollgate simulate`).

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
  /** Milliseconds: finite, > 0. */
  period: number;
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
}

/** A limit's config (SPEC §1). */
export type RateLimitConfig = TokenBucketConfig | FixedWindowConfig;

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
  const { rate, period } = config;
  const wait =
    config.kind === "token bucket"
      ? (-next.value * period) / rate
      : next.ts + period * Math.ceil(-next.value / rate) - now;
  const retryAfter = ok
    ? // A reservation: the booked tokens have flowed in once the new state is back at 0.
      settle(now, wait, (at) => advance(config, next, at, 0).value >= 0)
    : // A refusal: the same request, made again at now + retryAfter, is granted.
      settle(now, wait, (at) => advance(config, from, at, count).value >= 0);
  return { ok, retryAfter, value: next.value, ts: next.ts };
}

function capacity(config: RateLimitConfig): number {
  return config.capacity ?? config.rate;
}

function fresh(config: RateLimitConfig, now: number): RateLimitState {
  if (config.kind === "token bucket") {
    return { value: capacity(config), ts: now };
  }
  const alignment = config.start ?? 0;
  const ts = alignment + Math.floor((now - alignment) / config.period) * config.period;
  return { value: capacity(config), ts };
}

function advance(
  config: RateLimitConfig,
  state: RateLimitState,
  now: number,
  count: number,
): RateLimitState {
  const { rate, period } = config;
  const max = capacity(config);
  if (config.kind === "token bucket") {
    return { value: atMost(state.value + ((now - state.ts) * rate) / period, max) - count, ts: now };
  }
  const windows = Math.floor((now - state.ts) / period);
  return { value: atMost(state.value + rate * windows, max) - count, ts: state.ts + windows * period };
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
