// The checks of a call's arguments, made once for every call and every door (a server over
// HTTP, the `tollgate` package's engine in the process, and its direct path): a value that
// JSON cannot carry as it is (NaN, Infinity and null would arrive as null, a lone surrogate as
// an escape the server refuses while the addon made it U+FFFD) or that is not of its
// argument's type is a TypeError, thrown before anything is sent or taken. What a value
// means (a negative count, a name not defined, a bad config) is the engine's to say, in the
// same words through every door: a TollgateError with status 400 or 404.

import { parseDuration } from "./algebra.js";

/** The calls whose arguments are checked here, as their messages name them. */
export type Call =
  | "limit"
  | "check"
  | "transaction"
  | "adjust"
  | "reset"
  | "getValue"
  | "acquire"
  | "hold"
  | "release"
  | "renew"
  | "getSlotsValue";

const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;

/** Whether `text` has no lone surrogate (a half of a UTF-16 pair, which UTF-8 cannot hold):
 *  the platform's own scan where it has one (Node 20, browsers since 2023). */
const wellFormed: (text: string) => boolean =
  typeof (String.prototype as { isWellFormed?: unknown }).isWellFormed === "function"
    ? (text) => (text as unknown as { isWellFormed(): boolean }).isWellFormed()
    : (text) => !LONE_SURROGATE.test(text);

function shown(value: unknown): string {
  return typeof value === "string" ? `the string ${JSON.stringify(value)}` : String(value);
}

/** A limit's name: a string of whole characters. */
export function checkName(call: Call, name: unknown): void {
  if (typeof name !== "string" || !wellFormed(name)) {
    throw new TypeError(`${call}: the limit's name must be a string (without lone surrogates); got ${shown(name)}`);
  }
}

/** A key: absent, or a string of whole characters (null is not "no key": leave it out). */
export function checkKey(call: Call, key: unknown): void {
  if (key !== undefined && (typeof key !== "string" || !wellFormed(key))) {
    throw new TypeError(
      `${call}: key must be a string (without lone surrogates), or left out for the one shared value; got ${shown(key)}`,
    );
  }
}

/** A count: absent, or a finite number (its sign and size are the engine's to judge). */
export function checkCount(call: Call, count: unknown): void {
  if (count !== undefined && (typeof count !== "number" || !Number.isFinite(count))) {
    throw new TypeError(`${call}: count must be a finite number, or left out for 1; got ${shown(count)}`);
  }
}

/** A ticket: the string an acquire answered (its digits are the engine's to judge). */
export function checkTicket(call: Call, ticket: unknown): void {
  if (typeof ticket !== "string") {
    throw new TypeError(`${call}: ticket must be the string an acquire answered; got ${shown(ticket)}`);
  }
}

/** A flag (`reserve`, `throws`): absent, or a boolean. */
export function checkFlag(call: Call, what: string, value: unknown): void {
  if (value !== undefined && typeof value !== "boolean") {
    throw new TypeError(`${call}: ${what} must be true or false; got ${shown(value)}`);
  }
}

function checkConfig(call: Call, config: unknown): void {
  if (config !== undefined && (typeof config !== "object" || config === null || Array.isArray(config))) {
    throw new TypeError(`${call}: config must be a limit's config object; got ${shown(config)}`);
  }
}

/** A ttl: absent, or milliseconds (a finite number) or a duration such as `"2m"`; in ms. */
export function ttlOf(call: Call, ttl: unknown): number | undefined {
  if (ttl === undefined) return undefined;
  const ms = typeof ttl === "string" ? parseDuration(ttl) : ttl;
  if (typeof ms !== "number" || !Number.isFinite(ms)) {
    throw new TypeError(
      `${call}: ttl must be milliseconds (a finite number) or a duration such as "30s" or "2m", or left out for the limit's; got ${shown(ttl)}`,
    );
  }
  return ms;
}

/** An options argument: absent, or an object (`limit("api", userId)` is a mistake: the key
 *  goes in `{ key }`). */
export function checkOptions(call: Call, options: unknown): void {
  if (options !== undefined && (typeof options !== "object" || options === null || Array.isArray(options))) {
    const hint = typeof options === "string" ? ` (a key goes in the options: ${call}(name, { key }))` : "";
    throw new TypeError(`${call}: the options must be an object; got ${shown(options)}${hint}`);
  }
}

/** The options of a take, as they may come (anything, from JavaScript). */
type TakeOptions = { key?: unknown; count?: unknown; reserve?: unknown; throws?: unknown; config?: unknown } | undefined;

/**
 * Whether `options` of a take without a config are of `checkTake`'s types: typeofs only,
 * small enough to inline, for the `tollgate` package's direct path (its hottest call), which
 * calls `checkTake` for the error when this says no. A key's characters are not looked at
 * (a scan per call cost a tenth of that call): the addon refuses a lone surrogate as it reads
 * the key, and the call then goes the general path, whose `checkTake` says why. The name is
 * checked there once per name, when its function is made.
 */
export function plainTake(options: TakeOptions): boolean {
  if (options === undefined) return true;
  if (typeof options !== "object" || options === null || Array.isArray(options)) return false;
  const { key, count, reserve, throws } = options;
  return (
    (key === undefined || typeof key === "string") &&
    (count === undefined || (typeof count === "number" && Number.isFinite(count))) &&
    (reserve === undefined || typeof reserve === "boolean") &&
    (throws === undefined || typeof throws === "boolean")
  );
}

/** The arguments of `limit` and `check` (and each request of a transaction: `call`). */
export function checkTake(call: Call, name: unknown, options: TakeOptions): void {
  checkName(call, name);
  checkOptions(call, options);
  if (options === undefined) return;
  checkKey(call, options.key);
  checkCount(call, options.count);
  checkFlag(call, "reserve", options.reserve);
  checkFlag(call, "throws", options.throws);
  checkConfig(call, options.config);
}

/** The requests of a transaction: an array of `{ name, key, count, reserve, config }`. */
export function checkTransaction(requests: unknown): void {
  if (!Array.isArray(requests)) {
    throw new TypeError(`transaction: the requests must be an array of { name, key, count }; got ${shown(requests)}`);
  }
  for (const request of requests) {
    if (typeof request !== "object" || request === null) {
      throw new TypeError(`transaction: each request must be an object { name, key, count }; got ${shown(request)}`);
    }
    checkTake("transaction", (request as { name?: unknown }).name, request as Record<string, unknown>);
  }
}
