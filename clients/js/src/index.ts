// tollgate-client: the API of tollgate's server (SPEC §4 and §6) for TypeScript and
// JavaScript, on the platform's fetch (Node >= 20, browsers), with no runtime dependency.

// `Held` is disposable (`await using`): the type of `Symbol.asyncDispose` comes with the
// declarations, for a project whose `lib` does not name it (TypeScript 5.2 and later).
/// <reference lib="esnext.disposable" preserve="true" />

import { durationMs, type Duration, type RateLimitConfig } from "./algebra.js";
import {
  checkCount,
  checkFlag,
  checkKey,
  checkName,
  checkOptions,
  checkTake,
  checkTicket,
  checkTransaction,
  ttlOf,
} from "./check.js";
import { NoAnswer, type Reply, type Send, fetchSend, nodeSend, onNode } from "./transport.js";

/** The checks of `limit`'s and `check`'s arguments (a TypeError for a value of the wrong type),
 *  exported for the `tollgate` package, whose direct path makes the same, and of a ttl (its
 *  middleware checks a concurrency limit's when it is made). */
export { checkName, checkTake, plainTake, ttlOf } from "./check.js";
export {
  calculateRateLimit,
  nextUp,
  SECOND,
  MINUTE,
  HOUR,
  DAY,
} from "./algebra.js";
export type {
  Duration,
  Calculation,
  CalendarUnit,
  CalendarWindowConfig,
  FixedWindowConfig,
  RateLimitConfig,
  RateLimitState,
  TokenBucketConfig,
} from "./algebra.js";

/**
 * The limits the server defines, by name. Empty here: `tollgate types --config FILE` (or
 * `--url URL`) prints a declaration that fills it in, so that the compiler accepts those names
 * without a config. Put its output in a `.d.ts` file of your project.
 */
// eslint-disable-next-line @typescript-eslint/no-empty-interface
export interface ServerLimits {}

/** The names a limiter knows: those named in code, and those the server defines. */
export type LimitName<Limits> = (keyof Limits | keyof ServerLimits) & string;

/** How to reach the server. */
export interface ClientOptions {
  /** The server's base URL, such as `http://127.0.0.1:8787`. */
  url: string;
  /** A bearer token, if the server asks for one (a read token can `check` and `getValue`). */
  token?: string;
  /** How long a call may take, from sending the request to the answer's last byte, before
   *  it fails with a `TollgateError`: milliseconds, or a duration such as `"10s"`; default
   *  10,000 (ms). */
  timeoutMs?: Duration;
  /** The most bytes an answer's body may have: a larger one fails with a `TollgateError`
   *  saying so, without being read whole. Default 8 MiB (8,388,608), far above any answer
   *  but that of `getServerLimits` for a config file of tens of thousands of limits. */
  maxAnswerBytes?: number;
  /** A fetch to send requests with. Default: on Node, Node's own http module with a pool of
   *  keep-alive connections (faster there than the platform's fetch); elsewhere `fetch`. */
  fetch?: typeof fetch;
}

/**
 * Answers a request of the API as the server would, without HTTP: `method` and `path` as the
 * HTTP API names them (`POST /v1/limit`), `body` its JSON. The `tollgate` package's
 * in-process limiter is one: it hands a client the engine of its own process.
 */
export type Door = (
  method: string,
  path: string,
  body: string | undefined,
) => Promise<{ status: number; text: string; fields?: Record<string, string> }>;

/** A client whose requests go through a `Door` instead of HTTP. */
export interface DoorOptions {
  door: Door;
}

/** The options of `transaction`. */
export interface TransactionOptions {
  /** Also give the answer's IETF `RateLimit-Policy` and `RateLimit` header fields (and
   *  `Retry-After` on a refusal), as the server writes them: what the middleware sends. */
  fields?: boolean;
}

/** The options of `limit` and `check`. */
export interface LimitOptions {
  /** The key (a user, an IP); none: one shared value for the name. */
  key?: string;
  /** Tokens to take; default 1. */
  count?: number;
  /** Book a shortfall ahead instead of refusing: granted with a `retryAfter` to wait. */
  reserve?: boolean;
  /** Reject with a `RateLimitError` instead of answering `{ ok: false }`. */
  throws?: boolean;
}

/** The options of `adjust`. */
export interface AdjustOptions {
  key?: string;
  /** Signed: what the work used beyond (+) or below (-) what was taken for it. */
  count: number;
}

/** The answer of `adjust`: the value it left, and while that is negative the wait until it
 *  is back at 0. */
export interface AdjustResult {
  /** Tokens available after the adjust; negative while the limit is in debt. */
  value: number;
  /** Milliseconds until the value is back at 0, when it is negative. */
  retryAfter?: number;
}

/**
 * A concurrency limit's config (SPEC §6f): `max` slots held at once, each until it is
 * released or for `ttl`. A server defines these in its config file (`kind = "concurrency"`),
 * the `tollgate` package among its limits; a call never carries one.
 */
export interface ConcurrencyConfig {
  kind: "concurrency";
  /** The slots that may be held at once: a whole number, at least 1. */
  max: number;
  /** How long an acquire holds its slots unless released or renewed: milliseconds, or a
   *  duration such as `"2m"`; default 60,000 (ms). */
  ttl?: Duration;
}

/** The options of `acquire` and `hold`. */
export interface AcquireOptions {
  /** The key (a tenant, a user); none: one shared set of slots for the name. */
  key?: string;
  /** Slots to take, a whole number; default 1. More than the limit's `max` is an error. */
  count?: number;
  /** How long the slots are held unless released or renewed: milliseconds, or a duration
   *  such as `"30s"`; default the limit's `ttl`. */
  ttl?: Duration;
  /** Reject with a `RateLimitError` instead of answering `{ ok: false }` (`null` for
   *  `hold`). */
  throws?: boolean;
}

/** The answer of `acquire`: a ticket holding the slots, or the wait before trying again. */
export type AcquireResult =
  | {
      ok: true;
      /** Holds the slots: give it to `release` and `renew` as it came (a string of digits). */
      ticket: string;
      /** When the slots are free again unless renewed: ms since the Unix epoch, on the
       *  store's clock. */
      expiresAt: number;
    }
  | {
      ok: false;
      /** Milliseconds until the earliest holder's expiry (a release may free a slot
       *  sooner). */
      retryAfter: number;
    };

/** The options of `release`. */
export interface ReleaseOptions {
  /** The key the ticket was acquired with. */
  key?: string;
}

/** The options of `renew`. */
export interface RenewOptions {
  /** The key the ticket was acquired with. */
  key?: string;
  /** The new expiry is now plus this: milliseconds, or a duration such as `"30s"`; default
   *  the limit's `ttl`. */
  ttl?: Duration;
}

/** The answer of `renew`: the new expiry, or `ok: false` when the ticket had expired (its
 *  slots may be someone else's by then: stop the work, or acquire again). */
export type RenewResult = { ok: true; expiresAt: number } | { ok: false };

/** A concurrency limit's slots for a key (SPEC §6f's `value`). */
export interface SlotsValue {
  /** The slots held by unexpired tickets. */
  inFlight: number;
  /** The limit's `max`. */
  max: number;
  /** The unexpired tickets. */
  holders: number;
}

/** The options of `getValue`. */
export interface ValueOptions {
  key?: string;
  /** For a sharded limit: how many shards to sample for the estimate; default 1. */
  sampleShards?: number;
}

/** A config for the call: required for a name the limiter does not know. */
type ConfigFor<Limits, Name extends string> = Name extends LimitName<Limits>
  ? { config?: RateLimitConfig }
  : { config: RateLimitConfig };

/** The options argument of a call: optional for known names, required (for its config)
 *  otherwise. */
export type Args<Limits, Name extends string, Options> = Name extends LimitName<Limits>
  ? [options?: Options & ConfigFor<Limits, Name>]
  : [options: Options & ConfigFor<Limits, Name>];

/** The answer of `limit` and `check`. */
export interface RateLimitResult {
  /** Whether the tokens were (for `check`: would be) granted. */
  ok: boolean;
  /** Milliseconds: when refused, until a retry succeeds; when a reservation was granted, until
   *  the work may be done. Absent when granted with tokens on hand. */
  retryAfter?: number;
}

/** One request's answer in a `transaction`'s results. */
export interface TransactionLimitResult extends RateLimitResult {
  /** A concurrency limit's (a server takes one among a transaction's limits, named by its
   *  config), when every limit granted: the ticket that holds its slots, for `release`. */
  ticket?: string;
  /** With `ticket`: when its slots are free again unless renewed (ms since the Unix epoch). */
  expiresAt?: number;
}

/** The answer of `transaction`: `ok` when every limit granted (then all were taken). */
export interface TransactionResult extends RateLimitResult {
  /** One answer per request, in order. */
  results: TransactionLimitResult[];
  /** With a concurrency limit among the requests (at most one), when every limit granted:
   *  its slot's ticket (as its result's), taken together with the tokens; release it when
   *  the work is done. */
  ticket?: string;
  /** With `ticket`: when its slots are free again unless renewed (ms since the epoch). */
  expiresAt?: number;
  /** With `fields: true`: the answer's rate limit header fields by their lower-case names
   *  (`ratelimit-policy`, `ratelimit`, `retry-after`). */
  fields?: Record<string, string>;
}

/** One request of a transaction. */
export interface TransactionRequest<Name extends string = string> {
  name: Name;
  key?: string;
  count?: number;
  reserve?: boolean;
  config?: RateLimitConfig;
}

/** A limit's state as the server reports it (SPEC §4's `value`). */
export interface RateLimitValue {
  /** Tokens available at `ts` (for a sharded limit, the total estimated from the sampled
   *  shards); a key without a state reports `capacity`. */
  value: number;
  /** Milliseconds since the Unix epoch; 0 for a key without a state. */
  ts: number;
  /** The shard read (the fullest sampled). */
  shard: number;
  /** The config with every default filled in (a fixed window's `start` included). */
  config: RateLimitConfig & { capacity: number; shards: number };
}

/** A refusal, with `throws: true`. */
export class RateLimitError extends Error {
  /** Always `"RateLimited"`. */
  readonly kind = "RateLimited" as const;
  /** Milliseconds until a retry succeeds. */
  readonly retryAfter: number;
  /**
   * The limit's name. (It takes the place of `Error.name`, as in the API this client
   * follows; `kind` tells the error apart.)
   */
  override name: string;

  constructor(name: string, retryAfter: number) {
    super(`Rate limit ${name} exceeded; retry in ${retryAfter} ms`);
    this.name = name;
    this.retryAfter = retryAfter;
  }
}

/** Whether `e` is a `RateLimitError` (or its plain-object form `{ kind: "RateLimited" }`). */
export function isRateLimitError(
  e: unknown,
): e is { kind: "RateLimited"; name: string; retryAfter: number } {
  return (
    e instanceof RateLimitError ||
    (typeof e === "object" && e !== null && (e as { kind?: unknown }).kind === "RateLimited")
  );
}

/** Every failure but a refusal: an error answer, a timeout, a connection that failed. */
export class TollgateError extends Error {
  override name = "TollgateError";
  /** The HTTP status; undefined when no answer came (timeout, connection failed). */
  readonly status: number | undefined;
  /**
   * Whether tokens (or slots) may have been taken all the same. True when the server says so
   * (`mayHaveTaken: true` in its error answer, on a 503: its store failed after the write may
   * have happened), and for a write (`limit`, `transaction`, `adjust`, `reset`, `acquire`,
   * `hold`, `release`, `renew`) sent and left without an answer that could be read (a
   * timeout, a connection lost, an answer cut short, too large or not the API's, unless its
   * status is 4xx). False for a read (`check`, `getValue`, `getSlotsValue`, `getServerTime`,
   * `getServerLimits`), and for a request never sent (connection refused, no such host, the
   * timeout passed before a connection was made). An acquire that may have been granted
   * unseen holds its slots until its expiry, no longer.
   */
  readonly mayHaveTaken: boolean;
  /** The answer's body, if it was JSON. */
  readonly body: unknown;

  constructor(message: string, status: number | undefined, mayHaveTaken: boolean, body?: unknown) {
    super(message);
    this.status = status;
    this.mayHaveTaken = mayHaveTaken;
    this.body = body;
  }
}

/** What a `Held` calls to let its slots go or keep them: its limiter's. */
interface Holder {
  release(name: string, ticket: string, options?: ReleaseOptions): Promise<boolean>;
  renew(name: string, ticket: string, options?: RenewOptions): Promise<RenewResult>;
}

/**
 * Slots of a concurrency limit held by `hold`, until `release()`, or until the end of the
 * block that declared it with `await using`, however the block ends (a return, a throw):
 *
 * ```ts
 * await using slot = await limiter.hold("exports", { key: tenant });
 * if (slot === null) return tooBusy();
 * await runExport(); // the slot is released after this, even if it throws
 * ```
 *
 * A release at the block's end that fails (the store down) is not thrown: it would hide
 * what the block did, and the slots are free at `expiresAt` anyway. Call `release()` to
 * know.
 */
export class Held {
  /** The concurrency limit's name. */
  readonly name: string;
  /** The key the slots were acquired with. */
  readonly key: string | undefined;
  /** The ticket that holds them (see `acquire`). */
  readonly ticket: string;
  readonly #holder: Holder;
  #expiresAt: number;
  #released = false;

  /** Made by `hold`, from an acquire's answer. */
  constructor(holder: Holder, name: string, key: string | undefined, ticket: string, expiresAt: number) {
    this.#holder = holder;
    this.name = name;
    this.key = key;
    this.ticket = ticket;
    this.#expiresAt = expiresAt;
  }

  /** When the slots are free again unless renewed: ms since the Unix epoch, on the store's
   *  clock (moved by each `renew`). */
  get expiresAt(): number {
    return this.#expiresAt;
  }

  /** Whether `release()` has let the slots go (or found them expired already). */
  get released(): boolean {
    return this.#released;
  }

  /**
   * Holds the slots for `ttl` more from now (default the limit's): true, or false when the
   * ticket had expired or was released (its slots may be someone else's by then: stop the
   * work, or acquire again).
   */
  async renew(options?: { ttl?: Duration }): Promise<boolean> {
    if (this.#released) return false;
    checkOptions("renew", options);
    const renewed = await this.#holder.renew(this.name, this.ticket, { key: this.key, ttl: options?.ttl });
    if (renewed.ok) this.#expiresAt = renewed.expiresAt;
    return renewed.ok;
  }

  /**
   * Lets the slots go: true, or false when they had expired already, or were released by
   * an earlier call (which then sends nothing). Rejects with a `TollgateError` when the
   * store cannot say; the slots are then free at `expiresAt`.
   */
  async release(): Promise<boolean> {
    if (this.#released) return false;
    const released = await this.#holder.release(this.name, this.ticket, { key: this.key });
    this.#released = true;
    return released;
  }

  /** `release()` at the end of an `await using` block; a failure is not thrown (see
   *  above). */
  async [Symbol.asyncDispose](): Promise<void> {
    await this.release().catch(() => false);
  }
}

const DEFAULT_TIMEOUT_MS = 10_000;
// A timer's delay past 2^31 - 1 ms fires at once: a day is far below it, and far above any
// call's need.
const MAX_TIMEOUT_MS = 86_400_000;
const DEFAULT_MAX_ANSWER_BYTES = 8 * 1024 * 1024;
// At most this much of an answer that is not the API's is quoted in an error.
const SNIPPET = 200;

/** What `useRateLimit` (tollgate-client/react) reads from: this client, or your own backend. */
export interface RateLimitSource {
  getValue(name: string, options?: ValueOptions & { config?: RateLimitConfig }): Promise<RateLimitValue>;
  getServerTime(): Promise<number>;
}

/**
 * A client of a tollgate server. `limits` names configs in code, which travel with each call;
 * names the server's config file defines need none (declare them with `tollgate types`).
 *
 * ```ts
 * const limiter = new RateLimiter({ url: "http://127.0.0.1:8787" }, {
 *   sendMessage: { kind: "token bucket", rate: 10, period: MINUTE, capacity: 3 },
 * });
 * const { ok, retryAfter } = await limiter.limit("sendMessage", { key: userId });
 * ```
 */
export class RateLimiter<Limits extends Record<string, RateLimitConfig> = {}> {
  readonly #url: string;
  readonly #headers: Record<string, string>;
  readonly #timeoutMs: number;
  readonly #maxAnswerBytes: number;
  readonly #send: Send;
  readonly #limits: Partial<Record<string, RateLimitConfig>>;
  #closed = false;

  constructor(options: ClientOptions | DoorOptions, limits?: Limits) {
    // Without a prototype: a limit named `__proto__` or `constructor` is looked up as any
    // other, and a name that is not one finds nothing.
    this.#limits = Object.assign(Object.create(null) as Partial<Record<string, RateLimitConfig>>, limits);
    this.#headers = {};
    this.#timeoutMs = DEFAULT_TIMEOUT_MS;
    this.#maxAnswerBytes = DEFAULT_MAX_ANSWER_BYTES;
    if (typeof (options as Partial<DoorOptions> | undefined)?.door === "function") {
      // Paths go to the door as they are; it answers within its own store deadline.
      const door = (options as DoorOptions).door;
      this.#url = "";
      this.#send = (method, path, _headers, body) => door(method, path, body);
      return;
    }
    const url = (options as { url?: unknown } | undefined)?.url;
    if (typeof url !== "string" || !/^https?:\/\//.test(url)) {
      throw new TypeError(`url must be an http:// or https:// URL; got ${String(url)}`);
    }
    options = options as ClientOptions;
    this.#url = options.url.replace(/\/+$/, "");
    this.#headers["content-type"] = "application/json";
    if (options.token !== undefined) {
      this.#headers.authorization = `Bearer ${options.token}`;
    }
    const timeout = options.timeoutMs === undefined ? DEFAULT_TIMEOUT_MS : durationMs(options.timeoutMs, "timeoutMs");
    if (!(timeout > 0 && timeout <= MAX_TIMEOUT_MS)) {
      throw new TypeError(`timeoutMs must be more than 0 and at most a day; got ${String(options.timeoutMs)}`);
    }
    this.#timeoutMs = timeout;
    const max = options.maxAnswerBytes ?? DEFAULT_MAX_ANSWER_BYTES;
    if (!Number.isSafeInteger(max) || max <= 0) {
      throw new TypeError(`maxAnswerBytes must be a positive integer; got ${String(max)}`);
    }
    this.#maxAnswerBytes = max;
    this.#send = options.fetch
      ? fetchSend(options.fetch)
      : onNode()
        ? nodeSend()
        : fetchSend(globalThis.fetch.bind(globalThis));
  }

  /**
   * Closes the limiter: its idle connections to the server are closed, and every call made
   * after this rejects with a `TollgateError` (nothing sent, nothing taken). Calls under way
   * finish.
   */
  async close(): Promise<void> {
    this.#closed = true;
    this.#send.close?.();
  }

  /** Takes `count` tokens (default 1) from `name`'s limit for `key`. */
  async limit<Name extends string>(
    name: Name,
    ...[options]: Args<Limits, Name, LimitOptions>
  ): Promise<RateLimitResult> {
    return this.#take("/v1/limit", name, options);
  }

  /** Whether `limit` would grant, taking nothing. */
  async check<Name extends string>(
    name: Name,
    ...[options]: Args<Limits, Name, LimitOptions>
  ): Promise<RateLimitResult> {
    return this.#take("/v1/check", name, options);
  }

  /**
   * Settles a cost known only after the work (SPEC §4): `count`, signed, is what the work
   * used beyond (+) or below (-) what was taken for it. Never refused: a debt leaves a
   * negative value (the next requests wait for it), and a give-back never raises the limit
   * above its capacity. The pattern: `limit` an estimate, do the work, `adjust` by the
   * difference.
   */
  async adjust<Name extends string>(
    name: Name,
    options: AdjustOptions & ConfigFor<Limits, Name>,
  ): Promise<AdjustResult> {
    checkName("adjust", name);
    checkOptions("adjust", options);
    checkKey("adjust", options?.key);
    const count = options?.count;
    checkCount("adjust", count);
    if (count === undefined) throw new TypeError("adjust: count must be a finite number; got undefined");
    const body = { name, key: options.key, count, config: options.config ?? this.#limits[name] };
    return this.#post("/v1/adjust", body, true, adjustedOf);
  }

  /** Forgets every shard's state of (`name`, `key`): the next request starts full. */
  async reset<Name extends string>(
    name: Name,
    ...[options]: Args<Limits, Name, { key?: string }>
  ): Promise<void> {
    checkName("reset", name);
    checkOptions("reset", options);
    checkKey("reset", options?.key);
    await this.#post("/v1/reset", { name, key: options?.key }, true, (answer) => {
      if (!isObject(answer)) throw new WrongShape("not an object");
    });
  }

  /** The limit's stored state and full config, to evaluate it locally (`calculateRateLimit`). */
  async getValue<Name extends string>(
    name: Name,
    ...[options]: Args<Limits, Name, ValueOptions>
  ): Promise<RateLimitValue> {
    checkName("getValue", name);
    checkOptions("getValue", options);
    checkKey("getValue", options?.key);
    const body = {
      name,
      key: options?.key,
      sampleShards: options?.sampleShards,
      config: options?.config ?? this.#limits[name],
    };
    return this.#post("/v1/value", body, false, valueOf);
  }

  /**
   * Takes `count` slots (default 1) of the concurrency limit `name` for `key` (SPEC §6f),
   * which the server defines (`kind = "concurrency"`). Granted: a `ticket` that holds them
   * until `release`, or until `expiresAt` (now + `ttl`, on the store's clock), which `renew`
   * moves. Refused (nothing taken): the wait until the earliest holder's expiry. A `count`
   * above the limit's `max` is a `TollgateError` (400): it could never be granted.
   *
   * ```ts
   * const slot = await limiter.acquire("exports", { key: tenant });
   * if (!slot.ok) return retryIn(slot.retryAfter);
   * try {
   *   await runExport();
   * } finally {
   *   await limiter.release("exports", slot.ticket, { key: tenant });
   * }
   * ```
   */
  async acquire(name: string, options?: AcquireOptions): Promise<AcquireResult> {
    const body = acquireBody("acquire", name, options);
    return this.#post("/v1/acquire", body, true, acquiredOf);
  }

  /**
   * `acquire`, as slots held by a `Held` that `await using` releases at the end of its block
   * (however the block ends); `null` when refused (with `throws`, a `RateLimitError`).
   *
   * ```ts
   * await using slot = await limiter.hold("exports", { key: tenant });
   * if (slot === null) return tooBusy();
   * await runExport();
   * ```
   */
  async hold(name: string, options?: AcquireOptions): Promise<Held | null> {
    const body = acquireBody("hold", name, options);
    const acquired = await this.#post("/v1/acquire", body, true, acquiredOf);
    if (!acquired.ok) return null;
    return new Held(this, name, body.key, acquired.ticket, acquired.expiresAt);
  }

  /**
   * Lets a ticket's slots go: true, or false for a ticket unknown, released already or
   * expired (never an error: a release may race its expiry). `key`: the one it was acquired
   * with.
   */
  async release(name: string, ticket: string, options?: ReleaseOptions): Promise<boolean> {
    checkName("release", name);
    checkTicket("release", ticket);
    checkOptions("release", options);
    checkKey("release", options?.key);
    const body = { name, key: options?.key, ticket };
    return this.#post("/v1/release", body, true, (answer) => {
      if (!isObject(answer) || typeof answer.released !== "boolean") throw new WrongShape("not a release's answer");
      return answer.released;
    });
  }

  /**
   * Holds a ticket's slots for `ttl` more from now (default the limit's), for a long task:
   * the new expiry, or `ok: false` when the ticket had expired (its slots may be someone
   * else's by then: stop the work, or acquire again).
   */
  async renew(name: string, ticket: string, options?: RenewOptions): Promise<RenewResult> {
    checkName("renew", name);
    checkTicket("renew", ticket);
    checkOptions("renew", options);
    checkKey("renew", options?.key);
    const body = { name, key: options?.key, ticket, ttl: ttlOf("renew", options?.ttl) };
    return this.#post("/v1/renew", body, true, renewedOf);
  }

  /** A concurrency limit's slots for `key`: those held, its `max`, and the tickets holding
   *  them. (`check` says whether an acquire would be granted, `reset` frees every slot.) */
  async getSlotsValue(name: string, options?: { key?: string }): Promise<SlotsValue> {
    checkName("getSlotsValue", name);
    checkOptions("getSlotsValue", options);
    checkKey("getSlotsValue", options?.key);
    return this.#post("/v1/value", { name, key: options?.key }, false, slotsValueOf);
  }

  /** The server's clock, in ms since the Unix epoch. */
  async getServerTime(): Promise<number> {
    return this.#request("GET", "/v1/time", undefined, false, (answer) => {
      if (!isObject(answer) || !isNumber(answer.now)) throw new WrongShape("no time");
      return answer.now;
    });
  }

  /** The limits the server defines (its config file), with their configs. */
  async getServerLimits(): Promise<Record<string, RateLimitConfig>> {
    return this.#request("GET", "/v1/config", undefined, false, (answer) => {
      if (!isObject(answer) || !Object.values(answer).every(isObject)) {
        throw new WrongShape("not the limits");
      }
      return answer as Record<string, RateLimitConfig>;
    });
  }

  /** Takes from several limits all or nothing: if any refuses, none is taken. */
  async transaction<Name extends LimitName<Limits> | (string & {})>(
    requests: ReadonlyArray<TransactionRequest<Name>>,
    options?: TransactionOptions,
  ): Promise<TransactionResult> {
    checkTransaction(requests);
    const limits = requests.map((r) => ({
      name: r.name,
      key: r.key,
      count: r.count,
      reserve: r.reserve,
      config: r.config ?? this.#limits[r.name],
    }));
    return this.#post("/v1/transaction", { limits }, true, (answer, fields) => {
      const overall = decisionOf(answer);
      const results = (answer as { results?: unknown }).results;
      if (!Array.isArray(results) || results.length !== limits.length) {
        throw new WrongShape(`not one result per request (${limits.length})`);
      }
      const result: TransactionResult = { ...overall, results: results.map(transactionResultOf) };
      const { ticket, expiresAt } = answer as { ticket?: unknown; expiresAt?: unknown };
      if (ticket !== undefined) {
        if (typeof ticket !== "string" || !isNumber(expiresAt)) throw new WrongShape("not a transaction: its ticket is not one");
        result.ticket = ticket;
        result.expiresAt = expiresAt;
      }
      if (options?.fields) result.fields = { ...fields };
      return result;
    });
  }

  async #take(
    path: string,
    name: string,
    options: (LimitOptions & { config?: RateLimitConfig }) | undefined,
  ): Promise<RateLimitResult> {
    checkTake(path === "/v1/limit" ? "limit" : "check", name, options);
    const body = {
      name,
      key: options?.key,
      count: options?.count,
      reserve: options?.reserve,
      throws: options?.throws,
      config: options?.config ?? this.#limits[name],
    };
    return this.#post(path, body, path === "/v1/limit", decisionOf);
  }

  #post<T>(
    path: string,
    body: object,
    writes: boolean,
    read: (answer: unknown, fields?: Record<string, string>) => T,
  ): Promise<T> {
    return this.#request("POST", path, JSON.stringify(body), writes, read);
  }

  /**
   * Sends a request and reads its answer: a 200 with `read`, which returns the result or
   * throws a `WrongShape`; anything else as an error.
   * `writes`: whether the call may take tokens (for `mayHaveTaken`).
   */
  async #request<T>(
    method: string,
    path: string,
    body: string | undefined,
    writes: boolean,
    read: (answer: unknown, fields?: Record<string, string>) => T,
  ): Promise<T> {
    const url = this.#url + path;
    if (this.#closed) throw new TollgateError(`the limiter is closed; ${method} ${path} was not sent`, undefined, false);
    let response: Reply;
    try {
      response = await this.#send(method, url, this.#headers, body, this.#timeoutMs, this.#maxAnswerBytes);
    } catch (e) {
      // A write that went out may have been applied, unless an answer says it was refused.
      const sent = !(e instanceof NoAnswer) || e.sent;
      const status = e instanceof NoAnswer ? e.status : undefined;
      throw new TollgateError((e as Error).message, status, writes && sent && !refused(status));
    }
    const { status, text } = response;
    // An answer that is not the API's says nothing of what a write did, unless its status
    // says the request was refused.
    const unexpected = (what: string, answer?: unknown) =>
      new TollgateError(
        `unexpected answer from ${path}: ${what}: ${snippet(text)}`,
        status,
        writes && !refused(status),
        answer,
      );
    let answer: unknown;
    try {
      answer = JSON.parse(text);
    } catch {
      throw status === 200 ? unexpected("not JSON") : httpError(status, text, writes, text);
    }
    if (status === 200) {
      try {
        return read(answer, response.fields);
      } catch (e) {
        throw e instanceof WrongShape ? unexpected(e.what, answer) : e;
      }
    }
    throw answerError(status, text, answer, writes);
  }
}

/**
 * The error of an answer whose status is not 200, `answer` its parsed JSON body: a
 * `RateLimitError` for a refusal with `throws`, a `TollgateError` otherwise (`writes`: whether
 * the request could take tokens). Exported for the `tollgate` package, whose in-process
 * calls read the engine's answers as this client reads the server's.
 */
export function answerError(status: number, text: string, answer: unknown, writes: boolean): Error {
  if (status === 429 && isObject(answer) && answer.kind === "RateLimited") {
    const { name, retryAfter } = answer;
    if (typeof name === "string" && isWait(retryAfter)) {
      return new RateLimitError(name, retryAfter);
    }
  }
  if (isObject(answer) && typeof answer.error === "string") {
    // The server's own error: nothing taken unless it says otherwise.
    return new TollgateError(answer.error, status, answer.mayHaveTaken === true, answer);
  }
  return httpError(status, text, writes, answer);
}

/** What is wrong with a 200 answer's shape: thrown by the readers below. */
class WrongShape {
  constructor(readonly what: string) {}
}

/** An error status whose body is not tollgate's: a proxy's, a wrong address's. */
function httpError(status: number, text: string, writes: boolean, body: unknown): TollgateError {
  return new TollgateError(`HTTP ${status}: ${snippet(text)}`, status, writes && !refused(status), body);
}

/** Whether `status` says the request was refused (4xx): then nothing was taken. */
function refused(status: number | undefined): boolean {
  return status !== undefined && status >= 400 && status < 500;
}

function snippet(text: string): string {
  const start = text.slice(0, SNIPPET).trim();
  return start === "" ? "(empty body)" : start;
}

function isObject(x: unknown): x is Record<string, unknown> {
  return typeof x === "object" && x !== null && !Array.isArray(x);
}

/** A JSON number (finite: JSON.parse reads 1e999 as Infinity). */
function isNumber(x: unknown): x is number {
  return typeof x === "number" && Number.isFinite(x);
}

/** A `retryAfter`: milliseconds, finite and not negative. */
function isWait(x: unknown): x is number {
  return isNumber(x) && x >= 0;
}

/** The answer of `limit` and `check` (and each of a transaction's): `ok`, and `retryAfter`
 *  if the server sent one. */
function decisionOf(answer: unknown): RateLimitResult {
  if (!isObject(answer) || typeof answer.ok !== "boolean") throw new WrongShape("not a decision");
  if (!("retryAfter" in answer)) return { ok: answer.ok };
  if (!isWait(answer.retryAfter)) throw new WrongShape("not a decision: retryAfter is not a wait");
  return { ok: answer.ok, retryAfter: answer.retryAfter };
}

/** A result of a transaction's answer: a decision, with a concurrency limit's ticket and
 *  its expiry when it carries them (dropped, it would hold the slots until their ttl). */
function transactionResultOf(answer: unknown): TransactionLimitResult {
  const decision: TransactionLimitResult = decisionOf(answer);
  const { ticket, expiresAt } = answer as Record<string, unknown>;
  if (ticket === undefined) return decision;
  if (typeof ticket !== "string" || !/^\d+$/.test(ticket) || !isTime(expiresAt)) {
    throw new WrongShape("not a transaction's answer: a ticket without its expiry");
  }
  decision.ticket = ticket;
  decision.expiresAt = expiresAt;
  return decision;
}

function adjustedOf(answer: unknown): AdjustResult {
  if (!isObject(answer) || !isNumber(answer.value)) throw new WrongShape("not an adjust's answer");
  if (!("retryAfter" in answer)) return { value: answer.value };
  if (!isWait(answer.retryAfter)) throw new WrongShape("not an adjust's answer: retryAfter is not a wait");
  return { value: answer.value, retryAfter: answer.retryAfter };
}

function valueOf(answer: unknown): RateLimitValue {
  if (!isObject(answer)) throw new WrongShape("not a value");
  const { value, ts, shard, config } = answer;
  if (!isNumber(value) || !isNumber(ts) || !Number.isSafeInteger(shard) || (shard as number) < 0) {
    throw new WrongShape("not a value");
  }
  if (!isObject(config)) throw new WrongShape("not a value: no config");
  return { value, ts, shard: shard as number, config: config as unknown as RateLimitValue["config"] };
}

/** The body of an acquire (`call`: `acquire` or `hold`), its arguments checked. */
function acquireBody(call: "acquire" | "hold", name: string, options: AcquireOptions | undefined) {
  checkName(call, name);
  checkOptions(call, options);
  checkKey(call, options?.key);
  checkCount(call, options?.count);
  checkFlag(call, "throws", options?.throws);
  return { name, key: options?.key, count: options?.count, ttl: ttlOf(call, options?.ttl), throws: options?.throws };
}

/** A time on the store's clock: ms since the Unix epoch, never negative. */
function isTime(x: unknown): x is number {
  return isNumber(x) && x >= 0;
}

/** A count of slots or holders: a whole number, never negative. */
function isTally(x: unknown): x is number {
  return Number.isSafeInteger(x) && (x as number) >= 0;
}

function acquiredOf(answer: unknown): AcquireResult {
  if (!isObject(answer) || typeof answer.ok !== "boolean") throw new WrongShape("not an acquire's answer");
  if (answer.ok) {
    const { ticket, expiresAt } = answer;
    if (typeof ticket !== "string" || !/^\d+$/.test(ticket) || !isTime(expiresAt)) {
      throw new WrongShape("not an acquire's answer: no ticket and expiry");
    }
    return { ok: true, ticket, expiresAt };
  }
  if (!isWait(answer.retryAfter)) throw new WrongShape("not an acquire's answer: retryAfter is not a wait");
  return { ok: false, retryAfter: answer.retryAfter };
}

function renewedOf(answer: unknown): RenewResult {
  if (!isObject(answer) || typeof answer.ok !== "boolean") throw new WrongShape("not a renew's answer");
  if (!answer.ok) return { ok: false };
  if (!isTime(answer.expiresAt)) throw new WrongShape("not a renew's answer: no expiry");
  return { ok: true, expiresAt: answer.expiresAt };
}

function slotsValueOf(answer: unknown): SlotsValue {
  if (!isObject(answer)) throw new WrongShape("not a concurrency limit's value");
  const { inFlight, max, holders } = answer;
  if (!isTally(inFlight) || !isTally(max) || !isTally(holders)) {
    throw new WrongShape("not a concurrency limit's value (a rate limit's? read it with getValue)");
  }
  return { inFlight, max, holders };
}
