// What every framework's middleware decides, whatever the framework: the request's key, its
// limits taken all or nothing, and the answer's status, header fields and body, written as
// tollgate's tower layer writes them (crates/tollgate/src/tower): `RateLimit-Policy` and
// `RateLimit` on every answer, `429` with `Retry-After` in whole seconds and
// `{"kind": "RateLimited", "name", "retryAfter"}` on a refusal, `503 {"error": "rate limit
// store unavailable", "mayHaveTaken"}` when the store fails (fail closed; the store's message
// goes to `onStoreError`, never to the client), `400 {"error"}` without a key. Every
// option is checked and resolved once, when the middleware is made (`middleware`), its limits
// included: an in-process limiter takes them through a function of the addon made for the
// middleware (no JSON), a server's through its transaction. A request pays for its key, the
// take and the answer's fields.

import { TollgateError, type RateLimitConfig, type TransactionOptions, type TransactionRequest, type TransactionResult } from "tollgate-client";

import { ipKey, ipv6SubnetOf } from "./ip.js";

export { ipKey } from "./ip.js";

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

/** What the middleware needs of a limiter: in-process (`{ store }`) or a server's (`{ url }`). */
export interface Transacting {
  transaction(requests: ReadonlyArray<TransactionRequest<string>>, options?: TransactionOptions): Promise<TransactionResult>;
  /** A server's limits, to check the middleware's names against. */
  getServerLimits?(): Promise<Record<string, RateLimitConfig>>;
  [taking]?(limits: ReadonlyArray<{ name: string; count?: number }>): Taking | undefined;
}

/** One limit a request takes from: its name, or its name and how many tokens. */
export type LimitRef = string | { name: string; count?: number };

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

/** The options every middleware takes. */
export interface MiddlewareOptions<Req> {
  /** The limiter the limits are taken from. */
  limiter: Transacting;
  /** One limit or several, taken all or nothing: if one refuses, none is taken. */
  limits: LimitRef | LimitRef[];
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
   * Told each failure of the store that made a request's answer a 503, with the request: the
   * store's own message (which may name its host, user or database) goes here, never into the
   * answer's body. Default: `console.warn`, at most one line per 10 seconds for all the
   * middleware of the process (the line counts those left out), so an outage never floods
   * the log. Give your logger's function instead (`(error, req) => req.log.warn(error)`).
   */
  onStoreError?: (error: Error, request: Req) => void;
}

/** What the middleware answers: pass on (with `headers` on the answer), or answer itself. */
export interface Verdict {
  /** Whether the request goes on to its handler. */
  pass: boolean;
  /** 429, 503 or 400 when it does not pass. */
  status: number;
  /** Header fields to set, in the case the tower layer writes them. */
  headers: Record<string, string>;
  /** The JSON body of the middleware's own answer. */
  body?: string;
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
 *  address from a proxy's X-Forwarded-For (for the message of a unix socket). */
export interface Framework {
  trustProxy: string;
}

/** A request's key: a string, `GLOBAL` for the one shared value, anything else if the
 *  request has none. */
type Key = unknown;

/** The key of `"global"`: no key in the transaction (a key function's null is no key). */
const GLOBAL = Symbol("global");

/** A middleware's options, checked and resolved: what each request needs, and nothing more. */
export interface Middleware<Req> {
  limiter: Transacting;
  limits: Array<{ name: string; count?: number }>;
  /** Takes the limits for a key. */
  take: Take;
  /** The limits' policies, by name, for the IETF fields. */
  policies: Map<string, Policy>;
  key(request: Req, view: RequestView): Key | Promise<Key>;
  /** The 400 answer's body for a request without a key. */
  noKey: string;
  onStoreError(error: Error, request: Req): void;
  /** For the "ip" key: what to do with a request that came through a unix socket, where no
   *  request has a peer address (undefined for the other keys). */
  unixSocket?: (socket: unknown) => Verdict | undefined;
}

/** Checks `options` and resolves them for `decide`; throws a `TypeError` for a bad one. */
export function middleware<Req>(options: MiddlewareOptions<Req>, framework: Framework): Middleware<Req> {
  const limits = limitsOf(options.limits);
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
  const noKey = json({ error: `Rate limit ${limits[0]!.name}: ${what}.` });
  const onStoreError = options.onStoreError ?? warn;
  if (typeof onStoreError !== "function") {
    throw new TypeError(`onStoreError must be a function of (error, request); got ${String(onStoreError)}`);
  }
  const unixSocket = source === "ip" ? unixSocketOf(limits[0]!.name, framework) : undefined;
  const limiter = options.limiter;
  // In-process: the limiter checks the names now (a TypeError), and takes without JSON.
  const { take, policies } = limiter?.[taking]?.(limits) ?? transactionTaking(limiter, limits);
  return { limiter, limits, take, policies, key, noKey, onStoreError, unixSocket };
}

/** The path a server listens on, if `socket` is a connection to a unix socket's server. */
function socketPath(socket: unknown): string | undefined {
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
function unixSocketOf(name: string, framework: Framework): (socket: unknown) => Verdict | undefined {
  let said = false;
  const body = json({ error: `Rate limit ${name}: no peer address on a unix socket; the server's log says how to key it.` });
  return (socket) => {
    const path = socketPath(socket);
    if (path === undefined) return undefined;
    if (!said) {
      said = true;
      console.error(
        `tollgate: rate limit ${name} is keyed by the client's IP address ("ip", the default), but this server listens on ` +
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

/** Takes the request's limits and says how to answer it. Not an `async` function: where
 *  the key and the decision are at hand (a key from the request, the memory store, a lease),
 *  the verdict is made without a turn of the microtask queue per step. */
export function decide<Req>(m: Middleware<Req>, request: Req, view: RequestView): Promise<Verdict> {
  let key: Key | Promise<Key>;
  try {
    key = m.key(request, view);
  } catch (e) {
    return Promise.reject(e);
  }
  // A key function's promise, or any thenable, as `await` would take it.
  if (typeof (key as PromiseLike<Key> | undefined)?.then === "function") {
    return Promise.resolve(key as PromiseLike<Key>).then((k) => keyed(m, request, view, k));
  }
  return keyed(m, request, view, key);
}

/** `decide` once the key is known. */
function keyed<Req>(m: Middleware<Req>, request: Req, view: RequestView, key: Key): Promise<Verdict> {
  if (key === undefined || key === null || key === "") {
    return Promise.resolve((m.unixSocket && view.ip === undefined && m.unixSocket(view.socket)) || { pass: false, status: 400, headers: {}, body: m.noKey });
  }
  if (key !== GLOBAL && typeof key !== "string") {
    return Promise.reject(new TypeError(`Rate limit ${m.limits[0]!.name}: the key function returned ${String(key)}, not a string`));
  }
  let decision: Decision | Promise<Decision>;
  try {
    decision = m.take(key === GLOBAL ? undefined : (key as string));
  } catch (e) {
    return new Promise((resolve) => resolve(failed(m, request, e)));
  }
  if (decision instanceof Promise) return decision.then((d) => verdictOf(m, d), (e: unknown) => failed(m, request, e));
  return Promise.resolve(verdictOf(m, decision));
}

/** The answer to a request whose limits were not taken because of `e`; throws `e` when it
 *  is the app's error. */
function failed<Req>(m: Middleware<Req>, request: Req, e: unknown): Verdict {
  // A limit the server does not define: the app's configuration, not the request's fault.
  if (e instanceof NotDefined) throw e;
  // The limiter's checks refused the request's key (a lone surrogate, say): the request's
  // own fault, answered 400 like a key that is missing; nothing was taken.
  if (e instanceof TypeError) return { pass: false, status: 400, headers: {}, body: json({ error: e.message }) };
  if (e instanceof TollgateError && e.status !== undefined && e.status < 500 && e.status !== 429) {
    return { pass: false, status: e.status, headers: {}, body: json({ error: e.message }) };
  }
  const mayHaveTaken = e instanceof TollgateError ? e.mayHaveTaken : true;
  try {
    m.onStoreError(e instanceof Error ? e : new Error(String(e)), request);
  } catch {
    // A logger that throws does not change the answer.
  }
  return { pass: false, status: 503, headers: {}, body: UNAVAILABLE[`${mayHaveTaken}`] };
}

/** The answer to a request whose limits decided `decision`. */
function verdictOf<Req>(m: Middleware<Req>, decision: Decision): Verdict {
  const headers = ietfFields(decision, m.policies);
  if (decision.ok) return { pass: true, status: 200, headers };
  const retryAfter = decision.retryAfter;
  headers["Retry-After"] = String(Math.max(0, Math.ceil(retryAfter / 1_000)));
  return {
    pass: false,
    status: 429,
    headers,
    body: json({ kind: "RateLimited", name: decision.refusedBy ?? m.limits[0]!.name, retryAfter }),
  };
}

/** The most members each IETF field lists (as the engine's, crates/server/src/fields.rs). */
const MAX_MEMBERS = 8;
/** The most bytes each IETF field may take (as the engine's). */
const MAX_FIELD_BYTES = 1024;

/**
 * `RateLimit-Policy` and `RateLimit` of `decision`, as the engine writes them
 * (crates/server/src/fields.rs): every limit when they fit, else the tightest that fit;
 * none when a limit's numbers are not known.
 */
function ietfFields(decision: Decision, policies: Map<string, Policy>): Record<string, string> {
  const limits = decision.limits;
  if (limits.length === 1) {
    // The usual middleware: one limit.
    const policy = policies.get(limits[0]!.name);
    const status = policy && statusMember(policy, limits[0]!);
    return status === undefined ? {} : { "RateLimit-Policy": policy!.member, RateLimit: status };
  }
  const members: Array<{ policy: Policy; status: string; left: number }> = [];
  for (const l of limits) {
    const policy = policies.get(l.name);
    const status = policy && statusMember(policy, l);
    if (status === undefined) return {};
    members.push({ policy: policy!, status, left: l.remaining / policy!.capacity });
  }
  if (members.length === 0) return {};
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
  return {
    "RateLimit-Policy": kept.map((i) => members[i]!.policy.member).join(", "),
    RateLimit: kept.map((i) => members[i]!.status).join(", "),
  };
}

/** A limit's member of `RateLimit`: `"name";r=<tokens left, down>;t=<s until full, up>`;
 *  undefined when its numbers are not known. */
function statusMember(policy: Policy, l: LimitStatus): string | undefined {
  if (Number.isNaN(l.remaining) || Number.isNaN(l.resetAfter)) return undefined;
  return `${policy.quoted};r=${Math.max(0, Math.floor(l.remaining))};t=${Math.max(0, Math.ceil(l.resetAfter / 1_000))}`;
}

/** A limit the server does not define, found at a middleware's first request. */
class NotDefined extends TypeError {}

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
 * The numbers are those of the answer's header fields: whole tokens and seconds, and of more
 * than 8 limits the tightest.
 */
function transactionTaking(limiter: Transacting, limits: ReadonlyArray<{ name: string; count?: number }>): Taking {
  const policies = new Map<string, Policy>();
  const capacities = new Map<string, number>();
  let checked: { done: boolean; at: number; error?: NotDefined; pending?: Promise<void> } = { done: false, at: -Infinity };
  const check = async (): Promise<void> => {
    const defined = await limiter.getServerLimits!();
    const missing = limits.find((l) => !Object.hasOwn(defined, l.name));
    if (missing !== undefined) {
      const names = Object.keys(defined);
      throw new NotDefined(
        `rate limit ${JSON.stringify(missing.name)} is not defined by the server; it defines ${names.length === 0 ? "none" : names.map((n) => JSON.stringify(n)).join(", ")}`,
      );
    }
    for (const l of limits) {
      const capacity = (defined[l.name] as { capacity?: unknown }).capacity;
      if (typeof capacity === "number") capacities.set(l.name, capacity);
    }
  };
  const resolved = async (): Promise<void> => {
    if (checked.done || typeof limiter.getServerLimits !== "function") return;
    if (checked.error !== undefined && Date.now() - checked.at < 1_000) throw checked.error;
    checked.pending ??= check().then(
      () => void (checked = { done: true, at: Date.now() }),
      (e: unknown) => {
        // The server not reached: the transaction says so; checked at the next request.
        checked = e instanceof NotDefined ? { done: false, at: Date.now(), error: e } : { done: false, at: -Infinity };
      },
    );
    await checked.pending;
    if (checked.error !== undefined) throw checked.error;
  };
  const take = async (key: string | undefined): Promise<Decision> => {
    await resolved();
    const requests = key === undefined ? limits : limits.map((l) => ({ ...l, key }));
    const result = await limiter.transaction(requests, { fields: true });
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
  const decision: Decision = { ok: result.ok, retryAfter: 0, limits: [] };
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
