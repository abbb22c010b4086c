// tollgate for Node: the API of tollgate-client with tollgate's Rust engine inside this process
// (`{ store }`), or a tollgate server's (`{ url }`). One class, two doors: the calls, their
// answers and their errors are the same, because in-process calls go through the client's own
// code with the engine as its door (SPEC §6e).

import {
  RateLimiter as Client,
  RateLimitError,
  answerError,
  checkName,
  checkTake,
  plainTake,
  type Args,
  type ClientOptions,
  type ConcurrencyConfig,
  type Door,
  type Duration,
  type LimitOptions,
  type RateLimitConfig,
  type RateLimitResult,
  type TransactionResult,
} from "tollgate-client";

import {
  type Decision,
  type LimitStatus,
  type Taking,
  concurrencyInLimits,
  concurrencyOf,
  decisionOfAnswer,
  policyOf,
  taking,
} from "./middleware.js";
import { addon, type NativeLimiter, type NativeTake, type NativeTakeAll } from "./native.js";

export * from "tollgate-client";

/** A leased limit's tuning (SPEC §6's `lease`); `true` takes the defaults. */
export interface LeaseOptions {
  /** How long a lease is held before it is given back: milliseconds, or a duration such as
   *  `"2s"`; default 2,000 (ms). */
  term?: Duration;
  /** The most of the capacity one lease may take, more than 0 and at most 1. */
  share?: number;
  /** The part of the capacity left unleased for the others, from 0 to 1. */
  floor?: number;
  /** Takes of one key within a term, in this process, before the key is leased (default
   *  16; 1 leases every key from its first take): cold keys are taken as unleased. */
  hotAfter?: number;
}

/** Where an in-process limiter keeps its states, and how it treats them. */
export interface StoreOptions {
  /**
   * A store URL (SPEC §6): `memory`, `sqlite://PATH` (`?synchronous=full` for every write on
   * disk), `redis://HOST:PORT/DB`, `redis+cluster://HOST:PORT,HOST:PORT`,
   * `redis+sentinel://HOST:PORT,…/MASTER` (each `rediss…` over TLS) or
   * `postgres://USER@HOST/DB`.
   */
  store: string;
  /** How long a call may wait for Redis or PostgreSQL (or SQLite's write lock) before it
   *  fails with a `TollgateError`: milliseconds, or a duration such as `"250ms"`; default 250
   *  (ms). */
  storeDeadline?: Duration;
  /** The memory store: the most live states. At the bound, full states are swept first; a
   *  request that needs a new state past it fails with a `TollgateError` (nothing is evicted,
   *  which would reset a limit). */
  maxKeys?: number;
  /** Limits served from leases (Redis and PostgreSQL): a hot key's tokens taken in batches
   *  per process, within the limit's bound over every process. */
  leases?: Record<string, boolean | LeaseOptions>;
  /** Limits granted while the store fails (fail open); the others fail closed. */
  failOpen?: string[];
}

/** `object`'s own property `key`: an option is never read from a prototype (an option of
 *  Object.prototype's, set by other code, is not the caller's). */
function own<T extends object, K extends keyof T>(object: T, key: K): T[K] | undefined {
  return Object.hasOwn(object, key) ? object[key] : undefined;
}

/** A map without a prototype: a name such as `__proto__` or `constructor` is a name like
 *  any other in it, and an assignment to it never reaches Object.prototype. */
function table<V>(): Record<string, V> {
  return Object.create(null) as Record<string, V>;
}

/** The limits of an in-process limiter, by name: rate limits and concurrency limits. */
export type LimitsOf = Record<string, RateLimitConfig | ConcurrencyConfig>;

/** The rate limits among `Limits`: the names `limit`, `check`, `transaction` and the
 *  middleware take (a concurrency limit's slots are taken with `acquire` and `hold`). */
export type RateLimitsOf<Limits> = {
  [Name in keyof Limits as Limits[Name] extends ConcurrencyConfig ? never : Name]: Extract<Limits[Name], RateLimitConfig>;
};

/** The concurrency limits among `Limits`: the names `acquire`, `hold` and the middleware's
 *  `concurrency` take. */
export type ConcurrencyLimitsOf<Limits> = {
  [Name in keyof Limits as Limits[Name] extends ConcurrencyConfig ? Name : never]: Limits[Name];
};

/** The rate limits of `limits`, for a server's limiter (which sends them with its calls). */
function rateLimitsOf<Limits extends LimitsOf>(limits: Limits | undefined): RateLimitsOf<Limits> | undefined {
  if (limits === undefined) return undefined;
  const rates = table<RateLimitConfig>();
  for (const [name, config] of Object.entries(limits)) {
    if ((config as { kind?: unknown }).kind !== "concurrency") rates[name] = config as RateLimitConfig;
  }
  return rates as RateLimitsOf<Limits>;
}

/** A limiter's settings as a config file's: `{ server, limits }` as JSON. */
function configJson(options: StoreOptions, limits: LimitsOf | undefined): string {
  const store = own(options, "store");
  if (typeof store !== "string") {
    throw new TypeError(`store must be a store URL such as "memory"; got ${String(store)}`);
  }
  const server = table<unknown>();
  server.store = store;
  const storeDeadline = own(options, "storeDeadline");
  if (storeDeadline !== undefined) server.storeDeadline = storeDeadline;
  const maxKeys = own(options, "maxKeys");
  if (maxKeys !== undefined) server.maxKeys = maxKeys;
  const tables = table<Record<string, unknown>>();
  for (const [name, config] of Object.entries(limits ?? {})) tables[name] = Object.assign(table(), config);
  const known = (what: string, name: unknown) => {
    if (typeof name !== "string" || !Object.hasOwn(tables, name)) {
      throw new TypeError(`${what} names ${JSON.stringify(name)}, which is not among the limits`);
    }
    return tables[name]!;
  };
  const leases = own(options, "leases");
  if (leases !== undefined && (typeof leases !== "object" || leases === null || Array.isArray(leases))) {
    throw new TypeError(`leases must be an object of limit names; got ${String(leases)}`);
  }
  for (const [name, lease] of Object.entries(leases ?? {})) {
    const limit = known("leases", name);
    // false (or undefined): not leased, as a flag reads; an object: its tuning.
    if (lease === false || lease === undefined) continue;
    if (lease !== true && (typeof lease !== "object" || lease === null || Array.isArray(lease))) {
      throw new TypeError(`leases.${name} must be true, false or { term, share, floor, hotAfter }; got ${String(lease)}`);
    }
    limit.lease = lease === true ? true : Object.assign(table(), lease);
  }
  const failOpen = own(options, "failOpen");
  if (failOpen !== undefined && !Array.isArray(failOpen)) {
    throw new TypeError(`failOpen must be an array of limit names; got ${String(failOpen)}`);
  }
  for (const name of failOpen ?? []) known("failOpen", name).failOpen = true;
  return JSON.stringify({ server, limits: tables });
}

/** The addon's check of a config, thrown as the client throws a bad option: a TypeError. */
function validated(config: string): string {
  try {
    addon().validate(config);
  } catch (e) {
    throw new TypeError((e as Error).message);
  }
  return config;
}

const OPS: Record<string, string> = {
  "/v1/limit": "limit",
  "/v1/check": "check",
  "/v1/transaction": "transaction",
  "/v1/reset": "reset",
  "/v1/value": "value",
  "/v1/adjust": "adjust",
  "/v1/acquire": "acquire",
  "/v1/release": "release",
  "/v1/renew": "renew",
};

type Reply = { status: number; text: string; fields?: Record<string, string> };

/** An answer's string (see native.ts) as the client's reply. */
function reply(answer: string): Reply {
  const status = Number(answer.slice(0, 3));
  const end = answer.indexOf("\n", 3);
  if (end < 0) return { status, text: answer.slice(3) };
  const fields: Record<string, string> = {};
  const parts = answer.slice(end + 1).split("\n");
  for (let i = 0; i + 1 < parts.length; i += 2) fields[parts[i]!] = parts[i + 1]!;
  return { status, text: answer.slice(3, end), fields };
}

/** The engine of this process, once it is open (or why it could not be), and the `take`s
 *  waiting for their answers. */
interface Engine {
  /** The config it opens (JSON). */
  config: string;
  /** The last open, under way or done. */
  opening: Promise<NativeLimiter>;
  ready?: NativeLimiter;
  /** The take functions of the limits called so far (of defined names only), by name. */
  takers: Map<string, NativeTake>;
  /** Why the last open failed, and when (ms since the epoch); unset while one is under way. */
  failed?: { message: string; at: number };
  /** Set by `close`: an open that ends later does not make the direct path live again. */
  closed?: boolean;
  /** Resolvers of the `take`s whose answers come back through the settler, by id. */
  waiting: Map<number, (answer: number | string | number[]) => void>;
  nextId: number;
  /** Holds the event loop open, and the engine alive, while answers are awaited (the
   *  settler does neither). */
  hold?: ReturnType<typeof setInterval>;
}

/** Takes the answers of the take functions that waited: one function for the limiter,
 *  called on the event loop with each [id, answer]. It holds its engine weakly: the addon
 *  holds it, and a strong hold would keep the engine, its native limiter and the store
 *  alive for as long as the process runs, each limiter ever made. While answers are
 *  awaited, the engine is held by its timer (`hold`). */
function settler(engine: Engine): (settled: [number, number | string | number[]]) => void {
  const weak = new WeakRef(engine);
  return ([id, answer]) => {
    const engine = weak.deref();
    if (engine === undefined) return;
    const resolve = engine.waiting.get(id);
    engine.waiting.delete(id);
    if (engine.waiting.size === 0 && engine.hold !== undefined) {
      clearInterval(engine.hold);
      engine.hold = undefined;
    }
    resolve?.(answer);
  };
}

/**
 * The least time between two opens of a store that failed to open. A store that was not
 * reachable at first (a database not created yet, a SQLite directory not made yet; Redis and
 * PostgreSQL that are down open at once and connect later) is opened again by a call that
 * comes this long after the last failure: the calls meanwhile fail at once with its reason,
 * so that a flood of calls during an outage makes one attempt a second, not one per call.
 */
const REOPEN_AFTER_MS = 1_000;

/** Opens `engine`'s store, again if it failed before; the calls wait for this open. */
function open(engine: Engine): Promise<NativeLimiter> {
  const opening = addon().open(engine.config);
  engine.opening = opening;
  engine.failed = undefined;
  // Each call reports a failure to open; none is left unhandled.
  opening.then(
    (limiter) => {
      limiter.settleWith(settler(engine));
      if (!engine.closed) engine.ready = limiter;
    },
    (e: Error) => (engine.failed = { message: e.message, at: Date.now() }),
  );
  return opening;
}

/** The engine of this process as the client's door: each path to its operation. */
function doorOf(engine: Engine): Door {
  const answer = (l: NativeLimiter, method: string, path: string, body: string | undefined): Promise<Reply> => {
    if (method === "GET" && path === "/v1/time") return l.time().then(reply);
    if (method === "GET" && path === "/v1/config") return Promise.resolve(reply(l.config()));
    const op = OPS[path];
    if (op === undefined) {
      return Promise.resolve({ status: 404, text: JSON.stringify({ error: `no such operation ${path}` }) });
    }
    // Answered now when no I/O was needed (the memory store, a lease's take): under the
    // promise, without a turn of the event loop.
    const answered = l.run(op, body ?? "");
    return typeof answered === "string" ? Promise.resolve(reply(answered)) : answered.then(reply);
  };
  return async (method, path, body) => {
    if (engine.ready) return answer(engine.ready, method, path, body);
    const failed = engine.failed;
    const opening = failed !== undefined && Date.now() - failed.at >= REOPEN_AFTER_MS ? open(engine) : engine.opening;
    try {
      return answer(await opening, method, path, body);
    } catch (e) {
      // The store could not be opened: nothing was taken, as when the server's store fails.
      return {
        status: 503,
        text: JSON.stringify({ error: `the store could not be opened: ${(e as Error).message}`, mayHaveTaken: false }),
      };
    }
  };
}

const engines = new WeakMap<object, Engine>();

/**
 * `limit` or `check` (`writes`) of a limit defined at open, without the JSON of the general
 * path: the calls made most. Undefined when the general path must answer (the engine not
 * open yet, a config in the call, an argument the addon does not take as it is).
 */
function take(
  engine: Engine | undefined,
  name: string,
  options: (LimitOptions & { config?: RateLimitConfig }) | undefined,
  writes: boolean,
): Promise<RateLimitResult> | undefined {
  const ready = engine?.ready;
  if (ready === undefined || options?.config !== undefined) return undefined;
  // The general path's checks, made here as there (typeofs, for the calls that pass them): a
  // TypeError, nothing taken.
  if (!plainTake(options)) {
    try {
      checkTake(writes ? "limit" : "check", name, options);
    } catch (e) {
      return Promise.reject(e);
    }
  }
  const reserve = options?.reserve;
  const throws = options?.throws;
  let native = engine!.takers.get(name);
  if (native === undefined) {
    // The name, checked once: only a name that passes has a function here.
    try {
      checkName(writes ? "limit" : "check", name);
    } catch (e) {
      return Promise.reject(e);
    }
    try {
      const made = ready.taker(name);
      // A name not defined: the general path says so.
      if (made === null) return undefined;
      engine!.takers.set(name, (native = made));
    } catch {
      // The addon could not make it: the general path says why.
      return undefined;
    }
  }
  let answered: number | string | null;
  const id = engine!.nextId;
  engine!.nextId = (id + 1) % 4_294_967_296;
  const key = options?.key;
  const count = options?.count;
  const flags = (key === undefined ? 0 : 1) | (count === undefined ? 0 : 2) | (reserve === true ? 4 : 0) | (writes ? 8 : 0);
  try {
    answered = native(key ?? "", count ?? 0, flags, id);
  } catch {
    // Refused by the addon before any work: the general path says why.
    return undefined;
  }
  if (answered === null) return settled(engine!, id).then((r) => result(r as number | string, name, throws === true, writes));
  try {
    return Promise.resolve(result(answered, name, throws === true, writes));
  } catch (e) {
    return Promise.reject(e);
  }
}

/** The answer of the take function call `id` that waits, when it comes to the settler. */
function settled(engine: Engine, id: number): Promise<number | string | number[]> {
  // The timer holds the event loop open and the engine alive until the answers are in.
  engine.hold ??= setInterval(() => engine, 2 ** 30);
  return new Promise((resolve) => engine.waiting.set(id, resolve));
}

/** The error of an answer's string that is not a decision (see native.ts). */
function failure(answer: string, writes: boolean): never {
  const { status, text } = reply(answer);
  throw answerError(status, text, JSON.parse(text), writes);
}

/** What `take`'s answer `r` says (see native.ts), as the client's result or error. */
function result(r: number | string, name: string, throws: boolean, writes: boolean): RateLimitResult {
  if (typeof r === "string") failure(r, writes);
  if (r === -1) return { ok: true };
  if (r >= 0) return { ok: true, retryAfter: r };
  const retryAfter = -2 - r;
  if (throws) throw new RateLimitError(name, retryAfter);
  return { ok: false, retryAfter };
}

/**
 * A middleware's `Taking` of `limits` on `engine`: through the addon's function for them
 * (`NativeTakeAll`), no JSON; through the limiter's transaction (`general`) while the engine
 * is not open, and for a key the addon does not take as it is (the transaction says why).
 * Throws a TypeError now for a limit the limiter does not define, and for a concurrency limit
 * (its slot, taken with the limits, would never be released: it is `concurrency`'s).
 */
function limitsTaking(
  engine: Engine,
  limits: ReadonlyArray<{ name: string; count?: number }>,
  general: (key: string | undefined) => Promise<TransactionResult>,
): Taking {
  const names = limits.map((l) => l.name);
  const defined = (JSON.parse(engine.config) as { limits: Record<string, { kind?: unknown }> }).limits;
  // Taken by the transaction, a concurrency limit's slot would be acquired per request and
  // never released (the middleware has no ticket to release): refused here instead.
  const slots = names.find((n) => Object.hasOwn(defined, n) && defined[n]!.kind === "concurrency");
  if (slots !== undefined) {
    throw new TypeError(concurrencyInLimits(slots));
  }
  const found = addon().policies(engine.config, names);
  const missing = found.findIndex((p) => p === null);
  if (missing >= 0) {
    const known = Object.keys(defined);
    throw new TypeError(
      `limits: ${JSON.stringify(names[missing])} is not a limit of the limiter; it has ${known.length === 0 ? "none" : known.map((n) => JSON.stringify(n)).join(", ")} (a limit is defined by new RateLimiter(store, { name: config }))`,
    );
  }
  const policies = new Map(found.map((p, i) => [names[i]!, policyOf(p!.member, p!.capacity)]));
  const capacities = found.map((p) => p!.capacity);
  // w of the policy member, in ms.
  const windows = found.map((p) => Number(p!.member.slice(p!.member.lastIndexOf(";w=") + 3)) * 1_000);
  const counts = limits.map((l) => l.count ?? null);
  // In an ArrayBuffer of its own (a small typed array may start in V8's heap, where its
  // numbers would move): the addon writes the numbers here.
  const out = new Float64Array(new ArrayBuffer(8 * (2 + 3 * limits.length)));
  // Where the addon writes the time of the numbers (see native.ts).
  const atIndex = 1 + 3 * limits.length;
  let native: NativeTakeAll | null | undefined;
  const decisionOf = (n: ArrayLike<number>): Decision => {
    const statuses = new Array<LimitStatus>(names.length);
    let refusing = -1;
    let longest = 0;
    for (let i = 0; i < names.length; i++) {
      // A refusal is -2 - its wait (see native.ts); the longest names the answer.
      const d = n[1 + 3 * i]!;
      if (d <= -2 && (refusing < 0 || -2 - d > longest)) {
        refusing = i;
        longest = -2 - d;
      }
      statuses[i] = { name: names[i]!, limit: capacities[i]!, remaining: n[2 + 3 * i]!, resetAfter: n[3 + 3 * i]!, window: windows[i]! };
    }
    const at = n[atIndex]!;
    if (n[0]! > -2) return { ok: true, retryAfter: 0, limits: statuses, at };
    return { ok: false, retryAfter: longest, limits: statuses, refusedBy: names[Math.max(refusing, 0)]!, at };
  };
  const capacityOf = new Map(names.map((n, i) => [n, capacities[i]!]));
  const slow = (key: string | undefined) => general(key).then((r) => decisionOfAnswer(r, limits, policies, capacityOf));
  const take = (key: string | undefined): Decision | Promise<Decision> => {
    const ready = engine.ready;
    if (ready === undefined) return slow(key);
    if (native === undefined) {
      try {
        native = ready.limitsTaker(names, counts, out);
      } catch {
        native = null;
      }
    }
    if (native === null) return slow(key);
    const id = engine.nextId;
    engine.nextId = (id + 1) % 4_294_967_296;
    let answered: number | string | null;
    try {
      answered = native(key ?? "", key === undefined ? 0 : 1, id);
    } catch {
      // Refused by the addon before any work: the general path says why.
      return slow(key);
    }
    if (answered === 0) return decisionOf(out);
    if (typeof answered === "string") failure(answered, true);
    return settled(engine, id).then((r) => (typeof r === "string" ? failure(r, true) : decisionOf(r as number[])));
  };
  return { take, policies };
}

/**
 * A rate limiter: in this process on a store (`{ store: "redis://127.0.0.1:6379" }`, or the
 * URL alone), or a tollgate server's (`{ url: "http://127.0.0.1:8787" }`). `limits` names
 * configs, checked by the compiler at every call: rate limits, and concurrency limits
 * (`{ kind: "concurrency", max, ttl? }`, whose slots `acquire` and `hold` take).
 *
 * ```ts
 * const limiter = new RateLimiter({ store: "memory" }, {
 *   sendMessage: { kind: "token bucket", rate: 10, period: MINUTE, capacity: 3 },
 *   exports: { kind: "concurrency", max: 4, ttl: "2m" },
 * });
 * const { ok, retryAfter } = await limiter.limit("sendMessage", { key: userId });
 * await using slot = await limiter.hold("exports", { key: userId });
 * ```
 *
 * A bad store URL or limit throws a `TypeError` here; a store that cannot be reached fails
 * each call with a `TollgateError` (`mayHaveTaken: false`) until it can, and is used from then
 * on (one that failed to open is opened again, once a second at most).
 */
export class RateLimiter<Limits extends LimitsOf = {}> extends Client<RateLimitsOf<Limits>> {
  constructor(options: string | StoreOptions | ClientOptions, limits?: Limits) {
    if (typeof options === "object" && options !== null && "url" in options) {
      // A server defines its concurrency limits: a call never carries one's config.
      super(options, rateLimitsOf(limits));
      return;
    }
    const store = typeof options === "string" ? { store: options } : options;
    const config = validated(configJson(store, limits));
    const engine = { config, takers: new Map(), waiting: new Map(), nextId: 0 } as Omit<Engine, "opening"> as Engine;
    open(engine);
    // The limits are defined in the engine: calls carry no config of their own.
    super({ door: doorOf(engine) }, undefined);
    engines.set(this, engine);
  }

  // Callers see the signatures the compiler checks (a rest parameter of the names' options);
  // the implementations take the options as a plain parameter: a rest array, destructured,
  // was made at every call.
  override limit<Name extends string>(
    name: Name,
    ...options: Args<RateLimitsOf<Limits>, Name, LimitOptions>
  ): Promise<RateLimitResult>;
  override limit(name: string, options?: LimitOptions): Promise<RateLimitResult> {
    return (
      take(engines.get(this), name, options, true) ??
      super.limit(name, ...([options] as Args<RateLimitsOf<Limits>, string, LimitOptions>))
    );
  }

  /** A middleware's way to take its limits in this process (ts/middleware.ts), without
   *  JSON; undefined for a server's limiter, whose middleware takes them by transaction.
   *  Throws a TypeError for a limit not defined here. */
  [taking](limits: ReadonlyArray<{ name: string; count?: number }>): Taking | undefined {
    const engine = engines.get(this);
    if (engine === undefined) return undefined;
    const general = (key: string | undefined) =>
      this.transaction(
        limits.map((l) => (key === undefined ? l : { ...l, key })),
        { fields: true },
      );
    return limitsTaking(engine, limits, general);
  }

  /** The `max` of the concurrency limit `name`, for a middleware's `concurrency` (checked
   *  when it is made); undefined for a server's limiter, whose middleware checks it when the
   *  server's limits are read. Throws a TypeError when this limiter has no concurrency limit
   *  of that name. */
  [concurrencyOf](name: string): { max: number } | undefined {
    const engine = engines.get(this);
    if (engine === undefined) return undefined;
    const limits = (JSON.parse(engine.config) as { limits: Record<string, { kind?: unknown; max?: unknown }> }).limits;
    const config = Object.hasOwn(limits, name) ? limits[name] : undefined;
    if (config?.kind === "concurrency") return { max: config.max as number };
    const names = Object.keys(limits).filter((n) => limits[n]!.kind === "concurrency");
    throw new TypeError(
      `concurrency: ${JSON.stringify(name)} is ${config === undefined ? "not a limit of the limiter" : "a rate limit (give it in limits)"}; its concurrency limits are ${names.length === 0 ? "none" : names.map((n) => JSON.stringify(n)).join(", ")} (defined by new RateLimiter(store, { name: { kind: "concurrency", max } }))`,
    );
  }

  override check<Name extends string>(
    name: Name,
    ...options: Args<RateLimitsOf<Limits>, Name, LimitOptions>
  ): Promise<RateLimitResult>;
  override check(name: string, options?: LimitOptions): Promise<RateLimitResult> {
    return (
      take(engines.get(this), name, options, false) ??
      super.check(name, ...([options] as Args<RateLimitsOf<Limits>, string, LimitOptions>))
    );
  }

  /** Closes the limiter: every call made after this rejects with a `TollgateError` (nothing
   *  taken, no lease taken again), and the leases this process holds are given back (their
   *  unused tokens return to the store for other processes); call it before the process
   *  exits. A server's limiter closes its idle connections. */
  override async close(): Promise<void> {
    // Refused from now on, by the client's own check (the direct path is the engine's
    // `ready`: without it every call goes the client's way).
    await super.close();
    const engine = engines.get(this);
    if (engine === undefined) return;
    engine.closed = true;
    engine.ready = undefined;
    const limiter = await engine.opening.catch(() => undefined);
    await limiter?.close();
  }
}
