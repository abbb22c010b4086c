// What every framework's middleware decides, whatever the framework: the request's key, its
// limits taken all or nothing, and the answer's status, header fields and body, written as
// tollgate's tower layer writes them (crates/tollgate/src/tower): `RateLimit-Policy` and
// `RateLimit` on every answer, `429` with `Retry-After` in whole seconds and
// `{"kind": "RateLimited", "name", "retryAfter"}` on a refusal, `503 {"error",
// "mayHaveTaken"}` when the store fails (fail closed), `400 {"error"}` without a key.

import { TollgateError, type TransactionOptions, type TransactionRequest, type TransactionResult } from "tollgate-client";

/** What the middleware needs of a limiter: in-process (`{ store }`) or a server's (`{ url }`). */
export interface Transacting {
  transaction(requests: ReadonlyArray<TransactionRequest<string>>, options?: TransactionOptions): Promise<TransactionResult>;
}

/** One limit a request takes from: its name, or its name and how many tokens. */
export type LimitRef = string | { name: string; count?: number };

/**
 * Where a request's key comes from: `"ip"` (the peer's address as the framework reports it;
 * behind a proxy, tell the framework to trust it), `{ header: "x-api-key" }`, `"global"` (one
 * value shared by every request), or a function of the request. A request without a key is
 * refused with 400, and nothing is taken.
 */
export type KeySource<Req> =
  | "ip"
  | "global"
  | { header: string }
  | ((request: Req) => string | undefined | Promise<string | undefined>);

/** The options every middleware takes. */
export interface MiddlewareOptions<Req> {
  /** The limiter the limits are taken from. */
  limiter: Transacting;
  /** One limit or several, taken all or nothing: if one refuses, none is taken. */
  limits: LimitRef | LimitRef[];
  /** Where the key comes from; default `"ip"`. */
  key?: KeySource<Req>;
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

/** The view of a request each framework gives: its peer address and a header by name. */
export interface RequestView {
  ip: string | undefined;
  header(name: string): string | undefined;
}

const NAMES: Record<string, string> = {
  "ratelimit-policy": "RateLimit-Policy",
  ratelimit: "RateLimit",
  "retry-after": "Retry-After",
};

/** The middleware's limits as transaction requests (checked once, at setup). */
export function limitsOf(limits: LimitRef | LimitRef[]): Array<{ name: string; count?: number }> {
  const list = (Array.isArray(limits) ? limits : [limits]).map((l) => (typeof l === "string" ? { name: l } : { ...l }));
  if (list.length === 0 || list.some((l) => typeof l.name !== "string" || l.name === "")) {
    throw new TypeError("limits: give at least one limit name");
  }
  return list;
}

/** The key of a request, or undefined when it has none. */
export async function keyOf<Req>(source: KeySource<Req>, request: Req, view: RequestView): Promise<string | undefined | null> {
  if (source === "global") return null;
  if (source === "ip") return view.ip;
  if (typeof source === "function") return source(request);
  return view.header(source.header.toLowerCase());
}

function json(body: unknown): string {
  return JSON.stringify(body);
}

/** Takes the request's limits and says how to answer it. */
export async function decide<Req>(
  options: MiddlewareOptions<Req>,
  limits: Array<{ name: string; count?: number }>,
  request: Req,
  view: RequestView,
): Promise<Verdict> {
  const key = await keyOf(options.key ?? "ip", request, view);
  if (key === undefined || key === "") {
    const what = options.key === undefined || options.key === "ip" ? "no peer address" : "no key in the request";
    return { pass: false, status: 400, headers: {}, body: json({ error: `Rate limit ${limits[0]!.name}: ${what}.` }) };
  }
  let result: TransactionResult;
  try {
    result = await options.limiter.transaction(
      limits.map((l) => ({ ...l, ...(key === null ? {} : { key }) })),
      { fields: true },
    );
  } catch (e) {
    if (e instanceof TollgateError && e.status !== undefined && e.status < 500 && e.status !== 429) {
      return { pass: false, status: e.status, headers: {}, body: json({ error: e.message }) };
    }
    const mayHaveTaken = e instanceof TollgateError ? e.mayHaveTaken : true;
    return { pass: false, status: 503, headers: {}, body: json({ error: (e as Error).message, mayHaveTaken }) };
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
    body: json({ kind: "RateLimited", name: limits[refusing]!.name, retryAfter }),
  };
}
