// What every framework's middleware decides, whatever the framework: the request's key, its
// limits taken all or nothing, and the answer's status, header fields and body, written as
// tollgate's tower layer writes them (crates/tollgate/src/tower): `RateLimit-Policy` and
// `RateLimit` on every answer, `429` with `Retry-After` in whole seconds and
// `{"kind": "RateLimited", "name", "retryAfter"}` on a refusal, `503 {"error": "rate limit
// store unavailable", "mayHaveTaken"}` when the store fails (fail closed; the store's message
// goes to `onStoreError`, never to the client), `400 {"error"}` without a key. Every
// option is checked and resolved once, when the middleware is made (`middleware`); a request
// pays for its key, the transaction and the answer's fields.

import { TollgateError, type TransactionOptions, type TransactionRequest, type TransactionResult } from "tollgate-client";

import { ipKey, ipv6SubnetOf } from "./ip.js";

export { ipKey } from "./ip.js";

/** What the middleware needs of a limiter: in-process (`{ store }`) or a server's (`{ url }`). */
export interface Transacting {
  transaction(requests: ReadonlyArray<TransactionRequest<string>>, options?: TransactionOptions): Promise<TransactionResult>;
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
  key(request: Req, view: RequestView): Key | Promise<Key>;
  /** The 400 answer's body for a request without a key. */
  noKey: string;
  onStoreError(error: Error, request: Req): void;
  /** For the "ip" key: what to do with a request that came through a unix socket, where no
   *  request has a peer address (undefined for the other keys). */
  unixSocket?: (socket: unknown) => Verdict | undefined;
}

const NAMES: Record<string, string> = {
  "ratelimit-policy": "RateLimit-Policy",
  ratelimit: "RateLimit",
  "retry-after": "Retry-After",
};

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
  return { limiter: options.limiter, limits, key, noKey, onStoreError, unixSocket };
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

/** Takes the request's limits and says how to answer it. */
export async function decide<Req>(m: Middleware<Req>, request: Req, view: RequestView): Promise<Verdict> {
  const key = await m.key(request, view);
  if (key === undefined || key === null || key === "") {
    return (m.unixSocket && view.ip === undefined && m.unixSocket(view.socket)) || { pass: false, status: 400, headers: {}, body: m.noKey };
  }
  if (key !== GLOBAL && typeof key !== "string") {
    throw new TypeError(`Rate limit ${m.limits[0]!.name}: the key function returned ${String(key)}, not a string`);
  }
  let result: TransactionResult;
  try {
    result = await m.limiter.transaction(
      m.limits.map((l) => (key === GLOBAL ? l : { ...l, key: key as string })),
      { fields: true },
    );
  } catch (e) {
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
  const headers: Record<string, string> = {};
  for (const [name, value] of Object.entries(result.fields ?? {})) headers[NAMES[name] ?? name] = value;
  if (result.ok) {
    delete headers["Retry-After"];
    return { pass: true, status: 200, headers };
  }
  // The refusal that waits longest names the answer, as the tower layer's does.
  let refusing = 0;
  result.results.forEach((r, i) => {
    const longest = result.results[refusing]!;
    if (!r.ok && (longest.ok || (r.retryAfter ?? 0) > (longest.retryAfter ?? 0))) refusing = i;
  });
  const retryAfter = result.results[refusing]!.retryAfter ?? result.retryAfter ?? 0;
  headers["Retry-After"] ??= String(Math.max(0, Math.ceil(retryAfter / 1_000)));
  return {
    pass: false,
    status: 429,
    headers,
    body: json({ kind: "RateLimited", name: m.limits[refusing]!.name, retryAfter }),
  };
}
