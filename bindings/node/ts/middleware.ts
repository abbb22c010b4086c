// What every framework's middleware decides, whatever the framework: the request's key, its
// limits taken all or nothing, and the answer's status, header fields and body. By default
// as tollgate's tower layer writes them (crates/tollgate/src/tower): `RateLimit-Policy` and
// `RateLimit` on every answer, `429` with `Retry-After` in whole seconds and
// `{"kind": "RateLimited", "name", "retryAfter"}` on a refusal, `503 {"error": "rate limit
// store unavailable", "mayHaveTaken"}` when the store fails (fail closed; the store's message
// goes to `onStoreError`, never to the client), `400 {"error"}` without a key; and, as the
// options of express-rate-limit 8, @fastify/rate-limit 11 and hono-rate-limiter say under
// their names, otherwise (ts/headers.ts writes the header sets). Every option is checked and
// resolved once, when the middleware is made (`middleware`), its limits included: an
// in-process limiter takes them through a function of the addon made for the middleware (no
// JSON), a server's through its transaction. A request pays for its key, the take and the
// answer's fields. A concurrency limit (`concurrency`) is acquired before the limits are
// taken, and released once, when the response is over however it ends (`slotted`).

import {
  TollgateError,
  ttlOf,
  type Duration,
  type LimitName,
  type RateLimiter as Client,
  type RateLimitConfig,
  type TransactionOptions,
  type TransactionRequest,
  type TransactionResult,
} from "tollgate-client";

import {
  draft6Headers,
  draft7Headers,
  draft8Headers,
  legacyHeaders,
  seconds,
  sfString,
  type StandardHeaders,
} from "./headers.js";
import type { ConcurrencyLimitsOf, RateLimiter, RateLimitsOf } from "./index.js";
import { ipKey, ipv6SubnetOf } from "./ip.js";

export { ipKey } from "./ip.js";
export type { StandardHeaders } from "./headers.js";

/** One limit's numbers in a middleware's decision (ms where a time). */
export interface LimitStatus {
  /** The limit's name. */
  name: string;
  /** Its capacity: the most tokens it holds (a fixed window's rate). */
  limit: number;
  /** The tokens it has left (after this request, if it was admitted): the `r` of its
   *  `RateLimit` member. NaN when not known (granted because the store failed and the limit
   *  fails open); over a server, whole tokens. */
  remaining: number;
  /** The ms until it is full again: the `t` of its `RateLimit` member. NaN when not known;
   *  over a server, whole seconds. */
  resetAfter: number;
  /** Its window: the `w` of its `RateLimit-Policy` member, in ms. */
  window: number;
}

/** A middleware's decision, whatever the door. */
export interface Decision {
  /** Whether every limit admitted the request (then all were taken, else none). */
  ok: boolean;
  /** When refused, the ms until the limit that refused it longest admits it; else 0. */
  retryAfter: number;
  /** The limits' numbers, in the middleware's order (over a server, those its header fields
   *  list: the 8 tightest of more). */
  limits: LimitStatus[];
  /** When refused, the name of the limit that refused it longest (the one a 429 names). */
  refusedBy?: string;
  /** When its numbers were read, ms since the Unix epoch: `resetAfter` counts from then (in
   *  process the addon's clock, over a server when the answer came). */
  at: number;
}

/** How a middleware takes its limits for a request's key (`undefined`: no key, the
 *  `"global"` key's), made once per middleware by its limiter's door. */
export type Take = (key: string | undefined) => Decision | Promise<Decision>;

/** A limit's IETF header fields: its `RateLimit-Policy` member (`"name";q=10;w=60`), its
 *  name as the fields quote it, and its capacity (which ranks how tight it is). */
export interface Policy {
  member: string;
  quoted: string;
  capacity: number;
}

/** What a limiter's door makes for one middleware: its take, and the policy of each limit
 *  by name (a server's come with its answers). */
export interface Taking {
  take: Take;
  policies: Map<string, Policy>;
}

/** The method of an in-process limiter (ts/index.ts) that makes a middleware's `Taking` for
 *  its limits, or throws a TypeError naming a limit it does not define. */
export const taking: unique symbol = Symbol("tollgate.taking");

/** The method of an in-process limiter (ts/index.ts) that answers its concurrency limit
 *  `name`'s `max`, or throws a TypeError when it has no concurrency limit of that name. */
export const concurrencyOf: unique symbol = Symbol("tollgate.concurrencyOf");

/** What the middleware needs of a limiter: in-process (`{ store }`) or a server's (`{ url }`). */
export interface Transacting {
  transaction(requests: ReadonlyArray<TransactionRequest<string>>, options?: TransactionOptions): Promise<TransactionResult>;
  /** A server's limits, to check the middleware's names against. */
  getServerLimits?(): Promise<Record<string, RateLimitConfig>>;
  [taking]?(limits: ReadonlyArray<{ name: string; count?: number }>): Taking | undefined;
  /** Gives tokens back (a negative count), for `skipFailedRequests` and `skipSuccessfulRequests`. */
  adjust(name: string, options: { key?: string; count: number }): Promise<unknown>;
  /** Takes a concurrency limit's slots, for `concurrency`. */
  acquire?(name: string, options: { key?: string; count?: number; ttl?: Duration }): Promise<
    { ok: true; ticket: string } | { ok: false; retryAfter: number }
  >;
  /** Lets a ticket's slots go, for `concurrency`. */
  release?(name: string, ticket: string, options?: { key?: string }): Promise<boolean>;
  [concurrencyOf]?(name: string): { max: number } | undefined;
}

/** The names a middleware of `limiter` may take: those its type knows (its rate limits, and
 *  a server's from `tollgate types`), or any name if its type knows none. */
export type NameOf<Limiter> = Limiter extends RateLimiter<infer Limits>
  ? NamesIn<RateLimitsOf<Limits>>
  : Limiter extends Client<infer Limits>
    ? NamesIn<Limits>
    : string;

/** The names of `Limits` (with a server's), or any name if there are none. */
type NamesIn<Limits> = [LimitName<Limits>] extends [never] ? string : LimitName<Limits>;

/** The names a middleware of `limiter` may acquire slots of: an in-process limiter's
 *  concurrency limits (none if its type knows only rate limits), or any name if its type
 *  knows no limits (a server's concurrency limits are not in its type). */
export type ConcurrencyNameOf<Limiter> = Limiter extends RateLimiter<infer Limits>
  ? [keyof Limits] extends [never]
    ? string
    : keyof ConcurrencyLimitsOf<Limits> & string
  : string;

/**
 * The concurrency limit a request holds a slot of while it is answered: its name, or its name
 * and what an acquire takes: `count` slots (default 1) for `ttl` (default the limit's), after
 * which a slot of a request still running is free again (set it above the longest response).
 */
export type ConcurrencyRef<Name extends string = string> = Name | { name: Name; count?: number; ttl?: Duration };

/** One limit a request takes from: its name, or its name and how many tokens. */
export type LimitRef<Name extends string = string> = Name | { name: Name; count?: number };

/**
 * Where a request's key comes from: `"ip"` (the peer's address as the framework reports it,
 * an IPv6 address grouped by its /56: see `ipv6Subnet`; behind a proxy, tell the framework to
 * trust it), `{ header: "x-api-key" }`, `"global"` (one value shared by every request), or a
 * function of the request. A request without a key (none, or a function's `undefined`, `null`
 * or `""`) is refused with 400, and nothing is taken; a function's key of another type is a
 * `TypeError`, passed to the framework as an error.
 */
export type KeySource<Req> =
  | "ip"
  | "global"
  | { header: string }
  | ((request: Req) => string | null | undefined | Promise<string | null | undefined>);

/**
 * What a handler sees of the decision (`req.rateLimit` in Express and Fastify,
 * `c.get("rateLimit")` in Hono), as express-rate-limit's `req.rateLimit`: the numbers of the
 * limit that binds (the one that refused, or the one with the fewest tokens left), and each
 * limit's in `limits`.
 */
export interface RateLimitInfo {
  /** The limit's quota in its window (the `q` of `RateLimit-Policy`). */
  limit: number;
  /** `limit - remaining`: what is taken in the window (a refusal takes nothing). */
  used: number;
  /** Tokens left, rounded down. */
  remaining: number;
  /** When the limit is full again, counted from when its tokens were taken. On the object the
   *  middleware sets this is a getter that makes the `Date` at its first read (the same one
   *  at each read after): `JSON.stringify` and `util.inspect` show it, a copy by spread or
   *  `Object.assign` does not have it (copy it by name). */
  resetTime: Date;
  /** The request's key; undefined for `key: "global"`. */
  key: string | undefined;
  /** Every limit of the middleware, in the order given (over a server, of more than 8 the
   *  8 tightest, as its header fields list them). */
  limits: LimitStatus[];
}

/** The options every middleware takes; `Res` is what a framework hands beside the request
 *  (Express's response, Fastify's reply). */
export interface MiddlewareOptions<Req, Limiter extends Transacting = Transacting, Res = never> {
  /** The limiter the limits are taken from. */
  limiter: Limiter;
  /** One limit or several, taken all or nothing: if one refuses, none is taken. A name the
   *  limiter's type does not know does not compile. May be left out when `concurrency` is
   *  given (then no RateLimit field is written and no `rateLimit` is set on the request).
   *  Rate limits only: a concurrency limit's slot, taken here, would be held per request and
   *  never released, so one named here is an error. In process it throws a TypeError when
   *  the middleware is made; over a server it is said once in the log when the server's
   *  limits are read, and each request is answered 500 (a slot a transaction acquired
   *  before that, or after a reload made the name a concurrency limit, is released at
   *  once). Give it as `concurrency`. */
  limits?: LimitRef<NameOf<Limiter>> | Array<LimitRef<NameOf<Limiter>>>;
  /**
   * A concurrency limit (`kind: "concurrency"`): a slot of it is acquired for the request's
   * key (the `key` of the limits) before its handler runs, and released once when its
   * response is over, however it ends: sent, the handler's error answered, an answer sent
   * early or by a timeout, the client gone first. In Express and Fastify that is Node's
   * `finish` or `close` of the response (work a handler does after its client left is not
   * counted); in Hono, when the handlers' `next()` returns or throws (a body streamed after
   * that is not counted). Refused, the request is answered `concurrencyStatusCode` with
   * `Retry-After` and tollgate's body (`{"kind": "RateLimited", "name", "retryAfter"}`, or
   * `message`'s; a framework's `handler` answers the limits' refusals only, whose numbers it
   * is given), and nothing is taken of the limits. Granted, the limits are taken after; if
   * they refuse (or their store fails), the slot is released before the answer is written.
   * A store that fails the acquire is answered as for the limits (503, or `passOnStoreError`:
   * the request passes untouched, limits included).
   *
   * One limit, named as the limits are (a name the limiter's type does not know does not
   * compile): the name alone, or `{ name, count, ttl }` as `acquire` takes them. One, not a
   * list: slots of several limits are not yet acquired all or nothing; stack a middleware
   * per limit. The option is named for the limits' `kind`, as `limits` is for theirs.
   */
  concurrency?: ConcurrencyRef<ConcurrencyNameOf<Limiter>>;
  /** The status of a refusal by `concurrency`; default 429 (too many of this client's
   *  requests at once, as the server's acquire refuses), or 503 where being busy is the
   *  service's state rather than the client's doing. */
  concurrencyStatusCode?: number;
  /** Where the key comes from; default `"ip"`. */
  key?: KeySource<Req>;
  /**
   * The `"ip"` key's grouping of IPv6 peers: the prefix length (1 to 128) of the network that
   * is keyed as one, or `false` (or 128) to key each address whole; default 56, so that one host
   * hopping between the addresses of its network (a /64 at least) is one key. The key is the
   * network's first address and its length, `"2001:db8:abcd:1200::/56"`; an IPv4 peer (an
   * IPv4-mapped IPv6 address included) is keyed by its address, `"192.0.2.1"`.
   */
  ipv6Subnet?: number | false;
  /**
   * Told each failure of the store that made a request's answer a 503 (or, with
   * `passOnStoreError`, let it pass), and each release of a `concurrency` slot that failed
   * (the slot is free at its ttl), with the request: the store's own message (which may
   * name its host, user or database) goes here, never into the answer's body. Default:
   * `console.warn`, at most one line per 10 seconds for all the middleware of the process
   * (the line counts those left out), so an outage never floods the log. Give your logger's
   * function instead (`(error, req) => req.log.warn(error)`).
   */
  onStoreError?: (error: Error, request: Req) => void;
  /** A request for which this is true passes untouched: nothing taken, no header field
   *  written (health checks, an allow-list). */
  skip?: (request: Req, response: Res) => boolean | Promise<boolean>;
  /** The status of a refusal; default 429. */
  statusCode?: number;
  /**
   * The body of a refusal instead of `{"kind": "RateLimited", "name", "retryAfter"}`: a string
   * (sent as it is), an object (sent as JSON), or a function of the request that returns one.
   */
  message?: unknown;
  /** The property of the request (Hono: the context's variable) that holds the decision
   *  (`RateLimitInfo`); default `"rateLimit"`. */
  requestPropertyName?: string;
  /**
   * Which RateLimit header fields to write: `"ietf"` (default: tollgate's, one member per
   * limit), or `"draft-6"`, `"draft-7"`, `"draft-8"` as express-rate-limit writes them; `true`
   * is `"draft-6"` and `false` none, as express-rate-limit reads them.
   */
  standardHeaders?: StandardHeaders | boolean;
  /** The names of the limits in draft 8's fields; default each limit's name. */
  identifier?: string | ((request: Req) => string);
  /** Also write `X-RateLimit-Limit`, `X-RateLimit-Remaining` and `X-RateLimit-Reset` (seconds
   *  since the Unix epoch); default false. */
  legacyHeaders?: boolean;
  /** When the store fails, let the request pass (told to `onStoreError`) instead of
   *  answering 503; default false. */
  passOnStoreError?: boolean;
  /** Give the request's tokens back when its response fails (status 400 or more, or the
   *  connection closed first): only successes count. Default false. */
  skipFailedRequests?: boolean;
  /** Give the request's tokens back when its response succeeds: only failures count.
   *  Default false. */
  skipSuccessfulRequests?: boolean;
  /** Whether a response succeeded, for the two options above; default: status below 400. */
  requestWasSuccessful?: (request: Req, response: Res) => boolean | Promise<boolean>;
}

/** What the middleware answers: pass on (with `headers` on the answer), or answer itself. */
export interface Verdict {
  /** Whether the request goes on to its handler. */
  pass: boolean;
  /** The refusal's status (429 unless `statusCode`), or 503, 400, 500 when it does not pass. */
  status: number;
  /** Header fields to set. */
  headers: Record<string, string>;
  /** The JSON body of the middleware's own answer. */
  body?: string;
  /** The decision, for handlers (set on the request under `requestPropertyName`); absent when
   *  no limit was taken (skipped, no key, a store that failed). */
  info?: RateLimitInfo;
  /** Whether it is a refusal by the limits (a custom `handler` or `message` answers it). */
  limited?: boolean;
  /** With `skipFailedRequests` or `skipSuccessfulRequests`, on a pass: to be called once the
   *  response is over, with whether it succeeded. */
  settle?: (successful: boolean) => void;
  /** With `concurrency`, on a pass: lets the request's slot go, to be called once the
   *  response is over (`releaseWhenOver`), or at once if the framework will not answer it.
   *  A second call does nothing. */
  release?: () => void;
  /** Whether it is a refusal by `concurrency` (a framework's `handler` does not answer it). */
  busy?: boolean;
}

/** The view of a request each framework gives: its peer address, a header by name, and, when
 *  the address is the connection's own (no proxy's header is trusted), the connection (read
 *  only when the address is missing). */
export interface RequestView {
  ip: string | undefined;
  header(name: string): string | undefined;
  socket?: unknown;
}

/** What a framework tells the middleware of itself: how its users make it read a client's
 *  address from a proxy's X-Forwarded-For (for the message of a unix socket), and the
 *  options of its own (checked with the others for a misspelled name). */
export interface Framework {
  trustProxy: string;
  options?: readonly string[];
}

/** A request's key: a string, `GLOBAL` for the one shared value, anything else if the
 *  request has none. */
type Key = unknown;

/** The key of `"global"`: no key in the transaction (a key function's null is no key). */
const GLOBAL = Symbol("global");

/** A middleware's options, checked and resolved: what each request needs, and nothing more. */
export interface Middleware<Req, Res = never> {
  limiter: Transacting;
  limits: Array<{ name: string; count?: number }>;
  /** What the errors of the middleware name it by: its first limit, `Rate limit NAME`, or
   *  its concurrency limit, `Concurrency limit NAME`. */
  label: string;
  /** The concurrency limit a request holds a slot of, if any (`concurrency`). */
  slots?: Slots;
  /** Takes the limits for a key. */
  take: Take;
  /** The limits' policies, by name, for the IETF fields. */
  policies: Map<string, Policy>;
  /** What each limit takes of a request (its count, default 1), by name. */
  countOf: Map<string, number>;
  key(request: Req, view: RequestView): Key | Promise<Key>;
  /** The 400 answer's body for a request without a key. */
  noKey: string;
  onStoreError(error: Error, request: Req): void;
  /** For the "ip" key: what to do with a request that came through a unix socket, where no
   *  request has a peer address (undefined for the other keys). */
  unixSocket?: (socket: unknown) => Verdict | undefined;
  skip?: (request: Req, response: Res) => boolean | Promise<boolean>;
  /** Fastify's `allowList`: whether a request passes untouched, by its key. */
  allow?: (request: Req, key: string | undefined) => boolean | Promise<boolean>;
  statusCode: number;
  /** The refusal's body, if not tollgate's own: what `message` gives for the request. */
  message?: (request: Req) => unknown;
  requestPropertyName: string;
  /** The header fields of a decision whose numbers are known, `binding` the index of its
   *  binding limit (`bindingOf`): a writer made for the options' header sets when the
   *  middleware is made (`headersOf`). */
  headers(decision: Decision, binding: number, key: string | undefined, request: Req): Record<string, string>;
  passOnStoreError: boolean;
  /** Which responses give their tokens back: failed ones, successful ones. */
  giveBack?: { failed: boolean; successful: boolean };
  /** Says (once) that the limiter does not define `name`; with `concurrency`, that `name`,
   *  in `limits`, is a concurrency limit of the limiter. */
  undefinedName(name: string, concurrency?: boolean): void;
}

/** A middleware's `concurrency`, checked: what each request acquires, and how a refusal is
 *  answered. */
export interface Slots {
  name: string;
  count: number | undefined;
  /** In ms; undefined for the limit's own. */
  ttl: number | undefined;
  /** `concurrencyStatusCode`. */
  status: number;
  /** Whether a refusal carries `Retry-After` (unless no header set is written). */
  retryAfter: boolean;
}

/** The options `middleware` reads; a name not among them (or a framework's own) is refused. */
const OPTIONS = [
  "limiter",
  "limits",
  "key",
  "ipv6Subnet",
  "onStoreError",
  "skip",
  "statusCode",
  "message",
  "requestPropertyName",
  "standardHeaders",
  "identifier",
  "legacyHeaders",
  "passOnStoreError",
  "skipFailedRequests",
  "skipSuccessfulRequests",
  "requestWasSuccessful",
  "concurrency",
  "concurrencyStatusCode",
];

/** The fix for an option of the middleware tollgate's replaces, given to tollgate's. */
const MOVED: Record<string, string> = {
  windowMs: "a limit's window is its config: define it in the RateLimiter's limits and name it in `limits`",
  max: "a limit's size is its config: define it in the RateLimiter's limits and name it in `limits`",
  limit: "did you mean `limits`? (a limit's size is its config in the RateLimiter's limits)",
  timeWindow: "a limit's window is its config: define it in the RateLimiter's limits and name it in `limits`",
  keyGenerator: "give the function as `key` (a function of the request)",
  store: "the store is the limiter's: `new RateLimiter({ store: URL }, limits)` given as `limiter`",
  headers: "`legacyHeaders` (X-RateLimit-*) and `standardHeaders` say which fields are written",
  skipOnError: "`passOnStoreError: true`",
  errorResponseBuilder: "`handler` (or `message` and `statusCode`)",
};

/** Checks `options` and resolves them for `decide`; throws a `TypeError` for a bad one,
 *  naming it and its fix. */
export function middleware<Req, Res = never>(
  options: MiddlewareOptions<Req, Transacting, Res>,
  framework: Framework,
): Middleware<Req, Res> {
  if (typeof options !== "object" || options === null) {
    throw new TypeError(`the rate limit middleware takes an object of options ({ limiter, limits }); got ${String(options)}`);
  }
  const known = new Set([...OPTIONS, ...(framework.options ?? [])]);
  for (const name of Object.keys(options)) {
    if (known.has(name)) continue;
    const fix = MOVED[name] ?? `the options are ${[...known].join(", ")}`;
    throw new TypeError(`rate limit middleware: no option ${JSON.stringify(name)}: ${fix}`);
  }
  const limiter = options.limiter as Partial<Transacting> | undefined;
  if (typeof limiter?.transaction !== "function") {
    throw new TypeError("limiter must be a RateLimiter (new RateLimiter({ store: \"memory\" }, limits), or { url } for a server)");
  }
  const given = slotsOf(options);
  // Left out only beside `concurrency` (slotsOf says so otherwise).
  const limits = options.limits === undefined ? [] : limitsOf(options.limits);
  const label = limits.length === 0 ? `Concurrency limit ${given!.name}` : `Rate limit ${limits[0]!.name}`;
  // In-process: the limiter checks the names now (a TypeError), and takes without JSON.
  const { take, policies } =
    limits.length === 0
      ? { take: nothingToTake, policies: new Map<string, Policy>() }
      : (options.limiter[taking]?.(limits) ?? transactionTaking(options.limiter, limits));
  const source = options.key ?? "ip";
  const subnet = ipv6SubnetOf(options.ipv6Subnet);
  let key: Middleware<Req>["key"];
  if (source === "ip") {
    key = (_request, view) => (view.ip === undefined ? undefined : ipKey(view.ip, subnet));
  } else if (source === "global") {
    key = () => GLOBAL;
  } else if (typeof source === "function") {
    // What it returns is checked per request (decide): null is "no key", never "global".
    key = (request) => source(request);
  } else if (typeof source === "object" && source !== null && typeof source.header === "string") {
    const header = source.header.toLowerCase();
    key = (_request, view) => view.header(header);
  } else {
    throw new TypeError(`key must be "ip", "global", { header: NAME } or a function of the request; got ${String(source)}`);
  }
  const what = source === "ip" ? "no peer address" : "no key in the request";
  const noKey = json({ error: `${label}: ${what}.` });
  const onStoreError = options.onStoreError ?? warn;
  if (typeof onStoreError !== "function") {
    throw new TypeError(`onStoreError must be a function of (error, request); got ${String(onStoreError)}`);
  }
  const unixSocket = source === "ip" ? unixSocketOf(label, framework) : undefined;
  const undefinedName = undefinedNameOf(options.limiter, limits, given);
  const skip = optionalFunction<Middleware<Req, Res>["skip"]>(options, "skip", "(request) => boolean, true for a request that passes untouched");
  const allow = allowOf((options as { allowList?: unknown }).allowList);
  optionalFunction(options, "requestWasSuccessful", "(request, response) => boolean");
  const statusCode = statusOf(options, "statusCode");
  const givenMessage = options.message;
  const message =
    givenMessage === undefined
      ? undefined
      : typeof givenMessage === "function"
        ? (givenMessage as (request: Req) => unknown)
        : () => givenMessage;
  const requestPropertyName = options.requestPropertyName ?? "rateLimit";
  if (typeof requestPropertyName !== "string" || requestPropertyName === "") {
    throw new TypeError(`requestPropertyName must be a property name such as "rateLimit"; got ${String(requestPropertyName)}`);
  }
  const passOnStoreError = flag(options, "passOnStoreError");
  const failed = flag(options, "skipFailedRequests");
  const successful = flag(options, "skipSuccessfulRequests");
  const headers = headersOf(options, limits, policies);
  // A refusal of the slot writes Retry-After as a refusal of the limits does: unless no
  // header set is written.
  const slots = given && { ...given, retryAfter: headers !== writesNone };
  return {
    limiter: options.limiter,
    limits,
    label,
    slots,
    take,
    policies,
    countOf: countsOf(limits),
    key,
    noKey,
    onStoreError,
    unixSocket,
    skip,
    allow,
    statusCode,
    message,
    requestPropertyName,
    headers,
    passOnStoreError,
    giveBack: failed || successful ? { failed, successful } : undefined,
    undefinedName,
  };
}

/**
 * A limit name the limiter does not define, as the app's misconfiguration rather than the
 * client's: said once in the log (`console.error`) with the names it defines and the fix, as
 * soon as the limiter's limits can be read (an in-process limiter's at once, a server's when
 * it answers), or at the first request that names it; such a request is answered 500. The
 * same for its concurrency limit (`slots`), with what else is wrong with it: a rate limit's
 * name, a `count` above its `max`; and for a concurrency limit named in `limits`, whose slot
 * a transaction would hold per request (in process, all three are refused when the
 * middleware is made).
 */
function undefinedNameOf(
  limiter: Transacting,
  limits: ReadonlyArray<{ name: string }>,
  slots: Pick<Slots, "name" | "count"> | undefined,
): (name?: string, concurrency?: boolean) => void {
  let said = false;
  let saidSlots = false;
  let saidMisplaced = false;
  const sayMisplaced = (name: string) => {
    if (saidMisplaced) return;
    saidMisplaced = true;
    console.error(
      `tollgate: the rate limit middleware takes ${JSON.stringify(name)} in limits, which is a concurrency limit of the limiter: ` +
        `its requests are answered 500 (taken with the limits, its slot would be held by each request and never released). ` +
        `Give it as concurrency (concurrency: ${JSON.stringify(name)}), not in limits.`,
    );
  };
  const saySlots = (problem: string) => {
    if (saidSlots) return;
    saidSlots = true;
    console.error(
      `tollgate: the middleware's concurrency limit ${JSON.stringify(slots!.name)} ${problem}, so every request it handles fails. ` +
        `Define it with kind "concurrency" in the limiter's limits (new RateLimiter(store, { NAME: { kind: "concurrency", max } })) ` +
        `or the server's config file, or fix concurrency.`,
    );
  };
  const say = (missing: string[], defined: string[] | undefined) => {
    if (said || missing.length === 0) return;
    said = true;
    const known = defined === undefined ? "" : ` (it defines ${defined.length === 0 ? "none" : defined.map((n) => JSON.stringify(n)).join(", ")})`;
    console.error(
      `tollgate: the rate limit middleware takes ${missing.map((n) => JSON.stringify(n)).join(", ")}, which the limiter does not define${known}: ` +
        `its requests are answered 500. Define it in the limiter's limits (new RateLimiter(store, { NAME: config })) or the server's config file, or fix the name in limits.`,
    );
  };
  const read = (limiter as { getServerLimits?: () => Promise<Record<string, unknown>> }).getServerLimits;
  if (typeof read === "function") {
    read.call(limiter).then(
      (defined) => {
        say(limits.map((l) => l.name).filter((n) => !Object.hasOwn(defined, n)), Object.keys(defined));
        const misplaced = limits.find((l) => isConcurrency(defined, l.name));
        if (misplaced !== undefined) sayMisplaced(misplaced.name);
        const problem = slots === undefined ? undefined : slotsProblem(slots, defined);
        if (problem !== undefined) saySlots(problem);
      },
      // Not readable now (a server not up yet, a store not open): the first request says it.
      () => {},
    );
  }
  return (name, concurrency) => {
    if (name !== undefined && concurrency === true) sayMisplaced(name);
    else if (name !== undefined && name === slots?.name) saySlots("is not defined by the limiter");
    else say(name === undefined ? [] : [name], undefined);
  };
}

/** Whether a limiter's limits (`GET /v1/config`) define `name` as a concurrency limit. */
function isConcurrency(defined: Record<string, unknown>, name: string): boolean {
  return Object.hasOwn(defined, name) && (defined[name] as { kind?: unknown }).kind === "concurrency";
}

/** What is wrong with `slots` by a limiter's limits (`GET /v1/config`), if anything. */
function slotsProblem(slots: Pick<Slots, "name" | "count">, defined: Record<string, unknown>): string | undefined {
  const config = Object.hasOwn(defined, slots.name) ? (defined[slots.name] as { kind?: unknown; max?: unknown }) : undefined;
  if (config?.kind === "concurrency") {
    return typeof config.max === "number" && (slots.count ?? 1) > config.max
      ? `takes ${String(slots.count)} slots, more than its max (${config.max})`
      : undefined;
  }
  const names = Object.keys(defined).filter((n) => (defined[n] as { kind?: unknown }).kind === "concurrency");
  const known = `its concurrency limits: ${names.length === 0 ? "none" : names.map((n) => JSON.stringify(n)).join(", ")}`;
  return `is ${config === undefined ? "not defined by the limiter" : "a rate limit, not a concurrency limit"} (${known})`;
}

/** Fastify's `allowList` (keys, or a function of the request and its key) as a function. */
function allowOf<Req>(allowList: unknown): Middleware<Req>["allow"] {
  if (allowList === undefined) return undefined;
  if (typeof allowList === "function") return allowList as Middleware<Req>["allow"];
  if (!Array.isArray(allowList) || !allowList.every((k) => typeof k === "string")) {
    throw new TypeError(`allowList must be an array of keys (such as IP addresses) or a function (request, key) => boolean; got ${String(allowList)}`);
  }
  const allowed = new Set<string>(allowList);
  return (_request, key) => key !== undefined && allowed.has(key);
}

/** A status option (`statusCode`, `concurrencyStatusCode`), 429 if not given. */
function statusOf(options: object, name: string): number {
  const status = (options as Record<string, unknown>)[name] ?? 429;
  if (!Number.isInteger(status) || (status as number) < 100 || (status as number) > 599) {
    throw new TypeError(`${name} must be an HTTP status (an integer from 100 to 599), such as 429; got ${String(status)}`);
  }
  return status as number;
}

/**
 * `concurrency` checked, or undefined if not given: its name, and the count and ttl of its
 * acquires. An in-process limiter checks now that it defines the limit, and that its `max`
 * admits `count`; a server's, when its limits are read (`undefinedNameOf`).
 */
function slotsOf<Req, Res>(options: MiddlewareOptions<Req, Transacting, Res>): Omit<Slots, "retryAfter"> | undefined {
  const given = options.concurrency;
  if (given === undefined) {
    if (options.concurrencyStatusCode !== undefined) {
      throw new TypeError("concurrencyStatusCode is the status of a refusal by concurrency: give concurrency too");
    }
    if (options.limits === undefined) {
      throw new TypeError("give limits (rate limits' names), concurrency (a concurrency limit's name), or both");
    }
    return undefined;
  }
  const { name, count, ttl }: Partial<Exclude<ConcurrencyRef, string>> = typeof given === "string" ? { name: given } : (given ?? {});
  if (typeof name !== "string" || name === "") {
    throw new TypeError(`concurrency must be a concurrency limit's name, or { name, count?, ttl? }; got ${String(given)}`);
  }
  if (count !== undefined && !(Number.isSafeInteger(count) && count >= 1)) {
    throw new TypeError(`concurrency: ${name}'s count must be a whole number of slots, at least 1; got ${String(count)}`);
  }
  let ms: number | undefined;
  try {
    ms = ttlOf("acquire", ttl);
  } catch (e) {
    throw new TypeError(`concurrency: ${name}'s ${(e as Error).message.replace(/^acquire: /, "")}`);
  }
  if (ms !== undefined && !(ms > 0)) throw new TypeError(`concurrency: ${name}'s ttl must be more than 0 ms; got ${String(ttl)}`);
  const limiter = options.limiter;
  if (typeof limiter.acquire !== "function" || typeof limiter.release !== "function") {
    throw new TypeError(
      "concurrency: the limiter has no acquire and release (a tollgate-client or tollgate package older than its concurrency limits)",
    );
  }
  const max = limiter[concurrencyOf]?.(name)?.max;
  if (max !== undefined && (count ?? 1) > max) {
    throw new TypeError(`concurrency: ${name}'s count is ${String(count)}, more than its max (${max}): no request could ever be admitted`);
  }
  return { name, count, ttl: ms, status: statusOf(options, "concurrencyStatusCode") };
}

/** The take of a middleware of no limits (`concurrency` alone): a pass, with no numbers. */
function nothingToTake(): Decision {
  return { ok: true, retryAfter: 0, limits: [], at: Date.now() };
}

/** A boolean option, false if not given. */
function flag(options: object, name: string): boolean {
  const value = (options as Record<string, unknown>)[name];
  if (value === undefined) return false;
  if (typeof value !== "boolean") throw new TypeError(`${name} must be true or false; got ${String(value)}`);
  return value;
}

/** A function option, or undefined if not given. */
function optionalFunction<F>(options: object, name: string, shape: string): F | undefined {
  const value = (options as Record<string, unknown>)[name];
  if (value === undefined) return undefined;
  if (typeof value !== "function") throw new TypeError(`${name} must be a function ${shape}; got ${String(value)}`);
  return value as F;
}

/**
 * The header sets `standardHeaders` and `legacyHeaders` ask for, as one writer of a
 * decision's fields, made for them once: `Retry-After` on a refusal whenever any set is
 * written. The usual options (the IETF fields of one limit, no legacy fields) get a writer of
 * their own, which makes the answer's fields in one object literal.
 */
function headersOf<Req>(
  options: MiddlewareOptions<Req, Transacting, never>,
  limits: ReadonlyArray<{ name: string; count?: number }>,
  policies: Map<string, Policy>,
): Middleware<Req>["headers"] {
  const given = options.standardHeaders ?? "ietf";
  const standard = given === true ? "draft-6" : given;
  if (standard !== false && !["ietf", "draft-6", "draft-7", "draft-8"].includes(standard)) {
    throw new TypeError(
      `standardHeaders must be "ietf" (tollgate's, the default), "draft-6", "draft-7", "draft-8", true ("draft-6") or false (none); got ${String(given)}`,
    );
  }
  const legacy = flag(options, "legacyHeaders");
  const names = limits.map((l) => sfString(l.name));
  const identifier = options.identifier;
  if (identifier !== undefined && typeof identifier !== "string" && typeof identifier !== "function") {
    throw new TypeError(`identifier must be a name (a string) or a function of the request; got ${String(identifier)}`);
  }
  if (identifier !== undefined && standard !== "draft-8") {
    throw new TypeError(`identifier names the limits in draft 8's fields: give it with standardHeaders: "draft-8"`);
  }
  if (standard === "ietf" && !legacy && limits.length === 1) return ietfOfOne(limits[0]!.name, policies);
  if (standard === false && !legacy) return writesNone;
  // One identifier for several limits: the second is `id-2`, and so on.
  const named = (id: string) => limits.map((_, i) => sfString(i === 0 ? id : `${id}-${i + 1}`));
  const identifiers = typeof identifier === "string" ? named(identifier) : names;
  // A decision lists its limits by name (over a server, the 8 tightest of more): each one's
  // identifier is found by its name, never by its place.
  const position = new Map(limits.map((l, i) => [l.name, i]));
  return (decision, index, key, request) => {
    const out: Record<string, string> = {};
    const binding = decision.limits[index]!;
    if (standard === "ietf") ietfFields(decision, policies, out);
    else if (standard === "draft-6") draft6Headers(binding, out);
    else if (standard === "draft-7") draft7Headers(binding, out);
    else if (standard === "draft-8") {
      const ids = typeof identifier === "function" ? named(identifier(request)) : identifiers;
      draft8Headers(decision, decision.limits.map((l) => ids[position.get(l.name) ?? 0]!), key, out);
    }
    if (legacy) legacyHeaders(binding, decision.at, out);
    if (!decision.ok) out["Retry-After"] = String(seconds(decision.retryAfter));
    return out;
  };
}

/** The header writer of a middleware that writes no header set (`standardHeaders: false`
 *  without `legacyHeaders`): a refusal has no `Retry-After` either. */
const writesNone: Middleware<unknown>["headers"] = () => ({});

/** The IETF fields of a middleware of one limit, `name` (`ietfFields`' answer for one limit,
 *  with `Retry-After` on a refusal). Its policy is found once: in process it is known when the
 *  middleware is made, over a server from the first answer with fields. */
function ietfOfOne<Req>(name: string, policies: Map<string, Policy>): Middleware<Req>["headers"] {
  // The policy's member, and its name as `RateLimit` starts with it.
  let found: { member: string; status: string } | undefined;
  return (decision): Record<string, string> => {
    if (found === undefined) {
      const policy = policies.get(name);
      if (policy !== undefined) found = { member: policy.member, status: `${policy.quoted};r=` };
    }
    const l = decision.limits[0]!;
    if (found === undefined || Number.isNaN(l.resetAfter) || Number.isNaN(l.remaining)) {
      return decision.ok ? {} : { "Retry-After": String(seconds(decision.retryAfter)) };
    }
    const status = `${found.status}${Math.max(0, Math.floor(l.remaining))};t=${Math.max(0, Math.ceil(l.resetAfter / 1_000))}`;
    if (decision.ok) return { "RateLimit-Policy": found.member, RateLimit: status };
    return { "RateLimit-Policy": found.member, RateLimit: status, "Retry-After": String(seconds(decision.retryAfter)) };
  };
}

/** What each limit takes of a request, by name (1 unless its `count` says). */
function countsOf(limits: ReadonlyArray<{ name: string; count?: number }>): Map<string, number> {
  return new Map(limits.map((l) => [l.name, l.count ?? 1]));
}

/**
 * The index in `decision.limits` of the limit that binds a decision: on a refusal, the one
 * that names it (`refusedBy`: the refusal that waits longest, as the 429's body and
 * `Retry-After` say), else the one that refused (fewer tokens left than the request takes)
 * and is full again last; on a grant, the one with the fewest tokens left, the first of
 * equals. `countOf`: what each limit takes, by name.
 */
export function bindingOf(decision: Decision, countOf: ReadonlyMap<string, number>): number {
  if (decision.limits.length === 1) return 0;
  if (!decision.ok && decision.refusedBy !== undefined) {
    const named = decision.limits.findIndex((l) => l.name === decision.refusedBy);
    if (named >= 0) return named;
  }
  let best = 0;
  decision.limits.forEach((l, i) => {
    const b = decision.limits[best]!;
    if (decision.ok) {
      if (l.remaining < b.remaining) best = i;
      return;
    }
    const refuses = (j: number) => decision.limits[j]!.remaining < (countOf.get(decision.limits[j]!.name) ?? 1);
    if (refuses(i) && (!refuses(best) || l.resetAfter > b.resetAfter)) best = i;
  });
  return best;
}

/** The path a server listens on, if `socket` is a connection to a unix socket's server. */
export function socketPath(socket: unknown): string | undefined {
  const address = (socket as { server?: { address?(): unknown } } | undefined)?.server?.address?.();
  return typeof address === "string" ? address : undefined;
}

/**
 * The "ip" key behind a proxy on a unix socket: no request has a peer address there, so
 * every one would be refused as having no key, 400, as if the clients were at fault. It is
 * the server's configuration instead: said once in the log, with the fix, and each request
 * answered 500. (Falling back to one key for all, as slowapi's 127.0.0.1 does, would make a
 * per-client limit one limit for everyone without a word.)
 */
function unixSocketOf(label: string, framework: Framework): (socket: unknown) => Verdict | undefined {
  let said = false;
  const body = json({ error: `${label}: no peer address on a unix socket; the server's log says how to key it.` });
  return (socket) => {
    const path = socketPath(socket);
    if (path === undefined) return undefined;
    if (!said) {
      said = true;
      console.error(
        `tollgate: ${label[0]!.toLowerCase()}${label.slice(1)} is keyed by the client's IP address ("ip", the default), but this server listens on ` +
          `a unix socket (${path}), where requests have no peer address: each is answered 500. Behind a proxy that sets ` +
          `X-Forwarded-For, let the framework read it (${framework.trustProxy}), or give the middleware a key of its own ` +
          `(key: { header: "x-forwarded-for" } or a function of the request).`,
      );
    }
    return { pass: false, status: 500, headers: {}, body };
  };
}

/** The 503 answers' bodies: what a client is told of a store that failed, and no more. */
const UNAVAILABLE = {
  true: json({ error: "rate limit store unavailable", mayHaveTaken: true }),
  false: json({ error: "rate limit store unavailable", mayHaveTaken: false }),
};

/** The least time between two warnings of the default `onStoreError`. */
const WARN_EVERY_MS = 10_000;
let warned = { at: -Infinity, since: 0 };

/** The default `onStoreError`: one `console.warn` line per `WARN_EVERY_MS` at most, for the
 *  whole process, counting the failures it left out. */
function warn(error: Error): void {
  const now = Date.now();
  if (now - warned.at < WARN_EVERY_MS) {
    warned.since++;
    return;
  }
  const left = warned.since === 0 ? "" : ` (and ${warned.since} more since the last warning)`;
  warned = { at: now, since: 0 };
  console.warn(`tollgate: the rate limit store failed, requests answered 503${left}: ${error.message}`);
}

/** The middleware's limits as transaction requests (checked once, at setup). */
function limitsOf(limits: LimitRef | LimitRef[]): Array<{ name: string; count?: number }> {
  const list = (Array.isArray(limits) ? limits : [limits]).map((l) =>
    typeof l === "string" ? { name: l } : { name: l?.name, ...(l?.count === undefined ? {} : { count: l.count }) },
  );
  if (list.length === 0 || list.some((l) => typeof l.name !== "string" || l.name === "")) {
    throw new TypeError("limits: give at least one limit name");
  }
  for (const l of list) {
    if (l.count !== undefined && (typeof l.count !== "number" || !Number.isFinite(l.count))) {
      throw new TypeError(`limits: ${l.name}'s count must be a finite number; got ${String(l.count)}`);
    }
  }
  return list;
}

function json(body: unknown): string {
  return JSON.stringify(body);
}

/**
 * Takes `requests` through `transaction` with the header fields, read back from them (so
 * `remaining` is whole and the times whole seconds, as the fields write them): for a caller
 * with a config of its own (`TollgateStore`); the middleware takes through `Middleware.take`.
 */
export async function decisionOf(limiter: Transacting, requests: ReadonlyArray<TransactionRequest<string>>): Promise<Decision> {
  return decisionOfAnswer(await limiter.transaction(requests, { fields: true }), requests, new Map());
}

/** The answer of a request that passes untouched (skipped, or a store that failed with
 *  `passOnStoreError`): nothing written. */
const UNTOUCHED: Verdict = Object.freeze({ pass: true, status: 200, headers: Object.freeze({}) }) as Verdict;

/** Whether `value` is a promise or another thenable, as `await` would take it. */
function isThenable<T>(value: T | PromiseLike<T>): value is PromiseLike<T> {
  return typeof (value as PromiseLike<T> | undefined)?.then === "function";
}

/** Takes the request's limits and says how to answer it. Not an `async` function: where the
 *  options, the key and the decision are at hand (a key from the request, the memory store, a
 *  lease), the verdict is made without a turn of the microtask queue per step. */
export function decide<Req, Res>(m: Middleware<Req, Res>, request: Req, response: Res, view: RequestView): Promise<Verdict> {
  try {
    if (m.skip !== undefined) {
      const skipped = m.skip(request, response);
      if (isThenable(skipped)) return Promise.resolve(skipped).then((s) => (s ? UNTOUCHED : unskipped(m, request, view)));
      if (skipped) return Promise.resolve(UNTOUCHED);
    }
    return unskipped(m, request, view);
  } catch (e) {
    return Promise.reject(e);
  }
}

/** `decide` past `skip`. */
function unskipped<Req, Res>(m: Middleware<Req, Res>, request: Req, view: RequestView): Promise<Verdict> {
  const key = m.key(request, view);
  if (isThenable(key)) return Promise.resolve(key).then((k) => keyed(m, request, view, k));
  return keyed(m, request, view, key);
}

/** `decide` once the key is known. */
function keyed<Req, Res>(m: Middleware<Req, Res>, request: Req, view: RequestView, key: Key): Promise<Verdict> {
  if (key === undefined || key === null || key === "") {
    return Promise.resolve((m.unixSocket && view.ip === undefined && m.unixSocket(view.socket)) || { pass: false, status: 400, headers: {}, body: m.noKey });
  }
  if (key !== GLOBAL && typeof key !== "string") {
    return Promise.reject(new TypeError(`${m.label}: the key function returned ${String(key)}, not a string`));
  }
  const given = key === GLOBAL ? undefined : (key as string);
  if (m.allow !== undefined) {
    const allowed = m.allow(request, given);
    if (isThenable(allowed)) return Promise.resolve(allowed).then((a) => (a ? UNTOUCHED : admitted(m, request, given)));
    if (allowed) return Promise.resolve(UNTOUCHED);
  }
  return admitted(m, request, given);
}

/** `decide` once the request is to be taken: a slot of its concurrency limit, if any, then
 *  its limits. */
function admitted<Req, Res>(m: Middleware<Req, Res>, request: Req, given: string | undefined): Promise<Verdict> {
  return m.slots === undefined ? taken(m, request, given) : slotted(m, m.slots, request, given);
}

/**
 * `decide` with a concurrency limit: its slot acquired first, so that a request it refuses
 * takes nothing of the limits; then the limits taken, and the slot released at once unless
 * the request passes (refused by the limits, their store failed, an error), so that no
 * answer but a pass leaves it held. A pass carries the `release` its framework calls when
 * the response is over. (Taking both in one transaction, all or nothing, waits for the
 * transactions of acquires: issue 60.)
 */
async function slotted<Req, Res>(m: Middleware<Req, Res>, slots: Slots, request: Req, given: string | undefined): Promise<Verdict> {
  let acquired: { ok: true; ticket: string } | { ok: false; retryAfter: number };
  try {
    acquired = await m.limiter.acquire!(slots.name, { key: given, count: slots.count, ttl: slots.ttl });
  } catch (e) {
    if (e instanceof TollgateError && e.status === 404) {
      m.undefinedName(slots.name);
      return { pass: false, status: 500, headers: {}, body: json({ error: `Concurrency limit ${slots.name} is not defined.` }) };
    }
    return failed(m, request, e);
  }
  if (!acquired.ok) return busy(slots, acquired.retryAfter);
  const release = releaser(m, slots.name, acquired.ticket, given, request);
  let verdict: Verdict;
  try {
    verdict = await taken(m, request, given);
  } catch (e) {
    release();
    throw e;
  }
  if (!verdict.pass) {
    release();
    return verdict;
  }
  // UNTOUCHED is shared (a store that failed, with passOnStoreError): a verdict of its own.
  return verdict === UNTOUCHED ? { pass: true, status: 200, headers: {}, release } : Object.assign(verdict, { release });
}

/** The answer to a request its concurrency limit refused: `concurrencyStatusCode`, with
 *  `Retry-After` (whole seconds, up) and tollgate's refusal body. */
function busy(slots: Slots, retryAfter: number): Verdict {
  return {
    pass: false,
    status: slots.status,
    headers: slots.retryAfter ? { "Retry-After": String(seconds(retryAfter)) } : {},
    body: json({ kind: "RateLimited", name: slots.name, retryAfter }),
    limited: true,
    busy: true,
  };
}

/** Lets the slots of `ticket` go, at the first call only; a release that fails is told to
 *  `onStoreError` (the slots are free at their ttl). */
function releaser<Req, Res>(m: Middleware<Req, Res>, name: string, ticket: string, key: string | undefined, request: Req): () => void {
  let held = true;
  return () => {
    if (!held) return;
    held = false;
    try {
      m.limiter.release!(name, ticket, key === undefined ? undefined : { key }).catch((e: unknown) => tell(m, e, request));
    } catch (e) {
      tell(m, e, request);
    }
  };
}

/** `decide` once the request is to be taken: its limits taken for `given`. */
function taken<Req, Res>(m: Middleware<Req, Res>, request: Req, given: string | undefined): Promise<Verdict> {
  let decision: Decision | Promise<Decision>;
  try {
    decision = m.take(given);
  } catch (e) {
    return new Promise((resolve) => resolve(failed(m, request, e)));
  }
  if (decision instanceof Promise) {
    return decision.then(
      (d) => verdictOf(m, d, given, request),
      (e: unknown) => failed(m, request, e),
    );
  }
  return Promise.resolve(verdictOf(m, decision, given, request));
}

/** The answer to a request whose limits were not taken because of `e`. */
function failed<Req, Res>(m: Middleware<Req, Res>, request: Req, e: unknown): Verdict {
  // A limit the server does not define (or, from an older server, its 404): the app's
  // configuration, said in the log; not the client's fault.
  const name =
    e instanceof NotDefined
      ? e.limit
      : e instanceof TollgateError && e.status === 404
        ? (m.limits.find((l) => e.message.includes(`Rate limit ${l.name} `))?.name ?? m.limits[0]!.name)
        : undefined;
  if (name !== undefined) {
    m.undefinedName(name);
    return { pass: false, status: 500, headers: {}, body: json({ error: `Rate limit ${name} is not defined.` }) };
  }
  if (e instanceof Misplaced) {
    // The slots a transaction acquired for it go at once, not at their ttl.
    for (const held of e.held) releaser(m, held.name, held.ticket, e.key, request)();
    m.undefinedName(e.limit, true);
    return { pass: false, status: 500, headers: {}, body: json({ error: `Concurrency limit ${e.limit} is given as a rate limit.` }) };
  }
  // The limiter's checks refused the request's key (a lone surrogate, say): the request's
  // own fault, answered 400 like a key that is missing; nothing was taken.
  if (e instanceof TypeError) return { pass: false, status: 400, headers: {}, body: json({ error: e.message }) };
  if (e instanceof TollgateError && e.status !== undefined && e.status < 500 && e.status !== 429) {
    return { pass: false, status: e.status, headers: {}, body: json({ error: e.message }) };
  }
  const mayHaveTaken = e instanceof TollgateError ? e.mayHaveTaken : true;
  tell(m, e, request);
  if (m.passOnStoreError) return UNTOUCHED;
  return { pass: false, status: 503, headers: {}, body: UNAVAILABLE[`${mayHaveTaken}`] };
}

/** The answer to a request whose limits decided `decision`. */
function verdictOf<Req, Res>(m: Middleware<Req, Res>, decision: Decision, given: string | undefined, request: Req): Verdict {
  // No numbers (a limit granted because the store failed and it fails open): no fields, no
  // info, nothing to give back.
  let known = decision.limits.length > 0;
  for (const l of decision.limits) if (Number.isNaN(l.remaining)) known = false;
  const binding = known ? bindingOf(decision, m.countOf) : 0;
  const headers = known ? m.headers(decision, binding, given, request) : {};
  const info = known ? infoOf(decision, binding, given) : undefined;
  if (decision.ok) {
    return { pass: true, status: 200, headers, info, settle: known && m.giveBack ? settler(m, decision, given, request) : undefined };
  }
  const name = decision.refusedBy ?? decision.limits[binding]?.name ?? m.limits[0]!.name;
  return {
    pass: false,
    status: m.statusCode,
    headers,
    body: json({ kind: "RateLimited", name, retryAfter: decision.retryAfter }),
    info,
    limited: true,
  };
}

/** Tells `onStoreError` of `e`; a logger that throws does not change the answer. */
function tell<Req>(m: Middleware<Req, never> | Middleware<Req, unknown>, e: unknown, request: Req): void {
  try {
    m.onStoreError(e instanceof Error ? e : new Error(String(e)), request);
  } catch {
    // Nothing: the answer stands.
  }
}

/** `req.rateLimit` of a decision: the binding limit's numbers, and every limit's. */
function infoOf(decision: Decision, binding: number, key: string | undefined): RateLimitInfo {
  const l = decision.limits[binding]!;
  return new Info(l.limit, Math.floor(l.remaining), decision.at + l.resetAfter, key, decision.limits);
}

/** `Info`'s own fields that are not `RateLimitInfo`'s: keyed by symbols, which JSON and
 *  `Object.keys` leave out. */
const RESET_AT = Symbol("resetAt");
const RESET_TIME = Symbol("resetTime");

/**
 * A `RateLimitInfo`, as the middleware makes it for each request: its numbers are plain
 * fields, and `resetTime` is a getter of the class that makes its `Date` at the first read
 * (the same `Date` at each read after): a `Date` made for every request cost about a tenth of
 * the decision on the memory store (BENCHMARKS.md), and most handlers never read it. A getter
 * of the class, not of each object: an accessor defined on each object made the decision more
 * than twice as slow. The time it says is the decision's: when the binding limit is full again,
 * counted from when its tokens were taken (`Decision.at`). `JSON.stringify` and
 * `util.inspect` show `resetTime` with the other fields; a copy by spread or `Object.assign`
 * does not have it (copy it by name).
 */
class Info implements RateLimitInfo {
  // Each field is set by the constructor alone (declared, not defined first as undefined).
  declare limit: number;
  declare used: number;
  declare remaining: number;
  declare key: string | undefined;
  declare limits: LimitStatus[];
  /** `resetTime` in ms since the Unix epoch. */
  declare [RESET_AT]: number;
  /** `resetTime` once read (or set). */
  declare [RESET_TIME]: Date | undefined;

  constructor(limit: number, remaining: number, resetAt: number, key: string | undefined, limits: LimitStatus[]) {
    this.limit = limit;
    this.used = Math.max(0, limit - remaining);
    this.remaining = remaining;
    this.key = key;
    this.limits = limits;
    this[RESET_AT] = resetAt;
    this[RESET_TIME] = undefined;
  }

  get resetTime(): Date {
    return (this[RESET_TIME] ??= new Date(this[RESET_AT]));
  }

  set resetTime(value: Date) {
    this[RESET_TIME] = value;
  }

  /** Every field, `resetTime` included, in the order of `RateLimitInfo`. */
  toJSON(): RateLimitInfo {
    return { limit: this.limit, used: this.used, remaining: this.remaining, resetTime: this.resetTime, key: this.key, limits: this.limits };
  }

  [Symbol.for("nodejs.util.inspect.custom")](): RateLimitInfo {
    return this.toJSON();
  }
}

/**
 * What gives a passed request's tokens back once its response is over, if the options say
 * so for how it ended (`skipFailedRequests`, `skipSuccessfulRequests`): each limit is
 * `adjust`ed by minus what was taken, at most once. A limit whose state was full again by
 * then (its window ended) gets nothing: a token given back to the next window would admit
 * one more than it holds.
 */
function settler<Req, Res>(
  m: Middleware<Req, Res>,
  decision: Decision,
  key: string | undefined,
  request: Req,
): (successful: boolean) => void {
  const at = Date.now();
  let settled = false;
  return (successful) => {
    if (settled) return;
    settled = true;
    if (!(successful ? m.giveBack!.successful : m.giveBack!.failed)) return;
    const now = Date.now();
    for (const l of m.limits) {
      // By name: over a server, a decision of more than 8 limits lists the tightest 8, and a
      // limit it does not list gets nothing back (less given back, never more).
      const status = decision.limits.find((d) => d.name === l.name);
      if (status === undefined || now >= at + status.resetAfter) continue;
      const count = -(m.countOf.get(l.name) ?? 1);
      const options = key === undefined ? { count } : { key, count };
      m.limiter.adjust(l.name, options).catch((e: unknown) => tell(m, e, request));
    }
  };
}

/** A refusal's body and its content type: `message`'s for the request (a string as text, an
 *  object as JSON), or tollgate's JSON. */
export async function refusalBody<Req>(
  m: Middleware<Req, never> | Middleware<Req, unknown>,
  request: Req,
  verdict: Verdict,
): Promise<{ body: string; type: string }> {
  if (m.message === undefined || !verdict.limited) return { body: verdict.body ?? "", type: "application/json" };
  const message = await m.message(request);
  return typeof message === "string"
    ? { body: message, type: "text/plain; charset=utf-8" }
    : { body: json(message), type: "application/json" };
}

/** Node's response, as Express gives it and Fastify's `reply.raw`. */
export interface NodeResponse {
  readonly statusCode: number;
  readonly writableEnded: boolean;
  readonly writableFinished: boolean;
  readonly destroyed: boolean;
  once(event: "finish" | "close", listener: () => void): unknown;
}

/**
 * Calls `release` once `response` is over: at its `finish` (written whole: sent by the
 * handler, early or late, by an error handler or a timeout) or its `close` (the connection
 * gone first, a client that left), whichever comes first; at once if it is over already (the
 * client left while the slot was being acquired: neither event would come again).
 */
export function releaseWhenOver(release: () => void, response: NodeResponse): void {
  if (response.writableFinished || response.destroyed) return release();
  response.once("finish", release);
  response.once("close", release);
}

/**
 * Calls `settle` once `response` is over: with whether it succeeded when it finished
 * (`successful`, default its status below 400), with false when the connection closed
 * before it was written whole, as express-rate-limit counts a failed request. At once if it
 * is over already (the client left, or another middleware answered, while the limits were
 * taken): neither event would come again, and its tokens were never given back.
 */
export function settleWhenOver<Req, Res>(
  verdict: Verdict,
  response: NodeResponse,
  request: Req,
  res: Res,
  successful: ((request: Req, response: Res) => boolean | Promise<boolean>) | undefined,
): void {
  const settle = verdict.settle;
  if (settle === undefined) return;
  const finished = () => {
    if (successful === undefined) return settle(response.statusCode < 400);
    Promise.resolve()
      .then(() => successful(request, res))
      .then(settle, () => settle(false));
  };
  if (response.writableFinished) return finished();
  if (response.destroyed) return settle(false);
  response.once("finish", finished);
  response.once("close", () => {
    if (!response.writableEnded) settle(false);
  });
}

/** The most members each IETF field lists (as the engine's, crates/server/src/fields.rs). */
const MAX_MEMBERS = 8;
/** The most bytes each IETF field may take (as the engine's). */
const MAX_FIELD_BYTES = 1024;

/**
 * `RateLimit-Policy` and `RateLimit` of `decision`, as the engine writes them
 * (crates/server/src/fields.rs): every limit when they fit, else the tightest that fit;
 * none when a limit's numbers are not known. Written into `out`.
 */
function ietfFields(decision: Decision, policies: Map<string, Policy>, out: Record<string, string>): void {
  const limits = decision.limits;
  const members: Array<{ policy: Policy; status: string; left: number }> = [];
  for (const l of limits) {
    const policy = policies.get(l.name);
    const status = policy && statusMember(policy, l);
    if (status === undefined) return;
    members.push({ policy: policy!, status, left: l.remaining / policy!.capacity });
  }
  if (members.length === 0) return;
  if (members.length === 1) {
    out["RateLimit-Policy"] = members[0]!.policy.member;
    out["RateLimit"] = members[0]!.status;
    return;
  }
  const bytes = (i: number): [number, number] => [members[i]!.policy.member.length + 2, members[i]!.status.length + 2];
  let kept = members.map((_, i) => i);
  const [p, s] = kept.map(bytes).reduce(([p, s], [dp, ds]) => [p + dp, s + ds], [0, 0]);
  if (members.length > MAX_MEMBERS || Math.max(p, s) > MAX_FIELD_BYTES + 2) {
    // The least left of capacity first (a refused limit has 0 left), then the order given;
    // the first always fits.
    kept.sort((a, b) => members[a]!.left - members[b]!.left || a - b);
    const chosen: number[] = [];
    let [cp, cs] = [0, 0];
    for (const i of kept) {
      if (chosen.length === MAX_MEMBERS) break;
      const [dp, ds] = bytes(i);
      if (chosen.length > 0 && Math.max(cp + dp, cs + ds) > MAX_FIELD_BYTES + 2) continue;
      [cp, cs] = [cp + dp, cs + ds];
      chosen.push(i);
    }
    kept = chosen.sort((a, b) => a - b);
  }
  out["RateLimit-Policy"] = kept.map((i) => members[i]!.policy.member).join(", ");
  out["RateLimit"] = kept.map((i) => members[i]!.status).join(", ");
}

/** A limit's member of `RateLimit`: `"name";r=<tokens left, down>;t=<s until full, up>`;
 *  undefined when its numbers are not known. */
function statusMember(policy: Policy, l: LimitStatus): string | undefined {
  if (Number.isNaN(l.remaining) || Number.isNaN(l.resetAfter)) return undefined;
  return `${policy.quoted};r=${Math.max(0, Math.floor(l.remaining))};t=${Math.max(0, Math.ceil(l.resetAfter / 1_000))}`;
}

/** A limit the server does not define, found at a middleware's first request. */
class NotDefined extends TypeError {
  constructor(
    message: string,
    /** The name not defined. */
    readonly limit: string,
  ) {
    super(message);
  }
}

/**
 * A concurrency limit among a middleware's `limits`, over a server: found when the server's
 * limits were read, or by the ticket of its slot in a transaction's answer (a server reloaded
 * to make the name a concurrency limit, a limiter whose limits cannot be read), with the
 * tickets to release (`held`) and the key they were acquired with.
 */
class Misplaced extends TypeError {
  constructor(
    /** The concurrency limit's name. */
    readonly limit: string,
    readonly held: ReadonlyArray<{ name: string; ticket: string }> = [],
    readonly key?: string,
  ) {
    super(concurrencyInLimits(limit));
  }
}

/** What is said of a concurrency limit named in a middleware's `limits` (in process, by the
 *  TypeError thrown when the middleware is made). */
export function concurrencyInLimits(name: string): string {
  return `limits: ${JSON.stringify(name)} is a concurrency limit: give it as \`concurrency\`, not in \`limits\``;
}

/** `member`'s name as the fields quote it: the part before its `;q=`. */
export function policyOf(member: string, capacity: number): Policy {
  return { member, quoted: member.slice(0, member.lastIndexOf(";q=")), capacity };
}

/**
 * A door's `Taking` through its transaction with header fields: a server's, or any
 * `Transacting`. The names are checked against the server's limits (`GET /v1/config`) at
 * the first request rather than when the middleware is made: making one is synchronous
 * (`app.use(rateLimit(...))`), and the server may not be up yet when the app starts. An
 * undefined name is the app's error at each request (500, with the names the server
 * defines); the check is made again a second later, as the server's config may be reloaded.
 * So is a concurrency limit among the names (`Misplaced`); should an answer carry a slot's
 * ticket all the same (the server's config reloaded since the check, a limiter whose limits
 * cannot be read), the request fails with it, for the slot to be released at once
 * (`failed`), and the names are checked again a second later.
 * The numbers are those of the answer's header fields: whole tokens and seconds, and of more
 * than 8 limits the tightest.
 */
function transactionTaking(limiter: Transacting, limits: ReadonlyArray<{ name: string; count?: number }>): Taking {
  const policies = new Map<string, Policy>();
  const capacities = new Map<string, number>();
  let checked: { done: boolean; at: number; error?: NotDefined | Misplaced; pending?: Promise<void> } = { done: false, at: -Infinity };
  const check = async (): Promise<void> => {
    const defined = await limiter.getServerLimits!();
    const missing = limits.find((l) => !Object.hasOwn(defined, l.name));
    if (missing !== undefined) {
      const names = Object.keys(defined);
      throw new NotDefined(
        `rate limit ${JSON.stringify(missing.name)} is not defined by the server; it defines ${names.length === 0 ? "none" : names.map((n) => JSON.stringify(n)).join(", ")}`,
        missing.name,
      );
    }
    const slots = limits.find((l) => isConcurrency(defined, l.name));
    if (slots !== undefined) throw new Misplaced(slots.name);
    for (const l of limits) {
      const capacity = (defined[l.name] as { capacity?: unknown }).capacity;
      if (typeof capacity === "number") capacities.set(l.name, capacity);
    }
  };
  const resolved = async (): Promise<void> => {
    if (checked.done) return;
    if (checked.error !== undefined && Date.now() - checked.at < 1_000) throw checked.error;
    if (typeof limiter.getServerLimits !== "function") return;
    checked.pending ??= check().then(
      () => void (checked = { done: true, at: Date.now() }),
      (e: unknown) => {
        // The server not reached: the transaction says so; checked at the next request.
        checked =
          e instanceof NotDefined || e instanceof Misplaced ? { done: false, at: Date.now(), error: e } : { done: false, at: -Infinity };
      },
    );
    await checked.pending;
    if (checked.error !== undefined) throw checked.error;
  };
  const take = async (key: string | undefined): Promise<Decision> => {
    await resolved();
    const requests = key === undefined ? limits : limits.map((l) => ({ ...l, key }));
    const result = await limiter.transaction(requests, { fields: true });
    const held = result.results.flatMap((r, i) => (r.ticket === undefined ? [] : [{ name: limits[i]!.name, ticket: r.ticket }]));
    if (held.length > 0) {
      // Every request fails until the names are checked again, a second from now.
      checked = { done: false, at: Date.now(), error: new Misplaced(held[0]!.name) };
      throw new Misplaced(held[0]!.name, held, key);
    }
    return decisionOfAnswer(result, limits, policies, capacities);
  };
  return { take, policies };
}

/** A transaction's result with its header fields as a `Decision`; the policies of the
 *  fields into `policies`. */
export function decisionOfAnswer(
  result: TransactionResult,
  limits: ReadonlyArray<{ name: string }>,
  policies: Map<string, Policy>,
  capacities?: Map<string, number>,
): Decision {
  const listed = new Map<string, LimitStatus>();
  const fields = result.fields ?? {};
  const members = (field: string | undefined) => (field === undefined ? [] : sfMembers(field));
  const statuses = new Map(members(fields["ratelimit"]).map((m) => [m.name, m]));
  for (const m of members(fields["ratelimit-policy"])) {
    const status = statuses.get(m.name);
    const q = Number(m.params.q);
    if (!policies.has(m.name)) policies.set(m.name, policyOf(m.text, capacities?.get(m.name) ?? q));
    if (status === undefined) continue;
    listed.set(m.name, {
      name: m.name,
      limit: capacities?.get(m.name) ?? q,
      remaining: Number(status.params.r),
      resetAfter: Number(status.params.t) * 1_000,
      window: Number(m.params.w) * 1_000,
    });
  }
  const decision: Decision = { ok: result.ok, retryAfter: 0, limits: [], at: Date.now() };
  for (const l of limits) {
    const status = listed.get(l.name);
    if (status !== undefined) decision.limits.push(status);
  }
  if (!result.ok) {
    // The refusal that waits longest names the answer, as the tower layer's does.
    let refusing = -1;
    result.results.forEach((r, i) => {
      if (!r.ok && (refusing < 0 || (r.retryAfter ?? 0) > (result.results[refusing]!.retryAfter ?? 0))) refusing = i;
    });
    const wait = refusing < 0 ? undefined : result.results[refusing]!.retryAfter;
    decision.retryAfter = wait ?? result.retryAfter ?? 0;
    decision.refusedBy = limits[Math.max(refusing, 0)]!.name;
  }
  return decision;
}

/** The members of a structured field's list of strings with parameters
 *  (`"a";q=10;w=60, "b";r=1;t=6`): each member's name (unescaped), its parameters and its
 *  text as written. */
function sfMembers(field: string): Array<{ name: string; params: Record<string, string>; text: string }> {
  const out: Array<{ name: string; params: Record<string, string>; text: string }> = [];
  let i = 0;
  while (i < field.length) {
    while (field[i] === " " || field[i] === ",") i++;
    if (field[i] !== '"') break;
    const start = i;
    let name = "";
    for (i++; i < field.length && field[i] !== '"'; i++) name += field[i] === "\\" ? field[++i] : field[i];
    i++;
    const params: Record<string, string> = {};
    while (field[i] === ";") {
      const end = [field.indexOf(";", i + 1), field.indexOf(",", i + 1)].filter((e) => e >= 0);
      const stop = end.length === 0 ? field.length : Math.min(...end);
      const [k, v] = field.slice(i + 1, stop).split("=");
      params[k!.trim()] = (v ?? "").trim();
      i = stop;
    }
    out.push({ name, params, text: field.slice(start, i) });
  }
  return out;
}
