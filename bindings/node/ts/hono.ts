// Hono: a middleware taking a request's limits (ts/middleware.ts).

import { decide, middleware, type MiddlewareOptions } from "./middleware.js";

export { ipKey } from "./middleware.js";
export type { KeySource, LimitRef, MiddlewareOptions } from "./middleware.js";

/** The parts of Hono's context the middleware uses. */
interface HonoContext {
  /** Whether the context holds its response already (a timeout middleware answered). */
  finalized: boolean;
  req: { header(name: string): string | undefined };
  env?: unknown;
  header(name: string, value: string): void;
  body(data: string, status: number, headers: Record<string, string>): Response;
}

/** The peer's address on @hono/node-server (its `incoming` request); elsewhere give `ip`. */
function nodeIp(c: HonoContext): string | undefined {
  const env = c.env as { incoming?: { socket?: { remoteAddress?: string } } } | undefined;
  return env?.incoming?.socket?.remoteAddress;
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
  const m = middleware(options);
  return async (c, next) => {
    const ip = options.ip ? options.ip(c) : nodeIp(c);
    const verdict = await decide(m, c, { ip, header: (name) => c.req.header(name) });
    // Answered while the limits were taken (hono/timeout answered first): the decision
    // stands, and nothing more is written or run (a header set now throws).
    if (c.finalized) return undefined;
    if (!verdict.pass) {
      return c.body(verdict.body ?? "", verdict.status, { ...verdict.headers, "content-type": "application/json" });
    }
    for (const [name, value] of Object.entries(verdict.headers)) c.header(name, value);
    await next();
    return undefined;
  };
}
