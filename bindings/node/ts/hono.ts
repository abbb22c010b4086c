// Hono: a middleware taking a request's limits (ts/middleware.ts).

import { decide, middleware, type MiddlewareOptions } from "./middleware.js";

export { ipKey } from "./middleware.js";
export type { KeySource, LimitRef, MiddlewareOptions } from "./middleware.js";

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

/** The connection of a request on @hono/node-server (its `incoming` request). */
function nodeSocket(c: HonoContext): { remoteAddress?: string } | undefined {
  return (c.env as { incoming?: { socket?: { remoteAddress?: string } } } | undefined)?.incoming?.socket;
}

/**
 * A middleware that takes `limits` for each request, keyed as `key` says (default: the peer's
 * address, which Hono gives per runtime: on @hono/node-server it is read here; elsewhere pass
 * `ip`, such as `(c) => getConnInfo(c).remote.address`).
 *
 * ```ts
 * app.use("/api/*", rateLimiter({ limiter, limits: "perIp" }));
 * ```
 */
export function rateLimiter<C extends HonoContext = HonoContext>(
  options: MiddlewareOptions<C> & { ip?: (c: C) => string | undefined },
): (c: C, next: () => Promise<void>) => Promise<Response | undefined> {
  const m = middleware(options, { trustProxy: 'the middleware\'s ip option: (c) => c.req.header("x-forwarded-for")' });
  return async (c, next) => {
    const socket = options.ip ? undefined : nodeSocket(c);
    const ip = options.ip ? options.ip(c) : socket?.remoteAddress;
    const verdict = await decide(m, c, { ip, header: (name) => c.req.header(name), socket });
    // Answered while the limits were taken (hono/timeout answered first): the decision
    // stands, and nothing more is written or run (a header set now throws).
    if (c.finalized) return undefined;
    if (!verdict.pass) {
      return c.body(verdict.body ?? "", verdict.status, { ...verdict.headers, "content-type": "application/json" });
    }
    for (const [name, value] of Object.entries(verdict.headers)) c.header(name, value);
    await next();
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
  };
}
