// Hono: a middleware taking a request's limits (ts/middleware.ts).

// Hono's own types, for `c.get("rateLimit")` (the augmentation below).
import type {} from "hono";

import { decide, middleware, refusalBody, type MiddlewareOptions, type RateLimitInfo, type Transacting, type Verdict } from "./middleware.js";

export { ipKey } from "./middleware.js";
export type { ConcurrencyRef, Decision, KeySource, LimitRef, LimitStatus, MiddlewareOptions, RateLimitInfo, StandardHeaders } from "./middleware.js";

declare module "hono" {
  interface ContextVariableMap {
    /** The rate limit middleware's decision (`requestPropertyName`, default `rateLimit`). */
    rateLimit: RateLimitInfo;
  }
}

/** The parts of Hono's context the middleware uses. */
interface HonoContext {
  /** Whether the context holds its response already (a timeout middleware answered). */
  finalized: boolean;
  /** The response, once the handlers made it. */
  res: Response;
  req: { header(name: string): string | undefined };
  env?: unknown;
  header(name: string, value: string): void;
  body(data: string, status: number, headers: Record<string, string>): Response;
}

/** The options of Hono's middleware: every middleware's, where the peer's address comes from,
 *  and a handler of refusals. */
export interface HonoOptions<C, Limiter extends Transacting = Transacting> extends MiddlewareOptions<C, Limiter, undefined> {
  /** The peer's address, for the `"ip"` key, on a runtime other than @hono/node-server (where
   *  it is read from the connection): `(c) => getConnInfo(c).remote.address`. */
  ip?: (c: C) => string | undefined;
  /**
   * How many proxies in front of the app append to `X-Forwarded-For` (as Express's numeric
   * `trust proxy`): the `"ip"` key is then that many addresses from its right end (the
   * address the nearest proxy saw connect), not the proxy's own. Default `false`: the
   * connection's address, whatever the header says (which any client can write).
   */
  trustProxy?: number | false;
  /** Answers a refusal by the limits instead of the middleware (`message` and `statusCode`
   *  are not used): returns the response. */
  handler?: (c: C, next: () => Promise<void>, info: RateLimitInfo) => Response | Promise<Response>;
}

/** The connection of a request on @hono/node-server (its `incoming` request). */
function nodeSocket(c: HonoContext): { remoteAddress?: string } | undefined {
  return (c.env as { incoming?: { socket?: { remoteAddress?: string } } } | undefined)?.incoming?.socket;
}

/** The client's address behind `hops` proxies: that many addresses from the right end of
 *  `X-Forwarded-For` (its leftmost when it holds fewer), or `peer` without the header. */
export function forwardedFor(header: string | undefined, hops: number, peer: string | undefined): string | undefined {
  if (header === undefined) return peer;
  const addresses = header.split(",");
  const address = addresses[Math.max(0, addresses.length - hops)]!.trim();
  return address === "" ? peer : address;
}

/**
 * A middleware that takes `limits` for each request, keyed as `key` says (default: the peer's
 * address, which Hono gives per runtime: on @hono/node-server it is read here; elsewhere pass
 * `ip`, such as `(c) => getConnInfo(c).remote.address`; behind proxies, `trustProxy`). The
 * decision is the context's variable `rateLimit` (`c.get("rateLimit")`, `requestPropertyName`).
 * With `concurrency`, a request holds a slot of it from before the limits are taken until
 * `next()` returns or throws: the handlers are done (on every runtime: Hono has no event of
 * its own for a response written; a body streamed after that is not counted).
 *
 * ```ts
 * app.use("/api/*", rateLimiter({ limiter, limits: "perIp" }));
 * app.post("/api/render", rateLimiter({ limiter, concurrency: "renders" }), render);
 * ```
 */
export function rateLimiter<C extends HonoContext = HonoContext, Limiter extends Transacting = Transacting>(
  options: HonoOptions<C, Limiter>,
): (c: C, next: () => Promise<void>) => Promise<Response | undefined> {
  const m = middleware<C, undefined>(options as MiddlewareOptions<C, Transacting, undefined>, {
    trustProxy: "the middleware's trustProxy option, the number of proxies in front of the app, or its ip option",
    options: ["ip", "trustProxy", "handler"],
  });
  const { ip: ipOf, handler } = options;
  const hops = options.trustProxy ?? false;
  if (hops !== false && !(Number.isInteger(hops) && hops >= 1)) {
    throw new TypeError(`trustProxy must be the number of proxies in front of the app (1 or more), or false; got ${String(hops)}`);
  }
  if (hops !== false && ipOf !== undefined) {
    throw new TypeError("give either ip (the peer's address as you read it) or trustProxy (read from X-Forwarded-For), not both");
  }
  for (const [name, value] of [["ip", ipOf], ["handler", handler]] as const) {
    if (value !== undefined && typeof value !== "function") throw new TypeError(`${name} must be a function of the context; got ${String(value)}`);
  }
  const successful = options.requestWasSuccessful;
  const property = m.requestPropertyName;
  return async (c, next) => {
    const socket = ipOf ? undefined : nodeSocket(c);
    const peer = ipOf ? ipOf(c) : socket?.remoteAddress;
    const ip = hops === false ? peer : forwardedFor(c.req.header("x-forwarded-for"), hops, peer);
    const verdict = await decide(m, c, undefined, { ip, header: (name) => c.req.header(name), socket: hops === false ? socket : undefined });
    if (verdict.release === undefined) return answer(c, next, verdict);
    // The slot of `concurrency` (a pass's) is released however this ends: after the
    // handlers, or at once if they are not run.
    try {
      return await answer(c, next, verdict);
    } finally {
      verdict.release?.();
    }
  };

  /** What the middleware answers for `verdict`, the handlers run if it passes. */
  async function answer(c: C, next: () => Promise<void>, verdict: Verdict): Promise<Response | undefined> {
    // Answered while the limits were taken (hono/timeout answered first): the decision
    // stands, and nothing more is written or run (a header set now throws).
    if (c.finalized) return undefined;
    if (verdict.info !== undefined) (c as unknown as { set(key: string, value: unknown): void }).set(property, verdict.info);
    if (!verdict.pass) {
      if (verdict.limited && !verdict.busy && handler !== undefined) {
        for (const [name, value] of Object.entries(verdict.headers)) c.header(name, value);
        return handler(c, next, verdict.info!);
      }
      const { body, type } = await refusalBody(m, c, verdict);
      return c.body(body, verdict.status, { ...verdict.headers, "content-type": type });
    }
    for (const [name, value] of Object.entries(verdict.headers)) c.header(name, value);
    try {
      await next();
    } catch (e) {
      verdict.settle?.(false);
      throw e;
    }
    if (verdict.settle !== undefined) {
      verdict.settle(successful === undefined ? c.res.status < 400 : await successful(c, undefined));
    }
    // A handler that returns a Response of its own (new Response(...), a fetch's) replaces
    // the one the fields were set on: they are set on it too, unless it has them.
    for (const name in verdict.headers) {
      if (c.res.headers.has(name)) continue;
      try {
        c.res.headers.set(name, verdict.headers[name]!);
      } catch {
        // Its headers are immutable (a fetch's answer): a copy of it takes them.
        c.res = new Response(c.res.body, c.res);
        c.res.headers.set(name, verdict.headers[name]!);
      }
    }
    return undefined;
  }
}
